import numpy as np
import pytest

pytest.importorskip("ziglang")


@pytest.fixture
def rng():
    return np.random.default_rng(0)

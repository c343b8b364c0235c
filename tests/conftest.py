"""Shared pytest setup: hypothesis profiles.

"ci" (the default under CI=true) uses a fixed seed (derandomize) and bounded examples so the
whole suite stays well inside CI time on 2 cores; "dev" explores more; pick with
HYPOTHESIS_PROFILE=dev.
"""
import os

# MLX runs float32 matmul-family operations at reduced precision (TF32) on GPUs with matrix units
# unless MLX_ENABLE_TF32=0 (its "Numerical Precision" docs). The float32 limits here are
# float32's, so a GPU machine runs the suite with full float32 matmuls (set MLX_ENABLE_TF32=1 to
# run it at MLX's default instead). Set before MLX first reads it (it keeps the first value).
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx.core as mx  # noqa: E402
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", derandomize=True, max_examples=25, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=100, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def on_cpu():
    """Run a test on the CPU device: routing and fp32 tolerances as on a CPU, also on a CUDA
    machine (where "auto" picks the GPU and fp32 matmuls round through tf32)."""
    previous = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(previous)


@pytest.fixture(autouse=True)
def fresh_call_decisions():
    """Every test makes its calls' decisions anew: tests patch backend methods (unsupported_reason,
    unavailable_reason, ...) that a decision kept from an earlier test (mlx_flash/call_cache.py)
    would not see."""
    from mlx_flash import call_cache

    call_cache.forget()
    yield

"""The Metal simulator's compiler as a test requirement (mlx_flash.metalsim builds kernels with the
clang of the ziglang package)."""
import pytest

REASON = "the Metal simulator compiles kernels with the clang of the ziglang package (pip install ziglang)"


def require_metal_compiler() -> None:
    """Skip the calling test, or the whole module where called at its top level, without ziglang."""
    pytest.importorskip("ziglang", reason=REASON)

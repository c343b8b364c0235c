"""Property tests of the "mlx" backend against the float64 reference (the shared suite)."""
import mlx.core as mx
import pytest
from hypothesis import given, settings

from mlx_flash.backends import mlx_ops
from mlx_flash.spec import check_inputs

from attention_cases import Case, cases, check_case

# The "mlx" and "auto" backends against the float64 reference at the CPU's fp32 tolerance; on a
# CUDA GPU fp32 matmuls round through tf32 (the GPU kernels have their own suite, test_cuda.py).
pytestmark = pytest.mark.usefixtures("on_cpu")


# The "mlx" backend serves test-sized calls whole (MLX's autograd over one score block,
# mlx_ops.whole_function); CHUNKED runs the same calls through its chunked forward / backward.
CHUNKED = mlx_ops.MLXOpsBackend(whole_bytes=0)


@given(cases())
def test_matches_reference(case):
    check_case(case, backend="mlx")


@given(cases())
def test_chunked_path_matches_reference(case):
    check_case(case, backend=CHUNKED)


@settings(max_examples=10)
@given(cases(max_len=64, max_head_dim=64))
def test_auto_backend_matches_reference(case):
    # "auto" resolves by device; on a CPU machine without the simulator that is "mlx".
    check_case(case, backend="auto")


def test_multiple_row_chunks(monkeypatch):
    """Small blocks force many query-row chunks, band-edge masks and keyless chunks at test sizes."""
    for knob, value in (("MIN_BLOCK_BYTES", 2048), ("MAX_BLOCK_BYTES", 2048), ("ROW_ALIGN", 1),
                        ("MIN_ROWS", 3)):
        monkeypatch.setattr(mlx_ops, knob, value)
    for mask in ("none", "causal", "window", "causal_window", "bool", "additive"):
        for q_len, kv_len in ((61, 45), (45, 61), (33, 33)):
            check_case(Case(batch=2, kv_heads=2, group=2, q_len=q_len, kv_len=kv_len, head_dim=12,
                            mask=mask, window=(9, 4), softcap=5.0 if mask == "bool" else None,
                            lse_gradient=True, sinks=mask in ("causal", "window", "bool"),
                            seed=q_len * kv_len), backend=CHUNKED)
    # The test is only meaningful if the plan really splits the rows into several chunks.
    spec, _ = check_inputs(*[mx.zeros((2, 4, 61, 12))] * 3)
    assert len(mlx_ops.plan_chunks(spec)[1]) > 2

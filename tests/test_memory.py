"""Memory: forward and backward never materialize an Nq x Nk array (O(N) peak, not O(N^2))."""
import mlx.core as mx
import pytest

from mlx_flash import flash_attention

B, H, D = 1, 8, 16


def flash(mask):
    return lambda q, k, v: flash_attention(q, k, v, mask=mask)


def unfused(mask):
    return lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask=mask)


def peak_bytes(attention, n):
    """Peak memory above the inputs of one forward+backward (gradients w.r.t. q, k and v)."""
    q, k, v = (mx.random.normal((B, H, n, D), key=mx.random.key(i)) for i in range(3))
    mx.eval(q, k, v)
    grad = mx.grad(lambda q, k, v: attention(q, k, v).sum(), argnums=(0, 1, 2))
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(grad(q, k, v))
    return mx.get_peak_memory() - base


@pytest.mark.parametrize("mask", [None, "causal"])
def test_forward_backward_peak_is_a_fraction_of_one_score_matrix(mask):
    n = 4096
    one_score_matrix = B * H * n * n * 4  # a single fp32 Nq x Nk array
    ours = peak_bytes(flash(mask), n)
    theirs = peak_bytes(unfused(mask), n)
    mib = lambda x: f"{x / 2**20:.0f} MiB"
    assert ours < 0.5 * one_score_matrix, f"peak {mib(ours)} vs one N x N array {mib(one_score_matrix)}"
    assert ours < 0.25 * theirs, f"peak {mib(ours)} vs unfused {mib(theirs)}"


def test_peak_memory_grows_linearly():
    small, large = peak_bytes(flash(None), 1024), peak_bytes(flash(None), 4096)
    # 4x the length: O(N) memory grows ~4x, O(N^2) would grow 16x.
    assert large < 6 * small, f"peak {small / 2**20:.1f} MiB at N=1024, {large / 2**20:.1f} MiB at N=4096"


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_mlx_backend_peak_grows_linearly_in_each_dtype(dtype):
    """fp16 / bf16 compute in their dtype with fp32 statistics; no dtype may bring O(N^2) back."""

    def peak(n):
        q, k, v = (mx.random.normal((1, 2, n, D), key=mx.random.key(i)).astype(dtype) for i in range(3))
        mx.eval(q, k, v)
        grad = mx.grad(lambda q, k, v: flash_attention(q, k, v, backend="mlx").astype(mx.float32).sum(),
                       argnums=(0, 1, 2))
        mx.synchronize()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(grad(q, k, v))
        return mx.get_peak_memory() - base

    small, large = peak(1024), peak(4096)
    # 4x the length: O(N) memory grows ~4x, O(N^2) would grow 16x.
    assert large < 6 * small, f"{dtype}: peak {small / 2**20:.1f} MiB at N=1024, {large / 2**20:.1f} MiB at N=4096"

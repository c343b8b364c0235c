"""Memory: forward and backward never materialize an Nq x Nk array (O(N) peak, not O(N^2))."""
import mlx.core as mx
import pytest

from mlx_flash import flash_attention

# Peak-memory bounds of the "mlx" backend as the CPU frees buffers. On a CUDA GPU MLX holds a
# step's temporaries until its command buffer completes, and these bounds do not hold there
# (H100: 1.5 GB at N=4096 against 256 MiB; benchmarks/RESULTS.md, the "mlx" backend section).
pytestmark = pytest.mark.usefixtures("on_cpu")

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


def chunked(n, heads, mask):
    """Whether the "mlx" backend chunks a call of this size (small ones are served whole)."""
    from mlx_flash.backends import mlx_ops
    from mlx_flash.spec import check_inputs
    spec, _ = check_inputs(*[mx.zeros((1, heads, n, D))] * 3, mask=mask)
    return not mlx_ops.whole_function(spec)


def test_peak_memory_grows_linearly():
    # Causal: N=1024 at H=8 (32 MiB of fp32 scores) is chunked only with a band (whole_function).
    assert chunked(1024, H, "causal")
    small, large = peak_bytes(flash("causal"), 1024), peak_bytes(flash("causal"), 4096)
    # 4x the length: O(N) memory grows ~4x, O(N^2) would grow 16x.
    assert large < 6 * small, f"peak {small / 2**20:.1f} MiB at N=1024, {large / 2**20:.1f} MiB at N=4096"


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_mlx_backend_peak_grows_linearly_in_each_dtype(dtype):
    """fp16 / bf16 compute in their dtype with fp32 statistics; no dtype may bring O(N^2) back.
    The chunked path (small calls are served whole, at MLX's memory)."""
    from mlx_flash.backends import mlx_ops
    CHUNKED = mlx_ops.MLXOpsBackend(whole_bytes=0)

    def peak(n):
        q, k, v = (mx.random.normal((1, 2, n, D), key=mx.random.key(i)).astype(dtype) for i in range(3))
        mx.eval(q, k, v)
        grad = mx.grad(lambda q, k, v: flash_attention(q, k, v, backend=CHUNKED).astype(mx.float32).sum(),
                       argnums=(0, 1, 2))
        mx.synchronize()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(grad(q, k, v))
        return mx.get_peak_memory() - base

    small, large = peak(1024), peak(4096)
    # 4x the length: O(N) memory grows ~4x, O(N^2) would grow 16x.
    assert large < 6 * small, f"{dtype}: peak {small / 2**20:.1f} MiB at N=1024, {large / 2**20:.1f} MiB at N=4096"


def test_chunk_plan_follows_the_problem_and_the_device():
    from mlx_flash.backends import mlx_ops
    from mlx_flash.spec import check_inputs

    def plan(n, heads=16, memory=80 << 30, mask=None):
        spec, _ = check_inputs(*[mx.zeros((1, heads, n, 8))] * 3, mask=mask)
        return mlx_ops.plan_chunks(spec, memory)[1]

    def rows(chunks):
        return [q1 - q0 for q0, q1, _, _ in chunks]

    assert rows(plan(256, heads=2)) == [256]                     # small: the whole score matrix
    assert rows(plan(1024, heads=4)) == [256] * 4                # 16 MiB: the 4 MiB floor
    assert set(rows(plan(2048))) == {64}                           # the CPU's blocks: 64 rows x keys
    assert set(rows(plan(4096))) == {64}
    assert set(rows(plan(16384, memory=8 << 30))) == {64}         # 32 MiB floor, then 64 rows minimum
    gpu = lambda n, memory=80 << 30: mlx_ops.score_block_bytes(
        check_inputs(*[mx.zeros((1, 16, n, 8))] * 3)[0], memory, "gpu")
    assert gpu(4096) == 4 * 16 * 4096 * 4096 // 2                  # the GPU's: 1/2 of the scores
    assert gpu(16384) == (80 << 30) // 128                          # ... within 1/128 of the memory
    causal = plan(4096, mask="causal")
    assert rows(causal)[0] > rows(causal)[-1] == 64               # narrow causal chunks are taller
    assert all(k1 == q1 and k0 == 0 for _, q1, k0, k1 in causal)  # each sees exactly its keys
    for n in (1000, 3000, 5000):
        chunks = plan(n)
        assert chunks[0][0] == 0 and chunks[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
        assert all((q1 - q0) % 64 == 0 for q0, q1, _, _ in chunks[:-1])


def test_small_calls_are_served_whole_at_mlx_memory():
    """Up to 32 MiB of fp32 scores (and on the CPU, under a causal mask, 8 MiB) the "mlx" backend is
    MLX's unfused graph under MLX's own VJP: the memory of mx.fast (unfused on the CPU), not more."""
    from mlx_flash.backends import mlx_ops
    from mlx_flash.spec import check_inputs

    def whole(n, heads=8, mask=None, device_type="cpu"):
        spec, _ = check_inputs(*[mx.zeros((1, heads, n, D))] * 3, mask=mask)
        return mlx_ops.whole_function(spec, device_type=device_type)

    assert whole(1024) and not whole(1025) and not whole(2048)
    assert whole(512, mask="causal") and not whole(1024, mask="causal")
    assert whole(1024, mask="causal", device_type="gpu")          # a GPU: one launch sequence
    assert not whole(0) and not whole(1024, heads=9)
    ours, theirs = peak_bytes(flash(None), 1024), peak_bytes(unfused(None), 1024)
    assert ours <= 1.02 * theirs, f"peak {ours / 2**20:.1f} MiB vs mx.fast {theirs / 2**20:.1f} MiB"


def test_gpu_score_blocks_follow_their_own_fraction():
    """The GPU's score blocks are 1/2 of the score matrix and the CPU's 64 query rows (mlx_ops.SCORE_FRACTIONS,
    BLOCK_ROWS: measured on an H100, where smaller blocks were slower and bound the peak only under a
    memory limit)."""
    from mlx_flash.backends import mlx_ops
    from mlx_flash.spec import check_inputs
    spec, _ = check_inputs(*[mx.zeros((1, 16, 2048, 64), mx.bfloat16)] * 3)
    whole = 4 * 16 * 2048 * 2048
    memory = 80 << 30
    assert mlx_ops.score_block_bytes(spec, memory, "cpu") == whole // 32
    assert mlx_ops.score_block_bytes(spec, memory, "gpu") == whole // 2


def test_chunk_plan_follows_mlx_memory_limit():
    """A lower mx.set_memory_limit is the budget the "mlx" backend plans with (smaller score blocks)."""
    from mlx_flash.backends import budget, mlx_ops
    from mlx_flash.spec import check_inputs
    spec, _ = check_inputs(*[mx.zeros((1, 8, 16384, 64))] * 3)
    device = mx.default_device()
    unlimited = budget.memory_budget_bytes(device)
    before = mlx_ops.score_block_bytes(spec, unlimited)
    previous = mx.set_memory_limit(unlimited // 4)
    try:
        assert budget.memory_budget_bytes(device) == unlimited // 4
        after = mlx_ops.score_block_bytes(spec, budget.memory_budget_bytes(device))
    finally:
        mx.set_memory_limit(previous)
    assert budget.memory_budget_bytes(device) == unlimited
    assert after < before or before == mlx_ops.MIN_BLOCK_BYTES, (after, before)
    assert after >= mlx_ops.MIN_BLOCK_BYTES

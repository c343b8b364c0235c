"""The "cuda" backend against the float64 reference, on an NVIDIA GPU and on the CPU emulator.

The emulator tests (test_emulated_*) run the same kernels through mlx_flash.backends.cuda_emulator
on any machine with a host C++ compiler: every warp layout (4 / 8 warps, 1 / 2 / 4 column groups),
both cp.async completion orders (deferred to the wait, eager) and both CTA orders. The GPU tests
are skipped (with the reason) where MLX has no CUDA device. They cover the shared property suite (hypothesis over shapes, dtypes, masks, softcap, GQA, lse cotangents) at a
bounded set of head dims (each distinct head dim / flag set compiles new kernels), explicit
edge cases (D = 1..512 incl. odd and prime sizes, primes for N, rows with no visible key,
broadcast masks), GPU-sized cases (N up to 16K) against the "mlx" backend in fp32 on a subset
of rows, bitwise determinism of the gradients, and the float32 fallback being counted.
"""
import math
import os

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings

from attention_cases import Case, cases, check_case, make_arrays, relative_error, to_numpy

from mlx_flash import fallback_counts, flash_attention, planner, reset_fallback_counts  # noqa: E402
from mlx_flash.backends import cuda, cuda_emulator, get_backend  # noqa: E402
from mlx_flash.spec import check_inputs  # noqa: E402

HAS_GPU = hasattr(mx, "cuda") and mx.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU: mx.cuda.is_available() is False "
                                              "(MLX CPU/Metal build or no NVIDIA device)")
emulator = pytest.mark.skipif(cuda_emulator.compiler() is None, reason="no host C++ compiler for the CUDA emulator")

# (case, warp layout it exercises with the current blocks_cuda.txt)
EMULATED_CASES = [
    (Case(head_dim=64, q_len=150, kv_len=140, dtype="bfloat16", mask="causal", group=2, batch=2),
     "4 warps x 2 m-tiles, block-major CTA order"),
    (Case(head_dim=160, q_len=140, kv_len=170, dtype="float16", mask="bool", mask_shape=(False, True, True, True),
          softcap=5.0, lse_gradient=True), "8 warps, dK/dV with 2 column groups sharing P/dS"),
    (Case(head_dim=320, q_len=61, kv_len=67, dtype="bfloat16", mask="causal_window", window=(20, 3), group=3),
     "forward and dQ with 2 column groups, dK/dV with 4"),
]


@emulator
@pytest.mark.parametrize("eager_copies", [False, True], ids=["deferred-copies", "eager-copies"])
@pytest.mark.parametrize("case,layout", EMULATED_CASES, ids=lambda x: x if isinstance(x, str) else f"d{x.head_dim}")
def test_emulated_kernels(case, layout, eager_copies):
    """The kernels' logic on the CPU emulator (no GPU needed) against the float64 reference."""
    with cuda_emulator.emulated(seed=case.q_len + int(eager_copies), eager_copies=eager_copies):
        check_case(case, backend="cuda")


# Attention sinks: the forward's initial row state and the dQ kernel's per-warp parts of d_sink,
# with column groups and slices (only warps of column group 0 / slice 0 write parts), GQA and
# rows that see no key (causal with Nq > Nk: the sink takes all the probability).
EMULATED_SINK_CASES = [
    Case(head_dim=320, q_len=61, kv_len=67, dtype="bfloat16", mask="causal_window", window=(20, 3), group=3,
         sinks=True, lse_gradient=True),
    Case(head_dim=48, q_len=150, kv_len=40, dtype="float16", mask="causal", batch=2, kv_heads=2, sinks=True,
         lse_gradient=True),
]


@emulator
@pytest.mark.parametrize("case", EMULATED_SINK_CASES, ids=lambda c: f"d{c.head_dim}-{c.mask}")
def test_emulated_sinks(case):
    with cuda_emulator.emulated(seed=case.q_len):
        errors = check_case(case, backend="cuda")
    assert "d_sinks" in errors


@pytest.mark.parametrize("kernel", ["forward", "backward_query", "backward_key_value"])
@pytest.mark.parametrize("wgmma", [False, True], ids=["mma", "wgmma"])
def test_sinks_kernel_signature(kernel, wgmma, monkeypatch):
    """Sinks compile into the forward and dQ kernels (a sinks input; dQ writes d_sinks_part); the
    dK/dV kernel is the one without sinks (the forward's lse includes them)."""
    monkeypatch.setattr(cuda, "WGMMA_FORWARD_OVERRIDE", wgmma)
    monkeypatch.setattr(cuda, "WGMMA_BACKWARD_OVERRIDE", wgmma)
    q = mx.zeros((1, 2, 8, 64), mx.bfloat16)
    plain = cuda.kernel_config(kernel, check_inputs(q, q, q, mask="causal")[0], None)
    config = cuda.kernel_config(kernel, check_inputs(q, q, q, mask="causal", sinks=mx.zeros((2,), mx.bfloat16))[0], None)
    header, body, inputs, outputs = cuda.kernel_source(config)
    if kernel == "backward_key_value":
        assert config == plain
        return
    assert config.sinks and config.name != plain.name
    assert "constexpr bool SINKS = true;" in header and "sinks" in inputs
    assert ("d_sinks_part" in outputs) == (kernel == "backward_query")
    plain_body = cuda.kernel_source(plain)[1]
    assert "nullptr" in plain_body and "constexpr bool SINKS = false;" in cuda.kernel_source(plain)[0]


def _block_orders_agree():
    """Head-major and block-major CTA orders compute bitwise the same (only the schedule differs)."""
    case = Case(batch=2, kv_heads=2, group=2, q_len=140, kv_len=150, head_dim=64, dtype="bfloat16", mask="causal")
    results = []
    for block_major in (False, True):
        cuda.BLOCK_MAJOR_OVERRIDE = block_major
        try:
            results.append(_out_and_grads(case))
        finally:
            cuda.BLOCK_MAJOR_OVERRIDE = None
    for x, y in zip(*results):
        assert np.array_equal(x, y)


@emulator
def test_emulated_block_orders_agree():
    with cuda_emulator.emulated(seed=3):
        _block_orders_agree()


@gpu
def test_block_orders_agree():
    _block_orders_agree()


def _out_and_grads(case):
    a = make_arrays(case)

    def f(q_, k_, v_, sinks_=None):
        o = flash_attention(q_, k_, v_, mask=a.mask, sinks=sinks_, backend="cuda", **a.kwargs)
        return (o.astype(mx.float32) * a.d_out.astype(mx.float32)).sum(), o

    primals = (a.q, a.k, a.v) + (() if a.sinks is None else (a.sinks,))
    (_, out), g = mx.value_and_grad(f, argnums=tuple(range(len(primals))))(*primals)
    mx.eval(out, g)
    return [np.array(x.astype(mx.float32)) for x in (out, *g)]

# Head dims the property test samples from (bounds the number of compiled kernel variants).
PROPERTY_HEAD_DIMS = [8, 37, 64, 80, 128, 160, 256]
HALF_DTYPES = ("float16", "bfloat16")


# MLX_FLASH_CUDA_EXAMPLES trims the property suite where device time is short (default 40).


@gpu
@settings(max_examples=int(os.environ.get("MLX_FLASH_CUDA_EXAMPLES", "40")))
@given(cases(max_len=200, dtypes=HALF_DTYPES, head_dims=PROPERTY_HEAD_DIMS))
def test_property_suite(case):
    check_case(case, backend="cuda")


EDGE_CASES = [
    Case(head_dim=1, q_len=1, kv_len=1, dtype="bfloat16"),
    Case(head_dim=3, q_len=17, kv_len=5, dtype="float16", mask="causal"),  # Nq > Nk: rows see no key
    Case(head_dim=64, q_len=127, kv_len=131, dtype="bfloat16", mask="causal", group=4, kv_heads=2),
    Case(head_dim=72, q_len=131, kv_len=257, dtype="float16", mask="window", window=(17, 3)),
    Case(head_dim=96, q_len=64, kv_len=64, dtype="bfloat16", softcap=5.0, lse_gradient=True),
    Case(head_dim=128, q_len=257, kv_len=65, dtype="bfloat16", mask="bool", mask_shape=(False, True, True, True), batch=2),
    Case(head_dim=131, q_len=70, kv_len=300, dtype="float16", mask="additive", mask_shape=(True, False, False, True), batch=2),
    Case(head_dim=192, q_len=97, kv_len=97, dtype="bfloat16", mask="causal_window", window=(20, -1), group=2),
    Case(head_dim=200, q_len=33, kv_len=190, dtype="float16", softcap=30.0, mask="bool", mask_shape=(True, True, False, True)),
    Case(head_dim=256, q_len=129, kv_len=129, dtype="bfloat16", mask="causal", lse_gradient=True),
    Case(head_dim=320, q_len=61, kv_len=67, dtype="float16", group=3),
    Case(head_dim=509, q_len=40, kv_len=53, dtype="bfloat16", mask="additive"),
    Case(head_dim=512, q_len=130, kv_len=70, dtype="float16", mask="causal", group=2, kv_heads=2),
]


@gpu
@pytest.mark.parametrize("case", EDGE_CASES, ids=lambda c: f"d{c.head_dim}-{c.dtype}-{c.mask}-{c.q_len}x{c.kv_len}")
def test_edge_cases(case):
    check_case(case, backend="cuda")


def _rows_subset_error(out, ref, rows):
    return relative_error(to_numpy(out)[..., rows, :], to_numpy(ref)[..., rows, :].astype(np.float64))


@gpu
@pytest.mark.parametrize("n,d,causal", [(4096, 64, True), (16384, 128, False), (16384, 128, True), (4099, 256, True)])
def test_large_against_mlx_fp32(n, d, causal):
    """GPU-sized problems: compare with the blocked "mlx" backend run in fp32 on the same inputs."""
    rng = np.random.default_rng(n + d)
    B, H = 1, 2
    q, k, v, do = (mx.array(rng.standard_normal((B, H, n, d)).astype(np.float32)) for _ in range(4))
    mask = "causal" if causal else None

    def loss(backend, dtype):
        def f(q_, k_, v_):
            o = flash_attention(q_.astype(dtype), k_.astype(dtype), v_.astype(dtype), mask=mask, backend=backend)
            return (o.astype(mx.float32) * do).sum(), o
        return mx.value_and_grad(f, argnums=(0, 1, 2))

    (_, out), grads = loss("cuda", mx.bfloat16)(q, k, v)
    # The fp32 reference sees the same bf16-rounded inputs.
    qr, kr, vr = (x.astype(mx.bfloat16).astype(mx.float32) for x in (q, k, v))
    (_, ref_out), ref_grads = loss("mlx", mx.float32)(qr, kr, vr)
    mx.eval(out, grads, ref_out, ref_grads)
    rows = np.r_[0:64, n // 2:n // 2 + 64, n - 64:n]
    assert _rows_subset_error(out, ref_out, rows) < 2e-2
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        err = _rows_subset_error(g, r, rows)
        assert err < 5e-2, f"{name}: relative error {err}"


@gpu
def test_gradients_bitwise_deterministic():
    case = Case(batch=2, kv_heads=2, group=4, q_len=333, kv_len=517, head_dim=128, dtype="bfloat16", mask="causal")
    a = make_arrays(case)

    def grads():
        def f(q_, k_, v_):
            return (flash_attention(q_, k_, v_, mask=a.mask, backend="cuda").astype(mx.float32) * a.d_out.astype(mx.float32)).sum()
        g = mx.grad(f, argnums=(0, 1, 2))(a.q, a.k, a.v)
        mx.eval(g)
        return [np.array(x.astype(mx.float32)) for x in g]

    first, second = grads(), grads()
    for x, y in zip(first, second):
        assert np.array_equal(x, y)


@gpu
def test_many_heads_past_grid_y_limit():
    """B * H = 70000 blocks: the launch must not rely on grid y holding B * H."""
    rng = np.random.default_rng(1)
    q, k, v = (mx.array(rng.standard_normal((70000, 1, 16, 16)).astype(np.float32)).astype(mx.float16) for _ in range(3))
    out = flash_attention(q, k, v, backend="cuda")
    ref = flash_attention(q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32), backend="mlx")
    assert relative_error(to_numpy(out), to_numpy(ref).astype(np.float64)) < 4e-3


@gpu
def test_float32_falls_back_counted():
    reset_fallback_counts()
    q = mx.random.normal((1, 2, 32, 64))
    with pytest.warns(UserWarning):
        out = flash_attention(q, q, q, backend="cuda")
    mx.eval(out)
    assert any("float32" in reason for reason in fallback_counts())


@gpu
def test_backward_kernels_separately_match_backward():
    case = Case(batch=1, kv_heads=2, group=2, q_len=200, kv_len=150, head_dim=64, dtype="bfloat16", mask="causal")
    a = make_arrays(case)
    spec, mask4 = check_inputs(a.q, a.k, a.v, mask=a.mask)
    backend = get_backend("cuda")
    out, lse = backend.forward(a.q, a.k, a.v, mask4, spec)
    dq, dk, dv, d_sinks = backend.backward(a.q, a.k, a.v, mask4, out, lse, a.d_out, None, spec)
    assert d_sinks is None
    dq2 = backend.backward_query(a.q, a.k, a.v, mask4, out, lse, a.d_out, None, spec)
    dk2, dv2 = backend.backward_key_value(a.q, a.k, a.v, mask4, out, lse, a.d_out, None, spec)
    for x, y in ((dq, dq2), (dk, dk2), (dv, dv2)):
        assert np.array_equal(to_numpy(x), to_numpy(y))
    assert math.isfinite(float(mx.abs(dq.astype(mx.float32)).sum()))


# ----------------------------------------------------------------------------- wgmma forward
def test_wgmma_ops_header_matches_its_generator():
    import importlib.util
    path = os.path.join(os.path.dirname(cuda.__file__), "..", "kernels", "wgmma_generate.py")
    spec = importlib.util.spec_from_file_location("wgmma_generate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with open(module.PATH) as f:
        assert f.read() == module.generate(), "kernels/wgmma_ops.cuh is stale: run python kernels/wgmma_generate.py"


WGMMA_RENDER_CASES = [(kernel, head_dim) for kernel, dims in (
    ("forward", [1, 37, 64, 80, 128, 160, 200, 256]),
    ("backward_query", [1, 37, 64, 80, 128, 160, 256]),
    ("backward_key_value", [1, 37, 64, 80, 128, 144, 160, 176, 200, 256])) for head_dim in dims]


@pytest.mark.parametrize("kernel,head_dim", WGMMA_RENDER_CASES, ids=lambda x: str(x))
def test_wgmma_config_renders(kernel, head_dim, monkeypatch):
    monkeypatch.setattr(cuda, "WGMMA_FORWARD_OVERRIDE", True)
    monkeypatch.setattr(cuda, "WGMMA_BACKWARD_OVERRIDE", True)
    q = mx.zeros((1, 2, 8, head_dim), mx.bfloat16)
    spec, _ = check_inputs(q, q, q, mask="causal")
    config = cuda.kernel_config(kernel, spec, None)
    assert config.instruction == "wgmma"
    assert config.parallel_block == 64 * (config.warps // 4) // config.col_groups
    assert config.padded_dim % 16 == 0 and config.padded_dim >= head_dim
    assert config.shared_memory <= cuda.SHARED_MEMORY_LIMIT
    header, body, inputs, outputs = cuda.kernel_source(config)
    assert f"attention_{kernel}_wgmma(" in body
    assert outputs == {"forward": ["out", "lse"], "backward_query": ["dq"], "backward_key_value": ["dk", "dv"]}[kernel]
    assert f"static_assert(SMEM_BYTES <= {config.shared_memory}," in header  # the template's layout fits the launch
    assert f"struct Wgmma<{config.slice_width}, __nv_bfloat16>" in header
    assert f"struct Wgmma<{config.traversal_block}, __nv_bfloat16>" in header
    # dK/dV past the table row's H (<= 160): 128-column CTAs (slices, P = 128) or both consumer
    # warpgroups on 64 keys, 128 columns each (column groups, P = 64), as the table says; the
    # other kernels hold all of D in each warpgroup
    row = planner.plan("cuda", kernel, head_dim, mx.bfloat16, cuda.WGMMA_FAMILY)
    wide = kernel == "backward_key_value" and config.padded_dim > cuda._round_up(row.head_block, 16)
    assert wide == (config.slices * config.col_groups > 1)
    assert config.slices * config.col_groups * config.slice_width >= config.padded_dim
    assert ("constexpr int CG = 2;" in header) == (config.col_groups == 2)
    if not wide:
        assert config.slices == config.col_groups == 1 and config.slice_width == config.padded_dim
        assert config.padded_dim <= (cuda.WGMMA_WHOLE_MAX_COLUMNS if kernel == "backward_key_value" else 256)
        return
    for block, slices, col_groups in ((128, -(-config.padded_dim // 128), 1), (64, 1, 2)):
        monkeypatch.setitem(cuda.BLOCK_OVERRIDES, kernel + "_wgmma", (block, 64, 128, 8))
        scheme = cuda.kernel_config(kernel, spec, None)
        assert (scheme.parallel_block, scheme.slices, scheme.col_groups) == (block, slices, col_groups)
        assert scheme.shared_memory <= cuda.SHARED_MEMORY_LIMIT
        assert f"static_assert(SMEM_BYTES <= {scheme.shared_memory}," in cuda.kernel_source(scheme)[0]
    # All of D in one warpgroup (H >= D) holds up to WGMMA_WHOLE_MAX_COLUMNS; past it a clear error.
    monkeypatch.setitem(cuda.BLOCK_OVERRIDES, kernel + "_wgmma", (128, 32, config.padded_dim, 8))
    if config.padded_dim <= cuda.WGMMA_WHOLE_MAX_COLUMNS:
        whole = cuda.kernel_config(kernel, spec, None)
        assert (whole.slices, whole.col_groups, whole.slice_width) == (1, 1, config.padded_dim)
        assert f"static_assert(SMEM_BYTES <= {whole.shared_memory}," in cuda.kernel_source(whole)[0]
    else:
        with pytest.raises(ValueError, match="all of D up to 160"):
            cuda.kernel_config(kernel, spec, None)
    monkeypatch.setitem(cuda.BLOCK_OVERRIDES, kernel + "_wgmma", (128, 32, 96, 8))  # a split needs H = 128
    with pytest.raises(ValueError, match="H must be 128"):
        cuda.kernel_config(kernel, spec, None)


def test_wgmma_not_chosen_off_hopper(monkeypatch):
    q = mx.zeros((1, 1, 8, 128), mx.float16)
    spec, _ = check_inputs(q, q, q)
    for kernel in ("forward", "backward_query", "backward_key_value"):
        for capability, expected in ((None, False), (80, False), (90, True), (100, False)):
            monkeypatch.setattr(cuda, "compute_capability", lambda c=capability: c)
            assert cuda.use_wgmma(kernel, spec) is expected, (kernel, capability)
    monkeypatch.setattr(cuda, "compute_capability", lambda: 90)
    for head_dim, expected in ((1, True), (64, True), (128, True), (129, True), (256, True), (257, False),
                               (320, False)):
        x = mx.zeros((1, 1, 8, head_dim), mx.float16)
        spec = check_inputs(x, x, x)[0]
        for kernel in ("forward", "backward_query", "backward_key_value"):  # wgmma N <= 256
            assert cuda.use_wgmma(kernel, spec) is expected, (kernel, head_dim)


def test_kernel_config_cache_follows_gpu_and_hooks(monkeypatch):
    """kernel_config is cached per call; the GPU and the tuning hooks are part of the key."""
    q = mx.zeros((1, 2, 8, 64), mx.bfloat16)
    spec, _ = check_inputs(q, q, q)
    seen = []
    for capability, override in ((90, None), (80, None), (90, None), (90, False), (90, None)):
        monkeypatch.setattr(cuda, "compute_capability", lambda c=capability: c)
        monkeypatch.setattr(cuda, "WGMMA_FORWARD_OVERRIDE", override)
        seen.append(cuda.kernel_config("forward", spec, None).instruction)
    assert seen == ["wgmma", "mma", "wgmma", "mma", "wgmma"]
    monkeypatch.setitem(cuda.BLOCK_OVERRIDES, "forward_wgmma", (128, 64, 64, 8))
    assert cuda.kernel_config("forward", spec, None).traversal_block == 64
    monkeypatch.delitem(cuda.BLOCK_OVERRIDES, "forward_wgmma")
    assert cuda.kernel_config("forward", spec, None).traversal_block == 96  # blocks_cuda.txt, D <= 64


@gpu
@pytest.mark.skipif(not (HAS_GPU and cuda.compute_capability() and 90 <= cuda.compute_capability() < 100),
                    reason="the wgmma forward needs a Hopper GPU (sm_90)")
@pytest.mark.parametrize("case", [
    Case(head_dim=128, q_len=333, kv_len=517, dtype="bfloat16", mask="causal", group=2),
    Case(head_dim=72, q_len=100, kv_len=90, dtype="float16", mask="additive", softcap=10.0),
    Case(head_dim=256, q_len=200, kv_len=150, dtype="bfloat16", mask="window", window=(30, 30)),
    # D <= 64: three consumer warpgroups (P = 192); last row blocks with one or two warpgroups
    # wholly past Nq; a bool mask (the kernel spills there) with softcap and GQA; a causal window.
    Case(head_dim=64, q_len=450, kv_len=391, dtype="bfloat16", mask="bool", softcap=20.0, group=2),
    Case(head_dim=40, q_len=200, kv_len=260, dtype="float16", mask="causal_window", window=(50, -1)),
    # Three 64-column panels (D = 129..192): 24 copy chunks per row, which do not divide the 128
    # copying threads (load_swizzled's partial fast path); D = 150 takes the element-wise path.
    Case(head_dim=176, q_len=270, kv_len=333, dtype="bfloat16", mask="causal", group=2),
    Case(head_dim=150, q_len=90, kv_len=130, dtype="float16", mask="additive"),
    Case(head_dim=128, q_len=300, kv_len=120, dtype="bfloat16", mask="causal", group=2, sinks=True),
], ids=lambda c: f"d{c.head_dim}-{c.mask}" + ("-sinks" if c.sinks else ""))
def test_wgmma_forward_matches_reference_and_mma(case, monkeypatch):
    check_case(case, backend="cuda", gradients=False)
    a = make_arrays(case)
    outs = []
    for wgmma in (True, False):
        monkeypatch.setattr(cuda, "WGMMA_FORWARD_OVERRIDE", wgmma)
        outs.append(flash_attention(a.q, a.k, a.v, mask=a.mask, return_lse=True, backend="cuda", **a.kwargs))
    assert relative_error(to_numpy(outs[0][0]), to_numpy(outs[1][0])) < 1e-2
    lse_wgmma, lse_mma = np.array(outs[0][1]), np.array(outs[1][1])
    assert np.array_equal(np.isfinite(lse_wgmma), np.isfinite(lse_mma))
    finite = np.isfinite(lse_mma)
    assert relative_error(lse_wgmma[finite], lse_mma[finite]) < 1e-4


@gpu
@pytest.mark.skipif(not (HAS_GPU and cuda.compute_capability() and 90 <= cuda.compute_capability() < 100),
                    reason="the wgmma backward needs a Hopper GPU (sm_90)")
@pytest.mark.parametrize("case", [
    Case(head_dim=128, q_len=333, kv_len=517, dtype="bfloat16", mask="causal", group=2),
    Case(head_dim=64, q_len=300, kv_len=200, dtype="float16", mask="bool", mask_shape=(False, True, True, True)),
    Case(head_dim=72, q_len=100, kv_len=90, dtype="bfloat16", mask="additive", softcap=10.0, lse_gradient=True),
    Case(head_dim=37, q_len=130, kv_len=129, dtype="float16", mask="causal_window", window=(40, 5), group=3),
    Case(head_dim=200, q_len=150, kv_len=170, dtype="bfloat16", mask="causal", group=2),
    Case(head_dim=256, q_len=100, kv_len=140, dtype="float16", mask="bool", softcap=20.0),
    Case(head_dim=160, q_len=210, kv_len=300, dtype="bfloat16", mask="window", window=(70, 20)),  # three panels
    # Sinks: the dQ kernel's per-warp parts of d_sink (3 consumer warpgroups at D <= 64), rows with no key.
    Case(head_dim=64, q_len=333, kv_len=100, dtype="bfloat16", mask="causal", group=2, sinks=True, lse_gradient=True),
    Case(head_dim=128, q_len=200, kv_len=260, dtype="float16", mask="bool", softcap=10.0, sinks=True),
], ids=lambda c: f"d{c.head_dim}" + ("-sinks" if c.sinks else ""))
def test_wgmma_backward_matches_reference_and_mma(case, monkeypatch):
    """The wgmma dQ and dK/dV kernels against float64, and against the mma.sync kernels."""
    _check_wgmma_backward(case, monkeypatch)


def _check_wgmma_backward(case, monkeypatch):
    """check_case with the wgmma backward, then its gradients against the mma.sync kernels'."""
    monkeypatch.setattr(cuda, "WGMMA_BACKWARD_OVERRIDE", True)
    check_case(case, backend="cuda")
    grads = []
    for wgmma in (True, False):
        monkeypatch.setattr(cuda, "WGMMA_BACKWARD_OVERRIDE", wgmma)
        grads.append(_out_and_grads(case)[1:])
    monkeypatch.setattr(cuda, "WGMMA_BACKWARD_OVERRIDE", True)
    for name, g_wgmma, g_mma in zip(("dq", "dk", "dv", "d_sinks"), *grads):
        assert relative_error(g_wgmma, g_mma) < 2e-2, (case.head_dim, name)


@gpu
@pytest.mark.skipif(not (HAS_GPU and cuda.compute_capability() and 90 <= cuda.compute_capability() < 100),
                    reason="the wgmma backward needs a Hopper GPU (sm_90)")
@pytest.mark.parametrize("scheme", [(128, 32, 160, 8), (128, 16, 160, 8), (128, 64, 128, 8), (64, 64, 128, 8)],
                         ids=["whole-T32", "whole-T16", "slices", "column-groups"])
def test_wgmma_key_value_schemes(scheme, monkeypatch):
    """Past D = 128 the dK/dV kernel holds all of D per warpgroup (H >= D, up to 160), or splits
    it into 128-column CTAs (P = 128) or column groups (P = 64): each against float64 and mma.sync."""
    monkeypatch.setattr(cuda, "WGMMA_BACKWARD_OVERRIDE", True)
    monkeypatch.setitem(cuda.BLOCK_OVERRIDES, "backward_key_value_wgmma", scheme)
    for case in (Case(head_dim=160, q_len=230, kv_len=200, dtype="bfloat16", mask="causal", group=2),
                 Case(head_dim=136, q_len=90, kv_len=170, dtype="float16", mask="bool", softcap=15.0)):
        a = make_arrays(case)
        config = cuda.kernel_config("backward_key_value", check_inputs(a.q, a.k, a.v)[0], None)
        assert (config.slices * config.col_groups == 1) == (scheme[2] >= config.padded_dim)
        _check_wgmma_backward(case, monkeypatch)

"""The "cuda" backend against the float64 reference, on an NVIDIA GPU and on the CPU emulator.

The emulator tests (test_emulated_*) run the same kernels through mlx_flash.backends.cuda_emulator
on any machine with a host C++ compiler: every warp layout of the block table (1 / 2 / 4 / 8
warps, 1 / 2 / 4 column groups, the sm90, sm80 and sm86 families' rows), both cp.async
completion orders (deferred to the wait, eager) and both CTA orders.
MLX_FLASH_CUDA_CAPABILITY (e.g. 80, 86, 120) makes the GPU tests run another family's plans. The GPU tests
are skipped (with the reason) where MLX has no CUDA device. They cover the shared property suite (hypothesis over shapes, dtypes, masks, softcap, GQA, lse cotangents) at a
bounded set of head dims (each distinct head dim / flag set compiles new kernels), explicit
edge cases (D = 1..512 incl. odd and prime sizes, primes for N, rows with no visible key,
broadcast masks), GPU-sized cases (N up to 16K) against the "mlx" backend in fp32 on a subset
of rows, bitwise determinism of the gradients, and the float32 fallback being counted.
"""
import math
import os
import shutil
import warnings
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings

from attention_cases import (GRADIENT_TOLERANCE, LAYOUTS, Case, cases, check_case, laid_out, make_arrays,
                             relative_error, to_numpy)

from mlx_flash import (FallbackWarning, fallback_counts, flash_attention, planner, reference,  # noqa: E402
                       reset_fallback_counts)
from mlx_flash.backends import cuda, cuda_emulator, cuda_source, get_backend, guard  # noqa: E402
from mlx_flash.backends.cuda_source import Tuning  # noqa: E402
from mlx_flash.spec import check_inputs  # noqa: E402

HAS_GPU = hasattr(mx, "cuda") and mx.cuda.is_available()
ON_SM90 = HAS_GPU and cuda.device_capability() == 90 and cuda.BACKEND.family() is not None \
    and cuda.BACKEND.family().wgmma  # a real H100 / H200 planning for sm90 (no capability override)
sm90_only = pytest.mark.skipif(not ON_SM90, reason="the wgmma kernels need a real sm_90 GPU planning for sm90 "
                                                    "(no MLX_FLASH_CUDA_CAPABILITY override)")
gpu = pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU: mx.cuda.is_available() is False "
                                              "(MLX CPU/Metal build or no NVIDIA device)")
emulator = pytest.mark.skipif(cuda_emulator.compiler() is None, reason="no host C++ compiler for the CUDA emulator")

# (case, compute capability whose family plans it, warp layout it exercises with blocks_cuda.txt)
EMULATED_CASES = [
    (Case(head_dim=64, q_len=150, kv_len=140, dtype="bfloat16", mask="causal", group=2, batch=2), 90,
     "4 warps x 2 m-tiles, block-major CTA order"),
    (Case(head_dim=160, q_len=140, kv_len=170, dtype="float16", mask="bool", mask_shape=(False, True, True, True),
          softcap=5.0, lse_gradient=True), 90, "8 warps, dK/dV with 2 column groups sharing P/dS"),
    (Case(head_dim=320, q_len=61, kv_len=67, dtype="bfloat16", mask="causal_window", window=(20, 3), group=3), 90,
     "forward and dQ with 2 column groups, dK/dV with 4"),
    (Case(head_dim=200, q_len=70, kv_len=45, dtype="bfloat16", mask="additive", group=2), 80,
     "sm80: dQ 4 warps x 256 columns, dK/dV 8 warps in 2 column groups at T = 32"),
    (Case(head_dim=456, q_len=37, kv_len=20, dtype="float16", mask="causal", softcap=8.0), 86,
     "sm86: forward 2 column groups of 2 warps, dQ 2 warps, dK/dV 1 warp x 4 CTA slices"),
    (Case(head_dim=300, q_len=33, kv_len=30, dtype="bfloat16", mask="bool", lse_gradient=True), 86,
     "sm86: dK/dV 2 warps x 2 CTA slices, 16 x 16 tiles"),
    (Case(head_dim=40, q_len=140, kv_len=130, dtype="float16", mask="additive", mask_shape=(True, False, True, False),
          group=2), 86, "sm86: interior tiles of every kernel with a mask broadcast along heads and keys"),
    (Case(head_dim=64, q_len=130, kv_len=150, dtype="bfloat16", scale=-0.7, lse_gradient=True), 90,
     "a negative scale on interior tiles without a mask"),
]


@emulator
@pytest.mark.parametrize("eager_copies", [False, True], ids=["deferred-copies", "eager-copies"])
@pytest.mark.parametrize("case,capability,layout", EMULATED_CASES,
                         ids=lambda x: x if isinstance(x, str) else (f"sm{x}" if isinstance(x, int) else f"d{x.head_dim}"))
def test_emulated_kernels(case, capability, layout, eager_copies):
    """The kernels' logic on the CPU emulator (no GPU needed) against the float64 reference."""
    backend = cuda_emulator.backend(seed=case.q_len + int(eager_copies), eager_copies=eager_copies,
                                    capability=capability)
    check_case(case, backend=backend)


# Inputs where they lie (ensure_row_contiguous=False, `<name>_strides`): the emulator lays the
# kernels' strided inputs out itself (the values reach it as arrays), so the 16-byte path reads
# token-major rows and the element-wise path reads spread ones, in every kernel incl. the
# backward preprocessing; "mixed" gives each input of a kernel another layout.
@emulator
@pytest.mark.parametrize("layout", ["token_major", "spread", "mixed"])
@pytest.mark.parametrize("case,capability", [
    (Case(head_dim=64, q_len=70, kv_len=90, dtype="bfloat16", mask="causal", group=2, kv_heads=2, batch=2,
          lse_gradient=True), 90),
    (Case(head_dim=200, q_len=45, kv_len=38, dtype="float16", mask="bool", group=2, softcap=5.0), 80),
    (Case(head_dim=37, q_len=20, kv_len=33, dtype="bfloat16", mask="window", window=(5, 2), sinks=True), 86),
], ids=lambda x: f"sm{x}" if isinstance(x, int) else f"d{x.head_dim}")
def test_emulated_input_layouts(case, capability, layout):
    check_case(case, backend=cuda_emulator.backend(seed=case.q_len, capability=capability, layout=layout))


def _sum_cotangent_errors(case, backend):
    """Relative errors of the gradients of flash_attention(...).sum() against the float64 reference:
    the cotangent reaches the backward as a broadcast (all strides 0 on MLX)."""
    a = make_arrays(case)
    spec, mask4 = check_inputs(a.q, a.k, a.v, mask=a.mask, **a.kwargs)
    f = lambda q, k, v: flash_attention(q, k, v, mask=a.mask, backend=backend, **a.kwargs).sum()
    grads = mx.grad(f, argnums=(0, 1, 2))(a.q, a.k, a.v)
    q, k, v = (to_numpy(x) for x in (a.q, a.k, a.v))
    ref = reference.attention_backward(q, k, v, np.ones(q.shape), spec, None if mask4 is None else to_numpy(mask4))
    return [relative_error(to_numpy(g), r) for g, r in zip(grads, ref)]


@emulator
@pytest.mark.parametrize("capability,head_dim", [(90, 64), (86, 200), (80, 37)])
def test_emulated_broadcast_cotangent(capability, head_dim):
    """A constant-row input laid out as a broadcast (column stride 0) takes the element-wise copies."""
    case = Case(head_dim=head_dim, q_len=50, kv_len=41, dtype="bfloat16", mask="causal", group=2)
    backend = cuda_emulator.backend(seed=3, capability=capability, layout="broadcast")
    for error in _sum_cotangent_errors(case, backend):
        assert error < GRADIENT_TOLERANCE["bfloat16"]


@gpu
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
def test_broadcast_cotangent(head_dim):
    """out.sum()'s cotangent is a broadcast on MLX (all strides 0); flash_attention makes it contiguous."""
    case = Case(head_dim=head_dim, q_len=300, kv_len=257, dtype="bfloat16", mask="causal", group=4, kv_heads=2)
    for error in _sum_cotangent_errors(case, "cuda"):
        assert error < GRADIENT_TOLERANCE["bfloat16"]


def test_emulator_layouts_are_checked():
    with pytest.raises(ValueError, match="layout must be one of"):
        cuda_emulator.KernelFactory(layout="diagonal")


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
    errors = check_case(case, backend=cuda_emulator.backend(seed=case.q_len))
    assert "d_sinks" in errors


@pytest.mark.parametrize("kernel", ["forward", "backward_query", "backward_key_value"])
@pytest.mark.parametrize("wgmma", [False, True], ids=["mma", "wgmma"])
def test_sinks_kernel_signature(kernel, wgmma):
    """Sinks compile into the forward and dQ kernels (a sinks input; dQ writes d_sinks_part); the
    dK/dV kernel is the one without sinks (the forward's lse includes them)."""
    tuning = Tuning(wgmma_forward=wgmma, wgmma_backward=wgmma)
    family = cuda_source.family_named("sm90")
    q = mx.zeros((1, 2, 8, 64), mx.bfloat16)
    plain = cuda_source.make_variant(kernel, check_inputs(q, q, q, mask="causal")[0], None, family, tuning)
    variant = cuda_source.make_variant(
        kernel, check_inputs(q, q, q, mask="causal", sinks=mx.zeros((2,), mx.bfloat16))[0], None, family, tuning)
    assert variant.instruction == plain.instruction == ("wgmma" if wgmma else "mma.sync")
    header, body, inputs, outputs = cuda_source.source(variant)
    if kernel == "backward_key_value":
        assert variant == plain
        return
    assert variant.sinks and variant.name != plain.name and variant != plain
    assert "constexpr bool SINKS = true;" in header and "sinks" in inputs
    assert ("d_sinks_part" in outputs) == (kernel == "backward_query")
    plain_header, plain_body, plain_inputs, _ = cuda_source.source(plain)
    assert "nullptr" in plain_body and "constexpr bool SINKS = false;" in plain_header
    assert "sinks" not in plain_inputs


@pytest.mark.parametrize("kernel", ["forward", "backward_query", "backward_key_value"])
def test_poison_released_compiles_into_wgmma_kernels_only(kernel):
    """Tuning.poison_released is part of the wgmma variants (their names and the template's
    POISON_RELEASED) and of nothing else; a value that is not a bool is refused."""
    family = cuda_source.family_named("sm90")
    q = mx.zeros((1, 2, 300, 128), mx.bfloat16)
    spec = check_inputs(q, q, q)[0]
    wgmma = Tuning(wgmma_forward=True, wgmma_backward=True)
    plain = cuda_source.make_variant(kernel, spec, None, family, wgmma)
    checked = cuda_source.make_variant(kernel, spec, None, family, replace(wgmma, poison_released=True))
    assert checked.poison_released and not plain.poison_released
    assert checked.name.endswith("z") and checked.name.rsplit("_", 1)[0] == plain.name.rsplit("_", 1)[0]
    assert "constexpr bool POISON_RELEASED = true;" in cuda_source.source(checked)[0]
    assert "constexpr bool POISON_RELEASED = false;" in cuda_source.source(plain)[0]
    mma = Tuning(wgmma_forward=False, wgmma_backward=False, poison_released=True)
    assert not cuda_source.make_variant(kernel, spec, None, family, mma).poison_released
    with pytest.raises(TypeError, match="poison_released must be a bool, got 1"):
        Tuning(poison_released=1)


def _block_orders_agree(make_backend):
    """Head-major and block-major CTA orders compute bitwise the same (only the schedule differs)."""
    case = Case(batch=2, kv_heads=2, group=2, q_len=140, kv_len=150, head_dim=64, dtype="bfloat16", mask="causal")
    results = [_out_and_grads(case, make_backend(Tuning(block_major=major))) for major in (False, True)]
    for x, y in zip(*results):
        assert np.array_equal(x, y)


@emulator
def test_emulated_block_orders_agree():
    _block_orders_agree(lambda tuning: cuda_emulator.backend(seed=3, tuning=tuning))


@gpu
def test_block_orders_agree():
    _block_orders_agree(lambda tuning: cuda.CUDABackend(tuning=tuning))


# Calls whose wgmma kernels refill their buffers many times (more steps or items than stages), one
# per scheme of the producers and consumers: (case, tuning, what it exercises).
POISON_CASES = [
    (Case(kv_heads=2, group=2, q_len=700, kv_len=690, head_dim=64, dtype="bfloat16"), Tuning(fused_query=True),
     "D = 64: three forward consumers, the fused dQ"),
    (Case(kv_heads=1, group=4, q_len=600, kv_len=650, head_dim=128, dtype="bfloat16", mask="causal"),
     Tuning(fused_query=True), "D = 128 causal GQA: the fused dQ's walk"),
    (Case(kv_heads=2, q_len=500, kv_len=520, head_dim=96, dtype="float16", mask="bool"), Tuning(fused_query=False),
     "D = 96 with an array mask: the dQ kernel"),
    (Case(kv_heads=2, q_len=300, kv_len=310, head_dim=192, dtype="bfloat16"), Tuning(),
     "D = 192: the dK/dV kernel's column slices"),
    (Case(kv_heads=1, group=2, q_len=260, kv_len=270, head_dim=256, dtype="bfloat16", softcap=20.0), Tuning(),
     "D = 256 with softcap: column groups"),
    (Case(q_len=200, kv_len=210, head_dim=512, dtype="bfloat16"), Tuning(), "D = 512: the dK/dV kernel's roles"),
]


@sm90_only
@pytest.mark.parametrize("case, tuning, what", POISON_CASES, ids=[f"d{c.head_dim}-{c.mask}" for c, _, _ in POISON_CASES])
def test_released_buffers_are_not_read(case, tuning, what):
    """Tuning.poison_released: a consumer thread that releases a ring tile (K / V; dK/dV: Q / dO)
    while one of its pending wgmma groups still reads it (a release before the wait for that
    product, which racecheck cannot see: it does not follow wgmma's or TMA's accesses) writes NaN
    results, whatever the timing (ReadLedger); and the producers overwrite every released tile
    with NaN before the refill. Every kernel of the call carries the check, and the outputs and
    gradients are finite and bitwise those of the same kernels without it."""
    checked = cuda.CUDABackend(tuning=replace(tuning, poison_released=True))
    a = make_arrays(case)
    spec = check_inputs(a.q, a.k, a.v, mask=a.mask, **a.kwargs)[0]
    mask_dtype = None if a.mask is None or isinstance(a.mask, str) else a.mask.dtype
    for kernel in ("forward", "backward_query", "backward_key_value"):
        variant = checked.variant(kernel, spec, mask_dtype)
        assert variant.instruction == "wgmma" and variant.poison_released, (what, variant.name)
    plain = _out_and_grads(case, cuda.CUDABackend(tuning=tuning))
    for x, y in zip(plain, _out_and_grads(case, checked)):
        assert np.isfinite(y).all() and np.array_equal(x, y), what


# The dQ wgmma kernel's release of V's stage (one warpgroup: after dP's wait) and where a race
# would put it (before that wait, as a reverted version did).
V_RELEASE = "ledger.release(ledger.values(stage), step_ring.empty_values(stage), lane == 0);"
V_RELEASE_EARLY = "if (!EXP_UNDER_DP) " + V_RELEASE
V_RELEASE_AFTER_DP = "fence_registers(dp_flat);\n        " + V_RELEASE


@dataclass(frozen=True)  # hashable: the backend's verdicts are keyed by it
class EarlyRelease:
    """mx.fast.cuda_kernel, with the dQ wgmma kernel's V released before dP's wait (its own
    kernel name, so MLX's cache keeps it apart from the right one)."""

    def __call__(self, *, name, header, **kwargs):
        if "backward_query_wgmma" in name:
            assert header.count(V_RELEASE_EARLY) == 1 and header.count(V_RELEASE_AFTER_DP) == 1, \
                "the dQ kernel's V release moved: update V_RELEASE*"
            header = header.replace(V_RELEASE_AFTER_DP, "fence_registers(dp_flat);")
            header = header.replace(V_RELEASE_EARLY, V_RELEASE)
            name += "_early_release"
        return mx.fast.cuda_kernel(name=name, header=header, **kwargs)


@sm90_only
def test_poison_released_sees_an_early_release(monkeypatch):
    """The check above can fail: the dQ kernel releasing V before dP's wait (dP still reads V)
    gives a NaN dQ in every call with poison_released (the ledger's verdict, not the race's
    timing, which on an H200 never let the refill overtake dP), and dK / dV stay finite."""
    # First contact only builds and runs the racy kernel: a self-check would record its NaN as a
    # failed verdict under the right kernel's key (same backend name and variant) for the process.
    monkeypatch.setenv("MLX_FLASH_SELF_CHECK", "0")
    case, tuning, _ = POISON_CASES[2]  # D = 96: the dQ kernel with one warpgroup per 64 rows
    backend = cuda.CUDABackend(tuning=replace(tuning, poison_released=True, wgmma_forward=True, wgmma_backward=True),
                               kernel_factory=EarlyRelease(), capability=90)
    a = make_arrays(case)
    spec = check_inputs(a.q, a.k, a.v, mask=a.mask, **a.kwargs)[0]
    variant = backend.variant("backward_query", spec, a.mask.dtype)
    assert variant.instruction == "wgmma" and variant.poison_released, variant.name
    for _ in range(3):
        out, dq, dk, dv = _out_and_grads(case, backend)
        assert np.isfinite(out).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
        assert np.isnan(dq).any()


# GQA calls whose dK/dV kernel splits each kv head's query-head group over CTAs (head_split):
# (case, splits forced, what it exercises).
HEAD_SPLIT_CASES = [
    (Case(batch=2, kv_heads=2, group=4, q_len=150, kv_len=140, head_dim=64, dtype="bfloat16", mask="causal"), 2,
     "two heads a split, block-major CTA order"),
    (Case(kv_heads=1, group=4, q_len=130, kv_len=150, head_dim=128, dtype="float16", mask="bool", softcap=5.0,
          lse_gradient=True), 4, "a head a split, an array mask per head"),
    (Case(kv_heads=2, group=3, q_len=70, kv_len=75, head_dim=37, dtype="bfloat16", mask="causal_window",
          window=(20, 3), layout="columns"), 3, "an odd head dim (element-wise parts), strided rows"),
    (Case(kv_heads=1, group=2, q_len=61, kv_len=67, head_dim=320, dtype="bfloat16", mask="additive"), 2,
     "column slices: the split index beside the slice index"),
    (Case(kv_heads=2, group=3, q_len=90, kv_len=100, head_dim=96, dtype="bfloat16"), 2,
     "uneven splits: 2 + 1 heads"),
    (Case(kv_heads=1, group=7, q_len=80, kv_len=70, head_dim=64, dtype="float16", mask="causal", sinks=True), 3,
     "uneven splits: 3 + 2 + 2 heads, sinks"),
]
HEAD_SPLIT_IDS = [f"d{c.head_dim}-{c.mask}-g{c.group}/{n}" for c, n, _ in HEAD_SPLIT_CASES]


def _head_splits_agree(case, splits, make_backend):
    """A head-split dK/dV kernel (its fp32 parts added in split order by one more kernel) against
    float64, bitwise the same run to run, and close to the unsplit kernel (dK and dV add the
    query heads in another order, so not bitwise)."""
    split, whole = make_backend(Tuning(head_splits=splits)), make_backend(Tuning(head_splits=1))
    a = make_arrays(case)
    spec = check_inputs(a.q, a.k, a.v, mask=a.mask, **a.kwargs)[0]
    mask_dtype = None if a.mask is None or isinstance(a.mask, str) else a.mask.dtype
    assert split.head_splits(spec, mask_dtype) == splits
    assert split.variant("backward_key_value", spec, mask_dtype).head_split
    assert not whole.variant("backward_key_value", spec, mask_dtype).head_split
    check_case(case, backend=split)
    first, second, apart = _out_and_grads(case, split), _out_and_grads(case, split), _out_and_grads(case, whole)
    for x, y in zip(first, second):
        assert np.array_equal(x, y)
    for name, x, y in zip(("out", "dq", "dk", "dv"), first, apart):
        assert relative_error(x, y) < 1e-2, name
        if name in ("out", "dq"):  # the forward and dQ kernels are the same
            assert np.array_equal(x, y), name


@emulator
@pytest.mark.parametrize("case,splits,what", HEAD_SPLIT_CASES, ids=HEAD_SPLIT_IDS)
def test_emulated_head_splits(case, splits, what):
    _head_splits_agree(case, splits, lambda tuning: cuda_emulator.backend(seed=5, tuning=tuning, capability=86))


@gpu
@pytest.mark.parametrize("case,splits,what", HEAD_SPLIT_CASES, ids=HEAD_SPLIT_IDS)
def test_head_splits(case, splits, what):
    """The same on the GPU: the wgmma dK/dV kernel on an sm_90 (the mma.sync one elsewhere)."""
    reset_fallback_counts()
    _head_splits_agree(case, splits, lambda tuning: cuda.CUDABackend(tuning=tuning))
    assert not fallback_counts(), fallback_counts()


@gpu
@sm90_only
@pytest.mark.parametrize("head_dim,mask,group", [(128, "none", 4), (128, "causal", 4), (64, "none", 4),
                                                 (128, "causal", 7)])
def test_head_splits_with_fused_query(head_dim, mask, group):
    """Head splits and the fused dQ together: each split's adds into dQ's accumulator wait for the
    previous key block's CTA of the same split (a lower index); a group of 7 splits as 4 + 3."""
    case = Case(kv_heads=2, group=group, q_len=520, kv_len=400, head_dim=head_dim, dtype="bfloat16", mask=mask)
    reset_fallback_counts()
    _head_splits_agree(case, 2, lambda tuning: cuda.CUDABackend(tuning=replace(tuning, fused_query=True)))
    a = make_arrays(case)
    assert cuda.CUDABackend(tuning=Tuning(fused_query=True, head_splits=2)).variant(
        "backward_key_value", check_inputs(a.q, a.k, a.v)[0]).fused_query
    assert not fallback_counts(), fallback_counts()


def test_head_splits_rule():
    """cuda_source.head_splits: the count whose CTAs fit `waves` waves on the SMs with the fewest
    heads in the longest split (then the fewest CTAs), 1 without GQA or an SM count; a forced
    count up to the group."""
    rule = cuda_source.head_splits
    assert cuda_source.split_shares(7, 2) == (4, 3) and cuda_source.split_shares(4, 2) == (2, 2)
    assert cuda_source.split_shares(7, 4) == (2, 2, 2, 1) and sum(cuda_source.split_shares(11, 3)) == 11
    # (batch, kv heads, group, kv_len, P, slices, SMs, waves[, forced]); B=1 Hkv=4 N=2048 at P=128: 64 CTAs
    assert rule(1, 4, 4, 2048, 128, 1, 132, 1) == 2
    assert rule(1, 4, 4, 2048, 128, 1, 132, 2) == 4
    assert rule(1, 4, 4, 1024, 128, 1, 132, 1) == 4
    assert rule(1, 4, 4, 4096, 128, 1, 132, 1) == 1    # 128 CTAs already
    assert rule(1, 4, 4, 4096, 128, 1, 132, 2) == 2
    assert rule(1, 4, 1, 2048, 128, 1, 132, 1) == 1    # MHA
    assert rule(1, 4, 6, 1024, 128, 1, 132, 1) == 3    # 32 x 4 <= 132, but 4 splits of 6 are 2 + 2 + 1 + 1
    assert rule(1, 4, 7, 2048, 128, 1, 132, 1) == 2    # 7 heads as 4 + 3 (Qwen2.5-7B's 28 / 4)
    assert rule(1, 4, 7, 1024, 128, 1, 132, 1) == 4    # 2 + 2 + 2 + 1
    assert rule(1, 4, 5, 2048, 128, 1, 132, 2) == 3    # 4 would fit too, its longest split as long (2 heads)
    assert rule(1, 4, 4, 1024, 96, 1, 132, 1) == 2     # 44 CTAs: 3 would fit, its longest split as long
    assert rule(1, 4, 4, 2048, 64, 2, 132, 1) == 1     # column slices count as CTAs
    assert rule(1, 4, 4, 2048, 128, 1, None, 1) == 1   # SM count unknown
    assert rule(1, 4, 4, 2048, 128, 1, 132, None) == 1  # no option
    assert rule(1, 4, 6, 2048, 128, 1, None, None, forced=4) == 4
    assert rule(1, 4, 3, 2048, 128, 1, None, None, forced=4) == 3
    assert rule(64, 8, 4, 16384, 128, 1, None, None, forced=2) == 2
    with pytest.raises(ValueError, match="head_splits"):
        Tuning(head_splits=0)
    with pytest.raises(ValueError, match="sm_count"):
        cuda.CUDABackend(sm_count=0)


def test_head_splits_by_the_table():
    """The sm90 wgmma dK/dV rows' head_splits_causal_to1 (D <= 96) and head_splits_to1 (past 96),
    and the D = 128 row's head_splits_fused_causal_to2 (the causal fused dQ), as calls meet them,
    on a GPU of 132 SMs (planned here; the kernels are not run)."""
    backend = cuda.CUDABackend(kernel_factory=cuda_emulator.KernelFactory(), capability=90,
                               tuning=Tuning(wgmma_backward=True), sm_count=132)
    unknown = cuda.CUDABackend(kernel_factory=cuda_emulator.KernelFactory(), capability=90,
                               tuning=Tuning(wgmma_backward=True))
    for batch, q_heads, n, head_dim, mask, splits in [
            (1, 16, 2048, 128, None, 2), (1, 16, 2048, 128, "causal", 2), (2, 16, 2048, 128, "causal", 1),
            (1, 16, 4096, 128, None, 1), (1, 16, 4096, 128, "causal", 2), (1, 16, 8192, 128, "causal", 1),
            (1, 16, 1024, 128, None, 4), (1, 32, 2048, 128, "causal", 2), (1, 16, 2048, 64, None, 1),
            (1, 16, 2048, 64, "causal", 2), (1, 16, 1024, 256, "causal", 2), (1, 16, 1024, 256, None, 2),
            (1, 16, 2048, 96, None, 1), (1, 16, 2048, 160, None, 2), (1, 16, 2048, 192, None, 1),
            (1, 16, 2048, 192, "causal", 1), (1, 16, 1024, 192, "causal", 2),
            (1, 16, 1024, 192, None, 2), (1, 16, 512, 512, None, 2), (1, 4, 2048, 128, None, 1)]:
        q, kv = mx.zeros((batch, q_heads, n, head_dim), mx.bfloat16), mx.zeros((batch, 4, n, head_dim), mx.bfloat16)
        spec = check_inputs(q, kv, kv, mask=mask)[0]
        assert backend.head_splits(spec) == splits, (batch, q_heads, n, head_dim, mask)
        assert backend.variant("backward_key_value", spec).head_split == (splits > 1)
        assert unknown.head_splits(spec) == 1 and not unknown.variant("backward_key_value", spec).head_split


@emulator
def test_emulated_head_splits_by_a_table():
    """The table's rule end to end on the CPU emulator: a table whose sm86 dK/dV rows carry
    head_splits_to1, a GPU of 4 SMs. A GQA call of 2 CTAs splits (the head_split kernel and the
    parts kernel run), one of 8 does not, though the guard's small problem alone would split (the
    probe runs the call's own unsplit kernels); both against float64."""
    shipped = planner.shipped_table("cuda")
    rows = tuple(replace(r, cached=frozenset(r.cached | {cuda_source.HEAD_SPLITS + "1"}))
                 if (r.kernel, r.family) == ("backward_key_value", "sm86") else r for r in shipped.rows)
    backend = cuda.CUDABackend(kernel_factory=cuda_emulator.KernelFactory(seed=2), capability=86, sm_count=4,
                               tuning=Tuning(table=planner.Table("cuda", "test", rows)))
    for kv_len, splits in ((60, 2), (200, 1)):  # P = 64 keys: 1 / 4 key blocks x 2 kv heads
        case = Case(kv_heads=2, group=2, q_len=70, kv_len=kv_len, head_dim=64, dtype="bfloat16", mask="causal")
        a = make_arrays(case)
        spec = check_inputs(a.q, a.k, a.v, mask=a.mask)[0]
        assert backend.head_splits(spec) == splits
        assert backend.head_splits(guard.probe_spec(spec)) == 2
        check_case(case, backend=backend)


def test_probes_run_the_calls_own_kernels():
    """The first-contact guard keys a call by its own variant set and runs that set on its small
    problem, whose size alone would choose others: a call whose dK/dV kernel splits heads (the
    small problem splits too, by its own CTA count) and one that does not (the small problem would
    split), one long enough for the fused dQ (the small problem is not)."""
    backend = cuda.CUDABackend(kernel_factory=cuda_emulator.KernelFactory(), capability=90,
                               tuning=Tuning(wgmma_backward=True), sm_count=132)

    def call(batch, n, kv_heads=2):
        return check_inputs(mx.zeros((batch, 8, n, 128), mx.bfloat16), mx.zeros((batch, kv_heads, n, 128), mx.bfloat16),
                            mx.zeros((batch, kv_heads, n, 128), mx.bfloat16), mask="causal")[0]

    split, whole, mha = call(1, 2048), call(4, 4096), call(1, 2048, kv_heads=8)
    assert backend.head_splits(split) == 4 and backend.head_splits(whole) == 1 and backend.head_splits(mha) == 1
    assert backend.variant("backward_key_value", whole).fused_query
    assert backend.variant_key(split) != backend.variant_key(mha)

    class Recorder:
        """The backend's choices, kernels not run (the wgmma ones cannot run here): what the probe
        hands to forward and backward."""
        name, pins_variants, runs = "cuda", True, []

        def variant_key(self, spec_, mask_dtype=None):
            return backend.variant_key(spec_, mask_dtype)

        def variants(self, spec_, mask_dtype=None):
            return backend.variants(spec_, mask_dtype)

        def forward(self, q_, k_, v_, mask_, spec_, variants=None, **kwargs):
            self.runs.append((spec_, variants))
            return mx.zeros(q_.shape, q_.dtype), mx.zeros(q_.shape[:3])

        def backward(self, q_, k_, v_, mask_, out_, lse_, d_out_, d_lse_, spec_, variants=None, **kwargs):
            self.runs.append((spec_, variants))
            return mx.zeros_like(q_), mx.zeros_like(k_), mx.zeros_like(v_), None

    recorder = Recorder()
    for spec in (split, whole, mha):
        small = guard.probe_spec(spec)
        assert guard.FirstContact()._probe(recorder, spec, None)[0] is None
        assert [run for run in recorder.runs[-2:]] == [(small, backend.variants(spec))] * 2
    assert backend.variants(guard.probe_spec(whole)) != backend.variants(whole)  # what pinning is for


def _out_and_grads(case, backend="cuda"):
    a = make_arrays(case)

    def f(q_, k_, v_, sinks_=None):
        o = flash_attention(q_, k_, v_, mask=a.mask, sinks=sinks_, backend=backend, **a.kwargs)
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
@given(cases(max_len=200, dtypes=HALF_DTYPES, head_dims=PROPERTY_HEAD_DIMS, layouts=LAYOUTS))
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



def test_tensor_map_slots_agree_with_the_scratch_size():
    """The kernels publish each CTA's two maps at TENSOR_MAP_SLOT_BYTES * CTA in the scratch output
    that the host sizes with tensor_map.scratch_bytes: one slot size on both sides."""
    from mlx_flash.backends import tensor_map
    from mlx_flash.render import template_text
    assert "constexpr int TENSOR_MAP_SLOT_BYTES = 2 * 128;" in template_text("wgmma_common.cuh")
    assert tensor_map.SLOT_BYTES == 2 * 128 and tensor_map.scratch_bytes(3) == 3 * tensor_map.SLOT_BYTES
    for name in ("attention_forward_wgmma.cu", "attention_backward_query_wgmma.cu",
                 "attention_backward_key_value_wgmma.cu"):
        text = template_text(name)
        assert "tensor_map_slots(tensor_maps, bid)" in text and "256 * bid" not in text, name


SM90 = cuda_source.family_named("sm90")
WGMMA = Tuning(wgmma_forward=True, wgmma_backward=True)
MMA = Tuning(wgmma_forward=False, wgmma_backward=False)
WGMMA_RENDER_CASES = [(kernel, head_dim) for kernel, dims in (
    ("forward", [1, 37, 64, 80, 128, 160, 200, 256, 257, 300, 448, 500, 512]),
    ("backward_query", [1, 37, 64, 80, 128, 160, 256, 257, 300, 448, 512]),
    ("backward_key_value", [1, 37, 64, 80, 128, 144, 160, 176, 200, 256, 257, 300, 448, 512])) for head_dim in dims]


def _variant(kernel, head_dim, tuning=WGMMA, family=SM90, real_sm90=False):
    q = mx.zeros((1, 2, 8, head_dim), mx.bfloat16)
    spec, _ = check_inputs(q, q, q, mask="causal")
    return cuda_source.make_variant(kernel, spec, None, family, tuning, real_sm90)


@pytest.mark.parametrize("kernel,head_dim", WGMMA_RENDER_CASES, ids=lambda x: str(x))
def test_wgmma_variant_renders(kernel, head_dim):
    variant = _variant(kernel, head_dim)
    assert variant.instruction == "wgmma" and variant.family == "sm90_wgmma"
    assert variant.parallel_block == 64 * (variant.warps // 4) // variant.col_groups
    assert variant.padded_dim % 16 == 0 and variant.padded_dim >= head_dim
    assert variant.shared_memory <= SM90.shared_memory
    header, body, inputs, outputs = cuda_source.source(variant)
    assert f"attention_{kernel}_wgmma(" in body
    # the wgmma kernels load their streamed tiles with TMA: the map template in, every CTA's maps out (last)
    assert outputs == {"forward": ["out", "lse"], "backward_query": ["dq"], "backward_key_value": ["dk", "dv"]}[
        kernel] + ["tensor_maps"]
    assert inputs[-1] == "tensor_map" and variant.tensor_maps
    assert variant.tensor_map_rank == (3 if kernel == "backward_key_value" else 2)
    assert f"static_assert(SMEM_BYTES <= {variant.shared_memory}," in header  # the template's layout fits the launch
    assert f"struct Wgmma<{variant.head_block}, __nv_bfloat16>" in header
    assert f"struct Wgmma<{variant.traversal_block}, __nv_bfloat16>" in header
    # the forward's consumer warpgroups take turns where the table row says pingpong
    row = planner.plan("cuda", kernel, head_dim, mx.bfloat16, "sm90_wgmma")
    assert variant.pingpong == (kernel == "forward" and row.is_cached("pingpong"))
    # The forward and dQ past D = 256 (wgmma's N): column groups, both warpgroups on 64 query rows
    # with half of D each (on 64-column panels); below it one warpgroup holds all of D.
    if kernel in ("forward", "backward_query"):
        assert variant.slices == 1 and ("constexpr int CG = 2;" in header) == (variant.col_groups == 2)
        if variant.padded_dim <= 256:
            assert variant.col_groups == 1 and variant.head_block == variant.padded_dim
            return
        assert (variant.parallel_block, variant.col_groups, variant.pingpong) == (64, 2, False)
        assert variant.head_block == cuda_source._round_up(-(-variant.padded_dim // 2), 64)
        assert variant.head_block < variant.padded_dim <= 2 * variant.head_block <= 512
        with pytest.raises(ValueError, match="64 shared by both"):
            _variant(kernel, head_dim, Tuning(blocks={kernel + "_wgmma": (128, 16, 256, 8)}, wgmma_forward=True,
                                              wgmma_backward=True))
        return
    # dK/dV past the table row's H (<= 160): 128-column CTAs (slices, P = 128) or both consumer
    # warpgroups on 64 keys, 128 columns each (column groups, P = 64), as the table says; the
    # other kernels hold all of D in each warpgroup
    wide = kernel == "backward_key_value" and variant.padded_dim > cuda_source._round_up(row.head_block, 16)
    assert wide == (variant.slices * variant.col_groups > 1)
    assert variant.slices * variant.col_groups * variant.head_block >= variant.padded_dim
    assert ("constexpr int CG = 2;" in header) == (variant.col_groups == 2)
    if not wide:
        assert variant.slices == variant.col_groups == 1 and variant.head_block == variant.padded_dim
        assert variant.padded_dim <= (cuda_source.WGMMA_WHOLE_MAX_COLUMNS if kernel == "backward_key_value" else 256)
        return
    # Past D = 256 only column groups fit (64 rows of K and V over all of D), in CTA slices of 256
    # columns, at T = 16.
    schemes = [(64, -(-variant.padded_dim // 256), 2)] + (
        [(128, -(-variant.padded_dim // 128), 1)] if variant.padded_dim <= 256 else [])
    assert (variant.parallel_block, variant.slices, variant.col_groups) in schemes
    for block, slices, col_groups in schemes:
        scheme = _variant(kernel, head_dim, Tuning(blocks={kernel + "_wgmma": (block, 32 if head_dim <= 256 else 16,
                                                                               128, 8)}, wgmma_backward=True))
        assert (scheme.parallel_block, scheme.slices, scheme.col_groups) == (block, slices, col_groups)
        assert scheme.shared_memory <= SM90.shared_memory
        assert f"static_assert(SMEM_BYTES <= {scheme.shared_memory}," in cuda_source.source(scheme)[0]
    # All of D in one warpgroup (H >= D) holds up to WGMMA_WHOLE_MAX_COLUMNS; past it a clear error.
    whole = Tuning(blocks={kernel + "_wgmma": (128, 32, variant.padded_dim, 8)}, wgmma_backward=True)
    if variant.padded_dim <= cuda_source.WGMMA_WHOLE_MAX_COLUMNS:
        scheme = _variant(kernel, head_dim, whole)
        assert (scheme.slices, scheme.col_groups, scheme.head_block) == (1, 1, variant.padded_dim)
        assert f"static_assert(SMEM_BYTES <= {scheme.shared_memory}," in cuda_source.source(scheme)[0]
    else:
        with pytest.raises(ValueError, match="all of D up to 160"):
            _variant(kernel, head_dim, whole)
    with pytest.raises(ValueError, match="H must be 128"):  # a split needs H = 128
        _variant(kernel, head_dim, Tuning(blocks={kernel + "_wgmma": (128, 32, 96, 8)}, wgmma_backward=True))


def test_wgmma_only_on_a_real_sm90(monkeypatch):
    """wgmma: family sm90 at every D on a real sm_90 (past 256 the outputs in column slices or
    groups); never on another family, never where the capability is only an override
    (MLX_FLASH_CUDA_CAPABILITY=90 on another GPU), never emulated."""
    for kernel in planner.KERNELS:
        for head_dim, expected in ((1, True), (64, True), (129, True), (256, True), (257, True), (512, True)):
            assert _variant(kernel, head_dim, Tuning(), real_sm90=True).instruction == \
                ("wgmma" if expected else "mma.sync"), (kernel, head_dim)
        assert _variant(kernel, 128, Tuning(), real_sm90=False).instruction == "mma.sync"
        assert _variant(kernel, 128, MMA, real_sm90=True).instruction == "mma.sync"
        for name in ("sm80", "sm86", "sm100", "sm120"):
            assert _variant(kernel, 128, WGMMA, cuda_source.family_named(name), True).instruction == "mma.sync"
    for device, override, expected in ((90, None, True), (90, "90", True), (80, "90", False), (None, "90", False),
                                       (90, "80", False), (100, None, False)):
        monkeypatch.setattr(cuda, "device_capability", lambda d=device: d)
        if override is None:
            monkeypatch.delenv(cuda.CAPABILITY_VARIABLE, raising=False)
        else:
            monkeypatch.setenv(cuda.CAPABILITY_VARIABLE, override)
        backend = cuda.CUDABackend()
        q = mx.zeros((1, 1, 8, 128), mx.float16)
        variant = backend.variant("forward", check_inputs(q, q, q)[0])
        assert (variant.instruction == "wgmma") is expected, (device, override)
        assert cuda_emulator.backend(capability=90).variant("forward", check_inputs(q, q, q)[0]).instruction \
            == "mma.sync"


def test_variant_key_holds_family_and_tuning():
    """A variant is the cache key: the family and the tuning value are part of it."""
    base = _variant("forward", 64, Tuning(), real_sm90=True)
    assert base.traversal_block == 128  # blocks_cuda.txt, sm90_wgmma, D <= 64
    tuned = _variant("forward", 64, Tuning(blocks={"forward_wgmma": (128, 64, 64, 8)}), real_sm90=True)
    assert tuned.traversal_block == 64 and tuned != base
    assert _variant("forward", 64, Tuning(), real_sm90=True) is base  # cached
    assert _variant("forward", 64, Tuning(pingpong=False), real_sm90=True).pingpong is False
    assert base.pingpong is True
    sm80 = _variant("backward_query", 200, Tuning(), cuda_source.family_named("sm80"))
    sm86 = _variant("backward_query", 200, Tuning(), cuda_source.family_named("sm86"))
    assert (sm80.family, sm86.family) == ("sm80", "sm86") and sm80 != sm86
    with pytest.raises(ValueError, match="kernel"):
        Tuning(blocks={"backward": (64, 64, 64)})


def test_capability_override_and_fallback(monkeypatch):
    """MLX_FLASH_CUDA_CAPABILITY picks the family; below sm_80 the call is unsupported (the
    counted fallback), with a reason that names the capability."""
    q = mx.zeros((1, 1, 8, 64), mx.float16)
    spec = check_inputs(q, q, q)[0]
    monkeypatch.setenv(cuda.CAPABILITY_VARIABLE, "86")
    assert cuda.CUDABackend().family().name == "sm86"
    assert cuda.CUDABackend().unsupported_reason(spec) is None
    for capability in ("75", "70", "95"):
        monkeypatch.setenv(cuda.CAPABILITY_VARIABLE, capability)
        reason = cuda.CUDABackend().unsupported_reason(spec)
        assert reason is not None and f"compute capability {capability}" in reason
    monkeypatch.setenv(cuda.CAPABILITY_VARIABLE, "sm_x")
    with pytest.raises(ValueError, match="MLX_FLASH_CUDA_CAPABILITY"):
        cuda.CUDABackend().capability()


@emulator
def test_emulated_capability_75_falls_back_counted():
    """An sm_75 GPU: the call goes to the "mlx" backend, warned once and counted, with correct results."""
    reset_fallback_counts()
    case = Case(head_dim=32, q_len=20, kv_len=24, dtype="bfloat16", mask="causal")
    with pytest.warns(UserWarning, match="compute capability 75"):
        check_case(case, backend=cuda_emulator.backend(capability=75))
    assert any("compute capability 75" in reason for reason in fallback_counts())


def test_empty_calls_return_the_mlx_backends_result():
    """No rows, no keys or head_dim 0: the result the "mlx" backend gives, never a planner error."""
    backend = cuda_emulator.backend()
    for shape_q, shape_k in (((1, 2, 5, 0), (1, 2, 7, 0)), ((1, 2, 0, 16), (1, 2, 7, 16)), ((1, 2, 5, 16), (1, 2, 0, 16))):
        q, k = mx.zeros(shape_q, mx.bfloat16), mx.zeros(shape_k, mx.bfloat16)
        for mask in (None, "causal"):
            out, lse = flash_attention(q, k, k, mask=mask, return_lse=True, backend=backend)
            ref_out, ref_lse = flash_attention(q, k, k, mask=mask, return_lse=True, backend="mlx")
            assert out.shape == ref_out.shape and np.array_equal(np.array(lse), np.array(ref_lse))
            grads = mx.grad(lambda q_, k_, v_: flash_attention(q_, k_, v_, mask=mask, backend=backend).sum(),
                            argnums=(0, 1, 2))(q, k, k)
            assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]


def test_empty_calls_with_sinks_match_the_mlx_backend():
    """With sinks, no keys or head_dim 0 still give the "mlx" backend's out, lse (the sink takes
    the probability left over) and d_sinks (common.empty_forward / empty_sinks_gradient)."""
    backend = cuda_emulator.backend()
    sinks = mx.array([0.5, -1.0], mx.bfloat16)
    for shape_q, shape_k in (((1, 2, 5, 0), (1, 2, 7, 0)), ((1, 2, 5, 16), (1, 2, 0, 16))):
        q, k = mx.ones(shape_q, mx.bfloat16), mx.zeros(shape_k, mx.bfloat16)

        def results(name):
            out, lse = flash_attention(q, k, k, mask="causal", sinks=sinks, return_lse=True, backend=name)
            d_sinks = mx.grad(lambda s: flash_attention(q, k, k, mask="causal", sinks=s, return_lse=True,
                                                        backend=name)[1].sum())(sinks)
            return [np.array(x.astype(mx.float32)) for x in (out, lse, d_sinks)]

        for got, want in zip(results(backend), results("mlx")):
            assert got.shape == want.shape and np.allclose(got, want)


@gpu
@sm90_only
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
    # Past D = 256: column groups, two warpgroups on 64 rows with half of D each (D = 512: 256 + 256;
    # D = 300: 192 + 108 and 84 columns of zeros; D = 448: 256 + 192; D = 500: 256 + 244).
    Case(head_dim=512, q_len=200, kv_len=333, dtype="bfloat16", mask="causal", group=2),
    Case(head_dim=300, q_len=150, kv_len=90, dtype="float16", mask="additive", softcap=10.0),
    Case(head_dim=448, q_len=130, kv_len=170, dtype="bfloat16", mask="bool", sinks=True),
    Case(head_dim=500, q_len=70, kv_len=260, dtype="float16", mask="causal_window", window=(40, -1)),
    # Scales the interior softmax's fold must not take (zero, negative: the row maximum of the
    # scaled scores is then the raw minimum), a large one, and column groups with lazy rescaling.
    Case(head_dim=64, q_len=400, kv_len=500, dtype="bfloat16", scale=-0.7),
    Case(head_dim=128, q_len=450, kv_len=400, dtype="float16", mask="causal", scale=0.0),
    Case(head_dim=128, q_len=300, kv_len=520, dtype="bfloat16", scale=2.0, group=2),
    Case(head_dim=512, q_len=200, kv_len=390, dtype="bfloat16", scale=-0.7, sinks=True),
    Case(head_dim=256, q_len=330, kv_len=410, dtype="bfloat16", scale=0.3),  # rows that fold
    Case(head_dim=192, q_len=260, kv_len=300, dtype="float16", mask="causal", scale=1.5),
], ids=lambda c: f"d{c.head_dim}-{c.mask}" + ("-sinks" if c.sinks else "")
   + ("" if c.scale is None else f"-scale{c.scale:g}"))
def test_wgmma_forward_matches_reference_and_mma(case):
    """The wgmma forward, as the table plans it and with the scale fold forced on (SCALE_FOLD),
    against float64 and against the mma.sync forward."""
    reset_fallback_counts()
    check_case(case, backend="cuda", gradients=False)
    check_case(case, backend=cuda.CUDABackend(tuning=Tuning(scale_fold=True)), gradients=False)
    a = make_arrays(case)
    outs = [flash_attention(a.q, a.k, a.v, mask=a.mask, return_lse=True, backend=cuda.CUDABackend(tuning=tuning),
                            **a.kwargs)
            for tuning in (Tuning(wgmma_forward=False), Tuning(wgmma_forward=True),
                           Tuning(wgmma_forward=True, scale_fold=True))]
    lse_mma = np.array(outs[0][1])
    finite = np.isfinite(lse_mma)
    for out, lse in outs[1:]:
        assert relative_error(to_numpy(out), to_numpy(outs[0][0])) < 1e-2
        lse_wgmma = np.array(lse)
        assert np.array_equal(np.isfinite(lse_wgmma), finite)
        assert relative_error(lse_wgmma[finite], lse_mma[finite]) < 1e-4
    assert not fallback_counts(), fallback_counts()  # every call ran the kernels (none failed to build)


@gpu
@sm90_only
@pytest.mark.parametrize("case", [
    Case(head_dim=64, q_len=700, kv_len=900, dtype="bfloat16"),
    Case(head_dim=64, q_len=385, kv_len=385, dtype="float16", mask="causal", group=2),
    Case(head_dim=64, q_len=300, kv_len=333, dtype="bfloat16", mask="bool", sinks=True),
    Case(head_dim=64, q_len=320, kv_len=520, dtype="float16", mask="additive", lse_gradient=True),
    Case(head_dim=56, q_len=400, kv_len=420, dtype="bfloat16", mask="causal_window", window=(50, 0)),
    Case(head_dim=64, q_len=200, kv_len=250, dtype="bfloat16", softcap=15.0, batch=2),
    Case(head_dim=50, q_len=260, kv_len=130, dtype="bfloat16", scale=-0.7),
    Case(head_dim=64, q_len=129, kv_len=1, dtype="bfloat16", mask="causal", sinks=True),
], ids=lambda c: f"d{c.head_dim}-{c.mask}-{c.q_len}x{c.kv_len}" + ("-sinks" if c.sinks else ""))
def test_forward_row_sums_by_mma(case):
    """The wgmma forward with its row sums by the tensor cores (MMA_SUMS: O += P [V | 1] with the
    ones in a panel beside each V stage): O, lse and the gradients (which read lse) against
    float64, and O / lse against the forward that sums in the softmax. The variant is asserted to
    take the option, so a plan change cannot empty the test."""
    reset_fallback_counts()
    a = make_arrays(case)
    spec = check_inputs(a.q, a.k, a.v, mask=a.mask, sinks=a.sinks, **a.kwargs)[0]
    on, off = (cuda.CUDABackend(tuning=Tuning(mma_sums=flag)) for flag in (True, False))
    assert on.variant("forward", spec).mma_sums and not off.variant("forward", spec).mma_sums
    check_case(case, backend=on)
    (out_on, lse_on), (out_off, lse_off) = (
        flash_attention(a.q, a.k, a.v, mask=a.mask, sinks=a.sinks, return_lse=True, backend=backend, **a.kwargs)
        for backend in (on, off))
    assert relative_error(to_numpy(out_on), to_numpy(out_off)) < 1e-2
    lse_on, lse_off = np.array(lse_on), np.array(lse_off)
    finite = np.isfinite(lse_off)
    assert np.array_equal(np.isfinite(lse_on), finite)
    assert relative_error(lse_on[finite], lse_off[finite]) < 1e-4
    assert not fallback_counts(), fallback_counts()


@gpu
@sm90_only
@pytest.mark.parametrize("case", [
    # D <= 64: three consumer warpgroups of 64 rows (BM = 192); last blocks of 1 (385), 10, 16
    # (400) and 8 (200) rows leave two of the three without a row, 128 (320) one.
    Case(head_dim=64, q_len=385, kv_len=300, dtype="bfloat16"),
    Case(head_dim=64, q_len=385, kv_len=385, dtype="float16", mask="causal", group=2),
    Case(head_dim=64, q_len=10, kv_len=333, dtype="bfloat16", mask="bool", sinks=True),
    Case(head_dim=48, q_len=400, kv_len=420, dtype="bfloat16", mask="causal_window", window=(50, 0)),
    Case(head_dim=64, q_len=200, kv_len=250, dtype="bfloat16", softcap=15.0, batch=2),
    Case(head_dim=64, q_len=320, kv_len=520, dtype="bfloat16", mask="additive"),
    # Two consumer warpgroups (BM = 128): 320 = 2 x 128 + 64, 257 and 192 rows.
    Case(head_dim=128, q_len=320, kv_len=300, dtype="bfloat16", group=2),
    Case(head_dim=128, q_len=257, kv_len=700, dtype="float16", mask="causal", sinks=True),
    Case(head_dim=96, q_len=192, kv_len=8300, dtype="bfloat16"),  # the wide forward (T = 176)
    Case(head_dim=200, q_len=257, kv_len=260, dtype="bfloat16", mask="window", window=(30, 40)),
], ids=lambda c: f"d{c.head_dim}-{c.mask}-{c.q_len}x{c.kv_len}")
def test_forward_warpgroups_without_rows(case):
    """The wgmma forward's last query block where its warpgroups of 64 rows outnumber its rows:
    those without a row run the key walk on zero-filled Q rows and must leave nothing in O or lse
    (nor in rows of the next head). Each case has such a warpgroup in the table's plan; O and lse
    against float64, and the calls are served by the kernels (none fell back)."""
    reset_fallback_counts()
    a = make_arrays(case)
    spec = check_inputs(a.q, a.k, a.v, mask=a.mask, sinks=a.sinks, **a.kwargs)[0]
    variant = cuda.CUDABackend().variant("forward", spec)
    rows_per_block = variant.parallel_block
    last_rows = case.q_len - (-(-case.q_len // rows_per_block) - 1) * rows_per_block
    assert variant.col_groups == 1 and last_rows <= rows_per_block - 64, (variant.name, last_rows)
    check_case(case, backend="cuda", gradients=False)
    assert not fallback_counts(), fallback_counts()


@gpu
@pytest.mark.parametrize("case", [
    Case(head_dim=64, q_len=900, kv_len=1000, dtype="bfloat16", mask="bool", group=2),
    Case(head_dim=128, q_len=1000, kv_len=777, dtype="float16", mask="additive", mask_shape=(True, False, True, True),
         batch=2, softcap=20.0),
    Case(head_dim=96, q_len=700, kv_len=700, dtype="bfloat16", mask="bool", mask_shape=(False, True, False, True)),
    Case(head_dim=256, q_len=600, kv_len=650, dtype="bfloat16", mask="additive", group=2, lse_gradient=True),
    Case(head_dim=160, q_len=650, kv_len=600, dtype="float16", mask="bool", mask_shape=(True, True, True, False)),
], ids=lambda c: f"d{c.head_dim}-{c.mask}-{c.q_len}x{c.kv_len}")
@pytest.mark.parametrize("wgmma", [None, False], ids=["table", "mma-sync"])
def test_array_masks_on_interior_blocks(case, wgmma):
    """Array masks where most blocks lie wholly inside the problem (the kernels' interior-tile path
    reads the mask without index tests or clamps): rows broadcast along the batch, heads, queries
    (one mask row for every query) or keys; softcap, GQA and an lse gradient. Every kernel of the
    table's plan and of the mma.sync plan against the float64 reference, forward and gradients."""
    reset_fallback_counts()
    check_case(case, backend=cuda.CUDABackend(tuning=Tuning(wgmma_forward=wgmma, wgmma_backward=wgmma)))
    assert not fallback_counts(), fallback_counts()


@gpu
@sm90_only
@pytest.mark.parametrize("head_dim,kv_len,dtype,mask", [
    (128, 517, "bfloat16", "causal"), (64, 390, "float16", None), (96, 200, "bfloat16", None),
    (176, 333, "bfloat16", "causal"), (256, 150, "float16", None), (512, 333, "bfloat16", "causal"),
    (296, 150, "float16", None)])
def test_wgmma_load_paths_agree_bitwise(head_dim, kv_len, dtype, mask):
    """The wgmma kernels load their streamed tiles with TMA where the rows allow (row-contiguous,
    mlx-lm's token-major views), else with per-element stores (rows at an odd offset): K and V in
    the forward and dQ kernels, Q in the dK/dV kernel (through one map over a kv head's two query
    heads here). Both fill shared memory with the same tile, zeros past N and past D included, so
    the outputs, lse and gradients agree bit for bit. Tails: N not a multiple of the blocks;
    D = 96 and 176 fill part of their last 64-column panel."""
    rng = np.random.default_rng(head_dim + kv_len)
    dt = getattr(mx, dtype)
    B, Hq, Hkv, Nq = 2, 4, 2, 300
    q, d_out = (mx.array(rng.standard_normal((B, Hq, Nq, head_dim)).astype(np.float32)).astype(dt) for _ in range(2))
    k, v = (mx.array(rng.standard_normal((B, Hkv, kv_len, head_dim)).astype(np.float32)).astype(dt) for _ in range(2))
    backend = cuda.CUDABackend()

    def run(layout):
        ql, kl, vl = laid_out(q, layout), laid_out(k, layout), laid_out(v, layout)

        out, lse = flash_attention(ql, kl, vl, mask=mask, return_lse=True, backend=backend)
        grads = mx.vjp(lambda q_, k_, v_: flash_attention(q_, k_, v_, mask=mask, backend=backend), [ql, kl, vl],
                       [d_out])[1]
        mx.eval(out, lse, grads)
        return [np.array(x.astype(mx.float32)) for x in (out, lse, *grads)]

    tma, tma_token_major, elementwise = run("row"), run("token_major"), run("offset")
    for name, a, b, c in zip(("out", "lse", "dq", "dk", "dv"), tma, tma_token_major, elementwise):
        assert np.array_equal(a, b) and np.array_equal(a, c), (name, head_dim, kv_len)


@gpu
@sm90_only
@pytest.mark.parametrize("case", [
    Case(head_dim=128, q_len=333, kv_len=517, dtype="bfloat16", mask="causal", group=2),
    Case(head_dim=64, q_len=300, kv_len=200, dtype="float16", mask="bool", mask_shape=(False, True, True, True)),
    Case(head_dim=72, q_len=100, kv_len=90, dtype="bfloat16", mask="additive", softcap=10.0, lse_gradient=True),
    Case(head_dim=37, q_len=130, kv_len=129, dtype="float16", mask="causal_window", window=(40, 5), group=3),
    Case(head_dim=200, q_len=150, kv_len=170, dtype="bfloat16", mask="causal", group=2),
    Case(head_dim=256, q_len=100, kv_len=140, dtype="float16", mask="bool", softcap=20.0),
    Case(head_dim=160, q_len=210, kv_len=300, dtype="bfloat16", mask="window", window=(70, 20)),  # three panels
    # dK/dV: lse2 / delta stages refilled (6 items a CTA) under a bool mask with softcap, GQA.
    Case(head_dim=96, q_len=150, kv_len=153, dtype="bfloat16", mask="bool", softcap=20.0, group=2),
    # Sinks: the dQ kernel's per-warp parts of d_sink (3 consumer warpgroups at D <= 64), rows with no key.
    Case(head_dim=64, q_len=333, kv_len=100, dtype="bfloat16", mask="causal", group=2, sinks=True, lse_gradient=True),
    Case(head_dim=128, q_len=200, kv_len=260, dtype="float16", mask="bool", softcap=10.0, sinks=True),
    # Past D = 256: dK/dV column groups in CTA slices of 256 columns, T = 16 (D = 300: the second
    # slice's second warpgroup has no column of D); dQ column groups of half of D on 64-column
    # panels (D = 300: 192 + 108 columns; sinks: only the first warpgroup writes its rows' part).
    Case(head_dim=512, q_len=150, kv_len=170, dtype="bfloat16", mask="causal", group=2),
    Case(head_dim=300, q_len=90, kv_len=133, dtype="float16", mask="additive", softcap=10.0),
    Case(head_dim=448, q_len=70, kv_len=100, dtype="bfloat16", mask="bool", sinks=True),
], ids=lambda c: f"d{c.head_dim}" + ("-sinks" if c.sinks else ""))
def test_wgmma_backward_matches_reference_and_mma(case):
    """The wgmma dQ and dK/dV kernels against float64, and against the mma.sync kernels."""
    _check_wgmma_backward(case)


def _check_wgmma_backward(case, blocks=()):
    """check_case with the wgmma backward, then its gradients against the mma.sync kernels'."""
    reset_fallback_counts()
    wgmma = cuda.CUDABackend(tuning=Tuning(blocks=blocks, wgmma_backward=True))
    check_case(case, backend=wgmma)
    grads = [_out_and_grads(case, backend)[1:]
             for backend in (wgmma, cuda.CUDABackend(tuning=Tuning(wgmma_backward=False)))]
    for name, g_wgmma, g_mma in zip(("dq", "dk", "dv", "d_sinks"), *grads):
        assert relative_error(g_wgmma, g_mma) < 2e-2, (case.head_dim, name)
    assert not fallback_counts(), fallback_counts()  # every call ran the kernels (none failed to build)


@gpu
@sm90_only
@pytest.mark.parametrize("scheme", [(128, 32, 160, 8), (128, 16, 160, 8), (128, 64, 128, 8), (64, 64, 128, 8)],
                         ids=["whole-T32", "whole-T16", "slices", "column-groups"])
def test_wgmma_key_value_schemes(scheme):
    """Past D = 128 the dK/dV kernel holds all of D per warpgroup (H >= D, up to 160), or splits
    it into 128-column CTAs (P = 128) or column groups (P = 64): each against float64 and mma.sync."""
    blocks = {"backward_key_value_wgmma": scheme}
    for case in (Case(head_dim=160, q_len=230, kv_len=200, dtype="bfloat16", mask="causal", group=2),
                 Case(head_dim=136, q_len=90, kv_len=170, dtype="float16", mask="bool", softcap=15.0)):
        a = make_arrays(case)
        variant = cuda.CUDABackend(tuning=Tuning(blocks=blocks, wgmma_backward=True)).variant(
            "backward_key_value", check_inputs(a.q, a.k, a.v)[0])
        assert (variant.slices * variant.col_groups == 1) == (scheme[2] >= variant.padded_dim)
        _check_wgmma_backward(case, blocks)


@gpu
@sm90_only
@pytest.mark.parametrize("case", [
    Case(head_dim=128, q_len=333, kv_len=517, dtype="bfloat16", mask="causal", group=2),
    Case(head_dim=64, q_len=300, kv_len=200, dtype="float16", mask="bool", mask_shape=(False, True, True, True)),
    Case(head_dim=96, q_len=150, kv_len=153, dtype="bfloat16", mask="bool", softcap=20.0, group=2),
    Case(head_dim=37, q_len=130, kv_len=129, dtype="float16", mask="causal", group=3, layout="offset"),
    Case(head_dim=72, q_len=100, kv_len=90, dtype="bfloat16", mask="additive", softcap=10.0, lse_gradient=True),
    # Nq > Nk under a causal mask: the first query blocks see no key (dQ 0); several key blocks
    # add into every query block (the order), strided rows (the producer's cp.async path).
    Case(head_dim=128, q_len=700, kv_len=300, dtype="bfloat16", mask="causal", layout="columns"),
    Case(batch=2, head_dim=64, q_len=1000, kv_len=900, dtype="bfloat16", mask="none", group=2),
    # the D = 97..112 row (its table option from 4096 queries): 4 key blocks, 9 query blocks
    Case(head_dim=112, q_len=520, kv_len=400, dtype="bfloat16", mask="none", group=2),
], ids=lambda c: f"d{c.head_dim}-{c.mask}-{c.q_len}x{c.kv_len}-{c.layout}")
def test_wgmma_fused_query_gradient(case):
    """The dK/dV kernel with fused dQ against float64; its gradients close to the two kernels'
    (dK and dV sum the query blocks in its own walk's order, so not bitwise theirs), and every
    gradient bitwise the same in a second run (the adds into dQ go in a fixed order)."""
    reset_fallback_counts()
    fused = cuda.CUDABackend(tuning=Tuning(wgmma_backward=True, fused_query=True))
    a = make_arrays(case)
    assert fused.variant("backward_key_value", check_inputs(a.q, a.k, a.v)[0]).fused_query
    check_case(case, backend=fused)
    first, second = _out_and_grads(case, fused), _out_and_grads(case, fused)
    apart = _out_and_grads(case, cuda.CUDABackend(tuning=Tuning(wgmma_backward=True, fused_query=False)))
    for x, y in zip(first, second):
        assert np.array_equal(x, y)
    for name, x, y in zip(("dq", "dk", "dv"), first[1:], apart[1:]):
        assert relative_error(x, y) < 1e-2, name
    assert not fallback_counts(), fallback_counts()  # every call ran the kernels (none failed to build)


@gpu
@sm90_only
def test_fused_query_by_length_on_the_gpu():
    """The shipped table's fused_dq_from<N> / fused_dq_causal_from<N> (D = 128 and 64) as calls
    meet them: "cuda" with no tuning runs the fused dK/dV kernel from N queries on (gradients close
    to the two kernels', no fallback; causal with Nq > Nk, so that query blocks no key block sees
    keep dQ = 0, exactly) and the two kernels below N."""
    reset_fallback_counts()
    backend = cuda.CUDABackend()
    apart = cuda.CUDABackend(tuning=Tuning(fused_query=False))
    for head_dim in (128, 64):  # the D = 113..128 and D = 49..64 rows
        row = planner.plan("cuda", "backward_key_value", head_dim, mx.bfloat16, "sm90_wgmma",
                           planner.shipped_table("cuda"))
        for mask, option in (("none", cuda_source.FUSED_QUERY), ("causal", cuda_source.FUSED_QUERY_CAUSAL)):
            start = cuda_source.option_keys(row.cached, option, "row")
            for q_len, fused in ((start, True), (start - 64, False)):
                case = Case(head_dim=head_dim, q_len=q_len, kv_len=200, dtype="bfloat16", mask=mask)
                a = make_arrays(case)
                spec = check_inputs(a.q, a.k, a.v, mask=a.mask)[0]
                assert backend.variant("backward_key_value", spec).fused_query == fused
                got, want = _out_and_grads(case, backend), _out_and_grads(case, apart)
                for name, x, y in zip(("dq", "dk", "dv"), got[1:], want[1:]):
                    assert relative_error(x, y) < 1e-2, (head_dim, mask, q_len, name)
                if mask == "causal":  # query rows before Nq - Nk see no key
                    assert not got[1][..., :q_len - 200, :].any(), (head_dim, q_len)
    assert not fallback_counts(), fallback_counts()


@gpu
@sm90_only
def test_forward_by_keys_on_the_gpu():
    """The shipped table's t<T>_from<N> (the forward's T = 176 from 8192 keys at D = 65..128) as
    calls meet it: from N keys on, the wide forward (edge tiles: N + 33 keys; bottom-right causal;
    GQA; sinks) against the float64 reference and the row's T, no fallback; below N the row's T."""
    reset_fallback_counts()
    backend = cuda.CUDABackend()
    narrow = cuda.CUDABackend(tuning=Tuning(blocks={"forward_wgmma": (128, 128, 128, 8)}))
    row = planner.plan("cuda", "forward", 128, mx.bfloat16, "sm90_wgmma", planner.shipped_table("cuda"))
    wide, start = cuda_source.long_keys_option(row.cached, "row")
    for case in (Case(head_dim=128, q_len=200, kv_len=start + 33, dtype="bfloat16"),
                 Case(head_dim=96, q_len=300, kv_len=start, dtype="float16", mask="causal", group=2),
                 Case(head_dim=128, q_len=130, kv_len=start + 200, dtype="bfloat16", sinks=True),
                 Case(head_dim=128, q_len=100, kv_len=start - 64, dtype="bfloat16")):
        a = make_arrays(case)
        spec = check_inputs(a.q, a.k, a.v, mask=a.mask, sinks=a.sinks)[0]
        t = backend.variant("forward", spec).traversal_block
        assert t == (wide if case.kv_len >= start else row.traversal_block), case
        check_case(case, backend=backend, gradients=False)
        got, want = (flash_attention(a.q, a.k, a.v, mask=a.mask, sinks=a.sinks, backend=b) for b in (backend, narrow))
        assert relative_error(to_numpy(got), to_numpy(want)) < 1e-2, case
    assert not fallback_counts(), fallback_counts()


@emulator
@pytest.mark.parametrize("head_dim,dtype,mask", [(37, "float16", "causal"), (64, "bfloat16", "none"),
                                                 (96, "float16", "none"), (128, "bfloat16", "causal"),
                                                 (128, "bfloat16", "none")])
def test_fused_query_accumulator_order(head_dim, dtype, mask):
    """The kernel that makes dQ of the fused dK/dV kernel's accumulator (run by the CPU emulator)
    puts every float where the dK/dV kernel's layout says (two 64 x 64 units a tile, each in its
    warpgroup's register order: float4 i of thread t at i * 128 + t; thread 32 warp + 4 g + tq
    holds row 16 warp + 8 hf + g, column 8 n + 2 tq + e at float 4 n + 2 hf + e), sums a query
    block's chains (two without a causal mask) in order, rounded to the input dtype as MLX rounds,
    writes no row past Nq (the emulator poisons outputs), and leaves out the tiles whose count is 0
    (no key block wrote them: their floats are garbage; a block with none written is zero)."""
    from dataclasses import replace

    from mlx_flash import inspect
    B, H, N = 2, 3, 150
    spec = replace(inspect.make_spec(head_dim, dtype, mask, q_len=N), batch=B, q_heads=H, kv_heads=H)
    variant = cuda_source.make_variant("backward_key_value", spec, None, SM90, Tuning(fused_query=True),
                                       real_sm90=True)
    assert variant.fused_query
    bn, tile, chains = variant.traversal_block, cuda.fused_tile_floats(variant), cuda.fused_chains(variant)
    assert chains == (1 if mask == "causal" else 2)
    blocks = -(-N // bn)
    acc = np.random.default_rng(head_dim).standard_normal((B, H, blocks, chains, tile)).astype(np.float32)
    # chain c of query block t counts t // 3^c % 3: every third tile of a chain unwritten, and with
    # two chains blocks with neither, either or both written
    tiles = np.arange(B * H * blocks, dtype=np.int32).reshape(B, H, blocks, 1)
    counts = tiles // 3 ** np.arange(chains, dtype=np.int32) % 3
    written = (counts != 0).sum(axis=3)
    assert all((written == n).any() for n in range(chains + 1))
    placed = np.zeros((B, H, blocks * bn, chains, head_dim), np.float32)
    for i in range(blocks * bn):
        for c in range(head_dim):
            r = i % bn
            unit, rr, cc = (r // 64, r % 64, c) if bn == 128 else (c // 64, r, c % 64)
            t = 32 * (rr // 16) + 4 * (rr % 8) + (cc % 8) // 2
            at = unit * 4096 + ((cc // 8) * 128 + t) * 4 + 2 * ((rr % 16) // 8) + cc % 2
            placed[:, :, i, :, c] = acc[:, :, i // bn, :, at]
    placed[np.repeat(counts == 0, bn, axis=2)] = 0.0
    want = placed[:, :, :, 0]
    for chain in range(1, chains):  # in chain order, in fp32
        want = want + placed[:, :, :, chain]
    backend = cuda.CUDABackend(kernel_factory=cuda_emulator.KernelFactory())
    dq = backend.query_from_accumulator(mx.array(acc), mx.array(counts), variant, spec)
    assert dq.shape == (B, H, N, head_dim) and dq.dtype == spec.dtype
    expected = mx.array(want[:, :, :N]).astype(spec.dtype)
    assert np.array_equal(np.array(dq.astype(mx.float32)), np.array(expected.astype(mx.float32)))


@pytest.mark.parametrize("head_dim", [1, 8, 37, 64, 128, 136, 512])
def test_prepare_lanes_cover_a_row(head_dim):
    """The preprocessing kernel's threads per row: a power of two up to a warp, enough for the
    row's 8-element chunks where a warp suffices, and whole warps per block."""
    lanes = cuda_source.prepare_lanes(head_dim)
    assert lanes in (1, 2, 4, 8, 16, 32)
    assert lanes == 32 or lanes * 8 >= head_dim
    assert lanes == 1 or (lanes // 2) * 8 < head_dim  # no more than needed
    assert cuda_source.prepare_rows_per_block(head_dim) * lanes == cuda_source.PREPARE_THREADS
    assert cuda_source.PREPARE_THREADS % 32 == 0


@emulator
@pytest.mark.parametrize("layout", ["row", "spread"], ids=["chunks", "elements"])
@pytest.mark.parametrize("head_dim,q_len", [(8, 33), (37, 19), (64, 70), (136, 9), (512, 5)])
def test_prepare_delta_and_lse2(head_dim, q_len, layout):
    """delta = rowsum(dO * O) - dL and lse2 = lse * log2(e) (+inf where lse = -inf) from the
    preprocessing kernel on the CPU emulator: 16-byte chunks for row-contiguous inputs (D % 8 ==
    0), element loads for strided columns ("spread") and D = 37; row counts that leave a warp's
    last rows, and a block's last warps, without a row."""
    from mlx_flash import inspect
    B, H = 2, 3
    spec = replace(inspect.make_spec(head_dim, "bfloat16", "none", q_len=q_len), batch=B, q_heads=H, kv_heads=H)
    rng = np.random.default_rng(head_dim + q_len)
    out, d_out = (mx.array(rng.standard_normal((B, H, q_len, head_dim)).astype(np.float32)).astype(mx.bfloat16)
                  for _ in range(2))
    lse_np = rng.standard_normal((B, H, q_len)).astype(np.float32)
    lse_np[0, 1, 0] = -np.inf
    d_lse_np = rng.standard_normal((B, H, q_len)).astype(np.float32)
    backend = cuda.CUDABackend(kernel_factory=cuda_emulator.KernelFactory(layout=layout))
    delta, lse2 = backend.prepare_backward(out, mx.array(lse_np), d_out, mx.array(d_lse_np), spec)
    o64, do64 = (np.array(x.astype(mx.float32)).astype(np.float64) for x in (out, d_out))
    want_delta = (o64 * do64).sum(-1) - d_lse_np
    np.testing.assert_allclose(np.array(delta), want_delta, rtol=1e-5, atol=1e-4 * np.sqrt(head_dim))
    want_lse2 = np.where(np.isneginf(lse_np), np.inf, lse_np * np.float32(1.4426950408889634))
    np.testing.assert_allclose(np.array(lse2), want_lse2, rtol=1e-6)


@emulator
@pytest.mark.parametrize("q_len", [1, 150, 257])
def test_fused_query_counts_start_at_zero(q_len):
    """Before a fused dK/dV kernel the prepare kernel (run by the CPU emulator, which poisons
    outputs) zeroes one count per (batch, query head, query block) that the kernel then updates,
    and computes delta and lse2 as it does without them."""
    from dataclasses import replace

    from mlx_flash import inspect
    B, H, D = 2, 3, 128
    spec = replace(inspect.make_spec(D, "bfloat16", "none", q_len=q_len), batch=B, q_heads=H, kv_heads=H)
    variant = cuda_source.make_variant("backward_key_value", spec, None, SM90, Tuning(fused_query=True),
                                       real_sm90=True)
    assert variant.fused_query
    rng = np.random.default_rng(q_len)
    out, d_out = (mx.array(rng.standard_normal((B, H, q_len, D)).astype(np.float32)).astype(mx.bfloat16)
                  for _ in range(2))
    lse = mx.array(rng.standard_normal((B, H, q_len)).astype(np.float32))
    backend = cuda.CUDABackend(kernel_factory=cuda_emulator.KernelFactory())
    delta, lse2, counts = backend.prepare_backward(out, lse, d_out, None, spec, variant)
    assert counts.shape == (B, H, -(-q_len // variant.traversal_block), 2) and counts.dtype == mx.int32
    assert not np.array(counts).any()
    want = backend.prepare_backward(out, lse, d_out, None, spec)
    assert len(want) == 2
    for got, expected in zip((delta, lse2), want):
        assert np.array_equal(np.array(got), np.array(expected))


_SOFTMAX_STEPS, _SOFTMAX_KEYS = 5, 48  # steps of one 16-row m-tile over 48 keys (NS = 6 n8 tiles)


def _emulated_softmax_steps(raw: np.ndarray, scale: float, lazy: bool, fold: bool):
    """softmax_scores_tile (kernels/attention_common.cuh) over the interior tiles of one warp's 16
    rows, step by step, on the CPU emulator: P of each step, corr of each step, the final running
    max (log2 units) and sum of each row."""
    from mlx_flash.render import template_text
    ns = _SOFTMAX_KEYS // 8
    body = f"""
  using namespace mlxflash;
  const int lane = threadIdx.x, g = lane / 4, tq = lane % 4;
  const float scale = fparams[0];
  const float scale_log2 = scale * 1.4426950408889634f;
  MaskRegs<0, {ns}, float> masks;
  float row_max[2] = {{-INFINITY, -INFINITY}}, row_sum[2] = {{0.f, 0.f}};
  for (int step = 0; step < {_SOFTMAX_STEPS}; ++step) {{
    float s[{ns}][4], corr[2];
    for (int n = 0; n < {ns}; ++n)
      for (int e = 0; e < 4; ++e) s[n][e] = scores[(step * 16 + g + 8 * (e / 2)) * {_SOFTMAX_KEYS} + 8 * n + 2 * tq + e % 2];
    softmax_scores_tile<false, false, false, 0, {str(lazy).lower()}, {str(fold).lower()}>(
        s, corr, row_max, row_sum, masks, 0, 0, true, 16, {_SOFTMAX_KEYS}, 0, 0, 0, scale, scale_log2, 0.f, tq);
    for (int n = 0; n < {ns}; ++n)
      for (int e = 0; e < 4; ++e) p[(step * 16 + g + 8 * (e / 2)) * {_SOFTMAX_KEYS} + 8 * n + 2 * tq + e % 2] = s[n][e];
    if (tq == 0) {{ corr_out[step * 16 + g] = corr[0]; corr_out[step * 16 + g + 8] = corr[1]; }}
  }}
  const float sum0 = quad_sum(row_sum[0]), sum1 = quad_sum(row_sum[1]);  // each thread holds its columns' part
  if (tq == 0) {{ stats[g] = row_max[0]; stats[g + 8] = row_max[1]; stats[16 + g] = sum0; stats[24 + g] = sum1; }}"""
    kernel = cuda_emulator.EmulatedKernel("softmax_steps", ["scores", "fparams"], ["p", "corr_out", "stats"], body,
                                          template_text("attention_common.cuh"), seed=1)
    p, corr, stats = kernel(inputs=[mx.array(raw), mx.array(np.array([scale, 0.0], np.float32))],
                            output_shapes=[raw.shape, (_SOFTMAX_STEPS * 16,), (32,)],
                            output_dtypes=[mx.float32] * 3, grid=(32, 1, 1), threadgroup=(32, 1, 1))
    stats = np.array(stats)
    return (np.array(p).reshape(_SOFTMAX_STEPS, 16, _SOFTMAX_KEYS), np.array(corr).reshape(_SOFTMAX_STEPS, 16),
            stats[:16], np.concatenate([stats[16:24], stats[24:32]]))


@emulator
@pytest.mark.parametrize("lazy", [False, True], ids=["eager-rescale", "lazy-rescale"])
@pytest.mark.parametrize("scale", [0.125, 3.0, -1.0, 0.0])
def test_emulated_softmax_fold(scale, lazy):
    """The forward's online softmax with the scale folded into exp2's FFMA (FOLD, which the wgmma
    forward uses and the emulator cannot run) against the unfolded one and float64: the same
    running maxima (the maximum of raw scores times a positive scale is the maximum of the scaled
    ones, bitwise), the same probabilities and log-sum-exp within float32 rounding. A negative or
    zero scale takes the unfolded path, bitwise; the scores span +-100, so a maximum taken the
    wrong way round overflows exp2 (2^288)."""
    rng = np.random.default_rng(7)
    raw = (rng.uniform(-100, 100, (_SOFTMAX_STEPS * 16, _SOFTMAX_KEYS)) * rng.uniform(0.01, 1, (_SOFTMAX_STEPS * 16, 1))
           ).astype(np.float32)
    scale_log2 = np.float32(scale) * np.float32(1.4426950408889634)
    scaled = (raw * scale_log2).reshape(_SOFTMAX_STEPS, 16, _SOFTMAX_KEYS)  # float32 products, as the kernel's
    runs = {fold: _emulated_softmax_steps(raw, scale, lazy, fold) for fold in (False, True)}
    for fold, (p, corr, row_max, row_sum) in runs.items():
        assert np.isfinite(p).all() and np.isfinite(row_sum).all(), fold
        # P relative to the running max (folded: exp2 of the max's rounding error, 2^-15 at |max| = 424)
        assert (p <= (2.0 ** 8 if lazy else 1.0) * (1 + 1e-4)).all(), fold
        if not lazy:  # the running max is the scaled scores' maximum, to the bit
            assert np.array_equal(row_max, scaled.max(axis=(0, 2))), fold
        # probabilities: P of step j times the later steps' corrections, over the final sum
        later = np.flip(np.cumprod(np.flip(np.concatenate([corr[1:], np.ones((1, 16), np.float32)]), 0), 0), 0)
        probs = p.astype(np.float64) * later[:, :, None] / row_sum[None, :, None]
        x = scaled.astype(np.float64) * np.log(2.0)
        want = np.exp(x - x.max(axis=(0, 2), keepdims=True))
        want /= want.sum(axis=(0, 2), keepdims=True)
        assert np.abs(probs - want).max() < 1e-5, (fold, np.abs(probs - want).max())
        lse2 = row_max + np.log2(row_sum.astype(np.float64))
        want_lse2 = np.log2(np.exp2(scaled.astype(np.float64)).sum(axis=(0, 2)))
        assert np.abs(lse2 - want_lse2).max() < 1e-5 * max(1.0, np.abs(want_lse2).max()), fold
    if scale <= 0:  # the unfolded path, to the bit
        for a, b in zip(runs[False], runs[True]):
            assert np.array_equal(a, b)
    else:  # within rounding: exp2(fma(s, c, -m)) against exp2(round(s c) - m)
        assert not np.array_equal(runs[False][0], runs[True][0])
        assert np.abs(runs[False][0] - runs[True][0]).max() < 1e-4


# ----------------------------------------------------------------------------- first contact
@dataclass(frozen=True)
class BrokenTemplate(cuda_emulator.KernelFactory):
    """The emulator's kernel factory with a broken template for kernels whose name holds `kernel`
    (their source fails to compile at first launch, as a compiler that rejects it would)."""

    kernel: str = "backward_query"

    def __call__(self, *, name, header, **kwargs):
        if self.kernel in name:
            header += "\nstatic_assert(false, \"forced failure\"); this is not C++;\n"
        return super().__call__(name=name, header=header, **kwargs)


def _broken_call_falls_back(backend, broken, transform=None, counted=2):
    """A call on `backend` whose `broken` kernel cannot be built: correct results through the
    fallback, one FallbackWarning naming the variant and the compiler's error, every call counted
    (`counted` calls reach flash_attention: a compiled function traces it once, a checkpointed
    one runs it again in the backward)."""
    guard.GUARD.forget()
    reset_fallback_counts()
    case = Case(head_dim=40, q_len=30, kv_len=37, dtype="bfloat16", mask="causal", group=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if transform is None:
            check_case(case, backend=backend)  # one forward call, one gradient call
        else:
            a = make_arrays(case)
            f = transform(lambda q_, k_, v_: flash_attention(q_, k_, v_, mask="causal", backend=backend).sum())
            mx.eval(f(a.q, a.k, a.v))
            mx.eval(f(a.q, a.k, a.v))
    messages = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    assert len(messages) == 1, messages
    a = make_arrays(case)
    name = backend.variant_name(broken, check_inputs(a.q, a.k, a.v, mask="causal")[0])
    assert name in messages[0] and "failed to compile or run" in messages[0], messages[0]
    assert sum(fallback_counts().values()) == counted
    guard.GUARD.forget()


@emulator
@pytest.mark.parametrize("broken", ["forward", "backward_query", "backward_key_value"])
def test_emulated_first_contact_failure_falls_back(broken):
    _broken_call_falls_back(cuda.CUDABackend(kernel_factory=BrokenTemplate(kernel=broken), capability=86), broken)


@emulator
@pytest.mark.parametrize("transform", ["grad", "compile", "checkpoint"])
def test_emulated_first_contact_under_transformations(transform):
    wrap = {"grad": lambda f: mx.grad(f, argnums=(0, 1, 2)),
            "compile": lambda f: mx.compile(mx.grad(f, argnums=(0, 1, 2))),
            "checkpoint": lambda f: mx.grad(mx.checkpoint(f), argnums=(0, 1, 2))}[transform]
    _broken_call_falls_back(cuda.CUDABackend(kernel_factory=BrokenTemplate(kernel="forward"), capability=80),
                            "forward", wrap, counted={"grad": 2, "compile": 1, "checkpoint": 4}[transform])


@gpu
def test_first_contact_failure_falls_back_on_the_gpu():
    """A template broken for NVRTC: the GPU's own compiler rejects it, the call is served elsewhere."""

    def broken_nvrtc(*, name, header, **kwargs):
        if "backward_key_value" in name:
            header += "\nstatic_assert(false, \"forced failure\");\n"
        return mx.fast.cuda_kernel(name=name, header=header, **kwargs)

    _broken_call_falls_back(cuda.CUDABackend(kernel_factory=broken_nvrtc), "backward_key_value")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc (the CUDA toolkit's compiler)")
def test_wgmma_kernels_compile_with_nvcc():
    """The wgmma templates compile for sm_90a (nothing else compiles them off the GPU: the
    emulator runs the mma.sync kernels only), sinks variants among them; ~35 s on the CI machine."""
    import importlib.util
    import tempfile
    path = os.path.join(os.path.dirname(cuda.__file__), "..", "..", "benchmarks", "cuda_compile.py")
    spec = importlib.util.spec_from_file_location("cuda_compile", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with tempfile.TemporaryDirectory() as tmp:
        # D = 37: one panel, under the 64 columns of a column group (a template instantiated at
        # every D once failed to compile there, and the calls fell back)
        for kernel, head_dim in [(kernel, d) for d in (37, 128, 512) for kernel in planner.KERNELS]:
            line = module.compile_variant(_variant(kernel, head_dim, Tuning(), real_sm90=True), "sm_90a", tmp)
            assert not line.startswith("ERROR") and "SERIALIZED" not in line, line
        for kernel, head_dim in [(k, d) for d in (64, 128, 512) for k in ("forward", "backward_query")]:
            # with attention sinks (a float pointer after the mask; the dQ kernel writes d_sinks parts)
            q = mx.zeros((1, 2, 8, head_dim), mx.bfloat16)
            spec, _ = check_inputs(q, q, q, mask="causal", sinks=mx.zeros((2,), mx.bfloat16))
            variant = cuda_source.make_variant(kernel, spec, None, SM90, Tuning(), True)
            assert variant.sinks
            line = module.compile_variant(variant, "sm_90a", tmp)
            assert not line.startswith("ERROR") and "SERIALIZED" not in line, line
        for head_dim in (64, 128, 512):  # the forward with the scale fold (forced at D = 512)
            variant = _variant("forward", head_dim, Tuning(scale_fold=True), real_sm90=True)
            assert variant.scale_fold
            line = module.compile_variant(variant, "sm_90a", tmp)
            assert not line.startswith("ERROR") and "SERIALIZED" not in line, line
        for head_dim in (64, 128):  # the dK/dV kernel with fused dQ (off on every table row)
            variant = _variant("backward_key_value", head_dim, Tuning(fused_query=True), real_sm90=True)
            assert variant.fused_query
            line = module.compile_variant(variant, "sm_90a", tmp)
            assert not line.startswith("ERROR") and "SERIALIZED" not in line, line
            # and the kernel that makes dQ of its accumulator
            text = module.compile_unit(f"dq_from_acc_{head_dim}", module.wrapped(
                cuda_source.query_from_accumulator_source(variant.input_type, head_dim, variant.traversal_block,
                                                          cuda.fused_chains(variant)),
                variant.input_type), "sm_90a", tmp)
            assert not text.startswith("ERROR"), text
            # and the prepare kernel that zeroes its counts
            text = module.compile_unit(f"prepare_counts_{head_dim}", module.wrapped(
                cuda_source.prepare_source(variant.input_type, head_dim, False, variant.traversal_block,
                                           cuda.fused_chains(variant)),
                variant.input_type), "sm_90a", tmp)
            assert not text.startswith("ERROR"), text

"""The "metal" backend's kernels (forward, dQ, dK/dV) against the float64 reference.

No Apple GPU is needed: MLX_FLASH_METAL_SIM=1 (set for this whole module) runs the kernels
through mlx_flash.metalsim, which compiles the same Metal source to C++ and runs each GPU
thread as a fiber (barriers and SIMD-group functions are real synchronisation points).

Compiling a kernel variant dominates on a fresh machine (~3 s each, 3 per configuration), so
the property test runs over a fixed list of configurations (GPU family, head dim, dtype, mask
kind, softcap) that together cover every head dim of HEAD_DIMS, both block tables, every dtype
and mask kind, every cached-operand combination of each kernel in kernels/blocks_metal.txt and
the spill-to-output path (D > 256); hypothesis draws the sizes (lengths incl. 1 and primes,
batch, GQA group, window sides, mask broadcasting, lse cotangent) within each configuration,
so each configuration compiles once.
"""
from __future__ import annotations

import dataclasses
import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metal_compiler import require_metal_compiler  # noqa: E402
require_metal_compiler()

from attention_cases import Case, check_case, environment, make_arrays  # noqa: E402
from mlx_flash import fallback_counts, flash_attention, reset_fallback_counts  # noqa: E402
from mlx_flash.backends import metal as metal_backend  # noqa: E402
from mlx_flash.backends.metal_source import (THREADGROUP_MEMORY_LIMIT, KernelVariant,  # noqa: E402
                                             check_launch_limits, make_variant)
from mlx_flash.planner import KERNELS, families, load_table, plan  # noqa: E402
from mlx_flash.spec import check_inputs  # noqa: E402

HEAD_DIMS = [1, 7, 8, 16, 24, 33, 64, 80, 96, 128, 160, 257, 320]

# (family, head_dim, dtype, mask, softcap). The comments give the cached operands of the
# forward / dQ / dK-dV plans ("-" = nothing cached: every operand streams, accumulators spill).
CONFIGS = [
    ("m3", 1, "float32", "none", None),              # O,Q / Q,dO,dQ / K,V,dK,dV
    ("m1", 7, "float16", "causal", 5.0),             # O,Q / Q,dQ / V,dK,dV
    ("m3", 8, "bfloat16", "window", None),           # O,Q / Q,dO,dQ / K,V,dK,dV
    ("m1", 16, "float32", "bool", None),             # O,Q / Q,dQ / V,dK,dV
    ("m3", 24, "float16", "additive", 30.0),         # O,Q / Q,dO,dQ / K,V,dK,dV
    ("m1", 24, "float32", "none", None),             # O,Q / dQ / dK,dV   (H = 24)
    ("m1", 33, "bfloat16", "causal_window", None),   # O,Q / dQ / dV
    ("m3", 64, "float32", "causal", 0.5),            # O / Q,dQ / V,dK,dV
    ("m1", 80, "float16", "bool", None),             # O,Q / dQ / dV
    ("m3", 96, "bfloat16", "none", None),            # O,Q / Q,dQ / dK,dV
    ("m1", 128, "float16", "additive", None),        # Q / - / -
    ("m3", 160, "float16", "causal", 5.0),           # O / Q,dQ / dV
    ("m1", 257, "bfloat16", "window", None),         # - / - / -   (spill, fp32 scratch)
    ("m3", 257, "float16", "bool", None),            # - / - / -
    ("m3", 320, "float32", "causal_window", 0.5),    # - / - / -   (spill into the fp32 outputs)
]


def config_id(config) -> str:
    family, head_dim, dtype, mask, softcap = config
    return f"{family}-d{head_dim}-{dtype}-{mask}" + (f"-cap{softcap}" if softcap else "")


@pytest.fixture(autouse=True, scope="module")
def simulated_metal():
    with environment(MLX_FLASH_METAL_SIM="1"):
        yield


def run_case(case: Case, family: str, **check):
    with environment(MLX_FLASH_METAL_FAMILY=family):
        return check_case(case, backend="metal", **check)


@st.composite
def config_cases(draw, config):
    """Cases of one configuration; sizes shrink with the head dim to bound simulation time."""
    family, head_dim, dtype, mask, softcap = config
    max_len = 150 if head_dim <= 96 else 90
    window = (-1, -1)
    if mask in ("window", "causal_window"):
        # (-1, -1) would be no window at all: a different (uncompiled) variant.
        window = draw(st.tuples(st.integers(-1, 40), st.integers(-1, 40)).filter(lambda w: w != (-1, -1)))
    return Case(
        batch=draw(st.integers(1, 2)),
        kv_heads=draw(st.integers(1, 2)),
        group=draw(st.integers(1, 3)),
        q_len=draw(st.one_of(st.integers(1, max_len), st.sampled_from([1, 2, 13, 31, 127]))),
        kv_len=draw(st.one_of(st.integers(1, max_len), st.sampled_from([1, 3, 17, 67, 131]))),
        head_dim=head_dim, dtype=dtype, mask=mask, window=window, softcap=softcap,
        mask_shape=tuple(draw(st.booleans()) for _ in range(4)),
        lse_gradient=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


# A few examples per configuration (3 under the "ci" profile, 12 under "dev").
EXAMPLES_PER_CONFIG = max(3, settings().max_examples // 8)


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_property_suite(config):
    @settings(max_examples=EXAMPLES_PER_CONFIG)
    @given(config_cases(config))
    def check(case):
        run_case(case, family=config[0])

    check()


# Explicit edge cases, each in the variants of a configuration above (no extra compiles).
EDGE_CASES = [
    ("m3", Case(head_dim=1, q_len=1, kv_len=1)),
    ("m1", Case(head_dim=7, q_len=23, kv_len=5, dtype="float16", mask="causal", softcap=5.0)),  # rows see no key
    ("m3", Case(head_dim=8, q_len=40, kv_len=9, dtype="bfloat16", mask="window", window=(0, 0))),
    ("m3", Case(head_dim=96, q_len=131, kv_len=300, dtype="bfloat16", batch=1)),  # 3 key blocks of 128
    ("m1", Case(head_dim=16, q_len=97, kv_len=61, mask="bool", mask_shape=(False, False, True, False))),
    ("m3", Case(head_dim=257, q_len=70, kv_len=45, dtype="float16", mask="bool", group=4,
                mask_shape=(True, True, False, True), lse_gradient=True)),
    ("m3", Case(head_dim=320, q_len=41, kv_len=150, mask="causal_window", window=(30, 2), softcap=0.5,
                group=2, kv_heads=2)),
]


@pytest.mark.parametrize("family,case", EDGE_CASES,
                         ids=[f"{f}-d{c.head_dim}-{c.mask}-{c.q_len}x{c.kv_len}" for f, c in EDGE_CASES])
def test_edge_cases(family, case):
    run_case(case, family)


# The simulator's faithfulness modes: threads run in reversed order between synchronisation
# points (exposes missing barriers) and bounds-checked pointers (any out-of-bounds read or
# write of a buffer or the threadgroup tile raises). Reversed order does not recompile.
MODE_CASES = [
    ("m3", Case(head_dim=24, q_len=45, kv_len=77, dtype="float16", mask="additive", softcap=30.0,
                mask_shape=(True, False, True, True), group=2)),
    ("m1", Case(head_dim=80, q_len=66, kv_len=37, dtype="float16", mask="bool", batch=2)),
    ("m3", Case(head_dim=320, q_len=19, kv_len=70, mask="causal_window", window=(25, 3), softcap=0.5,
                group=3, lse_gradient=True)),
]


@pytest.mark.parametrize("family,case", MODE_CASES, ids=[f"{f}-d{c.head_dim}" for f, c in MODE_CASES])
def test_reversed_thread_order(family, case):
    with environment(MLX_FLASH_METALSIM_ORDER="reversed"):
        run_case(case, family)


@pytest.mark.parametrize("family,case", MODE_CASES[1:], ids=[f"{f}-d{c.head_dim}" for f, c in MODE_CASES[1:]])
def test_bounds_checked(family, case):
    with environment(MLX_FLASH_METALSIM_CHECK="bounds", MLX_FLASH_METALSIM_ORDER="reversed"):
        run_case(case, family)


def _gradients(case: Case, family: str):
    a = make_arrays(case)

    def loss(q, k, v):
        o = flash_attention(q, k, v, mask=a.mask, backend="metal", **a.kwargs)
        return (o.astype(mx.float32) * a.d_out.astype(mx.float32)).sum()

    with environment(MLX_FLASH_METAL_FAMILY=family):
        grads = mx.grad(loss, argnums=(0, 1, 2))(a.q, a.k, a.v)
        mx.eval(grads)
    return [np.array(g.astype(mx.float32)) for g in grads]


def test_gradients_bitwise_deterministic():
    case = Case(head_dim=257, q_len=50, kv_len=70, dtype="float16", mask="bool", group=3, kv_heads=2)
    first, second = _gradients(case, "m3"), _gradients(case, "m3")
    for name, x, y in zip(("dq", "dk", "dv"), first, second):
        assert np.array_equal(x, y), f"{name} differs between two identical backward runs"


def test_new_sequence_length_does_not_recompile():
    backend = metal_backend.BACKEND
    case = Case(head_dim=64, q_len=33, kv_len=40, mask="causal", softcap=0.5, batch=2)
    run_case(case, "m3")
    compiled = backend.compiled_count
    for q_len, kv_len, batch, group in ((71, 19, 1, 2), (5, 129, 2, 1)):
        run_case(dataclasses.replace(case, q_len=q_len, kv_len=kv_len, batch=batch, group=group,
                                     seed=q_len), "m3")
    assert backend.compiled_count == compiled, "a new length, batch or head count compiled a new kernel"


@pytest.mark.parametrize("kernel", KERNELS)
def test_launch_limits_every_table_row(kernel):
    """Threadgroup memory (from the plan) and threads fit Apple GPU limits for D up to 512."""
    for family in families("metal"):
        for dtype in (mx.float32, mx.float16, mx.bfloat16):
            for head_dim in range(1, 513):
                spec, _ = check_inputs(mx.zeros((1, 1, 1, head_dim), dtype), mx.zeros((1, 1, 1, head_dim), dtype),
                                       mx.zeros((1, 1, 1, head_dim), dtype))
                variant = make_variant(kernel, spec, family)
                check_launch_limits(variant)
                assert variant.threadgroup_memory_bytes <= THREADGROUP_MEMORY_LIMIT
                assert variant.threads_per_threadgroup <= 1024


def test_launch_limits_are_enforced():
    too_big = dataclasses.replace(plan("metal", "forward", 64, mx.float32, "m3"), traversal_block=1024, head_block=64)
    variant = KernelVariant("forward", too_big, "float32", "none", False, False, False)
    with pytest.raises(ValueError, match="threadgroup memory"):
        check_launch_limits(variant)


def test_every_table_row_is_exercised_by_a_cached_combination():
    """Each distinct cached-operand set of the table appears in CONFIGS (so it ran above)."""
    table = {(r.kernel, r.cached) for r in load_table("metal")}
    covered = set()
    for family, head_dim, dtype, *_ in CONFIGS:
        for kernel in KERNELS:
            covered.add((kernel, plan("metal", kernel, head_dim, getattr(mx, dtype), family).cached))
    assert table <= covered, f"cached sets never tested: {sorted(table - covered, key=str)}"


def test_grid_counts_threads_of_whole_threadgroups(monkeypatch):
    """grid = threadgroups * threadgroup size per dimension (ml-explore/mlx#4534)."""
    calls = []

    def recorder(**kwargs):
        calls.append(kwargs)
        return [mx.zeros(shape, dtype) for shape, dtype in zip(kwargs["output_shapes"], kwargs["output_dtypes"])]

    backend = metal_backend.MetalBackend(family="m1")
    monkeypatch.setattr(backend, "kernel", lambda variant: recorder)
    q = mx.zeros((3, 4, 70, 40))
    k = mx.zeros((3, 2, 50, 40))
    spec, _ = check_inputs(q, k, k)
    backend.forward(q, k, k, None, spec)
    backend.backward_key_value(q, k, k, None, q, mx.zeros((3, 4, 70)), q, None, spec)
    (fwd, kv) = calls
    # forward: P = 32 queries -> 128 threads; ceil(70 / 32) = 3 threadgroups.
    assert fwd["threadgroup"] == (128, 1, 1) and fwd["grid"] == (3 * 128, 4, 3)
    # dK/dV: one threadgroup per 32 keys of each kv head.
    assert kv["threadgroup"] == (128, 1, 1) and kv["grid"] == (2 * 128, 2, 3)


def test_family_detection():
    assert metal_backend.family_from_architecture("applegpu_g13s") == "m1"
    assert metal_backend.family_from_architecture("applegpu_g14g") == "m1"
    assert metal_backend.family_from_architecture("applegpu_g15p") == "m3"
    assert metal_backend.family_from_architecture("applegpu_g16s") == "m3"
    assert metal_backend.family_from_architecture("unknown") is None
    with environment(MLX_FLASH_METAL_FAMILY="m1"):
        assert metal_backend.BACKEND.family() == "m1"
    with environment(MLX_FLASH_METAL_FAMILY="m7"):
        with pytest.raises(ValueError, match="MLX_FLASH_METAL_FAMILY"):
            metal_backend.BACKEND.family()
    assert metal_backend.MetalBackend(family="m3").family() == "m3"


def test_auto_selects_metal_under_the_simulator():
    from mlx_flash.backends import select_backend
    spec, _ = check_inputs(mx.zeros((1, 1, 4, 8)), mx.zeros((1, 1, 4, 8)), mx.zeros((1, 1, 4, 8)))
    assert select_backend("auto", spec, None).name == "metal"


def test_value_dim_mismatch_falls_back_counted():
    reset_fallback_counts()
    q = mx.ones((1, 1, 4, 8))
    v = mx.ones((1, 1, 4, 16))
    with pytest.warns(UserWarning, match="value_dim"):
        out = flash_attention(q, q, v, backend="metal")
    assert out.shape == (1, 1, 4, 16)
    assert sum(n for reason, n in fallback_counts().items() if "value_dim" in reason) == 1


def test_empty_sequences():
    q = mx.zeros((1, 2, 0, 8))
    k = mx.zeros((1, 2, 5, 8))
    out, lse = flash_attention(q, k, k, return_lse=True, backend="metal")
    assert out.shape == (1, 2, 0, 8) and lse.shape == (1, 2, 0)
    q = mx.ones((1, 2, 3, 8))
    k = mx.zeros((1, 2, 0, 8))
    out, lse = flash_attention(q, k, k, return_lse=True, backend="metal")
    assert np.array_equal(np.array(out), np.zeros((1, 2, 3, 8)))
    assert np.all(np.isneginf(np.array(lse)))
    grads = mx.grad(lambda q_: flash_attention(q_, k, k, backend="metal").sum())(q)
    assert np.array_equal(np.array(grads), np.zeros((1, 2, 3, 8)))


def test_fully_masked_rows_give_zero_output_and_gradient():
    """Rows whose every key is masked: out 0, lse -inf, no NaN anywhere in the gradients."""
    q = mx.array(np.random.default_rng(1).standard_normal((1, 1, 12, 16)).astype(np.float32))
    keep = np.ones((1, 1, 12, 12), bool)
    keep[0, 0, [2, 7]] = False
    with environment(MLX_FLASH_METAL_FAMILY="m1"):
        out, lse = flash_attention(q, q, q, mask=mx.array(keep), return_lse=True, backend="metal")
        dq = mx.grad(lambda x: flash_attention(x, q, q, mask=mx.array(keep), backend="metal").sum())(q)
    assert np.all(np.array(out)[0, 0, [2, 7]] == 0)
    assert np.all(np.isneginf(np.array(lse)[0, 0, [2, 7]]))
    assert np.all(np.array(dq)[0, 0, [2, 7]] == 0) and not np.isnan(np.array(dq)).any()
    assert math.isfinite(float(lse[0, 0, 0]))


def test_head_dim_zero_matches_the_mlx_backend():
    """head_dim 0: empty out, lse of the mask alone (log of the visible key count), as "mlx"."""
    q, k = mx.zeros((1, 2, 5, 0)), mx.zeros((1, 2, 7, 0))
    for mask in (None, "causal"):
        out, lse = flash_attention(q, k, k, mask=mask, return_lse=True, backend="metal")
        ref_out, ref_lse = flash_attention(q, k, k, mask=mask, return_lse=True, backend="mlx")
        assert out.shape == ref_out.shape and np.allclose(np.array(lse), np.array(ref_lse))


# Attention sinks: the forward's initial row state and the dQ kernel's per-simdgroup parts of the
# sink gradient. The cases cover cached and spilled O / dQ (D = 257), GQA, rows that see no key
# (causal with Nq > Nk, fully masked bool rows), the lse cotangent and both families.
SINK_CASES = [
    ("m3", Case(head_dim=24, q_len=45, kv_len=77, dtype="float16", mask="additive", softcap=30.0, group=2,
                sinks=True, lse_gradient=True)),
    ("m1", Case(head_dim=16, q_len=97, kv_len=61, mask="bool", mask_shape=(False, False, True, False),
                sinks=True, kv_heads=2)),
    ("m1", Case(head_dim=7, q_len=23, kv_len=5, dtype="float16", mask="causal", softcap=5.0, sinks=True,
                batch=2, lse_gradient=True)),
    ("m3", Case(head_dim=257, q_len=70, kv_len=45, dtype="bfloat16", mask="window", window=(9, 4), group=3,
                sinks=True, lse_gradient=True)),
]


@pytest.mark.parametrize("family,case", SINK_CASES, ids=[f"{f}-d{c.head_dim}-{c.mask}" for f, c in SINK_CASES])
def test_sinks(family, case):
    errors = run_case(case, family)
    assert "d_sinks" in errors


def test_sinks_bounds_checked_reversed_and_deterministic():
    family, case = SINK_CASES[0]
    with environment(MLX_FLASH_METALSIM_CHECK="bounds", MLX_FLASH_METALSIM_ORDER="reversed"):
        run_case(case, family)
    a = make_arrays(case)

    def d_sinks():
        def loss(s):
            o = flash_attention(a.q, a.k, a.v, mask=a.mask, sinks=s, backend="metal", **a.kwargs)
            return (o.astype(mx.float32) * a.d_out.astype(mx.float32)).sum()
        with environment(MLX_FLASH_METAL_FAMILY=family):
            return np.array(mx.grad(loss)(a.sinks).astype(mx.float32))

    assert np.array_equal(d_sinks(), d_sinks())


def test_sinks_with_no_key():
    q, sinks = mx.ones((1, 2, 3, 8)), mx.array([0.5, -1.0])
    k = mx.zeros((1, 2, 0, 8))
    out, lse = flash_attention(q, k, k, sinks=sinks, return_lse=True, backend="metal")
    assert np.array_equal(np.array(out), np.zeros((1, 2, 3, 8)))
    assert np.allclose(np.array(lse), np.array(sinks)[None, :, None])
    d_sinks = mx.grad(lambda s: flash_attention(q, k, k, sinks=s, return_lse=True, backend="metal")[1].sum())(sinks)
    assert np.allclose(np.array(d_sinks), [3.0, 3.0])

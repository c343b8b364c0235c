"""The backends' variant-set caches (cuda_source.variant_set, metal_source.variant_set).

A call's three kernel variants are made once per (compiled features, family, tuning, table) and
handed out as one object. These tests check that the cached set is exactly what make_variant
gives for the call's own spec (the features hold everything a variant reads), that calls which
differ only in runtime data share it, that a tuned table takes effect at once, and that the
first-contact guard still checks each set once. No kernel runs: the kernel factory is a stub.
"""
from __future__ import annotations

import dataclasses
import itertools

import mlx.core as mx
import pytest

from mlx_flash import flash_attention, planner, tune, tuned
from mlx_flash.backends import cuda_source, guard, metal_source
from mlx_flash.backends.cuda import CUDABackend
from mlx_flash.backends.cuda_source import Tuning
from mlx_flash.backends.metal import MetalBackend
from mlx_flash.spec import check_inputs

pytestmark = pytest.mark.usefixtures("on_cpu")

WGMMA = Tuning(wgmma_forward=True, wgmma_backward=True)


def _stub_factory(**kwargs):
    """A kernel factory whose kernels return zeros of the output shapes without running anything."""
    def kernel(*, inputs, output_shapes, output_dtypes, **unused):
        return [mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
    return kernel


def _spec(head_dim=64, dtype=mx.float16, mask=None, window=None, softcap=None, sinks=False, q_len=8, kv_len=8,
          heads=(2, 1), batch=1, scale=None):
    q = mx.zeros((batch, heads[0], q_len, head_dim), dtype)
    k = mx.zeros((batch, heads[1], kv_len, head_dim), dtype)
    if mask in ("bool", "additive"):
        mask = mx.zeros((q_len, kv_len), mx.bool_ if mask == "bool" else mx.float32 if dtype == mx.float32 else dtype)
    spec, mask_array = check_inputs(q, k, k, mask=mask, window_size=window, softcap=softcap, scale=scale,
                                    sinks=mx.zeros((heads[0],), dtype) if sinks else None)
    return spec, None if mask_array is None else mask_array.dtype


# Every compiled feature varied at least once, at head dims across the tables' rows.
FEATURES = [dict(head_dim=d, dtype=t) for d, t in itertools.product((1, 40, 64, 128, 200, 512),
                                                                     (mx.float16, mx.bfloat16))] + [
    dict(mask="causal"), dict(mask="bool"), dict(mask="additive"), dict(mask="additive", dtype=mx.bfloat16),
    dict(window=(5, 0)), dict(softcap=30.0), dict(sinks=True), dict(mask="causal", window=(3, -1), softcap=2.0,
                                                                    sinks=True, head_dim=96)]


@pytest.mark.parametrize("capability,tuning,real_sm90", [(90, Tuning(), False), (90, WGMMA, True), (80, Tuning(), False),
                                                         (86, Tuning(block_major=True), False)])
def test_cuda_set_is_make_variant_of_the_call(capability, tuning, real_sm90):
    family = cuda_source.family_of(capability)
    table = planner.shipped_table("cuda")
    for features in FEATURES:
        spec, mask_dtype = _spec(**features)
        got = cuda_source.variant_set(cuda_source.VariantFeatures.of(spec), mask_dtype, family, tuning, real_sm90,
                                      table)
        want = tuple(cuda_source.make_variant(kernel, spec, mask_dtype, family, tuning, real_sm90, table)
                     for kernel in planner.KERNELS)
        assert tuple(got) == want, features


@pytest.mark.parametrize("family", ["m1", "m3"])
def test_metal_set_is_make_variant_of_the_call(family):
    table = planner.shipped_table("metal")
    for features in FEATURES + [dict(dtype=mx.float32), dict(dtype=mx.float32, head_dim=256, mask="additive")]:
        spec, _ = _spec(**features)
        got = metal_source.variant_set(metal_source.VariantFeatures.of(spec), family, table)
        assert tuple(got) == tuple(metal_source.make_variant(kernel, spec, family, table)
                                   for kernel in planner.KERNELS), features


def test_runtime_data_shares_one_set():
    """Lengths, batch, heads, scale and the window's and softcap's values are runtime data: one set."""
    cuda_backend, metal_backend = CUDABackend(kernel_factory=_stub_factory, capability=90), MetalBackend("m3")
    base, _ = _spec(mask="causal", window=(4, 0), softcap=5.0)
    others = [_spec(mask="causal", window=(9, 2), softcap=1.5, q_len=1, kv_len=700 + i, heads=(8, 2), batch=3,
                    scale=0.3)[0] for i in range(3)]
    for backend in (cuda_backend, metal_backend):
        assert all(backend.variants(spec) is backend.variants(base) for spec in others)
    assert cuda_backend.variants(base) is not cuda_backend.variants(_spec(mask="causal", softcap=5.0)[0])
    assert cuda_backend.variants(base, mx.bool_) is not cuda_backend.variants(base)  # the mask dtype is compiled in


def test_fused_query_by_length():
    """The wgmma dK/dV row's fused_dq_from<N> and fused_dq_causal_from<N> (the shipped table:
    1024 and 4096 at D = 113..128, 4096 and 8192 at D = 49..64): calls of at least N queries without an
    array mask get a set of their own whose dK/dV variant accumulates dQ (so the first-contact guard
    checks it apart);
    shorter, masked or windowed calls, D on other rows (96, 160) and calls with sinks get the
    other set; Tuning.fused_query forces one choice at every length."""
    table = planner.shipped_table("cuda")
    row = planner.plan("cuda", "backward_key_value", 128, mx.bfloat16, "sm90_wgmma", table)
    starts = {causal: cuda_source.option_keys(row.cached, option, "row")
              for causal, option in ((False, cuda_source.FUSED_QUERY), (True, cuda_source.FUSED_QUERY_CAUSAL))}
    assert starts == {False: 1024, True: 4096}
    backend = CUDABackend(kernel_factory=_stub_factory, capability=90, tuning=WGMMA)
    base = dict(head_dim=128, dtype=mx.bfloat16, kv_len=64, heads=(1, 1))
    for causal, start in starts.items():
        mask = dict(mask="causal") if causal else {}
        long, _ = _spec(**base, **mask, q_len=start)
        below, _ = _spec(**base, **mask, q_len=start - 1)
        assert backend.variants(long).backward_key_value.fused_query, causal
        assert not backend.variants(below).backward_key_value.fused_query, causal
        assert backend.variants(long) is not backend.variants(below)
        assert backend.variant_key(long) != backend.variant_key(below)
        assert backend.variants(long).forward == backend.variants(below).forward  # only dK/dV changes
    # the D = 97..112 row: from 4096 without a causal mask only; D = 65..96 never
    row = planner.plan("cuda", "backward_key_value", 112, mx.bfloat16, "sm90_wgmma", table)
    assert cuda_source.option_keys(row.cached, cuda_source.FUSED_QUERY, "row") == 4096
    assert cuda_source.option_keys(row.cached, cuda_source.FUSED_QUERY_CAUSAL, "row") is None
    # the D = 49..64 row: from 4096 queries, causal from 8192; D <= 48 and D = 65..96 never
    row = planner.plan("cuda", "backward_key_value", 64, mx.bfloat16, "sm90_wgmma", table)
    assert [cuda_source.option_keys(row.cached, option, "row")
            for option in (cuda_source.FUSED_QUERY, cuda_source.FUSED_QUERY_CAUSAL)] == [4096, 8192]
    for head_dim, q_len, mask, fused in ((112, 4096, {}, True), (112, 4095, {}, False),
                                         (112, 16384, dict(mask="causal"), False), (97, 4096, {}, True),
                                         (96, 16384, {}, False), (64, 4096, {}, True), (64, 4095, {}, False),
                                         (49, 4096, {}, True), (48, 16384, {}, False),
                                         (64, 8192, dict(mask="causal"), True),
                                         (64, 8191, dict(mask="causal"), False)):
        spec, _ = _spec(**{**base, "head_dim": head_dim, "q_len": q_len, **mask})
        assert backend.variants(spec).backward_key_value.fused_query == fused, (head_dim, q_len, mask)
    long, _ = _spec(**base, q_len=16384)
    for features in (dict(mask="bool"), dict(mask="causal", window=(8, 8)), dict(window=(8, 8)),
                     dict(head_dim=96), dict(head_dim=160), dict(sinks=True)):
        spec, mask_dtype = _spec(**{**base, "q_len": 16384, **features})
        assert not backend.variants(spec, mask_dtype).backward_key_value.fused_query, features
    below, _ = _spec(**base, q_len=100)
    for forced in (True, False):
        forcing = CUDABackend(kernel_factory=_stub_factory, capability=90,
                              tuning=dataclasses.replace(WGMMA, fused_query=forced))
        assert forcing.variants(long).backward_key_value.fused_query == forced
        assert forcing.variants(below).backward_key_value.fused_query == forced
        assert forcing.variants(long) is forcing.variants(below)
    # Without wgmma kernels (mma.sync everywhere) the length changes nothing.
    plain = CUDABackend(kernel_factory=_stub_factory, capability=90)
    assert plain.variants(long) is plain.variants(below)


def test_forward_keys_by_length():
    """The wgmma forward row's t<T>_from<N> (the shipped table: T = 176 from 8192 keys at D =
    65..128): calls of at least N keys without an array mask, window or softcap get sets whose
    forward walks T keys a step; the dQ and dK/dV variants are those of the same call below N
    (fused dQ by the query count and head splits alike); a tuning that overrides the row's blocks
    and D on other rows change nothing."""
    table = planner.shipped_table("cuda")
    row = planner.plan("cuda", "forward", 128, mx.bfloat16, "sm90_wgmma", table)
    assert cuda_source.long_keys_option(row.cached, "row") == (176, 8192)
    backend = CUDABackend(kernel_factory=_stub_factory, capability=90, tuning=WGMMA, sm_count=132)
    base = dict(head_dim=128, dtype=mx.bfloat16, heads=(1, 1))
    for head_dim, mask in ((128, {}), (128, dict(mask="causal")), (65, {}), (128, dict(sinks=True))):
        for q_len in (64, 8192):  # the dK/dV kernel's two kernels / fused dQ (from 1024 queries)
            spec, _ = _spec(**{**base, "head_dim": head_dim, **mask}, q_len=q_len, kv_len=8192)
            below, _ = _spec(**{**base, "head_dim": head_dim, **mask}, q_len=q_len, kv_len=8191)
            long, short = backend.variants(spec), backend.variants(below)
            assert (long.forward.traversal_block, short.forward.traversal_block) == (176, 128), (head_dim, mask)
            assert (long.backward_query, long.backward_key_value) == (short.backward_query, short.backward_key_value)
            assert long is backend.variants(spec)  # one object per set (the guard's lookup)
            assert backend.variant_key(spec) != backend.variant_key(below)
    # a GQA call that the dK/dV row splits over head groups keeps its split, with the wide forward
    gqa = dict(base, heads=(4, 1), q_len=2048)  # 64 key blocks of one kv head: 2 splits fit 132 SMs
    spec, _ = _spec(**gqa, kv_len=8192)
    below, _ = _spec(**gqa, kv_len=8191)
    assert backend.head_splits(spec) == backend.head_splits(below) == 2
    assert backend.variants(spec).backward_key_value == backend.variants(below).backward_key_value
    assert backend.variants(spec).backward_key_value.head_split
    assert (backend.variants(spec).forward.traversal_block, backend.variants(below).forward.traversal_block) == (
        176, 128)
    # no array mask, window or softcap (plain_scores); D on other rows; a blocks override
    for features, t in ((dict(mask="bool"), 96), (dict(mask="additive"), 96), (dict(window=(64, 64)), 128),
                        (dict(softcap=30.0), 128), (dict(head_dim=64), 128), (dict(head_dim=192), 96)):
        spec, mask_dtype = _spec(**{**base, "q_len": 64, "kv_len": 16384, **features})
        assert backend.variants(spec, mask_dtype).forward.traversal_block == t, features
    pinned = CUDABackend(kernel_factory=_stub_factory, capability=90,
                         tuning=dataclasses.replace(WGMMA, blocks={"forward_wgmma": (128, 64, 128, 8)}))
    spec, _ = _spec(**base, q_len=64, kv_len=16384)
    assert pinned.variants(spec).forward.traversal_block == 64
    # the option is the forward's alone, and one per row
    spec, _ = _spec(**base, q_len=64, kv_len=16384)
    for kernel, options, message in (("backward_query", {"t176_from8192"}, "the forward's"),
                                     ("forward", {"t176_from8192", "t160_from4096"}, "at most one")):
        rows = tuple(dataclasses.replace(r, cached=r.cached | options)
                     if (r.kernel, r.family, r.max_head_dim) == (kernel, "sm90_wgmma", 128) else r
                     for r in table.rows)
        with pytest.raises(ValueError, match=message):
            cuda_source.make_variant(kernel, spec, None, cuda_source.family_of(90), WGMMA, True,
                                     planner.Table("cuda", "test", rows), False, True)


def test_set_needs_a_resolved_table():
    """None would cache whichever table was active at the first call: refused."""
    spec, _ = _spec()
    with pytest.raises(TypeError, match="planner.Table"):
        cuda_source.variant_set(cuda_source.VariantFeatures.of(spec), None, cuda_source.family_of(90), Tuning(),
                                False, None)
    with pytest.raises(TypeError, match="planner.Table"):
        metal_source.variant_set(metal_source.VariantFeatures.of(spec), "m3", None)


def test_guard_checks_a_decode_loop_once_and_a_tuned_table_again(monkeypatch, tmp_path):
    """A decode loop (one key more per step) is first-contact-checked once; a tuned table written
    in the process gives new variants at the next call, checked once too."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("MLX_FLASH_TUNED", raising=False)
    monkeypatch.setattr(tuned, "device_identity", lambda target: ("stub gpu", "sm_86"))
    tuned.forget()
    guard.GUARD.forget()
    backend = CUDABackend(kernel_factory=_stub_factory, capability=86)  # sm86: tuned tables are keyed by family
    q = mx.zeros((1, 4, 1, 64), mx.float16)
    try:
        for step in range(5):
            kv = mx.zeros((1, 2, 100 + step, 64), mx.float16)
            flash_attention(q, kv, kv, backend=backend)
        assert len(guard.GUARD.records()) == 1
        spec, _ = _spec(heads=(4, 2))
        before = backend.variants(spec)
        row = planner.find_row(planner.shipped_table("cuda"), "forward", 64, "mixed", "sm86")
        moved = dataclasses.replace(row, traversal_block=row.traversal_block // 2)
        tuned.write("cuda", "sm86", tune.with_row(planner.shipped_table("cuda"), moved, 64, "tuned"))
        after = backend.variants(spec)
        assert after.forward.traversal_block == moved.traversal_block != before.forward.traversal_block
        flash_attention(q, kv, kv, backend=backend)
        assert len(guard.GUARD.records()) == 2
        monkeypatch.setenv("MLX_FLASH_TUNED", "0")
        tuned.forget()
        assert backend.variants(spec) is before
    finally:
        tuned.forget()
        guard.GUARD.forget()

"""Context parallelism (mlx_flash.distributed): ring attention over processes launched by mlx.launch.

The ring tests start 2, 3 or 4 local processes through `mlx.launch --backend ring` (ports chosen
free at random, a timeout, the process group killed on any failure: tests/ring_launch.py). One
launch runs a whole matrix of cases (tests/ring_worker.py) and writes the measured errors to a
file read here. MLX_FLASH_RING_BACKEND selects the backend the ranks use (default "auto"):

    MLX_FLASH_RING_BACKEND=cuda python -m pytest tests/test_distributed.py -k ring

The in-process tests check the pieces: AttentionSpec.diagonal_shift on every backend against the
float64 reference with the equivalent explicit mask, and the per-step call planner against the
global band.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from attention_cases import FORWARD_TOLERANCE, GRADIENT_TOLERANCE, relative_error, to_numpy
from mlx_flash import flash_attention, reference
from mlx_flash.backends import cuda_emulator, get_backend
from mlx_flash.distributed import plan, ring_attention, segments
from mlx_flash.spec import check_inputs
from ring_launch import launch
from metal_compiler import require_metal_compiler

HERE = Path(__file__).resolve().parent
WORKER = HERE / "ring_worker.py"
BACKEND = os.environ.get("MLX_FLASH_RING_BACKEND", "auto")
LAUNCH_TIMEOUT = 300


# -- AttentionSpec.diagonal_shift on each backend ---------------------------------------------------

def explicit_band(q_len, kv_len, diag, causal, window):
    """Bool [Nq, Nk]: query i sees key j (own key i + diag), written out independently of spec.py."""
    i = np.arange(q_len)[:, None]
    j = np.arange(kv_len)[None, :]
    keep = np.ones((q_len, kv_len), bool)
    if causal:
        keep &= j <= i + diag
    if window is not None:
        left, right = window
        if left >= 0:
            keep &= j >= i + diag - left
        if right >= 0:
            keep &= j <= i + diag + right
    return keep


SHIFTS = [  # (q_len, kv_len, causal, window, diagonal_shift)
    (24, 40, True, None, -20),      # keys start after the queries' own: early rows see nothing
    (24, 40, True, None, 9),
    (32, 32, True, (6, -1), 32),    # the pair one chunk below the diagonal, window reaches back 6
    (32, 32, False, (5, 3), -30),   # key chunk after the query chunk: only the right side reaches
    (17, 29, True, (11, 2), -3),
]


def run_shifted(backend, q_len, kv_len, causal, window, shift, dtype=mx.float32, head_dim=16, seed=0):
    """Errors of a backend's forward / backward under a shifted spec vs the float64 reference."""
    rng = np.random.default_rng(seed)
    B, Hkv, G = 1, 2, 2
    q, k, v, d_out = (mx.array(rng.standard_normal(s).astype(np.float32)).astype(dtype) for s in
                      ((B, Hkv * G, q_len, head_dim), (B, Hkv, kv_len, head_dim), (B, Hkv, kv_len, head_dim),
                       (B, Hkv * G, q_len, head_dim)))
    spec, _ = check_inputs(q, k, v, mask="causal" if causal else None, window_size=window)
    shifted = dataclasses.replace(spec, diagonal_shift=shift)
    out, lse = backend.forward(q, k, v, None, shifted)
    dq, dk, dv, _ = backend.backward(q, k, v, None, out, lse, d_out, None, shifted)
    plain = dataclasses.replace(spec, causal=False, window=None)
    mask = explicit_band(q_len, kv_len, kv_len - q_len + shift, causal, window)
    qn, kn, vn = (to_numpy(x) for x in (q, k, v))
    r_out, r_lse = reference.attention_forward(qn, kn, vn, plain, mask)
    r_grads = reference.attention_backward(qn, kn, vn, to_numpy(d_out), plain, mask)
    lse_np = np.array(lse)
    assert np.array_equal(np.isinf(lse_np), np.isinf(r_lse)), "rows that see no key differ"
    finite = np.isfinite(r_lse)
    errors = {"out": relative_error(to_numpy(out), r_out),
              "lse": relative_error(lse_np[finite], r_lse[finite]) if finite.any() else 0.0}
    for name, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), r_grads):
        errors[name] = relative_error(to_numpy(g), r)
    return errors


def assert_within(errors, dtype="float32", what=""):
    limits = {n: FORWARD_TOLERANCE[dtype] if n in ("out", "lse") else GRADIENT_TOLERANCE[dtype] for n in errors}
    bad = {n: e for n, e in errors.items() if not e <= limits[n]}
    assert not bad, f"{what}: errors over tolerance {bad} (all: {errors})"


@pytest.mark.usefixtures("on_cpu")  # fp32 tolerance: a CUDA device rounds fp32 matmuls through tf32
@pytest.mark.parametrize("case", SHIFTS, ids=[f"shift{c[-1]}" for c in SHIFTS])
def test_diagonal_shift_mlx(case):
    assert_within(run_shifted(get_backend("mlx"), *case), what=f"mlx {case}")


def test_diagonal_shift_zero_is_the_public_diagonal():
    q = mx.zeros((1, 1, 5, 4))
    k = mx.zeros((1, 1, 9, 4))
    spec, _ = check_inputs(q, k, k, mask="causal")
    assert spec.diagonal_shift == 0 and spec.diagonal == 4


def test_diagonal_shift_metal_simulated(monkeypatch):
    """The Metal kernels read the shift from params[7] (run through the simulator)."""
    require_metal_compiler()
    monkeypatch.setenv("MLX_FLASH_METAL_SIM", "1")
    backend = get_backend("metal")
    for case in (SHIFTS[2], SHIFTS[3], SHIFTS[0]):  # causal+window, window, causal: three variants
        assert_within(run_shifted(backend, *case), what=f"metal {case}")


@pytest.mark.skipif(cuda_emulator.compiler() is None, reason="no host C++ compiler for the CUDA emulator")
def test_diagonal_shift_cuda_emulated():
    """The CUDA kernels take spec.diagonal from their parameter array (CPU emulator; bf16 is their dtype)."""
    backend = cuda_emulator.backend(seed=3)
    for case in (SHIFTS[2], SHIFTS[3]):
        assert_within(run_shifted(backend, *case, dtype=mx.bfloat16, head_dim=64), "bfloat16",
                      what=f"cuda {case}")


@pytest.mark.skipif(not (hasattr(mx, "cuda") and mx.cuda.is_available()), reason="no CUDA device")
def test_diagonal_shift_cuda_gpu():
    backend = get_backend("cuda")
    for case in SHIFTS:
        for dtype, name in ((mx.bfloat16, "bfloat16"), (mx.float16, "float16")):
            assert_within(run_shifted(backend, *case, dtype=dtype, head_dim=128), name, what=f"cuda {case} {name}")


# -- the per-step call planner ---------------------------------------------------------------------

def global_band(n_global, causal, window):
    return explicit_band(n_global, n_global, 0, causal, window)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, (5, -1)), (False, (9, 4)),
                                           (True, (0, 0)), (False, (40, 0)), (False, (-1, 3))])
def test_plan_covers_the_global_band_exactly(layout, size, causal, window):
    """Every (rank, visiting shard) plan tiles exactly that block of the global band, no overlaps."""
    n_local = 12
    q = mx.zeros((1, 1, n_local, 8))
    base, _ = check_inputs(q, q, q, mask="causal" if causal else None, window_size=window)
    want = global_band(size * n_local, causal, window)
    positions = {r: np.concatenate([np.arange(g, g + n) for _, g, n in segments(layout, r, size, n_local)])
                 for r in range(size)}
    for r in range(size):
        for s in range(size):
            calls = plan.plan_pair(base, segments(layout, r, size, n_local), segments(layout, s, size, n_local),
                                   size * n_local, size * n_local)
            got = np.zeros((n_local, n_local), int)
            pieces = np.zeros((n_local, n_local), int)
            for c in calls:
                got[c.q0:c.q1, c.k0:c.k1] += reference.visible(c.spec)
                for p in plan.split_keys(c, 5):  # the key-range pieces of the "mlx" backend
                    pieces[p.q0:p.q1, p.k0:p.k1] += reference.visible(p.spec)
            assert np.array_equal(pieces, got), f"rank {r} shard {s}: split_keys changed {calls}"
            expected = want[np.ix_(positions[r], positions[s])]
            assert got.max(initial=0) <= 1, f"overlapping calls {calls}"
            assert np.array_equal(got.astype(bool), expected), f"rank {r} shard {s}: {calls}"
            if layout == "zigzag" and causal and window is None:
                assert len(calls) == 1, f"zigzag causal should be one call per step, got {calls}"
            if layout == "contiguous":
                assert len(calls) <= 1


# -- a group of one rank ---------------------------------------------------------------------------

def test_group_of_one_is_flash_attention():
    group = mx.distributed.init()
    assert group.size() == 1
    rng = np.random.default_rng(0)
    q, k, v = (mx.array(rng.standard_normal((1, 2, 9, 16)).astype(np.float32)) for _ in range(3))
    out, lse = ring_attention(q, k, v, mask="causal", return_lse=True, group=group)  # odd N is fine here
    want, want_lse = flash_attention(q, k, v, mask="causal", return_lse=True)
    assert np.array_equal(np.array(out), np.array(want)) and np.array_equal(np.array(lse), np.array(want_lse))
    with pytest.raises(ValueError, match="layout"):
        ring_attention(q, k, v, group=group, layout="spiral")
    with pytest.raises(ValueError, match="array masks"):
        ring_attention(q, k, v, group=group, mask=mx.ones((9, 9), dtype=mx.bool_))


# -- over processes --------------------------------------------------------------------------------

def _case(layout, causal, dtype, head_dim, kv_heads=1, group=1, window=None, softcap=None, lse=False, seed=0,
          n_local=16):
    return {"layout": layout, "causal": causal, "dtype": dtype, "head_dim": head_dim, "kv_heads": kv_heads,
            "group": group, "window": window, "softcap": softcap, "lse_gradient": lse, "n_local": n_local,
            "seed": seed, "batch": 1}


# Both layouts, causal and not, GQA, windows (inside one chunk, across chunks, one-sided), D 64 / 80 /
# 128, fp32 / bf16, softcap and an lse cotangent.
MATRIX = [
    _case("zigzag", True, "float32", 64, kv_heads=1, group=2, seed=1),
    _case("zigzag", True, "bfloat16", 128, kv_heads=2, group=1, lse=True, seed=2),
    _case("zigzag", False, "float32", 80, kv_heads=2, group=2, seed=3),
    _case("zigzag", True, "float32", 64, window=(5, 0), seed=4),
    _case("zigzag", False, "bfloat16", 80, window=(20, 3), seed=5),
    _case("contiguous", True, "bfloat16", 64, kv_heads=1, group=4, seed=6),
    _case("contiguous", False, "float32", 128, lse=True, seed=7),
    _case("contiguous", True, "float32", 80, window=(-1, 0), softcap=5.0, seed=8),
    _case("contiguous", False, "float32", 64, kv_heads=2, group=2, window=(3, 17), seed=9),
    # Long enough that the "mlx" backend's calls run in several key-range pieces per step.
    _case("zigzag", True, "float32", 64, window=(70, 0), lse=True, seed=10, n_local=128),
]


def for_backend(case):
    """The CUDA kernels take fp16 / bf16 (fp32 goes to the "mlx" backend, counted as a fallback):
    under MLX_FLASH_RING_BACKEND=cuda the fp32 cases run in fp16."""
    return dict(case, dtype="float16") if BACKEND == "cuda" and case["dtype"] == "float32" else case


def _launch(tmp_path, n, mode, payload=None, timeout=LAUNCH_TIMEOUT):
    args = [mode, tmp_path]
    if payload is not None:
        (tmp_path / "payload.json").write_text(json.dumps(payload))
        args.append(tmp_path / "payload.json")
    result = launch(n, WORKER, *args, timeout=timeout, env={"MLX_FLASH_RING_BACKEND": BACKEND})
    assert result.returncode == 0, f"mlx.launch -n {n} failed ({result.returncode}):\n{result.stdout[-6000:]}"
    return [json.loads((tmp_path / (f"{mode}.json" if r == 0 else f"{mode}.rank{r}.json")).read_text())
            for r in range(n)]


@pytest.mark.parametrize("n", [2, 3])
def test_ring_matches_flash_attention(tmp_path, n):
    """out, lse, dq, dk, dv gathered from n ranks = single-process flash_attention within the dtype's
    tolerance (and the float64 reference); gradients bitwise equal across two runs."""
    results = _launch(tmp_path, n, "matrix", [for_backend(c) for c in MATRIX])[0]
    assert len(results) == len(MATRIX)
    for entry in results:
        case = entry["case"]
        what = f"n={n} {case}"
        assert entry["roundtrip"], f"{what}: gather_sequence(shard_sequence(x)) != x"
        assert entry["inf_rows_match"], f"{what}: rows with no visible key differ"
        assert entry["bitwise"], f"{what}: gradients differ between two identical runs"
        assert_within(entry["vs_flash"], case["dtype"], what=f"{what} vs flash_attention")
        assert_within(entry["vs_reference"], case["dtype"], what=f"{what} vs float64 reference")
        if case["layout"] == "zigzag" and case["causal"] and not case["window"]:
            assert all(c == 1 for c in entry["calls"]), f"{what}: calls per step {entry['calls']}"


def test_bad_inputs_raise_on_every_rank(tmp_path):
    """Each bad input raises a clear error on every rank (3 ranks); none hangs; the ring works after."""
    seen = _launch(tmp_path, 3, "errors", timeout=120)
    expected = {"layout": "layout", "layout_one_rank": "layout|rejected their arguments",
                "lengths_differ": "shard lengths", "zigzag_odd": "zigzag",
                "array_mask": "array masks", "mask_differs": "mask must be the same",
                "dtype_one_rank": "dtype|rejected their arguments"}
    import re
    for rank, errors in enumerate(seen):
        assert errors["works_after"], f"rank {rank}: ring_attention failed after the errors"
        for name, pattern in expected.items():
            assert errors[name] is not None, f"rank {rank} raised nothing for {name}"
            assert re.search(pattern, errors[name][1]), f"rank {rank}, {name}: {errors[name]}"


def test_peak_memory_per_rank(tmp_path):
    """At N_global = 4 N_local each of 4 ranks peaks within 1.3x of one process running N_local alone."""
    case = for_backend(dict(_case("zigzag", True, "float32", 64, kv_heads=2, group=2), n_local=512))
    peaks = _launch(tmp_path, 4, "memory", case)
    for rank, p in enumerate(peaks):
        alone = min(p["alone"], p["alone_again"])
        assert p["ring"] <= 1.3 * alone, f"rank {rank}: ring peak {p['ring']} vs alone {alone} ({p})"


def test_example_quick_mode():
    """examples/long_context_ring.py --quick trains over 2 processes and prints its comparison."""
    result = launch(2, HERE.parent / "examples" / "long_context_ring.py", "--quick", "--backend", BACKEND,
                    timeout=LAUNCH_TIMEOUT)
    assert result.returncode == 0, result.stdout[-6000:]
    assert "ring over 2 ranks" in result.stdout and "one process" in result.stdout, result.stdout

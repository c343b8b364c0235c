"""`python -m mlx_flash tune` and tuned tables, through the Metal simulator (the mechanism only:
simulator timings say nothing about a GPU's speed). One head dim, float32, the forward kernel,
tiny problems: each candidate is one more kernel for the simulator to compile."""
from __future__ import annotations

import dataclasses
import os
import re
import warnings

import mlx.core as mx
import numpy as np
import pytest

from mlx_flash import benchmark as bm, flash_attention, inspect, planner, reference, tune, tuned
from mlx_flash.__main__ import main
from mlx_flash.fallback import FallbackWarning, reset_fallback_counts
from mlx_flash.tune_spaces import MetalSpace
from metal_compiler import require_metal_compiler

D = 16
BASE = planner.find_row(planner.shipped_table("metal"), "forward", D, "fp32", "m3")  # P=16 T=64 H=16 O,Q


@pytest.fixture
def sim(monkeypatch, tmp_path):
    """The Metal simulator as an M3, tuned tables under tmp_path."""
    require_metal_compiler()
    monkeypatch.setenv("MLX_FLASH_METAL_SIM", "1")
    monkeypatch.setenv("MLX_FLASH_METAL_FAMILY", "m3")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("MLX_FLASH_TUNED", raising=False)
    monkeypatch.delenv("MLX_FLASH_METALSIM_FAULT", raising=False)
    reset_fallback_counts()
    tuned.forget()
    yield tmp_path
    reset_fallback_counts()
    tuned.forget()


def _origins(dtype="float32"):
    return {p.table for p in inspect.plans("metal", D, dtype)}


def test_tune_quick_end_to_end_writes_a_table_the_planner_uses(sim, capsys):
    code = main(["tune", "--backend", "metal", "--quick", "--head-dims", str(D), "--dtypes", "float32",
                 "--kernels", "forward", "--max-candidates", "2", "--budget-s", "120"])
    assert code == 0
    printed = capsys.readouterr().out
    path = tuned.table_path("metal", "m3")
    assert path.is_file() and str(path) in printed
    table = tuned.parse(path.read_text(), str(path), "metal", "m3")
    assert {r.family for r in table.rows} == {"m3"}
    assert tune.measured_points(path.read_text()) == (("forward", "float32", D),)
    assert "forward D=16 float32 none" in printed and "timed" in printed
    # every timed candidate is listed with its time against the table's row
    assert re.search(r"timed against the table's row: P=\d+ T=\d+ .*\d\.\d{3}x", printed), printed
    assert _origins() == {str(path)}  # the inspector names the tuned table
    os.environ["MLX_FLASH_TUNED"] = "0"
    tuned.forget()
    try:
        assert _origins() == {"kernels/blocks_metal.txt"}
    finally:
        del os.environ["MLX_FLASH_TUNED"]
        tuned.forget()


def test_planner_plans_from_a_tuned_row_and_the_kernel_stays_correct(sim):
    moved = dataclasses.replace(BASE, traversal_block=32, cached=frozenset({"O"}))
    table = tune.with_row(planner.shipped_table("metal"), moved, D, "tuned")
    path = tuned.write("metal", "m3", table, ("measured: forward float32 D=16 masks=none: by hand",))
    plan = planner.plan("metal", "forward", D, mx.float32, "m3")
    assert (plan.traversal_block, plan.cached, plan.table) == (32, frozenset({"O"}), str(path))
    from mlx_flash.report import _tuned_table  # the report carries the table to us

    assert _tuned_table("metal") == {"tuned_table": str(path), "tuned_table_text": path.read_text()}
    # head dims past the tuned one keep the shipped row that covered them
    assert planner.plan("metal", "forward", D + 8, mx.float32, "m3").traversal_block == 32  # shipped 17..48 row
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, 40, D)).astype(np.float32) for _ in range(3))
    out = flash_attention(mx.array(q), mx.array(k), mx.array(v), mask="causal", backend="metal")
    spec = tune.spec_for(tune.Point("forward", D, "float32"), "causal", 40, 40)
    want, _ = reference.attention_forward(q, k, v, spec)
    assert reference.relative_error(np.asarray(out, dtype=np.float64), want) < reference.FORWARD_TOLERANCE["float32"]


def test_a_candidate_that_computes_wrong_numbers_is_rejected_before_timing(sim, monkeypatch):
    wrong = dataclasses.replace(BASE, traversal_block=32)  # kernel name ..._p16t32h16_...
    monkeypatch.setenv("MLX_FLASH_METALSIM_FAULT", "corrupt:forward_d16_float32_p16t32h16")
    outcome = tune.tune_point(MetalSpace("m3"), planner.shipped_table("metal"), tune.Point("forward", D, "float32"),
                              tune.Problem(1, 1, 32), bm.Settings(warmup=0, min_repeats=1, max_repeats=1,
                                                                  target_seconds=0.0),
                              quick=True, max_candidates=2)
    assert "relative error" in outcome.rejected[wrong]
    assert wrong not in outcome.timings and outcome.best != wrong
    assert BASE in outcome.timings


def test_malformed_or_stale_table_is_ignored_with_one_warning(sim):
    path = tuned.table_path("metal", "m3")
    path.parent.mkdir(parents=True)
    good = tuned.write("metal", "m3", planner.shipped_table("metal")).read_text()
    for broken, word in ((good + "forward fp32 m3 not-a-number 16 64 16 -\n", "malformed"),
                         (good.replace("# mlx_flash: ", "# mlx_flash: 0.0.0-"), "stale")):
        path.write_text(broken)
        os.utime(path, ns=(1, hash(word) & 0xFFFFFFFF))  # a new modification time: read again
        tuned.forget()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                plan = planner.plan("metal", "forward", D, mx.float32, "m3")
        assert plan.table == "kernels/blocks_metal.txt"
        messages = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
        assert len(messages) == 1 and word in messages[0] and str(path) in messages[0]


def test_metal_candidates_move_one_knob_and_stay_within_limits(sim):
    space = MetalSpace("m3")
    rows = space.candidates(BASE, D, quick=False)
    assert BASE not in rows and len(rows) == len(set(rows))
    for row in rows:
        changed = [f for f in ("parallel_block", "traversal_block", "head_block", "cached")
                   if getattr(row, f) != getattr(BASE, f)]
        assert len(changed) == 1
        assert row.head_block <= 16 and row.parallel_block % 8 == 0 and row.traversal_block % 8 == 0


def test_cuda_candidates_are_checked_by_the_kernels_own_rules(monkeypatch):
    monkeypatch.setenv("MLX_FLASH_CUDA_CAPABILITY", "86")
    from mlx_flash.tune_cuda import CudaSpace

    space, table = CudaSpace(), planner.shipped_table("cuda")
    for kernel in planner.KERNELS:
        point = tune.Point(kernel, 64, "bfloat16")
        base = planner.find_row(table, kernel, 64, "mixed", space.row_family(kernel, 64))
        assert space.invalid_reason(tune.with_row(table, base, 64, "x"), point) is None
        reasons = [space.invalid_reason(tune.with_row(table, r, 64, "x"), point) for r in space.candidates(base, 64, False)]
        assert any(r is None for r in reasons)
    too_big = dataclasses.replace(base, parallel_block=256, traversal_block=128)
    assert "shared memory" in space.invalid_reason(tune.with_row(table, too_big, 64, "x"), point)


def test_autotune_tunes_a_shape_once_then_plans_from_the_table(sim, monkeypatch):
    from mlx_flash.autotune import FIRST_USE

    monkeypatch.setenv("MLX_FLASH_AUTOTUNE", "1")
    monkeypatch.setenv("MLX_FLASH_AUTOTUNE_BUDGET_S", "60")
    FIRST_USE.forget()
    rng = np.random.default_rng(0)
    q, k, v = (mx.array(rng.standard_normal((1, 1, 24, D)).astype(np.float32)) for _ in range(3))
    try:
        with pytest.warns(UserWarning, match="mlx-flash autotune: D=16 float32 on metal m3"):
            out = flash_attention(q, k, v, backend="metal")
        path = tuned.table_path("metal", "m3")
        measured = tune.measured_points(path.read_text())
        assert set(measured) == {(kernel, "float32", D) for kernel in planner.KERNELS}
        assert _origins() == {str(path)}
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # measured already: no second tuning
            again = flash_attention(q, k, v, backend="metal")
        assert mx.array_equal(out, again)
        FIRST_USE.forget()  # a new process: the table's notes say the shape is measured
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            flash_attention(q, k, v, backend="metal")
    finally:
        FIRST_USE.forget()


def test_cuda_tuning_gates_and_times_on_the_emulator(monkeypatch):
    """The same engine on the CUDA kernels (CPU emulator, sm86 plans): the table's row and a
    candidate pass the gate and are timed; one planted with a block the kernels reject is refused."""
    from mlx_flash.backends import cuda_emulator
    from mlx_flash.tune_cuda import CudaSpace

    if cuda_emulator.compiler() is None:
        pytest.skip("no host C++ compiler for the CUDA emulator")
    monkeypatch.setenv("MLX_FLASH_CUDA_CAPABILITY", "86")
    space = CudaSpace(make_backend=lambda tuning: cuda_emulator.backend(capability=86, tuning=tuning))
    table = planner.shipped_table("cuda")
    base = planner.find_row(table, "forward", 16, "mixed", "sm86")
    planted = dataclasses.replace(base, parallel_block=base.parallel_block + 8)  # not a multiple of 16 rows
    outcome = tune.tune_point(space, table, tune.Point("forward", 16, "bfloat16"), tune.Problem(1, 1, 32),
                              bm.Settings(warmup=0, min_repeats=1, max_repeats=1, target_seconds=0.0),
                              quick=True, max_candidates=2, extra_candidates=[planted])
    assert "multiple of 16" in outcome.rejected[planted]
    assert base in outcome.timings and len(outcome.timings) == 2, outcome.rejected


@pytest.mark.parametrize("target", ["metal", "cuda"])
def test_every_shipped_row_survives_format_and_parse(target):
    """A tuned table is written with format_row and read with parse_rows: every shipped row,
    the sm90_wgmma family's long name included, must come back unchanged."""
    rows = planner.shipped_table(target).rows
    text = "\n".join(planner.format_row(r) for r in rows)
    assert planner.parse_rows(text, "round trip") == tuple(rows)


def test_cuda_tuned_table_of_the_wgmma_family_is_read_back(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    table = planner.shipped_table("cuda")
    path = tuned.write("cuda", "sm90", table, directory=tmp_path)
    back = tuned.parse(path.read_text(), str(path), "cuda", "sm90")
    assert {r.family for r in back.rows} == {"sm90", "sm90_wgmma"}
    assert len(back.rows) == sum(r.family in ("sm90", "sm90_wgmma") for r in table.rows)


def test_cuda_wgmma_forward_candidates_toggle_its_options():
    """The tuner's wgmma forward candidates include the row with pingpong and with the scale fold
    each toggled (on where the row has it, off where not), and at D = 64 the row sums by MMA: a
    tuned table keeps what wins."""
    from mlx_flash.backends import cuda_source
    from mlx_flash.tune_cuda import CudaSpace

    for head_dim in (64, 128, 512):  # the shipped rows: with the fold (and D = 64 the row sums), without it
        row = planner.find_row(planner.shipped_table("cuda"), "forward", head_dim, "mixed", "sm90_wgmma")
        assert (cuda_source.SCALE_FOLD in row.cached) == (head_dim <= 256)
        options = [c.cached for c in CudaSpace(family="sm90").candidates(row, head_dim, quick=True)
                   if (c.parallel_block, c.traversal_block, c.warps) == (row.parallel_block, row.traversal_block, row.warps)]
        sums = (cuda_source.MMA_SUMS,) if head_dim == 64 else ()  # only where it applies (D = 49..64)
        toggled = [row.cached ^ {option} for option in (cuda_source.PINGPONG, cuda_source.SCALE_FOLD, *sums)]
        assert sorted(options, key=sorted) == sorted(toggled, key=sorted), head_dim


def test_cuda_wgmma_forward_candidates_move_the_t_the_problem_runs(monkeypatch):
    """A wgmma forward row with t<T>_from<N> (the shipped D = 65..128 row: T = 128, 176 from 8192
    keys): a timed problem shorter than N runs the row's T, so the T moves move it; one of N keys
    or more runs the long T, so they move that T instead and one candidate drops the option.
    Either way the correctness gate also runs the row at N + 19 keys, and the kernels' own checks
    see both Ts."""
    from mlx_flash.tune_cuda import CudaSpace

    space = CudaSpace(family="sm90")
    row = planner.find_row(planner.shipped_table("cuda"), "forward", 128, "mixed", "sm90_wgmma")
    assert "t176_from8192" in row.cached and row.traversal_block == 128
    short = space.candidates(row, 128, quick=True, length=4096)
    assert {c.traversal_block for c in short if c.cached == row.cached} >= {112, 144}
    assert all("t176_from8192" in c.cached for c in short)
    long = [c for c in space.candidates(row, 128, quick=True, length=8192)
            if c.cached != row.cached and c.cached ^ row.cached <= {"t176_from8192", "t160_from8192", "t192_from8192"}]
    assert sorted(sorted(c.cached ^ row.cached) for c in long) == [
        ["t160_from8192", "t176_from8192"], ["t176_from8192"], ["t176_from8192", "t192_from8192"]]
    assert all(c.traversal_block == 128 for c in long)
    assert space.gate_keys(row) == (8211,)
    assert space.gate_keys(planner.find_row(planner.shipped_table("cuda"), "forward", 64, "mixed", "sm90_wgmma")) == ()
    assert space.gate_keys(planner.find_row(planner.shipped_table("cuda"), "backward_query", 128, "mixed",
                                            "sm90_wgmma")) == ()
    # a long T the kernels cannot take (past the forward's 256) is rejected before any call
    point = tune.Point("forward", 128, "bfloat16")
    bad = dataclasses.replace(row, cached=row.cached - {"t176_from8192"} | {"t272_from8192"})
    from mlx_flash.backends import cuda

    monkeypatch.setattr(cuda.CUDABackend, "real_sm90", lambda self: True)  # plan as an H100 / H200 does
    sm90 = CudaSpace(family="sm90")
    table = planner.shipped_table("cuda")
    assert sm90.invalid_reason(tune.with_row(table, row, 128, "x"), point) is None
    reason = sm90.invalid_reason(tune.with_row(table, bad, 128, "x"), point)
    assert reason is not None and "T=272" in reason


def test_the_gate_runs_the_spaces_longer_key_counts(sim, monkeypatch):
    """tune.gate runs a candidate at GATE_KEYS and at each key count the space's gate_keys names
    for its row, and a wrong answer there rejects it before timing, naming the count."""
    class Longer(MetalSpace):
        def gate_keys(self, row):
            return (120,)

    seen = []
    check = tune.Job.check

    def spy(job, results):
        seen.append(job.spec.kv_len)
        return "relative error 1 (planted)" if job.spec.kv_len == 120 else check(job, results)

    monkeypatch.setattr(tune.Job, "check", spy)
    point = tune.Point("forward", D, "float32")
    table = planner.shipped_table("metal")
    assert tune.gate(MetalSpace("m3"), table, point, BASE) is None and seen == [tune.GATE_KEYS]
    seen.clear()
    reason = tune.gate(Longer("m3"), table, point, BASE)
    assert seen == [tune.GATE_KEYS, 120] and reason == "none at 120 keys: relative error 1 (planted)"


def test_cuda_wgmma_key_value_candidates_toggle_roles_past_256():
    """The tuner's wgmma dK/dV candidates past D = 256 include the row with roles toggled (the
    shipped D = 385..512 row has it, the D = 257..384 row not); rows up to 256 have no such candidate."""
    from mlx_flash.backends import cuda_source
    from mlx_flash.tune_cuda import CudaSpace

    shipped = planner.shipped_table("cuda")
    for head_dim, has in ((300, False), (512, True), (256, None)):
        row = planner.find_row(shipped, "backward_key_value", head_dim, "mixed", "sm90_wgmma")
        toggled = [c for c in CudaSpace(family="sm90").candidates(row, head_dim, quick=True)
                   if c.cached ^ row.cached == {cuda_source.ROLES}]
        assert len(toggled) == (0 if has is None else 1), head_dim
        if has is not None:
            assert (cuda_source.ROLES in row.cached) == has and (cuda_source.ROLES in toggled[0].cached) != has


def test_timed_samples_issue_the_problems_calls_back_to_back(sim, monkeypatch):
    """Each timed sample of a candidate (and of the closing A/B) is the problem's back_to_back
    calls issued one after another and waited for once (benchmark.Call)."""
    runs, given = [], []
    real_time_calls = bm.time_calls

    def time_calls(calls, **kwargs):
        given.extend(call.back_to_back for call in calls.values())
        return real_time_calls(calls, **kwargs)

    monkeypatch.setattr(bm, "time_calls", time_calls)
    space, table = MetalSpace("m3"), planner.shipped_table("metal")

    class Counting:
        def __init__(self, backend):
            self.backend = backend

        def forward(self, *args):
            runs.append(1)
            return self.backend.forward(*args)

        def backward(self, *args):
            return self.backend.backward(*args)

    monkeypatch.setattr(space, "backend", lambda t, make=space.backend: Counting(make(t)))
    settings = bm.Settings(warmup=0, min_repeats=2, max_repeats=2, target_seconds=0.0)
    point = tune.Point("forward", D, "float32")
    for n in (1, 3):
        runs.clear()
        given.clear()
        medians = tune.time_tables(space, {BASE: table}, point, tune.Problem(1, 1, 32, n), settings)
        assert medians[point.masks[0]][BASE] > 0
        assert given == [n] and len(runs) >= 2 * n and len(runs) % n == 0, (n, len(runs))
        runs.clear()
        given.clear()
        times = tune.ab_whole_call(space, {"a": table, "b": table}, D, "float32", "none", tune.Problem(1, 1, 32, n), settings)
        assert set(times) == {"a", "b"} and given == [n, n] and len(runs) >= 4 * n and len(runs) % n == 0
    with pytest.raises(ValueError, match="back_to_back"):
        tune.time_tables(space, {BASE: table}, point, tune.Problem(1, 1, 32, 0), settings)


def test_cuda_problems_time_calls_back_to_back():
    """The tune command's CUDA problems and the autotuner's (tune.calls_per_sample) time 8 calls
    back to back per sample; Metal's one."""
    from mlx_flash import tune_command

    assert tune.calls_per_sample("cuda") == 8 and tune.calls_per_sample("metal") == 1
    assert {name: p.back_to_back for name, p in tune_command.PROBLEMS.items()} == {
        "cuda": 8, "cuda_quick": 8, "metal": 1, "metal_quick": 1, "metalsim": 1}

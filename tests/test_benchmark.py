"""The benchmark harness, benchmarks/bench.py and `python -m mlx_flash` (fast: a few seconds)."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_flash import benchmark as bm
from mlx_flash.backends import auto_backend_name

from child_env import child_env

ROOT = Path(__file__).resolve().parent.parent
ENV = child_env()
# What a child process started here picks: "auto"'s backend and the terminal's rate unit follow the
# default device (GFLOP/s on a CPU, where TFLOP/s would print as 0.00x; TFLOP/s on a GPU).
ON_GPU = mx.default_device().type == mx.gpu
AUTO_BACKEND = auto_backend_name(mx.default_device())
RATE_UNIT = "TFLOP/s" if ON_GPU else "GFLOP/s"
ENVIRONMENT_KEYS = {"device", "device_name", "mlx_version", "mlx_flash_version", "git_commit", "date",
                    "backend", "platform", "load_average"}


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_cli", ROOT / "benchmarks" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------
# Metric formulas against hand-computed values


def test_flops_forward_backward_and_causal_halving():
    case = bm.BenchCase(batch=2, q_heads=4, kv_heads=4, q_len=1024, kv_len=1024, head_dim=64)
    forward = 4 * 2 * 4 * 1024 * 1024 * 64  # 2 matmuls of 2·N·N·D flops per head
    assert forward == 2_147_483_648
    assert bm.attention_flops(case, "forward") == forward
    assert bm.attention_flops(case, "backward") == 2.5 * forward
    assert bm.attention_flops(case, "forward_backward") == 3.5 * forward
    assert bm.attention_flops(case, "backward_query") == 1.5 * forward
    assert bm.attention_flops(case, "backward_key_value") == 2.0 * forward
    causal = bm.BenchCase(batch=2, q_heads=4, kv_heads=4, q_len=1024, kv_len=1024, head_dim=64, causal=True)
    for kernel in bm.KERNELS:
        assert bm.attention_flops(causal, kernel) == bm.attention_flops(case, kernel) / 2


def test_flops_count_query_heads_and_both_lengths():
    # GQA: work follows the query heads; Nq != Nk: Nq·Nk pairs.
    case = bm.BenchCase(batch=1, q_heads=6, kv_heads=2, q_len=3, kv_len=5, head_dim=8)
    assert bm.attention_flops(case, "forward") == 4 * 6 * 3 * 5 * 8 == 2880


def test_instruction_counts_follow_mfa():
    case = bm.BenchCase(batch=1, q_heads=2, kv_heads=1, q_len=100, kv_len=300, head_dim=64)
    pairs = 2 * 100 * 300
    assert bm.attention_instructions(case, "forward") == 133 * pairs            # 2D + 5
    assert bm.attention_instructions(case, "backward_query") == 197 * pairs     # 3D + 5
    assert bm.attention_instructions(case, "backward_key_value") == 261 * pairs  # 4D + 5
    assert bm.attention_instructions(case, "backward") == (197 + 261) * pairs
    assert bm.attention_instructions(case, "forward_backward") == 591 * pairs   # 9D + 15
    causal = bm.BenchCase(batch=1, q_heads=2, kv_heads=1, q_len=100, kv_len=300, head_dim=64, causal=True)
    assert bm.attention_instructions(causal, "forward_backward") == 591 * pairs / 2


def test_rates_divide_work_by_time():
    case = bm.BenchCase(batch=1, q_heads=8, kv_heads=8, q_len=4096, kv_len=4096, head_dim=64)
    # 4·8·4096²·64 = 34.36 GFLOP in 10 ms = 3.436 TFLOP/s; (2·64+5)·8·4096² = 17.85 G instructions in 10 ms = 1785.1 G/s.
    assert bm.tflops_per_second(case, "forward", 0.01) == pytest.approx(3.4359738368)
    assert bm.ginstructions_per_second(case, "forward", 0.01) == pytest.approx(1785.0957824)


def test_bad_kernel_and_case_arguments_are_named():
    case = bm.BenchCase(1, 1, 1, 8, 8, 8)
    with pytest.raises(ValueError, match="kernel must be one of"):
        bm.attention_flops(case, "backwards")
    with pytest.raises(ValueError, match="q_heads \\(3\\) must be a multiple of kv_heads \\(2\\)"):
        bm.BenchCase(1, 3, 2, 8, 8, 8)
    with pytest.raises(ValueError, match="head_dim must be a positive int, got 0"):
        bm.BenchCase(1, 1, 1, 8, 8, 0)
    assert bm.BenchCase(1, 1, 1, 8, 8, 8, dtype="bf16").dtype == "bfloat16"
    with pytest.raises(ValueError, match="'fp8'"):
        bm.dtype_name("fp8")


def test_timing_statistics():
    timing = bm.Timing([0.004, 0.001, 0.003, 0.002])
    assert timing.median == pytest.approx(0.0025)
    assert timing.quantile(0.25) == pytest.approx(0.00175)
    assert timing.quantile(0.75) == pytest.approx(0.00325)
    summary = timing.summary_ms()
    assert summary["min_ms"] == pytest.approx(1.0) and summary["max_ms"] == pytest.approx(4.0)
    assert summary["repeats"] == 4


# ---------------------------------------------------------------------------------------------
# The timer really waits for the work


def test_timer_finishes_every_result_inside_the_clock():
    finished = []
    results = iter(range(100))

    def run(state):
        assert state == "prepared"
        return next(results)

    timing = bm.time_call(run, prepare=lambda: "prepared", finish=finished.append, warmup=2,
                          min_repeats=3, max_repeats=3, target_seconds=0.0)
    assert len(timing.samples) == 3
    # Each repetition first drains the queue (None), then finishes run's own result.
    assert finished == [None, 0, None, 1, None, 2, None, 3, None, 4]


def _matmul_chain(size: int, steps: int):
    """A run(state) that builds `steps` lazy matmul + tanh steps on an evaluated size x size array."""
    a = mx.random.normal((size, size))
    mx.eval(a)

    def chain(_):
        x = a
        for _ in range(steps):
            x = mx.tanh(x @ a) * 0.5
        return x

    return chain


def test_timer_measures_lazy_mlx_work_not_graph_building():
    chain = _matmul_chain(192, 12)
    start = time.perf_counter()
    for _ in range(5):
        chain(None)  # builds the graph, computes nothing
    build = (time.perf_counter() - start) / 5
    timed = bm.time_call(chain, warmup=1, min_repeats=3, max_repeats=3).median
    direct = min(_eval_time(chain) for _ in range(3))
    assert timed > 5 * build, (timed, build)
    assert timed > 0.3 * direct, (timed, direct)


def _eval_time(fn):
    start = time.perf_counter()
    mx.eval(fn(None))
    return time.perf_counter() - start


def test_back_to_back_launches_each_call_and_waits_once():
    events = []
    results = iter(range(100))

    def run(_):
        value = next(results)
        events.append(("run", value))
        return value

    call = bm.Call(run, finish=lambda r: events.append(("finish", r)), back_to_back=3,
                   launch=lambda r: events.append(("launch", r)))
    seconds = call.timed_once()
    assert events == [("finish", None), ("run", 0), ("launch", 0), ("run", 1), ("launch", 1), ("run", 2),
                      ("launch", 2), ("finish", [0, 1, 2])]
    assert seconds >= 0
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="back_to_back must be an int >= 1"):
            bm.Call(run, back_to_back=bad)


def test_back_to_back_sample_is_time_per_call():
    # K calls of real MLX work waited for once: a sample reads as the time per call, not K times
    # it (divided by K), and not a quarter of it (all K calls' work is inside the clock).
    chain = _matmul_chain(256, 10)
    one = bm.time_calls({0: bm.Call(chain)}, warmup=1, min_repeats=5, max_repeats=5, target_seconds=0)[0]
    four = bm.time_calls({0: bm.Call(chain, back_to_back=4)}, warmup=1, min_repeats=5, max_repeats=5,
                         target_seconds=0)[0]
    assert 0.3 * one.median < four.median < 2.0 * one.median, (one.median, four.median)


def test_backward_pass_times_the_gradient_evaluation():
    # The backward's graph is built and its forward evaluated untimed; what remains (dq, dk,
    # dv) must still be real work, comparable to the forward, not an already-evaluated no-op.
    case = bm.BenchCase(batch=1, q_heads=4, kv_heads=4, q_len=256, kv_len=256, head_dim=32)
    inputs = bm.random_inputs(case)
    settings = bm.Settings(warmup=1, min_repeats=3, max_repeats=3, target_seconds=0)
    items = {p: (bm.Call(*reversed(bm.mlx_pass(bm.unfused_attention, case, inputs, p))), case, p, None)
             for p in bm.PASSES}
    rows = bm.measure_many(items, settings, catch=False)
    assert rows["backward"]["median_ms"] > 0.5 * rows["forward"]["median_ms"], rows
    assert rows["forward_backward"]["median_ms"] > rows["forward"]["median_ms"], rows


def test_compiled_passes_compute_the_same_and_trace_once():
    """mlx_pass(compiled=True): the forward and forward+backward give the uncompiled values, and
    after the first call (the trace) a call no longer runs the Python attention function."""
    case = bm.BenchCase(batch=1, q_heads=2, kv_heads=1, q_len=64, kv_len=64, head_dim=16, causal=True)
    inputs = bm.random_inputs(case)
    traced = []

    def attention(q, k, v, mask, scale):
        traced.append(1)
        return bm.unfused_attention(q, k, v, mask, scale)

    for pass_name in ("forward", "forward_backward"):
        _, eager = bm.mlx_pass(bm.unfused_attention, case, inputs, pass_name)
        _, compiled = bm.mlx_pass(attention, case, inputs, pass_name, compiled=True)
        expected, got = eager(None), compiled(None)
        traced.clear()
        again = compiled(None)
        mx.eval(expected, got, again)
        assert not traced, pass_name  # replayed, not traced again
        flat = lambda x: [x] if isinstance(x, mx.array) else [a for y in x for a in flat(y)]
        for e, g, a in zip(flat(expected), flat(got), flat(again)):
            assert mx.allclose(e, g, atol=1e-5).item() and mx.array_equal(g, a).item(), pass_name
    with pytest.raises(ValueError, match="compiled timing covers"):
        bm.mlx_pass(attention, case, inputs, "backward", compiled=True)


def test_interleaved_timing_and_failure_capture():
    order = []

    def recorder(key):
        def run(_):
            order.append(key)
        return run

    def broken(_):
        raise MemoryError("no room")

    errors = {}
    calls = {"a": bm.Call(recorder("a"), finish=lambda r: None), "b": bm.Call(recorder("b"), finish=lambda r: None),
             "c": bm.Call(broken, finish=lambda r: None)}
    timings = bm.time_calls(calls, warmup=1, min_repeats=2, max_repeats=2, target_seconds=0, errors=errors,
                            order_seed=None)
    assert order == ["a", "b", "a", "b", "a", "b"]
    assert set(timings) == {"a", "b"} and errors == {"c": "MemoryError: no room"}


def test_interleaved_rounds_take_orders_of_their_own():
    """time_calls' timed rounds each visit every call once, in an order drawn from order_seed
    (reproducible; the warm-up round in the given order), so no call always follows the same one."""
    def run_rounds(seed):
        order = []
        calls = {key: bm.Call(lambda _, key=key: order.append(key), finish=lambda r: None) for key in "abcd"}
        bm.time_calls(calls, warmup=1, min_repeats=12, max_repeats=12, target_seconds=0, order_seed=seed)
        return [order[i:i + 4] for i in range(0, len(order), 4)]

    rounds = run_rounds(0)
    assert len(rounds) == 13 and rounds[0] == list("abcd") and all(sorted(r) == list("abcd") for r in rounds)
    assert len({tuple(r) for r in rounds[1:]}) > 3 and rounds == run_rounds(0)
    before_b = {r[r.index("b") - 1] for r in rounds[1:] if r.index("b") > 0}
    assert len(before_b) >= 2  # b follows more than one call


def test_peak_memory_counts_the_call_not_what_was_resident():
    resident = mx.ones((2048, 2048))  # 16 MiB already allocated must not count
    mx.eval(resident)
    peak = bm.peak_memory(lambda _: mx.ones((1024, 1024)) + 1.0)  # one or two 4 MiB arrays
    assert 4 << 20 <= peak <= 9 << 20, peak
    del resident


def test_cases_take_one_mask_and_array_masks_are_inputs():
    """BenchCase.array_mask: a random [1, 1, Nq, Nk] mask (about MASK_KEEP of it kept), labelled and
    recorded; mlx_pass needs it exactly for such cases, and every pass runs with it."""
    case = bm.BenchCase(batch=1, q_heads=2, kv_heads=1, q_len=64, kv_len=96, head_dim=16, array_mask="bool")
    assert case.mask == "bool" and case.label().endswith("float32 bool mask")
    assert bm.case_of(bm.as_dict(case)) == case
    legacy = {k: v for k, v in bm.as_dict(case).items() if k != "array_mask"}
    assert bm.case_of(legacy).mask == "none"  # rows recorded before array masks
    with pytest.raises(ValueError, match="causal or an array mask, not both"):
        bm.BenchCase(batch=1, q_heads=1, kv_heads=1, q_len=8, kv_len=8, head_dim=8, causal=True, array_mask="bool")
    with pytest.raises(ValueError, match="array_mask must be one of"):
        bm.BenchCase(batch=1, q_heads=1, kv_heads=1, q_len=8, kv_len=8, head_dim=8, array_mask="window")
    mask = bm.random_mask(case, seed=1)
    assert mask.shape == (1, 1, 64, 96) and mask.dtype == mx.bool_
    assert 0.85 < mask.astype(mx.float32).mean().item() < 0.95
    additive = bm.random_mask(dataclasses.replace(case, array_mask="additive", dtype="bfloat16"), seed=1)
    assert additive.dtype == mx.bfloat16 and mx.array_equal(additive == 0, mask).item()
    assert bm.random_mask(dataclasses.replace(case, array_mask="none")) is None
    inputs = bm.random_inputs(case)
    with pytest.raises(ValueError, match="mask must be given exactly"):
        bm.mlx_pass(bm.unfused_attention, case, inputs, "forward")
    for compiled in (False, True):
        _, run = bm.mlx_pass(bm.fast_attention, case, inputs, "forward", compiled=compiled, mask=mask)
        expected = bm.unfused_attention(*inputs[:3], mask, case.scale)
        assert mx.allclose(run(None), expected, atol=1e-5).item()
    _, run = bm.mlx_pass(bm.unfused_attention, case, inputs, "forward_backward", mask=additive.astype(mx.float32))
    (out,), grads = run(None)
    assert mx.allclose(out, expected, atol=1e-5).item() and all(mx.all(mx.isfinite(g)).item() for g in grads)


def test_unfused_attention_matches_the_reference():
    import numpy as np

    from mlx_flash import reference
    from mlx_flash.spec import check_inputs

    case = bm.BenchCase(batch=1, q_heads=4, kv_heads=2, q_len=24, kv_len=40, head_dim=16, causal=True)
    q, k, v, _ = bm.random_inputs(case, seed=3)
    spec, _ = check_inputs(q, k, v, mask="causal")
    expected, _ = reference.attention_forward(np.array(q), np.array(k), np.array(v), spec)
    out = bm.unfused_attention(q, k, v, "causal", case.scale)
    assert np.allclose(np.array(out), expected, atol=1e-5)
    # Array masks broadcast over the GQA heads as mx.fast does: per head [1, Hq, Nq, Nk], additive.
    bias = np.random.default_rng(0).standard_normal((1, 4, 24, 40)).astype(np.float32)
    spec, _ = check_inputs(q, k, v, mask=mx.array(bias))
    expected, _ = reference.attention_forward(np.array(q), np.array(k), np.array(v), spec, bias)
    assert np.allclose(np.array(bm.unfused_attention(q, k, v, mx.array(bias), case.scale)), expected, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# benchmarks/bench.py end to end


def test_bench_cli_writes_table_json_and_png(tmp_path):
    command = [sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--seq-lens", "32", "64", "--heads", "2",
               "--kv-heads", "1", "--masks", "none", "causal", "--warmup", "0", "--min-repeats", "1",
               "--max-repeats", "1", "--target-seconds", "0", "--torch", "--out", str(tmp_path), "--name", "t"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=ENV, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    # The terminal's rate unit follows the device; the JSON keeps TFLOP/s.
    assert "implementation" in done.stdout and RATE_UNIT in done.stdout
    assert f"mlx-flash[{AUTO_BACKEND}]" in done.stdout
    payload = json.loads((tmp_path / "t.json").read_text())
    assert ENVIRONMENT_KEYS <= set(payload["environment"])
    assert payload["environment"]["mlx_version"] == mx.__version__
    rows = payload["rows"]
    assert len(rows) == 4 * 4 * 3  # cases x implementations x passes
    measured = [r for r in rows if r["implementation"] != "torch-fa2"]
    assert all(r["status"] == "ok" for r in measured), [r["status"] for r in measured if r["status"] != "ok"]
    assert all(r["median_ms"] > 0 and r["tflops"] > 0 and r["peak_memory_bytes"] > 0 for r in measured)
    assert all(r["time_vs_mx_fast"] == 1.0 for r in measured if r["implementation"] == "mx.fast")
    # float32 inputs, and no torch with CUDA on a CPU machine: the column is skipped with its
    # reason, not an error.
    torch_rows = [r for r in rows if r["implementation"] == "torch-fa2"]
    assert torch_rows and all(r["status"].startswith("skipped: torch") for r in torch_rows)
    png = tmp_path / "t_d64_float32.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _version_tree(folder: Path, doubled: bool) -> Path:
    """A copy of this tree's mlx_flash/ and kernels/ (what ab_versions.py takes as --against);
    doubled: its flash_attention returns twice the output, so that a report can tell the trees apart."""
    import shutil
    shutil.copytree(ROOT / "kernels", folder / "kernels")
    shutil.copytree(ROOT / "mlx_flash", folder / "mlx_flash", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    if doubled:
        with open(folder / "mlx_flash" / "__init__.py", "a") as f:
            f.write("\n_undoubled = flash_attention\n\n\ndef flash_attention(*args, **kwargs):\n"
                    "    return _undoubled(*args, **kwargs) * 2\n")
    return folder


@pytest.mark.parametrize("doubled", [False, True], ids=["same-tree", "other-tree"])
def test_ab_versions_times_both_trees_in_turn(tmp_path, doubled):
    """benchmarks/ab_versions.py: a worker per tree, each importing its own mlx_flash (a tree whose
    output is doubled shows an output difference of 1, the same tree 0), every sample recorded."""
    other = _version_tree(tmp_path / "other", doubled)
    command = [sys.executable, str(ROOT / "benchmarks" / "ab_versions.py"), "--against", str(other), "--backend",
               "mlx", "--shapes", "1,2,64,32,none", "1,2,48,16,causal,1", "--rounds", "2", "--back-to-back", "2",
               "--out", str(tmp_path / "ab.json")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=ENV, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    payload = json.loads((tmp_path / "ab.json").read_text())
    assert payload["packages"] == {"this": str(ROOT / "mlx_flash"), "other": str(other / "mlx_flash")}
    assert [(r["label"], r["pass"]) for r in payload["rows"]] == [
        (label, p) for label in ("B=1 H=2 N=64 D=32 bfloat16", "B=1 H=2/1 N=48 D=16 bfloat16 causal")
        for p in ("forward", "forward_backward")]
    for row in payload["rows"]:
        assert sorted(row["samples_ms"]) == ["mx.fast", "other/flash", "this/flash"]
        assert all(len(s) == 2 and min(s) > 0 for s in row["samples_ms"].values())
        assert row["output_difference"] == pytest.approx(1.0 if doubled else 0.0, abs=1e-6)
        # twice the output, twice its gradients under the same cotangent
        assert row["gradient_difference"] == pytest.approx(1.0 if doubled else 0.0, abs=1e-6)
    assert done.stdout.count("forward_backward") == 2


def test_ab_versions_goes_on_where_mx_fast_fails(tmp_path):
    """Where mx.fast raises (on a GPU: MLX's unfused attention out of memory at long N), ab_versions
    prints and keeps its error and times the two versions on: a sitecustomize on PYTHONPATH makes
    mx.fast.scaled_dot_product_attention raise in every process."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import mlx.core as mx\n\n\ndef _fails(*args, **kwargs):\n"
        "    raise RuntimeError('cudaMallocAsync failed: out of memory (planted)')\n\n\n"
        "mx.fast.scaled_dot_product_attention = _fails\n")
    env = dict(ENV, PYTHONPATH=os.pathsep.join(p for p in (str(hook), ENV.get("PYTHONPATH", "")) if p))
    command = [sys.executable, str(ROOT / "benchmarks" / "ab_versions.py"), "--against", str(ROOT), "--backend",
               "mlx", "--shapes", "1,2,64,32,none", "--passes", "forward", "--rounds", "2", "--back-to-back", "1",
               "--out", str(tmp_path / "ab.json")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    (row,) = json.loads((tmp_path / "ab.json").read_text())["rows"]
    assert "out of memory (planted)" in row["mx_fast_error"] and "mx.fast failed" in done.stdout
    assert row["samples_ms"]["mx.fast"] == []
    assert len(row["samples_ms"]["this/flash"]) == len(row["samples_ms"]["other/flash"]) == 2
    assert row["gradient_difference"] is None  # a forward pass alone compares no gradients


def _emulated_ab_forward(tmp_path, shape: str, *tunings) -> dict:
    """ab_versions.py's JSON for one forward sample of `shape` on the CPU emulator, this tree
    against itself, with `tunings` (--tuning / --against-tuning arguments)."""
    command = [sys.executable, str(ROOT / "benchmarks" / "ab_versions.py"), "--against", str(ROOT), "--backend",
               "cuda-emulated", *tunings, "--shapes", shape, "--passes", "forward", "--rounds", "1",
               "--back-to-back", "1", "--out", str(tmp_path / "ab.json")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=ENV, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads((tmp_path / "ab.json").read_text())


def test_ab_versions_times_calls_with_an_array_mask(tmp_path):
    """A shape with a bool or additive mask runs both versions (and mx.fast) on the same random
    [1, 1, N, N] array mask: the kernels each side ran are the masked variants (mask kind 1 / 2 in
    their names), and the label says so."""
    for mask, kind in (("bool", "_k1bool"), ("additive", "_k2bfloat16")):
        (row,) = _emulated_ab_forward(tmp_path, f"1,2,40,32,{mask}")["rows"]
        assert row["label"] == f"B=1 H=2 N=40 D=32 bfloat16 {mask} mask"
        assert kind in row["kernels"]["this"][0] and row["kernels"]["this"] == row["kernels"]["other"]
        assert row["output_difference"] == 0.0


def test_ab_versions_tuning_applies_to_this_tree_and_names_the_kernels(tmp_path):
    """--tuning builds this tree's CUDA backend with those Tuning fields (here on the CPU emulator):
    the rows record the kernels each side ran, and only this side's forward takes the override."""
    payload = _emulated_ab_forward(tmp_path, "1,2,40,32,none", "--tuning", "blocks={'forward': (64, 16, 32)}")
    assert payload["tuning"] == {"blocks": "{'forward': (64, 16, 32)}"}
    (row,) = payload["rows"]
    this, other = row["kernels"]["this"], row["kernels"]["other"]
    assert this[0].startswith("mlxflash_forward_") and "_n16_" in this[0] and this[0] != other[0]
    assert this[1:] == other[1:]  # the backward kernels keep the table's blocks
    assert 0 < row["output_difference"] < 2e-2  # the same function, summed in another order


def test_ab_versions_against_tuning_applies_to_the_other_side(tmp_path):
    """--against-tuning builds the other side's backend with its Tuning fields: here head splits on
    one side of a GQA call (the dK/dV kernel's name carries the split flag), none on the other."""
    payload = _emulated_ab_forward(tmp_path, "1,4,40,32,causal,2", "--tuning", "head_splits=1",
                                   "--against-tuning", "head_splits=2")
    assert payload["against_tuning"] == {"head_splits": "2"}
    (row,) = payload["rows"]
    this, other = row["kernels"]["this"], row["kernels"]["other"]
    assert this[:2] == other[:2] and this[2].endswith("_c") and other[2].endswith("_ch")


def test_ab_versions_each_version_has_the_same_neighbours():
    """ab_versions' rounds (sample_order): both versions and mx.fast each round, which version goes
    first alternating; across an even number of rounds (round boundaries counted) each version's
    sample follows mx.fast run in its own process and the other version's sample equally often,
    and never its own last sample."""
    import collections

    tool = load_tool("ab_versions.py")
    rounds = [tool.sample_order(r) for r in range(9)]  # round 0 the warm-up
    assert all(len(order) == 3 and {e for e in order if e[1] == "flash"} == {("this", "flash"), ("other", "flash")}
               and order[2][1] == "fast" for order in rounds)
    assert [order[0][0] for order in rounds[1:]] == ["other", "this"] * 4
    sequence = [entry for order in rounds for entry in order]
    after = collections.Counter((sequence[i - 1], sequence[i]) for i in range(len(rounds[0]), len(sequence)))
    for me, them in (("this", "other"), ("other", "this")):
        assert after[((me, "fast"), (me, "flash"))] == after[((them, "flash"), (me, "flash"))] == 4
        assert sum(n for (before, now), n in after.items() if now == (me, "flash")) == 8


def test_ab_versions_bad_arguments_are_named(tmp_path):
    script = str(ROOT / "benchmarks" / "ab_versions.py")
    for arguments, message in [([], "--against is required"),
                               (["--against", str(tmp_path)], "mlx_flash/ missing"),
                               (["--against", "no-such-revision-x"], "neither a folder nor a git revision"),
                               (["--against", "HEAD", "--shapes", "1,2,64"], "--shapes takes B,H,N,D,mask"),
                               (["--against", "HEAD", "--tuning", "scale_fold"], "--tuning takes KEY=VALUE"),
                               (["--against", "HEAD", "--backend", "mlx", "--tuning", "scale_fold=True"],
                                "needs --backend cuda"),
                               (["--against", "HEAD", "--backend", "mlx", "--against-tuning", "head_splits=2"],
                                "needs --backend cuda"),
                               (["--against", "HEAD", "--backend", "cuda-emulated", "--compiled"],
                                "--compiled needs a GPU backend")]:
        done = subprocess.run([sys.executable, script, *arguments], capture_output=True, text=True, timeout=60,
                              env=ENV, cwd=tmp_path)
        assert done.returncode != 0 and message in done.stdout + done.stderr, (arguments, done.stderr)


def test_bench_array_masks_recorded_plotted_and_named(tmp_path, capsys):
    bench = load_bench()
    bench.main(["--seq-lens", "32", "--heads", "2", "--masks", "bool", "additive", "--head-dims", "16",
                "--passes", "forward", "forward_backward", "--warmup", "0", "--min-repeats", "1", "--max-repeats",
                "1", "--target-seconds", "0", "--compiled", "--out", str(tmp_path), "--name", "m"])
    payload = json.loads((tmp_path / "m.json").read_text())
    assert sorted({r["array_mask"] for r in payload["rows"]}) == ["additive", "bool"]
    assert all(r["status"] == "ok" and not r["causal"] for r in payload["rows"])
    assert (tmp_path / "m_d16_float32.png").read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    bench.main(["--markdown", str(tmp_path / "m.json")])
    out = capsys.readouterr().out
    assert "D=16 float32 bool mask**" in out and "D=16 float32 additive mask**" in out


def test_bench_back_to_back_recorded_and_named(tmp_path, capsys):
    bench = load_bench()
    bench.main(["--seq-lens", "32", "--heads", "2", "--masks", "causal", "--passes", "forward", "forward_backward",
                "--warmup", "0", "--min-repeats", "1", "--max-repeats", "1", "--target-seconds", "0",
                "--back-to-back", "3", "--compiled", "--out", str(tmp_path), "--name", "k", "--no-plots"])
    payload = json.loads((tmp_path / "k.json").read_text())
    assert payload["environment"]["back_to_back"] == 3 and payload["environment"]["mlx_compiled"] is True
    assert all(r["status"] == "ok" and r["median_ms"] > 0 for r in payload["rows"])
    capsys.readouterr()
    bench.main(["--markdown", str(tmp_path / "k.json")])
    assert ("timing: 3 calls back to back per sample, waited for once; MLX's passes mx.compile'd"
            in capsys.readouterr().out)


def test_bench_memory_guard_and_time_budget(tmp_path, capsys, monkeypatch):
    bench = load_bench()

    class Clock:  # bench.py's clock moves 1 s per reading: the first case always spends the budget
        now = 0.0

        @classmethod
        def perf_counter(cls):
            cls.now += 1.0
            return cls.now

    monkeypatch.setattr(bench, "time", Clock)
    # 20 KB: the unfused N^2 arrays (4 B x 2 heads x 64^2 x 2-5 arrays) exceed it; mlx-flash does not.
    bench.main(["--seq-lens", "64", "128", "--heads", "2", "--masks", "none", "--warmup", "0",
                "--min-repeats", "1", "--max-repeats", "1", "--max-memory-gb", str(20e3 / 2**30),
                "--time-budget-s", "1.5", "--out", str(tmp_path), "--name", "g", "--no-plots"])
    out = capsys.readouterr().out
    payload = json.loads((tmp_path / "g.json").read_text())
    by_impl = {}
    for row in payload["rows"]:
        by_impl.setdefault(row["implementation"], []).append(row["status"])
    assert by_impl["mlx-flash"] == ["ok"] * 3
    assert all(s.startswith("skipped: estimated") for s in by_impl["unfused"] + by_impl["mx.fast"])
    assert "skipped: estimated" in out
    # The budget ran out after the first case: the second is listed, not run.
    assert payload["skipped_cases"] == ["B=1 H=2 N=128 D=64 float32"]
    # The recorded JSON renders as Markdown (what benchmarks/RESULTS.md quotes).
    bench.main(["--markdown", str(tmp_path / "g.json")])
    table = capsys.readouterr().out
    assert "**B=1 H=2 N=64 D=64 float32**" in table and f"| mlx-flash[{AUTO_BACKEND}] | fwd |" in table
    assert "| unfused | fwd | skipped: estimated" in table


@pytest.mark.parametrize("arguments, message", [
    (["--dtypes", "foo"], "argument --dtypes: dtype must be one of"),
    (["--seq-lens", "0"], "argument --seq-lens: must be a positive integer, got 0"),
    (["--target-seconds", "nan"], "argument --target-seconds: must be a finite number >= 0"),
    (["--min-repeats", "5", "--max-repeats", "2"], "--max-repeats (2) must be >= --min-repeats (5)"),
    (["--backend", "rocm"], "argument --backend: invalid choice"),
    (["--back-to-back", "0"], "argument --back-to-back: must be a positive integer, got 0"),
    (["--back-to-back", "4", "--passes", "backward"], "--back-to-back times the forward and forward_backward"),
])
def test_bench_bad_values_are_usage_errors(arguments, message, capsys):
    bench = load_bench()
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(arguments)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_help_defaults_presets_and_output_outside_the_tree(capsys):
    bench = load_bench()
    with pytest.raises(SystemExit):
        bench.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option in ("--seq-lens", "--head-dims", "--heads", "--batch", "--warmup", "--out", "--no-plots"):
        help_text = text.split(f" {option} ", 1)[-1].split(" --", 1)[0]
        assert "default" in help_text, (option, help_text)
    args = bench.parse_args([])
    assert ROOT not in args.out.resolve().parents and args.out.resolve() != ROOT
    # A preset fills the options; an option given as well wins.
    args = bench.parse_args(["--preset", "gpu", "--min-repeats", "2"])
    assert args.dtypes == ["bfloat16"] and args.min_repeats == 2 and "torch-cudnn" in args.impls
    cases = bench.build_cases(args)
    assert len(cases) == 2 * len(bench.PRESETS["gpu"]["cases"])
    assert (cases[4].batch, cases[4].q_len, cases[4].head_dim) == (1, 16384, 128)
    # Shapes given on the command line replace the preset's list.
    cases = bench.build_cases(bench.parse_args(["--preset", "gpu", "--head-dims", "128", "--seq-lens", "4096"]))
    assert [(c.head_dim, c.q_len, c.dtype) for c in cases] == [(128, 4096, "bfloat16")] * 2


def test_torch_column_code_path_on_cpu():
    torch = pytest.importorskip("torch")
    bench = load_bench()
    flash = bench.TorchFlash(device="cpu")
    assert bench.TorchFlash(device="cpu", name="torch-cudnn").name == "torch-cudnn"
    case = bm.BenchCase(batch=1, q_heads=2, kv_heads=1, q_len=64, kv_len=64, head_dim=32, dtype="bf16", causal=True)
    assert flash.unsupported_reason(case) is None
    passes = flash.passes(case, seed=0)
    items = {p: (bm.Call(passes[p][1], passes[p][0], flash.finish), case, p, flash.memory_probe()) for p in bm.PASSES}
    rows = bm.measure_many(items, bm.Settings(warmup=0, min_repeats=1, max_repeats=1), catch=False)
    assert all(rows[p]["median_ms"] > 0 for p in bm.PASSES)
    if not torch.cuda.is_available():
        assert bench.TorchFlash().unavailable.endswith("sees no CUDA device")


# ---------------------------------------------------------------------------------------------
# python -m mlx_flash


def test_main_job_quick_run_checks_and_prints_the_table():
    done = subprocess.run([sys.executable, "-m", "mlx_flash", "--quick"], capture_output=True, text=True,
                          timeout=120, env=ENV, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    from mlx_flash.__main__ import DEVICE_DEFAULTS

    defaults = DEVICE_DEFAULTS["gpu" if ON_GPU else "cpu"]
    assert f"backend: '{AUTO_BACKEND}' (auto)" in out and "correctness: PASS" in out
    assert "memory ratio" in out and "MLX ms" in out and defaults["rate_unit"] == RATE_UNIT and RATE_UNIT in out
    # Every column is explained on a line of its own, and a summary line closes the run.
    for column in ("N", "pass", "memory", "memory ratio", "ms", "time ratio", RATE_UNIT):
        assert f"\n  {column} " in out, column
    assert out.strip().splitlines()[-1].startswith(
        f"summary: mlx-flash[{AUTO_BACKEND}] correct; at N={defaults['quick_sizes'][-1]} forward+backward")
    assert out.count("PASS") >= 4 and "FAIL" not in out


@pytest.mark.parametrize("device_type", ["cpu", "gpu"])
def test_main_job_times_with_its_devices_repeats(monkeypatch, device_type):
    """--quick takes the device's repeats: on a GPU a warm-up and several samples (one or two
    single calls of a millisecond put the time ratio anywhere), on a CPU one or two. On a GPU a
    sample is 8 calls back to back; mlx-flash is timed with the --backend asked for."""
    from mlx_flash import __main__ as main_job

    seen = {}

    def comparison(name, cases, passes, settings, rate_unit, timed=None, back_to_back=1, memory_budget=None):
        seen.update(settings=settings, sizes=[c.q_len for c in cases], rate_unit=rate_unit, timed=timed,
                    back_to_back=back_to_back)

    class Device:  # what run_job reads of the default device
        type = mx.gpu if device_type == "gpu" else mx.cpu

    monkeypatch.setattr(main_job, "run_comparison", comparison)
    monkeypatch.setattr(main_job.mx, "default_device", lambda: Device())
    monkeypatch.setattr(main_job, "resolve_backend", lambda requested, device: ("mlx", None, None))
    assert main_job.main(["--quick", "--skip-check"]) == 0
    defaults = main_job.DEVICE_DEFAULTS[device_type]
    assert seen == {"settings": defaults["quick_settings"], "sizes": defaults["quick_sizes"],
                    "rate_unit": defaults["rate_unit"], "timed": "auto",
                    "back_to_back": 8 if device_type == "gpu" else 1}
    if device_type == "gpu":
        assert seen["settings"].warmup >= 1 and seen["settings"].min_repeats >= 5
    assert main_job.main(["--skip-check", "--backend", "mlx"]) == 0
    assert seen["settings"] == defaults["settings"] and seen["sizes"] == defaults["sizes"]
    assert seen["timed"] == "mlx"


def test_main_job_marks_the_sizes_auto_hands_to_mx_fast(monkeypatch, capsys):
    """Under backend="auto" a size the dispatch table routes is timed as routed and says so (the
    route counted by flash_attention is what marks it); the legend names the back-to-back samples."""
    from mlx_flash import __main__ as main_job, fallback

    fallback.reset_fallback_counts()
    seen = []

    def compare(backend, case, passes, settings, progress=None, back_to_back=1, skip_mlx=()):
        seen.append((backend, case.q_len, back_to_back))
        if case.q_len == 1024:  # what flash_attention records for a routed call
            fallback.record_route("dispatch_cuda.txt line 40: sm90 bfloat16 D=128 mha none N=1024..4096; "
                                  "using mx.fast.scaled_dot_product_attention")
        return {(name, p): {"median_ms": 1.0 if name == "mx.fast" else 1.25, "peak_memory_bytes": 100, "tflops": 1.0}
                for name in ("mlx-flash", "mx.fast") for p in passes}

    monkeypatch.setattr(main_job, "compare_with_mlx", compare)
    cases = [bm.BenchCase(batch=1, q_heads=16, kv_heads=16, q_len=n, kv_len=n, head_dim=128, dtype="bfloat16")
             for n in (1024, 2048)]
    last = main_job.run_comparison("cuda", cases, ["forward_backward"], bm.Settings(), "TFLOP/s", timed="auto",
                                   back_to_back=8)
    out = capsys.readouterr().out
    fallback.reset_fallback_counts()
    assert seen == [("auto", 1024, 8), ("auto", 2048, 8)]
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()[:2] in (["1024", "fwd+bwd"],
                                                                                      ["2048", "fwd+bwd"])}
    assert "hands it to mx.fast (dispatch_cuda.txt line 40)" in rows["1024"]
    assert "mx.fast" not in rows["2048"] and "1.25x" in rows["2048"]
    assert "8 calls issued back to back" in out and "--backend cuda times the kernels" in out
    assert last["N"] == 2048 and last["routed"] is False


def test_main_job_does_not_run_mlx_past_its_memory_guard(monkeypatch, capsys):
    """Where MLX's N x N scores would pass the guard's share of the device's memory (a Mac's at
    the GPU sizes: MLX's backward there is unfused), the job times mlx-flash alone and says what
    MLX would need, instead of running it out of memory."""
    from mlx_flash import __main__ as main_job

    case = bm.BenchCase(batch=1, q_heads=2, kv_heads=2, q_len=64, kv_len=64, head_dim=16, dtype="float32")
    needs = bm.score_memory_estimate("mx.fast", case, "forward_backward")
    assert needs == 5 * 2 * 64 * 64 * 4  # the CPU runs mx.fast unfused
    settings = bm.Settings(warmup=0, min_repeats=1, max_repeats=1, target_seconds=0.0)
    last = main_job.run_comparison("mlx", [case], ["forward_backward"], settings, "GFLOP/s", memory_budget=needs / 2)
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.split()[:2] == ["64", "fwd+bwd"])
    assert f"MLX not run: its N x N scores would need ~{bm.format_bytes(needs)}" in row
    assert "MLX not run   the memory guard (40% of the device's memory) keeps MLX from" in out
    assert last["theirs"] is None and last["mine"]["median_ms"] > 0 and last["estimate"] == needs
    # Under the budget both run, and the row has no note.
    last = main_job.run_comparison("mlx", [case], ["forward_backward"], settings, "GFLOP/s", memory_budget=needs * 2)
    out = capsys.readouterr().out
    assert last["theirs"]["median_ms"] > 0 and "MLX not run" not in out
    # The whole job: the summary says what MLX would need.
    monkeypatch.setattr(main_job.bm, "device_memory_bytes", lambda: int(needs / 2 / bm.MEMORY_GUARD_FRACTION))
    assert main_job.main(["--quick", "--skip-check", "--sizes", "64", "--head-dim", "16", "--heads", "2",
                          "--batch", "1", "--dtype", "float32"]) == 0  # the case above on every device
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert "at N=64 forward+backward needs" in summary
    assert f"MLX's would need ~{bm.format_bytes(needs)} (not run)" in summary


def test_main_job_sizes_its_samples_by_work(monkeypatch):
    """A timed sample holds up to the device's calls back to back, as many as make SAMPLE_WORK (8
    fwd+bwd calls at B=1 H=16 N=4096 D=128): the GPU sizes' short calls go 8 at a time, the long
    ones one or two, so a slower GPU does not pay 8x for its largest sizes."""
    from mlx_flash import __main__ as main_job

    def case(n):
        return bm.BenchCase(batch=1, q_heads=16, kv_heads=16, q_len=n, kv_len=n, head_dim=128, dtype="bfloat16")

    most = main_job.DEVICE_DEFAULTS["gpu"]["back_to_back"]
    assert [bm.calls_per_sample(case(n), "forward_backward", most) for n in (1024, 2048, 4096, 8192, 16384)] \
        == [8, 8, 8, 2, 1]
    assert [bm.calls_per_sample(case(n), "forward", most) for n in (4096, 8192, 16384)] == [8, 7, 2]
    cpu_most = main_job.DEVICE_DEFAULTS["cpu"]["back_to_back"]
    assert bm.calls_per_sample(case(1024), "forward_backward", cpu_most) == 1
    seen = {}

    def measure_many(items, settings, catch, progress):
        seen.update({key: item[0].back_to_back for key, item in items.items()})

    monkeypatch.setattr(main_job.bm, "measure_many", measure_many)
    monkeypatch.setattr(main_job.bm, "random_inputs", lambda case, seed: None)  # no arrays of these sizes
    monkeypatch.setattr(main_job.bm, "mlx_pass", lambda attention, case, inputs, pass_name: (None, lambda _: None))
    main_job.compare_with_mlx("mlx", case(8192), ["forward", "forward_backward"], bm.Settings(), back_to_back=most)
    assert seen == {("mlx-flash", "forward"): 7, ("mlx-flash", "forward_backward"): 2,
                    ("mx.fast", "forward"): 7, ("mx.fast", "forward_backward"): 2}


def test_main_job_check_notes_fallbacks_instead_of_warning(monkeypatch):
    """A fallback in the check is counted and goes to the table's note column; its warning, which
    would only repeat it above the table, does not escape the check."""
    import warnings

    from mlx_flash import __main__ as main_job, fallback

    fallback.reset_fallback_counts()

    real = main_job.flash_attention

    def flash_attention(*args, **kwargs):
        fallback.record_fallback("a reason from the test")
        return real(*args, **kwargs)

    monkeypatch.setattr(main_job, "flash_attention", flash_attention)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = main_job.check_backend("mlx", "float32", 16)
    fallback.reset_fallback_counts()
    assert not [w for w in caught if issubclass(w.category, fallback.FallbackWarning)]
    assert all(r["fallbacks"] == ["a reason from the test"] and r["passed"] for r in results)


def test_main_job_exits_non_zero_when_a_check_fails(monkeypatch, capsys):
    from mlx_flash import __main__ as main_job

    # Tolerances no real computation meets: the check must fail and say so.
    monkeypatch.setattr(main_job.reference, "GRADIENT_TOLERANCE", {"float32": 0.0, "float16": 0.0, "bfloat16": 0.0})
    assert main_job.main(["--quick", "--sizes", "16"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "CORRECTNESS FAILED" in out


@pytest.mark.usefixtures("on_cpu")  # the CPU's float32 matmuls are float32's
def test_main_job_holds_float32_through_reduced_matmuls_to_float16_limits(monkeypatch, capsys):
    """Where MLX's float32 matmuls round to fewer bits (TF32 on a CUDA GPU, an M5's accelerators),
    a float32 case served by MLX's operations is held to float16's limits and the table says why;
    on this CPU they are exact, and float32's limits hold."""
    from mlx_flash import __main__ as main_job, reference

    assert reference.float32_matmuls_reduced(mx.cpu) is False
    assert reference.limits("float32") == (1e-4, 2e-4) and reference.limits("bfloat16", True) == (3e-2, 6e-2)
    assert [r["limits"] for r in main_job.check_backend("mlx", "float32", 32)] == [(1e-4, 2e-4)] * 3
    monkeypatch.setattr(reference, "float32_matmuls_reduced", lambda device=None: True)
    results = main_job.check_backend("mlx", "float32", 32)
    assert all(r["reduced_float32"] and r["limits"] == reference.limits("float16") and r["passed"] for r in results)
    assert not any(r["reduced_float32"] for r in main_job.check_backend("mlx", "bfloat16", 32))
    assert main_job.run_check("mlx", "float32", 32)
    out = capsys.readouterr().out
    assert "4e-03/1e-02" in out and "MLX_ENABLE_TF32=0 python -m mlx_flash" in out and "FAIL" not in out


@pytest.mark.parametrize("arguments, message", [
    (["--dtype", "int8"], "argument --dtype: dtype must be one of"),
    (["--sizes", "0"], "argument --sizes: must be a positive integer, got 0"),
    (["--heads", "two"], "argument --heads: must be a positive integer, got 'two'"),
    (["--backend", "rocm"], "argument --backend: invalid choice: 'rocm'"),
])
def test_main_job_bad_values_are_usage_errors(arguments, message, capsys):
    from mlx_flash import __main__ as main_job

    with pytest.raises(SystemExit) as exit_info:
        main_job.main(arguments)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m mlx_flash") and message in err and "Traceback" not in err


def test_main_job_help_shows_every_default(capsys):
    from mlx_flash import __main__ as main_job

    with pytest.raises(SystemExit):
        main_job.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    options = [o for o in text.split() if o.startswith("--") and o != "--help"]
    assert options
    for option in dict.fromkeys(options):
        help_text = text.split(f" {option} ", 1)[-1].split(" --", 1)[0]
        assert "default" in help_text, (option, help_text)


def test_subcommands_plug_in_with_one_function(monkeypatch, capsys):
    from mlx_flash import __main__ as main_job

    def add_echo_parser(subparsers):
        parser = subparsers.add_parser("echo", help="print the word")
        parser.add_argument("word")
        parser.set_defaults(run=lambda args: print(args.word) or 0)
        return parser

    monkeypatch.setattr(main_job, "SUBCOMMANDS", [add_echo_parser])
    assert main_job.main(["echo", "hello"]) == 0
    assert capsys.readouterr().out == "hello\n"


def test_variants_tool_old_column_runs_the_old_trees_own_backend(tmp_path):
    """The old tree's registry names its modules absolutely ("mlx_flash.backends.mlx_ops"): the
    variants tool must time the old tree's backend object, not this checkout's under the old API."""
    import shutil
    shutil.copytree(ROOT / "mlx_flash", tmp_path / "mlx_flash", ignore=shutil.ignore_patterns("__pycache__"))
    spec = importlib.util.spec_from_file_location("variants_tool", ROOT / "benchmarks" / "mlx_backend_variants.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    old = tool.load_old(str(tmp_path))
    attend = tool.old_backend(old)
    backend = next(c.cell_contents for c in attend.__closure__ if hasattr(c.cell_contents, "forward"))
    assert type(backend).__module__ == "mlx_flash_old.backends.mlx_ops"
    q = mx.random.normal((1, 2, 64, 16))
    assert mx.allclose(attend(q, q, q, "causal", 0.25), tool.new_backend(4)(q, q, q, "causal", 0.25), atol=1e-5)


# ---------------------------------------------------------------------------------------------
# benchmarks/ncu_profile.py: ncu's raw CSV to the summary (ncu itself needs a GPU)

def load_tool(script: str):
    """benchmarks/<script> as a module (its cli_args import resolved as when run as a script)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        name = script.removesuffix(".py") + "_tool"
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


NCU_RAW = '''==PROF== Connected to process 1
"ID","Kernel Name","gpu__time_duration.sum","sm__throughput.avg.pct_of_peak_sustained_elapsed","sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio","smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio","smsp__average_warps_issue_stalled_wait_per_issue_active.ratio","launch__registers_per_thread","sm__issue_active.avg.pct_of_peak_sustained_elapsed"
"","","usecond","%","%","ratio","ratio","ratio","register/thread","%"
"0","warm_up_kernel(int)","9","1","0","0","0","0","32","1"
"1","mlxflash_profile_marker","0.003","1","0","0","0","0","16","1"
"2","custom_kernel_forward<64>(float*)","1,234.5","71.5","74.0","0.5","2.7","1.4","168","63.5"
"3","cudnn::convert_dq_to_16bits<1>","55","16","0","0","55.3","0","30","9"
==PROF== Disconnected from process 1
'''


def test_ncu_profile_keeps_the_call_after_the_marker():
    """Only the launches after the last marker are the profiled call's; times are read in the
    units row's unit; the stall reasons come out largest first; the table has one row each."""
    tool = load_tool("ncu_profile.py")
    rows, units, marked = tool.kernel_rows(NCU_RAW)
    assert marked and [r["ID"] for r in rows] == ["2", "3"]
    first, second = (tool.summarize(r, units) for r in rows)
    assert first["kernel"] == "custom_kernel_forward<64>" and first["time_us"] == 1234.5
    assert first["sm_pct"] == 71.5 and first["registers"] == 168 and first["issue_pct"] == 63.5
    assert first["tensor_pct"] == {"pipe_tensor_cycles_active": 74.0}
    assert list(first["stalls"]) == ["long_scoreboard", "wait", "barrier"]
    assert second["time_us"] == 55 and list(second["stalls"]) == ["long_scoreboard"]
    table = tool.table({"call": [first, second]}).splitlines()
    assert len(table) == 4 and "long_scoreboard 2.7, wait 1.4, barrier 0.5" in table[2]
    nanoseconds = NCU_RAW.replace('"usecond"', '"nsecond"')
    rows, units, _ = tool.kernel_rows(nanoseconds)
    assert tool.summarize(rows[0], units)["time_us"] == 1.2345
    _, _, marked = tool.kernel_rows(NCU_RAW.replace("mlxflash_profile_marker", "other"))
    assert not marked


def test_ncu_profile_needs_ncu_and_valid_shapes(tmp_path):
    """Without ncu on the PATH the tool says so; a bad --shapes names the argument."""
    script = str(ROOT / "benchmarks" / "ncu_profile.py")
    env = {**ENV, "PATH": str(tmp_path)}  # no ncu there
    done = subprocess.run([sys.executable, script, "--out", str(tmp_path)], env=env, capture_output=True, text=True)
    assert done.returncode == 2 and "ncu" in done.stderr
    done = subprocess.run([sys.executable, script, "--shapes", "4,16,4096"], env=env, capture_output=True, text=True)
    assert done.returncode == 2 and "--shapes takes B,H,N,D,mask" in done.stderr and "Traceback" not in done.stderr


# ---------------------------------------------------------------------------------------------
# benchmarks/timeline.py: a CUPTI trace to kernel time and the GPU's idle time (CUPTI needs a GPU)

def test_timeline_splits_samples_into_calls_and_gaps(tmp_path):
    """GPU activities of a chrome trace (kernels, memsets; not CPU events) become, per call: the
    span, busy time (overlaps counted once), idle time and the gap before each kernel; a trace
    whose events do not split into samples x calls says so; untraced samples give the wall only."""
    tool = load_tool("timeline.py")
    trace = {"traceEvents": [
        {"cat": "kernel", "name": "fwd(int)", "ts": 100.0, "dur": 10.0},
        {"cat": "cpu_op", "name": "host", "ts": 0.0, "dur": 500.0},
        {"cat": "gpu_memset", "name": "Memset", "ts": 108.0, "dur": 4.0},   # overlaps fwd by 2
        {"cat": "kernel", "name": "bwd", "ts": 115.0, "dur": 5.0},
        {"cat": "kernel", "name": "fwd(int)", "ts": 124.0, "dur": 10.0},   # second call: 4 after
        {"cat": "gpu_memset", "name": "Memset", "ts": 134.0, "dur": 1.0},
        {"cat": "kernel", "name": "bwd", "ts": 140.0, "dur": 6.0}]}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    events = tool.gpu_events(path)
    assert [name for _, _, name in events] == ["fwd(int)", "Memset", "bwd"] * 2
    assert tool.busy_time(events[:3]) == 12 + 5
    row = tool.analyse([0.001], events, samples=1, calls=2)
    assert row["kernels_per_call"] == 3 and row["wall_ms"] == 1.0   # timed_once's seconds are per call
    assert row["span_ms"] == (146 - 100) / 2 / 1e3 and row["busy_ms"] == (17 + 17) / 2 / 1e3
    assert row["idle_ms"] == (46 - 34) / 2 / 1e3
    assert [k["name"] for k in row["kernels"]] == ["fwd", "Memset", "bwd"]
    assert [k["gap_before_us"] for k in row["kernels"]] == [4.0, 0.0, 4.0]  # medians of (4), (0, 0), (3, 5)
    assert [k["us"] for k in row["kernels"]] == [10.0, 2.5, 5.5]
    assert "error" in tool.analyse([0.001], events[:5], samples=1, calls=2)
    assert tool.analyse([0.002, 0.004], [], samples=2, calls=2) == {"wall_ms": 3.0}
    table = tool.summary([{"label": "s", "implementation": "ours", **row},
                          {"label": "s", "implementation": "mx.fast", "wall_ms": 1.5, "busy_ms": 0.0085,
                           "idle_ms": 0.001}]).splitlines()
    # speed 1.5 / 1.0, kernel 0.0085 / 0.017
    assert len(table) == 3 and table[2].split()[:5] == ["s", "1.000", "1.500", "1.500x", "0.500x"]


def test_timeline_needs_a_gpu_and_valid_arguments():
    """A bad --shapes or --rounds names the argument; without a GPU the tool says so."""
    script = str(ROOT / "benchmarks" / "timeline.py")
    done = subprocess.run([sys.executable, script, "--shapes", "4,16,4096"], env=ENV, capture_output=True, text=True)
    assert done.returncode == 2 and "--shapes takes B,H,N,D,mask" in done.stderr and "Traceback" not in done.stderr
    done = subprocess.run([sys.executable, script, "--shapes", "1,2,64,64,none", "--rounds", "0"], env=ENV,
                          capture_output=True, text=True)
    assert done.returncode == 2 and "--rounds" in done.stderr
    done = subprocess.run([sys.executable, script, "--shapes", "1,2,64,64,none", "--backend", "mlx", "--tuning",
                           "fused_query=True"], env=ENV, capture_output=True, text=True)
    assert done.returncode == 2 and "--tuning" in done.stderr and "'mlx'" in done.stderr
    if mx.default_device().type == mx.cpu:
        done = subprocess.run([sys.executable, script, "--shapes", "1,2,64,64,none"], env=ENV, capture_output=True,
                              text=True)
        assert done.returncode != 0 and "GPU" in done.stderr


def test_bench_training_runs_the_tree_it_is_told(tmp_path):
    """benchmarks/bench_training.py imports this repository's mlx_flash, or MLX_FLASH_TREE's (another
    version's tree, for A/Bs of the training step), and the JSON names the package that ran."""
    pytest.importorskip("mlx_lm")
    import shutil
    tree = tmp_path / "tree"
    for name in ("mlx_flash", "kernels"):
        shutil.copytree(ROOT / name, tree / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    script = str(ROOT / "benchmarks" / "bench_training.py")
    for chosen, expected in ((None, ROOT / "mlx_flash"), (tree, tree / "mlx_flash")):
        env = {k: v for k, v in ENV.items() if k != "MLX_FLASH_TREE"}
        if chosen is not None:
            env["MLX_FLASH_TREE"] = str(chosen)
        out = tmp_path / "train.json"
        done = subprocess.run([sys.executable, script, "--preset", "cpu", "--seq-lens", "32", "--steps", "1",
                               "--rounds", "1", "--warmup", "1", "--memory-steps", "1", "--out", str(out)],
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        result = json.loads(out.read_text())
        assert result["environment"]["mlx_flash_path"] == str(expected.resolve())
    row = result["rows"][0]  # one round: its ratio is the speed, and both quartiles
    assert len(row["speed_ratio_rounds"]) == 1
    assert row["speed_ratio_quartiles"] == [row["speed_ratio_rounds"][0]] * 2
    assert abs(row["speed_ratio_rounds"][0] - row["speed_ratio"]) < 1e-9
    assert f"x ({row['speed_ratio_quartiles'][0]:.2f}-" in done.stdout


def test_mx_fast_fusion_on_cuda_follows_the_fast_backends_rule(monkeypatch):
    """On a CUDA GPU the memory guard counts mx.fast as fused where MLX runs cuDNN (backends/fast.py):
    fp16 / bf16 with D a multiple of 8 up to 128, the backward only for query rows a multiple of 128."""
    monkeypatch.setattr(bm.mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(bm.mx.metal, "is_available", lambda: False)

    def fused(n=4096, d=128, dtype="bfloat16", pass_name="forward_backward"):
        case = bm.BenchCase(batch=1, q_heads=2, kv_heads=2, q_len=n, kv_len=n, head_dim=d, dtype=dtype)
        return bm.mx_fast_is_fused(case, pass_name)

    assert fused() and fused(d=64, dtype="float16") and fused(d=96)
    assert not fused(d=100) and not fused(d=256) and not fused(dtype="float32")
    assert fused(n=1000, pass_name="forward") and not fused(n=1000) and not fused(n=1000, pass_name="backward")
    case = bm.BenchCase(batch=1, q_heads=2, kv_heads=2, q_len=1000, kv_len=1000, head_dim=128, dtype="bfloat16")
    assert bm.score_memory_estimate("mx.fast", case, "forward") == 0
    assert bm.score_memory_estimate("mx.fast", case, "forward_backward") > 0


# ---------------------------------------------------------------------------------------------
# benchmarks/cta_phases.py: its stamps fit the forward template; the records' arithmetic

def test_cta_phases_stamps_fit_the_forward_template(tmp_path):
    """Every line cta_phases inserts its clock stamps at is in this tree's templates once (the tool
    stops with the line's name otherwise), and the stamped forward writes its record."""
    phases = load_tool("cta_phases.py")
    shutil.copytree(ROOT / "mlx_flash", tmp_path / "mlx_flash")  # its kernels link followed: a copy of its own
    shutil.copytree(ROOT / "kernels", tmp_path / "kernels")
    with pytest.raises(SystemExit, match="not a link"):
        phases.stamp_tree(str(tmp_path))
    shutil.rmtree(tmp_path / "mlx_flash")
    shutil.copytree(ROOT / "mlx_flash", tmp_path / "mlx_flash", symlinks=True)
    phases.stamp_tree(str(tmp_path))
    assert "probe[11] = clock64();" in (tmp_path / "mlx_flash" / phases.TEMPLATE).read_text()
    forward = (tmp_path / phases.TEMPLATE).read_text()
    assert all(f"probe[{i}] = clock64();" in forward for i in range(1, 12)) and "probe_p[1] = clock64();" in forward
    assert "w[15 + i] = (unsigned)(probe_p[i] - probe_e)" in forward
    assert "volatile unsigned long long* probe_p" in (tmp_path / "kernels" / "wgmma_common.cuh").read_text()
    (tmp_path / phases.TEMPLATE).write_text(forward.replace("  registers_increase<CONSUMER_REGS>();\n", ""))
    with pytest.raises(SystemExit, match="registers_increase"):
        phases.stamp_tree(str(tmp_path))


def test_cta_phases_records_to_phases():
    """Two SMs with two CTAs each (one warpgroup of 64 rows a CTA): the SM clock fitted from the
    entry clocks against the timer, the phases' medians, the gaps between CTAs and the idle ends."""
    phases = load_tool("cta_phases.py")
    ghz = 1.5
    words = np.zeros((1, 4 * 64), dtype=np.uint32)
    ends = {}
    for cta, (sm, start_ns) in enumerate([(0, 0), (1, 100), (0, 10_000), (1, 12_100)]):
        entry = 1_000_000 + int(start_ns * ghz)
        duration = 9_000 if cta < 3 else 12_000  # cycles
        consumer = [int(duration * (i + 1) / 11) for i in range(11)]
        record = [sm, entry & 0xFFFFFFFF, entry >> 32, start_ns, 0] + consumer + [10, 20, 30]
        words[0, cta * 64:cta * 64 + len(record)] = record
        ends[cta] = start_ns + duration / ghz
    records = phases.decode(words, parallel_block=64)
    assert [r["cta"] for r in records] == [(0, 0), (0, 1), (0, 2), (0, 3)] and records[3]["sm"] == 1
    summary = phases.summarize(records, steps=8)
    assert abs(summary["sm_clock_ghz"] - ghz) < 1e-9 and summary["ctas"] == 4 and summary["sms"] == 2
    assert abs(summary["phase_end_us"]["end"] - 9_000 / ghz / 1e3) < 1e-9  # three of the four CTAs
    # gaps: SM 0 from 6000 to 10000 ns, SM 1 from 6100 to 12100 ns
    assert abs(summary["gap_between_ctas_us"] - 5.0) < 1e-9
    kernel_end = max(ends.values())
    assert abs(summary["kernel_us"] - kernel_end / 1e3) < 1e-9
    assert abs(summary["sm_idle_at_end_us"] - (kernel_end - ends[2]) / 2 / 1e3) < 1e-9
    assert abs(summary["loop_us_per_step"] - (summary["phase_end_us"]["step loop done"]
                                              - summary["phase_end_us"]["first softmax done"]) / 7) < 1e-12

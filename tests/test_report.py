"""`python -m mlx_flash report`: through the Metal simulator, both files, readable tables, and
what a broken kernel looks like in them (the simulator's fault injection).

The command itself (`--quick`: five variant sets, about 70 s through the simulator on 2 cores
with a cold compile cache) is exercised here with --max-cases / --sizes so CI stays fast; the
case list of --quick is checked separately.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from metal_compiler import require_metal_compiler  # noqa: E402
require_metal_compiler()

import mlx.core as mx  # noqa: E402
import mlx_flash  # noqa: E402
from mlx_flash import report, report_markdown  # noqa: E402
from mlx_flash import __main__ as mlx_main
from mlx_flash.backends import guard  # noqa: E402
from child_env import child_env  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _tables(markdown: str):
    """The tables of a markdown document as rendered by a CommonMark + GFM-tables parser:
    [(header cells, [row cells, ...]), ...]."""
    markdown_it = pytest.importorskip("markdown_it")
    tokens = markdown_it.MarkdownIt("commonmark").enable("table").parse(markdown)
    tables, current, row, cell = [], None, None, None
    for token in tokens:
        if token.type == "table_open":
            current = []
        elif token.type == "tr_open":
            row = []
        elif token.type in ("th_open", "td_open"):
            cell = ""
        elif token.type == "inline" and cell is not None:
            cell = token.content
        elif token.type in ("th_close", "td_close"):
            row.append(cell)
            cell = None
        elif token.type == "tr_close":
            current.append(row)
        elif token.type == "table_close":
            tables.append((current[0], current[1:]))
    return tables


def test_report_command_through_the_simulator(tmp_path):
    """`python -m mlx_flash report --quick` in a fresh process: both files, every table readable."""
    env = child_env(MLX_FLASH_METAL_SIM="1")
    env.pop("MLX_FLASH_METALSIM_FAULT", None)
    result = subprocess.run([sys.executable, "-m", "mlx_flash", "report", "--quick", "--out", str(tmp_path),
                             "--max-cases", "1", "--sizes", "32"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads((tmp_path / "report.json").read_text())
    markdown = (tmp_path / "report.md").read_text()
    assert data["complete"] and data["backend"] == "metal" and data["environment"]["metal_simulated"]
    (case,) = data["correctness"]
    assert case["status"] == "PASS" and set(case["errors"]) == {"out", "lse", "dq", "dk", "dv"}
    assert {(r["implementation"], r["pass"]) for r in data["performance"]} == {
        (name, p) for name in report.IMPLEMENTATIONS for p in ("forward", "forward_backward")}
    assert all(r["median_ms"] > 0 and r["ginstrs"] > 0 for r in data["performance"])
    assert [c["verdict"] for c in data["first_contact"]] == [None, None]  # the case's and the timing's variants
    assert data["fallbacks"] == {}

    assert report_markdown.render_markdown(data) == markdown  # report.json alone renders report.md again
    tables = _tables(markdown)
    assert len(tables) == 4  # environment, correctness, speed, first contact (no fallbacks: a sentence)
    for header, rows in tables:
        assert rows and all(len(row) == len(header) for row in rows)
    correctness = dict(zip(tables[1][0], tables[1][1][0]))
    assert correctness["result"] == "PASS" and correctness["D"] == str(case["head_dim"])
    assert "simulator" in markdown and "Correctness: PASS" in markdown


@pytest.mark.parametrize("fault", ["compile:backward_key_value", "corrupt:forward"])
def test_report_shows_a_broken_kernel_as_fallback(tmp_path, monkeypatch, fault):
    monkeypatch.setenv("MLX_FLASH_METAL_SIM", "1")
    monkeypatch.setenv("MLX_FLASH_METALSIM_FAULT", fault)
    monkeypatch.delenv("MLX_FLASH_SELF_CHECK", raising=False)
    guard.GUARD.forget()
    mlx_flash.reset_fallback_counts()
    try:
        with pytest.warns(mlx_flash.FallbackWarning):
            code = mlx_main.main(["report", "--quick", "--out", str(tmp_path), "--max-cases", "1", "--sizes", "16"])
        data = json.loads((tmp_path / "report.json").read_text())
    finally:
        guard.GUARD.forget()
        mlx_flash.reset_fallback_counts()
    assert code == 0  # right numbers (from the fallback): nothing failed
    (case,) = data["correctness"]
    kind, kernel = fault.split(":")
    assert case["status"] == "FALLBACK" and kernel in case["fallbacks"][0]
    # What the fallback hid: the kernels called directly.
    assert not case["kernel"]["passed"]
    if kind == "compile":
        assert "fault injected" in case["kernel"]["error"]
    else:
        assert case["kernel"]["errors"]["out"] > 1 and case["errors"]["out"] < 1e-4
    assert data["summary"]["verdict"] == "PASS with fallbacks"
    assert any(c["verdict"] and kernel in c["verdict"] for c in data["first_contact"])
    assert sum(data["fallbacks"].values()) >= 1
    # The timing's variant set (another D) breaks the same way: mlx-flash's times are marked.
    assert all(kernel in r["fallback"] for r in data["performance"] if r["implementation"] == "mlx-flash")
    markdown = (tmp_path / "report.md").read_text()
    header, rows = _tables(markdown)[-1]  # the fallbacks table
    assert header == ["calls", "reason"] and kernel in rows[0][1]
    assert "**FALLBACK**" in markdown and "open an issue" in markdown and "called directly" in markdown
    assert f"Fault injected on purpose: MLX_FLASH_METALSIM_FAULT={fault}" in markdown
    if kind == "compile":  # the compiler's whole message, not only the warning's shortened one
        assert "Whole error of" in markdown and f"kernel 'mlx_flash_{kernel}" in markdown


def test_case_sets_cover_the_standard_set():
    full = report.standard_cases()
    assert {c.head_dim for c in full} == set(report.HEAD_DIMS) == {32, 64, 80, 96, 128, 160, 192, 256}
    assert {(c.head_dim, c.mask, c.dtype) for c in full} == {
        (d, m, t) for d in report.HEAD_DIMS for m in report.MASKS for t in report.DTYPES}
    assert all(c.q_heads > c.kv_heads for c in full)  # GQA
    quick = report.quick_cases()
    assert {c.mask for c in quick} == set(report.MASKS) and {c.dtype for c in quick} == set(report.DTYPES)
    assert any(c.q_heads == c.kv_heads for c in quick) and any(c.q_heads > c.kv_heads for c in quick)


def test_markdown_table_escapes_pipes():
    text = report_markdown.markdown_table(["a", "b"], [[1, "x | y"], [2.5, None]])
    (header, rows), = _tables(text)
    assert header == ["a", "b"] and rows == [["1", "x | y"], ["2.5", "-"]]


@pytest.mark.usefixtures("on_cpu")  # the CPU's float32 matmuls are float32's
def test_float32_served_by_mlx_operations_meets_their_precision(monkeypatch):
    """A float32 case served by MLX's own operations is held to float16's limits where MLX's
    float32 matmuls round to fewer bits (reference.float32_matmuls_reduced; TF32 on a CUDA GPU),
    and to float32's where they do not (this CPU)."""
    from mlx_flash import reference

    case = report.CheckCase(64, "float32", "causal")
    record = report.check_case(case, "mlx")
    assert record["status"] == "PASS" and not record["reduced_float32"]
    assert record["tolerance"] == {"forward": 1e-4, "gradient": 2e-4}
    monkeypatch.setattr(reference, "float32_matmuls_reduced", lambda device=None: True)
    record = report.check_case(case, "mlx")
    assert record["status"] == "PASS" and record["reduced_float32"]
    assert record["tolerance"] == {"forward": 4e-3, "gradient": 1e-2}
    assert not report.check_case(report.CheckCase(64, "bfloat16", "causal"), "mlx")["reduced_float32"]


def test_timing_skips_passes_past_the_memory_guard(monkeypatch):
    """A pass of mx.fast or unfused whose N x N scores would pass the guard's share of the
    device's memory is not run (on a Mac, mx.fast's backward is unfused); mlx-flash always runs."""
    from mlx_flash import benchmark as bm

    case = bm.BenchCase(batch=1, q_heads=2, kv_heads=2, q_len=64, kv_len=64, head_dim=16, dtype="float32")
    needs = {p: bm.score_memory_estimate("mx.fast", case, p) for p in ("forward", "forward_backward")}
    assert needs["forward"] < needs["forward_backward"]  # on the CPU both run unfused
    # A device whose guard lets the forwards in and keeps the forward+backward passes out.
    monkeypatch.setattr(bm, "device_memory_bytes",
                        lambda: int((needs["forward"] + needs["forward_backward"]) / 2 / bm.MEMORY_GUARD_FRACTION))
    settings = bm.Settings(warmup=0, min_repeats=1, max_repeats=1, target_seconds=0.0)
    rows = report.time_size("mlx", case, settings)
    by = {(r["implementation"], r["pass"]): r for r in rows}
    for name in ("mx.fast", "unfused"):
        assert by[name, "forward"]["median_ms"] > 0
        assert by[name, "forward_backward"]["error"] == (
            f"skipped: its N x N scores need ~{bm.format_bytes(needs['forward_backward'])}")
    assert all(by["mlx-flash", p]["median_ms"] > 0 for p in ("forward", "forward_backward"))


def test_gpu_timing_is_back_to_back_and_says_so():
    """On a GPU each timed sample is 8 calls back to back (as the main job times them), on a CPU
    one; the speed section says which, and time_size times the calls it is given that way."""
    from mlx_flash import benchmark as bm

    assert report.plan_for(mx.Device(mx.gpu), quick=True).back_to_back == 8
    assert report.plan_for(mx.Device(mx.cpu), quick=True).back_to_back == 1
    case = bm.BenchCase(batch=1, q_heads=2, kv_heads=2, q_len=32, kv_len=32, head_dim=16, dtype="float32")
    rows = report.time_size("mlx", case, bm.Settings(warmup=0, min_repeats=1, max_repeats=1, target_seconds=0.0),
                            back_to_back=2)
    assert {(r["implementation"], r["pass"]) for r in rows if r.get("median_ms", 0) > 0} == {
        (name, p) for name in report.IMPLEMENTATIONS for p in ("forward", "forward_backward")}
    setup = {"heads": 2, "head_dim": 16, "dtype": "float32", "sizes": [32], "causal": [False]}
    data = {"environment": {"device_name": "GPU", "device": "gpu"}, "backend": "cuda", "backend_requested": "auto",
            "quick": True, "correctness": [], "correctness_setup": {"q_len": 150, "kv_len": 173, "window": [48, 0]},
            "complete": True, "performance": [{**r, "N": 32, "causal": False} for r in rows]}
    for batched, phrase in ((8, "each sample up to 8 calls issued back to back"), (1, "(timed interleaved), peak")):
        markdown = report_markdown.render_markdown({**data, "performance_setup": {**setup, "back_to_back": batched}})
        assert phrase in markdown
    # A report.json written before the field renders as one call per sample.
    assert "(timed interleaved), peak" in report_markdown.render_markdown({**data, "performance_setup": setup})

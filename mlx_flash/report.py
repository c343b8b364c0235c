"""`python -m mlx_flash report --out DIR [--quick]`: what mlx-flash does on this machine, in
two files a device owner can share (DIR/report.json, DIR/report.md).

1. Device (name, GPU architecture string, what else MLX reports), OS, MLX and mlx-flash versions.
2. Correctness: a standard set of calls (head dims 32..256; no mask, causal, causal sliding
   window, boolean array mask; fp16, bf16, fp32; GQA) through `flash_attention` on the chosen
   backend, forward and backward; relative errors of out, lse, dq, dk, dv against the float64
   reference (mlx_flash.reference, its tolerances). A call that the backend handed to its
   fallback is marked FALLBACK with the reason: it passed, but not on the kernels.
3. Speed and memory: forward and forward+backward of mlx-flash next to
   mx.fast.scaled_dot_product_attention and unfused MLX attention (the N x N scores
   materialized), timed interleaved with mlx_flash.benchmark's helpers; ratios, G instructions/s.
4. Every first contact (kernel variants built, run and self-checked; guard.py) and every
   fallback of the run, with its reason.
The files are rewritten after each step, so a run that is stopped still leaves what it measured.

`--quick` runs a reduced case set at smaller sizes (on a CPU through the Metal simulator,
MLX_FLASH_METAL_SIM=1, it stays under 3 minutes on 2 cores with the simulator's cache cold).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from . import benchmark as bm, reference
from .backends import BACKEND_NAMES, auto_backend_name, get_backend, metal_simulated
from .cli import positive_int
from .fallback import fallback_counts, route_counts
from .report_markdown import IMPLEMENTATIONS, WHERE_TO_SEND, render_markdown

HEAD_DIMS = (32, 64, 80, 96, 128, 160, 192, 256)
MASKS = ("none", "causal", "window", "array")
DTYPES = ("float16", "bfloat16", "float32")
WINDOW = (48, 0)  # the "window" case: causal sliding window of 48 keys back


@dataclasses.dataclass(frozen=True)
class CheckCase:
    """One correctness call: q [1, Hq, Nq, D], k/v [1, Hkv, Nk, D]."""

    head_dim: int
    dtype: str
    mask: str          # one of MASKS
    q_heads: int = 4
    kv_heads: int = 2
    q_len: int = 150   # Nq != Nk and neither a multiple of a block: partial blocks, off-centre diagonal
    kv_len: int = 173

    def label(self) -> str:
        return f"D={self.head_dim} {self.dtype} {self.mask} H={self.q_heads}/{self.kv_heads}"


def standard_cases() -> List[CheckCase]:
    """Every head dim x mask x dtype, GQA 4:2 (96 calls; 96 variant sets on a kernel backend)."""
    return [CheckCase(d, dtype, mask) for d in HEAD_DIMS for mask in MASKS for dtype in DTYPES]


def quick_cases() -> List[CheckCase]:
    """Every dtype, mask kind and both GQA and plain heads once, over four head dims (five
    variant sets: what the simulator compiles in about two minutes on 2 cores)."""
    return [CheckCase(64, "float32", "causal"), CheckCase(128, "bfloat16", "window"),
            CheckCase(32, "float16", "array", q_heads=2, kv_heads=2), CheckCase(96, "float32", "none"),
            CheckCase(80, "float16", "causal", q_len=97, kv_len=64)]


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a report run does (sizes by device; see `plan_for`)."""

    cases: Sequence[CheckCase]
    sizes: Sequence[int]
    heads: int
    head_dim: int
    dtype: str
    causal: Sequence[bool]
    settings: bm.Settings
    back_to_back: int = 1  # at most this many calls per timed sample (benchmark.calls_per_sample): 8 on a GPU


def plan_for(device: mx.Device, quick: bool, max_cases: Optional[int] = None,
             sizes: Optional[Sequence[int]] = None) -> Plan:
    """The run's cases and timing sizes. A GPU times N = 1024..8192 (bf16, D = 128, 8 heads,
    causal and not); a CPU (the simulator) a few small N at fp32 / D = 64."""
    cases = quick_cases() if quick else standard_cases()
    if max_cases is not None:
        cases = cases[:max_cases]
    if device.type == mx.gpu:
        return Plan(cases, sizes or ((1024, 2048) if quick else (1024, 2048, 4096, 8192)), heads=8, head_dim=128,
                    dtype="bfloat16", causal=(False,) if quick else (False, True),
                    settings=bm.Settings(warmup=1 if quick else 2, min_repeats=3, max_repeats=10,
                                         target_seconds=0.2 if quick else 0.5), back_to_back=8)
    # 2-core CPU through the simulator: one simulated forward+backward at N=256, H=2, D=64
    # takes about a second.
    return Plan(cases, sizes or ((128, 256) if quick else (256, 512, 1024)), heads=2, head_dim=64,
                dtype="float32", causal=(False,) if quick else (False, True),
                settings=bm.Settings(warmup=0, min_repeats=2 if quick else 3, max_repeats=3 if quick else 5,
                                     target_seconds=0.2))


# ---------------------------------------------------------------------------------------------
# Correctness


def _case_arrays(case: CheckCase, seed: int):
    rng = np.random.default_rng(seed)
    dtype = bm.DTYPES[case.dtype]

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    q = normal(1, case.q_heads, case.q_len, case.head_dim)
    k, v = (normal(1, case.kv_heads, case.kv_len, case.head_dim) for _ in range(2))
    d_out = normal(1, case.q_heads, case.q_len, case.head_dim)
    kwargs: Dict[str, Any] = {}
    if case.mask in ("causal", "window"):
        kwargs["mask"] = "causal"
    if case.mask == "window":
        kwargs["window_size"] = WINDOW
    if case.mask == "array":  # shared by the heads, some keys dropped per query
        kwargs["mask"] = mx.array(rng.random((1, 1, case.q_len, case.kv_len)) < 0.85)
    return q, k, v, d_out, kwargs


def check_case(case: CheckCase, backend: str, seed: int = 0) -> Dict[str, Any]:
    """Run one case forward and backward through flash_attention; errors against the float64
    reference and the verdict. A case the backend handed to its fallback also gets its kernels'
    own errors (`kernel_check`): what the first contact saw, in full."""
    from .api import flash_attention

    q, k, v, d_out, kwargs = _case_arrays(case, seed)
    before = fallback_counts()
    started = time.perf_counter()
    record: Dict[str, Any] = {"case": case.label(), **dataclasses.asdict(case)}
    try:
        def attend(q_, k_, v_):
            return flash_attention(q_, k_, v_, return_lse=True, backend=backend, **kwargs)

        (out, lse), (dq, dk, dv) = mx.vjp(lambda *a: list(attend(*a)), [q, k, v],
                                          [d_out, mx.zeros(q.shape[:3], mx.float32)])
        mx.eval(out, lse, dq, dk, dv)
    except Exception as error:  # a crash of the kernels is what this report is for: keep going
        record.update(status="ERROR", error=_error_message(error), fallbacks=_new_fallbacks(before),
                      seconds=time.perf_counter() - started)
        return record
    errors = _reference_errors((q, k, v, d_out), kwargs, (out, lse, dq, dk, dv))
    fallbacks = _new_fallbacks(before)
    # Served by MLX's own operations: float32 at the precision of MLX's matmuls here (reference.limits).
    reduced = reference.reduced_float32(case.dtype, backend == "mlx" or bool(fallbacks))
    limits = dict(zip(("forward", "gradient"), reference.limits(case.dtype, reduced)))
    status = "FAIL" if not _passed(errors, limits) else "FALLBACK" if fallbacks else "PASS"
    record.update(status=status, errors=errors, tolerance=limits, fallbacks=fallbacks, reduced_float32=reduced)
    if fallbacks and _kernels_should_serve(backend, q, k, v, kwargs):  # first contact failed
        record["kernel"] = kernel_check(case, backend, seed)  # our kernels: float32's own limits
        kernel_limits = dict(zip(("forward", "gradient"), reference.limits(case.dtype)))
        record["kernel"]["passed"] = "errors" in record["kernel"] and _passed(record["kernel"]["errors"], kernel_limits)
    record["seconds"] = time.perf_counter() - started
    return record


def _kernels_should_serve(backend: str, q, k, v, kwargs) -> bool:
    """Whether `backend` has compiled kernels meant for this call (so a fallback means they
    failed their first contact, not that the call is outside what they implement)."""
    from .spec import check_inputs

    kernels = get_backend(backend)
    spec, _ = check_inputs(q, k, v, **kwargs)
    return hasattr(kernels, "variant_key") and kernels.unsupported_reason(spec) is None


def kernel_check(case: CheckCase, backend: str, seed: int = 0) -> Dict[str, Any]:
    """The backend's kernels called directly on the case (no guard, no fallback): {"errors": ...}
    against the float64 reference, or {"error": message} when they fail to build or run."""
    from .spec import check_inputs

    kernels = get_backend(backend)
    q, k, v, d_out, kwargs = _case_arrays(case, seed)
    spec, mask = check_inputs(q, k, v, **kwargs)
    try:
        out, lse = kernels.forward(q, k, v, mask, spec)
        mx.eval(out, lse)
        dq, dk, dv, _ = kernels.backward(q, k, v, mask, out, lse, d_out, None, spec)
        mx.eval(dq, dk, dv)
    except Exception as error:
        return {"error": _error_message(error)}
    return {"errors": _reference_errors((q, k, v, d_out), kwargs, (out, lse, dq, dk, dv))}


def _reference_errors(inputs, kwargs, results) -> Dict[str, float]:
    """Relative errors of (out, lse, dq, dk, dv) against the float64 reference."""
    from .spec import check_inputs

    q, k, v, d_out = inputs
    out, lse, dq, dk, dv = results
    spec, mask4 = check_inputs(q, k, v, **kwargs)
    as_np = [np.array(x.astype(mx.float32)) for x in (q, k, v, d_out)]
    np_mask = None if mask4 is None else np.array(mask4)
    ref_out, ref_lse = reference.attention_forward(*as_np[:3], spec, np_mask)
    ref_grads = reference.attention_backward(*as_np, spec, np_mask)
    lse_np, finite = np.array(lse), np.isfinite(ref_lse)
    errors = {"out": reference.relative_error(np.array(out.astype(mx.float32)), ref_out),
              "lse": (reference.relative_error(lse_np[finite], ref_lse[finite])
                      if np.array_equal(np.isneginf(lse_np), np.isneginf(ref_lse)) else math.inf)}
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        errors[name] = reference.relative_error(np.array(got.astype(mx.float32)), want)
    return errors


def _passed(errors: Dict[str, float], limits: Dict[str, float]) -> bool:
    return (max(errors["out"], errors["lse"]) <= limits["forward"]
            and max(errors["dq"], errors["dk"], errors["dv"]) <= limits["gradient"])


def _error_message(error: Exception, limit: int = 4000) -> str:
    text = f"{type(error).__name__}: {str(error).strip()}"
    return text if len(text) <= limit else text[:limit] + " ..."


def _auto_route(backend: str, case: bm.BenchCase) -> Optional[str]:
    """The kernels/dispatch_cuda.txt row by which backend="auto" would hand this case to mx.fast
    (the report times the kernels themselves, by name), or None."""
    if backend != "cuda":
        return None
    from .backends import dispatch, dispatch_route
    from .inspect import make_spec

    spec = dataclasses.replace(make_spec(case.head_dim, case.dtype, "causal" if case.causal else "none", case.q_len,
                                         case.kv_len), q_heads=case.q_heads, kv_heads=case.kv_heads)
    row = dispatch_route(get_backend("cuda"), spec)
    return None if row is None else f"{dispatch.TABLE_NAME} line {row.line}: {row.describe()}"


def _new_fallbacks(before: Dict[str, int]) -> List[str]:
    return [reason for reason, n in fallback_counts().items() if n > before.get(reason, 0)]


# ---------------------------------------------------------------------------------------------
# Speed and memory


def time_size(backend: str, case: bm.BenchCase, settings: bm.Settings,
              back_to_back: int = 1) -> List[Dict[str, Any]]:
    """Forward and forward+backward of the three implementations at one size, interleaved; a pass
    of unfused or mx.fast is skipped where its N x N scores would pass the memory guard's share of
    the device's memory (benchmark.MEMORY_GUARD_FRACTION: on a Mac, mx.fast's backward is unfused).
    Each timed sample is up to `back_to_back` calls waited for once (benchmark.Call, calls_per_sample)."""
    inputs = bm.random_inputs(case, seed=case.q_len)
    attention = {"mlx-flash": bm.flash_attention_with(backend), "mx.fast": bm.fast_attention,
                 "unfused": bm.unfused_attention}
    skipped: Dict[Tuple[str, str], str] = {}
    budget = bm.memory_guard_bytes()
    items = {}
    for name in IMPLEMENTATIONS:
        for pass_name in ("forward", "forward_backward"):
            needs = bm.score_memory_estimate(name, case, pass_name)
            if budget is not None and needs > budget:
                skipped[name, pass_name] = f"skipped: its N x N scores need ~{bm.format_bytes(needs)}"
                continue
            prepare, run = bm.mlx_pass(attention[name], case, inputs, pass_name)
            calls = bm.calls_per_sample(case, pass_name, back_to_back)
            items[name, pass_name] = (bm.Call(run, prepare, back_to_back=calls), case, pass_name, None)
    measured = bm.measure_many(items, settings, catch=True)
    rows = []
    for pass_name in ("forward", "forward_backward"):
        for name in IMPLEMENTATIONS:
            result = measured.get((name, pass_name), {"error": skipped.get((name, pass_name))})
            row = {"N": case.q_len, "causal": case.causal, "pass": pass_name, "implementation": name,
                   **{key: value for key, value in result.items() if key != "samples_ms"}}
            rows.append(row)
        mine = measured.get(("mlx-flash", pass_name), {})
        for row in rows[-len(IMPLEMENTATIONS) + 1:]:
            theirs = measured.get((row["implementation"], pass_name), {})
            if "median_ms" in mine and "median_ms" in theirs:
                row["time_ratio"] = mine["median_ms"] / theirs["median_ms"]  # mlx-flash / this
                if mine.get("peak_memory_bytes") and theirs.get("peak_memory_bytes"):
                    row["memory_ratio"] = mine["peak_memory_bytes"] / theirs["peak_memory_bytes"]
    return rows


# ---------------------------------------------------------------------------------------------
# Environment


def environment(requested: str, resolved: str) -> Dict[str, Any]:
    """bm.environment plus what a Mac owner's report needs: OS release, GPU architecture, cores."""
    env = bm.environment(requested, resolved)
    info = env.get("device_info", {})
    mac = platform.mac_ver()[0]
    env.update(os=f"macOS {mac}" if mac else platform.platform(),
               gpu_architecture=info.get("architecture"),
               gpu_core_count=next((value for key, value in info.items() if "core" in key.lower()), None),
               metal_simulated=metal_simulated(),
               metalsim_fault=os.environ.get("MLX_FLASH_METALSIM_FAULT") or None if metal_simulated() else None,
               metal_available=bool(getattr(mx, "metal", None) and mx.metal.is_available()))
    if resolved == "metal":
        from .backends.guard import self_check_enabled
        from .backends.metal import detect_family
        env.update(metal_block_family=detect_family(), self_check=self_check_enabled("metal"))
    env.update(_tuned_table(resolved))
    return env


def _tuned_table(backend: str) -> Dict[str, Any]:
    """{"tuned_table": path, "tuned_table_text": its text} when this GPU's plans come from a table
    measured by `python -m mlx_flash tune` (mlx_flash/tuned.py): the report carries it to us."""
    try:
        if backend == "metal":
            from .backends.metal import detect_family
            family = detect_family()
        elif backend == "cuda":
            from .backends.cuda import CUDABackend
            family = CUDABackend().family()
            family = family.name if family is not None else None
        else:
            return {}
        from . import tuned
        table = tuned.table_for(backend, family) if family else None
    except Exception as error:  # the report must still be written
        return {"tuned_table": f"could not be read: {type(error).__name__}: {error}"}
    if table is None:
        return {"tuned_table": None}
    return {"tuned_table": table.origin, "tuned_table_text": Path(table.origin).read_text()}


# ---------------------------------------------------------------------------------------------
# Output


def write_report(out_dir: Path, report: Dict[str, Any]) -> None:
    """DIR/report.json and DIR/report.md, each replaced whole (never left half-written)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (("report.json", json.dumps(_strict_json(report), indent=2, default=str) + "\n"),
                       ("report.md", render_markdown(report))):
        tmp = out_dir / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out_dir / name)


def _strict_json(value):
    """The report with non-finite floats as the strings "inf" / "-inf" / "nan" (strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(item) for item in value]
    return value


def _summary(records: List[Dict[str, Any]]) -> Dict[str, Any]:
    counts = {status: sum(r["status"] == status for r in records) for status in ("PASS", "FALLBACK", "FAIL", "ERROR")}
    verdict = ("FAIL" if counts["FAIL"] or counts["ERROR"] else
               "PASS with fallbacks" if counts["FALLBACK"] else "PASS")
    return {"cases": len(records), "passed": counts["PASS"], "fallback": counts["FALLBACK"],
            "failed": counts["FAIL"], "error": counts["ERROR"], "verdict": verdict}


# ---------------------------------------------------------------------------------------------
# Command line


def add_report_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `report` subcommand on an argparse subparsers object."""
    parser = subparsers.add_parser("report", help="write a shareable report of this machine (report.json, report.md)",
                                   description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for report.json and report.md")
    parser.add_argument("--quick", action="store_true", help="reduced case set and smaller sizes (minutes)")
    parser.add_argument("--backend", default="auto", choices=BACKEND_NAMES, help="default: auto (the device's)")
    parser.add_argument("--max-cases", type=positive_int, help="only the first N correctness cases (for testing the command)")
    parser.add_argument("--sizes", type=positive_int, nargs="+", help="sequence lengths N to time (default by device)")
    parser.set_defaults(run=run_report)
    return parser


def run_report(args: argparse.Namespace) -> int:
    """Write the report; 0 when every case passed (fallbacks included), 1 when one failed."""
    started = time.perf_counter()
    device = mx.default_device()
    resolved = auto_backend_name(device) if args.backend == "auto" else args.backend
    reason = get_backend(resolved).unavailable_reason(device)
    if reason is not None:
        if args.backend != "auto":
            print(f"report: backend {resolved!r} is not available: {reason}", file=sys.stderr)
            return 2
        resolved = "mlx"
    plan = plan_for(device, args.quick, args.max_cases, args.sizes)
    report: Dict[str, Any] = {"backend": resolved, "backend_requested": args.backend, "quick": bool(args.quick),
                              "environment": environment(args.backend, resolved), "correctness": [],
                              "performance": [], "complete": False,
                              "correctness_setup": {"q_len": CheckCase.q_len, "kv_len": CheckCase.kv_len,
                                                    "window": list(WINDOW)},
                              "performance_setup": {"heads": plan.heads, "head_dim": plan.head_dim, "dtype": plan.dtype,
                                                    "sizes": list(plan.sizes), "causal": list(plan.causal),
                                                    "back_to_back": plan.back_to_back}}
    out = args.out

    def save():
        from .backends.guard import GUARD
        report.update(first_contact=GUARD.records(), fallbacks=fallback_counts(), routes=route_counts(),
                      summary=_summary(report["correctness"]), seconds=time.perf_counter() - started)
        write_report(out, report)

    print(f"mlx-flash report: backend {resolved!r}, {len(plan.cases)} correctness cases, N = "
          f"{', '.join(map(str, plan.sizes))}; writing {out}/report.md and report.json", flush=True)
    for i, case in enumerate(plan.cases):
        record = check_case(case, resolved, seed=i)
        report["correctness"].append(record)
        print(f"  [{i + 1}/{len(plan.cases)}] {case.label()}: {record['status']} ({record['seconds']:.1f} s)",
              flush=True)
        save()
    for causal in plan.causal:
        for n in plan.sizes:
            case = bm.BenchCase(batch=1, q_heads=plan.heads, kv_heads=plan.heads, q_len=n, kv_len=n,
                                head_dim=plan.head_dim, dtype=plan.dtype, causal=causal)
            before = fallback_counts()
            try:
                rows = time_size(resolved, case, plan.settings, plan.back_to_back)
                for reason in _new_fallbacks(before):  # then mlx-flash's times are the fallback's
                    for row in rows:
                        if row["implementation"] == "mlx-flash":
                            row["fallback"] = reason
                route = _auto_route(resolved, case)
                for row in rows:
                    if route and row["implementation"] == "mlx-flash":
                        row["auto_route"] = route
                report["performance"] += rows
            except Exception as error:  # keep the correctness results and the other sizes
                report["performance"].append({"N": n, "causal": causal, "pass": "forward", "implementation": "all",
                                              "error": f"{type(error).__name__}: {str(error)[:300]}"})
            print(f"  timed N={n}{' causal' if causal else ''}", flush=True)
            save()
    report["complete"] = True
    save()
    summary = report["summary"]
    print(f"correctness: {summary['verdict']} ({summary['passed']} pass, {summary['fallback']} fallback, "
          f"{summary['failed']} fail, {summary['error']} error); {report['seconds']:.0f} s; wrote "
          f"{out / 'report.md'} and {out / 'report.json'}")
    if summary["fallback"] or summary["failed"] or summary["error"]:
        print(f"Please {WHERE_TO_SEND}.")
    return 1 if summary["failed"] or summary["error"] else 0

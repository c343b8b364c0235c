"""Nsight Compute over one attention call: what each kernel of ours and of MLX's spends its time on
(hardware counters; benchmarks/kernel_profile.py times every kernel of a call through CUPTI).

    python benchmarks/ncu_profile.py [--shapes 4,16,4096,128,none ...] [--passes forward_backward]
        [--backends cuda mlx] [--tuning KEY=VALUE ...] [--out DIR]

For every (shape, pass, backend) the tool runs itself under `ncu --clock-control none` (the GPU's
clocks left alone, as the timing tools leave them) with the SpeedOfLight, Occupancy, LaunchStats,
WarpStateStats and ComputeWorkloadAnalysis sections, and keeps the kernels of one call: the
profiled child makes the call twice (compilation and first-contact probes in the first), starts
the profiler (ncu --profile-from-start off; cuProfilerStart on the primary context) and launches a
marker kernel before the second; every launch after the marker belongs to it. "mlx"
is MLX's own mx.fast.scaled_dot_product_attention (cuDNN where it has a fused kernel), "cuda" is
mlx_flash's CUDA backend (--tuning sets fields of its cuda_source.Tuning, e.g. fused_query=True).

Per kernel: time under the profiler (each kernel runs alone, replayed, so this is not the time
of a call in a training step; benchmarks/ab_versions.py and bench.py time those), the SM and
memory throughput as a fraction of peak, the tensor pipe's activity where ncu names one, DRAM
throughput, achieved occupancy, registers per thread, and the warp stall reasons that take most
of the cycles between two issued instructions. Writes profile_<shape>_<pass>_<backend>.csv (ncu's
raw page) and ncu_profile.json (the summary) under --out, and prints a table.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from cli_args import cuda_backend, parse_shape, parse_tuning  # benchmarks/cli_args.py

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parent.parent
SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "ComputeWorkloadAnalysis")
MARKER = "mlxflash_profile_marker"
# ncu raw-page columns kept per kernel (the first present of each list).
COLUMNS = {
    "time_us": ["gpu__time_duration.sum"],
    "sm_pct": ["sm__throughput.avg.pct_of_peak_sustained_elapsed"],
    "memory_pct": ["gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"],
    "dram_pct": ["gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
                 "dram__throughput.avg.pct_of_peak_sustained_elapsed"],
    "occupancy_pct": ["sm__warps_active.avg.pct_of_peak_sustained_active"],
    "registers": ["launch__registers_per_thread"],
    "grid": ["launch__grid_size"],
    "block": ["launch__block_size"],
    "issue_pct": ["sm__issue_active.avg.pct_of_peak_sustained_elapsed",
                  "sm__inst_issued.avg.pct_of_peak_sustained_elapsed"],
    "cycles_per_issue": ["smsp__average_warp_latency_per_inst_issued.ratio",
                         "smsp__average_warps_issue_stalled_per_issue_active.ratio"],
}
TENSOR = re.compile(r"^sm__(pipe_tensor[a-z_]*|inst_executed_pipe_tensor[a-z_]*)"
                    r"(_cycles_active)?\.avg\.pct_of_peak_sustained_active$")
STALL = re.compile(r"^smsp__average_warps_issue_stalled_([a-z_]+)_per_issue_active\.ratio$")


def child(shape: str, pass_name: str, backend: str, tuning) -> int:
    """The profiled process: the call once (compiles, probes), the marker, the call again."""
    import mlx.core as mx

    from mlx_flash import benchmark as bm
    case = parse_shape(shape)
    if backend == "mlx":
        attention = bm.fast_attention
    else:
        attention = bm.flash_attention_with(cuda_backend(tuning))
    inputs = bm.random_inputs(case)
    mx.eval(inputs)
    prepare, run = bm.mlx_pass(attention, case, inputs, pass_name)
    marker = mx.fast.cuda_kernel(name=MARKER, input_names=["x"], output_names=["y"],
                                 source="y[0] = x[0];")
    mx.eval(run(prepare() if prepare else None))
    mx.synchronize()
    start_profiler()
    mx.eval(marker(inputs=[mx.zeros((1,))], output_shapes=[(1,)], output_dtypes=[mx.float32],
                   grid=(1, 1, 1), threadgroup=(1, 1, 1))[0])
    mx.synchronize()
    mx.eval(run(prepare() if prepare else None))
    mx.synchronize()
    return 0


def start_profiler() -> None:
    """cuProfilerStart on the device's primary context (the one MLX's runtime calls use), made
    current on this thread if none is."""
    import ctypes
    cuda = ctypes.CDLL("libcuda.so.1")
    context, device = ctypes.c_void_p(), ctypes.c_int()

    def check(name, status):
        if status:
            raise RuntimeError(f"{name} returned CUDA error {status}")

    check("cuInit", cuda.cuInit(0))
    check("cuCtxGetCurrent", cuda.cuCtxGetCurrent(ctypes.byref(context)))
    if not context.value:
        check("cuDeviceGet", cuda.cuDeviceGet(ctypes.byref(device), 0))
        check("cuDevicePrimaryCtxRetain", cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device))
        check("cuCtxSetCurrent", cuda.cuCtxSetCurrent(context))
    check("cuProfilerStart", cuda.cuProfilerStart())


def kernel_rows(raw_csv: str):
    """ncu's raw CSV (a header row, a units row, one row per launch) -> the launches after the
    last marker, each a dict of column -> text."""
    lines = [line for line in raw_csv.splitlines() if line.startswith('"')]
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    units = next((r for r in rows if not r.get("ID", "").isdigit()), {})
    rows = [r for r in rows if r.get("ID", "").isdigit()]
    last = max((i for i, r in enumerate(rows) if MARKER in r.get("Kernel Name", "")), default=None)
    return (rows if last is None else rows[last + 1:]), units, last is not None


def number(text):
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return None


def summarize(row, units) -> dict:
    """One launch's figures (COLUMNS, the tensor pipes, the top stall reasons)."""
    out = {"kernel": short_name(row.get("Kernel Name", "?"))}
    for key, names in COLUMNS.items():
        out[key] = next((number(row[n]) for n in names if n in row and number(row[n]) is not None), None)
    if out["time_us"] is not None:
        scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6,
                 "s": 1e6}
        out["time_us"] *= scale.get(units.get("gpu__time_duration.sum", "nsecond"), 1e-3)
    out["tensor_pct"] = {m.group(1): number(v) for k, v in row.items()
                         if (m := TENSOR.match(k)) and number(v) is not None}
    stalls = {m.group(1): number(v) for k, v in row.items() if (m := STALL.match(k)) and number(v)}
    out["stalls"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:4])
    return out


def short_name(name: str) -> str:
    name = re.sub(r"\(.*", "", name)  # template arguments and parameters
    return name if len(name) <= 60 else name[:57] + "..."


def run_ncu(ncu: str, shape: str, pass_name: str, backend: str, tuning, out_dir: Path, timeout: int):
    label = f"{shape.replace(',', '_')}_{pass_name}_{backend}"
    command = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--csv", "--page", "raw",
               "--print-units", "base"]
    for section in SECTIONS:
        command += ["--section", section]
    command += [sys.executable, str(SCRIPT), "--child", shape, pass_name, backend]
    command += [f"{k}={v!r}" for k, v in tuning]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    (out_dir / f"profile_{label}.csv").write_text(done.stdout)
    if done.returncode:
        raise RuntimeError(f"ncu exited {done.returncode} for {label}: {done.stderr[-2000:]}")
    rows, units, marked = kernel_rows(done.stdout)
    if not marked:
        raise RuntimeError(f"{label}: no {MARKER} launch in ncu's output (stderr: {done.stderr[-1000:]})")
    return [summarize(r, units) for r in rows]


def table(results) -> str:
    lines = ["| call | kernel | us | SM % | mem % | tensor % | DRAM % | occ % | regs | top stalls (cycles/issue) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for label, kernels in results.items():
        for k in kernels:
            tensor = max(k["tensor_pct"].values(), default=None)
            stalls = ", ".join(f"{name} {value:.1f}" for name, value in k["stalls"].items())
            cells = [label, k["kernel"]] + [
                "" if x is None else f"{x:.0f}" if abs(x) >= 10 else f"{x:.1f}"
                for x in (k["time_us"], k["sm_pct"], k["memory_pct"], tensor, k["dram_pct"],
                          k["occupancy_pct"], k["registers"])] + [stalls]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        shape, pass_name, backend, *tuning = argv[1:]
        return child(shape, pass_name, backend, [parse_tuning(t) for t in tuning])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["4,16,4096,128,none"],
                        help="B,H,N,D,mask[,KV_HEADS] (bf16)")
    parser.add_argument("--passes", nargs="+", default=["forward_backward"], choices=["forward", "forward_backward"])
    parser.add_argument("--backends", nargs="+", default=["cuda", "mlx"], choices=["cuda", "mlx"])
    parser.add_argument("--tuning", nargs="+", type=parse_tuning, default=[],
                        help="fields of the cuda backend's cuda_source.Tuning (KEY=VALUE)")
    parser.add_argument("--timeout-s", type=int, default=300, help="per profiled call (default 300)")
    parser.add_argument("--out", default=".", help="folder for the CSVs and ncu_profile.json")
    args = parser.parse_args(argv)
    for shape in args.shapes:  # kept as text (the child parses it again), checked here
        try:
            parse_shape(shape)
        except argparse.ArgumentTypeError as error:
            parser.error(str(error))
    ncu = shutil.which("ncu")
    if ncu is None:
        parser.error("ncu (Nsight Compute) is not on the PATH")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results, errors = {}, {}
    for shape in args.shapes:
        for pass_name in args.passes:
            for backend in args.backends:
                label = f"{shape} {pass_name} {backend}"
                try:
                    results[label] = run_ncu(ncu, shape, pass_name, backend,
                                             args.tuning if backend == "cuda" else [], out_dir, args.timeout_s)
                except (RuntimeError, subprocess.TimeoutExpired) as error:
                    errors[label] = str(error)
                    print(f"{label}: {error}", file=sys.stderr, flush=True)
    (out_dir / "ncu_profile.json").write_text(json.dumps(
        {"tuning": dict(args.tuning), "results": results, "errors": errors}, indent=1))
    print(table(results))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

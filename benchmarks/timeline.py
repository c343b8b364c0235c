"""Where the GPU waits between back-to-back calls: a CUPTI timeline (an experiment tool, CUDA only).

ab_versions.py and the dispatch table time `--back-to-back` calls issued one after another and
waited for once; ncu times each kernel alone. This tool records the same back-to-back samples
(mlx_pass, compiled) under PyTorch's profiler, whose CUPTI tracing sees every kernel of the
process (MLX's included), and splits each call's wall time into kernel time and the GPU's idle
time, kernel by kernel: which kernel runs how long, and how long the GPU waited before it.

    python3 benchmarks/timeline.py --shapes 4,16,4096,128,none 4,16,4096,64,none --out DIR

Per implementation (ours on --backend, mx.fast): wall ms per call (perf_counter, as
ab_versions.py reads it), span (first kernel's start to the last one's end), busy (the union
of kernel intervals), idle (span - busy); then per kernel of a call, in launch order, the
median duration and the median gap before it (the first kernel's gap is the one after the
previous call's last kernel, which is where host time between calls shows). --untraced times
the walls alone (H200, B=4 N=4096 D=128: speed 0.966x untraced, 0.961x traced). A table last: per
shape, speed = mx.fast's wall / ours and kernel = the same for busy time.

Rounds take the implementations in turn: timed one after the other (--rounds 1), the order
decided the comparison (H200: ours read 3.72 / 3.48 ms against mx.fast's 3.67 / 3.68 in two
such runs, 3.62 against 3.48 in rounds; RESULTS.md, "Where the remaining time goes").
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cli_args import cuda_backend, parse_shape, parse_tuning  # noqa: E402  (benchmarks/cli_args.py)
from mlx_flash import benchmark as bm  # noqa: E402

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_events(trace_path: Path) -> list:
    """[(start us, end us, name)] of every GPU activity in a chrome trace, by start."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    spans = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
             if e.get("cat") in GPU_CATEGORIES and "dur" in e]
    return sorted(spans)


def busy_time(spans) -> float:
    """The length of the union of the intervals (overlapping kernels count once)."""
    total, end = 0.0, None
    for start, stop, _ in spans:
        if end is None or start >= end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def profile_samples(call: bm.Call, samples: int, traced: bool = True) -> tuple:
    """(walls in seconds per call, GPU events) of `samples` samples of `call` under CUPTI (traced)
    or without it (no events)."""
    if not traced:
        return [call.timed_once() for _ in range(samples)], []
    from torch.profiler import ProfilerActivity, profile
    walls = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(samples):
            walls.append(call.timed_once())
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        return walls, gpu_events(path)


def analyse(walls, events, samples: int, calls: int) -> dict:
    """Per call: wall, span, busy and idle ms; per kernel position: name, duration, gap before.
    Without events (untraced): the wall alone."""
    if not events:
        return {"wall_ms": statistics.median(walls) * 1e3}
    if len(events) % (samples * calls):
        return {"error": f"{len(events)} GPU events do not split into {samples} samples x {calls} calls"}
    per_sample = len(events) // samples
    per_call = per_sample // calls
    spans, busies, durations, gaps = [], [], [[] for _ in range(per_call)], [[] for _ in range(per_call)]
    for s in range(samples):
        sample = events[s * per_sample:(s + 1) * per_sample]
        spans.append(sample[-1][1] - sample[0][0])
        busies.append(busy_time(sample))
        reach = None
        for i, (start, stop, _) in enumerate(sample):
            position = i % per_call
            durations[position].append(stop - start)
            if reach is not None:
                gaps[position].append(max(0.0, start - reach))
            reach = stop if reach is None else max(reach, stop)
    names = [name for _, _, name in events[:per_call]]
    median = statistics.median
    return {"wall_ms": median(walls) * 1e3, "span_ms": median(spans) / calls / 1e3,
            "busy_ms": median(busies) / calls / 1e3,
            "idle_ms": median(span - busy for busy, span in zip(busies, spans)) / calls / 1e3,
            "kernels_per_call": per_call,
            "kernels": [{"name": names[i].split("(")[0][:90], "us": round(median(durations[i]), 1),
                         "gap_before_us": round(median(gaps[i]), 1) if gaps[i] else None} for i in range(per_call)]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=parse_shape, nargs="+", required=True, help="B,H,N,D,mask[,KV_HEADS]")
    parser.add_argument("--backend", default="cuda", help="mlx_flash backend of 'ours' (default cuda)")
    parser.add_argument("--tuning", type=parse_tuning, nargs="*", default=[], help="KEY=VALUE of ours' Tuning")
    parser.add_argument("--pass", dest="pass_name", choices=("forward", "forward_backward"), default="forward_backward")
    parser.add_argument("--back-to-back", type=int, default=8)
    parser.add_argument("--samples", type=int, default=3, help="samples per implementation a round")
    parser.add_argument("--rounds", type=int, default=4,
                        help="rounds, the implementations in turn (reversed every other round; see above)")
    parser.add_argument("--untraced", action="store_true",
                        help="time the walls only, without CUPTI (does tracing change them?)")
    parser.add_argument("--out", default=None, help="write the results as JSON in this folder")
    args = parser.parse_args(argv)
    if min(args.back_to_back, args.samples, args.rounds) < 1:
        parser.error(f"--back-to-back, --samples and --rounds must be >= 1, got {args.back_to_back}, "
                     f"{args.samples} and {args.rounds}")
    if args.tuning and args.backend != "cuda":
        parser.error(f"--tuning sets the cuda backend's Tuning; --backend is {args.backend!r}")
    if mx.default_device().type != mx.gpu:
        raise SystemExit("timeline.py records GPU kernels: run it where MLX's default device is a GPU")
    ours = bm.flash_attention_with(cuda_backend(args.tuning) if args.backend == "cuda" else args.backend)
    env = bm.environment(args.backend, args.backend)
    print(f"# {env['device_name']}, mlx {env['mlx_version']}, commit {env['git_commit']}, {args.pass_name}, "
          f"{args.back_to_back} calls back to back, compiled")
    results = []
    for case in args.shapes:
        inputs = bm.random_inputs(case, seed=0)
        calls = {}
        for impl, attention in (("ours", ours), ("mx.fast", bm.fast_attention)):
            prepare, run = bm.mlx_pass(attention, case, inputs, args.pass_name, compiled=True)
            calls[impl] = bm.Call(run, prepare, back_to_back=args.back_to_back)
            for _ in range(3):
                calls[impl].timed_once()
        recorded = {impl: ([], []) for impl in calls}
        for round_ in range(args.rounds):
            for impl in (list(calls) if round_ % 2 == 0 else list(calls)[::-1]):
                walls, events = profile_samples(calls[impl], args.samples, not args.untraced)
                recorded[impl][0].extend(walls)
                recorded[impl][1].extend(events)
        for impl, (walls, events) in recorded.items():
            row = {"case": bm.as_dict(case), "label": case.label(), "implementation": impl, "walls_ms":
                   [w * 1e3 for w in walls], **analyse(walls, events, args.samples * args.rounds, args.back_to_back)}
            results.append(row)
            if "error" in row:
                print(f"{case.label()} {impl}: {row['error']}")
                continue
            if "span_ms" not in row:
                print(f"{case.label()} {impl}: wall {row['wall_ms']:.3f} ms/call (untraced)")
                continue
            print(f"\n{case.label()} {impl}: wall {row['wall_ms']:.3f} ms/call, span {row['span_ms']:.3f}, "
                  f"busy {row['busy_ms']:.3f}, idle {row['idle_ms']:.3f}, {row['kernels_per_call']} kernels")
            for kernel in row["kernels"]:
                gap = kernel["gap_before_us"]
                print(f"  {kernel['us']:9.1f} us  gap {gap if gap is not None else '-':>7}"
                      f"  {kernel['name']}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "timeline.json").write_text(json.dumps({"environment": env, "results": results}, indent=1))
    print("\n" + summary(results))
    return 0


def summary(results) -> str:
    """One line per shape: both walls, speed = mx.fast's wall / ours, and with a trace the same
    for kernel (busy) time and each side's idle time per call."""
    rows = []
    for case in dict.fromkeys(row["label"] for row in results):
        side = {row["implementation"]: row for row in results if row["label"] == case}
        ours, fast = side.get("ours", {}), side.get("mx.fast", {})
        ratio = lambda key: (f"{fast[key] / ours[key]:.3f}x" if key in ours and key in fast and ours[key] else None)
        ms = lambda row, key: f"{row[key]:.3f}" if key in row else None
        rows.append([case, ms(ours, "wall_ms"), ms(fast, "wall_ms"), ratio("wall_ms"), ratio("busy_ms"),
                     ms(ours, "idle_ms"), ms(fast, "idle_ms")])
    return bm.format_table(["shape", "ours ms", "mx.fast ms", "speed", "kernel", "idle ours", "idle mx.fast"], rows)


if __name__ == "__main__":
    sys.exit(main())

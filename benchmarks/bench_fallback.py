"""The fallback paths side by side: the "mlx" backend, unfused MLX ops, mx.fast.

For each shape: forward+backward (mx.vjp of out with a random cotangent, all evaluated) time
(median of interleaved rounds) and peak memory above the inputs, for
    mlx          mlx_flash.flash_attention(backend="mlx"), this checkout
    unfused      plain MLX ops (mlx_flash.benchmark.unfused_attention; N x N scores)
    mx.fast      mx.fast.scaled_dot_product_attention (cuDNN on CUDA where it applies)
and the ratios mlx / unfused and mlx / mx.fast (time, memory).

    python benchmarks/bench_fallback.py --preset gpu     # H100: bf16 and fp32 shapes, < 10 min
    python benchmarks/bench_fallback.py --preset gpu --memory-limit 0.25   # and the mlx path under a limit
    python benchmarks/bench_fallback.py --preset cpu     # the 2-core CPU: fp32 B=1 H=8 D=64

Writes the rows as JSON to --out (default: the temporary directory's fallback_<device>.json;
published results are merged into benchmarks/results/ by hand, one file per published table).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlx_flash import benchmark as bm  # noqa: E402
from mlx_flash.api import flash_attention  # noqa: E402
from mlx_flash.spec import check_inputs  # noqa: E402

# (B, H, N, D, dtype, causal)
PRESETS = {
    "gpu": [(1, 16, 4096, 128, "bfloat16", True), (1, 16, 8192, 128, "bfloat16", True),
            (1, 16, 4096, 64, "bfloat16", False), (1, 16, 2048, 256, "bfloat16", True),
            (1, 16, 4096, 64, "bfloat16", True), (1, 16, 4096, 128, "bfloat16", False),
            (1, 16, 4096, 256, "bfloat16", False), (1, 16, 4096, 256, "bfloat16", True),
            (1, 16, 4096, 128, "float32", True), (1, 16, 4096, 64, "float32", False),
            (1, 16, 8192, 128, "float32", True)],
    "gpu-long": [(1, 16, 16384, 128, "bfloat16", True), (1, 16, 16384, 64, "bfloat16", False)],
    "cpu": [(1, 8, n, 64, "float32", c) for n in (512, 1024, 2048, 4096) for c in (False, True)],
    "smoke": [(1, 2, 256, 32, "float32", True), (1, 2, 256, 32, "bfloat16", False)],  # a dry run
}
IMPLS = ("mlx", "unfused", "mx.fast")


def route(inputs, case):
    """Which backend flash_attention(backend="auto") picks for this call (the fallback rule)."""
    import warnings

    from mlx_flash.backends import select_backend

    q, k, v, _ = inputs
    spec, _ = check_inputs(q, k, v, scale=case.scale, mask="causal" if case.causal else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return select_backend("auto", spec, None).name


def implementation(name):
    if name == "mlx":
        return lambda q, k, v, mask, scale: flash_attention(q, k, v, scale=scale, mask=mask, backend="mlx")
    return {"unfused": bm.unfused_attention,
            "mx.fast": bm.fast_attention}[name]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpu" if mx.default_device().type == mx.gpu else "cpu")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--target-seconds", type=float, default=0.5)
    parser.add_argument("--max-repeats", type=int, default=9)
    parser.add_argument("--time-budget-s", type=float, default=540.0, help="start no new shape after this")
    parser.add_argument("--memory-limit", type=float, default=None, metavar="F",
                        help="also time the mlx backend under mx.set_memory_limit(inputs + F x unfused's peak): "
                             "on a GPU, MLX keeps ops' inputs until their command buffer completes and runs "
                             "ahead while memory is free, so the peak without a limit is not what the path needs")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    settings = bm.Settings(warmup=1, min_repeats=3, max_repeats=args.max_repeats, target_seconds=args.target_seconds)
    env = bm.environment("mlx", "mlx")
    print(f"# {env['device_name']} ({env['device']}), mlx {env['mlx_version']}, commit {env['git_commit']}")
    started, rows = time.time(), []
    header = (["shape"] + [f"{n} ms" for n in args.impls] + [f"{n} peak" for n in args.impls]
              + ["mlx/unfused t", "mlx/unfused mem", "mlx/fast t", "mlx/fast mem", "auto serves with"]
              + ([f"mlx@{args.memory_limit:g} ms", f"mlx@{args.memory_limit:g} peak", "peak/unfused"]
                 if args.memory_limit else []))
    table = []
    for B, H, N, D, dtype, causal in PRESETS[args.preset]:
        case = bm.BenchCase(B, H, H, N, N, D, dtype, causal)
        if time.time() - started > args.time_budget_s:
            print(f"skipped (time budget): {case.label()}")
            continue
        inputs = bm.random_inputs(case)
        items = {}
        for name in args.impls:
            prepare, run = bm.mlx_pass(implementation(name), case, inputs, "forward_backward")
            items[name] = (bm.Call(run, prepare), case, "forward_backward", None)
        result = bm.measure_many(items, settings)
        ms = {n: result[n].get("median_ms") for n in args.impls}
        peak = {n: result[n].get("peak_memory_bytes") for n in args.impls}
        served, limited = route(inputs, case), None
        if args.memory_limit and "mlx" in items and peak.get("unfused"):
            limit = int(mx.get_active_memory() + args.memory_limit * peak["unfused"])
            previous = mx.set_memory_limit(limit)
            try:
                limited = bm.measure_many({"mlx": items["mlx"]}, settings)["mlx"]
            finally:
                mx.set_memory_limit(previous)
            limited["memory_limit_bytes"] = limit
            result["mlx@limit"] = limited

        def ratio(a, b, d):
            return f"{d[a] / d[b]:.2f}x" if d.get(a) and d.get(b) else "-"

        table.append([case.label()] + [bm.format_ms(ms[n]) for n in args.impls]
                     + [bm.format_bytes(peak[n]) for n in args.impls]
                     + [ratio("mlx", "unfused", ms), ratio("mlx", "unfused", peak),
                        ratio("mlx", "mx.fast", ms), ratio("mlx", "mx.fast", peak), served]
                     + ([bm.format_ms(limited.get("median_ms")), bm.format_bytes(limited.get("peak_memory_bytes")),
                         f"{limited['peak_memory_bytes'] / peak['unfused']:.2f}x"
                         if limited.get("peak_memory_bytes") else "-"] if limited is not None else []))
        rows.append({"case": bm.as_dict(case), "results": result, "route": served})
        print(bm.format_table(header, table[-1:]).splitlines()[-1], flush=True)
        del inputs
    print()
    print(bm.format_table(header, table))
    # Outside the source tree unless named: published results are merged into benchmarks/results by hand.
    out = Path(args.out or Path(tempfile.gettempdir()) / f"fallback_{env['device_type']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

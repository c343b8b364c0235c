"""Which GPU kernels one forward+backward launches, and for how long (an experiment tool, CUDA only).

Times `mx.value_and_grad` of sum(attention) (how training calls it: every array derived from the
primals is a tracer, so mx.compile'd helpers run uncompiled) for mlx_flash on a backend and for
unfused MLX ops, then records the same calls under PyTorch's profiler, whose CUPTI tracing sees
every kernel of the process (MLX's included): kernels per call, summed kernel time, the largest.

    python3 benchmarks/kernel_profile.py --backend mlx --shapes 4096,128,causal 4096,64,none
    python3 benchmarks/kernel_profile.py --no-profile ...   # wall times only (no torch needed)
    python3 benchmarks/kernel_profile.py --backend cuda --layout mlx-lm --kv-heads 4 --shapes 8192,128,causal

--layout mlx-lm hands q, k and v over as mlx-lm does (transposed views of [B, N, H, D] buffers)
and sends the output through mlx-lm's transpose + reshape before the sum, so that its cotangent
reaches the backward as a transposed view too.

Wall time above summed kernel time is host time (graph building, launches) the GPU waited for.
peak_mib: mx.get_peak_memory() of one call above the memory held before it (the inputs).
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlx_flash import benchmark as bm  # noqa: E402
from mlx_flash.api import flash_attention  # noqa: E402


def shape(text):
    """N,D,mask with mask "none" or "causal"."""
    try:
        n, d, mask = text.split(",")
        if mask not in ("none", "causal"):
            raise ValueError
        return int(n), int(d), mask == "causal"
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is N,D,none|causal, got {text!r}") from None


def step(impl, backend, N, D, causal, heads, dtype, kv_heads=None, layout="row"):
    kv_heads = kv_heads or heads
    if layout == "row":
        q = mx.random.normal((1, heads, N, D)).astype(dtype)
        k, v = (mx.random.normal((1, kv_heads, N, D)).astype(dtype) for _ in range(2))
    else:  # mlx-lm: transposed views of [B, N, H, D] projections
        q = mx.random.normal((1, N, heads, D)).astype(dtype).transpose(0, 2, 1, 3)
        k, v = (mx.random.normal((1, N, kv_heads, D)).astype(dtype).transpose(0, 2, 1, 3) for _ in range(2))
    mx.eval(q, k, v)
    if impl == "mlx-flash":
        attend = lambda q, k, v: flash_attention(q, k, v, mask="causal" if causal else None, backend=backend)
    else:
        def attend(q, k, v):
            if kv_heads != heads:
                k, v = (mx.repeat(x, heads // kv_heads, axis=1) for x in (k, v))
            return bm.unfused_attention(q, k, v, "causal" if causal else None, D ** -0.5)
    if layout == "row":
        f = attend
    else:
        f = lambda q, k, v: attend(q, k, v).transpose(0, 2, 1, 3).reshape(1, N, -1)
    grad = mx.value_and_grad(lambda q, k, v: f(q, k, v).astype(mx.float32).sum(), argnums=(0, 1, 2))
    return lambda: grad(q, k, v)


def kernels(run, calls=2):
    """(kernels per call, kernel ms per call, [(name, count per call, ms per call)]) from CUPTI."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            mx.eval(run())
            mx.synchronize()
    per = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per[event.name][0] += 1
            per[event.name][1] += event.device_time_total
    count = sum(c for c, _ in per.values()) / calls
    total = sum(t for _, t in per.values()) / calls / 1e3
    top = sorted(per.items(), key=lambda item: -item[1][1])
    return count, total, [(name.split("(")[0][:100], c // calls, round(t / calls / 1e3, 3)) for name, (c, t) in top]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="mlx", help="mlx_flash backend name (default mlx)")
    parser.add_argument("--shapes", type=shape, nargs="+", default=[(4096, 128, True), (4096, 64, False)])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=None, help="kv heads (GQA; default: --heads)")
    parser.add_argument("--layout", choices=("row", "mlx-lm"), default="row",
                        help="how q, k, v and the output's cotangent lie in memory (see above)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    kv_heads = args.kv_heads or args.heads
    if kv_heads < 1 or args.heads % kv_heads:
        parser.error(f"--heads ({args.heads}) must be a positive multiple of --kv-heads ({args.kv_heads})")
    if mx.default_device().type != mx.gpu:
        raise SystemExit("kernel_profile.py profiles GPU kernels: run it where MLX's default device is a GPU")
    env = bm.environment(args.backend, "mlx")
    print(f"# {env['device_name']}, mlx {env['mlx_version']}, commit {env['git_commit']}")
    results = []
    for N, D, causal in args.shapes:
        for impl in ("mlx-flash", "unfused"):
            run = step(impl, args.backend, N, D, causal, args.heads, getattr(mx, args.dtype), args.kv_heads,
                       args.layout)
            for _ in range(3):
                mx.eval(run())
            walls, builds = [], []
            for _ in range(9):
                mx.synchronize()
                t0 = time.perf_counter()
                out = run()
                t1 = time.perf_counter()
                mx.eval(out)
                mx.synchronize()
                walls.append(time.perf_counter() - t0)
                builds.append(t1 - t0)
            mx.synchronize()
            mx.clear_cache()
            base = mx.get_active_memory()
            mx.reset_peak_memory()
            mx.eval(run())
            peak_mib = (mx.get_peak_memory() - base) / 2**20  # above the inputs, one call
            row = {"N": N, "D": D, "causal": causal, "implementation": impl,
                   "wall_ms": statistics.median(walls) * 1e3, "graph_build_ms": statistics.median(builds) * 1e3,
                   "peak_mib": peak_mib}
            if not args.no_profile:
                row["kernels_per_call"], row["kernel_ms_per_call"], top = kernels(run)
                row["top"] = top[:args.top]
            results.append(row)
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k != "top"}))
            for name, count, ms in row.get("top", []):
                print(f"    {count:4d} x {ms:7.3f} ms  {name}")
    if args.out:
        Path(args.out).write_text(json.dumps({"environment": env, "arguments": sys.argv[1:], "rows": results}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

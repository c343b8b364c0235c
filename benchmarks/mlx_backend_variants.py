"""The "mlx" backend's variants side by side, in ONE interleaved run (an experiment tool).

For each shape: forward+backward (mx.vjp of out with a random cotangent, all evaluated) time
(median of interleaved rounds, mlx_flash.benchmark's harness) and peak memory above the inputs, of
    old          the "mlx" backend of another checkout (--old-tree DIR: a directory holding that
                 checkout's mlx_flash package, e.g. `git archive <commit> mlx_flash | tar -x -C DIR`),
                 imported under another name
    new/F        this checkout's "mlx" backend with its score block at most 1/F of the score matrix
                 (an MLXOpsBackend with score fraction F; the shipped value is marked with *)
    unfused      plain MLX ops (mlx_flash.benchmark.unfused_attention; N x N scores)
    mx.fast      mx.fast.scaled_dot_product_attention
then a table: times, peaks, and new / unfused, new / mx.fast. The first call of each variant
(untimed; it measures the peak) also pays the first use of its shapes; `first ms` shows it.

    python benchmarks/mlx_backend_variants.py --preset gpu --old-tree /tmp/old   # H100, < 4 min
    python benchmarks/mlx_backend_variants.py --preset cpu --old-tree /tmp/old   # fp32 B=1 H=8 D=64
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlx_flash import benchmark as bm  # noqa: E402
from mlx_flash.api import flash_attention  # noqa: E402
from mlx_flash.backends import mlx_ops  # noqa: E402

# The shipped score fraction of the device this runs on (marked * in the table).
SHIPPED = mlx_ops.score_fraction("gpu" if mx.default_device().type == mx.gpu else "cpu")
SHIPPED_DEVICE = dict(mlx_ops.DEVICE_FRACTIONS)["gpu" if mx.default_device().type == mx.gpu else "cpu"]

# (B, H, N, D, dtype, causal)
PRESETS = {
    "gpu": [(1, 16, 4096, 128, "bfloat16", True), (1, 16, 8192, 128, "bfloat16", True),
            (1, 16, 4096, 64, "bfloat16", False), (1, 16, 2048, 256, "bfloat16", True),
            (1, 16, 4096, 256, "bfloat16", False), (1, 16, 4096, 128, "float32", True),
            (1, 16, 8192, 128, "float32", True)],
    "cpu": [(1, 8, n, 64, "float32", c) for n in (1024, 2048, 4096) for c in (False, True)],
    "smoke": [(1, 2, 256, 32, "float32", True), (1, 2, 256, 32, "bfloat16", False)],
}


def load_old(tree: str):
    """The mlx_flash package under DIR, imported as `mlx_flash_old` (its imports are relative)."""
    init = Path(tree) / "mlx_flash" / "__init__.py"
    if not init.exists():
        raise SystemExit(f"--old-tree: no mlx_flash package under {tree!r} (expected {init}).")
    spec = importlib.util.spec_from_file_location("mlx_flash_old", init,
                                                  submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["mlx_flash_old"] = module
    spec.loader.exec_module(module)
    return module


def new_backend(fraction, device_fraction=None):
    backend = mlx_ops.MLXOpsBackend(score_fractions=(("cpu", fraction), ("gpu", fraction)),
                                    device_fractions=mlx_ops.DEVICE_FRACTIONS if device_fraction is None
                                    else (("cpu", device_fraction), ("gpu", device_fraction)))

    def attend(q, k, v, mask, scale):
        return flash_attention(q, k, v, scale=scale, mask=mask, backend=backend)
    return attend


def old_backend(old):
    # The old tree's own backend object: its registry names modules absolutely ("mlx_flash.backends.
    # mlx_ops"), so backend="mlx" would run THIS checkout's backend under the old API.
    backend = importlib.import_module(old.__name__ + ".backends.mlx_ops").BACKEND
    if not backend.__class__.__module__.startswith(old.__name__):
        raise SystemExit(f"--old-tree: its mlx backend resolved to {backend.__class__.__module__}, not the old tree")

    def attend(q, k, v, mask, scale):
        return old.flash_attention(q, k, v, scale=scale, mask=mask, backend=backend)
    return attend


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpu" if mx.default_device().type == mx.gpu else "cpu")
    parser.add_argument("--old-tree", default=None, help="directory holding the old checkout's mlx_flash package")
    parser.add_argument("--fractions", type=int, nargs="+", default=None,
                        help="score fractions of the new backend (default: 8, 16 and the shipped "
                             f"{SHIPPED} on the gpu preset, the shipped one elsewhere)")
    parser.add_argument("--device-fractions", type=int, nargs="+", default=None,
                        help=f"also run each new/F with a block of at most 1/D of the device's memory "
                             f"(new/F@D; shipped: {dict(mlx_ops.DEVICE_FRACTIONS)})")
    parser.add_argument("--target-seconds", type=float, default=0.3)
    parser.add_argument("--max-repeats", type=int, default=5)
    parser.add_argument("--time-budget-s", type=float, default=200.0, help="start no new shape after this")
    parser.add_argument("--max-n", type=int, default=None, help="only the preset's shapes with N at most this")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    fractions = args.fractions or sorted({8, 16, SHIPPED} if args.preset == "gpu"
                                         else {SHIPPED})
    impls = {}
    if args.old_tree:
        impls["old"] = old_backend(load_old(args.old_tree))
    for f in fractions:
        impls[f"new/{f}" + ("*" if f == SHIPPED else "")] = new_backend(f)
        for d in args.device_fractions or []:
            if d != SHIPPED_DEVICE:
                impls[f"new/{f}@{d}"] = new_backend(f, d)
    impls["unfused"] = bm.unfused_attention
    impls["mx.fast"] = bm.fast_attention
    new = f"new/{SHIPPED}*" if SHIPPED in fractions else f"new/{fractions[0]}"

    settings = bm.Settings(warmup=1, min_repeats=3, max_repeats=args.max_repeats, target_seconds=args.target_seconds)
    env = bm.environment("mlx", "mlx")
    print(f"# {env['device_name']} ({env['device']}), mlx {env['mlx_version']}, commit {env['git_commit']}")
    started, rows, table = time.time(), [], []
    header = (["shape"] + [f"{n} ms" for n in impls] + [f"{n} peak" for n in impls] + [f"{new} first ms"]
              + ["new/unfused t", "new/unfused mem", "new/fast t", "new/fast mem", "new/old t"])
    for B, H, N, D, dtype, causal in PRESETS[args.preset]:
        if args.max_n is not None and N > args.max_n:
            continue
        case = bm.BenchCase(B, H, H, N, N, D, dtype, causal)
        if time.time() - started > args.time_budget_s:
            print(f"skipped (time budget): {case.label()}", flush=True)
            continue
        inputs = bm.random_inputs(case)
        # The first call of the shipped new variant, alone: graph building + first use of the shapes + run.
        prepare, run = bm.mlx_pass(impls[new], case, inputs, "forward_backward")
        t0 = time.perf_counter()
        mx.eval(run(None))
        first_ms = 1e3 * (time.perf_counter() - t0)
        items = {}
        for name, attend in impls.items():
            prepare, run = bm.mlx_pass(attend, case, inputs, "forward_backward")
            items[name] = (bm.Call(run, prepare), case, "forward_backward", None)
        result = bm.measure_many(items, settings)
        ms = {n: result[n].get("median_ms") for n in impls}
        peak = {n: result[n].get("peak_memory_bytes") for n in impls}

        def ratio(a, b, d):
            return f"{d[a] / d[b]:.2f}x" if d.get(a) and d.get(b) else "-"

        table.append([case.label()] + [bm.format_ms(ms[n]) for n in impls]
                     + [bm.format_bytes(peak[n]) for n in impls] + [bm.format_ms(first_ms)]
                     + [ratio(new, "unfused", ms), ratio(new, "unfused", peak),
                        ratio(new, "mx.fast", ms), ratio(new, "mx.fast", peak),
                        ratio(new, "old", ms) if "old" in impls else "-"])
        rows.append({"case": bm.as_dict(case), "results": result, "first_ms": first_ms})
        print(bm.format_table(header, table[-1:]).splitlines()[-1], flush=True)
        del inputs, items
    # Outside the source tree unless named: published results are copied into benchmarks/results by hand.
    out = Path(args.out or Path(tempfile.gettempdir()) / f"mlx_backend_variants_{env['device_type']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"environment": env, "rows": rows}, indent=1, default=str))
    print(f"wrote {out}")
    print()
    print(bm.format_table(header, table))


if __name__ == "__main__":
    main()

"""This tree's kernels against another version's, on one GPU, in interleaved rounds.

    python benchmarks/ab_versions.py --against REV [--backend cuda] [--shapes 4,16,4096,64,none ...]
        [--passes forward forward_backward] [--rounds 15] [--back-to-back 8] [--compiled]
        [--tuning KEY=VALUE ...] [--against-tuning KEY=VALUE ...]
        [--out FILE.json]
    python benchmarks/ab_versions.py --against . --tuning scale_fold=True   # one option, this tree

A shape is B,H,N,D,mask[,KV_HEADS] in bf16; its mask is none, causal, bool or additive (a random
[1, 1, N, N] array mask, benchmark.random_mask, the same in both versions and in mx.fast's calls).

REV is a git revision (its mlx_flash/ and kernels/ are extracted with git archive) or a folder
that holds a version's mlx_flash/ and kernels/ (benchmarks/versions.py): the GPU machine's copy of
the tree has no usable .git (one older than its files), so extract the revision here and carry the
folder, e.g.
    mkdir -p .ab/BASE && git archive BASE mlx_flash kernels | tar -x -C .ab/BASE
(.ab/ in .git/info/exclude), then run with --against .ab/BASE.

How: each version runs in a process of its own that imports its mlx_flash (planner, block table
and templates together), as benchmarks/host_time.py does for host time. The processes take turns
sample by sample (which one goes first alternates; MLX's own mx.fast.scaled_dot_product_attention
closes each round, in the process that goes first next round: sample_order says why), so both
versions and mx.fast meet the same clocks and both versions the same neighbours. A sample is
--back-to-back calls issued one after another and waited for once (mlx_flash.benchmark.Call),
reported per call; each version's first sample is a warm-up (kernel
compilation, first-contact probes). Outputs: each version's forward output on the same inputs,
as the largest difference over the largest value of this tree's (reordered arithmetic shows as a
few bf16 roundings; a broken kernel as O(1)); with the forward_backward pass also the gradients
(the vjp with the case's cotangent), the largest such difference of dq, dk and dv (0: bitwise
the same gradients).

--tuning sets fields of this tree's cuda_source.Tuning (this tree's side only: another version's
Tuning may lack them), so `--against .` times one option against the table; --against-tuning sets
the other side's (a version whose Tuning has those fields), so `--against . --tuning X=2
--against-tuning X=1` times two settings of one option. With a CUDA backend
each row records the kernels both sides ran (variant names: their flags show options such as the
scale fold's "f"). --backend cuda-emulated runs the CUDA kernels on the CPU emulator (a check of
the tool, not a timing).

Prints one row per shape and pass, medians in ms: this tree, REV, the ratio this / REV (below 1:
this tree is faster), its spread (the ratio of the quartiles, q1 / q3 and q3 / q1), mx.fast, and
the output and gradient differences. --out writes every sample and the environment as JSON.
Where mx.fast fails (MLX's unfused attention past D = 256 runs out of device memory at long N
with calls queued back to back), its error is printed and kept in the row ("mx_fast_error") and
the rounds go on with the two versions alone; a version that fails ends the run.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

import versions  # benchmarks/versions.py: the other version's tree and its server process
from cli_args import parse_shape, parse_tuning  # benchmarks/cli_args.py

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve()
DEFAULT_SHAPES = ("4,16,4096,64,none", "4,16,4096,128,none", "4,16,4096,128,causal", "1,16,16384,128,none")


@functools.lru_cache(maxsize=None)
def _benchmark_helpers():
    """This tree's mlx_flash/benchmark.py as a module of its own name (the timing helpers, the
    same in both processes whichever version of mlx_flash a process imports)."""
    name = "ab_benchmark_helpers"
    spec = importlib.util.spec_from_file_location(name, ROOT / "mlx_flash" / "benchmark.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _backend(name: str, tuning: dict):
    """What the worker passes as flash_attention's backend: the name, or a CUDA backend object
    (with `tuning`, or the CPU emulator's)."""
    if name not in ("cuda", "cuda-emulated"):
        return name
    from mlx_flash.backends import cuda, cuda_emulator, cuda_source
    value = cuda_source.Tuning(**tuning)
    return cuda.CUDABackend(tuning=value) if name == "cuda" else cuda_emulator.backend(seed=1, tuning=value)


def serve(backend_name: str, tuning: dict) -> None:
    """Worker: time what the driver asks for, one JSON line per request and per answer. It
    imports mlx_flash from PYTHONPATH (its version's tree) and the timing helpers from this tree."""
    import mlx.core as mx
    import numpy as np

    import mlx_flash
    from mlx_flash.spec import check_inputs
    bm = _benchmark_helpers()
    backend = _backend(backend_name, tuning)
    print(json.dumps({"ready": str(Path(mlx_flash.__file__).resolve().parent)}), flush=True)
    calls, inputs, masks = {}, {}, {}

    def flash(q, k, v, mask, scale):
        return mlx_flash.flash_attention(q, k, v, scale=scale, mask=mask, backend=backend)

    def mask_of(case):
        """The case's mask argument: its array mask (benchmark.random_mask), "causal" or None."""
        return masks[case] if masks[case] is not None else ("causal" if case.causal else None)

    def kernels(case) -> list:
        """The CUDA variants that serve the case (names), [] on other backends."""
        if not hasattr(backend, "variants"):
            return []
        q, k, v, _ = inputs[case]
        spec, _ = check_inputs(q, k, v, mask=mask_of(case), scale=case.scale)
        chosen = backend.variants(spec, None if masks[case] is None else masks[case].dtype)
        return [getattr(chosen, kernel).name for kernel in ("forward", "backward_query", "backward_key_value")]

    for line in sys.stdin:
        request = json.loads(line)
        case = bm.case_of(request["case"])
        if case not in inputs:
            inputs[case], masks[case] = bm.random_inputs(case, seed=0), bm.random_mask(case, seed=0)
        if request["op"] == "output":
            q, k, v, d_out = inputs[case]
            if request.get("gradients"):  # the output and its vjp with the case's cotangent
                (out,), grads = mx.vjp(lambda a, b, c: [flash(a, b, c, mask_of(case), case.scale)], [q, k, v], [d_out])
            else:
                out, grads = flash(q, k, v, mask_of(case), case.scale), []
            arrays = dict(zip(("out", "dq", "dk", "dv"), (out, *grads)))
            np.savez(request["path"], **{name: np.array(x.astype(mx.float32)) for name, x in arrays.items()})
            print(json.dumps({"kernels": kernels(case)}), flush=True)
            continue
        key = (case, request["pass"], request["impl"])
        if key not in calls:
            attention = flash if request["impl"] == "flash" else bm.fast_attention
            prepare, run = bm.mlx_pass(attention, case, inputs[case], request["pass"],
                                       compiled=request.get("compiled", False), mask=masks[case])
            calls[key] = bm.Call(run, prepare, back_to_back=request["back_to_back"])
        try:
            seconds = calls[key].timed_once()
        except RuntimeError as error:  # mx.fast's (MLX's unfused attention past D = 256) out of memory
            if request["impl"] == "flash":
                raise
            del calls[key]
            mx.clear_cache()
            print(json.dumps({"error": " ".join(str(error).split())[:300]}), flush=True)
            continue
        print(json.dumps({"seconds": seconds}), flush=True)


class Worker:
    """This script in --serve mode under `tree` (versions.Server), JSON lines both ways."""

    def __init__(self, tree: str, backend: str, tuning: dict):
        tuning_arguments = [f"{key}={value!r}" for key, value in tuning.items()]
        self.server = versions.Server(SCRIPT, tree, ["--backend", backend]
                                      + (["--tuning", *tuning_arguments] if tuning_arguments else []))
        self.package = json.loads(self.server.ready)["ready"]

    def ask(self, **request) -> dict:
        return json.loads(self.server.ask(json.dumps(request), f"{request['op']} {request['case']}"))

    def close(self) -> None:
        self.server.close()


def compare(args) -> dict:
    """Both versions and mx.fast, sample by sample, per shape and pass."""
    import numpy as np

    from mlx_flash import benchmark as bm
    results = {"against": args.against, "backend": args.backend, "tuning": {k: repr(v) for k, v in args.tuning},
               "against_tuning": {k: repr(v) for k, v in args.against_tuning},
               "back_to_back": args.back_to_back, "compiled": args.compiled,
               "rounds": args.rounds, "environment": bm.environment(args.backend, args.backend), "rows": []}
    with tempfile.TemporaryDirectory(prefix="ab_versions_") as scratch:
        tree = versions.version_tree(args.against, scratch)
        workers = {"this": Worker(str(ROOT), args.backend, dict(args.tuning)),
                   "other": Worker(tree, args.backend, dict(args.against_tuning))}
        results["packages"] = {name: worker.package for name, worker in workers.items()}
        print(f"# this: {workers['this'].package}, other: {workers['other'].package} ({args.against})\n"
              f"{'shape':<40} {'pass':<16} {'this ms':>9} {'other ms':>9} {'ratio':>7} {'(spread)':<13} "
              f"{'mx.fast':>9} {'out diff':>9} {'grad diff':>9}", flush=True)
        try:
            for case in args.shapes:
                described = bm.as_dict(case)
                paths, kernels = {}, {}
                gradients = "forward_backward" in args.passes
                for name, worker in workers.items():
                    paths[name] = os.path.join(scratch, f"out_{name}.npz")
                    kernels[name] = worker.ask(op="output", case=described, path=paths[name],
                                               gradients=gradients)["kernels"]
                if kernels["this"]:
                    print(f"# {case.label()}: this {' '.join(kernels['this'])}; other {' '.join(kernels['other'])}",
                          flush=True)
                mine, theirs = np.load(paths["this"]), np.load(paths["other"])

                def relative(name):  # the largest difference over the largest value of this tree's
                    return float(np.abs(mine[name] - theirs[name]).max() / max(np.abs(mine[name]).max(), 1e-30))
                difference = relative("out")
                gradient_difference = max(relative(name) for name in ("dq", "dk", "dv")) if gradients else None
                for pass_name in args.passes:
                    samples = {"this/flash": [], "other/flash": [], "mx.fast": []}
                    fast_error = None  # mx.fast's error, after which the rounds go on without it
                    for round_ in range(args.rounds + 1):  # round 0: warm-up
                        for worker_name, impl in sample_order(round_):
                            if impl == "fast" and fast_error is not None:
                                continue
                            answer = workers[worker_name].ask(op="sample", case=described, impl=impl,
                                                              back_to_back=args.back_to_back,
                                                              compiled=args.compiled, **{"pass": pass_name})
                            if "error" in answer:
                                fast_error = answer["error"]
                                print(f"# {case.label()} {pass_name}: mx.fast failed, the rounds go on without "
                                      f"it: {fast_error}", flush=True)
                                continue
                            if round_:
                                samples["mx.fast" if impl == "fast" else f"{worker_name}/flash"].append(
                                    answer["seconds"] * 1e3)
                    row = {"case": described, "label": case.label(), "pass": pass_name, "kernels": kernels,
                           "output_difference": difference, "gradient_difference": gradient_difference,
                           "samples_ms": samples, "mx_fast_error": fast_error}
                    results["rows"].append(row)
                    print(format_row(row), flush=True)
        finally:
            for worker in workers.values():
                worker.close()
    return results


def sample_order(round_: int):
    """The samples of one round as (process, what), in the order they are taken: the two versions,
    which one first alternating, then mx.fast in the process of the one that goes first next
    round. So each version's sample follows, in every other round, mx.fast in its own process,
    and in the rest the other version's sample in the other process: the same neighbours for
    both. What a sample follows shows in its time: before this order ((this, other, mx.fast in
    this process) and its reverse), with the same kernels on both sides, the other version took
    1.037x this one's time (H200, B=1 H=16 N=4096 D=512 causal fwd+bwd; forward 1.012x) and
    1.010x / 1.021x at B=4 N=4096 D=128 (fwd+bwd / forward), 1.002x / 1.026x at D=64: right after
    mx.fast (MLX's unfused attention at D = 512) it ran up to 6 % slower, and this version,
    which half the time followed its own last sample, up to 3 % faster.)"""
    versions = [("this", "flash"), ("other", "flash")] if round_ % 2 == 0 else [("other", "flash"), ("this", "flash")]
    return versions + [(versions[1][0], "fast")]  # the second goes first next round


def format_row(row) -> str:
    from mlx_flash.benchmark import Timing  # its quantiles, as bench.py's tables use

    def quartiles(samples):
        timing = Timing(samples)
        return timing.quantile(0.25), timing.median, timing.quantile(0.75)

    this_q1, this, this_q3 = quartiles(row["samples_ms"]["this/flash"])
    other_q1, other, other_q3 = quartiles(row["samples_ms"]["other/flash"])
    fast = f"{Timing(row['samples_ms']['mx.fast']).median:9.3f}" if row["samples_ms"]["mx.fast"] else f"{'-':>9}"
    grads = row.get("gradient_difference")
    grads = f"{grads:9.2e}" if grads is not None else f"{'-':>9}"
    return (f"{row['label']:<40} {row['pass']:<16} {this:9.3f} {other:9.3f} {this / other:7.3f} "
            f"({this_q1 / other_q3:.3f}-{this_q3 / other_q1:.3f}) {fast} {row['output_difference']:9.2e} {grads}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", help="a git revision, or a folder with mlx_flash/ and kernels/")
    parser.add_argument("--backend", default="cuda", help="the mlx_flash backend both versions run (default cuda)")
    parser.add_argument("--shapes", nargs="+", type=functools.partial(parse_shape, array_masks=True), default=None,
                        help=f"B,H,N,D,mask[,KV_HEADS] (bf16; mask none, causal, bool or additive: a random "
                             f"[1, 1, N, N] array mask), default {' '.join(DEFAULT_SHAPES)}")
    parser.add_argument("--passes", nargs="+", default=["forward", "forward_backward"],
                        choices=["forward", "forward_backward"])
    parser.add_argument("--rounds", type=int, default=15, help="timed samples of each (default 15)")
    parser.add_argument("--back-to-back", type=int, default=8, help="calls per sample (default 8)")
    parser.add_argument("--tuning", nargs="+", type=parse_tuning, default=[],
                        help="KEY=VALUE fields of this tree's cuda_source.Tuning (cuda backends only)")
    parser.add_argument("--against-tuning", nargs="+", type=parse_tuning, default=[],
                        help="KEY=VALUE fields of the other version's Tuning (cuda backends only)")
    parser.add_argument("--compiled", action="store_true",
                        help="time each pass as an mx.compile'd function (mlx_pass(compiled=True), as bench.py "
                             "--compiled and the dispatch table's recordings): less host time per call")
    parser.add_argument("--out", help="write every sample and the environment here (JSON)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    if "--serve" not in (sys.argv[1:] if argv is None else argv):
        sys.path.insert(0, str(ROOT))  # the driver: this tree's mlx_flash (a worker imports its own)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.backend, dict(args.tuning))
        return 0
    if not args.against:
        parser.error("--against is required: a git revision, or a folder with mlx_flash/ and kernels/")
    if (args.tuning or args.against_tuning) and args.backend not in ("cuda", "cuda-emulated"):
        parser.error(f"--tuning sets the CUDA backend's Tuning: it needs --backend cuda or cuda-emulated, "
                     f"got --backend {args.backend}")
    if args.compiled and args.backend == "cuda-emulated":
        parser.error("--compiled needs a GPU backend: the CPU emulator's kernels read their inputs' values, which "
                     "mx.compile does not let a function do")
    if args.rounds < 1 or args.back_to_back < 1:
        parser.error(f"--rounds and --back-to-back must be >= 1, got {args.rounds} and {args.back_to_back}")
    args.shapes = args.shapes or [parse_shape(s) for s in DEFAULT_SHAPES]
    results = compare(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

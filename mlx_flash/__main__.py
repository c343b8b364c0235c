"""`python -m mlx_flash`: the command line of mlx-flash.

Without a subcommand it runs the main job, in two steps:

1. Correctness: a few small random cases (non-causal, causal with Nq != Nk, GQA with an lse
   cotangent) through `flash_attention` on the chosen backend; O, lse, dQ, dK, dV compared with
   mlx_flash.reference (relative Frobenius error, the test suite's tolerances). Exit 1 on a
   failure.
2. Memory and speed: forward+backward of mlx-flash next to mx.fast.scaled_dot_product_attention
   on the same inputs, measured in the same run (peak memory of one call, then warm timed calls
   interleaved; mlx_flash/benchmark.py says exactly what is timed). mlx-flash is called with the
   --backend asked for, so under "auto" (the default) a call that the dispatch table hands to
   mx.fast is timed as such, and its row says so. On a GPU each timed sample is up to 8 calls
   issued back to back and waited for once, as a training step issues them (fewer for long
   calls). A pass of mx.fast whose N x N scores would pass a share of the device's memory
   (benchmark.MEMORY_GUARD_FRACTION) is not run; its row says what it would need. The sizes are
   chosen per device so that N reaches the lengths where MLX's N x N scores dominate its memory:
   on a 2-core CPU, B=1 H=2 D=64 fp32 up to N=4096 in about 2 minutes; on a GPU, bf16 D=128 H=16
   up to N=16384.

Subcommands live in their own modules. Each module has a function `add_<name>_parser(subparsers)`
that adds its parser to `subparsers` and sets `run` on it with `parser.set_defaults(run=...)`;
`run(args)` returns the exit code. Adding one is an import and an entry in SUBCOMMANDS.
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from . import __version__, benchmark as bm, reference
from .api import flash_attention
from .backends import BACKEND_NAMES, auto_backend_name, get_backend
from .fallback import FallbackWarning, fallback_counts, route_counts
from .cli import dtype_argument, positive_int
from .plan_command import add_plan_parser
from .report import add_report_parser
from .tune_command import add_tune_parser
from .spec import check_inputs

# add_<name>_parser(subparsers) functions, one per subcommand module (see the module docstring).
SUBCOMMANDS: List[Callable[[argparse._SubParsersAction], argparse.ArgumentParser]] = [add_report_parser,
                                                                                    add_plan_parser, add_tune_parser]

# (label, B, Hq, Hkv, Nq, Nk, causal, lse cotangent)
CHECK_CASES = [("non-causal", 2, 3, 3, 80, 80, False, False),
               ("causal Nq<Nk", 1, 2, 2, 70, 130, True, False),
               ("GQA 4/2 causal +dlse", 1, 4, 2, 96, 96, True, True)]

# Per device: the sizes of step 2. On the project's 2-core x86 CPU one forward+backward at
# B=1 H=2 D=64 N=4096 fp32 takes 12-27 s (mx.fast and mlx-flash alike, on the shared machine), and
# each size runs four calls (a memory call and a timed call per implementation), so N=4096 is
# the largest that keeps the whole job under 3 minutes. H=2 keeps the time down; mx.fast's
# peak memory (N x N scores) still grows 4x per doubling of N while mlx-flash's grows ~2x.
# quick_settings: --quick's repeats. On a CPU, one or two samples keep the run (and the tests that
# run it) to seconds. On a GPU a call at the quick sizes takes about a millisecond, and one or two
# samples put the time ratio anywhere (an H200 read 1.57x and 0.81x in two runs of one tree), so a
# warm-up and up to 20 samples, a quarter of a second per implementation and size.
# back_to_back: at most this many calls per timed sample. A GPU runs a call of the smaller sizes in
# about a millisecond, near the framework's own wait for the GPU (0.2-0.4 ms per synchronized call
# of MLX's on an H100) and the host's graph building, which a training step overlaps with the GPU's
# work; calls issued back to back and waited for once (benchmark.Call) time what such a step pays.
# A sample holds as many calls as make benchmark.SAMPLE_WORK (calls_per_sample), so long calls go one or two
# at a time and a slower GPU (a Mac's) does not take 8x as long for its largest sizes. On an
# H200 (B=1 H=16 D=128 bf16, --backend cuda) our fwd+bwd read 1.60x / 1.26x / 1.09x mx.fast's time
# at N = 2048 / 4096 / 8192 timed one call at a time, and 1.44x / 1.09x / 1.05x with 8 calls a
# sample at every size (two runs, before samples were sized by work;
# benchmarks/results/h200_cuda_bf16_vs_mlx_fa2_cudnn.json, "main_job_timing"). A CPU computes
# synchronously: one call.
DEVICE_DEFAULTS = {
    "cpu": {"sizes": [512, 1024, 2048, 4096], "quick_sizes": [128, 256], "dtype": "float32",
            "head_dim": 64, "heads": 2, "passes": ["forward_backward"], "rate_unit": "GFLOP/s",
            "settings": bm.Settings(warmup=0, min_repeats=1, max_repeats=3, target_seconds=1.0),
            "quick_settings": bm.Settings(warmup=0, min_repeats=1, max_repeats=2, target_seconds=0.0),
            "back_to_back": 1},
    "gpu": {"sizes": [2048, 4096, 8192, 16384], "quick_sizes": [1024, 2048], "dtype": "bfloat16",
            "head_dim": 128, "heads": 16, "passes": ["forward", "forward_backward"], "rate_unit": "TFLOP/s",
            "settings": bm.Settings(warmup=2, min_repeats=3, max_repeats=10, target_seconds=0.5),
            "quick_settings": bm.Settings(warmup=1, min_repeats=5, max_repeats=20, target_seconds=0.25),
            "back_to_back": 8},
}


def check_backend(backend: str, dtype: str, head_dim: int, seed: int = 0) -> List[Dict]:
    """Relative errors of O, lse, dQ, dK, dV against the float64 reference for CHECK_CASES."""
    results = []
    rng = np.random.default_rng(seed)
    for label, B, Hq, Hkv, Nq, Nk, causal, lse_cotangent in CHECK_CASES:
        def normal(*shape):
            return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(bm.DTYPES[dtype])

        q, k, v = normal(B, Hq, Nq, head_dim), normal(B, Hkv, Nk, head_dim), normal(B, Hkv, Nk, head_dim)
        d_out = normal(B, Hq, Nq, head_dim)
        d_lse = mx.array(rng.standard_normal((B, Hq, Nq)).astype(np.float32)) if lse_cotangent else None
        mask = "causal" if causal else None
        spec, _ = check_inputs(q, k, v, mask=mask)
        before = fallback_counts()

        if d_lse is not None:
            def attend(q_, k_, v_):
                return list(flash_attention(q_, k_, v_, mask=mask, return_lse=True, backend=backend))
            cotangents = [d_out, d_lse]
        else:  # the common case: only out is used, lse gets no cotangent at all
            def attend(q_, k_, v_):
                return [flash_attention(q_, k_, v_, mask=mask, backend=backend)]
            cotangents = [d_out]
        # A fallback is counted and shown in the table's note column; its warning would only repeat it
        # above the table.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FallbackWarning)
            out, lse = flash_attention(q, k, v, mask=mask, return_lse=True, backend=backend)
            _, gradients = mx.vjp(attend, [q, k, v], cotangents)
            mx.eval(out, lse, gradients)
        as_np = [np.array(x.astype(mx.float32)) for x in (q, k, v, d_out)]
        ref_out, ref_lse = reference.attention_forward(*as_np[:3], spec)
        ref_grads = reference.attention_backward(*as_np, spec, d_lse=None if d_lse is None else np.array(d_lse))
        errors = {"out": reference.relative_error(np.array(out.astype(mx.float32)), ref_out),
                  "lse": reference.relative_error(np.array(lse), ref_lse)}
        for name, gradient, ref in zip(("dq", "dk", "dv"), gradients, ref_grads):
            errors[name] = reference.relative_error(np.array(gradient.astype(mx.float32)), ref)
        fallbacks = [r for r, n in fallback_counts().items() if n > before.get(r, 0)]
        # Served by MLX's own operations (the "mlx" backend, or a fallback to it or to mx.fast):
        # float32 at the precision of MLX's matmuls on this device (reference.limits says why).
        reduced = reference.reduced_float32(dtype, backend == "mlx" or bool(fallbacks))
        forward_limit, gradient_limit = reference.limits(dtype, reduced)
        passed = (max(errors["out"], errors["lse"]) <= forward_limit
                  and max(errors["dq"], errors["dk"], errors["dv"]) <= gradient_limit)
        results.append({"case": label, "dtype": dtype, "errors": errors, "passed": passed, "fallbacks": fallbacks,
                        "limits": (forward_limit, gradient_limit), "reduced_float32": reduced})
    return results


class Progress:
    """A tqdm bar whose units are work (B·H·N² per call), so its estimate of the time left is
    fair across sizes; quiet when stderr is not a terminal."""

    def __init__(self, steps: List[float], description: str):
        from tqdm import tqdm

        self.bar = tqdm(total=sum(steps), desc=description, unit="work", disable=None, leave=False,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed} elapsed, ~{remaining} left")
        self.done = 0.0

    def advance(self, amount: float) -> None:
        # Adaptive repetitions can outrun the estimate: never past 100% before the end.
        step = min(amount, max(0.0, self.bar.total - self.bar.n))
        self.bar.update(step)

    def finish_step(self, planned: float) -> None:
        self.done += planned
        self.bar.update(max(0.0, self.done - self.bar.n))

    def close(self) -> None:
        self.bar.close()


def compare_with_mlx(backend: str, case: bm.BenchCase, passes: List[str], settings: bm.Settings,
                     progress: Optional[Callable] = None, back_to_back: int = 1,
                     skip_mlx: Sequence[str] = ()) -> Dict:
    """The given passes of mlx-flash (flash_attention(backend=backend)) and mx.fast on the same
    inputs, interleaved, each sample up to `back_to_back` calls waited for once (benchmark.Call;
    calls_per_sample). skip_mlx: passes mx.fast does not run (the memory guard's)."""
    inputs = bm.random_inputs(case, seed=case.q_len)
    items = {}
    for name, attention in (("mlx-flash", bm.flash_attention_with(backend)), ("mx.fast", bm.fast_attention)):
        for pass_name in passes:
            if name == "mx.fast" and pass_name in skip_mlx:
                continue
            prepare, run = bm.mlx_pass(attention, case, inputs, pass_name)
            calls = bm.calls_per_sample(case, pass_name, back_to_back)
            items[name, pass_name] = (bm.Call(run, prepare, back_to_back=calls), case, pass_name, None)
    return bm.measure_many(items, settings, catch=False, progress=progress)


def time_kernels(backend_name: str, case: bm.BenchCase, settings: bm.Settings) -> Dict:
    """The backend's own entry points, called directly with a precomputed forward:
    forward, then backward_query and backward_key_value when present, else backward."""
    backend = get_backend(backend_name)
    q, k, v, d_out = bm.random_inputs(case, seed=case.q_len + 1)
    spec, mask = check_inputs(q, k, v, mask="causal" if case.causal else None)
    reason = backend.unsupported_reason(spec)
    if reason is not None:
        return {"unsupported": reason}
    out, lse = backend.forward(q, k, v, mask, spec)
    mx.eval(out, lse)
    calls = {"forward": lambda _: backend.forward(q, k, v, mask, spec)}
    if hasattr(backend, "backward_query") and hasattr(backend, "backward_key_value"):
        calls["backward_query"] = lambda _: backend.backward_query(q, k, v, mask, out, lse, d_out, None, spec)
        calls["backward_key_value"] = lambda _: backend.backward_key_value(q, k, v, mask, out, lse, d_out, None, spec)
    else:
        calls["backward"] = lambda _: backend.backward(q, k, v, mask, out, lse, d_out, None, spec)[:3]
    return bm.measure_many({kernel: (bm.Call(run), case, kernel, None) for kernel, run in calls.items()},
                           settings, catch=False)


# ---------------------------------------------------------------------------------------------
# Command line


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """The main job's options (check + memory and speed against MLX)."""
    cpu, gpu = DEVICE_DEFAULTS["cpu"], DEVICE_DEFAULTS["gpu"]
    parser.add_argument("--quick", action="store_true",
                        help=f"smallest sizes ({cpu['quick_sizes']} on a CPU, {gpu['quick_sizes']} on a GPU), "
                             "fewest repeats: a few seconds (default: off)")
    parser.add_argument("--sizes", type=positive_int, nargs="+", metavar="N",
                        help=f"sequence lengths Nq = Nk (default: {cpu['sizes']} on a CPU, {gpu['sizes']} on a GPU)")
    parser.add_argument("--dtype", type=dtype_argument,
                        help="float32/fp32, float16/fp16 or bfloat16/bf16 "
                             f"(default: {cpu['dtype']} on a CPU, {gpu['dtype']} on a GPU)")
    parser.add_argument("--backend", default="auto", choices=BACKEND_NAMES,
                        help="mlx-flash backend; auto picks by device (default: %(default)s)")
    parser.add_argument("--head-dim", type=positive_int,
                        help=f"D (default: {cpu['head_dim']} on a CPU, {gpu['head_dim']} on a GPU)")
    parser.add_argument("--heads", type=positive_int,
                        help=f"H (default: {cpu['heads']} on a CPU, {gpu['heads']} on a GPU)")
    parser.add_argument("--batch", type=positive_int, default=1, help="B (default: %(default)s)")
    parser.add_argument("--causal", action="store_true", help="causal attention instead of non-causal (default: off)")
    parser.add_argument("--forward", action="store_true",
                        help="also time the forward alone (default: on a GPU only)")
    parser.add_argument("--kernels", action="store_true",
                        help="also time the backend's own entry points, called directly (default: off)")
    parser.add_argument("--skip-check", action="store_true", help="skip the correctness check (default: off)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mlx_flash",
        description="Check mlx-flash against a float64 reference, then show its forward+backward peak "
                    "memory and time next to mx.fast.scaled_dot_product_attention. About 2 minutes on "
                    "a 2-core laptop CPU, under a minute on a GPU (the first GPU run also compiles the "
                    "kernels).")
    add_job_arguments(parser)
    parser.set_defaults(run=run_job)
    if SUBCOMMANDS:
        subparsers = parser.add_subparsers(title="subcommands (without one: the check and comparison above)")
        for add in SUBCOMMANDS:
            add(subparsers)
    return parser


def resolve_backend(requested: str, device: mx.Device):
    """(backend name, message or None, exit code or None) for the requested backend on device."""
    name = auto_backend_name(device) if requested == "auto" else requested
    try:
        reason = get_backend(name).unavailable_reason(device)
    except ValueError as error:
        return name, f"backend {name!r}: {error}", 2
    if reason is None:
        return name, None, None
    if requested != "auto":
        return name, f"backend {name!r} is not available: {reason}", 2
    return "mlx", f"backend {name!r} (auto) is not available ({reason}); flash_attention falls back to 'mlx'", None


def run_check(name: str, dtype: str, head_dim: int) -> bool:
    print("\n1. Correctness against the float64 reference (relative error ||x - ref|| / ||ref||)")
    rows, failed, reduced = [], False, False
    for check_dtype in dict.fromkeys(["float32", dtype]):
        for r in check_backend(name, check_dtype, head_dim):
            e = r["errors"]
            note = "; ".join(f"FALLBACK: {f}" for f in r["fallbacks"])
            if r["reduced_float32"]:
                note = "float32 through MLX's reduced-precision matmuls (see below)" + (f"; {note}" if note else "")
            rows.append([r["case"], r["dtype"]] + [f"{e[n]:.1e}" for n in ("out", "lse", "dq", "dk", "dv")]
                        + [f"{r['limits'][0]:.0e}/{r['limits'][1]:.0e}", "PASS" if r["passed"] else "FAIL", note])
            failed |= not r["passed"]
            reduced |= r["reduced_float32"]
    print(bm.format_table(["case", "dtype", "O", "lse", "dQ", "dK", "dV", "tolerance fwd/grad", "result", "note"],
                          rows))
    if reduced:
        print(f"  float32 cases served by MLX's own operations are held to {reference.REDUCED_FLOAT32_LIMITS}'s "
              f"limits here: MLX runs float32 matmuls on this device at reduced precision (TF32-like, its default; "
              f"MLX_ENABLE_TF32=0 python -m mlx_flash checks them at float32's)")
    print(f"correctness: {'FAIL' if failed else 'PASS'} ({len(rows)} cases, B<=2 H<=4 N<=130 D={head_dim})")
    return not failed


def _legend(name: str, passes: List[str], rate_unit: str, back_to_back: int, notes: List[str]) -> str:
    """The lines under step 2's table: each column, and each kind of note the rows carry."""
    fwd_bwd = "fwd+bwd: out, (dq, dk, dv) = mx.vjp(attention, ...), all evaluated (what training pays per call)"
    timing = ("of warm calls, each waited for" if back_to_back == 1 else
              f"per call; a sample is up to {back_to_back} calls issued back to back and waited for once, as\n"
              "                a training step issues them (fewer for long calls: 8 fwd+bwd calls' work at N=4096)")
    return "\n".join([
        "  N             sequence length, Nq = Nk",
        f"  pass          {fwd_bwd}" + ("; fwd: the forward alone" if "forward" in passes else ""),
        "  memory        peak bytes allocated during one call above the resident inputs (mx.get_peak_memory):",
        "                mlx-flash keeps one block of scores at a time, so it grows with N; where MLX runs",
        "                attention unfused (a CPU; a Mac's backward) it holds N x N scores, so it grows with N^2",
        "  memory ratio  mlx-flash / MLX (mx.fast.scaled_dot_product_attention): below 1 = less memory",
        f"  ms            median wall-clock milliseconds {timing}; timed interleaved with MLX's",
        "  time ratio    mlx-flash ms / MLX ms: below 1 = faster",
        f"  {rate_unit:<12}  achieved rate: 4·B·H·N²·D operations for fwd, 3.5x that for fwd+bwd (halved if causal),",
        "                divided by the time; the papers' count, comparable across implementations"]
        + (["  note          backend='auto' (the default) hands calls that MLX runs faster to mx.fast: such a row\n"
            "                times mx.fast through flash_attention, which adds its own host time per call (5-20 us\n"
            "                on an H200 machine's host: seen only where a call takes the GPU less time than the\n"
            "                host, e.g. N=1024); --backend " + name + " times the kernels themselves"]
           if any(n.startswith("backend=") for n in notes) else [])
        + ([f"  MLX not run   the memory guard ({bm.MEMORY_GUARD_FRACTION:.0%} of the device's memory) keeps MLX from\n"
            "                passes whose N x N scores would exceed it, where running them could exhaust the\n"
            "                memory; mlx-flash needs O(N)"]
           if any(n.startswith("MLX not run") for n in notes) else []))


def run_comparison(name: str, cases: List[bm.BenchCase], passes: List[str], settings: bm.Settings,
                   rate_unit: str, timed: Optional[str] = None, back_to_back: int = 1,
                   memory_budget: Optional[float] = None) -> Dict:
    """Step 2: the table and its column notes; returns the largest case's fwd+bwd figures.

    Args:
        name: the backend the check ran (the table's label).
        timed: the `backend` argument mlx-flash is timed with (default: name); "auto" times what
            a caller of flash_attention gets, routes to mx.fast included (marked in a note column).
        back_to_back: at most this many calls per timed sample (see DEVICE_DEFAULTS).
        memory_budget: bytes; a pass of mx.fast whose N x N scores are estimated past it
            (benchmark.score_memory_estimate) is not run, and its row says what it would need
            (None: no guard).
    """
    first = cases[0]
    timed = timed or name
    print(f"\n2. mlx-flash[{name}] next to mx.fast.scaled_dot_product_attention, B={first.batch} "
          f"H={first.q_heads} D={first.head_dim} {first.dtype}{' causal' if first.causal else ''}"
          + (f", backend={timed!r}" if timed != name else ""))
    # Progress in units of work: each sample (a tick) is about its calls' share of a size's work.
    ticks_per_size = 2 * len(passes) * (1 + settings.warmup + settings.min_repeats)
    calls = [bm.calls_per_sample(c, "forward_backward", back_to_back) for c in cases]
    weights = [c.batch * c.q_heads * c.q_len * c.kv_len * ticks_per_size * n for c, n in zip(cases, calls)]
    progress = Progress(weights, "measuring")
    rows, notes, last = [], [], {}
    try:
        for case, weight in zip(cases, weights):
            unit = weight / ticks_per_size
            routes_before = route_counts()
            estimates = {p: bm.score_memory_estimate("mx.fast", case, p) for p in passes}
            skip = [p for p in passes if memory_budget is not None and estimates[p] > memory_budget]
            measured = compare_with_mlx(timed, case, passes, settings, back_to_back=back_to_back,
                                        progress=lambda _: progress.advance(unit), skip_mlx=skip)
            progress.finish_step(weight)
            routed = [r.split(":")[0] for r, n in route_counts().items() if n > routes_before.get(r, 0)]
            for pass_name in passes:
                mine, theirs = measured["mlx-flash", pass_name], measured.get(("mx.fast", pass_name))
                if theirs is None:
                    rows.append([case.q_len, bm.PASS_LABELS[pass_name], bm.format_bytes(mine["peak_memory_bytes"]),
                                 "-", "-", bm.format_ms(mine["median_ms"]), "-", "-",
                                 bm.format_rate(mine["tflops"] * 1e12, rate_unit), "-"])
                    notes.append(f"MLX not run: its N x N scores would need ~{bm.format_bytes(estimates[pass_name])}, "
                                 f"over the memory guard's {bm.format_bytes(memory_budget)}")
                    if pass_name == "forward_backward":
                        last = {"N": case.q_len, "mine": mine, "theirs": None, "estimate": estimates[pass_name],
                                "routed": bool(routed)}
                    continue
                memory_ratio = (mine["peak_memory_bytes"] / theirs["peak_memory_bytes"]
                                if theirs["peak_memory_bytes"] else None)
                rows.append([case.q_len, bm.PASS_LABELS[pass_name],
                             bm.format_bytes(mine["peak_memory_bytes"]), bm.format_bytes(theirs["peak_memory_bytes"]),
                             "-" if memory_ratio is None else f"{memory_ratio:.2f}x",
                             bm.format_ms(mine["median_ms"]), bm.format_ms(theirs["median_ms"]),
                             f"{mine['median_ms'] / theirs['median_ms']:.2f}x",
                             bm.format_rate(mine["tflops"] * 1e12, rate_unit),
                             bm.format_rate(theirs["tflops"] * 1e12, rate_unit)])
                notes.append(f"backend='auto' hands it to mx.fast ({'; '.join(routed)})" if routed else "")
                if pass_name == "forward_backward":
                    last = {"N": case.q_len, "mine": mine, "theirs": theirs, "memory_ratio": memory_ratio,
                            "routed": bool(routed)}
    finally:
        progress.close()
    header = ["N", "pass", "memory", "MLX memory", "memory ratio", "ms", "MLX ms", "time ratio", rate_unit,
              f"MLX {rate_unit}"]
    if any(notes):
        header, rows = header + ["note"], [row + [note] for row, note in zip(rows, notes)]
    print(bm.format_table(header, rows))
    print()
    print(_legend(name, passes, rate_unit, back_to_back, notes))
    return last


def run_job(args) -> int:
    """The default job: check, then memory and speed against MLX."""
    started = time.perf_counter()
    device = mx.default_device()
    config = DEVICE_DEFAULTS["gpu" if device.type == mx.gpu else "cpu"]
    dtype = args.dtype or config["dtype"]
    head_dim = args.head_dim or config["head_dim"]
    heads = args.heads or config["heads"]
    sizes = args.sizes or (config["quick_sizes"] if args.quick else config["sizes"])
    passes = list(config["passes"])
    if args.forward and "forward" not in passes:
        passes.insert(0, "forward")
    settings = config["quick_settings" if args.quick else "settings"]
    env = bm.device_description()
    print(f"mlx-flash {__version__}, MLX {mx.__version__}, device {env['device_name']} ({env['device']})")
    name, message, code = resolve_backend(args.backend, device)
    if message:
        print(message)
    if code is not None:
        return code
    print(f"backend: {name!r}" + (" (auto)" if args.backend == "auto" else ""))

    correct = True if args.skip_check else run_check(name, dtype, head_dim)
    cases = [bm.BenchCase(batch=args.batch, q_heads=heads, kv_heads=heads, q_len=n, kv_len=n, head_dim=head_dim,
                          dtype=dtype, causal=args.causal) for n in sizes]
    last = run_comparison(name, cases, passes, settings, config["rate_unit"], timed=args.backend,
                          back_to_back=config["back_to_back"], memory_budget=bm.memory_guard_bytes())

    if args.kernels:
        print(f"\n3. backend {name!r} entry points, called directly (backward given the evaluated forward)")
        rows = []
        for case in cases:
            kernels = time_kernels(name, case, settings)
            if "unsupported" in kernels:
                rows.append([case.q_len, "-", "-", "-", f"not served natively: {kernels['unsupported']}"])
                continue
            for kernel, r in kernels.items():
                rows.append([case.q_len, bm.PASS_LABELS[kernel], bm.format_ms(r["median_ms"]),
                             bm.format_rate(r["tflops"] * 1e12, config["rate_unit"]), ""])
        print(bm.format_table(["N", "kernel", "ms", config["rate_unit"], "note"], rows))

    elapsed = time.perf_counter() - started
    check = "correctness not checked" if args.skip_check else ("correct" if correct else "CORRECTNESS FAILED")
    summary = f"\nsummary: mlx-flash[{name}] {check}"
    if last and last["theirs"] is None:
        summary += (f"; at N={last['N']} forward+backward needs {bm.format_bytes(last['mine']['peak_memory_bytes'])}, "
                    f"where MLX's would need ~{bm.format_bytes(last['estimate'])} (not run)")
    elif last:
        mine, theirs = last["mine"], last["theirs"]
        summary += (f"; at N={last['N']} forward+backward needs "
                    + (f"{last['memory_ratio']:.2f}x MLX's peak memory "
                       f"({bm.format_bytes(mine['peak_memory_bytes'])} vs "
                       f"{bm.format_bytes(theirs['peak_memory_bytes'])})" if last["memory_ratio"] else "-")
                    + f" at {mine['median_ms'] / theirs['median_ms']:.2f}x its time"
                    + (" (backend='auto' hands it to mx.fast)" if last["routed"] else ""))
    print(summary + f"; done in {elapsed:.0f} s")
    return 0 if correct else 1


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

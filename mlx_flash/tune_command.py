"""`python -m mlx_flash tune`: measure block sizes on this GPU and write its tuned block table.

    python -m mlx_flash tune [--backend metal|cuda] [--head-dims 64,128] [--dtypes bfloat16,float32]
                             [--kernels forward,...] [--masks none,causal] [--quick] [--budget-s 600]

For each (kernel, head dim, dtype) point it gates candidate rows against the float64 reference,
times the survivors against the shipped row interleaved, confirms a winner in a second A/B and
writes the table to $XDG_CACHE_HOME/mlx_flash/tuned/ (mlx_flash/tune.py, mlx_flash/tuned.py).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import List

import mlx.core as mx

from . import benchmark as bm, planner, tune, tuned
from .cli import dtype_argument, positive_int

# Timed problems. GPUs: the sizes the shipped tables' comments were measured at (CUDA) or MFA's
# (Metal); the Metal simulator runs kernels on the CPU at a thousandth of a GPU's speed, so it
# gets a problem that only exercises the mechanism.
PROBLEMS = {"cuda": tune.Problem(4, 16, 4096, tune.calls_per_sample("cuda")),
            "cuda_quick": tune.Problem(1, 16, 2048, tune.calls_per_sample("cuda")),
            "metal": tune.Problem(1, 8, 2048), "metal_quick": tune.Problem(1, 8, 1024),
            "metalsim": tune.Problem(1, 1, 64)}
SETTINGS = {"full": bm.Settings(warmup=2, min_repeats=5, max_repeats=15, target_seconds=0.3),
            "quick": bm.Settings(warmup=1, min_repeats=3, max_repeats=5, target_seconds=0.1)}
DEFAULT_DTYPES = {"metal": ("bfloat16", "float32"), "cuda": ("bfloat16",)}
QUICK_HEAD_DIMS = (64, 128)
MAX_DEFAULT_HEAD_DIM = 256


def _list(kind, choices=None):
    def parse(text: str):
        items = [kind(part.strip()) for part in text.split(",") if part.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        if choices is not None:
            bad = [item for item in items if item not in choices]
            if bad:
                raise argparse.ArgumentTypeError(f"{bad} not among {choices}")
        return tuple(dict.fromkeys(items))
    return parse


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def add_tune_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `tune` subcommand (its handler: run_tune)."""
    parser = subparsers.add_parser("tune", help="measure block sizes on this GPU and write its tuned block table",
                                   description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("metal", "cuda"), help="default: this machine's GPU backend")
    parser.add_argument("--head-dims", type=_list(positive_int),
                        help="head dims to tune at (default: each table row's max_d up to 256; --quick: 64,128)")
    parser.add_argument("--dtypes", type=_list(dtype_argument), help="default: bfloat16,float32 (metal), bfloat16 (cuda)")
    parser.add_argument("--kernels", type=_list(str, planner.KERNELS), default=planner.KERNELS,
                        help=f"comma-separated, of {','.join(planner.KERNELS)} (default: all)")
    parser.add_argument("--masks", type=_list(str, tune.MASKS),
                        help="masks each candidate is timed on (one row serves all; default none,causal; --quick: none)")
    parser.add_argument("--quick", action="store_true", help="fewer candidates, head dims and repetitions")
    parser.add_argument("--budget-s", type=_positive_seconds, default=None,
                        help="stop trying candidates after this many seconds (default 900, --quick 180)")
    parser.add_argument("--max-candidates", type=positive_int, help="at most this many candidates per point")
    parser.add_argument("--seq-len", type=positive_int, help="N of the timed problem")
    parser.add_argument("--batch", type=positive_int, help="B of the timed problem")
    parser.add_argument("--heads", type=positive_int, help="H of the timed problem")
    parser.add_argument("--back-to-back", type=positive_int,
                        help="calls per timed sample, issued back to back and waited for once "
                             "(default 8 on CUDA, 1 on Metal)")
    parser.add_argument("--out-dir", type=Path, help="write the table here instead of the cache directory "
                                                     "(the planner reads only the cache directory)")
    parser.add_argument("--update", action="store_true",
                        help="start from this GPU's tuned table (keep its rows and notes) instead of the shipped one")
    parser.add_argument("--no-ab", action="store_true",
                        help="skip the closing A/B (whole forward + backward, shipped vs tuned table, interleaved)")
    parser.set_defaults(run=run_tune)
    return parser


def default_target() -> str:
    from .backends import metal_simulated

    if metal_simulated() or mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    raise ValueError("no GPU backend here: pass --backend (metal with MLX_FLASH_METAL_SIM=1 runs the simulator)")


def points(args, space, table: planner.Table, target: str) -> List[tune.Point]:
    """The points to tune: kernels x dtypes x head dims (default: the rows' max_d)."""
    dtypes = args.dtypes or DEFAULT_DTYPES[target]
    masks = args.masks or (("none",) if args.quick else tune.MASKS)
    result = []
    for kernel in args.kernels:
        for dtype in dtypes:
            if args.head_dims:
                dims = args.head_dims
            elif args.quick:
                dims = QUICK_HEAD_DIMS
            else:
                precision = planner.precision_of(bm.DTYPES[dtype])
                rows = planner.group_rows(table, kernel, precision, space.row_family(kernel, 64))
                dims = sorted({min(r.max_head_dim, MAX_DEFAULT_HEAD_DIM) for r in rows})
            result += [tune.Point(kernel, d, dtype, tuple(masks)) for d in dims]
    return result


def run_tune(args) -> int:
    """Tune, print each point's verdict and A/B, write the table; 2 on a bad argument."""
    from tqdm import tqdm

    from .backends import metal_simulated
    from .tune_spaces import space_for

    try:
        target = args.backend or default_target()
        space = space_for(target)
    except ValueError as error:
        print(f"python -m mlx_flash tune: {error}", file=sys.stderr)
        return 2
    family = space.family()
    table = planner.shipped_table(target)
    kept_notes = ()
    if args.update:
        previous = tuned.table_for(target, family)
        if previous is not None:
            table = previous
            kept_notes = tuple(line[2:] for line in Path(previous.origin).read_text().splitlines()
                               if line.startswith("# measured:"))
    todo = points(args, space, table, target)
    simulated = target == "metal" and metal_simulated()
    problem = PROBLEMS["metalsim" if simulated else f"{target}_quick" if args.quick else target]
    problem = tune.Problem(args.batch or problem.batch, args.heads or problem.heads, args.seq_len or problem.length,
                           args.back_to_back or problem.back_to_back)
    settings = SETTINGS["quick" if args.quick else "full"]
    budget = args.budget_s if args.budget_s is not None else (180.0 if args.quick else 900.0)
    started = time.monotonic()
    deadline = started + budget
    device, architecture = tuned.device_identity(target)
    print(f"tuning {target} family {family} on {device} ({architecture}): {len(todo)} points, "
          f"problem B={problem.batch} H={problem.heads} N={problem.length}, {problem.back_to_back} call(s) back to "
          f"back per sample, budget {budget:.0f} s")
    outcomes = []
    with tqdm(total=len(todo), unit="point", file=sys.stderr, dynamic_ncols=True) as bar:
        for point in todo:
            bar.set_description(point.label())
            if time.monotonic() > deadline:
                outcomes.append(_unreached(table, space, point))
                bar.update(1)
                continue
            outcome = tune.tune_point(space, table, point, problem, settings, quick=args.quick,
                                      max_candidates=args.max_candidates, deadline=deadline,
                                      progress=lambda key: bar.set_postfix_str(tune.row_label(key), refresh=False))
            outcomes.append(outcome)
            bar.update(1)
            tqdm.write(describe(outcome), file=sys.stdout)
    result = tune.apply(table, outcomes, "tuned")
    path = tuned.write(target, family, result, kept_notes + tune.notes(outcomes, problem, settings), args.out_dir)
    if not args.no_ab:
        for line in closing_ab(space, planner.shipped_table(target), result, outcomes, problem, settings):
            print(line)
    moved = sum(o.best != o.base for o in outcomes)
    print(f"{moved} of {len(outcomes)} points moved from the shipped table in {time.monotonic() - started:.0f} s; "
          f"table written to {path}")
    if args.out_dir is None:
        print("the planner uses it from now on (MLX_FLASH_TUNED=0 ignores it); see it with "
              f"`python -m mlx_flash plan --backend {target} --head-dim {todo[0].head_dim if todo else 64}`")
    return 0


def closing_ab(space, shipped: planner.Table, result: planner.Table, outcomes, problem, settings):
    """Lines of the whole-call A/B (forward + backward, shipped vs tuned, interleaved medians) for
    every (head dim, dtype, mask) where a row moved."""
    moved = dict.fromkeys((o.point.head_dim, o.point.dtype, mask) for o in outcomes if o.best != o.base
                          for mask in o.point.masks)
    for head_dim, dtype, mask in moved:
        try:
            medians = tune.ab_whole_call(space, {"shipped": shipped, "tuned": result}, head_dim, dtype, mask,
                                         problem, settings)
        except Exception as error:  # report it; the table stays written (each row passed its own A/B)
            yield f"A/B fwd+bwd D={head_dim} {dtype} {mask}: failed ({type(error).__name__}: {error})"
            continue
        yield (f"A/B fwd+bwd D={head_dim} {dtype} {mask} B={problem.batch} H={problem.heads} N={problem.length}: "
               f"shipped {bm.format_ms(medians['shipped'])} ms, tuned {bm.format_ms(medians['tuned'])} ms "
               f"({medians['tuned'] / medians['shipped']:.3f}x)")


def _unreached(table, space, point) -> tune.Outcome:
    precision = planner.precision_of(bm.DTYPES[point.dtype])
    family = space.row_family(point.kernel, point.head_dim)
    base = planner.find_row(table, point.kernel, point.head_dim, precision, family)
    return tune.Outcome(point, base, base, skipped="not reached: time budget spent")


def describe(outcome: tune.Outcome) -> str:
    """One point's verdict, its A/B (shipped vs tuned medians per mask) and its rejected candidates."""
    head = f"{outcome.point.label()}: "
    if outcome.skipped:
        text = head + f"kept {tune.row_label(outcome.base)} ({outcome.skipped})"
    elif outcome.best != outcome.base:
        text = head + (f"{tune.row_label(outcome.best)} replaces {tune.row_label(outcome.base)}, "
                       f"{outcome.ratio:.3f}x its time")
    else:
        fastest = min((r for r in outcome.timings if r != outcome.base), key=outcome.timings.get, default=None)
        runner = f"; fastest other {tune.row_label(fastest)} {outcome.timings[fastest]:.3f}x" if fastest else ""
        text = head + f"kept {tune.row_label(outcome.base)}{runner}"
    for mask, (base_ms, best_ms) in outcome.ab.items():
        text += (f"\n    A/B {mask}: the table's row {bm.format_ms(base_ms)} ms, the candidate {bm.format_ms(best_ms)} ms "
                 f"({best_ms / base_ms:.3f}x)")
    text += f"\n    {len(outcome.timings)} timed, {len(outcome.rejected)} rejected"
    others = sorted((r for r in outcome.timings if r != outcome.base), key=outcome.timings.get)
    if others:  # every timed candidate, fastest first: the geometric mean over masks of its time / the row's
        text += "\n    timed against the table's row: " + ", ".join(
            f"{tune.row_label(r)} {outcome.timings[r]:.3f}x" for r in others)
    for row, reason in outcome.rejected.items():
        text += f"\n    rejected {tune.row_label(row)}: {reason}"
    return text

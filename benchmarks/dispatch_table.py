"""Write kernels/dispatch_cuda.txt's rows for one GPU family from a recorded bench.py JSON.

    python3 benchmarks/dispatch_table.py RUN/a.json [RUN/b.json ...]   # one GPU's runs; family from its GPU
    python3 benchmarks/dispatch_table.py results/h200_dispatch.json     # a file may hold several runs
    python3 benchmarks/dispatch_table.py RUN/a.json --print             # show, write nothing
    python3 benchmarks/dispatch_table.py RUN/a.json --markdown          # the ratios and verdicts (RESULTS.md)
    python3 benchmarks/dispatch_table.py                                   # rewrite the header only

The recording: two runs per dtype (no mask and causal; the array masks), each bounded to under
4 minutes (--time-budget-s: cases not started in time are listed as skipped and route nothing;
on an H200 no case was cut, the four runs took 7 minutes). `--backend cuda` so the
"mlx-flash" rows time our kernels: bench.py passes the backend by name, and an explicitly named
backend is never routed (a routed or fallen-back row would not count as measured anyway).
`--compiled` (required): both sides run as mx.compile'd functions, as a compiled training step
runs attention, so the table compares the GPU work and MLX's launches, not Python's per-call
graph building. Timed call by call, synchronized, that building decided the routing: our ~0.2-0.5
ms per call against mx.fast's ~0.02-0.09 made our causal forward look 1.4-2.0x slower up to
N=4096, where compiled it is 1.02-1.33x faster than cuDNN's from N=2048 (H100, bf16 / fp16).

    for dtype in bf16 fp16; do
      common="--backend cuda --impls mlx-flash mx.fast --dtypes $dtype --head-dims 64 128 \
        --seq-lens 1024 2048 4096 8192 16384 --heads 16 --kv-heads 16 4 --batch 1 \
        --passes forward forward_backward --compiled --warm-up-clocks-s 0.5 --warmup 2 \
        --min-repeats 5 --max-repeats 10 --target-seconds 0.2 --no-plots --out $OUT"
      python3 benchmarks/bench.py $common --masks none causal --time-budget-s 235 --name dispatch_h200_$dtype
      python3 benchmarks/bench.py $common --masks bool additive --time-budget-s 230 \
        --name dispatch_masks_h200_$dtype
    done
    python3 benchmarks/dispatch_table.py $OUT/dispatch_h200_bf16.json $OUT/dispatch_h200_fp16.json \
        $OUT/dispatch_masks_h200_bf16.json $OUT/dispatch_masks_h200_fp16.json

The runs behind one table are kept in one file: a JSON list of bench.py JSONs
(the H100's earlier recording, h100_dispatch.json), or a dict holding that list as "recording"
beside other measurements of the table (benchmarks/results/h200_dispatch.json); the tool reads
every form. A family's rows are all replaced by the runs given, so give every run
of the family's table at once.

The rule (a call does not know whether a backward follows, so both passes count, and the
choice is the one whose worse pass loses less to the other side's):
- a measured point is (dtype, head dim, head layout class, mask, N) with Nq = Nk = N, the
  class "mha" (as many kv heads as query heads) or "gqa" (fewer); it routes only when, for
  every head layout and batch of its class measured at that point, with r = mx.fast's median /
  ours in each of the forward and the forward+backward pass:
  - min(r) < 1 - margin: mx.fast is faster by more than the margin in at least one pass (a tie
    within the margin in one pass does not keep a clear loss in the other: with compiled calls
    our forward at D = 128 without a mask ties cuDNN's, 0.90-1.06x, while its forward+backward is
    0.68-0.89x), and
  - max(r) < 1 / min(r): routed, the call's worse pass takes max(r) x our time, which is less
    than the 1 / min(r) x mx.fast's time ours takes in its worse pass. So a clear win in one pass
    beside a tie in the other routes, and so does a larger win beside a smaller loss: bf16 D = 128
    MHA without a mask at N = 4096 (H200) has our forward 0.93x cuDNN's time and our
    forward+backward 1.11x, so it routes, and training there runs at MLX's speed instead of 11 %
    below it, while a forward-only call takes 1.075x our time (never more than MLX's); our
    forward at 0.66x beside a forward+backward at 1.15x stays ours;
  MLX runs it through cuDNN (mlx_flash.backends.fast.cudnn_fuses), and our row ran our kernels
  (backend "cuda", no fallback);
- a point with a missing, skipped or failed row does not route, nor one where a head layout
  measured at other N of its (dtype, head dim, class, mask) is missing;
- adjacent routed points (in the measured N order) merge into one range [min_n, max_n]: a call
  routes only inside such a range, never between a routed and a not-routed point, never past
  the largest measured N.
Other families' rows and recorded-run lines are kept as they are.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections import defaultdict
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


from mlx_flash.backends import dispatch  # noqa: E402
from mlx_flash.backends.dispatch import DispatchRow, format_dispatch_row, parse_dispatch  # noqa: E402
from mlx_flash.backends.fast import cudnn_fuses  # noqa: E402
from mlx_flash.spec import AttentionSpec  # noqa: E402

TABLE = ROOT / "kernels" / dispatch.TABLE_NAME
DEFAULT_MARGIN = 0.05
PASSES = ("forward", "forward_backward")
RECORDED = "# recorded "  # "# recorded <family>: ..." lines name the run each family's rows come from

HEADER = """\
# Dispatch table for backend="auto" on CUDA: where MLX's mx.fast.scaled_dot_product_attention
# (cuDNN) was measured faster than the "cuda" backend's kernels, the call is routed there
# (counted in mlx_flash.route_counts(), never warned: a choice, not a fallback). backend="cuda"
# always runs our kernels. Written by benchmarks/dispatch_table.py from a recorded
# benchmarks/bench.py JSON, never by hand; a family without rows routes nothing.
# A call routes only if mx.fast serves it exactly (no window, softcap, sinks, lse or shifted
# diagonal: mlx_flash/backends/fast.py), MLX runs it through cuDNN forward and backward
# (fp16 / bf16, D multiple of 8 up to 128, query rows a multiple of 128) and a row below covers
# its family, dtype, head dim (exactly), head layout (mha: as many kv heads as query heads; gqa:
# fewer), mask (none, causal, or an array mask of that kind shaped [1, 1, N, N]: bench.py's
# random mask, the only shape measured) and N: Nq = Nk = N, min_n <= N <= max_n (only square
# problems are measured).
# Timing: both sides as mx.compile'd calls (bench.py --compiled), as a compiled training step runs
# them; Python's per-call graph building is not in it (benchmarks/dispatch_table.py says why).
# Rule: every measured head layout of the row's class at that N had mx.fast's median below
# (1 - margin) x ours in the forward or the forward+backward pass, and mx.fast's time / ours in
# its worse pass below ours / mx.fast's in ours' worse pass (routed, the call loses less in its
# worse pass than ours would: benchmarks/dispatch_table.py says why);
# adjacent such N merge into a range;
# nothing routes outside a measured range. forward / fwd_bwd: the range's largest mx.fast / ours
# median-time ratio (lower = mx.fast faster).
# Columns (each followed by at least one space; mlx_flash/backends/dispatch.py parses them):
# family   dtype     head_dim heads mask     min_n  max_n  forward fwd_bwd
"""


Point = Tuple[str, int, str, str, int]  # (dtype, head dim, head layout class, mask, N)


def point_of(row: Dict) -> Point:
    mask = "causal" if row["causal"] else row.get("array_mask", "none")
    return (row["dtype"], row["head_dim"], dispatch.heads_of(row["q_heads"], row["kv_heads"]), mask, row["q_len"])


def decide(rows: Iterable[Dict], margin: float = DEFAULT_MARGIN) -> Dict[Point, Optional[Tuple[float, float]]]:
    """Per measured point (dtype, head dim, head layout class, mask, N): (forward, fwd+bwd) worst
    mx.fast / ours ratios over the class's layouts where the point routes, else None.

    Args:
        rows: bench.py's JSON rows.
        margin: mx.fast must be faster by more than this fraction in at least one pass; its loss in
            the other pass (if any) must be smaller than ours in the first (the module docstring).
    """
    # point -> layout (batch, q_heads, kv_heads) -> (implementation, pass) -> median ms (None: unusable)
    table: Dict = defaultdict(lambda: defaultdict(dict))
    for row in rows:
        if row.get("implementation") not in ("mlx-flash", "mx.fast") or row.get("pass") not in PASSES:
            continue
        if row.get("dtype") not in dispatch.DTYPES or row.get("q_len") != row.get("kv_len"):
            continue
        usable = row.get("status") == "ok" and isinstance(row.get("median_ms"), (int, float)) and row["median_ms"] > 0
        if row["implementation"] == "mlx-flash" and (row.get("backend") != "cuda" or row.get("fallbacks")):
            usable = False  # not our kernels: nothing to compare
        layout = (row["batch"], row["q_heads"], row["kv_heads"])
        table[point_of(row)][layout][row["implementation"], row["pass"]] = row["median_ms"] if usable else None
    # Every layout measured anywhere in a (dtype, head dim, class, mask) group must be measured at
    # each of its points: a run cut short by its time budget may have timed a layout at one N only.
    group_layouts = defaultdict(set)
    for point, layouts in table.items():
        group_layouts[point[:4]].update(layouts)
    verdicts = {}
    for point, layouts in table.items():
        for missing in group_layouts[point[:4]] - set(layouts):
            layouts[missing] = {}
        dtype, head_dim, _, mask, n = point
        array_mask = mask in ("bool", "additive")
        spec = AttentionSpec(batch=1, q_heads=1, kv_heads=1, q_len=n, kv_len=n, head_dim=head_dim, value_dim=head_dim,
                             dtype=dispatch.DTYPES[dtype], scale=1.0, causal=mask == "causal",
                             mask_kind=mask if array_mask else "none", mask_shape=(1, 1, n, n) if array_mask else None)
        worst = [0.0, 0.0]
        routes = cudnn_fuses(spec)
        for times in layouts.values():
            pairs = [(times.get(("mlx-flash", p)), times.get(("mx.fast", p))) for p in PASSES]
            if any(ours is None or theirs is None for ours, theirs in pairs):
                routes = False
                continue
            ratios = [theirs / ours for ours, theirs in pairs]  # mx.fast / ours: < 1, mx.fast faster
            # A clear win in one pass, and routing's worse pass loses less than ours' worse pass.
            routes = routes and min(ratios) < 1 - margin and max(ratios) * min(ratios) < 1
            worst = [max(w, r) for w, r in zip(worst, ratios)]
        verdicts[point] = tuple(worst) if routes else None
    return verdicts


def table_rows(family: str, verdicts: Dict) -> List[DispatchRow]:
    """The verdicts as ranges of adjacent routed N, one row each, sorted."""
    groups = defaultdict(list)
    for (dtype, head_dim, heads, mask, n), verdict in verdicts.items():
        groups[dtype, head_dim, heads, mask].append((n, verdict))
    result = []
    for (dtype, head_dim, heads, mask), points in sorted(groups.items()):
        run: List[Tuple[int, Tuple[float, float]]] = []
        for n, verdict in sorted(points) + [(None, None)]:  # a sentinel closes the last range
            if verdict is not None:
                run.append((n, verdict))
                continue
            if run:
                result.append(DispatchRow(family, dtype, head_dim, heads, mask, run[0][0],
                                          run[-1][0], max(v[0] for _, v in run), max(v[1] for _, v in run)))
            run = []
    return result


def family_of_run(environment: Dict) -> str:
    """The CUDA family the run measured: an MLX_FLASH_CUDA_CAPABILITY override, else the GPU's."""
    from mlx_flash.backends import cuda_source

    text = environment.get("cuda_capability_override") or environment.get("device_info", {}).get("architecture", "")
    digits = "".join(c for c in str(text) if c.isdigit())
    family = cuda_source.family_of(int(digits)) if digits else None
    if family is None:
        raise ValueError(f"cannot tell the CUDA family of the recorded run (architecture {text!r}); pass --family")
    return family.name


def recorded_line(family: str, payload: Dict, margin: float) -> str:
    env = payload.get("environment", {})
    commit = (env.get("git_commit") or "unknown")[:12] + (" +changes" if env.get("git_dirty") else "")
    command = "python3 benchmarks/bench.py " + shlex.join(payload.get("arguments", []))
    return (f"{RECORDED}{family}: {env.get('device_name')}, MLX {env.get('mlx_version')}, commit {commit}, "
            f"{env.get('date')}, margin {margin}, command: {command}")


def split_table(text: str) -> Tuple[Dict[str, List[str]], Tuple[DispatchRow, ...]]:
    """(recorded-run lines by family, rows) of an existing table."""
    recorded = defaultdict(list)
    for line in text.splitlines():
        if line.startswith(RECORDED):
            recorded[line[len(RECORDED):].split(":", 1)[0].strip()].append(line)
    return recorded, parse_dispatch(text)


def render(recorded: Dict[str, List[str]], rows: Iterable[DispatchRow]) -> str:
    """The whole table: header, then per family its recorded-run lines and rows."""
    by_family = defaultdict(list)
    for row in rows:
        by_family[row.family].append(row)
    lines = [HEADER.rstrip("\n")]
    for family in sorted(set(recorded) | set(by_family)):
        lines += [""] + recorded.get(family, [])
        lines += [format_dispatch_row(r) for r in sorted(by_family[family], key=lambda r: (
            r.dtype, r.head_dim, r.heads, r.mask, r.min_n))]
    return "\n".join(lines) + "\n"


def update(text: str, family: Optional[str], payloads: List[Dict], margin: float) -> str:
    """`text` (an existing table, or "") with `family`'s rows and recorded lines replaced by the
    verdicts of `payloads` (their rows together: e.g. a bf16 and an fp16 run of one GPU; none:
    only the header is rewritten)."""
    recorded, rows = split_table(text)
    if not payloads:
        return render(recorded, rows)
    new = table_rows(family, decide([row for p in payloads for row in p["rows"]], margin))
    recorded[family] = [recorded_line(family, p, margin) for p in payloads]
    return render(recorded, [r for r in rows if r.family != family] + new)


MASK_GROUPS = (("none", "causal"), ("additive", "bool"))


def markdown(rows: Iterable[Dict], margin: float = DEFAULT_MARGIN) -> str:
    """The recording as benchmarks/RESULTS.md shows it: per dtype and mask group ("none, causal";
    "additive, bool"), a row per (head dim, mask, N) with our time / mx.fast's per measured head
    layout (Hq/Hkv) and pass, and which side backend="auto" runs for each head-layout class there
    (decide's verdicts; "-": not measured)."""
    rows = [r for r in rows if r.get("status") == "ok" and r.get("q_len") == r.get("kv_len")
            and r.get("implementation") in ("mlx-flash", "mx.fast") and r.get("pass") in PASSES]
    verdicts = decide(rows, margin)
    times = {(point_of(r), (r["q_heads"], r["kv_heads"]), r["implementation"], r["pass"]): r["median_ms"]
             for r in rows}
    out = []
    for dtype in sorted({p[0] for p, *_ in times}):
        for group in MASK_GROUPS:
            in_group = [(p, lay) for p, lay, *_ in times if p[0] == dtype and p[3] in group]
            if not in_group:
                continue
            points = sorted({(p[1], p[3], p[4]) for p, _ in in_group}, key=lambda x: (x[0], group.index(x[1]), x[2]))
            layouts = sorted({lay for _, lay in in_group}, key=lambda lay: (lay[0] != lay[1], lay))
            classes = [c for c in dispatch.HEADS if any(dispatch.heads_of(*lay) == c for lay in layouts)]
            header = ["D", "mask", "N"] + [f"{name} {q}/{kv}" for q, kv in layouts for name in ("fwd", "fwd+bwd")]
            header.append(f"auto runs {' / '.join(c.upper() for c in classes)}")
            lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            for head_dim, mask, n in points:
                cells = [str(head_dim), mask, str(n)]
                for lay in layouts:
                    at = (dtype, head_dim, dispatch.heads_of(*lay), mask, n)
                    for pass_name in PASSES:
                        ours, theirs = (times.get((at, lay, impl, pass_name)) for impl in ("mlx-flash", "mx.fast"))
                        cells.append(f"{ours / theirs:.2f}" if ours and theirs else "-")
                verdict = [verdicts.get((dtype, head_dim, c, mask, n), "-") for c in classes]
                cells.append(" / ".join(v if v == "-" else "mx.fast" if v else "ours" for v in verdict))
                lines.append("| " + " | ".join(cells) + " |")
            out += [f"{dtype}, masks {', '.join(group)} (our time / mx.fast's):", ""] + lines + [""]
    return "\n".join(out)


def runs_of(data) -> List[Dict]:
    """The bench.py runs in one recorded file: a run (a dict with "rows"), a list of them (one
    published table's recordings kept together, as results/h100_dispatch.json), or a dict whose
    "recording" is that list beside other data about the table (results/h200_dispatch.json)."""
    if isinstance(data, dict) and "recording" in data:
        data = data["recording"]
    runs = data if isinstance(data, list) else [data]
    if not runs or not all(isinstance(r, dict) and "rows" in r for r in runs):
        raise ValueError("a recorded file must hold a bench.py JSON (a dict with 'rows'), a list of them, or a "
                         "dict with such a list as 'recording'")
    return runs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recorded", type=Path, nargs="*",
                        help="bench.py JSONs of one GPU (omit: rewrite the header only)")
    parser.add_argument("--family", help="CUDA family the rows are for (default: the recorded GPU's)")
    parser.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                        help="mx.fast must be faster than ours by more than this fraction in one pass (and lose "
                             "less in its worse pass than ours in its worse one) (default %(default)s)")
    parser.add_argument("--table", type=Path, default=TABLE, help="the table to update (default %(default)s)")
    parser.add_argument("--print", action="store_true", help="print the new table instead of writing it")
    parser.add_argument("--markdown", action="store_true",
                        help="print the recording's ratios and verdicts as RESULTS.md's tables; write nothing")
    args = parser.parse_args(argv)
    if not 0 <= args.margin < 1:
        parser.error(f"--margin must be in [0, 1), got {args.margin}")
    try:
        runs = [(path, payload) for path in args.recorded for payload in runs_of(json.loads(path.read_text()))]
    except ValueError as error:
        parser.error(str(error))
    payloads = [payload for _, payload in runs]
    family = args.family
    if family is not None:
        from mlx_flash.backends import cuda_source
        try:
            cuda_source.family_named(family)
        except ValueError as error:
            parser.error(f"--family: {error}")
    if payloads and family is None:
        try:
            families = {family_of_run(p.get("environment", {})) for p in payloads}
        except ValueError as error:
            parser.error(str(error))
        if len(families) != 1:
            parser.error(f"the recorded runs are of different CUDA families {sorted(families)}: one family at a time")
        family = families.pop()
    if args.markdown:
        if not payloads:
            parser.error("--markdown needs the recorded runs")
        print(markdown([row for p in payloads for row in p["rows"]], args.margin))
        return 0
    uncompiled = [str(path) for path, p in runs if not p.get("environment", {}).get("mlx_compiled")]
    if uncompiled:
        parser.error(f"{', '.join(uncompiled)}: not recorded with bench.py --compiled (the table compares "
                     f"compiled calls; see this tool's docstring)")
    if any(p.get("environment", {}).get("device_type") != "gpu" for p in payloads):
        print("warning: a recorded run was not on a GPU", file=sys.stderr)
    text = update(args.table.read_text() if args.table.exists() else "", family, payloads, args.margin)
    parse_dispatch(text, str(args.table))  # what is written must parse
    if args.print:
        print(text, end="")
    else:
        args.table.write_text(text)
        print(f"wrote {args.table}" + (f" ({family})" if family else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Block sizes chosen by measurement on the user's GPU: the engine behind `python -m mlx_flash tune`
and MLX_FLASH_AUTOTUNE=1, shared by the Metal and CUDA backends.

For one point (kernel, head dim, dtype, masks) of the device's block table:
1. candidates: the table's row, then rows one knob away from it in the backend's space
   (tune_spaces.py: P / T / H / cached operands for Metal, P / T / H / warps / options for CUDA),
   and outside --quick a second round one knob away from the first round's fastest; each
   candidate is a planner.Table value handed to a backend object (never module state);
2. gate: every candidate runs on a small problem with partial blocks and is compared with the
   float64 reference (mlx_flash/reference.py) at the dtype's tolerance BEFORE it is timed; one
   that fails to build, run or match is rejected, so a fast wrong candidate can never win;
3. time: the survivors and the table's row, interleaved, with mlx_flash/benchmark.py's harness
   (warm-up, round-robin repetitions, medians) on each mask; a candidate's score is the geometric
   mean over masks of its median / the table row's median;
4. confirm: the best candidate, if it beats the row by more than MIN_GAIN, is timed again
   against the table's row in a fresh interleaved A/B; it replaces the row only if it still wins.
The tuned rows then go into a per-device table (tuned.write) that the planner reads.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from . import benchmark as bm, planner, reference
from .spec import AttentionSpec

# A candidate must beat the table's row by this much in the timed round to be confirmed at all:
# below it the difference is within the run-to-run spread of interleaved medians.
MIN_GAIN = 0.03
# The correctness gate's problem: several parallel and traversal blocks, partial last blocks and
# (Nq != Nk) an off-centre causal diagonal, as the first-contact guard's probe.
GATE_QUERIES = 67
GATE_KEYS = 83
MASKS = ("none", "causal")
# Rounds of one-knob moves outside --quick: each starts from the fastest row of the round before.
ROUNDS = 2


@dataclass(frozen=True)
class Point:
    """One thing to tune: a kernel at a head dim and dtype, over some masks.

    Attributes:
        kernel: one of planner.KERNELS.
        head_dim: D the candidates are measured at (the tuned row serves D and the smaller head
            dims of the row it splits).
        dtype: "float32", "float16" or "bfloat16".
        masks: of MASKS; the table has no mask column, so one row must serve them all.
    """

    kernel: str
    head_dim: int
    dtype: str
    masks: Tuple[str, ...] = ("none",)

    def label(self) -> str:
        return f"{self.kernel} D={self.head_dim} {self.dtype} {','.join(self.masks)}"


@dataclass(frozen=True)
class Problem:
    """The timed problem: its sizes (B, H, N) and how calls are issued.

    back_to_back: calls per timed sample, issued one after another and waited for once
    (benchmark.Call); `calls_per_sample` says how many each target's problems take.
    """

    batch: int
    heads: int
    length: int
    back_to_back: int = 1


def calls_per_sample(target: str) -> int:
    """Problem.back_to_back for `target`'s problems (the tune command's and the autotuner's).

    CUDA: 8 calls back to back, as a training step issues them. One call waited for at a time adds
    the host's launch and wait to every sample, and on an H200 (B=4 H=16 N=4096, D=64) a forward
    that timed 0.860x the table's row that way was 1.014x its time back to back
    (benchmarks/RESULTS.md, "The tuner on the H200"). Metal: one call (not measured on an Apple GPU).
    """
    return 8 if target == "cuda" else 1


@dataclass
class Outcome:
    """What tuning one point found.

    Attributes:
        point: what was tuned. base: the table's row that served it. best: the row chosen (base
        when nothing beat it). ratio: best's confirmed time / base's (1.0 when base kept).
        timings: row -> geometric-mean ratio to base in the timed round. rejected: row -> why.
        ab: the confirming A/B, mask -> (base median ms, best median ms); empty if none ran.
    """

    point: Point
    base: planner.Row
    best: planner.Row
    ratio: float = 1.0
    timings: Dict[planner.Row, float] = dataclasses.field(default_factory=dict)
    rejected: Dict[planner.Row, str] = dataclasses.field(default_factory=dict)
    ab: Dict[str, Tuple[float, float]] = dataclasses.field(default_factory=dict)
    skipped: str = ""


def row_label(row: planner.Row) -> str:
    cached = ",".join(sorted(row.cached)) or "-"
    warps = "" if row.warps is None else f" w{row.warps}"
    return f"P={row.parallel_block} T={row.traversal_block} H={row.head_block} {cached}{warps}"


def with_row(table: planner.Table, row: planner.Row, head_dim: int, origin: str) -> planner.Table:
    """`table` where `row`'s group serves head dims up to `head_dim` that the old covering row served
    with `row` (max_d = head_dim): the old row is replaced where its max_d is head_dim, else split."""
    group = planner.group_rows(table, row.kernel, row.precision, row.family)
    placed = dataclasses.replace(row, max_head_dim=head_dim)
    kept = tuple(r for r in group if r.max_head_dim != head_dim)
    return table.replace_rows(row.family, row.kernel, row.precision, kept + (placed,), origin)


def spec_for(point: Point, mask: str, q_len: int, kv_len: int, batch: int = 1, heads: int = 1) -> AttentionSpec:
    D = point.head_dim
    return AttentionSpec(batch=batch, q_heads=heads, kv_heads=heads, q_len=q_len, kv_len=kv_len, head_dim=D,
                         value_dim=D, dtype=bm.DTYPES[point.dtype], scale=1.0 / math.sqrt(D),
                         causal=mask == "causal", window=None, mask_kind="none", mask_shape=None)


def _inputs(spec: AttentionSpec, seed: int):
    rng = np.random.default_rng(seed)
    shape = (spec.batch, spec.q_heads, spec.q_len, spec.head_dim)
    kv_shape = (spec.batch, spec.kv_heads, spec.kv_len, spec.head_dim)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in (shape, kv_shape, kv_shape, shape)]
    return [mx.array(a).astype(spec.dtype) for a in arrays]


class Job:
    """One kernel's call on one problem; the backward kernels get out and lse as inputs.

    Args:
        kernel: one of planner.KERNELS.
        spec: the problem.
        seed: of the random inputs.
        checked: compute out and lse with the float64 reference (the gate, small problems) so that
            `check` can compare; otherwise with the "mlx" backend (timed problems, any size).
    """

    def __init__(self, kernel: str, spec: AttentionSpec, seed: int = 0, checked: bool = True):
        self.kernel, self.spec = kernel, spec
        self.q, self.k, self.v, self.d_out = _inputs(spec, seed)
        if checked:
            self._as64 = [np.asarray(a.astype(mx.float32), dtype=np.float64)
                          for a in (self.q, self.k, self.v, self.d_out)]
            out, lse = reference.attention_forward(*self._as64[:3], spec)
            self.out = mx.array(out.astype(np.float32)).astype(spec.dtype)
            self.lse = mx.array(lse.astype(np.float32))
        else:
            from .backends import get_backend

            self.out, self.lse = get_backend("mlx").forward(self.q, self.k, self.v, None, spec)
        mx.eval(self.q, self.k, self.v, self.d_out, self.out, self.lse)

    def run(self, backend):
        """The kernel's outputs (lazy) on `backend`."""
        args = (self.q, self.k, self.v, None)
        if self.kernel == "forward":
            return backend.forward(*args, self.spec)
        rest = (self.out, self.lse, self.d_out, None, self.spec)
        if self.kernel == "backward_query":
            return (backend.backward_query(*args, *rest),)
        return tuple(backend.backward_key_value(*args, *rest))

    def check(self, results) -> Optional[str]:
        """None when `results` match the float64 reference at the dtype's tolerance, else why not."""
        q, k, v, d_out = self._as64  # AttributeError for a Job made with checked=False
        spec = self.spec
        if self.kernel == "forward":
            want = reference.attention_forward(q, k, v, spec)
            names, limit = ("out", "lse"), reference.FORWARD_TOLERANCE
        else:
            dq, dk, dv = reference.attention_backward(q, k, v, d_out, spec)
            if self.kernel == "backward_query":
                want, names = (dq,), ("dq",)
            else:
                want, names = (dk, dv), ("dk", "dv")
            limit = reference.GRADIENT_TOLERANCE
        dtype = bm.dtype_name(str(spec.dtype).split(".")[-1])
        for name, got, ref in zip(names, results, want):
            error = reference.relative_error(np.asarray(got.astype(mx.float32), dtype=np.float64), ref)
            if not error <= limit[dtype]:
                return f"{name} relative error {error:.3g} > {limit[dtype]:g} ({dtype}) against the float64 reference"
        return None


def gate(space, table: planner.Table, point: Point, row: planner.Row) -> Optional[str]:
    """None when the candidate `table` computes `point`'s kernel correctly on every mask, else why
    not: on GATE_QUERIES x GATE_KEYS and on the longer key counts the space names for `row`, the
    candidate's row for the point (a forward row's T for long walks, which short calls never meet)."""
    backend = space.backend(table)
    lengths = (GATE_KEYS, *space.gate_keys(row))
    for keys in lengths:
        for mask in point.masks:
            job = Job(point.kernel, spec_for(point, mask, GATE_QUERIES, keys, heads=2), seed=1)
            try:
                results = job.run(backend)
                mx.eval(results)
            except Exception as error:  # the compiler's or the launcher's message
                return f"failed to build or run: {type(error).__name__}: {' '.join(str(error).split())[:200]}"
            reason = job.check(results)
            if reason is not None:
                return f"{mask}{'' if keys == GATE_KEYS else f' at {keys} keys'}: {reason}"
    return None


def time_tables(space, tables: Dict[planner.Row, planner.Table], point: Point, problem: Problem,
                settings: bm.Settings, progress: Callable[[object], None] = lambda key: None,
                failures: Optional[Dict[planner.Row, str]] = None) -> Dict[str, Dict[planner.Row, float]]:
    """Median seconds of `point`'s kernel under each table, per mask, timed interleaved; a call
    that raises on the timed problem (e.g. out of memory) is left out and its error put in
    `failures`."""
    medians: Dict[str, Dict[planner.Row, float]] = {}
    for mask in point.masks:
        job = Job(point.kernel, spec_for(point, mask, problem.length, problem.length, problem.batch,
                                         problem.heads), checked=False)
        backends = {row: space.backend(table) for row, table in tables.items()}
        calls = {row: bm.Call(run=lambda _, b=backend: job.run(b), back_to_back=problem.back_to_back)
                 for row, backend in backends.items()}
        errors: Dict[planner.Row, str] = {}
        timings = bm.time_calls(calls, warmup=settings.warmup, min_repeats=settings.min_repeats,
                                max_repeats=settings.max_repeats, target_seconds=settings.target_seconds,
                                errors=errors, progress=progress)
        medians[mask] = {row: timing.median for row, timing in timings.items()}
        if failures is not None:
            failures.update({row: f"{mask}: failed on the timed problem: {error}" for row, error in errors.items()})
    return medians


def geomean_ratio(medians: Dict[str, Dict[planner.Row, float]], row: planner.Row, base: planner.Row) -> float:
    ratios = [m[row] / m[base] for m in medians.values() if row in m and base in m]
    if len(ratios) != len(medians):
        return math.inf
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


def tune_point(space, table: planner.Table, point: Point, problem: Problem, settings: bm.Settings,
               quick: bool = False, max_candidates: Optional[int] = None, deadline: float = math.inf,
               progress: Callable[[object], None] = lambda key: None,
               extra_candidates: Sequence[planner.Row] = (), rounds: Optional[int] = None) -> Outcome:
    """Tune one point of `table` (see the module docstring).

    Args:
        space: the backend's candidate space (tune_spaces.space_for).
        table: the table the candidates are made around (its row for the point is the baseline).
        point, problem, settings: what to tune, the timed problem, the harness's repetitions.
        quick: the space's small neighbourhood, one round.
        max_candidates: at most this many new candidates per round.
        deadline: time.monotonic() after which no more candidates are gated or timed.
        progress: called once per gated candidate and per timed call.
        extra_candidates: rows tried in the first round besides the space's (tests plant wrong ones).
        rounds: rounds of one-knob moves, each around the fastest row so far, until none wins;
            default 1 with quick, else ROUNDS.
    """
    family = space.row_family(point.kernel, point.head_dim)
    precision = planner.precision_of(bm.DTYPES[point.dtype])
    base = planner.find_row(table, point.kernel, point.head_dim, precision, family)
    outcome = Outcome(point, base, base)
    origin = "candidate"
    tables = {base: with_row(table, base, point.head_dim, origin)}
    reason = gate(space, tables[base], point, base)
    progress(base)
    if reason is not None:
        outcome.skipped = f"the table's own row fails the gate ({reason}); nothing tuned"
        return outcome
    center, extra = base, list(extra_candidates)
    for _ in range(rounds or (1 if quick else ROUNDS)):
        fresh = [r for r in dict.fromkeys(extra + space.candidates(center, point.head_dim, quick,
                                                                          problem.length))
                 if r not in tables and r not in outcome.rejected]
        extra = []
        passed = {}
        for row in fresh[:max_candidates]:
            if time.monotonic() > deadline:
                outcome.rejected[row] = "not tried: time budget spent"
                continue
            candidate = with_row(table, row, point.head_dim, origin)
            reason = space.invalid_reason(candidate, point) or gate(space, candidate, point, row)
            progress(row)
            if reason is not None:
                outcome.rejected[row] = reason
            else:
                passed[row] = candidate
        if not passed or time.monotonic() > deadline:
            break
        tables.update(passed)
        timed = {row: tables[row] for row in dict.fromkeys([base, center, *passed])}
        medians = time_tables(space, timed, point, problem, settings, progress, outcome.rejected)
        if base in outcome.rejected:
            outcome.skipped = f"the table's own row failed on the timed problem ({outcome.rejected[base]})"
            return outcome
        ratios = {row: geomean_ratio(medians, row, base) for row in timed if row not in outcome.rejected}
        outcome.timings.update({row: ratio for row, ratio in ratios.items() if row not in (base, center)})
        outcome.timings.setdefault(base, 1.0)
        fastest = min(ratios, key=ratios.get)
        if fastest == center:
            break
        center = fastest
    best = min(outcome.timings, key=outcome.timings.get, default=base)
    if best == base or outcome.timings[best] > 1.0 - MIN_GAIN or time.monotonic() > deadline:
        return outcome
    confirm = time_tables(space, {base: tables[base], best: tables[best]}, point, problem, settings, progress)
    ratio = geomean_ratio(confirm, best, base)
    outcome.ab = {mask: (m[base] * 1e3, m[best] * 1e3) for mask, m in confirm.items() if base in m and best in m}
    if ratio < 1.0:
        outcome.best, outcome.ratio = best, ratio
    return outcome


def ab_whole_call(space, tables: Dict[str, planner.Table], head_dim: int, dtype: str, mask: str,
                  problem: Problem, settings: bm.Settings) -> Dict[str, float]:
    """Median ms of a whole forward + backward (the three kernels and the backward's preparation)
    under each named table, timed interleaved: the shipped against the tuned table."""
    spec = spec_for(Point("forward", head_dim, dtype), mask, problem.length, problem.length, problem.batch,
                    problem.heads)
    q, k, v, d_out = _inputs(spec, 2)
    mx.eval(q, k, v, d_out)

    def call(backend):
        def run(_):
            out, lse = backend.forward(q, k, v, None, spec)
            return (out,) + tuple(backend.backward(q, k, v, None, out, lse, d_out, None, spec)[:3])
        return bm.Call(run=run, back_to_back=problem.back_to_back)

    calls = {name: call(space.backend(table)) for name, table in tables.items()}
    timings = bm.time_calls(calls, warmup=settings.warmup, min_repeats=settings.min_repeats,
                            max_repeats=settings.max_repeats, target_seconds=settings.target_seconds)
    return {name: timing.median * 1e3 for name, timing in timings.items()}


def apply(table: planner.Table, outcomes: Sequence[Outcome], origin: str) -> planner.Table:
    """`table` with every outcome's chosen row placed at its head dim."""
    for outcome in outcomes:
        if outcome.best != outcome.base:
            table = with_row(table, outcome.best, outcome.point.head_dim, origin)
    return table


def notes(outcomes: Sequence[Outcome], problem: Problem, settings: bm.Settings) -> Tuple[str, ...]:
    """The comment lines a tuned table carries: the problem and, per point, what was measured."""
    lines = [f"problem: B={problem.batch} H={problem.heads} N={problem.length}, {problem.back_to_back} call(s) "
             f"back to back per sample; harness: warm-up {settings.warmup}, "
             f"{settings.min_repeats}-{settings.max_repeats} interleaved repetitions, medians"]
    for o in outcomes:
        verdict = (f"{row_label(o.best)} replaces {row_label(o.base)}: {o.ratio:.3f}x its time in the A/B"
                   if o.best != o.base else f"kept {row_label(o.base)}{' (' + o.skipped + ')' if o.skipped else ''}")
        lines.append(f"measured: {o.point.kernel} {o.point.dtype} D={o.point.head_dim} "
                     f"masks={','.join(o.point.masks)}: {verdict}; {len(o.timings)} timed, {len(o.rejected)} rejected")
    return tuple(lines)


def measured_points(text: str) -> Tuple[Tuple[str, str, int], ...]:
    """(kernel, dtype, head dim) of each `measured:` note of a tuned table's text."""
    import re

    found = re.findall(r"#\s*measured:\s*(\w+)\s+(\w+)\s+D=(\d+)", text)
    return tuple((kernel, dtype, int(d)) for kernel, dtype, d in found)

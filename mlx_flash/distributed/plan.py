"""Which attention calls one ring step makes: a (query shard, visiting key shard) pair.

Both shards are lists of segments of the global sequence (layout.py). A pair of segments
(query segment at global gq, key segment at global gk) sees the global causal / window band,
which in the pair's own coordinates is the band with diagonal

    diag = gq - gk + (Nk_global - Nq_global)      (query i's own key is i + diag)

so each pair is one backend call with `AttentionSpec.diagonal_shift = diag - (Lk - Lq)`, or no
call at all when no query of it sees any key, or a call without band when every query sees every
key. Fewer, larger calls are better for the kernels, so the planner also tries rectangles that
span several segments (the whole shards; one query segment against the whole key shard; the whole
query shard against one key segment): a rectangle is one call when, restricted to each segment
pair inside it, its band with one diagonal D equals the pair's global band. For contiguous
shards that is always one call; for zigzag it gives two calls per step (one on the home step).
Everything here is static Python on shapes: no array data is touched.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple

from ..spec import AttentionSpec
from .layout import Segment

FULL, EMPTY = "full", "empty"


@dataclasses.dataclass(frozen=True)
class Call:
    """One backend call: local query rows [q0, q1) against local key rows [k0, k1) under `spec`."""

    q0: int
    q1: int
    k0: int
    k1: int
    spec: AttentionSpec


def classify(base: AttentionSpec, q_len: int, kv_len: int, diag: int):
    """FULL, EMPTY or ("band", diag) for the band of `base` on a q_len x kv_len block."""
    if not base.has_band:
        return FULL
    spec = dataclasses.replace(base, q_len=q_len, kv_len=kv_len, diagonal_shift=diag - (kv_len - q_len))
    lo_first, _ = spec.key_range(0, 1)
    _, hi_last = spec.key_range(q_len - 1, q_len)
    if lo_first >= hi_last:
        return EMPTY  # consecutive rows' ranges slide by one key, so no row in between sees one
    lo_last, _ = spec.key_range(q_len - 1, q_len)
    _, hi_first = spec.key_range(0, 1)
    if lo_last <= 0 and hi_first >= kv_len:
        return FULL
    return ("band", diag)


def _rectangle(base: AttentionSpec, q_segs: Sequence[Segment], k_segs: Sequence[Segment],
               global_diag: int) -> Tuple[bool, Optional[Call]]:
    """(representable, call or None when empty) for the rectangle spanning q_segs x k_segs."""
    q0, q1 = q_segs[0][0], q_segs[-1][0] + q_segs[-1][2]
    k0, k1 = k_segs[0][0], k_segs[-1][0] + k_segs[-1][2]
    pairs = []
    for ql, qg, qn in q_segs:
        for kl, kg, kn in k_segs:
            pairs.append((ql - q0, kl - k0, qn, kn, classify(base, qn, kn, qg - kg + global_diag)))
    # Candidate rectangle diagonals: those that put one banded pair exactly where it belongs.
    candidates = {kd - qd + c[1] for qd, kd, _, _, c in pairs if isinstance(c, tuple)}
    if not candidates:
        kinds = {c for *_, c in pairs}
        if len(kinds) > 1:
            return False, None
        kind = kinds.pop()
        plain = dataclasses.replace(base, q_len=q1 - q0, kv_len=k1 - k0, causal=False, window=None)
        return True, (None if kind == EMPTY else Call(q0, q1, k0, k1, plain))
    for d in sorted(candidates):
        if all(classify(base, qn, kn, d + qd - kd) == c for qd, kd, qn, kn, c in pairs):
            whole = classify(base, q1 - q0, k1 - k0, d)
            if whole == EMPTY:
                return True, None
            if whole == FULL:
                spec = dataclasses.replace(base, q_len=q1 - q0, kv_len=k1 - k0, causal=False, window=None)
            else:
                spec = dataclasses.replace(base, q_len=q1 - q0, kv_len=k1 - k0,
                                           diagonal_shift=d - ((k1 - k0) - (q1 - q0)))
            return True, Call(q0, q1, k0, k1, spec)
    return False, None


def plan_pair(base: AttentionSpec, q_segs: Sequence[Segment], k_segs: Sequence[Segment],
              q_global: int, kv_global: int) -> Tuple[Call, ...]:
    """The calls for this rank's queries against one visiting key shard, fewest calls first.

    Args:
        base: the spec of the local call (scale, softcap, causal, window, dtype, heads...);
            its lengths and diagonal_shift are replaced per call.
        q_segs, k_segs: the segments of the query shard and of the visiting key shard.
        q_global, kv_global: the whole sequence lengths (Nq_global, Nk_global).
    """
    global_diag = kv_global - q_global
    options = [[(q_segs, k_segs)],
               [(q_segs, [k]) for k in k_segs],
               [([q], k_segs) for q in q_segs],
               [([q], [k]) for q in q_segs for k in k_segs]]
    best = None
    for option in options:
        calls, ok = [], True
        for qs, ks in option:
            representable, call = _rectangle(base, qs, ks, global_diag)
            if not representable:
                ok = False
                break
            if call is not None:
                calls.append(call)
        if ok and (best is None or len(calls) < len(best)):
            best = calls
    return tuple(best)


def split_keys(call: Call, size: int) -> Tuple[Call, ...]:
    """`call` as calls over consecutive key ranges of at most `size` keys (empty ranges dropped).

    Each piece keeps the call's band: its diagonal moves by the keys before it.
    """
    spec = call.spec
    if call.k1 - call.k0 <= size:
        return (call,)
    q_len, diag, pieces = call.q1 - call.q0, spec.diagonal, []
    for a in range(call.k0, call.k1, size):
        b = min(a + size, call.k1)
        kind = classify(spec, q_len, b - a, diag - (a - call.k0))
        if kind == EMPTY:
            continue
        if kind == FULL:
            piece = dataclasses.replace(spec, kv_len=b - a, causal=False, window=None, diagonal_shift=0)
        else:
            piece = dataclasses.replace(spec, kv_len=b - a, diagonal_shift=kind[1] - (b - a - q_len))
        pieces.append(Call(call.q0, call.q1, a, b, piece))
    return tuple(pieces)

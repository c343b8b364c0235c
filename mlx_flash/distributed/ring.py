"""The ring: forward and backward of attention over shards, passing K/V (and dK/dV) to the next rank.

Forward (n ranks, step t = 0 .. n-1): this rank holds the K/V shard of rank r - t, runs the
backend's forward on (local queries, visiting K/V) for the calls `plan.plan_pair` gives, and merges
the partial (out, lse) into its running result through lse (ALGORITHM.md, "Context parallelism").
Backward: with the global lse and out, each (local queries, visiting K/V) pair runs the backend's
own backward; dQ accumulates here, and the dK/dV accumulator of a shard travels with it, one hop
behind its K/V, and reaches home after the last step with one more hop. Accumulators are fp32.

Transport and its order. MLX's send / recv block until the peer's side runs, and a recv has no
inputs, so nothing in one lazy graph fixes the order of two recvs from one neighbour (two
same-shaped messages could even be swapped). So each step is evaluated on its own, with exactly
one message per neighbour: the send runs on one communication stream and the recv on another (CPU
streams, one thread each), both next to the step's kernels on the compute stream. What overlaps:
the transfer of the next K/V shard (and, in the backward, of the previous step's dK/dV) with this
step's attention kernels; the step ends when both are done. The cost: the ring evaluates inside the
call (n times forward, n + 1 times backward), so it cannot be traced by `mx.compile`.
"""
from __future__ import annotations

import functools
import math
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from ..spec import AttentionSpec
from .plan import Call, plan_pair


@functools.lru_cache(maxsize=None)
def _communication_streams() -> Tuple[mx.Stream, mx.Stream]:
    """(send stream, recv stream): two CPU streams, so a send never waits behind a recv."""
    return mx.new_stream(mx.cpu), mx.new_stream(mx.cpu)


class Ring:
    """Neighbour exchange on `group`: this rank sends to rank + 1 and receives from rank - 1."""

    def __init__(self, group):
        self.group = group
        self.size, self.rank = group.size(), group.rank()
        self.right = (self.rank + 1) % self.size
        self.left = (self.rank - 1) % self.size

    def exchange(self, message: Optional[mx.array], like: Optional[mx.array]):
        """(sent, received): lazy arrays; evaluate both in the same `mx.eval` as the step's work."""
        send_stream, recv_stream = _communication_streams()
        sent = received = None
        if message is not None:
            sent = mx.distributed.send(message, self.right, group=self.group, stream=send_stream)
        if like is not None:
            received = mx.distributed.recv_like(like, self.left, group=self.group, stream=recv_stream)
        return sent, received


def _pack(parts: Sequence[mx.array]) -> mx.array:
    """One flat uint8 message of several arrays (one message per neighbour and step)."""
    flat = [mx.view(p.reshape(-1), mx.uint8) for p in parts]
    return flat[0] if len(flat) == 1 else mx.concatenate(flat)


def _unpack(message: mx.array, likes: Sequence[mx.array]) -> List[mx.array]:
    out, offset = [], 0
    for like in likes:
        n = like.size * like.itemsize
        out.append(mx.view(message[offset:offset + n], like.dtype).reshape(like.shape))
        offset += n
    return out


def _pad_rows(x: mx.array, start: int, total: int, value: float = 0.0) -> mx.array:
    """x (rows on axis 2) placed at rows [start, start + rows) of `total` rows, `value` elsewhere."""
    rows = x.shape[2]
    if rows == total:
        return x
    widths = [(0, 0)] * x.ndim
    widths[2] = (start, total - start - rows)
    return mx.pad(x, widths, constant_values=value)


def _rows(x: mx.array, start: int, stop: int) -> mx.array:
    return x if (start == 0 and stop == x.shape[2]) else x[:, :, start:stop]


def _merge(out_acc, lse_acc, out_part, lse_part):
    """Combine two partial attentions of the same rows over disjoint keys (fp32, -inf safe)."""
    lse = mx.logaddexp(lse_acc, lse_part)
    safe = mx.where(lse == -math.inf, 0.0, lse)
    w_acc = mx.exp(lse_acc - safe)[..., None]
    w_part = mx.exp(lse_part - safe)[..., None]
    return out_acc * w_acc + out_part.astype(mx.float32) * w_part, lse


class RingAttention:
    """Ring forward and backward for one call's static description.

    Args:
        select: spec -> backend object (forward / backward protocol of mlx_flash.backends).
        spec: the local call's spec (q, k, v shards; no array mask).
        ring: the Ring of the group.
        q_segments(rank), k_segments(rank): the segments of a rank's query and key shards.
        q_global, kv_global: the whole sequence lengths.
    """

    def __init__(self, select, spec: AttentionSpec, ring: Ring, q_segments, k_segments,
                 q_global: int, kv_global: int):
        self.spec, self.ring = spec, ring
        n, r = ring.size, ring.rank
        mine = q_segments(r)
        # calls[t]: the calls of step t, when this rank holds the K/V shard of rank r - t.
        self.calls = [plan_pair(spec, mine, k_segments((r - t) % n), q_global, kv_global) for t in range(n)]
        # One backend per distinct call spec, chosen once (fallbacks are recorded here, once).
        self.backends = {c.spec: select(c.spec) for calls in self.calls for c in calls}

    # -- forward ---------------------------------------------------------------------------------

    def forward(self, q, k, v):
        spec, n = self.spec, self.ring.size
        B, Hq, Nq, Dv = spec.batch, spec.q_heads, spec.q_len, spec.value_dim
        D = spec.head_dim
        out = mx.zeros((B, Hq, Nq, Dv), mx.float32)
        lse = mx.full((B, Hq, Nq), -math.inf, mx.float32)
        kv = mx.concatenate([k, v], axis=-1)  # one message per step
        for t in range(n):
            last = t == n - 1
            mx.eval(kv)  # the message is ready before the exchange (see the module docstring)
            sent, received = self.ring.exchange(None if last else kv, None if last else kv)
            k_t, v_t = kv[..., :D], kv[..., D:]
            for call in self.calls[t]:
                o, l = self.backends[call.spec].forward(_rows(q, call.q0, call.q1), _rows(k_t, call.k0, call.k1),
                                            _rows(v_t, call.k0, call.k1), None, call.spec)
                o = _pad_rows(o.astype(mx.float32), call.q0, Nq)
                l = _pad_rows(l, call.q0, Nq, -math.inf)
                out, lse = _merge(out, lse, o, l)
            mx.eval([x for x in (out, lse, sent, received) if x is not None])
            if not last:
                kv = received
        return out.astype(spec.dtype), lse

    # -- backward --------------------------------------------------------------------------------

    def backward(self, q, k, v, out, lse, d_out, d_lse):
        """(dq, dk, dv) for the local shards; out / lse are the global results of this rank's rows."""
        spec, n = self.spec, self.ring.size
        D = spec.head_dim
        Nk = spec.kv_len
        dq = mx.zeros(q.shape, mx.float32)
        kv = mx.concatenate([k, v], axis=-1)
        acc_like = mx.zeros((*k.shape[:3], D + spec.value_dim), mx.float32)
        acc = None  # dK|dV accumulator of the shard held at the previous step (lazy)
        for t in range(n):
            # Message of step t: K/V for the next step (unless this is the last), and the
            # accumulator of the previous step's shard (from step 1 on).
            parts = ([kv] if t < n - 1 else []) + ([acc] if t >= 1 else [])
            message = _pack(parts) if parts else None
            if message is not None:
                mx.eval(message)
            sent, received = self.ring.exchange(message, message)
            contribution = mx.zeros(acc_like.shape, mx.float32)
            k_t, v_t = kv[..., :D], kv[..., D:]
            for call in self.calls[t]:
                r0, r1 = call.q0, call.q1
                dq_c, dk_c, dv_c = self.backends[call.spec].backward(
                    _rows(q, r0, r1), _rows(k_t, call.k0, call.k1), _rows(v_t, call.k0, call.k1), None,
                    _rows(out, r0, r1), lse[:, :, r0:r1], _rows(d_out, r0, r1),
                    None if d_lse is None else d_lse[:, :, r0:r1], call.spec)
                dq = dq + _pad_rows(dq_c.astype(mx.float32), r0, spec.q_len)
                dkv_c = mx.concatenate([dk_c.astype(mx.float32), dv_c.astype(mx.float32)], axis=-1)
                contribution = contribution + _pad_rows(dkv_c, call.k0, Nk)
            # Nothing evaluated here reads `received`: a compute-stream op waiting on the recv
            # could queue ahead of work a peer's send needs, and the ranks would wait on each other.
            mx.eval([x for x in (dq, contribution, sent, received) if x is not None])
            next_kv = arrived = None
            if received is not None:
                likes = ([kv] if t < n - 1 else []) + ([acc_like] if t >= 1 else [])
                unpacked = _unpack(received, likes)
                next_kv = unpacked[0] if t < n - 1 else None
                arrived = unpacked[-1] if t >= 1 else None
            # The shard held now, with the contributions of the ranks before this one (arrived).
            acc = contribution if arrived is None else arrived + contribution
            if next_kv is not None:
                kv = next_kv
        # One more hop: every accumulator is complete one rank before its home.
        mx.eval(acc)
        sent, received = self.ring.exchange(acc, acc)
        mx.eval(sent, received)
        dkv = received
        dk = (dkv[..., :D]).astype(k.dtype)
        dv = (dkv[..., D:]).astype(v.dtype)
        return dq.astype(q.dtype), dk, dv

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

Memory inside a VJP. MLX evaluates the backward of a custom function under "retain graph": every
array evaluated there keeps its whole graph, with each node's data, until the VJP returns. So
the accumulators (out / lse, dQ / dK|dV) are copied to graph-free arrays after every evaluation
(`_leaf`: O(N_local) bytes through host memory), and the "mlx" backend, whose calls build score
blocks from MLX ops (O(Nq * Nk) of them per call), is evaluated a key range at a time (`pieces`):
its transfer then overlaps the first piece only. The kernel backends keep O(N) per call and run
each step as one evaluation.
"""
from __future__ import annotations

import functools
import math
import threading
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from ..backends import mlx_ops
from ..spec import AttentionSpec
from .plan import plan_pair, split_keys

# Under retain-graph evaluation every intermediate of an evaluation stays alive until it ends;
# the "mlx" backend's backward makes ~5 score-block-sized arrays per key block, against ~2 live
# when it streams. Measured, 4 ranks, N_local = 512, Hq = 4, D = 64, fp32, causal zigzag, per-rank
# fwd+bwd peak / one process at N_local: quarter key blocks 1.21x, eighth key blocks 0.88-0.99x.
# The floor keeps pieces from shrinking to a few keys where the backend's own key block is already
# at its minimum (a guard, not a measured optimum).
MLX_PIECE_FRACTION = 8
MLX_PIECE_MIN_KEYS = 32


@functools.lru_cache(maxsize=None)
def _communication_streams(thread: int) -> Tuple[mx.Stream, mx.Stream]:
    """(send stream, recv stream): two CPU streams (per calling thread, as MLX's streams are), so
    a send never waits behind a recv."""
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
        send_stream, recv_stream = _communication_streams(threading.get_ident())
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


def _leaf(x: Optional[mx.array]) -> Optional[mx.array]:
    """An evaluated copy of x with no graph behind it (so not a tracer).

    MLX keeps the graph of an evaluated tracer, with every node's data, alive. Under mx.grad the
    forward's arrays are tracers when computed from the inputs, and inside the VJP every array is
    ("retain graph"); without copies a ring step would hold all its score blocks at once and the
    accumulators would keep every earlier step's intermediates (measured, 2 ranks, N_local = 512,
    fp32 fwd+bwd: 69 MB per rank against 17-21 MB for one process at N_local). So the steps start
    from copies of their inputs and the accumulators are copied after each evaluation: O(N_local)
    bytes each, through host memory (shared with the device on Apple silicon and under CUDA's
    managed memory).
    """
    if x is None:
        return None
    if x.dtype in (mx.float32, mx.int32, mx.uint8):
        return mx.array(memoryview(x))
    bits = {2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[x.itemsize]  # no buffer format for bfloat16
    return mx.view(mx.array(memoryview(mx.view(x, bits))), x.dtype)


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
        calls = [plan_pair(spec, mine, k_segments((r - t) % n), q_global, kv_global) for t in range(n)]
        # One backend per distinct call spec, chosen once (fallbacks are recorded here, once).
        self.backends = {c.spec: select(c.spec) for step in calls for c in step}
        # evaluations[t]: the groups of calls evaluated together at step t (the first with the exchange).
        self.evaluations = [self._evaluations(step, select) for step in calls]

    def _evaluations(self, calls, select):
        groups, kernels = [], []
        for call in calls:
            if self.backends[call.spec].name != "mlx":
                kernels.append(call)
                continue
            _, key_block = mlx_ops.plan_blocks(call.spec)
            for piece in split_keys(call, max(MLX_PIECE_MIN_KEYS, key_block // MLX_PIECE_FRACTION)):
                self.backends.setdefault(piece.spec, select(piece.spec))
                groups.append([piece])
        return ([kernels] if kernels else []) + groups

    # -- forward ---------------------------------------------------------------------------------

    def forward(self, q, k, v):
        spec, n = self.spec, self.ring.size
        q, kv = _leaf(q), _leaf(mx.concatenate([k, v], axis=-1))  # K and V travel as one message
        out = mx.zeros((spec.batch, spec.q_heads, spec.q_len, spec.value_dim), mx.float32)
        lse = mx.full((spec.batch, spec.q_heads, spec.q_len), -math.inf, mx.float32)
        for t in range(n):
            last = t == n - 1
            mx.eval(kv)  # the message is ready before the exchange (see the module docstring)
            comm = [x for x in self.ring.exchange(None if last else kv, None if last else kv) if x is not None]
            received = comm[-1] if comm else None
            for calls in self.evaluations[t] or [[]]:
                out, lse = self._forward_calls(calls, q, kv, out, lse)
                mx.eval(out, lse, *comm)
                out, lse, comm = _leaf(out), _leaf(lse), []
            if not last:
                kv = received
        return out.astype(spec.dtype), lse

    def _forward_calls(self, calls, q, kv, out, lse):
        """(out, lse) merged with the partials of `calls` (lazy)."""
        D, Nq = self.spec.head_dim, self.spec.q_len
        k_t, v_t = kv[..., :D], kv[..., D:]
        for call in calls:
            o, l = self.backends[call.spec].forward(_rows(q, call.q0, call.q1), _rows(k_t, call.k0, call.k1),
                                                    _rows(v_t, call.k0, call.k1), None, call.spec)
            out, lse = _merge(out, lse, _pad_rows(o.astype(mx.float32), call.q0, Nq),
                              _pad_rows(l, call.q0, Nq, -math.inf))
        return out, lse

    # -- backward --------------------------------------------------------------------------------

    def backward(self, q, k, v, out, lse, d_out, d_lse):
        """(dq, dk, dv) for the local shards; out / lse are the global results of this rank's rows."""
        spec, n = self.spec, self.ring.size
        D = spec.head_dim
        dq = mx.zeros(q.shape, mx.float32)
        kv = _leaf(mx.concatenate([k, v], axis=-1))
        q, out, lse, d_out, d_lse = (_leaf(x) for x in (q, out, lse, d_out, d_lse))
        acc_like = mx.zeros((*k.shape[:3], D + spec.value_dim), mx.float32)
        acc = None  # dK|dV accumulator of the shard held at the previous step (lazy)
        for t in range(n):
            # Message of step t: K/V for the next step (unless this is the last), and the
            # accumulator of the previous step's shard (from step 1 on).
            parts = ([kv] if t < n - 1 else []) + ([acc] if t >= 1 else [])
            message = _pack(parts) if parts else None
            if message is not None:
                mx.eval(message)
            comm = [x for x in self.ring.exchange(message, message) if x is not None]
            received = comm[-1] if comm else None
            contribution = mx.zeros(acc_like.shape, mx.float32)
            for calls in self.evaluations[t] or [[]]:
                dq, contribution = self._backward_calls(calls, q, kv, out, lse, d_out, d_lse, dq, contribution)
                # Nothing evaluated here reads `received`: a compute-stream op waiting on the recv
                # could queue ahead of work a peer's send needs, and the ranks would wait on each other.
                mx.eval(dq, contribution, *comm)
                dq, contribution, comm = _leaf(dq), _leaf(contribution), []
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
        dk = received[..., :D].astype(k.dtype)
        dv = received[..., D:].astype(v.dtype)
        return dq.astype(q.dtype), dk, dv

    def _backward_calls(self, calls, q, kv, out, lse, d_out, d_lse, dq, contribution):
        """(dq, dK|dV contribution to the visiting shard), with `calls` added (lazy)."""
        spec = self.spec
        D = spec.head_dim
        k_t, v_t = kv[..., :D], kv[..., D:]
        for call in calls:
            r0, r1 = call.q0, call.q1
            dq_c, dk_c, dv_c, _ = self.backends[call.spec].backward(
                _rows(q, r0, r1), _rows(k_t, call.k0, call.k1), _rows(v_t, call.k0, call.k1), None,
                _rows(out, r0, r1), lse[:, :, r0:r1], _rows(d_out, r0, r1),
                None if d_lse is None else d_lse[:, :, r0:r1], call.spec, lse_is_local=False)
            dq = dq + _pad_rows(dq_c.astype(mx.float32), r0, spec.q_len)
            dkv_c = mx.concatenate([dk_c.astype(mx.float32), dv_c.astype(mx.float32)], axis=-1)
            contribution = contribution + _pad_rows(dkv_c, call.k0, spec.kv_len)
        return dq, contribution

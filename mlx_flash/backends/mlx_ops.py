"""The "mlx" backend: blocked attention from MLX ops alone. Runs on every MLX device.

Shape of the computation: all query rows at once, streaming key blocks of `key_block`
columns. The forward keeps an online-softmax state; the backward is the one-pass,
five-product variant of ALGORITHM.md (per key block: recompute S and P, then dV, dP, dS,
dQ += dS K and dK), race-free here because each block is whole-array ops. No array larger
than one score block [B, Hq, Nq, key_block] is built, so memory grows O(N * block), not
O(N^2). Causal and window masks skip whole key blocks and, inside a key block, touch only
the query rows that can see it (a contiguous range); an index mask is built only for
blocks that straddle the band edge.

Why one packed state per step: MLX evaluates the graph in depth-first order of the inputs,
so when a block's temporaries feed several independent accumulator chains (max, sum and
output; or dQ, dK and dV) it computes every block's temporaries while walking the first
chain and keeps them all until the others are walked -- O(N^2) memory (measured: fwd peak
525 MiB at N=4096 with 4 MiB blocks). Packing each step's results into ONE array that the
next step reads makes every temporary die inside its own step (and `mx.depends` is no
help: its outputs keep the whole upstream graph alive). Measured after the change: see
tests/test_memory.py.

Precision: fp16 / bf16 inputs stay in their dtype for the five matmuls (MLX accumulates in
fp32 and rounds the product to the input dtype, as its own unfused attention does); scores,
softmax statistics (row max, row sum, lse), P before its rounding for the P V / P^T dO products,
dS and the O / dQ accumulators are fp32, and dK / dV blocks are summed over GQA heads in fp32.
The scale is folded into q once (q * scale in the input dtype, as MLX does). dP is a rounded
product, and when a row sees one key dP - D cancels exactly in exact arithmetic: with D in fp32
the rounding of dP alone survives (a 10% error in dQ, found by the property tests), so for
fp16 / bf16 D is rounded to the input dtype too, the same rounding that dP gets, and the
cancellation is exact again. fp32 inputs compute everything in fp32.

Block sizes (plan_blocks): one fp32 score block [B, Hq, Nq, key_block] may take 1/32 of the
whole score matrix (half of it for small problems, up to 8 MiB: fewer steps where memory is
cheap), and at most 1/512 of the device's memory clamped to [32, 256] MiB; key blocks are
multiples of 64 columns, at least 128. Forward+backward peaks at about 8 to 16 score blocks (MLX
keeps about ten operations in flight), so the 1/32 keeps the peak at a quarter to a half of one
score matrix (MLX's unfused attention: about 3.2 score matrices), and
the device share bounds the block of large problems, so memory grows linearly in N past it.

Sinks: a row's sink is the first score its online softmax sees (_initial_state: row max = sink,
row sum = 1); its gradient -sum_i p_sink,i D_i (sinks.py) takes the unrounded fp32 D_i, since no
rounded dP cancels against D there.

GQA: q is viewed as [B, Hkv, group, Nq, D] and k/v as [B, Hkv, 1, Nk, D], so matmul
broadcasting shares each kv head with its query heads without tiling k or v.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import mlx.core as mx

from ..spec import AttentionSpec
from .budget import device_memory_bytes
from .sinks import empty_lse, sinks_gradient

# Block plan (see the module docstring). Peak memory of forward+backward in fp32 score blocks,
# measured on the CPU (B=1 H=8, N=1024/2048): 4.2 with one key block, 5.1-5.2 with two, 7.9-8.5
# with four; 16 at N=4096 H=2 with 4 MiB blocks. MLX's unfused attention: ~3.2 score matrices.
SCORE_FRACTION = 32            # a score block is at most 1/32 of the whole Nq x Nk score matrix
SMALL_BLOCK_BYTES = 8 << 20    # ... or up to half of it while that is at most 8 MiB (fewer steps)
DEVICE_FRACTION = 512          # ... and at most 1/512 of the device's memory,
MIN_BLOCK_BYTES = 32 << 20     # clamped to [32, 256] MiB
MAX_BLOCK_BYTES = 256 << 20
KEY_BLOCK_ALIGN = 64
MIN_KEY_BLOCK = 128


def score_block_bytes(spec: AttentionSpec, memory_bytes: int) -> int:
    """Bytes one fp32 score block of this call may take on a device with `memory_bytes`."""
    device_share = min(max(memory_bytes // DEVICE_FRACTION, MIN_BLOCK_BYTES), MAX_BLOCK_BYTES)
    whole = 4 * spec.batch * spec.q_heads * spec.q_len * spec.kv_len
    problem_share = max(whole // SCORE_FRACTION, min(whole // 2, SMALL_BLOCK_BYTES))
    return max(1, min(device_share, problem_share))


def plan_blocks(spec: AttentionSpec, memory_bytes: Optional[int] = None) -> Tuple[int, int]:
    """(batch_chunk, key_block): batch entries per independent chunk and keys per block.

    Args:
        spec: the call.
        memory_bytes: the device's memory; default: the default device's (budget.py).
    """
    if memory_bytes is None:
        memory_bytes = device_memory_bytes(mx.default_device())
    elements = score_block_bytes(spec, memory_bytes) // 4
    rows = max(1, spec.q_heads * spec.q_len)
    key_block = elements // (spec.batch * rows)
    key_block = max(MIN_KEY_BLOCK, key_block // KEY_BLOCK_ALIGN * KEY_BLOCK_ALIGN)
    key_block = max(1, min(key_block, spec.kv_len))
    batch_chunk = max(1, min(spec.batch, elements // (rows * key_block)))
    return batch_chunk, key_block


class _Problem:
    """One chunk of batch entries: GQA-shaped views, the broadcastable mask, the band test.

    q is stored pre-scaled (q * scale) in the input dtype; k, v, too, stay in the input dtype.
    """

    def __init__(self, q, k, v, mask, spec: AttentionSpec, key_block: int):
        B, Hkv, G = q.shape[0], spec.kv_heads, spec.group
        self.spec = spec
        self.key_block = key_block
        self.q = (q * mx.array(spec.scale, q.dtype)).reshape(B, Hkv, G, spec.q_len, spec.head_dim)
        self.k = mx.expand_dims(k, 2)
        self.v = mx.expand_dims(v, 2)
        self.mask = None
        if mask is not None:
            mb, mh, mq, mk = mask.shape
            if mh == spec.q_heads and mh > 1:
                self.mask = mask.reshape(mb, Hkv, G, mq, mk)
            else:
                self.mask = mask.reshape(mb, 1, 1, mq, mk)

    def steps(self):
        """Key blocks (k0, k1) with the query rows (q0, q1) that can see them; empty ones skipped."""
        spec = self.spec
        for k0 in range(0, spec.kv_len, self.key_block):
            k1 = min(k0 + self.key_block, spec.kv_len)
            q0, q1 = spec.query_range(k0, k1)
            if q0 < q1:
                yield k0, k1, q0, q1

    def scores(self, q0, q1, k0, k1):
        """Final fp32 scores [B, Hkv, G, q1-q0, k1-k0] (softcapped, -inf where masked) and tanh(s/c)."""
        spec = self.spec
        s = mx.matmul(self.q[..., q0:q1, :], mx.swapaxes(self.k[..., k0:k1, :], -1, -2)).astype(mx.float32)
        t = None
        if spec.softcap is not None:
            t = mx.tanh(s * (1.0 / spec.softcap))
            s = t * spec.softcap
        keep = self._band(q0, q1, k0, k1)
        if self.mask is not None:
            m = self.mask
            m = m[..., q0:q1, :] if m.shape[-2] > 1 else m
            m = m[..., k0:k1] if m.shape[-1] > 1 else m
            if m.dtype == mx.bool_:
                keep = m if keep is None else mx.logical_and(keep, m)
            else:
                s = s + m.astype(mx.float32)
        if keep is not None:
            s = mx.where(keep, s, -math.inf)
        return s, t

    def _band(self, q0, q1, k0, k1) -> Optional[mx.array]:
        """Bool [q, k] index mask for a block straddling the causal/window edge; None if all visible."""
        spec = self.spec
        if not spec.has_band:
            return None
        lo_last, _ = spec.key_range(q1 - 1, q1)
        _, hi_first = spec.key_range(q0, q0 + 1)
        lo_first, _ = spec.key_range(q0, q0 + 1)
        _, hi_last = spec.key_range(q1 - 1, q1)
        if max(lo_first, lo_last) <= k0 and k1 <= min(hi_first, hi_last):
            return None  # every query row of the block sees every key in it
        i = mx.arange(q0, q1)[:, None] + spec.diagonal
        j = mx.arange(k0, k1)[None, :]
        keep = None
        if spec.causal:
            keep = j <= i
        if spec.window is not None:
            left, right = spec.window
            for cond in ((j >= i - left) if left >= 0 else None, (j <= i + right) if right >= 0 else None):
                if cond is not None:
                    keep = cond if keep is None else mx.logical_and(keep, cond)
        return keep


def _splice(state, q0, q1, rows):
    """state with rows [q0, q1) (axis -2) replaced by `rows`: one new array, the packed step result."""
    n = state.shape[-2]
    if q0 == 0 and q1 == n:
        return rows
    parts = ([state[..., :q0, :]] if q0 > 0 else []) + [rows] + ([state[..., q1:, :]] if q1 < n else [])
    return mx.concatenate(parts, axis=-2)


def _chunks(spec: AttentionSpec, batch_chunk: int):
    return [(b, min(b + batch_chunk, spec.batch)) for b in range(0, spec.batch, batch_chunk)]


def _slice_batch(x, b0, b1):
    return None if x is None else (x[b0:b1] if x.shape[0] > 1 else x)


def forward(q, k, v, mask, spec: AttentionSpec, sinks=None) -> Tuple[mx.array, mx.array]:
    """Returns (out [B, Hq, Nq, Dv] in q's dtype, lse [B, Hq, Nq] fp32, natural log).

    sinks ([Hq] or None): per-head sink logits, one extra softmax score with no value.
    """
    B, Hq, Nq, Dv = spec.batch, spec.q_heads, spec.q_len, spec.value_dim
    if min(B, Hq, Nq) == 0 or spec.kv_len == 0:
        return mx.zeros((B, Hq, Nq, Dv), spec.dtype), empty_lse(sinks, (B, Hq, Nq))
    batch_chunk, key_block = plan_blocks(spec)
    outs, lses = [], []
    for b0, b1 in _chunks(spec, batch_chunk):
        out, lse = _forward_chunk(q[b0:b1], k[b0:b1], v[b0:b1], _slice_batch(mask, b0, b1), spec, key_block,
                                  sinks)
        outs.append(out)
        lses.append(lse)
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
    lse = lses[0] if len(lses) == 1 else mx.concatenate(lses, axis=0)
    return out, lse


def _initial_state(B, Hkv, G, Nq, Dv, sinks=None):
    """The online-softmax state before any key: [acc (Dv) | row_sum | row_max] = [0 | 0 | -inf].

    With sinks the sink is the first score seen: row_max = sink and row_sum = exp(sink - sink) = 1
    (0 for a sink of -inf, which is no sink).
    """
    if sinks is None:
        return mx.concatenate([mx.zeros((B, Hkv, G, Nq, Dv + 1), mx.float32),
                               mx.full((B, Hkv, G, Nq, 1), -math.inf, mx.float32)], axis=-1)
    sink = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, Hkv, G, 1, 1), (B, Hkv, G, Nq, 1))
    return mx.concatenate([mx.zeros((B, Hkv, G, Nq, Dv), mx.float32),
                           mx.where(sink == -math.inf, 0.0, 1.0), sink], axis=-1)


def _forward_chunk(q, k, v, mask, spec, key_block, sinks=None):
    problem = _Problem(q, k, v, mask, spec, key_block)
    B, Hkv, G, Nq, Dv = q.shape[0], spec.kv_heads, spec.group, spec.q_len, spec.value_dim
    # Packed state per query row: [acc (Dv) | row_sum | row_max], fp32.
    state = _initial_state(B, Hkv, G, Nq, Dv, sinks)
    for k0, k1, q0, q1 in problem.steps():
        s, _ = problem.scores(q0, q1, k0, k1)
        rows = state[..., q0:q1, :]
        row_max = rows[..., -1]
        new_max = mx.maximum(row_max, s.max(-1))
        # Rows that have seen no key yet keep max -inf; subtract 0 instead (exp(-inf) = 0).
        safe_max = mx.where(new_max == -math.inf, 0.0, new_max)
        p = mx.exp(s - safe_max[..., None])
        correction = mx.exp(row_max - safe_max)[..., None]
        pv = mx.matmul(p.astype(v.dtype), problem.v[..., k0:k1, :]).astype(mx.float32)
        updated = mx.concatenate([rows[..., :Dv] * correction + pv,
                                  rows[..., Dv:Dv + 1] * correction + p.sum(-1, keepdims=True),
                                  new_max[..., None]], axis=-1)
        state = _splice(state, q0, q1, updated)
    acc, row_sum, row_max = state[..., :Dv], state[..., Dv], state[..., Dv + 1]
    seen = row_sum > 0
    out = mx.where(seen[..., None], acc / mx.where(seen, row_sum, 1.0)[..., None], 0.0)
    lse = mx.where(seen, row_max + mx.log(mx.where(seen, row_sum, 1.0)), -math.inf)
    return out.astype(spec.dtype).reshape(B, spec.q_heads, Nq, Dv), lse.reshape(B, spec.q_heads, Nq)


def backward(q, k, v, mask, out, lse, d_out, d_lse, spec: AttentionSpec, sinks=None):
    """Returns (dq, dk, dv, d_sinks) in the input dtypes (d_sinks None without sinks).
    d_lse (or None) is the cotangent of lse."""
    # D_i = rowsum(dO * O), minus the lse cotangent (dlse/ds = P folds into the same term).
    dot = (d_out.astype(mx.float32) * out.astype(mx.float32)).sum(-1)
    d_lse32 = None if d_lse is None else d_lse.astype(mx.float32)
    # The sink is a softmax column with no value: its score gradient is p_sink (0 - D_i). No dP
    # product cancels against D here, so d_sinks takes the unrounded fp32 D.
    d_sinks = None if sinks is None else sinks_gradient(
        sinks, lse, dot if d_lse32 is None else dot - d_lse32)
    row_term = dot
    if spec.dtype != mx.float32:
        # dP is a product rounded to the input dtype: round D alike so that dP - D cancels
        # exactly where it should (a row that sees one key); see the module docstring.
        row_term = row_term.astype(spec.dtype).astype(mx.float32)
    if d_lse32 is not None:
        row_term = row_term - d_lse32
    if min(spec.batch, spec.kv_heads, spec.q_len, spec.kv_len) == 0:
        return mx.zeros_like(q), mx.zeros_like(k), mx.zeros_like(v), d_sinks
    # Rows that saw no key have lse = -inf: use +inf so P = exp(S - lse) is 0 there.
    safe_lse = mx.where(lse == -math.inf, math.inf, lse)
    batch_chunk, key_block = plan_blocks(spec)
    grads = []
    for b0, b1 in _chunks(spec, batch_chunk):
        grads.append(_backward_chunk(q[b0:b1], k[b0:b1], v[b0:b1], _slice_batch(mask, b0, b1),
                                     safe_lse[b0:b1], row_term[b0:b1], d_out[b0:b1], spec, key_block))
    if len(grads) == 1:
        return (*grads[0], d_sinks)
    return (*(mx.concatenate(parts, axis=0) for parts in zip(*grads)), d_sinks)


def _backward_chunk(q, k, v, mask, safe_lse, row_term, d_out, spec, key_block):
    problem = _Problem(q, k, v, mask, spec, key_block)
    B, Hkv, G, Nq, Nk, D, Dv = (q.shape[0], spec.kv_heads, spec.group, spec.q_len,
                                spec.kv_len, spec.head_dim, spec.value_dim)
    safe_lse = safe_lse.reshape(B, Hkv, G, Nq)
    row_term = row_term.reshape(B, Hkv, G, Nq)
    d_out = d_out.astype(q.dtype).reshape(B, Hkv, G, Nq, Dv)
    # Packed state: dQ rows (all of them, [.., G, Nq, D]) and the dK | dV rows of the key blocks
    # done so far ([.., Nk_done, D + Dv]); each step reads the previous state and writes a new one.
    dq = mx.zeros((B, Hkv, G, Nq, D), mx.float32)
    dkv = []
    done = 0
    for k0, k1, q0, q1 in problem.steps():
        if k0 > done:
            dkv.append(mx.zeros((B, Hkv, k0 - done, D + Dv), mx.float32))
        s, t = problem.scores(q0, q1, k0, k1)
        p = mx.exp(s - safe_lse[..., q0:q1, None])
        do_blk = d_out[..., q0:q1, :]
        dp = mx.matmul(do_blk, mx.swapaxes(problem.v[..., k0:k1, :], -1, -2)).astype(mx.float32)
        ds = p * (dp - row_term[..., q0:q1, None])
        if t is not None:
            ds = ds * (1.0 - t * t)
        ds, p = ds.astype(q.dtype), p.astype(q.dtype)
        dq_rows = dq[..., q0:q1, :] + mx.matmul(ds, problem.k[..., k0:k1, :]).astype(mx.float32)
        # dK from the pre-scaled q: scale * dS^T q, so dK needs no further scaling.
        dk_blk = _sum_groups(mx.matmul(mx.swapaxes(ds, -1, -2), problem.q[..., q0:q1, :]))
        dv_blk = _sum_groups(mx.matmul(mx.swapaxes(p, -1, -2), do_blk))
        dq = _splice(dq, q0, q1, dq_rows)
        dkv.append(mx.concatenate([dk_blk, dv_blk], axis=-1))
        # Tie the new dK|dV rows to dQ so the step is one packed result (see the module docstring).
        packed = mx.concatenate([dq.reshape(B, Hkv, G * Nq * D)] + [x.reshape(B, Hkv, -1) for x in dkv], axis=-1)
        dq = packed[..., :G * Nq * D].reshape(B, Hkv, G, Nq, D)
        offset, rebuilt = G * Nq * D, []
        for x in dkv:
            size = x.shape[2] * (D + Dv)
            rebuilt.append(packed[..., offset:offset + size].reshape(x.shape))
            offset += size
        dkv = [mx.concatenate(rebuilt, axis=2)] if len(rebuilt) > 1 else rebuilt
        done = k1
    if done < Nk:
        dkv.append(mx.zeros((B, Hkv, Nk - done, D + Dv), mx.float32))
    dkv = dkv[0] if len(dkv) == 1 else mx.concatenate(dkv, axis=2)
    dq = (dq * spec.scale).astype(q.dtype).reshape(q.shape)
    dk = dkv[..., :D].astype(k.dtype)
    dv = dkv[..., D:].astype(v.dtype)
    return dq, dk, dv


def _sum_groups(x):
    """Sum a [B, Hkv, G, n, d] product over the G query heads of each kv head, in fp32."""
    if x.shape[2] == 1:
        return x.squeeze(2).astype(mx.float32)
    return x.astype(mx.float32).sum(2)


class MLXOpsBackend:
    """Backend protocol implementation for the blocked MLX-ops path (always available)."""

    name = "mlx"

    def unavailable_reason(self, device) -> Optional[str]:
        return None

    def unsupported_reason(self, spec: AttentionSpec) -> Optional[str]:
        return None

    forward = staticmethod(forward)
    backward = staticmethod(backward)


BACKEND = MLXOpsBackend()

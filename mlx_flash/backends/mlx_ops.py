"""The "mlx" backend: blocked attention from MLX ops alone. Runs on every MLX device.

The forward streams key blocks through an online softmax; the backward is the one-pass,
five-product variant of ALGORITHM.md (recompute S and P per block pair, then dV, dP,
dS, dQ and dK), which is race-free here because every block pair is its own array op.
No array larger than one score block [B, Hq, query_block, key_block] is ever built, so
peak memory grows O(N * block), not O(N^2). Causal and window masks skip whole block
pairs and build an index mask only for blocks that straddle the band edge.

GQA: q is viewed as [B, Hkv, group, Nq, D] and k/v as [B, Hkv, 1, Nk, D], so matmul
broadcasting shares each kv head with its query heads without tiling k or v.
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import mlx.core as mx

from ..spec import AttentionSpec

# Score-block budget in elements (B * Hq * query_block * key_block). Measured on a 2-core
# x86 CPU at B=1, H=8, N=4096, D=64, fp32: forward+backward time is flat from 2^22 to
# 2^24 elements, and the backward keeps ~5 block-sized fp32 temporaries alive, so 2^22
# (16 MiB per block) keeps peak memory a few percent of the unfused N^2 path.
SCORE_BLOCK_ELEMENTS = 1 << 22
MIN_KEY_BLOCK = 128
MAX_KEY_BLOCK = 1024


def block_sizes(spec: AttentionSpec) -> Tuple[int, int]:
    """(query_block, key_block) for this call: key blocks of up to 1024 keys, query blocks
    as tall as the score-block budget allows (a single block when it fits)."""
    heads = max(1, spec.batch * spec.q_heads)
    key_block = max(1, min(spec.kv_len, MAX_KEY_BLOCK,
                           max(MIN_KEY_BLOCK, SCORE_BLOCK_ELEMENTS // max(1, heads * spec.q_len))))
    query_block = max(1, min(spec.q_len, SCORE_BLOCK_ELEMENTS // (heads * key_block)))
    if spec.has_band and query_block >= spec.q_len and spec.q_len > key_block:
        # Causal/window: smaller query blocks let whole block pairs be skipped (~half the work).
        query_block = key_block
    return query_block, key_block


class _Blocks:
    """Shared per-call views: GQA-shaped q/k/v, the broadcastable mask, the band test."""

    def __init__(self, q, k, v, mask, spec: AttentionSpec):
        B, Hkv, G = spec.batch, spec.kv_heads, spec.group
        self.spec = spec
        self.q = q.reshape(B, Hkv, G, spec.q_len, spec.head_dim)
        self.k = mx.expand_dims(k, 2)
        self.v = mx.expand_dims(v, 2)
        self.mask = None
        if mask is not None:
            mb, mh, mq, mk = mask.shape
            self.mask = mask.reshape(mb, Hkv, G, mq, mk) if mh == spec.q_heads and mh > 1 else mask.reshape(mb, 1, 1, mq, mk)
        self.query_block, self.key_block = block_sizes(spec)

    def query_blocks(self):
        return [(s, min(s + self.query_block, self.spec.q_len)) for s in range(0, self.spec.q_len, self.query_block)]

    def key_blocks(self, q0: int, q1: int):
        """Key blocks that the queries [q0, q1) can see (whole blocks outside the band are skipped)."""
        lo, hi = self.spec.key_range(q0, q1)
        if hi <= lo:
            return []
        first = (lo // self.key_block) * self.key_block
        return [(s, min(s + self.key_block, self.spec.kv_len)) for s in range(first, hi, self.key_block)]

    def scores(self, q0, q1, k0, k1):
        """Final fp32 scores [B, Hkv, G, q1-q0, k1-k0] (softcapped, masked with -inf) and tanh(s/c)."""
        spec = self.spec
        s = mx.matmul(self.q[..., q0:q1, :], mx.swapaxes(self.k[..., k0:k1, :], -1, -2))
        s = s.astype(mx.float32) * spec.scale
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
        lo_first, hi_first = spec.key_range(q0, q0 + 1)
        lo_last, hi_last = spec.key_range(q1 - 1, q1)
        if lo_last <= k0 and k1 <= hi_first:
            return None  # every query in the block sees every key in it
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


def forward(q, k, v, mask, spec: AttentionSpec) -> Tuple[mx.array, mx.array]:
    """Returns (out [B, Hq, Nq, Dv] in q's dtype, lse [B, Hq, Nq] fp32, natural log)."""
    B, Hq, Nq, Dv = spec.batch, spec.q_heads, spec.q_len, spec.value_dim
    if min(B, Hq, Nq) == 0 or spec.kv_len == 0:
        return mx.zeros((B, Hq, Nq, Dv), spec.dtype), mx.full((B, Hq, Nq), -math.inf, mx.float32)
    blocks = _Blocks(q, k, v, mask, spec)
    shape = (B, spec.kv_heads, spec.group)
    outs, lses = [], []
    for q0, q1 in blocks.query_blocks():
        rows = q1 - q0
        row_max = mx.full((*shape, rows), -math.inf, mx.float32)
        row_sum = mx.zeros((*shape, rows), mx.float32)
        acc = mx.zeros((*shape, rows, Dv), mx.float32)
        for k0, k1 in blocks.key_blocks(q0, q1):
            s, _ = blocks.scores(q0, q1, k0, k1)
            new_max = mx.maximum(row_max, s.max(-1))
            # Rows that have seen no key yet keep max -inf; subtract 0 instead (exp(-inf) = 0).
            safe_max = mx.where(new_max == -math.inf, 0.0, new_max)
            p = mx.exp(s - safe_max[..., None])
            correction = mx.exp(row_max - safe_max)
            row_sum = row_sum * correction + p.sum(-1)
            pv = mx.matmul(p.astype(spec.dtype), blocks.v[..., k0:k1, :])
            acc = acc * correction[..., None] + pv.astype(mx.float32)
            row_max = new_max
        seen = row_sum > 0
        out = mx.where(seen[..., None], acc / mx.where(seen, row_sum, 1.0)[..., None], 0.0)
        lse = mx.where(seen, row_max + mx.log(mx.where(seen, row_sum, 1.0)), -math.inf)
        outs.append(out)
        lses.append(lse)
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=-2)
    lse = lses[0] if len(lses) == 1 else mx.concatenate(lses, axis=-1)
    return out.astype(spec.dtype).reshape(B, Hq, Nq, Dv), lse.reshape(B, Hq, Nq)


def backward(q, k, v, mask, out, lse, d_out, d_lse, spec: AttentionSpec):
    """Returns (dq, dk, dv) in the input dtype. d_lse (or None) is the cotangent of lse."""
    B, Hkv, G, Nq, Nk, D, Dv = (spec.batch, spec.kv_heads, spec.group, spec.q_len,
                                spec.kv_len, spec.head_dim, spec.value_dim)
    if min(B, Hkv, Nq, Nk) == 0:
        return mx.zeros_like(q), mx.zeros_like(k), mx.zeros_like(v)
    blocks = _Blocks(q, k, v, mask, spec)
    # D_i = rowsum(dO * O), minus the lse cotangent (dlse/ds = P folds into the same term).
    row_term = (d_out.astype(mx.float32) * out.astype(mx.float32)).sum(-1)
    if d_lse is not None:
        row_term = row_term - d_lse.astype(mx.float32)
    row_term = row_term.reshape(B, Hkv, G, Nq)
    # Rows that saw no key have lse = -inf: use +inf so P = exp(S - lse) is 0 there.
    safe_lse = mx.where(lse == -math.inf, math.inf, lse).reshape(B, Hkv, G, Nq)
    d_out = d_out.reshape(B, Hkv, G, Nq, Dv)

    n_key_blocks = (Nk + blocks.key_block - 1) // blocks.key_block
    dk_parts: List[Optional[mx.array]] = [None] * n_key_blocks
    dv_parts: List[Optional[mx.array]] = [None] * n_key_blocks
    dq_parts = []
    for q0, q1 in blocks.query_blocks():
        dq = None
        q_blk, do_blk = blocks.q[..., q0:q1, :], d_out[..., q0:q1, :]
        for k0, k1 in blocks.key_blocks(q0, q1):
            s, t = blocks.scores(q0, q1, k0, k1)
            p = mx.exp(s - safe_lse[..., q0:q1, None])
            p_in = p.astype(spec.dtype)
            dv = mx.matmul(mx.swapaxes(p_in, -1, -2), do_blk).astype(mx.float32).sum(2)
            dp = mx.matmul(do_blk, mx.swapaxes(blocks.v[..., k0:k1, :], -1, -2)).astype(mx.float32)
            ds = p * (dp - row_term[..., q0:q1, None])
            if t is not None:
                ds = ds * (1.0 - t * t)
            ds_in = ds.astype(spec.dtype)
            dq_blk = mx.matmul(ds_in, blocks.k[..., k0:k1, :]).astype(mx.float32)
            dq = dq_blk if dq is None else dq + dq_blk
            dk = mx.matmul(mx.swapaxes(ds_in, -1, -2), q_blk).astype(mx.float32).sum(2)
            b = k0 // blocks.key_block
            dk_parts[b] = dk if dk_parts[b] is None else dk_parts[b] + dk
            dv_parts[b] = dv if dv_parts[b] is None else dv_parts[b] + dv
        if dq is None:
            dq = mx.zeros((B, Hkv, G, q1 - q0, D), mx.float32)
        dq_parts.append(dq)

    def assemble(parts, width):
        filled = [p if p is not None else
                  mx.zeros((B, Hkv, min(blocks.key_block, Nk - i * blocks.key_block), width), mx.float32)
                  for i, p in enumerate(parts)]
        return filled[0] if len(filled) == 1 else mx.concatenate(filled, axis=-2)

    dq = dq_parts[0] if len(dq_parts) == 1 else mx.concatenate(dq_parts, axis=-2)
    dq = (dq * spec.scale).astype(q.dtype).reshape(q.shape)
    dk = (assemble(dk_parts, D) * spec.scale).astype(k.dtype)
    dv = assemble(dv_parts, Dv).astype(v.dtype)
    return dq, dk, dv


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

"""The attention-sink terms every backend shares, in MLX ops (O(B * Hq * Nq), no score matrix).

A sink is one more softmax score per query head with no value (ALGORITHM.md, "Attention sinks").
Its gradient needs only each row's lse (which includes the sink) and D_i = rowsum(dO * O) - dlse_i:
    d_sink_h = -sum over batches and queries of p_sink,i * D_i,  p_sink,i = exp(sink_h - lse_i).
The "mlx" backend uses this directly; the kernel backends fuse it into their dQ kernel and use
this only where no kernel runs (empty problems).
"""
from __future__ import annotations

import math

import mlx.core as mx


def sinks_gradient(sinks: mx.array, lse: mx.array, row_term: mx.array) -> mx.array:
    """d_sinks [Hq] in sinks' dtype.

    Args:
        sinks: [Hq] sink logits.
        lse: fp32 [B, Hq, Nq], natural log, sinks included (-inf only for a sink of -inf on a
            row with no key: p_sink is 0 there).
        row_term: fp32 [B, Hq, Nq], D_i = rowsum(dO * O) - dlse_i.
    """
    p_sink = mx.exp(sinks.astype(mx.float32)[None, :, None] - lse)
    p_sink = mx.where(lse == -math.inf, 0.0, p_sink)
    return (-(p_sink * row_term).sum(axis=(0, 2))).astype(sinks.dtype)


def row_term(out: mx.array, d_out: mx.array, d_lse) -> mx.array:
    """D_i = rowsum(dO * O) - dlse_i in fp32 (d_lse None: lse's cotangent is zero)."""
    term = (d_out.astype(mx.float32) * out.astype(mx.float32)).sum(-1)
    return term if d_lse is None else term - d_lse.astype(mx.float32)


def empty_lse(sinks, shape) -> mx.array:
    """lse of rows that see no key: -inf, or the sink (which then takes all the probability)."""
    if sinks is None:
        return mx.full(shape, -math.inf, mx.float32)
    return mx.broadcast_to(sinks.astype(mx.float32)[None, :, None], shape)

"""What the Metal and CUDA kernel backends share: the call's runtime operands and the empty call.

Both backends follow one chain: spec -> plan (planner + kernels/blocks_<target>.txt) -> kernel
variant (the compile-cache key, a frozen dataclass in metal_source.py / cuda_source.py) ->
source (render.py fills the template's {{name}} placeholders) -> launch (metal.py / cuda.py).
This module holds the pieces of the launch that do not depend on the GPU: the mask-kind and
dtype names, the broadcast strides of an array mask, the float parameter array, and the answer
to calls with nothing to compute.
"""
from __future__ import annotations

import functools
from types import MappingProxyType
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from ..spec import AttentionSpec
from .sinks import empty_lse, row_term, sinks_gradient

# The MASK_KIND constant of every kernel template: 0 no array mask, 1 bool (True = keep), 2 additive.
MASK_KINDS = MappingProxyType({"none": 0, "bool": 1, "additive": 2})
DTYPE_NAMES = MappingProxyType({mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"})
# Float parameters of every kernel: [scale, softcap, 1 / softcap, 0 ...] (8 floats: one layout,
# room to grow without changing a signature).
FLOAT_PARAMS = 8


def mask_strides(shape: Optional[Sequence[int]]) -> List[int]:
    """Element strides [b, h, query, key] of a row-contiguous rank-4 mask, 0 along broadcast dims.

    Args:
        shape: the mask's shape after left-padding to rank 4, or None (no mask: all zeros).
    """
    if shape is None:
        return [0, 0, 0, 0]
    strides, step = [0] * len(shape), 1
    for axis in range(len(shape) - 1, -1, -1):
        strides[axis] = step if shape[axis] > 1 else 0
        step *= shape[axis]
    return strides


def window_bounds(spec: AttentionSpec) -> Tuple[int, int]:
    """(left, right) of the sliding window, -1 = unbounded (both -1 without a window)."""
    return spec.window if spec.window is not None else (-1, -1)


@functools.lru_cache(maxsize=1024)
def float_params(spec: AttentionSpec) -> mx.array:
    """[scale, cap, 1 / cap, 0, ...] as fp32 (cap = 1 without softcap). Cached per spec: a call
    then uploads no new array."""
    cap = spec.softcap if spec.softcap is not None else 1.0
    values = [spec.scale, cap, 1.0 / cap]
    return mx.array(values + [0.0] * (FLOAT_PARAMS - len(values)), dtype=mx.float32)


def is_empty(spec: AttentionSpec) -> bool:
    """Whether the call has nothing for a kernel to do: no rows, no keys or head_dim 0."""
    return min(spec.batch, spec.q_heads, spec.q_len, spec.kv_len, spec.head_dim) == 0


def empty_forward(q, k, v, mask, spec: AttentionSpec, sinks=None) -> Tuple[mx.array, mx.array]:
    """(out, lse) of an empty call, as the "mlx" backend computes them.

    Without rows or keys, out is zeros and lse -inf (the sink, with sinks: it takes all the
    probability). With head_dim 0 every score is 0, so lse is the logsumexp of the mask (and the
    sink) alone: the "mlx" backend answers.
    """
    if spec.head_dim == 0 and min(spec.batch, spec.q_heads, spec.q_len, spec.kv_len) > 0:
        from . import mlx_ops
        return mlx_ops.forward(q, k, v, mask, spec, sinks=sinks)
    B, Hq, Nq = spec.batch, spec.q_heads, spec.q_len
    return mx.zeros((B, Hq, Nq, spec.value_dim), spec.dtype), empty_lse(sinks, (B, Hq, Nq))


def empty_backward(q, k, v) -> Tuple[mx.array, mx.array, mx.array]:
    """(dq, dk, dv) of an empty call: zeros (nothing depends on the inputs)."""
    return mx.zeros_like(q), mx.zeros_like(k), mx.zeros_like(v)


def empty_sinks_gradient(sinks, out, lse, d_out, d_lse) -> Optional[mx.array]:
    """d_sinks of an empty call (no kernel runs), None without sinks: the sink's probability in
    each row still meets that row's D_i = rowsum(dO * O) - dlse_i (sinks.py)."""
    return None if sinks is None else sinks_gradient(sinks, lse, row_term(out, d_out, d_lse))

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
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import mlx.core as mx

from ..spec import AttentionSpec
from .sinks import empty_lse, row_term, sinks_gradient

# The MASK_KIND constant of every kernel template: 0 no array mask, 1 bool (True = keep), 2 additive.
MASK_KINDS = MappingProxyType({"none": 0, "bool": 1, "additive": 2})
DTYPE_NAMES = MappingProxyType({mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"})
# Float parameters of every kernel: [scale, softcap, 1 / softcap, 0 ...] (8 floats: one layout,
# room to grow without changing a signature).
FLOAT_PARAMS = 8


def cached_hash(value) -> int:
    """The hash of a frozen dataclass of hashable fields, computed once and kept on the object (a
    dataclass's own __hash__ builds the tuple of its fields on every call). For the values that key
    per-call caches: kernel variants, GPU families, tunings. (A pickled copy would carry the hash to
    a process with another string-hash seed; none of these values is pickled.)"""
    cached = value.__dict__.get("_hash")
    if cached is None:
        cached = hash(tuple(getattr(value, f.name) for f in fields(value)))
        object.__setattr__(value, "_hash", cached)
    return cached


class VariantFeatures(NamedTuple):
    """What of a call is compiled into its kernels; the rest of an AttentionSpec (sizes, scale,
    the window's and softcap's values) is runtime data. The key of the backends' variant-set
    caches: every decode step's longer kv_len, every layer and every batch of one model share it.

    A NamedTuple, not a frozen dataclass: it is made on every call, in a third of the time.
    """

    head_dim: int
    dtype: mx.Dtype
    causal: bool
    window: bool
    softcap: bool
    mask_kind: str
    has_sinks: bool

    @staticmethod
    def of(spec: AttentionSpec) -> "VariantFeatures":
        return VariantFeatures(spec.head_dim, spec.dtype, spec.causal, spec.window is not None,
                               spec.softcap is not None, spec.mask_kind, spec.has_sinks)

    def spec(self) -> AttentionSpec:
        """The smallest call with these features (one row, one key): what the variants are planned
        from (make_variant reads only the features; tests check every variant against the call's own)."""
        return AttentionSpec(batch=1, q_heads=1, kv_heads=1, q_len=1, kv_len=1, head_dim=self.head_dim,
                             value_dim=self.head_dim, dtype=self.dtype, scale=1.0, causal=self.causal,
                             window=(-1, -1) if self.window else None, softcap=1.0 if self.softcap else None,
                             mask_kind=self.mask_kind, mask_shape=None if self.mask_kind == "none" else (1, 1, 1, 1),
                             has_sinks=self.has_sinks)


@dataclass(frozen=True)
class VariantSet:
    """The three kernel variants one call runs: what the first-contact guard checks once per process.

    Made by the backends' variant-set caches, which hand out one object per key: its hash is
    computed once, and a dictionary lookup with it (the guard's, every call) ends at the identity test.
    """

    forward: Any
    backward_query: Any
    backward_key_value: Any

    def __hash__(self) -> int:
        return cached_hash(self)

    def __iter__(self):
        return iter((self.forward, self.backward_query, self.backward_key_value))


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


# How the kernels meet MLX's layouts. Inputs q, k, v, d_out (and the saved output) are read where
# they lie: the kernels are built with ensure_row_contiguous=False and read each one's
# `<name>_strides` (element (b, h, n, d) at b s0 + h s1 + n s2 + d s3), so mlx-lm's transposed views
# (q, k after RoPE on the GPU, v, the output's cotangent) are never copied. Outputs (out, dq, dk,
# dv) are written as [B, N, H, D] buffers and returned as [B, H, N, D] views, as MLX's own Metal
# attention writes its output: a model's transpose + reshape after attention then costs nothing,
# and the saved output shares its buffer with the next projection's input.
STRIDED_INPUTS = ("q", "k", "v", "d_out", "out", "o")  # "o": the Metal dQ kernel's saved output


def token_major_shape(shape: Sequence[int]) -> Tuple[int, int, int, int]:
    """[B, H, N, D] -> the [B, N, H, D] shape of the buffer a kernel writes."""
    b, h, n, d = shape
    return (b, n, h, d)


def heads_view(x: mx.array) -> mx.array:
    """A kernel's [B, N, H, D] output buffer as the [B, H, N, D] array the caller gets (a view)."""
    return x.transpose(0, 2, 1, 3)


def contiguous_operands(arrays: Sequence[mx.array]) -> List[mx.array]:
    """The operands a kernel reads as row-contiguous (masks, sinks, statistics): made so where they
    are not (no copy where they are), since the kernels are built with ensure_row_contiguous=False."""
    return [mx.contiguous(x) for x in arrays]


def window_bounds(spec: AttentionSpec) -> Tuple[int, int]:
    """(left, right) of the sliding window, -1 = unbounded (both -1 without a window)."""
    return spec.window if spec.window is not None else (-1, -1)


def float_params(spec: AttentionSpec) -> mx.array:
    """[scale, cap, 1 / cap, 0, ...] as fp32 (cap = 1 without softcap). Cached per (scale,
    softcap): a call then uploads no new array, and the cache's key compares two floats, not
    two specs (a spec's == took ~1.5 us of each launch)."""
    return _float_params(spec.scale, spec.softcap)


@functools.lru_cache(maxsize=1024)
def _float_params(scale: float, softcap: Optional[float]) -> mx.array:
    cap = softcap if softcap is not None else 1.0
    values = [scale, cap, 1.0 / cap]
    return mx.array(values + [0.0] * (FLOAT_PARAMS - len(values)), dtype=mx.float32)


@functools.lru_cache(maxsize=None)
def constant_zeros(dtype: mx.Dtype, size: int) -> mx.array:
    """A 1-D array of `size` zeros, made once: the dummy operands that keep a kernel's signature
    fixed (never read). An mx.array of a list holds data at once, so no compile trace or stream
    ever owns it; a new mx.zeros per launch was ~1 us of host time each."""
    return mx.array([0] * size, dtype=dtype)


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

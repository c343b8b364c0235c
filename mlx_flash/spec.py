"""Argument checking: turn a public call into an `AttentionSpec` or raise a clear error.

Every error names the offending argument and shows the values, in the style of MLX's
own messages. Nothing here touches array data, so checking costs no device work.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import mlx.core as mx

FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


@dataclass(frozen=True)
class AttentionSpec:
    """Everything about a call that is not array data. Hashable: backends key caches on it.

    Attributes:
        batch, q_heads, kv_heads, q_len, kv_len, head_dim, value_dim: the problem sizes.
        dtype: the common floating dtype of q, k, v (and of the output).
        scale: multiplier of q @ k^T.
        causal: bottom-right aligned causal mask (as MLX).
        window: (left, right) sliding window, -1 = unbounded on that side; None = no window.
        softcap: c in c * tanh(s / c), or None.
        mask_kind: "none", "bool" or "additive" for the array mask.
        mask_shape: the array mask's shape after left-padding to rank 4 (dims of size 1 broadcast).
        diagonal_shift: internal, never set by the public API: moves the causal / window diagonal
            by this many keys. Context parallelism (mlx_flash.distributed) runs one call per
            (query shard, key shard) pair of a longer sequence; the pair's band is the global
            one, which sits (query start - key start) keys off the pair's own bottom-right diagonal.
        has_sinks: a sinks array [Hq] joins each row's softmax (the logits themselves are data).
    """

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    value_dim: int
    dtype: mx.Dtype
    scale: float
    causal: bool = False
    window: Optional[Tuple[int, int]] = None
    softcap: Optional[float] = None
    mask_kind: str = "none"
    mask_shape: Optional[Tuple[int, int, int, int]] = None
    diagonal_shift: int = 0
    has_sinks: bool = False

    @property
    def group(self) -> int:
        """Query heads per kv head (GQA/MQA)."""
        return self.q_heads // self.kv_heads

    @property
    def diagonal(self) -> int:
        """Offset of the bottom-right aligned diagonal: query i's own key is i + diagonal."""
        return self.kv_len - self.q_len + self.diagonal_shift

    def key_range(self, q_start: int, q_stop: int) -> Tuple[int, int]:
        """Keys [lo, hi) that any query in [q_start, q_stop) may see under causal/window.

        Array masks are not considered (they are data); an empty range has lo >= hi.
        """
        lo, hi = 0, self.kv_len
        if q_stop <= q_start:
            return 0, 0
        if self.causal:
            hi = min(hi, q_stop - 1 + self.diagonal + 1)
        if self.window is not None:
            left, right = self.window
            if left >= 0:
                lo = max(lo, q_start + self.diagonal - left)
            if right >= 0:
                hi = min(hi, q_stop - 1 + self.diagonal + right + 1)
        return max(lo, 0), max(min(hi, self.kv_len), 0)

    def query_range(self, k_start: int, k_stop: int) -> Tuple[int, int]:
        """Queries [lo, hi) that may see any key in [k_start, k_stop) under causal/window."""
        lo, hi = 0, self.q_len
        if k_stop <= k_start:
            return 0, 0
        if self.causal:
            lo = max(lo, k_start - self.diagonal)
        if self.window is not None:
            left, right = self.window
            if right >= 0:
                lo = max(lo, k_start - self.diagonal - right)
            if left >= 0:
                hi = min(hi, k_stop - 1 - self.diagonal + left + 1)
        return max(lo, 0), max(min(hi, self.q_len), 0)

    @property
    def has_band(self) -> bool:
        """Whether causal/window masking applies (computed from indices, no data)."""
        return self.causal or self.window is not None


@functools.lru_cache(maxsize=None)
def promote(a: mx.Dtype, b: mx.Dtype) -> mx.Dtype:
    """MLX's type promotion of two dtypes (as `a + b` would give)."""
    return (mx.array(0, dtype=a) + mx.array(0, dtype=b)).dtype


def _shape_str(x) -> str:
    return "(" + ", ".join(str(s) for s in x.shape) + ")"


def check_sinks(sinks, q_heads: int, dtype: mx.Dtype, name: str = "flash_attention") -> None:
    """Validate attention sinks as MLX does: an array of shape [Hq] whose dtype promotes to `dtype`.

    Raises:
        TypeError: sinks is not an mx.array.
        ValueError: a wrong rank, length (one logit per query head, also under GQA) or dtype.
    """
    if not isinstance(sinks, mx.array):
        raise TypeError(f"[{name}] sinks must be None or an mx.array of shape [Hq], got {type(sinks).__name__}.")
    if sinks.ndim != 1 or sinks.shape[0] != q_heads:
        raise ValueError(f"[{name}] sinks must have shape [Hq] = ({q_heads},) (one logit per query head), "
                         f"got shape {tuple(sinks.shape)}.")
    if promote(sinks.dtype, dtype) != dtype:
        raise ValueError(f"[{name}] the dtype of sinks ({sinks.dtype}) must promote to the output dtype {dtype}.")


def check_inputs(q, k, v, *, scale=None, mask=None, window_size=None, softcap=None,
                 sinks=None) -> Tuple[AttentionSpec, Optional[mx.array]]:
    """Validate a call and return its spec and the normalized array mask (rank 4, or None).

    Raises:
        TypeError: for non-arrays, non-floating or mismatched dtypes, or a mask of another dtype.
        ValueError: for bad ranks, shapes, scale, softcap, window or mask values, or bad sinks.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, mx.array):
            raise TypeError(f"[flash_attention] {name} must be an mx.array, got {type(x).__name__}.")
        if x.ndim != 4:
            raise ValueError(f"[flash_attention] {name} must have rank 4 [batch, heads, length, head_dim], "
                             f"got shape {_shape_str(x)} (rank {x.ndim}).")
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"[flash_attention] {name} must be float32, float16 or bfloat16, got {x.dtype}.")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"[flash_attention] q, k and v must share one dtype, got q {q.dtype}, "
                        f"k {k.dtype}, v {v.dtype}.")
    B, Hq, Nq, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"[flash_attention] batch sizes differ: q {_shape_str(q)}, k {_shape_str(k)}, "
                         f"v {_shape_str(v)}.")
    if k.shape[3] != D:
        raise ValueError(f"[flash_attention] head_dim of q ({D}) and k ({k.shape[3]}) differ: "
                         f"q {_shape_str(q)}, k {_shape_str(k)}.")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"[flash_attention] k and v must have the same heads and length, got "
                         f"k {_shape_str(k)}, v {_shape_str(v)}.")
    Hkv, Nk = k.shape[1], k.shape[2]
    if Hkv == 0 and Hq != 0 or (Hkv > 0 and Hq % Hkv != 0):
        raise ValueError(f"[flash_attention] the query heads ({Hq}) must be a multiple of the kv heads "
                         f"({Hkv}) (GQA/MQA), got q {_shape_str(q)}, k {_shape_str(k)}.")

    if scale is None:
        scale = 1.0 / math.sqrt(D) if D > 0 else 1.0
    if isinstance(scale, mx.array):
        if scale.size != 1:
            raise ValueError(f"[flash_attention] scale must be a scalar, got an array of shape {scale.shape}.")
        scale = scale.item()
    # float() would also parse strings ('0.1'): only numbers (and numpy scalars) are accepted.
    if isinstance(scale, (str, bytes)) or not isinstance(scale, (int, float)):
        try:
            if isinstance(scale, (str, bytes)):
                raise TypeError
            scale = float(scale)
        except (TypeError, ValueError):
            raise TypeError(f"[flash_attention] scale must be a real number or a scalar array, "
                            f"got {type(scale).__name__} {scale!r}.") from None
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"[flash_attention] scale must be finite, got {scale}.")

    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
            raise TypeError(f"[flash_attention] softcap must be a positive number or None, got {softcap!r}.")
        softcap = float(softcap)
        if not (softcap > 0 and math.isfinite(softcap)):
            raise ValueError(f"[flash_attention] softcap must be positive and finite, got {softcap}.")

    window = None
    if window_size is not None:
        try:
            left, right = window_size
        except (TypeError, ValueError):
            raise ValueError(f"[flash_attention] window_size must be a pair (left, right), got {window_size!r}.") from None
        for side, w in (("left", left), ("right", right)):
            if isinstance(w, bool) or not isinstance(w, int):
                raise TypeError(f"[flash_attention] window_size {side} must be an int, got {w!r}.")
            if w < -1:
                raise ValueError(f"[flash_attention] window_size {side} must be >= -1 (-1 = unbounded), "
                                 f"got window_size={window_size!r}.")
        window = (int(left), int(right)) if (left, right) != (-1, -1) else None

    causal = False
    mask_kind, mask_shape, mask_array = "none", None, None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"[flash_attention] mask must be None, \"causal\" or an array, got the string {mask!r}.")
        causal = True
    elif mask is not None:
        if not isinstance(mask, mx.array):
            raise TypeError(f"[flash_attention] mask must be None, \"causal\" or an mx.array, got {type(mask).__name__}.")
        if mask.dtype == mx.bool_:
            mask_kind = "bool"
        elif mx.issubdtype(mask.dtype, mx.floating):
            mask_kind = "additive"
            if promote(mask.dtype, q.dtype) != q.dtype:
                raise TypeError(f"[flash_attention] an additive mask must promote to q's dtype {q.dtype}, "
                                f"got mask dtype {mask.dtype}.")
        else:
            raise TypeError(f"[flash_attention] mask must be bool (True = keep) or floating (additive), "
                            f"got dtype {mask.dtype}.")
        if mask.ndim > 4:
            raise ValueError(f"[flash_attention] mask of shape {_shape_str(mask)} has rank {mask.ndim} > 4 and "
                             f"cannot broadcast to [B, Hq, Nq, Nk] = {(B, Hq, Nq, Nk)}.")
        full = (1,) * (4 - mask.ndim) + tuple(mask.shape)
        target = (B, Hq, Nq, Nk)
        if any(m not in (1, t) for m, t in zip(full, target)):
            raise ValueError(f"[flash_attention] mask of shape {_shape_str(mask)} is not broadcastable to "
                             f"[B, Hq, Nq, Nk] = {target}.")
        mask_shape = full
        mask_array = mask.reshape(full)

    if sinks is not None:
        check_sinks(sinks, Hq, q.dtype)

    spec = AttentionSpec(batch=B, q_heads=Hq, kv_heads=Hkv, q_len=Nq, kv_len=Nk, head_dim=D,
                         value_dim=v.shape[3], dtype=q.dtype, scale=scale, causal=causal,
                         window=window, softcap=softcap, mask_kind=mask_kind, mask_shape=mask_shape,
                         has_sinks=sinks is not None)
    return spec, mask_array


def mlx_argument_rules(q, k, v, mask, force_fused):
    """Apply `mx.fast.scaled_dot_product_attention`'s argument rules (MLX 0.32) ahead of the strict
    checks, so the drop-in accepts what MLX accepts and raises what MLX raises.

    q, k and v are promoted to their common dtype, which must be floating (MLX raises ValueError
    otherwise); an array mask that is not bool is additive and is cast to that dtype, which its
    dtype must promote to (integer masks included; ValueError otherwise). The rest (ranks, shapes,
    sinks) is checked by `check_inputs` with the same error types as MLX.

    Returns:
        (q, k, v, mask) ready for `check_inputs`.

    Raises:
        TypeError: q, k, v not arrays, or force_fused not a bool.
        ValueError: a non-floating common dtype, or a mask dtype that does not promote to it.
    """
    name = "[scaled_dot_product_attention]"
    for arg, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, mx.array):
            raise TypeError(f"{name} {arg} must be an mx.array, got {type(x).__name__}.")
    if not isinstance(force_fused, bool):
        raise TypeError(f"{name} force_fused must be a bool, got {force_fused!r}.")
    dtype = promote(promote(q.dtype, k.dtype), v.dtype)
    if not mx.issubdtype(dtype, mx.floating):
        raise ValueError(f"{name} q, k and v must promote to a floating dtype, got q {q.dtype}, "
                         f"k {k.dtype}, v {v.dtype} (promoted: {dtype}).")
    q, k, v = (x if x.dtype == dtype else x.astype(dtype) for x in (q, k, v))
    if isinstance(mask, mx.array) and mask.dtype != mx.bool_:
        if promote(mask.dtype, dtype) != dtype:
            raise ValueError(f"{name} an additive mask's dtype must promote to the output dtype {dtype}, "
                             f"got mask dtype {mask.dtype}.")
        if mask.dtype != dtype:
            mask = mask.astype(dtype)
    return q, k, v, mask

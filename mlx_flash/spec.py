"""Argument checking: turn a public call into an `AttentionSpec` or raise a clear error.

Every error names the offending argument and shows the values, in the style of MLX's
own messages. Nothing here touches array data, so checking costs no device work.
"""
from __future__ import annotations

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


def _shape_str(x) -> str:
    return "(" + ", ".join(str(s) for s in x.shape) + ")"


def check_inputs(q, k, v, *, scale=None, mask=None, window_size=None, softcap=None) -> Tuple[AttentionSpec, Optional[mx.array]]:
    """Validate a call and return its spec and the normalized array mask (rank 4, or None).

    Raises:
        TypeError: for non-arrays, non-floating or mismatched dtypes, or a mask of another dtype.
        ValueError: for bad ranks, shapes, scale, softcap, window or mask values.
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
            if (mx.array(0, dtype=mask.dtype) + mx.array(0, dtype=q.dtype)).dtype != q.dtype:
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

    spec = AttentionSpec(batch=B, q_heads=Hq, kv_heads=Hkv, q_len=Nq, kv_len=Nk, head_dim=D,
                         value_dim=v.shape[3], dtype=q.dtype, scale=scale, causal=causal,
                         window=window, softcap=softcap, mask_kind=mask_kind, mask_shape=mask_shape)
    return spec, mask_array

"""Attention layers on `mlx_flash.flash_attention`.

- `MultiHeadAttention`: a drop-in for `mlx.nn.MultiHeadAttention` (it subclasses it: same
  constructor, call signature, parameter names and shapes, so weights load either way).
- `GroupedQueryAttention`: the self-attention block of a decoder (Llama-style parameter names
  q_proj/k_proj/v_proj/o_proj), with GQA/MQA heads, causal / sliding-window / softcap options,
  optional RoPE and an optional KV cache.

    import mlx_flash.nn
    attention = mlx_flash.nn.GroupedQueryAttention(512, n_heads=8, n_kv_heads=2, rope=True)
    y = attention(x)    # x [batch, length, 512], causal by default
"""
from __future__ import annotations

import math
from typing import Any, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from .api import flash_attention
from .backends import BACKEND_NAMES


def _check_backend(layer: str, backend) -> str:
    if not isinstance(backend, str) or backend not in BACKEND_NAMES:
        raise ValueError(f"[{layer}] backend must be one of {BACKEND_NAMES}, got {backend!r}.")
    return backend


def _check_positive_int(layer: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"[{layer}] {name} must be a positive int, got {value!r}.")
    return value


class MultiHeadAttention(nn.MultiHeadAttention):
    """Drop-in for `mlx.nn.MultiHeadAttention` that runs `mlx_flash.flash_attention`.

    It is a subclass: the parameters (query_proj, key_proj, value_proj, out_proj), their shapes,
    `create_additive_causal_mask` and `isinstance` checks are MLX's, so weights saved from either
    class load into the other. The mask is what MLX's layer accepts: None, an additive float
    array (e.g. from `create_additive_causal_mask`), a bool array (True = keep) or "causal",
    broadcastable to (batch, num_heads, # queries, # keys).

    Args:
        dims (int): The model dimensions; the default for every other dimension.
        num_heads (int): The number of attention heads.
        query_input_dims (int, optional): Input dimensions of the queries. Default: ``dims``.
        key_input_dims (int, optional): Input dimensions of the keys. Default: ``dims``.
        value_input_dims (int, optional): Input dimensions of the values. Default: ``key_input_dims``.
        value_dims (int, optional): Dimensions of the projected values. Default: ``dims``.
        value_output_dims (int, optional): Output dimensions. Default: ``dims``.
        bias (bool, optional): Biases in the projections. Default: ``False``.
        backend (str, optional): The flash_attention backend ("auto", "mlx", "metal", "cuda").
            Default: ``"auto"``.
    """

    def __init__(self, dims: int, num_heads: int, query_input_dims: Optional[int] = None,
                 key_input_dims: Optional[int] = None, value_input_dims: Optional[int] = None,
                 value_dims: Optional[int] = None, value_output_dims: Optional[int] = None,
                 bias: bool = False, *, backend: str = "auto"):
        super().__init__(dims, num_heads, query_input_dims, key_input_dims, value_input_dims,
                         value_dims, value_output_dims, bias)
        # MLX checks dims only; an indivisible value_dims would fail later inside unflatten.
        if (value_dims or dims) % num_heads != 0:
            raise ValueError(f"[MultiHeadAttention] value_dims ({value_dims}) must be divisible by "
                             f"num_heads ({num_heads}).")
        self.backend = _check_backend("MultiHeadAttention", backend)

    def __call__(self, queries: mx.array, keys: mx.array, values: mx.array,
                 mask: Union[None, str, mx.array] = None, *,
                 window_size: Optional[Tuple[int, int]] = None,
                 softcap: Optional[float] = None) -> mx.array:
        """Attend from queries [B, Lq, query_input_dims] to keys/values [B, Lk, ...].

        Args:
            queries, keys, values (array): rank-3 inputs, as for `mlx.nn.MultiHeadAttention`.
            mask (array | "causal", optional): additive or bool mask broadcastable to
                (B, num_heads, Lq, Lk), or "causal" (bottom-right aligned). Default: ``None``.
            window_size ((int, int), optional): (left, right) sliding window, see
                `mlx_flash.flash_attention`.
            softcap (float, optional): scores become softcap * tanh(s / softcap).

        Returns:
            array: [B, Lq, value_output_dims].
        """
        queries = self.query_proj(queries)
        keys = self.key_proj(keys)
        values = self.value_proj(values)

        num_heads = self.num_heads
        queries = mx.unflatten(queries, -1, (num_heads, -1)).transpose(0, 2, 1, 3)
        keys = mx.unflatten(keys, -1, (num_heads, -1)).transpose(0, 2, 1, 3)
        values = mx.unflatten(values, -1, (num_heads, -1)).transpose(0, 2, 1, 3)
        scale = math.sqrt(1 / queries.shape[-1])
        output = flash_attention(queries, keys, values, scale=scale, mask=mask,
                                 window_size=window_size, softcap=softcap, backend=self.backend)
        output = output.transpose(0, 2, 1, 3).flatten(-2, -1)
        return self.out_proj(output)


class GroupedQueryAttention(nn.Module):
    """Decoder self-attention with grouped key/value heads, on `mlx_flash.flash_attention`.

    Parameter names and shapes follow mlx-lm's Llama attention (q_proj, k_proj, v_proj, o_proj),
    so its weights load as they are. k and v keep n_kv_heads heads (never tiled).

    Args:
        dims (int): Model dimensions (input and output).
        n_heads (int): Query heads.
        n_kv_heads (int, optional): Key/value heads; must divide ``n_heads`` (1 = multi-query).
            Default: ``n_heads``.
        head_dim (int, optional): Dimensions per head. Default: ``dims // n_heads``.
        bias (bool, optional): Biases in the projections. Default: ``False``.
        causal (bool, optional): Query i sees keys up to its own position (bottom-right
            aligned, so it stays right with a KV cache). Default: ``True``.
        window_size ((int, int), optional): (left, right) sliding window in FlashAttention-2
            terms (-1 = unbounded); a Mistral-style window of w tokens is ``(w - 1, 0)``.
            With ``causal`` the right side is 0 whatever is given. Default: ``None``.
        softcap (float, optional): Scores become softcap * tanh(s / softcap). Default: ``None``.
        scale (float, optional): Multiplies q k^T. Default: ``head_dim ** -0.5``.
        rope (bool | Module, optional): ``True`` applies ``mlx.nn.RoPE(head_dim, base=rope_base,
            traditional=rope_traditional)`` to q and k; a module (called as ``rope(x, offset=...)``,
            e.g. a scaled RoPE) is used as given. Default: ``False``.
        rope_base (float, optional): RoPE base when ``rope`` is True. Default: ``10000``.
        rope_traditional (bool, optional): RoPE layout when ``rope`` is True. Default: ``False``.
        backend (str, optional): The flash_attention backend. Default: ``"auto"``.
    """

    def __init__(self, dims: int, n_heads: int, n_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, *, bias: bool = False, causal: bool = True,
                 window_size: Optional[Tuple[int, int]] = None, softcap: Optional[float] = None,
                 scale: Optional[float] = None, rope: Union[bool, nn.Module] = False,
                 rope_base: float = 10000, rope_traditional: bool = False, backend: str = "auto"):
        super().__init__()
        name = "GroupedQueryAttention"
        _check_positive_int(name, "dims", dims)
        _check_positive_int(name, "n_heads", n_heads)
        n_kv_heads = n_heads if n_kv_heads is None else _check_positive_int(name, "n_kv_heads", n_kv_heads)
        if n_heads % n_kv_heads != 0:
            raise ValueError(f"[{name}] n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads}).")
        if head_dim is None:
            if dims % n_heads != 0:
                raise ValueError(f"[{name}] dims ({dims}) must be divisible by n_heads ({n_heads}) "
                                 f"unless head_dim is given.")
            head_dim = dims // n_heads
        _check_positive_int(name, "head_dim", head_dim)
        if window_size is not None:
            try:
                left, right = window_size
            except (TypeError, ValueError):
                raise ValueError(f"[{name}] window_size must be a pair (left, right), got {window_size!r}.") from None
            window_size = (left, 0 if causal else right)
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.causal = bool(causal)
        self.window_size = window_size
        self.softcap = softcap
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.backend = _check_backend(name, backend)

        self.q_proj = nn.Linear(dims, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dims, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dims, n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, dims, bias=bias)
        if isinstance(rope, nn.Module):
            self.rope = rope
        elif rope is True:
            self.rope = nn.RoPE(head_dim, traditional=rope_traditional, base=rope_base)
        elif rope is False or rope is None:
            self.rope = None
        else:
            raise TypeError(f"[{name}] rope must be a bool or an mlx.nn.Module, got {type(rope).__name__}.")

    def _masking(self, mask: Optional[mx.array]):
        """(mask, window_size) for flash_attention from the layer's options and a call's mask."""
        window = self.window_size
        if self.causal and window is None:
            if mask is None:
                return "causal", None
            # "causal" cannot be combined with an array mask in one argument; the causal band is
            # the window (unbounded left, 0 right), which skips the same blocks.
            window = (-1, 0)
        return mask, window

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache: Optional[Any] = None) -> mx.array:
        """Self-attention over x [B, L, dims].

        Args:
            x (array): Inputs [B, L, dims].
            mask (array, optional): An extra bool (True = keep) or additive mask broadcastable to
                (B, n_heads, L, L + cache offset), e.g. for padding; applied on top of
                ``causal`` / ``window_size``. Default: ``None``.
            cache (optional): A KV cache with ``offset`` and ``update_and_fetch(keys, values)``
                (e.g. ``mlx_lm.models.cache.KVCache``) for incremental decoding.

        Returns:
            array: [B, L, dims].
        """
        if x.ndim != 3:
            raise ValueError(f"[GroupedQueryAttention] x must have shape [batch, length, dims], got "
                             f"shape {tuple(x.shape)}.")
        B, L, _ = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        if self.rope is not None:
            queries = self.rope(queries, offset=offset)
            keys = self.rope(keys, offset=offset)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        attention_mask, window = self._masking(mask)
        output = flash_attention(queries, keys, values, scale=self.scale, mask=attention_mask,
                                 window_size=window, softcap=self.softcap, backend=self.backend)
        return self.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))

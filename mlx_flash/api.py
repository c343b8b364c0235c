"""The public API: validate, pick a backend, wrap it in mx.custom_function.

The forward returns (out, lse); the VJP reads lse from the saved outputs, so several
attention layers in one model each carry their own statistics and nothing is kept
between forward and backward outside the autograd graph.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Tuple, Union

import mlx.core as mx

from .backends import select_backend
from .spec import check_inputs


def _attention_function(backend, spec, has_mask: bool, lse_is_used: bool):
    """A custom_function (q, k, v[, mask]) -> (out, lse) whose VJP runs the backend's backward."""

    def forward(q, k, v, *mask):
        return backend.forward(q, k, v, mask[0] if has_mask else None, spec)

    attention = mx.custom_function(forward)

    @attention.vjp
    def attention_vjp(primals, cotangents, outputs):
        q, k, v = primals[:3]
        mask = primals[3] if has_mask else None
        d_out, d_lse = cotangents
        out, lse = outputs
        dq, dk, dv = backend.backward(q, k, v, mask, out, lse, d_out,
                                      d_lse if lse_is_used else None, spec)
        # Masks get no gradient.
        return (dq, dk, dv, mx.zeros_like(mask)) if has_mask else (dq, dk, dv)

    return attention


def flash_attention(q: mx.array, k: mx.array, v: mx.array, *, scale: Optional[float] = None,
                    mask: Union[None, str, mx.array] = None,
                    window_size: Optional[Tuple[int, int]] = None, softcap: Optional[float] = None,
                    return_lse: bool = False, backend: str = "auto",
                    stream: Union[None, mx.Stream, mx.Device] = None):
    """Fused, memory-efficient attention with gradients: softmax(q k^T * scale + mask) v.

    Args:
        q (array): queries [B, Hq, Nq, D].
        k (array): keys [B, Hkv, Nk, D], with Hq a multiple of Hkv (GQA/MQA; k is never tiled).
        v (array): values [B, Hkv, Nk, Dv] (Dv is usually D).
        scale (float, optional): multiplies q k^T. Default: 1 / sqrt(D).
        mask (None | "causal" | array, optional): "causal" is bottom-right aligned (query i sees
            key j iff j <= i + Nk - Nq); a bool array keeps True entries; a floating array is added
            to the scores. Arrays broadcast to [B, Hq, Nq, Nk] and get no gradient.
        window_size ((int, int), optional): (left, right) sliding window, FlashAttention-2
            semantics: query i sees keys in [i + Nk - Nq - left, i + Nk - Nq + right]; -1 = unbounded.
        softcap (float, optional): scores become softcap * tanh(s / softcap) before masking (Gemma 2).
        return_lse (bool): also return lse [B, Hq, Nq] fp32, the natural-log logsumexp of the
            final scores (-inf for rows that see no key; those rows output 0).
        backend (str): "auto" (by the stream's device: Metal GPU -> "metal", CUDA GPU -> "cuda",
            otherwise "mlx"), "mlx" (blocked MLX ops, any device), "metal" or "cuda"; or a backend
            object (e.g. mlx_flash.backends.cuda.CUDABackend(tuning=...)).
        stream (Stream | Device, optional): where to run.

    Returns:
        array: out [B, Hq, Nq, Dv] in q's dtype; or (out, lse) when return_lse is True.
    """
    spec, mask_array = check_inputs(q, k, v, scale=scale, mask=mask, window_size=window_size, softcap=softcap)
    if not isinstance(return_lse, bool):
        raise TypeError(f"[flash_attention] return_lse must be a bool, got {return_lse!r}.")
    chosen = select_backend(backend, spec, stream, None if mask_array is None else mask_array.dtype,
                            lse_is_used=return_lse)
    with (mx.stream(stream) if stream is not None else contextlib.nullcontext()):
        if getattr(chosen, "whole_function", False):
            # mx.fast with MLX's own VJP (the fallback rule never picks it when lse is asked for).
            return chosen.attention(q, k, v, mask_array, spec)
        attention = _attention_function(chosen, spec, mask_array is not None, return_lse)
        inputs = (q, k, v) if mask_array is None else (q, k, v, mask_array)
        out, lse = attention(*inputs)
    return (out, lse) if return_lse else out


def scaled_dot_product_attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float,
                                 mask: Union[None, str, mx.array] = None,
                                 stream: Union[None, mx.Stream, mx.Device] = None) -> mx.array:
    """Drop-in for `mx.fast.scaled_dot_product_attention` (same signature and semantics), fused
    forward and backward. See `flash_attention` for the argument meanings."""
    return flash_attention(q, k, v, scale=scale, mask=mask, stream=stream)

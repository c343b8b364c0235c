"""The public API: validate, pick a backend, wrap it in mx.custom_function.

The forward returns (out, lse); the VJP reads lse from the saved outputs, so several
attention layers in one model each carry their own statistics and nothing is kept
between forward and backward outside the autograd graph. What a call signature decides (the
spec, the backend, the custom function) is kept by mlx_flash/call_cache.py for its next call.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Union

import mlx.core as mx

from . import call_cache
from .backends import Choice, choose_backend
from .backends.common import heads_view
from .fallback import record_fallback
from .spec import FLOAT_DTYPES, check_inputs, mlx_argument_rules

def takes_row_contiguous(backend) -> bool:
    """Whether `backend` reads row-contiguous q, k, v and d_out only, i.e. its kernels are launched
    with ensure_row_contiguous=True, which copies a strided input (mlx-lm's q, k, v and the output's
    cotangent are transposed [B, N, H, D] views) at every launch.

    A backend says so with a `row_contiguous_inputs` attribute (default False). The shipped ones read
    their inputs where they lie: "mlx" through MLX ops, "metal" and "cuda" through the strides MLX
    passes to their kernels (mlx_flash/backends/common.py, STRIDED_INPUTS).
    """
    return bool(getattr(backend, "row_contiguous_inputs", False))


def writes_token_major(backend) -> bool:
    """Whether `backend.forward`'s out is a [B, H, N, D] view of a [B, N, H, D] buffer (the kernel
    backends: mlx_flash/backends/common.py). Declared with a `token_major_outputs` attribute."""
    return bool(getattr(backend, "token_major_outputs", False))


def _attention_function(backend, spec, has_mask: bool, lse_is_used: bool):
    """A custom_function (q, k, v[, mask][, sinks]) -> (out, lse) whose VJP runs the backend's backward.

    sinks is a differentiable primal (its gradient comes from the backward); the mask gets none.
    For a backend that reads row-contiguous arrays only, the caller passes q, k, v made contiguous
    once (`flash_attention`), and d_out is made contiguous here once: otherwise each of the
    backward's three launches (preprocessing, dQ, dK/dV) copied a strided d_out again (and dQ, dK/dV
    strided q, k, v), ~224 MiB of copies per mlx-lm Llama layer at N = 16K (Hq 16, Hkv 4, D 128, bf16).

    For a backend that writes token-major outputs, the custom function returns out as its
    [B, N, H, D] buffer (the caller takes the [B, H, N, D] view), so d_out arrives [B, N, H, D]-shaped
    and is made row-contiguous here: no copy where a model transposes and reshapes the output
    (mlx-lm: the cotangent is then row-contiguous already), one copy of a broadcast cotangent
    (out.sum()'s), which the kernels would otherwise read through gathered loads at every step
    (fwd+bwd took 4-5x as long on an H200), and one of a [B, H, N, D] one (docs/cuda_notes.md,
    "Strided inputs": the ways past it measured so far).
    """
    token_major = writes_token_major(backend)
    contiguous_d_out = takes_row_contiguous(backend)

    def split(primals):
        q, k, v = primals[:3]
        mask = primals[3] if has_mask else None
        sinks = primals[-1] if spec.has_sinks else None
        return q, k, v, mask, sinks

    def forward(*primals):
        q, k, v, mask, sinks = split(primals)
        out, lse = backend.forward(q, k, v, mask, spec, sinks=sinks)
        return (out.transpose(0, 2, 1, 3) if token_major else out), lse

    attention = mx.custom_function(forward)

    @attention.vjp
    def attention_vjp(primals, cotangents, outputs):
        q, k, v, mask, sinks = split(primals)
        d_out, d_lse = cotangents
        out, lse = outputs
        if token_major:
            out, d_out = heads_view(out), heads_view(mx.contiguous(d_out))
        elif contiguous_d_out:
            d_out = mx.contiguous(d_out)  # no copy when it is row-contiguous already
        dq, dk, dv, d_sinks = backend.backward(q, k, v, mask, out, lse, d_out,
                                               d_lse if lse_is_used else None, spec, sinks=sinks)
        grads = (dq, dk, dv)
        if has_mask:
            # Masks get no gradient: a broadcast zero (no mask-sized buffer even if evaluated).
            grads += (mx.broadcast_to(mx.array(0, mask.dtype), mask.shape),)
        if spec.has_sinks:
            grads += (d_sinks,)
        return grads

    return attention


def flash_attention(q: mx.array, k: mx.array, v: mx.array, *, scale: Optional[float] = None,
                    mask: Union[None, str, mx.array] = None,
                    window_size: Optional[Tuple[int, int]] = None, softcap: Optional[float] = None,
                    sinks: Optional[mx.array] = None, return_lse: bool = False, backend: str = "auto",
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
        sinks (array, optional): attention sinks [Hq], one logit per query head (as MLX's `sinks=`,
            gpt-oss): an extra score in every row's softmax that adds no value. Its dtype must promote
            to q's; it is differentiable (the gradient is fused into the backward).
        return_lse (bool): also return lse [B, Hq, Nq] fp32, the natural-log logsumexp of the
            final scores, sinks included (-inf for rows that see no key and have no sink; rows that
            see no key output 0).
        backend (str): "auto" (by the stream's device: Metal GPU -> "metal", CUDA GPU -> "cuda",
            otherwise "mlx"), "mlx" (blocked MLX ops, any device), "metal" or "cuda"; or a backend
            object (e.g. mlx_flash.backends.cuda.CUDABackend(tuning=...)).
        stream (Stream | Device, optional): where to run.

    Returns:
        array: out [B, Hq, Nq, Dv] in q's dtype; or (out, lse) when return_lse is True.
    """
    key = call_cache.call_key(q, k, v, scale, mask, window_size, softcap, sinks, return_lse, backend, stream)
    now = call_cache.stamp()
    decision = _DECISIONS.lookup(key, now)
    if decision is None:
        decision = _decide(q, k, v, scale, mask, window_size, softcap, sinks, return_lse, backend, stream)
        _DECISIONS.store(key, now, decision)
    if decision.direct is not None and stream is None:  # (the key holds the stream's device only)
        decision.choice.record()
        return decision.direct(q, k, v)
    return decision.run(q, k, v, mask, sinks, stream)


@dataclass(frozen=True)
class _Decision:
    """What flash_attention decided for a call signature: the spec, the serving backend (with the
    route or fallback that choosing it counts) and how it runs (whole, or the custom function)."""

    spec: object
    choice: Choice
    attention: Optional[Callable]  # the custom function; None: the backend serves the call whole
    return_lse: bool
    # (q, k, v) -> out: a whole call with nothing to add around it (the backend's direct_call: no
    # array mask, sinks or lse), taken without `run`'s steps by calls without a stream argument.
    direct: Optional[Callable] = None

    def run(self, q, k, v, mask, sinks, stream):
        self.choice.record()
        spec, chosen = self.spec, self.choice.backend
        mask_array = None
        if spec.mask_shape is not None:
            mask_array = mask if mask.ndim == 4 else mask.reshape(spec.mask_shape)
        with (mx.stream(stream) if stream is not None else contextlib.nullcontext()):
            if self.attention is None:
                # Differentiated by MLX itself: mx.fast (never with lse or sinks: the fallback rule), or
                # the "mlx" backend's small unbanded calls (one score block, P kept for the backward).
                if sinks is not None and sinks.dtype != q.dtype:
                    sinks = sinks.astype(q.dtype)
                out, lse = chosen.attention(q, k, v, mask_array, spec, sinks=sinks, return_lse=self.return_lse)
                return (out, lse) if self.return_lse else out
            if takes_row_contiguous(chosen):
                # One copy of a strided q, k or v (none for a row-contiguous one), made before the
                # custom function: the forward and both backward kernels read that copy, and it is what
                # the backward keeps (the strided view's buffer is freed unless the caller holds it).
                q, k, v = mx.contiguous(q), mx.contiguous(k), mx.contiguous(v)
            inputs = (q, k, v) if mask_array is None else (q, k, v, mask_array)
            if sinks is not None:
                # As MLX: the sinks join the softmax in the output dtype (astype carries the gradient back).
                inputs += (sinks if sinks.dtype == q.dtype else sinks.astype(q.dtype),)
            out, lse = self.attention(*inputs)
            if writes_token_major(chosen):
                out = heads_view(out)
        return (out, lse) if self.return_lse else out


_DECISIONS = call_cache.Kept()  # call_key -> _Decision


def _decide(q, k, v, scale, mask, window_size, softcap, sinks, return_lse, backend, stream) -> _Decision:
    """flash_attention's decisions for a call: its checks (raising on bad arguments), the backend
    choice (with the first-contact guard) and the custom function."""
    spec, mask_array = check_inputs(q, k, v, scale=scale, mask=mask, window_size=window_size, softcap=softcap,
                                    sinks=sinks)
    if not isinstance(return_lse, bool):
        raise TypeError(f"[flash_attention] return_lse must be a bool, got {return_lse!r}.")
    choice = choose_backend(backend, spec, stream, None if mask_array is None else mask_array.dtype,
                            lse_is_used=return_lse)
    chosen = choice.backend
    whole = getattr(chosen, "whole_function", None)
    with (mx.stream(stream) if stream is not None else contextlib.nullcontext()):  # whole_function asks the device
        attention = None
        if whole is None or not whole(spec):
            attention = _attention_function(chosen, spec, mask_array is not None, return_lse)
    direct = None
    if attention is None and sinks is None and not return_lse:
        direct_call = getattr(chosen, "direct_call", None)
        direct = direct_call(spec) if direct_call is not None else None
    return _Decision(spec, choice, attention, return_lse, direct)


def scaled_dot_product_attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float,
                                 mask: Union[None, str, mx.array] = None, sinks: Optional[mx.array] = None,
                                 force_fused: bool = False,
                                 stream: Union[None, mx.Stream, mx.Device] = None) -> mx.array:
    """Drop-in for `mx.fast.scaled_dot_product_attention`: the same signature, semantics and argument
    rules as MLX 0.32, fused forward and backward (the gradient of `sinks` included).

    MLX's rules that `flash_attention` does not apply: q, k and v of different dtypes are promoted
    to their common dtype; integer and other non-bool masks are additive (cast to that dtype);
    bad arguments raise the error types MLX raises. `force_fused` is accepted and has no effect:
    this path is always fused. float64 inputs (MLX runs them on the CPU) have no kernel here and
    are handed to MLX, warned once and counted as a fallback.
    See `flash_attention` for the argument meanings.
    """
    q, k, v, mask = mlx_argument_rules(q, k, v, mask, force_fused)
    if q.dtype not in FLOAT_DTYPES:
        record_fallback(f"scaled_dot_product_attention: {q.dtype} inputs have no mlx-flash path; using MLX's")
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks, stream=stream)
    return flash_attention(q, k, v, scale=scale, mask=mask, sinks=sinks, stream=stream)

"""The "fast" backend: MLX's own `mx.fast.scaled_dot_product_attention`, forward and VJP.

It serves calls that a kernel backend cannot (see `select_backend`) when MLX computes exactly
mlx-flash's function, and, under backend="auto" on CUDA, calls that kernels/dispatch_cuda.txt
routes here because mx.fast (cuDNN) was measured faster for them (dispatch.py). It is a
whole-function backend: `attention(q, k, v, mask, spec) -> out`, differentiated by MLX itself,
not a forward/backward pair under our custom_function. Why: mx.fast returns no lse, and
recovering it would take another pass over Q K^T (the work of a forward, and O(N^2) memory
unless blocked), while wrapping mx.fast's output in our VJP would replace cuDNN's fused backward
on CUDA with a slower one. So calls that need lse (return_lse,
an lse cotangent) never come here, and MLX's own VJP is the exact gradient of what it computed.

Where MLX's semantics differ from ours, this backend either makes them equal or refuses:
- rows that see no key: ours output 0 (gradient 0). MLX's unfused path fills masked scores
  with the dtype's lowest value, so such a row under a bool mask (or causal with Nq > Nk)
  averages all of V, and under an additive mask of -inf it is NaN. Array masks are therefore
  given one more visible column set per empty row (a bool mask keeps every key in such a row, an
  additive mask's row becomes 0), and the output of those rows is set to 0. The reduction reads
  the mask in its own (unbroadcast) shape, the same data the attention reads anyway. Causal with
  Nq > Nk: the first Nq - Nk rows see no key (output 0); the rest are a square causal problem.
- window, softcap, sinks: mx.fast has no window or softcap; its VJP refuses sinks. Refused.
- empty problems (a zero dimension): refused (the "mlx" backend returns the empty results).

Memory: mx.fast is fused only on some paths (MLX 0.32): on CUDA through cuDNN for fp16/bf16 with
D and Dv multiples of 8 up to 128 (forward and, when Nq is a multiple of 128, backward); on a
Metal GPU only outside autodiff (under grad MLX runs it unfused); on the CPU never. Unfused
forward+backward needs about 3.2 score matrices in the input dtype (measured on the CPU at
B=1, H=8, N=1024/2048, D=64: 3.38 / 3.19 fp32 matrices in fp32, 1.69 / 1.59 in fp16), so where
fusion is not certain the call comes here only if 4 score matrices (B*Hq*Nq*Nk elements of the
input dtype each) fit in 1/16 of the device's memory (or of MLX's memory limit, where lower);
larger problems go to the "mlx" backend,
whose memory grows linearly in N. On an 80 GB H100 that is bf16 B*Hq*Nq*Nk <= 640 M (H=16:
N <= 6300); on a 16 GB Mac 128 M (bf16 H=8: N <= 4096).
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import mlx.core as mx

from ..spec import AttentionSpec
from .budget import memory_budget_bytes

# Unfused peak per call estimated as this many score matrices in the input dtype (measured 3.2).
UNFUSED_SCORE_MATRICES = 4
# The share of the device's memory an unfused call may take before the "mlx" backend serves it.
UNFUSED_MEMORY_FRACTION = 1 / 16


def _cuda_fused(spec: AttentionSpec, device: mx.Device) -> bool:
    """Whether MLX 0.32 runs this call's forward and backward through cuDNN (O(N) memory)."""
    if device.type != mx.gpu or not (hasattr(mx, "cuda") and mx.cuda.is_available()):
        return False
    return cudnn_fuses(spec)


def cudnn_forward_fuses(spec: AttentionSpec) -> bool:
    """Whether MLX 0.32's CUDA backend runs the forward of a call of this spec through cuDNN: fp16 /
    bf16, D and Dv multiples of 8 up to 128."""
    dims_ok = all(d % 8 == 0 and d <= 128 for d in (spec.head_dim, spec.value_dim))
    return spec.dtype in (mx.float16, mx.bfloat16) and dims_ok


def cudnn_fuses(spec: AttentionSpec) -> bool:
    """Whether MLX 0.32's CUDA backend runs a call of this spec through cuDNN, forward and backward:
    the forward's rule (cudnn_forward_fuses) and the backward's query rows a multiple of 128."""
    rows = min(spec.q_len, spec.kv_len) if spec.causal else spec.q_len
    return cudnn_forward_fuses(spec) and rows % 128 == 0


def unfused_bytes(spec: AttentionSpec) -> int:
    """Estimated forward+backward peak of MLX's unfused attention for this call."""
    itemsize = 4 if spec.dtype == mx.float32 else 2
    return UNFUSED_SCORE_MATRICES * spec.batch * spec.q_heads * spec.q_len * spec.kv_len * itemsize


class FastBackend:
    """mx.fast.scaled_dot_product_attention as a whole-function backend (MLX's own VJP)."""

    name = "fast"

    def whole_function(self, spec: AttentionSpec) -> bool:
        """`attention` replaces the forward/backward pair for every call (see the module docstring)."""
        return True

    def unavailable_reason(self, device) -> Optional[str]:
        return None

    def cudnn_fuses(self, spec: AttentionSpec) -> bool:
        """Whether MLX's CUDA backend runs this call through cuDNN, forward and backward."""
        return cudnn_fuses(spec)

    def unsupported_reason(self, spec: AttentionSpec, lse_is_used: bool = False,
                           device: Optional[mx.Device] = None) -> Optional[str]:
        """Why mx.fast cannot serve this call exactly (or within memory), or None."""
        reason = self.inexact_reason(spec, lse_is_used)
        if reason is not None:
            return reason
        device = device or mx.default_device()
        if not _cuda_fused(spec, device):
            need, budget = unfused_bytes(spec), int(memory_budget_bytes(device) * UNFUSED_MEMORY_FRACTION)
            if need > budget:
                return (f"unfused under grad: about {need / 2**20:.0f} MiB > {budget / 2**20:.0f} MiB "
                        f"(1/16 of the device's memory or MLX's memory limit)")
        return None

    def inexact_reason(self, spec: AttentionSpec, lse_is_used: bool = False) -> Optional[str]:
        """Why mx.fast does not compute exactly this call's function (the "serves exactly" rule,
        shared by the fallback rule and the dispatch table's routing), or None."""
        if lse_is_used:
            return "lse is requested (mx.fast returns no lse)"
        if spec.window is not None:
            return "sliding window"
        if spec.softcap is not None:
            return "softcap"
        if getattr(spec, "has_sinks", False):
            return "attention sinks (MLX's VJP has no sink gradient)"
        if spec.diagonal_shift:
            return "a shifted causal diagonal (a ring attention step)"
        if min(spec.batch, spec.q_heads, spec.q_len, spec.kv_len, spec.head_dim, spec.value_dim) == 0:
            return "an empty dimension"
        return None

    def direct_call(self, spec: AttentionSpec) -> Optional[Callable]:
        """(q, k, v) -> out where a call of `spec` is mx.fast's own call with nothing around it (no
        array mask, no query rows before the causal diagonal), else None. flash_attention keeps it
        with the call's decision and calls it directly, so a routed call costs on top of MLX's own
        only the decision's lookup: on the H200 machine's host, building a routed forward took 5.4
        us against 9.4 through `attention` (mx.fast's own 1.4-2.0; benchmarks/host_time.py, "auto")."""
        if spec.mask_kind != "none" or (spec.causal and spec.q_len > spec.kv_len):
            return None
        return functools.partial(mx.fast.scaled_dot_product_attention, scale=spec.scale,
                                 mask="causal" if spec.causal else None)

    def attention(self, q, k, v, mask, spec: AttentionSpec, sinks=None, return_lse: bool = False):
        """(out [B, Hq, Nq, Dv] in q's dtype, None); `mask` is None or the rank-4 array mask.
        The fallback rule and the dispatch table never send sinks or lse here (inexact_reason)."""
        if sinks is not None or return_lse:
            raise ValueError("[flash_attention] mx.fast cannot serve sinks or return_lse.")
        return self._out(q, k, v, mask, spec), None

    def _out(self, q, k, v, mask, spec: AttentionSpec) -> mx.array:
        if spec.causal and spec.q_len > spec.kv_len:
            blind = spec.q_len - spec.kv_len  # query rows before the first key's diagonal
            seen = mx.fast.scaled_dot_product_attention(q[:, :, blind:], k, v, scale=spec.scale, mask="causal")
            zeros = mx.zeros((spec.batch, spec.q_heads, blind, spec.value_dim), seen.dtype)
            return mx.concatenate([zeros, seen], axis=2)
        if mask is None:
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=spec.scale,
                                                        mask="causal" if spec.causal else None)
        if mask.dtype == mx.bool_:
            row_seen = mask.any(axis=-1, keepdims=True)
            mask = mx.logical_or(mask, mx.logical_not(row_seen))
        else:
            row_seen = (mask > -math.inf).any(axis=-1, keepdims=True)
            mask = mx.where(row_seen, mask, mx.zeros_like(mask))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=spec.scale, mask=mask)
        return mx.where(row_seen, out, mx.zeros_like(out))


BACKEND = FastBackend()

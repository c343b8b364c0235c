"""Backend registry and selection.

A backend is an object with:
    name: str
    unavailable_reason(device) -> str | None   # None when it can run on that device
    unsupported_reason(spec) -> str | None     # None when it serves this call natively
    forward(q, k, v, mask, spec, sinks=None) -> (out, lse)
    backward(q, k, v, mask, out, lse, d_out, d_lse, spec, sinks=None, lse_is_local=True)
        -> (dq, dk, dv, d_sinks)
and, for backends of compiled kernels, what the first-contact guard (backends/guard.py) needs:
    variant_key(spec, mask_dtype) -> hashable     # the set of kernel variants a call runs
    variant_name(kernel, spec, mask_dtype) -> str # readable name of one of them
mask is None or a rank-4 array broadcastable to [B, Hq, Nq, Nk]; lse is fp32 [B, Hq, Nq]
(natural log, sinks included; -inf for rows that see no key and have no sink); d_lse is None when
lse's cotangent is known zero. The backward's P is exp(S - lse); lse_is_local=False says that lse
covers more keys than the call's (the ring's key pieces), so P is not the softmax of the call's
scores. sinks is None (spec.has_sinks False) or [Hq] in q's dtype, one extra
softmax logit per query head with no value; d_sinks is its gradient [Hq] in sinks' dtype, None
when sinks is None.
A backend may also serve some calls whole: whole_function(spec) -> bool says which, and
attention(q, k, v, mask, spec, sinks=None, return_lse=False) -> (out, lse or None) computes them
with MLX's own VJP instead of the forward/backward pair. The "fast" backend
(mx.fast.scaled_dot_product_attention, fast.py) serves every call so; only the fallback rule and,
under backend="auto" on CUDA, the dispatch table (dispatch.py: where a recorded run measured
mx.fast faster) choose it. The "mlx" backend serves its small calls so (mlx_ops.whole_function:
P kept instead of recomputed).
Modules are imported lazily so a missing Metal or CUDA toolchain never breaks `import mlx_flash`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import os
from types import MappingProxyType
from typing import Optional

import mlx.core as mx

from . import dispatch
from ..fallback import record_fallback, record_route

_MODULES = MappingProxyType({"mlx": "mlx_flash.backends.mlx_ops", "metal": "mlx_flash.backends.metal",
                             "cuda": "mlx_flash.backends.cuda", "fast": "mlx_flash.backends.fast"})
# What the `backend` argument accepts ("fast" is reached through the fallback rule only).
BACKEND_NAMES = ("auto", "mlx", "metal", "cuda")


@functools.lru_cache(maxsize=None)
def get_backend(name: str):
    """The backend object for `name` ("mlx", "metal", "cuda" or "fast")."""
    try:
        module = importlib.import_module(_MODULES[name])
    except ModuleNotFoundError as e:
        if e.name == _MODULES[name]:
            raise ValueError(f"[flash_attention] backend {name!r} is not built into this version of mlx-flash.") from None
        raise
    return module.BACKEND


def metal_simulated() -> bool:
    """MLX_FLASH_METAL_SIM=1: run the Metal backend's kernels through mlx_flash.metalsim."""
    return os.environ.get("MLX_FLASH_METAL_SIM", "0") not in ("", "0", "false", "False")


def stream_device(stream) -> mx.Device:
    if stream is None:
        return mx.default_device()
    if isinstance(stream, mx.Device):
        return stream
    if isinstance(stream, mx.DeviceType):  # mx.cpu / mx.gpu, as MLX's own functions accept
        return mx.Device(stream)
    if isinstance(stream, mx.Stream):
        return stream.device
    raise TypeError(f"[flash_attention] stream must be None, an mx.Stream, mx.Device or mx.cpu/mx.gpu, got {type(stream).__name__}.")


def auto_backend_name(device: mx.Device) -> str:
    """What "auto" means on `device`: Metal GPU -> metal, CUDA GPU -> cuda, otherwise mlx."""
    if device.type == mx.gpu:
        if mx.metal.is_available():
            return "metal"
        if hasattr(mx, "cuda") and mx.cuda.is_available():
            return "cuda"
    if metal_simulated():
        return "metal"
    return "mlx"


def _is_backend(value) -> bool:
    return not isinstance(value, str) and all(
        hasattr(value, a) for a in ("name", "unavailable_reason", "unsupported_reason", "forward", "backward"))


@dataclasses.dataclass(frozen=True)
class Choice:
    """The backend that serves a call and what choosing it counts: a dispatch route or a fallback
    reason is recorded on every call it decides (`record`), also when the choice is reused
    (mlx_flash/call_cache.py)."""

    backend: object
    route: Optional[str] = None  # record_route's reason
    fallback: Optional[str] = None  # record_fallback's reason

    def record(self) -> None:
        if self.route is not None:
            record_route(self.route)
        if self.fallback is not None:
            record_fallback(self.fallback)


def select_backend(name, spec, stream, mask_dtype=None, lse_is_used: bool = False):
    """Resolve the `backend` argument to a backend object for this call (choose_backend's
    choice, its route or fallback counted)."""
    choice = choose_backend(name, spec, stream, mask_dtype, lse_is_used)
    choice.record()
    return choice.backend


def choose_backend(name, spec, stream, mask_dtype=None, lse_is_used: bool = False) -> Choice:
    """Which backend serves this call (a `Choice`; nothing counted yet: its `record` does that).

    An unknown name or an explicitly requested backend that cannot run on the stream's
    device raises. Under "auto", a call that the dispatch table routes (dispatch_route) goes to
    mx.fast (the Choice's route: counted in mlx_flash.route_counts()); an explicit backend always
    runs itself. Otherwise, when the chosen backend cannot serve the call (it is unavailable under
    "auto", or its unsupported_reason -- an unsupported dtype, shape or architecture -- or the
    first-contact guard (guard.py) names a reason), `fallback_backend` picks the path that serves
    it (the Choice's fallback: warned once per reason, counted for every call).

    Args:
        name: the `backend` argument ("auto", "mlx", "metal" or "cuda"), or a backend object
            (e.g. a CUDABackend with its own tuning, or the CUDA emulator's), used as if requested.
        spec: the call's AttentionSpec.
        stream: the `stream` argument (None, a Stream, a Device or mx.cpu / mx.gpu).
        mask_dtype: the array mask's dtype (part of a compiled kernel variant), or None.
        lse_is_used: whether the caller needs lse (return_lse), which mx.fast cannot give.
    """
    device = stream_device(stream)
    if _is_backend(name):
        backend, name, explicit = name, name.name, True
    elif not isinstance(name, str) or name not in BACKEND_NAMES:
        raise ValueError(f"[flash_attention] backend must be one of {BACKEND_NAMES} or a backend object, got {name!r}.")
    else:
        explicit = name != "auto"
        if not explicit:
            name = auto_backend_name(device)
        backend = get_backend(name)
    reason = backend.unavailable_reason(device)
    if reason is not None:
        if explicit:
            raise ValueError(f"[flash_attention] backend {name!r} is not available: {reason}")
        return fallback_backend(f"backend {name!r} unavailable ({reason})", spec, device, lse_is_used)
    if not explicit:
        row = dispatch_route(backend, spec, lse_is_used)
        if row is not None:  # a choice, not a fallback: counted, not warned
            return Choice(get_backend("fast"), route=f"{dispatch.TABLE_NAME} line {row.line}: {row.describe()}; "
                                                     f"using mx.fast.scaled_dot_product_attention")
    reason = backend.unsupported_reason(spec)
    if reason is None and hasattr(backend, "variant_key"):
        from ..autotune import FIRST_USE  # MLX_FLASH_AUTOTUNE=1: tune this shape's rows once, first
        from .guard import GUARD  # first use of these kernel variants in this process: build, run, check
        with (mx.stream(stream) if stream is not None else contextlib.nullcontext()):
            FIRST_USE.maybe_tune(backend, spec)
            reason = GUARD.verdict(backend, spec, mask_dtype)
    if reason is not None:
        return fallback_backend(f"backend {name!r} cannot serve this call ({reason})", spec, device,
                                lse_is_used)
    return Choice(backend)


def dispatch_route(backend, spec, lse_is_used: bool = False):
    """The dispatch table row (dispatch.py) that routes this call from `backend` to mx.fast, or None.

    Only the "cuda" backend's calls route, and only where the "fast" backend serves the call
    exactly (its inexact_reason: the one "serves exactly" rule, also fallback_backend's), MLX runs
    it through cuDNN forward and backward (fast.cudnn_fuses: O(N) memory, so no memory budget
    applies) and a row of the backend's GPU family covers its dtype, head dim, mask and N. No
    device argument: an available "cuda" backend means a CUDA GPU, and the plan inspector asks
    about GPUs it does not run on.

    Args:
        backend: the backend "auto" resolved to (available on the call's device).
        spec: the call's AttentionSpec.
        lse_is_used: whether the caller asked for lse.
    """
    if backend.name != "cuda" or not hasattr(backend, "family"):
        return None
    family = backend.family()
    if family is None:
        return None
    row = dispatch.dispatch_row(family.name, spec)
    if row is None:
        return None
    fast = get_backend("fast")
    if fast.inexact_reason(spec, lse_is_used) is not None or not fast.cudnn_fuses(spec):
        return None
    return row


def fallback_backend(why: str, spec, device: mx.Device, lse_is_used: bool) -> Choice:
    """The rule, in one place: which path serves a call that the chosen backend cannot.

    MLX's mx.fast.scaled_dot_product_attention ("fast") where it computes exactly our function
    (no window, softcap, sinks or lse; masks and rows that see no key are made equal, see fast.py)
    and, unless it runs fused forward and backward there, its unfused memory fits the budget;
    otherwise the blocked "mlx" backend. The Choice's fallback reason names the destination: it is
    warned once per (reason, destination) and counted for every call.

    Args:
        why: what the chosen backend could not do (the first part of the counted reason).
        spec: the call's AttentionSpec.
        device: the device that runs the call.
        lse_is_used: whether the caller asked for lse.
    """
    fast = get_backend("fast")
    refused = fast.unsupported_reason(spec, lse_is_used, device)
    if refused is None:
        return Choice(fast, fallback=f"{why}; using mx.fast.scaled_dot_product_attention")
    return Choice(get_backend("mlx"), fallback=f"{why}; using 'mlx' (mx.fast cannot: {refused})")

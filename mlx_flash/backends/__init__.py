"""Backend registry and selection.

A backend is an object with:
    name: str
    unavailable_reason(device) -> str | None   # None when it can run on that device
    unsupported_reason(spec) -> str | None     # None when it serves this call natively
    forward(q, k, v, mask, spec, sinks=None) -> (out, lse)
    backward(q, k, v, mask, out, lse, d_out, d_lse, spec, sinks=None) -> (dq, dk, dv, d_sinks)
mask is None or a rank-4 array broadcastable to [B, Hq, Nq, Nk]; lse is fp32 [B, Hq, Nq]
(natural log, sinks included; -inf for rows that see no key and have no sink); d_lse is None when
lse's cotangent is known zero. sinks is None (spec.has_sinks False) or [Hq] in q's dtype, one extra
softmax logit per query head with no value; d_sinks is its gradient [Hq] in sinks' dtype, None
when sinks is None.
Modules are imported lazily so a missing Metal or CUDA toolchain never breaks `import mlx_flash`.
"""
from __future__ import annotations

import functools
import importlib
import os

import mlx.core as mx

from ..fallback import record_fallback

_MODULES = {"mlx": "mlx_flash.backends.mlx_ops", "metal": "mlx_flash.backends.metal",
            "cuda": "mlx_flash.backends.cuda"}
BACKEND_NAMES = ("auto",) + tuple(_MODULES)


@functools.lru_cache(maxsize=None)
def get_backend(name: str):
    """The backend object for `name` ("mlx", "metal" or "cuda")."""
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


def select_backend(name, spec, stream):
    """Resolve the `backend` argument to a backend object for this call.

    An unknown name or an explicitly requested backend that cannot run on the stream's
    device raises. A backend that runs but cannot serve this particular call natively
    hands it to the "mlx" backend, warning once per reason and counting it.
    """
    if not isinstance(name, str) or name not in BACKEND_NAMES:
        raise ValueError(f"[flash_attention] backend must be one of {BACKEND_NAMES}, got {name!r}.")
    device = stream_device(stream)
    explicit = name != "auto"
    if not explicit:
        name = auto_backend_name(device)
    backend = get_backend(name)
    reason = backend.unavailable_reason(device)
    if reason is not None:
        if explicit:
            raise ValueError(f"[flash_attention] backend {name!r} is not available: {reason}")
        record_fallback(f"backend {name!r} unavailable ({reason}); using 'mlx'")
        return get_backend("mlx")
    reason = backend.unsupported_reason(spec)
    if reason is not None:
        record_fallback(f"backend {name!r} cannot serve this call ({reason}); using 'mlx'")
        return get_backend("mlx")
    return backend

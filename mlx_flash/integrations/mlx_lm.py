"""Make every mlx-lm model attend with `mlx_flash.flash_attention`.

    from mlx_flash.integrations import mlx_lm as flash_mlx_lm
    flash_mlx_lm.patch()          # or: with flash_mlx_lm.patched(): ...
    model, tokenizer = mlx_lm.load(...)   # train / evaluate / generate as usual
    flash_mlx_lm.unpatch()

mlx-lm's model files call `scaled_dot_product_attention(queries, keys, values, cache, scale,
mask, sinks=None)`, bound with `from .base import scaled_dot_product_attention`. So a model
module imported before `patch()` holds its own reference to mlx-lm's function. `patch()`
therefore rebinds that name wherever it is mlx-lm's function, in `mlx_lm.models.base` and in
every loaded `mlx_lm` module (by identity, so a model that defines its own attention function
under that name is left alone). Modules imported later need no import hook: their
`from .base import ...` runs after the patch and binds the flash function from `base` itself
(as does `importlib.reload`). `unpatch()` puts mlx-lm's function object back everywhere the
flash function is bound, including modules imported while patched.

Arguments follow `mx.fast.scaled_dot_product_attention`'s rules (mixed q/k/v dtypes promote,
integer masks are additive) and attention sinks are forwarded (gpt-oss, mimo), gradient included.
Calls that flash attention does not serve go to mlx-lm's own function, counted by reason in
`mlx_flash.fallback_counts()` (and warned once): quantized KV caches, decode steps (Nq <= 8,
where MLX has a fused vector kernel) and inputs MLX's rules reject. `call_counts()` counts calls
per path, and per model and reason with `by_model=True`. Both count Python-level calls: inside
an `mx.compile`d function (mlx-lm's training step) the attention function runs once per trace,
not once per executed step.

Models that write attention by hand or call `mx.fast.scaled_dot_product_attention` directly
are reached through the small per-model adapters of `mlx_lm_adapters` (gemma2, gear, plamo2,
muse_spark), applied and undone with the patch; `mlx_lm_adapters.NOT_ADAPTED` lists the models
left as they are and why. A function compiled with `mx.compile` while patched keeps the path
it was traced with until it is traced again.
"""
from __future__ import annotations

import collections
import contextlib
import importlib
import sys
import threading
import types
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import mlx.core as mx

from ..api import flash_attention
from ..backends import BACKEND_NAMES
from ..fallback import record_fallback
from ..spec import check_inputs, mlx_argument_rules

ATTRIBUTE = "scaled_dot_product_attention"
# Up to this many queries per call, MLX's fused single-pass ("vector") kernel is the better
# tool (decoding); flash attention pays off on long query blocks (prefill and training).
DECODE_QUERY_LENGTH = 8

_FLASH = "flash"
_ORIGINAL = "original"


@dataclass(frozen=True)
class _Patch:
    original: Callable
    replacement: Callable
    backend: str


_lock = threading.RLock()
_active: Optional[_Patch] = None
_calls: collections.Counter = collections.Counter()
_calls_lock = threading.Lock()


def _count(path: str, model: str, reason: Optional[str] = None) -> None:
    with _calls_lock:
        _calls[(model, path, reason)] += 1


def call_counts(by_model: bool = False) -> Dict:
    """Calls of the patched attention since start (or the last reset), by the path that served
    them: "flash" (mlx_flash) and "original" (mlx-lm's or MLX's function; the reasons are also
    in `mlx_flash.fallback_counts()`). Under `mx.compile` a call is counted once per trace.

    Args:
        by_model (bool): break the counts down per model module (e.g. "gpt_oss") as
            {model: {"flash": n, "original": {reason: n}}}. Default: totals per path.
    """
    with _calls_lock:
        items = list(_calls.items())
    if not by_model:
        totals = {_FLASH: 0, _ORIGINAL: 0}
        for (_, path, _), n in items:
            totals[path] += n
        return totals
    models: Dict[str, Dict] = {}
    for (model, path, reason), n in items:
        entry = models.setdefault(model, {_FLASH: 0, _ORIGINAL: {}})
        if path == _FLASH:
            entry[_FLASH] += n
        else:
            entry[_ORIGINAL][reason] = entry[_ORIGINAL].get(reason, 0) + n
    return models


def reset_call_counts() -> None:
    """Set `call_counts()` back to zero (tests use this)."""
    with _calls_lock:
        _calls.clear()


def model_name(module_name: Optional[str]) -> str:
    """"gpt_oss" for "mlx_lm.models.gpt_oss"; other callers keep their module name."""
    name = module_name or "?"
    return name[len("mlx_lm.models."):] if name.startswith("mlx_lm.models.") else name


def fallback_reason(queries, keys, values, cache, scale, mask, sinks=None, softcap=None) -> Optional[str]:
    """Why MLX's or mlx-lm's own attention should serve this call, or None when mlx_flash serves it."""
    if hasattr(cache, "bits"):
        return "mlx-lm quantized KV cache (cache.bits): served by mlx-lm's quantized attention"
    if isinstance(queries, mx.array) and queries.ndim == 4 and queries.shape[2] <= DECODE_QUERY_LENGTH:
        return (f"mlx-lm decode step (query length <= {DECODE_QUERY_LENGTH}): served by MLX's fused "
                f"vector kernel")
    if isinstance(mask, str) and mask != "causal":
        return f"mlx-lm mask {mask!r}: flash_attention understands only \"causal\" among strings"
    if mask is not None and not isinstance(mask, (str, mx.array)):
        return f"mlx-lm mask of type {type(mask).__name__}: flash_attention takes None, \"causal\" or an array"
    try:
        queries, keys, values, mask = mlx_argument_rules(queries, keys, values, mask, False)
        check_inputs(queries, keys, values, scale=scale, mask=mask, sinks=sinks, softcap=softcap)
    except (TypeError, ValueError) as error:
        return f"mlx-lm attention inputs MLX's rules reject ({error})"
    return None


def flash(queries, keys, values, *, scale, mask, sinks=None, softcap=None, backend="auto"):
    """mlx_flash attention under MLX's argument rules (the call passed `fallback_reason`)."""
    queries, keys, values, mask = mlx_argument_rules(queries, keys, values, mask, False)
    return flash_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks, softcap=softcap,
                           backend=backend)


def _make_replacement(original: Callable, backend: str) -> Callable:
    """The patched function: mlx-lm's signature, flash attention where it applies."""

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        model = model_name(sys._getframe(1).f_globals.get("__name__"))
        reason = fallback_reason(queries, keys, values, cache, scale, mask, sinks)
        if reason is not None:
            record_fallback(reason)
            _count(_ORIGINAL, model, reason)
            # Older mlx-lm versions have no sinks parameter; pass it only when it is used.
            extra = {} if sinks is None else {"sinks": sinks}
            return original(queries, keys, values, cache, scale=scale, mask=mask, **extra)
        _count(_FLASH, model)
        return flash(queries, keys, values, scale=scale, mask=mask, sinks=sinks, backend=backend)

    scaled_dot_product_attention.__doc__ = (
        "mlx-lm's scaled_dot_product_attention served by mlx_flash.flash_attention "
        "(patched in by mlx_flash.integrations.mlx_lm; see its docstring).")
    scaled_dot_product_attention.__wrapped__ = original
    return scaled_dot_product_attention


def _bindings(modules: Iterator[types.ModuleType], function: Callable) -> List[Tuple[types.ModuleType, str]]:
    """(module, global name) pairs whose value is `function` (identity)."""
    found = []
    for module in modules:
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            if value is function:
                found.append((module, name))
    return found


def _loaded_modules(prefix: Optional[str]) -> Iterator[types.ModuleType]:
    for name, module in list(sys.modules.items()):
        if not isinstance(module, types.ModuleType):
            continue
        if prefix is None or name == prefix or name.startswith(prefix + "."):
            yield module


def patch(backend: str = "auto") -> None:
    """Route mlx-lm's attention through `mlx_flash.flash_attention`. Idempotent.

    Args:
        backend (str, optional): flash_attention backend for the patched calls ("auto", "mlx",
            "metal", "cuda"). Default: ``"auto"``.

    Raises:
        ValueError: for an unknown backend, or when already patched with another backend.
        ImportError: when mlx-lm is not installed (``pip install mlx-flash[lm]``).
    """
    global _active
    if not isinstance(backend, str) or backend not in BACKEND_NAMES:
        raise ValueError(f"[mlx_flash.integrations.mlx_lm.patch] backend must be one of {BACKEND_NAMES}, "
                         f"got {backend!r}.")
    base = importlib.import_module("mlx_lm.models.base")
    with _lock:
        if _active is not None:
            if _active.backend != backend:
                raise ValueError(f"[mlx_flash.integrations.mlx_lm.patch] already patched with backend "
                                 f"{_active.backend!r}; unpatch() before patching with {backend!r}.")
            return
        original = getattr(base, ATTRIBUTE)
        replacement = _make_replacement(original, backend)
        bindings = _bindings(_loaded_modules("mlx_lm"), original)
        if (base, ATTRIBUTE) not in bindings:
            bindings.append((base, ATTRIBUTE))
        for module, name in bindings:
            setattr(module, name, replacement)
        _active = _Patch(original=original, replacement=replacement, backend=backend)
        from . import mlx_lm_adapters
        mlx_lm_adapters.apply(backend)


def unpatch() -> None:
    """Undo `patch()`: mlx-lm's original function object is bound again wherever the flash
    function is bound (every loaded module, including those imported while patched).
    Does nothing when not patched."""
    global _active
    with _lock:
        if _active is None:
            return
        for module, name in _bindings(_loaded_modules(None), _active.replacement):
            setattr(module, name, _active.original)
        from . import mlx_lm_adapters
        mlx_lm_adapters.undo()
        _active = None


def is_patched() -> bool:
    """Whether `patch()` is in effect."""
    return _active is not None


def original_function() -> Optional[Callable]:
    """mlx-lm's own scaled_dot_product_attention while patched, else None."""
    active = _active
    return active.original if active is not None else None


@contextlib.contextmanager
def patched(backend: str = "auto"):
    """Context manager: `patch(backend)` on entry; on exit `unpatch()` unless it was already
    patched on entry (so it nests inside a `patch()` region).

    Args:
        backend (str, optional): see `patch`. Default: ``"auto"``.
    """
    with _lock:
        was_patched = is_patched()
        patch(backend)
    try:
        yield
    finally:
        if not was_patched:
            unpatch()

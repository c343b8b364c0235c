"""Per-model adapters: mlx-lm models whose attention does not go through `base.scaled_dot_product_attention`.

Applied by `mlx_lm.patch()` and undone by `unpatch()` (the import of a model module here is what
mlx-lm's loader would do anyway). Each adapter sends a call to mlx_flash under the same rules as
the patched base function (`mlx_lm.fallback_reason`): decode steps, quantized caches and inputs
MLX's rules reject stay on the model's own path, warned once and counted per model and reason.

Adapted (found by sweeping mlx_lm.models for hand-written softmax attention and direct
`mx.fast.scaled_dot_product_attention` calls, mlx-lm 0.32):
- gemma2: attention with logit soft-capping written by hand -> flash_attention(softcap=).
- gear: `_softcap_attention`, the same by hand (models with attn_logit_softcapping).
- plamo2, muse_spark: call `mx.fast.scaled_dot_product_attention` directly; their module-level
  `mx` is swapped for a view of mlx.core whose `fast.scaled_dot_product_attention` is ours.
`NOT_ADAPTED` lists the rest with the reason.
"""
from __future__ import annotations

import importlib
import threading
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx

from ..fallback import record_fallback
from . import mlx_lm as integration

NOT_ADAPTED = {
    "deepseek_v41": "sparse attention over gathered keys with one query per call (Nq = 1): a decode-shaped "
                    "call that MLX's fused vector kernel serves",
    "phi3small": "block-sparse attention built from a dense mask per call (its fused path is a TODO upstream); "
                 "the scores are materialized by the model itself",
    "olmo": "OLMo 1 needs the hf_olmo package; its hand-written attention is plain softmax attention with an "
            "additive mask (an adapter like gemma2's would serve it)",
}

_lock = threading.Lock()
# (owner object, attribute, original value) of every swap in effect.
_swaps: List[Tuple[object, str, object]] = []
_backend = "auto"


def _early_reason(query_length: int, cache, mask) -> Optional[str]:
    """The fallback reasons known before q/k/v exist (an adapter that updates a KV cache must
    decide before it does)."""
    if hasattr(cache, "bits"):
        return "mlx-lm quantized KV cache (cache.bits): served by the model's own attention"
    if query_length <= integration.DECODE_QUERY_LENGTH:
        return (f"mlx-lm decode step (query length <= {integration.DECODE_QUERY_LENGTH}): served by the "
                f"model's own attention")
    if mask is not None and not isinstance(mask, (str, mx.array)):
        return f"mlx-lm mask of type {type(mask).__name__}: served by the model's own attention"
    return None


def _fall_back(model: str, reason: str) -> None:
    record_fallback(f"{model}: {reason}")
    integration._count(integration._ORIGINAL, model, reason)


# -- gemma2: Attention.__call__ --------------------------------------------------------------------

def _gemma2_call(original: Callable) -> Callable:
    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        reason = _early_reason(L, cache, mask)
        if reason is not None:
            _fall_back("gemma2", reason)
            return original(self, x, mask=mask, cache=cache)
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        queries = queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        values = values.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if cache is not None:
            queries = self.rope(queries, offset=cache.offset)
            keys = self.rope(keys, offset=cache.offset)
            keys, values = cache.update_and_fetch(keys, values)
        else:
            queries = self.rope(queries)
            keys = self.rope(keys)
        integration._count(integration._FLASH, "gemma2")
        output = integration.flash(queries, keys, values, scale=self.scale, mask=mask,
                                   softcap=self.attn_logit_softcapping, backend=_backend)
        return self.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))

    return __call__


# -- gear: _softcap_attention(queries, keys, values, scale, softcap, mask) ------------------------

def _gear_softcap_attention(original: Callable) -> Callable:
    def _softcap_attention(queries, keys, values, scale, softcap, mask):
        reason = integration.fallback_reason(queries, keys, values, None, scale, mask, softcap=softcap)
        if reason is not None:
            _fall_back("gear", reason)
            return original(queries, keys, values, scale=scale, softcap=softcap, mask=mask)
        integration._count(integration._FLASH, "gear")
        return integration.flash(queries, keys, values, scale=scale, mask=mask, softcap=softcap, backend=_backend)

    return _softcap_attention


# -- plamo2, muse_spark: a view of mlx.core with our mx.fast.scaled_dot_product_attention ----------

class _FastView:
    """mx.fast with scaled_dot_product_attention served by mlx_flash (the rest is mx.fast's)."""

    def __init__(self, model: str):
        self._model = model

    def __getattr__(self, name):
        return getattr(mx.fast, name)

    def scaled_dot_product_attention(self, q, k, v, *, scale, mask=None, sinks=None, force_fused=False,
                                     stream=None):
        reason = integration.fallback_reason(q, k, v, None, scale, mask, sinks)
        if reason is None and stream is not None:
            reason = "an explicit stream: served by MLX"
        if reason is not None:
            _fall_back(self._model, reason)
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks,
                                                        force_fused=force_fused, stream=stream)
        integration._count(integration._FLASH, self._model)
        return integration.flash(q, k, v, scale=scale, mask=mask, sinks=sinks, backend=_backend)


class _MxView:
    """mlx.core as a model module sees it, with `fast` replaced by a `_FastView`."""

    def __init__(self, model: str):
        self.fast = _FastView(model)

    def __getattr__(self, name):
        return getattr(mx, name)


def _adapters() -> Dict[str, List[Tuple[Callable, str, Callable]]]:
    """model -> [(owner getter, attribute, factory(original) -> replacement)]."""
    return {
        "gemma2": [(lambda m: m.Attention, "__call__", _gemma2_call)],
        "gear": [(lambda m: m, "_softcap_attention", _gear_softcap_attention)],
        "plamo2": [(lambda m: m, "mx", lambda original: _MxView("plamo2"))],
        "muse_spark": [(lambda m: m, "mx", lambda original: _MxView("muse_spark"))],
    }


def adapted_models() -> List[str]:
    """The models with an adapter in this mlx-lm (those whose module imports)."""
    found = []
    for model in _adapters():
        try:
            importlib.import_module(f"mlx_lm.models.{model}")
        except ImportError:
            continue
        found.append(model)
    return found


def apply(backend: str) -> None:
    """Install every adapter whose model module imports (called by `mlx_lm.patch()`)."""
    global _backend
    with _lock:
        if _swaps:
            return
        _backend = backend
        for model, entries in _adapters().items():
            try:
                module = importlib.import_module(f"mlx_lm.models.{model}")
            except ImportError:  # not in this mlx-lm version, or an optional dependency missing
                continue
            for owner_of, attribute, factory in entries:
                owner = owner_of(module)
                original = owner.__dict__[attribute] if isinstance(owner, type) else getattr(owner, attribute)
                setattr(owner, attribute, factory(original))
                _swaps.append((owner, attribute, original))


def undo() -> None:
    """Put every original back (called by `mlx_lm.unpatch()`)."""
    with _lock:
        while _swaps:
            owner, attribute, original = _swaps.pop()
            setattr(owner, attribute, original)

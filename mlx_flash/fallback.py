"""Fallbacks are never silent: each reason warns once and is counted.

A fallback happens when the path that was asked for (a kernel backend, a patched
mlx-lm call) cannot serve a call and another path serves it instead.

A route is a choice, not a fallback: backend="auto" hands a call that our kernels could serve
to a path measured faster for it (kernels/dispatch_cuda.txt, mlx_flash/backends/dispatch.py).
Routes are counted by reason (route_counts()) and never warned.
"""
from __future__ import annotations

import collections
import threading
import warnings

_counts: collections.Counter = collections.Counter()
_routes: collections.Counter = collections.Counter()
_warned: set[str] = set()
_lock = threading.Lock()


class FallbackWarning(UserWarning):
    """Warned (once per reason) when mlx-flash serves a call on another path than asked."""


def record_fallback(reason: str) -> None:
    """Count one fallback for `reason` and warn the first time it is seen."""
    with _lock:
        _counts[reason] += 1
        first = reason not in _warned
        _warned.add(reason)
    if first:
        warnings.warn(f"mlx-flash fallback: {reason} (warned once; see mlx_flash.fallback_counts())",
                      FallbackWarning, stacklevel=3)


def fallback_counts() -> dict[str, int]:
    """How many calls fell back, by reason, since start (or the last reset)."""
    with _lock:
        return dict(_counts)


def record_route(reason: str) -> None:
    """Count one call that backend="auto" routed for `reason` (the dispatch table row); no warning."""
    with _lock:
        _routes[reason] += 1


def route_counts() -> dict[str, int]:
    """How many calls backend="auto" routed to another path measured faster, by reason, since
    start (or the last reset)."""
    with _lock:
        return dict(_routes)


def reset_fallback_counts() -> None:
    """Forget fallback and route counts and the warnings (tests use this)."""
    with _lock:
        _counts.clear()
        _routes.clear()
        _warned.clear()

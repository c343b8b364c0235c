"""Fallbacks are never silent: each reason warns once and is counted.

A fallback happens when the path that was asked for (a kernel backend, a patched
mlx-lm call) cannot serve a call and another path serves it instead.
"""
from __future__ import annotations

import collections
import threading
import warnings

_counts: collections.Counter = collections.Counter()
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


def reset_fallback_counts() -> None:
    """Forget counts and warnings (tests use this)."""
    with _lock:
        _counts.clear()
        _warned.clear()

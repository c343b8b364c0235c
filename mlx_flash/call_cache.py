"""flash_attention's decisions, kept per call signature so that a repeated call does not make them again.

A call's path (argument checks, the backend choice with its dispatch route or fallback, the
first-contact verdict, the custom function) depends only on what the signature names: the
types, shapes and dtypes of the arrays, the scalar arguments, the backend argument and the
device; and on the process state listed here. Making them again cost most of flash_attention's
own Python per call: with kernels stubbed on the CI machine, a repeated forward took 62 us
before and 27 us after (fwd+bwd 122 -> 77 us; mx.fast's whole forward 5 us). A decode loop's
growing cache makes a new signature per step, shared by the step's layers (the first pays
~9 us more than before: the key and the store). On the H100 machine's host the whole call's
graph building right after a synchronize is dominated by MLX's own calls, and did not get faster
(benchmarks/RESULTS.md, "Per-call host time on the H100").

What a kept decision is checked against on every call (`stamp`), so it is never staler than the
path it replaces:
    - the environment variables that steer the decisions (ENVIRONMENT), read from the process
      environment on every call (os.environ.get would cost ~1 us per variable: 7 us a call);
    - `generation`, moved by `forget()`, which the owners of other process state call when it
      changes (the first-contact verdicts, the tuned tables' kept answers, the autotuner's);
    - the second of time.monotonic(): a tuned table written by another process is seen within
      RECHECK_S, as tuned.table_for promises.
Counted events (a dispatch route or a fallback) are recorded again on every call that reuses
the decision, as the uncached path records them.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Dict, Optional, Tuple

import mlx.core as mx

# The environment variables read on the way to a call's path (backends, guard, tuned tables,
# autotuner, CUDA / Metal family overrides).
ENVIRONMENT = ("MLX_FLASH_METAL_SIM", "MLX_FLASH_CUDA_CAPABILITY", "MLX_FLASH_METAL_FAMILY", "MLX_FLASH_AUTOTUNE",
               "MLX_FLASH_SELF_CHECK", "MLX_FLASH_TUNED", "XDG_CACHE_HOME")
RECHECK_S = 1.0  # as tuned.RECHECK_S
MAX_ENTRIES = 256  # past it the cache starts over (a decode loop's growing cache makes a key per call)

_generation = 0


def _environment_reader() -> Callable[[], tuple]:
    """A function returning the ENVIRONMENT values. On POSIX, CPython keeps os.environ's contents
    in the dict os.environ._data (bytes keys), which os.environ's setters update: 25 ns a lookup
    against ~1 us through os.environ.get. Elsewhere, os.environ.get."""
    data = getattr(os.environ, "_data", None)
    if os.name == "posix" and isinstance(data, dict):
        keys = tuple(os.fsencode(name) for name in ENVIRONMENT)
        get = data.get
        return lambda: tuple(map(get, keys))
    return lambda: tuple(map(os.environ.get, ENVIRONMENT))


environment = _environment_reader()


def stamp() -> tuple:
    """What a kept decision must match to be reused (see the module doc)."""
    return _generation, int(time.monotonic() / RECHECK_S), environment()


def forget() -> None:
    """Invalidate every kept decision (of every Kept): process state that they depend on has changed."""
    global _generation
    _generation += 1


class Kept:
    """Decisions kept by key, each valid under the stamp it was made under. Thread-safe: a lookup is
    one dictionary read; a store replaces the entry (past MAX_ENTRIES the store starts over)."""

    def __init__(self):
        self._entries: Dict[Any, Tuple[tuple, Any]] = {}
        self._lock = threading.Lock()

    def lookup(self, key, now: tuple):
        """The decision kept for `key` under stamp `now`, or None (also for a None key)."""
        if key is None:
            return None
        entry = self._entries.get(key)
        return entry[1] if entry is not None and entry[0] == now else None

    def store(self, key, now: tuple, decision) -> None:
        """Keep `decision` for `key`, made under stamp `now` (nothing for a None key)."""
        if key is None:
            return
        with self._lock:
            if len(self._entries) >= MAX_ENTRIES:
                self._entries.clear()
            self._entries[key] = (now, decision)


def _array_key(x) -> Optional[tuple]:
    return (x.shape, x.dtype) if type(x) is mx.array else None


def _device_key(stream) -> Optional[tuple]:
    """The device that runs the call (all a decision depends on): mx.Device and mx.Stream hash by
    identity, so the key holds the device's type and index instead."""
    if stream is None:
        device = mx.default_device()
    elif isinstance(stream, mx.Stream):
        device = stream.device
    elif isinstance(stream, mx.Device):
        device = stream
    else:
        return None  # mx.cpu / mx.gpu or a bad argument: the full path
    return device.type, device.index if hasattr(device, "index") else 0


def call_key(q, k, v, scale, mask, window_size, softcap, sinks, return_lse, backend, stream) -> Optional[tuple]:
    """The signature of a flash_attention call, or None where it cannot be keyed (a scale given as an
    array, an argument of an unusual type, an unhashable backend object): such calls take the full path.
    Everything the argument checks and the backend choice read is in it."""
    array = mx.array
    if type(q) is not array or type(k) is not array or type(v) is not array:
        return None
    arrays = (q.shape, q.dtype, k.shape, k.dtype, v.shape, v.dtype)
    if scale is not None and type(scale) is not float and type(scale) is not int:
        return None
    if softcap is not None and type(softcap) is not float and type(softcap) is not int:
        return None
    if type(return_lse) is not bool:
        return None
    if mask is None or type(mask) is str:
        mask_key = mask
    else:
        mask_key = _array_key(mask)
        if mask_key is None:
            return None
    if window_size is not None and (type(window_size) is not tuple or
                                    any(type(w) is not int for w in window_size)):
        return None
    sinks_key = None
    if sinks is not None:
        sinks_key = _array_key(sinks)
        if sinks_key is None:
            return None
    if type(backend) is not str:
        try:
            hash(backend)
        except TypeError:
            return None
    device = _device_key(stream)
    if device is None:
        return None
    return arrays, scale, mask_key, window_size, softcap, sinks_key, return_lse, backend, device

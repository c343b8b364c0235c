"""MLX_FLASH_AUTOTUNE=1: the first call of a (head dim, dtype) on a kernel backend tunes that call's
three kernels within a small budget, then caches the result in this GPU's tuned table.

It runs where the first-contact guard does (select_backend, before the call enters the user's
graph) and like the guard's probe it evaluates only arrays it made itself. A point already
measured (a `measured:` note in the tuned table, from `tune` or an earlier process) is not
measured again. Every tuning is announced once with a warning naming what moved and where the
table went; any failure inside the tuner leaves the table as it was and is counted as a
fallback (mlx_flash.fallback_counts()), never raised into the user's program.

Environment:
    MLX_FLASH_AUTOTUNE: "1" on; unset or "0" off.
    MLX_FLASH_AUTOTUNE_BUDGET_S: seconds one shape may spend (default 20).
"""
from __future__ import annotations

import os
import re
import threading
import time
import warnings
from typing import Dict, List, Optional

from . import benchmark as bm, call_cache, planner, tune, tuned
from .fallback import record_fallback

DEFAULT_BUDGET_S = 20.0
SETTINGS = bm.Settings(warmup=1, min_repeats=3, max_repeats=5, target_seconds=0.05)
# The timed problem is the call's own shape, capped so that one candidate's repetitions stay
# within a fraction of the budget on any GPU.
MAX_BATCH, MAX_HEADS, MAX_LENGTH = 2, 16, 4096
SIMULATOR_PROBLEM = tune.Problem(1, 1, 64)
# Candidates per kernel besides the table's row: the quick space's first moves (T, then P).
MAX_CANDIDATES = 3


def enabled() -> bool:
    value = os.environ.get("MLX_FLASH_AUTOTUNE", "0").strip()
    if value not in ("0", "1", ""):
        raise ValueError(f"[flash_attention] MLX_FLASH_AUTOTUNE must be 0 or 1, got {value!r}.")
    return value == "1"


def budget_s() -> float:
    text = os.environ.get("MLX_FLASH_AUTOTUNE_BUDGET_S", "").strip()
    try:
        value = float(text) if text else DEFAULT_BUDGET_S
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"[flash_attention] MLX_FLASH_AUTOTUNE_BUDGET_S must be a positive number of seconds, "
                         f"got {text!r}.")
    return value


class FirstUse:
    """Per-process record of the shapes autotuned (or found measured); thread-safe."""

    def __init__(self):
        self._seen: Dict[tuple, Optional[str]] = {}
        self._lock = threading.Lock()

    def maybe_tune(self, backend, spec) -> None:
        """Tune the rows serving `spec` on `backend` once, if MLX_FLASH_AUTOTUNE=1 (see the module doc)."""
        if not enabled() or backend.name not in ("metal", "cuda") or spec.dtype not in bm.DTYPES.values():
            return
        dtype = next(name for name, value in bm.DTYPES.items() if value == spec.dtype)
        key = (backend.name, spec.head_dim, dtype, bool(spec.causal))
        if key in self._seen:
            return
        with self._lock:
            if key in self._seen:
                return
            try:
                self._seen[key] = self._tune(backend.name, spec, dtype)
            except Exception as error:  # the tuner must never break the user's call
                self._seen[key] = None
                record_fallback(f"autotune of D={spec.head_dim} {dtype} on {backend.name} failed "
                                f"({type(error).__name__}: {str(error)[:200]}); the table is unchanged")

    def records(self) -> Dict[tuple, Optional[str]]:
        with self._lock:
            return dict(self._seen)

    def forget(self) -> None:
        """Drop what was tuned in this process, and the call decisions made after it (call_cache)."""
        with self._lock:
            self._seen.clear()
        call_cache.forget()

    def _tune(self, target: str, spec, dtype: str) -> Optional[str]:
        from .backends import metal_simulated
        from .tune_spaces import space_for

        space = space_for(target)
        family = space.family()
        path = tuned.table_path(target, family)
        previous = path.read_text() if tuned.table_for(target, family) is not None else ""
        done = set(tune.measured_points(previous))
        masks = ("causal",) if spec.causal else ("none",)
        todo = [tune.Point(kernel, spec.head_dim, dtype, masks) for kernel in planner.KERNELS
                if (kernel, dtype, spec.head_dim) not in done]
        if not todo:
            return None
        if target == "metal" and metal_simulated():
            problem = SIMULATOR_PROBLEM
        else:
            problem = tune.Problem(min(spec.batch, MAX_BATCH), min(spec.q_heads, MAX_HEADS),
                                   min(max(spec.q_len, spec.kv_len, 128), MAX_LENGTH), tune.calls_per_sample(target))
        started = time.monotonic()
        deadline = started + budget_s()
        table = planner.active_table(target, family)
        outcomes: List[tune.Outcome] = []
        for point in todo:
            if time.monotonic() > deadline:
                break
            outcomes.append(tune.tune_point(space, table, point, problem, SETTINGS, quick=True,
                                            max_candidates=MAX_CANDIDATES,
                                            deadline=deadline))
        kept = [line[2:] for line in previous.splitlines() if re.match(r"#\s*measured:", line)]
        written = tuned.write(target, family, tune.apply(table, outcomes, "tuned"),
                              tuple(kept) + tune.notes(outcomes, problem, SETTINGS)[1:])
        moved = [f"{o.point.kernel} {tune.row_label(o.best)} ({o.ratio:.2f}x)" for o in outcomes if o.best != o.base]
        message = (f"mlx-flash autotune: D={spec.head_dim} {dtype} on {target} {family} in "
                   f"{time.monotonic() - started:.1f} s: {', '.join(moved) if moved else 'the table rows stay'}; "
                   f"table {written}")
        warnings.warn(message, UserWarning, stacklevel=4)
        return message


FIRST_USE = FirstUse()

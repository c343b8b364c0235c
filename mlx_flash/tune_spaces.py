"""What the tuner may try on each backend: candidate rows around a block-table row, from the
backend's plan type (mlx_flash/tune.py does the rest, the same for both).

Each space has:
    target: "metal" or "cuda"; family(): the table family of this GPU;
    row_family(kernel, head_dim): the family name of the rows that plan the kernel here;
    candidates(row, head_dim, quick, length): rows to try, one knob moved at a time (length: the
        timed problem's N, for knobs that only calls of some length meet);
    invalid_reason(table, point): why the backend cannot build a candidate (None if it can);
    gate_keys(row): key counts past tune.GATE_KEYS at which the correctness gate runs the row too;
    backend(table): a backend object planning every kernel from `table`.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

from . import planner


def _halve_double(value: int, step: int, low: int, high: int) -> List[int]:
    return [v for v in (value // 2, value * 2) if v % step == 0 and low <= v <= high and v != value]


class MetalSpace:
    """Metal: P (8 rows per SIMD-group, up to 64), T, H (multiples of 8, H up to D rounded to 8) and
    the cached operands (one added or dropped at a time)."""

    target = "metal"

    def __init__(self, family: Optional[str] = None):
        from .backends import metal

        self._family = family or metal.detect_family()
        self._backends = {}  # table -> backend: a candidate's kernels are built once per tuning

    def family(self) -> str:
        return self._family

    def row_family(self, kernel: str, head_dim: int) -> str:
        return self._family

    def candidates(self, row: planner.Row, head_dim: int, quick: bool, length: int = 0) -> List[planner.Row]:
        from .backends.metal_source import CACHEABLE

        out = [dataclasses.replace(row, traversal_block=t) for t in _halve_double(row.traversal_block, 8, 8, 256)]
        out += [dataclasses.replace(row, parallel_block=p) for p in _halve_double(row.parallel_block, 8, 8, 64)]
        out += [dataclasses.replace(row, head_block=h)
                for h in _halve_double(row.head_block, 8, 8, -(-head_dim // 8) * 8)]
        if not quick:
            for operand in CACHEABLE[row.kernel]:
                out.append(dataclasses.replace(row, cached=row.cached ^ {operand}))
        return out

    def gate_keys(self, row: planner.Row) -> Tuple[int, ...]:
        return ()  # a Metal row plans every length alike

    def invalid_reason(self, table: planner.Table, point) -> Optional[str]:
        from .backends import metal_source
        from .tune import spec_for

        try:
            variant = metal_source.make_variant(point.kernel, spec_for(point, "none", 1, 1), self._family, table)
            metal_source.check_launch_limits(variant)
        except ValueError as error:
            return str(error)
        return None

    def backend(self, table: planner.Table):
        from .backends.metal import MetalBackend

        if table not in self._backends:
            self._backends[table] = MetalBackend(family=self._family, table=table)
        return self._backends[table]


def space_for(target: str, family: Optional[str] = None):
    """The candidate space of a backend ("metal" or "cuda") on this machine."""
    if target == "metal":
        return MetalSpace(family)
    if target == "cuda":
        from .tune_cuda import CudaSpace

        return CudaSpace(family)
    raise ValueError(f"[tune] backend must be 'metal' or 'cuda', got {target!r}.")

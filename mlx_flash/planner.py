"""Block planning, shared by the Metal and CUDA backends: one planner, one table per target.

A plan says, for one kernel at one head dim, dtype and GPU family, how the work is blocked:
the parallel block P (rows a threadgroup / CTA owns), the traversal block T (rows streamed
per step), the head block H (columns of D per inner step) and which operands stay in
registers ("cached"). The numbers live in kernels/blocks_<target>.txt as data, so tuning
is an edit to a table, not to code.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources
from typing import FrozenSet, List, Optional, Tuple

import mlx.core as mx

KERNELS = ("forward", "backward_query", "backward_key_value")


@dataclass(frozen=True)
class BlockPlan:
    """How one kernel is blocked for one (head_dim, dtype, family).

    Attributes:
        kernel: "forward", "backward_query" or "backward_key_value".
        parallel_block: P, rows owned by one threadgroup (queries for forward/dQ, keys for dK/dV).
        traversal_block: T, rows streamed per step (keys for forward/dQ, queries for dK/dV).
        head_block: H, columns of the head dim handled per inner step (a multiple of 8).
        cached: operands kept in registers for the whole kernel (e.g. {"Q", "O"}); in the CUDA
            table, options of the kernel (e.g. {"pingpong"}).
        head_dim: the real D.
        warps: SIMD-groups / warps per threadgroup, or None where the backend derives it
            (the Metal kernels use P / 8 SIMD-groups).
    """

    kernel: str
    parallel_block: int
    traversal_block: int
    head_block: int
    cached: FrozenSet[str]
    head_dim: int
    warps: Optional[int] = None

    @property
    def padded_head_dim(self) -> int:
        """D rounded up to a multiple of the head block (tiles past D are zero-filled)."""
        return -(-self.head_dim // self.head_block) * self.head_block

    @property
    def head_steps(self) -> int:
        """Number of H-wide D-blocks."""
        return self.padded_head_dim // self.head_block

    def is_cached(self, operand: str) -> bool:
        return operand in self.cached


@dataclass(frozen=True)
class _Row:
    kernel: str
    precision: str
    family: str
    max_head_dim: int
    parallel_block: int
    traversal_block: int
    head_block: int
    cached: FrozenSet[str]
    warps: Optional[int]


@functools.lru_cache(maxsize=None)
def load_table(target: str) -> Tuple[_Row, ...]:
    """Parse kernels/blocks_<target>.txt: whitespace columns, '#' comments, '-' = nothing cached;
    an optional ninth column gives the warps per threadgroup ('-' = the backend's default)."""
    text = resources.files("mlx_flash.kernels").joinpath(f"blocks_{target}.txt").read_text()
    rows: List[_Row] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) not in (8, 9):
            raise ValueError(f"blocks_{target}.txt line {number}: expected 8 or 9 columns, got {fields}")
        kernel, precision, family, max_d, p, t, h, cached = fields[:8]
        warps = fields[8] if len(fields) == 9 else "-"
        if kernel not in KERNELS:
            raise ValueError(f"blocks_{target}.txt line {number}: unknown kernel {kernel!r}")
        rows.append(_Row(kernel, precision, family, int(max_d), int(p), int(t), int(h),
                         frozenset() if cached == "-" else frozenset(cached.split(",")),
                         None if warps == "-" else int(warps)))
    return tuple(rows)


def precision_of(dtype: mx.Dtype) -> str:
    return "fp32" if dtype == mx.float32 else "mixed"


def families(target: str) -> Tuple[str, ...]:
    """The GPU families a target's table has rows for."""
    return tuple(sorted({row.family for row in load_table(target)}))


@functools.lru_cache(maxsize=None)
def plan(target: str, kernel: str, head_dim: int, dtype: mx.Dtype, family: str) -> BlockPlan:
    """The block plan for one kernel.

    Args:
        target: "metal" or "cuda" (which table).
        kernel: one of KERNELS.
        head_dim: D, any positive int; past the table's last row its last row applies.
        dtype: the input dtype (fp32 vs mixed precision rows).
        family: the GPU family the table is keyed by (e.g. "m1", "m3"; "sm86", "sm90_wgmma" for CUDA:
            kernels/families_cuda.txt).
    """
    if kernel not in KERNELS:
        raise ValueError(f"[planner] kernel must be one of {KERNELS}, got {kernel!r}.")
    if head_dim < 1:
        raise ValueError(f"[planner] head_dim must be >= 1, got {head_dim}.")
    precision = precision_of(dtype)
    rows = sorted((r for r in load_table(target)
                   if r.kernel == kernel and r.precision == precision and r.family == family),
                  key=lambda r: r.max_head_dim)
    if not rows:
        raise ValueError(f"[planner] no {target} rows for kernel={kernel!r}, precision={precision!r}, "
                         f"family={family!r}; families in the table: {families(target)}.")
    row = next((r for r in rows if head_dim <= r.max_head_dim), rows[-1])
    head_block = min(row.head_block, -(-head_dim // 8) * 8)
    return BlockPlan(kernel, row.parallel_block, row.traversal_block, head_block, row.cached, head_dim,
                     row.warps)

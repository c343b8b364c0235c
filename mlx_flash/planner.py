"""Block planning, shared by the Metal and CUDA backends: one planner, one table per target.

A plan says, for one kernel at one head dim, dtype and GPU family, how the work is blocked:
the parallel block P (rows a threadgroup / CTA owns), the traversal block T (rows streamed
per step), the head block H (columns of D per inner step) and which operands stay in
registers ("cached"). The numbers live in kernels/blocks_<target>.txt as data, so tuning
is an edit to a table, not to code.

Which table: a `Table` value. By default `active_table` gives the table measured on this machine
by `python -m mlx_flash tune` when one matches the device and versions (mlx_flash/tuned.py), else
the shipped one; the tuner passes candidate tables explicitly (`plan(..., table=...)`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
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
    # Which table the plan came from (kernels/blocks_<target>.txt or a tuned table's path): shown by
    # the plan inspector, not part of the kernel variant's identity.
    table: str = field(default="", compare=False)

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
class Row:
    """One line of a block table (see kernels/blocks_metal.txt for the columns)."""

    kernel: str
    precision: str
    family: str
    max_head_dim: int
    parallel_block: int
    traversal_block: int
    head_block: int
    cached: FrozenSet[str]
    warps: Optional[int]


@dataclass(frozen=True)
class Table:
    """A whole block table as a value: where it came from and its rows.

    Attributes:
        target: "metal" or "cuda".
        origin: "kernels/blocks_<target>.txt" or the path of a tuned table.
        rows: the rows, in file order.
    """

    target: str
    origin: str
    rows: Tuple[Row, ...]

    def __hash__(self) -> int:  # computed once: a table is part of plan caches' keys on every call
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.target, self.origin, self.rows))
            object.__setattr__(self, "_hash", cached)
        return cached

    def replace_rows(self, family: str, kernel: str, precision: str, rows: Tuple[Row, ...],
                     origin: str) -> "Table":
        """This table with the (kernel, precision, family) group's rows replaced by `rows`."""
        kept = tuple(r for r in self.rows if (r.kernel, r.precision, r.family) != (kernel, precision, family))
        return Table(self.target, origin, kept + tuple(rows))


def parse_rows(text: str, name: str) -> Tuple[Row, ...]:
    """Rows of a block table's text: whitespace columns, '#' comments, '-' = nothing cached; an
    optional ninth column gives the warps per threadgroup ('-' = the backend's default).

    Raises:
        ValueError: naming `name`, the line and what is wrong with it.
    """
    rows: List[Row] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) not in (8, 9):
            raise ValueError(f"{name} line {number}: expected 8 or 9 columns, got {fields}")
        kernel, precision, family, max_d, p, t, h, cached = fields[:8]
        warps = fields[8] if len(fields) == 9 else "-"
        if kernel not in KERNELS:
            raise ValueError(f"{name} line {number}: unknown kernel {kernel!r}")
        try:
            numbers = [int(x) for x in (max_d, p, t, h)] + ([] if warps == "-" else [int(warps)])
        except ValueError:
            raise ValueError(f"{name} line {number}: max_d, P, T, H and warps must be integers, "
                             f"got {fields[3:]}") from None
        if min(numbers) < 1:
            raise ValueError(f"{name} line {number}: max_d, P, T, H and warps must be positive, got {fields[3:]}")
        rows.append(Row(kernel, precision, family, numbers[0], numbers[1], numbers[2], numbers[3],
                        frozenset() if cached == "-" else frozenset(cached.split(",")),
                        None if warps == "-" else numbers[4]))
    return tuple(rows)


def format_row(row: Row) -> str:
    """One table line in the shipped tables' column layout (parse_rows reads it back)."""
    cached = ",".join(sorted(row.cached)) or "-"
    warps = "-" if row.warps is None else str(row.warps)
    # Each column is padded to its width in the shipped tables and always followed by a space: a
    # family name as long as "sm90_wgmma" once ran into max_d and the table failed to parse.
    return (f"{row.kernel:<21} {row.precision:<9} {row.family:<10} {row.max_head_dim:<6} {row.parallel_block:<4} "
            f"{row.traversal_block:<4} {row.head_block:<4} {cached:<8} {warps}").rstrip()


@functools.lru_cache(maxsize=None)
def shipped_table(target: str) -> Table:
    """kernels/blocks_<target>.txt as a Table."""
    name = f"blocks_{target}.txt"
    text = resources.files("mlx_flash.kernels").joinpath(name).read_text()
    return Table(target, f"kernels/{name}", parse_rows(text, name))


def load_table(target: str) -> Tuple[Row, ...]:
    """The rows of kernels/blocks_<target>.txt."""
    return shipped_table(target).rows


def active_table(target: str, family: str) -> Table:
    """The table plans come from on this machine: a matching tuned table (mlx_flash/tuned.py;
    MLX_FLASH_TUNED=0 ignores them), else the shipped one."""
    return tuned.table_for(target, family) or shipped_table(target)


def precision_of(dtype: mx.Dtype) -> str:
    return "fp32" if dtype == mx.float32 else "mixed"


def families(target: str) -> Tuple[str, ...]:
    """The GPU families a target's table has rows for."""
    return tuple(sorted({row.family for row in load_table(target)}))



def plan(target: str, kernel: str, head_dim: int, dtype: mx.Dtype, family: str,
         table: Optional[Table] = None) -> BlockPlan:
    """The block plan for one kernel.

    Args:
        target: "metal" or "cuda" (which table).
        kernel: one of KERNELS.
        head_dim: D, any positive int; past the table's last row its last row applies.
        dtype: the input dtype (fp32 vs mixed precision rows).
        family: the GPU family the table is keyed by (e.g. "m1", "m3"; "sm86", "sm90_wgmma" for CUDA:
            kernels/families_cuda.txt).
        table: the table to plan from; None = active_table(target, family).
    """
    if table is None:
        table = active_table(target, family)
    return _plan(table, kernel, head_dim, dtype, family)


@functools.lru_cache(maxsize=4096)
def _plan(table: Table, kernel: str, head_dim: int, dtype: mx.Dtype, family: str) -> BlockPlan:
    if kernel not in KERNELS:
        raise ValueError(f"[planner] kernel must be one of {KERNELS}, got {kernel!r}.")
    if head_dim < 1:
        raise ValueError(f"[planner] head_dim must be >= 1, got {head_dim}.")
    row = find_row(table, kernel, head_dim, precision_of(dtype), family)
    head_block = min(row.head_block, -(-head_dim // 8) * 8)
    return BlockPlan(kernel, row.parallel_block, row.traversal_block, head_block, row.cached, head_dim,
                     row.warps, table.origin)


def find_row(table: Table, kernel: str, head_dim: int, precision: str, family: str) -> Row:
    """The row of `table` that serves head_dim (past the group's last row: its last row)."""
    rows = group_rows(table, kernel, precision, family)
    if not rows:
        raise ValueError(f"[planner] no {table.target} rows for kernel={kernel!r}, precision={precision!r}, "
                         f"family={family!r} in {table.origin}; families in it: "
                         f"{tuple(sorted({r.family for r in table.rows}))}.")
    return next((r for r in rows if head_dim <= r.max_head_dim), rows[-1])


def group_rows(table: Table, kernel: str, precision: str, family: str) -> Tuple[Row, ...]:
    """The rows of one (kernel, precision, family) group, by max_d."""
    return tuple(sorted((r for r in table.rows if r.kernel == kernel and r.precision == precision
                         and r.family == family), key=lambda r: r.max_head_dim))


from . import tuned  # noqa: E402 (tuned.py builds on this module's Table and parse_rows)

"""The dispatch table: where backend="auto" on CUDA hands a call to MLX's own fused attention.

kernels/dispatch_cuda.txt lists, per GPU family, the (dtype, head dim, head layout, mask, N
range) where a recorded benchmark measured mx.fast.scaled_dot_product_attention (cuDNN) faster
than the "cuda" backend's kernels in the forward or the forward+backward pass by more than a
margin, and where the routed call's worse pass loses less to ours than ours would lose to
mx.fast in its worse pass (benchmarks/dispatch_table.py states the rule). It is data, written by
benchmarks/dispatch_table.py from a recorded benchmarks/bench.py JSON, never by hand; a family
without rows routes nothing. `select_backend` (backends/__init__.py) consults it for
backend="auto" only, after the "fast" backend's "serves exactly" rule (fast.py) and its fused
rule have both agreed; backend="cuda" always runs our kernels.

Columns (each followed by at least one space; '#' starts a comment):
    family   a family of kernels/families_cuda.txt (sm80, sm86, sm90, ...)
    dtype    float16 or bfloat16
    head_dim D (= Dv), matched exactly: only measured head dims route
    heads    mha (as many kv heads as query heads) or gqa (fewer: grouped or multi-query); the
             two differ (our dK / dV kernel sums a group's heads inside one CTA), so each has
             its own rows, from the layouts the recording measured in that class
    mask     none, causal, bool or additive: an array mask of that kind, shaped [1, 1, Nq, Nk]
             (shared by every batch and head, as recorded; other mask shapes never route)
    min_n    smallest N of the range; a call routes when Nq = Nk = N and min_n <= N <= max_n
             (only square problems are measured: MLX may take another path for Nq != Nk)
    max_n    largest measured N of the range (beyond it nothing routes)
    forward  the range's largest mx.fast / ours median-time ratio, forward pass (< 1: mx.fast faster;
             above 1 where the other pass's win is the larger)
    fwd_bwd  the same for forward+backward
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from importlib import resources
from types import MappingProxyType
from typing import Optional, Tuple

import mlx.core as mx

from ..spec import AttentionSpec

TABLE_NAME = "dispatch_cuda.txt"
DTYPES = MappingProxyType({"float16": mx.float16, "bfloat16": mx.bfloat16})
MASKS = ("none", "causal", "bool", "additive")
HEADS = ("mha", "gqa")


def heads_of(q_heads: int, kv_heads: int) -> str:
    """The head-layout class of a call or a measured case (the table's heads column)."""
    return "mha" if q_heads == kv_heads else "gqa"


def mask_of(spec: AttentionSpec) -> Optional[str]:
    """A call's mask column: none, causal, bool or additive; None for masks no row can cover
    (causal with an array mask, or an array mask not shaped [1, 1, Nq, Nk])."""
    if spec.mask_kind == "none":
        return "causal" if spec.causal else "none"
    if spec.causal or spec.mask_shape != (1, 1, spec.q_len, spec.kv_len):
        return None
    return spec.mask_kind


@dataclass(frozen=True)
class DispatchRow:
    """One line of kernels/dispatch_cuda.txt (see the module docstring for the columns)."""

    family: str
    dtype: str
    head_dim: int
    heads: str
    mask: str
    min_n: int
    max_n: int
    forward: float
    forward_backward: float
    # Where it stands in its table (named in route reasons); not part of its identity.
    line: int = field(default=0, compare=False)

    def matches(self, family: str, spec: AttentionSpec) -> bool:
        """Whether this row covers a call of `spec` on `family` (mask and N checked; exactness is
        the "fast" backend's rule, not this table's)."""
        return (self.family == family and DTYPES[self.dtype] == spec.dtype and self.head_dim == spec.head_dim
                and self.head_dim == spec.value_dim and self.heads == heads_of(spec.q_heads, spec.kv_heads)
                and self.mask == mask_of(spec) and spec.q_len == spec.kv_len and self.min_n <= spec.q_len <= self.max_n)

    def describe(self) -> str:
        return (f"{self.family} {self.dtype} D={self.head_dim} {self.heads} {self.mask} N={self.min_n}..{self.max_n} "
                f"(mx.fast/ours {self.forward:.2f} fwd, {self.forward_backward:.2f} fwd+bwd)")


def parse_dispatch(text: str, name: str = TABLE_NAME) -> Tuple[DispatchRow, ...]:
    """The rows of a dispatch table's text.

    Raises:
        ValueError: naming `name`, the line and what is wrong with it.
    """
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 9:
            raise ValueError(f"{name} line {number}: expected 9 columns (family dtype head_dim heads mask min_n "
                             f"max_n forward fwd_bwd), got {fields}")
        family, dtype, head_dim, heads, mask, min_n, max_n, forward, forward_backward = fields
        if dtype not in DTYPES:
            raise ValueError(f"{name} line {number}: dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
        if heads not in HEADS:
            raise ValueError(f"{name} line {number}: heads must be one of {HEADS}, got {heads!r}")
        if mask not in MASKS:
            raise ValueError(f"{name} line {number}: mask must be one of {MASKS}, got {mask!r}")
        try:
            sizes = [int(x) for x in (head_dim, min_n, max_n)]
            ratios = [float(x) for x in (forward, forward_backward)]
        except ValueError:
            raise ValueError(f"{name} line {number}: head_dim, min_n, max_n must be integers and forward, fwd_bwd "
                             f"numbers, got {[head_dim] + fields[5:]}") from None
        if min(sizes) < 1 or sizes[1] > sizes[2]:
            raise ValueError(f"{name} line {number}: head_dim, min_n, max_n must be positive with "
                             f"min_n <= max_n, got {[head_dim, min_n, max_n]}")
        if not (all(0 < r < 2 for r in ratios) and min(ratios) < 1):
            raise ValueError(f"{name} line {number}: a routed row's ratios must lie in (0, 2), one below 1 "
                             f"(mx.fast faster in that pass), got {fields[7:]}")
        rows.append(DispatchRow(family, dtype, sizes[0], heads, mask, sizes[1], sizes[2], *ratios, line=number))
    return tuple(rows)


def format_dispatch_row(row: DispatchRow) -> str:
    """One table line (parse_dispatch reads it back); every column is followed by a space."""
    return (f"{row.family:<10} {row.dtype:<9} {row.head_dim:<8} {row.heads:<5} {row.mask:<8} {row.min_n:<6} "
            f"{row.max_n:<6} "
            f"{row.forward:<7.3f} {row.forward_backward:.3f}")


@functools.lru_cache(maxsize=None)
def shipped_dispatch() -> Tuple[DispatchRow, ...]:
    """kernels/dispatch_cuda.txt's rows."""
    return parse_dispatch(resources.files("mlx_flash.kernels").joinpath(TABLE_NAME).read_text())


def dispatch_row(family: str, spec: AttentionSpec,
                 rows: Optional[Tuple[DispatchRow, ...]] = None) -> Optional[DispatchRow]:
    """The row that routes this call on `family` to mx.fast, or None.

    Args:
        family: the CUDA backend's family name (e.g. "sm90").
        spec: the call's AttentionSpec.
        rows: the table; None = the shipped one.
    """
    rows = shipped_dispatch() if rows is None else rows
    return next((r for r in rows if r.matches(family, spec)), None)

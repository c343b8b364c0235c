"""How a sequence is split along N across the ranks of a group, and conversions to and from shards.

A rank's shard is a list of segments of the global sequence, concatenated in order:
    contiguous: one segment, positions [r * n_local, (r + 1) * n_local).
    zigzag:     the sequence in 2n chunks of c = n_local / 2; rank r holds chunks r and 2n - 1 - r,
                so under a causal mask every rank has the same number of visible (query, key) pairs.
"""
from __future__ import annotations

from typing import Tuple

import mlx.core as mx

LAYOUTS = ("zigzag", "contiguous")

# (local start, global start, length) of each segment of a rank's shard.
Segment = Tuple[int, int, int]


def check_layout(layout, where: str) -> None:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"[{where}] layout must be one of {LAYOUTS}, got {layout!r}.")


def segments(layout: str, rank: int, size: int, n_local: int) -> Tuple[Segment, ...]:
    """The segments of rank `rank`'s shard of length `n_local` (a sequence of size * n_local)."""
    if layout == "contiguous":
        return ((0, rank * n_local, n_local),)
    c = n_local // 2
    return ((0, rank * c, c), (c, (2 * size - 1 - rank) * c, c))


def _group(group):
    return mx.distributed.init() if group is None else group


def _check_axis(x, axis: int, where: str) -> int:
    if not isinstance(x, mx.array):
        raise TypeError(f"[{where}] x must be an mx.array, got {type(x).__name__}.")
    if isinstance(axis, bool) or not isinstance(axis, int) or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"[{where}] axis must be an int in [{-x.ndim}, {x.ndim}) for an array of "
                         f"shape {tuple(x.shape)}, got {axis!r}.")
    return axis % x.ndim


def shard_sequence(x: mx.array, group=None, layout: str = "zigzag", axis: int = 2) -> mx.array:
    """This rank's shard of a whole sequence `x` (every rank passes the same `x`).

    Args:
        x (array): the whole sequence, e.g. [B, H, N, D] with the sequence along `axis`.
        group (Group, optional): the ranks the sequence is split across; default `mx.distributed.init()`.
        layout (str): "zigzag" (N must divide into 2 * size chunks) or "contiguous" (into size).
        axis (int): the sequence axis.

    Returns:
        array: the shard, N / size long along `axis`.
    """
    where = "shard_sequence"
    check_layout(layout, where)
    axis = _check_axis(x, axis, where)
    group = _group(group)
    size, rank = group.size(), group.rank()
    pieces = size * (2 if layout == "zigzag" else 1)
    n = x.shape[axis]
    if n % pieces:
        raise ValueError(f"[{where}] the sequence length {n} (axis {axis} of shape {tuple(x.shape)}) must "
                         f"be a multiple of {pieces} for layout {layout!r} over {size} ranks.")
    n_local = n // size
    parts = []
    for _, start, length in segments(layout, rank, size, n_local):
        index = [slice(None)] * x.ndim
        index[axis] = slice(start, start + length)
        parts.append(x[tuple(index)])
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=axis)


def gather_sequence(x_local: mx.array, group=None, layout: str = "zigzag", axis: int = 2) -> mx.array:
    """The whole sequence from every rank's shard (a collective: every rank must call it).

    Args:
        x_local (array): this rank's shard, the same shape on every rank.
        group (Group, optional): default `mx.distributed.init()`.
        layout (str): the layout the shards were made with.
        axis (int): the sequence axis.

    Returns:
        array: the whole sequence, size * N_local long along `axis`, on every rank.
    """
    where = "gather_sequence"
    check_layout(layout, where)
    axis = _check_axis(x_local, axis, where)
    group = _group(group)
    size = group.size()
    n_local = x_local.shape[axis]
    if layout == "zigzag" and n_local % 2:
        raise ValueError(f"[{where}] layout 'zigzag' needs an even shard length, got {n_local} "
                         f"(axis {axis} of shape {tuple(x_local.shape)}).")
    if size == 1:
        return x_local
    moved = mx.moveaxis(x_local, axis, 0)
    gathered = mx.distributed.all_gather(moved, group=group)  # ranks in order along axis 0
    pieces = []
    for rank in range(size):
        for local, start, length in segments(layout, rank, size, n_local):
            pieces.append((start, rank * n_local + local, length))
    pieces.sort()
    whole = mx.concatenate([gathered[offset:offset + length] for _, offset, length in pieces], axis=0)
    return mx.moveaxis(whole, 0, axis)

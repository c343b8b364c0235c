"""Context parallelism: attention over a sequence split along N across the ranks of an MLX group.

    out = ring_attention(q, k, v, mask="causal")   # q, k, v: this rank's shards [B, H, N_local, D]

Each rank holds a shard of q, k and v (`shard_sequence` makes one, `gather_sequence` joins them);
K/V shards travel around the ring of ranks while every rank attends its queries to each visiting
shard with the same kernels as `flash_attention`, merging partial results through lse. Built on
`mx.distributed`'s send / recv / all_gather only, so it runs on every backend MLX has (ring, jaccl,
mpi, nccl). See ring.py for the schedule and what overlaps, plan.py for the per-step calls.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import mlx.core as mx

from ..api import flash_attention
from ..backends import select_backend
from ..spec import FLOAT_DTYPES, check_inputs
from .layout import LAYOUTS, gather_sequence, segments, shard_sequence
from .ring import Ring, RingAttention

__all__ = ["ring_attention", "shard_sequence", "gather_sequence", "LAYOUTS"]

_WHERE = "ring_attention"
# Per-rank facts that every rank must agree on (all_gather'ed once per call).
_FACTS = ("error", "batch", "q_heads", "kv_heads", "q_len", "kv_len", "head_dim", "value_dim", "dtype",
          "causal", "window_left", "window_right", "layout")


def _local_check(q, k, v, scale, mask, window_size, softcap, return_lse, layout, size):
    """(spec or None, error or None) for this rank's arguments, without raising."""
    try:
        if not isinstance(layout, str) or layout not in LAYOUTS:
            raise ValueError(f"[{_WHERE}] layout must be one of {LAYOUTS}, got {layout!r}.")
        if not isinstance(return_lse, bool):
            raise TypeError(f"[{_WHERE}] return_lse must be a bool, got {return_lse!r}.")
        if isinstance(mask, mx.array):
            raise ValueError(f"[{_WHERE}] mask must be None or \"causal\" (over global positions); array "
                             f"masks are not supported across shards, got an array of shape {tuple(mask.shape)}.")
        spec, _ = check_inputs(q, k, v, scale=scale, mask=mask, window_size=window_size, softcap=softcap)
        if size > 1:
            for name, n in (("q", spec.q_len), ("k", spec.kv_len)):
                if n == 0:
                    raise ValueError(f"[{_WHERE}] the {name} shard is empty (shape {tuple((q if name == 'q' else k).shape)}).")
                if layout == "zigzag" and n % 2:
                    raise ValueError(f"[{_WHERE}] layout 'zigzag' needs an even shard length (two chunks per "
                                     f"rank), got {name} of shape {tuple((q if name == 'q' else k).shape)} "
                                     f"(N_local = {n}).")
        return spec, None
    except (TypeError, ValueError) as e:
        return None, e


def _agree(group, spec, error, layout):
    """all_gather every rank's facts; raise the same kind of error on every rank if they disagree."""
    if spec is None:
        facts = [1] + [0] * (len(_FACTS) - 1)
    else:
        left, right = spec.window if spec.window is not None else (-1, -1)
        facts = [0, spec.batch, spec.q_heads, spec.kv_heads, spec.q_len, spec.kv_len, spec.head_dim,
                 spec.value_dim, FLOAT_DTYPES.index(spec.dtype), int(spec.causal), left, right,
                 LAYOUTS.index(layout)]
    table = mx.distributed.all_gather(mx.array([facts], dtype=mx.int64), group=group)
    rows = [dict(zip(_FACTS, row)) for row in table.tolist()]
    failed = [i for i, row in enumerate(rows) if row["error"]]
    if error is not None:
        raise error
    if failed:
        raise ValueError(f"[{_WHERE}] rank(s) {failed} rejected their arguments (see the error there); "
                         f"every rank raises so that none waits on the others.")
    mine = rows[group.rank()]
    for name in _FACTS[1:]:
        values = [row[name] for row in rows]
        if len(set(values)) > 1:
            what = {"q_len": "the q shard lengths (N_local of q)", "kv_len": "the k / v shard lengths (N_local of k)",
                    "layout": "layout", "causal": "mask", "window_left": "window_size",
                    "window_right": "window_size"}.get(name, f"the shards' {name}")
            shown = [LAYOUTS[x] for x in values] if name == "layout" else values
            raise ValueError(f"[{_WHERE}] {what} must be the same on every rank, got {shown} for ranks "
                             f"0..{len(rows) - 1} (this is rank {group.rank()}, {name} = {mine[name]}).")


def ring_attention(q: mx.array, k: mx.array, v: mx.array, *, scale: Optional[float] = None,
                   mask: Union[None, str] = None, window_size: Optional[Tuple[int, int]] = None,
                   softcap: Optional[float] = None, return_lse: bool = False, group=None,
                   layout: str = "zigzag", backend: str = "auto"):
    """Attention over a sequence split along N across the ranks of `group`, with gradients.

    Every rank calls it with its shards; the result is this rank's shard of exactly what
    `flash_attention` returns on the whole sequence. Memory per rank: the local shards, one
    visiting K/V shard in flight and the backend's own O(N_local) working set; nothing O(N_global).
    The ring is evaluated step by step inside the call (the order of the exchanges must be fixed),
    so it works under mx.grad / mx.value_and_grad / nn.value_and_grad but cannot be traced by
    mx.compile: compile the rest of the model around it.

    Args:
        q (array): this rank's query shard [B, Hq, N_local, D].
        k (array): this rank's key shard [B, Hkv, N_local_k, D] (Hq a multiple of Hkv).
        v (array): this rank's value shard [B, Hkv, N_local_k, Dv].
        scale (float, optional): multiplies q k^T. Default: 1 / sqrt(D).
        mask (None | "causal"): "causal" over global positions, bottom-right aligned as in
            `flash_attention`. Array masks raise a ValueError.
        window_size ((int, int), optional): (left, right) sliding window over global positions.
        softcap (float, optional): scores become softcap * tanh(s / softcap).
        return_lse (bool): also return this rank's shard of lse [B, Hq, N_local] (fp32, differentiable).
        group (Group, optional): the ranks; default `mx.distributed.init()`. A group of one rank
            is plain `flash_attention`.
        layout (str): "zigzag" (rank r holds chunks r and 2n-1-r of 2n; balances causal work;
            N_local must be even) or "contiguous" (rank r holds [r N_local, (r+1) N_local)).
        backend (str): as in `flash_attention` ("auto", "mlx", "metal", "cuda").

    Returns:
        array: this rank's shard of the output [B, Hq, N_local, Dv]; or (out, lse) with return_lse.

    Raises:
        ValueError / TypeError, on every rank (the ranks agree through one small all_gather first):
        bad layout, shard shapes that differ across ranks, odd N_local under zigzag, array masks,
        and everything `flash_attention` rejects.
    """
    group = mx.distributed.init() if group is None else group
    size = group.size()
    spec, error = _local_check(q, k, v, scale, mask, window_size, softcap, return_lse, layout, size)
    if size == 1:
        if error is not None:
            raise error
        return flash_attention(q, k, v, scale=scale, mask=mask, window_size=window_size, softcap=softcap,
                               return_lse=return_lse, backend=backend)
    _agree(group, spec, error, layout)
    ring = Ring(group)
    q_segments = lambda r: segments(layout, r, size, spec.q_len)  # noqa: E731
    k_segments = lambda r: segments(layout, r, size, spec.kv_len)  # noqa: E731
    attention = RingAttention(lambda s: select_backend(backend, s, None, lse_is_used=True), spec, ring, q_segments, k_segments,
                              size * spec.q_len, size * spec.kv_len)

    def forward(q_, k_, v_):
        return attention.forward(q_, k_, v_)

    function = mx.custom_function(forward)

    @function.vjp
    def function_vjp(primals, cotangents, outputs):
        d_out, d_lse = cotangents
        out, lse = outputs
        return attention.backward(*primals, out, lse, d_out, d_lse if return_lse else None)

    out, lse = function(q, k, v)
    return (out, lse) if return_lse else out

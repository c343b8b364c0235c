"""The "mlx" backend: attention from MLX ops alone, in query-row chunks. Runs on every MLX device.

Shape of the computation: MLX's own unfused attention cut into chunks of query rows, each chunk
attending to all of the keys its rows may see at once (no online softmax, no rescaling):
    forward   S = q (scale k)^T (one matmul), the masks (where / add), P = softmax(S) (MLX's
              precise softmax: fp32 statistics, P in the input dtype), lse = max S - log(max P),
              O = P V (one matmul). Each chunk's O and lse are final.
    backward  per chunk: recompute S and P = softmax(S) (lse is not needed), dP - D in one
              product ([dO, -D] [V, 1]^T), dS = P (dP - D) (times 1 - tanh^2 under softcap);
              dQ of the chunk's rows = dS (scale k) is final; dK | dV of its keys +=
              [dS^T q | P^T dO] in fp32 -- five products, as ALGORITHM.md's one-pass variant (dK
              takes the scale once, at the end). When the caller's lse covers more keys than the
              call's (the ring's pieces: lse_is_local=False), P = exp(S - lse) instead.
Every pass over a score block is one MLX primitive. mx.compile is not used: under mx.grad /
mx.value_and_grad every array derived from the primals is a tracer, and a compiled function called
with tracers runs uncompiled, so the fused fp32 chains this backend once compiled ran as ~10
kernels per block on the H100 (N=4096 D=128 bf16 causal, fwd+bwd under value_and_grad: 325
kernels, 15.0 ms of kernel time, 16.6 ms per call; with the passes below and GPU-sized chunks
119 kernels, 5.6 ms, 6.5 ms, against unfused attention's 28, 5.5 ms, 5.9 ms:
benchmarks/kernel_profile.py, RESULTS.md). Bytes read and written per score element in the input dtype (bf16): forward 8
(softmax 4, the two maxima 2 + 2), backward 10 (softmax 4, times dP - D 6), plus 5 per pass
for a band or array mask (where). Unfused attention's VJP makes about 22.

Under a causal mask or a window a chunk [q0, q1) sees only keys spec.key_range(q0, q1): about half
of the causal work is skipped, and an index mask is built only for the chunk's band edge. Rows
that see no key (a softmax of -inf only is 0 / 0) output 0 and get P = 0 in the backward, where a
chunk may hold such rows (array masks; the chunk at the edge of a causal mask with Nq > Nk or a
window). GQA: a chunk's G query heads x rows are the rows of one matrix [B, Hkv, G * rows, D], so
every product is a plain batched matmul against k / v [B, Hkv, Nk, D] (never tiled) and dK / dV
sum the G heads in the matmul's fp32 accumulation.

Why the chunks are chained: MLX does not evaluate independent chunks one after another. Measured
on the CPU (B=1 H=8 N=4096 D=16, 16 chunks of 32 MiB scores): chunks whose results are only
concatenated at the end peak at all of their score blocks (516 MiB for softmax + P V; 1 GiB with
logsumexp + exp); mx.depends did not help (546 MiB). So step i's result is ONE array that step
i + 1 reads its inputs from: the next chunk's q rows (and dO rows, backward) packed with one
element of each result of the step (its output rows and lse; its dQ rows and the dK | dV arrays
it made), so that every result is computed within its step (_chained). Then a step's temporaries
die inside it, and the peak is the operations MLX keeps in flight. The O(N * D) copies this costs
are per chunk and small next to a chunk's products. On a GPU, MLX keeps every input of an op until
its command buffer completes and lets several buffers run ahead; there the chain bounds the peak
only when MLX waits for memory (mx.set_memory_limit; benchmarks/RESULTS.md has the figures).

Precision: fp16 / bf16 inputs stay in their dtype for the five matmuls (MLX accumulates in fp32
and rounds the product to the input dtype) and for the elementwise passes, as MLX's own unfused
attention and its softmax VJP; the softmax statistics are fp32, and dK / dV accumulate across
chunks in fp32. lse's error is max P's rounding (2^-9 absolute in bf16), below the error S's own
rounding puts in it. D = rowsum(dO O) is subtracted inside the dP product's fp32 accumulation, as
two input-dtype columns (hi + lo, ~2^-17 relative in bf16): where a row sees one key, dP - D
cancels in exact arithmetic, and a D off by the rounding of dP (2^-9) left a 10% error in dQ
(found by the property tests). fp32 inputs compute everything in fp32.

Chunk sizes (plan_chunks): one fp32 score block [B, Hq, rows, visible keys] holds 64 query rows
of every batch entry and head on the CPU (so the peak grows linearly in N) and 1/2 of the whole
score matrix on a GPU (all of it while that is at most 8 MiB: one chunk, no chain, for small
problems and for the ring's key pieces; at least 4 MiB above that), and at most 1/512 of the
memory on the CPU (clamped to [32, 256] MiB), 1/128 on a GPU (to [32 MiB, 1 GiB]), where the
memory is the device's or MLX's memory limit if that is lower (budget.memory_budget_bytes: under
mx.set_memory_limit the blocks shrink with the limit); chunks start on multiples of 64 rows and
take at least 64. Narrow chunks (the first ones under a causal mask) are taller, so each holds
about one block of scores. The CPU's rows meet its memory target (forward+backward peak under a
quarter of MLX's unfused attention, tests/test_memory.py). On a GPU each MLX op is a kernel launch
and a chunk takes about 15 forward and 25 backward, so fewer, larger chunks win there (measured:
the comment at SCORE_FRACTIONS).

Small calls (whole_function: fp32 scores of at most 32 MiB; on the CPU, under a causal mask or a
window, at most 8 MiB) skip all of this: `attention` is MLX's unfused graph with these semantics, and MLX's VJP keeps P
instead of recomputing it (four products in the backward, not five); flash_attention calls it
outside the custom function. The ring calls forward / backward directly and always chunks.

Sinks: a row's sink joins its lse (lse = logaddexp(logsumexp(S), sink)); the keys' share of the
row, 1 - p_sink, scales O (forward) and P (backward); the sink's gradient -sum_i p_sink,i D_i
(sinks.py) takes the unrounded fp32 D_i, since no rounded dP cancels against D there.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import mlx.core as mx

from ..spec import AttentionSpec
from .budget import memory_budget_bytes
from .sinks import empty_lse, sinks_gradient

# Chunk plan (see the module docstring): one fp32 score block [B, Hq, rows, keys] may take
# 1/SCORE_FRACTION of the whole Nq x Nk fp32 score matrix (all of it while that is at most
# SMALL_BLOCK_BYTES: one chunk, no step chain, where memory is cheap; else at least half of
# SMALL_BLOCK_BYTES), and at most 1/DEVICE_FRACTION of the device's memory, clamped to
# [MIN_BLOCK_BYTES, MAX_BLOCK_BYTES x 512 / DEVICE_FRACTION]; both fractions per device type.
# CPU: no fraction (BLOCK_ROWS bounds its blocks), 1/512 of the memory. GPU: 1/2 and 1/128
# (640 MB on an H100).
# Each MLX op is a kernel launch there, and a chunk costs about 40 of them, so fewer, larger
# chunks win. On an H100 (B=1 H=16 fwd+bwd, benchmarks/mlx_backend_variants.py,
# results/h100_mlx_backend.json), against 1/512 of the memory, 1/128 took
# N=4096 D=128 bf16 causal 6.75 -> 6.00 ms, N=8192 23.6 -> 18.5, D=64 6.90 -> 5.50, D=256 9.92 ->
# 7.38, fp32 N=8192 causal 41.3 -> 31.1 ms; 1/32 was no faster (6.12, 20.4, 5.45, 7.22, 34.6 ms).
# Then, at 1/128, 1/2 of the scores against 1/4 (the same plan from N=8192 at H=16, where the
# device share caps both): D=64 6.35 -> 5.47 ms, N=4096 D=256 7.22 -> 5.92, N=2048 D=256 causal
# 3.96 -> 3.65, N=4096 D=128 causal 6.11 -> 6.20 (results/h100_mlx_backend.json,
# "h100_score_fractions").
# Earlier, at 1/512, 1/8 of the scores was slower than 1/4 at 6 of 7 shapes (bf16 N=4096 D=128
# causal 9.37 vs 8.52 ms, D=64 8.43 vs 7.94 ms, N=2048 D=256 causal 7.15 vs 4.22 ms). MLX's CUDA
# backend holds an op's inputs until its command buffer (100 ops on an H100) completes and lets
# up to 10 buffers run ahead, so the block size bounds the GPU's peak only when MLX has to wait
# for memory (mx.set_memory_limit): benchmarks/RESULTS.md.
SCORE_FRACTIONS = (("cpu", 1), ("gpu", 2))
# ... and at most this many query rows (of every batch entry and head) x their keys; 0: no bound.
# The CPU's blocks are 64 rows (MIN_ROWS): its peak then grows linearly in N (tests/test_memory.py),
# where 1/32 of the score matrix grew with N^2 / 32 (32 rows at N=1024, 128 at 4096); at N=2048
# the two are one plan. The CPU's time is its products', so more chunks cost little there.
BLOCK_ROWS = (("cpu", 64), ("gpu", 0))
SMALL_BLOCK_BYTES = 8 << 20
# Calls whose whole fp32 score matrix takes at most this (B=1 H=8: N <= 1024) run as one block
# under MLX's own autograd (whole_function; on the CPU banded calls only up to SMALL_BLOCK_BYTES).
WHOLE_BYTES = 32 << 20
DEVICE_FRACTIONS = (("cpu", 512), ("gpu", 128))
MIN_BLOCK_BYTES = 32 << 20
MAX_BLOCK_BYTES = 256 << 20
ROW_ALIGN = 64                 # chunk boundaries on multiples of 64 query rows (matmul tiles)
MIN_ROWS = 64                  # ... and at least 64 rows per chunk (fewer steps beat a smaller block)


def _per_device(table, device_type: str) -> int:
    """The entry of a ((device type, value), ...) table for "gpu", or "cpu" for any other type."""
    return dict(table)["gpu" if device_type == "gpu" else "cpu"]


def score_fraction(device_type: str, score_fractions=SCORE_FRACTIONS) -> int:
    """1/fraction of the score matrix is one score block on a device of this type ("cpu" or "gpu")."""
    return _per_device(score_fractions, device_type)


def score_block_bytes(spec: AttentionSpec, memory_bytes: int, device_type: str = "cpu",
                      score_fractions=SCORE_FRACTIONS, device_fractions=DEVICE_FRACTIONS) -> int:
    """Bytes one fp32 score block [B, Hq, rows, keys] of this call may take on a device with
    `memory_bytes` of type `device_type` ("cpu" or "gpu"), with `score_fractions` per device type
    and at most 1/F of the device's memory, F from `device_fractions` per device type (clamped to
    [MIN_BLOCK_BYTES, MAX_BLOCK_BYTES x 512 / F])."""
    device_fraction = _per_device(device_fractions, device_type)
    cap = MAX_BLOCK_BYTES * 512 // device_fraction  # the clamp's top scales with the fraction
    device_share = min(max(memory_bytes // device_fraction, MIN_BLOCK_BYTES), cap)
    whole = 4 * spec.batch * spec.q_heads * spec.q_len * spec.kv_len
    fraction = score_fraction(device_type, score_fractions)
    share = whole // fraction
    rows = _per_device(BLOCK_ROWS, device_type)
    if rows:
        share = min(share, 4 * spec.batch * spec.q_heads * rows * spec.kv_len)
    problem_share = whole if whole <= SMALL_BLOCK_BYTES else max(share, SMALL_BLOCK_BYTES // 2)
    return max(1, min(device_share, problem_share))


def plan_chunks(spec: AttentionSpec, memory_bytes: Optional[int] = None, score_fractions=SCORE_FRACTIONS,
                device_fractions=DEVICE_FRACTIONS):
    """(batch_chunk, [(q0, q1, k0, k1), ...]): batch entries per independent chunk and the query-row
    chunks, each with the keys [k0, k1) its rows may see (k0 >= k1: none).

    A chunk takes as many rows as keep rows x visible keys within the score block, so under a
    causal mask or a window the early (narrow) chunks are taller.

    Args:
        spec: the call.
        memory_bytes: the memory to plan with; default: the default device's, or MLX's memory
            limit where that is lower (budget.memory_budget_bytes).
        score_fractions: ((device type, fraction), ...), default SCORE_FRACTIONS.
        device_fractions: ((device type, F), ...): a block takes at most 1/F of memory_bytes.
    """
    device = mx.default_device()
    if memory_bytes is None:
        memory_bytes = memory_budget_bytes(device)
    device_type = "gpu" if device.type == mx.gpu else "cpu"
    elements = score_block_bytes(spec, memory_bytes, device_type, score_fractions, device_fractions) // 4
    heads, Nq = max(1, spec.q_heads), spec.q_len
    min_rows = max(1, min(MIN_ROWS, Nq))
    batch_chunk = max(1, min(spec.batch, elements // max(1, heads * min_rows * spec.kv_len)))
    per_row = batch_chunk * heads  # score elements per (query row, key)

    def fits(q0, q1):
        k0, k1 = spec.key_range(q0, q1)
        return (q1 - q0) * max(k1 - k0, 1) * per_row <= elements

    chunks, q0 = [], 0
    while q0 < Nq:
        lo, hi = min(q0 + min_rows, Nq), Nq  # the largest q1 in [lo, hi] that fits (at least lo)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(q0, mid) else (lo, mid - 1)
        q1 = lo if lo == Nq or lo - q0 < ROW_ALIGN else q0 + (lo - q0) // ROW_ALIGN * ROW_ALIGN
        k0, k1 = spec.key_range(q0, q1)
        chunks.append((q0, q1, k0, k1))
        q0 = q1
    return batch_chunk, chunks


def plan_blocks(spec: AttentionSpec, memory_bytes: Optional[int] = None) -> Tuple[int, int]:
    """(batch_chunk, keys): the keys of a score block that spans all query rows of a batch chunk.

    For callers that size their own key pieces to this backend's memory budget (the ring).
    """
    device = mx.default_device()
    if memory_bytes is None:
        memory_bytes = memory_budget_bytes(device)
    batch_chunk, _ = plan_chunks(spec, memory_bytes)
    elements = score_block_bytes(spec, memory_bytes, "gpu" if device.type == mx.gpu else "cpu") // 4
    keys = elements // max(1, batch_chunk * spec.q_heads * spec.q_len)
    return batch_chunk, max(1, min(max(keys, MIN_ROWS), spec.kv_len))


# -- the elementwise parts, each an MLX primitive on the input dtype (why: the module docstring) ----

def _final_scores(s, keep, mask, softcap: Optional[float]):
    """The final scores from the product s = q (scale k)^T, in s's dtype: softcap (in fp32), the
    additive mask, -inf where `keep` (bool, or None) is False. Returns (scores, t) with
    t = tanh(s / softcap) in fp32 under softcap (the backward's 1 - t^2), else None."""
    t = None
    if softcap is not None:
        t = mx.tanh(s.astype(mx.float32) * (1.0 / softcap))
        s = (t * softcap).astype(s.dtype)
    if mask is not None:
        if mask.dtype == mx.bool_:
            keep = mask if keep is None else mx.logical_and(keep, mask)
        else:
            s = s + mask
    if keep is not None:
        s = mx.where(keep, s, mx.array(-math.inf, s.dtype))
    return s, t


class _Problem:
    """One chunk of batch entries: GQA-shaped views, the scaled keys, the broadcastable mask, the band.

    q is viewed as [B, Hkv, G, Nq, D]; k, v stay [B, Hkv, Nk, D]; all in the input dtype. The scale
    is folded into the keys once (k_scaled = scale * k), so S = q k_scaled^T and dQ = dS k_scaled
    need no further scaling (dK = scale * dS^T q is scaled once, in fp32, at the end). A chunk's G
    query heads x rows are one matrix [B, Hkv, G * rows, D], so every product is a plain batched
    matmul (no broadcast of k / v).
    """

    def __init__(self, q, k, v, mask, spec: AttentionSpec):
        B, Hkv, G = q.shape[0], spec.kv_heads, spec.group
        self.spec = spec
        self.shape = (B, Hkv, G)
        self.q = q.reshape(B, Hkv, G, spec.q_len, spec.head_dim)
        self.k_scaled = k * spec.scale  # a Python float keeps k's dtype
        self.k, self.v = k, v
        self._index = None  # (query index + diagonal, key index), for band masks
        self._pad = {}  # the chain's zero padding, one array per width
        self.mask = None
        if mask is not None:
            mb, mh, mq, mk = mask.shape
            if mh == spec.q_heads and mh > 1:
                self.mask = mask.reshape(mb, Hkv, G, mq, mk)
            else:
                self.mask = mask.reshape(mb, 1, 1, mq, mk)

    def rows(self, x, q0, q1):
        """x [B, Hkv, G, N, d] rows [q0, q1) as one matrix [B, Hkv, G * (q1 - q0), d]."""
        B, Hkv, G = self.shape
        return x[..., q0:q1, :].reshape(B, Hkv, G * (q1 - q0), x.shape[-1])

    def scores(self, q_rows, q0, q1, k0, k1):
        """The chunk's final scores [B, Hkv, G, rows, keys] in the input dtype, and softcap's t."""
        B, Hkv, G = self.shape
        s = mx.matmul(q_rows, mx.swapaxes(self.k_scaled[..., k0:k1, :], -1, -2))
        s = s.reshape(B, Hkv, G, q1 - q0, k1 - k0)
        m = self.mask
        if m is not None:
            m = m[..., q0:q1, :] if m.shape[-2] > 1 else m
            m = m[..., k0:k1] if m.shape[-1] > 1 else m
        return _final_scores(s, self._band(q0, q1, k0, k1), m, self.spec.softcap)

    def may_have_empty_rows(self, q0, q1) -> bool:
        """Whether a row of [q0, q1) may see no key (its softmax is NaN, its output 0): an array mask
        may hide whole rows; under a causal mask or window the rows that see a key are one interval
        (key_range is monotone in the row), so the first and last rows tell."""
        spec = self.spec
        if spec.mask_kind != "none":
            return True
        if not spec.has_band:
            return False
        return any(lo >= hi for lo, hi in (spec.key_range(q0, q0 + 1), spec.key_range(q1 - 1, q1)))

    def _band(self, q0, q1, k0, k1) -> Optional[mx.array]:
        """Bool [q, k] index mask for a chunk straddling the causal/window edge; None if all visible."""
        spec = self.spec
        if not spec.has_band:
            return None
        lo_last, _ = spec.key_range(q1 - 1, q1)
        _, hi_first = spec.key_range(q0, q0 + 1)
        lo_first, _ = spec.key_range(q0, q0 + 1)
        _, hi_last = spec.key_range(q1 - 1, q1)
        if max(lo_first, lo_last) <= k0 and k1 <= min(hi_first, hi_last):
            return None  # every query row of the chunk sees every key in it
        if self._index is None:  # built once per call: a band chunk's mask is then one compare
            self._index = (mx.arange(spec.q_len) + spec.diagonal, mx.arange(spec.kv_len))
        i = self._index[0][q0:q1, None]
        j = self._index[1][None, k0:k1]
        keep = None
        if spec.causal:
            keep = j <= i
        if spec.window is not None:
            left, right = spec.window
            for cond in ((j >= i - left) if left >= 0 else None, (j <= i + right) if right >= 0 else None):
                if cond is not None:
                    keep = cond if keep is None else mx.logical_and(keep, cond)
        return keep


def _chunks(spec: AttentionSpec, batch_chunk: int):
    return [(b, min(b + batch_chunk, spec.batch)) for b in range(0, spec.batch, batch_chunk)]


def _slice_batch(x, b0, b1):
    return None if x is None else (x[b0:b1] if x.shape[0] > 1 else x)


def _chained(payload, ties, problem):
    """The step chain's ONE array [B, Hkv, n + t]: the payload arrays of the next step, flattened per
    (batch, kv head), first; then one element of each of this step's results (`ties`), padded to a
    multiple of 8 elements. The next step reads its rows as views [..., :n]: at offset 0, with a row
    stride that keeps 16-byte alignment where n does. (With the ties in front, the views started at
    an odd element and MLX's CUDA matmuls of every step fell back to cuBLAS's align-1 kernels.)
    Ties of another dtype are cast together, and the padding is one array per call: each MLX op is
    a kernel launch on a GPU, and a chunk's launches are what its time is made of at small N."""
    B, Hkv, _ = problem.shape
    dtype = payload[0].dtype
    flat = [x.reshape(B, Hkv, -1) for x in payload]
    same = [t.reshape(B, Hkv, 1) for t in ties if t.dtype == dtype]
    other = [t.reshape(B, Hkv, 1) for t in ties if t.dtype != dtype]
    if other:
        same.append((other[0] if len(other) == 1 else mx.concatenate(other, axis=-1)).astype(dtype))
    pad = -sum(t.shape[-1] for t in same) % 8
    if pad:
        if pad not in problem._pad:
            problem._pad[pad] = mx.zeros((B, Hkv, pad), dtype)
        same.append(problem._pad[pad])
    return mx.concatenate(flat + same, axis=-1)


def forward(q, k, v, mask, spec: AttentionSpec, sinks=None,
            score_fractions=SCORE_FRACTIONS, device_fractions=DEVICE_FRACTIONS) -> Tuple[mx.array, mx.array]:
    """Returns (out [B, Hq, Nq, Dv] in q's dtype, lse [B, Hq, Nq] fp32, natural log).

    sinks ([Hq] or None): per-head sink logits, one extra softmax score with no value.
    score_fractions, device_fractions: the chunk plan's limits per device type (plan_chunks).
    """
    B, Hq, Nq, Dv = spec.batch, spec.q_heads, spec.q_len, spec.value_dim
    if min(B, Hq, Nq) == 0 or spec.kv_len == 0:
        return mx.zeros((B, Hq, Nq, Dv), spec.dtype), empty_lse(sinks, (B, Hq, Nq))
    batch_chunk, chunks = plan_chunks(spec, score_fractions=score_fractions, device_fractions=device_fractions)
    outs, lses = [], []
    for b0, b1 in _chunks(spec, batch_chunk):
        out, lse = _forward_chunk(q[b0:b1], k[b0:b1], v[b0:b1], _slice_batch(mask, b0, b1), spec, chunks, sinks)
        outs.append(out)
        lses.append(lse)
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
    lse = lses[0] if len(lses) == 1 else mx.concatenate(lses, axis=0)
    return out, lse


def _forward_chunk(q, k, v, mask, spec, chunks, sinks=None):
    problem = _Problem(q, k, v, mask, spec)
    B, Hkv, G = problem.shape
    Dv, dtype = spec.value_dim, spec.dtype
    sink = None if sinks is None else sinks.astype(mx.float32).reshape(1, Hkv, G, 1)
    # The step chain (see the module docstring): step i's result is ONE array holding one element
    # of its output rows, one of its lse (the lse is not an input of the output, so untied it
    # would keep the step's scores alive to the end) and the q rows of step i + 1, which step
    # i + 1 reads from it.
    outs, lses = [], []
    q_rows = problem.rows(problem.q, *chunks[0][:2])
    for index, (q0, q1, k0, k1) in enumerate(chunks):
        rows = q1 - q0
        if k0 >= k1:  # no key visible to any row of the chunk
            out = mx.zeros((B, Hkv, G, rows, Dv), dtype)
            lse = (mx.full((B, Hkv, G, rows), -math.inf, mx.float32) if sink is None
                   else mx.broadcast_to(sink, (B, Hkv, G, rows)))
        else:
            s, _ = problem.scores(q_rows, q0, q1, k0, k1)
            p = mx.softmax(s, axis=-1, precise=True)
            # lse from the softmax itself: its largest entry is exp(max S - lse), so
            # lse = max S - log(max P), two reductions over the input dtype (an fp32 copy of S for
            # logsumexp read and wrote 10 bytes per score). The error is max P's rounding, 2^-9
            # (bf16) absolute, below that of S's own rounding (|S| 2^-9); fp32 inputs: 2^-24.
            top = mx.max(s, axis=-1).astype(mx.float32)
            lse_keys = top - mx.log(mx.max(p, axis=-1).astype(mx.float32))
            empty = problem.may_have_empty_rows(q0, q1)
            if empty:  # rows that see no key: max S = -inf, P = 0 / 0
                lse_keys = mx.where(top == -math.inf, -math.inf, lse_keys)
            out = mx.matmul(p.reshape(B, Hkv, G * rows, k1 - k0), v[..., k0:k1, :]).reshape(B, Hkv, G, rows, Dv)
            lse = lse_keys
            if sink is not None:
                lse = mx.logaddexp(lse_keys, sink)
                out = (out * mx.exp(lse_keys - lse)[..., None]).astype(dtype)  # the keys' share
            if empty:
                # Rows that see no key: their softmax is 0 / 0; the output is 0 (rows x Dv, cheap).
                out = mx.where((lse_keys > -math.inf)[..., None], out, mx.array(0, dtype))
        lses.append(lse)
        outs.append(out)
        if index + 1 < len(chunks):
            following = problem.rows(problem.q, *chunks[index + 1][:2])
            state = _chained([following], [out[..., :1, :1, :1], lse[..., :1, :1]], problem)
            q_rows = state[..., :following.size // (B * Hkv)].reshape(following.shape)
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)
    lse = lses[0] if len(lses) == 1 else mx.concatenate(lses, axis=3)
    return out.reshape(B, spec.q_heads, spec.q_len, Dv), lse.reshape(B, spec.q_heads, spec.q_len)


def backward(q, k, v, mask, out, lse, d_out, d_lse, spec: AttentionSpec, sinks=None,
             score_fractions=SCORE_FRACTIONS, lse_is_local: bool = True, device_fractions=DEVICE_FRACTIONS):
    """Returns (dq, dk, dv, d_sinks) in the input dtypes (d_sinks None without sinks).
    d_lse (or None) is the cotangent of lse; score_fractions as for forward.

    lse_is_local: lse is this call's own (its keys and sinks), so P is recomputed as a softmax of
    the chunk's scores. False (the ring's key pieces, whose lse covers all keys of the rows):
    P = exp(S - lse) in fp32, three passes instead of one."""
    # D_i = rowsum(dO * O), minus the lse cotangent (dlse/ds = P folds into the same term).
    dot = (d_out.astype(mx.float32) * out.astype(mx.float32)).sum(-1)
    d_lse32 = None if d_lse is None else d_lse.astype(mx.float32)
    # The sink is a softmax column with no value: its score gradient is p_sink (0 - D_i). No dP
    # product cancels against D here, so d_sinks takes the unrounded fp32 D.
    d_sinks = None if sinks is None else sinks_gradient(
        sinks, lse, dot if d_lse32 is None else dot - d_lse32)
    row_term = dot
    if d_lse32 is not None:
        row_term = row_term - d_lse32
    if min(spec.batch, spec.kv_heads, spec.q_len, spec.kv_len) == 0:
        return mx.zeros_like(q), mx.zeros_like(k), mx.zeros_like(v), d_sinks
    # The keys' share of each row's softmax: 1 without sinks; 1 - p_sink with them. A row whose
    # share is 0 saw no key (its recomputed softmax is 0 / 0 and is replaced by 0).
    # Not local (the ring): P = exp(S - lse) instead, with lse = +inf where it is -inf (P = 0).
    share, safe_lse = None, None
    if not lse_is_local:
        safe_lse = mx.where(lse == -math.inf, math.inf, lse)
        seen = None
    elif sinks is None:
        seen = lse > -math.inf
    else:
        share = -mx.expm1(sinks.astype(mx.float32).reshape(1, -1, 1) - lse)
        seen = share > 0
    batch_chunk, chunks = plan_chunks(spec, score_fractions=score_fractions, device_fractions=device_fractions)
    grads = []
    for b0, b1 in _chunks(spec, batch_chunk):
        rows = [None if x is None else x[b0:b1] for x in (row_term, share, seen, safe_lse)]
        grads.append(_backward_chunk(q[b0:b1], k[b0:b1], v[b0:b1], _slice_batch(mask, b0, b1), *rows,
                                     d_out[b0:b1], spec, chunks))
    if len(grads) == 1:
        return (*grads[0], d_sinks)
    return (*(mx.concatenate(parts, axis=0) for parts in zip(*grads)), d_sinks)


class _KeySums:
    """fp32 sums over the steps of per-key products (dK or dV rows), for steps that run in reverse
    row order: a step's key range [k0, k1) only moves left (see _backward_chunk), so the keys at
    or past its k1 are final (copied out, so the older array's buffer is freed) and the rest take
    ONE add of the step's product."""

    def __init__(self):
        self.acc, self.a, self.b = None, 0, 0  # the sums of keys [a, b) a later step may add to
        self.finals = []  # (first key, final sums of keys [first, first + rows))

    def add(self, product, k0, k1):
        """Adds product [..., k1 - k0, d] (any float dtype) for keys [k0, k1); returns the arrays
        this step made (for the step chain's ties)."""
        made, x = [], product.astype(mx.float32)
        acc, a, b = self.acc, self.a, self.b
        if acc is not None:
            done = max(k1, a)  # keys [done, b) are final (k1 <= b and k0 <= a: the order)
            if done < b:
                piece = acc if done == a else mx.contiguous(acc[..., done - a:, :])
                self.finals.append((done, piece))
                made.append(piece)
            if k1 > a:  # the keys [a, k1) take this step's product too
                kept = acc[..., :k1 - a, :]
                x = x + kept if k0 == a else mx.concatenate([x[..., :a - k0, :], x[..., a - k0:, :] + kept], axis=2)
        self.acc, self.a, self.b = x, k0, k1
        return made + [x]

    def result(self, shape):
        """The sums of all keys [B, Hkv, Nk, d]: the final pieces in key order, zeros for keys no
        step saw."""
        finals = self.finals + ([(self.a, self.acc)] if self.acc is not None else [])
        pieces, edge = [], 0
        for first, piece in sorted(finals, key=lambda f: f[0]):
            if first > edge:
                pieces.append(mx.zeros((*shape[:2], first - edge, shape[3]), mx.float32))
            pieces.append(piece)
            edge = first + piece.shape[2]
        if edge < shape[2]:
            pieces.append(mx.zeros((*shape[:2], shape[2] - edge, shape[3]), mx.float32))
        return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=2)


def _backward_chunk(q, k, v, mask, row_term, share, seen, safe_lse, d_out, spec, chunks):
    problem = _Problem(q, k, v, mask, spec)
    B, Hkv, G = problem.shape
    Nk, D, Dv, dtype = spec.kv_len, spec.head_dim, spec.value_dim, q.dtype
    rows_shape = (B, Hkv, G, spec.q_len, 1)
    share = None if share is None else share.astype(dtype).reshape(rows_shape)
    seen = None if seen is None else seen.reshape(rows_shape)
    safe_lse = None if safe_lse is None else safe_lse.reshape(rows_shape)
    # dP - D in ONE product: dO gets the columns -D_hi, -D_lo (D's fp32 value split into two
    # input-dtype parts) and v the columns 1, 1, padded with zeros to a multiple of 8, so the
    # matmul subtracts D in its fp32 accumulation and rounds once. No separate pass over the
    # scores (4 bytes each), and where a row sees one key (dP = D in exact arithmetic) what is
    # left is D's split error, |D| 2^-17 in bf16, not the rounding of dP (|D| 2^-9: a 10% error
    # in dQ, found by the property tests, when D was not rounded as dP was).
    hi = row_term.astype(dtype)
    lo = (row_term - hi.astype(mx.float32)).astype(dtype)
    width = -(-(Dv + 2) // 8) * 8
    pad = width - Dv - 2
    d_out = d_out.astype(dtype).reshape(B, Hkv, G, spec.q_len, Dv)
    minus_d = mx.concatenate([-hi.reshape(rows_shape), -lo.reshape(rows_shape)]
                             + ([mx.zeros((B, Hkv, G, spec.q_len, pad), dtype)] if pad else []), axis=-1)
    v_plus = mx.concatenate([v, mx.ones((B, Hkv, Nk, 2), dtype)]
                            + ([mx.zeros((B, Hkv, Nk, pad), dtype)] if pad else []), axis=-1)

    # dK and dV are fp32 sums over the steps (_KeySums), and the steps run in reverse row order:
    # under a causal mask or a window a chunk's key range [k0, k1) only moves left as its rows do
    # (no band: it is all keys), so each step adds ONCE per sum. (Key blocks added into in place
    # cost a number of adds quadratic in the chunks under a causal mask: 135 per call at N=8192 on
    # the H100; a slice_update copied the whole array every step, since MLX's GPU backends do not
    # donate a buffer that an op of the open command buffer still references. dK and dV apart:
    # no concatenated copy of both per step.)
    # And the step chain (see the module docstring): step i's result is ONE array holding one
    # element of each of its results (dQ rows, the sums and final pieces it made) and the q and
    # dO rows of step i + 1, which step i + 1 reads from it.
    order = chunks[::-1]
    key_sums = (_KeySums(), _KeySums())  # dK (before its scale), dV (and the -D columns' products)
    dqs = []

    def step_inputs(index):
        q0, q1 = order[index][:2]
        # A step's dO rows get their -D columns here (an augmented copy of all of dO would be one
        # more O(N Dv) array for the whole backward: 5% of the CPU's peak at N=2048).
        do_plus = mx.concatenate([d_out[..., q0:q1, :], minus_d[..., q0:q1, :]], axis=-1)
        return [problem.rows(problem.q, q0, q1), do_plus]

    carried = _chained(step_inputs(0), [], problem)
    for index, (q0, q1, k0, k1) in enumerate(order):
        rows = q1 - q0
        n_q, n_o = G * rows * D, G * rows * width
        q_rows = carried[..., :n_q].reshape(B, Hkv, G * rows, D)
        do_plus = carried[..., n_q:n_q + n_o].reshape(B, Hkv, G * rows, width)
        results = []
        if k0 >= k1:
            dq_rows = mx.zeros((B, Hkv, G * rows, D), dtype)
        else:
            keys = k1 - k0
            s, t = problem.scores(q_rows, q0, q1, k0, k1)
            if safe_lse is not None:  # lse not the call's own (the ring)
                p = mx.exp(s.astype(mx.float32) - safe_lse[..., q0:q1, :]).astype(dtype)
            else:
                p = mx.softmax(s, axis=-1, precise=True)
                if share is not None:
                    p = p * share[..., q0:q1, :]
                if problem.may_have_empty_rows(q0, q1):
                    p = mx.where(seen[..., q0:q1, :], p, mx.array(0, dtype))
            dp_minus_d = mx.matmul(do_plus, mx.swapaxes(v_plus[..., k0:k1, :], -1, -2))
            ds = p * dp_minus_d.reshape(B, Hkv, G, rows, keys)
            if t is not None:  # d softcap(x) / dx = 1 - tanh^2
                ds = (ds.astype(mx.float32) * (1.0 - t * t)).astype(dtype)
            p = p.reshape(B, Hkv, G * rows, keys)
            ds = ds.reshape(B, Hkv, G * rows, keys)
            dq_rows = mx.matmul(ds, problem.k_scaled[..., k0:k1, :])  # complete for these rows
            # The G query heads of a kv head are rows of one product: their sum is the matmul's
            # fp32 accumulation. dK's scale is applied once, at the end.
            # dV from the whole [dO, -D_hi, -D_lo, 0...]: MLX copies a column slice before a
            # matmul, and the extra columns of the product are dropped at the end.
            products = (mx.matmul(mx.swapaxes(ds, -1, -2), q_rows), mx.matmul(mx.swapaxes(p, -1, -2), do_plus))
            for sums, product in zip(key_sums, products):
                results += [x[..., :1, :1] for x in sums.add(product, k0, k1)]
        dqs.append(dq_rows.reshape(B, Hkv, G, rows, D))
        if index + 1 < len(order):
            following = step_inputs(index + 1)
            carried = _chained(following, [dq_rows[..., :1, :1]] + results, problem)
    dq = dqs[0] if len(dqs) == 1 else mx.concatenate(dqs[::-1], axis=3)
    dk = key_sums[0].result((B, Hkv, Nk, D))
    dv = key_sums[1].result((B, Hkv, Nk, width))
    return dq.reshape(q.shape), (dk * spec.scale).astype(k.dtype), dv[..., :Dv].astype(v.dtype)


# -- small problems: the whole call as one score block that MLX differentiates itself --------------

def whole_function(spec: AttentionSpec, whole_bytes: int = WHOLE_BYTES, device_type: Optional[str] = None) -> bool:
    """Whether this call is served by `attention` (MLX's own autograd over one score block) rather
    than the chunked forward / backward pair: no dimension is empty and its fp32 score matrix takes
    at most `whole_bytes`; on the CPU a causal mask or window also needs it within
    SMALL_BLOCK_BYTES (else chunks skip the keys its rows cannot see). whole_bytes = 0: never.
    device_type: "cpu" or "gpu", default the default device's.

    Why: the chunked backward recomputes S and P (five products and a softmax per chunk); MLX's
    VJP of the unfused graph keeps P from the forward and needs four. While the whole score matrix
    is small, that memory is cheap and the recompute is not. On the 2-core CPU (fp32 B=1 H=8 D=64,
    fwd+bwd, against mx.fast): chunked 1.34x at N=512 and 1.28x at N=1024, whole 1.00x at both.
    Causal, chunks of 4 MiB blocks took 0.72x at N=1024 (the whole matrix 1.00x) and one chunk
    1.34x at N=256 and 512 (results/cpu2core_mlx_backend.json,
    "cpu2core_small_before", "cpu2core_causal_small_blocks"). Smaller blocks skip more (1 MiB:
    0.79x at N=512, 0.69x at 1024) but were not kept: the ring's per-rank peak (its key pieces,
    distributed/ring.py) is held to 1.3x of one process running its share, and 1 MiB blocks
    cut that process's peak from 21 to 8.6 MB while the ring's stayed 14.8 MB
    (tests/test_distributed.py: 4 ranks, N_local=512, H=4 causal). On a GPU each MLX op is a kernel launch and a chunk costs about
    40 of them, so small banded calls are whole there too (H100, H=8 N=1024 bf16 causal: 0.57 ms
    whole, 1.46 ms chunked; "h100_whole_path").
    """
    if min(spec.batch, spec.q_heads, spec.q_len, spec.kv_len, spec.head_dim, spec.value_dim) == 0:
        return False
    if device_type is None:
        device_type = "gpu" if mx.default_device().type == mx.gpu else "cpu"
    whole = 4 * spec.batch * spec.q_heads * spec.q_len * spec.kv_len
    if spec.has_band and device_type != "gpu":
        return whole <= min(SMALL_BLOCK_BYTES, whole_bytes)
    return whole <= whole_bytes


def attention(q, k, v, mask, spec: AttentionSpec, sinks=None, return_lse: bool = False):
    """(out [B, Hq, Nq, Dv] in q's dtype, lse [B, Hq, Nq] fp32 or None): MLX's unfused attention
    with mlx-flash's semantics, differentiated by MLX (whole_function says when).

    The same passes as a chunk of `forward` over all rows and keys. Rows that see no key get the
    scores 0 before the softmax and output 0 after it, so no 0 / 0 reaches the softmax's VJP (their
    gradient is 0). lse (only when asked for, or with sinks) is logsumexp over fp32 scores: its VJP
    is P, the term the lse cotangent adds to dS.
    """
    problem = _Problem(q, k, v, mask, spec)
    B, Hkv, G = problem.shape
    Nq, Nk, Dv, dtype = spec.q_len, spec.kv_len, spec.value_dim, spec.dtype
    s, _ = problem.scores(problem.rows(problem.q, 0, Nq), 0, Nq, 0, Nk)
    seen = None
    if problem.may_have_empty_rows(0, Nq):
        seen = mx.max(s, axis=-1, keepdims=True) > -math.inf
        s = mx.where(seen, s, mx.array(0, s.dtype))
    p = mx.softmax(s, axis=-1, precise=True)
    out = mx.matmul(p.reshape(B, Hkv, G * Nq, Nk), v).reshape(B, Hkv, G, Nq, Dv)
    lse = None
    if return_lse or sinks is not None:
        lse = mx.logsumexp(s.astype(mx.float32), axis=-1)
        if seen is not None:
            lse = mx.where(seen[..., 0], lse, -math.inf)
        if sinks is not None:
            lse_keys, lse = lse, mx.logaddexp(lse, sinks.astype(mx.float32).reshape(1, Hkv, G, 1))
            out = (out * mx.exp(lse_keys - lse)[..., None]).astype(dtype)  # the keys' share
        lse = lse.reshape(B, spec.q_heads, Nq)
    if seen is not None:
        out = mx.where(seen, out, mx.array(0, dtype))
    return out.reshape(B, spec.q_heads, Nq, Dv), lse


class MLXOpsBackend:
    """Backend protocol implementation for the blocked MLX-ops path (always available).

    Args:
        score_fractions: the chunk plan's ((device type, fraction), ...); an immutable value of the
            backend object (benchmarks/mlx_backend_variants.py compares others through it).
        device_fractions: ((device type, F), ...): a score block takes at most 1/F of the memory
            budget (budget.memory_budget_bytes); an immutable value like score_fractions.
        whole_bytes: calls whose fp32 score matrix takes at most this are served whole, by MLX's
            autograd (whole_function); 0: every call is chunked (the tests of the chunked path).
    """

    name = "mlx"

    def __init__(self, score_fractions=SCORE_FRACTIONS, device_fractions=DEVICE_FRACTIONS,
                 whole_bytes: int = WHOLE_BYTES):
        self.score_fractions = tuple((str(t), int(f)) for t, f in score_fractions)
        self.device_fractions = tuple((str(t), int(f)) for t, f in device_fractions)
        self.whole_bytes = int(whole_bytes)

    def unavailable_reason(self, device) -> Optional[str]:
        return None

    def unsupported_reason(self, spec: AttentionSpec) -> Optional[str]:
        return None

    def whole_function(self, spec: AttentionSpec) -> bool:
        """Whether `attention` serves this call (small: module-level whole_function)."""
        return whole_function(spec, self.whole_bytes)

    def attention(self, q, k, v, mask, spec: AttentionSpec, sinks=None, return_lse: bool = False):
        return attention(q, k, v, mask, spec, sinks, return_lse)

    def forward(self, q, k, v, mask, spec: AttentionSpec, sinks=None):
        return forward(q, k, v, mask, spec, sinks, self.score_fractions, self.device_fractions)

    def backward(self, q, k, v, mask, out, lse, d_out, d_lse, spec: AttentionSpec, sinks=None,
                 lse_is_local: bool = True):
        return backward(q, k, v, mask, out, lse, d_out, d_lse, spec, sinks, self.score_fractions, lse_is_local,
                        self.device_fractions)


BACKEND = MLXOpsBackend()

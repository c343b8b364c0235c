"""What each GPU kernel of a call would run with: `plans()`, behind `python -m mlx_flash plan`.

For one backend ("cuda" or "metal"), GPU (compute capability / Metal family), head dim, dtype and
mask it returns, per kernel, the instruction family (wgmma / mma.sync / simdgroup_matrix, or
fallback with the reason), the block sizes, warps, threads, shared memory bytes and the GPU
family's limits: the same variants the backends compile, with nothing re-derived here.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import List, Optional

import mlx.core as mx

from .planner import KERNELS
from .spec import AttentionSpec

MASKS = ("none", "causal", "window", "bool", "additive")
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


@dataclass(frozen=True)
class KernelPlan:
    """How one kernel of a call runs on one GPU family.

    Attributes:
        kernel: "forward", "backward_query" or "backward_key_value".
        family: the GPU family ("sm86", "sm90_wgmma", "m3", ...), None for a fallback without one.
        instruction: "wgmma", "mma.sync", "simdgroup_matrix" or "fallback".
        parallel_block, traversal_block, head_block: P, T, H (0 for a fallback).
        warps: warps (SIMD-groups) per block, the wgmma producer warpgroup included.
        threads: threads per block. shared_memory: bytes of shared (threadgroup) memory.
        shared_memory_limit, threads_limit: the family's limits (0 for a fallback).
        name: the compiled kernel's name (the variant), or the fallback's reason.
        table: the block table the plan came from: kernels/blocks_<target>.txt or the path of this
            GPU's tuned table (mlx_flash/tuned.py); "" for a fallback.
    """

    kernel: str
    family: Optional[str]
    instruction: str
    parallel_block: int
    traversal_block: int
    head_block: int
    warps: int
    threads: int
    shared_memory: int
    shared_memory_limit: int
    threads_limit: int
    name: str
    table: str = ""

    @property
    def fits(self) -> bool:
        return self.shared_memory <= self.shared_memory_limit and self.threads <= self.threads_limit

    def as_dict(self) -> dict:
        return dict(asdict(self), fits=self.fits)


def make_spec(head_dim: int, dtype: str = "bfloat16", mask: str = "none", q_len: int = 1,
              kv_len: Optional[int] = None, group: int = 1) -> AttentionSpec:
    """The spec of a call with this head dim, dtype and mask (sizes do not change a plan; they
    change whether backend="auto" routes the call, see auto_route). kv_len None = q_len; group:
    query heads per kv head (1: MHA)."""
    if dtype not in DTYPES:
        raise ValueError(f"[plan] dtype must be one of {tuple(DTYPES)}, got {dtype!r}.")
    if mask not in MASKS:
        raise ValueError(f"[plan] mask must be one of {MASKS}, got {mask!r}.")
    if not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"[plan] head_dim must be a positive int, got {head_dim!r}.")
    kv_len = q_len if kv_len is None else kv_len
    for name, value in (("q_len", q_len), ("kv_len", kv_len), ("group", group)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"[plan] {name} must be a positive int, got {value!r}.")
    mask_kind = mask if mask in ("bool", "additive") else "none"
    return AttentionSpec(batch=1, q_heads=group, kv_heads=1, q_len=q_len, kv_len=kv_len, head_dim=head_dim,
                         value_dim=head_dim, dtype=DTYPES[dtype], scale=1.0, causal=mask == "causal",
                         window=(16, 0) if mask == "window" else None, mask_kind=mask_kind,
                         mask_shape=(1, 1, q_len, kv_len) if mask_kind != "none" else None)


def _fallback(kernel: str, reason: str, family: Optional[str] = None) -> KernelPlan:
    return KernelPlan(kernel, family, "fallback", 0, 0, 0, 0, 0, 0, 0, 0, reason)


def plans(backend: str, head_dim: int, dtype: str = "bfloat16", mask: str = "none",
          capability: Optional[int] = None, family: Optional[str] = None, tuning=None,
          q_len: int = 1, kv_len: Optional[int] = None, group: int = 1, kv_heads: int = 1, batch: int = 1,
          sm_count: Optional[int] = None) -> List[KernelPlan]:
    """The plan of every kernel of a call.

    Args:
        backend: "cuda" or "metal".
        head_dim: D (value dim = D).
        dtype: "float16", "bfloat16" or "float32".
        mask: "none", "causal", "window", "bool" or "additive".
        capability: cuda: compute capability (10 * major + minor) of the GPU to plan for; the
            plan is what a GPU of that capability runs (wgmma on sm_90). None = this machine's
            backend (MLX_FLASH_CUDA_CAPABILITY, else its GPU).
        family: metal: "m1" or "m3"; None = this machine's (MLX_FLASH_METAL_FAMILY, else detected).
        tuning: cuda: a cuda_source.Tuning (default: the block table's choices).
        q_len: the call's query count (cuda: a row's fused_dq_from<N> picks the dK/dV kernel by it).
        kv_len, group, kv_heads, batch: the call's key count (None = q_len), query heads per kv
            head, kv heads and batch (cuda: they decide the dK/dV kernel's head splits, see
            head_splits_line; a forward row's t<T>_from<N> picks the forward's T by kv_len).
        sm_count: cuda: the GPU's SMs (None = this machine's GPU's, unknown without one).

    Returns:
        One KernelPlan per kernel (forward, backward_query, backward_key_value).
    """
    spec, mask_dtype = _call(head_dim, dtype, mask, q_len, kv_len, group, kv_heads, batch)
    if backend == "cuda":
        return _cuda_plans(spec, mask_dtype, capability, tuning, sm_count)
    if backend == "metal":
        return _metal_plans(spec, family)
    raise ValueError(f"[plan] backend must be 'cuda' or 'metal', got {backend!r}.")


def _cuda_length_sets(spec: AttentionSpec, mask_dtype, capability: Optional[int], tuning,
                      sm_count: Optional[int] = None):
    """(backend, its LengthSets for the call, or the reason it cannot serve it) as a GPU of
    `capability` (None: this machine's) plans the call: the sets the backend would pick from (the
    dK/dV kernel's fused dQ by length, its head splits by the call's CTAs, the forward's T by the
    key count)."""
    from .backends import cuda, cuda_source

    tuning = tuning if tuning is not None else cuda_source.Tuning()
    if capability is None:
        backend = cuda.CUDABackend(tuning=tuning, sm_count=sm_count)
        real_sm90 = backend.real_sm90()
    else:
        backend = cuda.CUDABackend(tuning=tuning, capability=capability, sm_count=sm_count)
        real_sm90 = True  # what a GPU of that capability runs: wgmma where its family has it
    reason = backend.unsupported_reason(spec)
    if reason is not None:
        return backend, reason
    family = backend.family()
    return backend, cuda_source.length_sets(cuda_source.VariantFeatures.of(spec), mask_dtype, family, tuning,
                                            real_sm90, backend.table(family), backend.sm_count())


def _cuda_plans(spec: AttentionSpec, mask_dtype, capability: Optional[int], tuning,
                sm_count: Optional[int] = None) -> List[KernelPlan]:
    backend, kept = _cuda_length_sets(spec, mask_dtype, capability, tuning, sm_count)
    if isinstance(kept, str):
        return [_fallback(kernel, kept) for kernel in KERNELS]
    family = backend.family()
    table = backend.table(family)
    variants = kept.pick(spec)
    result = []
    for kernel in KERNELS:
        variant = getattr(variants, kernel)
        result.append(KernelPlan(kernel, variant.family, variant.instruction, variant.parallel_block,
                                 variant.traversal_block, variant.head_block, variant.threads // 32, variant.threads,
                                 variant.shared_memory, family.shared_memory, family.threads, variant.name,
                                 table.origin))
    return result


def _metal_plans(spec: AttentionSpec, family: Optional[str]) -> List[KernelPlan]:
    from .backends import metal, metal_source

    backend = metal.MetalBackend(family=family)
    reason = backend.unsupported_reason(spec)
    if reason is not None:
        return [_fallback(kernel, reason, backend.family()) for kernel in KERNELS]
    result = []
    for kernel in KERNELS:
        variant = metal_source.make_variant(kernel, spec, backend.family())
        p = variant.plan
        result.append(KernelPlan(kernel, backend.family(), "simdgroup_matrix", p.parallel_block, p.traversal_block,
                                 p.head_block, variant.threads_per_threadgroup // 32, variant.threads_per_threadgroup,
                                 variant.threadgroup_memory_bytes, metal_source.THREADGROUP_MEMORY_LIMIT,
                                 metal_source.MAX_THREADS_PER_THREADGROUP, variant.name, p.table))
    return result


def head_splits_line(head_dim: int, dtype: str = "bfloat16", mask: str = "none", capability: Optional[int] = None,
                     q_len: int = 1, kv_len: Optional[int] = None, group: int = 1, kv_heads: int = 1,
                     batch: int = 1, sm_count: Optional[int] = None) -> List[str]:
    """How many CTAs of the CUDA dK/dV kernel share each kv head's `group` query heads in such a
    call (cuda_source.head_splits), in words; empty for MHA or where the kernels cannot serve the
    call. Arguments as for `plans`."""
    from .backends import cuda_source

    if group <= 1:
        return []
    spec, mask_dtype = _call(head_dim, dtype, mask, q_len, kv_len, group, kv_heads, batch)
    backend, kept = _cuda_length_sets(spec, mask_dtype, capability, None, sm_count)
    if isinstance(kept, str):
        return []
    splits, sms = kept.splits(spec), backend.sm_count()
    call = f"B={batch} x {kv_heads} kv heads x {group} query heads each, Nk={spec.kv_len}"
    where = f"on {sms} SMs" if sms else "with the SM count unknown (--sm-count)"
    if splits == 1:
        return [f"dK/dV head splits: none (a kv head's query heads in one CTA; {call}, {where})"]
    shares = " + ".join(map(str, cuda_source.split_shares(group, splits)))
    return [f"dK/dV head splits: {splits} CTAs share each kv head's query heads, {shares} ({call}, {where})"]


def _call(head_dim: int, dtype: str, mask: str, q_len: int, kv_len: Optional[int], group: int, kv_heads: int,
          batch: int):
    """(spec, mask dtype) of the call `plans` and `head_splits_line` describe: make_spec's (batch 1,
    one kv head) with `kv_heads` kv heads and `batch` entries."""
    for name, value in (("kv_heads", kv_heads), ("batch", batch)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"[plan] {name} must be a positive int, got {value!r}.")
    spec = make_spec(head_dim, dtype, mask, q_len=q_len, kv_len=kv_len, group=group)
    spec = replace(spec, batch=batch, kv_heads=kv_heads, q_heads=spec.group * kv_heads)
    return spec, {"bool": mx.bool_, "additive": spec.dtype}.get(mask)


def auto_route(head_dim: int, dtype: str = "bfloat16", mask: str = "none", capability: Optional[int] = None,
               q_len: Optional[int] = None, kv_len: Optional[int] = None, group: int = 1) -> List[str]:
    """What backend="auto" does with such a call on a CUDA GPU, in words: the kernels, or mx.fast
    and the kernels/dispatch_cuda.txt row that routes it (backends.dispatch_route decides). Empty
    where the kernels cannot serve the call (the fallback rule decides; plans() names the reason).

    Args:
        head_dim, dtype, mask, capability: as for `plans`.
        q_len, kv_len: the call's Nq and Nk; None = every N (the rows of this family, dtype,
            head dim, head layout and mask, with their N ranges). kv_len None = q_len.
        group: query heads per kv head (1: MHA; the table has rows per layout class).
    """
    from .backends import cuda, dispatch, dispatch_route, get_backend

    backend = cuda.CUDABackend(capability=capability)
    spec = make_spec(head_dim, dtype, mask, q_len or 1, kv_len, group)
    if backend.unsupported_reason(spec) is not None:
        return []
    family, fast = backend.family().name, get_backend("fast")
    inexact = fast.inexact_reason(spec)
    if inexact is not None:
        return [f"backend='auto' runs these kernels: mx.fast cannot serve such a call exactly ({inexact})"]
    if q_len is not None:
        row = dispatch_route(backend, spec)
        where = f"Nq={spec.q_len} Nk={spec.kv_len}"
        if row is not None:
            return [f"backend='auto' routes {where} to mx.fast.scaled_dot_product_attention: "
                    f"{dispatch.TABLE_NAME} line {row.line}: {row.describe()}"]
        why = ("MLX does not run it through cuDNN" if not fast.cudnn_fuses(spec)
               else f"no {dispatch.TABLE_NAME} row of {family} covers it")
        return [f"backend='auto' runs these kernels at {where} ({why})"]
    routed = [f"backend='auto' routes Nq = Nk = N in {row.min_n}..{row.max_n} to mx.fast.scaled_dot_product_attention: "
              f"{dispatch.TABLE_NAME} line {row.line}: {row.describe()}"
              for row in dispatch.shipped_dispatch()  # every row that routes such a call at its own N
              if dispatch_route(backend, make_spec(head_dim, dtype, mask, row.min_n, group=group)) == row]
    heads = dispatch.heads_of(spec.q_heads, spec.kv_heads)
    return routed or [f"backend='auto' runs these kernels at every N (no {dispatch.TABLE_NAME} row of {family} "
                      f"routes {dtype} D={head_dim} {heads} mask {mask})"]


def format_table(rows: List[KernelPlan]) -> str:
    """A fixed-width table of plans, one kernel per line."""
    header = ("kernel", "family", "instruction", "P", "T", "H", "warps", "threads", "shared", "limit")
    lines = [header] + [(r.kernel, r.family or "-", r.instruction, *(
        "-" if r.instruction == "fallback" else str(x) for x in (
            r.parallel_block, r.traversal_block, r.head_block, r.warps, r.threads, r.shared_memory,
            r.shared_memory_limit))) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    text += [f"{r.kernel}: {r.name}" for r in rows if r.instruction == "fallback"][:1]
    text += [f"block table: {origin}" for origin in dict.fromkeys(r.table for r in rows if r.table)]
    return "\n".join(text)

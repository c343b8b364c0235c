"""Plan -> Metal source for the attention kernels: what is baked in, and the launch geometry.

A `KernelVariant` is everything that changes the generated source: the kernel, its block plan
(P, T, H, cached operands from kernels/blocks_metal.txt), the head dim, the input dtype and the
features compiled in (mask kind, causal, window, softcap). Sequence lengths, batch, heads,
strides, scale, softcap value and window sizes are runtime inputs, so a new sequence length
reuses the compiled kernel.

Block-size choices follow Metal FlashAttention (MFA, ALGORITHM.md): small parallel blocks
(P = 16 on the M3 family, 32 on M1) with long traversal blocks (T = 64..128) keep the spill
traffic of uncached accumulators small next to the math, and caching an operand in registers is
only worth it while it fits (MFA measured ~4400 GINSTRS, 83% of the M1 Max ALU roofline, with
these tables in the forward pass).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from types import MappingProxyType
from typing import Dict, Tuple

import mlx.core as mx

from ..planner import KERNELS, BlockPlan, Table, plan
from ..render import render
from .common import DTYPE_NAMES, MASK_KINDS, VariantFeatures, VariantSet, cached_hash  # noqa: F401 (MASK_KINDS: part of this module's names)

# Threadgroup memory per threadgroup on every Apple GPU; mx.fast.metal_kernel sources can only
# declare compile-time sized threadgroup arrays, so each kernel's tile size is fixed by its plan.
THREADGROUP_MEMORY_LIMIT = 32 * 1024
MAX_THREADS_PER_THREADGROUP = 1024
# Each threadgroup tile row is padded by 16 bytes (as MLX's steel attention) so the strided
# fragment reads of a tile do not all land in one memory bank.
TILE_PAD_BYTES = 16

DTYPES = MappingProxyType({name: dtype for dtype, name in DTYPE_NAMES.items()})
INPUT_TYPES = MappingProxyType({mx.float32: "float", mx.float16: "half", mx.bfloat16: "bfloat16_t"})

# Operands each kernel can keep in registers, as the block table names them.
CACHEABLE = MappingProxyType({
    "forward": ("Q", "O"),
    "backward_query": ("Q", "dO", "dQ"),
    "backward_key_value": ("K", "V", "dK", "dV"),
})
TEMPLATES = MappingProxyType({
    "forward": "attention_forward.metal",
    "backward_query": "attention_backward_query.metal",
    "backward_key_value": "attention_backward_key_value.metal",
})
HEADER = "attention_common.metal"

INPUT_NAMES = MappingProxyType({
    "forward": ("q", "k", "v", "mask", "mask_layout", "sinks", "params", "fparams"),
    "backward_query": ("q", "k", "v", "o", "d_out", "lse", "d_lse", "mask", "mask_layout", "sinks",
                       "params", "fparams"),
    "backward_key_value": ("q", "k", "v", "d_out", "lse", "delta", "mask", "mask_layout",
                           "params", "fparams"),
})
OUTPUT_NAMES = MappingProxyType({
    "forward": ("out", "lse", "o_acc"),
    "backward_query": ("dq", "delta", "dq_acc", "d_sinks_part"),
    "backward_key_value": ("dk", "dv", "dk_acc", "dv_acc"),
})
# The fp32 spill buffer of each accumulator, by the output it accumulates.
ACCUMULATORS = MappingProxyType({"forward": {"O": "o_acc"}, "backward_query": {"dQ": "dq_acc"},
                                 "backward_key_value": {"dK": "dk_acc", "dV": "dv_acc"}})

_UNROLL = "#pragma clang loop unroll(full)"
_ROLLED = "#pragma clang loop unroll(disable)"


@dataclass(frozen=True)
class KernelVariant:
    """The compile-time constants of one kernel; the key of the compiled-kernel cache."""

    kernel: str
    plan: BlockPlan
    dtype_name: str
    mask_kind: str
    causal: bool
    window: bool
    softcap: bool
    sinks: bool = False

    def __hash__(self) -> int:  # computed once: variants key the compile cache on every launch
        return cached_hash(self)

    @property
    def dtype(self) -> mx.Dtype:
        return DTYPES[self.dtype_name]

    @property
    def head_dim(self) -> int:
        return self.plan.head_dim

    @property
    def threads_per_threadgroup(self) -> int:
        """One simdgroup (32 threads) per 8 rows of the parallel block."""
        return self.plan.parallel_block // 8 * 32

    @property
    def threadgroup_memory_bytes(self) -> int:
        return threadgroup_memory_bytes(self.plan, self.dtype)

    @property
    def name(self) -> str:
        """A readable, unique Metal function name."""
        p = self.plan
        cached = "".join(sorted(p.cached)) or "none"
        flags = "".join(f for f, on in (("c", self.causal), ("w", self.window), ("s", self.softcap),
                                        ("k", self.sinks)) if on)
        return (f"mlx_flash_{self.kernel}_d{p.head_dim}_{self.dtype_name}_p{p.parallel_block}"
                f"t{p.traversal_block}h{p.head_block}_{cached}_{self.mask_kind}{('_' + flags) if flags else ''}")

    def spills(self, operand: str) -> bool:
        """Whether accumulator `operand` needs a separate fp32 buffer (uncached, input not fp32)."""
        return not self.plan.is_cached(operand) and self.dtype != mx.float32


def tile_pad(dtype: mx.Dtype) -> int:
    return TILE_PAD_BYTES // dtype.size


def threadgroup_memory_bytes(block_plan: BlockPlan, dtype: mx.Dtype) -> int:
    """Bytes of the one threadgroup tile (T rows x (H + pad) columns, input dtype) a kernel uses."""
    return block_plan.traversal_block * (block_plan.head_block + tile_pad(dtype)) * dtype.size


def make_variant(kernel: str, spec, family: str, table=None) -> KernelVariant:
    """The variant serving `spec` with `kernel` on GPU family `family` ("m1" or "m3").

    Args:
        table: the planner.Table to plan from; None = the active one (tuned or shipped).
    """
    block_plan = plan("metal", kernel, spec.head_dim, spec.dtype, family, table)
    return KernelVariant(kernel=kernel, plan=block_plan, dtype_name=DTYPE_NAMES[spec.dtype],
                         mask_kind=spec.mask_kind, causal=bool(spec.causal),
                         window=spec.window is not None, softcap=spec.softcap is not None,
                         # The dK/dV kernel needs no sink term: the forward's lse includes it.
                         sinks=spec.has_sinks and kernel != "backward_key_value")


# Made once per key: working the three variants out again for each call (the guard's key, then
# each launch) was the largest part of a call's host time. A tuned table is part of the key by
# value, so a new table gives new variants at once. benchmarks/host_time.py (simulator with stub
# kernels, 2-core CI machine, us per call, before -> after): forward 92 -> 59, forward + backward
# 182 -> 115; flash_attention's own path with a do-nothing backend: 21 / 38.
@functools.lru_cache(maxsize=1024)
def variant_set(features: VariantFeatures, family: str, table: Table) -> VariantSet:
    """The forward, dQ and dK/dV variants of every call with `features` on `family`, planned from
    `table`; one object per key.

    Args:
        table: the table to plan from, resolved by the caller (planner.active_table when the backend
            has none): a None here would cache whichever table was active at the first call.
    """
    if not isinstance(table, Table):
        raise TypeError(f"[metal] variant_set needs a planner.Table, got {table!r}.")
    spec = features.spec()
    return VariantSet(*(make_variant(kernel, spec, family, table) for kernel in KERNELS))


def check_launch_limits(variant: KernelVariant) -> None:
    """Raise before launch if the plan breaks Apple GPU limits (which would fail or truncate)."""
    p = variant.plan
    if p.parallel_block % 8 or p.traversal_block % 8 or p.head_block % 8:
        raise ValueError(f"[metal] block sizes must be multiples of 8, got P={p.parallel_block}, "
                         f"T={p.traversal_block}, H={p.head_block} for {variant.name}.")
    memory = variant.threadgroup_memory_bytes
    if memory > THREADGROUP_MEMORY_LIMIT:
        raise ValueError(f"[metal] {variant.name} needs {memory} bytes of threadgroup memory, "
                         f"over the {THREADGROUP_MEMORY_LIMIT}-byte limit.")
    threads = variant.threads_per_threadgroup
    if threads > MAX_THREADS_PER_THREADGROUP:
        raise ValueError(f"[metal] {variant.name} needs {threads} threads per threadgroup, over "
                         f"the limit of {MAX_THREADS_PER_THREADGROUP}.")


def accumulator_names(variant: KernelVariant) -> Dict[str, str]:
    """Which buffer each accumulator spills to: its fp32 scratch output, or (fp32 input) the
    output itself. A cached accumulator names its scratch output too (then 1 element, unused)."""
    outputs = dict(zip(("O", "dQ", "dK", "dV"), ("out", "dq", "dk", "dv")))
    names = {}
    for operand, scratch in ACCUMULATORS[variant.kernel].items():
        uses_output = not variant.plan.is_cached(operand) and variant.dtype == mx.float32
        names[operand] = outputs[operand] if uses_output else scratch
    return names


def source(variant: KernelVariant) -> Tuple[str, str]:
    """(body, header) of the variant's Metal kernel."""
    p = variant.plan
    cached = {op: p.is_cached(op) for op in CACHEABLE[variant.kernel]}
    unroll = lambda *ops: _UNROLL if any(cached[o] for o in ops) else _ROLLED  # noqa: E731
    dtype = variant.dtype
    constants = dict(
        head_dim=p.head_dim, parallel_block=p.parallel_block, traversal_block=p.traversal_block,
        head_block=p.head_block, tile_pad=tile_pad(dtype),
        causal=variant.causal, window=variant.window, softcap=variant.softcap,
        mask_kind=MASK_KINDS[variant.mask_kind], input_type=INPUT_TYPES[dtype],
        # Cached input operands are held as pairs of the input dtype where it is exact and
        # cheaper (half); bf16 is held in fp32 (no bf16 ALU before the M3 family; one path).
        cache_type="half" if dtype == mx.float16 else "float",
    )
    acc = accumulator_names(variant)
    if variant.kernel == "forward":
        constants.update(q_cached=cached["Q"], o_cached=cached["O"], o_accumulator=acc["O"], sinks=variant.sinks,
                         qk_unroll=unroll("Q"), pv_unroll=unroll("O"))
    elif variant.kernel == "backward_query":
        constants.update(q_cached=cached["Q"], do_cached=cached["dO"], dq_cached=cached["dQ"],
                         dq_accumulator=acc["dQ"], delta_unroll=unroll("dO"), sinks=variant.sinks,
                         qk_unroll=unroll("Q"), dov_unroll=unroll("dO"), dsk_unroll=unroll("dQ"))
    else:
        constants.update(k_cached=cached["K"], v_cached=cached["V"], dk_cached=cached["dK"],
                         dv_cached=cached["dV"], dk_accumulator=acc["dK"], dv_accumulator=acc["dV"],
                         kq_unroll=unroll("K"), dov_unroll=unroll("V", "dV"), dsq_unroll=unroll("dK"))
    return render(TEMPLATES[variant.kernel], **constants), render(HEADER)

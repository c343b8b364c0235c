"""The "cuda" backend: fused attention kernels for NVIDIA GPUs through `mx.fast.cuda_kernel`.

spec -> plan -> variant -> source (cuda_source.py) -> launch (here). A `CUDABackend` holds what
is fixed for its life: the `Tuning` value, the kernel factory (mx.fast.cuda_kernel, or the CPU
emulator's stand-in) and optionally a compute capability; it compiles each variant once (NVRTC)
and launches the kernels with the runtime values (sizes, strides, scale, softcap, window) passed
as two small arrays, so a new sequence length or batch never recompiles (past the lengths where
the table picks other kernels: the fused dQ's queries, the forward's t<T>_from<N> keys, each a
variant compiled once).

No atomics on the data: gradients are bitwise reproducible (the dK/dV kernel's fused dQ, which
the table turns on for long calls without an array mask at D = 49..64 and 97..128 (fused_dq_from<N>,
fused_dq_causal_from<N>) and Tuning.fused_query forces, adds into an fp32 accumulator in a fixed
order; one more kernel makes dQ of it). A GQA call with too few key blocks for the GPU's SMs has
several dK/dV CTAs share each kv head's query heads (the table's head_splits_to<W>, Tuning.head_splits),
each writing fp32 parts that one more kernel adds in split order.
Supported natively: fp16 / bf16, any head dim 1..512, any Nq / Nk, GQA / MQA, causal, sliding window, softcap, bool / additive array
masks with broadcast strides, on every GPU family of kernels/families_cuda.txt (compute
capability 8.0 and up). float32 inputs, value_dim != head_dim, head_dim > 512 and GPUs without
a family (below sm_80) go to the "mlx" backend (counted by mlx_flash.fallback).

First contact: select_backend has mlx_flash.backends.guard build and run the call's set of
variants (variant_key) once per process on a small problem before the user's graph uses them; a
variant that fails to compile or launch on this GPU sends its calls to the "mlx" backend, with
one FallbackWarning naming it and the error, counted.

MLX_FLASH_CUDA_CAPABILITY=<10 * major + minor> plans for another capability than the GPU's
(an H100 runs the sm_80 / sm_86 / sm_120 plans; the wgmma kernels only ever run on a real sm_90).
"""
from __future__ import annotations

import functools
import os
from typing import Callable, Optional, Tuple

import mlx.core as mx

from .. import call_cache, planner
from ..planner import KERNELS
from ..spec import AttentionSpec
from . import cuda_source, tensor_map
from .common import (VariantFeatures, VariantSet, constant_zeros, contiguous_operands, empty_backward,
                     empty_forward, empty_sinks_gradient, float_params, heads_view, is_empty, mask_strides,
                     token_major_shape)
from .cuda_source import (CUDA_TYPES, MAX_HEAD_DIM, PREPARE_THREADS, Family, KernelVariant, Tuning,
                          block_major, family_of, fused_chains, length_sets)

MAX_GRID_X_BLOCKS = 1 << 16  # the rest of the block count goes on grid y (limit 65535)
CAPABILITY_VARIABLE = "MLX_FLASH_CUDA_CAPABILITY"


@functools.lru_cache(maxsize=None)
def device_capability() -> Optional[int]:
    """The GPU's compute capability as 10 * major + minor (90 for H100 / H200), None if unknown.

    Read from mx.device_info()'s "architecture" (e.g. "sm_90a" on MLX's CUDA backend)."""
    try:
        info = mx.device_info(mx.gpu)
    except Exception:  # no GPU device or an MLX without device_info
        return None
    text = str(info.get("architecture", info.get("compute_capability", "")))
    digits = "".join(c for c in text if c.isdigit())
    return int(digits) if digits else None


@functools.lru_cache(maxsize=None)
def device_sm_count() -> Optional[int]:
    """The GPU's streaming multiprocessors (what the dK/dV kernel's head splits plan for), None if
    unknown: MLX does not report it, so it is asked of the CUDA driver (libcuda, the driver
    library every CUDA program loads; CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT of device 0, the
    one MLX runs on)."""
    if not cuda_available():
        return None
    import ctypes
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        device, count = ctypes.c_int(0), ctypes.c_int(0)
        if (driver.cuInit(0) != 0 or driver.cuDeviceGet(ctypes.byref(device), 0) != 0
                or driver.cuDeviceGetAttribute(ctypes.byref(count), 16, device) != 0):
            return None
    except (OSError, AttributeError):  # no driver library by that name, or a stub without the symbols
        return None
    return count.value if count.value > 0 else None


def capability_override() -> Optional[int]:
    """MLX_FLASH_CUDA_CAPABILITY as an int (e.g. 86), None when unset."""
    text = os.environ.get(CAPABILITY_VARIABLE, "").strip().lower().removeprefix("sm_").removeprefix("sm")
    if not text:
        return None
    if not text.isdigit():
        raise ValueError(f"[cuda] {CAPABILITY_VARIABLE} must be a compute capability as 10 * major + minor "
                         f"(e.g. 80, 86, 90), got {os.environ[CAPABILITY_VARIABLE]!r}.")
    return int(text)


def cuda_available() -> bool:
    return hasattr(mx, "cuda") and mx.cuda.is_available()


def _grid(total_blocks: int, threads: int) -> Tuple[Tuple[int, int, int], Tuple[int, int, int]]:
    """(grid in threads, threadgroup) for a 1-D block count of any size (B*H past 65535 too)."""
    gx = max(1, min(total_blocks, MAX_GRID_X_BLOCKS))
    gy = -(-total_blocks // gx)
    if gy > 65535:
        raise ValueError(f"[cuda] {total_blocks} thread blocks exceed the grid limit.")
    return (gx * threads, gy, 1), (threads, 1, 1)


def _int_params(spec: AttentionSpec, blocks: int, total: int, major: bool, splits: int = 1) -> mx.array:
    """The launch's integer parameters (order = enum Param in kernels/attention_common.cuh)."""
    return _int_params_of((spec.batch, spec.q_heads, spec.kv_heads, spec.q_len, spec.kv_len, spec.diagonal,
                           spec.window, spec.mask_shape, blocks, total, major, splits))


# The parameter arrays are constants of (sizes, launch shape): cached, so that a call does not
# create and upload new ones (part of the per-call host time, which was ~4x MLX's attention's).
# Keyed by a tuple of ints, not by the spec: a spec's == took ~1.5 us of each launch.
@functools.lru_cache(maxsize=1024)
def _int_params_of(key: tuple) -> mx.array:
    batch, q_heads, kv_heads, q_len, kv_len, diagonal, window, mask_shape, blocks, total, major, splits = key
    values = [batch, q_heads, kv_heads, q_len, kv_len, q_heads // kv_heads, diagonal,
              *(window if window is not None else (-1, -1)), *mask_strides(mask_shape), blocks, total, int(major),
              splits]
    return mx.array(values, dtype=mx.int64)


class CUDABackend:
    """Backend protocol implementation (see mlx_flash.backends) for the CUDA kernels.

    Args:
        tuning: overrides of the block table's choices (exploration tools); Tuning() = the table.
        kernel_factory: what compiles a kernel, with mx.fast.cuda_kernel's keyword arguments
            (name, input_names, output_names, source, header, ensure_row_contiguous,
            shared_memory); None = mx.fast.cuda_kernel. Any other factory (the CPU emulator's)
            makes the backend available without a GPU and never runs the wgmma kernels.
        capability: plan for this compute capability; None = MLX_FLASH_CUDA_CAPABILITY, else the GPU's.
        sm_count: the SMs the dK/dV kernel's head splits plan for (cuda_source.head_splits); None =
            the GPU's (device_sm_count) with MLX's kernels, none with another factory (no splits
            unless the tuning forces them).
    """

    name = "cuda"
    # q, k, v and d_out are read where they lie (common.STRIDED_INPUTS): flash_attention copies nothing;
    # out, dq, dk, dv are views of [B, N, H, D] buffers.
    row_contiguous_inputs = False
    token_major_outputs = True
    # forward / backward take `variants`: the first-contact guard runs a call's own set on its
    # small problem (guard.py), whose size alone would choose other ones.
    pins_variants = True

    def __init__(self, tuning: Tuning = Tuning(), kernel_factory: Optional[Callable] = None,
                 capability: Optional[int] = None, sm_count: Optional[int] = None):
        if not isinstance(tuning, Tuning):
            raise TypeError(f"[cuda] tuning must be a cuda_source.Tuning, got {type(tuning).__name__}.")
        self.tuning = tuning
        self._factory = kernel_factory
        self._capability = capability
        if sm_count is not None and (isinstance(sm_count, bool) or not isinstance(sm_count, int) or sm_count < 1):
            raise ValueError(f"[cuda] sm_count must be None or a positive int, got {sm_count!r}.")
        self._sm_count = sm_count
        # Compile cache: variant (or the preprocessing kernel's key) -> kernel object.
        self._kernels: dict = {}
        self._variant_sets = call_cache.Kept()  # (features, mask dtype) -> LengthSets

    # -- the GPU --------------------------------------------------------------------------------

    def capability(self) -> Optional[int]:
        """The compute capability the kernels are planned for."""
        if self._capability is not None:
            return self._capability
        override = capability_override()
        return override if override is not None else device_capability()

    def family(self) -> Optional[Family]:
        return family_of(self.capability())

    def sm_count(self) -> Optional[int]:
        """The SMs the head splits plan for (see __init__)."""
        if self._sm_count is not None or self._factory is not None:
            return self._sm_count
        return device_sm_count()

    def real_sm90(self) -> bool:
        """The wgmma kernels may run: the real GPU (not an override) is an sm_90, through MLX."""
        return self._factory is None and device_capability() == 90

    def variants(self, spec: AttentionSpec, mask_dtype: Optional[mx.Dtype] = None) -> VariantSet:
        """The forward, dQ and dK/dV variants that serve this call on this backend's GPU family
        (cuda_source.length_sets: made once per features, family, tuning and table, a set below
        and one from the table's fused_dq_from<N> queries where that changes the dK/dV kernel, each
        with a twin whose dK/dV kernel splits the query-head group for the GQA calls that
        cuda_source.head_splits splits, and all again with the forward of the table's
        t<T>_from<N> for calls of N keys or more; the sets are kept per features and mask dtype
        while call_cache's stamp holds, as each launch asks)."""
        return self._length_sets(spec, mask_dtype).pick(spec)

    def head_splits(self, spec: AttentionSpec, mask_dtype: Optional[mx.Dtype] = None) -> int:
        """CTAs sharing each kv head's query-head group in this call's dK/dV kernel
        (cuda_source.head_splits; 1 unless its variant is a head_split one)."""
        return self._length_sets(spec, mask_dtype).splits(spec)

    def _length_sets(self, spec: AttentionSpec, mask_dtype: Optional[mx.Dtype]) -> cuda_source.LengthSets:
        key, now = (VariantFeatures.of(spec), mask_dtype), call_cache.stamp()
        kept = self._variant_sets.lookup(key, now)
        if kept is not None:
            return kept
        family = self.family()
        if family is None:
            raise ValueError(f"[cuda] {self.unsupported_reason(spec)}")
        kept = length_sets(key[0], mask_dtype, family, self.tuning, self.real_sm90(), self.table(family),
                           self.sm_count())
        self._variant_sets.store(key, now, kept)
        return kept

    def variant(self, kernel: str, spec: AttentionSpec, mask_dtype: Optional[mx.Dtype] = None) -> KernelVariant:
        """The variant that serves `kernel` for this call on this backend's GPU family."""
        if kernel not in KERNELS:
            raise ValueError(f"[cuda] kernel must be one of {KERNELS}, got {kernel!r}.")
        return getattr(self.variants(spec, mask_dtype), kernel)

    def table(self, family: Family) -> planner.Table:
        """The block table this backend plans from: its tuning's, else the active one (tuned or shipped)."""
        return self.tuning.table or planner.active_table("cuda", family.name)

    # -- what the first-contact guard (guard.py) keys its verdicts by ---------------------------

    def variant_key(self, spec: AttentionSpec, mask_dtype: Optional[mx.Dtype] = None):
        """The kernel variants a call runs, and what builds them (the GPU's NVRTC or the emulator):
        the guard builds and runs each such set once per process before a call uses it."""
        return self.variants(spec, mask_dtype), self._factory

    def variant_name(self, kernel: str, spec: AttentionSpec, mask_dtype: Optional[mx.Dtype] = None) -> str:
        return self.variant(kernel, spec, mask_dtype).name

    # -- protocol -------------------------------------------------------------------------------

    def unavailable_reason(self, device) -> Optional[str]:
        if self._factory is not None:
            return None
        if not cuda_available():
            return "no CUDA GPU (mx.cuda.is_available() is False: MLX without its CUDA backend or no NVIDIA GPU)"
        if device.type != mx.gpu:
            return f"the stream's device is {device}, not the GPU"
        return None

    def unsupported_reason(self, spec: AttentionSpec) -> Optional[str]:
        if spec.dtype == mx.float32:
            return "float32 inputs (the CUDA kernels are fp16/bf16 tensor-core kernels)"
        if spec.value_dim != spec.head_dim:
            return f"value_dim {spec.value_dim} != head_dim {spec.head_dim}"
        if spec.head_dim > MAX_HEAD_DIM:
            return f"head_dim {spec.head_dim} > {MAX_HEAD_DIM}"
        capability = self.capability()
        if family_of(capability) is None:
            known = ", ".join(f"{f.name} ({'/'.join(str(c) for c in sorted(f.capabilities))})"
                              for f in cuda_source.families())
            return (f"compute capability {capability} has no CUDA kernel family (sm_80 or newer: bf16 mma.sync, "
                    f"cp.async; families: {known})")
        return None

    def forward(self, q, k, v, mask, spec: AttentionSpec, sinks=None,
                variants: Optional[VariantSet] = None) -> Tuple[mx.array, mx.array]:
        """(out [B, Hq, Nq, D] in q's dtype (a view of a [B, Nq, Hq, D] buffer), lse [B, Hq, Nq]
        fp32, natural log, sinks included). variants: the set to run instead of the call's own
        (the first-contact probe's: see pins_variants)."""
        if is_empty(spec):
            return empty_forward(q, k, v, mask, spec, sinks)
        B, Hq, Nq, D = spec.batch, spec.q_heads, spec.q_len, spec.head_dim
        variant = (variants or self.variants(spec, None if mask is None else mask.dtype)).forward
        out, lse = self._launch(variant, spec, [q, k, v], mask, rows=Nq, heads=Hq,
                                output_shapes=[(B, Nq, Hq, D), (B, Hq, Nq)], output_dtypes=[spec.dtype, mx.float32],
                                sinks=sinks)
        return heads_view(out), lse

    def backward(self, q, k, v, mask, out, lse, d_out, d_lse, spec: AttentionSpec, sinks=None,
                 lse_is_local: bool = True, variants: Optional[VariantSet] = None):
        """(dq, dk, dv, d_sinks) in the input dtype. d_lse (or None) is the cotangent of lse.
        lse_is_local is ignored: the kernels compute P = exp(S - lse) for any lse. variants: the
        set to run instead of the call's own (the first-contact probe's: see pins_variants).

        d_sinks (None without sinks) is fused into the dQ kernel: per-warp parts, summed here in a
        fixed order (deterministic, no atomics). Where the dK/dV variant accumulates dQ as well
        (fused_query: no sinks then), the dQ kernel does not run."""
        if is_empty(spec):
            return (*empty_backward(q, k, v), empty_sinks_gradient(sinks, out, lse, d_out, d_lse))
        variants = variants or self.variants(spec, None if mask is None else mask.dtype)
        if variants.backward_key_value.fused_query:
            prepared = self.prepare_backward(out, lse, d_out, d_lse, spec, variants.backward_key_value)
            dk, dv, dq = self._backward_key_value(variants.backward_key_value, q, k, v, mask, d_out, prepared, spec,
                                                  with_query=True)
            return dq, dk, dv, None
        prepared = self.prepare_backward(out, lse, d_out, d_lse, spec)
        delta, lse2 = prepared
        dq, d_sinks_part = self._backward_query(variants.backward_query, q, k, v, mask, d_out, lse2, delta, spec,
                                                sinks)
        d_sinks = None if sinks is None else d_sinks_part.sum(axis=(0, 2)).astype(sinks.dtype)
        dk, dv = self._backward_key_value(variants.backward_key_value, q, k, v, mask, d_out, prepared, spec)
        return dq, dk, dv, d_sinks

    # -- the backward kernels separately (the benchmark times them apart) ------------------------

    def backward_query(self, q, k, v, mask, out, lse, d_out, d_lse, spec: AttentionSpec, sinks=None) -> mx.array:
        """dQ alone (preprocessing + the dQ kernel)."""
        if is_empty(spec):
            return empty_backward(q, k, v)[0]
        variant = self.variants(spec, None if mask is None else mask.dtype).backward_query
        delta, lse2 = self.prepare_backward(out, lse, d_out, d_lse, spec)
        return self._backward_query(variant, q, k, v, mask, d_out, lse2, delta, spec, sinks)[0]

    def backward_key_value(self, q, k, v, mask, out, lse, d_out, d_lse, spec: AttentionSpec):
        """(dK, dV) alone (preprocessing + the dK/dV kernel)."""
        if is_empty(spec):
            return empty_backward(q, k, v)[1:]
        variant = self.variants(spec, None if mask is None else mask.dtype).backward_key_value
        prepared = self.prepare_backward(out, lse, d_out, d_lse, spec, variant)
        return self._backward_key_value(variant, q, k, v, mask, d_out, prepared, spec)

    def prepare_backward(self, out, lse, d_out, d_lse, spec: AttentionSpec,
                         key_value: Optional[KernelVariant] = None) -> Tuple[mx.array, ...]:
        """(delta, lse2[, counts]): delta = rowsum(dO * O) - dL and lse in base 2 (+inf for rows with no key).
        Where key_value (the dK/dV variant) accumulates dQ as well (fused_query), also the counts
        that order its adds, zeroed (kernels/attention_backward_prepare.cu says why here)."""
        rows = spec.batch * spec.q_heads * spec.q_len
        has_d_lse = d_lse is not None
        fused = key_value is not None and key_value.fused_query
        count_block, chains = (key_value.traversal_block, fused_chains(key_value)) if fused else (0, 1)
        key = ("prepare", CUDA_TYPES[spec.dtype], spec.head_dim, has_d_lse, count_block, chains)
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = self._compiled(key, lambda: (cuda_source.prepare_name(*key[1:]),
                                                  cuda_source.prepare_source(*key[1:]), 0))
        blocks = -(-rows // cuda_source.prepare_rows_per_block(spec.head_dim))
        grid, group = _grid(blocks, PREPARE_THREADS)
        d_lse = d_lse.astype(mx.float32) if has_d_lse else constant_zeros(mx.float32, 1)
        shape = (spec.batch, spec.q_heads, spec.q_len)
        counts = [(spec.batch, spec.q_heads, -(-spec.q_len // count_block), chains)] if count_block else []
        lse, d_lse = contiguous_operands([lse, d_lse])  # out and d_out: read through their strides
        return tuple(kernel(inputs=[out, d_out, lse, d_lse, _int_params(spec, 0, blocks, False)],
                            output_shapes=[shape, shape] + counts,
                            output_dtypes=[mx.float32, mx.float32] + [mx.int32] * len(counts),
                            grid=grid, threadgroup=group))

    # -- internals ------------------------------------------------------------------------------

    def _backward_query(self, variant, q, k, v, mask, d_out, lse2, delta, spec, sinks=None):
        """(dq, d_sinks_part [B, Hq, parts] with sinks, else None): one part per warp's rows
        (mma.sync: a row group, wgmma: a consumer warp's 16 rows), summed by the caller."""
        shapes, dtypes = [token_major_shape(q.shape)], [spec.dtype]
        if sinks is not None:
            blocks = -(-spec.q_len // variant.parallel_block)
            parts = variant.parallel_block // 16 if variant.instruction == "wgmma" else variant.row_groups
            shapes.append((spec.batch, spec.q_heads, blocks * parts))
            dtypes.append(mx.float32)
        results = self._launch(variant, spec, [q, k, v, d_out, lse2, delta], mask, rows=spec.q_len,
                               heads=spec.q_heads, output_shapes=shapes, output_dtypes=dtypes, sinks=sinks)
        return heads_view(results[0]), (results[1] if sinks is not None else None)

    def _backward_key_value(self, variant, q, k, v, mask, d_out, prepared, spec, with_query: bool = False):
        """(dk, dv), and dq last if with_query (a fused_query variant only). prepared:
        prepare_backward's arrays for this variant.

        A head_split variant runs head_splits(spec) CTAs per key block, each over its share of the
        kv head's query heads, into fp32 parts [splits, B, Nk, Hkv, D] that key_value_from_parts
        adds in split order.

        A fused_query variant also takes the counts that order its adds (prepare_backward's, zeroed)
        and updates them, and writes dQ's fp32 accumulator, whose tiles the first key block stores
        and the others add to (kernels/attention_backward_key_value_wgmma.cu); query_from_accumulator
        makes dQ of it."""
        delta, lse2, counts = prepared if variant.fused_query else (*prepared, None)
        splits = 1
        if variant.head_split:
            splits = self.head_splits(spec, None if mask is None else mask.dtype)
            if splits == 1:  # a call's split kernel pinned on a problem that would not split (the probe's)
                splits = spec.group
        parts = (splits,) if variant.head_split else ()
        shapes = [parts + token_major_shape(k.shape), parts + token_major_shape(v.shape)]
        dtypes = [mx.float32, mx.float32] if variant.head_split else [spec.dtype, spec.dtype]
        if variant.fused_query:
            shapes.append(counts.shape + (fused_tile_floats(variant),))
            dtypes.append(mx.float32)
        results = self._launch(variant, spec, [q, k, v, d_out, lse2, delta], mask, rows=spec.kv_len,
                               heads=spec.kv_heads, output_shapes=shapes, output_dtypes=dtypes,
                               counts=counts, splits=splits)
        dk, dv = results[:2]
        if variant.head_split:
            dk, dv = self.key_value_from_parts(dk, dv, spec)
        dk, dv = heads_view(dk), heads_view(dv)
        if with_query:
            return dk, dv, self.query_from_accumulator(results[2], counts, variant, spec)
        return dk, dv

    def query_from_accumulator(self, acc: mx.array, counts: mx.array, variant: KernelVariant,
                               spec: AttentionSpec) -> mx.array:
        """dQ [B, Hq, Nq, D] in the input dtype (a view of a [B, Nq, Hq, D] buffer) from the fused
        dK/dV kernel's accumulator [B, Hq, query blocks, chains, tile] (already scaled) and its
        counts [B, Hq, query blocks, chains] (0: no key block wrote the tile, which adds nothing):
        one kernel that sums each query block's chains in order, reorders and rounds
        (kernels/attention_backward_query_from_accumulator.cu says how the tiles lie)."""
        key = ("query_from_accumulator", CUDA_TYPES[spec.dtype], spec.head_dim, variant.traversal_block,
               fused_chains(variant))
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = self._compiled(key, lambda: (
                cuda_source.query_from_accumulator_name(*key[1:]), cuda_source.query_from_accumulator_source(*key[1:]),
                cuda_source.query_from_accumulator_shared_bytes(*key[2:4])))
        tiles = acc.shape[0] * acc.shape[1] * acc.shape[2]
        grid, group = _grid(tiles, cuda_source.QUERY_FROM_ACCUMULATOR_THREADS)
        dq, = kernel(inputs=[acc, counts, _int_params(spec, acc.shape[2], tiles, False)],
                     output_shapes=[(spec.batch, spec.q_len, spec.q_heads, spec.head_dim)],
                     output_dtypes=[spec.dtype], grid=grid, threadgroup=group)
        return heads_view(dq)

    def key_value_from_parts(self, dk_parts: mx.array, dv_parts: mx.array, spec: AttentionSpec):
        """dK and dV [B, Nk, Hkv, D] in the input dtype from a head-split dK/dV kernel's fp32
        parts [splits, B, Nk, Hkv, D], added in split order (kernels/attention_backward_key_value_parts.cu)."""
        key = ("key_value_parts", CUDA_TYPES[spec.dtype], spec.head_dim)
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = self._compiled(key, lambda: (cuda_source.key_value_parts_name(*key[1:]),
                                                  cuda_source.key_value_parts_source(*key[1:]), 0))
        splits, shape = dk_parts.shape[0], dk_parts.shape[1:]
        chunks = -(-(shape[0] * shape[1] * shape[2] * shape[3]) // cuda_source.key_value_parts_chunk(spec.head_dim))
        blocks = -(-chunks // cuda_source.KEY_VALUE_PARTS_THREADS)
        grid, group = _grid(blocks, cuda_source.KEY_VALUE_PARTS_THREADS)
        return tuple(kernel(inputs=[dk_parts, dv_parts, _int_params(spec, 0, blocks, False, splits)],
                            output_shapes=[shape, shape], output_dtypes=[spec.dtype, spec.dtype],
                            grid=grid, threadgroup=group))

    def kernel(self, variant: KernelVariant):
        """The compiled kernel object of a variant (built once per variant and backend)."""
        compiled = self._kernels.get(variant)  # every launch: one lookup, no closure made
        if compiled is None:
            compiled = self._compiled(variant, lambda: (variant.name, cuda_source.source(variant),
                                                        variant.shared_memory))
        return compiled

    def _compiled(self, key, describe):
        """The cached kernel for `key`; `describe()` -> (name, (header, body, inputs, outputs),
        shared memory bytes) renders its source only on a miss: rendering the wgmma headers took
        ~0.8 ms of host time per call, more than a D = 128 forward's GPU time on an H100."""
        compiled = self._kernels.get(key)
        if compiled is None:
            name, (header, body, inputs, outputs), shared_memory = describe()
            factory = self._factory or mx.fast.cuda_kernel
            kwargs = dict(name=name, input_names=inputs, output_names=outputs, source=body, header=header,
                          ensure_row_contiguous=False)
            if shared_memory:
                kwargs["shared_memory"] = shared_memory
            compiled = self._kernels[key] = factory(**kwargs)
        return compiled

    @property
    def compiled_count(self) -> int:
        """How many kernels this backend has built (tests check lengths reuse them)."""
        return len(self._kernels)

    def _launch(self, variant: KernelVariant, spec, arrays, mask, rows: int, heads: int, output_shapes,
                output_dtypes, sinks=None, counts=None, splits: int = 1):
        """Run `variant` over `rows` (queries or keys) of every (batch, head): one CTA per block
        of parallel_block rows and column slice; the mask, the sinks (fp32), the fused dQ's counts
        and the parameter arrays go last. q, k, v and d_out are passed as they lie; the mask and
        the sinks are read row-contiguous (made so: a copy only of a broadcast or strided one)."""
        blocks = -(-rows // variant.parallel_block)
        total = spec.batch * heads * blocks * variant.slices * splits
        grid, group = _grid(total, variant.threads)
        sinks_inputs = [sinks.astype(mx.float32)] if sinks is not None and variant.sinks else []
        inputs = arrays + contiguous_operands(([mask] if mask is not None else []) + sinks_inputs) + (
            [counts] if counts is not None else []) + [
            _int_params(spec, blocks, total, block_major(spec, self.tuning), splits), float_params(spec)]
        if not variant.tensor_maps:
            return self.kernel(variant)(inputs=inputs, output_shapes=output_shapes, output_dtypes=output_dtypes,
                                        grid=grid, threadgroup=group)
        # TMA loads: the template in, a scratch output for every CTA's published maps (dropped).
        outputs = self.kernel(variant)(
            inputs=inputs + [tensor_map.panel_template(variant.traversal_block, variant.tensor_map_rank)],
            output_shapes=list(output_shapes) + [(tensor_map.scratch_bytes(total),)],
            output_dtypes=list(output_dtypes) + [mx.uint8], grid=grid, threadgroup=group)
        return outputs[:-1]


def fused_tile_floats(variant: KernelVariant) -> int:
    """Floats of one (query head, query block) tile of the fused dQ accumulator: T x D padded to
    64-column panels (DQ_TILE_FLOATS of the dK/dV template)."""
    return variant.traversal_block * 64 * -(-variant.padded_dim // 64)


BACKEND = CUDABackend()

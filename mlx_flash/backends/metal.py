"""The "metal" backend: fused attention kernels for Apple GPUs through mx.fast.metal_kernel.

Three kernels (kernels/attention_*.metal, sharing kernels/attention_common.metal) are rendered
at call time from the block plan of kernels/blocks_metal.txt:
  forward             -> out, lse
  backward_query      -> dq, delta = rowsum(dO * O) - d_lse (also used by the next kernel)
  backward_key_value  -> dk, dv (GQA: loops over the group's query heads inside a threadgroup)
No atomics anywhere, so gradients are bitwise reproducible.

Layouts (common.STRIDED_INPUTS): the kernels are built with ensure_row_contiguous=False and read
q, k, v, d_out and the saved output through their strides, so mlx-lm's transposed [B, N, H, D]
views are never copied; out, dq, dk, dv are written as [B, N, H, D] buffers and returned as
[B, H, N, D] views (common.heads_view), as MLX's own Metal attention returns its output.

MLX_FLASH_METAL_SIM=1 runs the same kernels through mlx_flash.metalsim (a CPU simulator of
Metal compute kernels) instead of mx.fast.metal_kernel, so they are tested without a Mac.
MLX_FLASH_METAL_FAMILY=m1|m3 overrides the GPU family that picks the block-table rows.
"""
from __future__ import annotations

import functools
import os
import re
from typing import Dict, Optional, Tuple

import mlx.core as mx

from .. import call_cache, planner
from ..spec import AttentionSpec
from . import metal_simulated
from . import common
from .common import (VariantFeatures, VariantSet, constant_zeros, empty_backward, empty_forward,
                     empty_sinks_gradient, float_params, heads_view, is_empty, token_major_shape)
from .metal_source import (INPUT_NAMES, OUTPUT_NAMES, KernelVariant, check_launch_limits, source,
                           variant_set)

FAMILIES = ("m1", "m3")


def detect_family() -> str:
    """GPU family for the block table: MLX_FLASH_METAL_FAMILY, else from the Metal device.

    MLX reports the GPU architecture as e.g. "applegpu_g13s" (M1), "applegpu_g14g" (M2),
    "applegpu_g15s" (M3), "applegpu_g16s" (M4): generation 15 and up is the M3 family (Apple GPU
    family 9). Without a Metal device (the simulator) the M3 table is used.
    """
    override = os.environ.get("MLX_FLASH_METAL_FAMILY", "").strip().lower()
    if override:
        if override not in FAMILIES:
            raise ValueError(f"[metal] MLX_FLASH_METAL_FAMILY must be one of {FAMILIES}, got {override!r}.")
        return override
    return _device_family()


@functools.lru_cache(maxsize=None)
def _device_family() -> str:
    """The Metal device's family (asked once: the device of a process does not change)."""
    if mx.metal.is_available():
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        family = family_from_architecture(str(info.get("architecture", "")))
        if family is not None:
            return family
    return "m3"


def family_from_architecture(architecture: str) -> Optional[str]:
    """"m1" or "m3" from MLX's architecture string ("applegpu_g<generation><class>"), or None."""
    match = re.search(r"applegpu_g(\d+)", architecture)
    if not match:
        return None
    return "m3" if int(match.group(1)) >= 15 else "m1"


@functools.lru_cache(maxsize=None)
def _simulator_import_error() -> Optional[ImportError]:
    """Why mlx_flash.metalsim cannot be imported, or None (tried once: an import statement on
    every call was part of its host time)."""
    try:
        from .. import metalsim  # noqa: F401
    except ImportError as e:
        return e
    return None


def _kernel_factory():
    """mx.fast.metal_kernel, or the simulator's drop-in when MLX_FLASH_METAL_SIM=1."""
    if metal_simulated():
        from .. import metalsim
        return metalsim.metal_kernel, False
    return mx.fast.metal_kernel, True


class MetalBackend:
    """Backend protocol implementation (see mlx_flash.backends) for the Metal kernels.

    Args:
        family: "m1" or "m3" to fix the block table's GPU family; None detects it per call.
        table: a planner.Table to plan every kernel from (the tuner's candidates); None = the
            active table (this device's tuned table when one matches, else the shipped one).
    """

    name = "metal"
    # The kernels read q, k, v and d_out through their strides (api.takes_row_contiguous): the
    # caller copies none of them.
    row_contiguous_inputs = False
    token_major_outputs = True  # out, dq, dk, dv: views of [B, N, H, D] buffers

    def __init__(self, family: Optional[str] = None, table=None):
        if family is not None and family not in FAMILIES:
            raise ValueError(f"[metal] family must be one of {FAMILIES} or None, got {family!r}.")
        if table is not None and getattr(table, "target", None) != "metal":
            raise ValueError(f"[metal] table must be a planner.Table of target 'metal' or None, got {table!r}.")
        self._family = family
        self.table = table
        # Compile cache: (variant, simulated) -> kernel object. Keyed only by compile-time
        # constants, so new lengths, batch sizes or scales reuse a compiled kernel.
        self._kernels: Dict[Tuple[KernelVariant, bool], object] = {}
        self._variant_sets = call_cache.Kept()  # features -> VariantSet

    # -- protocol -----------------------------------------------------------------------------

    def unavailable_reason(self, device) -> Optional[str]:
        if metal_simulated():
            error = _simulator_import_error()
            return None if error is None else f"MLX_FLASH_METAL_SIM=1 but the simulator cannot be imported ({error})"
        if not mx.metal.is_available():
            return "no Metal GPU (set MLX_FLASH_METAL_SIM=1 to run the kernels on the CPU simulator)"
        if device.type != mx.gpu:
            return f"the stream's device is {device}, the Metal kernels run on the GPU"
        return None

    def unsupported_reason(self, spec: AttentionSpec) -> Optional[str]:
        if spec.value_dim != spec.head_dim:
            return (f"value_dim {spec.value_dim} != head_dim {spec.head_dim} is not implemented "
                    f"in the Metal kernels")
        return None

    def family(self) -> str:
        return self._family or detect_family()

    def variants(self, spec: AttentionSpec) -> VariantSet:
        """The forward, dQ and dK/dV variants that serve this call (metal_source.variant_set: made
        once per features, family and table; the answer is kept per features while call_cache's
        stamp holds, as each launch asks)."""
        features, now = VariantFeatures.of(spec), call_cache.stamp()
        kept = self._variant_sets.lookup(features, now)
        if kept is None:
            family = self.family()
            kept = variant_set(features, family, self.table or planner.active_table("metal", family))
            self._variant_sets.store(features, now, kept)
        return kept

    def variant_key(self, spec: AttentionSpec, mask_dtype=None):
        """The kernel variants a call runs (with the mask dtype, which the compiled signature has)."""
        return self.variants(spec), mask_dtype, metal_simulated()

    def variant_name(self, kernel: str, spec: AttentionSpec, mask_dtype=None) -> str:
        if kernel not in INPUT_NAMES:
            raise ValueError(f"[metal] kernel must be one of {tuple(INPUT_NAMES)}, got {kernel!r}.")
        return getattr(self.variants(spec), kernel).name

    def forward(self, q, k, v, mask, spec: AttentionSpec, sinks=None):
        """(out [B,Hq,Nq,D] in q's dtype, a view of a [B,Nq,Hq,D] buffer; lse [B,Hq,Nq] fp32
        natural log, sinks included). q, k, v are read through their strides (any layout)."""
        if is_empty(spec):
            return empty_forward(q, k, v, mask, spec, sinks)
        B, Hq, Nq, D = spec.batch, spec.q_heads, spec.q_len, spec.head_dim
        variant = self.variants(spec).forward
        mask_array, mask_strides = _mask_operands(mask)
        spill = (B * Hq * Nq * D,) if variant.spills("O") else (1,)
        out, lse, _ = self._launch(
            variant, spec, parallel_len=Nq, heads=Hq,
            inputs=[q, k, v, mask_array, mask_strides, _sinks_operand(sinks), _params(spec), float_params(spec)],
            output_shapes=[token_major_shape((B, Hq, Nq, D)), (B, Hq, Nq), spill],
            output_dtypes=[spec.dtype, mx.float32, mx.float32])
        return heads_view(out), lse

    def backward(self, q, k, v, mask, out, lse, d_out, d_lse, spec: AttentionSpec, sinks=None,
                 lse_is_local: bool = True):
        """(dq, dk, dv, d_sinks) in the input dtype, dq, dk, dv views of [B, N, H, D] buffers; d_lse
        is None or the cotangent of lse. q, k, v, out and d_out are read through their strides.
        lse_is_local is ignored: the kernels compute P = exp(S - lse) for any lse.

        d_sinks (None without sinks) is fused into the dQ kernel: each simdgroup writes the
        part of its 8 query rows, summed here in a fixed order (deterministic, no atomics).
        """
        if is_empty(spec):
            return (*empty_backward(q, k, v), empty_sinks_gradient(sinks, out, lse, d_out, d_lse))
        variants = self.variants(spec)
        # The row-contiguous operands, made so once for both kernels (delta, the dQ kernel's output,
        # is row-contiguous already).
        masks, lse = _mask_operands(mask), _statistic(lse)
        dq, delta, d_sinks_part = self._backward_query(variants.backward_query, q, k, v, masks, out, lse, d_out,
                                                       d_lse, spec, sinks)
        dk, dv = self._backward_key_value(variants.backward_key_value, q, k, v, masks, lse, d_out, delta, spec)
        d_sinks = None if sinks is None else d_sinks_part.sum(axis=(0, 2)).astype(sinks.dtype)
        return dq, dk, dv, d_sinks

    # -- the two backward kernels, separately (the benchmark times them apart) -------------------

    def backward_query(self, q, k, v, mask, out, lse, d_out, d_lse, spec: AttentionSpec, sinks=None):
        """dq from the dQ kernel alone."""
        if is_empty(spec):
            return empty_backward(q, k, v)[0]
        return self._backward_query(self.variants(spec).backward_query, q, k, v, _mask_operands(mask), out,
                                    _statistic(lse), d_out, d_lse, spec, sinks)[0]

    def backward_key_value(self, q, k, v, mask, out, lse, d_out, d_lse, spec: AttentionSpec,
                           delta=None):
        """(dk, dv) from the dK/dV kernel.

        Args:
            delta: rowsum(dO * O) - d_lse, fp32 [B,Hq,Nq], as the dQ kernel writes it; computed
                here with MLX ops when None (so this kernel can run and be timed alone).
        """
        if is_empty(spec):
            return empty_backward(q, k, v)[1:]
        if delta is None:
            delta = (d_out.astype(mx.float32) * out.astype(mx.float32)).sum(-1)
            if d_lse is not None:
                delta = delta - d_lse.astype(mx.float32)
        return self._backward_key_value(self.variants(spec).backward_key_value, q, k, v, _mask_operands(mask),
                                        _statistic(lse), d_out, _statistic(delta), spec)

    # -- internals ----------------------------------------------------------------------------

    def _backward_key_value(self, variant, q, k, v, masks, lse, d_out, delta, spec):
        """(dk, dv) from the dK/dV kernel `variant`, given delta (see backward_key_value).

        Args:
            masks: _mask_operands(mask). lse, delta: fp32, row-contiguous (_statistic).
        """
        B, Hkv, Nk, D = spec.batch, spec.kv_heads, spec.kv_len, spec.head_dim
        mask_array, mask_strides = masks
        dk_spill = (B * Hkv * Nk * D,) if variant.spills("dK") else (1,)
        dv_spill = (B * Hkv * Nk * D,) if variant.spills("dV") else (1,)
        shape = token_major_shape((B, Hkv, Nk, D))
        dk, dv, _, _ = self._launch(
            variant, spec, parallel_len=Nk, heads=Hkv,
            inputs=[q, k, v, d_out.astype(spec.dtype), lse, delta, mask_array, mask_strides, _params(spec),
                    float_params(spec)],
            output_shapes=[shape, shape, dk_spill, dv_spill],
            output_dtypes=[spec.dtype, spec.dtype, mx.float32, mx.float32])
        return heads_view(dk), heads_view(dv)

    def _backward_query(self, variant, q, k, v, masks, out, lse, d_out, d_lse, spec, sinks=None):
        """(dq, delta, d_sinks_part): d_sinks_part [B, Hq, parts] with sinks, else unused.

        Args:
            masks: _mask_operands(mask). lse: fp32, row-contiguous (_statistic).
        """
        B, Hq, Nq, D = spec.batch, spec.q_heads, spec.q_len, spec.head_dim
        mask_array, mask_strides = masks
        # The cotangent MLX makes for an unused lse is a broadcast zero (stride 0): made contiguous.
        d_lse = mx.zeros((B, Hq, Nq), mx.float32) if d_lse is None else _statistic(d_lse)
        spill = (B * Hq * Nq * D,) if variant.spills("dQ") else (1,)
        # One sink-gradient part per simdgroup (8 query rows) of each query block.
        P = variant.plan.parallel_block
        parts = (B, Hq, -(-Nq // P) * (P // 8)) if variant.sinks else (1,)
        dq, delta, _, d_sinks_part = self._launch(
            variant, spec, parallel_len=Nq, heads=Hq,
            inputs=[q, k, v, out.astype(spec.dtype), d_out.astype(spec.dtype), lse, d_lse, mask_array,
                    mask_strides, _sinks_operand(sinks), _params(spec), float_params(spec)],
            output_shapes=[token_major_shape((B, Hq, Nq, D)), (B, Hq, Nq), spill, parts],
            output_dtypes=[spec.dtype, mx.float32, mx.float32, mx.float32])
        return heads_view(dq), delta, d_sinks_part

    def kernel(self, variant: KernelVariant):
        """The compiled kernel object of a variant (built once per variant and backend)."""
        simulated = metal_simulated()
        key = (variant, simulated)
        compiled = self._kernels.get(key)
        if compiled is None:
            # Checked here, before the kernel is built and cached, rather than at every launch: a
            # variant that breaks the limits is never cached, so each of its launches raises.
            check_launch_limits(variant)
            factory, real_metal = _kernel_factory()
            body, header = source(variant)
            kwargs = dict(name=variant.name, input_names=list(INPUT_NAMES[variant.kernel]),
                          output_names=list(OUTPUT_NAMES[variant.kernel]), source=body, header=header,
                          ensure_row_contiguous=False)
            if real_metal and _accepts_compile_options():
                # IEEE inf semantics (exp2(-inf) == 0) are relied on for masked scores. MLX
                # before 0.32 has no compile_options and always compiles custom kernels with
                # fast math disabled, which gives the same semantics.
                kwargs["compile_options"] = {"math_mode": "safe"}
            compiled = factory(**kwargs)
            self._kernels[key] = compiled
        return compiled

    @property
    def compiled_count(self) -> int:
        """How many kernel variants this backend has built (tests check lengths reuse them)."""
        return len(self._kernels)

    def _launch(self, variant: KernelVariant, spec, parallel_len: int, heads: int, inputs,
                output_shapes, output_dtypes):
        threads = variant.threads_per_threadgroup
        groups = -(-parallel_len // variant.plan.parallel_block)
        # mx.fast.metal_kernel's grid counts threads; a grid dim smaller than the threadgroup
        # dim would silently truncate (ml-explore/mlx#4534): launch whole threadgroups.
        return self.kernel(variant)(
            inputs=inputs, output_shapes=output_shapes, output_dtypes=output_dtypes,
            grid=(groups * threads, heads, spec.batch), threadgroup=(threads, 1, 1))


def _accepts_compile_options() -> bool:
    doc = mx.fast.metal_kernel.__doc__ or ""
    return "compile_options" in doc.split("\n", 1)[0]


# The small operands below are constants of a few ints: made once per value instead of once per
# launch (mx.array of a list: data, never a lazy op that a compile trace could hold).
def _params(spec: AttentionSpec) -> mx.array:
    return _params_of((spec.q_len, spec.kv_len, spec.q_heads, spec.kv_heads, spec.window, spec.diagonal_shift))


@functools.lru_cache(maxsize=1024)
def _params_of(key: tuple) -> mx.array:
    q_len, kv_len, q_heads, kv_heads, window, diagonal_shift = key
    left, right = window if window is not None else (-1, -1)
    return mx.array([q_len, kv_len, q_heads, q_heads // kv_heads, left, right, kv_heads, diagonal_shift],
                    dtype=mx.int32)


def _statistic(x: mx.array) -> mx.array:
    """A per-row statistic (lse, d_lse, delta) as the kernels read it: fp32, row-contiguous."""
    return mx.contiguous(x.astype(mx.float32))  # common.contiguous_operands of one, without the list


def _sinks_operand(sinks) -> mx.array:
    """fp32 sinks [Hq], or a 1-element dummy that keeps the kernel signature fixed (never read)."""
    return constant_zeros(mx.float32, 1) if sinks is None else mx.contiguous(sinks.astype(mx.float32))


def _mask_operands(mask) -> Tuple[mx.array, mx.array]:
    """(mask made row-contiguous, its element strides [b, h, query, key] with 0 on broadcast dims,
    int64).

    Without a mask, a 1-element dummy keeps the kernel signature fixed (it is never read).
    """
    if mask is None:
        return constant_zeros(mx.bool_, 1), constant_zeros(mx.int64, 8)
    return mx.contiguous(mask), _mask_layout(tuple(mask.shape))


@functools.lru_cache(maxsize=256)
def _mask_layout(shape: Tuple[int, ...]) -> mx.array:
    return mx.array(common.mask_strides(shape) + [0] * 4, dtype=mx.int64)


BACKEND = MetalBackend()

"""The "cuda" backend: fused attention kernels for NVIDIA GPUs through `mx.fast.cuda_kernel`.

plan -> source -> launch:
  * `kernel_config` asks the shared planner (kernels/blocks_cuda.txt) for the block sizes of one
    kernel and folds in what the call needs at compile time (dtype, head dim, causal / window /
    softcap presence, mask kind and dtype);
  * `kernel_source` renders kernels/attention_*.cu with those constants (after the helpers in
    kernels/attention_common.cuh) and `_kernel` compiles it once per configuration (NVRTC, cached);
  * forward / backward launch the kernels with the runtime values (sizes, strides, scale, softcap,
    window) passed as two small arrays, so a new sequence length or batch never recompiles.

Kernels: forward (O, L), a per-row preprocessing step for the backward (delta = rowsum(dO * O)
- dL, L in base 2), dQ, and dK/dV. No atomics anywhere: gradients are bitwise reproducible. On
Hopper (sm_90) the forward, dQ and dK/dV for head_dim <= 256 are warp-specialized warpgroup-MMA
kernels (kernels/attention_*_wgmma.cu); elsewhere, and past 256, mma.sync kernels.
Supported natively: fp16 / bf16, any head dim 1..512, any Nq / Nk, GQA / MQA, causal, sliding
window, softcap, bool / additive array masks with broadcast strides. float32 inputs, value_dim !=
head_dim and head_dim > 512 go to the "mlx" backend (counted by mlx_flash.fallback).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import List, Optional, Tuple

import mlx.core as mx

from .. import planner
from ..render import render, template_text
from ..spec import AttentionSpec
from .sinks import empty_lse, row_term, sinks_gradient

FAMILY = "sm90"
DEFAULT_WARPS = 4  # warps per CTA where the table row's warps column is '-'
MAX_HEAD_DIM = 512
# Opt-in shared memory per block on sm_90 (227 KB); sm_80 has 163 KB, sm_86/89 99 KB.
SHARED_MEMORY_LIMIT = 227 * 1024
PREPARE_ROWS_PER_BLOCK = 4
MAX_GRID_X_BLOCKS = 1 << 16  # the rest of the block count goes on grid y (limit 65535)

_CUDA_TYPES = {mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float", mx.bool_: "bool"}
_MASK_KINDS = {"none": 0, "bool": 1, "additive": 2}
_TEMPLATES = {"forward": "attention_forward.cu", "backward_query": "attention_backward_query.cu",
              "backward_key_value": "attention_backward_key_value.cu"}
# Hopper's warpgroup-MMA kernels (kernels/attention_*_wgmma.cu): rows of family "sm90a" in
# blocks_cuda.txt, P = 64 rows (queries, or keys for dK/dV) per consumer warpgroup, warps = 4 per
# consumer warpgroup, whole D per warpgroup; the CTA has one more warpgroup, the producer of the
# streamed tiles (K / V, or Q / dO for dK/dV).
WGMMA_FAMILY = "sm90a"
_WGMMA_TEMPLATES = {"forward": "attention_forward_wgmma.cu", "backward_query": "attention_backward_query_wgmma.cu",
                    "backward_key_value": "attention_backward_key_value_wgmma.cu"}
# Head dims each wgmma kernel covers: wgmma's N (the O / dQ tile width) is at most 256. dK/dV: the
# dK and dV accumulators of a 64-row warpgroup hold D / 2 floats each per thread, which beside the
# score tiles fit the consumers' 232 registers up to D = 160 (WGMMA_WHOLE_MAX_COLUMNS); the table
# row's H says how many columns one warpgroup takes: past H the kernel splits D into 128-column
# parts (WGMMA_SLICE_WIDTH), one CTA each (slices) or one warpgroup each (column groups).
WGMMA_MAX_HEAD_DIMS = {"forward": 256, "backward_query": 256, "backward_key_value": 256}
WGMMA_SLICE_WIDTH = 128
WGMMA_WHOLE_MAX_COLUMNS = 160
# The warp-specialized wgmma forward is the faster one at every head dim it covers (H100, one
# run, 2026-11-22, TFLOP/s per call mma.sync / wgmma: D=64 196 / 250, D=128 240 / 412, D=160
# 163 / 211, D=256 168 / 344; causal D=128 214 / 289, D=256 149 / 237).
# Consumer warpgroups take turns issuing MMAs (FlashAttention-3's scheduler barriers) up to this
# head dim; past it the softmax is a small share of a step. Provisional: FA3's choice for bf16.
WGMMA_PINGPONG_MAX_HEAD_DIM = 128


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass(frozen=True)
class KernelConfig:
    """Compile-time constants of one attention kernel (hashable: the kernel cache key).

    Attributes:
        kernel: "forward", "backward_query" or "backward_key_value".
        dtype: CUDA element type of q, k, v ("__half" or "__nv_bfloat16").
        head_dim: D. padded_dim: D rounded up to 16 (the QK^T / dO V^T contraction).
        slice_width: output columns per warp (H, a multiple of 16).
        col_groups: warps of one CTA side by side along the output columns (CG); the CTA covers
            CG * H columns. slices: CTAs per parallel block (column slices of CG * H).
        warps: warps per CTA (row groups RG = warps / CG).
        m_tiles: 16-row m-tiles per warp (parallel block = 16 * m_tiles * RG rows).
        traversal_block: keys (forward, dQ) or queries (dK/dV) streamed per step.
        causal, window, softcap: which index masks / transforms are compiled in.
        mask_kind: 0 none, 1 bool, 2 additive; mask_type: CUDA type of the mask elements.
        cache_q: the forward keeps Q fragments in registers.
        instruction: "mma" (mma.sync kernels, sm_80+) or "wgmma" (the Hopper kernels: one
            consumer warpgroup per 64 rows (queries; keys for dK/dV), m_tiles = 1, warps = 4 *
            consumer warpgroups, plus a producer warpgroup; slice_width = the columns of O / dQ /
            dK and dV each warpgroup computes; past D = 128 dK/dV has slices > 1 (CTAs per key
            block) or col_groups = 2 (both warpgroups on the same 64 keys, 128 columns each)).
        pingpong: wgmma kernels: the consumer warpgroups take turns issuing their MMAs.
        stages: wgmma kernels: buffers of each streamed tile (K and V, or Q and dO) in the ring.
    """

    kernel: str
    dtype: str
    head_dim: int
    padded_dim: int
    slice_width: int
    slices: int
    m_tiles: int
    traversal_block: int
    causal: bool
    window: bool
    softcap: bool
    mask_kind: int
    mask_type: str
    cache_q: bool
    warps: int = DEFAULT_WARPS
    col_groups: int = 1
    instruction: str = "mma"
    pingpong: bool = False
    stages: int = 2
    sinks: bool = False  # attention sinks (forward and dQ kernels; dK/dV needs none: lse includes them)

    @property
    def row_groups(self) -> int:
        return self.warps // self.col_groups

    @property
    def threads(self) -> int:
        return 32 * self.warps + (128 if self.instruction == "wgmma" else 0)  # + the producer warpgroup

    @property
    def parallel_block(self) -> int:
        return 16 * self.m_tiles * self.row_groups

    @property
    def staged_dim(self) -> int:
        """Columns of each shared-memory tile in the backward kernels (every slice fits)."""
        return self.slices * self.col_groups * self.slice_width

    @property
    def shared_memory(self) -> int:
        """Bytes of dynamic shared memory (must match SMEM_BYTES in the template)."""
        bm, bn, cg = self.parallel_block, self.traversal_block, self.col_groups
        if self.instruction == "wgmma":  # swizzled 64-column panels (128 B rows), 1 KB alignment, mbarriers
            row = -(-self.padded_dim // 64) * 128
            if self.kernel == "forward":  # Q; K and V rings
                return 1024 + row * (bm + 2 * self.stages * bn) + 32 * self.stages
            if self.kernel == "backward_query":  # Q and dO; K and V rings
                return 1024 + row * (2 * bm + 2 * self.stages * bn) + 32 * self.stages
            # K and V; Q, dO (whole 128-column slices), lse2 and delta ring; column groups' swap
            tile_row = row if self.slices == 1 and cg == 1 else self.slices * cg * self.slice_width * 2
            swap = 512 * bn * (2 if bn <= 32 else 1) if cg == 2 else 0  # S^T / dP^T, SWAP_BUFFERS
            return 1024 + row * 2 * bm + 2 * self.stages * bn * tile_row + swap + self.stages * (8 * bn + 24)
        if self.kernel == "forward":
            row = self.padded_dim + 8
            return (bm * row + 2 * bn * row + 2 * bn * (cg * self.slice_width + 8)) * 2
        row = self.staged_dim + 8
        shared_scores = bm * (bn + 8) if cg > 1 else 0  # P^T and dS^T (dK/dV) or dS (dQ) tiles
        if self.kernel == "backward_query":
            return (2 * bm * row + 4 * bn * row + shared_scores) * 2
        return (2 * bm * row + 4 * bn * row + 2 * shared_scores) * 2 + 4 * bn * 4

    @property
    def name(self) -> str:
        flags = "".join(c for c, on in (("c", self.causal), ("w", self.window), ("s", self.softcap),
                                         ("q", self.cache_q),
                                         ("p", self.pingpong), ("k", self.sinks)) if on)
        kernel = self.kernel + (f"_wgmma{self.stages}" if self.instruction == "wgmma" else "")
        return (f"mlxflash_{kernel}_{'bf16' if 'bfloat' in self.dtype else 'f16'}_d{self.head_dim}"
                f"_h{self.slice_width}_w{self.warps}g{self.col_groups}_m{self.m_tiles}_n{self.traversal_block}"
                f"_k{self.mask_kind}{self.mask_type.replace('__', '').replace('nv_', '')}_{flags or 'x'}")


def column_slices(head_dim: int, head_block: int, warps: int) -> Tuple[int, int, int]:
    """(warp column width H, column groups CG, CTA slices) covering head_dim.

    ceil(D / head_block) slices are rounded up to a count the CTA's warps divide evenly (a
    divisor of `warps`, or a multiple of it past that), then made as narrow as the head dim
    allows (H = D / slices rounded up to 16): D = 160 with head_block 128 gives 2 x 80, not 2 x 128.
    """
    slices = -(-head_dim // head_block)
    if slices <= warps:
        slices = min(c for c in range(slices, warps + 1) if warps % c == 0)
    else:
        slices = _round_up(slices, warps)
    width = _round_up(-(-head_dim // slices), 16)
    col_groups = min(slices, warps)
    return width, col_groups, slices // col_groups


# Tuning hook for benchmarks/gpu_check.py only: {kernel: (P, T, H[, warps])} replaces the table's
# row for every head dim. Empty in normal use.
BLOCK_OVERRIDES: dict = {}


def kernel_config(kernel: str, spec: AttentionSpec, mask_dtype: Optional[mx.Dtype]) -> KernelConfig:
    """The compile-time configuration of `kernel` for a call (block sizes from blocks_cuda.txt)."""
    return _kernel_config(kernel, spec, mask_dtype, _tuning_key())


def _tuning_key() -> tuple:
    """Everything besides the call that kernel_config reads: the GPU and the tuning hooks below
    (their defaults in normal use), so that a hook set by gpu_check or a test is never answered
    from the cache."""
    return (compute_capability(), WGMMA_FORWARD_OVERRIDE, WGMMA_BACKWARD_OVERRIDE, WGMMA_PINGPONG,
            WGMMA_BACKWARD_PINGPONG, WGMMA_STAGES, WGMMA_SLICE_WIDTH, WGMMA_WHOLE_MAX_COLUMNS,
            tuple(sorted(BLOCK_OVERRIDES.items())))


# Cached: working the table out took 8 us of the call's ~50 us host time (CI machine, D=64).
@functools.lru_cache(maxsize=1024)
def _kernel_config(kernel: str, spec: AttentionSpec, mask_dtype: Optional[mx.Dtype], tuning: tuple) -> KernelConfig:
    sinks = spec.has_sinks and kernel != "backward_key_value"
    if use_wgmma(kernel, spec):
        config = _wgmma_config(kernel, spec, mask_dtype)
        return replace(config, sinks=True) if sinks else config
    plan = planner.plan("cuda", kernel, spec.head_dim, spec.dtype, FAMILY)
    warps = plan.warps or DEFAULT_WARPS
    if kernel in BLOCK_OVERRIDES:
        p, t, h, *rest = BLOCK_OVERRIDES[kernel]
        plan = planner.BlockPlan(kernel, p, t, min(h, -(-spec.head_dim // 8) * 8), plan.cached, spec.head_dim)
        warps = rest[0] if rest else warps
    padded = _round_up(spec.head_dim, 16)
    width, col_groups, cta_slices = column_slices(spec.head_dim, min(_round_up(plan.head_block, 16), padded), warps)
    row_groups = warps // col_groups
    if plan.parallel_block % (16 * row_groups):
        raise ValueError(f"[cuda] blocks_cuda.txt: P={plan.parallel_block} for {kernel} at head_dim={spec.head_dim} "
                         f"must be a multiple of 16 * {row_groups} (row groups of {warps} warps, {col_groups} "
                         f"column groups).")
    config = KernelConfig(
        kernel=kernel, dtype=_CUDA_TYPES[spec.dtype], head_dim=spec.head_dim, padded_dim=padded,
        slice_width=width, slices=cta_slices, m_tiles=plan.parallel_block // (16 * row_groups),
        traversal_block=plan.traversal_block, causal=spec.causal, window=spec.window is not None,
        softcap=spec.softcap is not None, mask_kind=_MASK_KINDS[spec.mask_kind],
        mask_type=_CUDA_TYPES[mask_dtype] if mask_dtype is not None else _CUDA_TYPES[spec.dtype],
        cache_q=kernel == "forward" and plan.is_cached("Q"), warps=warps, col_groups=col_groups)
    # The backward kernels split the traversal block over the column groups in 8-wide tiles.
    min_block = 16 if kernel == "forward" or col_groups == 1 else max(16, 8 * col_groups)
    if config.traversal_block % min_block:
        raise ValueError(f"[cuda] blocks_cuda.txt: T={config.traversal_block} for {kernel} at head_dim="
                         f"{spec.head_dim} must be a multiple of {min_block} ({col_groups} column groups).")
    # A table row too large for shared memory halves its traversal block (down to the minimum).
    while config.shared_memory > SHARED_MEMORY_LIMIT and config.traversal_block // 2 >= min_block \
            and (config.traversal_block // 2) % min_block == 0:
        config = replace(config, traversal_block=config.traversal_block // 2)
    if config.shared_memory > SHARED_MEMORY_LIMIT:
        raise ValueError(f"[cuda] {kernel} at head_dim={spec.head_dim} needs {config.shared_memory} bytes of "
                         f"shared memory (limit {SHARED_MEMORY_LIMIT}); reduce P or H in blocks_cuda.txt.")
    return replace(config, sinks=True) if sinks else config


def _wgmma_config(kernel: str, spec: AttentionSpec, mask_dtype: Optional[mx.Dtype]) -> KernelConfig:
    plan = planner.plan("cuda", kernel, spec.head_dim, spec.dtype, WGMMA_FAMILY)
    block, keys, columns, warps = plan.parallel_block, plan.traversal_block, plan.head_block, plan.warps or 8
    if kernel + "_wgmma" in BLOCK_OVERRIDES:
        block, keys, columns, *rest = BLOCK_OVERRIDES[kernel + "_wgmma"]
        warps = rest[0] if rest else block // 16
    # Consumer warps (4 per warpgroup): the dK/dV kernel's register split needs exactly two.
    consumers = (8,) if kernel == "backward_key_value" else (8, 12)
    padded = _round_up(spec.head_dim, 16)
    # dK/dV past the row's H columns: P = 128 keys (64 per warpgroup) splits D into 128-column
    # CTAs (slices), P = 64 has both warpgroups share the keys and split the columns (column groups).
    wide = kernel == "backward_key_value" and padded > _round_up(columns, 16)
    if kernel == "backward_key_value" and (padded > WGMMA_WHOLE_MAX_COLUMNS if not wide else columns != WGMMA_SLICE_WIDTH):
        raise ValueError(f"[cuda] blocks_cuda.txt: the {WGMMA_FAMILY} backward_key_value at head_dim={spec.head_dim} "
                         f"has H={columns}: a warpgroup holds dK / dV for all of D up to {WGMMA_WHOLE_MAX_COLUMNS} "
                         f"columns, past that H must be {WGMMA_SLICE_WIDTH} (slices or column groups).")
    col_groups = 2 if wide and block == 8 * warps else 1
    if warps not in consumers or block * col_groups != 16 * warps:
        raise ValueError(f"[cuda] blocks_cuda.txt: the {WGMMA_FAMILY} {kernel} at head_dim={spec.head_dim} needs "
                         f"P = 64 rows per consumer warpgroup of 4 warps, {' or '.join(str(w // 4) for w in consumers)}"
                         f" of them{' (or 64 shared by both past D = 128)' if wide else ''}; got P={block} with "
                         f"{warps} warps.")
    most = 256 if kernel == "forward" else 128
    if keys % 16 or not 16 <= keys <= most:
        raise ValueError(f"[cuda] blocks_cuda.txt: T={keys} for the {WGMMA_FAMILY} {kernel} at head_dim="
                         f"{spec.head_dim} must be a multiple of 16 in [16, {most}].")
    slices = -(-padded // WGMMA_SLICE_WIDTH) if wide and col_groups == 1 else 1
    config = KernelConfig(
        kernel=kernel, dtype=_CUDA_TYPES[spec.dtype], head_dim=spec.head_dim, padded_dim=padded,
        slice_width=WGMMA_SLICE_WIDTH if wide else padded, slices=slices, m_tiles=1,
        traversal_block=keys, causal=spec.causal, window=spec.window is not None,
        softcap=spec.softcap is not None, mask_kind=_MASK_KINDS[spec.mask_kind],
        mask_type=_CUDA_TYPES[mask_dtype] if mask_dtype is not None else _CUDA_TYPES[spec.dtype],
        cache_q=False, warps=warps, col_groups=col_groups, instruction="wgmma",
        pingpong=(WGMMA_PINGPONG if WGMMA_PINGPONG is not None else spec.head_dim <= WGMMA_PINGPONG_MAX_HEAD_DIM)
        if kernel == "forward" else bool(WGMMA_BACKWARD_PINGPONG),
        stages=WGMMA_STAGES)
    while config.shared_memory > SHARED_MEMORY_LIMIT and (config.stages > 2 or config.traversal_block >= 32):
        if config.stages > 2:  # fewer buffers first, then narrower tiles
            config = replace(config, stages=config.stages - 1)
        else:
            config = replace(config, traversal_block=config.traversal_block // 2)
    if config.shared_memory > SHARED_MEMORY_LIMIT:
        raise ValueError(f"[cuda] the {WGMMA_FAMILY} {kernel} at head_dim={spec.head_dim} needs "
                         f"{config.shared_memory} bytes of shared memory (limit {SHARED_MEMORY_LIMIT}).")
    return config


# Tuning hooks for benchmarks/gpu_check.py only: None = the wgmma forward wherever
# use_wgmma allows it, False = the mma.sync forward everywhere, True = the wgmma forward
# for every head_dim <= 256 whatever the GPU (nvcc resource checks).
WGMMA_FORWARD_OVERRIDE: Optional[bool] = None
WGMMA_BACKWARD_OVERRIDE: Optional[bool] = None  # the same for the dQ and dK/dV kernels
WGMMA_BACKWARD_PINGPONG = False  # the backward kernels' consumer warpgroups take turns issuing MMAs
WGMMA_PINGPONG: Optional[bool] = None  # None = by head dim (WGMMA_PINGPONG_MAX_HEAD_DIM)
# K / V buffers each in the producer's ring. H100, one run, TFLOP/s per call 2 / 3 stages:
# D=64 250 / 233, D=128 412 / 388 (3 won, 315 / 289, while the producer waited for its own
# copies; since the hardware announces them, two suffice). The backward kernels use the same
# count (only 2 measured).
WGMMA_STAGES = 2


@functools.lru_cache(maxsize=None)
def compute_capability() -> Optional[int]:
    """The GPU's compute capability as 10 * major + minor (90 for H100 / H200), None if unknown.

    Read from mx.device_info()'s "architecture" (e.g. "sm_90a" on MLX's CUDA backend)."""
    try:
        info = mx.device_info(mx.gpu)
    except Exception:  # no GPU device or an MLX without device_info
        return None
    text = str(info.get("architecture", info.get("compute_capability", "")))
    digits = "".join(c for c in text if c.isdigit())
    return int(digits) if digits else None


def use_wgmma(kernel: str, spec: AttentionSpec) -> bool:
    """Whether `kernel` runs its warpgroup-MMA version: Hopper only (wgmma is sm_90a; Blackwell
    dropped it) and head_dim up to WGMMA_MAX_HEAD_DIMS[kernel] (an override forces it, or the
    mma.sync kernel, anywhere)."""
    override = WGMMA_FORWARD_OVERRIDE if kernel == "forward" else WGMMA_BACKWARD_OVERRIDE
    if override is False or spec.head_dim > WGMMA_MAX_HEAD_DIMS[kernel]:
        return False
    if override:
        return True
    capability = compute_capability()
    return capability is not None and 90 <= capability < 100


def kernel_source(config: KernelConfig) -> Tuple[str, str, List[str], List[str]]:
    """(header, body, input names, output names) for mx.fast.cuda_kernel."""
    has_mask = config.mask_kind != 0
    mask_arg = "mask" if has_mask else f"(const {config.mask_type}*)nullptr"
    if config.instruction == "wgmma":
        constants = dict(T=config.dtype, MASK_T=config.mask_type, HEAD_DIM=config.head_dim, DP=config.padded_dim,
                         GROUPS=config.warps // 4, BN=config.traversal_block, CAUSAL=config.causal,
                         WINDOW=config.window, SOFTCAP=config.softcap, MASK_KIND=config.mask_kind,
                         STAGES=config.stages, PINGPONG=config.pingpong, LAUNCH_SMEM=config.shared_memory)
        if config.kernel == "backward_key_value":
            constants.update(NSLICE=config.slices, DS=config.slice_width, CG=config.col_groups)
        else:
            constants["SINKS"] = config.sinks
        header = "\n".join([template_text("attention_common.cuh"), _wgmma_wrappers(config),
                            template_text("wgmma_common.cuh"), render(_WGMMA_TEMPLATES[config.kernel], **constants)])
        inputs, outputs, body = _signature(config.kernel, has_mask, mask_arg, "_wgmma", config.sinks)
        return header, body, inputs, outputs
    constants = dict(T=config.dtype, MASK_T=config.mask_type, HEAD_DIM=config.head_dim,
                     DP=config.padded_dim, HB=config.slice_width, NSLICE=config.slices,
                     WM=config.m_tiles, RG=config.row_groups, CG=config.col_groups,
                     BN=config.traversal_block, CAUSAL=config.causal,
                     WINDOW=config.window, SOFTCAP=config.softcap, MASK_KIND=config.mask_kind)
    if config.kernel == "forward":
        constants["CACHE_Q"] = config.cache_q
    else:
        constants["DS"] = config.staged_dim
    if config.kernel != "backward_key_value":
        constants["SINKS"] = config.sinks
    header = template_text("attention_common.cuh") + "\n" + render(_TEMPLATES[config.kernel], **constants)
    inputs, outputs, body = _signature(config.kernel, has_mask, mask_arg, "", config.sinks)
    return header, body, inputs, outputs


def _signature(kernel: str, has_mask: bool, mask_arg: str, suffix: str,
               sinks: bool = False) -> Tuple[List[str], List[str], str]:
    """(input names, output names, body) of `kernel`: the body calls mlxflash::attention_<kernel><suffix>.

    The forward and dQ kernels take a sinks pointer after the mask (null without sinks); the dQ
    kernel also writes d_sinks_part after dq (null without sinks)."""
    if kernel == "forward":
        inputs, outputs = ["q", "k", "v"], ["out", "lse"]
    else:
        inputs = ["q", "k", "v", "d_out", "lse2", "delta"]
        outputs = ["dq"] if kernel == "backward_query" else ["dk", "dv"]
    args = list(inputs) + [mask_arg]
    if kernel != "backward_key_value":
        args.append("sinks" if sinks else "(const float*)nullptr")
    inputs += (["mask"] if has_mask else []) + (["sinks"] if sinks else []) + ["params", "fparams"]
    args += ["params", "fparams"] + outputs
    if kernel == "backward_query":
        outputs = outputs + (["d_sinks_part"] if sinks else [])
        args.append("d_sinks_part" if sinks else "(float*)nullptr")
    body = f"mlxflash::attention_{kernel}{suffix}({', '.join(args)});"
    return inputs, outputs, body


def prepare_source(dtype: str, head_dim: int, has_d_lse: bool) -> Tuple[str, str, List[str], List[str]]:
    """(header, body, inputs, outputs) of the backward preprocessing kernel."""
    header = template_text("attention_common.cuh") + "\n" + render(
        "attention_backward_prepare.cu", T=dtype, HEAD_DIM=head_dim, HAS_DLSE=has_d_lse)
    body = "mlxflash::attention_backward_prepare(out, d_out, lse, d_lse, params, delta, lse2);"
    return header, body, ["out", "d_out", "lse", "d_lse", "params"], ["delta", "lse2"]


def _wgmma_wrappers(config: KernelConfig) -> str:
    """kernels/wgmma_ops.cuh cut to the two widths the kernel uses (scores: BN; O, dQ or a dK / dV
    slice: slice_width). MLX copies and hashes a kernel's source on every call: the whole file
    (148 KB) made that host time 3x."""
    text = template_text("wgmma_ops.cuh")
    marker = "template <> struct Wgmma<"
    first = text.index(marker)
    head, structs = text[:first], text[first:].split(marker)[1:]
    widths = {config.traversal_block, config.slice_width}
    keep = [marker + body for body in structs
            if int(body.split(",")[0]) in widths and body.split(",")[1].split(">")[0].strip() == config.dtype]
    return head + "".join(keep).rstrip().removesuffix("}  // namespace mlxflash").rstrip() + "\n\n}  // namespace mlxflash\n"


@functools.lru_cache(maxsize=None)
def _kernel(config: KernelConfig):
    header, body, inputs, outputs = kernel_source(config)
    return mx.fast.cuda_kernel(name=config.name, input_names=inputs, output_names=outputs, source=body,
                               header=header, ensure_row_contiguous=True, shared_memory=config.shared_memory)


@functools.lru_cache(maxsize=None)
def _prepare_kernel(dtype: str, head_dim: int, has_d_lse: bool):
    header, body, inputs, outputs = prepare_source(dtype, head_dim, has_d_lse)
    name = f"mlxflash_prepare_{'bf16' if 'bfloat' in dtype else 'f16'}_d{head_dim}_{int(has_d_lse)}"
    return mx.fast.cuda_kernel(name=name, input_names=inputs, output_names=outputs, source=body,
                               header=header, ensure_row_contiguous=True)


def _grid(total_blocks: int, threads: int) -> Tuple[Tuple[int, int, int], Tuple[int, int, int]]:
    """(grid in threads, threadgroup) for a 1-D block count of any size (B*H past 65535 too)."""
    gx = max(1, min(total_blocks, MAX_GRID_X_BLOCKS))
    gy = -(-total_blocks // gx)
    if gy > 65535:
        raise ValueError(f"[cuda] {total_blocks} thread blocks exceed the grid limit.")
    return (gx * threads, gy, 1), (threads, 1, 1)


def _mask_strides(spec: AttentionSpec) -> List[int]:
    """Element strides of the row-contiguous rank-4 mask, 0 along broadcast (size-1) dims."""
    if spec.mask_shape is None:
        return [0, 0, 0, 0]
    shape = spec.mask_shape
    strides, step = [0] * 4, 1
    for axis in range(3, -1, -1):
        strides[axis] = step if shape[axis] > 1 else 0
        step *= shape[axis]
    return strides


# Tuning hook for benchmarks/gpu_check.py only: None = _block_major's choice (see block_of in
# kernels/attention_common.cuh); True / False forces one order for every kernel.
BLOCK_MAJOR_OVERRIDE: Optional[bool] = None


def _block_major(spec: AttentionSpec) -> bool:
    """Whether CTAs go block-major (every head's block 0, then every head's block 1, ...) rather
    than head-major: under a causal mask blocks differ in work by up to N / block times, and
    block-major order starts every head's longest blocks first. H100, causal / non-causal time in
    an interleaved A/B (gpu_check --phases order, session 5), head-major vs block-major: forward
    D=160 0.89 vs 0.68, D=256 0.67 vs 0.58, D=512 0.61 vs 0.54, D <= 128 within 0.01; fwd+bwd
    D=64 0.71 vs 0.65, N=16K D=128 0.51 vs 0.54, elsewhere within 0.03. (A single comparison
    per row favoured whichever order was timed second, in both directions.)"""
    if BLOCK_MAJOR_OVERRIDE is not None:
        return BLOCK_MAJOR_OVERRIDE
    return spec.causal


def _int_params(spec: AttentionSpec, blocks: int, total: int) -> mx.array:
    return _int_params_array(spec, blocks, total, _block_major(spec))


# The parameter arrays are constants of (spec, launch shape): cached, so that a call does not
# create and upload new ones (part of the per-call host time, which was ~4x MLX's attention's).
@functools.lru_cache(maxsize=1024)
def _int_params_array(spec: AttentionSpec, blocks: int, total: int, block_major: bool) -> mx.array:
    # Order = enum Param in kernels/attention_common.cuh.
    left, right = spec.window if spec.window is not None else (-1, -1)
    values = [spec.batch, spec.q_heads, spec.kv_heads, spec.q_len, spec.kv_len, spec.group,
              spec.diagonal, left, right, *_mask_strides(spec), blocks, total, int(block_major)]
    return mx.array(values, dtype=mx.int64)


@functools.lru_cache(maxsize=1024)
def _float_params(spec: AttentionSpec) -> mx.array:
    return mx.array([spec.scale, spec.softcap if spec.softcap is not None else 1.0], dtype=mx.float32)


def _empty(spec: AttentionSpec) -> bool:
    return min(spec.batch, spec.q_heads, spec.q_len, spec.kv_len) == 0


def forward(q, k, v, mask, spec: AttentionSpec, sinks=None) -> Tuple[mx.array, mx.array]:
    """Returns (out [B, Hq, Nq, D] in q's dtype, lse [B, Hq, Nq] fp32, natural log, sinks included)."""
    B, Hq, Nq, D = spec.batch, spec.q_heads, spec.q_len, spec.head_dim
    if _empty(spec):
        return mx.zeros((B, Hq, Nq, D), spec.dtype), empty_lse(sinks, (B, Hq, Nq))
    config = kernel_config("forward", spec, None if mask is None else mask.dtype)
    blocks = -(-Nq // config.parallel_block)
    total = B * Hq * blocks * config.slices
    grid, group = _grid(total, config.threads)
    inputs = [q, k, v] + ([mask] if mask is not None else []) + _sinks_input(sinks) + [
        _int_params(spec, blocks, total), _float_params(spec)]
    out, lse = _kernel(config)(inputs=inputs, output_shapes=[(B, Hq, Nq, D), (B, Hq, Nq)],
                               output_dtypes=[spec.dtype, mx.float32], grid=grid, threadgroup=group)
    return out, lse


def prepare_backward(out, lse, d_out, d_lse, spec: AttentionSpec) -> Tuple[mx.array, mx.array]:
    """(delta, lse2): delta = rowsum(dO * O) - dL and lse in base 2 (+inf for rows with no key)."""
    rows = spec.batch * spec.q_heads * spec.q_len
    has_d_lse = d_lse is not None
    kernel = _prepare_kernel(_CUDA_TYPES[spec.dtype], spec.head_dim, has_d_lse)
    blocks = -(-rows // PREPARE_ROWS_PER_BLOCK)
    grid, group = _grid(blocks, 32 * PREPARE_ROWS_PER_BLOCK)
    d_lse = d_lse.astype(mx.float32) if has_d_lse else mx.zeros((1,), mx.float32)
    shape = (spec.batch, spec.q_heads, spec.q_len)
    delta, lse2 = kernel(inputs=[out, d_out, lse, d_lse, _int_params(spec, 0, blocks)],
                         output_shapes=[shape, shape], output_dtypes=[mx.float32, mx.float32],
                         grid=grid, threadgroup=group)
    return delta, lse2


def _sinks_input(sinks) -> List[mx.array]:
    return [] if sinks is None else [sinks.astype(mx.float32)]


def _backward_query(q, k, v, mask, d_out, lse2, delta, spec: AttentionSpec, sinks=None):
    """dq, or (dq, d_sinks_part [B, Hq, parts]) with sinks: one part per warp's rows (mma.sync: a row
    group, wgmma: a consumer warp's 16 rows), summed by the caller."""
    config = kernel_config("backward_query", spec, None if mask is None else mask.dtype)
    blocks = -(-spec.q_len // config.parallel_block)
    total = spec.batch * spec.q_heads * blocks * config.slices
    grid, group = _grid(total, config.threads)
    inputs = [q, k, v, d_out, lse2, delta] + ([mask] if mask is not None else []) + _sinks_input(sinks) + [
        _int_params(spec, blocks, total), _float_params(spec)]
    shapes, dtypes = [q.shape], [spec.dtype]
    if sinks is not None:
        parts = config.parallel_block // 16 if config.instruction == "wgmma" else config.row_groups
        shapes.append((spec.batch, spec.q_heads, blocks * parts))
        dtypes.append(mx.float32)
    results = _kernel(config)(inputs=inputs, output_shapes=shapes, output_dtypes=dtypes, grid=grid,
                              threadgroup=group)
    return results[0] if sinks is None else (results[0], results[1])


def _backward_key_value(q, k, v, mask, d_out, lse2, delta, spec: AttentionSpec) -> Tuple[mx.array, mx.array]:
    config = kernel_config("backward_key_value", spec, None if mask is None else mask.dtype)
    blocks = -(-spec.kv_len // config.parallel_block)
    total = spec.batch * spec.kv_heads * blocks * config.slices
    grid, group = _grid(total, config.threads)
    inputs = [q, k, v, d_out, lse2, delta] + ([mask] if mask is not None else []) + [
        _int_params(spec, blocks, total), _float_params(spec)]
    dk, dv = _kernel(config)(inputs=inputs, output_shapes=[k.shape, v.shape],
                             output_dtypes=[spec.dtype, spec.dtype], grid=grid, threadgroup=group)
    return dk, dv


def backward_query(q, k, v, mask, out, lse, d_out, d_lse, spec: AttentionSpec) -> mx.array:
    """dQ alone (preprocessing + the dQ kernel), for timing the kernels separately."""
    if _empty(spec):
        return mx.zeros_like(q)
    delta, lse2 = prepare_backward(out, lse, d_out, d_lse, spec)
    return _backward_query(q, k, v, mask, d_out, lse2, delta, spec)


def backward_key_value(q, k, v, mask, out, lse, d_out, d_lse, spec: AttentionSpec) -> Tuple[mx.array, mx.array]:
    """(dK, dV) alone (preprocessing + the dK/dV kernel), for timing the kernels separately."""
    if _empty(spec):
        return mx.zeros_like(k), mx.zeros_like(v)
    delta, lse2 = prepare_backward(out, lse, d_out, d_lse, spec)
    return _backward_key_value(q, k, v, mask, d_out, lse2, delta, spec)


def backward(q, k, v, mask, out, lse, d_out, d_lse, spec: AttentionSpec, sinks=None):
    """Returns (dq, dk, dv, d_sinks) in the input dtype. d_lse (or None) is the cotangent of lse.

    d_sinks (None without sinks) is fused into the dQ kernel: per-warp parts, summed here in a
    fixed order (deterministic, no atomics)."""
    if _empty(spec):
        d_sinks = None if sinks is None else sinks_gradient(sinks, lse, row_term(out, d_out, d_lse))
        return mx.zeros_like(q), mx.zeros_like(k), mx.zeros_like(v), d_sinks
    delta, lse2 = prepare_backward(out, lse, d_out, d_lse, spec)
    dq = _backward_query(q, k, v, mask, d_out, lse2, delta, spec, sinks)
    d_sinks = None
    if sinks is not None:
        dq, parts = dq
        d_sinks = parts.sum(axis=(0, 2)).astype(sinks.dtype)
    dk, dv = _backward_key_value(q, k, v, mask, d_out, lse2, delta, spec)
    return dq, dk, dv, d_sinks


def cuda_available() -> bool:
    return hasattr(mx, "cuda") and mx.cuda.is_available()


class CUDABackend:
    """Backend protocol implementation for the CUDA kernels."""

    name = "cuda"

    def unavailable_reason(self, device) -> Optional[str]:
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
        return None

    forward = staticmethod(forward)
    backward = staticmethod(backward)
    backward_query = staticmethod(backward_query)
    backward_key_value = staticmethod(backward_key_value)


BACKEND = CUDABackend()

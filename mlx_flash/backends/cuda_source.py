"""Plan -> CUDA source for the attention kernels: GPU families, tuning, variants and their text.

The chain, as in metal_source.py: a call's spec and the GPU family (kernels/families_cuda.txt)
give a block plan (kernels/blocks_cuda.txt through mlx_flash.planner); the plan, the call's
compile-time features and the `Tuning` value make a `KernelVariant` (frozen: the compile-cache
key); `source(variant)` renders kernels/attention_*.cu with the variant's constants.

Kernels: forward (O, L), a per-row preprocessing step for the backward (delta = rowsum(dO * O)
- dL, L in base 2), dQ, and dK/dV. On sm_90 all three are warp-specialized warpgroup-MMA kernels
at any head_dim (kernels/attention_*_wgmma.cu, rows of family "sm90_wgmma"; past 256 their
outputs in column slices or groups); elsewhere mma.sync kernels (the family's own rows).
A plan that breaks its family's limits is an error, never shrunk at run time: each family's rows
are chosen for its shared memory (tests/test_plans.py checks every head dim 1..512).
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import FrozenSet, List, Mapping, NamedTuple, Optional, Tuple

import mlx.core as mx

from .. import planner
from ..render import render, template_text
from ..spec import AttentionSpec
from . import tensor_map
from .common import MASK_KINDS, STRIDED_INPUTS, VariantFeatures, VariantSet, cached_hash as _cached_hash

MAX_HEAD_DIM = 512
DEFAULT_WARPS = 4  # warps per CTA where the table row's warps column is '-'
PREPARE_THREADS = 256  # THREADS of kernels/attention_backward_prepare.cu


def prepare_lanes(head_dim: int) -> int:
    """Threads per query row of the backward preprocessing kernel (its LANES): the row's 8-element
    chunks rounded up to a power of two, at most a warp."""
    lanes = 1
    while lanes < 32 and lanes * 8 < head_dim:
        lanes *= 2
    return lanes


def prepare_rows_per_block(head_dim: int) -> int:
    """Query rows per thread block of the backward preprocessing kernel (its ROWS_PER_BLOCK)."""
    return PREPARE_THREADS // prepare_lanes(head_dim)


CUDA_TYPES = MappingProxyType({mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float",
                               mx.bool_: "bool"})
HEADER = "attention_common.cuh"
TEMPLATES = MappingProxyType({"forward": "attention_forward.cu", "backward_query": "attention_backward_query.cu",
                              "backward_key_value": "attention_backward_key_value.cu"})
WGMMA_TEMPLATES = MappingProxyType({"forward": "attention_forward_wgmma.cu",
                                    "backward_query": "attention_backward_query_wgmma.cu",
                                    "backward_key_value": "attention_backward_key_value_wgmma.cu"})
# wgmma kernels: P = 64 rows per consumer warpgroup of 4 warps, plus a producer warpgroup. The O /
# dQ / dK / dV tile is wgmma's N, at most 256 columns: past that the forward's and the dQ
# kernel's two warpgroups share 64 rows and hold half of D each (column groups, P = 64), and the
# dK/dV kernel's column groups (below) run in CTA slices. dK/dV: the dK and dV accumulators of a
# 64-row warpgroup hold D / 2 floats each per thread, which beside the score tiles fit the
# consumers' 232 registers up to D = 160 (WGMMA_WHOLE_MAX_COLUMNS); past the row's H the kernel
# splits D into 128-column parts (WGMMA_SLICE_WIDTH), one CTA each (slices) or one warpgroup each
# (column groups).
WGMMA_MAX_COLUMNS = 256
WGMMA_SLICE_WIDTH = 128
WGMMA_WHOLE_MAX_COLUMNS = 160
WGMMA_STAGES = 2  # STAGES in the wgmma templates (K / V or Q / dO buffers of the producer's ring)
# A CTA's two tensor maps in shared memory (KeyValueRing; MAP_BYTES in dK/dV): the size of its global slot.
WGMMA_MAP_BYTES = tensor_map.SLOT_BYTES
# The block table's options column (CUDA): consumer warpgroups take turns issuing MMAs
# (FlashAttention-3's scheduler barriers), on the wgmma forward's rows up to D = 128.
PINGPONG = "pingpong"
# ... and masked_t<N> / window_t<N> / softcap_t<N>: the row's T for calls with an array mask (bool
# or additive) / a sliding window / a logit softcap on a wgmma row, where the row's own T spills
# with the mask's loads, the window's bounds or the softcap's tanh and is slower (blocks_cuda.txt
# says where). A call with several takes the smallest.
MASKED_KEYS = "masked_t"
WINDOW_KEYS = "window_t"
SOFTCAP_KEYS = "softcap_t"
# ... and fused_dq_from<N> / fused_dq_causal_from<N>: for calls of at least N queries without an
# array mask, a window or sinks, non-causal / causal, the wgmma dK/dV kernel accumulates dQ too (5
# products a step for the backward instead of 7; kernels/attention_backward_key_value_wgmma.cu,
# FUSED_DQ), where it can: one 64 x 64 unit of the T x D dQ tile per warpgroup (D <= 64 at T = 128,
# D = 65..128 at T = 64). The dQ kernel then does not run. By length because on an H100 it was
# slower than the two kernels at short N and faster at long N, with the same CTA count
# (blocks_cuda.txt has the numbers).
FUSED_QUERY = "fused_dq_from"
FUSED_QUERY_CAUSAL = "fused_dq_causal_from"
# ... and t<T>_from<N>: the wgmma forward's T for calls of at least N keys (a CTA's walk of N / T
# steps is then long enough that a wider step pays: fewer steps' waits and barriers per key; at
# N = 4096 it did not), for calls without an array mask, a window or softcap (plain_scores).
# H200: D = 128 at T = 176 against 128, forward time 0.970x at B=2 N=8192, 0.983x at N=16384
# (blocks_cuda.txt has the numbers).
LONG_KEYS = re.compile(r"t(\d+)_from(\d+)")
# ... and scale_fold: the wgmma forward's interior tiles without an array mask or softcap fold the
# scale into exp2's FFMA where it is positive (kernels/attention_common.cuh, FOLD: one instruction
# per score fewer). On the rows up to D = 256: 0.914x (D = 64) to 0.984x (D = 192) the forward time
# on an H200 (blocks_cuda.txt has the numbers).
SCALE_FOLD = "scale_fold"
# ... and mma_sums: the wgmma forward at D = 49..64 (one 64-column V panel) has the tensor cores sum
# each row's P for calls without an array mask, window or softcap (plain_scores): O += P [V | 1]
# with N = 72, the ones in a panel beside each V stage (kernels/attention_forward_wgmma.cu,
# MMA_SUMS: one FADD per score fewer in the softmax). H200: 0.990x the forward time on average over
# 12 A/B readings, 0.961-1.009x (blocks_cuda.txt has the numbers).
MMA_SUMS = "mma_sums"
# ... and roles: past D = 256 the wgmma dK/dV kernel's two CTAs of a key block split by role for
# calls without a causal mask or window, one computing dV (S^T over half of D per warpgroup,
# added), the other dK (S^T and dP^T), instead of by columns (each recomputing S^T and dP^T):
# 5 products' work for 6 at D = 512 (kernels/attention_backward_key_value_wgmma.cu, ROLES). H200:
# 0.968x the fwd+bwd time at D = 512, 0.979x at D = 448, none faster at D <= 384 or causal
# (blocks_cuda.txt has the numbers).
ROLES = "roles"
# ... and head_splits_to<W> / head_splits_causal_to<W> / head_splits_fused_causal_to<W>: a dK/dV
# row's CTAs (one per key block, kv head and column slice) each sum a kv head's whole query-head
# group; where a GQA call has too few of them for the GPU's SMs (B=1 Hkv=4 N=2048 is 64 CTAs at
# P = 128 on 132 SMs), the group is split over as many CTAs of a key block as fit W waves of them
# (head_splits), each writing fp32 parts that one more kernel adds in order (HEAD_SPLIT); the
# second option in the first's place for causal calls, the third for the causal fused dQ's
# (blocks_cuda.txt has the numbers).
HEAD_SPLITS = "head_splits_to"
HEAD_SPLITS_CAUSAL = "head_splits_causal_to"
HEAD_SPLITS_FUSED_CAUSAL = "head_splits_fused_causal_to"


def fused_query_option(spec: AttentionSpec) -> Optional[str]:
    """The row option whose N turns the fused dQ on for calls like `spec`: none with an array mask
    (not measured); windows and sinks cannot take it (fused_query_fits)."""
    if spec.mask_kind != "none":
        return None
    return FUSED_QUERY_CAUSAL if spec.causal else FUSED_QUERY


def option_keys(options, prefix: str, where: str) -> Optional[int]:
    """The N of a <prefix><N> option (masked_t64, window_t64, fused_dq_from8192) among a row's
    options, None without one."""
    found = [o for o in options if o.startswith(prefix)]
    if not found:
        return None
    text = found[0][len(prefix):]
    if len(found) > 1 or not text.isdigit():
        raise ValueError(f"[cuda] blocks_cuda.txt: {where} has options {sorted(options)}: at most one "
                         f"{prefix}<N> with N a number (e.g. {prefix}64).")
    return int(text)


def long_keys_option(options, where: str) -> Optional[Tuple[int, int]]:
    """(T, N) of a t<T>_from<N> option (t176_from8192) among a row's options, None without one."""
    found = [o for o in options if LONG_KEYS.fullmatch(o)]
    if len(found) > 1:
        raise ValueError(f"[cuda] blocks_cuda.txt: {where} has options {sorted(options)}: at most one "
                         f"t<T>_from<N> (e.g. t176_from8192).")
    if not found:
        return None
    t, n = LONG_KEYS.fullmatch(found[0]).groups()
    return int(t), int(n)


def plain_scores(spec: AttentionSpec) -> bool:
    """Whether a call's scores take no array mask, window or softcap: the calls the forward's
    t<T>_from<N> and mma_sums were measured on and take (at D = 128 and T = 176 a window spills 20
    bytes, softcap 272, nvcc 13.0; mma_sums forced with an array mask was slower)."""
    return spec.mask_kind == "none" and spec.window is None and spec.softcap is None


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# ----------------------------------------------------------------------------------- families
@dataclass(frozen=True)
class Family:
    """One row of kernels/families_cuda.txt.

    Attributes:
        name: e.g. "sm80"; the block table's rows of this family carry the name (and
            "<name>_wgmma" for the warpgroup-MMA kernels).
        capabilities: compute capabilities (10 * major + minor) in the family.
        shared_memory: opt-in dynamic shared memory per block, bytes.
        threads: most threads per block.
        wgmma: whether the warpgroup-MMA kernels exist for the family.
        gpus: examples, for people.
    """

    name: str
    capabilities: FrozenSet[int]
    shared_memory: int
    threads: int
    wgmma: bool
    gpus: str

    def __hash__(self) -> int:  # computed once: part of the variant-set cache's key on every call
        return _cached_hash(self)


@functools.lru_cache(maxsize=None)
def families() -> Tuple[Family, ...]:
    """The families of kernels/families_cuda.txt, in table order."""
    rows = []
    for number, line in enumerate(template_text("families_cuda.txt").splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split(None, 5)
        if len(fields) != 6 or fields[4] not in ("yes", "no"):
            raise ValueError(f"families_cuda.txt line {number}: expected 'family capabilities shared_memory "
                             f"threads yes|no GPUs', got {line!r}")
        name, capabilities, memory, threads, wgmma, gpus = fields
        rows.append(Family(name, frozenset(int(c) for c in capabilities.split(",")), int(memory), int(threads),
                           wgmma == "yes", gpus))
    return tuple(rows)


@functools.lru_cache(maxsize=None)
def family_of(capability: Optional[int]) -> Optional[Family]:
    """The family of a compute capability (e.g. 86 -> sm86), None where no family has it."""
    return next((f for f in families() if capability in f.capabilities), None)


def family_named(name: str) -> Family:
    """The family called `name` (ValueError naming the known ones otherwise)."""
    found = next((f for f in families() if f.name == name), None)
    if found is None:
        raise ValueError(f"[cuda] family must be one of {[f.name for f in families()]}, got {name!r}.")
    return found


# ------------------------------------------------------------------------------------- tuning
@dataclass(frozen=True)
class Tuning:
    """Every knob the exploration tools turn, as one value; part of each variant's cache key.

    The default, Tuning(), is the block table's choice everywhere.

    Attributes:
        blocks: {kernel: (P, T, H[, warps])} replacing the table's row at every head dim; a
            kernel name with the suffix "_wgmma" replaces the warpgroup-MMA kernel's row. Given
            as a dict, kept as a sorted tuple of pairs (hashable).
        wgmma_forward: None = the wgmma forward where the family has it and the GPU is a real
            sm_90; False = mma.sync everywhere; True = wgmma wherever a row covers D, whatever the
            GPU (rendering and nvcc resource checks on any machine).
        wgmma_backward: the same for the dQ and dK/dV kernels.
        pingpong: None = the table's options column; True / False forces the wgmma forward's
            consumer warpgroups to take turns issuing MMAs, or not.
        block_major: None = block-major CTA order under causal masks (head-major otherwise);
            True / False forces one order (see `block_major`).
        fused_query: None = the table's options column (by the call's length); True / False
            forces the wgmma dK/dV kernel to accumulate dQ (where it can: see FUSED_QUERY), or not.
        scale_fold: None = the table's options column; True / False forces the wgmma forward's
            scale fold (where it applies: see SCALE_FOLD), or not.
        mma_sums: None = the table's options column; True / False forces the wgmma forward's row
            sums by the tensor cores (where it applies: see MMA_SUMS), or not.
        roles: None = the table's options column; True / False forces the wgmma dK/dV kernel's
            split by role past D = 256 (where it applies: see ROLES), or the split by columns.
        head_splits: None = the table's options column (head_splits_to<W>, see head_splits, on a
            GPU whose SM count is known); 1 = never split a kv head's query-head group over dK/dV
            CTAs; n >= 2 = split every GQA call's group over min(n, group) CTAs.
        table: the planner.Table every kernel is planned from (the tuner's candidates); None =
            planner.active_table (this GPU's tuned table when one matches, else the shipped one).
        poison_released: a check for tests, never for speed, of the wgmma kernels' releases of
            their ring's tiles: each consumer thread keeps a ledger of the tiles its pending
            wgmma groups read and turns its results into NaN where it releases one of them
            (whatever the timing), and the producers overwrite every released tile with NaN
            before refilling it (ReadLedger and POISON_RELEASED in wgmma_common.cuh); the
            outputs must be bitwise those of the kernels without it.
    """

    blocks: Tuple[Tuple[str, Tuple[int, ...]], ...] = field(default=())
    wgmma_forward: Optional[bool] = None
    wgmma_backward: Optional[bool] = None
    pingpong: Optional[bool] = None
    block_major: Optional[bool] = None
    fused_query: Optional[bool] = None
    scale_fold: Optional[bool] = None
    mma_sums: Optional[bool] = None
    roles: Optional[bool] = None
    head_splits: Optional[int] = None
    table: Optional[planner.Table] = None
    poison_released: bool = False

    def __post_init__(self):
        if not isinstance(self.poison_released, bool):
            raise TypeError(f"[cuda] Tuning.poison_released must be a bool, got {self.poison_released!r}.")
        if self.head_splits is not None and (isinstance(self.head_splits, bool) or not isinstance(self.head_splits, int)
                                             or self.head_splits < 1):
            raise ValueError(f"[cuda] Tuning.head_splits must be None or an int >= 1, got {self.head_splits!r}.")
        blocks = dict(self.blocks) if isinstance(self.blocks, (Mapping, tuple, list)) else None
        if blocks is None:
            raise TypeError(f"[cuda] Tuning.blocks must be a dict {{kernel: (P, T, H[, warps])}}, got {self.blocks!r}.")
        for name, shape in blocks.items():
            if name.removesuffix("_wgmma") not in planner.KERNELS or not 3 <= len(shape) <= 4:
                raise ValueError(f"[cuda] Tuning.blocks: {name!r}: {shape!r} must name a kernel of "
                                 f"{planner.KERNELS} (optionally + '_wgmma') with (P, T, H[, warps]).")
        object.__setattr__(self, "blocks", tuple(sorted((k, tuple(v)) for k, v in blocks.items())))

    def __hash__(self) -> int:  # computed once: part of the variant-set cache's key on every call
        return _cached_hash(self)

    def block_override(self, name: str) -> Optional[Tuple[int, ...]]:
        return dict(self.blocks).get(name)

    def wgmma_override(self, kernel: str) -> Optional[bool]:
        return self.wgmma_forward if kernel == "forward" else self.wgmma_backward


def block_major(spec: AttentionSpec, tuning: Tuning) -> bool:
    """Whether CTAs go block-major (every head's block 0, then every head's block 1, ...) rather
    than head-major: under a causal mask blocks differ in work by up to N / block times, and
    block-major order starts every head's longest blocks first. H100, causal / non-causal time in
    an interleaved A/B, head-major vs block-major: forward D=160 0.89 vs 0.68, D=256 0.67 vs 0.58,
    D=512 0.61 vs 0.54, D <= 128 within 0.01; fwd+bwd D=64 0.71 vs 0.65, N=16K D=128 0.51 vs
    0.54, elsewhere within 0.03. (A single comparison per row favoured whichever order was timed
    second, in both directions.)

    The dK/dV kernel with fused dQ keeps this order too: block-major order made it 1.35x slower
    without a mask at B=4 N=4096 D=128 (its CTAs then stream 64 heads' Q and dO at once) and no
    faster at N=16384 (results/h100_cuda_bf16_vs_mlx_fa2_cudnn.json, "dkdv_fused_dq_writer")."""
    return spec.causal if tuning.block_major is None else tuning.block_major


# ----------------------------------------------------------------------------------- variants
@dataclass(frozen=True)
class KernelVariant:
    """Compile-time constants of one attention kernel (hashable: the kernel cache key).

    Attributes:
        kernel: "forward", "backward_query" or "backward_key_value".
        family: the GPU family whose rows planned it (e.g. "sm86").
        instruction: "mma.sync" (sm_80+) or "wgmma" (sm_90: one consumer warpgroup per 64 rows,
            m_tiles = 1, warps = 4 * consumer warpgroups, plus a producer warpgroup).
        input_type: CUDA element type of q, k, v ("__half" or "__nv_bfloat16").
        head_dim: D. padded_dim: D rounded up to 16 (the QK^T / dO V^T contraction).
        head_block: output columns per warp (mma.sync) or per warpgroup (wgmma), a multiple of 16.
        col_groups: warps (warpgroups) of one CTA side by side along the output columns; the CTA
            covers col_groups * head_block columns. slices: CTAs per parallel block.
        warps: warps per CTA (row groups = warps / col_groups), producer not counted.
        m_tiles: 16-row m-tiles per warp (parallel block = 16 * m_tiles * row groups).
        traversal_block: keys (forward, dQ) or queries (dK/dV) streamed per step.
        causal, window, softcap: which index masks / transforms are compiled in.
        mask_kind: 0 none, 1 bool, 2 additive; mask_type: CUDA type of the mask elements.
        pingpong: wgmma forward: the consumer warpgroups take turns issuing their MMAs.
        fused_query: wgmma dK/dV: the kernel accumulates dQ as well (FUSED_QUERY); the dQ kernel
            does not run.
        scale_fold: wgmma forward without an array mask or softcap: interior tiles fold a positive
            scale into exp2's FFMA (SCALE_FOLD).
        mma_sums: wgmma forward at D = 49..64: the tensor cores sum P's rows (MMA_SUMS).
        roles: wgmma dK/dV past D = 256: the key block's two CTAs compute dV and dK (ROLES), not a
            column slice of both each.
        head_split: dK/dV: CTAs share a kv head's query-head group (P_SPLITS of them at run time,
            head_splits) and write fp32 parts of dK and dV, which the parts kernel adds (HEAD_SPLIT).
        sinks: attention sinks compiled in (forward and dQ kernels; dK/dV needs none: the
            forward's lse includes them).
        tuning: the Tuning value it was planned with (part of the key).
    """

    kernel: str
    family: str
    instruction: str
    input_type: str
    head_dim: int
    padded_dim: int
    head_block: int
    slices: int
    m_tiles: int
    traversal_block: int
    causal: bool
    window: bool
    softcap: bool
    mask_kind: int
    mask_type: str
    warps: int = DEFAULT_WARPS
    col_groups: int = 1
    pingpong: bool = False
    sinks: bool = False
    fused_query: bool = False
    scale_fold: bool = False
    mma_sums: bool = False
    roles: bool = False
    head_split: bool = False
    tuning: Tuning = Tuning()

    def __hash__(self) -> int:  # computed once: variants key the compile cache on every launch
        return _cached_hash(self)

    # The launch geometry is read on every launch: computed once per variant (cached_property writes
    # the instance's __dict__, which a frozen dataclass allows; not fields, so not in == or hash).
    @functools.cached_property
    def row_groups(self) -> int:
        return self.warps // self.col_groups

    @functools.cached_property
    def threads(self) -> int:
        return 32 * self.warps + (128 if self.instruction == "wgmma" else 0)  # + the producer warpgroup

    @functools.cached_property
    def parallel_block(self) -> int:
        return 16 * self.m_tiles * self.row_groups

    @property
    def poison_released(self) -> bool:
        """Tuning.poison_released's check compiled in (the wgmma kernels only)."""
        return self.instruction == "wgmma" and self.tuning.poison_released

    @property
    def staged_dim(self) -> int:
        """Columns of each shared-memory tile in the backward kernels (every slice fits)."""
        return self.slices * self.col_groups * self.head_block

    @property
    def shared_memory(self) -> int:
        """Bytes of dynamic shared memory (the templates' SMEM_BYTES; they static_assert it)."""
        bm, bn, cg = self.parallel_block, self.traversal_block, self.col_groups
        if self.instruction == "wgmma":  # swizzled 64-column panels (128 B rows), 1 KB alignment, mbarriers
            row, stages = -(-self.padded_dim // 64) * 128, WGMMA_STAGES
            ring = WGMMA_MAP_BYTES + 32 * stages  # K / V tensor maps and mbarriers (KeyValueRing)
            if self.kernel == "forward":  # Q; K and V rings (column groups: panels of both, S's parts swapped)
                tile_row = max(row, cg * self.head_block * 2)
                ones = stages * bn * 128 if self.mma_sums else 0  # a panel of ones per V stage
                return 1024 + tile_row * (bm + 2 * stages * bn) + ones + (1024 * bn if cg == 2 else 0) + ring
            if self.kernel == "backward_query":  # Q and dO; K and V rings (column groups: panels of both, a swap)
                tile_row = max(row, cg * self.head_block * 2)
                return 1024 + row * 2 * bm + tile_row * 2 * stages * bn + (1024 * bn if cg == 2 else 0) + ring
            # K and V; Q, dO (whole 128-column slices), lse2 and delta ring; column groups' swap
            tile_row = row if self.slices == 1 and cg == 1 else self.slices * cg * self.head_block * 2
            swap = 512 * bn * (2 if bn <= 32 else 1) if cg == 2 else 0  # S^T / dP^T, SWAP_BUFFERS
            fused = 2 * bn * 256 + bn * row * 2 + 48 if self.fused_query else 0  # dS tiles, dQ staging, 6 mbarriers
            return (1024 + row * 2 * bm + 2 * stages * bn * tile_row + swap + fused + WGMMA_MAP_BYTES
                    + stages * (8 * bn + 24))
        if self.kernel == "forward":
            row = self.padded_dim + 8
            return (bm * row + 2 * bn * row + 2 * bn * (cg * self.head_block + 8)) * 2
        row = self.staged_dim + 8
        shared_scores = bm * (bn + 8) if cg > 1 else 0  # P^T and dS^T (dK/dV) or dS (dQ) tiles
        if self.kernel == "backward_query":
            return (2 * bm * row + 4 * bn * row + shared_scores) * 2
        return (2 * bm * row + 4 * bn * row + 2 * shared_scores) * 2 + 4 * bn * 4

    @property
    def tensor_maps(self) -> bool:
        """Whether the kernel loads its streamed tiles with TMA where their rows allow (the wgmma
        kernels: K and V, or the dK/dV kernel's Q and dO): it then takes a tensor-map template and
        a scratch output for its maps."""
        return self.instruction == "wgmma"

    @property
    def tensor_map_rank(self) -> int:
        """The maps' rank: 3 where one map spans a group's query heads (dK/dV), else 2."""
        return 3 if self.kernel == "backward_key_value" else 2

    @property
    def name(self) -> str:
        flags = "".join(c for c, on in (("c", self.causal), ("w", self.window), ("s", self.softcap),
                                         ("p", self.pingpong), ("k", self.sinks), ("q", self.fused_query),
                                         ("f", self.scale_fold), ("l", self.mma_sums), ("r", self.roles),
                                         ("h", self.head_split), ("z", self.poison_released)) if on)
        kernel = self.kernel + ("_wgmma" if self.instruction == "wgmma" else "")
        return (f"mlxflash_{kernel}_{'bf16' if 'bfloat' in self.input_type else 'f16'}_d{self.head_dim}"
                f"_h{self.head_block}_w{self.warps}g{self.col_groups}_m{self.m_tiles}_n{self.traversal_block}"
                f"_k{self.mask_kind}{self.mask_type.replace('__', '').replace('nv_', '')}_{flags or 'x'}")

    def constants(self) -> dict:
        """The template's {{name}} values."""
        values = dict(input_type=self.input_type, mask_type=self.mask_type, head_dim=self.head_dim,
                      padded_dim=self.padded_dim, traversal_block=self.traversal_block, causal=self.causal,
                      window=self.window, softcap=self.softcap, mask_kind=self.mask_kind)
        if self.kernel != "backward_key_value":
            values["sinks"] = self.sinks
        else:
            values.update(head_split=self.head_split, gradient_type="float" if self.head_split else self.input_type)
        if self.instruction == "wgmma":
            values.update(consumer_groups=self.warps // 4, shared_memory=self.shared_memory,
                          poison_released=self.poison_released)
            if self.kernel == "forward":
                values.update(pingpong=self.pingpong, head_block=self.head_block, col_groups=self.col_groups,
                              scale_fold=self.scale_fold, mma_sums=self.mma_sums)
            if self.kernel == "backward_key_value":
                values.update(slices=self.slices, head_block=self.head_block, col_groups=self.col_groups,
                              fused_query=self.fused_query, chains=fused_chains(self), roles=self.roles)
            if self.kernel == "backward_query":
                values.update(head_block=self.head_block, col_groups=self.col_groups)
            return values
        values.update(head_block=self.head_block, slices=self.slices, m_tiles=self.m_tiles,
                      row_groups=self.row_groups, col_groups=self.col_groups)
        if self.kernel != "forward":
            values["staged_dim"] = self.staged_dim
        return values


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


def wgmma_covers(kernel: str, head_dim: int, family: Family) -> bool:
    """Whether the family's wgmma rows cover `kernel` at head_dim (their last max_d; past wgmma's N
    the kernels split their outputs into column slices or groups)."""
    if not family.wgmma:
        return False
    rows = [r for r in planner.load_table("cuda") if r.kernel == kernel and r.family == family.name + "_wgmma"]
    return bool(rows) and head_dim <= max(r.max_head_dim for r in rows)


def uses_wgmma(kernel: str, head_dim: int, family: Family, tuning: Tuning, real_sm90: bool) -> bool:
    """Whether `kernel` runs its warpgroup-MMA version: the family has it at this head dim and
    either the GPU is a real sm_90 (wgmma is sm_90a; Blackwell dropped it) or the tuning forces it."""
    override = tuning.wgmma_override(kernel)
    if override is False or not wgmma_covers(kernel, head_dim, family):
        return False
    return bool(override) or real_sm90


# Cached: working the table out took 8 us of the call's ~50 us host time (CI machine, D=64).
@functools.lru_cache(maxsize=4096)
def make_variant(kernel: str, spec: AttentionSpec, mask_dtype: Optional[mx.Dtype], family: Family,
                 tuning: Tuning = Tuning(), real_sm90: bool = False,
                 table: Optional[planner.Table] = None, long_queries: bool = False,
                 long_keys: bool = False) -> KernelVariant:
    """The variant serving `spec` with `kernel` on `family`.

    Args:
        kernel: one of planner.KERNELS.
        spec: the call (fp16 / bf16, head_dim 1..512).
        mask_dtype: the array mask's dtype, None without one.
        family: the GPU family (family_of(capability)).
        tuning: overrides of the table's choices.
        real_sm90: the GPU is an sm_90 (the wgmma kernels may run).
        table: the planner.Table to plan from (tuning.table when given); None = the active one.
            Part of the cache key, so a table tuned in this process takes effect at once.
        long_queries: the call has at least the dK/dV row's fused_dq_from<N> queries (see
            fused_query_from; spec's own q_len is not read: variant sets are planned per features).
        long_keys: the call has at least the forward row's t<T>_from<N> keys (see
            forward_long_from; spec's kv_len is not read either).

    Raises:
        ValueError: a table row (or a tuning override) that the kernels cannot take or that
            breaks the family's shared memory / thread limits.
    """
    if uses_wgmma(kernel, spec.head_dim, family, tuning, real_sm90):
        variant = _wgmma_variant(kernel, spec, mask_dtype, family, tuning, tuning.table or table, long_queries,
                                 long_keys)
    else:
        variant = _mma_variant(kernel, spec, mask_dtype, family, tuning, tuning.table or table)
    if spec.has_sinks and kernel != "backward_key_value":  # dK/dV: the forward's lse includes the sinks
        variant = replace(variant, sinks=True)
    check_limits(variant, family)
    return variant


# Made once per key: the three variants are a pure function of these arguments (a tuned table is
# part of the key by value, so a table tuned in this process gives new variants at once), and
# working them out again for the guard's key and for each launch was the largest part of a call's
# host time. benchmarks/host_time.py (kernels stubbed, 2-core CI machine, us per call, before ->
# after this cache and the launch constants keyed by ints): forward 85 -> 60, forward + backward
# 149 -> 112 (decode B=1 Hq=32 D=128; prefill N=256 D=64 alike); flash_attention's own path with a
# backend that does nothing costs 21 / 38, MLX's attention 5 / 20.
@functools.lru_cache(maxsize=1024)
def variant_set(features: VariantFeatures, mask_dtype: Optional[mx.Dtype], family: Family, tuning: Tuning,
                real_sm90: bool, table: planner.Table, long_queries: bool = False,
                long_keys: bool = False) -> VariantSet:
    """The forward, dQ and dK/dV variants of every call with `features` (and long_queries,
    long_keys: see make_variant, fused_query_from, forward_long_from); one object per key, made once.

    Args:
        table: the table to plan from, resolved by the caller (CUDABackend.table): a None here would
            cache whichever table was active at the first call.

    Raises:
        ValueError: as make_variant (not cached: every call with these arguments raises again).
    """
    if not isinstance(table, planner.Table):
        raise TypeError(f"[cuda] variant_set needs a planner.Table, got {table!r}.")
    spec = features.spec()
    return VariantSet(*(make_variant(kernel, spec, mask_dtype, family, tuning, real_sm90, table, long_queries,
                                     long_keys)
                        for kernel in planner.KERNELS))


class LengthSets(NamedTuple):
    """The variant sets of one features key: `short`, and from `from_queries` queries on `long`
    (None where the length changes nothing); each with a twin whose dK/dV variant splits the
    query-head group (head_split), for the GQA calls that head_splits splits (`sm_count`: the
    GPU's SMs, `waves` / `long_waves`: the dK/dV row's W for the short / long set (see
    length_sets), `forced`: Tuning.head_splits; twins None where none applies). From
    `forward_from` keys (None where the length changes nothing) the calls take `long_keys`
    instead: the same four sets (short, long, short_split, long_split) with the forward row's
    t<T>_from<N> forward."""

    short: VariantSet
    from_queries: Optional[int]
    long: Optional[VariantSet]
    sm_count: Optional[int] = None
    waves: Optional[int] = None
    long_waves: Optional[int] = None
    forced: Optional[int] = None
    short_split: Optional[VariantSet] = None
    long_split: Optional[VariantSet] = None
    forward_from: Optional[int] = None
    long_keys: Optional[Tuple[Optional[VariantSet], ...]] = None

    def is_long(self, spec: AttentionSpec) -> bool:
        return self.from_queries is not None and spec.q_len >= self.from_queries

    def splits(self, spec: AttentionSpec) -> int:
        """How many CTAs share each kv head's query-head group in this call's dK/dV kernel."""
        if self.short_split is None or spec.group <= 1:
            return 1
        long = self.is_long(spec)
        kv = (self.long if long else self.short).backward_key_value
        return head_splits(spec.batch, spec.kv_heads, spec.group, spec.kv_len, kv.parallel_block, kv.slices,
                           self.sm_count, self.long_waves if long else self.waves, self.forced)

    def pick(self, spec: AttentionSpec) -> VariantSet:
        long, split = self.is_long(spec), self.splits(spec) > 1
        if self.forward_from is not None and spec.kv_len >= self.forward_from:
            return self.long_keys[2 * split + long]
        if split:
            return self.long_split if long else self.short_split
        return self.long if long else self.short


def length_sets(features: VariantFeatures, mask_dtype: Optional[mx.Dtype], family: Family, tuning: Tuning,
                real_sm90: bool, table: planner.Table, sm_count: Optional[int] = None) -> LengthSets:
    """variant_set's sets of calls with `features` below and from fused_query_from's length, and
    their head-split twins where the tuning splits heads or the dK/dV row has head_splits_to<W>
    (head_splits_causal_to<W> in its place for causal calls, head_splits_fused_causal_to<W> for
    the causal fused dQ's long set) and the GPU's SM count (`sm_count`) is known; each again
    with the forward of forward_long_from's keys on, where it applies."""
    sets = _length_sets(features, mask_dtype, family, tuning, real_sm90, table, sm_count)
    keys_from = forward_long_from(features, mask_dtype, family, tuning, real_sm90, table)
    if keys_from is None:
        return sets
    wide = _length_sets(features, mask_dtype, family, tuning, real_sm90, table, sm_count, long_keys=True)
    return sets._replace(forward_from=keys_from,
                         long_keys=(wide.short, wide.long, wide.short_split, wide.long_split))


def _length_sets(features: VariantFeatures, mask_dtype: Optional[mx.Dtype], family: Family, tuning: Tuning,
                 real_sm90: bool, table: planner.Table, sm_count: Optional[int] = None,
                 long_keys: bool = False) -> LengthSets:
    short = variant_set(features, mask_dtype, family, tuning, real_sm90, table, False, long_keys)
    start = fused_query_from(features, mask_dtype, family, tuning, real_sm90, table)
    long = None if start is None else variant_set(features, mask_dtype, family, tuning, real_sm90, table, True,
                                                  long_keys)
    kv = short.backward_key_value
    where = f"the {kv.family} backward_key_value at head_dim={features.head_dim}"
    options = planner.plan("cuda", "backward_key_value", features.head_dim, features.dtype, kv.family,
                           tuning.table or table).cached
    waves = option_keys(options, HEAD_SPLITS, where)
    if features.causal:
        waves = option_keys(options, HEAD_SPLITS_CAUSAL, where) or waves
    long_waves = waves
    if features.causal and long is not None and long.backward_key_value.fused_query:
        long_waves = option_keys(options, HEAD_SPLITS_FUSED_CAUSAL, where) or waves
    forced = tuning.head_splits
    if forced == 1 or (forced is None and (sm_count is None or (waves is None and long_waves is None))):
        return LengthSets(short, start, long)

    def twin(variants: Optional[VariantSet]) -> Optional[VariantSet]:
        if variants is None:
            return None
        return VariantSet(variants.forward, variants.backward_query,
                          replace(variants.backward_key_value, head_split=True))

    return LengthSets(short, start, long, sm_count, waves, long_waves, forced, twin(short), twin(long))


def split_shares(group: int, splits: int) -> Tuple[int, ...]:
    """Query heads of each of `splits` CTAs sharing a kv head's `group` (HEAD_SPLIT in the dK/dV
    kernels, which take the same shares): group // splits each, the first group % splits one more."""
    per, extra = divmod(group, splits)
    return tuple(per + (i < extra) for i in range(splits))


@functools.lru_cache(maxsize=4096)
def head_splits(batch: int, kv_heads: int, group: int, kv_len: int, parallel_block: int, slices: int,
                sm_count: Optional[int], waves: Optional[int], forced: Optional[int] = None) -> int:
    """CTAs that share each kv head's query-head group in the dK/dV kernel (HEAD_SPLIT).

    1 without GQA. A split walks its split_shares of the heads (a group of 7 in 2 splits: 4 + 3).
    `forced` (Tuning.head_splits): min(forced, group).
    Otherwise, among the d whose CTAs (d per key block, kv head and column slice) fit `waves`
    waves of one CTA per SM on sm_count SMs (the wgmma dK/dV kernels' shared memory and registers
    allow no second), the one whose longest split has the fewest heads, the fewest CTAs of those
    (so a group of 4 takes 2, not 3): the row's head_splits_to<W>, head_splits_causal_to<W>
    or head_splits_fused_causal_to<W> as length_sets picks it (1 where none applies or sm_count
    is unknown). So a GQA call of too few key blocks for the GPU runs each CTA on a share of the
    heads, on SMs that would otherwise idle, and a call that fills them is left alone: H200 (132
    SMs), B=1 Hq=16 Hkv=4 D=128 fwd+bwd, 2 splits against none: N=2048 (64 CTAs) 0.674x, causal
    0.655x; but 4 against 2 there 1.06x / 1.17x, and 2 against none at B=2 N=2048 causal (128
    CTAs) 1.038x, N=4096 (128 CTAs) 1.01x. The causal fused dQ is the exception (its adds go
    key block by key block, so each CTA's walk keeps in step with the one before): N=4096 (128
    CTAs) 0.706x with 2 splits, N=8192 (256) 0.991x, B=4 N=4096 (512) 0.988x (blocks_cuda.txt).
    """
    if group <= 1:
        return 1
    if forced is not None:
        return min(forced, group)
    if sm_count is None or waves is None:
        return 1
    ctas = batch * kv_heads * -(-kv_len // parallel_block) * slices
    fitting = [d for d in range(1, group + 1) if d == 1 or ctas * d <= waves * sm_count]
    return min(fitting, key=lambda d: (max(split_shares(group, d)), d))


def fused_query_from(features: VariantFeatures, mask_dtype: Optional[mx.Dtype], family: Family, tuning: Tuning,
                     real_sm90: bool, table: planner.Table) -> Optional[int]:
    """From how many queries calls with `features` run the dK/dV kernel with fused dQ: the wgmma
    dK/dV row's fused_dq_from<N> where the call can take it (see _wgmma_variant), None where no
    length does (or the tuning forces fused_query either way)."""
    spec = features.spec()
    kernel = "backward_key_value"
    if make_variant(kernel, spec, mask_dtype, family, tuning, real_sm90, table, True) == make_variant(
            kernel, spec, mask_dtype, family, tuning, real_sm90, table):
        return None
    plan = planner.plan("cuda", kernel, spec.head_dim, spec.dtype, family.name + "_wgmma",
                        tuning.table or table)
    return option_keys(plan.cached, fused_query_option(spec),
                       f"the {family.name}_wgmma {kernel} at head_dim={spec.head_dim}")


def forward_long_from(features: VariantFeatures, mask_dtype: Optional[mx.Dtype], family: Family, tuning: Tuning,
                      real_sm90: bool, table: planner.Table) -> Optional[int]:
    """From how many keys calls with `features` run the forward at the wgmma forward row's
    t<T>_from<N> T: that N where it changes the forward variant, else None (no such option,
    calls with an array mask, window or softcap (plain_scores), or a tuning that overrides the
    row's blocks)."""
    spec = features.spec()
    if make_variant("forward", spec, mask_dtype, family, tuning, real_sm90, table, long_keys=True) == make_variant(
            "forward", spec, mask_dtype, family, tuning, real_sm90, table):
        return None
    plan = planner.plan("cuda", "forward", spec.head_dim, spec.dtype, family.name + "_wgmma", tuning.table or table)
    return long_keys_option(plan.cached, f"the {family.name}_wgmma forward at head_dim={spec.head_dim}")[1]


def check_limits(variant: KernelVariant, family: Family) -> None:
    """Raise before compiling if the variant breaks its family's limits (it would fail at launch)."""
    if variant.shared_memory > family.shared_memory:
        raise ValueError(f"[cuda] blocks_cuda.txt: {variant.name} needs {variant.shared_memory} bytes of shared "
                         f"memory, over family {family.name}'s {family.shared_memory}; give the row smaller blocks.")
    if variant.threads > family.threads:
        raise ValueError(f"[cuda] blocks_cuda.txt: {variant.name} needs {variant.threads} threads per block, over "
                         f"family {family.name}'s {family.threads}.")


def _features(spec: AttentionSpec, mask_dtype: Optional[mx.Dtype]) -> dict:
    return dict(input_type=CUDA_TYPES[spec.dtype], head_dim=spec.head_dim, padded_dim=_round_up(spec.head_dim, 16),
                causal=spec.causal, window=spec.window is not None, softcap=spec.softcap is not None,
                mask_kind=MASK_KINDS[spec.mask_kind],
                mask_type=CUDA_TYPES[mask_dtype] if mask_dtype is not None else CUDA_TYPES[spec.dtype])


def _mma_variant(kernel, spec, mask_dtype, family: Family, tuning: Tuning, table=None) -> KernelVariant:
    plan = planner.plan("cuda", kernel, spec.head_dim, spec.dtype, family.name, table)
    block, keys, columns, warps = plan.parallel_block, plan.traversal_block, plan.head_block, plan.warps
    override = tuning.block_override(kernel)
    if override is not None:
        block, keys, columns, *rest = override
        warps = rest[0] if rest else warps
    warps = warps or DEFAULT_WARPS
    features = _features(spec, mask_dtype)
    padded = features["padded_dim"]
    width, col_groups, cta_slices = column_slices(spec.head_dim, min(_round_up(columns, 16), padded), warps)
    row_groups = warps // col_groups
    where = f"the {family.name} {kernel} at head_dim={spec.head_dim}"
    if block % (16 * row_groups):
        raise ValueError(f"[cuda] blocks_cuda.txt: P={block} for {where} must be a multiple of 16 * {row_groups} "
                         f"(row groups of {warps} warps, {col_groups} column groups).")
    # The backward kernels split the traversal block over the column groups in 8-wide tiles.
    min_block = 16 if kernel == "forward" or col_groups == 1 else max(16, 8 * col_groups)
    if keys % min_block:
        raise ValueError(f"[cuda] blocks_cuda.txt: T={keys} for {where} must be a multiple of {min_block} "
                         f"({col_groups} column groups).")
    return KernelVariant(kernel=kernel, family=family.name, instruction="mma.sync", head_block=width,
                         slices=cta_slices, m_tiles=block // (16 * row_groups), traversal_block=keys,
                         warps=warps, col_groups=col_groups, tuning=tuning, **features)


def _wgmma_variant(kernel, spec, mask_dtype, family: Family, tuning: Tuning, table=None,
                   long_queries: bool = False, long_keys: bool = False) -> KernelVariant:
    rows = family.name + "_wgmma"
    plan = planner.plan("cuda", kernel, spec.head_dim, spec.dtype, rows,
                        table or planner.active_table("cuda", family.name))
    block, keys, columns, warps = plan.parallel_block, plan.traversal_block, plan.head_block, plan.warps or 8
    where = f"the {rows} {kernel} at head_dim={spec.head_dim}"
    # The forward's T for long walks (t<T>_from<N>), where the call has that many keys.
    by_keys = long_keys_option(plan.cached, where)
    if by_keys is not None and kernel != "forward":
        raise ValueError(f"[cuda] blocks_cuda.txt: {where} has options {sorted(plan.cached)}: t<T>_from<N> is "
                         f"the forward's (a {kernel} row takes its T by length only through fused_dq_from<N>).")
    if long_keys and by_keys is not None and plain_scores(spec):
        keys = by_keys[0]
    masked, windowed, capped = (option_keys(plan.cached, prefix, where)
                                for prefix in (MASKED_KEYS, WINDOW_KEYS, SOFTCAP_KEYS))
    keys = min([t for t, applies in ((masked, spec.mask_kind != "none"), (windowed, spec.window is not None),
                                     (capped, spec.softcap is not None))
                if applies and t is not None], default=keys)
    override = tuning.block_override(kernel + "_wgmma")
    if override is not None:
        block, keys, columns, *rest = override
        warps = rest[0] if rest else block // 16
    # Consumer warps (4 per warpgroup): the dK/dV kernel's register split needs exactly two.
    consumers = (8,) if kernel == "backward_key_value" else (8, 12)
    features = _features(spec, mask_dtype)
    padded = features["padded_dim"]
    # dK/dV past the row's H columns: P = 128 keys (64 per warpgroup) splits D into 128-column
    # CTAs (slices), P = 64 has both warpgroups share the keys and split the columns (column groups).
    wide = kernel == "backward_key_value" and padded > _round_up(columns, 16)
    if kernel == "backward_key_value" and (padded > WGMMA_WHOLE_MAX_COLUMNS if not wide else columns != WGMMA_SLICE_WIDTH):
        raise ValueError(f"[cuda] blocks_cuda.txt: {where} has H={columns}: a warpgroup holds dK / dV for all of D "
                         f"up to {WGMMA_WHOLE_MAX_COLUMNS} columns, past that H must be {WGMMA_SLICE_WIDTH} "
                         f"(slices or column groups).")
    # The forward and dQ past wgmma's N: both warpgroups share 64 query rows, each holding O / dQ
    # for half the columns (the forward: each computing half of S too).
    wide_query = kernel in ("forward", "backward_query") and padded > WGMMA_MAX_COLUMNS
    col_groups = 2 if (wide and block == 8 * warps) or wide_query else 1
    if warps not in consumers or block * col_groups != 16 * warps:
        raise ValueError(f"[cuda] blocks_cuda.txt: {where} needs P = 64 rows per consumer warpgroup of 4 warps, "
                         f"{' or '.join(str(w // 4) for w in consumers)} of them"
                         f"{' (or 64 shared by both past D = 128)' if wide else ''}"
                         f"{' (past D = 256: 64 shared by both)' if wide_query else ''}; got P={block} with {warps} warps.")
    most = 256 if kernel == "forward" else 128
    if keys % 16 or not 16 <= keys <= most:
        raise ValueError(f"[cuda] blocks_cuda.txt: T={keys} for {where} must be a multiple of 16 in [16, {most}].")
    # Column groups cover 2 x 128 columns a CTA: past 256, CTA slices of them as well.
    slices = -(-padded // (WGMMA_SLICE_WIDTH * col_groups)) if wide else 1
    width = WGMMA_SLICE_WIDTH if wide else padded
    if wide_query:  # half of D each, on 64-column panels (where an MN-major B operand may start)
        width = _round_up(-(-padded // 2), 64)
    # Column groups run in step (they swap S every step): no turns to take.
    pingpong = kernel == "forward" and col_groups == 1 and (
        plan.is_cached(PINGPONG) if tuning.pingpong is None else tuning.pingpong)
    # Fused dQ by the row's length (measured without array masks: blocks_cuda.txt), or forced.
    option = fused_query_option(spec)
    by_length = long_queries and option is not None and option_keys(plan.cached, option, where) is not None
    fused_query = kernel == "backward_key_value" and (
        by_length if tuning.fused_query is None else tuning.fused_query) and (
        fused_query_fits(spec, keys, padded, col_groups * slices))
    # The scale fold where the kernel has the path it changes (no array mask, no softcap).
    scale_fold = kernel == "forward" and spec.mask_kind == "none" and spec.softcap is None and (
        plan.is_cached(SCALE_FOLD) if tuning.scale_fold is None else tuning.scale_fold)
    # The row sums by MMA where O is one 64-column V panel (D = 49..64): by the row's option for the
    # calls it was measured on and faster (plain_scores; forced with an array mask 1.010-1.021x the
    # forward time), by a tuning anywhere.
    mma_sums = kernel == "forward" and col_groups == 1 and padded == 64 and (
        plan.is_cached(MMA_SUMS) and plain_scores(spec) if tuning.mma_sums is None else tuning.mma_sums)
    # dK/dV past 256 (two CTAs of column groups a key block): split by role, not by columns, for
    # calls without a causal mask or window (those were not faster: ROLES).
    roles = kernel == "backward_key_value" and col_groups == 2 and slices == 2 and not spec.causal and (
        spec.window is None) and (plan.is_cached(ROLES) if tuning.roles is None else tuning.roles)
    return KernelVariant(kernel=kernel, family=rows, instruction="wgmma",
                         head_block=width, slices=slices, m_tiles=1,
                         traversal_block=keys, warps=warps, col_groups=col_groups, pingpong=pingpong,
                         fused_query=fused_query, scale_fold=scale_fold, mma_sums=mma_sums, roles=roles, tuning=tuning,
                         **features)


def fused_chains(variant: KernelVariant) -> int:
    """Accumulator tiles (and counts) per (query head, query block) of a fused_query dK/dV
    variant: 2 without a causal mask (the key blocks walk down from their diagonal, in two chains
    of adds), else 1; 1 without the fused dQ. The template's CHAINS (it checks the value against
    its walk); the prepare and accumulator kernels and their buffers take it from here."""
    return 2 if variant.fused_query and not variant.causal else 1


def fused_query_fits(spec: AttentionSpec, queries: int, padded_dim: int, column_parts: int) -> bool:
    """Whether the wgmma dK/dV kernel can accumulate dQ for this call (FUSED_QUERY): all of D per
    warpgroup (no column groups or slices), T x D made of exactly two 64 x 64 units (one per
    consumer warpgroup), no window (its adds go in key-block order from block 0) and no sinks
    (d_sinks comes from the dQ kernel)."""
    units = (queries // 64) * -(-padded_dim // 64) if queries % 64 == 0 else 0
    return column_parts == 1 and units == 2 and spec.window is None and not spec.has_sinks


# ------------------------------------------------------------------------------------- source
def source(variant: KernelVariant) -> Tuple[str, str, List[str], List[str]]:
    """(header, body, input names, output names) of the variant, for mx.fast.cuda_kernel."""
    has_mask = variant.mask_kind != 0
    mask_arg = "mask" if has_mask else f"(const {variant.mask_type}*)nullptr"
    if variant.instruction == "wgmma":
        parts = [template_text(HEADER), _wgmma_wrappers(variant), template_text("wgmma_common.cuh"),
                 render(WGMMA_TEMPLATES[variant.kernel], **variant.constants())]
        suffix = "_wgmma"
    else:
        parts = [template_text(HEADER), render(TEMPLATES[variant.kernel], **variant.constants())]
        suffix = ""
    inputs, outputs, body = _signature(variant.kernel, has_mask, mask_arg, suffix, variant.sinks,
                                       variant.tensor_maps, variant.fused_query if suffix else None,
                                       variant.head_split)
    return "\n".join(parts), body, inputs, outputs


def _signature(kernel: str, has_mask: bool, mask_arg: str, suffix: str, sinks: bool = False,
               tensor_maps: bool = False, fused_query: Optional[bool] = None,
               head_split: bool = False) -> Tuple[List[str], List[str], str]:
    """(input names, output names, body) of `kernel`: the body calls mlxflash::attention_<kernel><suffix>.

    The [B, H, N, D] inputs are followed by their layouts (`<name>_strides`, which MLX passes to a
    body that names them: common.STRIDED_INPUTS). The forward and dQ kernels take a sinks pointer
    after the mask (null without sinks); the dQ kernel also writes d_sinks_part after dq (null
    without sinks). The wgmma dK/dV kernel (fused_query not None) writes dq_acc after dv and takes
    dq_order (the prepare kernel's zeroed counts, which it updates) after the mask; both null unless
    fused_query. With tensor_maps (the wgmma kernels) the tensor-map template follows the
    parameters and a scratch output for the CTAs' maps comes last. A head_split dK/dV kernel writes
    fp32 dk_parts and dv_parts instead of dk and dv."""
    if kernel == "forward":
        inputs, outputs = ["q", "k", "v"], ["out", "lse"]
    else:
        inputs = ["q", "k", "v", "d_out", "lse2", "delta"]
        outputs = ["dq"] if kernel == "backward_query" else (["dk_parts", "dv_parts"] if head_split else ["dk", "dv"])
    strided = [name for name in inputs if name in STRIDED_INPUTS]
    args = strided + [_layout(name) for name in strided] + inputs[len(strided):] + [mask_arg]
    if kernel != "backward_key_value":
        args.append("sinks" if sinks else "(const float*)nullptr")
    fused = kernel == "backward_key_value" and bool(fused_query)
    inputs += (["mask"] if has_mask else []) + (["sinks"] if sinks else []) + (["dq_order"] if fused else []) + [
        "params", "fparams"]
    args += ["params", "fparams"] + (["tensor_map"] if tensor_maps else []) + outputs
    if kernel == "backward_query":
        outputs = outputs + (["d_sinks_part"] if sinks else [])
        args.append("d_sinks_part" if sinks else "(float*)nullptr")
    if kernel == "backward_key_value" and fused_query is not None:
        # dq_order is an input (MLX declares it const) that the kernel updates: see prepare_source.
        outputs = outputs + (["dq_acc"] if fused else [])
        args += ["dq_acc", "const_cast<int*>(dq_order)"] if fused else ["(float*)nullptr", "(int*)nullptr"]
    if tensor_maps:
        inputs.append("tensor_map")
        outputs = outputs + ["tensor_maps"]
        args.append("tensor_maps")
    body = f"mlxflash::attention_{kernel}{suffix}({', '.join(args)});"
    return inputs, outputs, body


def _layout(name: str) -> str:
    """The kernel argument that carries input `name`'s layout (MLX passes `<name>_strides`)."""
    return f"mlxflash::layout_of({name}_strides)"


def prepare_source(input_type: str, head_dim: int, has_d_lse: bool, count_block: int = 0, count_chains: int = 1
                   ) -> Tuple[str, str, List[str], List[str]]:
    """(header, body, inputs, outputs) of the backward preprocessing kernel. count_block > 0: it
    also writes dq_order, the fused dQ's counts (count_chains per block of count_block queries),
    zeroed."""
    header = template_text(HEADER) + "\n" + render(
        "attention_backward_prepare.cu", input_type=input_type, head_dim=head_dim, has_d_lse=has_d_lse,
        count_block=count_block, count_chains=count_chains, threads=PREPARE_THREADS, lanes=prepare_lanes(head_dim))
    counts = "dq_order" if count_block else "(int*)nullptr"
    body = (f"mlxflash::attention_backward_prepare(out, d_out, {_layout('out')}, {_layout('d_out')}, lse, d_lse, "
            f"params, delta, lse2, {counts});")
    return header, body, ["out", "d_out", "lse", "d_lse", "params"], ["delta", "lse2"] + (
        ["dq_order"] if count_block else [])


def prepare_name(input_type: str, head_dim: int, has_d_lse: bool, count_block: int = 0, count_chains: int = 1
                 ) -> str:
    counts = f"_c{count_block}x{count_chains}" if count_block else ""
    return f"mlxflash_prepare_{'bf16' if 'bfloat' in input_type else 'f16'}_d{head_dim}_{int(has_d_lse)}{counts}"


QUERY_FROM_ACCUMULATOR_THREADS = 256  # THREADS of kernels/attention_backward_query_from_accumulator.cu


def query_from_accumulator_source(input_type: str, head_dim: int, traversal_block: int, chains: int = 1
                                  ) -> Tuple[str, str, List[str], List[str]]:
    """(header, body, inputs, outputs) of the kernel that makes dQ of the fused dK/dV kernel's
    accumulator (tiles of traversal_block rows x 64-column panels covering head_dim, `chains` per
    query block: fused_chains)."""
    header = template_text(HEADER) + "\n" + render(
        "attention_backward_query_from_accumulator.cu", input_type=input_type, head_dim=head_dim,
        traversal_block=traversal_block, tile_columns=_round_up(head_dim, 64),
        threads=QUERY_FROM_ACCUMULATOR_THREADS, chains=chains)
    body = "mlxflash::attention_backward_query_from_accumulator(acc, counts, params, dq);"
    return header, body, ["acc", "counts", "params"], ["dq"]


def query_from_accumulator_shared_bytes(head_dim: int, traversal_block: int) -> int:
    """Its tile in shared memory (SHARED_BYTES of the template: rows of the columns + 8 floats)."""
    return traversal_block * (_round_up(head_dim, 64) + 8) * 4


def query_from_accumulator_name(input_type: str, head_dim: int, traversal_block: int, chains: int = 1) -> str:
    return f"mlxflash_dq_from_acc_{'bf16' if 'bfloat' in input_type else 'f16'}_d{head_dim}_t{traversal_block}x{chains}"


KEY_VALUE_PARTS_THREADS = 256  # THREADS of kernels/attention_backward_key_value_parts.cu


def key_value_parts_source(input_type: str, head_dim: int) -> Tuple[str, str, List[str], List[str]]:
    """(header, body, inputs, outputs) of the kernel that adds a head-split dK/dV kernel's fp32
    parts in split order and rounds them into dK and dV (HEAD_SPLIT)."""
    header = template_text(HEADER) + "\n" + render(
        "attention_backward_key_value_parts.cu", input_type=input_type, head_dim=head_dim,
        threads=KEY_VALUE_PARTS_THREADS, chunk=key_value_parts_chunk(head_dim))
    body = "mlxflash::attention_backward_key_value_parts(dk_parts, dv_parts, params, dk, dv);"
    return header, body, ["dk_parts", "dv_parts", "params"], ["dk", "dv"]


def key_value_parts_name(input_type: str, head_dim: int) -> str:
    return f"mlxflash_kv_parts_{'bf16' if 'bfloat' in input_type else 'f16'}_d{head_dim}"


def key_value_parts_chunk(head_dim: int) -> int:
    """Elements each thread of the parts kernel takes (the template's CHUNK; the launch's grid)."""
    return 4 if head_dim % 4 == 0 else 1


def _wgmma_wrappers(variant: KernelVariant) -> str:
    """kernels/wgmma_ops.cuh cut to the two widths the kernel uses (scores: traversal_block; O,
    dQ or a dK / dV slice: head_block). MLX copies and hashes a kernel's source on every call:
    the whole file (148 KB) made that host time 3x."""
    text = template_text("wgmma_ops.cuh")
    marker = "template <> struct Wgmma<"
    first = text.index(marker)
    head, structs = text[:first], text[first:].split(marker)[1:]
    # The dK/dV kernel's fused dQ product is m64n64 (compiled in whether or not it runs).
    widths = {variant.traversal_block, variant.head_block} | ({64} if variant.kernel == "backward_key_value" else set())
    if variant.mma_sums:  # O += P [V | 1]
        widths.add(variant.head_block + 8)
    keep = [marker + body for body in structs
            if int(body.split(",")[0]) in widths and body.split(",")[1].split(">")[0].strip() == variant.input_type]
    return head + "".join(keep).rstrip().removesuffix("}  // namespace mlxflash").rstrip() + "\n\n}  // namespace mlxflash\n"

"""Tensor-map templates for the wgmma kernels' TMA loads (K and V; Q and dO in the dK/dV kernel).

A CUDA tensor map (CUtensorMap, 128 opaque bytes) tells the Tensor Memory Accelerator where a
tensor lies and which box one load copies. Only the CUDA driver encodes one
(`cuTensorMapEncodeTiled`), and it wants the tensor's device address, which MLX does not give
Python before a kernel runs. So the host encodes one template per box shape with a placeholder
address and sizes, and each CTA writes its head's address, sizes and row stride into a copy of it
(`tensormap.replace`, kernels/wgmma_common.cuh) before its first load.

The box is one 64-column panel of the kernels' swizzled tile layout: 64 16-bit elements (128
bytes) by `rows` rows, 128-byte swizzle, so TMA writes exactly the layout wgmma reads.
"""

import ctypes
import functools

import mlx.core as mx

# CUDA driver API enumerators (cuda.h).
_UINT16 = 1  # CU_TENSOR_MAP_DATA_TYPE_UINT16: bf16 and fp16 are copied as bits
_INTERLEAVE_NONE = 0
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3
_FILL_ZERO = 0  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: rows and columns past the tensor read as zero
_PANEL_COLUMNS = 64
_MAP_BYTES = 128


@functools.lru_cache(maxsize=None)
def _driver():
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        encode = cuda.cuTensorMapEncodeTiled
    except (OSError, AttributeError) as error:
        raise RuntimeError(f"[cuda] the wgmma kernels load their tiles with TMA, whose tensor maps only the CUDA "
                           f"driver encodes (cuTensorMapEncodeTiled in libcuda.so.1): {error}") from error
    encode.restype = ctypes.c_int
    return encode


@functools.lru_cache(maxsize=None)
def panel_template(rows: int, rank: int = 2) -> mx.array:
    """The 32 uint32 words of a tensor map whose box is one 64-column panel of `rows` rows.

    Args:
        rows: rows per load (a tile's keys or queries), 1..256 (TMA's box limit).
        rank: 2 (columns, rows: one head's rows) or 3 (a third dimension of heads, box 1: the
            dK/dV kernel's one map over the query heads of a kv head's group).
    """
    if not 1 <= rows <= 256:
        raise ValueError(f"[cuda] a TMA box has 1..256 rows; got rows={rows}")
    if rank not in (2, 3):
        raise ValueError(f"[cuda] the kernels' tensor maps have rank 2 or 3; got rank={rank}")
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    words = (ctypes.c_uint32 * (_MAP_BYTES // 4))()
    # Placeholder address, sizes and strides (each CTA replaces them); the address must be
    # 16-byte aligned, each stride a multiple of 16 bytes.
    sizes = (_PANEL_COLUMNS, 1 << 20, 1)[:rank]
    strides = (2 * _PANEL_COLUMNS, 2 * _PANEL_COLUMNS << 20)[:rank - 1]
    status = _driver()(ctypes.byref(words), _UINT16, rank, ctypes.c_void_p(1 << 20),
                       (u64 * rank)(*sizes), (u64 * (rank - 1))(*strides),
                       (u32 * rank)(*(_PANEL_COLUMNS, rows, 1)[:rank]), (u32 * rank)(*(1,) * rank),
                       _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_256B, _FILL_ZERO)
    if status != 0:
        raise RuntimeError(f"[cuda] cuTensorMapEncodeTiled failed with CUresult {status} for a "
                           f"{_PANEL_COLUMNS} x {rows} box of rank {rank}")
    return mx.array(list(words), dtype=mx.uint32)


# Two maps per CTA (K and V, or Q and dO): kernels/wgmma_common.cuh's TENSOR_MAP_SLOT_BYTES.
SLOT_BYTES = 2 * _MAP_BYTES


def scratch_bytes(ctas: int) -> int:
    """Bytes of the global scratch the kernels publish their maps in: SLOT_BYTES per CTA."""
    return SLOT_BYTES * ctas

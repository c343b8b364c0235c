"""Apple's Metal kernels from MLX's shipped headers, driven through metalsim.

Each helper builds a metalsim kernel whose header includes Apple's headers
unchanged (``mlx/backend/metal/kernels/...`` from the installed mlx wheel)
and whose body calls Apple's kernel template with the arguments MLX's host
code passes (mlx/backend/metal/*.cpp), then runs it. Parameter structs
(AttnParams, GEMMParams) travel as int64 byte buffers, as MLX sets them
with setBytes.
"""

from __future__ import annotations

import struct

import mlx.core as mx
import numpy as np

from mlx_flash import metalsim

K = "mlx/backend/metal/kernels/"


def _include(*names: str) -> str:
    return "".join(f'#include "{K}{n}"\n' for n in names)


def _param_buffer(data: bytes) -> mx.array:
    data += b"\0" * ((8 - len(data) % 8) % 8)
    return mx.array(np.frombuffer(data, dtype=np.int64).copy())


def softmax(x: mx.array, *, looped: bool = False, **opts) -> mx.array:
    """softmax.h: softmax_single_row / softmax_looped<T, float> over the last axis."""
    rows, n = x.shape
    fn = "softmax_looped" if looped else "softmax_single_row"
    extra = "threads_per_threadgroup.x, " if looped else ""
    kern = metalsim.metal_kernel(
        name=f"apple_{fn}", input_names=["inp", "axis_size"], output_names=["out"],
        header=_include("utils.h", "softmax.h"),
        source=f"""{fn}<T, float>(inp, out, axis_size, threadgroup_position_in_grid.x,
            thread_position_in_threadgroup.x, {extra}thread_index_in_simdgroup,
            simdgroup_index_in_threadgroup);""", **opts)
    # MLX (softmax.cpp): single row takes ceil(n / N_READS) threads rounded to a simdgroup;
    # looped takes the pipeline's maximum, 1024: it reads all 32 simdgroups' partial results
    # from threadgroup memory (with fewer, it reads memory nobody wrote, which metalsim
    # poisons with NaN).
    tg = 1024 if looped else ((n + 3) // 4 + 31) // 32 * 32
    return kern(inputs=[x, mx.array(n, dtype=mx.int32)], template=[("T", x.dtype)],
                grid=(tg * rows, 1, 1), threadgroup=(tg, 1, 1), output_shapes=[x.shape],
                output_dtypes=[x.dtype])[0]


def logsumexp(x: mx.array, **opts) -> mx.array:
    """logsumexp.h: logsumexp<T, float> over the last axis."""
    rows, n = x.shape
    kern = metalsim.metal_kernel(
        name="apple_logsumexp", input_names=["inp", "axis_size"], output_names=["out"],
        header=_include("utils.h", "logsumexp.h"),
        source="""logsumexp<T, float>(inp, out, axis_size, threadgroup_position_in_grid.x,
            thread_position_in_threadgroup.x, thread_index_in_simdgroup,
            simdgroup_index_in_threadgroup);""", **opts)
    tg = ((n + 3) // 4 + 31) // 32 * 32
    return kern(inputs=[x, mx.array(n, dtype=mx.int32)], template=[("T", x.dtype)],
                grid=(tg * rows, 1, 1), threadgroup=(tg, 1, 1), output_shapes=[(rows,)],
                output_dtypes=[x.dtype])[0]


def all_reduce_sum(x: mx.array, out_dtype, *, threads: int = 96, **opts) -> mx.array:
    """reduce_all.h: all_reduce<T, U, Sum<U>>, one row of the flattened input per threadgroup
    (int64 sums take reduction/ops.h's simd_shuffle_down path, the others simd_sum)."""
    rows, n = x.shape
    kern = metalsim.metal_kernel(
        name="apple_all_reduce", input_names=["inp", "in_size", "row_size"], output_names=["out"],
        header=_include("utils.h", "reduce_utils.h", "reduce.h"),
        source="""all_reduce<T, U, Sum<U>>(inp, out, in_size, row_size,
            threadgroup_position_in_grid, thread_position_in_threadgroup, threads_per_threadgroup,
            simdgroups_per_threadgroup, thread_index_in_simdgroup,
            simdgroup_index_in_threadgroup);""", **opts)
    return kern(inputs=[x, mx.array(x.size, mx.uint64), mx.array(n, mx.uint64)],
                template=[("T", x.dtype), ("U", out_dtype)], grid=(threads, rows, 1),
                threadgroup=(threads, 1, 1), output_shapes=[(rows,)], output_dtypes=[out_dtype])[0]


def sdpa_vector(q: mx.array, k: mx.array, v: mx.array, scale: float, *, causal: bool = False,
                **opts) -> mx.array:
    """sdpa_vector.h: sdpa_vector<T, D> (one simdgroup per key, 32 simdgroups), q of shape
    (B, Hq, Lq, D) with Lq small, k/v (B, Hk, N, D), row-contiguous."""
    B, Hq, Lq, D = q.shape
    Hk, N = k.shape[1], k.shape[2]
    kern = metalsim.metal_kernel(
        name="apple_sdpa_vector",
        input_names=["q", "k", "v", "gqa_factor", "N", "k_head_stride", "k_seq_stride",
                     "v_head_stride", "v_seq_stride", "scale"],
        output_names=["out"], header=_include("utils.h", "sdpa_vector.h"),
        source="""sdpa_vector<T, D, D>(q, k, v, out, gqa_factor, N, k_head_stride, k_seq_stride,
            v_head_stride, v_seq_stride, scale, nullptr, nullptr, 0, 0, 0, nullptr, 0,
            threadgroup_position_in_grid, threadgroups_per_grid, simdgroup_index_in_threadgroup,
            thread_index_in_simdgroup);""",
        **{"function_constants": dict(has_mask=False, query_transposed=False, do_causal=causal,
                                      bool_mask=False, float_mask=False, has_sinks=False,
                                      blocks=1), **opts})
    u64 = lambda n: mx.array(n, mx.uint64)  # noqa: E731
    return kern(inputs=[q, k, v, mx.array(Hq // Hk, mx.int32), mx.array(N, mx.int32),
                        u64(N * D), u64(D), u64(N * D), u64(D), mx.array(scale, mx.float32)],
                template=[("T", q.dtype), ("D", D)], grid=(B * Hq * 1024, Lq, 1),
                threadgroup=(1024, 1, 1), output_shapes=[q.shape], output_dtypes=[q.dtype])[0]


def steel_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, *, causal: bool = False,
                    bq: int = 32, bk: int = 32, wm: int = 4, **opts) -> mx.array:
    """steel/attn/kernels/steel_attention.h: attention<T, BQ, BK, BD, BD, WM, 1> (the
    simdgroup_matrix flash-attention forward), q (B, H, qL, D), k/v (B, H / gqa, kL, D)."""
    B, H, qL, D = q.shape
    Hk, kL = k.shape[1], k.shape[2]
    kern = metalsim.metal_kernel(
        name="apple_steel_attention", input_names=["q", "k", "v", "params"],
        output_names=["out"], header=_include("utils.h", "steel/attn/kernels/steel_attention.h"),
        source="""attention<T, BQ, BK, BD, BD, WM, 1, float, float>(q, k, v, out,
            reinterpret_cast<const constant AttnParams*>(params), nullptr, nullptr, nullptr,
            nullptr, thread_index_in_simdgroup, simdgroup_index_in_threadgroup,
            threadgroup_position_in_grid, thread_position_in_threadgroup);""",
        function_constants=dict(align_Q=qL % bq == 0, align_K=kL % bk == 0, has_mask=False,
                                do_causal=causal, has_sinks=False, save_lse=False), **opts)
    nq, nk = -(-qL // bq), -(-kL // bk)

    def strides(h, n):
        return (h * n * D, n * D, D)

    # mlx::steel::AttnParams, field by field (scaled_dot_product_attention.cpp).
    p = struct.pack("6if7i", B, H, D, qL, kL, H // Hk, scale, nq, nk, qL // bq, kL // bk,
                    qL % bq, kL % bk, kL - qL)
    p += struct.pack("12q", *strides(H, qL), *strides(Hk, kL), *strides(Hk, kL),
                                 *strides(H, qL))
    return kern(inputs=[q, k, v, _param_buffer(p)],
                template=[("T", q.dtype), ("BQ", bq), ("BK", bk), ("BD", D), ("WM", wm)],
                grid=(nq * 32, H * wm, B), threadgroup=(32, wm, 1), output_shapes=[q.shape],
                output_dtypes=[q.dtype])[0]


def steel_gemm(a: mx.array, b: mx.array, *, bm: int = 32, bn: int = 32, bk: int = 16,
               wm: int = 2, wn: int = 2, **opts) -> mx.array:
    """steel/gemm/kernels/steel_gemm_fused.h: gemm<T, BM, BN, BK, WM, WN, false, false> (the
    simdgroup_matrix GEMM behind mx.matmul), row-major a (M, K) @ b (K, N)."""
    M, Kd = a.shape
    N = b.shape[1]
    kern = metalsim.metal_kernel(
        name="apple_steel_gemm", input_names=["a", "b", "params"], output_names=["d"],
        header=_include("utils.h", "steel/gemm/gemm.h", "steel/gemm/kernels/steel_gemm_fused.h"),
        source="""gemm<T, BM, BN, BK, WM, WN, false, false, float>(a, b, nullptr, d,
            reinterpret_cast<const constant GEMMParams*>(params), nullptr, nullptr, nullptr,
            thread_index_in_simdgroup, simdgroup_index_in_threadgroup,
            threadgroup_position_in_grid, thread_position_in_threadgroup);""",
        function_constants=dict(has_batch=False, use_out_source=False, do_axpby=False,
                                align_M=M % bm == 0, align_N=N % bn == 0, align_K=Kd % bk == 0),
        **opts)
    tn, tm = -(-N // bn), -(-M // bm)
    # mlx::steel::GEMMParams (matmul.cpp), swizzle_log 0, one batch.
    p = struct.pack("8i3q3i", M, N, Kd, Kd, N, N, tn, tm, 0, 0, 0, 0, Kd // bk, 0)
    return kern(inputs=[a, b, _param_buffer(p)],
                template=[("T", a.dtype), ("BM", bm), ("BN", bn), ("BK", bk), ("WM", wm),
                          ("WN", wn)],
                grid=(tn * 32, tm * wn, wm), threadgroup=(32, wn, wm), output_shapes=[(M, N)],
                output_dtypes=[a.dtype])[0]

"""A sample MSL kernel for mlx_flash.metalsim: its tests and benchmark run it (and it shows how to
drive a simdgroup_matrix kernel through metal_kernel)."""

# Tiled matmul C = A @ B (A: M x K, B: K x N; M, N multiples of 64, K of 32):
# a threadgroup of 4 simdgroups computes a 64 x 64 tile of C, each simdgroup a
# 32 x 32 quarter as 4 x 4 simdgroup_matrix 8x8 accumulators (the shape of
# MLX's steel GEMM); A and B tiles are staged in threadgroup memory (16 KB).
MATMUL_HEADER = """
constant constexpr int BM = 64;
constant constexpr int BN = 64;
constant constexpr int BK = 32;
constant constexpr int FR = 4;   // fragments per simdgroup and dimension
"""

MATMUL_SOURCE = """
    threadgroup T As[BM * BK];
    threadgroup T Bs[BK * BN];
    const int M = a_shape[0], K = a_shape[1], N = b_shape[1];
    uint tid = thread_index_in_threadgroup;
    uint sg = simdgroup_index_in_threadgroup;
    int row0 = threadgroup_position_in_grid.y * BM;
    int col0 = threadgroup_position_in_grid.x * BN;
    int sr = (sg / 2) * (8 * FR), sc = (sg % 2) * (8 * FR);
    simdgroup_matrix<AccT, 8, 8> acc[FR][FR];
    for (int i = 0; i < FR; ++i)
      for (int j = 0; j < FR; ++j)
        acc[i][j] = make_filled_simdgroup_matrix<AccT, 8, 8>(0);
    for (int k0 = 0; k0 < K; k0 += BK) {
      for (uint e = tid; e < BM * BK; e += 128) {
        uint r = e / BK, c = e % BK;
        As[e] = a[(row0 + r) * K + k0 + c];
      }
      for (uint e = tid; e < BK * BN; e += 128) {
        uint r = e / BN, c = e % BN;
        Bs[e] = b[(k0 + r) * N + col0 + c];
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (int kk = 0; kk < BK; kk += 8) {
        simdgroup_matrix<T, 8, 8> af[FR], bf[FR];
        for (int i = 0; i < FR; ++i)
          simdgroup_load(af[i], As, BK, ulong2(kk, sr + 8 * i));
        for (int j = 0; j < FR; ++j)
          simdgroup_load(bf[j], Bs, BN, ulong2(sc + 8 * j, kk));
        for (int i = 0; i < FR; ++i)
          for (int j = 0; j < FR; ++j)
            simdgroup_multiply_accumulate(acc[i][j], af[i], bf[j], acc[i][j]);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    for (int i = 0; i < FR; ++i)
      for (int j = 0; j < FR; ++j)
        simdgroup_store(acc[i][j], c, N, ulong2(col0 + sc + 8 * j, row0 + sr + 8 * i));
"""


def matmul_kernel(metalsim, **kw):
    return metalsim.metal_kernel(
        name="tiled_matmul", input_names=["a", "b"], output_names=["c"],
        source=MATMUL_SOURCE, header=MATMUL_HEADER, **kw)


def run_matmul(kernel, a, b, dtype, acc_dtype=None):
    """C = A @ B through the sample kernel: one threadgroup of 128 threads per 64 x 64 tile."""
    M, K = a.shape
    N = b.shape[1]
    return kernel(
        inputs=[a, b],
        template=[("T", dtype), ("AccT", acc_dtype or dtype)],
        grid=(N // 64 * 128, M // 64, 1),
        threadgroup=(128, 1, 1),
        output_shapes=[(M, N)],
        output_dtypes=[acc_dtype or dtype],
    )[0]

// Shared device helpers for the CUDA attention kernels (Hopper and newer, sm_80+ instructions).
//
// Everything lives in namespace mlxflash so it cannot clash with MLX's own device headers,
// which mx.fast.cuda_kernel includes ahead of ours. Matrix products use mma.sync m16n8k16
// (fp16/bf16 operands, fp32 accumulators); tiles are staged in shared memory with cp.async and
// read with ldmatrix. Shared-memory rows are padded by 8 elements (16 bytes) so the 8 row
// addresses of one ldmatrix land in 8 different bank groups.
#pragma once
#ifndef MLXFLASH_CPU_EMULATION
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace mlxflash {

typedef unsigned int u32;
typedef int64_t i64;

// Runtime integer parameters, one int64 array shared by every kernel (layout fixed here and in
// mlx_flash/backends/cuda.py: keep the two in step). P_BLOCK_MAJOR: 1 = CTAs ordered block-major
// (all heads' first blocks, then their second, ...), 0 = head-major (see block_of). P_SPLITS:
// the dK/dV kernels' head splits (CTAs sharing one kv head's query-head group; 1 elsewhere).
enum Param {
  P_BATCH = 0, P_QHEADS, P_KVHEADS, P_QLEN, P_KVLEN, P_GROUP, P_DIAG, P_WLEFT, P_WRIGHT,
  P_MSB, P_MSH, P_MSQ, P_MSK, P_NBLOCKS, P_TOTAL, P_BLOCK_MAJOR, P_SPLITS, P_COUNT
};

// The runtime sizes and scalars every attention kernel reads first, declared as const locals of
// the kernel (a macro, not a struct: the kernels' [&] lambdas use them by name, and C++17 lambdas
// cannot capture structured bindings). NBLOCKS names the per-head block count.
#define MLXFLASH_READ_LAUNCH_PARAMS(ip, fp, NBLOCKS)                                                              \
  const int Hq = (int)(ip)[P_QHEADS], Hkv = (int)(ip)[P_KVHEADS], Nq = (int)(ip)[P_QLEN], Nk = (int)(ip)[P_KVLEN]; \
  const int group = (int)(ip)[P_GROUP], diag = (int)(ip)[P_DIAG];                                                  \
  const int wleft = (int)(ip)[P_WLEFT], wright = (int)(ip)[P_WRIGHT];                                              \
  const int NBLOCKS = (int)(ip)[P_NBLOCKS];                                                                         \
  const float scale = (fp)[0], cap = (fp)[1];                                                                       \
  const float scale_log2 = scale * 1.4426950408889634f

// The instructions below have CPU stand-ins in kernels/cuda_emulation.cuh (kernel logic tests
// without a GPU: mlx_flash/backends/cuda_emulator.py).
#ifndef MLXFLASH_CPU_EMULATION
__device__ __forceinline__ u32 smem_u32(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

// 16-byte asynchronous copy; src_bytes = 0 writes zeros (tiles past N or D).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}
// Two 8x8 matrices (row addresses from lanes 0-15).
__device__ __forceinline__ void ldmatrix_x2(u32 (&r)[2], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1]) : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldmatrix_x2_trans(u32 (&r)[2], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1]) : "r"(smem_u32(p)));
}

// c += a (16x16, row) * b (16x8, col), fp32 accumulate.
__device__ __forceinline__ void mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1, __nv_bfloat16) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1, __half) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

#endif  // MLXFLASH_CPU_EMULATION

__device__ __forceinline__ u32 pack2(float x, float y, __nv_bfloat16) {
  __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<u32*>(&v);
}
__device__ __forceinline__ u32 pack2(float x, float y, __half) {
  __half2 v = __floats2half2_rn(x, y);
  return *reinterpret_cast<u32*>(&v);
}
// Two n8 accumulator tiles of a 16-row m-tile (columns 16 kk .. 16 kk + 15, mma.sync's C layout,
// also wgmma's per warp) as the k16 A fragment of the next product: P V, dS K, P^T dO, dS^T Q.
template <typename T>
__device__ __forceinline__ void accumulators_to_a(const float (&lo)[4], const float (&hi)[4], u32 (&a)[4]) {
  a[0] = pack2(lo[0], lo[1], T());
  a[1] = pack2(lo[2], lo[3], T());
  a[2] = pack2(hi[0], hi[1], T());
  a[3] = pack2(hi[2], hi[3], T());
}
__device__ __forceinline__ void store2(__nv_bfloat16* p, float x, float y) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x, y);
}
__device__ __forceinline__ void store2(__half* p, float x, float y) {
  *reinterpret_cast<__half2*>(p) = __floats2half2_rn(x, y);
}
__device__ __forceinline__ void store1(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }
__device__ __forceinline__ void store1(__half* p, float x) { *p = __float2half_rn(x); }
// fp32 outputs: the dK/dV kernels' parts of split heads (HEAD_SPLIT).
__device__ __forceinline__ void store2(float* p, float x, float y) { *reinterpret_cast<float2*>(p) = make_float2(x, y); }
__device__ __forceinline__ void store1(float* p, float x) { *p = x; }

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(bool x) { return x ? 1.0f : 0.0f; }

#ifndef MLXFLASH_CPU_EMULATION
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
// One MUFU instruction (sm_75+), max relative error about 2^-11 (PTX ISA), as FlashAttention's
// softcap uses. tanhf is a sequence of ~20 instructions per score: it made softcap calls 4x
// slower than plain ones (H100, D=64 wgmma forward: 68 against 279 TFLOP/s).
__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
#endif

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Attention sinks (ALGORITHM.md): the online softmax of a row starts from the sink, a score
// with no value: max = sink (log2 units), sum = 1 held by one lane of the quad (quad_sum adds
// the four lanes' partial sums); a sink of -inf is no sink.
__device__ __forceinline__ void sink_row_state(float sink, int tq, float& row_max, float& row_sum) {
  row_max = sink * 1.4426950408889634f;
  row_sum = tq == 0 && row_max != -INFINITY ? 1.f : 0.f;
}

// One warp's part of the sink gradient: -sum_i exp2(sink2 - lse2_i) * delta_i over its rows, given
// per lane the value of each row it holds in lane tq == 0 of its quad (0 elsewhere); the warp sum
// runs in a fixed shuffle order (bitwise reproducible, no atomics).
__device__ __forceinline__ float sink_gradient_part(float x) {
#pragma unroll
  for (int m = 16; m >= 1; m /= 2) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

// Two score-shaped products that share their operands' layout, computed in one pass over the
// contraction: C1 = A1 B1^T and C2 = A2 B2^T for this warp's WM 16-row m-tiles (rows arow..) and
// BNW columns (bcol..); all four operands are row-major in shared memory with row stride ROW.
// The backward kernels use it for S = Q K^T with dP = dO V^T (dQ) and for S^T = K Q^T with
// dP^T = V dO^T (dK/dV).
template <int WM, int BNW, int DP, int ROW, typename T>
__device__ __forceinline__ void dual_gemm_abt(float (&c1)[WM][BNW / 8][4], float (&c2)[WM][BNW / 8][4],
                                              const T* a1, const T* a2, int arow,
                                              const T* b1, const T* b2, int bcol, int lane) {
#pragma unroll
  for (int mt = 0; mt < WM; ++mt)
#pragma unroll
    for (int n = 0; n < BNW / 8; ++n)
#pragma unroll
      for (int r = 0; r < 4; ++r) c1[mt][n][r] = c2[mt][n][r] = 0.f;
#pragma unroll
  for (int kk = 0; kk < DP / 16; ++kk) {
    u32 x1[WM][4], x2[WM][4];
#pragma unroll
    for (int mt = 0; mt < WM; ++mt) {
      const int off = (arow + mt * 16 + lane % 16) * ROW + kk * 16 + (lane / 16) * 8;
      ldmatrix_x4(x1[mt], a1 + off);
      ldmatrix_x4(x2[mt], a2 + off);
    }
#pragma unroll
    for (int nn = 0; nn < BNW / 16; ++nn) {
      u32 y1[4], y2[4];
      const int mi = lane / 8;
      const int off = (bcol + nn * 16 + (mi / 2) * 8 + lane % 8) * ROW + kk * 16 + (mi % 2) * 8;
      ldmatrix_x4(y1, b1 + off);
      ldmatrix_x4(y2, b2 + off);
#pragma unroll
      for (int mt = 0; mt < WM; ++mt) {
        mma(c1[mt][2 * nn], x1[mt], y1[0], y1[1], T());
        mma(c1[mt][2 * nn + 1], x1[mt], y1[2], y1[3], T());
        mma(c2[mt][2 * nn], x2[mt], y2[0], y2[1], T());
        mma(c2[mt][2 * nn + 1], x2[mt], y2[2], y2[3], T());
      }
    }
    if (BNW % 16 == 8) {  // a last 8-column tile
      u32 y1[2], y2[2];
      const int off = (bcol + BNW - 8 + lane % 8) * ROW + kk * 16 + ((lane / 8) % 2) * 8;
      ldmatrix_x2(y1, b1 + off);
      ldmatrix_x2(y2, b2 + off);
#pragma unroll
      for (int mt = 0; mt < WM; ++mt) {
        mma(c1[mt][BNW / 8 - 1], x1[mt], y1[0], y1[1], T());
        mma(c2[mt][BNW / 8 - 1], x2[mt], y2[0], y2[1], T());
      }
    }
  }
}

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

// Where a [B, H, N, D] operand's elements lie: (b, h, n, d) at b batch + h head + n row + d col
// elements from its pointer. Inputs (q, k, v, d_out, the saved out) come as MLX hands them over
// (layout_of(<name>_strides): the kernels are built with ensure_row_contiguous=False, so
// mlx-lm's transposed views are read in place, never copied); outputs are [B, N, H, D] buffers
// (token_major), returned to the caller as [B, H, N, D] views (mlx_flash/backends/common.py).
struct Layout {
  i64 batch, head, row, col;
};

template <typename S>
__device__ __forceinline__ Layout layout_of(const S& strides) {
  return Layout{strides[0], strides[1], strides[2], strides[3]};
}

__device__ __forceinline__ Layout token_major(int rows, int heads, int head_dim) {
  return Layout{(i64)rows * heads * head_dim, (i64)head_dim, (i64)heads * head_dim, 1};
}

// One (batch, head)'s rows of an operand: element (n, d) at p[n row + d col].
template <typename T>
struct Rows {
  T* p;
  i64 row, col;
  __device__ __forceinline__ Rows from(i64 n) const { return Rows{p + n * row, row, col}; }  // rows n..
  __device__ __forceinline__ T& operator()(i64 n, i64 d) const { return p[n * row + d * col]; }
};

template <typename T>
__device__ __forceinline__ Rows<T> head_rows(T* base, const Layout& l, int b, int h) {
  return Rows<T>{base + (i64)b * l.batch + (i64)h * l.head, l.row, l.col};
}

// Whether rows can be copied in 16-byte chunks: whole 8-element chunks of unit-stride columns,
// rows and base 16-byte aligned (any row-contiguous or mlx-lm layout with D % 8 == 0).
template <int HEAD_DIM, typename T>
__device__ __forceinline__ bool vector_rows(const Rows<T>& r) {
  return HEAD_DIM % 8 == 0 && r.col == 1 && r.row % 8 == 0 && aligned16(r.p);
}

// The 16-byte chunk at p (16-byte aligned) as floats, with one load.
template <typename T, int N>
__device__ __forceinline__ void load_chunk(const T* p, float (&f)[N]) {
  static_assert(N * sizeof(T) == 16, "a 16-byte chunk");
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int j = 0; j < N; ++j) f[j] = to_float(e[j]);
}

// Elements d..d+7 of row r of g as one 16-byte chunk, read one by one through g's strides (any
// layout: a broadcast's stride-0 columns, D % 8 != 0, odd strides); zeros where r >= rows_valid or
// a column >= cols. The eight loads are independent, so they are in flight together, and the
// chunk goes to shared memory with one store. One element per loop step (one load in flight, a
// 2-byte store) took 4.5x the fwd+bwd time at D = 100, where every operand takes this path (H200,
// B=2 H=16 N=4096 bf16: 43.7 against 9.7 ms; forward 12.0 against 3.4 ms); a stride-0 dO read in
// place took 51 ms a call against 17 (B=4 N=4096 D=128; the VJP copies such a cotangent: 3.5 ms).
template <typename T>
__device__ __forceinline__ uint4 gather_chunk(const Rows<const T>& g, int r, int rows_valid, int d, int cols) {
  static_assert(sizeof(T) == 2, "eight 2-byte elements");
  const unsigned short* row = reinterpret_cast<const unsigned short*>(g.p) + (i64)r * g.row;
  u32 w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int c = d + 2 * j;
    const u32 lo = r < rows_valid && c < cols ? row[(i64)c * g.col] : 0u;  // 0 bits = +0.0 (half, bf16)
    const u32 hi = r < rows_valid && c + 1 < cols ? row[(i64)(c + 1) * g.col] : 0u;
    w[j] = lo | (hi << 16);
  }
  return uint4{w[0], w[1], w[2], w[3]};
}

// A tile of ROWS x COLS elements (columns col0.. of rows 0.. of g) into shared memory rows of
// SROW elements; rows >= rows_valid and columns >= head_dim are zero-filled. vec (see
// vector_rows): 16-byte cp.async chunks, else gathered chunks (gather_chunk).
template <int ROWS, int COLS, int SROW, int THREADS, typename T>
__device__ __forceinline__ void load_tile(T* s, const Rows<const T>& g, int rows_valid, int col0, int head_dim,
                                          bool vec, int tid) {
  static_assert(COLS % 8 == 0, "whole 16-byte chunks");
  constexpr int CHUNKS = COLS / 8;
  if (vec) {
#pragma unroll
    for (int idx = tid; idx < ROWS * CHUNKS; idx += THREADS) {
      const int r = idx / CHUNKS, c = (idx % CHUNKS) * 8;
      const bool ok = r < rows_valid && col0 + c < head_dim;
      cp_async16(s + r * SROW + c, ok ? g.p + r * g.row + col0 + c : g.p, ok);
    }
  } else {
#pragma unroll 1
    for (int idx = tid; idx < ROWS * CHUNKS; idx += THREADS) {
      const int r = idx / CHUNKS, c = (idx % CHUNKS) * 8;
      *reinterpret_cast<uint4*>(s + r * SROW + c) = gather_chunk(g, r, rows_valid, col0 + c, head_dim);
    }
  }
}


// Whether query row i may see key j under causal / sliding window (band from indices only).
template <bool CAUSAL, bool WINDOW>
__device__ __forceinline__ bool band_visible(int i, int j, int diag, int wleft, int wright) {
  bool ok = true;
  if (CAUSAL) ok = ok && j <= i + diag;
  if (WINDOW) {
    if (wleft >= 0) ok = ok && j >= i + diag - wleft;
    if (wright >= 0) ok = ok && j <= i + diag + wright;
  }
  return ok;
}

// Key blocks [kb_begin, kb_end) of BN keys that query rows [q0, q_last] may see under the band.
template <bool CAUSAL, bool WINDOW, int BN>
__device__ __forceinline__ void key_block_range(int q0, int q_last, int Nk, int diag, int wleft, int wright,
                                                int& kb_begin, int& kb_end) {
  int lo = 0, hi = Nk;
  if (CAUSAL) hi = min(hi, q_last + diag + 1);
  if (WINDOW) {
    if (wleft >= 0) lo = max(lo, q0 + diag - wleft);
    if (wright >= 0) hi = min(hi, q_last + diag + wright + 1);
  }
  kb_begin = max(lo, 0) / BN;
  kb_end = hi > lo ? (hi + BN - 1) / BN : kb_begin;
}

// Query blocks [qb_begin, qb_begin + qb_count) of BN queries that see any key of [k0, k_last]
// under the band: the dK / dV kernels' counterpart of key_block_range.
template <bool CAUSAL, bool WINDOW, int BN>
__device__ __forceinline__ void query_block_range(int k0, int k_last, int Nq, int diag, int wleft, int wright,
                                                  int& qb_begin, int& qb_count) {
  int lo = 0, hi = Nq;
  if (CAUSAL) lo = max(lo, k0 - diag);
  if (WINDOW) {
    if (wright >= 0) lo = max(lo, k0 - diag - wright);
    if (wleft >= 0) hi = min(hi, k_last - diag + wleft + 1);
  }
  qb_begin = max(lo, 0) / BN;
  qb_count = hi > lo ? (hi + BN - 1) / BN - qb_begin : 0;
}

// Whether the band lets every query of [q_first, q_last] see every key of [k_first, k_last]
// (the caller checks the tile lies inside Nq x Nk): such tiles skip the per-element index tests.
template <bool CAUSAL, bool WINDOW>
__device__ __forceinline__ bool band_covers_tile(int q_first, int q_last, int k_first, int k_last, int diag,
                                                 int wleft, int wright) {
  return (!CAUSAL || k_last <= q_first + diag) &&
         (!WINDOW || ((wleft < 0 || k_first >= q_last + diag - wleft) && (wright < 0 || k_last <= q_first + diag + wright)));
}

// The block's linear index over a 2-D grid (x capped so any block count fits the grid limits).
__device__ __forceinline__ i64 linear_block() {
  return (i64)blockIdx.y * gridDim.x + blockIdx.x;
}

// Splits `rest` (the CTA's index without its column slice) into (block, head) for `nblocks`
// blocks per head. Head-major keeps a head's blocks adjacent (K/V stay hot in L2); block-major
// puts block b of every head before block b + 1 of any: the GPU starts CTAs in index order, so
// under causal masks, where block work differs by up to nblocks times, the longest go first and
// the short ones fill the tail (longest-processing-time-first scheduling).
__device__ __forceinline__ void block_of(i64 rest, int nblocks, bool block_major, i64 heads, int& block, i64& head) {
  if (block_major) {
    block = (int)(rest / heads);
    head = rest % heads;
  } else {
    block = (int)(rest % nblocks);
    head = rest / nblocks;
  }
}

// The (query block, batch * head) of a query-side CTA (forward, dQ) from its index `rest` (without
// its column slice). Under a causal mask the blocks go in reverse, so the longest rows start first:
// better tail balance.
template <bool CAUSAL>
__device__ __forceinline__ void query_block_of(i64 rest, int nqb, const i64* ip, int Hq, int& qb, i64& bh) {
  block_of(rest, nqb, ip[P_BLOCK_MAJOR] != 0, ip[P_BATCH] * Hq, qb, bh);
  if (CAUSAL) qb = nqb - 1 - qb;
}

}  // namespace mlxflash

namespace mlxflash {

// One element's final score in log2 units (scores * log2(e)), -inf where masked.
// raw = q . k; `t` receives tanh(raw * scale / cap) when SOFTCAP (the backward needs 1 - t^2).
// MASK_KIND: 0 none, 1 bool (nonzero = keep), 2 additive; `m` is the element's mask value as a
// float (MaskRegs::value) or a pointer to it, read only for a visible element (where the entry is
// read at use, reading it for every element cost ptxas 64-272 more spilled bytes in dK/dV).
__device__ __forceinline__ float mask_value(float m) { return m; }
template <typename MaskT>
__device__ __forceinline__ float mask_value(const MaskT* m) { return to_float(*m); }

template <bool SOFTCAP, int MASK_KIND, typename M>
__device__ __forceinline__ float score_log2(float raw, bool visible, M m, float scale, float scale_log2, float cap,
                                            float& t) {
  constexpr float LOG2E = 1.4426950408889634f;
  if (!visible) return -INFINITY;
  if (!SOFTCAP && MASK_KIND == 0) return raw * scale_log2;
  float s = raw * scale;
  if (SOFTCAP) {
    t = fast_tanh(raw * (scale / cap));  // scale / cap is loop-invariant: computed once per kernel
    s = cap * t;
  }
  if (MASK_KIND == 1) {
    if (mask_value(m) == 0.f) return -INFINITY;
  } else if (MASK_KIND == 2) {
    s += mask_value(m);
  }
  return s * LOG2E;
}

// Two adjacent mask entries (columns c, c + 1) in one load (p aligned to both), as floats.
template <int BYTES>
struct PairWord;
template <>
struct PairWord<1> {
  typedef unsigned short type;
};
template <>
struct PairWord<2> {
  typedef unsigned type;
};
template <>
struct PairWord<4> {
  typedef unsigned long long type;
};
template <typename MaskT>
__device__ __forceinline__ void load_mask_pair(const MaskT* p, float (&v)[2]) {
  const typename PairWord<sizeof(MaskT)>::type word = *reinterpret_cast<const typename PairWord<sizeof(MaskT)>::type*>(p);
  const MaskT* e = reinterpret_cast<const MaskT*>(&word);
  v[0] = to_float(e[0]);
  v[1] = to_float(e[1]);
}

// An array mask's entries for one thread's scores of a tile, in the MMA accumulator layout: two
// rows (hf) x NS n8 tiles (n) x two adjacent columns (e), column c0 + 8 n + 2 tq + e. load() sets
// where they lie (beside the tile's MMAs); value() reads an entry where the softmax uses it.
// Against reading through a pointer built per element in the softmax loop: additive-masked wgmma
// forward at D=128 0.80x its time, fwd+bwd 0.90x; bool unchanged (H100, N=4096,
// benchmarks/RESULTS.md). Holding a tile's entries in registers instead (two per integer load,
// issued beside the MMAs) made ptxas spill in dK/dV and was never measured on a GPU: not kept.
template <int MASK_KIND, int NS, typename MaskT>
struct MaskRegs {
  const MaskT* rows[2];
  int c0, climit;
  i64 cstride;
  bool paired;  // every thread of the warp may read its entries in pairs (pair_inside)

  // rows_[hf]: the mask entry of this thread's row hf at column 0 (a row past the problem clamped
  // to its last); columns at or past climit read column climit - 1 (their scores are not visible).
  __device__ __forceinline__ void load(const MaskT* const (&rows_)[2], int c0_, int climit_, i64 cstride_, int tq) {
    if (MASK_KIND == 0) return;
    rows[0] = rows_[0];
    rows[1] = rows_[1];
    c0 = c0_ + 2 * tq;
    climit = climit_;
    cstride = cstride_;
    // Pairs: entries contiguous along the columns and each pair aligned to its size (c0 is even).
    constexpr unsigned PAIR = 2 * sizeof(MaskT);
    const bool aligned = (((unsigned long long)(rows[0] + c0) | (unsigned long long)(rows[1] + c0)) % PAIR) == 0;
    paired = __all_sync(0xffffffffu, cstride == 1 && aligned);
  }

  __device__ __forceinline__ float value(int hf, int n, int e) const {
    if (MASK_KIND == 0) return 0.f;
    return to_float(rows[hf][(i64)min(c0 + 8 * n + e, climit - 1) * cstride]);
  }
  // The same where every column of the tile lies before climit (no clamp).
  __device__ __forceinline__ float value_inside(int hf, int n, int e) const {
    if (MASK_KIND == 0) return 0.f;
    return to_float(rows[hf][(i64)(c0 + 8 * n + e) * cstride]);
  }
  // Both entries (e = 0, 1) of n8 tile n in one load, inside the tile: only where paired. Against
  // one load per entry, the masked forward 0.77x (bool) / 0.78-0.84x (additive) its time (H100).
  __device__ __forceinline__ void pair_inside(int hf, int n, float (&v)[2]) const {
    load_mask_pair(rows[hf] + c0 + 8 * n, v);
  }
};

// Lazy rescaling (LAZY): the running max of a softmax row moves only when a block's maximum
// exceeds it by more than MAX_SLACK (log2 units). Below that, P = exp2(S - running max) <= 2^8:
// fp32 row sums and O accumulators have room to spare, and P rounded to bf16 / fp16 keeps its
// relative precision, so O / l and lse are the same function; but a step whose rows all keep
// their max leaves O alone (rescale_output skips the warp's multiplies), which after the first
// blocks is most steps (FlashAttention-4 rescales the same way, with the same threshold).
// It pays only where O is wide and an MMA is in flight beside the softmax: H100 wgmma forward,
// CUPTI, against rescaling every step: D=160 3 %, D=256 6 % faster, D=128 2-3 % slower, D=64
// 12-13 % slower (the branch splits the step's code, and ptxas no longer interleaves the
// multiplies with the softmax's latencies); the synchronous mma.sync forward was 1.5-5.5 % slower
// at D >= 256. Only attention_forward_wgmma.cu sets LAZY (DP > 128).
constexpr float MAX_SLACK = 8.f;

// One step of the forward's online softmax for one 16-row m-tile, in the accumulator layout of
// mma.sync (and of wgmma, per warp): this thread holds rows row0 and row0 + 8, columns
// 8 n + 2 tq (+1) of the BN keys from key0. Scores become log2 units with the masks applied,
// then P = exp2(S - running max) replaces them in s; row sums grow, and corr receives the factor
// exp2(old max - new max) that O must be scaled by (rescale_output) before P V is added: exactly
// 1 where the running max stays (LAZY: MAX_SLACK). FOLD: interior tiles without a mask or softcap
// keep the raw scores and scale them in exp2's FFMA (where the scale is positive; see below).
// full_block: every element is visible (skips the index tests). SUMS = false: the caller's tensor
// cores sum P (the wgmma forward's MMA_SUMS), so row_sum is left alone.
template <bool CAUSAL, bool WINDOW, bool SOFTCAP, int MASK_KIND, bool LAZY = false, bool FOLD = false,
          bool SUMS = true, int NS, typename MaskT>
__device__ __forceinline__ void softmax_scores_tile(float (&s)[NS][4], float (&corr)[2], float (&row_max)[2],
                                                    float (&row_sum)[2], const MaskRegs<MASK_KIND, NS, MaskT>& masks,
                                                    int row0, int key0, bool full_block, int Nq, int Nk, int diag,
                                                    int wleft, int wright, float scale, float scale_log2, float cap,
                                                    int tq) {
  float mx[2] = {row_max[0], row_max[1]};  // the two rows' running maxima
  // P = exp2(s * exp_scale - max) below: s is in log2 units (exp_scale 1, an exact product) or,
  // where the scale is folded, the raw q . k (exp_scale scale_log2).
  constexpr bool FOLDS = FOLD && MASK_KIND == 0 && !SOFTCAP;
  float exp_scale = 1.f;
  if (FOLDS && full_block && scale_log2 > 0.f) {
    // Interior tile, no mask, positive scale: the scale folded into exp2's FFMA, one instruction
    // per score fewer. The maximum of the raw scores times scale_log2 is the maximum of the
    // scaled ones (rounding is monotone); a negative scale would reverse it, and a zero or
    // negative one takes the unfolded path. Against the unfolded wgmma forward (H200, B=4 H=16
    // N=4096, interleaved): 0.914x (D = 64) / 0.941x (D = 128) the time, 0.97-0.98x at D = 192 /
    // 256; without the branch, before the TMA loads, it had measured 3-6 % slower
    // (docs/cuda_notes.md). Only the wgmma forward takes FOLD, where its table row has
    // the scale_fold option (cuda_source.SCALE_FOLD); the mma.sync forward does not: there
    // ptxas spilled with it (sm_86 D = 128: 0 -> 40 bytes), and it was never timed.
    exp_scale = scale_log2;
    float raw[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < NS; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) raw[e / 2] = fmaxf(raw[e / 2], s[n][e]);
    mx[0] = fmaxf(mx[0], raw[0] * scale_log2);
    mx[1] = fmaxf(mx[1], raw[1] * scale_log2);
  } else if (MASK_KIND == 0 && !SOFTCAP && full_block) {
    // Interior tile, no mask: no index arithmetic. (The general loop below, for every tile, made
    // the wgmma forward issue ~25 instructions per score on H100, most of them integer ones.)
#pragma unroll
    for (int n = 0; n < NS; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[n][e] *= scale_log2;
        mx[e / 2] = fmaxf(mx[e / 2], s[n][e]);
      }
  } else if (MASK_KIND != 0 && full_block) {
    // Interior tile with an array mask: every score is inside the problem and the band, so only
    // the mask decides (no index tests, no clamped columns; rows past Nq read row Nq - 1's
    // entries and are never stored). Masked tiles used to take the edge path below (ncu, D=128
    // forward: 2.5x / 2.9x the unmasked kernel's instructions, additive / bool); with this path
    // in every kernel a masked fwd+bwd took 0.49-0.51x (bool) / 0.81x (additive) its time, with
    // the pairs 0.41-0.43x / 0.67-0.75x (H100, D = 64 / 128, N=4096; RESULTS.md).
    auto masked_score = [&](int hf, int n, int e, float m) {
      float t;
      const float v2 = score_log2<SOFTCAP, MASK_KIND>(s[n][2 * hf + e], true, m, scale, scale_log2, cap, t);
      s[n][2 * hf + e] = v2;
      mx[hf] = fmaxf(mx[hf], v2);
    };
    if (masks.paired) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
#pragma unroll
        for (int n = 0; n < NS; ++n) {
          float m[2];
          masks.pair_inside(hf, n, m);
          masked_score(hf, n, 0, m[0]);
          masked_score(hf, n, 1, m[1]);
        }
    } else {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) masked_score(hf, n, e, masks.value_inside(hf, n, e));
    }
  } else {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int i = row0 + 8 * hf;
#pragma unroll
      for (int n = 0; n < NS; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = key0 + n * 8 + 2 * tq + e;
          float t;
          bool visible = true;
          if (!full_block || MASK_KIND != 0)
            visible = j < Nk && i < Nq && band_visible<CAUSAL, WINDOW>(i, j, diag, wleft, wright);
          const float v2 = score_log2<SOFTCAP, MASK_KIND>(s[n][2 * hf + e], visible, masks.value(hf, n, e), scale,
                                                          scale_log2, cap, t);
          s[n][2 * hf + e] = v2;
          mx[hf] = fmaxf(mx[hf], v2);
        }
    }
  }
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const float m = quad_max(mx[hf]);  // >= row_max[hf]: mx started from it
    // LAZY: the row keeps its max unless m is more than MAX_SLACK above it (a max of -inf,
    // nothing visible yet, moves to any finite m).
    const float m_new = LAZY && !(m > row_max[hf] + MAX_SLACK) ? row_max[hf] : m;
    const float m_use = m_new == -INFINITY ? 0.f : m_new;
    corr[hf] = LAZY && m_new == row_max[hf] ? 1.f : fast_exp2(row_max[hf] - m_use);
    row_max[hf] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int n = 0; n < NS; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float p = fast_exp2(FOLDS ? fmaf(s[n][2 * hf + e], exp_scale, -m_use) : s[n][2 * hf + e] - m_use);
        s[n][2 * hf + e] = p;
        if (SUMS) sum += p;
      }
    if (SUMS) row_sum[hf] = row_sum[hf] * corr[hf] + sum;
  }
}

// O (rows row0, row0 + 8 of the m-tile) scaled by softmax_scores_tile's correction factors;
// LAZY: nothing to do (a warp-uniform branch) where every row of the warp kept its max.
template <bool LAZY = false, int NO>
__device__ __forceinline__ void rescale_output(float (&o)[NO][4], const float (&corr)[2]) {
  if (LAZY && !__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) return;
#pragma unroll
  for (int n = 0; n < NO; ++n) {
    o[n][0] *= corr[0];
    o[n][1] *= corr[0];
    o[n][2] *= corr[1];
    o[n][3] *= corr[1];
  }
}

// softmax_scores_tile and rescale_output together (when O is not being accumulated meanwhile).
template <bool CAUSAL, bool WINDOW, bool SOFTCAP, int MASK_KIND, int NS, int NO, typename MaskT>
__device__ __forceinline__ void online_softmax_tile(float (&s)[NS][4], float (&o)[NO][4], float (&row_max)[2],
                                                    float (&row_sum)[2], const MaskRegs<MASK_KIND, NS, MaskT>& masks,
                                                    int row0, int key0, bool full_block, int Nq, int Nk, int diag,
                                                    int wleft, int wright, float scale, float scale_log2, float cap,
                                                    int tq) {
  float corr[2];
  softmax_scores_tile<CAUSAL, WINDOW, SOFTCAP, MASK_KIND>(s, corr, row_max, row_sum, masks, row0, key0, full_block,
                                                          Nq, Nk, diag, wleft, wright, scale, scale_log2, cap, tq);
  rescale_output(o, corr);
}

// One accumulator row (half hf of a 16-row m-tile: row0 + 8 hf) times factor into `row`, columns
// col0 + 8 n + 2 tq (+1) < HEAD_DIM; the gradient and output epilogues below share it.
template <int HEAD_DIM, int NO, typename T>
__device__ __forceinline__ void store_scaled_row(const float (&acc)[NO][4], int hf, T* row, int col0, float factor,
                                                 int tq) {
#pragma unroll
  for (int n = 0; n < NO; ++n) {
    const int c = col0 + n * 8 + 2 * tq;
    const float x = acc[n][2 * hf] * factor, y = acc[n][2 * hf + 1] * factor;
    if (HEAD_DIM % 2 == 0) {
      if (c < HEAD_DIM) store2(row + c, x, y);
    } else {
      if (c < HEAD_DIM) store1(row + c, x);
      if (c + 1 < HEAD_DIM) store1(row + c + 1, y);
    }
  }
}

// A gradient tile's epilogue (dQ, dK or dV) for one 16-row m-tile in the accumulator layout
// (rows row0 and row0 + 8, columns col0 + 8 n + 2 tq (+1)): factor * acc stored for rows <
// rows_valid and columns < HEAD_DIM of `base` (an output's rows: unit column stride, row 0 =
// tile row 0).
template <int HEAD_DIM, int NO, typename T>
__device__ __forceinline__ void store_gradient_tile(const float (&acc)[NO][4], int row0, int rows_valid, int col0,
                                                    const Rows<T>& base, float factor, int tq) {
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = row0 + 8 * hf;
    if (r >= rows_valid) continue;
    store_scaled_row<HEAD_DIM>(acc, hf, base.p + r * base.row, col0, factor, tq);
  }
}

// A row's softmax statistics at the end of the forward, from its max (log2 units) and its summed
// row sum l: the factor that normalizes O (0 for a row that saw no key) and its log-sum-exp
// L = max * ln 2 + ln(l) (natural log, -inf for a row that saw no key).
__device__ __forceinline__ float row_inverse_sum(float l) { return l > 0.f ? 1.f / l : 0.f; }
__device__ __forceinline__ float row_lse(float row_max, float l) {
  return l > 0.f ? row_max * 0.6931471805599453f + logf(l) : -INFINITY;
}

// The forward's epilogue for one 16-row m-tile (layout as above): O / rowsum stored for rows
// < Nq and columns col0 + 8 n + 2 tq (+1) < HEAD_DIM of out (this head's rows, unit column stride);
// the row's lse (row_lse) into lse when non-null.
template <int HEAD_DIM, int NO, typename T>
__device__ __forceinline__ void store_output_tile(const float (&o)[NO][4], const float (&row_max)[2],
                                                  const float (&row_sum)[2], int row0, int Nq, int col0,
                                                  const Rows<T>& out, float* lse, int tq) {
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int i = row0 + 8 * hf;
    const float l = quad_sum(row_sum[hf]);
    const float inv = row_inverse_sum(l);
    if (i < Nq) {
      store_scaled_row<HEAD_DIM>(o, hf, out.p + i * out.row, col0, inv, tq);
      if (lse != nullptr && tq == 0) lse[i] = row_lse(row_max[hf], l);
    }
  }
}

}  // namespace mlxflash

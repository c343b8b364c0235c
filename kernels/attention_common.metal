// Shared helpers of the mlx-flash attention kernels (forward, backward dQ, backward dK/dV).
//
// Passed as the `header=` of mx.fast.metal_kernel; the kernel bodies (attention_*.metal) bake
// their compile-time constants in and call these templates. Everything here is documented MSL:
// simdgroup_matrix<float, 8, 8> multiply-accumulate with same-type operands (as MLX's steel
// attention), per-lane element access through thread_elements(), threadgroup tiles with a
// compile-time size, simd_shuffle_xor row reductions.
//
// Layout conventions (MFA's, see ALGORITHM.md):
//  * A simdgroup owns 8 rows of the parallel dimension. An 8x8 fragment gives each lane two
//    adjacent elements of one row: row y = (lane / 16) * 4 + (lane / 2) % 4, columns x, x + 1
//    with x = ((lane / 4) & 2) * 2 + (lane % 2) * 2 (fragment_coord).
//  * Lanes l, l^1, l^8, l^9 share a row, so row reductions are two shuffles (xor 1, xor 8).
//  * Operands streamed along the traversal dimension (K, V in forward/dQ; Q, dO in dK/dV) are
//    staged in threadgroup memory one T x H tile at a time, in the input dtype, and read into
//    fp32 fragments; operands of the parallel dimension are read by each lane from device memory.
//  * All fragments fed to simdgroup_multiply_accumulate are fp32: fp16/bf16 inputs are exact in
//    fp32, so products are exact and sums are fp32 (mixed precision). Cached input operands may
//    be held as half pairs (cache_t) to halve their registers.
//  * Inputs q, k, v, d_out and the saved output are read where they lie, through the strides
//    mx.fast.metal_kernel passes (`<name>_strides`: element (b, h, n, d) at b s0 + h s1 + n s2 +
//    d s3), so MLX's transposed [B, N, H, D] views are not copied. Outputs out, dq, dk, dv are
//    written as [B, N, H, D] buffers (the backend returns them as [B, H, N, D] views, as MLX's
//    own Metal attention does); lse, delta, masks and the fp32 spill buffers are row-contiguous.
//
// Why this shape (numbers from Metal FlashAttention, MFA, measured on M1 Max / M3 / M4):
//  * Skewed blocks, small P and long T (P = 16 on the M3 family, 32 on M1; T = 32..128): an
//    accumulator that does not fit in registers is spilled to its fp32 buffer, one 8 x H load +
//    store per simdgroup per T keys, next to 8 x T x H FMAs of math: 8 / T bytes per FMA
//    (1/16 at T = 128), small enough that spilling beats running out of registers. This is what
//    lets one kernel serve any head dim (MFA: D up to 384 at the same block table row).
//  * Register caching per operand follows MFA's per-(D, precision, family) table
//    (kernels/blocks_metal.txt): e.g. the mixed-precision forward caches Q and O up to D = 96,
//    then O only, then nothing; MFA reports ~4400 G instructions/s (83% of the M1 Max ALU
//    roofline, 5308 peak) in the forward and 62-71% utilisation for forward + backward.
//  * Two backward kernels without atomics (7 products instead of FlashAttention-2's 5): Apple
//    GPUs have no fast float atomics, and it makes gradients bitwise reproducible.
//  * dK/dV computes dV += P^T dO and dP^T = V dO^T from the same staged dO tile (one tile load
//    and two barriers per D-block fewer than MFA's separate passes).
//  Nothing here has been tuned on hardware (no Apple GPU was available): the table is MFA's.
#include <metal_stdlib>
#include <metal_simdgroup>
#include <metal_simdgroup_matrix>
using namespace metal;

#define ATTN_FUNC inline __attribute__((always_inline))
#define ATTN_LOG2E 1.4426950408889634f
#define ATTN_LN2 0.6931471805599453f

// This lane's two elements of an 8x8 fp32 fragment (see fragment_coord for which). Fragments
// live in registers as plain vectors; simdgroup_matrix values exist only inside mma(), as in
// MLX's steel MMA and MFA's simdgroup_matrix_storage.
typedef float2 frag_t;

// c += a * b on 8x8 fragments held across the simdgroup.
ATTN_FUNC void mma(thread frag_t& c, frag_t a, frag_t b) {
  simdgroup_matrix<float, 8, 8> a_mat;
  simdgroup_matrix<float, 8, 8> b_mat;
  simdgroup_matrix<float, 8, 8> c_mat;
  reinterpret_cast<thread float2&>(a_mat.thread_elements()) = a;
  reinterpret_cast<thread float2&>(b_mat.thread_elements()) = b;
  reinterpret_cast<thread float2&>(c_mat.thread_elements()) = c;
  simdgroup_multiply_accumulate(c_mat, a_mat, b_mat, c_mat);
  c = reinterpret_cast<thread float2&>(c_mat.thread_elements());
}

// (column, row) inside an 8x8 fragment of this lane's first element; the second is column + 1.
ATTN_FUNC ushort2 fragment_coord(ushort lane) {
  const ushort quad = lane / 4;
  return ushort2((quad & 2) * 2 + (lane % 2) * 2, (quad & 4) + (lane / 2) % 4);
}

// Reductions over one fragment row: its 4 column pairs are held by lanes l, l^1, l^8, l^9.
ATTN_FUNC float row_max(float v) {
  v = max(v, simd_shuffle_xor(v, ushort(1)));
  return max(v, simd_shuffle_xor(v, ushort(8)));
}

ATTN_FUNC float row_sum(float v) {
  v += simd_shuffle_xor(v, ushort(1));
  return v + simd_shuffle_xor(v, ushort(8));
}

// ---------------------------------------------------------------------------------------------
// Per-lane loads and stores of the parallel-dimension operands (device memory)
// ---------------------------------------------------------------------------------------------

// Elements [col, col + 1] of one row, zero past `cols` or when the row is past the end.
template <typename Ptr>
ATTN_FUNC float2 load_pair(Ptr row_ptr, int col, int cols, bool row_ok) {
  float2 value = float2(0.0f);
  if (row_ok) {
    if (col < cols) value.x = float(row_ptr[col]);
    if (col + 1 < cols) value.y = float(row_ptr[col + 1]);
  }
  return value;
}

// The same for a row of an input read where it lies, whose elements are `step` apart (its last
// stride; 1 in every layout MLX makes but a transposed head dim: that case takes the branch).
template <typename Ptr>
ATTN_FUNC float2 load_strided_pair(Ptr row_ptr, int col, int cols, bool row_ok, long step) {
  if (step == 1) return load_pair(row_ptr, col, cols, row_ok);
  float2 value = float2(0.0f);
  if (row_ok) {
    if (col < cols) value.x = float(row_ptr[col * step]);
    if (col + 1 < cols) value.y = float(row_ptr[(col + 1) * step]);
  }
  return value;
}

template <typename OutT, typename Ptr>
ATTN_FUNC void store_pair(Ptr row_ptr, int col, int cols, bool row_ok, float2 value) {
  if (row_ok) {
    if (col < cols) row_ptr[col] = OutT(value.x);
    if (col + 1 < cols) row_ptr[col + 1] = OutT(value.y);
  }
}

// W / 8 pairs of one input row (elements `step` apart), columns col0 + [0, W) (col0 includes
// the lane's column offset).
template <int W, typename AT, typename Ptr>
ATTN_FUNC void load_row_pairs(thread vec<AT, 2>* dst, Ptr row_ptr, int col0, int cols, bool row_ok,
                              long step) {
#pragma clang loop unroll(full)
  for (int d = 0; d < W; d += 8) {
    dst[d / 8] = vec<AT, 2>(load_strided_pair(row_ptr, col0 + d, cols, row_ok, step));
  }
}

// An accumulator block (W / 8 fragments) read back from its fp32 spill buffer.
template <int W, typename Ptr>
ATTN_FUNC void load_row_frags(thread frag_t* dst, Ptr row_ptr, int col0, int cols, bool row_ok) {
#pragma clang loop unroll(full)
  for (int d = 0; d < W; d += 8) {
    dst[d / 8] = load_pair(row_ptr, col0 + d, cols, row_ok);
  }
}

// factor * (W / 8 fragments) written to columns col0 + [0, W) of one row.
template <int W, typename OutT, typename Ptr>
ATTN_FUNC void store_row_frags(Ptr row_ptr, thread frag_t* src, float factor, int col0, int cols,
                               bool row_ok) {
#pragma clang loop unroll(full)
  for (int d = 0; d < W; d += 8) {
    store_pair<OutT>(row_ptr, col0 + d, cols, row_ok, src[d / 8] * factor);
  }
}

template <int N>
ATTN_FUNC void zero_frags(thread frag_t* frags) {
#pragma clang loop unroll(full)
  for (int i = 0; i < N; ++i) {
    frags[i] = float2(0.0f);
  }
}

// Multiplies the first `width` columns (a multiple of 8) of a W-wide block by `factor`.
template <int W>
ATTN_FUNC void scale_frags(thread frag_t* frags, float factor, int width) {
#pragma clang loop unroll(full)
  for (int d = 0; d < W; d += 8) {
    if (d < width) frags[d / 8] *= factor;
  }
}

// ---------------------------------------------------------------------------------------------
// Threadgroup tiles of the traversal-dimension operands
// ---------------------------------------------------------------------------------------------

// Copies rows row0 + [0, ROWS) and columns col0 + [0, COLS) of a matrix read where it lies
// (element (r, c) at src[r * ld + c * step]) into `tile` (row stride LD), zero-filling rows >=
// `rows` and columns >= `cols` so padded rows and columns add nothing to the products. Only the
// 8-row fragments that hold valid rows are written (the products skip the others).
template <bool UNIT_STEP, int ROWS, int COLS, int LD, int NTHREADS, typename TileT, typename TilePtr,
          typename Ptr>
ATTN_FUNC void copy_tile(TilePtr tile, Ptr src, long ld, long step, int row0, int rows, int col0,
                         int cols, ushort tid) {
  const int valid_rows = min(ROWS, (rows - row0 + 7) / 8 * 8);
  for (int i = tid; i < valid_rows * COLS; i += NTHREADS) {
    const int r = i / COLS;
    const int c = i % COLS;
    const int src_row = row0 + r;
    const int src_col = col0 + c;
    TileT value = TileT(0.0f);
    if (src_row < rows && src_col < cols) {
      value = TileT(src[long(src_row) * ld + (UNIT_STEP ? long(src_col) : src_col * step)]);
    }
    tile[r * LD + c] = value;
  }
}

// copy_tile with barriers on both sides: the previous tile's readers are done before it is
// overwritten, and the new tile is complete before use. The step is uniform over the
// threadgroup: the common unit step (adjacent columns) keeps its own loop without a multiply.
template <int ROWS, int COLS, int LD, int NTHREADS, typename TileT, typename TilePtr, typename Ptr>
ATTN_FUNC void stage_tile(TilePtr tile, Ptr src, long ld, long step, int row0, int rows, int col0,
                          int cols, ushort tid) {
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (step == 1) {
    copy_tile<true, ROWS, COLS, LD, NTHREADS, TileT>(tile, src, ld, step, row0, rows, col0, cols, tid);
  } else {
    copy_tile<false, ROWS, COLS, LD, NTHREADS, TileT>(tile, src, ld, step, row0, rows, col0, cols, tid);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// ---------------------------------------------------------------------------------------------
// The two tile products. C fragments hold 8 rows of this simdgroup. Fragments starting at or
// past `d_limit` (head columns) or `t_limit` (traversal rows) are skipped: they only hold the
// zero padding of the last D-block or of the last traversal block.
// ---------------------------------------------------------------------------------------------

// C (8 x T, T / 8 fragments) += A (8 x W, W / 8 lane pairs) * B^T, with B = tile (T x W).
template <int T, int W, int LD, typename AT, typename TilePtr>
ATTN_FUNC void gemm_abt(thread frag_t* C, thread vec<AT, 2>* A, TilePtr tile, int d_limit,
                        int t_limit, ushort2 lc) {
#pragma clang loop unroll(full)
  for (int d = 0; d < W; d += 8) {
    if (d < d_limit) {
      const frag_t a = float2(A[d / 8]);
#pragma clang loop unroll(full)
      for (int t = 0; t < T; t += 8) {
        if (t < t_limit) {
          // b(row = head column dd, col = traversal row tt) = tile[t + tt][d + dd].
          const auto b_src = tile + (t + lc.x) * LD + d + lc.y;
          mma(C[t / 8], a, float2(float(b_src[0]), float(b_src[LD])));
        }
      }
    }
  }
}

// C (8 x W, W / 8 fragments) += A (8 x T, T / 8 fragments) * B, with B = tile (T x W).
template <int T, int W, int LD, typename TilePtr>
ATTN_FUNC void gemm_ab(thread frag_t* C, thread frag_t* A, TilePtr tile, int d_limit, int t_limit,
                       ushort2 lc) {
#pragma clang loop unroll(full)
  for (int t = 0; t < T; t += 8) {
    if (t < t_limit) {
#pragma clang loop unroll(full)
      for (int d = 0; d < W; d += 8) {
        if (d < d_limit) {
          // b(row = traversal row tt, col = head column dd) = tile[t + tt][d + dd].
          const auto b_src = tile + (t + lc.y) * LD + d + lc.x;
          mma(C[d / 8], A[t / 8], float2(float(b_src[0]), float(b_src[1])));
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Scores: scale, softcap, masks
// ---------------------------------------------------------------------------------------------

struct ScoreContext {
  float scale;    // multiplies q . k
  float cap;      // softcap c (when compiled in)
  float inv_cap;  // 1 / c
  int diagonal;   // Nk - Nq (+ AttentionSpec.diagonal_shift): query i's own key is i + diagonal
  int left;       // sliding window sides, -1 = unbounded
  int right;
};

// Whether query i may see key j under the causal / sliding-window band (FA2 semantics).
template <bool CAUSAL, bool WINDOW>
ATTN_FUNC bool band_visible(int i, int j, thread const ScoreContext& ctx) {
  const int own = i + ctx.diagonal;
  bool visible = true;
  if (CAUSAL) visible = visible && j <= own;
  if (WINDOW) {
    if (ctx.left >= 0) visible = visible && j >= own - ctx.left;
    if (ctx.right >= 0) visible = visible && j <= own + ctx.right;
  }
  return visible;
}

// The final score of (query, key) in base 2 (log2(e) * natural score), -inf when masked.
// raw = q . k. softcap_grad receives d(final)/d(scaled score) = 1 - tanh^2 (1 without softcap).
// The array mask element is mask_line[mask_index * mask_step] (strides 0 where it broadcasts);
// MASK_KIND: 0 none, 1 bool (true = keep), 2 additive. The mask is read only for in-bounds,
// band-visible pairs.
template <bool CAUSAL, bool WINDOW, bool SOFTCAP, int MASK_KIND, typename MaskPtr>
ATTN_FUNC float final_score(float raw, int query, int key, bool in_bounds, MaskPtr mask_line,
                            long mask_index, long mask_step, thread const ScoreContext& ctx,
                            thread float& softcap_grad) {
  float s = raw * ctx.scale;
  softcap_grad = 1.0f;
  if (SOFTCAP) {
    const float t = tanh(s * ctx.inv_cap);
    s = t * ctx.cap;
    softcap_grad = 1.0f - t * t;
  }
  bool visible = in_bounds && band_visible<CAUSAL, WINDOW>(query, key, ctx);
  if (MASK_KIND == 1 && visible) {
    // Through float: one conversion every mask dtype has (bool, half, bfloat16_t, float).
    visible = float(mask_line[mask_index * mask_step]) != 0.0f;
  }
  if (MASK_KIND == 2 && visible) {
    s += float(mask_line[mask_index * mask_step]);
  }
  return visible ? s * ATTN_LOG2E : -INFINITY;
}

// Keys [lo, hi) that queries [q_first, q_last] may see under the band (spec.key_range).
template <bool CAUSAL, bool WINDOW>
ATTN_FUNC int2 key_range(int q_first, int q_last, int kv_len, thread const ScoreContext& ctx) {
  int lo = 0;
  int hi = kv_len;
  if (CAUSAL) hi = min(hi, q_last + ctx.diagonal + 1);
  if (WINDOW) {
    if (ctx.left >= 0) lo = max(lo, q_first + ctx.diagonal - ctx.left);
    if (ctx.right >= 0) hi = min(hi, q_last + ctx.diagonal + ctx.right + 1);
  }
  return int2(max(lo, 0), min(hi, kv_len));
}

// Queries [lo, hi) that may see any of keys [k_first, k_last] under the band (spec.query_range).
template <bool CAUSAL, bool WINDOW>
ATTN_FUNC int2 query_range(int k_first, int k_last, int q_len, thread const ScoreContext& ctx) {
  int lo = 0;
  int hi = q_len;
  if (CAUSAL) lo = max(lo, k_first - ctx.diagonal);
  if (WINDOW) {
    if (ctx.right >= 0) lo = max(lo, k_first - ctx.diagonal - ctx.right);
    if (ctx.left >= 0) hi = min(hi, k_last - ctx.diagonal + ctx.left + 1);
  }
  return int2(max(lo, 0), min(hi, q_len));
}

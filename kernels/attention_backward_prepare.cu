// Backward preprocessing, LANES threads per query row r = (b Hq + h) Nq + i (O and dO through
// their strides):
//   delta[r] = rowsum(dO[r] * O[r]) - dL[r]   (fp32; dL = cotangent of lse, if any)
//   lse2[r]  = L[r] * log2(e), or +inf where L = -inf (then P = exp2(S - lse2) = 0 for that row).
// A row's lanes read 16-byte chunks where the rows allow (vector_rows: any row-contiguous or
// mlx-lm layout with D % 8 == 0), element by element otherwise; LANES = the row's 8-element
// chunks rounded up to a power of two (at most a warp), so a lane issues one or two loads per
// operand at D <= 512. With one warp per row and 2-byte loads the kernel took 77 us at B=4 H=16
// N=4096 D=128 (H200, ncu; 37% of DRAM bandwidth for 128 MB read), against cuDNN's 68 us.
// COUNT_BLOCK > 0 (the wgmma dK/dV kernel's fused dQ, attention_backward_key_value_wgmma.cu):
// also zeroes dq_order, COUNT_CHAINS counts per (batch, query head, block of COUNT_BLOCK queries),
// which that kernel then updates. MLX's cuda_kernel can only fill all of a kernel's outputs
// (init_value), and filling the dK/dV kernel's (dK, dV and dQ's fp32 accumulator, which the
// kernel writes in full anyway) took 0.12 ms of a 2.9 ms backward at B=4 H=16 N=4096 D=128 and
// 0.31 of 10.3 ms at B=1 N=16384 (H100); here the zeros cost one store per count.
namespace mlxflash {
namespace prep {
typedef {{input_type}} T;
constexpr int HEAD_DIM = {{head_dim}};
constexpr bool HAS_DLSE = {{has_d_lse}};
constexpr int COUNT_BLOCK = {{count_block}};
constexpr int COUNT_CHAINS = {{count_chains}};
constexpr int THREADS = {{threads}};
constexpr int LANES = {{lanes}};                 // threads per row
constexpr int ROWS_PER_BLOCK = THREADS / LANES;
constexpr int ELEMS = 16 / (int)sizeof(T);       // elements of a 16-byte chunk
static_assert(LANES >= 1 && LANES <= 32 && (LANES & (LANES - 1)) == 0 && THREADS % 32 == 0, "lanes of a warp");
}  // namespace prep

__device__ void attention_backward_prepare(const prep::T* __restrict__ out, const prep::T* __restrict__ d_out,
                                           const Layout lo, const Layout ldo, const float* __restrict__ lse, const float* __restrict__ d_lse,
                                           const i64* __restrict__ ip, float* __restrict__ delta,
                                           float* __restrict__ lse2, int* __restrict__ dq_order) {
  using namespace prep;
  const i64 rows = ip[P_BATCH] * ip[P_QHEADS] * ip[P_QLEN];
  const i64 warp_row = linear_block() * ROWS_PER_BLOCK + threadIdx.x / 32 * (32 / LANES);
  if (warp_row >= rows) return;  // the whole warp: every lane that stays takes part in the shuffles
  const int lane = threadIdx.x % LANES;
  const i64 r = warp_row + threadIdx.x % 32 / LANES;
  const bool valid = r < rows;
  const int Hq = (int)ip[P_QHEADS], Nq = (int)ip[P_QLEN];
  float acc = 0.f;
  if (valid) {
    const int i = (int)(r % Nq), b = (int)(r / Nq / Hq), h = (int)(r / Nq % Hq);
    const Rows<const T> o = head_rows(out, lo, b, h).from(i);
    const Rows<const T> d = head_rows(d_out, ldo, b, h).from(i);
    if (vector_rows<HEAD_DIM>(o) && vector_rows<HEAD_DIM>(d)) {
      for (int c = lane * ELEMS; c < HEAD_DIM; c += LANES * ELEMS) {
        float x[ELEMS], y[ELEMS];
        load_chunk(&o(0, c), x);
        load_chunk(&d(0, c), y);
#pragma unroll
        for (int e = 0; e < ELEMS; ++e) acc += x[e] * y[e];
      }
    } else {
      for (int c = lane; c < HEAD_DIM; c += LANES) acc += to_float(o(0, c)) * to_float(d(0, c));
    }
  }
#pragma unroll
  for (int off = LANES / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (valid && lane == 0) {
    const float l = lse[r];
    delta[r] = HAS_DLSE ? acc - d_lse[r] : acc;
    lse2[r] = l == -INFINITY ? INFINITY : l * 1.4426950408889634f;
    if (COUNT_BLOCK > 0 && r < ip[P_BATCH] * Hq * ((Nq + COUNT_BLOCK - 1) / COUNT_BLOCK))
      for (int c = 0; c < COUNT_CHAINS; ++c) dq_order[r * COUNT_CHAINS + c] = 0;
  }
}

}  // namespace mlxflash

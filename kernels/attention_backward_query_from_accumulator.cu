// dQ from the fused dK/dV kernel's fp32 accumulator (attention_backward_key_value_wgmma.cu,
// FUSED_DQ): one CTA per (batch, query head, query block) tile, rounding to the input dtype on the
// way into the token-major [B, Nq, Hq, D] dQ buffer. The accumulator holds each tile as two 64 x 64
// units, each in its consumer warpgroup's register order: float4 i of thread t at i * 128 + t,
// thread t = 32 warp + 4 g + tq holding row 16 warp + 8 hf + g, column 8 i + 2 tq + e at float
// 2 hf + e of it; the units lie along the rows at BN = 128 (D <= 64), along the columns at BN = 64.
// The tile is read with coalesced float4 loads, put in place in shared memory and written out row
// by row. CHAINS tiles per (batch, query head, query block), one per chain of key blocks (the
// dK/dV kernel's ROTATED walk: 2 without a causal mask), summed in chain order. A tile whose count
// is 0 was written by no key block (causal, Nq > Nk: rows that see no key; the first query block
// has no second chain; the dK/dV kernel stores a chain's first part instead of adding it to
// zeros): it adds nothing, and a query block with no written tile has dQ 0. MLX's transposed
// copy of the same permutation (plus its rounding copy) took 0.58 ms at B=4 H=16 N=4096 D=128 on
// an H100, a sixth of the backward.
namespace mlxflash {
namespace dqacc {
typedef {{input_type}} T;
constexpr int HEAD_DIM = {{head_dim}};
constexpr int BN = {{traversal_block}};  // query rows of a tile
constexpr int COLS = {{tile_columns}};   // columns of a tile: 64-column panels covering HEAD_DIM
constexpr int THREADS = {{threads}};
constexpr int CHAINS = {{chains}};  // accumulator tiles per query block, summed in this order
// Row pitch in floats: 8 banks between rows, so each half-warp's float2 stores (4 rows x 4 column
// pairs) hit 32 different banks.
constexpr int PITCH = COLS + 8;
constexpr int SHARED_BYTES = BN * PITCH * 4;
constexpr int CHUNK = HEAD_DIM % 4 == 0 ? 4 : 1;  // output elements a thread rounds and stores at once
static_assert(BN * COLS == 2 * 64 * 64 && COLS >= HEAD_DIM && (BN == 64 || BN == 128), "two 64 x 64 units a tile");
}  // namespace dqacc

__device__ void attention_backward_query_from_accumulator(const float* __restrict__ acc, const int* __restrict__ counts,
                                                          const i64* __restrict__ ip, dqacc::T* __restrict__ dq) {
  using namespace dqacc;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* tile = reinterpret_cast<float*>(smem_raw);
  const int Hq = (int)ip[P_QHEADS], Nq = (int)ip[P_QLEN];
  const int nqb = (Nq + BN - 1) / BN;
  const i64 index = linear_block();  // (b Hq + h) nqb + query block: the accumulator's tile order
  if (index >= ip[P_BATCH] * Hq * nqb) return;  // the whole CTA: no barrier is skipped by part of it
  const int qb = (int)(index % nqb), h = (int)(index / nqb % Hq);
  const i64 b = index / nqb / Hq;
  const float4* src = reinterpret_cast<const float4*>(acc) + index * CHAINS * (BN * COLS / 4);
  bool written[CHAINS];
#pragma unroll
  for (int c = 0; c < CHAINS; ++c) written[c] = counts[index * CHAINS + c] != 0;
  for (int j = threadIdx.x; j < BN * COLS / 4; j += THREADS) {
    float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
    bool any = false;
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) {
      if (!written[c]) continue;
      const float4 y = src[c * (BN * COLS / 4) + j];
      x = any ? make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w) : y;
      any = true;
    }
    const int unit = j / 1024, i = j / 128 % 8, t = j % 128;
    const int row = (BN == 128 ? 64 * unit : 0) + 16 * (t / 32) + t % 32 / 4;
    const int col = (BN == 64 ? 64 * unit : 0) + 8 * i + 2 * (t % 4);
    *reinterpret_cast<float2*>(&tile[row * PITCH + col]) = make_float2(x.x, x.y);
    *reinterpret_cast<float2*>(&tile[(row + 8) * PITCH + col]) = make_float2(x.z, x.w);
  }
  __syncthreads();
  constexpr int CHUNKS = (HEAD_DIM + CHUNK - 1) / CHUNK;
  for (int j = threadIdx.x; j < BN * CHUNKS; j += THREADS) {
    const int row = j / CHUNKS, c = CHUNK * (j % CHUNKS), q = qb * BN + row;
    if (q >= Nq) break;  // rows ascend with j
    T* out = dq + ((b * Nq + q) * Hq + h) * HEAD_DIM + c;
    const float* in = &tile[row * PITCH + c];
    if constexpr (CHUNK == 4) {
      const float4 x = *reinterpret_cast<const float4*>(in);
      *reinterpret_cast<uint2*>(out) = make_uint2(pack2(x.x, x.y, T()), pack2(x.z, x.w, T()));
    } else {
      store1(out, in[0]);
    }
  }
}

}  // namespace mlxflash

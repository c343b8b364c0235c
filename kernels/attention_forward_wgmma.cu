// Attention forward for Hopper (sm_90a): O = softmax(scale * Q K^T + mask) V and L = logsumexp.
//
// The algorithm of attention_forward.cu with warpgroup MMAs (wgmma.mma_async) instead of
// mma.sync: each of GROUPS warpgroups (128 threads) owns 64 query rows and all DN output
// columns. S = Q K^T reads Q and K straight from shared memory (no ldmatrix, no operand
// registers), O += P V takes P from the S accumulators in registers and V from shared memory.
// Why: the mma.sync forward holds S, O and the operand fragments in registers (255 per thread,
// 2 warps per scheduler) and spends a third of its issue slots on ldmatrix; wgmma needs neither.
//
// Shared memory tiles use the 128-byte swizzle of wgmma's canonical layouts: a tile of R rows x
// C columns is stored as ceil(C / 64) panels of R rows x 64 columns (128 bytes a row); inside a
// panel, 16-byte chunk c of row r sits at chunk position c ^ (r % 8). Panels start on 1024-byte
// boundaries, so the hardware's swizzle (address bits 4-6 ^= bits 7-9) matches this one.
//   Q, K: K-major operands (rows = queries / keys, contiguous along D).
//   V:    MN-major B operand of O += P V (rows = keys = the contraction, contiguous along D).
// Loads: cp.async (generic proxy) two K and two V buffers deep (see the pipeline below), then
// fence.proxy.async before the barrier so the tensor cores (async proxy) see the data.
// Rendered by mlx_flash.backends.cuda with the constants below.
namespace mlxflash {
namespace fwdwg {
typedef {{T}} T;
typedef {{MASK_T}} MaskT;
constexpr int HEAD_DIM = {{HEAD_DIM}};  // real D (<= 256)
constexpr int DP = {{DP}};              // D padded to 16: the QK^T contraction and the PV width
constexpr int GROUPS = {{GROUPS}};      // warpgroups per CTA (64 query rows each)
constexpr int BN = {{BN}};              // keys per step (the S tile width)
constexpr bool CAUSAL = {{CAUSAL}};
constexpr bool WINDOW = {{WINDOW}};
constexpr bool SOFTCAP = {{SOFTCAP}};
constexpr int MASK_KIND = {{MASK_KIND}};
constexpr bool V_LBO_ALONG_K = {{V_LBO_ALONG_K}};  // false = the PTX ISA's reading (below); true = swapped
constexpr int THREADS = 128 * GROUPS, BM = 64 * GROUPS;
constexpr int PANELS = (DP + 63) / 64;        // 64-column panels per tile row
constexpr int Q_BYTES = PANELS * BM * 128, K_BYTES = PANELS * BN * 128, V_BYTES = K_BYTES;
constexpr int SMEM_BYTES = 1024 + Q_BYTES + 2 * K_BYTES + 2 * V_BYTES;  // + 1024: alignment slack
static_assert(DP % 16 == 0 && DP <= 256, "wgmma N is at most 256");
static_assert(BN % 16 == 0 && BN <= 256, "BN must be a multiple of 16, at most 256");
}  // namespace fwdwg

#ifndef MLXFLASH_CPU_EMULATION
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Writes through the generic proxy (cp.async, st.shared) made visible to wgmma's async proxy.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
#endif
template <bool B> struct Flag { static constexpr bool value = B; };

// Keeps the compiler from moving reads / writes of accumulator registers across a wgmma
// issue or wait (the asm statements do not name them).
template <int N>
__device__ __forceinline__ void fence_registers(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Matrix descriptor of a 128-byte-swizzled shared memory operand (PTX ISA, "Matrix Descriptor
// Format"): start address, leading and stride byte offsets, all >> 4; swizzle mode 1 = 128 B.
__device__ __forceinline__ unsigned long long smem_descriptor(u32 address, u32 leading_bytes, u32 stride_bytes) {
  return (unsigned long long)((address & 0x3FFFF) >> 4) | ((unsigned long long)(leading_bytes >> 4) << 16) |
         ((unsigned long long)(stride_bytes >> 4) << 32) | (1ull << 62);
}

// Byte offset of element (row, col) in a panel-swizzled tile of `rows` rows (see the top).
__device__ __forceinline__ int swizzled_offset(int row, int col, int rows) {
  return (col / 64) * rows * 128 + row * 128 + ((((col % 64) / 8) ^ (row % 8)) * 16) + (col % 8) * 2;
}

// Copies rows [0, rows_valid) x columns [0, head_dim) of a row-major [*, head_dim] matrix into a
// ROWS x (64 PANELS) swizzled tile; everything else is zero-filled.
template <int ROWS, int PANELS, int THREADS, typename T>
__device__ __forceinline__ void load_swizzled(unsigned char* tile, const T* g, int rows_valid, int head_dim,
                                              bool vec, int tid) {
  constexpr int CHUNKS = PANELS * 8;  // 16-byte chunks per row
  if (vec) {
#pragma unroll
    for (int idx = tid; idx < ROWS * CHUNKS; idx += THREADS) {
      const int r = idx / CHUNKS, c = (idx % CHUNKS) * 8;
      const bool ok = r < rows_valid && c < head_dim;
      cp_async16(tile + swizzled_offset(r, c, ROWS), ok ? g + (i64)r * head_dim + c : g, ok);
    }
  } else {
    for (int idx = tid; idx < ROWS * CHUNKS * 8; idx += THREADS) {
      const int r = idx / (CHUNKS * 8), c = idx % (CHUNKS * 8);
      const bool ok = r < rows_valid && c < head_dim;
      *reinterpret_cast<T*>(tile + swizzled_offset(r, c, ROWS)) = ok ? g[(i64)r * head_dim + c] : T(0.0f);
    }
  }
}

__device__ void attention_forward_wgmma(const fwdwg::T* __restrict__ q, const fwdwg::T* __restrict__ k,
                                        const fwdwg::T* __restrict__ v, const fwdwg::MaskT* __restrict__ mask,
                                        const i64* __restrict__ ip, const float* __restrict__ fp,
                                        fwdwg::T* __restrict__ out, float* __restrict__ lse) {
  using namespace fwdwg;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // Panels must start on 1024-byte boundaries of the shared address space (swizzle phase).
  unsigned char* base = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  unsigned char* Qs = base;
  unsigned char* Ks = Qs + Q_BYTES;
  unsigned char* Vs = Ks + 2 * K_BYTES;

  const i64 bid = linear_block();
  if (bid >= ip[P_TOTAL]) return;
  const int Hq = (int)ip[P_QHEADS], Hkv = (int)ip[P_KVHEADS], Nq = (int)ip[P_QLEN], Nk = (int)ip[P_KVLEN];
  const int group = (int)ip[P_GROUP], diag = (int)ip[P_DIAG], wleft = (int)ip[P_WLEFT], wright = (int)ip[P_WRIGHT];
  const int nqb = (int)ip[P_NBLOCKS];
  const float scale = fp[0], cap = fp[1];
  const float scale_log2 = scale * 1.4426950408889634f;

  int qb;
  i64 bh;
  block_of(bid, nqb, ip[P_BLOCK_MAJOR] != 0, ip[P_BATCH] * Hq, qb, bh);
  if (CAUSAL) qb = nqb - 1 - qb;  // longest rows first: better tail balance
  const int b = (int)(bh / Hq), h = (int)(bh % Hq), hk = h / group;
  const int tid = threadIdx.x, warpgroup = tid / 128, warp = (tid % 128) / 32, lane = tid % 32;
  const int g = lane / 4, tq = lane % 4;
  const int q0 = qb * BM;
  const int row0 = q0 + warpgroup * 64 + warp * 16 + g;  // this thread's first query row

  const T* qg = q + (bh * Nq + q0) * (i64)HEAD_DIM;
  const T* kg = k + ((i64)b * Hkv + hk) * Nk * (i64)HEAD_DIM;
  const T* vg = v + ((i64)b * Hkv + hk) * Nk * (i64)HEAD_DIM;
  const bool vec = (HEAD_DIM % 8 == 0) && aligned16(q) && aligned16(k) && aligned16(v);

  const int q_last = min(q0 + BM, Nq) - 1;
  int kb_begin, kb_end;  // the key blocks any row of this block may see
  key_block_range<CAUSAL, WINDOW, BN>(q0, q_last, Nk, diag, wleft, wright, kb_begin, kb_end);

  float o[DP / 8][4];
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
#pragma unroll
  for (int n = 0; n < DP / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  const MaskT* mrow[2] = {nullptr, nullptr};
  if (MASK_KIND != 0) {
    const i64 mbase = (i64)b * ip[P_MSB] + (i64)h * ip[P_MSH];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) mrow[hf] = mask + mbase + (i64)min(row0 + 8 * hf, Nq - 1) * ip[P_MSQ];
  }
  const i64 msk = MASK_KIND != 0 ? ip[P_MSK] : 0;

  const u32 q_addr = smem_u32(Qs) + warpgroup * 64 * 128;  // this warpgroup's 64 rows of panel 0
  // V as the B operand (16 keys x DP columns, MN-major): 64-column panels are BN * 128 bytes
  // apart (along N: the leading byte offset), 8-key row groups 1024 bytes apart (along K: the
  // stride byte offset), per the canonical layout ((8,8,m),(8,k)):((1,8,LBO),(64,SBO)).
  const u32 v_leading = V_LBO_ALONG_K ? 1024 : BN * 128, v_stride = V_LBO_ALONG_K ? BN * 128 : 1024;
  auto load_keys = [&](int kb, int buffer) {
    const int k0 = kb * BN;
    load_swizzled<BN, PANELS, THREADS>(Ks + buffer * K_BYTES, kg + (i64)k0 * HEAD_DIM, Nk - k0, HEAD_DIM, vec, tid);
  };
  auto load_values = [&](int kb, int buffer) {
    const int k0 = kb * BN;
    load_swizzled<BN, PANELS, THREADS>(Vs + buffer * V_BYTES, vg + (i64)k0 * HEAD_DIM, Nk - k0, HEAD_DIM, vec, tid);
  };
  // S = Q K^T from K buffer `buffer`, issued (not waited): DP / 16 k-steps; a k-step moves 32
  // bytes along a panel row, every 4 steps the next panel.
  auto issue_scores = [&](float (&s)[BN / 8][4], int buffer) {
    float(&s_flat)[BN / 2] = *reinterpret_cast<float(*)[BN / 2]>(&s[0][0]);
    const u32 k_addr = smem_u32(Ks + buffer * K_BYTES);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) {
      const u32 step = (kk % 4) * 32;
      const unsigned long long a_desc = smem_descriptor(q_addr + (kk / 4) * BM * 128 + step, 16, 1024);
      const unsigned long long b_desc = smem_descriptor(k_addr + (kk / 4) * BN * 128 + step, 16, 1024);
      Wgmma<BN, T>::ss(s_flat, a_desc, b_desc, kk > 0);
    }
    wgmma_commit();
  };
  float(&o_flat)[DP / 2] = *reinterpret_cast<float(*)[DP / 2]>(&o[0][0]);

  // Software pipeline (per warpgroup): while the tensor cores compute S_{j+1} = Q K_{j+1}^T, the
  // warpgroup runs the softmax of S_j, then O += P_j V_j; both are waited for at the end of the
  // step. (Leaving O += P_j V_j running into the next step, or issuing S_{j+1} under a runtime
  // condition, makes ptxas serialize every wgmma: nvcc 13.0, warning C7515.) The last step has
  // no S_{j+1}: HAS_NEXT is a compile-time flag at each call site. Buffers: K double (K_{j+2}
  // loads while S_{j+1} reads K_{j+1}), V double (V_{j+1} loads while O += P_j V_j reads V_j).
  auto step = [&](int kb, float (&s_cur)[BN / 8][4], float (&s_next)[BN / 8][4], auto has_next) {
    constexpr bool HAS_NEXT = decltype(has_next)::value;
    const int it = kb - kb_begin;
    cp_async_wait<0>();  // K_{kb+1} and V_{kb} (committed one step ago) have landed
    fence_proxy_async();
    __syncthreads();     // ... for every thread, and every warpgroup finished step kb - 1
    if (kb + 2 < kb_end) load_keys(kb + 2, it % 2);
    if (HAS_NEXT) load_values(kb + 1, (it + 1) % 2);
    cp_async_commit();
    if (HAS_NEXT) issue_scores(s_next, (it + 1) % 2);

    // Scores -> log2 units with masks; online softmax (P replaces S, O is rescaled).
    const int key0 = kb * BN;
    const bool full_block =
        key0 + BN <= Nk && band_covers_tile<CAUSAL, WINDOW>(q0, q_last, key0, key0 + BN - 1, diag, wleft, wright);
    online_softmax_tile<CAUSAL, WINDOW, SOFTCAP, MASK_KIND>(s_cur, o, row_max, row_sum, mrow, row0, key0, full_block,
                                                           Nq, Nk, diag, wleft, wright, msk, scale, scale_log2, cap, tq);

    // O += P V: P from the S accumulators (two n8 accumulator tiles = one k16 A fragment).
    u32 p[BN / 16][4];
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      p[kk][0] = pack2(s_cur[2 * kk][0], s_cur[2 * kk][1], T());
      p[kk][1] = pack2(s_cur[2 * kk][2], s_cur[2 * kk][3], T());
      p[kk][2] = pack2(s_cur[2 * kk + 1][0], s_cur[2 * kk + 1][1], T());
      p[kk][3] = pack2(s_cur[2 * kk + 1][2], s_cur[2 * kk + 1][3], T());
    }
    fence_registers(o_flat);
    wgmma_fence();
    const u32 v_addr = smem_u32(Vs + (it % 2) * V_BYTES);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      Wgmma<DP, T>::rs(o_flat, p[kk], smem_descriptor(v_addr + kk * 16 * 128, v_leading, v_stride), 1);
    wgmma_commit();
    wgmma_wait<0>();  // S_{j+1} and O += P_j V_j
    fence_registers(o_flat);
    if (HAS_NEXT) {
      float(&next_flat)[BN / 2] = *reinterpret_cast<float(*)[BN / 2]>(&s_next[0][0]);
      fence_registers(next_flat);
    }
  };

  if (kb_begin < kb_end) {
    load_swizzled<BM, PANELS, THREADS>(Qs, qg, Nq - q0, HEAD_DIM, vec, tid);
    load_keys(kb_begin, 0);
    load_values(kb_begin, 0);
    cp_async_commit();
    if (kb_begin + 1 < kb_end) load_keys(kb_begin + 1, 1);
    cp_async_commit();
    cp_async_wait<1>();  // Q, K_0, V_0
    fence_proxy_async();
    __syncthreads();
  }
  float s_a[BN / 8][4], s_b[BN / 8][4];
  if (kb_begin < kb_end) {
    issue_scores(s_a, 0);
    wgmma_wait<0>();
    float(&a_flat)[BN / 2] = *reinterpret_cast<float(*)[BN / 2]>(&s_a[0][0]);
    fence_registers(a_flat);
  }
  // Unrolled by two so S_j and S_{j+1} swap roles without copies; the last step alone.
  int kb = kb_begin;
  for (; kb + 2 < kb_end; kb += 2) {
    step(kb, s_a, s_b, Flag<true>());
    step(kb + 1, s_b, s_a, Flag<true>());
  }
  if (kb + 1 < kb_end) {
    step(kb, s_a, s_b, Flag<true>());
    step(kb + 1, s_b, s_a, Flag<false>());
  } else if (kb < kb_end) {
    step(kb, s_a, s_b, Flag<false>());
  }

  store_output_tile<HEAD_DIM>(o, row_max, row_sum, row0, Nq, 0, out + bh * Nq * (i64)HEAD_DIM, lse + bh * Nq, tq);
}

}  // namespace mlxflash

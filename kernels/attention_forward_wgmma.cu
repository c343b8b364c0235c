// Attention forward for Hopper (sm_90a): O = softmax(scale * Q K^T + mask) V and L = logsumexp.
//
// The algorithm of attention_forward.cu with warpgroup MMAs (wgmma.mma_async) and warp
// specialization (the FlashAttention-3 design):
//   - a producer warpgroup streams K and V tiles into a ring of STAGES shared memory buffers each
//     with cp.async and announces each tile on an mbarrier ("full"); it runs on 48 registers
//     (setmaxnreg) since it holds no tiles;
//   - CONSUMERS consumer warpgroups (64 query rows each, all DP output columns) run the MMAs
//     and the online softmax on 224 registers, and hand each buffer back on its "empty" mbarrier
//     as soon as their MMAs have read it.
// No CTA-wide barrier inside the loop: the previous version (every thread loading, a
// __syncthreads per step) kept both warpgroups in lock step, so their softmaxes coincided and
// the tensor cores idled (H100: 247 TFLOP/s at D=128 against 251 for the mma.sync forward).
//
// Per consumer warpgroup, step j of the loop issues S_{j+1} = Q K_{j+1}^T and O += P_j V_j
// back to back, runs the softmax of S_{j+1} while O += P_j V_j is still on the tensor cores,
// and only then rescales O. Both MMA groups are waited for inside the step: leaving one in
// flight across the loop edge, or issuing one under a runtime condition, makes ptxas serialize
// every wgmma (nvcc 13.0, warning C7515), so the last step is peeled. PINGPONG adds
// FlashAttention-3's scheduler barriers: the consumer warpgroups take turns to issue their
// MMAs, so one's softmax overlaps the other's MMAs.
//
// Shared memory tiles use the 128-byte swizzle of wgmma's canonical layouts: a tile of R rows x
// C columns is stored as ceil(C / 64) panels of R rows x 64 columns (128 bytes a row); inside a
// panel, 16-byte chunk c of row r sits at chunk position c ^ (r % 8). Panels start on 1024-byte
// boundaries, so the hardware's swizzle (address bits 4-6 ^= bits 7-9) matches this one.
//   Q, K: K-major operands (rows = queries / keys, contiguous along D); each consumer
//         warpgroup loads its own 64 Q rows.
//   V:    MN-major B operand of O += P V (rows = keys = the contraction, contiguous along D).
// Ordering: cp.async writes through the generic proxy, wgmma reads through the async proxy; the
// hardware arrives on a tile's "full" barrier when the copies land, and each consumer runs
// fence.proxy.async after acquiring it.
// Rendered by mlx_flash.backends.cuda with the constants below.
namespace mlxflash {
namespace fwdwg {
typedef {{T}} T;
typedef {{MASK_T}} MaskT;
constexpr int HEAD_DIM = {{HEAD_DIM}};  // real D (<= 256)
constexpr int DP = {{DP}};              // D padded to 16: the QK^T contraction and the PV width
constexpr int CONSUMERS = {{GROUPS}};   // consumer warpgroups per CTA (64 query rows each)
constexpr int BN = {{BN}};              // keys per step (the S tile width)
constexpr bool CAUSAL = {{CAUSAL}};
constexpr bool WINDOW = {{WINDOW}};
constexpr bool SOFTCAP = {{SOFTCAP}};
constexpr int MASK_KIND = {{MASK_KIND}};
constexpr bool PINGPONG = {{PINGPONG}};
constexpr bool V_LBO_ALONG_K = {{V_LBO_ALONG_K}};  // false = the PTX ISA's reading (below); true = swapped
constexpr int THREADS = 128 * (CONSUMERS + 1), BM = 64 * CONSUMERS;
constexpr int STAGES = {{STAGES}};  // K and V buffers each (a ring)
constexpr int PANELS = (DP + 63) / 64;        // 64-column panels per tile row
constexpr int Q_GROUP_BYTES = PANELS * 64 * 128, K_BYTES = PANELS * BN * 128, V_BYTES = K_BYTES;
constexpr int BARRIER_BYTES = 4 * STAGES * 8;  // full / empty mbarriers of the K and V rings
constexpr int SMEM_BYTES = 1024 + CONSUMERS * Q_GROUP_BYTES + STAGES * (K_BYTES + V_BYTES) + BARRIER_BYTES;
// Register split: the launch bounds give every thread LAUNCH_REGS (65536 / THREADS rounded down
// to 8: 168 with two consumers). setmaxnreg moves registers only inside the CTA's allocation, so
// what the producer gives back (LAUNCH_REGS - PRODUCER_REGS each) must cover what the consumers
// take, or their setmaxnreg.inc waits forever.
constexpr int LAUNCH_REGS = 65536 / THREADS / 8 * 8;
// 48 / 224 (two consumers): with 40 the producer's copy loop spills at D=256 (nvcc 13.0); the
// consumers need at most 224 at D <= 256 with BN = 64 (D > 128) or 128 (no spills).
constexpr int PRODUCER_REGS = 48;
constexpr int CONSUMER_REGS_FIT = (LAUNCH_REGS * THREADS - 128 * PRODUCER_REGS) / (128 * CONSUMERS) / 8 * 8;
constexpr int CONSUMER_REGS = CONSUMER_REGS_FIT < 240 ? CONSUMER_REGS_FIT : 240;
static_assert(128 * PRODUCER_REGS + 128 * CONSUMERS * CONSUMER_REGS <= LAUNCH_REGS * THREADS, "register split");
static_assert(CONSUMERS == 2 || CONSUMERS == 3, "2 or 3 consumer warpgroups (the register split)");
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

// mbarriers (PTX ISA "Parallel Synchronization and Communication Instructions: mbarrier"):
// arrive has release semantics, try_wait acquire, both at CTA scope. A barrier's phase
// completes when `count` arrivals have come; waiting on parity P returns once the phase of
// parity P has completed (a fresh barrier counts its phase "1" as completed).
__device__ __forceinline__ void mbarrier_init(u32 barrier, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(barrier), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(u32 barrier) {
  asm volatile("{\n .reg .b64 state;\n mbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(barrier) : "memory");
}
// The barrier receives one arrival once all of this thread's earlier cp.async copies have landed
// (noinc: that arrival counts toward the barrier's expected count).
__device__ __forceinline__ void cp_async_arrive_noinc(u32 barrier) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(barrier) : "memory");
}
__device__ __forceinline__ void mbarrier_wait(u32 barrier, u32 parity) {
  u32 done;
  do {
    asm volatile(
        "{\n .reg .pred ready;\n mbarrier.try_wait.parity.shared::cta.b64 ready, [%1], %2;\n"
        " selp.u32 %0, 1, 0, ready;\n}\n"
        : "=r"(done)
        : "r"(barrier), "r"(parity)
        : "memory");
  } while (!done);
}
// Named barriers 1..15 (0 is __syncthreads): bar.sync waits for `threads` arrivals counting its
// own warp's, bar.arrive adds its warp's without waiting.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// setmaxnreg: the warpgroup's per-thread register budget from here on (a multiple of 8).
template <int REGS>
__device__ __forceinline__ void registers_decrease() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS)); }
template <int REGS>
__device__ __forceinline__ void registers_increase() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS)); }
#endif

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
// ROWS x (64 PANELS) swizzled tile; everything else is zero-filled. `tid` in [0, THREADS).
// Thread tid copies 16-byte chunk column tid % CHUNKS of rows tid / CHUNKS + i * (THREADS / CHUNKS)
// when CHUNKS divides THREADS: its shared and global offsets then advance by constants, so each
// copy costs a few instructions (the general index arithmetic cost ~25 per 16-byte copy and made
// the producer warpgroup too slow to feed the tensor cores: H100, D=128).
template <int ROWS, int PANELS, int THREADS, int HEAD_DIM, typename T>
__device__ __forceinline__ void load_swizzled(unsigned char* tile, const T* g, int rows_valid, bool vec, int tid) {
  constexpr int CHUNKS = PANELS * 8;  // 16-byte chunks per row
  static_assert((ROWS * CHUNKS) % THREADS == 0, "whole copies per thread");
  if (vec && THREADS % CHUNKS == 0) {
    constexpr int ROW_STEP = THREADS / CHUNKS;
    const int r0 = tid / CHUNKS, c = (tid % CHUNKS) * 8;
    const int rows = c < HEAD_DIM ? rows_valid : 0;  // rows to copy (the rest are zero-filled)
    const T* src = g + (i64)r0 * HEAD_DIM + c;
    // Partly unrolled: the producer runs on PRODUCER_REGS (fully unrolled, its addresses spill).
#pragma unroll 4
    for (int r = r0; r < ROWS; r += ROW_STEP, src += ROW_STEP * HEAD_DIM) {
      const bool ok = r < rows;
      cp_async16(tile + swizzled_offset(r, c, ROWS), ok ? src : g, ok);
    }
  } else if (vec) {
#pragma unroll 2
    for (int i = 0; i < ROWS * CHUNKS / THREADS; ++i) {
      const int idx = tid + i * THREADS, r = idx / CHUNKS, c = (idx % CHUNKS) * 8;
      const bool ok = r < rows_valid && c < HEAD_DIM;
      cp_async16(tile + swizzled_offset(r, c, ROWS), ok ? g + (i64)r * HEAD_DIM + c : g, ok);
    }
  } else {
    for (int idx = tid; idx < ROWS * CHUNKS * 8; idx += THREADS) {
      const int r = idx / (CHUNKS * 8), c = idx % (CHUNKS * 8);
      const bool ok = r < rows_valid && c < HEAD_DIM;
      *reinterpret_cast<T*>(tile + swizzled_offset(r, c, ROWS)) = ok ? g[(i64)r * HEAD_DIM + c] : T(0.0f);
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
  unsigned char* Ks = Qs + CONSUMERS * Q_GROUP_BYTES;
  unsigned char* Vs = Ks + STAGES * K_BYTES;
  const u32 barriers = smem_u32(Vs + STAGES * V_BYTES);
  auto full_keys = [&](int stage) { return barriers + 8 * stage; };
  auto empty_keys = [&](int stage) { return barriers + 8 * (STAGES + stage); };
  auto full_values = [&](int stage) { return barriers + 8 * (2 * STAGES + stage); };
  auto empty_values = [&](int stage) { return barriers + 8 * (3 * STAGES + stage); };

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
  const int tid = threadIdx.x, warpgroup = tid / 128;
  const int q0 = qb * BM;
  const T* kg = k + ((i64)b * Hkv + hk) * Nk * (i64)HEAD_DIM;
  const T* vg = v + ((i64)b * Hkv + hk) * Nk * (i64)HEAD_DIM;
  const bool vec = (HEAD_DIM % 8 == 0) && aligned16(q) && aligned16(k) && aligned16(v);

  const int q_last = min(q0 + BM, Nq) - 1;
  int kb_begin, kb_end;  // the key blocks any row of this block may see
  key_block_range<CAUSAL, WINDOW, BN>(q0, q_last, Nk, diag, wleft, wright, kb_begin, kb_end);
  const int steps = kb_end - kb_begin;

  if (tid == 0) {
#pragma unroll
    for (int stage = 0; stage < STAGES; ++stage) {
      mbarrier_init(full_keys(stage), 128);             // every producer thread
      mbarrier_init(full_values(stage), 128);
      mbarrier_init(empty_keys(stage), 4 * CONSUMERS);  // one lane of every consumer warp
      mbarrier_init(empty_values(stage), 4 * CONSUMERS);
    }
  }
  __syncthreads();  // the barriers are initialized before anyone uses them

  if (warpgroup == CONSUMERS) {  // ---------------- producer ----------------
    registers_decrease<PRODUCER_REGS>();
    const int ptid = tid - 128 * CONSUMERS;
    // Each tile is announced by the hardware as it lands: cp.async.mbarrier.arrive.noinc makes
    // the thread's arrival on the "full" barrier wait for its copies, so the producer never
    // waits for its own loads, only for free buffers (it runs up to STAGES tiles ahead). The
    // previous scheme (wait_group, fence, arrive) left the consumers waiting for K / V in 20% of
    // the stall samples (H100 ncu, D=128).
    auto announce = [&](u32 full_barrier) {
      if (vec) {
        cp_async_arrive_noinc(full_barrier);
      } else {  // plain stores (D % 8 != 0 or unaligned inputs)
        fence_proxy_async();
        mbarrier_arrive(full_barrier);
      }
    };
    for (int j = 0; j < steps; ++j) {
      const int k0 = (kb_begin + j) * BN, stage = j % STAGES;
      const u32 parity = ((j / STAGES) & 1) ^ 1;  // the consumers freed this buffer (j >= STAGES)
      mbarrier_wait(empty_keys(stage), parity);
      load_swizzled<BN, PANELS, 128, HEAD_DIM>(Ks + stage * K_BYTES, kg + (i64)k0 * HEAD_DIM, Nk - k0, vec, ptid);
      announce(full_keys(stage));
      mbarrier_wait(empty_values(stage), parity);
      load_swizzled<BN, PANELS, 128, HEAD_DIM>(Vs + stage * V_BYTES, vg + (i64)k0 * HEAD_DIM, Nk - k0, vec, ptid);
      announce(full_values(stage));
    }
    cp_async_wait<0>();  // no copy outlives the thread
    return;
  }

  // ---------------- consumers ----------------
  registers_increase<CONSUMER_REGS>();
  const int warp = (tid % 128) / 32, lane = tid % 32;
  const int g = lane / 4, tq = lane % 4;
  const int row0 = q0 + warpgroup * 64 + warp * 16 + g;  // this thread's first query row

  float o[DP / 8][4];
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
#pragma unroll
  for (int n = 0; n < DP / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;

  if (steps > 0) {
    const MaskT* mrow[2] = {nullptr, nullptr};
    if (MASK_KIND != 0) {
      const i64 mbase = (i64)b * ip[P_MSB] + (i64)h * ip[P_MSH];
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) mrow[hf] = mask + mbase + (i64)min(row0 + 8 * hf, Nq - 1) * ip[P_MSQ];
    }
    const i64 msk = MASK_KIND != 0 ? ip[P_MSK] : 0;

    // This warpgroup's 64 Q rows (a tile of its own: the producer never waits for Q).
    unsigned char* q_tile = Qs + warpgroup * Q_GROUP_BYTES;
    const int q_row = q0 + warpgroup * 64;
    load_swizzled<64, PANELS, 128, HEAD_DIM>(q_tile, q + (bh * Nq + q_row) * (i64)HEAD_DIM, Nq - q_row, vec,
                                             tid % 128);
    cp_async_commit();
    cp_async_wait<0>();
    fence_proxy_async();
    named_barrier_sync(1 + warpgroup, 128);

    const u32 q_addr = smem_u32(q_tile);
    // V as the B operand (16 keys x DP columns, MN-major): 64-column panels are BN * 128 bytes
    // apart (along N: the leading byte offset), 8-key row groups 1024 bytes apart (along K: the
    // stride byte offset), per the canonical layout ((8,8,m),(8,k)):((1,8,LBO),(64,SBO)).
    const u32 v_leading = V_LBO_ALONG_K ? 1024 : BN * 128, v_stride = V_LBO_ALONG_K ? BN * 128 : 1024;
    float s[BN / 8][4];
    float(&s_flat)[BN / 2] = *reinterpret_cast<float(*)[BN / 2]>(&s[0][0]);
    float(&o_flat)[DP / 2] = *reinterpret_cast<float(*)[DP / 2]>(&o[0][0]);
    u32 p[BN / 16][4];  // P_j as bf16 / fp16 A fragments: two n8 accumulator tiles = one k16 fragment

    // S = Q K_j^T from K buffer j % STAGES: DP / 16 k-steps; a k-step moves 32 bytes along a
    // panel row, every 4 steps the next panel.
    auto issue_scores = [&](int it) {
      const u32 k_addr = smem_u32(Ks + (it % STAGES) * K_BYTES);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < DP / 16; ++kk) {
        const u32 step = (kk % 4) * 32;
        const unsigned long long a_desc = smem_descriptor(q_addr + (kk / 4) * 64 * 128 + step, 16, 1024);
        const unsigned long long b_desc = smem_descriptor(k_addr + (kk / 4) * BN * 128 + step, 16, 1024);
        Wgmma<BN, T>::ss(s_flat, a_desc, b_desc, kk > 0);
      }
      wgmma_commit();
    };
    // O += P_j V_j from V buffer j % STAGES.
    auto issue_values = [&](int it) {
      const u32 v_addr = smem_u32(Vs + (it % STAGES) * V_BYTES);
      fence_registers(o_flat);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
        Wgmma<DP, T>::rs(o_flat, p[kk], smem_descriptor(v_addr + kk * 16 * 128, v_leading, v_stride), 1);
      wgmma_commit();
    };
    // Scores of step j -> P_j in fp32 (masks, log2 units, online softmax); corr rescales O.
    auto softmax = [&](int it, float (&corr)[2]) {
      const int key0 = (kb_begin + it) * BN;
      const bool full_block =
          key0 + BN <= Nk && band_covers_tile<CAUSAL, WINDOW>(q0, q_last, key0, key0 + BN - 1, diag, wleft, wright);
      softmax_scores_tile<CAUSAL, WINDOW, SOFTCAP, MASK_KIND>(s, corr, row_max, row_sum, mrow, row0, key0, full_block,
                                                              Nq, Nk, diag, wleft, wright, msk, scale, scale_log2, cap,
                                                              tq);
    };
    // P_j to the A fragments of O += P_j V_j: only once O += P_{j-1} V_{j-1} is done reading them.
    auto convert = [&]() {
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        accumulators_to_a<T>(s[2 * kk], s[2 * kk + 1], p[kk]);
      }
    };
    auto release = [&](u32 barrier) {  // this warp is done reading the buffer
      if (lane == 0) mbarrier_arrive(barrier);
    };
    // PINGPONG: warpgroup w issues its MMAs after warpgroup w - 1 (cyclically) issued its own.
    auto take_turn = [&]() {
      if (PINGPONG) named_barrier_sync(1 + CONSUMERS + warpgroup, 256);
    };
    auto pass_turn = [&]() {
      if (PINGPONG) named_barrier_arrive(1 + CONSUMERS + (warpgroup + 1) % CONSUMERS, 256);
    };
    if (PINGPONG && warpgroup == CONSUMERS - 1) named_barrier_arrive(1 + CONSUMERS, 256);  // warpgroup 0 first

    float corr[2];
    // cp.async writes through the generic proxy and the producer cannot fence after they land,
    // so each consumer orders them before its wgmma reads (async proxy) after the acquire.
    auto wait_full = [&](u32 barrier, int it) {
      mbarrier_wait(barrier, (it / STAGES) & 1);
      fence_proxy_async();
    };
    wait_full(full_keys(0), 0);
    take_turn();
    issue_scores(0);
    pass_turn();
    wgmma_wait<0>();
    fence_registers(s_flat);
    release(empty_keys(0));
    softmax(0, corr);  // O is still zero: no rescale
    convert();
    for (int it = 0; it + 1 < steps; ++it) {
      wait_full(full_keys((it + 1) % STAGES), it + 1);
      wait_full(full_values(it % STAGES), it);
      take_turn();
      issue_scores(it + 1);
      issue_values(it);
      pass_turn();
      wgmma_wait<1>();  // S_{j+1}; O += P_j V_j still running
      fence_registers(s_flat);
      release(empty_keys((it + 1) % STAGES));
      softmax(it + 1, corr);
      wgmma_wait<0>();
      fence_registers(o_flat);
      release(empty_values(it % STAGES));
      rescale_output(o, corr);
      convert();
    }
    wait_full(full_values((steps - 1) % STAGES), steps - 1);
    take_turn();
    issue_values(steps - 1);
    if (warpgroup != CONSUMERS - 1) pass_turn();  // the last warpgroup's last turn has no taker
    wgmma_wait<0>();
    fence_registers(o_flat);
  }

  store_output_tile<HEAD_DIM>(o, row_max, row_sum, row0, Nq, 0, out + bh * Nq * (i64)HEAD_DIM, lse + bh * Nq, tq);
}

}  // namespace mlxflash

// mx.fast.cuda_kernel writes "__global__ void <name>(...)" right after this header and takes no
// launch bounds, but setmaxnreg needs them: ptxas must know each thread's register budget at
// entry (65536 / THREADS), or the consumers' setmaxnreg.inc could wait for registers that the
// launch never reserved. So the kernel's __global__ carries them.
#if defined(__location__)
#define MLXFLASH_GLOBAL_KERNEL __location__(global)
#else
#define MLXFLASH_GLOBAL_KERNEL __attribute__((global))
#endif
#undef __global__
#define __global__ MLXFLASH_GLOBAL_KERNEL __launch_bounds__(mlxflash::fwdwg::THREADS, 1)

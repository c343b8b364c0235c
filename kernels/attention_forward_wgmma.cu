// Attention forward for Hopper (sm_90a): O = softmax(scale * Q K^T + mask) V and L = logsumexp.
//
// The algorithm of attention_forward.cu with warpgroup MMAs (wgmma.mma_async) and warp
// specialization (the FlashAttention-3 design):
//   - a producer warpgroup streams K and V tiles into a ring of STAGES shared memory buffers,
//     each tile one TMA load per 64-column panel issued by one thread, which the hardware
//     counts on the tile's mbarrier ("full") as it lands (rows TMA cannot name: all 128 threads
//     with cp.async); it runs on 48 registers (setmaxnreg, 32 on the D <= 64 row) since it
//     holds no tiles;
//   - CONSUMERS consumer warpgroups (64 query rows each, DV output columns) run the MMAs and
//     the online softmax on 224 registers (160 with three, the D <= 64 table row), and hand
//     each buffer back on its "empty" mbarrier as soon as their MMAs have read it.
// Past D = 256 (wgmma's N; O's 512 columns would take 256 accumulator registers a thread) O is
// split by columns in column groups (CG = 2, P = 64): both consumer warpgroups own the same 64
// query rows and DV columns each (half of D rounded up to 64: an MN-major B operand starts on a
// panel); each computes its part of S over its DV columns of Q and K, they add the two parts
// through shared memory (both get the same sums: a + b == b + a), run the same softmax and
// accumulate O for their DV columns. It replaced column slices (CTAs each computing O for up to
// 256 columns and S over all of D: at D = 512 six products' work for four), which took
// 1.05-1.11x its forward time on an H100 (docs/cuda_notes.md, "Past D = 256").
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
// Shared memory tiles: the swizzled panel layout of wgmma_common.cuh.
//   Q, K: K-major operands (rows = queries / keys, contiguous along D); each consumer
//         warpgroup loads its own 64 Q rows.
//   V:    MN-major B operand of O += P V (rows = keys = the contraction, contiguous along D).
// Ordering: TMA writes through the async proxy, which wgmma reads, so a TMA tile needs only its
// "full" barrier; cp.async (and the per-element stores) write through the generic proxy, the
// hardware arrives on the tile's "full" barrier when the copies land, and each consumer runs
// fence.proxy.async after acquiring it.
// Rendered by mlx_flash.backends.cuda_source with the constants below.
namespace mlxflash {
namespace fwdwg {
typedef {{input_type}} T;
typedef {{mask_type}} MaskT;
constexpr int HEAD_DIM = {{head_dim}};  // real D (<= 512)
constexpr int DP = {{padded_dim}};              // D padded to 16: the QK^T contraction
constexpr int CG = {{col_groups}};      // column groups: consumer warpgroups sharing 64 query rows
constexpr int DV = {{head_block}};      // O columns per warpgroup: DP, or (CG = 2) half of DP rounded up to 64
constexpr int CONSUMERS = {{consumer_groups}};   // consumer warpgroups per CTA (64 query rows each, or CG per 64)
constexpr int BN = {{traversal_block}};              // keys per step (the S tile width)
constexpr bool CAUSAL = {{causal}};
constexpr bool WINDOW = {{window}};
constexpr bool SOFTCAP = {{softcap}};
constexpr int MASK_KIND = {{mask_kind}};
constexpr bool PINGPONG = {{pingpong}};
constexpr bool SINKS = {{sinks}};   // attention sinks: sinks [Hq] fp32 start each row's softmax
constexpr bool POISON_RELEASED = {{poison_released}};  // tests only: the release check (ReadLedger, wgmma_common.cuh)
// Interior tiles without a mask or softcap fold a positive scale into exp2's FFMA (attention_common.cuh).
constexpr bool SCALE_FOLD = {{scale_fold}};
// Lazy rescaling of O (attention_common.cuh, MAX_SLACK) where O is wide: H100, forward kernel
// time against rescaling every step, D=256 6 % faster, D=128 2-3 % slower, D=64 12-13 % slower.
constexpr bool LAZY_RESCALE = DV > 128;
// Row sums by the tensor cores (D = 49..64, one V panel): O += P V runs as P [V | 1] with N = DV + 8,
// the eight extra columns read from a panel of ones beside each V stage, so the accumulator's last
// n8 tile holds each row's sum of P (the bf16 P the products use) and the softmax adds nothing:
// one FADD per score fewer. The rescale by corr scales the sums with O, as l's recurrence does.
// H200, B=4 H=16 N=4096 D=64, ncu: 12 % fewer instructions issued, 558 against 562 us (cuDNN 522);
// forward time 0.990x on average over 12 A/B readings (0.961-1.009x, each within its spread;
// docs/cuda_notes.md, "Row sums by the tensor cores"). The table's row option mma_sums.
constexpr bool MMA_SUMS = {{mma_sums}};
constexpr int NV = DV + (MMA_SUMS ? 8 : 0);  // the O += P V product's N (O and, with MMA_SUMS, the sums)
constexpr int THREADS = 128 * (CONSUMERS + 1), ROW_GROUPS = CONSUMERS / CG, BM = 64 * ROW_GROUPS;
// Two buffers: three measured slower on an H100 (TFLOP/s per call 2 / 3 stages: D=64 250 / 233,
// D=128 412 / 388; the hardware announces each copy, so the producer never waits on its own).
constexpr int STAGES = 2;  // K and V buffers each (a ring)
// 64-column panels per Q, K and V tile row (column groups: CG * DV, zero-filled past D)
constexpr int PANELS = CG == 2 ? 2 * DV / 64 : (DP + 63) / 64;
constexpr int Q_GROUP_BYTES = PANELS * 64 * 128, K_BYTES = PANELS * BN * 128, V_BYTES = K_BYTES;
// Column groups: the parts of S swapped between the warpgroups, double-buffered (one barrier per step).
constexpr int SWAP_BYTES = CG == 2 ? 2 * 2 * 128 * (BN / 2) * 4 : 0;
// MMA_SUMS: STAGES panels of ones right after the V stages; the product's leading byte offset
// (the distance between its 64-column panels) is then STAGES * V_BYTES, so stage s's second panel
// is ones panel s.
constexpr int ONES_BYTES = MMA_SUMS ? STAGES * V_BYTES : 0;
constexpr int SMEM_BYTES = 1024 + ROW_GROUPS * Q_GROUP_BYTES + STAGES * (K_BYTES + V_BYTES) + ONES_BYTES + SWAP_BYTES +
                           KeyValueRing<STAGES>::BYTES;
static_assert(SMEM_BYTES <= {{shared_memory}}, "shared memory layout larger than the launch's");
// Register split: the launch bounds give every thread LAUNCH_REGS (65536 / THREADS rounded down
// to 8: 168 with two consumers). setmaxnreg moves registers only inside the CTA's allocation, so
// what the producer gives back (LAUNCH_REGS - PRODUCER_REGS each) must cover what the consumers
// take, or their setmaxnreg.inc waits forever.
constexpr int LAUNCH_REGS = 65536 / THREADS / 8 * 8;
// 48 / 224 (two consumers): with 40 the producer's copy loop spills at D=256 (nvcc 13.0); the
// consumers need at most 224 at D <= 256 with BN = 64 (D > 128) or 128 (no spills). A producer
// on 32 (the dQ kernel's; its TMA path fits) against 48, H100, kernel time, B=4 H=16 N=4096:
// D=256 1.030x (causal 1.002x); three consumers (D=64) at BN = 96 1.045x (1.051x), at BN = 128,
// which spills on 152 but not on 160, 0.953x (1.014x). So three consumers at BN = 128 (the
// D <= 64 row) take 32 / 160 (H200: 0.935x the forward time of BN = 96 on 48 / 152 at B=4
// N=4096, blocks_cuda.txt has the rest), and at BN = 96 (that row's softcap and window calls)
// 48 / 152.
constexpr int PRODUCER_REGS = CONSUMERS == 3 && BN >= 128 ? 32 : 48;
constexpr int CONSUMER_REGS_FIT = (LAUNCH_REGS * THREADS - 128 * PRODUCER_REGS) / (128 * CONSUMERS) / 8 * 8;
constexpr int CONSUMER_REGS = CONSUMER_REGS_FIT < 240 ? CONSUMER_REGS_FIT : 240;
static_assert(128 * PRODUCER_REGS + 128 * CONSUMERS * CONSUMER_REGS <= LAUNCH_REGS * THREADS, "register split");
static_assert(CONSUMERS == 2 || CONSUMERS == 3, "2 or 3 consumer warpgroups (the register split)");
static_assert(DV % 16 == 0 && DV <= 256 && DV * CG >= DP, "wgmma N is at most 256: O split past it");
static_assert(CG == 1 ? DV == DP : CG == 2 && CONSUMERS == 2 && DV % 64 == 0 && DV < DP && !PINGPONG,
              "column groups: two warpgroups on 64 rows, DV on 64-column panels");
constexpr int SWAP_BARRIER = 1 + 2 * CONSUMERS;  // past the warpgroups' named barriers (1..)
// O stored through shared memory in 16-byte chunks (store_tile_staged) where each warpgroup owns
// all of D (its Q tile is free after the loop) and rows split into whole chunks.
constexpr bool STAGED_EPILOGUE = CG == 1 && HEAD_DIM % 8 == 0;
static_assert(BN % 16 == 0 && BN <= 256, "BN must be a multiple of 16, at most 256");
static_assert(!MMA_SUMS || (CG == 1 && DP == 64), "row sums by MMA: one 64-column V panel, the ones in the next");
}  // namespace fwdwg

__device__ void attention_forward_wgmma(const fwdwg::T* __restrict__ q, const fwdwg::T* __restrict__ k,
                                        const fwdwg::T* __restrict__ v, const Layout lq, const Layout lk,
                                        const Layout lv, const fwdwg::MaskT* __restrict__ mask,
                                        const float* __restrict__ sinks, const i64* __restrict__ ip,
                                        const float* __restrict__ fp, const u32* __restrict__ tensor_map,
                                        fwdwg::T* __restrict__ out, float* __restrict__ lse,
                                        unsigned char* __restrict__ tensor_maps) {
  using namespace fwdwg;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // Panels must start on 1024-byte boundaries of the shared address space (swizzle phase).
  unsigned char* base = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  unsigned char* Qs = base;
  unsigned char* Ks = Qs + ROW_GROUPS * Q_GROUP_BYTES;
  unsigned char* Vs = Ks + STAGES * K_BYTES;
  unsigned char* ones = Vs + STAGES * V_BYTES;  // MMA_SUMS: [STAGES] panels of ones
  float4* swap = reinterpret_cast<float4*>(ones + ONES_BYTES);  // [2 buffers][2 warpgroups]
  const KeyValueRing<STAGES> ring{smem_u32(ones + ONES_BYTES + SWAP_BYTES)};

  const i64 bid = linear_block();
  if (bid >= ip[P_TOTAL]) return;
  MLXFLASH_READ_LAUNCH_PARAMS(ip, fp, nqb);

  int qb;
  i64 bh;
  query_block_of<CAUSAL>(bid, nqb, ip, Hq, qb, bh);
  const int b = (int)(bh / Hq), h = (int)(bh % Hq), hk = h / group;
  // The warpgroup index broadcast from lane 0 (uniform registers for the Q descriptors): the
  // forward 1.1 % faster at D=128 and 3.4 % at D=256 than with tid / 128 (H100); with three
  // consumer warpgroups (152 registers each, D <= 64) 1.8 % slower, so those keep tid / 128.
  const int tid = threadIdx.x, warpgroup = CONSUMERS == 3 ? tid / 128 : warpgroup_index();
  const int q0 = qb * BM;
  const Rows<const T> qg = head_rows(q, lq, b, h);
  const Rows<const T> kg = head_rows(k, lk, b, hk);
  const Rows<const T> vg = head_rows(v, lv, b, hk);
  const bool vec = vector_rows<HEAD_DIM>(qg) && vector_rows<HEAD_DIM>(kg) && vector_rows<HEAD_DIM>(vg);
  const bool tma = tma_rows<HEAD_DIM>(kg) && tma_rows<HEAD_DIM>(vg);

  const int q_last = min(q0 + BM, Nq) - 1;
  int kb_begin, kb_end;  // the key blocks any row of this block may see
  key_block_range<CAUSAL, WINDOW, BN>(q0, q_last, Nk, diag, wleft, wright, kb_begin, kb_end);
  const int steps = kb_end - kb_begin;

  if (tid == 0) ring.init(4 * CONSUMERS, tma ? 1 : 128);
  if (MMA_SUMS) {  // the ones panels (every element 1, so the swizzle does not matter), for wgmma's reads
    const u32 word = pack2(1.f, 1.f, T());
    for (int i = tid; i < ONES_BYTES / 16; i += THREADS)
      reinterpret_cast<uint4*>(ones)[i] = make_uint4(word, word, word, word);
    fence_proxy_async();
  }
  __syncthreads();  // the barriers are initialized (and the ones written) before anyone uses them

  if (warpgroup == CONSUMERS) {  // ---------------- producer ----------------
    registers_decrease<PRODUCER_REGS>();
    produce_key_value_tiles<BN, PANELS, HEAD_DIM, STAGES>(ring, Ks, Vs, kg, vg, kb_begin, steps, Nk, vec, tma,
                                                          {tensor_map, tensor_map_slots(tensor_maps, bid)},
                                                          tid - 128 * CONSUMERS, POISON_RELEASED);
    return;
  }

  // ---------------- consumers ----------------
  registers_increase<CONSUMER_REGS>();
  const int warp = (tid % 128) / 32, lane = tid % 32;
  const int g = lane / 4, tq = lane % 4;
  const int row_group = warpgroup / CG;
  const int row0 = q0 + row_group * 64 + warp * 16 + g;  // this thread's first query row
  // Column groups: this warpgroup's columns of the S contraction and of O, V.
  const int col0 = (warpgroup % CG) * DV;

  float o[NV / 8][4];  // O's DV columns, then (MMA_SUMS) the row sums in every column of the last n8 tile
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  if (SINKS) {
    sink_row_state(sinks[h], tq, row_max[0], row_sum[0]);
    sink_row_state(sinks[h], tq, row_max[1], row_sum[1]);
  }
#pragma unroll
  for (int n = 0; n < NV / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  if (MMA_SUMS && SINKS) {  // the sums start where the softmax's would: the sink's term (quad-summed: in every lane)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) o[NV / 8 - 1][2 * hf] = o[NV / 8 - 1][2 * hf + 1] = quad_sum(row_sum[hf]);
  }

  if (steps > 0) {
    const MaskT* mrow[2] = {nullptr, nullptr};
    if (MASK_KIND != 0) {
      const i64 mbase = (i64)b * ip[P_MSB] + (i64)h * ip[P_MSH];
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) mrow[hf] = mask + mbase + (i64)min(row0 + 8 * hf, Nq - 1) * ip[P_MSQ];
    }
    const i64 msk = MASK_KIND != 0 ? ip[P_MSK] : 0;
    MaskRegs<MASK_KIND, BN / 8, MaskT> masks;  // where step j's mask entries lie, set while S_j is computed
    auto load_masks = [&](int it) { masks.load(mrow, (kb_begin + it) * BN, Nk, msk, tq); };

    // This warpgroup's 64 Q rows (a tile of its own: the producer never waits for Q); with
    // column groups each warpgroup loads the panels it multiplies.
    unsigned char* q_tile = Qs + row_group * Q_GROUP_BYTES;
    const int q_row = q0 + row_group * 64;
    if (CG == 1) {
      load_swizzled<64, PANELS, 128, HEAD_DIM>(q_tile, qg.from(q_row), Nq - q_row, vec, tid % 128);
    } else {
      const Rows<const T> q_part{qg.p + col0 * qg.col, qg.row, qg.col};
      // (CG == 2 ? DV / 64 : 1): the call is compiled with CG = 1 too, where DV < 64 is 0 panels.
      load_swizzled<64, CG == 2 ? DV / 64 : 1, 128, HEAD_DIM>(q_tile + col0 * 128, q_part.from(q_row), Nq - q_row,
                                                             vec, tid % 128, HEAD_DIM - col0);
    }
    resident_rows_ready(warpgroup);

    // Column groups: the parts of S start at this warpgroup's first panel of the Q and K tiles.
    const u32 q_addr = smem_u32(q_tile) + (CG == 2 ? col0 * 128 : 0);
    const u32 k_part = CG == 2 ? col0 / 64 * BN * 128 : 0, v_part = k_part;
    // V as the B operand (16 keys x DV columns, MN-major): 64-column panels are BN * 128 bytes
    // apart (along N: the leading byte offset), 8-key row groups 1024 bytes apart (along K: the
    // stride byte offset), per the canonical layout ((8,8,m),(8,k)):((1,8,LBO),(64,SBO)).
    const u32 v_leading = MMA_SUMS ? STAGES * V_BYTES : BN * 128, v_stride = 1024;
    float s[BN / 8][4];
    float(&s_flat)[BN / 2] = *reinterpret_cast<float(*)[BN / 2]>(&s[0][0]);
    float(&o_flat)[NV / 2] = *reinterpret_cast<float(*)[NV / 2]>(&o[0][0]);
    u32 p[BN / 16][4];  // P_j as bf16 / fp16 A fragments: two n8 accumulator tiles = one k16 fragment

    ReadLedger<POISON_RELEASED, STAGES> ledger;  // tests only (wgmma_common.cuh)
    // S = Q K_j^T from K buffer j % STAGES.
    auto issue_scores = [&](int it) {
      // Past D = 256 the Q address is made opaque each step: else the compiler hoists the Q
      // descriptors of the part's DV / 16 k-steps out of the loop and the consumers spill (nvcc
      // 13.0, D = 512 with an additive mask: 60 bytes spilled against none).
      u32 q_at = q_addr;
      if (DP > 256) asm volatile("" : "+r"(q_at));
      wgmma_fence();
      wgmma_shared_shared<BN, CG == 2 ? DV : DP, 64, T>(s_flat, q_at, smem_u32(Ks + (it % STAGES) * K_BYTES) + k_part);
      ledger.commit(ledger.keys(it % STAGES));
    };
    // O += P_j V_j from V buffer j % STAGES.
    auto issue_values = [&](int it) {
      fence_registers(o_flat);
      wgmma_fence();
      wgmma_registers_shared<NV, BN, T>(o_flat, p, smem_u32(Vs + (it % STAGES) * V_BYTES) + v_part, v_leading,
                                        v_stride);
      ledger.commit(ledger.values(it % STAGES));
    };
    // Scores of step j -> P_j in fp32 (masks, log2 units, online softmax); corr rescales O.
    auto softmax = [&](int it, float (&corr)[2]) {
      const int key0 = (kb_begin + it) * BN;
      const bool full_block =
          key0 + BN <= Nk && band_covers_tile<CAUSAL, WINDOW>(q0, q_last, key0, key0 + BN - 1, diag, wleft, wright);
      softmax_scores_tile<CAUSAL, WINDOW, SOFTCAP, MASK_KIND, LAZY_RESCALE, SCALE_FOLD, !MMA_SUMS>(
          s, corr, row_max, row_sum, masks, row0, key0, full_block, Nq, Nk, diag, wleft, wright, scale, scale_log2, cap,
          tq);
    };
    // P_j to the A fragments of O += P_j V_j: only once O += P_{j-1} V_{j-1} is done reading them.
    auto convert = [&]() {
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        accumulators_to_a<T>(s[2 * kk], s[2 * kk + 1], p[kk]);
      }
    };
    // This warp is done reading `tiles`.
    auto release = [&](u32 tiles, u32 barrier) { ledger.release(tiles, barrier, lane == 0); };
    // Column groups: S of step j = this warpgroup's part + the other's, through shared memory
    // (two buffers: the other warpgroup last read buffer j % 2 two steps ago, before it arrived
    // at last step's barrier).
    auto add_other_part = [&](int it) {
      if (CG == 1) return;
      store_fragments(s_flat, fragment_slot<BN / 2>(swap, (it % 2) * 2 + warpgroup, tid % 128));
      named_barrier_sync(SWAP_BARRIER, 256);
      float other[BN / 2];
      load_fragments(other, fragment_slot<BN / 2>(swap, (it % 2) * 2 + 1 - warpgroup, tid % 128));
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) s_flat[i] += other[i];
    };
    // PINGPONG: the consumer warpgroups take turns to issue their MMAs (named barriers from
    // 1 + CONSUMERS; 1 .. CONSUMERS guard the Q loads).
    const MmaTurns<PINGPONG, CONSUMERS, 1 + CONSUMERS> turns{warpgroup};
    turns.start();

    float corr[2];
    auto wait_full = [&](u32 barrier, int it) { acquire_tile(barrier, (it / STAGES) & 1, !tma); };
    wait_full(ring.full_keys(0), 0);
    turns.take();
    issue_scores(0);
    turns.pass();
    load_masks(0);
    ledger.wait<0>();
    fence_registers(s_flat);
    release(ledger.keys(0), ring.empty_keys(0));
    add_other_part(0);
    softmax(0, corr);  // O is still zero: no rescale
    if (MMA_SUMS && SINKS) {  // but the sums start at the sink's term, which the softmax's sum would rescale
#pragma unroll
      for (int e = 0; e < 4; ++e) o[NV / 8 - 1][e] *= corr[e / 2];
    }
    convert();
    for (int it = 0; it + 1 < steps; ++it) {
      wait_full(ring.full_keys((it + 1) % STAGES), it + 1);
      wait_full(ring.full_values(it % STAGES), it);
      turns.take();
      issue_scores(it + 1);
      issue_values(it);
      turns.pass();
      load_masks(it + 1);
      ledger.wait<1>();  // S_{j+1}; O += P_j V_j still running
      fence_registers(s_flat);
      release(ledger.keys((it + 1) % STAGES), ring.empty_keys((it + 1) % STAGES));
      add_other_part(it + 1);
      softmax(it + 1, corr);
      ledger.wait<0>();
      fence_registers(o_flat);
      release(ledger.values(it % STAGES), ring.empty_values(it % STAGES));
      rescale_output<LAZY_RESCALE>(o, corr);
      convert();
    }
    wait_full(ring.full_values((steps - 1) % STAGES), steps - 1);
    turns.take();
    issue_values(steps - 1);
    turns.pass(true);  // the last warpgroup's last turn has no taker
    ledger.wait<0>();
    fence_registers(o_flat);
    if constexpr (POISON_RELEASED) ledger.spoil(o_flat);  // (wgmma_common.cuh: why the if)
  }

  if (MMA_SUMS) {  // the row sums for the epilogues' quad sums: each lane holds its rows' whole sum
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) row_sum[hf] = tq == 0 ? o[NV / 8 - 1][2 * hf] : 0.f;
  }
  float(&o_out)[DV / 8][4] = *reinterpret_cast<float(*)[DV / 8][4]>(&o[0][0]);
  const Rows<T> og = head_rows(out, token_major(Nq, Hq, HEAD_DIM), b, h);
  if constexpr (STAGED_EPILOGUE) {
    // O through this warpgroup's Q tile: its last reader, S of the last step, was waited for.
    const int q_row = q0 + row_group * 64;
    if (vector_rows<HEAD_DIM>(og)) {
      float inv[2];
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const float l = quad_sum(row_sum[hf]);
        inv[hf] = row_inverse_sum(l);
        const int i = row0 + 8 * hf;
        if (i < Nq && tq == 0) lse[bh * Nq + i] = row_lse(row_max[hf], l);
      }
      store_tile_staged<HEAD_DIM>(o_out, inv, Qs + row_group * Q_GROUP_BYTES, warp, lane, Nq - q_row, og.from(q_row));
      return;
    }
  }
  store_output_tile<HEAD_DIM>(o_out, row_max, row_sum, row0, Nq, col0, og, col0 == 0 ? lse + bh * Nq : nullptr, tq);
}

}  // namespace mlxflash

// Launch bounds for setmaxnreg (see the end of wgmma_common.cuh).
#undef __global__
#define __global__ MLXFLASH_GLOBAL_KERNEL __launch_bounds__(mlxflash::fwdwg::THREADS, 1)

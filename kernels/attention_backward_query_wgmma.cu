// Attention backward, dQ, for Hopper (sm_90a): the algorithm of attention_backward_query.cu
// with warpgroup MMAs and warp specialization, in the structure of attention_forward_wgmma.cu.
//
// One CTA owns BM = 64 * CONSUMERS / CG query rows of one (batch, head) and all of D; it streams the
// key blocks of BN keys those rows may see:
//   S = Q K^T, dP = dO V^T                             (wgmma, both operands in shared memory)
//   P = exp2(S2 - lse2), dS = P * (dP - delta)         (registers)
//   dQ += dS K                                         (wgmma, dS from registers)
// - The producer warpgroup streams K and V tiles into the ring of the forward
//   (produce_key_value_tiles in wgmma_common.cuh).
// - CONSUMERS consumer warpgroups own 64 query rows each: their Q and dO rows stay in shared
//   memory, lse2 and delta of their rows in registers, the dQ accumulators (DP / 2 floats per
//   thread, up to 128 at D = 256) in registers.
// - CG = 2 (past D = 256, wgmma's N): both consumer warpgroups own the same 64 query rows;
//   warpgroup 0 computes S = Q K^T, warpgroup 1 dP = dO V^T, each over all of D, and they swap
//   the two through shared memory (as the dK/dV kernel's column groups); each then accumulates
//   dQ for DQ columns (a multiple of 64: an MN-major B operand starts on a panel). Q and dO rows
//   of all of D (64 KB each at D = 512) leave room for BN = 16.
// dQ needs no atomics: each CTA owns its rows (the two-kernel backward). With SINKS each consumer
// warp also writes its 16 rows' part of the sink gradient, -sum_i exp2(sink2 - lse2_i) delta_i, to
// d_sinks_part[b, h, qb * BM / 16 + row group * 4 + warp] (as attention_backward_query.cu per warp).
//
// Shared memory tiles: the swizzled panel layout of wgmma_common.cuh. Q, dO: K-major A operands.
// K: K-major B operand of S and MN-major B operand of dQ += dS K; V: K-major B operand of dP.
// Rendered by mlx_flash.backends.cuda_source with the constants below.
namespace mlxflash {
namespace bwdqwg {
typedef {{input_type}} T;
typedef {{mask_type}} MaskT;
constexpr int HEAD_DIM = {{head_dim}};  // real D (<= 512)
constexpr int DP = {{padded_dim}};              // D padded to 16
constexpr int CONSUMERS = {{consumer_groups}};   // consumer warpgroups per CTA (64 query rows each, or CG per 64)
constexpr int CG = {{col_groups}};              // column groups: consumer warpgroups sharing 64 query rows
constexpr int DQ = {{head_block}};              // dQ columns per warpgroup: DP, or with CG = 2 a multiple of 64
constexpr int BN = {{traversal_block}};              // keys per step
constexpr bool CAUSAL = {{causal}};
constexpr bool WINDOW = {{window}};
constexpr bool SOFTCAP = {{softcap}};
constexpr int MASK_KIND = {{mask_kind}};
constexpr bool SINKS = {{sinks}};
constexpr bool POISON_RELEASED = {{poison_released}};  // tests only: the release check (ReadLedger, wgmma_common.cuh)
constexpr int STAGES = 2;  // K and V buffers each in the producer's ring (as the forward)
constexpr int THREADS = 128 * (CONSUMERS + 1), ROW_GROUPS = CONSUMERS / CG, BM = 64 * ROW_GROUPS;
constexpr int PANELS = (DP + 63) / 64;
constexpr int TILE_PANELS = CG * DQ / 64 > PANELS ? CG * DQ / 64 : PANELS;  // K / V panels, zero-filled past D
constexpr int Q_GROUP_BYTES = PANELS * 64 * 128;  // one row group's 64 rows of Q (or dO)
constexpr int TILE_BYTES = TILE_PANELS * BN * 128;  // one K (or V) tile
// CG = 2: S and dP swapped between the warpgroups, double-buffered (one barrier per step).
constexpr int SWAP_BYTES = CG == 2 ? 2 * 2 * 128 * (BN / 2) * 4 : 0;
constexpr int SMEM_BYTES =
    1024 + ROW_GROUPS * 2 * Q_GROUP_BYTES + STAGES * 2 * TILE_BYTES + SWAP_BYTES + KeyValueRing<STAGES>::BYTES;
static_assert(SMEM_BYTES <= {{shared_memory}}, "shared memory layout larger than the launch's");
constexpr int LAUNCH_REGS = 65536 / THREADS / 8 * 8;
// The producer runs on 24 registers (32 with three consumers: the split then gives the consumers
// 240 / 160, FlashAttention-3's numbers); its TMA path needs no more, its cp.async path (rows TMA
// cannot name) spills a few words per tile (nvcc 13.0). The consumers' 160 against 152 (producer 48)
// let D <= 64 take BN = 96 without spills (BN = 80 before). H100, dQ kernel time, B=4 H=16
// N=4096, 3 interleaved rounds: D=64 0.963x at BN = 80 and 0.920x at BN = 96 (causal 1.000x /
// 0.965x) against producer 48 at BN = 80; D=128, 192, 256 0.994-1.011x (neither way).
constexpr int PRODUCER_REGS = CONSUMERS == 3 ? 32 : 24;
constexpr int CONSUMER_REGS_FIT = (LAUNCH_REGS * THREADS - 128 * PRODUCER_REGS) / (128 * CONSUMERS) / 8 * 8;
constexpr int CONSUMER_REGS = CONSUMER_REGS_FIT < 240 ? CONSUMER_REGS_FIT : 240;
static_assert(128 * PRODUCER_REGS + 128 * CONSUMERS * CONSUMER_REGS <= LAUNCH_REGS * THREADS, "register split");
static_assert(CONSUMERS == 2 || CONSUMERS == 3, "2 or 3 consumer warpgroups (the register split)");
static_assert(DQ % 16 == 0 && DQ <= 256 && CG * DQ >= DP, "wgmma N (the dQ tile width) is at most 256");
static_assert(CG == 1 ? DQ == DP : CG == 2 && CONSUMERS == 2 && DQ % 64 == 0 && DQ < DP,
              "column groups: two warpgroups, DQ on 64-column panels");
constexpr int SWAP_BARRIER = 1 + 2 * CONSUMERS;  // past the warpgroups' named barriers (1..)
// dQ stored through shared memory in 16-byte chunks (store_tile_staged) where each warpgroup
// owns all of D (its dO tile is free after the loop).
constexpr bool STAGED_EPILOGUE = CG == 1 && HEAD_DIM % 8 == 0;
// CG = 1 (both products in one warpgroup): the interior tile's exponentials run while the tensor
// cores still compute dP (as in the dK/dV kernel); V is released after dP's wait.
constexpr bool EXP_UNDER_DP = CG == 1;
static_assert(BN % 16 == 0 && BN <= 128, "BN must be a multiple of 16, at most 128");
}  // namespace bwdqwg

__device__ void attention_backward_query_wgmma(
    const bwdqwg::T* __restrict__ q, const bwdqwg::T* __restrict__ k, const bwdqwg::T* __restrict__ v,
    const bwdqwg::T* __restrict__ d_out, const Layout lq, const Layout lk, const Layout lv, const Layout ldo,
    const float* __restrict__ lse2, const float* __restrict__ delta,
    const bwdqwg::MaskT* __restrict__ mask, const float* __restrict__ sinks, const i64* __restrict__ ip,
    const float* __restrict__ fp, const u32* __restrict__ tensor_map, bwdqwg::T* __restrict__ dq,
    float* __restrict__ d_sinks_part, unsigned char* __restrict__ tensor_maps) {
  using namespace bwdqwg;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* base = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);  // 1024-aligned panels
  unsigned char* Qs = base;                                // [ROW_GROUPS] x 64 query rows
  unsigned char* dOs = Qs + ROW_GROUPS * Q_GROUP_BYTES;    // [ROW_GROUPS] x 64 query rows
  unsigned char* Ks = dOs + ROW_GROUPS * Q_GROUP_BYTES;    // [STAGES] x BN keys
  unsigned char* Vs = Ks + STAGES * TILE_BYTES;            // [STAGES] x BN keys
  float4* swap = reinterpret_cast<float4*>(Vs + STAGES * TILE_BYTES);  // [2 buffers][2 warpgroups]
  const KeyValueRing<STAGES> ring{smem_u32(Vs + STAGES * TILE_BYTES + SWAP_BYTES)};

  const i64 bid = linear_block();
  if (bid >= ip[P_TOTAL]) return;
  MLXFLASH_READ_LAUNCH_PARAMS(ip, fp, nqb);

  int qb;
  i64 bh;
  query_block_of<CAUSAL>(bid, nqb, ip, Hq, qb, bh);
  const int b = (int)(bh / Hq), h = (int)(bh % Hq), hk = h / group;
  const int tid = threadIdx.x, warpgroup = warpgroup_index();
  const int q0 = qb * BM;
  const Rows<const T> qg = head_rows(q, lq, b, h);
  const Rows<const T> dog = head_rows(d_out, ldo, b, h);
  const Rows<const T> kg = head_rows(k, lk, b, hk);
  const Rows<const T> vg = head_rows(v, lv, b, hk);
  const bool vec = vector_rows<HEAD_DIM>(qg) && vector_rows<HEAD_DIM>(dog) && vector_rows<HEAD_DIM>(kg) &&
                   vector_rows<HEAD_DIM>(vg);
  const bool tma = tma_rows<HEAD_DIM>(kg) && tma_rows<HEAD_DIM>(vg);

  const int q_last = min(q0 + BM, Nq) - 1;
  int kb_begin, kb_end;  // the key blocks any row of this block may see
  key_block_range<CAUSAL, WINDOW, BN>(q0, q_last, Nk, diag, wleft, wright, kb_begin, kb_end);
  const int steps = kb_end - kb_begin;

  if (tid == 0) ring.init(4 * CONSUMERS, tma ? 1 : 128);
  __syncthreads();  // the barriers are initialized before anyone uses them

  if (warpgroup == CONSUMERS) {  // ---------------- producer ----------------
    registers_decrease<PRODUCER_REGS>();
    produce_key_value_tiles<BN, TILE_PANELS, HEAD_DIM, STAGES>(ring, Ks, Vs, kg, vg, kb_begin, steps, Nk, vec, tma,
                                                               {tensor_map, tensor_map_slots(tensor_maps, bid)},
                                                               tid - 128 * CONSUMERS, POISON_RELEASED);
    return;
  }

  // ---------------- consumers ----------------
  registers_increase<CONSUMER_REGS>();
  const int warp = (tid % 128) / 32, lane = tid % 32;
  const int g = lane / 4, tq = lane % 4;
  const int row_group = warpgroup / CG;
  const int query_first = q0 + row_group * 64;  // this warpgroup's rows: [query_first, query_first + 64)
  const int row0 = query_first + warp * 16 + g;  // this thread's first query row
  // CG = 2: warpgroup 0 computes S (reads Q and K), warpgroup 1 dP (dO and V).
  const bool scores_side = CG == 1 || warpgroup == 0;
  const int col0 = (warpgroup % CG) * DQ;  // this warpgroup's dQ columns

  float dqa[DQ / 8][4];
#pragma unroll
  for (int n = 0; n < DQ / 8; ++n) dqa[n][0] = dqa[n][1] = dqa[n][2] = dqa[n][3] = 0.f;
  if (SINKS && warpgroup % CG == 0) {  // every row, also those that see no key block (steps == 0)
    const float sink2 = sinks[h] * 1.4426950408889634f;
    float part = 0.f;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int i = row0 + 8 * hf;
      if (tq == 0 && i < Nq) part -= fast_exp2(sink2 - lse2[bh * Nq + i]) * delta[bh * Nq + i];
    }
    part = sink_gradient_part(part);
    if (lane == 0) d_sinks_part[bh * nqb * (BM / 16) + (i64)qb * (BM / 16) + row_group * 4 + warp] = part;
  }

  if (steps > 0) {
    float row_l2[2], row_d[2];
    const MaskT* mrow[2] = {nullptr, nullptr};
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int i = row0 + 8 * hf;
      row_l2[hf] = i < Nq ? lse2[bh * Nq + i] : INFINITY;
      row_d[hf] = i < Nq ? delta[bh * Nq + i] : 0.f;
      if (MASK_KIND != 0) mrow[hf] = mask + (i64)b * ip[P_MSB] + (i64)h * ip[P_MSH] + (i64)min(i, Nq - 1) * ip[P_MSQ];
    }
    const i64 msk = MASK_KIND != 0 ? ip[P_MSK] : 0;
    MaskRegs<MASK_KIND, BN / 8, MaskT> masks;  // where the step's mask entries lie, set while S and dP are computed

    // This warpgroup's Q and dO rows (rows past Nq zero-filled; the address stays in bounds).
    // With column groups each warpgroup loads the one it multiplies.
    unsigned char* q_tile = Qs + row_group * Q_GROUP_BYTES;
    unsigned char* do_tile = dOs + row_group * Q_GROUP_BYTES;
    const int q_row = min(query_first, Nq - 1);
    if (scores_side) load_swizzled<64, PANELS, 128, HEAD_DIM>(q_tile, qg.from(q_row), Nq - query_first, vec, tid % 128);
    if (CG == 1 || !scores_side)
      load_swizzled<64, PANELS, 128, HEAD_DIM>(do_tile, dog.from(q_row), Nq - query_first, vec, tid % 128);
    resident_rows_ready(warpgroup);

    const u32 q_addr = smem_u32(q_tile), do_addr = smem_u32(do_tile);
    // The ring's and the tiles' addresses opaque once, before the step loop: else the compiler
    // rebuilds the ring's from the CTA id in every step (S2UR + ULEA; nvcc 13.0, every D up to
    // 256). Past D = 256 (column groups) the loop keeps it without.
    KeyValueRing<STAGES> step_ring = ring;
    u32 keys_at = smem_u32(Ks), values_at = smem_u32(Vs);
    if (DP <= 256) asm volatile("" : "+r"(step_ring.at), "+r"(keys_at), "+r"(values_at));
    float s[BN / 8][4], dp[BN / 8][4];
    float(&s_flat)[BN / 2] = *reinterpret_cast<float(*)[BN / 2]>(&s[0][0]);
    float(&dp_flat)[BN / 2] = *reinterpret_cast<float(*)[BN / 2]>(&dp[0][0]);
    float(&dq_flat)[DQ / 2] = *reinterpret_cast<float(*)[DQ / 2]>(&dqa[0][0]);

    ReadLedger<POISON_RELEASED, STAGES> ledger;  // tests only (wgmma_common.cuh)
    for (int it = 0; it < steps; ++it) {
      const int stage = it % STAGES, key0 = (kb_begin + it) * BN;
      const u32 parity = (it / STAGES) & 1;
      const u32 k_addr = keys_at + stage * TILE_BYTES, v_addr = values_at + stage * TILE_BYTES;

      if (CG == 1) {
        acquire_tile(step_ring.full_keys(stage), parity, !tma);
        wgmma_fence();
        wgmma_shared_shared<BN, DP, 64, T>(s_flat, q_addr, k_addr);
        ledger.commit(ledger.keys(stage));
        acquire_tile(step_ring.full_values(stage), parity, !tma);
        wgmma_fence();
        wgmma_shared_shared<BN, DP, 64, T>(dp_flat, do_addr, v_addr);
        ledger.commit(ledger.values(stage));
        masks.load(mrow, key0, Nk, msk, tq);
        ledger.wait<1>();  // S; dP still running (its wait follows the exponentials)
        fence_registers(s_flat);
      } else {
        // Column groups: one product each, then the swap (two buffers: the other warpgroup last
        // read buffer it % 2 two steps ago, before it arrived at last step's barrier). The same
        // wgmma instructions in both warpgroups, only the descriptors differ (C7520). The resident
        // tile's address is made opaque each step, as in the forward past D = 256.
        float4* mine = fragment_slot<BN / 2>(swap, (it % 2) * 2 + warpgroup, tid % 128);
        float4* theirs = fragment_slot<BN / 2>(swap, (it % 2) * 2 + 1 - warpgroup, tid % 128);
        acquire_tile(scores_side ? step_ring.full_keys(stage) : step_ring.full_values(stage), parity, !tma);
        u32 resident = scores_side ? q_addr : do_addr;
        asm volatile("" : "+r"(resident));
        wgmma_fence();
        wgmma_shared_shared<BN, DP, 64, T>(s_flat, resident, scores_side ? k_addr : v_addr);
        ledger.commit(scores_side ? ledger.keys(stage) : ledger.values(stage));
        masks.load(mrow, key0, Nk, msk, tq);
        ledger.wait<0>();
        fence_registers(s_flat);
        store_fragments(s_flat, mine);
        named_barrier_sync(SWAP_BARRIER, 256);
        load_fragments(dp_flat, theirs);
        if (!scores_side) {  // this warpgroup's product was dP
#pragma unroll
          for (int i = 0; i < BN / 2; ++i) {
            const float x = s_flat[i];
            s_flat[i] = dp_flat[i];
            dp_flat[i] = x;
          }
          acquire_tile(step_ring.full_keys(stage), parity, !tma);  // K: the B operand of dQ += dS K
        }
      }
      // V is read: the producer may refill it (EXP_UNDER_DP: below, once dP has completed).
      if (!EXP_UNDER_DP) ledger.release(ledger.values(stage), step_ring.empty_values(stage), lane == 0);

      // dS into s. Thread element (n, hf, e): query row0 + 8 hf, key key0 + 8 n + 2 tq + e.
      const bool full_block =
          key0 + BN <= Nk && band_covers_tile<CAUSAL, WINDOW>(q0, q_last, key0, key0 + BN - 1, diag, wleft, wright);
      // One score of the masked or edge paths (m: its mask entry's value).
      auto gradient_score = [&](int n, int hf, int e, bool visible, float m) {
        float t = 0.f;
        const float s2 = score_log2<SOFTCAP, MASK_KIND>(s[n][2 * hf + e], visible, m, scale, scale_log2, cap, t);
        const float p = fast_exp2(s2 - row_l2[hf]);
        float ds = p * (dp[n][2 * hf + e] - row_d[hf]);
        if (SOFTCAP) ds *= 1.f - t * t;
        s[n][2 * hf + e] = ds;
      };
      // EXP_UNDER_DP: the interior tile's exponentials before dP's wait; the other paths wait first.
      const bool interior = MASK_KIND == 0 && !SOFTCAP && full_block;
      if (EXP_UNDER_DP && interior) {
#pragma unroll
        for (int n = 0; n < BN / 8; ++n)
#pragma unroll
          for (int r = 0; r < 4; ++r) s[n][r] = fast_exp2(s[n][r] * scale_log2 - row_l2[r / 2]);
      }
      if constexpr (EXP_UNDER_DP) {
        ledger.wait<0>();
        fence_registers(dp_flat);
        ledger.release(ledger.values(stage), step_ring.empty_values(stage), lane == 0);
      }
      if (EXP_UNDER_DP && interior) {
#pragma unroll
        for (int n = 0; n < BN / 8; ++n)
#pragma unroll
          for (int r = 0; r < 4; ++r) s[n][r] *= dp[n][r] - row_d[r / 2];
      } else if (interior) {
#pragma unroll
        for (int n = 0; n < BN / 8; ++n)
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const float p = fast_exp2(s[n][r] * scale_log2 - row_l2[r / 2]);
            s[n][r] = p * (dp[n][r] - row_d[r / 2]);
          }
      } else if (MASK_KIND != 0 && full_block) {
        // Interior tile with an array mask: only the mask decides (softmax_scores_tile says why).
        if (masks.paired) {
#pragma unroll
          for (int n = 0; n < BN / 8; ++n)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
              float m[2];
              masks.pair_inside(hf, n, m);
              gradient_score(n, hf, 0, true, m[0]);
              gradient_score(n, hf, 1, true, m[1]);
            }
        } else {
#pragma unroll
          for (int n = 0; n < BN / 8; ++n)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf)
#pragma unroll
              for (int e = 0; e < 2; ++e) gradient_score(n, hf, e, true, masks.value_inside(hf, n, e));
        }
      } else {
#pragma unroll
        for (int n = 0; n < BN / 8; ++n)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int i = row0 + 8 * hf, j = key0 + n * 8 + 2 * tq + e;
              const bool visible = j < Nk && i < Nq && band_visible<CAUSAL, WINDOW>(i, j, diag, wleft, wright);
              gradient_score(n, hf, e, visible, masks.value(hf, n, e));
            }
      }

      // dQ += dS K: K as the MN-major B operand (rows = keys = the contraction).
      u32 dsa[BN / 16][4];
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) accumulators_to_a<T>(s[2 * kk], s[2 * kk + 1], dsa[kk]);
      fence_registers(dq_flat);
      wgmma_fence();
      wgmma_registers_shared<DQ, BN, T>(dq_flat, dsa, k_addr + (col0 / 64) * BN * 128, BN * 128, 1024);
      ledger.commit(ledger.keys(stage));
      ledger.wait<0>();
      fence_registers(dq_flat);
      ledger.release(ledger.keys(stage), step_ring.empty_keys(stage), lane == 0);
    }
    if constexpr (POISON_RELEASED) ledger.spoil(dq_flat);  // (wgmma_common.cuh: why the if)
  }

  // dQ = scale * dS K (the scores' scale).
  const Rows<T> dqg = head_rows(dq, token_major(Nq, Hq, HEAD_DIM), b, h).from(query_first);
  if constexpr (STAGED_EPILOGUE) {
    // Through this warpgroup's dO tile, whose last reader (dP of the last step) was waited for.
    if (vector_rows<HEAD_DIM>(dqg)) {
      const float scaled[2] = {scale, scale};
      store_tile_staged<HEAD_DIM>(dqa, scaled, dOs + row_group * Q_GROUP_BYTES, warp, lane, Nq - query_first, dqg);
      return;
    }
  }
  store_gradient_tile<HEAD_DIM>(dqa, warp * 16 + g, Nq - query_first, col0, dqg, scale, tq);
}

}  // namespace mlxflash

// Launch bounds for setmaxnreg (see the end of wgmma_common.cuh).
#undef __global__
#define __global__ MLXFLASH_GLOBAL_KERNEL __launch_bounds__(mlxflash::bwdqwg::THREADS, 1)

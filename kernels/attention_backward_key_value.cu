// Attention backward, dK and dV. One CTA of WARPS = RG x CG warps owns BM = 16 * WM * RG keys of
// one (batch, kv head) and CG * HB columns of dK and dV (CTA slice `cslice` of NSLICE). It loops
// over the kv head's GROUP query heads and, for each, over the query blocks of BN rows that can
// see its keys (Q, dO, lse2 and delta tiles double buffered), in the transposed orientation so
// keys are the mma rows:
//   S^T = K Q^T, dP^T = V dO^T, P^T = exp2(S2^T - lse2), dS^T = P^T * (dP^T - delta)
//   dV[:, cols] += P^T dO[:, cols],  dK[:, cols] += dS^T Q[:, cols]
// Warp (rg, cg) owns key rows rg and output columns cg. With CG = 1 it computes the scores of
// its rows for all BN queries and feeds P^T / dS^T from the accumulator registers straight into
// the A operand. With CG > 1 the CG warps of a row group split the BN queries of the score tile
// (each computes BN / CG of them, full-D contraction), write P^T and dS^T to shared memory and
// read the whole tile back as A fragments: every score is computed once per CTA however many
// column groups share it (large D: the dK / dV accumulators need several warps per row).
// GQA heads are summed inside the CTA in a fixed order: no atomics, bitwise reproducible.
// HEAD_SPLIT: SPLITS CTAs (ip[P_SPLITS], at most the group) share a key block's group, each
// summing GROUP / SPLITS of its query heads (the first GROUP % SPLITS one more) into an fp32 part
// ([SPLITS, B, Nk, Hkv, D] buffers); the parts kernel (attention_backward_key_value_parts.cu)
// adds them in split order. Where a call has too few key blocks to fill the GPU (GQA at batch 1,
// short N), the same work on more SMs.
namespace mlxflash {
namespace bwdkv {
typedef {{input_type}} T;
typedef {{mask_type}} MaskT;
constexpr int HEAD_DIM = {{head_dim}};
constexpr int DP = {{padded_dim}};              // D padded to 16: the S / dP contraction
constexpr int DS = {{staged_dim}};              // columns staged in smem (NSLICE * CG * HB >= DP)
constexpr int HB = {{head_block}};              // output columns per warp
constexpr int NSLICE = {{slices}};      // CTAs per key block (column slices of CG * HB)
constexpr int WM = {{m_tiles}};              // 16-row m-tiles per warp
constexpr int RG = {{row_groups}};              // warps along the rows
constexpr int CG = {{col_groups}};              // warps along the output columns
constexpr int BN = {{traversal_block}};              // queries per step
constexpr bool CAUSAL = {{causal}};
constexpr bool WINDOW = {{window}};
constexpr bool SOFTCAP = {{softcap}};
constexpr int MASK_KIND = {{mask_kind}};
constexpr bool HEAD_SPLIT = {{head_split}};
typedef {{gradient_type}} G;                    // dK / dV elements: T, or float parts (HEAD_SPLIT)
constexpr int WARPS = RG * CG, THREADS = 32 * WARPS, BM = 16 * WM * RG;
constexpr int BNW = BN / CG;            // score columns (queries) per warp
constexpr int ROW = DS + 8;
constexpr int PROW = BN + 8;            // P^T / dS^T smem rows (CG > 1)
constexpr int K_ELEMS = BM * ROW, Q_ELEMS = BN * ROW, P_ELEMS = CG > 1 ? BM * PROW : 0;
constexpr int SMEM_BYTES = (2 * K_ELEMS + 4 * Q_ELEMS + 2 * P_ELEMS) * 2 + 4 * BN * 4;
static_assert(BNW % 8 == 0 && BNW * CG == BN, "BN / CG must be a multiple of 8");
static_assert(BN % 16 == 0, "BN must be a multiple of 16");
}  // namespace bwdkv

__device__ void attention_backward_key_value(
    const bwdkv::T* __restrict__ q, const bwdkv::T* __restrict__ k, const bwdkv::T* __restrict__ v,
    const bwdkv::T* __restrict__ d_out, const Layout lq, const Layout lk, const Layout lv, const Layout ldo,
    const float* __restrict__ lse2, const float* __restrict__ delta, const bwdkv::MaskT* __restrict__ mask, const i64* __restrict__ ip, const float* __restrict__ fp,
    bwdkv::G* __restrict__ dk, bwdkv::G* __restrict__ dv) {
  using namespace bwdkv;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* Ks = reinterpret_cast<T*>(smem_raw);
  T* Vs = Ks + K_ELEMS;
  T* Qs = Vs + K_ELEMS;
  T* dOs = Qs + 2 * Q_ELEMS;
  T* Ps = dOs + 2 * Q_ELEMS;
  T* dSs = Ps + P_ELEMS;
  float* Ls = reinterpret_cast<float*>(dSs + P_ELEMS);
  float* Dls = Ls + 2 * BN;

  const i64 bid = linear_block();
  if (bid >= ip[P_TOTAL]) return;
  MLXFLASH_READ_LAUNCH_PARAMS(ip, fp, nkb);

  const int cslice = (int)(bid % NSLICE);
  i64 rest = bid / NSLICE;
  // Head splits next (within a key block's CTAs, so every split of it starts together).
  const int splits = HEAD_SPLIT ? (int)ip[P_SPLITS] : 1, split = HEAD_SPLIT ? (int)(rest % splits) : 0;
  rest /= splits;
  int kb;  // causal: key block 0 sees the most queries, so ascending order is longest first
  i64 bkv;
  block_of(rest, nkb, ip[P_BLOCK_MAJOR] != 0, ip[P_BATCH] * Hkv, kb, bkv);
  const int b = (int)(bkv / Hkv), hk = (int)(bkv % Hkv);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // (CG = 1: folded at compile time, the layout of the 4-warp kernels)
  const int rg = CG == 1 ? warp : warp % RG, cg = CG == 1 ? 0 : warp / RG;
  const int g = lane / 4, tq = lane % 4;
  const int k0 = kb * BM, col0 = (cslice * CG + cg) * HB;
  const int wrow = rg * 16 * WM;  // this warp's first key row in the block
  const int qcol = cg * BNW;      // this warp's first score column (query) in the step

  // This CTA's query heads h0.. (group / splits each, the first group % splits splits one more).
  const int per_split = group / splits, extra = group % splits;
  const int heads = per_split + (split < extra), h0 = hk * group + split * per_split + min(split, extra);
  const Rows<const T> kg = head_rows(k, lk, b, hk).from(k0);
  const Rows<const T> vg = head_rows(v, lv, b, hk).from(k0);
  // Q / dO rows of the group's query heads (vector loads for all of them: head stride too).
  const bool vec = vector_rows<HEAD_DIM>(kg) && vector_rows<HEAD_DIM>(vg) &&
                   vector_rows<HEAD_DIM>(head_rows(q, lq, b, h0)) && lq.head % 8 == 0 &&
                   vector_rows<HEAD_DIM>(head_rows(d_out, ldo, b, h0)) && ldo.head % 8 == 0;

  const int k_last = min(k0 + BM, Nk) - 1;
  int qb_begin, qb_count;  // the query blocks any key of this block is seen by
  query_block_range<CAUSAL, WINDOW, BN>(k0, k_last, Nq, diag, wleft, wright, qb_begin, qb_count);
  const int items = qb_count * heads;  // (query head from h0, query block) pairs

  float dka[WM][HB / 8][4], dva[WM][HB / 8][4];
#pragma unroll
  for (int mt = 0; mt < WM; ++mt)
#pragma unroll
    for (int n = 0; n < HB / 8; ++n)
#pragma unroll
      for (int r = 0; r < 4; ++r) dka[mt][n][r] = dva[mt][n][r] = 0.f;

  // Stage loader for item it: Q / dO tiles (async) and lse2 / delta (plain stores).
  auto load_item = [&](int it, int stage) {
    const int gi = it / qb_count, qs = (qb_begin + it % qb_count) * BN;
    const int h = h0 + gi;
    const i64 bh = (i64)b * Hq + h;
    load_tile<BN, DS, ROW, THREADS>(Qs + stage * Q_ELEMS, head_rows(q, lq, b, h).from(qs), Nq - qs, 0, HEAD_DIM,
                                    vec, tid);
    load_tile<BN, DS, ROW, THREADS>(dOs + stage * Q_ELEMS, head_rows(d_out, ldo, b, h).from(qs), Nq - qs, 0,
                                    HEAD_DIM, vec, tid);
    for (int c = tid; c < BN; c += THREADS) {
      const bool ok = qs + c < Nq;
      Ls[stage * BN + c] = ok ? lse2[bh * Nq + qs + c] : INFINITY;
      Dls[stage * BN + c] = ok ? delta[bh * Nq + qs + c] : 0.f;
    }
  };

  if (items > 0) {
    load_tile<BM, DS, ROW, THREADS>(Ks, kg, Nk - k0, 0, HEAD_DIM, vec, tid);
    load_tile<BM, DS, ROW, THREADS>(Vs, vg, Nk - k0, 0, HEAD_DIM, vec, tid);
    load_item(0, 0);
    cp_async_commit();
  }
  const i64 msk = MASK_KIND != 0 ? ip[P_MSK] : 0, msq = MASK_KIND != 0 ? ip[P_MSQ] : 0;

  for (int it = 0; it < items; ++it) {
    const int stage = it & 1;
    if (it + 1 < items) load_item(it + 1, stage ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const T* Qst = Qs + stage * Q_ELEMS;
    const T* dOst = dOs + stage * Q_ELEMS;
    const float* Lst = Ls + stage * BN;
    const float* Dst = Dls + stage * BN;
    const int gi = it / qb_count, qs = (qb_begin + it % qb_count) * BN;

    // S^T = K Q^T and dP^T = V dO^T for this warp's rows and queries [qcol, qcol + BNW).
    float s[WM][BNW / 8][4], dp[WM][BNW / 8][4];
    dual_gemm_abt<WM, BNW, DP, ROW>(s, dp, Ks, Vs, wrow, Qst, dOst, qcol, lane);

    // P^T into s, dS^T into dp.
    const bool full_block = qs + BN <= Nq && k0 + BM <= Nk &&
        band_covers_tile<CAUSAL, WINDOW>(qs, qs + BN - 1, k0, k0 + BM - 1, diag, wleft, wright);
    const MaskT* mhead = nullptr;
    if (MASK_KIND != 0) mhead = mask + (i64)b * ip[P_MSB] + (i64)(h0 + gi) * ip[P_MSH];
#pragma unroll
    for (int mt = 0; mt < WM; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int j = k0 + wrow + mt * 16 + g + 8 * hf;  // key
#pragma unroll
        for (int n = 0; n < BNW / 8; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int cl = qcol + n * 8 + 2 * tq + e, i = qs + cl;  // query
            float t = 0.f;
            // Inside a full block every index is in range and in the band (an array mask too).
            bool visible = true;
            if (!full_block) visible = j < Nk && i < Nq && band_visible<CAUSAL, WINDOW>(i, j, diag, wleft, wright);
            const MaskT* mp = MASK_KIND == 0 ? nullptr
                              : full_block   ? mhead + (i64)i * msq + (i64)j * msk
                                             : mhead + (i64)min(i, Nq - 1) * msq + (i64)min(j, Nk - 1) * msk;
            const float s2 = score_log2<SOFTCAP, MASK_KIND>(s[mt][n][2 * hf + e], visible, mp, scale, scale_log2, cap, t);
            const float p = fast_exp2(s2 - Lst[cl]);
            float ds = p * (dp[mt][n][2 * hf + e] - Dst[cl]);
            if (SOFTCAP) ds *= 1.f - t * t;
            s[mt][n][2 * hf + e] = p;
            dp[mt][n][2 * hf + e] = ds;
          }
      }

    if constexpr (CG > 1) {
      // Share the score tile: each warp writes its P^T / dS^T columns, then reads whole rows.
#pragma unroll
      for (int mt = 0; mt < WM; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int r = wrow + mt * 16 + g + 8 * hf;
#pragma unroll
          for (int n = 0; n < BNW / 8; ++n) {
            const int c = qcol + n * 8 + 2 * tq;
            store2(Ps + r * PROW + c, s[mt][n][2 * hf], s[mt][n][2 * hf + 1]);
            store2(dSs + r * PROW + c, dp[mt][n][2 * hf], dp[mt][n][2 * hf + 1]);
          }
        }
      __syncthreads();
    }

    // dV[:, cols] += P^T dO[:, cols];  dK[:, cols] += dS^T Q[:, cols]
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      u32 ap[WM][4], as[WM][4];
#pragma unroll
      for (int mt = 0; mt < WM; ++mt) {
        if constexpr (CG > 1) {
          const int off = (wrow + mt * 16 + lane % 16) * PROW + kk * 16 + (lane / 16) * 8;
          ldmatrix_x4(ap[mt], Ps + off);
          ldmatrix_x4(as[mt], dSs + off);
        } else {
          // P^T / dS^T from the accumulators: the C layout of two n8 tiles is the A layout of one k16.
          accumulators_to_a<T>(s[mt][2 * kk], s[mt][2 * kk + 1], ap[mt]);
          accumulators_to_a<T>(dp[mt][2 * kk], dp[mt][2 * kk + 1], as[mt]);
        }
      }
#pragma unroll
      for (int nn = 0; nn < HB / 16; ++nn) {
        u32 bd[4], bq[4];
        const int mi = lane / 8;
        const int off = (kk * 16 + (mi % 2) * 8 + lane % 8) * ROW + col0 + nn * 16 + (mi / 2) * 8;
        ldmatrix_x4_trans(bd, dOst + off);
        ldmatrix_x4_trans(bq, Qst + off);
#pragma unroll
        for (int mt = 0; mt < WM; ++mt) {
          mma(dva[mt][2 * nn], ap[mt], bd[0], bd[1], T());
          mma(dva[mt][2 * nn + 1], ap[mt], bd[2], bd[3], T());
          mma(dka[mt][2 * nn], as[mt], bq[0], bq[1], T());
          mma(dka[mt][2 * nn + 1], as[mt], bq[2], bq[3], T());
        }
      }
    }
    __syncthreads();
  }

  // dK, dV into [B, Nk, Hkv, D] buffers (HEAD_SPLIT: this split's part of [SPLITS, B, Nk, Hkv, D]).
  const i64 part = HEAD_SPLIT ? split * (i64)ip[P_BATCH] * Nk * Hkv * HEAD_DIM : 0;
  const Rows<G> dkg = head_rows(dk + part, token_major(Nk, Hkv, HEAD_DIM), b, hk);
  const Rows<G> dvg = head_rows(dv + part, token_major(Nk, Hkv, HEAD_DIM), b, hk);
#pragma unroll
  for (int mt = 0; mt < WM; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int j = k0 + wrow + mt * 16 + g + 8 * hf;
      if (j >= Nk) continue;
      G* krow = dkg.p + j * dkg.row;
      G* vrow = dvg.p + j * dvg.row;
#pragma unroll
      for (int n = 0; n < HB / 8; ++n) {
        const int c = col0 + n * 8 + 2 * tq;
        const float kx = dka[mt][n][2 * hf] * scale, ky = dka[mt][n][2 * hf + 1] * scale;
        const float vx = dva[mt][n][2 * hf], vy = dva[mt][n][2 * hf + 1];
        if (HEAD_DIM % 2 == 0) {
          if (c < HEAD_DIM) {
            store2(krow + c, kx, ky);
            store2(vrow + c, vx, vy);
          }
        } else {
          if (c < HEAD_DIM) {
            store1(krow + c, kx);
            store1(vrow + c, vx);
          }
          if (c + 1 < HEAD_DIM) {
            store1(krow + c + 1, ky);
            store1(vrow + c + 1, vy);
          }
        }
      }
    }
}

}  // namespace mlxflash

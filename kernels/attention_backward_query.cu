// Attention backward, dQ. One CTA of WARPS = RG x CG warps owns BM = 16 * WM * RG query rows of
// one (batch, head) and CG * HB dQ columns (CTA slice `cslice` of NSLICE), and streams the key
// blocks those rows can see:
//   S = Q K^T, dP = dO V^T (both full-D contractions, mma.sync), P = exp2(S2 - lse2),
//   dS = P * (dP - delta) [* (1 - tanh^2) with softcap],  dQ[:, cols] += dS K[:, cols].
// Warp (rg, cg) owns rows rg and dQ columns cg. With CG = 1, dS goes from the accumulator
// registers straight into the A operand; with CG > 1 the CG warps of a row group split the BN
// keys of the score tile, write dS to shared memory and read whole rows back (each score is
// computed once per CTA). No atomics: each dQ element has one owner, so the result is bitwise
// reproducible. With SINKS, each row-group warp (cg = 0, slice 0) also writes its rows' part of the
// sink gradient, -sum_i exp2(sink2 - lse2_i) delta_i, to d_sinks_part[b, h, qb * RG + rg]; the
// caller sums the parts.
namespace mlxflash {
namespace bwdq {
typedef {{input_type}} T;
typedef {{mask_type}} MaskT;
constexpr int HEAD_DIM = {{head_dim}};
constexpr int DP = {{padded_dim}};              // D padded to 16: the S / dP contraction
constexpr int DS = {{staged_dim}};              // columns staged in smem (NSLICE * CG * HB >= DP)
constexpr int HB = {{head_block}};              // dQ columns per warp
constexpr int NSLICE = {{slices}};      // CTAs per query block (column slices of CG * HB)
constexpr int WM = {{m_tiles}};              // 16-row m-tiles per warp
constexpr int RG = {{row_groups}};              // warps along the rows
constexpr int CG = {{col_groups}};              // warps along the dQ columns
constexpr int BN = {{traversal_block}};              // keys per step
constexpr bool CAUSAL = {{causal}};
constexpr bool WINDOW = {{window}};
constexpr bool SOFTCAP = {{softcap}};
constexpr int MASK_KIND = {{mask_kind}};
constexpr bool SINKS = {{sinks}};
constexpr int WARPS = RG * CG, THREADS = 32 * WARPS, BM = 16 * WM * RG;
constexpr int BNW = BN / CG;            // score columns (keys) per warp
constexpr int ROW = DS + 8;
constexpr int PROW = BN + 8;            // dS smem rows (CG > 1)
constexpr int Q_ELEMS = BM * ROW, K_ELEMS = BN * ROW, P_ELEMS = CG > 1 ? BM * PROW : 0;
constexpr int SMEM_BYTES = (2 * Q_ELEMS + 4 * K_ELEMS + P_ELEMS) * 2;
static_assert(BNW % 8 == 0 && BNW * CG == BN, "BN / CG must be a multiple of 8");
static_assert(BN % 16 == 0, "BN must be a multiple of 16");
}  // namespace bwdq

__device__ void attention_backward_query(const bwdq::T* __restrict__ q, const bwdq::T* __restrict__ k,
                                         const bwdq::T* __restrict__ v, const bwdq::T* __restrict__ d_out,
                                         const Layout lq, const Layout lk, const Layout lv, const Layout ldo,
                                         const float* __restrict__ lse2, const float* __restrict__ delta,
                                         const bwdq::MaskT* __restrict__ mask, const float* __restrict__ sinks,
                                         const i64* __restrict__ ip, const float* __restrict__ fp,
                                         bwdq::T* __restrict__ dq, float* __restrict__ d_sinks_part) {
  using namespace bwdq;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* Qs = reinterpret_cast<T*>(smem_raw);
  T* dOs = Qs + Q_ELEMS;
  T* Ks = dOs + Q_ELEMS;
  T* Vs = Ks + 2 * K_ELEMS;
  T* dSs = Vs + 2 * K_ELEMS;

  const i64 bid = linear_block();
  if (bid >= ip[P_TOTAL]) return;
  MLXFLASH_READ_LAUNCH_PARAMS(ip, fp, nqb);

  const int cslice = (int)(bid % NSLICE);
  i64 rest = bid / NSLICE;
  int qb;
  i64 bh;
  query_block_of<CAUSAL>(rest, nqb, ip, Hq, qb, bh);
  const int b = (int)(bh / Hq), h = (int)(bh % Hq), hk = h / group;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // (CG = 1: folded at compile time, the layout of the 4-warp kernels)
  const int rg = CG == 1 ? warp : warp % RG, cg = CG == 1 ? 0 : warp / RG;
  const int g = lane / 4, tq = lane % 4;
  const int q0 = qb * BM, col0 = (cslice * CG + cg) * HB;
  const int wrow = rg * 16 * WM;  // this warp's first query row in the block
  const int kcol = cg * BNW;      // this warp's first score column (key) in the step

  const Rows<const T> qg = head_rows(q, lq, b, h).from(q0);
  const Rows<const T> dog = head_rows(d_out, ldo, b, h).from(q0);
  const Rows<const T> kg = head_rows(k, lk, b, hk);
  const Rows<const T> vg = head_rows(v, lv, b, hk);
  const bool vec = vector_rows<HEAD_DIM>(qg) && vector_rows<HEAD_DIM>(dog) && vector_rows<HEAD_DIM>(kg) &&
                   vector_rows<HEAD_DIM>(vg);

  const int q_last = min(q0 + BM, Nq) - 1;
  int kb_begin, kb_end;  // the key blocks any row of this block may see
  key_block_range<CAUSAL, WINDOW, BN>(q0, q_last, Nk, diag, wleft, wright, kb_begin, kb_end);

  float acc[WM][HB / 8][4];
  float row_l2[WM][2], row_d[WM][2];
  const MaskT* mrow[WM][2];
  const i64 mbase = MASK_KIND != 0 ? (i64)b * ip[P_MSB] + (i64)h * ip[P_MSH] : 0;
#pragma unroll
  for (int mt = 0; mt < WM; ++mt) {
#pragma unroll
    for (int n = 0; n < HB / 8; ++n) acc[mt][n][0] = acc[mt][n][1] = acc[mt][n][2] = acc[mt][n][3] = 0.f;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int i = q0 + wrow + mt * 16 + g + 8 * hf;
      const int ic = min(i, Nq - 1);
      row_l2[mt][hf] = i < Nq ? lse2[bh * Nq + i] : INFINITY;
      row_d[mt][hf] = i < Nq ? delta[bh * Nq + i] : 0.f;
      if (MASK_KIND != 0) mrow[mt][hf] = mask + mbase + (i64)ic * ip[P_MSQ];
    }
  }
  const i64 msk = MASK_KIND != 0 ? ip[P_MSK] : 0;
  if (SINKS && cg == 0 && cslice == 0) {
    const float sink2 = sinks[h] * 1.4426950408889634f;
    float part = 0.f;
#pragma unroll
    for (int mt = 0; mt < WM; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)  // rows past Nq: lse2 = +inf, delta = 0
        if (tq == 0) part -= fast_exp2(sink2 - row_l2[mt][hf]) * row_d[mt][hf];
    part = sink_gradient_part(part);
    if (lane == 0) d_sinks_part[bh * nqb * RG + (i64)qb * RG + rg] = part;
  }

  if (kb_begin < kb_end) {
    load_tile<BM, DS, ROW, THREADS>(Qs, qg, Nq - q0, 0, HEAD_DIM, vec, tid);
    load_tile<BM, DS, ROW, THREADS>(dOs, dog, Nq - q0, 0, HEAD_DIM, vec, tid);
    const int k0 = kb_begin * BN;
    load_tile<BN, DS, ROW, THREADS>(Ks, kg.from(k0), Nk - k0, 0, HEAD_DIM, vec, tid);
    load_tile<BN, DS, ROW, THREADS>(Vs, vg.from(k0), Nk - k0, 0, HEAD_DIM, vec, tid);
    cp_async_commit();
  }

  for (int kb = kb_begin; kb < kb_end; ++kb) {
    const int stage = (kb - kb_begin) & 1;
    if (kb + 1 < kb_end) {
      const int k1 = (kb + 1) * BN;
      load_tile<BN, DS, ROW, THREADS>(Ks + (stage ^ 1) * K_ELEMS, kg.from(k1), Nk - k1, 0, HEAD_DIM, vec, tid);
      load_tile<BN, DS, ROW, THREADS>(Vs + (stage ^ 1) * K_ELEMS, vg.from(k1), Nk - k1, 0, HEAD_DIM, vec, tid);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const T* Kst = Ks + stage * K_ELEMS;
    const T* Vst = Vs + stage * K_ELEMS;

    // S = Q K^T and dP = dO V^T for this warp's rows and keys [kcol, kcol + BNW).
    float s[WM][BNW / 8][4], dp[WM][BNW / 8][4];
    dual_gemm_abt<WM, BNW, DP, ROW>(s, dp, Qs, dOs, wrow, Kst, Vst, kcol, lane);

    // dS = P * (dP - delta) [* (1 - t^2)], written over s.
    const int key0 = kb * BN;
    const bool full_block =
        key0 + BN <= Nk && band_covers_tile<CAUSAL, WINDOW>(q0, q_last, key0, key0 + BN - 1, diag, wleft, wright);
#pragma unroll
    for (int mt = 0; mt < WM; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = q0 + wrow + mt * 16 + g + 8 * hf;
#pragma unroll
        for (int n = 0; n < BNW / 8; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int j = key0 + kcol + n * 8 + 2 * tq + e;
            float t = 0.f;
            // Inside a full block every index is in range and in the band (an array mask too).
            bool visible = true;
            if (!full_block) visible = j < Nk && i < Nq && band_visible<CAUSAL, WINDOW>(i, j, diag, wleft, wright);
            const MaskT* mp = MASK_KIND != 0 ? mrow[mt][hf] + (i64)(full_block ? j : min(j, Nk - 1)) * msk : nullptr;
            const float s2 = score_log2<SOFTCAP, MASK_KIND>(s[mt][n][2 * hf + e], visible, mp, scale, scale_log2, cap, t);
            const float p = fast_exp2(s2 - row_l2[mt][hf]);
            float ds = p * (dp[mt][n][2 * hf + e] - row_d[mt][hf]);
            if (SOFTCAP) ds *= 1.f - t * t;
            s[mt][n][2 * hf + e] = ds;
          }
      }

    if constexpr (CG > 1) {
      // Share the score tile: each warp writes its dS columns, then reads whole rows.
#pragma unroll
      for (int mt = 0; mt < WM; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int r = wrow + mt * 16 + g + 8 * hf;
#pragma unroll
          for (int n = 0; n < BNW / 8; ++n)
            store2(dSs + r * PROW + kcol + n * 8 + 2 * tq, s[mt][n][2 * hf], s[mt][n][2 * hf + 1]);
        }
      __syncthreads();
    }

    // dQ[:, cols] += dS K[:, cols]
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      u32 a[WM][4];
#pragma unroll
      for (int mt = 0; mt < WM; ++mt) {
        if constexpr (CG > 1) {
          ldmatrix_x4(a[mt], dSs + (wrow + mt * 16 + lane % 16) * PROW + kk * 16 + (lane / 16) * 8);
        } else {
          // dS from the accumulators: the C layout of two n8 tiles is the A layout of one k16.
          accumulators_to_a<T>(s[mt][2 * kk], s[mt][2 * kk + 1], a[mt]);
        }
      }
#pragma unroll
      for (int nn = 0; nn < HB / 16; ++nn) {
        u32 bfr[4];
        const int mi = lane / 8;
        ldmatrix_x4_trans(bfr, Kst + (kk * 16 + (mi % 2) * 8 + lane % 8) * ROW + col0 + nn * 16 + (mi / 2) * 8);
#pragma unroll
        for (int mt = 0; mt < WM; ++mt) {
          mma(acc[mt][2 * nn], a[mt], bfr[0], bfr[1], T());
          mma(acc[mt][2 * nn + 1], a[mt], bfr[2], bfr[3], T());
        }
      }
    }
    __syncthreads();
  }

  const Rows<T> dqg = head_rows(dq, token_major(Nq, Hq, HEAD_DIM), b, h);
#pragma unroll
  for (int mt = 0; mt < WM; ++mt)
    store_gradient_tile<HEAD_DIM>(acc[mt], q0 + wrow + mt * 16 + g, Nq, col0, dqg, scale, tq);
}

}  // namespace mlxflash

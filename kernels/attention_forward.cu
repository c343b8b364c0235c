// Attention forward: O = softmax(scale * Q K^T + mask) V and L = logsumexp (natural log, fp32).
//
// One CTA of WARPS = RG x CG warps owns BM = 16 * WM * RG query rows of one (batch, head) and
// CG * HB output columns (CTA slice `cslice` of NSLICE); warp (rg, cg) owns 16 * WM rows and HB
// columns. It streams key blocks of BN keys (K and V tiles double buffered through cp.async),
// computes S = Q K^T with mma.sync m16n8k16, applies softcap and masks, runs the online softmax
// in fp32 (base 2), and feeds P straight from registers into O += P V. Key blocks outside the
// causal / window band are never loaded. Head dims whose O does not fit one warp's registers are
// split into column groups: the CG warps of a row group each recompute S for their rows (sharing
// the K / V tiles in shared memory), and past that into NSLICE CTAs.
// Rendered by mlx_flash.backends.cuda_source with the constants below.
namespace mlxflash {
namespace fwd {
typedef {{input_type}} T;
typedef {{mask_type}} MaskT;
constexpr int HEAD_DIM = {{head_dim}};  // real D
constexpr int DP = {{padded_dim}};              // D padded to 16 (QK^T contraction)
constexpr int HB = {{head_block}};              // output columns per warp (multiple of 16)
constexpr int NSLICE = {{slices}};      // CTAs per query block (column slices of CG * HB)
constexpr int WM = {{m_tiles}};              // 16-row m-tiles per warp
constexpr int RG = {{row_groups}};              // warps along the rows
constexpr int CG = {{col_groups}};              // warps along the output columns
constexpr int BN = {{traversal_block}};              // keys per step
constexpr bool CAUSAL = {{causal}};
constexpr bool WINDOW = {{window}};
constexpr bool SOFTCAP = {{softcap}};
constexpr int MASK_KIND = {{mask_kind}};
constexpr bool SINKS = {{sinks}};       // attention sinks: sinks [Hq] fp32 start each row's softmax
constexpr int WARPS = RG * CG, THREADS = 32 * WARPS, BM = 16 * WM * RG;
constexpr int VC = CG * HB;             // V columns staged per CTA
constexpr int QROW = DP + 8, KROW = DP + 8, VROW = VC + 8;  // padded smem rows (elements)
constexpr int Q_ELEMS = BM * QROW, K_ELEMS = BN * KROW, V_ELEMS = BN * VROW;
constexpr int SMEM_BYTES = (Q_ELEMS + 2 * K_ELEMS + 2 * V_ELEMS) * 2;
}  // namespace fwd

__device__ void attention_forward(const fwd::T* __restrict__ q, const fwd::T* __restrict__ k,
                                  const fwd::T* __restrict__ v, const Layout lq, const Layout lk, const Layout lv,
                                  const fwd::MaskT* __restrict__ mask,
                                  const float* __restrict__ sinks, const i64* __restrict__ ip,
                                  const float* __restrict__ fp, fwd::T* __restrict__ out, float* __restrict__ lse) {
  using namespace fwd;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* Qs = reinterpret_cast<T*>(smem_raw);
  T* Ks = Qs + Q_ELEMS;
  T* Vs = Ks + 2 * K_ELEMS;

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
  const int q0 = qb * BM;
  const int vcol0 = cslice * VC;     // first V column staged by this CTA
  const int col0 = vcol0 + cg * HB;  // first output column of this warp
  const int wrow = rg * 16 * WM;     // this warp's first query row in the block

  const Rows<const T> qg = head_rows(q, lq, b, h).from(q0);
  const Rows<const T> kg = head_rows(k, lk, b, hk);
  const Rows<const T> vg = head_rows(v, lv, b, hk);
  const bool vec = vector_rows<HEAD_DIM>(qg) && vector_rows<HEAD_DIM>(kg) && vector_rows<HEAD_DIM>(vg);

  const int q_last = min(q0 + BM, Nq) - 1;
  int kb_begin, kb_end;  // the key blocks any row of this block may see
  key_block_range<CAUSAL, WINDOW, BN>(q0, q_last, Nk, diag, wleft, wright, kb_begin, kb_end);

  float o[WM][HB / 8][4];
  float row_max[WM][2], row_sum[WM][2];
#pragma unroll
  for (int mt = 0; mt < WM; ++mt) {
#pragma unroll
    for (int n = 0; n < HB / 8; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
    row_max[mt][0] = row_max[mt][1] = -INFINITY;
    row_sum[mt][0] = row_sum[mt][1] = 0.f;
    if (SINKS) {
      sink_row_state(sinks[h], tq, row_max[mt][0], row_sum[mt][0]);
      sink_row_state(sinks[h], tq, row_max[mt][1], row_sum[mt][1]);
    }
  }
  const fwd::MaskT* mrow[WM][2];
  if (MASK_KIND != 0) {
    const i64 mbase = (i64)b * ip[P_MSB] + (i64)h * ip[P_MSH];
#pragma unroll
    for (int mt = 0; mt < WM; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = min(q0 + wrow + mt * 16 + g + 8 * hf, Nq - 1);
        mrow[mt][hf] = mask + mbase + (i64)i * ip[P_MSQ];
      }
  }
  const i64 msk = MASK_KIND != 0 ? ip[P_MSK] : 0;

  if (kb_begin < kb_end) {
    load_tile<BM, DP, QROW, THREADS>(Qs, qg, Nq - q0, 0, HEAD_DIM, vec, tid);
    const int k0 = kb_begin * BN;
    load_tile<BN, DP, KROW, THREADS>(Ks, kg.from(k0), Nk - k0, 0, HEAD_DIM, vec, tid);
    load_tile<BN, VC, VROW, THREADS>(Vs, vg.from(k0), Nk - k0, vcol0, HEAD_DIM, vec, tid);
    cp_async_commit();
  }

  for (int kb = kb_begin; kb < kb_end; ++kb) {
    const int stage = (kb - kb_begin) & 1;
    if (kb + 1 < kb_end) {
      const int k1 = (kb + 1) * BN;
      load_tile<BN, DP, KROW, THREADS>(Ks + (stage ^ 1) * K_ELEMS, kg.from(k1), Nk - k1, 0, HEAD_DIM, vec, tid);
      load_tile<BN, VC, VROW, THREADS>(Vs + (stage ^ 1) * V_ELEMS, vg.from(k1), Nk - k1, vcol0, HEAD_DIM, vec, tid);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const T* Kst = Ks + stage * K_ELEMS;
    const T* Vst = Vs + stage * V_ELEMS;

    // S = Q K^T
    float s[WM][BN / 8][4];
#pragma unroll
    for (int mt = 0; mt < WM; ++mt)
#pragma unroll
      for (int n = 0; n < BN / 8; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) {
      u32 a[WM][4];
#pragma unroll
      for (int mt = 0; mt < WM; ++mt)
        ldmatrix_x4(a[mt], Qs + (wrow + mt * 16 + lane % 16) * QROW + kk * 16 + (lane / 16) * 8);
#pragma unroll
      for (int nn = 0; nn < BN / 16; ++nn) {
        u32 bfr[4];
        const int mi = lane / 8;
        ldmatrix_x4(bfr, Kst + (nn * 16 + (mi / 2) * 8 + lane % 8) * KROW + kk * 16 + (mi % 2) * 8);
#pragma unroll
        for (int mt = 0; mt < WM; ++mt) {
          mma(s[mt][2 * nn], a[mt], bfr[0], bfr[1], T());
          mma(s[mt][2 * nn + 1], a[mt], bfr[2], bfr[3], T());
        }
      }
    }

    // Scores -> log2 units with masks; online softmax (P replaces S, O is rescaled).
    const int key0 = kb * BN;
    const bool full_block =
        key0 + BN <= Nk && band_covers_tile<CAUSAL, WINDOW>(q0, q_last, key0, key0 + BN - 1, diag, wleft, wright);
#pragma unroll
    for (int mt = 0; mt < WM; ++mt) {
      MaskRegs<MASK_KIND, BN / 8, fwd::MaskT> masks;
      masks.load(mrow[mt], key0, Nk, msk, tq);
      online_softmax_tile<CAUSAL, WINDOW, SOFTCAP, MASK_KIND>(
          s[mt], o[mt], row_max[mt], row_sum[mt], masks, q0 + wrow + mt * 16 + g, key0, full_block,
          Nq, Nk, diag, wleft, wright, scale, scale_log2, cap, tq);
    }

    // O += P V (P from the accumulator registers: the C layout of two n8 tiles is the A layout of one k16).
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      u32 a[WM][4];
#pragma unroll
      for (int mt = 0; mt < WM; ++mt) {
        accumulators_to_a<T>(s[mt][2 * kk], s[mt][2 * kk + 1], a[mt]);
      }
#pragma unroll
      for (int nn = 0; nn < HB / 16; ++nn) {
        u32 bfr[4];
        const int mi = lane / 8;
        ldmatrix_x4_trans(bfr, Vst + (kk * 16 + (mi % 2) * 8 + lane % 8) * VROW + cg * HB + nn * 16 + (mi / 2) * 8);
#pragma unroll
        for (int mt = 0; mt < WM; ++mt) {
          mma(o[mt][2 * nn], a[mt], bfr[0], bfr[1], T());
          mma(o[mt][2 * nn + 1], a[mt], bfr[2], bfr[3], T());
        }
      }
    }
    __syncthreads();
  }

  // Normalize and store O (rows < Nq, columns < D; a [B, Nq, Hq, D] buffer) and L.
  const Rows<T> og = head_rows(out, token_major(Nq, Hq, HEAD_DIM), b, h);
#pragma unroll
  for (int mt = 0; mt < WM; ++mt)
    store_output_tile<HEAD_DIM>(o[mt], row_max[mt], row_sum[mt], q0 + wrow + mt * 16 + g, Nq, col0, og,
                                cslice == 0 && cg == 0 ? lse + bh * Nq : nullptr, tq);
}

}  // namespace mlxflash

// Attention backward, dK and dV, for Hopper (sm_90a): the algorithm of
// attention_backward_key_value.cu with warpgroup MMAs and warp specialization.
//
// One CTA owns BM = 64 * CONSUMERS keys of one (batch, kv head) and all of D. It loops over the
// kv head's GROUP query heads and, for each, over the query blocks of BN rows that can see its
// keys ("items"), in the transposed orientation so keys are the MMA rows:
//   S^T = K Q^T, dP^T = V dO^T                          (wgmma, both operands in shared memory)
//   P^T = exp2(S2^T - lse2), dS^T = P^T * (dP^T - delta) (registers)
//   dV += P^T dO, dK += dS^T Q                         (wgmma, P^T / dS^T from registers)
// - A producer warpgroup streams each item's Q and dO tiles into a ring of STAGES buffers: one
//   thread issues a TMA load per panel through one map per operand over the group's query
//   heads (rows TMA cannot name: cp.async from all 128 threads); the hardware announces each
//   tile on an mbarrier as it lands. The item's lse2 and delta values go
//   beside them through ordinary loads and stores, each announced by its own thread's arrive
//   (see the producer: the consumers read them with ordinary loads, not through wgmma).
// - CG = 1, NSLICE = 1 (D <= blocks_cuda.txt's H): CONSUMERS consumer warpgroups own 64 keys
//   each: their K and V rows stay in shared memory for the whole loop, their dK and dV
//   accumulators (all DS = D columns, DS / 2 floats each per thread) in registers. Up to D = 160
//   they fit beside the score tiles at BN <= 32 (nvcc 13.0: 12 bytes spilled at D = 160; D = 192
//   spills 576 and serializes the wgmmas).
// Past H the accumulators of all D columns do not fit beside the score tiles; blocks_cuda.txt
// picks one of two schemes by its P (keys per CTA), with H = 128:
// - CG = 2 (P = 64, column groups): both consumer warpgroups own the same 64 keys and split the
//   columns: warpgroup w accumulates dK and dV for columns [128 w, 128 w + 128)
//   of Q / dO tiles zero-filled to 256 columns. (Both take 128: the same instructions in both
//   warpgroups, see the swap below; the MN-major B operand could not begin inside a 128-byte
//   swizzle row anyway.) Warpgroup 0 computes S^T = K Q^T, warpgroup 1 dP^T = V dO^T, each over
//   all of D, and they swap the two tiles through shared memory (fp32, so P^T and dS^T are the
//   same bits in both): each score product is computed once per CTA, 2/3 of the slices' MMA
//   work at D = 256. But the warpgroups meet at a barrier every step, so neither's arithmetic
//   hides behind the other's MMAs.
// - NSLICE > 1 (P = 128, slices): NSLICE CTAs share a key block, each computing dK and dV for
//   its 128 columns and recomputing S^T and dP^T over all of D; the Q / dO tiles carry 2 NSLICE
//   panels (columns past D zero-filled).
// - Both past D = 256 (P = 64, CG = 2, NSLICE = 2): the two CTAs of a key block each cover 256
//   columns of dK and dV and recompute S^T and dP^T (at D = 512, 6 products' work for 4), or,
//   for calls without a causal mask or window (ROLES), split by role. The keys' CTA computes dK
//   for all of D: warpgroup 0 S^T, warpgroup 1 dP^T, swapped as above, each accumulating dK for
//   256 columns. The values' CTA computes dV for all of D and needs P^T only: each warpgroup
//   computes S^T over half of D (HALF_PANELS of K's panels; K is its only resident tile) and
//   they add the two parts through the swap area (a + b == b + a: both hold the same S^T), as
//   the forward's column groups add S; each then accumulates dV for 256 columns. At D = 512
//   that is 5 products' work per key block for 6. H200, fwd+bwd time by role / by columns: D =
//   512 0.968x (GQA 4:1 N=8192 0.967x), D = 448 0.979x; not faster at D = 320..384 or causal
//   (blocks_cuda.txt's roles: D = 385..512 without a causal mask or window). So the values'
//   CTA saves less than its share of the products; not profiled apart, likely
//   because its steps of BN = 16 are short and the per-step waits weigh more, and under a causal
//   mask because the keys' CTAs, as long as the slices, set the tail. K and V (64 rows of all of
//   D, 128 KB) leave room for BN = 16 only.
// H100, B=1 H=16 N=4096, interleaved rounds, TFLOP/s column groups / slices: D=160 158 / 164,
// D=192 174 / 189, D=256 237 / 196 (causal 160 / 146). Issuing the next step's S^T / dP^T
// before this step's P^T / dS^T (to hide the arithmetic) made column groups slower: 107-158.
// GQA heads are summed inside the CTA in a fixed order: no atomics, bitwise reproducible.
//
// FUSED_DQ (CG = 1, NSLICE = 1, no window; BN x 64 PANELS = two 64 x 64 units): the kernel
// accumulates dQ as well, so the backward runs 5 products per step instead of these 4 plus the
// dQ kernel's 3 (FlashAttention-3's backward in its deterministic form). Each warpgroup stores
// its dS^T (bf16, 4-byte stores as the fragments lie) into its 64 key rows of a 128-key x BN dS^T
// tile (double-buffered), the MN-major A operand of dQ = dS K, and arrives on the tile's "full"
// mbarrier. In the next step (after the last one for the last item), once both warpgroups'
// rows are in, warpgroup w multiplies unit w of dQ_part (BN x 64 PANELS) = dS (BN x 128 keys) *
// K (128 keys x D): rows 64 w.. at BN = 128, columns 64 w.. at BN = 64; frees the dS^T tile on
// its "empty" mbarrier, stores the unit to a shared staging tile in its register layout
// ([8][128] float4s a unit, no bank conflicts) and arrives on an mbarrier. So a warpgroup waits
// for the other only a step later, never at the step it stores. A writer thread of the producer
// warpgroup adds the staging tile into an fp32 accumulator in global memory (tiles of BN x 64
// PANELS floats in that same layout; attention_backward_query_from_accumulator.cu makes dQ of it) with one TMA
// bulk add, in a fixed order: the key blocks of a chain add theirs in ascending order, each
// writer waiting on a per-(query head, query block, chain) count (zeroed by the prepare kernel; an
// input this kernel updates). The first of a chain stores its part instead (one TMA bulk copy), so
// nothing fills the accumulator first; a chain no key block joined keeps a count of 0, which tells
// the dQ kernel it is zero. A CTA waits only on CTAs of lower index (started no earlier), so the
// wait ends; the order makes dQ bitwise reproducible. The consumers never wait on the order, only
// on the staging tile being read. blocks_cuda.txt's fused_dq_from<N> turns it on for long calls.
// The walk and the chains. Under a causal mask: one chain, the key blocks 0.. the last that see
// the query block, and every CTA walks its query blocks down from the last. Walking up from its
// diagonal, key block k reaches query block i BM / BN steps before key block k - 1 does, and its
// add waits for k - 1's: each link of the chain holds its CTA that much further back (key block k
// about k BM / BN steps). Walking down, every key block that sees query block i reaches it in the
// same step, and key block k waits for the k adds before its own, a delay that does not grow
// along the walk. Without one, every key block sees every
// query block, and an upward walk by all of them made key block k's writer about k links late at
// every tile (the CTAs of a head start together and each add waits for the one before): with the
// count wait removed (dQ wrong, a timing probe) the backward took 0.916x the time at B=4 N=4096
// D=128 and 0.871x at D=64 (H100). So each CTA starts at the query block on its own diagonal,
// r = min(kb BM / BN, last), and walks down, wrapping: r, r - 1, .., 0, last, .., r + 1. Query block
// i then hears from key blocks first(i) = ceil(i BN / BM), first(i) + 1, .. from the first step on,
// BM / BN steps apart, and from 0, 1, .. first(i) - 1 at the end of the sweep, again BM / BN steps
// apart: two chains in ascending order, each into an accumulator tile of its own (the second would
// otherwise wait for the wrap), which the dQ kernel sums in that order.
//
// Shared memory tiles: the swizzled panel layout of wgmma_common.cuh. K, V: K-major A operands
// of S^T and dP^T. Q, dO: K-major B operands of S^T / dP^T and MN-major B operands of dK / dV
// (rows = queries = the contraction), one layout for both.
// Rendered by mlx_flash.backends.cuda_source with the constants below.
namespace mlxflash {
namespace bwdkvwg {
typedef {{input_type}} T;
typedef {{mask_type}} MaskT;
constexpr int HEAD_DIM = {{head_dim}};  // real D (<= 512)
constexpr int DP = {{padded_dim}};              // D padded to 16: the S^T / dP^T contraction
constexpr int NSLICE = {{slices}};      // CTAs per key block (column slices)
constexpr int DS = {{head_block}};              // dK / dV columns per warpgroup (DP <= 160 if NSLICE == CG == 1, else 128)
constexpr int CONSUMERS = {{consumer_groups}};   // consumer warpgroups per CTA
constexpr int CG = {{col_groups}};              // column groups: consumer warpgroups sharing one 64-key block
constexpr int BN = {{traversal_block}};              // queries per step
constexpr bool CAUSAL = {{causal}};
constexpr bool WINDOW = {{window}};
constexpr bool SOFTCAP = {{softcap}};
constexpr int MASK_KIND = {{mask_kind}};
constexpr bool FUSED_DQ = {{fused_query}};
constexpr bool POISON_RELEASED = {{poison_released}};  // tests only: the release check (ReadLedger, wgmma_common.cuh)
// HEAD_SPLIT: SPLITS CTAs (ip[P_SPLITS], at most the group, next to each other in CTA order)
// share a key block, each walking GROUP / SPLITS of its query heads (the first GROUP % SPLITS one
// more, so a group of 7 runs as 4 + 3) and storing its dK / dV sums
// as an fp32 part ([SPLITS, B, Nk, Hkv, D] buffers) that the parts kernel adds in split order
// (attention_backward_key_value_parts.cu). With FUSED_DQ a split's adds wait for the previous key
// block's CTA of the same split: still a lower index.
constexpr bool HEAD_SPLIT = {{head_split}};
typedef {{gradient_type}} G;  // dK / dV elements: T, or float parts (HEAD_SPLIT)
constexpr bool ROTATED = FUSED_DQ && !CAUSAL;  // (FUSED_DQ: no window) the walk and chains above
constexpr bool STEP_MAJOR = FUSED_DQ && CAUSAL;  // the items' order (below, item_head)
constexpr int CHAINS = {{chains}};  // accumulator tiles and counts per (query head, query block): cuda_source.fused_chains
static_assert(CHAINS == (ROTATED ? 2 : 1), "CHAINS: two chains for the walk that wraps (ROTATED), else one");
constexpr int STAGES = 2;  // Q / dO buffers in the producer's ring (as the forward)
constexpr int THREADS = 128 * (CONSUMERS + 1), KEY_GROUPS = CONSUMERS / CG, BM = 64 * KEY_GROUPS;
constexpr int PANELS = (DP + 63) / 64;                     // K / V tile panels
// Q / dO tile panels: whole 128-column slices or column groups, columns past D zero-filled.
constexpr int TILE_PANELS = NSLICE > 1 || CG == 2 ? 2 * NSLICE * CG : PANELS;
constexpr int KV_GROUP_BYTES = PANELS * 64 * 128;       // 64 rows of K (or V)
constexpr int TILE_BYTES = TILE_PANELS * BN * 128;      // one Q (or dO) tile
// CG = 2: S^T and dP^T swapped between the warpgroups through shared memory: double-buffered
// (one barrier per step) where it fits, at BN <= 32; at BN = 64 one buffer and a second barrier.
constexpr int SWAP_BUFFERS = BN <= 32 ? 2 : 1;
constexpr int SWAP_BYTES = CG == 2 ? SWAP_BUFFERS * 2 * 128 * (BN / 2) * 4 : 0;
constexpr int MAP_BYTES = 2 * 128;  // the Q and dO tensor maps (TMA)
// FUSED_DQ: two dS^T tiles (128 key rows: 64 per warpgroup, x BN queries), the staging tile of
// dQ_part (BN x 64 PANELS fp32) and six mbarriers (staging full / empty, each dS^T tile's full /
// empty).
constexpr int DS_TILE_BYTES = FUSED_DQ ? BN * 256 : 0;
constexpr int DQ_TILE_FLOATS = FUSED_DQ ? BN * 64 * PANELS : 0;
constexpr int SMEM_BYTES = 1024 + KEY_GROUPS * 2 * KV_GROUP_BYTES + STAGES * 2 * TILE_BYTES + 2 * DS_TILE_BYTES +
                           DQ_TILE_FLOATS * 4 + SWAP_BYTES + MAP_BYTES + STAGES * 2 * BN * 4 + 3 * STAGES * 8 +
                           (FUSED_DQ ? 48 : 0);
static_assert(SMEM_BYTES <= {{shared_memory}}, "shared memory layout larger than the launch's");
constexpr int LAUNCH_REGS = 65536 / THREADS / 8 * 8;
// 40 producer registers leave the consumers 232: at D = 128, BN = 64 they hold dK, dV (64 floats
// each), S^T, dP^T (32 each) and the P^T / dS^T fragments without spills, and with a bool mask
// spill 4 bytes (48 / 224: 32 bytes). At D <= 64 the consumers need far fewer and the producer's
// loop spills 8-16 bytes on 40, none on 48. nvcc 13.0.
constexpr int PRODUCER_REGS = DP <= 64 ? 48 : 40;
constexpr int CONSUMER_REGS_FIT = (LAUNCH_REGS * THREADS - 128 * PRODUCER_REGS) / (128 * CONSUMERS) / 8 * 8;
constexpr int CONSUMER_REGS = CONSUMER_REGS_FIT < 240 ? CONSUMER_REGS_FIT : 240;
static_assert(128 * PRODUCER_REGS + 128 * CONSUMERS * CONSUMER_REGS <= LAUNCH_REGS * THREADS, "register split");
static_assert(CONSUMERS == 2, "2 consumer warpgroups (the register split)");
static_assert(DS % 16 == 0 && (NSLICE == 1 && CG == 1 ? DS == DP && DS <= 160 : DS == 128 && 128 * NSLICE * CG >= DP),
              "dK and dV accumulators: all of D up to 160 columns per warpgroup, or 128-column slices / groups");
static_assert(CG == 1 || (CG == 2 && PANELS > 2 && 256 * (NSLICE - 1) < DP),
              "column groups: two warpgroups of 128 columns a slice, more than 128 columns");
constexpr int SWAP_BARRIER = 1 + 2 * CONSUMERS;  // past the warpgroups' named barriers (1..)
// ROLES (past D = 256, blocks_cuda.txt's roles): CTA 0 of a key block computes dV (VALUES), CTA 1
// dK (KEYS); each warpgroup's two 128-column accumulators cover columns [256 w, 256 w + 256) of
// that gradient. BOTH: dK and dV (CTA slices of both, or all of D).
constexpr bool ROLES = {{roles}};
static_assert(!ROLES || (CG == 2 && NSLICE == 2 && !FUSED_DQ), "roles: the two CTAs of column groups past D = 256");
constexpr int BOTH = 0, VALUES = 1, KEYS = 2;
template <int R>
struct Role {
  static constexpr int value = R;
};
// The values' CTA: each warpgroup's part of the S^T contraction, in 64-column panels of K and Q
// (the second part zero-filled past D; its K panels run on into the unused V region).
// (2 HALF_PANELS <= PANELS + 1: the K and V regions, PANELS each, always hold both halves.)
constexpr int HALF_PANELS = (PANELS + 1) / 2;
static_assert(!ROLES || (DS == 128 && 2 * HALF_PANELS <= TILE_PANELS),
              "roles: 128-column accumulators, both halves of Q's panels in its tile");
// dK and dV stored through shared memory in 16-byte chunks (store_tile_staged) where each
// warpgroup owns all of D of its keys in T (no slices, column groups or fp32 parts).
constexpr bool STAGED_EPILOGUE = CG == 1 && NSLICE == 1 && !HEAD_SPLIT && HEAD_DIM % 8 == 0;
static_assert(!FUSED_DQ || (CG == 1 && NSLICE == 1 && !WINDOW && BN % 64 == 0 && (BN / 64) * PANELS == CONSUMERS),
              "fused dQ: all of D per warpgroup, no window (the key blocks that see a query block are 0.. the "
              "last), one 64 x 64 unit of the BN x 64 PANELS dQ tile per consumer warpgroup");
// FUSED_DQ: the previous item's dQ unit is issued beside this item's dK and dV products where
// the registers allow (BN = 64: their P^T / dS^T fragments and the unit's 32 accumulators fit;
// at BN = 128 ptxas serializes every wgmma, nvcc 13.0), else after them.
constexpr bool DQ_BESIDE_GRADIENTS = BN == 64;
// CG = 1 (both score products in each warpgroup): the interior tile's exponentials run while the
// tensor cores still compute dP^T, whose wait follows them; the stage is released at the step's
// end, after every product that reads it. Not with the fused dQ past D = 64: H200, fwd+bwd, D =
// 128 read 1.016x (B=4 N=4096) and 1.025x (GQA 4:1 N=8192), inside one run's spread but no gain;
// D = 64 0.973x / 0.995x (two runs).
constexpr bool EXP_UNDER_DP = CG == 1 && (!FUSED_DQ || DP <= 64);
// The producer warpgroup's threads: with FUSED_DQ warps 0-1 copy (cp.async path) and stage the
// statistics, thread 96 writes dQ; otherwise all 128 copy and BN stage one statistics row each.
// With FUSED_DQ the cp.async path (rows TMA cannot name) spills 146-414 bytes on the producer's
// 40-48 registers, nvcc 13.0; the TMA path and the consumers spill none at D = 65..128 (36 bytes
// at D = 64). A producer budget that removes them leaves the consumers too few at D = 128.
constexpr int COPY_THREADS = FUSED_DQ ? 64 : 128;
constexpr int STATS_THREADS = FUSED_DQ && BN > 64 ? 64 : BN, STATS_ROWS = BN / STATS_THREADS;
constexpr int WRITER_THREAD = 96;
static_assert(DP <= 512, "D <= 512");
static_assert(BN % 16 == 0 && BN <= 128, "BN must be a multiple of 16, at most 128");
}  // namespace bwdkvwg

__device__ void attention_backward_key_value_wgmma(
    const bwdkvwg::T* __restrict__ q, const bwdkvwg::T* __restrict__ k, const bwdkvwg::T* __restrict__ v,
    const bwdkvwg::T* __restrict__ d_out, const Layout lq, const Layout lk, const Layout lv, const Layout ldo,
    const float* __restrict__ lse2, const float* __restrict__ delta, const bwdkvwg::MaskT* __restrict__ mask,
    const i64* __restrict__ ip, const float* __restrict__ fp, const u32* __restrict__ tensor_map,
    bwdkvwg::G* __restrict__ dk, bwdkvwg::G* __restrict__ dv, float* __restrict__ dq_acc, int* __restrict__ dq_order,
    unsigned char* __restrict__ tensor_maps) {
  using namespace bwdkvwg;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* base = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);  // 1024-aligned panels
  unsigned char* Ks = base;                                   // [KEY_GROUPS] x 64 key rows
  unsigned char* Vs = Ks + KEY_GROUPS * KV_GROUP_BYTES;       // [KEY_GROUPS] x 64 key rows
  unsigned char* Qs = Vs + KEY_GROUPS * KV_GROUP_BYTES;       // [STAGES] x BN query rows
  unsigned char* dOs = Qs + STAGES * TILE_BYTES;              // [STAGES] x BN query rows
  unsigned char* dSs = dOs + STAGES * TILE_BYTES;             // FUSED_DQ: [2] x 128 key rows x BN queries
  float4* dq_stage = reinterpret_cast<float4*>(dSs + 2 * DS_TILE_BYTES);  // FUSED_DQ: [CONSUMERS][8][128]
  unsigned char* after = dSs + 2 * DS_TILE_BYTES + DQ_TILE_FLOATS * 4;
  float4* swap = reinterpret_cast<float4*>(after);            // [SWAP_BUFFERS][2 warpgroups]
  const u32 q_map = smem_u32(after + SWAP_BYTES), do_map = q_map + 128;
  float* Ls = reinterpret_cast<float*>(after + SWAP_BYTES + MAP_BYTES);  // [STAGES] x BN lse2
  float* Dls = Ls + STAGES * BN;                                     // [STAGES] x BN delta
  u32 barriers = smem_u32(Dls + STAGES * BN);  // made opaque in the consumers (below)
  // Per stage: Q + lse2 landed, dO + delta landed, both released by every consumer thread.
  auto full_q = [&](int stage) { return barriers + 8 * stage; };
  auto full_do = [&](int stage) { return barriers + 8 * (STAGES + stage); };
  auto empty = [&](int stage) { return barriers + 8 * (2 * STAGES + stage); };
  // FUSED_DQ: the staging tile written by every consumer thread / read by the writer's bulk add;
  // the two dS^T tiles, stored by every consumer thread / read by both warpgroups' dQ wgmmas.
  const u32 dq_full = barriers + 8 * 3 * STAGES, dq_empty = dq_full + 8;
  auto ds_full = [&](int tile) { return dq_full + 16 + 8 * tile; };
  auto ds_empty = [&](int tile) { return dq_full + 32 + 8 * tile; };

  const i64 bid = linear_block();
  if (bid >= ip[P_TOTAL]) return;
  MLXFLASH_READ_LAUNCH_PARAMS(ip, fp, nkb);

  const int cslice = NSLICE > 1 ? (int)(bid % NSLICE) : 0;
  int kb;  // causal: key block 0 sees the most queries, so ascending order is longest first
  i64 bkv;
  i64 rest = NSLICE > 1 ? bid / NSLICE : bid;
  const int splits = HEAD_SPLIT ? (int)ip[P_SPLITS] : 1, split = HEAD_SPLIT ? (int)(rest % splits) : 0;
  rest /= splits;
  block_of(rest, nkb, ip[P_BLOCK_MAJOR] != 0, ip[P_BATCH] * Hkv, kb, bkv);
  const int b = (int)(bkv / Hkv), hk = (int)(bkv % Hkv);
  const int tid = threadIdx.x, warpgroup = warpgroup_index();
  // This warpgroup's dK / dV columns [col0, col0 + DS) (ROLES: its first accumulator's; the
  // second's start at col0 + DS).
  const int col0 = ROLES ? 2 * warpgroup * DS : (cslice * CG + (CG == 2 ? warpgroup % CG : 0)) * DS;
  const int k0 = kb * BM;
  // This CTA's query heads h0.. (group / splits each, the first group % splits splits one more).
  const int per_split = group / splits, extra = group % splits;
  const int heads = per_split + (split < extra), h0 = hk * group + split * per_split + min(split, extra);
  const Rows<const T> kg = head_rows(k, lk, b, hk);
  const Rows<const T> vg = head_rows(v, lv, b, hk);
  // Q / dO rows of the group's query heads (vector loads for all of them: head stride too).
  const bool vec = vector_rows<HEAD_DIM>(kg) && vector_rows<HEAD_DIM>(vg) &&
                   vector_rows<HEAD_DIM>(head_rows(q, lq, b, h0)) && lq.head % 8 == 0 &&
                   vector_rows<HEAD_DIM>(head_rows(d_out, ldo, b, h0)) && ldo.head % 8 == 0;
  // TMA: one map per operand spans the CTA's query heads (a third dimension of `heads` heads).
  const bool tma = tma_rows<HEAD_DIM>(head_rows(q, lq, b, h0)) &&
                   tma_rows<HEAD_DIM>(head_rows(d_out, ldo, b, h0)) &&
                   (heads == 1 || (lq.head % 8 == 0 && lq.head > 0 && ldo.head % 8 == 0 && ldo.head > 0));

  const int k_last = min(k0 + BM, Nk) - 1;
  int qb_begin, qb_count;  // the query blocks any key of this block is seen by
  query_block_range<CAUSAL, WINDOW, BN>(k0, k_last, Nq, diag, wleft, wright, qb_begin, qb_count);
  const int items = qb_count * heads;  // (query head from h0, query block) pairs
  // Item it: query head h0 + item_head(it), query block item_block(it). FUSED_DQ: the
  // walks above (ROTATED: down from this key block's diagonal, wrapping; qb_begin is 0 without a
  // causal mask or window; causal: down from the last); otherwise up from the first. One head's
  // walk after another, except for the causal fused dQ (STEP_MAJOR): there key blocks see
  // different numbers of query blocks, so one head after another would put key block k's walk
  // of its h-th head BM / BN * h items behind key block k - 1's, a lag that the chain of waits
  // adds up along the key blocks; step by step, every head of a step before the next step, key
  // block k reaches each (head, query block) at the same item as k - 1 does.
  const int diagonal = ROTATED ? min(kb * BM / BN, qb_count - 1) : 0;
  auto item_head = [&](int it) { return STEP_MAJOR ? it % heads : it / qb_count; };
  auto item_block = [&](int it) {
    const int s = STEP_MAJOR ? it / heads : it % qb_count;
    if (!FUSED_DQ) return qb_begin + s;
    if (!ROTATED) return qb_begin + qb_count - 1 - s;
    return diagonal >= s ? diagonal - s : diagonal - s + qb_count;
  };

  if (tid == 0) {
#pragma unroll
    for (int stage = 0; stage < STAGES; ++stage) {
      // The tile's arrivals (one with TMA, the COPY_THREADS copying threads with cp.async) + one per
      // statistics thread.
      mbarrier_init(full_q(stage), (tma ? 1 : COPY_THREADS) + STATS_THREADS);
      mbarrier_init(full_do(stage), (tma ? 1 : COPY_THREADS) + STATS_THREADS);
      mbarrier_init(empty(stage), 128 * CONSUMERS);
    }
    if (FUSED_DQ) {
      mbarrier_init(dq_full, 128 * CONSUMERS);
      mbarrier_init(dq_empty, 1);
      for (int tile = 0; tile < 2; ++tile) {
        mbarrier_init(ds_full(tile), 128 * CONSUMERS);
        mbarrier_init(ds_empty(tile), 128 * CONSUMERS);
      }
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();  // the barriers are initialized before anyone uses them

  if (warpgroup == CONSUMERS) {  // ---------------- producer ----------------
    registers_decrease<PRODUCER_REGS>();
    const int ptid = tid - 128 * CONSUMERS;
    // Thread ptid < BN stages query row qs + ptid's lse2 and delta (0 past Nq) with an ordinary
    // load one item ahead (its latency hides behind the wait for a free buffer and the tile
    // copies) and an ordinary store, then arrives on the stage's full barrier itself: that
    // arrive's release orders its own store before the consumers' ordinary loads. 4-byte
    // cp.async copies announced by the tiles' asynchronous arrival used to carry them, and
    // compute-sanitizer's racecheck reported hazards on exactly those two copies (H100: D = 96
    // bool mask, 160 causal, 200 additive, the last with 2 items, so no stage was ever refilled;
    // none on the tiles, which only wgmma reads). With plain tile stores (vec false) nothing
    // waited for those copies at all: announce_tile's wait_group 0 skipped uncommitted copies.
    if (FUSED_DQ && ptid >= COPY_THREADS) {  // warps 2 and 3: thread 96 writes dQ, the rest are done
      if (ptid != WRITER_THREAD) return;
      const int nqb = (Nq + BN - 1) / BN;
      for (int it = 0; it < items; ++it) {
        const int qb = item_block(it);
        const int first = ROTATED ? (qb * BN + BM - 1) / BM : 0;  // the first key block of chain 0
        const int chain = kb >= first ? 0 : 1, position = chain == 0 ? kb - first : kb;
        const i64 tile = (((i64)b * Hq + h0 + item_head(it)) * nqb + qb) * CHAINS + chain;
        mbarrier_wait(dq_full, it & 1);            // both warpgroups' units are in the staging tile
        wait_for_count(dq_order + tile, position);  // the chain's key blocks before this one have added theirs
        if (position == 0) {                       // the first: a store (the accumulator is not zeroed)
          bulk_store_f32(dq_acc + tile * DQ_TILE_FLOATS, smem_u32(dq_stage), DQ_TILE_FLOATS * 4);
        } else {
          bulk_add_f32(dq_acc + tile * DQ_TILE_FLOATS, smem_u32(dq_stage), DQ_TILE_FLOATS * 4);
        }
        bulk_wait_read();
        mbarrier_arrive(dq_empty);                 // the consumers may stage the next item
        bulk_wait();                               // the adds are done before the count says so
        release_count(dq_order + tile);
      }
      return;
    }
    const bool stats_thread = ptid < STATS_THREADS;
    float next_l[STATS_ROWS] = {}, next_d[STATS_ROWS] = {};
    auto load_stats = [&](int it) {
      if (!stats_thread || it >= items) return;
#pragma unroll
      for (int r = 0; r < STATS_ROWS; ++r) {
        const int i = item_block(it) * BN + ptid + r * STATS_THREADS;
        const i64 row = ((i64)b * Hq + h0 + item_head(it)) * Nq + min(i, Nq - 1);
        next_l[r] = i < Nq ? lse2[row] : 0.f;
        next_d[r] = i < Nq ? delta[row] : 0.f;
      }
    };
    load_stats(0);
    if (tma) {  // the first warp publishes the Q and dO maps, thread 0 issues the loads
      unsigned char *q_global = tensor_map_slots(tensor_maps, bid), *do_global = q_global + 128;
      if (ptid < 32)
        publish_tensor_maps(tensor_map, q_map, do_map, q_global, ptid, [&] {
          tensor_map_replace(q_map, head_rows(q, lq, b, h0).p, HEAD_DIM, Nq, lq.row * (i64)sizeof(T));
          tensor_map_replace_heads(q_map, heads, (heads > 1 ? lq.head : 8) * (i64)sizeof(T));
          tensor_map_replace(do_map, head_rows(d_out, ldo, b, h0).p, HEAD_DIM, Nq, ldo.row * (i64)sizeof(T));
          tensor_map_replace_heads(do_map, heads, (heads > 1 ? ldo.head : 8) * (i64)sizeof(T));
        });
      // One tile (query rows qs.., query head gi of the group) into `tile`, counted on `full`.
      auto load_tile = [&](unsigned char* tile, const unsigned char* map, int qs, int gi, u32 full) {
        if (ptid != 0) return;
        mbarrier_arrive_expect_bytes(full, TILE_BYTES);
#pragma unroll
        for (int p = 0; p < TILE_PANELS; ++p) tma_load_3d(smem_u32(tile + p * BN * 128), map, 64 * p, qs, gi, full);
      };
      for (int it = 0; it < items; ++it) {
        const int stage = it % STAGES, gi = item_head(it), qs = item_block(it) * BN;
        float l[STATS_ROWS], d[STATS_ROWS];
#pragma unroll
        for (int r = 0; r < STATS_ROWS; ++r) l[r] = next_l[r], d[r] = next_d[r];
        load_stats(it + 1);
        mbarrier_wait(empty(stage), ((it / STAGES) & 1) ^ 1);  // the consumers freed this buffer
        if (POISON_RELEASED && ptid == 0 && it >= STAGES) {
          poison_released_tile<TILE_BYTES>(Qs + stage * TILE_BYTES);
          poison_released_tile<TILE_BYTES>(dOs + stage * TILE_BYTES);
        }
        load_tile(Qs + stage * TILE_BYTES, q_global, qs, gi, full_q(stage));
        if (stats_thread) {
#pragma unroll
          for (int r = 0; r < STATS_ROWS; ++r) Ls[stage * BN + ptid + r * STATS_THREADS] = l[r];
          mbarrier_arrive(full_q(stage));
        }
        load_tile(dOs + stage * TILE_BYTES, do_global, qs, gi, full_do(stage));
        if (stats_thread) {
#pragma unroll
          for (int r = 0; r < STATS_ROWS; ++r) Dls[stage * BN + ptid + r * STATS_THREADS] = d[r];
          mbarrier_arrive(full_do(stage));
        }
      }
      return;
    }
    for (int it = 0; it < items; ++it) {
      const int stage = it % STAGES, gi = item_head(it), qs = item_block(it) * BN;
      const int h = h0 + gi;
      float l[STATS_ROWS], d[STATS_ROWS];
#pragma unroll
      for (int r = 0; r < STATS_ROWS; ++r) l[r] = next_l[r], d[r] = next_d[r];
      load_stats(it + 1);
      mbarrier_wait(empty(stage), ((it / STAGES) & 1) ^ 1);  // the consumers freed this buffer
      load_swizzled<BN, TILE_PANELS, COPY_THREADS, HEAD_DIM>(Qs + stage * TILE_BYTES, head_rows(q, lq, b, h).from(qs),
                                                             Nq - qs, vec, ptid);
      announce_tile(full_q(stage), vec);
      if (stats_thread) {
#pragma unroll
        for (int r = 0; r < STATS_ROWS; ++r) Ls[stage * BN + ptid + r * STATS_THREADS] = l[r];
        mbarrier_arrive(full_q(stage));
      }
      load_swizzled<BN, TILE_PANELS, COPY_THREADS, HEAD_DIM>(dOs + stage * TILE_BYTES,
                                                             head_rows(d_out, ldo, b, h).from(qs), Nq - qs, vec, ptid);
      announce_tile(full_do(stage), vec);
      if (stats_thread) {
#pragma unroll
        for (int r = 0; r < STATS_ROWS; ++r) Dls[stage * BN + ptid + r * STATS_THREADS] = d[r];
        mbarrier_arrive(full_do(stage));
      }
    }
    cp_async_wait_all();  // no copy outlives the thread
    return;
  }

  // ---------------- consumers ----------------
  registers_increase<CONSUMER_REGS>();
  // The barriers' address opaque once: else the compiler rebuilds it from the CTA id in the step
  // loop (S2UR + ULEA at D = 32, 96, 160 and causal 64; nvcc 13.0). Not with FUSED_DQ, whose loops
  // keep it and which spill 4-24 bytes more with it opaque.
  if (!FUSED_DQ) asm volatile("" : "+r"(barriers));
  const int role = ROLES ? (cslice == 0 ? VALUES : KEYS) : BOTH;
  const int warp = (tid % 128) / 32, lane = tid % 32;
  const int g = lane / 4, tq = lane % 4;
  const int key_group = warpgroup / CG;
  const int key_first = k0 + key_group * 64;   // this warpgroup's keys: [key_first, key_first + 64)
  // CG = 2: warpgroup 0 computes S^T (reads K and Q), warpgroup 1 dP^T (V and dO); in the values'
  // CTA both compute S^T.
  const bool scores_side = CG == 1 || warpgroup == 0 || role == VALUES;
  const int row0 = key_first + warp * 16 + g;  // this thread's first key row

  float dka[DS / 8][4], dva[DS / 8][4];
#pragma unroll
  for (int n = 0; n < DS / 8; ++n)
#pragma unroll
    for (int r = 0; r < 4; ++r) dka[n][r] = dva[n][r] = 0.f;

  if (items > 0) {
    // This warpgroup's K and V rows (rows past Nk zero-filled; the address stays in bounds);
    // with column groups each warpgroup loads the one it multiplies.
    unsigned char* k_tile = Ks + key_group * KV_GROUP_BYTES;
    unsigned char* v_tile = Vs + key_group * KV_GROUP_BYTES;
    const int kv_row = min(key_first, Nk - 1);
    if (role == VALUES) {  // this warpgroup's half of K's panels
      const int c = warpgroup * HALF_PANELS * 64;
      const Rows<const T> k_part{kg.p + c * kg.col, kg.row, kg.col};
      load_swizzled<64, ROLES ? HALF_PANELS : 1, 128, HEAD_DIM>(k_tile + c * 128, k_part.from(kv_row), Nk - key_first,
                                                                vec, tid % 128, HEAD_DIM - c);
    } else if (scores_side) {
      load_swizzled<64, PANELS, 128, HEAD_DIM>(k_tile, kg.from(kv_row), Nk - key_first, vec, tid % 128);
    }
    if (CG == 1 || !scores_side)
      load_swizzled<64, PANELS, 128, HEAD_DIM>(v_tile, vg.from(kv_row), Nk - key_first, vec, tid % 128);
    resident_rows_ready(warpgroup);

    const u32 k_addr = smem_u32(k_tile), v_addr = smem_u32(v_tile);
    float s[BN / 8][4], dp[BN / 8][4];
    float(&s_flat)[BN / 2] = *reinterpret_cast<float(*)[BN / 2]>(&s[0][0]);
    float(&dp_flat)[BN / 2] = *reinterpret_cast<float(*)[BN / 2]>(&dp[0][0]);
    float(&dk_flat)[DS / 2] = *reinterpret_cast<float(*)[DS / 2]>(&dka[0][0]);
    float(&dv_flat)[DS / 2] = *reinterpret_cast<float(*)[DS / 2]>(&dva[0][0]);
    const i64 msk = MASK_KIND != 0 ? ip[P_MSK] : 0, msq = MASK_KIND != 0 ? ip[P_MSQ] : 0;

    ReadLedger<POISON_RELEASED, STAGES> ledger;  // tests only (wgmma_common.cuh): keys = Q, values = dO
    // acc (64 x DS) += A (registers, 64 x BN) * tile columns [col0, col0 + DS) (BN queries,
    // MN-major); the slice starts at panel col0 / 64.
    auto issue_gradient = [&](float (&acc)[DS / 2], const u32 (&a)[BN / 16][4], u32 b_addr, int col) {
      wgmma_registers_shared<DS, BN, T>(acc, a, b_addr + (col / 64) * BN * 128, BN * 128, 1024);
    };

    // FUSED_DQ: unit `warpgroup` of item j's dQ_part = dS (BN x 128 keys) * K (128 keys x D),
    // scaled: rows 64 w.. of the dS tile (BN = 128) or columns 64 w.. of K (BN = 64). Item j's
    // unit is computed in step j + 1 (and after the last step), a step after both warpgroups
    // stored their dS^T panels, so neither waits for the other in the step that stores them.
    // dqa: a fresh array per call site, so its "+f" operands read nothing live across steps.
    auto issue_query_unit = [&](float (&dqa)[32], int j) {
      mbarrier_wait(ds_full(j & 1), (j >> 1) & 1);  // both warpgroups' dS^T panels of item j
      // Both addresses opaque each time: else the compiler hoists the 16 descriptors out of the
      // step loop and spills (as the resident tiles past D = 256).
      u32 ds_addr = smem_u32(dSs + (j & 1) * DS_TILE_BYTES) + (BN == 128 ? warpgroup * 16384 : 0);
      u32 kq_addr = smem_u32(Ks) + (BN == 128 ? 0 : warpgroup * 8192);
      asm volatile("" : "+r"(ds_addr), "+r"(kq_addr));
      const SmemDescriptor ds_desc(ds_addr, 128 * 128, 1024), k_desc(kq_addr, 64 * 128, 1024);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 8; ++kk)
        Wgmma<64, T>::ss_mn(dqa, ds_desc.at(kk * 16 * 128), k_desc.at((kk / 4) * KV_GROUP_BYTES + (kk % 4) * 16 * 128),
                            kk > 0);
      ledger.commit(0);  // the dS tile and the resident K
    };
    // After the unit's wgmma has completed: its dS tile freed, the unit staged for the writer.
    auto stage_query_unit = [&](float (&dqa)[32], int j) {
      fence_registers(dqa);
      mbarrier_arrive(ds_empty(j & 1));
      mbarrier_wait(dq_empty, (j & 1) ^ 1);  // the writer has read item j - 1's staging tile
#pragma unroll
      for (int i = 0; i < 32; ++i) dqa[i] *= scale;
      store_fragments(dqa, fragment_slot<32>(dq_stage, warpgroup, tid % 128));
      fence_proxy_async();  // these stores before the bulk add's reads
      mbarrier_arrive(dq_full);
    };

    // CG = 2 and the values' CTA: this warpgroup's fp32 tile (s_flat) out to `mine` in the swap
    // area, the other warpgroup's in from `theirs` (into dp_flat). Two buffers: the other
    // warpgroup last read buffer it % 2 two steps ago, before it arrived at last step's barrier.
    // One buffer: an extra barrier that it reaches once it has read last step's.
    auto swap_tiles = [&](int it, float4* mine, const float4* theirs) {
      if (SWAP_BUFFERS == 1 && it > 0) named_barrier_sync(SWAP_BARRIER, 256);
      store_fragments(s_flat, mine);
      named_barrier_sync(SWAP_BARRIER, 256);
      load_fragments(dp_flat, theirs);
    };

    // One item. FIRST (FUSED_DQ's first step): no previous item's dQ unit to compute. ROLE: the
    // CTA's (a uniform branch around two whole loops: no wgmma under a runtime condition).
    auto step = [&](int it, auto first, auto role_of_cta) {
      constexpr bool FIRST = decltype(first)::value;
      constexpr int ROLE = decltype(role_of_cta)::value;
      const int stage = it % STAGES, gi = item_head(it), qs = item_block(it) * BN;
      const u32 parity = (it / STAGES) & 1;
      const u32 q_addr = smem_u32(Qs + stage * TILE_BYTES), do_addr = smem_u32(dOs + stage * TILE_BYTES);
      const float* Lst = Ls + stage * BN;
      const float* Dst = Dls + stage * BN;

      // S^T starts as soon as Q has landed. Every acquire fences, TMA tiles too: skipping the
      // fence after TMA tiles cost ptxas 8-12 bytes of spills here (acquire_tile).
      if constexpr (ROLE == VALUES) {
        // Each warpgroup's part of S^T over its half of the panels, then the other's part added
        // (the same sum in both).
        const int buffer = SWAP_BUFFERS == 2 ? it % 2 : 0;
        acquire_tile(full_q(stage), parity, true);
        wgmma_fence();
        u32 k_half = k_addr + warpgroup * HALF_PANELS * 64 * 128;
        asm volatile("" : "+r"(k_half));  // (as the resident tiles below)
        wgmma_shared_shared<BN, HALF_PANELS * 64, 64, T>(s_flat, k_half, q_addr + warpgroup * HALF_PANELS * BN * 128);
        ledger.commit(ledger.keys(stage));
        ledger.wait<0>();
        fence_registers(s_flat);
        swap_tiles(it, fragment_slot<BN / 2>(swap, buffer * 2 + warpgroup, tid % 128),
                   fragment_slot<BN / 2>(swap, buffer * 2 + 1 - warpgroup, tid % 128));
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) s_flat[i] += dp_flat[i];
        acquire_tile(full_do(stage), parity, true);  // dV's B
      } else if (CG == 1) {
        acquire_tile(full_q(stage), parity, true);
        wgmma_fence();
        wgmma_shared_shared<BN, DP, 64, T>(s_flat, k_addr, q_addr);
        ledger.commit(ledger.keys(stage));
        acquire_tile(full_do(stage), parity, true);
        wgmma_fence();
        wgmma_shared_shared<BN, DP, 64, T>(dp_flat, v_addr, do_addr);
        ledger.commit(ledger.values(stage));
        if constexpr (EXP_UNDER_DP) {
          ledger.wait<1>();  // S^T; dP^T still running (its wait is below the exponentials)
          fence_registers(s_flat);
        } else {
          ledger.wait<0>();
          fence_registers(s_flat);
          fence_registers(dp_flat);
        }
      } else {
        // Column groups: one product each, then the swap.
        const int buffer = SWAP_BUFFERS == 2 ? it % 2 : 0;
        float4* mine = fragment_slot<BN / 2>(swap, buffer * 2 + warpgroup, tid % 128);
        float4* theirs = fragment_slot<BN / 2>(swap, buffer * 2 + 1 - warpgroup, tid % 128);
        // The same instructions in both warpgroups (only the descriptors differ): a wgmma on a
        // divergent path makes ptxas serialize every wgmma of the kernel (C7520).
        acquire_tile(scores_side ? full_q(stage) : full_do(stage), parity, true);
        wgmma_fence();
        // Past D = 256 the resident tile's address is made opaque each step (as the forward's Q):
        // else the compiler hoists all DP / 16 of its descriptors out of the loop and spills.
        u32 resident = scores_side ? k_addr : v_addr;
        if (DP > 256) asm volatile("" : "+r"(resident));
        wgmma_shared_shared<BN, DP, 64, T>(s_flat, resident, scores_side ? q_addr : do_addr);
        ledger.commit(scores_side ? ledger.keys(stage) : ledger.values(stage));
        ledger.wait<0>();
        fence_registers(s_flat);
        swap_tiles(it, mine, theirs);
        if (!scores_side) {  // this warpgroup's product was dP^T
#pragma unroll
          for (int i = 0; i < BN / 2; ++i) {
            const float x = s_flat[i];
            s_flat[i] = dp_flat[i];
            dp_flat[i] = x;
          }
        }
        acquire_tile(scores_side ? full_do(stage) : full_q(stage), parity, true);  // the gradient product's B
      }

      // P^T into s, dS^T into dp. Thread element (n, hf, e): key row0 + 8 hf, query qs + col.
      const bool full_block = qs + BN <= Nq && key_first + 64 <= Nk &&
          band_covers_tile<CAUSAL, WINDOW>(qs, qs + BN - 1, key_first, key_first + 63, diag, wleft, wright);
      // One score of the masked or edge paths: P^T into s, dS^T into dp (mp: its mask entry).
      auto gradient_scores = [&](int n, int hf, int e, bool visible, const MaskT* mp) {
        const int col = n * 8 + 2 * tq + e;
        float t = 0.f;
        const float s2 = score_log2<SOFTCAP, MASK_KIND>(s[n][2 * hf + e], visible, mp, scale, scale_log2, cap, t);
        const float p = fast_exp2(s2 - Lst[col]);
        s[n][2 * hf + e] = p;
        if constexpr (ROLE != VALUES) {
          float ds = p * (dp[n][2 * hf + e] - Dst[col]);
          if (SOFTCAP) ds *= 1.f - t * t;
          dp[n][2 * hf + e] = ds;
        }
      };
      // EXP_UNDER_DP (CG = 1, so ROLE == BOTH): the interior tile's exponentials before dP^T's
      // wait; the other paths after it.
      const bool interior = MASK_KIND == 0 && !SOFTCAP && full_block;
      if (EXP_UNDER_DP && interior) {
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
          const float2 l2 = *reinterpret_cast<const float2*>(Lst + n * 8 + 2 * tq);
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            s[n][2 * hf] = fast_exp2(s[n][2 * hf] * scale_log2 - l2.x);
            s[n][2 * hf + 1] = fast_exp2(s[n][2 * hf + 1] * scale_log2 - l2.y);
          }
        }
      }
      if constexpr (EXP_UNDER_DP) {
        ledger.wait<0>();
        fence_registers(dp_flat);
      }
      if (EXP_UNDER_DP && interior) {
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
          const float2 dl = *reinterpret_cast<const float2*>(Dst + n * 8 + 2 * tq);
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            dp[n][2 * hf] = s[n][2 * hf] * (dp[n][2 * hf] - dl.x);
            dp[n][2 * hf + 1] = s[n][2 * hf + 1] * (dp[n][2 * hf + 1] - dl.y);
          }
        }
      } else if (interior) {
        // Interior tile, no mask: no index arithmetic (see softmax_scores_tile).
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
          const int col = n * 8 + 2 * tq;
          const float2 l2 = *reinterpret_cast<const float2*>(Lst + col);
          const float2 dl = *reinterpret_cast<const float2*>(Dst + col);
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const float p0 = fast_exp2(s[n][2 * hf] * scale_log2 - l2.x);
            const float p1 = fast_exp2(s[n][2 * hf + 1] * scale_log2 - l2.y);
            s[n][2 * hf] = p0;
            s[n][2 * hf + 1] = p1;
            if constexpr (ROLE != VALUES) {
              dp[n][2 * hf] = p0 * (dp[n][2 * hf] - dl.x);
              dp[n][2 * hf + 1] = p1 * (dp[n][2 * hf + 1] - dl.y);
            }
          }
        }
      } else if (MASK_KIND != 0 && full_block) {
        // Interior tile with an array mask: only the mask decides, no clamped indices
        // (softmax_scores_tile says why).
        const MaskT* mbase = mask + (i64)b * ip[P_MSB] + (i64)(h0 + gi) * ip[P_MSH] + (i64)(qs + 2 * tq) * msq;
#pragma unroll
        for (int n = 0; n < BN / 8; ++n)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              gradient_scores(n, hf, e, true, mbase + (i64)(n * 8 + e) * msq + (i64)(row0 + 8 * hf) * msk);
      } else {
        const MaskT* mhead = nullptr;
        if (MASK_KIND != 0) mhead = mask + (i64)b * ip[P_MSB] + (i64)(h0 + gi) * ip[P_MSH];
#pragma unroll
        for (int n = 0; n < BN / 8; ++n)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int j = row0 + 8 * hf, col = n * 8 + 2 * tq + e, i = qs + col;
              const bool visible = j < Nk && i < Nq && band_visible<CAUSAL, WINDOW>(i, j, diag, wleft, wright);
              gradient_scores(n, hf, e, visible,
                              MASK_KIND != 0 ? mhead + (i64)min(i, Nq - 1) * msq + (i64)min(j, Nk - 1) * msk : nullptr);
            }
      }

      // dV += P^T dO, dK += dS^T Q. The accumulator layout of two n8 tiles is the A fragment
      // layout of one k16 step. ROLES: dva and dka hold the CTA's one gradient, columns [col0,
      // col0 + DS) and [col0 + DS, col0 + 2 DS).
      u32 pa[BN / 16][4], dsa[BN / 16][4];
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        if constexpr (ROLE != KEYS) accumulators_to_a<T>(s[2 * kk], s[2 * kk + 1], pa[kk]);
        if constexpr (ROLE != VALUES) accumulators_to_a<T>(dp[2 * kk], dp[2 * kk + 1], dsa[kk]);
      }
      fence_registers(dv_flat);
      fence_registers(dk_flat);
      wgmma_fence();
      if constexpr (ROLE == BOTH) {
        issue_gradient(dv_flat, pa, do_addr, col0);
        issue_gradient(dk_flat, dsa, q_addr, col0);
      } else if constexpr (ROLE == VALUES) {
        issue_gradient(dv_flat, pa, do_addr, col0);
        issue_gradient(dk_flat, pa, do_addr, col0 + DS);
      } else {
        issue_gradient(dv_flat, dsa, q_addr, col0);
        issue_gradient(dk_flat, dsa, q_addr, col0 + DS);
      }
      ledger.commit(ROLE == VALUES ? ledger.values(stage) : ROLE == KEYS ? ledger.keys(stage)
                                                                        : ledger.keys(stage) | ledger.values(stage));
      float dqa[32];
      if constexpr (FUSED_DQ) {
        // This warpgroup's 64 key rows of the item's dS^T tile while dK / dV run (two tiles: this
        // one last held item it - 2, whose units both warpgroups computed in step it - 1), then
        // the previous item's dQ unit.
        mbarrier_wait(ds_empty(it & 1), ((it >> 1) & 1) ^ 1);
        store_scores_rows<BN>(dsa, dSs + (it & 1) * DS_TILE_BYTES, warpgroup * 64 + warp * 16 + g, tq);
        mbarrier_arrive(ds_full(it & 1));
        if constexpr (!FIRST && DQ_BESIDE_GRADIENTS) issue_query_unit(dqa, it - 1);
      }
      ledger.wait<0>();
      fence_registers(dv_flat);
      fence_registers(dk_flat);
      if constexpr (FUSED_DQ && !FIRST && !DQ_BESIDE_GRADIENTS) {
        issue_query_unit(dqa, it - 1);
        ledger.wait<0>();
      }
      // Every thread frees the stage itself: its arrive (release) orders its own loads of the
      // stage's lse2 / delta before the producer's next stores there (128 * CONSUMERS arrivals a
      // stage; the former one by lane 0 of each warp released only lane 0's own loads).
      ledger.release(ledger.keys(stage) | ledger.values(stage), empty(stage), true);
      if constexpr (FUSED_DQ && !FIRST) stage_query_unit(dqa, it - 1);
    };
    if constexpr (FUSED_DQ) {
      step(0, Flag<true>{}, Role<BOTH>{});
      for (int it = 1; it < items; ++it) step(it, Flag<false>{}, Role<BOTH>{});
      float dqa[32];
      issue_query_unit(dqa, items - 1);
      ledger.wait<0>();
      stage_query_unit(dqa, items - 1);
    } else if constexpr (ROLES) {
      if (role == VALUES) {
        for (int it = 0; it < items; ++it) step(it, Flag<false>{}, Role<VALUES>{});
      } else {
        for (int it = 0; it < items; ++it) step(it, Flag<false>{}, Role<KEYS>{});
      }
    } else {
      for (int it = 0; it < items; ++it) step(it, Flag<false>{}, Role<BOTH>{});
    }
    if constexpr (POISON_RELEASED) {  // (wgmma_common.cuh: why the if)
      ledger.spoil(dk_flat);
      ledger.spoil(dv_flat);
    }
  }

  // dK = scale * dS^T Q (the scores' scale), dV as accumulated; [B, Nk, Hkv, D] buffers
  // (HEAD_SPLIT: this split's part of [SPLITS, B, Nk, Hkv, D]).
  const Layout lout = token_major(Nk, Hkv, HEAD_DIM);
  const i64 part = HEAD_SPLIT ? split * (i64)ip[P_BATCH] * Nk * Hkv * HEAD_DIM : 0;
  auto gradient_rows = [&](G* x) { return head_rows(x + part, lout, b, hk).from(key_first); };
  if constexpr (STAGED_EPILOGUE) {
    // Both through this warpgroup's V tile, whose last reader (dP^T of the last item) was waited
    // for; not K's, which the other warpgroup's last dQ unit may still read (FUSED_DQ).
    const Rows<G> dkg = gradient_rows(dk), dvg = gradient_rows(dv);
    if (vector_rows<HEAD_DIM>(dkg) && vector_rows<HEAD_DIM>(dvg)) {
      unsigned char* v_tile = Vs + key_group * KV_GROUP_BYTES;
      const float one[2] = {1.f, 1.f}, scaled[2] = {scale, scale};
      store_tile_staged<HEAD_DIM>(dva, one, v_tile, warp, lane, Nk - key_first, dvg);
      store_tile_staged<HEAD_DIM>(dka, scaled, v_tile, warp, lane, Nk - key_first, dkg);
      return;
    }
  }
  if constexpr (ROLES) {
    const Rows<G> rows = gradient_rows(role == VALUES ? dv : dk);
    const float factor = role == VALUES ? 1.f : scale;
    store_gradient_tile<HEAD_DIM>(dva, warp * 16 + g, Nk - key_first, col0, rows, factor, tq);
    store_gradient_tile<HEAD_DIM>(dka, warp * 16 + g, Nk - key_first, col0 + DS, rows, factor, tq);
    return;
  }
  store_gradient_tile<HEAD_DIM>(dka, warp * 16 + g, Nk - key_first, col0, gradient_rows(dk), scale, tq);
  store_gradient_tile<HEAD_DIM>(dva, warp * 16 + g, Nk - key_first, col0, gradient_rows(dv), 1.f, tq);
}

}  // namespace mlxflash

// Launch bounds for setmaxnreg (see the end of wgmma_common.cuh).
#undef __global__
#define __global__ MLXFLASH_GLOBAL_KERNEL __launch_bounds__(mlxflash::bwdkvwg::THREADS, 1)

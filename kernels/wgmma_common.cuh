// Shared device helpers of the Hopper (sm_90a) warpgroup-MMA kernels: wgmma issue / fence / wait,
// mbarriers and named barriers for warp specialization, setmaxnreg, shared memory descriptors of
// the 128-byte-swizzled tile layout and the loader that writes it. Included after
// attention_common.cuh and wgmma_ops.cuh by attention_forward_wgmma.cu and the two wgmma
// backward kernels.
//
// The tile layout (every wgmma operand in shared memory): a tile of R rows x C columns is stored
// as ceil(C / 64) panels of R rows x 64 columns (128 bytes a row); inside a panel, 16-byte chunk
// c of row r sits at chunk position c ^ (r % 8). Panels start on 1024-byte boundaries, so the
// hardware's swizzle (address bits 4-6 ^= bits 7-9) matches this one. The same tile serves as a
// K-major operand (rows = M or N, contiguous along the contraction: Q, K in S = Q K^T) and as an
// MN-major B operand (rows = the contraction: V in O += P V).
#pragma once
namespace mlxflash {

// A compile-time flag passed to a generic lambda (`auto` parameter): the kernels' step lambdas
// peel a first or last step with it, so no wgmma is issued under a runtime condition.
template <bool B>
struct Flag {
  static constexpr bool value = B;
};

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

// Tensor maps (PTX ISA "Tensor Map", "tensormap.replace"): a 128-byte object that tells the Tensor
// Memory Accelerator (TMA) where a 2-D tensor lies and which box one load copies. The host encodes
// a template once per box shape (mlx_flash/backends/tensor_map.py: cuTensorMapEncodeTiled with a
// dummy address); the device writes each head's address, sizes and row stride into a copy in
// shared memory, then publishes it to global memory, where TMA reads maps.
__device__ __forceinline__ void tensor_map_replace(u32 map, const void* base, int cols, int rows, i64 row_bytes) {
  asm volatile("tensormap.replace.tile.global_address.shared::cta.b1024.b64 [%0], %1;\n" ::"r"(map), "l"(base)
               : "memory");
  asm volatile("tensormap.replace.tile.global_dim.shared::cta.b1024.b32 [%0], 0, %1;\n" ::"r"(map), "r"(cols)
               : "memory");
  asm volatile("tensormap.replace.tile.global_dim.shared::cta.b1024.b32 [%0], 1, %1;\n" ::"r"(map), "r"(rows)
               : "memory");
  asm volatile("tensormap.replace.tile.global_stride.shared::cta.b1024.b64 [%0], 0, %1;\n" ::"r"(map), "l"(row_bytes)
               : "memory");
}
// A third dimension: `heads` 2-D tensors `head_bytes` apart (the query heads of a kv head's group).
__device__ __forceinline__ void tensor_map_replace_heads(u32 map, int heads, i64 head_bytes) {
  asm volatile("tensormap.replace.tile.global_dim.shared::cta.b1024.b32 [%0], 2, %1;\n" ::"r"(map), "r"(heads)
               : "memory");
  asm volatile("tensormap.replace.tile.global_stride.shared::cta.b1024.b64 [%0], 1, %1;\n" ::"r"(map),
               "l"(head_bytes)
               : "memory");
}
// The whole warp: copies the shared map to `global` with a release fence toward the tensor-map proxy.
__device__ __forceinline__ void tensor_map_publish(unsigned char* global, u32 map) {
  asm volatile(
      "tensormap.cp_fenceproxy.global.shared::cta.tensormap::generic.release.gpu.sync.aligned [%0], [%1], 128;\n" ::"l"(
          global),
      "r"(map)
      : "memory");
}
// Before the first TMA load through a published map (by the thread that issues the loads).
__device__ __forceinline__ void tensor_map_acquire(const unsigned char* global) {
  asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(global) : "memory");
}
// A CTA's two published maps in the scratch output: two 128-byte slots (mlx_flash/backends/
// tensor_map.py's scratch_bytes sizes the output with the same SLOT_BYTES per CTA).
constexpr int TENSOR_MAP_SLOT_BYTES = 2 * 128;
__device__ __forceinline__ unsigned char* tensor_map_slots(unsigned char* scratch, i64 cta) {
  return scratch + TENSOR_MAP_SLOT_BYTES * cta;
}

// A CTA's two tensor maps, by its producer's first warp (lane 0..31): the host's template (32
// words) into both shared maps, which lane 0 then completes (`complete`: tensor_map_replace...);
// the warp publishes them to `slots` (two 128-byte global slots) and lane 0, which issues the
// loads, acquires them.
template <typename Complete>
__device__ __forceinline__ void publish_tensor_maps(const u32* templ, u32 first, u32 second, unsigned char* slots,
                                                    int lane, Complete complete) {
  const u32 word = templ[lane];
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(first + 4 * lane), "r"(word) : "memory");
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(second + 4 * lane), "r"(word) : "memory");
  __syncwarp();
  if (lane == 0) complete();
  __syncwarp();
  tensor_map_publish(slots, first);
  tensor_map_publish(slots + 128, second);
  if (lane == 0) {
    tensor_map_acquire(slots);
    tensor_map_acquire(slots + 128);
  }
}
// The barrier's current phase also waits for `bytes` of asynchronous copies (and counts this
// thread's arrival).
__device__ __forceinline__ void mbarrier_arrive_expect_bytes(u32 barrier, u32 bytes) {
  asm volatile("{\n .reg .b64 state;\n mbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n" ::"r"(barrier),
               "r"(bytes)
               : "memory");
}
// One TMA load: the map's box at (column, row) into shared memory at `dst` (1024-byte aligned for
// the 128-byte swizzle), counted on `barrier` as it lands. Rows and columns past the tensor's
// sizes are zero-filled.
__device__ __forceinline__ void tma_load_2d(u32 dst, const unsigned char* map, int column, int row, u32 barrier) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          dst),
      "l"(map), "r"(column), "r"(row), "r"(barrier)
      : "memory");
}
// The same through a map with a third dimension (tensor_map_replace_heads): box (column, row, head).
__device__ __forceinline__ void tma_load_3d(u32 dst, const unsigned char* map, int column, int row, int head,
                                            u32 barrier) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(dst),
      "l"(map), "r"(column), "r"(row), "r"(head), "r"(barrier)
      : "memory");
}
#endif

// This thread's warpgroup (0, 1, ...), broadcast from lane 0 so that the compiler knows it is
// the same across the warp: addresses derived from it (each consumer's resident tiles) then live
// in uniform registers, where wgmma reads its descriptors, instead of being moved there before
// every wgmma (R2UR) from general registers.
__device__ __forceinline__ int warpgroup_index() { return __shfl_sync(0xffffffffu, (int)threadIdx.x / 128, 0); }

// Keeps the compiler from moving reads / writes of accumulator registers across a wgmma
// issue or wait (the asm statements do not name them).
template <int N>
__device__ __forceinline__ void fence_registers(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Matrix descriptor of a 128-byte-swizzled shared memory operand (PTX ISA, "Matrix Descriptor
// Format"): start address, leading and stride byte offsets, all >> 4; swizzle mode 1 = 128 B.
// Kept as its two 32-bit halves: the start address (bits 0-13) and the leading offset (bits
// 16-29) in the low one, the stride offset and the swizzle mode in the high one. An operand
// `offset` bytes further on (a multiple of 16, still inside shared memory, so below 2^18) has the
// low half plus offset >> 4 (no carry out of the 14-bit field). The k-steps of a product add a
// compile-time constant to one register: building each descriptor from its address took 4-5
// instructions per wgmma, about a sixth of the D=128 forward's instructions per step (nvcc 13.0 SASS).
struct SmemDescriptor {
  u32 lo, hi;
  __device__ __forceinline__ SmemDescriptor(u32 address, u32 leading_bytes, u32 stride_bytes)
      : lo(((address & 0x3FFFF) >> 4) | ((leading_bytes >> 4) << 16)), hi((stride_bytes >> 4) | (1u << 30)) {}
  __device__ __forceinline__ unsigned long long at(u32 offset) const {
    return ((unsigned long long)hi << 32) | (lo + (offset >> 4));
  }
};

// Byte offset of element (row, col) in a panel-swizzled tile of `rows` rows (see the top).
__device__ __forceinline__ int swizzled_offset(int row, int col, int rows) {
  return (col / 64) * rows * 128 + row * 128 + ((((col % 64) / 8) ^ (row % 8)) * 16) + (col % 8) * 2;
}

// The two operand forms of every wgmma product in these kernels (the caller fences, commits and
// waits). A swizzled tile of R rows keeps its 64-column panels R * 128 bytes apart.
//   C (64 x N) = A (A_ROWS-row tile, rows 0..63 used) * B (N-row tile)^T over K = KDIM columns,
//   both K-major (S = Q K^T, dP = dO V^T and their transposes): a k-step moves the start 32 bytes
//   along a panel row, every 4 steps to the next panel.
template <int N, int KDIM, int A_ROWS, typename T>
__device__ __forceinline__ void wgmma_shared_shared(float (&c)[N / 2], u32 a_addr, u32 b_addr) {
  const SmemDescriptor a(a_addr, 16, 1024), b(b_addr, 16, 1024);
#pragma unroll
  for (int kk = 0; kk < KDIM / 16; ++kk) {
    const u32 step = (kk % 4) * 32;
    Wgmma<N, T>::ss(c, a.at((kk / 4) * A_ROWS * 128 + step), b.at((kk / 4) * N * 128 + step), kk > 0);
  }
}
//   acc (64 x N) += A (K / 16 register fragments) * B (K rows x N columns from b_addr, MN-major:
//   the rows are the contraction; O += P V, dQ += dS K, dV += P^T dO, dK += dS^T Q). In the
//   canonical layout 64-column panels are `leading` bytes apart (the tile's rows * 128) and
//   8-row groups `stride` = 1024 bytes apart; a k-step moves 16 rows down.
template <int N, int K, typename T>
__device__ __forceinline__ void wgmma_registers_shared(float (&acc)[N / 2], const u32 (&a)[K / 16][4], u32 b_addr,
                                                       u32 leading, u32 stride) {
  const SmemDescriptor b(b_addr, leading, stride);
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) Wgmma<N, T>::rs(acc, a[kk], b.at(kk * 16 * 128), 1);
}

// Copies rows [0, rows_valid) x columns [0, cols) of g (rows through their strides; cols <=
// HEAD_DIM, a multiple of 8 with vec: the forward's column groups load a part of Q) into a
// ROWS x (64 PANELS) swizzled tile; everything else is zero-filled. `tid` in [0, THREADS). vec:
// 16-byte cp.async chunks (vector_rows), else gathered chunks (gather_chunk).
// Thread tid copies 16-byte chunk column tid % CHUNKS of rows tid / CHUNKS + i * (THREADS / CHUNKS):
// its shared and global offsets then advance by constants, so each copy costs a few instructions
// (the general index arithmetic cost ~25 per 16-byte copy and made the producer warpgroup too
// slow to feed the tensor cores: H100, D=128). Where CHUNKS does not divide THREADS (three
// panels, D = 129..192: 24 chunks) the last THREADS % CHUNKS threads sit out: 120 of 128 copy.
// That path used to take the general arithmetic and measured slower per call than D = 256
// (H100, B=1 H=16 N=4096: D=192 266 against 361 TFLOP/s; ncu: the producer's copy loop).
template <int ROWS, int PANELS, int THREADS, int HEAD_DIM, typename T>
__device__ __forceinline__ void load_swizzled(unsigned char* tile, const Rows<const T>& g, int rows_valid, bool vec,
                                              int tid, int cols = HEAD_DIM) {
  constexpr int CHUNKS = PANELS * 8;  // 16-byte chunks per row
  static_assert((ROWS * CHUNKS) % THREADS == 0, "whole copies per thread");
  if (vec && CHUNKS <= THREADS) {
    constexpr int ROW_STEP = THREADS / CHUNKS, ACTIVE = ROW_STEP * CHUNKS;
    const int r0 = (ACTIVE == THREADS || tid < ACTIVE) ? tid / CHUNKS : ROWS, c = (tid % CHUNKS) * 8;
    const int rows = c < cols ? rows_valid : 0;  // rows to copy (the rest are zero-filled)
    const T* src = g.p + r0 * g.row + c;
    const i64 step = ROW_STEP * g.row;
    // Partly unrolled: the producer runs on PRODUCER_REGS (fully unrolled, its addresses spill).
#pragma unroll 4
    for (int r = r0; r < ROWS; r += ROW_STEP, src += step) {
      const bool ok = r < rows;
      cp_async16(tile + swizzled_offset(r, c, ROWS), ok ? src : g.p, ok);
    }
  } else if (vec) {
#pragma unroll 2
    for (int i = 0; i < ROWS * CHUNKS / THREADS; ++i) {
      const int idx = tid + i * THREADS, r = idx / CHUNKS, c = (idx % CHUNKS) * 8;
      const bool ok = r < rows_valid && c < cols;
      cp_async16(tile + swizzled_offset(r, c, ROWS), ok ? g.p + r * g.row + c : g.p, ok);
    }
  } else {
#pragma unroll 1
    for (int idx = tid; idx < ROWS * CHUNKS; idx += THREADS) {
      const int r = idx / CHUNKS, c = (idx % CHUNKS) * 8;
      *reinterpret_cast<uint4*>(tile + swizzled_offset(r, c, ROWS)) = gather_chunk(g, r, rows_valid, c, cols);
    }
  }
}

// Waits for every cp.async this thread issued, committed or not (cp.async.wait_group waits only
// for committed groups, and the producers never commit theirs: the mbarriers track them).
__device__ __forceinline__ void cp_async_wait_all() {
  cp_async_commit();
  cp_async_wait<0>();
}

// After a consumer warpgroup's cp.async copies of its resident rows (Q / dO, or K / V): waits for
// them, orders them before wgmma's reads (async proxy) and for every thread of the warpgroup
// (its own named barrier, 1 + warpgroup; the other warpgroups keep going).
__device__ __forceinline__ void resident_rows_ready(int warpgroup) {
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async();
  named_barrier_sync(1 + warpgroup, 128);
}

// A warpgroup's register tile (N floats per thread) to / from shared memory as [N / 4][128]
// float4s, `at` = the base + the thread's index in its warpgroup: each warp moves 512 contiguous
// bytes per access (no bank conflicts), and thread t of another warpgroup (same fragment layout)
// finds its own positions. The column groups of the wgmma kernels swap their score tiles this way.
template <int N>
__device__ __forceinline__ void store_fragments(const float (&r)[N], float4* at) {
  static_assert(N % 4 == 0, "whole float4s");
#pragma unroll
  for (int i = 0; i < N / 4; ++i) at[i * 128] = make_float4(r[4 * i], r[4 * i + 1], r[4 * i + 2], r[4 * i + 3]);
}
// The position of thread `t` of a warpgroup (0..127) in slot `slot` of a swap area of
// [slots][N / 4][128] float4s (one warpgroup's N-float register tile per slot): the column
// groups swap through slot buffer * 2 + warpgroup.
template <int N>
__device__ __forceinline__ float4* fragment_slot(float4* area, int slot, int t) {
  return area + slot * (N / 4) * 128 + t;
}
template <int N>
__device__ __forceinline__ void load_fragments(float (&r)[N], const float4* at) {
#pragma unroll
  for (int i = 0; i < N / 4; ++i) {
    const float4 x = at[i * 128];
    r[4 * i] = x.x;
    r[4 * i + 1] = x.y;
    r[4 * i + 2] = x.z;
    r[4 * i + 3] = x.w;
  }
}

// The dK/dV kernel's dQ (FUSED_DQ): a warpgroup's dS^T A fragments (keys = rows key0 + 8 (r & 1)
// of the thread, queries 16 kk + 8 (r >> 1) + 2 tq + {0, 1}) stored as they lie into the rows of a
// swizzled tile of 128 key rows x BN queries: the MN-major A operand of dQ = dS K. A query pair is
// one 4-byte store, and a warp's 8 rows hit 8 different 16-byte chunks (the swizzle), so the
// stores are free of bank conflicts. The two rows' address is made opaque: else the compiler
// keeps all BN / 4 addresses in registers across the step loop and the consumers spill (nvcc
// 13.0, D = 64: 280 bytes). Followed by the proxy fence that orders these generic stores before
// wgmma's reads (the caller then synchronizes).
template <int BN>
__device__ __forceinline__ void store_scores_rows(const u32 (&a)[BN / 16][4], unsigned char* tile, int key0, int tq) {
  // Row key0 + 8 h, query column 8 c + 2 tq: row * 128 + ((c % 8) ^ (key0 % 8)) * 16 + 4 tq in
  // panel c / 8 (key0 % 8 == (key0 + 8) % 8).
  u32 row = smem_u32(tile) + key0 * 128 + 4 * tq;
  asm volatile("" : "+r"(row));
  const u32 swizzle = (key0 % 8) * 16;
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int c = 2 * kk + (r >> 1);
      const u32 at = row + (c / 8) * 128 * 128 + (r & 1) * 8 * 128 + (((c % 8) * 16) ^ swizzle);
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at), "r"(a[kk][r]) : "memory");
    }
  fence_proxy_async();
}

// The epilogue of a warpgroup's 64 x HEAD_DIM output tile (O, dQ, dK or dV in the accumulator
// layout: rows 16 warp + g (+ 8), columns 8 n + 2 tq (+ 1)) through shared memory. Stored from
// the fragments, a warp's 4-byte stores put 16 bytes into each of 8 rows, 8 partial 128-byte
// lines per instruction; here each warp writes its 16 rows (times factor[hf], as T) into `tile`,
// a 64-row swizzled tile that no wgmma reads any more (conflict-free 4-byte stores, as
// store_scores_rows), and reads them back as 16-byte chunks, consecutive lanes along a row, so
// its global stores fill whole lines. A warp touches only its own rows: __syncwarp orders the
// two halves, and a second call on the same tile (dK after dV) waits for the first's reads.
// Rows >= rows_valid are not stored. g: row 0 = tile row 0, vector_rows (16-byte chunks).
// H200, bf16, H=16, against the fragment stores, interleaved, 8 calls back to back, time: fwd+bwd
// B=4 N=4096 D=128 0.977x (causal 0.984x), D=64 0.972x, B=1 N=4096 D=256 0.986x, N=16384 D=128
// 0.999x; forward 0.948-0.972x, at N=16384 1.016x (spread 0.983-1.036); outputs bitwise equal.
// It is a cost per CTA: the gain shows at N = 4096 (64 steps a dK/dV CTA), not at 16384 (256).
template <int HEAD_DIM, int NO, typename T>
__device__ __forceinline__ void store_tile_staged(const float (&acc)[NO][4], const float (&factor)[2],
                                                  unsigned char* tile, int warp, int lane, int rows_valid,
                                                  const Rows<T>& g) {
  static_assert(HEAD_DIM % 8 == 0 && NO * 8 >= HEAD_DIM, "16-byte chunks of the real columns");
  constexpr int CHUNKS = HEAD_DIM / 8;  // per row
  const int tq = lane % 4, first = warp * 16 + lane / 4;  // row first % 8 == lane / 4
  unsigned char* rows = tile + first * 128 + 4 * tq;
#pragma unroll
  for (int n = 0; n < CHUNKS; ++n)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const u32 at = (n / 8) * 64 * 128 + hf * 8 * 128 + (((n % 8) ^ (lane / 4)) * 16);
      *reinterpret_cast<u32*>(rows + at) = pack2(acc[n][2 * hf] * factor[hf], acc[n][2 * hf + 1] * factor[hf], T());
    }
  __syncwarp();
#pragma unroll
  for (int i = lane; i < 16 * CHUNKS; i += 32) {
    const int r = warp * 16 + i / CHUNKS, c = i % CHUNKS;
    if (r < rows_valid)
      *reinterpret_cast<uint4*>(g.p + r * g.row + 8 * c) =
          *reinterpret_cast<const uint4*>(tile + (c / 8) * 64 * 128 + r * 128 + (((c % 8) ^ (r % 8)) * 16));
  }
  __syncwarp();
}

// Ordered writes into global memory by other CTAs (the fused dQ: the first a bulk store, the
// rest bulk adds): a count each writer waits on. wait_for_count spins until *count (global)
// reaches `value`; its acquire orders this thread's later bulk adds after the writes the count
// published (completed: the writer waited for its bulk group before releasing the count). No
// proxy fence: both sides' stores and adds are the async proxy's, and
// a fence.proxy.async.global in the dK/dV kernel made ptxas spill 150-470 bytes (nvcc 13.0).
__device__ __forceinline__ void wait_for_count(const int* count, int value) {
  int seen;
  do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(count) : "memory");
  } while (seen != value);
}
// Publishes this thread's completed adds (the bulk group waited for) and counts them.
__device__ __forceinline__ void release_count(int* count) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(count) : "memory");
}
// Adds `bytes` (a multiple of 16) of fp32 from shared memory into global memory element by
// element, performed by the TMA unit (a bulk group: commit, then wait for the reads of the
// source, then for completion).
__device__ __forceinline__ void bulk_add_f32(float* global, u32 shared, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               ::"l"(global), "r"(shared), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// The same as a plain copy of `bytes` from shared memory to global memory.
__device__ __forceinline__ void bulk_store_f32(float* global, u32 shared, int bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(global), "r"(shared), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// FlashAttention-3's scheduler barriers: consumer warpgroup w issues its MMAs only after
// warpgroup w - 1 (cyclically) has issued its own, so one's softmax / gradient arithmetic
// overlaps the other's MMAs instead of colliding with them. Named barriers FIRST ..
// FIRST + CONSUMERS - 1 (barrier FIRST + w is warpgroup w's turn): take() waits for the turn
// (its 128 threads + the 128 of the previous warpgroup's pass()), pass() hands it on without
// waiting. Every pass() must be matched by a take(): the last turn of a kernel is not passed.
template <bool ON, int CONSUMERS, int FIRST>
struct MmaTurns {
  int warpgroup;
  __device__ __forceinline__ void start() const {  // warpgroup 0 goes first
    if (ON && warpgroup == CONSUMERS - 1) named_barrier_arrive(FIRST, 256);
  }
  __device__ __forceinline__ void take() const {
    if (ON) named_barrier_sync(FIRST + warpgroup, 256);
  }
  __device__ __forceinline__ void pass(bool last_turn = false) const {
    if (ON && !(last_turn && warpgroup == CONSUMERS - 1)) named_barrier_arrive(FIRST + (warpgroup + 1) % CONSUMERS, 256);
  }
};

// Producer side of a tile handoff: the tile's "full" barrier receives this thread's arrival once
// its copies have landed. With cp.async (vec) the hardware arrives by itself
// (cp.async.mbarrier.arrive.noinc), so the producer never waits for its own loads, only for free
// buffers: the earlier scheme (wait_group, fence, arrive) left the forward's consumers waiting for
// K / V in 20 % of the stall samples (H100 ncu, D=128). Plain stores (D % 8 != 0, unaligned
// or strided rows; load_swizzled then issues no cp.async) are fenced into the async proxy and arrive at once.
__device__ __forceinline__ void announce_tile(u32 full_barrier, bool vec) {
  if (vec) {
    cp_async_arrive_noinc(full_barrier);
  } else {
    fence_proxy_async();
    mbarrier_arrive(full_barrier);
  }
}

// Consumer side: waits for phase `parity` of a "full" barrier, then, where the tile was written
// through the generic proxy (cp.async, per-element stores, which the producer cannot fence after
// they land), orders those writes before this thread's wgmma reads (async proxy). A TMA tile is
// written through the async proxy and needs no fence. Skipping it made the forward 0.3-1.1 %
// faster (N=8192 D=128 0.836 -> 0.825 ms) and the dK/dV kernel 1-2 % slower (ptxas spilled 8-12
// bytes at D=64), so that kernel always fences (docs/cuda_notes.md, "TMA loads").
__device__ __forceinline__ void acquire_tile(u32 full_barrier, u32 parity, bool generic_writes) {
  mbarrier_wait(full_barrier, parity);
  if (generic_writes) fence_proxy_async();
}

// The K / V ring of the forward and the dQ kernel: STAGES buffers of BN keys each for K and V,
// and its control block at `at` (BYTES, 128-byte aligned): the K and V tensor maps, then four
// arrays of STAGES mbarriers: full / empty for K, full / empty for V. "full" counts the producer's
// arrivals (`producers`: one thread with TMA, the producer's 128 threads with cp.async), "empty"
// one lane of each of the consumers' warps.
template <int STAGES>
struct KeyValueRing {
  static constexpr int BYTES = 2 * 128 + 4 * STAGES * 8;
  u32 at;
  __device__ __forceinline__ u32 key_map() const { return at; }
  __device__ __forceinline__ u32 value_map() const { return at + 128; }
  __device__ __forceinline__ u32 full_keys(int stage) const { return at + 256 + 8 * stage; }
  __device__ __forceinline__ u32 empty_keys(int stage) const { return at + 256 + 8 * (STAGES + stage); }
  __device__ __forceinline__ u32 full_values(int stage) const { return at + 256 + 8 * (2 * STAGES + stage); }
  __device__ __forceinline__ u32 empty_values(int stage) const { return at + 256 + 8 * (3 * STAGES + stage); }
  __device__ __forceinline__ void init(int consumer_warps, int producers) const {
#pragma unroll
    for (int stage = 0; stage < STAGES; ++stage) {
      mbarrier_init(full_keys(stage), producers);
      mbarrier_init(full_values(stage), producers);
      mbarrier_init(empty_keys(stage), consumer_warps);
      mbarrier_init(empty_values(stage), consumer_warps);
    }
    // The initializations visible to the asynchronous proxy too (TMA counts bytes on "full").
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
};

// Whether TMA can load these rows: vector_rows' 16-byte chunks, and a row stride that a tensor
// map can name (a positive multiple of 16 bytes, rows not overlapping).
template <int HEAD_DIM, typename T>
__device__ __forceinline__ bool tma_rows(const Rows<T>& r) {
  return vector_rows<HEAD_DIM>(r) && r.row >= HEAD_DIM && r.row < ((i64)1 << 36);
}

// Where a CTA's K and V tensor maps come from: the host's template (32 words) and the CTA's two
// 128-byte slots of a global scratch output (TMA reads maps from global memory only).
struct TensorMapSource {
  const u32* templ;
  unsigned char* slots;
};

// POISON_RELEASED (Tuning.poison_released; tests only, never in the table): before the producer
// refills a buffer its consumers released, it overwrites the buffer with NaN (0x7fff in every
// bf16 / fp16 element), last bytes first, and fences the stores before the refill's TMA writes.
// A product that still reads a buffer after its release reads NaN if the refill overtakes it:
// the race that neither the tests nor racecheck (blind to wgmma's and TMA's shared-memory
// accesses) can see. On an H200 the refill never overtook the running product in a kernel with
// that race (docs/cuda_notes.md "How the kernels are checked"): the ledger below is what
// catches it. The TMA paths only (the cp.async paths' copies are ordinary enough for racecheck).
template <int BYTES>
__device__ __forceinline__ void poison_released_tile(unsigned char* tile) {
  static_assert(BYTES % 16 == 0, "whole 16-byte chunks");
  uint4* chunks = reinterpret_cast<uint4*>(tile);
  for (int i = BYTES / 16 - 1; i >= 0; --i) chunks[i] = make_uint4(0x7fff7fffu, 0x7fff7fffu, 0x7fff7fffu, 0x7fff7fffu);
  fence_proxy_async();  // these stores before the refill's (async-proxy) writes
}

// POISON_RELEASED's second half, which does not depend on timing (the NaN above is seen only
// where a refill overtakes the product: on the H200 a release before dP's wait did not show).
// Each consumer thread keeps a ledger of the ring tiles its pending wgmma groups read: one byte
// per committed group, the newest lowest; bit `stage` for the ring's K tile (dK/dV: Q), bit
// 4 + stage for its V tile (dK/dV: dO). A wait_group N keeps the newest N bytes; a release of a
// tile that a kept byte names marks the thread, and a marked thread's results are NaN (spoil).
// So a release placed before the wait that retires a product reading the tile fails the tests
// at every call that reaches it. Off (ON = false) it is the bare wgmma_commit / wgmma_wait and
// the arrive (the default kernels' SASS is unchanged).
template <bool ON, int STAGES>
struct ReadLedger {
  static_assert(STAGES <= 4, "four bits a tile");
  unsigned long long pending = 0;
  bool early = false;
  __device__ __forceinline__ static u32 keys(int stage) { return 1u << stage; }
  __device__ __forceinline__ static u32 values(int stage) { return 16u << stage; }
  // wgmma.commit_group of the products issued since the last one, which read `tiles`.
  __device__ __forceinline__ void commit(u32 tiles) {
    wgmma_commit();
    if constexpr (ON) pending = pending << 8 | tiles;
  }
  // wgmma.wait_group N: all but the newest N groups have completed.
  template <int N>
  __device__ __forceinline__ void wait() {
    static_assert(N >= 0 && N < 8, "the ledger holds eight groups");
    wgmma_wait<N>();
    if constexpr (ON) pending &= (1ull << (8 * N)) - 1;
  }
  // The consumers are done with `tiles`: `arrive` threads arrive on their "empty" barrier.
  __device__ __forceinline__ void release(u32 tiles, u32 barrier, bool arrive) {
    if constexpr (ON) early |= (pending & tiles * 0x0101010101010101ull) != 0;
    if (arrive) mbarrier_arrive(barrier);
  }
  // A marked thread's accumulators to NaN. Called under `if constexpr (POISON_RELEASED)`: even
  // the empty call changed ptxas's register allocation in the D = 448 / 512 dK/dV kernels
  // (264 -> 188 / 228 bytes of spill loads, the same speed: 1.002-1.003x fwd+bwd on an H200).
  template <int N>
  __device__ __forceinline__ void spoil(float (&acc)[N]) const {
    if constexpr (ON) {
      if (early) {
#pragma unroll
        for (int i = 0; i < N; ++i) acc[i] = __int_as_float(0x7fc00000);
      }
    }
  }
};

// The producer warpgroup's loop (ptid = its thread index 0..127): key blocks kb_begin ..
// kb_begin + steps - 1 of this kv head's K (kg) and V (vg) into the ring, each buffer refilled
// once the consumers released it (it runs up to STAGES tiles ahead).
// tma (tma_rows for K and V; the ring's "full" barriers then count one arrival): the first warp
// publishes the two tensor maps and one thread issues a TMA load per 64-column panel; the
// hardware counts the bytes on "full". Else all 128 threads copy with cp.async (load_swizzled).
// poison: POISON_RELEASED's check (above), on the TMA path.
template <int BN, int PANELS, int HEAD_DIM, int STAGES, typename T>
__device__ __forceinline__ void produce_key_value_tiles(const KeyValueRing<STAGES>& ring, unsigned char* Ks,
                                                        unsigned char* Vs, const Rows<const T>& kg,
                                                        const Rows<const T>& vg, int kb_begin, int steps, int Nk,
                                                        bool vec, bool tma, const TensorMapSource& maps, int ptid,
                                                        bool poison = false) {
  constexpr int TILE_BYTES = PANELS * BN * 128;
  if (tma) {
    if (ptid >= 32) return;
    unsigned char *key_map = maps.slots, *value_map = maps.slots + 128;
    publish_tensor_maps(maps.templ, ring.key_map(), ring.value_map(), maps.slots, ptid, [&] {
      tensor_map_replace(ring.key_map(), kg.p, HEAD_DIM, Nk, kg.row * (i64)sizeof(T));
      tensor_map_replace(ring.value_map(), vg.p, HEAD_DIM, Nk, vg.row * (i64)sizeof(T));
    });
    if (ptid != 0) return;
    for (int j = 0; j < steps; ++j) {
      const int k0 = (kb_begin + j) * BN, stage = j % STAGES;
      const u32 parity = ((j / STAGES) & 1) ^ 1;
      mbarrier_wait(ring.empty_keys(stage), parity);
      if (poison && j >= STAGES) poison_released_tile<TILE_BYTES>(Ks + stage * TILE_BYTES);
      mbarrier_arrive_expect_bytes(ring.full_keys(stage), TILE_BYTES);
#pragma unroll
      for (int p = 0; p < PANELS; ++p)
        tma_load_2d(smem_u32(Ks + stage * TILE_BYTES + p * BN * 128), key_map, 64 * p, k0, ring.full_keys(stage));
      mbarrier_wait(ring.empty_values(stage), parity);
      if (poison && j >= STAGES) poison_released_tile<TILE_BYTES>(Vs + stage * TILE_BYTES);
      mbarrier_arrive_expect_bytes(ring.full_values(stage), TILE_BYTES);
#pragma unroll
      for (int p = 0; p < PANELS; ++p)
        tma_load_2d(smem_u32(Vs + stage * TILE_BYTES + p * BN * 128), value_map, 64 * p, k0,
                    ring.full_values(stage));
    }
    return;
  }
  for (int j = 0; j < steps; ++j) {
    const int k0 = (kb_begin + j) * BN, stage = j % STAGES;
    const u32 parity = ((j / STAGES) & 1) ^ 1;  // the consumers freed this buffer (j >= STAGES)
    mbarrier_wait(ring.empty_keys(stage), parity);
    load_swizzled<BN, PANELS, 128, HEAD_DIM>(Ks + stage * TILE_BYTES, kg.from(k0), Nk - k0, vec, ptid);
    announce_tile(ring.full_keys(stage), vec);
    mbarrier_wait(ring.empty_values(stage), parity);
    load_swizzled<BN, PANELS, 128, HEAD_DIM>(Vs + stage * TILE_BYTES, vg.from(k0), Nk - k0, vec, ptid);
    announce_tile(ring.full_values(stage), vec);
  }
  cp_async_wait_all();  // no copy outlives the thread
}

}  // namespace mlxflash

// mx.fast.cuda_kernel writes "__global__ void <name>(...)" right after the header and takes no
// launch bounds, but setmaxnreg needs them: ptxas must know each thread's register budget at
// entry (65536 / THREADS), or a consumer's setmaxnreg.inc could wait for registers that the
// launch never reserved. So each wgmma kernel's template ends by redefining __global__ with
// MLXFLASH_GLOBAL_KERNEL and its own launch bounds.
#if defined(__location__)
#define MLXFLASH_GLOBAL_KERNEL __location__(global)
#else
#define MLXFLASH_GLOBAL_KERNEL __attribute__((global))
#endif

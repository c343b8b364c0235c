// CPU emulation of the CUDA subset the attention kernels use, for checking kernel LOGIC on a
// machine without a GPU (mlx_flash/backends/cuda_emulator.py compiles a rendered kernel with
// this prelude through the host C++ compiler and runs it on numpy buffers).
//
// Model: every CUDA thread of a block is a fiber (ucontext). A fiber runs until it reaches a
// warp collective (ldmatrix, mma.sync, shuffle) or __syncthreads and then yields. When all 32
// lanes of a warp wait at the same collective, the scheduler executes it for the whole warp
// (reading the lanes' posted operands, writing each lane's result) and releases the warp; when
// every live thread waits at __syncthreads, the block is released. The next warp to run is
// drawn at random (seeded), so shared-memory ordering bugs show as wrong or varying results.
// cp.async copies are deferred to the cp.async.wait that covers them (or done at issue in
// "eager" mode), so a read before the wait sees stale data. Shared-memory accesses of ldmatrix
// and cp.async are bounds- and alignment-checked; a failed check aborts the launch with a message.
// Arithmetic: mma.sync decodes fp16 / bf16 exactly and accumulates in fp32 (the tensor cores'
// accumulation order differs, within rounding).
#pragma once
#define MLXFLASH_CPU_EMULATION 1
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))
#define __shared__

using std::max;
using std::min;

struct dim3_ {
  unsigned x, y, z;
};

// ---------------------------------------------------------------- 16-bit float types
static inline float emu_bf16_to_float(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline uint16_t emu_float_to_bf16(float f) {  // round to nearest even, NaN kept quiet
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
static inline float emu_f16_to_float(uint16_t b) {
  _Float16 h;
  std::memcpy(&h, &b, 2);
  return (float)h;
}
static inline uint16_t emu_float_to_f16(float f) {
  _Float16 h = (_Float16)f;
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}

struct __nv_bfloat16 {
  uint16_t bits;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) : bits(emu_float_to_bf16(f)) {}
};
struct __half {
  uint16_t bits;
  __half() = default;
  __half(float f) : bits(emu_float_to_f16(f)) {}
};
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
struct __half2 {
  __half x, y;
};
static inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__nv_bfloat16(a), __nv_bfloat16(b)}; }
static inline __half2 __floats2half2_rn(float a, float b) { return {__half(a), __half(b)}; }
static inline __nv_bfloat16 __float2bfloat16_rn(float a) { return __nv_bfloat16(a); }
static inline __half __float2half_rn(float a) { return __half(a); }
static inline float __bfloat162float(__nv_bfloat16 a) { return emu_bf16_to_float(a.bits); }
static inline float __half2float(__half a) { return emu_f16_to_float(a.bits); }

// ---------------------------------------------------------------- vector types (CUDA's alignment)
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) uint2 { uint32_t x, y; };
struct alignas(16) uint4 { uint32_t x, y, z, w; };
static inline float2 make_float2(float x, float y) { return {x, y}; }
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
static inline uint2 make_uint2(uint32_t x, uint32_t y) { return {x, y}; }

namespace emu {

enum Op { OP_NONE = 0, OP_LDM, OP_LDM_T, OP_LDM2, OP_LDM2_T, OP_MMA_BF16, OP_MMA_F16, OP_SHFL, OP_VOTE_ANY, OP_SYNC, OP_DONE };

struct Lane {
  ucontext_t ctx;
  int op = OP_NONE;             // what the lane waits at
  const void* addr = nullptr;   // ldmatrix row address
  uint32_t a[4], b[2], r[4];    // mma / ldmatrix operands and results
  float c[4];                   // mma accumulators (in and out)
  float fval;                   // shuffle value / result
  int ival;                     // shuffle lane mask / vote predicate and result
  struct Copy { void* dst; const void* src; bool valid; int group; };
  std::vector<Copy> pending;    // cp.async copies not yet done
  int group = 0;                // current (uncommitted) cp.async group number
};

struct State {
  std::vector<Lane> lanes;
  std::vector<char*> stacks;
  ucontext_t sched;
  int current = -1;
  unsigned char* smem = nullptr;
  size_t smem_bytes = 0;
  bool eager_copies = false;
  std::string error;
  std::mt19937 rng;
};
inline State& st() {
  static State s;
  return s;
}

}  // namespace emu

// Built-in variables: the scheduler sets them before resuming a fiber.
inline dim3_ threadIdx, blockIdx, gridDim, blockDim;

namespace mlxflash {
alignas(128) inline unsigned char smem_raw[232448 + 128];
}

namespace emu {

[[noreturn]] inline void fail(const std::string& msg) {
  State& s = st();
  if (s.error.empty()) s.error = msg;
  // Jump back to the scheduler for good: the launch reports the error.
  s.lanes[s.current].op = OP_DONE;
  setcontext(&s.sched);
  std::abort();
}

inline void wait_at(int op) {
  State& s = st();
  s.lanes[s.current].op = op;
  swapcontext(&s.lanes[s.current].ctx, &s.sched);
}

inline Lane& me() { return st().lanes[st().current]; }

inline void check_smem(const void* p, size_t bytes, const char* what) {
  State& s = st();
  const unsigned char* c = static_cast<const unsigned char*>(p);
  if (c < s.smem || c + bytes > s.smem + s.smem_bytes) {
    char buf[200];
    snprintf(buf, sizeof buf, "%s: shared-memory access at byte offset %ld (+%zu) outside [0, %zu) (thread %d)", what,
             (long)(c - s.smem), bytes, s.smem_bytes, s.current);
    fail(buf);
  }
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0 && bytes == 16) {
    char buf[160];
    snprintf(buf, sizeof buf, "%s: shared address at byte offset %ld not 16-byte aligned (thread %d)", what,
             (long)(c - s.smem), s.current);
    fail(buf);
  }
}

inline uint16_t half_at(const void* row, int element) {
  uint16_t v;
  std::memcpy(&v, static_cast<const unsigned char*>(row) + 2 * element, 2);
  return v;
}

// Executes the collective all lanes [w*32, w*32+32) wait at.
inline void run_collective(int w) {
  State& s = st();
  Lane* L = &s.lanes[w * 32];
  const int op = L[0].op;
  for (int l = 1; l < 32; ++l)
    if (L[l].op != op) {
      char buf[160];
      snprintf(buf, sizeof buf, "warp %d: lanes wait at different collectives (%d vs %d): divergent warp", w, op, L[l].op);
      s.error = buf;
      return;
    }
  if (op == OP_LDM || op == OP_LDM_T || op == OP_LDM2 || op == OP_LDM2_T) {
    const int mats = (op == OP_LDM || op == OP_LDM_T) ? 4 : 2;
    const bool trans = op == OP_LDM_T || op == OP_LDM2_T;
    for (int l = 0; l < 32; ++l) {
      for (int i = 0; i < mats; ++i) {
        uint16_t lo, hi;
        if (!trans) {
          const void* row = L[8 * i + l / 4].addr;
          lo = half_at(row, 2 * (l % 4));
          hi = half_at(row, 2 * (l % 4) + 1);
        } else {
          lo = half_at(L[8 * i + 2 * (l % 4)].addr, l / 4);
          hi = half_at(L[8 * i + 2 * (l % 4) + 1].addr, l / 4);
        }
        L[l].r[i] = (uint32_t)lo | ((uint32_t)hi << 16);
      }
    }
  } else if (op == OP_MMA_BF16 || op == OP_MMA_F16) {
    float A[16][16], B[16][8];
    auto dec = [&](uint32_t v, int which) {
      const uint16_t h = which ? (uint16_t)(v >> 16) : (uint16_t)(v & 0xffff);
      return op == OP_MMA_BF16 ? emu_bf16_to_float(h) : emu_f16_to_float(h);
    };
    for (int l = 0; l < 32; ++l) {
      const int g = l / 4, t = l % 4;
      for (int e = 0; e < 2; ++e) {
        A[g][2 * t + e] = dec(L[l].a[0], e);
        A[g + 8][2 * t + e] = dec(L[l].a[1], e);
        A[g][2 * t + 8 + e] = dec(L[l].a[2], e);
        A[g + 8][2 * t + 8 + e] = dec(L[l].a[3], e);
        B[2 * t + e][g] = dec(L[l].b[0], e);
        B[2 * t + 8 + e][g] = dec(L[l].b[1], e);
      }
    }
    for (int l = 0; l < 32; ++l) {
      const int g = l / 4, t = l % 4;
      const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
      for (int i = 0; i < 4; ++i) {
        float acc = 0.f;
        for (int kx = 0; kx < 16; ++kx) acc += A[rows[i]][kx] * B[kx][cols[i]];
        L[l].c[i] += acc;
      }
    }
  } else if (op == OP_SHFL) {
    float v[32];
    for (int l = 0; l < 32; ++l) v[l] = L[l].fval;
    for (int l = 0; l < 32; ++l) L[l].fval = v[l ^ L[l].ival];
  } else if (op == OP_VOTE_ANY) {
    int any = 0;
    for (int l = 0; l < 32; ++l) any |= L[l].ival;
    for (int l = 0; l < 32; ++l) L[l].ival = any != 0;
  } else {
    s.error = "internal: unknown collective";
    return;
  }
  for (int l = 0; l < 32; ++l) L[l].op = OP_NONE;
}

inline void fiber_entry_trampoline();

}  // namespace emu

// ---------------------------------------------------------------- device API used by kernels
inline void __syncthreads() { emu::wait_at(emu::OP_SYNC); }

inline float __shfl_xor_sync(unsigned, float x, int mask) {
  emu::Lane& l = emu::me();
  l.fval = x;
  l.ival = mask;
  emu::wait_at(emu::OP_SHFL);
  return emu::me().fval;
}

inline int __any_sync(unsigned, int predicate) {
  emu::Lane& l = emu::me();
  l.ival = predicate != 0;
  emu::wait_at(emu::OP_VOTE_ANY);
  return emu::me().ival;
}

inline int __all_sync(unsigned mask, int predicate) { return !__any_sync(mask, !predicate); }

namespace mlxflash {
typedef unsigned int u32;

inline void cp_async16(void* dst, const void* src, bool valid) {
  emu::check_smem(dst, 16, "cp.async");
  emu::Lane& l = emu::me();
  if (emu::st().eager_copies) {
    if (valid) std::memcpy(dst, src, 16);
    else std::memset(dst, 0, 16);
  } else {
    l.pending.push_back({dst, src, valid, l.group});
  }
}
inline void cp_async_commit() { emu::me().group++; }
template <int N>
inline void cp_async_wait() {
  // Complete every copy of the committed groups except the N most recent.
  emu::Lane& l = emu::me();
  std::vector<emu::Lane::Copy> keep;
  for (auto& c : l.pending) {
    if (c.group < l.group - N) {
      if (c.valid) std::memcpy(c.dst, c.src, 16);
      else std::memset(c.dst, 0, 16);
    } else {
      keep.push_back(c);
    }
  }
  l.pending.swap(keep);
}

inline void ldmatrix_impl(u32* r, const void* p, int op, int n) {
  emu::check_smem(p, 16, "ldmatrix");
  emu::me().addr = p;
  emu::wait_at(op);
  for (int i = 0; i < n; ++i) r[i] = emu::me().r[i];
}
inline void ldmatrix_x4(u32 (&r)[4], const void* p) { ldmatrix_impl(r, p, emu::OP_LDM, 4); }
inline void ldmatrix_x4_trans(u32 (&r)[4], const void* p) { ldmatrix_impl(r, p, emu::OP_LDM_T, 4); }
inline void ldmatrix_x2(u32 (&r)[2], const void* p) { ldmatrix_impl(r, p, emu::OP_LDM2, 2); }
inline void ldmatrix_x2_trans(u32 (&r)[2], const void* p) { ldmatrix_impl(r, p, emu::OP_LDM2_T, 2); }

inline void mma_impl(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1, int op) {
  emu::Lane& l = emu::me();
  for (int i = 0; i < 4; ++i) l.a[i] = a[i], l.c[i] = c[i];
  l.b[0] = b0;
  l.b[1] = b1;
  emu::wait_at(op);
  for (int i = 0; i < 4; ++i) c[i] = emu::me().c[i];
}
inline void mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1, __nv_bfloat16) { mma_impl(c, a, b0, b1, emu::OP_MMA_BF16); }
inline void mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1, __half) { mma_impl(c, a, b0, b1, emu::OP_MMA_F16); }

inline float fast_exp2(float x) { return std::exp2(x); }
inline float fast_tanh(float x) { return std::tanh(x); }
}  // namespace mlxflash

// ---------------------------------------------------------------- launch
namespace emu {

typedef void (*BlockFn)(void** args);
inline BlockFn g_block_fn = nullptr;
inline void** g_args = nullptr;

inline void fiber_main() {
  g_block_fn(g_args);
  State& s = st();
  // Outstanding cp.async copies of a finished thread land eventually: complete them.
  for (auto& c : s.lanes[s.current].pending) {
    if (c.valid) std::memcpy(c.dst, c.src, 16);
    else std::memset(c.dst, 0, 16);
  }
  s.lanes[s.current].pending.clear();
  s.lanes[s.current].op = OP_DONE;
  swapcontext(&s.lanes[s.current].ctx, &s.sched);
}

// Runs one block of `threads` threads. Returns false (with st().error set) on a detected fault.
inline bool run_block(int threads) {
  State& s = st();
  const int warps = threads / 32;
  for (int t = 0; t < threads; ++t) {
    Lane& l = s.lanes[t];
    l.op = OP_NONE;
    l.pending.clear();
    l.group = 0;
    getcontext(&l.ctx);
    l.ctx.uc_stack.ss_sp = s.stacks[t];
    l.ctx.uc_stack.ss_size = 256 * 1024;
    l.ctx.uc_link = &s.sched;
    makecontext(&l.ctx, (void (*)())fiber_main, 0);
  }
  auto resume = [&](int t) {
    s.current = t;
    threadIdx = {(unsigned)t, 0u, 0u};
    swapcontext(&s.sched, &s.lanes[t].ctx);
  };
  std::vector<int> order;
  while (s.error.empty()) {
    // Warps that can make progress: some lane runnable (OP_NONE) or a complete collective.
    order.clear();
    int at_sync = 0, done = 0;
    for (int w = 0; w < warps; ++w) {
      bool runnable = false, collective = true;
      for (int l = 0; l < 32; ++l) {
        const int op = s.lanes[w * 32 + l].op;
        if (op == OP_NONE) runnable = true;
        if (op == OP_NONE || op == OP_SYNC || op == OP_DONE) collective = false;
        if (op == OP_SYNC) ++at_sync;
        if (op == OP_DONE) ++done;
      }
      if (runnable || collective) order.push_back(w);
    }
    if (order.empty()) {
      if (done == threads) return true;
      if (at_sync + done == threads) {  // barrier complete (exited threads count as arrived)
        for (int t = 0; t < threads; ++t)
          if (s.lanes[t].op == OP_SYNC) s.lanes[t].op = OP_NONE;
        continue;
      }
      s.error = "deadlock: some threads wait at __syncthreads while others wait at a warp collective";
      return false;
    }
    const int w = order[std::uniform_int_distribution<int>(0, (int)order.size() - 1)(s.rng)];
    bool runnable = false;
    for (int l = 0; l < 32; ++l) runnable = runnable || s.lanes[w * 32 + l].op == OP_NONE;
    if (runnable) {
      for (int l = 0; l < 32 && s.error.empty(); ++l)
        if (s.lanes[w * 32 + l].op == OP_NONE) resume(w * 32 + l);
    } else {
      bool mixed = false;
      for (int l = 0; l < 32; ++l) {
        const int op = s.lanes[w * 32 + l].op;
        mixed = mixed || op == OP_SYNC || op == OP_DONE;
      }
      if (mixed) {
        s.error = "warp collective with some lanes at __syncthreads or exited";
        return false;
      }
      run_collective(w);
    }
  }
  return false;
}

}  // namespace emu

// Entry point: runs grid_x * grid_y blocks of `threads` threads one after another.
extern "C" int mlxflash_emulate(emu::BlockFn fn, void** args, int grid_x, int grid_y, int threads, int smem_bytes,
                                int seed, int eager, char* error, int error_len) {
  using namespace emu;
  State& s = st();
  s.error.clear();
  s.rng.seed(seed);
  s.eager_copies = eager != 0;
  s.smem = mlxflash::smem_raw;
  s.smem_bytes = (size_t)smem_bytes;
  if (threads % 32 != 0 || threads > 1024 || smem_bytes > 232448) {
    snprintf(error, error_len, "bad launch: %d threads, %d bytes of shared memory", threads, smem_bytes);
    return 1;
  }
  if ((int)s.lanes.size() < threads) {
    s.lanes.resize(threads);
    while ((int)s.stacks.size() < threads) s.stacks.push_back(static_cast<char*>(std::malloc(256 * 1024)));
  }
  g_block_fn = fn;
  g_args = args;
  gridDim = {(unsigned)grid_x, (unsigned)grid_y, 1u};
  blockDim = {(unsigned)threads, 1u, 1u};
  for (int by = 0; by < grid_y; ++by)
    for (int bx = 0; bx < grid_x; ++bx) {
      blockIdx = {(unsigned)bx, (unsigned)by, 0u};
      // Poison shared memory: a read of something no one wrote gives NaN-like garbage.
      std::memset(mlxflash::smem_raw, 0xff, sizeof mlxflash::smem_raw);
      if (!run_block(threads)) {
        snprintf(error, error_len, "block (%d, %d): %s", bx, by, s.error.c_str());
        return 1;
      }
    }
  return 0;
}

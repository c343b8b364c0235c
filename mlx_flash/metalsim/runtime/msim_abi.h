// metalsim ABI shared by the scheduler runtime (metalsim_rt.cpp) and the
// kernel-side header (metalsim.hpp). Keep it C-compatible and tiny: it is
// included by every compiled kernel.
#pragma once
#include <stddef.h>
#include <stdint.h>

typedef unsigned int msim_u32x3 __attribute__((ext_vector_type(3)));

// Per-thread values of the Metal kernel attributes ([[thread_position_in_grid]]
// and friends). Filled by the scheduler, read by the generated thunk.
struct msim_attrs {
  msim_u32x3 thread_position_in_grid;
  msim_u32x3 thread_position_in_threadgroup;
  msim_u32x3 threadgroup_position_in_grid;
  msim_u32x3 threads_per_threadgroup;           // actual size (partial at edges)
  msim_u32x3 dispatch_threads_per_threadgroup;  // size given at dispatch
  msim_u32x3 threadgroups_per_grid;
  msim_u32x3 threads_per_grid;
  msim_u32x3 grid_size;
  msim_u32x3 grid_origin;
  unsigned thread_index_in_threadgroup;
  unsigned thread_index_in_simdgroup;
  unsigned simdgroup_index_in_threadgroup;
  unsigned simdgroups_per_threadgroup;
  unsigned dispatch_simdgroups_per_threadgroup;
  unsigned thread_execution_width;
  unsigned threads_per_simdgroup;
  unsigned thread_index_in_quadgroup;
  unsigned quadgroup_index_in_threadgroup;
  unsigned quadgroups_per_threadgroup;
  unsigned dispatch_quadgroups_per_threadgroup;
};

// A SIMD-group collective. Each participating lane fills one of these on its
// own stack and calls msim_rt_collective(); the last lane to arrive runs
// `fn` once for the whole simdgroup with the lanes' slots (`mask` has a bit
// per active lane; slots[l] is only meaningful for those lanes). Lanes whose `fn`
// differs (divergent code reaching different collectives) are run as
// separate groups.
struct msim_coll;
typedef void (*msim_coll_fn)(struct msim_coll* const* slots, unsigned mask);
struct msim_coll {
  msim_coll_fn fn;
  void* p[4];
  uint64_t u[4];
};

typedef void (*msim_thunk_fn)(void* const* args, const struct msim_attrs* a);

struct msim_launch_desc {
  msim_thunk_fn thunk;
  void* const* args;           // kernel arguments (buffer pointers)
  unsigned grid[3];            // threads per grid (MLX `grid`)
  unsigned tg[3];              // threads per threadgroup (already clamped)
  int reversed;                // run threads of a threadgroup in reverse order
  int nworkers;                // OS threads running threadgroups
  size_t stack_size;           // fiber stack size in bytes
  size_t tg_mem_limit;         // bytes of threadgroup memory allowed
  const char* kernel_name;
  const char* const* tg_names; // names of threadgroup allocation sites
};

#ifdef __cplusplus
extern "C" {
#endif
int msim_rt_launch(const struct msim_launch_desc* d, char* err, size_t errlen);
void msim_rt_barrier(void);
void msim_rt_collective(struct msim_coll* c);
unsigned msim_rt_lane(void);
void* msim_rt_tg_alloc(int site, size_t size, size_t align);
void msim_rt_oob(const char* buffer, long long index, long long lo, long long hi,
                 int is_tg);
void msim_rt_fatal(const char* msg);
#ifdef __cplusplus
}
#endif

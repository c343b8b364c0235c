// metalsim scheduler runtime: runs the threads of each threadgroup as
// user-space fibers and the threadgroups on a small pool of OS threads.
//
// Execution model (deterministic within a threadgroup):
//  * every thread of a threadgroup is a fiber with its own stack; fibers only
//    switch at synchronisation points (threadgroup_barrier, SIMD collectives)
//    and when a thread finishes;
//  * a run queue holds the runnable fibers in thread order (or reversed);
//  * a barrier completes when every live (not yet returned) thread of the
//    threadgroup has arrived; a SIMD collective completes when every live
//    lane of the simdgroup has arrived and is executed once, by the last lane
//    to arrive, on behalf of all lanes;
//  * if nothing is runnable while some lanes wait at a collective (the other
//    lanes of their simdgroup wait at a barrier or diverged), the collective
//    runs with the waiting lanes as the active set: this is how divergent
//    SIMD code behaves on the GPU.
//
// Built once per machine (cached) and loaded with RTLD_GLOBAL; compiled
// kernels import the msim_rt_* entry points from it.
#include "msim_abi.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#define MSIM_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

enum FiberState { F_NEW, F_RUNNABLE, F_RUNNING, F_WAIT_BAR, F_WAIT_COLL, F_DONE };

struct Worker;

struct Fiber {
  void* sp;  // saved stack pointer (x86-64 switch)
#if !defined(__x86_64__)
  ucontext_t uc;
#endif
  char* stack_lo;
  int state;
  unsigned idx, lane, sg;
  Worker* w;
  msim_attrs* attrs;  // kept out of line: Fiber stays small and hot
};

struct SimdGroup {
  unsigned live_mask;
  unsigned arrived_mask;
  unsigned ready_mask;    // lanes woken by a collective, not yet resumed
  msim_coll* slot[32];    // the arrived lanes' collectives
  msim_coll_fn fn[32];    // copies of slot[l]->fn, compared without touching lane stacks
};

constexpr int kMaxThreads = 1024;
constexpr int kMaxSites = 1024;

struct Site {
  unsigned epoch;
  size_t offset;
};

struct Launch {
  const msim_launch_desc* d;
  unsigned ntg[3];
  unsigned long long total_tg;
  unsigned long long next_tg;  // atomic
  int abort;                   // atomic
  pthread_mutex_t err_mu;
  char* err;
  size_t errlen;
  int has_err;
};

struct Worker {
  // fibers and their stacks (grown on demand, reused across launches)
  Fiber* fibers;
  msim_attrs* attrs;
  int cap;
  char* stacks;
  size_t stacks_bytes;
  size_t stack_size;
  // threadgroup state
  Launch* L;
  int nthreads;
  int live;
  int bar_count;
  int nsg;
  SimdGroup sgs[kMaxThreads / 32];
  int runq[kMaxThreads];
  int rq_head, rq_len;
  Fiber* cur;
  void* main_sp;
#if !defined(__x86_64__)
  ucontext_t main_uc;
#endif
  int aborted_tg;  // current threadgroup abandoned after a fatal error
  // alternate signal stack (faults on a fiber stack, e.g. stack overflow)
  char* altstack;
  stack_t old_altstack;
  // threadgroup memory
  char* arena;
  size_t arena_used;
  unsigned epoch;
  Site sites[kMaxSites];
};

// initial-exec: a plain %fs-relative load instead of a __tls_get_addr call
// on every barrier/collective (needs only a pointer of static TLS).
__thread Worker* tls_worker __attribute__((tls_model("initial-exec")));

// ---------------------------------------------------------------------------
// Context switch
// ---------------------------------------------------------------------------
// Stack tops are staggered ("coloured") so that the hot top-of-stack lines of
// the fibers do not all map to the same cache sets.
inline uintptr_t stack_top(Fiber* f, size_t stack_size) {
  size_t colour = ((size_t)f->idx * 17 % 64) * 64 + ((size_t)f->idx / 64 % 4) * 4096;
  return ((uintptr_t)(f->stack_lo + stack_size - colour)) & ~(uintptr_t)15;
}

#if defined(__x86_64__)
extern "C" void msim_switch(void** save_sp, void* new_sp);
extern "C" void msim_fiber_entry(void);
extern "C" void msim_fiber_main(Fiber* f);
// Saves the callee-saved registers on the current stack, stores the stack
// pointer in *save_sp, switches to new_sp and restores from there.
__asm__(
    ".text\n"
    ".p2align 4\n"
    ".hidden msim_switch\n"
    ".type msim_switch,@function\n"
    "msim_switch:\n"
    "  pushq %rbp\n"
    "  pushq %rbx\n"
    "  pushq %r12\n"
    "  pushq %r13\n"
    "  pushq %r14\n"
    "  pushq %r15\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  popq %r15\n"
    "  popq %r14\n"
    "  popq %r13\n"
    "  popq %r12\n"
    "  popq %rbx\n"
    "  popq %rbp\n"
    "  ret\n"
    ".size msim_switch, .-msim_switch\n"
    ".p2align 4\n"
    ".hidden msim_fiber_entry\n"
    ".type msim_fiber_entry,@function\n"
    "msim_fiber_entry:\n"
    "  movq %r12, %rdi\n"
    "  call msim_fiber_main\n"
    "  ud2\n"
    ".size msim_fiber_entry, .-msim_fiber_entry\n");

inline void fiber_init(Fiber* f, size_t stack_size) {
  // Initial frame popped by msim_switch: r15 r14 r13 r12 rbx rbp ret.
  uintptr_t top = stack_top(f, stack_size);
  void** sp = (void**)(top - 56);
  for (int i = 0; i < 7; ++i) sp[i] = nullptr;
  sp[3] = (void*)f;                  // r12 -> first argument of fiber main
  sp[6] = (void*)&msim_fiber_entry;  // return address
  f->sp = (void*)sp;
}
inline void switch_fiber(void** save, Fiber* to) { msim_switch(save, to->sp); }
inline void switch_to_main(void** save, Worker* w) { msim_switch(save, w->main_sp); }
inline void main_to_fiber(Worker* w, Fiber* to) { msim_switch(&w->main_sp, to->sp); }
#else
extern "C" void msim_fiber_main(Fiber* f);
void uc_entry(unsigned lo, unsigned hi) {
  msim_fiber_main((Fiber*)(((uintptr_t)hi << 32) | lo));
}
inline void fiber_init(Fiber* f, size_t stack_size) {
  getcontext(&f->uc);
  f->uc.uc_stack.ss_sp = f->stack_lo;
  f->uc.uc_stack.ss_size = stack_top(f, stack_size) - (uintptr_t)f->stack_lo;
  f->uc.uc_link = nullptr;
  uintptr_t p = (uintptr_t)f;
  makecontext(&f->uc, (void (*)())uc_entry, 2, (unsigned)(p & 0xffffffffu),
              (unsigned)(p >> 32));
}
#endif

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------
void set_error(Launch* L, const char* msg) {
  pthread_mutex_lock(&L->err_mu);
  if (!L->has_err) {
    L->has_err = 1;
    snprintf(L->err, L->errlen, "%s", msg);
  }
  pthread_mutex_unlock(&L->err_mu);
  __atomic_store_n(&L->abort, 1, __ATOMIC_RELAXED);
}

// ---------------------------------------------------------------------------
// Scheduling
// ---------------------------------------------------------------------------
inline void rq_push(Worker* w, int i) {
  w->runq[(w->rq_head + w->rq_len) % kMaxThreads] = i;
  w->rq_len++;
}
inline int rq_pop(Worker* w) {
  if (!w->rq_len) return -1;
  int i = w->runq[w->rq_head];
  w->rq_head = (w->rq_head + 1) % kMaxThreads;
  w->rq_len--;
  return i;
}

inline void make_runnable(Worker* w, Fiber* f) {
  f->state = F_RUNNABLE;
  rq_push(w, (int)f->idx);
}

// Runs the collectives waiting in simdgroup `g` for the lanes in `mask`,
// one group per distinct collective function, and wakes the lanes (all but
// `self`, the lane executing this, if it is one of them).
void run_collectives(Worker* w, int g, Fiber* self) {
  SimdGroup& sg = w->sgs[g];
  unsigned arrived = sg.arrived_mask;
  sg.arrived_mask = 0;
  Fiber* base = w->fibers + g * 32;
  msim_coll_fn fn0 = sg.fn[__builtin_ctz(arrived)];
  unsigned same = 0;
  for (unsigned m = arrived; m; m &= m - 1) {
    int l = __builtin_ctz(m);
    if (sg.fn[l] == fn0) same |= 1u << l;
  }
  if (same == arrived) {
    fn0(sg.slot, arrived);  // the common case: one collective for all lanes
  } else {
    // Divergent lanes reached different collectives: one group per function.
    unsigned todo = arrived;
    while (todo) {
      msim_coll_fn fn = sg.fn[__builtin_ctz(todo)];
      unsigned grp = 0;
      for (unsigned m = todo; m; m &= m - 1) {
        int l = __builtin_ctz(m);
        if (sg.fn[l] == fn) grp |= 1u << l;
      }
      fn(sg.slot, grp);
      todo &= ~grp;
    }
  }
  // Woken lanes go to the simdgroup's ready set: the scheduler resumes them
  // before other simdgroups, so a simdgroup runs from collective to
  // collective with its 32 stacks hot in the cache.
  for (unsigned m = arrived; m; m &= m - 1) base[__builtin_ctz(m)].state = F_RUNNABLE;
  unsigned wake = self ? arrived & ~(1u << self->lane) : arrived;
  if (self) self->state = F_RUNNING;
  sg.ready_mask |= wake;
}

void release_barrier(Worker* w) {
  w->bar_count = 0;
  int n = w->nthreads, rev = w->L->d->reversed;
  for (int k = 0; k < n; ++k) {
    Fiber* f = w->fibers + (rev ? n - 1 - k : k);
    if (f->state == F_WAIT_BAR) make_runnable(w, f);
  }
}

// The next fiber to run: a ready lane of simdgroup `g` (lowest lane first,
// highest when reversed), else the run queue, else any simdgroup's ready lane.
inline Fiber* pick_next(Worker* w, int g) {
  int rev = w->L->d->reversed;
  if (g >= 0 && w->sgs[g].ready_mask) {
    unsigned m = w->sgs[g].ready_mask;
    int l = rev ? 31 - __builtin_clz(m) : __builtin_ctz(m);
    w->sgs[g].ready_mask = m & ~(1u << l);
    return w->fibers + g * 32 + l;
  }
  int i = rq_pop(w);
  if (i >= 0) return w->fibers + i;
  for (int k = 0; k < w->nsg; ++k) {
    int h = rev ? w->nsg - 1 - k : k;
    if (w->sgs[h].ready_mask) return pick_next(w, h);
  }
  return nullptr;
}

// Leaves the current fiber (already marked blocked or done) and continues
// with the next runnable fiber, or returns to the threadgroup loop.
inline void schedule_next(Worker* w, Fiber* self) {
  Fiber* to = pick_next(w, (int)self->sg);
  if (to) {
    if (to == self) {  // woken while we were switching away: keep running
      to->state = F_RUNNING;
      return;
    }
    w->cur = to;
    bool fresh = to->state == F_NEW;
    to->state = F_RUNNING;
#if defined(__x86_64__)
    if (fresh) fiber_init(to, w->stack_size);
    switch_fiber(&self->sp, to);
#else
    if (fresh) fiber_init(to, w->stack_size);
    swapcontext(&self->uc, &to->uc);
#endif
  } else {
    w->cur = nullptr;
#if defined(__x86_64__)
    switch_to_main(&self->sp, w);
#else
    swapcontext(&self->uc, &w->main_uc);
#endif
  }
}

extern "C" __attribute__((visibility("hidden"), used)) void msim_fiber_main(
    Fiber* f) {
  Worker* w = f->w;
  w->L->d->thunk(w->L->d->args, f->attrs);
  // Thread finished: it no longer takes part in barriers and collectives.
  f->state = F_DONE;
  w->live--;
  SimdGroup& sg = w->sgs[f->sg];
  sg.live_mask &= ~(1u << f->lane);
  if (sg.arrived_mask && sg.arrived_mask == sg.live_mask)
    run_collectives(w, (int)f->sg, nullptr);
  if (w->bar_count && w->bar_count == w->live) release_barrier(w);
  schedule_next(w, f);
  __builtin_trap();  // a finished fiber is never resumed
}

// Abandons the current threadgroup after a fatal error.
[[noreturn]] void abandon(Worker* w) {
  w->aborted_tg = 1;
  Fiber* f = w->cur;
  w->cur = nullptr;
#if defined(__x86_64__)
  switch_to_main(&f->sp, w);
#else
  swapcontext(&f->uc, &w->main_uc);
#endif
  __builtin_trap();
}

// ---------------------------------------------------------------------------
// Threadgroup execution
// ---------------------------------------------------------------------------
bool ensure_capacity(Worker* w, int n, size_t stack_size) {
  if (w->cap >= n && w->stack_size == stack_size) return true;
  if (w->stacks) munmap(w->stacks, w->stacks_bytes);
  free(w->fibers);
  free(w->attrs);
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  size_t per = stack_size + page;  // + guard page below each stack
  size_t bytes = per * (size_t)n;
  void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mem == MAP_FAILED) {
    w->stacks = nullptr;
    w->fibers = nullptr;
    w->attrs = nullptr;
    w->cap = 0;
    return false;
  }
  w->stacks = (char*)mem;
  w->stacks_bytes = bytes;
  w->stack_size = stack_size;
  w->fibers = (Fiber*)calloc((size_t)n, sizeof(Fiber));
  w->attrs = (msim_attrs*)calloc((size_t)n, sizeof(msim_attrs));
  w->cap = n;
  for (int i = 0; i < n; ++i) {
    char* lo = w->stacks + per * (size_t)i;
    mprotect(lo, page, PROT_NONE);
    w->fibers[i].stack_lo = lo + page;
    w->fibers[i].w = w;
    w->fibers[i].attrs = w->attrs + i;
  }
  return true;
}

void run_threadgroup(Worker* w, unsigned long long tgi) {
  Launch* L = w->L;
  const msim_launch_desc* d = L->d;
  unsigned tgp[3] = {(unsigned)(tgi % L->ntg[0]),
                     (unsigned)((tgi / L->ntg[0]) % L->ntg[1]),
                     (unsigned)(tgi / ((unsigned long long)L->ntg[0] * L->ntg[1]))};
  // Actual threadgroup size: partial at the edges of a non-multiple grid
  // (dispatchThreads semantics); threads outside the grid do not exist.
  unsigned sz[3];
  for (int k = 0; k < 3; ++k) {
    unsigned start = tgp[k] * d->tg[k];
    unsigned rem = d->grid[k] - start;
    sz[k] = rem < d->tg[k] ? rem : d->tg[k];
  }
  int n = (int)(sz[0] * sz[1] * sz[2]);
  unsigned dispatch_n = d->tg[0] * d->tg[1] * d->tg[2];
  w->nthreads = n;
  w->live = n;
  w->bar_count = 0;
  w->nsg = (n + 31) / 32;
  w->rq_head = w->rq_len = 0;
  w->aborted_tg = 0;
  w->arena_used = 0;
  w->epoch++;
  for (int g = 0; g < w->nsg; ++g) {
    int cnt = n - g * 32 < 32 ? n - g * 32 : 32;
    w->sgs[g].live_mask = cnt == 32 ? 0xffffffffu : ((1u << cnt) - 1);
    w->sgs[g].arrived_mask = 0;
    w->sgs[g].ready_mask = 0;
  }
  for (int i = 0; i < n; ++i) {
    Fiber* f = w->fibers + i;
    f->idx = (unsigned)i;
    f->lane = (unsigned)i % 32;
    f->sg = (unsigned)i / 32;
    f->state = F_NEW;
    msim_attrs& a = *f->attrs;
    unsigned lx = (unsigned)i % sz[0], ly = ((unsigned)i / sz[0]) % sz[1],
             lz = (unsigned)i / (sz[0] * sz[1]);
    a.thread_position_in_threadgroup = msim_u32x3{lx, ly, lz};
    a.threadgroup_position_in_grid = msim_u32x3{tgp[0], tgp[1], tgp[2]};
    a.thread_position_in_grid =
        msim_u32x3{tgp[0] * d->tg[0] + lx, tgp[1] * d->tg[1] + ly, tgp[2] * d->tg[2] + lz};
    a.threads_per_threadgroup = msim_u32x3{sz[0], sz[1], sz[2]};
    a.dispatch_threads_per_threadgroup = msim_u32x3{d->tg[0], d->tg[1], d->tg[2]};
    a.threadgroups_per_grid = msim_u32x3{L->ntg[0], L->ntg[1], L->ntg[2]};
    a.threads_per_grid = msim_u32x3{d->grid[0], d->grid[1], d->grid[2]};
    a.grid_size = a.threads_per_grid;
    a.grid_origin = msim_u32x3{0, 0, 0};
    a.thread_index_in_threadgroup = (unsigned)i;
    a.thread_index_in_simdgroup = (unsigned)i % 32;
    a.simdgroup_index_in_threadgroup = (unsigned)i / 32;
    a.simdgroups_per_threadgroup = (unsigned)(n + 31) / 32;
    a.dispatch_simdgroups_per_threadgroup = (dispatch_n + 31) / 32;
    a.thread_execution_width = 32;
    a.threads_per_simdgroup = 32;
    a.thread_index_in_quadgroup = (unsigned)i % 4;
    a.quadgroup_index_in_threadgroup = (unsigned)i / 4;
    a.quadgroups_per_threadgroup = (unsigned)(n + 3) / 4;
    a.dispatch_quadgroups_per_threadgroup = (dispatch_n + 3) / 4;
  }
  for (int k = 0; k < n; ++k) rq_push(w, d->reversed ? n - 1 - k : k);

  for (;;) {
    Fiber* f = pick_next(w, -1);
    if (!f) {
      if (w->live == 0 || w->aborted_tg) break;
      // Nothing runnable: lanes waiting at a collective whose simdgroup
      // mates are elsewhere (barrier, other branch) run it among themselves.
      bool progressed = false;
      for (int g = 0; g < w->nsg; ++g) {
        if (w->sgs[g].arrived_mask) {
          run_collectives(w, g, nullptr);
          progressed = true;
        }
      }
      if (!progressed) {
        char msg[256];
        snprintf(msg, sizeof msg,
                 "metalsim: kernel '%s' deadlocked in threadgroup (%u, %u, %u)",
                 d->kernel_name, tgp[0], tgp[1], tgp[2]);
        set_error(L, msg);
        break;
      }
      continue;
    }
    bool fresh = f->state == F_NEW;
    f->state = F_RUNNING;
    w->cur = f;
    if (fresh) fiber_init(f, w->stack_size);
#if defined(__x86_64__)
    main_to_fiber(w, f);
#else
    swapcontext(&w->main_uc, &f->uc);
#endif
    if (w->aborted_tg) break;
  }
  w->cur = nullptr;
}

// ---------------------------------------------------------------------------
// Faults inside kernels (invalid memory access, fiber stack overflow, integer
// division by zero) become launch errors instead of killing the process: the
// handler abandons the threadgroup and the launch reports the fault. Faults
// outside fibers are passed on to the previous handler.
// ---------------------------------------------------------------------------
constexpr int kNumFaultSignals = 3;
const int kFaultSignals[kNumFaultSignals] = {SIGSEGV, SIGBUS, SIGFPE};
struct sigaction g_old_actions[kNumFaultSignals];

void fault_handler(int sig, siginfo_t* si, void*) {
  Worker* w = tls_worker;
  if (!w || !w->cur) {
    for (int k = 0; k < kNumFaultSignals; ++k)
      if (kFaultSignals[k] == sig) sigaction(sig, &g_old_actions[k], nullptr);
    return;  // the faulting instruction runs again under the previous handler
  }
  Fiber* f = w->cur;
  const msim_attrs& a = *f->attrs;
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  char* addr = (char*)si->si_addr;
  const char* what = "invalid memory access";
  if (sig == SIGFPE) what = "arithmetic fault (integer division by zero?)";
  else if (addr >= f->stack_lo - page && addr < f->stack_lo + 256)
    what = "fiber stack overflow (raise MLX_FLASH_METALSIM_STACK_KB)";
  char msg[640];
  snprintf(msg, sizeof msg,
           "metalsim: %s in kernel '%s' at address %p (thread_position_in_grid=(%u, %u, %u), "
           "threadgroup_position_in_grid=(%u, %u, %u)); check='bounds' reports out-of-bounds "
           "buffer accesses by name",
           what, w->L->d->kernel_name, (void*)addr, a.thread_position_in_grid.x,
           a.thread_position_in_grid.y, a.thread_position_in_grid.z,
           a.threadgroup_position_in_grid.x, a.threadgroup_position_in_grid.y,
           a.threadgroup_position_in_grid.z);
  set_error(w->L, msg);
  abandon(w);
}

void install_fault_handlers() {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = fault_handler;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  for (int k = 0; k < kNumFaultSignals; ++k) sigaction(kFaultSignals[k], &sa, &g_old_actions[k]);
}

void restore_fault_handlers() {
  for (int k = 0; k < kNumFaultSignals; ++k) sigaction(kFaultSignals[k], &g_old_actions[k], nullptr);
}

void run_worker(Worker* w, Launch* L) {
  w->L = L;
  tls_worker = w;
  constexpr size_t kAltStack = 64 * 1024;
  if (!w->altstack) w->altstack = (char*)malloc(kAltStack);
  stack_t ss;
  ss.ss_sp = w->altstack;
  ss.ss_size = kAltStack;
  ss.ss_flags = 0;
  bool alt = w->altstack && sigaltstack(&ss, &w->old_altstack) == 0;
  const msim_launch_desc* d = L->d;
  int need = (int)(d->tg[0] * d->tg[1] * d->tg[2]);
  if (!ensure_capacity(w, need, d->stack_size)) {
    set_error(L, "metalsim: could not allocate fiber stacks");
    if (alt) sigaltstack(&w->old_altstack, nullptr);
    tls_worker = nullptr;
    return;
  }
  if (!w->arena) w->arena = (char*)malloc(65536 + 64);
  for (;;) {
    if (__atomic_load_n(&L->abort, __ATOMIC_RELAXED)) break;
    unsigned long long t = __atomic_fetch_add(&L->next_tg, 1ull, __ATOMIC_RELAXED);
    if (t >= L->total_tg) break;
    run_threadgroup(w, t);
  }
  if (alt) sigaltstack(&w->old_altstack, nullptr);
  tls_worker = nullptr;
}

// ---------------------------------------------------------------------------
// Worker pool: persistent OS threads, woken per launch.
// ---------------------------------------------------------------------------
constexpr int kMaxWorkers = 256;
Worker g_workers[kMaxWorkers];
pthread_t g_threads[kMaxWorkers];
int g_nthreads = 0;  // pool threads started (worker i+1 runs on thread i)
pthread_mutex_t g_launch_mu = PTHREAD_MUTEX_INITIALIZER;
pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
pthread_cond_t g_done_cv = PTHREAD_COND_INITIALIZER;
unsigned long long g_gen = 0;
Launch* g_launch = nullptr;
int g_active = 0;   // pool workers taking part in the current launch
int g_pending = 0;  // of which not finished yet

void* pool_main(void* arg) {
  int id = (int)(intptr_t)arg;  // worker index >= 1
  unsigned long long seen = 0;
  pthread_mutex_lock(&g_mu);
  for (;;) {
    while (g_gen == seen) pthread_cond_wait(&g_cv, &g_mu);
    seen = g_gen;
    if (id > g_active) continue;
    Launch* L = g_launch;
    pthread_mutex_unlock(&g_mu);
    run_worker(&g_workers[id], L);
    pthread_mutex_lock(&g_mu);
    if (--g_pending == 0) pthread_cond_signal(&g_done_cv);
  }
  return nullptr;
}

// After fork() the child has none of the pool threads: forget them (and any
// lock state copied mid-launch) so the child's first launch starts new ones.
void after_fork_in_child() {
  g_nthreads = 0;
  g_active = g_pending = 0;
  g_launch = nullptr;
  pthread_mutex_init(&g_launch_mu, nullptr);
  pthread_mutex_init(&g_mu, nullptr);
  pthread_cond_init(&g_cv, nullptr);
  pthread_cond_init(&g_done_cv, nullptr);
}
pthread_once_t g_atfork_once = PTHREAD_ONCE_INIT;
#if defined(__GLIBC__)
// pthread_atfork itself lives in libc_nonshared.a, which -nostdlib leaves out.
extern "C" int __register_atfork(void (*)(void), void (*)(void), void (*)(void), void*);
void register_atfork() { __register_atfork(nullptr, nullptr, after_fork_in_child, nullptr); }
#else
void register_atfork() { pthread_atfork(nullptr, nullptr, after_fork_in_child); }
#endif

}  // namespace

// ---------------------------------------------------------------------------
// Entry points
// ---------------------------------------------------------------------------
MSIM_EXPORT int msim_rt_launch(const msim_launch_desc* d, char* err, size_t errlen) {
  Launch L;
  memset(&L, 0, sizeof L);
  L.d = d;
  L.err = err;
  L.errlen = errlen;
  pthread_mutex_init(&L.err_mu, nullptr);
  if (errlen) err[0] = 0;
  for (int k = 0; k < 3; ++k) {
    if (d->grid[k] == 0 || d->tg[k] == 0) return 0;  // empty dispatch
    L.ntg[k] = (d->grid[k] + d->tg[k] - 1) / d->tg[k];
  }
  L.total_tg = (unsigned long long)L.ntg[0] * L.ntg[1] * L.ntg[2];
  int nw = d->nworkers < 1 ? 1 : d->nworkers;
  if (nw > kMaxWorkers) nw = kMaxWorkers;
  if ((unsigned long long)nw > L.total_tg) nw = (int)L.total_tg;

  pthread_once(&g_atfork_once, register_atfork);
  pthread_mutex_lock(&g_launch_mu);
  install_fault_handlers();
  int helpers = nw - 1;
  if (helpers > 0) {
    pthread_mutex_lock(&g_mu);
    while (g_nthreads < helpers) {
      int id = g_nthreads + 1;
      if (pthread_create(&g_threads[g_nthreads], nullptr, pool_main,
                         (void*)(intptr_t)id) != 0)
        break;
      pthread_detach(g_threads[g_nthreads]);
      g_nthreads++;
    }
    if (helpers > g_nthreads) helpers = g_nthreads;
    g_launch = &L;
    g_active = helpers;
    g_pending = helpers;
    g_gen++;
    pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
  }
  run_worker(&g_workers[0], &L);
  if (helpers > 0) {
    pthread_mutex_lock(&g_mu);
    while (g_pending > 0) pthread_cond_wait(&g_done_cv, &g_mu);
    g_launch = nullptr;
    pthread_mutex_unlock(&g_mu);
  }
  restore_fault_handlers();
  pthread_mutex_unlock(&g_launch_mu);
  pthread_mutex_destroy(&L.err_mu);
  return L.has_err ? 1 : 0;
}

MSIM_EXPORT void msim_rt_barrier(void) {
  Worker* w = tls_worker;
  Fiber* f = w->cur;
  w->bar_count++;
  if (w->bar_count == w->live) {
    release_barrier(w);
    return;
  }
  f->state = F_WAIT_BAR;
  schedule_next(w, f);
}

MSIM_EXPORT void msim_rt_collective(msim_coll* c) {
  Worker* w = tls_worker;
  Fiber* f = w->cur;
  SimdGroup& sg = w->sgs[f->sg];
  sg.slot[f->lane] = c;
  sg.fn[f->lane] = c->fn;
  sg.arrived_mask |= 1u << f->lane;
  if (sg.arrived_mask == sg.live_mask) {
    run_collectives(w, (int)f->sg, f);  // last to arrive does the work
    return;
  }
  f->state = F_WAIT_COLL;
  schedule_next(w, f);
}

MSIM_EXPORT unsigned msim_rt_lane(void) { return tls_worker->cur->lane; }

MSIM_EXPORT void* msim_rt_tg_alloc(int site, size_t size, size_t align) {
  Worker* w = tls_worker;
  if (site < 0 || site >= kMaxSites) msim_rt_fatal("metalsim: too many threadgroup declarations");
  Site& s = w->sites[site];
  if (s.epoch != w->epoch) {
    // First thread of this threadgroup to reach the declaration allocates;
    // the others get the same memory. Fresh memory is poisoned (0xFF bytes:
    // NaN as float/half/bfloat) so reads before writes show up.
    size_t off = (w->arena_used + align - 1) & ~(align - 1);
    const msim_launch_desc* d = w->L->d;
    if (off + size > d->tg_mem_limit) {
      char msg[512];
      snprintf(msg, sizeof msg,
               "metalsim: kernel '%s' uses more threadgroup memory than Metal "
               "allows: %zu bytes needed (threadgroup array '%s' of %zu bytes), "
               "limit is %zu bytes",
               d->kernel_name, off + size,
               d->tg_names ? d->tg_names[site] : "?", size, d->tg_mem_limit);
      msim_rt_fatal(msg);
    }
    s.epoch = w->epoch;
    s.offset = off;
    w->arena_used = off + size;
    memset(w->arena + off, 0xFF, size);
  }
  return w->arena + s.offset;
}

MSIM_EXPORT void msim_rt_oob(const char* buffer, long long index, long long lo,
                             long long hi, int is_tg) {
  Worker* w = tls_worker;
  const msim_attrs& a = *w->cur->attrs;
  char msg[768];
  snprintf(msg, sizeof msg,
           "metalsim: out-of-bounds access in kernel '%s': %s '%s' index %lld "
           "outside [%lld, %lld) (thread_position_in_grid=(%u, %u, %u), "
           "threadgroup_position_in_grid=(%u, %u, %u))",
           w->L->d->kernel_name, is_tg ? "threadgroup array" : "buffer", buffer,
           index, lo, hi, a.thread_position_in_grid.x, a.thread_position_in_grid.y,
           a.thread_position_in_grid.z, a.threadgroup_position_in_grid.x,
           a.threadgroup_position_in_grid.y, a.threadgroup_position_in_grid.z);
  set_error(w->L, msg);
}

MSIM_EXPORT void msim_rt_fatal(const char* msg) {
  Worker* w = tls_worker;
  set_error(w->L, msg);
  abandon(w);
}

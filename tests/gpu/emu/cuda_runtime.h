/* A tiny CPU emulator of the CUDA features select.cu uses: each block runs on one OS
 * thread (blocks concurrently on a few worker threads), each CUDA thread is a ucontext
 * coroutine; warp intrinsics and __syncthreads are cooperative barriers. Built by
 * tests/gpu/emu/build.sh with -DAMBER_CUDA_EMULATOR; the tests run select.cu's source
 * with it where there is no GPU. */
#pragma once
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <sched.h>
#include <ucontext.h>
#include <atomic>
#include <thread>
#include <vector>
#include <stdlib.h>

typedef int cudaError_t;
typedef void *cudaStream_t;
enum { cudaSuccess = 0 };
static inline cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t) { memset(p, v, n); return 0; }
static inline cudaError_t cudaGetLastError() { return 0; }

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static thread_local

struct emu_dim { unsigned x, y, z; };
struct emu_co { ucontext_t ctx; emu_dim tid; int done; unsigned xgen; char *stack; };
struct emu_warp { int arrived; unsigned gen; uint64_t buf[2][32]; };
enum { EMU_THREADS = 256, EMU_STACK = 1 << 16 };
static thread_local emu_co *emu_cur_p;
static thread_local emu_dim emu_block; /* the block this OS thread runs */
static thread_local ucontext_t emu_sched;
static thread_local emu_warp emu_warps[EMU_THREADS / 32];
static thread_local int emu_blk_arrived;
static thread_local unsigned emu_blk_gen;
static thread_local unsigned long emu_yields;
static emu_dim emu_grid;
#define threadIdx (emu_cur_p->tid)
#define blockIdx emu_block
#define gridDim emu_grid

static inline void emu_yield() {
  if (++emu_yields % 4096 == 0) sched_yield();
  swapcontext(&emu_cur_p->ctx, &emu_sched);
}
static inline uint64_t *emu_exchange(uint64_t v) {
  emu_co *c = emu_cur_p;
  emu_warp &w = emu_warps[c->tid.x / 32];
  int slot = c->xgen & 1;
  w.buf[slot][c->tid.x % 32] = v;
  c->xgen++;
  unsigned g = w.gen;
  if (++w.arrived == 32) { w.arrived = 0; w.gen++; }
  else while (w.gen == g) emu_yield();
  return w.buf[slot];
}
static inline void __syncthreads() {
  unsigned g = emu_blk_gen;
  if (++emu_blk_arrived == EMU_THREADS) { emu_blk_arrived = 0; emu_blk_gen++; }
  else while (emu_blk_gen == g) emu_yield();
}
static inline unsigned __ballot_sync(unsigned, int p) {
  uint64_t *v = emu_exchange(p != 0);
  unsigned b = 0;
  for (int i = 0; i < 32; i++) b |= (unsigned)(v[i] != 0) << i;
  return b;
}
static inline int __any_sync(unsigned m, int p) { return __ballot_sync(m, p) != 0; }
template <class T> static inline T __shfl_sync(unsigned, T v, int src) {
  return (T)emu_exchange((uint64_t)(int64_t)v)[src];
}
template <class T> static inline T __shfl_up_sync(unsigned, T v, int o) {
  uint64_t *a = emu_exchange((uint64_t)(int64_t)v);
  int lane = emu_cur_p->tid.x % 32;
  return lane >= o ? (T)a[lane - o] : v;
}
template <class T> static inline T __shfl_xor_sync(unsigned, T v, int o) {
  return (T)emu_exchange((uint64_t)v)[(emu_cur_p->tid.x % 32) ^ o];
}
static inline int __popc(unsigned v) { return __builtin_popcount(v); }
static inline int __ffs(unsigned v) { return __builtin_ffs((int)v); }
static inline unsigned atomicAdd(unsigned *p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static inline unsigned long long atomicExch(unsigned long long *p, unsigned long long v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
static inline unsigned atomicMax(unsigned *p, unsigned v) {
  unsigned old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
  while (old < v &&
         !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
  return old;
}
static inline float __uint_as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t __float_as_uint(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline long long __double_as_longlong(double d) { long long u; memcpy(&u, &d, 8); return u; }
static inline double __longlong_as_double(long long u) { double d; memcpy(&d, &u, 8); return d; }
static inline float __double2float_rn(double d) { return (float)d; }
static inline float __uint2float_rn(unsigned u) { return (float)u; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __int2float_rn(int i) { return (float)i; }
static inline double __ddiv_rn(double a, double b) { return a / b; }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline double __dmul_rn(double a, double b) { return a * b; }

template <class A> struct emu_job { void (*fn)(A); A a; };
template <class A> static thread_local emu_job<A> *emu_job_p;
template <class A> static void emu_entry() {
  emu_job_p<A>->fn(emu_job_p<A>->a);
  emu_cur_p->done = 1;
  swapcontext(&emu_cur_p->ctx, &emu_sched);
}
template <class A> static void emu_launch(void (*fn)(A), unsigned grid, A a) {
  emu_grid.x = grid; emu_grid.y = emu_grid.z = 1;
  std::atomic<unsigned> next(0);
  const char *e = getenv("EMU_WORKERS");
  unsigned workers = e ? (unsigned)atoi(e) : 3;
  if (workers > grid) workers = grid;
  std::vector<std::thread> ts;
  for (unsigned w = 0; w < workers; w++)
    ts.emplace_back([&]() {
      emu_job<A> job{fn, a};
      emu_job_p<A> = &job;
      std::vector<emu_co> cos(EMU_THREADS);
      for (auto &c : cos) c.stack = (char *)malloc(EMU_STACK);
      for (unsigned b; (b = next.fetch_add(1)) < grid;) {
        emu_block = {b, 0, 0};
        for (int t = 0; t < EMU_THREADS; t++) {
          emu_co &c = cos[t];
          c.tid = {(unsigned)t, 0, 0}; c.done = 0; c.xgen = 0;
          getcontext(&c.ctx);
          c.ctx.uc_stack.ss_sp = c.stack; c.ctx.uc_stack.ss_size = EMU_STACK; c.ctx.uc_link = 0;
          makecontext(&c.ctx, (void (*)())emu_entry<A>, 0);
        }
        memset(emu_warps, 0, sizeof emu_warps);
        emu_blk_arrived = 0;
        for (int left = EMU_THREADS; left;) {
          left = 0;
          for (auto &c : cos) {
            if (c.done) continue;
            emu_cur_p = &c;
            swapcontext(&emu_sched, &c.ctx);
            left += !c.done;
          }
        }
      }
      for (auto &c : cos) free(c.stack);
    });
  for (auto &t : ts) t.join();
}

/*
 * select.cu - libamber_cuda: the accelerator path's selection as one fused CUDA kernel,
 * for the tensors amber.device selects on a GPU (python/amber/device.py holds the
 * contract, which mirrors src/scan.c; python/amber/_cuda.py calls this library).
 *
 * One pass over live and reference selects what src/scan.c would select, compacts it
 * in index order and, in the same pass, writes what a save needs of each selected
 * element: its global index (int64, increasing), its live value and the reference's
 * old value (the bits, by element width), a budget key on request, and (on request)
 * moves the live value into the reference (error feedback: the reference takes what
 * is stored, and only that). The rules, per element:
 *   - exact (every integer and bool tensor too): the bits differ (any width);
 *   - compare: |x - r| > ABS + REL*|r| in f32 for f32, and for f16, bf16, f8 e4m3fn
 *     and f8 e5m2 after their exact conversion to f32 (scan.c's widen()), with the
 *     bound less the smallest subnormal and never below 0; in f64 for f64; a change
 *     to or from NaN or Inf is always selected (forced), a change above CAP too, and
 *     a small float whose NaN encoding changed. The caller passes the bounds already
 *     shrunk as scan.c shrinks them (exact in f32 for all but f64).
 *   - threshold is compare with CAP = Inf; budget's candidate pass is compare with
 *     REL = 0, CAP, and each chunk's own threshold (estimated by the caller from its
 *     sample) from a device array; its key is scan.c's: the f32 bits of the change
 *     (an f64 change clamped to 3e38 first), 0xFFFFFFFF for a forced one, 0 for a
 *     non-finite element that is not forced. The cut and the band fill are left to
 *     the caller (amber._cuda does them with torch operations over the candidates).
 * The arithmetic is written with round-to-nearest intrinsics (__fsub_rn, __fmul_rn,
 * ...), which are never contracted into a fused multiply-add, and the file is built
 * with -fmad=false besides: a fused multiply-add in the bound would round unlike the
 * C path and select other elements. Denormals are kept (-ftz=false).
 *
 * The compaction is a single-pass, order-preserving scan over tiles of TILE elements
 * (THREADS threads, ITEMS elements each, strided so that loads coalesce): each block
 * takes a ticket from a counter so that tiles start in ticket order, flags its tile
 * (the values stay in registers), counts it, publishes the count and looks back over
 * its predecessors' published words (a decoupled look-back: an aggregate, or an
 * inclusive prefix that ends the look-back), publishes its own inclusive prefix and
 * then writes its selected elements at their positions. A tile's word holds its flag
 * and its count together (64 bits, written by one atomic exchange, read by volatile
 * loads), so no fence is needed between them. A tile waits only for tiles that took
 * earlier tickets, which are therefore running: no deadlock whatever the schedule.
 *
 * Outputs are sized by the caller: it passes their capacity (in elements) and gets
 * the number selected in device memory (*count, written even when it exceeds the
 * capacity). Only elements whose position is below the capacity are written and
 * moved into the reference, so after an overflow the caller puts back the olds of
 * the first `capacity` elements (or has not asked for the move), and runs again with
 * a capacity of *count. Scratch (the ticket counter and one word per tile,
 * amber_cuda_scratch_bytes(n) bytes) is the caller's device memory, cleared here
 * with cudaMemsetAsync on the stream, as is *count. Nothing is allocated here and
 * nothing is synchronized: everything is queued on the caller's stream. The library
 * is plain CUDA C with a C ABI, loaded with ctypes and called with raw device
 * pointers (aligned to the element width) and the caller's stream: it is never built
 * against PyTorch.
 *
 * Not yet run on a GPU when it was written: tests/gpu/run.sh checks it against the
 * portable path before amber.device uses it by default.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#define THREADS 256
#define ITEMS 16
#define TILE (THREADS * ITEMS)
#define WARPS (THREADS / 32)
#define SLOTS (ITEMS * WARPS)  /* one count per (item, warp): in index order */
#define PER_LANE (SLOTS / 32)
#define FULL 0xffffffffu

#define EXP32 0x7f800000u
#define EXP64 0x7ff0000000000000ull
#define KEY_FORCED 0xffffffffu

/* a tile's published word: flag in bits 62-63, count in bits 0-61; 0: nothing yet */
#define ST_AGG (1ull << 62) /* the tile's own count */
#define ST_PRE (2ull << 62) /* the inclusive prefix: every tile up to this one */
#define ST_VAL (ST_AGG - 1)

#define AMBER_CUDA_EINVAL 1 /* bad arguments; CUDA errors are returned negated */

enum { KIND_EXACT = 0, KIND_COMPARE = 1 };
/* amber_dtype values (include/amber.h) */
enum { DT_F32 = 1, DT_F16 = 2, DT_BF16 = 3, DT_F64 = 4, DT_E4M3 = 5, DT_E5M2 = 6 };
/* the kernel's comparison, a template argument */
enum { M_EXACT, M_F32, M_F16, M_BF16, M_E4M3, M_E5M2, M_F64 };

extern "C" {
/* One selection (python/amber/_cuda.py mirrors this layout with ctypes). */
typedef struct amber_cuda_args {
  int kind;                /* KIND_EXACT (0) or KIND_COMPARE (1) */
  int dtype;               /* amber_dtype of live and ref */
  int width;               /* bytes per element: 1, 2, 4 or 8 */
  int update;              /* 1: each written element's live value goes into ref */
  const void *live;        /* n elements, device memory */
  void *ref;               /* n elements, device memory (written only with update) */
  uint64_t n;
  double abs_b, rel_b;     /* compare: ABS and REL, shrunk (f32-exact but for f64) */
  double cap_b;            /* compare: CAP, shrunk likewise; Inf for none */
  const double *chunk_abs; /* compare, or NULL: each chunk's ABS instead (device) */
  uint64_t chunk_elems;    /* elements per chunk, with chunk_abs */
  uint64_t capacity;       /* room of each output, in elements */
  int64_t *idx;            /* out: the selected global indices, increasing */
  void *vals;              /* out, or NULL: their live values (width bytes each) */
  void *olds;              /* out, or NULL: the reference's values before */
  uint32_t *keys;          /* out, or NULL: compare: their budget keys */
  uint64_t *count;         /* out, device: how many are selected (even past capacity) */
  void *scratch;           /* device, amber_cuda_scratch_bytes(n) bytes */
  uint64_t scratch_bytes;
} amber_cuda_args;
}

/* ---- one element, as src/scan.c compares it ---- */

/* scan.c's f16_to_f32, exactly (subnormals: man * 2^-24, exact in f32). */
__device__ __forceinline__ float f16_to_f32(uint32_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1f) return __uint_as_float(sign | EXP32 | (man << 13)); /* Inf / NaN */
  if (exp == 0) {
    float v = __fmul_rn(__uint2float_rn(man), 5.9604644775390625e-8f);
    return sign ? -v : v;
  }
  return __uint_as_float(sign | ((exp + 112) << 23) | (man << 13));
}

/* scan.c's e4m3_to_f32 (OCP "fn": no Inf; NaN is S.1111.111). */
__device__ __forceinline__ float e4m3_to_f32(uint32_t b) {
  uint32_t sign = (b >> 7) & 1u, exp = (b >> 3) & 0xfu, man = b & 7u;
  if (exp == 0xf && man == 7) return __uint_as_float(0x7fc00000u | (sign << 31));
  float v = exp == 0 ? __fmul_rn(__uint2float_rn(man), 0.001953125f) /* man * 2^-9 */
                     : __uint_as_float(((exp + 120) << 23) | (man << 20));
  return sign ? -v : v;
}

template <int M> __device__ __forceinline__ float widen(uint32_t b) {
  if (M == M_F16) return f16_to_f32(b);
  if (M == M_BF16) return __uint_as_float(b << 16);
  if (M == M_E4M3) return e4m3_to_f32(b);
  if (M == M_E5M2) return f16_to_f32(b << 8); /* the top byte of an f16 */
  return __uint_as_float(b);
}

/* flags_f32 of src/scan.c for one element: selected, and its key. */
__device__ __forceinline__ bool rule_f32(float x, float r, float abs_f, float rel_f,
                                         float cap_f, uint32_t &key) {
  uint32_t xb = __float_as_uint(x), rb = __float_as_uint(r);
  float d = fabsf(__fsub_rn(x, r));
  /* less the smallest subnormal; NaN (an Inf reference times 0) is not > 0: 0 */
  float b = __fsub_rn(__fadd_rn(abs_f, __fmul_rn(rel_f, fabsf(r))), __uint_as_float(1u));
  b = b > 0.0f ? b : 0.0f;
  bool nf = ((xb & EXP32) == EXP32) || ((rb & EXP32) == EXP32);
  bool forced = (nf && xb != rb) || d > cap_f;
  key = forced ? KEY_FORCED : nf ? 0u : __float_as_uint(d);
  return d > b || forced;
}

/* flags_f64 of src/scan.c for one element. */
__device__ __forceinline__ bool rule_f64(double x, double r, double abs_d, double rel_d,
                                         double cap_d, uint32_t &key) {
  uint64_t xb = (uint64_t)__double_as_longlong(x), rb = (uint64_t)__double_as_longlong(r);
  double d = fabs(__dsub_rn(x, r));
  double b = __dadd_rn(abs_d, __dmul_rn(rel_d, fabs(r)));
  bool nf = ((xb & EXP64) == EXP64) || ((rb & EXP64) == EXP64);
  bool forced = (nf && xb != rb) || d > cap_d;
  float df = d > 3e38 ? 3e38f : __double2float_rn(d);
  key = forced ? KEY_FORCED : nf ? 0u : __float_as_uint(df);
  return d > b || forced;
}

struct bounds {
  float rel_f, cap_f;
  double rel_d, cap_d;
};

/* Whether element (x, r) is selected under mode M with threshold abs_f / abs_d; its
 * key in `key` (compare modes). */
template <int M, typename T>
__device__ __forceinline__ bool pick(T xv, T rv, float abs_f, double abs_d, const bounds &b,
                                     uint32_t &key) {
  key = 0;
  if (M == M_EXACT) return xv != rv;
  if (M == M_F64)
    return rule_f64(__longlong_as_double((long long)xv), __longlong_as_double((long long)rv),
                    abs_d, b.rel_d, b.cap_d, key);
  float x = widen<M>((uint32_t)xv), r = widen<M>((uint32_t)rv);
  bool s = rule_f32(x, r, abs_f, b.rel_f, b.cap_f, key);
  /* distinct NaN encodings of a small float may widen alike: a changed NaN is stored */
  if (M != M_F32 && !s && x != x && xv != rv) {
    key = KEY_FORCED;
    s = true;
  }
  return s;
}

/* ---- the order-preserving single pass ---- */

__device__ __forceinline__ void publish(unsigned long long *word, unsigned long long v) {
  atomicExch(word, v);
}

/* Warp 0 of tile `tile` (> 0): the sum of every earlier tile's count, from the
 * published words of its predecessors (st[t] for tile t): aggregates are added until
 * an inclusive prefix ends the look-back; a word not yet published is waited for. */
__device__ uint64_t look_back(const unsigned long long *st, uint64_t tile, int lane) {
  const volatile unsigned long long *vs = st;
  uint64_t excl = 0;
  int64_t top = (int64_t)tile - 1; /* the nearest predecessor, read by lane 0 */
  for (;;) {
    int64_t j = top - lane;
    unsigned long long w = j >= 0 ? vs[j] : ST_PRE; /* before tile 0: a prefix of 0 */
    if (__any_sync(FULL, (w >> 62) == 0)) {
#if __CUDA_ARCH__ >= 700
      __nanosleep(32);
#endif
      continue;
    }
    unsigned pre = __ballot_sync(FULL, (w >> 62) == 2);
    int stop = pre ? __ffs(pre) - 1 : 31; /* the nearest prefix, or the whole window */
    unsigned long long v = lane <= stop ? (w & ST_VAL) : 0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    excl += v;
    if (pre) return excl;
    top -= 32;
  }
}

template <typename T, int M>
__global__ void __launch_bounds__(THREADS) select_kernel(amber_cuda_args a) {
  __shared__ int slot[SLOTS];
  __shared__ unsigned long long base_s;
  __shared__ unsigned tile_s;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  unsigned long long *scratch = (unsigned long long *)a.scratch;
  unsigned long long *st = scratch + 1; /* scratch[0]: the ticket counter */
  if (tid == 0) tile_s = atomicAdd((unsigned *)scratch, 1u);
  __syncthreads();
  const uint64_t tile = tile_s, n = a.n, first = tile * TILE + (uint64_t)tid;
  const T *live = (const T *)a.live;
  T *ref = (T *)a.ref;
  bounds b;
  b.rel_f = __double2float_rn(a.rel_b); /* exact: the caller's f32 bounds */
  b.cap_f = __double2float_rn(a.cap_b);
  b.rel_d = a.rel_b;
  b.cap_d = a.cap_b;

  /* load and flag: element first + k*THREADS is item k of this thread */
  T xv[ITEMS], rv[ITEMS];
#pragma unroll
  for (int k = 0; k < ITEMS; k++) {
    uint64_t i = first + (uint64_t)k * THREADS;
    xv[k] = 0;
    rv[k] = 0;
    if (i < n) {
      xv[k] = live[i];
      rv[k] = ref[i];
    }
  }
  const bool chunked = a.chunk_abs != NULL && a.chunk_elems != 0;
  uint64_t chunk = 0, next = ~0ull; /* this thread's chunk, and where the next begins */
  if (chunked) {
    chunk = first / a.chunk_elems;
    next = (chunk + 1) * a.chunk_elems;
  }
  float abs_f = __double2float_rn(a.abs_b);
  double abs_d = a.abs_b;
  uint32_t sel = 0;
#pragma unroll
  for (int k = 0; k < ITEMS; k++) {
    uint64_t i = first + (uint64_t)k * THREADS;
    if (i < n) {
      if (chunked && i >= next) {
        while (i >= next) {
          chunk++;
          next += a.chunk_elems;
        }
      }
      if (chunked) {
        abs_d = a.chunk_abs[chunk];
        abs_f = __double2float_rn(abs_d);
      }
      uint32_t key;
      if (pick<M, T>(xv[k], rv[k], abs_f, abs_d, b, key)) sel |= 1u << k;
    }
  }

  /* count: per (item, warp), then an exclusive scan of the SLOTS counts by warp 0 */
#pragma unroll
  for (int k = 0; k < ITEMS; k++) {
    unsigned bal = __ballot_sync(FULL, (sel >> k) & 1u);
    if (lane == 0) slot[k * WARPS + warp] = __popc(bal);
  }
  __syncthreads();
  if (warp == 0) {
    int v[PER_LANE], sum = 0;
#pragma unroll
    for (int q = 0; q < PER_LANE; q++) {
      v[q] = slot[lane * PER_LANE + q];
      sum += v[q];
    }
    int inc = sum;
    for (int o = 1; o < 32; o <<= 1) {
      int t = __shfl_up_sync(FULL, inc, o);
      if (lane >= o) inc += t;
    }
    int run = inc - sum;
#pragma unroll
    for (int q = 0; q < PER_LANE; q++) {
      slot[lane * PER_LANE + q] = run;
      run += v[q];
    }
    uint64_t total = (uint64_t)__shfl_sync(FULL, inc, 31), excl = 0;
    if (tile == 0) {
      if (lane == 0) publish(&st[0], ST_PRE | total);
    } else {
      if (lane == 0) publish(&st[tile], ST_AGG | total);
      excl = look_back(st, tile, lane);
      if (lane == 0) publish(&st[tile], ST_PRE | (excl + total));
    }
    if (lane == 0) {
      base_s = excl;
      if (tile == gridDim.x - 1) *a.count = excl + total;
    }
  }
  __syncthreads();

  /* write: each selected element at its position, in index order */
  const uint64_t base = base_s;
  const unsigned below = (1u << lane) - 1u;
  T *vals = (T *)a.vals, *olds = (T *)a.olds;
#pragma unroll
  for (int k = 0; k < ITEMS; k++) {
    bool f = (sel >> k) & 1u;
    unsigned bal = __ballot_sync(FULL, f);
    if (!f) continue;
    uint64_t pos = base + (uint64_t)slot[k * WARPS + warp] + (uint64_t)__popc(bal & below);
    if (pos >= a.capacity) continue;
    uint64_t i = first + (uint64_t)k * THREADS;
    a.idx[pos] = (int64_t)i;
    if (vals) vals[pos] = xv[k];
    if (olds) olds[pos] = rv[k];
    if (a.keys) {
      uint32_t key; /* the key does not depend on the threshold */
      pick<M, T>(xv[k], rv[k], abs_f, abs_d, b, key);
      a.keys[pos] = key;
    }
    if (a.update) ref[i] = xv[k];
  }
}

/* ---- the C entry points ---- */

static int check(cudaError_t e) {
  return e == cudaSuccess ? 0 : -(int)e;
}

static uint64_t tiles_of(uint64_t n) {
  return (n + TILE - 1) / TILE;
}

static int width_of(int dtype) {
  switch (dtype) {
  case DT_F32: return 4;
  case DT_F64: return 8;
  case DT_F16:
  case DT_BF16: return 2;
  case DT_E4M3:
  case DT_E5M2: return 1;
  default: return 0;
  }
}

template <typename T, int M>
static int launch(const amber_cuda_args *a, uint64_t tiles, cudaStream_t s) {
#ifdef AMBER_CUDA_EMULATOR /* tests/gpu/emu: this source on the CPU, for the tests */
  (void)s;
  emu_launch(select_kernel<T, M>, (unsigned)tiles, *a);
#else
  select_kernel<T, M><<<(unsigned)tiles, THREADS, 0, s>>>(*a);
#endif
  return check(cudaGetLastError());
}

extern "C" {

/* Elements per tile (tests use it for sizes around a tile). */
uint64_t amber_cuda_tile(void) {
  return TILE;
}

/* sizeof(amber_cuda_args): a caller's mirror of it (ctypes) checks its layout. */
uint64_t amber_cuda_args_bytes(void) {
  return sizeof(amber_cuda_args);
}

/* Bytes of scratch device memory that a selection of n elements needs. */
uint64_t amber_cuda_scratch_bytes(uint64_t n) {
  return 8 * (tiles_of(n) + 1);
}

/* Whether (kind, dtype) is selected here: exact for every dtype (by its width),
 * compare for f32, f16, bf16, f64, f8 e4m3fn and f8 e5m2. */
int amber_cuda_supports(int kind, int dtype) {
  return kind == KIND_EXACT || (kind == KIND_COMPARE && width_of(dtype) != 0);
}

/* One fused pass (see the top of this file) on `stream` (a cudaStream_t; NULL: the
 * legacy default stream). Queues two memsets and one kernel and returns at once: 0,
 * AMBER_CUDA_EINVAL (1) for bad arguments (nothing queued), or minus the cudaError_t. */
int amber_cuda_select(const amber_cuda_args *a, void *stream) {
  cudaStream_t s = (cudaStream_t)stream;
  if (!a || !a->count || !amber_cuda_supports(a->kind, a->dtype)) return AMBER_CUDA_EINVAL;
  int w = a->width;
  if (w != 1 && w != 2 && w != 4 && w != 8) return AMBER_CUDA_EINVAL;
  if (a->kind == KIND_COMPARE && w != width_of(a->dtype)) return AMBER_CUDA_EINVAL;
  uint64_t tiles = tiles_of(a->n);
  if (a->n && (!a->live || !a->ref || (a->capacity && !a->idx) || !a->scratch ||
               a->scratch_bytes < amber_cuda_scratch_bytes(a->n) || tiles > 0x7fffffffu ||
               (a->chunk_abs && !a->chunk_elems)))
    return AMBER_CUDA_EINVAL;
  int rc = check(cudaMemsetAsync(a->count, 0, sizeof(uint64_t), s));
  if (rc || !a->n) return rc;
  rc = check(cudaMemsetAsync(a->scratch, 0, amber_cuda_scratch_bytes(a->n), s));
  if (rc) return rc;
  if (a->kind == KIND_EXACT) {
    switch (w) {
    case 1: return launch<uint8_t, M_EXACT>(a, tiles, s);
    case 2: return launch<uint16_t, M_EXACT>(a, tiles, s);
    case 4: return launch<uint32_t, M_EXACT>(a, tiles, s);
    default: return launch<uint64_t, M_EXACT>(a, tiles, s);
    }
  }
  switch (a->dtype) {
  case DT_F32: return launch<uint32_t, M_F32>(a, tiles, s);
  case DT_F16: return launch<uint16_t, M_F16>(a, tiles, s);
  case DT_BF16: return launch<uint16_t, M_BF16>(a, tiles, s);
  case DT_E4M3: return launch<uint8_t, M_E4M3>(a, tiles, s);
  case DT_E5M2: return launch<uint8_t, M_E5M2>(a, tiles, s);
  default: return launch<uint64_t, M_F64>(a, tiles, s);
  }
}

} /* extern "C" */

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

/* One quantization of a compacted selection (python/amber/_cuda.py mirrors it). */
typedef struct amber_cuda_qargs {
  int dtype;            /* amber_dtype of vals and olds: f32, f16, bf16 or f64 */
  int mode;             /* AMBER_QV_*: 1 Q8, 2 Q4, 3 BF16 */
  int budget;           /* 0: a threshold (abs, rel); 1: a budget (cap) */
  int lead;             /* +lead (Q8, Q4) */
  double abs, rel, cap; /* the policy's ABS and REL (threshold), CAP (budget; Inf: none) */
  uint64_t k;           /* selected elements */
  const int64_t *idx;   /* their global indices, increasing (device) */
  const void *vals;     /* their live values, k elements of the dtype (device) */
  const void *olds;     /* the reference's values there, k elements (device) */
  uint64_t chunk_elems; /* element i is in chunk idx[i] / chunk_elems, below nchunks */
  uint64_t nchunks;
  void *ref;            /* NULL, or the reference: ref[idx[i]] takes news[i] */
  void *codes;          /* out: k codes, int8 (Q8, Q4) or bf16 bits (BF16); 0 if escaped */
  uint8_t *esc;         /* out: k flags, 1 for an escape (stored whole) */
  void *news;           /* out: k values the reference takes: restored, or live if escaped */
  float *steps;         /* out, Q8/Q4: each chunk's step (0 for a chunk without elements
                           under a budget) */
  void *scratch;        /* budget Q8/Q4: device, amber_cuda_qscratch_bytes(nchunks) bytes */
  uint64_t scratch_bytes;
} amber_cuda_qargs;
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

/* ---- the quantizer (src/quant.c, function by function) ----
 *
 * After the selection, amber._cuda hands the compacted selection (global indices,
 * live values and the reference's old ones) to amber_cuda_quantize, which follows
 * src/quant.c step by step: per chunk the budget's step from the least and largest
 * finite change (two atomic maxima per element, then one thread per chunk), then per
 * element the code, the lead, the restore (rounded to the dtype), the bound check
 * and the escape, and the reference's move to what a restore decodes (the live value
 * for an escape). Every operation is a round-to-nearest intrinsic, in f32 for f32,
 * f16 and bf16 (widened exactly) and in f64 for f64; nearest codes round half to
 * even (rint); f16 and bf16 round as src/half.h does. */

enum { QV_Q8 = 1, QV_Q4 = 2, QV_BF16 = 3 };
#define QNONE INT32_MIN

/* A quantized policy, as quant.c reads amber__policy, with its f32 constants. */
struct qrule {
  int mode, budget, lead, qmax;
  double abs, rel, cap;
  float a, b;         /* threshold: the step a + b*|r|, a = f32(0.5*ABS), b = f32(0.5*REL) */
  float abs_f, rel_f; /* (float)ABS, (float)REL, for +lead */
  float cap_f;        /* (float)CAP */
};

/* src/half.h's amber__f32_to_bf16: to nearest, ties to even; NaN stays a quiet NaN. */
__device__ __forceinline__ uint32_t f32_to_bf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > EXP32) return (u >> 16) | 0x40u;
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

/* src/half.h's amber__f32_to_f16. */
__device__ __forceinline__ uint32_t f32_to_f16(float f) {
  uint32_t u = __float_as_uint(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > EXP32) return sign | 0x7e00u | ((a >> 13) & 0x3ffu);
  if (a >= 0x477ff000u) return sign | 0x7c00u;
  if (a < 0x38800000u) /* a subnormal f16 in units of 2^-24 (exact scaling), or zero */
    return sign | (uint32_t)rintf(__fmul_rn(__uint_as_float(a), 16777216.0f));
  uint32_t r = a - 0x38000000u;
  r += 0xfffu + ((r >> 13) & 1u);
  return sign | (r >> 13);
}

/* One element widened: live, reference, their change (quant.c's load()). */
struct qel {
  double x, r, d;
};

template <int M, typename T> __device__ __forceinline__ qel qload(T xv, T rv) {
  qel e;
  if (M == M_F64) {
    e.x = __longlong_as_double((long long)xv);
    e.r = __longlong_as_double((long long)rv);
    e.d = __dsub_rn(e.x, e.r);
    return e;
  }
  float x = widen<M>((uint32_t)xv), r = widen<M>((uint32_t)rv);
  e.x = x;
  e.r = r;
  e.d = __fsub_rn(x, r); /* the f32 change, as the codes see it */
  return e;
}

/* codec.h's amber__dequant_f32 / amber__dequant_f64. */
__device__ __forceinline__ float dequant_f32(float r, float a, float b, int32_t code) {
  float s = __fadd_rn(a, __fmul_rn(b, fabsf(r)));
  return __fadd_rn(r, __fmul_rn(__int2float_rn(code), s));
}

__device__ __forceinline__ double dequant_f64(double r, float a, float b, int32_t code) {
  double s = __dadd_rn((double)a, __dmul_rn((double)b, fabs(r)));
  return __dadd_rn(r, __dmul_rn((double)code, s));
}

/* restore(): the restored value under (a, b, code) or the bf16 delta bf, its bits
 * (the dtype's) in *out, its value widened returned. */
template <int M>
__device__ __forceinline__ double qrestore(int mode, double r, float a, float b, int32_t code,
                                           uint32_t bf, uint64_t *out) {
  if (M == M_F64) {
    double v = mode == QV_BF16 ? __dadd_rn(r, (double)__uint_as_float(bf << 16))
                               : dequant_f64(r, a, b, code);
    *out = (uint64_t)__double_as_longlong(v);
    return v;
  }
  float rf = __double2float_rn(r); /* exact: r is a widened f32 */
  float v = mode == QV_BF16 ? __fadd_rn(rf, __uint_as_float(bf << 16))
                            : dequant_f32(rf, a, b, code);
  if (M == M_F32) {
    *out = __float_as_uint(v);
    return v;
  }
  uint32_t h = M == M_BF16 ? f32_to_bf16(v) : f32_to_f16(v);
  *out = h;
  return widen<M>(h);
}

/* within(): v is finite and within the policy's bound of x (threshold: ABS + REL*|v|;
 * budget: CAP), in f64. */
__device__ __forceinline__ bool qwithin(const qrule &q, double x, double v) {
  double bound = q.budget ? q.cap : __dadd_rn(q.abs, __dmul_rn(q.rel, fabs(v)));
  return isfinite(v) && fabs(__dsub_rn(x, v)) <= bound;
}

/* step_of(): a + b*|r| in the restore's arithmetic. */
template <int M> __device__ __forceinline__ double qstep(double r, float a, float b) {
  if (M == M_F64) return __dadd_rn((double)a, __dmul_rn((double)b, fabs(r)));
  return __fadd_rn(a, __fmul_rn(b, fabsf(__double2float_rn(r))));
}

/* code_of(): the nearest code of d in steps of s, or QNONE. */
template <int M> __device__ __forceinline__ int32_t qcode(double d, double s, int32_t qmax) {
  double t = M == M_F64 ? __ddiv_rn(d, s)
                        : (double)__fdiv_rn(__double2float_rn(d), __double2float_rn(s));
  if (!(fabs(t) <= (double)qmax + 0.5)) return QNONE; /* NaN fails too */
  int32_t c = (int32_t)rint(t);                      /* ties to even */
  return c < -qmax || c > qmax ? QNONE : c;
}

/* lead_code(): from the farthest code in the change's direction that the bound could
 * allow back towards c, the first of at most 4 that restores within the bound (a
 * budget's: within its cut too); c when none does. A step that makes the farthest
 * code NaN (an infinite step) tries none. */
template <int M>
__device__ __forceinline__ int32_t qlead(const qrule &q, const qel &e, float a, float b,
                                         float cut, double s, int32_t c) {
  int32_t sgn = e.d > 0 ? 1 : -1;
  double far;
  if (M == M_F64) {
    double ef = q.budget ? (double)cut : __dadd_rn(q.abs, __dmul_rn(q.rel, fabs(e.r)));
    far = __ddiv_rn(__dadd_rn(fabs(e.d), ef), s);
  } else {
    float ef = q.budget ? cut : __fadd_rn(q.abs_f, __fmul_rn(q.rel_f, fabsf((float)e.r)));
    far = __fdiv_rn(__fadd_rn(fabsf((float)e.d), ef), (float)s);
  }
  int32_t f = far >= (double)q.qmax ? q.qmax : far >= 0 ? (int32_t)far : -1;
  uint64_t bits;
  for (int tries = 0; tries < 4 && f > sgn * c; tries++, f--) {
    double v = qrestore<M>(q.mode, e.r, a, b, f * sgn, 0, &bits);
    if (qwithin(q, e.x, v) && (!q.budget || fabs(__dsub_rn(e.x, v)) <= (double)cut))
      return f * sgn;
  }
  return c;
}

/* The arguments of the quantizer's kernels. */
struct qjob {
  amber_cuda_qargs a;
  qrule q;
};

__device__ __forceinline__ uint32_t *qrange_of(const qjob &j) {
  return (uint32_t *)j.a.scratch; /* per chunk: EXP32 - least |d| bits, largest |d| bits */
}

__device__ __forceinline__ float *qcut_of(const qjob &j) {
  return (float *)j.a.scratch + 2 * j.a.nchunks; /* per chunk: the budget's cut */
}

/* budget_step(), first half: each chunk's least and largest finite |change| (f32),
 * gathered with atomic maxima (non-negative floats order as their bits). */
template <typename T, int M> __global__ void __launch_bounds__(THREADS) qrange_kernel(qjob j) {
  const T *live = (const T *)j.a.vals, *old = (const T *)j.a.olds;
  uint32_t *range = qrange_of(j);
  for (uint64_t i = (uint64_t)blockIdx.x * THREADS + threadIdx.x; i < j.a.k;
       i += (uint64_t)gridDim.x * THREADS) {
    qel e = qload<M, T>(live[i], old[i]);
    float ad = __double2float_rn(fabs(e.d));
    if (!isfinite(e.x) || !isfinite(e.r) || !isfinite(ad)) continue;
    uint64_t c = (uint64_t)j.a.idx[i] / j.a.chunk_elems;
    atomicMax(&range[2 * c], EXP32 - __float_as_uint(ad));
    atomicMax(&range[2 * c + 1], __float_as_uint(ad));
  }
}

/* Each chunk's step (budget_step()'s second half for a budget; a for a threshold). */
__global__ void __launch_bounds__(THREADS) qstep_kernel(qjob j) {
  for (uint64_t c = (uint64_t)blockIdx.x * THREADS + threadIdx.x; c < j.a.nchunks;
       c += (uint64_t)gridDim.x * THREADS) {
    if (!j.q.budget) {
      j.a.steps[c] = j.q.a;
      continue;
    }
    const uint32_t *range = qrange_of(j);
    float lo = __uint_as_float(EXP32 - range[2 * c]), hi = __uint_as_float(range[2 * c + 1]);
    if (!isfinite(lo)) lo = 0.0f; /* nothing finite: every element is an escape */
    float s = __fmul_rn(0.5f, lo), m = __fdiv_rn(hi, (float)j.q.qmax);
    s = m > s ? m : s;
    if (s > j.q.cap_f) s = j.q.cap_f;
    j.a.steps[c] = s;
    qcut_of(j)[c] = lo;
  }
}

/* The loop of amber__quantize over the elements, one thread each. */
template <typename T, int M> __global__ void __launch_bounds__(THREADS) quant_kernel(qjob j) {
  const qrule &q = j.q;
  const T *live = (const T *)j.a.vals, *old = (const T *)j.a.olds;
  T *news = (T *)j.a.news, *ref = (T *)j.a.ref;
  for (uint64_t i = (uint64_t)blockIdx.x * THREADS + threadIdx.x; i < j.a.k;
       i += (uint64_t)gridDim.x * THREADS) {
    qel e = qload<M, T>(live[i], old[i]);
    bool ok = isfinite(e.x) && isfinite(e.r) && isfinite(e.d);
    uint64_t bits = 0;
    if (q.mode == QV_BF16) {
      uint32_t c = f32_to_bf16(__double2float_rn(e.d));
      ok = ok && qwithin(q, e.x, qrestore<M>(q.mode, e.r, 0, 0, 0, c, &bits));
      ((uint16_t *)j.a.codes)[i] = (uint16_t)(ok ? c : 0);
    } else {
      uint64_t ch = (uint64_t)j.a.idx[i] / j.a.chunk_elems;
      float a = j.a.steps[ch], b = q.budget ? 0.0f : q.b, cut = q.budget ? qcut_of(j)[ch] : 0;
      double s = qstep<M>(e.r, a, b);
      int32_t c = ok ? qcode<M>(e.d, s, q.qmax) : QNONE;
      if (c != QNONE && q.lead) c = qlead<M>(q, e, a, b, cut, s, c);
      ok = c != QNONE && qwithin(q, e.x, qrestore<M>(q.mode, e.r, a, b, c, 0, &bits));
      ((int8_t *)j.a.codes)[i] = (int8_t)(ok ? c : 0);
    }
    T v = ok ? (T)bits : live[i]; /* an escape: stored whole, the reference takes it */
    j.a.esc[i] = ok ? 0 : 1;
    news[i] = v;
    if (ref) ref[j.a.idx[i]] = v;
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

static unsigned qgrid(uint64_t n) {
  uint64_t g = (n + THREADS - 1) / THREADS;
  return (unsigned)(g < 4096 ? (g ? g : 1) : 4096); /* grid-stride loops do the rest */
}

/* Bytes of a budget's scratch for nchunks chunks: each chunk's range and cut. */
static uint64_t qscratch_bytes(uint64_t nchunks) {
  return 12 * nchunks;
}

template <typename T, int M> static int qlaunch(const qjob &j, cudaStream_t s) {
  const amber_cuda_qargs *a = &j.a;
  if (a->mode != QV_BF16 && a->budget) {
    int rc = check(cudaMemsetAsync(a->scratch, 0, qscratch_bytes(a->nchunks), s));
    if (rc) return rc;
#ifdef AMBER_CUDA_EMULATOR
    emu_launch(qrange_kernel<T, M>, qgrid(a->k), j);
#else
    qrange_kernel<T, M><<<qgrid(a->k), THREADS, 0, s>>>(j);
#endif
  }
  if (a->mode != QV_BF16) {
#ifdef AMBER_CUDA_EMULATOR
    emu_launch(qstep_kernel, qgrid(a->nchunks), j);
#else
    qstep_kernel<<<qgrid(a->nchunks), THREADS, 0, s>>>(j);
#endif
  }
#ifdef AMBER_CUDA_EMULATOR
  emu_launch(quant_kernel<T, M>, qgrid(a->k), j);
#else
  quant_kernel<T, M><<<qgrid(a->k), THREADS, 0, s>>>(j);
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

/* sizeof(amber_cuda_qargs), for a caller's mirror of it. */
uint64_t amber_cuda_qargs_bytes(void) {
  return sizeof(amber_cuda_qargs);
}

/* Bytes of scratch device memory that a budget's quantization of nchunks chunks
 * needs (each chunk's range of changes and its cut). */
uint64_t amber_cuda_qscratch_bytes(uint64_t nchunks) {
  return qscratch_bytes(nchunks);
}

/* Quantizes a compacted selection as src/quant.c does (see "the quantizer" above),
 * on `stream`: fills codes, esc, news and (Q8, Q4) steps, and with ref set moves the
 * reference at the selected indices to news. Queues at most a memset and three
 * kernels and returns at once: 0, AMBER_CUDA_EINVAL (1) for bad arguments (nothing
 * queued), or minus the cudaError_t. */
int amber_cuda_quantize(const amber_cuda_qargs *a, void *stream) {
  cudaStream_t s = (cudaStream_t)stream;
  if (!a || a->mode < QV_Q8 || a->mode > QV_BF16 || (a->lead && a->mode == QV_BF16))
    return AMBER_CUDA_EINVAL;
  if (a->dtype != DT_F32 && a->dtype != DT_F16 && a->dtype != DT_BF16 && a->dtype != DT_F64)
    return AMBER_CUDA_EINVAL;
  if (!a->k) return 0;
  int q8 = a->mode != QV_BF16;
  if (!a->idx || !a->vals || !a->olds || !a->codes || !a->esc || !a->news || !a->chunk_elems ||
      !a->nchunks || (q8 && !a->steps) ||
      (q8 && a->budget &&
       (!a->scratch || a->scratch_bytes < qscratch_bytes(a->nchunks))))
    return AMBER_CUDA_EINVAL;
  qjob j;
  j.a = *a;
  qrule &q = j.q;
  q.mode = a->mode;
  q.budget = a->budget;
  q.lead = a->lead;
  q.qmax = a->mode == QV_Q4 ? 7 : 127;
  q.abs = a->abs;
  q.rel = a->rel;
  q.cap = a->cap;
  q.a = (float)(0.5 * a->abs); /* AMBER__QSTEP_SHARE */
  q.b = (float)(0.5 * a->rel);
  q.abs_f = (float)a->abs;
  q.rel_f = (float)a->rel;
  q.cap_f = (float)a->cap;
  switch (a->dtype) {
  case DT_F32: return qlaunch<uint32_t, M_F32>(j, s);
  case DT_F16: return qlaunch<uint16_t, M_F16>(j, s);
  case DT_BF16: return qlaunch<uint16_t, M_BF16>(j, s);
  default: return qlaunch<uint64_t, M_F64>(j, s);
  }
}

} /* extern "C" */

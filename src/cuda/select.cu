/*
 * select.cu - libamber_cuda: the accelerator path's selection as CUDA kernels, for
 * the tensors amber.device selects on a GPU (python/amber/device.py holds the
 * contract; this is its faster implementation for exact and threshold).
 *
 * Given live and reference on the device, it returns the increasing global indices
 * of the elements that src/scan.c would select: exact compares bits (any width);
 * threshold compares |x - r| > ABS + REL*|r| in f32 for f32, f16 and bf16 (bounds
 * already shrunk by the caller, less the smallest subnormal here, as flags_f32) and
 * in f64 for f64, with a change to or from NaN/Inf always selected. It is built with
 * -fmad=false: a fused multiply-add in the bound would round differently from the
 * C path and select other elements.
 *
 * Two kernels over tiles of TILE elements: count (one flag per element, a count per
 * tile), then, after the caller's exclusive scan of the counts, write (the same
 * flags again, each tile's selected indices in order at its offset). The caller
 * sizes the output exactly from the counts. Both read live and reference once each,
 * coalesced; nothing is allocated here. The library is plain CUDA C with a C ABI,
 * loaded with ctypes and called with raw device pointers and the caller's stream:
 * it is never built against PyTorch.
 *
 * Not yet run on a GPU when it was written: tests/gpu/run.sh checks it against the
 * portable path before amber.device uses it by default.
 */
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#define TILE 2048
#define THREADS 256
#define PER_THREAD (TILE / THREADS)

enum { KIND_EXACT = 0, KIND_THRESHOLD = 1 };
/* amber_dtype values (include/amber.h) */
enum { DT_F32 = 1, DT_F16 = 2, DT_BF16 = 3, DT_F64 = 4 };

struct args {
  int kind, dtype, width;
  const void *live, *ref;
  uint64_t n;
  float abs_f, rel_f;
  double abs_d, rel_d;
};

__device__ __forceinline__ float f16_to_f32(uint16_t h) {
  return __half2float(*reinterpret_cast<const __half *>(&h));
}

__device__ __forceinline__ float bf16_to_f32(uint16_t h) {
  return __uint_as_float((uint32_t)h << 16);
}

/* flags_f32 of src/scan.c for one element (cap: none under threshold) */
__device__ __forceinline__ bool rule_f32(float x, float r, float abs_f, float rel_f) {
  uint32_t xb = __float_as_uint(x), rb = __float_as_uint(r);
  float d = fabsf(__fsub_rn(x, r));
  float b = __fsub_rn(__fadd_rn(abs_f, __fmul_rn(rel_f, fabsf(r))), 1.40129846e-45f);
  b = b > 0.0f ? b : 0.0f;
  bool nf = ((xb & 0x7f800000u) == 0x7f800000u) || ((rb & 0x7f800000u) == 0x7f800000u);
  return d > b || (nf && xb != rb);
}

__device__ __forceinline__ bool rule_f64(double x, double r, double abs_d, double rel_d) {
  uint64_t xb = __double_as_longlong(x), rb = __double_as_longlong(r);
  const uint64_t e = 0x7ff0000000000000ull;
  double d = fabs(__dsub_rn(x, r));
  double b = __dadd_rn(abs_d, __dmul_rn(rel_d, fabs(r)));
  bool nf = ((xb & e) == e) || ((rb & e) == e);
  return d > b || (nf && xb != rb);
}

__device__ __forceinline__ bool selected(const args &a, uint64_t i) {
  if (a.kind == KIND_EXACT) {
    switch (a.width) {
    case 1: return ((const uint8_t *)a.live)[i] != ((const uint8_t *)a.ref)[i];
    case 2: return ((const uint16_t *)a.live)[i] != ((const uint16_t *)a.ref)[i];
    case 4: return ((const uint32_t *)a.live)[i] != ((const uint32_t *)a.ref)[i];
    default: return ((const uint64_t *)a.live)[i] != ((const uint64_t *)a.ref)[i];
    }
  }
  switch (a.dtype) {
  case DT_F32:
    return rule_f32(((const float *)a.live)[i], ((const float *)a.ref)[i], a.abs_f, a.rel_f);
  case DT_F64:
    return rule_f64(((const double *)a.live)[i], ((const double *)a.ref)[i], a.abs_d, a.rel_d);
  default: { /* f16, bf16: widened to f32, as scan.c's widen() */
    uint16_t xh = ((const uint16_t *)a.live)[i], rh = ((const uint16_t *)a.ref)[i];
    float x = a.dtype == DT_F16 ? f16_to_f32(xh) : bf16_to_f32(xh);
    float r = a.dtype == DT_F16 ? f16_to_f32(rh) : bf16_to_f32(rh);
    /* distinct NaN encodings may widen alike: a changed NaN is stored */
    return rule_f32(x, r, a.abs_f, a.rel_f) || (x != x && xh != rh);
  }
  }
}

__global__ void count_kernel(args a, uint32_t *counts) {
  uint64_t start = (uint64_t)blockIdx.x * TILE;
  int c = 0;
  for (int k = 0; k < PER_THREAD; k++) {
    uint64_t i = start + (uint64_t)k * THREADS + threadIdx.x;
    c += i < a.n && selected(a, i);
  }
  for (int o = 16; o > 0; o >>= 1) c += __shfl_down_sync(0xffffffffu, c, o);
  __shared__ int warp[THREADS / 32];
  if ((threadIdx.x & 31) == 0) warp[threadIdx.x >> 5] = c;
  __syncthreads();
  if (threadIdx.x == 0) {
    int t = 0;
    for (int w = 0; w < THREADS / 32; w++) t += warp[w];
    counts[blockIdx.x] = (uint32_t)t;
  }
}

__global__ void write_kernel(args a, const int64_t *offsets, int64_t *out) {
  __shared__ int warp[THREADS / 32];
  uint64_t start = (uint64_t)blockIdx.x * TILE;
  int64_t base = offsets[blockIdx.x];
  int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  for (int k = 0; k < PER_THREAD; k++) {
    uint64_t i = start + (uint64_t)k * THREADS + threadIdx.x;
    bool f = i < a.n && selected(a, i);
    uint32_t ballot = __ballot_sync(0xffffffffu, f);
    if (lane == 0) warp[wid] = __popc(ballot);
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < THREADS / 32; w++) {
      before += w < wid ? warp[w] : 0;
      total += warp[w];
    }
    if (f) out[base + before + __popc(ballot & ((1u << lane) - 1))] = (int64_t)i;
    base += total;
    __syncthreads(); /* warp[] is rewritten by the next step */
  }
}

static int check(cudaError_t e) {
  return e == cudaSuccess ? 0 : -(int)e;
}

static args make(int kind, int dtype, int width, const void *live, const void *ref, uint64_t n,
                 double abs_b, double rel_b) {
  args a;
  a.kind = kind;
  a.dtype = dtype;
  a.width = width;
  a.live = live;
  a.ref = ref;
  a.n = n;
  a.abs_f = (float)abs_b; /* the caller's f32 bounds are exact in float */
  a.rel_f = (float)rel_b;
  a.abs_d = abs_b;
  a.rel_d = rel_b;
  return a;
}

extern "C" {

/* Tiles of a tensor of n elements: the length of the counts and offsets arrays. */
uint64_t amber_cuda_tiles(uint64_t n) {
  return (n + TILE - 1) / TILE;
}

/* Whether (kind, dtype) is one these kernels select: exact for every width,
 * threshold for f32, f16, bf16 and f64. */
int amber_cuda_supports(int kind, int dtype) {
  return kind == KIND_EXACT ||
         (kind == KIND_THRESHOLD &&
          (dtype == DT_F32 || dtype == DT_F16 || dtype == DT_BF16 || dtype == DT_F64));
}

/* Pass 1: counts[t] = elements selected in tile t (amber_cuda_tiles(n) entries).
 * live, ref, counts: device memory; stream: a cudaStream_t (NULL: the default).
 * Returns 0 or minus the cudaError_t of the launch. */
int amber_cuda_count(int kind, int dtype, int width, const void *live, const void *ref,
                     uint64_t n, double abs_b, double rel_b, uint32_t *counts, void *stream) {
  if (!n) return 0;
  args a = make(kind, dtype, width, live, ref, n, abs_b, rel_b);
  count_kernel<<<(unsigned)amber_cuda_tiles(n), THREADS, 0, (cudaStream_t)stream>>>(a, counts);
  return check(cudaGetLastError());
}

/* Pass 2: the selected indices (increasing) into out, tile t's from offsets[t] on
 * (the exclusive scan of pass 1's counts; out holds their sum). */
int amber_cuda_write(int kind, int dtype, int width, const void *live, const void *ref,
                     uint64_t n, double abs_b, double rel_b, const int64_t *offsets,
                     int64_t *out, void *stream) {
  if (!n) return 0;
  args a = make(kind, dtype, width, live, ref, n, abs_b, rel_b);
  write_kernel<<<(unsigned)amber_cuda_tiles(n), THREADS, 0, (cudaStream_t)stream>>>(a, offsets,
                                                                                     out);
  return check(cudaGetLastError());
}

} /* extern "C" */

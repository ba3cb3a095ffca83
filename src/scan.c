/*
 * scan.c - the scan kernel: compare a chunk of live values with the reference
 * state, select what a delta stores, and move the selected elements into the
 * reference, in one pass over both arrays.
 *
 * The chunk is walked in blocks of 256 elements. For each block a flag kernel,
 * written as a plain loop so that the compiler vectorizes it (this file is built
 * with -O3 and the kernels are cloned for AVX2 with run-time dispatch; `make
 * vecreport` shows it), computes one flag per element; a compaction loop then
 * gathers the flagged indices and values while the block is still in L1 and
 * updates the reference. Live and reference memory are read once.
 *
 * Policies (DESIGN.md): exact selects changed bits; threshold selects
 * |x - r| > ABS + REL*|r|; budget selects the FRAC*n largest changes plus all
 * above CAP. Budget finds its cut without sorting: a threshold estimated from a
 * strided sample of the chunk selects a few more candidates than the budget,
 * and, if there are too many, a 12-bit histogram of the candidates' changes
 * picks the exact cut and the surplus is put back into the reference. A change
 * to or from NaN or Inf is always selected. f16, bf16 and f8 compare in f32,
 * f32 compares in f32 with a bound shrunk by 2^-20 so that float rounding can
 * only select more, never less, than the exact rule; f64 compares in f64.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "scan.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) &&                  \
    !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define KERNEL __attribute__((target_clones("avx2", "default")))
#else
#define KERNEL
#endif

#define BLK 256
#define EXP32 0x7f800000u
#define EXP64 0x7ff0000000000000ull
#define SHRINK (1.0 - 1.0 / 1048576.0) /* 1 - 2^-20 */

/* ---- small-float conversions ---- */

static inline float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0x1f) return bits_f32(sign | EXP32 | (man << 13)); /* Inf / NaN */
  if (exp == 0) {
    float v = (float)man * 5.9604644775390625e-8f; /* subnormal: man * 2^-24, exact */
    return sign ? -v : v;
  }
  return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

/* f8 e4m3 (OCP "fn" variant): no Inf; NaN is S.1111.111. */
static inline float e4m3_to_f32(uint8_t b) {
  uint32_t sign = b >> 7, exp = (b >> 3) & 0xf, man = b & 7;
  float v;
  if (exp == 0xf && man == 7) return bits_f32(0x7fc00000u | (sign << 31));
  if (exp == 0) v = (float)man * 0.001953125f; /* man * 2^-9 */
  else v = bits_f32(((exp + 120) << 23) | (man << 20));
  return sign ? -v : v;
}

static void widen(int dtype, const uint8_t *src, float *dst, size_t n) {
  for (size_t i = 0; i < n; i++) {
    uint16_t h;
    switch (dtype) {
    case AMBER_F16:
      memcpy(&h, src + 2 * i, 2);
      dst[i] = f16_to_f32(h);
      break;
    case AMBER_BF16:
      memcpy(&h, src + 2 * i, 2);
      dst[i] = bits_f32((uint32_t)h << 16);
      break;
    case AMBER_F8_E4M3:
      dst[i] = e4m3_to_f32(src[i]);
      break;
    default: /* AMBER_F8_E5M2: the top byte of an f16 */
      dst[i] = f16_to_f32((uint16_t)(src[i] << 8));
      break;
    }
  }
}

double amber__to_f64(int dtype, const void *p) {
  float f = 0;
  if (dtype == AMBER_F64) {
    double d;
    memcpy(&d, p, 8);
    return d;
  }
  if (dtype == AMBER_F32) memcpy(&f, p, 4);
  else widen(dtype, p, &f, 1);
  return f;
}

/* ---- flag kernels over one block ---- */

KERNEL static void flags_exact(const uint8_t *x, const uint8_t *r, uint8_t *sel, size_t m,
                               size_t w) {
  switch (w) {
  case 1:
    for (size_t i = 0; i < m; i++) sel[i] = x[i] != r[i];
    break;
  case 2:
    for (size_t i = 0; i < m; i++) {
      uint16_t a, b;
      memcpy(&a, x + 2 * i, 2);
      memcpy(&b, r + 2 * i, 2);
      sel[i] = a != b;
    }
    break;
  case 4:
    for (size_t i = 0; i < m; i++) {
      uint32_t a, b;
      memcpy(&a, x + 4 * i, 4);
      memcpy(&b, r + 4 * i, 4);
      sel[i] = a != b;
    }
    break;
  default:
    for (size_t i = 0; i < m; i++) {
      uint64_t a, b;
      memcpy(&a, x + 8 * i, 8);
      memcpy(&b, r + 8 * i, 8);
      sel[i] = a != b;
    }
  }
}

/* f32 (or widened): sel = d > thr(r) or a forced change; key = bits of d. */
KERNEL static void flags_f32(const float *x, const float *r, uint8_t *sel, uint32_t *key,
                             size_t m, float abs_, float rel, float cap) {
  for (size_t i = 0; i < m; i++) {
    uint32_t xb, rb, kb;
    memcpy(&xb, &x[i], 4);
    memcpy(&rb, &r[i], 4);
    float d = fabsf(x[i] - r[i]);
    /* Minus the smallest subnormal: near zero, f32 rounding of the bound is a whole
     * unit of 2^-149, not a relative error that the shrink covers; f32 changes
     * are multiples of it, so this never stores a change within the exact bound
     * of a normal-range element. */
    float b = abs_ + rel * fabsf(r[i]) - 0x1p-149f;
    b = b > 0 ? b : 0; /* not fmaxf: that is a libm call that stops vectorization */
    int nf = ((xb & EXP32) == EXP32) | ((rb & EXP32) == EXP32);
    int forced = (nf & (xb != rb)) | (d > cap);
    memcpy(&kb, &d, 4);
    sel[i] = (uint8_t)((d > b) | forced);
    key[i] = forced ? AMBER__KEY_FORCED : nf ? 0 : kb;
  }
}

KERNEL static void flags_f64(const double *x, const double *r, uint8_t *sel, uint32_t *key,
                             size_t m, double abs_, double rel, double cap) {
  for (size_t i = 0; i < m; i++) {
    uint64_t xb, rb;
    memcpy(&xb, &x[i], 8);
    memcpy(&rb, &r[i], 8);
    double d = fabs(x[i] - r[i]);
    double b = abs_ + rel * fabs(r[i]);
    int nf = ((xb & EXP64) == EXP64) | ((rb & EXP64) == EXP64);
    int forced = (nf & (xb != rb)) | (d > cap);
    float df = d > 3e38 ? 3e38f : (float)d;
    uint32_t kb;
    memcpy(&kb, &df, 4);
    sel[i] = (uint8_t)((d > b) | forced);
    key[i] = forced ? AMBER__KEY_FORCED : nf ? 0 : kb;
  }
}

/* ---- the pass ---- */

typedef struct pass {
  const amber__scan_args *a;
  size_t w, k;
  int keep_old; /* budget: remember reference values, the cut may put some back */
} pass;

/* Gathers the flagged elements of block [base, base+m) and moves them into the
 * reference. */
static void compact(pass *p, size_t base, const uint8_t *sel, const uint32_t *key, size_t m) {
  const amber__scan_args *a = p->a;
  const uint8_t *live = (const uint8_t *)a->live + base * p->w;
  uint8_t *ref = (uint8_t *)a->ref + base * p->w;
  size_t w = p->w, k = p->k;
  for (size_t i = 0; i < m; i += 8) {
    uint64_t word = 0;
    size_t left = m - i < 8 ? m - i : 8;
    memcpy(&word, sel + i, left);
    if (!word) continue;
    for (size_t j = i; j < i + left; j++) {
      if (!sel[j]) continue;
      a->idx[k] = (uint32_t)(base + j);
      if (p->keep_old) {
        a->keys[k] = key[j];
        memcpy(a->olds + k * w, ref + j * w, w);
      }
      memcpy(a->vals + k * w, live + j * w, w);
      memcpy(ref + j * w, live + j * w, w);
      k++;
    }
  }
  p->k = k;
}

static int is_small_float(int dtype) {
  return dtype == AMBER_F16 || dtype == AMBER_BF16 || dtype == AMBER_F8_E4M3 ||
         dtype == AMBER_F8_E5M2;
}

/* k-th largest of v[0..n) (0-based), by quickselect; reorders v. */
static float kth_largest(float *v, size_t n, size_t k) {
  size_t lo = 0, hi = n - 1;
  while (lo < hi) {
    float piv = v[lo + (hi - lo) / 2];
    size_t i = lo, j = hi;
    while (i <= j) {
      while (v[i] > piv) i++;
      while (v[j] < piv) j--;
      if (i <= j) {
        float t = v[i];
        v[i] = v[j];
        v[j] = t;
        i++;
        if (j == 0) break;
        j--;
      }
    }
    if (k <= j) hi = j;
    else if (k >= i) lo = i;
    else break;
  }
  return v[k];
}

/* Budget: a threshold that a sample says 1.25x the budget exceeds. The sample is
 * a few contiguous runs spread over the chunk: strided single elements would each
 * cost a cache and TLB miss. */
static double budget_threshold(const amber__scan_args *a, size_t w) {
  enum { RUNS = 8, RUN = 256, S = RUNS * RUN };
  float d[S];
  size_t n = a->n, m = 0;
  for (size_t k = 0; k < RUNS && m < S; k++) {
    size_t start = n <= S ? m : (n - RUN) / (RUNS - 1) * k;
    size_t len = n <= S ? n - m : RUN;
    if (len > S - m) len = S - m;
    if (a->dtype == AMBER_F32) {
      const float *x = (const float *)((const uint8_t *)a->live + start * w);
      const float *r = (const float *)((const uint8_t *)a->ref + start * w);
      for (size_t i = 0; i < len; i++) {
        float x_, r_;
        memcpy(&x_, x + i, 4); /* live may be unaligned */
        memcpy(&r_, r + i, 4);
        float v = fabsf(x_ - r_);
        d[m + i] = isfinite(v) ? v : 0;
      }
    } else {
      for (size_t i = 0; i < len; i++) {
        double v = fabs(amber__to_f64(a->dtype, (const uint8_t *)a->live + (start + i) * w) -
                        amber__to_f64(a->dtype, (const uint8_t *)a->ref + (start + i) * w));
        d[m + i] = isfinite(v) ? (float)v : 0;
      }
    }
    m += len;
    if (n <= S) break;
  }
  size_t want = (size_t)(1.25 * (double)a->budget * (double)m / (double)n);
  if (want == 0) want = 1;
  if (want >= m) return 0;
  /* Just below the k-th largest sampled change, so that equal changes are
   * candidates (the cut removes any surplus); the f32 rounding of an f64 change
   * must not put it above every change. */
  float kth = kth_largest(d, m, want);
  return kth > 0 ? nextafterf(kth, 0) : 0;
}

/* Too many candidates: keep the forced ones and the `budget` largest (by a
 * 12-bit histogram of their keys, ties in the cut bucket in index order); put
 * the others' reference values back. */
static size_t budget_cut(const amber__scan_args *a, size_t k, size_t w) {
  uint32_t hist[4096] = {0};
  for (size_t i = 0; i < k; i++)
    if (a->keys[i] != AMBER__KEY_FORCED) hist[a->keys[i] >> 20]++;
  size_t taken = 0;
  int cut;
  for (cut = 4095; cut >= 0; cut--) {
    if (taken + hist[cut] > a->budget) break;
    taken += hist[cut];
  }
  size_t partial = cut >= 0 ? a->budget - taken : 0, out = 0;
  uint8_t *ref = a->ref;
  for (size_t i = 0; i < k; i++) {
    uint32_t key = a->keys[i];
    int keep = key == AMBER__KEY_FORCED || (int)(key >> 20) > cut;
    if (!keep && (int)(key >> 20) == cut && partial) {
      keep = 1;
      partial--;
    }
    if (keep) {
      a->idx[out] = a->idx[i];
      memmove(a->vals + out * w, a->vals + i * w, w);
      out++;
    } else {
      memcpy(ref + (size_t)a->idx[i] * w, a->olds + i * w, w);
    }
  }
  return out;
}

size_t amber__scan(const amber__scan_args *a) {
  size_t w = amber_dtype_size(a->dtype), n = a->n;
  /* budget may put candidates back; exact callers build XOR payloads from olds */
  pass p = {.a = a, .w = w, .keep_old = a->kind != AMBER__SCAN_THRESHOLD};
  uint8_t sel[BLK];
  uint32_t key[BLK];
  double abs_ = a->abs, rel = a->rel, cap = INFINITY;
  if (a->kind == AMBER__SCAN_BUDGET) {
    if (a->budget >= n) { /* everything fits: a threshold of 0 takes every change */
      abs_ = 0;
    } else {
      abs_ = budget_threshold(a, w);
    }
    rel = 0;
    cap = a->cap;
    if (abs_ > cap) abs_ = cap;
  }
  /* f32 arithmetic may round a change down: shrink bounds so it errs on storing */
  float abs_f = (float)(abs_ * SHRINK), rel_f = (float)(rel * SHRINK);
  float cap_f = isinf(cap) ? INFINITY : (float)(cap * SHRINK);
  if ((double)abs_f > abs_ * SHRINK) abs_f = nextafterf(abs_f, 0);
  if ((double)rel_f > rel * SHRINK) rel_f = nextafterf(rel_f, 0);
  if (!isinf(cap_f) && (double)cap_f > cap * SHRINK) cap_f = nextafterf(cap_f, 0);
  float fx[BLK], fr[BLK];
  double dx[BLK], dr[BLK];
  /* Tensors inside a safetensors file may sit at any address. */
  int aligned = (uintptr_t)a->live % w == 0 && (uintptr_t)a->ref % w == 0;
  for (size_t base = 0; base < n; base += BLK) {
    size_t m = n - base < BLK ? n - base : BLK;
    const uint8_t *x = (const uint8_t *)a->live + base * w;
    const uint8_t *r = (const uint8_t *)a->ref + base * w;
    if (!aligned && (a->dtype == AMBER_F32 || a->dtype == AMBER_F64) &&
        a->kind != AMBER__SCAN_EXACT) {
      memcpy(a->dtype == AMBER_F32 ? (void *)fx : (void *)dx, x, m * w);
      memcpy(a->dtype == AMBER_F32 ? (void *)fr : (void *)dr, r, m * w);
      if (a->dtype == AMBER_F32)
        flags_f32(fx, fr, sel, key, m, abs_f, rel_f, cap_f);
      else
        flags_f64(dx, dr, sel, key, m, abs_, rel, cap);
    } else if (a->kind == AMBER__SCAN_EXACT) {
      flags_exact(x, r, sel, m, w);
    } else if (a->dtype == AMBER_F32) {
      flags_f32((const float *)x, (const float *)r, sel, key, m, abs_f, rel_f, cap_f);
    } else if (a->dtype == AMBER_F64) {
      flags_f64((const double *)x, (const double *)r, sel, key, m, abs_, rel, cap);
    } else if (is_small_float(a->dtype)) {
      widen(a->dtype, x, fx, m);
      widen(a->dtype, r, fr, m);
      flags_f32(fx, fr, sel, key, m, abs_f, rel_f, cap_f);
      /* distinct NaN encodings of small floats may widen to equal bits */
      for (size_t i = 0; i < m; i++)
        if (!sel[i] && isnan(fx[i]) && memcmp(x + i * w, r + i * w, w)) {
          sel[i] = 1;
          key[i] = AMBER__KEY_FORCED;
        }
    } else {
      flags_exact(x, r, sel, m, w); /* integers are always exact */
    }
    compact(&p, base, sel, key, m);
  }
  if (a->kind == AMBER__SCAN_BUDGET && p.k > a->budget) return budget_cut(a, p.k, w);
  return p.k;
}


/*
 * scan.c - the scan kernels: compare a chunk of live values with the reference
 * state, decide which elements a delta stores, copy those into the reference.
 *
 * Each policy has a flag pass that reads live and reference once, written as a
 * plain loop over arrays so that the compiler vectorizes it (this file is built
 * with -O3, and the kernels are cloned for AVX2 with a run-time dispatch; see
 * `make vecreport`), followed by one compaction pass over the flags that skips
 * unselected elements eight at a time. Policies compare f16, bf16 and f8 values
 * in f32 and f32/f64 values in f64, so that the bound test is exact enough to be
 * a guarantee. A change to or from NaN or Inf is always selected.
 */
#include <math.h>
#include <string.h>

#include "scan.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) &&                  \
    !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define KERNEL __attribute__((target_clones("avx2", "default")))
#else
#define KERNEL
#endif

/* ---- small-float conversions ---- */

static inline float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000 | (man << 13)); /* Inf / NaN */
  if (exp == 0) {
    /* zero or subnormal: man * 2^-24, exactly representable in f32 */
    float v = (float)man * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

static inline float bf16_to_f32(uint16_t h) {
  return bits_f32((uint32_t)h << 16);
}

/* f8 e4m3 (OCP "fn" variant): no Inf, NaN is S.1111.111. */
static inline float e4m3_to_f32(uint8_t b) {
  uint32_t sign = b >> 7, exp = (b >> 3) & 0xf, man = b & 7;
  float v;
  if (exp == 0xf && man == 7) return bits_f32(0x7fc00000u | (sign << 31));
  if (exp == 0) v = (float)man * 0.001953125f; /* man * 2^-9 */
  else v = bits_f32(((exp + 120) << 23) | (man << 20));
  return sign ? -v : v;
}

static inline float e5m2_to_f32(uint8_t b) {
  return f16_to_f32((uint16_t)(b << 8));
}

/* Converts n elements of a small float type to f32. */
static void widen(int dtype, const uint8_t *src, float *dst, size_t n) {
  switch (dtype) {
  case AMBER_F16:
    for (size_t i = 0; i < n; i++) {
      uint16_t h;
      memcpy(&h, src + 2 * i, 2);
      dst[i] = f16_to_f32(h);
    }
    break;
  case AMBER_BF16:
    for (size_t i = 0; i < n; i++) {
      uint16_t h;
      memcpy(&h, src + 2 * i, 2);
      dst[i] = bf16_to_f32(h);
    }
    break;
  case AMBER_F8_E4M3:
    for (size_t i = 0; i < n; i++) dst[i] = e4m3_to_f32(src[i]);
    break;
  case AMBER_F8_E5M2:
    for (size_t i = 0; i < n; i++) dst[i] = e5m2_to_f32(src[i]);
    break;
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

/* ---- flag passes ---- */

KERNEL static void flags_exact4(const uint32_t *x, const uint32_t *r, uint8_t *sel, size_t n) {
  for (size_t i = 0; i < n; i++) sel[i] = x[i] != r[i];
}
KERNEL static void flags_exact2(const uint16_t *x, const uint16_t *r, uint8_t *sel, size_t n) {
  for (size_t i = 0; i < n; i++) sel[i] = x[i] != r[i];
}
KERNEL static void flags_exact8(const uint64_t *x, const uint64_t *r, uint8_t *sel, size_t n) {
  for (size_t i = 0; i < n; i++) sel[i] = x[i] != r[i];
}
KERNEL static void flags_exact1(const uint8_t *x, const uint8_t *r, uint8_t *sel, size_t n) {
  for (size_t i = 0; i < n; i++) sel[i] = x[i] != r[i];
}

/* threshold on f32: |x - r| > abs + rel * |r| in double, or a non-finite change. */
KERNEL static void flags_thr_f32(const float *x, const float *r, uint8_t *sel, size_t n,
                                 double abs_, double rel) {
  const uint32_t *xb = (const uint32_t *)x, *rb = (const uint32_t *)r;
  for (size_t i = 0; i < n; i++) {
    double d = fabs((double)x[i] - (double)r[i]);
    double b = abs_ + rel * fabs((double)r[i]);
    int nf = ((xb[i] & 0x7f800000u) == 0x7f800000u) | ((rb[i] & 0x7f800000u) == 0x7f800000u);
    sel[i] = (uint8_t)((d > b) | (nf & (xb[i] != rb[i])));
  }
}

KERNEL static void flags_thr_f64(const double *x, const double *r, uint8_t *sel, size_t n,
                                 double abs_, double rel) {
  const uint64_t *xb = (const uint64_t *)x, *rb = (const uint64_t *)r;
  const uint64_t em = 0x7ff0000000000000ull;
  for (size_t i = 0; i < n; i++) {
    double d = fabs(x[i] - r[i]);
    double b = abs_ + rel * fabs(r[i]);
    int nf = ((xb[i] & em) == em) | ((rb[i] & em) == em);
    sel[i] = (uint8_t)((d > b) | (nf & (xb[i] != rb[i])));
  }
}

/* budget keys: the f32 bits of |x - r| (monotone in the change), with
 * AMBER__KEY_FORCED for changes above `cap` and non-finite changes. */
KERNEL static void keys_f32(const float *x, const float *r, uint32_t *key, size_t n, double cap) {
  const uint32_t *xb = (const uint32_t *)x, *rb = (const uint32_t *)r;
  for (size_t i = 0; i < n; i++) {
    double d = fabs((double)x[i] - (double)r[i]);
    float df = (float)d;
    uint32_t k;
    memcpy(&k, &df, 4);
    int nf = ((xb[i] & 0x7f800000u) == 0x7f800000u) | ((rb[i] & 0x7f800000u) == 0x7f800000u);
    int forced = (d > cap) | (nf & (xb[i] != rb[i]));
    key[i] = forced ? AMBER__KEY_FORCED : (nf ? 0 : k);
  }
}

KERNEL static void keys_f64(const double *x, const double *r, uint32_t *key, size_t n,
                            double cap) {
  const uint64_t *xb = (const uint64_t *)x, *rb = (const uint64_t *)r;
  const uint64_t em = 0x7ff0000000000000ull;
  for (size_t i = 0; i < n; i++) {
    double d = fabs(x[i] - r[i]);
    float df = d > 3e38 ? 3e38f : (float)d;
    uint32_t k;
    memcpy(&k, &df, 4);
    int nf = ((xb[i] & em) == em) | ((rb[i] & em) == em);
    int forced = (d > cap) | (nf & (xb[i] != rb[i]));
    key[i] = forced ? AMBER__KEY_FORCED : (nf ? 0 : k);
  }
}

/* Selects from keys: every forced element, then up to `budget` of the largest
 * changes, found with a histogram on the top 12 bits of the key (sign, exponent
 * and 3 mantissa bits: buckets 12.5% wide), never a sort. Writes sel[]. */
static void select_budget(const uint32_t *key, uint8_t *sel, size_t n, size_t budget) {
  uint32_t hist[4096] = {0};
  for (size_t i = 0; i < n; i++) hist[key[i] >> 20]++;
  hist[AMBER__KEY_FORCED >> 20] = 0; /* forced ones do not count against the budget */
  hist[0] = 0;                        /* nor are tiny changes worth a bucket walk */
  size_t taken = 0;
  int cut = 0;
  for (cut = 4094; cut > 0; cut--) {
    if (taken + hist[cut] > budget) break;
    taken += hist[cut];
  }
  size_t partial = budget - taken; /* taken from the cut bucket, in index order */
  for (size_t i = 0; i < n; i++) {
    uint32_t b = key[i] >> 20;
    int s = key[i] == AMBER__KEY_FORCED || (b > (uint32_t)cut && b < 4095 && key[i] != 0);
    if (!s && b == (uint32_t)cut && cut > 0 && partial) {
      s = 1;
      partial--;
    }
    sel[i] = (uint8_t)s;
  }
}

/* ---- compaction ---- */

/* Gathers selected indices and live values, and copies them into the reference. */
static size_t compact(const uint8_t *sel, const uint8_t *live, uint8_t *ref, size_t n,
                      size_t w, uint32_t *idx, uint8_t *vals) {
  size_t k = 0, i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t word;
    memcpy(&word, sel + i, 8);
    if (!word) continue;
    for (size_t j = i; j < i + 8; j++)
      if (sel[j]) {
        idx[k] = (uint32_t)j;
        memcpy(vals + k * w, live + j * w, w);
        memcpy(ref + j * w, live + j * w, w);
        k++;
      }
  }
  for (; i < n; i++)
    if (sel[i]) {
      idx[k] = (uint32_t)i;
      memcpy(vals + k * w, live + i * w, w);
      memcpy(ref + i * w, live + i * w, w);
      k++;
    }
  return k;
}

static int is_small_float(int dtype) {
  return dtype == AMBER_F16 || dtype == AMBER_BF16 || dtype == AMBER_F8_E4M3 ||
         dtype == AMBER_F8_E5M2;
}

void amber__scan_flags(const amber__scan_args *a) {
  size_t n = a->n, w = amber_dtype_size(a->dtype);
  const uint8_t *x = a->live;
  const uint8_t *r = a->ref;
  if (a->kind == AMBER__SCAN_EXACT) {
    switch (w) {
    case 1: flags_exact1(x, r, a->sel, n); break;
    case 2: flags_exact2((const uint16_t *)x, (const uint16_t *)r, a->sel, n); break;
    case 4: flags_exact4((const uint32_t *)x, (const uint32_t *)r, a->sel, n); break;
    default: flags_exact8((const uint64_t *)x, (const uint64_t *)r, a->sel, n); break;
    }
    return;
  }
  /* Small floats are widened to f32 in blocks that stay in cache. */
  if (is_small_float(a->dtype)) {
    enum { B = 4096 };
    float fx[B], fr[B];
    for (size_t o = 0; o < n; o += B) {
      size_t m = n - o < B ? n - o : B;
      widen(a->dtype, x + o * w, fx, m);
      widen(a->dtype, r + o * w, fr, m);
      if (a->kind == AMBER__SCAN_THRESHOLD) {
        flags_thr_f32(fx, fr, a->sel + o, m, a->abs, a->rel);
        /* the widened values may compare equal while the bits differ (NaN payloads) */
      } else {
        keys_f32(fx, fr, a->keys + o, m, a->cap);
      }
    }
  } else if (a->dtype == AMBER_F32) {
    if (a->kind == AMBER__SCAN_THRESHOLD)
      flags_thr_f32((const float *)x, (const float *)r, a->sel, n, a->abs, a->rel);
    else
      keys_f32((const float *)x, (const float *)r, a->keys, n, a->cap);
  } else {
    if (a->kind == AMBER__SCAN_THRESHOLD)
      flags_thr_f64((const double *)x, (const double *)r, a->sel, n, a->abs, a->rel);
    else
      keys_f64((const double *)x, (const double *)r, a->keys, n, a->cap);
  }
  if (a->kind == AMBER__SCAN_BUDGET) select_budget(a->keys, a->sel, n, a->budget);
}

size_t amber__scan_select(const amber__scan_args *a) {
  return compact(a->sel, a->live, a->ref, a->n, amber_dtype_size(a->dtype), a->idx, a->vals);
}

size_t amber__count_flags(const uint8_t *sel, size_t n) {
  size_t k = 0;
  for (size_t i = 0; i < n; i++) k += sel[i];
  return k;
}

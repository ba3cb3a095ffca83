/*
 * scan.c - the scan kernel: compare a chunk of live values with the reference
 * state, select what a delta stores, and move the selected elements into the
 * reference, in one pass over both arrays.
 *
 * The common case, f32 under threshold or budget, runs as one fused loop on
 * x86-64: AVX-512 (sixteen elements a step, the selected ones compressed into the
 * outputs with masked stores, no branch on the selection) or AVX2 (32
 * elements a step, flags as a bit mask, only set bits visited), chosen at run
 * time. Everything else takes the portable kernels: the chunk is walked in
 * blocks of 256 elements; for each block a flag kernel, written as a plain loop
 * so that the compiler vectorizes it (this file is built with -O3 and the
 * kernels are cloned for AVX2; `make vecreport` shows it), computes one flag per
 * element; a compaction loop, one copy per element width, then gathers the
 * flagged indices and values while the block is still in L1 and updates the
 * reference. Either way live and reference memory are read once, and every
 * path selects exactly the same elements (test_delta_kernels checks it).
 *
 * Policies (docs/DESIGN.md, "Concepts"): exact selects changed bits; threshold selects
 * |x - r| > ABS + REL*|r|; budget selects the FRAC*n largest changes plus all
 * above CAP. Budget finds its cut without sorting: a threshold estimated from a
 * strided sample of the chunk selects a few more candidates than the budget,
 * and, if there are too many, a 12-bit histogram of the candidates' changes
 * picks the exact cut and the surplus is put back into the reference. A change
 * to or from NaN or Inf is always selected. A threshold with a share cap
 * ("/SHARE:MULT") that selected more than SHARE of the chunk keeps the forced
 * ones (beyond MULT bounds, or not finite) and the farthest over their bound by
 * the same histogram cut (share_trim); the others stay in live - reference.
 * f16, bf16 and f8 compare in f32,
 * f32 compares in f32 with a bound shrunk by 2^-20 so that float rounding can
 * only select more, never less, than the exact rule; f64 compares in f64.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "half.h"
#include "scan.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) &&                  \
    !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define KERNEL __attribute__((target_clones("avx2", "default")))
#else
#define KERNEL
#endif

#define BLK 256
#define EXP32 AMBER__EXP32
#define EXP64 0x7ff0000000000000ull
#define SHRINK (1.0 - 1.0 / 1048576.0) /* 1 - 2^-20 */

static size_t share_trim(const amber__scan_args *a, size_t k, size_t w, float *xs, float *rs);

/* ---- small-float conversions ---- */

/* f8 e4m3 (OCP "fn" variant): no Inf; NaN is S.1111.111. */
static inline float e4m3_to_f32(uint8_t b) {
  uint32_t sign = b >> 7, exp = (b >> 3) & 0xf, man = b & 7;
  float v;
  if (exp == 0xf && man == 7) return amber__bits_f32(0x7fc00000u | (sign << 31));
  if (exp == 0) v = (float)man * 0.001953125f; /* man * 2^-9 */
  else v = amber__bits_f32(((exp + 120) << 23) | (man << 20));
  return sign ? -v : v;
}

static void widen(int dtype, const uint8_t *src, float *dst, size_t n) {
  uint16_t h;
  switch (dtype) {
  case AMBER_F16:
    for (size_t i = 0; i < n; i++) {
      memcpy(&h, src + 2 * i, 2);
      dst[i] = amber__f16_to_f32(h);
    }
    break;
  case AMBER_BF16:
    for (size_t i = 0; i < n; i++) {
      memcpy(&h, src + 2 * i, 2);
      dst[i] = amber__bits_f32((uint32_t)h << 16);
    }
    break;
  case AMBER_F8_E4M3:
    for (size_t i = 0; i < n; i++) dst[i] = e4m3_to_f32(src[i]);
    break;
  default: /* AMBER_F8_E5M2: the top byte of an f16 */
    for (size_t i = 0; i < n; i++) dst[i] = amber__f16_to_f32((uint16_t)(src[i] << 8));
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
 * reference; one copy per element width, so that each copy is a single move. The
 * flags are read eight at a time and only set ones are visited. */
#define COMPACT_W(NAME, T)                                                                    \
  static size_t NAME(const amber__scan_args *a, size_t base, const uint8_t *sel,              \
                     const uint32_t *key, size_t m, size_t k, int keep_old) {                 \
    const uint8_t *live = (const uint8_t *)a->live + base * sizeof(T);                        \
    uint8_t *ref = (uint8_t *)a->ref + base * sizeof(T);                                      \
    for (size_t i = 0; i < m; i += 8) {                                                       \
      uint64_t word = 0;                                                                      \
      if (m - i >= 8)                                                                         \
        memcpy(&word, sel + i, 8);                                                            \
      else                                                                                    \
        memcpy(&word, sel + i, m - i);                                                        \
      while (word) {                                                                          \
        size_t j = i + ((size_t)__builtin_ctzll(word) >> 3);                                  \
        T v, o;                                                                               \
        word &= word - 1;                                                                     \
        memcpy(&v, live + j * sizeof(T), sizeof v);                                           \
        a->idx[k] = (uint32_t)(base + j);                                                     \
        if (keep_old) {                                                                       \
          memcpy(&o, ref + j * sizeof(T), sizeof o);                                          \
          memcpy(a->olds + k * sizeof(T), &o, sizeof o);                                      \
          a->keys[k] = key[j];                                                                \
        }                                                                                     \
        memcpy(a->vals + k * sizeof(T), &v, sizeof v);                                        \
        if (!a->defer) memcpy(ref + j * sizeof(T), &v, sizeof v);                             \
        k++;                                                                                  \
      }                                                                                       \
    }                                                                                         \
    return k;                                                                                 \
  }
COMPACT_W(compact1, uint8_t)
COMPACT_W(compact2, uint16_t)
COMPACT_W(compact4, uint32_t)
COMPACT_W(compact8, uint64_t)

static void compact(pass *p, size_t base, const uint8_t *sel, const uint32_t *key, size_t m) {
  switch (p->w) {
  case 1: p->k = compact1(p->a, base, sel, key, m, p->k, p->keep_old); break;
  case 2: p->k = compact2(p->a, base, sel, key, m, p->k, p->keep_old); break;
  case 4: p->k = compact4(p->a, base, sel, key, m, p->k, p->keep_old); break;
  default: p->k = compact8(p->a, base, sel, key, m, p->k, p->keep_old); break;
  }
}

/* ---- the fused f32 kernel (x86-64 with AVX2) ----
 *
 * The common case, an f32 tensor under threshold or budget, in one loop: 32
 * elements per iteration, their flags as a bit mask (movemask), and only the set
 * bits visited, with no flag array in between. It selects exactly what
 * flags_f32 + compact select (test_delta_kernels runs both). */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_F32_AVX2 1

static inline uint32_t f32_key(uint32_t xb, uint32_t rb, float cap) {
  float x = amber__bits_f32(xb), r = amber__bits_f32(rb), d = fabsf(x - r);
  int nf = ((xb & EXP32) == EXP32) | ((rb & EXP32) == EXP32);
  uint32_t kb;
  memcpy(&kb, &d, 4);
  return ((nf & (xb != rb)) | (d > cap)) ? AMBER__KEY_FORCED : nf ? 0 : kb;
}

__attribute__((target("avx2"))) static inline __m256 f32_flags8(const uint8_t *x,
                                                                 const uint8_t *r, __m256 vabs,
                                                                 __m256 vrel) {
  const __m256 sign = _mm256_set1_ps(-0.0f), tiny = _mm256_set1_ps(0x1p-149f);
  const __m256i expo = _mm256_set1_epi32((int)EXP32);
  __m256 vx = _mm256_loadu_ps((const float *)(const void *)x);
  __m256 vr = _mm256_loadu_ps((const float *)(const void *)r);
  __m256 d = _mm256_andnot_ps(sign, _mm256_sub_ps(vx, vr));
  __m256 b = _mm256_add_ps(vabs, _mm256_mul_ps(vrel, _mm256_andnot_ps(sign, vr)));
  b = _mm256_max_ps(_mm256_sub_ps(b, tiny), _mm256_setzero_ps()); /* max(NaN, 0) is 0 */
  __m256i xi = _mm256_castps_si256(vx), ri = _mm256_castps_si256(vr);
  __m256i nf = _mm256_or_si256(_mm256_cmpeq_epi32(_mm256_and_si256(xi, expo), expo),
                               _mm256_cmpeq_epi32(_mm256_and_si256(ri, expo), expo));
  __m256i forced = _mm256_andnot_si256(_mm256_cmpeq_epi32(xi, ri), nf);
  return _mm256_or_ps(_mm256_cmp_ps(d, b, _CMP_GT_OQ), _mm256_castsi256_ps(forced));
}

/* Returns the number selected. abs_, rel and cap are the shrunk f32 bounds;
 * cap (always at or above abs_) only sorts candidates into forced ones. */
__attribute__((target("avx2"))) static size_t scan_f32_avx2(const amber__scan_args *a,
                                                            float abs_, float rel, float cap,
                                                            int keep_old) {
  const uint8_t *x = a->live;
  uint8_t *r = a->ref;
  size_t n = a->n, k = 0, i = 0;
  __m256 vabs = _mm256_set1_ps(abs_), vrel = _mm256_set1_ps(rel);
  uint32_t *idx = a->idx, *keys = a->keys;
  uint8_t *vals = a->vals, *olds = a->olds;
  for (;;) {
    uint32_t mask;
    if (i + 32 <= n) {
      const uint8_t *xp = x + 4 * i, *rp = r + 4 * i;
      mask = (uint32_t)_mm256_movemask_ps(f32_flags8(xp, rp, vabs, vrel)) |
             (uint32_t)_mm256_movemask_ps(f32_flags8(xp + 32, rp + 32, vabs, vrel)) << 8 |
             (uint32_t)_mm256_movemask_ps(f32_flags8(xp + 64, rp + 64, vabs, vrel)) << 16 |
             (uint32_t)_mm256_movemask_ps(f32_flags8(xp + 96, rp + 96, vabs, vrel)) << 24;
    } else if (i < n) {
      /* the tail, through a zero-padded copy; padding never differs */
      uint8_t tx[128] = {0}, tr[128] = {0};
      memcpy(tx, x + 4 * i, 4 * (n - i));
      memcpy(tr, r + 4 * i, 4 * (n - i));
      mask = (uint32_t)_mm256_movemask_ps(f32_flags8(tx, tr, vabs, vrel)) |
             (uint32_t)_mm256_movemask_ps(f32_flags8(tx + 32, tr + 32, vabs, vrel)) << 8 |
             (uint32_t)_mm256_movemask_ps(f32_flags8(tx + 64, tr + 64, vabs, vrel)) << 16 |
             (uint32_t)_mm256_movemask_ps(f32_flags8(tx + 96, tr + 96, vabs, vrel)) << 24;
    } else {
      break;
    }
    while (mask) {
      size_t j = i + (size_t)__builtin_ctz(mask);
      uint32_t v, o;
      mask &= mask - 1;
      memcpy(&v, x + 4 * j, 4);
      memcpy(&o, r + 4 * j, 4);
      idx[k] = (uint32_t)j;
      memcpy(vals + 4 * k, &v, 4);
      if (keep_old) {
        memcpy(olds + 4 * k, &o, 4);
        keys[k] = f32_key(v, o, cap);
      }
      if (!a->defer) memcpy(r + 4 * j, &v, 4);
      k++;
    }
    i += 32;
  }
  return k;
}

/* The same with AVX-512: sixteen elements per step. The selected indices and
 * values (and, for a budget, keys) are compressed into the outputs with masked
 * stores, with no branch on the selection. A threshold moves the selected lanes
 * into the reference with a masked store; a budget leaves the reference alone
 * (its cut then writes only the kept ones, see cut4_avx512), which saves the old
 * values' store. A non-finite change (either side non-finite, or an overflow)
 * is the only lane that needs the full rule: it shows as a non-finite |x - r|,
 * so the common step tests one mask and takes a rarely taken branch. */
__attribute__((target("avx512f"))) static size_t scan_f32_avx512(const amber__scan_args *a,
                                                                 float abs_, float rel,
                                                                 float cap, int budget) {
  const uint8_t *x = a->live;
  uint8_t *r = a->ref;
  size_t n = a->n, k = 0;
  const __m512 vabs = _mm512_set1_ps(abs_), vrel = _mm512_set1_ps(rel),
               vcap = _mm512_set1_ps(cap), tiny = _mm512_set1_ps(0x1p-149f),
               zero = _mm512_setzero_ps();
  const __m512i expo = _mm512_set1_epi32((int)EXP32), absm = _mm512_set1_epi32(0x7fffffff),
                forcedk = _mm512_set1_epi32((int)AMBER__KEY_FORCED),
                lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  /* max(abs - tiny, 0): the bound of every finite reference when rel is 0 */
  const __m512 bconst = _mm512_max_ps(_mm512_sub_ps(vabs, tiny), zero);
  const int use_rel = rel != 0;
  uint32_t *idx = a->idx, *keys = a->keys;
  float *vals = (float *)(void *)a->vals;
  for (size_t i = 0; i < n; i += 16) {
    const float *xp = (const float *)(const void *)(x + 4 * i);
    float *rp = (float *)(void *)(r + 4 * i);
    __m512 vx, vr;
    if (n - i >= 16) { /* a masked load is much slower than a plain one */
      vx = _mm512_loadu_ps(xp);
      vr = _mm512_loadu_ps(rp);
    } else {
      __mmask16 in = (__mmask16)((1u << (n - i)) - 1);
      vx = _mm512_maskz_loadu_ps(in, xp);
      vr = _mm512_maskz_loadu_ps(in, rp);
    }
    __m512i di = _mm512_and_si512(_mm512_castps_si512(_mm512_sub_ps(vx, vr)), absm);
    __m512 d = _mm512_castsi512_ps(di);
    __m512 b = bconst;
    if (use_rel) {
      __m512 ar = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(vr), absm));
      b = _mm512_max_ps(_mm512_sub_ps(_mm512_add_ps(vabs, _mm512_mul_ps(vrel, ar)), tiny), zero);
    }
    __mmask16 sel = _mm512_cmp_ps_mask(d, b, _CMP_GT_OQ), forced = 0;
    if (__builtin_expect(_mm512_cmpeq_epi32_mask(_mm512_and_si512(di, expo), expo) != 0, 0)) {
      /* the full rule: a change to or from NaN/Inf is forced; max(NaN, 0) is 0 */
      __m512i xi = _mm512_castps_si512(vx), ri = _mm512_castps_si512(vr);
      __m512 ar = _mm512_castsi512_ps(_mm512_and_si512(ri, absm));
      b = _mm512_max_ps(_mm512_sub_ps(_mm512_add_ps(vabs, _mm512_mul_ps(vrel, ar)), tiny), zero);
      __mmask16 nf = _mm512_cmpeq_epi32_mask(_mm512_and_si512(xi, expo), expo) |
                     _mm512_cmpeq_epi32_mask(_mm512_and_si512(ri, expo), expo);
      forced = nf & _mm512_cmpneq_epi32_mask(xi, ri);
      sel = _mm512_cmp_ps_mask(d, b, _CMP_GT_OQ) | forced;
    }
    /* no branch on sel: at a few percent selected, a third of the steps select
     * something, and the mispredictions cost more than the stores */
    unsigned c = (unsigned)__builtin_popcount(sel);
    __mmask16 pre = (__mmask16)((1u << c) - 1);
    _mm512_mask_storeu_epi32(idx + k, pre,
                             _mm512_maskz_compress_epi32(sel, _mm512_add_epi32(
                                                                  lanes, _mm512_set1_epi32((int)i))));
    _mm512_mask_storeu_ps(vals + k, pre, _mm512_maskz_compress_ps(sel, vx));
    if (budget) {
      __mmask16 fk = forced | _mm512_cmp_ps_mask(d, vcap, _CMP_GT_OQ);
      __m512i key = _mm512_mask_blend_epi32(fk, di, forcedk);
      _mm512_mask_storeu_epi32(keys + k, pre, _mm512_maskz_compress_epi32(sel, key));
    } else if (!a->defer) {
      _mm512_mask_storeu_ps(rp, sel, vx);
    }
    k += c;
  }
  return k;
}

/* |x - v| <= absb + relb * |v| (and v finite), in f64, for 16 f32 lanes. */
__attribute__((target("avx512f"))) static inline __mmask16 within16(__m512 vx, __m512 v,
                                                                   __m512d absb, __m512d relb) {
  const __m512i absm = _mm512_set1_epi64(0x7fffffffffffffffll);
  __mmask16 m = 0;
  for (int h = 0; h < 2; h++) {
    __m256 xs = _mm512_castps512_ps256(h ? _mm512_shuffle_f32x4(vx, vx, 0xEE) : vx);
    __m256 vs = _mm512_castps512_ps256(h ? _mm512_shuffle_f32x4(v, v, 0xEE) : v);
    __m512d xd = _mm512_cvtps_pd(xs), vd = _mm512_cvtps_pd(vs);
    __m512d e = _mm512_castsi512_pd(
        _mm512_and_si512(_mm512_castpd_si512(_mm512_sub_pd(xd, vd)), absm));
    __m512d av = _mm512_castsi512_pd(_mm512_and_si512(_mm512_castpd_si512(vd), absm));
    __m512d lim = _mm512_add_pd(absb, _mm512_mul_pd(relb, av));
    m |= (__mmask16)(_mm512_cmp_pd_mask(e, lim, _CMP_LE_OQ) << (8 * h));
  }
  const __m512i expo = _mm512_set1_epi32((int)EXP32);
  __m512i vi = _mm512_castps_si512(v);
  return m & _mm512_cmpneq_epi32_mask(_mm512_and_si512(vi, expo), expo);
}

/* scan_f32_avx512 for a threshold with its quantization in the pass (a->fuse), in
 * two phases. The pass over the chunk selects, and packs each selected element's
 * index, live value and reference value (q->xs, q->rs); the coding then runs over
 * the packed elements, sixteen selected ones per step, instead of over every
 * sixteen-lane block that holds one (at a few percent selected, most blocks hold
 * one). Each element gets its code (src/quant.c's rules: step a + b|r|, nearest
 * code, +lead from the farthest code down, at most 4 tries, the bound checked at the
 * restored value in f64) and the reference its restored value (the live one for an
 * escape). Every decision is per element, so the packing changes no result. */
__attribute__((target("avx512f"))) static size_t scan_f32_avx512_q(const amber__scan_args *a,
                                                                   float abs_, float rel) {
  amber__qfuse *q = a->fuse;
  const uint8_t *x = a->live;
  uint8_t *r = a->ref;
  size_t n = a->n, k = 0, nesc = 0;
  const __m512 vabs = _mm512_set1_ps(abs_), vrel = _mm512_set1_ps(rel),
               tiny = _mm512_set1_ps(0x1p-149f), zero = _mm512_setzero_ps(),
               va = _mm512_set1_ps(q->a), vb = _mm512_set1_ps(q->b),
               vaf = _mm512_set1_ps(q->absf), vrf = _mm512_set1_ps(q->relf),
               vqmax = _mm512_set1_ps((float)q->qmax),
               vqlim = _mm512_set1_ps((float)q->qmax + 0.5f), one = _mm512_set1_ps(1.0f),
               mone = _mm512_set1_ps(-1.0f);
  const __m512d absb = _mm512_set1_pd(q->absb), relb = _mm512_set1_pd(q->relb);
  const __m512i expo = _mm512_set1_epi32((int)EXP32), absm = _mm512_set1_epi32(0x7fffffff),
                lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 bconst = _mm512_max_ps(_mm512_sub_ps(vabs, tiny), zero);
  const int use_rel = rel != 0;
  uint32_t *idx = a->idx;
  float *xs = q->xs, *rs = q->rs;
  /* 1: select and pack */
  for (size_t i = 0; i < n; i += 16) {
    const float *xp = (const float *)(const void *)(x + 4 * i);
    const float *rp = (const float *)(const void *)(r + 4 * i);
    __mmask16 in = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
    __m512 vx = _mm512_maskz_loadu_ps(in, xp), vr = _mm512_maskz_loadu_ps(in, rp);
    __m512 d = _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_castps_si512(_mm512_sub_ps(vx, vr)), absm));
    __m512 bnd =
        use_rel ? _mm512_max_ps(
                      _mm512_sub_ps(_mm512_add_ps(vabs, _mm512_mul_ps(vrel, _mm512_castsi512_ps(
                                                                               _mm512_and_si512(
                                                                                   _mm512_castps_si512(vr),
                                                                                   absm)))),
                                    tiny),
                      zero)
                : bconst;
    __m512i xi = _mm512_castps_si512(vx), ri = _mm512_castps_si512(vr);
    __mmask16 fin = _mm512_cmpneq_epi32_mask(_mm512_and_si512(xi, expo), expo) &
                    _mm512_cmpneq_epi32_mask(_mm512_and_si512(ri, expo), expo);
    /* a change to or from NaN/Inf is forced (and an escape) */
    __mmask16 sel = _mm512_cmp_ps_mask(d, bnd, _CMP_GT_OQ) |
                    ((__mmask16)~fin & _mm512_cmpneq_epi32_mask(xi, ri));
    sel &= in;
    if (!sel) continue;
    unsigned cnt = (unsigned)__builtin_popcount(sel);
    __mmask16 pre = (__mmask16)((1u << cnt) - 1);
    _mm512_mask_storeu_epi32(idx + k, pre,
                             _mm512_maskz_compress_epi32(sel, _mm512_add_epi32(
                                                                  lanes, _mm512_set1_epi32((int)i))));
    _mm512_mask_storeu_ps(xs + k, pre, _mm512_maskz_compress_ps(sel, vx));
    _mm512_mask_storeu_ps(rs + k, pre, _mm512_maskz_compress_ps(sel, vr));
    k += cnt;
  }
  if (a->share_k && k > a->share_k) k = share_trim(a, k, 4, xs, rs);
  /* 2: code the packed elements */
  float *ref = (float *)(void *)r;
  for (size_t j = 0; j < k; j += 16) {
    __mmask16 sel = k - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - j)) - 1);
    __m512 vx = _mm512_maskz_loadu_ps(sel, xs + j), vr = _mm512_maskz_loadu_ps(sel, rs + j);
    __m512 ds = _mm512_sub_ps(vx, vr);
    __m512 d = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(ds), absm));
    __m512 ar = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(vr), absm));
    __m512i xi = _mm512_castps_si512(vx), ri = _mm512_castps_si512(vr);
    __mmask16 xfin = _mm512_cmpneq_epi32_mask(_mm512_and_si512(xi, expo), expo),
              rfin = _mm512_cmpneq_epi32_mask(_mm512_and_si512(ri, expo), expo);
    __m512 s = _mm512_add_ps(va, _mm512_mul_ps(vb, ar));
    __m512 t = _mm512_div_ps(ds, s);
    /* + 0: a code of -0 is 0, as the integer codes of quant.c (r + -0*s keeps r = -0) */
    __m512 c = _mm512_add_ps(_mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                             zero);
    __m512 tabs = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(t), absm));
    __m512 cabs = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(c), absm));
    __mmask16 ok = sel & xfin & rfin & _mm512_cmp_ps_mask(tabs, vqlim, _CMP_LE_OQ) &
                   _mm512_cmp_ps_mask(cabs, vqmax, _CMP_LE_OQ);
    c = _mm512_maskz_mov_ps(ok, c);
    __m512 v = _mm512_add_ps(vr, _mm512_mul_ps(c, s));
    if (q->lead && ok) {
      __m512 sg = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(ds, zero, _CMP_GT_OQ), mone, one);
      __m512 e = _mm512_add_ps(vaf, _mm512_mul_ps(vrf, ar));
      __m512 far = _mm512_div_ps(_mm512_add_ps(d, e), s);
      __m512 f = _mm512_min_ps(_mm512_roundscale_ps(far, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC),
                               vqmax);
      cabs = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(c), absm));
      __mmask16 pending = ok & _mm512_cmp_ps_mask(f, cabs, _CMP_GT_OQ);
      for (int tries = 0; tries < 4 && pending; tries++) {
        __m512 cf = _mm512_mul_ps(f, sg);
        __m512 w = _mm512_add_ps(vr, _mm512_mul_ps(cf, s));
        __mmask16 wok = pending & within16(vx, w, absb, relb);
        c = _mm512_mask_mov_ps(c, wok, cf);
        v = _mm512_mask_mov_ps(v, wok, w);
        pending &= (__mmask16)~wok;
        f = _mm512_sub_ps(f, one);
        pending &= _mm512_cmp_ps_mask(f, cabs, _CMP_GT_OQ);
      }
    }
    ok &= within16(vx, v, absb, relb);
    __mmask16 escape = sel & (__mmask16)~ok;
    __m512i ci = _mm512_cvtps_epi32(_mm512_maskz_mov_ps(ok, c)); /* integral: exact */
    _mm512_mask_cvtepi32_storeu_epi8(q->codes + j, sel, ci);
    _mm512_mask_i32scatter_ps(ref, sel, _mm512_maskz_loadu_epi32(sel, idx + j),
                              _mm512_mask_mov_ps(v, escape, vx), 4);
    while (escape) { /* rare: stored whole */
      unsigned l = (unsigned)__builtin_ctz(escape);
      escape &= (__mmask16)(escape - 1);
      q->esc[nesc] = (uint32_t)(j + l);
      memcpy(q->esc_vals + 4 * nesc, xs + j + l, 4);
      nesc++;
    }
  }
  q->nesc = nesc;
  q->done = 1;
  return k;
}

/* After scan_f32_avx512 under a budget that kept every candidate: the reference
 * takes their new values. */
__attribute__((target("avx512f"))) static void put_all_avx512(const amber__scan_args *a,
                                                              size_t k) {
  float *ref = (float *)a->ref;
  const float *vals = (const float *)(const void *)a->vals;
  for (size_t i = 0; i < k; i += 16) {
    __mmask16 in = k - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - i)) - 1);
    _mm512_mask_i32scatter_ps(ref, in, _mm512_maskz_loadu_epi32(in, a->idx + i),
                              _mm512_maskz_loadu_ps(in, vals + i), 4);
  }
}

/* cut4 after scan_f32_avx512: sixteen candidates per step; the kept ones are
 * compressed to the front and their new values scattered into the reference
 * (which still holds every old value). */
__attribute__((target("avx512f"))) static size_t cut4_avx512(const amber__scan_args *a, size_t k,
                                                             int cut, size_t partial) {
  size_t out = 0;
  float *ref = (float *)a->ref, *vals = (float *)(void *)a->vals;
  const __m512i forcedk = _mm512_set1_epi32((int)AMBER__KEY_FORCED),
                vcut = _mm512_set1_epi32(cut);
  for (size_t i = 0; i < k; i += 16) {
    __mmask16 in = k - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - i)) - 1);
    __m512i key = _mm512_maskz_loadu_epi32(in, a->keys + i);
    __m512i bucket = _mm512_srli_epi32(key, 20);
    __mmask16 keep = in & (_mm512_cmpeq_epi32_mask(key, forcedk) |
                           _mm512_cmpgt_epi32_mask(bucket, vcut));
    __mmask16 eq = in & _mm512_cmpeq_epi32_mask(bucket, vcut) & (__mmask16)~keep;
    if (eq && partial) { /* ties of the cut bucket: the first ones in index order */
      unsigned c = (unsigned)__builtin_popcount(eq);
      if (c <= partial) {
        keep |= eq;
        partial -= c;
      } else {
        for (; partial; partial--) {
          __mmask16 low = eq & (__mmask16)-eq;
          keep |= low;
          eq &= (__mmask16)~low;
        }
      }
    }
    __m512i ix = _mm512_maskz_loadu_epi32(in, a->idx + i);
    __m512 v = _mm512_maskz_loadu_ps(in, vals + i);
    if (!a->defer) _mm512_mask_i32scatter_ps(ref, keep, ix, v, 4);
    unsigned c = (unsigned)__builtin_popcount(keep);
    __mmask16 pre = (__mmask16)((1u << c) - 1);
    _mm512_mask_storeu_epi32(a->idx + out, pre, _mm512_maskz_compress_epi32(keep, ix));
    _mm512_mask_storeu_ps(vals + out, pre, _mm512_maskz_compress_ps(keep, v));
    out += c;
  }
  return out;
}

/* 2: AVX-512F, 1: AVX2, 0: neither. */
static int f32_simd_level(void) {
  static int ok = -1;
  int v = __atomic_load_n(&ok, __ATOMIC_RELAXED);
  if (v < 0) {
    __builtin_cpu_init();
    v = __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
    __atomic_store_n(&ok, v, __ATOMIC_RELAXED);
  }
  return v;
}
#endif

static int use_simd = 2;

void amber__scan_use_simd(int level) {
  __atomic_store_n(&use_simd, level, __ATOMIC_RELAXED);
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

/* Budget: a threshold (*thr) that a sample says 1.25x the budget exceeds. The
 * sample is a few contiguous runs spread over the chunk: strided single elements
 * would each cost a cache and TLB miss. Returns 1, with the band (lo, hi] of a
 * cluster, when a strict pass above the cluster and a fill from it are better. */
static int budget_threshold(const amber__scan_args *a, size_t w, double *thr, float band[2]) {
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
  double in_sample = (double)a->budget * (double)m / (double)n;
  size_t want = (size_t)(1.25 * in_sample);
  *thr = 0;
  if (want == 0) want = 1;
  if (want >= m) return 0;
  /* Just below the k-th largest sampled change, so that equal changes are
   * candidates (the cut removes any surplus); the f32 rounding of an f64 change
   * must not put it above every change. */
  float kth = kth_largest(d, m, want);
  *thr = kth > 0 ? nextafterf(kth, 0) : 0;
  if (kth <= 0 || !isfinite(kth)) return 0;
  /* Clusters of (nearly) equal changes are common: bf16, Adam's first steps,
   * sign-based optimizers such as Lion, whose changes are multiples of the
   * learning rate up to rounding. When the sample says that the changes within
   * 2^-10 of the k-th would be four budgets or more, taking them all as
   * candidates would flood the cut: the caller then selects strictly above the
   * cluster and fills up from it, in index order, until the budget is full. */
  float lo = kth * (1.0f - 0x1p-10f), hi = kth * (1.0f + 0x1p-10f);
  size_t near = 0;
  for (size_t i = 0; i < m; i++) near += d[i] > lo && d[i] <= hi;
  if (near >= 8 && (double)near >= 4 * in_sample) {
    band[0] = lo;
    band[1] = hi;
    return 1;
  }
  return 0;
}

/* After a strict pass above band[1] that selected the k candidates a->idx:
 * selects up to `want` more elements whose change lies in the band (band[0],
 * band[1]], first in index order, into tidx/tvals (and the reference), stopping
 * as soon as it has them. Compares in f32, as the pass did. The candidates are
 * skipped by index: a change forced by CAP may lie in the band, and with `defer`
 * the reference still holds its old value there. */
static size_t fill_band(const amber__scan_args *a, size_t w, const float band[2], size_t want,
                        size_t k, uint32_t *tidx, uint8_t *tvals) {
  float fx[BLK], fr[BLK];
  size_t got = 0, c = 0; /* c: the first candidate not below the element */
  const uint8_t *live = a->live;
  uint8_t *ref = a->ref;
  for (size_t base = 0; base < a->n && got < want; base += BLK) {
    size_t m = a->n - base < BLK ? a->n - base : BLK;
    if (a->dtype == AMBER_F32) {
      memcpy(fx, live + base * 4, m * 4);
      memcpy(fr, ref + base * 4, m * 4);
    } else {
      widen(a->dtype, live + base * w, fx, m);
      widen(a->dtype, ref + base * w, fr, m);
    }
    for (size_t i = 0; i < m && got < want; i++) {
      float d = fabsf(fx[i] - fr[i]);
      if (!(d > band[0] && d <= band[1])) continue;
      while (c < k && a->idx[c] < base + i) c++;
      if (c < k && a->idx[c] == base + i) continue;
      tidx[got] = (uint32_t)(base + i);
      memcpy(tvals + got * w, live + (base + i) * w, w);
      /* from the value just read, not from live again: a racing writer must not
       * make the reference differ from what the step stores */
      if (!a->defer) memcpy(ref + (base + i) * w, tvals + got * w, w);
      got++;
    }
  }
  return got;
}

/* Merges the fill run (tidx/tvals, m elements) into the k sorted selections, from
 * the back, so that the indices stay increasing. */
static void merge_fill(const amber__scan_args *a, size_t w, size_t k, const uint32_t *tidx,
                       const uint8_t *tvals, size_t m) {
  size_t i = k, j = m, out = k + m;
  while (j > 0) {
    out--;
    if (i > 0 && a->idx[i - 1] > tidx[j - 1]) {
      i--;
      a->idx[out] = a->idx[i];
      memmove(a->vals + out * w, a->vals + i * w, w);
    } else {
      j--;
      a->idx[out] = tidx[j];
      memcpy(a->vals + out * w, tvals + j * w, w);
    }
  }
}

/* The cut of a 12-bit histogram of keys: the highest bucket whose candidates, with
 * those above it, exceed `budget` (-1: they all fit), and in *partial how many of
 * that bucket still fit (taken in index order). budget_cut and share_trim share it. */
static int hist_cut(const uint32_t hist[4096], size_t budget, size_t *partial) {
  size_t taken = 0;
  int cut;
  for (cut = 4095; cut >= 0; cut--) {
    if (taken + hist[cut] > budget) break;
    taken += hist[cut];
  }
  *partial = cut >= 0 ? budget - taken : 0;
  return cut;
}

/* A threshold's share cap, when the scan selected k > share_k elements: keeps the
 * forced ones (a change beyond MULT bounds, or to or from NaN or Inf) and, of the
 * others, the share_k - forced farthest over their bound (by a 12-bit histogram of
 * the f32 bits of change / bound, ties in the cut bucket in index order, as
 * budget_cut). Decided in f64 for every dtype (the values widen exactly), so that
 * the device path (python/amber/device.py) repeats it bit for bit. The reference is
 * untouched (the scan deferred), so the dropped elements simply stay in
 * live - reference. xs/rs: the fused pass's packed live and reference values (f32),
 * or NULL: the gathered values and the reference at the indices. */
static size_t share_trim(const amber__scan_args *a, size_t k, size_t w, float *xs, float *rs) {
  uint32_t *key = a->keys, hist[4096] = {0};
  size_t nforced = 0;
  for (size_t i = 0; i < k; i++) {
    double x, r;
    if (xs) {
      x = xs[i];
      r = rs[i];
    } else {
      x = amber__to_f64(a->dtype, a->vals + i * w);
      r = amber__to_f64(a->dtype, (const uint8_t *)a->ref + (size_t)a->idx[i] * w);
    }
    double d = fabs(x - r), e = a->abs + a->rel * fabs(r);
    if (!(d <= a->mult * e) || isinf(d)) { /* NaN and Inf on either side, a zero bound */
      key[i] = AMBER__KEY_FORCED;
      nforced++;
      continue;
    }
    float t = (float)(d / e);
    uint32_t b;
    memcpy(&b, &t, 4);
    key[i] = b >> 20;
    hist[key[i]]++;
  }
  size_t partial, out = 0;
  int cut = hist_cut(hist, a->share_k > nforced ? a->share_k - nforced : 0, &partial);
  for (size_t i = 0; i < k; i++) {
    int keep = key[i] == AMBER__KEY_FORCED || (int)key[i] > cut;
    if (!keep && (int)key[i] == cut && partial) {
      keep = 1;
      partial--;
    }
    if (!keep) continue;
    a->idx[out] = a->idx[i];
    if (xs) {
      xs[out] = xs[i];
      rs[out] = rs[i];
    } else if (out != i) {
      memcpy(a->vals + out * w, a->vals + i * w, w);
    }
    out++;
  }
  return out;
}

/* Too many candidates: keep the forced ones and the `budget` largest (by a
 * 12-bit histogram of their keys, ties in the cut bucket in index order); put
 * the others' reference values back. */
#define CUT_W(NAME, T)                                                                        \
  static size_t NAME(const amber__scan_args *a, size_t k, int cut, size_t partial) {          \
    size_t out = 0;                                                                           \
    uint8_t *ref = a->ref;                                                                    \
    for (size_t i = 0; i < k; i++) {                                                          \
      uint32_t key = a->keys[i];                                                              \
      int bucket = (int)(key >> 20);                                                          \
      int keep = key == AMBER__KEY_FORCED || bucket > cut;                                    \
      if (!keep && bucket == cut && partial) {                                                \
        keep = 1;                                                                             \
        partial--;                                                                            \
      }                                                                                       \
      T v;                                                                                    \
      if (keep) {                                                                             \
        memcpy(&v, a->vals + i * sizeof(T), sizeof v);                                        \
        memcpy(a->vals + out * sizeof(T), &v, sizeof v);                                      \
        a->idx[out++] = a->idx[i];                                                            \
      } else {                                                                                \
        memcpy(&v, a->olds + i * sizeof(T), sizeof v);                                        \
        memcpy(ref + (size_t)a->idx[i] * sizeof(T), &v, sizeof v);                            \
      }                                                                                       \
    }                                                                                         \
    return out;                                                                               \
  }
CUT_W(cut1, uint8_t)
CUT_W(cut2, uint16_t)
CUT_W(cut4, uint32_t)
CUT_W(cut8, uint64_t)

static size_t budget_cut(const amber__scan_args *a, size_t k, size_t w, int level) {
  uint32_t hist[4096] = {0};
  for (size_t i = 0; i < k; i++)
    if (a->keys[i] != AMBER__KEY_FORCED) hist[a->keys[i] >> 20]++;
  size_t partial;
  int cut = hist_cut(hist, a->budget, &partial);
#ifdef HAVE_F32_AVX2
  if (w == 4 && level == 2) return cut4_avx512(a, k, cut, partial);
#else
  (void)level;
#endif
  switch (w) {
  case 1: return cut1(a, k, cut, partial);
  case 2: return cut2(a, k, cut, partial);
  case 4: return cut4(a, k, cut, partial);
  default: return cut8(a, k, cut, partial);
  }
}

/* A budget's end of the scan: cut the surplus, or after a strict pass fill up
 * from the band. The fill's indices and values go through keys and
 * olds, which a budget without a cut no longer needs. */
static size_t finish(const amber__scan_args *a, size_t k, size_t w, int level, int strict,
                     const float band[2]) {
  if (a->kind != AMBER__SCAN_BUDGET)
    return a->share_k && k > a->share_k ? share_trim(a, k, w, NULL, NULL) : k;
  if (k > a->budget) return budget_cut(a, k, w, level);
#ifdef HAVE_F32_AVX2
  if (level == 2 && !a->defer) put_all_avx512(a, k); /* its pass left the reference alone */
#endif
  if (strict && k < a->budget) {
    size_t m = fill_band(a, w, band, a->budget - k, k, a->keys, a->olds);
    merge_fill(a, w, k, a->keys, a->olds, m);
    k += m;
  }
  return k;
}

size_t amber__scan(const amber__scan_args *a) {
  size_t w = amber_dtype_size(a->dtype), n = a->n;
  /* budget may put candidates back; exact callers build XOR payloads from olds */
  pass p = {.a = a, .w = w, .keep_old = a->kind != AMBER__SCAN_THRESHOLD};
  uint8_t sel[BLK];
  uint32_t key[BLK];
  double abs_ = a->abs, rel = a->rel, cap = INFINITY;
  float band[2] = {0, 0};
  int strict = 0; /* budget: only changes above band[1], then fill_band */
  if (a->kind == AMBER__SCAN_BUDGET) {
    if (a->budget >= n) { /* everything fits: a threshold of 0 takes every change */
      abs_ = 0;
    } else {
      strict = budget_threshold(a, w, &abs_, band);
    }
    rel = 0;
    cap = a->cap;
    if (abs_ > cap || band[1] > cap) {
      abs_ = abs_ > cap ? cap : abs_;
      strict = 0;
    }
    if (a->dtype == AMBER_F64) strict = 0; /* f64 compares in f64, not in the band */
  }
  /* f32 arithmetic may round a change down: shrink bounds so it errs on storing */
  float abs_f = (float)(abs_ * SHRINK), rel_f = (float)(rel * SHRINK);
  float cap_f = isinf(cap) ? INFINITY : (float)(cap * SHRINK);
  if ((double)abs_f > abs_ * SHRINK) abs_f = nextafterf(abs_f, 0);
  if (strict) abs_f = band[1]; /* a budget needs no margin: its bound is CAP */
  if ((double)rel_f > rel * SHRINK) rel_f = nextafterf(rel_f, 0);
  if (!isinf(cap_f) && (double)cap_f > cap * SHRINK) cap_f = nextafterf(cap_f, 0);
#ifdef HAVE_F32_AVX2
  int level = a->dtype == AMBER_F32 && a->kind != AMBER__SCAN_EXACT ? f32_simd_level() : 0;
  if (level > __atomic_load_n(&use_simd, __ATOMIC_RELAXED))
    level = __atomic_load_n(&use_simd, __ATOMIC_RELAXED);
  if (level == 2 && a->fuse && a->fuse->xs && a->fuse->rs && a->defer &&
      a->kind == AMBER__SCAN_THRESHOLD)
    return scan_f32_avx512_q(a, abs_f, rel_f);
  if (level) {
    p.k = level == 2 ? scan_f32_avx512(a, abs_f, rel_f, cap_f, a->kind == AMBER__SCAN_BUDGET)
                     : scan_f32_avx2(a, abs_f, rel_f, cap_f, p.keep_old);
    return finish(a, p.k, w, level, strict, band);
  }
#endif
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
  return finish(a, p.k, w, 0, strict, band);
}


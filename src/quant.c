/*
 * quant.c - the quantizer of a delta chunk (docs/FORMAT.md, "Quantized sparse
 * body"; docs/DESIGN.md, "Quantized deltas").
 *
 * A stored change costs its value's bits plus its index's. Under a quantized
 * policy a selected element stores, instead of its new value, a small integer
 * code: the change divided by a step, rounded. The reference then moves to what
 * a restore decodes (reference + code * step), not to the live value, so the
 * rounding error stays in live - reference and is stored later once it matters:
 * error feedback, as for the elements a policy leaves out. Each element's
 * restored value is checked against the policy's bound; one that a code cannot
 * carry within it (a change too large for the codes, a NaN or Inf on either side,
 * a step that rounds badly) is stored whole, an "escape".
 *
 * Steps: a threshold policy's step is AMBER__QSTEP_SHARE of the element's own
 * bound (ABS + REL * |reference|), one pair (a, b) for the chunk, so that every
 * element is coded in units of what the policy tolerates for it. A budget has no
 * bound of its own below CAP, but each save has its cut: the least change it
 * selected. It is coded as a threshold at its cut: step AMBER__QSTEP_SHARE of the
 * cut, or the largest change over the largest code if that is more (so that no
 * change overflows the codes), at most CAP; one step for the chunk. With "+lead"
 * the code is the one farthest in the change's direction that still restores
 * within the bound (a budget: within its cut, and CAP): for a quantity that drifts
 * one way (a weight under a steady update, a decaying second moment), the restored
 * value is then ahead of the live one as often as behind, instead of always
 * behind, and the next store comes later.
 *
 * Every decision is made with single IEEE operations in a fixed order (f32, or
 * f64 for f64 tensors), so the device path (python/amber/device.py) and the CUDA
 * kernel (src/cuda/select.cu), which follow this file step by step, store the
 * same codes and move their references to the same bits.
 */
#include <math.h>
#include <string.h>

#include "quant.h"

/* The most a code may be (Q8: 127, Q4: 7); -qmax is the least. */
static int32_t qmax_of(int mode) {
  return mode == AMBER__QV_Q4 ? 7 : 127;
}

/* One element, widened: live, reference, their change. */
typedef struct qel {
  double x, r, d;
} qel;

static qel load(int dtype, const uint8_t *live, const uint8_t *ref) {
  qel e;
  if (dtype == AMBER_F64) {
    memcpy(&e.x, live, 8);
    memcpy(&e.r, ref, 8);
    e.d = e.x - e.r;
    return e;
  }
  float x, r;
  if (dtype == AMBER_F32) {
    memcpy(&x, live, 4);
    memcpy(&r, ref, 4);
  } else {
    uint16_t hx, hr;
    memcpy(&hx, live, 2);
    memcpy(&hr, ref, 2);
    x = dtype == AMBER_BF16 ? amber__bf16_to_f32(hx) : amber__f16_to_f32(hx);
    r = dtype == AMBER_BF16 ? amber__bf16_to_f32(hr) : amber__f16_to_f32(hr);
  }
  e.x = x;
  e.r = r;
  e.d = (double)(x - r); /* the f32 change, as the codes see it */
  return e;
}

/* The restored value of an element with reference r under (a, b, code) or a bf16
 * delta, in the tensor's dtype: its bits into out, its value returned widened. */
static double restore(int dtype, int mode, double r, float a, float b, int32_t code,
                      uint16_t bf, uint8_t *out) {
  if (dtype == AMBER_F64) {
    double v = mode == AMBER__QV_BF16 ? r + (double)amber__bf16_to_f32(bf)
                                      : amber__dequant_f64(r, a, b, code);
    memcpy(out, &v, 8);
    return v;
  }
  float rf = (float)r;
  float v = mode == AMBER__QV_BF16 ? rf + amber__bf16_to_f32(bf)
                                   : amber__dequant_f32(rf, a, b, code);
  if (dtype == AMBER_F32) {
    memcpy(out, &v, 4);
    return v;
  }
  uint16_t h = dtype == AMBER_BF16 ? amber__f32_to_bf16(v) : amber__f32_to_f16(v);
  memcpy(out, &h, 2);
  return dtype == AMBER_BF16 ? amber__bf16_to_f32(h) : amber__f16_to_f32(h);
}

/* The policy's bound for an element restored to v (threshold: ABS + REL * |v|, as
 * the guarantee is stated; budget: CAP). */
static double bound_at(const amber__policy *p, double v) {
  return p->kind == AMBER__POL_THRESHOLD ? p->abs + p->rel * fabs(v) : p->cap;
}

static int within(const amber__policy *p, double x, double v) {
  return isfinite(v) && fabs(x - v) <= bound_at(p, v);
}

/* The step of an element with reference r: a + b * |r|, in the arithmetic of the
 * restore. */
static double step_of(int dtype, double r, float a, float b) {
  if (dtype == AMBER_F64) return (double)a + (double)b * fabs(r);
  return (double)(a + b * fabsf((float)r));
}

/* The code of change d in steps of s, or INT32_MIN when it has none (too large,
 * or a step that is zero or not finite). */
static int32_t code_of(int dtype, double d, double s, int32_t qmax) {
  double t = dtype == AMBER_F64 ? d / s : (double)((float)d / (float)s);
  if (!(fabs(t) <= (double)qmax + 0.5)) return INT32_MIN; /* NaN fails too */
  int32_t c = (int32_t)nearbyint(t); /* ties to even, as rintf and torch.round */
  return c < -qmax || c > qmax ? INT32_MIN : c;
}

/* With +lead: from the code farthest in the change's direction whose restore the
 * bound could allow (|d| + the bound at r, in steps, truncated; a budget's bound
 * is its cut `cut`) back towards the nearest code c, the first that restores
 * within the bound (and, for a budget, within the cut), trying at most a few; c
 * when none does. */
static int32_t lead_code(const amber__policy *p, int dtype, int mode, const qel *e, float a,
                         float b, float cut, double s, int32_t c, int32_t qmax, uint8_t *tmp) {
  int32_t sgn = e->d > 0 ? 1 : -1;
  int thr = p->kind == AMBER__POL_THRESHOLD;
  double far;
  if (dtype == AMBER_F64) {
    far = (fabs(e->d) + (thr ? p->abs + p->rel * fabs(e->r) : (double)cut)) / s;
  } else {
    float ef = thr ? (float)p->abs + (float)p->rel * fabsf((float)e->r) : cut;
    far = (double)((fabsf((float)e->d) + ef) / (float)s);
  }
  if (far != far) return c; /* an infinite step: no lead (the element escapes) */
  int32_t f = far >= (double)qmax ? qmax : (int32_t)far;
  for (int tries = 0; tries < 4 && f > sgn * c; tries++, f--) {
    double v = restore(dtype, mode, e->r, a, b, f * sgn, 0, tmp);
    if (within(p, e->x, v) && (thr || fabs(e->x - v) <= (double)cut)) return f * sgn;
  }
  return c;
}


/* ---- f32 with integer codes: the common case, in one tight loop ----
 *
 * The same decisions as the generic code below (test_delta_quant runs both), with
 * what costs there taken out: no widening to f64 but for the bound's check, codes
 * rounded by the 1.5 * 2^23 trick (|t| <= 127.5 is checked first, so the sum lies in
 * [2^23, 2^24), where f32 has unit spacing: round to nearest, ties to even, as
 * nearbyint), and the restore's two operations inline. */

static int fast = 2; /* 2: AVX-512 where it runs, 1: the f32 loop, 0: generic */

void amber__quant_use_fast(int on) {
  __atomic_store_n(&fast, on, __ATOMIC_RELAXED);
}

/* ---- f32 budgets without a lead on AVX-512: sixteen selected elements a step ----
 *
 * The first moments' rule ("budget:F:CAP@q8") quantizes a few percent of a large
 * tensor after the scan, each element with its reference gathered from and its
 * restore scattered into the tensor. The same operations as quant_f32 (and so the
 * same bits: test_delta_quant compares both with the generic code), sixteen at a
 * time. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define QUANT_AVX512 1

static int have_avx512(void) {
  static int level = -1;
  int v = __atomic_load_n(&level, __ATOMIC_RELAXED);
  if (v < 0) {
    __builtin_cpu_init();
    v = __builtin_cpu_supports("avx512f") ? 1 : 0;
    __atomic_store_n(&level, v, __ATOMIC_RELAXED);
  }
  return v;
}

/* budget_step's least and largest finite |x - r| (f32) */
__attribute__((target("avx512f"))) static void budget_range16(const float *ref, const uint32_t *idx,
                                                              const float *vals, size_t k,
                                                              float *lo, float *hi) {
  const __m512i absm = _mm512_set1_epi32(0x7fffffff), expo = _mm512_set1_epi32(0x7f800000);
  __m512 vlo = _mm512_set1_ps(INFINITY), vhi = _mm512_setzero_ps();
  for (size_t i = 0; i < k; i += 16) {
    __mmask16 in = k - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - i)) - 1);
    __m512 vr = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), in,
                                         _mm512_maskz_loadu_epi32(in, idx + i), ref, 4);
    __m512 vx = _mm512_maskz_loadu_ps(in, vals + i);
    __m512i ad = _mm512_and_si512(_mm512_castps_si512(_mm512_sub_ps(vx, vr)), absm);
    __mmask16 m = in &
                  _mm512_cmpneq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(vx), expo), expo) &
                  _mm512_cmpneq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(vr), expo), expo) &
                  _mm512_cmpneq_epi32_mask(_mm512_and_si512(ad, expo), expo);
    vlo = _mm512_mask_min_ps(vlo, m, vlo, _mm512_castsi512_ps(ad));
    vhi = _mm512_mask_max_ps(vhi, m, vhi, _mm512_castsi512_ps(ad));
  }
  *lo = _mm512_reduce_min_ps(vlo);
  *hi = _mm512_reduce_max_ps(vhi);
}

__attribute__((target("avx512f"))) static size_t quant_f32_budget16(
    float *ref, const uint32_t *idx, const float *vals, size_t k, int32_t qmax, float a, double cap,
    int8_t *codes, uint32_t *esc, uint8_t *esc_vals) {
  const __m512 va = _mm512_set1_ps(a), zero = _mm512_setzero_ps(),
               vqlim = _mm512_set1_ps((float)qmax + 0.5f), vqmax = _mm512_set1_ps((float)qmax);
  const __m512i absm = _mm512_set1_epi32(0x7fffffff), expo = _mm512_set1_epi32(0x7f800000);
  const __m512i absd = _mm512_set1_epi64(0x7fffffffffffffffll);
  const __m512d capd = _mm512_set1_pd(cap);
  size_t nesc = 0;
  for (size_t i = 0; i < k; i += 16) {
    __mmask16 in = k - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - i)) - 1);
    __m512i ix = _mm512_maskz_loadu_epi32(in, idx + i);
    __m512 vr = _mm512_mask_i32gather_ps(zero, in, ix, ref, 4);
    __m512 vx = _mm512_maskz_loadu_ps(in, vals + i);
    __m512 ar = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(vr), absm));
    __m512 s = _mm512_add_ps(va, _mm512_mul_ps(zero, ar)); /* a + 0 * |r|, as quant_f32 */
    __m512 t = _mm512_div_ps(_mm512_sub_ps(vx, vr), s);
    __m512 tabs = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(t), absm));
    __mmask16 ok =
        in & _mm512_cmp_ps_mask(tabs, vqlim, _CMP_LE_OQ) &
        _mm512_cmpneq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(vx), expo), expo) &
        _mm512_cmpneq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(vr), expo), expo);
    /* + 0: a code of -0 is 0, as an integer */
    __m512 c = _mm512_add_ps(_mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                             zero);
    __m512 cabs = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(c), absm));
    ok &= _mm512_cmp_ps_mask(cabs, vqmax, _CMP_LE_OQ);
    c = _mm512_maskz_mov_ps(ok, c);
    __m512 v = _mm512_add_ps(vr, _mm512_mul_ps(c, s));
    /* f32_within for a budget: v finite and |x - v| <= CAP, in f64 */
    __mmask16 w = 0;
    for (int h = 0; h < 2; h++) {
      __m512d xd = _mm512_cvtps_pd(_mm512_castps512_ps256(h ? _mm512_shuffle_f32x4(vx, vx, 0xEE) : vx));
      __m512d vd = _mm512_cvtps_pd(_mm512_castps512_ps256(h ? _mm512_shuffle_f32x4(v, v, 0xEE) : v));
      __m512d e = _mm512_castsi512_pd(_mm512_and_si512(_mm512_castpd_si512(_mm512_sub_pd(xd, vd)), absd));
      w |= (__mmask16)(_mm512_cmp_pd_mask(e, capd, _CMP_LE_OQ) << (8 * h));
    }
    ok &= w & _mm512_cmpneq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), expo), expo);
    _mm512_mask_cvtepi32_storeu_epi8(codes + i, in, _mm512_cvtps_epi32(_mm512_maskz_mov_ps(ok, c)));
    _mm512_mask_i32scatter_ps(ref, in, ix, _mm512_mask_mov_ps(vx, ok, v), 4);
    __mmask16 escape = in & (__mmask16)~ok;
    while (escape) { /* stored whole */
      unsigned l = (unsigned)__builtin_ctz(escape);
      escape &= (__mmask16)(escape - 1);
      esc[nesc] = (uint32_t)(i + l);
      memcpy(esc_vals + 4 * nesc, vals + i + l, 4);
      nesc++;
    }
  }
  return nesc;
}
#endif

/* A budget's cut and step: the least and the largest finite change selected, the
 * step AMBER__QSTEP_SHARE of the cut or the largest over qmax, whichever is more,
 * at most CAP (f32 operations, as the device path repeats them). */
static float budget_step(const amber__policy *p, int dtype, const uint8_t *ref,
                         const uint32_t *idx, const uint8_t *vals, size_t k, int32_t qmax,
                         float *cut) {
  size_t w = amber_dtype_size(dtype);
  float lo = INFINITY, hi = 0;
#ifdef QUANT_AVX512
  if (dtype == AMBER_F32 && __atomic_load_n(&fast, __ATOMIC_RELAXED) >= 2 && have_avx512())
    budget_range16((const float *)(const void *)ref, idx, (const float *)(const void *)vals, k,
                   &lo, &hi);
  else
#endif
    for (size_t i = 0; i < k; i++) {
      qel e = load(dtype, vals + i * w, ref + (size_t)idx[i] * w);
      float ad = (float)fabs(e.d);
      if (!isfinite(e.x) || !isfinite(e.r) || !isfinite(ad)) continue;
      lo = ad < lo ? ad : lo;
      hi = ad > hi ? ad : hi;
    }
  if (!isfinite(lo)) lo = 0; /* nothing finite: every element is an escape */
  float s = (float)AMBER__QSTEP_SHARE * lo, m = hi / (float)qmax;
  s = m > s ? m : s;
  if (s > (float)p->cap) s = (float)p->cap;
  *cut = lo;
  return s;
}

static inline float round_code(float t) {
  volatile float big = 0x1.8p23f; /* volatile: the sum is not folded away */
  return (t + big) - big;
}

static inline int f32_within(int thr, double absb, double relb, double cap, float x, float v) {
  double e = fabs((double)x - (double)v);
  return isfinite(v) && e <= (thr ? absb + relb * fabs((double)v) : cap);
}

static size_t quant_f32(const amber__policy *p, float *ref, const uint32_t *idx,
                        const float *vals, size_t k, int32_t qmax, float a, float b, float cut,
                        int8_t *codes, uint32_t *esc, uint8_t *esc_vals) {
  const int thr = p->kind == AMBER__POL_THRESHOLD, lead = p->lead;
  const double absb = p->abs, relb = p->rel, cap = p->cap, cutd = cut;
  const float absf = (float)p->abs, relf = (float)p->rel, qlim = (float)qmax + 0.5f;
  size_t nesc = 0;
  for (size_t i = 0; i < k; i++) {
    float *rp = ref + idx[i];
    float r = *rp, x;
    memcpy(&x, vals + i, 4);
    float d = x - r, s = a + b * fabsf(r), t = d / s;
    int ok = fabsf(t) <= qlim && isfinite(x) && isfinite(r);
    float c = ok ? round_code(t) + 0.0f : 0; /* + 0: a code of -0 is 0, as an integer */
    ok = ok && fabsf(c) <= (float)qmax; /* 127.5 rounds to 128 */
    float v = r + c * s;
    if (ok && lead) {
      float ef = thr ? absf + relf * fabsf(r) : cut, far = (fabsf(d) + ef) / s, sg = d > 0 ? 1 : -1;
      int32_t f = far != far ? 0 : far >= (float)qmax ? qmax : (int32_t)far;
      int32_t ca = (int32_t)fabsf(c);
      for (int tries = 0; tries < 4 && f > ca; tries++, f--) {
        float w = r + ((float)f * sg) * s;
        if (f32_within(thr, absb, relb, cap, x, w) &&
            (thr || fabs((double)x - (double)w) <= cutd)) {
          c = (float)f * sg;
          v = w;
          break;
        }
      }
    }
    ok = ok && f32_within(thr, absb, relb, cap, x, v);
    codes[i] = (int8_t)(ok ? c : 0);
    if (ok) {
      *rp = v;
    } else { /* stored whole */
      esc[nesc] = (uint32_t)i;
      memcpy(esc_vals + 4 * nesc, &x, 4);
      *rp = x;
      nesc++;
    }
  }
  return nesc;
}

int amber__qfuse_init(amber__qfuse *f, const amber__policy *p, int dtype,
                      const amber__qbuf *buf) {
  memset(f, 0, sizeof *f);
  if (dtype != AMBER_F32 || p->kind != AMBER__POL_THRESHOLD || p->qmode == AMBER__QV_BF16 ||
      !__atomic_load_n(&fast, __ATOMIC_RELAXED))
    return 0;
  f->a = (float)(AMBER__QSTEP_SHARE * p->abs);
  f->b = (float)(AMBER__QSTEP_SHARE * p->rel);
  f->absf = (float)p->abs;
  f->relf = (float)p->rel;
  f->absb = p->abs;
  f->relb = p->rel;
  f->qmax = qmax_of(p->qmode);
  f->lead = p->lead;
  f->codes = buf->codes;
  f->esc = buf->esc;
  f->esc_vals = buf->esc_vals;
  return 1;
}

void amber__qfuse_result(const amber__qfuse *f, const amber__policy *p, const uint32_t *idx,
                         size_t k, const amber__qbuf *buf, amber__qsel *q) {
  memset(q, 0, sizeof *q);
  q->k = k;
  q->idx = idx;
  q->mode = p->qmode;
  q->group_log2 = 24;
  q->rel_step = f->b;
  q->steps = buf->steps;
  buf->steps[0] = f->a;
  q->codes = f->codes;
  q->nesc = f->nesc;
  q->esc = f->esc;
  q->esc_vals = f->esc_vals;
}

void amber__quantize(const amber__policy *p, int dtype, uint8_t *ref, const uint32_t *idx,
                     const uint8_t *vals, size_t k, const amber__qbuf *buf, amber__qsel *q) {
  size_t w = amber_dtype_size(dtype);
  int mode = p->qmode;
  int32_t qmax = qmax_of(mode);
  int8_t *codes = buf->codes;
  uint16_t *bfc = buf->codes;
  memset(q, 0, sizeof *q);
  q->k = k;
  q->idx = idx;
  q->mode = mode;
  q->codes = buf->codes;
  q->steps = buf->steps;
  q->esc = buf->esc;
  q->esc_vals = buf->esc_vals;
  float a = 0, b = 0, cut = 0;
  if (mode != AMBER__QV_BF16) { /* one step rule for the chunk */
    q->group_log2 = 24;
    if (p->kind == AMBER__POL_THRESHOLD) {
      a = (float)(AMBER__QSTEP_SHARE * p->abs);
      b = (float)(AMBER__QSTEP_SHARE * p->rel);
    } else {
      a = budget_step(p, dtype, ref, idx, vals, k, qmax, &cut);
    }
    q->rel_step = b;
    if (k) buf->steps[0] = a;
  }
  size_t nesc = 0;
  uint8_t tmp[8];
#ifdef QUANT_AVX512
  if (dtype == AMBER_F32 && mode != AMBER__QV_BF16 && p->kind == AMBER__POL_BUDGET && !p->lead &&
      __atomic_load_n(&fast, __ATOMIC_RELAXED) >= 2 && have_avx512()) {
    q->nesc = quant_f32_budget16((float *)(void *)ref, idx, (const float *)(const void *)vals, k,
                                 qmax, a, p->cap, codes, buf->esc, buf->esc_vals);
    return;
  }
#endif
  if (dtype == AMBER_F32 && mode != AMBER__QV_BF16 && __atomic_load_n(&fast, __ATOMIC_RELAXED)) {
    q->nesc = quant_f32(p, (float *)(void *)ref, idx, (const float *)(const void *)vals, k, qmax,
                        a, b, cut, codes, buf->esc, buf->esc_vals);
    return;
  }
  for (size_t i = 0; i < k; i++) {
    uint8_t *rp = ref + (size_t)idx[i] * w;
    const uint8_t *xp = vals + i * w;
    qel e = load(dtype, xp, rp);
    int ok = isfinite(e.x) && isfinite(e.r) && isfinite(e.d);
    if (mode == AMBER__QV_BF16) {
      uint16_t c = amber__f32_to_bf16((float)e.d);
      bfc[i] = c;
      ok = ok && within(p, e.x, restore(dtype, mode, e.r, 0, 0, 0, c, tmp));
    } else {
      double s = step_of(dtype, e.r, a, b);
      int32_t c = ok ? code_of(dtype, e.d, s, qmax) : INT32_MIN;
      if (c != INT32_MIN && p->lead)
        c = lead_code(p, dtype, mode, &e, a, b, cut, s, c, qmax, tmp);
      ok = c != INT32_MIN && within(p, e.x, restore(dtype, mode, e.r, a, b, c, 0, tmp));
      codes[i] = (int8_t)(ok ? c : 0);
    }
    if (ok) {
      memcpy(rp, tmp, w);
    } else { /* stored whole */
      if (mode == AMBER__QV_BF16) bfc[i] = 0;
      buf->esc[nesc] = (uint32_t)i;
      memcpy(buf->esc_vals + nesc * w, xp, w);
      memcpy(rp, xp, w);
      nesc++;
    }
  }
  q->nesc = nesc;
}

/*
 * codec.c - byte shuffle by element width and zstd framing of chunk payloads.
 *
 * Float values of neighbouring elements share their sign/exponent bytes; grouping
 * byte k of every element together (the shuffle of blosc) turns that into long
 * runs zstd can use. The decoder side never trusts a frame: its declared content
 * size must equal the size the index implies before anything is decompressed.
 */
#include <string.h>

#include <zstd.h>

#include "codec.h"
#include "internal.h"

void amber__shuffle(uint8_t *dst, const uint8_t *src, size_t n, size_t width) {
  if (width == 1) {
    memcpy(dst, src, n);
    return;
  }
  if (width == 4) { /* the common case, written out so it vectorizes */
    uint8_t *d0 = dst, *d1 = dst + n, *d2 = dst + 2 * n, *d3 = dst + 3 * n;
    for (size_t i = 0; i < n; i++) {
      d0[i] = src[4 * i];
      d1[i] = src[4 * i + 1];
      d2[i] = src[4 * i + 2];
      d3[i] = src[4 * i + 3];
    }
    return;
  }
  for (size_t i = 0; i < n; i++)
    for (size_t b = 0; b < width; b++) dst[b * n + i] = src[i * width + b];
}

void amber__unshuffle(uint8_t *dst, const uint8_t *src, size_t n, size_t width) {
  if (width == 1) {
    memcpy(dst, src, n);
    return;
  }
  if (width == 4) {
    const uint8_t *s0 = src, *s1 = src + n, *s2 = src + 2 * n, *s3 = src + 3 * n;
    for (size_t i = 0; i < n; i++) {
      dst[4 * i] = s0[i];
      dst[4 * i + 1] = s1[i];
      dst[4 * i + 2] = s2[i];
      dst[4 * i + 3] = s3[i];
    }
    return;
  }
  for (size_t i = 0; i < n; i++)
    for (size_t b = 0; b < width; b++) dst[i * width + b] = src[b * n + i];
}

size_t amber__zstd_bound(size_t n) {
  return ZSTD_compressBound(n);
}

int amber__zstd_compress(void *cctx, int level, uint8_t *dst, size_t cap, const uint8_t *src,
                         size_t n, size_t *out) {
  size_t r = ZSTD_compressCCtx(cctx, dst, cap, src, n, level);
  if (ZSTD_isError(r)) return AMBER_ENOMEM;
  *out = r;
  return 0;
}

int amber__zstd_decompress(void *dctx, uint8_t *dst, size_t expect, const uint8_t *src,
                           size_t n) {
  unsigned long long cs = ZSTD_getFrameContentSize(src, n);
  if (cs == ZSTD_CONTENTSIZE_ERROR || cs == ZSTD_CONTENTSIZE_UNKNOWN || cs != expect)
    return AMBER_ECORRUPT;
  size_t r = ZSTD_decompressDCtx(dctx, dst, expect, src, n);
  if (ZSTD_isError(r) || r != expect) return AMBER_ECORRUPT;
  return 0;
}

void *amber__zstd_cctx(void) {
  return ZSTD_createCCtx();
}
void amber__zstd_cctx_free(void *c) {
  ZSTD_freeCCtx(c);
}
void *amber__zstd_dctx(void) {
  return ZSTD_createDCtx();
}
void amber__zstd_dctx_free(void *d) {
  ZSTD_freeDCtx(d);
}

int amber__zstd_decompress_bounded(void *dctx, uint8_t *dst, size_t cap, const uint8_t *src,
                                   size_t n, size_t *out) {
  unsigned long long cs = ZSTD_getFrameContentSize(src, n);
  if (cs == ZSTD_CONTENTSIZE_ERROR || cs == ZSTD_CONTENTSIZE_UNKNOWN || cs > cap)
    return AMBER_ECORRUPT;
  size_t r = ZSTD_decompressDCtx(dctx, dst, (size_t)cs, src, n);
  if (ZSTD_isError(r) || r != cs) return AMBER_ECORRUPT;
  *out = r;
  return 0;
}

/* ---- sparse bodies (docs/FORMAT.md, "Sparse body") ---- */

static size_t varint_len(uint32_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    n++;
  }
  return n;
}

size_t amber__sparse_bound(size_t n, size_t k, size_t w) {
  size_t bitmap = (n + 7) / 8, varints = 5 * k;
  return 1 + (bitmap > varints ? bitmap : varints) + k * w;
}

static uint8_t *put_varint(uint8_t *p, uint32_t g) {
  while (g >= 0x80) {
    *p++ = (uint8_t)(g | 0x80);
    g >>= 7;
  }
  *p++ = (uint8_t)g;
  return p;
}

size_t amber__positions_encode(uint8_t *p, const uint32_t *idx, size_t k, size_t n) {
  /* The gaps are written as varints while they stay more than one varint (5
   * bytes) short of the bitmap's size; near that size the rest is only counted,
   * so the index never runs past what the smaller encoding needs. One pass over
   * idx in the common, sparse case. */
  uint8_t *body = p;
  size_t bitmap = (n + 7) / 8, i = 0;
  p = body + 1;
  const uint8_t *safe = body + 1 + (bitmap > 5 ? bitmap - 5 : 0);
  for (uint32_t prev = 0; i < k && p < safe; i++) {
    uint32_t g = idx[i] - prev; /* prev is idx[i - 1] + 1 */
    prev = idx[i] + 1;
    if (g < 0x80)
      *p++ = (uint8_t)g;
    else
      p = put_varint(p, g);
  }
  size_t varints = (size_t)(p - (body + 1));
  for (size_t j = i; j < k && varints < bitmap; j++)
    varints += varint_len(idx[j] - (j ? idx[j - 1] + 1 : 0));
  if (varints < bitmap) {
    body[0] = 1;
    for (; i < k; i++) p = put_varint(p, idx[i] - (i ? idx[i - 1] + 1 : 0));
  } else {
    body[0] = 0;
    p = body + 1;
    memset(p, 0, bitmap);
    for (size_t j = 0; j < k; j++) p[idx[j] / 8] |= (uint8_t)(1u << (idx[j] % 8));
    p += bitmap;
  }
  return (size_t)(p - body);
}

size_t amber__sparse_encode(uint8_t *body, const uint32_t *idx, const uint8_t *vals, size_t k,
                            size_t n, size_t w) {
  size_t ilen = amber__positions_encode(body, idx, k, n);
  amber__shuffle(body + ilen, vals, k, w);
  return ilen + k * w;
}

/* Writes the k values (byte-shuffled, `sh`) to their validated positions `idx`,
 * gathering each value's bytes from the shuffled planes on the way: one pass, one
 * store per element, the width fixed at compile time. */
#define SCATTER_W(NAME, T)                                                                    \
  static void NAME(uint8_t *dst, const uint32_t *idx, const uint8_t *sh, size_t k) {          \
    for (size_t i = 0; i < k; i++) {                                                          \
      uint8_t b[sizeof(T)];                                                                   \
      for (size_t j = 0; j < sizeof(T); j++) b[j] = sh[j * k + i];                            \
      memcpy(dst + (size_t)idx[i] * sizeof(T), b, sizeof(T));                                 \
    }                                                                                         \
  }
SCATTER_W(scatter1, uint8_t)
SCATTER_W(scatter2, uint16_t)
SCATTER_W(scatter4, uint32_t)
SCATTER_W(scatter8, uint64_t)

/* Reads one unsigned LEB128 varint of at most 32 bits. */
static int get_varint(const uint8_t **pp, const uint8_t *end, uint64_t *out) {
  const uint8_t *p = *pp;
  if (p < end && !(*p & 0x80)) { /* the common case: below 128 */
    *out = *p;
    *pp = p + 1;
    return 0;
  }
  uint64_t g = 0;
  for (int shift = 0;; shift += 7) {
    if (p == end || shift > 28) return AMBER_ECORRUPT;
    uint8_t b = *p++;
    g |= (uint64_t)(b & 0x7f) << shift;
    if (!(b & 0x80)) break;
  }
  *out = g;
  *pp = p;
  return 0;
}

/* Increasing positions below `n` from `k` varint gaps (the first is the first
 * position, each next one the distance past the previous one). */
static int get_gaps(const uint8_t **p, const uint8_t *end, size_t n, size_t k, uint32_t *out) {
  uint64_t at = 0;
  for (size_t i = 0; i < k; i++) {
    uint64_t g;
    if (get_varint(p, end, &g)) return AMBER_ECORRUPT;
    at += g + (i ? 1 : 0);
    if (at >= n) return AMBER_ECORRUPT;
    out[i] = (uint32_t)at;
  }
  return 0;
}

int amber__positions_decode(const uint8_t **pp, const uint8_t *end, size_t n, size_t k,
                        uint32_t *idx) {
  const uint8_t *p = *pp;
  if (p == end) return AMBER_ECORRUPT;
  uint8_t mode = *p++;
  size_t bitmap = (n + 7) / 8;
  if (mode == 0) {
    if ((size_t)(end - p) < bitmap) return AMBER_ECORRUPT;
    if (n % 8 && (p[bitmap - 1] >> (n % 8))) return AMBER_ECORRUPT;
    size_t got = 0;
    for (size_t i = 0; i < bitmap; i++) {
      uint8_t b = p[i];
      if (got + (size_t)__builtin_popcount(b) > k) return AMBER_ECORRUPT;
      while (b) {
        idx[got++] = (uint32_t)(i * 8 + (size_t)__builtin_ctz(b));
        b &= (uint8_t)(b - 1);
      }
    }
    if (got != k) return AMBER_ECORRUPT;
    p += bitmap;
  } else if (mode == 1) {
    if (get_gaps(&p, end, n, k, idx)) return AMBER_ECORRUPT;
  } else {
    return AMBER_ECORRUPT;
  }
  *pp = p;
  return 0;
}

int amber__sparse_apply(uint8_t *dst, const uint8_t *body, size_t len, size_t n, size_t k,
                        size_t w, uint32_t *idx) {
  const uint8_t *p = body, *end = body + len;
  /* decode and validate every index before anything is written */
  if (amber__positions_decode(&p, end, n, k, idx)) return AMBER_ECORRUPT;
  if ((size_t)(end - p) != k * w) return AMBER_ECORRUPT;
  switch (w) {
  case 1: scatter1(dst, idx, p, k); break;
  case 2: scatter2(dst, idx, p, k); break;
  case 4: scatter4(dst, idx, p, k); break;
  default: scatter8(dst, idx, p, k); break;
  }
  return 0;
}

void amber__xor(uint8_t *dst, const uint8_t *a, const uint8_t *b, size_t len) {
  for (size_t i = 0; i < len; i++) dst[i] = a[i] ^ b[i];
}

/* ---- quantized sparse bodies (docs/FORMAT.md, "Quantized sparse body") ---- */

#define QFIXED 12 /* value_mode, group_log2, reserved, rel_step, n_escapes */

static size_t code_bytes(int mode, size_t k) {
  return mode == AMBER__QV_Q4 ? (k + 1) / 2 : mode == AMBER__QV_BF16 ? 2 * k : k;
}

static size_t ngroups(int mode, unsigned group_log2, size_t k) {
  return mode == AMBER__QV_BF16 || !k ? 0 : ((k - 1) >> group_log2) + 1;
}

size_t amber__qsparse_bound(size_t n, const amber__qsel *q, size_t w) {
  /* the index takes the bitmap's size at most: varints only when smaller */
  return 1 + (n + 7) / 8 + QFIXED + 4 * ngroups(q->mode, q->group_log2, q->k) +
         code_bytes(q->mode, q->k) + q->nesc * (5 + w);
}

size_t amber__qsparse_body_max(size_t n, size_t k, size_t w) {
  amber__qsel q = {.k = k, .mode = AMBER__QV_BF16, .nesc = k}; /* 2-byte codes */
  return amber__qsparse_bound(n, &q, w) + 4 * k; /* and a step per code */
}

size_t amber__qsparse_encode(uint8_t *body, const amber__qsel *q, size_t n, size_t w) {
  uint8_t *p = body + amber__positions_encode(body, q->idx, q->k, n);
  size_t ng = ngroups(q->mode, q->group_log2, q->k);
  p[0] = (uint8_t)q->mode;
  p[1] = (uint8_t)(q->mode == AMBER__QV_BF16 ? 0 : q->group_log2);
  p[2] = p[3] = 0;
  amber__put32(p + 4, q->mode == AMBER__QV_BF16 ? 0 : amber__f32_bits(q->rel_step));
  amber__put32(p + 8, (uint32_t)q->nesc);
  p += QFIXED;
  for (size_t g = 0; g < ng; g++, p += 4) amber__put32(p, amber__f32_bits(q->steps[g]));
  if (q->mode == AMBER__QV_Q8) {
    if (q->k) memcpy(p, q->codes, q->k);
    p += q->k;
  } else if (q->mode == AMBER__QV_Q4) {
    const int8_t *c = q->codes;
    for (size_t i = 0; i + 1 < q->k; i += 2)
      *p++ = (uint8_t)(((uint8_t)c[i] & 0xf) | ((uint8_t)c[i + 1] << 4));
    if (q->k % 2) *p++ = (uint8_t)c[q->k - 1] & 0xf;
  } else {
    amber__shuffle(p, q->codes, q->k, 2);
    p += 2 * q->k;
  }
  for (size_t e = 0; e < q->nesc; e++)
    p = put_varint(p, q->esc[e] - (e ? q->esc[e - 1] + 1 : 0));
  if (q->nesc) memcpy(p, q->esc_vals, q->nesc * w);
  return (size_t)(p - body) + q->nesc * w;
}

/* The code of selected element i of a Q8 or Q4 body. */
static inline int32_t qcode(const uint8_t *codes, int mode, size_t i) {
  if (mode == AMBER__QV_Q8) return (int8_t)codes[i];
  uint8_t nib = (uint8_t)((codes[i / 2] >> (4 * (i % 2))) & 0xf);
  return (int32_t)nib - ((nib & 8) << 1); /* sign-extend 4 bits */
}

/* Writes the restored value of one element that is not an escape: dst holds the
 * parent's value, which the delta moves by its code times its step. */
static inline __attribute__((always_inline)) void dequant_one(uint8_t *dst, int dtype, int mode,
                                                              int32_t code, uint16_t bf, float a,
                                                              float b) {
  if (dtype == AMBER_F64) {
    double r;
    memcpy(&r, dst, 8);
    r = mode == AMBER__QV_BF16 ? r + (double)amber__bf16_to_f32(bf)
                               : amber__dequant_f64(r, a, b, code);
    memcpy(dst, &r, 8);
    return;
  }
  float r;
  uint16_t h;
  if (dtype == AMBER_F32) {
    memcpy(&r, dst, 4);
  } else {
    memcpy(&h, dst, 2);
    r = dtype == AMBER_BF16 ? amber__bf16_to_f32(h) : amber__f16_to_f32(h);
  }
  r = mode == AMBER__QV_BF16 ? r + amber__bf16_to_f32(bf) : amber__dequant_f32(r, a, b, code);
  if (dtype == AMBER_F32) {
    memcpy(dst, &r, 4);
  } else {
    h = dtype == AMBER_BF16 ? amber__f32_to_bf16(r) : amber__f32_to_f16(r);
    memcpy(dst, &h, 2);
  }
}

/* Selected elements [i, end) of a body, none of them an escape, applied onto dst.
 * Inlined into one loop per (dtype, mode) below, so that the loop a restore spends
 * its time in holds no branch on either and reads each group's step once. */
static inline __attribute__((always_inline)) void dequant_run(
    uint8_t *dst, const uint32_t *idx, size_t i, size_t end, int dtype, int mode,
    const uint8_t *codes, size_t k, const uint8_t *steps, unsigned glog, float b) {
  size_t w = amber_dtype_size(dtype);
  if (mode == AMBER__QV_BF16) {
    for (; i < end; i++)
      dequant_one(dst + (size_t)idx[i] * w, dtype, mode, 0,
                  (uint16_t)(codes[i] | codes[k + i] << 8), 0, 0);
    return;
  }
  while (i < end) {
    size_t g = i >> glog, stop = (g + 1) << glog;
    if (stop > end) stop = end;
    float a = amber__bits_f32(amber__get32(steps + 4 * g));
    for (; i < stop; i++)
      dequant_one(dst + (size_t)idx[i] * w, dtype, mode, qcode(codes, mode, i), 0, a, b);
  }
}

#define DEQUANT_CASE(dt, md)                                                        \
  case (dt) * 4 + (md):                                                              \
    dequant_run(dst, idx, i, end, (dt), (md), codes, k, steps, glog, b);             \
    break

static void dequant_span(uint8_t *dst, const uint32_t *idx, size_t i, size_t end, int dtype,
                         int mode, const uint8_t *codes, size_t k, const uint8_t *steps,
                         unsigned glog, float b) {
  switch (dtype * 4 + mode) {
    DEQUANT_CASE(AMBER_F32, AMBER__QV_Q8);
    DEQUANT_CASE(AMBER_F32, AMBER__QV_Q4);
    DEQUANT_CASE(AMBER_F32, AMBER__QV_BF16);
    DEQUANT_CASE(AMBER_BF16, AMBER__QV_Q8);
    DEQUANT_CASE(AMBER_BF16, AMBER__QV_Q4);
    DEQUANT_CASE(AMBER_BF16, AMBER__QV_BF16);
    default: /* f16, f64 */
      dequant_run(dst, idx, i, end, dtype, mode, codes, k, steps, glog, b);
  }
}

int amber__qsparse_apply(uint8_t *dst, const uint8_t *body, size_t len, size_t n, size_t k,
                         int dtype, uint32_t *idx, uint32_t *esc) {
  size_t w = amber_dtype_size(dtype);
  const uint8_t *p = body, *end = body + len;
  if (!amber__quant_dtype(dtype)) return AMBER_ECORRUPT;
  /* every part is decoded and checked before anything is written */
  if (amber__positions_decode(&p, end, n, k, idx) || (size_t)(end - p) < QFIXED)
    return AMBER_ECORRUPT;
  int mode = p[0];
  unsigned glog = p[1];
  uint32_t rel_bits = amber__get32(p + 4);
  size_t nesc = amber__get32(p + 8);
  if (mode < AMBER__QV_Q8 || mode > AMBER__QV_BF16 || p[2] || p[3] || nesc > k || glog > 24 ||
      (mode == AMBER__QV_BF16 && (glog || rel_bits)))
    return AMBER_ECORRUPT;
  p += QFIXED;
  size_t ng = ngroups(mode, glog, k), cb = code_bytes(mode, k);
  if ((size_t)(end - p) < 4 * ng + cb) return AMBER_ECORRUPT;
  const uint8_t *steps = p, *codes = p + 4 * ng;
  p = codes + cb;
  if (mode == AMBER__QV_Q4 && k % 2 && (codes[cb - 1] >> 4)) return AMBER_ECORRUPT;
  if (get_gaps(&p, end, k, nesc, esc)) return AMBER_ECORRUPT;
  if ((size_t)(end - p) != nesc * w) return AMBER_ECORRUPT;
  const uint8_t *raw = p;
  /* an escaped element's code is zero: it is stored whole */
  for (size_t e = 0; e < nesc; e++) {
    size_t i = esc[e];
    if (mode == AMBER__QV_BF16 ? (codes[i] | codes[k + i]) != 0 : qcode(codes, mode, i) != 0)
      return AMBER_ECORRUPT;
  }
  float b = amber__bits_f32(rel_bits);
  for (size_t i = 0, e = 0; i < k; e++) {
    size_t stop = e < nesc ? esc[e] : k; /* the run up to the next escape */
    dequant_span(dst, idx, i, stop, dtype, mode, codes, k, steps, glog, b);
    if (stop < k) memcpy(dst + (size_t)idx[stop] * w, raw + e * w, w);
    i = stop + 1;
  }
  return 0;
}

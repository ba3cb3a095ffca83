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

size_t amber__sparse_encode(uint8_t *body, const uint32_t *idx, const uint8_t *vals, size_t k,
                            size_t n, size_t w) {
  /* The gaps are written as varints while they stay more than one varint (5
   * bytes) short of the bitmap's size; near that size the rest is only counted,
   * so the index never runs past what the smaller encoding needs. One pass over
   * idx in the common, sparse case. */
  size_t bitmap = (n + 7) / 8, i = 0;
  uint8_t *p = body + 1;
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
  amber__shuffle(p, vals, k, w);
  return (size_t)(p - body) + k * w;
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

int amber__sparse_apply(uint8_t *dst, const uint8_t *body, size_t len, size_t n, size_t k,
                        size_t w, uint32_t *idx) {
  if (len < 1) return AMBER_ECORRUPT;
  const uint8_t *p = body + 1, *end = body + len;
  size_t bitmap = (n + 7) / 8;
  /* decode and validate every index before anything is written */
  if (body[0] == 0) {
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
  } else if (body[0] == 1) {
    uint64_t at = 0;
    for (size_t i = 0; i < k; i++) {
      uint64_t g;
      if (p < end && !(*p & 0x80)) { /* the common case: a gap below 128 */
        g = *p++;
      } else {
        g = 0;
        int shift = 0;
        for (;;) {
          if (p == end || shift > 28) return AMBER_ECORRUPT;
          uint8_t b = *p++;
          g |= (uint64_t)(b & 0x7f) << shift;
          shift += 7;
          if (!(b & 0x80)) break;
        }
      }
      at += g + (i ? 1 : 0);
      if (at >= n) return AMBER_ECORRUPT;
      idx[i] = (uint32_t)at;
    }
  } else {
    return AMBER_ECORRUPT;
  }
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

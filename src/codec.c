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

#include "internal.h"
#include "codec.h"

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

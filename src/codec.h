/*
 * codec.h - internal: chunk payload codecs (shuffle, zstd framing) of
 * docs/FORMAT.md "Encodings". Contexts are opaque pointers so that callers need
 * not include zstd.h.
 */
#ifndef AMBER_CODEC_H
#define AMBER_CODEC_H

#include <stddef.h>
#include <stdint.h>

size_t amber__zstd_bound(size_t n);
/* Compresses `n` bytes into dst (capacity `cap`, >= amber__zstd_bound(n)) as one
 * frame that declares its content size. */
int amber__zstd_compress(void *cctx, int level, uint8_t *dst, size_t cap,
                         const uint8_t *src, size_t n, size_t *out);
/* Decompresses one frame that must declare exactly `expect` bytes of content;
 * AMBER_ECORRUPT otherwise, before or while decompressing. */
int amber__zstd_decompress(void *dctx, uint8_t *dst, size_t expect, const uint8_t *src,
                           size_t n);
void *amber__zstd_cctx(void);
void amber__zstd_cctx_free(void *c);
void *amber__zstd_dctx(void);
void amber__zstd_dctx_free(void *d);

#endif

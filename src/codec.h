/*
 * codec.h - internal: chunk payload codecs (shuffle, zstd framing) of
 * docs/FORMAT.md "Encodings". Contexts are opaque pointers so that callers need
 * not include zstd.h.
 */
#ifndef AMBER_CODEC_H
#define AMBER_CODEC_H

#include <stddef.h>
#include <stdint.h>

/* Byte shuffle by element width (FORMAT.md "Encodings"). */
void amber__shuffle(uint8_t *dst, const uint8_t *src, size_t n, size_t width);
void amber__unshuffle(uint8_t *dst, const uint8_t *src, size_t n, size_t width);

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

/* Like amber__zstd_decompress, for frames whose size is only bounded: the
 * declared content size must be <= cap; *out receives it. */
int amber__zstd_decompress_bounded(void *dctx, uint8_t *dst, size_t cap, const uint8_t *src,
                                   size_t n, size_t *out);

/* Largest sparse body for k of n elements of width w. */
size_t amber__sparse_bound(size_t n, size_t k, size_t w);
/* Writes the sparse body of k selected elements (increasing indices `idx`, their
 * values `vals` unshuffled) with whichever index form is smaller; returns its size. */
size_t amber__sparse_encode(uint8_t *body, const uint32_t *idx, const uint8_t *vals, size_t k,
                            size_t n, size_t w);
/* Validates a sparse body completely, then writes its values into dst (a chunk of
 * n elements, n < 2^32). `idx` is scratch for k indices. AMBER_ECORRUPT if
 * malformed. */
int amber__sparse_apply(uint8_t *dst, const uint8_t *body, size_t len, size_t n, size_t k,
                        size_t w, uint32_t *idx);
void amber__xor(uint8_t *dst, const uint8_t *a, const uint8_t *b, size_t len);

#endif

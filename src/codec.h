/*
 * codec.h - internal: chunk payload codecs (shuffle, zstd framing) of
 * docs/FORMAT.md "Encodings". Contexts are opaque pointers so that callers need
 * not include zstd.h.
 */
#ifndef AMBER_CODEC_H
#define AMBER_CODEC_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "amber.h"
#include "half.h"

/* Byte shuffle by element width (FORMAT.md "Encodings"). */
void amber__shuffle(uint8_t *dst, const uint8_t *src, size_t n, size_t width);
void amber__unshuffle(uint8_t *dst, const uint8_t *src, size_t n, size_t width);

size_t amber__zstd_bound(size_t n);
/* Compresses `n` bytes into dst (capacity `cap`, >= amber__zstd_bound(n)) as one
 * frame that declares its content size. */
/* The zstd level of quantized (QSPARSE) bodies when the writer's zstd_level is the
 * default. zstd's negative levels (the default for whole values) store literals
 * without entropy coding, which costs little on float values but about a third more
 * bytes on small integer codes (GPT-2's `lossy` deltas: 27.7 MB at -1, 19.5 MB at 1,
 * in about the same time). A zstd_level the caller sets applies to both. */
#define AMBER__QZSTD_LEVEL 1
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

/* The positions part of sparse bodies (FORMAT.md, "Sparse body"): a mode byte, then a
 * bitmap or varint gaps, whichever is smaller. Encode returns the bytes written
 * (at most 1 + max(ceil(n/8), 5k)); decode reads exactly k increasing indices
 * below n into idx and advances *p, or returns AMBER_ECORRUPT. */
size_t amber__positions_encode(uint8_t *p, const uint32_t *idx, size_t k, size_t n);
int amber__positions_decode(const uint8_t **p, const uint8_t *end, size_t n, size_t k,
                        uint32_t *idx);

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

/* ---- quantized sparse bodies (FORMAT.md, "Quantized sparse body") ----
 *
 * A QSPARSE chunk moves each selected element of the parent by a code times a
 * step: step = a + b * |parent value|, with `a` one f32 per group of 2^group_log2
 * selected elements and `b` one f32 per chunk (Q8 and Q4), or by a bf16 delta
 * (BF16). Escaped elements are stored whole. The restore below is the one
 * definition of the arithmetic: the writer's quantizer (quant.c), the device
 * path (python/amber/device.py) and the CUDA kernel compute the same IEEE
 * operations in the same order (each one rounded, no fused multiply-add: the
 * library is built with -ffp-contract=off), so every implementation moves its
 * reference to the bits a restore produces. */
enum { AMBER__QV_Q8 = 1, AMBER__QV_Q4 = 2, AMBER__QV_BF16 = 3 };

/* The dtypes a quantized policy encodes (others store their values as SPARSE). */
static inline int amber__quant_dtype(int dtype) {
  return dtype == AMBER_F32 || dtype == AMBER_F64 || dtype == AMBER_BF16 || dtype == AMBER_F16;
}

static inline float amber__dequant_f32(float r, float a, float b, int32_t code) {
  float s = a + b * fabsf(r);
  return r + (float)code * s;
}

static inline double amber__dequant_f64(double r, float a, float b, int32_t code) {
  double s = (double)a + (double)b * fabs(r);
  return r + (double)code * s;
}

/* A quantized selection of one chunk, as a body encodes it. */
typedef struct amber__qsel {
  size_t k;             /* selected elements */
  const uint32_t *idx;  /* their increasing indices */
  int mode;             /* AMBER__QV_* */
  unsigned group_log2;  /* Q8/Q4: selected elements per step (log2, <= 24) */
  float rel_step;       /* Q8/Q4: b */
  const float *steps;   /* Q8/Q4: a per group */
  const void *codes;    /* k codes: int8 (Q8, Q4: -8..7) or bf16 bits (BF16); 0 if escaped */
  size_t nesc;          /* escaped elements */
  const uint32_t *esc;  /* their increasing ordinals within the selection (< k) */
  const uint8_t *esc_vals; /* their values, nesc elements of the dtype */
} amber__qsel;

/* Largest body of q in a chunk of n elements of width w. */
size_t amber__qsparse_bound(size_t n, const amber__qsel *q, size_t w);
/* The largest valid body of k of n elements of width w (a reader's bound). */
size_t amber__qsparse_body_max(size_t n, size_t k, size_t w);
/* Writes the body of q; returns its size. */
size_t amber__qsparse_encode(uint8_t *body, const amber__qsel *q, size_t n, size_t w);
/* Validates a quantized body completely, then restores its elements onto dst (a
 * chunk of n elements of `dtype` holding the parent's values). `idx` and `esc` are
 * scratch for k indices each. AMBER_ECORRUPT if malformed or for a dtype that
 * has no quantized encoding. */
int amber__qsparse_apply(uint8_t *dst, const uint8_t *body, size_t len, size_t n, size_t k,
                         int dtype, uint32_t *idx, uint32_t *esc);

#endif

/*
 * quant.h - internal: the quantizer of a delta chunk (see quant.c). After the scan
 * has selected what a chunk stores under a quantized policy (and left the
 * reference alone at those elements), the quantizer turns each selected change
 * into a code and a step, moves the reference to exactly what a restore will
 * decode, and stores whole whatever the codes cannot carry within the bound.
 */
#ifndef AMBER_QUANT_H
#define AMBER_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "codec.h"
#include "policy.h"
#include "scan.h"

/* The step is this share of the bound (a threshold's, or a budget's cut): a code
 * of 1 restores a change of half the bound, so a change just past the bound
 * becomes 2 steps and what is left is at most a quarter of the bound. */
#define AMBER__QSTEP_SHARE 0.5

/* Where the quantizer puts its outputs: buffers of the caller, each large
 * enough for k selected elements (codes: 2k bytes; steps: one float (the writer
 * uses one step per chunk; the format allows one per group); esc: k; esc_vals: k
 * elements). */
typedef struct amber__qbuf {
  void *codes;
  float *steps;
  uint32_t *esc;
  uint8_t *esc_vals;
} amber__qbuf;

/* Quantizes the k selected elements (indices idx, live values vals, both as the
 * scan gathered them) of a chunk of `dtype` whose reference `ref` still holds the
 * old values at those indices, under policy p (p->qmode != 0). Fills *q (pointing
 * into buf) and moves every selected element of ref to the value a restore of q
 * yields. */
void amber__quantize(const amber__policy *p, int dtype, uint8_t *ref, const uint32_t *idx,
                     const uint8_t *vals, size_t k, const amber__qbuf *buf, amber__qsel *q);

/* A threshold policy of an f32 tensor can be quantized inside the scan's pass
 * (scan.c, AVX-512): fills *f for it and returns 1, or 0 when it cannot (the caller
 * then runs amber__quantize after the scan). After a scan that set f->done,
 * amber__qfuse_result makes the chunk's selection *q of its outputs. */
int amber__qfuse_init(amber__qfuse *f, const amber__policy *p, int dtype,
                      const amber__qbuf *buf);
void amber__qfuse_result(const amber__qfuse *f, const amber__policy *p, const uint32_t *idx,
                         size_t k, const amber__qbuf *buf, amber__qsel *q);

/* Tests: 0 makes every dtype take the generic code, so that the f32 code can be
 * checked against it; 1 the f32 loop; 2 (the default) also the AVX-512 budget loop. */
void amber__quant_use_fast(int on);

#endif /* AMBER_QUANT_H */

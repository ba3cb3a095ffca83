/*
 * scan.h - internal: the scan kernels of a delta save (see scan.c).
 */
#ifndef AMBER_SCAN_H
#define AMBER_SCAN_H

#include <stddef.h>
#include <stdint.h>

#include "amber.h"

#define AMBER__KEY_FORCED 0xFFFFFFFFu

enum { AMBER__SCAN_EXACT = 0, AMBER__SCAN_THRESHOLD = 1, AMBER__SCAN_BUDGET = 2 };

/* A threshold policy's quantization done inside the scan's pass (f32, AVX-512): the
 * same decisions as src/quant.c's, for each selected element as it is found. */
typedef struct amber__qfuse {
  float a, b;         /* the step of an element with reference r: a + b * |r| */
  float absf, relf;   /* +lead's reach: absf + relf * |r| (f32) */
  double absb, relb;  /* the bound, checked at the restored value v: absb + relb * |v| */
  int32_t qmax;       /* the largest code */
  int lead;
  int8_t *codes;      /* out: one per selected element (0 for an escape) */
  uint32_t *esc;      /* out: escaped ordinals */
  uint8_t *esc_vals;  /* out: their live values */
  float *xs, *rs;     /* scratch: the selected elements' live and reference values,
                         up to n each (neither may overlap esc_vals) */
  size_t nesc;        /* out */
  int done;           /* out: the pass quantized (else the caller quantizes) */
} amber__qfuse;

typedef struct amber__scan_args {
  int kind;           /* AMBER__SCAN_* */
  int dtype;
  size_t n;           /* elements in the chunk */
  const void *live;   /* n elements, any alignment */
  void *ref;          /* n elements; selected ones are overwritten with live */
  double abs, rel;    /* threshold */
  double cap;         /* budget: changes above are always selected (INFINITY: none) */
  size_t budget;      /* budget: elements selected besides the forced ones */
  uint32_t *keys;     /* scratch for budget, n entries */
  uint32_t *idx;      /* out: selected indices, up to n */
  uint8_t *vals;      /* out: selected live values, up to n * width bytes */
  uint8_t *olds;      /* out (exact): their previous reference values; scratch for
                         budget, n * width bytes */
  int defer;          /* threshold, budget: leave the reference alone at the selected
                         elements (a quantized policy moves them itself, quant.c) */
  size_t share_k;     /* threshold with a share cap: keep at most this many (0: no cap),
                         the farthest over their bound first, plus all beyond `mult`
                         bounds; needs defer */
  double mult;
  amber__qfuse *fuse; /* with defer, a threshold may be quantized in the pass (NULL:
                         not); the selected values are then not gathered */
} amber__scan_args;

/* Selects the elements a delta stores under the policy, gathers their indices
 * and values and (unless `defer`) moves them into the reference, reading live and
 * reference once. Returns the number selected. */
size_t amber__scan(const amber__scan_args *a);
/* Value of one element of a float dtype as f64, the way the policies compare it
 * (tests use it). */
double amber__to_f64(int dtype, const void *p);
/* Tests: the most a scan may use of the fused f32 kernels: 2 AVX-512 (the
 * default), 1 AVX2, 0 only the portable kernels, so that each is checked against
 * the same properties. Set before any save runs. */
void amber__scan_use_simd(int level);

#endif

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

typedef struct amber__scan_args {
  int kind;           /* AMBER__SCAN_* */
  int dtype;
  size_t n;           /* elements in the chunk */
  const void *live;   /* n elements */
  void *ref;          /* n elements; selected ones are overwritten with live */
  double abs, rel;    /* threshold */
  double cap;         /* budget: changes above are always selected (INFINITY: none) */
  size_t budget;      /* budget: elements selected besides the forced ones */
  uint8_t *sel;       /* scratch, n bytes: 1 = selected */
  uint32_t *keys;     /* scratch for budget, n entries */
  uint32_t *idx;      /* out: selected indices, up to n */
  uint8_t *vals;      /* out: selected live values, up to n * width bytes */
} amber__scan_args;

/* Fills a->sel from live and reference under the policy; reads both once. */
void amber__scan_flags(const amber__scan_args *a);
/* Gathers the selected indices and values and updates the reference; returns k. */
size_t amber__scan_select(const amber__scan_args *a);
size_t amber__count_flags(const uint8_t *sel, size_t n);
/* Value of one element of a float dtype as f64, the way the policies compare it
 * (tests use it). */
double amber__to_f64(int dtype, const void *p);

#endif

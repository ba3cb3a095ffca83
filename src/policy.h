/*
 * policy.h - internal: policy rules of the writer (see amber_writer_add_policy).
 */
#ifndef AMBER_POLICY_H
#define AMBER_POLICY_H

#include <stddef.h>

#include "internal.h"

enum { AMBER__POL_EXACT = 0, AMBER__POL_THRESHOLD = 1, AMBER__POL_BUDGET = 2 };

typedef struct amber__policy {
  int kind;
  double abs, rel;  /* threshold: store when |x - ref| > abs + rel * |ref| */
  double frac, cap; /* budget: at most frac of the elements, plus all above cap */
  double share, mult; /* threshold "/SHARE:MULT": at most share of a chunk's elements (the
                         farthest over their bound first), plus all beyond mult bounds;
                         share 0: no cap */
  int qmode;        /* value code of the stored changes: 0 (whole values) or AMBER__QV_* */
  int lead;         /* quantized: the reference leads the change, to the bound's edge */
  int abs_unit, cap_unit; /* ABS, CAP written "Nu": N times the tensor's unit */
} amber__policy;

/* Room for a policy spec with its numbers written out (amber__policy_format). */
#define AMBER__SPEC_MAX 160

typedef struct amber__rule {
  char *pattern; /* NULL: every tensor */
  char *spec;    /* the SPEC text, recorded in the index */
  amber__policy policy;
} amber__rule;

typedef struct amber__rules {
  amber__rule *v;
  size_t n, cap;
} amber__rules;

/* Parses a SPEC without pattern ("threshold:1e-3@q4+lead"); -1 if malformed. */
int amber__policy_parse(const char *spec, amber__policy *p);
int amber__rules_add(amber__err *e, amber__rules *r, const char *rule);
/* Whether p has numbers in units of the tensor's unit. */
static inline int amber__policy_has_units(const amber__policy *p) {
  return p->abs_unit || p->cap_unit;
}
/* p for a tensor whose unit is `unit` (> 0): ABS and CAP in units multiplied. */
void amber__policy_scale(const amber__policy *p, double unit, amber__policy *out);
/* Writes p as a SPEC that amber__policy_parse reads back to the same numbers (no
 * units left); returns its length, or -1 if it does not fit `cap` bytes. */
int amber__policy_format(const amber__policy *p, char *buf, size_t cap);
void amber__rules_free(amber__rules *r);
/* The rule for a tensor, or NULL for exact (no match, or not a float dtype). */
const amber__rule *amber__rules_match(const amber__rules *r, const char *name, int dtype);

#endif

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
} amber__policy;

typedef struct amber__rule {
  char *pattern; /* NULL: every tensor */
  char *spec;    /* the SPEC text, recorded in the index */
  amber__policy policy;
} amber__rule;

typedef struct amber__rules {
  amber__rule *v;
  size_t n, cap;
} amber__rules;

/* Parses a SPEC without pattern; -1 if malformed. */
int amber__policy_parse(const char *spec, amber__policy *p);
int amber__rules_add(amber__err *e, amber__rules *r, const char *rule);
void amber__rules_free(amber__rules *r);
/* The rule for a tensor, or NULL for exact (no match, or not a float dtype). */
const amber__rule *amber__rules_match(const amber__rules *r, const char *name, int dtype);

#endif

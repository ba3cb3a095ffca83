/*
 * policy.c - parsing policy rules ("exact", "threshold:ABS[:REL]",
 * "budget:FRAC[:CAP]", optionally "PATTERN=" in front) and choosing the rule that
 * applies to a tensor: the last one whose glob matches its name. Integer and bool
 * tensors are always exact, whatever the rules say.
 */
#include <errno.h>
#include <fnmatch.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "policy.h"

/* Parses a non-negative finite number that spans [s, end). */
static int parse_num(const char *s, const char *end, double *out) {
  char buf[64];
  size_t n = (size_t)(end - s);
  if (n == 0 || n >= sizeof buf) return -1;
  memcpy(buf, s, n);
  buf[n] = 0;
  char *e;
  errno = 0;
  double v = strtod(buf, &e);
  if (*e || errno || !isfinite(v) || v < 0) return -1;
  *out = v;
  return 0;
}

int amber__policy_parse(const char *spec, amber__policy *p) {
  memset(p, 0, sizeof *p);
  if (!strcmp(spec, "exact")) {
    p->kind = AMBER__POL_EXACT;
    return 0;
  }
  const char *args;
  if (!strncmp(spec, "threshold:", 10)) {
    p->kind = AMBER__POL_THRESHOLD;
    args = spec + 10;
  } else if (!strncmp(spec, "budget:", 7)) {
    p->kind = AMBER__POL_BUDGET;
    args = spec + 7;
  } else {
    return -1;
  }
  const char *colon = strchr(args, ':');
  const char *end1 = colon ? colon : args + strlen(args);
  double a, b = 0;
  if (parse_num(args, end1, &a)) return -1;
  if (colon && parse_num(colon + 1, colon + 1 + strlen(colon + 1), &b)) return -1;
  if (p->kind == AMBER__POL_THRESHOLD) {
    p->abs = a;
    p->rel = b;
  } else {
    if (a > 1) return -1;
    p->frac = a;
    p->cap = colon ? b : INFINITY;
  }
  return 0;
}

int amber__rules_add(amber__err *e, amber__rules *r, const char *rule) {
  const char *eq = strrchr(rule, '=');
  const char *spec = eq ? eq + 1 : rule;
  amber__policy p;
  if (amber__policy_parse(spec, &p) != 0)
    return amber__fail(e, AMBER_EINVAL,
                       "bad policy '%s' (expected exact, threshold:ABS[:REL] or "
                       "budget:FRAC[:CAP], optionally PATTERN=SPEC)",
                       rule);
  if (eq && eq == rule)
    return amber__fail(e, AMBER_EINVAL, "bad policy '%s': empty pattern", rule);
  if (r->n == r->cap) {
    size_t cap = r->cap ? 2 * r->cap : 8;
    amber__rule *g = realloc(r->v, cap * sizeof *g);
    if (!g) return amber__fail(e, AMBER_ENOMEM, "out of memory");
    r->v = g;
    r->cap = cap;
  }
  amber__rule *x = &r->v[r->n];
  x->pattern = eq ? strndup(rule, (size_t)(eq - rule)) : NULL;
  x->spec = strdup(spec);
  if ((eq && !x->pattern) || !x->spec) {
    free(x->pattern);
    free(x->spec);
    return amber__fail(e, AMBER_ENOMEM, "out of memory");
  }
  x->policy = p;
  r->n++;
  return 0;
}

void amber__rules_free(amber__rules *r) {
  for (size_t i = 0; i < r->n; i++) {
    free(r->v[i].pattern);
    free(r->v[i].spec);
  }
  free(r->v);
  memset(r, 0, sizeof *r);
}

static int is_float(int dtype) {
  return dtype == AMBER_F32 || dtype == AMBER_F16 || dtype == AMBER_BF16 ||
         dtype == AMBER_F64 || dtype == AMBER_F8_E4M3 || dtype == AMBER_F8_E5M2;
}

const amber__rule *amber__rules_match(const amber__rules *r, const char *name, int dtype) {
  if (!is_float(dtype)) return NULL;
  for (size_t i = r->n; i-- > 0;)
    if (!r->v[i].pattern || fnmatch(r->v[i].pattern, name, 0) == 0) return &r->v[i];
  return NULL;
}

/*
 * policy.c - parsing policy rules ("exact", "threshold:ABS[:REL][/SHARE:MULT]",
 * "budget:FRAC[:CAP]", optionally with a value code "@q8", "@q4" or "@bf16" and
 * "+lead" after it, optionally "PATTERN=" in front) and choosing the rule that
 * applies to a tensor: the last one whose glob matches its name. Integer and bool
 * tensors are always exact, whatever the rules say.
 */
#include <errno.h>
#include <fnmatch.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "codec.h"
#include "internal.h"
#include "policy.h"

/* Parses a non-negative finite number that spans [s, end); with `unit` not NULL
 * it may end in 'u' (in units of the tensor's unit), which sets *unit. */
static int parse_num(const char *s, const char *end, double *out, int *unit) {
  char buf[64];
  size_t n = (size_t)(end - s);
  if (unit && n > 1 && end[-1] == 'u') {
    *unit = 1;
    n--;
  }
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

/* The value code after '@' in [s, end): "q8", "q4" or "bf16", then "+lead". */
static int parse_code(const char *s, const char *end, amber__policy *p) {
  size_t n = (size_t)(end - s);
  const char *plus = memchr(s, '+', n);
  size_t cn = plus ? (size_t)(plus - s) : n;
  if (cn == 2 && !strncmp(s, "q8", 2)) p->qmode = AMBER__QV_Q8;
  else if (cn == 2 && !strncmp(s, "q4", 2)) p->qmode = AMBER__QV_Q4;
  else if (cn == 4 && !strncmp(s, "bf16", 4)) p->qmode = AMBER__QV_BF16;
  else return -1;
  if (plus) {
    if ((size_t)(end - plus) != 5 || strncmp(plus, "+lead", 5)) return -1;
    /* bf16 codes carry the change itself; a lead needs a bound to stop at */
    if (p->qmode == AMBER__QV_BF16 || (p->kind == AMBER__POL_BUDGET && isinf(p->cap)))
      return -1;
    p->lead = 1;
  }
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
  const char *at = strchr(args, '@');
  const char *end = at ? at : args + strlen(args);
  /* a threshold's share cap: "/SHARE:MULT", 0 < SHARE <= 1, MULT >= 1 */
  const char *slash = memchr(args, '/', (size_t)(end - args));
  if (slash) {
    if (p->kind != AMBER__POL_THRESHOLD) return -1;
    const char *c2 = memchr(slash + 1, ':', (size_t)(end - slash - 1));
    if (!c2 || parse_num(slash + 1, c2, &p->share, NULL) || parse_num(c2 + 1, end, &p->mult, NULL))
      return -1;
    if (!(p->share > 0 && p->share <= 1) || !(p->mult >= 1)) return -1;
    end = slash;
  }
  const char *colon = memchr(args, ':', (size_t)(end - args));
  const char *end1 = colon ? colon : end;
  double a, b = 0;
  int thr = p->kind == AMBER__POL_THRESHOLD;
  /* units: a threshold's ABS, a budget's CAP */
  if (parse_num(args, end1, &a, thr ? &p->abs_unit : NULL)) return -1;
  if (colon && parse_num(colon + 1, end, &b, thr ? NULL : &p->cap_unit)) return -1;
  if (thr) {
    p->abs = a;
    p->rel = b;
  } else {
    if (a > 1) return -1;
    p->frac = a;
    p->cap = colon ? b : INFINITY;
  }
  if (at && parse_code(at + 1, at + strlen(at), p)) return -1;
  return 0;
}

void amber__policy_scale(const amber__policy *p, double unit, amber__policy *out) {
  *out = *p;
  if (p->abs_unit) out->abs = p->abs * unit;
  if (p->cap_unit) out->cap = p->cap * unit;
  out->abs_unit = out->cap_unit = 0;
}

int amber__policy_format(const amber__policy *p, char *buf, size_t cap) {
  static const char *codes[] = {"", "@q8", "@q4", "@bf16"};
  int n;
  if (p->kind == AMBER__POL_EXACT)
    n = snprintf(buf, cap, "exact");
  else if (p->kind == AMBER__POL_THRESHOLD && p->share > 0)
    n = snprintf(buf, cap, "threshold:%.17g:%.17g/%.17g:%.17g%s%s", p->abs, p->rel, p->share,
                 p->mult, codes[p->qmode], p->lead ? "+lead" : "");
  else if (p->kind == AMBER__POL_THRESHOLD)
    n = snprintf(buf, cap, "threshold:%.17g:%.17g%s%s", p->abs, p->rel, codes[p->qmode],
                 p->lead ? "+lead" : "");
  else if (isinf(p->cap))
    n = snprintf(buf, cap, "budget:%.17g%s", p->frac, codes[p->qmode]);
  else
    n = snprintf(buf, cap, "budget:%.17g:%.17g%s%s", p->frac, p->cap, codes[p->qmode],
                 p->lead ? "+lead" : "");
  return n < 0 || (size_t)n >= cap ? -1 : n;
}

int amber__rules_add(amber__err *e, amber__rules *r, const char *rule) {
  const char *eq = strrchr(rule, '=');
  const char *spec = eq ? eq + 1 : rule;
  amber__policy p;
  if (amber__policy_parse(spec, &p) != 0)
    return amber__fail(e, AMBER_EINVAL,
                       "bad policy '%s' (expected exact, threshold:ABS[:REL][/SHARE:MULT] "
                       "(0 < SHARE <= 1, MULT >= 1) or budget:FRAC[:CAP] (ABS and CAP may end "
                       "in u), optionally followed by "
                       "@q8, @q4 or @bf16 and +lead, optionally PATTERN=SPEC)",
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

int amber_policy_check(const char *rule) {
  if (!rule) return amber__fail(NULL, AMBER_EINVAL, "amber_policy_check: NULL rule");
  amber__rules r = {0};
  int rc = amber__rules_add(NULL, &r, rule);
  amber__rules_free(&r);
  return rc;
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

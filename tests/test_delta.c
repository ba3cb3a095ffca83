/*
 * test_delta.c - delta checkpoints keep their policy's promise (docs/DESIGN.md,
 * Guarantees 1, 2 and 4) over random training-like trajectories.
 *
 * A trajectory declares tensors of every float dtype (scalar, empty, odd sizes,
 * sizes that straddle small chunks) plus integer and bool tensors, then for each
 * step mutates the live values like an optimizer would (small drifts on most
 * elements, a few large jumps, NaN/Inf set and cleared, untouched elements,
 * integer increments), saves, and opens a reader on that step to check:
 *  - exact (default or explicit): the restore is bit-identical to the live bytes;
 *  - threshold:ABS:REL: |x - r| <= ABS + REL*|r| for every element, in double via
 *    amber__to_f64 as the policies compare, and non-finite values bit-identical;
 *  - budget:FRAC[:CAP]: every element within CAP, at most floor(FRAC*n) (at least
 *    1) stored per chunk besides the forced ones, and convergence once the values
 *    stop moving;
 *  - integer and bool tensors exact under any policy;
 *  - per chunk of each delta file: `stored` equals the number of elements whose
 *    restored bits changed, UNCHANGED chunks change nothing.
 * Then: restores of earlier steps, the full/delta cadence, reopening a store, the
 * size of deltas, and corrupted, missing or substituted parents.
 *
 * Everything is seeded; a failure prints the seed, step, tensor and element.
 */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <unistd.h>

#include "codec.h"
#include "ckpt.h"
#include "internal.h"
#include "scan.h"
#include "testutil.h"

/* The sanitizer builds run the same properties on fewer seeds and steps. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define HEAVY 0
#else
#define HEAVY 1
#endif
#define SEEDS (HEAVY ? 8 : 2)
#define LONG_STEPS (HEAVY ? 120 : 100)

/* ---- policies as the test expects them ---- */

enum { P_EXACT, P_THR, P_BUD };

typedef struct {
  int kind;
  double abs, rel;  /* threshold */
  double frac, cap; /* budget; cap INFINITY when absent */
  const char *spec; /* what the index must record */
} pol;

static const pol EXACT = {P_EXACT, 0, 0, 0, 0, "exact"};

static pol thr(double a, double r, const char *spec) {
  pol p = {P_THR, a, r, 0, 0, spec};
  return p;
}
static pol bud(double f, double c, const char *spec) {
  pol p = {P_BUD, 0, 0, f, c, spec};
  return p;
}

static int is_float(int dt) {
  return dt == AMBER_F32 || dt == AMBER_F16 || dt == AMBER_BF16 || dt == AMBER_F64 ||
         dt == AMBER_F8_E4M3 || dt == AMBER_F8_E5M2;
}

static const int FLOATS[] = {AMBER_F32, AMBER_F16,     AMBER_BF16,
                             AMBER_F64, AMBER_F8_E4M3, AMBER_F8_E5M2};
#define NFLOATS 6

/* Failure details are printed for the first few only. */
static int details;
#define DETAIL(...)                                                                  \
  do {                                                                               \
    if (details++ < 25) fprintf(stderr, "    " __VA_ARGS__);                         \
  } while (0)

/* ---- element helpers ---- */

static uint64_t get_bits(const uint8_t *p, size_t w) {
  uint64_t v = 0;
  for (size_t b = w; b-- > 0;) v = (v << 8) | p[b];
  return v;
}
static void put_bits(uint8_t *p, uint64_t v, size_t w) {
  for (size_t b = 0; b < w; b++) p[b] = (uint8_t)(v >> (8 * b));
}
static double val(int dt, const uint8_t *p) {
  return amber__to_f64(dt, p);
}
static void put_f(int dt, uint8_t *p, double v) {
  if (dt == AMBER_F64) {
    memcpy(p, &v, 8);
  } else {
    float f = (float)v;
    memcpy(p, &f, 4);
  }
}
static double urand(uint64_t *s) {
  return (double)(tu_rand(s) >> 11) * 0x1p-53;
}

/* Whether restored `r` is an acceptable restore of live `x` under `p`. */
static int elem_ok(int dt, const pol *p, const uint8_t *x, const uint8_t *r, size_t w) {
  if (!memcmp(x, r, w)) return 1;
  if (!is_float(dt) || p->kind == P_EXACT) return 0;
  double xv = val(dt, x), rv = val(dt, r);
  if (!isfinite(xv) || !isfinite(rv)) return 0; /* non-finite: bit-identical */
  double d = fabs(xv - rv);
  if (p->kind == P_THR) return d <= p->abs + p->rel * fabs(rv);
  return d <= p->cap;
}

/* The scan compares f32 and narrower values in f32 with bounds shrunk by 2^-20
 * (scan.c), so that rounding can only make it store more than the exact rule.
 * The checks of what a delta stored ("not more than needed") allow that much. */
#define NEAR(b) ((b) * (1 - 0x1p-16) - 1e-30)

/* Whether the policy may have to store live `x` against reference `r`: a
 * non-finite change, or (budget) a change at or near above CAP. */
static int forced(int dt, const pol *p, const uint8_t *x, const uint8_t *r, size_t w) {
  if (!memcmp(x, r, w)) return 0;
  double xv = val(dt, x), rv = val(dt, r);
  if (!isfinite(xv) || !isfinite(rv)) return 1;
  return p->kind == P_BUD && fabs(xv - rv) > NEAR(p->cap);
}

/* Whether a threshold policy may store x against r: the change exceeds the bound
 * or comes within rounding of it. */
static int thr_exceeds(int dt, const pol *p, const uint8_t *x, const uint8_t *r, size_t w) {
  if (forced(dt, p, x, r, w)) return 1;
  double xv = val(dt, x), rv = val(dt, r);
  return fabs(xv - rv) > NEAR(p->abs + p->rel * fabs(rv));
}

/* ---- mutations ---- */

/* A random finite value. Without `tiny`, small floats stay at 0 or >= 1e-4 in
 * magnitude and f32/f64 values are never subnormal. */
static void rand_finite(int dt, uint8_t *p, uint64_t *rng, int tiny) {
  size_t w = amber_dtype_size(dt);
  if (dt == AMBER_F32 || dt == AMBER_F64) {
    uint64_t r = tu_rand(rng);
    double v;
    if (r % 64 == 0) v = 0;
    else if (tiny && r % 64 == 1) v = (dt == AMBER_F32 ? 1e-42 : 1e-315) * (double)((r >> 40) % 500);
    else v = (urand(rng) * 2 - 1) * pow(10, urand(rng) * 6 - 3);
    put_f(dt, p, v);
    return;
  }
  for (;;) {
    put_bits(p, tu_rand(rng), w);
    double v = val(dt, p);
    if (!isfinite(v)) continue;
    if (!tiny && v != 0 && (fabs(v) < 1e-4 || fabs(v) > 1e30)) continue;
    return;
  }
}

static void set_nonfinite(int dt, uint8_t *p, uint64_t *rng) {
  uint64_t r = tu_rand(rng);
  int kind = (int)(r % 3); /* 0 NaN, 1 Inf */
  uint64_t sign = (r >> 8) & 1, pay = r >> 16;
  switch (dt) {
  case AMBER_F32:
    put_bits(p, (sign << 31) | (kind ? 0x7f800000u : 0x7fc00000u | (pay & 0x3fffff)), 4);
    break;
  case AMBER_F64:
    put_bits(p, (sign << 63) | (kind ? 0x7ff0000000000000u : 0x7ff8000000000000u |
                                                                 (pay & 0x7ffffffffffffu)),
             8);
    break;
  case AMBER_F16: put_bits(p, (sign << 15) | (kind ? 0x7c00u : 0x7e00u | (pay & 0x1ff)), 2); break;
  case AMBER_BF16: put_bits(p, (sign << 15) | (kind ? 0x7f80u : 0x7fc0u | (pay & 0x3f)), 2); break;
  case AMBER_F8_E5M2: put_bits(p, (sign << 7) | (kind ? 0x7cu : 0x7eu | (pay & 1)), 1); break;
  default: put_bits(p, (sign << 7) | 0x7fu, 1); break; /* e4m3 has no Inf */
  }
}

/* A small move: relative and absolute noise for f32/f64, one or two units in the
 * last place for the small floats (never across the sign or into NaN/Inf). */
static void drift(int dt, uint8_t *p, uint64_t *rng, int tiny) {
  if (dt == AMBER_F32 || dt == AMBER_F64) {
    double v = val(dt, p);
    v += v * (urand(rng) * 2 - 1) * 2e-3 + (urand(rng) * 2 - 1) * 1e-5;
    put_f(dt, p, v);
    return;
  }
  size_t w = amber_dtype_size(dt);
  uint64_t r = tu_rand(rng), old = get_bits(p, w), sign = 1ull << (8 * w - 1);
  uint64_t mask = w == 1 ? 0xff : 0xffff, d = 1 + (r % 2);
  uint64_t nb = ((r >> 8) & 1 ? old + d : old - d) & mask;
  if ((nb ^ old) & sign) return;
  put_bits(p, nb, w);
  double v = val(dt, p);
  if (!isfinite(v) || (!tiny && v != 0 && fabs(v) < 1e-4)) put_bits(p, old, w);
}

static void mutate_float(int dt, uint8_t *p, uint64_t *rng, int tiny) {
  if (!isfinite(val(dt, p))) {
    if (urand(rng) < 0.3) rand_finite(dt, p, rng, tiny);
    return;
  }
  double u = urand(rng);
  if (u < 0.004) set_nonfinite(dt, p, rng);
  else if (u < 0.014) rand_finite(dt, p, rng, tiny); /* a large jump */
  else if (u < 0.6) drift(dt, p, rng, tiny);
  /* else unchanged */
}

static void mutate_int(int dt, uint8_t *p, uint64_t *rng) {
  size_t w = amber_dtype_size(dt);
  uint64_t r = tu_rand(rng);
  if (dt == AMBER_BOOL) {
    if (r % 10 == 0) p[0] = (uint8_t)!p[0];
    return;
  }
  if (r % 5) return;
  put_bits(p, get_bits(p, w) + (r >> 32) % 2001 - 1000, w);
}

/* ---- a trajectory ---- */

typedef struct {
  char name[48];
  int dtype;
  uint32_t ndim;
  int64_t shape[2];
  size_t n, w, nb;
  uint8_t *live, *prev, *got; /* prev: the restore of the previous step */
  uint8_t *live_mem;          /* live is live_mem + 1 when misaligned */
  pol p;                      /* the policy this tensor must follow */
} tens;

typedef struct {
  uint64_t seed, rng;
  int tiny;
  int misalign; /* live buffers at odd addresses, as inside a mapped safetensors file */
  const char *dir;
  amber_store *st;
  amber_writer *w;
  tens t[64];
  size_t n;
  int have_prev;
} world;

static tens *add_tensor(world *W, const char *name, int dt, uint32_t ndim, int64_t d0,
                        int64_t d1, const pol *p) {
  tens *t = &W->t[W->n++];
  memset(t, 0, sizeof *t);
  snprintf(t->name, sizeof t->name, "%s", name);
  t->dtype = dt;
  t->ndim = ndim;
  t->shape[0] = d0;
  t->shape[1] = d1;
  t->n = 1;
  for (uint32_t d = 0; d < ndim; d++) t->n *= (size_t)t->shape[d];
  t->w = amber_dtype_size(dt);
  t->nb = t->n * t->w;
  t->live_mem = calloc(t->nb + 2, 1);
  t->live = t->live_mem + (W->misalign ? 1 : 0);
  t->prev = calloc(t->nb + 1, 1);
  t->got = calloc(t->nb + 1, 1);
  t->p = is_float(dt) ? *p : EXACT;
  for (size_t i = 0; i < t->n; i++) {
    if (is_float(dt)) rand_finite(dt, t->live + i * t->w, &W->rng, W->tiny);
    else if (dt == AMBER_BOOL) t->live[i] = (uint8_t)(tu_rand(&W->rng) & 1);
    else put_bits(t->live + i * t->w, tu_rand(&W->rng), t->w);
  }
  return t;
}

/* Every float dtype as a scalar, an empty tensor, an odd 1-D size and a 2-D size,
 * the sizes around multiples of `chunk`; then integer and bool tensors. */
static void add_standard(world *W, uint64_t chunk, const pol *p) {
  int64_t C = (int64_t)chunk;
  const int64_t cand[] = {C - 1, C, C + 1, 2 * C + 3, 7, 3 * C - 5};
  char name[48];
  for (int k = 0; k < NFLOATS; k++) {
    const char *dn = amber_dtype_name(FLOATS[k]);
    snprintf(name, sizeof name, "%s.scalar", dn);
    add_tensor(W, name, FLOATS[k], 0, 0, 0, p);
    snprintf(name, sizeof name, "%s.empty", dn);
    add_tensor(W, name, FLOATS[k], 2, 0, 3, p);
    snprintf(name, sizeof name, "%s.odd", dn);
    add_tensor(W, name, FLOATS[k], 1, cand[tu_rand(&W->rng) % 6], 0, p);
    snprintf(name, sizeof name, "%s.mat", dn);
    add_tensor(W, name, FLOATS[k], 2, 3, C / 2 + 1, p);
  }
  add_tensor(W, "int.i64", AMBER_I64, 1, 5, 0, p);
  add_tensor(W, "int.i32", AMBER_I32, 1, C + 1, 0, p);
  add_tensor(W, "int.i16", AMBER_I16, 1, 17, 0, p);
  add_tensor(W, "int.i8", AMBER_I8, 1, 3, 0, p);
  add_tensor(W, "int.u8", AMBER_U8, 1, 2 * C + 1, 0, p);
  add_tensor(W, "int.bool", AMBER_BOOL, 1, C - 1, 0, p);
  add_tensor(W, "int.u16", AMBER_U16, 1, C + 3, 0, p);
  add_tensor(W, "int.u32", AMBER_U32, 2, 2, C / 2 + 1, p);
  add_tensor(W, "int.u64", AMBER_U64, 1, 9, 0, p);
  add_tensor(W, "int.step", AMBER_I64, 0, 0, 0, p);
}

static void world_init(world *W, uint64_t seed, int tiny) {
  memset(W, 0, sizeof *W);
  W->seed = seed;
  W->rng = seed * 0x9E3779B97F4A7C15ull + 1;
  W->tiny = tiny;
  W->dir = tu_tmpdir();
}

/* Opens store and writer, adds `rules` (NULL-terminated) and declares the tensors. */
static int world_open(world *W, const amber_writer_opts *wo, const char *const *rules) {
  int ok = 1;
  CHECK_OK(amber_store_open(&W->st, W->dir, NULL));
  if (!W->st) return 0;
  CHECK_OK(amber_writer_open(&W->w, W->st, wo));
  if (!W->w) return 0;
  for (size_t i = 0; rules && rules[i]; i++) CHECK_OK(amber_writer_add_policy(W->w, rules[i]));
  for (size_t i = 0; i < W->n; i++) {
    tens *t = &W->t[i];
    int rc = amber_writer_add(W->w, t->name, t->dtype, t->ndim, t->shape, t->live, NULL);
    CHECK_OK(rc);
    ok &= rc == 0;
  }
  return ok;
}

static void world_close(world *W) {
  amber_writer_close(W->w);
  amber_store_close(W->st);
  W->w = NULL;
  W->st = NULL;
}

static void world_free(world *W) {
  for (size_t i = 0; i < W->n; i++) {
    free(W->t[i].live_mem);
    free(W->t[i].prev);
    free(W->t[i].got);
  }
  W->n = 0;
}

static void world_mutate(world *W) {
  for (size_t i = 0; i < W->n; i++) {
    tens *t = &W->t[i];
    for (size_t e = 0; e < t->n; e++) {
      if (is_float(t->dtype)) mutate_float(t->dtype, t->live + e * t->w, &W->rng, W->tiny);
      else mutate_int(t->dtype, t->live + e * t->w, &W->rng);
    }
  }
}

/* Elements a budget may store in a chunk of n besides the forced ones:
 * floor(FRAC*n), or one where that is 0 but FRAC is not (a chunk smaller than
 * 1/FRAC must still make progress; see the tail-chunk test below). */
static uint64_t budget_allows(double frac, size_t n) {
  uint64_t b = (uint64_t)(frac * (double)n);
  return b ? b : (frac > 0 && n > 0);
}

/* Checks each chunk entry of delta `step` against what the restore changed. */
static void check_delta_chunks(world *W, uint64_t step) {
  amber__err e;
  amber__ckpt c;
  int rc = amber__ckpt_open(&e, W->st, step, &c);
  CHECK_OK(rc);
  if (rc) return;
  CHECK(c.hdr.kind == AMBER_KIND_DELTA);
  for (size_t i = 0; i < W->n && i < c.ix.n_tensors; i++) {
    const tens *t = &W->t[i];
    const amber__tensor *xt = &c.ix.tensors[i];
    for (uint64_t j = 0; j < xt->n_chunks; j++) {
      const amber__chunk *ch = &c.ix.chunks[xt->first_chunk + j];
      size_t n = (size_t)amber__chunk_n(xt, j), o = (size_t)(j * xt->chunk_elems);
      size_t changed = 0, nforced = 0, overstored = 0, over_at = 0;
      for (size_t k = o; k < o + n; k++) {
        const uint8_t *x = t->live + k * t->w, *g = t->got + k * t->w, *r = t->prev + k * t->w;
        int ch_k = memcmp(g, r, t->w) != 0;
        changed += (size_t)ch_k;
        nforced += (size_t)forced(t->dtype, &t->p, x, r, t->w);
        if (ch_k && t->p.kind == P_THR && !thr_exceeds(t->dtype, &t->p, x, r, t->w) &&
            !overstored++)
          over_at = k;
      }
      int ok = 1;
      switch (ch->encoding) {
      case AMBER__ENC_UNCHANGED: ok = ch->stored == 0 && ch->size == 0 && changed == 0; break;
      case AMBER__ENC_SPARSE:
      case AMBER__ENC_XOR_ZSTD: ok = ch->stored == changed && ch->size > 0; break;
      case AMBER__ENC_RAW: ok = ch->stored == n && ch->size == n * t->w; break;
      default: ok = 0;
      }
      if (ok && ch->encoding == AMBER__ENC_SPARSE && t->p.kind == P_THR) ok = overstored == 0;
      if (ok && ch->encoding != AMBER__ENC_RAW && t->p.kind == P_BUD)
        ok = ch->stored <= budget_allows(t->p.frac, n) + nforced;
      CHECK(ok);
      if (!ok)
        DETAIL("seed %" PRIu64 " step %" PRIu64 " '%s' chunk %" PRIu64 ": encoding %u stored %" PRIu64
               " size %" PRIu64 ", restore changed %zu of %zu (forced %zu, overstored %zu)\n",
               W->seed, step, t->name, j, ch->encoding, ch->stored, ch->size, changed, n,
               nforced, overstored);
      if (!ok && overstored) {
        const uint8_t *x = t->live + over_at * t->w, *r = t->prev + over_at * t->w;
        DETAIL("  [%zu] live %a (0x%" PRIx64 ") was stored against reference %a (0x%" PRIx64
               "): |x - r| = %a, bound %a\n",
               over_at, val(t->dtype, x), get_bits(x, t->w), val(t->dtype, r), get_bits(r, t->w),
               fabs(val(t->dtype, x) - val(t->dtype, r)),
               t->p.abs + t->p.rel * fabs(val(t->dtype, r)));
      }
    }
  }
  amber__ckpt_close(&c);
}

/* Opens a reader on `step` and checks every tensor against the live values; the
 * restore becomes `prev` for the next step. Returns the checkpoint's kind. */
static int check_step(world *W, uint64_t step) {
  amber_reader *r = NULL;
  CHECK_OK(amber_reader_open(&r, W->st, step, NULL));
  if (!r) return -1;
  amber_ckpt_info ci;
  CHECK_OK(amber_reader_ckpt_info(r, &ci));
  CHECK(ci.step == step && amber_reader_step(r) == step);
  CHECK(amber_reader_count(r) == W->n);
  for (size_t i = 0; i < W->n && i < amber_reader_count(r); i++) {
    tens *t = &W->t[i];
    amber_tensor_info ti;
    CHECK_OK(amber_reader_info(r, i, &ti));
    CHECK(!strcmp(ti.name, t->name) && ti.dtype == t->dtype && ti.nbytes == t->nb);
    CHECK(ti.stored_elems <= ti.nelems);
    CHECK(ti.policy && !strcmp(ti.policy, t->p.spec));
    if (!ti.policy || strcmp(ti.policy, t->p.spec))
      DETAIL("'%s' records policy '%s', expected '%s'\n", t->name, ti.policy ? ti.policy : "(null)",
             t->p.spec);
    if (ci.kind == AMBER_KIND_FULL) CHECK(ti.stored_elems == ti.nelems);
    memset(t->got, 0xA5, t->nb);
    CHECK_OK(amber_reader_read(r, i, t->got, t->nb));
    const pol *p = ci.kind == AMBER_KIND_FULL ? &EXACT : &t->p; /* a full is exact */
    size_t bad = 0, first = 0;
    for (size_t e = 0; e < t->n; e++)
      if (!elem_ok(t->dtype, p, t->live + e * t->w, t->got + e * t->w, t->w) && !bad++) first = e;
    CHECK(bad == 0);
    if (bad) {
      const uint8_t *x = t->live + first * t->w, *g = t->got + first * t->w;
      DETAIL("seed %" PRIu64 " step %" PRIu64 " '%s' (%s, %s): %zu bad elements; [%zu] live %a "
             "(0x%" PRIx64 ") restored %a (0x%" PRIx64 ")\n",
             W->seed, step, t->name, amber_dtype_name(t->dtype), p->spec, bad, first,
             is_float(t->dtype) ? val(t->dtype, x) : 0.0, get_bits(x, t->w),
             is_float(t->dtype) ? val(t->dtype, g) : 0.0, get_bits(g, t->w));
    }
  }
  amber_reader_close(r);
  if (ci.kind == AMBER_KIND_DELTA) {
    CHECK(W->have_prev);
    if (W->have_prev) check_delta_chunks(W, step);
  }
  for (size_t i = 0; i < W->n; i++) memcpy(W->t[i].prev, W->t[i].got, W->t[i].nb);
  W->have_prev = 1;
  return (int)ci.kind;
}

static int save_check(world *W, uint64_t step, uint32_t flags) {
  int rc = amber_writer_save(W->w, step, flags);
  CHECK_OK(rc);
  if (rc) return -1;
  return check_step(W, step);
}

/* Runs `steps` steps of a trajectory under one policy for every float tensor;
 * counts the kinds saved. Some steps change nothing, to exercise UNCHANGED. */
static int g_misalign;

static void run_trajectory(uint64_t seed, uint64_t chunk, const char *rule, const pol *p,
                           int steps, uint32_t full_every, double full_share, int tiny,
                           int *nfull) {
  world W;
  world_init(&W, seed, tiny);
  W.misalign = g_misalign;
  add_standard(&W, chunk, p);
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.chunk_elems = chunk;
  wo.full_every = full_every;
  wo.full_share = full_share;
  const char *rules[] = {rule, NULL};
  if (world_open(&W, &wo, rules)) {
    int fulls = 0, f0 = tu_failures;
    for (int s = 1; s <= steps && tu_failures - f0 < 20; s++) {
      if (s > 1 && s % 9 != 0) world_mutate(&W);
      int kind = save_check(&W, (uint64_t)s, 0);
      fulls += kind == AMBER_KIND_FULL;
      if (s == 1) CHECK(kind == AMBER_KIND_FULL);
    }
    if (nfull) *nfull = fulls;
    amber_reader *r = NULL;
    CHECK_OK(amber_reader_open(&r, W.st, AMBER_LATEST, NULL));
    if (r) CHECK_OK(amber_reader_verify(r));
    amber_reader_close(r);
  }
  world_close(&W);
  world_free(&W);
  tu_rm_rf(W.dir);
}

/* ---- the properties ---- */

static void test_exact_policy_restores_bit_exact_every_step(void) {
  for (uint64_t seed = 1; seed <= SEEDS; seed++) {
    /* no rule (default exact) and an explicit "exact" rule */
    const char *rule = seed % 2 ? NULL : "exact";
    run_trajectory(seed, seed % 3 ? 64 : 1000, rule, &EXACT, HEAVY ? 30 : 15, 7, 0, 1, NULL);
  }
}

static void test_threshold_bound_holds_every_step_of_long_chains(void) {
  const pol pols[] = {thr(1e-3, 1e-2, "threshold:1e-3:1e-2"), thr(0.05, 0, "threshold:0.05"),
                      thr(0, 1e-3, "threshold:0:1e-3"), thr(0, 0, "threshold:0:0")};
  for (uint64_t seed = 1; seed <= SEEDS; seed++) {
    const pol *p = &pols[seed % 4];
    int nfull = 0;
    /* long chains: one full, then only deltas */
    run_trajectory(100 + seed, seed % 2 ? 64 : 1000, p->spec, p, LONG_STEPS, UINT32_MAX, -1,
                   1, &nfull);
    CHECK(nfull == 1);
  }
  /* and with the default cadence, fulls in between */
  const pol loose = thr(1e-2, 1e-2, "threshold:1e-2:1e-2");
  run_trajectory(199, 64, "*=threshold:1e-2:1e-2", &loose, 40, 0, 0, 1, NULL);
}

static void test_budget_within_cap_every_step(void) {
  const pol pols[] = {bud(0.1, 0.01, "budget:0.1:0.01"), bud(0.02, 0.5, "budget:0.02:0.5"),
                      bud(0, 1e-3, "budget:0:1e-3"), bud(1, 0, "budget:1:0")};
  for (uint64_t seed = 1; seed <= SEEDS; seed++) {
    const pol *p = &pols[seed % 4];
    int nfull = 0;
    run_trajectory(200 + seed, seed % 2 ? 64 : 1000, p->spec, p, HEAVY ? 100 : 40, UINT32_MAX,
                   -1, 1, &nfull);
    CHECK(nfull == 1);
  }
}

/* Without CAP nothing is bounded per step, but what is left behind is only
 * deferred: once the values stop moving, each save stores the largest remaining
 * differences, and the restore reaches the live values. Only tensors whose every
 * chunk has a budget of at least one element can converge. */
static void converge_run(uint64_t seed, uint64_t chunk, double frac, const char *rule) {
  const char *eq = strchr(rule, '=');
  pol p = bud(frac, INFINITY, eq ? eq + 1 : rule);
  world W;
  world_init(&W, seed, 0);
  add_standard(&W, chunk, &p);
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.chunk_elems = chunk;
  wo.full_every = UINT32_MAX;
  wo.full_share = -1;
  const char *rules[] = {rule, NULL};
  if (!world_open(&W, &wo, rules)) goto out;
  uint64_t step = 1;
  for (; step <= 30; step++) {
    if (step > 1) world_mutate(&W);
    save_check(&W, step, 0);
  }
  /* frozen from here: enough saves for the slowest chunk that can converge */
  size_t last_diff[64];
  int rounds = 1;
  for (size_t i = 0; i < W.n; i++) {
    last_diff[i] = SIZE_MAX;
    size_t sizes[2] = {W.t[i].n < chunk ? W.t[i].n : chunk, W.t[i].n % chunk};
    for (int k = 0; k < 2; k++) {
      size_t b = (size_t)(frac * (double)sizes[k]);
      if (b && (int)((sizes[k] + b - 1) / b) + 1 > rounds) rounds = (int)((sizes[k] + b - 1) / b) + 1;
    }
  }
  for (int k = 0; k < rounds; k++, step++) {
    save_check(&W, step, 0);
    for (size_t i = 0; i < W.n; i++) {
      tens *t = &W.t[i];
      size_t diff = 0;
      for (size_t e = 0; e < t->n; e++) {
        const uint8_t *x = t->live + e * t->w, *g = t->got + e * t->w;
        diff += is_float(t->dtype) && isfinite(val(t->dtype, x))
                    ? val(t->dtype, x) != val(t->dtype, g)
                    : memcmp(x, g, t->w) != 0;
      }
      CHECK(diff <= last_diff[i]); /* never moves away */
      last_diff[i] = diff;
    }
  }
  for (size_t i = 0; i < W.n; i++) {
    tens *t = &W.t[i];
    int can = t->n == 0 || (uint64_t)(frac * (double)(t->n % chunk ? t->n % chunk : chunk)) >= 1;
    if (t->n > chunk && (uint64_t)(frac * (double)chunk) < 1) can = 0;
    if (!can) continue;
    CHECK(last_diff[i] == 0);
    if (last_diff[i])
      DETAIL("seed %" PRIu64 " '%s' (%zu elements, %s): %zu elements still differ after %d "
             "frozen saves\n",
             seed, t->name, t->n, rule, last_diff[i], rounds);
  }
out:
  world_close(&W);
  world_free(&W);
  tu_rm_rf(W.dir);
}

static void test_budget_without_cap_converges_once_values_stop(void) {
  converge_run(301, 64, 0.25, "budget:0.25");
  converge_run(302, 1000, 0.05, "budget:0.05");
  if (HEAVY) {
    converge_run(303, 64, 0.1, "*=budget:0.1");
    converge_run(304, 1000, 0.3, "budget:0.3");
  }
}

/* Differences too small for an f32 key (f64 values near 1e-300, f32 subnormals)
 * are deferred like any other: the chain must still reach the live values. */
static void test_budget_converges_for_tiny_values(void) {
  const char *dir = tu_tmpdir();
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, dir, NULL));
  amber_writer *w = NULL;
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.full_every = UINT32_MAX;
  wo.full_share = -1;
  CHECK_OK(amber_writer_open(&w, st, &wo));
  if (!w) {
    amber_store_close(st);
    return;
  }
  enum { N = 256 };
  double d[N];
  float f[N];
  int64_t n = N;
  for (int i = 0; i < N; i++) {
    d[i] = 1e-300 * (i + 1);
    f[i] = 1e-44f * (float)(i % 7 + 1);
  }
  CHECK_OK(amber_writer_add(w, "tiny.f64", AMBER_F64, 1, &n, d, NULL));
  CHECK_OK(amber_writer_add(w, "tiny.f32", AMBER_F32, 1, &n, f, NULL));
  CHECK_OK(amber_writer_add_policy(w, "budget:0.5"));
  CHECK_OK(amber_writer_save(w, 1, 0));
  for (int i = 0; i < N; i++) {
    d[i] *= 3;
    f[i] *= 2;
  }
  for (uint64_t s = 2; s <= 8; s++) CHECK_OK(amber_writer_save(w, s, 0));
  amber_reader *r = NULL;
  CHECK_OK(amber_reader_open(&r, st, AMBER_LATEST, NULL));
  if (r) {
    double gd[N];
    float gf[N];
    CHECK_OK(amber_reader_read(r, 0, gd, sizeof gd));
    CHECK_OK(amber_reader_read(r, 1, gf, sizeof gf));
    int bd = 0, bf = 0;
    for (int i = 0; i < N; i++) {
      bd += gd[i] != d[i];
      bf += gf[i] != f[i];
    }
    CHECK(bd == 0);
    CHECK(bf == 0);
    if (bd || bf)
      DETAIL("after 7 frozen saves under budget:0.5: %d of %d f64 elements near 1e-300 and %d "
             "f32 subnormals still at their step-1 values\n",
             bd, N, bf);
  }
  amber_reader_close(r);
  amber_writer_close(w);
  amber_store_close(st);
}

/* Restores the latest step of `st` into `buf` and counts the elements that differ
 * in value from `want` (n elements of dtype dt). */
static size_t count_off(amber_store *st, size_t index, int dt, const void *want, size_t n) {
  size_t w = amber_dtype_size(dt), off = 0;
  uint8_t *got = malloc(n * w + 1);
  amber_reader *r = NULL;
  CHECK_OK(amber_reader_open(&r, st, AMBER_LATEST, NULL));
  if (r) CHECK_OK(amber_reader_read(r, index, got, n * w));
  for (size_t i = 0; r && i < n; i++)
    off += val(dt, (const uint8_t *)want + i * w) != val(dt, got + i * w);
  amber_reader_close(r);
  free(got);
  return r ? off : n;
}

/* Changes that are all equal (an f64 step of exactly 0.1 everywhere, say) are
 * deferred like any others: repeated saves of frozen values must converge. */
static void test_budget_converges_when_all_changes_are_equal(void) {
  const char *dir = tu_tmpdir();
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, dir, NULL));
  amber_writer *w = NULL;
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.full_every = UINT32_MAX;
  wo.full_share = -1;
  CHECK_OK(amber_writer_open(&w, st, &wo));
  if (!w) {
    amber_store_close(st);
    return;
  }
  enum { N = 4096 };
  static double d[N];
  static float f[N];
  int64_t n = N;
  memset(d, 0, sizeof d);
  memset(f, 0, sizeof f);
  CHECK_OK(amber_writer_add(w, "eq.f64", AMBER_F64, 1, &n, d, NULL));
  CHECK_OK(amber_writer_add(w, "eq.f32", AMBER_F32, 1, &n, f, NULL));
  CHECK_OK(amber_writer_add_policy(w, "budget:0.1"));
  CHECK_OK(amber_writer_save(w, 1, 0));
  for (int i = 0; i < N; i++) {
    d[i] = 0.1;
    f[i] = 0.1f;
  }
  size_t off_d = N, off_f = N;
  for (uint64_t s = 2; s <= 14; s++) CHECK_OK(amber_writer_save(w, s, 0));
  off_d = count_off(st, 0, AMBER_F64, d, N);
  off_f = count_off(st, 1, AMBER_F32, f, N);
  CHECK(off_d == 0);
  CHECK(off_f == 0);
  if (off_d || off_f)
    DETAIL("13 saves after a change of 0.1 to all %d elements under budget:0.1: %zu f64 and %zu "
           "f32 elements still at 0\n",
           N, off_d, off_f);
  amber_writer_close(w);
  amber_store_close(st);
}

/* The bound holds for f32 subnormals too, where a bound computed in f32 rounds by
 * a whole unit: REL*|r| of 0.7 to 1 units of 2^-149 must not round up to one unit
 * and let a change of one unit go unstored. */
static void test_threshold_bound_holds_for_f32_subnormals(void) {
  const char *dir = tu_tmpdir();
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, dir, NULL));
  amber_writer *w = NULL;
  CHECK_OK(amber_writer_open(&w, st, NULL));
  if (!w) {
    amber_store_close(st);
    return;
  }
  enum { N = 64 };
  float x[N], got[N];
  int64_t n = N;
  for (int i = 0; i < N; i++) x[i] = (float)(50000 + 1000 * i) * 0x1p-149f; /* subnormal */
  CHECK_OK(amber_writer_add(w, "sub", AMBER_F32, 1, &n, x, NULL));
  CHECK_OK(amber_writer_add_policy(w, "threshold:0:1e-5"));
  CHECK_OK(amber_writer_save(w, 1, 0));
  for (int i = 0; i < N; i++) x[i] = nextafterf(x[i], 1); /* one unit, 2^-149, up */
  CHECK_OK(amber_writer_save(w, 2, 0));
  amber_reader *r = NULL;
  CHECK_OK(amber_reader_open(&r, st, 2, NULL));
  if (r) CHECK_OK(amber_reader_read(r, 0, got, sizeof got));
  int bad = 0, first = -1;
  for (int i = 0; r && i < N; i++)
    if (!(fabs((double)x[i] - (double)got[i]) <= 1e-5 * fabs((double)got[i])) && !bad++) first = i;
  CHECK(bad == 0);
  if (bad)
    DETAIL("threshold:0:1e-5 on f32 subnormals: %d of %d elements out of bound; [%d] live %a "
           "restored %a: |x - r| = %a > 1e-5*|r| = %a\n",
           bad, N, first, (double)x[first], (double)got[first],
           fabs((double)x[first] - (double)got[first]), 1e-5 * fabs((double)got[first]));
  amber_reader_close(r);
  amber_writer_close(w);
  amber_store_close(st);
}

static void test_policies_hold_for_misaligned_live_buffers(void) {
  const pol t = thr(1e-3, 1e-3, "threshold:1e-3:1e-3"), b = bud(0.1, 0.01, "budget:0.1:0.01");
  g_misalign = 1;
  run_trajectory(450, 64, NULL, &EXACT, 20, 5, 0, 1, NULL);
  run_trajectory(451, 64, t.spec, &t, 20, UINT32_MAX, -1, 1, NULL);
  run_trajectory(452, 1000, b.spec, &b, 20, UINT32_MAX, -1, 1, NULL);
  g_misalign = 0;
}

/* A budget counts whole elements per chunk: a tail chunk or a scalar smaller than
 * 1/FRAC elements gets floor(FRAC*n) = 0 and, without CAP, would never be stored
 * between fulls. The change must still be deferred, not dropped. */
static void test_budget_converges_in_small_tail_chunks_and_scalars(void) {
  const char *dir = tu_tmpdir();
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, dir, NULL));
  amber_writer *w = NULL;
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.chunk_elems = 1000;
  wo.full_every = UINT32_MAX;
  wo.full_share = -1;
  CHECK_OK(amber_writer_open(&w, st, &wo));
  if (!w) {
    amber_store_close(st);
    return;
  }
  static float v[1005];
  float lr = 1e-3f;
  int64_t n = 1005;
  memset(v, 0, sizeof v);
  CHECK_OK(amber_writer_add(w, "v", AMBER_F32, 1, &n, v, NULL));
  CHECK_OK(amber_writer_add(w, "lr", AMBER_F32, 0, NULL, &lr, NULL));
  CHECK_OK(amber_writer_add_policy(w, "budget:0.1"));
  CHECK_OK(amber_writer_save(w, 1, 0));
  for (int i = 0; i < 1005; i++) v[i] = 1 + (float)i;
  lr = 5e-4f;
  for (uint64_t s = 2; s <= 14; s++) CHECK_OK(amber_writer_save(w, s, 0));
  size_t off_v = count_off(st, 0, AMBER_F32, v, 1005), off_lr = count_off(st, 1, AMBER_F32, &lr, 1);
  CHECK(off_v == 0);
  CHECK(off_lr == 0);
  if (off_v || off_lr)
    DETAIL("13 saves after a change under budget:0.1 (chunks of 1000): %zu of the 1005 elements "
           "and %zu of the scalar still at step 1's values\n",
           off_v, off_lr);
  amber_writer_close(w);
  amber_store_close(st);
}

static void test_integer_and_bool_tensors_are_exact_under_any_policy(void) {
  /* add_standard's int tensors expect exact whatever rule the floats follow; with
   * "budget:0" nothing of a float is stored, and "*=threshold:1:1" is loose. */
  const pol pols[] = {thr(1, 1, "threshold:1:1"), bud(0, INFINITY, "budget:0")};
  const char *rules[] = {"*=threshold:1:1", "*=budget:0"};
  for (int k = 0; k < 2; k++)
    run_trajectory(400 + (uint64_t)k, 64, rules[k], &pols[k], 25, UINT32_MAX, -1, 0, NULL);
}

static void test_last_matching_pattern_wins(void) {
  const pol loose = thr(1e-2, 0, "threshold:1e-2");
  const struct {
    const char *rules[3];
    int b_exact;
  } cases[] = {{{"*=threshold:1e-2", "*.b=exact", NULL}, 1},
               {{"*.b=exact", "*=threshold:1e-2", NULL}, 0}};
  for (int c = 0; c < 2; c++) {
    world W;
    world_init(&W, 500 + (uint64_t)c, 0);
    add_tensor(&W, "x.a", AMBER_F32, 1, 100, 0, &loose);
    add_tensor(&W, "x.b", AMBER_F32, 1, 100, 0, cases[c].b_exact ? &EXACT : &loose);
    add_tensor(&W, "y.b", AMBER_BF16, 1, 33, 0, cases[c].b_exact ? &EXACT : &loose);
    add_tensor(&W, "x.bb", AMBER_F16, 1, 10, 0, &loose);
    if (world_open(&W, NULL, cases[c].rules)) {
      for (uint64_t s = 1; s <= 15; s++) {
        if (s > 1) world_mutate(&W);
        save_check(&W, s, 0);
      }
    }
    world_close(&W);
    world_free(&W);
  }
}

/* Every committed step restores to that step's values, not only the latest. */
static void earlier_steps_run(uint64_t seed, const char *rule, const pol *p, uint32_t full_every) {
  enum { S = 20 };
  world W;
  world_init(&W, seed, 1);
  add_standard(&W, 64, p);
  uint8_t *live[S + 1][64], *got[S + 1][64];
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.chunk_elems = 64;
  wo.full_every = full_every;
  wo.full_share = -1;
  const char *rules[] = {rule, NULL};
  int ok = world_open(&W, &wo, rules);
  for (int s = 1; ok && s <= S; s++) {
    if (s > 1) world_mutate(&W);
    save_check(&W, (uint64_t)s, 0);
    for (size_t i = 0; i < W.n; i++) {
      live[s][i] = malloc(W.t[i].nb + 1);
      got[s][i] = malloc(W.t[i].nb + 1);
      memcpy(live[s][i], W.t[i].live, W.t[i].nb);
      memcpy(got[s][i], W.t[i].got, W.t[i].nb);
    }
  }
  world_close(&W);
  if (!ok) goto out;
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY;
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, W.dir, &so));
  for (int s = S; st && s >= 1; s--) {
    amber_reader *r = NULL;
    CHECK_OK(amber_reader_open(&r, st, (uint64_t)s, NULL));
    if (!r) continue;
    CHECK_OK(amber_reader_verify(r));
    for (size_t i = 0; i < W.n; i++) {
      tens *t = &W.t[i];
      CHECK_OK(amber_reader_read(r, i, t->got, t->nb));
      /* the same bytes as when it was the latest, and within the policy of its live values */
      CHECK(memcmp(t->got, got[s][i], t->nb) == 0);
      size_t bad = 0;
      for (size_t e = 0; e < t->n; e++)
        bad += !elem_ok(t->dtype, &t->p, live[s][i] + e * t->w, t->got + e * t->w, t->w);
      CHECK(bad == 0);
      if (bad) DETAIL("seed %" PRIu64 " step %d '%s': %zu bad elements\n", seed, s, t->name, bad);
    }
    /* amber_reader_read_many, every tensor in reverse order in one call: the same
     * bytes; bad arguments fail before anything is written */
    size_t idxs[64];
    void *bufs[64];
    uint64_t sizes[64];
    for (size_t i = 0; i < W.n; i++) {
      idxs[i] = W.n - 1 - i;
      sizes[i] = W.t[idxs[i]].nb;
      bufs[i] = W.t[idxs[i]].got;
      memset(bufs[i], 0x5A, (size_t)sizes[i]);
    }
    CHECK_OK(amber_reader_read_many(r, W.n, idxs, bufs, sizes));
    size_t differ = 0;
    for (size_t i = 0; i < W.n; i++) differ += memcmp(W.t[i].got, got[s][i], W.t[i].nb) != 0;
    CHECK(differ == 0);
    if (differ) DETAIL("seed %" PRIu64 " step %d: read_many differs in %zu tensors\n", seed, s, differ);
    for (size_t i = 0; i < W.n; i++) memset(bufs[i], 0x5A, (size_t)sizes[i]);
    sizes[W.n - 1]++;
    CHECK_RC(amber_reader_read_many(r, W.n, idxs, bufs, sizes), AMBER_EINVAL);
    sizes[W.n - 1]--;
    idxs[W.n - 1] = W.n;
    CHECK_RC(amber_reader_read_many(r, W.n, idxs, bufs, sizes), AMBER_EINVAL);
    size_t touched = 0;
    for (size_t i = 0; i < W.n; i++)
      for (size_t b = 0; b < (size_t)sizes[i]; b++) touched += ((uint8_t *)bufs[i])[b] != 0x5A;
    CHECK(touched == 0);
    CHECK_OK(amber_reader_read_many(r, 0, NULL, NULL, NULL));
    amber_reader_close(r);
  }
  amber_store_close(st);
out:
  for (int s = 1; ok && s <= S; s++)
    for (size_t i = 0; i < W.n; i++) {
      free(live[s][i]);
      free(got[s][i]);
    }
  world_free(&W);
}

static void test_every_earlier_step_restores_its_own_values(void) {
  earlier_steps_run(601, NULL, &EXACT, UINT32_MAX);
  earlier_steps_run(602, "exact", &EXACT, 6); /* fulls inside the 20 steps */
  const pol t = thr(1e-3, 1e-3, "threshold:1e-3:1e-3");
  earlier_steps_run(603, "*=threshold:1e-3:1e-3", &t, UINT32_MAX);
  const pol b = bud(0.1, 0.05, "budget:0.1:0.05");
  earlier_steps_run(604, "budget:0.1:0.05", &b, 7);
}

/* ---- cadence ---- */

/* A small store: one f32 tensor where `share` of the elements change each step. */
typedef struct {
  const char *dir;
  amber_store *st;
  amber_writer *w;
  float x[4000];
  uint64_t rng;
} small;

static void small_open(small *S, const char *dir, const amber_writer_opts *wo) {
  S->dir = dir;
  S->st = NULL;
  S->w = NULL;
  CHECK_OK(amber_store_open(&S->st, dir, NULL));
  if (S->st) CHECK_OK(amber_writer_open(&S->w, S->st, wo));
  int64_t n = 4000;
  if (S->w) CHECK_OK(amber_writer_add(S->w, "x", AMBER_F32, 1, &n, S->x, NULL));
}

static void small_init(small *S, uint64_t seed) {
  S->rng = seed;
  for (int i = 0; i < 4000; i++) S->x[i] = (float)urand(&S->rng);
}

static void small_step(small *S, double share) {
  for (int i = 0; i < 4000; i++)
    if (urand(&S->rng) < share) S->x[i] += 1e-3f;
}

static void small_close(small *S) {
  amber_writer_close(S->w);
  amber_store_close(S->st);
  S->w = NULL;
  S->st = NULL;
}

/* The kinds as a string, "FDDD..."; parents of deltas must be the previous step. */
static void kinds_of(amber_store *st, char *out, size_t cap) {
  amber_ckpt_info *info = NULL;
  size_t n = 0;
  CHECK_OK(amber_store_list(st, &info, &n));
  size_t k = 0;
  for (size_t i = 0; i < n && k + 1 < cap; i++) {
    out[k++] = info[i].kind == AMBER_KIND_FULL ? 'F' : 'D';
    if (info[i].kind == AMBER_KIND_DELTA) CHECK(i > 0 && info[i].parent == info[i - 1].step);
    else CHECK(info[i].parent == AMBER_NO_STEP);
  }
  out[k] = 0;
  amber_free(info);
}

static void test_full_every_sets_the_cadence(void) {
  small S;
  small_init(&S, 700);
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.full_every = 3;
  wo.full_share = -1;
  small_open(&S, tu_tmpdir(), &wo);
  for (uint64_t s = 1; S.w && s <= 11; s++) {
    small_step(&S, 0.05);
    CHECK_OK(amber_writer_save(S.w, s, 0));
  }
  char kinds[64];
  kinds_of(S.st, kinds, sizeof kinds);
  CHECK(!strcmp(kinds, "FDDDFDDDFDD"));
  if (strcmp(kinds, "FDDDFDDDFDD")) DETAIL("full_every=3 gave kinds %s\n", kinds);
  small_close(&S);
}

static void test_small_full_share_makes_fulls_more_often(void) {
  int fulls[2] = {0, 0};
  const double shares[2] = {0.01, 0}; /* 0: the default */
  for (int c = 0; c < 2; c++) {
    small S;
    small_init(&S, 710);
    amber_writer_opts wo;
    amber_writer_opts_init(&wo);
    wo.full_share = shares[c];
    small_open(&S, tu_tmpdir(), &wo);
    for (uint64_t s = 1; S.w && s <= 12; s++) {
      small_step(&S, 0.05); /* a delta of ~5% of the elements: > 1% of a full */
      CHECK_OK(amber_writer_save(S.w, s, 0));
    }
    char kinds[64];
    kinds_of(S.st, kinds, sizeof kinds);
    for (char *k = kinds; *k; k++) fulls[c] += *k == 'F';
    if (c == 0) {
      /* each delta alone is above the share: the writer backs off, 1, 2, 4 fulls */
      CHECK(!strcmp(kinds, "FDFDFFDFFFFD"));
      if (strcmp(kinds, "FDFDFFDFFFFD")) DETAIL("full_share=0.01 gave kinds %s\n", kinds);
    }
    small_close(&S);
  }
  CHECK(fulls[0] == 8 && fulls[1] < fulls[0]);
}

/* Deltas as big as a full (dense changes under the exact policy) are not worth
 * writing: after one, the writer writes fulls, twice as many each time, up to 32,
 * and goes back to deltas as soon as one is small again. full_share < 0 keeps
 * every save a delta. */
static void test_dense_deltas_back_off_to_fulls_and_recover(void) {
  for (int c = 0; c < 2; c++) {
    small S;
    small_init(&S, 730 + (uint64_t)c);
    amber_writer_opts wo;
    amber_writer_opts_init(&wo);
    wo.full_share = c ? -1 : 0;
    wo.full_every = UINT32_MAX;
    small_open(&S, tu_tmpdir(), &wo);
    uint64_t s = 0;
    for (int i = 0; S.w && i < 70; i++) { /* every element changes: deltas ~ a full */
      small_step(&S, 1.0);
      CHECK_OK(amber_writer_save(S.w, ++s, 0));
    }
    for (int i = 0; S.w && i < 40; i++) { /* then 1% of them */
      small_step(&S, 0.01);
      CHECK_OK(amber_writer_save(S.w, ++s, 0));
    }
    char kinds[200];
    kinds_of(S.st, kinds, sizeof kinds);
    if (c == 0) {
      /* F D F D FF D FFFF D FFFFFFFF D (16 F) D (32 F) D ..., then deltas once small */
      const char *want = "FDFDFFDFFFFDFFFFFFFFDFFFFFFFFFFFFFFFFDFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFD";
      CHECK(!strncmp(kinds, want, strlen(want)));
      if (strncmp(kinds, want, strlen(want))) DETAIL("dense deltas gave kinds %s\n", kinds);
      /* the first small delta resets the back-off: deltas from then on, up to
       * full_share's own cadence */
      size_t fulls_late = 0;
      for (size_t i = 72; i < strlen(kinds); i++) fulls_late += kinds[i] == 'F';
      CHECK(fulls_late <= 3 && !strstr(kinds + 72, "FF"));
      if (fulls_late > 3 || strstr(kinds + 72, "FF"))
        DETAIL("after the changes became sparse: %s\n", kinds + 70);
    } else {
      size_t fulls = 0;
      for (char *k = kinds; *k; k++) fulls += *k == 'F';
      CHECK(fulls == 1);
    }
    small_close(&S);
  }
}

static void test_save_full_flag_forces_a_full(void) {
  small S;
  small_init(&S, 720);
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.full_every = UINT32_MAX;
  wo.full_share = -1;
  small_open(&S, tu_tmpdir(), &wo);
  for (uint64_t s = 1; S.w && s <= 6; s++) {
    small_step(&S, 0.02);
    CHECK_OK(amber_writer_save(S.w, s, s == 4 ? AMBER_SAVE_FULL : 0));
  }
  char kinds[64];
  kinds_of(S.st, kinds, sizeof kinds);
  CHECK(!strcmp(kinds, "FDDFDD"));
  small_close(&S);
}

static void test_cadence_continues_across_reopen(void) {
  small S;
  small_init(&S, 730);
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.full_every = 3;
  wo.full_share = -1;
  const char *dir = tu_tmpdir();
  uint64_t s = 1;
  for (int session = 0; session < 3; session++) {
    small_open(&S, dir, &wo);
    for (int k = 0; S.w && k < 3; k++, s++) {
      small_step(&S, 0.05);
      CHECK_OK(amber_writer_save(S.w, s, 0));
    }
    if (session < 2) small_close(&S);
  }
  char kinds[64];
  kinds_of(S.st, kinds, sizeof kinds);
  CHECK(!strcmp(kinds, "FDDDFDDDF"));
  if (strcmp(kinds, "FDDDFDDDF")) DETAIL("full_every=3 over reopens gave kinds %s\n", kinds);
  small_close(&S);
}

/* ---- reopening ---- */

static void test_reopened_writer_continues_with_deltas(void) {
  const pol p = thr(1e-3, 1e-2, "threshold:1e-3:1e-2");
  const pol e = EXACT;
  for (int c = 0; c < 2; c++) {
    world W;
    world_init(&W, 800 + (uint64_t)c, 1);
    add_standard(&W, 64, c ? &e : &p);
    amber_writer_opts wo;
    amber_writer_opts_init(&wo);
    wo.chunk_elems = 64;
    wo.full_every = UINT32_MAX;
    wo.full_share = -1;
    const char *rules[] = {c ? NULL : p.spec, NULL};
    uint64_t s = 1;
    for (int session = 0; session < 3; session++) {
      if (!world_open(&W, &wo, rules)) break;
      for (int k = 0; k < 8; k++, s++) {
        if (s > 1) world_mutate(&W);
        int kind = save_check(&W, s, 0);
        CHECK(kind == (int)(s == 1 ? AMBER_KIND_FULL : AMBER_KIND_DELTA));
      }
      world_close(&W);
    }
    world_free(&W);
  }
}

/* One tensor "w" declared with the given shape, dtype and chunk; returns the kind
 * of the saved step. */
static int save_one(const char *dir, uint64_t step, int dt, int64_t n, uint64_t chunk,
                    const char *extra) {
  amber_store *st = NULL;
  amber_writer *w = NULL;
  int kind = -1;
  CHECK_OK(amber_store_open(&st, dir, NULL));
  if (!st) return -1;
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.chunk_elems = chunk;
  CHECK_OK(amber_writer_open(&w, st, &wo));
  uint8_t *buf = malloc((size_t)n * 8 + 8);
  tu_fill_random(buf, (size_t)n * 8 + 8, step);
  for (int64_t i = 0; i < n && is_float(dt); i++) /* finite small values */
    put_f(AMBER_F32, buf + 4 * i, (double)(i % 17));
  if (w) {
    CHECK_OK(amber_writer_add(w, "w", dt, 1, &n, buf, NULL));
    int64_t one = 1;
    if (extra) CHECK_OK(amber_writer_add(w, extra, AMBER_F32, 1, &one, buf, NULL));
    CHECK_OK(amber_writer_save(w, step, 0));
    amber_reader *r = NULL;
    CHECK_OK(amber_reader_open(&r, st, step, NULL));
    if (r) {
      amber_ckpt_info ci;
      amber_reader_ckpt_info(r, &ci);
      kind = (int)ci.kind;
      uint8_t *got = malloc((size_t)n * amber_dtype_size(dt) + 1);
      CHECK_OK(amber_reader_read(r, 0, got, (uint64_t)n * amber_dtype_size(dt)));
      CHECK(memcmp(got, buf, (size_t)n * amber_dtype_size(dt)) == 0);
      free(got);
    }
    amber_reader_close(r);
  }
  amber_writer_close(w);
  amber_store_close(st);
  free(buf);
  return kind;
}

static void test_reopened_writer_with_other_tensors_saves_full(void) {
  const char *dir = tu_tmpdir();
  uint64_t s = 1;
  CHECK(save_one(dir, s++, AMBER_F32, 100, 64, NULL) == AMBER_KIND_FULL);
  CHECK(save_one(dir, s++, AMBER_F32, 100, 64, NULL) == AMBER_KIND_DELTA);
  CHECK(save_one(dir, s++, AMBER_F32, 101, 64, NULL) == AMBER_KIND_FULL);  /* other shape */
  CHECK(save_one(dir, s++, AMBER_F32, 101, 64, NULL) == AMBER_KIND_DELTA);
  CHECK(save_one(dir, s++, AMBER_I32, 101, 64, NULL) == AMBER_KIND_FULL);  /* other dtype */
  CHECK(save_one(dir, s++, AMBER_I32, 101, 32, NULL) == AMBER_KIND_FULL);  /* other chunks */
  CHECK(save_one(dir, s++, AMBER_I32, 101, 32, "z") == AMBER_KIND_FULL);   /* one more */
  CHECK(save_one(dir, s++, AMBER_I32, 101, 32, "z") == AMBER_KIND_DELTA);
  CHECK(save_one(dir, s++, AMBER_I32, 101, 32, NULL) == AMBER_KIND_FULL);  /* one fewer */
  /* without a chunk size of its own, a writer adopts the store's and goes on */
  CHECK(save_one(dir, s++, AMBER_I32, 101, 0, NULL) == AMBER_KIND_DELTA);
}

/* ---- sizes ---- */

static void test_sparse_exact_delta_is_small(void) {
  const int64_t n = 1 << 20;
  const uint64_t chunks[2] = {0, 65536};
  for (int c = 0; c < 2; c++) {
    const char *dir = tu_tmpdir();
    float *x = malloc((size_t)n * 4), *y = malloc((size_t)n * 4);
    uint64_t rng = 900 + (uint64_t)c;
    for (int64_t i = 0; i < n; i++) x[i] = (float)(urand(&rng) * 2 - 1) * 0.05f;
    amber_store *st = NULL;
    amber_writer *w = NULL;
    amber_writer_opts wo;
    amber_writer_opts_init(&wo);
    wo.chunk_elems = chunks[c];
    CHECK_OK(amber_store_open(&st, dir, NULL));
    CHECK_OK(amber_writer_open(&w, st, &wo));
    CHECK_OK(amber_writer_add(w, "big", AMBER_F32, 1, &n, x, NULL));
    CHECK_OK(amber_writer_save(w, 1, 0));
    for (uint64_t s = 2; s <= 4; s++) {
      size_t changed = 0;
      for (int64_t k = 0; k < n / 100; k++) {
        size_t i = (size_t)(tu_rand(&rng) % (uint64_t)n);
        x[i] += x[i] * 1e-3f + 1e-6f;
        changed++;
      }
      CHECK_OK(amber_writer_save(w, s, 0));
      amber_reader *r = NULL;
      CHECK_OK(amber_reader_open(&r, st, s, NULL));
      if (!r) continue;
      amber_tensor_info ti;
      CHECK_OK(amber_reader_info(r, 0, &ti));
      CHECK(ti.stored_elems > 0 && ti.stored_elems <= changed);
      CHECK_OK(amber_reader_read(r, 0, y, (uint64_t)n * 4));
      CHECK(memcmp(x, y, (size_t)n * 4) == 0);
      amber_reader_close(r);
    }
    amber_ckpt_info *info = NULL;
    size_t cnt = 0;
    CHECK_OK(amber_store_list(st, &info, &cnt));
    CHECK(cnt == 4);
    for (size_t i = 1; i < cnt; i++) {
      CHECK(info[i].kind == AMBER_KIND_DELTA);
      CHECK((double)info[i].bytes < 0.03 * (double)info[0].bytes);
      if ((double)info[i].bytes >= 0.03 * (double)info[0].bytes)
        DETAIL("chunk %" PRIu64 ": delta %zu is %" PRIu64 " bytes, full %" PRIu64 "\n", chunks[c],
               i, info[i].bytes, info[0].bytes);
    }
    amber_free(info);
    amber_writer_close(w);
    amber_store_close(st);
    free(x);
    free(y);
    tu_rm_rf(dir);
  }
}

static void test_unchanged_tensors_have_payload_free_chunks(void) {
  world W;
  world_init(&W, 950, 0);
  const pol t = thr(1e-3, 0, "threshold:1e-3");
  add_tensor(&W, "moving", AMBER_F32, 1, 1000, 0, &EXACT);
  add_tensor(&W, "still.f32", AMBER_F32, 1, 1000, 0, &EXACT);
  add_tensor(&W, "still.bf16", AMBER_BF16, 2, 30, 70, &t);
  add_tensor(&W, "still.i64", AMBER_I64, 1, 300, 0, &EXACT);
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.chunk_elems = 128;
  wo.full_every = UINT32_MAX;
  wo.full_share = -1;
  const char *rules[] = {"still.bf16=threshold:1e-3", NULL};
  if (world_open(&W, &wo, rules)) {
    for (uint64_t s = 1; s <= 5; s++) {
      for (size_t e = 0; s > 1 && e < W.t[0].n; e++) drift(AMBER_F32, W.t[0].live + 4 * e, &W.rng, 0);
      save_check(&W, s, 0);
      if (s == 1) continue;
      amber_reader *r = NULL;
      CHECK_OK(amber_reader_open(&r, W.st, s, NULL));
      for (size_t i = 0; r && i < W.n; i++) {
        amber_tensor_info ti;
        CHECK_OK(amber_reader_info(r, i, &ti));
        if (i == 0) CHECK(ti.stored_bytes > 0);
        else CHECK(ti.stored_bytes == 0 && ti.stored_elems == 0 && ti.nchunks > 1);
      }
      amber_reader_close(r);
      amber__err e;
      amber__ckpt c;
      CHECK_OK(amber__ckpt_open(&e, W.st, s, &c));
      for (uint64_t j = W.t[0].n / 128 + 1; j < c.ix.n_chunks; j++)
        CHECK(c.ix.chunks[j].encoding == AMBER__ENC_UNCHANGED && c.ix.chunks[j].size == 0);
      amber__ckpt_close(&c);
    }
  }
  world_close(&W);
  world_free(&W);
}

/* ---- corruption (Guarantee 4) ---- */

/* Builds steps 1..6 of a store: a full, then deltas that change 10% of "w". With
 * `full_at`, that step is forced full. */
static void build_chain(const char *dir, uint64_t seed, uint64_t full_at) {
  small S;
  small_init(&S, seed);
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.chunk_elems = 1000;
  wo.full_every = UINT32_MAX;
  wo.full_share = -1;
  small_open(&S, dir, &wo);
  for (uint64_t s = 1; S.w && s <= 6; s++) {
    small_step(&S, 0.1);
    CHECK_OK(amber_writer_save(S.w, s, s == full_at ? AMBER_SAVE_FULL : 0));
  }
  small_close(&S);
}

static amber_store *open_ro(const char *dir) {
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY;
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, dir, &so));
  return st;
}

static void ckpt_file(const char *dir, uint64_t step, char *out, size_t cap) {
  snprintf(out, cap, "%s/ckpt-%020" PRIu64 ".amber", dir, step);
}

/* Opens `step` and verifies it; returns the first failure (open or verify). */
static int open_verify(amber_store *st, uint64_t step, char *msg, size_t cap) {
  amber_reader *r = NULL;
  int rc = amber_reader_open(&r, st, step, NULL);
  if (rc == 0) {
    rc = amber_reader_verify(r);
    float buf[4000];
    int rd = amber_reader_read(r, 0, buf, sizeof buf);
    CHECK(rd == rc); /* a read fails exactly when verify does */
    snprintf(msg, cap, "%s", amber_last_error(r));
  } else {
    snprintf(msg, cap, "%s", amber_last_error(NULL));
  }
  amber_reader_close(r);
  return rc;
}

static void test_flipped_byte_in_delta_fails_it_and_later_steps(void) {
  const char *dir = tu_tmpdir();
  build_chain(dir, 1000, 0);
  char path[4200], msg[2048];
  ckpt_file(dir, 3, path, sizeof path);
  CHECK(tu_flip_byte(path, TU_MIDDLE, 0x10) == 0);
  amber_store *st = open_ro(dir);
  for (uint64_t s = 1; st && s <= 6; s++) {
    int rc = open_verify(st, s, msg, sizeof msg);
    if (s < 3) {
      CHECK_OK(rc);
    } else {
      CHECK_RC(rc, AMBER_ECORRUPT);
      CHECK(strstr(msg, "ckpt-00000000000000000003.amber") != NULL);
      if (!strstr(msg, "ckpt-00000000000000000003.amber"))
        DETAIL("step %" PRIu64 ": message does not name the damaged file: %s\n", s, msg);
    }
  }
  amber_store_close(st);
}

static void test_missing_parent_fails_children_with_eparent(void) {
  const char *dir = tu_tmpdir();
  build_chain(dir, 1010, 0);
  char path[4200], msg[2048];
  ckpt_file(dir, 3, path, sizeof path);
  CHECK(unlink(path) == 0);
  amber_store *st = open_ro(dir);
  for (uint64_t s = 1; st && s <= 6; s++) {
    int rc = open_verify(st, s, msg, sizeof msg);
    if (s < 3) {
      CHECK_OK(rc);
    } else if (s == 3) {
      CHECK(rc < 0 && strstr(msg, "step 3") != NULL);
    } else {
      CHECK_RC(rc, AMBER_EPARENT);
      CHECK(strstr(msg, "parent step 3") != NULL);
      if (!strstr(msg, "parent step 3")) DETAIL("message for step %" PRIu64 ": %s\n", s, msg);
    }
  }
  amber_store_close(st);
}

static void test_substituted_parent_fails_children_with_eparent(void) {
  /* B's step 3 is a full (self-contained) or a delta on B's own step 2; either way
   * it is not the step 3 that A's step 4 was computed against. */
  for (int c = 0; c < 2; c++) {
    const char *a = tu_tmpdir(), *b = tu_tmpdir();
    build_chain(a, 1020, 0);
    build_chain(b, 1030, c ? 0 : 3);
    char pa[4200], pb[4200], msg[2048];
    ckpt_file(a, 3, pa, sizeof pa);
    ckpt_file(b, 3, pb, sizeof pb);
    size_t len = 0;
    uint8_t *buf = tu_read_file(pb, &len);
    CHECK(buf && tu_write_file(pa, buf, len) == 0);
    free(buf);
    amber_store *st = open_ro(a);
    for (uint64_t s = 1; st && s <= 6; s++) {
      int rc = open_verify(st, s, msg, sizeof msg);
      if (s < 3) CHECK_OK(rc);
      else if (s == 3) CHECK_RC(rc, c ? AMBER_EPARENT : 0); /* B's delta names B's step 2 */
      else CHECK_RC(rc, AMBER_EPARENT);
      if (s >= 4) CHECK(strstr(msg, "ckpt-00000000000000000003.amber") != NULL);
    }
    amber_store_close(st);
  }
}

/* ---- the fused f32 kernels against the portable ones ---- */

/* One f32 value as a trajectory might hold it: drifts of every size, exact ties,
 * subnormals, signed zeros, NaN of several encodings and infinities. */
static float odd_f32(uint64_t *rs, float base) {
  uint64_t r = tu_rand(rs);
  switch (r % 16) {
  case 0: return base;                              /* unchanged */
  case 1: return base + 1e-3f;                      /* ties: the same change */
  case 2: return base - 1e-3f;
  case 3: return 0x1p-140f * (float)(r >> 40 & 0xff); /* subnormals */
  case 4: return -0.0f;
  case 5: return (r >> 8) & 1 ? INFINITY : -INFINITY;
  case 6: {
    uint32_t b = 0x7f800001u | (uint32_t)(r >> 16 & 0x7fffff) | (uint32_t)(r >> 40 & 1) << 31;
    float f;
    memcpy(&f, &b, 4);
    return f; /* a NaN, payload and sign random */
  }
  case 7: return base * 1e30f;
  default: return base + (float)((double)(int64_t)(r >> 1) / 9.2e18) * 0.01f;
  }
}

/* Every scan level must select the same elements, in the same order, with the
 * same values, and leave the same reference: the fused kernels are a faster way
 * to run the portable ones, nothing else. */
static void test_simd_kernels_select_what_the_portable_ones_select(void) {
  const size_t sizes[] = {0, 1, 7, 15, 16, 17, 31, 33, 100, 255, 256, 257, 4099, 65536 + 5};
  struct {
    int kind;
    double abs, rel, cap;
    double frac;
  } pols[] = {{AMBER__SCAN_THRESHOLD, 1e-3, 1e-2, INFINITY, 0},
              {AMBER__SCAN_THRESHOLD, 0, 0, INFINITY, 0},
              {AMBER__SCAN_THRESHOLD, 0, 1e-3, INFINITY, 0},
              {AMBER__SCAN_THRESHOLD, 0, 1e-5, INFINITY, 0},
              {AMBER__SCAN_THRESHOLD, 1e-40, 0, INFINITY, 0},
              {AMBER__SCAN_THRESHOLD, INFINITY, 0, INFINITY, 0},
              {AMBER__SCAN_BUDGET, 0, 0, INFINITY, 0.02},
              {AMBER__SCAN_BUDGET, 0, 0, 0.5, 0.1},
              {AMBER__SCAN_BUDGET, 0, 0, 1e-3, 0},
              {AMBER__SCAN_BUDGET, 0, 0, 0, 1},
              {AMBER__SCAN_BUDGET, 0, 0, INFINITY, 0.3}};
  size_t maxn = 65536 + 5, cases = 0;
  float *base = malloc(maxn * 4);
  uint8_t *live = malloc(maxn * 4 + 4), *ref0 = malloc(maxn * 4);
  uint8_t *ref[3], *vals[3], *olds[3];
  uint32_t *idx[3], *keys[3];
  for (int l = 0; l < 3; l++) {
    ref[l] = malloc(maxn * 4);
    vals[l] = malloc(maxn * 4);
    olds[l] = malloc(maxn * 4);
    idx[l] = malloc(maxn * 4);
    keys[l] = malloc(maxn * 4);
  }
  uint64_t rs = 777;
  for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++) {
    size_t n = sizes[si];
    for (size_t pi = 0; pi < sizeof pols / sizeof *pols; pi++) {
      for (int mis = 0; mis < 2; mis++) { /* live at an odd address, as in safetensors */
        uint8_t *lv = live + mis;
        for (size_t i = 0; i < n; i++) {
          base[i] = (float)((double)(int64_t)tu_rand(&rs) / 9.2e18);
          if (tu_rand(&rs) % 4 == 0) base[i] *= 0x1p-130f; /* near and below FLT_MIN */
          float r = tu_rand(&rs) % 8 ? base[i] : odd_f32(&rs, base[i]);
          float x = odd_f32(&rs, base[i]);
          if (tu_rand(&rs) % 4 == 0) { /* a change of one or two units in the last place */
            float to = tu_rand(&rs) % 2 ? INFINITY : -INFINITY;
            x = nextafterf(r, to);
            if (tu_rand(&rs) % 2) x = nextafterf(x, to);
          }
          memcpy(ref0 + 4 * i, &r, 4);
          memcpy(lv + 4 * i, &x, 4);
        }
        size_t k[3];
        for (int l = 0; l < 3; l++) {
          memcpy(ref[l], ref0, n * 4);
          amber__scan_args a = {.kind = pols[pi].kind, .dtype = AMBER_F32, .n = n, .live = lv,
                                .ref = ref[l], .abs = pols[pi].abs, .rel = pols[pi].rel,
                                .cap = pols[pi].cap, .keys = keys[l], .idx = idx[l],
                                .vals = vals[l], .olds = olds[l]};
          if (a.kind == AMBER__SCAN_BUDGET) {
            a.budget = (size_t)(pols[pi].frac * (double)n);
            if (!a.budget && pols[pi].frac > 0) a.budget = 1;
          }
          amber__scan_use_simd(l);
          k[l] = amber__scan(&a);
        }
        amber__scan_use_simd(2);
        for (int l = 1; l < 3; l++) {
          int same = k[l] == k[0] && !memcmp(idx[l], idx[0], k[0] * 4) &&
                     !memcmp(vals[l], vals[0], k[0] * 4) && !memcmp(ref[l], ref[0], n * 4);
          CHECK(same);
          if (!same)
            DETAIL("n=%zu policy %zu misaligned=%d: level %d selected %zu, portable %zu", n, pi,
                   mis, l, k[l], k[0]);
        }
        cases++;
      }
    }
  }
  CHECK(cases == 2 * sizeof pols / sizeof *pols * sizeof sizes / sizeof *sizes);
  for (int l = 0; l < 3; l++) {
    free(ref[l]);
    free(vals[l]);
    free(olds[l]);
    free(idx[l]);
    free(keys[l]);
  }
  free(base);
  free(live);
  free(ref0);
}

/* Changes that are (nearly) all equal, as under Lion or in bf16: the budget is
 * still filled exactly, the larger changes all go first, indices stay sorted, and
 * the reference takes exactly the selected values. */
static void test_budget_fills_from_a_cluster_of_equal_changes(void) {
  const size_t n = 200003, budget = n / 50;
  const int dtypes[] = {AMBER_F32, AMBER_BF16};
  uint8_t *live = malloc(n * 4), *ref = malloc(n * 4), *ref0 = malloc(n * 4);
  uint8_t *vals = malloc(n * 4), *olds = malloc(n * 4);
  uint32_t *idx = malloc(n * 4), *keys = malloc(n * 4);
  uint64_t rs = 4242;
  for (int di = 0; di < 2; di++) {
    int dt = dtypes[di];
    size_t w = amber_dtype_size(dt), big = 0;
    for (size_t i = 0; i < n; i++) {
      float r = (float)((double)(int64_t)tu_rand(&rs) / 9.2e18) * 0.05f;
      int large = tu_rand(&rs) % 200 == 0; /* 0.5%: must all be selected */
      float x = r + ((tu_rand(&rs) & 1) ? 1e-4f : -1e-4f) * (large ? 50.0f : 1.0f);
      big += large;
      if (dt == AMBER_F32) {
        memcpy(ref0 + 4 * i, &r, 4);
        memcpy(live + 4 * i, &x, 4);
      } else { /* bf16: the top half of the f32 */
        uint32_t rb, xb;
        memcpy(&rb, &r, 4);
        memcpy(&xb, &x, 4);
        uint16_t r16 = (uint16_t)(rb >> 16), x16 = (uint16_t)(xb >> 16);
        if (x16 == r16) x16 ^= 1;
        memcpy(ref0 + 2 * i, &r16, 2);
        memcpy(live + 2 * i, &x16, 2);
      }
    }
    for (int level = 0; level < 3; level++) {
      memcpy(ref, ref0, n * w);
      amber__scan_args a = {.kind = AMBER__SCAN_BUDGET, .dtype = dt, .n = n, .live = live,
                            .ref = ref, .cap = INFINITY, .budget = budget, .keys = keys,
                            .idx = idx, .vals = vals, .olds = olds};
      amber__scan_use_simd(level);
      size_t k = amber__scan(&a);
      amber__scan_use_simd(2);
      CHECK(k == budget);
      size_t sorted = 1, large_in = 0, moved = 0, valsok = 1;
      for (size_t i = 0; i < k; i++) {
        if (i && idx[i] <= idx[i - 1]) sorted = 0;
        double d = fabs(amber__to_f64(dt, live + idx[i] * w) - amber__to_f64(dt, ref0 + idx[i] * w));
        large_in += d > 2e-3;
        if (memcmp(vals + i * w, live + idx[i] * w, w)) valsok = 0;
      }
      for (size_t i = 0; i < n; i++) moved += memcmp(ref + i * w, ref0 + i * w, w) != 0;
      CHECK(sorted && valsok);
      CHECK(large_in == big);
      CHECK(moved == k);
      if (!sorted || !valsok || large_in != big || moved != k)
        DETAIL("dtype %d level %d: %zu selected (budget %zu), sorted %zu, %zu of %zu large "
               "changes, %zu reference elements moved\n",
               dt, level, k, budget, sorted, large_in, big, moved);
    }
  }
  free(live);
  free(ref);
  free(ref0);
  free(vals);
  free(olds);
  free(idx);
  free(keys);
}

/* The threshold and budget properties once more through the portable kernels,
 * which machines without AVX2 run. */
static void test_policies_hold_through_the_portable_kernels(void) {
  amber__scan_use_simd(0);
  const pol t = thr(1e-3, 1e-2, "threshold:1e-3:1e-2"), b = bud(0.1, 0.01, "budget:0.1:0.01");
  run_trajectory(901, 64, t.spec, &t, 40, UINT32_MAX, -1, 1, NULL);
  run_trajectory(902, 1000, b.spec, &b, 40, UINT32_MAX, -1, 1, NULL);
  amber__scan_use_simd(1);
  run_trajectory(903, 1000, b.spec, &b, 40, UINT32_MAX, -1, 1, NULL);
  amber__scan_use_simd(2);
}

/* The sparse body as docs/FORMAT.md describes it, written the obvious way: the
 * index form is the varint gaps when they are shorter than the bitmap. */
static size_t reference_sparse_body(uint8_t *body, const uint32_t *idx, const uint8_t *vals,
                                    size_t k, size_t n, size_t w) {
  size_t bitmap = (n + 7) / 8, varints = 0, o = 1;
  for (size_t i = 0; i < k; i++)
    for (uint32_t g = i ? idx[i] - idx[i - 1] - 1 : idx[0];; g >>= 7) {
      varints++;
      if (g < 0x80) break;
    }
  body[0] = varints < bitmap;
  if (body[0]) {
    for (size_t i = 0; i < k; i++) {
      uint32_t g = i ? idx[i] - idx[i - 1] - 1 : idx[0];
      for (; g >= 0x80; g >>= 7) body[o++] = (uint8_t)(g | 0x80);
      body[o++] = (uint8_t)g;
    }
  } else {
    memset(body + 1, 0, bitmap);
    for (size_t i = 0; i < k; i++) body[1 + idx[i] / 8] |= (uint8_t)(1u << (idx[i] % 8));
    o += bitmap;
  }
  for (size_t i = 0; i < k; i++)
    for (size_t b = 0; b < w; b++) body[o + b * k + i] = vals[i * w + b];
  return o + k * w;
}

/* amber__sparse_encode writes the reference body byte for byte on both sides of
 * the bitmap/varint crossover (gaps of 1 to 4 varint bytes, selections from empty
 * to full), and amber__sparse_apply puts every value back where it came from. */
static void test_sparse_bodies_match_the_format_across_the_crossover(void) {
  const size_t sizes[] = {1, 7, 8, 9, 40, 41, 1000, 4099, 70000};
  const size_t widths[] = {1, 2, 4, 8};
  uint64_t rng = 0x5eed5;
  size_t cases = 0, varint_cases = 0;
  for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
    size_t n = sizes[si];
    uint32_t *idx = malloc(n * sizeof *idx), *scratch = malloc(n * sizeof *scratch);
    uint8_t *vals = malloc(n * 8), *dst = malloc(n * 8), *want = malloc(n * 8);
    size_t cap = amber__sparse_bound(n, n, 8);
    uint8_t *got = malloc(cap), *ref = malloc(cap);
    CHECK(idx && scratch && vals && dst && want && got && ref);
    for (int trial = 0; trial < 60; trial++) {
      /* densities around 1/8 (the crossover for one-byte gaps) and far from it;
       * sparse selections have gaps of 2 and 3 bytes */
      double p = trial < 40 ? 0.05 + 0.0025 * trial : 1.0 / (double)(1 + (trial % 20) * 40);
      size_t k = 0;
      for (size_t i = 0; i < n; i++) {
        rng = rng * 6364136223846793005u + 1442695040888963407u;
        double u = (double)(rng >> 11) / 9007199254740992.0;
        if (u < p || (trial % 7 == 3 && i == n - 1)) idx[k++] = (uint32_t)i;
      }
      size_t w = widths[trial % 4];
      for (size_t i = 0; i < k * w; i++) vals[i] = (uint8_t)(rng >> (8 * (i % 8)));
      size_t glen = amber__sparse_encode(got, idx, vals, k, n, w);
      size_t rlen = reference_sparse_body(ref, idx, vals, k, n, w);
      CHECK(glen == rlen);
      CHECK(glen <= amber__sparse_bound(n, k, w));
      if (glen != rlen || memcmp(got, ref, rlen) != 0) {
        fprintf(stderr, "    n=%zu k=%zu w=%zu trial=%d: body differs\n", n, k, w, trial);
        CHECK(0);
        break;
      }
      varint_cases += got[0] == 1;
      memset(dst, 0xA5, n * w);
      memset(want, 0xA5, n * w);
      for (size_t i = 0; i < k; i++) memcpy(want + (size_t)idx[i] * w, vals + i * w, w);
      CHECK_OK(amber__sparse_apply(dst, got, glen, n, k, w, scratch));
      CHECK(memcmp(dst, want, n * w) == 0);
      cases++;
    }
    free(idx), free(scratch), free(vals), free(dst), free(want), free(got), free(ref);
  }
  CHECK(varint_cases > 0 && varint_cases < cases); /* both forms were exercised */
  /* four-byte gaps: three elements of the largest chunk */
  size_t n = AMBER__MAX_CHUNK_ELEMS, k = 3;
  uint32_t idx[3] = {0, (1u << 21) + 7, (uint32_t)n - 1}, scratch[3];
  uint8_t vals[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  uint8_t *got = malloc(amber__sparse_bound(n, k, 4)), *ref = malloc(amber__sparse_bound(n, k, 4));
  CHECK(got && ref);
  size_t glen = amber__sparse_encode(got, idx, vals, k, n, 4);
  CHECK(glen == reference_sparse_body(ref, idx, vals, k, n, 4) && memcmp(got, ref, glen) == 0);
  CHECK(got[0] == 1 && glen == 1 + 1 + 4 + 4 + 12);
  uint8_t *dst = calloc(n, 4);
  CHECK(dst != NULL);
  CHECK_OK(amber__sparse_apply(dst, got, glen, n, k, 4, scratch));
  CHECK(memcmp(dst + 4 * (size_t)idx[1], vals + 4, 4) == 0 &&
        memcmp(dst + 4 * (n - 1), vals + 8, 4) == 0);
  free(dst), free(got), free(ref);
}

int main(void) {
  TEST_RUN(test_exact_policy_restores_bit_exact_every_step);
  TEST_RUN(test_threshold_bound_holds_every_step_of_long_chains);
  TEST_RUN(test_threshold_bound_holds_for_f32_subnormals);
  TEST_RUN(test_budget_within_cap_every_step);
  TEST_RUN(test_budget_without_cap_converges_once_values_stop);
  TEST_RUN(test_budget_converges_for_tiny_values);
  TEST_RUN(test_budget_converges_when_all_changes_are_equal);
  TEST_RUN(test_budget_converges_in_small_tail_chunks_and_scalars);
  TEST_RUN(test_policies_hold_for_misaligned_live_buffers);
  TEST_RUN(test_simd_kernels_select_what_the_portable_ones_select);
  TEST_RUN(test_policies_hold_through_the_portable_kernels);
  TEST_RUN(test_budget_fills_from_a_cluster_of_equal_changes);
  TEST_RUN(test_integer_and_bool_tensors_are_exact_under_any_policy);
  TEST_RUN(test_last_matching_pattern_wins);
  TEST_RUN(test_every_earlier_step_restores_its_own_values);
  TEST_RUN(test_full_every_sets_the_cadence);
  TEST_RUN(test_small_full_share_makes_fulls_more_often);
  TEST_RUN(test_dense_deltas_back_off_to_fulls_and_recover);
  TEST_RUN(test_save_full_flag_forces_a_full);
  TEST_RUN(test_cadence_continues_across_reopen);
  TEST_RUN(test_reopened_writer_continues_with_deltas);
  TEST_RUN(test_reopened_writer_with_other_tensors_saves_full);
  TEST_RUN(test_sparse_exact_delta_is_small);
  TEST_RUN(test_sparse_bodies_match_the_format_across_the_crossover);
  TEST_RUN(test_unchanged_tensors_have_payload_free_chunks);
  TEST_RUN(test_flipped_byte_in_delta_fails_it_and_later_steps);
  TEST_RUN(test_missing_parent_fails_children_with_eparent);
  TEST_RUN(test_substituted_parent_fails_children_with_eparent);
  return tu_finish();
}

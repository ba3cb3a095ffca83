/*
 * trajectory.c - the random training-like trajectories that the delta tests
 * (tests/test_delta_*.c) share, and the small one-tensor store of the cadence and
 * corruption tests (see trajectory.h).
 */
#include "format.h"
#include "trajectory.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>

#include "ckpt.h"
#include "internal.h"
#include "scan.h"

const pol EXACT = {P_EXACT, 0, 0, 0, 0, "exact", 0, 0};
int details;

static const int FLOATS[] = {AMBER_F32, AMBER_F16,     AMBER_BF16,
                             AMBER_F64, AMBER_F8_E4M3, AMBER_F8_E5M2};
#define NFLOATS 6

/* ---- element helpers ---- */

static uint64_t get_bits(const uint8_t *p, size_t w) {
  uint64_t v = 0;
  for (size_t b = w; b-- > 0;) v = (v << 8) | p[b];
  return v;
}
static void put_bits(uint8_t *p, uint64_t v, size_t w) {
  for (size_t b = 0; b < w; b++) p[b] = (uint8_t)(v >> (8 * b));
}
double val(int dt, const uint8_t *p) {
  return amber__to_f64(dt, p);
}
void put_f(int dt, uint8_t *p, double v) {
  if (dt == AMBER_F64) {
    memcpy(p, &v, 8);
  } else {
    float f = (float)v;
    memcpy(p, &f, 4);
  }
}
double urand(uint64_t *s) {
  return (double)(tu_rand(s) >> 11) * 0x1p-53;
}

/* Whether restored `r` is an acceptable restore of live `x` under `p`. */
int elem_ok(int dt, const pol *p, const uint8_t *x, const uint8_t *r, size_t w) {
  if (!memcmp(x, r, w)) return 1;
  if (!is_float(dt) || p->kind == P_EXACT) return 0;
  double xv = val(dt, x), rv = val(dt, r);
  if (!isfinite(xv) || !isfinite(rv)) return 0; /* non-finite: bit-identical */
  double d = fabs(xv - rv);
  if (p->kind == P_THR) return d <= (p->share ? p->mult : 1) * (p->abs + p->rel * fabs(rv));
  return d <= p->cap;
}

/* The scan compares f32 and narrower values in f32 with bounds shrunk by 2^-20
 * (scan.c), so that rounding can only make it store more than the exact rule.
 * The checks of what a delta stored ("not more than needed") allow that much. */
#define NEAR(b) ((b) * (1 - 0x1p-16) - 1e-30)

/* Whether the policy may have to store live `x` against reference `r`: a
 * non-finite change, or (budget) a change at or near above CAP, or (a threshold's
 * share cap) at or near beyond MULT bounds. */
static int forced(int dt, const pol *p, const uint8_t *x, const uint8_t *r, size_t w) {
  if (!memcmp(x, r, w)) return 0;
  double xv = val(dt, x), rv = val(dt, r);
  if (!isfinite(xv) || !isfinite(rv)) return 1;
  if (p->kind == P_THR && p->share)
    return fabs(xv - rv) > NEAR(p->mult * (p->abs + p->rel * fabs(rv)));
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
void drift(int dt, uint8_t *p, uint64_t *rng, int tiny) {
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

tens *add_tensor(world *W, const char *name, int dt, uint32_t ndim, int64_t d0, int64_t d1,
                 const pol *p) {
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
void add_standard(world *W, uint64_t chunk, const pol *p) {
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

void world_init(world *W, uint64_t seed, int tiny) {
  memset(W, 0, sizeof *W);
  W->seed = seed;
  W->rng = seed * 0x9E3779B97F4A7C15ull + 1;
  W->tiny = tiny;
  W->dir = tu_tmpdir();
}

/* Opens store and writer, adds `rules` (NULL-terminated) and declares the tensors. */
int world_open(world *W, const amber_writer_opts *wo, const char *const *rules) {
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

void world_close(world *W) {
  amber_writer_close(W->w);
  amber_store_close(W->st);
  W->w = NULL;
  W->st = NULL;
}

void world_free(world *W) {
  for (size_t i = 0; i < W->n; i++) {
    free(W->t[i].live_mem);
    free(W->t[i].prev);
    free(W->t[i].got);
  }
  W->n = 0;
}

void world_mutate(world *W) {
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
      /* a quantized change may round to a code of 0: stored, and restores unchanged */
      case AMBER__ENC_QSPARSE: ok = ch->stored >= changed && ch->size > 0; break;
      case AMBER__ENC_RAW: ok = ch->stored == n && ch->size == n * t->w; break;
      default: ok = 0;
      }
      if (ok && (ch->encoding == AMBER__ENC_SPARSE || ch->encoding == AMBER__ENC_QSPARSE) &&
          t->p.kind == P_THR)
        ok = overstored == 0;
      if (ok && ch->encoding != AMBER__ENC_RAW && t->p.kind == P_BUD)
        ok = ch->stored <= budget_allows(t->p.frac, n) + nforced;
      if (ok && ch->encoding != AMBER__ENC_RAW && t->p.kind == P_THR && t->p.share)
        ok = ch->stored <= budget_allows(t->p.share, n) + nforced;
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

int save_check(world *W, uint64_t step, uint32_t flags) {
  int rc = amber_writer_save(W->w, step, flags);
  CHECK_OK(rc);
  if (rc) return -1;
  return check_step(W, step);
}

int g_misalign;

/* Runs `steps` steps of a trajectory under one policy for every float tensor;
 * counts the kinds saved. Some steps change nothing, to exercise UNCHANGED. */
void run_trajectory(uint64_t seed, uint64_t chunk, const char *rule, const pol *p, int steps,
                    uint32_t full_every, double full_share, int tiny, int *nfull) {
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

void small_open(small *S, const char *dir, const amber_writer_opts *wo) {
  S->dir = dir;
  S->st = NULL;
  S->w = NULL;
  CHECK_OK(amber_store_open(&S->st, dir, NULL));
  if (S->st) CHECK_OK(amber_writer_open(&S->w, S->st, wo));
  int64_t n = 4000;
  if (S->w) CHECK_OK(amber_writer_add(S->w, "x", AMBER_F32, 1, &n, S->x, NULL));
}

void small_init(small *S, uint64_t seed) {
  S->rng = seed;
  for (int i = 0; i < 4000; i++) S->x[i] = (float)urand(&S->rng);
}

void small_step(small *S, double share) {
  for (int i = 0; i < 4000; i++)
    if (urand(&S->rng) < share) S->x[i] += 1e-3f;
}

void small_close(small *S) {
  amber_writer_close(S->w);
  amber_store_close(S->st);
  S->w = NULL;
  S->st = NULL;
}

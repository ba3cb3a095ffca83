/*
 * test_delta_quant.c - quantized deltas (format 1.3, QSPARSE): policies with a
 * value code (@q8, @q4, @bf16, +lead) keep their bound at every step of long
 * chains for every dtype; the quantizer moves the writer's reference to exactly
 * what a restore decodes; quantized bodies decode as FORMAT.md says and every
 * malformed one is refused before anything is written; units resolve into the
 * recorded policy; the f32 -> f16 rounding is IEEE's.
 */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>

#include "ckpt.h"
#include "codec.h"
#include "format.h"
#include "internal.h"
#include "quant.h"
#include "scan.h"
#include "trajectory.h"

#define LONG_STEPS 80

/* ---- trajectories ---- */

static void test_quantized_threshold_bound_holds_every_step_of_long_chains(void) {
  const pol pols[] = {thr(1e-3, 1e-2, "threshold:1e-3:1e-2@q4"),
                      thr(0.05, 0, "threshold:0.05@q4+lead"),
                      thr(0, 0.3, "threshold:0:0.3@q4+lead"),
                      thr(1e-3, 0, "threshold:1e-3@q8"),
                      thr(0, 1e-3, "threshold:0:1e-3@bf16"),
                      thr(2e-3, 5e-2, "threshold:2e-3:5e-2@q8+lead")};
  for (uint64_t seed = 1; seed <= 6; seed++) {
    const pol *p = &pols[seed - 1];
    int nfull = 0;
    run_trajectory(300 + seed, seed % 2 ? 64 : 1000, p->spec, p, LONG_STEPS, UINT32_MAX, -1, 1,
                   &nfull);
    CHECK(nfull == 1);
  }
}

static void test_quantized_budget_within_cap_every_step(void) {
  const pol pols[] = {bud(0.1, 0.01, "budget:0.1:0.01@q4"), bud(0.2, 0.5, "budget:0.2:0.5@q8+lead"),
                      bud(0.05, 1e-3, "budget:0.05:1e-3@bf16"), bud(1, 0.05, "budget:1:0.05@q4+lead")};
  for (uint64_t seed = 1; seed <= 4; seed++) {
    const pol *p = &pols[seed - 1];
    int nfull = 0;
    run_trajectory(400 + seed, seed % 2 ? 64 : 1000, p->spec, p, 50, UINT32_MAX, -1, 1, &nfull);
    CHECK(nfull == 1);
  }
}

/* A share cap ("/SHARE:MULT"): the trajectory's drift takes most elements past
 * these small bounds at every step, so each chunk stores at most SHARE of itself
 * besides the forced ones, every element stays within MULT bounds, and what is
 * stored is over its bound (trajectory.h checks all three at every step), with
 * whole values and codes. */
static void test_share_capped_threshold_stores_at_most_its_share_every_step(void) {
  const pol pols[] = {thrc(0, 1e-3, 0.05, 4, "threshold:0:1e-3/0.05:4@q8+lead"),
                      thrc(1e-4, 0, 0.1, 2, "threshold:1e-4/0.1:2"),
                      thrc(0, 2e-3, 0.02, 8, "threshold:0:2e-3/0.02:8@q4"),
                      thrc(1e-5, 1e-3, 0.2, 3, "threshold:1e-5:1e-3/0.2:3@bf16"),
                      thrc(0, 1e-3, 1, 1, "threshold:0:1e-3/1:1@q8+lead")};
  for (uint64_t seed = 1; seed <= 5; seed++) {
    const pol *p = &pols[seed - 1];
    int nfull = 0;
    run_trajectory(500 + seed, seed % 2 ? 64 : 1000, p->spec, p, 40, UINT32_MAX, -1, 1, &nfull);
    CHECK(nfull == 1);
  }
}

/* ---- an independent decoder (FORMAT.md, "Quantized sparse body") ---- */

static uint64_t rnd(uint64_t *s) {
  return tu_rand(s);
}

static double urnd(uint64_t *s) {
  return (double)(rnd(s) >> 11) * 0x1p-53;
}

/* Reads element i of a chunk as f64 and writes v back in the dtype. */
static double getv(int dt, const uint8_t *p) {
  return amber__to_f64(dt, p);
}

/* What the format says element i restores to, computed here from the parts. */
static void ref_restore(int dt, uint8_t *d, const amber__qsel *q, size_t i) {
  if (dt == AMBER_F64) {
    double r;
    memcpy(&r, d, 8);
    if (q->mode == AMBER__QV_BF16) {
      uint16_t b = ((const uint16_t *)q->codes)[i];
      uint32_t u = (uint32_t)b << 16;
      float f;
      memcpy(&f, &u, 4);
      r = r + (double)f;
    } else {
      double s = (double)q->steps[i >> q->group_log2] + (double)q->rel_step * fabs(r);
      r = r + (double)((const int8_t *)q->codes)[i] * s;
    }
    memcpy(d, &r, 8);
    return;
  }
  float r = (float)getv(dt, d);
  if (q->mode == AMBER__QV_BF16) {
    uint32_t u = (uint32_t)((const uint16_t *)q->codes)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    r = r + f;
  } else {
    float s = q->rel_step * fabsf(r);
    s = q->steps[i >> q->group_log2] + s;
    float t = (float)((const int8_t *)q->codes)[i] * s;
    r = r + t;
  }
  if (dt == AMBER_F32) {
    memcpy(d, &r, 4);
  } else if (dt == AMBER_BF16) {
    uint16_t h = amber__f32_to_bf16(r);
    memcpy(d, &h, 2);
  } else {
    uint16_t h = amber__f32_to_f16(r);
    memcpy(d, &h, 2);
  }
}

static const int QDT[] = {AMBER_F32, AMBER_F64, AMBER_BF16, AMBER_F16};

static void put_val(int dt, uint8_t *p, double v) {
  if (dt == AMBER_F64) {
    memcpy(p, &v, 8);
  } else if (dt == AMBER_F32) {
    float f = (float)v;
    memcpy(p, &f, 4);
  } else {
    uint16_t h = dt == AMBER_BF16 ? amber__f32_to_bf16((float)v) : amber__f32_to_f16((float)v);
    memcpy(p, &h, 2);
  }
}

/* Quantized bodies are entropy coded by default (zstd level 1: the codes are small
 * integers, which zstd's negative levels store as raw literals), and a zstd level
 * the caller sets applies to them too: the same saves, the same restore, a smaller
 * delta by default than at an explicit level -1. */
static void test_quantized_bodies_are_entropy_coded_by_default(void) {
  size_t n = 1 << 16;
  float *x = malloc(n * 4), *g[2] = {malloc(n * 4), malloc(n * 4)};
  CHECK(x && g[0] && g[1]);
  uint64_t bytes[2] = {0, 0};
  for (int v = 0; v < 2; v++) {
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/qz-%d", tu_tmpdir(), v);
    uint64_t rng = 7;
    for (size_t i = 0; i < n; i++) x[i] = (float)(urnd(&rng) - 0.5);
    amber_store *st;
    amber_writer *w;
    amber_writer_opts wo;
    amber_writer_opts_init(&wo);
    wo.full_every = UINT32_MAX;
    wo.full_share = -1;
    wo.zstd_level = v ? -1 : 0;
    CHECK_OK(amber_store_open(&st, dir, NULL));
    CHECK_OK(amber_writer_open(&w, st, &wo));
    CHECK_OK(amber_writer_add(w, "x", AMBER_F32, 1, (int64_t[]){(int64_t)n}, x, NULL));
    CHECK_OK(amber_writer_add_policy(w, "threshold:1e-3@q8"));
    CHECK_OK(amber_writer_save(w, 1, 0));
    /* most elements move a little: codes of small magnitude, a skewed distribution */
    for (size_t i = 0; i < n; i++) x[i] += (float)((urnd(&rng) - 0.5) * 4e-3);
    CHECK_OK(amber_writer_save(w, 2, 0));
    amber_ckpt_info *info;
    size_t cnt;
    CHECK_OK(amber_store_list(st, &info, &cnt));
    CHECK(cnt == 2 && info[1].kind == AMBER_KIND_DELTA);
    if (cnt == 2) bytes[v] = info[1].bytes;
    amber_free(info);
    amber_reader *r;
    CHECK_OK(amber_reader_open(&r, st, 2, NULL));
    CHECK_OK(amber_reader_read(r, 0, g[v], n * 4));
    amber_reader_close(r);
    amber_writer_close(w);
    amber_store_close(st);
  }
  CHECK(!memcmp(g[0], g[1], n * 4));
  if (!(bytes[0] < bytes[1] * 9 / 10))
    fprintf(stderr, "    default %" PRIu64 " bytes, level -1 %" PRIu64 "\n", bytes[0], bytes[1]);
  CHECK(bytes[0] < bytes[1] * 9 / 10);
  free(x), free(g[0]), free(g[1]);
}

/* Random selections, codes, steps and escapes of every mode and dtype encode to a
 * body that decodes to what the format defines, element by element. */
static void test_quantized_bodies_decode_as_the_format_defines(void) {
  uint64_t rng = 0x9e3779b9;
  const size_t sizes[] = {1, 2, 9, 64, 65, 1000, 5000};
  size_t cases = 0;
  for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
    size_t n = sizes[si];
    uint32_t *idx = malloc(n * 4), *esc = malloc(n * 4), *s1 = malloc(n * 4), *s2 = malloc(n * 4);
    int8_t *codes = malloc(2 * n);
    float *steps = malloc((n + 1) * 4);
    uint8_t *base = malloc(n * 8), *want = malloc(n * 8), *got = malloc(n * 8),
            *ev = malloc(n * 8);
    amber__qsel q0 = {.k = n, .mode = AMBER__QV_BF16, .nesc = n};
    uint8_t *body = malloc(amber__qsparse_bound(n, &q0, 8) + 4 * n);
    CHECK(idx && esc && codes && steps && base && want && got && ev && body && s1 && s2);
    for (int trial = 0; trial < 24; trial++) {
      int dt = QDT[trial % 4], mode = 1 + (trial / 4) % 3;
      size_t w = amber_dtype_size(dt), k = 0, nesc = 0;
      double p = trial % 5 == 0 ? 1.0 : 0.02 + 0.1 * urnd(&rng);
      for (size_t i = 0; i < n; i++)
        if (urnd(&rng) < p) idx[k++] = (uint32_t)i;
      unsigned glog = mode == AMBER__QV_BF16 ? 0 : (unsigned)(rnd(&rng) % 8);
      amber__qsel q = {.k = k, .idx = idx, .mode = mode, .group_log2 = glog,
                       .rel_step = mode == AMBER__QV_BF16 ? 0 : (float)(0.1 * urnd(&rng)),
                       .steps = steps, .codes = codes, .esc = esc, .esc_vals = ev};
      for (size_t g = 0; g <= n; g++) steps[g] = (float)(1e-3 * urnd(&rng));
      for (size_t i = 0; i < k; i++) {
        if (urnd(&rng) < 0.1) { /* an escape */
          esc[nesc] = (uint32_t)i;
          put_val(dt, ev + nesc * w, 100 * urnd(&rng) - 50);
          nesc++;
          if (mode == AMBER__QV_BF16) ((uint16_t *)(void *)codes)[i] = 0;
          else codes[i] = 0;
          continue;
        }
        if (mode == AMBER__QV_BF16)
          ((uint16_t *)(void *)codes)[i] = amber__f32_to_bf16((float)(0.01 * (urnd(&rng) - 0.5)));
        else
          codes[i] = (int8_t)(mode == AMBER__QV_Q4 ? (int)(rnd(&rng) % 16) - 8
                                                   : (int)(rnd(&rng) % 255) - 127);
      }
      q.nesc = nesc;
      for (size_t i = 0; i < n; i++) put_val(dt, base + i * w, 2 * urnd(&rng) - 1);
      memcpy(want, base, n * w);
      for (size_t i = 0, e = 0; i < k; i++) {
        if (e < nesc && esc[e] == i) {
          memcpy(want + (size_t)idx[i] * w, ev + e * w, w);
          e++;
        } else {
          ref_restore(dt, want + (size_t)idx[i] * w, &q, i);
        }
      }
      size_t len = amber__qsparse_encode(body, &q, n, w);
      CHECK(len <= amber__qsparse_bound(n, &q, w));
      CHECK(len <= amber__qsparse_body_max(n, k, w));
      memcpy(got, base, n * w);
      CHECK_OK(amber__qsparse_apply(got, body, len, n, k, dt, s1, s2));
      if (memcmp(got, want, n * w)) {
        fprintf(stderr, "    n=%zu k=%zu dt=%d mode=%d: restore differs\n", n, k, dt, mode);
        CHECK(0);
      }
      cases++;
    }
    free(idx), free(esc), free(codes), free(steps), free(base), free(want), free(got), free(ev);
    free(body), free(s1), free(s2);
  }
  CHECK(cases == 24 * sizeof sizes / sizeof sizes[0]);
}

/* ---- the quantizer ---- */

/* For every dtype, mode and policy: after amber__quantize the reference holds, bit
 * for bit, what decoding the body onto the old reference gives; every selected
 * element is within the bound; NaN, Inf and changes too large for the codes are
 * escapes that restore the live bits. */
static void test_quantizer_moves_the_reference_to_what_a_restore_decodes(void) {
  const char *specs[] = {"threshold:1e-3@q4", "threshold:1e-3:0.05@q4+lead", "threshold:0:0.3@q8+lead",
                         "threshold:2e-4@q8", "threshold:0:0.01@bf16", "budget:0.5:0.02@q4",
                         "budget:0.5:0.02@q8+lead", "budget:0.5@q4", "budget:0.5:1e-3@bf16"};
  uint64_t rng = 77;
  size_t n = 3000, escapes = 0, leads = 0, total = 0;
  uint32_t *idx = malloc(n * 4), *s1 = malloc(n * 4), *s2 = malloc(n * 4);
  uint32_t *esc = malloc(n * 4);
  uint8_t *live = malloc(n * 8), *ref = malloc(n * 8), *old = malloc(n * 8), *vals = malloc(n * 8),
          *dec = malloc(n * 8), *ev = malloc(n * 8), *codes = malloc(2 * n);
  float *steps = malloc((n / 64 + 2) * 4);
  amber__qsel q0 = {.k = n, .mode = AMBER__QV_BF16, .nesc = n};
  uint8_t *body = malloc(amber__qsparse_bound(n, &q0, 8));
  CHECK(idx && s1 && s2 && esc && live && ref && old && vals && dec && ev && codes && steps && body);
  for (size_t si = 0; si < sizeof specs / sizeof specs[0]; si++) {
    amber__policy p;
    CHECK(amber__policy_parse(specs[si], &p) == 0);
    for (size_t di = 0; di < 4; di++) {
      int dt = QDT[di];
      size_t w = amber_dtype_size(dt), k = 0;
      for (size_t i = 0; i < n; i++) {
        double r = (urnd(&rng) - 0.5) * (i % 3 == 0 ? 10 : 0.1);
        double ch = (urnd(&rng) - 0.5) * (i % 7 == 0 ? 1.0 : 4e-3);
        put_val(dt, ref + i * w, r);
        put_val(dt, live + i * w, r + ch);
        if (i % 97 == 5) put_val(dt, live + i * w, NAN);
        if (i % 101 == 7) put_val(dt, live + i * w, -INFINITY);
        if (i % 103 == 9) put_val(dt, ref + i * w, INFINITY);
        if (i % 89 == 3) put_val(dt, live + i * w, (i % 2 ? 1 : -1) * 6e4); /* f16: near its max */
        if (memcmp(live + i * w, ref + i * w, w) && (urnd(&rng) < 0.6 || i % 97 == 5)) {
          idx[k] = (uint32_t)i;
          memcpy(vals + k * w, live + i * w, w);
          k++;
        }
      }
      memcpy(old, ref, n * w);
      amber__qbuf qb = {.codes = codes, .steps = steps, .esc = esc, .esc_vals = ev};
      amber__qsel q;
      amber__quantize(&p, dt, ref, idx, vals, k, &qb, &q);
      CHECK(q.k == k && q.mode == p.qmode);
      size_t len = amber__qsparse_encode(body, &q, n, w);
      memcpy(dec, old, n * w);
      CHECK_OK(amber__qsparse_apply(dec, body, len, n, k, dt, s1, s2));
      if (memcmp(dec, ref, n * w)) {
        fprintf(stderr, "    %s dtype %d: reference and restore differ\n", specs[si], dt);
        CHECK(0);
      }
      for (size_t i = 0, e = 0; i < k; i++) {
        const uint8_t *x = live + (size_t)idx[i] * w, *r = ref + (size_t)idx[i] * w;
        int is_esc = e < q.nesc && q.esc[e] == i;
        e += (size_t)is_esc;
        escapes += (size_t)is_esc;
        double xv = getv(dt, x), rv = getv(dt, r), ov = getv(dt, old + (size_t)idx[i] * w);
        if (!isfinite(xv) || !isfinite(ov)) CHECK(is_esc && !memcmp(x, r, w));
        if (is_esc) CHECK(!memcmp(x, r, w));
        double bound = p.kind == AMBER__POL_THRESHOLD ? p.abs + p.rel * fabs(rv) : p.cap;
        if (isfinite(xv) && !(fabs(xv - rv) <= bound)) {
          fprintf(stderr, "    %s dtype %d [%u]: live %a restored %a, bound %a\n", specs[si], dt,
                  idx[i], xv, rv, bound);
          CHECK(0);
        }
        /* a lead overshoots: restored past live, away from the old value */
        leads += p.lead && isfinite(xv) && !is_esc && (rv - xv) * (xv - ov) > 0;
        total++;
      }
    }
  }
  CHECK(escapes > 0 && leads > total / 20);
  free(idx), free(s1), free(s2), free(esc), free(live), free(ref), free(old), free(vals);
  free(dec), free(ev), free(codes), free(steps), free(body);
}

/* The f32 loop (the default for f32 tensors) decides exactly as the generic code:
 * the same codes, escapes and reference bits, for every policy kind, on changes that
 * land on ties of the rounding (x.5 steps, the codes' edges), on NaN, Inf, zero
 * references and huge jumps. */
static void test_f32_quantizer_matches_the_generic_one(void) {
  const char *specs[] = {"threshold:1e-3@q4", "threshold:1e-3:0.05@q4+lead", "threshold:0:0.3@q8+lead",
                         "threshold:2e-4@q8", "budget:0.5:0.02@q4", "budget:0.5:0.02@q8+lead",
                         "budget:0.5@q8", "budget:0.3:1e-3@q4+lead"};
  uint64_t rng = 4242;
  size_t n = 4000;
  uint32_t *idx = malloc(n * 4), *e1 = malloc(n * 4), *e2 = malloc(n * 4);
  float *live = malloc(n * 4), *r1 = malloc(n * 4), *r2 = malloc(n * 4), *v1 = malloc(n * 4),
        *v2 = malloc(n * 4), *s1 = malloc(64), *s2 = malloc(64);
  int8_t *c1 = malloc(n), *c2 = malloc(n);
  size_t ties = 0;
  CHECK(idx && e1 && e2 && live && r1 && r2 && v1 && v2 && c1 && c2 && s1 && s2);
  for (size_t si = 0; si < sizeof specs / sizeof specs[0]; si++) {
    amber__policy p;
    CHECK(amber__policy_parse(specs[si], &p) == 0);
    double step = p.kind == AMBER__POL_THRESHOLD ? 0.5 * p.abs : 1e-3;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
      float r = (float)((urnd(&rng) - 0.5) * (i % 5 == 0 ? 10 : 0.2));
      double m = (double)(int)(rnd(&rng) % 300) - 150 + (i % 2 ? 0.5 : 0.0); /* ties */
      float x = (float)(r + m * step * (urnd(&rng) < 0.5 ? 1 : 1 + 1e-7));
      if (i % 97 == 5) x = NAN;
      if (i % 101 == 7) x = -INFINITY;
      if (i % 103 == 9) r = 0;
      if (i % 109 == 13) { /* a reference of -0 and a change that rounds to a code of 0 */
        r = -0.0f;
        x = (float)(0.2 * step);
      }
      if (i % 107 == 11) x = r + 1e30f;
      r1[i] = r2[i] = r;
      live[i] = x;
      if (memcmp(&x, &r, 4) && urnd(&rng) < 0.7) {
        idx[k] = (uint32_t)i;
        memcpy(v1 + k, &x, 4);
        k++;
      }
      ties += fabs(fmod(m, 1.0)) == 0.5;
    }
    float *ev = malloc(n * 4), *r0 = malloc(n * 4);
    CHECK(ev && r0);
    memcpy(r0, r2, n * 4);
    amber__qbuf b2 = {.codes = c2, .steps = s2, .esc = e2, .esc_vals = (uint8_t *)ev};
    amber__qsel q1, q2;
    amber__quant_use_fast(0);
    amber__quantize(&p, AMBER_F32, (uint8_t *)r2, idx, (const uint8_t *)v1, k, &b2, &q2);
    int same = 1;
    for (int level = 2; level >= 1; level--) { /* AVX-512 (where it runs), the f32 loop */
      memcpy(r1, r0, n * 4);
      amber__qbuf b1 = {.codes = c1, .steps = s1, .esc = e1, .esc_vals = (uint8_t *)v2};
      amber__quant_use_fast(level);
      amber__quantize(&p, AMBER_F32, (uint8_t *)r1, idx, (const uint8_t *)v1, k, &b1, &q1);
      int ok = q1.nesc == q2.nesc && s1[0] == s2[0] && !memcmp(c1, c2, k) &&
               !memcmp(r1, r2, n * 4) && !memcmp(e1, e2, q1.nesc * 4) &&
               !memcmp(v2, ev, q1.nesc * 4);
      if (!ok)
        fprintf(stderr, "    %s: the f32 code (level %d) and the generic code differ\n", specs[si],
                level);
      same = same && ok;
    }
    amber__quant_use_fast(2);
    free(r0);
    CHECK(same && q1.nesc > 0);
    free(ev);
  }
  CHECK(ties > 100);
  free(idx), free(e1), free(e2), free(live), free(r1), free(r2), free(v1), free(v2);
  free(c1), free(c2), free(s1), free(s2);
}

/* A threshold policy of an f32 tensor is quantized inside the scan's pass on AVX-512
 * (scan.c) and after it elsewhere: a trajectory saved both ways restores the same
 * bits at every step, and so the writers' references are the same. */
static void test_quantizing_in_the_scan_matches_quantizing_after_it(void) {
  const char *specs[] = {"threshold:1e-3@q8+lead", "threshold:1e-3:0.05@q4", "threshold:0:0.3@q8+lead",
                         "threshold:2e-3@q4+lead", "threshold:2e-4/0.1:4@q8+lead",
                         "threshold:0:1e-3/0.05:3@q4"};
  size_t n = 5000;
  float *x = malloc(n * 4), *g0 = malloc(n * 4), *g2 = malloc(n * 4);
  CHECK(x && g0 && g2);
  for (size_t si = 0; si < sizeof specs / sizeof specs[0]; si++) {
    amber_store *st[2];
    amber_writer *w[2];
    amber_store_opts so;
    amber_store_opts_init(&so);
    so.threads = 1;
    amber_writer_opts wo;
    tu_deltas_only(&wo, 1024);
    uint64_t rng = 99 + si;
    for (size_t i = 0; i < n; i++) x[i] = (float)((urnd(&rng) - 0.5) * (i % 4 ? 1 : 1e3));
    for (int v = 0; v < 2; v++) {
      char dir[4200];
      snprintf(dir, sizeof dir, "%s/fuse-%zu-%d", tu_tmpdir(), si, v);
      CHECK_OK(amber_store_open(&st[v], dir, &so));
      CHECK_OK(amber_writer_open(&w[v], st[v], &wo));
      CHECK_OK(amber_writer_add(w[v], "x", AMBER_F32, 1, (int64_t[]){(int64_t)n}, x, NULL));
      CHECK_OK(amber_writer_add_policy(w[v], specs[si]));
    }
    int same = 1;
    for (uint64_t step = 1; step <= 25 && same; step++) {
      for (size_t i = 0; i < n; i++) {
        x[i] += (float)((urnd(&rng) - 0.3) * 2e-3 * (i % 3 ? 1 : 5)) - 0.05f * x[i] * (i % 5 == 0);
        if (i % 211 == step % 7) x[i] = step % 2 ? NAN : INFINITY;
        else if (!isfinite(x[i])) x[i] = 0.5f;
      }
      for (int v = 0; v < 2; v++) {
        amber__scan_use_simd(v ? 2 : 0);
        CHECK_OK(amber_writer_save(w[v], step, 0));
      }
      amber__scan_use_simd(2);
      amber_reader *r;
      CHECK_OK(amber_reader_open(&r, st[0], step, NULL));
      CHECK_OK(amber_reader_read(r, 0, g0, n * 4));
      amber_reader_close(r);
      CHECK_OK(amber_reader_open(&r, st[1], step, NULL));
      CHECK_OK(amber_reader_read(r, 0, g2, n * 4));
      amber_reader_close(r);
      same = !memcmp(g0, g2, n * 4);
      if (!same) fprintf(stderr, "    %s step %" PRIu64 ": the two restores differ\n", specs[si], step);
    }
    CHECK(same);
    for (int v = 0; v < 2; v++) {
      amber_writer_close(w[v]);
      amber_store_close(st[v]);
    }
  }
  free(x), free(g0), free(g2);
}

/* A budget's fill from the band after a strict pass skips the candidates: one forced
 * by CAP may lie in the band, and under a quantized policy (defer) the reference
 * still holds its old value there. Once they were selected twice: duplicate
 * indices, and a body that does not decode. Every kernel level, f32 and f16. */
static void test_a_budget_fill_skips_the_candidates_in_the_band(void) {
  const int dts[] = {AMBER_F32, AMBER_F16};
  size_t n = 4096, budget = 204;
  double hi = 1.0 + 0x1p-10; /* the band's top for a cluster of changes of 1 */
  uint32_t *idx = malloc(n * 4), *keys = malloc(n * 4), *first = malloc(n * 4), *s1 = malloc(n * 4),
           *s2 = malloc(n * 4), *esc = malloc(n * 4);
  uint8_t *live = malloc(n * 4), *ref = malloc(n * 4), *vals = malloc(n * 4), *olds = malloc(n * 4),
          *dec = malloc(n * 4), *codes = malloc(2 * n), *ev = malloc(n * 4);
  float steps[1];
  amber__qsel q0 = {.k = n, .mode = AMBER__QV_BF16, .nesc = n};
  uint8_t *body = malloc(amber__qsparse_bound(n, &q0, 4));
  CHECK(idx && keys && first && s1 && s2 && esc && live && ref && vals && olds && dec && codes &&
        ev && body);
  amber__policy p;
  CHECK(amber__policy_parse("budget:0.05:1.0009765625@q8", &p) == 0);
  for (int level = 0; level <= 2; level++) {
    amber__scan_use_simd(level);
    for (size_t di = 0; di < 2; di++) {
      int dt = dts[di];
      size_t w = amber_dtype_size(dt), k0 = 0;
      for (int defer = 0; defer <= 1; defer++) {
        for (size_t i = 0; i < n; i++) {
          put_val(dt, ref + i * w, 0);
          put_val(dt, live + i * w, i < 4 ? hi : 1.0); /* forced by CAP, in the band */
        }
        amber__scan_args a = {.kind = AMBER__SCAN_BUDGET, .dtype = dt, .n = n, .live = live,
                              .ref = ref, .cap = hi, .budget = budget, .keys = keys,
                              .idx = idx, .vals = vals, .olds = olds, .defer = defer};
        size_t k = amber__scan(&a);
        CHECK(k == budget);
        for (size_t i = 1; i < k; i++) CHECK(idx[i] > idx[i - 1]);
        if (!defer) {
          memcpy(first, idx, k * 4);
          k0 = k;
          continue;
        }
        CHECK(k == k0 && !memcmp(first, idx, k * 4)); /* the same selection either way */
        amber__qbuf qb = {.codes = codes, .steps = steps, .esc = esc, .esc_vals = ev};
        amber__qsel q;
        memcpy(dec, ref, n * w);
        amber__quantize(&p, dt, ref, idx, vals, k, &qb, &q);
        size_t len = amber__qsparse_encode(body, &q, n, w);
        CHECK_OK(amber__qsparse_apply(dec, body, len, n, k, dt, s1, s2));
        CHECK(!memcmp(dec, ref, n * w));
      }
    }
  }
  amber__scan_use_simd(2);
  free(idx), free(keys), free(first), free(s1), free(s2), free(esc), free(live), free(ref);
  free(vals), free(olds), free(dec), free(codes), free(ev), free(body);
}

/* ---- malformed bodies ---- */

/* A valid Q4 body of 5 of 40 f32 elements with one escape; each damage below makes
 * amber__qsparse_apply refuse it, and the destination stays untouched. */
static void test_malformed_quantized_bodies_are_refused(void) {
  size_t n = 40, k = 5, w = 4;
  uint32_t idx[5] = {1, 4, 9, 20, 39}, esc[1] = {2}, s1[40], s2[40];
  int8_t codes[5] = {3, -7, 0, 7, -8};
  float steps[1] = {0.5f}, evf[1] = {42.0f};
  amber__qsel q = {.k = k, .idx = idx, .mode = AMBER__QV_Q4, .group_log2 = 3, .rel_step = 0,
                   .steps = steps, .codes = codes, .nesc = 1, .esc = esc,
                   .esc_vals = (const uint8_t *)evf};
  uint8_t body[256], bad[256], dst[160], keep[160];
  size_t len = amber__qsparse_encode(body, &q, n, w);
  for (size_t i = 0; i < n; i++) {
    float v = (float)i;
    memcpy(keep + 4 * i, &v, 4);
  }
  memcpy(dst, keep, sizeof dst);
  CHECK_OK(amber__qsparse_apply(dst, body, len, n, k, AMBER_F32, s1, s2));
  float got;
  memcpy(&got, dst + 4 * 9, 4);
  CHECK(got == 42.0f);
  memcpy(&got, dst + 4 * 39, 4);
  CHECK(got == 39.0f - 8 * 0.5f);
  /* the positions part is a bitmap (5 varints are no smaller): 1 + 5 bytes */
  size_t vm = 6;
  CHECK(body[0] == 0 && body[vm] == AMBER__QV_Q4);
  struct {
    const char *what;
    size_t at;
    uint8_t val;
  } edits[] = {
      {"value_mode 0", vm, 0},          {"value_mode 4", vm, 4},
      {"group_log2 25", vm + 1, 25},    {"reserved byte", vm + 2, 1},
      {"reserved byte 2", vm + 3, 1},   {"n_escapes 6", vm + 8, 6},
      {"n_escapes 2", vm + 8, 2},       {"escape past k", len - 5, 5},
      {"escape with a code", len - 5, 0}, /* ordinal 0 has code 3 */
  };
  for (size_t e = 0; e < sizeof edits / sizeof edits[0]; e++) {
    memcpy(bad, body, len);
    bad[edits[e].at] = edits[e].val;
    memcpy(dst, keep, sizeof dst);
    if (amber__qsparse_apply(dst, bad, len, n, k, AMBER_F32, s1, s2) != AMBER_ECORRUPT ||
        memcmp(dst, keep, sizeof dst)) {
      fprintf(stderr, "    %s: not refused cleanly\n", edits[e].what);
      CHECK(0);
    }
  }
  /* every truncation, and one byte too many */
  for (size_t l = 0; l < len; l++) {
    memcpy(dst, keep, sizeof dst);
    CHECK(amber__qsparse_apply(dst, body, l, n, k, AMBER_F32, s1, s2) == AMBER_ECORRUPT);
    CHECK(!memcmp(dst, keep, sizeof dst));
  }
  memcpy(bad, body, len);
  bad[len] = 0;
  CHECK(amber__qsparse_apply(dst, bad, len + 1, n, k, AMBER_F32, s1, s2) == AMBER_ECORRUPT);
  /* a wrong count, an f8 or integer dtype */
  CHECK(amber__qsparse_apply(dst, body, len, n, k + 1, AMBER_F32, s1, s2) == AMBER_ECORRUPT);
  CHECK(amber__qsparse_apply(dst, body, len, n, k, AMBER_F8_E4M3, s1, s2) == AMBER_ECORRUPT);
  CHECK(amber__qsparse_apply(dst, body, len, n, k, AMBER_I32, s1, s2) == AMBER_ECORRUPT);
  /* Q4 with an odd count: the last byte's high half must be zero */
  int8_t c3[3] = {1, 2, 3};
  uint32_t i3[3] = {0, 1, 2};
  amber__qsel q3 = {.k = 3, .idx = i3, .mode = AMBER__QV_Q4, .group_log2 = 24, .steps = steps,
                    .codes = c3};
  len = amber__qsparse_encode(body, &q3, n, w);
  CHECK_OK(amber__qsparse_apply(dst, body, len, n, 3, AMBER_F32, s1, s2));
  body[len - 1] |= 0x10;
  CHECK(amber__qsparse_apply(dst, body, len, n, 3, AMBER_F32, s1, s2) == AMBER_ECORRUPT);
  /* bf16 codes with a group or a rel_step */
  uint16_t b3[3] = {0x3f80, 0, 0x4000};
  amber__qsel qb = {.k = 3, .idx = i3, .mode = AMBER__QV_BF16, .codes = b3};
  len = amber__qsparse_encode(body, &qb, n, w);
  CHECK_OK(amber__qsparse_apply(dst, body, len, n, 3, AMBER_F32, s1, s2));
  body[4 + 1] = 1; /* positions: mode + 3 gaps; group_log2 at 5 */
  CHECK(amber__qsparse_apply(dst, body, len, n, 3, AMBER_F32, s1, s2) == AMBER_ECORRUPT);
}

/* ---- the f16 rounding ---- */

/* amber__f32_to_f16 rounds to nearest, ties to even, with subnormals, overflow to
 * Inf and NaN kept: every f16 value round-trips, and for random and boundary f32
 * values it agrees with the compiler's own conversion where there is one. */
static void test_f16_rounding_is_ieee_round_to_nearest_even(void) {
  for (uint32_t h = 0; h < 0x10000; h++) {
    float f = amber__f16_to_f32((uint16_t)h);
    uint16_t back = amber__f32_to_f16(f);
    if (isnan(f)) CHECK((back & 0x7c00) == 0x7c00 && (back & 0x3ff) && (back & 0x8000) == (h & 0x8000));
    else if (back != h) {
      fprintf(stderr, "    f16 0x%04x -> %a -> 0x%04x\n", h, f, back);
      CHECK(0);
      break;
    }
    /* the midpoint between h and the next value up rounds to the even one */
    if ((h & 0x7fff) < 0x7bff && !isnan(f)) {
      float nxt = amber__f16_to_f32((uint16_t)(h + 1));
      float mid = (float)(((double)f + (double)nxt) / 2);
      uint16_t want = (h & 1) ? (uint16_t)(h + 1) : (uint16_t)h;
      if ((h & 0x8000) == 0 && amber__f32_to_f16(mid) != want) {
        fprintf(stderr, "    midpoint of 0x%04x rounds to 0x%04x\n", h, amber__f32_to_f16(mid));
        CHECK(0);
        break;
      }
    }
  }
  CHECK(amber__f32_to_f16(65520.0f) == 0x7c00 && amber__f32_to_f16(65519.0f) == 0x7bff);
  CHECK(amber__f32_to_f16(-1e30f) == 0xfc00 && amber__f32_to_f16(0x1p-25f) == 0);
  CHECK(amber__f32_to_f16(0x1.8p-25f) == 1 && amber__f32_to_f16(-0.0f) == 0x8000);
  CHECK(amber__f32_to_bf16(1.00390625f) == 0x3f80 && amber__f32_to_bf16(1.01171875f) == 0x3f82);
#ifdef __FLT16_MAX__
  uint64_t rng = 5;
  for (int i = 0; i < 200000; i++) {
    uint32_t u = (uint32_t)rnd(&rng);
    float f;
    memcpy(&f, &u, 4);
    if (isnan(f)) continue;
    _Float16 g = (_Float16)f;
    uint16_t want;
    memcpy(&want, &g, 2);
    if (amber__f32_to_f16(f) != want) {
      fprintf(stderr, "    %a: 0x%04x, the compiler 0x%04x\n", f, amber__f32_to_f16(f), want);
      CHECK(0);
      break;
    }
  }
#endif
}

/* ---- policies and units ---- */

static void test_value_codes_and_units_parse_as_documented(void) {
  const char *good[] = {"threshold:1e-3@q4", "threshold:1e-3:0.1@q8+lead", "budget:0.1@q8",
                        "budget:0.1:1e-2@q4+lead", "threshold:0:0.3@bf16", "threshold:0.5u@q4+lead",
                        "budget:0.05:2u@q4", "x.*=threshold:1u", "threshold:1u/0.1:8@q8+lead",
                        "threshold:0:0.3/1:1", "threshold:1e-3/0.05:2.5"};
  const char *bad[] = {"exact@q4", "threshold:1e-3@q3", "threshold:1e-3@", "threshold:1e-3@bf16+lead",
                       "budget:0.1@q4+lead", "threshold:1e-3@q4+led", "threshold:1e-3@q4+lead+lead",
                       "budget:0.1u", "threshold:1e-3:0.1u", "threshold:uu", "threshold:u",
                       "threshold:1e-3/0.1", "threshold:1e-3/0:4", "threshold:1e-3/1.5:4",
                       "threshold:1e-3/0.1:0.5", "threshold:1e-3/0.1:4u", "threshold:1e-3/0.1u:4",
                       "budget:0.1/0.1:4", "threshold:1e-3/0.1:inf", "threshold:1e-3/0.1:4/0.1:4",
                       "threshold:1e-3/:4", "threshold:/0.1:4"};
  const char *dir = tu_tmpdir();
  amber_store *st;
  amber_writer *w;
  CHECK_OK(amber_store_open(&st, dir, NULL));
  CHECK_OK(amber_writer_open(&w, st, NULL));
  for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) CHECK_OK(amber_writer_add_policy(w, good[i]));
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    int rc = amber_writer_add_policy(w, bad[i]);
    if (rc != AMBER_EINVAL) fprintf(stderr, "    '%s' was accepted\n", bad[i]);
    CHECK(rc == AMBER_EINVAL);
  }
  amber_writer_close(w);
  /* units: "Nu" is N times the tensor's unit, written out in the index; a tensor
   * without a unit is exact under such a rule */
  float a[64], b[64];
  for (int i = 0; i < 64; i++) a[i] = b[i] = (float)i;
  CHECK_OK(amber_writer_open(&w, st, NULL));
  CHECK_OK(amber_writer_add_policy(w, "threshold:0.5u@q4+lead"));
  CHECK_OK(amber_writer_add_policy(w, "c=threshold:2u/0.25:8@q8+lead"));
  CHECK_OK(amber_writer_add(w, "a", AMBER_F32, 1, (int64_t[]){64}, a, NULL));
  CHECK_OK(amber_writer_add(w, "b", AMBER_F32, 1, (int64_t[]){64}, b, NULL));
  CHECK_OK(amber_writer_add(w, "c", AMBER_F32, 1, (int64_t[]){64}, b, NULL));
  CHECK_RC(amber_writer_set_units(w, (double[]){1, 2, 3, 4}, 4), AMBER_EINVAL);
  CHECK_RC(amber_writer_set_units(w, (double[]){NAN}, 1), AMBER_EINVAL);
  CHECK_RC(amber_writer_set_units(w, (double[]){-1}, 1), AMBER_EINVAL);
  CHECK_OK(amber_writer_set_units(w, (double[]){1e-3, 0, 1e-3}, 3));
  CHECK_OK(amber_writer_save(w, 1, 0));
  for (int i = 0; i < 64; i++) a[i] += 4e-4f * (float)(i % 3), b[i] += 1e-6f;
  CHECK_OK(amber_writer_save(w, 2, 0));
  amber_reader *r;
  amber_tensor_info ia, ib, ic;
  CHECK_OK(amber_reader_open(&r, st, 2, NULL));
  CHECK_OK(amber_reader_info(r, 0, &ia));
  CHECK_OK(amber_reader_info(r, 1, &ib));
  CHECK_OK(amber_reader_info(r, 2, &ic));
  CHECK(!strcmp(ia.policy, "threshold:0.00050000000000000001:0@q4+lead"));
  CHECK(!strcmp(ib.policy, "exact"));
  CHECK(!strcmp(ic.policy, "threshold:0.002:0/0.25:8@q8+lead"));
  float ga[64], gb[64];
  CHECK_OK(amber_reader_read(r, 0, ga, sizeof ga));
  CHECK_OK(amber_reader_read(r, 1, gb, sizeof gb));
  for (int i = 0; i < 64; i++) CHECK(fabsf(ga[i] - a[i]) <= 5e-4f && gb[i] == b[i]);
  amber_reader_close(r);
  /* a file that may hold quantized chunks says format 1.3 */
  amber__err e;
  amber__ckpt c;
  CHECK_OK(amber__ckpt_open(&e, st, 2, &c));
  CHECK(c.hdr.format_minor == 3);
  amber__ckpt_close(&c);
  amber_writer_close(w);
  amber_store_close(st);
}

int main(void) {
  TEST_RUN(test_quantized_threshold_bound_holds_every_step_of_long_chains);
  TEST_RUN(test_quantized_budget_within_cap_every_step);
  TEST_RUN(test_share_capped_threshold_stores_at_most_its_share_every_step);
  TEST_RUN(test_quantized_bodies_are_entropy_coded_by_default);
  TEST_RUN(test_quantized_bodies_decode_as_the_format_defines);
  TEST_RUN(test_quantizer_moves_the_reference_to_what_a_restore_decodes);
  TEST_RUN(test_f32_quantizer_matches_the_generic_one);
  TEST_RUN(test_quantizing_in_the_scan_matches_quantizing_after_it);
  TEST_RUN(test_a_budget_fill_skips_the_candidates_in_the_band);
  TEST_RUN(test_malformed_quantized_bodies_are_refused);
  TEST_RUN(test_f16_rounding_is_ieee_round_to_nearest_even);
  TEST_RUN(test_value_codes_and_units_parse_as_documented);
  return tu_finish();
}

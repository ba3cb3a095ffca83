/*
 * test_delta_policy.c - delta checkpoints keep their policy's promise
 * (docs/DESIGN.md, Guarantees 1 and 2) over random training-like trajectories
 * (tests/trajectory.h): exact restores bit-exact, threshold within its bound at
 * every step of long chains, budget within its CAP, and without a CAP every
 * pending change is stored once the values stop moving (also for tiny values,
 * equal changes, tail chunks and scalars); misaligned live buffers, integer and
 * bool tensors, the last matching rule, and restores of every earlier step.
 */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>

#include "trajectory.h"

/* The sanitizer builds run the same properties on fewer seeds and steps. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define HEAVY 0
#else
#define HEAVY 1
#endif
#define SEEDS (HEAVY ? 8 : 2)
#define LONG_STEPS (HEAVY ? 120 : 100)

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
  tu_deltas_only(&wo, chunk);
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
  tu_deltas_only(&wo, 1000);
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
  TEST_RUN(test_integer_and_bool_tensors_are_exact_under_any_policy);
  TEST_RUN(test_last_matching_pattern_wins);
  TEST_RUN(test_every_earlier_step_restores_its_own_values);
  return tu_finish();
}

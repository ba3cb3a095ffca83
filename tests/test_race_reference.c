/*
 * test_race_reference.c - a save raced by a writer thread cannot poison the
 * writer's reference.
 *
 * The API forbids changing a tensor between begin and the fence; a program that
 * does anyway (a second thread, a write through an alias that no check sees) gets
 * a step that may hold a mix of old and new values. What it must never get is a
 * reference that differs from what restoring that step yields: every later delta
 * is computed against the reference, so such a difference would make later,
 * correct saves restore values that never existed. Here a thread keeps adding to
 * every element while a save scans them; the next save, with no race, must
 * restore exactly the live values, for every policy and encoding the race can
 * reach (dense exact chunks stored as XOR or RAW, sparse ones, threshold and
 * budget selections). This test races on purpose, so it is not run under TSan.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <math.h>
#include <stdlib.h>

#include "testutil.h"

#define N (1u << 20)
#define CHUNK 65536

typedef struct racer {
  float *x;
  atomic_int stop;
  atomic_long passes;
} racer;

/* Adds a small step to every element, pass after pass, until told to stop. The
 * volatile accesses keep the compiler from batching passes. */
static void *race(void *arg) {
  racer *r = arg;
  volatile float *x = r->x;
  while (!atomic_load(&r->stop)) {
    for (size_t i = 0; i < N; i++) x[i] = x[i] + 0.25f;
    atomic_fetch_add(&r->passes, 1);
  }
  return NULL;
}

/* Restores `step` and compares it with `want`; returns the number of elements
 * that differ. */
static size_t differing(amber_store *st, uint64_t step, const float *want, float *got) {
  amber_reader *rd = NULL;
  CHECK_OK(amber_reader_open(&rd, st, step, NULL));
  if (!rd) return N;
  CHECK_OK(amber_reader_read(rd, 0, got, (size_t)N * sizeof *got));
  amber_reader_close(rd);
  size_t bad = 0;
  for (size_t i = 0; i < N; i++) bad += memcmp(&got[i], &want[i], sizeof *got) != 0;
  return bad;
}

/* Saves `rounds` pairs of steps: one raced (every element changes by 1, so exact
 * chunks are dense and go XOR or RAW, and a budget sees one cluster of equal
 * changes and fills from its band), then one clean (a sparse change of a fifth of
 * the elements), then `drain` saves of unchanged values (a budget stores what is
 * still pending). The last of them must restore the live values within `bound`
 * (0: bit for bit). */
static void raced_then_clean(const char *policy, double bound, int rounds, int drain) {
  amber_store *st = NULL;
  amber_writer *w = NULL;
  CHECK_OK(amber_store_open(&st, tu_tmpdir(), NULL));
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.chunk_elems = CHUNK;
  wo.full_every = 1000;
  wo.full_share = 1000.0; /* deltas only: the chain carries the reference */
  CHECK_OK(amber_writer_open(&w, st, &wo));
  float *x = malloc((size_t)N * sizeof *x), *want = malloc((size_t)N * sizeof *want);
  float *got = malloc((size_t)N * sizeof *got);
  tu_fill_random(x, (size_t)N * sizeof *x, 7);
  for (size_t i = 0; i < N; i++) x[i] = (float)((int32_t)((uint32_t *)x)[i] >> 8) * 0x1p-20f;
  int64_t n = N;
  CHECK_OK(amber_writer_add(w, "x", AMBER_F32, 1, &n, x, NULL));
  if (policy) CHECK_OK(amber_writer_add_policy(w, policy));
  uint64_t step = 1;
  CHECK_OK(amber_writer_save(w, step, AMBER_SAVE_FULL));
  size_t bad_steps = 0;
  long raced = 0;
  for (int k = 0; k < rounds && w; k++) {
    racer r = {.x = x};
    pthread_t th;
    step++;
    for (size_t i = 0; i < N; i++) x[i] += 1.0f;
    CHECK(pthread_create(&th, NULL, race, &r) == 0);
    while (atomic_load(&r.passes) == 0) {} /* the race is on before the save reads */
    int rc = amber_writer_save(w, step, 0); /* its content is undefined; it may commit */
    atomic_store(&r.stop, 1);
    pthread_join(th, NULL);
    raced += atomic_load(&r.passes);
    if (rc < 0) fprintf(stderr, "raced save %llu: %s\n", (unsigned long long)step,
                        amber_last_error(NULL));
    step++;
    for (size_t i = (size_t)k % 5; i < N; i += 5) x[i] += 0.5f;
    memcpy(want, x, (size_t)N * sizeof *x);
    CHECK_OK(amber_writer_save(w, step, 0));
    for (int d = 0; d < drain; d++) CHECK_OK(amber_writer_save(w, ++step, 0));
    if (bound == 0) {
      size_t bad = differing(st, step, want, got);
      if (bad) fprintf(stderr, "%s: clean step %llu restores %zu elements wrong\n",
                       policy ? policy : "exact", (unsigned long long)step, bad);
      bad_steps += bad != 0;
    } else {
      differing(st, step, want, got);
      size_t over = 0;
      for (size_t i = 0; i < N; i++) over += !(fabs((double)got[i] - want[i]) <= bound);
      if (over) fprintf(stderr, "%s: clean step %llu: %zu elements beyond the bound\n",
                        policy, (unsigned long long)step, over);
      bad_steps += over != 0;
    }
  }
  CHECK(bad_steps == 0);
  CHECK(raced > 0);
  amber_writer_close(w);
  amber_store_close(st);
  free(x);
  free(want);
  free(got);
}

static void test_exact_dense_raced_save_keeps_reference_equal_to_restore(void) {
  raced_then_clean(NULL, 0, 8, 0);
}

static void test_threshold_raced_save_keeps_the_bound(void) {
  raced_then_clean("threshold:1e-3", 1e-3, 4, 0);
}

/* A budget of 5% drains every pending change in 20 saves: then the restore is the
 * live state exactly, unless the reference holds values that no step stored. */
static void test_budget_raced_save_drains_to_the_live_state(void) {
  raced_then_clean("budget:0.05:8", 0, 3, 24);
}

int main(void) {
  TEST_RUN(test_exact_dense_raced_save_keeps_reference_equal_to_restore);
  TEST_RUN(test_threshold_raced_save_keeps_the_bound);
  TEST_RUN(test_budget_raced_save_drains_to_the_live_state);
  return tu_finish();
}

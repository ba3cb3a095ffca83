/*
 * test_maint.c - compact and prune: every kept step restores bit-identically
 * afterwards, compaction keeps later deltas and LATEST valid, prune never removes
 * a file that a kept step needs, and both refuse what they must.
 */
#include <pthread.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "testutil.h"

#define STEPS 12
#define N 5000

static float states[STEPS + 3][N]; /* live state at each step (exact policy) */

/* Builds a chain: full at step 1, deltas after, with full_every = 5. */
static void build(const char *dir) {
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, dir, NULL));
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.chunk_elems = 512;
  wo.full_every = 5;
  wo.full_share = -1;
  amber_writer *w = NULL;
  CHECK_OK(amber_writer_open(&w, st, &wo));
  float live[N];
  int64_t n = N;
  uint64_t seed = 42;
  for (int i = 0; i < N; i++) live[i] = (float)(tu_rand(&seed) % 1000) / 7.0f;
  CHECK_OK(amber_writer_add(w, "x", AMBER_F32, 1, &n, live, NULL));
  for (int s = 1; s <= STEPS; s++) {
    for (int k = 0; k < 50; k++) live[tu_rand(&seed) % N] += 1.0f;
    memcpy(states[s], live, sizeof live);
    CHECK_OK(amber_writer_save(w, (uint64_t)s, 0));
  }
  amber_writer_close(w);
  amber_store_close(st);
}

static void check_step(amber_store *st, uint64_t s) {
  amber_reader *r = NULL;
  CHECK_OK(amber_reader_open(&r, st, s, NULL));
  if (!r) return;
  static float got[N];
  CHECK_OK(amber_reader_read(r, 0, got, sizeof got));
  CHECK(memcmp(got, states[s], sizeof got) == 0);
  CHECK_OK(amber_reader_verify(r));
  amber_reader_close(r);
}

static uint32_t kind_of(amber_store *st, uint64_t step) {
  amber_ckpt_info *info = NULL;
  size_t n = 0;
  uint32_t kind = 99;
  CHECK_OK(amber_store_list(st, &info, &n));
  for (size_t i = 0; i < n; i++)
    if (info[i].step == step) kind = info[i].kind;
  amber_free(info);
  return kind;
}

static void test_compact_keeps_every_step_identical(void) {
  const char *dir = tu_tmpdir();
  build(dir);
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, dir, NULL));
  CHECK(kind_of(st, 8) == AMBER_KIND_DELTA);
  CHECK_OK(amber_store_compact(st, 8));
  CHECK(kind_of(st, 8) == AMBER_KIND_FULL);
  for (uint64_t s = 1; s <= STEPS; s++) check_step(st, s); /* 9..12 chain through 8 */
  CHECK_OK(amber_store_compact(st, STEPS));                /* the latest: LATEST stays valid */
  CHECK(kind_of(st, STEPS) == AMBER_KIND_FULL);
  check_step(st, STEPS);
  CHECK_OK(amber_store_compact(st, 1)); /* already full: no-op */
  CHECK_RC(amber_store_compact(st, 99), AMBER_ENOENT);
  amber_store_close(st);
}

static void test_writer_continues_after_compaction(void) {
  const char *dir = tu_tmpdir();
  build(dir);
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, dir, NULL));
  CHECK_OK(amber_store_compact(st, STEPS));
  amber_writer *w = NULL;
  CHECK_OK(amber_writer_open(&w, st, NULL));
  int64_t n = N;
  static float live[N];
  memcpy(live, states[STEPS], sizeof live);
  live[7] = -1;
  CHECK_OK(amber_writer_add(w, "x", AMBER_F32, 1, &n, live, NULL));
  CHECK_OK(amber_writer_save(w, STEPS + 1, 0)); /* a delta against the compacted full */
  amber_writer_close(w);
  CHECK(kind_of(st, STEPS + 1) == AMBER_KIND_DELTA);
  amber_reader *r = NULL;
  CHECK_OK(amber_reader_open(&r, st, STEPS + 1, NULL));
  static float got[N];
  if (r) CHECK_OK(amber_reader_read(r, 0, got, sizeof got));
  CHECK(memcmp(got, live, sizeof got) == 0);
  amber_reader_close(r);
  amber_store_close(st);
}

static void test_prune_keeps_what_kept_steps_need(void) {
  const char *dir = tu_tmpdir();
  build(dir); /* fulls at 1, 7 (after 5 deltas: 2..6), 13 would be next */
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, dir, NULL));
  size_t removed = 0;
  CHECK_OK(amber_store_prune(st, 3, &removed)); /* keep 10, 11, 12: need 7, 8, 9 too */
  amber_ckpt_info *info = NULL;
  size_t n = 0;
  CHECK_OK(amber_store_list(st, &info, &n));
  CHECK(n == 6 && removed == 6);
  for (size_t i = 0; i < n && n == 6; i++) CHECK(info[i].step == 7 + i);
  amber_free(info);
  for (uint64_t s = 7; s <= STEPS; s++) check_step(st, s);
  amber_reader *r = NULL;
  CHECK_RC(amber_reader_open(&r, st, 3, NULL), AMBER_ENOENT);
  CHECK_RC(amber_store_prune(st, 0, NULL), AMBER_EINVAL);
  CHECK_OK(amber_store_prune(st, 1, &removed)); /* keep 12: chain 7..12 stays */
  CHECK(removed == 0);
  amber_store_close(st);
}

static void test_maintenance_needs_a_writable_store(void) {
  const char *dir = tu_tmpdir();
  build(dir);
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY;
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, dir, &so));
  CHECK_RC(amber_store_compact(st, 8), AMBER_EREADONLY);
  CHECK_RC(amber_store_prune(st, 1, NULL), AMBER_EREADONLY);
  amber_store_close(st);
}

static void test_compact_refuses_a_damaged_chain(void) {
  const char *dir = tu_tmpdir();
  build(dir);
  char path[4200];
  snprintf(path, sizeof path, "%s/ckpt-%020d.amber", dir, 3);
  CHECK(tu_flip_byte(path, 100, 0x40) == 0); /* inside the first chunk payload */
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, dir, NULL));
  CHECK_RC(amber_store_compact(st, 5), AMBER_ECORRUPT);
  CHECK(kind_of(st, 5) == AMBER_KIND_DELTA); /* untouched */
  amber_store_close(st);
}

static size_t list_steps(amber_store *st, uint64_t *steps, size_t cap) {
  amber_ckpt_info *info = NULL;
  size_t n = 0;
  CHECK_OK(amber_store_list(st, &info, &n));
  for (size_t i = 0; i < n && i < cap; i++) steps[i] = info[i].step;
  amber_free(info);
  return n;
}

/* keep_last: after each save the store holds the newest K steps and the chain
 * back to their full checkpoint, nothing else; every kept step restores exactly
 * and the writer keeps saving deltas. */
static void test_writer_keep_last_prunes_after_every_save(void) {
  const char *dir = tu_tmpdir();
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, dir, NULL));
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.chunk_elems = 512;
  wo.full_every = 5; /* fulls at 1, 7, 13, ... */
  wo.full_share = -1;
  wo.keep_last = 3;
  amber_writer *w = NULL;
  CHECK_OK(amber_writer_open(&w, st, &wo));
  if (!w) return;
  static float live[N];
  int64_t n = N;
  uint64_t seed = 7;
  for (int i = 0; i < N; i++) live[i] = (float)(tu_rand(&seed) % 1000) / 7.0f;
  CHECK_OK(amber_writer_add(w, "x", AMBER_F32, 1, &n, live, NULL));
  size_t total_removed = 0;
  for (uint64_t s = 1; s <= STEPS; s++) {
    for (int k = 0; k < 50; k++) live[tu_rand(&seed) % N] += 1.0f;
    memcpy(states[s], live, sizeof live);
    CHECK_OK(amber_writer_save(w, s, 0));
    size_t removed = 99;
    const char *msg = "unset";
    CHECK_OK(amber_writer_prune_status(w, &removed, &msg));
    CHECK(msg == NULL);
    total_removed += removed;
    /* expected: from the last full at or before step s-2 (the oldest kept) to s */
    uint64_t oldest = s > 3 ? s - 2 : 1, full = 1;
    for (uint64_t f = 1; f <= oldest; f += 6) full = f;
    uint64_t got[STEPS + 1];
    size_t cnt = list_steps(st, got, STEPS + 1);
    CHECK(cnt == s - full + 1);
    for (size_t i = 0; i < cnt && cnt == s - full + 1; i++) CHECK(got[i] == full + i);
    CHECK(kind_of(st, s) == ((s - 1) % 6 == 0 ? AMBER_KIND_FULL : AMBER_KIND_DELTA));
  }
  CHECK(total_removed == 6); /* 1..6 at step 9; 7..12 stay: 13 is not reached */
  amber_writer_close(w);
  for (uint64_t s = 7; s <= STEPS; s++) check_step(st, s);
  amber_store_close(st);
}

/* A checkpoint file that cannot be removed does not fail the save: the save
 * commits, the others are removed, the failure is reported by
 * amber_writer_prune_status with the file's name, and the next save tries again. */
static void test_failed_prune_does_not_fail_the_save(void) {
  const char *dir = tu_tmpdir();
  build(dir); /* fulls at 1 and 7, deltas to 12 */
  char one[4200], inner[4300];
  snprintf(one, sizeof one, "%s/ckpt-%020d.amber", dir, 1);
  snprintf(inner, sizeof inner, "%s/keep", one);
  CHECK(unlink(one) == 0 && mkdir(one, 0755) == 0); /* unlink() of it fails: EISDIR */
  tu_write_file(inner, (const uint8_t *)"x", 1);
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, dir, NULL));
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.chunk_elems = 512;
  wo.keep_last = 2;
  amber_writer *w = NULL;
  CHECK_OK(amber_writer_open(&w, st, &wo));
  if (!w) return;
  static float live[N];
  memcpy(live, states[STEPS], sizeof live);
  int64_t n = N;
  CHECK_OK(amber_writer_add(w, "x", AMBER_F32, 1, &n, live, NULL));
  live[3] += 2.0f;
  memcpy(states[STEPS + 1], live, sizeof live);
  CHECK_OK(amber_writer_save(w, STEPS + 1, 0));
  size_t removed = 0;
  const char *msg = NULL;
  CHECK(amber_writer_prune_status(w, &removed, &msg) != 0);
  CHECK(msg && strstr(msg, "ckpt-00000000000000000001.amber"));
  CHECK(removed == 5); /* 2..6 */
  uint64_t got[STEPS + 2];
  CHECK(list_steps(st, got, STEPS + 2) == 8); /* the unreadable 1, then 7..13 */
  CHECK(got[0] == 1 && got[1] == 7 && got[7] == STEPS + 1);
  CHECK(kind_of(st, STEPS + 1) == AMBER_KIND_DELTA);
  /* the obstacle goes: the next save's prune succeeds */
  CHECK(unlink(inner) == 0 && rmdir(one) == 0);
  CHECK_OK(amber_writer_save(w, STEPS + 2, 0));
  CHECK_OK(amber_writer_prune_status(w, &removed, &msg));
  CHECK(msg == NULL && removed == 0);
  amber_writer_close(w);
  check_step(st, STEPS + 1);
  amber_store_close(st);
}

/* Readers are separate handles: opened from two threads on one store handle,
 * each reports its own failure (under TSan: no shared message buffer is written). */
static void *open_empty_readers(void *arg) {
  amber_store *st = arg;
  for (int i = 0; i < 200; i++) {
    amber_reader *r = NULL;
    int rc = amber_reader_open(&r, st, AMBER_LATEST, NULL);
    if (rc != AMBER_ENOENT || r != NULL || !strstr(amber_last_error(NULL), "no committed")) {
      fprintf(stderr, "    reader of an empty store: rc %d, \"%s\"\n", rc, amber_last_error(NULL));
      return (void *)1;
    }
  }
  return NULL;
}

static void test_readers_opened_in_parallel_report_their_own_failures(void) {
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, tu_tmpdir(), NULL));
  pthread_t t[2];
  for (int i = 0; i < 2; i++) CHECK(pthread_create(&t[i], NULL, open_empty_readers, st) == 0);
  for (int i = 0; i < 2; i++) {
    void *bad = NULL;
    pthread_join(t[i], &bad);
    CHECK(bad == NULL);
  }
  amber_store_close(st);
}

int main(void) {
  TEST_RUN(test_compact_keeps_every_step_identical);
  TEST_RUN(test_writer_continues_after_compaction);
  TEST_RUN(test_prune_keeps_what_kept_steps_need);
  TEST_RUN(test_writer_keep_last_prunes_after_every_save);
  TEST_RUN(test_failed_prune_does_not_fail_the_save);
  TEST_RUN(test_readers_opened_in_parallel_report_their_own_failures);
  TEST_RUN(test_maintenance_needs_a_writable_store);
  TEST_RUN(test_compact_refuses_a_damaged_chain);
  return tu_finish();
}

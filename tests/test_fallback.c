/*
 * test_fallback.c - restore robustness: with AMBER_READER_FALLBACK a damaged newest
 * checkpoint is passed over for the newest intact one, and the reader says so;
 * without it (strict) the damage is an error.
 */
#include <stdlib.h>

#include "testutil.h"

#define N 4096

static float states[6][N];

static void build(const char *dir) {
  amber_store *st = NULL;
  amber_writer *w = NULL;
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.chunk_elems = 1024;
  wo.full_every = 2; /* 1 full, 2 3 deltas, 4 full, 5 delta */
  CHECK_OK(amber_store_open(&st, dir, NULL));
  CHECK_OK(amber_writer_open(&w, st, &wo));
  float x[N];
  int64_t n = N;
  for (int i = 0; i < N; i++) x[i] = (float)i;
  CHECK_OK(amber_writer_add(w, "x", AMBER_F32, 1, &n, x, NULL));
  for (int s = 1; s <= 5; s++) {
    for (int i = s; i < N; i += 50) x[i] += 1;
    memcpy(states[s], x, sizeof x);
    CHECK_OK(amber_writer_save(w, (uint64_t)s, 0));
  }
  amber_writer_close(w);
  amber_store_close(st);
}

static void damage(const char *dir, int step) {
  char path[4200];
  snprintf(path, sizeof path, "%s/ckpt-%020d.amber", dir, step);
  CHECK(tu_flip_byte(path, 70, 0x10) == 0); /* the first chunk's payload */
}

static void expect(amber_store *st, uint32_t flags, uint64_t want_step, size_t want_skipped) {
  amber_reader_opts ro;
  amber_reader_opts_init(&ro);
  ro.flags = flags;
  amber_reader *r = NULL;
  CHECK_OK(amber_reader_open(&r, st, AMBER_LATEST, &ro));
  if (!r) return;
  CHECK(amber_reader_step(r) == want_step);
  CHECK(amber_reader_skipped(r) == want_skipped);
  if (want_skipped) CHECK(strstr(amber_last_error(r), "damaged") != NULL);
  float got[N];
  CHECK_OK(amber_reader_read(r, 0, got, sizeof got));
  CHECK(memcmp(got, states[want_step], sizeof got) == 0);
  amber_reader_close(r);
}

static void test_damaged_latest_falls_back_to_newest_intact(void) {
  const char *dir = tu_tmpdir();
  build(dir);
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, dir, NULL));
  expect(st, AMBER_READER_FALLBACK, 5, 0); /* intact: no fallback */
  damage(dir, 4);                          /* 5 is a delta on 4: both are lost */
  expect(st, AMBER_READER_FALLBACK, 3, 2);
  /* strict: opening works (headers are fine), the read fails */
  amber_reader *r = NULL;
  CHECK_OK(amber_reader_open(&r, st, AMBER_LATEST, NULL));
  float got[N];
  if (r) CHECK_RC(amber_reader_read(r, 0, got, sizeof got), AMBER_ECORRUPT);
  amber_reader_close(r);
  amber_store_close(st);
}

static void test_no_intact_step_is_an_error(void) {
  const char *dir = tu_tmpdir();
  build(dir);
  damage(dir, 1);
  damage(dir, 4);
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, dir, NULL));
  amber_reader_opts ro;
  amber_reader_opts_init(&ro);
  ro.flags = AMBER_READER_FALLBACK;
  amber_reader *r = NULL;
  CHECK_RC(amber_reader_open(&r, st, AMBER_LATEST, &ro), AMBER_ECORRUPT);
  CHECK(strstr(amber_last_error(NULL), "no intact checkpoint") != NULL);
  ro.flags = 0x80;
  CHECK_RC(amber_reader_open(&r, st, AMBER_LATEST, &ro), AMBER_EINVAL);
  amber_store_close(st);
}

int main(void) {
  TEST_RUN(test_damaged_latest_falls_back_to_newest_intact);
  TEST_RUN(test_no_intact_step_is_an_error);
  return tu_finish();
}

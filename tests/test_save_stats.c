/*
 * test_save_stats.c - amber_writer_save_stats, the public figures of the last save
 * (what `amber bench` prints): zero before the first save; then the kind and the
 * file size that the store lists, and times that add up (each part within the
 * total); NULL arguments refused.
 */
#include <stdlib.h>

#include "testutil.h"

#define N 300000

static uint64_t listed_bytes(amber_store *st, uint64_t step) {
  amber_ckpt_info *ck = NULL;
  size_t n = 0;
  uint64_t bytes = 0;
  CHECK_OK(amber_store_list(st, &ck, &n));
  for (size_t i = 0; i < n; i++)
    if (ck[i].step == step) bytes = ck[i].bytes;
  amber_free(ck);
  return bytes;
}

static void check_times(const amber_save_stats *s) {
  CHECK(s->total_s > 0);
  CHECK(s->workers >= 1);
  const double parts[] = {s->prepare_s, s->chunks_s, s->finish_s, s->commit_s};
  for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++)
    CHECK(parts[i] >= 0 && parts[i] <= s->total_s);
  CHECK(s->scan_cpu_s >= 0 && s->encode_cpu_s >= 0);
  for (int i = 0; i < 4; i++) CHECK(s->reserved[i] == 0);
}

static void test_stats_describe_the_last_save(void) {
  const char *d = tu_tmpdir();
  float *x = malloc(N * sizeof *x);
  tu_fill_random(x, N * sizeof *x, 5);
  amber_store *st = NULL;
  amber_writer *w = NULL;
  CHECK_OK(amber_store_open(&st, d, NULL));
  CHECK_OK(amber_writer_open(&w, st, NULL));
  int64_t n = N;
  CHECK_OK(amber_writer_add(w, "x", AMBER_F32, 1, &n, x, NULL));
  amber_save_stats s, zero;
  memset(&zero, 0, sizeof zero);
  memset(&s, 0xff, sizeof s);
  CHECK_OK(amber_writer_save_stats(w, &s));
  CHECK(memcmp(&s, &zero, sizeof s) == 0);

  CHECK_OK(amber_writer_save(w, 1, 0));
  CHECK_OK(amber_writer_save_stats(w, &s));
  CHECK(s.kind == AMBER_KIND_FULL);
  CHECK(s.bytes == listed_bytes(st, 1) && s.bytes > N * sizeof *x);
  check_times(&s);

  for (int i = 0; i < N; i += 100) x[i] += 1.0f;
  CHECK_OK(amber_writer_begin(w, 2, 0));
  CHECK_OK(amber_writer_wait(w));
  CHECK_OK(amber_writer_save_stats(w, &s));
  CHECK(s.kind == AMBER_KIND_DELTA);
  CHECK(s.bytes == listed_bytes(st, 2) && s.bytes < N * sizeof *x / 4);
  check_times(&s);

  CHECK_RC(amber_writer_save_stats(NULL, &s), AMBER_EINVAL);
  CHECK_RC(amber_writer_save_stats(w, NULL), AMBER_EINVAL);
  amber_writer_close(w);
  amber_store_close(st);
  free(x);
}

int main(void) {
  TEST_RUN(test_stats_describe_the_last_save);
  return tu_finish();
}

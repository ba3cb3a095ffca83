/*
 * test_stress.c - a state shaped like a large model's: 10,000 small tensors and a
 * few large ones, saved with the split save (a full, then deltas under mixed
 * policies) and restored exactly by name, in reasonable time.
 */
#include <math.h>
#include <stdlib.h>
#include <time.h>

#include "testutil.h"

#define NSMALL 10000
#define NLARGE 3
#define LARGE (1 << 20)

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void test_ten_thousand_small_and_a_few_large_tensors(void) {
  const char *dir = tu_tmpdir();
  uint64_t seed = 99;
  int64_t sizes[NSMALL + NLARGE];
  float *data[NSMALL + NLARGE];
  char name[64];
  for (int i = 0; i < NSMALL + NLARGE; i++) {
    sizes[i] = i < NSMALL ? 1 + (int64_t)(tu_rand(&seed) % 300) : LARGE + i;
    data[i] = malloc((size_t)sizes[i] * sizeof(float));
    tu_fill_random(data[i], (size_t)sizes[i] * sizeof(float), (uint64_t)i);
    for (int64_t j = 0; j < sizes[i]; j++) data[i][j] = (float)(data[i][j] > 0 ? 1e-3 : -1e-3);
  }
  amber_store *st = NULL;
  amber_writer *w = NULL;
  CHECK_OK(amber_store_open(&st, dir, NULL));
  CHECK_OK(amber_writer_open(&w, st, NULL));
  double t0 = now();
  for (int i = 0; i < NSMALL + NLARGE; i++) {
    snprintf(name, sizeof name, "layer.%d.%s", i, i % 4 ? "weight" : "exp_avg_sq");
    CHECK_OK(amber_writer_add(w, name, AMBER_F32, 1, &sizes[i], data[i], NULL));
  }
  double t_declare = now() - t0;
  CHECK_OK(amber_writer_add_policy(w, "*.exp_avg_sq=threshold:0:1e-2"));
  for (int step = 1; step <= 4; step++) {
    for (int i = step; i < NSMALL + NLARGE; i += 7) data[i][0] += 1.0f; /* exact: stored */
    CHECK_OK(amber_writer_begin(w, (uint64_t)step, 0));
    CHECK_OK(amber_writer_fence(w));
    CHECK_OK(amber_writer_wait(w));
  }
  amber_writer_close(w);
  t0 = now();
  amber_reader *r = NULL;
  CHECK_OK(amber_reader_open(&r, st, AMBER_LATEST, NULL));
  if (r) CHECK(amber_reader_count(r) == NSMALL + NLARGE);
  float *buf = malloc((LARGE + NSMALL + NLARGE) * sizeof *buf);
  int bad = 0;
  for (int i = 0; r && i < NSMALL + NLARGE; i++) {
    size_t k = 0;
    snprintf(name, sizeof name, "layer.%d.%s", i, i % 4 ? "weight" : "exp_avg_sq");
    CHECK_OK(amber_reader_find(r, name, &k));
    CHECK_OK(amber_reader_read(r, k, buf, (uint64_t)sizes[i] * sizeof(float)));
    if (i % 4) { /* weights: exact */
      bad += memcmp(buf, data[i], (size_t)sizes[i] * sizeof(float)) != 0;
    } else {
      for (int64_t j = 0; j < sizes[i]; j++)
        bad += !(fabsf(buf[j] - data[i][j]) <= 1e-2f * fabsf(buf[j]) * 1.0001f);
    }
  }
  CHECK(bad == 0);
  double t_restore = now() - t0;
  amber_reader_close(r);
  amber_store_close(st);
  printf("declare %.3f s, restore by name %.3f s\n", t_declare, t_restore);
  CHECK(t_declare < 5 && t_restore < 60); /* quadratic name handling would show here */
  for (int i = 0; i < NSMALL + NLARGE; i++) free(data[i]);
  free(buf);
}

int main(void) {
  TEST_RUN(test_ten_thousand_small_and_a_few_large_tensors);
  return tu_finish();
}

/*
 * test_tier_image.c - the image a memory tier's drain keeps of its newest step
 * (AMBER_DRAIN_IMAGE, src/image.c): it follows each commit and a restore of the
 * newest step reads it alone, bit-identical to the step's files (its tensors and its
 * own metadata), exact and quantized deltas alike; a torn image (a crash in the
 * middle of an update) is never read and is rebuilt after the next commit; a damaged
 * one costs a fallback load nothing; a reader that holds it delays its update and
 * reads what it opened; a budget without room for it means no image, and no error;
 * `amber verify`'s reads never take it.
 */
#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "testutil.h"
#include "tier_job.h"

static void paths(char *mem, char *dur, size_t len) {
  const char *t = tu_tmpdir();
  snprintf(mem, len, "%s/mem", t);
  snprintf(dur, len, "%s/durable", t);
}

static amber_drain *start(const char *mem, const char *dur, uint64_t budget) {
  amber_drain_opts o;
  amber_drain_opts_init(&o);
  o.flags = AMBER_DRAIN_IMAGE;
  o.memory_budget = budget;
  amber_drain *d = NULL;
  CHECK_OK(amber_drain_start(&d, mem, dur, &o));
  return d;
}

/* Waits (at most 20 s) until the drain's image holds `step`; returns its step. */
static uint64_t wait_image(amber_drain *d, uint64_t step) {
  amber_drain_status ds = {0};
  for (int i = 0; i < 2000; i++) {
    CHECK_OK(amber_drain_get_status(d, &ds));
    if (ds.image_step == step) break;
    usleep(10000);
  }
  return ds.image_step;
}

static void image_path(const char *mem, char *p, size_t len) {
  snprintf(p, len, "%s/image.amber", mem);
}

static void full_path(const char *mem, uint64_t step, char *p, size_t len) {
  snprintf(p, len, "%s/ckpt-%020llu.amber", mem, (unsigned long long)step);
}

/* Restores tensor 0 of `step` of `dir` into out (N floats): with `files`, from the
 * step's own files only. Returns the reader's error code. */
static int restore(const char *dir, uint64_t step, int files, float *out) {
  amber_store *st = tu_open_ro(dir);
  amber_reader_opts ro;
  amber_reader_opts_init(&ro);
  ro.flags = files ? AMBER_READER_FILES : 0;
  amber_reader *r = NULL;
  int rc = amber_reader_open(&r, st, step, &ro);
  if (!rc) rc = amber_reader_read(r, 0, out, N * sizeof(float));
  amber_reader_close(r);
  amber_store_close(st);
  return rc;
}

/* The metadata a save of step s carries: its step, and padding that grows with it (so
 * that an image's index changes size as it moves). */
static void meta_for(uint64_t s, char *buf, size_t len) {
  int n = snprintf(buf, len, "{\"step\": %llu, \"pad\": \"", (unsigned long long)s);
  for (uint64_t k = 0; k < 37 * s && (size_t)n + 3 < len; k++) buf[n++] = (char)('a' + k % 26);
  snprintf(buf + n, len - (size_t)n, "\"}");
}

/* 1 when step `step` of `dir`, read (not from its files only: so from the image when
 * it holds the step), carries the metadata its save set. */
static int meta_is_saved(const char *dir, uint64_t step) {
  amber_store *st = tu_open_ro(dir);
  amber_reader *r = NULL;
  const char *json = NULL;
  size_t len = 0;
  char want[2048];
  meta_for(step, want, sizeof want);
  int ok = amber_reader_open(&r, st, step, NULL) == 0 && amber_reader_meta(r, &json, &len) == 0 &&
           len == strlen(want) && json && memcmp(json, want, len) == 0;
  amber_reader_close(r);
  amber_store_close(st);
  return ok;
}

/* 1 when a restore of `step` of `mem` is served by the image alone: it succeeds
 * with the chain's full checkpoint moved away, while the files alone cannot. */
static int served_by_image(const char *mem, uint64_t full, uint64_t step) {
  char p[4400], q[4500];
  full_path(mem, full, p, sizeof p);
  snprintf(q, sizeof q, "%s.away", p);
  CHECK(rename(p, q) == 0);
  static float got[N];
  int by_image = restore(mem, step, 0, got) == 0;
  int by_files = restore(mem, step, 1, got) == 0;
  CHECK(rename(q, p) == 0);
  return by_image && !by_files;
}

/* Commits step s of job `j` under drain `d` and checks that the image takes it on and
 * serves it alone (the chain's full checkpoint `full` moved away), bit for bit. */
static void commit_served_by_image(job *j, amber_drain *d, const char *mem, uint64_t full,
                                   uint64_t s) {
  static float got[N];
  job_save(j, s, 0);
  CHECK_OK(amber_drain_kick(d));
  CHECK(wait_image(d, s) == s);
  CHECK(served_by_image(mem, full, s));
  CHECK_OK(restore(mem, s, 0, got));
  CHECK(memcmp(got, states[s], sizeof got) == 0);
}

static void test_the_image_follows_each_commit_and_restores_identically(void) {
  char mem[2048], dur[2048];
  paths(mem, dur, sizeof mem);
  job j;
  job_open(&j, mem, 5); /* 1 full, 2..6 deltas, 7 full, 8..12, 13 full, 14, 15 */
  amber_drain *d = start(mem, dur, 0);
  static float got[N];
  char meta[2048];
  for (uint64_t s = 1; s <= 12; s++) {
    meta_for(s, meta, sizeof meta);
    CHECK_OK(amber_writer_set_meta(j.w, meta, strlen(meta)));
    job_save(&j, s, 0);
    CHECK_OK(amber_drain_kick(d));
    CHECK(wait_image(d, s) == s);
    CHECK_OK(restore(mem, s, 0, got));
    CHECK(memcmp(got, states[s], sizeof got) == 0);
    CHECK(meta_is_saved(mem, s)); /* the step's own metadata, not the image's first */
    if (s == 4) CHECK(served_by_image(mem, 1, 4));
  }
  CHECK(served_by_image(mem, 7, 12));
  CHECK(meta_is_saved(mem, 12));
  /* every step the memory tier lists restores from its files too */
  check_step(mem, 12);
  /* the image is no checkpoint: not listed, never drained */
  uint64_t steps[MAXSTEP];
  size_t n = steps_of(mem, steps);
  CHECK(n >= 1 && steps[n - 1] == 12);
  CHECK_OK(amber_drain_flush(d, 30));
  char p[4400];
  image_path(dur, p, sizeof p);
  CHECK(access(p, F_OK) != 0);
  /* 13 is full (the image is built anew from it), 14 a delta; a clean close leaves
   * the image at the newest step, and a new drain takes it up */
  for (uint64_t s = 13; s <= 14; s++) {
    job_save(&j, s, 0);
    CHECK_OK(amber_drain_kick(d));
  }
  CHECK_OK(amber_drain_close(d));
  CHECK(served_by_image(mem, 13, 14));
  d = start(mem, dur, 0);
  commit_served_by_image(&j, d, mem, 13, 15);
  CHECK_OK(amber_drain_close(d));
  job_close(&j);
}

/* Quantized deltas (each restore moves the reference by codes times steps, not by
 * the saved values): the image holds what the files restore, bit for bit. */
static void test_the_image_of_quantized_deltas_is_what_the_files_restore(void) {
  char mem[2048], dur[2048];
  paths(mem, dur, sizeof mem);
  job j;
  job_open(&j, mem, 100);
  CHECK_OK(amber_writer_add_policy(j.w, "threshold:0.25@q8+lead"));
  amber_drain *d = start(mem, dur, 0);
  static float a[N], b[N];
  for (uint64_t s = 1; s <= 10; s++) {
    for (int k = 0; k < N; k += 3) j.live[k] += 0.01f * (float)(k % 17); /* many small */
    job_save(&j, s, 0);
    CHECK_OK(amber_drain_kick(d));
    CHECK(wait_image(d, s) == s);
    CHECK_OK(restore(mem, s, 0, a));
    CHECK_OK(restore(mem, s, 1, b));
    CHECK(memcmp(a, b, sizeof a) == 0);
  }
  CHECK(served_by_image(mem, 1, 10));
  CHECK_OK(amber_drain_close(d));
  job_close(&j);
}

/* Saves steps 1..n of job `j` (in `mem`) with a drain that keeps an image, until the
 * image holds n, then closes the drain. */
static void saved_with_image(job *j, const char *mem, const char *dur, uint64_t n) {
  amber_drain *d = start(mem, dur, 0);
  for (uint64_t s = 1; s <= n; s++) {
    job_save(j, s, 0);
    CHECK_OK(amber_drain_kick(d));
  }
  CHECK(wait_image(d, n) == n);
  CHECK_OK(amber_drain_close(d));
}

/* What a crash in the middle of an update leaves: the header's checksum zero. */
static void test_a_torn_image_is_never_read_and_is_rebuilt(void) {
  char mem[2048], dur[2048], p[4400];
  paths(mem, dur, sizeof mem);
  job j;
  job_open(&j, mem, 100);
  saved_with_image(&j, mem, dur, 4);
  image_path(mem, p, sizeof p);
  size_t len = 0;
  uint8_t *img = tu_read_file(p, &len);
  CHECK(img && len > 64);
  /* half of an update: some payload changed, the header invalid */
  for (size_t k = 64; k < 4096 && k < len; k++) img[k] ^= 0x5a;
  memset(img + 56, 0, 8);
  CHECK(tu_write_file(p, img, len) == 0);
  free(img);
  static float got[N];
  CHECK_OK(restore(mem, 4, 0, got)); /* from the files */
  CHECK(memcmp(got, states[4], sizeof got) == 0);
  CHECK(!served_by_image(mem, 1, 4));
  /* a restarted job's drain leaves it alone until the job commits (its restore runs
   * meanwhile), then builds it anew */
  amber_drain *d = start(mem, dur, 0);
  usleep(300000);
  amber_drain_status ds;
  CHECK_OK(amber_drain_get_status(d, &ds));
  CHECK(ds.image_step == AMBER_NO_STEP);
  commit_served_by_image(&j, d, mem, 1, 5);
  CHECK_OK(amber_drain_close(d));
  job_close(&j);
}

/* A damaged payload in a whole-looking image: a plain read fails on its checksum
 * (naming the image), a fallback load reads the step's files and skips nothing. */
static void test_a_damaged_image_costs_a_fallback_load_nothing(void) {
  char mem[2048], dur[2048], p[4400];
  paths(mem, dur, sizeof mem);
  job j;
  job_open(&j, mem, 100);
  saved_with_image(&j, mem, dur, 3);
  image_path(mem, p, sizeof p);
  CHECK(tu_flip_byte(p, 200, 0x10) == 0);
  static float got[N];
  CHECK_RC(restore(mem, 3, 0, got), AMBER_ECORRUPT);
  CHECK(strstr(amber_last_error(NULL), "image.amber") != NULL);
  amber_store *st = tu_open_ro(mem);
  amber_reader_opts ro;
  amber_reader_opts_init(&ro);
  ro.flags = AMBER_READER_FALLBACK;
  amber_reader *r = NULL;
  CHECK_OK(amber_reader_open(&r, st, AMBER_LATEST, &ro));
  CHECK(r && amber_reader_step(r) == 3 && amber_reader_skipped(r) == 0);
  if (r) CHECK_OK(amber_reader_read(r, 0, got, sizeof got));
  CHECK(memcmp(got, states[3], sizeof got) == 0);
  amber_reader_close(r);
  amber_store_close(st);
  /* and `amber verify` checks the files: the store is intact */
  CHECK(tu_system("%s verify %s > /dev/null 2>&1", AMBER_CLI, mem) == 0);
  job_close(&j);
}

/* A reader holds the image (a shared lock): the drain leaves it alone, the reader
 * reads the step it opened; once the reader closes the image moves on. */
static void test_a_reader_holding_the_image_delays_its_update(void) {
  char mem[2048], dur[2048];
  paths(mem, dur, sizeof mem);
  job j;
  job_open(&j, mem, 100);
  amber_drain *d = start(mem, dur, 0);
  job_save(&j, 1, 0);
  job_save(&j, 2, 0);
  CHECK_OK(amber_drain_kick(d));
  CHECK(wait_image(d, 2) == 2);
  amber_store *st = tu_open_ro(mem);
  amber_reader *r = NULL;
  CHECK_OK(amber_reader_open(&r, st, 2, NULL));
  job_save(&j, 3, 0);
  CHECK_OK(amber_drain_kick(d));
  CHECK_OK(amber_drain_flush(d, 30));
  usleep(300000);
  amber_drain_status ds;
  CHECK_OK(amber_drain_get_status(d, &ds));
  CHECK(ds.image_step == 2 && ds.durable_step == 3);
  static float got[N];
  CHECK_OK(amber_reader_read(r, 0, got, sizeof got));
  CHECK(memcmp(got, states[2], sizeof got) == 0);
  amber_reader_close(r);
  amber_store_close(st);
  CHECK(wait_image(d, 3) == 3);
  CHECK_OK(restore(mem, 3, 0, got));
  CHECK(memcmp(got, states[3], sizeof got) == 0);
  CHECK_OK(amber_drain_close(d));
  job_close(&j);
}

/* A budget with no room for an image beside the files: none, no error. */
static void test_a_budget_without_room_means_no_image_and_no_error(void) {
  char mem[2048], dur[2048], p[4400];
  paths(mem, dur, sizeof mem);
  job j;
  job_open(&j, mem, 100);
  job_save(&j, 1, 0);
  amber_ckpt_info *info = NULL;
  size_t n = 0;
  CHECK_OK(amber_store_list(j.st, &info, &n));
  uint64_t full = n ? info[0].bytes : 0;
  amber_free(info);
  amber_drain *d = start(mem, dur, full + full / 2); /* room for the chain, not an image */
  for (uint64_t s = 2; s <= 4; s++) {
    job_save(&j, s, 0);
    CHECK_OK(amber_drain_kick(d));
  }
  CHECK_OK(amber_drain_flush(d, 30));
  usleep(300000);
  amber_drain_status ds;
  CHECK_OK(amber_drain_get_status(d, &ds));
  CHECK(ds.image_step == AMBER_NO_STEP && ds.error == 0);
  image_path(mem, p, sizeof p);
  CHECK(access(p, F_OK) != 0);
  CHECK_OK(amber_drain_close(d));
  check_step(mem, 4);
  job_close(&j);
}

int main(void) {
  tu_run("the image follows each commit and restores identically",
         test_the_image_follows_each_commit_and_restores_identically);
  tu_run("the image of quantized deltas is what the files restore",
         test_the_image_of_quantized_deltas_is_what_the_files_restore);
  tu_run("a torn image is never read and is rebuilt",
         test_a_torn_image_is_never_read_and_is_rebuilt);
  tu_run("a damaged image costs a fallback load nothing",
         test_a_damaged_image_costs_a_fallback_load_nothing);
  tu_run("a reader holding the image delays its update",
         test_a_reader_holding_the_image_delays_its_update);
  tu_run("a budget without room means no image and no error",
         test_a_budget_without_room_means_no_image_and_no_error);
  return tu_finish();
}

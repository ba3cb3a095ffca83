/*
 * test_async.c - the split save (begin / fence / wait) and failed saves.
 *
 * A save begun at step N stores the tensors as they were at begin, even when the
 * caller changes them right after the fence; a save in progress refuses another
 * begin and changes to what it reads; a failed save (injected write errors, and
 * a real ENOSPC on a tiny tmpfs) is reported by wait or by the next begin, leaves
 * every committed checkpoint intact, and the next save is correct again.
 */
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"
#include "io.h"
#include "testutil.h"

#define N 300000 /* over several chunks of 65536 */

typedef struct fixture {
  amber_store *st;
  amber_writer *w;
  float *x;
  int32_t *c;
} fixture;

static void setup(fixture *f, const char *dir, const char *policy) {
  memset(f, 0, sizeof *f);
  f->x = malloc(N * sizeof *f->x);
  f->c = calloc(1000, sizeof *f->c);
  for (int i = 0; i < N; i++) f->x[i] = (float)i * 0.5f;
  CHECK_OK(amber_store_open(&f->st, dir, NULL));
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.chunk_elems = 65536;
  CHECK_OK(amber_writer_open(&f->w, f->st, &wo));
  int64_t n = N, m = 1000;
  CHECK_OK(amber_writer_add(f->w, "x", AMBER_F32, 1, &n, f->x, NULL));
  CHECK_OK(amber_writer_add(f->w, "c", AMBER_I32, 1, &m, f->c, NULL));
  if (policy) CHECK_OK(amber_writer_add_policy(f->w, policy));
}

static void teardown(fixture *f) {
  amber_writer_close(f->w);
  amber_store_close(f->st);
  free(f->x);
  free(f->c);
}

/* Restores step `step` of the fixture's store and compares with `want`. */
static void check_step(fixture *f, uint64_t step, const float *want, const int32_t *wantc) {
  amber_reader *r = NULL;
  CHECK_OK(amber_reader_open(&r, f->st, step, NULL));
  if (!r) return;
  float *got = malloc(N * sizeof *got);
  int32_t gotc[1000];
  CHECK_OK(amber_reader_read(r, 0, got, N * sizeof *got));
  CHECK_OK(amber_reader_read(r, 1, gotc, sizeof gotc));
  CHECK(memcmp(got, want, N * sizeof *got) == 0);
  CHECK(memcmp(gotc, wantc, sizeof gotc) == 0);
  free(got);
  amber_reader_close(r);
}

static void mutate(fixture *f, int step) {
  for (int i = step; i < N; i += 97) f->x[i] += 1.0f;
  f->c[step % 1000]++;
}

static void test_saved_state_is_the_state_at_begin(void) {
  fixture f;
  setup(&f, tu_tmpdir(), NULL);
  float *snap = malloc(N * sizeof *snap);
  int32_t snapc[1000];
  for (int step = 1; step <= 6; step++) { /* 1: full (two-phase), then deltas */
    mutate(&f, step);
    memcpy(snap, f.x, N * sizeof *snap);
    memcpy(snapc, f.c, sizeof snapc);
    CHECK_OK(amber_writer_begin(f.w, (uint64_t)step, 0));
    CHECK_OK(amber_writer_fence(f.w));
    CHECK_OK(amber_writer_fence(f.w)); /* idempotent */
    mutate(&f, step + 1000);          /* the next optimizer step, after the fence */
    CHECK_OK(amber_writer_wait(f.w));
    check_step(&f, (uint64_t)step, snap, snapc);
    memcpy(f.x, snap, N * sizeof *snap); /* continue from the saved state */
    memcpy(f.c, snapc, sizeof snapc);
  }
  CHECK_OK(amber_writer_wait(f.w)); /* nothing in progress: 0 */
  CHECK_OK(amber_writer_fence(f.w));
  free(snap);
  teardown(&f);
}

static void test_a_save_in_progress_refuses_changes(void) {
  fixture f;
  setup(&f, tu_tmpdir(), NULL);
  CHECK_OK(amber_writer_begin(f.w, 1, 0));
  /* The save may already be done; then these succeed, so test only when busy. */
  int rc = amber_writer_begin(f.w, 2, 0);
  CHECK(rc == AMBER_EBUSY || rc == 0);
  if (rc == AMBER_EBUSY) {
    CHECK(strstr(amber_last_error(f.w), "in progress") != NULL);
    CHECK_OK(amber_writer_wait(f.w));
    CHECK_OK(amber_writer_begin(f.w, 2, 0));
  }
  int mrc = amber_writer_set_meta(f.w, "{}", 2);
  CHECK(mrc == AMBER_EBUSY || mrc == 0);
  CHECK_OK(amber_writer_wait(f.w));
  CHECK_OK(amber_writer_set_meta(f.w, "{}", 2));
  CHECK_RC(amber_writer_begin(f.w, 2, 0), AMBER_EEXIST); /* a refused begin starts nothing */
  CHECK_OK(amber_writer_wait(f.w));
  teardown(&f);
}

static void test_close_waits_for_a_save_in_progress(void) {
  const char *dir = tu_tmpdir();
  fixture f;
  setup(&f, dir, NULL);
  CHECK_OK(amber_writer_begin(f.w, 7, 0));
  amber_writer_close(f.w);
  f.w = NULL;
  uint64_t latest = 0;
  CHECK_OK(amber_store_latest(f.st, &latest));
  CHECK(latest == 7);
  amber_store_close(f.st);
  free(f.x);
  free(f.c);
}

/* Temporary files (their names end in .tmp) in the fixture's store. */
static int tmp_files(fixture *f) {
  DIR *d = opendir(amber_store_path(f->st));
  int n = 0;
  struct dirent *e;
  while (d && (e = readdir(d))) {
    size_t len = strlen(e->d_name);
    n += len > 4 && !strcmp(e->d_name + len - 4, ".tmp");
  }
  if (d) closedir(d);
  return n;
}

/* A failed save: reported, nothing committed, store intact, next save correct. */
static void check_failure_recovery(fixture *f, int failing_step, int rc_seen) {
  CHECK(rc_seen < 0);
  uint64_t latest = 0;
  CHECK_OK(amber_store_latest(f->st, &latest));
  CHECK(latest == (uint64_t)failing_step - 1);
  amber_ckpt_info *info = NULL;
  size_t n = 0;
  CHECK_OK(amber_store_list(f->st, &info, &n));
  CHECK(n == (size_t)failing_step - 1);
  for (size_t i = 0; i < n; i++) {
    amber_reader *r = NULL;
    CHECK_OK(amber_reader_open(&r, f->st, info[i].step, NULL));
    if (r) CHECK_OK(amber_reader_verify(r));
    amber_reader_close(r);
  }
  amber_free(info);
  CHECK(tmp_files(f) == 0); /* no leftover */
}

static void test_injected_write_failure_is_reported_and_recovered(void) {
  for (int phase = 0; phase < 2; phase++) { /* fail writing the file, or writing LATEST */
    fixture f;
    setup(&f, tu_tmpdir(), "x=threshold:0.25");
    for (int step = 1; step <= 3; step++) {
      mutate(&f, step);
      CHECK_OK(amber_writer_save(f.w, (uint64_t)step, step == 1 ? AMBER_SAVE_FULL : 0));
    }
    mutate(&f, 4);
    amber__io_inject_failure(phase, phase ? ENOSPC : EIO);
    int rc = amber_writer_begin(f.w, 4, 0);
    if (rc == 0) rc = amber_writer_wait(f.w);
    amber__io_inject_failure(0, 0);
    CHECK(rc == AMBER_EIO || rc == AMBER_ENOSPC);
    CHECK(strlen(amber_last_error(NULL)) > 0);
    check_failure_recovery(&f, 4, rc);
    /* training goes on: the next save is a correct delta from the committed state */
    float *snap = malloc(N * sizeof *snap);
    memcpy(snap, f.x, N * sizeof *snap);
    CHECK_OK(amber_writer_save(f.w, 5, 0));
    amber_reader *r = NULL;
    CHECK_OK(amber_reader_open(&r, f.st, 5, NULL));
    float *got = malloc(N * sizeof *got);
    if (r) CHECK_OK(amber_reader_read(r, 0, got, N * sizeof *got));
    int within = 1;
    for (int i = 0; i < N; i++)
      if (!(fabsf(got[i] - snap[i]) <= 0.25f)) within = 0;
    CHECK(within);
    amber_reader_close(r);
    free(got);
    free(snap);
    teardown(&f);
  }
}

static void test_unreported_failure_is_returned_by_the_next_begin(void) {
  fixture f;
  setup(&f, tu_tmpdir(), NULL);
  CHECK_OK(amber_writer_save(f.w, 1, 0));
  amber__io_inject_failure(0, EIO);
  CHECK_OK(amber_writer_begin(f.w, 2, 0));
  amber_writer_fence(f.w);
  usleep(200 * 1000); /* let it fail */
  int rc = amber_writer_begin(f.w, 3, 0);
  amber__io_inject_failure(0, 0);
  if (rc == 0) { /* the failing save was still running: wait reports it */
    CHECK(0 && "begin should have failed while the first save was in progress");
    amber_writer_wait(f.w);
  } else {
    CHECK(rc == AMBER_EIO || rc == AMBER_EBUSY);
    if (rc == AMBER_EBUSY) CHECK_RC(amber_writer_wait(f.w), AMBER_EIO);
  }
  uint64_t latest = 0;
  CHECK_OK(amber_store_latest(f.st, &latest));
  CHECK(latest == 1);
  CHECK_OK(amber_writer_save(f.w, 3, 0)); /* the error was reported once: go on */
  teardown(&f);
}

/* A real full disk: a 1 MiB tmpfs holds the first checkpoints, not the next. */
static void test_real_enospc_on_a_small_tmpfs(void) {
  char dir[4200];
  snprintf(dir, sizeof dir, "%s/small", tu_tmpdir());
  mkdir(dir, 0755);
  if (mount("tmpfs", dir, "tmpfs", 0, "size=1600k") != 0) {
    printf("skip test_real_enospc_on_a_small_tmpfs: cannot mount tmpfs (%s)\n", strerror(errno));
    return;
  }
  fixture f;
  setup(&f, dir, NULL); /* each full is ~1.2 MB: the second full cannot fit */
  CHECK_OK(amber_writer_save(f.w, 1, AMBER_SAVE_FULL));
  mutate(&f, 2);
  int rc = amber_writer_save(f.w, 2, AMBER_SAVE_FULL);
  CHECK_RC(rc, AMBER_ENOSPC);
  CHECK(strstr(amber_last_error(f.w), "ckpt-") != NULL);
  check_failure_recovery(&f, 2, rc);
  CHECK_OK(amber_writer_save(f.w, 2, 0)); /* a small delta still fits */
  teardown(&f);
  umount2(dir, MNT_DETACH);
}

/* A small staging ring (the host-memory cap of the pipeline) still saves large
 * tensors correctly: workers wait for the disk instead of buffering more. */
static void test_small_stage_cap_applies_back_pressure(void) {
  const char *dir = tu_tmpdir();
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, dir, NULL));
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.stage_bytes = 1 << 20;
  amber_writer *w = NULL;
  CHECK_RC(amber_writer_open(&w, st, &wo), AMBER_EINVAL); /* below the minimum */
  wo.stage_bytes = 4 << 20;
  CHECK_OK(amber_writer_open(&w, st, &wo));
  int64_t n = 3 << 20; /* 12 MiB: three times the ring */
  float *x = malloc((size_t)n * 4);
  tu_fill_random(x, (size_t)n * 4, 5);
  CHECK_OK(amber_writer_add(w, "x", AMBER_F32, 1, &n, x, NULL));
  CHECK_OK(amber_writer_begin(w, 1, 0));
  CHECK_OK(amber_writer_wait(w));
  amber_writer_close(w);
  amber_reader *r = NULL;
  CHECK_OK(amber_reader_open(&r, st, 1, NULL));
  float *y = malloc((size_t)n * 4);
  if (r) CHECK_OK(amber_reader_read(r, 0, y, (uint64_t)n * 4));
  CHECK(memcmp(x, y, (size_t)n * 4) == 0);
  amber_reader_close(r);
  amber_store_close(st);
  free(x);
  free(y);
}

/* Cancel stops a save before its commit; the store keeps its last checkpoint and
 * the next save is correct. */
static void test_cancel_stops_a_save_cleanly(void) {
  fixture f;
  setup(&f, tu_tmpdir(), NULL);
  CHECK_OK(amber_writer_save(f.w, 1, 0));
  CHECK_OK(amber_writer_cancel(f.w)); /* nothing in progress */
  int canceled = 0;
  for (int step = 2; step < 40 && !canceled; step++) {
    mutate(&f, step);
    CHECK_OK(amber_writer_begin(f.w, (uint64_t)step, AMBER_SAVE_FULL));
    int rc = amber_writer_cancel(f.w); /* races with the save: either outcome is valid */
    CHECK(rc == 0 || rc == AMBER_ECANCELED);
    uint64_t latest = 0;
    CHECK_OK(amber_store_latest(f.st, &latest));
    if (rc == AMBER_ECANCELED) {
      canceled = 1;
      CHECK(latest == (uint64_t)step - 1);
      CHECK(tmp_files(&f) == 0);
      float *snap = malloc(N * sizeof *snap);
      memcpy(snap, f.x, N * sizeof *snap);
      CHECK_OK(amber_writer_save(f.w, (uint64_t)step, 0)); /* the same step again */
      check_step(&f, (uint64_t)step, snap, f.c);
      free(snap);
    } else {
      CHECK(latest == (uint64_t)step);
    }
  }
  CHECK(canceled); /* a full save of 1.2 MB is slow enough to be caught at least once */
  teardown(&f);
}

int main(void) {
  TEST_RUN(test_cancel_stops_a_save_cleanly);
  TEST_RUN(test_small_stage_cap_applies_back_pressure);
  TEST_RUN(test_saved_state_is_the_state_at_begin);
  TEST_RUN(test_a_save_in_progress_refuses_changes);
  TEST_RUN(test_close_waits_for_a_save_in_progress);
  TEST_RUN(test_injected_write_failure_is_reported_and_recovered);
  TEST_RUN(test_unreported_failure_is_returned_by_the_next_begin);
  TEST_RUN(test_real_enospc_on_a_small_tmpfs);
  return tu_finish();
}

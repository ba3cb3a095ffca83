/*
 * test_async_confirm.c - the commit gate (AMBER_SAVE_CONFIRM, amber_writer_confirm).
 *
 * A save begun with AMBER_SAVE_CONFIRM is written and made durable but commits
 * only on the caller's word: a confirmed save commits; a vetoed one fails with
 * AMBER_ECHANGED and the caller's reason, leaves the store at the previous step
 * with no file left behind, and the next save is a correct delta; wait and close
 * without a verdict refuse the commit instead of hanging; confirm without a
 * gated save is AMBER_EINVAL; cancel stops a gated save. The name starts with
 * test_async so that `make test-tsan` runs it.
 */
#include <dirent.h>
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

#include "testutil.h"

#define N 300000 /* several chunks of 65536 */

typedef struct fixture {
  amber_store *st;
  amber_writer *w;
  float *x;
  int32_t *c;
} fixture;

static void setup(fixture *f, const char *dir) {
  memset(f, 0, sizeof *f);
  f->x = malloc(N * sizeof *f->x);
  f->c = calloc(1000, sizeof *f->c);
  for (int i = 0; i < N; i++) f->x[i] = (float)i * 0.25f;
  CHECK_OK(amber_store_open(&f->st, dir, NULL));
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.chunk_elems = 65536;
  CHECK_OK(amber_writer_open(&f->w, f->st, &wo));
  int64_t n = N, m = 1000;
  CHECK_OK(amber_writer_add(f->w, "x", AMBER_F32, 1, &n, f->x, NULL));
  CHECK_OK(amber_writer_add(f->w, "c", AMBER_I32, 1, &m, f->c, NULL));
}

static void teardown(fixture *f) {
  amber_writer_close(f->w);
  amber_store_close(f->st);
  free(f->x);
  free(f->c);
}

static void mutate(fixture *f, int step) {
  for (int i = step; i < N; i += 89) f->x[i] += 1.0f;
  f->c[step % 1000]++;
}

/* Step `step` restores to exactly the fixture's current tensors. */
static void check_step_is_current(fixture *f, uint64_t step) {
  amber_reader *r = NULL;
  CHECK_OK(amber_reader_open(&r, f->st, step, NULL));
  if (!r) return;
  float *got = malloc(N * sizeof *got);
  int32_t gotc[1000];
  CHECK_OK(amber_reader_read(r, 0, got, N * sizeof *got));
  CHECK_OK(amber_reader_read(r, 1, gotc, sizeof gotc));
  CHECK(memcmp(got, f->x, N * sizeof *got) == 0);
  CHECK(memcmp(gotc, f->c, sizeof gotc) == 0);
  free(got);
  amber_reader_close(r);
}

static uint64_t latest(fixture *f) {
  uint64_t s = AMBER_NO_STEP;
  CHECK_OK(amber_store_latest(f->st, &s));
  return s;
}

static uint32_t kind_of(fixture *f, uint64_t step) {
  amber_reader *r = NULL;
  amber_ckpt_info ci = {.kind = 99};
  CHECK_OK(amber_reader_open(&r, f->st, step, NULL));
  if (r) CHECK_OK(amber_reader_ckpt_info(r, &ci));
  amber_reader_close(r);
  return ci.kind;
}

/* Files in the store other than committed checkpoints, LATEST and .lock. */
static int stray_files(fixture *f) {
  DIR *d = opendir(amber_store_path(f->st));
  int n = 0;
  struct dirent *e;
  while (d && (e = readdir(d))) {
    size_t len = strlen(e->d_name);
    if (e->d_name[0] == '.' || !strcmp(e->d_name, "LATEST")) continue;
    if (len > 6 && !strcmp(e->d_name + len - 6, ".amber")) continue;
    fprintf(stderr, "  stray file %s\n", e->d_name);
    n++;
  }
  if (d) closedir(d);
  return n;
}

static void test_a_confirmed_save_commits(void) {
  fixture f;
  setup(&f, tu_tmpdir());
  for (int step = 1; step <= 3; step++) { /* a two-phase full, then deltas */
    mutate(&f, step);
    CHECK_OK(amber_writer_begin(f.w, (uint64_t)step, AMBER_SAVE_CONFIRM));
    CHECK_OK(amber_writer_fence(f.w));
    CHECK_OK(amber_writer_confirm(f.w, 1, NULL));
    CHECK_OK(amber_writer_wait(f.w));
    CHECK(latest(&f) == (uint64_t)step);
    check_step_is_current(&f, (uint64_t)step);
  }
  CHECK(kind_of(&f, 3) == AMBER_KIND_DELTA);
  /* confirm before the fence waits for the scan itself */
  mutate(&f, 4);
  CHECK_OK(amber_writer_begin(f.w, 4, AMBER_SAVE_CONFIRM));
  CHECK_OK(amber_writer_confirm(f.w, 1, ""));
  CHECK_OK(amber_writer_wait(f.w));
  check_step_is_current(&f, 4);
  teardown(&f);
}

/* A veto fails the save with ECHANGED and the reason; nothing is visible; the
 * next save is a delta against the last committed step and restores exactly. */
static void test_a_vetoed_save_fails_and_the_next_delta_is_exact(void) {
  const char *why = "tensor 'x' changed after save() and before fence(); call fence() first";
  for (int full = 0; full < 2; full++) {
    fixture f;
    setup(&f, tu_tmpdir());
    for (int step = 1; step <= 2; step++) {
      mutate(&f, step);
      CHECK_OK(amber_writer_save(f.w, (uint64_t)step, 0));
    }
    mutate(&f, 3);
    CHECK_OK(amber_writer_begin(f.w, 3, full ? AMBER_SAVE_FULL | AMBER_SAVE_CONFIRM
                                             : AMBER_SAVE_CONFIRM));
    CHECK_OK(amber_writer_fence(f.w));
    CHECK_OK(amber_writer_confirm(f.w, 0, why));
    CHECK_RC(amber_writer_wait(f.w), AMBER_ECHANGED);
    const char *msg = amber_last_error(f.w);
    CHECK(strstr(msg, why) != NULL);
    CHECK(strstr(msg, "step 3") != NULL);
    CHECK(strcmp(amber_strerror(AMBER_ECHANGED), "the data changed while it was being saved") ==
          0);
    CHECK(strcmp(amber_err_name(AMBER_ECHANGED), "AMBER_ECHANGED") == 0);
    CHECK(latest(&f) == 2);
    CHECK(stray_files(&f) == 0);
    /* the reference rolled back: step 3 again, as a delta of step 2, is exact */
    mutate(&f, 33);
    CHECK_OK(amber_writer_save(f.w, 3, 0));
    CHECK(kind_of(&f, 3) == AMBER_KIND_DELTA);
    check_step_is_current(&f, 3);
    mutate(&f, 4);
    CHECK_OK(amber_writer_save(f.w, 4, 0));
    check_step_is_current(&f, 4);
    teardown(&f);
  }
}

static void test_wait_or_close_without_a_verdict_refuses_the_commit(void) {
  const char *dir = tu_tmpdir();
  fixture f;
  setup(&f, dir);
  CHECK_OK(amber_writer_save(f.w, 1, 0));
  mutate(&f, 2);
  CHECK_OK(amber_writer_begin(f.w, 2, AMBER_SAVE_CONFIRM));
  CHECK_RC(amber_writer_begin(f.w, 3, 0), AMBER_EBUSY); /* no verdict yet: still in progress */
  CHECK_RC(amber_writer_wait(f.w), AMBER_ECHANGED);
  CHECK(strstr(amber_last_error(f.w), "not confirmed") != NULL);
  CHECK(latest(&f) == 1);
  CHECK(stray_files(&f) == 0);
  CHECK_OK(amber_writer_save(f.w, 2, 0));
  check_step_is_current(&f, 2);
  /* close without a verdict: refused too, and close returns */
  mutate(&f, 3);
  CHECK_OK(amber_writer_begin(f.w, 3, AMBER_SAVE_CONFIRM));
  amber_writer_close(f.w);
  f.w = NULL;
  CHECK(latest(&f) == 2);
  CHECK(stray_files(&f) == 0);
  teardown(&f);
}

static void test_confirm_without_a_gated_save_is_einval(void) {
  fixture f;
  setup(&f, tu_tmpdir());
  CHECK_RC(amber_writer_confirm(f.w, 1, NULL), AMBER_EINVAL); /* nothing in progress */
  CHECK(strstr(amber_last_error(f.w), "no save") != NULL);
  CHECK_OK(amber_writer_begin(f.w, 1, 0)); /* not gated */
  CHECK_RC(amber_writer_confirm(f.w, 1, NULL), AMBER_EINVAL);
  CHECK(strstr(amber_last_error(f.w), "AMBER_SAVE_CONFIRM") != NULL);
  CHECK_OK(amber_writer_wait(f.w));
  CHECK_OK(amber_writer_begin(f.w, 2, AMBER_SAVE_CONFIRM));
  CHECK_OK(amber_writer_confirm(f.w, 1, NULL));
  CHECK_RC(amber_writer_confirm(f.w, 0, "too late"), AMBER_EINVAL); /* verdict already in */
  CHECK_OK(amber_writer_wait(f.w));
  CHECK(latest(&f) == 2);
  CHECK_RC(amber_writer_confirm(f.w, 1, NULL), AMBER_EINVAL); /* reported by wait */
  CHECK_RC(amber_writer_save(f.w, 3, AMBER_SAVE_CONFIRM), AMBER_EINVAL); /* nobody to confirm */
  CHECK_RC(amber_writer_confirm(NULL, 1, NULL), AMBER_EINVAL);
  CHECK(latest(&f) == 2);
  teardown(&f);
}

static void test_cancel_stops_a_gated_save(void) {
  fixture f;
  setup(&f, tu_tmpdir());
  CHECK_OK(amber_writer_save(f.w, 1, 0));
  mutate(&f, 2);
  CHECK_OK(amber_writer_begin(f.w, 2, AMBER_SAVE_CONFIRM));
  CHECK_OK(amber_writer_fence(f.w));
  CHECK_RC(amber_writer_cancel(f.w), AMBER_ECANCELED); /* no verdict: it cannot have committed */
  CHECK(latest(&f) == 1);
  CHECK(stray_files(&f) == 0);
  CHECK_OK(amber_writer_save(f.w, 2, 0));
  check_step_is_current(&f, 2);
  teardown(&f);
}

/* The verdict comes from another thread while the save thread waits at the
 * gate (the case TSan checks), many times over, alternating ok and veto. */
typedef struct verdict_arg {
  amber_writer *w;
  int ok;
  int rc;
} verdict_arg;

static void *give_verdict_later(void *p) {
  verdict_arg *a = p;
  usleep(2000);
  a->rc = amber_writer_confirm(a->w, a->ok, "vetoed by the test");
  return NULL;
}

static void test_verdicts_from_another_thread(void) {
  fixture f;
  setup(&f, tu_tmpdir());
  uint64_t committed = 0;
  for (int i = 1; i <= 16; i++) {
    mutate(&f, i);
    uint64_t step = committed + 1;
    CHECK_OK(amber_writer_begin(f.w, step, AMBER_SAVE_CONFIRM));
    verdict_arg a = {.w = f.w, .ok = i % 3 != 0};
    pthread_t t;
    CHECK(pthread_create(&t, NULL, give_verdict_later, &a) == 0);
    pthread_join(t, NULL);
    CHECK_OK(a.rc);
    int rc = amber_writer_wait(f.w);
    CHECK_RC(rc, a.ok ? 0 : AMBER_ECHANGED);
    if (rc == 0) committed = step;
    CHECK(latest(&f) == committed);
  }
  check_step_is_current(&f, committed);
  CHECK(stray_files(&f) == 0);
  teardown(&f);
}

int main(void) {
  TEST_RUN(test_a_confirmed_save_commits);
  TEST_RUN(test_a_vetoed_save_fails_and_the_next_delta_is_exact);
  TEST_RUN(test_wait_or_close_without_a_verdict_refuses_the_commit);
  TEST_RUN(test_confirm_without_a_gated_save_is_einval);
  TEST_RUN(test_cancel_stops_a_gated_save);
  TEST_RUN(test_verdicts_from_another_thread);
  return tu_finish();
}

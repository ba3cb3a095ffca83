/*
 * test_progress.c - the progress hook (amber_set_progress) and the CLI's progress
 * line: a save, a verify and a compact report their bytes up to done == total,
 * under their own names, with nothing reported once the hook is removed; the CLI
 * prints its progress on stderr only when asked (a terminal, or AMBER_PROGRESS=1),
 * and never on stdout.
 */
#include <pthread.h>
#include <stdlib.h>

#include "testutil.h"

#define N 6000

static struct {
  pthread_mutex_t mu;
  int calls, bad, mixed;
  char what[16], last[16];
  uint64_t max, total;
} seen = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void reset(void) {
  seen.calls = seen.bad = seen.mixed = 0;
  seen.what[0] = seen.last[0] = 0;
  seen.max = seen.total = 0;
}

/* Workers may report at once and out of order. `mixed` counts the reports of
 * another operation or total than the first one's. */
static void hook(void *ctx, const char *what, uint64_t done, uint64_t total) {
  pthread_mutex_lock(&seen.mu);
  if (ctx != &seen || done > total) seen.bad++;
  if (!seen.calls) snprintf(seen.what, sizeof seen.what, "%s", what), seen.total = total;
  else if (strcmp(seen.what, what) || seen.total != total) seen.mixed++;
  snprintf(seen.last, sizeof seen.last, "%s", what);
  if (done > seen.max) seen.max = done;
  seen.calls++;
  pthread_mutex_unlock(&seen.mu);
}

static void test_save_verify_and_compact_report_progress_to_the_end(void) {
  const char *dir = tu_tmpdir();
  amber_store *st = NULL;
  amber_writer *w = NULL;
  CHECK_OK(amber_store_open(&st, dir, NULL));
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.chunk_elems = 1000; /* several chunks per tensor */
  CHECK_OK(amber_writer_open(&w, st, &wo));
  static float a[N], b[N / 2];
  int64_t na = N, nb = N / 2;
  tu_fill_random(a, sizeof a, 1);
  tu_fill_random(b, sizeof b, 2);
  CHECK_OK(amber_writer_add(w, "a", AMBER_F32, 1, &na, a, NULL));
  CHECK_OK(amber_writer_add(w, "b", AMBER_F32, 1, &nb, b, NULL));
  uint64_t total = sizeof a + sizeof b;

  amber_set_progress(hook, &seen);
  reset();
  CHECK_OK(amber_writer_save(w, 1, 0));
  CHECK(seen.calls == 9 && !seen.bad && !seen.mixed && !strcmp(seen.what, "save"));
  CHECK(seen.max == total && seen.total == total);
  a[17] += 1.0f;
  reset();
  CHECK_OK(amber_writer_save(w, 2, 0)); /* a delta reports every chunk too */
  CHECK(seen.calls == 9 && !seen.bad && !seen.mixed && seen.max == total);

  amber_reader *r = NULL;
  CHECK_OK(amber_reader_open(&r, st, 2, NULL));
  reset();
  CHECK_OK(amber_reader_verify(r));
  CHECK(seen.calls == 2 && !seen.bad && !seen.mixed && !strcmp(seen.what, "verify"));
  CHECK(seen.max == total);
  amber_reader_close(r);
  amber_writer_close(w);

  /* compact verifies, then rewrites: both report, the rewrite last. */
  reset();
  CHECK_OK(amber_store_compact(st, 2));
  CHECK(seen.calls == 4 && !seen.bad && seen.mixed == 2 && !strcmp(seen.what, "verify"));
  CHECK(!strcmp(seen.last, "compact") && seen.max == total);

  amber_set_progress(NULL, NULL);
  reset();
  CHECK_OK(amber_store_compact(st, 1)); /* a no-op: full already */
  CHECK_OK(amber_reader_open(&r, st, 2, NULL));
  CHECK_OK(amber_reader_verify(r));
  amber_reader_close(r);
  CHECK(seen.calls == 0);
  amber_store_close(st);
}

static void test_cli_prints_progress_on_stderr_only_when_asked(void) {
  const char *dir = tu_tmpdir();
  char store[4200], out[4200], err[4200];
  snprintf(store, sizeof store, "%s/s", dir);
  snprintf(out, sizeof out, "%s/out.txt", dir);
  snprintf(err, sizeof err, "%s/err.txt", dir);
  amber_store *st = NULL;
  amber_writer *w = NULL;
  CHECK_OK(amber_store_open(&st, store, NULL));
  CHECK_OK(amber_writer_open(&w, st, NULL));
  static float a[N];
  int64_t na = N;
  CHECK_OK(amber_writer_add(w, "a", AMBER_F32, 1, &na, a, NULL));
  CHECK_OK(amber_writer_save(w, 1, 0));
  amber_writer_close(w);
  amber_store_close(st);
  size_t len = 0;
  char *txt;
  /* Not a terminal: nothing on stderr. */
  CHECK(tu_system("%s verify %s > %s 2> %s", AMBER_CLI, store, out, err) == 0);
  txt = (char *)tu_read_file(err, &len);
  CHECK(txt && len == 0);
  free(txt);
  /* Asked for: a line per report on stderr, stdout as before. */
  CHECK(tu_system("AMBER_PROGRESS=1 %s verify %s > %s 2> %s", AMBER_CLI, store, out, err) == 0);
  txt = (char *)tu_read_file(err, &len);
  CHECK(txt && strstr(txt, "verify step 1: 100% of 24.0 kB\n"));
  free(txt);
  txt = (char *)tu_read_file(out, &len);
  CHECK(txt && len == strlen("step 1: ok\n") && !memcmp(txt, "step 1: ok\n", len));
  free(txt);
  CHECK(tu_system("AMBER_PROGRESS=1 %s export %s -o %s/x.safetensors > /dev/null 2> %s",
                  AMBER_CLI, store, dir, err) == 0);
  txt = (char *)tu_read_file(err, &len);
  CHECK(txt && strstr(txt, "export step 1: 100% of 24.0 kB\n"));
  free(txt);
}

int main(void) {
  TEST_RUN(test_save_verify_and_compact_report_progress_to_the_end);
  TEST_RUN(test_cli_prints_progress_on_stderr_only_when_asked);
  return tu_finish();
}

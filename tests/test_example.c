/*
 * test_example.c - examples/train_loop.c, the C trainer that checkpoints every step
 * with begin/fence/wait: a run SIGKILLed in the middle of a save and resumed from
 * the store ends bit-identical to an uninterrupted run (exact policy), and runs
 * under a lossy policy complete with an intact store.
 */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>

#include "testutil.h"

/* Runs the example; returns its exit status (-1 if killed) and its last line. */
static int run(const char *store, const char *extra, char *line, size_t len) {
  char cmd[16384], out[4200];
  snprintf(out, sizeof out, "%s.out", store);
  snprintf(cmd, sizeof cmd, "%s %s --steps 60 %s > %s 2> %s.err", AMBER_TRAIN_LOOP, store,
           extra, out, out);
  int st = system(cmd);
  line[0] = 0;
  size_t n = 0;
  uint8_t *b = tu_read_file(out, &n);
  if (b) {
    snprintf(line, len, "%.*s", (int)n, (const char *)b);
    free(b);
  }
  if (st == -1 || !WIFEXITED(st)) return -1;
  return WEXITSTATUS(st) == 128 + SIGKILL ? -1 : WEXITSTATUS(st); /* the shell reports it */
}

/* The step the last run of `store` resumed from (its stderr says), or -1. */
static long resumed_from(const char *store) {
  char path[4300];
  snprintf(path, sizeof path, "%s.out.err", store);
  size_t n = 0;
  uint8_t *b = tu_read_file(path, &n);
  long step = -1;
  if (b) {
    char *t = malloc(n + 1);
    memcpy(t, b, n);
    t[n] = 0;
    const char *at = strstr(t, "resumed from step ");
    if (at) step = strtol(at + 18, NULL, 10);
    free(t);
    free(b);
  }
  return step;
}

static void verify_store(const char *dir) {
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY;
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, dir, &so));
  amber_ckpt_info *info = NULL;
  size_t n = 0;
  CHECK_OK(amber_store_list(st, &info, &n));
  CHECK(n > 0);
  for (size_t i = 0; i < n; i++) {
    amber_reader *r = NULL;
    CHECK_OK(amber_reader_open(&r, st, info[i].step, NULL));
    if (r) CHECK_OK(amber_reader_verify(r));
    amber_reader_close(r);
  }
  amber_free(info);
  amber_store_close(st);
}

static void test_killed_and_resumed_run_matches_uninterrupted(void) {
  const char *tmp = tu_tmpdir();
  char a[4200], b[4200], la[256], lb[256], lk[256];
  snprintf(a, sizeof a, "%s/a", tmp);
  snprintf(b, sizeof b, "%s/b", tmp);
  CHECK(run(a, "", la, sizeof la) == 0);
  CHECK(strncmp(la, "final step 60 ", 14) == 0);
  CHECK(resumed_from(a) == -1);
  long last = -1;
  for (int kill_at = 7; kill_at <= 50; kill_at += 21) { /* three crashes in one run */
    char extra[64];
    snprintf(extra, sizeof extra, "--kill-at %d", kill_at);
    CHECK(run(b, extra, lk, sizeof lk) == -1); /* SIGKILLed */
    if (kill_at > 7) CHECK(resumed_from(b) >= last - 1 && resumed_from(b) <= last);
    last = kill_at;
  }
  CHECK(run(b, "", lb, sizeof lb) == 0);
  long from = resumed_from(b); /* the save of 49 was in flight: 48 or 49 was committed */
  CHECK(from == 48 || from == 49);
  CHECK(strcmp(la, lb) == 0);
  if (strcmp(la, lb)) fprintf(stderr, "uninterrupted: %sresumed:      %s", la, lb);
  verify_store(b);
}

static void test_lossy_policy_run_completes(void) {
  const char *tmp = tu_tmpdir();
  char s[4200], line[256];
  snprintf(s, sizeof s, "%s/lossy", tmp);
  CHECK(run(s, "--policy 'optim.*=threshold:1e-7:1e-2' --kill-at 30", line, sizeof line) == -1);
  CHECK(run(s, "--policy 'optim.*=threshold:1e-7:1e-2'", line, sizeof line) == 0);
  CHECK(strncmp(line, "final step 60 ", 14) == 0);
  verify_store(s);
}

int main(void) {
  TEST_RUN(test_killed_and_resumed_run_matches_uninterrupted);
  TEST_RUN(test_lossy_policy_run_completes);
  return tu_finish();
}

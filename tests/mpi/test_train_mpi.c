/*
 * test_train_mpi.c - examples/train_mpi.c under mpirun: the many-rank trainer that
 * checkpoints every step as one global step with split saves.
 *
 * - A run stopped and resumed at the same rank count ends bit-identical to an
 *   uninterrupted one (exact policy: the same final state hash).
 * - A resume at another rank count (4 -> 2 -> 3 -> 1) restores every tensor
 *   bit-exactly: the state hash printed after the resume is the one the previous
 *   run ended with.
 * - SIGKILL of one rank at a random moment, or of every rank at once (the whole
 *   job), with the commit in the background or inside wait(): the store is left at
 *   a global commit that `amber verify` accepts, no older than the step before the
 *   one being saved, and a resumed run restores it and ends bit-identical to an
 *   uninterrupted run.
 *
 * The kill trials run AMBER_TRIALS times (3 by default, `make test-long` 50),
 * seeded from AMBER_SEED (printed, so that a failing trial can be replayed). Every
 * mpirun is bounded by timeout, which kills its whole process group.
 */
#include <inttypes.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>

#include "testutil.h"

enum { STEPS = 24 };

/* Runs the example under mpirun at `np` ranks on `store`; returns its exit status
 * (-1 when it did not exit by itself). `line` gets its final stdout line, `resumed`
 * its "resumed from step" line (empty when it started afresh). */
static int run(int np, const char *store, int steps, const char *extra, char *line,
               char *resumed, size_t len) {
  char cmd[16384], out[4200];
  snprintf(out, sizeof out, "%s.out", store);
  snprintf(cmd, sizeof cmd,
           "timeout -k 10 120 %s --allow-run-as-root --oversubscribe -np %d %s %s --steps %d %s"
           " > %s 2> %s.err",
           AMBER_MPIEXEC, np, AMBER_TRAIN_MPI, store, steps, extra, out, out);
  int st = system(cmd);
  line[0] = resumed[0] = 0;
  size_t n = 0;
  uint8_t *b = tu_read_file(out, &n);
  if (b) {
    const char *at = memmem(b, n, "final step", 10);
    if (at) snprintf(line, len, "%.*s", (int)((const char *)b + n - at), at);
    free(b);
  }
  snprintf(out + strlen(out), sizeof out - strlen(out), ".err");
  if ((b = tu_read_file(out, &n)) != NULL) {
    const char *at = memmem(b, n, "resumed from step ", 18);
    if (at) {
      const char *end = memchr(at, '\n', n - (size_t)(at - (const char *)b));
      snprintf(resumed, len, "%.*s", (int)(end ? end - at : 0), at);
    }
    free(b);
  }
  if (st == -1 || !WIFEXITED(st)) return -1;
  return WEXITSTATUS(st);
}

/* The state hash at the end of a "final step ... state H" or "resumed ... state H" line. */
static const char *state_of(const char *line) {
  const char *s = strstr(line, "state ");
  return s ? s + 6 : "";
}

/* The latest global step of `store`, AMBER_NO_STEP when none. */
static uint64_t latest_global(const char *store) {
  amber_global_step_info *gs = NULL;
  size_t n = 0;
  uint64_t last = AMBER_NO_STEP;
  if (amber_global_list(store, &gs, &n) == 0 && n) last = gs[n - 1].step;
  amber_free(gs);
  return last;
}

static int verify(const char *store) {
  return tu_system("%s verify %s > /dev/null", AMBER_CLI, store);
}

/* Whether the last run on `store` said so on stderr. */
static int said(const char *store, const char *what) {
  char path[4300];
  snprintf(path, sizeof path, "%s.out.err", store);
  size_t n = 0;
  uint8_t *b = tu_read_file(path, &n);
  int found = b && memmem(b, n, what, strlen(what)) != NULL;
  free(b);
  return found;
}

/* The first part runs with the commit inside wait() (--funneled), the rest and
 * the uninterrupted run with the commit in the background (MPI_THREAD_MULTIPLE):
 * where the commit runs changes nothing of the state. */
static void test_resume_at_same_rank_count_is_bit_identical(void) {
  const char *tmp = tu_tmpdir();
  char a[4200], b[4200], la[512], lb[512], r[512];
  snprintf(a, sizeof a, "%s/a", tmp);
  snprintf(b, sizeof b, "%s/b", tmp);
  CHECK(run(2, a, STEPS, "", la, r, sizeof la) == 0);
  CHECK(strncmp(la, "final step 24 ", 14) == 0);
  CHECK(r[0] == 0);
  CHECK(said(a, "the global commit runs in the background"));
  CHECK(run(2, b, STEPS / 2, "--funneled", lb, r, sizeof lb) == 0);
  CHECK(said(b, "the global commit runs inside wait()"));
  CHECK(run(2, b, STEPS, "", lb, r, sizeof lb) == 0);
  CHECK(strncmp(r, "resumed from step 12 ", 21) == 0);
  CHECK(strcmp(la, lb) == 0);
  if (strcmp(la, lb)) fprintf(stderr, "uninterrupted: %sresumed:      %s", la, lb);
  CHECK(verify(b) == 0);
}

static void test_resume_at_other_rank_counts_restores_every_tensor(void) {
  const char *tmp = tu_tmpdir();
  char s[4200], line[512] = "", r[512], prev[512];
  snprintf(s, sizeof s, "%s/reshard", tmp);
  static const int counts[] = {4, 2, 3, 1};
  for (int i = 0; i < 4; i++) {
    int steps = 6 + 4 * i;
    snprintf(prev, sizeof prev, "%s", line);
    CHECK(run(counts[i], s, steps, "", line, r, sizeof line) == 0);
    if (i == 0) continue;
    char want[64];
    snprintf(want, sizeof want, "resumed from step %d (written by %d ranks)", steps - 4,
             counts[i - 1]);
    CHECK(strncmp(r, want, strlen(want)) == 0);
    /* Every global tensor of the resumed state, gathered, has the bits the
     * previous run (another rank count) ended with. */
    CHECK(state_of(r)[0] && strncmp(state_of(r), state_of(prev), 16) == 0);
    if (strncmp(state_of(r), state_of(prev), 16))
      fprintf(stderr, "%d -> %d ranks: ended %s  resumed %s\n", counts[i - 1], counts[i],
              prev, r);
  }
  CHECK(latest_global(s) == 18);
  CHECK(verify(s) == 0);
}

static long env_long(const char *name, long def) {
  const char *v = getenv(name);
  return v && *v ? strtol(v, NULL, 10) : def;
}

static void test_sigkill_of_a_rank_or_the_job_leaves_a_verified_store(void) {
  const char *tmp = tu_tmpdir();
  long trials = env_long("AMBER_TRIALS", 3);
  uint64_t seed0 = (uint64_t)env_long("AMBER_SEED", (long)time(NULL)), seed = seed0;
  printf("     %ld trials, AMBER_SEED=%" PRIu64 "\n", trials, seed0);
  char ref[2][512] = {"", ""}; /* uninterrupted runs at 2 and 4 ranks */
  int killed = 0;
  for (long t = 0; t < trials && !tu_failures; t++) {
    int np = t % 3 == 1 ? 4 : 2, whole = (int)(t % 2);
    char s[4200], line[512], r[512], extra[128];
    if (!ref[np / 4][0]) {
      snprintf(s, sizeof s, "%s/ref%d", tmp, np);
      CHECK(run(np, s, STEPS, "", ref[np / 4], r, sizeof ref[0]) == 0);
    }
    snprintf(s, sizeof s, "%s/kill%ld", tmp, t);
    int at = 2 + (int)(tu_rand(&seed) % (STEPS - 2));
    int rank = whole ? -1 : (int)(tu_rand(&seed) % (uint64_t)np);
    long us = (long)(tu_rand(&seed) % 20000);
    snprintf(extra, sizeof extra, "--kill-rank %d --kill-at %d --kill-after-us %ld%s", rank, at,
             us, t % 4 >= 2 ? " --funneled" : "");
    int rc = run(np, s, STEPS, extra, line, r, sizeof line);
    uint64_t last = latest_global(s);
    printf("     trial %ld: %d ranks, commit %s, %s at step %d + %ld us: %s, store at step %"
           PRId64 "\n", t, np, t % 4 >= 2 ? "in wait()" : "in the background",
           whole ? "every rank" : "one rank", at, us,
           rc == 0 ? "ran to the end" : "killed", last == AMBER_NO_STEP ? (int64_t)-1 : (int64_t)last);
    killed += rc != 0;
    /* The step before the one being saved was committed everywhere before any
     * rank began the save it died in. */
    CHECK(last != AMBER_NO_STEP && last + 1 >= (uint64_t)at);
    CHECK(verify(s) == 0);
    CHECK(run(np, s, STEPS, "", line, r, sizeof line) == 0);
    char want[64];
    snprintf(want, sizeof want, "resumed from step %" PRIu64 " ", last);
    CHECK(strncmp(r, want, strlen(want)) == 0);
    CHECK(strncmp(line, "final step 24 ", 14) == 0); /* and the same state, bit for bit */
    CHECK(state_of(line)[0] && strcmp(state_of(line), state_of(ref[np / 4])) == 0);
    CHECK(verify(s) == 0);
    if (tu_failures)
      fprintf(stderr, "  trial %ld failed (%s; AMBER_SEED=%" PRIu64 "): resumed '%s', ended %s"
              "  uninterrupted %s", t, extra, seed0, r, line, ref[np / 4]);
    tu_rm_rf(s);
  }
  printf("     %d of %ld runs were killed (the others ended before the kill)\n", killed, trials);
}

int main(void) {
  /* OpenMPI in a container: no cross-memory attach. Under ASan, OpenMPI's own
   * allocations (its plugins, unloaded before the leak check) show as leaks that
   * no narrower suppression can name; amber's code is leak-checked in
   * test_global with the threads communicator. */
  setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none", 1);
  /* Its shared-memory segments (a file per rank) in a directory removed at the end:
   * the ranks killed on purpose leave theirs behind. */
  const char *shm = tu_memdir();
  setenv("OMPI_MCA_btl_vader_backing_directory", shm ? shm : tu_tmpdir(), 1);
  const char *asan = getenv("ASAN_OPTIONS");
  char opts[1024];
  snprintf(opts, sizeof opts, "%s%sdetect_leaks=0", asan ? asan : "", asan && *asan ? ":" : "");
  setenv("ASAN_OPTIONS", opts, 1);
  TEST_RUN(test_resume_at_same_rank_count_is_bit_identical);
  TEST_RUN(test_resume_at_other_rank_counts_restores_every_tensor);
  TEST_RUN(test_sigkill_of_a_rank_or_the_job_leaves_a_verified_store);
  return tu_finish();
}

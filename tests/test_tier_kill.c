/*
 * test_tier_kill.c - a drain killed at any instant (SIGKILL of a child process that
 * runs amber_drain_run, after a random delay, its puts slowed a little so that the
 * kills land all along it) leaves the durable tier with a prefix of the committed
 * steps, each restoring bit-identically, and no partial step visible: the pointer
 * (LATEST; GLOBAL for a multi-rank store) moves only after everything its step
 * needs; nothing committed is lost from both tiers; the next drain finishes what is
 * left and removes the temporary files. AMBER_KILL_ITERS sets the number of kills
 * (default 30 for each layout), AMBER_KILL_SEED the delays.
 */
#include <dirent.h>
#include <inttypes.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"
#include "tier.h"
#include "tier_job.h"

#define STEPS 12

static long env_long(const char *name, long def) {
  const char *v = getenv(name);
  return v && *v ? strtol(v, NULL, 10) : def;
}

/* Temporary files left anywhere under `dir`. */
static int count_tmp(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return 0;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    size_t len = strlen(e->d_name);
    if (e->d_name[0] == '.') continue;
    char sub[4200];
    snprintf(sub, sizeof sub, "%s/%s", dir, e->d_name);
    if (len > 4 && !strcmp(e->d_name + len - 4, ".tmp"))
      n++;
    else if (!strncmp(e->d_name, "rank-", 5))
      n += count_tmp(sub);
  }
  closedir(d);
  return n;
}

/* Runs amber_drain_run(mem, dur) in a child killed after up to `max_us`; returns 1
 * when the child was killed, 0 when it finished first. */
static int killed_drain(const char *mem, const char *dur, useconds_t delay) {
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    amber__tier_inject(1500, -1, 0); /* each put 1.5 ms slower */
    _exit(amber_drain_run(mem, dur, NULL) == 0 ? 0 : 3);
  }
  usleep(delay);
  kill(pid, SIGKILL);
  int status = 0;
  CHECK(waitpid(pid, &status, 0) == pid);
  if (WIFEXITED(status)) CHECK(WEXITSTATUS(status) == 0);
  return WIFSIGNALED(status);
}


static uint64_t check_multi(const char *mem, const char *dur) {
  uint64_t ds[64], ms[64];
  size_t nd = g_steps(dur, ds, 64), nm = g_steps(mem, ms, 64);
  for (size_t i = 0; i < nd; i++) {
    CHECK(ds[i] == i + 1);
    g_check(dur, ds[i]);
  }
  for (size_t i = 0; i < nm; i++)
    g_check(mem, ms[i]);
  for (uint64_t k = 1; k <= STEPS; k++) {
    int in = k <= nd;
    for (size_t i = 0; i < nm; i++)
      in |= ms[i] == k;
    CHECK(in);
  }
  return nd;
}

static void build(const char *mem, int multi) {
  if (multi) {
    gjob jb = {.path = mem, .first = 1, .last = STEPS, .full_every = 4, .fail_rank = -1};
    g_run(&jb, 2);
    return;
  }
  job j;
  job_open(&j, mem, 4);
  for (uint64_t s = 1; s <= STEPS; s++)
    job_save(&j, s, 0);
  job_close(&j);
}

static void kill_loop(int multi) {
  long iters = env_long("AMBER_KILL_ITERS", 30);
  uint64_t seed0 = (uint64_t)env_long("AMBER_KILL_SEED", 20251206), seed = seed0;
  long kills = 0, finished = 0, rounds = 0;
  uint64_t progress_seen = 0;
  while (kills < iters && !tu_failures) {
    char mem[2048], dur[2048];
    const char *t = tu_tmpdir();
    snprintf(mem, sizeof mem, "%s/mem", t);
    snprintf(dur, sizeof dur, "%s/durable", t);
    build(mem, multi);
    rounds++;
    /* kill drains of this memory tier until one finishes: each resumes the last */
    for (int done = 0; !done && !tu_failures;) {
      useconds_t delay = (useconds_t)(tu_rand(&seed) % 60000);
      done = !killed_drain(mem, dur, delay);
      kills += !done, finished += done;
      uint64_t l = multi ? check_multi(mem, dur) : check_visible(mem, dur, STEPS, 1);
      if (l > 0 && l < STEPS) progress_seen++;
      if (tu_failures)
        fprintf(stderr, "  kill after %u us (AMBER_KILL_SEED=%" PRIu64 ")\n",
                (unsigned)delay, seed0);
    }
    /* the finished drain: everything durable, nothing temporary left */
    CHECK((multi ? check_multi(mem, dur) : check_visible(mem, dur, STEPS, 1)) == STEPS);
    CHECK(count_tmp(dur) == 0);
    tu_rm_rf(t);
  }
  printf("     %ld kills in %ld rounds, %ld drains finished; %llu kills left a partial "
         "durable tier (AMBER_KILL_SEED=%" PRIu64 ")\n",
         kills, rounds, finished, (unsigned long long)progress_seen, seed0);
  CHECK(iters == 0 || progress_seen > 0); /* the kills did land inside drains */
}

static void test_sigkill_during_a_single_rank_drain(void) {
  kill_loop(0);
}

static void test_sigkill_during_a_multi_rank_drain(void) {
  kill_loop(1);
}

int main(void) {
  TEST_RUN(test_sigkill_during_a_single_rank_drain);
  TEST_RUN(test_sigkill_during_a_multi_rank_drain);
  return tu_finish();
}

/*
 * test_tier_ranks.c - the drain of a multi-rank memory tier (src/drain.c): every
 * global step becomes durable, its rank files first and GLOBAL last, and reads back
 * exactly there; a drain of every rank (amber drain) and one drain per rank beside
 * the global writer (rank 0 drains the manifests once every rank's files are
 * durable); a failed global step, whose rank files move back, breaks neither tier;
 * rank stores on two hosts' memory tiers drain in either order, the coordinator's
 * refusing, with a clear error, while another host's files are missing.
 */
#include <errno.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include "store.h"
#include "testutil.h"
#include "tier_job.h"

static void paths(char *mem, char *dur, size_t len) {
  const char *t = tu_tmpdir();
  snprintf(mem, len, "%s/mem", t);
  snprintf(dur, len, "%s/durable", t);
}

/* What the memory tier keeps after a drain: the manifests from the newest durable
 * step on, and in each rank store the chain of its file of that step. */
static void check_memory_kept(const char *mem, uint64_t newest, int ranks) {
  uint64_t steps[64];
  size_t n = g_steps(mem, steps, 64);
  CHECK(n == 1 && steps[0] == newest);
  g_check(mem, newest);
  for (int r = 0; r < ranks; r++) {
    char p[4200];
    snprintf(p, sizeof p, "%s/rank-%05d", mem, r);
    check_only_newest_chain(p, newest);
  }
}

static void test_drain_run_of_every_rank_makes_each_global_step_durable(void) {
  char mem[2048], dur[2048];
  paths(mem, dur, sizeof mem);
  gjob jb = {.path = mem, .first = 1, .last = 9, .full_every = 3, .fail_rank = -1};
  g_run(&jb, 3);
  CHECK_OK(amber_drain_run(mem, dur, NULL));
  uint64_t steps[64];
  size_t n = g_steps(dur, steps, 64);
  CHECK(n == 9);
  for (size_t i = 0; i < n && i < 64; i++)
    CHECK(steps[i] == i + 1);
  for (uint64_t s = 1; s <= 9; s++)
    g_check(dur, s);
  for (int r = 0; r < 3; r++) { /* each rank store of the durable tier has its LATEST */
    char p[4200];
    snprintf(p, sizeof p, "%s/rank-%05d", dur, r);
    amber_store *st = NULL;
    uint64_t latest = 0;
    amber_store_opts so;
    amber_store_opts_init(&so);
    so.flags = AMBER_OPEN_READONLY;
    CHECK_OK(amber_store_open(&st, p, &so));
    CHECK_OK(amber_store_latest(st, &latest));
    CHECK(latest == 9);
    amber_store_close(st);
  }
  check_memory_kept(mem, 9, 3);
  /* the memory tier is a multi-rank store as before: its writer goes on */
  jb.first = 10, jb.last = 11;
  g_run(&jb, 3);
  CHECK_OK(amber_drain_run(mem, NULL, NULL));
  for (uint64_t s = 1; s <= 11; s++)
    g_check(dur, s);
  check_memory_kept(mem, 11, 3);
}

static void test_a_drain_per_rank_beside_the_global_writer(void) {
  char mem[2048], dur[2048];
  paths(mem, dur, sizeof mem);
  gjob jb = {.path = mem,
             .first = 1,
             .last = 12,
             .full_every = 4,
             .fail_rank = -1,
             .durable = dur,
             .linger_us = 600000};
  amber_drain_opts_init(&jb.dopts);
  jb.dopts.max_lag_steps = 3;
  g_run(&jb, 3);
  uint64_t steps[64];
  CHECK(g_steps(dur, steps, 64) == 12);
  for (uint64_t s = 1; s <= 12; s++)
    g_check(dur, s);
  /* Each rank's drain, still open after rank 0's moved the durable GLOBAL to 12,
   * removed what step 12 no longer needs. */
  check_memory_kept(mem, 12, 3);
}

/* The number of checkpoint files in rank store r of `mem`. */
static size_t rank_files(const char *mem, int r) {
  char p[4200];
  snprintf(p, sizeof p, "%s/rank-%05d", mem, r);
  uint64_t steps[MAXSTEP];
  return steps_of(p, steps);
}

/* Ranks 1 and 2 drain everything before rank 0's drain (the coordinator) starts:
 * until the durable tier has a GLOBAL they keep every file; once rank 0's drain
 * writes it, their idle drains see it and keep only what its step needs. */
static void test_idle_rank_drains_follow_the_durable_global(void) {
  char mem[2048], dur[2048];
  paths(mem, dur, sizeof mem);
  gjob jb = {.path = mem, .first = 1, .last = 6, .full_every = 4, .fail_rank = -1};
  g_run(&jb, 3); /* fulls at 1 and 6 */
  amber_drain *d[3] = {NULL, NULL, NULL};
  amber_drain_opts o;
  amber_drain_opts_init(&o);
  for (int r = 2; r >= 1; r--) {
    o.rank = r;
    CHECK_OK(amber_drain_start(&d[r], mem, dur, &o));
    CHECK_OK(amber_drain_flush(d[r], 30));
  }
  CHECK(rank_files(mem, 1) == 6 && rank_files(mem, 2) == 6);
  o.rank = 0;
  CHECK_OK(amber_drain_start(&d[0], mem, dur, &o));
  CHECK_OK(amber_drain_flush(d[0], 30));
  uint64_t steps[64];
  CHECK(g_steps(dur, steps, 64) == 6);
  int waited = 0;
  while ((rank_files(mem, 1) != 1 || rank_files(mem, 2) != 1) && waited < 3000)
    usleep(10000), waited += 10;
  CHECK(rank_files(mem, 1) == 1 && rank_files(mem, 2) == 1);
  for (int r = 0; r < 3; r++)
    CHECK_OK(amber_drain_close(d[r]));
  check_memory_kept(mem, 6, 3);
}

/* Step 5 fails on rank 1: ranks 0 and 2 committed their part and move back; their
 * drains may have copied it. Nothing breaks: the writer's next steps (full) save,
 * the drains go on, and every committed step is in the durable tier. */
static void test_a_failed_global_step_breaks_neither_tier(void) {
  char mem[2048], dur[2048];
  paths(mem, dur, sizeof mem);
  gjob jb = {.path = mem,
             .first = 1,
             .last = 9,
             .full_every = 3,
             .fail_rank = 1,
             .fail_step = 5,
             .durable = dur};
  amber_drain_opts_init(&jb.dopts);
  g_run(&jb, 3);
  uint64_t steps[64];
  size_t n = g_steps(dur, steps, 64);
  CHECK(n == 8);
  for (size_t i = 0; i < n && i < 64; i++) {
    CHECK(steps[i] != 5);
    g_check(dur, steps[i]);
  }
  g_check(mem, 9);
  CHECK_OK(amber_drain_run(mem, dur, NULL));
  check_memory_kept(mem, 9, 3);
}

/* A rank store may be one step ahead of GLOBAL (its part of a step that then fails,
 * before it moves back): a full file there must not make its drain remove what the
 * committed steps need, since the rank's LATEST moves back to them. */
static void test_a_rank_ahead_of_global_keeps_what_global_needs(void) {
  char mem[2048], dur[2048], ahead[2100], from[2300], to[2300];
  paths(mem, dur, sizeof mem);
  gjob jb = {.path = mem, .first = 1, .last = 6, .full_every = 100, .fail_rank = -1};
  g_run(&jb, 2);
  CHECK_OK(amber_drain_run(mem, dur, NULL)); /* the durable GLOBAL is 6 */
  /* rank 1's full part of step 7, made in a copy and put beside its committed steps */
  snprintf(ahead, sizeof ahead, "%s.ahead", mem);
  CHECK(tu_system("cp -a '%s' '%s'", mem, ahead) == 0);
  gjob j7 = {.path = ahead,
             .first = 7,
             .last = 7,
             .full_every = 100,
             .fail_rank = -1,
             .flags = AMBER_SAVE_FULL};
  g_run(&j7, 2);
  static const char *const names[] = {"ckpt-00000000000000000007.amber", "LATEST"};
  for (int i = 0; i < 2; i++) {
    snprintf(from, sizeof from, "%s/rank-00001/%s", ahead, names[i]);
    snprintf(to, sizeof to, "%s/rank-00001/%s", mem, names[i]);
    CHECK(rename(from, to) == 0);
  }
  amber_drain_opts o;
  amber_drain_opts_init(&o);
  o.rank = 1;
  CHECK_OK(
      amber_drain_run(mem, dur, &o)); /* drains rank 1's step 7, keeps step 6's chain */
  /* step 7 fails: rank 1 moves back to 6 */
  snprintf(to, sizeof to, "%s/rank-00001/%s", mem, names[0]);
  CHECK(unlink(to) == 0);
  amber__err e;
  amber_store *st = NULL;
  snprintf(to, sizeof to, "%s/rank-00001", mem);
  CHECK_OK(amber_store_open(&st, to, NULL));
  amber_ckpt_info *info = NULL;
  size_t n = 0;
  CHECK_OK(amber_store_list(st, &info, &n));
  for (size_t i = 0; i < n; i++)
    if (info[i].step == 6) CHECK_OK(amber__write_latest(st, &e, 6, info[i].hash));
  amber_free(info);
  amber_store_close(st);
  g_check(mem, 6);
  jb.first = jb.last = 7; /* and the job goes on from there */
  g_run(&jb, 2);
  g_check(mem, 7);
}

/* Two hosts: A holds GLOBAL, the manifests and rank 0; B rank 1. */
static void test_two_hosts_drain_in_either_order(void) {
  char mem[2048], dur[2048], hostb[2100], from[2200], to[2200];
  paths(mem, dur, sizeof mem);
  gjob jb = {.path = mem, .first = 1, .last = 5, .full_every = 2, .fail_rank = -1};
  g_run(&jb, 2);
  snprintf(hostb, sizeof hostb, "%s.b", mem);
  mkdir(hostb, 0755);
  snprintf(from, sizeof from, "%s/rank-00001", mem);
  snprintf(to, sizeof to, "%s/rank-00001", hostb);
  CHECK(rename(from, to) == 0);
  /* A first: rank 1's files are in neither tier it can see */
  CHECK_RC(amber_drain_run(mem, dur, NULL), AMBER_ENOENT);
  const char *msg = amber_last_error(NULL);
  CHECK(strstr(msg, "rank 1") && strstr(msg, "rank-00001/ckpt-") &&
        strstr(msg, "drain the memory"));
  uint64_t steps[64];
  CHECK(g_steps(dur, steps, 64) == 0); /* no GLOBAL without rank 1's files */
  /* B, then A */
  CHECK_OK(amber_drain_run(hostb, dur, NULL));
  CHECK(g_steps(dur, steps, 64) == 0);
  CHECK_OK(amber_drain_run(mem, dur, NULL));
  CHECK(g_steps(dur, steps, 64) == 5);
  for (uint64_t s = 1; s <= 5; s++)
    g_check(dur, s);
  /* B's own drain again: A's GLOBAL lets it keep only the newest chain */
  CHECK_OK(amber_drain_run(hostb, dur, NULL));
  check_only_newest_chain(to, 5);
  char r0[2200];
  snprintf(r0, sizeof r0, "%s/rank-00000", mem);
  check_only_newest_chain(r0, 5);
}

int main(void) {
  TEST_RUN(test_drain_run_of_every_rank_makes_each_global_step_durable);
  TEST_RUN(test_a_drain_per_rank_beside_the_global_writer);
  TEST_RUN(test_idle_rank_drains_follow_the_durable_global);
  TEST_RUN(test_a_failed_global_step_breaks_neither_tier);
  TEST_RUN(test_a_rank_ahead_of_global_keeps_what_global_needs);
  TEST_RUN(test_two_hosts_drain_in_either_order);
  return tu_finish();
}

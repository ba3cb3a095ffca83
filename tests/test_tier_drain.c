/*
 * test_tier_drain.c - the drain of a single-rank memory tier to its durable tier
 * (src/drain.c, docs/DESIGN.md "Storage tiers"): every committed step becomes
 * durable in commit order and restores bit-identically there; the memory tier keeps
 * only what is not durable and what its newest step needs, while its writer goes on;
 * a drain resumes what an earlier one left; kick's back-pressure honours the lag
 * bounds; the budget asks for a full checkpoint, and refuses one that cannot fit; a
 * full durable disk is a sticky error that loses nothing; the TIERS file records the
 * durable tier and breaks no reader.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include "testutil.h"
#include "tier.h"
#include "tier_job.h"

static int has_file(const char *dir, uint64_t step) {
  char p[4400];
  struct stat sb;
  snprintf(p, sizeof p, "%s/ckpt-%020llu.amber", dir, (unsigned long long)step);
  return stat(p, &sb) == 0;
}

static void paths(char *mem, char *dur, size_t len) {
  const char *t = tu_tmpdir();
  snprintf(mem, len, "%s/mem", t);
  snprintf(dur, len, "%s/durable", t);
}

/* full_every 4: steps 1 (full), 2..4, 5 (full), ... 9 (full), 10. */
static void test_drain_run_makes_every_committed_step_durable_and_identical(void) {
  char mem[2048], dur[2048];
  paths(mem, dur, sizeof mem);
  job j;
  job_open(&j, mem, 4);
  for (uint64_t s = 1; s <= 10; s++)
    job_save(&j, s, 0);
  job_close(&j);
  CHECK_OK(amber_drain_run(mem, dur, NULL));
  uint64_t steps[MAXSTEP];
  size_t n = steps_of(dur, steps);
  CHECK(n == 10);
  for (size_t i = 0; i < n; i++)
    CHECK(steps[i] == i + 1);
  for (uint64_t s = 1; s <= 10; s++)
    check_step(dur, s);
  /* The memory tier keeps the chain of its newest step (6 full, 7..10), no more. */
  check_only_newest_chain(mem, 10);
  CHECK(steps_of(mem, steps) == 5);
  check_step(mem, 10);
  /* TIERS records the durable tier (an absolute path). */
  char *rec = NULL;
  CHECK_OK(amber_tier_durable(mem, &rec));
  char *abs = realpath(dur, NULL);
  CHECK(rec && abs && !strcmp(rec, abs));
  amber_free(rec);
  free(abs);
  /* A second run has nothing to do and changes nothing. */
  CHECK_OK(amber_drain_run(mem, NULL, NULL));
  CHECK(steps_of(dur, steps) == 10);
}

static void test_background_drain_follows_commits_and_flush_waits_for_them(void) {
  char mem[2048], dur[2048];
  paths(mem, dur, sizeof mem);
  job j;
  job_open(&j, mem, 5);
  amber_drain *d = NULL;
  CHECK_OK(amber_drain_start(&d, mem, dur, NULL));
  for (uint64_t s = 1; s <= 12; s++) {
    job_save(&j, s, 0);
    CHECK_OK(amber_drain_kick(d));
  }
  CHECK_OK(amber_drain_flush(d, 30));
  amber_drain_status ds;
  CHECK_OK(amber_drain_get_status(d, &ds));
  CHECK(ds.memory_step == 12 && ds.durable_step == 12);
  CHECK(ds.lag_steps == 0 && ds.lag_bytes == 0);
  CHECK(ds.drained_files == 12 && ds.drained_bytes > 0 && ds.error == 0);
  for (uint64_t s = 1; s <= 12; s++)
    check_step(dur, s);
  /* the writer's store: only the chain of 12 remains (7 full, 8..12), and the writer
   * goes on */
  check_only_newest_chain(mem, 12);
  job_save(&j, 13, 0);
  CHECK_OK(amber_drain_kick(d));
  CHECK_OK(amber_drain_flush(d, 30));
  check_step(dur, 13);
  check_step(mem, 13);
  CHECK_OK(amber_drain_close(d));
  job_close(&j);
}

/* The drain's files appear in commit order: a watcher sees LATEST only move up, and
 * every step it names restores there at that moment (its chain is whole). */
typedef struct watch {
  const char *dur;
  atomic_int stop;
  int bad, seen;
} watch;

static void *watcher(void *arg) {
  watch *w = arg;
  uint64_t last = 0;
  while (!atomic_load(&w->stop)) {
    amber_store_opts so;
    amber_store_opts_init(&so);
    so.flags = AMBER_OPEN_READONLY;
    amber_store *st = NULL;
    uint64_t latest;
    if (amber_store_open(&st, w->dur, &so) == 0 && amber_store_latest(st, &latest) == 0) {
      if (latest < last) w->bad++;
      if (latest != last) {
        amber_reader *r = NULL;
        if (amber_reader_open(&r, st, latest, NULL) != 0 || amber_reader_verify(r) != 0)
          w->bad++;
        amber_reader_close(r);
        w->seen++;
      }
      last = latest;
    }
    amber_store_close(st);
  }
  return NULL;
}

static void test_steps_become_durable_in_commit_order_pointer_last(void) {
  char mem[2048], dur[2048];
  paths(mem, dur, sizeof mem);
  job j;
  job_open(&j, mem, 3);
  for (uint64_t s = 1; s <= 15; s++)
    job_save(&j, s, 0);
  watch w = {.dur = dur};
  mkdir(dur, 0755);
  pthread_t th;
  pthread_create(&th, NULL, watcher, &w);
  amber__tier_inject(3000, -1, 0); /* slow puts: the watcher sees the steps one by one */
  CHECK_OK(amber_drain_run(mem, dur, NULL));
  amber__tier_inject(0, -1, 0);
  atomic_store(&w.stop, 1);
  pthread_join(th, NULL);
  CHECK(w.bad == 0);
  CHECK(w.seen >= 5);
  printf("     the watcher saw %d of 15 steps appear, each whole\n", w.seen);
  job_close(&j);
}

static void test_a_drain_resumes_what_an_earlier_one_left(void) {
  char mem[2048], dur[2048], p[4300];
  paths(mem, dur, sizeof mem);
  job j;
  job_open(&j, mem, 4);
  for (uint64_t s = 1; s <= 8; s++)
    job_save(&j, s, 0);
  /* The first drain fails after 5 puts (3 files with their pointers): 1, 2 durable. */
  amber__tier_inject(0, 5, EIO);
  CHECK_RC(amber_drain_run(mem, dur, NULL), AMBER_EIO);
  amber__tier_inject(0, -1, 0);
  uint64_t steps[MAXSTEP];
  CHECK(steps_of(dur, steps) == 2);
  CHECK(has_file(dur, 3)); /* whole, but no pointer names it yet */
  /* What a crash leaves: a temporary file. */
  snprintf(p, sizeof p, "%s/ckpt-00000000000000000004.amber.0123456789abcdef.tmp", dur);
  CHECK(tu_write_file(p, "x", 1) == 0);
  amber_drain *d = NULL;
  CHECK_OK(amber_drain_start(&d, mem, dur, NULL));
  CHECK_OK(amber_drain_flush(d, 30));
  amber_drain_status ds;
  CHECK_OK(amber_drain_get_status(d, &ds));
  CHECK(ds.drained_files == 5); /* 3 was not copied again */
  CHECK_OK(amber_drain_close(d));
  CHECK(access(p, F_OK) != 0);
  CHECK(steps_of(dur, steps) == 8);
  for (uint64_t s = 1; s <= 8; s++)
    check_step(dur, s);
  job_close(&j);
}

/* Runs `steps` saves with kicks under `o`, the drain slowed down; returns the
 * largest lag (in steps and bytes) that a kick returned with. */
static void lag_run(const amber_drain_opts *o, uint64_t *max_steps, uint64_t *max_bytes) {
  char mem[2048], dur[2048];
  paths(mem, dur, sizeof mem);
  job j;
  job_open(&j, mem, 100);
  amber_drain *d = NULL;
  *max_steps = *max_bytes = 0;
  amber__tier_inject(20000, -1, 0);
  CHECK_OK(amber_drain_start(&d, mem, dur, o));
  for (uint64_t s = 1; s <= 10; s++) {
    job_save(&j, s, 0);
    CHECK_OK(amber_drain_kick(d));
    amber_drain_status ds;
    CHECK_OK(amber_drain_get_status(d, &ds));
    if (ds.lag_steps > *max_steps) *max_steps = ds.lag_steps;
    if (ds.lag_bytes > *max_bytes) *max_bytes = ds.lag_bytes;
  }
  amber__tier_inject(0, -1, 0);
  CHECK_OK(amber_drain_flush(d, 60));
  CHECK_OK(amber_drain_close(d));
  job_close(&j);
  for (uint64_t s = 1; s <= 10; s++)
    check_step(dur, s);
  tu_rm_rf(mem);
  tu_rm_rf(dur);
}

static void test_kick_holds_the_lag_within_its_bounds(void) {
  amber_drain_opts o;
  amber_drain_opts_init(&o);
  uint64_t free_steps, free_bytes, st, sb;
  lag_run(&o, &free_steps, &free_bytes); /* no bound: the drain falls behind */
  o.max_lag_steps = 2;
  lag_run(&o, &st, &sb);
  printf("     lag without a bound: %llu steps, %llu bytes; with max_lag_steps 2: %llu\n",
         (unsigned long long)free_steps, (unsigned long long)free_bytes,
         (unsigned long long)st);
  CHECK(free_steps > 2); /* else the bound below proves nothing */
  CHECK(st <= 2);
  amber_drain_opts_init(&o);
  o.max_lag_bytes = free_bytes / 3;
  lag_run(&o, &st, &sb);
  CHECK(sb <= o.max_lag_bytes);
}

static void test_budget_asks_for_a_full_then_shrinks(void) {
  char mem[2048], dur[2048];
  paths(mem, dur, sizeof mem);
  job j;
  job_open(&j, mem, 100);
  job_save(&j, 1, 0); /* the full */
  amber_ckpt_info *info = NULL;
  size_t n = 0;
  CHECK_OK(amber_store_list(j.st, &info, &n));
  uint64_t full = n ? info[0].bytes : 0;
  amber_free(info);
  amber_drain_opts o;
  amber_drain_opts_init(&o);
  o.memory_budget = full + full / 2;
  amber_drain *d = NULL;
  CHECK_OK(amber_drain_start(&d, mem, dur, &o));
  uint64_t s = 1;
  while (!amber_drain_wants_full(d) && s < 40) {
    job_save(&j, ++s, 0);
    CHECK_OK(amber_drain_kick(d));
  }
  CHECK(amber_drain_wants_full(d) == 1);
  amber_drain_status ds;
  CHECK_OK(amber_drain_get_status(d, &ds));
  CHECK(ds.memory_bytes > o.memory_budget && ds.wants_full == 1);
  printf("     over the budget after %llu deltas; the next save is full\n",
         (unsigned long long)(s - 1));
  job_save(&j, ++s, AMBER_SAVE_FULL);
  CHECK_OK(amber_drain_kick(d)); /* waits until the old chain is durable and removed */
  CHECK(amber_drain_wants_full(d) == 0);
  CHECK_OK(amber_drain_get_status(d, &ds));
  CHECK(ds.memory_bytes <= o.memory_budget);
  CHECK_OK(amber_drain_flush(d, 30));
  CHECK_OK(amber_drain_close(d)); /* after the unit in progress, its retention too */
  uint64_t steps[MAXSTEP];
  CHECK(steps_of(mem, steps) == 1 && steps[0] == s);
  for (uint64_t k = 1; k <= s; k++)
    check_step(dur, k);
  job_close(&j);
}

static void test_a_budget_smaller_than_a_full_is_a_clear_sticky_error(void) {
  char mem[2048], dur[2048];
  paths(mem, dur, sizeof mem);
  job j;
  job_open(&j, mem, 100);
  amber_drain_opts o;
  amber_drain_opts_init(&o);
  o.memory_budget = 10000; /* a full of this state takes about 80 kB */
  amber_drain *d = NULL;
  CHECK_OK(amber_drain_start(&d, mem, dur, &o));
  job_save(&j, 1, 0);
  CHECK_RC(amber_drain_kick(d), AMBER_ENOSPC);
  const char *msg = amber_last_error(d);
  CHECK(strstr(msg, "cannot hold one full checkpoint") && strstr(msg, "10000 bytes"));
  CHECK(strstr(amber_last_error(NULL), "cannot hold one full checkpoint") != NULL);
  job_save(&j, 2, 0);
  CHECK_RC(amber_drain_kick(d), AMBER_ENOSPC); /* sticky */
  CHECK_RC(amber_drain_flush(d, 5), AMBER_ENOSPC);
  CHECK_RC(amber_drain_close(d), AMBER_ENOSPC);
  CHECK_OK(amber_drain_run(mem, dur, NULL)); /* the drain itself went on, and goes on */
  check_step(dur, 2);
  job_close(&j);
}

/* A full durable disk: a sticky AMBER_ENOSPC naming the durable file; the durable
 * tier keeps its committed steps, the memory tier everything not yet durable; with
 * room again, a drain finishes. A real small tmpfs where the test may mount one,
 * else the destination's injected failure. */
static void test_a_full_durable_disk_is_a_sticky_error_that_loses_nothing(void) {
  char mem[2048], dur[2048];
  paths(mem, dur, sizeof mem);
  mkdir(dur, 0755);
  int mounted = mount("tmpfs", dur, "tmpfs", 0, "size=300k") == 0;
  if (!mounted)
    printf("     (cannot mount tmpfs: %s; the failure is injected)\n", strerror(errno));
  job j;
  job_open(&j, mem, 3); /* fulls of ~80 kB every third step */
  amber_drain *d = NULL;
  CHECK_OK(amber_drain_start(&d, mem, dur, NULL));
  if (!mounted) amber__tier_inject(0, 8, ENOSPC);
  int rc = 0;
  uint64_t s = 0;
  while (rc == 0 && s < 30) {
    job_save(&j, ++s, 0);
    rc = amber_drain_kick(d);
    if (!rc) rc = amber_drain_flush(d, 30);
  }
  CHECK_RC(rc, AMBER_ENOSPC);
  const char *msg = amber_last_error(d);
  CHECK(strstr(msg, dur) && strstr(msg, "ckpt-") && strstr(msg, "amber drain"));
  printf("     %s\n", msg);
  job_save(&j, ++s, 0); /* the writer goes on; the memory tier holds the steps */
  CHECK_RC(amber_drain_kick(d), AMBER_ENOSPC);
  CHECK_RC(amber_drain_close(d), AMBER_ENOSPC);
  uint64_t steps[MAXSTEP], msteps[MAXSTEP];
  size_t nd = steps_of(dur, steps), nm = steps_of(mem, msteps);
  CHECK(nd >= 1 && nm >= 1);
  for (size_t i = 0; i < nd; i++)
    check_step(dur, steps[i]);
  /* every step is in one tier or the other, and each of the memory's restores */
  for (uint64_t k = 1; k <= s; k++) {
    int in = 0;
    for (size_t i = 0; i < nd; i++)
      in |= steps[i] == k;
    for (size_t i = 0; i < nm; i++)
      in |= msteps[i] == k;
    CHECK(in);
  }
  for (size_t i = 0; i < nm; i++)
    check_step(mem, msteps[i]);
  if (mounted)
    CHECK(mount("tmpfs", dur, "tmpfs", MS_REMOUNT, "size=8m") == 0);
  else
    amber__tier_inject(0, -1, 0);
  CHECK_OK(amber_drain_run(mem, NULL, NULL));
  CHECK(steps_of(dur, steps) == s);
  for (uint64_t k = 1; k <= s; k++)
    check_step(dur, k);
  job_close(&j);
  if (mounted) umount2(dur, MNT_DETACH);
}

/* A memory file damaged after its commit fails the drain at that step, naming the
 * file, and never becomes durable: the durable tier stops at the step before. */
static void test_a_damaged_memory_file_never_becomes_durable(void) {
  char mem[2048], dur[2048], p[4400];
  paths(mem, dur, sizeof mem);
  job j;
  job_open(&j, mem, 100);
  for (uint64_t s = 1; s <= 4; s++)
    job_save(&j, s, 0);
  job_close(&j);
  snprintf(p, sizeof p, "%s/ckpt-00000000000000000003.amber", mem);
  CHECK(tu_flip_byte(p, 100, 0x04) ==
        0); /* a payload byte: only its chunk's checksum sees it */
  CHECK_RC(amber_drain_run(mem, dur, NULL), AMBER_ECORRUPT);
  CHECK(strstr(amber_last_error(NULL), "ckpt-00000000000000000003.amber") &&
        strstr(amber_last_error(NULL), "checksum"));
  uint64_t steps[MAXSTEP];
  CHECK(steps_of(dur, steps) == 2);
  CHECK(!has_file(dur, 3));
  CHECK(has_file(mem, 3) &&
        has_file(mem, 1)); /* the memory tier keeps what is not durable */
}

/* A store being installed in the memory tier (a restore copying a chain there from a
 * peer or the durable tier: its files first, LATEST last) holds files but no LATEST
 * for a while. A drain that looks at it then finds nothing committed to move; it
 * must not take it for a damaged store (a sticky error that failed the job's close
 * while the restore was in progress). */
static void test_a_store_being_installed_is_not_damage(void) {
  char mem[2048], dur[2048], latest[4400], aside[4400];
  paths(mem, dur, sizeof mem);
  job j;
  job_open(&j, mem, 100);
  for (uint64_t s = 1; s <= 3; s++)
    job_save(&j, s, 0);
  job_close(&j);
  snprintf(latest, sizeof latest, "%s/LATEST", mem);
  snprintf(aside, sizeof aside, "%s/../LATEST.aside", mem);
  CHECK(rename(latest, aside) == 0); /* the install has written the files only */
  amber_drain *d = NULL;
  CHECK_OK(amber_drain_start(&d, mem, dur, NULL));
  CHECK_OK(amber_drain_kick(d));
  CHECK_OK(amber_drain_flush(d, 30));
  amber_drain_status ds;
  CHECK_OK(amber_drain_get_status(d, &ds));
  CHECK(ds.error == 0 && ds.durable_step == AMBER_NO_STEP);
  uint64_t steps[MAXSTEP];
  CHECK(steps_of(dur, steps) == 0);
  CHECK(has_file(mem, 1) && has_file(mem, 3)); /* nothing removed */
  CHECK(rename(aside, latest) == 0); /* the install completes */
  CHECK_OK(amber_drain_kick(d));
  CHECK_OK(amber_drain_flush(d, 30));
  CHECK(steps_of(dur, steps) == 3);
  check_step(dur, 3);
  CHECK_OK(amber_drain_close(d));
}

static void test_drain_refuses_what_it_must(void) {
  char mem[2048], dur[2048], p[4300];
  paths(mem, dur, sizeof mem);
  job j;
  job_open(&j, mem, 4);
  job_save(&j, 1, 0);
  amber_drain *a = NULL, *b = NULL;
  CHECK_OK(amber_drain_start(&a, mem, dur, NULL));
  CHECK_RC(amber_drain_start(&b, mem, dur, NULL),
           AMBER_ELOCKED); /* one drain per store */
  CHECK(strstr(amber_last_error(NULL), ".lock") != NULL);
  CHECK_RC(amber_drain_run(mem, dur, NULL), AMBER_ELOCKED);
  CHECK_OK(amber_drain_close(a));
  amber_drain_opts o;
  amber_drain_opts_init(&o);
  o.flags = AMBER_DRAIN_IMAGE << 1; /* an unknown flag */
  CHECK_RC(amber_drain_start(&b, mem, dur, &o), AMBER_EINVAL);
  amber_drain_opts_init(&o);
  o.rank = 0; /* a rank of a single-rank store */
  CHECK_RC(amber_drain_start(&b, mem, dur, &o), AMBER_EINVAL);
  /* a durable tier of the other layout */
  char other[2048];
  snprintf(other, sizeof other, "%s/other", tu_tmpdir());
  mkdir(other, 0755);
  snprintf(p, sizeof p, "%s/GLOBAL", other);
  CHECK(tu_write_file(p, "x", 1) == 0);
  CHECK_RC(amber_drain_run(mem, other, NULL), AMBER_EINVAL);
  CHECK(strstr(amber_last_error(NULL), "multi-rank") != NULL);
  CHECK_RC(amber_drain_run(mem, mem, NULL), AMBER_EINVAL); /* one directory: never */
  CHECK(strstr(amber_last_error(NULL), "one directory") != NULL);
  uint64_t steps[MAXSTEP];
  CHECK(steps_of(mem, steps) == 1);
  /* no memory tier; a memory tier that records none */
  snprintf(p, sizeof p, "%s/none", tu_tmpdir());
  CHECK_RC(amber_drain_run(p, dur, NULL), AMBER_ENOENT);
  CHECK_RC(amber_drain_run(p, NULL, NULL), AMBER_ENOENT);
  CHECK(strstr(amber_last_error(NULL), "no TIERS file") != NULL);
  job_close(&j);
}

static void test_tiers_file_is_read_strictly_and_breaks_no_reader(void) {
  char mem[2048], dur[2048], p[4300];
  paths(mem, dur, sizeof mem);
  job j;
  job_open(&j, mem, 4);
  for (uint64_t s = 1; s <= 3; s++)
    job_save(&j, s, 0);
  CHECK_OK(amber_drain_run(mem, dur, NULL));
  /* the memory tier reads, lists and verifies as any store, TIERS or not */
  check_step(mem, 3);
  job_save(&j, 4, 0); /* its writer saves on */
  job_close(&j);
  job_open(&j, mem, 4); /* and a writer opens it again (its clean-up leaves TIERS) */
  job_close(&j);
  snprintf(p, sizeof p, "%s/TIERS", mem);
  CHECK(access(p, F_OK) == 0);
  static const struct {
    const char *text;
    int rc;
  } cases[] = {
      {"{\"amber.tiers\": 1, \"durable\": \"/a/\\\"b\\u0001\"}", 0},
      {"{\"durable\":\"/"
       "x\",\"amber.tiers\":1,\"later\":{\"k\":[1,2,{\"a\":null}]},\"t\":true}",
       0},
      {"{\"amber.tiers\": 2, \"durable\": \"/x\"}", AMBER_EFORMAT},
      {"{\"amber.tiers\": 1}", AMBER_ECORRUPT},
      {"{\"amber.tiers\": 1, \"durable\": \"\"}", AMBER_ECORRUPT},
      {"{\"amber.tiers\": 1, \"durable\": \"/x\"", AMBER_ECORRUPT},
      {"{\"amber.tiers\": 1, \"durable\": \"/x\"} x", AMBER_ECORRUPT},
      {"[1]", AMBER_ECORRUPT},
      {"{\"amber.tiers\": 1, \"durable\": \"/x\\u00e9\"}", AMBER_ECORRUPT},
      {"", AMBER_ECORRUPT},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    CHECK(tu_write_file(p, cases[i].text, strlen(cases[i].text)) == 0);
    char *rec = NULL;
    int rc = amber_tier_durable(mem, &rec);
    if (rc != cases[i].rc) fprintf(stderr, "  case %zu: %d\n", i, rc);
    CHECK(rc == cases[i].rc);
    if (i == 0) CHECK(rec && !strcmp(rec, "/a/\"b\x01"));
    if (i == 1) CHECK(rec && !strcmp(rec, "/x"));
    amber_free(rec);
  }
  /* the writer's own file round-trips any path */
  amber__err e;
  const char *odd = "/tmp/a \"quoted\"\\ path\twith\nlines";
  CHECK_OK(amber__tiers_write(&e, mem, odd));
  char *rec = NULL;
  CHECK_OK(amber_tier_durable(mem, &rec));
  CHECK(rec && !strcmp(rec, odd));
  amber_free(rec);
}

int main(void) {
  TEST_RUN(test_drain_run_makes_every_committed_step_durable_and_identical);
  TEST_RUN(test_background_drain_follows_commits_and_flush_waits_for_them);
  TEST_RUN(test_steps_become_durable_in_commit_order_pointer_last);
  TEST_RUN(test_a_drain_resumes_what_an_earlier_one_left);
  TEST_RUN(test_kick_holds_the_lag_within_its_bounds);
  TEST_RUN(test_budget_asks_for_a_full_then_shrinks);
  TEST_RUN(test_a_budget_smaller_than_a_full_is_a_clear_sticky_error);
  TEST_RUN(test_a_full_durable_disk_is_a_sticky_error_that_loses_nothing);
  TEST_RUN(test_a_damaged_memory_file_never_becomes_durable);
  TEST_RUN(test_a_store_being_installed_is_not_damage);
  TEST_RUN(test_drain_refuses_what_it_must);
  TEST_RUN(test_tiers_file_is_read_strictly_and_breaks_no_reader);
  return tu_finish();
}

/*
 * test_commit.c - Guarantee 3: a SIGKILL at any instant of a save leaves the store
 * restorable to the last committed checkpoint, and an uncommitted checkpoint is
 * never visible. A child process saves checkpoints of about 2.5 MB (steps 1, 2,
 * 3, ..., every byte derived from the step) in a loop until the parent kills it
 * after a random, seeded delay of 0-300 ms. The parent then checks the store
 * read-only (LATEST names a step whose restore is exactly that step's data and
 * verifies; no listed step is newer) and through a writable open, which must
 * remove every *.tmp file and every checkpoint file newer than LATEST; the next
 * child continues in the same store. This runs once with full checkpoints and
 * once with deltas (exact policy, the writer's cadence), where a new child must
 * also rebuild its reference state from what the killed one committed.
 * AMBER_KILL_ITERS (default 40 full, half as many delta) and AMBER_KILL_SEED change
 * the number of kills and the delays. Further tests plant leftovers by hand (a
 * stale ckpt-*.amber.tmp, LATEST.tmp, a complete checkpoint newer than LATEST) and
 * check that a read-only store never shows them and that the next writable open
 * removes them and nothing else: never a checkpoint when LATEST is missing or
 * damaged.
 */
#include <dirent.h>
#include <inttypes.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"

typedef struct {
  const char *name;
  int dtype;
  uint32_t ndim;
  int64_t shape[2];
} spec;

static const spec specs[] = {
    {"model.weight", AMBER_F32, 2, {512, 1024}},
    {"optim.exp_avg", AMBER_BF16, 1, {262144}},
    {"rng.state", AMBER_U8, 1, {5000}},
    {"step", AMBER_I64, 0, {0}},
};
#define NSPEC (sizeof specs / sizeof specs[0])

static size_t nbytes_of(size_t i) {
  size_t n = amber_dtype_size(specs[i].dtype);
  for (uint32_t d = 0; d < specs[i].ndim; d++) n *= (size_t)specs[i].shape[d];
  return n;
}

/* The state of `step`: fixed random bytes of which 300 elements, chosen and set
 * by a generator seeded with the step, differ (so that deltas are small), and the
 * step itself. */
static void fill(size_t i, uint64_t step, uint8_t *buf) {
  size_t w = amber_dtype_size(specs[i].dtype), n = nbytes_of(i) / w;
  if (specs[i].ndim == 0) {
    int64_t s = (int64_t)step;
    memcpy(buf, &s, 8);
    return;
  }
  tu_fill_random(buf, nbytes_of(i), 1000 + i);
  uint64_t g = step * 7919 + i;
  for (int j = 0; j < 300; j++) {
    size_t at = (size_t)(tu_rand(&g) % n);
    uint64_t v = tu_rand(&g);
    memcpy(buf + at * w, &v, w);
  }
}

static int meta_of(uint64_t step, char *buf, size_t cap) {
  return snprintf(buf, cap, "{\"step\": %" PRIu64 ", \"lr\": 0.0003}", step);
}

/* A writer with every tensor declared; data[] receive the buffers. */
static amber_writer *open_writer(amber_store *st, uint8_t *data[NSPEC]) {
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.chunk_elems = 1 << 16;
  amber_writer *w = NULL;
  if (amber_writer_open(&w, st, &wo) != 0) return NULL;
  for (size_t i = 0; i < NSPEC; i++) {
    data[i] = malloc(nbytes_of(i));
    if (!data[i] || amber_writer_add(w, specs[i].name, specs[i].dtype, specs[i].ndim,
                                     specs[i].shape, data[i], NULL) != 0) {
      amber_writer_close(w);
      return NULL;
    }
  }
  return w;
}

static int save_step(amber_writer *w, uint8_t *data[NSPEC], uint64_t step, uint32_t flags) {
  char meta[128];
  for (size_t i = 0; i < NSPEC; i++) fill(i, step, data[i]);
  int n = meta_of(step, meta, sizeof meta);
  int rc = amber_writer_set_meta(w, meta, (size_t)n);
  if (rc || step % 2 == 0) return rc ? rc : amber_writer_save(w, step, flags);
  /* odd steps take the split save: the save thread, the two-phase full save */
  if ((rc = amber_writer_begin(w, step, flags)) == 0 && (rc = amber_writer_fence(w)) == 0)
    rc = amber_writer_wait(w);
  return rc;
}

/* The child: saves latest+1, latest+2, ... until it is killed. Never returns. */
static void child_main(const char *dir, uint32_t flags) {
  amber_store *st = NULL;
  uint8_t *data[NSPEC] = {0};
  uint64_t step = 0;
  if (amber_store_open(&st, dir, NULL) != 0) _exit(10);
  int rc = amber_store_latest(st, &step);
  if (rc != 0 && rc != AMBER_ENOENT) _exit(11);
  amber_writer *w = open_writer(st, data);
  if (!w) _exit(12);
  for (uint64_t n = 0; n < 1000000; n++)
    if (save_step(w, data, ++step, flags) != 0) _exit(13);
  _exit(14);
}

typedef struct {
  int tmp, newer;    /* *.tmp files; checkpoint files newer than `latest` */
  uint64_t max_step; /* of any checkpoint file */
} listing;

/* What the directory holds, compared with LATEST's step `latest`. */
static listing scan(const char *dir, uint64_t latest) {
  listing l = {0, 0, 0};
  DIR *d = opendir(dir);
  struct dirent *e;
  while (d && (e = readdir(d))) {
    size_t n = strlen(e->d_name);
    uint64_t s;
    int end = 0;
    if (n > 4 && !strcmp(e->d_name + n - 4, ".tmp")) l.tmp++;
    else if (sscanf(e->d_name, "ckpt-%20" SCNu64 ".amber%n", &s, &end) == 1 && (size_t)end == n) {
      if (s > latest) l.newer++;
      if (s > l.max_step) l.max_step = s;
    }
  }
  if (d) closedir(d);
  return l;
}

/* Restores `step` (AMBER_LATEST allowed) and checks every byte, the metadata and
 * verify; `want` is the step whose data must come back. */
static void check_restore(amber_store *st, uint64_t step, uint64_t want) {
  amber_reader *r = NULL;
  CHECK_OK(amber_reader_open(&r, st, step, NULL));
  if (!r) return;
  CHECK(amber_reader_step(r) == want);
  CHECK(amber_reader_count(r) == NSPEC);
  for (size_t i = 0; i < NSPEC && i < amber_reader_count(r); i++) {
    size_t n = nbytes_of(i);
    uint8_t *got = malloc(n), *exp = malloc(n);
    fill(i, want, exp);
    CHECK_OK(amber_reader_read(r, i, got, n));
    if (memcmp(got, exp, n) != 0) {
      fprintf(stderr, "  step %" PRIu64 ": tensor %s differs from its saved data\n", want,
              specs[i].name);
      tu_failures++;
    }
    free(got);
    free(exp);
  }
  char meta[128];
  const char *m = NULL;
  size_t mlen = 0, n = (size_t)meta_of(want, meta, sizeof meta);
  CHECK_OK(amber_reader_meta(r, &m, &mlen));
  CHECK(mlen == n && m && !memcmp(m, meta, n));
  CHECK_OK(amber_reader_verify(r));
  amber_reader_close(r);
}

/* After a kill: read-only view first, then the writable open's clean-up. Returns
 * the committed step (0 when none) and counts kills that left leftovers and
 * deltas committed. */
static uint64_t check_after_kill(const char *dir, uint64_t prev, int *leftovers, int *deltas) {
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY;
  amber_store *st = NULL;
  uint64_t latest = 0;
  CHECK_OK(amber_store_open(&st, dir, &so));
  if (!st) return prev;
  int rc = amber_store_latest(st, &latest);
  if (rc == AMBER_ENOENT) {
    CHECK(prev == 0); /* nothing committed yet: only before the first commit */
    latest = 0;
    amber_reader *r = NULL; /* and nothing to see (see test_crash_in_first_commit...) */
    rc = amber_reader_open(&r, st, AMBER_LATEST, NULL);
    CHECK(rc == AMBER_ENOENT || rc == AMBER_ECORRUPT);
    amber_reader_close(r);
  } else {
    CHECK_OK(rc);
    CHECK(latest >= prev);
    amber_ckpt_info *info = NULL;
    size_t count = 0;
    CHECK_OK(amber_store_list(st, &info, &count));
    CHECK(count >= 1 && info && info[count - 1].step == latest);
    for (size_t i = 0; i < count && info; i++) *deltas += info[i].kind == AMBER_KIND_DELTA;
    amber_free(info);
    check_restore(st, AMBER_LATEST, latest);
  }
  listing before = scan(dir, latest);
  *leftovers += before.tmp > 0 || before.newer > 0;
  amber_store_close(st);

  st = NULL;
  CHECK_OK(amber_store_open(&st, dir, NULL)); /* writable: cleans up */
  listing after = scan(dir, latest);
  if (after.tmp || (latest && after.newer)) {
    fprintf(stderr, "  after a writable open: %d *.tmp, %d files newer than step %" PRIu64 "\n",
            after.tmp, after.newer, latest);
    tu_failures++;
  }
  uint64_t again = 0;
  if (latest) {
    CHECK_OK(amber_store_latest(st, &again));
    CHECK(again == latest);
    CHECK_OK(amber_store_prune(st, 1, NULL)); /* disk space; keeps what latest needs */
  }
  amber_store_close(st);
  return latest;
}

static long env_long(const char *name, long def) {
  const char *v = getenv(name);
  return v && *v ? strtol(v, NULL, 10) : def;
}

/* Kills `iters` children that save with `flags`; checks the store after each. */
static void kill_loop(long iters, uint32_t flags) {
  const char *dir = tu_tmpdir();
  uint64_t seed0 = (uint64_t)env_long("AMBER_KILL_SEED", env_long("AMBER_SEED", 20250611));
  uint64_t seed = seed0, prev = 0;
  printf("     %ld kills, AMBER_KILL_SEED=%" PRIu64 "\n", iters, seed0);
  int leftovers = 0, deltas = 0;
  for (long it = 0; it < iters; it++) {
    useconds_t delay = (useconds_t)(tu_rand(&seed) % 300001);
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) {
      perror("fork");
      tu_failures++;
      return;
    }
    if (pid == 0) child_main(dir, flags);
    usleep(delay);
    kill(pid, SIGKILL);
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    if (!WIFSIGNALED(status) || WTERMSIG(status) != SIGKILL) {
      fprintf(stderr, "  kill %ld: the child ended by itself (status 0x%x)\n", it, status);
      tu_failures++;
    }
    uint64_t latest = check_after_kill(dir, prev, &leftovers, &deltas);
    if (tu_failures) {
      fprintf(stderr, "  kill %ld after %u us, latest step %" PRIu64 " (AMBER_KILL_SEED=%" PRIu64
              ")\n", it, (unsigned)delay, latest, seed0);
      return;
    }
    prev = latest;
  }
  printf("     %ld kills, %" PRIu64 " steps committed, %d kills left files to clean\n", iters,
         prev, leftovers);
  CHECK(iters == 0 || prev > 0); /* the child did commit, so the kills hit real saves */
  CHECK(iters == 0 || (flags & AMBER_SAVE_FULL) || deltas > 0);
}

static void test_sigkill_during_full_saves_leaves_last_commit_restorable(void) {
  kill_loop(env_long("AMBER_KILL_ITERS", 40), AMBER_SAVE_FULL);  /* make test-long: 200 */
}

static void test_sigkill_during_delta_saves_leaves_last_commit_restorable(void) {
  kill_loop(env_long("AMBER_KILL_ITERS", 40) / 2, 0);
}

static void test_planted_leftovers_are_invisible_then_removed(void) {
  const char *dir = tu_tmpdir();
  amber_store *st = NULL;
  uint8_t *data[NSPEC] = {0};
  CHECK_OK(amber_store_open(&st, dir, NULL));
  amber_writer *w = open_writer(st, data);
  CHECK(w != NULL);
  char lp[4200];
  size_t llen = 0;
  snprintf(lp, sizeof lp, "%s/LATEST", dir);
  uint8_t *latest30 = NULL;
  for (uint64_t s = 10; w && s <= 40; s += 10) {
    CHECK_OK(save_step(w, data, s, AMBER_SAVE_FULL));
    if (s == 30) latest30 = tu_read_file(lp, &llen);
  }
  amber_writer_close(w);
  amber_store_close(st);
  for (size_t i = 0; i < NSPEC; i++) free(data[i]);
  memset(data, 0, sizeof data);
  /* Step 40 is complete but uncommitted: the writer "died" before moving LATEST. */
  CHECK(latest30 && tu_write_file(lp, latest30, llen) == 0);
  free(latest30);
  char p[4200];
  snprintf(p, sizeof p, "%s/ckpt-%020d.amber.tmp", dir, 50);
  CHECK(tu_write_file(p, "half a checkpoint", 17) == 0);
  snprintf(p, sizeof p, "%s/ckpt-%020d.amber", dir, 60);
  CHECK(tu_write_file(p, "not even a checkpoint", 21) == 0);
  snprintf(p, sizeof p, "%s/LATEST.tmp", dir);
  CHECK(tu_write_file(p, "60 0000000000000000\n", 20) == 0);

  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY;
  CHECK_OK(amber_store_open(&st, dir, &so));
  if (st) {
    uint64_t latest = 0;
    CHECK_OK(amber_store_latest(st, &latest));
    CHECK(latest == 30);
    amber_ckpt_info *info = NULL;
    size_t n = 0;
    CHECK_OK(amber_store_list(st, &info, &n));
    CHECK(n == 3);
    for (size_t i = 0; i < n && info; i++) CHECK(info[i].step == 10 * (i + 1));
    amber_free(info);
    amber_reader *r = NULL;
    CHECK_RC(amber_reader_open(&r, st, 40, NULL), AMBER_ENOENT);
    CHECK_RC(amber_reader_open(&r, st, 60, NULL), AMBER_ENOENT);
    check_restore(st, AMBER_LATEST, 30);
    amber_store_close(st);
  }
  listing l = scan(dir, 30); /* a read-only store removes nothing */
  CHECK(l.tmp == 2 && l.newer == 2);

  CHECK_OK(amber_store_open(&st, dir, NULL));
  l = scan(dir, 30);
  CHECK(l.tmp == 0 && l.newer == 0 && l.max_step == 30);
  for (uint64_t s = 10; s <= 30; s += 10) check_restore(st, s, s);
  w = open_writer(st, data);
  CHECK(w != NULL);
  if (w) CHECK_OK(save_step(w, data, 40, 0)); /* step 40 is free again */
  amber_writer_close(w);
  for (size_t i = 0; i < NSPEC; i++) free(data[i]);
  check_restore(st, AMBER_LATEST, 40);
  amber_store_close(st);
}

static void test_crash_in_first_commit_leaves_an_empty_store(void) {
  /* A kill between the rename of the very first checkpoint file and the rename of
   * LATEST leaves a complete ckpt file, maybe LATEST.tmp, and no LATEST. Nothing
   * was committed: the store must read as empty (not damaged, or a restarted run
   * could not start), show nothing, and take the same step again. */
  const char *dir = tu_tmpdir();
  amber_store *st = NULL;
  uint8_t *data[NSPEC] = {0};
  CHECK_OK(amber_store_open(&st, dir, NULL));
  amber_writer *w = open_writer(st, data);
  if (w) CHECK_OK(save_step(w, data, 1, AMBER_SAVE_FULL));
  amber_writer_close(w);
  amber_store_close(st);
  for (size_t i = 0; i < NSPEC; i++) free(data[i]);
  memset(data, 0, sizeof data);
  char p[4200], q[4200];
  snprintf(p, sizeof p, "%s/LATEST", dir);
  snprintf(q, sizeof q, "%s/LATEST.tmp", dir);
  CHECK(rename(p, q) == 0);
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY;
  uint64_t latest = 0;
  amber_ckpt_info *info = NULL;
  size_t n = 0;
  amber_reader *r = NULL;
  CHECK_OK(amber_store_open(&st, dir, &so));
  CHECK_RC(amber_store_latest(st, &latest), AMBER_ENOENT);
  CHECK_OK(amber_store_list(st, &info, &n));
  CHECK(n == 0);
  amber_free(info);
  int rc = amber_reader_open(&r, st, AMBER_LATEST, NULL);
  CHECK(rc == AMBER_ENOENT || rc == AMBER_ECORRUPT); /* FORMAT.md: "damaged" */
  amber_store_close(st);
  CHECK_OK(amber_store_open(&st, dir, NULL)); /* what the restarted run does: */
  if (st && amber_store_latest(st, &latest) == AMBER_ENOENT) latest = 0;
  CHECK(latest == 0);
  w = st ? open_writer(st, data) : NULL;
  CHECK(w != NULL);
  if (w) CHECK_OK(save_step(w, data, latest + 1, AMBER_SAVE_FULL));
  amber_writer_close(w);
  for (size_t i = 0; i < NSPEC; i++) free(data[i]);
  if (st) check_restore(st, AMBER_LATEST, 1);
  amber_store_close(st);
}

/* A store of full checkpoints 10, 20, 30; returns its directory. */
static const char *store_10_20_30(void) {
  const char *dir = tu_tmpdir();
  amber_store *st = NULL;
  uint8_t *data[NSPEC] = {0};
  CHECK_OK(amber_store_open(&st, dir, NULL));
  amber_writer *w = open_writer(st, data);
  CHECK(w != NULL);
  for (uint64_t s = 10; w && s <= 30; s += 10) CHECK_OK(save_step(w, data, s, AMBER_SAVE_FULL));
  amber_writer_close(w);
  amber_store_close(st);
  for (size_t i = 0; i < NSPEC; i++) free(data[i]);
  return dir;
}

static int has_10_20_30(const char *dir) {
  char p[4200];
  int all = 1;
  for (uint64_t s = 10; s <= 30; s += 10) {
    snprintf(p, sizeof p, "%s/ckpt-%020" PRIu64 ".amber", dir, s);
    all = all && access(p, F_OK) == 0;
  }
  return all;
}

static void test_store_that_lost_latest_keeps_its_checkpoints(void) {
  /* Three checkpoint files and no LATEST: no crash leaves this (a crash can leave
   * at most the first file uncommitted), LATEST was lost. The files are a damaged
   * store's data: neither a writable open nor a writer that saves a step there
   * may make them disappear. */
  const char *dir = store_10_20_30();
  char p[4200];
  snprintf(p, sizeof p, "%s/LATEST", dir);
  CHECK(unlink(p) == 0);
  amber_store *st = NULL;
  amber_writer *w = NULL;
  uint8_t *data[NSPEC] = {0};
  if (amber_store_open(&st, dir, NULL) == 0 && (w = open_writer(st, data)) != NULL)
    save_step(w, data, 1, 0); /* may be refused; either way nothing may be lost */
  amber_writer_close(w);
  amber_store_close(st);
  for (size_t i = 0; i < NSPEC; i++) free(data[i]);
  st = NULL;
  if (amber_store_open(&st, dir, NULL) == 0) amber_store_close(st);
  CHECK(has_10_20_30(dir));
}

static void test_damaged_latest_never_makes_a_writable_open_delete_checkpoints(void) {
  /* A file newer than LATEST is stale only when LATEST itself checks out: here it
   * names step 20 with step 30's state id (one flipped bit: '3' -> '2'). */
  const char *dir = store_10_20_30();
  char p[4200];
  size_t n = 0;
  snprintf(p, sizeof p, "%s/LATEST", dir);
  uint8_t *line = tu_read_file(p, &n);
  CHECK(line && n == 20 && line[0] == '3');
  if (line) line[0] = '2';
  CHECK(line && tu_write_file(p, line, n) == 0);
  free(line);
  amber_store *st = NULL;
  if (amber_store_open(&st, dir, NULL) == 0) amber_store_close(st);
  CHECK(has_10_20_30(dir));
}

int main(void) {
  TEST_RUN(test_planted_leftovers_are_invisible_then_removed);
  TEST_RUN(test_crash_in_first_commit_leaves_an_empty_store);
  TEST_RUN(test_store_that_lost_latest_keeps_its_checkpoints);
  TEST_RUN(test_damaged_latest_never_makes_a_writable_open_delete_checkpoints);
  TEST_RUN(test_sigkill_during_full_saves_leaves_last_commit_restorable);
  TEST_RUN(test_sigkill_during_delta_saves_leaves_last_commit_restorable);
  return tu_finish();
}

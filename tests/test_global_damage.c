/*
 * test_global_damage.c - a multi-rank store that is damaged, or in use, in the
 * ways an outside probe found (issue 30), with ranks as threads
 * (tests/comm_threads.h): a store without GLOBAL is refused by readers, writers
 * and the CLI, and keeps every rank's files.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "amber.h"
#include "comm_threads.h"
#include "global.h"
#include "testutil.h"

#define ROWS 16
#define COLS 8

static float wval(int64_t i, int64_t j, uint64_t step) {
  return (float)(i * COLS + j) + 1000.0f * (float)step;
}

/* Rank r's rows of "w" when `n` ranks split it. */
static void rows(int r, int n, int64_t *off, int64_t *shape) {
  off[0] = ROWS * r / n, off[1] = 0;
  shape[0] = ROWS * (r + 1) / n - off[0], shape[1] = COLS;
}

typedef struct job {
  const char *path;
  uint64_t first, last;
  uint32_t full_every; /* 0: the default */
  int expect_open;     /* what amber_global_writer_open must return */
  const char *open_msg; /* and a part of its message */
} job;

static void rank_main(const amber_comm *c, void *arg) {
  const job *jb = arg;
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.full_every = jb->full_every;
  wo.full_share = -1;
  amber_global_writer *gw = NULL;
  int rc = amber_global_writer_open(&gw, jb->path, c, &wo);
  RCHECK(rc == jb->expect_open);
  if (rc < 0) {
    RCHECK(!jb->open_msg || strstr(amber_last_error(NULL), jb->open_msg));
    if (c->rank == 0) fprintf(stderr, "  (expected) %s\n", amber_last_error(NULL));
    return;
  }
  int64_t g[2] = {ROWS, COLS}, off[2], sh[2];
  rows(c->rank, c->size, off, sh);
  float w[ROWS * COLS], b = 0.5f;
  RCHECK(amber_global_writer_add(gw, "w", AMBER_F32, 2, g, off, sh, w, 0) == 0);
  int64_t one = 1;
  RCHECK(amber_global_writer_add(gw, "b", AMBER_F32, 1, &one, NULL, NULL, &b,
                                 AMBER_SHARD_REPLICATED) == 0);
  for (uint64_t s = jb->first; s <= jb->last; s++) {
    for (int64_t i = 0; i < sh[0]; i++)
      for (int64_t j = 0; j < COLS; j++) w[i * COLS + j] = wval(off[0] + i, j, s);
    b = (float)s;
    RCHECK(amber_global_writer_save(gw, s, 0) == 0);
  }
  amber_global_writer_close(gw);
}

static void run(const char *path, int n, uint64_t first, uint64_t last, int expect_open,
                const char *open_msg) {
  job jb = {path, first, last, 0, expect_open, open_msg};
  atomic_store(&rank_fails, 0);
  tc_run(n, rank_main, &jb);
  CHECK(atomic_load(&rank_fails) == 0);
}

/* Reads all of "w" of `step` (whatever shape the manifest gives it) and checks it
 * against the values saved at `want`: < 0 when the read fails, 1 when it succeeds
 * with other values (the caller's buffer holds -1 where nothing was written). */
static int read_w(const char *path, uint64_t step, uint64_t want) {
  amber_global_reader *g = NULL;
  int rc = amber_global_reader_open(&g, path, step);
  float got[ROWS * COLS];
  for (size_t i = 0; i < ROWS * COLS; i++) got[i] = -1.0f;
  int64_t o[2] = {0, 0};
  size_t wi = 0;
  amber_global_tensor t;
  if (rc == 0) rc = amber_global_reader_find(g, "w", &wi);
  if (rc == 0) rc = amber_global_reader_tensor(g, wi, &t);
  if (rc == 0 && t.shape[0] * t.shape[1] != ROWS * COLS) rc = 1;
  if (rc == 0) rc = amber_global_reader_read(g, wi, o, t.shape, got, sizeof got);
  if (rc == 0)
    for (int64_t i = 0; i < ROWS * COLS; i++)
      if (got[i] != wval(i / COLS, i % COLS, want)) {
        fprintf(stderr, "  w[%lld] = %g after a read that succeeded, saved %g\n", (long long)i,
                (double)got[i], (double)wval(i / COLS, i % COLS, want));
        rc = 1;
        break;
      }
  if (rc < 0) fprintf(stderr, "  (read of step %llu) %s\n", (unsigned long long)step,
                      g ? amber_last_error(g) : amber_last_error(NULL));
  amber_global_reader_close(g);
  return rc;
}

static size_t count_files(const char *path, int rank) {
  char dir[4200];
  snprintf(dir, sizeof dir, "%s/rank-%05d", path, rank);
  return (size_t)tu_system("exit $(ls %s | grep -c '^ckpt-.*\\.amber$')", dir);
}

/* The CLI on `path`: exit status of `amber ARGS`, its output in *out (malloc'd). */
static int cli(const char *path, const char *args, char **out) {
  char f[4200];
  snprintf(f, sizeof f, "%s.cli-out", path);
  int rc = tu_system("%s %s %s > %s 2>&1", AMBER_CLI, args, path, f);
  size_t len;
  *out = (char *)tu_read_file(f, &len);
  if (*out) {
    char *t = realloc(*out, len + 1);
    if (t) t[len] = 0, *out = t;
  }
  return rc;
}

static int cli_says(const char *path, const char *args, int want_ok, const char *needle) {
  char *out = NULL;
  int rc = cli(path, args, &out);
  int ok = (rc == 0) == want_ok && out && (!needle || strstr(out, needle));
  if (!ok) fprintf(stderr, "  amber %s %s: exit %d:\n%s\n", args, path, rc, out ? out : "");
  free(out);
  return ok;
}

/* ---- a store without GLOBAL ---- */

static void test_store_without_global_is_refused_everywhere_and_keeps_its_files(void) {
  const char *p = tu_tmpdir();
  run(p, 2, 1, 6, 0, NULL);
  char global[4200], saved[4200];
  snprintf(global, sizeof global, "%s/GLOBAL", p);
  snprintf(saved, sizeof saved, "%s/GLOBAL.saved", tu_tmpdir());
  CHECK(rename(global, saved) == 0);
  amber_global_step_info *gs = NULL;
  size_t n = 0;
  CHECK_RC(amber_global_list(p, &gs, &n), AMBER_ECORRUPT);
  CHECK(strstr(amber_last_error(NULL), "GLOBAL is missing") != NULL);
  amber_free(gs);
  amber_global_reader *g = NULL;
  CHECK_RC(amber_global_reader_open(&g, p, AMBER_LATEST), AMBER_ECORRUPT);
  CHECK_RC(amber_global_reader_open(&g, p, 3), AMBER_ECORRUPT);
  /* the next writer refuses on every rank, and removes nothing */
  run(p, 2, 7, 7, AMBER_ECORRUPT, "GLOBAL is missing");
  CHECK(count_files(p, 0) == 6 && count_files(p, 1) == 6);
  CHECK(cli_says(p, "ls", 0, "GLOBAL is missing"));
  CHECK(cli_says(p, "verify", 0, "GLOBAL is missing"));
  char args[4300];
  snprintf(args, sizeof args, "export -o %s/x.safetensors", tu_tmpdir());
  CHECK(cli_says(p, args, 0, "GLOBAL is missing"));
  /* GLOBAL back: everything is there */
  CHECK(rename(saved, global) == 0);
  CHECK(read_w(p, AMBER_LATEST, 6) == 0);
  CHECK(read_w(p, 2, 2) == 0);
}

/* What a crash in the first global commit leaves (one manifest, one file per rank,
 * no GLOBAL) is still an empty store: listed as such, and the next writer starts
 * afresh. */
static void test_first_commit_crash_without_global_is_an_empty_store(void) {
  const char *p = tu_tmpdir();
  run(p, 2, 5, 5, 0, NULL);
  char global[4200];
  snprintf(global, sizeof global, "%s/GLOBAL", p);
  CHECK(unlink(global) == 0);
  amber_global_step_info *gs = NULL;
  size_t n = 9;
  CHECK_OK(amber_global_list(p, &gs, &n));
  CHECK(n == 0);
  amber_free(gs);
  amber_global_reader *g = NULL;
  CHECK_RC(amber_global_reader_open(&g, p, AMBER_LATEST), AMBER_ENOENT);
  run(p, 2, 1, 2, 0, NULL);
  CHECK(read_w(p, AMBER_LATEST, 2) == 0);
  CHECK(count_files(p, 0) == 2 && count_files(p, 1) == 2);
}

int main(void) {
  alarm(300); /* a rank stuck in a collective must not hang the suite */
  TEST_RUN(test_store_without_global_is_refused_everywhere_and_keeps_its_files);
  TEST_RUN(test_first_commit_crash_without_global_is_an_empty_store);
  return tu_finish();
}

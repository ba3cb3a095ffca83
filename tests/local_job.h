/*
 * local_job.h - a job of thread ranks (tests/comm_threads.h) whose global writer runs
 * in local mode (AMBER_WRITER_GLOBAL_LOCAL): each rank's path is the directory of
 * its simulated host, which no other host's rank reads. Each rank holds its rows of
 * "w" (ROWS x COLS, f32; a few elements change per step, so later steps are deltas)
 * and rank 0 the replicated "b". lj_check_rank reads one rank's rows (and, where
 * asked, "b") back from a directory and compares them bit for bit.
 */
#ifndef AMBER_LOCAL_JOB_H
#define AMBER_LOCAL_JOB_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "amber.h"
#include "comm_threads.h"
#include "testutil.h"

#define LJ_ROWS 32
#define LJ_COLS 1024
#define LJ_BIAS 5

/* about 1% of the elements change per step: a delta is a small share of a full */
static inline float lj_w(int64_t i, int64_t j, uint64_t step) {
  int64_t k = i * LJ_COLS + j;
  return (float)k * 0.25f + ((k % 97) == (int64_t)(step % 97) ? (float)step * 1.5f : 0.0f);
}
static inline float lj_b(int64_t i, uint64_t step) {
  return (float)i + 0.125f * (float)step;
}

/* Rank r's rows of "w" among n ranks. */
static inline void lj_rows(int r, int n, int64_t *off, int64_t *shape) {
  off[0] = LJ_ROWS * r / n, off[1] = 0;
  shape[0] = LJ_ROWS * (r + 1) / n - off[0], shape[1] = LJ_COLS;
}

typedef struct lj_job {
  const char *dir[64];  /* each rank's path (its host's directory) */
  int shared;           /* one path seen by every rank (no local mode): a durable tier */
  uint64_t first, last; /* steps saved */
  uint64_t keep_last;
  /* a rank whose save of one step is made to fail by a blocked name: the manifest's
   * in its path (block_manifest) */
  int block_rank;
  uint64_t block_step;
  int open_rc[64];      /* each rank's result of the open */
  char open_msg[64][512];
  int save_rc[64];      /* each rank's result of the blocked step's save */
  char save_msg[64][512];
  /* called by each rank after each committed step, and once before its writer
   * closes (NULL: none) */
  void (*after)(const amber_comm *c, struct lj_job *jb, uint64_t step);
  void (*done)(const amber_comm *c, struct lj_job *jb);
  void *user;
} lj_job;

static inline void lj_manifest_name(const char *dir, uint64_t step, char *buf, size_t len) {
  snprintf(buf, len, "%.4000s/step-%020llu.manifest", dir, (unsigned long long)step);
}

static void lj_rank(const amber_comm *c, void *arg) {
  lj_job *jb = arg;
  amber_global_writer *gw = NULL;
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.flags = jb->shared ? 0 : AMBER_WRITER_GLOBAL_LOCAL;
  wo.keep_last = jb->keep_last;
  wo.full_share = -1; /* deltas whatever their size: the tests pin chains */
  int rc = amber_global_writer_open(&gw, jb->dir[c->rank], c, &wo);
  jb->open_rc[c->rank] = rc;
  snprintf(jb->open_msg[c->rank], sizeof jb->open_msg[0], "%s", amber_last_error(NULL));
  if (rc < 0) return;
  int64_t g[2] = {LJ_ROWS, LJ_COLS}, off[2], sh[2], bs[1] = {LJ_BIAS};
  lj_rows(c->rank, c->size, off, sh);
  float *w = malloc((size_t)(sh[0] * sh[1]) * sizeof *w + 1), b[LJ_BIAS];
  RCHECK(amber_global_writer_add(gw, "w", AMBER_F32, 2, g, off, sh, w, 0) == 0);
  RCHECK(amber_global_writer_add(gw, "b", AMBER_F32, 1, bs, NULL, NULL, b,
                                 AMBER_SHARD_REPLICATED) == 0);
  char blocked[4300];
  lj_manifest_name(jb->dir[c->rank], jb->block_step, blocked, sizeof blocked);
  for (uint64_t s = jb->first; s <= jb->last; s++) {
    for (int64_t i = 0; i < sh[0]; i++)
      for (int64_t j = 0; j < LJ_COLS; j++) w[i * LJ_COLS + j] = lj_w(off[0] + i, j, s);
    for (int i = 0; i < LJ_BIAS; i++) b[i] = lj_b(i, s);
    int blocking = jb->block_step == s && jb->block_rank >= 0;
    if (blocking && c->rank == jb->block_rank) RCHECK(mkdir(blocked, 0755) == 0);
    c->barrier(c->ctx);
    if (s % 2) {
      rc = amber_global_writer_save(gw, s, 0);
    } else {
      rc = amber_global_writer_begin(gw, s, 0);
      RCHECK(amber_global_writer_fence(gw) == 0);
      if (rc == 0) rc = amber_global_writer_wait(gw);
    }
    if (blocking) {
      jb->save_rc[c->rank] = rc;
      snprintf(jb->save_msg[c->rank], sizeof jb->save_msg[0], "%s", amber_last_error(gw));
      c->barrier(c->ctx);
      if (c->rank == jb->block_rank) rmdir(blocked);
      c->barrier(c->ctx);
      continue;
    }
    RCHECK(rc == 0);
    if (rc == 0 && jb->after) jb->after(c, jb, s);
  }
  if (jb->done) jb->done(c, jb);
  amber_global_writer_close(gw);
  free(w);
}

/* Runs the job on n ranks; every rank's open and saves must succeed unless
 * `expect_open_fail`. */
static inline void lj_run(lj_job *jb, int n) {
  atomic_store(&rank_fails, 0);
  tc_run(n, lj_rank, jb);
  CHECK(atomic_load(&rank_fails) == 0);
}

static inline lj_job lj_job_init(void) {
  lj_job jb;
  memset(&jb, 0, sizeof jb);
  jb.block_rank = -1;
  return jb;
}

/* Reads rank r's rows of "w" (of n ranks) at `step` from directory `dir` and checks
 * them bit for bit against the values of `want`; with `bias`, also "b". Returns
 * the reader's open or read failure (0 when every read succeeded). */
static inline int lj_check_rank(const char *dir, uint64_t step, uint64_t want, int r, int n,
                                int bias) {
  amber_global_reader *g;
  int rc = amber_global_reader_open(&g, dir, step);
  if (rc < 0) return rc;
  size_t wi = 0, bi = 0;
  CHECK_OK(amber_global_reader_find(g, "w", &wi));
  CHECK_OK(amber_global_reader_find(g, "b", &bi));
  int64_t off[2], sh[2];
  lj_rows(r, n, off, sh);
  size_t cnt = (size_t)(sh[0] * sh[1]);
  float *got = malloc(cnt * sizeof *got + 1), *exp = malloc(cnt * sizeof *exp + 1);
  for (int64_t i = 0; i < sh[0]; i++)
    for (int64_t j = 0; j < LJ_COLS; j++) exp[i * LJ_COLS + j] = lj_w(off[0] + i, j, want);
  rc = amber_global_reader_read(g, wi, off, sh, got, cnt * sizeof *got);
  if (rc == 0) CHECK(memcmp(got, exp, cnt * sizeof *got) == 0);
  if (rc == 0 && bias) {
    float b[LJ_BIAS], e[LJ_BIAS];
    int64_t o = 0, s = LJ_BIAS;
    for (int i = 0; i < LJ_BIAS; i++) e[i] = lj_b(i, want);
    rc = amber_global_reader_read(g, bi, &o, &s, b, sizeof b);
    if (rc == 0) CHECK(memcmp(b, e, sizeof b) == 0);
  }
  free(got), free(exp);
  amber_global_reader_close(g);
  return rc;
}

#endif /* AMBER_LOCAL_JOB_H */

/*
 * tier_job.h - what the storage-tier tests share: a single-rank job (one tensor of
 * N floats, a few elements changed per step, so that steps are deltas between
 * fulls) whose state at every step is kept to check restores bit for bit; and a
 * multi-rank job (ranks as threads, tests/comm_threads.h) whose values are a
 * function of the step, with an optional drain per rank beside its writer.
 */
#ifndef AMBER_TIER_JOB_H
#define AMBER_TIER_JOB_H

#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "comm_threads.h"
#include "testutil.h"

/* ---- one rank ---- */

#define N 20000
#define MAXSTEP 64

/* the live state saved at each step */
__attribute__((unused)) static float states[MAXSTEP + 1][N];

typedef struct job {
  amber_store *st;
  amber_writer *w;
  float live[N];
  uint64_t seed;
} job;

static inline void job_open(job *j, const char *dir, uint32_t full_every) {
  memset(j, 0, sizeof *j);
  CHECK_OK(amber_store_open(&j->st, dir, NULL));
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.chunk_elems = 4096;
  wo.full_every = full_every;
  wo.full_share = -1;
  CHECK_OK(amber_writer_open(&j->w, j->st, &wo));
  int64_t n = N;
  j->seed = 7;
  for (int i = 0; i < N; i++)
    j->live[i] = (float)(tu_rand(&j->seed) % 1000) / 7.0f;
  CHECK_OK(amber_writer_add(j->w, "x", AMBER_F32, 1, &n, j->live, NULL));
}

/* Saves step s (a few elements change, so it is a delta unless `flags` says full). */
static inline void job_save(job *j, uint64_t s, uint32_t flags) {
  for (int k = 0; k < 200; k++)
    j->live[tu_rand(&j->seed) % N] += 1.0f;
  memcpy(states[s], j->live, sizeof j->live);
  CHECK_OK(amber_writer_save(j->w, s, flags));
}

static inline void job_close(job *j) {
  amber_writer_close(j->w);
  amber_store_close(j->st);
}

/* Step s of store `dir` restores to states[s] and verifies. */
static inline void check_step(const char *dir, uint64_t s) {
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY;
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, dir, &so));
  amber_reader *r = NULL;
  CHECK_OK(amber_reader_open(&r, st, s, NULL));
  if (r) {
    static float got[N];
    CHECK_OK(amber_reader_read(r, 0, got, sizeof got));
    CHECK(memcmp(got, states[s], sizeof got) == 0);
    CHECK_OK(amber_reader_verify(r));
  }
  amber_reader_close(r);
  amber_store_close(st);
}

/* The committed steps of `dir` into steps[] (at most MAXSTEP); returns their count. */
static inline size_t steps_of(const char *dir, uint64_t *steps) {
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY;
  amber_store *st = NULL;
  amber_ckpt_info *info = NULL;
  size_t n = 0;
  if (amber_store_open(&st, dir, &so) == 0) amber_store_list(st, &info, &n);
  for (size_t i = 0; i < n && i < MAXSTEP; i++)
    steps[i] = info[i].step;
  amber_free(info);
  amber_store_close(st);
  return n;
}

/* The memory tier holds the chain of its newest step, no more: its steps are the
 * newest full one and the deltas after it. */
/* What a drain that was killed or failed leaves visible, a single-rank store's: the
 * durable tier `dur` (a directory or an s3:// store) holds steps 1..L in commit
 * order, each restoring whole there, and every step up to `last` is in one tier or
 * the other (nothing committed is lost). `restore_memory`: the memory tier's steps
 * restore too. Returns L. */
static inline size_t check_visible(const char *mem, const char *dur, uint64_t last,
                                   int restore_memory) {
  uint64_t ds[MAXSTEP], ms[MAXSTEP];
  size_t nd = steps_of(dur, ds), nm = steps_of(mem, ms);
  for (size_t i = 0; i < nd; i++) {
    CHECK(ds[i] == i + 1); /* commit order: a prefix */
    check_step(dur, ds[i]);
  }
  for (size_t i = 0; restore_memory && i < nm; i++)
    check_step(mem, ms[i]);
  for (uint64_t k = 1; k <= last; k++) {
    int in = k <= nd;
    for (size_t i = 0; i < nm; i++)
      in |= ms[i] == k;
    CHECK(in);
  }
  return nd;
}

static inline void check_only_newest_chain(const char *dir, uint64_t newest) {
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY;
  amber_store *st = NULL;
  amber_ckpt_info *info = NULL;
  size_t n = 0;
  CHECK_OK(amber_store_open(&st, dir, &so));
  CHECK_OK(amber_store_list(st, &info, &n));
  CHECK(n >= 1 && info[0].kind == AMBER_KIND_FULL && info[n - 1].step == newest);
  for (size_t i = 1; i < n; i++)
    CHECK(info[i].kind == AMBER_KIND_DELTA && info[i].parent == info[i - 1].step);
  amber_free(info);
  amber_store_close(st);
}

/* ---- many ranks ---- */

#define G_ROWS 12
#define G_COLS 10
#define G_BIAS 5

static inline float g_wval(int64_t i, int64_t j, uint64_t step) {
  int64_t k = i * G_COLS + j;
  return (float)k * 0.125f + ((k % 7) == (int64_t)(step % 7) ? (float)step : 0.0f);
}

static inline float g_bval(int64_t i, uint64_t step) {
  return (float)i - 0.5f * (float)step;
}

/* Rank r of n holds rows [G_ROWS*r/n, G_ROWS*(r+1)/n) of "w"; "b" is replicated. */
static inline void g_part(int r, int n, int64_t *off, int64_t *shape) {
  int64_t a = G_ROWS * r / n, b = G_ROWS * (r + 1) / n;
  off[0] = a, off[1] = 0, shape[0] = b - a, shape[1] = G_COLS;
}

typedef struct gjob {
  const char *path; /* the store (the memory tier) */
  uint64_t first, last;
  uint32_t full_every;
  int fail_rank; /* -1: none; else its save of fail_step fails */
  uint64_t fail_step;
  uint32_t flags;      /* of every save (AMBER_SAVE_FULL) */
  const char *durable; /* with each rank's drain (rank mode) beside its writer */
  amber_drain_opts dopts;
  useconds_t linger_us; /* how long the drains stay open after their flush */
  atomic_int drain_errors;
} gjob;

static inline void g_block(const char *path, int rank, uint64_t step, int on) {
  char p[4200];
  snprintf(p, sizeof p, "%s/rank-%05d/ckpt-%020llu.amber", path, rank,
           (unsigned long long)step);
  if (on)
    mkdir(p, 0755);
  else
    rmdir(p);
}

static inline void g_rank_main(const amber_comm *c, void *arg) {
  gjob *jb = arg;
  amber_drain *d = NULL;
  if (jb->durable) {
    amber_drain_opts o = jb->dopts;
    o.rank = c->rank;
    RCHECK(amber_drain_start(&d, jb->path, jb->durable, &o) == 0);
  }
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.full_every = jb->full_every;
  wo.full_share = -1;
  amber_global_writer *gw = NULL;
  RCHECK(amber_global_writer_open(&gw, jb->path, c, &wo) == 0);
  if (!gw) return;
  int64_t gshape[2] = {G_ROWS, G_COLS}, off[2], shape[2], bshape[1] = {G_BIAS};
  g_part(c->rank, c->size, off, shape);
  float *w = malloc((size_t)(shape[0] * shape[1]) * sizeof *w + 1), b[G_BIAS];
  RCHECK(amber_global_writer_add(gw, "w", AMBER_F32, 2, gshape, off, shape, w, 0) == 0);
  RCHECK(amber_global_writer_add(gw, "b", AMBER_F32, 1, bshape, NULL, NULL, b,
                                 AMBER_SHARD_REPLICATED) == 0);
  for (uint64_t s = jb->first; s <= jb->last; s++) {
    for (int64_t i = 0; i < shape[0]; i++)
      for (int64_t j = 0; j < G_COLS; j++)
        w[i * G_COLS + j] = g_wval(off[0] + i, j, s);
    for (int i = 0; i < G_BIAS; i++)
      b[i] = g_bval(i, s);
    int failing = jb->fail_rank >= 0 && jb->fail_step == s;
    if (failing && c->rank == jb->fail_rank) g_block(jb->path, c->rank, s, 1);
    c->barrier(c->ctx);
    int rc = amber_global_writer_save(gw, s, jb->flags);
    RCHECK(failing ? rc < 0 : rc == 0);
    c->barrier(c->ctx);
    if (failing && c->rank == jb->fail_rank) g_block(jb->path, c->rank, s, 0);
    if (d && amber_drain_kick(d) != 0) atomic_fetch_add(&jb->drain_errors, 1);
  }
  amber_global_writer_close(gw);
  free(w);
  if (d) {
    c->barrier(c->ctx); /* every rank committed all: flush waits for all of it */
    if (amber_drain_flush(d, 60) != 0) {
      fprintf(stderr, "rank %d: %s\n", c->rank, amber_last_error(NULL));
      atomic_fetch_add(&jb->drain_errors, 1);
    }
    c->barrier(c->ctx);
    usleep(jb->linger_us);
    if (amber_drain_close(d) != 0) atomic_fetch_add(&jb->drain_errors, 1);
  }
}

static inline void g_run(gjob *jb, int n) {
  atomic_store(&rank_fails, 0);
  tc_run(n, g_rank_main, jb);
  CHECK(atomic_load(&rank_fails) == 0);
  CHECK(atomic_load(&jb->drain_errors) == 0);
}

/* Global step `step` of `path` reads back exactly as written, and verifies. */
static inline void g_check(const char *path, uint64_t step) {
  amber_global_reader *g = NULL;
  CHECK_OK(amber_global_reader_open(&g, path, step));
  if (!g) return;
  size_t wi, bi;
  CHECK_OK(amber_global_reader_find(g, "w", &wi));
  CHECK_OK(amber_global_reader_find(g, "b", &bi));
  float w[G_ROWS * G_COLS], b[G_BIAS], want[G_ROWS * G_COLS];
  int64_t off[2] = {0, 0}, shape[2] = {G_ROWS, G_COLS}, bo = 0, bs = G_BIAS;
  CHECK_OK(amber_global_reader_read(g, wi, off, shape, w, sizeof w));
  CHECK_OK(amber_global_reader_read(g, bi, &bo, &bs, b, sizeof b));
  for (int64_t i = 0; i < G_ROWS; i++)
    for (int64_t j = 0; j < G_COLS; j++)
      want[i * G_COLS + j] = g_wval(i, j, step);
  CHECK(memcmp(w, want, sizeof w) == 0);
  for (int i = 0; i < G_BIAS; i++)
    CHECK(b[i] == g_bval(i, step));
  CHECK_OK(amber_global_reader_verify(g));
  amber_global_reader_close(g);
}

/* The committed global steps of `path` into steps[] (at most cap); their count. */
static inline size_t g_steps(const char *path, uint64_t *steps, size_t cap) {
  amber_global_step_info *info = NULL;
  size_t n = 0;
  if (amber_global_list(path, &info, &n) != 0) n = 0;
  for (size_t i = 0; i < n && i < cap; i++)
    steps[i] = info[i].step;
  amber_free(info);
  return n;
}

#endif /* AMBER_TIER_JOB_H */

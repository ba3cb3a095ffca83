/*
 * test_global_presel.c - pre-selected tensors in a global step (src/global.c:
 * amber_global_writer_add_preselected, _plan, _info, _set_selection), with ranks
 * as threads (tests/comm_threads.h). Each rank plays a device that keeps its own
 * reference of its shard and hands over only what it selects: the step restores
 * what was selected, full and delta, at 2 ranks; the planned kind is the same on
 * every rank, even when only one rank asks for a full step or only one rank's
 * writer cannot make a delta; wrong use gets an error that says what to do.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "amber.h"
#include "comm_threads.h"
#include "format.h"
#include "store.h"
#include "testutil.h"


#define ROWS 12
#define COLS 10
#define BIAS 7
#define CHUNK 16 /* elements: a rank's shard of "w" spans several chunks */

/* Global element (i, j) of "w" at a step: a few elements change per step, some by
 * less than the test's threshold. */
static float wval(int64_t i, int64_t j, uint64_t step) {
  int64_t k = i * COLS + j;
  float v = (float)k * 0.125f;
  if ((k % 5) == (int64_t)(step % 5)) v += (float)step;
  if ((k % 7) == (int64_t)(step % 7)) v += 0.01f * (float)step;
  return v;
}

/* One rank's "device": a tensor's live values, the reference it keeps of them (what
 * a restore of the latest committed step gives) and its selection buffers. */
typedef struct dev {
  float *live, *ref, *vals;
  uint32_t *idx;
  amber_chunk_sel *sels;
  size_t n;
  atomic_int asked; /* chunks its source answered (job.source) */
} dev;

static void dev_init(dev *d, size_t n) {
  d->n = n;
  d->live = calloc(n + 1, sizeof *d->live);
  d->ref = calloc(n + 1, sizeof *d->ref);
  d->vals = calloc(n + 1, sizeof *d->vals);
  d->idx = calloc(n + 1, sizeof *d->idx);
  d->sels = calloc(n + 1, sizeof *d->sels);
}

static void dev_free(dev *d) {
  free(d->live), free(d->ref), free(d->vals), free(d->idx), free(d->sels);
}

/* Selects tensor `index` for the planned save (every chunk whole for a full one;
 * else the elements that changed by more than `thr`, bitwise for 0), moves the
 * reference by what is selected and hands the selection to the global writer. */
static int dev_hand_over(amber_global_writer *gw, size_t index, dev *d, int full, float thr,
                         int by_source) {
  amber_tensor_info info;
  int rc = amber_global_writer_info(gw, index, &info);
  if (rc < 0) return rc;
  size_t k = 0;
  for (uint64_t j = 0; j < info.nchunks; j++) {
    size_t lo = (size_t)(j * info.chunk_elems), hi = lo + (size_t)info.chunk_elems;
    if (hi > d->n) hi = d->n;
    if (full) {
      d->sels[j] = (amber_chunk_sel){.count = AMBER_SELECT_WHOLE, .vals = d->live + lo};
      memcpy(d->ref + lo, d->live + lo, (hi - lo) * sizeof *d->ref);
      continue;
    }
    size_t start = k;
    for (size_t i = lo; i < hi; i++) {
      int moved = memcmp(&d->live[i], &d->ref[i], sizeof(float)) != 0;
      if (moved && (thr == 0 || fabsf(d->live[i] - d->ref[i]) > thr)) {
        d->idx[k] = (uint32_t)(i - lo), d->vals[k++] = d->live[i];
        d->ref[i] = d->live[i];
      }
    }
    d->sels[j] = (amber_chunk_sel){.count = k - start, .idx = d->idx + start, .vals = d->vals + start};
  }
  if (by_source) return 0; /* its source answers from d->sels */
  return amber_global_writer_set_selection(gw, index, d->sels, info.nchunks);
}

/* The source of tensor "w" (index 0) when job.source: chunk j of its selection. */
static int dev_source(void *user, int worker, size_t index, uint64_t j, amber_chunk_sel *sel) {
  dev *d = user;
  (void)worker;
  if (index != 0) return AMBER_EINVAL;
  *sel = d->sels[j];
  atomic_fetch_add(&d->asked, 1);
  return 0;
}

/* Reads box (off, shape) of `name` at `step` and compares it with `want`. */
static int box_is(const char *path, uint64_t step, const char *name, const int64_t *off,
                  const int64_t *shape, const float *want, size_t n) {
  amber_global_reader *g;
  if (amber_global_reader_open(&g, path, step) < 0) return 0;
  size_t ti;
  float *got = calloc(n + 1, sizeof *got);
  int ok = got && amber_global_reader_find(g, name, &ti) == 0 &&
           amber_global_reader_read(g, ti, off, shape, got, n * sizeof *got) == 0 &&
           memcmp(got, want, n * sizeof *got) == 0;
  free(got);
  amber_global_reader_close(g);
  return ok;
}

typedef struct job {
  const char *path;
  uint64_t first, last; /* steps to save */
  float thr;            /* the device's selection: 0 exact, else a threshold */
  uint32_t full_every;
  uint32_t kinds[2][16]; /* what plan said, by rank and step */
  int lossy[2];          /* a rank's reference ended apart from its live values */
  int source;            /* "w" through amber_global_writer_set_source, set before any plan */
} job;

/* Rank r holds rows [r*ROWS/2, (r+1)*ROWS/2) of "w" (pre-selected), "b" (replicated,
 * pre-selected: rank 0 writes it) and "c" (a plain host tensor, sharded as "w"). */
static void presel_main(const amber_comm *c, void *arg) {
  job *jb = arg;
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.chunk_elems = CHUNK;
  wo.full_every = jb->full_every;
  wo.full_share = -1; /* deltas whatever their size: the test pins the kinds */
  amber_global_writer *gw;
  RCHECK(amber_global_writer_open(&gw, jb->path, c, &wo) == 0);
  if (!gw) return;
  int64_t gshape[2] = {ROWS, COLS}, off[2] = {c->rank * ROWS / 2, 0},
          shape[2] = {ROWS / 2, COLS}, bn = BIAS;
  size_t n = (size_t)(shape[0] * shape[1]);
  dev w, b;
  dev_init(&w, n), dev_init(&b, BIAS);
  float *cpu = calloc(n, sizeof *cpu);
  RCHECK(amber_global_writer_add_preselected(gw, "w", AMBER_F32, 2, gshape, off, shape, 0) == 0);
  RCHECK(amber_global_writer_add_preselected(gw, "b", AMBER_F32, 1, &bn, NULL, NULL,
                                             AMBER_SHARD_REPLICATED) == 0);
  RCHECK(amber_global_writer_add(gw, "c", AMBER_F32, 2, gshape, off, shape, cpu, 0) == 0);
  if (jb->source) {
    RCHECK(amber_global_writer_set_source(gw, 0, dev_source, &w) == 0);
    RCHECK(amber_global_writer_set_source(gw, 2, dev_source, &w) == AMBER_EINVAL);
    RCHECK(amber_global_writer_set_source(gw, 3, dev_source, &w) == AMBER_ERANGE);
  }
  for (uint64_t s = jb->first; s <= jb->last; s++) {
    for (int64_t i = 0; i < shape[0]; i++)
      for (int64_t j = 0; j < COLS; j++)
        w.live[i * COLS + j] = wval(off[0] + i, j, s), cpu[i * COLS + j] = -wval(off[0] + i, j, s);
    for (int i = 0; i < BIAS; i++) b.live[i] = (float)i - 0.5f * (float)(s % 3);
    uint32_t kind = 99;
    RCHECK(amber_global_writer_plan(gw, s, AMBER_SAVE_CONFIRM, &kind) == 0);
    jb->kinds[c->rank][s] = kind;
    int full = kind == AMBER_KIND_FULL;
    RCHECK(dev_hand_over(gw, 0, &w, full, jb->thr, jb->source) == 0);
    atomic_store(&w.asked, 0);
    if (c->rank == 0) {
      RCHECK(dev_hand_over(gw, 1, &b, full, 0, 0) == 0);
    } else { /* rank 0 writes the replicated tensor: rank 1 has nothing to hand over */
      amber_tensor_info info;
      RCHECK(amber_global_writer_info(gw, 1, &info) == AMBER_EINVAL);
      RCHECK(strstr(amber_last_error(NULL), "replicated") != NULL);
      RCHECK(amber_global_writer_set_selection(gw, 1, b.sels, 1) == AMBER_EINVAL);
    }
    RCHECK(amber_global_writer_begin(gw, s, AMBER_SAVE_CONFIRM) == 0);
    RCHECK(amber_global_writer_set_selection(gw, 0, w.sels, 1) == AMBER_EBUSY);
    RCHECK(amber_global_writer_fence(gw) == 0);
    RCHECK(amber_global_writer_confirm(gw, 1, NULL) == 0);
    RCHECK(amber_global_writer_wait(gw) == 0);
    RCHECK(atomic_load(&w.asked) == (jb->source ? (int)((n + CHUNK - 1) / CHUNK) : 0));
    /* the step restores what this rank selected: its reference, not its live values */
    RCHECK(box_is(jb->path, s, "w", off, shape, w.ref, n));
    RCHECK(box_is(jb->path, s, "c", off, shape, cpu, n));
    if (c->rank == 0) {
      int64_t z = 0;
      RCHECK(box_is(jb->path, s, "b", &z, &bn, b.ref, BIAS));
    }
  }
  jb->lossy[c->rank] = memcmp(w.ref, w.live, n * sizeof *w.ref) != 0;
  amber_global_writer_close(gw);
  dev_free(&w), dev_free(&b);
  free(cpu);
}

static void run(job *jb) {
  atomic_store(&rank_fails, 0);
  tc_run(2, presel_main, jb);
  CHECK(atomic_load(&rank_fails) == 0);
  for (uint64_t s = jb->first; s <= jb->last; s++)
    CHECK(jb->kinds[0][s] == jb->kinds[1][s]);
}

static void test_exact_full_and_deltas_restore_what_each_rank_selected(void) {
  job jb = {tu_tmpdir(), 1, 6, 0, 4, {{0}}, {0, 0}, 0};
  run(&jb);
  /* full, three deltas, full (full_every 4 over the step), delta */
  uint32_t want[] = {0, AMBER_KIND_FULL, AMBER_KIND_DELTA, AMBER_KIND_DELTA, AMBER_KIND_DELTA,
                     AMBER_KIND_DELTA, AMBER_KIND_FULL};
  amber_global_step_info *gs = NULL;
  size_t n = 0;
  CHECK_OK(amber_global_list(jb.path, &gs, &n));
  CHECK(n == 6);
  for (size_t i = 0; i < n && i < 6; i++) {
    CHECK(jb.kinds[0][i + 1] == want[i + 1]);
    CHECK(gs[i].kind == want[i + 1]);
  }
  amber_free(gs);
  /* every step whole, restored at another world size: the whole of "w" at once */
  float all[ROWS * COLS];
  int64_t z[2] = {0, 0}, sh[2] = {ROWS, COLS};
  for (int64_t i = 0; i < ROWS * COLS; i++) all[i] = wval(i / COLS, i % COLS, 6);
  CHECK(box_is(jb.path, 6, "w", z, sh, all, ROWS * COLS));
}

static void test_threshold_selection_restores_the_references_not_the_live_values(void) {
  job jb = {tu_tmpdir(), 1, 4, 0.5f, 0, {{0}}, {0, 0}, 0};
  run(&jb);
  CHECK(jb.kinds[0][1] == AMBER_KIND_FULL && jb.kinds[0][4] == AMBER_KIND_DELTA);
  CHECK(jb.lossy[0] && jb.lossy[1]); /* some changes were below the threshold */
}

/* A source set before the first plan (before the rank writer exists) serves every
 * save, full and delta, asked once per chunk with the global index; the steps
 * restore what each rank's source answered. */
static void test_a_source_serves_every_save_from_before_the_first_plan(void) {
  job jb = {tu_tmpdir(), 1, 6, 0.5f, 3, {{0}}, {0, 0}, 1};
  run(&jb);
  CHECK(jb.kinds[0][1] == AMBER_KIND_FULL && jb.kinds[0][2] == AMBER_KIND_DELTA);
  CHECK(jb.kinds[0][5] == AMBER_KIND_FULL && jb.kinds[0][6] == AMBER_KIND_DELTA);
  CHECK(jb.lossy[0] && jb.lossy[1]);
}

/* ---- the planned kind is the same on every rank ---- */

typedef struct vote_job {
  const char *path;
  int mode; /* 0: steps 1 and 2, rank 1 asks for a full step 2; 1: step 1; 2: step 2 */
  uint32_t kind[2];
  int rc[2];
} vote_job;

/* Rank r holds half of "d" (pre-selected) and of "c" (plain). */
static void vote_main(const amber_comm *c, void *arg) {
  vote_job *vj = arg;
  amber_global_writer *gw;
  RCHECK(amber_global_writer_open(&gw, vj->path, c, NULL) == 0);
  if (!gw) return;
  int64_t n = 8, off = 8 * c->rank, gn = 16;
  dev d;
  dev_init(&d, 8);
  float cpu[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  RCHECK(amber_global_writer_add_preselected(gw, "d", AMBER_F32, 1, &gn, &off, &n, 0) == 0);
  RCHECK(amber_global_writer_add(gw, "c", AMBER_F32, 1, &gn, &off, &n, cpu, 0) == 0);
  if (vj->mode < 2) {
    uint32_t k = 99;
    RCHECK(amber_global_writer_plan(gw, 1, 0, &k) == 0 && k == AMBER_KIND_FULL);
    RCHECK(dev_hand_over(gw, 0, &d, 1, 0, 0) == 0);
    RCHECK(amber_global_writer_save(gw, 1, 0) == 0);
  }
  if (vj->mode != 1) {
    memcpy(d.ref, d.live, sizeof cpu); /* as a device that read its shard back */
    d.live[c->rank] = 42;
    uint32_t flags = c->rank == 1 && vj->mode == 0 ? AMBER_SAVE_FULL : 0;
    vj->rc[c->rank] = amber_global_writer_plan(gw, 2, flags, &vj->kind[c->rank]);
    if (vj->rc[c->rank] == 0) {
      RCHECK(dev_hand_over(gw, 0, &d, vj->kind[c->rank] == AMBER_KIND_FULL, 0, 0) == 0);
      RCHECK(amber_global_writer_save(gw, 2, flags) == 0);
    }
  }
  amber_global_writer_close(gw);
  dev_free(&d);
}

static void test_one_rank_asking_for_full_makes_the_planned_step_full_everywhere(void) {
  vote_job vj = {tu_tmpdir(), 0, {9, 9}, {1, 1}};
  atomic_store(&rank_fails, 0);
  tc_run(2, vote_main, &vj);
  CHECK(atomic_load(&rank_fails) == 0);
  CHECK(vj.rc[0] == 0 && vj.rc[1] == 0);
  CHECK(vj.kind[0] == AMBER_KIND_FULL && vj.kind[1] == AMBER_KIND_FULL);
  amber_global_step_info *gs = NULL;
  size_t n = 0;
  CHECK_OK(amber_global_list(vj.path, &gs, &n));
  CHECK(n == 2 && gs[1].kind == AMBER_KIND_FULL);
  amber_free(gs);
}

/* Damages chunk 0 of "c" in rank `rank`'s file of step 1. */
static void damage_plain_chunk(const char *path, int rank) {
  char dir[4200], f[4300];
  snprintf(dir, sizeof dir, "%s/rank-%05d", path, rank);
  snprintf(f, sizeof f, "%s/ckpt-%020d.amber", dir, 1);
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY | AMBER_OPEN_NOCREATE;
  amber_store *st;
  amber_reader *r = NULL;
  CHECK_OK(amber_store_open(&st, dir, &so));
  if (!st) return;
  CHECK_OK(amber_reader_open(&r, st, 1, NULL));
  size_t li = 0;
  long pos = 0;
  if (r && amber_reader_find(r, "c", &li) == 0) {
    const amber__index *ix = amber__reader_index(r);
    const amber__chunk *ch = &ix->chunks[ix->tensors[li].first_chunk];
    pos = (long)(ch->offset + ch->size / 2);
  }
  amber_reader_close(r);
  amber_store_close(st);
  CHECK(pos > 0 && tu_flip_byte(f, pos, 0x20) == 0);
}

/* Rank 1's writer cannot load its reference (a damaged chunk of its plain tensor):
 * alone, it would write a full part while rank 0 writes a delta; plan makes the
 * step full on both, and says so on both. */
static void test_a_rank_without_a_reference_makes_the_planned_step_full_everywhere(void) {
  const char *p = tu_tmpdir();
  vote_job one = {p, 1, {9, 9}, {1, 1}}, two = {p, 2, {9, 9}, {1, 1}};
  atomic_store(&rank_fails, 0);
  tc_run(2, vote_main, &one);
  damage_plain_chunk(p, 1);
  tc_run(2, vote_main, &two);
  CHECK(atomic_load(&rank_fails) == 0);
  CHECK(two.rc[0] == 0 && two.rc[1] == 0);
  CHECK(two.kind[0] == AMBER_KIND_FULL && two.kind[1] == AMBER_KIND_FULL);
  amber_global_step_info *gs = NULL;
  size_t n = 0;
  CHECK_OK(amber_global_list(p, &gs, &n));
  CHECK(n == 2 && gs[n - 1].kind == AMBER_KIND_FULL);
  amber_free(gs);
}

/* ---- wrong use ---- */

static void test_wrong_use_is_refused_with_what_to_do(void) {
  const char *p = tu_tmpdir();
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.chunk_elems = 4;
  amber_global_writer *gw;
  CHECK_OK(amber_global_writer_open(&gw, p, amber_comm_self(), &wo));
  if (!gw) return;
  int64_t n = 8, z = 0;
  float cpu[8] = {0}, vals[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  uint32_t idx[8] = {0, 1, 2, 3};
  CHECK_OK(amber_global_writer_add_preselected(gw, "d", AMBER_F32, 1, &n, &z, &n, 0));
  CHECK_OK(amber_global_writer_add(gw, "c", AMBER_F32, 1, &n, &z, &n, cpu, 0));
  CHECK_RC(amber_global_writer_add_preselected(gw, "d", AMBER_F32, 1, &n, &z, &n, 0),
           AMBER_EEXIST);
  CHECK_RC(amber_global_writer_add_preselected(gw, "e", AMBER_F32, 1, &n, NULL, NULL, 0),
           AMBER_EINVAL);
  amber_chunk_sel whole[2] = {{.count = AMBER_SELECT_WHOLE, .vals = vals},
                              {.count = AMBER_SELECT_WHOLE, .vals = vals + 4}};
  amber_chunk_sel some[2] = {{.count = 2, .idx = idx, .vals = vals}, {.count = 0}};
  amber_tensor_info info;
  uint32_t kind;
  /* before a plan there is no rank writer to take a selection */
  CHECK_RC(amber_global_writer_set_selection(gw, 0, whole, 2), AMBER_EINVAL);
  CHECK(strstr(amber_last_error(gw), "amber_global_writer_plan first") != NULL);
  CHECK_RC(amber_global_writer_info(gw, 0, &info), AMBER_EINVAL);
  CHECK_RC(amber_global_writer_set_data(gw, 0, cpu), AMBER_EINVAL);
  CHECK(strstr(amber_last_error(gw), "pre-selected") != NULL);
  CHECK_RC(amber_global_writer_plan(gw, 1, 0, NULL), AMBER_EINVAL);
  CHECK_RC(amber_global_writer_plan(gw, 1, 0x80, &kind), AMBER_EINVAL);
  CHECK_OK(amber_global_writer_plan(gw, 1, 0, &kind));
  CHECK(kind == AMBER_KIND_FULL);
  CHECK_RC(amber_global_writer_add(gw, "late", AMBER_F32, 1, &n, &z, &n, cpu, 0), AMBER_EINVAL);
  CHECK_OK(amber_global_writer_info(gw, 0, &info));
  CHECK(info.chunk_elems == 4 && info.nchunks == 2 && !strcmp(info.name, "d"));
  CHECK_RC(amber_global_writer_info(gw, 2, &info), AMBER_ERANGE);
  CHECK_RC(amber_global_writer_set_selection(gw, 1, whole, 2), AMBER_EINVAL);
  CHECK(strstr(amber_last_error(gw), "not pre-selected") != NULL);
  CHECK_RC(amber_global_writer_set_selection(gw, 5, whole, 2), AMBER_ERANGE);
  CHECK_RC(amber_global_writer_set_selection(gw, 0, whole, 1), AMBER_EINVAL);
  CHECK(strstr(amber_last_error(gw), "2 chunks") != NULL);
  /* a full step with a chunk that is not whole fails, on every rank, at the commit */
  CHECK_OK(amber_global_writer_set_selection(gw, 0, some, 2));
  CHECK_OK(amber_global_writer_begin(gw, 1, 0));
  CHECK_RC(amber_global_writer_set_selection(gw, 0, whole, 2), AMBER_EBUSY);
  CHECK_RC(amber_global_writer_plan(gw, 2, 0, &kind), AMBER_EBUSY);
  CHECK_RC(amber_global_writer_wait(gw), AMBER_EINVAL);
  CHECK(strstr(amber_last_error(gw), "AMBER_SELECT_WHOLE") != NULL);
  /* a pre-selected tensor without a selection fails the step */
  CHECK_OK(amber_global_writer_plan(gw, 1, 0, &kind));
  CHECK(kind == AMBER_KIND_FULL);
  CHECK_RC(amber_global_writer_save(gw, 1, 0), AMBER_EINVAL);
  CHECK(strstr(amber_last_error(gw), "has no selection") != NULL);
  /* planned and saved */
  CHECK_OK(amber_global_writer_plan(gw, 1, 0, &kind));
  CHECK_OK(amber_global_writer_set_selection(gw, 0, whole, 2));
  CHECK_OK(amber_global_writer_save(gw, 1, 0));
  CHECK_RC(amber_global_writer_plan(gw, 1, 0, &kind), AMBER_EEXIST);
  /* planned as a delta, begun as a full step: the plan does not hold, and the
   * delta's selection is refused */
  CHECK_OK(amber_global_writer_plan(gw, 2, 0, &kind));
  CHECK(kind == AMBER_KIND_DELTA);
  CHECK_OK(amber_global_writer_set_selection(gw, 0, some, 2));
  CHECK_RC(amber_global_writer_save(gw, 2, AMBER_SAVE_FULL), AMBER_EINVAL);
  /* after a failed step the next is full */
  CHECK_OK(amber_global_writer_plan(gw, 2, 0, &kind));
  CHECK(kind == AMBER_KIND_FULL);
  amber_global_writer_close(gw);
  CHECK(box_is(p, 1, "d", &z, &n, vals, 8));
}

int main(void) {
  TEST_RUN(test_exact_full_and_deltas_restore_what_each_rank_selected);
  TEST_RUN(test_threshold_selection_restores_the_references_not_the_live_values);
  TEST_RUN(test_a_source_serves_every_save_from_before_the_first_plan);
  TEST_RUN(test_one_rank_asking_for_full_makes_the_planned_step_full_everywhere);
  TEST_RUN(test_a_rank_without_a_reference_makes_the_planned_step_full_everywhere);
  TEST_RUN(test_wrong_use_is_refused_with_what_to_do);
  return tu_finish();
}

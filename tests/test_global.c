/*
 * test_global.c - many ranks in one global checkpoint (src/global.c, greader.c),
 * with ranks as threads (tests/comm_threads.h): sharded and replicated tensors
 * round-trip at 2 and 4 ranks; a failure on one rank commits nothing anywhere,
 * rolls every rank back and the next save is correct; a rank's leftovers are
 * removed by the next writer; steps load at another world size (4->1, 1->4, 4->3,
 * rows versus columns); deltas chain across ranks; a lossy policy stays within
 * its bound after resharding.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "amber.h"
#include "comm_threads.h"
#include "format.h"
#include "store.h"
#include "testutil.h"


#define ROWS 12
#define COLS 10
#define BIAS 7

/* The global value of element (i, j) of "w" at a step: a few elements change per
 * step, so later steps are deltas. */
static float wval(int64_t i, int64_t j, uint64_t step) {
  int64_t k = i * COLS + j;
  return (float)k * 0.125f + ((k % 5) == (int64_t)(step % 5) ? (float)step : 0.0f);
}
static float bval(int64_t i, uint64_t step) {
  return (float)i - 0.5f * (float)step;
}

static void fill_w(float *dst, const int64_t *off, const int64_t *shape, uint64_t step) {
  for (int64_t i = 0; i < shape[0]; i++)
    for (int64_t j = 0; j < shape[1]; j++)
      dst[i * shape[1] + j] = wval(off[0] + i, off[1] + j, step);
}

typedef struct job {
  const char *path;
  int by_cols;           /* split "w" by columns instead of rows */
  uint64_t first, last;  /* steps to save */
  int fail_rank;         /* -1: none; else this rank's save of fail_step fails */
  uint64_t fail_step;
  const char *policy;
  int expect_fail_seen;
  uint32_t full_every;   /* 0: the default */
  uint64_t chunk_elems;  /* 0: the default */
  uint64_t keep_last;    /* retention; then the store is checked after each step */
  double full_share;     /* 0: the default */
} job;

static void check_retention(const job *jb, const amber_comm *c, amber_global_writer *gw,
                            uint64_t s, int ok);

/* This rank's box of "w" when it is split in `n` parts along one dimension. */
static void part(int rank, int n, int by_cols, int64_t *off, int64_t *shape) {
  int64_t len = by_cols ? COLS : ROWS;
  int64_t a = len * rank / n, b = len * (rank + 1) / n;
  off[0] = by_cols ? 0 : a, off[1] = by_cols ? a : 0;
  shape[0] = by_cols ? ROWS : b - a, shape[1] = by_cols ? b - a : COLS;
}

static void block_step(const char *path, int rank, uint64_t step, int on) {
  char p[4200];
  snprintf(p, sizeof p, "%s/rank-%05d/ckpt-%020llu.amber", path, rank,
           (unsigned long long)step);
  if (on) mkdir(p, 0755);
  else rmdir(p);
}

static void rank_main(const amber_comm *c, void *arg) {
  job *jb = arg;
  amber_global_writer *gw;
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.full_every = jb->full_every;
  wo.chunk_elems = jb->chunk_elems;
  wo.keep_last = jb->keep_last;
  wo.full_share = jb->full_share;
  int rc = amber_global_writer_open(&gw, jb->path, c, &wo);
  RCHECK(rc == 0);
  if (rc < 0) return;
  int64_t gshape[2] = {ROWS, COLS}, off[2], shape[2], bshape[1] = {BIAS};
  part(c->rank, c->size, jb->by_cols, off, shape);
  float *w = malloc((size_t)(shape[0] * shape[1]) * sizeof *w + 1);
  float b[BIAS];
  RCHECK(amber_global_writer_add(gw, "w", AMBER_F32, 2, gshape, off, shape, w, 0) == 0);
  RCHECK(amber_global_writer_add(gw, "b", AMBER_F32, 1, bshape, NULL, NULL, b,
                                 AMBER_SHARD_REPLICATED) == 0);
  if (jb->policy) RCHECK(amber_global_writer_add_policy(gw, jb->policy) == 0);
  for (uint64_t s = jb->first; s <= jb->last; s++) {
    fill_w(w, off, shape, s);
    for (int i = 0; i < BIAS; i++) b[i] = bval(i, s);
    int failing = jb->fail_step == s && jb->fail_rank >= 0;
    if (failing && c->rank == jb->fail_rank) block_step(jb->path, c->rank, s, 1);
    c->barrier(c->ctx);
    rc = s % 2 ? amber_global_writer_save(gw, s, 0) : amber_global_writer_begin(gw, s, 0);
    if (!(s % 2) && rc == 0) {
      RCHECK(amber_global_writer_fence(gw) == 0);
      rc = amber_global_writer_wait(gw);
    }
    if (failing) {
      char want[64];
      snprintf(want, sizeof want, "rank %d failed", jb->fail_rank);
      RCHECK(rc < 0);
      RCHECK(strstr(amber_last_error(gw), want) != NULL);
      if (c->rank == 0) fprintf(stderr, "  (expected) %s\n", amber_last_error(gw));
      c->barrier(c->ctx);
      if (c->rank == jb->fail_rank) block_step(jb->path, c->rank, s, 0);
    } else {
      RCHECK(rc == 0);
    }
    if (jb->keep_last) check_retention(jb, c, gw, s, rc == 0);
  }
  amber_global_writer_close(gw);
  free(w);
}

static void run_job(const char *path, int n, int by_cols, uint64_t first, uint64_t last,
                    int fail_rank, uint64_t fail_step, const char *policy) {
  /* deltas whatever their size: the tests pin the chains (full_share has its own) */
  job jb = {path, by_cols, first, last, fail_rank, fail_step, policy, 0, 0, 0, 0, -1};
  atomic_store(&rank_fails, 0);
  tc_run(n, rank_main, &jb);
  CHECK(atomic_load(&rank_fails) == 0);
}

/* Reads step `step` of `path` as `n` readers splitting "w" along rows or columns
 * (any n: resharding) and checks every element against the values of `want_step`
 * within `tol` (0: bit-exact). */
static void check_read(const char *path, uint64_t step, uint64_t want_step, int n, int by_cols,
                       double tol) {
  amber_global_reader *g;
  CHECK_OK(amber_global_reader_open(&g, path, step));
  if (!g) return;
  size_t wi, bi;
  CHECK_OK(amber_global_reader_find(g, "w", &wi));
  CHECK_OK(amber_global_reader_find(g, "b", &bi));
  amber_global_tensor t;
  CHECK_OK(amber_global_reader_tensor(g, wi, &t));
  CHECK(t.ndim == 2 && t.shape[0] == ROWS && t.shape[1] == COLS && t.dtype == AMBER_F32);
  for (int r = 0; r < n; r++) {
    int64_t off[2], shape[2];
    part(r, n, by_cols, off, shape);
    size_t cnt = (size_t)(shape[0] * shape[1]);
    float *got = malloc(cnt * sizeof *got + 1), *want = malloc(cnt * sizeof *want + 1);
    fill_w(want, off, shape, want_step);
    CHECK_OK(amber_global_reader_read(g, wi, off, shape, got, cnt * sizeof *got));
    if (tol == 0)
      CHECK(memcmp(got, want, cnt * sizeof *got) == 0);
    else
      for (size_t i = 0; i < cnt; i++) CHECK(fabs((double)got[i] - (double)want[i]) <= tol);
    free(got), free(want);
  }
  float b[BIAS];
  int64_t o0 = 0, bs = BIAS;
  CHECK_OK(amber_global_reader_read(g, bi, &o0, &bs, b, sizeof b));
  for (int i = 0; i < BIAS; i++) CHECK(fabs((double)b[i] - (double)bval(i, want_step)) <= tol);
  CHECK_OK(amber_global_reader_verify(g));
  amber_global_reader_close(g);
}

static void test_two_ranks_sharded_and_replicated_round_trip(void) {
  const char *p = tu_tmpdir();
  run_job(p, 2, 0, 1, 3, -1, 0, NULL);
  for (uint64_t s = 1; s <= 3; s++) check_read(p, s, s, 2, 0, 0);
  check_read(p, AMBER_LATEST, 3, 1, 0, 0);
  amber_global_step_info *info;
  size_t n;
  CHECK_OK(amber_global_list(p, &info, &n));
  CHECK(n == 3);
  if (n == 3) {
    CHECK(info[0].kind == AMBER_KIND_FULL && info[0].world_size == 2);
    CHECK(info[1].kind == AMBER_KIND_DELTA && info[1].parent == 1);
    CHECK(info[2].kind == AMBER_KIND_DELTA && info[2].parent == 2);
  }
  amber_free(info);
  CHECK(amber_global_is_store(p) == 1);
}

static void test_failure_on_one_rank_commits_nothing_and_next_save_is_correct(void) {
  const char *p = tu_tmpdir();
  run_job(p, 4, 0, 1, 4, 2, 3, NULL); /* step 3 fails on rank 2 */
  amber_global_step_info *info;
  size_t n;
  CHECK_OK(amber_global_list(p, &info, &n));
  CHECK(n == 3);
  if (n == 3) {
    CHECK(info[0].step == 1 && info[1].step == 2 && info[2].step == 4);
    CHECK(info[2].kind == AMBER_KIND_FULL); /* after a failure the step is full */
  }
  amber_free(info);
  amber_global_reader *g;
  CHECK_RC(amber_global_reader_open(&g, p, 3), AMBER_ENOENT);
  /* No rank keeps a file of step 3. */
  for (int r = 0; r < 4; r++) {
    char f[4200];
    snprintf(f, sizeof f, "%s/rank-%05d/ckpt-%020d.amber", p, r, 3);
    CHECK(access(f, F_OK) != 0);
  }
  check_read(p, 2, 2, 4, 0, 0);
  check_read(p, 4, 4, 4, 0, 0);
}

static void test_leftovers_of_a_dead_rank_are_removed_by_the_next_writer(void) {
  const char *p = tu_tmpdir();
  run_job(p, 2, 0, 1, 2, -1, 0, NULL);
  /* Rank 1 committed step 3 in its own store, then the job died before the manifest. */
  char dir[4200];
  snprintf(dir, sizeof dir, "%s/rank-00001", p);
  amber_store *st;
  CHECK_OK(amber_store_open(&st, dir, NULL));
  amber_writer *w;
  CHECK_OK(amber_writer_open(&w, st, NULL));
  float x[4] = {1, 2, 3, 4};
  int64_t sh[1] = {4};
  CHECK_OK(amber_writer_add(w, "junk", AMBER_F32, 1, sh, x, NULL));
  CHECK_OK(amber_writer_save(w, 3, 0));
  amber_writer_close(w);
  amber_store_close(st);
  run_job(p, 2, 0, 3, 4, -1, 0, NULL); /* step 3 again: the leftover must not stop it */
  check_read(p, 3, 3, 2, 0, 0);
  check_read(p, 4, 4, 3, 1, 0);
}

static void test_reshard_4_to_1_and_3_and_columns(void) {
  const char *p = tu_tmpdir();
  run_job(p, 4, 0, 1, 2, -1, 0, NULL);
  check_read(p, 2, 2, 1, 0, 0);
  check_read(p, 2, 2, 3, 0, 0);
  check_read(p, 2, 2, 3, 1, 0); /* written by rows, read by columns */
  check_read(p, 1, 1, 4, 1, 0);
}

static void test_reshard_1_to_4_and_columns_to_rows(void) {
  const char *p = tu_tmpdir();
  run_job(p, 1, 0, 1, 2, -1, 0, NULL);
  check_read(p, 2, 2, 4, 0, 0);
  const char *q = tu_tmpdir();
  run_job(q, 3, 1, 1, 3, -1, 0, NULL); /* columns at 3 ranks */
  check_read(q, 3, 3, 4, 0, 0);
  check_read(q, 2, 2, 2, 1, 0);
}

static void test_delta_chain_across_ranks_and_world_size_change(void) {
  const char *p = tu_tmpdir();
  run_job(p, 4, 0, 1, 6, -1, 0, NULL);
  for (uint64_t s = 1; s <= 6; s++) check_read(p, s, s, 2, 0, 0);
  /* The job resumes at 3 ranks on the same store. */
  run_job(p, 3, 0, 7, 8, -1, 0, NULL);
  for (uint64_t s = 5; s <= 8; s++) check_read(p, s, s, 4, 1, 0);
  amber_global_step_info *info;
  size_t n;
  CHECK_OK(amber_global_list(p, &info, &n));
  CHECK(n == 8);
  if (n == 8) CHECK(info[5].world_size == 4 && info[7].world_size == 3);
  /* The first step at another world size is full on every rank, the next a delta. */
  if (n == 8) CHECK(info[6].kind == AMBER_KIND_FULL && info[7].kind == AMBER_KIND_DELTA);
  amber_free(info);
}

/* Back at a world size seen before (4 -> 2 -> 4): ranks 2 and 3 find their own
 * stores as the 4-rank job left them, with shards of the same shape, yet the first
 * step is full on every rank, so that no chain reaches back past the steps that
 * another world size wrote. */
static void test_first_step_after_a_world_size_change_is_full(void) {
  const char *p = tu_tmpdir();
  run_job(p, 4, 0, 1, 3, -1, 0, NULL);
  run_job(p, 2, 0, 4, 5, -1, 0, NULL);
  run_job(p, 4, 0, 6, 7, -1, 0, NULL);
  amber_global_step_info *info;
  size_t n;
  CHECK_OK(amber_global_list(p, &info, &n));
  CHECK(n == 7);
  if (n == 7)
    CHECK(info[3].kind == AMBER_KIND_FULL && info[4].kind == AMBER_KIND_DELTA &&
          info[5].kind == AMBER_KIND_FULL && info[5].parent == AMBER_NO_STEP &&
          info[6].kind == AMBER_KIND_DELTA);
  amber_free(info);
  for (uint64_t s = 1; s <= 7; s++) check_read(p, s, s, 3, 1, 0);
}

/* A rank after a load of global step 3: its tensors hold the step's values and its
 * writer seeds its reference from them (what_seed), then saves step 4 with its own
 * file of step 3 moved away, which a writer reading its reference back would need. */
typedef struct seed_job {
  const char *path;
  int by_cols;    /* 2: by rows, each rank the other's rows (the same shapes, other boxes) */
  uint64_t step;  /* the step to seed from */
  int want_rc;    /* the seed's outcome on every rank */
  int save;       /* then save step 4 with the rank's file of step 3 away */
} seed_job;

static void seed_main(const amber_comm *c, void *arg) {
  seed_job *jb = arg;
  amber_global_writer *gw;
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.full_share = -1;
  int rc = amber_global_writer_open(&gw, jb->path, c, &wo);
  RCHECK(rc == 0);
  if (rc < 0) return;
  int64_t gshape[2] = {ROWS, COLS}, off[2], shape[2], bshape[1] = {BIAS};
  if (jb->by_cols == 2) part(c->size - 1 - c->rank, c->size, 0, off, shape);
  else part(c->rank, c->size, jb->by_cols, off, shape);
  float *w = malloc((size_t)(shape[0] * shape[1]) * sizeof *w + 1);
  float b[BIAS];
  RCHECK(amber_global_writer_add(gw, "w", AMBER_F32, 2, gshape, off, shape, w, 0) == 0);
  RCHECK(amber_global_writer_add(gw, "b", AMBER_F32, 1, bshape, NULL, NULL, b,
                                 AMBER_SHARD_REPLICATED) == 0);
  fill_w(w, off, shape, 3);
  for (int i = 0; i < BIAS; i++) b[i] = bval(i, 3);
  rc = amber_global_writer_seed_reference(gw, jb->step);
  RCHECK(rc == jb->want_rc);
  if (rc != jb->want_rc) fprintf(stderr, "  seed: %d %s\n", rc, amber_last_error(gw));
  if (rc < 0 && c->rank == 0) fprintf(stderr, "  (expected) %s\n", amber_last_error(gw));
  if (jb->save) {
    char f[4200], away[4300];
    snprintf(f, sizeof f, "%s/rank-%05d/ckpt-%020d.amber", jb->path, c->rank, 3);
    snprintf(away, sizeof away, "%s.away", f);
    RCHECK(rename(f, away) == 0);
    fill_w(w, off, shape, 4);
    for (int i = 0; i < BIAS; i++) b[i] = bval(i, 4);
    c->barrier(c->ctx);
    RCHECK(amber_global_writer_save(gw, 4, 0) == 0);
    RCHECK(rename(away, f) == 0);
  }
  amber_global_writer_close(gw);
  free(w);
}

static void seed_run(const char *path, int n, int by_cols, uint64_t step, int want_rc,
                     int save) {
  seed_job jb = {path, by_cols, step, want_rc, save};
  atomic_store(&rank_fails, 0);
  tc_run(n, seed_main, &jb);
  CHECK(atomic_load(&rank_fails) == 0);
}

static void test_a_rank_writer_seeded_after_a_load_saves_a_delta_reading_nothing(void) {
  const char *p = tu_tmpdir();
  run_job(p, 2, 0, 1, 3, -1, 0, NULL);
  /* refused: not the latest step; another world size; other shapes (by columns);
   * the same shapes in other boxes (each rank the other's rows) */
  seed_run(p, 2, 0, 2, AMBER_EINVAL, 0);
  seed_run(p, 3, 0, 3, AMBER_EMISMATCH, 0);
  seed_run(p, 2, 1, 3, AMBER_EMISMATCH, 0);
  seed_run(p, 2, 2, 3, AMBER_EMISMATCH, 0);
  /* the same world and boxes: seeded, and step 4 is a delta of exactly its values */
  seed_run(p, 2, 0, 3, 0, 1);
  amber_global_step_info *info;
  size_t n;
  CHECK_OK(amber_global_list(p, &info, &n));
  CHECK(n == 4);
  if (n == 4) CHECK(info[3].kind == AMBER_KIND_DELTA && info[3].parent == 3);
  amber_free(info);
  for (uint64_t s = 1; s <= 4; s++) check_read(p, s, s, 2, 1, 0);
}

static void test_lossy_policy_resharded_within_bound(void) {
  const char *p = tu_tmpdir();
  run_job(p, 4, 0, 1, 5, -1, 0, "threshold:0.01");
  for (uint64_t s = 1; s <= 5; s++) check_read(p, s, s, 3, 1, 0.01 + 1e-6);
}

static void test_region_outside_or_wrong_size_is_refused(void) {
  const char *p = tu_tmpdir();
  run_job(p, 2, 0, 1, 1, -1, 0, NULL);
  amber_global_reader *g;
  CHECK_OK(amber_global_reader_open(&g, p, AMBER_LATEST));
  if (!g) return;
  int64_t off[2] = {10, 0}, sh[2] = {4, COLS};
  float buf[4 * COLS];
  CHECK_RC(amber_global_reader_read(g, 0, off, sh, buf, sizeof buf), AMBER_ERANGE);
  off[0] = 0;
  CHECK_RC(amber_global_reader_read(g, 0, off, sh, buf, sizeof buf - 4), AMBER_EINVAL);
  CHECK_OK(amber_global_reader_read(g, 0, off, sh, buf, sizeof buf));
  amber_global_reader_close(g);
}

static void test_cli_ls_and_verify_on_a_multi_rank_store(void) {
  const char *p = tu_tmpdir();
  run_job(p, 4, 0, 1, 2, -1, 0, NULL);
  char out[4200];
  snprintf(out, sizeof out, "%s/ls.json", p);
  CHECK(tu_system("%s ls %s --json > %s", AMBER_CLI, p, out) == 0);
  size_t len;
  char *txt = (char *)tu_read_file(out, &len);
  CHECK(txt && strstr(txt, "\"world_size\": 4") && strstr(txt, "\"kind\": \"delta\""));
  free(txt);
  CHECK(tu_system("%s verify %s > /dev/null", AMBER_CLI, p) == 0);
  snprintf(out, sizeof out, "%s/info.json", p);
  CHECK(tu_system("%s info %s --json > %s", AMBER_CLI, p, out) == 0);
  txt = (char *)tu_read_file(out, &len);
  CHECK(txt && strstr(txt, "\"world_size\": 4") && strstr(txt, "\"shards\": 4"));
  free(txt);
  /* export: one safetensors file of the consolidated global tensors. */
  snprintf(out, sizeof out, "%s/x.safetensors", p);
  CHECK(tu_system("%s export %s -o %s > /dev/null", AMBER_CLI, p, out) == 0);
  uint8_t *st = tu_read_file(out, &len);
  float w[ROWS * COLS];
  int64_t o[2] = {0, 0}, g[2] = {ROWS, COLS};
  fill_w(w, o, g, 2);
  CHECK(st && len > 8 + sizeof w);
  if (st && len > 8 + sizeof w) {
    uint64_t hl = 0;
    memcpy(&hl, st, 8);
    CHECK(8 + hl + sizeof w <= len && memcmp(st + 8 + hl, w, sizeof w) == 0);
  }
  free(st);
  /* Damage rank 3's file of step 2: verify fails and names the rank. */
  char f[4200];
  snprintf(f, sizeof f, "%s/rank-00003/ckpt-%020d.amber", p, 2);
  CHECK(tu_flip_byte(f, 100, 0x10) == 0);
  snprintf(out, sizeof out, "%s/verify.txt", p);
  CHECK(tu_system("%s verify %s > %s", AMBER_CLI, p, out) != 0);
  txt = (char *)tu_read_file(out, &len);
  CHECK(txt && strstr(txt, "rank 3"));
  free(txt);
}

static void overlap_main(const amber_comm *c, void *arg) {
  const char *path = arg;
  amber_global_writer *gw;
  int rc = amber_global_writer_open(&gw, path, c, NULL);
  RCHECK(rc == 0);
  if (rc < 0) return;
  int64_t g[2] = {ROWS, COLS}, off[2] = {0, 0}, sh[2] = {ROWS / 2 + 1, COLS};
  float w[(ROWS / 2 + 1) * COLS];
  memset(w, 0, sizeof w);
  off[0] = c->rank ? ROWS / 2 - 1 : 0; /* the ranks' boxes overlap by two rows */
  RCHECK(amber_global_writer_add(gw, "w", AMBER_F32, 2, g, off, sh, w, 0) == 0);
  rc = amber_global_writer_save(gw, 1, 0);
  RCHECK(rc == AMBER_EMISMATCH);
  RCHECK(strstr(amber_last_error(gw), "tensor 'w'") != NULL);
  amber_global_writer_close(gw);
}

static void test_shards_that_do_not_tile_fail_the_step_on_every_rank(void) {
  const char *p = tu_tmpdir();
  atomic_store(&rank_fails, 0);
  tc_run(2, overlap_main, (void *)p);
  CHECK(atomic_load(&rank_fails) == 0);
  amber_global_step_info *info;
  size_t n = 9;
  CHECK_OK(amber_global_list(p, &info, &n));
  CHECK(n == 0);
  amber_free(info);
  for (int r = 0; r < 2; r++) {
    char f[4200];
    snprintf(f, sizeof f, "%s/rank-%05d/ckpt-%020d.amber", p, r, 1);
    CHECK(access(f, F_OK) != 0);
  }
}

/* Golden multi-rank stores (format 1.2), which must load forever: 3 steps (full,
 * delta, delta) written at 2 ranks by rows and at 4 ranks by columns. With
 * AMBER_WRITE_GOLDEN set, (re)writes them into tests/golden/. */
static void test_golden_multi_rank_stores_load(void) {
  const char *gen = getenv("AMBER_WRITE_GOLDEN");
  for (int k = 0; k < 2; k++) {
    int n = k ? 4 : 2, cols = k;
    char p[4200];
    snprintf(p, sizeof p, "%s/tests/golden/v1.2-ranks%d", AMBER_SOURCE_DIR, n);
    if (gen) {
      tu_rm_rf(p);
      run_job(p, n, cols, 1, 3, -1, 0, NULL);
      tu_system("find %s -name .lock -delete", p);
    }
    for (uint64_t s = 1; s <= 3; s++) {
      check_read(p, s, s, 1, 0, 0);
      check_read(p, s, s, 3, !cols, 0);
    }
    amber_global_step_info *info;
    size_t cnt = 0;
    CHECK_OK(amber_global_list(p, &info, &cnt));
    CHECK(cnt == 3 && info[0].world_size == (uint32_t)n && info[2].kind == AMBER_KIND_DELTA);
    amber_free(info);
  }
}

/* Each rank saves two steps (a full, a split delta) and checks its figures. */
static void stats_main(const amber_comm *c, void *arg) {
  amber_global_writer *gw = NULL;
  RCHECK(amber_global_writer_open(&gw, arg, c, NULL) == 0);
  if (!gw) return;
  int64_t g[2] = {ROWS, COLS}, off[2], sh[2];
  part(c->rank, c->size, 0, off, sh);
  float w[ROWS * COLS];
  RCHECK(amber_global_writer_add(gw, "w", AMBER_F32, 2, g, off, sh, w, 0) == 0);
  amber_global_save_stats st;
  for (uint64_t s = 1; s <= 2; s++) {
    fill_w(w, off, sh, s);
    if (s == 1) {
      RCHECK(amber_global_writer_save(gw, s, 0) == 0);
    } else {
      RCHECK(amber_global_writer_begin(gw, s, 0) == 0);
      RCHECK(amber_global_writer_fence(gw) == 0);
      RCHECK(amber_global_writer_wait(gw) == 0);
    }
    RCHECK(amber_global_writer_save_stats(gw, &st) == 0);
    RCHECK(st.part.kind == (s == 1 ? AMBER_KIND_FULL : AMBER_KIND_DELTA) && st.part.bytes > 0);
    RCHECK(st.part_s >= st.part.total_s && st.vote_s >= 0 && st.outcome_s >= 0);
    /* Only rank 0 writes the manifest. */
    RCHECK(c->rank == 0 ? st.manifest_s > 0 : st.manifest_s == 0);
    RCHECK(fabs(st.commit_s - (st.vote_s + st.manifest_s + st.outcome_s)) < 1e-9);
    RCHECK(fabs(st.total_s - (st.part_s + st.commit_s)) < 1e-9);
  }
  RCHECK(amber_global_writer_save_stats(gw, NULL) == AMBER_EINVAL);
  amber_global_writer_close(gw);
}

static void test_save_stats_split_a_rank_part_from_the_global_commit(void) {
  atomic_store(&rank_fails, 0);
  tc_run(3, stats_main, (void *)tu_tmpdir());
  CHECK(atomic_load(&rank_fails) == 0);
}

static void self_main(const char *p, uint64_t step) {
  amber_global_writer *gw = NULL;
  CHECK_OK(amber_global_writer_open(&gw, p, amber_comm_self(), NULL));
  if (!gw) return;
  float w[ROWS * COLS], b[BIAS];
  int64_t g[2] = {ROWS, COLS}, o[2] = {0, 0}, bs[1] = {BIAS};
  fill_w(w, o, g, step);
  for (int i = 0; i < BIAS; i++) b[i] = bval(i, step);
  CHECK_OK(amber_global_writer_add(gw, "w", AMBER_F32, 2, g, o, g, w, 0));
  CHECK_OK(amber_global_writer_add(gw, "b", AMBER_F32, 1, bs, NULL, NULL, b,
                                   AMBER_SHARD_REPLICATED));
  CHECK_OK(amber_global_writer_save(gw, step, 0));
  CHECK_RC(amber_global_writer_save(gw, step, 0), AMBER_EEXIST);
  amber_global_writer_close(gw);
}

static void test_one_rank_through_amber_comm_self(void) {
  const char *p = tu_tmpdir();
  self_main(p, 1);
  self_main(p, 2); /* a new writer on the same store: a delta after the first */
  check_read(p, 1, 1, 2, 1, 0);
  check_read(p, 2, 2, 4, 0, 0);
  amber_global_step_info *info;
  size_t n = 0;
  CHECK_OK(amber_global_list(p, &info, &n));
  CHECK(n == 2 && info[1].kind == AMBER_KIND_DELTA && info[1].world_size == 1);
  amber_free(info);
}

/* A multi-rank store is not a single-rank one, nor the reverse: opening one as the
 * other fails with a message that says so, and changes nothing (a single-rank open
 * used to find it empty, and a writer would have mixed a checkpoint into it). */
static void test_single_and_multi_rank_stores_do_not_open_as_each_other(void) {
  const char *p = tu_tmpdir();
  self_main(p, 1);
  amber_store *st = NULL;
  CHECK_RC(amber_store_open(&st, p, NULL), AMBER_EINVAL);
  CHECK(strstr(amber_last_error(NULL), "is a multi-rank store") != NULL);
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY;
  CHECK_RC(amber_store_open(&st, p, &so), AMBER_EINVAL);
  char lock[4200];
  snprintf(lock, sizeof lock, "%s/.lock", p);
  CHECK(access(lock, F_OK) != 0); /* nothing created */
  check_read(p, 1, 1, 1, 0, 0);
  char single[4200];
  snprintf(single, sizeof single, "%s/single", tu_tmpdir());
  amber_writer *w;
  float x[4] = {1, 2, 3, 4};
  int64_t shape[1] = {4};
  CHECK_OK(amber_store_open(&st, single, NULL));
  CHECK_OK(amber_writer_open(&w, st, NULL));
  CHECK_OK(amber_writer_add(w, "x", AMBER_F32, 1, shape, x, NULL));
  CHECK_OK(amber_writer_save(w, 1, 0));
  amber_writer_close(w);
  amber_store_close(st);
  amber_global_writer *gw = NULL;
  CHECK_RC(amber_global_writer_open(&gw, single, amber_comm_self(), NULL), AMBER_EINVAL);
  CHECK(strstr(amber_last_error(NULL), "written by one process") != NULL);
  char rank0[4300];
  snprintf(rank0, sizeof rank0, "%s/rank-00000", single);
  CHECK(access(rank0, F_OK) != 0);
  CHECK(!amber_global_is_store(single));
}

static void test_missing_rank_file_names_the_rank_and_tensor(void) {
  const char *p = tu_tmpdir();
  run_job(p, 4, 0, 1, 1, -1, 0, NULL);
  char f[4200];
  snprintf(f, sizeof f, "%s/rank-00002/ckpt-%020d.amber", p, 1);
  CHECK(unlink(f) == 0);
  amber_global_reader *g;
  CHECK_OK(amber_global_reader_open(&g, p, 1));
  if (!g) return;
  float row[COLS];
  int64_t off[2] = {0, 0}, sh[2] = {1, COLS};
  CHECK_OK(amber_global_reader_read(g, 0, off, sh, row, sizeof row)); /* rank 0's rows */
  off[0] = ROWS - 4; /* rank 2's rows */
  CHECK(amber_global_reader_read(g, 0, off, sh, row, sizeof row) < 0);
  CHECK(strstr(amber_last_error(g), "rank 2") != NULL);
  CHECK(strstr(amber_last_error(g), "tensor 'w'") != NULL);
  CHECK(strstr(amber_last_error(g), "rank-00002") != NULL);
  /* the rank's own message is wrapped, not garbled by formatting it into itself */
  fprintf(stderr, "  (expected) %s\n", amber_last_error(g));
  CHECK(strstr(amber_last_error(g), "rank 2: rank 2") == NULL);
  CHECK(strstr(amber_last_error(g), "step 1") != NULL);
  CHECK(amber_global_reader_verify(g) < 0);
  amber_global_reader_close(g);
}

static void test_prune_keeps_what_the_kept_steps_need(void) {
  const char *p = tu_tmpdir();
  job jb = {p, 0, 1, 6, -1, 0, NULL, 0, 2, 0, 0, -1}; /* full at 1 and 4 */
  atomic_store(&rank_fails, 0);
  tc_run(4, rank_main, &jb);
  CHECK(atomic_load(&rank_fails) == 0);
  size_t removed = 0;
  CHECK_OK(amber_global_prune(p, 2, &removed));
  CHECK(removed == 4);
  amber_global_step_info *info;
  size_t n = 0;
  CHECK_OK(amber_global_list(p, &info, &n));
  CHECK(n == 2 && info[0].step == 5);
  amber_free(info);
  check_read(p, 5, 5, 3, 1, 0);
  check_read(p, 6, 6, 1, 0, 0);
  char f[4200];
  for (int s = 1; s <= 4; s++) {
    snprintf(f, sizeof f, "%s/rank-00001/ckpt-%020d.amber", p, s);
    CHECK((access(f, F_OK) == 0) == (s == 4)); /* 4 is the full that 5 and 6 need */
  }
  CHECK(tu_system("%s prune %s --keep-last 1 > /dev/null", AMBER_CLI, p) == 0);
  check_read(p, 6, 6, 2, 0, 0);
}

/* Retention in the global writer: after each step (rank 0 checks while the others
 * wait) the store holds the newest keep_last committed steps, each rank's store
 * exactly their files and the chain back to their full step, and every kept step
 * reads back bit-exactly at another sharding. */
static uint64_t ret_committed[64], ret_full[64];
static size_t ret_n;

static void check_retention(const job *jb, const amber_comm *c, amber_global_writer *gw,
                            uint64_t s, int ok) {
  size_t removed = 0;
  const char *msg = NULL;
  RCHECK(amber_global_writer_prune_status(gw, &removed, &msg) == 0 && msg == NULL);
  c->barrier(c->ctx);
  if (c->rank == 0 && ok) {
    amber_global_save_stats st;
    RCHECK(amber_global_writer_save_stats(gw, &st) == 0);
    ret_committed[ret_n] = s, ret_full[ret_n++] = st.part.kind == AMBER_KIND_FULL;
  }
  if (c->rank == 0) {
    size_t keep = ret_n < jb->keep_last ? ret_n : (size_t)jb->keep_last, n = 0;
    amber_global_step_info *info = NULL;
    RCHECK(amber_global_list(jb->path, &info, &n) == 0 && n == keep);
    for (size_t i = 0; i < n && n == keep; i++) {
      RCHECK(info[i].step == ret_committed[ret_n - keep + i]);
      check_read(jb->path, info[i].step, info[i].step, 3, 1, 0);
    }
    amber_free(info);
    size_t start = ret_n - keep; /* back to the full step the oldest kept one needs */
    while (start > 0 && !ret_full[start]) start--;
    for (int r = 0; r < c->size; r++)
      for (uint64_t t = 1; t <= s; t++) {
        int want = 0;
        for (size_t i = start; i < ret_n; i++) want |= ret_committed[i] == t;
        char f[4200];
        snprintf(f, sizeof f, "%s/rank-%05d/ckpt-%020llu.amber", jb->path, r,
                 (unsigned long long)t);
        struct stat sb;
        int have = stat(f, &sb) == 0 && S_ISREG(sb.st_mode);
        if (have != want) fprintf(stderr, "  rank %d step %llu: file %d, want %d\n", r,
                                  (unsigned long long)t, have, want);
        RCHECK(have == want);
      }
  }
  c->barrier(c->ctx);
}

/* full_share in the global writer: each rank weighs its own deltas against its last
 * full file, and any rank's call makes the whole step full (the manifest says full
 * only when every rank's file is). Without it (negative) every later step is a
 * delta; restores are exact either way. */
static void test_full_share_makes_whole_steps_full(void) {
  for (int on = 0; on < 2; on++) {
    const char *p = tu_tmpdir();
    job jb = {p, 0, 1, 6, -1, 0, NULL, 0, 1000, 0, 0, on ? 0.3 : -1.0};
    atomic_store(&rank_fails, 0);
    tc_run(3, rank_main, &jb);
    CHECK(atomic_load(&rank_fails) == 0);
    amber_global_step_info *info = NULL;
    size_t n = 0, fulls = 0;
    CHECK_OK(amber_global_list(p, &info, &n));
    CHECK(n == 6);
    for (size_t i = 1; i < n; i++) fulls += info[i].kind == AMBER_KIND_FULL;
    amber_free(info);
    CHECK(on ? fulls > 0 : fulls == 0);
    for (uint64_t s = 1; s <= 6; s++) check_read(p, s, s, 2, 1, 0);
  }
}

static void test_keep_last_in_the_global_writer_prunes_after_each_step(void) {
  for (int bg = 0; bg < 2; bg++) { /* the commit inside wait, then in the background */
    const char *p = tu_tmpdir();
    tc_flags = bg ? AMBER_COMM_ANY_THREAD : 0;
    ret_n = 0;
    /* full every 3rd step; step 5 fails on rank 1 (nothing pruned, the next is full) */
    job jb = {p, 0, 1, 8, 1, 5, NULL, 0, 2, 0, 2, -1};
    atomic_store(&rank_fails, 0);
    tc_run(3, rank_main, &jb);
    CHECK(atomic_load(&rank_fails) == 0);
    CHECK(ret_n == 7);
    /* A writer reopened on the pruned store, at another keep_last: the chain's
     * manifests are gone, so its first step is full; retention goes on. */
    job j2 = {p, 0, 9, 11, -1, 0, NULL, 0, 2, 0, 1, -1};
    atomic_store(&rank_fails, 0);
    tc_run(3, rank_main, &j2);
    tc_flags = 0;
    CHECK(atomic_load(&rank_fails) == 0);
    CHECK(ret_n == 10 && ret_full[7]);
    check_read(p, 11, 11, 2, 0, 0);
    CHECK(tu_system("%s verify %s > /dev/null", AMBER_CLI, p) == 0);
  }
}

/* A collective that fails once rank 0 has published the step (the broadcast of the
 * outcome, lost on every rank, as when a peer dies then): every rank's save fails,
 * rank 0's saying the step was committed, and no rank removes its file of it, so the
 * store stays whole at that step; a new writer then goes on from it. */
static void lost_outcome_main(const amber_comm *c, void *arg) {
  const char *p = arg;
  amber_global_writer *gw = NULL;
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.full_share = -1;
  for (uint64_t s = 1; s <= 3; s++) {
    if (s != 2) RCHECK(amber_global_writer_open(&gw, p, c, &wo) == 0);
    if (!gw) return;
    int64_t g[2] = {ROWS, COLS}, off[2], sh[2], bshape[1] = {BIAS};
    part(c->rank, c->size, 0, off, sh);
    float w[ROWS * COLS], b[BIAS];
    fill_w(w, off, sh, s);
    for (int i = 0; i < BIAS; i++) b[i] = bval(i, s);
    if (s != 2) {
      RCHECK(amber_global_writer_add(gw, "w", AMBER_F32, 2, g, off, sh, w, 0) == 0);
      RCHECK(amber_global_writer_add(gw, "b", AMBER_F32, 1, bshape, NULL, NULL, b,
                                     AMBER_SHARD_REPLICATED) == 0);
    } else {
      RCHECK(amber_global_writer_set_data(gw, 0, w) == 0);
      RCHECK(amber_global_writer_set_data(gw, 1, b) == 0);
      c->barrier(c->ctx);
      if (c->rank == 0) atomic_store(&tc_broadcast_fails, (1ull << c->size) - 1);
      c->barrier(c->ctx);
    }
    int rc = amber_global_writer_save(gw, s, 0);
    if (s == 2) {
      RCHECK(rc == AMBER_EIO);
      RCHECK(strstr(amber_last_error(gw), c->rank ? "broadcast of the outcome failed"
                                                  : "step 2 was committed") != NULL);
      if (c->rank == 0) fprintf(stderr, "  (expected) %s\n", amber_last_error(gw));
    } else {
      RCHECK(rc == 0);
    }
    c->barrier(c->ctx);
    if (s != 1) amber_global_writer_close(gw), gw = NULL;
  }
}

static void test_a_lost_outcome_after_the_publish_leaves_the_step_whole(void) {
  const char *p = tu_tmpdir();
  atomic_store(&rank_fails, 0);
  tc_run(3, lost_outcome_main, (void *)p);
  CHECK(atomic_load(&rank_fails) == 0);
  amber_global_step_info *info = NULL;
  size_t n = 0;
  CHECK_OK(amber_global_list(p, &info, &n));
  CHECK(n == 3);
  amber_free(info);
  check_read(p, 2, 2, 2, 1, 0);
  check_read(p, 3, 3, 4, 0, 0);
  CHECK(tu_system("%s verify %s > /dev/null", AMBER_CLI, p) == 0);
}

/* The kind of every rank's file of global step `step` (-1 when a file is missing). */
static int rank_files_kind(const char *p, int n, uint64_t step) {
  int kind = AMBER_KIND_FULL;
  for (int r = 0; r < n; r++) {
    char d[4200];
    snprintf(d, sizeof d, "%s/rank-%05d", p, r);
    amber_store_opts so;
    amber_store_opts_init(&so);
    so.flags = AMBER_OPEN_READONLY;
    amber_store *st = NULL;
    amber_ckpt_info *info = NULL;
    size_t k = 0;
    int found = 0;
    if (amber_store_open(&st, d, &so) == 0 && amber_store_list(st, &info, &k) == 0)
      for (size_t i = 0; i < k; i++)
        if (info[i].step == step) {
          found = 1;
          if (info[i].kind != AMBER_KIND_FULL) kind = (int)info[i].kind;
        }
    amber_free(info);
    amber_store_close(st);
    if (!found) return -1;
  }
  return kind;
}

static void test_compact_makes_a_global_step_full_on_every_rank(void) {
  const char *p = tu_tmpdir();
  run_job(p, 3, 0, 1, 5, -1, 0, NULL);
  CHECK(rank_files_kind(p, 3, 3) == AMBER_KIND_DELTA);
  CHECK(tu_system("%s compact %s --step 3 > /dev/null", AMBER_CLI, p) == 0);
  CHECK(rank_files_kind(p, 3, 3) == AMBER_KIND_FULL);
  amber_global_step_info *info;
  size_t n = 0;
  CHECK_OK(amber_global_list(p, &info, &n));
  CHECK(n == 5);
  if (n == 5)
    CHECK(info[2].kind == AMBER_KIND_FULL && info[2].parent == AMBER_NO_STEP &&
          info[3].kind == AMBER_KIND_DELTA && info[4].kind == AMBER_KIND_DELTA);
  amber_free(info);
  /* Every step still restores bit-exactly, at another sharding too. */
  for (uint64_t s = 1; s <= 5; s++) check_read(p, s, s, 2, 1, 0);
  CHECK(tu_system("%s verify %s > /dev/null", AMBER_CLI, p) == 0);
  /* The latest: three rank files rewritten, then nothing left to do. */
  size_t files = 9;
  CHECK_OK(amber_global_compact(p, AMBER_LATEST, &files));
  CHECK(files == 3);
  CHECK_OK(amber_global_compact(p, AMBER_LATEST, &files));
  CHECK(files == 0);
  CHECK_RC(amber_global_compact(p, 9, NULL), AMBER_ENOENT);
  /* Keeping only the latest (now full) step needs nothing older on any rank. */
  CHECK_OK(amber_global_prune(p, 1, NULL));
  char f[4200];
  for (int s = 1; s <= 5; s++) {
    snprintf(f, sizeof f, "%s/rank-00002/ckpt-%020d.amber", p, s);
    CHECK((access(f, F_OK) == 0) == (s == 5));
  }
  check_read(p, 5, 5, 4, 0, 0);
  /* A later global writer goes on from the compacted step with a delta. */
  run_job(p, 3, 0, 6, 6, -1, 0, NULL);
  CHECK(rank_files_kind(p, 3, 6) == AMBER_KIND_DELTA);
  check_read(p, 6, 6, 1, 0, 0);
}

/* compact and prune take every rank's lock before they change anything. */
static void test_compact_and_prune_refuse_while_a_global_writer_is_open(void) {
  const char *p = tu_tmpdir();
  run_job(p, 1, 0, 1, 3, -1, 0, NULL);
  amber_global_writer *gw = NULL;
  CHECK_OK(amber_global_writer_open(&gw, p, amber_comm_self(), NULL));
  CHECK_RC(amber_global_compact(p, AMBER_LATEST, NULL), AMBER_ELOCKED);
  CHECK_RC(amber_global_prune(p, 1, NULL), AMBER_ELOCKED);
  CHECK(strstr(amber_last_error(NULL), "rank 0") != NULL);
  amber_global_writer_close(gw);
  amber_global_step_info *info;
  size_t n = 0;
  CHECK_OK(amber_global_list(p, &info, &n));
  CHECK(n == 3); /* no manifest was removed */
  amber_free(info);
  CHECK(rank_files_kind(p, 1, 3) == AMBER_KIND_DELTA);
}

/* With an AMBER_COMM_ANY_THREAD communicator the commit of a split save runs from
 * begin on: the step is committed before any rank calls wait. */
static void background_main(const amber_comm *c, void *arg) {
  const char *p = arg;
  amber_global_writer *gw = NULL;
  RCHECK(amber_global_writer_open(&gw, p, c, NULL) == 0);
  if (!gw) return;
  int64_t g[2] = {ROWS, COLS}, off[2], sh[2];
  part(c->rank, c->size, 1, off, sh);
  float w[ROWS * COLS], b[BIAS];
  int64_t bshape[1] = {BIAS};
  fill_w(w, off, sh, 1);
  for (int i = 0; i < BIAS; i++) b[i] = bval(i, 1);
  RCHECK(amber_global_writer_add(gw, "w", AMBER_F32, 2, g, off, sh, w, 0) == 0);
  RCHECK(amber_global_writer_add(gw, "b", AMBER_F32, 1, bshape, NULL, NULL, b,
                                 AMBER_SHARD_REPLICATED) == 0);
  RCHECK(amber_global_writer_save(gw, 1, 0) == 0);
  fill_w(w, off, sh, 2);
  for (int i = 0; i < BIAS; i++) b[i] = bval(i, 2);
  RCHECK(amber_global_writer_begin(gw, 2, 0) == 0);
  RCHECK(amber_global_writer_fence(gw) == 0);
  /* While the commit runs, the writer refuses what would race with it. */
  RCHECK(amber_global_writer_add_policy(gw, "exact") == AMBER_EBUSY);
  RCHECK(amber_global_writer_set_data(gw, 0, w) == AMBER_EBUSY);
  RCHECK(amber_global_writer_begin(gw, 3, 0) == AMBER_EBUSY);
  int seen = 0;
  for (int i = 0; i < 2000 && !seen; i++) { /* up to 10 s */
    amber_global_step_info *info = NULL;
    size_t n = 0;
    if (amber_global_list(p, &info, &n) == 0 && n == 2) seen = 1;
    amber_free(info);
    if (!seen) usleep(5000);
  }
  RCHECK(seen); /* committed without anyone in wait */
  RCHECK(amber_global_writer_wait(gw) == 0);
  amber_global_save_stats st;
  RCHECK(amber_global_writer_save_stats(gw, &st) == 0 && st.part.kind == AMBER_KIND_DELTA);
  RCHECK(amber_global_writer_wait(gw) == 0); /* nothing in progress */
  amber_global_writer_close(gw);
}

static void test_any_thread_comm_commits_split_saves_in_the_background(void) {
  const char *p = tu_tmpdir();
  tc_flags = AMBER_COMM_ANY_THREAD;
  atomic_store(&rank_fails, 0);
  tc_run(3, background_main, (void *)p);
  CHECK(atomic_load(&rank_fails) == 0);
  check_read(p, 2, 2, 2, 0, 0);
  /* A failure in a background commit (step 4, a split save, on rank 1) reaches
   * every rank's wait, commits nothing, and the next step is full. */
  const char *q = tu_tmpdir();
  run_job(q, 3, 0, 1, 6, 1, 4, NULL);
  tc_flags = 0;
  amber_global_step_info *info;
  size_t n = 0;
  CHECK_OK(amber_global_list(q, &info, &n));
  CHECK(n == 5);
  if (n == 5) CHECK(info[3].step == 5 && info[3].kind == AMBER_KIND_FULL);
  amber_free(info);
  for (uint64_t s = 5; s <= 6; s++) check_read(q, s, s, 4, 1, 0);
}

/* Per-rank metadata, set_data and the confirm verdict: each rank's metadata comes
 * back as that rank's (rank 1 holds only a replicated tensor and still gets its
 * own); a repointed tensor is saved from its new memory; a rank that refuses its
 * part (confirm 0) fails the step on every rank, naming it. */
static void meta_main(const amber_comm *c, void *arg) {
  const char *path = arg;
  amber_global_writer *gw;
  RCHECK(amber_global_writer_open(&gw, path, c, NULL) == 0);
  if (!gw) return;
  int64_t n = 6, bn = BIAS;
  float w1[6], b[BIAS];
  for (int i = 0; i < 6; i++) w1[i] = -1.0f;
  for (int i = 0; i < BIAS; i++) b[i] = (float)i;
  /* rank 0 holds "w" whole; rank 1 only the replicated "b" */
  int64_t wl = c->rank == 0 ? n : 0;
  RCHECK(amber_global_writer_add(gw, "b", AMBER_F32, 1, &bn, NULL, NULL, b,
                                 AMBER_SHARD_REPLICATED) == 0);
  int64_t z = 0;
  float whole[6];
  for (int i = 0; i < 6; i++) whole[i] = (float)i * 2.0f;
  if (c->rank == 0) RCHECK(amber_global_writer_add(gw, "w", AMBER_F32, 1, &n, &z, &wl, w1, 0) == 0);
  char m[64];
  int ml = snprintf(m, sizeof m, "{\"rank\":%d}", c->rank);
  RCHECK(amber_global_writer_set_meta(gw, m, (size_t)ml) == 0);
  if (c->rank == 0) RCHECK(amber_global_writer_set_data(gw, 1, whole) == 0);
  RCHECK(amber_global_writer_set_data(gw, 7, whole) == AMBER_ERANGE);
  RCHECK(amber_global_writer_save(gw, 1, 0) == 0);
  /* step 2: rank 1 refuses its part */
  RCHECK(amber_global_writer_begin(gw, 2, AMBER_SAVE_CONFIRM) == 0);
  RCHECK(amber_global_writer_confirm(gw, c->rank != 1, "torn on purpose") == 0);
  int rc = amber_global_writer_wait(gw);
  RCHECK(rc == AMBER_ECHANGED);
  RCHECK(strstr(amber_last_error(gw), "rank 1 failed") != NULL);
  RCHECK(strstr(amber_last_error(gw), "torn on purpose") != NULL);
  /* step 3 confirmed everywhere */
  RCHECK(amber_global_writer_begin(gw, 3, AMBER_SAVE_CONFIRM) == 0);
  RCHECK(amber_global_writer_confirm(gw, 1, NULL) == 0);
  RCHECK(amber_global_writer_wait(gw) == 0);
  amber_global_writer_close(gw);
}

static void test_rank_metadata_set_data_and_confirm(void) {
  const char *p = tu_tmpdir();
  atomic_store(&rank_fails, 0);
  tc_run(2, meta_main, (void *)p);
  CHECK(atomic_load(&rank_fails) == 0);
  amber_global_reader *g;
  CHECK_OK(amber_global_reader_open(&g, p, AMBER_LATEST));
  if (!g) return;
  CHECK(amber_global_reader_step(g) == 3);
  for (uint32_t r = 0; r < 2; r++) {
    const char *json;
    size_t len;
    char want[64];
    snprintf(want, sizeof want, "{\"rank\":%u}", r);
    CHECK_OK(amber_global_reader_meta(g, r, &json, &len));
    CHECK(json && len == strlen(want) && !memcmp(json, want, len));
  }
  const char *json;
  size_t len;
  CHECK_RC(amber_global_reader_meta(g, 2, &json, &len), AMBER_ERANGE);
  size_t wi;
  float w[6];
  int64_t o = 0, n = 6;
  CHECK_OK(amber_global_reader_find(g, "w", &wi));
  CHECK_OK(amber_global_reader_read(g, wi, &o, &n, w, sizeof w));
  for (int i = 0; i < 6; i++) CHECK(w[i] == (float)i * 2.0f);
  amber_global_reader_close(g);
  CHECK_RC(amber_global_reader_open(&g, p, 2), AMBER_ENOENT);
}

/* A region read restores only the chunks of a shard that hold part of it: with a
 * row per chunk, a damaged row of rank 1's file fails exactly the reads that need
 * it (naming the corruption), and rows around it still read bit-exactly. */
static void test_region_read_restores_only_the_chunks_it_needs(void) {
  const char *p = tu_tmpdir();
  job jb = {p, 0, 1, 1, -1, 0, NULL, 0, 0, COLS, 0, 0}; /* by rows; one row per chunk */
  atomic_store(&rank_fails, 0);
  tc_run(2, rank_main, &jb);
  CHECK(atomic_load(&rank_fails) == 0);
  /* find the payload of rank 1's third row (global row ROWS/2 + 2) */
  char dir[4200], f[4300];
  snprintf(dir, sizeof dir, "%s/rank-00001", p);
  snprintf(f, sizeof f, "%s/ckpt-%020d.amber", dir, 1);
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY | AMBER_OPEN_NOCREATE;
  amber_store *st;
  CHECK_OK(amber_store_open(&st, dir, &so));
  if (!st) return;
  amber_reader *r;
  CHECK_OK(amber_reader_open(&r, st, 1, NULL));
  size_t li = 0;
  CHECK_OK(amber_reader_find(r, "w", &li));
  const amber__index *ix = amber__reader_index(r);
  const amber__tensor *t = &ix->tensors[li];
  CHECK(t->chunk_elems == COLS && t->n_chunks == ROWS / 2);
  const amber__chunk *ch = &ix->chunks[t->first_chunk + 2];
  long pos = (long)(ch->offset + ch->size / 2);
  amber_reader_close(r);
  amber_store_close(st);
  CHECK(tu_flip_byte(f, pos, 0x20) == 0);

  amber_global_reader *g;
  CHECK_OK(amber_global_reader_open(&g, p, 1));
  if (!g) return;
  size_t wi;
  CHECK_OK(amber_global_reader_find(g, "w", &wi));
  float got[ROWS * COLS], want[ROWS * COLS];
  /* rows ROWS/2 .. ROWS/2+1 and ROWS/2+3 .. end: everything but the damaged row */
  int64_t off[2] = {ROWS / 2, 0}, sh[2] = {2, COLS};
  fill_w(want, off, sh, 1);
  CHECK_OK(amber_global_reader_read(g, wi, off, sh, got, 2 * COLS * sizeof(float)));
  CHECK(memcmp(got, want, 2 * COLS * sizeof(float)) == 0);
  off[0] = ROWS / 2 + 3, sh[0] = ROWS / 2 - 3;
  fill_w(want, off, sh, 1);
  CHECK_OK(amber_global_reader_read(g, wi, off, sh, got, (size_t)sh[0] * COLS * sizeof(float)));
  CHECK(memcmp(got, want, (size_t)sh[0] * COLS * sizeof(float)) == 0);
  /* the damaged row, and a column (which crosses every row), fail */
  off[0] = ROWS / 2 + 2, sh[0] = 1;
  CHECK(amber_global_reader_read(g, wi, off, sh, got, COLS * sizeof(float)) == AMBER_ECORRUPT);
  CHECK(strstr(amber_last_error(g), "rank 1") != NULL);
  int64_t coff[2] = {0, 3}, csh[2] = {ROWS, 1};
  CHECK(amber_global_reader_read(g, wi, coff, csh, got, ROWS * sizeof(float)) == AMBER_ECORRUPT);
  CHECK(amber_global_reader_verify(g) < 0);
  amber_global_reader_close(g);
}

/* AMBER_SAVE_VOTED: the ranks agree on full or delta themselves (each asks
 * amber_global_writer_wants_full; a step is full when any rank wants it) and begin
 * takes the kind it is given, with no vote of its own. */
static void voted_rank(const amber_comm *c, void *arg) {
  const char *path = arg;
  amber_global_writer *gw;
  int rc = amber_global_writer_open(&gw, path, c, NULL);
  RCHECK(rc == 0);
  if (rc < 0) return;
  int64_t gshape[2] = {ROWS, COLS}, off[2], shape[2];
  part(c->rank, c->size, 0, off, shape);
  float *w = malloc((size_t)(shape[0] * shape[1]) * sizeof *w + 1), b[BIAS];
  int64_t bshape[1] = {BIAS};
  RCHECK(amber_global_writer_add(gw, "w", AMBER_F32, 2, gshape, off, shape, w, 0) == 0);
  RCHECK(amber_global_writer_add(gw, "b", AMBER_F32, 1, bshape, NULL, NULL, b,
                                 AMBER_SHARD_REPLICATED) == 0);
  /* step 1: every rank wants it full (the first); 2: none does; 3: forced by the caller
   * (whatever the cadence says after a dense delta) */
  int want[3] = {1, 0, -1};
  uint32_t extra[3] = {0, 0, AMBER_SAVE_FULL};
  for (uint64_t s = 1; s <= 3; s++) {
    fill_w(w, off, shape, s);
    for (int i = 0; i < BIAS; i++) b[i] = bval(i, s);
    int full = -1;
    RCHECK(amber_global_writer_wants_full(gw, s, 0, &full) == 0);
    RCHECK(want[s - 1] < 0 || full == want[s - 1]);
    uint32_t flags = AMBER_SAVE_VOTED | extra[s - 1] | (full ? AMBER_SAVE_FULL : 0);
    RCHECK(amber_global_writer_begin(gw, s, flags) == 0);
    RCHECK(amber_global_writer_wait(gw) == 0);
  }
  RCHECK(amber_global_writer_begin(gw, 4, AMBER_SAVE_VOTED | (1u << 7)) == AMBER_EINVAL);
  amber_global_writer_close(gw);
  free(w);
}

static void test_voted_begin_takes_the_kind_the_ranks_agreed_on(void) {
  const char *p = tu_tmpdir();
  atomic_store(&rank_fails, 0);
  tc_run(2, voted_rank, (void *)p);
  CHECK(atomic_load(&rank_fails) == 0);
  amber_global_step_info *info;
  size_t n;
  CHECK_OK(amber_global_list(p, &info, &n));
  CHECK(n == 3);
  if (n == 3) {
    CHECK(info[0].kind == AMBER_KIND_FULL);
    CHECK(info[1].kind == AMBER_KIND_DELTA);
    CHECK(info[2].kind == AMBER_KIND_FULL);
  }
  amber_free(info);
  check_read(p, 2, 2, 2, 0, 0);
  check_read(p, 3, 3, 1, 1, 0);
}

int main(void) {
  alarm(300); /* a rank stuck in a collective must not hang the suite */
  TEST_RUN(test_two_ranks_sharded_and_replicated_round_trip);
  TEST_RUN(test_failure_on_one_rank_commits_nothing_and_next_save_is_correct);
  TEST_RUN(test_leftovers_of_a_dead_rank_are_removed_by_the_next_writer);
  TEST_RUN(test_reshard_4_to_1_and_3_and_columns);
  TEST_RUN(test_reshard_1_to_4_and_columns_to_rows);
  TEST_RUN(test_delta_chain_across_ranks_and_world_size_change);
  TEST_RUN(test_first_step_after_a_world_size_change_is_full);
  TEST_RUN(test_a_rank_writer_seeded_after_a_load_saves_a_delta_reading_nothing);
  TEST_RUN(test_lossy_policy_resharded_within_bound);
  TEST_RUN(test_region_outside_or_wrong_size_is_refused);
  TEST_RUN(test_cli_ls_and_verify_on_a_multi_rank_store);
  TEST_RUN(test_shards_that_do_not_tile_fail_the_step_on_every_rank);
  TEST_RUN(test_golden_multi_rank_stores_load);
  TEST_RUN(test_one_rank_through_amber_comm_self);
  TEST_RUN(test_single_and_multi_rank_stores_do_not_open_as_each_other);
  TEST_RUN(test_save_stats_split_a_rank_part_from_the_global_commit);
  TEST_RUN(test_missing_rank_file_names_the_rank_and_tensor);
  TEST_RUN(test_prune_keeps_what_the_kept_steps_need);
  TEST_RUN(test_keep_last_in_the_global_writer_prunes_after_each_step);
  TEST_RUN(test_full_share_makes_whole_steps_full);
  TEST_RUN(test_a_lost_outcome_after_the_publish_leaves_the_step_whole);
  TEST_RUN(test_compact_makes_a_global_step_full_on_every_rank);
  TEST_RUN(test_compact_and_prune_refuse_while_a_global_writer_is_open);
  TEST_RUN(test_any_thread_comm_commits_split_saves_in_the_background);
  TEST_RUN(test_rank_metadata_set_data_and_confirm);
  TEST_RUN(test_region_read_restores_only_the_chunks_it_needs);
  TEST_RUN(test_voted_begin_takes_the_kind_the_ranks_agreed_on);
  return tu_finish();
}

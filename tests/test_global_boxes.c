/*
 * test_global_boxes.c - a rank that holds several boxes of one global tensor
 * (src/global.c, greader.c, manifest.c; FORMAT.md and DESIGN.md, "Many ranks"),
 * as PyTorch's ShardedTensor with a ChunkShardingSpec ["rank:0", "rank:1",
 * "rank:1", "rank:0"] or an EnumerableShardingSpec gives it, with ranks as threads
 * (tests/comm_threads.h). Interleaved row blocks and irregular 2-D blocks at 2 and
 * 3 ranks, saved as full and delta steps, resumed, and read back whole and as any
 * region by 1, 2 and 3 readers bit-exactly; the declarations a rank is refused; a
 * manifest whose boxes of one rank were swapped or moved is refused; policies
 * match every box by its global name; the CLI's verify and export; the golden
 * store of format 1.4 (tests/golden/v1.4-ranks2-multibox).
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "amber.h"
#include "comm_threads.h"
#include "global_files.h"
#include "global.h"
#include "testutil.h"

/* "w" (ROWS, COLS) in row chunks placed as a ChunkShardingSpec places them; "m"
 * (MR, MC) in irregular 2-D blocks; "v" (VLEN) one box per rank; "b" (BIAS)
 * replicated. */
#define ROWS 18
#define COLS 6
#define MR 9
#define MC 11
#define VLEN 10
#define BIAS 5
#define MAXBOX 8

typedef struct box {
  int64_t off[2], shape[2];
} box;

typedef struct tdef {
  const char *name;
  uint32_t ndim;
  int64_t shape[2];
  int id; /* for its values */
} tdef;

static const tdef T_W = {"w", 2, {ROWS, COLS}, 1}, T_M = {"m", 2, {MR, MC}, 2},
                  T_V = {"v", 1, {VLEN, 1}, 3}, T_B = {"b", 1, {BIAS, 1}, 4};

/* The value of element k (row-major in the global tensor) of tensor `id` at a
 * step: a few elements change per step, so later steps are deltas. */
static float val(int id, int64_t k, uint64_t step) {
  float base = (float)id * 1000.0f + (float)k * 0.25f;
  return (k % 7) == (int64_t)(step % 7) ? base + (float)step : base;
}

/* ChunkShardingSpec's placements of "w": ceil(ROWS / n) rows per chunk, chunk i on
 * rank place[i] (2 ranks: 5, 5, 5, 3 rows on 0, 1, 1, 0; 3 ranks: 3 rows each on
 * 0, 1, 2, 2, 1, 0). Returns how many boxes `rank` holds, in chunk order. */
static int w_boxes(int world, int rank, box *out) {
  static const int p2[] = {0, 1, 1, 0}, p3[] = {0, 1, 2, 2, 1, 0};
  const int *place = world == 2 ? p2 : p3;
  int k = world == 2 ? 4 : 6, n = 0;
  int64_t chunk = (ROWS + k - 1) / k;
  for (int i = 0; i < k; i++) {
    if (place[i] != rank) continue;
    int64_t a = chunk * i, b = a + chunk < ROWS ? a + chunk : ROWS;
    out[n++] = (box){{a, 0}, {b - a, COLS}};
  }
  return n;
}

/* An EnumerableShardingSpec of "m": six irregular blocks that tile (MR, MC). */
static const box M_BLOCKS[6] = {{{0, 0}, {4, 5}}, {{0, 5}, {4, 6}}, {{4, 0}, {5, 3}},
                                {{4, 3}, {2, 8}}, {{6, 3}, {3, 4}}, {{6, 7}, {3, 4}}};

/* 2 ranks: rank 0 holds blocks 0, 3, 5 and rank 1 blocks 1, 2, 4; 3 ranks: two each. */
static int m_boxes(int world, int rank, box *out) {
  static const int p2[] = {0, 1, 1, 0, 1, 0}, p3[] = {0, 1, 2, 0, 2, 1};
  const int *place = world == 2 ? p2 : p3;
  int n = 0;
  for (int i = 0; i < 6; i++)
    if (place[i] == rank) out[n++] = M_BLOCKS[i];
  return n;
}

static int64_t volume(const box *b, uint32_t ndim) {
  int64_t v = 1;
  for (uint32_t d = 0; d < ndim; d++) v *= b->shape[d];
  return v;
}

/* Fills `dst` with box `b` of tensor `t` at `step`. */
static void fill(const tdef *t, const box *b, uint64_t step, float *dst) {
  int64_t cols = t->ndim == 2 ? t->shape[1] : 1, bc = t->ndim == 2 ? b->shape[1] : 1;
  for (int64_t i = 0; i < b->shape[0]; i++)
    for (int64_t j = 0; j < bc; j++) {
      int64_t gi = b->off[0] + i, gj = (t->ndim == 2 ? b->off[1] : 0) + j;
      dst[i * bc + j] = val(t->id, gi * cols + gj, step);
    }
}

/* ---- the writers ---- */

typedef struct job {
  const char *path;
  uint64_t first, last;
  int reverse; /* each rank declares its boxes of a tensor in the other order */
} job;

typedef struct decl {
  const tdef *t;
  box b;
  float *data;
} decl;

static void reverse_boxes(box *b, int n) {
  for (int i = 0; i < n / 2; i++) {
    box x = b[i];
    b[i] = b[n - 1 - i], b[n - 1 - i] = x;
  }
}

/* This rank's declarations, interleaved so that a tensor's boxes are not adjacent
 * in declaration order: "b", then per k the k-th box of "w", "v" and "m". */
static size_t declare_all(amber_global_writer *gw, const amber_comm *c, int reverse,
                          decl *d) {
  box wb[MAXBOX], mb[MAXBOX];
  int nw = w_boxes(c->size, c->rank, wb), nm = m_boxes(c->size, c->rank, mb);
  if (reverse) reverse_boxes(wb, nw), reverse_boxes(mb, nm);
  size_t n = 0;
  int64_t bshape[1] = {BIAS};
  d[n].t = &T_B, d[n].b = (box){{0, 0}, {BIAS, 1}};
  d[n].data = calloc(BIAS, sizeof(float));
  RCHECK(amber_global_writer_add(gw, "b", AMBER_F32, 1, bshape, NULL, NULL, d[n].data,
                                 AMBER_SHARD_REPLICATED) == 0);
  n++;
  for (int k = 0; k < MAXBOX && (k < nw || k < nm || k == 0); k++) {
    if (k < nw) d[n++] = (decl){&T_W, wb[k], NULL};
    if (k == 0) {
      int64_t a = VLEN * c->rank / c->size, e = VLEN * (c->rank + 1) / c->size;
      d[n++] = (decl){&T_V, {{a, 0}, {e - a, 1}}, NULL};
    }
    if (k < nm) d[n++] = (decl){&T_M, mb[k], NULL};
  }
  for (size_t i = 1; i < n; i++) {
    d[i].data = calloc((size_t)volume(&d[i].b, d[i].t->ndim) + 1, sizeof(float));
    int rc = amber_global_writer_add(gw, d[i].t->name, AMBER_F32, d[i].t->ndim, d[i].t->shape,
                                     d[i].b.off, d[i].b.shape, d[i].data, 0);
    RCHECK(rc == 0);
  }
  return n;
}

static void rank_main(const amber_comm *c, void *arg) {
  const job *jb = arg;
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.chunk_elems = 8; /* several chunks per box: deltas change only some */
  wo.full_share = -1;
  amber_global_writer *gw = NULL;
  int rc = amber_global_writer_open(&gw, jb->path, c, &wo);
  RCHECK(rc == 0);
  if (rc < 0) return;
  decl d[4 * MAXBOX];
  size_t n = declare_all(gw, c, jb->reverse, d);
  for (uint64_t s = jb->first; s <= jb->last; s++) {
    for (size_t i = 0; i < n; i++) fill(d[i].t, &d[i].b, s, d[i].data);
    if (s % 2) {
      RCHECK(amber_global_writer_save(gw, s, 0) == 0);
    } else {
      RCHECK(amber_global_writer_begin(gw, s, 0) == 0);
      RCHECK(amber_global_writer_fence(gw) == 0);
      RCHECK(amber_global_writer_wait(gw) == 0);
    }
  }
  amber_global_writer_close(gw);
  for (size_t i = 0; i < n; i++) free(d[i].data);
}

static void run_job(const char *path, int world, uint64_t first, uint64_t last,
                    int reverse) {
  job jb = {path, first, last, reverse};
  atomic_store(&rank_fails, 0);
  tc_run(world, rank_main, &jb);
  CHECK(atomic_load(&rank_fails) == 0);
}

static void run(const char *path, int world, uint64_t first, uint64_t last) {
  run_job(path, world, first, last, 0);
}

/* ---- the readers ---- */

/* Reads box `b` of tensor `t` of `g` and checks it bit for bit against `want`'s
 * values: 0, the read's error, or 1 for other values. */
static int read_box(amber_global_reader *g, const tdef *t, const box *b, uint64_t want) {
  size_t index;
  int rc = amber_global_reader_find(g, t->name, &index);
  if (rc < 0) return rc;
  size_t n = (size_t)volume(b, t->ndim);
  float *got = malloc((n + 1) * sizeof *got), *exp = malloc((n + 1) * sizeof *exp);
  fill(t, b, want, exp);
  rc = amber_global_reader_read(g, index, b->off, b->shape, got, n * sizeof *got);
  if (rc == 0 && memcmp(got, exp, n * sizeof *got) != 0) {
    fprintf(stderr, "  tensor '%s' at [%lld, %lld] of shape [%lld, %lld]: other values\n",
            t->name, (long long)b->off[0], (long long)b->off[1], (long long)b->shape[0],
            (long long)b->shape[1]);
    rc = 1;
  }
  if (rc < 0) fprintf(stderr, "  tensor '%s': %s\n", t->name, amber_last_error(g));
  free(got);
  free(exp);
  return rc;
}

/* A random box inside tensor `t`: anywhere, of any size (empty too). */
static box random_box(const tdef *t, uint64_t *seed) {
  box b = {{0, 0}, {1, 1}};
  for (uint32_t d = 0; d < t->ndim; d++) {
    int64_t a = (int64_t)(tu_rand(seed) % (uint64_t)(t->shape[d] + 1));
    int64_t e = a + (int64_t)(tu_rand(seed) % (uint64_t)(t->shape[d] - a + 1));
    b.off[d] = a, b.shape[d] = e - a;
  }
  return b;
}

/* `nreaders` readers of step `step` (a job of that many ranks resuming: each opens
 * its own reader) each read their rows of every tensor and random regions; the
 * first also reads every tensor whole. Each must hold `want`'s values exactly. */
static void check_read(const char *path, uint64_t step, uint64_t want, int nreaders) {
  static const tdef *all[] = {&T_W, &T_M, &T_V, &T_B};
  uint64_t seed = 0x5eed0000u + step * 31 + (uint64_t)nreaders;
  for (int q = 0; q < nreaders; q++) {
    amber_global_reader *g = NULL;
    CHECK_OK(amber_global_reader_open(&g, path, step));
    if (!g) return;
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) {
      const tdef *t = all[i];
      box whole = {{0, 0}, {t->shape[0], t->shape[1]}};
      if (q == 0) CHECK(read_box(g, t, &whole, want) == 0);
      int64_t a = t->shape[0] * q / nreaders, e = t->shape[0] * (q + 1) / nreaders;
      box mine = {{a, 0}, {e - a, t->shape[1]}};
      CHECK(read_box(g, t, &mine, want) == 0);
      for (int k = 0; k < 6; k++) {
        box r = random_box(t, &seed);
        CHECK(read_box(g, t, &r, want) == 0);
      }
    }
    amber_global_reader_close(g);
  }
}

static uint32_t step_kind(const char *path, uint64_t step) {
  amber_global_step_info *gs = NULL;
  size_t n = 0;
  uint32_t kind = 99;
  CHECK_OK(amber_global_list(path, &gs, &n));
  for (size_t i = 0; i < n; i++)
    if (gs[i].step == step) kind = gs[i].kind;
  amber_free(gs);
  return kind;
}

/* The manifest's format_minor (bytes 10..11 of its header). */
static unsigned manifest_minor(const char *path, uint64_t step) {
  char f[4200];
  snprintf(f, sizeof f, "%s/step-%020llu.manifest", path, (unsigned long long)step);
  size_t len = 0;
  uint8_t *b = tu_read_file(f, &len);
  unsigned minor = b && len > 12 ? amber__get16(b + 10) : 0;
  free(b);
  return minor;
}

static void test_ranks_holding_several_boxes_round_trip_at_any_reader_count(void) {
  const char *p = tu_tmpdir();
  run(p, 2, 1, 3); /* full, then deltas */
  CHECK(step_kind(p, 1) == AMBER_KIND_FULL);
  CHECK(step_kind(p, 2) == AMBER_KIND_DELTA && step_kind(p, 3) == AMBER_KIND_DELTA);
  CHECK(manifest_minor(p, 1) == 4);
  for (uint64_t s = 1; s <= 3; s++)
    for (int n = 1; n <= 3; n++) check_read(p, s, s, n);
  /* resumed at the same world size: the deltas go on from each box's file tensor */
  run(p, 2, 4, 5);
  CHECK(step_kind(p, 4) == AMBER_KIND_DELTA && step_kind(p, 5) == AMBER_KIND_DELTA);
  for (int n = 1; n <= 3; n++) check_read(p, 5, 5, n);
  /* resumed at 3 ranks with other boxes: a full step, then deltas */
  run(p, 3, 6, 8);
  CHECK(step_kind(p, 6) == AMBER_KIND_FULL && step_kind(p, 8) == AMBER_KIND_DELTA);
  for (uint64_t s = 6; s <= 8; s++)
    for (int n = 1; n <= 3; n++) check_read(p, s, s, n);
  check_read(p, 4, 4, 2);
}

static void test_three_ranks_with_several_boxes_each_round_trip(void) {
  const char *p = tu_tmpdir();
  run(p, 3, 1, 4);
  CHECK(step_kind(p, 1) == AMBER_KIND_FULL && step_kind(p, 4) == AMBER_KIND_DELTA);
  for (uint64_t s = 1; s <= 4; s++)
    for (int n = 1; n <= 3; n++) check_read(p, s, s, n);
  /* compact makes step 4 full, its manifest keeps its shards (and its minor) */
  size_t files = 0;
  CHECK_OK(amber_global_compact(p, 4, &files));
  CHECK(step_kind(p, 4) == AMBER_KIND_FULL && manifest_minor(p, 4) == 4);
  for (int n = 1; n <= 3; n++) check_read(p, 4, 4, n);
  size_t removed = 0;
  CHECK_OK(amber_global_prune(p, 1, &removed));
  CHECK(removed == 3);
  check_read(p, 4, 4, 2);
}

/* A job resumed whose ranks declare their boxes in another order (a planner's order
 * may change): each box is then another tensor of the rank's file, the step is
 * written whole, and every step reads back as it was saved. */
static void test_boxes_declared_in_another_order_after_a_resume_read_back(void) {
  const char *p = tu_tmpdir();
  run(p, 2, 1, 2);
  run_job(p, 2, 3, 4, 1);
  for (uint64_t s = 1; s <= 4; s++) check_read(p, s, s, 2);
  CHECK(step_kind(p, 3) == AMBER_KIND_FULL && step_kind(p, 4) == AMBER_KIND_DELTA);
  run(p, 2, 5, 5);
  check_read(p, 5, 5, 3);
}

/* ---- what a rank's declarations may not do ---- */

static void test_second_box_that_disagrees_overlaps_or_mixes_is_refused(void) {
  const char *p = tu_tmpdir();
  amber_global_writer *gw = NULL;
  CHECK_OK(amber_global_writer_open(&gw, p, amber_comm_self(), NULL));
  if (!gw) return;
  float w[ROWS * COLS] = {0}, b[BIAS] = {0};
  int64_t g[2] = {ROWS, COLS}, g2[2] = {ROWS, COLS + 1}, bs[1] = {BIAS};
  int64_t o0[2] = {0, 0}, s0[2] = {5, COLS}, o1[2] = {10, 0}, s1[2] = {8, COLS};
  int64_t o2[2] = {3, 0}, s2[2] = {4, COLS}, o3[2] = {5, 0}, s3[2] = {5, COLS};
  CHECK_OK(amber_global_writer_add(gw, "w", AMBER_F32, 2, g, o0, s0, w, 0));
  CHECK_OK(amber_global_writer_add(gw, "w", AMBER_F32, 2, g, o1, s1, w, 0));
  /* another dtype, another global shape: both boxes named */
  CHECK_RC(amber_global_writer_add(gw, "w", AMBER_F16, 2, g, o3, s3, w, 0), AMBER_EINVAL);
  CHECK(strstr(amber_last_error(gw), "'w'") && strstr(amber_last_error(gw), "[5, 0]") &&
        strstr(amber_last_error(gw), "[0, 0]"));
  fprintf(stderr, "  (expected) %s\n", amber_last_error(gw));
  CHECK_RC(amber_global_writer_add(gw, "w", AMBER_F32, 2, g2, o3, s3, w, 0), AMBER_EINVAL);
  CHECK(strstr(amber_last_error(gw), "global shape") != NULL);
  fprintf(stderr, "  (expected) %s\n", amber_last_error(gw));
  CHECK_RC(amber_global_writer_add(gw, "w", AMBER_F32, 1, g, o3, s3, w, 0), AMBER_EINVAL);
  /* overlapping a box of this rank, or the same box again */
  CHECK_RC(amber_global_writer_add(gw, "w", AMBER_F32, 2, g, o2, s2, w, 0), AMBER_EEXIST);
  CHECK(strstr(amber_last_error(gw), "'w'") && strstr(amber_last_error(gw), "[3, 0]") &&
        strstr(amber_last_error(gw), "overlap"));
  fprintf(stderr, "  (expected) %s\n", amber_last_error(gw));
  CHECK_RC(amber_global_writer_add(gw, "w", AMBER_F32, 2, g, o1, s1, w, 0), AMBER_EEXIST);
  /* mixed with a replicated declaration, either way round */
  CHECK_RC(amber_global_writer_add(gw, "w", AMBER_F32, 2, g, NULL, NULL, w,
                                   AMBER_SHARD_REPLICATED), AMBER_EEXIST);
  CHECK(strstr(amber_last_error(gw), "replicated") != NULL);
  fprintf(stderr, "  (expected) %s\n", amber_last_error(gw));
  CHECK_OK(amber_global_writer_add(gw, "b", AMBER_F32, 1, bs, NULL, NULL, b,
                                   AMBER_SHARD_REPLICATED));
  int64_t bo[1] = {0}, bl[1] = {2};
  CHECK_RC(amber_global_writer_add(gw, "b", AMBER_F32, 1, bs, bo, bl, b, 0), AMBER_EEXIST);
  CHECK_RC(amber_global_writer_add(gw, "b", AMBER_F32, 1, bs, NULL, NULL, b,
                                   AMBER_SHARD_REPLICATED), AMBER_EEXIST);
  /* the names a rank's file gives its second and later boxes are amber's own */
  const char *reserved[] = {"amber.boxes", "amber.boxes/1/w", "amber.boxes/"};
  for (size_t i = 0; i < sizeof reserved / sizeof *reserved; i++) {
    CHECK_RC(amber_global_writer_add(gw, reserved[i], AMBER_F32, 2, g, o3, s3, w, 0),
             AMBER_EINVAL);
    CHECK(strstr(amber_last_error(gw), "amber's own") != NULL);
  }
  /* a third box that fits: the refusals took no index */
  CHECK_OK(amber_global_writer_add(gw, "w", AMBER_F32, 2, g, o3, s3, w, 0));
  uint32_t kind;
  CHECK_OK(amber_global_writer_plan(gw, 1, 0, &kind));
  amber_tensor_info ti;
  CHECK_OK(amber_global_writer_info(gw, 3, &ti));
  CHECK(ti.ndim == 2 && ti.shape[0] == 5 && ti.shape[1] == COLS);
  CHECK_RC(amber_global_writer_info(gw, 4, &ti), AMBER_ERANGE);
  CHECK_OK(amber_global_writer_save(gw, 1, 0));
  amber_global_writer_close(gw);
  amber_global_reader *r = NULL;
  CHECK_OK(amber_global_reader_open(&r, p, 1));
  if (!r) return;
  amber_global_tensor gt;
  size_t wi = 9;
  CHECK_OK(amber_global_reader_find(r, "w", &wi));
  CHECK_OK(amber_global_reader_tensor(r, wi, &gt));
  CHECK(gt.nshards == 3);
  amber_global_reader_close(r);
}

/* A policy names global tensors: it applies to every box of one, whatever name the
 * rank's file gives the box. */
static void test_policy_applies_to_every_box_of_a_tensor(void) {
  const char *p = tu_tmpdir();
  amber_global_writer *gw = NULL;
  CHECK_OK(amber_global_writer_open(&gw, p, amber_comm_self(), NULL));
  if (!gw) return;
  float w[ROWS * COLS] = {0};
  int64_t g[2] = {ROWS, COLS}, o0[2] = {0, 0}, s0[2] = {9, COLS}, o1[2] = {9, 0};
  CHECK_OK(amber_global_writer_add(gw, "w", AMBER_F32, 2, g, o0, s0, w, 0));
  CHECK_OK(amber_global_writer_add(gw, "w", AMBER_F32, 2, g, o1, s0, w + 9 * COLS, 0));
  CHECK_OK(amber_global_writer_add_policy(gw, "w=threshold:0.5"));
  uint32_t kind;
  CHECK_OK(amber_global_writer_plan(gw, 1, 0, &kind));
  for (size_t i = 0; i < 2; i++) {
    amber_tensor_info ti;
    CHECK_OK(amber_global_writer_info(gw, i, &ti));
    CHECK(ti.policy && !strncmp(ti.policy, "threshold:0.5", 13));
  }
  CHECK_OK(amber_global_writer_save(gw, 1, 0));
  amber_global_writer_close(gw);
}

/* ---- a manifest that does not match the rank files ---- */

static amber__mtensor *tensor(amber__manifest *m, const char *name) {
  for (uint32_t i = 0; i < m->ntensors; i++)
    if (!strcmp(m->tensors[i].name, name)) return &m->tensors[i];
  return &m->tensors[0];
}

/* The k-th shard of rank r in tensor t's list. */
static amber__mshard *shard(amber__mtensor *t, uint32_t r, int k) {
  for (uint32_t s = 0; s < t->nshards; s++)
    if (t->shards[s].rank == r && k-- == 0) return &t->shards[s];
  return &t->shards[0];
}

static void swap_boxes(amber__mshard *a, amber__mshard *b) {
  amber__mshard x = *a;
  memcpy(a->off, b->off, sizeof a->off), memcpy(a->shape, b->shape, sizeof a->shape);
  memcpy(b->off, x.off, sizeof b->off), memcpy(b->shape, x.shape, sizeof b->shape);
}

/* rank 1's two row chunks of "w" (the same shape): only the box table tells them apart */
static void swap_same_shape(amber__manifest *m) {
  amber__mtensor *t = tensor(m, "w");
  swap_boxes(shard(t, 1, 0), shard(t, 1, 1));
}
/* rank 0's first and last blocks of "m" (other shapes) */
static void swap_other_shape(amber__manifest *m) {
  amber__mtensor *t = tensor(m, "m");
  swap_boxes(shard(t, 0, 0), shard(t, 0, 2));
}
/* the same boxes, rank 0's listed in the other order */
static void reorder(amber__manifest *m) {
  amber__mtensor *t = tensor(m, "w");
  amber__mshard *a = shard(t, 0, 0), *b = shard(t, 0, 1), x = *a;
  *a = *b, *b = x;
}
/* rank 0's first chunk of "w" and rank 1's first (both 5 rows) trade ranks */
static void trade_ranks(amber__manifest *m) {
  amber__mtensor *t = tensor(m, "w");
  amber__mshard *a = shard(t, 0, 0), *b = shard(t, 1, 0);
  a->rank = 1, b->rank = 0;
}

static void test_manifest_with_boxes_of_a_rank_swapped_is_refused(void) {
  static const struct {
    const char *what;
    void (*fn)(amber__manifest *);
  } cases[] = {{"two boxes of one shape swapped", swap_same_shape},
               {"two boxes of other shapes swapped", swap_other_shape},
               {"a rank's boxes listed in another order", reorder},
               {"boxes traded between ranks", trade_ranks}};
  const char *orig = tu_tmpdir();
  run(orig, 2, 1, 2);
  for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
    const char *p = tu_tmpdir();
    CHECK(tu_system("cp -r %s/. %s", orig, p) == 0);
    tg_patch_manifest(p, 2, cases[k].fn);
    amber_global_reader *g = NULL;
    int rc = amber_global_reader_open(&g, p, 2);
    if (rc == 0) rc = amber_global_reader_verify(g);
    CHECK_RC(rc, AMBER_ECORRUPT);
    fprintf(stderr, "  (expected, %s) %s\n", cases[k].what,
            g ? amber_last_error(g) : amber_last_error(NULL));
    CHECK(strstr(g ? amber_last_error(g) : amber_last_error(NULL), "rank ") != NULL);
    amber_global_reader_close(g);
    check_read(p, 1, 1, 1); /* the step before is untouched */
  }
}

/* ---- the CLI ---- */

/* The bytes of tensor `name` in safetensors file `st` (len bytes), or NULL. */
static const uint8_t *st_tensor(const uint8_t *st, size_t len, const char *name,
                                size_t *nbytes) {
  uint64_t hl = 0;
  if (len < 8) return NULL;
  memcpy(&hl, st, 8);
  if (hl > len - 8) return NULL;
  char *h = malloc(hl + 1), key[64];
  memcpy(h, st + 8, hl), h[hl] = 0;
  snprintf(key, sizeof key, "\"%s\"", name);
  const char *at = strstr(h, key), *o = at ? strstr(at, "data_offsets") : NULL;
  unsigned long long a = 0, b = 0;
  int ok = o && (o = strchr(o, '[')) && sscanf(o, "[ %llu , %llu ]", &a, &b) == 2 && a <= b &&
           8 + hl + b <= len;
  free(h);
  if (!ok) return NULL;
  *nbytes = (size_t)(b - a);
  return st + 8 + hl + a;
}

static void test_cli_verifies_and_exports_a_store_with_several_boxes_per_rank(void) {
  const char *p = tu_tmpdir();
  run(p, 2, 1, 2);
  char out[4200];
  CHECK(tu_system("%s verify %s > /dev/null", AMBER_CLI, p) == 0);
  snprintf(out, sizeof out, "%s/info.json", tu_tmpdir());
  CHECK(tu_system("%s info %s --json > %s", AMBER_CLI, p, out) == 0);
  size_t len = 0;
  char *txt = (char *)tu_read_file(out, &len);
  CHECK(txt && strstr(txt, "\"shards\": 6")); /* "m": six blocks of two ranks */
  free(txt);
  snprintf(out, sizeof out, "%s/x.safetensors", tu_tmpdir());
  CHECK(tu_system("%s export %s -o %s > /dev/null", AMBER_CLI, p, out) == 0);
  uint8_t *st = tu_read_file(out, &len);
  static const tdef *all[] = {&T_W, &T_M, &T_V, &T_B};
  for (size_t i = 0; st && i < sizeof all / sizeof *all; i++) {
    const tdef *t = all[i];
    box whole = {{0, 0}, {t->shape[0], t->shape[1]}};
    size_t n = (size_t)volume(&whole, t->ndim), nb = 0;
    float *want = malloc(n * sizeof *want);
    fill(t, &whole, 2, want);
    const uint8_t *got = st_tensor(st, len, t->name, &nb);
    CHECK(got && nb == n * sizeof *want && !memcmp(got, want, nb));
    free(want);
  }
  CHECK(st != NULL);
  free(st);
  /* a rank's second box damaged: verify fails and names the rank */
  char f[4200];
  snprintf(f, sizeof f, "%s/rank-00001/ckpt-%020d.amber", p, 1);
  CHECK(tu_flip_byte(f, 100, 0x10) == 0);
  snprintf(out, sizeof out, "%s/verify.txt", tu_tmpdir());
  CHECK(tu_system("%s verify %s > %s 2>&1", AMBER_CLI, p, out) != 0);
  txt = (char *)tu_read_file(out, &len);
  CHECK(txt && strstr(txt, "rank 1"));
  free(txt);
}

/* ---- golden ---- */

/* Rank r's box table of `step`, parsed here by FORMAT.md (not by the library):
 * each of the file's tensors is named by the rule of "Many ranks" (the first box
 * of a global tensor by its name, the k-th `amber.boxes/<k>/<name>`), with its
 * global shape and offsets. */
static void check_box_table(const char *path, int r, uint64_t step) {
  amber_store *st;
  amber_reader *rd;
  CHECK_OK(tg_rank_reader(path, r, step, &st, &rd));
  size_t li;
  amber_tensor_info ti;
  uint8_t t[4096];
  if (!rd || amber_reader_find(rd, "amber.boxes", &li) != 0 ||
      amber_reader_info(rd, li, &ti) != 0 || ti.nbytes > sizeof t) {
    CHECK(!"a box table in the rank's file");
    amber_reader_close(rd);
    amber_store_close(st);
    return;
  }
  CHECK_OK(amber_reader_read(rd, li, t, ti.nbytes));
  /* the file's tensors, in declaration order, as declare_all makes them */
  box wb[MAXBOX], mb[MAXBOX];
  int nw = w_boxes(2, r, wb), nm = m_boxes(2, r, mb);
  char names[4 * MAXBOX][64];
  const tdef *defs[4 * MAXBOX];
  box boxes[4 * MAXBOX];
  size_t n = 0;
  if (r == 0) snprintf(names[n], 64, "b"), defs[n] = &T_B, boxes[n++] = (box){{0, 0}, {BIAS}};
  for (int k = 0; k < nw || k < nm || k == 0; k++) {
    if (k < nw) {
      snprintf(names[n], 64, k ? "amber.boxes/%d/w" : "w", k);
      defs[n] = &T_W, boxes[n++] = wb[k];
    }
    if (k == 0) {
      snprintf(names[n], 64, "v");
      defs[n] = &T_V, boxes[n++] = (box){{VLEN * r / 2, 0}, {VLEN / 2, 1}};
    }
    if (k < nm) {
      snprintf(names[n], 64, k ? "amber.boxes/%d/m" : "m", k);
      defs[n] = &T_M, boxes[n++] = mb[k];
    }
  }
  CHECK(amber_reader_count(rd) == n + 1);
  CHECK(!memcmp(t, "AMBERBX1", 8) && amber__get32(t + 8) == n && amber__get32(t + 12) == 0);
  const uint8_t *b = t + 16, *end = t + ti.nbytes;
  for (size_t i = 0; i < n && b + 4 <= end; i++) {
    size_t nl = amber__get16(b);
    uint32_t nd = b[2];
    CHECK(nl == strlen(names[i]) && !memcmp(b + 4, names[i], nl) && nd == defs[i]->ndim);
    b += 4 + nl;
    for (uint32_t d = 0; d < nd; d++) CHECK(amber__get64(b + 8 * d) == (uint64_t)defs[i]->shape[d]);
    b += 8 * nd;
    for (uint32_t d = 0; d < nd; d++) CHECK(amber__get64(b + 8 * d) == (uint64_t)boxes[i].off[d]);
    b += 8 * nd;
    size_t fi;
    amber_tensor_info fti;
    CHECK(amber_reader_find(rd, names[i], &fi) == 0 && fi == i); /* the file's tensor i */
    CHECK(amber_reader_info(rd, i, &fti) == 0 && fti.shape[0] == boxes[i].shape[0]);
  }
  CHECK(b == end);
  amber_reader_close(rd);
  amber_store_close(st);
}

/* A golden store of format 1.4: 3 steps at 2 ranks (full, delta, delta) with
 * several boxes per rank. Its values load at 1, 2 and 3 readers, its manifests say
 * minor 4, and each rank file's box table holds its boxes byte for byte. With
 * AMBER_WRITE_GOLDEN set, (re)writes it into tests/golden/. */
static void test_golden_store_with_several_boxes_per_rank_loads(void) {
  char p[4200];
  snprintf(p, sizeof p, "%s/tests/golden/v1.4-ranks2-multibox", AMBER_SOURCE_DIR);
  if (getenv("AMBER_WRITE_GOLDEN")) {
    tu_rm_rf(p);
    run(p, 2, 1, 3);
    tu_system("find %s -name .lock -delete", p);
  }
  for (uint64_t s = 1; s <= 3; s++) {
    CHECK(manifest_minor(p, s) == 4);
    for (int n = 1; n <= 3; n++) check_read(p, s, s, n);
    for (int r = 0; r < 2; r++) check_box_table(p, r, s);
  }
  CHECK(step_kind(p, 1) == AMBER_KIND_FULL && step_kind(p, 3) == AMBER_KIND_DELTA);
}

int main(void) {
  alarm(300); /* a rank stuck in a collective must not hang the suite */
  TEST_RUN(test_ranks_holding_several_boxes_round_trip_at_any_reader_count);
  TEST_RUN(test_three_ranks_with_several_boxes_each_round_trip);
  TEST_RUN(test_boxes_declared_in_another_order_after_a_resume_read_back);
  TEST_RUN(test_second_box_that_disagrees_overlaps_or_mixes_is_refused);
  TEST_RUN(test_policy_applies_to_every_box_of_a_tensor);
  TEST_RUN(test_manifest_with_boxes_of_a_rank_swapped_is_refused);
  TEST_RUN(test_cli_verifies_and_exports_a_store_with_several_boxes_per_rank);
  TEST_RUN(test_golden_store_with_several_boxes_per_rank_loads);
  return tu_finish();
}

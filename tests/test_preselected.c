/*
 * test_preselected.c - pre-selected tensors (amber_writer_add_preselected,
 * amber_writer_plan, amber_writer_set_selection): a caller that selects on its
 * own device and keeps its own reference hands amber only the selected elements.
 *
 * The "device" here is the test itself: it runs the library's own scan kernel on
 * its own copy of the reference, with the arguments a CPU-path delta uses, and
 * hands what it selected to the writer. So both paths make the same selection,
 * and a store written through pre-selected chunks must restore exactly what a
 * store written by the CPU path restores, at every step, for every policy. Bad
 * selections (unsorted or out-of-range indices, wrong counts, none at all) fail
 * with a clear error and commit nothing.
 */
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>

#include "internal.h"
#include "policy.h"
#include "scan.h"
#include "testutil.h"

#define N_P 10000u /* the pre-selected tensor: chunks of 4096, a tail of 1808 */
#define N_Q 3000u  /* an i32 pre-selected tensor: always exact */
#define N_C 5000u  /* a tensor the writer scans itself */
#define N_H 6000u  /* a bf16 pre-selected tensor: compared in f32 */
#define CHUNK 4096u

/* What a device keeps for one pre-selected tensor: its reference, the buffers
 * its selection goes to, and the chunk selections handed to the writer. */
typedef struct dev {
  int dtype;
  size_t n, w, chunk;
  uint8_t *live, *ref;
  uint32_t *keys, *idx;
  uint8_t *vals, *olds;
  amber_chunk_sel sel[8];
  size_t nchunks;
} dev;

static void dev_init(dev *d, int dtype, size_t n, uint8_t *live) {
  memset(d, 0, sizeof *d);
  d->dtype = dtype;
  d->n = n;
  d->w = amber_dtype_size(dtype);
  d->live = live;
  d->ref = calloc(n, d->w);
  d->keys = calloc(n, 4);
  d->idx = calloc(n, 4);
  d->vals = calloc(n, d->w);
  d->olds = calloc(n, d->w);
}

static void dev_free(dev *d) {
  free(d->ref);
  free(d->keys);
  free(d->idx);
  free(d->vals);
  free(d->olds);
}

/* Selects every chunk of `d` for the writer's next save, as chunk.c would:
 * whole chunks for a full save or a dense selection (and the reference takes
 * the whole chunk), else the scan's selection, which moves the reference. */
static void dev_select(dev *d, amber_writer *w, size_t index, int full) {
  amber_tensor_info info;
  CHECK_OK(amber_writer_info(w, index, &info));
  amber__policy pol = {0};
  CHECK(amber__policy_parse(info.policy, &pol) == 0);
  d->chunk = (size_t)info.chunk_elems;
  d->nchunks = (size_t)info.nchunks;
  CHECK(d->nchunks <= 8);
  for (size_t j = 0; j < d->nchunks && j < 8; j++) {
    size_t base = j * d->chunk, n = d->n - base < d->chunk ? d->n - base : d->chunk;
    uint8_t *live = d->live + base * d->w, *ref = d->ref + base * d->w;
    amber_chunk_sel *s = &d->sel[j];
    if (full) {
      memcpy(ref, live, n * d->w);
      *s = (amber_chunk_sel){.count = AMBER_SELECT_WHOLE, .vals = live};
      continue;
    }
    amber__scan_args a = {.kind = AMBER__SCAN_EXACT, .dtype = d->dtype, .n = n, .live = live,
                          .ref = ref, .keys = d->keys, .idx = d->idx + base,
                          .vals = d->vals + base * d->w, .olds = d->olds};
    if (pol.kind == AMBER__POL_THRESHOLD) {
      a.kind = AMBER__SCAN_THRESHOLD;
      a.abs = pol.abs;
      a.rel = pol.rel;
    } else if (pol.kind == AMBER__POL_BUDGET) {
      a.kind = AMBER__SCAN_BUDGET;
      a.cap = pol.cap;
      a.budget = (size_t)(pol.frac * (double)n);
      if (!a.budget && pol.frac > 0) a.budget = 1;
    }
    size_t k = amber__scan(&a);
    if (1 + (n + 7) / 8 + k * d->w >= n * d->w) { /* dense: cheaper whole */
      memcpy(ref, live, n * d->w);
      *s = (amber_chunk_sel){.count = AMBER_SELECT_WHOLE, .vals = live};
    } else {
      *s = (amber_chunk_sel){.count = k, .idx = a.idx, .vals = a.vals};
    }
  }
}

/* A training-like step: every element moves a little, a few move a lot. */
static void step_f32(float *x, size_t n, uint64_t *rng) {
  for (size_t i = 0; i < n; i++) {
    double u = (double)(tu_rand(rng) >> 11) / 9007199254740992.0 - 0.5;
    x[i] += (float)(u * ((tu_rand(rng) & 63) == 0 ? 0.5 : 2e-3));
  }
}

/* bf16 moves by whole units of its last place, a few elements by more */
static void step_bf16(uint16_t *x, size_t n, uint64_t *rng) {
  for (size_t i = 0; i < n; i++) {
    uint64_t u = tu_rand(rng);
    if ((u & 7) == 0) x[i] = (uint16_t)(x[i] + (u >> 8) % 5 - 2);
    if ((u & 255) == 1) x[i] = (uint16_t)(x[i] ^ 0x0100); /* a larger jump */
  }
}

static void step_i32(int32_t *x, size_t n, uint64_t *rng) {
  for (size_t i = 0; i < n; i++)
    if ((tu_rand(rng) & 31) == 0) x[i] += (int32_t)(tu_rand(rng) % 7) - 3;
}

/* Restores tensor `name` of the latest step of `st` into buf; 0 on success. */
static int restore(amber_store *st, const char *name, void *buf, size_t bytes) {
  amber_reader *r = NULL;
  size_t i;
  int rc = amber_reader_open(&r, st, AMBER_LATEST, NULL);
  if (!rc) rc = amber_reader_find(r, name, &i);
  if (!rc) rc = amber_reader_read(r, i, buf, bytes);
  amber_reader_close(r);
  return rc;
}

static amber_writer *open_writer(amber_store **st, const char *dir, uint32_t full_every) {
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.chunk_elems = CHUNK;
  wo.full_every = full_every;
  wo.full_share = -1;
  amber_writer *w = NULL;
  CHECK_OK(amber_store_open(st, dir, NULL));
  if (*st) CHECK_OK(amber_writer_open(&w, *st, &wo));
  return w;
}

static void add_rules(amber_writer *w, const char *policy) {
  CHECK_OK(amber_writer_add_policy(w, policy));
  CHECK_OK(amber_writer_add_policy(w, "c=threshold:1e-3"));
}

/* One trajectory under `policy` for tensor p, saved twice: by the CPU path
 * (every tensor scanned by the writer) and with p, q and h pre-selected. */
static void same_restore_as_cpu_path(const char *policy) {
  float *p = calloc(N_P, 4), *c = calloc(N_C, 4);
  int32_t *q = calloc(N_Q, 4);
  float *got = calloc(N_P, 4), *want = calloc(N_P, 4);
  int32_t *qgot = calloc(N_Q, 4), *qwant = calloc(N_Q, 4);
  uint16_t *h = calloc(N_H, 2), *hgot = calloc(N_H, 2), *hwant = calloc(N_H, 2);
  for (size_t i = 0; i < N_H; i++) h[i] = (uint16_t)(0x3f80 + i % 200); /* 1.0 .. 1.8 */
  float *cgot = calloc(N_C, 4), *cwant = calloc(N_C, 4);
  uint64_t rng = 1234;
  tu_fill_random(p, N_P * 4, 1);
  for (size_t i = 0; i < N_P; i++) p[i] = (float)(i % 97) * 0.01f; /* finite */
  for (size_t i = 0; i < N_C; i++) c[i] = (float)(i % 13) * 0.1f;
  const char *dir_cpu = tu_tmpdir(), *dir_dev = tu_tmpdir();
  amber_store *sa = NULL, *sb = NULL;
  amber_writer *wa = open_writer(&sa, dir_cpu, 6), *wb = open_writer(&sb, dir_dev, 6);
  int64_t sp = N_P, sq = N_Q, sc = N_C, sh = N_H;
  size_t ip = 9, iq = 9, ih = 9;
  CHECK_OK(amber_writer_add(wa, "p", AMBER_F32, 1, &sp, p, NULL));
  CHECK_OK(amber_writer_add(wa, "q", AMBER_I32, 1, &sq, q, NULL));
  CHECK_OK(amber_writer_add(wa, "c", AMBER_F32, 1, &sc, c, NULL));
  CHECK_OK(amber_writer_add(wa, "h", AMBER_BF16, 1, &sh, h, NULL));
  CHECK_OK(amber_writer_add_preselected(wb, "p", AMBER_F32, 1, &sp, &ip));
  CHECK_OK(amber_writer_add_preselected(wb, "q", AMBER_I32, 1, &sq, &iq));
  CHECK_OK(amber_writer_add(wb, "c", AMBER_F32, 1, &sc, c, NULL));
  CHECK_OK(amber_writer_add_preselected(wb, "h", AMBER_BF16, 1, &sh, &ih));
  add_rules(wa, policy);
  add_rules(wb, policy);
  dev dp, dq, dh;
  dev_init(&dp, AMBER_F32, N_P, (uint8_t *)p);
  dev_init(&dq, AMBER_I32, N_Q, (uint8_t *)q);
  dev_init(&dh, AMBER_BF16, N_H, (uint8_t *)h);
  int deltas = 0;
  for (uint64_t s = 1; s <= 14 && wa && wb && !tu_failures; s++) {
    if (s > 1) {
      step_f32(p, N_P, &rng);
      step_f32(c, N_C, &rng);
      step_i32(q, N_Q, &rng);
      step_bf16(h, N_H, &rng);
    }
    if (s == 9) p[77] = NAN; /* a change to NaN is always stored */
    if (s == 10) p[77] = 1.5f;
    uint32_t kind = 9;
    CHECK_OK(amber_writer_plan(wb, s, 0, &kind));
    deltas += kind == AMBER_KIND_DELTA;
    dev_select(&dp, wb, ip, kind == AMBER_KIND_FULL);
    dev_select(&dq, wb, iq, kind == AMBER_KIND_FULL);
    dev_select(&dh, wb, ih, kind == AMBER_KIND_FULL);
    CHECK_OK(amber_writer_set_selection(wb, ip, dp.sel, dp.nchunks));
    CHECK_OK(amber_writer_set_selection(wb, iq, dq.sel, dq.nchunks));
    CHECK_OK(amber_writer_set_selection(wb, ih, dh.sel, dh.nchunks));
    CHECK_OK(amber_writer_save(wa, s, 0));
    if (s % 2) { /* the split save too */
      CHECK_OK(amber_writer_begin(wb, s, 0));
      CHECK_OK(amber_writer_fence(wb));
      CHECK_OK(amber_writer_wait(wb));
    } else {
      CHECK_OK(amber_writer_save(wb, s, 0));
    }
    CHECK_OK(restore(sa, "p", want, N_P * 4));
    CHECK_OK(restore(sb, "p", got, N_P * 4));
    CHECK_OK(restore(sa, "q", qwant, N_Q * 4));
    CHECK_OK(restore(sb, "q", qgot, N_Q * 4));
    CHECK_OK(restore(sa, "h", hwant, N_H * 2));
    CHECK_OK(restore(sb, "h", hgot, N_H * 2));
    CHECK(memcmp(hgot, hwant, N_H * 2) == 0);
    CHECK(memcmp(hgot, dh.ref, N_H * 2) == 0);
    CHECK_OK(restore(sa, "c", cwant, N_C * 4));
    CHECK_OK(restore(sb, "c", cgot, N_C * 4));
    CHECK(memcmp(got, want, N_P * 4) == 0);
    CHECK(memcmp(qgot, qwant, N_Q * 4) == 0);
    CHECK(memcmp(qgot, q, N_Q * 4) == 0); /* integers are exact */
    CHECK(memcmp(cgot, cwant, N_C * 4) == 0);
    /* the device's reference is the restore */
    CHECK(memcmp(got, dp.ref, N_P * 4) == 0);
    CHECK(memcmp(qgot, dq.ref, N_Q * 4) == 0);
    if (tu_failures) fprintf(stderr, "  policy %s, step %" PRIu64 "\n", policy, s);
  }
  CHECK(deltas >= 10); /* fulls at steps 1 and 8 */
  amber_writer_close(wa);
  amber_writer_close(wb);
  amber_store_close(sa);
  amber_store_close(sb);
  dev_free(&dp);
  dev_free(&dq);
  dev_free(&dh);
  free(h), free(hgot), free(hwant);
  free(p), free(c), free(q), free(got), free(want), free(qgot), free(qwant);
  free(cgot), free(cwant);
}

static void test_exact_selection_restores_as_the_cpu_path(void) {
  same_restore_as_cpu_path("exact");
}

static void test_threshold_selection_restores_as_the_cpu_path(void) {
  same_restore_as_cpu_path("[ph]=threshold:1e-3:1e-2");
}

static void test_budget_selection_restores_as_the_cpu_path(void) {
  same_restore_as_cpu_path("[ph]=budget:0.02:0.05");
}

/* A writer with one pre-selected f32 tensor of N_P elements, at its first
 * (full) save committed as step 1. */
typedef struct one {
  amber_store *st;
  amber_writer *w;
  float *x;
  dev d;
  size_t i;
} one;

static void one_open(one *o) {
  memset(o, 0, sizeof *o);
  o->x = calloc(N_P, 4);
  for (size_t i = 0; i < N_P; i++) o->x[i] = (float)i;
  o->w = open_writer(&o->st, tu_tmpdir(), 50);
  int64_t shape = N_P;
  if (!o->w) return;
  CHECK_OK(amber_writer_add_preselected(o->w, "p", AMBER_F32, 1, &shape, &o->i));
  dev_init(&o->d, AMBER_F32, N_P, (uint8_t *)o->x);
  uint32_t kind;
  CHECK_OK(amber_writer_plan(o->w, 1, 0, &kind));
  CHECK(kind == AMBER_KIND_FULL);
  dev_select(&o->d, o->w, o->i, 1);
  CHECK_OK(amber_writer_set_selection(o->w, o->i, o->d.sel, o->d.nchunks));
  CHECK_OK(amber_writer_save(o->w, 1, 0));
}

static void one_close(one *o) {
  amber_writer_close(o->w);
  amber_store_close(o->st);
  dev_free(&o->d);
  free(o->x);
}

static uint64_t latest(amber_store *st) {
  uint64_t s = 0;
  CHECK_OK(amber_store_latest(st, &s));
  return s;
}

/* A bad selection for step 2: the save fails with AMBER_EINVAL, its message
 * holds `says`, and the store stays at step 1 with step 1's values. */
static void check_refused(one *o, int rc, const char *says) {
  CHECK_RC(rc, AMBER_EINVAL);
  const char *msg = amber_last_error(o->w);
  if (!strstr(msg, says)) {
    fprintf(stderr, "  message \"%s\" does not say \"%s\"\n", msg, says);
    tu_failures++;
  }
  CHECK(latest(o->st) == 1);
  float *back = calloc(N_P, 4);
  CHECK_OK(restore(o->st, "p", back, N_P * 4));
  for (size_t i = 0; i < N_P; i++)
    if (back[i] != (float)i) {
      CHECK(back[i] == (float)i);
      break;
    }
  free(back);
}

static void test_bad_indices_fail_the_save_and_commit_nothing(void) {
  one o;
  one_open(&o);
  uint32_t idx[3] = {5, 3, 9};
  float vals[3] = {1, 2, 3};
  uint32_t kind;
  amber_chunk_sel sel[3] = {{0}, {0}, {0}};
  /* unsorted, then out of range (the tail chunk holds 1808 elements), in sync
   * and split saves */
  for (int c = 0; c < 4; c++) {
    if (c >= 2) idx[1] = 1808 + 2;
    else idx[1] = 3;
    idx[2] = c >= 2 ? 1808 + 5 : 9;
    CHECK_OK(amber_writer_plan(o.w, 2, 0, &kind));
    CHECK(kind == AMBER_KIND_DELTA);
    sel[2] = (amber_chunk_sel){.count = 3, .idx = idx, .vals = vals};
    CHECK_OK(amber_writer_set_selection(o.w, o.i, sel, 3));
    int rc;
    if (c % 2) {
      CHECK_OK(amber_writer_begin(o.w, 2, 0));
      rc = amber_writer_wait(o.w);
    } else {
      rc = amber_writer_save(o.w, 2, 0);
    }
    check_refused(&o, rc, c >= 2 ? "past the chunk's end" : "not above the one before it");
    CHECK(strstr(amber_last_error(o.w), "tensor 'p', chunk 2") != NULL);
  }
  /* the writer goes on: a good selection commits */
  CHECK_OK(amber_writer_plan(o.w, 2, 0, &kind));
  idx[1] = 7;
  idx[2] = 9;
  CHECK_OK(amber_writer_set_selection(o.w, o.i, sel, 3));
  CHECK_OK(amber_writer_save(o.w, 2, 0));
  float *back = calloc(N_P, 4);
  CHECK_OK(restore(o.st, "p", back, N_P * 4));
  CHECK(back[2 * CHUNK + 5] == 1 && back[2 * CHUNK + 7] == 2 && back[2 * CHUNK + 9] == 3);
  CHECK(back[2 * CHUNK + 6] == (float)(2 * CHUNK + 6) && back[0] == 0);
  free(back);
  one_close(&o);
}

static void test_bad_counts_are_refused_before_the_save(void) {
  one o;
  one_open(&o);
  uint32_t kind, idx[1] = {0};
  float vals[1] = {1};
  amber_chunk_sel sel[3] = {{0}, {0}, {0}};
  CHECK_OK(amber_writer_plan(o.w, 2, 0, &kind));
  /* the wrong number of chunks */
  check_refused(&o, amber_writer_set_selection(o.w, o.i, sel, 2), "2 selections were given");
  /* more than a chunk holds */
  sel[2].count = 1809;
  sel[2].idx = idx;
  sel[2].vals = vals;
  check_refused(&o, amber_writer_set_selection(o.w, o.i, sel, 3), "1809 elements selected");
  /* no indices */
  sel[2] = (amber_chunk_sel){.count = 1, .vals = vals};
  check_refused(&o, amber_writer_set_selection(o.w, o.i, sel, 3), "no indices");
  /* no selection at all for the save */
  check_refused(&o, amber_writer_save(o.w, 2, 0), "has no selection");
  /* a full save needs whole chunks */
  CHECK_OK(amber_writer_plan(o.w, 2, AMBER_SAVE_FULL, &kind));
  CHECK(kind == AMBER_KIND_FULL);
  sel[2] = (amber_chunk_sel){.count = 1, .idx = idx, .vals = vals};
  CHECK_OK(amber_writer_set_selection(o.w, o.i, sel, 3));
  check_refused(&o, amber_writer_save(o.w, 2, AMBER_SAVE_FULL), "is not AMBER_SELECT_WHOLE");
  /* a save consumes its selection: the next one needs its own */
  CHECK_OK(amber_writer_plan(o.w, 2, 0, &kind));
  sel[2] = (amber_chunk_sel){0};
  CHECK_OK(amber_writer_set_selection(o.w, o.i, sel, 3));
  CHECK_OK(amber_writer_save(o.w, 2, 0));
  CHECK(latest(o.st) == 2);
  CHECK_RC(amber_writer_save(o.w, 3, 0), AMBER_EINVAL);
  CHECK(latest(o.st) == 2);
  /* what a pre-selected tensor is not */
  CHECK_RC(amber_writer_set_data(o.w, o.i, o.x), AMBER_EINVAL);
  one_close(&o);
}

static void test_selection_needs_a_plan_and_a_preselected_tensor(void) {
  amber_store *st = NULL;
  amber_writer *w = open_writer(&st, tu_tmpdir(), 50);
  float x[4] = {0};
  int64_t shape = 4;
  size_t ip, ic;
  amber_chunk_sel sel = {.count = AMBER_SELECT_WHOLE, .vals = x};
  CHECK_OK(amber_writer_add_preselected(w, "p", AMBER_F32, 1, &shape, &ip));
  CHECK_OK(amber_writer_add(w, "c", AMBER_F32, 1, &shape, x, &ic));
  CHECK_RC(amber_writer_set_selection(w, ip, &sel, 1), AMBER_EINVAL); /* before a plan */
  CHECK(strstr(amber_last_error(w), "amber_writer_plan") != NULL);
  uint32_t kind;
  CHECK_OK(amber_writer_plan(w, 5, 0, &kind));
  CHECK_RC(amber_writer_set_selection(w, ic, &sel, 1), AMBER_EINVAL);
  CHECK(strstr(amber_last_error(w), "not pre-selected") != NULL);
  amber_tensor_info info;
  CHECK_OK(amber_writer_info(w, ip, &info));
  CHECK(info.nchunks == 1 && info.chunk_elems == CHUNK && !strcmp(info.policy, "exact"));
  CHECK_RC(amber_writer_info(w, 2, &info), AMBER_ERANGE);
  CHECK_OK(amber_writer_set_selection(w, ip, &sel, 1));
  CHECK_OK(amber_writer_save(w, 5, 0));
  CHECK_RC(amber_writer_plan(w, 5, 0, &kind), AMBER_EEXIST);
  amber_writer_close(w);
  amber_store_close(st);
}

/* The plan's kind is the save's, with the cadence (full_every 2) and when forced. */
static void test_plan_tells_the_kind_of_the_save(void) {
  one o;
  one_open(&o);
  amber_writer_close(o.w);
  amber_store_close(o.st);
  o.w = open_writer(&o.st, tu_tmpdir(), 2);
  int64_t shape = N_P;
  CHECK_OK(amber_writer_add_preselected(o.w, "p", AMBER_F32, 1, &shape, &o.i));
  const char *want = "FDDFDDF";
  for (uint64_t s = 1; s <= 7; s++) {
    uint32_t kind, flags = s == 7 ? AMBER_SAVE_FULL : 0;
    CHECK_OK(amber_writer_plan(o.w, s, flags, &kind));
    CHECK((kind == AMBER_KIND_FULL) == (want[s - 1] == 'F'));
    dev_select(&o.d, o.w, o.i, kind == AMBER_KIND_FULL);
    CHECK_OK(amber_writer_set_selection(o.w, o.i, o.d.sel, o.d.nchunks));
    CHECK_OK(amber_writer_save(o.w, s, flags));
    amber_ckpt_info *info = NULL;
    size_t n = 0;
    CHECK_OK(amber_store_list(o.st, &info, &n));
    CHECK(n == s && info[n - 1].kind == kind);
    amber_free(info);
    o.x[s * 100] += 1;
  }
  one_close(&o);
}

/* A source (amber_writer_set_source) that streams: a full save's chunks are copied
 * from the "device" (the test's array) into one reused slot per worker, as a GPU's
 * go through a ring of pinned buffers; a delta's come from dev_select's selection.
 * It checks that a worker never has two calls in flight and counts the calls. */
typedef struct streamer {
  dev *d;
  int full;
  int fail;                 /* nonzero: return this from chunk fail_at */
  uint64_t fail_at;
  uint8_t *slot[16];        /* one chunk's bytes per worker */
  int busy[16];
  int calls, overlap, max_worker;
  pthread_mutex_t mu;
} streamer;

static int stream_chunk(void *user, int worker, size_t index, uint64_t j, amber_chunk_sel *sel) {
  streamer *s = user;
  (void)index;
  if (worker < 0 || worker >= 16) return AMBER_ERANGE;
  pthread_mutex_lock(&s->mu);
  s->calls++;
  if (worker > s->max_worker) s->max_worker = worker;
  if (s->busy[worker]++) s->overlap++;
  pthread_mutex_unlock(&s->mu);
  int rc = 0;
  if (s->fail && j == s->fail_at) {
    rc = s->fail;
  } else if (s->full) {
    size_t base = (size_t)j * s->d->chunk, n = s->d->n - base < s->d->chunk ? s->d->n - base
                                                                            : s->d->chunk;
    memcpy(s->slot[worker], s->d->live + base * s->d->w, n * s->d->w);
    memcpy(s->d->ref + base * s->d->w, s->slot[worker], n * s->d->w);
    *sel = (amber_chunk_sel){.count = AMBER_SELECT_WHOLE, .vals = s->slot[worker]};
  } else {
    *sel = s->d->sel[j];
  }
  pthread_mutex_lock(&s->mu);
  s->busy[worker]--;
  pthread_mutex_unlock(&s->mu);
  return rc;
}

/* Saves through a source restore what saves through set_selection restore; the
 * full ones never hold more than a chunk per worker; a failing source fails the
 * save, names the tensor and chunk, and commits nothing; a selection given for a
 * save wins over the source. */
static void test_a_source_streams_the_chunks(void) {
  one o;
  one_open(&o); /* step 1: full, through set_selection */
  streamer s = {.d = &o.d};
  pthread_mutex_init(&s.mu, NULL);
  for (int k = 0; k < 16; k++) s.slot[k] = calloc(CHUNK, 4);
  CHECK_OK(amber_writer_set_source(o.w, o.i, stream_chunk, &s));
  uint64_t rng = 7;
  float *back = calloc(N_P, 4);
  for (uint64_t step = 2; step <= 7; step++) {
    step_f32(o.x, N_P, &rng);
    uint32_t kind, flags = step % 3 == 0 ? AMBER_SAVE_FULL : 0;
    CHECK_OK(amber_writer_plan(o.w, step, flags, &kind));
    s.full = kind == AMBER_KIND_FULL;
    CHECK(s.full == (step % 3 == 0));
    if (!s.full) dev_select(&o.d, o.w, o.i, 0); /* exact: every change */
    else CHECK_OK(amber_writer_info(o.w, o.i, &(amber_tensor_info){0}));
    s.calls = 0;
    if (step % 2) { /* begin, fence, wait as a training loop does */
      CHECK_OK(amber_writer_begin(o.w, step, flags));
      CHECK_OK(amber_writer_wait(o.w));
    } else {
      CHECK_OK(amber_writer_save(o.w, step, flags));
    }
    CHECK(s.calls == 3); /* once per chunk */
    CHECK_OK(restore(o.st, "p", back, N_P * 4));
    CHECK(memcmp(back, o.x, N_P * 4) == 0);
  }
  CHECK(s.overlap == 0);
  /* a source that fails: the code comes back, the store stays at step 7 */
  s.fail = AMBER_ENOSPC;
  s.fail_at = 1;
  step_f32(o.x, N_P, &rng);
  s.full = 1;
  CHECK_RC(amber_writer_save(o.w, 8, AMBER_SAVE_FULL), AMBER_ENOSPC);
  CHECK(strstr(amber_last_error(o.w), "tensor 'p', chunk 1: its chunk source failed") != NULL);
  CHECK(latest(o.st) == 7);
  s.fail = 12345; /* not an amber code: AMBER_EIO */
  CHECK_RC(amber_writer_save(o.w, 8, AMBER_SAVE_FULL), AMBER_EIO);
  CHECK(latest(o.st) == 7);
  s.fail = 0;
  /* a delta answer to a full save is refused */
  s.full = 0;
  dev_select(&o.d, o.w, o.i, 0);
  CHECK_RC(amber_writer_save(o.w, 8, AMBER_SAVE_FULL), AMBER_EINVAL);
  CHECK(strstr(amber_last_error(o.w), "is not AMBER_SELECT_WHOLE") != NULL);
  CHECK(latest(o.st) == 7);
  /* a selection given for the save wins; the source is not asked */
  uint32_t kind;
  CHECK_OK(amber_writer_plan(o.w, 8, AMBER_SAVE_FULL, &kind));
  dev_select(&o.d, o.w, o.i, 1);
  CHECK_OK(amber_writer_set_selection(o.w, o.i, o.d.sel, o.d.nchunks));
  s.calls = 0;
  CHECK_OK(amber_writer_save(o.w, 8, AMBER_SAVE_FULL));
  CHECK(s.calls == 0);
  CHECK_OK(restore(o.st, "p", back, N_P * 4));
  CHECK(memcmp(back, o.x, N_P * 4) == 0);
  /* removed: the next save has nothing to take */
  CHECK_OK(amber_writer_set_source(o.w, o.i, NULL, NULL));
  CHECK_RC(amber_writer_save(o.w, 9, 0), AMBER_EINVAL);
  CHECK(strstr(amber_last_error(o.w), "has no selection") != NULL);
  CHECK_RC(amber_writer_set_source(o.w, 5, stream_chunk, &s), AMBER_EINVAL);
  free(back);
  for (int k = 0; k < 16; k++) free(s.slot[k]);
  pthread_mutex_destroy(&s.mu);
  one_close(&o);
}

/* A tensor the writer reads itself has no source. */
static void test_a_source_needs_a_preselected_tensor(void) {
  amber_store *st = NULL;
  amber_writer *w = open_writer(&st, tu_tmpdir(), 50);
  float x[4] = {0};
  int64_t shape = 4;
  size_t ic;
  CHECK_OK(amber_writer_add(w, "c", AMBER_F32, 1, &shape, x, &ic));
  CHECK_RC(amber_writer_set_source(w, ic, stream_chunk, NULL), AMBER_EINVAL);
  CHECK(strstr(amber_last_error(w), "not pre-selected") != NULL);
  CHECK_RC(amber_writer_set_source(NULL, 0, NULL, NULL), AMBER_EINVAL);
  amber_writer_close(w);
  amber_store_close(st);
}

int main(void) {
  TEST_RUN(test_exact_selection_restores_as_the_cpu_path);
  TEST_RUN(test_threshold_selection_restores_as_the_cpu_path);
  TEST_RUN(test_budget_selection_restores_as_the_cpu_path);
  TEST_RUN(test_bad_indices_fail_the_save_and_commit_nothing);
  TEST_RUN(test_bad_counts_are_refused_before_the_save);
  TEST_RUN(test_selection_needs_a_plan_and_a_preselected_tensor);
  TEST_RUN(test_plan_tells_the_kind_of_the_save);
  TEST_RUN(test_a_source_streams_the_chunks);
  TEST_RUN(test_a_source_needs_a_preselected_tensor);
  return tu_finish();
}

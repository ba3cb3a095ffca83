/*
 * test_delta_cadence.c - when a save is full and when a delta (docs/DESIGN.md,
 * "Cadence"): full_every, full_share and the back-off after dense deltas,
 * AMBER_SAVE_FULL, the cadence carried across a reopen; a reopened writer goes on
 * with deltas, or saves a full when the declared tensors differ; and the sizes:
 * a sparse exact delta is small, unchanged tensors take payload-free chunks.
 */
#include <inttypes.h>
#include <stdlib.h>

#include "ckpt.h"
#include "format.h"
#include "internal.h"
#include "trajectory.h"

/* The kinds as a string, "FDDD..."; parents of deltas must be the previous step. */
static void kinds_of(amber_store *st, char *out, size_t cap) {
  amber_ckpt_info *info = NULL;
  size_t n = 0;
  CHECK_OK(amber_store_list(st, &info, &n));
  size_t k = 0;
  for (size_t i = 0; i < n && k + 1 < cap; i++) {
    out[k++] = info[i].kind == AMBER_KIND_FULL ? 'F' : 'D';
    if (info[i].kind == AMBER_KIND_DELTA) CHECK(i > 0 && info[i].parent == info[i - 1].step);
    else CHECK(info[i].parent == AMBER_NO_STEP);
  }
  out[k] = 0;
  amber_free(info);
}

static void test_full_every_sets_the_cadence(void) {
  small S;
  small_init(&S, 700);
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.full_every = 3;
  wo.full_share = -1;
  small_open(&S, tu_tmpdir(), &wo);
  for (uint64_t s = 1; S.w && s <= 11; s++) {
    small_step(&S, 0.05);
    CHECK_OK(amber_writer_save(S.w, s, 0));
  }
  char kinds[64];
  kinds_of(S.st, kinds, sizeof kinds);
  CHECK(!strcmp(kinds, "FDDDFDDDFDD"));
  if (strcmp(kinds, "FDDDFDDDFDD")) DETAIL("full_every=3 gave kinds %s\n", kinds);
  small_close(&S);
}

static void test_small_full_share_makes_fulls_more_often(void) {
  int fulls[2] = {0, 0};
  const double shares[2] = {0.01, 0}; /* 0: the default */
  for (int c = 0; c < 2; c++) {
    small S;
    small_init(&S, 710);
    amber_writer_opts wo;
    amber_writer_opts_init(&wo);
    wo.full_share = shares[c];
    small_open(&S, tu_tmpdir(), &wo);
    for (uint64_t s = 1; S.w && s <= 12; s++) {
      small_step(&S, 0.05); /* a delta of ~5% of the elements: > 1% of a full */
      CHECK_OK(amber_writer_save(S.w, s, 0));
    }
    char kinds[64];
    kinds_of(S.st, kinds, sizeof kinds);
    for (char *k = kinds; *k; k++) fulls[c] += *k == 'F';
    if (c == 0) {
      /* each delta alone is above the share: the writer backs off, 1, 2, 4 fulls */
      CHECK(!strcmp(kinds, "FDFDFFDFFFFD"));
      if (strcmp(kinds, "FDFDFFDFFFFD")) DETAIL("full_share=0.01 gave kinds %s\n", kinds);
    }
    small_close(&S);
  }
  CHECK(fulls[0] == 8 && fulls[1] < fulls[0]);
}

/* Deltas as big as a full (dense changes under the exact policy) are not worth
 * writing: after one, the writer writes fulls, twice as many each time, up to 32,
 * and goes back to deltas as soon as one is small again. full_share < 0 keeps
 * every save a delta. */
static void test_dense_deltas_back_off_to_fulls_and_recover(void) {
  for (int c = 0; c < 2; c++) {
    small S;
    small_init(&S, 730 + (uint64_t)c);
    amber_writer_opts wo;
    amber_writer_opts_init(&wo);
    wo.full_share = c ? -1 : 0;
    wo.full_every = UINT32_MAX;
    small_open(&S, tu_tmpdir(), &wo);
    uint64_t s = 0;
    for (int i = 0; S.w && i < 70; i++) { /* every element changes: deltas ~ a full */
      small_step(&S, 1.0);
      CHECK_OK(amber_writer_save(S.w, ++s, 0));
    }
    for (int i = 0; S.w && i < 40; i++) { /* then 1% of them */
      small_step(&S, 0.01);
      CHECK_OK(amber_writer_save(S.w, ++s, 0));
    }
    char kinds[200];
    kinds_of(S.st, kinds, sizeof kinds);
    if (c == 0) {
      /* F D F D FF D FFFF D FFFFFFFF D (16 F) D (32 F) D ..., then deltas once small */
      const char *want = "FDFDFFDFFFFDFFFFFFFFDFFFFFFFFFFFFFFFFDFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFD";
      CHECK(!strncmp(kinds, want, strlen(want)));
      if (strncmp(kinds, want, strlen(want))) DETAIL("dense deltas gave kinds %s\n", kinds);
      /* the first small delta resets the back-off: deltas from then on, up to
       * full_share's own cadence */
      size_t fulls_late = 0;
      for (size_t i = 72; i < strlen(kinds); i++) fulls_late += kinds[i] == 'F';
      CHECK(fulls_late <= 3 && !strstr(kinds + 72, "FF"));
      if (fulls_late > 3 || strstr(kinds + 72, "FF"))
        DETAIL("after the changes became sparse: %s\n", kinds + 70);
    } else {
      size_t fulls = 0;
      for (char *k = kinds; *k; k++) fulls += *k == 'F';
      CHECK(fulls == 1);
    }
    small_close(&S);
  }
}

static void test_save_full_flag_forces_a_full(void) {
  small S;
  small_init(&S, 720);
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.full_every = UINT32_MAX;
  wo.full_share = -1;
  small_open(&S, tu_tmpdir(), &wo);
  for (uint64_t s = 1; S.w && s <= 6; s++) {
    small_step(&S, 0.02);
    CHECK_OK(amber_writer_save(S.w, s, s == 4 ? AMBER_SAVE_FULL : 0));
  }
  char kinds[64];
  kinds_of(S.st, kinds, sizeof kinds);
  CHECK(!strcmp(kinds, "FDDFDD"));
  small_close(&S);
}

static void test_cadence_continues_across_reopen(void) {
  small S;
  small_init(&S, 730);
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.full_every = 3;
  wo.full_share = -1;
  const char *dir = tu_tmpdir();
  uint64_t s = 1;
  for (int session = 0; session < 3; session++) {
    small_open(&S, dir, &wo);
    for (int k = 0; S.w && k < 3; k++, s++) {
      small_step(&S, 0.05);
      CHECK_OK(amber_writer_save(S.w, s, 0));
    }
    if (session < 2) small_close(&S);
  }
  char kinds[64];
  kinds_of(S.st, kinds, sizeof kinds);
  CHECK(!strcmp(kinds, "FDDDFDDDF"));
  if (strcmp(kinds, "FDDDFDDDF")) DETAIL("full_every=3 over reopens gave kinds %s\n", kinds);
  small_close(&S);
}

/* ---- reopening ---- */

static void test_reopened_writer_continues_with_deltas(void) {
  const pol p = thr(1e-3, 1e-2, "threshold:1e-3:1e-2");
  const pol e = EXACT;
  for (int c = 0; c < 2; c++) {
    world W;
    world_init(&W, 800 + (uint64_t)c, 1);
    add_standard(&W, 64, c ? &e : &p);
    amber_writer_opts wo;
    tu_deltas_only(&wo, 64);
    const char *rules[] = {c ? NULL : p.spec, NULL};
    uint64_t s = 1;
    for (int session = 0; session < 3; session++) {
      if (!world_open(&W, &wo, rules)) break;
      for (int k = 0; k < 8; k++, s++) {
        if (s > 1) world_mutate(&W);
        int kind = save_check(&W, s, 0);
        CHECK(kind == (int)(s == 1 ? AMBER_KIND_FULL : AMBER_KIND_DELTA));
      }
      world_close(&W);
    }
    world_free(&W);
  }
}

/* One tensor "w" declared with the given shape, dtype and chunk; returns the kind
 * of the saved step. */
static int save_one(const char *dir, uint64_t step, int dt, int64_t n, uint64_t chunk,
                    const char *extra) {
  amber_store *st = NULL;
  amber_writer *w = NULL;
  int kind = -1;
  CHECK_OK(amber_store_open(&st, dir, NULL));
  if (!st) return -1;
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.chunk_elems = chunk;
  CHECK_OK(amber_writer_open(&w, st, &wo));
  uint8_t *buf = malloc((size_t)n * 8 + 8);
  tu_fill_random(buf, (size_t)n * 8 + 8, step);
  for (int64_t i = 0; i < n && is_float(dt); i++) /* finite small values */
    put_f(AMBER_F32, buf + 4 * i, (double)(i % 17));
  if (w) {
    CHECK_OK(amber_writer_add(w, "w", dt, 1, &n, buf, NULL));
    int64_t one = 1;
    if (extra) CHECK_OK(amber_writer_add(w, extra, AMBER_F32, 1, &one, buf, NULL));
    CHECK_OK(amber_writer_save(w, step, 0));
    amber_reader *r = NULL;
    CHECK_OK(amber_reader_open(&r, st, step, NULL));
    if (r) {
      amber_ckpt_info ci;
      amber_reader_ckpt_info(r, &ci);
      kind = (int)ci.kind;
      uint8_t *got = malloc((size_t)n * amber_dtype_size(dt) + 1);
      CHECK_OK(amber_reader_read(r, 0, got, (uint64_t)n * amber_dtype_size(dt)));
      CHECK(memcmp(got, buf, (size_t)n * amber_dtype_size(dt)) == 0);
      free(got);
    }
    amber_reader_close(r);
  }
  amber_writer_close(w);
  amber_store_close(st);
  free(buf);
  return kind;
}

static void test_reopened_writer_with_other_tensors_saves_full(void) {
  const char *dir = tu_tmpdir();
  uint64_t s = 1;
  CHECK(save_one(dir, s++, AMBER_F32, 100, 64, NULL) == AMBER_KIND_FULL);
  CHECK(save_one(dir, s++, AMBER_F32, 100, 64, NULL) == AMBER_KIND_DELTA);
  CHECK(save_one(dir, s++, AMBER_F32, 101, 64, NULL) == AMBER_KIND_FULL);  /* other shape */
  CHECK(save_one(dir, s++, AMBER_F32, 101, 64, NULL) == AMBER_KIND_DELTA);
  CHECK(save_one(dir, s++, AMBER_I32, 101, 64, NULL) == AMBER_KIND_FULL);  /* other dtype */
  CHECK(save_one(dir, s++, AMBER_I32, 101, 32, NULL) == AMBER_KIND_FULL);  /* other chunks */
  CHECK(save_one(dir, s++, AMBER_I32, 101, 32, "z") == AMBER_KIND_FULL);   /* one more */
  CHECK(save_one(dir, s++, AMBER_I32, 101, 32, "z") == AMBER_KIND_DELTA);
  CHECK(save_one(dir, s++, AMBER_I32, 101, 32, NULL) == AMBER_KIND_FULL);  /* one fewer */
  /* without a chunk size of its own, a writer adopts the store's and goes on */
  CHECK(save_one(dir, s++, AMBER_I32, 101, 0, NULL) == AMBER_KIND_DELTA);
}

/* ---- sizes ---- */

static void test_sparse_exact_delta_is_small(void) {
  const int64_t n = 1 << 20;
  const uint64_t chunks[2] = {0, 65536};
  for (int c = 0; c < 2; c++) {
    const char *dir = tu_tmpdir();
    float *x = malloc((size_t)n * 4), *y = malloc((size_t)n * 4);
    uint64_t rng = 900 + (uint64_t)c;
    for (int64_t i = 0; i < n; i++) x[i] = (float)(urand(&rng) * 2 - 1) * 0.05f;
    amber_store *st = NULL;
    amber_writer *w = NULL;
    amber_writer_opts wo;
    amber_writer_opts_init(&wo);
    wo.chunk_elems = chunks[c];
    CHECK_OK(amber_store_open(&st, dir, NULL));
    CHECK_OK(amber_writer_open(&w, st, &wo));
    CHECK_OK(amber_writer_add(w, "big", AMBER_F32, 1, &n, x, NULL));
    CHECK_OK(amber_writer_save(w, 1, 0));
    for (uint64_t s = 2; s <= 4; s++) {
      size_t changed = 0;
      for (int64_t k = 0; k < n / 100; k++) {
        size_t i = (size_t)(tu_rand(&rng) % (uint64_t)n);
        x[i] += x[i] * 1e-3f + 1e-6f;
        changed++;
      }
      CHECK_OK(amber_writer_save(w, s, 0));
      amber_reader *r = NULL;
      CHECK_OK(amber_reader_open(&r, st, s, NULL));
      if (!r) continue;
      amber_tensor_info ti;
      CHECK_OK(amber_reader_info(r, 0, &ti));
      CHECK(ti.stored_elems > 0 && ti.stored_elems <= changed);
      CHECK_OK(amber_reader_read(r, 0, y, (uint64_t)n * 4));
      CHECK(memcmp(x, y, (size_t)n * 4) == 0);
      amber_reader_close(r);
    }
    amber_ckpt_info *info = NULL;
    size_t cnt = 0;
    CHECK_OK(amber_store_list(st, &info, &cnt));
    CHECK(cnt == 4);
    for (size_t i = 1; i < cnt; i++) {
      CHECK(info[i].kind == AMBER_KIND_DELTA);
      CHECK((double)info[i].bytes < 0.03 * (double)info[0].bytes);
      if ((double)info[i].bytes >= 0.03 * (double)info[0].bytes)
        DETAIL("chunk %" PRIu64 ": delta %zu is %" PRIu64 " bytes, full %" PRIu64 "\n", chunks[c],
               i, info[i].bytes, info[0].bytes);
    }
    amber_free(info);
    amber_writer_close(w);
    amber_store_close(st);
    free(x);
    free(y);
    tu_rm_rf(dir);
  }
}

static void test_unchanged_tensors_have_payload_free_chunks(void) {
  world W;
  world_init(&W, 950, 0);
  const pol t = thr(1e-3, 0, "threshold:1e-3");
  add_tensor(&W, "moving", AMBER_F32, 1, 1000, 0, &EXACT);
  add_tensor(&W, "still.f32", AMBER_F32, 1, 1000, 0, &EXACT);
  add_tensor(&W, "still.bf16", AMBER_BF16, 2, 30, 70, &t);
  add_tensor(&W, "still.i64", AMBER_I64, 1, 300, 0, &EXACT);
  amber_writer_opts wo;
  tu_deltas_only(&wo, 128);
  const char *rules[] = {"still.bf16=threshold:1e-3", NULL};
  if (world_open(&W, &wo, rules)) {
    for (uint64_t s = 1; s <= 5; s++) {
      for (size_t e = 0; s > 1 && e < W.t[0].n; e++) drift(AMBER_F32, W.t[0].live + 4 * e, &W.rng, 0);
      save_check(&W, s, 0);
      if (s == 1) continue;
      amber_reader *r = NULL;
      CHECK_OK(amber_reader_open(&r, W.st, s, NULL));
      for (size_t i = 0; r && i < W.n; i++) {
        amber_tensor_info ti;
        CHECK_OK(amber_reader_info(r, i, &ti));
        if (i == 0) CHECK(ti.stored_bytes > 0);
        else CHECK(ti.stored_bytes == 0 && ti.stored_elems == 0 && ti.nchunks > 1);
      }
      amber_reader_close(r);
      amber__err e;
      amber__ckpt c;
      CHECK_OK(amber__ckpt_open(&e, W.st, s, &c));
      for (uint64_t j = W.t[0].n / 128 + 1; j < c.ix.n_chunks; j++)
        CHECK(c.ix.chunks[j].encoding == AMBER__ENC_UNCHANGED && c.ix.chunks[j].size == 0);
      amber__ckpt_close(&c);
    }
  }
  world_close(&W);
  world_free(&W);
}

int main(void) {
  TEST_RUN(test_full_every_sets_the_cadence);
  TEST_RUN(test_small_full_share_makes_fulls_more_often);
  TEST_RUN(test_dense_deltas_back_off_to_fulls_and_recover);
  TEST_RUN(test_save_full_flag_forces_a_full);
  TEST_RUN(test_cadence_continues_across_reopen);
  TEST_RUN(test_reopened_writer_continues_with_deltas);
  TEST_RUN(test_reopened_writer_with_other_tensors_saves_full);
  TEST_RUN(test_sparse_exact_delta_is_small);
  TEST_RUN(test_unchanged_tensors_have_payload_free_chunks);
  return tu_finish();
}

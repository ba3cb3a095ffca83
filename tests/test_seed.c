/*
 * test_seed.c - seeding a writer's reference from memory that holds a restored
 * step (amber_writer_seed_reference), the resume path of a training run.
 *
 * After a restore of the latest step into the tensors, a new writer seeded from
 * it saves a delta at once, without reading the store (a damaged payload of that
 * step goes unnoticed by the seed), restores bit-exactly, keeps the store's
 * cadence, and under lossy policies writes exactly the files that a writer that
 * loaded its reference from the store writes. Seeding from a step that is not
 * the latest, from an empty store or with other declarations fails clearly.
 */
#include <stdlib.h>
#include <unistd.h>

#include "testutil.h"

#define N 300000 /* several chunks of 65536 */
#define M 1000

typedef struct state {
  float x[N];
  int32_t c[M];
} state;

static void mutate(state *s, int step) {
  for (int i = step; i < N; i += 61) s->x[i] += 0.001f * (float)(i % 7 + 1);
  for (int i = step; i < N; i += 4099) s->x[i] += 3.0f;
  s->c[step % M]++;
}

static amber_store *open_store(const char *dir, uint32_t threads) {
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.threads = threads;
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, dir, &so));
  return st;
}

/* A writer of `s` (x, c) with default options but full_every. */
static amber_writer *open_writer(amber_store *st, state *s, const char *policy,
                                 uint32_t full_every) {
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.full_every = full_every;
  amber_writer *w = NULL;
  CHECK_OK(amber_writer_open(&w, st, &wo));
  if (!w) return NULL;
  int64_t n = N, m = M;
  CHECK_OK(amber_writer_add(w, "x", AMBER_F32, 1, &n, s->x, NULL));
  CHECK_OK(amber_writer_add(w, "c", AMBER_I32, 1, &m, s->c, NULL));
  if (policy) CHECK_OK(amber_writer_add_policy(w, policy));
  return w;
}

/* Restores `step` into `s`. */
static void restore(amber_store *st, uint64_t step, state *s) {
  amber_reader *r = NULL;
  CHECK_OK(amber_reader_open(&r, st, step, NULL));
  if (!r) return;
  CHECK_OK(amber_reader_read(r, 0, s->x, sizeof s->x));
  CHECK_OK(amber_reader_read(r, 1, s->c, sizeof s->c));
  amber_reader_close(r);
}

static uint32_t kind_of(amber_store *st, uint64_t step) {
  amber_reader *r = NULL;
  amber_ckpt_info ci = {.kind = 99};
  CHECK_OK(amber_reader_open(&r, st, step, NULL));
  if (r) CHECK_OK(amber_reader_ckpt_info(r, &ci));
  amber_reader_close(r);
  return ci.kind;
}

/* Steps 1..last written by a first writer (step 1 full, `full_at` also full). */
static void first_run(const char *dir, state *s, const char *policy, int last, int full_at,
                      uint32_t full_every) {
  amber_store *st = open_store(dir, 0);
  amber_writer *w = open_writer(st, s, policy, full_every);
  for (int step = 1; step <= last; step++) {
    mutate(s, step);
    CHECK_OK(amber_writer_save(w, (uint64_t)step, step == full_at ? AMBER_SAVE_FULL : 0));
  }
  amber_writer_close(w);
  amber_store_close(st);
}

static void test_a_seeded_writer_saves_an_exact_delta_at_once(void) {
  const char *dir = tu_tmpdir();
  state *s = calloc(1, sizeof *s), *t = calloc(1, sizeof *t), *got = calloc(1, sizeof *got);
  first_run(dir, s, NULL, 4, 1, 0);
  amber_store *st = open_store(dir, 0);
  restore(st, 4, t); /* the resumed run's tensors */
  CHECK(memcmp(s, t, sizeof *s) == 0);
  amber_writer *w = open_writer(st, t, NULL, 0);
  CHECK_OK(amber_writer_seed_reference(w, 4));
  for (int step = 5; step <= 7; step++) {
    mutate(t, step);
    CHECK_OK(amber_writer_begin(w, (uint64_t)step, 0));
    CHECK_OK(amber_writer_wait(w));
    CHECK(kind_of(st, (uint64_t)step) == AMBER_KIND_DELTA);
    restore(st, (uint64_t)step, got);
    CHECK(memcmp(got, t, sizeof *t) == 0);
  }
  amber_writer_close(w);
  amber_store_close(st);
  free(s);
  free(t);
  free(got);
}

/* The seed reads headers and indexes only: damage in the payload of the seeded
 * step does not stop it, and the next save is still a delta. */
static void test_seeding_reads_no_tensor_data(void) {
  const char *dir = tu_tmpdir();
  state *s = calloc(1, sizeof *s), *t = calloc(1, sizeof *t);
  first_run(dir, s, NULL, 3, 3, 0); /* step 3 is a full file: its middle is payload */
  amber_store *st = open_store(dir, 0);
  restore(st, 3, t);
  char path[4200];
  snprintf(path, sizeof path, "%s/ckpt-%020d.amber", dir, 3);
  CHECK(tu_flip_byte(path, TU_MIDDLE, 0x10) == 0);
  amber_writer *w = open_writer(st, t, NULL, 0);
  CHECK_OK(amber_writer_seed_reference(w, 3));
  mutate(t, 4);
  CHECK_OK(amber_writer_save(w, 4, 0));
  CHECK(kind_of(st, 4) == AMBER_KIND_DELTA); /* unseeded, the damage would force a full */
  amber_writer_close(w);
  amber_store_close(st);
  free(s);
  free(t);
}

/* Cadence: the seeded writer counts the deltas since the store's last full. */
static void test_a_seeded_writer_keeps_the_cadence(void) {
  const char *dir = tu_tmpdir();
  state *s = calloc(1, sizeof *s);
  first_run(dir, s, NULL, 3, 1, 3); /* full, delta, delta */
  amber_store *st = open_store(dir, 0);
  amber_writer *w = open_writer(st, s, NULL, 3);
  CHECK_OK(amber_writer_seed_reference(w, 3));
  mutate(s, 4);
  CHECK_OK(amber_writer_save(w, 4, 0));
  mutate(s, 5);
  CHECK_OK(amber_writer_save(w, 5, 0));
  CHECK(kind_of(st, 4) == AMBER_KIND_DELTA);
  CHECK(kind_of(st, 5) == AMBER_KIND_FULL); /* the fourth delta would exceed full_every 3 */
  amber_writer_close(w);
  amber_store_close(st);
  free(s);
}

static void test_seeding_from_a_wrong_step_or_an_empty_store_fails_clearly(void) {
  const char *dir = tu_tmpdir();
  state *s = calloc(1, sizeof *s);
  amber_store *st = open_store(dir, 0);
  amber_writer *w = open_writer(st, s, NULL, 0);
  CHECK_RC(amber_writer_seed_reference(w, 1), AMBER_ENOENT); /* empty store */
  CHECK(strstr(amber_last_error(w), "no committed checkpoint") != NULL);
  amber_writer_close(w);
  amber_store_close(st);
  first_run(dir, s, NULL, 3, 1, 0);
  st = open_store(dir, 0);
  w = open_writer(st, s, NULL, 0);
  CHECK_RC(amber_writer_seed_reference(w, 2), AMBER_EINVAL); /* not the latest */
  CHECK(strstr(amber_last_error(w), "latest step") != NULL);
  CHECK(strstr(amber_last_error(w), " 3 ") != NULL);
  CHECK_RC(amber_writer_seed_reference(w, 9), AMBER_EINVAL); /* no such step */
  CHECK_RC(amber_writer_seed_reference(NULL, 3), AMBER_EINVAL);
  CHECK_OK(amber_writer_seed_reference(w, 3)); /* the refusals left the writer usable */
  mutate(s, 4);
  CHECK_OK(amber_writer_begin(w, 4, 0));
  CHECK_RC(amber_writer_seed_reference(w, 3), AMBER_EBUSY); /* a save not yet reported */
  CHECK_OK(amber_writer_wait(w));
  CHECK_OK(amber_writer_seed_reference(w, 4)); /* a writer that saved may seed again */
  amber_writer_close(w);
  amber_store_close(st);
  free(s);
}

static void test_seeding_with_other_declarations_names_the_difference(void) {
  const char *dir = tu_tmpdir();
  state *s = calloc(1, sizeof *s);
  first_run(dir, s, NULL, 2, 1, 0);
  amber_store *st = open_store(dir, 0);
  int64_t n = N, m = M, half[2] = {N / 2, 2};
  struct {
    const char *name0, *name1;
    int dtype1;
    uint32_t ndim0;
    const int64_t *shape0;
    int extra;
    const char *want;
  } cases[] = {
      {"x", "d", AMBER_I32, 1, &n, 0, "'c'"},            /* another name */
      {"x", "c", AMBER_F32, 1, &n, 0, "'c' is f32"},     /* another dtype */
      {"x", "c", AMBER_I32, 2, half, 0, "'x' has another shape"},
      {"x", "c", AMBER_I32, 1, &n, 1, "3"},             /* one more tensor */
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    amber_writer *w = NULL;
    CHECK_OK(amber_writer_open(&w, st, NULL));
    CHECK_OK(amber_writer_add(w, cases[k].name0, AMBER_F32, cases[k].ndim0, cases[k].shape0,
                              s->x, NULL));
    CHECK_OK(amber_writer_add(w, cases[k].name1, cases[k].dtype1, 1, &m, s->c, NULL));
    if (cases[k].extra) CHECK_OK(amber_writer_add(w, "e", AMBER_I32, 1, &m, s->c, NULL));
    CHECK_RC(amber_writer_seed_reference(w, 2), AMBER_EMISMATCH);
    if (!strstr(amber_last_error(w), cases[k].want)) {
      fprintf(stderr, "case %zu: message '%s' lacks '%s'\n", k, amber_last_error(w),
              cases[k].want);
      CHECK(0);
    }
    CHECK(strstr(amber_last_error(w), "ckpt-") != NULL); /* names the file */
    amber_writer_close(w);
  }
  /* the writer's own chunk size, unlike the store's */
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.chunk_elems = 4096;
  amber_writer *w = NULL;
  CHECK_OK(amber_writer_open(&w, st, &wo));
  CHECK_OK(amber_writer_add(w, "x", AMBER_F32, 1, &n, s->x, NULL));
  CHECK_OK(amber_writer_add(w, "c", AMBER_I32, 1, &m, s->c, NULL));
  CHECK_RC(amber_writer_seed_reference(w, 2), AMBER_EMISMATCH);
  CHECK(strstr(amber_last_error(w), "chunk") != NULL);
  amber_writer_close(w);
  amber_store_close(st);
  free(s);
}

/* Under lossy policies the seeded reference is the restored state, as the one a
 * writer loads from the store: the next deltas are the same files, byte for
 * byte (one worker thread, so payloads come in the same order). */
static void test_under_lossy_policies_seeding_writes_the_same_deltas(void) {
  const char *a = tu_tmpdir(), *b = tu_tmpdir();
  state *s = calloc(1, sizeof *s), *ta = calloc(1, sizeof *ta), *tb = calloc(1, sizeof *tb);
  const char *policy = "x=threshold:0.002:0.001";
  first_run(a, s, policy, 4, 1, 0);
  CHECK(tu_system("cp -a %s/. %s/", a, b) == 0);
  amber_store *sa = open_store(a, 1), *sb = open_store(b, 1);
  restore(sa, 4, ta);
  restore(sb, 4, tb);
  CHECK(memcmp(ta, tb, sizeof *ta) == 0);
  CHECK(memcmp(ta, s, sizeof *s) != 0); /* the threshold left changes out */
  amber_writer *wa = open_writer(sa, ta, policy, 0), *wb = open_writer(sb, tb, policy, 0);
  CHECK_OK(amber_writer_seed_reference(wa, 4)); /* wb loads its reference from the store */
  for (int step = 5; step <= 7; step++) {
    mutate(ta, step);
    mutate(tb, step);
    CHECK_OK(amber_writer_save(wa, (uint64_t)step, 0));
    CHECK_OK(amber_writer_save(wb, (uint64_t)step, 0));
    CHECK(kind_of(sa, (uint64_t)step) == AMBER_KIND_DELTA);
    char pa[4200], pb[4200];
    snprintf(pa, sizeof pa, "%s/ckpt-%020d.amber", a, step);
    snprintf(pb, sizeof pb, "%s/ckpt-%020d.amber", b, step);
    size_t la = 0, lb = 0;
    uint8_t *fa = tu_read_file(pa, &la), *fb = tu_read_file(pb, &lb);
    CHECK(fa && fb && la == lb && memcmp(fa, fb, la) == 0);
    free(fa);
    free(fb);
  }
  amber_writer_close(wa);
  amber_writer_close(wb);
  amber_store_close(sa);
  amber_store_close(sb);
  free(s);
  free(ta);
  free(tb);
}

int main(void) {
  TEST_RUN(test_a_seeded_writer_saves_an_exact_delta_at_once);
  TEST_RUN(test_seeding_reads_no_tensor_data);
  TEST_RUN(test_a_seeded_writer_keeps_the_cadence);
  TEST_RUN(test_seeding_from_a_wrong_step_or_an_empty_store_fails_clearly);
  TEST_RUN(test_seeding_with_other_declarations_names_the_difference);
  TEST_RUN(test_under_lossy_policies_seeding_writes_the_same_deltas);
  return tu_finish();
}

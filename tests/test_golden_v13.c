/*
 * test_golden_v13.c - golden files of format 1.3 must load forever (docs/FORMAT.md).
 *
 * Format 1.3 added the encoding QSPARSE (5): quantized delta chunks.
 * tests/golden/v1.3-quant/store/ holds a small store written once by this program
 * (`test_golden_v13 --regenerate DIR`, one thread) and committed: step 1 full,
 * steps 2 and 3 deltas of it, with f32, bf16, f16 and f64 tensors under policies
 * with every value code (@q8, @q4, @bf16, +lead, absolute and relative bounds, a
 * budget), NaN, Inf and large jumps that must be escapes, an f8 tensor under a
 * quantized rule (stored whole) and an integer one. The generator also writes what
 * each step restored (expected-<step>.bytes: the tensors' bytes back to back) after
 * checking it against the bounds. The normal run opens the committed store
 * read-only and checks: every step restores those bytes exactly; every element is
 * within its policy's bound of the live values computed here; the deltas hold
 * QSPARSE chunks of every value mode; the files say format 1.3; verify passes.
 * Never regenerate the files of a released format version.
 */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt.h"
#include "codec.h"
#include "internal.h"
#include "scan.h"
#include "testutil.h"

#define GOLDEN AMBER_SOURCE_DIR "/tests/golden/v1.3-quant/store"
#define CHUNK 64
#define STEPS 3

typedef struct {
  const char *name;
  int dtype;
  int64_t n;
  const char *rule; /* the spec after "name=" */
  int mode;         /* the value mode its QSPARSE chunks must have (0: none) */
  double abs, rel, cap;
} spec;

static const spec specs[] = {
    {"w32", AMBER_F32, 300, "threshold:1e-3@q4+lead", AMBER__QV_Q4, 1e-3, 0, 0},
    {"m32", AMBER_F32, 100, "budget:0.25:0.05@q8", AMBER__QV_Q8, 0, 0, 0.05},
    {"v32", AMBER_F32, 90, "threshold:0:0.3@q4+lead", AMBER__QV_Q4, 0, 0.3, 0},
    {"b16", AMBER_BF16, 70, "threshold:1e-2@q8", AMBER__QV_Q8, 1e-2, 0, 0},
    {"h16", AMBER_F16, 70, "threshold:1e-3:1e-2@bf16", AMBER__QV_BF16, 1e-3, 1e-2, 0},
    {"d64", AMBER_F64, 40, "threshold:1e-6@q4", AMBER__QV_Q4, 1e-6, 0, 0},
    {"e8", AMBER_F8_E4M3, 16, "threshold:0.1@q4", 0, 0.1, 0, 0},
    {"i32", AMBER_I32, 10, "exact", 0, 0, 0, 0},
};
#define NSPEC (sizeof specs / sizeof specs[0])

/* The live value of element k of tensor i at `step` (1..3), as a double. */
static double live_value(size_t i, int64_t k, uint64_t step) {
  double x = sin(0.37 * (double)k + (double)i) * (i == 2 ? 3 + (double)(k % 5) : 1);
  for (uint64_t s = 2; s <= step; s++) {
    double drift = (i == 2) ? -0.2 * x : 2e-3 * cos((double)(k * s)); /* v32 decays */
    if (i == 3 || i == 6) drift = 3e-2 * cos((double)(k * s));
    if (i == 5) drift = 3e-6 * cos((double)(k * s));
    x += drift;
    if (k % 29 == 3) x += 5.0 * (double)s; /* jumps the codes cannot carry */
  }
  if (step == 2 && k % 31 == 7 && i != 6) x = k % 2 ? NAN : INFINITY; /* escapes */
  return x;
}

static void put_value(int dt, uint8_t *p, double v, int64_t k, uint64_t step) {
  if (dt == AMBER_F64) {
    memcpy(p, &v, 8);
  } else if (dt == AMBER_F32) {
    float f = (float)v;
    memcpy(p, &f, 4);
  } else if (dt == AMBER_BF16 || dt == AMBER_F16) {
    uint16_t h = dt == AMBER_BF16 ? amber__f32_to_bf16((float)v) : amber__f32_to_f16((float)v);
    memcpy(p, &h, 2);
  } else if (dt == AMBER_F8_E4M3) {
    p[0] = (uint8_t)((k * 7 + (int64_t)step * (k % 3 == 0)) & 0x77); /* finite e4m3 codes */
  } else {
    int32_t x = (int32_t)(k * 1000 + (int64_t)step);
    memcpy(p, &x, 4);
  }
}

static void live_bytes(size_t i, uint64_t step, uint8_t *out) {
  size_t w = amber_dtype_size(specs[i].dtype);
  for (int64_t k = 0; k < specs[i].n; k++)
    put_value(specs[i].dtype, out + (size_t)k * w, live_value(i, k, step), k, step);
}

static size_t total_bytes(void) {
  size_t t = 0;
  for (size_t i = 0; i < NSPEC; i++) t += (size_t)specs[i].n * amber_dtype_size(specs[i].dtype);
  return t;
}

/* Every element of tensor i restored as `got` is within its bound of `live`
 * (non-finite live values and integer tensors bit for bit). */
static int within_bounds(size_t i, const uint8_t *live, const uint8_t *got) {
  int dt = specs[i].dtype;
  size_t w = amber_dtype_size(dt);
  for (int64_t k = 0; k < specs[i].n; k++) {
    const uint8_t *x = live + (size_t)k * w, *r = got + (size_t)k * w;
    if (!memcmp(x, r, w)) continue;
    if (dt == AMBER_I32) return 0;
    double xv = amber__to_f64(dt, x), rv = amber__to_f64(dt, r);
    if (!isfinite(xv) || !isfinite(rv)) return 0;
    double bound = specs[i].cap ? specs[i].cap : specs[i].abs + specs[i].rel * fabs(rv);
    if (fabs(xv - rv) > bound) {
      fprintf(stderr, "  '%s'[%" PRId64 "]: live %a restored %a bound %a\n", specs[i].name, k, xv,
              rv, bound);
      return 0;
    }
  }
  return 1;
}

static void expected_path(char *p, size_t cap, const char *dir, uint64_t step) {
  snprintf(p, cap, "%s/../expected-%" PRIu64 ".bytes", dir, step);
}

/* Reads every tensor of `step` back to back into out. */
static int read_step(amber_store *st, uint64_t step, uint8_t *out) {
  amber_reader *r = NULL;
  int rc = amber_reader_open(&r, st, step, NULL);
  for (size_t i = 0, o = 0; !rc && i < NSPEC; i++) {
    size_t nb = (size_t)specs[i].n * amber_dtype_size(specs[i].dtype);
    rc = amber_reader_read(r, i, out + o, nb);
    o += nb;
  }
  amber_reader_close(r);
  return rc;
}

/* ---- generator ---- */

static int regenerate(const char *dir) {
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.threads = 1; /* payloads in a fixed order: reproducible files */
  amber_store *st = NULL;
  int rc = amber_store_open(&st, dir, &so);
  uint64_t latest;
  if (!rc && amber_store_latest(st, &latest) == 0) rc = AMBER_EEXIST; /* never overwrite */
  amber_writer_opts wo;
  tu_deltas_only(&wo, CHUNK);
  amber_writer *w = NULL;
  uint8_t *data[NSPEC] = {0};
  size_t tb = total_bytes();
  uint8_t *got = malloc(tb), *liv = malloc(tb);
  if (!rc) rc = amber_writer_open(&w, st, &wo);
  for (size_t i = 0; i < NSPEC && !rc; i++) {
    char rule[128];
    data[i] = calloc((size_t)specs[i].n * amber_dtype_size(specs[i].dtype) + 1, 1);
    rc = amber_writer_add(w, specs[i].name, specs[i].dtype, 1, &specs[i].n, data[i], NULL);
    snprintf(rule, sizeof rule, "%s=%s", specs[i].name, specs[i].rule);
    if (!rc) rc = amber_writer_add_policy(w, rule);
  }
  for (uint64_t s = 1; s <= STEPS && !rc; s++) {
    for (size_t i = 0, o = 0; i < NSPEC; i++) {
      size_t nb = (size_t)specs[i].n * amber_dtype_size(specs[i].dtype);
      live_bytes(i, s, data[i]);
      memcpy(liv + o, data[i], nb);
      o += nb;
    }
    rc = amber_writer_save(w, s, 0);
    if (!rc) rc = read_step(st, s, got);
    for (size_t i = 0, o = 0; !rc && i < NSPEC; i++) {
      if (!within_bounds(i, liv + o, got + o)) rc = AMBER_ECORRUPT;
      o += (size_t)specs[i].n * amber_dtype_size(specs[i].dtype);
    }
    char p[4200];
    expected_path(p, sizeof p, dir, s);
    if (!rc && tu_write_file(p, got, tb) != 0) rc = AMBER_EIO;
  }
  if (rc)
    fprintf(stderr, "regenerate %s: %s: %s\n", dir, amber_strerror(rc),
            w ? amber_last_error(w) : amber_last_error(NULL));
  amber_writer_close(w);
  amber_store_close(st);
  for (size_t i = 0; i < NSPEC; i++) free(data[i]);
  free(got);
  free(liv);
  char p[4200];
  snprintf(p, sizeof p, "%s/.lock", dir);
  unlink(p);
  if (!rc) printf("wrote %s: steps 1 to %d and their expected restores\n", dir, STEPS);
  return rc ? 1 : 0;
}

/* ---- the committed store ---- */

static void test_golden_v13_restores_the_committed_bytes_within_every_bound(void) {
  amber_store *st = tu_open_ro(GOLDEN);
  size_t tb = total_bytes();
  uint8_t *got = malloc(tb), *liv = malloc(tb);
  for (uint64_t s = 1; st && s <= STEPS; s++) {
    char p[4200];
    size_t n = 0;
    expected_path(p, sizeof p, GOLDEN, s);
    uint8_t *want = tu_read_file(p, &n);
    CHECK(want && n == tb);
    CHECK_OK(read_step(st, s, got));
    if (want && n == tb && memcmp(got, want, tb)) {
      fprintf(stderr, "  step %" PRIu64 ": the restore differs from %s\n", s, p);
      tu_failures++;
    }
    for (size_t i = 0, o = 0; i < NSPEC; i++) {
      live_bytes(i, s, liv + o);
      if (!within_bounds(i, liv + o, got + o)) {
        fprintf(stderr, "  step %" PRIu64 ": '%s' out of its bound\n", s, specs[i].name);
        tu_failures++;
      }
      o += (size_t)specs[i].n * amber_dtype_size(specs[i].dtype);
    }
    amber_reader *r = NULL;
    CHECK_OK(amber_reader_open(&r, st, s, NULL));
    if (r) CHECK_OK(amber_reader_verify(r));
    for (size_t i = 0; r && i < NSPEC; i++) {
      amber_tensor_info ti;
      CHECK_OK(amber_reader_info(r, i, &ti));
      CHECK(!strcmp(ti.policy, specs[i].dtype == AMBER_I32 ? "exact" : specs[i].rule));
    }
    amber_reader_close(r);
    free(want);
  }
  free(got);
  free(liv);
  amber_store_close(st);
}

/* The deltas hold QSPARSE chunks of every value mode their tensors' policies name
 * (read from each body's value_mode byte), the f8 tensor only SPARSE ones, and
 * every file says 1.3. */
static void test_golden_v13_deltas_hold_every_value_mode(void) {
  amber_store *st = tu_open_ro(GOLDEN);
  int seen[NSPEC] = {0};
  void *dctx = amber__zstd_dctx();
  for (uint64_t s = 1; st && s <= STEPS; s++) {
    amber__err e;
    amber__ckpt c;
    int rc = amber__ckpt_open(&e, st, s, &c);
    CHECK_OK(rc);
    if (rc) continue;
    CHECK(c.hdr.format_major == 1 && c.hdr.format_minor == 3);
    for (size_t i = 0; i < NSPEC && i < c.ix.n_tensors; i++) {
      const amber__tensor *t = &c.ix.tensors[i];
      for (uint64_t j = 0; j < t->n_chunks; j++) {
        const amber__chunk *ch = &c.ix.chunks[t->first_chunk + j];
        if (ch->encoding != AMBER__ENC_QSPARSE) continue;
        CHECK(s > 1 && specs[i].mode != 0);
        uint8_t *pay = malloc(ch->size), body[4096];
        size_t blen = 0;
        CHECK(pread(c.fd, pay, ch->size, (off_t)ch->offset) == (ssize_t)ch->size);
        CHECK_OK(amber__zstd_decompress_bounded(dctx, body, sizeof body, pay, ch->size, &blen));
        /* positions first: a bitmap (1 + ceil(n/8)) or varint gaps */
        size_t n = (size_t)amber__chunk_n(t, j), at = 1;
        if (body[0] == 0) {
          at += (n + 7) / 8;
        } else {
          for (uint64_t g = 0; g < ch->stored; g++)
            while (body[at++] & 0x80) {
            }
        }
        if (at < blen && body[at] == specs[i].mode) seen[i] = 1;
        free(pay);
      }
    }
    amber__ckpt_close(&c);
  }
  amber__zstd_dctx_free(dctx);
  for (size_t i = 0; i < NSPEC; i++)
    if (seen[i] != (specs[i].mode != 0)) {
      fprintf(stderr, "  '%s': QSPARSE chunks of mode %d %sfound\n", specs[i].name, specs[i].mode,
              seen[i] ? "" : "not ");
      tu_failures++;
    }
  amber_store_close(st);
}

static void test_golden_v13_store_is_left_untouched(void) {
  char p[4200];
  snprintf(p, sizeof p, "%s/.lock", GOLDEN);
  CHECK(access(p, F_OK) != 0);
}

int main(int argc, char **argv) {
  if (argc == 3 && !strcmp(argv[1], "--regenerate")) return regenerate(argv[2]);
  if (argc != 1) {
    fprintf(stderr, "usage: %s [--regenerate DIR]\n", argv[0]);
    return 2;
  }
  TEST_RUN(test_golden_v13_restores_the_committed_bytes_within_every_bound);
  TEST_RUN(test_golden_v13_deltas_hold_every_value_mode);
  TEST_RUN(test_golden_v13_store_is_left_untouched);
  return tu_finish();
}

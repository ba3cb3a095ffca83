/*
 * test_golden_v11.c - golden files of format 1.1 must load forever (docs/FORMAT.md).
 *
 * Format 1.1 added the dtypes u16, u32 and u64 (codes 13, 14, 15).
 * tests/golden/v1.1/store/ holds a small store written once by this program
 * (`test_golden_v11 --regenerate DIR`, one thread) and committed: step 1 full, step
 * 2 a delta of it, with u16, u32 and u64 tensors (multi-chunk, 2-D, a scalar, an
 * empty one) holding values with the top bit set, next to an f32 tensor and a
 * bf16 one. Every tensor has a lossy rule (`*=threshold:0.5:0`): the unsigned
 * ones must still record "exact" and restore bit for bit; the f32 one moves by 10
 * (stored) or by 0.25 (not stored), so its restore is known exactly too. The normal
 * run opens the committed store read-only and checks both steps against values
 * computed here, the metadata, list and verify, the header's format version (1.1)
 * and the dtype codes in the index. It also pins which version today's writer
 * records: 1.0 for files without the new dtypes (old readers keep reading them),
 * 1.1 for files with them, through saves and compact alike.
 * Never regenerate the files of a released format version.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <xxhash.h>

#include "ckpt.h"
#include "internal.h"
#include "testutil.h"

#define GOLDEN AMBER_SOURCE_DIR "/tests/golden/v1.1/store"
#define CHUNK 64
#define RULE "*=threshold:0.5:0"

typedef struct {
  const char *name;
  int dtype;
  int code; /* the on-disk dtype code, written out so that a renumbering fails */
  uint32_t ndim;
  int64_t shape[2];
} spec;

static const spec specs[] = {
    {"u16.counts", AMBER_U16, 13, 1, {300}}, /* 5 chunks */
    {"u32.ids", AMBER_U32, 14, 2, {3, 50}},
    {"u64.hash", AMBER_U64, 15, 1, {70}},
    {"u64.step", AMBER_U64, 15, 0, {0}}, /* scalar */
    {"u16.empty", AMBER_U16, 13, 2, {0, 4}},
    {"w", AMBER_F32, 1, 1, {90}},
    {"b", AMBER_BF16, 3, 1, {5}},
};
#define NSPEC (sizeof specs / sizeof specs[0])

static uint64_t nelems_of(size_t i) {
  uint64_t n = 1;
  for (uint32_t d = 0; d < specs[i].ndim; d++) n *= (uint64_t)specs[i].shape[d];
  return n;
}

static void put_le(uint8_t *p, uint64_t v, size_t w) {
  for (size_t b = 0; b < w; b++) p[b] = (uint8_t)(v >> (8 * b));
}

static uint64_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

/* The bytes of tensor i at step 1 or 2 as the writer is given them (`restored` 0)
 * or as a restore must return them (1: the f32 changes below the threshold were
 * not stored). */
static void values(size_t i, uint64_t step, int restored, uint8_t *out) {
  size_t w = amber_dtype_size(specs[i].dtype);
  for (uint64_t k = 0; k < nelems_of(i); k++) {
    uint64_t v = 0, two = step == 2;
    switch (i) {
    case 0: v = 0xFFFFu - k * 11 - (two && k % 7 == 0 ? 1000 : 0); break; /* sparse */
    case 1: v = 0xFFFFFFF0u - k * 65537 + (two ? k % 2 : 0); break;    /* xor: half */
    case 2: /* the first chunk unchanged, the second changed */
      v = 0x8000000000000000ull + k * 0x0123456789ull + (two && k >= 64 ? 3 : 0);
      break;
    case 3: v = UINT64_MAX - 1 + two; break;
    case 5: {
      float x = (float)k;
      if (two) x += k % 3 == 0 ? 10.0f : restored ? 0.0f : 0.25f;
      v = f32_bits(x);
      break;
    }
    case 6: v = f32_bits((float)(k + 1) * (two ? -2.0f : 2.0f)) >> 16; break;
    }
    put_le(out + k * w, v, w);
  }
}

static int meta_of(uint64_t step, char *buf, size_t cap) {
  return snprintf(buf, cap, "{\"amber.golden\": \"v1.1\", \"step\": %" PRIu64 "}", step);
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
  if (!rc) rc = amber_writer_open(&w, st, &wo);
  for (size_t i = 0; i < NSPEC && !rc; i++) {
    data[i] = calloc(nelems_of(i) * amber_dtype_size(specs[i].dtype) + 1, 1);
    rc = amber_writer_add(w, specs[i].name, specs[i].dtype, specs[i].ndim, specs[i].shape,
                          data[i], NULL);
  }
  if (!rc) rc = amber_writer_add_policy(w, RULE);
  for (uint64_t s = 1; s <= 2 && !rc; s++) {
    char meta[128];
    int n = meta_of(s, meta, sizeof meta);
    for (size_t i = 0; i < NSPEC; i++) values(i, s, 0, data[i]);
    rc = amber_writer_set_meta(w, meta, (size_t)n);
    if (!rc) rc = amber_writer_save(w, s, 0);
  }
  if (rc)
    fprintf(stderr, "regenerate %s: %s: %s\n", dir, amber_strerror(rc),
            w ? amber_last_error(w) : amber_last_error(NULL));
  amber_writer_close(w);
  amber_store_close(st);
  for (size_t i = 0; i < NSPEC; i++) free(data[i]);
  char p[4200];
  snprintf(p, sizeof p, "%s/.lock", dir);
  unlink(p);
  if (!rc) printf("wrote %s: steps 1 and 2\n", dir);
  return rc ? 1 : 0;
}

/* ---- the committed store ---- */

static void test_golden_v11_lists_a_full_and_a_delta(void) {
  amber_store *st = tu_open_ro(GOLDEN);
  if (!st) return;
  amber_ckpt_info *info = NULL;
  size_t n = 0;
  CHECK_OK(amber_store_list(st, &info, &n));
  CHECK(n == 2);
  if (info && n == 2) {
    CHECK(info[0].step == 1 && info[0].kind == AMBER_KIND_FULL);
    CHECK(info[1].step == 2 && info[1].kind == AMBER_KIND_DELTA && info[1].parent == 1);
  }
  amber_free(info);
  amber_store_close(st);
}

static void test_golden_v11_restores_exact_unsigned_values(void) {
  amber_store *st = tu_open_ro(GOLDEN);
  for (uint64_t s = 1; st && s <= 2; s++) {
    amber_reader *r = NULL;
    CHECK_OK(amber_reader_open(&r, st, s, NULL));
    if (!r) continue;
    CHECK(amber_reader_count(r) == NSPEC);
    for (size_t i = 0; i < NSPEC && i < amber_reader_count(r); i++) {
      amber_tensor_info ti;
      CHECK_OK(amber_reader_info(r, i, &ti));
      uint64_t nb = nelems_of(i) * amber_dtype_size(specs[i].dtype);
      CHECK(!strcmp(ti.name, specs[i].name) && ti.dtype == specs[i].dtype);
      CHECK(ti.ndim == specs[i].ndim && ti.nelems == nelems_of(i) && ti.nbytes == nb);
      for (uint32_t d = 0; d < ti.ndim && d < 2; d++)
        CHECK(ti.shape[d] == specs[i].shape[d]);
      int is_float = specs[i].dtype == AMBER_F32 || specs[i].dtype == AMBER_BF16;
      /* integers are exact under any rule */
      const char *want_policy = is_float ? "threshold:0.5:0" : "exact";
      CHECK(ti.chunk_elems == CHUNK && !strcmp(ti.policy, want_policy));
      uint8_t *got = malloc(nb + 1), *want = malloc(nb + 1);
      values(i, s, 1, want);
      CHECK_OK(amber_reader_read(r, i, got, nb));
      if (memcmp(got, want, nb) != 0) {
        fprintf(stderr, "  step %" PRIu64 ": tensor '%s' differs\n", s, specs[i].name);
        tu_failures++;
      }
      free(got);
      free(want);
    }
    char meta[128];
    const char *m = NULL;
    size_t mlen = 0, n = (size_t)meta_of(s, meta, sizeof meta);
    CHECK_OK(amber_reader_meta(r, &m, &mlen));
    CHECK(mlen == n && m && !memcmp(m, meta, n));
    CHECK_OK(amber_reader_verify(r));
    amber_reader_close(r);
  }
  amber_store_close(st);
}

static uint16_t minor_of_file(const char *dir, uint64_t step) {
  char p[4200];
  size_t n = 0;
  snprintf(p, sizeof p, "%s/ckpt-%020" PRIu64 ".amber", dir, step);
  uint8_t *b = tu_read_file(p, &n);
  uint16_t minor = 0xFFFF; /* by the FORMAT.md header table, checksum included */
  uint64_t sum = 0;
  for (int k = 7; b && n >= 64 && k >= 0; k--) sum = sum << 8 | b[56 + k];
  if (b && n >= 64 && b[8] == 1 && b[9] == 0 && sum == XXH3_64bits(b, 56))
    minor = (uint16_t)(b[10] | b[11] << 8);
  free(b);
  return minor;
}

static void test_golden_v11_files_say_1_1_and_hold_codes_13_to_15(void) {
  amber_store *st = tu_open_ro(GOLDEN);
  for (uint64_t s = 1; st && s <= 2; s++) {
    CHECK(minor_of_file(GOLDEN, s) == 1);
    amber__err e;
    amber__ckpt c;
    int rc = amber__ckpt_open(&e, st, s, &c);
    CHECK_OK(rc);
    if (rc) continue;
    CHECK(c.hdr.format_major == 1 && c.hdr.format_minor == 1);
    CHECK(c.ix.n_tensors == NSPEC);
    for (size_t i = 0; i < NSPEC && i < c.ix.n_tensors; i++)
      CHECK(c.ix.tensors[i].dtype == specs[i].code);
    amber__ckpt_close(&c);
  }
  amber_store_close(st);
}

/* ---- what today's writer records ---- */

static void save_one(const char *dir, int dtype, uint64_t step) {
  amber_store *st = NULL;
  amber_writer *w = NULL;
  uint8_t data[64] = {0};
  int64_t n = 8;
  CHECK_OK(amber_store_open(&st, dir, NULL));
  CHECK_OK(amber_writer_open(&w, st, NULL));
  CHECK_OK(amber_writer_add(w, "a", AMBER_F32, 1, &n, data, NULL));
  CHECK_OK(amber_writer_add(w, "b", dtype, 1, &n, data, NULL));
  CHECK_OK(amber_writer_save(w, step, step == 1 ? AMBER_SAVE_FULL : 0));
  amber_writer_close(w);
  if (step == 2) CHECK_OK(amber_store_compact(st, 2));
  amber_store_close(st);
}

static void test_writer_records_1_0_unless_a_new_dtype_is_used(void) {
  static const int old_dtypes[] = {AMBER_F32, AMBER_I64, AMBER_U8, AMBER_BOOL};
  static const int new_dtypes[] = {AMBER_U16, AMBER_U32, AMBER_U64};
  for (size_t i = 0; i < 4 + 3; i++) {
    int dt = i < 4 ? old_dtypes[i] : new_dtypes[i - 4];
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/s", tu_tmpdir());
    save_one(dir, dt, 1);
    save_one(dir, dt, 2); /* a delta, then compacted into a full one */
    for (uint64_t s = 1; s <= 2; s++)
      if (minor_of_file(dir, s) != (i < 4 ? 0 : 1)) {
        fprintf(stderr, "  %s: step %" PRIu64 " records 1.%u\n", amber_dtype_name(dt), s,
                minor_of_file(dir, s));
        tu_failures++;
      }
  }
}

static void test_golden_v11_store_is_left_untouched(void) {
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
  TEST_RUN(test_golden_v11_lists_a_full_and_a_delta);
  TEST_RUN(test_golden_v11_restores_exact_unsigned_values);
  TEST_RUN(test_golden_v11_files_say_1_1_and_hold_codes_13_to_15);
  TEST_RUN(test_writer_records_1_0_unless_a_new_dtype_is_used);
  TEST_RUN(test_golden_v11_store_is_left_untouched);
  return tu_finish();
}

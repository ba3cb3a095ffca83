/*
 * test_golden.c - golden files of format 1.0 must load forever (docs/FORMAT.md).
 *
 * tests/golden/v1.0/store/ holds a small store written once by this program
 * (`test_golden --regenerate DIR`) and committed: fifteen tensors covering every
 * dtype, a scalar, an empty tensor and a non-ASCII name, metadata JSON, and two
 * full checkpoints: step 10 with raw chunks and step 20 written with
 * AMBER_WRITER_COMPRESS_FULL (SHUF_ZSTD chunks). Deltas have their own golden store
 * (tests/test_golden_delta.c). The normal run opens the committed
 * store read-only and checks every tensor against values computed here (never read
 * from a file), the metadata, list and latest, and verify. It also walks each
 * file's header, footer, index and chunk table by the FORMAT.md byte tables with
 * xxHash called directly, so that a format change adopted by writer and reader
 * alike still fails here. Never regenerate the files of a released format version:
 * a new version gets a new directory and its own checks.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <xxhash.h>

#include "testutil.h"

#define GOLDEN AMBER_SOURCE_DIR "/tests/golden/v1.0/store"
#define NFILES 2

typedef struct {
  const char *name;
  int dtype;
  uint32_t ndim;
  int64_t shape[2];
} spec;

static const spec specs[] = {
    {"embed.weight", AMBER_F32, 2, {8, 64}}, /* 8 chunks, compressible */
    {"norm.weight", AMBER_BF16, 1, {100}},
    {"head.weight", AMBER_F16, 2, {3, 7}},
    {"optim.exp_avg_sq", AMBER_F64, 1, {70}},
    {"q.e4m3", AMBER_F8_E4M3, 1, {12}},
    {"q.e5m2", AMBER_F8_E5M2, 1, {5}},
    {"data.position", AMBER_I64, 1, {3}},
    {"counts", AMBER_I32, 2, {2, 3}},
    {"deltas", AMBER_I16, 1, {5}},
    {"bytes", AMBER_I8, 1, {6}},
    {"rng.state", AMBER_U8, 1, {32}},
    {"mask", AMBER_BOOL, 1, {9}},
    {"optim.step", AMBER_I64, 0, {0}}, /* scalar */
    {"empty", AMBER_F32, 2, {0, 4}},
    {"\xc3\xa9t\xc3\xa9", AMBER_F32, 1, {3}}, /* "été" */
};
#define NSPEC (sizeof specs / sizeof specs[0])

static const uint64_t steps[NFILES] = {10, 20};
static const char *const files[NFILES] = {"ckpt-00000000000000000010.amber",
                                          "ckpt-00000000000000000020.amber"};

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

/* The bytes of tensor i at `step`, little-endian, from exactly representable values. */
static void expected(size_t i, uint64_t step, uint8_t *out) {
  size_t w = amber_dtype_size(specs[i].dtype);
  for (uint64_t k = 0; k < nelems_of(i); k++) {
    int64_t ki = (int64_t)k, s = (int64_t)step;
    uint64_t v = 0;
    double d;
    switch (specs[i].dtype) {
    case AMBER_F32: v = f32_bits((float)(ki % 16 - 8) * 0.125f + (float)s); break;
    case AMBER_BF16: v = f32_bits((float)(ki % 9 + s)) >> 16; break;
    case AMBER_F16: v = 0x3C00u + (uint64_t)(ki * 37 + s) % 512u; break;
    case AMBER_F64:
      d = (double)ki * 0.5 - (double)s;
      memcpy(&v, &d, 8);
      break;
    case AMBER_F8_E4M3:
    case AMBER_F8_E5M2: v = (uint64_t)(ki * 13 + s) & 0xFF; break;
    case AMBER_I64:
      v = specs[i].ndim ? (uint64_t)(ki * -1000000007LL + s * (1LL << 40)) : (uint64_t)s;
      break;
    case AMBER_I32: v = (uint64_t)(ki * 100000 - 7 * s); break;
    case AMBER_I16: v = (uint64_t)(ki * 1000 - 3000 + s); break;
    case AMBER_I8: v = (uint64_t)(ki * 20 - 60 + s); break;
    case AMBER_U8: v = (uint64_t)(ki * 7 + s); break;
    case AMBER_BOOL: v = (uint64_t)((ki + s) % 3 == 0); break;
    }
    put_le(out + k * w, v, w);
  }
}

static int meta_of(uint64_t step, char *buf, size_t cap) {
  return snprintf(buf, cap,
                  "{\"amber.golden\": \"v1.0\", \"step\": %" PRIu64
                  ", \"lr\": 0.00025, \"note\": \"caf\xc3\xa9 \\u6743\\u91cd\"}",
                  step);
}

/* ---- generator ---- */

static int regenerate(const char *dir) {
  amber_store *st = NULL;
  int rc = amber_store_open(&st, dir, NULL);
  uint64_t latest;
  if (!rc && amber_store_latest(st, &latest) == 0) rc = AMBER_EEXIST; /* never overwrite */
  for (size_t f = 0; f < NFILES && !rc; f++) {
    amber_writer_opts wo;
    amber_writer_opts_init(&wo);
    wo.chunk_elems = 64;
    wo.flags = f == 1 ? AMBER_WRITER_COMPRESS_FULL : 0;
    amber_writer *w = NULL;
    uint8_t *data[NSPEC] = {0};
    char meta[256];
    int n = meta_of(steps[f], meta, sizeof meta);
    rc = amber_writer_open(&w, st, &wo);
    for (size_t i = 0; i < NSPEC && !rc; i++) {
      data[i] = malloc(nelems_of(i) * amber_dtype_size(specs[i].dtype) + 1);
      expected(i, steps[f], data[i]);
      rc = amber_writer_add(w, specs[i].name, specs[i].dtype, specs[i].ndim, specs[i].shape,
                            data[i], NULL);
    }
    if (!rc) rc = amber_writer_set_meta(w, meta, (size_t)n);
    if (!rc) rc = amber_writer_save(w, steps[f], AMBER_SAVE_FULL);
    if (rc) fprintf(stderr, "regenerate: %s\n", amber_last_error(w));
    amber_writer_close(w);
    for (size_t i = 0; i < NSPEC; i++) free(data[i]);
  }
  if (rc)
    fprintf(stderr, "regenerate %s: %s: %s\n", dir, amber_strerror(rc), amber_last_error(NULL));
  amber_store_close(st);
  char p[4200];
  snprintf(p, sizeof p, "%s/.lock", dir);
  unlink(p);
  if (!rc) printf("wrote %s/{LATEST,%s,%s}\n", dir, files[0], files[1]);
  return rc ? 1 : 0;
}

/* ---- restoring the golden store ---- */

static void test_golden_store_lists_both_full_checkpoints(void) {
  amber_store *st = tu_open_ro(GOLDEN);
  if (!st) return;
  uint64_t latest = 0;
  CHECK_OK(amber_store_latest(st, &latest));
  CHECK(latest == 20);
  amber_ckpt_info *info = NULL;
  size_t n = 0;
  CHECK_OK(amber_store_list(st, &info, &n));
  CHECK(n == NFILES);
  for (size_t f = 0; f < n && f < NFILES && info; f++) {
    char p[4200];
    struct stat sb;
    snprintf(p, sizeof p, "%s/%s", GOLDEN, files[f]);
    CHECK(info[f].step == steps[f]);
    CHECK(info[f].kind == AMBER_KIND_FULL && info[f].parent == AMBER_NO_STEP);
    CHECK(stat(p, &sb) == 0 && info[f].bytes == (uint64_t)sb.st_size);
  }
  amber_free(info);
  amber_store_close(st);
}

static void test_golden_tensors_restore_expected_values(void) {
  amber_store *st = tu_open_ro(GOLDEN);
  for (size_t f = 0; st && f < NFILES; f++) {
    amber_reader *r = NULL;
    CHECK_OK(amber_reader_open(&r, st, steps[f], NULL));
    if (!r) continue;
    CHECK(amber_reader_count(r) == NSPEC);
    for (size_t i = 0; i < NSPEC && i < amber_reader_count(r); i++) {
      amber_tensor_info ti;
      CHECK_OK(amber_reader_info(r, i, &ti));
      uint64_t nb = nelems_of(i) * amber_dtype_size(specs[i].dtype);
      CHECK(!strcmp(ti.name, specs[i].name) && ti.dtype == specs[i].dtype);
      CHECK(ti.ndim == specs[i].ndim && ti.nelems == nelems_of(i) && ti.nbytes == nb);
      for (uint32_t d = 0; d < ti.ndim && d < 2; d++) CHECK(ti.shape[d] == specs[i].shape[d]);
      CHECK(ti.chunk_elems == 64 && !strcmp(ti.policy, "exact"));
      uint8_t *got = malloc(nb + 1), *want = malloc(nb + 1);
      expected(i, steps[f], want);
      CHECK_OK(amber_reader_read(r, i, got, nb));
      if (memcmp(got, want, nb) != 0) {
        fprintf(stderr, "  step %" PRIu64 ": tensor '%s' differs\n", steps[f], specs[i].name);
        tu_failures++;
      }
      free(got);
      free(want);
    }
    char meta[256];
    const char *m = NULL;
    size_t mlen = 0, n = (size_t)meta_of(steps[f], meta, sizeof meta);
    CHECK_OK(amber_reader_meta(r, &m, &mlen));
    CHECK(mlen == n && m && !memcmp(m, meta, n));
    CHECK_OK(amber_reader_verify(r));
    amber_tensor_info ti;
    CHECK_OK(amber_reader_info(r, 0, &ti)); /* step 20's compressed chunks are smaller */
    CHECK(f == 0 ? ti.stored_bytes == ti.nbytes : ti.stored_bytes < ti.nbytes);
    amber_reader_close(r);
  }
  amber_store_close(st);
}

/* ---- the bytes, by the FORMAT.md tables ---- */

static uint64_t le(const uint8_t *p, size_t w) {
  uint64_t v = 0;
  for (size_t b = w; b-- > 0;) v = (v << 8) | p[b];
  return v;
}

static void test_golden_headers_match_the_format_table(void) {
  for (size_t f = 0; f < NFILES; f++) {
    char p[4200];
    size_t n = 0;
    snprintf(p, sizeof p, "%s/%s", GOLDEN, files[f]);
    uint8_t *b = tu_read_file(p, &n), want[64] = {0x89, 'A', 'M', 'B', 'R', '\r', '\n', 0x1a};
    CHECK(b && n > 64 + 56);
    if (!b || n <= 64 + 56) continue;
    put_le(want + 8, 1, 2);        /* format_major */
    put_le(want + 10, 0, 2);       /* format_minor */
    put_le(want + 12, 64, 4);      /* header_size; flags 0 */
    put_le(want + 24, steps[f], 8);
    want[32] = 0;                  /* kind full; reserved 0 */
    put_le(want + 40, UINT64_MAX, 8);
    put_le(want + 48, 0, 8);
    put_le(want + 56, XXH3_64bits(want, 56), 8);
    if (memcmp(b, want, 64) != 0) {
      fprintf(stderr, "  %s: header bytes differ from the FORMAT.md table\n", files[f]);
      tu_failures++;
    }
    free(b);
  }
}

static void test_golden_footer_index_and_chunks_match_the_format_tables(void) {
  static const uint8_t end_magic[8] = {'A', 'M', 'B', 'R', 'E', 'N', 'D', 0x89};
  char p[4200];
  size_t n = 0;
  uint64_t state[NFILES] = {0};
  for (size_t f = 0; f < NFILES; f++) {
    snprintf(p, sizeof p, "%s/%s", GOLDEN, files[f]);
    uint8_t *b = tu_read_file(p, &n);
    CHECK(b && n > 64 + 56);
    if (!b || n <= 64 + 56) continue;
    const uint8_t *ft = b + n - 56;
    uint64_t io = le(ft, 8), isz = le(ft + 8, 8);
    CHECK(!memcmp(ft + 48, end_magic, 8) && le(ft + 40, 8) == XXH3_64bits(ft, 40));
    CHECK(io >= 64 && isz >= 32 && io + isz + 56 == n);
    if (io < 64 || isz < 32 || io + isz + 56 != n) continue;
    const uint8_t *ix = b + io;
    CHECK(le(ft + 16, 8) == XXH3_64bits(ix, isz));
    XXH3_state_t *hs = XXH3_createState();
    XXH3_64bits_reset(hs);
    XXH3_64bits_update(hs, b, 64);
    XXH3_64bits_update(hs, ix, isz);
    uint64_t content = XXH3_64bits_digest(hs);
    XXH3_freeState(hs);
    CHECK(le(ft + 24, 8) == content && le(ft + 32, 8) == content); /* state_id: first write */
    state[f] = le(ft + 32, 8);
    CHECK(!memcmp(ix, "AIDX", 4) && le(ix + 4, 4) == 0 && le(ix + 8, 8) == NSPEC);
    uint64_t nchunks = le(ix + 16, 8), meta = le(ix + 24, 8), at = 32, next = 0;
    for (size_t i = 0; i < NSPEC && at + 32 <= isz; i++) { /* tensor entries */
      const uint8_t *t = ix + at;
      uint64_t nl = le(t, 2), nd = t[3], ne = nelems_of(i);
      CHECK(t[2] == specs[i].dtype && nd == specs[i].ndim && le(t + 4, 4) == 0);
      CHECK(le(t + 8, 8) == 64 && le(t + 16, 8) == next && le(t + 24, 8) == (ne + 63) / 64);
      next += (ne + 63) / 64;
      for (uint64_t d = 0; d < nd && d < 2; d++)
        CHECK(le(t + 32 + 8 * d, 8) == (uint64_t)specs[i].shape[d]);
      at += 32 + 8 * nd;
      CHECK(at + nl + 2 <= isz);
      if (at + nl + 2 > isz) break;
      CHECK(nl == strlen(specs[i].name) && !memcmp(ix + at, specs[i].name, nl));
      at += nl;
      uint64_t pl = le(ix + at, 2);
      CHECK(pl == 5 && at + 7 <= isz && !memcmp(ix + at + 2, "exact", 5));
      at += 2 + pl;
    }
    CHECK(next == nchunks && at + 40 * nchunks + meta == isz);
    int seen[2] = {0};
    for (uint64_t j = 0; j < nchunks && at + 40 * j + 40 <= isz; j++) { /* chunk entries */
      const uint8_t *c = ix + at + 40 * j;
      uint64_t off = le(c, 8), sz = le(c + 8, 8);
      CHECK(off >= 64 && off + sz <= io && c[24] <= 1 && le(c + 25, 7) == 0);
      if (off < 64 || off + sz > io || c[24] > 1) continue;
      CHECK(le(c + 32, 8) == XXH3_64bits(b + off, sz));
      seen[c[24]]++;
    }
    /* step 10 is all RAW; step 20 has SHUF_ZSTD chunks (and RAW where zstd lost) */
    CHECK(f == 0 ? seen[0] == (int)nchunks : seen[1] > 0);
    char mt[256];
    int mlen = meta_of(steps[f], mt, sizeof mt);
    CHECK(meta == (uint64_t)mlen && meta <= isz &&
          !memcmp(ix + isz - meta, mt, (size_t)mlen));
    free(b);
  }
  snprintf(p, sizeof p, "%s/LATEST", GOLDEN);
  uint8_t *l = tu_read_file(p, &n);
  char want[64];
  snprintf(want, sizeof want, "20 %016" PRIx64 "\n", state[1]);
  CHECK(l && n == strlen(want) && !memcmp(l, want, n));
  free(l);
}

static void test_golden_store_is_left_untouched(void) {
  char p[4200];
  snprintf(p, sizeof p, "%s/.lock", GOLDEN);
  CHECK(access(p, F_OK) != 0); /* read-only opens take no lock and write nothing */
  snprintf(p, sizeof p, "%s/LATEST.tmp", GOLDEN);
  CHECK(access(p, F_OK) != 0);
}

int main(int argc, char **argv) {
  if (argc == 3 && !strcmp(argv[1], "--regenerate")) return regenerate(argv[2]);
  if (argc != 1) {
    fprintf(stderr, "usage: %s [--regenerate DIR]\n", argv[0]);
    return 2;
  }
  TEST_RUN(test_golden_store_lists_both_full_checkpoints);
  TEST_RUN(test_golden_tensors_restore_expected_values);
  TEST_RUN(test_golden_headers_match_the_format_table);
  TEST_RUN(test_golden_footer_index_and_chunks_match_the_format_tables);
  TEST_RUN(test_golden_store_is_left_untouched);
  return tu_finish();
}

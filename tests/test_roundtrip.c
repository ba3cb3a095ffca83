/*
 * test_roundtrip.c - full checkpoints restore exactly: every dtype, scalar, empty,
 * multi-chunk and odd-sized tensors, non-ASCII names, metadata, several steps,
 * reading one tensor alone, and the store's bookkeeping (list, latest, lock).
 */
#include <stdlib.h>
#include <sys/stat.h>

#include "testutil.h"

typedef struct {
  const char *name;
  int dtype;
  uint32_t ndim;
  int64_t shape[4];
} spec;

static const spec specs[] = {
    {"f32.matrix", AMBER_F32, 2, {33, 47}},
    {"f16", AMBER_F16, 1, {1001}},
    {"bf16", AMBER_BF16, 3, {2, 3, 5}},
    {"f64", AMBER_F64, 1, {77}},
    {"f8e4m3", AMBER_F8_E4M3, 1, {129}},
    {"f8e5m2", AMBER_F8_E5M2, 1, {3}},
    {"i64", AMBER_I64, 1, {10}},
    {"i32", AMBER_I32, 2, {4, 4}},
    {"i16", AMBER_I16, 1, {9}},
    {"i8", AMBER_I8, 1, {255}},
    {"u8", AMBER_U8, 1, {256}},
    {"bool", AMBER_BOOL, 1, {17}},
    {"u16", AMBER_U16, 1, {65}},
    {"u32", AMBER_U32, 2, {3, 3}},
    {"u64", AMBER_U64, 1, {40}},
    {"scalar.step", AMBER_I64, 0, {0}},
    {"empty", AMBER_F32, 2, {0, 5}},
    {"\xc3\xa9t\xc3\xa9.\xe6\x9d\x83\xe9\x87\x8d", AMBER_F32, 1, {5}}, /* été.权重 */
    {"multi.chunk", AMBER_F32, 1, {1000}}, /* 1000 elements over chunks of 64 */
};
#define NSPEC (sizeof specs / sizeof specs[0])

static size_t nbytes_of(const spec *s) {
  size_t n = amber_dtype_size(s->dtype);
  for (uint32_t d = 0; d < s->ndim; d++) n *= (size_t)s->shape[d];
  return n;
}

static amber_store *open_store(const char *dir) {
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, dir, NULL));
  return st;
}

/* Saves `steps` full checkpoints with fresh random data; returns the last data. */
static uint8_t **save_steps(const char *dir, int steps, uint64_t chunk, const char *meta) {
  amber_store *st = open_store(dir);
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.chunk_elems = chunk;
  amber_writer *w = NULL;
  CHECK_OK(amber_writer_open(&w, st, &wo));
  uint8_t **data = calloc(NSPEC, sizeof *data);
  for (size_t i = 0; i < NSPEC; i++) {
    data[i] = malloc(nbytes_of(&specs[i]) + 1);
    CHECK_OK(amber_writer_add(w, specs[i].name, specs[i].dtype, specs[i].ndim, specs[i].shape,
                              data[i], NULL));
  }
  if (meta) CHECK_OK(amber_writer_set_meta(w, meta, strlen(meta)));
  for (int s = 0; s < steps; s++) {
    for (size_t i = 0; i < NSPEC; i++)
      tu_fill_random(data[i], nbytes_of(&specs[i]), (uint64_t)(s * 100 + (int)i));
    CHECK_OK(amber_writer_save(w, (uint64_t)(10 * s + 10), AMBER_SAVE_FULL));
  }
  amber_writer_close(w);
  amber_store_close(st);
  return data;
}

static void check_restore(const char *dir, uint64_t step, uint8_t **want) {
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY;
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, dir, &so));
  amber_reader *r = NULL;
  CHECK_OK(amber_reader_open(&r, st, step, NULL));
  if (!r) {
    amber_store_close(st);
    return;
  }
  CHECK(amber_reader_count(r) == NSPEC);
  for (size_t i = 0; i < NSPEC; i++) {
    amber_tensor_info ti;
    CHECK_OK(amber_reader_info(r, i, &ti));
    CHECK(!strcmp(ti.name, specs[i].name));
    CHECK(ti.dtype == specs[i].dtype);
    CHECK(ti.ndim == specs[i].ndim);
    for (uint32_t d = 0; d < ti.ndim; d++) CHECK(ti.shape[d] == specs[i].shape[d]);
    CHECK(ti.nbytes == nbytes_of(&specs[i]));
    size_t idx = 99;
    CHECK_OK(amber_reader_find(r, specs[i].name, &idx));
    CHECK(idx == i);
    uint8_t *got = malloc(ti.nbytes + 1);
    CHECK_OK(amber_reader_read(r, i, got, ti.nbytes));
    CHECK(memcmp(got, want[i], ti.nbytes) == 0);
    free(got);
  }
  CHECK_OK(amber_reader_verify(r));
  amber_reader_close(r);
  amber_store_close(st);
}

static void free_data(uint8_t **d) {
  for (size_t i = 0; i < NSPEC; i++) free(d[i]);
  free(d);
}

static void test_every_dtype_and_shape_restores_bit_exact(void) {
  const char *dir = tu_tmpdir();
  uint8_t **d = save_steps(dir, 1, 64, NULL);
  check_restore(dir, AMBER_LATEST, d);
  check_restore(dir, 10, d);
  free_data(d);
}

static void test_default_chunking_restores_bit_exact(void) {
  const char *dir = tu_tmpdir();
  uint8_t **d = save_steps(dir, 1, 0, NULL);
  check_restore(dir, AMBER_LATEST, d);
  free_data(d);
}

static void test_large_multi_chunk_tensor_restores(void) {
  /* Larger than one 8 MiB staging buffer and not a multiple of the chunk. */
  const char *dir = tu_tmpdir();
  int64_t n = (3 << 20) + 12345;
  float *x = malloc((size_t)n * 4);
  tu_fill_random(x, (size_t)n * 4, 7);
  amber_store *st = open_store(dir);
  amber_writer *w = NULL;
  CHECK_OK(amber_writer_open(&w, st, NULL));
  CHECK_OK(amber_writer_add(w, "big", AMBER_F32, 1, &n, x, NULL));
  CHECK_OK(amber_writer_save(w, 1, 0));
  amber_writer_close(w);
  amber_reader *r = NULL;
  CHECK_OK(amber_reader_open(&r, st, AMBER_LATEST, NULL));
  float *y = malloc((size_t)n * 4);
  CHECK_OK(amber_reader_read(r, 0, y, (uint64_t)n * 4));
  CHECK(memcmp(x, y, (size_t)n * 4) == 0);
  amber_tensor_info ti;
  CHECK_OK(amber_reader_info(r, 0, &ti));
  CHECK(ti.nchunks == 4);
  amber_reader_close(r);
  amber_store_close(st);
  free(x);
  free(y);
}

static void test_compressed_full_restores_bit_exact(void) {
  const char *dir = tu_tmpdir();
  int64_t n = 50000;
  float *x = malloc((size_t)n * 4);
  for (int64_t i = 0; i < n; i++) x[i] = (float)(i % 100) * 0.01f; /* compressible */
  amber_store *st = open_store(dir);
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.flags = AMBER_WRITER_COMPRESS_FULL;
  wo.chunk_elems = 4096;
  amber_writer *w = NULL;
  CHECK_OK(amber_writer_open(&w, st, &wo));
  CHECK_OK(amber_writer_add(w, "x", AMBER_F32, 1, &n, x, NULL));
  CHECK_OK(amber_writer_save(w, 1, 0));
  amber_writer_close(w);
  amber_reader *r = NULL;
  CHECK_OK(amber_reader_open(&r, st, 1, NULL));
  amber_tensor_info ti;
  CHECK_OK(amber_reader_info(r, 0, &ti));
  CHECK(ti.stored_bytes < ti.nbytes / 2);
  float *y = calloc((size_t)n, 4);
  CHECK_OK(amber_reader_read(r, 0, y, (uint64_t)n * 4));
  CHECK(memcmp(x, y, (size_t)n * 4) == 0);
  CHECK_OK(amber_reader_verify(r));
  amber_reader_close(r);
  amber_store_close(st);
  free(x);
  free(y);
}

static void test_metadata_is_kept_exactly(void) {
  const char *dir = tu_tmpdir();
  const char *meta = "{\"step\": 10, \"lr\": 0.001, \"name\": \"r\\u00e9sum\\u00e9\"}";
  uint8_t **d = save_steps(dir, 1, 64, meta);
  amber_store *st = open_store(dir);
  amber_reader *r = NULL;
  CHECK_OK(amber_reader_open(&r, st, AMBER_LATEST, NULL));
  const char *m = NULL;
  size_t len = 0;
  CHECK_OK(amber_reader_meta(r, &m, &len));
  CHECK(len == strlen(meta) && m && !memcmp(m, meta, len));
  amber_reader_close(r);
  amber_store_close(st);
  free_data(d);
}

static void test_every_step_is_listed_and_restorable(void) {
  const char *dir = tu_tmpdir();
  uint8_t **d = save_steps(dir, 3, 64, NULL);
  amber_store *st = open_store(dir);
  amber_ckpt_info *info = NULL;
  size_t n = 0;
  CHECK_OK(amber_store_list(st, &info, &n));
  CHECK(n == 3);
  for (size_t i = 0; i < n && info; i++) {
    char path[4200];
    struct stat sb;
    snprintf(path, sizeof path, "%s/ckpt-%020llu.amber", dir, (unsigned long long)info[i].step);
    CHECK(info[i].step == 10 * (i + 1));
    CHECK(info[i].kind == AMBER_KIND_FULL);
    CHECK(info[i].parent == AMBER_NO_STEP);
    CHECK(stat(path, &sb) == 0 && (uint64_t)sb.st_size == info[i].bytes);
  }
  amber_free(info);
  uint64_t latest = 0;
  CHECK_OK(amber_store_latest(st, &latest));
  CHECK(latest == 30);
  amber_store_close(st);
  check_restore(dir, 30, d);
  free_data(d);
}

static void test_step_must_increase(void) {
  const char *dir = tu_tmpdir();
  uint8_t **d = save_steps(dir, 2, 64, NULL); /* steps 10, 20 */
  amber_store *st = open_store(dir);
  amber_writer *w = NULL;
  CHECK_OK(amber_writer_open(&w, st, NULL));
  int64_t one = 1;
  float v = 1;
  CHECK_OK(amber_writer_add(w, "v", AMBER_F32, 1, &one, &v, NULL));
  CHECK_RC(amber_writer_save(w, 20, 0), AMBER_EEXIST);
  CHECK(strstr(amber_last_error(w), "20") != NULL);
  CHECK_RC(amber_writer_save(w, 5, 0), AMBER_EEXIST);
  CHECK_OK(amber_writer_save(w, 21, 0));
  amber_writer_close(w);
  amber_store_close(st);
  free_data(d);
}

static void test_second_writer_is_locked_out(void) {
  const char *dir = tu_tmpdir();
  amber_store *a = open_store(dir), *b = NULL;
  CHECK_RC(amber_store_open(&b, dir, NULL), AMBER_ELOCKED);
  CHECK(b == NULL);
  CHECK(strstr(amber_last_error(NULL), dir) != NULL);
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY;
  CHECK_OK(amber_store_open(&b, dir, &so)); /* readers are not locked out */
  amber_writer *w = NULL;
  CHECK_RC(amber_writer_open(&w, b, NULL), AMBER_EREADONLY);
  amber_store_close(b);
  amber_store_close(a);
  CHECK_OK(amber_store_open(&b, dir, NULL)); /* the lock went with the handle */
  amber_store_close(b);
}

static void test_bad_arguments_are_refused(void) {
  const char *dir = tu_tmpdir();
  amber_store *st = open_store(dir);
  amber_writer *w = NULL;
  CHECK_OK(amber_writer_open(&w, st, NULL));
  int64_t shape[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1}, neg = -1;
  float v = 0;
  CHECK_RC(amber_writer_add(w, "", AMBER_F32, 1, shape, &v, NULL), AMBER_EINVAL);
  CHECK_RC(amber_writer_add(w, "x", 99, 1, shape, &v, NULL), AMBER_EINVAL);
  CHECK_RC(amber_writer_add(w, "x", AMBER_F32, 9, shape, &v, NULL), AMBER_EINVAL);
  CHECK_RC(amber_writer_add(w, "x", AMBER_F32, 1, &neg, &v, NULL), AMBER_EINVAL);
  CHECK_RC(amber_writer_add(w, "x", AMBER_F32, 1, shape, NULL, NULL), AMBER_EINVAL);
  CHECK_OK(amber_writer_add(w, "x", AMBER_F32, 1, shape, &v, NULL));
  CHECK_RC(amber_writer_add(w, "x", AMBER_F32, 1, shape, &v, NULL), AMBER_EEXIST);
  CHECK_RC(amber_writer_add_policy(w, "threshold:abc"), AMBER_EINVAL);
  CHECK_RC(amber_writer_add_policy(w, "budget:2"), AMBER_EINVAL);
  CHECK_RC(amber_writer_add_policy(w, "=exact"), AMBER_EINVAL);
  CHECK_OK(amber_writer_add_policy(w, "*.exp_avg_sq=threshold:0:1e-3"));
  CHECK_RC(amber_writer_save(w, 1, 0x80), AMBER_EINVAL);
  CHECK_RC(amber_writer_set_data(w, 5, &v), AMBER_EINVAL);
  amber_writer *w2 = NULL;
  CHECK_RC(amber_writer_open(&w2, st, NULL), AMBER_EBUSY);
  amber_writer_close(w);
  amber_reader *r = NULL;
  CHECK_RC(amber_reader_open(&r, st, AMBER_LATEST, NULL), AMBER_ENOENT);
  amber_store_close(st);
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_NOCREATE;
  char missing[4200];
  snprintf(missing, sizeof missing, "%s/nope", dir);
  CHECK_RC(amber_store_open(&st, missing, &so), AMBER_ENOENT);
}

static void test_error_table_is_complete(void) {
  for (int c = -1; c >= -16; c--) {
    CHECK(strcmp(amber_strerror(c), "unknown error") != 0);
    CHECK(strncmp(amber_err_name(c), "AMBER_E", 7) == 0);
  }
  CHECK(!strcmp(amber_strerror(-1000), "unknown error"));
  CHECK(amber_version() == ((AMBER_VERSION_MAJOR << 16) | (AMBER_VERSION_MINOR << 8) |
                            AMBER_VERSION_PATCH));
  CHECK(!strcmp(amber_version_string(), AMBER_VERSION_STRING));
  for (int dt = AMBER_F32; dt <= AMBER_U64; dt++)
    CHECK(amber_dtype_from_name(amber_dtype_name(dt)) == dt);
  CHECK(amber_dtype_size(AMBER_U16) == 2 && amber_dtype_size(AMBER_U32) == 4 &&
        amber_dtype_size(AMBER_U64) == 8);
  CHECK(amber_dtype_size(0) == 0 && amber_dtype_size(16) == 0 && !amber_dtype_name(16));
}

int main(void) {
  TEST_RUN(test_every_dtype_and_shape_restores_bit_exact);
  TEST_RUN(test_default_chunking_restores_bit_exact);
  TEST_RUN(test_large_multi_chunk_tensor_restores);
  TEST_RUN(test_compressed_full_restores_bit_exact);
  TEST_RUN(test_metadata_is_kept_exactly);
  TEST_RUN(test_every_step_is_listed_and_restorable);
  TEST_RUN(test_step_must_increase);
  TEST_RUN(test_second_writer_is_locked_out);
  TEST_RUN(test_bad_arguments_are_refused);
  TEST_RUN(test_error_table_is_complete);
  return tu_finish();
}

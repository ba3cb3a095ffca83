/*
 * test_safetensors.c - the safetensors header parser and formatter
 * (tools/safetensors.c): round trips of every dtype and of the odd shapes, the
 * formatter's layout and refusals, and one test per kind of malformed header,
 * each pinning the error code and that the message names the tensor. Every file
 * the formatter lays out is also read by safetensors (tu_st_reference_check).
 */
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "safetensors.h"
#include "testutil.h"

static const int all_dtypes[] = {
    AMBER_F64, AMBER_F32, AMBER_F16, AMBER_BF16, AMBER_F8_E4M3, AMBER_F8_E5M2, AMBER_I64,
    AMBER_I32, AMBER_I16, AMBER_I8,  AMBER_U8,   AMBER_BOOL,    AMBER_U16,     AMBER_U32,
    AMBER_U64};
#define NDT (sizeof all_dtypes / sizeof all_dtypes[0])

/* A file image: 8-byte length, `json`, then `data_size` zero bytes. */
static uint8_t *make_file(const char *json, size_t data_size, size_t *len) {
  size_t n = strlen(json);
  uint8_t *b = calloc(1, 8 + n + data_size);
  if (!b) abort();
  for (int i = 0; i < 8; i++)
    b[i] = (uint8_t)((uint64_t)n >> (8 * i));
  memcpy(b + 8, json, n);
  *len = 8 + n + data_size;
  return b;
}

static int parse_json(const char *json, size_t data_size, amber__st_header *h, char *err,
                      size_t errlen) {
  size_t len;
  uint8_t *b = make_file(json, data_size, &len);
  int rc = amber__st_parse(b, len, len, h, err, errlen);
  free(b);
  return rc;
}

/* Parses a malformed header: wants `code`, a message that mentions each of the
 * NULL-terminated `mentions`, and an empty header left behind. */
static void expect_bad_at(int line, const char *json, size_t data_size, int code, ...) {
  amber__st_header h;
  char err[512] = "";
  int rc = parse_json(json, data_size, &h, err, sizeof err);
  int ok = rc == code && err[0] && !h.tensors && !h.count && !h.metadata;
  va_list ap;
  va_start(ap, code);
  for (const char *m; (m = va_arg(ap, const char *));)
    ok = ok && strstr(err, m);
  va_end(ap);
  if (!ok) {
    fprintf(stderr, "%s:%d: header %s: got %s \"%s\", wanted %s\n", __FILE__, line, json,
            amber_err_name(rc), err, amber_err_name(code));
    tu_failures++;
  }
  if (rc == 0) amber__st_header_free(&h);
}
#define EXPECT_BAD(json, size, code, ...)                                                \
  expect_bad_at(__LINE__, json, size, code, __VA_ARGS__)

/* Sets t's nbytes from its shape and dtype. */
static void set_tensor(amber__st_tensor *t, const char *name, int dtype, uint32_t ndim,
                       const int64_t *shape) {
  memset(t, 0, sizeof *t);
  t->name = (char *)name;
  t->dtype = dtype;
  t->ndim = ndim;
  uint64_t n = amber_dtype_size(dtype);
  for (uint32_t i = 0; i < ndim; i++) {
    t->shape[i] = shape[i];
    n *= (uint64_t)shape[i];
  }
  t->nbytes = n;
}

static int write_all(const char *path, const uint8_t *a, size_t alen, size_t zeros) {
  uint8_t *b = calloc(1, alen + zeros);
  if (!b) return -1;
  memcpy(b, a, alen);
  int rc = tu_write_file(path, b, alen + zeros);
  free(b);
  return rc;
}

/* Formats t[0..n), parses the result and checks that everything came back, also
 * through safetensors' reader. */
static void round_trip(amber__st_tensor *t, size_t n, const char *meta) {
  uint8_t *out = NULL;
  size_t outlen = 0;
  char err[512] = "";
  int rc = amber__st_format_header(t, n, meta, meta ? strlen(meta) : 0, &out, &outlen,
                                   err, sizeof err);
  CHECK_OK(rc);
  if (rc) {
    fprintf(stderr, "format: %s\n", err);
    return;
  }
  CHECK(outlen % 8 == 0 && outlen > 8);
  uint64_t pos = outlen;
  for (size_t i = 0; i < n; i++) {
    CHECK(t[i].offset == pos);
    pos += t[i].nbytes;
  }
  amber__st_header h;
  rc = amber__st_parse(out, outlen, pos, &h, err, sizeof err);
  CHECK_OK(rc);
  if (rc) fprintf(stderr, "parse: %s\n", err);
  if (rc == 0) {
    CHECK(h.data_start == outlen);
    CHECK(h.count == n);
    for (size_t i = 0; i < n && i < h.count; i++) {
      /* back to back: the parser's offset order is the given order, except that an
       * empty tensor sorts before the non-empty one it shares an offset with */
      const amber__st_tensor *g = NULL;
      for (size_t j = 0; j < h.count; j++)
        if (!strcmp(h.tensors[j].name, t[i].name)) g = &h.tensors[j];
      CHECK(g != NULL);
      if (!g) continue;
      CHECK(g->dtype == t[i].dtype && g->ndim == t[i].ndim);
      CHECK(!memcmp(g->shape, t[i].shape, t[i].ndim * sizeof t[i].shape[0]));
      CHECK(g->offset == t[i].offset && g->nbytes == t[i].nbytes);
    }
    if (meta)
      CHECK(h.metadata && h.metadata_len == strlen(meta) && !strcmp(h.metadata, meta));
    else
      CHECK(h.metadata == NULL && h.metadata_len == 0);
    amber__st_header_free(&h);
  }
  char path[4200];
  snprintf(path, sizeof path, "%s/round-trip.safetensors", tu_tmpdir());
  CHECK(write_all(path, out, outlen, (size_t)(pos - outlen)) == 0);
  tu_st_reference_check(path);
  free(out);
}

static void test_round_trip_every_dtype_with_metadata(void) {
  amber__st_tensor t[NDT];
  char names[NDT][16];
  for (size_t i = 0; i < NDT; i++) {
    int64_t shape[3] = {(int64_t)i + 1, 3, 2};
    snprintf(names[i], sizeof names[i], "t%zu.%s", i, amber_dtype_name(all_dtypes[i]));
    set_tensor(&t[i], names[i], all_dtypes[i], (uint32_t)(1 + i % 3), shape);
  }
  round_trip(t, NDT, "{\"format\":\"pt\",\"step\":\"100\"}");
  round_trip(t, NDT, NULL);
}

static void test_round_trip_scalar_empty_and_non_ascii_names(void) {
  amber__st_tensor t[5];
  int64_t zero[1] = {0}, mid_zero[3] = {2, 0, 3}, eight[8] = {1, 2, 1, 2, 1, 2, 1, 2},
          two[1] = {2};
  set_tensor(&t[0], "step", AMBER_I64, 0, NULL);
  set_tensor(&t[1], "empty", AMBER_F32, 1, zero);
  set_tensor(&t[2], "层.0.权重", AMBER_BF16, 3, mid_zero);
  set_tensor(&t[3], "poids.é", AMBER_F16, 8, eight);
  set_tensor(&t[4], "after_empty.🙂", AMBER_U8, 1, two);
  CHECK(t[0].nbytes == 8 && t[1].nbytes == 0 && t[2].nbytes == 0);
  round_trip(t, 5, "{\"説明\":\"ünïcödé\"}");
}

static void test_format_writes_utf8_in_given_order_padded(void) {
  amber__st_tensor t[3];
  int64_t s[1] = {3};
  set_tensor(&t[0], "zeta", AMBER_F32, 1, s);
  set_tensor(&t[1], "alpha", AMBER_F32, 1, s);
  set_tensor(&t[2], "µ", AMBER_I8, 1, s);
  uint8_t *out = NULL;
  size_t outlen = 0;
  char err[256];
  CHECK_OK(
      amber__st_format_header(t, 3, "{\"k\":\"v\"}", 9, &out, &outlen, err, sizeof err));
  if (!out) return;
  char *js = calloc(1, outlen);
  memcpy(js, out + 8, outlen - 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; i--)
    n = (n << 8) | out[i];
  CHECK(n == outlen - 8 && outlen % 8 == 0);
  char *m = strstr(js, "__metadata__"), *z = strstr(js, "zeta"), *a = strstr(js, "alpha"),
       *mu = strstr(js, "µ"); /* raw UTF-8, not \u escaped */
  CHECK(m && z && a && mu && m < z && z < a && a < mu);
  CHECK(strstr(js, "\"data_offsets\":[0,12]") && strstr(js, "\"data_offsets\":[24,27]"));
  char *end = strrchr(js, '}'); /* then only the spaces that pad to 8 */
  CHECK(end && strspn(end + 1, " ") == strlen(end + 1) && strlen(end + 1) < 8);
  CHECK(t[0].offset == outlen && t[1].offset == outlen + 12 &&
        t[2].offset == outlen + 24);
  free(js);
  free(out);
}

static void expect_format_einval(amber__st_tensor *t, size_t n, const char *meta,
                                 const char *mention) {
  uint8_t *out = (uint8_t *)&out;
  size_t outlen = 1;
  char err[256] = "";
  for (size_t i = 0; i < n; i++)
    t[i].offset = 12345;
  int rc = amber__st_format_header(t, n, meta, meta ? strlen(meta) : 0, &out, &outlen,
                                   err, sizeof err);
  CHECK_RC(rc, AMBER_EINVAL);
  CHECK(out == NULL && outlen == 0 && err[0]);
  if (mention && !strstr(err, mention)) {
    fprintf(stderr, "format error \"%s\" does not mention '%s'\n", err, mention);
    tu_failures++;
  }
  for (size_t i = 0; i < n; i++)
    CHECK(t[i].offset == 12345);
}

static void test_format_rejects_bad_tensors_and_metadata(void) {
  amber__st_tensor t[2];
  int64_t s[AMBER_MAX_DIMS] = {2, 2, 2, 2, 2, 2, 2, 2};
  set_tensor(&t[0], "", AMBER_F32, 1, s);
  expect_format_einval(t, 1, NULL, "empty");
  set_tensor(&t[0], NULL, AMBER_F32, 1, s);
  expect_format_einval(t, 1, NULL, "empty");
  set_tensor(&t[0], "__metadata__", AMBER_F32, 1, s);
  expect_format_einval(t, 1, NULL, "__metadata__");
  set_tensor(&t[0], "bad\xff", AMBER_F32, 1, s);
  expect_format_einval(t, 1, NULL, "UTF-8");
  set_tensor(&t[0], "surrogate\xed\xa0\x80", AMBER_F32, 1, s);
  expect_format_einval(t, 1, NULL, "UTF-8");
  set_tensor(&t[0], "overlong\xc0\xaf", AMBER_F32, 1, s);
  expect_format_einval(t, 1, NULL, "UTF-8");
  set_tensor(&t[0], "cut\xf0\x9f\x99", AMBER_F32, 1, s);
  expect_format_einval(t, 1, NULL, "UTF-8");
  int64_t big[1] = {(int64_t)1 << 60}; /* 2^63 bytes of F64: offsets would not fit */
  set_tensor(&t[0], "huge", AMBER_F64, 1, big);
  expect_format_einval(t, 1, NULL, "'huge'");
  set_tensor(&t[0], "w", AMBER_F32, 1, s);
  set_tensor(&t[1], "w", AMBER_F16, 1, s);
  expect_format_einval(t, 2, NULL, "'w'");
  t[0].dtype = 0;
  expect_format_einval(t, 1, NULL, "'w'");
  t[0].dtype = 99;
  expect_format_einval(t, 1, NULL, "'w'");
  set_tensor(&t[0], "w", AMBER_U8, AMBER_MAX_DIMS, s);
  t[0].ndim = AMBER_MAX_DIMS + 1;
  expect_format_einval(t, 1, NULL, "'w'");
  set_tensor(&t[0], "w", AMBER_F32, 1, s);
  t[0].nbytes = 7;
  expect_format_einval(t, 1, NULL, "'w'");
  t[0].shape[0] = -2;
  t[0].nbytes = 0;
  expect_format_einval(t, 1, NULL, "'w'");
  set_tensor(&t[0], "w", AMBER_F32, 1, s);
  expect_format_einval(t, 1, "{\"a\":", NULL);
  expect_format_einval(t, 1, "[\"a\"]", "object");
  expect_format_einval(t, 1, "{\"a\":1}", "'a'");
  expect_format_einval(t, 1, "{\"a\":\"x\",\"a\":\"y\"}", NULL);
}

static void test_parse_sorts_by_offset_and_accepts_gaps_and_padding(void) {
  amber__st_header h;
  char err[256] = "";
  int rc =
      parse_json("{\"b\":{\"dtype\":\"I16\",\"shape\":[2],\"data_offsets\":[8,12]},"
                 "\"a\":{\"data_offsets\":[0,4],\"shape\":[4],\"dtype\":\"U8\"}}    ",
                 16, &h, err, sizeof err);
  CHECK_OK(rc);
  if (rc) return;
  CHECK(h.count == 2 && h.metadata == NULL);
  CHECK(!strcmp(h.tensors[0].name, "a") && !strcmp(h.tensors[1].name, "b"));
  CHECK(h.tensors[0].offset == h.data_start && h.tensors[1].offset == h.data_start + 8);
  CHECK(h.tensors[1].dtype == AMBER_I16 && h.tensors[1].nbytes == 4);
  amber__st_header_free(&h);
}

static void test_parse_accepts_empty_tensor_anywhere(void) {
  amber__st_header h;
  char err[256] = "";
  /* a 0-byte tensor holds no byte, so it overlaps nothing even inside another */
  int rc = parse_json("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                      "\"e\":{\"dtype\":\"F32\",\"shape\":[0,5],\"data_offsets\":[4,4]},"
                      "\"f\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,8]}}",
                      8, &h, err, sizeof err);
  CHECK_OK(rc);
  if (rc) return;
  CHECK(h.count == 3 && h.tensors[1].nbytes == 0 && h.tensors[1].ndim == 2);
  amber__st_header_free(&h);
  CHECK_OK(parse_json("{}", 0, &h, err, sizeof err));
  CHECK(h.count == 0);
  amber__st_header_free(&h);
}

static void test_rejects_file_shorter_than_length_field(void) {
  amber__st_header h;
  char err[256] = "";
  const uint8_t b[5] = {1, 0, 0, 0, 0};
  CHECK_RC(amber__st_parse(b, sizeof b, sizeof b, &h, err, sizeof err), AMBER_ECORRUPT);
  CHECK(err[0]);
}

static void test_parse_refuses_buffer_shorter_than_header(void) {
  amber__st_header h;
  char err[256] = "";
  size_t len;
  uint8_t *b = make_file("{}      ", 64, &len);
  /* the header is fine but the caller passed only part of it */
  CHECK_RC(amber__st_parse(b, 12, len, &h, err, sizeof err), AMBER_EINVAL);
  CHECK_RC(amber__st_parse(b, 4, len, &h, err, sizeof err), AMBER_EINVAL);
  CHECK_RC(amber__st_parse(NULL, 16, len, &h, err, sizeof err), AMBER_EINVAL);
  CHECK_OK(amber__st_parse(b, 16, len, &h, err, sizeof err));
  amber__st_header_free(&h);
  amber__st_header_free(NULL);
  free(b);
}

static void test_rejects_header_length_beyond_file(void) {
  amber__st_header h;
  char err[256] = "";
  size_t len;
  uint8_t *b = make_file("{}", 8, &len);
  b[0] = 11; /* 8 + 11 = 19 > 18 */
  CHECK_RC(amber__st_parse(b, len, len, &h, err, sizeof err), AMBER_ECORRUPT);
  CHECK(err[0]);
  b[0] = 10; /* fits exactly: "{}" + 8 zero bytes is not JSON */
  CHECK_RC(amber__st_parse(b, len, len, &h, err, sizeof err), AMBER_ECORRUPT);
  free(b);
}

static void test_rejects_huge_header_length_before_allocating(void) {
  amber__st_header h;
  char err[256] = "";
  size_t len;
  uint8_t *b = make_file("{}", 0, &len);
  memset(b, 0, 8);
  b[7] = 0x80; /* 2^63 */
  CHECK_RC(amber__st_parse(b, len, len, &h, err, sizeof err), AMBER_ECORRUPT);
  CHECK(err[0]);
  /* over the limit even where the claimed file would be big enough */
  memset(b, 0, 8);
  b[5] = 1; /* 2^40 */
  CHECK_RC(amber__st_parse(b, len, UINT64_MAX, &h, err, sizeof err), AMBER_ECORRUPT);
  free(b);
}

static void test_rejects_invalid_json(void) {
  EXPECT_BAD("{\"w\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,", 8,
             AMBER_ECORRUPT, "JSON", NULL);
  EXPECT_BAD("{} x", 0, AMBER_ECORRUPT, "JSON", NULL);
  EXPECT_BAD("", 8, AMBER_ECORRUPT, "JSON", NULL);
  EXPECT_BAD("{\"w\":1e999999}", 0, AMBER_ECORRUPT, "JSON", NULL);
}

static void test_rejects_header_that_is_not_an_object(void) {
  EXPECT_BAD("[]", 0, AMBER_ECORRUPT, "object", NULL);
  EXPECT_BAD("\"w\"", 0, AMBER_ECORRUPT, "JSON", NULL); /* jansson wants [ or { */
  EXPECT_BAD("{\"w\":[\"F32\",[1],[0,4]]}", 4, AMBER_ECORRUPT, "'w'", NULL);
}

/* The dtypes of safetensors 0.8 that amber does not carry, and made-up ones. */
static void test_rejects_unsupported_dtype_with_eformat(void) {
  static const char *const names[] = {"F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F6_E2M3",
                                      "F6_E3M2", "F4", "C64", "U128", "u16"};
  char json[256];
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    snprintf(json, sizeof json,
             "{\"a\":{\"dtype\":\"U8\",\"shape\":[8],\"data_offsets\":[0,8]},"
             "\"s.%zu\":{\"dtype\":\"%s\",\"shape\":[8],\"data_offsets\":[8,16]}}",
             i, names[i]);
    char tensor[16], dtype[32];
    snprintf(tensor, sizeof tensor, "'s.%zu'", i);
    snprintf(dtype, sizeof dtype, "'%s'", names[i]);
    EXPECT_BAD(json, 16, AMBER_EFORMAT, tensor, dtype, "not supported", NULL);
  }
  EXPECT_BAD("{\"w\":{\"dtype\":\"f32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8,
             AMBER_EFORMAT, "'w'", "f32", NULL);
  EXPECT_BAD("{\"w\":{\"dtype\":1,\"shape\":[2],\"data_offsets\":[0,8]}}", 8,
             AMBER_ECORRUPT, "'w'", NULL);
}

static void test_rejects_more_than_max_dims(void) {
  EXPECT_BAD(
      "{\"w\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,1]}}",
      8, AMBER_EFORMAT, "'w'", NULL);
}

static void test_rejects_bad_shape_entries(void) {
  EXPECT_BAD("{\"w\":{\"dtype\":\"U8\",\"shape\":[-2],\"data_offsets\":[0,0]}}", 8,
             AMBER_ECORRUPT, "'w'", NULL);
  EXPECT_BAD("{\"w\":{\"dtype\":\"U8\",\"shape\":[2.0],\"data_offsets\":[0,2]}}", 8,
             AMBER_ECORRUPT, "'w'", NULL);
  EXPECT_BAD("{\"w\":{\"dtype\":\"U8\",\"shape\":[\"2\"],\"data_offsets\":[0,2]}}", 8,
             AMBER_ECORRUPT, "'w'", NULL);
  EXPECT_BAD("{\"w\":{\"dtype\":\"U8\",\"shape\":2,\"data_offsets\":[0,2]}}", 8,
             AMBER_ECORRUPT, "'w'", NULL);
}

static void test_rejects_shape_size_overflow(void) {
  /* 2^80 elements; and 2^62 elements whose 8-byte size is 2^65 */
  EXPECT_BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[1099511627776,1099511627776],"
             "\"data_offsets\":[0,0]}}",
             8, AMBER_ECORRUPT, "'w'", "overflow", NULL);
  EXPECT_BAD("{\"d\":{\"dtype\":\"F64\",\"shape\":[2147483648,2147483648],"
             "\"data_offsets\":[0,0]}}",
             8, AMBER_ECORRUPT, "'d'", "overflow", NULL);
}

static void test_rejects_bad_data_offsets(void) {
  EXPECT_BAD("{\"w\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2,4]}}", 8,
             AMBER_ECORRUPT, "'w'", NULL);
  EXPECT_BAD("{\"w\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[2]}}", 8,
             AMBER_ECORRUPT, "'w'", NULL);
  EXPECT_BAD("{\"w\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[-2,0]}}", 8,
             AMBER_ECORRUPT, "'w'", NULL);
  EXPECT_BAD("{\"w\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0.0,2]}}", 8,
             AMBER_ECORRUPT, "'w'", NULL);
  EXPECT_BAD("{\"w\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[4,2]}}", 8,
             AMBER_ECORRUPT, "'w'", "begin", NULL);
  EXPECT_BAD("{\"w\":{\"dtype\":\"U8\",\"shape\":[16],\"data_offsets\":[0,16]}}", 8,
             AMBER_ECORRUPT, "'w'", "past the end", NULL);
  EXPECT_BAD("{\"w\":{\"dtype\":\"U8\",\"shape\":[0],"
             "\"data_offsets\":[9223372036854775807,9223372036854775807]}}",
             8, AMBER_ECORRUPT, "'w'", NULL);
}

static void test_rejects_offsets_not_matching_shape(void) {
  amber__st_header h;
  char err[256] = "";
  CHECK_RC(parse_json("{\"w\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,12]}}",
                      16, &h, err, sizeof err),
           AMBER_ECORRUPT);
  CHECK(!strcmp(
      err, "tensor 'w': data_offsets [0, 12] do not match shape [4] of F32 (16 bytes)"));
  EXPECT_BAD("{\"s\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[0,4]}}", 8,
             AMBER_ECORRUPT, "'s'", "[]", NULL);
}

static void test_rejects_overlapping_tensors(void) {
  EXPECT_BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
             "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
             16, AMBER_ECORRUPT, "'a'", "'b'", "overlap", NULL);
  EXPECT_BAD("{\"b\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]},"
             "\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]}}",
             16, AMBER_ECORRUPT, "'a'", "'b'", NULL);
}

static void test_rejects_duplicate_tensor_name(void) {
  EXPECT_BAD("{\"w\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]},"
             "\"w\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[2,4]}}",
             8, AMBER_ECORRUPT, "duplicate", "\"w\"", NULL);
}

static void test_rejects_bad_metadata(void) {
  EXPECT_BAD("{\"__metadata__\":{\"step\":100}}", 0, AMBER_ECORRUPT, "'step'", NULL);
  EXPECT_BAD("{\"__metadata__\":[\"a\"]}", 0, AMBER_ECORRUPT, "__metadata__", NULL);
  EXPECT_BAD("{\"__metadata__\":\"x\"}", 0, AMBER_ECORRUPT, "__metadata__", NULL);
}

static void test_rejects_empty_name_and_bad_entry_keys(void) {
  EXPECT_BAD("{\"\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]}}", 8,
             AMBER_ECORRUPT, "empty name", NULL);
  EXPECT_BAD("{\"w\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2],\"x\":1}}", 8,
             AMBER_ECORRUPT, "'w'", "'x'", NULL);
  EXPECT_BAD("{\"w\":{\"shape\":[2],\"data_offsets\":[0,2]}}", 8, AMBER_ECORRUPT, "'w'",
             "dtype", NULL);
  EXPECT_BAD("{\"w\":{\"dtype\":\"U8\",\"data_offsets\":[0,2]}}", 8, AMBER_ECORRUPT,
             "'w'", "shape", NULL);
  EXPECT_BAD("{\"w\":{\"dtype\":\"U8\",\"shape\":[2]}}", 8, AMBER_ECORRUPT, "'w'",
             "data_offsets", NULL);
}

static void test_read_header_from_file(void) {
  char path[4096];
  snprintf(path, sizeof path, "%s/model.safetensors", tu_tmpdir());
  amber__st_tensor t[2];
  int64_t s[2] = {3, 5};
  set_tensor(&t[0], "embed", AMBER_BF16, 2, s);
  set_tensor(&t[1], "bias", AMBER_F32, 1, s);
  uint8_t *out = NULL;
  size_t outlen = 0;
  char err[256] = "";
  CHECK_OK(
      amber__st_format_header(t, 2, "{\"a\":\"b\"}", 9, &out, &outlen, err, sizeof err));
  if (!out) return;
  CHECK(write_all(path, out, outlen, 30 + 12) == 0);
  tu_st_reference_check(path);
  free(out);
  int fd = open(path, O_RDONLY);
  CHECK(fd >= 0);
  struct stat sb;
  CHECK(fstat(fd, &sb) == 0);
  amber__st_header h;
  int rc = amber__st_read_header(fd, (uint64_t)sb.st_size, &h, err, sizeof err);
  CHECK_OK(rc);
  if (rc == 0) {
    CHECK(h.count == 2 && h.data_start == outlen);
    CHECK(!strcmp(h.tensors[0].name, "embed") && h.tensors[0].offset == outlen &&
          h.tensors[0].nbytes == 30);
    CHECK(!strcmp(h.tensors[1].name, "bias") && h.tensors[1].offset == outlen + 30);
    CHECK(h.metadata && !strcmp(h.metadata, "{\"a\":\"b\"}"));
    amber__st_header_free(&h);
  }
  close(fd);
  CHECK_RC(amber__st_read_header(-1, 100, &h, err, sizeof err), AMBER_EIO);
  CHECK(err[0]);
}

static void test_read_header_refuses_huge_length_on_small_file(void) {
  char path[4096];
  snprintf(path, sizeof path, "%s/huge.safetensors", tu_tmpdir());
  uint8_t b[64] = {0};
  b[5] = 1; /* N = 2^40 */
  memcpy(b + 8, "{}", 2);
  CHECK(tu_write_file(path, b, sizeof b) == 0);
  int fd = open(path, O_RDONLY);
  CHECK(fd >= 0);
  amber__st_header h;
  char err[256] = "";
  CHECK_RC(amber__st_read_header(fd, sizeof b, &h, err, sizeof err), AMBER_ECORRUPT);
  CHECK_RC(amber__st_read_header(fd, 4, &h, err, sizeof err), AMBER_ECORRUPT);
  close(fd);
}

static void test_read_header_reports_file_shorter_than_told(void) {
  char path[4096];
  snprintf(path, sizeof path, "%s/short.safetensors", tu_tmpdir());
  uint8_t b[16] = {100}; /* N = 100, but the file ends after 16 bytes */
  CHECK(tu_write_file(path, b, sizeof b) == 0);
  int fd = open(path, O_RDONLY);
  CHECK(fd >= 0);
  amber__st_header h;
  char err[256] = "";
  CHECK_RC(amber__st_read_header(fd, 4096, &h, err, sizeof err), AMBER_EIO);
  CHECK(err[0] && h.tensors == NULL);
  close(fd);
}

int main(void) {
  TEST_RUN(test_round_trip_every_dtype_with_metadata);
  TEST_RUN(test_round_trip_scalar_empty_and_non_ascii_names);
  TEST_RUN(test_format_writes_utf8_in_given_order_padded);
  TEST_RUN(test_format_rejects_bad_tensors_and_metadata);
  TEST_RUN(test_parse_sorts_by_offset_and_accepts_gaps_and_padding);
  TEST_RUN(test_parse_accepts_empty_tensor_anywhere);
  TEST_RUN(test_rejects_file_shorter_than_length_field);
  TEST_RUN(test_parse_refuses_buffer_shorter_than_header);
  TEST_RUN(test_rejects_header_length_beyond_file);
  TEST_RUN(test_rejects_huge_header_length_before_allocating);
  TEST_RUN(test_rejects_invalid_json);
  TEST_RUN(test_rejects_header_that_is_not_an_object);
  TEST_RUN(test_rejects_unsupported_dtype_with_eformat);
  TEST_RUN(test_rejects_more_than_max_dims);
  TEST_RUN(test_rejects_bad_shape_entries);
  TEST_RUN(test_rejects_shape_size_overflow);
  TEST_RUN(test_rejects_bad_data_offsets);
  TEST_RUN(test_rejects_offsets_not_matching_shape);
  TEST_RUN(test_rejects_overlapping_tensors);
  TEST_RUN(test_rejects_duplicate_tensor_name);
  TEST_RUN(test_rejects_bad_metadata);
  TEST_RUN(test_rejects_empty_name_and_bad_entry_keys);
  TEST_RUN(test_read_header_from_file);
  TEST_RUN(test_read_header_refuses_huge_length_on_small_file);
  TEST_RUN(test_read_header_reports_file_shorter_than_told);
  return tu_finish();
}

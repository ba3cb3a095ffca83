/*
 * test_cli.c - the `amber` command line as other programs use it (docs/DESIGN.md,
 * "Interfaces other programs depend on"): import then export is bit-exact for every
 * dtype, scalar, empty, multi-chunk and non-ASCII tensors and keeps __metadata__;
 * ls/info/verify --json parse and report what is on disk; verify catches a flipped
 * byte; exit status 2 for usage errors and 1 for failures, which leave the store and
 * the output file as they were. Every exported file is also read by safetensors
 * (tu_st_reference_check).
 */
#include <dirent.h>
#include <stdarg.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "safetensors.h"
#include "cli_run.h"
#include "testutil.h"

typedef struct {
  const char *name;
  int dtype;
  uint32_t ndim;
  int64_t shape[4];
} spec;

static const spec all_dtypes[] = {
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
    {"u64", AMBER_U64, 0, {0}},
    {"scalar.step", AMBER_I64, 0, {0}},
    {"empty", AMBER_F32, 2, {0, 5}},
    {"\xc3\xa9t\xc3\xa9.\xe6\x9d\x83\xe9\x87\x8d", AMBER_F32, 1, {5}}, /* été.权重 */
    {"multi.chunk", AMBER_F32, 1, {1572864}}, /* 1.5 Mi: two default chunks */
};
#define NALL (sizeof all_dtypes / sizeof all_dtypes[0])

static const char *meta_json = "{\"format\":\"pt\",\"note\":\"caf\xc3\xa9\"}";

/* Writes a safetensors file of random tensors with amber__st_format_header. */
static int write_safetensors(const char *path, const spec *s, size_t n, const char *meta,
                             uint64_t seed) {
  amber__st_tensor t[32];
  CHECK(n <= 32);
  for (size_t i = 0; i < n; i++) {
    memset(&t[i], 0, sizeof t[i]);
    t[i].name = (char *)s[i].name;
    t[i].dtype = s[i].dtype;
    t[i].ndim = s[i].ndim;
    t[i].nbytes = amber_dtype_size(s[i].dtype);
    for (uint32_t d = 0; d < s[i].ndim; d++) {
      t[i].shape[d] = s[i].shape[d];
      t[i].nbytes *= (uint64_t)s[i].shape[d];
    }
  }
  uint8_t *hdr = NULL;
  size_t hlen = 0;
  char err[256];
  int rc = amber__st_format_header(t, n, meta, meta ? strlen(meta) : 0, &hdr, &hlen, err,
                                   sizeof err);
  CHECK_OK(rc);
  if (rc) return -1;
  FILE *f = fopen(path, "wb");
  CHECK(f != NULL);
  if (!f) return -1;
  fwrite(hdr, 1, hlen, f);
  free(hdr);
  for (size_t i = 0; i < n; i++) {
    uint8_t *b = malloc(t[i].nbytes + 1);
    tu_fill_random(b, (size_t)t[i].nbytes, seed + i);
    fwrite(b, 1, (size_t)t[i].nbytes, f);
    free(b);
  }
  return fclose(f);
}

/* ---- running the CLI (cli_run.h) ---- */

/* Runs the CLI and parses its stdout as JSON; NULL (and a failed check) if not. */
__attribute__((format(printf, 2, 3))) static json_t *cli_json(int want_rc,
                                                              const char *fmt, ...) {
  char args[4096];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(args, sizeof args, fmt, ap);
  va_end(ap);
  result r = cli("%s", args);
  CHECK(r.rc == want_rc);
  json_error_t je;
  json_t *j = json_loads(r.out, 0, &je);
  if (!j || r.rc != want_rc)
    fprintf(stderr, "amber %s: rc %d, stdout '%s', stderr '%s', json: %s\n", args, r.rc,
            r.out, r.err, je.text);
  CHECK(j != NULL);
  result_free(&r);
  return j;
}

/* 1 when `j` is the JSON string `s`; 0 also when it is missing. */
static int str_is(const json_t *j, const char *s) {
  const char *v = json_string_value(j);
  return v && !strcmp(v, s);
}

static uint64_t file_size(const char *path) {
  struct stat sb;
  return stat(path, &sb) == 0 ? (uint64_t)sb.st_size : UINT64_MAX;
}

static int exists(const char *path) {
  struct stat sb;
  return stat(path, &sb) == 0;
}

/* Names in a directory, sorted and joined, to compare before and after. */
static char *dir_listing(const char *path) {
  struct dirent **list = NULL;
  int n = scandir(path, &list, NULL, alphasort);
  char *s = calloc(1, 1);
  size_t len = 0;
  for (int i = 0; i < n; i++) {
    size_t k = strlen(list[i]->d_name);
    s = realloc(s, len + k + 2);
    memcpy(s + len, list[i]->d_name, k);
    s[len + k] = '\n';
    s[len += k + 1] = 0;
    free(list[i]);
  }
  free(list);
  return s;
}

/* ---- comparing safetensors files ---- */

/* Checks that two safetensors files hold the same tensors (order, names, dtypes,
 * shapes, bytes) and the same __metadata__. */
static void check_same_safetensors(const char *a_path, const char *b_path) {
  size_t alen = 0, blen = 0;
  uint8_t *a = tu_read_file(a_path, &alen), *b = tu_read_file(b_path, &blen);
  CHECK(a && b);
  if (!a || !b) goto out;
  amber__st_header ha, hb;
  char err[256];
  CHECK_OK(amber__st_parse(a, alen, alen, &ha, err, sizeof err));
  int rc = amber__st_parse(b, blen, blen, &hb, err, sizeof err);
  CHECK_OK(rc);
  if (rc) {
    fprintf(stderr, "%s: %s\n", b_path, err);
    amber__st_header_free(&ha);
    goto out;
  }
  CHECK(hb.data_start % 8 == 0);
  CHECK(ha.count == hb.count);
  tu_st_reference_check(b_path); /* and what safetensors reads */
  uint64_t end = hb.data_start;
  for (size_t i = 0; i < ha.count && i < hb.count; i++) {
    const amber__st_tensor *x = &ha.tensors[i], *y = &hb.tensors[i];
    CHECK(!strcmp(x->name, y->name));
    CHECK(x->dtype == y->dtype);
    CHECK(x->ndim == y->ndim);
    CHECK(!memcmp(x->shape, y->shape, sizeof x->shape[0] * x->ndim));
    CHECK(x->nbytes == y->nbytes);
    if (x->nbytes == y->nbytes) CHECK(!memcmp(a + x->offset, b + y->offset, x->nbytes));
    CHECK(y->offset == end); /* back to back, in the checkpoint's order */
    end = y->offset + y->nbytes;
  }
  CHECK(end == blen);
  CHECK((ha.metadata == NULL) == (hb.metadata == NULL));
  if (ha.metadata && hb.metadata) {
    json_t *ma = json_loads(ha.metadata, 0, NULL), *mb = json_loads(hb.metadata, 0, NULL);
    CHECK(ma && mb && json_equal(ma, mb));
    json_decref(ma);
    json_decref(mb);
  }
  amber__st_header_free(&ha);
  amber__st_header_free(&hb);
out:
  free(a);
  free(b);
}

/* ---- tests ---- */

static void import_export_is_bit_exact_for_all_dtypes(void) {
  const char *d = tu_tmpdir();
  char in[4200], out[4200], store[4200];
  snprintf(in, sizeof in, "%s/in.safetensors", d);
  snprintf(out, sizeof out, "%s/out.safetensors", d);
  snprintf(store, sizeof store, "%s/store", d);
  CHECK(write_safetensors(in, all_dtypes, NALL, meta_json, 1) == 0);
  result r = cli("import '%s' '%s' --step 0", in, store);
  CHECK_EXIT(r, 0);
  CHECK(strstr(r.out, "step 0") != NULL);
  result_free(&r);
  r = cli("export '%s' -o '%s'", store, out);
  CHECK_EXIT(r, 0);
  result_free(&r);
  check_same_safetensors(in, out);
  /* A file in canonical form (as amber writes it) comes back byte for byte. */
  size_t alen = 0, blen = 0;
  uint8_t *a = tu_read_file(in, &alen), *b = tu_read_file(out, &blen);
  CHECK(a && b && alen == blen && !memcmp(a, b, alen));
  free(a);
  free(b);
}

static void import_export_with_small_chunks_is_bit_exact(void) {
  const char *d = tu_tmpdir();
  char in[4200], out[4200], store[4200];
  snprintf(in, sizeof in, "%s/in.safetensors", d);
  snprintf(out, sizeof out, "%s/out.safetensors", d);
  snprintf(store, sizeof store, "%s/store", d);
  CHECK(write_safetensors(in, all_dtypes, NALL - 1, NULL, 2) == 0); /* no big tensor */
  result r = cli("import '%s' '%s' --step 3 --chunk-elems 64 --full", in, store);
  CHECK_EXIT(r, 0);
  result_free(&r);
  json_t *info = cli_json(0, "info '%s' --json", store);
  json_t *t0 = json_array_get(json_object_get(info, "tensors"), 0);
  CHECK(json_integer_value(json_object_get(t0, "chunk_elems")) == 64);
  CHECK(json_integer_value(json_object_get(t0, "nchunks")) == (33 * 47 + 63) / 64);
  json_decref(info);
  r = cli("export '%s' -o '%s' --step 3", store, out);
  CHECK_EXIT(r, 0);
  result_free(&r);
  check_same_safetensors(in, out);
}

static void ls_json_reports_steps_kinds_and_file_sizes(void) {
  const char *d = tu_tmpdir();
  char in[4200], store[4200], ck[4300];
  snprintf(in, sizeof in, "%s/in.safetensors", d);
  snprintf(store, sizeof store, "%s/store", d);
  CHECK(write_safetensors(in, all_dtypes, 4, NULL, 3) == 0);
  const uint64_t steps[] = {0, 10, 12345678901ull};
  for (int i = 0; i < 3; i++) {
    result r = cli("import '%s' '%s' --step %llu --full", in, store,
                   (unsigned long long)steps[i]);
    CHECK_EXIT(r, 0);
    result_free(&r);
  }
  json_t *ls = cli_json(0, "ls '%s' --json", store);
  CHECK(json_is_array(ls) && json_array_size(ls) == 3);
  for (size_t i = 0; i < json_array_size(ls); i++) {
    json_t *o = json_array_get(ls, i);
    snprintf(ck, sizeof ck, "%s/ckpt-%020llu.amber", store, (unsigned long long)steps[i]);
    CHECK((uint64_t)json_integer_value(json_object_get(o, "step")) == steps[i]);
    CHECK(str_is(json_object_get(o, "kind"), "full"));
    CHECK(json_is_null(json_object_get(o, "parent")));
    CHECK((uint64_t)json_integer_value(json_object_get(o, "bytes")) == file_size(ck));
    const char *h = json_string_value(json_object_get(o, "hash"));
    CHECK(h && strlen(h) == 16 && strspn(h, "0123456789abcdef") == 16);
  }
  json_decref(ls);
  result r = cli("ls '%s'", store); /* the table: one row per checkpoint */
  CHECK(r.rc == 0 && strstr(r.out, "12345678901") && strstr(r.out, "full"));
  result_free(&r);
}

/* An empty store (made by a writer, nothing committed yet) lists nothing; a directory
 * that holds nothing of a store, or no directory, is an error (a mistyped path). */
static void ls_of_empty_store_is_empty_and_missing_store_fails(void) {
  const char *d = tu_tmpdir();
  char store[4200], plain[4200];
  snprintf(store, sizeof store, "%s/empty", d);
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, store, NULL));
  amber_store_close(st);
  snprintf(plain, sizeof plain, "%s/plain", d);
  CHECK(mkdir(plain, 0755) == 0);
  for (int v = 0; v < 2; v++) {
    result p = cli("%s '%s'", v ? "verify" : "ls", plain);
    CHECK(p.rc == 1 && strstr(p.err, "is not an amber store"));
    result_free(&p);
  }
  json_t *ls = cli_json(0, "ls '%s' --json", store);
  CHECK(json_is_array(ls) && json_array_size(ls) == 0);
  json_decref(ls);
  result r = cli("ls '%s'", store);
  CHECK(r.rc == 0 && r.out[0] == 0);
  result_free(&r);
  r = cli("ls '%s/missing'", d);
  CHECK(r.rc == 1 && strstr(r.err, "missing"));
  result_free(&r);
  char missing[4200]; /* ls never creates a store */
  snprintf(missing, sizeof missing, "%s/missing", d);
  CHECK(!exists(missing));
}

static void info_json_lists_tensors(void) {
  const char *d = tu_tmpdir();
  char in[4200], store[4200];
  snprintf(in, sizeof in, "%s/in.safetensors", d);
  snprintf(store, sizeof store, "%s/store", d);
  CHECK(write_safetensors(in, all_dtypes, NALL - 1, meta_json, 4) == 0);
  result r = cli("import '%s' '%s' --step 7", in, store);
  CHECK_EXIT(r, 0);
  result_free(&r);
  json_t *info = cli_json(0, "info '%s' --step 7 --json", store);
  CHECK(json_integer_value(json_object_get(info, "step")) == 7);
  CHECK(str_is(json_object_get(info, "kind"), "full"));
  CHECK(json_is_null(json_object_get(info, "parent")));
  json_t *ts = json_object_get(info, "tensors");
  CHECK(json_array_size(ts) == NALL - 1);
  for (size_t i = 0; i < json_array_size(ts) && i < NALL - 1; i++) {
    json_t *t = json_array_get(ts, i);
    const spec *s = &all_dtypes[i];
    CHECK(str_is(json_object_get(t, "name"), s->name));
    CHECK(str_is(json_object_get(t, "dtype"), amber_dtype_name(s->dtype)));
    json_t *shape = json_object_get(t, "shape");
    CHECK(json_array_size(shape) == s->ndim);
    uint64_t nelems = 1;
    for (uint32_t k = 0; k < s->ndim; k++) {
      CHECK(json_integer_value(json_array_get(shape, k)) == s->shape[k]);
      nelems *= (uint64_t)s->shape[k];
    }
    CHECK((uint64_t)json_integer_value(json_object_get(t, "nelems")) == nelems);
    CHECK((uint64_t)json_integer_value(json_object_get(t, "nbytes")) ==
          nelems * amber_dtype_size(s->dtype));
    CHECK(json_integer_value(json_object_get(t, "stored_elems")) ==
          json_integer_value(json_object_get(t, "nelems"))); /* full checkpoint */
    CHECK(json_is_string(json_object_get(t, "policy")));
    CHECK(json_is_integer(json_object_get(t, "stored_bytes")));
  }
  json_decref(info);
  r = cli("info '%s'", store);
  CHECK(r.rc == 0 && strstr(r.out, "f32.matrix") && strstr(r.out, "[33, 47]"));
  result_free(&r);
}

static void verify_passes_intact_and_names_file_of_flipped_byte(void) {
  const char *d = tu_tmpdir();
  char in[4200], store[4200], ck[4300];
  snprintf(in, sizeof in, "%s/in.safetensors", d);
  snprintf(store, sizeof store, "%s/store", d);
  CHECK(write_safetensors(in, all_dtypes, NALL, NULL, 5) == 0);
  for (int step = 1; step <= 2; step++) { /* two full ones: step 2 does not need 1 */
    result r = cli("import '%s' '%s' --step %d --full", in, store, step);
    CHECK_EXIT(r, 0);
    result_free(&r);
  }
  result r = cli("verify '%s'", store);
  CHECK(r.rc == 0 && strstr(r.out, "step 1: ok") && strstr(r.out, "step 2: ok"));
  result_free(&r);
  json_t *v = cli_json(0, "verify '%s' --json", store);
  CHECK(json_array_size(v) == 2 &&
        json_is_true(json_object_get(json_array_get(v, 0), "ok")));
  json_decref(v);

  snprintf(ck, sizeof ck, "%s/ckpt-%020d.amber", store, 1);
  CHECK(tu_flip_byte(ck, TU_MIDDLE, 0x10) == 0);
  r = cli("verify '%s'", store);
  CHECK(r.rc == 1);
  CHECK(strstr(r.out, "step 1: FAILED") &&
        strstr(r.out, "ckpt-00000000000000000001.amber"));
  CHECK(strstr(r.out, "step 2: ok") != NULL);
  result_free(&r);
  r = cli("verify '%s' --step 2", store);
  CHECK_EXIT(r, 0);
  result_free(&r);
  r = cli("verify '%s' --step 1", store);
  CHECK(r.rc == 1);
  result_free(&r);
}

/* Full or delta is the library's choice; either way each step exports exactly. */
static void successive_imports_export_exactly(void) {
  const char *d = tu_tmpdir();
  char in[4200], out[4200], store[4200];
  snprintf(out, sizeof out, "%s/out.safetensors", d);
  snprintf(store, sizeof store, "%s/store", d);
  for (int step = 1; step <= 3; step++) {
    snprintf(in, sizeof in, "%s/in%d.safetensors", d, step);
    /* step 3 repeats step 2's data: nothing changed */
    CHECK(write_safetensors(in, all_dtypes, NALL, meta_json,
                            step == 3 ? 20 : 10u * step) == 0);
    result r = cli("import '%s' '%s' --step %d", in, store, step);
    CHECK_EXIT(r, 0);
    result_free(&r);
  }
  json_t *ls = cli_json(0, "ls '%s' --json", store);
  CHECK(json_array_size(ls) == 3);
  for (size_t i = 0; i < json_array_size(ls); i++) {
    json_t *o = json_array_get(ls, i);
    const char *kind = json_string_value(json_object_get(o, "kind"));
    json_t *parent = json_object_get(o, "parent");
    CHECK(kind && (!strcmp(kind, "full") || !strcmp(kind, "delta")));
    if (kind && !strcmp(kind, "delta"))
      CHECK(json_integer_value(parent) == (json_int_t)i);
    else
      CHECK(json_is_null(parent));
  }
  json_decref(ls);
  for (int step = 1; step <= 3; step++) {
    snprintf(in, sizeof in, "%s/in%d.safetensors", d, step);
    result r = cli("export '%s' -o '%s' --step %d", store, out, step);
    CHECK_EXIT(r, 0);
    result_free(&r);
    check_same_safetensors(in, out);
  }
  result r = cli("verify '%s'", store);
  CHECK_EXIT(r, 0);
  result_free(&r);
}

/* Without LATEST but with two checkpoint files: damage, not an empty store (one
 * lone file would be an unfinished first commit, which is empty). */
static void store_that_lost_latest_is_reported_damaged(void) {
  const char *d = tu_tmpdir();
  char in[4200], store[4200], latest[4300];
  snprintf(in, sizeof in, "%s/in.safetensors", d);
  snprintf(store, sizeof store, "%s/store", d);
  snprintf(latest, sizeof latest, "%s/LATEST", store);
  CHECK(write_safetensors(in, all_dtypes, 3, NULL, 11) == 0);
  result r = cli("import '%s' '%s' --step 4", in, store);
  CHECK_EXIT(r, 0);
  result_free(&r);
  r = cli("import '%s' '%s' --step 5", in, store);
  CHECK_EXIT(r, 0);
  result_free(&r);
  CHECK(unlink(latest) == 0);
  r = cli("ls '%s' --json", store);
  CHECK_EXIT(r, 1);
  CHECK(strstr(r.err, "LATEST") != NULL);
  result_free(&r);
  r = cli("verify '%s'", store);
  CHECK_EXIT(r, 1);
  CHECK(strstr(r.err, "LATEST") != NULL);
  result_free(&r);
}

/* ls shows a checkpoint whose header is damaged as such (table and JSON), not as
 * a full checkpoint with a zero hash. */
static void ls_flags_a_damaged_checkpoint(void) {
  const char *d = tu_tmpdir();
  char in[4200], store[4200], f4[4300];
  snprintf(in, sizeof in, "%s/in.safetensors", d);
  snprintf(store, sizeof store, "%s/store", d);
  snprintf(f4, sizeof f4, "%s/ckpt-%020d.amber", store, 4);
  CHECK(write_safetensors(in, all_dtypes, 3, NULL, 11) == 0);
  result r = cli("import '%s' '%s' --step 4 --full", in, store);
  CHECK_EXIT(r, 0);
  result_free(&r);
  r = cli("import '%s' '%s' --step 5 --full", in, store);
  CHECK_EXIT(r, 0);
  result_free(&r);
  CHECK(tu_flip_byte(f4, 20, 0x04) == 0); /* inside the header */
  json_t *ls = cli_json(0, "ls '%s' --json", store);
  CHECK(json_array_size(ls) == 2);
  CHECK(json_is_true(json_object_get(json_array_get(ls, 0), "damaged")));
  CHECK(json_is_false(json_object_get(json_array_get(ls, 1), "damaged")));
  json_decref(ls);
  r = cli("ls '%s'", store);
  CHECK_EXIT(r, 0);
  CHECK(strstr(r.out, "damaged") != NULL);
  result_free(&r);
}

static void usage_errors_exit_2(void) {
  static const char *const bad[] = {
      "",
      "frobnicate",
      "import x.safetensors store", /* --step missing */
      "import x.safetensors store --step abc",
      "import x.safetensors store --step -1",
      "import x.safetensors store --step 12x",
      "import x.safetensors store --step ' 5'",
      "import x.safetensors store --step 99999999999999999999",
      "import x.safetensors store --step",
      "import x.safetensors --step 1", /* STORE missing */
      "import x.safetensors store --step 1 --chunk-elems 0",
      "export store", /* -o missing */
      "export store -o out --bogus",
      "ls",
      "ls a b",
      "ls store --step 1",
      "info store --step abc",
      "verify store --step -1",
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    result r = cli("%s", bad[i]);
    if (r.rc != 2) fprintf(stderr, "amber %s: rc %d, wanted 2\n", bad[i], r.rc);
    CHECK(r.rc == 2);
    CHECK(strstr(r.err, "usage") != NULL);
    CHECK(r.out[0] == 0);
    result_free(&r);
  }
}

static void help_and_version_exit_0(void) {
  static const char *const ok[] = {"--help",    "import --help", "export --help",
                                   "ls --help", "info -h",       "verify --help"};
  for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
    result r = cli("%s", ok[i]);
    CHECK(r.rc == 0 && strstr(r.out, "usage"));
    result_free(&r);
  }
  result r = cli("--version");
  CHECK(r.rc == 0 && strstr(r.out, amber_version_string()));
  result_free(&r);
}

static void export_failures_exit_1_and_leave_no_file(void) {
  const char *d = tu_tmpdir();
  char in[4200], store[4200], out[4200];
  snprintf(in, sizeof in, "%s/in.safetensors", d);
  snprintf(store, sizeof store, "%s/store", d);
  snprintf(out, sizeof out, "%s/out.safetensors", d);
  result r = cli("export '%s/nope' -o '%s'", d, out);
  CHECK(r.rc == 1 && strstr(r.err, "nope"));
  CHECK(!exists(out));
  result_free(&r);
  char nope[4200];
  snprintf(nope, sizeof nope, "%s/nope", d);
  CHECK(!exists(nope));

  CHECK(write_safetensors(in, all_dtypes, 4, NULL, 6) == 0);
  r = cli("import '%s' '%s' --step 5", in, store);
  CHECK_EXIT(r, 0);
  result_free(&r);
  CHECK(tu_write_file(out, "keep", 4) == 0);
  r = cli("export '%s' -o '%s' --step 6", store, out); /* not committed */
  CHECK(r.rc == 1 && strstr(r.err, "step 6"));
  result_free(&r);
  size_t len = 0;
  uint8_t *b = tu_read_file(out, &len);
  CHECK(b && len == 4 && !memcmp(b, "keep", 4));
  free(b);
  char *names = dir_listing(d);
  CHECK(strstr(names, ".tmp") == NULL);
  free(names);
  r = cli("export '%s' -o '%s/no/such/dir/out.safetensors'", store, d);
  CHECK(r.rc == 1);
  result_free(&r);
}

static void malformed_import_fails_and_leaves_store_unchanged(void) {
  const char *d = tu_tmpdir();
  char in[4200], bad[4200], store[4200];
  snprintf(in, sizeof in, "%s/in.safetensors", d);
  snprintf(bad, sizeof bad, "%s/bad.safetensors", d);
  snprintf(store, sizeof store, "%s/store", d);
  CHECK(write_safetensors(in, all_dtypes, 6, meta_json, 7) == 0);
  result r = cli("import '%s' '%s' --step 1", in, store);
  CHECK_EXIT(r, 0);
  result_free(&r);
  r = cli("ls '%s' --json", store);
  char *before = r.out, *files_before = dir_listing(store);
  free(r.err);

  size_t len = 0;
  uint8_t *b = tu_read_file(in, &len);
  CHECK(b != NULL);
  const size_t cuts[] = {0, 5, 40, len - 1}; /* truncations: length, header, data */
  for (size_t i = 0; b && i < sizeof cuts / sizeof cuts[0]; i++) {
    CHECK(tu_write_file(bad, b, cuts[i]) == 0);
    r = cli("import '%s' '%s' --step 2", bad, store);
    CHECK(r.rc == 1 && strstr(r.err, "bad.safetensors"));
    result_free(&r);
    r = cli("import '%s' '%s/fresh' --step 2", bad, d); /* no store is created */
    CHECK(r.rc == 1);
    result_free(&r);
  }
  free(b);
  char fresh[4200];
  snprintf(fresh, sizeof fresh, "%s/fresh", d);
  CHECK(!exists(fresh));
  r = cli("import '%s/none.safetensors' '%s' --step 2", d, store);
  CHECK(r.rc == 1 && strstr(r.err, "none.safetensors"));
  result_free(&r);

  r = cli("ls '%s' --json", store);
  CHECK(!strcmp(before, r.out));
  result_free(&r);
  char *files_after = dir_listing(store);
  CHECK(!strcmp(files_before, files_after));
  free(files_after);
  free(files_before);
  free(before);
}

static void import_of_old_step_fails(void) {
  const char *d = tu_tmpdir();
  char in[4200], store[4200];
  snprintf(in, sizeof in, "%s/in.safetensors", d);
  snprintf(store, sizeof store, "%s/store", d);
  CHECK(write_safetensors(in, all_dtypes, 3, NULL, 8) == 0);
  result r = cli("import '%s' '%s' --step 10 --json", in, store);
  CHECK_EXIT(r, 0);
  json_t *j = json_loads(r.out, 0, NULL);
  CHECK(json_integer_value(json_object_get(j, "step")) == 10);
  CHECK(json_integer_value(json_object_get(j, "tensors")) == 3);
  json_decref(j);
  result_free(&r);
  r = cli("ls '%s' --json", store);
  char *before = r.out;
  free(r.err);
  const int old[] = {10, 9, 0};
  for (size_t i = 0; i < sizeof old / sizeof old[0]; i++) {
    r = cli("import '%s' '%s' --step %d", in, store, old[i]);
    CHECK(r.rc == 1 && strstr(r.err, "step") && strstr(r.err, "in.safetensors"));
    result_free(&r);
  }
  r = cli("ls '%s' --json", store);
  CHECK(!strcmp(before, r.out));
  result_free(&r);
  free(before);
}

static void bad_policy_fails(void) {
  const char *d = tu_tmpdir();
  char in[4200], store[4200];
  snprintf(in, sizeof in, "%s/in.safetensors", d);
  snprintf(store, sizeof store, "%s/store", d);
  CHECK(write_safetensors(in, all_dtypes, 3, NULL, 9) == 0);
  result r = cli("import '%s' '%s' --step 1 --policy 'threshold:oops'", in, store);
  CHECK(r.rc == 1 && strstr(r.err, "threshold:oops"));
  result_free(&r);
  r = cli("import '%s' '%s' --step 1 --policy 'threshold:0.001/1.5:4'", in, store);
  CHECK(r.rc == 1 && strstr(r.err, "threshold:0.001/1.5:4") && strstr(r.err, "SHARE:MULT"));
  result_free(&r);
  r = cli("import '%s' '%s' --step 1 --policy exact --policy '*.matrix=threshold:0.001'",
          in, store);
  CHECK_EXIT(r, 0);
  result_free(&r);
  /* a share cap with a value code is a policy of the CLI too, recorded as given */
  r = cli("import '%s' '%s' --step 2 --policy '*.matrix=threshold:0.001/0.1:4@q8+lead'", in,
          store);
  CHECK_EXIT(r, 0);
  result_free(&r);
  r = cli("info '%s' --step 2 --json", store);
  CHECK_EXIT(r, 0);
  CHECK(strstr(r.out, "threshold:0.001/0.1:4@q8+lead") != NULL);
  result_free(&r);
}

int main(void) {
  TEST_RUN(import_export_is_bit_exact_for_all_dtypes);
  TEST_RUN(import_export_with_small_chunks_is_bit_exact);
  TEST_RUN(ls_json_reports_steps_kinds_and_file_sizes);
  TEST_RUN(ls_of_empty_store_is_empty_and_missing_store_fails);
  TEST_RUN(info_json_lists_tensors);
  TEST_RUN(verify_passes_intact_and_names_file_of_flipped_byte);
  TEST_RUN(successive_imports_export_exactly);
  TEST_RUN(store_that_lost_latest_is_reported_damaged);
  TEST_RUN(ls_flags_a_damaged_checkpoint);
  TEST_RUN(usage_errors_exit_2);
  TEST_RUN(help_and_version_exit_0);
  TEST_RUN(export_failures_exit_1_and_leave_no_file);
  TEST_RUN(malformed_import_fails_and_leaves_store_unchanged);
  TEST_RUN(import_of_old_step_fails);
  TEST_RUN(bad_policy_fails);
  return tu_finish();
}

/* testutil.c - implementation of the shared C test harness (see testutil.h). */
#include "testutil.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <jansson.h>
#include <linux/magic.h>

#include "safetensors.h"

int tu_failures;
int tu_tests_passed;
int tu_tests_failed;

static char *tmpdirs[256];
static int ntmpdirs;

void tu_run(const char *name, void (*fn)(void)) {
  tu_failures = 0;
  fn();
  if (tu_failures) {
    fprintf(stderr, "FAIL %s (%d checks)\n", name, tu_failures);
    tu_tests_failed++;
  } else {
    printf("ok   %s\n", name);
    fflush(stdout);
    tu_tests_passed++;
  }
}

int tu_finish(void) {
  if (!getenv("AMBER_KEEP_TMP"))
    for (int i = 0; i < ntmpdirs; i++) tu_rm_rf(tmpdirs[i]);
  for (int i = 0; i < ntmpdirs; i++) free(tmpdirs[i]);
  printf("%d passed, %d failed\n", tu_tests_passed, tu_tests_failed);
  return tu_tests_failed ? 1 : 0;
}

static const char *make_dir(const char *base) {
  char tmpl[4096];
  snprintf(tmpl, sizeof tmpl, "%s/amber-test-XXXXXX", base);
  if (!mkdtemp(tmpl) || ntmpdirs == 256) {
    perror("mkdtemp");
    exit(2);
  }
  tmpdirs[ntmpdirs] = strdup(tmpl);
  return tmpdirs[ntmpdirs++];
}

void tu_deltas_only(amber_writer_opts *wo, uint64_t chunk_elems) {
  amber_writer_opts_init(wo);
  wo->chunk_elems = chunk_elems;
  wo->full_every = UINT32_MAX;
  wo->full_share = -1;
}

const char *tu_tmpdir(void) {
  const char *base = getenv("TMPDIR");
  return make_dir(base && *base ? base : "/tmp");
}

const char *tu_memdir(void) {
  struct statfs sf;
  if (statfs("/dev/shm", &sf) != 0 || sf.f_type != TMPFS_MAGIC || access("/dev/shm", W_OK))
    return NULL;
  return make_dir("/dev/shm");
}

void tu_rm_rf(const char *path) {
  struct stat sb;
  if (lstat(path, &sb) != 0) return;
  if (S_ISDIR(sb.st_mode)) {
    DIR *d = opendir(path);
    if (d) {
      struct dirent *e;
      while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char sub[4096];
        snprintf(sub, sizeof sub, "%s/%s", path, e->d_name);
        tu_rm_rf(sub);
      }
      closedir(d);
    }
    rmdir(path);
  } else {
    unlink(path);
  }
}

uint64_t tu_rand(uint64_t *s) {
  uint64_t x = *s ? *s : 0x9E3779B97F4A7C15ull;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  *s = x;
  return x * 0x2545F4914F6CDD1Dull;
}

void tu_fill_random(void *buf, size_t n, uint64_t seed) {
  uint8_t *p = buf;
  uint64_t s = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; i += 8) {
    uint64_t r = tu_rand(&s);
    size_t k = n - i < 8 ? n - i : 8;
    memcpy(p + i, &r, k);
  }
}

uint8_t *tu_read_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  uint8_t *b = malloc(n > 0 ? (size_t)n : 1);
  if (b && n > 0 && fread(b, 1, (size_t)n, f) != (size_t)n) {
    free(b);
    b = NULL;
  }
  fclose(f);
  if (b) *len = (size_t)n;
  return b;
}

int tu_write_file(const char *path, const void *data, size_t len) {
  FILE *f = fopen(path, "wb");
  if (!f) return -1;
  size_t w = fwrite(data, 1, len, f);
  return (fclose(f) == 0 && w == len) ? 0 : -1;
}

int tu_flip_byte(const char *path, long pos, uint8_t mask) {
  int fd = open(path, O_RDWR);
  if (fd < 0) return -1;
  struct stat sb;
  long size = fstat(fd, &sb) == 0 ? (long)sb.st_size : -1;
  long at = pos == TU_MIDDLE ? size / 2 : pos < 0 ? size + pos : pos;
  uint8_t b;
  int ok = size > 0 && at >= 0 && at < size && pread(fd, &b, 1, at) == 1;
  b = (uint8_t)(b ^ mask);
  ok = ok && pwrite(fd, &b, 1, at) == 1;
  return (close(fd) == 0 && ok) ? 0 : -1;
}

int tu_system(const char *fmt, ...) {
  char cmd[8192];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(cmd, sizeof cmd, fmt, ap);
  va_end(ap);
  int st = system(cmd);
  if (st == -1 || !WIFEXITED(st)) return -1;
  return WEXITSTATUS(st);
}

/* ---- the independent safetensors reader ---- */

#ifndef AMBER_TEST_PYTHON
#define AMBER_TEST_PYTHON ""
#endif

/* safetensors dtype names, written here apart from tools/safetensors.c's table so
 * that a wrong entry there cannot agree with itself. */
static int st_dtype_of(const char *s) {
  static const struct {
    const char *name;
    int dtype;
  } map[] = {{"F64", AMBER_F64}, {"F32", AMBER_F32},         {"F16", AMBER_F16},
             {"BF16", AMBER_BF16}, {"F8_E4M3", AMBER_F8_E4M3}, {"F8_E5M2", AMBER_F8_E5M2},
             {"I64", AMBER_I64}, {"I32", AMBER_I32},         {"I16", AMBER_I16},
             {"I8", AMBER_I8},   {"U64", AMBER_U64},         {"U32", AMBER_U32},
             {"U16", AMBER_U16}, {"U8", AMBER_U8},           {"BOOL", AMBER_BOOL}};
  for (size_t i = 0; s && i < sizeof map / sizeof map[0]; i++)
    if (!strcmp(map[i].name, s)) return map[i].dtype;
  return 0;
}

/* CRC-32 (IEEE, as zlib.crc32). */
static uint32_t crc32_of(const uint8_t *p, uint64_t n) {
  static uint32_t table[256];
  if (!table[1])
    for (uint32_t i = 0; i < 256; i++) {
      uint32_t c = i;
      for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      table[i] = c;
    }
  uint32_t c = 0xFFFFFFFFu;
  for (uint64_t i = 0; i < n; i++) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

#define ST_FAIL(...)                                                                   \
  do {                                                                                 \
    fprintf(stderr, "safetensors cross-check of %s: ", path);                          \
    fprintf(stderr, __VA_ARGS__);                                                      \
    fputc('\n', stderr);                                                               \
    tu_failures++;                                                                     \
  } while (0)

/* Compares what the reference reader printed (`ref`) with amber's parse of the file. */
static void st_compare(const char *path, json_t *ref, const uint8_t *b, size_t len) {
  amber__st_header h;
  char err[512] = "";
  if (amber__st_parse(b, len, len, &h, err, sizeof err)) {
    ST_FAIL("amber's parser refuses it: %s", err);
    return;
  }
  json_t *ts = json_object_get(ref, "tensors"), *meta = json_object_get(ref, "metadata");
  if (json_array_size(ts) != h.count)
    ST_FAIL("safetensors sees %zu tensors, amber %zu", json_array_size(ts), h.count);
  for (size_t i = 0; i < h.count; i++) {
    const amber__st_tensor *t = &h.tensors[i];
    json_t *r = NULL; /* by name: empty tensors share offsets, so orders may differ */
    for (size_t j = 0; j < json_array_size(ts) && !r; j++) {
      const char *nj = json_string_value(json_object_get(json_array_get(ts, j), "name"));
      if (nj && !strcmp(t->name, nj)) r = json_array_get(ts, j);
    }
    json_t *shape = json_object_get(r, "shape");
    const char *dt = json_string_value(json_object_get(r, "dtype"));
    int same_shape = json_array_size(shape) == t->ndim;
    for (uint32_t d = 0; same_shape && d < t->ndim; d++)
      same_shape = json_integer_value(json_array_get(shape, d)) == t->shape[d];
    if (!r)
      ST_FAIL("tensor '%s' is missing for safetensors", t->name);
    else if (st_dtype_of(dt) != t->dtype || !same_shape)
      ST_FAIL("tensor '%s' is %s for amber, %s (or another shape) for safetensors",
              t->name, amber_dtype_name(t->dtype), dt ? dt : "?");
    else if ((uint64_t)json_integer_value(json_object_get(r, "crc32")) !=
             crc32_of(b + t->offset, t->nbytes))
      ST_FAIL("tensor '%s': safetensors reads other bytes than amber", t->name);
  }
  json_t *ours = h.metadata ? json_loads(h.metadata, 0, NULL) : NULL;
  if (!(json_is_null(meta) && !ours) && !json_equal(meta, ours))
    ST_FAIL("__metadata__ differs (amber: %s)", h.metadata ? h.metadata : "none");
  json_decref(ours);
  amber__st_header_free(&h);
}

int tu_st_reference_check(const char *path) {
  static int warned;
  const char *py = getenv("AMBER_PYTHON");
  if (!py || !*py) py = AMBER_TEST_PYTHON;
  if (!*py) {
    if (!warned++)
      fprintf(stderr, "\n*** WARNING: safetensors exports are NOT checked by the reference\n"
                      "*** reader: no Python (set AMBER_PYTHON, or run scripts/setup and\n"
                      "*** reconfigure).\n\n");
    return 0;
  }
  static const char *dir;
  if (!dir) dir = tu_tmpdir();
  char out[4200];
  snprintf(out, sizeof out, "%s/st-reference.json", dir);
  int rc = tu_system("'%s' '%s/tests/safetensors_read.py' '%s' >'%s'", py,
                     AMBER_SOURCE_DIR, path, out);
  size_t n = 0, len = 0;
  uint8_t *text = tu_read_file(out, &n), *b = tu_read_file(path, &len);
  json_t *ref = rc == 0 && text ? json_loadb((const char *)text, n, 0, NULL) : NULL;
  if (rc == 3)
    ST_FAIL("%s cannot import safetensors", py);
  else if (rc != 0)
    ST_FAIL("safetensors refuses the file (exit %d, its message above)", rc);
  else if (!ref || !b)
    ST_FAIL("no readable output");
  else
    st_compare(path, ref, b, len);
  json_decref(ref);
  free(text);
  free(b);
  return 1;
}

amber_store *tu_open_ro(const char *dir) {
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY | AMBER_OPEN_NOCREATE;
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, dir, &so));
  return st;
}

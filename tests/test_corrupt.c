/*
 * test_corrupt.c - Guarantees 4 and 5: damage to a store is detected before any
 * data is returned, with an error that names the damaged file (or LATEST), and a
 * hostile file can neither crash the reader nor make it allocate more than the
 * file could hold. Small stores of steps 10, 20, 30 (chunks of 64 elements; full
 * raw, full compressed, and full + two deltas with SPARSE, XOR_ZSTD and UNCHANGED
 * chunks) are damaged the ways a disk, a crash or an attacker can: a bit flip at
 * every byte of a file or of the parent it needs, truncation to every length,
 * appended bytes, missing files, a missing or malformed LATEST, a renamed file,
 * header fields of a newer format, hostile indexes whose checksums were recomputed
 * so that the parser itself is exercised, and deltas with a wrong parent. Each
 * case asserts the exact error code and the file its message names; a read that
 * succeeds must return the saved bytes. Allocations are capped (RLIMIT_AS, or
 * ASan's max_allocation_size_mb) so that an allocation sized from a hostile field
 * fails the test (as AMBER_ENOMEM) instead of passing unnoticed.
 */
#include <dirent.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "codec.h"
#include "format.h"
#include "internal.h"
#include "testutil.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define SANITIZED 1
#endif
#endif

#ifdef SANITIZED
/* An allocation above 256 MiB returns NULL instead of succeeding. */
const char *__asan_default_options(void);
const char *__asan_default_options(void) {
  return "allocator_may_return_null=1:max_allocation_size_mb=256";
}
#endif

/* Without ASan: at most 512 MiB more address space than the process uses now. */
static void cap_address_space(void) {
#ifndef SANITIZED
  long pages = 0;
  FILE *f = fopen("/proc/self/statm", "r");
  if (f && fscanf(f, "%ld", &pages) != 1) pages = 0;
  if (f) fclose(f);
  struct rlimit rl;
  rlim_t cap = (rlim_t)pages * (rlim_t)sysconf(_SC_PAGESIZE) + ((rlim_t)512 << 20);
  if (getrlimit(RLIMIT_AS, &rl) == 0 && (rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur > cap)) {
    rl.rlim_cur = cap;
    setrlimit(RLIMIT_AS, &rl);
  }
#endif
}

/* ---- the fixture ---- */

typedef struct {
  const char *name;
  int dtype;
  uint32_t ndim;
  int64_t shape[2];
} spec;

static const spec specs[] = {
    {"w.0", AMBER_F32, 2, {3, 50}}, /* 3 chunks */
    {"w.1", AMBER_BF16, 1, {100}},  /* 2 chunks; a name as long as w.0's */
    {"w.2", AMBER_I64, 0, {0}},     /* scalar */
    {"mask", AMBER_BOOL, 1, {10}},
};
#define NSPEC (sizeof specs / sizeof specs[0])
#define F1 "ckpt-00000000000000000001.amber"
#define F10 "ckpt-00000000000000000010.amber"
#define F20 "ckpt-00000000000000000020.amber"
#define F30 "ckpt-00000000000000000030.amber"
#define META "{\"epoch\": 3, \"lr\": 0.001}"

static char raw_master[4096], zst_master[4096], dlt_master[4096];

static size_t nbytes_of(size_t i) {
  size_t n = amber_dtype_size(specs[i].dtype);
  for (uint32_t d = 0; d < specs[i].ndim; d++) n *= (size_t)specs[i].shape[d];
  return n;
}

/* Deterministic and compressible after the byte shuffle. From one step to the
 * next every 8th element changes (SPARSE in a delta), all of w.1 (XOR_ZSTD), and
 * the scalar not at all (UNCHANGED). */
static void fill(size_t i, uint64_t step, uint8_t *buf) {
  size_t w = amber_dtype_size(specs[i].dtype);
  for (size_t k = 0; k < nbytes_of(i); k++) {
    int changed = i == 1 || (k / w) % 8 == (step / 10) % 8;
    buf[k] = specs[i].dtype == AMBER_BOOL ? (uint8_t)((k + (changed ? step / 10 : 0)) & 1)
                                          : (uint8_t)((k % 11) * 17 + i * 5 + changed * step * 3);
  }
}

/* Saves steps 10, 20, 30; with save_flags 0 the writer makes 20 and 30 deltas. */
static void make_store(char *dir, uint32_t wflags, uint32_t save_flags) {
  strcpy(dir, tu_tmpdir());
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, dir, NULL));
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.chunk_elems = 64;
  wo.flags = wflags;
  wo.full_share = -1; /* by size alone, tiny deltas would call for full ones */
  amber_writer *w = NULL;
  CHECK_OK(amber_writer_open(&w, st, &wo));
  uint8_t *data[NSPEC];
  for (size_t i = 0; i < NSPEC; i++) {
    data[i] = malloc(nbytes_of(i));
    CHECK_OK(amber_writer_add(w, specs[i].name, specs[i].dtype, specs[i].ndim, specs[i].shape,
                              data[i], NULL));
  }
  CHECK_OK(amber_writer_set_meta(w, META, strlen(META)));
  for (uint64_t s = 10; s <= 30; s += 10) {
    for (size_t i = 0; i < NSPEC; i++) fill(i, s, data[i]);
    CHECK_OK(amber_writer_save(w, s, save_flags));
  }
  amber_writer_close(w);
  amber_ckpt_info *info = NULL;
  size_t n = 0;
  CHECK_OK(amber_store_list(st, &info, &n));
  for (size_t i = 0; i < n && info; i++) /* the fixture is what the tests assume */
    CHECK(info[i].kind == (save_flags || i == 0 ? AMBER_KIND_FULL : AMBER_KIND_DELTA));
  amber_free(info);
  amber_store_close(st);
  for (size_t i = 0; i < NSPEC; i++) free(data[i]);
}

static void path_in(char *buf, const char *dir, const char *name) {
  snprintf(buf, 4200, "%s/%s", dir, name);
}

static void put(const char *dir, const char *name, const void *data, size_t len) {
  char p[4200];
  path_in(p, dir, name);
  CHECK(tu_write_file(p, data, len) == 0);
}

/* A fresh copy of a master store (its regular files, not .lock). */
static const char *clone(const char *src) {
  const char *dst = tu_tmpdir();
  DIR *d = opendir(src);
  struct dirent *e;
  while (d && (e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    char p[4200];
    size_t n;
    path_in(p, src, e->d_name);
    uint8_t *b = tu_read_file(p, &n);
    CHECK(b != NULL);
    if (b) put(dst, e->d_name, b, n);
    free(b);
  }
  if (d) closedir(d);
  return dst;
}

/* ---- attempting a restore ---- */

/* Opens `step` of the store read-only, reads every tensor of at most 64 MiB and
 * verifies. Returns 0 when all of it succeeded, else the failing open's or
 * verify's code, with its message in msg. A read that succeeds must return the
 * bytes saved at `data_step` (0: do not compare); otherwise the test fails here. */
static int attempt(const char *dir, uint64_t step, uint64_t data_step, char *msg) {
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY;
  amber_store *st = NULL;
  amber_reader *r = NULL;
  int rc = amber_store_open(&st, dir, &so);
  if (!rc) rc = amber_reader_open(&r, st, step, NULL);
  snprintf(msg, 1024, "%s", amber_last_error(NULL));
  if (rc) {
    amber_store_close(st);
    return rc;
  }
  if (data_step) {
    const char *m = NULL;
    size_t mlen = 0;
    amber_reader_meta(r, &m, &mlen);
    CHECK(amber_reader_count(r) == NSPEC && mlen == strlen(META) && !memcmp(m, META, mlen));
  }
  for (size_t i = 0; i < amber_reader_count(r); i++) {
    amber_tensor_info ti;
    if (amber_reader_info(r, i, &ti) != 0 || ti.nbytes > (64u << 20)) continue;
    uint8_t *got = malloc(ti.nbytes + 1), *want = malloc(ti.nbytes + 1);
    int rrc = amber_reader_read(r, i, got, ti.nbytes);
    if (rrc == 0 && data_step && i < NSPEC) {
      fill(i, data_step, want);
      if (strcmp(ti.name, specs[i].name) || ti.nbytes != nbytes_of(i) ||
          memcmp(got, want, ti.nbytes)) {
        fprintf(stderr, "  %s: read of '%s' (step %" PRIu64 ") succeeded with WRONG DATA\n",
                dir, ti.name, data_step);
        tu_failures++;
      }
    }
    free(got);
    free(want);
  }
  rc = amber_reader_verify(r);
  snprintf(msg, 1024, "%s", amber_last_error(r));
  amber_reader_close(r);
  amber_store_close(st);
  return rc;
}

/* Expects `want` (0: success) naming `needle`; prints the case on a mismatch. */
static int expect(const char *what, const char *dir, uint64_t step, int want, const char *needle) {
  char msg[1024];
  int rc = attempt(dir, step, step == 1 ? 0 : 30, msg);
  if (rc == want && (!want || strstr(msg, needle))) return 1;
  fprintf(stderr, "  %s: got %s \"%s\", wanted %s naming %s%s\n", what, amber_err_name(rc), msg,
          amber_err_name(want), needle,
          rc == AMBER_ENOMEM ? " (an allocation sized from a hostile field?)" : "");
  tu_failures++;
  return 0;
}

/* ---- whole-file damage ---- */

/* Flips one bit of every byte of `file` in turn; restoring step 30 must fail. */
static void flip_every_byte(const char *master, const char *file) {
  const char *dir = clone(master);
  char p[4200], what[64];
  size_t n = 0;
  path_in(p, dir, file);
  uint8_t *orig = tu_read_file(p, &n);
  CHECK(orig && n > 500 && n < 8192);
  expect("undamaged", dir, AMBER_LATEST, 0, "");
  int fd = open(p, O_WRONLY);
  int bad = 0;
  for (size_t pos = 0; orig && pos < n; pos++) {
    uint8_t b = (uint8_t)(orig[pos] ^ (1u << (pos % 8)));
    CHECK(pwrite(fd, &b, 1, (off_t)pos) == 1);
    snprintf(what, sizeof what, "bit %zu of byte %zu flipped", pos % 8, pos);
    int ok = expect(what, dir, AMBER_LATEST, AMBER_ECORRUPT, file);
    CHECK(pwrite(fd, &orig[pos], 1, (off_t)pos) == 1);
    if (!ok && ++bad == 5) break; /* enough output */
  }
  close(fd);
  expect("restored", dir, AMBER_LATEST, 0, "");
  free(orig);
}

static void test_bit_flip_at_every_byte_is_detected(void) {
  char p0[4200], p1[4200];
  struct stat a, b; /* the compressed fixture must really be compressed */
  path_in(p0, raw_master, F30);
  path_in(p1, zst_master, F30);
  CHECK(stat(p0, &a) == 0 && stat(p1, &b) == 0 && b.st_size < a.st_size);
  flip_every_byte(raw_master, F30);
  flip_every_byte(zst_master, F30);
  flip_every_byte(dlt_master, F30); /* a delta, and the files its restore needs: */
  flip_every_byte(dlt_master, F20); /* its parent, a delta, */
  flip_every_byte(dlt_master, F10); /* and their full checkpoint */
}

static void test_truncation_to_every_length_is_detected(void) {
  const char *dir = clone(raw_master);
  char p[4200], what[64];
  size_t n = 0;
  path_in(p, dir, F30);
  uint8_t *orig = tu_read_file(p, &n);
  int bad = 0;
  for (size_t len = 0; orig && len < n; len++) {
    put(dir, F30, orig, len);
    snprintf(what, sizeof what, "truncated to %zu of %zu bytes", len, n);
    if (!expect(what, dir, AMBER_LATEST, AMBER_ECORRUPT, F30) && ++bad == 5) break;
  }
  free(orig);
}

static void test_appended_bytes_are_detected(void) {
  const char *dir = clone(raw_master);
  char p[4200];
  size_t n = 0;
  path_in(p, dir, F30);
  uint8_t *orig = tu_read_file(p, &n), *b = calloc(n + 4096, 1);
  if (!orig || !b) abort();
  memcpy(b, orig, n);
  put(dir, F30, b, n + 1);
  expect("one zero byte appended", dir, AMBER_LATEST, AMBER_ECORRUPT, F30);
  put(dir, F30, b, n + 4096);
  expect("4096 zero bytes appended", dir, AMBER_LATEST, AMBER_ECORRUPT, F30);
  memcpy(b + n, orig + n - 56, 56);
  put(dir, F30, b, n + 56);
  expect("footer appended twice", dir, AMBER_LATEST, AMBER_ECORRUPT, F30);
  free(orig);
  free(b);
}

static void test_missing_file_is_reported_and_older_steps_still_restore(void) {
  const char *dir = clone(raw_master);
  char p[4200];
  path_in(p, dir, F30);
  CHECK(unlink(p) == 0);
  expect("latest file missing", dir, AMBER_LATEST, AMBER_ENOENT, F30);
  path_in(p, dir, F10);
  CHECK(unlink(p) == 0);
  expect("step 10's file missing", dir, 10, AMBER_ENOENT, F10);
  char msg[1024];
  CHECK_RC(attempt(dir, 20, 20, msg), 0); /* the fall-back: the newest intact step */
}

static void test_renamed_or_foreign_file_is_detected(void) {
  const char *dir = clone(raw_master);
  char p[4200];
  size_t n;
  path_in(p, dir, F20);
  uint8_t *b = tu_read_file(p, &n);
  put(dir, F30, b, n);
  expect("ckpt 20 copied over 30", dir, AMBER_LATEST, AMBER_ECORRUPT, F30);
  free(b);
  path_in(p, zst_master, F30); /* same step, another store: LATEST's state id differs */
  b = tu_read_file(p, &n);
  put(dir, F30, b, n);
  expect("ckpt 30 of another store", dir, AMBER_LATEST, AMBER_ECORRUPT, "LATEST");
  free(b);
}

/* ---- LATEST ---- */

static void latest_line(const char *dir, char line[64]) {
  char p[4200];
  size_t n = 0;
  path_in(p, dir, "LATEST");
  uint8_t *b = tu_read_file(p, &n);
  CHECK(b && n == 20 && !memcmp(b, "30 ", 3) && b[19] == '\n');
  memset(line, 0, 64);
  if (b && n < 64) memcpy(line, b, n);
  free(b);
}

static void test_missing_latest_with_checkpoints_is_corruption(void) {
  const char *dir = clone(raw_master);
  char p[4200];
  path_in(p, dir, "LATEST");
  CHECK(unlink(p) == 0);
  expect("LATEST missing", dir, AMBER_LATEST, AMBER_ECORRUPT, "LATEST");
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY;
  amber_store *st = NULL;
  uint64_t latest = 0;
  CHECK_OK(amber_store_open(&st, dir, &so));
  /* Not "empty": no crash leaves three files without LATEST (test_commit.c covers
   * the one a crash can leave), and a caller that starts afresh on ENOENT would
   * bury the damage. */
  CHECK_RC(amber_store_latest(st, &latest), AMBER_ECORRUPT);
  amber_store_close(st);
  const char *empty = tu_tmpdir();
  expect("empty store", empty, AMBER_LATEST, AMBER_ENOENT, empty);
}

static void test_malformed_latest_is_detected(void) {
  const char *dir = clone(raw_master);
  char good[64];
  latest_line(dir, good);
  const char *hex = good + 3;
  char bad[][64] = {"", "30", "30\n", "30 \n", "x30 ", " 30 ", "-30 ", "+30 ", "30  ",
                    "30 0123456789abcde\n", "30 0123456789abcdef0\n", "30 0123456789ABCDEF\n",
                    "18446744073709551615 ", "99999999999999999999999 ", "30 ", "30 "};
  size_t nbad = sizeof bad / sizeof bad[0];
  for (size_t i = 4; i < 9; i++) strcat(bad[i], hex); /* with a good id */
  strcat(bad[12], hex);
  strcat(bad[13], hex);
  memcpy(bad[14] + 3, hex, 16); /* no newline */
  bad[14][19] = 0;
  strcat(bad[15], hex);
  strcat(bad[15], "\n"); /* two newlines */
  for (size_t i = 0; i < nbad; i++) {
    put(dir, "LATEST", bad[i], strlen(bad[i]));
    char what[128];
    snprintf(what, sizeof what, "LATEST \"%.*s\"", (int)strcspn(bad[i], "\n"), bad[i]);
    expect(what, dir, AMBER_LATEST, AMBER_ECORRUPT, "LATEST");
  }
  char junk[300];
  memset(junk, '7', sizeof junk);
  put(dir, "LATEST", junk, sizeof junk);
  expect("LATEST of 300 digits", dir, AMBER_LATEST, AMBER_ECORRUPT, "LATEST");
  put(dir, "LATEST", good, strlen(good));
  expect("LATEST restored", dir, AMBER_LATEST, 0, "");
}

static void test_latest_state_id_mismatch_is_detected(void) {
  const char *dir = clone(raw_master);
  char line[64], b[64], msg[1024];
  latest_line(dir, line);
  memcpy(b, line, 64);
  b[18] = b[18] == '0' ? '1' : '0';
  put(dir, "LATEST", b, strlen(b));
  expect("LATEST names another state id", dir, AMBER_LATEST, AMBER_ECORRUPT, "LATEST");
  /* Every bit of LATEST: never a successful restore of anything. */
  for (size_t pos = 0; pos < 20; pos++)
    for (int bit = 0; bit < 8; bit++) {
      memcpy(b, line, 64);
      b[pos] = (char)(b[pos] ^ (1 << bit));
      put(dir, "LATEST", b, 20);
      int rc = attempt(dir, AMBER_LATEST, 30, msg);
      CHECK(rc == AMBER_ECORRUPT || rc == AMBER_ENOENT);
      CHECK(strstr(msg, "LATEST") || strstr(msg, "ckpt-"));
    }
}

/* ---- patched fields, with checksums recomputed ---- */

enum { HDR, FTR, IDX, TENSOR, CHUNK };

typedef struct {
  const char *what;
  int region;
  uint64_t k; /* tensor or chunk number */
  uint32_t off, width;
  int add; /* add `value` to the field instead of setting it */
  uint64_t value;
  int reseal;
  int want;
} patch;

#define BIG (UINT64_C(1) << 62)
/* clang-format off */
static const patch patches[] = {
    {"magic", HDR, 0, 1, 1, 0, 'X', 1, AMBER_ECORRUPT},
    {"format_major 2, checksum stale", HDR, 0, 8, 2, 0, 2, 0, AMBER_ECORRUPT},
    {"format_major 2", HDR, 0, 8, 2, 0, 2, 1, AMBER_EFORMAT},
    {"format_major 0", HDR, 0, 8, 2, 0, 0, 1, AMBER_EFORMAT},
    {"format_minor 1 is readable", HDR, 0, 10, 2, 0, 1, 1, 0},
    {"header_size 128", HDR, 0, 12, 4, 0, 128, 1, AMBER_ECORRUPT},
    {"required flag bit 0, checksum stale", HDR, 0, 16, 4, 0, 1, 0, AMBER_ECORRUPT},
    {"required flag bit 0", HDR, 0, 16, 4, 0, 1, 1, AMBER_EFORMAT},
    {"required flag bit 31", HDR, 0, 16, 4, 0, 0x80000000u, 1, AMBER_EFORMAT},
    {"optional flag bit 5 is ignored", HDR, 0, 20, 4, 0, 32, 1, 0},
    {"step 31 in the file of step 30", HDR, 0, 24, 8, 0, 31, 1, AMBER_ECORRUPT},
    {"kind 2", HDR, 0, 32, 1, 0, 2, 1, AMBER_EFORMAT},
    {"kind delta with a full's parent", HDR, 0, 32, 1, 0, 1, 1, AMBER_ECORRUPT},
    {"reserved header byte", HDR, 0, 35, 1, 0, 1, 1, AMBER_ECORRUPT},
    {"full names a parent step", HDR, 0, 40, 8, 0, 20, 1, AMBER_ECORRUPT},
    {"full names a parent state", HDR, 0, 48, 8, 0, 1, 1, AMBER_ECORRUPT},
    {"index_offset + 8", FTR, 0, 0, 8, 1, 8, 1, AMBER_ECORRUPT},
    {"index_offset 0", FTR, 0, 0, 8, 0, 0, 1, AMBER_ECORRUPT},
    {"index_size huge", FTR, 0, 8, 8, 0, UINT64_MAX - 100, 1, AMBER_ECORRUPT},
    {"index_checksum", FTR, 0, 16, 8, 1, 1, 1, AMBER_ECORRUPT},
    {"state_id differs from LATEST", FTR, 0, 32, 8, 1, 1, 1, AMBER_ECORRUPT},
    {"end magic", FTR, 0, 48, 1, 0, 'X', 1, AMBER_ECORRUPT},
    {"index magic", IDX, 0, 0, 1, 0, 'X', 1, AMBER_ECORRUPT},
    {"index reserved", IDX, 0, 4, 4, 0, 1, 1, AMBER_ECORRUPT},
    {"n_tensors 2^62", IDX, 0, 8, 8, 0, BIG, 1, AMBER_ECORRUPT},
    {"n_tensors 2^64-1", IDX, 0, 8, 8, 0, UINT64_MAX, 1, AMBER_ECORRUPT},
    {"n_tensors + 1", IDX, 0, 8, 8, 1, 1, 1, AMBER_ECORRUPT},
    {"n_tensors 0", IDX, 0, 8, 8, 0, 0, 1, AMBER_ECORRUPT},
    {"n_chunks 2^62", IDX, 0, 16, 8, 0, BIG, 1, AMBER_ECORRUPT},
    {"n_chunks 2^64-1", IDX, 0, 16, 8, 0, UINT64_MAX, 1, AMBER_ECORRUPT},
    {"n_chunks - 1", IDX, 0, 16, 8, 1, UINT64_MAX, 1, AMBER_ECORRUPT},
    {"meta_size 2^63", IDX, 0, 24, 8, 0, UINT64_C(1) << 63, 1, AMBER_ECORRUPT},
    {"meta_size + 1", IDX, 0, 24, 8, 1, 1, 1, AMBER_ECORRUPT},
    {"meta_size - 1", IDX, 0, 24, 8, 1, UINT64_MAX, 1, AMBER_ECORRUPT},
    {"ndim 9", TENSOR, 0, 3, 1, 0, 9, 1, AMBER_EFORMAT},
    {"ndim 255", TENSOR, 2, 3, 1, 0, 255, 1, AMBER_EFORMAT},
    {"name_len 0", TENSOR, 0, 0, 2, 0, 0, 1, AMBER_ECORRUPT},
    {"name_len beyond the index", TENSOR, 0, 0, 2, 0, 0xFFFF, 1, AMBER_ECORRUPT},
    {"dtype 0", TENSOR, 0, 2, 1, 0, 0, 1, AMBER_EFORMAT},
    {"dtype 16 (after 1.1's u64)", TENSOR, 1, 2, 1, 0, 16, 1, AMBER_EFORMAT},
    {"dtype 255", TENSOR, 1, 2, 1, 0, 255, 1, AMBER_EFORMAT},
    {"tensor reserved", TENSOR, 0, 4, 4, 0, 1, 1, AMBER_ECORRUPT},
    {"chunk_elems 0", TENSOR, 0, 8, 8, 0, 0, 1, AMBER_ECORRUPT},
    {"chunk_elems 65", TENSOR, 0, 8, 8, 0, 65, 1, AMBER_ECORRUPT},
    {"chunk_elems 2^62", TENSOR, 0, 8, 8, 0, BIG, 1, AMBER_ECORRUPT},
    {"first_chunk 1", TENSOR, 0, 16, 8, 0, 1, 1, AMBER_ECORRUPT},
    {"first_chunk 2^64-1", TENSOR, 1, 16, 8, 0, UINT64_MAX, 1, AMBER_ECORRUPT},
    {"tensor n_chunks 4", TENSOR, 0, 24, 8, 0, 4, 1, AMBER_ECORRUPT},
    {"tensor n_chunks 2^62", TENSOR, 0, 24, 8, 0, BIG, 1, AMBER_ECORRUPT},
    {"shape[0] 2^62", TENSOR, 0, 32, 8, 0, BIG, 1, AMBER_ECORRUPT},
    {"shape[0] 0", TENSOR, 0, 32, 8, 0, 0, 1, AMBER_ECORRUPT},
    {"shape[1] 2^64-1", TENSOR, 0, 40, 8, 0, UINT64_MAX, 1, AMBER_ECORRUPT},
    {"duplicate tensor name", TENSOR, 1, 42, 1, 0, '0', 1, AMBER_ECORRUPT}, /* w.1 -> w.0 */
    {"NUL in a name", TENSOR, 0, 49, 1, 0, 0, 1, AMBER_ECORRUPT},
    {"policy_len beyond the index", TENSOR, 3, 44, 2, 0, 0xFFFF, 1, AMBER_ECORRUPT},
    {"payload_offset beyond the file", CHUNK, 0, 0, 8, 0, UINT64_C(1) << 40, 1, AMBER_ECORRUPT},
    {"payload_offset + size overflows", CHUNK, 1, 0, 8, 0, UINT64_MAX - 8, 1, AMBER_ECORRUPT},
    {"payload_offset in the header", CHUNK, 0, 0, 8, 0, 8, 1, AMBER_ECORRUPT},
    {"payload_offset + 1", CHUNK, 0, 0, 8, 1, 1, 1, AMBER_ECORRUPT},
    {"payload_size + 1", CHUNK, 0, 8, 8, 1, 1, 1, AMBER_ECORRUPT},
    {"payload_size 2^62", CHUNK, 0, 8, 8, 0, BIG, 1, AMBER_ECORRUPT},
    {"stored n + 1", CHUNK, 2, 16, 8, 1, 1, 1, AMBER_ECORRUPT},
    {"stored 0 in a raw chunk", CHUNK, 0, 16, 8, 0, 0, 1, AMBER_ECORRUPT},
    {"encoding 6 (after 1.3's QSPARSE)", CHUNK, 0, 24, 1, 0, 6, 1, AMBER_EFORMAT},
    {"encoding 255", CHUNK, 6, 24, 1, 0, 255, 1, AMBER_EFORMAT},
    {"SHUF_ZSTD on raw bytes", CHUNK, 0, 24, 1, 0, 1, 1, AMBER_ECORRUPT},
    {"UNCHANGED with a payload", CHUNK, 0, 24, 1, 0, 2, 1, AMBER_ECORRUPT},
    {"SPARSE in a full checkpoint", CHUNK, 3, 24, 1, 0, 3, 1, AMBER_ECORRUPT},
    {"XOR_ZSTD in a full checkpoint", CHUNK, 5, 24, 1, 0, 4, 1, AMBER_ECORRUPT},
    {"QSPARSE in a full checkpoint", CHUNK, 2, 24, 1, 0, 5, 1, AMBER_ECORRUPT},
    {"chunk reserved", CHUNK, 0, 27, 1, 0, 1, 1, AMBER_ECORRUPT},
    {"payload_checksum", CHUNK, 4, 32, 8, 1, 1, 1, AMBER_ECORRUPT},
};
/* clang-format on */

/* Absolute offset of tensor entry k or chunk entry k of the file's index. */
static uint64_t entry_off(const uint8_t *b, uint64_t ix, int region, uint64_t k) {
  uint64_t nt = amber__get64(b + ix + 8), p = ix + AMBER__INDEX_FIXED;
  for (uint64_t i = 0; i < nt && !(region == TENSOR && i == k); i++) {
    uint32_t ndim = b[p + 3], nl = amber__get16(b + p);
    p += AMBER__TENSOR_FIXED + 8u * ndim + nl;
    p += 2 + amber__get16(b + p);
  }
  return region == TENSOR ? p : p + AMBER__CHUNK_ENTRY * k;
}

static void reseal(uint8_t *b, size_t n, int region) {
  uint8_t *f = b + n - AMBER__FOOTER_SIZE;
  if (region == HDR) amber__put64(b + 56, amber__xxh3(b, 56));
  if (region >= IDX) amber__put64(f + 16, amber__xxh3(b + amber__get64(f), amber__get64(f + 8)));
  if (region != HDR) amber__put64(f + 40, amber__xxh3(f, 40));
}

static void test_patched_fields_are_refused_cleanly(void) {
  const char *dir = clone(raw_master);
  char p[4200];
  size_t n = 0;
  path_in(p, dir, F30);
  uint8_t *orig = tu_read_file(p, &n), *b = malloc(n);
  if (!orig || !b) abort();
  uint64_t ix = amber__get64(orig + n - AMBER__FOOTER_SIZE);
  for (size_t i = 0; i < sizeof patches / sizeof patches[0]; i++) {
    const patch *pt = &patches[i];
    memcpy(b, orig, n);
    uint64_t at = pt->region == HDR   ? 0
                  : pt->region == FTR ? n - AMBER__FOOTER_SIZE
                  : pt->region == IDX ? ix
                                      : entry_off(orig, ix, pt->region, pt->k);
    at += pt->off;
    uint64_t v = pt->value;
    if (pt->add)
      v += pt->width == 8 ? amber__get64(b + at) : pt->width == 4 ? amber__get32(b + at)
           : pt->width == 2 ? amber__get16(b + at) : b[at];
    if (pt->width == 8) amber__put64(b + at, v);
    else if (pt->width == 4) amber__put32(b + at, (uint32_t)v);
    else if (pt->width == 2) amber__put16(b + at, (uint16_t)v);
    else b[at] = (uint8_t)v;
    CHECK(memcmp(b, orig, n) != 0);
    if (pt->reseal) reseal(b, n, pt->region);
    put(dir, F30, b, n);
    expect(pt->what, dir, AMBER_LATEST, pt->want, F30);
  }
  free(orig);
  free(b);
}

/* ---- crafted files ---- */

/* Writes header, payload, the index `ix` and a footer as `name` in `dir`; returns
 * the state id. */
static uint64_t craft(const char *dir, const char *name, const amber__header *h,
                      const amber__index *ix, const uint8_t *payload, size_t plen) {
  uint64_t isz = amber__index_size(ix);
  size_t total = AMBER__HEADER_SIZE + plen + isz + AMBER__FOOTER_SIZE;
  uint8_t *b = malloc(total), *hi = malloc(AMBER__HEADER_SIZE + isz);
  if (!b || !hi) abort();
  amber__header_encode(h, b);
  if (plen) memcpy(b + AMBER__HEADER_SIZE, payload, plen);
  amber__index_encode(ix, b + AMBER__HEADER_SIZE + plen);
  memcpy(hi, b, AMBER__HEADER_SIZE);
  memcpy(hi + AMBER__HEADER_SIZE, b + AMBER__HEADER_SIZE + plen, isz);
  amber__footer f = {.index_offset = AMBER__HEADER_SIZE + plen, .index_size = isz};
  f.index_checksum = amber__xxh3(b + f.index_offset, isz);
  f.content_hash = f.state_id = amber__xxh3(hi, AMBER__HEADER_SIZE + isz);
  amber__footer_encode(&f, b + f.index_offset + isz);
  put(dir, name, b, total);
  free(b);
  free(hi);
  return f.state_id;
}

static void set_latest(const char *dir, uint64_t step, uint64_t state) {
  char line[64];
  int n = snprintf(line, sizeof line, "%" PRIu64 " %016" PRIx64 "\n", step, state);
  put(dir, "LATEST", line, (size_t)n);
}

static void test_hostile_sizes_cause_no_big_allocation(void) {
  /* One chunk claiming 64 MiB (the most a chunk may hold), 1 GiB or 4 TiB of f32
   * from a payload of a few bytes. */
  uint8_t zero[64] = {0}, frame[128];
  size_t flen = 0;
  void *cctx = amber__zstd_cctx();
  CHECK_OK(amber__zstd_compress(cctx, 1, frame, sizeof frame, zero, sizeof zero, &flen));
  amber__zstd_cctx_free(cctx);
  const uint64_t sizes[] = {UINT64_C(1) << 24, UINT64_C(1) << 28, UINT64_C(1) << 40};
  const uint8_t encs[] = {AMBER__ENC_SHUF_ZSTD, AMBER__ENC_UNCHANGED};
  for (size_t s = 0; s < 3; s++)
    for (size_t e = 0; e < 2; e++) {
      const char *dir = tu_tmpdir();
      int unchanged = encs[e] == AMBER__ENC_UNCHANGED;
      amber__tensor t = {.name = (char *)"huge", .name_len = 4, .dtype = AMBER_F32, .ndim = 1,
                         .shape = {sizes[s]}, .chunk_elems = sizes[s], .n_chunks = 1,
                         .policy = (char *)"exact"};
      amber__chunk c = {.offset = AMBER__HEADER_SIZE, .size = unchanged ? 0 : flen,
                        .stored = unchanged ? 0 : sizes[s], .encoding = encs[e],
                        .checksum = unchanged ? 0 : amber__xxh3(frame, flen)};
      amber__index ix = {.tensors = &t, .n_tensors = 1, .chunks = &c, .n_chunks = 1,
                         .meta = (char *)"", .meta_size = 0};
      amber__header h = {.format_major = 1, .step = 1, .kind = AMBER_KIND_FULL,
                         .parent_step = AMBER_NO_STEP};
      set_latest(dir, 1, craft(dir, F1, &h, &ix, frame, unchanged ? 0 : flen));
      char what[96];
      snprintf(what, sizeof what, "%s chunk claiming %" PRIu64 " elements",
               unchanged ? "UNCHANGED (full)" : "SHUF_ZSTD", sizes[s]);
      expect(what, dir, 1, AMBER_ECORRUPT, F1);
    }
}

/* Listing reads only headers and footers: a damaged one is listed, flagged
 * AMBER_CKPT_DAMAGED; intact ones are not flagged. */
static void test_listing_flags_damaged_headers_and_footers(void) {
  const char *dir = clone(raw_master);
  char p[4200];
  path_in(p, dir, F20);
  CHECK(tu_flip_byte(p, 9, 0x10) == 0); /* inside the header */
  path_in(p, dir, F30);
  CHECK(tu_flip_byte(p, -3, 0x01) == 0); /* inside the footer */
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY;
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, dir, &so));
  amber_ckpt_info *info = NULL;
  size_t cnt = 0;
  CHECK_OK(amber_store_list(st, &info, &cnt));
  CHECK(cnt == 3);
  for (size_t i = 0; i < cnt && info; i++) {
    CHECK(info[i].step == 10 * (i + 1));
    CHECK(!!(info[i].flags & AMBER_CKPT_DAMAGED) == (i > 0));
  }
  CHECK(cnt == 3 && info && info[0].hash != 0);
  amber_free(info);
  amber_store_close(st);
}

static void test_wrong_or_missing_parent_is_detected(void) {
  const char *dir = clone(dlt_master);
  char p[4200], msg[1024];
  size_t n;
  expect("undamaged deltas", dir, AMBER_LATEST, 0, "");
  path_in(p, raw_master, F20); /* step 20 again, but another state */
  uint8_t *b = tu_read_file(p, &n);
  put(dir, F20, b, n);
  free(b);
  expect("parent replaced by another step 20", dir, AMBER_LATEST, AMBER_EPARENT, F30);
  CHECK_RC(attempt(dir, 20, 20, msg), 0); /* which is itself intact */
  path_in(p, dir, F20);
  CHECK(unlink(p) == 0);
  expect("parent file missing", dir, AMBER_LATEST, AMBER_EPARENT, F30);
  dir = clone(dlt_master);
  path_in(p, dir, F10);
  CHECK(unlink(p) == 0);
  expect("grandparent file missing", dir, AMBER_LATEST, AMBER_EPARENT, F20);
  put(dir, F10, "junk", 4);
  expect("grandparent file damaged", dir, AMBER_LATEST, AMBER_ECORRUPT, F10);
}

int main(void) {
  make_store(raw_master, 0, AMBER_SAVE_FULL);
  make_store(zst_master, AMBER_WRITER_COMPRESS_FULL, AMBER_SAVE_FULL);
  make_store(dlt_master, 0, 0);
  cap_address_space();
  TEST_RUN(test_bit_flip_at_every_byte_is_detected);
  TEST_RUN(test_truncation_to_every_length_is_detected);
  TEST_RUN(test_appended_bytes_are_detected);
  TEST_RUN(test_missing_file_is_reported_and_older_steps_still_restore);
  TEST_RUN(test_renamed_or_foreign_file_is_detected);
  TEST_RUN(test_listing_flags_damaged_headers_and_footers);
  TEST_RUN(test_missing_latest_with_checkpoints_is_corruption);
  TEST_RUN(test_malformed_latest_is_detected);
  TEST_RUN(test_latest_state_id_mismatch_is_detected);
  TEST_RUN(test_patched_fields_are_refused_cleanly);
  TEST_RUN(test_hostile_sizes_cause_no_big_allocation);
  TEST_RUN(test_wrong_or_missing_parent_is_detected);
  return tu_finish();
}

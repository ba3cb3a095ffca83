/*
 * test_tier_pack.c - replicas of a rank's files (src/tpack.c, docs/FORMAT.md "Pack"):
 * a pack from nothing or from an earlier step, unpacked into another directory,
 * restores bit-identically there (single-rank stores, and a rank of a multi-rank
 * store with its manifest and GLOBAL); unpack moves pointers last and never back;
 * a damaged, truncated or hostile blob changes nothing; holdings says what a
 * directory can restore.
 */
#include <dirent.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "testutil.h"
#include "tier.h"
#include "tier_job.h"

static int exists(const char *dir, const char *name) {
  char p[4400];
  struct stat sb;
  snprintf(p, sizeof p, "%s/%s", dir, name);
  return stat(p, &sb) == 0;
}

/* The blob's frames' names, joined by spaces (its layout read independently of
 * src/tpack.c: FORMAT.md's table). */
static void frame_names(const uint8_t *b, size_t len, char *out, size_t cap) {
  size_t o = 32, w = 0;
  out[0] = 0;
  while (o + 16 <= len) {
    uint16_t nl = (uint16_t)(b[o] | b[o + 1] << 8);
    uint64_t dl = 0;
    for (int i = 7; i >= 0; i--)
      dl = dl << 8 | b[o + 8 + i];
    w += (size_t)snprintf(out + w, cap > w ? cap - w : 0, "%s%.*s", w ? " " : "", (int)nl,
                          (const char *)b + o + 16);
    o += 16 + nl + dl + 8;
  }
}

static void holding(const char *dir, int32_t rank, uint64_t *step, uint64_t *oldest) {
  amber_tier_holding *h = NULL;
  size_t n = 0;
  *step = *oldest = 12345;
  CHECK_OK(amber_tier_holdings(dir, &h, &n));
  for (size_t i = 0; i < n; i++)
    if (h[i].kind == AMBER_TIER_STORE && h[i].rank == rank)
      *step = h[i].step, *oldest = h[i].oldest;
  amber_free(h);
}

static void test_pack_and_unpack_a_single_rank_store(void) {
  const char *t = tu_tmpdir();
  char mem[2048], rep[2048], names[4096];
  snprintf(mem, sizeof mem, "%s/mem", t);
  snprintf(rep, sizeof rep, "%s/replica", t);
  job j;
  job_open(&j, mem, 4); /* fulls at 1, 6, 11 */
  for (uint64_t s = 1; s <= 9; s++)
    job_save(&j, s, 0);
  void *blob = NULL;
  size_t len = 0;
  CHECK_OK(amber_tier_pack(mem, -1, AMBER_NO_STEP, 9, &blob, &len));
  frame_names(blob, len, names, sizeof names);
  CHECK(!strcmp(
      names, "ckpt-00000000000000000006.amber ckpt-00000000000000000007.amber "
             "ckpt-00000000000000000008.amber ckpt-00000000000000000009.amber LATEST"));
  CHECK_OK(amber_tier_unpack(rep, blob, len));
  amber_free(blob);
  check_step(rep, 9);
  uint64_t step, oldest;
  holding(rep, -1, &step, &oldest);
  CHECK(step == 9 && oldest == 6);
  /* from step 9 to 10: one file */
  job_save(&j, 10, 0);
  CHECK_OK(amber_tier_pack(mem, -1, 9, 10, &blob, &len));
  frame_names(blob, len, names, sizeof names);
  CHECK(!strcmp(names, "ckpt-00000000000000000010.amber LATEST"));
  CHECK_OK(amber_tier_unpack(rep, blob, len));
  amber_free(blob);
  check_step(rep, 10);
  check_step(rep, 7);
  /* an older step's blob does not move LATEST back */
  CHECK_OK(amber_tier_pack(mem, -1, AMBER_NO_STEP, 8, &blob, &len));
  CHECK_OK(amber_tier_unpack(rep, blob, len));
  amber_free(blob);
  holding(rep, -1, &step, &oldest);
  CHECK(step == 10);
  /* a pack from a step the replica does not have: files, but no pointer */
  job_save(&j, 11, 0);
  job_save(&j, 12, 0);
  char rep2[2100];
  snprintf(rep2, sizeof rep2, "%s/replica2", t);
  CHECK_OK(amber_tier_pack(mem, -1, 11, 12, &blob, &len));
  CHECK_RC(amber_tier_unpack(rep2, blob, len), AMBER_EPARENT);
  CHECK(strstr(amber_last_error(NULL), "step 12") != NULL);
  CHECK(exists(rep2, "ckpt-00000000000000000012.amber") && !exists(rep2, "LATEST"));
  holding(rep2, -1, &step, &oldest);
  CHECK(step == AMBER_NO_STEP);
  amber_free(blob);
  /* not committed; bad arguments */
  CHECK_RC(amber_tier_pack(mem, -1, AMBER_NO_STEP, 13, &blob, &len), AMBER_ENOENT);
  CHECK_RC(amber_tier_pack(mem, 0, AMBER_NO_STEP, 12, &blob, &len), AMBER_ENOENT);
  CHECK_RC(amber_tier_pack(mem, -2, AMBER_NO_STEP, 12, &blob, &len), AMBER_EINVAL);
  job_close(&j);
}

static void test_pack_a_rank_with_its_manifest_and_global(void) {
  const char *t = tu_tmpdir();
  char mem[2048], rep[2048], names[4096];
  snprintf(mem, sizeof mem, "%s/mem", t);
  snprintf(rep, sizeof rep, "%s/replica", t);
  gjob jb = {.path = mem, .first = 1, .last = 5, .full_every = 2, .fail_rank = -1};
  g_run(&jb, 2); /* fulls at 1, 4, 7 */
  void *blob = NULL;
  size_t len = 0;
  CHECK_OK(amber_tier_pack(mem, 1, AMBER_NO_STEP, 5, &blob, &len));
  frame_names(blob, len, names, sizeof names);
  CHECK(!strcmp(names, "rank-00001/ckpt-00000000000000000004.amber "
                       "rank-00001/ckpt-00000000000000000005.amber "
                       "step-00000000000000000005.manifest rank-00001/LATEST GLOBAL"));
  CHECK_OK(amber_tier_unpack(rep, blob, len));
  amber_free(blob);
  amber_tier_holding *h = NULL;
  size_t n = 0;
  CHECK_OK(amber_tier_holdings(rep, &h, &n));
  CHECK(n == 2);
  if (n == 2) {
    CHECK(h[0].kind == AMBER_TIER_STORE && h[0].rank == 1 && h[0].step == 5 &&
          h[0].oldest == 4);
    CHECK(h[1].kind == AMBER_TIER_MANIFEST && h[1].step == 5 &&
          h[1].flags == AMBER_TIER_COMMITTED);
  }
  amber_free(h);
  /* with rank 0's part too, the replica reads as the store */
  CHECK_OK(amber_tier_pack(mem, 0, AMBER_NO_STEP, 5, &blob, &len));
  CHECK_OK(amber_tier_unpack(rep, blob, len));
  amber_free(blob);
  g_check(rep, 5);
  /* later steps, rank by rank: GLOBAL follows the manifests */
  jb.first = 6, jb.last = 7;
  g_run(&jb, 2);
  CHECK_OK(amber_tier_pack(mem, 1, 5, 7, &blob, &len));
  frame_names(blob, len, names, sizeof names);
  CHECK(!strcmp(names, "rank-00001/ckpt-00000000000000000007.amber " /* 7 is full */
                       "step-00000000000000000007.manifest rank-00001/LATEST GLOBAL"));
  CHECK_OK(amber_tier_unpack(rep, blob, len));
  amber_free(blob);
  uint64_t step, oldest;
  holding(rep, 0, &step, &oldest);
  CHECK(step == 5);
  holding(rep, 1, &step, &oldest);
  CHECK(step == 7);
  CHECK_OK(amber_tier_pack(mem, 0, 5, 7, &blob, &len));
  CHECK_OK(amber_tier_unpack(rep, blob, len));
  amber_free(blob);
  g_check(rep, 7);
  g_check(rep, 5);
}

/* Nothing is written (the directory is not even made) for a blob that fails. */
static void check_refused(const char *dir, const void *b, size_t len, const char *what) {
  int rc = amber_tier_unpack(dir, b, len);
  if (rc != AMBER_ECORRUPT && rc != AMBER_EFORMAT) {
    fprintf(stderr, "  %s: unpack returned %d\n", what, rc);
    tu_failures++;
  }
  CHECK(access(dir, F_OK) != 0);
}

static void test_a_damaged_or_truncated_blob_changes_nothing(void) {
  const char *t = tu_tmpdir();
  char mem[2048], rep[2048];
  snprintf(mem, sizeof mem, "%s/mem", t);
  snprintf(rep, sizeof rep, "%s/replica", t);
  job j;
  job_open(&j, mem, 3);
  for (uint64_t s = 1; s <= 3; s++)
    job_save(&j, s, 0);
  job_close(&j);
  uint8_t *blob = NULL;
  size_t len = 0;
  CHECK_OK(amber_tier_pack(mem, -1, AMBER_NO_STEP, 3, (void **)&blob, &len));
  uint8_t *copy = malloc(len);
  uint64_t seed = 99;
  size_t flips = 0;
  /* the header and every frame's first bytes, then positions all over */
  for (size_t k = 0; k < 400 && !tu_failures; k++) {
    size_t pos = k < 64 ? k : (size_t)(tu_rand(&seed) % len);
    memcpy(copy, blob, len);
    copy[pos] ^= (uint8_t)(1u << (k % 8));
    char what[64];
    snprintf(what, sizeof what, "bit flip at %zu", pos);
    check_refused(rep, copy, len, what);
    flips++;
  }
  check_refused(rep, blob, len - 1, "truncated by one byte");
  check_refused(rep, blob, len / 2, "truncated to half");
  check_refused(rep, blob, 10, "10 bytes");
  uint8_t *longer = calloc(1, len + 8);
  memcpy(longer, blob, len);
  for (int i = 0; i < 8; i++)
    longer[16 + i] = (uint8_t)((uint64_t)(len + 8) >> (8 * i));
  uint64_t lh = amber__xxh3(longer, 24);
  for (int i = 0; i < 8; i++)
    longer[24 + i] = (uint8_t)(lh >> (8 * i));
  check_refused(rep, longer, len + 8, "8 bytes after the last frame, the length says so");
  free(longer);
  memcpy(copy, blob, len);
  copy[8] = 2; /* version 2, header checksum recomputed */
  uint64_t h = amber__xxh3(copy, 24);
  for (int i = 0; i < 8; i++)
    copy[24 + i] = (uint8_t)(h >> (8 * i));
  CHECK_RC(amber_tier_unpack(rep, copy, len), AMBER_EFORMAT);
  printf("     %zu damaged blobs refused, nothing written\n", flips);
  CHECK_OK(amber_tier_unpack(rep, blob, len));
  check_step(rep, 3);
  free(copy);
  amber_free(blob);
}

/* A blob of one frame named `name` with `data`, every checksum right. */
static size_t one_frame(uint8_t *b, const char *name, const void *data, size_t dl) {
  size_t nl = strlen(name), len = 32 + 16 + nl + dl + 8;
  memset(b, 0, len);
  memcpy(b, "AMBERPK1", 8);
  b[8] = 1, b[12] = 1;
  for (int i = 0; i < 8; i++)
    b[16 + i] = (uint8_t)((uint64_t)len >> (8 * i));
  uint64_t h = amber__xxh3(b, 24);
  for (int i = 0; i < 8; i++)
    b[24 + i] = (uint8_t)(h >> (8 * i));
  uint8_t *f = b + 32;
  f[0] = (uint8_t)nl, f[1] = (uint8_t)(nl >> 8);
  for (int i = 0; i < 8; i++)
    f[8 + i] = (uint8_t)((uint64_t)dl >> (8 * i));
  memcpy(f + 16, name, nl);
  memcpy(f + 16 + nl, data, dl);
  h = amber__xxh3(f, 16 + nl + dl);
  for (int i = 0; i < 8; i++)
    f[16 + nl + dl + i] = (uint8_t)(h >> (8 * i));
  return len;
}

static void test_a_hostile_blob_writes_nothing_anywhere(void) {
  const char *t = tu_tmpdir();
  char rep[2048];
  snprintf(rep, sizeof rep, "%s/replica", t);
  static const char *const bad[] = {
      "../evil",
      "rank-00001/../../evil",
      "/etc/evil",
      "rank-1/LATEST",
      "rank-00001/GLOBAL",
      "ckpt-1.amber",
      "LATEST.tmp",
      "rank-00001/",
      "step-1.manifest",
      "rank-00001/step-00000000000000000001.manifest",
      "TIERS",
      ".lock",
      "rank-000001/LATEST", /* rank 1, spelled otherwise: a second directory of it */
  };
  uint8_t b[512];
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    size_t len = one_frame(b, bad[i], "1 0000000000000000\n", 19);
    check_refused(rep, b, len, bad[i]);
  }
  char evil[2100];
  snprintf(evil, sizeof evil, "%s/evil", t);
  CHECK(access(evil, F_OK) != 0);
  /* a well-named frame whose bytes are no checkpoint */
  size_t len = one_frame(b, "ckpt-00000000000000000001.amber", "not a checkpoint", 16);
  check_refused(rep, b, len, "a checkpoint frame of junk");
  len = one_frame(b, "LATEST", "junk", 4);
  check_refused(rep, b, len, "a LATEST frame of junk");
  /* a well-formed LATEST alone: it names a file the directory lacks */
  len = one_frame(b, "LATEST", "1 0000000000000000\n", 19);
  CHECK_RC(amber_tier_unpack(rep, b, len), AMBER_EPARENT);
  CHECK(!exists(rep, "LATEST"));
}

static void test_holdings_stop_at_a_damaged_file(void) {
  const char *t = tu_tmpdir();
  char mem[2048], path[4400];
  snprintf(mem, sizeof mem, "%s/mem", t);
  job j;
  job_open(&j, mem, 4); /* fulls at 1, 6 */
  for (uint64_t s = 1; s <= 9; s++)
    job_save(&j, s, 0);
  job_close(&j);
  uint64_t step, oldest;
  holding(mem, -1, &step, &oldest);
  CHECK(step == 9 && oldest == 1);
  snprintf(path, sizeof path, "%s/ckpt-00000000000000000008.amber", mem);
  CHECK(tu_flip_byte(path, -20, 0x10) == 0); /* its footer */
  holding(mem, -1, &step, &oldest);
  CHECK(step == 7 && oldest == 1);
  snprintf(path, sizeof path, "%s/ckpt-00000000000000000003.amber", mem);
  CHECK(unlink(path) == 0);
  holding(mem, -1, &step, &oldest);
  CHECK(step == 7 && oldest == 6);
  amber_tier_holding *h = NULL;
  size_t n = 0;
  snprintf(path, sizeof path, "%s/none", t);
  CHECK_RC(amber_tier_holdings(path, &h, &n), AMBER_ENOENT);
}

/* ---- golden blobs: tests/golden/v1.4-pack ----
 *
 * "single.pack": a single-rank store's steps 1 (full) and 2 (delta) of one tensor
 * "x" (G_N f32, element i is i/2 at step 1, plus 1 at step 2 where i % 10 == 0);
 * "rank1.pack": rank 1 of a two-rank store (tier_job.h's "w" and "b") from nothing
 * to step 2, with the manifest of step 2 and GLOBAL; "TIERS": a memory tier's
 * record of the durable tier "/runs/x/durable". Written once by this version
 * (AMBER_WRITE_TIER_GOLDEN=DIR writes them to DIR); every later one must read them. */

#define G_N 1000
#define GOLDEN AMBER_SOURCE_DIR "/tests/golden/v1.4-pack"

static float golden_x(int i, int step) {
  return (float)i * 0.5f + (step == 2 && i % 10 == 0 ? 1.0f : 0.0f);
}

static void write_golden(const char *out) {
  const char *t = tu_tmpdir();
  char mem[2048], gmem[2048], p[4400];
  snprintf(mem, sizeof mem, "%s/mem", t);
  snprintf(gmem, sizeof gmem, "%s/gmem", t);
  amber_store *st = NULL;
  amber_writer *w = NULL;
  CHECK_OK(amber_store_open(&st, mem, NULL));
  CHECK_OK(amber_writer_open(&w, st, NULL));
  float x[G_N];
  int64_t n = G_N;
  CHECK_OK(amber_writer_add(w, "x", AMBER_F32, 1, &n, x, NULL));
  for (int s = 1; s <= 2; s++) {
    for (int i = 0; i < G_N; i++)
      x[i] = golden_x(i, s);
    CHECK_OK(amber_writer_save(w, (uint64_t)s, 0));
  }
  amber_writer_close(w);
  amber_store_close(st);
  gjob jb = {.path = gmem, .first = 1, .last = 2, .full_every = 5, .fail_rank = -1};
  g_run(&jb, 2);
  void *b;
  size_t len;
  mkdir(out, 0755);
  CHECK_OK(amber_tier_pack(mem, -1, AMBER_NO_STEP, 2, &b, &len));
  snprintf(p, sizeof p, "%s/single.pack", out);
  CHECK(tu_write_file(p, b, len) == 0);
  amber_free(b);
  CHECK_OK(amber_tier_pack(gmem, 1, AMBER_NO_STEP, 2, &b, &len));
  snprintf(p, sizeof p, "%s/rank1.pack", out);
  CHECK(tu_write_file(p, b, len) == 0);
  amber_free(b);
  amber__err e;
  CHECK_OK(amber__tiers_write(&e, out, "/runs/x/durable"));
}

static void test_golden_blobs_of_pack_v1_still_unpack(void) {
  const char *t = tu_tmpdir();
  char dir[2048], p[4400];
  size_t len = 0;
  snprintf(p, sizeof p, "%s/single.pack", GOLDEN);
  uint8_t *b = tu_read_file(p, &len);
  CHECK(b != NULL);
  snprintf(dir, sizeof dir, "%s/single", t);
  if (b) CHECK_OK(amber_tier_unpack(dir, b, len));
  free(b);
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY;
  amber_store *st = NULL;
  amber_reader *r = NULL;
  CHECK_OK(amber_store_open(&st, dir, &so));
  for (int s = 1; st && s <= 2; s++) {
    CHECK_OK(amber_reader_open(&r, st, (uint64_t)s, NULL));
    float x[G_N];
    if (r) CHECK_OK(amber_reader_read(r, 0, x, sizeof x));
    for (int i = 0; r && i < G_N; i++)
      CHECK(x[i] == golden_x(i, s));
    amber_reader_close(r);
  }
  amber_store_close(st);
  snprintf(p, sizeof p, "%s/rank1.pack", GOLDEN);
  b = tu_read_file(p, &len);
  CHECK(b != NULL);
  snprintf(dir, sizeof dir, "%s/rank1", t);
  if (b) CHECK_OK(amber_tier_unpack(dir, b, len));
  free(b);
  amber_tier_holding *h = NULL;
  size_t n = 0;
  CHECK_OK(amber_tier_holdings(dir, &h, &n));
  CHECK(n == 2 && h && h[0].rank == 1 && h[0].step == 2 && h[0].oldest == 1 &&
        h[1].kind == AMBER_TIER_MANIFEST && h[1].step == 2 &&
        h[1].flags == AMBER_TIER_COMMITTED);
  amber_free(h);
  /* rank 1's own store holds its rows of "w" at step 2 */
  snprintf(p, sizeof p, "%s/rank-00001", dir);
  CHECK_OK(amber_store_open(&st, p, &so));
  CHECK_OK(amber_reader_open(&r, st, 2, NULL));
  size_t wi = 0;
  int64_t off[2], shape[2];
  g_part(1, 2, off, shape);
  float w[G_ROWS * G_COLS];
  if (r) CHECK_OK(amber_reader_find(r, "w", &wi));
  if (r)
    CHECK_OK(amber_reader_read(r, wi, w, (uint64_t)(shape[0] * shape[1]) * sizeof *w));
  for (int64_t i = 0; r && i < shape[0]; i++)
    for (int64_t j = 0; j < G_COLS; j++)
      CHECK(w[i * G_COLS + j] == g_wval(off[0] + i, j, 2));
  amber_reader_close(r);
  amber_store_close(st);
  char *durable = NULL;
  CHECK_OK(amber_tier_durable(GOLDEN, &durable));
  CHECK(durable && !strcmp(durable, "/runs/x/durable"));
  amber_free(durable);
}

int main(void) {
  if (getenv("AMBER_WRITE_TIER_GOLDEN")) {
    write_golden(getenv("AMBER_WRITE_TIER_GOLDEN"));
    return tu_finish();
  }
  TEST_RUN(test_golden_blobs_of_pack_v1_still_unpack);
  TEST_RUN(test_pack_and_unpack_a_single_rank_store);
  TEST_RUN(test_pack_a_rank_with_its_manifest_and_global);
  TEST_RUN(test_a_damaged_or_truncated_blob_changes_nothing);
  TEST_RUN(test_a_hostile_blob_writes_nothing_anywhere);
  TEST_RUN(test_holdings_stop_at_a_damaged_file);
  return tu_finish();
}

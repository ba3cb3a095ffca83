/*
 * test_manifest.c - the manifest parser against damaged and hostile manifests
 * (docs/FORMAT.md, "Many ranks"): every truncation, a flipped byte, counts far
 * beyond the file, shards outside their tensor or overlapping, a newer format;
 * each a clear error and never a crash or a huge allocation. Also the tiling check
 * and the box table of a rank's file; a rank with several shards of a tensor (format
 * 1.4) and the names of their file tensors. Also writes the fuzz corpus seeds
 * when AMBER_WRITE_CORPUS names a directory.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "global.h"
#include "testutil.h"

/* A valid manifest: 2 ranks, a tensor split by rows and a replicated one. */
static uint8_t *sample(size_t *len) {
  amber__mrank ranks[2] = {{5, 0x1111, 100, AMBER_KIND_DELTA, AMBER__RANK_PRESENT},
                           {5, 0x2222, 90, AMBER_KIND_DELTA, AMBER__RANK_PRESENT}};
  amber__mshard ws[2];
  memset(ws, 0, sizeof ws);
  ws[0].rank = 0, ws[0].shape[0] = 2, ws[0].shape[1] = 3;
  ws[1].rank = 1, ws[1].off[0] = 2, ws[1].shape[0] = 2, ws[1].shape[1] = 3;
  amber__mshard bs;
  memset(&bs, 0, sizeof bs);
  bs.shape[0] = 3;
  amber__mtensor t[2];
  memset(t, 0, sizeof t);
  t[0].name = "w", t[0].dtype = AMBER_F32, t[0].ndim = 2, t[0].shape[0] = 4;
  t[0].shape[1] = 3, t[0].nshards = 2, t[0].shards = ws;
  t[1].name = "b", t[1].dtype = AMBER_BF16, t[1].ndim = 1, t[1].shape[0] = 3;
  t[1].flags = AMBER_SHARD_REPLICATED, t[1].nshards = 1, t[1].shards = &bs;
  amber__manifest m = {5, 4, 2, AMBER_KIND_DELTA, ranks, 2, t};
  uint8_t *b = NULL;
  amber__err e;
  CHECK_OK(amber__manifest_encode(&m, &e, &b, len));
  return b;
}

static void reseal(uint8_t *b, size_t len) {
  amber__put64(b + 48, len);
  amber__put64(b + len - 8, amber__xxh3(b, len - 8));
}

static int decode(const uint8_t *b, size_t len, char *msg, size_t ml) {
  amber__manifest m;
  amber__err e;
  e.msg[0] = 0;
  int rc = amber__manifest_decode(&e, "M", b, len, &m);
  if (rc == 0) amber__manifest_free(&m);
  snprintf(msg, ml, "%s", e.msg);
  return rc;
}

static void test_valid_manifest_round_trips(void) {
  size_t len;
  uint8_t *b = sample(&len);
  amber__manifest m;
  amber__err e;
  CHECK_OK(amber__manifest_decode(&e, "M", b, len, &m));
  CHECK(m.step == 5 && m.parent == 4 && m.world == 2 && m.ntensors == 2);
  CHECK(!strcmp(m.tensors[0].name, "w") && m.tensors[0].shards[1].off[0] == 2);
  CHECK(m.tensors[1].flags == AMBER_SHARD_REPLICATED && m.ranks[1].hash == 0x2222);
  amber__manifest_free(&m);
  free(b);
}

/* A rank that holds several shards of a tensor (interleaved row blocks, as a
 * ChunkShardingSpec ["rank:0", "rank:1", "rank:1", "rank:0"] places them): the
 * manifest says format 1.4, and each shard is numbered among its rank's for the
 * name of its file tensor; one shard per rank stays 1.2 for older readers. */
static void test_several_shards_of_one_rank_make_minor_4_and_are_numbered(void) {
  amber__mrank ranks[2] = {{5, 0x1111, 100, AMBER_KIND_FULL, AMBER__RANK_PRESENT},
                           {5, 0x2222, 90, AMBER_KIND_FULL, AMBER__RANK_PRESENT}};
  static const uint32_t place[4] = {0, 1, 1, 0};
  amber__mshard ws[4];
  memset(ws, 0, sizeof ws);
  for (int i = 0; i < 4; i++)
    ws[i].rank = place[i], ws[i].off[0] = i, ws[i].shape[0] = 1, ws[i].shape[1] = 3;
  amber__mtensor t;
  memset(&t, 0, sizeof t);
  t.name = "w", t.dtype = AMBER_F32, t.ndim = 2, t.shape[0] = 4, t.shape[1] = 3;
  t.nshards = 4, t.shards = ws;
  amber__manifest m = {5, AMBER_NO_STEP, 2, AMBER_KIND_FULL, ranks, 1, &t};
  uint8_t *b = NULL;
  size_t len = 0;
  amber__err e;
  CHECK_OK(amber__manifest_encode(&m, &e, &b, &len));
  CHECK(b && amber__get16(b + 10) == AMBER__MF_MINOR_BOXES && AMBER__MF_MINOR_BOXES == 4);
  amber__manifest d;
  CHECK_OK(amber__manifest_decode(&e, "M", b, len, &d));
  static const uint32_t ord[4] = {0, 0, 1, 1};
  for (uint32_t i = 0; d.ntensors == 1 && i < 4; i++)
    CHECK(d.tensors[0].shards[i].rank == place[i] && d.tensors[0].shards[i].ord == ord[i]);
  amber__manifest_free(&d);
  free(b);
  b = sample(&len);
  CHECK(amber__get16(b + 10) == AMBER__MF_MINOR && AMBER__MF_MINOR == 2);
  free(b);
  /* the names of a rank's later boxes in its file, and what no global tensor may be */
  char *f0 = amber__box_file_name("w", 0), *f2 = amber__box_file_name("w", 2);
  CHECK(f0 && !strcmp(f0, "w") && f2 && !strcmp(f2, "amber.boxes/2/w"));
  free(f0), free(f2);
  CHECK(amber__box_name_reserved("amber.boxes") && amber__box_name_reserved("amber.boxes/1/w"));
  CHECK(!amber__box_name_reserved("amber.boxes2") && !amber__box_name_reserved("amber.box"));
  CHECK(!amber__box_name_reserved("w/amber.boxes/1/w"));
}

static void test_every_truncation_is_refused(void) {
  size_t len;
  uint8_t *b = sample(&len);
  char msg[1100];
  for (size_t n = 0; n < len; n++) {
    CHECK(decode(b, n, msg, sizeof msg) == AMBER_ECORRUPT);
    CHECK(strstr(msg, "M:") != NULL);
  }
  /* Truncated and resealed: the tables run past the end. */
  for (size_t n = AMBER__MF_HEADER + 8; n < len; n++) {
    uint8_t *c = malloc(n);
    memcpy(c, b, n - 8);
    reseal(c, n);
    CHECK(decode(c, n, msg, sizeof msg) < 0);
    free(c);
  }
  free(b);
}

static void test_flipped_byte_fails_the_checksum(void) {
  size_t len;
  uint8_t *b = sample(&len);
  char msg[1100];
  for (size_t i = 0; i < len; i++) {
    b[i] ^= 0x40;
    CHECK(decode(b, len, msg, sizeof msg) < 0);
    b[i] ^= 0x40;
  }
  b[60] ^= 1;
  CHECK(decode(b, len, msg, sizeof msg) == AMBER_ECORRUPT);
  CHECK(strstr(msg, "checksum") != NULL);
  free(b);
}

static void test_huge_counts_are_refused_before_allocating(void) {
  size_t len;
  uint8_t *b = sample(&len);
  char msg[1100];
  uint8_t *c = malloc(len);
  /* world size, tensor count, shard count, name length */
  const size_t at[] = {32, 40, AMBER__MF_HEADER + 2 * AMBER__MF_RANK + 8,
                       AMBER__MF_HEADER + 2 * AMBER__MF_RANK};
  const uint32_t vals[] = {0xFFFFFFFFu, 0x7FFFFFFFu, 0xFFFFFFFFu, 0xFFFF};
  for (int k = 0; k < 4; k++) {
    memcpy(c, b, len);
    if (k == 3) amber__put16(c + at[k], (uint16_t)vals[k]);
    else amber__put32(c + at[k], vals[k]);
    reseal(c, len);
    CHECK(decode(c, len, msg, sizeof msg) == AMBER_ECORRUPT);
    CHECK(strstr(msg, "fit") != NULL || strstr(msg, "truncated") != NULL);
  }
  free(c);
  free(b);
}

static void test_shard_outside_its_tensor_or_unknown_rank_is_refused(void) {
  size_t len;
  uint8_t *b = sample(&len);
  char msg[1100];
  size_t shard0 = AMBER__MF_HEADER + 2 * AMBER__MF_RANK + AMBER__MF_TENSOR + 1 + 16;
  uint8_t *c = malloc(len);
  memcpy(c, b, len);
  amber__put64(c + shard0 + 8, 3); /* rows 3..4 of a 4-row tensor */
  reseal(c, len);
  CHECK(decode(c, len, msg, sizeof msg) == AMBER_ECORRUPT);
  CHECK(strstr(msg, "outside") != NULL);
  memcpy(c, b, len);
  amber__put32(c + shard0, 7); /* rank 7 of 2 */
  reseal(c, len);
  CHECK(decode(c, len, msg, sizeof msg) == AMBER_ECORRUPT);
  CHECK(strstr(msg, "rank 7") != NULL);
  free(c);
  free(b);
}

/* Shards that stay inside the tensor and whose volumes add up to it, but overlap
 * (and so leave part of it uncovered), or leave a gap: refused, naming the tensor,
 * and for an overlap both shards. */
static void test_overlapping_or_gapped_shards_are_refused(void) {
  size_t len;
  uint8_t *b = sample(&len);
  char msg[1100];
  size_t shard1 = AMBER__MF_HEADER + 2 * AMBER__MF_RANK + AMBER__MF_TENSOR + 1 + 16 + 40;
  uint8_t *c = malloc(len);
  memcpy(c, b, len);
  amber__put64(c + shard1 + 8, 0); /* rank 1's rows 2..3 moved onto rank 0's 0..1 */
  reseal(c, len);
  CHECK(decode(c, len, msg, sizeof msg) == AMBER_ECORRUPT);
  CHECK(strstr(msg, "M: tensor 'w'") && strstr(msg, "overlap") && strstr(msg, "rank 0") &&
        strstr(msg, "rank 1"));
  memcpy(c, b, len);
  amber__put64(c + shard1 + 24, 1); /* rank 1 holds one row: row 3 is nobody's */
  reseal(c, len);
  CHECK(decode(c, len, msg, sizeof msg) == AMBER_ECORRUPT);
  CHECK(strstr(msg, "tensor 'w'") && strstr(msg, "do not tile"));
  free(c);
  free(b);
}

/* The tiling check against random block grids of 1 to 3 dimensions, the blocks in
 * random order: every grid passes; moving one block onto another of the same
 * shape (the volumes still add up) is found, whichever dimensions the grid
 * splits. */
static void test_tiling_check_finds_any_overlap_in_block_grids(void) {
  uint64_t rs = 42;
  for (int trial = 0; trial < 300; trial++) {
    amber__mtensor t;
    memset(&t, 0, sizeof t);
    t.name = "t";
    t.ndim = 1 + (uint32_t)(tu_rand(&rs) % 3);
    int64_t parts[3] = {1, 1, 1}, len[3];
    uint32_t n = 1;
    for (uint32_t d = 0; d < t.ndim; d++) {
      parts[d] = 1 + (int64_t)(tu_rand(&rs) % 5);
      len[d] = 1 + (int64_t)(tu_rand(&rs) % 3);
      t.shape[d] = parts[d] * len[d];
      n *= (uint32_t)parts[d];
    }
    amber__mshard sh[125];
    memset(sh, 0, sizeof sh);
    for (uint32_t i = 0; i < n; i++) {
      uint32_t k = i;
      sh[i].rank = i;
      for (uint32_t d = 0; d < t.ndim; d++) {
        sh[i].off[d] = (int64_t)(k % (uint32_t)parts[d]) * len[d];
        sh[i].shape[d] = len[d];
        k /= (uint32_t)parts[d];
      }
    }
    for (uint32_t i = n; i > 1; i--) { /* shuffle */
      uint32_t j = (uint32_t)(tu_rand(&rs) % i);
      amber__mshard x = sh[i - 1];
      sh[i - 1] = sh[j], sh[j] = x;
    }
    t.nshards = n, t.shards = sh;
    char why[512];
    CHECK(amber__mtensor_check_tiling(&t, why, sizeof why) == 0);
    if (n < 2) continue;
    uint32_t a = (uint32_t)(tu_rand(&rs) % n), b = (uint32_t)(tu_rand(&rs) % (n - 1));
    b += b >= a;
    memcpy(sh[b].off, sh[a].off, sizeof sh[b].off);
    CHECK(amber__mtensor_check_tiling(&t, why, sizeof why) == AMBER_EMISMATCH);
    CHECK(strstr(why, "overlap") != NULL);
  }
}

/* A rank file's box table (FORMAT.md, "Many ranks"): round trip, sorted by name
 * for lookups; every truncation, a reserved byte, a repeated name refused. */
static void test_box_table_round_trips_and_malformed_tables_are_refused(void) {
  amber__box bx[2];
  memset(bx, 0, sizeof bx);
  bx[0].name = "w", bx[0].name_len = 1, bx[0].ndim = 2;
  bx[0].shape[0] = 4, bx[0].shape[1] = 3, bx[0].off[0] = 2;
  bx[1].name = "b", bx[1].name_len = 1, bx[1].ndim = 1, bx[1].shape[0] = 3;
  uint8_t *b = NULL;
  size_t len = 0;
  amber__err e;
  CHECK_OK(amber__boxes_encode(bx, 2, &e, &b, &len));
  CHECK(len == AMBER__BOXES_HEADER + (4 + 1 + 32) + (4 + 1 + 16));
  CHECK(b && !memcmp(b, "AMBERBX1", 8) && amber__get32(b + 8) == 2);
  amber__box *got = NULL;
  size_t n = 0;
  CHECK_OK(amber__boxes_decode(&e, "T", b, len, &got, &n));
  const amber__box *w = amber__boxes_find(got, n, "w");
  CHECK(n == 2 && w && w->ndim == 2 && w->shape[1] == 3 && w->off[0] == 2 && w->off[1] == 0);
  CHECK(amber__boxes_find(got, n, "x") == NULL);
  free(got);
  for (size_t k = 0; k < len; k++) {
    e.msg[0] = 0;
    CHECK(amber__boxes_decode(&e, "T", b, k, &got, &n) == AMBER_ECORRUPT);
    CHECK(strstr(e.msg, "T:") != NULL);
  }
  uint8_t *c = malloc(len + 1);
  memcpy(c, b, len);
  c[AMBER__BOXES_HEADER + 3] = 1; /* reserved byte of the first box */
  CHECK(amber__boxes_decode(&e, "T", c, len, &got, &n) == AMBER_ECORRUPT);
  memcpy(c, b, len);
  c[len] = 0; /* a byte after the last box */
  CHECK(amber__boxes_decode(&e, "T", c, len + 1, &got, &n) == AMBER_ECORRUPT);
  memcpy(c, b, len);
  c[AMBER__BOXES_HEADER + 4] = 'b'; /* "w" renamed "b": a name twice */
  CHECK(amber__boxes_decode(&e, "T", c, len, &got, &n) == AMBER_ECORRUPT);
  free(c);
  free(b);
}

static void test_newer_format_and_reserved_bits_are_refused(void) {
  size_t len;
  uint8_t *b = sample(&len);
  char msg[1100];
  uint8_t *c = malloc(len);
  memcpy(c, b, len);
  amber__put16(c + 10, AMBER_FORMAT_MINOR + 1);
  reseal(c, len);
  CHECK(decode(c, len, msg, sizeof msg) == AMBER_EFORMAT);
  memcpy(c, b, len);
  amber__put32(c + 12, 1);
  reseal(c, len);
  CHECK(decode(c, len, msg, sizeof msg) == AMBER_EFORMAT);
  free(c);
  free(b);
}

static void test_damaged_manifest_on_disk_names_the_file(void) {
  const char *d = tu_tmpdir();
  size_t len;
  uint8_t *b = sample(&len);
  char p[4200];
  amber__global_manifest_path(d, 5, p, sizeof p);
  b[len / 2] ^= 1;
  CHECK(tu_write_file(p, b, len) == 0);
  amber__err e;
  CHECK_OK(amber__global_write_latest(d, &e, 5));
  amber_global_reader *g = NULL;
  CHECK_RC(amber_global_reader_open(&g, d, AMBER_LATEST), AMBER_ECORRUPT);
  CHECK(strstr(amber_last_error(NULL), "step-00000000000000000005.manifest") != NULL);
  free(b);
}

static void write_corpus(const char *dir) {
  size_t len;
  uint8_t *b = sample(&len);
  char p[4200];
  snprintf(p, sizeof p, "%s/valid", dir);
  tu_write_file(p, b, len);
  snprintf(p, sizeof p, "%s/truncated", dir);
  tu_write_file(p, b, len / 2);
  b[70] ^= 0xff;
  snprintf(p, sizeof p, "%s/badsum", dir);
  tu_write_file(p, b, len);
  amber__put32(b + 32, 0xFFFFFFFFu);
  reseal(b, len);
  snprintf(p, sizeof p, "%s/hugeworld", dir);
  tu_write_file(p, b, len);
  free(b);
  amber__box bx;
  memset(&bx, 0, sizeof bx);
  bx.name = "w", bx.name_len = 1, bx.ndim = 2, bx.shape[0] = 4, bx.shape[1] = 3, bx.off[0] = 2;
  amber__err e;
  if (amber__boxes_encode(&bx, 1, &e, &b, &len) == 0) {
    snprintf(p, sizeof p, "%s/boxes", dir);
    tu_write_file(p, b, len);
    free(b);
  }
}

int main(void) {
  const char *corpus = getenv("AMBER_WRITE_CORPUS");
  if (corpus) write_corpus(corpus);
  TEST_RUN(test_valid_manifest_round_trips);
  TEST_RUN(test_several_shards_of_one_rank_make_minor_4_and_are_numbered);
  TEST_RUN(test_every_truncation_is_refused);
  TEST_RUN(test_flipped_byte_fails_the_checksum);
  TEST_RUN(test_huge_counts_are_refused_before_allocating);
  TEST_RUN(test_shard_outside_its_tensor_or_unknown_rank_is_refused);
  TEST_RUN(test_overlapping_or_gapped_shards_are_refused);
  TEST_RUN(test_tiling_check_finds_any_overlap_in_block_grids);
  TEST_RUN(test_box_table_round_trips_and_malformed_tables_are_refused);
  TEST_RUN(test_newer_format_and_reserved_bits_are_refused);
  TEST_RUN(test_damaged_manifest_on_disk_names_the_file);
  return tu_finish();
}

/*
 * test_manifest.c - the manifest parser against damaged and hostile manifests
 * (docs/FORMAT.md, "Many ranks"): every truncation, a flipped byte, counts far
 * beyond the file, shards outside their tensor, a newer format; each a clear
 * error and never a crash or a huge allocation. Also writes the fuzz corpus seeds
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
}

int main(void) {
  const char *corpus = getenv("AMBER_WRITE_CORPUS");
  if (corpus) write_corpus(corpus);
  TEST_RUN(test_valid_manifest_round_trips);
  TEST_RUN(test_every_truncation_is_refused);
  TEST_RUN(test_flipped_byte_fails_the_checksum);
  TEST_RUN(test_huge_counts_are_refused_before_allocating);
  TEST_RUN(test_shard_outside_its_tensor_or_unknown_rank_is_refused);
  TEST_RUN(test_newer_format_and_reserved_bits_are_refused);
  TEST_RUN(test_damaged_manifest_on_disk_names_the_file);
  return tu_finish();
}

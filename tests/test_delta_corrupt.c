/*
 * test_delta_corrupt.c - damage in a chain of deltas is detected (docs/DESIGN.md,
 * Guarantee 4): a flipped byte fails its step and every later one, naming the
 * file; a missing or substituted parent fails its children with AMBER_EPARENT.
 * A read fails exactly when verify does.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <unistd.h>

#include "trajectory.h"

/* Builds steps 1..6 of a store: a full, then deltas that change 10% of "w". With
 * `full_at`, that step is forced full. */
static void build_chain(const char *dir, uint64_t seed, uint64_t full_at) {
  small S;
  small_init(&S, seed);
  amber_writer_opts wo;
  tu_deltas_only(&wo, 1000);
  small_open(&S, dir, &wo);
  for (uint64_t s = 1; S.w && s <= 6; s++) {
    small_step(&S, 0.1);
    CHECK_OK(amber_writer_save(S.w, s, s == full_at ? AMBER_SAVE_FULL : 0));
  }
  small_close(&S);
}

static void ckpt_file(const char *dir, uint64_t step, char *out, size_t cap) {
  snprintf(out, cap, "%s/ckpt-%020" PRIu64 ".amber", dir, step);
}

/* Opens `step` and verifies it; returns the first failure (open or verify). */
static int open_verify(amber_store *st, uint64_t step, char *msg, size_t cap) {
  amber_reader *r = NULL;
  int rc = amber_reader_open(&r, st, step, NULL);
  if (rc == 0) {
    rc = amber_reader_verify(r);
    float buf[4000];
    int rd = amber_reader_read(r, 0, buf, sizeof buf);
    CHECK(rd == rc); /* a read fails exactly when verify does */
    snprintf(msg, cap, "%s", amber_last_error(r));
  } else {
    snprintf(msg, cap, "%s", amber_last_error(NULL));
  }
  amber_reader_close(r);
  return rc;
}

static void test_flipped_byte_in_delta_fails_it_and_later_steps(void) {
  const char *dir = tu_tmpdir();
  build_chain(dir, 1000, 0);
  char path[4200], msg[2048];
  ckpt_file(dir, 3, path, sizeof path);
  CHECK(tu_flip_byte(path, TU_MIDDLE, 0x10) == 0);
  amber_store *st = tu_open_ro(dir);
  for (uint64_t s = 1; st && s <= 6; s++) {
    int rc = open_verify(st, s, msg, sizeof msg);
    if (s < 3) {
      CHECK_OK(rc);
    } else {
      CHECK_RC(rc, AMBER_ECORRUPT);
      CHECK(strstr(msg, "ckpt-00000000000000000003.amber") != NULL);
      if (!strstr(msg, "ckpt-00000000000000000003.amber"))
        DETAIL("step %" PRIu64 ": message does not name the damaged file: %s\n", s, msg);
    }
  }
  amber_store_close(st);
}

static void test_missing_parent_fails_children_with_eparent(void) {
  const char *dir = tu_tmpdir();
  build_chain(dir, 1010, 0);
  char path[4200], msg[2048];
  ckpt_file(dir, 3, path, sizeof path);
  CHECK(unlink(path) == 0);
  amber_store *st = tu_open_ro(dir);
  for (uint64_t s = 1; st && s <= 6; s++) {
    int rc = open_verify(st, s, msg, sizeof msg);
    if (s < 3) {
      CHECK_OK(rc);
    } else if (s == 3) {
      CHECK(rc < 0 && strstr(msg, "step 3") != NULL);
    } else {
      CHECK_RC(rc, AMBER_EPARENT);
      CHECK(strstr(msg, "parent step 3") != NULL);
      if (!strstr(msg, "parent step 3")) DETAIL("message for step %" PRIu64 ": %s\n", s, msg);
    }
  }
  amber_store_close(st);
}

static void test_substituted_parent_fails_children_with_eparent(void) {
  /* B's step 3 is a full (self-contained) or a delta on B's own step 2; either way
   * it is not the step 3 that A's step 4 was computed against. */
  for (int c = 0; c < 2; c++) {
    const char *a = tu_tmpdir(), *b = tu_tmpdir();
    build_chain(a, 1020, 0);
    build_chain(b, 1030, c ? 0 : 3);
    char pa[4200], pb[4200], msg[2048];
    ckpt_file(a, 3, pa, sizeof pa);
    ckpt_file(b, 3, pb, sizeof pb);
    size_t len = 0;
    uint8_t *buf = tu_read_file(pb, &len);
    CHECK(buf && tu_write_file(pa, buf, len) == 0);
    free(buf);
    amber_store *st = tu_open_ro(a);
    for (uint64_t s = 1; st && s <= 6; s++) {
      int rc = open_verify(st, s, msg, sizeof msg);
      if (s < 3) CHECK_OK(rc);
      else if (s == 3) CHECK_RC(rc, c ? AMBER_EPARENT : 0); /* B's delta names B's step 2 */
      else CHECK_RC(rc, AMBER_EPARENT);
      if (s >= 4) CHECK(strstr(msg, "ckpt-00000000000000000003.amber") != NULL);
    }
    amber_store_close(st);
  }
}

int main(void) {
  TEST_RUN(test_flipped_byte_in_delta_fails_it_and_later_steps);
  TEST_RUN(test_missing_parent_fails_children_with_eparent);
  TEST_RUN(test_substituted_parent_fails_children_with_eparent);
  return tu_finish();
}

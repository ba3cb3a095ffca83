/*
 * test_mapped_read.c - reads of a store on a memory file system (a memory tier),
 * whose files the reader maps and copies from, checking each block as it copies
 * (src/ckpt.c, copy_checked): every step of a chain (a full, then deltas) restores
 * bit-identical whole tensors into destinations at every alignment, boxes straight
 * into place and through a worker's buffer, and a tensor whose last chunk is not a
 * whole number of blocks; a flipped payload byte fails the read and verify with
 * AMBER_ECORRUPT, naming the file, for its step and every delta on it. Skipped
 * (exit 77) where there is no /dev/shm.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

enum { ROWS = 1001, COLS = 333, N = ROWS * COLS, CHUNK = 70001, NB = 77, STEPS = 4 };

static const char *dir;
static float want_m[STEPS + 1][N]; /* the values each step saved */
static uint8_t want_b[STEPS + 1][NB];
static double want_s[STEPS + 1];

/* Steps 1..STEPS of a store in `dir`: a full, then deltas (a tenth of "m" changed,
 * then all of it, then a few elements), chunks of CHUNK elements (280004 bytes: no
 * whole number of copy blocks, nor of 64 bytes), "b" and "s" chunks of a few bytes. */
static void build(void) {
  static float m[N];
  uint8_t b[NB];
  double s = 1.5;
  uint64_t rng = 42;
  tu_fill_random(m, sizeof m, 1);
  for (int i = 0; i < N; i++) m[i] = (float)(m[i] != m[i] ? 0.0f : m[i]);
  tu_fill_random(b, sizeof b, 2);
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, dir, NULL));
  amber_writer_opts wo;
  tu_deltas_only(&wo, CHUNK);
  amber_writer *w = NULL;
  if (st) CHECK_OK(amber_writer_open(&w, st, &wo));
  if (!w) {
    amber_store_close(st);
    return;
  }
  int64_t ms[2] = {ROWS, COLS}, bs[1] = {NB};
  CHECK_OK(amber_writer_add(w, "m", AMBER_F32, 2, ms, m, NULL));
  CHECK_OK(amber_writer_add(w, "b", AMBER_U8, 1, bs, b, NULL));
  CHECK_OK(amber_writer_add(w, "s", AMBER_F64, 0, NULL, &s, NULL));
  for (int step = 1; step <= STEPS; step++) {
    if (step == 2)
      for (int i = 0; i < N / 10; i++) m[tu_rand(&rng) % N] += 0.25f;
    if (step == 3)
      for (int i = 0; i < N; i++) m[i] = (float)(tu_rand(&rng) % 100000) / 7.0f;
    if (step == 4) {
      m[0] = -1.0f, m[N - 1] = 3.0f, m[CHUNK] = 9.0f;
      b[NB - 1] ^= 0xff;
    }
    s += step;
    CHECK_OK(amber_writer_save(w, (uint64_t)step, 0));
    memcpy(want_m[step], m, sizeof m);
    memcpy(want_b[step], b, sizeof b);
    want_s[step] = s;
  }
  amber_writer_close(w);
  amber_store_close(st);
}

static void ckpt_file(uint64_t step, char *out, size_t cap) {
  snprintf(out, cap, "%s/ckpt-%020" PRIu64 ".amber", dir, step);
}

/* Whole tensors of `step` into destinations `align` bytes past an aligned address. */
static void check_whole(amber_reader *r, int step, size_t align) {
  size_t cap = (N * sizeof(float) + NB + 8 + 3 * 64 + 63) & ~(size_t)63; /* C11 asks it */
  uint8_t *mem = aligned_alloc(64, cap);
  if (!mem) {
    CHECK(mem != NULL);
    return;
  }
  uint8_t *pm = mem + align, *pb = pm + N * sizeof(float) + align, *ps = pb + NB + align;
  size_t idx[3] = {0, 1, 2};
  void *bufs[3] = {pm, pb, ps};
  uint64_t sizes[3] = {N * sizeof(float), NB, 8};
  CHECK_OK(amber_reader_read_many(r, 3, idx, bufs, sizes));
  int same = !memcmp(pm, want_m[step], sizes[0]) && !memcmp(pb, want_b[step], NB) &&
             !memcmp(ps, &want_s[step], 8);
  CHECK(same);
  if (!same) fprintf(stderr, "step %d, destination %zu bytes past alignment: other bytes\n", step, align);
  free(mem);
}

/* Box (r0, c0, nr, nc) of "m" of `step`. */
static void check_box(amber_reader *r, int step, int r0, int c0, int nr, int nc) {
  float *got = malloc((size_t)nr * nc * sizeof *got);
  if (!got) {
    CHECK(got != NULL);
    return;
  }
  size_t idx = 0;
  int64_t off[AMBER_MAX_DIMS] = {r0, c0}, shape[AMBER_MAX_DIMS] = {nr, nc};
  void *buf = got;
  uint64_t size = (uint64_t)nr * nc * sizeof *got;
  CHECK_OK(amber_reader_read_boxes(r, 1, &idx, off, shape, &buf, &size));
  int bad = 0;
  for (int i = 0; i < nr && !bad; i++)
    bad = memcmp(got + (size_t)i * nc, want_m[step] + (size_t)(r0 + i) * COLS + c0,
                 (size_t)nc * sizeof *got) != 0;
  CHECK(!bad);
  if (bad) fprintf(stderr, "step %d, box (%d, %d) of %dx%d: other values\n", step, r0, c0, nr, nc);
  free(got);
}

static void test_every_step_reads_exact_from_a_memory_fs(void) {
  amber_store *st = tu_open_ro(dir);
  for (int step = 1; st && step <= STEPS; step++) {
    amber_reader *r = NULL;
    CHECK_OK(amber_reader_open(&r, st, (uint64_t)step, NULL));
    if (!r) continue;
    const size_t aligns[] = {0, 1, 3, 8, 15, 17, 63};
    for (size_t k = 0; k < sizeof aligns / sizeof *aligns; k++) check_whole(r, step, aligns[k]);
    /* whole rows: the chunks inside go straight to their place (unaligned), the
     * others through a worker's buffer */
    check_box(r, step, 10, 0, 690, COLS);
    check_box(r, step, 7, 5, 100, 200);   /* every chunk through a worker's buffer */
    check_box(r, step, ROWS - 1, COLS - 3, 1, 3);
    CHECK_OK(amber_reader_verify(r));
    amber_reader_close(r);
  }
  amber_store_close(st);
}

static void test_a_flipped_payload_byte_fails_reads_and_verify(void) {
  char path[4200];
  ckpt_file(1, path, sizeof path);
  CHECK(tu_flip_byte(path, TU_MIDDLE, 0x20) == 0); /* the full's raw payload of "m" */
  amber_store *st = tu_open_ro(dir);
  float *buf = malloc(N * sizeof *buf);
  for (int step = 1; st && buf && step <= STEPS; step++) {
    amber_reader *r = NULL;
    CHECK_OK(amber_reader_open(&r, st, (uint64_t)step, NULL));
    if (!r) continue;
    CHECK_RC(amber_reader_read(r, 0, buf, N * sizeof *buf), AMBER_ECORRUPT);
    const char *msg = amber_last_error(r);
    int named = strstr(msg, "ckpt-00000000000000000001.amber") != NULL;
    CHECK(named);
    if (!named) fprintf(stderr, "step %d: the message does not name the full: %s\n", step, msg);
    CHECK_RC(amber_reader_verify(r), AMBER_ECORRUPT);
    amber_reader_close(r);
  }
  free(buf);
  amber_store_close(st);
}

int main(void) {
  dir = tu_memdir();
  if (!dir) {
    printf("skipped: no memory file system at /dev/shm\n");
    return 77;
  }
  build();
  TEST_RUN(test_every_step_reads_exact_from_a_memory_fs);
  TEST_RUN(test_a_flipped_payload_byte_fails_reads_and_verify);
  return tu_finish();
}

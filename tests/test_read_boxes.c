/*
 * test_read_boxes.c - the load path's box reads (src/reader.c, amber__read_parts):
 * amber_reader_read_boxes on a single-rank store and amber_global_reader_read_many
 * on a 3-rank store, both with chunks that cut rows, shards and boxes anywhere
 * (chunk_elems 7 and 5), a full checkpoint and deltas in the chain, and random
 * boxes of tensors of 0 to 4 dimensions read in one call each: every element equals
 * what the state held, whether its chunk was decoded straight into the buffer or
 * aside and copied. A damaged chunk fails the read with the file and the rank named.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "amber.h"
#include "comm_threads.h"
#include "format.h"
#include "io.h"
#include "store.h"
#include "testutil.h"

#define NT 5
#define STEPS 3

/* Tensors: name, dtype, ndim, shape. */
static const struct {
  const char *name;
  int dtype;
  uint32_t ndim;
  int64_t shape[4];
} T[NT] = {
    {"scalar", AMBER_F32, 0, {0}},
    {"vec", AMBER_F64, 1, {23}},
    {"mat", AMBER_F32, 2, {9, 11}},
    {"cube", AMBER_I32, 3, {4, 5, 6}},
    {"four", AMBER_F32, 4, {3, 2, 5, 4}},
};

static int64_t nelems(int t) {
  int64_t n = 1;
  for (uint32_t d = 0; d < T[t].ndim; d++) n *= T[t].shape[d];
  return n;
}

/* Element k of tensor t at a step: a third of the elements change per step, so
 * later steps are deltas. */
static double val(int t, int64_t k, uint64_t step) {
  return (double)k * 0.25 + t * 100 + ((k % 3) == (int64_t)(step % 3) ? (double)step : 0.0);
}

static void fill(int t, void *buf, const int64_t *off, const int64_t *shape, uint64_t step) {
  int64_t n = 1, idx[4] = {0};
  for (uint32_t d = 0; d < T[t].ndim; d++) n *= shape[d];
  for (int64_t i = 0; i < n; i++) {
    int64_t k = 0;
    for (uint32_t d = 0; d < T[t].ndim; d++) k = k * T[t].shape[d] + off[d] + idx[d];
    double v = val(t, k, step);
    if (T[t].dtype == AMBER_F64) ((double *)buf)[i] = v;
    else if (T[t].dtype == AMBER_I32) ((int32_t *)buf)[i] = (int32_t)(v * 4);
    else ((float *)buf)[i] = (float)v;
    for (int d = (int)T[t].ndim - 1; d >= 0; d--) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
}

/* A random box of tensor t (sometimes the whole tensor, sometimes empty). */
static void random_box(int t, uint64_t *rng, int64_t *off, int64_t *shape) {
  int whole = tu_rand(rng) % 5 == 0;
  for (uint32_t d = 0; d < T[t].ndim; d++) {
    int64_t len = T[t].shape[d];
    off[d] = whole ? 0 : (int64_t)(tu_rand(rng) % (uint64_t)(len + 1));
    shape[d] = whole ? len : (int64_t)(tu_rand(rng) % (uint64_t)(len - off[d] + 1));
  }
}

/* Reads `nbox` random boxes of random tensors through `read` (one call) and checks
 * every element against the state of `step`. */
typedef int (*read_fn)(void *h, size_t n, const size_t *idx, const int64_t *off,
                       const int64_t *shape, void *const *bufs, const uint64_t *sizes);

static void check_boxes(void *h, read_fn read, const size_t *index, uint64_t step, uint64_t seed,
                        int nbox) {
  uint64_t rng = seed;
  size_t idx[64];
  int which[64];
  int64_t off[64 * AMBER_MAX_DIMS] = {0}, shape[64 * AMBER_MAX_DIMS] = {0};
  void *bufs[64], *want[64];
  uint64_t sizes[64];
  for (int i = 0; i < nbox; i++) {
    int t = (int)(tu_rand(&rng) % NT);
    which[i] = t;
    idx[i] = index[t];
    random_box(t, &rng, off + i * AMBER_MAX_DIMS, shape + i * AMBER_MAX_DIMS);
    uint64_t n = 1;
    for (uint32_t d = 0; d < T[t].ndim; d++) n *= (uint64_t)shape[i * AMBER_MAX_DIMS + d];
    sizes[i] = n * amber_dtype_size(T[t].dtype);
    bufs[i] = malloc(sizes[i] + 1);
    want[i] = malloc(sizes[i] + 1);
    memset(bufs[i], 0xA5, sizes[i]); /* poison: every byte must be written */
    fill(t, want[i], off + i * AMBER_MAX_DIMS, shape + i * AMBER_MAX_DIMS, step);
  }
  CHECK_OK(read(h, (size_t)nbox, idx, off, shape, bufs, sizes));
  for (int i = 0; i < nbox; i++) {
    if (memcmp(bufs[i], want[i], sizes[i]) != 0) {
      fprintf(stderr, "box %d of tensor %s differs (seed %llu)\n", i, T[which[i]].name,
              (unsigned long long)seed);
      tu_failures++;
    }
    free(bufs[i]);
    free(want[i]);
  }
}

static int reader_boxes(void *h, size_t n, const size_t *idx, const int64_t *off,
                        const int64_t *shape, void *const *bufs, const uint64_t *sizes) {
  return amber_reader_read_boxes(h, n, idx, off, shape, bufs, sizes);
}

static int global_boxes(void *h, size_t n, const size_t *idx, const int64_t *off,
                        const int64_t *shape, void *const *bufs, const uint64_t *sizes) {
  return amber_global_reader_read_many(h, n, idx, off, shape, bufs, sizes);
}

static void single_store_boxes_of_a_chain(void) {
  const char *dir = tu_tmpdir();
  char path[4200];
  snprintf(path, sizeof path, "%s/s", dir);
  amber_store *st;
  amber_writer *w;
  CHECK_OK(amber_store_open(&st, path, NULL));
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.chunk_elems = 7; /* rows, boxes and chunks cut each other anywhere */
  wo.full_share = -1;
  CHECK_OK(amber_writer_open(&w, st, &wo));
  void *data[NT];
  int64_t zero[4] = {0};
  for (int t = 0; t < NT; t++) {
    data[t] = malloc((size_t)nelems(t) * 8 + 1);
    CHECK_OK(amber_writer_add(w, T[t].name, T[t].dtype, T[t].ndim, T[t].shape, data[t], NULL));
  }
  for (uint64_t s = 1; s <= STEPS; s++) {
    for (int t = 0; t < NT; t++) fill(t, data[t], zero, T[t].shape, s);
    CHECK_OK(amber_writer_save(w, s, 0));
  }
  amber_writer_close(w);
  amber_reader *r;
  CHECK_OK(amber_reader_open(&r, st, AMBER_LATEST, NULL));
  amber_ckpt_info ci;
  CHECK_OK(amber_reader_ckpt_info(r, &ci));
  CHECK(ci.kind == AMBER_KIND_DELTA); /* a chain: full + 2 deltas */
  size_t index[NT];
  for (int t = 0; t < NT; t++) CHECK_OK(amber_reader_find(r, T[t].name, &index[t]));
  for (uint64_t seed = 1; seed <= 40; seed++) check_boxes(r, reader_boxes, index, STEPS, seed, 12);
  /* whole tensors through read_many: straight into the buffers */
  void *bufs[NT];
  uint64_t sizes[NT];
  for (int t = 0; t < NT; t++) {
    sizes[t] = (uint64_t)nelems(t) * amber_dtype_size(T[t].dtype);
    bufs[t] = malloc(sizes[t] + 1);
  }
  CHECK_OK(amber_reader_read_many(r, NT, index, bufs, sizes));
  for (int t = 0; t < NT; t++) {
    fill(t, data[t], zero, T[t].shape, STEPS);
    CHECK(memcmp(bufs[t], data[t], sizes[t]) == 0);
  }
  /* a box outside the tensor, or a buffer of the wrong size, is refused */
  int64_t off[AMBER_MAX_DIMS] = {5, 0}, shape[AMBER_MAX_DIMS] = {5, 11};
  CHECK_RC(amber_reader_read_boxes(r, 1, &index[2], off, shape, bufs, sizes), AMBER_ERANGE);
  off[0] = 0;
  CHECK_RC(amber_reader_read_boxes(r, 1, &index[2], off, shape, bufs, sizes), AMBER_EINVAL);
  amber_reader_close(r);
  /* damage a chunk of the full checkpoint that a box needs: the read fails naming it */
  char file[4300];
  snprintf(file, sizeof file, "%s/ckpt-%020d.amber", path, 1);
  amber_store_close(st);
  uint64_t at = 0;
  {
    amber_store_opts so;
    amber_store_opts_init(&so);
    so.flags = AMBER_OPEN_READONLY;
    amber_store *s1;
    amber_reader *r1;
    CHECK_OK(amber_store_open(&s1, path, &so));
    CHECK_OK(amber_reader_open(&r1, s1, 1, NULL));
    size_t i;
    CHECK_OK(amber_reader_find(r1, "mat", &i));
    const amber__index *ix = amber__reader_index(r1);
    at = ix->chunks[ix->tensors[i].first_chunk + 3].offset; /* elements 21..27: rows 1-2 */
    amber_reader_close(r1);
    amber_store_close(s1);
  }
  CHECK(tu_flip_byte(file, (long)at + 2, 0x10) == 0);
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY;
  CHECK_OK(amber_store_open(&st, path, &so));
  CHECK_OK(amber_reader_open(&r, st, AMBER_LATEST, NULL));
  int64_t o2[AMBER_MAX_DIMS] = {2, 3}, s2[AMBER_MAX_DIMS] = {1, 2}; /* elements 25, 26 */
  float got[2];
  uint64_t gsz = sizeof got;
  void *gp = got;
  CHECK_RC(amber_reader_read_boxes(r, 1, &index[2], o2, s2, &gp, &gsz), AMBER_ECORRUPT);
  CHECK(strstr(amber_last_error(r), "ckpt-00000000000000000001.amber") != NULL);
  CHECK(strstr(amber_last_error(r), "checksum") != NULL);
  o2[0] = 0; /* a box that needs other chunks only reads */
  CHECK_OK(amber_reader_read_boxes(r, 1, &index[2], o2, s2, &gp, &gsz));
  amber_reader_close(r);
  amber_store_close(st);
  for (int t = 0; t < NT; t++) free(data[t]), free(bufs[t]);
}

static void test_single_store_boxes_of_a_chain(void) {
  single_store_boxes_of_a_chain();
}

/* The same where O_DIRECT is refused: every payload read buffered, the same results
 * and the same error for the damaged chunk. */
static void test_single_store_boxes_of_a_chain_without_o_direct(void) {
  amber__io_direct_reads(0);
  single_store_boxes_of_a_chain();
  amber__io_direct_reads(1);
}

/* Payloads of 4 MiB (a full checkpoint's raw chunks): read with O_DIRECT where the
 * file system allows it, buffered when it is refused; boxes across chunk edges and a
 * damaged chunk read the same either way. */
static void large_chunks(int direct) {
  amber__io_direct_reads(direct);
  char path[4200];
  snprintf(path, sizeof path, "%s/large%d", tu_tmpdir(), direct);
  const int64_t rows = 3000, cols = 1000; /* 3M f32: chunks of 1M elements, 1000-element rows */
  float *x = malloc((size_t)(rows * cols) * sizeof *x);
  for (int64_t i = 0; i < rows * cols; i++) x[i] = (float)i;
  amber_store *st;
  amber_writer *w;
  int64_t shape[2] = {rows, cols};
  CHECK_OK(amber_store_open(&st, path, NULL));
  CHECK_OK(amber_writer_open(&w, st, NULL));
  CHECK_OK(amber_writer_add(w, "x", AMBER_F32, 2, shape, x, NULL));
  CHECK_OK(amber_writer_save(w, 1, AMBER_SAVE_FULL));
  amber_writer_close(w);
  amber_reader *r;
  CHECK_OK(amber_reader_open(&r, st, 1, NULL));
  size_t xi = 0;
  /* rows 1040..1060 (across the first chunk edge at element 1048576) */
  int64_t off[AMBER_MAX_DIMS] = {1040, 0}, n[AMBER_MAX_DIMS] = {20, 1000};
  float *got = malloc(20 * 1000 * sizeof *got);
  void *gp = got;
  uint64_t sz = 20 * 1000 * sizeof *got;
  CHECK_OK(amber_reader_read_boxes(r, 1, &xi, off, n, &gp, &sz));
  CHECK(memcmp(got, x + 1040 * 1000, sz) == 0);
  float *all = malloc((size_t)(rows * cols) * sizeof *all);
  uint64_t asz = (uint64_t)(rows * cols) * sizeof *all;
  CHECK_OK(amber_reader_read(r, xi, all, asz));
  CHECK(memcmp(all, x, asz) == 0);
  uint64_t at = amber__reader_index(r)->chunks[1].offset; /* chunk 1: elements 1M..2M */
  amber_reader_close(r);
  amber_store_close(st);
  char file[4300];
  snprintf(file, sizeof file, "%s/ckpt-%020d.amber", path, 1);
  CHECK(tu_flip_byte(file, (long)at + 4096 * 3 + 17, 0x08) == 0);
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY;
  CHECK_OK(amber_store_open(&st, path, &so));
  CHECK_OK(amber_reader_open(&r, st, 1, NULL));
  CHECK_RC(amber_reader_read(r, xi, all, asz), AMBER_ECORRUPT);
  CHECK(strstr(amber_last_error(r), "checksum mismatch") != NULL);
  CHECK_RC(amber_reader_read_boxes(r, 1, &xi, off, n, &gp, &sz), AMBER_ECORRUPT);
  off[0] = 0; /* rows of chunk 0 only: intact */
  CHECK_OK(amber_reader_read_boxes(r, 1, &xi, off, n, &gp, &sz));
  CHECK(memcmp(got, x, sz) == 0);
  CHECK_RC(amber_reader_verify(r), AMBER_ECORRUPT);
  amber_reader_close(r);
  amber_store_close(st);
  free(x), free(got), free(all);
  amber__io_direct_reads(1);
}

static void test_large_chunks_with_o_direct(void) {
  large_chunks(1);
}

static void test_large_chunks_buffered(void) {
  large_chunks(0);
}

/* ---- a global store: "mat" split by rows, "cube" by dim 1, "four" by dim 2 over 3
 * ranks (uneven), "vec" and "scalar" replicated ---- */

static const char *gpath;

static void split(int t, int rank, int n, int64_t *off, int64_t *shape) {
  int dim = t == 2 ? 0 : t == 3 ? 1 : 2;
  for (uint32_t d = 0; d < T[t].ndim; d++) off[d] = 0, shape[d] = T[t].shape[d];
  int64_t len = T[t].shape[dim];
  off[dim] = len * rank / n;
  shape[dim] = len * (rank + 1) / n - off[dim];
}

static void rank_main(const amber_comm *c, void *arg) {
  (void)arg;
  amber_global_writer *gw;
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.chunk_elems = 5;
  wo.full_share = -1;
  RCHECK(amber_global_writer_open(&gw, gpath, c, &wo) == 0);
  void *data[NT];
  int64_t off[NT][4], shape[NT][4];
  for (int t = 0; t < NT; t++) {
    int repl = t < 2;
    if (repl)
      for (uint32_t d = 0; d < T[t].ndim; d++) off[t][d] = 0, shape[t][d] = T[t].shape[d];
    else
      split(t, c->rank, c->size, off[t], shape[t]);
    data[t] = malloc((size_t)nelems(t) * 8 + 1);
    RCHECK(amber_global_writer_add(gw, T[t].name, T[t].dtype, T[t].ndim, T[t].shape,
                                   repl ? NULL : off[t], repl ? NULL : shape[t], data[t],
                                   repl ? AMBER_SHARD_REPLICATED : 0) == 0);
  }
  for (uint64_t s = 1; s <= STEPS; s++) {
    for (int t = 0; t < NT; t++) fill(t, data[t], off[t], shape[t], s);
    RCHECK(amber_global_writer_save(gw, s, 0) == 0);
  }
  amber_global_writer_close(gw);
  for (int t = 0; t < NT; t++) free(data[t]);
}

static void test_global_boxes_across_shards_in_one_call(void) {
  char path[4200];
  snprintf(path, sizeof path, "%s/g", tu_tmpdir());
  gpath = path;
  atomic_store(&rank_fails, 0);
  tc_run(3, rank_main, NULL);
  CHECK(atomic_load(&rank_fails) == 0);
  amber_global_reader *g;
  CHECK_OK(amber_global_reader_open(&g, path, AMBER_LATEST));
  if (!g) return;
  size_t index[NT];
  for (int t = 0; t < NT; t++) CHECK_OK(amber_global_reader_find(g, T[t].name, &index[t]));
  for (uint64_t seed = 100; seed < 140; seed++) check_boxes(g, global_boxes, index, STEPS, seed, 16);
  /* this rank's own box at another world size (2), every tensor in one call, as a load does */
  for (int r = 0; r < 2; r++) {
    size_t idx[NT];
    int64_t off[NT * AMBER_MAX_DIMS] = {0}, shape[NT * AMBER_MAX_DIMS] = {0};
    void *bufs[NT], *want[NT];
    uint64_t sizes[NT];
    for (int t = 0; t < NT; t++) {
      idx[t] = index[t];
      if (t < 2)
        for (uint32_t d = 0; d < T[t].ndim; d++) shape[t * AMBER_MAX_DIMS + d] = T[t].shape[d];
      else
        split(t, r, 2, off + t * AMBER_MAX_DIMS, shape + t * AMBER_MAX_DIMS);
      uint64_t n = 1;
      for (uint32_t d = 0; d < T[t].ndim; d++) n *= (uint64_t)shape[t * AMBER_MAX_DIMS + d];
      sizes[t] = n * amber_dtype_size(T[t].dtype);
      bufs[t] = malloc(sizes[t] + 1);
      want[t] = malloc(sizes[t] + 1);
      fill(t, want[t], off + t * AMBER_MAX_DIMS, shape + t * AMBER_MAX_DIMS, STEPS);
    }
    CHECK_OK(amber_global_reader_read_many(g, NT, idx, off, shape, bufs, sizes));
    for (int t = 0; t < NT; t++) {
      CHECK(memcmp(bufs[t], want[t], sizes[t]) == 0);
      free(bufs[t]), free(want[t]);
    }
  }
  amber_global_reader_close(g);
  /* a damaged chunk of rank 1's full checkpoint: the read names the tensor, the rank
   * and the file */
  char rank1[4300], file[4400];
  snprintf(rank1, sizeof rank1, "%s/rank-00001", path);
  snprintf(file, sizeof file, "%s/ckpt-%020d.amber", rank1, 1);
  uint64_t at = 0;
  {
    amber_store_opts so;
    amber_store_opts_init(&so);
    so.flags = AMBER_OPEN_READONLY;
    amber_store *s1;
    amber_reader *r1;
    CHECK_OK(amber_store_open(&s1, rank1, &so));
    CHECK_OK(amber_reader_open(&r1, s1, 1, NULL));
    size_t i;
    CHECK_OK(amber_reader_find(r1, "mat", &i));
    at = amber__reader_index(r1)->chunks[amber__reader_index(r1)->tensors[i].first_chunk].offset;
    amber_reader_close(r1);
    amber_store_close(s1);
  }
  CHECK(at > 0 && tu_flip_byte(file, (long)at, 0x01) == 0);
  CHECK_OK(amber_global_reader_open(&g, path, AMBER_LATEST));
  size_t mi = index[2];
  int64_t off[AMBER_MAX_DIMS] = {0, 0}, shape[AMBER_MAX_DIMS] = {9, 11};
  float *buf = malloc(9 * 11 * sizeof *buf);
  void *bp = buf;
  uint64_t sz = 9 * 11 * sizeof *buf;
  CHECK_RC(amber_global_reader_read_many(g, 1, &mi, off, shape, &bp, &sz), AMBER_ECORRUPT);
  const char *msg = amber_last_error(g);
  CHECK(strstr(msg, "tensor 'mat'") != NULL && strstr(msg, "rank 1") != NULL &&
        strstr(msg, "rank-00001/ckpt-00000000000000000001.amber") != NULL);
  CHECK_RC(amber_global_reader_read(g, mi, off, shape, buf, sz), AMBER_ECORRUPT);
  shape[0] = 3; /* rank 0's rows only: intact */
  sz = 3 * 11 * sizeof *buf;
  CHECK_OK(amber_global_reader_read_many(g, 1, &mi, off, shape, &bp, &sz));
  CHECK_RC(amber_global_reader_verify(g), AMBER_ECORRUPT);
  free(buf);
  amber_global_reader_close(g);
}

int main(void) {
  TEST_RUN(test_single_store_boxes_of_a_chain);
  TEST_RUN(test_single_store_boxes_of_a_chain_without_o_direct);
  TEST_RUN(test_large_chunks_with_o_direct);
  TEST_RUN(test_large_chunks_buffered);
  TEST_RUN(test_global_boxes_across_shards_in_one_call);
  return tu_finish();
}

/*
 * test_mpi_global.c - many-rank saves over real MPI processes (libamber_mpi): each
 * rank writes its rows of "w" and rank 0 the replicated "b", for steps 1..4 (even
 * steps as split saves); step 3 fails on the last rank (its file's name is
 * blocked), which every rank must report; then every rank reads the latest step
 * back at another sharding (columns) and checks it bit-exactly. Run by run.sh
 * under mpirun; exits non-zero on any failure.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "amber_mpi.h"

#define ROWS 16
#define COLS 6

static int fails;
#define CHK(c)                                                                        \
  do {                                                                                \
    if (!(c)) {                                                                       \
      fprintf(stderr, "rank %d: %s:%d: %s (%s)\n", me, __FILE__, __LINE__, #c,         \
              amber_last_error(NULL));                                                \
      fails++;                                                                        \
    }                                                                                 \
  } while (0)

static float val(int64_t i, int64_t j, uint64_t s) {
  return (float)(i * COLS + j) + ((i + j) % 3 == (int64_t)(s % 3) ? 0.5f * (float)s : 0.0f);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int me, n;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  if (argc < 2) return 2;
  const char *path = argv[1];
  amber_comm comm;
  CHK(amber_mpi_comm_init(&comm, MPI_COMM_WORLD) == 0);
  amber_global_writer *gw = NULL;
  CHK(amber_global_writer_open(&gw, path, &comm, NULL) == 0);
  if (!gw) MPI_Abort(MPI_COMM_WORLD, 1);
  int64_t g[2] = {ROWS, COLS}, off[2] = {ROWS * me / n, 0},
          sh[2] = {ROWS * (me + 1) / n - ROWS * me / n, COLS}, bs[1] = {3};
  float *w = malloc((size_t)(sh[0] * COLS) * sizeof *w + 1), b[3];
  CHK(amber_global_writer_add(gw, "w", AMBER_F32, 2, g, off, sh, w, 0) == 0);
  CHK(amber_global_writer_add(gw, "b", AMBER_F32, 1, bs, NULL, NULL, b,
                              AMBER_SHARD_REPLICATED) == 0);
  char block[4200];
  snprintf(block, sizeof block, "%s/rank-%05d/ckpt-%020d.amber", path, n - 1, 3);
  for (uint64_t s = 1; s <= 4; s++) {
    for (int64_t i = 0; i < sh[0]; i++)
      for (int64_t j = 0; j < COLS; j++) w[i * COLS + j] = val(off[0] + i, j, s);
    for (int i = 0; i < 3; i++) b[i] = (float)s * (float)(i + 1);
    if (s == 3 && me == n - 1) mkdir(block, 0755);
    MPI_Barrier(MPI_COMM_WORLD);
    int rc;
    if (s % 2) {
      rc = amber_global_writer_save(gw, s, 0);
    } else {
      rc = amber_global_writer_begin(gw, s, 0);
      CHK(amber_global_writer_fence(gw) == 0);
      if (rc == 0) rc = amber_global_writer_wait(gw);
    }
    if (s == 3) {
      char want[32];
      snprintf(want, sizeof want, "rank %d failed", n - 1);
      CHK(rc < 0 && strstr(amber_last_error(gw), want));
      if (me == n - 1) rmdir(block);
    } else {
      CHK(rc == 0);
    }
  }
  amber_global_writer_close(gw);
  MPI_Barrier(MPI_COMM_WORLD);
  /* Read back by columns: rank r reads columns [r*COLS/n, (r+1)*COLS/n). */
  amber_global_reader *rd = NULL;
  CHK(amber_global_reader_open(&rd, path, AMBER_LATEST) == 0);
  if (rd) {
    CHK(amber_global_reader_step(rd) == 4 && amber_global_reader_world_size(rd) == (uint32_t)n);
    int64_t c0 = COLS * me / n, c1 = COLS * (me + 1) / n;
    int64_t o[2] = {0, c0}, s2[2] = {ROWS, c1 - c0};
    size_t cnt = (size_t)(ROWS * (c1 - c0));
    float *got = malloc(cnt * sizeof *got + 1);
    size_t wi;
    CHK(amber_global_reader_find(rd, "w", &wi) == 0);
    CHK(amber_global_reader_read(rd, wi, o, s2, got, cnt * sizeof *got) == 0);
    for (int64_t i = 0; i < ROWS; i++)
      for (int64_t j = c0; j < c1; j++) CHK(got[i * (c1 - c0) + (j - c0)] == val(i, j, 4));
    free(got);
    amber_global_reader_close(rd);
  }
  free(w);
  amber_mpi_comm_free(&comm);
  int all = 0;
  MPI_Allreduce(&fails, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (me == 0) printf("%s: %d ranks, %d failures\n", all ? "FAIL" : "ok", n, all);
  MPI_Finalize();
  return all ? 1 : 0;
}

/*
 * test_mpi_tiers.c - peer replicas and the restore from the tiers over real MPI
 * processes (libamber_mpi's communicator and p2p), each rank a host of its own
 * (AMBER_HOST) with its own memory directory DIR/hostR. Modes (run_tiers.sh):
 *   run   - a durable tier of steps 1..3 (a shared global writer), the memory tier's
 *           steps 1..5 (a local-mode writer) replicated after every step on a
 *           communicator of the replicator's own; rank 1's host wiped: restored
 *           bit-identical at step 5 from its peer; every host wiped: restored at step
 *           3 from the durable tier, into memory;
 *   loop  - restores, then saves and replicates until it is killed;
 *   check - after a kill: no torn step in this rank's directory (its own store and
 *           the replicas it keeps, each at its LATEST, verified and exact, and its
 *           GLOBAL's step), then a restore that every rank reads back exactly;
 *           with "wipe", rank 1's directory is wiped first (when its replica exists).
 * Exits non-zero on any failure.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "amber_mpi.h"

#define ROWS 64
#define COLS 256
#define BIAS 4

static int fails, me, n;
#define CHK(c)                                                                        \
  do {                                                                                \
    if (!(c)) {                                                                       \
      fprintf(stderr, "rank %d: %s:%d: %s (%s)\n", me, __FILE__, __LINE__, #c,         \
              amber_last_error(NULL));                                                \
      fails++;                                                                        \
    }                                                                                 \
  } while (0)

static float wv(int64_t i, int64_t j, uint64_t s) {
  int64_t k = i * COLS + j;
  return (float)k + ((k % 89) == (int64_t)(s % 89) ? 0.5f * (float)s : 0.0f);
}
static float bv(int i, uint64_t s) {
  return (float)i * 2.0f + (float)s;
}

static int64_t off[2], sh[2];
static char mem[4096], durable[4096];
static amber_comm comm, rcomm; /* the job's, the replicator's */
static amber_p2p p2p, rp2p;

static void fill(float *w, float *b, uint64_t s) {
  for (int64_t i = 0; i < sh[0]; i++)
    for (int64_t j = 0; j < COLS; j++) w[i * COLS + j] = wv(off[0] + i, j, s);
  for (int i = 0; i < BIAS; i++) b[i] = bv(i, s);
}

static amber_global_writer *open_writer(const char *path, int local, float *w, float *b) {
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.flags = local ? AMBER_WRITER_GLOBAL_LOCAL : 0;
  wo.full_share = -1;
  amber_global_writer *gw = NULL;
  int64_t g[2] = {ROWS, COLS}, bs[1] = {BIAS};
  CHK(amber_global_writer_open(&gw, path, &comm, &wo) == 0);
  if (!gw) return NULL;
  CHK(amber_global_writer_add(gw, "w", AMBER_F32, 2, g, off, sh, w, 0) == 0);
  CHK(amber_global_writer_add(gw, "b", AMBER_F32, 1, bs, NULL, NULL, b,
                              AMBER_SHARD_REPLICATED) == 0);
  return gw;
}

/* This rank's rows and "b" of `step` from `dir`, bit for bit. */
static void check_read(const char *dir, uint64_t step) {
  amber_global_reader *g = NULL;
  CHK(amber_global_reader_open(&g, dir, step) == 0);
  if (!g) return;
  size_t wi, bi;
  float *got = malloc((size_t)(sh[0] * COLS) * sizeof *got + 1), b[BIAS];
  CHK(amber_global_reader_find(g, "w", &wi) == 0 && amber_global_reader_find(g, "b", &bi) == 0);
  CHK(amber_global_reader_read(g, wi, off, sh, got, (uint64_t)(sh[0] * COLS) * sizeof *got) == 0);
  int64_t o = 0, bs = BIAS;
  CHK(amber_global_reader_read(g, bi, &o, &bs, b, sizeof b) == 0);
  int ok = 1;
  for (int64_t i = 0; i < sh[0]; i++)
    for (int64_t j = 0; j < COLS; j++) ok &= got[i * COLS + j] == wv(off[0] + i, j, step);
  for (int i = 0; i < BIAS; i++) ok &= b[i] == bv(i, step);
  CHK(ok);
  free(got);
  amber_global_reader_close(g);
}

/* This rank's rows of `step` from `dir` (where rank 0's files may not be). */
static void check_read_own(const char *dir, uint64_t step) {
  amber_global_reader *g = NULL;
  CHK(amber_global_reader_open(&g, dir, step) == 0);
  if (!g) return;
  size_t wi;
  float *got = malloc((size_t)(sh[0] * COLS) * sizeof *got + 1);
  CHK(amber_global_reader_find(g, "w", &wi) == 0);
  CHK(amber_global_reader_read(g, wi, off, sh, got, (uint64_t)(sh[0] * COLS) * sizeof *got) == 0);
  int ok = 1;
  for (int64_t i = 0; i < sh[0]; i++)
    for (int64_t j = 0; j < COLS; j++) ok &= got[i * COLS + j] == wv(off[0] + i, j, step);
  CHK(ok);
  free(got);
  amber_global_reader_close(g);
}

static amber_tiers_result restore(const char *dur) {
  amber_tiers_result res;
  CHK(amber_tiers_restore(mem, dur, &comm, &p2p, &res) == 0);
  return res;
}

/* Saves steps first..last into the memory tier (and, up to `dlast`, the durable
 * tier), replicating each; usleep_us between steps. */
static void save(uint64_t first, uint64_t last, uint64_t dlast, unsigned usleep_us) {
  float *w = malloc((size_t)(sh[0] * COLS) * sizeof *w + 1), b[BIAS];
  amber_global_writer *gw = open_writer(mem, 1, w, b);
  amber_global_writer *dw = dlast ? open_writer(durable, 0, w, b) : NULL;
  amber_replicas *r = NULL;
  amber_replicas_opts o;
  amber_replicas_opts_init(&o);
  CHK(amber_replicas_open(&r, mem, &rcomm, &rp2p, 1, &o) == 0);
  for (uint64_t s = first; gw && r && s <= last; s++) {
    fill(w, b, s);
    CHK(amber_global_writer_save(gw, s, 0) == 0);
    if (dw && s <= dlast) CHK(amber_global_writer_save(dw, s, 0) == 0);
    CHK(amber_replicas_step(r, s) == 0);
    if (usleep_us) usleep(usleep_us);
  }
  amber_replicas_close(r);
  amber_global_writer_close(dw);
  amber_global_writer_close(gw);
  free(w);
}

/* After a kill: this rank's directory shows no torn step. */
static void check_directory(void) {
  amber_global_step_info *info = NULL;
  size_t cnt = 0;
  CHK(amber_global_list(mem, &info, &cnt) == 0);
  if (cnt) check_read_own(mem, info[cnt - 1].step);
  amber_free(info);
  for (int q = 0; q < n; q++) {
    char p[4200];
    snprintf(p, sizeof p, "%s/rank-%05d", mem, q);
    amber_store_opts so;
    amber_store_opts_init(&so);
    so.flags = AMBER_OPEN_READONLY;
    amber_store *st;
    uint64_t l;
    if (amber_store_open(&st, p, &so) < 0) continue;
    amber_reader *rd = NULL;
    if (amber_store_latest(st, &l) == 0) {
      CHK(amber_reader_open(&rd, st, l, NULL) == 0);
      if (rd) CHK(amber_reader_verify(rd) == 0);
      size_t i;
      int64_t qo = ROWS * q / n, qs = ROWS * (q + 1) / n - qo;
      float *got = malloc((size_t)(qs * COLS) * sizeof *got + 1);
      CHK(rd && amber_reader_find(rd, "w", &i) == 0 &&
          amber_reader_read(rd, i, got, (uint64_t)(qs * COLS) * sizeof *got) == 0);
      int ok = 1;
      for (int64_t a = 0; rd && a < qs; a++)
        for (int64_t j = 0; j < COLS; j++) ok &= got[a * COLS + j] == wv(qo + a, j, l);
      CHK(ok);
      free(got);
    }
    amber_reader_close(rd);
    amber_store_close(st);
  }
}

int main(int argc, char **argv) {
  int level;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &level);
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  if (argc < 3) return 2;
  const char *mode = argv[2];
  snprintf(mem, sizeof mem, "%s/host%d", argv[1], me);
  snprintf(durable, sizeof durable, "%s/durable", argv[1]);
  char host[32];
  snprintf(host, sizeof host, "h%d", me);
  setenv("AMBER_HOST", host, 1); /* each rank a host of its own */
  off[0] = ROWS * me / n, off[1] = 0, sh[0] = ROWS * (me + 1) / n - off[0], sh[1] = COLS;
  CHK(amber_mpi_comm_init(&comm, MPI_COMM_WORLD) == 0);
  CHK(amber_mpi_comm_init(&rcomm, MPI_COMM_WORLD) == 0);
  CHK(amber_mpi_p2p_init(&p2p, &comm) == 0 && amber_mpi_p2p_init(&rp2p, &rcomm) == 0);
  if (!strcmp(mode, "run")) {
    save(1, 5, 3, 0);
    MPI_Barrier(MPI_COMM_WORLD);
    char cmd[4300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", mem);
    if (me == 1) CHK(system(cmd) == 0);
    MPI_Barrier(MPI_COMM_WORLD);
    amber_tiers_result res = restore(durable);
    CHK(res.step == 5);
    CHK(me != 1 || res.tier == AMBER_RESTORE_PEER);
    CHK(me != 0 || res.tier == AMBER_RESTORE_MEMORY);
    if (res.dir) check_read(res.dir, 5);
    MPI_Barrier(MPI_COMM_WORLD);
    CHK(system(cmd) == 0);
    MPI_Barrier(MPI_COMM_WORLD);
    res = restore(durable);
    CHK(res.step == 3 && res.tier == AMBER_RESTORE_DURABLE && res.dir == mem);
    if (res.dir) check_read(res.dir, 3);
    save(4, 5, 0, 0); /* the job goes on from the restored step */
    res = restore(durable);
    CHK(res.step == 5);
    if (res.dir) check_read(res.dir, 5);
  } else if (!strcmp(mode, "loop")) {
    amber_tiers_result res = restore(NULL);
    uint64_t first = res.step == AMBER_NO_STEP ? 1 : res.step + 1;
    save(first, first + 10000, 0, 2000);
  } else if (!strcmp(mode, "check")) {
    check_directory();
    MPI_Barrier(MPI_COMM_WORLD);
    if (argc > 3 && !strcmp(argv[3], "wipe")) {
      /* rank 1's host lost, once its files have a replica on the next host */
      char rep[4300];
      int has = 0, all = 0;
      snprintf(rep, sizeof rep, "%s/host%d/rank-00001/LATEST", argv[1], 2 % n);
      if (me == 1) has = access(rep, F_OK) == 0;
      MPI_Allreduce(&has, &all, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
      char cmd[4300];
      snprintf(cmd, sizeof cmd, "rm -rf '%s'", mem);
      if (me == 1 && all) CHK(system(cmd) == 0);
      MPI_Barrier(MPI_COMM_WORLD);
    }
    amber_tiers_result res = restore(NULL);
    CHK(res.step != AMBER_NO_STEP);
    if (res.dir) check_read(res.dir, res.step);
    if (me == 0)
      printf("restored step %llu: %u from memory, %u from peers\n",
             (unsigned long long)res.step, res.ranks_memory, res.ranks_peer);
  }
  amber_mpi_comm_free(&rcomm);
  amber_mpi_comm_free(&comm);
  int total = 0;
  MPI_Allreduce(&fails, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (me == 0) printf("tiers %s: %s at %d ranks\n", mode, total ? "FAILED" : "ok", n);
  MPI_Finalize();
  return total != 0;
}

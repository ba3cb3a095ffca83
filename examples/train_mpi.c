/*
 * train_mpi.c - how an MPI trainer uses amber's many-rank checkpoints: a small MLP
 * whose weights are split across the ranks (tensor parallel, as Megatron splits an
 * MLP), trained with AdamW on synthetic regression data, checkpointed after every
 * optimizer step with the split save (begin / fence / wait) as one global step, and
 * resumable at any rank count.
 *
 *   mpirun -np N train_mpi STORE [--steps N] [--policy SPEC] [--funneled]
 *                                [--kill-rank R --kill-at S --kill-after-us U]
 *
 * The model is y = W2 relu(W1 x + b1) + b2. Rank r of n holds rows [lo, hi) of W1
 * and b1 (the hidden units lo..hi-1) and the same columns of W2; b2 is replicated.
 * Forward: each rank computes its hidden units and its partial product W2[:, lo:hi]
 * h[lo:hi]; an allgather of the partials, summed in rank order on every rank,
 * gives the output (a fixed order, so that every rank gets the same bits and the
 * replicas of b2 stay identical). Backward needs no communication: each rank's
 * gradients are those of its own slices, and b2's is computed alike everywhere.
 *
 * The checkpoint holds each rank's slices as shards of the global tensors (W1 and
 * b1 split by rows, W2 by columns), the AdamW moments alike, and b2, its moments
 * and the step counter replicated (written once, by rank 0). The batch of step t is
 * drawn from a generator seeded by t and the initial weights from their global
 * index, so that a resumed run sees what an uninterrupted one does at any rank
 * count. A resume reads this rank's region of every global tensor from the latest
 * global step, whatever the rank count that wrote it.
 *
 * MPI is initialized with MPI_THREAD_MULTIPLE when the library provides it: the
 * communicator that libamber_mpi makes is then flagged AMBER_COMM_ANY_THREAD, and
 * each step's global commit runs on amber's own thread from begin on, beside this
 * program's MPI_Allgather. With --funneled (MPI_THREAD_FUNNELED) it runs
 * inside amber_global_writer_wait, on this thread.
 *
 * With --kill-rank R (-1: every rank) --kill-at S --kill-after-us U, rank R
 * SIGKILLs itself U microseconds after it began the save of step S, wherever it
 * then is (scanning, in a collective, in the next forward pass), as a crash would;
 * mpirun then ends the whole job.
 *
 * Prints (rank 0) "resumed from step S state H" after a resume and "final step N
 * loss L state H" at the end, where H hashes the whole global state (every global
 * tensor, gathered on rank 0): with the exact policy a resumed run prints the same
 * final line as an uninterrupted one at the same rank count, and a resume at any
 * rank count prints the state of the step it resumed from.
 */
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <unistd.h>

#include <mpi.h>

#include "amber_mpi.h"

enum { IN = 32, HID = 48, OUT = 8, BATCH = 64 };

static int me, nranks;
static int64_t lo, cnt; /* this rank's hidden units: lo .. lo+cnt-1 */

/* One parameter and its AdamW moments, as this rank holds them. */
typedef struct param {
  const char *name;
  int split;           /* 0: replicated, 1: rows (dim 0), 2: columns (dim 1) */
  uint32_t ndim;
  int64_t gshape[2];   /* global shape */
  int64_t off[2], lshape[2];
  int64_t n;           /* local elements */
  float *w, *g, *m, *v;
} param;

static param P[4] = {
    {.name = "w1", .split = 1, .ndim = 2, .gshape = {HID, IN}},
    {.name = "b1", .split = 1, .ndim = 1, .gshape = {HID}},
    {.name = "w2", .split = 2, .ndim = 2, .gshape = {OUT, HID}},
    {.name = "b2", .split = 0, .ndim = 1, .gshape = {OUT}},
};
#define NP 4
static int64_t step_counter; /* AdamW's t, replicated */

static uint64_t splitmix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

static float uniform(uint64_t x) { return (float)(splitmix(x) >> 40) / 16777216.0f * 2 - 1; }

/* Sets each parameter's local box, allocates it and its moments, and initializes
 * it from the global index of each element (the same global tensor at any n). */
static int setup_params(void) {
  lo = (int64_t)HID * me / nranks;
  cnt = (int64_t)HID * (me + 1) / nranks - lo;
  for (int p = 0; p < NP; p++) {
    param *q = &P[p];
    for (uint32_t d = 0; d < q->ndim; d++) q->off[d] = 0, q->lshape[d] = q->gshape[d];
    if (q->split) q->off[q->split - 1] = lo, q->lshape[q->split - 1] = cnt;
    q->n = q->ndim == 1 ? q->lshape[0] : q->lshape[0] * q->lshape[1];
    size_t sz = (size_t)q->n * sizeof(float) + 1; /* + 1: never malloc(0) */
    q->w = malloc(sz), q->g = malloc(sz), q->m = calloc(1, sz), q->v = calloc(1, sz);
    if (!q->w || !q->g || !q->m || !q->v) return -1;
    int64_t cols = q->ndim == 2 ? q->lshape[1] : 1, gcols = q->ndim == 2 ? q->gshape[1] : 1;
    for (int64_t i = 0; i < q->n; i++) {
      int64_t gi = (q->off[0] + i / cols) * gcols + (q->ndim == 2 ? q->off[1] + i % cols : 0);
      q->w[i] = 0.2f * uniform((uint64_t)p << 32 | (uint64_t)gi);
    }
  }
  return 0;
}

/* The batch of step t: inputs, and targets from a fixed random map through tanh. */
static void batch(int64_t t, float *x, float *y) {
  for (int i = 0; i < BATCH * IN; i++) x[i] = uniform(0xB0000000000ull ^ (uint64_t)t << 20 ^ (uint64_t)i);
  for (int b = 0; b < BATCH; b++)
    for (int o = 0; o < OUT; o++) {
      float acc = 0;
      for (int i = 0; i < IN; i++) acc += uniform(0xA000000ull + (uint64_t)(o * IN + i)) * x[b * IN + i];
      y[b * OUT + o] = tanhf(acc);
    }
}

/* Forward and backward of step t on this rank's slices; returns the loss. */
static float forward_backward(int64_t t) {
  static float x[BATCH * IN], y[BATCH * OUT], gp[BATCH * OUT];
  float *h = calloc((size_t)(BATCH * cnt) + 1, sizeof *h);
  float *part = calloc((size_t)nranks * BATCH * OUT, sizeof *part);
  float *w1 = P[0].w, *b1 = P[1].w, *w2 = P[2].w, *b2 = P[3].w;
  float *gw1 = P[0].g, *gb1 = P[1].g, *gw2 = P[2].g, *gb2 = P[3].g;
  if (!h || !part) MPI_Abort(MPI_COMM_WORLD, 1);
  batch(t, x, y);
  for (int k = 0; k < NP; k++) memset(P[k].g, 0, (size_t)P[k].n * sizeof(float));
  for (int b = 0; b < BATCH; b++)
    for (int64_t j = 0; j < cnt; j++) {
      float a = b1[j];
      for (int i = 0; i < IN; i++) a += w1[j * IN + i] * x[b * IN + i];
      h[b * cnt + j] = a > 0 ? a : 0;
    }
  float mine[BATCH * OUT];
  for (int b = 0; b < BATCH; b++)
    for (int o = 0; o < OUT; o++) {
      float a = 0;
      for (int64_t j = 0; j < cnt; j++) a += w2[o * cnt + j] * h[b * cnt + j];
      mine[b * OUT + o] = a;
    }
  MPI_Allgather(mine, BATCH * OUT, MPI_FLOAT, part, BATCH * OUT, MPI_FLOAT, MPI_COMM_WORLD);
  float loss = 0;
  for (int k = 0; k < BATCH * OUT; k++) {
    float a = b2[k % OUT];
    for (int r = 0; r < nranks; r++) a += part[(size_t)r * BATCH * OUT + (size_t)k];
    float d = a - y[k];
    loss += d * d;
    gp[k] = 2 * d / (BATCH * OUT);
  }
  for (int b = 0; b < BATCH; b++)
    for (int o = 0; o < OUT; o++) {
      float g = gp[b * OUT + o];
      gb2[o] += g;
      for (int64_t j = 0; j < cnt; j++) gw2[o * cnt + j] += g * h[b * cnt + j];
    }
  for (int b = 0; b < BATCH; b++)
    for (int64_t j = 0; j < cnt; j++) {
      if (h[b * cnt + j] <= 0) continue;
      float g = 0;
      for (int o = 0; o < OUT; o++) g += gp[b * OUT + o] * w2[o * cnt + j];
      gb1[j] += g;
      for (int i = 0; i < IN; i++) gw1[j * IN + i] += g * x[b * IN + i];
    }
  free(h);
  free(part);
  return loss / (BATCH * OUT);
}

static void adamw_step(void) {
  const float lr = 3e-3f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.01f;
  step_counter++;
  float c1 = 1 - powf(b1, (float)step_counter), c2 = 1 - powf(b2, (float)step_counter);
  for (int k = 0; k < NP; k++) {
    param *q = &P[k];
    for (int64_t i = 0; i < q->n; i++) {
      q->m[i] = b1 * q->m[i] + (1 - b1) * q->g[i];
      q->v[i] = b2 * q->v[i] + (1 - b2) * q->g[i] * q->g[i];
      q->w[i] -= lr * ((q->m[i] / c1) / (sqrtf(q->v[i] / c2) + eps) + wd * q->w[i]);
    }
  }
}

/* The checkpointed tensors: each parameter and its two moments, named as a
 * PyTorch state would be. */
static const char *suffix[3] = {"", ".exp_avg", ".exp_avg_sq"};
static float *tensor_data(int p, int kind) {
  return kind == 0 ? P[p].w : kind == 1 ? P[p].m : P[p].v;
}
static void tensor_name(int p, int kind, char *buf, size_t len) {
  snprintf(buf, len, "%s.%s%s", kind ? "optim" : "model", P[p].name, suffix[kind]);
}

/* Gathers a local box of a global tensor on rank 0 as its global row-major bytes
 * and hashes them (FNV-1a, continuing from *h). Collective. */
static void hash_global(const param *q, const float *local, uint64_t *h) {
  int64_t total = q->ndim == 1 ? q->gshape[0] : q->gshape[0] * q->gshape[1];
  float *all = NULL, *glob = NULL;
  int *counts = NULL, *displs = NULL;
  if (!q->split) {
    glob = (float *)local;
  } else {
    all = malloc((size_t)total * sizeof *all);
    glob = malloc((size_t)total * sizeof *glob);
    counts = malloc((size_t)nranks * sizeof *counts);
    displs = malloc((size_t)nranks * sizeof *displs);
    if (!all || !glob || !counts || !displs) MPI_Abort(MPI_COMM_WORLD, 1);
    int64_t per = q->ndim == 2 ? q->gshape[1 - (q->split - 1)] : 1;
    for (int r = 0, d = 0; r < nranks; r++) {
      int64_t c = (int64_t)HID * (r + 1) / nranks - (int64_t)HID * r / nranks;
      counts[r] = (int)(c * per), displs[r] = d, d += counts[r];
    }
    MPI_Gatherv(local, (int)q->n, MPI_FLOAT, all, counts, displs, MPI_FLOAT, 0, MPI_COMM_WORLD);
    if (q->split == 2) { /* columns: each rank's block is OUT x c; interleave them */
      for (int r = 0; r < nranks; r++) {
        int64_t c0 = (int64_t)HID * r / nranks, c = counts[r] / q->gshape[0];
        for (int64_t i = 0; i < q->gshape[0]; i++)
          memcpy(glob + i * q->gshape[1] + c0, all + displs[r] + i * c, (size_t)c * sizeof *glob);
      }
    } else {
      memcpy(glob, all, (size_t)total * sizeof *glob);
    }
  }
  if (me == 0) {
    const uint8_t *b = (const uint8_t *)glob;
    for (size_t i = 0; i < (size_t)total * sizeof *glob; i++) *h = (*h ^ b[i]) * 1099511628211ull;
  }
  if (q->split) free(glob);
  free(all);
  free(counts);
  free(displs);
}

/* A hash of the whole global state: every parameter, every moment, the counter. */
static uint64_t state_hash(void) {
  uint64_t h = 1469598103934665603ull;
  for (int p = 0; p < NP; p++)
    for (int k = 0; k < 3; k++) hash_global(&P[p], tensor_data(p, k), &h);
  const uint8_t *b = (const uint8_t *)&step_counter;
  for (size_t i = 0; i < sizeof step_counter; i++) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

static void die(const char *what, const void *handle) {
  fprintf(stderr, "train_mpi: rank %d: %s: %s\n", me, what, amber_last_error(handle));
  MPI_Abort(MPI_COMM_WORLD, 1);
}

/* Reads this rank's region of every tensor from the latest global step, whatever
 * the rank count that wrote it. Returns 0 when the store has no step yet. */
static int resume(const char *store) {
  amber_global_reader *g = NULL;
  int rc = amber_global_reader_open(&g, store, AMBER_LATEST);
  if (rc == AMBER_ENOENT) return 0;
  if (rc) die("cannot open the latest global step", NULL);
  char name[64];
  size_t k;
  for (int p = 0; p < NP; p++)
    for (int kind = 0; kind < 3; kind++) {
      tensor_name(p, kind, name, sizeof name);
      if ((rc = amber_global_reader_find(g, name, &k)) != 0 ||
          (rc = amber_global_reader_read(g, k, P[p].off, P[p].lshape, tensor_data(p, kind),
                                         (uint64_t)P[p].n * sizeof(float))) != 0)
        die(name, g);
    }
  if ((rc = amber_global_reader_find(g, "optim.step", &k)) != 0 ||
      (rc = amber_global_reader_read(g, k, NULL, NULL, &step_counter, sizeof step_counter)) != 0)
    die("optim.step", g);
  uint64_t step = amber_global_reader_step(g);
  uint32_t world = amber_global_reader_world_size(g);
  amber_global_reader_close(g);
  uint64_t h = state_hash();
  if (me == 0)
    fprintf(stderr, "train_mpi: resumed from step %" PRIu64 " (written by %u ranks) state %016" PRIx64
            "\n", step, world, h);
  return 0;
}

static void on_alarm(int sig) {
  (void)sig;
  kill(getpid(), SIGKILL);
}

static void usage(void) {
  if (me == 0)
    fprintf(stderr, "usage: train_mpi STORE [--steps N] [--policy SPEC] [--funneled] "
                    "[--kill-rank R --kill-at S --kill-after-us U]\n");
  MPI_Finalize();
  exit(2);
}

int main(int argc, char **argv) {
  int provided, funneled = 0;
  for (int i = 1; i < argc; i++) funneled |= !strcmp(argv[i], "--funneled");
  MPI_Init_thread(&argc, &argv, funneled ? MPI_THREAD_FUNNELED : MPI_THREAD_MULTIPLE,
                  &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &nranks);
  const char *store = NULL, *policy = NULL;
  int64_t steps = 40, kill_at = -1, kill_us = 0;
  int kill_rank = -2;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoll(argv[++i]);
    else if (!strcmp(argv[i], "--policy") && i + 1 < argc) policy = argv[++i];
    else if (!strcmp(argv[i], "--funneled")) continue;
    else if (!strcmp(argv[i], "--kill-rank") && i + 1 < argc) kill_rank = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--kill-at") && i + 1 < argc) kill_at = atoll(argv[++i]);
    else if (!strcmp(argv[i], "--kill-after-us") && i + 1 < argc) kill_us = atoll(argv[++i]);
    else if (!store && argv[i][0] != '-') store = argv[i];
    else usage();
  }
  if (!store || nranks > HID) usage();
  if (setup_params() < 0) die("out of memory", NULL);
  if (resume(store)) return 1;

  amber_comm comm;
  amber_global_writer *gw = NULL;
  if (amber_mpi_comm_init(&comm, MPI_COMM_WORLD)) die("cannot make the communicator", NULL);
  if (me == 0)
    fprintf(stderr, "train_mpi: %d ranks, the global commit runs %s\n", nranks,
            comm.flags & AMBER_COMM_ANY_THREAD ? "in the background (MPI_THREAD_MULTIPLE)"
                                               : "inside wait() (no MPI_THREAD_MULTIPLE)");
  if (amber_global_writer_open(&gw, store, &comm, NULL)) die("cannot open the global writer", NULL);
  char name[64];
  for (int p = 0; p < NP; p++)
    for (int kind = 0; kind < 3; kind++) {
      tensor_name(p, kind, name, sizeof name);
      if (amber_global_writer_add(gw, name, AMBER_F32, P[p].ndim, P[p].gshape, P[p].off,
                                  P[p].lshape, tensor_data(p, kind),
                                  P[p].split ? 0 : AMBER_SHARD_REPLICATED))
        die(name, gw);
    }
  if (amber_global_writer_add(gw, "optim.step", AMBER_I64, 0, NULL, NULL, NULL, &step_counter,
                              AMBER_SHARD_REPLICATED))
    die("optim.step", gw);
  if (policy && amber_global_writer_add_policy(gw, policy)) die("bad policy", gw);

  float loss = 0;
  while (step_counter < steps) {
    loss = forward_backward(step_counter + 1); /* overlaps the scan of the last save */
    if (amber_global_writer_fence(gw)) die("fence", gw);
    adamw_step();
    /* The previous global step is committed everywhere, or its error is here (the
     * same on every rank); training goes on either way, and the next step is full. */
    if (amber_global_writer_wait(gw) && me == 0)
      fprintf(stderr, "train_mpi: checkpoint failed, training goes on: %s\n",
              amber_last_error(gw));
    if (amber_global_writer_begin(gw, (uint64_t)step_counter, 0))
      die("cannot begin a checkpoint", gw);
    if (step_counter == kill_at && (kill_rank == me || kill_rank == -1)) {
      struct itimerval it = {{0, 0}, {(time_t)(kill_us / 1000000), (suseconds_t)(kill_us % 1000000)}};
      signal(SIGALRM, on_alarm);
      if (kill_us <= 0) kill(getpid(), SIGKILL);
      setitimer(ITIMER_REAL, &it, NULL);
    }
  }
  if (amber_global_writer_wait(gw)) die("last checkpoint", gw);
  amber_global_writer_close(gw);
  amber_mpi_comm_free(&comm);
  uint64_t h = state_hash();
  if (me == 0)
    printf("final step %" PRId64 " loss %.6f state %016" PRIx64 "\n", step_counter, loss, h);
  for (int p = 0; p < NP; p++) free(P[p].w), free(P[p].g), free(P[p].m), free(P[p].v);
  MPI_Finalize();
  return 0;
}

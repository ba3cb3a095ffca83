/*
 * bench_ranks.c - `amber bench --ranks`, run under mpirun: what the global commit
 * of a many-rank checkpoint costs next to the ranks' own saves.
 *
 *   mpirun -np N amber bench --ranks [--size-mb TOTAL] [--deltas D] [--policy SPEC]
 *                                    [--funneled]
 *
 * Each of the N ranks holds 1/N of the synthetic AdamW state (as shards of the
 * same global tensors) and saves it through a global writer: one full step, then
 * D AdamW steps each followed by a delta step (default budget:0.02). Every save
 * starts after a barrier, so the step is durable when the slowest rank's save
 * returns. Printed (rank 0):
 *
 * - each rank's save of its part (begin until its own file is committed);
 * - the global commit's own cost: the step's save-to-durable minus the slowest
 *   rank's part, i.e. the collectives (vote allgather, outcome broadcast) and the
 *   manifest that rank 0 writes durably, with the manifest shown apart;
 * - a single-rank save of the same total bytes by rank 0 alone (the other ranks
 *   idle), the same trajectory and policy;
 * - the target: the commit adds at most 5% to a delta step's save-to-durable;
 * - split saves (begin, then "compute" twice as long as a delta part, fence,
 *   wait): wait's duration is what the save costs the training thread at its end.
 *   MPI is initialized with MPI_THREAD_MULTIPLE, so the commit runs on amber's
 *   thread from begin on; with --funneled (MPI_THREAD_FUNNELED) it runs inside
 *   wait(), on the training thread.
 *
 * The ranks share the machine: on a small machine N ranks contend for its cores
 * and its disk, which a job with a node per rank does not.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <mpi.h>

#include "amber_mpi.h"
#include "bench.h"

enum { F_PART, F_VOTE, F_MANIFEST, F_OUTCOME, F_COMMIT, F_TOTAL, F_BYTES, F_WAIT, NF };

/* Split saves measured after the D deltas: begin, compute, fence, wait. */
#define SPLIT_STEPS 5

/* Waits for every rank without spinning, so that an idle rank leaves the cores to
 * the one that works (MPI_Barrier polls). */
static void quiet_barrier(void) {
  MPI_Request rq;
  int done = 0;
  MPI_Ibarrier(MPI_COMM_WORLD, &rq);
  while (MPI_Test(&rq, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && !done) {
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
}

static double max_of(const double *v, int n, int stride) {
  double m = v[0];
  for (int i = 1; i < n; i++)
    if (v[i * stride] > m) m = v[i * stride];
  return m;
}

/* The global saves of this rank's shard: step 1 full, steps 2..D+1 deltas, then
 * SPLIT_STEPS split saves. f gets NF figures per step. */
static int global_run(const bench_opts *o, const char *dir, int me, int n, double *f) {
  bench_state s = {0};
  float *gtab = amber__bench_gradients();
  amber_comm comm;
  amber_global_writer *gw = NULL;
  int rc = -1;
  if (!gtab || amber__bench_state(&s, o->size_bytes / (uint64_t)n) < 0) goto out;
  amber__bench_fill(&s, 1 + (uint64_t)me); /* the ranks hold different values */
  if (amber_mpi_comm_init(&comm, MPI_COMM_WORLD)) goto out;
  if (amber_global_writer_open(&gw, dir, &comm, NULL)) {
    fprintf(stderr, "amber bench: rank %d: %s\n", me, amber_last_error(NULL));
    goto out_comm;
  }
  for (size_t i = 0; i < s.n; i++) {
    /* Tensor i of every rank is one shard of global tensor i. */
    int64_t g = s.t[i].n * n, off = s.t[i].n * me;
    if (amber_global_writer_add(gw, s.t[i].name, AMBER_F32, 1, &g, &off, &s.t[i].n, s.t[i].x, 0))
      goto fail;
  }
  if (amber_global_writer_add_policy(gw, o->policy ? o->policy : "budget:0.02")) goto fail;
  for (int k = 0; k <= o->deltas; k++) {
    if (k) amber__bench_adam(&s, gtab, k + 1);
    quiet_barrier();
    if (amber_global_writer_save(gw, (uint64_t)k + 1, k ? 0 : AMBER_SAVE_FULL)) goto fail;
    amber_global_save_stats st;
    amber_global_writer_save_stats(gw, &st);
    double *x = f + (size_t)k * NF;
    x[F_PART] = st.part_s, x[F_VOTE] = st.vote_s, x[F_MANIFEST] = st.manifest_s;
    x[F_OUTCOME] = st.outcome_s, x[F_COMMIT] = st.commit_s, x[F_TOTAL] = st.total_s;
    x[F_BYTES] = (double)st.part.bytes;
  }
  /* Split saves: the "compute" between begin and wait lasts twice the slowest
   * rank's median delta part, so each part is durable before wait is called. */
  if (o->deltas < 1) goto fail;
  double *parts = malloc((size_t)(unsigned)o->deltas * sizeof *parts), comp = 0;
  if (!parts) goto fail;
  for (int k = 1; k <= o->deltas; k++) parts[k - 1] = f[(size_t)k * NF + F_PART];
  double mine = 2 * amber__bench_median(parts, o->deltas);
  free(parts);
  MPI_Allreduce(&mine, &comp, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  for (int k = o->deltas + 1; k <= o->deltas + SPLIT_STEPS; k++) {
    amber__bench_adam(&s, gtab, k + 1);
    quiet_barrier();
    if (amber_global_writer_begin(gw, (uint64_t)k + 1, 0)) goto fail;
    struct timespec ts = {(time_t)comp, (long)((comp - (double)(time_t)comp) * 1e9)};
    nanosleep(&ts, NULL);
    if (amber_global_writer_fence(gw)) goto fail;
    double t0 = amber__bench_now();
    if (amber_global_writer_wait(gw)) goto fail;
    double *x = f + (size_t)k * NF;
    x[F_WAIT] = amber__bench_now() - t0;
    amber_global_save_stats st;
    amber_global_writer_save_stats(gw, &st);
    x[F_COMMIT] = st.commit_s, x[F_MANIFEST] = st.manifest_s;
  }
  rc = 0;
fail:
  if (rc) fprintf(stderr, "amber bench: rank %d: %s\n", me, amber_last_error(gw));
  amber_global_writer_close(gw);
out_comm:
  amber_mpi_comm_free(&comm);
out:
  amber__bench_free(&s);
  free(gtab);
  return rc;
}

/* Rank 0 alone: the same total bytes through one writer, same trajectory. t gets
 * the save-to-durable of the full and of each delta. */
static int single_run(const bench_opts *o, const char *dir, double *t) {
  bench_state s = {0};
  float *gtab = amber__bench_gradients();
  amber_store *st = NULL;
  amber_writer *w = NULL;
  int rc = -1;
  if (!gtab || amber__bench_state(&s, o->size_bytes) < 0) goto out;
  if (amber_store_open(&st, dir, NULL)) goto out;
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.full_every = UINT32_MAX, wo.full_share = -1; /* as the global writer's ranks */
  if (amber_writer_open(&w, st, &wo)) goto out;
  for (size_t i = 0; i < s.n; i++)
    if (amber_writer_add(w, s.t[i].name, AMBER_F32, 1, &s.t[i].n, s.t[i].x, NULL)) goto out;
  if (amber_writer_add_policy(w, o->policy ? o->policy : "budget:0.02")) goto out;
  for (int k = 0; k <= o->deltas; k++) {
    if (k) amber__bench_adam(&s, gtab, k + 1);
    double t0 = amber__bench_now();
    if (amber_writer_save(w, (uint64_t)k + 1, k ? 0 : AMBER_SAVE_FULL)) goto out;
    t[k] = amber__bench_now() - t0;
  }
  rc = 0;
out:
  if (rc) fprintf(stderr, "amber bench: single-rank save: %s\n", amber_last_error(w ? (void *)w : (void *)st));
  amber_writer_close(w);
  amber_store_close(st);
  amber__bench_free(&s);
  free(gtab);
  return rc;
}

static void row(const char *what, double *v, int n, const char *unit_note) {
  double lo = v[0], hi = v[0];
  for (int i = 1; i < n; i++) lo = v[i] < lo ? v[i] : lo, hi = v[i] > hi ? v[i] : hi;
  double med = amber__bench_median(v, n);
  printf("  %-46s %9.3f ms  (%.3f-%.3f)%s\n", what, 1e3 * med, 1e3 * lo, 1e3 * hi,
         unit_note ? unit_note : "");
}

static void report(const bench_opts *o, int n, const double *all, const double *single) {
  int D = o->deltas, S = D + 1 + SPLIT_STEPS;
  double *v = malloc((size_t)(D > 0 ? D : 1) * 4 * sizeof *v);
  double *durable = v + D, *overhead = v + 2 * D, *one = v + 3 * D;
  if (!v) return;
  printf("amber bench --ranks: %d ranks, %.1f MB in all (%.1f MB per rank), %d deltas, "
         "policy %s\n", n, (double)o->size_bytes / 1e6, (double)o->size_bytes / 1e6 / n, D,
         o->policy ? o->policy : "budget:0.02");
  printf(" delta steps (median over %d, min-max):\n", D);
  for (int r = 0; r < n; r++) {
    char what[64];
    double bytes = 0;
    for (int k = 1; k <= D; k++) {
      v[k - 1] = all[((size_t)r * S + (size_t)k) * NF + F_PART];
      bytes += all[((size_t)r * S + (size_t)k) * NF + F_BYTES];
    }
    snprintf(what, sizeof what, "rank %d: its part, save to durable", r);
    char note[64];
    snprintf(note, sizeof note, "  %.2f MB per delta", bytes / D / 1e6);
    row(what, v, D, note);
  }
  for (int k = 1; k <= D; k++) {
    /* The step is durable when the last rank's save returns (they began together). */
    double parts = max_of(&all[(size_t)k * NF + F_PART], n, S * NF);
    durable[k - 1] = max_of(&all[(size_t)k * NF + F_TOTAL], n, S * NF);
    overhead[k - 1] = durable[k - 1] - parts;
    v[k - 1] = all[(size_t)k * NF + F_MANIFEST];
    one[k - 1] = single[k];
  }
  row("global commit's own cost (collectives+manifest)", overhead, D, NULL);
  row("  of which rank 0's manifest + GLOBAL (durable)", v, D, NULL);
  for (int k = 1; k <= D; k++) v[k - 1] = all[(size_t)k * NF + F_OUTCOME];
  row("  of which the outcome broadcast (rank 0)", v, D, NULL);
  row("global delta step: save to durable", durable, D, NULL);
  row("single rank, same total bytes: save to durable", one, D, NULL);
  double med_over = amber__bench_median(overhead, D), med_dur = amber__bench_median(durable, D);
  double share = med_dur > med_over ? med_over / (med_dur - med_over) : 0;
  printf(" full step: global %.1f ms (slowest part %.1f ms), single rank %.1f ms\n",
         1e3 * max_of(&all[F_TOTAL], n, S * NF), 1e3 * max_of(&all[F_PART], n, S * NF),
         1e3 * single[0]);
  printf(" target: the commit adds <= 5%% to a delta step's save-to-durable: %.1f%% (%s)\n",
         100 * share, share <= 0.05 ? "met" : "not met");
  printf(" global delta step / single-rank delta of the same bytes: %.2fx\n",
         med_dur / amber__bench_median(one, D));
  int level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&level);
  printf(" split saves (begin, compute, fence, wait; median over %d), the commit %s:\n",
         SPLIT_STEPS, level == MPI_THREAD_MULTIPLE
                          ? "in the background (MPI_THREAD_MULTIPLE)"
                          : "inside wait() (no MPI_THREAD_MULTIPLE)");
  double w[SPLIT_STEPS], wmax[SPLIT_STEPS];
  for (int k = 0; k < SPLIT_STEPS; k++) {
    w[k] = all[(size_t)(D + 1 + k) * NF + F_WAIT];
    wmax[k] = max_of(&all[(size_t)(D + 1 + k) * NF + F_WAIT], n, S * NF);
  }
  row("wait() on the training thread, rank 0", w, SPLIT_STEPS, NULL);
  row("wait() on the training thread, slowest rank", wmax, SPLIT_STEPS, NULL);
  free(v);
}

int amber__bench_ranks(const bench_opts *o) {
  int inited = 0, me, n, provided = 0;
  MPI_Initialized(&inited);
  if (!inited)
    MPI_Init_thread(NULL, NULL, o->funneled ? MPI_THREAD_FUNNELED : MPI_THREAD_MULTIPLE,
                    &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  /* Rank 0 names the directory; every rank writes under it. */
  char dir[4096] = "", tmpl[] = "/var/tmp/amber-bench-XXXXXX";
  int own = 0, rc = 0;
  if (me == 0) {
    if (o->dir) snprintf(dir, sizeof dir, "%s", o->dir);
    else if (mkdtemp(tmpl)) snprintf(dir, sizeof dir, "%s", tmpl), own = 1;
    else fprintf(stderr, "amber bench: cannot create a directory: %s\n", strerror(errno));
  }
  MPI_Bcast(dir, sizeof dir, MPI_CHAR, 0, MPI_COMM_WORLD);
  if (!dir[0]) rc = 1;
  size_t S = (size_t)o->deltas + 1 + SPLIT_STEPS;
  double *f = calloc(S * NF, sizeof *f), *all = calloc(S * NF * (size_t)n, sizeof *all);
  double *single = calloc(S, sizeof *single);
  char gdir[4200], sdir[4200];
  snprintf(gdir, sizeof gdir, "%s/global", dir);
  snprintf(sdir, sizeof sdir, "%s/single", dir);
  if (!f || !all || !single) rc = 1;
  int mine = rc ? 1 : global_run(o, gdir, me, n, f) ? 1 : 0;
  MPI_Allreduce(&mine, &rc, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rc == 0) {
    MPI_Gather(f, (int)(S * NF), MPI_DOUBLE, all, (int)(S * NF), MPI_DOUBLE, 0, MPI_COMM_WORLD);
    if (me == 0) rc = single_run(o, sdir, single) ? 1 : 0;
    quiet_barrier();
    if (me == 0 && rc == 0) report(o, n, all, single);
  }
  if (own) {
    char cmd[4400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "amber bench: could not remove %s\n", dir);
  }
  free(f);
  free(all);
  free(single);
  MPI_Bcast(&rc, 1, MPI_INT, 0, MPI_COMM_WORLD);
  if (!inited) MPI_Finalize();
  return rc;
}

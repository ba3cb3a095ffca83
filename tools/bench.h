/*
 * bench.h - shared pieces of `amber bench` (tools/bench*.c): the synthetic
 * training state and timed save/restore helpers.
 */
#ifndef AMBER_BENCH_H
#define AMBER_BENCH_H

#include <stddef.h>
#include <stdint.h>

#include "amber.h"

typedef struct bench_tensor {
  char name[96];
  int64_t n;
  int role; /* 0 param, 1 exp_avg, 2 exp_avg_sq */
  float *x;
} bench_tensor;

typedef struct bench_state {
  bench_tensor *t;
  size_t n;
  uint64_t bytes;
} bench_state;

typedef struct bench_opts {
  uint64_t size_bytes;
  int repeat;
  const char *dir;
  const char *json_path;
  int deltas;         /* delta mode: number of deltas */
  const char *policy; /* delta mode: policy rule */
  int compute_ms;     /* async mode: compute between optimizer steps */
  int funneled;       /* ranks mode: MPI_THREAD_FUNNELED, the commit inside wait() */
} bench_opts;

int amber__bench_state(bench_state *s, uint64_t total_bytes);
void amber__bench_fill(bench_state *s, uint64_t seed);
void amber__bench_free(bench_state *s);
int amber__bench_save(amber_store *st, amber_writer **w, const bench_state *s,
                      const amber_writer_opts *wo, uint64_t step, uint32_t flags,
                      double *secs);
int amber__bench_restore(amber_store *st, uint64_t step, bench_state *dst, double *secs);
int amber__bench_main(int argc, char **argv);
double amber__bench_now(void);
/* A plain buffered write+fsync of the state to `path`, as a naive checkpointer does. */
double amber__bench_plain_write(const bench_state *s, const char *path);
/* Evicts the store's checkpoint files from the page cache, so reads hit the disk. */
void amber__bench_drop_store(const char *dir);
double amber__bench_median(double *v, int n);
int amber__bench_delta(const bench_opts *o);
int amber__bench_async(const bench_opts *o);
/* `amber bench --ranks` (tools/bench_ranks.c, only when built with MPI). */
int amber__bench_ranks(const bench_opts *o);
float *amber__bench_gradients(void);
void amber__bench_adam(bench_state *s, const float *gtab, int step);

#endif

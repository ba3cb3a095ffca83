/*
 * bench_async.c - `amber bench --async`: what a training loop pays for a
 * checkpoint every step with begin / fence / wait.
 *
 * The loop: compute (a busy loop standing for forward and backward, on the
 * training thread) overlaps the scan of the checkpoint begun after the previous
 * optimizer step; then fence, the AdamW step, wait for the previous checkpoint,
 * begin the next. The stall is the time the training thread spends in fence,
 * wait and begin. Printed next to it, measured in the same run: each save's time
 * to durable, and a synchronous save (full and delta) of the same state; the
 * peak RSS against the state's size.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "bench.h"

/* Stands for forward + backward: busy for `ms` on this thread. */
static void compute(int ms) {
  double end = amber__bench_now() + ms / 1000.0;
  volatile double x = 1;
  while (amber__bench_now() < end)
    for (int i = 0; i < 10000; i++) x = x * 1.0000001 + 1e-9;
}

int amber__bench_async(const bench_opts *o) {
  bench_state s = {0};
  const char *policy = o->policy ? o->policy : "budget:0.02";
  int K = o->deltas > 10 ? 10 : o->deltas;
  printf("amber bench --async: %.2f GB AdamW state, %d checkpoints under '%s', %d ms of "
         "compute between optimizer steps\n",
         (double)o->size_bytes / 1e9, K, policy, o->compute_ms);
  if (amber__bench_state(&s, o->size_bytes)) {
    fprintf(stderr, "amber bench: out of memory\n");
    return 1;
  }
  float *gtab = amber__bench_gradients();
  for (size_t i = s.n / 3; i < s.n; i++) memset(s.t[i].x, 0, (size_t)s.t[i].n * 4);
  for (int k = 1; k <= 3; k++) amber__bench_adam(&s, gtab, k);
  char store[4200];
  snprintf(store, sizeof store, "%s/store", o->dir);
  amber_store *st = NULL;
  amber_writer *w = NULL;
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.full_every = UINT32_MAX;
  wo.full_share = -1;
  int rc = amber_store_open(&st, store, NULL);
  if (!rc) rc = amber_writer_open(&w, st, &wo);
  for (size_t i = 0; !rc && i < s.n; i++)
    rc = amber_writer_add(w, s.t[i].name, AMBER_F32, 1, &s.t[i].n, s.t[i].x, NULL);
  if (!rc) rc = amber_writer_add_policy(w, policy);
  /* synchronous baselines on the same state: a full save, then a delta */
  double t_full = 0, t_delta = 0, t0;
  uint64_t step = 1;
  if (!rc) {
    t0 = amber__bench_now();
    rc = amber_writer_save(w, step++, AMBER_SAVE_FULL);
    t_full = amber__bench_now() - t0;
  }
  if (!rc) {
    amber__bench_adam(&s, gtab, 4);
    t0 = amber__bench_now();
    rc = amber_writer_save(w, step++, 0);
    t_delta = amber__bench_now() - t0;
  }
  printf("\n%5s %10s %10s %10s %10s %12s\n", "step", "stall s", "fence s", "wait s",
         "begin s", "durable s");
  double stall_sum = 0, stall_max = 0, durable_sum = 0;
  int measured = 0;
  for (int k = 0; !rc && k <= K; k++) {
    compute(o->compute_ms); /* forward + backward, overlapping the scan */
    double a = amber__bench_now();
    rc = amber_writer_fence(w);
    double b = amber__bench_now();
    amber__bench_adam(&s, gtab, 5 + k); /* the optimizer step changes the tensors */
    double c = amber__bench_now();
    if (!rc) rc = amber_writer_wait(w);
    amber_save_stats ss;
    amber_writer_save_stats(w, &ss);
    double d = amber__bench_now();
    if (!rc && k < K) rc = amber_writer_begin(w, step++, 0);
    double e = amber__bench_now();
    if (rc) break;
    if (k > 0) { /* row k reports the save begun in iteration k-1 */
      double stall = (b - a) + (d - c) + (e - d);
      printf("%5" PRIu64 " %10.4f %10.4f %10.4f %10.4f %12.4f\n", step - (k < K ? 2 : 1), stall,
             b - a, d - c, e - d, ss.total_s);
      stall_sum += stall;
      durable_sum += ss.total_s;
      if (stall > stall_max) stall_max = stall;
      measured++;
    }
  }
  if (rc) fprintf(stderr, "amber bench: %s\n", amber_last_error(w ? (void *)w : NULL));
  amber_writer_close(w);
  amber_store_close(st);
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  double rss = (double)ru.ru_maxrss * 1024;
  if (!rc && measured) {
    double ms = stall_sum / measured;
    printf("\n%-46s %10.4f s\n", "mean stall per checkpoint", ms);
    printf("%-46s %10.4f s\n", "max stall", stall_max);
    printf("%-46s %10.4f s\n", "mean save-to-durable (background)", durable_sum / measured);
    printf("%-46s %10.4f s\n", "synchronous full save of the same state", t_full);
    printf("%-46s %10.4f s\n", "synchronous delta save of the same state", t_delta);
    printf("%-46s %10.2f GB (state %.2f GB, reference %.2f GB, other %.3f GB)\n", "peak RSS",
           rss / 1e9, (double)s.bytes / 1e9, (double)s.bytes / 1e9,
           (rss - 2.0 * (double)s.bytes) / 1e9);
    printf("\nratios, same run:\n  mean stall / synchronous full save %8.3f%%  (target <= 1%%)\n",
           100 * ms / t_full);
    printf("  mean stall / synchronous delta save %7.3f%%\n", 100 * ms / t_delta);
    if (o->json_path) {
      FILE *f = fopen(o->json_path, "w");
      if (f) {
        fprintf(f,
                "{\"mode\": \"async\", \"policy\": \"%s\", \"state_bytes\": %" PRIu64
                ", \"checkpoints\": %d, \"compute_ms\": %d,\n \"stall_mean_s\": %.6f, "
                "\"stall_max_s\": %.6f, \"durable_mean_s\": %.6f, \"sync_full_s\": %.6f, "
                "\"sync_delta_s\": %.6f, \"peak_rss_bytes\": %.0f}\n",
                policy, s.bytes, measured, o->compute_ms, ms, stall_max,
                durable_sum / measured, t_full, t_delta, rss);
        fclose(f);
        printf("figures written to %s\n", o->json_path);
      }
    }
  }
  free(gtab);
  amber__bench_free(&s);
  return rc ? 1 : 0;
}

/*
 * comm_threads.h - a communicator whose ranks are threads of one process, so that
 * many-rank tests run without MPI: tc_run(n, fn, arg) starts n threads, each
 * calling fn(comm, arg) with its own amber_comm, and joins them. Collectives meet
 * at a barrier; each rank publishes a pointer to its data and the others copy from
 * it, so no rank's buffer is written by another.
 */
#ifndef AMBER_COMM_THREADS_H
#define AMBER_COMM_THREADS_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "amber.h"

/* A check inside a rank's thread: a failure is printed (with the thread's last
 * amber error) and counted in rank_fails, which the test reads after tc_run. */
static atomic_int rank_fails;

#define RCHECK(cond)                                                                 \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      fprintf(stderr, "%s:%d: rank check failed: %s (%s)\n", __FILE__, __LINE__, #cond, \
              amber_last_error(NULL));                                               \
      atomic_fetch_add(&rank_fails, 1);                                              \
    }                                                                                \
  } while (0)

typedef struct tc_world {
  int size;
  pthread_barrier_t bar;
  const void *slot[64];
} tc_world;

typedef struct tc_rank {
  tc_world *w;
  int rank;
  amber_comm comm;
  void (*fn)(const amber_comm *, void *);
  void *arg;
} tc_rank;

static int tc_allgather(void *ctx, const void *send, size_t len, void *recv) {
  tc_rank *r = ctx;
  r->w->slot[r->rank] = send;
  pthread_barrier_wait(&r->w->bar);
  for (int i = 0; i < r->w->size; i++)
    if (len) memcpy((char *)recv + (size_t)i * len, r->w->slot[i], len);
  pthread_barrier_wait(&r->w->bar);
  return 0;
}

/* Ranks (bit r: rank r) whose next broadcast fails with AMBER_EIO after it has
 * run (the data reached nobody through it): a connection lost once rank 0 has sent,
 * as when a peer dies. Each rank clears its own bit as it fails. */
static _Atomic unsigned long long tc_broadcast_fails;

static int tc_broadcast(void *ctx, void *buf, size_t len, int root) {
  tc_rank *r = ctx;
  if (r->rank == root) r->w->slot[root] = buf;
  pthread_barrier_wait(&r->w->bar);
  unsigned long long bit = 1ull << r->rank;
  int fail = (atomic_load(&tc_broadcast_fails) & bit) != 0;
  if (r->rank != root && len && !fail) memcpy(buf, r->w->slot[root], len);
  pthread_barrier_wait(&r->w->bar);
  if (fail) atomic_fetch_and(&tc_broadcast_fails, ~bit);
  return fail ? AMBER_EIO : 0;
}

static int tc_barrier(void *ctx) {
  tc_rank *r = ctx;
  pthread_barrier_wait(&r->w->bar);
  return 0;
}

static void *tc_main(void *p) {
  tc_rank *r = p;
  r->fn(&r->comm, r->arg);
  return NULL;
}

/* Flags of the communicators that tc_run makes (AMBER_COMM_ANY_THREAD: its
 * collectives work from any thread, one at a time per rank, which they do). */
static uint64_t tc_flags;

/* Runs fn on n ranks (threads, n <= 64) and waits for all of them. */
static inline void tc_run(int n, void (*fn)(const amber_comm *, void *), void *arg) {
  tc_world w;
  memset(&w, 0, sizeof w);
  w.size = n;
  pthread_barrier_init(&w.bar, NULL, (unsigned)n);
  tc_rank *rs = calloc((size_t)n, sizeof *rs);
  pthread_t *th = calloc((size_t)n, sizeof *th);
  for (int i = 0; i < n; i++) {
    rs[i].w = &w;
    rs[i].rank = i;
    rs[i].fn = fn;
    rs[i].arg = arg;
    rs[i].comm.rank = i;
    rs[i].comm.size = n;
    rs[i].comm.allgather = tc_allgather;
    rs[i].comm.broadcast = tc_broadcast;
    rs[i].comm.barrier = tc_barrier;
    rs[i].comm.ctx = &rs[i];
    rs[i].comm.flags = tc_flags;
    pthread_create(&th[i], NULL, tc_main, &rs[i]);
  }
  for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
  pthread_barrier_destroy(&w.bar);
  free(rs);
  free(th);
}

#endif /* AMBER_COMM_THREADS_H */

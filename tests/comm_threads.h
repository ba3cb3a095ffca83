/*
 * comm_threads.h - a communicator whose ranks are threads of one process, so that
 * many-rank tests run without MPI: tc_run(n, fn, arg) starts n threads, each
 * calling fn(comm, arg) with its own amber_comm, and joins them. Collectives meet
 * at a barrier; each rank publishes a pointer to its data and the others copy from
 * it, so no rank's buffer is written by another. tc_p2p(comm) is the rank's
 * point-to-point exchange (amber_p2p): mailboxes between every pair of ranks.
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

/* A message of the point-to-point exchange, queued from one rank to another. */
typedef struct tc_msg {
  struct tc_msg *next;
  size_t len;
  unsigned char data[];
} tc_msg;

typedef struct tc_world {
  int size;
  pthread_barrier_t bar;
  const void *slot[64];
  pthread_mutex_t mu; /* the mailboxes: box[from][to], oldest first */
  pthread_cond_t cv;
  tc_msg *box[64][64];
} tc_world;

typedef struct tc_rank {
  tc_world *w;
  int rank;
  amber_comm comm;
  amber_p2p p2p; /* tc_p2p(comm) */
  void (*fn)(const amber_comm *, void *);
  void *arg;
} tc_rank;

/* The point-to-point exchange of the rank whose communicator is `c` (one made by
 * tc_run). */
static inline const amber_p2p *tc_p2p(const amber_comm *c) {
  return &((const tc_rank *)c->ctx)->p2p;
}

/* tc_sendrecv_fail_at[r] = k > 0: rank r's k-th next sendrecv fails with AMBER_EIO
 * after it has run (a connection lost once the bytes went through). */
static atomic_int tc_sendrecv_fail_at[64];

/* Sends never wait (the message is queued), so any order of exchanges completes;
 * a receive waits for its message and checks its length. */
static int tc_sendrecv(void *ctx, const void *send, size_t slen, int dest, void *recv,
                       size_t rlen, int src) {
  tc_rank *r = ctx;
  tc_world *w = r->w;
  if ((dest >= w->size) || (src >= w->size)) return AMBER_EINVAL;
  if (dest >= 0) {
    tc_msg *m = malloc(sizeof *m + slen + 1);
    if (!m) return AMBER_ENOMEM;
    m->next = NULL, m->len = slen;
    if (slen) memcpy(m->data, send, slen);
    pthread_mutex_lock(&w->mu);
    tc_msg **q = &w->box[r->rank][dest];
    while (*q) q = &(*q)->next;
    *q = m;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
  }
  int rc = 0;
  if (src >= 0) {
    pthread_mutex_lock(&w->mu);
    while (!w->box[src][r->rank]) pthread_cond_wait(&w->cv, &w->mu);
    tc_msg *m = w->box[src][r->rank];
    w->box[src][r->rank] = m->next;
    pthread_mutex_unlock(&w->mu);
    if (m->len != rlen) rc = AMBER_EIO;
    else if (rlen) memcpy(recv, m->data, rlen);
    free(m);
  }
  if (atomic_load(&tc_sendrecv_fail_at[r->rank]) > 0 &&
      atomic_fetch_sub(&tc_sendrecv_fail_at[r->rank], 1) == 1)
    rc = AMBER_EIO;
  return rc;
}

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
  pthread_mutex_init(&w.mu, NULL);
  pthread_cond_init(&w.cv, NULL);
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
    rs[i].p2p.sendrecv = tc_sendrecv;
    rs[i].p2p.ctx = &rs[i];
    rs[i].p2p.flags = tc_flags;
    pthread_create(&th[i], NULL, tc_main, &rs[i]);
  }
  for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < n; i++) /* messages nobody received (a test that failed) */
    for (int j = 0; j < n; j++)
      while (w.box[i][j]) {
        tc_msg *m = w.box[i][j];
        w.box[i][j] = m->next;
        free(m);
      }
  pthread_mutex_destroy(&w.mu);
  pthread_cond_destroy(&w.cv);
  pthread_barrier_destroy(&w.bar);
  free(rs);
  free(th);
}

#endif /* AMBER_COMM_THREADS_H */

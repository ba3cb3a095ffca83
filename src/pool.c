/*
 * pool.c - a small fixed thread pool for parallel loops over chunks.
 *
 * amber__pool_for(p, n, fn, ctx) runs fn(ctx, worker, i) for i in [0, n) on the
 * pool's workers and the calling thread, handing out items through an atomic
 * counter, and returns when all are done. `worker` (0..nthreads-1) lets callers
 * keep per-worker scratch buffers, so nothing is allocated per item.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#include "pool.h"

struct amber__pool {
  int nthreads; /* workers including the caller */
  pthread_t *threads;
  pthread_mutex_t mu;
  pthread_cond_t go, done;
  uint64_t generation;
  int stop;
  int busy; /* workers still in the current loop */
  /* the current loop */
  amber__pool_fn fn;
  void *ctx;
  size_t n;
  atomic_size_t next;
};

static void run_items(amber__pool *p, int worker) {
  for (;;) {
    size_t i = atomic_fetch_add(&p->next, 1);
    if (i >= p->n) break;
    p->fn(p->ctx, worker, i);
  }
}

typedef struct {
  amber__pool *p;
  int worker;
} worker_arg;

static void *worker_main(void *arg) {
  worker_arg *wa = arg;
  amber__pool *p = wa->p;
  int worker = wa->worker;
  free(wa);
  uint64_t seen = 0;
  pthread_mutex_lock(&p->mu);
  for (;;) {
    while (p->generation == seen && !p->stop) pthread_cond_wait(&p->go, &p->mu);
    if (p->stop) break;
    seen = p->generation;
    pthread_mutex_unlock(&p->mu);
    run_items(p, worker);
    pthread_mutex_lock(&p->mu);
    if (--p->busy == 0) pthread_cond_broadcast(&p->done);
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

int amber__pool_create(amber__pool **out, int nthreads) {
  amber__pool *p = calloc(1, sizeof *p);
  if (!p) return -1;
  if (nthreads < 1) nthreads = 1;
  p->nthreads = nthreads;
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->go, NULL);
  pthread_cond_init(&p->done, NULL);
  p->threads = calloc((size_t)nthreads, sizeof *p->threads);
  if (!p->threads) {
    amber__pool_destroy(p);
    return -1;
  }
  for (int i = 1; i < nthreads; i++) {
    worker_arg *wa = malloc(sizeof *wa);
    if (!wa) {
      p->nthreads = i;
      break;
    }
    wa->p = p;
    wa->worker = i;
    if (pthread_create(&p->threads[i], NULL, worker_main, wa) != 0) {
      free(wa);
      p->nthreads = i; /* fewer workers still work */
      break;
    }
  }
  *out = p;
  return 0;
}

int amber__pool_size(const amber__pool *p) {
  return p ? p->nthreads : 1;
}

void amber__pool_for(amber__pool *p, size_t n, amber__pool_fn fn, void *ctx) {
  if (n == 0) return;
  if (!p || p->nthreads == 1 || n == 1) {
    for (size_t i = 0; i < n; i++) fn(ctx, 0, i);
    return;
  }
  pthread_mutex_lock(&p->mu);
  p->fn = fn;
  p->ctx = ctx;
  p->n = n;
  atomic_store(&p->next, 0);
  p->busy = p->nthreads - 1;
  p->generation++;
  pthread_cond_broadcast(&p->go);
  pthread_mutex_unlock(&p->mu);
  run_items(p, 0);
  pthread_mutex_lock(&p->mu);
  while (p->busy > 0) pthread_cond_wait(&p->done, &p->mu);
  pthread_mutex_unlock(&p->mu);
}

void amber__pool_destroy(amber__pool *p) {
  if (!p) return;
  pthread_mutex_lock(&p->mu);
  p->stop = 1;
  pthread_cond_broadcast(&p->go);
  pthread_mutex_unlock(&p->mu);
  for (int i = 1; i < p->nthreads; i++) pthread_join(p->threads[i], NULL);
  free(p->threads);
  pthread_mutex_destroy(&p->mu);
  pthread_cond_destroy(&p->go);
  pthread_cond_destroy(&p->done);
  free(p);
}

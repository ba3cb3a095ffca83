/*
 * pool.h - internal: a fixed thread pool for parallel loops (see pool.c).
 */
#ifndef AMBER_POOL_H
#define AMBER_POOL_H

#include <stddef.h>

typedef struct amber__pool amber__pool;
typedef void (*amber__pool_fn)(void *ctx, int worker, size_t item);

/* nthreads counts the calling thread; 1 means no extra threads. */
int amber__pool_create(amber__pool **out, int nthreads);
void amber__pool_destroy(amber__pool *p);
int amber__pool_size(const amber__pool *p);
/* Runs fn for every item in [0, n) and returns when all are done. Not reentrant:
 * one loop at a time per pool. */
void amber__pool_for(amber__pool *p, size_t n, amber__pool_fn fn, void *ctx);

#endif

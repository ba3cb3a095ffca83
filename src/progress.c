/*
 * progress.c - the process-wide progress hook of long operations (a checkpoint's
 * save, verify, compact): the library never prints, so it reports how far it got
 * through a function that the program installs (the CLI draws a progress line on
 * a terminal). Reporting costs one atomic load when no hook is installed.
 */
#include <stdatomic.h>

#include "internal.h"

static _Atomic(amber_progress_fn) hook;
static void *_Atomic hook_ctx;

void amber_set_progress(amber_progress_fn fn, void *ctx) {
  atomic_store(&hook_ctx, ctx);
  atomic_store(&hook, fn);
}

void amber__progress(const char *what, uint64_t done, uint64_t total) {
  amber_progress_fn fn = atomic_load_explicit(&hook, memory_order_acquire);
  if (fn) fn(atomic_load(&hook_ctx), what, done, total);
}

/*
 * internal.h - what every source file of the library needs: error reporting into
 * handles, little-endian encode/decode, checked arithmetic and the one hash. The
 * parts have headers of their own: format.h (on-disk structures), io.h (files),
 * store.h (the store directory), ckpt.h (a checkpoint file), codec.h, scan.h and
 * the writer's parts. Nothing here is part of the public API; non-static names
 * carry the amber__ prefix.
 */
#ifndef AMBER_INTERNAL_H
#define AMBER_INTERNAL_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "amber.h"

/* ---- errors ---- */

#define AMBER__ERRLEN 1024

/* Every handle struct starts with this, so amber_last_error() can read any of them. */
typedef struct amber__err {
  char msg[AMBER__ERRLEN];
} amber__err;

/* Records a failure: formats the message into `e` (when not NULL) and into the
 * calling thread's last-error slot. Returns `code`, so callers write
 * `return amber__fail(&h->err, AMBER_EIO, "...", ...)`. */
int amber__fail(amber__err *e, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Maps an errno value to an AMBER_E* code (ENOSPC, EDQUOT -> AMBER_ENOSPC, ...). */
int amber__errno_code(int err);
/* Copies the thread's last message into `e` (after a callee failed). */
void amber__err_adopt(amber__err *e);

/* ---- little-endian encode/decode ---- */

/* Reports progress to the hook of amber_set_progress, if one is installed. */
void amber__progress(const char *what, uint64_t done, uint64_t total);

/* Seconds on the monotonic clock, for the figures of amber_*_save_stats. */
static inline double amber__now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline void amber__put16(uint8_t *p, uint16_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
}
static inline void amber__put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline void amber__put64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint16_t amber__get16(const uint8_t *p) {
  return (uint16_t)(p[0] | (p[1] << 8));
}
static inline uint32_t amber__get32(const uint8_t *p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}
static inline uint64_t amber__get64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}

/* Checked arithmetic: return 1 on overflow. */
static inline int amber__mul_overflow(uint64_t a, uint64_t b, uint64_t *out) {
  return __builtin_mul_overflow(a, b, out);
}
static inline int amber__add_overflow(uint64_t a, uint64_t b, uint64_t *out) {
  return __builtin_add_overflow(a, b, out);
}

uint64_t amber__xxh3(const void *data, size_t len);

#endif /* AMBER_INTERNAL_H */

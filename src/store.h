/*
 * store.h - internal: the store directory (src/store.c): the handle, checkpoint
 * paths, LATEST, commit, listing and prune; and what the writer and compaction
 * learn from a reader of a step (its index, its chain's sizes).
 */
#ifndef AMBER_STORE_H
#define AMBER_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "format.h"
#include "internal.h"

struct amber_store {
  amber__err err;
  char *path;
  int dirfd;
  int lockfd; /* -1 when read-only */
  uint32_t flags;
  uint32_t threads;
  int writers;     /* open writers (at most 1) */
};

/* Builds "<store>/ckpt-<step>.amber" (or with suffix) into buf. */
void amber__ckpt_path(const amber_store *st, uint64_t step, const char *suffix,
                      char *buf, size_t len);
/* The store's internal operations report failures into `e`, the error of the
 * handle on whose behalf they run (a reader, a writer's background work, or the
 * store itself; NULL: the thread's message only), so that handles used from
 * separate threads never write one message buffer. */

/* Reads LATEST: 0 and step/state, AMBER_ENOENT when absent, ECORRUPT if malformed. */
int amber__read_latest(amber_store *st, amber__err *e, uint64_t *step, uint64_t *state);
/* Atomically points LATEST at (step, state): tmp, fsync, rename, fsync dir. */
int amber__write_latest(amber_store *st, amber__err *e, uint64_t step, uint64_t state);
/* The committed state: 0 and LATEST's step and state id; AMBER_ENOENT when the
 * store is empty (no LATEST and at most the one file of an unfinished first
 * commit); AMBER_ECORRUPT when LATEST is malformed, or missing while two or
 * more checkpoint files exist. */
int amber__store_state(amber_store *st, amber__err *e, uint64_t *step, uint64_t *state);
/* Commits a finished temporary file `tmp` as checkpoint `step`. */
int amber__commit_file(amber_store *st, amber__err *e, const char *tmp, uint64_t step);
/* amber_store_list and amber_store_prune, reporting into `e`. */
int amber__store_list(amber_store *st, amber__err *e, amber_ckpt_info **out, size_t *count);
int amber__store_prune(amber_store *st, amber__err *e, uint64_t keep_last, size_t *removed);

/* The index of the step a reader opened (for compaction). */
amber__index *amber__reader_index(amber_reader *r);
/* Restores only the chunks of tensor `index` whose byte in `want` (one per chunk)
 * is set, each into its place in `buf` (the whole tensor's size); the other bytes
 * of buf are not touched. A region read of a shard needs no more than that. */
int amber__reader_read_chunks(amber_reader *r, size_t index, const uint8_t *want, void *buf,
                              uint64_t size);
/* The sizes of the files of a reader's chain: its full checkpoint's, and the
 * number and total size of the deltas after it (for the writer's cadence). */
void amber__reader_chain_bytes(amber_reader *r, uint64_t *full_bytes, uint64_t *deltas,
                               uint64_t *delta_bytes);

#endif /* AMBER_STORE_H */

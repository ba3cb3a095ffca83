/*
 * tier.h - internal: storage tiers (docs/DESIGN.md, "Storage tiers"). A memory tier
 * is an ordinary store on a memory file system; the drain (src/drain.c) copies its
 * committed steps to a durable tier, pack/unpack (src/tpack.c) to a peer's replica.
 * What they share is here:
 *
 *  - a destination: where the durable tier lives, behind a small table of
 *    functions (put a whole file durably, stat, read, list, remove, claim), so that
 *    an object store can be one beside the directory (src/tdest.c) without the drain
 *    knowing which: a put's body is a buffer or a file read with pread, as the S3
 *    client's upload takes it (src/s3.h), so its parts can go in parallel;
 *  - a checkpoint file read with every checksum checked as its bytes pass (so a
 *    damaged memory file never becomes a durable one);
 *  - what a destination holds of one store (its files, checked once, and LATEST),
 *    and installing a step into it: the files its chain lacks, then the pointer;
 *  - the memory tier's TIERS file (FORMAT.md, "Storage tiers").
 */
#ifndef AMBER_TIER_H
#define AMBER_TIER_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "ckpt.h"
#include "internal.h"
#include "store.h"

/* ---- destinations ---- */

typedef struct amber__dest amber__dest;

/* What a put writes: `len` bytes of `buf`, or of the file `fd` from offset 0 when buf
 * is NULL (read with pread, so that a destination may read parts in parallel, or
 * again after a failure; the file must not change until the put returns). `wrote`
 * (may be NULL) hears of the bytes written as the put goes. */
typedef struct amber__body {
  const void *buf;
  int fd;
  uint64_t len;
  void (*wrote)(void *arg, uint64_t bytes);
  void *arg;
} amber__body;

/* Names are relative to the destination's root, with '/' between a rank store and
 * its file ("rank-00003/ckpt-...amber", "step-....manifest", "GLOBAL", "LATEST").
 * Every function reports its failure into `e`, naming the destination and the file. */
typedef struct amber__dest_ops {
  /* Writes object `name` from `body` so that it is visible whole or not at all, and
   * durable when put returns (a directory: a temporary file, fsync, rename over
   * `name`, fsync of its directory). AMBER_ENOSPC when the destination is full. */
  int (*put)(amber__dest *d, amber__err *e, const char *name, const amber__body *body);
  /* *size of `name`; AMBER_ENOENT when there is none. */
  int (*stat)(amber__dest *d, amber__err *e, const char *name, uint64_t *size);
  /* Reads `len` bytes at `off` of `name`: AMBER_ENOENT when there is none,
   * AMBER_ECORRUPT when it is shorter. */
  int (*read)(amber__dest *d, amber__err *e, const char *name, uint64_t off, void *buf,
              size_t len);
  /* The names directly under `prefix` ("" or "rank-00003/"), without it: *names
   * (one malloc'd array of *n strings, freed with amber__names_list_free). */
  int (*list)(amber__dest *d, amber__err *e, const char *prefix, char ***names,
              size_t *n);
  /* Removes `name`; no error when there is none. */
  int (*remove)(amber__dest *d, amber__err *e, const char *name);
  /* Claims store `store` ("" or "rank-00003") for this destination handle until it
   * closes, so that two drains never write one store at once (a directory: the
   * store's .lock, as a writer takes it): AMBER_ELOCKED when it is held. */
  int (*claim)(amber__dest *d, amber__err *e, const char *store);
  void (*close)(amber__dest *d);
} amber__dest_ops;

struct amber__dest {
  const amber__dest_ops *ops;
  char *where; /* the destination in messages (a path) */
};

/* Tests only: every put of a directory destination first waits `delay_us`; after
 * `after` more successful puts (-1: never) each put fails with errno `err`, as on a
 * full disk, until called again. */
void amber__tier_inject(int delay_us, int after, int err);
/* A destination over directory `root`, created (not its parents) when `create`. */
int amber__dest_dir_open(amber__dest **out, amber__err *e, const char *root, int create);
void amber__dest_close(amber__dest *d);
void amber__names_list_free(char **names, size_t n);
/* Puts `n` bytes from memory as `name`. */
int amber__dest_put_bytes(amber__dest *d, amber__err *e, const char *name, const void *p,
                          size_t n);
/* Reads object `name` whole, at most `max` bytes (AMBER_ECORRUPT when larger):
 * *out (malloc'd) of *len bytes; AMBER_ENOENT when there is none. */
int amber__dest_get(amber__dest *d, amber__err *e, const char *name, size_t max,
                    uint8_t **out, size_t *len);

/* ---- a checkpoint file read with its checksums checked ---- */

/* Reads opened checkpoint file `c` front to back, in blocks: every chunk's payload
 * checksum, the header, the index checksum and the footer are checked against what
 * the open decoded as the bytes pass (AMBER_ECORRUPT naming the file and the chunk),
 * so whoever pulls the last block has the whole file checked. Each pull gives the
 * next *n bytes at *p (valid until the next pull), *n 0 at the end. */
typedef struct amber__vsrc amber__vsrc;
int amber__vsrc_open(amber__vsrc **out, amber__err *e, const amber__ckpt *c);
int amber__vsrc_pull(amber__vsrc *v, amber__err *e, const void **p, size_t *n);
void amber__vsrc_close(amber__vsrc *v);
/* Reads `c` whole through a vsrc: 0 when every check passes. */
int amber__vsrc_check(amber__err *e, const amber__ckpt *c);

/* ---- what a destination holds of one store ---- */

typedef struct amber__known {
  uint64_t step, state;
  uint64_t parent, parent_state; /* AMBER_NO_STEP for a full file */
} amber__known;

/* One store of a destination (the single-rank store, or rank r's): the files known
 * to be there whole with their chains (each checked once, by its size, footer and
 * header, then remembered), its LATEST. */
typedef struct amber__dview {
  amber__dest *d;
  char prefix[24]; /* "" or "rank-RRRRR/" */
  amber__known *k; /* sorted by step */
  size_t n, cap;
} amber__dview;

void amber__dview_init(amber__dview *v, amber__dest *d, int32_t rank);
void amber__dview_free(amber__dview *v);
/* The name of checkpoint `step` of the view's store into buf. */
void amber__dview_name(const amber__dview *v, uint64_t step, char *buf, size_t len);
/* 1 when the destination holds step `step` with state id `state` and the whole
 * chain behind it, 0 when it does not, or a negative code when it cannot be read. */
int amber__dview_has(amber__dview *v, amber__err *e, uint64_t step, uint64_t state);
/* The store's LATEST: 0, AMBER_ENOENT when it has none, AMBER_ECORRUPT. */
int amber__dview_latest(amber__dview *v, amber__err *e, uint64_t *step, uint64_t *state);

/* Progress of the copies of one drain or pack: bytes and files copied; with
 * `total` set, each block is reported to the progress hook as "drain". */
typedef struct amber__tcount {
  uint64_t bytes, files, total;
} amber__tcount;

/* The chain of step `step` of store `st`, whose file must carry state id `state`:
 * its files opened and checked (header, footer, index, each link's state id), newest
 * first, back to its full checkpoint, or to the first step at or below `have`, or
 * (when `v` is given) to the first file that `v` holds with its chain. *out
 * (malloc'd, close each with amber__ckpt_close, then free) gets *n files. A missing
 * file is AMBER_EPARENT (AMBER_ENOENT for `step` itself), naming it. */
int amber__tier_chain(amber_store *st, amber__err *e, uint64_t step, uint64_t state,
                      uint64_t have, amber__dview *v, amber__ckpt **out, size_t *n);
void amber__tier_chain_free(amber__ckpt *c, size_t n);
/* Installs step `step` (state `state`) of memory store `st` into view `v`: every
 * file of its chain that `v` lacks, oldest first, each checked as it is copied;
 * then, when `pointer`, the store's LATEST. Between files it stops when *stop is set
 * (AMBER_ECANCELED). Failures name the file and the tier. */
int amber__tier_install(amber_store *st, amber__dview *v, amber__err *e, uint64_t step,
                        uint64_t state, int pointer, const atomic_int *stop,
                        amber__tcount *cnt);

/* ---- the TIERS file of a memory tier ---- */

/* Records durable tier `durable` in memory directory `memory` (atomically). */
int amber__tiers_write(amber__err *e, const char *memory, const char *durable);
/* The durable tier recorded in `memory`: *durable (malloc'd); AMBER_ENOENT, ECORRUPT. */
int amber__tiers_read(amber__err *e, const char *memory, char **durable);

#endif /* AMBER_TIER_H */

/*
 * store.h - internal: the store directory (src/store.c): the handle, checkpoint
 * paths, LATEST, commit, listing and prune; and what the writer and compaction
 * learn from a reader of a step (its index, its chain's sizes).
 */
#ifndef AMBER_STORE_H
#define AMBER_STORE_H

#include <stdatomic.h>
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
  struct amber__s3 *s3; /* an s3:// store (src/s3store.c): its client, whose prefix is
                           the store's; dirfd and lockfd are then -1 */
};

/* Whether the store was opened to be changed: its lock held, or an s3:// store opened
 * writable (by maintenance: an object store has no lock). */
int amber__store_writable(const amber_store *st);

/* 1 when `name` is a checkpoint file's name ("ckpt-<20 digits>.amber"), its step
 * in *step. */
int amber__parse_ckpt_name(const char *name, uint64_t *step);
/* Builds "<store>/ckpt-<step>.amber" (or with suffix) into buf. */
void amber__ckpt_path(const amber_store *st, uint64_t step, const char *suffix,
                      char *buf, size_t len);
/* The store's internal operations report failures into `e`, the error of the
 * handle on whose behalf they run (a reader, a writer's background work, or the
 * store itself; NULL: the thread's message only), so that handles used from
 * separate threads never write one message buffer. */

/* LATEST's bytes, both ways: the line "<step> <16 hex digits>\n" of (step, state)
 * into buf (returns its length); and `n` bytes of one, checked (`what` names it in
 * messages: AMBER_ECORRUPT when malformed). */
#define AMBER__LATEST_MAX 64
size_t amber__latest_encode(uint64_t step, uint64_t state, char buf[AMBER__LATEST_MAX]);
int amber__latest_decode(amber__err *e, const char *what, const char *buf, size_t n,
                         uint64_t *step, uint64_t *state);
/* Reads LATEST: 0 and step/state, AMBER_ENOENT when absent, ECORRUPT if malformed. */
int amber__read_latest(amber_store *st, amber__err *e, uint64_t *step, uint64_t *state);
/* Atomically points LATEST at (step, state): tmp, fsync, rename, fsync dir. */
int amber__write_latest(amber_store *st, amber__err *e, uint64_t step, uint64_t state);
/* The committed state: 0 and LATEST's step and state id; AMBER_ENOENT when the
 * store is empty (no LATEST and at most the one file of an unfinished first
 * commit); AMBER_ECORRUPT when LATEST is malformed, or missing while two or
 * more checkpoint files exist. */
int amber__store_state(amber_store *st, amber__err *e, uint64_t *step, uint64_t *state);
/* amber_store_open; with `clean` 0 a writable open takes the lock but leaves
 * what crashed writers left (amber__store_clean removes it later): for a caller
 * that first repairs LATEST from what it knows (a multi-rank store's manifests),
 * so that a committed file never looks like a first commit's leftover. */
int amber__store_open(amber_store **out, const char *path, const amber_store_opts *opts,
                      int clean);
/* Removes *.tmp files, files after a confirmed LATEST and the lone file of an
 * unfinished first commit (what amber_store_open does when writable). Lock held. */
int amber__store_clean(amber_store *st);
/* Number of ckpt-*.amber files in directory `dir` (committed or not; 0 when it
 * cannot be read); *only (may be NULL) receives the step of the last one seen. */
size_t amber__count_ckpt_files(const char *dir, uint64_t *only);
/* 1 when checkpoint `step`'s file exists and its footer holds state id `state`. */
int amber__ckpt_has_state(amber_store *st, uint64_t step, uint64_t state);
/* Commits a finished temporary file `tmp` as checkpoint `step`. */
int amber__commit_file(amber_store *st, amber__err *e, const char *tmp, uint64_t step);
/* The steps of the checkpoint files of the store up to `upto`, sorted: *out
 * (malloc'd) of *count. */
int amber__store_steps(amber_store *st, amber__err *e, uint64_t upto, uint64_t **out,
                       size_t *count);
/* amber_store_list and amber_store_prune, reporting into `e`. */
int amber__store_list(amber_store *st, amber__err *e, amber_ckpt_info **out, size_t *count);
int amber__store_prune(amber_store *st, amber__err *e, uint64_t keep_last, size_t *removed);

/* Opens a reader of step `step`, whose file must carry state id `state`, without
 * LATEST: for a caller that knows the step from elsewhere (a multi-rank store's
 * manifest, named `who` in messages). The chain is checked as amber_reader_open
 * checks it. */
int amber__reader_open_at(amber_reader **out, amber_store *st, uint64_t step, uint64_t state,
                          const char *who);
/* The same, from the step's own files only (never an image), `state` checked. */
int amber__reader_open_files(amber_reader **out, amber_store *st, uint64_t step,
                             uint64_t state);
/* The index of the step a reader opened (for compaction). */
amber__index *amber__reader_index(amber_reader *r);

/* Writes the restored state of the reader's step as a full checkpoint of raw chunks
 * with state id `state_id` into a new temporary file next to `dst`, named into `tmp`
 * (4200 bytes), reporting progress as `progress` (NULL: none). src/maint.c. */
int amber__write_restored(amber__err *e, amber_reader *r, uint64_t state_id, const char *dst,
                          char *tmp, const char *progress);

/* ---- applying a chunk outside a restore (src/reader.c, for src/image.c) ---- */
typedef struct amber__applier amber__applier;
struct amber__ckpt;
int amber__applier_create(amber__applier **out);
void amber__applier_free(amber__applier *a);
/* Decodes chunk `j` of tensor `tensor` of file `c` onto `dst` (the chunk's bytes,
 * holding its parent's values for a delta), as a restore does. */
int amber__applier_apply(amber__applier *a, amber__err *e, struct amber__ckpt *c, size_t tensor,
                         uint64_t j, uint8_t *dst);

/* ---- the image of a memory tier's store (src/image.c) ----
 *
 * The drain of a memory tier keeps, in each store it drains, "image.amber": the
 * newest step's state as one full checkpoint of raw chunks with that step's state id,
 * so that a restart restores it by reading one file instead of the full checkpoint
 * and every delta after it. The image is brought forward in place, delta by delta,
 * under an exclusive flock; its header is invalid while that runs, so a crash leaves
 * a file no reader takes (and the next drain rebuilds it). A reader takes it, under
 * a shared flock, in place of the delta file of the same step and state id. */
void amber__image_path(const char *store, char *buf, size_t len);
typedef struct amber__image amber__image;
int amber__image_create(amber__image **out, const char *store);
void amber__image_free(amber__image *im);
/* Brings the image of store `st` to its LATEST, where it takes at most `room` bytes
 * (else there is none): 0 (also when it could not, for now: a reader holds it, or
 * the step does not restore; the files serve restores then), AMBER_ECANCELED when
 * *stop was set, AMBER_ENOMEM. *bytes (may be NULL) gets the image's size, 0 when
 * there is none. */
int amber__image_update(amber__image *im, amber_store *st, const atomic_int *stop,
                        uint64_t room, uint64_t *bytes);
/* 1 when there is nothing for amber__image_update to do: the image holds the store's
 * LATEST (or the store has none, or its LATEST could not be imaged). Reads LATEST only. */
int amber__image_current(amber__image *im, amber_store *st);
/* The step the image holds (AMBER_NO_STEP: none), and its size (0: none). */
uint64_t amber__image_step(const amber__image *im);
uint64_t amber__image_bytes(const amber__image *im);

/* ---- restores of boxes (src/reader.c): the one load path of every reader ----
 *
 * A part is a box of one stored tensor (of reader `r`) and where it goes: the box
 * `n` at `so` of the stored tensor (shape `ss`, the tensor's own) lands at `doff`
 * in `dst`, a row-major buffer of shape `ds`. A part is planned into one job per
 * chunk of the stored tensor that holds part of the box: a chunk that lies inside
 * one contiguous run of the box (every chunk of a whole tensor, or of a shard's
 * rows) is restored straight into its place in `dst`; the few others (a box's edge,
 * a column slice) are restored into the worker's scratch and their part copied.
 * Every job, of every part and every reader, runs in one parallel loop. */
typedef struct amber__part {
  amber_reader *r;
  size_t tensor;  /* index in r's step */
  uint32_t ndim;
  int64_t ss[AMBER_MAX_DIMS], so[AMBER_MAX_DIMS], n[AMBER_MAX_DIMS];
  uint8_t *dst;
  int64_t ds[AMBER_MAX_DIMS], doff[AMBER_MAX_DIMS];
  const char *name; /* for messages: the global tensor's name (NULL: none) */
  int64_t rank;     /* for messages: the rank whose file holds it (-1: none) */
} amber__part;

/* Worker threads with their decode buffers, and the jobs of the loop in progress
 * (reused from loop to loop). One per reader, and one per global reader. */
typedef struct amber__rpool amber__rpool;
/* threads: 0 for the default (the online CPUs, at least 4: a restore waits on the
 * disk and wants more reads in flight than there are cores). A restore from an
 * s3:// store waits on the network: AMBER__S3_READ_THREADS workers, each fetching its
 * chunk's payloads of the whole chain at once. */
#define AMBER__S3_READ_THREADS 16
int amber__rpool_create(amber__rpool **out, uint32_t threads);
void amber__rpool_destroy(amber__rpool *p);
/* Restores the parts (their boxes are checked by the caller) in one parallel loop.
 * On failure: the first failure's code, its message in `e` (prefixed by the part's
 * name and rank); buffers may hold part of their data. */
int amber__read_parts(amber__rpool *p, amber__err *e, const amber__part *parts, size_t n);
/* The sizes of the files of a reader's chain: its full checkpoint's, and the
 * number and total size of the deltas after it (for the writer's cadence). */
void amber__reader_chain_bytes(amber_reader *r, uint64_t *full_bytes, uint64_t *deltas,
                               uint64_t *delta_bytes);

#endif /* AMBER_STORE_H */

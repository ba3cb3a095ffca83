/*
 * s3store.h - internal: stores in an object store, "s3://bucket/prefix" (src/s3store.c).
 * The layout is a directory store's, one object per file, keyed by the file's path
 * under the prefix (FORMAT.md, "Object stores"). What src/store.c, src/ckpt.c,
 * src/manifest.c and the maintenance do with files, they do with objects through
 * these functions when a path is an s3:// URL; the protocol is the S3 client's
 * (src/s3.h).
 *
 * Nothing here writes a step: a writer writes into a directory, and a drain moves
 * its committed steps to the object store by the commit rule for objects (the
 * destination of src/s3dest.c). What maintenance writes (compact's full file, a
 * manifest that says full) is uploaded whole and confirmed (size and checksum read
 * back) before anything names it.
 */
#ifndef AMBER_S3STORE_H
#define AMBER_S3STORE_H

#include <stddef.h>
#include <stdint.h>

#include "s3.h"
#include "store.h"

/* 1 when `path` names a store in an object store ("s3://..."). */
int amber__is_s3(const char *path);

/* ---- a store of one process (or a rank store) over S3 ---- */

/* The object key of checkpoint `step` ("ckpt-<20 digits>.amber") into buf. */
void amber__s3store_ckpt_key(uint64_t step, char *buf, size_t len);
/* amber_store_open of st->path, an s3:// URL: opens the client (st->s3) and makes the
 * checks a directory open makes (a multi-rank store is refused; a read-only open
 * needs something under the prefix: AMBER_ENOENT "no store at URL"). Reports into
 * the thread's error. */
int amber__s3store_open(amber_store *st);
/* LATEST: 0 and step/state, AMBER_ENOENT when absent, ECORRUPT when malformed. */
int amber__s3store_read_latest(amber_store *st, amber__err *e, uint64_t *step,
                               uint64_t *state);
/* Number of checkpoint objects (committed or not). */
int amber__s3store_count(amber_store *st, amber__err *e, size_t *n);
/* The checkpoint objects up to step `upto`, sorted: *steps and (when not NULL) *sizes
 * (malloc'd) of *n. */
int amber__s3store_steps(amber_store *st, amber__err *e, uint64_t upto, uint64_t **steps,
                         uint64_t **sizes, size_t *n);
/* amber_store_list's entries of `n` checkpoints of known sizes: each one's header
 * and footer (ranged GETs, many at once); a damaged or unreadable one is flagged. */
void amber__s3store_peek(amber_store *st, const uint64_t *steps, const uint64_t *sizes,
                         size_t n, amber_ckpt_info *info);
/* Removes checkpoint `step`'s object. */
int amber__s3store_remove(amber_store *st, amber__err *e, uint64_t step);
/* Uploads the finished local file `tmp` as checkpoint `step` (replacing the object
 * there, which S3 does atomically), confirms it, and removes `tmp` either way. */
int amber__s3store_commit_file(amber_store *st, amber__err *e, const char *tmp,
                               uint64_t step);

/* ---- a multi-rank store's objects, by path ("s3://bucket/prefix/GLOBAL") ---- */

/* Reads object `path` whole, at most `max` bytes (AMBER_ECORRUPT when larger;
 * AMBER_ENOENT when missing): *out (malloc'd) of *len bytes. */
int amber__s3_read_small(const char *path, amber__err *e, uint8_t **out, size_t *len,
                         size_t max);
/* Uploads `len` bytes as object `path` and confirms them. */
int amber__s3_write_small(const char *path, amber__err *e, const void *data, size_t len);
/* Removes object `path` (no error when there is none). */
int amber__s3_remove_path(const char *path, amber__err *e);
/* 1 when some object lies under `path` + "/" (a rank store), 0 when none, or < 0. */
int amber__s3_has_dir(const char *path);
/* The steps of the manifests of store `path` up to `upto`, sorted. */
int amber__s3_manifest_steps(const char *path, uint64_t upto, uint64_t **steps,
                             size_t *n);
/* What a multi-rank store holds besides GLOBAL: its manifests, and the most
 * checkpoint objects of one rank store (and that rank). */
int amber__s3_global_counts(const char *path, amber__err *e, size_t *manifests,
                            size_t *files, uint32_t *rank);
/* 1 when `path` holds GLOBAL or a rank store rank-00000/. */
int amber__s3_is_global(const char *path);

#endif /* AMBER_S3STORE_H */

/*
 * global.h - what the multi-rank files share inside the library: the manifest of
 * a global step (src/manifest.c owns its bytes both ways), the global LATEST
 * pointer, the store's paths, and the variable-length allgather over amber_comm
 * (src/comm.c). Not part of the public API.
 */
#ifndef AMBER_GLOBAL_H
#define AMBER_GLOBAL_H

#include "internal.h"
#include "io.h"
#include "store.h"

/* ---- collectives (src/comm.c) ---- */

/* Allgather of blobs of any length: *out (malloc'd, caller frees) gets the
 * `size` blobs one after another; lens[r] (caller's array of comm->size) and
 * offs[r] their lengths and offsets. */
int amber__comm_allgatherv(const amber_comm *c, amber__err *e, const void *send, size_t len,
                           uint8_t **out, uint64_t *lens, uint64_t *offs);
/* Checks a communicator given by a caller. */
int amber__comm_check(const amber_comm *c, amber__err *e);
/* Every rank's outcome `rc` (its message in e when < 0) to every rank: returns the
 * lowest failing rank's code with its message "rank R: REASON" in e, the same on
 * every rank; 0 when every rank succeeded. When the exchange itself fails, returns
 * its code (e says why) with *broken (may be NULL) set. Collective. */
int amber__comm_agree(const amber_comm *c, amber__err *e, int rc, int *broken);
/* Checks a point-to-point exchange given by a caller. */
int amber__p2p_check(const amber_p2p *p, amber__err *e);

/* ---- manifest (src/manifest.c) ---- */

#define AMBER__MF_MAGIC "AMBERMF1"
#define AMBER__MF_HEADER 56
#define AMBER__MF_RANK 32
#define AMBER__MF_TENSOR 16
#define AMBER__MF_MAX_WORLD (1u << 20)

#define AMBER__RANK_PRESENT 1u /* the rank wrote a file for the step */

typedef struct amber__mrank {
  uint64_t step;  /* the step of the rank's own store that holds its part */
  uint64_t hash;  /* its state id (LATEST's) */
  uint64_t bytes; /* its file's size */
  uint32_t kind;
  uint32_t flags; /* AMBER__RANK_* */
} amber__mrank;

typedef struct amber__mshard {
  uint32_t rank;
  /* Its place among its rank's shards of the tensor, in the manifest's order (0: the
   * first): the rank's file holds it under amber__box_file_name(tensor, ord). Not
   * stored: amber__manifest_number_shards derives it. */
  uint32_t ord;
  int64_t off[AMBER_MAX_DIMS];
  int64_t shape[AMBER_MAX_DIMS];
} amber__mshard;

typedef struct amber__mtensor {
  char *name;
  int dtype;
  uint32_t ndim;
  uint32_t flags; /* AMBER_SHARD_REPLICATED */
  int64_t shape[AMBER_MAX_DIMS];
  uint32_t nshards;
  amber__mshard *shards;
} amber__mtensor;

typedef struct amber__manifest {
  uint64_t step, parent;
  uint32_t world, kind;
  amber__mrank *ranks;   /* world entries */
  uint32_t ntensors;
  amber__mtensor *tensors;
} amber__manifest;

/* The manifest's format_minor: 2 where each rank holds at most one shard of each
 * tensor (readers of 1.2 and 1.3 read it), 4 where one holds several (they refuse
 * it, rather than read one box's file tensor for another). */
#define AMBER__MF_MINOR 2
#define AMBER__MF_MINOR_BOXES 4

/* Numbers the shards of every tensor of `m` among their rank's (mshard.ord) and sets
 * *several when a rank holds more than one shard of a tensor. 0 or AMBER_ENOMEM. */
int amber__manifest_number_shards(const amber__manifest *m, int *several);
/* Whether boxes a and b (offsets, shapes; ndim dims) share an element (an empty box
 * shares none). */
int amber__boxes_meet(const int64_t *aoff, const int64_t *ashape, const int64_t *boff,
                      const int64_t *bshape, uint32_t ndim);
/* "[a, b, ...]" of n values into buf, for messages. */
void amber__dims_text(const int64_t *v, uint32_t n, char *buf, size_t len);

/* The shards of `t` tile it: no two share an element, and their volumes add up to
 * the tensor's (each lies inside it). 0, or AMBER_EMISMATCH with `why` naming the
 * tensor and, for an overlap, both shards (AMBER_ENOMEM). */
int amber__mtensor_check_tiling(const amber__mtensor *t, char *why, size_t wl);
/* Encodes `m`: *out (malloc'd) of *len bytes. */
int amber__manifest_encode(const amber__manifest *m, amber__err *e, uint8_t **out,
                           size_t *len);
/* Decodes and checks `len` bytes; `what` names the file in messages. On success the
 * caller owns *m (release with amber__manifest_free). */
int amber__manifest_decode(amber__err *e, const char *what, const uint8_t *in, size_t len,
                           amber__manifest *m);
void amber__manifest_free(amber__manifest *m);

/* ---- the box table of a rank's file (src/manifest.c) ----
 *
 * The global writer adds to each rank's file a u8 tensor AMBER__BOXES_NAME that
 * records, for every tensor of the file, the box it holds of its global tensor;
 * the global reader checks each manifest shard against it, so that a manifest
 * whose shards were moved or swapped between ranks is refused (FORMAT.md, "Many
 * ranks"). A rank's first box of a global tensor is the file's tensor of that
 * name; its k-th (k >= 1, in declaration order, which is the manifest's order of
 * the rank's shards) is AMBER__BOXES_NAME "/<k>/<name>", a name that no global
 * tensor may take. */

#define AMBER__BOXES_NAME "amber.boxes"
#define AMBER__BOXES_MAGIC "AMBERBX1"
#define AMBER__BOXES_HEADER 16
/* A box table holds at most this many bytes (a reader refuses a larger one). */
#define AMBER__BOXES_MAX (UINT64_C(1) << 30)

typedef struct amber__box {
  const char *name; /* name_len bytes, not NUL-terminated */
  size_t name_len;
  uint32_t ndim;
  int64_t shape[AMBER_MAX_DIMS]; /* the global tensor's */
  int64_t off[AMBER_MAX_DIMS];   /* where the file's tensor lies in it */
} amber__box;

/* Encodes `n` boxes: *out (malloc'd) of *len bytes. */
int amber__boxes_encode(const amber__box *b, size_t n, amber__err *e, uint8_t **out,
                        size_t *len);
/* Decodes and checks a table of `len` bytes (`what` names it in messages): *out
 * (malloc'd; names point into `in`, which must outlive it) gets *count boxes,
 * sorted by name, for amber__boxes_find. */
int amber__boxes_decode(amber__err *e, const char *what, const uint8_t *in, size_t len,
                        amber__box **out, size_t *count);
const amber__box *amber__boxes_find(const amber__box *b, size_t n, const char *name);
/* Whether `name` is amber's own in a rank's file (the box table's, or the reserved
 * form of a later box's): a global tensor may not be named so. */
int amber__box_name_reserved(const char *name);
/* The name of a rank's box `ord` of global tensor `name` in its file: `name` for 0,
 * else "amber.boxes/<ord>/<name>" (malloc'd; NULL when out of memory). */
char *amber__box_file_name(const char *name, uint32_t ord);

/* ---- store paths and the global LATEST (src/manifest.c) ---- */

/* 1 when `name` is a manifest's file name ("step-<20 digits>.manifest"), its step
 * in *step. */
int amber__parse_manifest_name(const char *name, uint64_t *step);
/* The latest committed global step of `store`, as amber__store_state is for one
 * store: 0 and *step; AMBER_ENOENT when it has none (no GLOBAL, and at most what a
 * crash in the first global commit leaves: one manifest, one file per rank
 * store); AMBER_ECORRUPT when GLOBAL is damaged, or missing while the store holds
 * more (the message says what). */
int amber__global_state(const char *store, amber__err *e, uint64_t *step);

/* The steps of the manifests in directory `path` up to `upto`, sorted: *steps
 * (malloc'd) of *n. */
int amber__manifest_steps(const char *path, uint64_t upto, uint64_t **steps, size_t *n);
/* 1 when `name` is a rank store's directory name ("rank-" and five to seven digits),
 * its rank in *rank. */
int amber__parse_rank_name(const char *name, uint32_t *rank);
void amber__global_manifest_path(const char *store, uint64_t step, char *buf, size_t len);
void amber__global_rank_path(const char *store, uint32_t rank, char *buf, size_t len);
/* GLOBAL's bytes, both ways: the 24 bytes that point at `step`; and `len` bytes of
 * one, checked (`what` names it: AMBER_ECORRUPT when damaged). */
#define AMBER__GLOBAL_SIZE 24
void amber__global_encode(uint64_t step, uint8_t out[AMBER__GLOBAL_SIZE]);
int amber__global_decode(amber__err *e, const char *what, const uint8_t *b, size_t len,
                         uint64_t *step);
/* Reads STORE/GLOBAL: 0 and the step; AMBER_ENOENT when absent. */
int amber__global_read_latest(const char *store, amber__err *e, uint64_t *step);
/* Atomically points STORE/GLOBAL at `step` (tmp, fsync, rename, fsync dir). */
int amber__global_write_latest(const char *store, amber__err *e, uint64_t step);
/* Reads file `path` whole, at most `max` bytes (AMBER_ECORRUPT when larger; AMBER_ENOENT
 * when missing): *out (malloc'd) of *len bytes. */
int amber__read_small(const char *path, amber__err *e, uint8_t **out, size_t *len, size_t max);
/* Writes `len` bytes as file `path` atomically and durably. */
int amber__write_file_durable(const char *dir, const char *path, amber__err *e,
                              const void *data, size_t len);
/* Reads and decodes the manifest of `step`. */
int amber__global_load_manifest(const char *store, uint64_t step, amber__err *e,
                                amber__manifest *m);
/* Reads the manifest of `step` and checks that it decodes: *out (malloc'd; may be
 * NULL: not kept) gets its bytes, *len their count, *m (may be NULL) the decoded
 * manifest (release with amber__manifest_free). For a copy of it elsewhere. */
int amber__global_manifest_bytes(const char *store, uint64_t step, amber__err *e, uint8_t **out,
                                 size_t *len, amber__manifest *m);

#endif /* AMBER_GLOBAL_H */

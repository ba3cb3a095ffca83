/*
 * gwriter.h - the global writer's handle, shared by its two files: src/gopen.c
 * (opening: the store checked, this rank's store made, repaired and cleaned) and
 * src/global.c (declarations, saves and the global commit). Not part of the
 * public API.
 */
#ifndef AMBER_GWRITER_H
#define AMBER_GWRITER_H

#include <pthread.h>

#include "cadence.h"
#include "global.h"

typedef struct gtensor {
  char *name;
  /* Its place among this rank's boxes of the tensor (declaration order), and the
   * name of its tensor in this rank's files when that is not `name`: a rank's
   * second and later boxes of a tensor (amber__box_file_name). */
  uint32_t ord;
  char *file;
  int dtype;
  uint32_t ndim, flags;
  int64_t gshape[AMBER_MAX_DIMS], off[AMBER_MAX_DIMS], lshape[AMBER_MAX_DIMS];
  const void *data;
  int local;  /* written by this rank */
  int presel; /* pre-selected: the caller selects, and keeps its reference */
  amber_chunk_source src; /* pre-selected: its source of selections, or NULL */
  void *src_user;
  double unit; /* amber_global_writer_set_units */
} gtensor;

struct amber_global_writer {
  amber__err err; /* first: amber_last_error reads it */
  amber_comm comm;
  char *path;
  char rankdir[4096];
  amber_writer_opts opts; /* the rank writers' */
  uint32_t full_every;    /* the step's cadence: deltas between fulls at most */
  amber__cadence share;   /* and this rank's full_share (its own files' bytes) */
  amber_store *st;
  amber_writer *w; /* NULL until the first save, and after a rollback */
  gtensor *t;
  size_t nt;
  char **pol;
  size_t npol;
  uint8_t *boxes; /* the box table of this rank's files (its last tensor), or NULL */
  size_t boxes_len;
  char *meta; /* this rank's metadata for its files (amber_global_writer_set_meta) */
  size_t meta_len;
  int has_meta;
  int saved;                 /* a save or plan was begun: declarations are fixed */
  uint64_t latest;           /* the last global commit, AMBER_NO_STEP for none */
  uint32_t deltas;           /* delta steps since the last full step */
  int force_full;            /* after a failed step */
  struct { /* amber_global_writer_plan's decision for the next save */
    int set, full;
    uint64_t step;
    uint32_t flags;
  } plan;
  /* the save in progress */
  int busy, begin_rc, present, full, gated;
  uint64_t step;
  uint64_t prev_step, prev_state; /* the rank store's LATEST before it */
  char begin_msg[256];
  double t_begin;               /* when the save in progress began */
  /* With an AMBER_COMM_ANY_THREAD communicator: the commit of the save in progress
   * runs on this thread, started by fence and joined by wait; until then the
   * training thread touches nothing that it uses (w, st, the step's state). */
  pthread_t committer;
  int committing, commit_rc;
  int drop_w; /* the rank writer is to be closed (after a failed step) */
  /* Retention (opts.keep_last): after each committed step rank 0 removes the
   * manifests of the steps before the newest keep_last, then every rank prunes its
   * own store, keeping what the kept steps need. */
  uint64_t keep_last;
  int prune_rc;         /* this rank's part of the prune after the last commit */
  size_t pruned;        /* files it removed (on rank 0: manifests too) */
  amber__err prune_err; /* its message when it failed */
  amber_global_save_stats stats; /* of the last save */
};

/* Moves the rank store's LATEST back to `step` (state `state`; AMBER_NO_STEP:
 * empty) and removes its files of later steps. The rank writer must be idle. */
int amber__gw_rank_rollback(amber_global_writer *gw, uint64_t step, uint64_t state);

#endif /* AMBER_GWRITER_H */

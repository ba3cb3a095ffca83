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

/* Local mode (AMBER_WRITER_GLOBAL_LOCAL, src/glocal.c): what open agreed on. */
typedef struct amber__gw_local {
  int on;
  uint64_t had;      /* this path's GLOBAL before the agreement (AMBER_NO_STEP: none) */
  uint8_t *install;  /* the agreed step's manifest, when this path lacks it */
  size_t install_len;
} amber__gw_local;

struct amber_global_writer {
  amber__err err; /* first: amber_last_error reads it */
  amber_comm comm;
  char *path;
  amber__gw_local local;
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
/* Writes the rank store's LATEST again from the manifests of gw->path when it is
 * missing or damaged while its files are there (src/gopen.c). */
int amber__gw_repair_rank_latest(amber_global_writer *gw);

/* ---- retention (src/global.c) ---- */

/* The oldest step that the newest keep_last steps of gw->path keep (AMBER_NO_STEP:
 * nothing to prune, or the listing failed: gw->prune_rc says). */
uint64_t amber__gw_oldest_kept(amber_global_writer *gw);
/* Removes the manifests of gw->path of steps before `oldest` (counted in gw->pruned). */
int amber__gw_remove_manifests_before(amber_global_writer *gw, uint64_t oldest);

/* ---- local mode (src/glocal.c) ---- */

/* At open, after the first round: every rank's path and rank store reported to
 * every rank, and the committed step agreed (docs/DESIGN.md, "Local mode"): the
 * newest step whose manifest some path holds and whose every rank's part is in its
 * rank's store. Sets gw->latest, and gw->local.install when this path lacks the
 * agreed manifest. Collective; the same result on every rank. */
int amber__gw_local_agree(amber_global_writer *gw);
/* At open, after amber__gw_local_agree: this path made to say the agreed step (its
 * manifest installed, GLOBAL moved to it, later manifests removed). Not collective. */
int amber__gw_local_install(amber_global_writer *gw);
/* At commit, once rank 0's manifest of the step is built (`bytes`, `len`: rank 0's
 * encoding; NULL on the other ranks): the bytes broadcast, every rank's copy of the
 * manifest and GLOBAL written to its path, every rank's outcome exchanged. *bad
 * gets the lowest rank whose copy failed (-1: none), *brc its code and `why` its
 * message; then every rank has taken its copy back. *oldest gets the oldest step
 * that retention keeps (rank 0's listing). Returns 0, or a collective's failure
 * (the outcome unknown). Collective. */
int amber__gw_local_copy(amber_global_writer *gw, const uint8_t *bytes, uint64_t len, int *bad,
                         int *brc, char *why, size_t wl, uint64_t *oldest);

#endif /* AMBER_GWRITER_H */

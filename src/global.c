/*
 * global.c - the global writer: one rank's part of a many-rank checkpoint and the
 * global commit (docs/DESIGN.md, "Many ranks"). Each rank writes its own store,
 * STORE/rank-RRRRR/, with an ordinary amber_writer (chunks, checksums, policies,
 * deltas: everything a single-rank save has); the global commit then exchanges
 * every rank's status and state id with one allgather, rank 0 writes the step's
 * manifest durably and moves STORE/GLOBAL, and a broadcast tells every rank the
 * outcome. A step that fails anywhere is rolled back everywhere (unless a collective
 * itself failed: see fail_local): each rank moves
 * its store's LATEST back and removes its file of the step, and the next step is
 * full on every rank.
 */
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gwriter.h"
#include "writer.h"

void amber_global_writer_close(amber_global_writer *gw) {
  if (!gw) return;
  if (gw->committing) pthread_join(gw->committer, NULL);
  amber_writer_close(gw->w);
  amber_store_close(gw->st);
  for (size_t i = 0; i < gw->nt; i++) free(gw->t[i].name), free(gw->t[i].file);
  for (size_t i = 0; i < gw->npol; i++) free(gw->pol[i]);
  free(gw->t);
  free(gw->pol);
  free(gw->meta);
  free(gw->boxes);
  free(gw->local.install);
  free(gw->path);
  free(gw);
}

/* Tensor `index`'s index in the rank writer: its local tensors in declaration order. */
static size_t local_index(const amber_global_writer *gw, size_t index) {
  size_t li = 0;
  for (size_t i = 0; i < index; i++) li += gw->t[i].local != 0;
  return li;
}

/* Where a call on the caller's thread records its failure: the handle, except while
 * the committer thread runs (it records the save's outcome there), when only the
 * thread's own message (amber_last_error(NULL)) takes it. */
static amber__err *caller_err(amber_global_writer *gw) {
  return gw->committing ? NULL : &gw->err;
}

int amber_global_writer_set_data(amber_global_writer *gw, size_t index, const void *data) {
  if (index >= gw->nt)
    return amber__fail(&gw->err, AMBER_ERANGE, "tensor index %zu out of range (%zu declared)",
                       index, gw->nt);
  if ((gw->busy && gw->present && !gw->begin_rc) || gw->committing)
    return amber__fail(caller_err(gw), AMBER_EBUSY, "tensor '%s': a save is in progress",
                       gw->t[index].name);
  if (gw->t[index].presel)
    return amber__fail(&gw->err, AMBER_EINVAL,
                       "tensor '%s' is pre-selected: it has no memory for amber to read",
                       gw->t[index].name);
  gw->t[index].data = data;
  if (!gw->w || !gw->t[index].local) return 0;
  int rc = amber_writer_set_data(gw->w, local_index(gw, index), data);
  return rc < 0 ? amber__fail(&gw->err, rc, "%s", amber_last_error(gw->w)) : 0;
}

int amber_global_writer_set_meta(amber_global_writer *gw, const char *json, size_t len) {
  if (len && !json) return amber__fail(&gw->err, AMBER_EINVAL, "set_meta: NULL metadata");
  char *m = NULL;
  if (len) {
    if (!(m = malloc(len))) return amber__fail(&gw->err, AMBER_ENOMEM, "out of memory");
    memcpy(m, json, len);
  }
  free(gw->meta);
  gw->meta = m, gw->meta_len = len, gw->has_meta = len != 0;
  return 0;
}

/* The name of tensor `t` in this rank's files. */
static const char *file_name(const gtensor *t) {
  return t->file ? t->file : t->name;
}

/* "at [o, ...] of shape [s, ...]" of t's box, for messages. */
static void box_text(const gtensor *t, char *buf, size_t len) {
  char o[200], s[200];
  amber__dims_text(t->off, t->ndim, o, sizeof o);
  amber__dims_text(t->lshape, t->ndim, s, sizeof s);
  snprintf(buf, len, "%s at %s of shape %s",
           t->flags & AMBER_SHARD_REPLICATED ? "replicated (the whole tensor)" : "the box", o,
           s);
}

/* Whether `b`, a new declaration of the name of `a`, an earlier one of this rank,
 * may join it: another box of the same global tensor (dtype, global shape), apart
 * from it, and neither replicated. 0, or the refusal naming both boxes. */
static int check_another_box(amber_global_writer *gw, const gtensor *a, const gtensor *b) {
  int repl = ((a->flags | b->flags) & AMBER_SHARD_REPLICATED) != 0;
  int same = a->dtype == b->dtype && a->ndim == b->ndim;
  for (uint32_t d = 0; same && d < a->ndim; d++) same = a->gshape[d] == b->gshape[d];
  if (!repl && same && !amber__boxes_meet(a->off, a->lshape, b->off, b->lshape, a->ndim))
    return 0;
  char at[512], bt[512], ag[200], bg[200];
  box_text(a, at, sizeof at), box_text(b, bt, sizeof bt);
  if (repl)
    return amber__fail(&gw->err, AMBER_EEXIST, "tensor '%s' declared twice on this rank: %s, "
                       "then %s (a replicated tensor is declared once, and with no box)",
                       a->name, at, bt);
  if (same)
    return amber__fail(&gw->err, AMBER_EEXIST, "tensor '%s': %s overlaps %s that this rank "
                       "declared before (a rank's boxes of a tensor are disjoint)", a->name,
                       bt, at);
  amber__dims_text(a->gshape, a->ndim, ag, sizeof ag);
  amber__dims_text(b->gshape, b->ndim, bg, sizeof bg);
  return amber__fail(&gw->err, AMBER_EINVAL, "tensor '%s': %s is declared as %s of global "
                     "shape %s, but %s on this rank as %s of global shape %s (every box of a "
                     "tensor has its dtype and global shape)", a->name, bt,
                     amber_dtype_name(b->dtype), bg, at, amber_dtype_name(a->dtype), ag);
}

/* Checks `g`, whose name this rank may have declared before, against those
 * declarations, and gives it its place among them and its name in the rank's
 * files. */
static int place_box(amber_global_writer *gw, gtensor *g, const char *name) {
  g->ord = 0;
  for (size_t i = 0; i < gw->nt; i++) {
    if (strcmp(gw->t[i].name, name)) continue;
    int rc = check_another_box(gw, &gw->t[i], g);
    if (rc < 0) return rc;
    g->ord++;
  }
  if (!g->ord) return 0;
  if (!(g->file = amber__box_file_name(name, g->ord)))
    return amber__fail(&gw->err, AMBER_ENOMEM, "out of memory");
  if (strlen(g->file) > 65535) {
    free(g->file), g->file = NULL;
    return amber__fail(&gw->err, AMBER_EINVAL, "tensor '%.200s...': its box %u needs a name "
                       "of more than 65535 bytes in this rank's files", name, g->ord);
  }
  return 0;
}

/* The declaration of amber_global_writer_add and _add_preselected. A rank may
 * declare several boxes of one global tensor, each its own declaration (index). */
static int declare(amber_global_writer *gw, const char *name, int dtype, uint32_t ndim,
                   const int64_t *global_shape, const int64_t *offsets,
                   const int64_t *local_shape, const void *data, uint32_t flags, int presel) {
  if (gw->saved)
    return amber__fail(&gw->err, AMBER_EINVAL,
                       "declarations are fixed after the first save or plan");
  if (!name || !*name || strlen(name) > 65535 || ndim > AMBER_MAX_DIMS ||
      !amber_dtype_size(dtype) || (flags & ~(uint32_t)AMBER_SHARD_REPLICATED) ||
      (ndim && !global_shape))
    return amber__fail(&gw->err, AMBER_EINVAL, "tensor '%s': invalid declaration",
                       name ? name : "(null)");
  int repl = (flags & AMBER_SHARD_REPLICATED) != 0;
  if (amber__box_name_reserved(name))
    return amber__fail(&gw->err, AMBER_EINVAL, "tensor '%s': the name is amber's own (each "
                       "rank's file records its boxes as %s, and a rank's second and later "
                       "boxes of a tensor as %s/K/NAME)", name, AMBER__BOXES_NAME,
                       AMBER__BOXES_NAME);
  if (!repl && ndim && (!offsets || !local_shape))
    return amber__fail(&gw->err, AMBER_EINVAL, "tensor '%s': offsets and local shape needed",
                       name);
  gtensor g;
  memset(&g, 0, sizeof g);
  g.dtype = dtype, g.ndim = ndim, g.flags = flags, g.data = data, g.presel = presel;
  for (uint32_t d = 0; d < ndim; d++) {
    g.gshape[d] = global_shape[d];
    g.off[d] = repl ? 0 : offsets[d];
    g.lshape[d] = repl ? global_shape[d] : local_shape[d];
    if (g.gshape[d] < 0 || g.off[d] < 0 || g.lshape[d] < 0 || g.off[d] > g.gshape[d] ||
        g.lshape[d] > g.gshape[d] - g.off[d])
      return amber__fail(&gw->err, AMBER_ERANGE,
                         "tensor '%s': region outside the global shape in dim %u", name, d);
  }
  int rc = place_box(gw, &g, name);
  if (rc < 0) return rc;
  g.local = !repl || gw->comm.rank == 0;
  gtensor *nt = realloc(gw->t, (gw->nt + 1) * sizeof *nt);
  if (nt) gw->t = nt;
  if (!nt || !(g.name = strdup(name))) {
    free(g.file);
    return amber__fail(&gw->err, AMBER_ENOMEM, "out of memory");
  }
  gw->t[gw->nt++] = g;
  return 0;
}

int amber_global_writer_add(amber_global_writer *gw, const char *name, int dtype,
                            uint32_t ndim, const int64_t *global_shape,
                            const int64_t *offsets, const int64_t *local_shape,
                            const void *data, uint32_t flags) {
  return declare(gw, name, dtype, ndim, global_shape, offsets, local_shape, data, flags, 0);
}

int amber_global_writer_add_preselected(amber_global_writer *gw, const char *name, int dtype,
                                        uint32_t ndim, const int64_t *global_shape,
                                        const int64_t *offsets, const int64_t *local_shape,
                                        uint32_t flags) {
  return declare(gw, name, dtype, ndim, global_shape, offsets, local_shape, NULL, flags, 1);
}

int amber_global_writer_add_policy(amber_global_writer *gw, const char *rule) {
  if (gw->committing)
    return amber__fail(caller_err(gw), AMBER_EBUSY, "a save is in progress (wait for it first)");
  char **np = realloc(gw->pol, (gw->npol + 1) * sizeof *np);
  if (!np) return amber__fail(&gw->err, AMBER_ENOMEM, "out of memory");
  gw->pol = np;
  if (!(gw->pol[gw->npol] = strdup(rule)))
    return amber__fail(&gw->err, AMBER_ENOMEM, "out of memory");
  gw->npol++;
  if (gw->w) {
    int rc = amber_writer_add_policy(gw->w, rule);
    if (rc < 0) {
      free(gw->pol[--gw->npol]);
      return amber__fail(&gw->err, rc, "%s", amber_last_error(gw->w));
    }
  }
  return 0;
}

/* The rank writer's sources: tensor li of the rank writer is the li-th local one of
 * the global writer, whose source is asked with the global index. */
static int global_source(void *user, int worker, size_t li, uint64_t chunk,
                         amber_chunk_sel *sel) {
  amber_global_writer *gw = user;
  for (size_t i = 0; i < gw->nt; i++)
    if (gw->t[i].local && li-- == 0)
      return gw->t[i].src ? gw->t[i].src(gw->t[i].src_user, worker, i, chunk, sel)
                          : AMBER_EINVAL;
  return AMBER_ERANGE;
}

/* Gives the rank writer the units of its tensors. */
static int push_units(amber_global_writer *gw) {
  double stack[256] = {0}, *u = stack;
  size_t nl = 0;
  for (size_t i = 0; i < gw->nt; i++) nl += gw->t[i].local != 0;
  if (nl > 256 && !(u = malloc(nl * sizeof *u))) return AMBER_ENOMEM;
  for (size_t i = 0, li = 0; i < gw->nt; i++)
    if (gw->t[i].local) u[li++] = gw->t[i].unit;
  int rc = amber_writer_set_units(gw->w, u, nl);
  if (u != stack) free(u);
  return rc;
}

int amber_global_writer_set_units(amber_global_writer *gw, const double *units, size_t n) {
  if (n && !units) return amber__fail(&gw->err, AMBER_EINVAL, "set_units: NULL units");
  if (n > gw->nt)
    return amber__fail(&gw->err, AMBER_EINVAL, "%zu units for %zu declared tensors", n, gw->nt);
  if ((gw->busy && gw->present && !gw->begin_rc) || gw->committing)
    return amber__fail(caller_err(gw), AMBER_EBUSY, "a save is in progress (wait for it first)");
  for (size_t i = 0; i < n; i++)
    if (!(units[i] >= 0) || isinf(units[i]))
      return amber__fail(&gw->err, AMBER_EINVAL, "tensor '%s': unit %g is not finite and >= 0",
                         gw->t[i].name, units[i]);
  for (size_t i = 0; i < n; i++) gw->t[i].unit = units[i];
  if (!gw->w) return 0;
  int rc = push_units(gw);
  return rc < 0 ? amber__fail(&gw->err, rc, "%s", amber_last_error(gw->w)) : 0;
}

/* The box table of this rank's files: every tensor it writes, with where it lies
 * in its global tensor (declarations are fixed by then, so it is made once). */
static int make_boxes(amber_global_writer *gw) {
  if (gw->boxes) return 0;
  size_t n = 0;
  amber__box *b = calloc(gw->nt ? gw->nt : 1, sizeof *b);
  if (!b) return amber__fail(&gw->err, AMBER_ENOMEM, "out of memory");
  for (size_t i = 0; i < gw->nt; i++) {
    const gtensor *t = &gw->t[i];
    if (!t->local) continue;
    b[n].name = file_name(t), b[n].name_len = strlen(b[n].name), b[n].ndim = t->ndim;
    memcpy(b[n].shape, t->gshape, sizeof b[n].shape);
    memcpy(b[n].off, t->off, sizeof b[n].off);
    n++;
  }
  int rc = amber__boxes_encode(b, n, &gw->err, &gw->boxes, &gw->boxes_len);
  free(b);
  return rc;
}

/* (Re)creates the rank's writer from the declarations. Its tensors are the local
 * ones in declaration order (local_index), then the box table, when it holds any:
 * a u8 tensor, always exact, unchanged from step to step (an UNCHANGED chunk in
 * a delta). */
static int ensure_writer(amber_global_writer *gw) {
  if (gw->w) return 0;
  int nlocal = 0;
  for (size_t i = 0; i < gw->nt; i++) nlocal |= gw->t[i].local;
  int rc = nlocal ? make_boxes(gw) : 0;
  if (rc < 0) return rc;
  rc = amber_writer_open(&gw->w, gw->st, &gw->opts);
  if (rc < 0) return amber__fail(&gw->err, rc, "%s: %s", gw->rankdir, amber_last_error(NULL));
  for (size_t i = 0; rc == 0 && i < gw->npol; i++) rc = amber_writer_add_policy(gw->w, gw->pol[i]);
  for (size_t i = 0, li = 0; rc == 0 && i < gw->nt; i++) {
    const gtensor *t = &gw->t[i];
    if (!t->local) continue;
    if (t->presel) {
      rc = amber_writer_add_preselected(gw->w, file_name(t), t->dtype, t->ndim, t->lshape, &li);
      if (rc == 0 && t->src) rc = amber_writer_set_source(gw->w, li, global_source, gw);
    } else {
      rc = amber_writer_add(gw->w, file_name(t), t->dtype, t->ndim, t->lshape, t->data, &li);
    }
    /* the caller's rules name the global tensor, whatever name the box has here */
    if (rc == 0 && t->file) rc = amber__writer_match_as(gw->w, li, t->name);
  }
  if (rc == 0 && nlocal) {
    int64_t len = (int64_t)gw->boxes_len;
    rc = amber_writer_add(gw->w, AMBER__BOXES_NAME, AMBER_U8, 1, &len, gw->boxes, NULL);
  }
  if (rc == 0) rc = push_units(gw);
  if (rc < 0) {
    rc = amber__fail(&gw->err, rc, "%s", amber_last_error(gw->w));
    amber_writer_close(gw->w);
    gw->w = NULL;
  }
  return rc;
}

/* Whether this rank writes a file for the step: it holds a tensor of its own, or
 * metadata (a rank's RNG state and counters are its own even when every tensor
 * it holds is replicated). */
static int any_local(const amber_global_writer *gw) {
  for (size_t i = 0; i < gw->nt; i++)
    if (gw->t[i].local) return 1;
  return gw->has_meta;
}

static int commit(amber_global_writer *gw);

static void *commit_main(void *arg) {
  amber_global_writer *gw = arg;
  gw->commit_rc = commit(gw);
  return NULL;
}

/* With a communicator usable from any thread, the rest of the save (this rank's part
 * durable, the vote, the manifest, the outcome) goes on a thread of its own from
 * here, overlapping the training's next forward and backward pass; wait joins it.
 * A save that awaits a confirm keeps its commit in wait, after the verdict. If the
 * thread cannot start, wait commits as without the flag. */
static int start_commit(amber_global_writer *gw) {
  if ((gw->comm.flags & AMBER_COMM_ANY_THREAD) && !gw->gated)
    gw->committing = pthread_create(&gw->committer, NULL, commit_main, gw) == 0;
  return 0;
}

/* The checks of a save or plan request, the same on every rank (no collective). */
static int check_request(amber_global_writer *gw, uint64_t step, uint32_t flags) {
  if (gw->busy || gw->committing)
    return amber__fail(caller_err(gw), AMBER_EBUSY, "a save is in progress (wait for it first)");
  if (flags & ~(uint32_t)(AMBER_SAVE_FULL | AMBER_SAVE_CONFIRM | AMBER_SAVE_VOTED))
    return amber__fail(&gw->err, AMBER_EINVAL, "global save: unsupported flags 0x%x", flags);
  if (gw->latest != AMBER_NO_STEP && step <= gw->latest)
    return amber__fail(&gw->err, AMBER_EEXIST, "step %llu is not after the latest step %llu",
                       (unsigned long long)step, (unsigned long long)gw->latest);
  return 0;
}

/* Whether this rank wants the step full: asked for, after a failed step, the first
 * step, or the cadence (full_every over the step, full_share over this rank's files). */
static int want_full(const amber_global_writer *gw, uint32_t flags) {
  return (flags & AMBER_SAVE_FULL) || gw->force_full || gw->latest == AMBER_NO_STEP ||
         gw->deltas >= gw->full_every || amber__cadence_decide(&gw->share);
}

/* Full or delta for the whole step: one byte per rank, full if any rank wants it.
 * Collective. */
static int vote_full(amber_global_writer *gw, int want, int *full) {
  uint8_t mine = (uint8_t)(want != 0), *all = malloc((size_t)gw->comm.size);
  if (!all) return amber__fail(&gw->err, AMBER_ENOMEM, "out of memory");
  int rc = gw->comm.allgather(gw->comm.ctx, &mine, 1, all);
  *full = 0;
  for (int r = 0; rc == 0 && r < gw->comm.size; r++) *full |= all[r];
  free(all);
  if (rc < 0) return amber__fail(&gw->err, rc, "allgather failed (%s)", amber_strerror(rc));
  return 0;
}

int amber_global_writer_wants_full(const amber_global_writer *gw, uint64_t step,
                                   uint32_t flags, int *full) {
  if (!gw || !full)
    return amber__fail(NULL, AMBER_EINVAL, "amber_global_writer_wants_full: NULL argument");
  (void)step;
  *full = want_full(gw, flags);
  return 0;
}

/* The rank writer's flags for a step of kind `full` begun with `flags`. */
static uint32_t rank_flags(int full, uint32_t flags) {
  return (full ? AMBER_SAVE_FULL : 0u) | (flags & AMBER_SAVE_CONFIRM);
}

int amber_global_writer_begin(amber_global_writer *gw, uint64_t step, uint32_t flags) {
  int planned = gw->plan.set && gw->plan.step == step && gw->plan.flags == flags;
  gw->plan.set = 0;
  int rc = check_request(gw, step, flags);
  if (rc < 0) return rc;
  double t0 = amber__now();
  /* A planned step keeps the plan's kind, which every rank voted for already; the
   * vote runs again so that every begin makes the same collectives, planned or not.
   * With AMBER_SAVE_VOTED the caller's own vote decided it, on every rank alike. */
  if (flags & AMBER_SAVE_VOTED)
    gw->full = planned ? gw->plan.full : (flags & AMBER_SAVE_FULL) != 0;
  else if ((rc = vote_full(gw, planned ? gw->plan.full : want_full(gw, flags), &gw->full)) < 0)
    return rc;
  gw->saved = 1, gw->busy = 1, gw->step = step, gw->begin_rc = 0, gw->begin_msg[0] = 0;
  gw->t_begin = t0;
  memset(&gw->stats, 0, sizeof gw->stats);
  gw->present = any_local(gw);
  gw->gated = 0;
  if (!gw->present) return start_commit(gw);
  rc = amber__store_state(gw->st, &gw->err, &gw->prev_step, &gw->prev_state);
  if (rc == AMBER_ENOENT) gw->prev_step = AMBER_NO_STEP, rc = 0;
  if (rc == 0) rc = ensure_writer(gw);
  if (rc == 0) {
    rc = amber_writer_set_meta(gw->w, gw->has_meta ? gw->meta : NULL, gw->meta_len);
    if (rc < 0) amber__fail(&gw->err, rc, "%s", amber_last_error(gw->w));
  }
  if (rc == 0) {
    rc = amber_writer_begin(gw->w, step, rank_flags(gw->full, flags));
    gw->gated = rc == 0 && (flags & AMBER_SAVE_CONFIRM);
    if (rc < 0) amber__fail(&gw->err, rc, "%s", amber_last_error(gw->w));
  }
  if (rc < 0) {
    gw->begin_rc = rc;
    snprintf(gw->begin_msg, sizeof gw->begin_msg, "%.255s", gw->err.msg);
  }
  /* a failure here is this rank's vote, reported by wait on every rank */
  return start_commit(gw);
}

int amber_global_writer_fence(amber_global_writer *gw) {
  /* The rank writer's fence and wait may run at once (its saver serializes them),
   * and the committer never closes the rank writer (wait does, after the join). */
  if (!gw->busy || !gw->present || gw->begin_rc || !gw->w) return 0;
  return amber_writer_fence(gw->w);
}

/* Whether this rank's file `step` holds the box table `gw->boxes`: 0 when it does,
 * AMBER_EMISMATCH when it holds another (the boxes moved), else the read's code. */
static int same_boxes(amber_global_writer *gw, uint64_t step) {
  amber_reader *r = NULL;
  size_t i;
  amber_tensor_info ti;
  int rc = amber_reader_open(&r, gw->st, step, NULL);
  if (rc == 0) rc = amber_reader_find(r, AMBER__BOXES_NAME, &i);
  if (rc == 0) rc = amber_reader_info(r, i, &ti);
  uint8_t *got = NULL;
  if (rc == 0 && ti.nbytes != gw->boxes_len) rc = AMBER_EMISMATCH;
  if (rc == 0 && !(got = malloc(ti.nbytes ? ti.nbytes : 1))) rc = AMBER_ENOMEM;
  if (rc == 0) rc = amber_reader_read(r, i, got, ti.nbytes);
  if (rc == 0 && memcmp(got, gw->boxes, gw->boxes_len) != 0) rc = AMBER_EMISMATCH;
  free(got);
  if (rc == AMBER_EMISMATCH)
    amber__fail(&gw->err, rc, "%s: this rank's boxes are not those of its file of step %" PRIu64
                " (the sharding changed)", gw->rankdir, step);
  else if (rc < 0)
    amber__fail(&gw->err, rc, "%s: %s", gw->rankdir, amber_last_error(NULL));
  amber_reader_close(r);
  return rc;
}

int amber_global_writer_seed_reference(amber_global_writer *gw, uint64_t step) {
  if (!gw) return amber__fail(NULL, AMBER_EINVAL, "amber_global_writer_seed_reference: NULL");
  if (gw->busy)
    return amber__fail(&gw->err, AMBER_EBUSY, "amber_global_writer_seed_reference: a save is "
                       "in progress (call amber_global_writer_wait first)");
  if (step != gw->latest)
    return amber__fail(&gw->err, AMBER_EINVAL,
                       "cannot seed the reference from global step %" PRIu64 ": the latest "
                       "global step of %s is %" PRIu64, step, gw->path, gw->latest);
  amber__manifest m;
  int rc = amber__global_load_manifest(gw->path, step, &gw->err, &m);
  if (rc < 0) return rc;
  uint32_t me = (uint32_t)gw->comm.rank;
  int here = m.world == (uint32_t)gw->comm.size && (m.ranks[me].flags & AMBER__RANK_PRESENT);
  uint64_t lstep = here ? m.ranks[me].step : 0, lstate = here ? m.ranks[me].hash : 0;
  uint32_t world = m.world;
  amber__manifest_free(&m);
  if (!here)
    return amber__fail(&gw->err, AMBER_EMISMATCH,
                       "cannot seed the reference from global step %" PRIu64 ": %s",
                       step, world != (uint32_t)gw->comm.size
                                 ? "it was written at another world size"
                                 : "this rank wrote no file for it");
  uint64_t latest, state;
  if ((rc = amber__store_state(gw->st, &gw->err, &latest, &state)) < 0) return rc;
  if (latest != lstep || state != lstate)
    return amber__fail(&gw->err, AMBER_EMISMATCH,
                       "%s: its latest checkpoint is not the one global step %" PRIu64
                       " names", gw->rankdir, step);
  if ((rc = ensure_writer(gw)) < 0) return rc;
  if (gw->boxes && (rc = same_boxes(gw, lstep)) < 0) return rc;
  rc = amber_writer_seed_reference(gw->w, lstep);
  return rc < 0 ? amber__fail(&gw->err, rc, "%s", amber_last_error(gw->w)) : 0;
}

int amber_global_writer_confirm(amber_global_writer *gw, int ok, const char *why) {
  if (!gw->busy) return amber__fail(&gw->err, AMBER_EINVAL, "confirm: no save is in progress");
  if (gw->committing) return 0; /* begun without AMBER_SAVE_CONFIRM: nothing to confirm */
  if (!gw->gated) return 0; /* this rank writes nothing, or its begin failed: its vote says so */
  gw->gated = 0;
  int rc = amber_writer_confirm(gw->w, ok, why);
  return rc < 0 ? amber__fail(&gw->err, rc, "%s", amber_last_error(gw->w)) : 0;
}

/* ---- pre-selected tensors: the caller selects on its device ---- */

/* The kind must be the same on every rank, as begin's vote makes it: the same vote
 * first, then each rank's writer plans its part, and a rank whose writer cannot
 * make a delta (it found no reference in its store) makes the step full everywhere
 * (a second exchange, which also carries each rank's failure to all). */
int amber_global_writer_plan(amber_global_writer *gw, uint64_t step, uint32_t flags,
                             uint32_t *kind) {
  if (!gw || !kind)
    return amber__fail(NULL, AMBER_EINVAL, "amber_global_writer_plan: NULL argument");
  gw->plan.set = 0;
  int rc = check_request(gw, step, flags), full;
  if (rc < 0) return rc;
  rc = vote_full(gw, want_full(gw, flags), &full);
  if (rc < 0) return rc;
  gw->saved = 1; /* the rank writer is made from the declarations */
  int lrc = 0, lfull = full;
  uint32_t k = 0;
  if (any_local(gw) && (lrc = ensure_writer(gw)) == 0) {
    lrc = amber_writer_plan(gw->w, step, rank_flags(full, flags), &k);
    if (lrc < 0) amber__fail(&gw->err, lrc, "%s", amber_last_error(gw->w));
    lfull = lrc == 0 && k == AMBER_KIND_FULL;
  }
  uint8_t mine[8], *all = malloc((size_t)gw->comm.size * sizeof mine);
  if (!all) return amber__fail(&gw->err, AMBER_ENOMEM, "out of memory");
  amber__put32(mine, (uint32_t)lrc), amber__put32(mine + 4, (uint32_t)lfull);
  if (lrc < 0) { /* the rank's own reason, named as the other ranks name it */
    char m[sizeof gw->err.msg];
    snprintf(m, sizeof m, "%s", gw->err.msg);
    amber__fail(&gw->err, lrc, "step %llu: rank %d cannot plan its part: %s",
                (unsigned long long)step, gw->comm.rank, m);
  }
  rc = gw->comm.allgather(gw->comm.ctx, mine, sizeof mine, all);
  int bad = -1, brc = 0;
  for (int r = 0; rc == 0 && r < gw->comm.size; r++) {
    int rrc = (int)amber__get32(all + 8 * (size_t)r);
    if (rrc < 0 && bad < 0) bad = r, brc = rrc;
    full |= amber__get32(all + 8 * (size_t)r + 4) != 0;
  }
  free(all);
  if (rc < 0) return amber__fail(&gw->err, rc, "allgather failed (%s)", amber_strerror(rc));
  if (bad == gw->comm.rank) return brc;
  if (bad >= 0)
    return amber__fail(&gw->err, brc, "step %llu: rank %d cannot plan its part (%s)",
                       (unsigned long long)step, bad, amber_strerror(brc));
  /* Another rank made the step full: this rank's writer plans a full part. If that
   * fails, begin meets the same failure and votes it. */
  if (full && !lfull && gw->w) amber_writer_plan(gw->w, step, rank_flags(1, flags), &k);
  gw->plan.set = 1, gw->plan.full = full, gw->plan.step = step, gw->plan.flags = flags;
  *kind = full ? AMBER_KIND_FULL : AMBER_KIND_DELTA;
  return 0;
}

/* The rank writer's index of tensor `index`, or a failure: the tensor is not this
 * rank's to write, or there is no rank writer yet. */
static int rank_tensor(const amber_global_writer *gw, amber__err *e, size_t index,
                       const char *what, size_t *li) {
  if (index >= gw->nt)
    return amber__fail(e, AMBER_ERANGE, "%s: tensor index %zu out of range (%zu declared)",
                       what, index, gw->nt);
  if (!gw->t[index].local)
    return amber__fail(e, AMBER_EINVAL, "%s: tensor '%s' is replicated: rank 0 writes it, "
                       "not rank %d", what, gw->t[index].name, gw->comm.rank);
  if (!gw->w)
    return amber__fail(e, AMBER_EINVAL, "%s: tensor '%s': call amber_global_writer_plan "
                       "first (it makes this rank's writer and fixes the chunking)",
                       what, gw->t[index].name);
  *li = local_index(gw, index);
  return 0;
}

int amber_global_writer_info(const amber_global_writer *gw, size_t index,
                             amber_tensor_info *out) {
  if (!gw || !out)
    return amber__fail(NULL, AMBER_EINVAL, "amber_global_writer_info: NULL argument");
  size_t li = 0;
  int rc = rank_tensor(gw, NULL, index, "amber_global_writer_info", &li);
  return rc < 0 ? rc : amber_writer_info(gw->w, li, out);
}

int amber_global_writer_set_selection(amber_global_writer *gw, size_t index,
                                      const amber_chunk_sel *chunks, uint64_t nchunks) {
  if (!gw)
    return amber__fail(NULL, AMBER_EINVAL, "amber_global_writer_set_selection: NULL argument");
  if (gw->busy || gw->committing)
    return amber__fail(caller_err(gw), AMBER_EBUSY,
                       "amber_global_writer_set_selection: a save is in progress");
  size_t li = 0;
  int rc = rank_tensor(gw, &gw->err, index, "amber_global_writer_set_selection", &li);
  if (rc == 0 && !gw->t[index].presel)
    rc = amber__fail(&gw->err, AMBER_EINVAL, "tensor '%s' is not pre-selected (declared "
                     "with amber_global_writer_add)", gw->t[index].name);
  if (rc == 0 && (rc = amber_writer_set_selection(gw->w, li, chunks, nchunks)) < 0)
    amber__fail(&gw->err, rc, "%s", amber_last_error(gw->w));
  return rc;
}

int amber_global_writer_set_source(amber_global_writer *gw, size_t index,
                                   amber_chunk_source fn, void *user) {
  if (!gw) return amber__fail(NULL, AMBER_EINVAL, "amber_global_writer_set_source: NULL writer");
  if (gw->busy || gw->committing)
    return amber__fail(caller_err(gw), AMBER_EBUSY,
                       "amber_global_writer_set_source: a save is in progress");
  if (index >= gw->nt)
    return amber__fail(&gw->err, AMBER_ERANGE,
                       "amber_global_writer_set_source: tensor index %zu out of range (%zu "
                       "declared)", index, gw->nt);
  gtensor *t = &gw->t[index];
  if (!t->presel)
    return amber__fail(&gw->err, AMBER_EINVAL, "tensor '%s' is not pre-selected (declared "
                       "with amber_global_writer_add)", t->name);
  t->src = fn;
  t->src_user = fn ? user : NULL;
  int rc = 0;
  if (gw->w && t->local &&
      (rc = amber_writer_set_source(gw->w, local_index(gw, index), fn ? global_source : NULL,
                                    gw)) < 0)
    amber__fail(&gw->err, rc, "%s", amber_last_error(gw->w));
  return rc;
}

/* One rank's vote: i32 rc, u32 kind, u64 hash, u64 bytes, u32 present, u16 msg len,
 * msg, then its declarations: per tensor u16 name len, u8 dtype, u8 ndim, u32
 * flags, name, then global shape, offsets, local shape (i64 each). */
static uint8_t *encode_vote(amber_global_writer *gw, int rc, uint32_t kind, uint64_t hash,
                            uint64_t bytes, const char *msg, size_t *len) {
  size_t ml = strlen(msg), n = 30 + ml;
  for (size_t i = 0; i < gw->nt; i++)
    if (gw->t[i].local) n += 8 + strlen(gw->t[i].name) + 24 * (size_t)gw->t[i].ndim;
  uint8_t *b = calloc(1, n), *p = b;
  if (!b) return NULL;
  amber__put32(p, (uint32_t)rc), amber__put32(p + 4, kind), amber__put64(p + 8, hash);
  amber__put64(p + 16, bytes), amber__put32(p + 24, (uint32_t)gw->present);
  amber__put16(p + 28, (uint16_t)ml);
  memcpy(p + 30, msg, ml);
  p += 30 + ml;
  for (size_t i = 0; i < gw->nt; i++) {
    const gtensor *t = &gw->t[i];
    if (!t->local) continue;
    size_t nl = strlen(t->name);
    amber__put16(p, (uint16_t)nl), p[2] = (uint8_t)t->dtype, p[3] = (uint8_t)t->ndim;
    amber__put32(p + 4, t->flags);
    memcpy(p + 8, t->name, nl);
    p += 8 + nl;
    for (uint32_t d = 0; d < t->ndim; d++, p += 8) amber__put64(p, (uint64_t)t->gshape[d]);
    for (uint32_t d = 0; d < t->ndim; d++, p += 8) amber__put64(p, (uint64_t)t->off[d]);
    for (uint32_t d = 0; d < t->ndim; d++, p += 8) amber__put64(p, (uint64_t)t->lshape[d]);
  }
  *len = n;
  return b;
}

/* Builds the step's manifest from every rank's vote (all of which succeeded).
 * The votes come from ranks of this job, so they are trusted to be well formed;
 * what is checked is that the ranks agree on each tensor and tile it. */
static int build_manifest(amber_global_writer *gw, const uint8_t *all, const uint64_t *lens,
                          const uint64_t *offs, amber__manifest *m, char *why, size_t wl) {
  uint32_t world = (uint32_t)gw->comm.size;
  memset(m, 0, sizeof *m);
  m->step = gw->step, m->parent = gw->latest, m->world = world;
  m->ranks = calloc(world, sizeof *m->ranks);
  if (!m->ranks) return AMBER_ENOMEM;
  int allfull = 1;
  for (uint32_t r = 0; r < world; r++) {
    const uint8_t *p = all + offs[r], *end = p + lens[r];
    amber__mrank *k = &m->ranks[r];
    k->kind = amber__get32(p + 4), k->hash = amber__get64(p + 8), k->bytes = amber__get64(p + 16);
    k->flags = amber__get32(p + 24) ? AMBER__RANK_PRESENT : 0;
    k->step = gw->step;
    if (k->flags && k->kind != AMBER_KIND_FULL) allfull = 0;
    p += 30 + amber__get16(p + 28);
    while (p < end) {
      size_t nl = amber__get16(p);
      uint32_t ndim = p[3];
      amber__mtensor *t = NULL;
      for (uint32_t i = 0; i < m->ntensors; i++)
        if (strlen(m->tensors[i].name) == nl && !memcmp(m->tensors[i].name, p + 8, nl))
          t = &m->tensors[i];
      if (!t) {
        amber__mtensor *nt = realloc(m->tensors, (m->ntensors + 1) * sizeof *nt);
        if (!nt) return AMBER_ENOMEM;
        m->tensors = nt;
        t = &m->tensors[m->ntensors++];
        memset(t, 0, sizeof *t);
        if (!(t->name = malloc(nl + 1))) return AMBER_ENOMEM;
        memcpy(t->name, p + 8, nl), t->name[nl] = 0;
        t->dtype = p[2], t->ndim = ndim, t->flags = amber__get32(p + 4);
        for (uint32_t d = 0; d < ndim; d++)
          t->shape[d] = (int64_t)amber__get64(p + 8 + nl + 8 * d);
      } else {
        int same = t->dtype == p[2] && t->ndim == ndim && t->flags == amber__get32(p + 4);
        for (uint32_t d = 0; same && d < ndim; d++)
          same = t->shape[d] == (int64_t)amber__get64(p + 8 + nl + 8 * d);
        if (!same) {
          snprintf(why, wl, "tensor '%s': rank %u declares another dtype, shape or kind",
                   t->name, r);
          return AMBER_EMISMATCH;
        }
      }
      amber__mshard *ns = realloc(t->shards, (t->nshards + 1) * sizeof *ns);
      if (!ns) return AMBER_ENOMEM;
      t->shards = ns;
      amber__mshard *s = &t->shards[t->nshards++];
      memset(s, 0, sizeof *s);
      s->rank = r;
      for (uint32_t d = 0; d < ndim; d++) {
        s->off[d] = (int64_t)amber__get64(p + 8 + nl + 8 * (ndim + d));
        s->shape[d] = (int64_t)amber__get64(p + 8 + nl + 8 * (2 * ndim + d));
      }
      p += 8 + nl + 24 * (size_t)ndim;
    }
  }
  m->kind = allfull ? AMBER_KIND_FULL : AMBER_KIND_DELTA;
  if (allfull) m->parent = AMBER_NO_STEP;
  /* The shards must tile each tensor (no overlap, no gap), as every reader of the
   * manifest checks again. */
  for (uint32_t i = 0; i < m->ntensors; i++) {
    int rc = amber__mtensor_check_tiling(&m->tensors[i], why, wl);
    if (rc < 0) return rc;
  }
  return 0;
}

/* Rank 0: writes the manifest and moves the global LATEST. */
static int publish(amber_global_writer *gw, const amber__manifest *m, char *why, size_t wl) {
  uint8_t *b;
  size_t len;
  char path[4200];
  int rc = amber__manifest_encode(m, &gw->err, &b, &len);
  if (rc < 0) return snprintf(why, wl, "%s", gw->err.msg), rc;
  amber__global_manifest_path(gw->path, m->step, path, sizeof path);
  rc = amber__write_file_durable(gw->path, path, &gw->err, b, len);
  free(b);
  if (rc == 0) {
    rc = amber__global_write_latest(gw->path, &gw->err, m->step);
    if (rc < 0) unlink(path);
  }
  if (rc < 0) snprintf(why, wl, "%s", gw->err.msg);
  return rc;
}

/* After a failed step: this rank's file of it is removed and its store's LATEST
 * moved back (the rank writer is idle by now), and the rank writer is to be
 * dropped (drop_writer: on the caller's thread, since a fence may still use it):
 * its reference may hold state that no global step has. After a failed collective
 * (`rollback` 0) the file stays: this rank cannot know whether rank 0 published the
 * step (a manifest naming it), and the next writer on the store removes it if not. */
static void fail_local(amber_global_writer *gw, int rollback) {
  gw->drop_w = 1;
  if (gw->present && rollback) {
    uint64_t l;
    if (amber_store_latest(gw->st, &l) == 0 && l == gw->step)
      amber__gw_rank_rollback(gw, gw->prev_step, gw->prev_state);
  }
  gw->force_full = 1;
}

static void drop_writer(amber_global_writer *gw) {
  if (!gw->drop_w) return;
  amber_writer_close(gw->w);
  gw->w = NULL, gw->drop_w = 0;
}

/* ---- retention ---- */

uint64_t amber__gw_oldest_kept(amber_global_writer *gw) {
  amber_global_step_info *gs = NULL;
  size_t n = 0;
  uint64_t oldest = AMBER_NO_STEP;
  int rc = amber_global_list(gw->path, &gs, &n);
  if (rc < 0) amber__fail(&gw->prune_err, rc, "%s", amber_last_error(NULL));
  else if (n > gw->keep_last) oldest = gs[n - gw->keep_last].step;
  amber_free(gs);
  gw->prune_rc = rc;
  return oldest;
}

int amber__gw_remove_manifests_before(amber_global_writer *gw, uint64_t oldest) {
  DIR *d = opendir(gw->path);
  if (!d)
    return amber__fail(&gw->prune_err, amber__errno_code(errno), "%s: %s", gw->path,
                       strerror(errno));
  struct dirent *de;
  uint64_t s;
  int rc = 0;
  while (rc == 0 && (de = readdir(d))) {
    if (!amber__parse_manifest_name(de->d_name, &s) || s >= oldest) continue;
    if (unlinkat(dirfd(d), de->d_name, 0) == 0) gw->pruned++;
    else if (errno != ENOENT) /* a rank sharing the path removed it first */
      rc = amber__fail(&gw->prune_err, amber__errno_code(errno), "cannot remove %s/%s: %s",
                       gw->path, de->d_name, strerror(errno));
  }
  closedir(d);
  if (rc == 0 && amber__fsync_dir(gw->path) < 0)
    rc = amber__fail(&gw->prune_err, AMBER_EIO, "%s: fsync of the directory failed", gw->path);
  return rc;
}

/* Rank 0, after publishing a step: removes the manifests of the steps before the
 * newest keep_last and returns the oldest step kept (AMBER_NO_STEP: nothing to
 * prune, or the removal failed, so that no rank removes files). Manifests first:
 * a crash in between leaves rank files that no step names, never a step whose
 * files are gone. */
static uint64_t prune_manifests(amber_global_writer *gw) {
  uint64_t oldest = amber__gw_oldest_kept(gw);
  if (oldest != AMBER_NO_STEP && (gw->prune_rc = amber__gw_remove_manifests_before(gw, oldest)) < 0)
    oldest = AMBER_NO_STEP;
  return oldest;
}

/* Every rank, once rank 0 has removed the old manifests: prunes its own store so
 * that it keeps every file of steps from `oldest` on and their chains. */
static void prune_rank_store(amber_global_writer *gw, uint64_t oldest) {
  amber_ckpt_info *info = NULL;
  size_t n = 0, keep = 0, removed = 0;
  int rc = amber__store_list(gw->st, &gw->prune_err, &info, &n);
  for (size_t i = 0; rc == 0 && i < n; i++) keep += info[i].step >= oldest;
  free(info);
  /* a rank with no file in the kept steps keeps its older ones (nothing reads them) */
  if (rc == 0 && keep) rc = amber__store_prune(gw->st, &gw->prune_err, keep, &removed);
  if (rc < 0) {
    char m[sizeof gw->prune_err.msg];
    snprintf(m, sizeof m, "%s", gw->prune_err.msg);
    amber__fail(&gw->prune_err, rc, "rank %d: %s", gw->comm.rank, m);
  }
  gw->pruned += removed;
  if (gw->prune_rc == 0) gw->prune_rc = rc;
}

int amber_global_writer_prune_status(const amber_global_writer *gw, size_t *removed,
                                     const char **message) {
  if (removed) *removed = gw ? gw->pruned : 0;
  if (message) *message = gw && gw->prune_rc ? gw->prune_err.msg : NULL;
  return gw ? gw->prune_rc : AMBER_EINVAL;
}

int amber_global_writer_wait(amber_global_writer *gw) {
  if (!gw->busy) return 0;
  int rc;
  if (gw->committing) { /* the commit ran (or runs) on its own thread */
    pthread_join(gw->committer, NULL);
    gw->committing = 0;
    rc = gw->commit_rc;
    /* its message becomes this thread's too (amber_last_error(NULL)) */
    if (rc < 0) amber__fail(&gw->err, rc, "%s", gw->err.msg);
  } else {
    rc = commit(gw);
  }
  gw->busy = 0;
  drop_writer(gw);
  return rc;
}

/* The rest of the save after the fence: this rank's part made durable, every rank's
 * vote, rank 0's manifest, the outcome; rollback on failure. On the caller's thread
 * (wait) or on the committer (fence). */
static int commit(amber_global_writer *gw) {
  int rc = gw->begin_rc;
  char msg[512];
  snprintf(msg, sizeof msg, "%s", gw->begin_msg);
  uint32_t kind = 0;
  uint64_t hash = 0, bytes = 0, s;
  if (gw->present && rc == 0) {
    if (gw->gated) { /* begun with AMBER_SAVE_CONFIRM and never confirmed */
      gw->gated = 0;
      amber_writer_confirm(gw->w, 0, "amber_global_writer_wait without a confirm");
    }
    rc = amber_writer_wait(gw->w);
    if (rc < 0) snprintf(msg, sizeof msg, "%s", amber_last_error(gw->w));
    amber_save_stats *st = &gw->stats.part;
    if (rc == 0 && amber_writer_save_stats(gw->w, st) == 0) kind = st->kind, bytes = st->bytes;
    if (rc == 0) rc = amber__store_state(gw->st, &gw->err, &s, &hash);
    if (rc == 0 && s != gw->step) rc = AMBER_EIO;
  }
  double t_part = amber__now();
  size_t vl;
  uint8_t *vote = encode_vote(gw, rc, kind, hash, bytes, msg, &vl);
  uint64_t *lens = calloc((size_t)gw->comm.size * 2, sizeof *lens);
  uint8_t *all = NULL;
  int crc = vote && lens ? 0 : AMBER_ENOMEM;
  if (crc == 0) crc = amber__comm_allgatherv(&gw->comm, &gw->err, vote, vl, &all, lens,
                                             lens + gw->comm.size);
  free(vote);
  double t_vote = amber__now(), t_manifest = t_vote;
  if (crc < 0) { /* the collective itself failed: nobody can know the outcome */
    free(lens);
    fail_local(gw, 0);
    return amber__fail(&gw->err, crc, "step %llu not committed: collective failed",
                       (unsigned long long)gw->step);
  }
  uint64_t *offs = lens + gw->comm.size;
  int bad = -1, brc = 0;
  for (int r = 0; r < gw->comm.size && bad < 0; r++)
    if ((brc = (int)amber__get32(all + offs[r])) < 0) bad = r;
  char why[512] = "";
  if (bad >= 0) {
    const uint8_t *p = all + offs[bad];
    size_t ml = amber__get16(p + 28);
    snprintf(why, sizeof why, "%.*s", (int)ml, (const char *)p + 30);
  }
  /* Every rank has the same votes: rank 0 alone writes (in local mode: encodes,
   * and every rank writes its copy after the outcome), then says how it went. */
  int published = 0;
  /* i32 rc, message, u64 oldest step kept (retention), u64 manifest length (local) */
  uint8_t res[4 + 256 + 8 + 8], *mbytes = NULL;
  size_t mlen = 0;
  memset(res, 0, sizeof res);
  amber__put64(res + 260, AMBER_NO_STEP);
  gw->prune_rc = 0, gw->pruned = 0;
  if (bad < 0 && gw->comm.rank == 0) {
    amber__manifest m;
    char w2[256] = "";
    int mrc = build_manifest(gw, all, lens, offs, &m, w2, sizeof w2);
    if (mrc == AMBER_ENOMEM && !w2[0]) snprintf(w2, sizeof w2, "out of memory");
    if (mrc == 0 && gw->local.on) {
      if ((mrc = amber__manifest_encode(&m, &gw->err, &mbytes, &mlen)) < 0)
        snprintf(w2, sizeof w2, "%.255s", gw->err.msg);
    } else if (mrc == 0) {
      mrc = publish(gw, &m, w2, sizeof w2);
      published = mrc == 0;
    }
    amber__manifest_free(&m);
    amber__put32(res, (uint32_t)mrc);
    memcpy(res + 4, w2, strnlen(w2, 255));
    amber__put64(res + 268, mlen);
    if (published && gw->keep_last) amber__put64(res + 260, prune_manifests(gw));
    t_manifest = amber__now();
  }
  free(all);
  free(lens);
  if (bad < 0) {
    crc = gw->comm.broadcast(gw->comm.ctx, res, sizeof res, 0);
    if (crc < 0) {
      free(mbytes);
      fail_local(gw, 0);
      if (published) { /* the step is in GLOBAL: the other ranks may not know it */
        gw->latest = gw->step;
        return amber__fail(&gw->err, crc, "step %llu was committed (GLOBAL names it), but the "
                           "broadcast of the outcome to the other ranks failed",
                           (unsigned long long)gw->step);
      }
      return amber__fail(&gw->err, crc, "step %llu: broadcast of the outcome failed (the step "
                         "is committed only if rank 0 wrote it: see GLOBAL)",
                         (unsigned long long)gw->step);
    }
    brc = (int)amber__get32(res);
    if (brc < 0) {
      bad = 0;
      snprintf(why, sizeof why, "%.255s", (const char *)res + 4);
    } else if (gw->local.on) { /* every rank's copy, or none */
      uint64_t oldest;
      crc = amber__gw_local_copy(gw, mbytes, amber__get64(res + 268), &bad, &brc, why,
                                 sizeof why, &oldest);
      amber__put64(res + 260, oldest);
      if (crc < 0) {
        free(mbytes);
        fail_local(gw, 0);
        return amber__fail(&gw->err, crc, "step %llu not committed on every path: %s (the "
                           "next open settles it)", (unsigned long long)gw->step, gw->err.msg);
      }
    }
  }
  free(mbytes);
  if (bad >= 0) {
    fail_local(gw, 1);
    return amber__fail(&gw->err, brc, "step %llu not committed: rank %d failed: %s: %s",
                       (unsigned long long)gw->step, bad, amber_strerror(brc), why);
  }
  amber_global_save_stats *gs = &gw->stats;
  double t_end = amber__now();
  gs->part_s = t_part - gw->t_begin;
  gs->vote_s = t_vote - t_part;
  gs->manifest_s = t_manifest - t_vote;
  gs->outcome_s = t_end - t_manifest;
  gs->commit_s = t_end - t_part;
  gs->total_s = t_end - gw->t_begin;
  gw->latest = gw->step;
  gw->force_full = 0;
  gw->deltas = gw->full ? 0 : gw->deltas + 1;
  if (gw->present)
    amber__cadence_record(&gw->share, gw->stats.part.kind != AMBER_KIND_FULL,
                          gw->stats.part.bytes);
  /* Retention never fails the save: amber_global_writer_prune_status tells. */
  uint64_t oldest = amber__get64(res + 260);
  if (gw->keep_last && oldest != AMBER_NO_STEP && gw->local.on)
    gw->prune_rc = amber__gw_remove_manifests_before(gw, oldest); /* this path's copies */
  if (gw->keep_last && oldest != AMBER_NO_STEP && gw->prune_rc == 0)
    prune_rank_store(gw, oldest);
  return 0;
}

int amber_global_writer_save_stats(const amber_global_writer *gw,
                                   amber_global_save_stats *out) {
  if (!gw || !out)
    return amber__fail(NULL, AMBER_EINVAL, "amber_global_writer_save_stats: NULL argument");
  *out = gw->stats;
  return 0;
}

int amber_global_writer_save(amber_global_writer *gw, uint64_t step, uint32_t flags) {
  int rc = amber_global_writer_begin(gw, step, flags);
  if (rc < 0) return rc;
  return amber_global_writer_wait(gw);
}

/*
 * gopen.c - opening the global writer (docs/DESIGN.md, "Many ranks", "Opening the
 * global writer"): two rounds, each ended by an exchange of every rank's outcome,
 * so that a failure on one rank fails the open on all with its reason. The first
 * changes nothing (the directory is not a single-rank store, the global state is
 * sound, this rank's store is free); the second makes this rank's store, repairs
 * its LATEST from the manifests, removes what crashed writers left and learns the
 * cadence's counters. The rest of the writer is in src/global.c.
 */
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gwriter.h"
#include "io.h"

int amber__gw_rank_rollback(amber_global_writer *gw, uint64_t step, uint64_t state) {
  amber_ckpt_info *info = NULL;
  size_t n = 0;
  int rc = amber__store_list(gw->st, &gw->err, &info, &n);
  if (rc < 0) return rc;
  char path[4200];
  if (step == AMBER_NO_STEP) {
    snprintf(path, sizeof path, "%s/LATEST", gw->rankdir);
    if (unlink(path) < 0 && errno != ENOENT) rc = amber__errno_code(errno);
  } else {
    rc = amber__write_latest(gw->st, &gw->err, step, state);
  }
  for (size_t i = 0; rc == 0 && i < n; i++)
    if (step == AMBER_NO_STEP || info[i].step > step) {
      amber__ckpt_path(gw->st, info[i].step, NULL, path, sizeof path);
      if (unlink(path) < 0 && errno != ENOENT) rc = amber__errno_code(errno);
    }
  free(info);
  if (rc == 0 && amber__fsync_dir(gw->rankdir) < 0) rc = AMBER_EIO;
  if (rc < 0)
    return amber__fail(&gw->err, rc, "%s: cannot roll back to step %llu", gw->rankdir,
                       (unsigned long long)step);
  return 0;
}

/* At open: removes what this rank wrote after the last global commit (a rank or
 * the job died between a rank's own commit and the manifest). */
static int remove_leftovers(amber_global_writer *gw) {
  uint64_t l;
  int rc = amber_store_latest(gw->st, &l);
  if (rc == AMBER_ENOENT || (rc == 0 && gw->latest != AMBER_NO_STEP && l <= gw->latest))
    return 0;
  if (rc < 0) return amber__fail(&gw->err, rc, "%s: %s", gw->rankdir, amber_last_error(gw->st));
  amber_ckpt_info *info = NULL;
  size_t n = 0;
  rc = amber__store_list(gw->st, &gw->err, &info, &n);
  if (rc < 0) return rc;
  uint64_t keep = AMBER_NO_STEP, state = 0;
  for (size_t i = 0; i < n; i++)
    if (gw->latest != AMBER_NO_STEP && info[i].step <= gw->latest) {
      keep = info[i].step;
      state = info[i].hash;
    }
  free(info);
  return amber__gw_rank_rollback(gw, keep, state);
}

/* Delta steps since the last full one, from the manifests. When the latest step
 * was written at another world size (a job resumed at another rank count), the
 * ranks' own stores hold other shards than they will write now, so the next step
 * must be full everywhere: that is returned as UINT32_MAX. */
static uint32_t count_deltas(amber_global_writer *gw) {
  uint32_t n = 0;
  uint64_t s = gw->latest;
  while (s != AMBER_NO_STEP && n < UINT32_MAX) {
    amber__manifest m;
    /* A manifest that cannot be read (a parent's that retention removed, or a
     * damaged one): the chain's length is unknown, so the next step is full (a
     * chain stays bounded across resumes, and starts afresh after damage). */
    if (amber__global_load_manifest(gw->path, s, NULL, &m) < 0) return UINT32_MAX;
    uint32_t kind = m.kind;
    if (s == gw->latest && m.world != (uint32_t)gw->comm.size) {
      amber__manifest_free(&m);
      return UINT32_MAX;
    }
    s = m.parent;
    amber__manifest_free(&m);
    if (kind == AMBER_KIND_FULL) break;
    n++;
  }
  return n;
}

/* The full_share counters from this rank's own chain (its files since its last
 * full one): each rank weighs its own deltas, and any rank's call makes the whole
 * step full (begin's allgather). */
static void learn_share(amber_global_writer *gw) {
  amber_ckpt_info *info = NULL;
  size_t n = 0;
  uint64_t want, full_bytes = 0, deltas = 0, delta_bytes = 0;
  if (amber_store_latest(gw->st, &want) == 0 && amber__store_list(gw->st, NULL, &info, &n) == 0)
    for (size_t i = n; i-- > 0;) {
      if (info[i].step != want) continue;
      if (info[i].kind == AMBER_KIND_FULL) {
        full_bytes = info[i].bytes;
        break;
      }
      deltas++, delta_bytes += info[i].bytes;
      want = info[i].parent;
    }
  free(info);
  amber__cadence_learn(&gw->share, full_bytes, deltas, delta_bytes);
}

/* One round of open: every rank's outcome `rc` (its message in gw->err when it
 * failed) goes to every rank, and each returns the lowest failing rank's code,
 * with the message "rank R: REASON", the same on every rank. Collective. */
static int agree(amber_global_writer *gw, int rc) {
  int broken;
  rc = amber__comm_agree(&gw->comm, &gw->err, rc, &broken);
  if (broken)
    return amber__fail(&gw->err, rc, "%s: opening the global writer: a collective failed (%s)",
                       gw->path, amber_strerror(rc));
  return rc;
}

/* What open checks before it changes anything: the directory is not a single-rank
 * store's, the store's global state is sound (a store without GLOBAL that holds
 * committed steps is refused, never taken for empty), and this rank's store, when
 * it exists, is held by no other writer (its lock is kept from here on). */
static int check_store(amber_global_writer *gw) {
  char single[4200];
  struct stat sb;
  snprintf(single, sizeof single, "%s/LATEST", gw->path);
  if (stat(single, &sb) == 0)
    return amber__fail(&gw->err, AMBER_EINVAL,
                       "%s holds a store written by one process (LATEST): a multi-rank store "
                       "needs a directory of its own", gw->path);
  int rc = amber__global_state(gw->path, &gw->err, &gw->latest);
  if (rc == AMBER_ENOENT) gw->latest = AMBER_NO_STEP, rc = 0;
  if (rc < 0 || stat(gw->rankdir, &sb) < 0) return rc; /* made once every rank agrees */
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_NOCREATE;
  rc = amber__store_open(&gw->st, gw->rankdir, &so, 0);
  if (rc == AMBER_ELOCKED)
    return amber__fail(&gw->err, rc, "the store %s is in use: %s/.lock is held by another "
                       "process (a global writer of another job, or amber prune or compact)",
                       gw->path, gw->rankdir);
  return rc < 0 ? amber__fail(&gw->err, rc, "%s", amber_last_error(NULL)) : 0;
}

/* Rank 0, at open: removes the manifests of steps after the latest global commit,
 * which a crash between a manifest and GLOBAL leaves (GLOBAL never named them),
 * once GLOBAL's own manifest confirms it. Rank 0 holds rank-00000's lock, so no
 * other global writer or maintenance runs. */
static void remove_stale_manifests(amber_global_writer *gw) {
  amber__manifest m;
  if (gw->latest != AMBER_NO_STEP) {
    if (amber__global_load_manifest(gw->path, gw->latest, NULL, &m) < 0) return;
    amber__manifest_free(&m);
  }
  DIR *d = opendir(gw->path);
  if (!d) return;
  struct dirent *de;
  int removed = 0;
  uint64_t s;
  while ((de = readdir(d)))
    if (amber__parse_manifest_name(de->d_name, &s) &&
        (gw->latest == AMBER_NO_STEP || s > gw->latest))
      removed += unlinkat(dirfd(d), de->d_name, 0) == 0;
  closedir(d);
  if (removed) amber__fsync_dir(gw->path);
}

/* A rank store whose LATEST is missing or unreadable while its files are there
 * (damage, or a hand that removed it) gets LATEST back from the manifests: the
 * newest committed global step whose manifest names this rank's file gives its
 * step and state id, once that file is there with that state id. Without this a
 * writable open would take a lone committed file for a first commit's leftover
 * and remove it. When no manifest names this rank's files, they belong to no
 * committed step and the store is left to the usual rules (amber__store_state).
 * Called with the rank store's lock held, before its stale files are cleaned. */
int amber__gw_repair_rank_latest(amber_global_writer *gw) {
  uint64_t s, id;
  int rc = amber__read_latest(gw->st, NULL, &s, &id);
  if ((rc != AMBER_ENOENT && rc != AMBER_ECORRUPT) || gw->latest == AMBER_NO_STEP ||
      (rc == AMBER_ENOENT && amber__count_ckpt_files(gw->rankdir, NULL) == 0))
    return 0; /* sound, empty, or unreadable: remove_leftovers says so */
  amber_global_step_info *gs = NULL;
  size_t n = 0;
  if (amber_global_list(gw->path, &gs, &n) < 0) n = 0;
  uint32_t me = (uint32_t)gw->comm.rank;
  int found = 0;
  uint64_t g = 0;
  for (size_t i = n; i-- > 0 && !found;) {
    amber__manifest m;
    if ((gs[i].flags & AMBER_CKPT_DAMAGED) ||
        amber__global_load_manifest(gw->path, gs[i].step, NULL, &m) < 0)
      continue;
    if (me < m.world && (m.ranks[me].flags & AMBER__RANK_PRESENT))
      found = 1, g = m.step, s = m.ranks[me].step, id = m.ranks[me].hash;
    amber__manifest_free(&m);
  }
  amber_free(gs);
  if (!found) return 0;
  if (!amber__ckpt_has_state(gw->st, s, id))
    return amber__fail(&gw->err, AMBER_ECORRUPT,
                       "%s: LATEST is %s, and checkpoint %llu (state id %016llx), which the "
                       "manifest of global step %llu names, is missing or another file: the "
                       "rank's store is damaged", gw->rankdir,
                       rc == AMBER_ENOENT ? "missing" : "damaged", (unsigned long long)s,
                       (unsigned long long)id, (unsigned long long)g);
  return amber__write_latest(gw->st, &gw->err, s, id);
}

/* The second round of open, once every rank found the store sound and free: this
 * rank's store made (when new) and locked, its LATEST repaired from the manifests
 * when damaged, what crashed writers left removed (files after the last global
 * commit too), and on rank 0 the manifests of steps GLOBAL never named. */
static int prepare_rank_store(amber_global_writer *gw) {
  int rc;
  if (!gw->st) {
    if (amber__mkdir_p(gw->rankdir) < 0)
      return amber__fail(&gw->err, amber__errno_code(errno), "cannot create %s: %s",
                         gw->rankdir, strerror(errno));
    amber_store_opts so;
    amber_store_opts_init(&so);
    if ((rc = amber__store_open(&gw->st, gw->rankdir, &so, 0)) < 0)
      return amber__fail(&gw->err, rc, "%s", amber_last_error(NULL));
  }
  if (gw->local.on && (rc = amber__gw_local_install(gw)) < 0) return rc;
  if ((rc = amber__gw_repair_rank_latest(gw)) < 0) return rc;
  if ((rc = amber__store_clean(gw->st)) < 0)
    return amber__fail(&gw->err, rc, "%s", amber_last_error(NULL));
  if ((rc = remove_leftovers(gw)) < 0) return rc;
  if (gw->comm.rank == 0 && !gw->local.on) remove_stale_manifests(gw);
  return 0;
}

int amber_global_writer_open(amber_global_writer **out, const char *path,
                             const amber_comm *comm, const amber_writer_opts *opts) {
  *out = NULL;
  int rc = amber__comm_check(comm, NULL);
  if (rc < 0) return rc;
  if (opts && isnan(opts->full_share))
    return amber__fail(NULL, AMBER_EINVAL, "full_share is NaN");
  amber_global_writer *gw = calloc(1, sizeof *gw);
  if (!gw || !(gw->path = strdup(path))) {
    free(gw);
    return amber__fail(NULL, AMBER_ENOMEM, "out of memory");
  }
  gw->comm = *comm;
  if (opts) gw->opts = *opts;
  else amber_writer_opts_init(&gw->opts);
  gw->local.on = (gw->opts.flags & AMBER_WRITER_GLOBAL_LOCAL) != 0;
  gw->opts.flags &= ~(uint32_t)AMBER_WRITER_GLOBAL_LOCAL; /* the rank writers' flags */
  gw->full_every = gw->opts.full_every ? gw->opts.full_every : 50;
  gw->opts.full_every = UINT32_MAX; /* the step decides, not each rank */
  double share = gw->opts.full_share == 0 ? AMBER__DEFAULT_FULL_SHARE : gw->opts.full_share;
  amber__cadence_init(&gw->share, UINT32_MAX, share);
  gw->opts.full_share = -1;
  gw->keep_last = gw->opts.keep_last;
  gw->opts.keep_last = 0; /* the step prunes, not each rank writer on its own */
  amber__global_rank_path(path, (uint32_t)comm->rank, gw->rankdir, sizeof gw->rankdir);
  /* Two rounds, each ended by an exchange of every rank's outcome, so that a
   * failure anywhere fails the open everywhere, with its reason: first what
   * changes nothing (a store in use by another job is left exactly as it was),
   * then this rank's store made ready. */
  rc = agree(gw, check_store(gw));
  /* local mode: the paths' copies of the commit point agreed (its own outcome is
   * the same on every rank) */
  if (rc == 0 && gw->local.on) rc = amber__gw_local_agree(gw);
  if (rc == 0) {
    int lrc = prepare_rank_store(gw);
    if (lrc == 0) {
      gw->deltas = count_deltas(gw);
      learn_share(gw);
    }
    rc = agree(gw, lrc);
  }
  if (rc < 0) goto fail;
  *out = gw;
  return 0;
fail:
  amber__err_adopt(&gw->err);
  amber_global_writer_close(gw);
  return rc;
}


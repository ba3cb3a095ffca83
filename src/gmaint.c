/*
 * gmaint.c - maintenance of a multi-rank store, offline: prune (keep the newest K
 * global steps and what they need) and compact (make a global step full on every
 * rank). Both first take the writer lock of every rank store, so that they never
 * run beside a global writer (AMBER_ELOCKED), and then work rank store by rank
 * store through the single-rank maintenance (amber_store_prune, amber_store_compact).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "global.h"
#include "s3store.h"

/* Every rank store of `path`, opened writable (with its writer lock). */
typedef struct ranks {
  amber_store **st;
  uint32_t n;
} ranks;

static void ranks_close(ranks *rs) {
  for (uint32_t r = 0; r < rs->n; r++) amber_store_close(rs->st[r]);
  free(rs->st);
  memset(rs, 0, sizeof *rs);
}

/* Opens STORE/rank-00000, rank-00001, ... up to the first that does not exist
 * (ranks are numbered without gaps): AMBER_ELOCKED, naming the rank, while a
 * global writer holds one of them. Only the locks: what crashed writers left is
 * the global writer's to remove, which first repairs a rank's LATEST from the
 * manifests (a plain writable open would take a lone committed file under a
 * missing LATEST for a first commit's leftover). */
static int ranks_open(const char *path, ranks *rs) {
  memset(rs, 0, sizeof *rs);
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_NOCREATE;
  for (uint32_t r = 0; r < AMBER__MF_MAX_WORLD; r++) {
    char p[4200];
    struct stat sb;
    amber__global_rank_path(path, r, p, sizeof p);
    if (amber__is_s3(p) ? amber__s3_has_dir(p) != 1 : stat(p, &sb) < 0) break;
    amber_store **ns = realloc(rs->st, (rs->n + 1) * sizeof *ns);
    if (!ns) {
      ranks_close(rs);
      return amber__fail(NULL, AMBER_ENOMEM, "out of memory");
    }
    rs->st = ns;
    int rc = amber__store_open(&rs->st[rs->n], p, &so, 0);
    if (rc < 0) {
      rc = amber__fail(NULL, rc, "rank %u: %s", r, amber_last_error(NULL));
      ranks_close(rs);
      return rc;
    }
    rs->n++;
  }
  return 0;
}

/* ---- prune ---- */

/* Prunes a rank store so that it keeps every step from `oldest` on. */
static int prune_rank(amber_store *st, uint32_t r, uint64_t oldest) {
  amber_ckpt_info *info = NULL;
  size_t n = 0, keep = 0, removed;
  int rc = amber_store_list(st, &info, &n);
  for (size_t i = 0; rc == 0 && i < n; i++) keep += info[i].step >= oldest;
  amber_free(info);
  if (rc == 0 && keep) rc = amber_store_prune(st, keep, &removed);
  if (rc < 0) rc = amber__fail(NULL, rc, "rank %u: %s", r, amber_last_error(st));
  return rc;
}

int amber_global_prune(const char *path, uint64_t keep_last, size_t *removed) {
  if (removed) *removed = 0;
  if (keep_last == 0) return amber__fail(NULL, AMBER_EINVAL, "keep_last must be at least 1");
  ranks rs;
  int rc = ranks_open(path, &rs);
  if (rc < 0) return rc;
  amber_global_step_info *gs = NULL;
  size_t n = 0;
  rc = amber_global_list(path, &gs, &n);
  if (rc < 0 || n <= keep_last) {
    amber_free(gs);
    ranks_close(&rs);
    return rc;
  }
  uint64_t oldest = gs[n - keep_last].step;
  /* Manifests first: a crash between the two steps leaves rank files that no step
   * names, never a step whose files are gone. */
  char p[4200];
  for (size_t i = 0; i < n - keep_last; i++) {
    amber__global_manifest_path(path, gs[i].step, p, sizeof p);
    if (amber__is_s3(p)) {
      if ((rc = amber__s3_remove_path(p, NULL)) < 0) break;
    } else if (unlink(p) < 0 && errno != ENOENT) {
      rc = amber__fail(NULL, amber__errno_code(errno), "cannot remove %s: %s", p,
                       strerror(errno));
      break;
    }
    if (removed) (*removed)++;
  }
  amber_free(gs);
  if (rc == 0 && !amber__is_s3(path) && amber__fsync_dir(path) < 0)
    rc = amber__fail(NULL, AMBER_EIO, "%s: fsync of the directory failed", path);
  for (uint32_t r = 0; rc == 0 && r < rs.n; r++) rc = prune_rank(rs.st[r], r, oldest);
  ranks_close(&rs);
  return rc;
}

/* ---- compact ---- */

int amber_global_compact(const char *path, uint64_t step, size_t *compacted) {
  if (compacted) *compacted = 0;
  uint64_t latest;
  int rc = amber__global_state(path, NULL, &latest);
  if (rc == AMBER_ENOENT)
    return amber__fail(NULL, rc, "%s: no global step committed (no GLOBAL)", path);
  if (rc < 0) return rc;
  if (step == AMBER_LATEST) step = latest;
  if (step > latest)
    return amber__fail(NULL, AMBER_ENOENT, "%s: step %llu is after the latest global step %llu",
                       path, (unsigned long long)step, (unsigned long long)latest);
  ranks rs;
  if ((rc = ranks_open(path, &rs)) < 0) return rc;
  amber__manifest m;
  amber__err e = {0};
  if ((rc = amber__global_load_manifest(path, step, &e, &m)) < 0) {
    ranks_close(&rs);
    return amber__fail(NULL, rc, "%s", e.msg);
  }
  /* Each rank's file of the step becomes full, keeping its state id: the manifest
   * stays true for every reader and for the later deltas of each rank. */
  int allfull = 1;
  for (uint32_t r = 0; rc == 0 && r < m.world; r++) {
    amber__mrank *k = &m.ranks[r];
    if (!(k->flags & AMBER__RANK_PRESENT)) continue;
    if (r >= rs.n) {
      rc = amber__fail(NULL, AMBER_ENOENT, "step %llu: rank %u: its store is missing",
                       (unsigned long long)step, r);
      break;
    }
    if (k->kind == AMBER_KIND_FULL) continue;
    if ((rc = amber_store_compact(rs.st[r], k->step)) < 0) {
      rc = amber__fail(NULL, rc, "step %llu: rank %u: %s", (unsigned long long)step, r,
                       amber_last_error(rs.st[r]));
      break;
    }
    amber_ckpt_info *info = NULL;
    size_t n = 0;
    if ((rc = amber_store_list(rs.st[r], &info, &n)) < 0) {
      rc = amber__fail(NULL, rc, "rank %u: %s", r, amber_last_error(rs.st[r]));
      break;
    }
    for (size_t i = 0; i < n; i++)
      if (info[i].step == k->step) k->kind = info[i].kind, k->bytes = info[i].bytes;
    amber_free(info);
    if (compacted) (*compacted)++;
  }
  for (uint32_t r = 0; r < m.world; r++)
    if ((m.ranks[r].flags & AMBER__RANK_PRESENT) && m.ranks[r].kind != AMBER_KIND_FULL)
      allfull = 0;
  /* Then the manifest says so (atomically replaced): `ls` shows the step full and
   * the next global writer's cadence counts from it. A crash before this leaves
   * full rank files under a manifest that still says delta, which reads the same. */
  if (rc == 0 && allfull && m.kind != AMBER_KIND_FULL) {
    m.kind = AMBER_KIND_FULL, m.parent = AMBER_NO_STEP;
    uint8_t *b = NULL;
    size_t len = 0;
    char p[4200];
    amber__global_manifest_path(path, step, p, sizeof p);
    rc = amber__manifest_encode(&m, &e, &b, &len);
    if (rc == 0) rc = amber__write_file_durable(path, p, &e, b, len);
    if (rc < 0) rc = amber__fail(NULL, rc, "%s", e.msg);
    free(b);
  }
  amber__manifest_free(&m);
  ranks_close(&rs);
  return rc;
}

/*
 * glocal.c - the global writer's local mode (AMBER_WRITER_GLOBAL_LOCAL): each
 * rank's path is its own or its host's (a memory tier under /dev/shm on every
 * node), never seen by the ranks of other hosts (docs/DESIGN.md, "Local mode").
 * A rank writes its store under its own path as always; what changes is the
 * store's commit point, which every path must hold: at each commit rank 0
 * broadcasts the manifest it built and every rank writes its copy of it and of
 * GLOBAL, and at open the ranks agree on the committed step when a crash left the
 * copies different, and install the copies a path lacks.
 *
 * The rule that open applies: the committed step is the newest step whose manifest
 * some rank's path holds and whose every rank's part is in that rank's store (the
 * file the manifest names, with its state id, committed there, and its chain).
 * A manifest is written only after every rank's part is durable, and removed
 * (when a step fails, and by retention) before any rank's part is, so a crash at
 * any instant leaves the newest manifest complete; a newer manifest whose parts
 * are incomplete comes only from lost files, and an older step is then taken if
 * it is complete. When manifests exist but no step is complete (a directory
 * wiped), open is refused on every rank rather than taking the store for empty.
 */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gwriter.h"

/* The steps of the manifests in `dir`, newest first: *steps (malloc'd). */
static int manifest_steps(const char *dir, uint64_t **steps, size_t *n) {
  *steps = NULL, *n = 0;
  DIR *d = opendir(dir);
  if (!d) return errno == ENOENT ? 0 : amber__errno_code(errno);
  size_t cap = 0;
  struct dirent *de;
  int rc = 0;
  while (rc == 0 && (de = readdir(d))) {
    uint64_t s;
    if (!amber__parse_manifest_name(de->d_name, &s)) continue;
    if (*n == cap) {
      uint64_t *ns = realloc(*steps, (cap = cap ? 2 * cap : 16) * sizeof *ns);
      if (!ns) rc = AMBER_ENOMEM;
      else *steps = ns;
    }
    if (rc == 0) (*steps)[(*n)++] = s;
  }
  closedir(d);
  /* newest first: an insertion sort, since a path holds few manifests */
  for (size_t i = 1; rc == 0 && i < *n; i++)
    for (size_t j = i; j > 0 && (*steps)[j - 1] < (*steps)[j]; j--) {
      uint64_t t = (*steps)[j];
      (*steps)[j] = (*steps)[j - 1], (*steps)[j - 1] = t;
    }
  if (rc < 0) free(*steps), *steps = NULL, *n = 0;
  return rc;
}

/* The committed files of this rank's store whose chain is whole (each parent there,
 * none damaged), as (step, state id) pairs in increasing step order: *out
 * (malloc'd, 16 bytes each). A store not yet made has none. */
static int whole_files(amber_global_writer *gw, uint8_t **out, size_t *n) {
  *out = NULL, *n = 0;
  if (!gw->st) return 0;
  int rc = amber__gw_repair_rank_latest(gw); /* a lost LATEST would hide every file */
  amber_ckpt_info *info = NULL;
  size_t k = 0;
  if (rc == 0) rc = amber__store_list(gw->st, &gw->err, &info, &k);
  if (rc < 0) return rc;
  uint8_t *b = malloc(16 * k + 1), *whole = calloc(k + 1, 1);
  if (!b || !whole) {
    free(b), free(whole), free(info);
    return amber__fail(&gw->err, AMBER_ENOMEM, "out of memory");
  }
  for (size_t i = 0; i < k; i++) {
    if (info[i].flags & AMBER_CKPT_DAMAGED) continue;
    if (info[i].kind == AMBER_KIND_FULL) whole[i] = 1;
    for (size_t j = i; !whole[i] && j-- > 0;) /* steps increase: the parent is before */
      if (info[j].step == info[i].parent) whole[i] = whole[j];
    if (!whole[i]) continue;
    amber__put64(b + 16 * *n, info[i].step);
    amber__put64(b + 16 * *n + 8, info[i].hash);
    (*n)++;
  }
  free(whole), free(info);
  *out = b;
  return 0;
}

/* One rank's report, as the others read it. */
typedef struct report {
  int rc;
  const char *msg;
  size_t msg_len;
  uint64_t had;                /* its path's GLOBAL, AMBER_NO_STEP: none */
  const uint8_t *man, *files;  /* u64 steps; (u64 step, u64 state id) pairs */
  uint32_t nman, nfiles;
} report;

/* i32 rc, u16 message length, message, u64 GLOBAL, u32 manifests, u32 files, the
 * manifests' steps, the files' (step, state id). */
static uint8_t *encode_report(amber_global_writer *gw, int rc, const uint64_t *man, size_t nman,
                              const uint8_t *files, size_t nfiles, size_t *len) {
  size_t ml = rc < 0 ? strnlen(gw->err.msg, 1000) : 0;
  size_t n = 6 + ml + 16 + 8 * nman + 16 * nfiles;
  uint8_t *b = malloc(n), *p = b;
  if (!b) return NULL;
  amber__put32(p, (uint32_t)rc), amber__put16(p + 4, (uint16_t)ml);
  memcpy(p + 6, gw->err.msg, ml);
  p += 6 + ml;
  amber__put64(p, gw->local.had), amber__put32(p + 8, (uint32_t)nman);
  amber__put32(p + 12, (uint32_t)nfiles);
  p += 16;
  for (size_t i = 0; i < nman; i++, p += 8) amber__put64(p, man[i]);
  if (nfiles) memcpy(p, files, 16 * nfiles);
  *len = n;
  return b;
}

/* The reports come from this job's ranks: trusted to be well formed. */
static void decode_report(const uint8_t *p, report *r) {
  r->rc = (int)amber__get32(p);
  r->msg_len = amber__get16(p + 4);
  r->msg = (const char *)p + 6;
  p += 6 + r->msg_len;
  r->had = amber__get64(p), r->nman = amber__get32(p + 8), r->nfiles = amber__get32(p + 12);
  r->man = p + 16;
  r->files = r->man + 8 * (size_t)r->nman;
}

static int has_file(const report *r, uint64_t step, uint64_t state) {
  size_t lo = 0, hi = r->nfiles;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    uint64_t s = amber__get64(r->files + 16 * mid);
    if (s == step) return amber__get64(r->files + 16 * mid + 8) == state;
    if (s < step) lo = mid + 1;
    else hi = mid;
  }
  return 0;
}

/* Whether every rank's part of manifest `m` is in its rank's store. */
static int complete(const amber__manifest *m, const report *all, int size) {
  if (m->world != (uint32_t)size) return 0; /* the layout is per rank: same world only */
  for (uint32_t q = 0; q < m->world; q++)
    if ((m->ranks[q].flags & AMBER__RANK_PRESENT) &&
        !has_file(&all[q], m->ranks[q].step, m->ranks[q].hash))
      return 0;
  return 1;
}

/* A manifest of another world size was seen (bit 63 of best_here's answer). */
#define OTHER_WORLD (UINT64_C(1) << 63)

/* The newest manifest of this path that is complete: its step + 1 (0: none), with
 * OTHER_WORLD when a manifest newer than it was written at another world size. */
static uint64_t best_here(amber_global_writer *gw, const uint64_t *man, size_t nman,
                          const report *all) {
  uint64_t other = 0;
  for (size_t i = 0; i < nman; i++) {
    amber__manifest m;
    if (amber__global_load_manifest(gw->path, man[i], NULL, &m) < 0) continue; /* a damaged copy */
    int ok = m.step == man[i] && complete(&m, all, gw->comm.size);
    if (m.world != (uint32_t)gw->comm.size) other = OTHER_WORLD;
    amber__manifest_free(&m);
    if (ok) return (man[i] + 1) | other;
  }
  return other;
}

/* The refusal when manifests exist but no step is complete, the same words on every
 * rank: the newest manifest, and the ranks whose stores hold no file of it. */
static int refuse(amber_global_writer *gw, const report *all, int other_world) {
  if (other_world)
    return amber__fail(&gw->err, AMBER_ECORRUPT, "local mode: the paths hold steps written "
                       "at another world size than this job's %d ranks: a memory tier does "
                       "not reshard (each rank store is its rank's shard); empty the paths "
                       "(their steps restore from the durable tier) before writing here",
                       gw->comm.size);
  uint64_t newest = 0;
  int holder = -1;
  for (int r = 0; r < gw->comm.size; r++) /* each list is newest first */
    if (all[r].nman && (holder < 0 || amber__get64(all[r].man) > newest))
      newest = amber__get64(all[r].man), holder = r;
  char lack[256] = "";
  size_t o = 0;
  for (int r = 0; r < gw->comm.size && o < sizeof lack - 16; r++) {
    int found = 0;
    for (uint32_t i = 0; i < all[r].nfiles && !found; i++)
      found = amber__get64(all[r].files + 16 * i) == newest;
    if (!found) o += (size_t)snprintf(lack + o, sizeof lack - o, "%s%d", o ? ", " : "", r);
  }
  return amber__fail(&gw->err, AMBER_ECORRUPT,
                     "local mode: no global step has every rank's part in place: the newest "
                     "manifest, of step %llu, is on rank %d's path, and rank%s %s hold%s no "
                     "file of it (a directory lost? restore it from a peer or the durable "
                     "tier first: amber_tiers_restore)", (unsigned long long)newest, holder,
                     strchr(lack, ',') ? "s" : "", lack[0] ? lack : "(some)",
                     strchr(lack, ',') ? "" : "s");
}

/* Sends the agreed manifest from `owner` (the lowest rank whose path holds it and
 * found it complete) to every rank: its length, then its bytes. */
static int share_manifest(amber_global_writer *gw, int owner, int need) {
  uint8_t *b = NULL, hdr[8];
  size_t len = 0;
  if (gw->comm.rank == owner &&
      amber__global_manifest_bytes(gw->path, gw->latest, NULL, &b, &len, NULL) < 0)
    len = 0; /* read a moment ago: gone since (then every rank fails alike) */
  amber__put64(hdr, len);
  int rc = gw->comm.broadcast(gw->comm.ctx, hdr, sizeof hdr, owner);
  len = (size_t)amber__get64(hdr);
  if (rc == 0 && len && gw->comm.rank != owner && !(b = malloc(len))) rc = AMBER_ENOMEM;
  if (rc == 0 && len) rc = gw->comm.broadcast(gw->comm.ctx, b, len, owner);
  if (rc < 0) {
    free(b);
    return amber__fail(&gw->err, rc, "%s: local mode: sending the manifest of step %llu "
                       "failed (%s)", gw->path, (unsigned long long)gw->latest,
                       amber_strerror(rc));
  }
  if (!len) {
    free(b);
    return amber__fail(&gw->err, AMBER_EIO, "local mode: rank %d could not read the manifest "
                       "of step %llu again", owner, (unsigned long long)gw->latest);
  }
  if (need) gw->local.install = b, gw->local.install_len = len;
  else free(b);
  return 0;
}

int amber__gw_local_agree(amber_global_writer *gw) {
  int size = gw->comm.size;
  gw->local.had = gw->latest;
  uint64_t *man = NULL;
  uint8_t *files = NULL, *mine = NULL, *all = NULL;
  size_t nman = 0, nfiles = 0, len = 0;
  int rc = manifest_steps(gw->path, &man, &nman);
  if (rc < 0) rc = amber__fail(&gw->err, rc, "%s: cannot list its manifests", gw->path);
  if (rc == 0) rc = whole_files(gw, &files, &nfiles);
  if (rc < 0) { /* this rank's failure, named as the others name it */
    char m[sizeof gw->err.msg];
    snprintf(m, sizeof m, "%s", gw->err.msg);
    amber__fail(&gw->err, rc, "rank %d: %s", gw->comm.rank, m);
    nman = nfiles = 0;
  }
  uint64_t *lens = calloc(2 * (size_t)size, sizeof *lens);
  report *rep = calloc((size_t)size, sizeof *rep);
  uint8_t *best = malloc(8 * (size_t)size);
  int crc = lens && rep && best && (mine = encode_report(gw, rc, man, nman, files, nfiles, &len))
                ? 0 : AMBER_ENOMEM;
  free(files);
  /* every rank makes the same collectives, whatever failed on its own */
  if (crc == 0)
    crc = amber__comm_allgatherv(&gw->comm, &gw->err, mine, len, &all, lens, lens + size);
  free(mine);
  int bad = -1;
  uint64_t agreed = 0, b = 0;
  if (crc == 0) {
    for (int r = 0; r < size; r++) {
      decode_report(all + lens[size + r], &rep[r]);
      if (rep[r].rc < 0 && bad < 0) bad = r;
    }
    b = bad < 0 ? best_here(gw, man, nman, rep) : 0;
    uint8_t b8[8];
    amber__put64(b8, b);
    crc = gw->comm.allgather(gw->comm.ctx, b8, 8, best);
  }
  free(man);
  int owner = -1, need = 0, other = 0;
  for (int r = 0; crc == 0 && r < size; r++) {
    uint64_t br = amber__get64(best + 8 * (size_t)r);
    other |= (br & OTHER_WORLD) != 0;
    if ((br & ~OTHER_WORLD) > agreed) agreed = br & ~OTHER_WORLD, owner = r;
  }
  for (int r = 0; crc == 0 && agreed && r < size; r++)
    need |= (amber__get64(best + 8 * (size_t)r) & ~OTHER_WORLD) != agreed;
  free(best);
  if (crc < 0) rc = amber__fail(&gw->err, crc, "%s: opening the global writer: a collective "
                                "failed (%s)", gw->path, amber_strerror(crc));
  else if (bad >= 0)
    rc = amber__fail(&gw->err, rep[bad].rc, "%.*s", (int)rep[bad].msg_len, rep[bad].msg);
  else if (!agreed) {
    int any = 0;
    for (int r = 0; r < size; r++) any |= rep[r].nman != 0;
    gw->latest = AMBER_NO_STEP;
    rc = any ? refuse(gw, rep, other) : 0;
  } else {
    gw->latest = agreed - 1;
    rc = need ? share_manifest(gw, owner, (b & ~OTHER_WORLD) != agreed) : 0;
  }
  free(all), free(lens), free(rep);
  return rc;
}

/* Points this path's GLOBAL at `step` (AMBER_NO_STEP: removes it). */
static int set_global(amber_global_writer *gw, uint64_t step) {
  if (step != AMBER_NO_STEP) return amber__global_write_latest(gw->path, &gw->err, step);
  char p[4200];
  snprintf(p, sizeof p, "%s/GLOBAL", gw->path);
  if (unlink(p) < 0 && errno != ENOENT)
    return amber__fail(&gw->err, amber__errno_code(errno), "cannot remove %s: %s", p,
                       strerror(errno));
  return amber__fsync_dir(gw->path) < 0
             ? amber__fail(&gw->err, AMBER_EIO, "%s: fsync of the directory failed", gw->path)
             : 0;
}

/* Removes this path's manifests of steps after `step` (AMBER_NO_STEP: every one). */
static int remove_manifests_after(amber_global_writer *gw, uint64_t step) {
  uint64_t *man;
  size_t n;
  int rc = manifest_steps(gw->path, &man, &n), removed = 0;
  for (size_t i = 0; rc == 0 && i < n; i++) {
    if (step != AMBER_NO_STEP && man[i] <= step) break; /* newest first */
    char p[4200];
    amber__global_manifest_path(gw->path, man[i], p, sizeof p);
    if (unlink(p) < 0 && errno != ENOENT) rc = amber__errno_code(errno);
    removed = 1;
  }
  free(man);
  if (rc == 0 && removed && amber__fsync_dir(gw->path) < 0) rc = AMBER_EIO;
  return rc < 0 ? amber__fail(&gw->err, rc, "%s: cannot remove the manifests after the "
                              "agreed step", gw->path) : 0;
}

int amber__gw_local_install(amber_global_writer *gw) {
  int rc = 0;
  if (gw->local.install) {
    char p[4200];
    amber__manifest m;
    amber__global_manifest_path(gw->path, gw->latest, p, sizeof p);
    rc = amber__manifest_decode(&gw->err, p, gw->local.install, gw->local.install_len, &m);
    if (rc == 0) {
      amber__manifest_free(&m);
      rc = amber__write_file_durable(gw->path, p, &gw->err, gw->local.install,
                                     gw->local.install_len);
    }
    free(gw->local.install);
    gw->local.install = NULL;
  }
  /* the manifest before GLOBAL, as in a commit; what no step has, after */
  if (rc == 0 && gw->local.had != gw->latest) rc = set_global(gw, gw->latest);
  if (rc == 0) rc = remove_manifests_after(gw, gw->latest);
  return rc;
}

#define OUTCOME 256 /* i32 rc, u64 the oldest step kept (rank 0's), message */

int amber__gw_local_copy(amber_global_writer *gw, const uint8_t *bytes, uint64_t len, int *bad,
                         int *brc, char *why, size_t wl, uint64_t *oldest) {
  int me = gw->comm.rank, size = gw->comm.size;
  unsigned long long step = (unsigned long long)gw->step;
  *bad = -1, *brc = 0, *oldest = AMBER_NO_STEP;
  uint8_t *b = me == 0 ? (uint8_t *)bytes : malloc(len ? (size_t)len : 1);
  if (!b) return amber__fail(&gw->err, AMBER_ENOMEM, "step %llu: out of memory", step);
  int crc = gw->comm.broadcast(gw->comm.ctx, b, (size_t)len, 0);
  if (crc < 0) {
    if (me) free(b);
    return amber__fail(&gw->err, crc, "step %llu: the broadcast of its manifest failed (%s)",
                       step, amber_strerror(crc));
  }
  char mpath[4200];
  amber__global_manifest_path(gw->path, gw->step, mpath, sizeof mpath);
  /* a per-rank temporary name and a rename: ranks sharing the path write the same
   * bytes, one after the other or at once */
  int rc = amber__write_file_durable(gw->path, mpath, &gw->err, b, (size_t)len);
  if (me) free(b);
  if (rc == 0) rc = amber__global_write_latest(gw->path, &gw->err, gw->step);
  uint64_t keep = AMBER_NO_STEP;
  if (rc == 0 && me == 0 && gw->keep_last) keep = amber__gw_oldest_kept(gw);
  uint8_t mine[OUTCOME], *all = malloc((size_t)size * OUTCOME);
  memset(mine, 0, sizeof mine);
  amber__put32(mine, (uint32_t)rc), amber__put64(mine + 4, keep);
  if (rc < 0) snprintf((char *)mine + 12, OUTCOME - 12, "%.243s", gw->err.msg);
  crc = all ? gw->comm.allgather(gw->comm.ctx, mine, OUTCOME, all) : AMBER_ENOMEM;
  if (crc < 0) {
    free(all);
    return amber__fail(&gw->err, crc, "step %llu: the exchange of the copies' outcomes failed "
                       "(%s)", step, amber_strerror(crc));
  }
  for (int r = 0; r < size && *bad < 0; r++)
    if ((*brc = (int)amber__get32(all + (size_t)r * OUTCOME)) < 0) {
      *bad = r;
      snprintf(why, wl, "%.*s", OUTCOME - 12, (const char *)all + (size_t)r * OUTCOME + 12);
    }
  *oldest = amber__get64(all + 4);
  free(all);
  if (*bad < 0) return 0;
  /* Every path's copy is taken back before any rank removes its part of the step
   * (fail_local, after this): a crash in between leaves either a manifest whose
   * parts are all there (a complete step, which the next open keeps) or no manifest. */
  if (unlink(mpath) == 0) amber__fsync_dir(gw->path);
  set_global(gw, gw->latest);
  crc = gw->comm.barrier(gw->comm.ctx);
  return crc < 0 ? amber__fail(&gw->err, crc, "step %llu: a barrier failed (%s)", step,
                               amber_strerror(crc))
                 : 0;
}

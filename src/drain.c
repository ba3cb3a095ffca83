/*
 * drain.c - the drain: committed steps of a memory tier copied to the durable tier
 * in commit order, on a thread of their own (amber_drain_start) or once in the
 * caller's (amber_drain_run), and the memory tier kept to what is not yet durable
 * and what its newest step needs (docs/DESIGN.md, "Storage tiers").
 *
 * A drain works on lanes and, for a multi-rank store, a coordinator. A lane is one
 * store of the memory tier (the single-rank store, or a rank store) and the same
 * store of the durable tier: each of its committed steps is installed there (the
 * files its chain lacks, then LATEST: src/tier.c). The coordinator drains the
 * manifests and GLOBAL: a global step's manifest, then GLOBAL, once every rank's
 * file of the step and its chain are durable, whichever lane (or other process, for
 * ranks of other hosts) put them there. One unit of work at a time, so that close
 * stops after the file in progress and kick sees progress step by step.
 *
 * Retention: once a step is durable, the memory tier's files older than the chain
 * of the authority step are removed when the durable tier holds them and no step
 * not yet durable needs them (the memory tier restores every step it lists). The
 * authority is the memory store's LATEST for a single-rank store (LATEST never moves
 * back); for a multi-rank store, the durable tier's GLOBAL, since a rank store's LATEST
 * may move back one step when a global step fails, and every later step of the rank,
 * whatever its chain, starts at or after the chain of a committed global step. Files
 * are removed while the store's writer runs: they are committed, immutable, and
 * older than anything the writer will read again (its reference reloads from its
 * LATEST's chain), and the writer never writes their names again (steps increase);
 * so no lock is needed, and none is taken.
 */
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "global.h"
#include "io.h"
#include "s3store.h"
#include "tier.h"

#define POLL_IDLE_S 0.2    /* the thread looks for commits that no kick announced */
#define POLL_REMOTE_S 0.02 /* the coordinator waits for other hosts' rank files */

enum { LAYOUT_UNKNOWN, LAYOUT_SINGLE, LAYOUT_MULTI };

typedef struct lane {
  int32_t rank;    /* -1: the single-rank store */
  char *src;       /* the memory store's directory */
  amber_store *st; /* read-only, opened once the directory exists */
  amber__dview dv; /* what the durable tier holds of the store */
  uint64_t d_step,
      d_state; /* the durable store's LATEST (AMBER_NO_STEP: none); under mu */
  uint64_t auth_g, auth_step, auth_state; /* retention's authority, for GLOBAL auth_g */
  amber__image *img; /* AMBER_DRAIN_IMAGE: the image of the store's newest step */
  uint64_t img_step; /* the step it holds (AMBER_NO_STEP: none); under mu */
} lane;

struct amber_drain {
  amber__err err; /* first: amber_last_error(d) reads it; the sticky error's message */
  char *memory, *durable;
  amber_drain_opts o;
  amber__dest *dest;
  int layout, sync;
  int coord;            /* drains the manifests and GLOBAL */
  uint64_t retained_g;  /* the durable GLOBAL of the last retention (multi-rank) */
  amber__dview *remote; /* the coordinator's views of ranks no lane drains, by rank */
  uint32_t nremote;
  amber__tcount cnt; /* the thread's; published to drained_* under mu */
  /* shared with the caller's thread, under mu */
  pthread_mutex_t mu;
  pthread_cond_t wake, moved;
  lane *lanes;
  size_t nlanes;
  uint64_t g_d; /* the durable tier's GLOBAL (AMBER_NO_STEP: none) */
  int error;    /* sticky */
  int failed;   /* the drain stopped (error is its reason) */
  int kicked, wants_full;
  int committed; /* a commit was kicked: the images follow commits from then on, and a
                    restart's restore (which installs files but commits nothing) never
                    competes with an image being built */
  uint64_t gen; /* units of work done */
  uint64_t drained_bytes, drained_files;
  atomic_int stop;
  pthread_t thread;
  int threaded;
};

/* ---- errors ---- */

/* Makes `rc` the drain's sticky error (the first one stays), with message `msg`. */
static int set_error(amber_drain *d, int rc, const char *msg, int failed) {
  pthread_mutex_lock(&d->mu);
  if (!d->error) {
    d->error = rc;
    size_t len = strlen(msg); /* what fits */
    if (len >= sizeof d->err.msg) len = sizeof d->err.msg - 1;
    memcpy(d->err.msg, msg, len);
    d->err.msg[len] = 0;
  }
  d->failed |= failed;
  rc = d->error;
  pthread_cond_broadcast(&d->moved);
  pthread_mutex_unlock(&d->mu);
  return rc;
}

/* The sticky error, also as the calling thread's last message. */
static int sticky(amber_drain *d) {
  pthread_mutex_lock(&d->mu);
  int rc = d->error;
  if (rc) amber__fail(NULL, rc, "%s", d->err.msg);
  pthread_mutex_unlock(&d->mu);
  return rc;
}

/* ---- the memory tier ---- */

typedef struct mlist {
  amber_ckpt_info *info; /* committed steps, oldest first */
  size_t n;
} mlist;

/* The committed steps of memory store `dir` (none when it does not exist). */
static int mem_list(const char *dir, amber__err *e, mlist *m) {
  memset(m, 0, sizeof *m);
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY;
  amber_store *st;
  int rc = amber_store_open(&st, dir, &so);
  if (rc == AMBER_ENOENT) return 0;
  if (rc) return amber__fail(e, rc, "%s", amber_last_error(NULL));
  /* No LATEST: nothing committed to move. Files without it are also what a store
   * being installed holds for a while (a restore unpacks a chain there, its files
   * first and LATEST last), which is not damage: a reader reports a store left so. */
  uint64_t step, state;
  rc = amber__read_latest(st, e, &step, &state);
  if (rc == AMBER_ENOENT) {
    amber_store_close(st);
    return 0;
  }
  if (rc == 0) rc = amber__store_list(st, e, &m->info, &m->n);
  amber_store_close(st);
  return rc;
}

/* Marks in `in` the chain of entry `i` of the listing (following parents through
 * the listing) and returns the step of its full checkpoint, or AMBER_NO_STEP when the
 * chain cannot be followed to one. *bytes, *full_bytes (may be NULL): its size, and
 * its full file's. */
static uint64_t chain_of(const mlist *m, size_t i, char *in, uint64_t *bytes,
                         uint64_t *full_bytes) {
  for (;;) {
    in[i] = 1;
    if (bytes) *bytes += m->info[i].bytes;
    if (m->info[i].flags & AMBER_CKPT_DAMAGED) return AMBER_NO_STEP;
    if (m->info[i].kind == AMBER_KIND_FULL) {
      if (full_bytes) *full_bytes = m->info[i].bytes;
      return m->info[i].step;
    }
    size_t p = i;
    while (p > 0 && m->info[p - 1].step != m->info[i].parent)
      p--;
    if (p == 0) return AMBER_NO_STEP;
    i = p - 1;
  }
}

static int pending(const amber_ckpt_info *c, uint64_t d_step, uint64_t d_state) {
  return d_step == AMBER_NO_STEP || c->step > d_step ||
         (c->step == d_step && c->hash != d_state);
}

static uint64_t file_size(const char *path) {
  struct stat sb;
  return stat(path, &sb) == 0 ? (uint64_t)sb.st_size : 0;
}

/* ---- layout and lanes ---- */

/* What the memory directory holds: a multi-rank store (GLOBAL, a manifest or a rank
 * store), a single-rank store (LATEST or a checkpoint file), or nothing yet. */
static int memory_layout(const char *dir) {
  DIR *dd = opendir(dir);
  if (!dd) return LAYOUT_UNKNOWN;
  int layout = LAYOUT_UNKNOWN;
  struct dirent *de;
  while ((de = readdir(dd))) {
    uint64_t s;
    uint32_t r;
    if (!strcmp(de->d_name, "GLOBAL") || amber__parse_manifest_name(de->d_name, &s) ||
        amber__parse_rank_name(de->d_name, &r)) {
      layout = LAYOUT_MULTI;
      break;
    }
    if (!strcmp(de->d_name, "LATEST") || amber__parse_ckpt_name(de->d_name, &s))
      layout = LAYOUT_SINGLE;
  }
  closedir(dd);
  return layout;
}

static lane *find_lane(amber_drain *d, int32_t rank) {
  for (size_t i = 0; i < d->nlanes; i++)
    if (d->lanes[i].rank == rank) return &d->lanes[i];
  return NULL;
}

/* Claims the durable store of lane `rank`, removes what an earlier drain left there
 * (temporary files), reads its LATEST, and adds the lane. */
static int add_lane(amber_drain *d, amber__err *e, int32_t rank) {
  char store[16] = "", src[4200];
  if (rank >= 0) snprintf(store, sizeof store, "rank-%05d", (int)rank);
  snprintf(src, sizeof src, "%s%s%s", d->memory, rank >= 0 ? "/" : "", store);
  lane l;
  memset(&l, 0, sizeof l);
  l.rank = rank;
  l.d_step = l.auth_g = l.img_step = AMBER_NO_STEP;
  amber__dview_init(&l.dv, d->dest, rank);
  int rc = d->dest->ops->claim(d->dest, e, store);
  if (!rc && (d->o.flags & AMBER_DRAIN_IMAGE) && amber__image_create(&l.img, src))
    rc = amber__fail(e, AMBER_ENOMEM, "out of memory");
  char **names = NULL;
  size_t n = 0;
  if (!rc) rc = d->dest->ops->list(d->dest, e, l.dv.prefix, &names, &n);
  for (size_t i = 0; !rc && i < n; i++) {
    size_t len = strlen(names[i]);
    char name[4200];
    snprintf(name, sizeof name, "%s%s", l.dv.prefix, names[i]);
    if (len > 4 && !strcmp(names[i] + len - 4, ".tmp"))
      rc = d->dest->ops->remove(d->dest, e, name);
  }
  amber__names_list_free(names, n);
  if (!rc) {
    rc = amber__dview_latest(&l.dv, e, &l.d_step, &l.d_state);
    if (rc == AMBER_ENOENT) rc = 0, l.d_step = AMBER_NO_STEP;
  }
  if (!rc && !(l.src = strdup(src))) rc = amber__fail(e, AMBER_ENOMEM, "out of memory");
  lane *grown = rc ? NULL : realloc(d->lanes, (d->nlanes + 1) * sizeof *grown);
  if (!rc && !grown) rc = amber__fail(e, AMBER_ENOMEM, "out of memory");
  if (rc) {
    free(l.src);
    amber__dview_free(&l.dv);
    amber__image_free(l.img);
    return rc;
  }
  pthread_mutex_lock(&d->mu);
  d->lanes = grown;
  d->lanes[d->nlanes++] = l;
  pthread_mutex_unlock(&d->mu);
  return 0;
}

/* Decides the layout once the memory directory shows one, checks that the durable
 * tier has the same, and adds the lanes it shows (the rank stores of a -1 drain
 * appear as their ranks first commit). */
static int discover(amber_drain *d, amber__err *e) {
  if (d->layout == LAYOUT_UNKNOWN) {
    int m = memory_layout(d->memory);
    if (m == LAYOUT_SINGLE && d->o.rank >= 0)
      return amber__fail(e, AMBER_EINVAL,
                         "rank %d: the memory tier %s is a single-rank store",
                         (int)d->o.rank, d->memory);
    if (d->o.rank >= 0) m = LAYOUT_MULTI;
    if (m == LAYOUT_UNKNOWN) return 0;
    char **names = NULL;
    size_t n = 0;
    int rc = d->dest->ops->list(d->dest, e, "", &names, &n), other = 0;
    for (size_t i = 0; !rc && i < n; i++) {
      uint64_t s;
      uint32_t r;
      if (m == LAYOUT_MULTI)
        other |= !strcmp(names[i], "LATEST") || amber__parse_ckpt_name(names[i], &s);
      else
        other |= !strcmp(names[i], "GLOBAL") ||
                 amber__parse_manifest_name(names[i], &s) ||
                 amber__parse_rank_name(names[i], &r);
    }
    amber__names_list_free(names, n);
    if (rc) return rc;
    if (other)
      return amber__fail(e, AMBER_EINVAL,
                         "the memory tier %s is a %s store, but the durable "
                         "tier %s is a %s one",
                         d->memory, m == LAYOUT_MULTI ? "multi-rank" : "single-rank",
                         d->durable, m == LAYOUT_MULTI ? "single-rank" : "multi-rank");
    pthread_mutex_lock(&d->mu);
    d->layout = m;
    d->coord = m == LAYOUT_MULTI && d->o.rank <= 0;
    pthread_mutex_unlock(&d->mu);
    if (m == LAYOUT_SINGLE) return add_lane(d, e, -1);
    if (d->o.rank >= 0 && (rc = add_lane(d, e, d->o.rank))) return rc;
    if (d->coord) {
      /* the coordinator's own leftovers: temporary manifests and GLOBALs */
      char **top = NULL;
      size_t k = 0;
      rc = d->dest->ops->list(d->dest, e, "", &top, &k);
      for (size_t i = 0; !rc && i < k; i++) {
        size_t len = strlen(top[i]);
        if (len > 4 && !strcmp(top[i] + len - 4, ".tmp"))
          rc = d->dest->ops->remove(d->dest, e, top[i]);
      }
      amber__names_list_free(top, k);
      uint8_t *b;
      size_t len;
      amber__err scratch;
      int g = amber__dest_get(d->dest, &scratch, "GLOBAL", 4096, &b, &len);
      if (g == 0) {
        char what[4200];
        snprintf(what, sizeof what, "%s/GLOBAL", d->durable);
        g = amber__global_decode(e, what, b, len, &d->g_d);
        free(b);
        if (g) return g;
      } else if (g != AMBER_ENOENT) {
        return amber__fail(e, g, "%s", scratch.msg);
      }
      if (rc) return rc;
    }
  }
  if (d->layout != LAYOUT_MULTI || d->o.rank >= 0) return 0;
  DIR *dd = opendir(d->memory);
  if (!dd) return 0;
  struct dirent *de;
  int rc = 0;
  while (!rc && (de = readdir(dd))) {
    uint32_t r;
    if (amber__parse_rank_name(de->d_name, &r) && r < AMBER__MF_MAX_WORLD &&
        !find_lane(d, (int32_t)r))
      rc = add_lane(d, e, (int32_t)r);
  }
  closedir(dd);
  return rc;
}

static amber_store *lane_store(lane *l) {
  if (!l->st) {
    amber_store_opts so;
    amber_store_opts_init(&so);
    so.flags = AMBER_OPEN_READONLY;
    if (amber_store_open(&l->st, l->src, &so)) l->st = NULL;
  }
  return l->st;
}

/* ---- retention ---- */

/* The durable tier's GLOBAL, read again until it exists (it never goes away). */
static uint64_t durable_global(amber_drain *d) {
  if (d->coord) return d->g_d;
  uint8_t *b;
  size_t len;
  uint64_t g = AMBER_NO_STEP;
  amber__err scratch;
  if (amber__dest_get(d->dest, &scratch, "GLOBAL", 4096, &b, &len) == 0) {
    if (amber__global_decode(NULL, "GLOBAL", b, len, &g)) g = AMBER_NO_STEP;
    free(b);
  }
  return g;
}

/* Lane `l`'s part of the newest durable global step: 1 and its step and state, 0
 * when there is none. */
static int multi_authority(amber_drain *d, lane *l, uint64_t *step, uint64_t *state) {
  uint64_t g = durable_global(d);
  if (g == AMBER_NO_STEP) return 0;
  if (g != l->auth_g) {
    amber__manifest m;
    int rc = amber__global_load_manifest(d->memory, g, NULL, &m);
    if (rc) { /* not in the memory directory: the durable tier's copy */
      char name[64];
      uint8_t *b;
      size_t len;
      amber__err scratch;
      snprintf(name, sizeof name, "step-%020" PRIu64 ".manifest", g);
      if (amber__dest_get(d->dest, &scratch, name, (size_t)1 << 32, &b, &len)) return 0;
      rc = amber__manifest_decode(NULL, name, b, len, &m);
      free(b);
      if (rc) return 0;
    }
    l->auth_step = AMBER_NO_STEP;
    if ((uint32_t)l->rank < m.world && (m.ranks[l->rank].flags & AMBER__RANK_PRESENT))
      l->auth_step = m.ranks[l->rank].step, l->auth_state = m.ranks[l->rank].hash;
    amber__manifest_free(&m);
    l->auth_g = g;
  }
  if (l->auth_step == AMBER_NO_STEP) return 0;
  *step = l->auth_step, *state = l->auth_state;
  return 1;
}

/* Removes from lane `l`'s memory store the files older than the chain of the
 * authority step that the durable tier holds and that no step not yet durable needs
 * (newest first, as prune does). */
static int retain_lane(amber_drain *d, lane *l, amber__err *e) {
  amber_store *st = lane_store(l);
  if (!st) return 0;
  mlist m;
  int rc = mem_list(l->src, e, &m);
  if (rc || !m.n) {
    amber_free(m.info);
    return rc;
  }
  uint64_t astep = m.info[m.n - 1].step, astate = m.info[m.n - 1].hash;
  int have = d->layout == LAYOUT_SINGLE || multi_authority(d, l, &astep, &astate);
  size_t a = m.n;
  for (size_t i = 0; have && i < m.n; i++)
    if (m.info[i].step == astep && m.info[i].hash == astate) a = i;
  char *in = calloc(m.n, 1), *durable = calloc(m.n, 1);
  uint64_t full =
      a < m.n && in && durable ? chain_of(&m, a, in, NULL, NULL) : AMBER_NO_STEP;
  /* A step not yet durable keeps its chain too, so that the memory tier restores
   * every step it lists. */
  for (size_t i = 0; full != AMBER_NO_STEP && i < m.n && !rc; i++) {
    if (m.info[i].step >= full) break;
    int has = amber__dview_has(&l->dv, e, m.info[i].step, m.info[i].hash);
    if (has < 0) rc = has;
    if (has == 1)
      durable[i] = 1;
    else
      chain_of(&m, i, in, NULL, NULL);
  }
  int removed = 0;
  for (size_t i = m.n; full != AMBER_NO_STEP && i-- > 0 && !rc;) {
    if (m.info[i].step >= full || in[i] || !durable[i]) continue;
    char path[4200];
    amber__ckpt_path(st, m.info[i].step, NULL, path, sizeof path);
    if (unlink(path) != 0 && errno != ENOENT)
      rc =
          amber__fail(e, amber__errno_code(errno),
                      "cannot remove %s from the memory tier: %s", path, strerror(errno));
    removed = 1;
  }
  if (removed) amber__fsync_dir(l->src);
  free(in);
  free(durable);
  amber_free(m.info);
  return rc;
}

/* The coordinator's part: the memory directory's manifests older than the durable
 * tier's GLOBAL, once the durable tier holds them (the same bytes). */
static void retain_manifests(amber_drain *d) {
  uint64_t *steps;
  size_t n;
  if (d->g_d == AMBER_NO_STEP || d->g_d == 0 ||
      amber__manifest_steps(d->memory, d->g_d - 1, &steps, &n))
    return;
  int removed = 0;
  for (size_t i = 0; i < n; i++) {
    char path[4200], name[64];
    uint64_t size;
    amber__err scratch;
    amber__global_manifest_path(d->memory, steps[i], path, sizeof path);
    snprintf(name, sizeof name, "step-%020" PRIu64 ".manifest", steps[i]);
    if (d->dest->ops->stat(d->dest, &scratch, name, &size) == 0 &&
        size == file_size(path))
      removed += unlink(path) == 0;
  }
  free(steps);
  if (removed) amber__fsync_dir(d->memory);
}

static int retain(amber_drain *d, amber__err *e) {
  if (d->layout == LAYOUT_MULTI) d->retained_g = durable_global(d);
  if (d->coord) retain_manifests(d); /* manifests first: never a step without its files */
  int rc = 0;
  for (size_t i = 0; i < d->nlanes && !rc; i++)
    rc = retain_lane(d, &d->lanes[i], e);
  return rc;
}

/* ---- units of work ---- */

static void set_lane_position(amber_drain *d, lane *l, uint64_t step, uint64_t state) {
  pthread_mutex_lock(&d->mu);
  l->d_step = step, l->d_state = state;
  pthread_mutex_unlock(&d->mu);
}

static int lane_install(amber_drain *d, lane *l, amber__err *e, uint64_t step,
                        uint64_t state) {
  amber_store *st = lane_store(l);
  if (!st) return amber__fail(e, AMBER_ENOENT, "no store at %s", l->src);
  int pointer = l->d_step == AMBER_NO_STEP || step >= l->d_step;
  int rc = amber__tier_install(st, &l->dv, e, step, state, pointer, &d->stop, &d->cnt);
  if (!rc && pointer) set_lane_position(d, l, step, state);
  return rc;
}

/* Whether the lanes drain their stores' own commits: a rank's drain, a single-rank
 * store, and the rank stores of a memory directory without GLOBAL (a host whose
 * ranks' manifests another host's memory tier holds). Where the memory directory
 * has GLOBAL, a drain of every rank drains what the manifests name, no more: a rank
 * store ahead of GLOBAL holds a step that may never commit. */
static int lanes_free(const amber_drain *d, int layout) {
  if (d->o.rank >= 0 || layout == LAYOUT_SINGLE) return 1;
  char p[4200];
  struct stat sb;
  snprintf(p, sizeof p, "%s/GLOBAL", d->memory);
  return stat(p, &sb) != 0;
}

/* The oldest pending step of a lane that drains its own commits. */
static int lane_unit(amber_drain *d, lane *l, amber__err *e, int *progress) {
  mlist m;
  int rc = mem_list(l->src, e, &m);
  size_t i = 0;
  while (!rc && i < m.n && !pending(&m.info[i], l->d_step, l->d_state))
    i++;
  if (rc || i == m.n) {
    amber_free(m.info);
    return rc;
  }
  uint64_t step = m.info[i].step, state = m.info[i].hash;
  amber_free(m.info);
  rc = lane_install(d, l, e, step, state);
  *progress = 1;
  if (rc && rc != AMBER_ECANCELED) {
    /* Removed from the memory tier meanwhile (a prune of the writer's own): it can
     * no longer be drained, and nothing needs it. */
    amber__err scratch;
    int gone = mem_list(l->src, &scratch, &m) == 0;
    for (size_t k = 0; gone && k < m.n; k++)
      gone = m.info[k].step != step;
    amber_free(m.info);
    if (gone) rc = 0;
  }
  return rc;
}

static amber__dview *remote_view(amber_drain *d, amber__err *e, uint32_t r) {
  if (r >= d->nremote) {
    amber__dview *g = realloc(d->remote, (r + 1) * sizeof *g);
    if (!g) return amber__fail(e, AMBER_ENOMEM, "out of memory"), NULL;
    for (uint32_t i = d->nremote; i <= r; i++)
      amber__dview_init(&g[i], d->dest, (int32_t)i);
    d->remote = g, d->nremote = r + 1;
  }
  return &d->remote[r];
}

/* The oldest global step not yet durable: each rank's file of it (local lanes
 * install it), then the manifest, then GLOBAL. *waiting: a rank of another memory
 * tier has not put its file there yet. */
static int coord_unit(amber_drain *d, amber__err *e, int *progress, int *waiting) {
  uint64_t gm, *steps = NULL, s = AMBER_NO_STEP;
  size_t n = 0;
  int rc = amber__global_read_latest(d->memory, e, &gm);
  if (rc == AMBER_ENOENT) return 0;
  if (!rc) rc = amber__manifest_steps(d->memory, gm, &steps, &n);
  for (size_t i = 0; !rc && i < n && s == AMBER_NO_STEP; i++)
    if (d->g_d == AMBER_NO_STEP || steps[i] > d->g_d) s = steps[i];
  free(steps);
  if (rc || s == AMBER_NO_STEP) return rc;
  amber__manifest m;
  if ((rc = amber__global_load_manifest(d->memory, s, e, &m)) != 0)
    return rc == AMBER_ENOENT ? 0 : rc; /* removed since the listing: none to drain */
  for (uint32_t r = 0; !rc && r < m.world; r++) {
    const amber__mrank *k = &m.ranks[r];
    if (!(k->flags & AMBER__RANK_PRESENT)) continue;
    lane *l = find_lane(d, (int32_t)r);
    amber__dview *v = l ? &l->dv : remote_view(d, e, r);
    if (!v) rc = AMBER_ENOMEM;
    int has = rc ? 0 : amber__dview_has(v, e, k->step, k->hash);
    if (has < 0) rc = has;
    if (rc || has) continue;
    if (l) {
      rc = lane_install(d, l, e, k->step, k->hash);
      *progress = 1;
      amber__manifest_free(&m);
      return rc; /* one rank at a time: close stops between them */
    }
    if (!d->sync) {
      *waiting = 1;
      break;
    }
    char name[64];
    amber__dview_name(v, k->step, name, sizeof name);
    rc = amber__fail(
        e, AMBER_ENOENT,
        "global step %" PRIu64 " needs rank %u's file %s/%s, "
        "which the durable tier does not hold and %s does not have (no rank-%05u): "
        "drain the memory tier that holds it first",
        s, r, d->durable, name, d->memory, r);
  }
  amber__manifest_free(&m);
  if (rc || *waiting) return rc;
  char path[4200], name[64];
  uint8_t *b, g[AMBER__GLOBAL_SIZE];
  size_t len;
  amber__global_manifest_path(d->memory, s, path, sizeof path);
  snprintf(name, sizeof name, "step-%020" PRIu64 ".manifest", s);
  if ((rc = amber__read_small(path, e, &b, &len, (size_t)1 << 32)) != 0) return rc;
  if ((rc = amber__manifest_decode(e, path, b, len, &m)) ==
      0) { /* its checksum, its tiling */
    amber__manifest_free(&m);
    rc = amber__dest_put_bytes(d->dest, e, name, b, len);
  }
  free(b);
  if (rc) return rc;
  amber__global_encode(s, g);
  if ((rc = amber__dest_put_bytes(d->dest, e, "GLOBAL", g, sizeof g)) != 0) return rc;
  pthread_mutex_lock(&d->mu);
  d->g_d = s;
  pthread_mutex_unlock(&d->mu);
  *progress = 1;
  return 0;
}

/* The bytes the memory tier holds of lane `l`'s store (its committed files). */
static uint64_t lane_bytes(lane *l) {
  mlist m;
  amber__err e;
  uint64_t n = 0;
  if (mem_list(l->src, &e, &m) == 0)
    for (size_t k = 0; k < m.n; k++) n += m.info[k].bytes;
  amber_free(m.info);
  return n;
}

/* Brings each lane's image to its store's newest step, where the memory budget has
 * room for it beside the files (it is dropped where it has not). Done when nothing
 * else is to do: the durable tier comes first. */
static int images(amber_drain *d, const atomic_int *stop) {
  uint64_t used = 0, b = d->o.memory_budget;
  int rc = 0, counted = 0;
  for (size_t i = 0; i < d->nlanes && !rc; i++) {
    lane *l = &d->lanes[i];
    amber_store *st = l->img ? lane_store(l) : NULL;
    if (!st) continue;
    if (amber__image_current(l->img, st)) { /* the idle poll's usual case: LATEST read */
      used += amber__image_bytes(l->img);
      continue;
    }
    if (b && !counted) { /* what the files take, listed only when an image moves */
      for (size_t k = 0; k < d->nlanes; k++) used += lane_bytes(&d->lanes[k]);
      counted = 1;
    }
    uint64_t room = !b ? UINT64_MAX : b > used ? b - used : 0, bytes = 0;
    rc = amber__image_update(l->img, st, stop, room, &bytes);
    used += bytes;
    pthread_mutex_lock(&d->mu);
    l->img_step = amber__image_step(l->img);
    pthread_mutex_unlock(&d->mu);
  }
  return rc == AMBER_ECANCELED ? 0 : rc;
}

/* One unit of work: *progress when something became durable or was looked at
 * anew; *waiting when only other hosts' ranks can make the next step. */
static int unit(amber_drain *d, amber__err *e, int *progress, int *waiting) {
  *progress = *waiting = 0;
  int rc = discover(d, e);
  if (!rc && d->coord) rc = coord_unit(d, e, progress, waiting);
  int own = !rc && !*progress && lanes_free(d, d->layout);
  for (size_t i = 0; own && !rc && !*progress && i < d->nlanes; i++)
    rc = lane_unit(d, &d->lanes[i], e, progress);
  /* Retention after each step made durable, and when another process (rank 0's
   * drain) moved the durable GLOBAL, which is a multi-rank lane's authority. */
  if (!rc &&
      (*progress || (d->layout == LAYOUT_MULTI && durable_global(d) != d->retained_g)))
    rc = retain(d, e);
  pthread_mutex_lock(&d->mu);
  int committed = d->committed;
  pthread_mutex_unlock(&d->mu);
  if (!rc && !*progress && committed && (d->o.flags & AMBER_DRAIN_IMAGE) &&
      (rc = images(d, &d->stop)))
    amber__fail(e, rc, "memory tier %s: out of memory for its image", d->memory);
  return rc;
}

/* Records a failed unit as the sticky error, naming the tiers. */
static int unit_failed(amber_drain *d, int rc, const amber__err *e) {
  char msg[3 * AMBER__ERRLEN]; /* set_error keeps what fits */
  snprintf(msg, sizeof msg, "drain of %s to %s: %s%s", d->memory, d->durable, e->msg,
           rc == AMBER_ENOSPC ? " (the memory tier keeps every step not yet durable; "
                                "free space in the durable tier and run amber drain)"
                              : "");
  return set_error(d, rc, msg, 1);
}

static void *drain_main(void *arg) {
  amber_drain *d = arg;
  amber__err e;
  while (!atomic_load(&d->stop)) {
    int progress = 0, waiting = 0, rc = 0;
    pthread_mutex_lock(&d->mu);
    int failed = d->failed;
    d->kicked = 0;
    pthread_mutex_unlock(&d->mu);
    if (!failed) rc = unit(d, &e, &progress, &waiting);
    if (rc && rc != AMBER_ECANCELED) unit_failed(d, rc, &e);
    pthread_mutex_lock(&d->mu);
    d->gen++;
    d->drained_bytes = d->cnt.bytes, d->drained_files = d->cnt.files;
    pthread_cond_broadcast(&d->moved);
    if ((!progress || rc) && !d->kicked && !atomic_load(&d->stop)) {
      double wait = waiting ? POLL_REMOTE_S : POLL_IDLE_S;
      struct timespec ts;
      clock_gettime(CLOCK_REALTIME, &ts);
      long ns = ts.tv_nsec + (long)(wait * 1e9);
      ts.tv_sec += ns / 1000000000L, ts.tv_nsec = ns % 1000000000L;
      pthread_cond_timedwait(&d->wake, &d->mu, &ts);
    }
    pthread_mutex_unlock(&d->mu);
  }
  return NULL;
}

/* ---- where the drain stands ---- */

typedef struct view {
  uint64_t memory_step, durable_step, lag_steps, lag_bytes, memory_bytes;
  uint64_t chain_bytes, full_bytes; /* the newest steps' chains, and their full files */
  int deltas;                       /* a newest chain holds deltas */
  uint64_t full_step;               /* for the message: a newest chain's full step */
} view;

/* Looks at the memory tier now, against the durable positions the thread published. */
static int scan(amber_drain *d, amber__err *e, view *v) {
  memset(v, 0, sizeof *v);
  v->memory_step = v->durable_step = v->full_step = AMBER_NO_STEP;
  /* The lanes' positions (the thread owns the rest of each lane); src strings stay. */
  typedef struct pos {
    const char *src;
    uint64_t d_step, d_state;
  } pos;
  pthread_mutex_lock(&d->mu);
  size_t nl = d->nlanes;
  pos *ls = nl ? malloc(nl * sizeof *ls) : NULL;
  for (size_t i = 0; ls && i < nl; i++)
    ls[i] = (pos){d->lanes[i].src, d->lanes[i].d_step, d->lanes[i].d_state};
  uint64_t g_d = d->g_d;
  int coord = d->coord, own = lanes_free(d, d->layout);
  pthread_mutex_unlock(&d->mu);
  if (nl && !ls) return amber__fail(e, AMBER_ENOMEM, "out of memory");
  /* lanes that drain what the manifests name lag by what GLOBAL commits, no more */
  uint64_t gm = AMBER_NO_STEP, upto = AMBER_NO_STEP;
  int g = coord ? amber__global_read_latest(d->memory, NULL, &gm) : AMBER_ENOENT;
  if (!own) upto = g == 0 ? gm : 0;
  int rc = 0;
  uint64_t min_m = AMBER_NO_STEP, min_d = AMBER_NO_STEP, max_lag = 0;
  for (size_t i = 0; i < nl && !rc; i++) {
    mlist m;
    if ((rc = mem_list(ls[i].src, e, &m)) != 0) break;
    uint64_t lag = 0;
    for (size_t k = 0; k < m.n; k++) {
      v->memory_bytes += m.info[k].bytes;
      if (pending(&m.info[k], ls[i].d_step, ls[i].d_state) &&
          (upto == AMBER_NO_STEP || m.info[k].step <= upto))
        lag++, v->lag_bytes += m.info[k].bytes;
    }
    if (m.n) {
      char *in = calloc(m.n, 1);
      uint64_t cb = 0, fb = 0,
               full = in ? chain_of(&m, m.n - 1, in, &cb, &fb) : AMBER_NO_STEP;
      v->chain_bytes += cb, v->full_bytes += fb;
      v->deltas |= m.n && (full == AMBER_NO_STEP || m.info[m.n - 1].step != full);
      if (full != AMBER_NO_STEP) v->full_step = full;
      free(in);
    }
    uint64_t top = m.n ? m.info[m.n - 1].step : AMBER_NO_STEP;
    if (top != AMBER_NO_STEP && (min_m == AMBER_NO_STEP || top < min_m)) min_m = top;
    if (ls[i].d_step != AMBER_NO_STEP && (min_d == AMBER_NO_STEP || ls[i].d_step < min_d))
      min_d = ls[i].d_step;
    if (lag > max_lag) max_lag = lag;
    amber_free(m.info);
  }
  free(ls);
  v->memory_step = min_m, v->durable_step = min_d, v->lag_steps = max_lag;
  if (!rc && coord) {
    uint64_t *steps = NULL;
    size_t n = 0;
    if (g == 0 && amber__manifest_steps(d->memory, gm, &steps, &n) == 0) {
      uint64_t lag = 0;
      for (size_t k = 0; k < n; k++) {
        char path[4200];
        amber__global_manifest_path(d->memory, steps[k], path, sizeof path);
        uint64_t size = file_size(path);
        v->memory_bytes += size;
        if (k + 1 == n) v->chain_bytes += size;
        if (g_d == AMBER_NO_STEP || steps[k] > g_d) lag++, v->lag_bytes += size;
      }
      /* a drain of every rank drains what the manifests name: their lag is its lag */
      v->lag_steps = own && v->lag_steps > lag ? v->lag_steps : lag;
      v->memory_step = gm;
    } else if (g == AMBER_ENOENT) {
      v->memory_step = AMBER_NO_STEP;
    }
    free(steps);
    v->durable_step = g_d;
  }
  return rc;
}

/* The budget's verdicts on a view: wants_full, and the sticky error of a budget
 * that cannot hold one full checkpoint. */
static int budget_check(amber_drain *d, const view *v) {
  uint64_t b = d->o.memory_budget;
  int over = b && v->memory_bytes > b;
  pthread_mutex_lock(&d->mu);
  d->wants_full = over && v->memory_bytes <= v->chain_bytes && v->deltas;
  pthread_mutex_unlock(&d->mu);
  if (b && v->full_bytes > b) {
    char msg[2 * AMBER__ERRLEN];
    snprintf(msg, sizeof msg,
             "memory tier %s: its budget of %" PRIu64 " bytes cannot hold one "
             "full checkpoint, which takes %" PRIu64 " bytes (step %" PRIu64 "): raise "
             "memory_budget above that",
             d->memory, b, v->full_bytes, v->full_step);
    return set_error(d, AMBER_ENOSPC, msg, 0);
  }
  return 0;
}

/* ---- the API ---- */

void amber_drain_opts_init(amber_drain_opts *o) {
  memset(o, 0, sizeof *o);
  o->rank = -1;
}

static int drain_open(amber_drain **out, const char *memory, const char *durable,
                      const amber_drain_opts *o, int sync) {
  amber_drain_opts def;
  if (!o) {
    amber_drain_opts_init(&def);
    o = &def;
  }
  if (!out || !memory || !*memory)
    return amber__fail(NULL, AMBER_EINVAL, "drain: no memory tier given");
  *out = NULL;
  int reserved = (o->flags & ~AMBER_DRAIN_IMAGE) != 0;
  for (int i = 0; i < 4; i++)
    reserved |= o->reserved[i] != 0;
  if (reserved || o->rank < -1)
    return amber__fail(NULL, AMBER_EINVAL,
                       "drain: reserved option set, or rank %d below -1", (int)o->rank);
  amber__err e;
  char *recorded = NULL;
  if (!durable) {
    int rc = amber__tiers_read(&e, memory, &recorded);
    if (rc) return amber__fail(NULL, rc, "%s", e.msg);
    durable = recorded;
  }
  amber_drain *d = calloc(1, sizeof *d);
  if (!d || !(d->memory = strdup(memory)) || !(d->durable = strdup(durable))) {
    if (d) free(d->memory);
    free(d), free(recorded);
    return amber__fail(NULL, AMBER_ENOMEM, "out of memory");
  }
  free(recorded);
  size_t len = strlen(d->memory);
  while (len > 1 && d->memory[len - 1] == '/')
    d->memory[--len] = 0;
  d->o = *o;
  d->sync = sync;
  d->g_d = d->retained_g = AMBER_NO_STEP;
  pthread_mutex_init(&d->mu, NULL);
  pthread_cond_init(&d->wake, NULL);
  pthread_cond_init(&d->moved, NULL);
  int rc = 0;
  if (!sync && amber__mkdir_p(d->memory) != 0)
    rc = amber__fail(&e, amber__errno_code(errno), "cannot create the memory tier %s: %s",
                     d->memory, strerror(errno));
  struct stat sb;
  if (!rc && (stat(d->memory, &sb) != 0 || !S_ISDIR(sb.st_mode)))
    rc = amber__fail(&e, AMBER_ENOENT, "no memory tier at %s", d->memory);
  int s3 = amber__is_s3(d->durable);
  if (!rc)
    rc = s3 ? amber__dest_s3_open(&d->dest, &e, d->durable)
            : amber__dest_dir_open(&d->dest, &e, d->durable, 1);
  if (!rc && s3) { /* refused credentials or a missing bucket: now, naming it */
    char **names = NULL;
    size_t n = 0;
    rc = d->dest->ops->list(d->dest, &e, "", &names, &n);
    amber__names_list_free(names, n);
  }
  char *rm = rc || s3 ? NULL : realpath(d->memory, NULL),
       *rd = rc || s3 ? NULL : realpath(d->durable, NULL);
  if (rm && rd && !strcmp(rm, rd)) /* retention would remove the only copy */
    rc = amber__fail(&e, AMBER_EINVAL,
                     "the memory tier and the durable tier are one directory");
  free(rm), free(rd);
  if (!rc) rc = discover(d, &e);
  if (!rc) {
    /* what TIERS records: any process finds it */
    char *abs = s3 ? NULL : realpath(d->durable, NULL);
    rc = amber__tiers_write(&e, d->memory, abs ? abs : d->durable);
    free(abs);
  }
  if (rc) {
    amber__fail(NULL, rc, "drain of %s to %s: %s", d->memory, d->durable, e.msg);
    amber_drain_close(d);
    return rc;
  }
  *out = d;
  return 0;
}

int amber_drain_start(amber_drain **out, const char *memory, const char *durable,
                      const amber_drain_opts *o) {
  amber_drain *d;
  int rc = drain_open(&d, memory, durable, o, 0);
  if (rc) return rc;
  if (pthread_create(&d->thread, NULL, drain_main, d) != 0) {
    amber_drain_close(d);
    return amber__fail(NULL, AMBER_ENOMEM, "drain: cannot start its thread");
  }
  d->threaded = 1;
  *out = d;
  return 0;
}

int amber_drain_kick(amber_drain *d) {
  if (!d) return amber__fail(NULL, AMBER_EINVAL, "amber_drain_kick: NULL");
  const amber_drain_opts *o = &d->o;
  int bounded = o->max_lag_steps || o->max_lag_bytes || o->memory_budget;
  pthread_mutex_lock(&d->mu);
  d->kicked = d->committed = 1;
  pthread_cond_signal(&d->wake);
  /* The store's first commit shows its layout: the thread takes it (its lanes) first. */
  uint64_t gen = d->gen;
  while (bounded && d->layout == LAYOUT_UNKNOWN && d->gen == gen && !d->error)
    pthread_cond_wait(&d->moved, &d->mu);
  pthread_mutex_unlock(&d->mu);
  if (!bounded) return sticky(d);
  for (;;) {
    view v;
    amber__err e;
    int rc = scan(d, &e, &v);
    if (!rc) budget_check(d, &v);
    pthread_mutex_lock(&d->mu);
    int wait = !rc && !d->error && !d->failed &&
               ((o->max_lag_steps && v.lag_steps > o->max_lag_steps) ||
                (o->max_lag_bytes && v.lag_bytes > o->max_lag_bytes) ||
                (o->memory_budget && v.memory_bytes > o->memory_budget &&
                 v.memory_bytes > v.chain_bytes));
    if (wait) {
      gen = d->gen;
      struct timespec ts;
      clock_gettime(CLOCK_REALTIME, &ts);
      ts.tv_sec += 1; /* looks again at least every second */
      while (d->gen == gen && !d->error)
        if (pthread_cond_timedwait(&d->moved, &d->mu, &ts)) break;
    }
    pthread_mutex_unlock(&d->mu);
    if (rc) return amber__fail(NULL, rc, "drain of %s: %s", d->memory, e.msg);
    if (!wait) return sticky(d);
  }
}

int amber_drain_wants_full(amber_drain *d) {
  if (!d) return 0;
  pthread_mutex_lock(&d->mu);
  int w = d->wants_full;
  pthread_mutex_unlock(&d->mu);
  return w;
}

int amber_drain_get_status(amber_drain *d, amber_drain_status *st) {
  if (!d || !st) return amber__fail(NULL, AMBER_EINVAL, "amber_drain_get_status: NULL");
  view v;
  amber__err e;
  memset(st, 0, sizeof *st);
  int rc = scan(d, &e, &v);
  if (!rc) budget_check(d, &v);
  pthread_mutex_lock(&d->mu);
  st->memory_step = v.memory_step, st->durable_step = v.durable_step;
  st->lag_steps = v.lag_steps, st->lag_bytes = v.lag_bytes,
  st->memory_bytes = v.memory_bytes;
  st->drained_bytes = d->drained_bytes, st->drained_files = d->drained_files;
  st->error = d->error, st->wants_full = d->wants_full;
  st->image_step = AMBER_NO_STEP;
  for (size_t i = 0; i < d->nlanes; i++) /* the lowest: where every image is */
    if (!i || d->lanes[i].img_step < st->image_step ||
        d->lanes[i].img_step == AMBER_NO_STEP)
      st->image_step = d->lanes[i].img_step;
  pthread_mutex_unlock(&d->mu);
  if (rc) return amber__fail(NULL, rc, "drain of %s: %s", d->memory, e.msg);
  return sticky(d);
}

/* What flush waits for: GLOBAL's step, and the LATEST of each lane that drains its
 * own commits, as they were when it was called. */
typedef struct target {
  uint64_t g;     /* AMBER_NO_STEP: none */
  uint64_t *step; /* per lane (AMBER_NO_STEP: none) */
  size_t n;
} target;

static int flush_target(amber_drain *d, amber__err *e, target *t) {
  memset(t, 0, sizeof *t);
  t->g = AMBER_NO_STEP;
  pthread_mutex_lock(&d->mu);
  int coord = d->coord, own = lanes_free(d, d->layout);
  pthread_mutex_unlock(&d->mu);
  if (coord && amber__global_read_latest(d->memory, NULL, &t->g)) t->g = AMBER_NO_STEP;
  if (!own) return 0;
  pthread_mutex_lock(&d->mu);
  size_t n = d->nlanes;
  char **src = malloc((n ? n : 1) * sizeof *src);
  for (size_t i = 0; src && i < n; i++)
    src[i] = d->lanes[i].src;
  pthread_mutex_unlock(&d->mu);
  t->step = malloc((n ? n : 1) * sizeof *t->step);
  int rc = !src || !t->step ? amber__fail(e, AMBER_ENOMEM, "out of memory") : 0;
  for (size_t i = 0; !rc && i < n; i++) {
    mlist m;
    rc = mem_list(src[i], e, &m);
    t->step[i] = !rc && m.n ? m.info[m.n - 1].step : AMBER_NO_STEP;
    amber_free(m.info);
  }
  free(src);
  t->n = n;
  return rc;
}

static int reached(amber_drain *d, const target *t) {
  pthread_mutex_lock(&d->mu);
  int done = t->g == AMBER_NO_STEP || (d->g_d != AMBER_NO_STEP && d->g_d >= t->g);
  for (size_t i = 0; i < t->n; i++)
    done &= t->step[i] == AMBER_NO_STEP ||
            (d->lanes[i].d_step != AMBER_NO_STEP && d->lanes[i].d_step >= t->step[i]);
  pthread_mutex_unlock(&d->mu);
  return done;
}

int amber_drain_flush(amber_drain *d, double timeout_s) {
  if (!d) return amber__fail(NULL, AMBER_EINVAL, "amber_drain_flush: NULL");
  target t;
  amber__err e;
  int rc = flush_target(d, &e, &t);
  if (rc) {
    free(t.step);
    return amber__fail(NULL, rc, "drain of %s: %s", d->memory, e.msg);
  }
  double t0 = amber__now();
  for (;;) {
    if ((rc = sticky(d)) != 0 || reached(d, &t)) break;
    double left = timeout_s < 0 ? 1.0 : timeout_s - (amber__now() - t0);
    if (left <= 0) {
      rc = amber__fail(NULL, AMBER_ETIMEDOUT,
                       "drain of %s to %s: the steps committed to the "
                       "memory tier are not all durable after %.1f s",
                       d->memory, d->durable, timeout_s);
      break;
    }
    pthread_mutex_lock(&d->mu);
    d->kicked = 1;
    pthread_cond_signal(&d->wake);
    uint64_t gen = d->gen;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (left > 1) left = 1;
    long ns = ts.tv_nsec + (long)(left * 1e9);
    ts.tv_sec += ns / 1000000000L, ts.tv_nsec = ns % 1000000000L;
    while (d->gen == gen && !d->error)
      if (pthread_cond_timedwait(&d->moved, &d->mu, &ts)) break;
    pthread_mutex_unlock(&d->mu);
  }
  free(t.step);
  return rc;
}

int amber_drain_close(amber_drain *d) {
  if (!d) return 0;
  if (d->threaded) {
    atomic_store(&d->stop, 1);
    pthread_mutex_lock(&d->mu);
    pthread_cond_signal(&d->wake);
    pthread_mutex_unlock(&d->mu);
    pthread_join(d->thread, NULL);
  }
  int rc = sticky(d);
  if (!rc && d->committed && (d->o.flags & AMBER_DRAIN_IMAGE)) {
    /* a clean close leaves each image at its newest step: the next start reads one file */
    atomic_int go = 0;
    images(d, &go);
  }
  for (size_t i = 0; i < d->nlanes; i++) {
    amber__image_free(d->lanes[i].img);
    amber_store_close(d->lanes[i].st);
    amber__dview_free(&d->lanes[i].dv);
    free(d->lanes[i].src);
  }
  for (uint32_t r = 0; r < d->nremote; r++)
    amber__dview_free(&d->remote[r]);
  free(d->remote);
  free(d->lanes);
  amber__dest_close(d->dest);
  pthread_mutex_destroy(&d->mu);
  pthread_cond_destroy(&d->wake);
  pthread_cond_destroy(&d->moved);
  free(d->memory);
  free(d->durable);
  free(d);
  return rc;
}

int amber_drain_run(const char *memory, const char *durable, const amber_drain_opts *o) {
  amber_drain *d;
  int rc = drain_open(&d, memory, durable, o, 1);
  if (rc) return rc;
  view v;
  amber__err e;
  if ((rc = scan(d, &e, &v)) == 0) d->cnt.total = v.lag_bytes ? v.lag_bytes : 1;
  for (int progress = 1, waiting = 0; !rc && progress;)
    rc = unit(d, &e, &progress, &waiting);
  if (!rc) rc = retain(d, &e);
  if (rc)
    unit_failed(d, rc, &e);
  else
    amber__progress("drain", d->cnt.total, d->cnt.total);
  return amber_drain_close(d);
}

int amber_tier_durable(const char *memory, char **durable) {
  if (!memory || !durable)
    return amber__fail(NULL, AMBER_EINVAL, "amber_tier_durable: NULL");
  return amber__tiers_read(NULL, memory, durable);
}

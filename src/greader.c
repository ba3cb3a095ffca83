/*
 * greader.c - reading a global step of a multi-rank store at any world size: the
 * manifest's tensor table, and any region of a global tensor assembled from the
 * shards that overlap it, each read through its rank's own store (its chain, its
 * checksums), from the file the manifest names, checked to hold what the manifest
 * says it holds. Also the listing of global steps. Nothing here is collective.
 */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "global.h"

struct amber_global_reader {
  amber__err err; /* first: amber_last_error reads it */
  char *path;
  amber__manifest m;
  amber_store **st;   /* per rank, opened on first use */
  amber_reader **rd;
  amber__rpool *rp;   /* the workers of every read, made by the first */
  amber__part *parts; /* a read's (box, shard) pairs, kept between reads */
  size_t parts_cap;
  /* The manifest's shards by rank, made by the first rank part opened: rank r's
   * (tensor, shard) pairs are owned[first[r] .. first[r + 1]). */
  uint64_t *first;
  struct owned {
    uint32_t t, s;
  } *owned;
  /* Shard s of tensor t is shard base[t] + s of the manifest; li[] of it is its
   * tensor in its rank's file, found when that rank's part was checked. */
  uint64_t *base;
  size_t *li;
};

int amber_global_is_store(const char *path) {
  char p[4200];
  struct stat sb;
  snprintf(p, sizeof p, "%s/GLOBAL", path);
  if (stat(p, &sb) == 0) return 1;
  snprintf(p, sizeof p, "%s/rank-00000", path);
  return stat(p, &sb) == 0 && S_ISDIR(sb.st_mode);
}

int amber_global_reader_open(amber_global_reader **out, const char *path, uint64_t step) {
  *out = NULL;
  amber_global_reader *g = calloc(1, sizeof *g);
  if (!g || !(g->path = strdup(path))) {
    free(g);
    return amber__fail(NULL, AMBER_ENOMEM, "out of memory");
  }
  uint64_t latest;
  int rc = amber__global_state(path, &g->err, &latest);
  if (rc == 0 && step == AMBER_LATEST) step = latest;
  if (rc == 0 && step > latest)
    rc = amber__fail(&g->err, AMBER_ENOENT, "%s: no global step %llu (the latest is %llu)",
                     path, (unsigned long long)step, (unsigned long long)latest);
  if (rc == 0) rc = amber__global_load_manifest(path, step, &g->err, &g->m);
  if (rc == AMBER_ENOENT && step == latest)
    rc = amber__fail(&g->err, AMBER_ECORRUPT, "%s: GLOBAL names step %llu, but its manifest "
                     "is missing", path, (unsigned long long)step);
  else if (rc == AMBER_ENOENT && step < latest)
    rc = amber__fail(&g->err, AMBER_ENOENT, "%s: no global step %llu (no manifest: pruned, "
                     "or never committed)", path, (unsigned long long)step);
  if (rc == 0 && g->m.step != step)
    rc = amber__fail(&g->err, AMBER_ECORRUPT, "%s: manifest of step %llu says step %llu", path,
                     (unsigned long long)step, (unsigned long long)g->m.step);
  if (rc == 0) {
    g->st = calloc(g->m.world, sizeof *g->st);
    g->rd = calloc(g->m.world, sizeof *g->rd);
    if (!g->st || !g->rd) rc = amber__fail(&g->err, AMBER_ENOMEM, "out of memory");
  }
  if (rc < 0) {
    amber__err_adopt(&g->err);
    amber_global_reader_close(g);
    return rc;
  }
  *out = g;
  return 0;
}

void amber_global_reader_close(amber_global_reader *g) {
  if (!g) return;
  for (uint32_t r = 0; g->rd && r < g->m.world; r++) {
    amber_reader_close(g->rd[r]);
    amber_store_close(g->st[r]);
  }
  free(g->rd);
  free(g->st);
  amber__rpool_destroy(g->rp);
  free(g->parts);
  free(g->first);
  free(g->owned);
  free(g->base);
  free(g->li);
  amber__manifest_free(&g->m);
  free(g->path);
  free(g);
}

uint64_t amber_global_reader_step(const amber_global_reader *g) {
  return g->m.step;
}
uint32_t amber_global_reader_world_size(const amber_global_reader *g) {
  return g->m.world;
}
size_t amber_global_reader_count(const amber_global_reader *g) {
  return g->m.ntensors;
}

int amber_global_reader_tensor(const amber_global_reader *g, size_t index,
                               amber_global_tensor *out) {
  if (index >= g->m.ntensors)
    return amber__fail(NULL, AMBER_ERANGE, "tensor index %zu out of range", index);
  const amber__mtensor *t = &g->m.tensors[index];
  memset(out, 0, sizeof *out);
  out->name = t->name, out->dtype = t->dtype, out->ndim = t->ndim;
  out->nshards = t->nshards, out->flags = t->flags;
  memcpy(out->shape, t->shape, sizeof out->shape);
  return 0;
}

int amber_global_reader_find(const amber_global_reader *g, const char *name, size_t *index) {
  for (uint32_t i = 0; i < g->m.ntensors; i++)
    if (!strcmp(g->m.tensors[i].name, name)) return *index = i, 0;
  return amber__fail(NULL, AMBER_ENOENT, "no tensor '%s' in global step %llu", name,
                     (unsigned long long)g->m.step);
}

/* The manifest's shards grouped by rank (a counting sort, once per reader), and
 * numbered for their file tensors (base, li). */
static int index_owners(amber_global_reader *g) {
  if (g->first) return 0;
  const amber__manifest *m = &g->m;
  uint64_t total = 0;
  for (uint32_t i = 0; i < m->ntensors; i++) total += m->tensors[i].nshards;
  size_t nt = (size_t)m->ntensors + 1, ns = (size_t)(total ? total : 1);
  uint64_t *first = calloc((size_t)m->world + 1, sizeof *first);
  uint64_t *fill = calloc((size_t)m->world + 1, sizeof *fill);
  uint64_t *base = malloc(nt * sizeof *base);
  struct owned *o = malloc(ns * sizeof *o);
  size_t *li = calloc(ns, sizeof *li);
  if (!first || !fill || !base || !o || !li) {
    free(first), free(fill), free(base), free(o), free(li);
    return amber__fail(&g->err, AMBER_ENOMEM, "out of memory");
  }
  for (uint32_t i = 0; i < m->ntensors; i++) {
    base[i] = i ? base[i - 1] + m->tensors[i - 1].nshards : 0;
    for (uint32_t s = 0; s < m->tensors[i].nshards; s++)
      first[m->tensors[i].shards[s].rank + 1]++;
  }
  for (uint32_t r = 0; r < m->world; r++) first[r + 1] += first[r];
  for (uint32_t i = 0; i < m->ntensors; i++)
    for (uint32_t s = 0; s < m->tensors[i].nshards; s++) {
      uint32_t r = m->tensors[i].shards[s].rank;
      o[first[r] + fill[r]++] = (struct owned){i, s};
    }
  free(fill);
  g->first = first, g->owned = o, g->base = base, g->li = li;
  return 0;
}

/* The box table of rank r's file (the tensor AMBER__BOXES_NAME): *boxes (malloc'd,
 * names pointing into *buf) and *n; *boxes NULL for a file without one (written
 * before the global writer recorded boxes). */
static int read_boxes(amber_global_reader *g, uint32_t r, amber_reader *rd, uint8_t **buf,
                      amber__box **boxes, size_t *n) {
  *buf = NULL, *boxes = NULL, *n = 0;
  size_t li;
  amber_tensor_info ti;
  if (amber_reader_find(rd, AMBER__BOXES_NAME, &li) < 0) return 0;
  int rc = amber_reader_info(rd, li, &ti);
  if (rc == 0 && (ti.dtype != AMBER_U8 || ti.ndim != 1 || ti.nbytes > AMBER__BOXES_MAX))
    rc = amber__fail(&g->err, AMBER_ECORRUPT, "rank %u: its file of step %llu holds a "
                     "malformed %s tensor", r, (unsigned long long)g->m.ranks[r].step,
                     AMBER__BOXES_NAME);
  if (rc == 0 && !(*buf = malloc((size_t)ti.nbytes + 1)))
    rc = amber__fail(&g->err, AMBER_ENOMEM, "out of memory");
  if (rc == 0 && (rc = amber_reader_read(rd, li, *buf, ti.nbytes)) < 0)
    rc = amber__fail(&g->err, rc, "rank %u: %s", r, amber_last_error(rd));
  if (rc == 0) {
    char what[64];
    snprintf(what, sizeof what, "rank %u: the %s of step %llu", r, AMBER__BOXES_NAME,
             (unsigned long long)g->m.ranks[r].step);
    rc = amber__boxes_decode(&g->err, what, *buf, (size_t)ti.nbytes, boxes, n);
  }
  if (rc < 0) free(*buf), *buf = NULL;
  return rc;
}

/* Shard `sh` of tensor `t` (rank r's) is its file's tensor `name` (li), of the
 * manifest's dtype and the shard's shape, and where the file records its boxes,
 * at the shard's offsets of a global tensor of the manifest's shape. */
static int check_shard(amber_global_reader *g, uint32_t r, amber_reader *rd,
                       const amber__mtensor *t, const amber__mshard *sh, const char *name,
                       const amber__box *boxes, size_t nb, size_t *li) {
  char path[4200], what[300];
  amber__global_manifest_path(g->path, g->m.step, path, sizeof path);
  if (sh->ord) snprintf(what, sizeof what, " (its box %u of '%.200s')", sh->ord, t->name);
  else what[0] = 0;
  amber_tensor_info ti;
  int rc = amber_reader_find(rd, name, li);
  if (rc == 0) rc = amber_reader_info(rd, *li, &ti);
  if (rc < 0)
    return amber__fail(&g->err, rc, "rank %u: its file lacks tensor '%s'%s: %s", r, name,
                       what, amber_last_error(rd));
  int same = ti.dtype == t->dtype && ti.ndim == t->ndim;
  for (uint32_t d = 0; same && d < t->ndim; d++) same = ti.shape[d] == sh->shape[d];
  if (!same)
    return amber__fail(&g->err, AMBER_ECORRUPT, "rank %u: its file of step %llu holds tensor "
                       "'%s'%s with another dtype or shape than %s says", r,
                       (unsigned long long)g->m.ranks[r].step, name, what, path);
  if (!boxes) return 0;
  const amber__box *b = amber__boxes_find(boxes, nb, name);
  same = b && b->ndim == t->ndim;
  for (uint32_t d = 0; same && d < t->ndim; d++)
    same = b->shape[d] == t->shape[d] && b->off[d] == sh->off[d];
  if (!same)
    return amber__fail(&g->err, AMBER_ECORRUPT, "rank %u: its file of step %llu holds tensor "
                       "'%s'%s at another box than %s says (its shards were moved or "
                       "swapped)", r, (unsigned long long)g->m.ranks[r].step, name, what, path);
  return 0;
}

/* Rank r's part holds what the manifest says: each of its shards as the tensor of
 * its file that the shard's place among the rank's shards names (the first of a
 * tensor by the tensor's name, the k-th by amber__box_file_name), checked by
 * check_shard, with no box the manifest does not name (a manifest whose shards
 * were moved or swapped, between ranks or between the boxes of one, is refused
 * before any of them is read). */
static int check_part(amber_global_reader *g, uint32_t r, amber_reader *rd) {
  int rc = index_owners(g);
  if (rc < 0) return rc;
  uint8_t *buf;
  amber__box *boxes;
  size_t nb;
  if ((rc = read_boxes(g, r, rd, &buf, &boxes, &nb)) < 0) return rc;
  uint64_t mine = g->first[r + 1] - g->first[r];
  if (boxes && nb != mine) {
    char path[4200];
    amber__global_manifest_path(g->path, g->m.step, path, sizeof path);
    rc = amber__fail(&g->err, AMBER_ECORRUPT, "rank %u: its file of step %llu holds %zu "
                     "shards, %s names %llu", r, (unsigned long long)g->m.ranks[r].step, nb,
                     path, (unsigned long long)mine);
  }
  for (uint64_t k = g->first[r]; rc == 0 && k < g->first[r + 1]; k++) {
    const amber__mtensor *t = &g->m.tensors[g->owned[k].t];
    const amber__mshard *sh = &t->shards[g->owned[k].s];
    char *name = amber__box_file_name(t->name, sh->ord);
    if (!name) rc = amber__fail(&g->err, AMBER_ENOMEM, "out of memory");
    else rc = check_shard(g, r, rd, t, sh, name, boxes, nb,
                          &g->li[g->base[g->owned[k].t] + g->owned[k].s]);
    free(name);
  }
  free(boxes);
  free(buf);
  return rc;
}

/* Opens rank r's part of the step: the file the manifest names (its step and state
 * id; the rank store's LATEST is not read), its chain checked on the way, and its
 * contents checked against the manifest. */
static int rank_reader(amber_global_reader *g, uint32_t r, amber_reader **out) {
  if (g->rd[r]) return *out = g->rd[r], 0;
  char dir[4200], mpath[4200];
  amber__global_rank_path(g->path, r, dir, sizeof dir);
  amber__global_manifest_path(g->path, g->m.step, mpath, sizeof mpath);
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY | AMBER_OPEN_NOCREATE;
  int rc = amber_store_open(&g->st[r], dir, &so);
  if (rc < 0)
    return amber__fail(&g->err, rc, "rank %u: %s", r, amber_last_error(NULL));
  rc = amber__reader_open_at(&g->rd[r], g->st[r], g->m.ranks[r].step, g->m.ranks[r].hash,
                             mpath);
  if (rc < 0) rc = amber__fail(&g->err, rc, "rank %u: %s", r, amber_last_error(NULL));
  if (rc == 0) rc = check_part(g, r, g->rd[r]);
  if (rc < 0) {
    amber_reader_close(g->rd[r]);
    g->rd[r] = NULL;
    amber_store_close(g->st[r]); /* a later read opens it again */
    g->st[r] = NULL;
    return rc;
  }
  return *out = g->rd[r], 0;
}

/* Box `i` of a read: checked (region, size, that the shards tile it), and one part
 * per shard that overlaps it appended to g->parts[*np ..]. */
static int plan_box(amber_global_reader *g, size_t index, const int64_t *offsets,
                    const int64_t *shape, void *buf, uint64_t size, size_t *np) {
  if (index >= g->m.ntensors)
    return amber__fail(&g->err, AMBER_ERANGE, "tensor index %zu out of range", index);
  const amber__mtensor *t = &g->m.tensors[index];
  size_t esz = amber_dtype_size(t->dtype);
  uint64_t want = 1;
  for (uint32_t d = 0; d < t->ndim; d++) {
    if (offsets[d] < 0 || shape[d] < 0 || offsets[d] > t->shape[d] ||
        shape[d] > t->shape[d] - offsets[d])
      return amber__fail(&g->err, AMBER_ERANGE, "tensor '%s': region outside its shape in dim %u",
                         t->name, d);
    want *= (uint64_t)shape[d];
  }
  if (size != want * esz)
    return amber__fail(&g->err, AMBER_EINVAL, "tensor '%s': region is %llu bytes, buffer %llu",
                       t->name, (unsigned long long)(want * esz), (unsigned long long)size);
  if (size && !buf)
    return amber__fail(&g->err, AMBER_EINVAL, "tensor '%s': NULL buffer", t->name);
  uint64_t have = 0;
  for (uint32_t s = 0; s < t->nshards; s++) {
    const amber__mshard *sh = &t->shards[s];
    amber__part pt;
    memset(&pt, 0, sizeof pt);
    uint64_t cnt = 1;
    for (uint32_t d = 0; d < t->ndim; d++) {
      int64_t lo = offsets[d] > sh->off[d] ? offsets[d] : sh->off[d];
      int64_t a = offsets[d] + shape[d], b = sh->off[d] + sh->shape[d];
      int64_t n = (a < b ? a : b) - lo;
      if (n < 0) n = 0;
      pt.ss[d] = sh->shape[d];
      pt.so[d] = lo - sh->off[d];
      pt.n[d] = n;
      pt.ds[d] = shape[d];
      pt.doff[d] = lo - offsets[d];
      cnt *= (uint64_t)n;
    }
    if (!cnt) continue;
    amber_reader *r;
    int rc = rank_reader(g, sh->rank, &r);
    if (rc < 0) return amber__fail(&g->err, rc, "tensor '%s': %s", t->name, g->err.msg);
    pt.r = r;
    pt.tensor = g->li[g->base[index] + s]; /* found when its rank's part was checked */
    pt.ndim = t->ndim;
    pt.dst = buf;
    pt.name = t->name;
    pt.rank = sh->rank;
    if (*np == g->parts_cap) {
      size_t cap = g->parts_cap ? 2 * g->parts_cap : 64;
      amber__part *grown = realloc(g->parts, cap * sizeof *grown);
      if (!grown) return amber__fail(&g->err, AMBER_ENOMEM, "out of memory");
      g->parts = grown;
      g->parts_cap = cap;
    }
    g->parts[(*np)++] = pt;
    have += cnt;
  }
  if (have != want)
    return amber__fail(&g->err, AMBER_ECORRUPT,
                       "tensor '%s': its shards cover %llu of the %llu elements asked for "
                       "(they do not tile the tensor)",
                       t->name, (unsigned long long)have, (unsigned long long)want);
  return 0;
}

int amber_global_reader_read_many(amber_global_reader *g, size_t count, const size_t *indices,
                                  const int64_t *offsets, const int64_t *shapes,
                                  void *const *bufs, const uint64_t *sizes) {
  if (!g || (count && (!indices || !offsets || !shapes || !bufs || !sizes)))
    return amber__fail(g ? &g->err : NULL, AMBER_EINVAL, "amber_global_reader_read_many: NULL");
  size_t np = 0;
  for (size_t i = 0; i < count; i++) {
    int rc = plan_box(g, indices[i], offsets + i * AMBER_MAX_DIMS, shapes + i * AMBER_MAX_DIMS,
                      bufs[i], sizes[i], &np);
    if (rc) return rc;
  }
  if (!np) return 0;
  if (!g->rp && amber__rpool_create(&g->rp, 0) != 0)
    return amber__fail(&g->err, AMBER_ENOMEM, "out of memory");
  return amber__read_parts(g->rp, &g->err, g->parts, np);
}

int amber_global_reader_read(amber_global_reader *g, size_t index, const int64_t *offsets,
                             const int64_t *shape, void *buf, uint64_t size) {
  if (index >= g->m.ntensors)
    return amber__fail(&g->err, AMBER_ERANGE, "tensor index %zu out of range", index);
  int64_t o[AMBER_MAX_DIMS] = {0}, n[AMBER_MAX_DIMS] = {0};
  uint32_t nd = g->m.tensors[index].ndim;
  if (nd) {
    memcpy(o, offsets, nd * sizeof *o);
    memcpy(n, shape, nd * sizeof *n);
  }
  return amber_global_reader_read_many(g, 1, &index, o, n, &buf, &size);
}

int amber_global_reader_meta(amber_global_reader *g, uint32_t rank, const char **json,
                             size_t *len) {
  *json = NULL, *len = 0;
  if (rank >= g->m.world)
    return amber__fail(&g->err, AMBER_ERANGE, "rank %u: step %llu was written by %u ranks", rank,
                       (unsigned long long)g->m.step, g->m.world);
  if (!(g->m.ranks[rank].flags & AMBER__RANK_PRESENT)) return 0;
  amber_reader *r;
  int rc = rank_reader(g, rank, &r); /* its message names the rank */
  if (rc < 0) return rc;
  rc = amber_reader_meta(r, json, len);
  return rc < 0 ? amber__fail(&g->err, rc, "rank %u: %s", rank, amber_last_error(r)) : 0;
}

int amber_global_reader_verify(amber_global_reader *g) {
  for (uint32_t r = 0; r < g->m.world; r++) {
    if (!(g->m.ranks[r].flags & AMBER__RANK_PRESENT)) continue;
    amber_reader *rd;
    int rc = rank_reader(g, r, &rd); /* its message names the rank */
    if (rc < 0) return rc;
    if ((rc = amber_reader_verify(rd)) < 0)
      return amber__fail(&g->err, rc, "rank %u: %s", r, amber_last_error(rd));
  }
  return 0;
}

int amber_global_list(const char *path, amber_global_step_info **out, size_t *count) {
  *out = NULL, *count = 0;
  uint64_t latest, again, *steps = NULL;
  size_t n = 0;
  int rc;
  /* GLOBAL's step without its manifest is damage, unless a writer moved GLOBAL on
   * (and retention removed the manifest) while the listing ran: then list again. */
  for (int tries = 0;; tries++) {
    rc = amber__global_state(path, NULL, &latest);
    if (rc == AMBER_ENOENT) return 0;
    if (rc == 0) rc = amber__manifest_steps(path, latest, &steps, &n);
    if (rc < 0) return rc;
    if ((n && steps[n - 1] == latest) || tries == 3 ||
        amber__global_read_latest(path, NULL, &again) < 0 || again == latest)
      break;
    free(steps);
  }
  int missing = !n || steps[n - 1] != latest;
  amber_global_step_info *info = calloc(n + 1, sizeof *info);
  if (!info) {
    free(steps);
    return amber__fail(NULL, AMBER_ENOMEM, "out of memory");
  }
  size_t k = 0;
  for (size_t i = 0; i < n + (size_t)missing; i++) {
    uint64_t s = i < n ? steps[i] : latest;
    amber__manifest m;
    rc = i < n ? amber__global_load_manifest(path, s, NULL, &m) : AMBER_ENOENT;
    if (rc == AMBER_ENOENT && s != latest) continue; /* removed since the directory was read */
    amber_global_step_info *e = &info[k++];
    e->step = s, e->parent = AMBER_NO_STEP;
    if (rc == 0 && m.step == s) {
      e->kind = m.kind, e->world_size = m.world, e->parent = m.parent;
      for (uint32_t r = 0; r < m.world; r++) e->bytes += m.ranks[r].bytes;
    } else {
      e->flags = AMBER_CKPT_DAMAGED;
    }
    if (rc == 0) amber__manifest_free(&m);
  }
  free(steps);
  *out = info, *count = k;
  return 0;
}

/*
 * manifest.c - the bytes of a multi-rank store, both ways (docs/FORMAT.md, "Many
 * ranks"): the manifest of a global step, the global LATEST pointer (and what a
 * store without it holds), and the box table that binds a rank's checkpoint file
 * to the shards it holds. The one place that encodes and decodes them. They are
 * read from files that may be damaged or hostile: every count is checked against
 * the bytes left before anything is allocated, and a manifest's shards must tile
 * each tensor before anything reads through them.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "global.h"
#include "s3store.h"

#define GLOBAL_MAGIC "AMBERGL1"
#define GLOBAL_SIZE AMBER__GLOBAL_SIZE

void amber__global_manifest_path(const char *store, uint64_t step, char *buf, size_t len) {
  snprintf(buf, len, "%s/step-%020" PRIu64 ".manifest", store, step);
}

void amber__global_rank_path(const char *store, uint32_t rank, char *buf, size_t len) {
  snprintf(buf, len, "%s/rank-%05u", store, rank);
}

int amber__parse_manifest_name(const char *name, uint64_t *step) {
  if (strlen(name) != 34 || strncmp(name, "step-", 5) || strcmp(name + 25, ".manifest"))
    return 0;
  uint64_t v = 0;
  for (int i = 5; i < 25; i++)
    if (name[i] < '0' || name[i] > '9' || amber__mul_overflow(v, 10, &v) ||
        amber__add_overflow(v, (uint64_t)(name[i] - '0'), &v))
      return 0;
  *step = v;
  return 1;
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

int amber__manifest_steps(const char *path, uint64_t upto, uint64_t **steps, size_t *n) {
  if (amber__is_s3(path)) return amber__s3_manifest_steps(path, upto, steps, n);
  *steps = NULL, *n = 0;
  DIR *d = opendir(path);
  if (!d) return amber__fail(NULL, amber__errno_code(errno), "%s: %s", path, strerror(errno));
  size_t cap = 0;
  struct dirent *de;
  while ((de = readdir(d))) {
    uint64_t s;
    if (!amber__parse_manifest_name(de->d_name, &s) || s > upto) continue;
    if (*n == cap) {
      uint64_t *ns = realloc(*steps, (cap = cap ? 2 * cap : 16) * sizeof *ns);
      if (!ns) {
        closedir(d), free(*steps), *steps = NULL, *n = 0;
        return amber__fail(NULL, AMBER_ENOMEM, "out of memory");
      }
      *steps = ns;
    }
    (*steps)[(*n)++] = s;
  }
  closedir(d);
  if (*n) qsort(*steps, *n, sizeof **steps, cmp_u64);
  return 0;
}

int amber__parse_rank_name(const char *name, uint32_t *rank) {
  if (strncmp(name, "rank-", 5) || strlen(name) < 10 || strlen(name) > 12) return 0;
  uint32_t v = 0;
  for (const char *c = name + 5; *c; c++) {
    if (*c < '0' || *c > '9') return 0;
    v = v * 10 + (uint32_t)(*c - '0');
  }
  *rank = v;
  return 1;
}

void amber__dims_text(const int64_t *v, uint32_t n, char *buf, size_t len) {
  size_t o = (size_t)snprintf(buf, len, "[");
  for (uint32_t d = 0; d < n && o < len; d++)
    o += (size_t)snprintf(buf + o, len - o, "%s%lld", d ? ", " : "", (long long)v[d]);
  if (o < len) snprintf(buf + o, len - o, "]");
}

static uint64_t shard_size(uint32_t ndim) {
  return 8 + 16 * (uint64_t)ndim;
}

int amber__manifest_number_shards(const amber__manifest *m, int *several) {
  /* for each rank, the tensor (+1) whose shards it counts and how many it met */
  uint32_t *tensor = calloc((size_t)m->world + 1, sizeof *tensor);
  uint32_t *count = calloc((size_t)m->world + 1, sizeof *count);
  *several = 0;
  if (!tensor || !count) {
    free(tensor), free(count);
    return AMBER_ENOMEM;
  }
  for (uint32_t i = 0; i < m->ntensors; i++)
    for (uint32_t s = 0; s < m->tensors[i].nshards; s++) {
      amber__mshard *sh = &m->tensors[i].shards[s];
      if (sh->rank >= m->world) continue; /* refused by whoever reads it */
      if (tensor[sh->rank] != i + 1) tensor[sh->rank] = i + 1, count[sh->rank] = 0;
      sh->ord = count[sh->rank]++;
      *several |= sh->ord != 0;
    }
  free(tensor), free(count);
  return 0;
}

int amber__manifest_encode(const amber__manifest *m, amber__err *e, uint8_t **out,
                           size_t *len) {
  int several;
  if (amber__manifest_number_shards(m, &several) < 0)
    return amber__fail(e, AMBER_ENOMEM, "manifest: out of memory");
  uint64_t n = AMBER__MF_HEADER + (uint64_t)m->world * AMBER__MF_RANK + 8;
  for (uint32_t i = 0; i < m->ntensors; i++) {
    const amber__mtensor *t = &m->tensors[i];
    n += AMBER__MF_TENSOR + strlen(t->name) + 8 * (uint64_t)t->ndim +
         (uint64_t)t->nshards * shard_size(t->ndim);
  }
  uint8_t *b = calloc(1, (size_t)n);
  if (!b) return amber__fail(e, AMBER_ENOMEM, "manifest: out of memory");
  memcpy(b, AMBER__MF_MAGIC, 8);
  amber__put16(b + 8, AMBER_FORMAT_MAJOR);
  /* the oldest version that describes it, so that older readers keep reading
   * manifests without several shards of one rank */
  amber__put16(b + 10, several ? AMBER__MF_MINOR_BOXES : AMBER__MF_MINOR);
  amber__put64(b + 16, m->step);
  amber__put64(b + 24, m->parent);
  amber__put32(b + 32, m->world);
  amber__put32(b + 36, m->kind);
  amber__put32(b + 40, m->ntensors);
  amber__put64(b + 48, n);
  uint8_t *p = b + AMBER__MF_HEADER;
  for (uint32_t r = 0; r < m->world; r++, p += AMBER__MF_RANK) {
    amber__put64(p, m->ranks[r].step);
    amber__put64(p + 8, m->ranks[r].hash);
    amber__put64(p + 16, m->ranks[r].bytes);
    amber__put32(p + 24, m->ranks[r].kind);
    amber__put32(p + 28, m->ranks[r].flags);
  }
  for (uint32_t i = 0; i < m->ntensors; i++) {
    const amber__mtensor *t = &m->tensors[i];
    size_t nl = strlen(t->name);
    amber__put16(p, (uint16_t)nl);
    p[2] = (uint8_t)t->dtype;
    p[3] = (uint8_t)t->ndim;
    amber__put32(p + 4, t->flags);
    amber__put32(p + 8, t->nshards);
    p += AMBER__MF_TENSOR;
    memcpy(p, t->name, nl);
    p += nl;
    for (uint32_t d = 0; d < t->ndim; d++, p += 8) amber__put64(p, (uint64_t)t->shape[d]);
    for (uint32_t s = 0; s < t->nshards; s++) {
      amber__put32(p, t->shards[s].rank);
      p += 8;
      for (uint32_t d = 0; d < t->ndim; d++, p += 8)
        amber__put64(p, (uint64_t)t->shards[s].off[d]);
      for (uint32_t d = 0; d < t->ndim; d++, p += 8)
        amber__put64(p, (uint64_t)t->shards[s].shape[d]);
    }
  }
  amber__put64(p, amber__xxh3(b, (size_t)n - 8));
  *out = b;
  *len = (size_t)n;
  return 0;
}

int amber__boxes_meet(const int64_t *aoff, const int64_t *ashape, const int64_t *boff,
                      const int64_t *bshape, uint32_t ndim) {
  for (uint32_t d = 0; d < ndim; d++)
    if (!ashape[d] || !bshape[d] || aoff[d] >= boff[d] + bshape[d] ||
        boff[d] >= aoff[d] + ashape[d])
      return 0;
  return 1;
}

typedef struct sweep_key {
  int64_t key;
  uint32_t shard;
} sweep_key;

static int cmp_key(const void *a, const void *b) {
  const sweep_key *x = a, *y = b;
  if (x->key != y->key) return x->key < y->key ? -1 : 1;
  return x->shard < y->shard ? -1 : x->shard > y->shard;
}

/* Two shards that share an element, found by a sweep along the dimension where the
 * boxes start at the most distinct offsets (the one the tensor is split along):
 * sorted by where they start there, a box can only meet the ones that start
 * before it ends. *a gets UINT32_MAX when none do. */
static int find_overlap(const amber__mtensor *t, uint32_t *a, uint32_t *b) {
  *a = *b = UINT32_MAX;
  sweep_key *k = malloc((t->nshards ? t->nshards : 1) * sizeof *k);
  if (!k) return AMBER_ENOMEM;
  size_t n = 0;
  for (uint32_t s = 0; s < t->nshards; s++) {
    int empty = 0;
    for (uint32_t d = 0; d < t->ndim; d++) empty |= t->shards[s].shape[d] == 0;
    if (!empty) k[n++].shard = s;
  }
  uint32_t best = 0;
  size_t most = 0;
  for (uint32_t d = 0; d < t->ndim && n > 1; d++) {
    for (size_t i = 0; i < n; i++) k[i].key = t->shards[k[i].shard].off[d];
    qsort(k, n, sizeof *k, cmp_key);
    size_t distinct = 1;
    for (size_t i = 1; i < n; i++) distinct += k[i].key != k[i - 1].key;
    if (distinct > most) most = distinct, best = d;
  }
  for (size_t i = 0; i < n; i++) k[i].key = t->ndim ? t->shards[k[i].shard].off[best] : 0;
  qsort(k, n, sizeof *k, cmp_key);
  for (size_t i = 0; i < n && *a == UINT32_MAX; i++) {
    const amber__mshard *x = &t->shards[k[i].shard];
    int64_t end = t->ndim ? x->off[best] + x->shape[best] : 1;
    for (size_t j = i + 1; j < n && k[j].key < end; j++)
      if (amber__boxes_meet(x->off, x->shape, t->shards[k[j].shard].off,
                            t->shards[k[j].shard].shape, t->ndim)) {
        *a = k[i].shard < k[j].shard ? k[i].shard : k[j].shard;
        *b = k[i].shard < k[j].shard ? k[j].shard : k[i].shard;
        break;
      }
  }
  free(k);
  return 0;
}

int amber__mtensor_check_tiling(const amber__mtensor *t, char *why, size_t wl) {
  uint32_t a, b;
  if (find_overlap(t, &a, &b) < 0)
    return snprintf(why, wl, "out of memory"), AMBER_ENOMEM;
  if (a != UINT32_MAX) {
    const amber__mshard *x = &t->shards[a], *y = &t->shards[b];
    char xo[200], xs[200], yo[200], ys[200];
    amber__dims_text(x->off, t->ndim, xo, sizeof xo);
    amber__dims_text(x->shape, t->ndim, xs, sizeof xs);
    amber__dims_text(y->off, t->ndim, yo, sizeof yo);
    amber__dims_text(y->shape, t->ndim, ys, sizeof ys);
    snprintf(why, wl, "tensor '%s': the shards of rank %u (offsets %s, shape %s) and rank %u "
             "(offsets %s, shape %s) overlap", t->name, x->rank, xo, xs, y->rank, yo, ys);
    return AMBER_EMISMATCH;
  }
  /* disjoint boxes inside the tensor tile it when their volumes add up to it */
  uint64_t want = 1, have = 0;
  for (uint32_t d = 0; d < t->ndim; d++) want *= (uint64_t)t->shape[d];
  for (uint32_t s = 0; s < t->nshards; s++) {
    uint64_t v = 1;
    for (uint32_t d = 0; d < t->ndim; d++) v *= (uint64_t)t->shards[s].shape[d];
    have += v; /* disjoint and inside: the sum never passes the tensor's volume */
  }
  if (have != want) {
    snprintf(why, wl, "tensor '%s': its shards hold %llu of its %llu elements (they do not "
             "tile it)", t->name, (unsigned long long)have, (unsigned long long)want);
    return AMBER_EMISMATCH;
  }
  return 0;
}

void amber__manifest_free(amber__manifest *m) {
  if (!m) return;
  for (uint32_t i = 0; m->tensors && i < m->ntensors; i++) {
    free(m->tensors[i].name);
    free(m->tensors[i].shards);
  }
  free(m->tensors);
  free(m->ranks);
  memset(m, 0, sizeof *m);
}

/* Frees what was decoded so far once the message (which may name a tensor of it)
 * has been formatted. */
static int bad(amber__manifest *m, int rc) {
  amber__manifest_free(m);
  return rc;
}
#define BAD(...) bad(m, amber__fail(e, AMBER_ECORRUPT, __VA_ARGS__))

int amber__manifest_decode(amber__err *e, const char *what, const uint8_t *in, size_t len,
                           amber__manifest *m) {
  memset(m, 0, sizeof *m);
  if (len < AMBER__MF_HEADER + 8)
    return amber__fail(e, AMBER_ECORRUPT, "%s: truncated manifest (%zu bytes)", what, len);
  if (memcmp(in, AMBER__MF_MAGIC, 8) != 0)
    return amber__fail(e, AMBER_ECORRUPT, "%s: not an amber manifest (bad magic)", what);
  uint16_t major = amber__get16(in + 8);
  if (major != AMBER_FORMAT_MAJOR || amber__get16(in + 10) > AMBER_FORMAT_MINOR)
    return amber__fail(e, AMBER_EFORMAT, "%s: manifest format %u.%u (this library reads %d.%d)",
                       what, major, amber__get16(in + 10), AMBER_FORMAT_MAJOR,
                       AMBER_FORMAT_MINOR);
  if (amber__get64(in + 48) != len)
    return amber__fail(e, AMBER_ECORRUPT, "%s: manifest is %zu bytes, its header says %llu",
                       what, len, (unsigned long long)amber__get64(in + 48));
  if (amber__get64(in + len - 8) != amber__xxh3(in, len - 8))
    return amber__fail(e, AMBER_ECORRUPT, "%s: manifest checksum mismatch", what);
  if (amber__get32(in + 12) || amber__get32(in + 44))
    return amber__fail(e, AMBER_EFORMAT, "%s: manifest reserved fields are not zero", what);
  m->step = amber__get64(in + 16);
  m->parent = amber__get64(in + 24);
  m->world = amber__get32(in + 32);
  m->kind = amber__get32(in + 36);
  uint32_t nt = amber__get32(in + 40);
  const uint8_t *p = in + AMBER__MF_HEADER, *end = in + len - 8;
  if (m->world == 0 || m->world > AMBER__MF_MAX_WORLD ||
      (uint64_t)m->world * AMBER__MF_RANK > (uint64_t)(end - p))
    return BAD("%s: manifest world size %u does not fit its %zu bytes", what, m->world, len);
  if (m->kind > AMBER_KIND_DELTA) return BAD("%s: manifest kind %u unknown", what, m->kind);
  if ((uint64_t)nt * AMBER__MF_TENSOR > (uint64_t)(end - p) - (uint64_t)m->world * AMBER__MF_RANK)
    return BAD("%s: manifest tensor count %u does not fit its %zu bytes", what, nt, len);
  m->ranks = calloc(m->world, sizeof *m->ranks);
  m->tensors = calloc(nt ? nt : 1, sizeof *m->tensors);
  if (!m->ranks || !m->tensors) {
    amber__manifest_free(m);
    return amber__fail(e, AMBER_ENOMEM, "%s: out of memory", what);
  }
  for (uint32_t r = 0; r < m->world; r++, p += AMBER__MF_RANK) {
    amber__mrank *k = &m->ranks[r];
    k->step = amber__get64(p);
    k->hash = amber__get64(p + 8);
    k->bytes = amber__get64(p + 16);
    k->kind = amber__get32(p + 24);
    k->flags = amber__get32(p + 28);
    if (k->kind > AMBER_KIND_DELTA || (k->flags & ~AMBER__RANK_PRESENT))
      return BAD("%s: rank %u's entry is malformed", what, r);
  }
  for (uint32_t i = 0; i < nt; i++) {
    amber__mtensor *t = &m->tensors[i];
    if ((uint64_t)(end - p) < AMBER__MF_TENSOR) return BAD("%s: tensor %u truncated", what, i);
    size_t nl = amber__get16(p);
    t->dtype = p[2];
    t->ndim = p[3];
    t->flags = amber__get32(p + 4);
    t->nshards = amber__get32(p + 8);
    if (amber__get32(p + 12)) return BAD("%s: tensor %u: reserved field not zero", what, i);
    p += AMBER__MF_TENSOR;
    m->ntensors = i + 1;
    if (!nl || t->ndim > AMBER_MAX_DIMS || !amber_dtype_size(t->dtype) ||
        (t->flags & ~(uint32_t)AMBER_SHARD_REPLICATED))
      return BAD("%s: tensor %u: bad name length, ndim, dtype or flags", what, i);
    uint64_t need = nl + 8 * (uint64_t)t->ndim;
    if (need > (uint64_t)(end - p) ||
        (uint64_t)t->nshards > ((uint64_t)(end - p) - need) / shard_size(t->ndim))
      return BAD("%s: tensor %u: %u shards do not fit the manifest", what, i, t->nshards);
    t->name = malloc(nl + 1);
    t->shards = calloc(t->nshards ? t->nshards : 1, sizeof *t->shards);
    if (!t->name || !t->shards) {
      amber__manifest_free(m);
      return amber__fail(e, AMBER_ENOMEM, "%s: out of memory", what);
    }
    memcpy(t->name, p, nl);
    t->name[nl] = 0;
    if (memchr(t->name, 0, nl)) return BAD("%s: tensor %u: NUL in its name", what, i);
    p += nl;
    uint64_t elems = 1;
    for (uint32_t d = 0; d < t->ndim; d++, p += 8) {
      t->shape[d] = (int64_t)amber__get64(p);
      if (t->shape[d] < 0 || amber__mul_overflow(elems, (uint64_t)t->shape[d], &elems) ||
          elems > AMBER__MAX_BYTES)
        return BAD("%s: tensor '%s': impossible shape", what, t->name);
    }
    for (uint32_t s = 0; s < t->nshards; s++) {
      amber__mshard *sh = &t->shards[s];
      sh->rank = amber__get32(p);
      if (amber__get32(p + 4) || sh->rank >= m->world ||
          !(m->ranks[sh->rank].flags & AMBER__RANK_PRESENT))
        return BAD("%s: tensor '%s': shard %u names rank %u, which wrote no file", what,
                   t->name, s, sh->rank);
      p += 8;
      for (uint32_t d = 0; d < t->ndim; d++, p += 8) sh->off[d] = (int64_t)amber__get64(p);
      for (uint32_t d = 0; d < t->ndim; d++, p += 8) {
        sh->shape[d] = (int64_t)amber__get64(p);
        if (sh->off[d] < 0 || sh->shape[d] < 0 || sh->off[d] > t->shape[d] ||
            sh->shape[d] > t->shape[d] - sh->off[d])
          return BAD("%s: tensor '%s': shard %u of rank %u lies outside the tensor", what,
                     t->name, s, sh->rank);
      }
    }
    char why[512];
    int trc = amber__mtensor_check_tiling(t, why, sizeof why);
    if (trc == AMBER_ENOMEM) return bad(m, amber__fail(e, trc, "%s: out of memory", what));
    if (trc < 0) return BAD("%s: %s", what, why);
  }
  if (p != end) return BAD("%s: %zu unexpected bytes after the tensor table", what,
                           (size_t)(end - p));
  int several;
  if (amber__manifest_number_shards(m, &several) < 0)
    return bad(m, amber__fail(e, AMBER_ENOMEM, "%s: out of memory", what));
  return 0;
}

int amber__read_small(const char *path, amber__err *e, uint8_t **out, size_t *len,
                      size_t max) {
  if (amber__is_s3(path)) return amber__s3_read_small(path, e, out, len, max);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return amber__fail(e, errno == ENOENT ? AMBER_ENOENT : amber__errno_code(errno),
                       "%s: %s", path, strerror(errno));
  struct stat sb;
  if (fstat(fd, &sb) < 0 || sb.st_size < 0 || (uint64_t)sb.st_size > max) {
    close(fd);
    return amber__fail(e, AMBER_ECORRUPT, "%s: unexpected size", path);
  }
  uint8_t *b = malloc((size_t)sb.st_size + 1);
  if (!b) {
    close(fd);
    return amber__fail(e, AMBER_ENOMEM, "%s: out of memory", path);
  }
  int rc = amber__pread_full(fd, b, (size_t)sb.st_size, 0);
  close(fd);
  if (rc < 0) {
    free(b);
    return amber__fail(e, rc, "%s: read failed", path);
  }
  *out = b;
  *len = (size_t)sb.st_size;
  return 0;
}

int amber__global_manifest_bytes(const char *store, uint64_t step, amber__err *e, uint8_t **out,
                                 size_t *len, amber__manifest *m) {
  char path[4096];
  amber__global_manifest_path(store, step, path, sizeof path);
  uint8_t *b;
  int rc = amber__read_small(path, e, &b, len, UINT64_C(1) << 32);
  if (rc < 0) return rc;
  amber__manifest own;
  rc = amber__manifest_decode(e, path, b, *len, m ? m : &own);
  if (rc == 0 && !m) amber__manifest_free(&own);
  if (rc == 0 && out) *out = b;
  else free(b);
  return rc;
}

int amber__global_load_manifest(const char *store, uint64_t step, amber__err *e,
                                amber__manifest *m) {
  size_t len;
  return amber__global_manifest_bytes(store, step, e, NULL, &len, m);
}

int amber__global_state(const char *store, amber__err *e, uint64_t *step) {
  int rc = amber__global_read_latest(store, e, step);
  if (rc != AMBER_ENOENT) return rc;
  /* No GLOBAL: a crash in the first global commit leaves at most one manifest and
   * one file in each rank store (their parts of that step). More cannot come from
   * a crash: the store lost GLOBAL, and is refused (a writer would take it for
   * empty and remove every rank's committed files). */
  size_t manifests = 0, files = 0;
  uint32_t rank = 0;
  if (amber__is_s3(store) && (rc = amber__s3_global_counts(store, e, &manifests, &files,
                                                           &rank)) != 0)
    return rc;
  DIR *d = amber__is_s3(store) ? NULL : opendir(store);
  struct dirent *de;
  while (d && (de = readdir(d))) {
    uint64_t s;
    uint32_t r;
    if (amber__parse_manifest_name(de->d_name, &s)) {
      manifests++;
    } else if (amber__parse_rank_name(de->d_name, &r)) {
      char p[4200];
      snprintf(p, sizeof p, "%s/%s", store, de->d_name);
      size_t n = amber__count_ckpt_files(p, NULL);
      if (n > files) files = n, rank = r;
    }
  }
  if (d) closedir(d);
  if (manifests >= 2 || files >= 2)
    return amber__fail(e, AMBER_ECORRUPT,
                       "%s/GLOBAL is missing, but the store holds %zu step manifest%s and "
                       "rank-%05u holds %zu checkpoint file%s: the store is damaged (restore "
                       "GLOBAL, or move the store away)", store, manifests,
                       manifests == 1 ? "" : "s", rank, files, files == 1 ? "" : "s");
  return amber__fail(e, AMBER_ENOENT, "%s: no committed global step", store);
}

int amber__global_decode(amber__err *e, const char *what, const uint8_t *b, size_t len,
                         uint64_t *step) {
  if (len != GLOBAL_SIZE || memcmp(b, GLOBAL_MAGIC, 8) != 0 ||
      amber__get64(b + 16) != amber__xxh3(b, 16))
    return amber__fail(e, AMBER_ECORRUPT, "%s: damaged global LATEST", what);
  *step = amber__get64(b + 8);
  return 0;
}

void amber__global_encode(uint64_t step, uint8_t out[AMBER__GLOBAL_SIZE]) {
  memcpy(out, GLOBAL_MAGIC, 8);
  amber__put64(out + 8, step);
  amber__put64(out + 16, amber__xxh3(out, 16));
}

int amber__global_read_latest(const char *store, amber__err *e, uint64_t *step) {
  char path[4096];
  snprintf(path, sizeof path, "%s/GLOBAL", store);
  uint8_t *b;
  size_t len;
  int rc = amber__read_small(path, e, &b, &len, 4096);
  if (rc < 0) return rc;
  rc = amber__global_decode(e, path, b, len, step);
  free(b);
  return rc;
}

int amber__write_file_durable(const char *dir, const char *path, amber__err *e,
                              const void *data, size_t len) {
  if (amber__is_s3(path)) return amber__s3_write_small(path, e, data, len);
  char tmp[4200];
  int fd;
  int rc = amber__create_tmp(e, path, tmp, sizeof tmp, &fd);
  if (rc < 0) return rc;
  if (amber__write_full(fd, data, len) < 0) rc = amber__errno_code(errno);
  if (rc == 0 && fsync(fd) < 0) rc = amber__errno_code(errno);
  if (close(fd) < 0 && rc == 0) rc = amber__errno_code(errno);
  if (rc == 0 && rename(tmp, path) < 0) rc = amber__errno_code(errno);
  if (rc < 0) {
    int err = errno;
    unlink(tmp);
    return amber__fail(e, rc, "%s: write failed: %s", path, strerror(err));
  }
  if (amber__fsync_dir(dir) < 0)
    return amber__fail(e, AMBER_EIO, "%s: fsync of the directory failed", dir);
  return 0;
}

int amber__global_write_latest(const char *store, amber__err *e, uint64_t step) {
  char path[4096];
  uint8_t b[GLOBAL_SIZE];
  snprintf(path, sizeof path, "%s/GLOBAL", store);
  amber__global_encode(step, b);
  return amber__write_file_durable(store, path, e, b, sizeof b);
}

/* ---- the box table of a rank's file ---- */

static int cmp_box(const void *a, const void *b) {
  const amber__box *x = a, *y = b;
  size_t n = x->name_len < y->name_len ? x->name_len : y->name_len;
  int c = memcmp(x->name, y->name, n);
  return c ? c : (x->name_len > y->name_len) - (x->name_len < y->name_len);
}

int amber__boxes_encode(const amber__box *b, size_t n, amber__err *e, uint8_t **out,
                        size_t *len) {
  size_t total = AMBER__BOXES_HEADER;
  for (size_t i = 0; i < n; i++) total += 4 + b[i].name_len + 16 * (size_t)b[i].ndim;
  uint8_t *buf = calloc(1, total), *p = buf + AMBER__BOXES_HEADER;
  if (!buf) return amber__fail(e, AMBER_ENOMEM, "box table: out of memory");
  memcpy(buf, AMBER__BOXES_MAGIC, 8);
  amber__put32(buf + 8, (uint32_t)n);
  for (size_t i = 0; i < n; i++) {
    amber__put16(p, (uint16_t)b[i].name_len);
    p[2] = (uint8_t)b[i].ndim;
    memcpy(p + 4, b[i].name, b[i].name_len);
    p += 4 + b[i].name_len;
    for (uint32_t d = 0; d < b[i].ndim; d++, p += 8) amber__put64(p, (uint64_t)b[i].shape[d]);
    for (uint32_t d = 0; d < b[i].ndim; d++, p += 8) amber__put64(p, (uint64_t)b[i].off[d]);
  }
  *out = buf;
  *len = total;
  return 0;
}

int amber__boxes_decode(amber__err *e, const char *what, const uint8_t *in, size_t len,
                        amber__box **out, size_t *count) {
  *out = NULL, *count = 0;
  if (len < AMBER__BOXES_HEADER || memcmp(in, AMBER__BOXES_MAGIC, 8) || amber__get32(in + 12))
    return amber__fail(e, AMBER_ECORRUPT, "%s: not a box table (bad magic or reserved field)",
                       what);
  uint32_t n = amber__get32(in + 8);
  const uint8_t *p = in + AMBER__BOXES_HEADER, *end = in + len;
  if ((uint64_t)n * 4 > (uint64_t)(end - p))
    return amber__fail(e, AMBER_ECORRUPT, "%s: %u boxes do not fit the table's %zu bytes", what,
                       n, len);
  amber__box *b = calloc(n ? n : 1, sizeof *b);
  if (!b) return amber__fail(e, AMBER_ENOMEM, "%s: out of memory", what);
  for (uint32_t i = 0; i < n; i++) {
    if (end - p < 4) goto bad;
    b[i].name_len = amber__get16(p);
    b[i].ndim = p[2];
    if (!b[i].name_len || b[i].ndim > AMBER_MAX_DIMS || p[3] ||
        (uint64_t)(end - p) - 4 < b[i].name_len + 16 * (uint64_t)b[i].ndim)
      goto bad;
    b[i].name = (const char *)p + 4;
    p += 4 + b[i].name_len;
    for (uint32_t d = 0; d < b[i].ndim; d++, p += 8) b[i].shape[d] = (int64_t)amber__get64(p);
    for (uint32_t d = 0; d < b[i].ndim; d++, p += 8) b[i].off[d] = (int64_t)amber__get64(p);
  }
  if (p != end) goto bad;
  qsort(b, n, sizeof *b, cmp_box);
  for (uint32_t i = 1; i < n; i++)
    if (!cmp_box(&b[i - 1], &b[i])) goto bad;
  *out = b, *count = n;
  return 0;
bad:
  free(b);
  return amber__fail(e, AMBER_ECORRUPT, "%s: malformed box table", what);
}

const amber__box *amber__boxes_find(const amber__box *b, size_t n, const char *name) {
  amber__box key;
  memset(&key, 0, sizeof key);
  key.name = name, key.name_len = strlen(name);
  return bsearch(&key, b, n, sizeof *b, cmp_box);
}

int amber__box_name_reserved(const char *name) {
  size_t n = strlen(AMBER__BOXES_NAME);
  return !strncmp(name, AMBER__BOXES_NAME, n) && (name[n] == 0 || name[n] == '/');
}

char *amber__box_file_name(const char *name, uint32_t ord) {
  size_t len = strlen(name) + sizeof AMBER__BOXES_NAME + 16;
  char *f = malloc(len);
  if (!f) return NULL;
  if (ord) snprintf(f, len, "%s/%" PRIu32 "/%s", AMBER__BOXES_NAME, ord, name);
  else snprintf(f, len, "%s", name);
  return f;
}

/*
 * writer.c - the writer: tensor declarations, the reference state, and the save
 * of a full or delta checkpoint.
 *
 * The writer keeps the reference state: for every tensor, exactly the bytes that
 * restoring the latest committed checkpoint yields. A delta stores, per chunk,
 * what the tensor's policy selects from `live - reference` and moves only those
 * elements of the reference; whatever is not stored stays in the difference and
 * is carried to the next save (error feedback), so it is deferred, never lost.
 *
 * A save is a parallel loop over all chunks (pool.c): each worker encodes a chunk
 * (chunk.c: scan, then the smallest encoding) into its own scratch and appends
 * the payload to the one checkpoint file being written (ckpt.c; payload order in
 * the file does not matter: the index records offsets). The file is then sealed
 * (index, footer, fsync) and committed: rename, fsync of the directory, LATEST.
 * Buffers are sized at the first save and reused; nothing is allocated per save
 * after that. Whether a save is full or a delta is the cadence's call
 * (cadence.c); an asynchronous save's life cycle is the saver's (saver.c).
 *
 * The writer's state is in parts: the declarations (decls), the assembly of the
 * file (assembly), the reference (reference), the cadence, the saver, and what
 * it knows of the store (latest step and state, the last prune's status).
 */
#include <inttypes.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cadence.h"
#include "codec.h"
#include "chunk.h"
#include "ckpt.h"
#include "format.h"
#include "internal.h"
#include "io.h"
#include "names.h"
#include "policy.h"
#include "presel.h"
#include "pool.h"
#include "save_stats.h"
#include "saver.h"
#include "store.h"
#include "writer.h"

#define DEFAULT_CHUNK_ELEMS (UINT64_C(1) << 20)
#define DEFAULT_FULL_EVERY 50

/* One declared tensor. */
typedef struct decl {
  amber__tensor t;         /* as the index describes it; name owned, policy points into rules */
  const uint8_t *data;     /* the caller's memory */
  const amber__rule *rule; /* its rule at this save (NULL: exact) */
  char *match;             /* the name its rules match, when not its own (match_as) */
  double unit;             /* what "Nu" in its rule means (0: no unit, see set_units) */
  amber__rule own;         /* its rule with units resolved, when `rule` points here */
  char own_spec[AMBER__SPEC_MAX];
  uint8_t *ref;            /* its copy in the reference state (NULL until allocated) */
  int presel;              /* pre-selected: the caller selects and keeps the reference */
  amber_chunk_sel *sel;    /* pre-selected: the next save's chunks (n_chunks entries) */
  int sel_ready;           /* set_selection since the last save */
  amber_chunk_source src;  /* pre-selected: asked per chunk when no selection was set */
  void *src_user;
  int from_src;            /* the save in progress asks src */
} decl;

/* The declarations: fixed after the first save, except data, rules and metadata. */
typedef struct decls {
  decl *d;
  size_t n, cap;
  amber__rules rules;
  amber__names names; /* name -> position of the declared tensors */
  char *meta;
  size_t meta_len;
  int frozen;
  size_t resolved; /* rules.n when each tensor's rule was last resolved; 0: not yet */
} decls;

/* The assembly of a checkpoint file: the chunk table and the workers' scratch,
 * sized at the first save and reused by every save. */
typedef struct assembly {
  amber__ckpt_out *out;    /* the file being written */
  amber__tensor *tensors;  /* the index's tensor table, copied from the declarations */
  amber__chunk *chunks;    /* chunk table */
  uint32_t *owner;         /* tensor of each chunk */
  uint64_t n_chunks;
  amber__scratch *ws;      /* one per pool worker */
  size_t max_chunk_bytes, max_chunk_elems;
  int have_scratch;        /* allocated (lazily: a full-only writer needs none) */
  _Atomic uint64_t done;   /* bytes of the save's chunks written, for amber__progress */
  uint64_t total;          /* and of all of them */
} assembly;

/* The reference state (decl.ref): exactly what restoring the latest checkpoint yields. */
typedef struct reference {
  int valid;     /* it equals the restore of the latest checkpoint */
  int allocated; /* every decl.ref is (lazily: a full-only writer needs none) */
  int keep;      /* the save in progress updates it */
} reference;

struct amber_writer {
  amber__err err;
  amber_store *st;
  amber_writer_opts opts;
  int qzstd_level; /* QSPARSE bodies: the caller's zstd_level, else 1 (codec.h) */
  decls dc;
  assembly as;
  reference ref;
  amber__pool *pool;
  int delta;     /* kind of the save in progress */
  int two_phase; /* full save: copy all of live first, so the fence comes early */
  /* the store as this writer knows it */
  int have_latest;
  uint64_t latest_step, latest_state;
  amber__cadence cadence;
  int chunk_given; /* the caller chose chunk_elems; else the store's is adopted */
  struct {         /* amber_writer_plan's decision for the next save */
    int set, delta;
    uint64_t step;
    uint32_t flags;
  } plan;
  amber__save_stats stats; /* of the last save */
  int prune_rc;             /* the prune after the last commit (keep_last) */
  size_t pruned;            /* files it removed */
  amber__err prune_err;     /* its message when it failed */
  amber__saver saver; /* the asynchronous save (amber_writer_begin / fence / wait) */
};

void amber__writer_stats(const amber_writer *w, amber__save_stats *out) {
  *out = w->stats;
}

void amber_writer_opts_init(amber_writer_opts *opts) {
  memset(opts, 0, sizeof *opts);
}

static int run_begun(void *ctx, uint64_t step);

static int online_cpus(void) {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n < 1 ? 1 : n > 64 ? 64 : (int)n;
}

int amber_writer_open(amber_writer **out, amber_store *st, const amber_writer_opts *opts) {
  amber_writer_opts def;
  if (!opts) {
    amber_writer_opts_init(&def);
    opts = &def;
  }
  if (!out || !st) return amber__fail(NULL, AMBER_EINVAL, "amber_writer_open: NULL argument");
  *out = NULL;
  for (int i = 0; i < 4; i++)
    if (opts->reserved[i] || opts->reserved0)
      return amber__fail(NULL, AMBER_EINVAL, "amber_writer_open: reserved option set");
  if (opts->flags & AMBER_WRITER_GLOBAL_LOCAL)
    return amber__fail(NULL, AMBER_EINVAL, "AMBER_WRITER_GLOBAL_LOCAL is a global writer's "
                       "option (amber_global_writer_open)");
  if (opts->stage_bytes && opts->stage_bytes < AMBER__MIN_STAGE_BYTES)
    return amber__fail(NULL, AMBER_EINVAL, "stage_bytes %" PRIu64 " is below the minimum %u",
                       opts->stage_bytes, AMBER__MIN_STAGE_BYTES);
  if (st->s3)
    return amber__fail(NULL, AMBER_EINVAL,
                       "%s: a writer writes a store in a directory; an s3:// store is "
                       "written through one, drained to it (amber_drain_start(DIR, \"%s\"); "
                       "amber_tier_staging names a DIR for it)",
                       st->path, st->path);
  if (st->lockfd < 0)
    return amber__fail(NULL, AMBER_EREADONLY, "store %s is open read-only", st->path);
  if (st->writers)
    return amber__fail(NULL, AMBER_EBUSY, "store %s already has a writer", st->path);
  if (opts->zstd_level < -7 || opts->zstd_level > 19)
    return amber__fail(NULL, AMBER_EINVAL, "zstd level %d is out of range", opts->zstd_level);
  if (opts->chunk_elems > AMBER__MAX_CHUNK_ELEMS)
    return amber__fail(NULL, AMBER_EINVAL, "chunk_elems %" PRIu64 " is above the maximum %" PRIu64,
                       opts->chunk_elems, (uint64_t)AMBER__MAX_CHUNK_ELEMS);
  if (isnan(opts->full_share))
    return amber__fail(NULL, AMBER_EINVAL, "full_share is NaN");
  amber_writer *w = calloc(1, sizeof *w);
  if (!w) return amber__fail(NULL, AMBER_ENOMEM, "out of memory");
  w->st = st;
  w->opts = *opts;
  w->chunk_given = opts->chunk_elems != 0;
  if (!w->opts.chunk_elems) w->opts.chunk_elems = DEFAULT_CHUNK_ELEMS;
  w->qzstd_level = opts->zstd_level ? opts->zstd_level : AMBER__QZSTD_LEVEL;
  if (!w->opts.zstd_level) w->opts.zstd_level = -1;
  if (!w->opts.full_every) w->opts.full_every = DEFAULT_FULL_EVERY;
  if (w->opts.full_share == 0) w->opts.full_share = AMBER__DEFAULT_FULL_SHARE;
  amber__cadence_init(&w->cadence, w->opts.full_every, w->opts.full_share);
  amber__saver_init(&w->saver, run_begun, w);
  st->writers++;
  /* A damaged store (LATEST lost) is refused: saving into it would make its
   * checkpoints look uncommitted, and the next writer would remove them. */
  int rc = amber__store_state(st, &w->err, &w->latest_step, &w->latest_state);
  if (rc == 0) {
    w->have_latest = 1;
  } else if (rc != AMBER_ENOENT) {
    amber_writer_close(w);
    return rc;
  }
  int threads = st->threads ? (int)st->threads : online_cpus();
  uint64_t stage = opts->stage_bytes ? opts->stage_bytes : AMBER__STAGE_BYTES;
  int direct = !(opts->flags & AMBER_WRITER_NO_DIRECT_IO);
  if (amber__ckpt_out_create(&w->as.out, (size_t)stage, direct) ||
      amber__pool_create(&w->pool, threads)) {
    amber_writer_close(w);
    return amber__fail(NULL, AMBER_ENOMEM, "out of memory for the writer's buffers");
  }
  *out = w;
  return 0;
}

void amber_writer_close(amber_writer *w) {
  if (!w) return;
  amber_writer_wait(w);
  amber__saver_destroy(&w->saver);
  for (size_t i = 0; i < w->dc.n; i++) {
    free(w->dc.d[i].t.name);
    free(w->dc.d[i].match);
    free(w->dc.d[i].sel);
    amber__big_free(w->dc.d[i].ref, (size_t)w->dc.d[i].t.nbytes);
  }
  if (w->as.ws)
    for (int i = 0; i < amber__pool_size(w->pool); i++) amber__scratch_free(&w->as.ws[i]);
  free(w->as.ws);
  free(w->dc.d);
  free(w->as.tensors);
  amber__rules_free(&w->dc.rules);
  amber__names_free(&w->dc.names);
  free(w->dc.meta);
  free(w->as.chunks);
  free(w->as.owner);
  amber__pool_destroy(w->pool);
  amber__ckpt_out_destroy(w->as.out);
  w->st->writers--;
  free(w);
}

static const char *tensor_name(const void *ctx, size_t pos, size_t *len) {
  const amber_writer *w = ctx;
  *len = w->dc.d[pos].t.name_len;
  return w->dc.d[pos].t.name;
}

static int add_decl(amber_writer *w, const char *name, int dtype, uint32_t ndim,
                    const int64_t *shape, const void *data, int presel, size_t *index) {
  if (!w || !name) return amber__fail(NULL, AMBER_EINVAL, "amber_writer_add: NULL argument");
  size_t len = strlen(name);
  if (w->dc.frozen)
    return amber__fail(&w->err, AMBER_EBUSY,
                       "tensor '%s': tensors cannot be added after the first save", name);
  if (len == 0 || len > 65535)
    return amber__fail(&w->err, AMBER_EINVAL, "tensor name must be 1..65535 bytes");
  size_t isz = amber_dtype_size(dtype);
  if (!isz) return amber__fail(&w->err, AMBER_EINVAL, "tensor '%s': unknown dtype %d", name, dtype);
  if (ndim > AMBER_MAX_DIMS)
    return amber__fail(&w->err, AMBER_EINVAL, "tensor '%s': %u dimensions (max %d)", name, ndim,
                       AMBER_MAX_DIMS);
  if (ndim && !shape) return amber__fail(&w->err, AMBER_EINVAL, "tensor '%s': no shape", name);
  uint64_t nelems = 1, nbytes;
  for (uint32_t d = 0; d < ndim; d++)
    if (shape[d] < 0 || amber__mul_overflow(nelems, (uint64_t)shape[d], &nelems))
      return amber__fail(&w->err, AMBER_EINVAL, "tensor '%s': bad shape", name);
  if (amber__mul_overflow(nelems, isz, &nbytes) || nbytes > AMBER__MAX_BYTES)
    return amber__fail(&w->err, AMBER_EINVAL, "tensor '%s' is too large", name);
  if (nbytes && !data && !presel)
    return amber__fail(&w->err, AMBER_EINVAL, "tensor '%s': no data", name);
  if (amber__names_find(&w->dc.names, name, len, tensor_name, w) >= 0)
    return amber__fail(&w->err, AMBER_EEXIST, "tensor '%s' is declared twice", name);
  if (w->dc.n == w->dc.cap) {
    size_t cap = w->dc.cap ? 2 * w->dc.cap : 64;
    decl *d = realloc(w->dc.d, cap * sizeof *d);
    if (!d) return amber__fail(&w->err, AMBER_ENOMEM, "out of memory");
    w->dc.d = d;
    w->dc.cap = cap;
  }
  memset(&w->dc.d[w->dc.n], 0, sizeof w->dc.d[w->dc.n]);
  amber__tensor *t = &w->dc.d[w->dc.n].t;
  if (!(t->name = strdup(name))) return amber__fail(&w->err, AMBER_ENOMEM, "out of memory");
  t->name_len = len;
  t->dtype = dtype;
  t->ndim = ndim;
  for (uint32_t d = 0; d < ndim; d++) t->shape[d] = (uint64_t)shape[d];
  t->nelems = nelems;
  t->nbytes = nbytes;
  /* the chunk must stay within the format's per-chunk byte limit */
  t->chunk_elems = w->opts.chunk_elems;
  if (t->chunk_elems * isz > AMBER__MAX_CHUNK_BYTES) t->chunk_elems = AMBER__MAX_CHUNK_BYTES / isz;
  t->n_chunks = nelems / t->chunk_elems + (nelems % t->chunk_elems != 0);
  t->first_chunk = w->as.n_chunks;
  t->policy = (char *)"exact";
  if (amber__names_insert(&w->dc.names, t->name, len, w->dc.n, tensor_name, w) < 0) {
    free(t->name);
    return amber__fail(&w->err, AMBER_ENOMEM, "out of memory");
  }
  w->as.n_chunks += t->n_chunks;
  w->dc.d[w->dc.n].data = data;
  w->dc.d[w->dc.n].presel = presel;
  if (index) *index = w->dc.n;
  w->dc.n++;
  return 0;
}

int amber_writer_add(amber_writer *w, const char *name, int dtype, uint32_t ndim,
                     const int64_t *shape, const void *data, size_t *index) {
  return add_decl(w, name, dtype, ndim, shape, data, 0, index);
}

int amber_writer_add_preselected(amber_writer *w, const char *name, int dtype, uint32_t ndim,
                                 const int64_t *shape, size_t *index) {
  return add_decl(w, name, dtype, ndim, shape, NULL, 1, index);
}

/* Declarations, pointers, rules and metadata are read by a save in progress. */
static int busy(amber_writer *w, const char *what) {
  if (!amber__saver_busy(&w->saver)) return 0;
  return amber__fail(&w->err, AMBER_EBUSY, "%s: a save is in progress (wait for it first)",
                     what);
}

int amber__writer_match_as(amber_writer *w, size_t index, const char *name) {
  if (busy(w, "amber__writer_match_as")) return AMBER_EBUSY;
  if (index >= w->dc.n)
    return amber__fail(&w->err, AMBER_EINVAL, "tensor index %zu out of range (%zu tensors)",
                       index, w->dc.n);
  char *m = NULL;
  if (name && !(m = strdup(name))) return amber__fail(&w->err, AMBER_ENOMEM, "out of memory");
  free(w->dc.d[index].match);
  w->dc.d[index].match = m;
  w->dc.resolved = 0; /* its rule is matched again */
  return 0;
}

int amber_writer_set_data(amber_writer *w, size_t index, const void *data) {
  if (!w) return amber__fail(NULL, AMBER_EINVAL, "amber_writer_set_data: NULL writer");
  if (busy(w, "amber_writer_set_data")) return AMBER_EBUSY;
  if (index >= w->dc.n)
    return amber__fail(&w->err, AMBER_EINVAL, "tensor index %zu out of range (%zu tensors)",
                       index, w->dc.n);
  if (w->dc.d[index].presel)
    return amber__fail(&w->err, AMBER_EINVAL,
                       "tensor '%s' is pre-selected: it has no memory for amber to read",
                       w->dc.d[index].t.name);
  if (w->dc.d[index].t.nbytes && !data)
    return amber__fail(&w->err, AMBER_EINVAL, "tensor '%s': no data", w->dc.d[index].t.name);
  w->dc.d[index].data = data;
  return 0;
}

int amber_writer_add_policy(amber_writer *w, const char *rule) {
  if (!w || !rule) return amber__fail(NULL, AMBER_EINVAL, "amber_writer_add_policy: NULL");
  if (busy(w, "amber_writer_add_policy")) return AMBER_EBUSY;
  return amber__rules_add(&w->err, &w->dc.rules, rule);
}

int amber_writer_set_units(amber_writer *w, const double *units, size_t n) {
  if (!w || (n && !units)) return amber__fail(NULL, AMBER_EINVAL, "amber_writer_set_units: NULL");
  if (busy(w, "amber_writer_set_units")) return AMBER_EBUSY;
  if (n > w->dc.n)
    return amber__fail(&w->err, AMBER_EINVAL, "%zu units for %zu declared tensors", n, w->dc.n);
  for (size_t i = 0; i < n; i++)
    if (!(units[i] >= 0) || isinf(units[i]))
      return amber__fail(&w->err, AMBER_EINVAL, "tensor '%s': unit %g is not finite and >= 0",
                         w->dc.d[i].t.name, units[i]);
  for (size_t i = 0; i < n; i++)
    if (w->dc.d[i].unit != units[i]) {
      w->dc.d[i].unit = units[i];
      w->dc.resolved = 0; /* the rules in units resolve again */
    }
  return 0;
}

int amber_writer_set_meta(amber_writer *w, const char *json, size_t len) {
  if (!w || (len && !json)) return amber__fail(NULL, AMBER_EINVAL, "amber_writer_set_meta: NULL");
  if (busy(w, "amber_writer_set_meta")) return AMBER_EBUSY;
  char *m = NULL;
  if (len) {
    if (!(m = malloc(len + 1))) return amber__fail(&w->err, AMBER_ENOMEM, "out of memory");
    memcpy(m, json, len);
    m[len] = 0;
  }
  free(w->dc.meta);
  w->dc.meta = m;
  w->dc.meta_len = len;
  return 0;
}

static const char *index_name(const void *ctx, size_t pos, size_t *len) {
  const amber__index *ix = ctx;
  *len = ix->tensors[pos].name_len;
  return ix->tensors[pos].name;
}

/* The latest checkpoint, opened at most once per save however many parts of the
 * writer need it: on resuming, one reader gives the chunking, the cadence and
 * the reference (one pass over the store, not one per part). */
typedef struct latest_view {
  amber_reader *r;
  int tried;
} latest_view;

static amber_reader *latest_reader(amber_writer *w, latest_view *l) {
  if (!l || l->tried || !w->have_latest) return l ? l->r : NULL;
  l->tried = 1;
  if (amber_reader_open(&l->r, w->st, w->latest_step, NULL) != 0) l->r = NULL;
  return l->r;
}

/* A delta needs the latest checkpoint's chunking: unless the caller chose one,
 * tensors that the latest checkpoint (index `ix`; NULL: read it) also holds take
 * its chunk size. */
static void adopt_chunking(amber_writer *w, const amber__index *ix, latest_view *l) {
  if (w->chunk_given || !w->have_latest) return;
  if (!ix) {
    amber_reader *r = latest_reader(w, l);
    if (!r) return;
    ix = amber__reader_index(r);
  }
  amber__names names = {0};
  for (uint64_t k = 0; k < ix->n_tensors; k++)
    if (amber__names_insert(&names, ix->tensors[k].name, ix->tensors[k].name_len, (size_t)k,
                            index_name, ix) < 0)
      break; /* out of memory: keep the default chunking, the next save is full */
  w->as.n_chunks = 0;
  for (size_t i = 0; i < w->dc.n; i++) {
    amber__tensor *t = &w->dc.d[i].t;
    long k = amber__names_find(&names, t->name, t->name_len, index_name, ix);
    if (k >= 0 && ix->tensors[k].dtype == t->dtype && ix->tensors[k].nelems == t->nelems)
      t->chunk_elems = ix->tensors[k].chunk_elems;
    t->n_chunks = t->nelems / t->chunk_elems + (t->nelems % t->chunk_elems != 0);
    t->first_chunk = w->as.n_chunks;
    w->as.n_chunks += t->n_chunks;
  }
  amber__names_free(&names);
}

/* Sizes the chunk table for the declared tensors (first save only); `ix` as
 * for adopt_chunking. */
static int prepare(amber_writer *w, const amber__index *ix, latest_view *l) {
  if (w->dc.frozen) return 0;
  adopt_chunking(w, ix, l);
  w->as.chunks = calloc(w->as.n_chunks ? w->as.n_chunks : 1, sizeof *w->as.chunks);
  w->as.owner = calloc(w->as.n_chunks ? w->as.n_chunks : 1, sizeof *w->as.owner);
  w->as.tensors = calloc(w->dc.n ? w->dc.n : 1, sizeof *w->as.tensors);
  w->as.ws = calloc((size_t)amber__pool_size(w->pool), sizeof *w->as.ws);
  if (!w->as.chunks || !w->as.owner || !w->as.tensors || !w->as.ws)
    return amber__fail(&w->err, AMBER_ENOMEM, "out of memory for the chunk table");
  w->as.max_chunk_elems = 1;
  for (size_t i = 0; i < w->dc.n; i++) {
    const amber__tensor *t = &w->dc.d[i].t;
    for (uint64_t j = 0; j < t->n_chunks; j++) w->as.owner[t->first_chunk + j] = (uint32_t)i;
    uint64_t cb = t->chunk_elems * amber_dtype_size(t->dtype);
    if (t->nbytes < cb) cb = t->nbytes;
    uint64_t ce = t->nelems < t->chunk_elems ? t->nelems : t->chunk_elems;
    /* a pre-selected chunk has no reference to store whole when its selection
     * is dense: its sparse body (bitmap form at most) must fit the scratch */
    if (w->dc.d[i].presel) cb += 1 + (ce + 7) / 8;
    if (cb > w->as.max_chunk_bytes) w->as.max_chunk_bytes = (size_t)cb;
    if (ce > w->as.max_chunk_elems) w->as.max_chunk_elems = (size_t)ce;
  }
  w->dc.frozen = 1;
  return 0;
}

/* The reference state: one copy of every declared tensor, allocated once. */
static int ensure_ref(amber_writer *w) {
  for (size_t i = 0; !w->ref.allocated && i < w->dc.n; i++)
    if (w->dc.d[i].t.nbytes && !w->dc.d[i].ref && !w->dc.d[i].presel &&
        !(w->dc.d[i].ref = amber__big_alloc((size_t)w->dc.d[i].t.nbytes)))
      return amber__fail(&w->err, AMBER_ENOMEM, "out of memory for the reference state of '%s'",
                         w->dc.d[i].t.name);
  w->ref.allocated = 1;
  return 0;
}

/* Per worker: scan output and encode buffers for the largest chunk; `prefault`:
 * their pages are faulted in now rather than by the first delta's scan. */
static int ensure_scratch(amber_writer *w, int prefault) {
  if (w->as.have_scratch) return 0;
  for (int i = 0; i < amber__pool_size(w->pool); i++)
    if (amber__scratch_init(&w->as.ws[i], w->as.max_chunk_bytes, w->as.max_chunk_elems, prefault))
      return amber__fail(&w->err, AMBER_ENOMEM, "out of memory for scan buffers");
  w->as.have_scratch = 1;
  return 0;
}

/* Resolves each tensor's rule; rules and units may have changed since the last
 * save. A rule with units applies to a tensor with a unit as its numbers times
 * that unit (the index records them written out); a tensor without one is exact.
 * Rules are only ever added, and the declarations are fixed once frozen: unchanged
 * rules and units keep every tensor's rule, and the glob matching, thousands of
 * fnmatch calls for a model's tensors, is not redone at every save (set_units and
 * add_rule make it run again). */
static void resolve_policies(amber_writer *w) {
  if (w->dc.frozen && w->dc.resolved == w->dc.rules.n + 1) return;
  w->dc.resolved = w->dc.frozen ? w->dc.rules.n + 1 : 0;
  for (size_t i = 0; i < w->dc.n; i++) {
    decl *d = &w->dc.d[i];
    const char *name = d->match ? d->match : d->t.name;
    const amber__rule *m = amber__rules_match(&w->dc.rules, name, d->t.dtype), *r = m;
    if (m && amber__policy_has_units(&m->policy)) {
      r = NULL;
      if (d->unit > 0) {
        amber__policy_scale(&m->policy, d->unit, &d->own.policy);
        if (amber__policy_format(&d->own.policy, d->own_spec, sizeof d->own_spec) > 0) {
          d->own.spec = d->own_spec;
          r = &d->own;
        }
      }
    }
    d->rule = r;
    d->t.policy = r ? r->spec : (char *)"exact";
  }
}

/* A failure, a cancel or a veto: the rest of the save's work is wasted. */
static int stopping(amber_writer *w) {
  return amber__ckpt_failed(w->as.out) || amber__saver_stopping(&w->saver);
}

/* Two-phase full save, phase 1: copy a chunk of live into the reference and
 * checksum it; phase 2 (append_job) writes the reference. */
static void chunk_job(void *ctx, int worker, size_t j);

static void copy_job(void *ctx, int worker, size_t j) {
  amber_writer *w = ctx;
  size_t ti = w->as.owner[j];
  const amber__tensor *t = &w->dc.d[ti].t;
  uint64_t jj = j - t->first_chunk;
  if (w->dc.d[ti].presel) { /* no reference: appended now, while its values are lent */
    chunk_job(ctx, worker, j);
    return;
  }
  size_t isz = amber_dtype_size(t->dtype), bytes = (size_t)amber__chunk_n(t, jj) * isz;
  size_t off = (size_t)(jj * t->chunk_elems * isz);
  uint8_t *ref = w->dc.d[ti].ref + off;
  const uint8_t *src = w->dc.d[ti].data + off;
  amber__chunk *c = &w->as.chunks[j];
  c->encoding = AMBER__ENC_RAW;
  c->stored = amber__chunk_n(t, jj);
  c->checksum = amber__copy_hashed(ref, src, bytes);
}

/* A chunk of the save is done: counted for the progress hook. */
static void chunk_done(amber_writer *w, uint64_t bytes) {
  amber__progress("save", atomic_fetch_add(&w->as.done, bytes) + bytes, w->as.total);
}

static void append_job(void *ctx, int worker, size_t j) {
  amber_writer *w = ctx;
  (void)worker;
  if (stopping(w)) return;
  size_t ti = w->as.owner[j];
  if (w->dc.d[ti].presel) return; /* appended by copy_job */
  const amber__tensor *t = &w->dc.d[ti].t;
  uint64_t jj = j - t->first_chunk;
  size_t isz = amber_dtype_size(t->dtype);
  size_t bytes = (size_t)amber__chunk_n(t, jj) * isz;
  amber__ckpt_append(w->as.out, &w->as.chunks[j],
                     w->dc.d[ti].ref + (size_t)(jj * t->chunk_elems * isz), bytes);
  chunk_done(w, bytes);
}

/* Checks one chunk's selection as amber_writer_set_selection checks a tensor's:
 * 0, or a message in `why`. */
static int bad_sel(const decl *d, uint64_t j, const amber_chunk_sel *sel, int full, char *why,
                   size_t len) {
  uint64_t n = amber__chunk_n(&d->t, j), c = sel->count;
  if (c != AMBER_SELECT_WHOLE && c > n)
    snprintf(why, len,
             "tensor '%s', chunk %" PRIu64 ": %" PRIu64 " elements selected of its %" PRIu64,
             d->t.name, j, c, n);
  else if (sel->quant && (c == AMBER_SELECT_WHOLE || !amber__quant_dtype(d->t.dtype)))
    snprintf(why, len, "tensor '%s', chunk %" PRIu64 ": a quantized selection %s", d->t.name,
             j, c == AMBER_SELECT_WHOLE ? "of a whole chunk" : "of a dtype without codes");
  else if (c && n && ((!sel->vals && !sel->quant) || (c != AMBER_SELECT_WHOLE && !sel->idx)))
    snprintf(why, len, "tensor '%s', chunk %" PRIu64 ": no %s", d->t.name, j,
             sel->vals || sel->quant ? "indices" : "values");
  else if (full && c != AMBER_SELECT_WHOLE)
    snprintf(why, len,
             "a full checkpoint, but chunk %" PRIu64
             " of pre-selected tensor '%s' is not AMBER_SELECT_WHOLE",
             j, d->t.name);
  else
    return 0;
  return 1;
}

/* Asks tensor ti's source for chunk jj; a refusal or a bad answer fails the file. */
static int ask_source(amber_writer *w, int worker, size_t ti, uint64_t jj, amber_chunk_sel *sel) {
  const decl *d = &w->dc.d[ti];
  char why[AMBER__ERRLEN];
  memset(sel, 0, sizeof *sel);
  int rc = d->src(d->src_user, worker, ti, jj, sel);
  if (rc) {
    snprintf(why, sizeof why, "tensor '%s', chunk %" PRIu64 ": its chunk source failed (%d)",
             d->t.name, jj, rc);
    amber__ckpt_fail(w->as.out, rc < 0 && rc >= AMBER_ECHANGED ? rc : AMBER_EIO, why);
    return 1;
  }
  if (bad_sel(d, jj, sel, !w->delta, why, sizeof why)) {
    amber__ckpt_fail(w->as.out, AMBER_EINVAL, why);
    return 1;
  }
  return 0;
}

static void chunk_job(void *ctx, int worker, size_t j) {
  amber_writer *w = ctx;
  if (stopping(w)) return;
  size_t ti = w->as.owner[j];
  const amber__tensor *t = &w->dc.d[ti].t;
  uint64_t jj = j - t->first_chunk;
  size_t isz = amber_dtype_size(t->dtype), off = (size_t)(jj * t->chunk_elems * isz);
  amber__chunk_src src = {.out = w->as.out, .name = t->name, .dtype = t->dtype,
                          .n = (size_t)amber__chunk_n(t, jj), .rule = w->dc.d[ti].rule,
                          .zstd_level = w->opts.zstd_level,
                          .qzstd_level = w->qzstd_level,
                          .compress = (w->opts.flags & AMBER_WRITER_COMPRESS_FULL) != 0};
  if (w->dc.d[ti].presel) { /* the caller's selection; no reference here */
    amber_chunk_sel asked;
    const amber_chunk_sel *sel = &w->dc.d[ti].sel[jj];
    if (w->dc.d[ti].from_src) {
      if (ask_source(w, worker, ti, jj, &asked)) return;
      sel = &asked;
    }
    amber__chunk_presel(&w->as.ws[worker], &src, sel, jj, &w->as.chunks[j]);
    chunk_done(w, src.n * isz);
    return;
  }
  src.live = w->dc.d[ti].data + off;
  src.ref = w->ref.keep ? w->dc.d[ti].ref + off : NULL;
  if (w->delta)
    amber__chunk_delta(&w->as.ws[worker], &src, &w->as.chunks[j]);
  else
    amber__chunk_full(&w->as.ws[worker], &src, &w->as.chunks[j]);
  chunk_done(w, src.n * isz);
}

/* Writes header, chunks, index, footer to a new temporary file next to `dst`
 * and makes it durable; its name goes to `tmp` (4200 bytes). */
static int write_file(amber_writer *w, const char *dst, char *tmp, uint64_t step,
                      uint64_t *state, uint64_t *file_bytes) {
  for (size_t i = 0; i < w->dc.n; i++) w->as.tensors[i] = w->dc.d[i].t;
  int rc = amber__ckpt_create(w->as.out, &w->err, dst, step, w->as.tensors, w->dc.n,
                              w->delta ? w->latest_step : AMBER_NO_STEP, w->latest_state);
  if (rc) return rc;
  snprintf(tmp, 4200, "%s", amber__ckpt_tmp(w->as.out));
  int nw = amber__pool_size(w->pool);
  for (int i = 0; i < nw; i++) w->as.ws[i].scan_s = w->as.ws[i].encode_s = 0;
  atomic_store(&w->as.done, 0);
  w->as.total = 0;
  for (size_t i = 0; i < w->dc.n; i++) w->as.total += w->dc.d[i].t.nbytes;
  double t0 = amber__now();
  if (!w->delta && w->two_phase && w->ref.keep && !(w->opts.flags & AMBER_WRITER_COMPRESS_FULL)) {
    amber__pool_for(w->pool, (size_t)w->as.n_chunks, copy_job, w);
    amber__saver_scanned(&w->saver);
    amber__pool_for(w->pool, (size_t)w->as.n_chunks, append_job, w);
  } else {
    amber__pool_for(w->pool, (size_t)w->as.n_chunks, chunk_job, w);
  }
  amber__saver_scanned(&w->saver);
  w->stats.chunks_s = amber__now() - t0;
  for (int i = 0; i < nw; i++) {
    w->stats.scan_cpu_s += w->as.ws[i].scan_s;
    w->stats.encode_cpu_s += w->as.ws[i].encode_s;
  }
  w->stats.workers = nw;
  rc = amber__ckpt_failed(w->as.out);
  if (!rc) rc = amber__saver_check_stop(&w->saver, &w->err, step);
  if (rc) {
    amber__ckpt_abort(w->as.out);
    return rc;
  }
  amber__index ix = {.tensors = w->as.tensors, .n_tensors = w->dc.n, .chunks = w->as.chunks,
                     .n_chunks = w->as.n_chunks, .meta = w->dc.meta, .meta_size = w->dc.meta_len};
  t0 = amber__now();
  rc = amber__ckpt_seal(w->as.out, &ix, NULL, state, file_bytes);
  w->stats.finish_s = amber__now() - t0;
  return rc;
}

/* 0 when index `ix` (of file `what`) describes exactly the declared tensors, in
 * order and chunked alike; else AMBER_EMISMATCH, the first difference in `e`. */
static int match_tensors(amber_writer *w, amber__err *e, const amber__index *ix,
                         const char *what) {
  if (ix->n_tensors != w->dc.n)
    return amber__fail(e, AMBER_EMISMATCH, "%s holds %" PRIu64 " tensors, the writer declares %zu",
                       what, ix->n_tensors, w->dc.n);
  for (size_t i = 0; i < w->dc.n; i++) {
    const amber__tensor *t = &w->dc.d[i].t, *u = &ix->tensors[i];
    if (strcmp(u->name, t->name))
      return amber__fail(e, AMBER_EMISMATCH,
                         "tensor %zu is '%s' in the writer but '%s' in %s (same names in the "
                         "same order are needed)",
                         i, t->name, u->name, what);
    if (u->dtype != t->dtype)
      return amber__fail(e, AMBER_EMISMATCH, "tensor '%s' is %s in the writer but %s in %s",
                         t->name, amber_dtype_name(t->dtype), amber_dtype_name(u->dtype), what);
    int same_shape = u->ndim == t->ndim;
    for (uint32_t d = 0; same_shape && d < t->ndim; d++) same_shape = u->shape[d] == t->shape[d];
    if (!same_shape)
      return amber__fail(e, AMBER_EMISMATCH,
                         "tensor '%s' has another shape in %s (%u dimensions, %" PRIu64
                         " elements) than in the writer (%u dimensions, %" PRIu64 " elements)",
                         t->name, what, u->ndim, u->nelems, t->ndim, t->nelems);
    if (u->chunk_elems != t->chunk_elems)
      return amber__fail(e, AMBER_EMISMATCH,
                         "tensor '%s' is cut into chunks of %" PRIu64 " elements in %s, of %" PRIu64
                         " in the writer (a delta needs the same chunking)",
                         t->name, u->chunk_elems, what, t->chunk_elems);
  }
  return 0;
}

/* 1 when the latest checkpoint describes exactly the declared tensors. */
static int same_tensors(amber_writer *w, amber_reader *r) {
  return match_tensors(w, NULL, amber__reader_index(r), "") == 0;
}

/* Learns the cadence counters from the chain of the latest checkpoint: from its
 * reader when it opens, else from the store's listing. */
static void load_cadence(amber_writer *w, latest_view *l) {
  amber_ckpt_info *info = NULL;
  size_t n = 0;
  uint64_t full_bytes = 0, deltas = 0, delta_bytes = 0;
  amber_reader *r = latest_reader(w, l);
  if (r) {
    amber__reader_chain_bytes(r, &full_bytes, &deltas, &delta_bytes);
  } else if (amber__store_list(w->st, NULL, &info, &n) == 0) {
    uint64_t want = w->latest_step;
    for (size_t i = n; i-- > 0;) {
      if (info[i].step != want) continue;
      if (info[i].kind == AMBER_KIND_FULL) {
        full_bytes = info[i].bytes;
        break;
      }
      deltas++;
      delta_bytes += info[i].bytes;
      want = info[i].parent;
    }
  }
  amber_free(info);
  amber__cadence_learn(&w->cadence, full_bytes, deltas, delta_bytes);
}

/* Makes the reference equal to the latest checkpoint's restore; 1 if it could
 * (same tensors and intact), 0 if the next save must be full. */
static int load_reference(amber_writer *w, latest_view *l) {
  if (ensure_ref(w) != 0) return 0;
  amber_reader *r = latest_reader(w, l);
  if (!r) return 0;
  int ok = same_tensors(w, r);
  size_t *idx = ok ? malloc((w->dc.n ? w->dc.n : 1) * sizeof *idx) : NULL;
  void **bufs = ok ? malloc((w->dc.n ? w->dc.n : 1) * sizeof *bufs) : NULL;
  uint64_t *sizes = ok ? malloc((w->dc.n ? w->dc.n : 1) * sizeof *sizes) : NULL;
  ok = ok && idx && bufs && sizes;
  size_t m = 0;
  for (size_t i = 0; ok && i < w->dc.n; i++) {
    if (w->dc.d[i].presel) continue; /* its reference is the caller's */
    idx[m] = i;
    bufs[m] = w->dc.d[i].ref;
    sizes[m++] = w->dc.d[i].t.nbytes;
  }
  /* all tensors at once: every chunk a job for the reader's threads */
  ok = ok && amber_reader_read_many(r, m, idx, bufs, sizes) == 0;
  free(idx);
  free(bufs);
  free(sizes);
  return ok;
}

/* Seeding: copies a chunk of the caller's tensors into the reference. */
static void seed_job(void *ctx, int worker, size_t j) {
  amber_writer *w = ctx;
  (void)worker;
  size_t ti = w->as.owner[j];
  if (w->dc.d[ti].presel) return; /* its reference is the caller's */
  const amber__tensor *t = &w->dc.d[ti].t;
  uint64_t jj = j - t->first_chunk;
  size_t isz = amber_dtype_size(t->dtype), off = (size_t)(jj * t->chunk_elems * isz);
  memcpy(w->dc.d[ti].ref + off, w->dc.d[ti].data + off, (size_t)amber__chunk_n(t, jj) * isz);
}

int amber_writer_seed_reference(amber_writer *w, uint64_t step) {
  if (!w) return amber__fail(NULL, AMBER_EINVAL, "amber_writer_seed_reference: NULL writer");
  if (amber__saver_state(&w->saver) != AMBER__SAVE_IDLE)
    return amber__fail(&w->err, AMBER_EBUSY,
                       "amber_writer_seed_reference: the save of step %" PRIu64
                       " is not reported yet (call amber_writer_wait first)",
                       w->saver.step);
  for (size_t i = 0; i < w->dc.n; i++)
    if (w->dc.d[i].t.nbytes && !w->dc.d[i].data && !w->dc.d[i].presel)
      return amber__fail(&w->err, AMBER_EINVAL, "tensor '%s' has no data", w->dc.d[i].t.name);
  uint64_t latest, state;
  int rc = amber__store_state(w->st, &w->err, &latest, &state);
  if (rc == AMBER_ENOENT)
    return amber__fail(&w->err, AMBER_ENOENT,
                       "cannot seed the reference from step %" PRIu64
                       ": store %s has no committed checkpoint",
                       step, w->st->path);
  if (rc) return rc;
  if (step != latest)
    return amber__fail(&w->err, AMBER_EINVAL,
                       "cannot seed the reference from step %" PRIu64 ": the latest step of "
                       "store %s is %" PRIu64 " (the reference is the latest committed state)",
                       step, w->st->path, latest);
  /* From here the reference is being replaced: valid again only on success. */
  w->ref.valid = 0;
  w->have_latest = 1;
  w->latest_step = latest;
  w->latest_state = state;
  amber__ckpt c;
  if ((rc = amber__ckpt_open(&w->err, w->st, step, &c)) != 0) return rc;
  if (c.ftr.state_id != state)
    rc = amber__fail(&w->err, AMBER_ECORRUPT,
                     "%s: state id %016" PRIx64 " is not LATEST's %016" PRIx64, c.path,
                     c.ftr.state_id, state);
  if (!rc) rc = prepare(w, &c.ix, NULL);
  if (!rc) rc = match_tensors(w, &w->err, &c.ix, c.path);
  amber__ckpt_close(&c);
  if (!rc) rc = ensure_ref(w);
  if (!rc) rc = ensure_scratch(w, 1); /* the first delta needs it: fault it in here */
  if (rc) return rc;
  load_cadence(w, NULL);
  /* Every page of the reference is written here, by the pool's threads: the
   * page faults of a fresh reference happen now, not in the next save. */
  amber__pool_for(w->pool, (size_t)w->as.n_chunks, seed_job, w);
  w->ref.valid = 1;
  return 0;
}

static int want_full(amber_writer *w, uint32_t flags, latest_view *l) {
  if ((flags & AMBER_SAVE_FULL) || !w->have_latest) return 1;
  if (!w->cadence.known) load_cadence(w, l);
  if (amber__cadence_decide(&w->cadence)) return 1;
  if (!w->ref.valid) w->ref.valid = load_reference(w, l);
  return !w->ref.valid;
}

/* The checks of a save request that need nothing of the store. */
static int check_request(amber_writer *w, uint64_t step, uint32_t flags) {
  if (flags & ~(AMBER_SAVE_FULL | AMBER_SAVE_NO_REFERENCE | AMBER_SAVE_CONFIRM))
    return amber__fail(&w->err, AMBER_EINVAL, "amber_writer_save: unknown flags 0x%x", flags);
  if (step == AMBER_NO_STEP)
    return amber__fail(&w->err, AMBER_EINVAL, "step %" PRIu64 " is reserved", step);
  if (w->have_latest && step <= w->latest_step)
    return amber__fail(&w->err, AMBER_EEXIST,
                       "step %" PRIu64 " is not after the store's latest step %" PRIu64, step,
                       w->latest_step);
  for (size_t i = 0; i < w->dc.n; i++)
    if (w->dc.d[i].t.nbytes && !w->dc.d[i].data && !w->dc.d[i].presel)
      return amber__fail(&w->err, AMBER_EINVAL, "tensor '%s' has no data", w->dc.d[i].t.name);
  return 0;
}

/* Every pre-selected tensor has its selection for this save, whole in a full one. */
static int check_selections(amber_writer *w, uint64_t step) {
  for (size_t i = 0; i < w->dc.n; i++) {
    const decl *d = &w->dc.d[i];
    if (!d->presel) continue;
    w->dc.d[i].from_src = !d->sel_ready && d->src;
    if (d->from_src) continue; /* checked as each chunk is asked for */
    if (!d->sel_ready)
      return amber__fail(&w->err, AMBER_EINVAL,
                         "step %" PRIu64 ": pre-selected tensor '%s' has no selection (call "
                         "amber_writer_plan, then amber_writer_set_selection before each save, "
                         "or give it a source: amber_writer_set_source)",
                         step, d->t.name);
    for (uint64_t j = 0; !w->delta && j < d->t.n_chunks; j++)
      if (d->sel[j].count != AMBER_SELECT_WHOLE)
        return amber__fail(&w->err, AMBER_EINVAL,
                           "step %" PRIu64 " is a full checkpoint, but chunk %" PRIu64
                           " of pre-selected tensor '%s' is not AMBER_SELECT_WHOLE",
                           step, j, d->t.name);
  }
  return 0;
}

/* Checks a save request and decides its kind; nothing has started on failure. */
static int start_save(amber_writer *w, uint64_t step, uint32_t flags) {
  int rc = check_request(w, step, flags);
  int planned = w->plan.set && w->plan.step == step && w->plan.flags == flags;
  w->plan.set = 0;
  if (rc) return rc;
  memset(&w->stats, 0, sizeof w->stats);
  w->stats.total_s = amber__now(); /* start time until run_save ends */
  latest_view l = {0}; /* the store is read once, whatever this save must learn from it */
  rc = prepare(w, NULL, &l);
  if (!rc) {
    resolve_policies(w);
    w->delta = planned ? w->plan.delta : !want_full(w, flags, &l);
  }
  amber_reader_close(l.r);
  if (!rc) rc = check_selections(w, step);
  for (size_t i = 0; i < w->dc.n; i++) w->dc.d[i].sel_ready = 0; /* a save consumes them */
  if (rc) return rc;
  amber__saver_arm(&w->saver);
  w->ref.keep = w->delta || !(flags & AMBER_SAVE_NO_REFERENCE);
  if (w->ref.keep && (rc = ensure_ref(w)) != 0) return rc;
  if ((w->delta || (w->opts.flags & AMBER_WRITER_COMPRESS_FULL)) && (rc = ensure_scratch(w, 0)) != 0)
    return rc;
  return 0;
}

/* Retention after a commit: the store keeps the newest keep_last checkpoints and
 * what they need. A failure leaves the save committed; it is kept for
 * amber_writer_prune_status and the next save's prune tries again. */
static void prune(amber_writer *w) {
  w->pruned = 0;
  w->prune_rc = amber__store_prune(w->st, &w->prune_err, w->opts.keep_last, &w->pruned);
}

/* Writes and commits the save that start_save set up. */
static int run_save(amber_writer *w, uint64_t step) {
  double t_start = w->stats.total_s;
  char tmp[4200] = "", dst[4200];
  amber__ckpt_path(w->st, step, NULL, dst, sizeof dst);
  uint64_t state = 0, bytes = 0;
  /* From here the reference is being moved: it is valid again only on success. */
  w->ref.valid = 0;
  w->stats.prepare_s = amber__now() - t_start;
  int rc = write_file(w, dst, tmp, step, &state, &bytes);
  amber__saver_scanned(&w->saver); /* also when write_file failed early */
  if (!rc && (rc = amber__saver_await_verdict(&w->saver, &w->err, step)) != 0)
    unlink(tmp); /* durable, never visible */
  double t_commit = amber__now();
  if (!rc) rc = amber__commit_file(w->st, &w->err, tmp, step);
  if (!rc && (rc = amber__write_latest(w->st, &w->err, step, state)) != 0)
    unlink(dst); /* never committed; keep the store as it was */
  if (rc) return rc;
  w->stats.commit_s = amber__now() - t_commit;
  w->stats.total_s = amber__now() - t_start;
  w->stats.delta = w->delta;
  w->stats.bytes = bytes;
  w->ref.valid = w->ref.keep;
  w->have_latest = 1;
  w->latest_step = step;
  w->latest_state = state;
  amber__cadence_record(&w->cadence, w->delta, bytes);
  if (w->opts.keep_last) prune(w);
  return 0;
}

int amber_writer_prune_status(const amber_writer *w, size_t *removed, const char **message) {
  if (removed) *removed = w ? w->pruned : 0;
  if (message) *message = w && w->prune_rc ? w->prune_err.msg : NULL;
  return w ? w->prune_rc : AMBER_EINVAL;
}

int amber_writer_save(amber_writer *w, uint64_t step, uint32_t flags) {
  if (!w) return amber__fail(NULL, AMBER_EINVAL, "amber_writer_save: NULL writer");
  if (flags & AMBER_SAVE_CONFIRM)
    return amber__fail(&w->err, AMBER_EINVAL,
                       "step %" PRIu64 ": AMBER_SAVE_CONFIRM needs amber_writer_begin "
                       "(amber_writer_save cannot be confirmed)",
                       step);
  int rc = amber_writer_wait(w); /* a pending failure is reported first */
  if (rc) return rc;
  if ((rc = start_save(w, step, flags)) != 0) return rc;
  w->two_phase = 0; /* nobody waits for a fence: copy and write in one pass */
  return run_save(w, step);
}

/* ---- pre-selected tensors: the caller selects, amber encodes and commits ---- */

int amber_writer_plan(amber_writer *w, uint64_t step, uint32_t flags, uint32_t *kind) {
  if (!w || !kind) return amber__fail(NULL, AMBER_EINVAL, "amber_writer_plan: NULL argument");
  amber__save_state state = amber__saver_state(&w->saver);
  if (state != AMBER__SAVE_IDLE && state != AMBER__SAVE_DONE)
    return amber__fail(&w->err, AMBER_EBUSY,
                       "amber_writer_plan: the save of step %" PRIu64
                       " is still in progress (call amber_writer_wait first)",
                       w->saver.step);
  int rc = state == AMBER__SAVE_DONE ? amber_writer_wait(w) : 0; /* unreported failure */
  w->plan.set = 0;
  if (!rc) rc = check_request(w, step, flags);
  if (rc) return rc;
  latest_view l = {0};
  rc = prepare(w, NULL, &l);
  if (!rc) {
    resolve_policies(w);
    w->plan.delta = !want_full(w, flags, &l);
  }
  amber_reader_close(l.r);
  if (rc) return rc;
  w->plan.set = 1;
  w->plan.step = step;
  w->plan.flags = flags;
  *kind = w->plan.delta ? AMBER_KIND_DELTA : AMBER_KIND_FULL;
  return 0;
}

int amber_writer_info(const amber_writer *w, size_t index, amber_tensor_info *out) {
  if (!w || !out) return amber__fail(NULL, AMBER_EINVAL, "amber_writer_info: NULL argument");
  if (index >= w->dc.n)
    return amber__fail(NULL, AMBER_ERANGE, "tensor index %zu out of range (%zu tensors)", index,
                       w->dc.n);
  const amber__tensor *t = &w->dc.d[index].t;
  amber__tensor_info(t, out);
  return 0;
}

/* Pre-selected tensor `index` for `what` into *out; 0 or the error (in w). */
static int presel_decl(amber_writer *w, size_t index, const char *what, decl **out) {
  if (busy(w, what)) return AMBER_EBUSY;
  if (index >= w->dc.n)
    return amber__fail(&w->err, AMBER_EINVAL, "tensor index %zu out of range (%zu tensors)",
                       index, w->dc.n);
  *out = &w->dc.d[index];
  if (!(*out)->presel)
    return amber__fail(&w->err, AMBER_EINVAL,
                       "tensor '%s' is not pre-selected (declared with amber_writer_add)",
                       (*out)->t.name);
  return 0;
}

int amber_writer_set_selection(amber_writer *w, size_t index, const amber_chunk_sel *chunks,
                               uint64_t nchunks) {
  if (!w || (nchunks && !chunks))
    return amber__fail(NULL, AMBER_EINVAL, "amber_writer_set_selection: NULL argument");
  decl *d = NULL;
  int rc = presel_decl(w, index, "amber_writer_set_selection", &d);
  if (rc) return rc;
  if (!w->dc.frozen)
    return amber__fail(&w->err, AMBER_EINVAL,
                       "tensor '%s': call amber_writer_plan first (it fixes the chunking)",
                       d->t.name);
  if (nchunks != d->t.n_chunks)
    return amber__fail(&w->err, AMBER_EINVAL,
                       "tensor '%s' has %" PRIu64 " chunks of %" PRIu64
                       " elements, but %" PRIu64 " selections were given",
                       d->t.name, d->t.n_chunks, d->t.chunk_elems, nchunks);
  char why[AMBER__ERRLEN];
  for (uint64_t j = 0; j < nchunks; j++)
    if (bad_sel(d, j, &chunks[j], 0, why, sizeof why))
      return amber__fail(&w->err, AMBER_EINVAL, "%s", why);
  if (!d->sel && !(d->sel = malloc((size_t)(nchunks ? nchunks : 1) * sizeof *d->sel)))
    return amber__fail(&w->err, AMBER_ENOMEM, "out of memory");
  if (nchunks) memcpy(d->sel, chunks, (size_t)nchunks * sizeof *d->sel);
  d->sel_ready = 1;
  return 0;
}

int amber_writer_set_source(amber_writer *w, size_t index, amber_chunk_source fn, void *user) {
  if (!w) return amber__fail(NULL, AMBER_EINVAL, "amber_writer_set_source: NULL writer");
  decl *d = NULL;
  int rc = presel_decl(w, index, "amber_writer_set_source", &d);
  if (rc) return rc;
  d->src = fn;
  d->src_user = fn ? user : NULL;
  return 0;
}

/* ---- the asynchronous save (saver.c runs its life cycle) ---- */

/* The save thread's work: the save that begin set up. */
static int run_begun(void *ctx, uint64_t step) {
  return run_save(ctx, step);
}

int amber_writer_begin(amber_writer *w, uint64_t step, uint32_t flags) {
  if (!w) return amber__fail(NULL, AMBER_EINVAL, "amber_writer_begin: NULL writer");
  amber__save_state state = amber__saver_state(&w->saver);
  if (state != AMBER__SAVE_IDLE && state != AMBER__SAVE_DONE)
    return amber__fail(&w->err, AMBER_EBUSY,
                       "step %" PRIu64 ": the save of step %" PRIu64
                       " is still in progress (call amber_writer_wait first)",
                       step, w->saver.step);
  if (state == AMBER__SAVE_DONE) { /* unreported: a failure is returned, nothing starts */
    int rc = amber_writer_wait(w);
    if (rc) return rc;
  }
  int rc = amber__saver_start(&w->saver, &w->err);
  if (!rc) rc = start_save(w, step, flags);
  if (rc) return rc;
  w->two_phase = 1;
  amber__saver_submit(&w->saver, step, (flags & AMBER_SAVE_CONFIRM) != 0);
  return 0;
}

int amber_writer_cancel(amber_writer *w) {
  if (!w) return amber__fail(NULL, AMBER_EINVAL, "amber_writer_cancel: NULL writer");
  amber__saver_cancel(&w->saver);
  return amber_writer_wait(w);
}

int amber_writer_confirm(amber_writer *w, int ok, const char *why) {
  if (!w) return amber__fail(NULL, AMBER_EINVAL, "amber_writer_confirm: NULL writer");
  int job;
  if (!amber__saver_confirm(&w->saver, ok, why, &job))
    return job ? amber__fail(&w->err, AMBER_EINVAL,
                             "amber_writer_confirm: the save of step %" PRIu64
                             " awaits no verdict (begun without AMBER_SAVE_CONFIRM, or "
                             "already confirmed)",
                             w->saver.step)
               : amber__fail(&w->err, AMBER_EINVAL,
                             "amber_writer_confirm: no save is in progress");
  return 0;
}

int amber_writer_fence(amber_writer *w) {
  if (!w) return amber__fail(NULL, AMBER_EINVAL, "amber_writer_fence: NULL writer");
  amber__saver_fence(&w->saver);
  return 0;
}

int amber_writer_wait(amber_writer *w) {
  if (!w) return amber__fail(NULL, AMBER_EINVAL, "amber_writer_wait: NULL writer");
  int rc = amber__saver_wait(&w->saver);
  if (rc) /* the message was written by the save thread: give it to this thread too */
    amber__fail(&w->err, rc, "%s", w->err.msg);
  return rc;
}

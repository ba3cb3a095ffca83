/*
 * reader.c - restoring and verifying a checkpoint.
 *
 * Opening step N opens its file and, for a delta, every file back to the nearest
 * full checkpoint, checking each link (parent step and state id) and that every
 * delta describes the same tensors as its parent. Reading a tensor restores it
 * from the full checkpoint and applies the deltas in order; every payload's
 * checksum is checked before its bytes are used.
 */
#include <inttypes.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ckpt.h"
#include "codec.h"
#include "format.h"
#include "internal.h"
#include "names.h"
#include "pool.h"
#include "store.h"

/* What one worker needs to load and decode chunks. */
typedef struct rctx {
  amber__err err;
  amber__stage stage;
  uint8_t *scratch; /* decompressed payloads */
  size_t scratch_cap;
  void *dctx;
  uint8_t *buf; /* one restored chunk: verify, and chunks copied in part */
  size_t buf_cap;
} rctx;

/* A job of a parallel restore: chunk `chunk` of tensor `tensor` of reader `r`,
 * restored straight into `dst` (its exact place), or, with dst NULL, into the
 * worker's buffer and then, with `part`, the part's share copied out of it (with
 * neither: decoded and checked only, as verify does). */
typedef struct rjob {
  amber_reader *r;
  size_t tensor;
  uint64_t chunk;
  uint8_t *dst;
  const amber__part *part;
} rjob;

struct amber__rpool {
  amber__pool *pool;
  rctx *ctx; /* one per worker */
  rjob *jobs;
  size_t njobs, jobs_cap;
  size_t base; /* the loop in progress runs jobs[base ..] */
  amber__need *need; /* an object store's window: the payloads it fetches ahead */
  size_t need_cap;
  struct fetch { amber__ckpt *c; size_t i; } *fetch;
  size_t nfetch, fetch_cap;
  pthread_mutex_t mu;
  int rc; /* first failure of the loop in progress */
  amber__err err;
};

struct amber_reader {
  amber__err err;
  amber_store *st;
  amber__ckpt *chain; /* chain[0] is the full checkpoint, chain[n-1] the step read */
  size_t nchain;
  amber__rpool *rp;   /* made by the first read or verify */
  size_t skipped; /* AMBER_READER_FALLBACK: damaged newer steps passed over */
  amber__names names; /* name -> position in the opened step */
  int advised;        /* the deltas' pages were asked for (readahead) */
  amber__part *parts; /* the boxes of a read, kept between reads */
  size_t parts_cap;
  int imaged;         /* chain[0] is the store's image (take_image) */
};

static const amber__ckpt *target(const amber_reader *r) {
  return &r->chain[r->nchain - 1];
}

static const char *tensor_name(const void *ctx, size_t pos, size_t *len) {
  const amber__index *ix = ctx;
  *len = ix->tensors[pos].name_len;
  return ix->tensors[pos].name;
}

void amber_reader_opts_init(amber_reader_opts *opts) {
  memset(opts, 0, sizeof *opts);
}

/* A delta must describe exactly its parent's tensors. */
static int same_layout(amber__err *e, const amber__ckpt *child, const amber__ckpt *parent) {
  const amber__index *a = &child->ix, *b = &parent->ix;
  if (a->n_tensors != b->n_tensors || a->n_chunks != b->n_chunks)
    return amber__fail(e, AMBER_ECORRUPT, "%s: delta has %" PRIu64 " tensors, its parent %s has %"
                       PRIu64, child->path, a->n_tensors, parent->path, b->n_tensors);
  for (uint64_t i = 0; i < a->n_tensors; i++) {
    const amber__tensor *x = &a->tensors[i], *y = &b->tensors[i];
    if (x->name_len != y->name_len || memcmp(x->name, y->name, x->name_len) ||
        x->dtype != y->dtype || x->ndim != y->ndim || x->chunk_elems != y->chunk_elems ||
        memcmp(x->shape, y->shape, sizeof x->shape[0] * x->ndim))
      return amber__fail(e, AMBER_ECORRUPT,
                         "%s: tensor '%s' of the delta does not match its parent %s", child->path,
                         x->name, parent->path);
  }
  return 0;
}

static int open_chain(amber_reader **out, amber_store *st, uint64_t step, uint64_t state,
                      const char *who, int files);

static int open_one(amber_reader **out, amber_store *st, uint64_t step, int files) {
  return open_chain(out, st, step, 0, NULL, files);
}

int amber__reader_open_at(amber_reader **out, amber_store *st, uint64_t step, uint64_t state,
                          const char *who) {
  *out = NULL;
  return open_chain(out, st, step, state, who ? who : "its caller", 0);
}

int amber__reader_open_files(amber_reader **out, amber_store *st, uint64_t step,
                             uint64_t state) {
  *out = NULL;
  return open_chain(out, st, step, state, "LATEST", 1);
}

size_t amber_reader_skipped(const amber_reader *r) {
  return r ? r->skipped : 0;
}

int amber_reader_open(amber_reader **out, amber_store *st, uint64_t step,
                      const amber_reader_opts *opts) {
  if (!out || !st) return amber__fail(NULL, AMBER_EINVAL, "amber_reader_open: NULL argument");
  *out = NULL;
  if (opts) {
    for (int i = 0; i < 6; i++)
      if (opts->reserved[i] || opts->reserved0)
        return amber__fail(NULL, AMBER_EINVAL, "amber_reader_open: reserved option set");
    if (opts->flags & ~(AMBER_READER_FALLBACK | AMBER_READER_FILES))
      return amber__fail(NULL, AMBER_EINVAL, "amber_reader_open: unknown flags 0x%x",
                         opts->flags);
  }
  int files = opts && (opts->flags & AMBER_READER_FILES);
  if (!opts || !(opts->flags & AMBER_READER_FALLBACK)) return open_one(out, st, step, files);
  /* Fallback: the newest step <= the requested one that opens and verifies. */
  amber_ckpt_info *info = NULL;
  size_t n = 0, skipped = 0;
  int rc = amber__store_list(st, NULL, &info, &n);
  if (rc) return rc;
  char first[AMBER__ERRLEN] = "";
  uint64_t first_step = 0;
  rc = AMBER_ENOENT;
  for (size_t i = n; i-- > 0;) {
    if (step != AMBER_LATEST && info[i].step > step) continue;
    amber_reader *r = NULL;
    rc = open_one(&r, st, info[i].step, files);
    if (!rc) rc = amber_reader_verify(r);
    if (rc && r && r->imaged) { /* a damaged image: the step's own files may be whole */
      amber_reader_close(r);
      r = NULL;
      rc = open_one(&r, st, info[i].step, 1);
      if (!rc) rc = amber_reader_verify(r);
    }
    if (!rc) {
      r->skipped = skipped;
      if (skipped)
        amber__fail(&r->err, 0,
                    "step %" PRIu64 " is damaged (%s); restored step %" PRIu64
                    ", the newest intact one",
                    first_step, first, info[i].step);
      *out = r;
      break;
    }
    if (!skipped++) {
      snprintf(first, sizeof first, "%s", amber_last_error(NULL));
      first_step = info[i].step;
    }
    amber_reader_close(r);
  }
  amber_free(info);
  if (rc && skipped)
    rc = amber__fail(NULL, rc, "no intact checkpoint: step %" PRIu64 " is damaged (%s), and %zu "
                     "older ones too", first_step, first, skipped - 1);
  else if (rc)
    rc = amber__fail(NULL, rc, "store %s has no committed checkpoint", st->path);
  return rc;
}

/* Opens the chain of `step`. `who` NULL: the step is checked against LATEST (and
 * its file against LATEST's state id when it is LATEST's step); else `who` names
 * what gives `state`, which the step's file must carry, and LATEST is not read. */
/* A delta file `c` whose step the store's image holds (same step, same state id,
 * same tensors): the image, opened shared, takes its place in the chain and ends
 * it. 1 when it did; 0 leaves `c` (no image, one of another step, one the drain is
 * rewriting, or a damaged one: the files serve the step). */
static int take_image(amber_store *st, amber__ckpt *c) {
  if (st->s3 || c->hdr.kind == AMBER_KIND_FULL) return 0;
  char path[4200];
  amber__image_path(st->path, path, sizeof path);
  amber__ckpt img;
  amber__err quiet;
  if (access(path, F_OK) != 0 || amber__ckpt_open_file(&quiet, path, AMBER__OPEN_SHARED, &img))
    return 0;
  if (img.hdr.kind != AMBER_KIND_FULL || img.hdr.step != c->hdr.step ||
      img.ftr.state_id != c->ftr.state_id || same_layout(&quiet, c, &img)) {
    amber__ckpt_close(&img);
    return 0;
  }
  amber__ckpt_close(c);
  *c = img;
  return 1;
}

static int open_chain(amber_reader **out, amber_store *st, uint64_t step, uint64_t state,
                      const char *who, int files) {
  amber_reader *r = calloc(1, sizeof *r);
  if (!r) return amber__fail(NULL, AMBER_ENOMEM, "out of memory");
  r->st = st;
  int rc = 0, check_state = 1;
  uint64_t want_state = state;
  if (!who) {
    uint64_t latest, latest_state;
    rc = amber__store_state(st, &r->err, &latest, &latest_state);
    if (!rc && step == AMBER_LATEST) step = latest;
    if (!rc && step > latest)
      rc = amber__fail(&r->err, AMBER_ENOENT,
                       "step %" PRIu64 " is not committed in %s (latest is %" PRIu64 ")", step,
                       st->path, latest);
    want_state = step == latest ? latest_state : 0;
    check_state = step == latest;
    who = "LATEST";
  }
  /* Walk back to the full checkpoint; the chain is built newest first. */
  size_t cap = 0;
  while (!rc) {
    if (r->nchain == cap) {
      cap = cap ? 2 * cap : 8;
      amber__ckpt *grown = realloc(r->chain, cap * sizeof *grown);
      if (!grown) {
        rc = amber__fail(&r->err, AMBER_ENOMEM, "out of memory");
        break;
      }
      r->chain = grown;
    }
    amber__ckpt *c = &r->chain[r->nchain];
    if ((rc = amber__ckpt_open(&r->err, st, step, c)) != 0) break;
    r->nchain++;
    if (check_state && c->ftr.state_id != want_state) {
      rc = amber__fail(&r->err, r->nchain == 1 ? AMBER_ECORRUPT : AMBER_EPARENT,
                       "%s: state id %016" PRIx64 " differs from the %016" PRIx64
                       " that %s names",
                       c->path, c->ftr.state_id, want_state,
                       r->nchain == 1 ? who : r->chain[r->nchain - 2].path);
      break;
    }
    if (!files && take_image(st, c)) r->imaged = 1;
    if (r->nchain > 1 && (rc = same_layout(&r->err, &r->chain[r->nchain - 2], c)) != 0) break;
    if (c->hdr.kind == AMBER_KIND_FULL) break;
    step = c->hdr.parent_step;
    want_state = c->hdr.parent_state;
    check_state = 1;
  }
  if (rc == AMBER_ENOENT && r->nchain > 0)
    rc = amber__fail(&r->err, AMBER_EPARENT, "%s: parent step %" PRIu64 " is missing",
                     r->chain[r->nchain - 1].path, step);
  if (rc) {
    amber_reader_close(r);
    return rc;
  }
  for (size_t i = 0; i < r->nchain / 2; i++) { /* oldest first */
    amber__ckpt t = r->chain[i];
    r->chain[i] = r->chain[r->nchain - 1 - i];
    r->chain[r->nchain - 1 - i] = t;
  }
  const amber__index *ix = &target(r)->ix;
  for (uint64_t i = 0; i < ix->n_tensors; i++)
    if (amber__names_insert(&r->names, ix->tensors[i].name, ix->tensors[i].name_len, (size_t)i,
                            tensor_name, ix) < 0) {
      amber_reader_close(r);
      return amber__fail(NULL, AMBER_ENOMEM, "out of memory");
    }
  *out = r;
  return 0;
}

void amber_reader_close(amber_reader *r) {
  if (!r) return;
  for (size_t i = 0; i < r->nchain; i++) amber__ckpt_close(&r->chain[i]);
  free(r->chain);
  free(r->parts);
  amber__rpool_destroy(r->rp);
  amber__names_free(&r->names);
  free(r);
}

/* ---- the worker pool of restores ---- */

int amber__rpool_create(amber__rpool **out, uint32_t threads) {
  *out = NULL;
  amber__rpool *p = calloc(1, sizeof *p);
  if (!p) return AMBER_ENOMEM;
  /* A restore mostly waits on the disk: with as many threads as cores, too few
   * reads are in flight (torch_bench's load, 2 cores: 1.0-1.3 s with 2 threads,
   * 0.55-0.9 s with 4, no better with 6 or 8). */
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  int n = threads ? (int)threads : cpus < 4 ? 4 : cpus > 64 ? 64 : (int)cpus;
  pthread_mutex_init(&p->mu, NULL);
  if (amber__pool_create(&p->pool, n) != 0 ||
      !(p->ctx = calloc((size_t)amber__pool_size(p->pool), sizeof *p->ctx))) {
    amber__rpool_destroy(p);
    return AMBER_ENOMEM;
  }
  *out = p;
  return 0;
}

void amber__rpool_destroy(amber__rpool *p) {
  if (!p) return;
  if (p->ctx)
    for (int i = 0; i < amber__pool_size(p->pool); i++) {
      amber__stage_free(&p->ctx[i].stage);
      free(p->ctx[i].scratch);
      free(p->ctx[i].buf);
      amber__zstd_dctx_free(p->ctx[i].dctx);
    }
  free(p->ctx);
  free(p->jobs);
  free(p->need);
  free(p->fetch);
  amber__pool_destroy(p->pool);
  pthread_mutex_destroy(&p->mu);
  free(p);
}

/* The reader's own pool, made at its first read (a rank's reader inside a global
 * reader never needs one: the global reader's pool runs its jobs). */
static int own_pool(amber_reader *r) {
  if (!r->rp && amber__rpool_create(&r->rp, r->st->threads ? r->st->threads
                                            : r->st->s3   ? AMBER__S3_READ_THREADS
                                                          : 0) != 0)
    return amber__fail(&r->err, AMBER_ENOMEM, "out of memory");
  return 0;
}


amber__index *amber__reader_index(amber_reader *r) {
  return &r->chain[r->nchain - 1].ix;
}

void amber__reader_chain_bytes(amber_reader *r, uint64_t *full_bytes, uint64_t *deltas,
                               uint64_t *delta_bytes) {
  *full_bytes = r->chain[0].size;
  *deltas = r->nchain - 1;
  *delta_bytes = 0;
  for (size_t k = 1; k < r->nchain; k++) *delta_bytes += r->chain[k].size;
}

uint64_t amber_reader_step(const amber_reader *r) {
  return target(r)->hdr.step;
}

int amber_reader_ckpt_info(const amber_reader *r, amber_ckpt_info *out) {
  const amber__ckpt *c = target(r);
  memset(out, 0, sizeof *out);
  out->step = c->hdr.step;
  out->kind = c->hdr.kind;
  out->parent = c->hdr.kind == AMBER_KIND_DELTA ? c->hdr.parent_step : AMBER_NO_STEP;
  out->bytes = c->size;
  out->hash = c->ftr.state_id;
  return 0;
}

size_t amber_reader_count(const amber_reader *r) {
  return (size_t)target(r)->ix.n_tensors;
}

int amber_reader_info(const amber_reader *r, size_t index, amber_tensor_info *out) {
  const amber__index *ix = &target(r)->ix;
  if (index >= ix->n_tensors)
    return amber__fail((amber__err *)&r->err, AMBER_EINVAL, "tensor index %zu out of range",
                       index);
  const amber__tensor *t = &ix->tensors[index];
  amber__tensor_info(t, out);
  for (uint64_t j = 0; j < t->n_chunks; j++) {
    out->stored_bytes += ix->chunks[t->first_chunk + j].size;
    out->stored_elems += ix->chunks[t->first_chunk + j].stored;
  }
  return 0;
}


int amber_reader_find(const amber_reader *r, const char *name, size_t *index) {
  const amber__index *ix = &target(r)->ix;
  long pos = amber__names_find(&r->names, name, strlen(name), tensor_name, ix);
  if (pos >= 0) {
    *index = (size_t)pos;
    return 0;
  }
  return amber__fail((amber__err *)&r->err, AMBER_ENOENT, "no tensor '%s' in step %" PRIu64,
                     name, amber_reader_step(r));
}

int amber_reader_meta(const amber_reader *r, const char **json, size_t *len) {
  const amber__index *ix = &target(r)->ix;
  *json = ix->meta_size ? ix->meta : NULL;
  *len = (size_t)ix->meta_size;
  return 0;
}

static int need_scratch(rctx *r, size_t n) {
  if (!r->dctx && !(r->dctx = amber__zstd_dctx()))
    return amber__fail(&r->err, AMBER_ENOMEM, "out of memory");
  if (r->scratch_cap >= n) return 0;
  free(r->scratch);
  r->scratch_cap = 0;
  if (!(r->scratch = malloc(n ? n : 1))) return amber__fail(&r->err, AMBER_ENOMEM, "out of memory");
  r->scratch_cap = n;
  return 0;
}

/* Decodes chunk `j` of tensor `t` in file `c` onto `dst` (the chunk's bytes, already
 * holding the parent's values for a delta). `last`: nothing is applied on `dst`
 * after it (see amber__chunk_read_into's `stream`). */
static int apply_chunk(rctx *r, amber__ckpt *c, const amber__tensor *t, uint64_t j,
                       uint8_t *dst, int last) {
  const amber__chunk *ch = &c->ix.chunks[t->first_chunk + j];
  if (ch->encoding == AMBER__ENC_UNCHANGED) {
    if (c->hdr.kind == AMBER_KIND_FULL)
      return amber__fail(&r->err, AMBER_ECORRUPT, "%s: full checkpoint has an unchanged chunk",
                         c->path);
    return 0;
  }
  size_t isz = amber_dtype_size(t->dtype), n = (size_t)amber__chunk_n(t, j), bytes = n * isz;
  int rc;
  if (ch->encoding == AMBER__ENC_RAW && ch->size == bytes &&
      (rc = amber__chunk_read_into(&r->err, c, ch, dst, last)) <= 0)
    return rc;
  const uint8_t *p;
  if ((rc = amber__chunk_load(&r->err, c, ch, &r->stage, &p))) return rc;
  switch (ch->encoding) {
  case AMBER__ENC_RAW:
    memcpy(dst, p, bytes);
    return 0;
  case AMBER__ENC_SHUF_ZSTD:
    if ((rc = need_scratch(r, bytes))) return rc;
    if (amber__zstd_decompress(r->dctx, r->scratch, bytes, p, (size_t)ch->size) != 0)
      break;
    amber__unshuffle(dst, r->scratch, n, isz);
    return 0;
  case AMBER__ENC_SPARSE: {
    if (c->hdr.kind == AMBER_KIND_FULL) break;
    size_t k = (size_t)ch->stored, bound = amber__sparse_bound(n, k, isz), blen;
    bound = (bound + 3) & ~(size_t)3; /* the index scratch after it is 4-aligned */
    if ((rc = need_scratch(r, bound + k * 4))) return rc;
    if (amber__zstd_decompress_bounded(r->dctx, r->scratch, bound, p, (size_t)ch->size,
                                       &blen) != 0 ||
        amber__sparse_apply(dst, r->scratch, blen, n, k, isz,
                            (uint32_t *)(void *)(r->scratch + bound)) != 0)
      break;
    return 0;
  }
  case AMBER__ENC_QSPARSE: {
    if (c->hdr.kind == AMBER_KIND_FULL) break;
    size_t k = (size_t)ch->stored, bound = amber__qsparse_body_max(n, k, isz), blen;
    bound = (bound + 3) & ~(size_t)3; /* the index scratch after it is 4-aligned */
    if ((rc = need_scratch(r, bound + 2 * k * 4))) return rc;
    uint32_t *idx = (uint32_t *)(void *)(r->scratch + bound);
    if (amber__zstd_decompress_bounded(r->dctx, r->scratch, bound, p, (size_t)ch->size,
                                       &blen) != 0 ||
        amber__qsparse_apply(dst, r->scratch, blen, n, k, t->dtype, idx, idx + k) != 0)
      break;
    return 0;
  }
  case AMBER__ENC_XOR_ZSTD:
    if (c->hdr.kind == AMBER_KIND_FULL) break;
    if ((rc = need_scratch(r, 2 * bytes))) return rc;
    if (amber__zstd_decompress(r->dctx, r->scratch, bytes, p, (size_t)ch->size) != 0) break;
    amber__unshuffle(r->scratch + bytes, r->scratch, n, isz);
    amber__xor(dst, dst, r->scratch + bytes, bytes);
    return 0;
  default:
    if (c->hdr.kind == AMBER_KIND_FULL)
      return amber__fail(&r->err, AMBER_ECORRUPT, "%s: encoding %u is not allowed in a full "
                         "checkpoint", c->path, ch->encoding);
    return amber__fail(&r->err, AMBER_EFORMAT, "%s: unknown encoding %u", c->path,
                       ch->encoding);
  }
  return amber__fail(&r->err, AMBER_ECORRUPT,
                     "%s (step %" PRIu64 "): tensor '%s' chunk %" PRIu64 " does not decode",
                     c->path, c->hdr.step, t->name, j);
}

/* ---- one chunk applied outside a restore (the image, src/image.c) ---- */

struct amber__applier {
  rctx x;
};

int amber__applier_create(amber__applier **out) {
  return (*out = calloc(1, sizeof **out)) ? 0 : AMBER_ENOMEM;
}

void amber__applier_free(amber__applier *a) {
  if (!a) return;
  amber__stage_free(&a->x.stage);
  free(a->x.scratch);
  free(a->x.buf);
  amber__zstd_dctx_free(a->x.dctx);
  free(a);
}

int amber__applier_apply(amber__applier *a, amber__err *e, struct amber__ckpt *c,
                         size_t tensor, uint64_t j, uint8_t *dst) {
  int rc = apply_chunk(&a->x, c, &c->ix.tensors[tensor], j, dst, 0);
  if (rc) amber__fail(e, rc, "%s", a->x.err.msg);
  return rc;
}

/* ---- the parallel restore ---- */

/* Restores chunk j of tensor `tensor` of r's step into dst (its exact place), or,
 * with dst NULL, into the worker's buffer: the full checkpoint's chunk, then every
 * delta's, while the chunk is in cache. Sets *out to where it went. */
static int restore_chunk(rctx *x, amber_reader *r, size_t tensor, uint64_t j, uint8_t *dst,
                         uint8_t **out) {
  const amber__tensor *tt = &target(r)->ix.tensors[tensor];
  size_t bytes = (size_t)amber__chunk_n(tt, j) * amber_dtype_size(tt->dtype);
  int final = dst != NULL; /* the restore's place, not a buffer scattered from */
  if (!dst) {
    if (x->buf_cap < bytes) {
      free(x->buf);
      x->buf_cap = 0;
      if (!(x->buf = malloc(bytes ? bytes : 1)))
        return amber__fail(&x->err, AMBER_ENOMEM, "out of memory");
      x->buf_cap = bytes;
    }
    dst = x->buf;
  }
  *out = dst;
  for (size_t k = 0; k < r->nchain; k++) {
    amber__ckpt *c = &r->chain[k];
    int rc = apply_chunk(x, c, &c->ix.tensors[tensor], j, dst, final && k + 1 == r->nchain);
    if (rc) return rc;
  }
  return 0;
}

/* The dimension from which a part's box is contiguous: dims k..ndim-1 of the box
 * are one run of elements in the stored tensor and in the destination alike
 * (every dim after k whole in both). Row-major strides into *ss_st and *ds_st. */
static uint32_t run_dim(const amber__part *pt, uint64_t *ss_st, uint64_t *ds_st) {
  uint32_t d = pt->ndim;
  ss_st[d - 1] = ds_st[d - 1] = 1;
  for (uint32_t i = d - 1; i > 0; i--) {
    ss_st[i - 1] = ss_st[i] * (uint64_t)pt->ss[i];
    ds_st[i - 1] = ds_st[i] * (uint64_t)pt->ds[i];
  }
  uint32_t k = d - 1;
  while (k > 0 && pt->n[k] == pt->ss[k] && pt->ds[k] == pt->n[k]) k--;
  return k;
}

/* Copies the share of part `pt` that chunk [c0, c1) of its stored tensor holds,
 * restored in `buf`, to its places in the destination: run by run of the box. */
static void scatter(const amber__part *pt, const uint8_t *buf, uint64_t c0, uint64_t c1,
                    size_t esz) {
  if (pt->ndim == 0) {
    memcpy(pt->dst, buf, esz);
    return;
  }
  uint64_t ss_st[AMBER_MAX_DIMS], ds_st[AMBER_MAX_DIMS];
  uint32_t k = run_dim(pt, ss_st, ds_st);
  uint64_t runlen = (uint64_t)pt->n[k] * ss_st[k];
  uint64_t sr = k > 0 ? ss_st[k - 1] : (uint64_t)pt->ss[0] * ss_st[0]; /* a row of dims k.. */
  if (!sr || !runlen) return;
  for (uint64_t row = c0 / sr; row <= (c1 - 1) / sr; row++) {
    uint64_t rem = row, t = (uint64_t)pt->doff[k] * ds_st[k];
    int inside = 1;
    for (uint32_t d = k; d-- > 0;) {
      int64_t i = (int64_t)(rem % (uint64_t)pt->ss[d]);
      rem /= (uint64_t)pt->ss[d];
      if (i < pt->so[d] || i >= pt->so[d] + pt->n[d]) {
        inside = 0;
        break;
      }
      t += (uint64_t)(pt->doff[d] + i - pt->so[d]) * ds_st[d];
    }
    if (!inside) continue;
    uint64_t a = row * sr + (uint64_t)pt->so[k] * ss_st[k], b = a + runlen;
    uint64_t lo = a > c0 ? a : c0, hi = b < c1 ? b : c1;
    if (lo < hi) memcpy(pt->dst + (t + lo - a) * esz, buf + (lo - c0) * esz, (hi - lo) * esz);
  }
}

static int add_job(amber__rpool *p, amber__err *e, amber_reader *r, size_t tensor, uint64_t c,
                   uint8_t *dst, const amber__part *pt) {
  if (p->njobs == p->jobs_cap) {
    size_t cap = p->jobs_cap ? 2 * p->jobs_cap : 256;
    rjob *grown = realloc(p->jobs, cap * sizeof *grown);
    if (!grown) return amber__fail(e, AMBER_ENOMEM, "out of memory");
    p->jobs = grown;
    p->jobs_cap = cap;
  }
  p->jobs[p->njobs++] = (rjob){r, tensor, c, dst, pt};
  return 0;
}

/* The jobs of part `pt`: each chunk that holds part of its box, straight into the
 * destination when the chunk lies inside one run of the box, else restored aside
 * and its share copied (once per chunk, whatever runs it touches). */
static int plan_part(amber__rpool *p, amber__err *e, const amber__part *pt) {
  const amber__tensor *tt = &target(pt->r)->ix.tensors[pt->tensor];
  size_t esz = amber_dtype_size(tt->dtype);
  if (pt->ndim == 0) return tt->n_chunks ? add_job(p, e, pt->r, pt->tensor, 0, pt->dst, pt) : 0;
  for (uint32_t d = 0; d < pt->ndim; d++)
    if (pt->n[d] <= 0) return 0;
  uint64_t ss_st[AMBER_MAX_DIMS], ds_st[AMBER_MAX_DIMS];
  uint32_t k = run_dim(pt, ss_st, ds_st);
  uint64_t runlen = (uint64_t)pt->n[k] * ss_st[k], ce = tt->chunk_elems, nel = tt->nelems;
  if (!ce || !tt->n_chunks) return 0;
  uint8_t *aside = calloc((size_t)tt->n_chunks, 1);
  if (!aside) return amber__fail(e, AMBER_ENOMEM, "out of memory");
  int64_t idx[AMBER_MAX_DIMS] = {0};
  int rc = 0;
  for (;;) { /* every run: the odometer over dims 0..k-1 of the box */
    uint64_t s = (uint64_t)pt->so[k] * ss_st[k], t = (uint64_t)pt->doff[k] * ds_st[k];
    for (uint32_t d = 0; d < k; d++) {
      s += (uint64_t)(pt->so[d] + idx[d]) * ss_st[d];
      t += (uint64_t)(pt->doff[d] + idx[d]) * ds_st[d];
    }
    for (uint64_t c = s / ce; !rc && c <= (s + runlen - 1) / ce && c < tt->n_chunks; c++) {
      uint64_t c0 = c * ce, c1 = c0 + ce < nel ? c0 + ce : nel;
      if (c0 >= s && c1 <= s + runlen)
        rc = add_job(p, e, pt->r, pt->tensor, c, pt->dst + (t + c0 - s) * esz, pt);
      else
        aside[c] = 1;
    }
    int d = (int)k - 1;
    for (; d >= 0; d--) {
      if (++idx[d] < pt->n[d]) break;
      idx[d] = 0;
    }
    if (d < 0 || rc) break;
  }
  for (uint64_t c = 0; !rc && c < tt->n_chunks; c++)
    if (aside[c]) rc = add_job(p, e, pt->r, pt->tensor, c, NULL, pt);
  free(aside);
  return rc;
}

static void run_job(void *arg, int worker, size_t i) {
  amber__rpool *p = arg;
  if (__atomic_load_n(&p->rc, __ATOMIC_RELAXED)) return; /* a failure stops the rest */
  const rjob *jb = &p->jobs[p->base + i];
  rctx *x = &p->ctx[worker];
  uint8_t *at = NULL;
  int rc = restore_chunk(x, jb->r, jb->tensor, jb->chunk, jb->dst, &at);
  if (!rc && !jb->dst && jb->part) {
    const amber__tensor *tt = &target(jb->r)->ix.tensors[jb->tensor];
    uint64_t c0 = jb->chunk * tt->chunk_elems;
    scatter(jb->part, at, c0, c0 + amber__chunk_n(tt, jb->chunk), amber_dtype_size(tt->dtype));
  }
  if (!rc) return;
  pthread_mutex_lock(&p->mu);
  if (!p->rc) {
    const amber__part *pt = jb->part;
    int n = 0; /* a long message is cut at the buffer's end: that is all truncation does */
    if (pt && pt->name && pt->rank >= 0)
      n = snprintf(p->err.msg, sizeof p->err.msg, "tensor '%s': rank %lld: %s", pt->name,
                   (long long)pt->rank, x->err.msg);
    else if (pt && pt->name)
      n = snprintf(p->err.msg, sizeof p->err.msg, "tensor '%s': %s", pt->name, x->err.msg);
    else
      memcpy(p->err.msg, x->err.msg, sizeof p->err.msg);
    if (n < 0) memcpy(p->err.msg, x->err.msg, sizeof p->err.msg);
    __atomic_store_n(&p->rc, rc, __ATOMIC_RELAXED);
  }
  pthread_mutex_unlock(&p->mu);
}

/* A restore reads every file of the chain chunk by chunk: the deltas' small
 * payloads, one synchronous read each, would wait on the disk ~20x per chunk.
 * Asking the kernel for the delta files up front lets it read them ahead in large
 * requests while the full checkpoint's chunks stream in. */
static void advise_deltas(amber_reader *r) {
  if (r->advised) return;
  r->advised = 1;
#ifdef POSIX_FADV_WILLNEED
  for (size_t k = 1; k < r->nchain; k++)
    if (r->chain[k].fd >= 0) posix_fadvise(r->chain[k].fd, 0, 0, POSIX_FADV_WILLNEED);
#endif
}

/* Records the first failure of a parallel loop (its message from `from`). */
static void loop_failed(amber__rpool *p, int rc, const amber__err *from) {
  pthread_mutex_lock(&p->mu);
  if (!p->rc) {
    memcpy(p->err.msg, from->msg, sizeof p->err.msg);
    __atomic_store_n(&p->rc, rc, __ATOMIC_RELAXED);
  }
  pthread_mutex_unlock(&p->mu);
}

/* ---- an object store's restore: windows of jobs, their payloads fetched ahead ----
 *
 * A ranged GET per chunk and file (a round trip each) would make a restore wait on
 * request latency, hundreds of small requests for tensors of a few KB. Instead the
 * jobs run in windows of about AHEAD_WINDOW bytes of payload: a window's payloads,
 * in every file of their chains, are fetched first, neighbours in a file together
 * (amber__ahead_plan), all spans at once on the pool's workers (each a ranged GET in
 * parallel pieces), and then its jobs decode them from memory. A box reads only the
 * chunks that hold it, plus what lies less than AMBER__AHEAD_GAP between two of them. */
#define AHEAD_WINDOW ((uint64_t)256 << 20)

static void fetch_job(void *arg, int worker, size_t i) {
  amber__rpool *p = arg;
  if (__atomic_load_n(&p->rc, __ATOMIC_RELAXED)) return;
  rctx *x = &p->ctx[worker];
  int rc = amber__ahead_fetch(&x->err, p->fetch[i].c, p->fetch[i].i);
  if (rc) loop_failed(p, rc, &x->err);
}

/* The payloads of jobs [a, b) that their s3:// files hold: into p->need. */
static int window_needs(amber__rpool *p, amber__err *e, size_t a, size_t b, size_t *n) {
  *n = 0;
  for (size_t i = a; i < b; i++) {
    const rjob *jb = &p->jobs[i];
    for (size_t k = 0; k < jb->r->nchain; k++) {
      amber__ckpt *c = &jb->r->chain[k];
      const amber__chunk *ch = &c->ix.chunks[c->ix.tensors[jb->tensor].first_chunk + jb->chunk];
      if (!c->obj || !ch->size || ch->encoding == AMBER__ENC_UNCHANGED) continue;
      if (*n == p->need_cap) {
        size_t cap = p->need_cap ? 2 * p->need_cap : 256;
        amber__need *g = realloc(p->need, cap * sizeof *g);
        if (!g) return amber__fail(e, AMBER_ENOMEM, "out of memory");
        p->need = g, p->need_cap = cap;
      }
      p->need[(*n)++] = (amber__need){c, ch->offset, ch->size};
    }
  }
  return 0;
}

static uint64_t job_bytes(const rjob *jb) {
  uint64_t n = 0;
  for (size_t k = 0; k < jb->r->nchain; k++) {
    const amber__ckpt *c = &jb->r->chain[k];
    n += c->ix.chunks[c->ix.tensors[jb->tensor].first_chunk + jb->chunk].size;
  }
  return n;
}

/* Fetches the window of jobs [a, b) ahead: 0, or the first failure (in p). */
static int fetch_window(amber__rpool *p, amber__err *e, size_t a, size_t b) {
  size_t n, spans;
  int rc = window_needs(p, e, a, b, &n);
  if (!rc) rc = amber__ahead_plan(e, p->need, n, &spans);
  if (rc || !spans) return rc;
  if (spans > p->fetch_cap) {
    struct fetch *g = realloc(p->fetch, spans * sizeof *g);
    if (!g) return amber__fail(e, AMBER_ENOMEM, "out of memory");
    p->fetch = g, p->fetch_cap = spans;
  }
  p->nfetch = 0;
  for (size_t i = 0; i < n; i++) /* need is sorted by file: each file's spans once */
    if (!i || p->need[i].c != p->need[i - 1].c)
      for (size_t s = 0; s < p->need[i].c->nahead; s++)
        p->fetch[p->nfetch++] = (struct fetch){p->need[i].c, s};
  amber__pool_for(p->pool, p->nfetch, fetch_job, p);
  return p->rc;
}

/* Frees what the window of jobs [a, b) fetched ahead. */
static void drop_window(amber__rpool *p, size_t a, size_t b) {
  for (size_t i = a; i < b; i++)
    for (size_t k = 0; k < p->jobs[i].r->nchain; k++)
      amber__ahead_free(&p->jobs[i].r->chain[k]);
}

/* Runs the jobs planned into p: every worker of the pool and the caller; an object
 * store's in windows fetched ahead. */
static int run_jobs(amber__rpool *p, amber__err *e) {
  p->rc = 0;
  p->base = 0;
  int remote = 0;
  for (size_t i = 0; i < p->njobs && !remote; i++)
    remote = p->jobs[i].r->chain[0].obj != NULL;
  if (!remote) {
    amber__pool_for(p->pool, p->njobs, run_job, p);
  } else {
    for (size_t a = 0; a < p->njobs && !p->rc;) {
      size_t b = a;
      for (uint64_t bytes = 0; b < p->njobs && (b == a || bytes < AHEAD_WINDOW); b++)
        bytes += job_bytes(&p->jobs[b]);
      int rc = fetch_window(p, e, a, b);
      if (rc && !p->rc) return rc; /* planning failed (no memory): nothing fetched */
      if (!p->rc) {
        p->base = a;
        amber__pool_for(p->pool, b - a, run_job, p);
      }
      drop_window(p, a, b);
      a = b;
    }
    p->base = 0;
  }
  if (p->rc) return amber__fail(e, p->rc, "%s", p->err.msg); /* also the thread's message */
  return 0;
}

int amber__read_parts(amber__rpool *p, amber__err *e, const amber__part *parts, size_t n) {
  p->njobs = 0;
  for (size_t i = 0; i < n; i++) {
    advise_deltas(parts[i].r);
    int rc = plan_part(p, e, &parts[i]);
    if (rc) return rc;
  }
  return run_jobs(p, e);
}

/* Decodes and checks tensor `index` chunk by chunk into the workers' buffers (verify). */
static int verify_tensor(amber_reader *r, size_t index) {
  advise_deltas(r);
  amber__rpool *p = r->rp;
  p->njobs = 0;
  for (uint64_t c = 0; c < target(r)->ix.tensors[index].n_chunks; c++)
    if (add_job(p, &r->err, r, index, c, NULL, NULL)) return AMBER_ENOMEM;
  return run_jobs(p, &r->err);
}

int amber_reader_read(amber_reader *r, size_t index, void *buf, uint64_t size) {
  if (!r || (!buf && size)) return amber__fail(NULL, AMBER_EINVAL, "amber_reader_read: NULL");
  return amber_reader_read_many(r, 1, &index, &buf, &size);
}

/* Checks box `i` of a read (offsets and shape within the tensor's shape, the
 * buffer's size) and fills a part that reads it into a buffer of the box's shape. */
static int box_part(amber_reader *r, size_t index, const int64_t *off, const int64_t *shape,
                    void *buf, uint64_t size, amber__part *pt) {
  const amber__index *ix = &target(r)->ix;
  if (index >= ix->n_tensors)
    return amber__fail(&r->err, AMBER_EINVAL, "tensor index %zu out of range", index);
  const amber__tensor *tt = &ix->tensors[index];
  size_t esz = amber_dtype_size(tt->dtype);
  uint64_t want = 1;
  memset(pt, 0, sizeof *pt);
  pt->r = r;
  pt->tensor = index;
  pt->ndim = tt->ndim;
  pt->rank = -1;
  for (uint32_t d = 0; d < tt->ndim; d++) {
    int64_t o = off ? off[d] : 0, n = shape ? shape[d] : (int64_t)tt->shape[d];
    if (o < 0 || n < 0 || o > (int64_t)tt->shape[d] || n > (int64_t)tt->shape[d] - o)
      return amber__fail(&r->err, AMBER_ERANGE,
                         "tensor '%s': region outside its shape in dim %u", tt->name, d);
    pt->ss[d] = (int64_t)tt->shape[d];
    pt->so[d] = o;
    pt->n[d] = pt->ds[d] = n;
    want *= (uint64_t)n;
  }
  if (size != want * esz) {
    if (!off && !shape)
      return amber__fail(&r->err, AMBER_EINVAL, "tensor '%s' has %" PRIu64 " bytes, the buffer %" PRIu64,
                         tt->name, tt->nbytes, size);
    return amber__fail(&r->err, AMBER_EINVAL, "tensor '%s': region is %" PRIu64 " bytes, buffer %" PRIu64,
                       tt->name, want * esz, size);
  }
  if (size && !buf)
    return amber__fail(&r->err, AMBER_EINVAL, "tensor '%s': NULL buffer", tt->name);
  pt->dst = buf;
  return 0;
}

/* amber_reader_read_many and amber_reader_read_boxes: every box checked, then one
 * parallel loop over all their chunks. */
static int read_boxes(amber_reader *r, size_t count, const size_t *indices,
                      const int64_t *offsets, const int64_t *shapes, void *const *bufs,
                      const uint64_t *sizes) {
  if (count > r->parts_cap) {
    free(r->parts);
    r->parts_cap = 0;
    if (!(r->parts = malloc(count * sizeof *r->parts)))
      return amber__fail(&r->err, AMBER_ENOMEM, "out of memory");
    r->parts_cap = count;
  }
  size_t n = 0;
  for (size_t i = 0; i < count; i++) {
    int rc = box_part(r, indices[i], offsets ? offsets + i * AMBER_MAX_DIMS : NULL,
                      shapes ? shapes + i * AMBER_MAX_DIMS : NULL, bufs[i], sizes[i], &r->parts[n]);
    if (rc) return rc;
    if (sizes[i]) n++;
  }
  if (!n) return 0;
  if (own_pool(r)) return AMBER_ENOMEM;
  return amber__read_parts(r->rp, &r->err, r->parts, n);
}

int amber_reader_read_many(amber_reader *r, size_t count, const size_t *indices,
                           void *const *bufs, const uint64_t *sizes) {
  if (!r || (count && (!indices || !bufs || !sizes)))
    return amber__fail(NULL, AMBER_EINVAL, "amber_reader_read_many: NULL");
  return read_boxes(r, count, indices, NULL, NULL, bufs, sizes);
}

int amber_reader_read_boxes(amber_reader *r, size_t count, const size_t *indices,
                            const int64_t *offsets, const int64_t *shapes, void *const *bufs,
                            const uint64_t *sizes) {
  if (!r || (count && (!indices || !offsets || !shapes || !bufs || !sizes)))
    return amber__fail(NULL, AMBER_EINVAL, "amber_reader_read_boxes: NULL");
  return read_boxes(r, count, indices, offsets, shapes, bufs, sizes);
}

int amber_reader_verify(amber_reader *r) {
  if (!r) return amber__fail(NULL, AMBER_EINVAL, "amber_reader_verify: NULL reader");
  if (own_pool(r)) return AMBER_ENOMEM;
  /* Restoring every chunk into scratch memory exercises every check a restore
   * makes: checksums, frame sizes, decodability. */
  int rc = 0;
  const amber__index *ix = &target(r)->ix;
  uint64_t total = 0, done = 0;
  for (uint64_t i = 0; i < ix->n_tensors; i++) total += ix->tensors[i].nbytes;
  for (uint64_t i = 0; i < ix->n_tensors && !rc; i++) {
    rc = verify_tensor(r, (size_t)i);
    if (!rc) amber__progress("verify", done += ix->tensors[i].nbytes, total);
  }
  return rc;
}

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
  uint8_t *buf; /* verify: one restored chunk */
  size_t buf_cap;
} rctx;

struct amber_reader {
  amber__err err;
  amber_store *st;
  amber__ckpt *chain; /* chain[0] is the full checkpoint, chain[n-1] the step read */
  size_t nchain;
  amber__pool *pool;
  rctx *ctx; /* one per pool worker */
  pthread_mutex_t mu;
  int rc; /* first failure of the parallel loop in progress */
  /* the loop in progress */
  size_t tensor;
  uint8_t *dst;
  size_t skipped; /* AMBER_READER_FALLBACK: damaged newer steps passed over */
  amber__names names; /* name -> position in the opened step */
  int advised;        /* the deltas' pages were asked for (readahead) */
  /* amber_reader_read_many: job j is chunk jobs[j].chunk of tensor jobs[j].tensor */
  struct job {
    size_t tensor;
    uint64_t chunk;
    uint8_t *dst;
  } *jobs;
  size_t jobs_cap;
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

static int open_one(amber_reader **out, amber_store *st, uint64_t step);

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
    if (opts->flags & ~AMBER_READER_FALLBACK)
      return amber__fail(NULL, AMBER_EINVAL, "amber_reader_open: unknown flags 0x%x",
                         opts->flags);
  }
  if (!opts || !(opts->flags & AMBER_READER_FALLBACK)) return open_one(out, st, step);
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
    rc = open_one(&r, st, info[i].step);
    if (!rc) rc = amber_reader_verify(r);
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

static int open_one(amber_reader **out, amber_store *st, uint64_t step) {
  amber_reader *r = calloc(1, sizeof *r);
  if (!r) return amber__fail(NULL, AMBER_ENOMEM, "out of memory");
  r->st = st;
  pthread_mutex_init(&r->mu, NULL);
  /* A restore mostly waits on the disk: with as many threads as cores, too few
   * reads are in flight (torch_bench's load, 2 cores: 1.0-1.3 s with 2 threads,
   * 0.55-0.9 s with 4, no better with 6 or 8). */
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  int threads = st->threads ? (int)st->threads : cpus < 4 ? 4 : cpus > 64 ? 64 : (int)cpus;
  if (amber__pool_create(&r->pool, threads) != 0 ||
      !(r->ctx = calloc((size_t)amber__pool_size(r->pool), sizeof *r->ctx))) {
    amber_reader_close(r);
    return amber__fail(NULL, AMBER_ENOMEM, "out of memory");
  }
  uint64_t latest, latest_state;
  int rc = amber__store_state(st, &r->err, &latest, &latest_state);
  if (!rc && step == AMBER_LATEST) step = latest;
  if (!rc && step > latest)
    rc = amber__fail(&r->err, AMBER_ENOENT,
                     "step %" PRIu64 " is not committed in %s (latest is %" PRIu64 ")", step,
                     st->path, latest);
  /* Walk back to the full checkpoint; the chain is built newest first. */
  size_t cap = 0;
  uint64_t want_state = step == latest ? latest_state : 0;
  int check_state = step == latest;
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
                       r->nchain == 1 ? "LATEST" : r->chain[r->nchain - 2].path);
      break;
    }
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
  free(r->jobs);
  if (r->ctx)
    for (int i = 0; i < amber__pool_size(r->pool); i++) {
      amber__stage_free(&r->ctx[i].stage);
      free(r->ctx[i].scratch);
      free(r->ctx[i].buf);
      amber__zstd_dctx_free(r->ctx[i].dctx);
    }
  free(r->ctx);
  amber__pool_destroy(r->pool);
  amber__names_free(&r->names);
  pthread_mutex_destroy(&r->mu);
  free(r);
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
 * holding the parent's values for a delta). */
static int apply_chunk(rctx *r, amber__ckpt *c, const amber__tensor *t, uint64_t j,
                       uint8_t *dst) {
  const amber__chunk *ch = &c->ix.chunks[t->first_chunk + j];
  if (ch->encoding == AMBER__ENC_UNCHANGED) {
    if (c->hdr.kind == AMBER_KIND_FULL)
      return amber__fail(&r->err, AMBER_ECORRUPT, "%s: full checkpoint has an unchanged chunk",
                         c->path);
    return 0;
  }
  const uint8_t *p;
  int rc = amber__chunk_load(&r->err, c, ch, &r->stage, &p);
  if (rc) return rc;
  size_t isz = amber_dtype_size(t->dtype), n = (size_t)amber__chunk_n(t, j), bytes = n * isz;
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

/* Restores chunk j of the current tensor: the full checkpoint's chunk, then every
 * delta's, while the chunk is in cache. */
static void restore_chunk(amber_reader *r, int worker, size_t tensor, uint64_t j, uint8_t *dst);

static void restore_job(void *arg, int worker, size_t j) {
  amber_reader *r = arg;
  restore_chunk(r, worker, r->tensor, j, r->dst);
}

static void restore_many_job(void *arg, int worker, size_t j) {
  amber_reader *r = arg;
  restore_chunk(r, worker, r->jobs[j].tensor, r->jobs[j].chunk, r->jobs[j].dst);
}

/* Restores chunk j of tensor `tensor` of the target step into dst (the tensor's
 * buffer; NULL: decode and check only). */
static void restore_chunk(amber_reader *r, int worker, size_t tensor, uint64_t j, uint8_t *dst) {
  if (__atomic_load_n(&r->rc, __ATOMIC_RELAXED)) return;
  rctx *x = &r->ctx[worker];
  const amber__tensor *tt = &r->chain[r->nchain - 1].ix.tensors[tensor];
  size_t bytes = (size_t)amber__chunk_n(tt, j) * amber_dtype_size(tt->dtype);
  if (!dst) { /* verify: decode into the worker's buffer */
    if (x->buf_cap < bytes) {
      free(x->buf);
      x->buf_cap = 0;
      if (!(x->buf = malloc(bytes))) {
        pthread_mutex_lock(&r->mu);
        if (!r->rc) r->rc = amber__fail(&r->err, AMBER_ENOMEM, "out of memory");
        pthread_mutex_unlock(&r->mu);
        return;
      }
      x->buf_cap = bytes;
    }
    dst = x->buf;
  } else {
    dst += (size_t)(j * tt->chunk_elems) * amber_dtype_size(tt->dtype);
  }
  for (size_t k = 0; k < r->nchain; k++) {
    amber__ckpt *c = &r->chain[k];
    int rc = apply_chunk(x, c, &c->ix.tensors[tensor], j, dst);
    if (rc) {
      pthread_mutex_lock(&r->mu);
      if (!r->rc) {
        memcpy(r->err.msg, x->err.msg, sizeof r->err.msg);
        __atomic_store_n(&r->rc, rc, __ATOMIC_RELAXED);
      }
      pthread_mutex_unlock(&r->mu);
      return;
    }
  }
}

/* A restore reads every file of the chain chunk by chunk: the deltas' small
 * payloads, one synchronous read each, would wait on the disk ~20x per chunk.
 * Asking the kernel for the delta files up front lets it read them ahead in large
 * requests while the full checkpoint's chunks stream in. */
static void advise_deltas(amber_reader *r) {
  if (r->advised) return;
  r->advised = 1;
#ifdef POSIX_FADV_WILLNEED
  for (size_t k = 1; k < r->nchain; k++) posix_fadvise(r->chain[k].fd, 0, 0, POSIX_FADV_WILLNEED);
#endif
}

/* Decodes and checks tensor `index` chunk by chunk into the workers' buffers (verify). */
static int verify_tensor(amber_reader *r, size_t index) {
  advise_deltas(r);
  r->rc = 0;
  r->tensor = index;
  r->dst = NULL;
  amber__pool_for(r->pool, (size_t)r->chain[r->nchain - 1].ix.tensors[index].n_chunks,
                  restore_job, r);
  if (r->rc) amber__fail(&r->err, r->rc, "%s", r->err.msg); /* also the thread's message */
  return r->rc;
}

/* The job table of a parallel restore, kept between reads. */
static int ensure_jobs(amber_reader *r, size_t njobs) {
  if (njobs <= r->jobs_cap) return 0;
  free(r->jobs);
  r->jobs_cap = 0;
  if (!(r->jobs = malloc(njobs * sizeof *r->jobs)))
    return amber__fail(&r->err, AMBER_ENOMEM, "out of memory");
  r->jobs_cap = njobs;
  return 0;
}

int amber_reader_read(amber_reader *r, size_t index, void *buf, uint64_t size) {
  if (!r || (!buf && size)) return amber__fail(NULL, AMBER_EINVAL, "amber_reader_read: NULL");
  return amber_reader_read_many(r, 1, &index, &buf, &size);
}

int amber_reader_read_many(amber_reader *r, size_t count, const size_t *indices,
                           void *const *bufs, const uint64_t *sizes) {
  if (!r || (count && (!indices || !bufs || !sizes)))
    return amber__fail(NULL, AMBER_EINVAL, "amber_reader_read_many: NULL");
  const amber__index *ix = &target(r)->ix;
  size_t njobs = 0;
  for (size_t i = 0; i < count; i++) {
    if (indices[i] >= ix->n_tensors)
      return amber__fail(&r->err, AMBER_EINVAL, "tensor index %zu out of range", indices[i]);
    const amber__tensor *tt = &ix->tensors[indices[i]];
    if (sizes[i] != tt->nbytes)
      return amber__fail(&r->err, AMBER_EINVAL,
                         "tensor '%s' has %" PRIu64 " bytes, the buffer %" PRIu64, tt->name,
                         tt->nbytes, sizes[i]);
    if (sizes[i] && !bufs[i])
      return amber__fail(&r->err, AMBER_EINVAL, "tensor '%s': NULL buffer", tt->name);
    if (sizes[i]) njobs += (size_t)tt->n_chunks;
  }
  if (ensure_jobs(r, njobs)) return AMBER_ENOMEM;
  size_t j = 0;
  for (size_t i = 0; i < count; i++) {
    if (!sizes[i]) continue;
    for (uint64_t c = 0; c < ix->tensors[indices[i]].n_chunks; c++) {
      r->jobs[j].tensor = indices[i];
      r->jobs[j].chunk = c;
      r->jobs[j].dst = bufs[i]; /* the tensor's start: restore_chunk adds the offset */
      j++;
    }
  }
  advise_deltas(r);
  r->rc = 0;
  amber__pool_for(r->pool, njobs, restore_many_job, r);
  if (r->rc) amber__fail(&r->err, r->rc, "%s", r->err.msg);
  return r->rc;
}

int amber__reader_read_chunks(amber_reader *r, size_t index, const uint8_t *want, void *buf,
                              uint64_t size) {
  const amber__index *ix = &target(r)->ix;
  if (index >= ix->n_tensors)
    return amber__fail(&r->err, AMBER_EINVAL, "tensor index %zu out of range", index);
  const amber__tensor *tt = &ix->tensors[index];
  if (size != tt->nbytes)
    return amber__fail(&r->err, AMBER_EINVAL, "tensor '%s' has %" PRIu64 " bytes, the buffer %" PRIu64,
                       tt->name, tt->nbytes, size);
  size_t njobs = 0;
  for (uint64_t c = 0; c < tt->n_chunks; c++) njobs += want[c] != 0;
  if (!njobs) return 0;
  if (ensure_jobs(r, njobs)) return AMBER_ENOMEM;
  size_t j = 0;
  for (uint64_t c = 0; c < tt->n_chunks; c++)
    if (want[c]) r->jobs[j++] = (struct job){index, c, buf};
  advise_deltas(r);
  r->rc = 0;
  amber__pool_for(r->pool, njobs, restore_many_job, r);
  if (r->rc) amber__fail(&r->err, r->rc, "%s", r->err.msg);
  return r->rc;
}

int amber_reader_verify(amber_reader *r) {
  if (!r) return amber__fail(NULL, AMBER_EINVAL, "amber_reader_verify: NULL reader");
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

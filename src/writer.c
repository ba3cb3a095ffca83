/*
 * writer.c - the writer: tensor declarations and the save of a checkpoint.
 *
 * A save streams header, chunk payloads, index and footer through one reused
 * amber__wfile (aligned staging buffers, O_DIRECT, background write), then
 * commits: fsync, rename, fsync of the directory, LATEST. Nothing is allocated per
 * save once the first save has sized the buffers. Tensor memory is read during
 * amber_writer_save only.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack: no allocation per chunk */
#include <xxhash.h>

#include "codec.h"
#include "internal.h"
#include "policy.h"

#define DEFAULT_CHUNK_ELEMS (UINT64_C(1) << 20)
#define STAGE_BYTES (8u << 20)

struct amber_writer {
  amber__err err;
  amber_store *st;
  amber_writer_opts opts;
  amber__tensor *tensors; /* declarations; names owned here, policies point into rules */
  const amber__rule **rule; /* the rule of each tensor at this save (NULL: exact) */
  amber__rules rules;
  const uint8_t **data;   /* host pointers, parallel to tensors */
  size_t n, cap;
  char *meta;
  size_t meta_len;
  int frozen; /* declarations are fixed after the first save */
  uint64_t n_chunks;
  amber__chunk *chunks; /* chunk table, reused by every save */
  uint8_t *ixbuf;       /* encoded index, reused */
  uint64_t ixcap;
  uint8_t *scratch, *zbuf; /* shuffle / compress buffers, reused */
  size_t scratch_cap, zcap;
  void *cctx;
  amber__wfile *wf;
  int have_latest;
  uint64_t latest_step, latest_state;
};

void amber_writer_opts_init(amber_writer_opts *opts) {
  memset(opts, 0, sizeof *opts);
}

int amber_writer_open(amber_writer **out, amber_store *st, const amber_writer_opts *opts) {
  amber_writer_opts def;
  if (!opts) {
    amber_writer_opts_init(&def);
    opts = &def;
  }
  if (!out || !st) return amber__fail(NULL, AMBER_EINVAL, "amber_writer_open: NULL argument");
  *out = NULL;
  for (int i = 0; i < 8; i++)
    if (opts->reserved[i])
      return amber__fail(NULL, AMBER_EINVAL, "amber_writer_open: reserved option set");
  if (st->lockfd < 0)
    return amber__fail(NULL, AMBER_EREADONLY, "store %s is open read-only", st->path);
  if (st->writers)
    return amber__fail(NULL, AMBER_EBUSY, "store %s already has a writer", st->path);
  if (opts->zstd_level < -7 || opts->zstd_level > 19)
    return amber__fail(NULL, AMBER_EINVAL, "zstd level %d is out of range", opts->zstd_level);
  amber_writer *w = calloc(1, sizeof *w);
  if (!w) return amber__fail(NULL, AMBER_ENOMEM, "out of memory");
  w->st = st;
  w->opts = *opts;
  if (!w->opts.chunk_elems) w->opts.chunk_elems = DEFAULT_CHUNK_ELEMS;
  if (!w->opts.zstd_level) w->opts.zstd_level = 1;
  int rc = amber__read_latest(st, &w->latest_step, &w->latest_state);
  if (rc == 0) {
    w->have_latest = 1;
  } else if (rc != AMBER_ENOENT) {
    amber__err_adopt(NULL);
    free(w);
    return rc;
  }
  rc = amber__wfile_create(&w->wf, STAGE_BYTES, !(opts->flags & AMBER_WRITER_NO_DIRECT_IO));
  if (rc) {
    free(w);
    return amber__fail(NULL, rc, "out of memory for the staging buffers");
  }
  st->writers++;
  *out = w;
  return 0;
}

void amber_writer_close(amber_writer *w) {
  if (!w) return;
  for (size_t i = 0; i < w->n; i++) {
    free(w->tensors[i].name);
  }
  free(w->rule);
  amber__rules_free(&w->rules);
  free(w->tensors);
  free(w->data);
  free(w->meta);
  free(w->chunks);
  free(w->ixbuf);
  free(w->scratch);
  free(w->zbuf);
  amber__zstd_cctx_free(w->cctx);
  amber__wfile_destroy(w->wf);
  w->st->writers--;
  free(w);
}

int amber_writer_add(amber_writer *w, const char *name, int dtype, uint32_t ndim,
                     const int64_t *shape, const void *data, size_t *index) {
  if (!w || !name) return amber__fail(NULL, AMBER_EINVAL, "amber_writer_add: NULL argument");
  size_t len = strlen(name);
  if (w->frozen)
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
  if (nbytes && !data) return amber__fail(&w->err, AMBER_EINVAL, "tensor '%s': no data", name);
  for (size_t i = 0; i < w->n; i++) /* declarations happen once; n^2 is fine below 1e5 */
    if (w->tensors[i].name_len == len && !memcmp(w->tensors[i].name, name, len))
      return amber__fail(&w->err, AMBER_EEXIST, "tensor '%s' is declared twice", name);
  if (w->n == w->cap) {
    size_t cap = w->cap ? 2 * w->cap : 64;
    amber__tensor *t = realloc(w->tensors, cap * sizeof *t);
    if (t) w->tensors = t;
    const uint8_t **d = realloc(w->data, cap * sizeof *d);
    if (d) w->data = d;
    const amber__rule **r = realloc(w->rule, cap * sizeof *r);
    if (r) w->rule = r;
    if (!t || !d || !r) return amber__fail(&w->err, AMBER_ENOMEM, "out of memory");
    w->cap = cap;
  }
  amber__tensor *t = &w->tensors[w->n];
  memset(t, 0, sizeof *t);
  t->name = strdup(name);
  if (!t->name) return amber__fail(&w->err, AMBER_ENOMEM, "out of memory");
  t->policy = (char *)"exact";
  t->name_len = len;
  t->dtype = dtype;
  t->ndim = ndim;
  for (uint32_t d = 0; d < ndim; d++) t->shape[d] = (uint64_t)shape[d];
  t->nelems = nelems;
  t->nbytes = nbytes;
  t->chunk_elems = w->opts.chunk_elems;
  t->n_chunks = nelems / t->chunk_elems + (nelems % t->chunk_elems != 0);
  t->first_chunk = w->n_chunks;
  w->n_chunks += t->n_chunks;
  w->data[w->n] = data;
  if (index) *index = w->n;
  w->n++;
  return 0;
}

int amber_writer_set_data(amber_writer *w, size_t index, const void *data) {
  if (!w) return amber__fail(NULL, AMBER_EINVAL, "amber_writer_set_data: NULL writer");
  if (index >= w->n)
    return amber__fail(&w->err, AMBER_EINVAL, "tensor index %zu out of range (%zu tensors)",
                       index, w->n);
  if (w->tensors[index].nbytes && !data)
    return amber__fail(&w->err, AMBER_EINVAL, "tensor '%s': no data", w->tensors[index].name);
  w->data[index] = data;
  return 0;
}

int amber_writer_add_policy(amber_writer *w, const char *rule) {
  if (!w || !rule) return amber__fail(NULL, AMBER_EINVAL, "amber_writer_add_policy: NULL");
  return amber__rules_add(&w->err, &w->rules, rule);
}

/* Resolves each tensor's rule; rules may have changed since the last save. */
static void resolve_policies(amber_writer *w) {
  for (size_t i = 0; i < w->n; i++) {
    amber__tensor *t = &w->tensors[i];
    w->rule[i] = amber__rules_match(&w->rules, t->name, t->dtype);
    t->policy = w->rule[i] ? w->rule[i]->spec : (char *)"exact";
  }
}

int amber_writer_set_meta(amber_writer *w, const char *json, size_t len) {
  if (!w || (len && !json)) return amber__fail(NULL, AMBER_EINVAL, "amber_writer_set_meta: NULL");
  char *m = NULL;
  if (len) {
    if (!(m = malloc(len + 1))) return amber__fail(&w->err, AMBER_ENOMEM, "out of memory");
    memcpy(m, json, len);
    m[len] = 0;
  }
  free(w->meta);
  w->meta = m;
  w->meta_len = len;
  return 0;
}

/* Sizes the reused buffers for the declared tensors (first save only). */
static int prepare(amber_writer *w) {
  if (w->frozen) return 0;
  w->chunks = calloc(w->n_chunks ? w->n_chunks : 1, sizeof *w->chunks);
  if (!w->chunks) return amber__fail(&w->err, AMBER_ENOMEM, "out of memory for the chunk table");
  if (w->opts.flags & AMBER_WRITER_COMPRESS_FULL) {
    size_t max = 0;
    for (size_t i = 0; i < w->n; i++) {
      uint64_t cb = w->tensors[i].chunk_elems * amber_dtype_size(w->tensors[i].dtype);
      if (w->tensors[i].nbytes < cb) cb = w->tensors[i].nbytes;
      if (cb > max) max = (size_t)cb;
    }
    w->scratch_cap = max;
    w->zcap = amber__zstd_bound(max);
    w->scratch = malloc(max ? max : 1);
    w->zbuf = malloc(w->zcap);
    w->cctx = amber__zstd_cctx();
    if (!w->scratch || !w->zbuf || !w->cctx)
      return amber__fail(&w->err, AMBER_ENOMEM, "out of memory for compression buffers");
  }
  w->frozen = 1;
  return 0;
}

/* Writes one chunk of a full checkpoint and fills its index entry. */
static int put_full_chunk(amber_writer *w, const amber__tensor *t, const uint8_t *src,
                          uint64_t n, amber__chunk *c) {
  size_t isz = amber_dtype_size(t->dtype), bytes = (size_t)(n * isz);
  c->offset = amber__wfile_pos(w->wf);
  c->stored = n;
  if (w->opts.flags & AMBER_WRITER_COMPRESS_FULL) {
    size_t zlen;
    amber__shuffle(w->scratch, src, (size_t)n, isz);
    if (amber__zstd_compress(w->cctx, w->opts.zstd_level, w->zbuf, w->zcap, w->scratch, bytes,
                             &zlen) == 0 &&
        zlen < bytes) {
      c->encoding = AMBER__ENC_SHUF_ZSTD;
      c->size = zlen;
      c->checksum = amber__xxh3(w->zbuf, zlen);
      return amber__wfile_append(w->wf, w->zbuf, zlen);
    }
  }
  c->encoding = AMBER__ENC_RAW;
  c->size = bytes;
  return amber__wfile_append_hashed(w->wf, src, bytes, &c->checksum);
}

static int write_file(amber_writer *w, const char *tmp, uint64_t step, uint64_t *state) {
  amber__header h = {.format_major = AMBER_FORMAT_MAJOR,
                     .format_minor = AMBER_FORMAT_MINOR,
                     .step = step,
                     .kind = AMBER_KIND_FULL,
                     .parent_step = AMBER_NO_STEP};
  uint8_t hb[AMBER__HEADER_SIZE], fb[AMBER__FOOTER_SIZE];
  amber__header_encode(&h, hb);
  int rc = amber__wfile_begin(w->wf, &w->err, tmp);
  if (rc) return rc;
  rc = amber__wfile_append(w->wf, hb, sizeof hb);
  for (size_t i = 0; i < w->n && !rc; i++) {
    const amber__tensor *t = &w->tensors[i];
    size_t isz = amber_dtype_size(t->dtype);
    for (uint64_t j = 0; j < t->n_chunks && !rc; j++) {
      const uint8_t *src = w->data[i] + j * t->chunk_elems * isz;
      rc = put_full_chunk(w, t, src, amber__chunk_n(t, j), &w->chunks[t->first_chunk + j]);
    }
  }
  amber__index ix = {.tensors = w->tensors, .n_tensors = w->n, .chunks = w->chunks,
                     .n_chunks = w->n_chunks, .meta = w->meta, .meta_size = w->meta_len};
  uint64_t isize = amber__index_size(&ix);
  if (!rc && isize > w->ixcap) {
    free(w->ixbuf);
    w->ixcap = 0;
    if (!(w->ixbuf = malloc(isize))) rc = amber__fail(&w->err, AMBER_ENOMEM, "out of memory");
    else w->ixcap = isize;
  }
  if (!rc) {
    amber__index_encode(&ix, w->ixbuf);
    amber__footer f = {.index_offset = amber__wfile_pos(w->wf), .index_size = isize,
                       .index_checksum = amber__xxh3(w->ixbuf, isize)};
    XXH3_state_t hs;
    XXH3_INITSTATE(&hs);
    XXH3_64bits_reset(&hs);
    XXH3_64bits_update(&hs, hb, sizeof hb);
    XXH3_64bits_update(&hs, w->ixbuf, isize);
    f.content_hash = f.state_id = XXH3_64bits_digest(&hs);
    amber__footer_encode(&f, fb);
    *state = f.state_id;
    rc = amber__wfile_append(w->wf, w->ixbuf, isize);
    if (!rc) rc = amber__wfile_append(w->wf, fb, sizeof fb);
  }
  if (rc) {
    amber__wfile_abort(w->wf);
    return rc;
  }
  return amber__wfile_finish(w->wf);
}

int amber_writer_save(amber_writer *w, uint64_t step, uint32_t flags) {
  if (!w) return amber__fail(NULL, AMBER_EINVAL, "amber_writer_save: NULL writer");
  if (flags & ~AMBER_SAVE_FULL)
    return amber__fail(&w->err, AMBER_EINVAL, "amber_writer_save: unknown flags 0x%x", flags);
  if (step == AMBER_NO_STEP)
    return amber__fail(&w->err, AMBER_EINVAL, "step %" PRIu64 " is reserved", step);
  if (w->have_latest && step <= w->latest_step)
    return amber__fail(&w->err, AMBER_EEXIST,
                       "step %" PRIu64 " is not after the store's latest step %" PRIu64, step,
                       w->latest_step);
  for (size_t i = 0; i < w->n; i++)
    if (w->tensors[i].nbytes && !w->data[i])
      return amber__fail(&w->err, AMBER_EINVAL, "tensor '%s' has no data", w->tensors[i].name);
  int rc = prepare(w);
  if (rc) return rc;
  resolve_policies(w);
  char tmp[4200], dst[4200];
  amber__ckpt_path(w->st, step, ".tmp", tmp, sizeof tmp);
  amber__ckpt_path(w->st, step, NULL, dst, sizeof dst);
  uint64_t state = 0;
  rc = write_file(w, tmp, step, &state);
  if (!rc && (rc = amber__commit_file(w->st, tmp, step)) != 0) amber__err_adopt(&w->err);
  if (!rc && (rc = amber__write_latest(w->st, step, state)) != 0) {
    amber__err_adopt(&w->err);
    unlink(dst); /* never committed; keep the store as it was */
  }
  if (rc) return rc;
  w->have_latest = 1;
  w->latest_step = step;
  w->latest_state = state;
  return 0;
}

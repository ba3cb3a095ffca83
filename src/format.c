/*
 * format.c - encode and decode the fixed structures of a checkpoint file (header,
 * footer, index) exactly as docs/FORMAT.md specifies them. Decoders treat their
 * input as hostile: every count and size is checked against the bytes that are
 * there before anything is allocated from it, and every message names the file.
 */
#include <stdlib.h>
#include <string.h>

#include "format.h"
#include "internal.h"

static const uint8_t header_magic[8] = {0x89, 'A', 'M', 'B', 'R', '\r', '\n', 0x1a};
static const uint8_t end_magic[8] = {'A', 'M', 'B', 'R', 'E', 'N', 'D', 0x89};
static const uint8_t index_magic[4] = {'A', 'I', 'D', 'X'};

void amber__header_encode(const amber__header *h, uint8_t out[AMBER__HEADER_SIZE]) {
  memset(out, 0, AMBER__HEADER_SIZE);
  memcpy(out, header_magic, 8);
  amber__put16(out + 8, h->format_major);
  amber__put16(out + 10, h->format_minor);
  amber__put32(out + 12, AMBER__HEADER_SIZE);
  amber__put32(out + 16, h->required_flags);
  amber__put32(out + 20, h->optional_flags);
  amber__put64(out + 24, h->step);
  out[32] = h->kind;
  amber__put64(out + 40, h->parent_step);
  amber__put64(out + 48, h->parent_state);
  amber__put64(out + 56, amber__xxh3(out, 56));
}

int amber__header_decode(amber__err *e, const char *what, const uint8_t *in,
                         amber__header *h) {
  if (memcmp(in, header_magic, 8) != 0)
    return amber__fail(e, AMBER_ECORRUPT, "%s: not an amber checkpoint (bad magic)", what);
  if (amber__get64(in + 56) != amber__xxh3(in, 56))
    return amber__fail(e, AMBER_ECORRUPT, "%s: header checksum mismatch", what);
  h->format_major = amber__get16(in + 8);
  h->format_minor = amber__get16(in + 10);
  if (h->format_major != AMBER_FORMAT_MAJOR)
    return amber__fail(e, AMBER_EFORMAT,
                       "%s: format version %u.%u is not supported (this library reads %d.x)",
                       what, h->format_major, h->format_minor, AMBER_FORMAT_MAJOR);
  if (amber__get32(in + 12) != AMBER__HEADER_SIZE)
    return amber__fail(e, AMBER_ECORRUPT, "%s: header size %u, expected %d", what,
                       amber__get32(in + 12), AMBER__HEADER_SIZE);
  h->required_flags = amber__get32(in + 16);
  h->optional_flags = amber__get32(in + 20);
  if (h->required_flags != 0)
    return amber__fail(e, AMBER_EFORMAT,
                       "%s: unknown required feature flags 0x%08x (written by a newer amber?)",
                       what, h->required_flags);
  h->step = amber__get64(in + 24);
  h->kind = in[32];
  for (int i = 33; i < 40; i++)
    if (in[i]) return amber__fail(e, AMBER_ECORRUPT, "%s: reserved header byte %d is not zero", what, i);
  h->parent_step = amber__get64(in + 40);
  h->parent_state = amber__get64(in + 48);
  if (h->kind == AMBER_KIND_FULL) {
    if (h->parent_step != AMBER_NO_STEP || h->parent_state != 0)
      return amber__fail(e, AMBER_ECORRUPT, "%s: full checkpoint names a parent", what);
  } else if (h->kind == AMBER_KIND_DELTA) {
    if (h->parent_step >= h->step)
      return amber__fail(e, AMBER_ECORRUPT,
                         "%s: delta of step %llu names parent step %llu, which is not earlier",
                         what, (unsigned long long)h->step,
                         (unsigned long long)h->parent_step);
  } else {
    return amber__fail(e, AMBER_EFORMAT, "%s: unknown checkpoint kind %u", what, h->kind);
  }
  return 0;
}

void amber__footer_encode(const amber__footer *f, uint8_t out[AMBER__FOOTER_SIZE]) {
  amber__put64(out, f->index_offset);
  amber__put64(out + 8, f->index_size);
  amber__put64(out + 16, f->index_checksum);
  amber__put64(out + 24, f->content_hash);
  amber__put64(out + 32, f->state_id);
  amber__put64(out + 40, amber__xxh3(out, 40));
  memcpy(out + 48, end_magic, 8);
}

int amber__footer_decode(amber__err *e, const char *what, const uint8_t *in,
                         uint64_t file_size, amber__footer *f) {
  if (memcmp(in + 48, end_magic, 8) != 0)
    return amber__fail(e, AMBER_ECORRUPT,
                       "%s: no footer at the end of the file (truncated or extended?)", what);
  if (amber__get64(in + 40) != amber__xxh3(in, 40))
    return amber__fail(e, AMBER_ECORRUPT, "%s: footer checksum mismatch", what);
  f->index_offset = amber__get64(in);
  f->index_size = amber__get64(in + 8);
  f->index_checksum = amber__get64(in + 16);
  f->content_hash = amber__get64(in + 24);
  f->state_id = amber__get64(in + 32);
  uint64_t end;
  if (f->index_offset < AMBER__HEADER_SIZE ||
      amber__add_overflow(f->index_offset, f->index_size, &end) ||
      amber__add_overflow(end, AMBER__FOOTER_SIZE, &end) || end != file_size ||
      f->index_size < AMBER__INDEX_FIXED)
    return amber__fail(e, AMBER_ECORRUPT,
                       "%s: footer places the index at %llu+%llu, which does not fit a file "
                       "of %llu bytes",
                       what, (unsigned long long)f->index_offset,
                       (unsigned long long)f->index_size, (unsigned long long)file_size);
  return 0;
}

uint16_t amber__format_minor_for(const amber__tensor *t, uint64_t n) {
  uint16_t minor = 0;
  for (uint64_t i = 0; i < n; i++) {
    /* a policy with a value code ("@q4") may store QSPARSE chunks (1.3) */
    if (t[i].policy && strchr(t[i].policy, '@')) return 3;
    if (t[i].dtype == AMBER_U16 || t[i].dtype == AMBER_U32 || t[i].dtype == AMBER_U64)
      minor = 1;
  }
  return minor;
}

static uint64_t tensor_entry_size(const amber__tensor *t) {
  return AMBER__TENSOR_FIXED + 8ull * t->ndim + t->name_len + 2 + strlen(t->policy);
}

uint64_t amber__index_size(const amber__index *ix) {
  uint64_t n = AMBER__INDEX_FIXED;
  for (uint64_t i = 0; i < ix->n_tensors; i++) n += tensor_entry_size(&ix->tensors[i]);
  return n + AMBER__CHUNK_ENTRY * ix->n_chunks + ix->meta_size;
}

void amber__index_encode(const amber__index *ix, uint8_t *out) {
  memcpy(out, index_magic, 4);
  amber__put32(out + 4, 0);
  amber__put64(out + 8, ix->n_tensors);
  amber__put64(out + 16, ix->n_chunks);
  amber__put64(out + 24, ix->meta_size);
  uint8_t *p = out + AMBER__INDEX_FIXED;
  for (uint64_t i = 0; i < ix->n_tensors; i++) {
    const amber__tensor *t = &ix->tensors[i];
    size_t plen = strlen(t->policy);
    amber__put16(p, (uint16_t)t->name_len);
    p[2] = (uint8_t)t->dtype;
    p[3] = (uint8_t)t->ndim;
    amber__put32(p + 4, 0);
    amber__put64(p + 8, t->chunk_elems);
    amber__put64(p + 16, t->first_chunk);
    amber__put64(p + 24, t->n_chunks);
    p += AMBER__TENSOR_FIXED;
    for (uint32_t d = 0; d < t->ndim; d++, p += 8) amber__put64(p, t->shape[d]);
    memcpy(p, t->name, t->name_len);
    p += t->name_len;
    amber__put16(p, (uint16_t)plen);
    memcpy(p + 2, t->policy, plen);
    p += 2 + plen;
  }
  for (uint64_t j = 0; j < ix->n_chunks; j++, p += AMBER__CHUNK_ENTRY) {
    const amber__chunk *c = &ix->chunks[j];
    memset(p, 0, AMBER__CHUNK_ENTRY);
    amber__put64(p, c->offset);
    amber__put64(p + 8, c->size);
    amber__put64(p + 16, c->stored);
    p[24] = c->encoding;
    amber__put64(p + 32, c->checksum);
  }
  if (ix->meta_size) memcpy(p, ix->meta, ix->meta_size);
}

void amber__index_free(amber__index *ix) {
  if (!ix) return;
  free(ix->tensors);
  free(ix->chunks);
  free(ix->meta);
  free(ix->strings);
  memset(ix, 0, sizeof *ix);
}

/* Checks one decoded tensor entry's numbers; the caller has bounds-checked bytes. */
static int check_tensor(amber__err *e, const char *what, uint64_t i, amber__tensor *t,
                        uint64_t next_chunk, uint64_t n_chunks) {
  size_t isz = amber_dtype_size(t->dtype);
  if (!isz)
    return amber__fail(e, AMBER_EFORMAT,
                       "%s: tensor %llu has unknown dtype %d (written by a newer amber? "
                       "this library reads file format %d.%d)",
                       what, (unsigned long long)i, t->dtype, AMBER_FORMAT_MAJOR,
                       AMBER_FORMAT_MINOR);
  uint64_t n = 1;
  for (uint32_t d = 0; d < t->ndim; d++)
    if (amber__mul_overflow(n, t->shape[d], &n) || n > AMBER__MAX_BYTES)
      return amber__fail(e, AMBER_ECORRUPT, "%s: tensor %llu has an impossible shape", what,
                         (unsigned long long)i);
  if (amber__mul_overflow(n, isz, &t->nbytes) || t->nbytes > AMBER__MAX_BYTES)
    return amber__fail(e, AMBER_ECORRUPT, "%s: tensor %llu is impossibly large", what,
                       (unsigned long long)i);
  t->nelems = n;
  if (t->chunk_elems == 0 || t->chunk_elems > AMBER__MAX_CHUNK_ELEMS ||
      t->chunk_elems * isz > AMBER__MAX_CHUNK_BYTES)
    return amber__fail(e, AMBER_ECORRUPT, "%s: tensor %llu has chunk_elems %llu (1..%llu, "
                       "at most %llu bytes)", what, (unsigned long long)i,
                       (unsigned long long)t->chunk_elems,
                       (unsigned long long)AMBER__MAX_CHUNK_ELEMS,
                       (unsigned long long)AMBER__MAX_CHUNK_BYTES);
  uint64_t want = n / t->chunk_elems + (n % t->chunk_elems != 0);
  if (t->n_chunks != want || t->first_chunk != next_chunk ||
      t->n_chunks > n_chunks - next_chunk)
    return amber__fail(e, AMBER_ECORRUPT,
                       "%s: tensor %llu has an inconsistent chunk range (%llu chunks from %llu)",
                       what, (unsigned long long)i, (unsigned long long)t->n_chunks,
                       (unsigned long long)t->first_chunk);
  return 0;
}

static int check_chunk(amber__err *e, const char *what, const amber__tensor *t, uint64_t j,
                       const amber__chunk *c, uint64_t data_end) {
  uint64_t n = amber__chunk_n(t, j - t->first_chunk), end;
  if (c->encoding >= AMBER__ENC_COUNT)
    return amber__fail(e, AMBER_EFORMAT, "%s: tensor '%s' chunk %llu has unknown encoding %u",
                       what, t->name, (unsigned long long)(j - t->first_chunk), c->encoding);
  if (c->offset < AMBER__HEADER_SIZE || amber__add_overflow(c->offset, c->size, &end) ||
      end > data_end || c->stored > n)
    return amber__fail(e, AMBER_ECORRUPT,
                       "%s: tensor '%s' chunk %llu lies outside the data area or stores too "
                       "many elements",
                       what, t->name, (unsigned long long)(j - t->first_chunk));
  if (c->encoding == AMBER__ENC_RAW &&
      (c->stored != n || c->size != n * amber_dtype_size(t->dtype)))
    return amber__fail(e, AMBER_ECORRUPT, "%s: tensor '%s' chunk %llu: raw payload size %llu, "
                       "expected %llu", what, t->name,
                       (unsigned long long)(j - t->first_chunk), (unsigned long long)c->size,
                       (unsigned long long)(n * amber_dtype_size(t->dtype)));
  if (c->encoding == AMBER__ENC_UNCHANGED && (c->size != 0 || c->stored != 0))
    return amber__fail(e, AMBER_ECORRUPT, "%s: tensor '%s' chunk %llu: unchanged chunk with "
                       "a payload", what, t->name, (unsigned long long)(j - t->first_chunk));
  return 0;
}

static int cmp_name(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Names are unique within a file; sorting finds duplicates in n log n, which
 * matters for states of tens of thousands of tensors. */
static int check_unique_names(amber__err *e, const char *what, const amber__index *ix) {
  if (ix->n_tensors < 2) return 0;
  const char **names = malloc(ix->n_tensors * sizeof *names);
  if (!names) return amber__fail(e, AMBER_ENOMEM, "%s: out of memory", what);
  for (uint64_t i = 0; i < ix->n_tensors; i++) names[i] = ix->tensors[i].name;
  qsort(names, ix->n_tensors, sizeof *names, cmp_name);
  int rc = 0;
  for (uint64_t i = 1; i < ix->n_tensors && !rc; i++)
    if (!strcmp(names[i - 1], names[i]))
      rc = amber__fail(e, AMBER_ECORRUPT, "%s: tensor name '%s' appears twice", what,
                       names[i]);
  free(names);
  return rc;
}

int amber__index_decode(amber__err *e, const char *what, const uint8_t *in, uint64_t size,
                        uint64_t data_end, amber__index *ix) {
  memset(ix, 0, sizeof *ix);
  if (size < AMBER__INDEX_FIXED || memcmp(in, index_magic, 4) != 0)
    return amber__fail(e, AMBER_ECORRUPT, "%s: bad index magic", what);
  if (amber__get32(in + 4) != 0)
    return amber__fail(e, AMBER_ECORRUPT, "%s: reserved index field is not zero", what);
  uint64_t nt = amber__get64(in + 8), nc = amber__get64(in + 16), ms = amber__get64(in + 24);
  uint64_t rest = size - AMBER__INDEX_FIXED;
  /* Each tensor entry needs at least 35 bytes and each chunk 40: bound the counts
   * by what the index can hold before allocating. */
  if (nt > rest / (AMBER__TENSOR_FIXED + 3) || nc > rest / AMBER__CHUNK_ENTRY ||
      ms > rest || nc * AMBER__CHUNK_ENTRY + ms > rest)
    return amber__fail(e, AMBER_ECORRUPT,
                       "%s: index claims %llu tensors, %llu chunks and %llu metadata bytes, "
                       "more than its %llu bytes hold",
                       what, (unsigned long long)nt, (unsigned long long)nc,
                       (unsigned long long)ms, (unsigned long long)size);
  uint64_t tensor_bytes = rest - nc * AMBER__CHUNK_ENTRY - ms;
  ix->tensors = calloc(nt ? nt : 1, sizeof *ix->tensors);
  ix->chunks = calloc(nc ? nc : 1, sizeof *ix->chunks);
  ix->strings = malloc(tensor_bytes + 1); /* names + policies + NULs fit in this */
  ix->meta = malloc(ms + 1);
  if (!ix->tensors || !ix->chunks || !ix->strings || !ix->meta) {
    amber__index_free(ix);
    return amber__fail(e, AMBER_ENOMEM, "%s: out of memory for the index", what);
  }
  ix->n_tensors = nt;
  ix->n_chunks = nc;
  ix->meta_size = ms;
  const uint8_t *p = in + AMBER__INDEX_FIXED, *tend = p + tensor_bytes;
  char *s = ix->strings;
  uint64_t next_chunk = 0;
  int rc = 0;
  for (uint64_t i = 0; i < nt && !rc; i++) {
    amber__tensor *t = &ix->tensors[i];
    if ((uint64_t)(tend - p) < AMBER__TENSOR_FIXED) goto short_entry;
    t->name_len = amber__get16(p);
    t->dtype = p[2];
    t->ndim = p[3];
    t->chunk_elems = amber__get64(p + 8);
    t->first_chunk = amber__get64(p + 16);
    t->n_chunks = amber__get64(p + 24);
    if (t->ndim > AMBER_MAX_DIMS) {
      rc = amber__fail(e, AMBER_EFORMAT, "%s: tensor %llu has %u dimensions (max %d)", what,
                       (unsigned long long)i, t->ndim, AMBER_MAX_DIMS);
      break;
    }
    if (amber__get32(p + 4) != 0 || t->name_len == 0) {
      rc = amber__fail(e, AMBER_ECORRUPT, "%s: tensor %llu has a bad entry", what,
                       (unsigned long long)i);
      break;
    }
    p += AMBER__TENSOR_FIXED;
    if ((uint64_t)(tend - p) < 8ull * t->ndim + t->name_len + 2) goto short_entry;
    for (uint32_t d = 0; d < t->ndim; d++, p += 8) t->shape[d] = amber__get64(p);
    if (memchr(p, 0, t->name_len)) {
      rc = amber__fail(e, AMBER_ECORRUPT, "%s: tensor %llu has a NUL byte in its name", what,
                       (unsigned long long)i);
      break;
    }
    t->name = s;
    memcpy(s, p, t->name_len);
    s += t->name_len;
    *s++ = 0;
    p += t->name_len;
    size_t plen = amber__get16(p);
    p += 2;
    if ((uint64_t)(tend - p) < plen) goto short_entry;
    t->policy = s;
    memcpy(s, p, plen);
    s += plen;
    *s++ = 0;
    p += plen;
    rc = check_tensor(e, what, i, t, next_chunk, nc);
    next_chunk += t->n_chunks;
    continue;
  short_entry:
    rc = amber__fail(e, AMBER_ECORRUPT, "%s: index tensor entry %llu is truncated", what,
                     (unsigned long long)i);
  }
  if (!rc && (p != tend || next_chunk != nc))
    rc = amber__fail(e, AMBER_ECORRUPT,
                     "%s: index tensor table does not match its chunk table", what);
  if (!rc) rc = check_unique_names(e, what, ix);
  for (uint64_t i = 0, j = 0; i < nt && !rc; i++) {
    const amber__tensor *t = &ix->tensors[i];
    for (uint64_t k = 0; k < t->n_chunks && !rc; k++, j++, p += AMBER__CHUNK_ENTRY) {
      amber__chunk *c = &ix->chunks[j];
      c->offset = amber__get64(p);
      c->size = amber__get64(p + 8);
      c->stored = amber__get64(p + 16);
      c->encoding = p[24];
      for (int b = 25; b < 32; b++)
        if (p[b]) rc = amber__fail(e, AMBER_ECORRUPT, "%s: reserved chunk field not zero", what);
      c->checksum = amber__get64(p + 32);
      if (!rc) rc = check_chunk(e, what, t, j, c, data_end);
    }
  }
  if (!rc) {
    memcpy(ix->meta, in + size - ms, ms);
    ix->meta[ms] = 0;
  }
  if (rc) amber__index_free(ix);
  return rc;
}

void amber__tensor_info(const amber__tensor *t, amber_tensor_info *out) {
  memset(out, 0, sizeof *out);
  out->name = t->name;
  out->dtype = t->dtype;
  out->ndim = t->ndim;
  for (uint32_t d = 0; d < t->ndim; d++) out->shape[d] = (int64_t)t->shape[d];
  out->nelems = t->nelems;
  out->nbytes = t->nbytes;
  out->chunk_elems = t->chunk_elems;
  out->nchunks = t->n_chunks;
  out->policy = t->policy;
}

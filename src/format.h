/*
 * format.h - internal: the in-memory form of the on-disk structures of
 * docs/FORMAT.md (header, footer, index) and their encode/decode (src/format.c).
 */
#ifndef AMBER_FORMAT_H
#define AMBER_FORMAT_H

#include <stddef.h>
#include <stdint.h>

#include "internal.h"

#define AMBER__HEADER_SIZE 64
#define AMBER__FOOTER_SIZE 56
#define AMBER__INDEX_FIXED 32
#define AMBER__TENSOR_FIXED 32
#define AMBER__CHUNK_ENTRY 40
#define AMBER__MAX_BYTES (UINT64_C(1) << 62)
/* Chunks bound every buffer a reader allocates beyond the caller's. */
#define AMBER__MAX_CHUNK_ELEMS (UINT64_C(1) << 24)
#define AMBER__MAX_CHUNK_BYTES (UINT64_C(1) << 27)

enum {
  AMBER__ENC_RAW = 0,
  AMBER__ENC_SHUF_ZSTD = 1,
  AMBER__ENC_UNCHANGED = 2,
  AMBER__ENC_SPARSE = 3,
  AMBER__ENC_XOR_ZSTD = 4,
  AMBER__ENC_QSPARSE = 5, /* format 1.3 */
  AMBER__ENC_COUNT = 6
};

typedef struct amber__header {
  uint16_t format_major, format_minor;
  uint32_t required_flags, optional_flags;
  uint64_t step;
  uint8_t kind;
  uint64_t parent_step;
  uint64_t parent_state;
} amber__header;

typedef struct amber__footer {
  uint64_t index_offset, index_size, index_checksum, content_hash, state_id;
} amber__footer;

typedef struct amber__chunk {
  uint64_t offset, size, stored, checksum;
  uint8_t encoding;
} amber__chunk;

typedef struct amber__tensor {
  char *name; /* NUL-terminated */
  size_t name_len;
  int dtype;
  uint32_t ndim;
  uint64_t shape[AMBER_MAX_DIMS];
  uint64_t nelems, nbytes;
  uint64_t chunk_elems, first_chunk, n_chunks;
  char *policy; /* NUL-terminated, may be "" */
} amber__tensor;

typedef struct amber__index {
  amber__tensor *tensors;
  uint64_t n_tensors;
  amber__chunk *chunks;
  uint64_t n_chunks;
  char *meta; /* NUL-terminated copy */
  uint64_t meta_size;
  char *strings; /* arena that names and policies point into */
} amber__index;

/* The public description of a tensor of an index (amber_reader_info,
 * amber_writer_info): name, dtype, shape, sizes, chunking, policy; the stored_*
 * fields are left 0 for the caller. */
void amber__tensor_info(const amber__tensor *t, amber_tensor_info *out);

void amber__header_encode(const amber__header *h, uint8_t out[AMBER__HEADER_SIZE]);
/* Decodes and checks a header; `what` names the file in messages. */
int amber__header_decode(amber__err *e, const char *what, const uint8_t *in,
                         amber__header *h);
void amber__footer_encode(const amber__footer *f, uint8_t out[AMBER__FOOTER_SIZE]);
int amber__footer_decode(amber__err *e, const char *what, const uint8_t *in,
                         uint64_t file_size, amber__footer *f);

/* The format_minor a file holding these tensors records: the oldest minor that
 * describes it (FORMAT.md, "Header"), so that files without 1.1's dtypes stay 1.0. */
uint16_t amber__format_minor_for(const amber__tensor *t, uint64_t n);
/* Size in bytes of the encoded index of `ix`. */
uint64_t amber__index_size(const amber__index *ix);
/* Encodes `ix` into `out` (amber__index_size bytes). */
void amber__index_encode(const amber__index *ix, uint8_t *out);
/* Decodes and validates an index of `size` bytes; `data_end` is the offset where
 * the index starts (chunk payloads must end before it). `ix` is owned by the
 * caller on success; release with amber__index_free. */
int amber__index_decode(amber__err *e, const char *what, const uint8_t *in,
                        uint64_t size, uint64_t data_end, amber__index *ix);
void amber__index_free(amber__index *ix);

/* Number of elements in chunk `j` of `t`. */
static inline uint64_t amber__chunk_n(const amber__tensor *t, uint64_t j) {
  uint64_t start = j * t->chunk_elems;
  uint64_t left = t->nelems - start;
  return left < t->chunk_elems ? left : t->chunk_elems;
}

#endif /* AMBER_FORMAT_H */

/*
 * safetensors.h - the CLI's safetensors header code (tools/safetensors.c): parse and
 * write the header of a safetensors file. Not part of libamber: the `amber` tool,
 * the tests and the fuzz target link it from the internal amber_safetensors target.
 *
 * safetensors (https://github.com/huggingface/safetensors) is the interchange format
 * of `amber import` and `amber export`: an 8-byte little-endian header length N, N
 * bytes of UTF-8 JSON mapping tensor names to {dtype, shape, data_offsets} (plus an
 * optional "__metadata__" object of string values), then the tensor bytes. The
 * header is untrusted input: every field is validated before anything is allocated
 * or read from its description (see amber__st_parse).
 */
#ifndef AMBER_SAFETENSORS_H
#define AMBER_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "amber.h"

/* Largest header accepted: larger ones are refused before any allocation. */
#define AMBER__ST_MAX_HEADER (100u << 20)

typedef struct amber__st_tensor {
  char *name;      /* NUL-terminated UTF-8, owned by the amber__st_header */
  int dtype;       /* amber_dtype */
  uint32_t ndim;
  int64_t shape[AMBER_MAX_DIMS];
  uint64_t offset; /* absolute offset of the first byte in the file */
  uint64_t nbytes; /* = product(shape) * amber_dtype_size(dtype) */
} amber__st_tensor;

typedef struct amber__st_header {
  amber__st_tensor *tensors; /* sorted by offset; owned */
  size_t count;
  char *metadata;            /* JSON text of the "__metadata__" object, NUL-terminated, or NULL */
  size_t metadata_len;
  uint64_t data_start;       /* 8 + N: absolute offset of the data area */
} amber__st_header;

/* Parses the header of a safetensors file of `file_size` bytes whose first
 * `avail` bytes are at `buf` (avail >= 8 + N is needed; pass the whole file or at
 * least the header). Validates: N fits in the file and is <= AMBER__ST_MAX_HEADER;
 * the JSON is an object; every tensor entry has a known dtype (F64 F32 F16 BF16
 * F8_E4M3 F8_E5M2 I64 I32 I16 I8 U64 U32 U16 U8 BOOL), a shape of at most AMBER_MAX_DIMS
 * non-negative integers, data_offsets [begin, end] with begin <= end <= data size,
 * product(shape) * itemsize == end - begin without overflow; tensors do not
 * overlap; "__metadata__", if present, is an object of strings. Unknown keys in a
 * tensor entry are an error.
 * out: filled on success; release with amber__st_header_free(). On failure `out`
 * needs no release and `err` (size `errlen`) holds a message naming what is wrong.
 * Returns 0, AMBER_ECORRUPT (malformed), AMBER_EFORMAT (valid but unsupported,
 * e.g. dtype F8_E8M0 or F4, named with its tensor in `err`) or AMBER_ENOMEM. */
int amber__st_parse(const uint8_t *buf, size_t avail, uint64_t file_size,
                    amber__st_header *out, char *err, size_t errlen);

/* Reads and parses the header of the open file `fd` (of `file_size` bytes) with
 * pread; same checks and results as amber__st_parse. */
int amber__st_read_header(int fd, uint64_t file_size, amber__st_header *out, char *err,
                          size_t errlen);

void amber__st_header_free(amber__st_header *h);

/* Formats the header of a safetensors file holding `n` tensors in the given order,
 * laid out back to back: on return t[i].offset is set (absolute, i.e. including
 * 8 + N) and t[i].nbytes must already be set. `metadata` is the JSON text of an
 * object of strings to write as "__metadata__" (NULL/0 for none).
 * out/outlen: receive a malloc'ed buffer (free with free()) of the 8-byte length
 * followed by the JSON header, padded with spaces so the data starts at a multiple
 * of 8. Returns 0, AMBER_EINVAL (bad names/dtype/metadata) or AMBER_ENOMEM. */
int amber__st_format_header(amber__st_tensor *t, size_t n, const char *metadata,
                            size_t metadata_len, uint8_t **out, size_t *outlen,
                            char *err, size_t errlen);

#endif /* AMBER_SAFETENSORS_H */

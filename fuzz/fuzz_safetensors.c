/*
 * fuzz_safetensors.c - fuzz target for the safetensors header parser.
 *
 * Feeds the input as a whole file to amber__st_parse. A failure must come with a
 * message; a success must describe only tensors that lie inside the file, sorted
 * and not overlapping, with sizes that match their shapes. Every accepted header
 * must also survive amber__st_format_header and parse back to the same tensors
 * and metadata. Any violation aborts, which libFuzzer and the replay test report.
 * Built as a libFuzzer target (AMBER_FUZZ) and, with fuzz/replay.c, as a plain
 * test over tests/corpus/safetensors/.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define ASSERT(c)                                                                        \
  do {                                                                                   \
    if (!(c)) abort();                                                                   \
  } while (0)

static void check_tensor(const amber__st_header *h, const amber__st_tensor *t,
                         uint64_t file_size) {
  ASSERT(t->name && t->name[0]);
  ASSERT(t->ndim <= AMBER_MAX_DIMS);
  size_t isz = amber_dtype_size(t->dtype);
  ASSERT(isz != 0);
  uint64_t n = isz;
  for (uint32_t d = 0; d < t->ndim; d++) {
    ASSERT(t->shape[d] >= 0);
    ASSERT(!__builtin_mul_overflow(n, (uint64_t)t->shape[d], &n));
  }
  ASSERT(n == t->nbytes);
  ASSERT(t->offset >= h->data_start && t->offset <= file_size);
  ASSERT(t->nbytes <= file_size - t->offset);
}

static void check_header(const amber__st_header *h, uint64_t file_size) {
  ASSERT(h->data_start >= 8 && h->data_start <= file_size);
  ASSERT(h->count == 0 || h->tensors);
  ASSERT(!h->metadata || strlen(h->metadata) == h->metadata_len);
  const amber__st_tensor *last = NULL; /* last non-empty tensor */
  for (size_t i = 0; i < h->count; i++) {
    const amber__st_tensor *t = &h->tensors[i];
    check_tensor(h, t, file_size);
    if (i) ASSERT(h->tensors[i - 1].offset <= t->offset);
    if (!t->nbytes) continue;
    if (last) ASSERT(last->offset + last->nbytes <= t->offset);
    last = t;
  }
}

static int cmp_name(const void *a, const void *b) {
  return strcmp(((const amber__st_tensor *)a)->name, ((const amber__st_tensor *)b)->name);
}

/* Formats h's tensors back to back and parses the result: the same set of tensors
 * (order may differ among empty ones) and the same metadata must come back. */
static void check_round_trip(const amber__st_header *h) {
  char err[512];
  uint8_t *out = NULL;
  size_t outlen = 0;
  amber__st_tensor *t = malloc((h->count ? h->count : 1) * sizeof *t);
  if (!t) return;
  memcpy(t, h->tensors, h->count * sizeof *t);
  int rc = amber__st_format_header(t, h->count, h->metadata, h->metadata_len, &out,
                                   &outlen, err, sizeof err);
  if (rc == AMBER_ENOMEM) {
    free(t);
    return;
  }
  ASSERT(rc == 0 && outlen % 8 == 0);
  uint64_t file_size = outlen;
  for (size_t i = 0; i < h->count; i++) {
    ASSERT(t[i].offset == file_size);
    file_size += t[i].nbytes;
  }
  amber__st_header h2;
  rc = amber__st_parse(out, outlen, file_size, &h2, err, sizeof err);
  if (rc == AMBER_ENOMEM) {
    free(out);
    free(t);
    return;
  }
  ASSERT(rc == 0 && h2.count == h->count && h2.data_start == outlen);
  check_header(&h2, file_size);
  ASSERT((h->metadata == NULL) == (h2.metadata == NULL));
  ASSERT(!h->metadata || !strcmp(h->metadata, h2.metadata));
  qsort(t, h->count, sizeof *t, cmp_name);
  qsort(h2.tensors, h2.count, sizeof *h2.tensors, cmp_name);
  for (size_t i = 0; i < h->count; i++) {
    const amber__st_tensor *a = &t[i], *b = &h2.tensors[i];
    ASSERT(!strcmp(a->name, b->name) && a->dtype == b->dtype && a->ndim == b->ndim);
    ASSERT(a->nbytes == b->nbytes);
    ASSERT(!memcmp(a->shape, b->shape, a->ndim * sizeof a->shape[0]));
  }
  amber__st_header_free(&h2);
  free(out);
  free(t);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  amber__st_header h;
  char err[512];
  err[0] = '\0';
  int rc = amber__st_parse(data, size, size, &h, err, sizeof err);
  if (rc != 0) {
    ASSERT(rc == AMBER_ECORRUPT || rc == AMBER_EFORMAT || rc == AMBER_ENOMEM);
    ASSERT(err[0] != '\0');
    ASSERT(h.tensors == NULL && h.count == 0 && h.metadata == NULL);
    return 0;
  }
  check_header(&h, size);
  check_round_trip(&h);
  amber__st_header_free(&h);
  return 0;
}

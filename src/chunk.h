/*
 * chunk.h - internal: encoding one chunk of a save (docs/FORMAT.md, "Encodings"),
 * beside the scan (scan.c) that selects what a delta stores. A full chunk copies
 * live into the reference and stores it raw or shuffled+zstd; a delta chunk
 * scans live against the reference under the tensor's policy and stores nothing,
 * the selected elements (whole, or quantized: quant.c), their XOR, or the whole
 * chunk. Each builder appends the
 * payload to the checkpoint file being written (ckpt.c) and fills the chunk's
 * entry. Workers call them in parallel, each with its own scratch.
 */
#ifndef AMBER_CHUNK_H
#define AMBER_CHUNK_H

#include <stddef.h>
#include <stdint.h>

#include "ckpt.h"
#include "format.h"
#include "policy.h"

/* A worker's buffers, sized for the largest chunk and reused by every save. */
typedef struct amber__scratch {
  uint8_t *mem; /* one allocation that the buffers below point into */
  size_t mem_size;
  uint8_t *vals, *body, *zbuf, *xbuf, *zx;
  uint32_t *keys, *idx;
  uint8_t *qcodes; /* a quantized chunk's codes (2 bytes an element), then its steps */
  float *qsteps;
  void *cctx;
  double scan_s, encode_s; /* this save's time in each phase */
} amber__scratch;

/* Sizes the buffers for chunks of at most `max_bytes` bytes and `max_elems`
 * elements; `prefault`: their pages are faulted in now. AMBER_ENOMEM on failure
 * (release with amber__scratch_free either way). */
int amber__scratch_init(amber__scratch *s, size_t max_bytes, size_t max_elems, int prefault);
void amber__scratch_free(amber__scratch *s);

/* One chunk of a tensor, as the builders see it. */
typedef struct amber__chunk_src {
  amber__ckpt_out *out; /* the file the payload goes to */
  const char *name;     /* the tensor's, for messages */
  int dtype;
  size_t n;                  /* elements */
  const uint8_t *live;       /* the caller's memory */
  uint8_t *ref;              /* the reference's copy; NULL: a full save keeps none */
  const amber__rule *rule;   /* the tensor's policy (NULL: exact) */
  int zstd_level;            /* whole values */
  int qzstd_level;           /* quantized (QSPARSE) bodies */
  int compress;              /* full chunks: AMBER_WRITER_COMPRESS_FULL */
} amber__chunk_src;

/* Full chunk: the reference takes live (when kept) and the chunk is stored. */
void amber__chunk_full(amber__scratch *s, const amber__chunk_src *src, amber__chunk *c);
/* Delta chunk: what the policy selects from live - reference is stored and
 * moved into the reference; the rest stays in the difference. */
void amber__chunk_delta(amber__scratch *s, const amber__chunk_src *src, amber__chunk *c);
/* Copies `bytes` of live into the reference and returns the copy's xxh3, hashing
 * each slice while it is in cache: the live memory is read once. */
uint64_t amber__copy_hashed(uint8_t *ref, const uint8_t *src, size_t bytes);

#endif /* AMBER_CHUNK_H */

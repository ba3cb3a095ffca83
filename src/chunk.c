/*
 * chunk.c - the encoding of one chunk of a save (see chunk.h): the full and the
 * delta chunk builders, and the per-worker scratch they encode into. The scan
 * (scan.c) decides what a delta stores; this file decides how: which encoding of
 * docs/FORMAT.md is smallest, and what the reference takes.
 */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "xxh.h"

#include "chunk.h"
#include "codec.h"
#include "internal.h"
#include "io.h"
#include "quant.h"
#include "scan.h"

#define SLICE (256u << 10)

int amber__scratch_init(amber__scratch *s, size_t max_bytes, size_t max_elems, int prefault) {
  size_t mb = max_bytes ? max_bytes : 1, zb = amber__zstd_bound(mb + 16);
  size_t ib = max_elems * sizeof(uint32_t);
  size_t qb = 2 * max_elems + 64 + 64; /* codes, then the chunk's step */
  size_t sizes[8] = {ib, ib, mb, mb + 16, zb, mb, zb, qb}, total = 0;
  for (int k = 0; k < 8; k++) total += (sizes[k] + 63) & ~(size_t)63;
  s->mem = amber__big_alloc(total);
  s->cctx = amber__zstd_cctx();
  if (!s->mem || !s->cctx) return AMBER_ENOMEM;
  s->mem_size = total;
  if (prefault) amber__big_prefault(s->mem, total);
  uint8_t *p = s->mem, *at[8];
  for (int k = 0; k < 8; k++) {
    at[k] = p;
    p += (sizes[k] + 63) & ~(size_t)63;
  }
  s->keys = (uint32_t *)at[0];
  s->idx = (uint32_t *)at[1];
  s->vals = at[2];
  s->body = at[3];
  s->zbuf = at[4];
  s->xbuf = at[5];
  s->zx = at[6];
  s->qcodes = at[7];
  s->qsteps = (float *)(void *)(at[7] + ((2 * max_elems + 63) & ~(size_t)63));
  return 0;
}

void amber__scratch_free(amber__scratch *s) {
  amber__big_free(s->mem, s->mem_size);
  amber__zstd_cctx_free(s->cctx);
}

uint64_t amber__copy_hashed(uint8_t *ref, const uint8_t *src, size_t bytes) {
  XXH3_state_t hs;
  XXH3_INITSTATE(&hs);
  XXH3_64bits_reset(&hs);
  for (size_t o = 0; o < bytes; o += SLICE) {
    size_t k = bytes - o < SLICE ? bytes - o : SLICE;
    memcpy(ref + o, src + o, k);
    XXH3_64bits_update(&hs, ref + o, k);
  }
  return XXH3_64bits_digest(&hs);
}

/* Full chunk: copy live into the reference (hashing the copy while it is in
 * cache), then append it, raw or shuffled+zstd. */
void amber__chunk_full(amber__scratch *s, const amber__chunk_src *src, amber__chunk *c) {
  size_t isz = amber_dtype_size(src->dtype), n = src->n, bytes = n * isz;
  c->stored = n;
  if (!src->ref) { /* a one-off full save: straight from the caller's memory */
    c->encoding = AMBER__ENC_RAW;
    amber__ckpt_append_hashed(src->out, c, src->live, bytes);
    return;
  }
  uint8_t *ref = src->ref;
  if (src->compress) {
    size_t zlen;
    memcpy(ref, src->live, bytes);
    amber__shuffle(s->body, ref, n, isz);
    if (amber__zstd_compress(s->cctx, src->zstd_level, s->zbuf, amber__zstd_bound(bytes),
                             s->body, bytes, &zlen) == 0 &&
        zlen < bytes) {
      c->encoding = AMBER__ENC_SHUF_ZSTD;
      c->checksum = amber__xxh3(s->zbuf, zlen);
      amber__ckpt_append(src->out, c, s->zbuf, zlen);
      return;
    }
  } else {
    c->encoding = AMBER__ENC_RAW;
    c->checksum = amber__copy_hashed(ref, src->live, bytes);
    amber__ckpt_append(src->out, c, ref, bytes);
    return;
  }
  c->encoding = AMBER__ENC_RAW;
  c->checksum = amber__xxh3(ref, bytes);
  amber__ckpt_append(src->out, c, ref, bytes);
}

/* zstd of the delta body in s->body (blen bytes) into s->zbuf; on failure the
 * checkpoint fails (the chunk's whole size bounds what zbuf holds). */
static int compress_body(amber__scratch *s, const amber__chunk_src *src, int level, size_t bytes,
                         size_t blen, size_t *plen) {
  if (amber__zstd_compress(s->cctx, level, s->zbuf, amber__zstd_bound(bytes + 16),
                           s->body, blen, plen) == 0)
    return 0;
  char why[AMBER__ERRLEN];
  snprintf(why, sizeof why, "cannot compress a chunk of tensor '%s'", src->name);
  amber__ckpt_fail(src->out, AMBER_ENOMEM, why);
  return -1;
}

/* Where a quantized chunk's outputs go: keys and xbuf are free once the scan has
 * selected (the escapes' positions and values), the codes and step have their own. */
static amber__qbuf qbuf_of(amber__scratch *s) {
  return (amber__qbuf){.codes = s->qcodes, .steps = s->qsteps, .esc = s->keys,
                       .esc_vals = s->xbuf};
}

/* A quantized policy's chunk after its scan selected k > 0 elements (and left the
 * reference alone there, or quantized them itself: `fuse`): quantize, then store the
 * QSPARSE body when the body (before zstd) is smaller than the chunk, else the whole
 * chunk (RAW), the reference then taking every live value. The choice depends only
 * on sizes that the device path (python/amber/device.py) computes as well, not on
 * what zstd makes of the body, so that both paths store the same chunks and restore
 * the same values. */
static void quant_chunk(amber__scratch *s, const amber__chunk_src *src, const amber__policy *p,
                        size_t k, const amber__qfuse *fuse, amber__chunk *c) {
  size_t isz = amber_dtype_size(src->dtype), n = src->n, bytes = n * isz, blen = bytes, plen;
  amber__qbuf qb = qbuf_of(s);
  amber__qsel q;
  if (fuse->done)
    amber__qfuse_result(fuse, p, s->idx, k, &qb, &q);
  else
    amber__quantize(p, src->dtype, src->ref, s->idx, s->vals, k, &qb, &q);
  if (amber__qsparse_bound(n, &q, isz) <= bytes + 16) /* the body fits s->body */
    blen = amber__qsparse_encode(s->body, &q, n, isz);
  if (blen < bytes) {
    if (compress_body(s, src, src->qzstd_level, bytes, blen, &plen) != 0)
      return;
    c->encoding = AMBER__ENC_QSPARSE;
    c->checksum = amber__xxh3(s->zbuf, plen);
    amber__ckpt_append(src->out, c, s->zbuf, plen);
    return;
  }
  memcpy(src->ref, src->live, bytes);
  c->encoding = AMBER__ENC_RAW;
  c->stored = n;
  c->checksum = amber__xxh3(src->ref, bytes);
  amber__ckpt_append(src->out, c, src->ref, bytes);
}

/* Delta chunk: scan under the tensor's policy, then store nothing (UNCHANGED),
 * the selected elements (SPARSE), the XOR with the reference (exact policy, when
 * smaller), or the whole chunk (RAW, when denser than sparse pays). */
void amber__chunk_delta(amber__scratch *s, const amber__chunk_src *src, amber__chunk *c) {
  size_t isz = amber_dtype_size(src->dtype), n = src->n, bytes = n * isz;
  const amber__rule *rule = src->rule;
  amber__scan_args a = {.kind = AMBER__SCAN_EXACT, .dtype = src->dtype, .n = n,
                        .live = src->live, .ref = src->ref, .keys = s->keys,
                        .idx = s->idx, .vals = s->vals, .olds = s->xbuf};
  if (rule && rule->policy.kind == AMBER__POL_THRESHOLD) {
    a.kind = AMBER__SCAN_THRESHOLD;
    a.abs = rule->policy.abs;
    a.rel = rule->policy.rel;
    if (rule->policy.share > 0) { /* "/SHARE:MULT": at most SHARE of the chunk, at least 1 */
      a.share_k = (size_t)(rule->policy.share * (double)n);
      if (!a.share_k) a.share_k = 1;
      a.mult = rule->policy.mult;
    }
  } else if (rule && rule->policy.kind == AMBER__POL_BUDGET) {
    a.kind = AMBER__SCAN_BUDGET;
    a.cap = rule->policy.cap;
    a.budget = (size_t)(rule->policy.frac * (double)n);
    /* A chunk smaller than 1/FRAC elements (a small tensor, a tail chunk) still
     * moves one element per save: without a CAP it would otherwise never move. */
    if (!a.budget && rule->policy.frac > 0) a.budget = 1;
  }
  int quant = rule && rule->policy.qmode && a.kind != AMBER__SCAN_EXACT &&
              amber__quant_dtype(src->dtype);
  amber__qfuse fuse = {0};
  /* a share cap drops selected elements after the pass: the reference must still
   * hold their old values then */
  a.defer = quant || a.share_k;
  if (quant) {
    amber__qbuf qb = qbuf_of(s);
    if (amber__qfuse_init(&fuse, &rule->policy, src->dtype, &qb)) {
      fuse.xs = (float *)(void *)s->vals; /* n * 4 bytes each; free until the encoding */
      fuse.rs = (float *)(void *)s->body;
      a.fuse = &fuse;
    }
  }
  double t0 = amber__now();
  size_t k = amber__scan(&a);
  double t1 = amber__now();
  s->scan_s += t1 - t0;
  c->stored = k;
  if (k == 0) {
    c->encoding = AMBER__ENC_UNCHANGED;
    c->checksum = 0;
    amber__ckpt_append(src->out, c, NULL, 0);
    s->encode_s += amber__now() - t1;
    return;
  }
  if (quant) {
    quant_chunk(s, src, &rule->policy, k, &fuse, c);
    s->encode_s += amber__now() - t1;
    return;
  }
  if (a.share_k) /* whole values under a share cap: the kept ones move the reference */
    for (size_t i = 0; i < k; i++)
      memcpy((uint8_t *)src->ref + (size_t)s->idx[i] * isz, s->vals + i * isz, isz);
  /* Exact policy with dense changes: also try the XOR with the old reference,
   * rebuilt from the selected elements' old and new values. */
  size_t xlen = 0;
  if (a.kind == AMBER__SCAN_EXACT && k * 4 > n) {
    memset(s->body, 0, bytes);
    for (size_t i = 0; i < k; i++)
      for (size_t b = 0; b < isz; b++)
        s->body[(size_t)s->idx[i] * isz + b] = s->vals[i * isz + b] ^ s->xbuf[i * isz + b];
    amber__shuffle(s->zx, s->body, n, isz); /* zx is free until compression */
    memcpy(s->body, s->zx, bytes);
    if (amber__zstd_compress(s->cctx, src->zstd_level, s->zx, amber__zstd_bound(bytes),
                             s->body, bytes, &xlen) != 0)
      xlen = 0;
  }
  const uint8_t *payload;
  size_t plen;
  size_t bitmap = (n + 7) / 8;
  if (1 + bitmap + k * isz >= bytes) {
    /* Dense: the whole chunk. The reference must end up equal to what the chunk
     * restores, even if the caller broke the rule and changed live during the save:
     * so live is read once. Under the exact policy the scan has already moved the
     * reference to every value it read (the others were equal to it), so the
     * reference is the chunk, which XOR (built from the same reads) restores and
     * RAW stores. Under a threshold or budget the others take their live value
     * now, into the reference, and RAW stores the reference. */
    if (a.kind != AMBER__SCAN_EXACT) memcpy(a.ref, a.live, bytes);
    c->stored = n;
    if (xlen && xlen < bytes) {
      c->encoding = AMBER__ENC_XOR_ZSTD;
      c->stored = k;
      payload = s->zx;
      plen = xlen;
    } else {
      c->encoding = AMBER__ENC_RAW;
      payload = a.ref;
      plen = bytes;
    }
  } else {
    /* the body is at most 1 + bitmap + k * isz < bytes: it fits s->body */
    size_t blen = amber__sparse_encode(s->body, s->idx, s->vals, k, n, isz);
    if (compress_body(s, src, src->zstd_level, bytes, blen, &plen) != 0) return;
    c->encoding = AMBER__ENC_SPARSE;
    payload = s->zbuf;
    if (xlen && xlen < plen) {
      c->encoding = AMBER__ENC_XOR_ZSTD;
      payload = s->zx;
      plen = xlen;
    }
  }
  c->checksum = amber__xxh3(payload, plen);
  amber__ckpt_append(src->out, c, payload, plen);
  s->encode_s += amber__now() - t1;
}

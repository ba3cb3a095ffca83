/*
 * presel.c - the encoding of a chunk whose selection the caller made (see
 * amber_writer_set_selection): a device that keeps its own reference selects
 * under the tensor's policy and lends amber only the selected indices and
 * values. The chunk is stored with the same encodings a scanned delta uses
 * (docs/FORMAT.md, "Encodings"): UNCHANGED for nothing selected, SPARSE for a
 * selection (QSPARSE for a quantized one), RAW for a whole chunk. There is no reference here, so a dense
 * selection cannot become RAW or XOR_ZSTD as a scanned chunk's can: it
 * stays SPARSE, which restores the same values. A caller that wants the smaller
 * file hands a dense chunk over whole, as the device path does.
 */
#include <inttypes.h>
#include <stdio.h>
#include <time.h>

#include "codec.h"
#include "internal.h"
#include "presel.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The caller's indices are not trusted: an unsorted or out-of-range one would
 * write a body that does not restore what was meant (or a bitmap bit past the
 * chunk), so the save fails instead. Returns the first bad position, or k. */
static size_t first_bad_index(const uint32_t *idx, size_t k, size_t n) {
  for (size_t i = 0; i < k; i++)
    if (idx[i] >= n || (i && idx[i] <= idx[i - 1])) return i;
  return k;
}

/* A quantized selection's parts, checked before they are encoded (its indices are
 * checked by the caller); on failure the save fails naming the tensor and chunk.
 * *bound gets the largest size of its body. */
static int bad_qsel(const amber__chunk_src *src, const amber_chunk_sel *sel, uint64_t j,
                    size_t *bound) {
  const amber_chunk_qsel *q = sel->quant;
  size_t k = (size_t)sel->count, isz = amber_dtype_size(src->dtype);
  const char *bad = NULL;
  char why[AMBER__ERRLEN];
  int bf = q->mode == AMBER_QV_BF16;
  if (q->mode < AMBER_QV_Q8 || q->mode > AMBER_QV_BF16) bad = "an unknown value code";
  else if (bf ? q->group_log2 || q->rel_step != 0 : q->group_log2 > 24 || !q->steps)
    bad = bf ? "group_log2 and rel_step not 0 for bf16 codes" : "no steps, or group_log2 > 24";
  else if (!q->codes || (q->nesc && (!q->esc || !q->esc_vals)) || q->nesc > k)
    bad = "missing codes or escapes";
  for (size_t i = 0; !bad && q->mode == AMBER_QV_Q4 && i < k; i++)
    if (((const int8_t *)q->codes)[i] < -8 || ((const int8_t *)q->codes)[i] > 7)
      bad = "a 4-bit code outside -8..7";
  for (size_t e = 0; !bad && e < q->nesc; e++) {
    size_t i = q->esc[e];
    if (i >= k || (e && i <= q->esc[e - 1])) bad = "escapes not increasing below the count";
    else if (bf ? ((const uint16_t *)q->codes)[i] != 0 : ((const int8_t *)q->codes)[i] != 0)
      bad = "an escaped element with a code";
  }
  amber__qsel qs = {.k = k, .mode = (int)q->mode, .group_log2 = q->group_log2,
                    .nesc = (size_t)q->nesc};
  *bound = bad ? 0 : amber__qsparse_bound(src->n, &qs, isz);
  if (!bad && *bound > src->n * isz + 16)
    bad = "more escapes than a whole chunk holds (hand it over whole)";
  if (!bad) return 0;
  snprintf(why, sizeof why, "tensor '%s', chunk %" PRIu64 ": quantized selection with %s",
           src->name, j, bad);
  amber__ckpt_fail(src->out, AMBER_EINVAL, why);
  return 1;
}

void amber__chunk_presel(amber__scratch *s, const amber__chunk_src *src,
                         const amber_chunk_sel *sel, uint64_t j, amber__chunk *c) {
  size_t isz = amber_dtype_size(src->dtype), n = src->n;
  double t0 = now_s();
  if (sel->count == AMBER_SELECT_WHOLE) {
    c->encoding = AMBER__ENC_RAW;
    c->stored = n;
    amber__ckpt_append_hashed(src->out, c, sel->vals, n * isz);
    s->encode_s += now_s() - t0;
    return;
  }
  size_t k = (size_t)sel->count;
  c->stored = k;
  if (k == 0) {
    c->encoding = AMBER__ENC_UNCHANGED;
    c->checksum = 0;
    amber__ckpt_append(src->out, c, NULL, 0);
    return;
  }
  size_t bad = first_bad_index(sel->idx, k, n);
  if (bad < k) {
    char why[AMBER__ERRLEN];
    snprintf(why, sizeof why,
             "tensor '%s', chunk %" PRIu64 ": selected index %" PRIu32 " at position %zu is %s",
             src->name, j, sel->idx[bad], bad,
             sel->idx[bad] >= n ? "past the chunk's end" : "not above the one before it");
    amber__ckpt_fail(src->out, AMBER_EINVAL, why);
    return;
  }
  size_t blen, plen;
  if (sel->quant) {
    if (bad_qsel(src, sel, j, &blen)) return; /* blen: the body's size at most */
    amber__qsel q = {.k = k, .idx = sel->idx, .mode = (int)sel->quant->mode,
                     .group_log2 = sel->quant->group_log2, .rel_step = sel->quant->rel_step,
                     .steps = sel->quant->steps, .codes = sel->quant->codes,
                     .nesc = (size_t)sel->quant->nesc, .esc = sel->quant->esc,
                     .esc_vals = sel->quant->esc_vals};
    blen = amber__qsparse_encode(s->body, &q, n, isz);
  } else {
    /* the scratch body holds the bitmap form of a whole chunk (writer.c sizes it) */
    blen = amber__sparse_encode(s->body, sel->idx, sel->vals, k, n, isz);
  }
  int level = sel->quant ? src->qzstd_level : src->zstd_level;
  if (amber__zstd_compress(s->cctx, level, s->zbuf, amber__zstd_bound(blen), s->body, blen,
                           &plen) != 0) {
    char why[AMBER__ERRLEN];
    snprintf(why, sizeof why, "cannot compress a chunk of tensor '%s'", src->name);
    amber__ckpt_fail(src->out, AMBER_ENOMEM, why);
    return;
  }
  c->encoding = sel->quant ? AMBER__ENC_QSPARSE : AMBER__ENC_SPARSE;
  c->checksum = amber__xxh3(s->zbuf, plen);
  amber__ckpt_append(src->out, c, s->zbuf, plen);
  s->encode_s += now_s() - t0;
}

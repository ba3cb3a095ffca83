/*
 * maint.c - offline maintenance of a store: compact (rewrite a step as a full
 * checkpoint) and prune (drop old checkpoints that no kept one needs).
 *
 * Compaction writes the restored state of step N as a full file with the same
 * step and the same state id, then renames it over the old file: children of N
 * and LATEST name N by state id, so they stay valid, and a crash at any point
 * leaves either the old or the new file, both restoring the same state.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ckpt.h"
#include "format.h"
#include "internal.h"
#include "io.h"
#include "s3store.h"
#include "store.h"

int amber__write_restored(amber__err *e, amber_reader *r, uint64_t state_id,
                          const char *dst, char *tmp, const char *progress) {
  const amber__index *src = amber__reader_index(r);
  amber__ckpt_out *o = NULL;
  if (amber__ckpt_out_create(&o, AMBER__STAGE_BYTES, 1))
    return amber__fail(e, AMBER_ENOMEM, "out of memory");
  amber__index ix = *src;
  ix.chunks = calloc(src->n_chunks ? src->n_chunks : 1, sizeof *ix.chunks);
  uint64_t max = 0;
  for (uint64_t i = 0; i < src->n_tensors; i++)
    if (src->tensors[i].nbytes > max) max = src->tensors[i].nbytes;
  uint8_t *buf = malloc(max ? max : 1);
  int rc = 0;
  if (!ix.chunks || !buf) rc = amber__fail(e, AMBER_ENOMEM, "out of memory");
  if (!rc && (rc = amber__ckpt_create(o, e, dst, amber_reader_step(r), src->tensors,
                                      src->n_tensors, AMBER_NO_STEP, 0)) == 0)
    snprintf(tmp, 4200, "%s", amber__ckpt_tmp(o));
  int created = !rc;
  uint64_t total = 0, done = 0;
  for (uint64_t i = 0; i < src->n_tensors; i++) total += src->tensors[i].nbytes;
  for (uint64_t i = 0; i < src->n_tensors && !rc; i++) {
    const amber__tensor *t = &src->tensors[i];
    if ((rc = amber_reader_read(r, (size_t)i, buf, t->nbytes)) != 0) {
      amber__fail(e, rc, "%s", amber_last_error(r));
      break;
    }
    size_t isz = amber_dtype_size(t->dtype);
    for (uint64_t j = 0; j < t->n_chunks && !rc; j++) {
      amber__chunk *c = &ix.chunks[t->first_chunk + j];
      uint64_t n = amber__chunk_n(t, j);
      c->stored = n;
      c->encoding = AMBER__ENC_RAW;
      amber__ckpt_append_hashed(o, c, buf + j * t->chunk_elems * isz, (size_t)(n * isz));
      rc = amber__ckpt_failed(o);
    }
    if (!rc && progress) amber__progress(progress, done += t->nbytes, total);
  }
  uint64_t sealed_id, bytes;
  if (created && rc) amber__ckpt_abort(o);
  else if (created) rc = amber__ckpt_seal(o, &ix, &state_id, &sealed_id, &bytes);
  amber__ckpt_out_destroy(o);
  free(ix.chunks);
  free(buf);
  return rc;
}

int amber_store_compact(amber_store *st, uint64_t step) {
  if (!st) return amber__fail(NULL, AMBER_EINVAL, "amber_store_compact: NULL store");
  if (!amber__store_writable(st))
    return amber__fail(&st->err, AMBER_EREADONLY, "store %s is open read-only", st->path);
  amber_reader *r = NULL;
  int rc = amber_reader_open(&r, st, step, NULL);
  if (rc) {
    amber__err_adopt(&st->err);
    return rc;
  }
  /* Verify first: a compacted file must not bake damage into a full checkpoint. */
  if ((rc = amber_reader_verify(r)) != 0) {
    amber__err_adopt(&st->err);
    amber_reader_close(r);
    return rc;
  }
  amber_ckpt_info ci;
  amber_reader_ckpt_info(r, &ci);
  if (ci.kind == AMBER_KIND_FULL) {
    amber_reader_close(r);
    return 0; /* already full */
  }
  char tmp[4200] = "", dst[4200];
  if (st->s3) { /* written locally, then uploaded whole under the step's key */
    const char *dir = getenv("TMPDIR");
    snprintf(dst, sizeof dst, "%s/amber-compact-%ld", dir && *dir ? dir : "/tmp",
             (long)getpid());
  } else {
    amber__ckpt_path(st, ci.step, NULL, dst, sizeof dst);
  }
  rc = amber__write_restored(&st->err, r, ci.hash, dst, tmp, "compact");
  amber_reader_close(r);
  /* An object store replaces the object at once: a reader that opened the delta
   * fails with AMBER_ECHANGED (its reads are pinned to its ETag), never mixes two. */
  if (!rc && st->s3) rc = amber__s3store_commit_file(st, &st->err, tmp, ci.step);
  else if (!rc) rc = amber__commit_file(st, &st->err, tmp, ci.step);
  return rc;
}

int amber_store_prune(amber_store *st, uint64_t keep_last, size_t *removed) {
  if (!st) return amber__fail(NULL, AMBER_EINVAL, "amber_store_prune: NULL store");
  return amber__store_prune(st, &st->err, keep_last, removed);
}

int amber__store_prune(amber_store *st, amber__err *e, uint64_t keep_last, size_t *removed) {
  if (removed) *removed = 0;
  if (keep_last == 0)
    return amber__fail(e, AMBER_EINVAL, "prune must keep at least one checkpoint");
  if (!amber__store_writable(st))
    return amber__fail(e, AMBER_EREADONLY, "store %s is open read-only", st->path);
  amber_ckpt_info *info = NULL;
  size_t n = 0;
  int rc = amber__store_list(st, e, &info, &n);
  if (rc) return rc;
  char *keep = calloc(n ? n : 1, 1);
  if (!keep) {
    amber_free(info);
    return amber__fail(e, AMBER_ENOMEM, "out of memory");
  }
  /* Keep the newest K and everything their restores need (parents, back to a
   * full checkpoint). A damaged file's parent is unknown: keep everything older
   * than it too, rather than guess. */
  for (size_t i = n > keep_last ? n - keep_last : 0; i < n; i++) {
    size_t k = i;
    for (;;) {
      keep[k] = 1;
      if (info[k].kind == AMBER_KIND_FULL && info[k].hash) break;
      if (!info[k].hash) { /* unreadable header or footer */
        for (size_t m = 0; m < k; m++) keep[m] = 1;
        break;
      }
      size_t p = k;
      while (p > 0 && info[p - 1].step != info[k].parent) p--;
      if (p == 0) break; /* the parent is missing: nothing older is needed */
      k = p - 1;
    }
  }
  /* Newest first: a delta goes before its parent, so a crash in between leaves
   * no checkpoint whose chain is broken. A file that cannot be removed does not
   * stop the others; the first failure is reported. */
  for (size_t i = n; i-- > 0;) {
    if (keep[i]) continue;
    char path[4200];
    amber__ckpt_path(st, info[i].step, NULL, path, sizeof path);
    if (st->s3) {
      int r2 = amber__s3store_remove(st, e, info[i].step);
      if (r2 && !rc) rc = r2;
      if (!r2 && removed) (*removed)++;
    } else if (unlink(path) != 0 && errno != ENOENT) {
      if (!rc)
        rc = amber__fail(e, amber__errno_code(errno), "cannot remove %s: %s", path,
                         strerror(errno));
    } else if (removed) {
      (*removed)++;
    }
  }
  if (!st->s3 && amber__fsync_dir(st->path) != 0 && !rc)
    rc = amber__fail(e, AMBER_EIO, "cannot fsync %s", st->path);
  free(keep);
  amber_free(info);
  return rc;
}

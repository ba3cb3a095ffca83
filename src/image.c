/*
 * image.c - the image of a memory tier's store: its newest step as one full
 * checkpoint file ("image.amber", raw chunks, the step's state id), kept up to date
 * by the drain, so that a restart reads one file at memory speed instead of the full
 * checkpoint and every delta after it (docs/DESIGN.md, "Storage tiers").
 *
 * Bringing the image forward costs what the deltas cost to apply, plus a checksum
 * of each chunk they changed: it is updated in place, never rewritten. While that
 * runs the file's header checksum is zero, so no reader takes a half-updated image
 * (a crash leaves it so, and the next drain rebuilds it after the job's first commit:
 * never while a restart restores); the update holds an
 * exclusive flock, a reader a shared one (amber__ckpt_open_file), so the drain never
 * changes bytes a reader is reading: it skips the update and tries again later. The
 * image is built from the step's chain (a full checkpoint's restore, written as
 * compaction writes it) when there is none, when it is damaged, and after each
 * full checkpoint. It is an accelerator only: the files stay, the drain copies the
 * files, and when the image is missing, stale or busy a restore reads the files.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <unistd.h>

#include "xxh.h"

#include "ckpt.h"
#include "format.h"
#include "internal.h"
#include "io.h"
#include "store.h"

#define IMAGE_NAME "image.amber"
#define HDR_CHECKSUM_AT 56 /* the header's checksum field (docs/FORMAT.md) */

struct amber__image {
  char path[4200];
  amber__ckpt c;  /* the image, opened read-write (fd -1: none open) */
  uint8_t *map;   /* map_len bytes, shared: the file as mapped (its payloads do not move) */
  size_t map_len;
  uint8_t *dirty; /* one flag per chunk of an update */
  uint8_t *ixbuf; /* the encoded index of an update */
  size_t ixcap;
  amber__applier *ap;
  uint64_t failed_step, failed_state; /* a LATEST whose image could not be made */
};

void amber__image_path(const char *store, char *buf, size_t len) {
  snprintf(buf, len, "%s/" IMAGE_NAME, store);
}

int amber__image_create(amber__image **out, const char *store) {
  amber__image *im = calloc(1, sizeof *im);
  if (!im || amber__applier_create(&im->ap)) {
    free(im);
    return AMBER_ENOMEM;
  }
  amber__image_path(store, im->path, sizeof im->path);
  im->c.fd = im->c.dfd = -1;
  im->failed_step = AMBER_NO_STEP;
  *out = im;
  return 0;
}

static void unmap(amber__image *im) {
  if (im->map) munmap(im->map, im->map_len);
  im->map = NULL;
  im->ixcap = 0;
  if (im->c.fd >= 0 || im->c.path) amber__ckpt_close(&im->c);
  free(im->dirty);
  free(im->ixbuf);
  im->dirty = im->ixbuf = NULL;
}

void amber__image_free(amber__image *im) {
  if (!im) return;
  unmap(im);
  amber__applier_free(im->ap);
  free(im);
}

uint64_t amber__image_step(const amber__image *im) {
  return im && im->map ? im->c.hdr.step : AMBER_NO_STEP;
}

uint64_t amber__image_bytes(const amber__image *im) {
  return im && im->map ? im->c.size : 0;
}

/* The image is a full file of raw chunks only: what an update can change in place. */
static int raw_only(const amber__ckpt *c) {
  if (c->hdr.kind != AMBER_KIND_FULL) return 0;
  for (uint64_t t = 0; t < c->ix.n_tensors; t++) {
    const amber__tensor *tt = &c->ix.tensors[t];
    for (uint64_t j = 0; j < tt->n_chunks; j++) {
      const amber__chunk *ch = &c->ix.chunks[tt->first_chunk + j];
      if (ch->encoding != AMBER__ENC_RAW ||
          ch->size != amber__chunk_n(tt, j) * amber_dtype_size(tt->dtype))
        return 0;
    }
  }
  return 1;
}

/* Maps the image file (opened read-write and checked): 0, or a code when there is
 * none or it does not do (the caller rebuilds). It takes no lock: readers may read it
 * meanwhile (only this drain changes it, and only under the exclusive lock). */
static int map_image(amber__image *im) {
  amber__err e;
  int rc = amber__ckpt_open_file(&e, im->path, AMBER__OPEN_WRITE, &im->c);
  if (rc) return rc;
  size_t ixsize = (size_t)im->c.ftr.index_size;
  if (!raw_only(&im->c) || !(im->dirty = malloc(im->c.ix.n_chunks ? im->c.ix.n_chunks : 1)) ||
      !(im->ixbuf = malloc(ixsize ? ixsize : 1))) {
    unmap(im);
    return AMBER_ECORRUPT;
  }
  void *m = mmap(NULL, (size_t)im->c.size, PROT_READ | PROT_WRITE, MAP_SHARED, im->c.fd, 0);
  if (m == MAP_FAILED) {
    unmap(im);
    return AMBER_EIO;
  }
  im->map = m;
  im->map_len = (size_t)im->c.size;
  im->ixcap = ixsize;
  return 0;
}

static int same_tensors(const amber__index *a, const amber__index *b) {
  if (a->n_tensors != b->n_tensors || a->n_chunks != b->n_chunks) return 0;
  for (uint64_t i = 0; i < a->n_tensors; i++) {
    const amber__tensor *x = &a->tensors[i], *y = &b->tensors[i];
    if (x->name_len != y->name_len || memcmp(x->name, y->name, x->name_len) ||
        x->dtype != y->dtype || x->ndim != y->ndim || x->chunk_elems != y->chunk_elems ||
        x->n_chunks != y->n_chunks || x->first_chunk != y->first_chunk ||
        memcmp(x->shape, y->shape, sizeof x->shape[0] * x->ndim))
      return 0;
  }
  return 1;
}

/* Drops the image: unmapped and removed (a damaged or stale one is never read: its
 * header checks, but its step is no chain's, or its header does not check). */
static void drop(amber__image *im) {
  unmap(im);
  unlink(im->path);
}

/* A new image of step (step, state) from the step's files, over the old one. */
static int rebuild(amber__image *im, amber_store *st, uint64_t step, uint64_t state) {
  drop(im); /* first: the memory tier never holds two */
  amber_reader *r = NULL;
  amber__err e;
  char tmp[4200] = "";
  int rc = amber__reader_open_files(&r, st, step, state);
  if (!rc) rc = amber__write_restored(&e, r, state, im->path, tmp, NULL);
  amber_reader_close(r);
  if (!rc && rename(tmp, im->path) != 0) rc = amber__errno_code(errno);
  if (rc && *tmp) unlink(tmp);
  if (!rc) rc = map_image(im);
  return rc;
}

/* Applies the deltas `d[0..n)` (oldest first, the first one's parent the image's
 * step) to the mapped image, which then holds step (step, state). The caller holds
 * the exclusive lock. */
static int advance(amber__image *im, amber__ckpt *d, size_t n, uint64_t step, uint64_t state,
                   const atomic_int *stop) {
  amber__ckpt *c = &im->c;
  amber__index *ix = &c->ix;
  for (size_t k = 0; k < n; k++)
    if (!same_tensors(ix, &d[k].ix)) return AMBER_ECORRUPT;
  memset(im->map + HDR_CHECKSUM_AT, 0, 8); /* no reader takes it from here on */
  memset(im->dirty, 0, (size_t)ix->n_chunks);
  amber__err e;
  for (size_t k = 0; k < n; k++)
    for (uint64_t t = 0; t < ix->n_tensors; t++) {
      const amber__tensor *tt = &ix->tensors[t];
      for (uint64_t j = 0; j < tt->n_chunks; j++) {
        uint64_t i = tt->first_chunk + j;
        if (d[k].ix.chunks[i].encoding == AMBER__ENC_UNCHANGED) continue;
        if (atomic_load(stop)) return AMBER_ECANCELED;
        int rc = amber__applier_apply(im->ap, &e, &d[k], (size_t)t, j,
                                      im->map + ix->chunks[i].offset);
        if (rc) return rc;
        im->dirty[i] = 1;
      }
    }
  for (uint64_t i = 0; i < ix->n_chunks; i++)
    if (im->dirty[i])
      ix->chunks[i].checksum = amber__xxh3(im->map + ix->chunks[i].offset,
                                           (size_t)ix->chunks[i].size);
  /* The index: the newest delta's (its metadata, such as a Python Checkpointer's plain
   * values and RNG states, and its tensors' policies are the step's own) with the
   * image's chunks. Its size may differ from the old one's: it is written after the
   * payloads, the footer after it, and the file cut to its new length. */
  amber__index nx = d[n - 1].ix;
  nx.chunks = ix->chunks;
  size_t isize = (size_t)amber__index_size(&nx);
  if (isize > im->ixcap) {
    uint8_t *g = realloc(im->ixbuf, isize);
    if (!g) return AMBER_ENOMEM;
    im->ixbuf = g, im->ixcap = isize;
  }
  amber__index_encode(&nx, im->ixbuf);
  amber__index fresh;
  if (amber__index_decode(&e, im->path, im->ixbuf, isize, c->ftr.index_offset, &fresh))
    return AMBER_ECORRUPT;
  amber__index_free(ix);
  *ix = fresh;
  c->hdr.step = step;
  c->hdr.format_minor = d[n - 1].hdr.format_minor;
  uint8_t hb[AMBER__HEADER_SIZE], fb[AMBER__FOOTER_SIZE];
  amber__header_encode(&c->hdr, hb);
  XXH3_state_t hs;
  XXH3_INITSTATE(&hs);
  XXH3_64bits_reset(&hs);
  XXH3_64bits_update(&hs, hb, sizeof hb);
  XXH3_64bits_update(&hs, im->ixbuf, isize);
  c->ftr.index_size = isize;
  c->ftr.index_checksum = amber__xxh3(im->ixbuf, isize);
  c->ftr.content_hash = XXH3_64bits_digest(&hs);
  c->ftr.state_id = state;
  amber__footer_encode(&c->ftr, fb);
  uint64_t at = c->ftr.index_offset, size = at + isize + AMBER__FOOTER_SIZE;
  if (amber__pwrite_full(c->fd, im->ixbuf, isize, at) ||
      amber__pwrite_full(c->fd, fb, sizeof fb, at + isize) || ftruncate(c->fd, (off_t)size))
    return AMBER_EIO;
  c->size = size;
  memcpy(im->map, hb, HDR_CHECKSUM_AT);
  /* The checksum last, in program order: readers of the file never read while this
   * runs (the lock), so only a crash can see the file half written, and a process
   * that dies keeps every store it made; the compiler must not move them past this. */
  __asm__ __volatile__("" ::: "memory");
  memcpy(im->map + HDR_CHECKSUM_AT, hb + HDR_CHECKSUM_AT, AMBER__HEADER_SIZE - HDR_CHECKSUM_AT);
  return 0;
}

/* The deltas from the image's step to `step` (state `state`), oldest first: *n files
 * into *out; *n 0 (rebuild) when the chain reaches a full checkpoint first. */
static int deltas_since(amber__image *im, amber_store *st, uint64_t step, uint64_t state,
                        amber__ckpt **out, size_t *n) {
  amber__ckpt *d = NULL;
  size_t cnt = 0, cap = 0;
  amber__err e;
  int rc = 0;
  *out = NULL, *n = 0;
  for (;;) {
    if (cnt == cap) {
      amber__ckpt *g = realloc(d, (cap = cap ? 2 * cap : 8) * sizeof *g);
      if (!g) {
        rc = AMBER_ENOMEM;
        break;
      }
      d = g;
    }
    if ((rc = amber__ckpt_open(&e, st, step, &d[cnt])) != 0) break;
    amber__ckpt *c = &d[cnt++];
    if (c->ftr.state_id != state) {
      rc = AMBER_ECORRUPT;
      break;
    }
    if (c->hdr.kind == AMBER_KIND_FULL) { /* the image is older than this full */
      for (size_t k = 0; k < cnt; k++) amber__ckpt_close(&d[k]);
      cnt = 0;
      break;
    }
    step = c->hdr.parent_step, state = c->hdr.parent_state;
    if (step == im->c.hdr.step && state == im->c.ftr.state_id) break;
  }
  if (rc) {
    for (size_t k = 0; k < cnt; k++) amber__ckpt_close(&d[k]);
    free(d);
    return rc;
  }
  for (size_t k = 0; k < cnt / 2; k++) { /* oldest first */
    amber__ckpt t = d[k];
    d[k] = d[cnt - 1 - k];
    d[cnt - 1 - k] = t;
  }
  *out = d, *n = cnt;
  return 0;
}

/* The bytes an image of the step whose index is `ix` takes. */
static uint64_t image_bytes(const amber__index *ix) {
  uint64_t n = AMBER__HEADER_SIZE + AMBER__FOOTER_SIZE + amber__index_size(ix);
  for (uint64_t t = 0; t < ix->n_tensors; t++) n += ix->tensors[t].nbytes;
  return n;
}

/* A new image of (step, state), where `room` holds it. */
static int build(amber__image *im, amber_store *st, uint64_t step, uint64_t state,
                 uint64_t room) {
  amber__ckpt top;
  amber__err e;
  int rc = amber__ckpt_open(&e, st, step, &top);
  if (rc) return rc;
  uint64_t need = image_bytes(&top.ix);
  amber__ckpt_close(&top);
  if (need > room) {
    drop(im);
    return AMBER_ENOSPC;
  }
  return rebuild(im, st, step, state);
}

/* One update (see amber__image_update): 0 when the image holds (step, state). */
static int update(amber__image *im, amber_store *st, uint64_t step, uint64_t state,
                  const atomic_int *stop, uint64_t room) {
  if (!im->map && map_image(im) != 0) return build(im, st, step, state, room);
  if (im->c.hdr.step == step && im->c.ftr.state_id == state) {
    if (im->c.size <= room) return 0;
    drop(im);
    return AMBER_ENOSPC;
  }
  if (flock(im->c.fd, LOCK_EX | LOCK_NB) != 0) return AMBER_ELOCKED; /* being read: later */
  amber__ckpt *d = NULL;
  size_t n = 0;
  int rc = deltas_since(im, st, step, state, &d, &n);
  if (!rc && n && im->c.size > room) rc = AMBER_ENOSPC;
  else if (!rc && n) rc = advance(im, d, n, step, state, stop);
  for (size_t k = 0; k < n; k++) amber__ckpt_close(&d[k]);
  free(d);
  flock(im->c.fd, LOCK_UN);
  if (rc) drop(im); /* perhaps half updated: never read again */
  if (rc || n) return rc;
  return build(im, st, step, state, room); /* the step's chain starts at a newer full */
}

int amber__image_current(amber__image *im, amber_store *st) {
  uint64_t step, state;
  amber__err e;
  if (amber__store_state(st, &e, &step, &state) != 0) return 1; /* nothing committed */
  if (step == im->failed_step && state == im->failed_state) return 1; /* not again */
  return im->map && im->c.hdr.step == step && im->c.ftr.state_id == state;
}

int amber__image_update(amber__image *im, amber_store *st, const atomic_int *stop,
                        uint64_t room, uint64_t *bytes) {
  uint64_t step, state;
  amber__err e;
  if (bytes) *bytes = 0;
  if (amber__store_state(st, &e, &step, &state) != 0) return 0; /* nothing committed */
  int rc = 0;
  if (step != im->failed_step || state != im->failed_state) {
    rc = update(im, st, step, state, stop, room);
    if (rc && rc != AMBER_ELOCKED && rc != AMBER_ECANCELED && rc != AMBER_ENOMEM)
      im->failed_step = step, im->failed_state = state; /* not again for this step */
  }
  if (bytes && im->map) *bytes = im->c.size;
  return rc == AMBER_ENOMEM ? rc : rc == AMBER_ECANCELED ? rc : 0;
}

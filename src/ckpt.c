/*
 * ckpt.c - one checkpoint file, written and read (docs/FORMAT.md, "File
 * layout"): the only code that lays out a file's header, payloads, index and
 * footer, and the only code that opens one and loads its chunks.
 *
 * Writing goes through amber__wfile (io.c): payloads are staged in a reused ring
 * and written by background threads, in whatever order the writer's workers
 * append them (the index records each offset). Sealing appends the index and
 * the footer, whose content hash (header and index) is the state id that LATEST
 * and a child delta name.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "xxh.h"

#include "ckpt.h"
#include "format.h"
#include "internal.h"
#include "io.h"
#include "s3store.h"
#include "store.h"

/* ---- writing ---- */

struct amber__ckpt_out {
  amber__wfile *wf;
  amber__err *err;                   /* the handle the file's failures are reported to */
  pthread_mutex_t mu;                /* guards the appends and rc */
  int rc;                            /* the file's first failure */
  uint8_t hb[AMBER__HEADER_SIZE];    /* the encoded header, for the content hash */
  uint8_t *ixbuf;                    /* the encoded index, reused */
  uint64_t ixcap;
};

int amber__ckpt_out_create(amber__ckpt_out **out, size_t stage_bytes, int allow_direct) {
  amber__ckpt_out *o = calloc(1, sizeof *o);
  if (!o) return AMBER_ENOMEM;
  if (amber__wfile_create(&o->wf, stage_bytes, allow_direct)) {
    free(o);
    return AMBER_ENOMEM;
  }
  pthread_mutex_init(&o->mu, NULL);
  *out = o;
  return 0;
}

void amber__ckpt_out_destroy(amber__ckpt_out *o) {
  if (!o) return;
  amber__wfile_destroy(o->wf);
  pthread_mutex_destroy(&o->mu);
  free(o->ixbuf);
  free(o);
}

int amber__ckpt_create(amber__ckpt_out *o, amber__err *e, const char *dst, uint64_t step,
                       const amber__tensor *t, uint64_t n, uint64_t parent_step,
                       uint64_t parent_state) {
  int delta = parent_step != AMBER_NO_STEP;
  amber__header h = {.format_major = AMBER_FORMAT_MAJOR,
                     .format_minor = amber__format_minor_for(t, n),
                     .step = step,
                     .kind = delta ? AMBER_KIND_DELTA : AMBER_KIND_FULL,
                     .parent_step = parent_step,
                     .parent_state = delta ? parent_state : 0};
  amber__header_encode(&h, o->hb);
  o->err = e;
  o->rc = 0;
  int rc = amber__wfile_begin(o->wf, e, dst);
  if (!rc && (rc = amber__wfile_append(o->wf, o->hb, sizeof o->hb)) != 0)
    amber__wfile_abort(o->wf);
  o->rc = rc;
  return rc;
}

const char *amber__ckpt_tmp(const amber__ckpt_out *o) {
  return amber__wfile_path(o->wf);
}

static void append(amber__ckpt_out *o, amber__chunk *c, const void *p, size_t len, int hashed) {
  pthread_mutex_lock(&o->mu);
  if (!o->rc) {
    /* an empty payload points at the header: a valid offset that holds no bytes */
    c->offset = len ? amber__wfile_pos(o->wf) : AMBER__HEADER_SIZE;
    c->size = len;
    int rc = !len ? 0
             : hashed ? amber__wfile_append_hashed(o->wf, p, len, &c->checksum)
                      : amber__wfile_append(o->wf, p, len);
    if (rc) __atomic_store_n(&o->rc, rc, __ATOMIC_RELAXED);
  }
  pthread_mutex_unlock(&o->mu);
}

void amber__ckpt_append(amber__ckpt_out *o, amber__chunk *c, const void *p, size_t len) {
  append(o, c, p, len, 0);
}

void amber__ckpt_append_hashed(amber__ckpt_out *o, amber__chunk *c, const void *p, size_t len) {
  append(o, c, p, len, 1);
}

void amber__ckpt_fail(amber__ckpt_out *o, int code, const char *why) {
  pthread_mutex_lock(&o->mu);
  if (!o->rc) __atomic_store_n(&o->rc, amber__fail(o->err, code, "%s", why), __ATOMIC_RELAXED);
  pthread_mutex_unlock(&o->mu);
}

int amber__ckpt_failed(const amber__ckpt_out *o) {
  return __atomic_load_n(&o->rc, __ATOMIC_RELAXED);
}

void amber__ckpt_abort(amber__ckpt_out *o) {
  amber__wfile_abort(o->wf);
}

int amber__ckpt_seal(amber__ckpt_out *o, const amber__index *ix, const uint64_t *keep_id,
                     uint64_t *state_id, uint64_t *bytes) {
  int rc = o->rc;
  uint64_t isize = amber__index_size(ix);
  if (!rc && isize > o->ixcap) {
    free(o->ixbuf);
    o->ixcap = 0;
    if (!(o->ixbuf = malloc(isize))) rc = amber__fail(o->err, AMBER_ENOMEM, "out of memory");
    else o->ixcap = isize;
  }
  if (rc) {
    amber__wfile_abort(o->wf);
    return rc;
  }
  amber__index_encode(ix, o->ixbuf);
  amber__footer f = {.index_offset = amber__wfile_pos(o->wf), .index_size = isize,
                     .index_checksum = amber__xxh3(o->ixbuf, isize)};
  XXH3_state_t hs;
  XXH3_INITSTATE(&hs);
  XXH3_64bits_reset(&hs);
  XXH3_64bits_update(&hs, o->hb, sizeof o->hb);
  XXH3_64bits_update(&hs, o->ixbuf, isize);
  f.content_hash = XXH3_64bits_digest(&hs);
  f.state_id = keep_id ? *keep_id : f.content_hash;
  uint8_t fb[AMBER__FOOTER_SIZE];
  amber__footer_encode(&f, fb);
  rc = amber__wfile_append(o->wf, o->ixbuf, isize);
  if (!rc) rc = amber__wfile_append(o->wf, fb, sizeof fb);
  if (rc) {
    amber__wfile_abort(o->wf);
    return rc;
  }
  if ((rc = amber__wfile_finish(o->wf)) != 0) return rc; /* it removed the file */
  *state_id = f.state_id;
  *bytes = f.index_offset + isize + AMBER__FOOTER_SIZE;
  return 0;
}

/* ---- reading ---- */


/* A checkpoint's tail is read with its header in one round trip, and holds the
 * index of all but the largest ones, so that an s3:// file opens in two requests
 * (HEAD, then both ranges at once) rather than four. */
#define S3_TAIL (256u << 10)

/* The header, footer and index of an s3:// checkpoint into hb, fb and *ib. */
static int open_s3(amber__err *e, amber_store *st, uint64_t step, amber__ckpt *c,
                   uint8_t *hb, uint8_t *fb, uint8_t **ib) {
  char key[40];
  amber__s3store_ckpt_key(step, key, sizeof key);
  int rc = amber__s3_obj_open(&c->obj, st->s3, key);
  if (rc == AMBER_ENOENT)
    return amber__fail(e, AMBER_ENOENT, "%s: checkpoint file of step %" PRIu64 " is missing",
                       c->path, step);
  if (rc) return amber__fail(e, rc, "%s", amber_last_error(NULL));
  c->size = amber__s3_obj_size(c->obj);
  if (c->size < AMBER__HEADER_SIZE + AMBER__INDEX_FIXED + AMBER__FOOTER_SIZE)
    return amber__fail(e, AMBER_ECORRUPT, "%s: file of %" PRIu64 " bytes is too short "
                       "(truncated?)", c->path, c->size);
  uint64_t body = c->size - AMBER__HEADER_SIZE;
  size_t tlen = body < S3_TAIL ? (size_t)body : S3_TAIL;
  uint8_t *tail = malloc(tlen);
  if (!tail) return amber__fail(e, AMBER_ENOMEM, "out of memory");
  amber__s3_range rg[2] = {{0, AMBER__HEADER_SIZE, hb}, {c->size - tlen, tlen, tail}};
  if ((rc = amber__s3_obj_preadv(c->obj, rg, 2)) != 0) {
    free(tail);
    return amber__fail(e, rc, "%s", amber_last_error(NULL));
  }
  memcpy(fb, tail + tlen - AMBER__FOOTER_SIZE, AMBER__FOOTER_SIZE);
  amber__footer f;
  if ((rc = amber__footer_decode(e, c->path, fb, c->size, &f)) != 0) {
    free(tail);
    return rc;
  }
  if (!(*ib = malloc(f.index_size ? f.index_size : 1))) rc = AMBER_ENOMEM;
  else if (f.index_offset >= c->size - tlen) /* within the tail */
    memcpy(*ib, tail + (f.index_offset - (c->size - tlen)), f.index_size);
  else if ((rc = amber__s3_obj_pread(c->obj, *ib, f.index_size, f.index_offset)) != 0)
    rc = amber__fail(e, rc, "%s", amber_last_error(NULL));
  if (rc == AMBER_ENOMEM) amber__fail(e, rc, "%s: out of memory for the index", c->path);
  free(tail);
  return rc;
}

static int open_local(amber__err *e, const char *path, uint64_t step, int how, amber__ckpt *c);

int amber__ckpt_open(amber__err *e, amber_store *st, uint64_t step, amber__ckpt *c) {
  char path[4200];
  memset(c, 0, sizeof *c);
  c->fd = c->dfd = -1;
  amber__ckpt_path(st, step, NULL, path, sizeof path);
  if (!(c->path = strdup(path))) return amber__fail(e, AMBER_ENOMEM, "out of memory");
  if (st->s3) {
    uint8_t hb[AMBER__HEADER_SIZE], fb[AMBER__FOOTER_SIZE], *ib = NULL;
    int rc = open_s3(e, st, step, c, hb, fb, &ib);
    if (!rc) rc = amber__header_decode(e, path, hb, &c->hdr);
    if (!rc && c->hdr.step != step)
      rc = amber__fail(e, AMBER_ECORRUPT, "%s: file holds step %" PRIu64 ", not %" PRIu64,
                       path, c->hdr.step, step);
    if (!rc) rc = amber__footer_decode(e, path, fb, c->size, &c->ftr);
    if (!rc && amber__xxh3(ib, c->ftr.index_size) != c->ftr.index_checksum)
      rc = amber__fail(e, AMBER_ECORRUPT, "%s: index checksum mismatch", path);
    if (!rc)
      rc = amber__index_decode(e, path, ib, c->ftr.index_size, c->ftr.index_offset, &c->ix);
    free(ib);
    if (rc) amber__ckpt_close(c);
    return rc;
  }
  return open_local(e, path, step, AMBER__OPEN_PLAIN, c);
}

int amber__ckpt_open_file(amber__err *e, const char *path, int how, amber__ckpt *c) {
  memset(c, 0, sizeof *c);
  c->fd = c->dfd = -1;
  if (!(c->path = strdup(path))) return amber__fail(e, AMBER_ENOMEM, "out of memory");
  return open_local(e, path, AMBER_NO_STEP, how, c);
}

/* The local part of amber__ckpt_open: c->path set, the file at `path`. */
static int open_local(amber__err *e, const char *path, uint64_t step, int how, amber__ckpt *c) {
  c->fd = open(path, (how == AMBER__OPEN_WRITE ? O_RDWR : O_RDONLY) | O_CLOEXEC);
  if (c->fd < 0) {
    int err = errno;
    amber__ckpt_close(c);
    if (err == ENOENT)
      return amber__fail(e, AMBER_ENOENT, "%s: checkpoint file of step %" PRIu64 " is missing",
                         path, step);
    return amber__fail(e, amber__errno_code(err), "cannot open %s: %s", path, strerror(err));
  }
  struct stat sb;
  uint8_t hb[AMBER__HEADER_SIZE], fb[AMBER__FOOTER_SIZE];
  int rc = 0;
  if (how == AMBER__OPEN_SHARED && flock(c->fd, LOCK_SH | LOCK_NB) != 0) {
    int err = errno;
    amber__ckpt_close(c);
    return amber__fail(e, err == EWOULDBLOCK ? AMBER_ELOCKED : amber__errno_code(err),
                       "cannot lock %s: %s", path, strerror(err));
  }
  if (fstat(c->fd, &sb) != 0) {
    rc = amber__fail(e, AMBER_EIO, "cannot stat %s: %s", path, strerror(errno));
  } else if (sb.st_size < AMBER__HEADER_SIZE + AMBER__INDEX_FIXED + AMBER__FOOTER_SIZE) {
    rc = amber__fail(e, AMBER_ECORRUPT, "%s: file of %lld bytes is too short (truncated?)",
                     path, (long long)sb.st_size);
  } else {
    c->size = (uint64_t)sb.st_size;
    if (amber__pread_full(c->fd, hb, sizeof hb, 0) != 0 ||
        amber__pread_full(c->fd, fb, sizeof fb, c->size - AMBER__FOOTER_SIZE) != 0)
      rc = amber__fail(e, AMBER_EIO, "cannot read %s: %s", path, strerror(errno));
  }
  if (!rc) rc = amber__header_decode(e, path, hb, &c->hdr);
  if (!rc && step != AMBER_NO_STEP && c->hdr.step != step)
    rc = amber__fail(e, AMBER_ECORRUPT, "%s: file holds step %" PRIu64 ", not %" PRIu64, path,
                     c->hdr.step, step);
  if (!rc) rc = amber__footer_decode(e, path, fb, c->size, &c->ftr);
  uint8_t *ib = NULL;
  if (!rc && !(ib = malloc(c->ftr.index_size)))
    rc = amber__fail(e, AMBER_ENOMEM, "%s: out of memory for the index", path);
  if (!rc && amber__pread_full(c->fd, ib, c->ftr.index_size, c->ftr.index_offset) != 0)
    rc = amber__fail(e, AMBER_EIO, "cannot read %s: %s", path, strerror(errno));
  if (!rc && amber__xxh3(ib, c->ftr.index_size) != c->ftr.index_checksum)
    rc = amber__fail(e, AMBER_ECORRUPT, "%s: index checksum mismatch", path);
  if (!rc)
    rc = amber__index_decode(e, path, ib, c->ftr.index_size, c->ftr.index_offset, &c->ix);
  free(ib);
  if (rc) {
    amber__ckpt_close(c);
    return rc;
  }
  /* A memory file system has no cache to bypass: its files are mapped and read in
   * place (read(2) from tmpfs runs at 2.5x the time of a copy from its mapping). Else
   * O_DIRECT where it is supported (-1 where not: every payload is read buffered). */
  if (how != AMBER__OPEN_WRITE && amber__on_memory_fs(c->fd)) {
    void *m = mmap(NULL, (size_t)c->size, PROT_READ, MAP_SHARED, c->fd, 0);
    c->map = m == MAP_FAILED ? NULL : m;
  }
  c->dfd = how == AMBER__OPEN_PLAIN && !c->map && amber__io_direct_reads_on()
               ? open(path, O_RDONLY | O_CLOEXEC | O_DIRECT)
               : -1;
  return 0;
}

/* Unmapping a file drops each page's table entry and reference: about 11 ms per GB
 * here, which a restore's caller need not wait for. A large mapping is unmapped on a
 * detached thread (inline when no thread can be made), a piece at a time: munmap
 * holds the process's memory map lock, which every page fault, mmap and thread start
 * of the caller's next steps needs. */
#define UNMAP_ASIDE ((size_t)64 << 20)
#define UNMAP_PIECE ((size_t)16 << 20)

struct unmap_job {
  void *p;
  size_t n;
};

static void *unmap_run(void *arg) {
  struct unmap_job *j = arg;
  for (size_t o = 0; o < j->n; o += UNMAP_PIECE)
    munmap((uint8_t *)j->p + o, j->n - o < UNMAP_PIECE ? j->n - o : UNMAP_PIECE);
  free(j);
  return NULL;
}

static void unmap_aside(void *p, size_t n) {
  struct unmap_job *j = n >= UNMAP_ASIDE ? malloc(sizeof *j) : NULL;
  pthread_attr_t a;
  if (j && pthread_attr_init(&a) == 0) {
    pthread_t t;
    *j = (struct unmap_job){p, n};
    int rc = pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    if (!rc) rc = pthread_create(&t, &a, unmap_run, j);
    pthread_attr_destroy(&a);
    if (!rc) return;
  }
  free(j);
  munmap(p, n);
}

void amber__ckpt_close(amber__ckpt *c) {
  if (!c) return;
  if (c->fd >= 0) close(c->fd);
  if (c->dfd >= 0) close(c->dfd);
  if (c->map) unmap_aside((void *)c->map, (size_t)c->size);
  amber__s3_obj_close(c->obj);
  amber__ahead_free(c);
  amber__index_free(&c->ix);
  free(c->path);
  memset(c, 0, sizeof *c);
  c->fd = c->dfd = -1;
}

void amber__stage_free(amber__stage *s) {
  free(s->buf);
  s->buf = NULL;
  s->cap = 0;
}

static int check_payload(amber__err *e, const amber__ckpt *c, const amber__chunk *ch,
                         const uint8_t *p) {
  if (amber__xxh3(p, (size_t)ch->size) != ch->checksum)
    return amber__fail(e, AMBER_ECORRUPT,
                       "%s (step %" PRIu64 "): chunk checksum mismatch at offset %" PRIu64,
                       c->path, c->hdr.step, ch->offset);
  return 0;
}

/* The span of `c` fetched ahead (amber__ahead_plan) that holds [off, off + len), or
 * NULL. */
static const amber__span *ahead_of(const amber__ckpt *c, uint64_t off, uint64_t len) {
  size_t lo = 0, hi = c->nahead;
  while (lo < hi) { /* the first span that starts after off */
    size_t mid = (lo + hi) / 2;
    if (c->ahead[mid].off <= off)
      lo = mid + 1;
    else
      hi = mid;
  }
  if (!lo) return NULL;
  const amber__span *s = &c->ahead[lo - 1];
  return off + len <= s->off + s->len ? s : NULL;
}

/* Grows `s` to at least `need` bytes, aligned for O_DIRECT. */
static int grow_stage(amber__err *e, amber__stage *s, size_t need) {
  if (s->cap >= need) return 0;
  free(s->buf);
  s->cap = 0;
  if (posix_memalign((void **)&s->buf, AMBER__ALIGN, need ? need : 1) != 0) {
    s->buf = NULL;
    return amber__fail(e, AMBER_ENOMEM, "out of memory");
  }
  s->cap = need;
  return 0;
}

int amber__chunk_load(amber__err *e, amber__ckpt *c, const amber__chunk *ch,
                      amber__stage *stage, const uint8_t **payload) {
  if (ch->size == 0) {
    static const uint8_t none[1];
    *payload = none;
    if (ch->checksum != 0 && ch->checksum != amber__xxh3(none, 0))
      return amber__fail(e, AMBER_ECORRUPT, "%s (step %" PRIu64 "): empty chunk with a checksum",
                         c->path, c->hdr.step);
    return 0;
  }
  if (c->map) {
    *payload = c->map + ch->offset;
    return check_payload(e, c, ch, *payload);
  }
  if (c->obj) { /* an object: fetched ahead, else one ranged GET of its own */
    const amber__span *s = ahead_of(c, ch->offset, ch->size);
    if (s) {
      *payload = s->buf + (ch->offset - s->off);
      return check_payload(e, c, ch, *payload);
    }
    if (grow_stage(e, stage, (size_t)ch->size)) return AMBER_ENOMEM;
    int rc = amber__s3_obj_pread(c->obj, stage->buf, (size_t)ch->size, ch->offset);
    if (rc) return amber__fail(e, rc, "%s", amber_last_error(NULL));
    *payload = stage->buf;
    return check_payload(e, c, ch, *payload);
  }
  /* O_DIRECT needs aligned offsets and lengths: read the covering blocks. */
  uint64_t lo = ch->offset & ~(uint64_t)(AMBER__ALIGN - 1);
  uint64_t hi = (ch->offset + ch->size + AMBER__ALIGN - 1) & ~(uint64_t)(AMBER__ALIGN - 1);
  size_t need = (size_t)(hi - lo);
  if (grow_stage(e, stage, need)) return AMBER_ENOMEM;
  int rc = -1;
  /* O_DIRECT pays for large payloads; small ones (deltas) would each cost a disk
   * round trip, while buffered reads get the kernel's read-ahead. */
  if (c->dfd >= 0 && ch->size >= AMBER__DIRECT_MIN) {
    /* The final block may be short (file end): read what is there. */
    size_t want = hi > c->size ? (size_t)(c->size - lo) : need;
    ssize_t got = 0;
    while ((size_t)got < want) {
      ssize_t n = pread(c->dfd, stage->buf + got, need - (size_t)got, (off_t)(lo + (uint64_t)got));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      got += n;
    }
    if ((size_t)got >= want) {
      rc = 0;
      *payload = stage->buf + (ch->offset - lo);
    }
  }
  if (rc != 0) { /* no O_DIRECT, or it failed: plain read */
    if (amber__pread_full(c->fd, stage->buf, ch->size, ch->offset) != 0)
      return amber__fail(e, AMBER_EIO, "cannot read %s at offset %" PRIu64 ": %s", c->path,
                         ch->offset, strerror(errno));
    *payload = stage->buf;
  }
  return check_payload(e, c, ch, *payload);
}

/* Copies `n` bytes to `dst` with stores that bypass the cache: the destination is
 * written once and not read back soon, so its lines need not be read first (a copy
 * through the cache reads each destination line before writing it). Plain memcpy
 * where the instructions are missing. The caller fences (stream_fence). */
static void stream_copy(uint8_t *dst, const uint8_t *src, size_t n) {
#if defined(__SSE2__)
  size_t head = (size_t)(-(uintptr_t)dst & 15);
  if (head > n) head = n;
  memcpy(dst, src, head);
  size_t i = head;
  for (; i + 64 <= n; i += 64) {
    __m128i a = _mm_loadu_si128((const __m128i *)(const void *)(src + i));
    __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(src + i + 16));
    __m128i x = _mm_loadu_si128((const __m128i *)(const void *)(src + i + 32));
    __m128i y = _mm_loadu_si128((const __m128i *)(const void *)(src + i + 48));
    _mm_stream_si128((__m128i *)(void *)(dst + i), a);
    _mm_stream_si128((__m128i *)(void *)(dst + i + 16), b);
    _mm_stream_si128((__m128i *)(void *)(dst + i + 32), x);
    _mm_stream_si128((__m128i *)(void *)(dst + i + 48), y);
  }
  memcpy(dst + i, src + i, n - i);
#else
  memcpy(dst, src, n);
#endif
}

static void stream_fence(void) {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

/* A RAW payload of a mapped file copied to `dst` and hashed in one pass, block by
 * block: each copied (a copy streams from memory at twice the pace of the hash's
 * reads), then hashed from the cache, so that the payload crosses the memory bus
 * once. What is hashed is what was written: a block is copied from the mapping
 * into a buffer in cache, hashed there and copied on, so a file changed under the
 * read cannot put unchecked bytes in `dst`. With `stream` the last copy bypasses the
 * cache (the restore's final place: nothing reads it next); else it goes through it
 * (a delta is applied on it next, or it is scattered from a buffer). */
static int copy_checked(amber__err *e, const amber__ckpt *c, const amber__chunk *ch,
                        uint8_t *dst, int stream) {
  enum { BLOCK = 128u << 10, BOUNCE = 16u << 10, STREAM_MIN = 64u << 10 };
  const uint8_t *src = c->map + ch->offset;
  XXH3_state_t hs;
  XXH3_INITSTATE(&hs);
  XXH3_64bits_reset(&hs);
  if (stream && ch->size >= STREAM_MIN) { /* a small one may stay in cache */
    _Alignas(64) uint8_t bounce[BOUNCE];
    for (uint64_t off = 0; off < ch->size; off += BOUNCE) {
      size_t n = ch->size - off < BOUNCE ? (size_t)(ch->size - off) : BOUNCE;
      memcpy(bounce, src + off, n);
      XXH3_64bits_update(&hs, bounce, n);
      stream_copy(dst + off, bounce, n);
    }
    stream_fence();
  } else {
    for (uint64_t off = 0; off < ch->size; off += BLOCK) {
      size_t n = ch->size - off < BLOCK ? (size_t)(ch->size - off) : BLOCK;
      memcpy(dst + off, src + off, n);
      XXH3_64bits_update(&hs, dst + off, n);
    }
  }
  if (XXH3_64bits_digest(&hs) != ch->checksum)
    return amber__fail(e, AMBER_ECORRUPT,
                       "%s (step %" PRIu64 "): chunk checksum mismatch at offset %" PRIu64,
                       c->path, c->hdr.step, ch->offset);
  return 0;
}

int amber__chunk_read_into(amber__err *e, amber__ckpt *c, const amber__chunk *ch, uint8_t *dst,
                           int stream) {
  if (c->map && ch->size) return copy_checked(e, c, ch, dst, stream);
  if (c->obj || (c->dfd >= 0 && ch->size >= AMBER__DIRECT_MIN) || ch->size == 0) return 1;
  if (amber__pread_full(c->fd, dst, (size_t)ch->size, ch->offset) != 0)
    return amber__fail(e, AMBER_EIO, "cannot read %s at offset %" PRIu64 ": %s", c->path,
                       ch->offset, strerror(errno));
  return check_payload(e, c, ch, dst);
}

/* ---- reading ahead ---- */

void amber__ahead_free(amber__ckpt *c) {
  for (size_t i = 0; i < c->nahead; i++)
    free(c->ahead[i].buf);
  free(c->ahead);
  c->ahead = NULL;
  c->nahead = 0;
}

static int cmp_need(const void *a, const void *b) {
  const amber__need *x = a, *y = b;
  if (x->c != y->c) return (uintptr_t)x->c < (uintptr_t)y->c ? -1 : 1;
  return x->off < y->off ? -1 : x->off > y->off;
}

int amber__ahead_plan(amber__err *e, amber__need *need, size_t n, size_t *nspans) {
  *nspans = 0;
  qsort(need, n, sizeof *need, cmp_need);
  for (size_t i = 0; i < n;) {
    amber__ckpt *c = need[i].c;
    size_t j = i, cap = 0, k = 0;
    amber__span *sp = NULL;
    for (; j < n && need[j].c == c; j++) {
      uint64_t end = need[j].off + need[j].len;
      if (k && need[j].off <= sp[k - 1].off + sp[k - 1].len + AMBER__AHEAD_GAP &&
          (end - sp[k - 1].off <= AMBER__AHEAD_SPAN || need[j].off < sp[k - 1].off +
                                                                        sp[k - 1].len)) {
        if (end > sp[k - 1].off + sp[k - 1].len) sp[k - 1].len = end - sp[k - 1].off;
        continue;
      }
      if (k == cap) {
        amber__span *g = realloc(sp, (cap = cap ? 2 * cap : 16) * sizeof *g);
        if (!g) {
          free(sp);
          return amber__fail(e, AMBER_ENOMEM, "out of memory");
        }
        sp = g;
      }
      sp[k++] = (amber__span){need[j].off, need[j].len, NULL};
    }
    amber__ahead_free(c);
    c->ahead = sp, c->nahead = k;
    for (size_t s = 0; s < k; s++)
      if (!(sp[s].buf = malloc(sp[s].len ? (size_t)sp[s].len : 1)))
        return amber__fail(e, AMBER_ENOMEM, "out of memory for %" PRIu64 " bytes of %s",
                           sp[s].len, c->path);
    *nspans += k;
    i = j;
  }
  return 0;
}

int amber__ahead_fetch(amber__err *e, amber__ckpt *c, size_t i) {
  amber__span *s = &c->ahead[i];
  int rc = amber__s3_obj_pread(c->obj, s->buf, (size_t)s->len, s->off);
  return rc ? amber__fail(e, rc, "%s", amber_last_error(NULL)) : 0;
}

/*
 * internal.h - declarations shared by the library's source files: error reporting
 * into handles, little-endian encode/decode, the in-memory form of the on-disk
 * structures of docs/FORMAT.md, and the direct-I/O file helpers. Nothing here is
 * part of the public API; non-static names carry the amber__ prefix.
 */
#ifndef AMBER_INTERNAL_H
#define AMBER_INTERNAL_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "amber.h"

/* ---- errors ---- */

#define AMBER__ERRLEN 1024

/* Every handle struct starts with this, so amber_last_error() can read any of them. */
typedef struct amber__err {
  char msg[AMBER__ERRLEN];
} amber__err;

/* Records a failure: formats the message into `e` (when not NULL) and into the
 * calling thread's last-error slot. Returns `code`, so callers write
 * `return amber__fail(&h->err, AMBER_EIO, "...", ...)`. */
int amber__fail(amber__err *e, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Maps an errno value to an AMBER_E* code (ENOSPC, EDQUOT -> AMBER_ENOSPC, ...). */
int amber__errno_code(int err);
/* Copies the thread's last message into `e` (after a callee failed). */
void amber__err_adopt(amber__err *e);

/* ---- little-endian encode/decode ---- */

static inline void amber__put16(uint8_t *p, uint16_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
}
static inline void amber__put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline void amber__put64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint16_t amber__get16(const uint8_t *p) {
  return (uint16_t)(p[0] | (p[1] << 8));
}
static inline uint32_t amber__get32(const uint8_t *p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}
static inline uint64_t amber__get64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}

/* Checked arithmetic: return 1 on overflow. */
static inline int amber__mul_overflow(uint64_t a, uint64_t b, uint64_t *out) {
  return __builtin_mul_overflow(a, b, out);
}
static inline int amber__add_overflow(uint64_t a, uint64_t b, uint64_t *out) {
  return __builtin_add_overflow(a, b, out);
}

uint64_t amber__xxh3(const void *data, size_t len);

/* ---- on-disk structures (docs/FORMAT.md) ---- */

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
  AMBER__ENC_COUNT = 5
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

/* ---- files ---- */

#define AMBER__ALIGN 4096u
#define AMBER__DIRECT_MIN (1u << 20) /* smallest payload read with O_DIRECT */

/* Sequential writer of one file through reused aligned staging buffers, with
 * O_DIRECT where the file system allows it and a background thread doing the
 * writes. The buffers live as long as the struct (init/destroy), files come and
 * go (begin/finish/abort). */
typedef struct amber__wfile amber__wfile;

/* buf_size: the staging ring's total bytes. */
int amber__wfile_create(amber__wfile **out, size_t buf_size, int allow_direct);
void amber__wfile_destroy(amber__wfile *f);
/* Creates "<prefix>.<random>.tmp" exclusively (amber__create_tmp) and starts
 * writing it; amber__wfile_path gives its name until the next begin. */
int amber__wfile_begin(amber__wfile *f, amber__err *e, const char *prefix);
const char *amber__wfile_path(const amber__wfile *f);
/* Appends bytes; copies them into the staging buffers. */
int amber__wfile_append(amber__wfile *f, const void *data, size_t len);
/* Appends `len` bytes and returns their xxh3 (computed over the staged copy while
 * it is in cache, so the source is read once). */
int amber__wfile_append_hashed(amber__wfile *f, const void *data, size_t len,
                               uint64_t *hash);
uint64_t amber__wfile_pos(const amber__wfile *f);
/* Flushes, sets the exact length, fsyncs and closes. */
int amber__wfile_finish(amber__wfile *f);
/* Closes and unlinks the file being written, after a failure. */
void amber__wfile_abort(amber__wfile *f);

/* Tests only: after `after` more successful writes, every write fails with errno
 * `err` until called again with err 0. */
void amber__io_inject_failure(int after, int err);

/* Large reused buffers: 4 KiB-aligned, huge pages requested when large. */
void *amber__big_alloc(size_t n);
void amber__big_free(void *p, size_t n);
/* Faults in the pages of a fresh big buffer now (before it is needed in a
 * latency-sensitive path); its contents become zero. */
void amber__big_prefault(void *p, size_t n);

/* Reads exactly `len` bytes at `off` (retrying short reads and EINTR). */
int amber__pread_full(int fd, void *buf, size_t len, uint64_t off);
int amber__write_full(int fd, const void *buf, size_t len);
/* Creates a new temporary file "<prefix>.<16 random hex digits>.tmp" for
 * writing: never an existing file or link (O_EXCL, O_NOFOLLOW), a name other
 * processes cannot predict, mode 0644 less the umask. The name goes to `path`
 * (`len` bytes), the descriptor to *fd. The store's clean-up removes what a
 * crash leaves of it (its name ends in .tmp). */
int amber__create_tmp(amber__err *e, const char *prefix, char *path, size_t len, int *fd);
/* fsync of a directory by path. */
int amber__fsync_dir(const char *dir);

/* ---- store internals used by writer and reader ---- */

struct amber_store {
  amber__err err;
  char *path;
  int dirfd;
  int lockfd; /* -1 when read-only */
  uint32_t flags;
  uint32_t threads;
  int writers;     /* open writers (at most 1) */
};

/* Builds "<store>/ckpt-<step>.amber" (or with suffix) into buf. */
void amber__ckpt_path(const amber_store *st, uint64_t step, const char *suffix,
                      char *buf, size_t len);
/* The store's internal operations report failures into `e`, the error of the
 * handle on whose behalf they run (a reader, a writer's background work, or the
 * store itself; NULL: the thread's message only), so that handles used from
 * separate threads never write one message buffer. */

/* Reads LATEST: 0 and step/state, AMBER_ENOENT when absent, ECORRUPT if malformed. */
int amber__read_latest(amber_store *st, amber__err *e, uint64_t *step, uint64_t *state);
/* Atomically points LATEST at (step, state): tmp, fsync, rename, fsync dir. */
int amber__write_latest(amber_store *st, amber__err *e, uint64_t step, uint64_t state);
/* The committed state: 0 and LATEST's step and state id; AMBER_ENOENT when the
 * store is empty (no LATEST and at most the one file of an unfinished first
 * commit); AMBER_ECORRUPT when LATEST is malformed, or missing while two or
 * more checkpoint files exist. */
int amber__store_state(amber_store *st, amber__err *e, uint64_t *step, uint64_t *state);
/* Commits a finished temporary file `tmp` as checkpoint `step`. */
int amber__commit_file(amber_store *st, amber__err *e, const char *tmp, uint64_t step);
/* amber_store_list and amber_store_prune, reporting into `e`. */
int amber__store_list(amber_store *st, amber__err *e, amber_ckpt_info **out, size_t *count);
int amber__store_prune(amber_store *st, amber__err *e, uint64_t keep_last, size_t *removed);

/* Where the time of the writer's last save went (for `amber bench`). */
typedef struct amber__save_stats {
  int delta, workers;
  uint64_t bytes;     /* file size */
  double prepare_s;   /* deciding full/delta, loading the reference if needed */
  double chunks_s;    /* wall time of the parallel scan/encode/append loop */
  double scan_cpu_s;  /* summed over workers */
  double encode_cpu_s;
  double finish_s;    /* last writes and fsync of the file */
  double commit_s;    /* rename, directory fsync, LATEST */
  double total_s;
} amber__save_stats;
void amber__writer_stats(const amber_writer *w, amber__save_stats *out);

/* The index of the step a reader opened (for compaction). */
amber__index *amber__reader_index(amber_reader *r);

/* ---- codec (src/codec.c) ---- */

void amber__shuffle(uint8_t *dst, const uint8_t *src, size_t n, size_t width);
void amber__unshuffle(uint8_t *dst, const uint8_t *src, size_t n, size_t width);

#endif /* AMBER_INTERNAL_H */

/*
 * ckpt.h - internal: one checkpoint file (docs/FORMAT.md, "File layout"), both
 * ways. Writing: create the temporary file with its header, append chunk payloads
 * (from many threads), then seal it (index, footer, content hash, fsync) or abort
 * it. Reading: open a committed file with header, footer and index checked, and
 * load a chunk's payload with its checksum checked. The store (store.c) names,
 * commits and lists the files; the writer and compaction assemble their contents.
 */
#ifndef AMBER_CKPT_H
#define AMBER_CKPT_H

#include <stddef.h>
#include <stdint.h>

#include "format.h"
#include "internal.h"

/* The staging ring of a checkpoint file being written, unless the writer's
 * options set another size (amber_writer_opts.stage_bytes, at least the minimum). */
#define AMBER__STAGE_BYTES (32u << 20)
#define AMBER__MIN_STAGE_BYTES (4u << 20)

/* ---- writing ---- */

/* The assembly of checkpoint files, one at a time. Its buffers (the staging ring
 * of amber__wfile, the encoded index) are allocated once and reused by every file. */
typedef struct amber__ckpt_out amber__ckpt_out;

/* stage_bytes: the staging ring's size; allow_direct: O_DIRECT where possible. */
int amber__ckpt_out_create(amber__ckpt_out **out, size_t stage_bytes, int allow_direct);
void amber__ckpt_out_destroy(amber__ckpt_out *o);

/* Starts a new file next to `dst` (a temporary "<dst>.<random>.tmp", named by
 * amber__ckpt_tmp until the next create) and writes its header: checkpoint
 * `step` of the tensors `t[0..n)`, a delta of (parent_step, parent_state), or a
 * full checkpoint when parent_step is AMBER_NO_STEP. Failures of this file, now
 * and later, are reported into `e`. */
int amber__ckpt_create(amber__ckpt_out *o, amber__err *e, const char *dst, uint64_t step,
                       const amber__tensor *t, uint64_t n, uint64_t parent_step,
                       uint64_t parent_state);
const char *amber__ckpt_tmp(const amber__ckpt_out *o);

/* Appends a chunk's payload (`len` bytes, none for an empty payload) and records
 * its offset and size in `c`; the caller fills the rest of `c` (its checksum,
 * computed outside the file's lock). Thread-safe. After a failure of the file,
 * nothing more is appended. */
void amber__ckpt_append(amber__ckpt_out *o, amber__chunk *c, const void *p, size_t len);
/* As amber__ckpt_append, and also sets c->checksum: the payload is hashed while
 * it is staged, so `p` is read once. */
void amber__ckpt_append_hashed(amber__ckpt_out *o, amber__chunk *c, const void *p, size_t len);
/* Records a failure that is not the file's own (a chunk that could not be
 * encoded): `code` with message `why`, unless the file failed already. */
void amber__ckpt_fail(amber__ckpt_out *o, int code, const char *why);
/* The file's first failure so far, or 0 (cheap: workers poll it). */
int amber__ckpt_failed(const amber__ckpt_out *o);

/* Finishes the file: encodes index `ix` (whose chunk entries the appends
 * filled), appends it and the footer, and makes the file durable (flush, exact
 * length, fsync, close). The footer's content hash covers header and index; the
 * state id is that hash, or *keep_id when not NULL (compaction keeps the state
 * id of the file it replaces). On success *state_id and *bytes (the file's
 * size) are set and the temporary file is ready to commit; on failure, or when
 * the file failed earlier, it is removed. */
int amber__ckpt_seal(amber__ckpt_out *o, const amber__index *ix, const uint64_t *keep_id,
                     uint64_t *state_id, uint64_t *bytes);
/* Stops writing and removes the temporary file. */
void amber__ckpt_abort(amber__ckpt_out *o);

/* ---- reading ---- */

/* An opened, checked checkpoint file: header, footer and index in memory. */
/* A byte range of an s3:// file fetched ahead into memory. */
typedef struct amber__span {
  uint64_t off, len;
  uint8_t *buf;
} amber__span;

typedef struct amber__ckpt {
  char *path;
  int fd;
  int dfd; /* O_DIRECT descriptor, or -1 */
  struct amber__s3_obj *obj; /* an s3:// store's file: its object (fd, dfd -1), read by
                                ranges pinned to the ETag it opened */
  amber__span *ahead;        /* its ranges fetched ahead (sorted, disjoint) */
  const uint8_t *map;        /* a file on a memory file system: mapped whole, read in
                                place (a read(2) there costs 2.5x a copy), or NULL */
  size_t nahead;
  uint64_t size;
  amber__header hdr;
  amber__footer ftr;
  amber__index ix;
} amber__ckpt;

/* Opens checkpoint `step` of the store and checks its header, footer and index. */
int amber__ckpt_open(amber__err *e, amber_store *st, uint64_t step, amber__ckpt *c);
void amber__ckpt_close(amber__ckpt *c);
/* Opens the checkpoint file at `path`, whatever step it holds, and checks it as
 * amber__ckpt_open does. `how`: AMBER__OPEN_PLAIN; AMBER__OPEN_SHARED also takes a
 * shared flock on it for as long as it is open, without waiting (AMBER_ELOCKED while
 * an exclusive one is held): how an image (src/image.c) is read while its drain may
 * change it in place under an exclusive flock; AMBER__OPEN_WRITE opens it read-write,
 * unmapped and unlocked (the drain's own open: it locks for each change). */
enum { AMBER__OPEN_PLAIN, AMBER__OPEN_SHARED, AMBER__OPEN_WRITE };
int amber__ckpt_open_file(amber__err *e, const char *path, int how, amber__ckpt *c);

/* Reads the payload of chunk `ch` of file `c` into `buf` (>= ch->size bytes) and
 * checks its checksum. `stage` is a reusable aligned scratch buffer for O_DIRECT
 * reads, grown as needed. */
typedef struct amber__stage {
  uint8_t *buf;
  size_t cap;
} amber__stage;
int amber__chunk_load(amber__err *e, amber__ckpt *c, const amber__chunk *ch,
                      amber__stage *stage, const uint8_t **payload);
void amber__stage_free(amber__stage *s);
/* A payload stored as the chunk's bytes (RAW), read straight into their place `dst`
 * (>= ch->size bytes) and checked there, without a stage (a mapped file: copied and
 * hashed block by block, in one pass): 0, a failure (dst then holds bytes that did
 * not check), or 1 when `c` is read otherwise (an object, an O_DIRECT read, an empty
 * payload) and the caller must use amber__chunk_load. `stream`: `dst` is the
 * restore's final place, which nothing reads next (a mapped file's copy may then
 * bypass the cache). */
int amber__chunk_read_into(amber__err *e, amber__ckpt *c, const amber__chunk *ch, uint8_t *dst,
                           int stream);

/* ---- reading ahead (s3:// files) ----
 *
 * A restore from an object store does not read chunk by chunk: each request costs a
 * round trip. The reader fetches the payloads a batch of its jobs needs first, in as
 * few ranges as their offsets allow, in parallel, and amber__chunk_load then finds
 * them in memory (one that it does not find it reads on its own). */

/* One payload a restore needs: `len` bytes at `off` of file `c`. */
typedef struct amber__need {
  amber__ckpt *c;
  uint64_t off, len;
} amber__need;
/* Sets the spans that the `n` needs (sorted here, by file and offset) call for:
 * neighbours less than AMBER__AHEAD_GAP apart share one, up to AMBER__AHEAD_SPAN bytes
 * unless a payload is longer; each file's spans replace its earlier ones, their
 * buffers allocated, not yet filled. *nspans gets how many there are in all. */
#define AMBER__AHEAD_GAP (1u << 20)
#define AMBER__AHEAD_SPAN (64u << 20)
int amber__ahead_plan(amber__err *e, amber__need *need, size_t n, size_t *nspans);
/* Fills span `i` of file `c` (one ranged GET, in parallel pieces when long). */
int amber__ahead_fetch(amber__err *e, amber__ckpt *c, size_t i);
/* Frees file `c`'s spans. */
void amber__ahead_free(amber__ckpt *c);

#endif /* AMBER_CKPT_H */

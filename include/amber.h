/*
 * amber.h - the one public header of libamber.
 *
 * amber checkpoints training state (weights, optimizer moments, counters) into a
 * store: a directory of committed checkpoints, each either full (every byte of every
 * tensor) or a delta against its parent. This header is the whole C API: versions,
 * error codes, the store, the writer that saves checkpoints, and the reader that
 * lists, restores and verifies them. The on-disk format is specified in
 * docs/FORMAT.md; this header never exposes it.
 *
 * Conventions (docs/DESIGN.md, "How the code is written"):
 *  - Every function that can fail returns int: 0 on success or a negative AMBER_E*
 *    code. Results come back through out-parameters.
 *  - Every handle keeps a human-readable message for its last failure, naming the
 *    file, the step and what was expected; amber_last_error() returns it. The
 *    library never prints and never exits.
 *  - Handles are opaque, created by *_open and released by *_close, which accept
 *    NULL. Options structs are filled by *_opts_init() and passed by const
 *    pointer; NULL means defaults; zero in a field means "default"; reserved fields
 *    must be zero.
 *  - Thread safety: one handle must not be used by two threads at once. Separate
 *    handles (even on the same store) may be used from separate threads.
 */
#ifndef AMBER_H
#define AMBER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define AMBER_API __attribute__((visibility("default")))
#else
#define AMBER_API
#endif

/* ---- Versions ---------------------------------------------------------------- */

/* The library's version (semantic versioning). */
#define AMBER_VERSION_MAJOR 0
#define AMBER_VERSION_MINOR 2
#define AMBER_VERSION_PATCH 0
#define AMBER_VERSION_STRING "0.2.0"

/* The newest file-format version this library writes and reads (docs/FORMAT.md).
 * Readers accept every minor version of their major; a newer major is refused. A
 * file records the oldest version that describes it: 1.0 unless it holds a
 * tensor of a dtype that 1.1 added (U16, U32, U64), 1.3 when a tensor's policy
 * has a value code ("@q4": quantized deltas). A multi-rank step's manifest says
 * 1.2, or 1.4 when a rank holds several boxes of one global tensor. */
#define AMBER_FORMAT_MAJOR 1
#define AMBER_FORMAT_MINOR 4

/* Returns (MAJOR << 16) | (MINOR << 8) | PATCH of the linked library. */
AMBER_API uint32_t amber_version(void);
/* Returns the linked library's version as "MAJOR.MINOR.PATCH"; static storage. */
AMBER_API const char *amber_version_string(void);

/* ---- Errors ------------------------------------------------------------------ */

/* XX(name, value, message). One table feeds the enum and amber_strerror(). */
#define AMBER_ERRNO_MAP(XX)                                                      \
  XX(EINVAL, -1, "invalid argument")                                             \
  XX(ENOMEM, -2, "out of memory")                                                \
  XX(EIO, -3, "input/output error")                                              \
  XX(ENOSPC, -4, "no space left on device")                                      \
  XX(ENOENT, -5, "not found")                                                    \
  XX(EEXIST, -6, "already exists")                                               \
  XX(ECORRUPT, -7, "corrupt or truncated data")                                  \
  XX(EFORMAT, -8, "unsupported format version or feature")                      \
  XX(ELOCKED, -9, "store is locked by another writer")                           \
  XX(EMISMATCH, -10, "tensor does not match (name, dtype or shape)")             \
  XX(EPARENT, -11, "parent checkpoint missing or different")                     \
  XX(ERANGE, -12, "value out of range")                                          \
  XX(EBUSY, -13, "operation in progress")                                        \
  XX(ECANCELED, -14, "operation canceled")                                       \
  XX(EPERM, -15, "permission denied")                                            \
  XX(EREADONLY, -16, "store opened read-only")                                   \
  XX(ECHANGED, -17, "the data changed while it was being saved")                 \
  XX(ETIMEDOUT, -18, "timed out")

typedef enum amber_errno {
#define AMBER__XX(name, value, msg) AMBER_##name = (value),
  AMBER_ERRNO_MAP(AMBER__XX)
#undef AMBER__XX
} amber_errno;

/* Returns a static description of an AMBER_E* code ("unknown error" otherwise). */
AMBER_API const char *amber_strerror(int code);
/* Returns the short symbolic name of an AMBER_E* code, e.g. "AMBER_ECORRUPT". */
AMBER_API const char *amber_err_name(int code);

/* Returns the detailed message of the last failure on `handle`, which may be an
 * amber_store*, amber_writer*, amber_reader*, amber_global_writer*,
 * amber_global_reader*, amber_drain* or amber_replicas*. With NULL, returns the calling
 * thread's most recent failure of any call (useful when an _open failed and no
 * handle exists). Never NULL; "" when there was none. Valid until the next call on
 * the same handle or thread. */
AMBER_API const char *amber_last_error(const void *handle);

/* ---- Data types --------------------------------------------------------------- */

/* Values are stored on disk; never renumber. */
typedef enum amber_dtype {
  AMBER_F32 = 1,
  AMBER_F16 = 2,
  AMBER_BF16 = 3,
  AMBER_F64 = 4,
  AMBER_F8_E4M3 = 5,
  AMBER_F8_E5M2 = 6,
  AMBER_I64 = 7,
  AMBER_I32 = 8,
  AMBER_I16 = 9,
  AMBER_I8 = 10,
  AMBER_U8 = 11,
  AMBER_BOOL = 12,
  AMBER_U16 = 13, /* format 1.1 */
  AMBER_U32 = 14, /* format 1.1 */
  AMBER_U64 = 15  /* format 1.1 */
} amber_dtype;

#define AMBER_MAX_DIMS 8

/* Bytes per element of `dt`; 0 for an unknown dtype. */
AMBER_API size_t amber_dtype_size(int dt);
/* Lower-case name ("f32", "bf16", "f8_e4m3", "bool", ...); NULL for unknown. */
AMBER_API const char *amber_dtype_name(int dt);
/* Parses a name as returned by amber_dtype_name(); 0 when unknown. */
AMBER_API int amber_dtype_from_name(const char *name);

/* Frees memory that the library handed to the caller (e.g. amber_store_list). */
AMBER_API void amber_free(void *p);

/* Progress of long operations, for programs that show it (the CLI on a terminal):
 * fn(ctx, what, done, total) is called as the work advances, with `what` one of
 * "save" (a checkpoint's chunks written), "verify" (amber_reader_verify: tensors
 * checked), "compact" (amber_store_compact: tensors rewritten) or "drain"
 * (amber_drain_run: files copied to the durable tier), `done` of `total`
 * bytes (done == total once at the end). It is called from the library's threads,
 * possibly several at once, and must be quick and thread-safe; it must not call
 * amber. Process-wide; NULL removes it. Set it while no operation runs. */
typedef void (*amber_progress_fn)(void *ctx, const char *what, uint64_t done, uint64_t total);
AMBER_API void amber_set_progress(amber_progress_fn fn, void *ctx);

/* ---- Store -------------------------------------------------------------------- */

typedef struct amber_store amber_store;

/* Open read-only. Read-only means read-only: the open and everything done with
 * the handle (listing, readers, verify) never create, modify or remove anything,
 * not even the store directory, its lock file or temporary files; so there is no
 * lock and no clean-up of what a crashed writer left. A missing path (or one that
 * is not a directory) fails with AMBER_ENOENT and the message "no store at PATH:
 * ...", whatever the permissions of its parent. Implies AMBER_OPEN_NOCREATE. */
#define AMBER_OPEN_READONLY (1u << 0)
/* Fail with AMBER_ENOENT ("no store at PATH: ...") instead of creating a missing
 * store directory; nothing is created, not even for a moment. */
#define AMBER_OPEN_NOCREATE (1u << 1)

typedef struct amber_store_opts {
  uint32_t flags;        /* AMBER_OPEN_* */
  uint32_t threads;      /* worker threads for encode and restore; 0 = online CPUs for
                            saves, and at least 4 for restores (which wait on the
                            disk: more reads in flight) */
  uint64_t reserved[6];  /* must be zero */
} amber_store_opts;

/* Fills `opts` with defaults. */
AMBER_API void amber_store_opts_init(amber_store_opts *opts);

/* Opens the store at directory `path`, creating it and its parents if missing,
 * unless opened AMBER_OPEN_READONLY or AMBER_OPEN_NOCREATE. A multi-rank store's
 * directory (it holds GLOBAL or rank-00000/) is refused with AMBER_EINVAL: read it
 * with amber_global_reader_open, write it with amber_global_writer_open.
 * A writable open takes an exclusive lock on the store (AMBER_ELOCKED if another
 * process or handle holds it) and removes temporary files and uncommitted
 * checkpoint files that a crashed writer left behind.
 *
 * `path` may be an object store, "s3://bucket/prefix" (built with S3 support;
 * endpoint, region and credentials from the AWS environment variables and files, as
 * the AWS CLI reads them: docs/DESIGN.md, "Object stores (S3)"). Readers, listing,
 * verify, compact and prune work on it as on a directory, reading objects by ranges;
 * a read-only open of a prefix that holds nothing is AMBER_ENOENT ("no store at
 * URL"), a missing bucket AMBER_ENOENT and refused credentials AMBER_EPERM, each
 * naming the object. An object store has no lock: a writable open (for compact and
 * prune) takes none and cleans nothing (amber_store_sweep does, after a grace
 * period), and amber_writer_open refuses it: a writer writes a directory that a drain
 * moves to the object store (amber_drain_start(DIR, "s3://...")).
 * out: receives the handle; release with amber_store_close().
 * opts: NULL for defaults. */
AMBER_API int amber_store_open(amber_store **out, const char *path,
                               const amber_store_opts *opts);
/* Releases the lock and the handle. Accepts NULL. Readers and writers opened on
 * the store must be closed first. */
AMBER_API void amber_store_close(amber_store *st);

/* Directory of the store as given to amber_store_open(); owned by the store. */
AMBER_API const char *amber_store_path(const amber_store *st);

#define AMBER_KIND_FULL 0u
#define AMBER_KIND_DELTA 1u
/* A step that means "none" (the parent of a full checkpoint) or "latest". */
#define AMBER_NO_STEP UINT64_MAX
#define AMBER_LATEST UINT64_MAX

/* amber_ckpt_info.flags: the file's header or footer cannot be read or fails its
 * checks; kind, parent and hash are then only as far as known. */
#define AMBER_CKPT_DAMAGED (1u << 0)

typedef struct amber_ckpt_info {
  uint64_t step;
  uint32_t kind;      /* AMBER_KIND_FULL or AMBER_KIND_DELTA */
  uint32_t flags;     /* AMBER_CKPT_* */
  uint64_t parent;    /* parent step, AMBER_NO_STEP for a full checkpoint */
  uint64_t bytes;     /* size of the checkpoint's file on disk */
  uint64_t hash;      /* state id (docs/FORMAT.md) */
  uint64_t reserved[3];
} amber_ckpt_info;

/* Lists committed checkpoints in increasing step order. Reads each file's header
 * and footer (not its data); a checkpoint whose header or footer is damaged is
 * still listed, flagged AMBER_CKPT_DAMAGED, with kind/parent/hash as far as known,
 * and verify reports it.
 * out: receives an array to free with amber_free() (NULL when count is 0). */
AMBER_API int amber_store_list(amber_store *st, amber_ckpt_info **out, size_t *count);

/* The latest committed step; AMBER_ENOENT when the store is empty. */
AMBER_API int amber_store_latest(amber_store *st, uint64_t *step);

/* Rewrites committed step `step` as a full checkpoint restoring exactly the same
 * state (its restore is verified first). Later deltas and LATEST stay valid:
 * the new file keeps the step's state id. A crash leaves the old or the new
 * file, never neither. No-op for a step that is already full. Needs the store
 * open writable. */
AMBER_API int amber_store_compact(amber_store *st, uint64_t step);

/* Deletes every checkpoint except the newest `keep_last` and the checkpoints
 * their restores need (parents back to a full checkpoint). keep_last >= 1.
 * removed: if not NULL, receives the number of files deleted. A file that cannot
 * be deleted does not stop the others; the first such failure is returned. */
AMBER_API int amber_store_prune(amber_store *st, uint64_t keep_last, size_t *removed);

/* An s3:// store (single- or multi-rank, by its URL `path`): removes what interrupted
 * uploads left and no pointer reaches, when older than `grace_s` seconds: multipart
 * uploads never completed, checkpoint objects after their store's LATEST (or the
 * lone one of a store without LATEST), manifests after GLOBAL. The grace period is
 * there because another process's upload in flight (a running drain's) looks the
 * same until its pointer moves: give more than the longest upload takes (`amber
 * prune` gives 3600). A directory store: nothing (its writable open removes such
 * leftovers, holding the store's lock). removed: if not NULL, what was removed. */
AMBER_API int amber_store_sweep(const char *path, uint64_t grace_s, size_t *removed);

/* ---- Writer ------------------------------------------------------------------- */

typedef struct amber_writer amber_writer;

/* Compress full checkpoints (byte-shuffle + zstd) instead of storing raw bytes.
 * Smaller files on float data by a few percent, at a large cost in save speed. */
#define AMBER_WRITER_COMPRESS_FULL (1u << 0)
/* Never use O_DIRECT (it is used when the file system supports it). */
#define AMBER_WRITER_NO_DIRECT_IO (1u << 1)
/* amber_global_writer_open only ("local mode"; amber_writer_open refuses it): each
 * rank's `path` is its own or its host's (a memory tier such as /dev/shm/run on
 * every node), never seen by the ranks of other hosts. Every rank's path gets the
 * step's manifest and GLOBAL at each commit (rank 0 broadcasts the manifest's
 * bytes), and holds the rank stores of the ranks that write there. See
 * amber_global_writer_open and docs/DESIGN.md, "Local mode". */
#define AMBER_WRITER_GLOBAL_LOCAL (1u << 2)

typedef struct amber_writer_opts {
  uint64_t chunk_elems;  /* elements per chunk; 0 = 1 Mi (1048576); at most 16 Mi and
                            128 MiB per chunk */
  uint32_t flags;        /* AMBER_WRITER_* */
  int32_t zstd_level;    /* 0 = default (-1: zstd's fast mode; measured by amber bench as
                            half the encode time of level 1 for 0.5% larger deltas;
                            quantized delta chunks: 1, since their codes need the
                            entropy coding that negative levels skip: 27% smaller
                            deltas for about the same time). A level set here applies
                            to both */
  uint32_t full_every;   /* a full checkpoint after this many deltas; 0 = default (50),
                            UINT32_MAX = only when forced or needed */
  uint32_t reserved0;    /* must be zero */
  double full_share;     /* also a full checkpoint once the deltas written since the last
                            full add up to this share of its size; 0 = default (0.5),
                            negative = never. A single delta that reaches it (dense
                            changes: the exact policy under Adam makes deltas ~75% of a
                            full and slower to write) makes the next 1, 2, 4, ... 32
                            saves full before a delta is tried again */
  uint64_t stage_bytes;  /* host memory for encoded data waiting to be written: when it
                            is full, scan and encode wait for the disk (back-pressure);
                            0 = default (32 MiB), at least 4 MiB. Besides it the writer
                            holds the reference state (one copy of the tensors) and, per
                            worker thread, about 7x the largest chunk of scan buffers. */
  uint64_t keep_last;    /* retention: after each committed save, remove every checkpoint
                            except the newest keep_last and those their restores need
                            (as amber_store_prune); 0 = keep everything */
  uint64_t reserved[4];  /* must be zero */
} amber_writer_opts;

AMBER_API void amber_writer_opts_init(amber_writer_opts *opts);

/* Creates a writer on a store opened writable. Declare tensors with
 * amber_writer_add(), then call amber_writer_save() for each step.
 * opts: NULL for defaults. The writer must be closed before its store. */
AMBER_API int amber_writer_open(amber_writer **out, amber_store *st,
                                const amber_writer_opts *opts);

/* Declares a tensor: UTF-8 `name` (unique, 1..65535 bytes, copied), dtype, shape
 * (`ndim` <= AMBER_MAX_DIMS, copied; ndim 0 is a scalar) and `data`, the address of
 * its row-major little-endian bytes in host memory. amber does not copy or own
 * `data`: it reads it during every amber_writer_save() until the tensor's pointer
 * is changed with amber_writer_set_data() or the writer is closed. Tensors are
 * saved in declaration order. Declarations are fixed after the first save.
 * index: if not NULL, receives the tensor's position (0, 1, 2, ...). */
AMBER_API int amber_writer_add(amber_writer *w, const char *name, int dtype,
                               uint32_t ndim, const int64_t *shape, const void *data,
                               size_t *index);

/* Points tensor `index` at new host memory of the same size (e.g. after the
 * training framework reallocated it). */
AMBER_API int amber_writer_set_data(amber_writer *w, size_t index, const void *data);

/* Adds a policy rule: "SPEC" or "PATTERN=SPEC", where SPEC is `exact`,
 * `threshold:ABS[:REL]`, `threshold:ABS[:REL]/SHARE:MULT` (a share cap: at most
 * SHARE of each chunk's elements a delta, the farthest over their bound first, plus
 * every one beyond MULT bounds; every restored element within MULT bounds) or
 * `budget:FRAC[:CAP]`, and PATTERN a glob (fnmatch) on
 * tensor names; a rule without a pattern matches every tensor. For each tensor the
 * last matching rule wins; with none, the policy is `exact`. Integer and bool
 * tensors are always exact. AMBER_EINVAL with a message for a malformed rule.
 * Rules apply to every later save.
 *
 * Quantized deltas: a threshold or budget SPEC followed by `@q8`, `@q4` or `@bf16`
 * stores each selected change as an 8- or 4-bit code times a step (threshold: half
 * the element's bound; budget: per 64 selected elements, their largest change over
 * the largest code, at most CAP) or as a bf16 delta, and moves the reference to
 * what a restore decodes, so the rounding stays in live - reference like any
 * change left out; an element a code cannot carry within the bound is stored
 * whole. `+lead` after @q8/@q4 picks the code farthest in the change's direction
 * that stays within the bound (for quantities that drift one way). The bound of
 * the policy holds for every element as without a code. f32, f64, bf16 and f16
 * tensors are coded; f8 tensors store their selected values whole.
 *
 * Units: a threshold's ABS or a budget's CAP written `Nu` (e.g. `threshold:0.5u`)
 * means N times the tensor's unit, set with amber_writer_set_units (a learning
 * rate, say); a tensor without a unit is exact under such a rule. */
AMBER_API int amber_writer_add_policy(amber_writer *w, const char *rule);
/* Whether `rule` is a policy rule that amber_writer_add_policy takes: 0, or
 * AMBER_EINVAL with the reason in amber_last_error(NULL). For checking a
 * configuration before anything is opened. Thread-safe. */
AMBER_API int amber_policy_check(const char *rule);

/* Sets the units of the first n declared tensors (declaration order) for the
 * following saves: "Nu" in a rule means N * units[i] for tensor i; 0 means no unit
 * (the tensor is exact under a rule with units). Each save records its numbers
 * written out as the tensor's policy. AMBER_EINVAL for a negative or non-finite
 * unit or n beyond the declared tensors; AMBER_EBUSY during a save. */
AMBER_API int amber_writer_set_units(amber_writer *w, const double *units, size_t n);

/* Sets the checkpoint's metadata: small non-tensor state (counters,
 * hyper-parameters, ...) as `len` bytes of UTF-8 JSON, stored and returned exactly.
 * Copied; applies to every later save until set again. len 0 clears it. */
AMBER_API int amber_writer_set_meta(amber_writer *w, const char *json, size_t len);

/* Force a full checkpoint. */
#define AMBER_SAVE_FULL (1u << 0)
/* A full save that does not keep the writer's reference state, for one-off
 * saves such as `amber import`: it writes straight from the tensors' memory and
 * never allocates the reference. A later delta of this writer loads the
 * reference from the store first. Ignored by a save that is a delta. */
#define AMBER_SAVE_NO_REFERENCE (1u << 1)
/* amber_writer_begin only: the save is written and made durable in the
 * background but committed only when the caller says so with
 * amber_writer_confirm (see "Confirming a save" below). */
#define AMBER_SAVE_CONFIRM (1u << 2)
/* amber_global_writer_begin and _save only: the ranks have already agreed on full or
 * delta (every rank passes the same AMBER_SAVE_FULL, having asked
 * amber_global_writer_wants_full and exchanged the answers in a vote of its own), so
 * begin makes no collective of its own to decide it. A caller that votes on other
 * things before each step anyway (amber.torch does) saves a collective per step. */
#define AMBER_SAVE_VOTED (1u << 3)

/* Saves the declared tensors as checkpoint `step` and commits it: when this
 * returns 0 the checkpoint is durable and is the store's latest. The checkpoint
 * is a delta against the writer's reference state (the state that restoring the
 * latest checkpoint yields, loaded from the store on the first save if needed)
 * unless AMBER_SAVE_FULL is given, the store is empty, the declared tensors differ
 * from the latest checkpoint's, a previous save failed, or the cadence
 * (full_every, full_share) calls for a full one. `step` must be
 * greater than the store's latest step (AMBER_EEXIST otherwise). On failure the
 * store is unchanged: earlier checkpoints stay intact and nothing half-written
 * becomes visible. Reads the tensors' memory during the call only. */
AMBER_API int amber_writer_save(amber_writer *w, uint64_t step, uint32_t flags);

/* States that the declared tensors' memory (the addresses given to
 * amber_writer_add / amber_writer_set_data) holds exactly the restored state of
 * committed step `step`, e.g. right after the caller restored that step into it,
 * so that the writer need not read the store to build its reference state. The
 * writer checks that `step` is the store's latest step (AMBER_EINVAL otherwise;
 * AMBER_ENOENT for an empty store) and that its tensor table matches the
 * declarations in order, names, dtypes, shapes and chunking (AMBER_EMISMATCH with
 * the first difference otherwise); it adopts the step's chunking and the cadence
 * counters (full_every, full_share) from the files' headers and indexes, reads no
 * tensor data, then copies the tensors into its reference state now, with its
 * worker threads: the reference's memory is allocated and faulted in here, not
 * in the next save. The next save is then a delta against `step` (unless the
 * cadence calls for a full one).
 * amber cannot check the claim: if the memory does not hold that state, the
 * later deltas restore wrong values. Reads the tensors' memory during the call
 * only. AMBER_EBUSY while a save is in progress or not yet reported by
 * amber_writer_wait. On failure the next save reloads the reference from the
 * store as usual. */
AMBER_API int amber_writer_seed_reference(amber_writer *w, uint64_t step);

/* ---- Asynchronous save: begin, fence, wait ----
 *
 * amber_writer_save(w, step, flags) is amber_writer_begin + amber_writer_wait.
 * Split, it lets training compute while the checkpoint is taken:
 *
 *   optimizer_step();                    // tensors now hold step N
 *   amber_writer_begin(w, N, 0);         // returns at once; the scan starts
 *   forward(); backward();               // compute, but do not modify the tensors
 *   amber_writer_fence(w);               // blocks only until the scan is done
 *   optimizer_step();                    // tensors may change again
 *   ...
 *   amber_writer_wait(w);                // N is committed and durable (or failed)
 *
 * Ownership: from amber_writer_begin until amber_writer_fence (or wait, or close)
 * returns, amber reads the declared tensors' memory; the caller must not modify
 * or free it. After the fence amber holds no reference to it: encoding, writing
 * and the commit work on amber's own copies (the reference state). Metadata set
 * with amber_writer_set_meta is copied at begin.
 *
 * Errors of the background work are kept until reported: by amber_writer_wait,
 * or else by the next amber_writer_begin (which then starts nothing), or by
 * amber_writer_close's caller through amber_writer_wait. A failed save leaves
 * the committed checkpoints intact, and the writer's reference state is
 * restored from the latest committed checkpoint on the next save, so later
 * saves stay correct. */

/* ---- Confirming a save: the commit gate ----
 *
 * The rule: from amber_writer_begin until amber_writer_fence returns, the
 * declared tensors must not change. amber cannot see a write that breaks it; a
 * caller that can (e.g. with version counters of its own, read at begin and
 * compared after the fence) begins the save with AMBER_SAVE_CONFIRM and gives
 * its verdict with amber_writer_confirm:
 *
 *   amber_writer_begin(w, N, AMBER_SAVE_CONFIRM);  // note the tensors' versions
 *   forward(); backward();
 *   amber_writer_fence(w);
 *   amber_writer_confirm(w, versions_unchanged, "tensor 'x' changed before the fence");
 *   optimizer_step();
 *   ...
 *   amber_writer_wait(w);
 *
 * The background work scans, encodes and writes the file and makes it durable,
 * then waits (on a condition variable: nothing polls, the gate costs nothing
 * when the verdict is already there) for the verdict before it renames the file
 * into place and moves LATEST. A veto (ok == 0) makes the save fail with
 * AMBER_ECHANGED and the caller's `why` in its message: the temporary file is
 * removed, nothing becomes visible, and the reference state is restored as after
 * any failed save, so the next save is correct.
 *
 * Without a verdict: amber_writer_wait and amber_writer_close refuse the commit
 * (AMBER_ECHANGED, "not confirmed"; never a deadlock); amber_writer_begin
 * returns AMBER_EBUSY as for any save in progress; amber_writer_cancel stops
 * the save (AMBER_ECANCELED). AMBER_SAVE_CONFIRM is refused by
 * amber_writer_save (nobody could confirm it). */

/* Starts saving checkpoint `step` (same rules as amber_writer_save) and returns
 * once the scan has been handed to the worker threads. AMBER_EBUSY if a save is
 * still in progress (call amber_writer_wait first). */
AMBER_API int amber_writer_begin(amber_writer *w, uint64_t step, uint32_t flags);
/* Blocks until the save in progress no longer reads the tensors' memory. Returns
 * 0 at once when no save is in progress. Safe to call more than once. */
AMBER_API int amber_writer_fence(amber_writer *w);
/* Blocks until the save in progress is committed and durable, or has failed, and
 * returns its result (0 when no save was in progress and no error is pending). */
AMBER_API int amber_writer_wait(amber_writer *w);

/* Gives the verdict on the save in progress that was begun with
 * AMBER_SAVE_CONFIRM: ok != 0 lets it commit; ok == 0 makes it fail with
 * AMBER_ECHANGED, its message "step N not committed: WHY" (`why` may be NULL;
 * copied). Waits for the scan first, as amber_writer_fence does, so a verdict
 * always covers the whole time the tensors were read. Returns 0 when the verdict
 * was taken (also when the save had already failed for another reason: wait
 * reports that), AMBER_EINVAL when no save awaits a verdict (none in progress,
 * begun without AMBER_SAVE_CONFIRM, or already confirmed). The result of the
 * save itself comes from amber_writer_wait. Thread safety: as for every call on
 * the writer, never concurrently with another call on it. */
AMBER_API int amber_writer_confirm(amber_writer *w, int ok, const char *why);

/* Stops the save in progress if it has not reached its commit yet, waits until it
 * has stopped, and returns its result: AMBER_ECANCELED when it was stopped (the
 * store is unchanged; the next save reloads the reference), 0 when it had
 * already committed. 0 when no save is in progress. */
AMBER_API int amber_writer_cancel(amber_writer *w);

/* With keep_last: the outcome of the prune that followed the last committed save
 * (call it when no save is in progress, e.g. after amber_writer_wait). A failed
 * prune does not fail the save (the checkpoint is committed and durable); it is
 * tried again after the next save. Returns 0 or the prune's error code;
 * *removed (may be NULL) receives the number of files it removed, *message (may be
 * NULL) its error message, owned by the writer and valid until the next save. */
AMBER_API int amber_writer_prune_status(const amber_writer *w, size_t *removed,
                                        const char **message);

/* Where the time of the writer's last save went: for profiling a training
 * loop's checkpoints, and what `amber bench` prints. Times are wall-clock
 * seconds unless named cpu. */
typedef struct amber_save_stats {
  uint32_t kind;        /* AMBER_KIND_FULL or AMBER_KIND_DELTA */
  uint32_t workers;     /* threads of the chunk pass, the save thread included */
  uint64_t bytes;       /* size of the checkpoint's file */
  double prepare_s;     /* deciding full or delta, loading the reference if needed */
  double chunks_s;      /* the parallel scan, encode and append over every chunk */
  double scan_cpu_s;    /* scan time summed over the workers */
  double encode_cpu_s;  /* encode time summed over the workers */
  double finish_s;      /* the last writes and the fsync of the file */
  double commit_s;      /* rename, directory fsync, LATEST */
  double total_s;       /* the whole save, begin to commit */
  uint64_t reserved[4]; /* zero */
} amber_save_stats;

/* Fills `out` with the figures of the writer's last save. Call it when no save is
 * in progress (after amber_writer_save or amber_writer_wait returned 0): during a
 * save, and after a failed one, the figures are unspecified. All zero before the
 * first save. Returns 0, or AMBER_EINVAL when an argument is NULL. */
AMBER_API int amber_writer_save_stats(const amber_writer *w, amber_save_stats *out);

/* ---- Pre-selected tensors: the selection made by the caller ----
 *
 * For state that lives where amber cannot scan it (a GPU), the caller keeps the
 * tensor's reference itself, selects on its own device under the tensor's policy,
 * and hands amber only the selected elements of each chunk. amber encodes, writes
 * and commits them like any delta (same encodings, checksums, commit protocol and
 * failure behaviour) and keeps no reference for such a tensor: the caller owns
 * it, moves it only by what it hands over, and after a failed save puts it back as
 * it was. A save of a writer with pre-selected tensors goes:
 *
 *   amber_writer_plan(w, N, flags, &kind);       // full or delta, chunking, policies
 *   amber_writer_info(w, i, &info);              // per tensor: chunk_elems, policy
 *   ... select on the device, copy indices and values to host buffers ...
 *   amber_writer_set_selection(w, i, sels, info.nchunks);   // each pre-selected tensor
 *   amber_writer_begin(w, N, flags);             // or amber_writer_save
 *
 * Ownership: the selections' indices and values are read until amber_writer_fence
 * (or wait, or close) returns, as the declared tensors' memory is. */

/* amber_chunk_sel.count: every element of the chunk, values in chunk order. */
#define AMBER_SELECT_WHOLE UINT64_MAX

/* Value codes of a quantized selection (docs/FORMAT.md, "Quantized sparse body"). */
#define AMBER_QV_Q8 1   /* int8 codes in -127..127 */
#define AMBER_QV_Q4 2   /* 4-bit codes in -8..7 */
#define AMBER_QV_BF16 3 /* bf16 deltas */

/* A selection stored quantized: the selected element with ordinal i (its place in
 * the selection) and reference value r restores to r + codes[i] * (steps[i >>
 * group_log2] + rel_step * |r|) (Q8, Q4; each operation rounded to the precision
 * of the dtype's arithmetic: f32, or f64 for f64, then to the dtype), or to r +
 * codes[i] as a bf16 (BF16), or, escaped, to its value in esc_vals. The caller
 * quantizes (as src/quant.c does) and moves its own reference to exactly these
 * values. f32, f64, bf16 and f16 tensors only. */
typedef struct amber_chunk_qsel {
  uint32_t mode;        /* AMBER_QV_* */
  uint32_t group_log2;  /* Q8, Q4: selected elements per step, log2, at most 24; BF16: 0 */
  float rel_step;       /* Q8, Q4: b of the step; BF16: 0 */
  const float *steps;   /* Q8, Q4: one step per group of 2^group_log2 elements */
  const void *codes;    /* count codes: int8_t (Q8, Q4) or uint16_t bf16 bits (BF16);
                           0 for an escaped element */
  uint64_t nesc;        /* escaped elements, stored whole */
  const uint32_t *esc;  /* their ordinals, strictly increasing, each below count */
  const void *esc_vals; /* their new values, nesc elements of the dtype */
} amber_chunk_qsel;

/* What one chunk of a pre-selected tensor stores in a save. */
typedef struct amber_chunk_sel {
  uint64_t count;      /* selected elements (0: unchanged), or AMBER_SELECT_WHOLE */
  const uint32_t *idx; /* count strictly increasing indices within the chunk, each
                          below its element count; ignored for AMBER_SELECT_WHOLE */
  const void *vals;    /* the selected elements' new values, count (or, whole, the
                          chunk's) elements of the tensor's dtype, little-endian;
                          not read when quant is set */
  const amber_chunk_qsel *quant; /* NULL, or the selection stored quantized (a delta;
                          read, with what it points to, as long as idx) */
} amber_chunk_sel;

/* Declares a pre-selected tensor: as amber_writer_add, without memory to read; each
 * save takes its chunks from amber_writer_set_selection instead. Policies apply
 * to it as to any tensor (amber_writer_info tells which): the caller's selection
 * must follow them, amber records the policy but cannot check it. */
AMBER_API int amber_writer_add_preselected(amber_writer *w, const char *name, int dtype,
                                           uint32_t ndim, const int64_t *shape,
                                           size_t *index);

/* Decides what the next save of `step` with `flags` will be and fixes it: *kind
 * gets AMBER_KIND_FULL or AMBER_KIND_DELTA, and an amber_writer_begin or
 * amber_writer_save of the same step and flags that follows makes that kind of
 * save (any other request decides again). It also fixes the declarations and
 * their chunking on the first call, and resolves each tensor's policy. The same
 * checks as a save (AMBER_EEXIST for a step not after the latest, ...);
 * AMBER_EBUSY while a save is in progress, and a failure of the last save not
 * yet reported is returned (as amber_writer_begin does). */
AMBER_API int amber_writer_plan(amber_writer *w, uint64_t step, uint32_t flags,
                                uint32_t *kind);

/* Tensor `index` as the writer will save it: name, dtype, shape, chunk_elems and
 * nchunks (final once amber_writer_plan or a save has run), and policy (the spec
 * resolved by the last plan or save, "exact" before; owned by the writer, valid
 * until its next plan or save). stored_bytes and stored_elems are 0. */
struct amber_tensor_info; /* below, with the reader */
AMBER_API int amber_writer_info(const amber_writer *w, size_t index,
                                struct amber_tensor_info *out);

/* Gives pre-selected tensor `index` its selection for the next save: `nchunks`
 * (its nchunks) entries, chunk j's in chunks[j] (the array is copied; what it points
 * to is not). Call it after amber_writer_plan, for every pre-selected tensor before
 * each save; a save consumes the selections. In a full save every chunk must be
 * AMBER_SELECT_WHOLE. Counts and pointers are checked here and when the save
 * begins (AMBER_EINVAL, nothing starts); the indices are checked while the chunk is
 * encoded: an unsorted or out-of-range index fails the save with AMBER_EINVAL
 * naming the tensor and chunk, and nothing is committed. */
AMBER_API int amber_writer_set_selection(amber_writer *w, size_t index,
                                         const amber_chunk_sel *chunks, uint64_t nchunks);

/* A source of chunk selections, for a caller that would rather hand chunks over one
 * at a time than all at once: the save asks it for chunk `chunk` of pre-selected
 * tensor `index` when it is about to encode that chunk, and the source fills *sel
 * with the same rules as amber_writer_set_selection (AMBER_SELECT_WHOLE for every
 * chunk of a full save). The caller can then copy each chunk out of its device into
 * one reused buffer per worker while earlier chunks are written, instead of holding
 * a host copy of the whole tensor. It is called from the save's worker threads
 * (`worker` in 0..threads-1), concurrently for different workers, never twice at
 * once with the same worker, and never after amber_writer_wait returns. What *sel
 * points to must stay valid and unchanged until that worker's next call of any
 * source of this writer, or the save's end. A nonzero return (an AMBER_E* code, or
 * any other value for AMBER_EIO) fails the save, naming the tensor and chunk:
 * nothing of it is committed. */
typedef int (*amber_chunk_source)(void *user, int worker, size_t index, uint64_t chunk,
                                  amber_chunk_sel *sel);

/* Gives pre-selected tensor `index` a source of selections (fn NULL removes it). A
 * save takes each pre-selected tensor's chunks from the selection given by
 * amber_writer_set_selection since the last save if there is one, else from its
 * source. The source may be set once and serve every save (the pointer `user` is
 * kept). AMBER_EBUSY while a save is in progress. */
AMBER_API int amber_writer_set_source(amber_writer *w, size_t index, amber_chunk_source fn,
                                      void *user);

/* Releases the writer after waiting for a save in progress (call
 * amber_writer_cancel first to stop it instead). Accepts NULL. */
AMBER_API void amber_writer_close(amber_writer *w);

/* ---- Reader ------------------------------------------------------------------- */

typedef struct amber_reader amber_reader;

typedef struct amber_tensor_info {
  const char *name;      /* owned by the reader; valid until it is closed */
  int dtype;             /* amber_dtype */
  uint32_t ndim;
  int64_t shape[AMBER_MAX_DIMS];
  uint64_t nelems;       /* product of shape (1 for a scalar) */
  uint64_t nbytes;       /* nelems * amber_dtype_size(dtype) */
  uint64_t stored_bytes; /* payload bytes of this tensor in this step's file */
  uint64_t stored_elems; /* elements stored in this step's file */
  uint64_t chunk_elems;
  uint64_t nchunks;
  const char *policy;    /* policy spec in effect at this step; owned by the reader */
} amber_tensor_info;

/* Opening AMBER_LATEST (or any step): verify the step completely first, and if
 * it is damaged, open the newest older committed step that verifies instead.
 * amber_reader_skipped() then tells how many newer steps were passed over and
 * amber_last_error(reader) says which and why. Without the flag, a damaged step
 * is an error (strict). */
#define AMBER_READER_FALLBACK (1u << 0)
/* Read the step from its own checkpoint files, never from the image a memory tier's
 * drain keeps of its newest step (what `amber verify` does: it checks the files). */
#define AMBER_READER_FILES (1u << 1)

typedef struct amber_reader_opts {
  uint32_t flags;       /* AMBER_READER_* */
  uint32_t reserved0;
  uint64_t reserved[6]; /* must be zero */
} amber_reader_opts;

AMBER_API void amber_reader_opts_init(amber_reader_opts *opts);

/* Opens checkpoint `step` (AMBER_LATEST for the latest) for reading: reads and
 * checks the header, footer and index of its file and of every file its restore
 * needs. AMBER_ENOENT if the step is not committed, AMBER_ECORRUPT/AMBER_EFORMAT
 * with a message naming the file when a file is damaged or unsupported. */
AMBER_API int amber_reader_open(amber_reader **out, amber_store *st, uint64_t step,
                                const amber_reader_opts *opts);
AMBER_API void amber_reader_close(amber_reader *r);

/* With AMBER_READER_FALLBACK: the number of newer committed steps that were
 * damaged and passed over (0 when the requested step was intact). */
AMBER_API size_t amber_reader_skipped(const amber_reader *r);

/* The step and content hash of the opened checkpoint. */
AMBER_API uint64_t amber_reader_step(const amber_reader *r);
AMBER_API int amber_reader_ckpt_info(const amber_reader *r, amber_ckpt_info *out);

AMBER_API size_t amber_reader_count(const amber_reader *r);
AMBER_API int amber_reader_info(const amber_reader *r, size_t index,
                                amber_tensor_info *out);
/* Finds a tensor by name; AMBER_ENOENT if absent. */
AMBER_API int amber_reader_find(const amber_reader *r, const char *name, size_t *index);

/* Restores tensor `index` into `buf` (`size` must equal its nbytes). Reads only the
 * bytes this tensor needs, verifying every checksum before the call succeeds; on
 * failure the contents of `buf` are unspecified. */
AMBER_API int amber_reader_read(amber_reader *r, size_t index, void *buf, uint64_t size);
/* Restores `count` tensors at once: tensor indices[i] into bufs[i] (sizes[i] must
 * equal its nbytes). The same as a loop of amber_reader_read, but every chunk of
 * every tensor is one job for the worker threads, so small tensors are read in
 * parallel too: the way to load a whole state. The buffers must not overlap.
 * Arguments are all checked before anything is read; on failure the contents of
 * the buffers are unspecified. */
AMBER_API int amber_reader_read_many(amber_reader *r, size_t count, const size_t *indices,
                                     void *const *bufs, const uint64_t *sizes);
/* Restores `count` boxes at once: the box of tensor indices[i] at offsets
 * offsets[i*AMBER_MAX_DIMS ..] of shape shapes[i*AMBER_MAX_DIMS ..] (the tensor's
 * ndim entries of each are used) into bufs[i], row-major, sizes[i] bytes exactly
 * (AMBER_ERANGE for a box outside the tensor, AMBER_EINVAL for a wrong size). Only
 * the chunks that hold part of a box are read, all of every box in one parallel
 * loop; a chunk inside one contiguous run of its box (e.g. rows of a row-major
 * tensor) is decoded straight into its place in the buffer, the others aside and
 * their share copied. Otherwise as amber_reader_read_many. */
AMBER_API int amber_reader_read_boxes(amber_reader *r, size_t count, const size_t *indices,
                                      const int64_t *offsets, const int64_t *shapes,
                                      void *const *bufs, const uint64_t *sizes);

/* The checkpoint's metadata JSON (see amber_writer_set_meta). `*json` is owned by
 * the reader and not NUL-terminated when len is 0; NULL/0 when there is none. */
AMBER_API int amber_reader_meta(const amber_reader *r, const char **json, size_t *len);

/* Checks everything this step's restore needs: every header, index and chunk
 * checksum of every file in its chain, the parent links, and that every chunk
 * decodes. 0 when intact; the message names the first damaged file. */
AMBER_API int amber_reader_verify(amber_reader *r);

/* ---- Many ranks ----------------------------------------------------------------
 *
 * A job of N processes (ranks) writes one global checkpoint per step. Each rank
 * declares its tensors as regions of global tensors and writes its own files (its
 * own store under STORE/rank-RRRRR/, with its own reference, deltas and checksums);
 * a step becomes visible only when every rank's part is durable, through a
 * manifest that rank 0 writes (docs/FORMAT.md, "Many ranks"). amber never opens
 * sockets: the ranks agree through the job's own communicator, given as an
 * amber_comm (libamber_mpi's amber_mpi.h makes one from an MPI_Comm). */

/* The collectives amber needs. Each returns 0 or a negative AMBER_E* code, and is
 * called by every rank in the same order (collectively), never from two threads at
 * once. amber calls them from the thread that calls the amber_global_* function
 * (for split saves, the thread of amber_global_writer_wait), unless the
 * communicator is flagged AMBER_COMM_ANY_THREAD. */
typedef struct amber_comm {
  int rank;  /* this process's rank, 0 .. size-1 */
  int size;  /* number of ranks */
  /* Every rank contributes `len` bytes (the same len on every rank); `recv`
   * (size * len bytes) receives rank r's bytes at offset r * len. */
  int (*allgather)(void *ctx, const void *send, size_t len, void *recv);
  /* Copies `len` bytes of `buf` at rank `root` into `buf` on every rank. */
  int (*broadcast)(void *ctx, void *buf, size_t len, int root);
  /* Returns once every rank has called it. */
  int (*barrier)(void *ctx);
  void *ctx;              /* passed to the functions above */
  uint64_t flags;         /* AMBER_COMM_* */
  uint64_t reserved[3];   /* must be zero */
} amber_comm;

/* amber_comm.flags: the collectives may be called from a thread that amber starts,
 * while the program goes on using its own communicators on its threads (for MPI:
 * a duplicated communicator under MPI_THREAD_MULTIPLE, as libamber_mpi sets it).
 * A split save's global commit then runs in the background from begin on,
 * instead of inside amber_global_writer_wait. */
#define AMBER_COMM_ANY_THREAD (1u << 0)

/* The communicator of a job of one rank (rank 0, size 1). Static; never freed. */
AMBER_API const amber_comm *amber_comm_self(void);

/* Point-to-point exchange over the job's own communicator, for what moves one
 * rank's files to another (peer replicas, the restore from the tiers): amber never
 * opens sockets. Ranks are numbered as in the amber_comm given beside it.
 * libamber_mpi's amber_mpi_p2p_init makes one from an amber_mpi_comm_init
 * communicator (MPI_Sendrecv); Python's binding from any object with a sendrecv
 * method. */
typedef struct amber_p2p {
  /* Sends `slen` bytes of `send` to rank `dest` and receives exactly `rlen` bytes
   * from rank `src` into `recv`, both at once, returning when both are done: the
   * semantics of MPI_Sendrecv, so that a ring of exchanges cannot deadlock.
   * dest == AMBER_P2P_NONE sends nothing (slen is 0); src == AMBER_P2P_NONE
   * receives nothing (rlen is 0). Messages from one rank to another arrive in the
   * order they were sent. amber calls it from one thread at a time, in a sequence
   * where every send meets a receive of the same length on its destination.
   * Returns 0 or a negative AMBER_E* code (AMBER_EIO when the peer is gone). */
  int (*sendrecv)(void *ctx, const void *send, size_t slen, int dest, void *recv,
                  size_t rlen, int src);
  void *ctx;            /* passed to sendrecv */
  uint64_t flags;       /* AMBER_COMM_ANY_THREAD, as for amber_comm */
  uint64_t reserved[3]; /* must be zero */
} amber_p2p;

/* amber_p2p.sendrecv's dest or src: no peer this time. */
#define AMBER_P2P_NONE (-1)

typedef struct amber_global_writer amber_global_writer;

/* amber_global_writer_add flags: the tensor is replicated (every rank holds the
 * whole of it); only rank 0 writes it. offsets and local_shape are ignored. */
#define AMBER_SHARD_REPLICATED (1u << 0)

/* Opens the global writer of store directory `path` (created if missing) for this
 * rank. Collective. opts: each rank's writer options (NULL: defaults); its
 * full_every is applied to the whole step (full or delta is decided for the step,
 * not per rank), its full_share to each rank's own files (a rank whose deltas reach
 * the share makes the whole step full), its keep_last to the global steps
 * (amber_global_writer_prune_status). What a rank that died in an earlier save left (files of steps
 * after the last global commit) is removed here. `comm` is copied; it must stay
 * usable until amber_global_writer_close. Every rank returns the same result: a
 * failure on one rank (the code of the lowest failing rank, its message "rank R:
 * REASON") fails the open on all. Refused, with nothing created or changed: a
 * directory that holds a single-rank store (LATEST; AMBER_EINVAL); a store whose
 * GLOBAL is damaged, or missing while it holds committed steps (AMBER_ECORRUPT, as
 * amber_global_list); a store in use, whose rank store another process holds
 * (AMBER_ELOCKED: a global writer of another job, or maintenance). A rank store
 * whose LATEST is missing or damaged gets it back from the newest manifest that
 * names its file (the file must carry the manifest's state id, else
 * AMBER_ECORRUPT).
 *
 * Local mode (opts->flags AMBER_WRITER_GLOBAL_LOCAL, on every rank alike): `path` is
 * this rank's own directory or its host's, which no rank of another host reads;
 * ranks that share one keep their stores side by side under it (rank-RRRRR/).
 * Each commit writes the step's manifest and GLOBAL on every rank's path (rank 0
 * builds the manifest and broadcasts its bytes; each rank writes its copy, a
 * temporary file of its own renamed into place); a copy that fails on one path
 * fails the step on every rank, and every path takes its copy back. The open
 * agrees on the committed step when a crash left the paths' copies different: the
 * newest step whose manifest some path holds and whose every rank's part is
 * committed in that rank's own store (the file the manifest names, with its state
 * id and its chain) at the same world size; each path then gets that step's
 * manifest and GLOBAL, and loses the manifests and its ranks' files of later
 * steps. Manifests but no such step (a path wiped, a host replaced): refused on
 * every rank with AMBER_ECORRUPT and nothing removed (restore the path first:
 * amber_tiers_restore). A reader of one path (amber_global_reader_open) reads the
 * boxes of the ranks whose stores are there; replicated tensors are in rank 0's
 * files, which are on rank 0's path (amber_tiers_restore brings them to every
 * path that needs them). */
AMBER_API int amber_global_writer_open(amber_global_writer **out, const char *path,
                                       const amber_comm *comm,
                                       const amber_writer_opts *opts);
/* Declares this rank's part of global tensor `name` (same name, dtype and global
 * shape on every rank that declares it): the box at `offsets` of shape
 * `local_shape` (each ndim long; any dimension may be split), whose row-major bytes
 * are at `data` (not copied; read during saves as with amber_writer_add). A rank
 * need not declare every tensor. With AMBER_SHARD_REPLICATED the whole tensor.
 * A rank may declare a name again with another box of the same global tensor
 * (several shards of it, as a ChunkShardingSpec gives); each declaration has its
 * own index (declaration order, from 0). Refused on this rank, naming both boxes: a
 * box whose dtype or global shape differs from the name's earlier declarations
 * (AMBER_EINVAL), one that overlaps an earlier box of the name, or a replicated
 * declaration of a name declared before, or the reverse (AMBER_EEXIST). The names
 * "amber.boxes" and "amber.boxes/..." are amber's own (AMBER_EINVAL): a rank's file
 * holds its k-th later box of `name` as "amber.boxes/<k>/<name>" (docs/FORMAT.md,
 * "Many ranks"). Declarations are fixed by the first save or
 * amber_global_writer_plan. */
AMBER_API int amber_global_writer_add(amber_global_writer *gw, const char *name, int dtype,
                                      uint32_t ndim, const int64_t *global_shape,
                                      const int64_t *offsets, const int64_t *local_shape,
                                      const void *data, uint32_t flags);
/* Points tensor `index` (declaration order, from 0) at new memory of the same size,
 * as amber_writer_set_data; not while a save of this rank reads it (AMBER_EBUSY),
 * nor for a pre-selected tensor (AMBER_EINVAL). */
AMBER_API int amber_global_writer_set_data(amber_global_writer *gw, size_t index,
                                           const void *data);
/* Sets this rank's metadata (as amber_writer_set_meta: JSON, copied; len 0 removes
 * it) for later saves. It is stored in this rank's own file of each step, so each
 * rank keeps its own (RNG states, counters); a rank with metadata writes a file of
 * the step even when it declares no tensor of its own. Read it back with
 * amber_global_reader_meta. */
AMBER_API int amber_global_writer_set_meta(amber_global_writer *gw, const char *json,
                                           size_t len);
/* As amber_writer_add_policy, for this rank's files; a pattern matches the global
 * tensor's name, for each of its boxes. */
AMBER_API int amber_global_writer_add_policy(amber_global_writer *gw, const char *rule);
/* As amber_writer_set_units, for tensors 0..n-1 in declaration order (the ones
 * this rank does not write are kept and ignored). Not collective. */
AMBER_API int amber_global_writer_set_units(amber_global_writer *gw, const double *units,
                                            size_t n);
/* Saves global step `step` and commits it. Collective. When it returns 0 on one
 * rank it returns 0 on all, and the step is durable and the store's latest. If any
 * rank fails, every rank returns the same error (the code of the lowest failing
 * rank; AMBER_EMISMATCH when the ranks' declarations disagree or their shards do
 * not tile a tensor) whose message names the failing rank and its reason; nothing of the step is visible, every rank's own files of the step
 * are removed and the next save is full on every rank. flags: AMBER_SAVE_FULL
 * (and, for begin, AMBER_SAVE_CONFIRM: see amber_global_writer_confirm). */
AMBER_API int amber_global_writer_save(amber_global_writer *gw, uint64_t step, uint32_t flags);
/* The split save. begin calls one allgather (to decide full or delta for the step)
 * and starts this rank's part. The commit's collectives (status exchange, manifest,
 * GLOBAL) run inside amber_global_writer_wait, on the caller's thread, so that a
 * communicator need not be usable from a second thread; the cost is that the global
 * commit is not complete until every rank has called wait, and that wait spends the
 * commit's time (collectives and the manifest's fsyncs) on the caller's thread. With
 * a communicator flagged AMBER_COMM_ANY_THREAD they run instead on a thread that
 * begin starts (unless the save is begun with AMBER_SAVE_CONFIRM): the step commits
 * in the background as soon as every rank's part is durable, and wait only collects
 * the outcome. Until wait returns, set_data, add_policy and begin return
 * AMBER_EBUSY (their message in amber_last_error(NULL) while the background commit
 * runs: the handle's message is then the commit's). Ownership of the tensors'
 * memory as for amber_writer_begin/fence. */
AMBER_API int amber_global_writer_begin(amber_global_writer *gw, uint64_t step,
                                        uint32_t flags);
/* Whether this rank wants step `step` begun with `flags` to be full (asked for,
 * after a failed step, the first step, the cadence): what begin's own vote would
 * carry. The step is full on every rank when any rank wants it; a caller that
 * exchanges the answers itself begins with AMBER_SAVE_VOTED and, where any rank
 * wants it, AMBER_SAVE_FULL. Not collective. */
AMBER_API int amber_global_writer_wants_full(const amber_global_writer *gw, uint64_t step,
                                             uint32_t flags, int *full);
AMBER_API int amber_global_writer_fence(amber_global_writer *gw);
AMBER_API int amber_global_writer_wait(amber_global_writer *gw);
/* The verdict on a save begun with AMBER_SAVE_CONFIRM, as amber_writer_confirm, for
 * this rank's part: not ok makes this rank's part fail (AMBER_ECHANGED, message
 * ending with `why`), and so the step on every rank, naming this rank. A rank that
 * writes nothing of the step ignores it. Not collective. */
AMBER_API int amber_global_writer_confirm(amber_global_writer *gw, int ok, const char *why);
/* As amber_writer_seed_reference, for this rank's part, after a load of `step`, the
 * latest global step, at the world size and sharding that wrote it: this rank's
 * declared tensors hold exactly its part of that step's restore, and its writer
 * copies them as its reference, so that the next save is a delta against `step`
 * without reading the rank's files back. Not collective. AMBER_EMISMATCH when the
 * step was written at another world size or with other boxes, or this rank's store
 * has moved on; the reference is then read from the rank's files by the next save, as
 * without a seed. */
AMBER_API int amber_global_writer_seed_reference(amber_global_writer *gw, uint64_t step);
/* ---- Pre-selected tensors of a global step ----
 *
 * As amber_writer_add_preselected and its companions, for this rank's part of a
 * global step (a GPU rank that selects on its own device): the caller keeps the
 * reference of its shard, selects under the tensor's policy and hands over only
 * the selected elements; amber writes them in this rank's file and commits the
 * step as any other. A save of a global writer with pre-selected tensors goes, on
 * every rank:
 *
 *   amber_global_writer_plan(gw, N, flags, &kind);   // collective: the step's kind
 *   amber_global_writer_info(gw, i, &info);          // each tensor this rank writes
 *   ... select on the device, copy indices and values to host buffers ...
 *   amber_global_writer_set_selection(gw, i, sels, info.nchunks);
 *   amber_global_writer_begin(gw, N, flags);         // the same step and flags
 *
 * Ownership as for amber_writer_set_selection: the selections are read until
 * amber_global_writer_fence (or wait, or close) returns. A step that fails on any
 * rank fails on every rank, and each rank puts its own reference back. */

/* Declares this rank's part of global tensor `name` as pre-selected: as
 * amber_global_writer_add without memory to read (index: declaration order, shared
 * with amber_global_writer_add). Each save takes its chunks from
 * amber_global_writer_set_selection. A replicated one is written by rank 0 alone;
 * the other ranks declare it and select nothing. */
AMBER_API int amber_global_writer_add_preselected(amber_global_writer *gw, const char *name,
                                                  int dtype, uint32_t ndim,
                                                  const int64_t *global_shape,
                                                  const int64_t *offsets,
                                                  const int64_t *local_shape, uint32_t flags);
/* Decides what the next save of global step `step` with `flags` will be and fixes
 * it: *kind gets AMBER_KIND_FULL or AMBER_KIND_DELTA, the same on every rank, and an
 * amber_global_writer_begin or _save of the same step and flags that follows makes
 * that kind of step. Collective (two allgathers): the step is full when any rank
 * wants it full (begin's vote: the flags, full_every, full_share, a failed step
 * before), or when any rank's own writer cannot make a delta (no reference in its
 * store). It also makes this rank's writer from the declarations (which are then
 * fixed) and resolves each tensor's policy. The checks of begin (AMBER_EBUSY,
 * AMBER_EEXIST, ...) come first, on each rank alone; a failure of a rank's own
 * writer is returned on every rank, the code of the lowest failing rank with a
 * message that names it. */
AMBER_API int amber_global_writer_plan(amber_global_writer *gw, uint64_t step, uint32_t flags,
                                       uint32_t *kind);
/* Tensor `index` (declaration order) as this rank's writer will save it, as
 * amber_writer_info (chunk_elems and nchunks of the local shard, the policy
 * resolved by the last plan; the name its file gives it, "amber.boxes/<k>/<name>"
 * for a second or later box of one name). AMBER_EINVAL for a tensor this rank does not write (a
 * replicated one on a rank other than 0) and before the first plan; AMBER_ERANGE
 * for an index past the declarations. Not collective. */
AMBER_API int amber_global_writer_info(const amber_global_writer *gw, size_t index,
                                       struct amber_tensor_info *out);
/* Gives pre-selected tensor `index` (declaration order) its selection for the next
 * save, as amber_writer_set_selection: after amber_global_writer_plan, for every
 * pre-selected tensor this rank writes, before each save; every chunk
 * AMBER_SELECT_WHOLE in a full one. AMBER_EINVAL for a tensor declared with
 * amber_global_writer_add or not written by this rank, and before the first plan;
 * AMBER_EBUSY during a save. Not collective. */
AMBER_API int amber_global_writer_set_selection(amber_global_writer *gw, size_t index,
                                                const amber_chunk_sel *chunks,
                                                uint64_t nchunks);
/* Gives pre-selected tensor `index` (declaration order) a source of selections, as
 * amber_writer_set_source: asked per chunk by the save's workers when no selection
 * was set for the save, with `index` the global writer's. It may be set before the
 * first plan and stays for every save (also across the rank writer's reopening
 * after a failed step). fn NULL removes it. AMBER_EINVAL for a tensor declared with
 * amber_global_writer_add; AMBER_EBUSY during a save. Not collective. */
AMBER_API int amber_global_writer_set_source(amber_global_writer *gw, size_t index,
                                             amber_chunk_source fn, void *user);
/* Where the time of the global writer's last save went on this rank: for
 * profiling, and what `amber bench --ranks` prints. Wall-clock seconds. */
typedef struct amber_global_save_stats {
  amber_save_stats part;  /* this rank's own file, as amber_writer_save_stats (all
                             zero when the rank wrote nothing of the step) */
  double part_s;          /* begin until this rank's part was durable and committed in
                             its own store (for a split save: until wait saw it so) */
  double vote_s;          /* the allgather of every rank's outcome: includes waiting for
                             the ranks that finish their parts later */
  double manifest_s;      /* rank 0: checking the votes, writing the manifest durably
                             and moving GLOBAL; 0 on the other ranks */
  double outcome_s;       /* the broadcast of rank 0's outcome */
  double commit_s;        /* vote_s + manifest_s + outcome_s: the global commit */
  double total_s;         /* begin until the step was committed */
  uint64_t reserved[4];   /* zero */
} amber_global_save_stats;

/* Fills `out` with the figures of this rank's last save (call it after
 * amber_global_writer_save or _wait returned 0; after a failed save the figures
 * are unspecified). Not collective. Returns 0, or AMBER_EINVAL for a NULL argument. */
AMBER_API int amber_global_writer_save_stats(const amber_global_writer *gw,
                                             amber_global_save_stats *out);
/* With opts.keep_last: the outcome of this rank's part of the prune that followed
 * the last committed step (call it after amber_global_writer_save or _wait). Rank 0
 * removes the manifests of the steps before the newest keep_last, then every rank
 * prunes its own store, keeping every file the kept steps need (as
 * amber_global_prune); in the background with an AMBER_COMM_ANY_THREAD
 * communicator, else inside wait. A failed prune does not fail the save; the next
 * step's prune tries again. Returns 0 or the prune's error code; *removed (may be
 * NULL) gets the files this rank removed (on rank 0, manifests included),
 * *message (may be NULL) the error message, owned by the writer and valid until
 * the next save. Not collective. */
AMBER_API int amber_global_writer_prune_status(const amber_global_writer *gw, size_t *removed,
                                               const char **message);
/* Closes the writer (waiting for a save in progress, whose result is lost: call
 * wait first). Not collective. Accepts NULL. */
AMBER_API void amber_global_writer_close(amber_global_writer *gw);

/* One committed global step, as amber_global_list gives it. */
typedef struct amber_global_step_info {
  uint64_t step;
  uint32_t kind;        /* AMBER_KIND_FULL when every rank's file is full */
  uint32_t world_size;
  uint64_t parent;      /* previous global step, AMBER_NO_STEP for the first/full */
  uint64_t bytes;       /* the step's files of every rank, and its manifest */
  uint32_t flags;       /* AMBER_CKPT_DAMAGED: its manifest cannot be read or fails its
                           checks, or is missing though GLOBAL names the step; kind,
                           world_size and bytes are then 0, parent AMBER_NO_STEP */
  uint32_t reserved0;
  uint64_t reserved[3];
} amber_global_step_info;

/* 1 when `path` is a multi-rank store (it holds a global LATEST or manifest), else 0.
 * Here and in the amber_global_* functions below (all but the writer) `path` may be an
 * s3:// store (see amber_store_open): the same files as objects; prune and compact
 * there take no lock, and a manifest they rewrite is uploaded and confirmed. */
AMBER_API int amber_global_is_store(const char *path);
/* Lists the committed global steps of store `path`, oldest first, up to and
 * including the latest (GLOBAL's). *out (release with amber_free) gets *count
 * entries. A step whose manifest is damaged is listed, flagged AMBER_CKPT_DAMAGED,
 * and the listing goes on; a manifest removed while the listing runs (a prune)
 * is left out. 0 entries for a store without a committed step; AMBER_ECORRUPT for
 * a store whose GLOBAL is damaged, or missing while it holds committed steps (more
 * than the one manifest and rank file each that a crash in its first commit
 * leaves): it is refused until GLOBAL is restored. */
AMBER_API int amber_global_list(const char *path, amber_global_step_info **out,
                                size_t *count);

/* Keeps the newest `keep_last` (>= 1) global steps of store `path` and removes the
 * others' manifests, then prunes each rank's store so that it keeps every file the
 * kept steps need (as amber_store_prune does, per rank). Takes every rank store's
 * writer lock first: AMBER_ELOCKED, with nothing removed, while a global writer
 * is open. *removed (may
 * be NULL) gets the number of global steps removed. */
AMBER_API int amber_global_prune(const char *path, uint64_t keep_last, size_t *removed);

/* Makes global step `step` (AMBER_LATEST: the latest) of store `path` full on every
 * rank: each rank's file of the step is rewritten as a full checkpoint with the same
 * state id (as amber_store_compact, verified first), then the manifest says the
 * step is full. Later steps stay valid. Takes every rank store's writer lock first:
 * AMBER_ELOCKED while a global writer is open. *compacted (may be NULL) gets the
 * number of rank files rewritten (0 when the step was full already). */
AMBER_API int amber_global_compact(const char *path, uint64_t step, size_t *compacted);

typedef struct amber_global_reader amber_global_reader;

/* One global tensor of a step. */
typedef struct amber_global_tensor {
  const char *name;    /* owned by the reader */
  int dtype;
  uint32_t ndim;
  int64_t shape[AMBER_MAX_DIMS];  /* the global shape */
  uint32_t nshards;    /* shards that hold it (1 for a replicated tensor) */
  uint32_t flags;      /* AMBER_SHARD_REPLICATED */
  uint64_t reserved[2];
} amber_global_tensor;

/* Opens global step `step` (AMBER_LATEST: the latest) of store `path` for reading,
 * at any world size: not collective, any process may call it. Reads and checks
 * the manifest (AMBER_ECORRUPT/EFORMAT with the file named when it is damaged, or
 * when its shards overlap or leave part of a tensor uncovered; AMBER_ECORRUPT also
 * when GLOBAL is missing or damaged as amber_global_list says, or names a step
 * whose manifest is missing; AMBER_ENOENT for a step after GLOBAL's or without a
 * manifest). Each rank's part is opened, on first use, as the manifest names it
 * (its step and state id: the rank store's LATEST is not needed), and checked
 * against the manifest: its tensors' dtype and shape, and the box each holds of
 * its global tensor, which the global writer records in the rank's file. */
AMBER_API int amber_global_reader_open(amber_global_reader **out, const char *path,
                                       uint64_t step);
/* Closes the reader and the rank stores it opened. Accepts NULL. Thread safety: a
 * reader is used by one thread at a time; separate readers are independent. */
AMBER_API void amber_global_reader_close(amber_global_reader *g);
/* The step opened, and the world size that wrote it. */
AMBER_API uint64_t amber_global_reader_step(const amber_global_reader *g);
AMBER_API uint32_t amber_global_reader_world_size(const amber_global_reader *g);
/* The global tensor table: count, entry `index` (0 .. count-1; AMBER_ERANGE
 * otherwise; strings owned by the reader) and lookup by name (AMBER_ENOENT). */
AMBER_API size_t amber_global_reader_count(const amber_global_reader *g);
AMBER_API int amber_global_reader_tensor(const amber_global_reader *g, size_t index,
                                         amber_global_tensor *out);
AMBER_API int amber_global_reader_find(const amber_global_reader *g, const char *name,
                                       size_t *index);
/* Reads the box at global `offsets` of shape `shape` (ndim long each) of tensor
 * `index` into `buf` (row-major, `size` bytes exactly): from every shard that
 * overlaps it, each through its rank's chain with every checksum checked.
 * AMBER_ECORRUPT naming the tensor when the shards leave part of the box
 * uncovered; errors of a rank's files name the rank and the file. */
AMBER_API int amber_global_reader_read(amber_global_reader *g, size_t index,
                                       const int64_t *offsets, const int64_t *shape,
                                       void *buf, uint64_t size);
/* Reads `count` boxes at once, as amber_global_reader_read does one: box i is the
 * region of tensor indices[i] at offsets[i*AMBER_MAX_DIMS ..] of shape
 * shapes[i*AMBER_MAX_DIMS ..] into bufs[i] (sizes[i] bytes). Every box is checked
 * (range, size, that the shards tile it) before anything is read; then every chunk
 * of every overlapping shard of every box is restored in one parallel loop, each
 * chunk that lies inside one contiguous run of its box (a shard's rows of a
 * row-sharded tensor: all but its first and last) straight into its place in the
 * buffer: no copy of a shard is ever held. The buffers must not overlap. On
 * failure the buffers' contents are unspecified. */
AMBER_API int amber_global_reader_read_many(amber_global_reader *g, size_t count,
                                            const size_t *indices, const int64_t *offsets,
                                            const int64_t *shapes, void *const *bufs,
                                            const uint64_t *sizes);
/* Rank `rank`'s metadata of the step (amber_global_writer_set_meta): *json (owned
 * by the reader, valid until it closes) and *len; NULL/0 when that rank stored
 * none. AMBER_ERANGE when the step's world size has no such rank. */
AMBER_API int amber_global_reader_meta(amber_global_reader *g, uint32_t rank,
                                       const char **json, size_t *len);
/* Checks the manifest and every rank's files that the step needs: each rank's
 * part against the manifest (as a read does) and every chunk of its chain. */
AMBER_API int amber_global_reader_verify(amber_global_reader *g);

/* ---- Storage tiers ------------------------------------------------------------
 *
 * A memory tier is an ordinary store (single-rank or multi-rank) in a directory on
 * a memory file system (/dev/shm/...), which outlives the training process; the
 * durable tier is an ordinary store of the same layout at the run's path. A drain
 * copies every committed step of the memory tier to the durable tier, in commit
 * order, each step's files first and its pointer last (LATEST; for a multi-rank
 * store the manifest, then GLOBAL, once every rank's files of the step are there),
 * so that a crash at any point leaves the durable tier's committed steps intact and
 * no partial step visible. Once a step is durable, the drain removes from the
 * memory tier the files that no newer step needs. The memory tier records its
 * durable tier in a small file, TIERS (docs/FORMAT.md, "Storage tiers"). */

typedef struct amber_drain amber_drain;

typedef struct amber_drain_opts {
  uint64_t max_lag_steps; /* committed steps the durable tier may lag behind the memory
                             tier; beyond it amber_drain_kick waits (back-pressure).
                             0: no bound */
  uint64_t max_lag_bytes; /* bytes of committed files not yet durable; beyond it
                             amber_drain_kick waits. 0: no bound */
  uint64_t memory_budget; /* bytes the memory tier may hold of the stores this drain
                             drains (checkpoint files and manifests). 0: no bound */
  int32_t rank;           /* a multi-rank memory tier: drain rank `rank`'s rank store
                             only; rank 0 also drains the manifests and GLOBAL, each once
                             every rank's files of its step are durable (it polls the
                             durable tier for them). -1: every rank store the memory
                             directory holds, and its manifests (what `amber drain` does);
                             a single-rank memory tier takes -1 */
  uint32_t flags;         /* AMBER_DRAIN_* */
  uint64_t reserved[4];   /* must be zero */
} amber_drain_opts;

/* The drain keeps an image of each store it drains (file "image.amber" there): the
 * newest step's state as one full checkpoint file, brought forward in place as
 * steps commit, after they are durable, so that a restart from the memory tier
 * reads one file instead of a full checkpoint and every delta after it. It takes
 * one state's bytes of the memory tier, where the memory budget leaves room for it
 * (it is dropped where it does not); readers take it only while it is whole and
 * holds the step they read, else they read the step's files. */
#define AMBER_DRAIN_IMAGE (1u << 0)

/* Fills `o` with defaults: no bounds, rank -1. */
AMBER_API void amber_drain_opts_init(amber_drain_opts *o);

/* Starts draining the store at `memory` to the store at `durable` on a background
 * thread: every committed step, in commit order, and then each step as it is
 * committed. `durable` is created if missing (its parent must exist); NULL takes the
 * durable tier that `memory`'s TIERS file records. The memory directory is created
 * if missing, and its TIERS file records `durable`. The durable store's rank stores
 * that this drain writes (the store itself for a single-rank one) are locked for it
 * (AMBER_ELOCKED while another drain or a writer holds one), and the temporary files
 * an earlier drain left there are removed. Resumes whatever an earlier drain, or a
 * crashed job, left: files already durable are not copied again.
 * `durable` may be an object store, "s3://bucket/prefix": each file is uploaded
 * whole (multipart, parts in parallel, for large ones) and confirmed by reading back
 * its size and checksum before the pointer that names it is put, itself confirmed;
 * nothing is locked there (a second drain of one s3:// store at once is the caller's
 * mistake), and the multipart uploads an earlier drain left are aborted. Errors of
 * the object store (refused credentials: AMBER_EPERM; a missing bucket: AMBER_ENOENT)
 * name the object; 5xx answers, throttling and cut connections are retried.
 * AMBER_EINVAL when the two layouts differ (a single-rank store against a
 * multi-rank one), or when both are one directory. out: the handle; release with
 * amber_drain_close().
 * o: NULL for defaults. Thread safety: kick, wants_full, flush and get_status may be
 * called from any thread, close once none of them runs; the drain's own thread never
 * calls back. */
AMBER_API int amber_drain_start(amber_drain **out, const char *memory, const char *durable,
                                const amber_drain_opts *o);
/* Tells the drain that a step was committed to the memory tier (call it after each
 * commit): wakes its thread, then waits while the lag is beyond its bounds
 * (back-pressure) and while the memory tier is over its budget and the drain can
 * still shrink it (files outside the newest step's chain wait to become durable and
 * be removed). Without bounds and budget it returns at once. Returns the drain's
 * sticky error (a negative AMBER_E* code; amber_last_error(d) names the file and the
 * tier: a full durable disk is AMBER_ENOSPC naming the durable path), or 0. A
 * budget that cannot hold one full checkpoint is a sticky AMBER_ENOSPC that says how
 * large one is (the drain itself goes on). */
AMBER_API int amber_drain_kick(amber_drain *d);
/* 1 when the memory tier is over its budget and only a full checkpoint would let it
 * shrink (what fills it is the chain of its newest step, full and deltas): the
 * caller should make its next save full (AMBER_SAVE_FULL). 0 otherwise. As of the
 * last amber_drain_kick or amber_drain_get_status. */
AMBER_API int amber_drain_wants_full(amber_drain *d);
/* Waits at most `timeout_s` seconds (negative: no limit) until every step committed
 * to the memory tier when it was called is durable. AMBER_ETIMEDOUT when the time
 * runs out; the sticky error if there is one. */
AMBER_API int amber_drain_flush(amber_drain *d, double timeout_s);

typedef struct amber_drain_status {
  uint64_t memory_step;   /* the newest committed step of the memory tier (a multi-rank
                             drain that drains manifests: the global step; a rank's:
                             its rank store's); AMBER_NO_STEP when none */
  uint64_t durable_step;  /* the newest step the drain made durable (same kind); AMBER_NO_STEP */
  uint64_t lag_steps;     /* committed steps not yet durable */
  uint64_t lag_bytes;     /* their bytes */
  uint64_t memory_bytes;  /* bytes the memory tier holds of what this drain drains */
  uint64_t drained_bytes; /* bytes copied by this handle */
  uint64_t drained_files; /* files copied by this handle (pointers not counted) */
  int error;              /* the sticky error, or 0 */
  int wants_full;         /* as amber_drain_wants_full */
  uint64_t image_step;    /* AMBER_DRAIN_IMAGE: the step every drained store's image holds
                             (the lowest of them); AMBER_NO_STEP when a store has none */
  uint64_t reserved[3];
} amber_drain_status;

/* Fills `st` with the drain's position (the memory tier looked at now). Returns the
 * sticky error, or 0; st is filled either way. */
AMBER_API int amber_drain_get_status(amber_drain *d, amber_drain_status *st);
/* Stops the thread after the file in progress (what is left resumes at the next
 * start or `amber drain`) and frees the handle. Returns the sticky error, or 0.
 * Accepts NULL. */
AMBER_API int amber_drain_close(amber_drain *d);
/* Drains, in the calling thread, everything committed to `memory` (what `amber drain
 * MEMORY [DURABLE]` runs): returns when every committed step is durable. `durable`
 * NULL: the recorded one. A multi-rank step whose rank files are in neither tier (a
 * rank store on another host's memory tier, not yet drained) fails with
 * AMBER_ENOENT naming the rank and the file. Progress goes to the progress hook as
 * "drain", in bytes. */
AMBER_API int amber_drain_run(const char *memory, const char *durable,
                              const amber_drain_opts *o);
/* The durable tier that `memory`'s TIERS file records: *durable (release with
 * amber_free). AMBER_ENOENT when there is no TIERS file, AMBER_ECORRUPT when it is
 * malformed. */
AMBER_API int amber_tier_durable(const char *memory, char **durable);
/* The local directory through which the s3:// store `url` is written when the caller
 * names no memory tier (what amber.torch's Checkpointer("s3://...") and `amber
 * import` use): $AMBER_STAGING, else /dev/shm when it is a writable directory, else
 * $TMPDIR, else /tmp, followed by "/amber-<uid>-<16 hex digits of the URL's xxh3>",
 * so that every process of one user on one host that writes that URL finds the same
 * one (a resume reads its newest step from there). Created by nobody here. *dir
 * (release with amber_free). AMBER_EINVAL when `url` is not s3://. */
AMBER_API int amber_tier_staging(const char *url, char **dir);

/* ---- Replicas of a rank's files (pack, unpack, holdings) ---------------------- */

/* The files a replica of `memory`'s rank store `rank` (-1: `memory` is a single-rank
 * store) needs to go from step `have` (AMBER_NO_STEP: nothing) to committed step
 * `want`, as one blob (docs/FORMAT.md, "Pack"): the files of want's chain after
 * `have` (all of it for AMBER_NO_STEP), each checked against its checksums as it is
 * read; the rank store's LATEST pointing at want; and, for a multi-rank store whose
 * directory holds want's manifest, that manifest and GLOBAL pointing at want.
 * `want` is committed when its manifest names it (then the rank file must carry the
 * manifest's state id) or when it is at most the rank store's LATEST.
 * *blob (release with amber_free) of *len bytes. Thread safety: any thread; it only
 * reads. */
AMBER_API int amber_tier_pack(const char *memory, int32_t rank, uint64_t have, uint64_t want,
                              void **blob, size_t *len);
/* Installs a blob of amber_tier_pack into directory `dir` (created if missing), with
 * the same layout (rank files under dir/rank-RRRRR/): every frame's checksum and name
 * is checked first (a damaged or hostile blob changes nothing: AMBER_ECORRUPT); then
 * the files, each under a temporary name, fsynced, renamed, the directory fsynced;
 * then the pointers, last: a rank store's LATEST once the file it names is there
 * with its state id (it never moves back to an older step), GLOBAL once its manifest
 * is there (never back either). A crash leaves the pointers where they were. */
AMBER_API int amber_tier_unpack(const char *dir, const void *blob, size_t len);

/* amber_tier_holding.kind */
#define AMBER_TIER_STORE 0u    /* a rank store (rank), or the single-rank store (rank -1) */
#define AMBER_TIER_MANIFEST 1u /* a global step's manifest */
/* amber_tier_holding.flags */
#define AMBER_TIER_COMMITTED (1u << 0) /* MANIFEST: at most the directory's GLOBAL */

typedef struct amber_tier_holding {
  uint32_t kind;   /* AMBER_TIER_STORE or AMBER_TIER_MANIFEST */
  int32_t rank;    /* STORE: the rank, -1 for a single-rank store; MANIFEST: -1 */
  uint64_t step;   /* STORE: the newest committed step whose whole chain is present and
                      intact (AMBER_NO_STEP: none); MANIFEST: its step */
  uint64_t state;  /* STORE: that step's state id; MANIFEST: 0 */
  uint64_t oldest; /* STORE: the oldest step from which every committed step up to
                      `step` restores (AMBER_NO_STEP: none); MANIFEST: its step */
  uint32_t flags;  /* AMBER_TIER_COMMITTED */
  uint32_t reserved0;
  uint64_t reserved[3];
} amber_tier_holding;

/* What directory `dir` can restore: one STORE entry for each rank store it holds
 * (its own and replicas), or one for a single-rank store, then one MANIFEST entry
 * for each intact manifest, oldest first. "Present and intact" is what opening a
 * reader checks (each file's header, footer and index checksums, each link's state
 * id; a committed step is at most the store's LATEST, or any step when the store has
 * no readable LATEST, as a replica's rank store may not); the chunks' checksums are
 * checked when they are read. *out (release with amber_free) gets *n entries;
 * AMBER_ENOENT when `dir` does not exist. Reads only. */
AMBER_API int amber_tier_holdings(const char *dir, amber_tier_holding **out, size_t *n);
/* ---- Peer replicas and the restore from the fastest tier ------------------------
 *
 * With many ranks, each host's memory tier is a directory of its own (a local-mode
 * global writer's path, AMBER_WRITER_GLOBAL_LOCAL), which a lost host takes with
 * it. A replicator sends each rank's newly committed files to `replicas` peers on
 * other hosts after every step, over the job's communicator and an amber_p2p; each
 * peer keeps them in its own memory directory under the sender's rank store
 * (rank-SSSSS/, docs/FORMAT.md "Peer replicas"). amber_tiers_restore then agrees on
 * the newest step every rank can restore from some tier and moves what a rank lacks
 * from the peer that holds it (docs/DESIGN.md, "Peer replicas and the restore"). */

typedef struct amber_replicas amber_replicas;

typedef struct amber_replicas_opts {
  const char *host;     /* this rank's host, the unit that fails together: NULL = the
                           environment's AMBER_HOST, else gethostname(). Copied */
  uint64_t keep_last;   /* global steps each replica keeps, with what their restores
                           need: 0 = 2 (the newest and the one before, so that a restore
                           after a crash in the middle of a step's replication finds a
                           step that every replica holds) */
  uint32_t flags;       /* must be zero */
  uint32_t reserved0;   /* must be zero */
  uint64_t reserved[4]; /* must be zero */
} amber_replicas_opts;

/* Fills `o` with defaults. */
AMBER_API void amber_replicas_opts_init(amber_replicas_opts *o);

/* Opens this rank's replicator over memory directory `memory` (this rank's path of a
 * local-mode global writer: its files are memory/rank-RRRRR/). Collective over
 * `comm`; `comm` and `p2p` (the same ranks) are copied and must stay usable until
 * amber_replicas_close; call every amber_replicas_* of one replicator from one
 * thread at a time, with a communicator that no other thread uses meanwhile (a
 * duplicate of the job's: libamber_mpi's amber_mpi_comm_init; a gloo group of its
 * own in torch.distributed), since replication runs beside training.
 *
 * Peers: every rank's host is gathered. Hosts are ordered by their lowest rank and
 * each host's ranks by rank; rank r, the i-th of host h (of H hosts), sends its files
 * to the i mod n_k -th rank of host (h + k) mod H for k = 1 .. min(replicas, H - 1),
 * n_k being that host's rank count: a ring over hosts, one replica per other host.
 * So a job on one host has no replicas (a host's memory is lost with the host), and
 * replicas >= H gives each rank's files to every other host once. The peers that
 * already hold a replica of this rank (from an earlier job) are asked its step, so
 * that the first amber_replicas_step sends them only what they lack.
 *
 * Returns the same result on every rank. out: release with amber_replicas_close.
 * opts: NULL for defaults. */
AMBER_API int amber_replicas_open(amber_replicas **out, const char *memory,
                                  const amber_comm *comm, const amber_p2p *p2p,
                                  uint32_t replicas, const amber_replicas_opts *opts);
/* Replicates committed global step `step` (steps in increasing order, each after the
 * local-mode global writer committed it; a step may be skipped). Collective. Each
 * rank packs its rank store's files that step's chain has beyond what each peer
 * holds (amber_tier_pack: after the first step, about one delta), and the ranks
 * exchange them in rounds in which each rank sends to at most one peer and receives
 * from at most one (sizes first, then bytes, with sendrecv: no round can deadlock);
 * each receiver installs what it got into its memory directory under the sender's
 * rank (amber_tier_unpack: files first, pointers last, never back), then keeps the
 * newest keep_last steps of that replica. An exchange of every rank's outcome ends
 * the step, so every rank returns the same result: 0, or the lowest failing rank's
 * code with "rank R: REASON". An error is sticky: the replicator stops, and every
 * later call returns it (open a new one to go on; it sends what the peers lack). */
AMBER_API int amber_replicas_step(amber_replicas *r, uint64_t step);
/* This rank's peers, the ranks that hold its replicas (in order k = 1, 2, ...): *n
 * gets their count, peers[0 .. min(*n, cap)) the ranks. Not collective. */
AMBER_API int amber_replicas_peers(const amber_replicas *r, int *peers, size_t cap, size_t *n);

typedef struct amber_replicas_stats {
  uint64_t step;           /* the last step replicated (AMBER_NO_STEP: none yet) */
  uint64_t sent_bytes;     /* bytes this rank sent for it (to all its peers) */
  uint64_t received_bytes; /* bytes it received for it (from every rank it keeps) */
  uint64_t total_sent, total_received; /* since the open */
  double seconds;          /* wall-clock time of that amber_replicas_step */
  uint64_t reserved[4];
} amber_replicas_stats;

/* The figures of this rank's replication. Not collective. */
AMBER_API int amber_replicas_stats_get(const amber_replicas *r, amber_replicas_stats *out);
/* Releases the replicator (not collective). Accepts NULL. */
AMBER_API void amber_replicas_close(amber_replicas *r);

/* amber_tiers_result.tier: where a rank's files of the restored step came from. */
#define AMBER_RESTORE_NONE 0u    /* no tier holds a step every rank can restore */
#define AMBER_RESTORE_MEMORY 1u  /* its own memory directory held them */
#define AMBER_RESTORE_PEER 2u    /* a peer's memory directory (fetched into its own) */
#define AMBER_RESTORE_DURABLE 3u /* the durable tier */

typedef struct amber_tiers_result {
  uint64_t step;        /* the global step every rank restores (AMBER_NO_STEP: none) */
  uint32_t tier;        /* AMBER_RESTORE_*: this rank's */
  uint32_t world_size;  /* the step's */
  const char *dir;      /* the store to open at `step` (amber_global_reader_open):
                           `memory` or `durable` as the caller passed them; NULL for
                           AMBER_RESTORE_NONE */
  uint64_t fetched_bytes; /* bytes this rank received from its peers or the durable
                             tier into its memory directory */
  uint32_t ranks_memory, ranks_peer, ranks_durable; /* ranks each tier served */
  uint32_t reserved0;
  uint64_t reserved[4];
} amber_tiers_result;

/* Restores from the fastest tier that holds a step every rank can restore.
 * Collective over `comm` (with `p2p`). `memory`: this rank's memory directory (its
 * local-mode path: its own rank store, the replicas it keeps, the manifests);
 * `durable`: the durable tier, a multi-rank store every rank can read (NULL: none).
 *
 * The rule: every rank reports what its memory directory holds (amber_tier_holdings)
 * and rank 0 the durable tier's newest committed step D. A step S that some memory
 * directory holds the manifest of, written at this world size, is restorable when
 * each rank r finds what it needs, its own part of S and, when S has a replicated
 * tensor, rank 0's part (rank 0 writes those), in some rank's memory directory
 * (each rank store there holding S in its restorable range), or S is D. The step is
 * the newest restorable S at or above D, else D. Each rank's tier: MEMORY when its
 * own directory holds what it needs; PEER when some directory does (the lowest rank
 * whose directory holds it sends it, pack, sendrecv, unpack, into the directory of
 * the lowest rank that shares the receiver's: one copy per directory); DURABLE
 * otherwise. At this world size a DURABLE rank's part, and rank 0's where needed,
 * is copied from the durable tier into its memory directory as well, so that the
 * memory tier holds the step whole again (a local-mode writer opened there goes on
 * from it, deltas included) and `dir` is `memory`; at another world size the
 * memory directories cannot hold the step (a rank's store is its shard's), nothing
 * of them is used or changed, every rank gets DURABLE and `dir` is `durable`, and
 * the memory directories must be emptied before a local-mode writer opens there
 * (which refuses manifests of another world size). Nothing in any tier (a new job):
 * 0, with AMBER_RESTORE_NONE and step AMBER_NO_STEP. Steps in the memory
 * directories, none of them restorable, and no durable step: AMBER_ENOENT, nothing
 * changed (what is there cannot make a whole step).
 *
 * A wiped host's ranks (an empty memory directory) restore bit-identical from their
 * peers' replicas; with every memory directory lost, every rank restores the
 * durable tier's newest step. Returns the same result on every rank: 0, or the
 * lowest failing rank's code with "rank R: REASON". */
AMBER_API int amber_tiers_restore(const char *memory, const char *durable,
                                  const amber_comm *comm, const amber_p2p *p2p,
                                  amber_tiers_result *out);

#ifdef __cplusplus
}
#endif

#endif /* AMBER_H */

/*
 * fuzz_reader.c - fuzz target for the checkpoint reader (Guarantees 4 and 5).
 *
 * The input becomes ckpt-00000000000000000001.amber in a private store directory
 * (created once and reused; $TMPDIR, else /dev/shm, else /tmp), with LATEST naming
 * step 1 and the state id found in the input's footer, so that the reader gets
 * past LATEST. The directory also holds a fixed full checkpoint of step 0 (see
 * write_parent), so that an input that is a delta of it gets past the parent
 * checks into the delta decoders. The target opens step 1, reads every tensor of
 * at most 64 MiB into a buffer of exactly its size, reads the metadata, lists the
 * store and verifies. It then does the same once more on a copy whose step is 1,
 * whose parent (for a delta) is step 0 with its state id, and whose checksums
 * (header, every chunk the index locates, index, footer) were recomputed, so that
 * mutations reach the parsers behind the checksums instead of stopping at the
 * first mismatch. Beyond crashes and sanitizer reports it aborts when a failure
 * has no message naming the file, or when verify passes although a read failed.
 * Built as a libFuzzer target (AMBER_FUZZ) and, with fuzz/replay.c, as a plain
 * test over tests/corpus/reader/.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* mkdtemp; the libFuzzer build does not define it */
#endif
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "format.h"
#include "internal.h"
#include "io.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define FILE_NAME "ckpt-00000000000000000001.amber"
#define MAX_READ (UINT64_C(64) << 20)

#define ASSERT(c)                                                                        \
  do {                                                                                   \
    if (!(c)) {                                                                          \
      fprintf(stderr, "fuzz_reader: %s failed: %s\n", #c, amber_last_error(NULL));       \
      abort();                                                                           \
    }                                                                                    \
  } while (0)

static char dir[4096];
static amber_store *store;
static uint64_t parent_state;

/* The parent of delta inputs: step 0, chunks of 16 elements, raw. */
static const struct {
  const char *name;
  int dtype;
  uint32_t ndim;
  int64_t shape[1];
} parent_tensors[] = {
    {"a", AMBER_F32, 1, {40}}, /* 3 chunks */
    {"b", AMBER_BF16, 1, {20}},
    {"c", AMBER_U8, 1, {16}},
    {"s", AMBER_I64, 0, {0}},
};
#define NPARENT (sizeof parent_tensors / sizeof parent_tensors[0])

static int write_parent(void) {
  amber_store *st = NULL;
  amber_writer *w = NULL;
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.chunk_elems = 16;
  static uint8_t bytes[NPARENT][160];
  int rc = amber_store_open(&st, dir, NULL);
  if (!rc) rc = amber_writer_open(&w, st, &wo);
  for (size_t i = 0; i < NPARENT && !rc; i++) {
    for (size_t k = 0; k < sizeof bytes[i]; k++) bytes[i][k] = (uint8_t)(k * 7 + i);
    rc = amber_writer_add(w, parent_tensors[i].name, parent_tensors[i].dtype,
                          parent_tensors[i].ndim, parent_tensors[i].shape, bytes[i], NULL);
  }
  if (!rc) rc = amber_writer_save(w, 0, AMBER_SAVE_FULL);
  amber_writer_close(w);
  amber_reader *r = NULL;
  if (!rc) rc = amber_reader_open(&r, st, 0, NULL);
  amber_ckpt_info ci;
  if (!rc) rc = amber_reader_ckpt_info(r, &ci);
  if (!rc) parent_state = ci.hash;
  amber_reader_close(r);
  amber_store_close(st);
  char p[4200];
  snprintf(p, sizeof p, "%s/.lock", dir);
  unlink(p);
  return rc;
}

static void path_of(char *buf, size_t cap, const char *name) {
  snprintf(buf, cap, "%s/%s", dir, name);
}

static void cleanup(void) {
  char p[4200];
  amber_store_close(store);
  path_of(p, sizeof p, FILE_NAME);
  unlink(p);
  path_of(p, sizeof p, "LATEST");
  unlink(p);
  path_of(p, sizeof p, "ckpt-00000000000000000000.amber");
  unlink(p);
  rmdir(dir);
}

static int setup(void) {
  const char *base = getenv("TMPDIR");
  if (!base || !*base) base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
  snprintf(dir, sizeof dir, "%s/amber-fuzz-reader-XXXXXX", base);
  if (!mkdtemp(dir) || write_parent() != 0) return -1;
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY;
  if (amber_store_open(&store, dir, &so) != 0) return -1;
  atexit(cleanup);
  return 0;
}

static void put(const char *name, const void *data, size_t len) {
  char p[4200];
  path_of(p, sizeof p, name);
  int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ASSERT(fd >= 0);
  ASSERT(amber__write_full(fd, data, len) == 0);
  close(fd);
}

/* A failure is a known code with a message that names the file (unless the
 * message is about memory, which has no file to name). */
static void check_failure(int rc, const char *msg) {
  ASSERT(rc < 0 && strcmp(amber_err_name(rc), "AMBER_UNKNOWN") != 0);
  ASSERT(rc == AMBER_ENOMEM || strstr(msg, FILE_NAME) || strstr(msg, "LATEST"));
}

static void run_once(const uint8_t *data, size_t size) {
  char latest[64];
  uint64_t state = size >= AMBER__FOOTER_SIZE ? amber__get64(data + size - 24) : 0;
  int n = snprintf(latest, sizeof latest, "1 %016llx\n", (unsigned long long)state);
  put(FILE_NAME, data, size);
  put("LATEST", latest, (size_t)n);

  amber_reader *r = NULL;
  int rc = amber_reader_open(&r, store, 1, NULL);
  if (rc) {
    check_failure(rc, amber_last_error(NULL));
    ASSERT(r == NULL);
  } else {
    amber_ckpt_info ci;
    const char *meta;
    size_t mlen, index;
    int reads_failed = 0;
    ASSERT(amber_reader_step(r) == 1);
    ASSERT(amber_reader_ckpt_info(r, &ci) == 0 && ci.step == 1 && ci.bytes == size);
    ASSERT(amber_reader_meta(r, &meta, &mlen) == 0 && (mlen == 0 || meta));
    for (size_t i = 0; i < amber_reader_count(r); i++) {
      amber_tensor_info ti;
      ASSERT(amber_reader_info(r, i, &ti) == 0 && ti.name && ti.policy);
      ASSERT(ti.ndim <= AMBER_MAX_DIMS && amber_dtype_size(ti.dtype) != 0);
      ASSERT(ti.nbytes == ti.nelems * amber_dtype_size(ti.dtype));
      ASSERT(amber_reader_find(r, ti.name, &index) == 0 && index == i);
      if (ti.nbytes > MAX_READ) continue;
      uint8_t *buf = malloc(ti.nbytes ? (size_t)ti.nbytes : 1);
      ASSERT(buf);
      rc = amber_reader_read(r, i, buf, ti.nbytes);
      if (rc) {
        check_failure(rc, amber_last_error(r));
        reads_failed++;
      }
      free(buf);
    }
    rc = amber_reader_verify(r);
    if (rc) check_failure(rc, amber_last_error(r));
    else ASSERT(reads_failed == 0); /* verify passed: every tensor must restore */
    amber_reader_close(r);
  }
  amber_ckpt_info *list = NULL;
  size_t count = 0;
  if (amber_store_list(store, &list, &count) == 0) ASSERT(count == 2 && list[1].step == 1);
  amber_free(list);
}

/* Makes the header name step 1 (and parent 0 for a delta) and recomputes every
 * checksum that the bytes allow locating; never reads outside. */
static void reseal(uint8_t *b, size_t n) {
  if (n < AMBER__HEADER_SIZE + AMBER__FOOTER_SIZE) return;
  uint8_t *f = b + n - AMBER__FOOTER_SIZE;
  amber__put64(b + 24, 1);
  if (b[32] == AMBER_KIND_DELTA) {
    amber__put64(b + 40, 0);
    amber__put64(b + 48, parent_state);
  }
  amber__put64(b + 56, amber__xxh3(b, 56));
  uint64_t io = amber__get64(f), isz = amber__get64(f + 8);
  if (io >= AMBER__HEADER_SIZE && io <= n - AMBER__FOOTER_SIZE &&
      isz == n - AMBER__FOOTER_SIZE - io && isz >= AMBER__INDEX_FIXED) {
    uint8_t *ix = b + io;
    uint64_t nt = amber__get64(ix + 8), nc = amber__get64(ix + 16), at = AMBER__INDEX_FIXED;
    for (uint64_t i = 0; i < nt && at <= isz && isz - at >= AMBER__TENSOR_FIXED; i++) {
      at += AMBER__TENSOR_FIXED + 8u * ix[at + 3] + amber__get16(ix + at);
      if (at > isz || isz - at < 2) at = isz + 1;
      else at += 2 + amber__get16(ix + at);
    }
    for (uint64_t j = 0; j < nc && at <= isz && isz - at >= AMBER__CHUNK_ENTRY;
         j++, at += AMBER__CHUNK_ENTRY) {
      uint8_t *c = ix + at;
      uint64_t off = amber__get64(c), sz = amber__get64(c + 8);
      if (off <= n && sz <= n - off) amber__put64(c + 32, sz ? amber__xxh3(b + off, sz) : 0);
    }
    amber__put64(f + 16, amber__xxh3(ix, isz));
  }
  amber__put64(f + 40, amber__xxh3(f, 40));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!store && setup() != 0) {
    fprintf(stderr, "fuzz_reader: cannot create a store directory\n");
    abort();
  }
  run_once(data, size);
  uint8_t *copy = malloc(size ? size : 1);
  ASSERT(copy);
  if (size) memcpy(copy, data, size);
  reseal(copy, size);
  if (size && memcmp(copy, data, size) != 0) run_once(copy, size);
  free(copy);
  return 0;
}

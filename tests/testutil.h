/*
 * testutil.h - the small test harness shared by the C tests.
 *
 * Each tests/test_*.c is one executable (one ctest test) that pins one behaviour
 * area. CHECK* macros record a failure with file:line and go on; a test function
 * is registered with TEST_RUN, and main returns non-zero if anything failed. The
 * last line printed is "N passed, N failed".
 */
#ifndef AMBER_TESTUTIL_H
#define AMBER_TESTUTIL_H

#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "amber.h"

extern int tu_failures;      /* CHECK failures in the current test */
extern int tu_tests_passed;
extern int tu_tests_failed;

#define CHECK(cond)                                                                  \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);      \
      tu_failures++;                                                                 \
    }                                                                                \
  } while (0)

/* Checks that an amber call returned `want`; prints the code and last error if not. */
#define CHECK_RC(expr, want)                                                         \
  do {                                                                               \
    int tu_rc_ = (expr);                                                             \
    if (tu_rc_ != (want)) {                                                          \
      fprintf(stderr, "%s:%d: %s returned %d (%s), wanted %d (%s): %s\n", __FILE__,  \
              __LINE__, #expr, tu_rc_, amber_err_name(tu_rc_), (int)(want),         \
              amber_err_name(want), amber_last_error(NULL));                        \
      tu_failures++;                                                                 \
    }                                                                                \
  } while (0)

#define CHECK_OK(expr) CHECK_RC(expr, 0)

/* Runs one test function and reports it by name. */
#define TEST_RUN(fn) tu_run(#fn, fn)
void tu_run(const char *name, void (*fn)(void));
/* Prints the summary line and returns main's exit status. */
int tu_finish(void);

/* A fresh empty directory under $TMPDIR (or /tmp), removed by tu_finish unless
 * AMBER_KEEP_TMP is set. Returns a static-lifetime string. */
const char *tu_tmpdir(void);
/* The same on a memory file system (/dev/shm: its files are read through a
 * mapping); NULL where there is none (the caller skips what needs one). */
const char *tu_memdir(void);
/* Writer options `wo` initialized for chunks of `chunk_elems` elements and deltas
 * only, whatever their size, after the first save (a full one when asked). */
void tu_deltas_only(amber_writer_opts *wo, uint64_t chunk_elems);
/* Store `dir` (which must exist), opened read-only; NULL, with a failed check, when
 * it cannot be. */
amber_store *tu_open_ro(const char *dir);
/* Removes a directory tree (best effort). */
void tu_rm_rf(const char *path);
/* Deterministic pseudo-random numbers (xorshift64*). */
uint64_t tu_rand(uint64_t *state);
void tu_fill_random(void *buf, size_t n, uint64_t seed);
/* Reads a whole file into a malloc'ed buffer; returns NULL on failure. */
uint8_t *tu_read_file(const char *path, size_t *len);
int tu_write_file(const char *path, const void *data, size_t len);
/* Flips the bits `mask` of the byte at `pos` of a file (pos < 0: from its end;
 * TU_MIDDLE: its middle byte); 0, or -1 when there is no such byte. */
#define TU_MIDDLE LONG_MIN
int tu_flip_byte(const char *path, long pos, uint8_t mask);
/* Runs a shell command, returns its exit status (or -1). */
int tu_system(const char *fmt, ...);

/* The independent reader: every safetensors file that amber writes in the tests is
 * also read by Hugging Face's safetensors (tests/safetensors_read.py), which must
 * accept it and see exactly the tensors (names, dtypes, shapes, bytes by CRC-32) and
 * the __metadata__ that amber's own parser sees; a difference is a CHECK failure.
 * The Python is $AMBER_PYTHON, else the build's (CMake: the project's .venv when it
 * existed at configure time). With neither, the check cannot run: it says so on
 * stderr, loudly, once per test program, and the ctest test safetensors_reference
 * reports itself Skipped; a Python that cannot import safetensors is a failure.
 * Returns 1 when the file was checked, 0 when it could not be. */
int tu_st_reference_check(const char *path);

#endif

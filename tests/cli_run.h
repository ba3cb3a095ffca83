/*
 * cli_run.h - the tests' way of running the `amber` CLI (AMBER_CLI, the binary
 * CMake built): `cli("ls --json '%s'", dir)` runs it through the shell, capturing its
 * exit status, stdout and stderr. Progress lines are off unless AMBER_PROGRESS is
 * set; AMBER_TEST_VERBOSE=1 echoes each command and what it printed.
 */
#ifndef AMBER_TEST_CLI_RUN_H
#define AMBER_TEST_CLI_RUN_H

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

typedef struct {
  int rc;
  char *out, *err; /* NUL-terminated stdout and stderr */
} result;

static inline char *cli_read_text(const char *path) {
  size_t len = 0;
  uint8_t *b = tu_read_file(path, &len);
  char *s = malloc(len + 1);
  if (b) memcpy(s, b, len);
  s[b ? len : 0] = 0;
  free(b);
  return s;
}

/* Runs `amber ARGS` (ARGS is shell text). */
__attribute__((format(printf, 1, 2), unused)) static result cli(const char *fmt, ...) {
  static const char *dir;
  if (!dir) dir = tu_tmpdir();
  char args[8192], o[4200], e[4200];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(args, sizeof args, fmt, ap);
  va_end(ap);
  snprintf(o, sizeof o, "%s/stdout", dir);
  snprintf(e, sizeof e, "%s/stderr", dir);
  result r;
  r.rc = tu_system("AMBER_PROGRESS=${AMBER_PROGRESS:-0} '%s' %s >'%s' 2>'%s'", AMBER_CLI,
                   args, o, e);
  r.out = cli_read_text(o);
  r.err = cli_read_text(e);
  if (getenv("AMBER_TEST_VERBOSE")) fprintf(stderr, "$ amber %s\n%s%s", args, r.out, r.err);
  return r;
}

/* Checks the exit status; on a mismatch shows what the CLI said. */
#define CHECK_EXIT(r, want)                                                              \
  do {                                                                                   \
    CHECK((r).rc == (want));                                                             \
    if ((r).rc != (want))                                                                \
      fprintf(stderr, "  exit %d, wanted %d; stderr: %s", (r).rc, (want), (r).err);      \
  } while (0)

static inline void result_free(result *r) {
  free(r->out);
  free(r->err);
}

#endif /* AMBER_TEST_CLI_RUN_H */

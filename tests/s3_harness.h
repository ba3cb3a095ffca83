/*
 * s3_harness.h - a real S3 server for the C tests of src/s3.c: tests/s3_server.py
 * (moto's S3 server with signatures checked, behind a fault-injecting proxy), started
 * by the test program on 127.0.0.1 and stopped at its end.
 *
 * The Python is $AMBER_PYTHON, else the build's (the project's .venv, where
 * scripts/setup --python installs moto). When the server cannot start, or the library
 * was built without S3 support, the test program is skipped (exit 77, which ctest
 * shows as Skipped) with the reason on stderr; under CI (CI set) a server that cannot
 * start fails the test instead, so that CI never passes without running these.
 */
#ifndef AMBER_S3_HARNESS_H
#define AMBER_S3_HARNESS_H

#include <sys/types.h>

#include "s3.h"

typedef struct tu_s3 {
  pid_t pid;
  int to, from; /* the server's stdin and stdout */
  int proxy_port, server_port;
  char key[128], secret[128];
} tu_s3;

/* Starts the server; 0, or -1 when it could not (the reason printed). */
int tu_s3_start(tu_s3 *h);
/* Closes its stdin and waits for it (killed after 10 s). */
void tu_s3_stop(tu_s3 *h);
/* The exit status of a test program whose server could not start: 77, or 1 under CI. */
int tu_s3_skip(const char *why);
/* Sends one command ("fail 2 503 SlowDown", "count", "down", ...) and returns its
 * answer line (static storage), "" when there was none within 60 s. */
const char *tu_s3_cmd(tu_s3 *h, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Requests seen by the proxy since the last "reset", and the most in flight at once. */
int tu_s3_requests(tu_s3 *h, int *most);

/* Points the AWS environment at the proxy (or the server itself, direct = 1) with the
 * test user's credentials, and away from any ~/.aws files of the machine. */
void tu_s3_env(tu_s3 *h, int direct);
/* A client of s3://amber-test/PREFIX as the environment says (tu_s3_env), with
 * `opts` (NULL: defaults) but backoffs of 20 ms unless given; NULL on failure
 * (printed). */
amber__s3 *tu_s3_client(const char *prefix, const amber__s3_opts *opts);

#endif

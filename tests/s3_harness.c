/*
 * s3_harness.c - starts, drives and stops tests/s3_server.py for the S3 tests (see
 * s3_harness.h).
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "s3_harness.h"

#ifndef AMBER_TEST_PYTHON
#define AMBER_TEST_PYTHON ""
#endif

/* One line from fd within `ms` milliseconds; "" when none came. */
static const char *read_line(int fd, int ms) {
  static char line[1024];
  size_t n = 0;
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  while (n + 1 < sizeof line) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    int left =
        ms - (int)((t.tv_sec - t0.tv_sec) * 1000 + (t.tv_nsec - t0.tv_nsec) / 1000000);
    struct pollfd p = {fd, POLLIN, 0};
    if (left <= 0 || poll(&p, 1, left) <= 0) break;
    char c;
    if (read(fd, &c, 1) != 1) break;
    if (c == '\n') {
      line[n] = 0;
      return line;
    }
    line[n++] = c;
  }
  line[0] = 0;
  return line;
}

int tu_s3_skip(const char *why) {
  const char *ci = getenv("CI");
  if (ci && *ci && strcmp(ci, "false") != 0) {
    fprintf(stderr,
            "FAILED: %s; under CI the S3 tests must run (scripts/setup --python "
            "installs moto into .venv)\n",
            why);
    return 1;
  }
  fprintf(stderr, "SKIPPED: %s\n", why);
  return 77;
}

int tu_s3_start(tu_s3 *h) {
  memset(h, 0, sizeof *h);
  const char *py = getenv("AMBER_PYTHON");
  if (!py || !*py) py = AMBER_TEST_PYTHON;
  if (!*py) {
    fprintf(stderr,
            "no Python for tests/s3_server.py: run scripts/setup --python, or set "
            "AMBER_PYTHON to a Python with moto[server]\n");
    return -1;
  }
  int in[2], out[2];
  if (pipe2(in, O_CLOEXEC) < 0 || pipe2(out, O_CLOEXEC) < 0) return -1;
  h->pid = fork();
  if (h->pid < 0) return -1;
  if (h->pid == 0) {
    dup2(in[0], 0);
    dup2(out[1], 1);
    execl(py, py, AMBER_SOURCE_DIR "/tests/s3_server.py", "--timeout", "900",
          (char *)NULL);
    fprintf(stderr, "exec %s: %s\n", py, strerror(errno));
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  h->to = in[1];
  h->from = out[0];
  const char *line = read_line(h->from, 120000);
  if (sscanf(line, "ready %d %d %127s %127s", &h->proxy_port, &h->server_port, h->key,
             h->secret) != 4) {
    fprintf(stderr,
            "%s tests/s3_server.py did not start (said '%s'; is moto[server] "
            "installed in that Python?)\n",
            py, line);
    tu_s3_stop(h);
    return -1;
  }
  signal(SIGPIPE, SIG_IGN);
  return 0;
}

void tu_s3_stop(tu_s3 *h) {
  if (h->pid <= 0) return;
  close(h->to);
  for (int i = 0; i < 100; i++) {
    if (waitpid(h->pid, NULL, WNOHANG) == h->pid) goto done;
    usleep(100000);
  }
  kill(h->pid, SIGKILL);
  waitpid(h->pid, NULL, 0);
done:
  close(h->from);
  h->pid = 0;
}

const char *tu_s3_cmd(tu_s3 *h, const char *fmt, ...) {
  char cmd[512];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(cmd, sizeof cmd - 1, fmt, ap);
  va_end(ap);
  cmd[n++] = '\n';
  if (write(h->to, cmd, (size_t)n) != n) return "";
  const char *r = read_line(h->from, 60000);
  if (strncmp(r, "ok", 2) != 0)
    fprintf(stderr, "s3_server.py: %.*s: '%s'\n", n - 1, cmd, r);
  return r;
}

int tu_s3_requests(tu_s3 *h, int *most) {
  int req = -1, conns = 0, m = 0;
  sscanf(tu_s3_cmd(h, "count"), "ok %d %d %d", &req, &conns, &m);
  if (most) *most = m;
  return req;
}

void tu_s3_env(tu_s3 *h, int direct) {
  char url[64];
  snprintf(url, sizeof url, "http://127.0.0.1:%d",
           direct ? h->server_port : h->proxy_port);
  setenv("AWS_ENDPOINT_URL", url, 1);
  setenv("AWS_ACCESS_KEY_ID", h->key, 1);
  setenv("AWS_SECRET_ACCESS_KEY", h->secret, 1);
  setenv("AWS_REGION", "us-east-1", 1);
  setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials", 1);
  setenv("AWS_CONFIG_FILE", "/nonexistent/config", 1);
  unsetenv("AWS_SESSION_TOKEN");
  unsetenv("AWS_PROFILE");
  unsetenv("AWS_DEFAULT_PROFILE");
  unsetenv("AWS_ENDPOINT_URL_S3");
  unsetenv("AWS_DEFAULT_REGION");
  unsetenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS");
}

amber__s3 *tu_s3_client(const char *prefix, const amber__s3_opts *opts) {
  char url[256];
  snprintf(url, sizeof url, "s3://amber-test/%s", prefix);
  amber__s3_opts o;
  memset(&o, 0, sizeof o);
  if (opts) o = *opts;
  if (!o.backoff_ms) o.backoff_ms = 20; /* tests wait little between retries */
  amber__s3 *s = NULL;
  if (amber__s3_open(&s, url, &o) < 0) {
    fprintf(stderr, "amber__s3_open(%s): %s\n", url, amber_last_error(NULL));
    return NULL;
  }
  return s;
}

/* testutil.c - implementation of the shared C test harness (see testutil.h). */
#include "testutil.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

int tu_failures;
int tu_tests_passed;
int tu_tests_failed;

static char *tmpdirs[256];
static int ntmpdirs;

void tu_run(const char *name, void (*fn)(void)) {
  tu_failures = 0;
  fn();
  if (tu_failures) {
    fprintf(stderr, "FAIL %s (%d checks)\n", name, tu_failures);
    tu_tests_failed++;
  } else {
    printf("ok   %s\n", name);
    fflush(stdout);
    tu_tests_passed++;
  }
}

int tu_finish(void) {
  if (!getenv("AMBER_KEEP_TMP"))
    for (int i = 0; i < ntmpdirs; i++) tu_rm_rf(tmpdirs[i]);
  for (int i = 0; i < ntmpdirs; i++) free(tmpdirs[i]);
  printf("%d passed, %d failed\n", tu_tests_passed, tu_tests_failed);
  return tu_tests_failed ? 1 : 0;
}

const char *tu_tmpdir(void) {
  const char *base = getenv("TMPDIR");
  char tmpl[4096];
  snprintf(tmpl, sizeof tmpl, "%s/amber-test-XXXXXX", base && *base ? base : "/tmp");
  if (!mkdtemp(tmpl) || ntmpdirs == 256) {
    perror("mkdtemp");
    exit(2);
  }
  tmpdirs[ntmpdirs] = strdup(tmpl);
  return tmpdirs[ntmpdirs++];
}

void tu_rm_rf(const char *path) {
  struct stat sb;
  if (lstat(path, &sb) != 0) return;
  if (S_ISDIR(sb.st_mode)) {
    DIR *d = opendir(path);
    if (d) {
      struct dirent *e;
      while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char sub[4096];
        snprintf(sub, sizeof sub, "%s/%s", path, e->d_name);
        tu_rm_rf(sub);
      }
      closedir(d);
    }
    rmdir(path);
  } else {
    unlink(path);
  }
}

uint64_t tu_rand(uint64_t *s) {
  uint64_t x = *s ? *s : 0x9E3779B97F4A7C15ull;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  *s = x;
  return x * 0x2545F4914F6CDD1Dull;
}

void tu_fill_random(void *buf, size_t n, uint64_t seed) {
  uint8_t *p = buf;
  uint64_t s = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; i += 8) {
    uint64_t r = tu_rand(&s);
    size_t k = n - i < 8 ? n - i : 8;
    memcpy(p + i, &r, k);
  }
}

uint8_t *tu_read_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  uint8_t *b = malloc(n > 0 ? (size_t)n : 1);
  if (b && n > 0 && fread(b, 1, (size_t)n, f) != (size_t)n) {
    free(b);
    b = NULL;
  }
  fclose(f);
  if (b) *len = (size_t)n;
  return b;
}

int tu_write_file(const char *path, const void *data, size_t len) {
  FILE *f = fopen(path, "wb");
  if (!f) return -1;
  size_t w = fwrite(data, 1, len, f);
  return (fclose(f) == 0 && w == len) ? 0 : -1;
}

int tu_flip_byte(const char *path, long pos, uint8_t mask) {
  int fd = open(path, O_RDWR);
  if (fd < 0) return -1;
  struct stat sb;
  long size = fstat(fd, &sb) == 0 ? (long)sb.st_size : -1;
  long at = pos == TU_MIDDLE ? size / 2 : pos < 0 ? size + pos : pos;
  uint8_t b;
  int ok = size > 0 && at >= 0 && at < size && pread(fd, &b, 1, at) == 1;
  b = (uint8_t)(b ^ mask);
  ok = ok && pwrite(fd, &b, 1, at) == 1;
  return (close(fd) == 0 && ok) ? 0 : -1;
}

int tu_system(const char *fmt, ...) {
  char cmd[8192];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(cmd, sizeof cmd, fmt, ap);
  va_end(ap);
  int st = system(cmd);
  if (st == -1 || !WIFEXITED(st)) return -1;
  return WEXITSTATUS(st);
}

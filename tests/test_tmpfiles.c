/*
 * test_tmpfiles.c - temporary files are created safely.
 *
 * Every file that amber writes under a temporary name and renames into place
 * (checkpoint files of a save and of compact, LATEST, the output of `amber
 * export`) is created exclusively, under a name that nobody can predict and
 * without following links: a symlink planted at the name an older amber used
 * (or at any guess) is never written through, the file it points to stays
 * untouched, and what is renamed into place is a regular file with the mode that
 * 0644 and the umask give.
 */
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "internal.h"
#include "io.h"
#include "testutil.h"

#define N 200000
static const char precious[] = "precious data that no checkpoint may overwrite\n";

/* A file outside the store that planted links point at. */
static const char *make_target(void) {
  static char path[4200];
  snprintf(path, sizeof path, "%s/target", tu_tmpdir());
  CHECK(tu_write_file(path, precious, sizeof precious - 1) == 0);
  return path;
}

static void check_target_untouched(const char *target) {
  size_t len = 0;
  uint8_t *b = tu_read_file(target, &len);
  CHECK(b && len == sizeof precious - 1 && memcmp(b, precious, len) == 0);
  free(b);
}

static void check_regular(const char *path, mode_t mode) {
  struct stat sb;
  CHECK(lstat(path, &sb) == 0);
  CHECK(S_ISREG(sb.st_mode));
  if ((sb.st_mode & 0777) != mode) {
    fprintf(stderr, "  %s: mode %o, wanted %o\n", path, (unsigned)(sb.st_mode & 0777),
            (unsigned)mode);
    CHECK(0);
  }
}

static void plant(const char *target, const char *fmt, const char *dir, long n) {
  char link[4200];
  snprintf(link, sizeof link, fmt, dir, n);
  CHECK(symlink(target, link) == 0);
}

/* Saves, compact and LATEST never write through links at their old names. */
static void test_saves_and_compact_do_not_follow_planted_links(void) {
  const char *target = make_target(), *dir = tu_tmpdir();
  mode_t old_mask = umask(027);
  float *x = malloc(N * sizeof *x), *at3 = malloc(N * sizeof *x);
  tu_fill_random(x, N * sizeof *x, 1);
  amber_store *st = NULL;
  amber_writer *w = NULL;
  CHECK_OK(amber_store_open(&st, dir, NULL)); /* clears *.tmp: plant after the open */
  CHECK_OK(amber_writer_open(&w, st, NULL));
  int64_t n = N;
  CHECK_OK(amber_writer_add(w, "x", AMBER_F32, 1, &n, x, NULL));
  for (long step = 1; step <= 3; step++) {
    plant(target, "%s/ckpt-%020ld.amber.tmp", dir, step); /* the names amber used */
    plant(target, "%s/LATEST.tmp%.0ld", dir, 0);
    CHECK_OK(amber_writer_save(w, (uint64_t)step, 0));
    if (step == 3) memcpy(at3, x, N * sizeof *x);
    x[step] = (float)step;
    char p[4200];
    snprintf(p, sizeof p, "%s/ckpt-%020ld.amber", dir, step);
    check_regular(p, 0640);
    snprintf(p, sizeof p, "%s/LATEST", dir);
    check_regular(p, 0640);
    snprintf(p, sizeof p, "%s/LATEST.tmp", dir);
    CHECK(unlink(p) == 0);
    check_target_untouched(target);
  }
  amber_writer_close(w);
  plant(target, "%s/ckpt-%020ld.amber.tmp", dir, 4);
  CHECK_OK(amber_store_compact(st, 3)); /* a delta: rewritten through a temporary file */
  char p[4200];
  snprintf(p, sizeof p, "%s/ckpt-%020d.amber", dir, 3);
  check_regular(p, 0640);
  check_target_untouched(target);
  amber_reader *r = NULL;
  float *y = malloc(N * sizeof *y);
  CHECK_OK(amber_reader_open(&r, st, 3, NULL));
  if (r) CHECK_OK(amber_reader_read(r, 0, y, N * sizeof *y));
  CHECK(memcmp(at3, y, N * sizeof *y) == 0);
  amber_reader_close(r);
  amber_store_close(st);
  umask(old_mask);
  free(x);
  free(at3);
  free(y);
}

/* The names cannot be predicted: two in a row differ, and each is new. */
static void test_temporary_names_are_unpredictable_and_exclusive(void) {
  const char *dir = tu_tmpdir();
  char prefix[4200], a[4200], b[4200];
  snprintf(prefix, sizeof prefix, "%s/out", dir);
  int fa = -1, fb = -1;
  CHECK_OK(amber__create_tmp(NULL, prefix, a, sizeof a, &fa));
  CHECK_OK(amber__create_tmp(NULL, prefix, b, sizeof b, &fb));
  CHECK(strcmp(a, b) != 0);
  CHECK(strncmp(a, prefix, strlen(prefix)) == 0 && strlen(a) == strlen(prefix) + 21);
  CHECK(!strcmp(a + strlen(a) - 4, ".tmp"));
  close(fa);
  close(fb);
  check_regular(a, 0644 & ~(mode_t)022);
  char longp[5000];
  memset(longp, 'a', sizeof longp - 1);
  longp[sizeof longp - 1] = 0;
  CHECK_RC(amber__create_tmp(NULL, longp, a, sizeof a, &fa), AMBER_EINVAL);
}

/* `amber export -o OUT` with a link planted where it wrote before (OUT.tmp-<pid>:
 * the child plants it for its own pid and then becomes the CLI). */
static void test_export_does_not_follow_a_planted_link(void) {
  const char *target = make_target(), *dir = tu_tmpdir(), *shared = tu_tmpdir();
  float x[1000];
  tu_fill_random(x, sizeof x, 2);
  amber_store *st = NULL;
  amber_writer *w = NULL;
  CHECK_OK(amber_store_open(&st, dir, NULL));
  CHECK_OK(amber_writer_open(&w, st, NULL));
  int64_t n = 1000;
  CHECK_OK(amber_writer_add(w, "x", AMBER_F32, 1, &n, x, NULL));
  CHECK_OK(amber_writer_save(w, 1, 0));
  amber_writer_close(w);
  amber_store_close(st);
  char out[4200];
  snprintf(out, sizeof out, "%s/out.safetensors", shared);
  pid_t pid = fork();
  if (pid == 0) {
    char link[4300];
    snprintf(link, sizeof link, "%s.tmp-%ld", out, (long)getpid());
    if (symlink(target, link) != 0) _exit(99);
    execl(AMBER_CLI, "amber", "export", dir, "-o", out, (char *)NULL);
    _exit(98);
  }
  int status = 0;
  CHECK(waitpid(pid, &status, 0) == pid);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  check_target_untouched(target);
  check_regular(out, 0644 & ~(mode_t)022);
  size_t len = 0;
  uint8_t *b = tu_read_file(out, &len);
  CHECK(b && len > sizeof x && memcmp(b + len - sizeof x, x, sizeof x) == 0);
  free(b);
}

int main(void) {
  umask(022);
  TEST_RUN(test_saves_and_compact_do_not_follow_planted_links);
  TEST_RUN(test_temporary_names_are_unpredictable_and_exclusive);
  TEST_RUN(test_export_does_not_follow_a_planted_link);
  return tu_finish();
}

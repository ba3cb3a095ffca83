/*
 * test_readonly.c - read-only means read-only (include/amber.h, AMBER_OPEN_READONLY).
 *
 * A read-only or NOCREATE open of a missing path fails with AMBER_ENOENT and says
 * "no store at PATH", and creates nothing, not even for a moment: the test binary
 * interposes mkdir and rmdir (the library is linked statically, so its calls come
 * here) and counts them, which also works as root, where a read-only parent does not
 * stop a mkdir. An existing store opened read-only, listed, restored and verified
 * is left exactly as it was (every entry's name, inode, size, mtime and ctime, and
 * the directory's own): no lock file, no temporary file, no clean-up of a crashed
 * writer's leftovers. The CLI's read-only commands (ls, info, verify, export) on a
 * missing path exit 1 with the "no store at" message and create nothing.
 */
#include <dirent.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "testutil.h"

/* ---- mkdir and rmdir, counted while armed ---- */

static int armed, mkdirs, rmdirs;

int mkdir(const char *path, mode_t mode) {
  if (armed) mkdirs++;
  return mkdirat(AT_FDCWD, path, mode);
}

int rmdir(const char *path) {
  if (armed) rmdirs++;
  return unlinkat(AT_FDCWD, path, AT_REMOVEDIR);
}

static void arm(void) {
  armed = 1;
  mkdirs = rmdirs = 0;
}

/* Disarms; checks that nothing was created or removed while armed. */
#define CHECK_NO_MKDIR()                                                               \
  do {                                                                                 \
    armed = 0;                                                                         \
    CHECK(mkdirs == 0);                                                                \
    CHECK(rmdirs == 0);                                                                \
  } while (0)

static int exists(const char *path) {
  struct stat sb;
  return lstat(path, &sb) == 0;
}

/* Sets a directory's times far in the past, so that any change of its entries
 * (even a mkdir undone at once) shows in its mtime, whatever the clock's grain. */
static void age(const char *dir) {
  struct timespec t[2] = {{1000000000, 0}, {1000000000, 0}};
  CHECK(utimensat(AT_FDCWD, dir, t, AT_SYMLINK_NOFOLLOW) == 0);
}

static int unchanged_since_age(const char *dir) {
  struct stat sb;
  return stat(dir, &sb) == 0 && sb.st_mtim.tv_sec == 1000000000 &&
         sb.st_mtim.tv_nsec == 0;
}

/* Opens `path` with `flags` and checks the refusal: AMBER_ENOENT, a message that
 * says "no store at" and names the path, and nothing created. */
static void check_no_store(const char *path, uint32_t flags, const char *why) {
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = flags;
  amber_store *st = NULL;
  arm();
  CHECK_RC(amber_store_open(&st, path, &so), AMBER_ENOENT);
  CHECK_NO_MKDIR();
  CHECK(st == NULL);
  const char *msg = amber_last_error(NULL);
  if (!strstr(msg, "no store at") || !strstr(msg, path) || !strstr(msg, why)) {
    fprintf(stderr, "  flags %u, %s: message '%s'\n", flags, path, msg);
    CHECK(0);
  }
  amber_store_close(st);
}

static const uint32_t refusing[] = {AMBER_OPEN_READONLY,
                                    AMBER_OPEN_READONLY | AMBER_OPEN_NOCREATE,
                                    AMBER_OPEN_NOCREATE};

static void test_open_of_missing_path_creates_nothing(void) {
  const char *d = tu_tmpdir();
  char missing[4200], deeper[4200], file[4200];
  snprintf(missing, sizeof missing, "%s/missing", d);
  snprintf(deeper, sizeof deeper, "%s/missing/deeper", d);
  snprintf(file, sizeof file, "%s/file", d);
  CHECK(tu_write_file(file, "x", 1) == 0);
  age(d);
  for (size_t i = 0; i < sizeof refusing / sizeof refusing[0]; i++) {
    check_no_store(missing, refusing[i], "no such directory");
    check_no_store(deeper, refusing[i], "no such directory");
    check_no_store(file, refusing[i], "not a directory");
    CHECK(!exists(missing));
  }
  CHECK(unchanged_since_age(d));
}

/* A writable open creates the store's directory and the parents it lacks (as
 * Python's Checkpointer does): a fresh "runs/x" works as written; a parent that is a
 * file is a clear error. */
static void test_writable_open_creates_missing_parents(void) {
  const char *d = tu_tmpdir();
  char deep[4200], under_file[4200], file[4200];
  snprintf(deep, sizeof deep, "%s/runs/a/b/x", d);
  snprintf(file, sizeof file, "%s/plain", d);
  snprintf(under_file, sizeof under_file, "%s/plain/x", d);
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, deep, NULL));
  amber_store_close(st);
  CHECK(exists(deep));
  CHECK(tu_write_file(file, "x", 1) == 0);
  CHECK(amber_store_open(&st, under_file, NULL) < 0);
  CHECK(strstr(amber_last_error(NULL), "cannot create store") != NULL);
}

/* Under a parent that nobody may write to, a missing store is still "no store",
 * never "cannot create store". As root the mode stops nothing: the counted mkdir
 * and the parent's mtime show that no attempt was made. */
static void test_open_under_readonly_parent_says_no_store(void) {
  const char *d = tu_tmpdir();
  char parent[4200], missing[4200];
  snprintf(parent, sizeof parent, "%s/ro", d);
  snprintf(missing, sizeof missing, "%s/ro/store", d);
  CHECK(mkdir(parent, 0755) == 0);
  CHECK(chmod(parent, 0555) == 0);
  age(parent);
  for (size_t i = 0; i < sizeof refusing / sizeof refusing[0]; i++) {
    check_no_store(missing, refusing[i], "no such directory");
    CHECK(!exists(missing));
  }
  CHECK(unchanged_since_age(parent));
  CHECK(chmod(parent, 0755) == 0);
}

/* ---- an existing store ---- */

#define NX 5000

typedef struct entry {
  char name[256];
  struct stat sb;
} entry;

/* Every entry of `dir` (and the directory itself as "."), sorted by name. */
static size_t snapshot(const char *dir, entry *out, size_t cap) {
  size_t n = 0;
  DIR *dh = opendir(dir);
  CHECK(dh != NULL);
  struct dirent *de;
  while (dh && (de = readdir(dh)) && n < cap) {
    if (!strcmp(de->d_name, "..")) continue;
    char p[4400];
    snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
    snprintf(out[n].name, sizeof out[n].name, "%s", de->d_name);
    CHECK(lstat(p, &out[n].sb) == 0);
    n++;
  }
  if (dh) closedir(dh);
  for (size_t i = 1; i < n; i++) /* insertion sort: a handful of entries */
    for (size_t j = i; j > 0 && strcmp(out[j - 1].name, out[j].name) > 0; j--) {
      entry t = out[j];
      out[j] = out[j - 1];
      out[j - 1] = t;
    }
  return n;
}

static int same_time(struct timespec a, struct timespec b) {
  return a.tv_sec == b.tv_sec && a.tv_nsec == b.tv_nsec;
}

static void check_same(const entry *a, size_t na, const entry *b, size_t nb) {
  CHECK(na == nb);
  for (size_t i = 0; i < na && i < nb; i++) {
    int same = !strcmp(a[i].name, b[i].name) && a[i].sb.st_ino == b[i].sb.st_ino &&
               a[i].sb.st_size == b[i].sb.st_size &&
               same_time(a[i].sb.st_mtim, b[i].sb.st_mtim) &&
               same_time(a[i].sb.st_ctim, b[i].sb.st_ctim);
    if (!same) {
      fprintf(stderr, "  entry %zu: '%s' became '%s' (or its size or times changed)\n", i,
              a[i].name, b[i].name);
      CHECK(0);
    }
  }
}

/* A store with a full and a delta step, without the .lock its writer made (as a
 * copied or downloaded store is), plus what a crashed writer leaves: a temporary
 * file and a checkpoint file newer than LATEST. A writable open would take the
 * lock and remove both leftovers. */
static const char *make_store(void) {
  const char *d = tu_tmpdir();
  static float x[NX];
  tu_fill_random(x, sizeof x, 3);
  amber_store *st = NULL;
  amber_writer *w = NULL;
  CHECK_OK(amber_store_open(&st, d, NULL));
  CHECK_OK(amber_writer_open(&w, st, NULL));
  int64_t shape[1] = {NX};
  CHECK_OK(amber_writer_add(w, "x", AMBER_F32, 1, shape, x, NULL));
  CHECK_OK(amber_writer_set_meta(w, "{\"step\":1}", 10));
  CHECK_OK(amber_writer_save(w, 1, 0));
  for (int i = 0; i < NX; i += 7) x[i] += 1.0f;
  CHECK_OK(amber_writer_save(w, 2, 0));
  amber_writer_close(w);
  amber_store_close(st);
  char p[4200], q[4200];
  snprintf(p, sizeof p, "%s/.lock", d);
  CHECK(unlink(p) == 0);
  snprintf(p, sizeof p, "%s/ckpt-00000000000000000003.amber.tmp", d);
  CHECK(tu_write_file(p, "partial", 7) == 0);
  size_t len = 0;
  snprintf(q, sizeof q, "%s/ckpt-00000000000000000002.amber", d);
  uint8_t *b = tu_read_file(q, &len);
  CHECK(b != NULL);
  snprintf(p, sizeof p, "%s/ckpt-00000000000000000009.amber", d);
  CHECK(b && tu_write_file(p, b, len) == 0);
  free(b);
  return d;
}

/* Everything a read-only handle can do: list, find the latest, restore, verify
 * with and without fallback, read the metadata. */
static void use_readonly(const char *dir) {
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY;
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, dir, &so));
  if (!st) return;
  amber_ckpt_info *ck = NULL;
  size_t n = 0;
  CHECK_OK(amber_store_list(st, &ck, &n));
  CHECK(n == 2);
  amber_free(ck);
  uint64_t latest = 0;
  CHECK_OK(amber_store_latest(st, &latest));
  CHECK(latest == 2);
  amber_reader_opts ro;
  amber_reader_opts_init(&ro);
  ro.flags = AMBER_READER_FALLBACK;
  for (int i = 0; i < 2; i++) {
    amber_reader *r = NULL;
    CHECK_OK(amber_reader_open(&r, st, AMBER_LATEST, i ? &ro : NULL));
    if (!r) continue;
    static float y[NX];
    CHECK_OK(amber_reader_read(r, 0, y, sizeof y));
    const char *meta = NULL;
    size_t len = 0;
    CHECK_OK(amber_reader_meta(r, &meta, &len));
    CHECK(len == 10);
    CHECK_OK(amber_reader_verify(r));
    amber_reader_close(r);
  }
  CHECK_RC(amber_store_compact(st, 2), AMBER_EREADONLY);
  CHECK_RC(amber_store_prune(st, 1, NULL), AMBER_EREADONLY);
  amber_writer *w = NULL;
  CHECK_RC(amber_writer_open(&w, st, NULL), AMBER_EREADONLY);
  amber_store_close(st);
}

static void test_readonly_open_of_store_writes_nothing(void) {
  const char *d = make_store();
  static entry before[64], after[64];
  size_t nb = snapshot(d, before, 64);
  arm();
  use_readonly(d);
  CHECK_NO_MKDIR();
  size_t na = snapshot(d, after, 64);
  check_same(before, nb, after, na);
  char p[4200];
  snprintf(p, sizeof p, "%s/.lock", d);
  CHECK(!exists(p));
  snprintf(p, sizeof p, "%s/ckpt-00000000000000000003.amber.tmp", d);
  CHECK(exists(p)); /* a crashed writer's leftovers are a writer's to clean */
}

/* A read-only handle takes no lock: a writer can open the store meanwhile. */
static void test_readonly_open_takes_no_lock(void) {
  const char *d = make_store();
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY;
  amber_store *ro = NULL, *rw = NULL;
  CHECK_OK(amber_store_open(&ro, d, &so));
  CHECK_OK(amber_store_open(&rw, d, NULL));
  amber_store_close(rw);
  amber_store_close(ro);
}

/* ---- the CLI ---- */

/* Runs `amber CMD PATH [EXTRA]` and checks: exit 1, "no store at PATH" on stderr,
 * PATH not created, its parent's entries untouched. */
static void check_cli_no_store(const char *dir, const char *cmd, const char *path,
                               const char *extra) {
  char err[4200];
  snprintf(err, sizeof err, "%s/stderr", dir);
  int rc =
      tu_system("'%s' %s '%s' %s 2>'%s' >/dev/null", AMBER_CLI, cmd, path, extra, err);
  CHECK(rc == 1);
  size_t len = 0;
  char *text = (char *)tu_read_file(err, &len);
  char want[4300];
  snprintf(want, sizeof want, "amber: no store at %s", path);
  if (!text || !memmem(text, len, want, strlen(want))) {
    fprintf(stderr, "  amber %s: exit %d, stderr '%.*s', wanted '%s'\n", cmd, rc,
            text ? (int)len : 0, text ? text : "", want);
    CHECK(0);
  }
  free(text);
  CHECK(!exists(path));
}

static void test_cli_readonly_commands_on_missing_path_say_no_store(void) {
  const char *d = tu_tmpdir();
  char parent[4200], missing[4200], out[4200], extra[4300];
  snprintf(parent, sizeof parent, "%s/ro", d);
  snprintf(missing, sizeof missing, "%s/ro/store", d);
  snprintf(out, sizeof out, "%s/out.safetensors", d);
  snprintf(extra, sizeof extra, "-o '%s'", out);
  CHECK(mkdir(parent, 0755) == 0);
  for (int readonly_parent = 0; readonly_parent < 2; readonly_parent++) {
    CHECK(chmod(parent, readonly_parent ? 0555 : 0755) == 0);
    age(parent);
    check_cli_no_store(d, "ls", missing, "");
    check_cli_no_store(d, "ls --json", missing, "");
    check_cli_no_store(d, "info", missing, "");
    check_cli_no_store(d, "verify", missing, "");
    check_cli_no_store(d, "export", missing, extra);
    CHECK(unchanged_since_age(parent));
    CHECK(!exists(out));
  }
  CHECK(chmod(parent, 0755) == 0);
}

int main(void) {
  TEST_RUN(test_open_of_missing_path_creates_nothing);
  TEST_RUN(test_writable_open_creates_missing_parents);
  TEST_RUN(test_open_under_readonly_parent_says_no_store);
  TEST_RUN(test_readonly_open_of_store_writes_nothing);
  TEST_RUN(test_readonly_open_takes_no_lock);
  TEST_RUN(test_cli_readonly_commands_on_missing_path_say_no_store);
  return tu_finish();
}

/*
 * store.c - the store directory: opening and locking it, cleaning what a crashed
 * writer left, the LATEST commit point, committing a finished file, listing
 * checkpoints (docs/FORMAT.md, "Store layout" and "Commit protocol"). What is
 * inside one checkpoint file is ckpt.c's.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "format.h"
#include "internal.h"
#include "io.h"
#include "s3store.h"
#include "store.h"

void amber_store_opts_init(amber_store_opts *opts) {
  memset(opts, 0, sizeof *opts);
}

const char *amber_store_path(const amber_store *st) {
  return st ? st->path : NULL;
}

void amber__ckpt_path(const amber_store *st, uint64_t step, const char *suffix, char *buf,
                      size_t len) {
  snprintf(buf, len, "%s/ckpt-%020" PRIu64 ".amber%s", st->path, step, suffix ? suffix : "");
}

/* Parses "ckpt-<20 digits>.amber" (optionally followed by `suffix`); 1 if it matches. */
static int parse_ckpt_name(const char *name, const char *suffix, uint64_t *step);

int amber__parse_ckpt_name(const char *name, uint64_t *step) {
  return parse_ckpt_name(name, "", step);
}

static int parse_ckpt_name(const char *name, const char *suffix, uint64_t *step) {
  if (strncmp(name, "ckpt-", 5) != 0) return 0;
  uint64_t v = 0;
  for (int i = 5; i < 25; i++) {
    if (name[i] < '0' || name[i] > '9') return 0;
    if (amber__mul_overflow(v, 10, &v) || amber__add_overflow(v, (uint64_t)(name[i] - '0'), &v))
      return 0;
  }
  if (strncmp(name + 25, ".amber", 6) != 0 || strcmp(name + 31, suffix) != 0) return 0;
  *step = v;
  return 1;
}

int amber__latest_decode(amber__err *e, const char *what, const char *buf, size_t n,
                        uint64_t *step, uint64_t *state) {
  char line[64];
  int ok = n > 0 && n < sizeof line && !memchr(buf, 0, n); /* a NUL inside: malformed */
  if (ok) {
    memcpy(line, buf, n);
    line[n] = 0;
  }
  char *end = line;
  errno = 0;
  unsigned long long s = ok ? strtoull(line, &end, 10) : 0;
  ok = ok && line[0] >= '0' && line[0] <= '9' && errno == 0 && *end == ' ' && s != UINT64_MAX;
  unsigned long long id = 0;
  if (ok) {
    char *hex = end + 1, *e2;
    ok = strlen(hex) == 17 && hex[16] == '\n';
    if (ok) {
      for (int i = 0; i < 16; i++)
        ok = ok && ((hex[i] >= '0' && hex[i] <= '9') || (hex[i] >= 'a' && hex[i] <= 'f'));
      id = strtoull(hex, &e2, 16);
    }
  }
  if (!ok)
    return amber__fail(e, AMBER_ECORRUPT,
                       "%s is malformed (expected '<step> <16 hex digits>')", what);
  *step = s;
  *state = id;
  return 0;
}

size_t amber__latest_encode(uint64_t step, uint64_t state, char buf[AMBER__LATEST_MAX]) {
  return (size_t)snprintf(buf, AMBER__LATEST_MAX, "%" PRIu64 " %016" PRIx64 "\n", step, state);
}

int amber__read_latest(amber_store *st, amber__err *e, uint64_t *step, uint64_t *state) {
  if (st->s3) return amber__s3store_read_latest(st, e, step, state);
  char path[4200], buf[128];
  snprintf(path, sizeof path, "%s/LATEST", st->path);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return AMBER_ENOENT;
    return amber__fail(e, amber__errno_code(errno), "cannot open %s: %s", path,
                       strerror(errno));
  }
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n < 0)
    return amber__fail(e, AMBER_EIO, "cannot read %s: %s", path, strerror(errno));
  return amber__latest_decode(e, path, buf, (size_t)n, step, state);
}

int amber__write_latest(amber_store *st, amber__err *e, uint64_t step, uint64_t state) {
  char tmp[4200], dst[4200], line[AMBER__LATEST_MAX];
  snprintf(dst, sizeof dst, "%s/LATEST", st->path);
  size_t n = amber__latest_encode(step, state, line);
  int fd, rc = amber__create_tmp(e, dst, tmp, sizeof tmp, &fd);
  if (rc) return rc;
  if (amber__write_full(fd, line, n) != 0 || fsync(fd) != 0) {
    int err = errno;
    close(fd);
    unlink(tmp);
    return amber__fail(e, amber__errno_code(err), "cannot write %s: %s", tmp,
                       strerror(err));
  }
  close(fd);
  if (rename(tmp, dst) != 0) {
    int err = errno;
    unlink(tmp);
    return amber__fail(e, amber__errno_code(err), "cannot rename %s: %s", tmp,
                       strerror(err));
  }
  if (amber__fsync_dir(st->path) != 0)
    return amber__fail(e, amber__errno_code(errno), "cannot fsync %s: %s", st->path,
                       strerror(errno));
  return 0;
}

int amber__commit_file(amber_store *st, amber__err *e, const char *tmp, uint64_t step) {
  char dst[4200];
  amber__ckpt_path(st, step, NULL, dst, sizeof dst);
  if (rename(tmp, dst) != 0) {
    int err = errno;
    unlink(tmp);
    return amber__fail(e, amber__errno_code(err), "cannot rename %s to %s: %s", tmp,
                       dst, strerror(err));
  }
  if (amber__fsync_dir(st->path) != 0)
    return amber__fail(e, amber__errno_code(errno), "cannot fsync %s: %s", st->path,
                       strerror(errno));
  return 0;
}

size_t amber__count_ckpt_files(const char *dir, uint64_t *only) {
  DIR *d = opendir(dir);
  if (!d) return 0;
  struct dirent *e;
  uint64_t step;
  size_t n = 0;
  while ((e = readdir(d)))
    if (parse_ckpt_name(e->d_name, "", &step)) {
      n++;
      if (only) *only = step;
    }
  closedir(d);
  return n;
}

int amber__store_state(amber_store *st, amber__err *e, uint64_t *step, uint64_t *state) {
  int rc = amber__read_latest(st, e, step, state);
  if (rc != AMBER_ENOENT) return rc;
  /* No LATEST: one checkpoint file is what a crash in the very first commit
   * leaves (never committed: the store is empty); more cannot come from a crash. */
  size_t n = 0;
  if (st->s3) {
    if ((rc = amber__s3store_count(st, e, &n)) != 0) return rc;
  } else {
    n = amber__count_ckpt_files(st->path, NULL);
  }
  if (n >= 2)
    return amber__fail(e, AMBER_ECORRUPT,
                       "%s/LATEST is missing but the store holds %zu checkpoint files "
                       "(restore LATEST, or move the files away)",
                       st->path, n);
  return amber__fail(e, AMBER_ENOENT, "store %s has no committed checkpoint", st->path);
}

int amber__ckpt_has_state(amber_store *st, uint64_t step, uint64_t state) {
  char path[4200];
  amber__ckpt_path(st, step, NULL, path, sizeof path);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  struct stat sb;
  uint8_t f[AMBER__FOOTER_SIZE];
  amber__footer ftr;
  int ok = fstat(fd, &sb) == 0 && sb.st_size > AMBER__FOOTER_SIZE &&
           amber__pread_full(fd, f, sizeof f, (uint64_t)sb.st_size - AMBER__FOOTER_SIZE) == 0 &&
           amber__footer_decode(NULL, path, f, (uint64_t)sb.st_size, &ftr) == 0 &&
           ftr.state_id == state;
  close(fd);
  return ok;
}

/* Removes what crashed writers leave: *.tmp files, checkpoint files newer than
 * LATEST, and the lone file of a first commit that never reached LATEST. Only
 * when LATEST is confirmed by its own file: a damaged LATEST must never make a
 * committed checkpoint look uncommitted. Called with the lock held. */
int amber__store_clean(amber_store *st) {
  uint64_t latest = 0, state = 0, lone = 0;
  int rc = amber__read_latest(st, &st->err, &latest, &state);
  int trust = rc == 0 && amber__ckpt_has_state(st, latest, state);
  int first_commit = rc == AMBER_ENOENT && amber__count_ckpt_files(st->path, &lone) == 1;
  DIR *d = opendir(st->path);
  if (!d)
    return amber__fail(&st->err, amber__errno_code(errno), "cannot list %s: %s", st->path,
                       strerror(errno));
  struct dirent *e;
  int removed = 0;
  while ((e = readdir(d))) {
    size_t n = strlen(e->d_name);
    uint64_t step;
    int stale = n > 4 && !strcmp(e->d_name + n - 4, ".tmp");
    if (!stale && parse_ckpt_name(e->d_name, "", &step))
      stale = (trust && step > latest) || (first_commit && step == lone);
    if (stale && unlinkat(st->dirfd, e->d_name, 0) == 0) removed++;
  }
  closedir(d);
  if (removed) amber__fsync_dir(st->path);
  return 0;
}

int amber_store_open(amber_store **out, const char *path, const amber_store_opts *opts) {
  return amber__store_open(out, path, opts, 1);
}

int amber__store_writable(const amber_store *st) {
  return st->lockfd >= 0 || (st->s3 && !(st->flags & AMBER_OPEN_READONLY));
}

/* amber__store_open of an s3:// store: no directory, lock or clean-up (see s3store.c). */
static int open_s3(amber_store **out, const char *path, const amber_store_opts *opts) {
  amber_store *st = calloc(1, sizeof *st);
  if (!st || !(st->path = strdup(path))) {
    free(st);
    return amber__fail(NULL, AMBER_ENOMEM, "out of memory");
  }
  size_t len = strlen(st->path);
  while (len > 5 && st->path[len - 1] == '/') st->path[--len] = 0;
  st->dirfd = st->lockfd = -1;
  st->flags = opts->flags;
  st->threads = opts->threads;
  int rc = amber__s3store_open(st);
  if (rc) {
    amber_store_close(st);
    return rc;
  }
  *out = st;
  return 0;
}

int amber__store_open(amber_store **out, const char *path, const amber_store_opts *opts,
                      int clean) {
  amber_store_opts def;
  if (!opts) {
    amber_store_opts_init(&def);
    opts = &def;
  }
  if (!out || !path || !*path)
    return amber__fail(NULL, AMBER_EINVAL, "amber_store_open: no store path given");
  *out = NULL;
  for (int i = 0; i < 6; i++)
    if (opts->reserved[i])
      return amber__fail(NULL, AMBER_EINVAL, "amber_store_open: reserved option set");
  if (amber__is_s3(path)) return open_s3(out, path, opts);
  int ro = (opts->flags & AMBER_OPEN_READONLY) != 0;
  /* Only an open that may create tries mkdir: a read-only or NOCREATE open must not
   * touch the file system, not even with a mkdir it undoes (which also changes the
   * parent and fails under a read-only parent with a misleading error). */
  int create = !ro && !(opts->flags & AMBER_OPEN_NOCREATE);
  if (create && amber__mkdir_p(path) != 0)
    return amber__fail(NULL, amber__errno_code(errno), "cannot create store %s: %s", path,
                       strerror(errno));
  amber_store *st = calloc(1, sizeof *st);
  if (!st || !(st->path = strdup(path))) {
    free(st);
    return amber__fail(NULL, AMBER_ENOMEM, "out of memory");
  }
  size_t len = strlen(st->path);
  while (len > 1 && st->path[len - 1] == '/') st->path[--len] = 0;
  st->lockfd = -1;
  st->flags = opts->flags;
  st->threads = opts->threads;
  st->dirfd = open(st->path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (st->dirfd < 0) {
    int err = errno;
    amber_store_close(st);
    if (err == ENOENT || err == ENOTDIR)
      return amber__fail(NULL, AMBER_ENOENT, "no store at %s: %s", path,
                         err == ENOENT ? "no such directory" : "not a directory");
    return amber__fail(NULL, amber__errno_code(err), "cannot open store %s: %s", path,
                       strerror(err));
  }
  /* A multi-rank store's directory holds GLOBAL and rank-RRRRR/ (each of those a
   * store of its own): opened as one store it would look empty, and a writer would
   * mix a single-rank checkpoint into it. */
  struct stat gs;
  if (fstatat(st->dirfd, "GLOBAL", &gs, 0) == 0 ||
      (fstatat(st->dirfd, "rank-00000", &gs, 0) == 0 && S_ISDIR(gs.st_mode))) {
    amber_store_close(st);
    return amber__fail(NULL, AMBER_EINVAL,
                       "%s is a multi-rank store (it holds GLOBAL and rank-RRRRR/): read it "
                       "with amber_global_reader_open, write it with amber_global_writer_open",
                       path);
  }
  if (!ro) {
    st->lockfd = openat(st->dirfd, ".lock", O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (st->lockfd < 0) {
      int err = errno;
      amber_store_close(st);
      return amber__fail(NULL, amber__errno_code(err), "cannot create %s/.lock: %s", path,
                         strerror(err));
    }
    if (flock(st->lockfd, LOCK_EX | LOCK_NB) != 0) {
      int err = errno;
      amber_store_close(st);
      if (err == EWOULDBLOCK)
        return amber__fail(NULL, AMBER_ELOCKED,
                           "store %s is open for writing by another process or handle", path);
      return amber__fail(NULL, AMBER_EIO, "cannot lock %s: %s", path, strerror(err));
    }
    int rc = clean ? amber__store_clean(st) : 0;
    if (rc) {
      amber_store_close(st);
      return rc;
    }
  }
  *out = st;
  return 0;
}

void amber_store_close(amber_store *st) {
  if (!st) return;
  if (st->lockfd >= 0) close(st->lockfd); /* releases the flock */
  if (st->dirfd >= 0) close(st->dirfd);
  amber__s3_close(st->s3);
  free(st->path);
  free(st);
}

int amber_store_latest(amber_store *st, uint64_t *step) {
  uint64_t state;
  return amber__store_state(st, &st->err, step, &state);
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

int amber__store_steps(amber_store *st, amber__err *e, uint64_t latest, uint64_t **out,
                       size_t *count) {
  if (st->s3) return amber__s3store_steps(st, e, latest, out, NULL, count);
  DIR *d = opendir(st->path);
  if (!d)
    return amber__fail(e, amber__errno_code(errno), "cannot list %s: %s", st->path,
                       strerror(errno));
  size_t n = 0, cap = 64;
  uint64_t *steps = malloc(cap * sizeof *steps);
  struct dirent *de;
  while (steps && (de = readdir(d))) {
    uint64_t step;
    if (!parse_ckpt_name(de->d_name, "", &step) || step > latest) continue;
    if (n == cap) {
      uint64_t *grown = realloc(steps, 2 * cap * sizeof *steps);
      if (!grown) {
        free(steps);
        steps = NULL;
        break;
      }
      steps = grown;
      cap *= 2;
    }
    steps[n++] = step;
  }
  closedir(d);
  if (!steps) return amber__fail(e, AMBER_ENOMEM, "out of memory");
  qsort(steps, n, sizeof *steps, cmp_u64);
  *out = steps;
  *count = n;
  return 0;
}

/* Reads header and footer of one checkpoint file, for listing. */
static int peek_ckpt(amber_store *st, uint64_t step, amber_ckpt_info *info) {
  char path[4200];
  amber__ckpt_path(st, step, NULL, path, sizeof path);
  memset(info, 0, sizeof *info);
  info->step = step;
  info->parent = AMBER_NO_STEP;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    info->flags |= AMBER_CKPT_DAMAGED;
    return AMBER_EIO;
  }
  struct stat sb;
  uint8_t h[AMBER__HEADER_SIZE], f[AMBER__FOOTER_SIZE];
  amber__header hdr;
  amber__footer ftr;
  int rc = AMBER_ECORRUPT;
  if (fstat(fd, &sb) == 0) {
    info->bytes = (uint64_t)sb.st_size;
    if (sb.st_size >= AMBER__HEADER_SIZE + AMBER__FOOTER_SIZE &&
        amber__pread_full(fd, h, sizeof h, 0) == 0 &&
        amber__pread_full(fd, f, sizeof f, (uint64_t)sb.st_size - AMBER__FOOTER_SIZE) == 0 &&
        (rc = amber__header_decode(NULL, path, h, &hdr)) == 0) {
      info->kind = hdr.kind;
      info->parent = hdr.kind == AMBER_KIND_DELTA ? hdr.parent_step : AMBER_NO_STEP;
      if ((rc = amber__footer_decode(NULL, path, f, (uint64_t)sb.st_size, &ftr)) == 0)
        info->hash = ftr.state_id;
    }
  }
  close(fd);
  if (rc) info->flags |= AMBER_CKPT_DAMAGED;
  return rc;
}

int amber__store_list(amber_store *st, amber__err *e, amber_ckpt_info **out, size_t *count) {
  *out = NULL;
  *count = 0;
  uint64_t latest, state, *steps = NULL;
  size_t n = 0;
  int rc = amber__store_state(st, e, &latest, &state);
  if (rc == AMBER_ENOENT) return 0;
  if (rc) return rc;
  uint64_t *sizes = NULL;
  if (st->s3)
    rc = amber__s3store_steps(st, e, latest, &steps, &sizes, &n);
  else
    rc = amber__store_steps(st, e, latest, &steps, &n);
  if (rc) return rc;
  amber_ckpt_info *info = calloc(n ? n : 1, sizeof *info);
  if (!info) {
    free(steps), free(sizes);
    return amber__fail(e, AMBER_ENOMEM, "out of memory");
  }
  if (st->s3)
    amber__s3store_peek(st, steps, sizes, n, info);
  else
    for (size_t i = 0; i < n; i++) peek_ckpt(st, steps[i], &info[i]);
  free(steps), free(sizes);
  *out = info;
  *count = n;
  return 0;
}

int amber_store_list(amber_store *st, amber_ckpt_info **out, size_t *count) {
  if (!st || !out || !count)
    return amber__fail(NULL, AMBER_EINVAL, "amber_store_list: NULL argument");
  return amber__store_list(st, &st->err, out, count);
}

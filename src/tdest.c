/*
 * tdest.c - the directory destination of a drain (src/tier.h): the durable tier as
 * a directory on a file system. A file is put as a store commits one (FORMAT.md,
 * "Commit protocol"): a new temporary file, written, fsynced, renamed over its name,
 * the directory fsynced; so a name is there whole or not at all, and a crash leaves
 * at most a temporary file, which the next drain removes. Claiming a store takes its
 * .lock as a writer does, so a drain and a writer (or two drains) never write one
 * store at once.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <stdatomic.h>
#include <unistd.h>

#include "io.h"
#include "tier.h"

#define BLOCK (4u << 20) /* a file's bytes go through a buffer of this size */

typedef struct dirdest {
  amber__dest base;
  char *root;
  int *locks; /* the .lock descriptors of the claimed stores */
  size_t nlocks;
} dirdest;

static atomic_int inject_delay, inject_after = -1, inject_err;

void amber__tier_inject(int delay_us, int after, int err) {
  atomic_store(&inject_delay, delay_us);
  atomic_store(&inject_err, err);
  atomic_store(&inject_after, after);
}

/* The errno a put fails with now (tests), or 0. */
static int injected(void) {
  int delay = atomic_load(&inject_delay);
  if (delay > 0) usleep((useconds_t)delay);
  int after = atomic_load(&inject_after);
  while (after > 0 && !atomic_compare_exchange_weak(&inject_after, &after, after - 1)) {
  }
  return after == 0 ? atomic_load(&inject_err) : 0;
}

static void path_of(const dirdest *dd, const char *name, char *buf, size_t len) {
  snprintf(buf, len, "%s/%s", dd->root, name);
}

/* The directory that holds `path` (its parent), into buf. */
static void parent_of(const char *path, char *buf, size_t len) {
  snprintf(buf, len, "%s", path);
  char *slash = strrchr(buf, '/');
  if (slash && slash != buf) *slash = 0;
}

/* Writes the body to `fd`, a block at a time from a file. */
static int write_body(int fd, const amber__body *b, int *err) {
  if (b->buf) {
    if (amber__write_full(fd, b->buf, (size_t)b->len) != 0) return *err = errno, -1;
    if (b->wrote) b->wrote(b->arg, b->len);
    return 0;
  }
  size_t cap = b->len < BLOCK ? (size_t)b->len + 1 : BLOCK;
  uint8_t *buf = malloc(cap);
  if (!buf) return *err = ENOMEM, -1;
  int rc = 0;
  for (uint64_t off = 0; !rc && off < b->len;) {
    size_t n = b->len - off < cap ? (size_t)(b->len - off) : cap;
    if (amber__pread_full(b->fd, buf, n, off) != 0 || amber__write_full(fd, buf, n) != 0)
      rc = -1, *err = errno;
    else if (b->wrote)
      b->wrote(b->arg, n);
    off += n;
  }
  free(buf);
  return rc;
}

static int dir_put(amber__dest *d, amber__err *e, const char *name,
                   const amber__body *body) {
  dirdest *dd = (dirdest *)d;
  char path[4200], dir[4200], tmp[4300];
  path_of(dd, name, path, sizeof path);
  parent_of(path, dir, sizeof dir);
  if (strchr(name, '/') && mkdir(dir, 0755) != 0 && errno != EEXIST)
    return amber__fail(e, amber__errno_code(errno), "cannot create %s: %s", dir,
                       strerror(errno));
  int err = injected();
  if (err)
    return amber__fail(e, amber__errno_code(err), "cannot write %s: %s", path,
                       strerror(err));
  int fd, rc = amber__create_tmp(e, path, tmp, sizeof tmp, &fd);
  if (rc) return rc;
  if (write_body(fd, body, &err) != 0)
    rc = amber__fail(e, amber__errno_code(err), "cannot write %s: %s", path,
                     strerror(err));
  if (!rc && fsync(fd) != 0)
    rc = amber__fail(e, amber__errno_code(errno), "cannot fsync %s: %s", path,
                     strerror(errno));
  if (close(fd) != 0 && !rc)
    rc = amber__fail(e, amber__errno_code(errno), "cannot write %s: %s", path,
                     strerror(errno));
  if (!rc && rename(tmp, path) != 0)
    rc = amber__fail(e, amber__errno_code(errno), "cannot rename %s to %s: %s", tmp, path,
                     strerror(errno));
  if (rc) {
    unlink(tmp);
    return rc;
  }
  if (amber__fsync_dir(dir) != 0)
    return amber__fail(e, amber__errno_code(errno), "cannot fsync %s: %s", dir,
                       strerror(errno));
  return 0;
}

static int dir_stat(amber__dest *d, amber__err *e, const char *name, uint64_t *size) {
  char path[4200];
  path_of((dirdest *)d, name, path, sizeof path);
  struct stat sb;
  if (stat(path, &sb) != 0)
    return amber__fail(e, amber__errno_code(errno), "%s: %s", path, strerror(errno));
  *size = (uint64_t)sb.st_size;
  return 0;
}

static int dir_read(amber__dest *d, amber__err *e, const char *name, uint64_t off,
                    void *buf, size_t len) {
  char path[4200];
  path_of((dirdest *)d, name, path, sizeof path);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return amber__fail(e, amber__errno_code(errno), "%s: %s", path, strerror(errno));
  int rc = amber__pread_full(fd, buf, len, off);
  int err = errno;
  close(fd);
  if (rc != 0)
    return amber__fail(e, err == EIO ? AMBER_ECORRUPT : amber__errno_code(err),
                       "cannot read %zu bytes at %llu of %s: %s", len,
                       (unsigned long long)off, path, strerror(err));
  return 0;
}

void amber__names_list_free(char **names, size_t n) {
  for (size_t i = 0; names && i < n; i++)
    free(names[i]);
  free(names);
}

static int dir_list(amber__dest *d, amber__err *e, const char *prefix, char ***names,
                    size_t *n) {
  char path[4200];
  path_of((dirdest *)d, prefix, path, sizeof path);
  *names = NULL, *n = 0;
  DIR *dir = opendir(path);
  if (!dir) {
    if (errno == ENOENT) return 0;
    return amber__fail(e, amber__errno_code(errno), "cannot list %s: %s", path,
                       strerror(errno));
  }
  size_t cap = 0;
  struct dirent *de;
  int rc = 0;
  while (!rc && (de = readdir(dir))) {
    if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
    if (*n == cap) {
      char **grown = realloc(*names, (cap = cap ? 2 * cap : 32) * sizeof *grown);
      if (!grown) {
        rc = amber__fail(e, AMBER_ENOMEM, "out of memory");
        break;
      }
      *names = grown;
    }
    if (!((*names)[*n] = strdup(de->d_name)))
      rc = amber__fail(e, AMBER_ENOMEM, "out of memory");
    else
      (*n)++;
  }
  closedir(dir);
  if (rc) {
    amber__names_list_free(*names, *n);
    *names = NULL, *n = 0;
  }
  return rc;
}

static int dir_remove(amber__dest *d, amber__err *e, const char *name) {
  char path[4200];
  path_of((dirdest *)d, name, path, sizeof path);
  if (unlink(path) != 0 && errno != ENOENT)
    return amber__fail(e, amber__errno_code(errno), "cannot remove %s: %s", path,
                       strerror(errno));
  return 0;
}

static int dir_claim(amber__dest *d, amber__err *e, const char *store) {
  dirdest *dd = (dirdest *)d;
  char dir[4200], lock[4300];
  path_of(dd, store, dir, sizeof dir);
  if (*store && mkdir(dir, 0755) != 0 && errno != EEXIST)
    return amber__fail(e, amber__errno_code(errno), "cannot create %s: %s", dir,
                       strerror(errno));
  snprintf(lock, sizeof lock, "%s/.lock", dir);
  int *grown = realloc(dd->locks, (dd->nlocks + 1) * sizeof *grown);
  if (!grown) return amber__fail(e, AMBER_ENOMEM, "out of memory");
  dd->locks = grown;
  int fd = open(lock, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0)
    return amber__fail(e, amber__errno_code(errno), "cannot create %s: %s", lock,
                       strerror(errno));
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    int err = errno;
    close(fd);
    if (err == EWOULDBLOCK)
      return amber__fail(
          e, AMBER_ELOCKED,
          "the durable store %s is in use by another drain or writer (%s is "
          "held)",
          dir, lock);
    return amber__fail(e, AMBER_EIO, "cannot lock %s: %s", lock, strerror(err));
  }
  dd->locks[dd->nlocks++] = fd;
  return 0;
}

static void dir_close(amber__dest *d) {
  dirdest *dd = (dirdest *)d;
  for (size_t i = 0; i < dd->nlocks; i++)
    close(dd->locks[i]); /* releases the flocks */
  free(dd->locks);
  free(dd->root);
  free(dd);
}

static const amber__dest_ops dir_ops = {dir_put,    dir_stat,  dir_read, dir_list,
                                        dir_remove, dir_claim, dir_close};

int amber__dest_dir_open(amber__dest **out, amber__err *e, const char *root, int create) {
  *out = NULL;
  if (create && amber__mkdir_p(root) != 0)
    return amber__fail(e, amber__errno_code(errno), "cannot create %s: %s", root,
                       strerror(errno));
  struct stat sb;
  if (stat(root, &sb) != 0 || !S_ISDIR(sb.st_mode))
    return amber__fail(e, AMBER_ENOENT, "no directory at %s", root);
  dirdest *dd = calloc(1, sizeof *dd);
  if (!dd || !(dd->root = strdup(root))) {
    free(dd);
    return amber__fail(e, AMBER_ENOMEM, "out of memory");
  }
  size_t len = strlen(dd->root);
  while (len > 1 && dd->root[len - 1] == '/')
    dd->root[--len] = 0;
  dd->base.ops = &dir_ops;
  dd->base.where = dd->root;
  *out = &dd->base;
  return 0;
}

void amber__dest_close(amber__dest *d) {
  if (d) d->ops->close(d);
}

/* ---- helpers over any destination ---- */

int amber__dest_put_bytes(amber__dest *d, amber__err *e, const char *name, const void *p,
                          size_t n) {
  amber__body body = {p ? p : "", -1, n, NULL, NULL};
  return d->ops->put(d, e, name, &body);
}

int amber__dest_get(amber__dest *d, amber__err *e, const char *name, size_t max,
                    uint8_t **out, size_t *len) {
  uint64_t size;
  *out = NULL, *len = 0;
  int rc = d->ops->stat(d, e, name, &size);
  if (rc) return rc;
  if (size > max)
    return amber__fail(e, AMBER_ECORRUPT, "%s/%s: %llu bytes, more than the %zu expected",
                       d->where, name, (unsigned long long)size, max);
  uint8_t *b = malloc(size ? (size_t)size : 1);
  if (!b) return amber__fail(e, AMBER_ENOMEM, "out of memory");
  if ((rc = d->ops->read(d, e, name, 0, b, (size_t)size)) != 0) {
    free(b);
    return rc;
  }
  *out = b, *len = (size_t)size;
  return 0;
}

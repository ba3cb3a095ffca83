/*
 * io.c - file I/O: the sequential checkpoint-file writer and small POSIX helpers.
 *
 * A buffered write of a new file runs at about a fifth of the disk's speed on the
 * machines we measure, because every page-cache page is a fresh page fault.
 * amber__wfile therefore stages bytes in a few reused, 4 KiB-aligned buffers and
 * writes them with O_DIRECT (when the file system allows it) from a background
 * thread, so that copying and checksumming the next buffer overlaps the write of
 * the previous one. The last buffer is padded to the alignment and the file is
 * then truncated to its exact length.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <time.h>
#include <unistd.h>

#include <linux/magic.h>

#include "xxh.h"

#include "internal.h"
#include "io.h"

/* Several writes in flight: virtual disks here complete two or more concurrent
 * large writes faster than one at a time. */
#define NBUF 4
#define NIO 2

struct amber__wfile {
  amber__err *err; /* the handle whose message a failure sets */
  char path[4096];
  int fd;
  int direct;
  int allow_direct;
  size_t buf_size;
  uint8_t *buf[NBUF];
  size_t len[NBUF];    /* bytes queued in each buffer */
  uint64_t off[NBUF];  /* file offset of each queued buffer */
  int queued[NBUF];    /* buffer is waiting for, or in, a write */
  int cur;             /* buffer being filled */
  size_t fill;         /* bytes in the current buffer */
  uint64_t pos;        /* logical bytes appended */
  int io_err;          /* sticky errno of the I/O thread */
  int stop;
  int next_io;         /* next queued buffer an I/O thread takes */
  int flushing;        /* an I/O thread is in fdatasync */
  pthread_t thread[NIO];
  int threads_on;
  pthread_mutex_t mu;
  pthread_cond_t cv;
};

/* Fault injection for tests: after `countdown` more writes, writes fail with
 * `inject_err` until reset. Off (0) in normal use. */
static int inject_countdown, inject_err;

void amber__io_inject_failure(int after, int err) {
  __atomic_store_n(&inject_err, err, __ATOMIC_SEQ_CST);
  __atomic_store_n(&inject_countdown, err ? after + 1 : 0, __ATOMIC_SEQ_CST);
}

static int direct_reads = 1;

void amber__io_direct_reads(int on) {
  __atomic_store_n(&direct_reads, on, __ATOMIC_SEQ_CST);
}

int amber__on_memory_fs(int fd) {
  struct statfs sf;
  return fstatfs(fd, &sf) == 0 && (sf.f_type == TMPFS_MAGIC || sf.f_type == RAMFS_MAGIC);
}

int amber__io_direct_reads_on(void) {
  return __atomic_load_n(&direct_reads, __ATOMIC_SEQ_CST);
}

/* 0, or the injected errno when this write must fail. */
static int injected(void) {
  int c = __atomic_load_n(&inject_countdown, __ATOMIC_SEQ_CST);
  if (c == 0) return 0;
  if (c > 1) {
    __atomic_fetch_sub(&inject_countdown, 1, __ATOMIC_SEQ_CST);
    return 0;
  }
  return __atomic_load_n(&inject_err, __ATOMIC_SEQ_CST);
}

/* Big buffers (the reference state, staging, scan scratch) come from mmap with
 * transparent huge pages requested: on the virtual machines we measure, faulting
 * in fresh 4 KiB pages costs about 20x a memcpy, and huge pages cut that about
 * threefold. They are allocated once and reused. */
#define BIG_MIN (4u << 20)

void *amber__big_alloc(size_t n) {
  if (n < BIG_MIN) {
    void *p = NULL;
    return posix_memalign(&p, AMBER__ALIGN, n ? n : 1) == 0 ? p : NULL;
  }
  void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return NULL;
#ifdef MADV_HUGEPAGE
  madvise(p, n, MADV_HUGEPAGE);
#endif
  return p;
}

void amber__big_prefault(void *p, size_t n) {
  if (!p || !n) return;
#ifdef MADV_POPULATE_WRITE
  if (madvise(p, n, MADV_POPULATE_WRITE) == 0) return;
#endif
  /* an older kernel: one write per page (the memory is not in use yet) */
  long pg = sysconf(_SC_PAGESIZE);
  size_t step = pg > 0 ? (size_t)pg : 4096;
  for (size_t o = 0; o < n; o += step) ((volatile uint8_t *)p)[o] = 0;
}

void amber__big_free(void *p, size_t n) {
  if (!p) return;
  if (n < BIG_MIN) free(p);
  else munmap(p, n);
}

int amber__pwrite_full(int fd, const void *buf, size_t len, uint64_t off) {
  const uint8_t *p = buf;
  while (len) {
    ssize_t n = pwrite(fd, p, len, (off_t)off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return -1;
    p += n, len -= (size_t)n, off += (uint64_t)n;
  }
  return 0;
}

int amber__write_full(int fd, const void *buf, size_t len) {
  int inj = injected();
  if (inj) {
    errno = inj;
    return -1;
  }
  const uint8_t *p = buf;
  while (len) {
    ssize_t n = write(fd, p, len);
    if (n < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

int amber__pread_full(int fd, void *buf, size_t len, uint64_t off) {
  uint8_t *p = buf;
  while (len) {
    ssize_t n = pread(fd, p, len, (off_t)off);
    if (n < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    if (n == 0) {
      errno = EIO; /* the file is shorter than its structures say */
      return -1;
    }
    p += n;
    len -= (size_t)n;
    off += (uint64_t)n;
  }
  return 0;
}

/* 64 bits that another process cannot guess: a temporary name must not be
 * predictable, or a link planted there in a shared directory could be waiting. */
static uint64_t unguessable(void) {
  uint64_t v;
  if (getrandom(&v, sizeof v, GRND_NONBLOCK) == (ssize_t)sizeof v) return v;
  /* no entropy yet (early boot): O_EXCL still makes the creation safe */
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  static uint64_t counter;
  uint64_t c = __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED);
  return amber__xxh3(&ts, sizeof ts) ^ ((uint64_t)getpid() << 32) ^ (c * 0x9E3779B97F4A7C15ull);
}

int amber__create_tmp(amber__err *e, const char *prefix, char *path, size_t len, int *fd) {
  *fd = -1;
  for (int tries = 0; tries < 100; tries++) {
    int n = snprintf(path, len, "%s.%016llx.tmp", prefix, (unsigned long long)unguessable());
    if (n < 0 || (size_t)n >= len)
      return amber__fail(e, AMBER_EINVAL, "path %s is too long", prefix);
    *fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (*fd >= 0) return 0;
    if (errno != EEXIST) break;
  }
  return amber__fail(e, amber__errno_code(errno), "cannot create %s: %s", path,
                     strerror(errno));
}

int amber__mkdir_p(const char *path) {
  char buf[4096];
  if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) {
    errno = ENAMETOOLONG;
    return -1;
  }
  for (char *p = buf + 1; *p; p++)
    if (*p == '/' && p[-1] != '/') {
      *p = 0;
      if (mkdir(buf, 0755) < 0 && errno != EEXIST) return -1;
      *p = '/';
    }
  return mkdir(buf, 0755) < 0 && errno != EEXIST ? -1 : 0;
}

int amber__fsync_dir(const char *dir) {
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return -1;
  int rc = fsync(fd);
  int saved = errno;
  close(fd);
  errno = saved;
  return rc;
}

static int pwrite_full(int fd, const uint8_t *p, size_t len, uint64_t off) {
  int inj = injected();
  if (inj) return inj;
  while (len) {
    ssize_t n = pwrite(fd, p, len, (off_t)off);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return EIO;
    p += n;
    len -= (size_t)n;
    off += (uint64_t)n;
  }
  return 0;
}

static void *io_main(void *arg) {
  amber__wfile *f = arg;
  pthread_mutex_lock(&f->mu);
  for (;;) {
    /* queued[b] == 1: waiting; 2: being written. Buffers are taken in order. */
    while (f->queued[f->next_io] != 1 && !f->stop) pthread_cond_wait(&f->cv, &f->mu);
    if (f->queued[f->next_io] != 1) break; /* stop, and nothing left to write */
    int b = f->next_io;
    f->queued[b] = 2;
    f->next_io = (b + 1) % NBUF;
    int skip = f->io_err != 0; /* after a failure, only drain */
    pthread_mutex_unlock(&f->mu);
    int e = skip ? 0 : pwrite_full(f->fd, f->buf[b], f->len[b], f->off[b]);
    pthread_mutex_lock(&f->mu);
    if (e && !f->io_err) f->io_err = e;
    f->queued[b] = 0;
    pthread_cond_broadcast(&f->cv);
    /* Nothing else to write yet (a delta trickles out while the scan runs): make
     * what is written durable now, so that the final fsync, which on the virtual
     * disks we measure costs as much as the writes it flushes, has only the last
     * buffer left. A full save keeps the queue busy and is not slowed by this. */
    if (f->direct && !f->io_err && !f->stop && !f->flushing && f->queued[f->next_io] != 1) {
      f->flushing = 1;
      pthread_mutex_unlock(&f->mu);
      int fe = fdatasync(f->fd) != 0 ? errno : 0;
      pthread_mutex_lock(&f->mu);
      f->flushing = 0;
      if (fe && !f->io_err) f->io_err = fe;
    }
  }
  pthread_mutex_unlock(&f->mu);
  return NULL;
}

int amber__wfile_create(amber__wfile **out, size_t buf_size, int allow_direct) {
  amber__wfile *f = calloc(1, sizeof *f);
  if (!f) return AMBER_ENOMEM;
  f->fd = -1;
  /* `buf_size` is the whole ring: NBUF buffers share it */
  f->buf_size = (buf_size / NBUF + AMBER__ALIGN - 1) / AMBER__ALIGN * AMBER__ALIGN;
  f->allow_direct = allow_direct;
  for (int i = 0; i < NBUF; i++) {
    if (!(f->buf[i] = amber__big_alloc(f->buf_size))) {
      amber__wfile_destroy(f);
      return AMBER_ENOMEM;
    }
  }
  pthread_mutex_init(&f->mu, NULL);
  pthread_cond_init(&f->cv, NULL);
  *out = f;
  return 0;
}

void amber__wfile_destroy(amber__wfile *f) {
  if (!f) return;
  if (f->fd >= 0) amber__wfile_abort(f);
  for (int i = 0; i < NBUF; i++) amber__big_free(f->buf[i], f->buf_size);
  pthread_mutex_destroy(&f->mu);
  pthread_cond_destroy(&f->cv);
  free(f);
}

uint64_t amber__wfile_pos(const amber__wfile *f) {
  return f->pos;
}

const char *amber__wfile_path(const amber__wfile *f) {
  return f->path;
}

int amber__wfile_begin(amber__wfile *f, amber__err *e, const char *prefix) {
  f->err = e;
  f->direct = 0;
  int rc = amber__create_tmp(e, prefix, f->path, sizeof f->path, &f->fd);
  if (rc) return rc;
  /* O_DIRECT on the created file: where the file system refuses it, fcntl fails
   * and the file stays buffered (an open with O_DIRECT could fail after creating
   * the file) */
  if (f->allow_direct) {
    int fl = fcntl(f->fd, F_GETFL);
    if (fl >= 0 && fcntl(f->fd, F_SETFL, fl | O_DIRECT) == 0) f->direct = 1;
  }
  f->cur = 0;
  f->fill = 0;
  f->pos = 0;
  f->io_err = 0;
  f->stop = 0;
  f->next_io = 0;
  f->flushing = 0;
  memset(f->queued, 0, sizeof f->queued);
  f->threads_on = 0;
  for (int i = 0; i < NIO; i++) {
    if (pthread_create(&f->thread[i], NULL, io_main, f) != 0) {
      amber__wfile_abort(f);
      return amber__fail(e, AMBER_ENOMEM, "cannot start the I/O threads for %s", f->path);
    }
    f->threads_on++;
  }
  return 0;
}

static int io_failure(amber__wfile *f, int err) {
  return amber__fail(f->err, amber__errno_code(err), "cannot write %s: %s", f->path,
                     strerror(err));
}

/* Hands the current buffer to the I/O thread and waits until the next is free. */
static int submit(amber__wfile *f) {
  pthread_mutex_lock(&f->mu);
  f->len[f->cur] = f->fill;
  f->off[f->cur] = f->pos - f->fill;
  f->queued[f->cur] = 1;
  pthread_cond_broadcast(&f->cv);
  f->cur = (f->cur + 1) % NBUF;
  f->fill = 0;
  while (f->queued[f->cur] && !f->io_err) pthread_cond_wait(&f->cv, &f->mu);
  int err = f->io_err;
  pthread_mutex_unlock(&f->mu);
  return err ? io_failure(f, err) : 0;
}

static int append(amber__wfile *f, const void *data, size_t len, XXH3_state_t *hs) {
  const uint8_t *p = data;
  while (len) {
    size_t room = f->buf_size - f->fill;
    size_t n = len < room ? len : room;
    /* Copy in slices that stay in cache, so the hash re-reads cached bytes. */
    size_t slice = hs ? (256u << 10) : n;
    for (size_t o = 0; o < n; o += slice) {
      size_t k = n - o < slice ? n - o : slice;
      memcpy(f->buf[f->cur] + f->fill + o, p + o, k);
      if (hs) XXH3_64bits_update(hs, f->buf[f->cur] + f->fill + o, k);
    }
    f->fill += n;
    f->pos += n;
    p += n;
    len -= n;
    if (f->fill == f->buf_size) {
      int rc = submit(f);
      if (rc) return rc;
    }
  }
  return 0;
}

int amber__wfile_append(amber__wfile *f, const void *data, size_t len) {
  return append(f, data, len, NULL);
}

int amber__wfile_append_hashed(amber__wfile *f, const void *data, size_t len,
                               uint64_t *hash) {
  XXH3_state_t st;
  XXH3_INITSTATE(&st);
  XXH3_64bits_reset(&st);
  int rc = append(f, data, len, &st);
  *hash = XXH3_64bits_digest(&st);
  return rc;
}

static int stop_thread(amber__wfile *f) {
  if (!f->threads_on) return f->io_err;
  pthread_mutex_lock(&f->mu);
  f->stop = 1;
  pthread_cond_broadcast(&f->cv);
  pthread_mutex_unlock(&f->mu);
  for (int i = 0; i < f->threads_on; i++) pthread_join(f->thread[i], NULL);
  f->threads_on = 0;
  return f->io_err;
}

int amber__wfile_finish(amber__wfile *f) {
  int rc = 0;
  if (f->fill) {
    size_t pad = f->direct ? (AMBER__ALIGN - f->fill % AMBER__ALIGN) % AMBER__ALIGN : 0;
    memset(f->buf[f->cur] + f->fill, 0, pad);
    f->fill += pad;
    f->pos += pad; /* undone by the truncate below */
    rc = submit(f);
    f->pos -= pad;
  }
  int err = stop_thread(f);
  if (!rc && err) rc = io_failure(f, err);
  if (!rc && f->direct && ftruncate(f->fd, (off_t)f->pos) != 0) rc = io_failure(f, errno);
  if (!rc && fsync(f->fd) != 0) rc = io_failure(f, errno);
  if (close(f->fd) != 0 && !rc) rc = io_failure(f, errno);
  f->fd = -1;
  if (rc) unlink(f->path);
  return rc;
}

void amber__wfile_abort(amber__wfile *f) {
  stop_thread(f);
  if (f->fd >= 0) {
    close(f->fd);
    f->fd = -1;
    unlink(f->path);
  }
}

/*
 * io.h - internal: file helpers of src/io.c: the staged O_DIRECT writer
 * (amber__wfile), big reused buffers, full reads and writes, temporary files.
 */
#ifndef AMBER_IO_H
#define AMBER_IO_H

#include <stddef.h>
#include <stdint.h>

#include "internal.h"

#define AMBER__ALIGN 4096u
#define AMBER__DIRECT_MIN (1u << 20) /* smallest payload read with O_DIRECT */

/* Sequential writer of one file through reused aligned staging buffers, with
 * O_DIRECT where the file system allows it and a background thread doing the
 * writes. The buffers live as long as the struct (init/destroy), files come and
 * go (begin/finish/abort). */
typedef struct amber__wfile amber__wfile;

/* buf_size: the staging ring's total bytes. */
int amber__wfile_create(amber__wfile **out, size_t buf_size, int allow_direct);
void amber__wfile_destroy(amber__wfile *f);
/* Creates "<prefix>.<random>.tmp" exclusively (amber__create_tmp) and starts
 * writing it; amber__wfile_path gives its name until the next begin. */
int amber__wfile_begin(amber__wfile *f, amber__err *e, const char *prefix);
const char *amber__wfile_path(const amber__wfile *f);
/* Appends bytes; copies them into the staging buffers. */
int amber__wfile_append(amber__wfile *f, const void *data, size_t len);
/* Appends `len` bytes and returns their xxh3 (computed over the staged copy while
 * it is in cache, so the source is read once). */
int amber__wfile_append_hashed(amber__wfile *f, const void *data, size_t len,
                               uint64_t *hash);
uint64_t amber__wfile_pos(const amber__wfile *f);
/* Flushes, sets the exact length, fsyncs and closes. */
int amber__wfile_finish(amber__wfile *f);
/* Closes and unlinks the file being written, after a failure. */
void amber__wfile_abort(amber__wfile *f);

/* Tests only: after `after` more successful writes, every write fails with errno
 * `err` until called again with err 0. */
void amber__io_inject_failure(int after, int err);
/* Tests only: 0 makes the checkpoint files opened from now on read without O_DIRECT
 * (what a file system that refuses it gets); 1 (the default) allows it again. */
void amber__io_direct_reads(int on);
int amber__io_direct_reads_on(void);
/* 1 when open file `fd` lives on a memory file system (tmpfs, ramfs: /dev/shm). */
int amber__on_memory_fs(int fd);

/* Large reused buffers: 4 KiB-aligned, huge pages requested when large. */
void *amber__big_alloc(size_t n);
void amber__big_free(void *p, size_t n);
/* Faults in the pages of a fresh big buffer now (before it is needed in a
 * latency-sensitive path); its contents become zero. */
void amber__big_prefault(void *p, size_t n);

/* Reads exactly `len` bytes at `off` (retrying short reads and EINTR). */
int amber__pread_full(int fd, void *buf, size_t len, uint64_t off);
int amber__write_full(int fd, const void *buf, size_t len);
/* pwrite of all `len` bytes at `off` (retried on EINTR and short writes): 0 or -1. */
int amber__pwrite_full(int fd, const void *buf, size_t len, uint64_t off);
/* Creates a new temporary file "<prefix>.<16 random hex digits>.tmp" for
 * writing: never an existing file or link (O_EXCL, O_NOFOLLOW), a name other
 * processes cannot predict, mode 0644 less the umask. The name goes to `path`
 * (`len` bytes), the descriptor to *fd. The store's clean-up removes what a
 * crash leaves of it (its name ends in .tmp). */
int amber__create_tmp(amber__err *e, const char *prefix, char *path, size_t len, int *fd);
/* mkdir -p: creates `path` and the parents it lacks (mode 0755 less the umask); 0 when
 * it is there afterwards (made or not), else -1 with errno set (mkdir's). */
int amber__mkdir_p(const char *path);
/* fsync of a directory by path. */
int amber__fsync_dir(const char *dir);

#endif /* AMBER_IO_H */

/*
 * s3store.c - stores in an object store, "s3://bucket/prefix" (see s3store.h): the
 * store directory's operations done with objects (open, LATEST, the listing, a
 * checkpoint's header and footer, removal, compact's upload), the multi-rank
 * store's small objects (GLOBAL, manifests) by path, and the two things only an
 * object store needs: the sweep of what interrupted uploads left (amber_store_sweep)
 * and the local directory through which a writer writes one (amber_tier_staging).
 *
 * An object store has no lock, no rename and no directory. Every object amber
 * writes is uploaded whole (a single PUT, or a multipart upload that becomes
 * visible only when it completes) and confirmed by reading back its size and
 * checksum before a pointer names it; readers trust only what a pointer names. So a
 * crash leaves at most objects that no pointer reaches, and multipart uploads that
 * never completed: the sweep removes them once they are older than a grace period,
 * since another process's upload in flight looks the same.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <fcntl.h>

#include "format.h"
#include "global.h"
#include "io.h"
#include "s3store.h"

int amber__is_s3(const char *path) {
  return path && strncmp(path, "s3://", 5) == 0;
}

void amber__s3store_ckpt_key(uint64_t step, char *buf, size_t len) {
  snprintf(buf, len, "ckpt-%020" PRIu64 ".amber", step);
}

/* ---- a store of one process over S3 ---- */

int amber__s3store_open(amber_store *st) {
  int rc = amber__s3_open(&st->s3, st->path, NULL);
  if (rc) return rc;
  int ro = (st->flags & AMBER_OPEN_READONLY) != 0;
  if (ro || (st->flags & AMBER_OPEN_NOCREATE)) { /* nothing there is "no store" */
    int any = amber__s3_exists(st->s3, "");
    if (any < 0) return any;
    if (!any)
      return amber__fail(NULL, AMBER_ENOENT,
                         "no store at %s: no object under that prefix", st->path);
  }
  amber__s3_stat gs;
  rc = amber__s3_head(st->s3, "GLOBAL", &gs);
  int multi = rc == 0;
  if (rc == AMBER_ENOENT) rc = 0;
  if (!rc && !multi) {
    int r0 = amber__s3_exists(st->s3, "rank-00000/");
    if (r0 < 0) rc = r0;
    multi = r0 == 1;
  }
  if (rc) return rc;
  if (multi)
    return amber__fail(
        NULL, AMBER_EINVAL,
        "%s is a multi-rank store (it holds GLOBAL and rank-RRRRR/): read it "
        "with amber_global_reader_open",
        st->path);
  return 0;
}

int amber__s3store_read_latest(amber_store *st, amber__err *e, uint64_t *step,
                               uint64_t *state) {
  void *b;
  size_t n;
  int rc = amber__s3_get(st->s3, "LATEST", 127, &b, &n);
  if (rc == AMBER_ENOENT) return rc;
  char what[4200];
  snprintf(what, sizeof what, "%s/LATEST", st->path);
  if (rc == AMBER_ERANGE)
    return amber__fail(e, AMBER_ECORRUPT,
                       "%s is malformed (expected '<step> <16 hex digits>')", what);
  if (rc) return amber__fail(e, rc, "%s", amber_last_error(NULL));
  rc = amber__latest_decode(e, what, b, n, step, state);
  free(b);
  return rc;
}

typedef struct steps_acc {
  uint64_t upto, *steps, *sizes;
  size_t n, cap;
  int oom;
} steps_acc;

static int add_ckpt(void *arg, const char *name, uint64_t size, time_t mtime) {
  (void)mtime;
  steps_acc *a = arg;
  uint64_t step;
  if (!amber__parse_ckpt_name(name, &step) || step > a->upto) return 0;
  if (a->n == a->cap) {
    size_t cap = a->cap ? 2 * a->cap : 64;
    uint64_t *s = realloc(a->steps, cap * sizeof *s), *z;
    if (s) a->steps = s;
    z = s ? realloc(a->sizes, cap * sizeof *z) : NULL;
    if (!z) return a->oom = 1, AMBER_ENOMEM;
    a->sizes = z, a->cap = cap;
  }
  a->steps[a->n] = step, a->sizes[a->n++] = size;
  return 0;
}

int amber__s3store_steps(amber_store *st, amber__err *e, uint64_t upto, uint64_t **steps,
                         uint64_t **sizes, size_t *n) {
  steps_acc a = {upto, NULL, NULL, 0, 0, 0};
  *steps = NULL, *n = 0;
  if (sizes) *sizes = NULL;
  int rc = amber__s3_list_dir(st->s3, "", add_ckpt, &a);
  if (rc || a.oom) {
    free(a.steps), free(a.sizes);
    if (a.oom) return amber__fail(e, AMBER_ENOMEM, "out of memory");
    return amber__fail(e, rc, "%s", amber_last_error(NULL));
  }
  /* keys come back in order, and the 20-digit names sort as their steps */
  *steps = a.steps, *n = a.n;
  if (sizes)
    *sizes = a.sizes;
  else
    free(a.sizes);
  return 0;
}

int amber__s3store_count(amber_store *st, amber__err *e, size_t *n) {
  uint64_t *steps;
  int rc = amber__s3store_steps(st, e, UINT64_MAX, &steps, NULL, n);
  free(steps);
  return rc;
}

/* Header and footer of each checkpoint, two ranged GETs each, all at once (a few
 * hundred at most per batch, to bound memory). */
void amber__s3store_peek(amber_store *st, const uint64_t *steps, const uint64_t *sizes,
                         size_t n, amber_ckpt_info *info) {
  enum { BATCH = 256 };
  const size_t H = AMBER__HEADER_SIZE, F = AMBER__FOOTER_SIZE;
  char (*keys)[40] = malloc(BATCH * sizeof *keys);
  const char **kp = malloc(2 * BATCH * sizeof *kp);
  amber__s3_range *rg = malloc(2 * BATCH * sizeof *rg);
  uint8_t *buf = malloc(BATCH * (H + F));
  for (size_t i = 0; i < n; i++) {
    memset(&info[i], 0, sizeof info[i]);
    info[i].step = steps[i], info[i].bytes = sizes[i], info[i].parent = AMBER_NO_STEP;
    info[i].flags = AMBER_CKPT_DAMAGED; /* until its header and footer decode */
  }
  for (size_t b0 = 0; keys && kp && rg && buf && b0 < n; b0 += BATCH) {
    size_t m = 0, idx[BATCH];
    for (size_t i = b0; i < n && i < b0 + BATCH; i++) {
      if (sizes[i] < H + F) continue;
      size_t k = i - b0;
      amber__s3store_ckpt_key(steps[i], keys[k], sizeof keys[k]);
      kp[2 * m] = kp[2 * m + 1] = keys[k];
      rg[2 * m] = (amber__s3_range){0, H, buf + k * (H + F)};
      rg[2 * m + 1] = (amber__s3_range){sizes[i] - F, F, buf + k * (H + F) + H};
      idx[m++] = i;
    }
    if (!m || amber__s3_get_rangesm(st->s3, kp, rg, 2 * m) != 0) continue;
    for (size_t j = 0; j < m; j++) {
      size_t i = idx[j];
      const uint8_t *hb = buf + (i - b0) * (H + F);
      amber__header hdr;
      amber__footer ftr;
      char path[4200];
      snprintf(path, sizeof path, "%s/%s", st->path, keys[i - b0]);
      if (amber__header_decode(NULL, path, hb, &hdr) != 0) continue;
      info[i].kind = hdr.kind;
      info[i].parent = hdr.kind == AMBER_KIND_DELTA ? hdr.parent_step : AMBER_NO_STEP;
      if (amber__footer_decode(NULL, path, hb + H, sizes[i], &ftr) != 0) continue;
      info[i].hash = ftr.state_id;
      info[i].flags = 0;
    }
  }
  free(keys), free(kp), free(rg), free(buf);
}

int amber__s3store_remove(amber_store *st, amber__err *e, uint64_t step) {
  char key[40];
  amber__s3store_ckpt_key(step, key, sizeof key);
  int rc = amber__s3_delete(st->s3, key);
  return rc ? amber__fail(e, rc, "%s", amber_last_error(NULL)) : 0;
}

int amber__s3store_commit_file(amber_store *st, amber__err *e, const char *tmp,
                               uint64_t step) {
  char key[40];
  amber__s3store_ckpt_key(step, key, sizeof key);
  int fd = open(tmp, O_RDONLY | O_CLOEXEC), rc = 0;
  struct stat sb;
  if (fd < 0 || fstat(fd, &sb) != 0)
    rc = amber__fail(e, amber__errno_code(errno), "cannot read %s: %s", tmp,
                     strerror(errno));
  amber__s3_stat want;
  if (!rc) {
    amber__s3_body body = {NULL, fd, (uint64_t)sb.st_size};
    rc = amber__s3_upload(st->s3, key, &body, &want);
    if (!rc) rc = amber__s3_confirm(st->s3, key, &want);
    if (rc) amber__err_adopt(e);
  }
  if (fd >= 0) close(fd);
  unlink(tmp);
  return rc;
}

/* ---- objects by path ---- */

/* The client of the "directory" of `path` and the key of its last part. */
static int open_parent(const char *path, amber__s3 **s, const char **key) {
  const char *slash = strrchr(path + 5, '/');
  if (!slash || !slash[1])
    return amber__fail(NULL, AMBER_EINVAL, "%s: not an object of a store", path);
  char dir[4200];
  snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path);
  *key = slash + 1;
  return amber__s3_open(s, dir, NULL);
}

int amber__s3_read_small(const char *path, amber__err *e, uint8_t **out, size_t *len,
                         size_t max) {
  amber__s3 *s;
  const char *key;
  *out = NULL, *len = 0;
  int rc = open_parent(path, &s, &key);
  void *b = NULL;
  if (!rc) rc = amber__s3_get(s, key, max, &b, len);
  amber__s3_close(s);
  if (rc == AMBER_ERANGE)
    return amber__fail(e, AMBER_ECORRUPT, "%s: unexpected size", path);
  if (rc) return amber__fail(e, rc, "%s", amber_last_error(NULL));
  *out = b;
  return 0;
}

int amber__s3_write_small(const char *path, amber__err *e, const void *data, size_t len) {
  amber__s3 *s;
  const char *key;
  int rc = open_parent(path, &s, &key);
  amber__s3_stat want;
  if (!rc) rc = amber__s3_put(s, key, data, len, &want);
  if (!rc) rc = amber__s3_confirm(s, key, &want);
  amber__s3_close(s);
  return rc ? amber__fail(e, rc, "%s", amber_last_error(NULL)) : 0;
}

int amber__s3_remove_path(const char *path, amber__err *e) {
  amber__s3 *s;
  const char *key;
  int rc = open_parent(path, &s, &key);
  if (!rc) rc = amber__s3_delete(s, key);
  amber__s3_close(s);
  return rc ? amber__fail(e, rc, "%s", amber_last_error(NULL)) : 0;
}

int amber__s3_has_dir(const char *path) {
  amber__s3 *s;
  const char *key;
  int rc = open_parent(path, &s, &key);
  char sub[300];
  snprintf(sub, sizeof sub, "%s/", key ? key : "");
  if (!rc) rc = amber__s3_exists(s, sub);
  amber__s3_close(s);
  return rc;
}

int amber__s3_is_global(const char *path) {
  amber__s3 *s;
  if (amber__s3_open(&s, path, NULL)) return 0;
  amber__s3_stat st;
  int rc = amber__s3_head(s, "GLOBAL", &st); /* refused: no second request */
  int yes = rc == 0 || (rc == AMBER_ENOENT && amber__s3_exists(s, "rank-00000/") == 1);
  amber__s3_close(s);
  return yes;
}

typedef struct counts {
  uint64_t upto, *steps;
  size_t n, cap;
  int oom;
  /* amber__s3_global_counts: checkpoint objects per rank, by the listing's order */
  uint32_t rank, best_rank;
  size_t files, best;
} counts;

static int add_manifest(void *arg, const char *name, uint64_t size, time_t mtime) {
  (void)size, (void)mtime;
  counts *c = arg;
  uint64_t step;
  uint32_t r;
  const char *slash = strchr(name, '/');
  if (slash) { /* rank-RRRRR/ckpt-...: counted per rank */
    char dir[16];
    uint64_t s;
    if ((size_t)(slash - name) >= sizeof dir) return 0;
    snprintf(dir, sizeof dir, "%.*s", (int)(slash - name), name);
    if (!amber__parse_rank_name(dir, &r) || strchr(slash + 1, '/') ||
        !amber__parse_ckpt_name(slash + 1, &s))
      return 0;
    if (r != c->rank) c->rank = r, c->files = 0;
    if (++c->files > c->best) c->best = c->files, c->best_rank = r;
    return 0;
  }
  if (!amber__parse_manifest_name(name, &step) || step > c->upto) return 0;
  if (c->n == c->cap) {
    uint64_t *s = realloc(c->steps, (c->cap = c->cap ? 2 * c->cap : 16) * sizeof *s);
    if (!s) return c->oom = 1, AMBER_ENOMEM;
    c->steps = s;
  }
  c->steps[c->n++] = step;
  return 0;
}

int amber__s3_manifest_steps(const char *path, uint64_t upto, uint64_t **steps,
                             size_t *n) {
  amber__s3 *s;
  counts c = {.upto = upto, .rank = UINT32_MAX};
  *steps = NULL, *n = 0;
  int rc = amber__s3_open(&s, path, NULL);
  if (!rc) rc = amber__s3_list_dir(s, "", add_manifest, &c);
  amber__s3_close(s);
  if (rc || c.oom) {
    free(c.steps);
    return c.oom ? amber__fail(NULL, AMBER_ENOMEM, "out of memory") : rc;
  }
  *steps = c.steps, *n = c.n;
  return 0;
}

int amber__s3_global_counts(const char *path, amber__err *e, size_t *manifests,
                            size_t *files, uint32_t *rank) {
  amber__s3 *s;
  counts c = {.upto = UINT64_MAX, .rank = UINT32_MAX};
  int rc = amber__s3_open(&s, path, NULL);
  if (!rc) rc = amber__s3_list(s, "", add_manifest, &c);
  amber__s3_close(s);
  free(c.steps);
  if (c.oom) return amber__fail(e, AMBER_ENOMEM, "out of memory");
  if (rc) return amber__fail(e, rc, "%s", amber_last_error(NULL));
  *manifests = c.n, *files = c.best, *rank = c.best_rank;
  return 0;
}

/* ---- the sweep ---- */

typedef struct sweep {
  amber__s3 *s;
  const char *sub; /* "" or "rank-RRRRR/": what is directly under it */
  time_t before;   /* older than this */
  uint64_t above;  /* checkpoint objects after this step (the store's LATEST) */
  int lone;        /* no LATEST: the one checkpoint object is a first commit's leftover */
  size_t removed;
  int rc;
} sweep;

static int direct(const sweep *w, const char *name) {
  size_t n = strlen(w->sub);
  return !strncmp(name, w->sub, n) && !strchr(name + n, '/');
}

static int sweep_upload(void *arg, const char *name, const char *id, time_t initiated) {
  sweep *w = arg;
  if (!direct(w, name) || !initiated || initiated >= w->before) return 0;
  int rc = amber__s3_upload_abort(w->s, name, id);
  if (rc && !w->rc) w->rc = rc;
  if (!rc) w->removed++;
  return 0;
}

static int sweep_object(void *arg, const char *name, uint64_t size, time_t mtime) {
  (void)size;
  sweep *w = arg;
  uint64_t step;
  if (!direct(w, name) || !amber__parse_ckpt_name(name + strlen(w->sub), &step)) return 0;
  if (!(w->lone || step > w->above) || !mtime || mtime >= w->before) return 0;
  int rc = amber__s3_delete(w->s, name);
  if (rc && !w->rc) w->rc = rc;
  if (!rc) w->removed++;
  return 0;
}

/* Sweeps the store under `sub` of client `s`: leftover multipart uploads, and
 * checkpoint objects after its LATEST (or the lone one of a store without LATEST). */
static int sweep_store(amber__s3 *s, const char *sub, time_t before, size_t *removed) {
  char key[300];
  snprintf(key, sizeof key, "%sLATEST", sub);
  void *b = NULL;
  size_t n;
  uint64_t step = 0, state;
  int rc = amber__s3_get(s, key, 127, &b, &n), have = rc == 0;
  if (have) rc = amber__latest_decode(NULL, key, b, n, &step, &state);
  free(b);
  if (rc && rc != AMBER_ENOENT) return rc; /* a damaged LATEST: remove nothing */
  sweep w = {s, sub, before, step, !have, 0, 0};
  if (w.lone) { /* only where one object alone is there, as a directory's clean-up */
    size_t count = 0;
    steps_acc a = {UINT64_MAX, NULL, NULL, 0, 0, 0};
    rc = amber__s3_list_dir(s, sub, add_ckpt, &a);
    count = a.n;
    free(a.steps), free(a.sizes);
    if (rc) return rc;
    if (count != 1) w.lone = 0, w.above = UINT64_MAX;
  }
  rc = amber__s3_uploads(s, sub, sweep_upload, &w);
  if (!rc) rc = amber__s3_list_dir(s, sub, sweep_object, &w);
  *removed += w.removed;
  return rc ? rc : w.rc;
}

static int add_rank(void *arg, const char *name, uint64_t size, time_t mtime) {
  (void)size, (void)mtime;
  uint32_t r, *top = arg;
  char dir[16];
  size_t len = strlen(name);
  if (len < 2 || len >= sizeof dir || name[len - 1] != '/') return 0;
  snprintf(dir, sizeof dir, "%.*s", (int)len - 1, name);
  if (amber__parse_rank_name(dir, &r) && (*top == UINT32_MAX || r > *top)) *top = r;
  return 0;
}

static int sweep_manifest(void *arg, const char *name, uint64_t size, time_t mtime) {
  (void)size;
  sweep *w = arg;
  uint64_t step;
  if (!amber__parse_manifest_name(name, &step) || step <= w->above || !mtime ||
      mtime >= w->before)
    return 0;
  int rc = amber__s3_delete(w->s, name);
  if (rc && !w->rc) w->rc = rc;
  if (!rc) w->removed++;
  return 0;
}

int amber_store_sweep(const char *path, uint64_t grace_s, size_t *removed) {
  size_t dummy;
  if (!removed) removed = &dummy;
  *removed = 0;
  if (!path) return amber__fail(NULL, AMBER_EINVAL, "amber_store_sweep: NULL path");
  if (!amber__is_s3(path)) return 0; /* a directory: the writable open cleans */
  amber__s3 *s;
  int rc = amber__s3_open(&s, path, NULL);
  if (rc) return rc;
  time_t before = time(NULL) - (time_t)grace_s;
  amber__s3_stat gst;
  int multi = amber__s3_head(s, "GLOBAL", &gst) == 0;
  if (!multi) multi = amber__s3_exists(s, "rank-00000/") == 1;
  if (!multi) {
    rc = sweep_store(s, "", before, removed);
  } else {
    /* manifests after GLOBAL, then each rank store as a store of its own */
    void *b = NULL;
    size_t n;
    uint64_t g = 0;
    int have = amber__s3_get(s, "GLOBAL", 4096, &b, &n) == 0 &&
               amber__global_decode(NULL, "GLOBAL", b, n, &g) == 0;
    free(b);
    sweep w = {s, "", before, have ? g : 0, 0, 0, 0};
    if (have) rc = amber__s3_list_dir(s, "", sweep_manifest, &w);
    *removed += w.removed;
    if (!rc) rc = w.rc;
    uint32_t top = UINT32_MAX;
    if (!rc) rc = amber__s3_list_dir(s, "", add_rank, &top);
    for (uint32_t r = 0; !rc && top != UINT32_MAX && r <= top; r++) {
      char sub[32];
      snprintf(sub, sizeof sub, "rank-%05u/", r);
      rc = sweep_store(s, sub, before, removed);
    }
  }
  if (rc) rc = amber__fail(NULL, rc, "sweep of %s: %s", path, amber_last_error(NULL));
  amber__s3_close(s);
  return rc;
}

/* ---- the staging directory of an s3:// store ---- */

int amber_tier_staging(const char *url, char **dir) {
  if (!url || !dir) return amber__fail(NULL, AMBER_EINVAL, "amber_tier_staging: NULL");
  *dir = NULL;
  if (!amber__is_s3(url))
    return amber__fail(NULL, AMBER_EINVAL, "%s is not an s3:// URL", url);
  size_t len = strlen(url);
  while (len > 5 && url[len - 1] == '/')
    len--;
  const char *base = getenv("AMBER_STAGING");
  struct stat sb;
  if (!base || !*base)
    base =
        stat("/dev/shm", &sb) == 0 && S_ISDIR(sb.st_mode) && access("/dev/shm", W_OK) == 0
            ? "/dev/shm"
            : NULL;
  if (!base) base = getenv("TMPDIR");
  if (!base || !*base) base = "/tmp";
  char buf[4200];
  int n = snprintf(buf, sizeof buf, "%s/amber-%u-%016" PRIx64, base, (unsigned)getuid(),
                   amber__xxh3(url, len));
  if (n < 0 || (size_t)n >= sizeof buf)
    return amber__fail(NULL, AMBER_EINVAL, "staging directory name too long under %s",
                       base);
  if (!(*dir = strdup(buf))) return amber__fail(NULL, AMBER_ENOMEM, "out of memory");
  return 0;
}

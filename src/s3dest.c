/*
 * s3dest.c - the S3 destination of a drain (src/tier.h): the durable tier as the
 * objects under s3://bucket/prefix, a file's path under the tier being its key.
 *
 * The commit rule for objects (docs/DESIGN.md, "Object stores (S3)"): a put uploads
 * the file whole (one PUT, or a multipart upload with its parts in parallel, which
 * S3 shows only once it completes) and then reads back the object's size and
 * checksum and compares them with what was sent (amber__s3_confirm); only then does
 * it return, and only then does the drain put the pointer (LATEST; the manifest and
 * GLOBAL of a multi-rank step) that names it, itself confirmed the same way. So a
 * pointer names only objects that are there whole, and an interrupted drain leaves
 * objects no pointer reaches (a later drain puts them again, or `amber prune`
 * sweeps them) and at most an unfinished multipart upload (aborted by the upload
 * itself when it fails, by a later drain's claim, or by the sweep).
 *
 * An object store has no lock: claiming a store aborts the multipart uploads an
 * earlier drain of it left, and two drains of one store at once are the caller's
 * mistake to avoid (documented; nothing here can see it).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "s3.h"
#include "tier.h"

typedef struct s3dest {
  amber__dest base;
  amber__s3 *s3;
} s3dest;

static amber__s3 *client(amber__dest *d) {
  return ((s3dest *)d)->s3;
}

/* The client's last failure as the destination's, named by the object. */
static int failed(amber__err *e, int rc) {
  return amber__fail(e, rc, "%s", amber_last_error(NULL));
}

static int s3_put(amber__dest *d, amber__err *e, const char *name, const amber__body *b) {
  amber__s3_body body = {b->buf, b->fd, b->len};
  amber__s3_stat want;
  int rc = amber__s3_upload(client(d), name, &body, &want);
  if (!rc) rc = amber__s3_confirm(client(d), name, &want);
  if (rc) return failed(e, rc);
  if (b->wrote) b->wrote(b->arg, b->len);
  return 0;
}

static int s3_stat(amber__dest *d, amber__err *e, const char *name, uint64_t *size) {
  amber__s3_stat st;
  int rc = amber__s3_head(client(d), name, &st);
  if (rc) return failed(e, rc);
  *size = st.size;
  return 0;
}

static int s3_read(amber__dest *d, amber__err *e, const char *name, uint64_t off,
                   void *buf, size_t len) {
  if (!len) return 0;
  amber__s3_range r = {off, len, buf};
  int rc = amber__s3_get_ranges(client(d), name, &r, 1);
  if (rc == AMBER_ERANGE) rc = AMBER_ECORRUPT; /* shorter than asked: as a short file */
  return rc ? failed(e, rc) : 0;
}

typedef struct names {
  const char *prefix;
  char **v;
  size_t n, cap;
  int oom;
} names;

static int add_name(void *arg, const char *name, uint64_t size, time_t mtime) {
  (void)size, (void)mtime;
  names *l = arg;
  size_t pl = strlen(l->prefix), len = strlen(name);
  if (strncmp(name, l->prefix, pl) != 0 || len == pl) return 0;
  if (l->n == l->cap) {
    char **g = realloc(l->v, (l->cap = l->cap ? 2 * l->cap : 32) * sizeof *g);
    if (!g) return l->oom = 1, AMBER_ENOMEM;
    l->v = g;
  }
  /* a deeper level ("rank-00003/") is a directory's entry ("rank-00003") */
  size_t keep = len - pl - (name[len - 1] == '/');
  if (!(l->v[l->n] = strndup(name + pl, keep))) return l->oom = 1, AMBER_ENOMEM;
  l->n++;
  return 0;
}

static int s3_list(amber__dest *d, amber__err *e, const char *prefix, char ***out,
                   size_t *n) {
  names l = {prefix, NULL, 0, 0, 0};
  int rc = amber__s3_list_dir(client(d), prefix, add_name, &l);
  if (rc || l.oom) {
    amber__names_list_free(l.v, l.n);
    *out = NULL, *n = 0;
    return l.oom ? amber__fail(e, AMBER_ENOMEM, "out of memory") : failed(e, rc);
  }
  *out = l.v, *n = l.n;
  return 0;
}

static int s3_remove(amber__dest *d, amber__err *e, const char *name) {
  int rc = amber__s3_delete(client(d), name);
  return rc ? failed(e, rc) : 0;
}

typedef struct leftovers {
  amber__s3 *s3;
  const char *sub;
  int rc;
} leftovers;

static int abort_one(void *arg, const char *name, const char *id, time_t initiated) {
  (void)initiated;
  leftovers *l = arg;
  size_t n = strlen(l->sub);
  if (strncmp(name, l->sub, n) || strchr(name + n, '/')) return 0; /* another store's */
  int rc = amber__s3_upload_abort(l->s3, name, id);
  if (rc && !l->rc) l->rc = rc;
  return 0;
}

static int s3_claim(amber__dest *d, amber__err *e, const char *store) {
  char sub[64];
  snprintf(sub, sizeof sub, "%s%s", store, *store ? "/" : "");
  leftovers l = {client(d), sub, 0};
  int rc = amber__s3_uploads(client(d), sub, abort_one, &l);
  if (!rc) rc = l.rc;
  return rc ? failed(e, rc) : 0;
}

static void s3_close(amber__dest *d) {
  s3dest *sd = (s3dest *)d;
  amber__s3_close(sd->s3);
  free(sd->base.where);
  free(sd);
}

static const amber__dest_ops s3_ops = {s3_put,    s3_stat,  s3_read, s3_list,
                                       s3_remove, s3_claim, s3_close};

int amber__dest_s3_open(amber__dest **out, amber__err *e, const char *url) {
  *out = NULL;
  s3dest *sd = calloc(1, sizeof *sd);
  if (!sd) return amber__fail(e, AMBER_ENOMEM, "out of memory");
  int rc = amber__s3_open(&sd->s3, url, NULL);
  if (rc) {
    free(sd);
    return failed(e, rc);
  }
  if (!(sd->base.where = strdup(amber__s3_url(sd->s3)))) {
    amber__s3_close(sd->s3);
    free(sd);
    return amber__fail(e, AMBER_ENOMEM, "out of memory");
  }
  sd->base.ops = &s3_ops;
  *out = &sd->base;
  return 0;
}

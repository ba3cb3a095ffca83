/*
 * s3.c - the S3 client's operations (s3.h): a whole object up (one PUT, or a
 * multipart upload with its parts in parallel, aborted on failure), HEAD and the
 * confirm step, whole and ranged GETs, DELETE, and the listings of keys and of
 * unfinished multipart uploads. Each is a batch of requests for the engine of
 * src/s3req.c, which sends, signs, retries and explains them.
 *
 * Every upload carries its CRC32 (x-amz-checksum-crc32), which S3 checks on arrival
 * and reports on HEAD, so that a writer can confirm that what the server holds is
 * what it sent before it commits anything that names the object. A multipart
 * object's checksum is S3's COMPOSITE one, the CRC32 of its parts' CRC32s.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "s3.h"

#ifndef AMBER_HAVE_S3

/* Built without libcurl: only open can be reached, and it says why it fails. */
int amber__s3_open(amber__s3 **out, const char *url, const amber__s3_opts *opts) {
  (void)opts;
  *out = NULL;
  return amber__fail(NULL, AMBER_EFORMAT,
                     "%s: this amber was built without S3 support (AMBER_S3 off, or "
                     "libcurl >= 7.75, expat or zlib not found when it was built)",
                     url);
}
void amber__s3_close(amber__s3 *s) {
  (void)s;
}
const char *amber__s3_url(const amber__s3 *s) {
  (void)s;
  return "";
}
#define UNBUILT return amber__fail(NULL, AMBER_EFORMAT, "built without S3 support")
int amber__s3_upload(amber__s3 *s, const char *k, const amber__s3_body *b,
                     amber__s3_stat *st) {
  (void)s, (void)k, (void)b, (void)st;
  UNBUILT;
}
int amber__s3_put(amber__s3 *s, const char *k, const void *b, size_t n,
                  amber__s3_stat *st) {
  (void)s, (void)k, (void)b, (void)n, (void)st;
  UNBUILT;
}
int amber__s3_head(amber__s3 *s, const char *k, amber__s3_stat *st) {
  (void)s, (void)k, (void)st;
  UNBUILT;
}
int amber__s3_confirm(amber__s3 *s, const char *k, const amber__s3_stat *w) {
  (void)s, (void)k, (void)w;
  UNBUILT;
}
int amber__s3_get(amber__s3 *s, const char *k, size_t m, void **o, size_t *n) {
  (void)s, (void)k, (void)m, (void)o, (void)n;
  UNBUILT;
}
int amber__s3_get_ranges(amber__s3 *s, const char *k, const amber__s3_range *r,
                         size_t n) {
  (void)s, (void)k, (void)r, (void)n;
  UNBUILT;
}
int amber__s3_get_rangesm(amber__s3 *s, const char *const *k, const amber__s3_range *r,
                          size_t n) {
  (void)s, (void)k, (void)r, (void)n;
  UNBUILT;
}
int amber__s3_delete(amber__s3 *s, const char *k) {
  (void)s, (void)k;
  UNBUILT;
}
int amber__s3_list(amber__s3 *s, const char *sub, amber__s3_list_fn fn, void *arg) {
  (void)s, (void)sub, (void)fn, (void)arg;
  UNBUILT;
}
int amber__s3_list_dir(amber__s3 *s, const char *sub, amber__s3_list_fn fn, void *arg) {
  (void)s, (void)sub, (void)fn, (void)arg;
  UNBUILT;
}
int amber__s3_exists(amber__s3 *s, const char *sub) {
  (void)s, (void)sub;
  UNBUILT;
}
int amber__s3_uploads(amber__s3 *s, const char *sub, amber__s3_upload_fn fn, void *arg) {
  (void)s, (void)sub, (void)fn, (void)arg;
  UNBUILT;
}
int amber__s3_upload_abort(amber__s3 *s, const char *k, const char *id) {
  (void)s, (void)k, (void)id;
  UNBUILT;
}
int amber__s3_upload_begin(amber__s3 *s, const char *k, char *id, size_t n) {
  (void)s, (void)k, (void)id, (void)n;
  UNBUILT;
}
void amber__s3_counters_get(const amber__s3 *s, amber__s3_counters *c) {
  (void)s;
  memset(c, 0, sizeof *c);
}
int amber__s3_obj_open(amber__s3_obj **out, amber__s3 *s, const char *k) {
  (void)s, (void)k;
  *out = NULL;
  UNBUILT;
}
uint64_t amber__s3_obj_size(const amber__s3_obj *o) {
  (void)o;
  return 0;
}
int amber__s3_obj_pread(amber__s3_obj *o, void *b, size_t n, uint64_t off) {
  (void)o, (void)b, (void)n, (void)off;
  UNBUILT;
}
int amber__s3_obj_preadv(amber__s3_obj *o, const amber__s3_range *r, size_t n) {
  (void)o, (void)r, (void)n;
  UNBUILT;
}
void amber__s3_obj_close(amber__s3_obj *o) {
  (void)o;
}

#else /* AMBER_HAVE_S3 */

#include "s3req.h"

/* ---- the client ---- */

int amber__s3_open(amber__s3 **out, const char *url, const amber__s3_opts *opts) {
  *out = NULL;
  amber__s3 *s = calloc(1, sizeof *s);
  if (!s) return amber__fail(NULL, AMBER_ENOMEM, "out of memory");
  int rc = amber__s3_conf_load(&s->conf, url);
  if (rc < 0) {
    free(s);
    return rc;
  }
  if (opts) s->opts = *opts;
  amber__s3_opts *o = &s->opts;
  if (!o->parallel) o->parallel = 8;
  if (!o->part_size) o->part_size = 16 * AMBER__S3_MIB;
  if (o->part_size < 5 * AMBER__S3_MIB)
    o->part_size = 5 * AMBER__S3_MIB; /* S3's smallest */
  if (!o->retries) o->retries = 10;
  if (!o->backoff_ms) o->backoff_ms = 200;
  if (!o->stall_s) o->stall_s = 30;
  if (!o->connect_ms) o->connect_ms = 10000;
  snprintf(s->sigv4, sizeof s->sigv4, "aws:amz:%s:s3", s->conf.region);
  size_t n = strlen(s->conf.bucket) + strlen(s->conf.region) +
             (s->conf.endpoint ? strlen(s->conf.endpoint) : 0) + 64;
  s->base = malloc(n);
  s->url = malloc(strlen(s->conf.bucket) + strlen(s->conf.prefix) + 8);
  if (!s->base || !s->url) rc = amber__fail(NULL, AMBER_ENOMEM, "out of memory");
  if (rc == 0) rc = amber__s3_engine_init(s);
  if (rc < 0) {
    amber__s3_close(s);
    return rc;
  }
  const char *ep = s->conf.endpoint;
  if (s->conf.path_style && ep)
    snprintf(s->base, n, "%s/%s", ep, s->conf.bucket);
  else if (s->conf.path_style)
    snprintf(s->base, n, "https://s3.%s.amazonaws.com/%s", s->conf.region,
             s->conf.bucket);
  else if (ep) { /* virtual-hosted on a given endpoint: the bucket before its host */
    const char *host = strstr(ep, "://") + 3;
    snprintf(s->base, n, "%.*s%s.%s", (int)(host - ep), ep, s->conf.bucket, host);
  } else
    snprintf(s->base, n, "https://%s.s3.%s.amazonaws.com", s->conf.bucket,
             s->conf.region);
  sprintf(s->url, "s3://%s/%s", s->conf.bucket, s->conf.prefix);
  if (s->url[strlen(s->url) - 1] == '/') s->url[strlen(s->url) - 1] = 0;
  *out = s;
  return 0;
}

void amber__s3_close(amber__s3 *s) {
  if (!s) return;
  amber__s3_engine_fini(s);
  amber__s3_conf_free(&s->conf);
  free(s->base);
  free(s->url);
  free(s);
}

const char *amber__s3_url(const amber__s3 *s) {
  return s->url;
}

void amber__s3_counters_get(const amber__s3 *s, amber__s3_counters *c) {
  c->requests = __atomic_load_n(&s->counters.requests, __ATOMIC_RELAXED);
  c->retries = __atomic_load_n(&s->counters.retries, __ATOMIC_RELAXED);
  c->bytes_up = __atomic_load_n(&s->counters.bytes_up, __ATOMIC_RELAXED);
  c->bytes_down = __atomic_load_n(&s->counters.bytes_down, __ATOMIC_RELAXED);
}

/* ---- objects: HEAD, GET, DELETE ---- */

int amber__s3_head(amber__s3 *s, const char *key, amber__s3_stat *st) {
  amber__s3_req r;
  int rc = amber__s3_req_init(s, &r, "HEAD", key, 0, NULL, NULL);
  if (rc == 0) rc = amber__s3_req_header(&r, "x-amz-checksum-mode: ENABLED");
  if (rc == 0) rc = amber__s3_run(s, &r, 1);
  if (rc == 0) {
    memset(st, 0, sizeof *st);
    st->size = r.clen;
    snprintf(st->etag, sizeof st->etag, "%s", r.etag);
    snprintf(st->crc32, sizeof st->crc32, "%s", r.crc32);
  } else if (rc == AMBER_ENOENT) {
    amber__fail(NULL, rc, "s3://%s/%s: no such object", s->conf.bucket, r.key);
  }
  amber__s3_req_free(&r);
  return rc;
}

/* Whether two x-amz-checksum-crc32 values agree: a server may give a multipart
 * object's composite checksum without its "-N" part count (moto does), and the
 * checksum itself is what must match. */
static int same_crc32(const char *a, const char *b) {
  size_t la = strcspn(a, "-"), lb = strcspn(b, "-");
  if (la != lb || strncmp(a, b, la) != 0) return 0;
  return !a[la] || !b[lb] || strcmp(a + la, b + lb) == 0;
}

int amber__s3_confirm(amber__s3 *s, const char *key, const amber__s3_stat *want) {
  amber__s3_stat got;
  int rc = amber__s3_head(s, key, &got);
  if (rc < 0) return rc;
  if (got.size != want->size || (want->crc32[0] && !same_crc32(got.crc32, want->crc32)))
    return amber__fail(
        NULL, AMBER_ECORRUPT,
        "%s/%s: the server holds %llu bytes with CRC32 '%s', the upload sent "
        "%llu bytes with CRC32 '%s'",
        s->url, key, (unsigned long long)got.size, got.crc32,
        (unsigned long long)want->size, want->crc32);
  return 0;
}

int amber__s3_get(amber__s3 *s, const char *key, size_t max, void **out, size_t *len) {
  *out = NULL;
  *len = 0;
  amber__s3_req r;
  int rc = amber__s3_req_init(s, &r, "GET", key, 0, NULL, NULL);
  r.body_max = max ? max : 1;
  if (rc == 0) rc = amber__s3_run(s, &r, 1);
  if (rc == 0 && !r.body) r.body = calloc(1, 1); /* an empty object */
  if (rc == 0 && !r.body) rc = amber__fail(NULL, AMBER_ENOMEM, "out of memory");
  if (rc == 0 && max == 0 && r.body_len) /* max 0 allows only an empty object */
    rc = amber__fail(NULL, AMBER_ERANGE, "s3://%s/%s: not empty", s->conf.bucket, r.key);
  if (rc == 0) {
    *out = r.body;
    *len = r.body_len;
    r.body = NULL;
  }
  amber__s3_req_free(&r);
  return rc;
}

/* Ranged GETs of `n` ranges, each longer than a part in several pieces, range i of
 * key keys[i] (keys[0] for all when `one`); with etags, of that version of the object
 * only (a 412 otherwise). */
static int get_ranges(amber__s3 *s, const char *const *keys, const char *const *etags,
                      int one, const amber__s3_range *rg, size_t n) {
  size_t np = 0;
  uint64_t piece = s->opts.part_size;
  for (size_t i = 0; i < n; i++)
    np += (rg[i].len + piece - 1) / piece;
  amber__s3_req *rs = np ? calloc(np, sizeof *rs) : NULL;
  if (np && !rs) return amber__fail(NULL, AMBER_ENOMEM, "out of memory");
  int rc = 0;
  size_t k = 0;
  for (size_t i = 0; i < n && rc == 0; i++) {
    const char *key = keys[one ? 0 : i], *if_match = etags ? etags[one ? 0 : i] : NULL;
    for (uint64_t off = 0; off < rg[i].len && rc == 0; off += piece, k++) {
      uint64_t len = rg[i].len - off < piece ? rg[i].len - off : piece;
      uint64_t a = rg[i].off + off, b = a + len - 1;
      char what[64], hdr[160];
      snprintf(what, sizeof what, "GET bytes %llu-%llu", (unsigned long long)a,
               (unsigned long long)b);
      snprintf(hdr, sizeof hdr, "Range: bytes=%llu-%llu", (unsigned long long)a,
               (unsigned long long)b);
      rc = amber__s3_req_init(s, &rs[k], "GET", key, 0, NULL, what);
      if (rc == 0) rc = amber__s3_req_header(&rs[k], hdr);
      if (rc == 0 && if_match) {
        snprintf(hdr, sizeof hdr, "If-Match: \"%s\"", if_match);
        rc = amber__s3_req_header(&rs[k], hdr);
      }
      rs[k].dst = (uint8_t *)rg[i].buf + off;
      rs[k].dst_len = len;
    }
  }
  if (rc == 0 && np) rc = amber__s3_run(s, rs, np);
  for (size_t i = 0; i < np; i++)
    amber__s3_req_free(&rs[i]);
  free(rs);
  return rc;
}

int amber__s3_get_ranges(amber__s3 *s, const char *key, const amber__s3_range *rg,
                         size_t n) {
  return get_ranges(s, &key, NULL, 1, rg, n);
}

int amber__s3_get_rangesm(amber__s3 *s, const char *const *keys, const amber__s3_range *rg,
                          size_t n) {
  return get_ranges(s, keys, NULL, 0, rg, n);
}

/* ---- an object read by ranges ---- */

struct amber__s3_obj {
  amber__s3 *s;
  char *key;
  amber__s3_stat st;
};

int amber__s3_obj_open(amber__s3_obj **out, amber__s3 *s, const char *key) {
  *out = NULL;
  amber__s3_obj *o = calloc(1, sizeof *o);
  if (!o || !(o->key = strdup(key))) {
    free(o);
    return amber__fail(NULL, AMBER_ENOMEM, "out of memory");
  }
  o->s = s;
  int rc = amber__s3_head(s, key, &o->st);
  if (rc == 0 && !o->st.etag[0])
    rc = amber__fail(NULL, AMBER_EIO, "%s/%s: HEAD gave no ETag", s->url, key);
  if (rc < 0) {
    amber__s3_obj_close(o);
    return rc;
  }
  *out = o;
  return 0;
}

uint64_t amber__s3_obj_size(const amber__s3_obj *o) {
  return o->st.size;
}

/* Range `r` lies inside object `o`: 0, else AMBER_ECORRUPT, asked of no server. */
static int inside(const amber__s3_obj *o, const amber__s3_range *r) {
  if (r->off <= o->st.size && r->len <= o->st.size - r->off) return 0;
  return amber__fail(NULL, AMBER_ECORRUPT,
                     "%s/%s: bytes %llu..%llu asked of an object of %llu bytes", o->s->url,
                     o->key, (unsigned long long)r->off,
                     (unsigned long long)(r->off + r->len), (unsigned long long)o->st.size);
}

/* A read pinned to an ETag that failed with AMBER_ECHANGED, told as such. */
static int changed(const amber__s3_obj *o, int rc) {
  if (rc != AMBER_ECHANGED) return rc;
  return amber__fail(
      NULL, AMBER_ECHANGED,
      "%s/%s: the object was replaced while it was read (its ETag is no longer %s)",
      o->s->url, o->key, o->st.etag);
}

int amber__s3_obj_preadv(amber__s3_obj *o, const amber__s3_range *r, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (inside(o, &r[i])) return AMBER_ECORRUPT;
  const char *key = o->key, *etag = o->st.etag;
  return changed(o, get_ranges(o->s, &key, &etag, 1, r, n));
}

int amber__s3_obj_pread(amber__s3_obj *o, void *buf, size_t len, uint64_t off) {
  amber__s3_range r = {off, len, buf};
  return amber__s3_obj_preadv(o, &r, 1);
}

void amber__s3_obj_close(amber__s3_obj *o) {
  if (!o) return;
  free(o->key);
  free(o);
}

int amber__s3_delete(amber__s3 *s, const char *key) {
  amber__s3_req r;
  int rc = amber__s3_req_init(s, &r, "DELETE", key, 0, NULL, NULL);
  if (rc == 0) rc = amber__s3_run(s, &r, 1);
  amber__s3_req_free(&r);
  return rc == AMBER_ENOENT ? 0 : rc;
}

/* ---- uploads ---- */

static int put_one(amber__s3 *s, const char *key, const amber__s3_body *b,
                   amber__s3_stat *st) {
  amber__s3_req r;
  int rc = amber__s3_req_init(s, &r, "PUT", key, 0, NULL, NULL);
  r.src = b;
  r.src_len = b->len;
  r.crc_header = 1;
  if (rc == 0) rc = amber__s3_req_header(&r, "Content-Type: application/octet-stream");
  if (rc == 0) rc = amber__s3_req_header(&r, "x-amz-sdk-checksum-algorithm: CRC32");
  if (rc == 0) rc = amber__s3_run(s, &r, 1);
  if (rc == 0 && st) {
    memset(st, 0, sizeof *st);
    st->size = b->len;
    amber__s3_crc32_b64(r.crc, st->crc32);
    snprintf(st->etag, sizeof st->etag, "%s", r.etag);
  }
  amber__s3_req_free(&r);
  return rc;
}

typedef struct xml_result {
  char upload_id[1024];
  char etag[80];
} xml_result;

static void result_fields(void *arg, const char *parent, const char *name,
                          const char *text) {
  xml_result *x = arg;
  (void)parent;
  if (strcmp(name, "UploadId") == 0)
    snprintf(x->upload_id, sizeof x->upload_id, "%s", text);
  if (strcmp(name, "ETag") == 0) {
    while (*text == '"')
      text++;
    snprintf(x->etag, sizeof x->etag, "%s", text);
    char *q = strchr(x->etag, '"');
    if (q) *q = 0;
  }
}

/* A query string of (name, value) pairs, already sorted by name as SigV4's canonical
 * form wants; values are encoded here, and NULL ones left out. */
static char *query(const char *const *kv, size_t n) {
  size_t len = 1;
  for (size_t i = 0; i < n; i += 2)
    if (kv[i + 1]) len += strlen(kv[i]) + 3 * strlen(kv[i + 1]) + 2;
  char *q = malloc(len), *p = q;
  if (!q) return NULL;
  *p = 0;
  for (size_t i = 0; i < n; i += 2) {
    if (!kv[i + 1]) continue;
    char *v = amber__s3_uri_encode(kv[i + 1], 0);
    if (!v) {
      free(q);
      return NULL;
    }
    p += sprintf(p, "%s%s=%s", p == q ? "" : "&", kv[i], v);
    free(v);
  }
  return q;
}

int amber__s3_upload_begin(amber__s3 *s, const char *key, char *id, size_t id_len) {
  amber__s3_req r;
  int rc = amber__s3_req_init(s, &r, "POST", key, 0, "uploads=", "CreateMultipartUpload");
  r.post = "";
  r.body_max = AMBER__S3_XML_MAX;
  if (rc == 0) rc = amber__s3_req_header(&r, "Content-Type: application/octet-stream");
  if (rc == 0) rc = amber__s3_req_header(&r, "x-amz-checksum-algorithm: CRC32");
  if (rc == 0) rc = amber__s3_req_header(&r, "x-amz-checksum-type: COMPOSITE");
  if (rc == 0) rc = amber__s3_run(s, &r, 1);
  xml_result x = {"", ""};
  if (rc == 0 && (amber__s3_xml_parse(r.body ? r.body : "", r.body_len, result_fields, &x,
                                      NULL) < 0 ||
                  !x.upload_id[0] || strlen(x.upload_id) >= id_len))
    rc = amber__fail(NULL, AMBER_EIO,
                     "s3://%s/%s: CreateMultipartUpload: no upload id in the answer",
                     s->conf.bucket, r.key);
  if (rc == 0) strcpy(id, x.upload_id);
  amber__s3_req_free(&r);
  return rc;
}

int amber__s3_upload_abort(amber__s3 *s, const char *key, const char *upload_id) {
  const char *kv[] = {"uploadId", upload_id};
  char *q = query(kv, 2);
  if (!q) return amber__fail(NULL, AMBER_ENOMEM, "out of memory");
  amber__s3_req r;
  int rc = amber__s3_req_init(s, &r, "DELETE", key, 0, q, "AbortMultipartUpload");
  if (rc == 0) rc = amber__s3_run(s, &r, 1);
  amber__s3_req_free(&r);
  free(q);
  return rc == AMBER_ENOENT ? 0 : rc;
}

/* CompleteMultipartUpload's body: every part's number, ETag and CRC32. */
static char *complete_xml(const amber__s3_req *parts, size_t n) {
  size_t cap = 128 + n * 256, len = 0;
  char *x = malloc(cap);
  if (!x) return NULL;
  len += (size_t)sprintf(
      x, "<CompleteMultipartUpload xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">");
  for (size_t i = 0; i < n; i++) {
    char b64[12];
    amber__s3_crc32_b64(parts[i].crc, b64);
    len += (size_t)snprintf(x + len, cap - len,
                            "<Part><ChecksumCRC32>%s</ChecksumCRC32><ETag>\"%s\"</ETag>"
                            "<PartNumber>%zu</PartNumber></Part>",
                            b64, parts[i].etag, i + 1);
  }
  snprintf(x + len, cap - len, "</CompleteMultipartUpload>");
  return x;
}

/* S3's COMPOSITE checksum of a multipart object: the CRC32 of its parts' CRC32s
 * (big-endian), then "-N". */
static void composite_crc(const amber__s3_req *parts, size_t n, char out[32]) {
  uLong crc = crc32(0L, Z_NULL, 0);
  for (size_t i = 0; i < n; i++) {
    uint32_t c = parts[i].crc;
    uint8_t be[4] = {(uint8_t)(c >> 24), (uint8_t)(c >> 16), (uint8_t)(c >> 8),
                     (uint8_t)c};
    crc = crc32(crc, be, 4);
  }
  char b64[12];
  amber__s3_crc32_b64((uint32_t)crc, b64);
  snprintf(out, 32, "%s-%zu", b64, n);
}

static int put_multi(amber__s3 *s, const char *key, const amber__s3_body *b,
                     amber__s3_stat *st) {
  uint64_t part = s->opts.part_size, n = (b->len + part - 1) / part;
  if (n > 10000) { /* S3's most parts: larger ones, in whole AMBER__S3_MIB */
    part = ((b->len + 9999) / 10000 + AMBER__S3_MIB - 1) / AMBER__S3_MIB * AMBER__S3_MIB;
    n = (b->len + part - 1) / part;
  }
  char id[1024];
  int rc = amber__s3_upload_begin(s, key, id, sizeof id);
  if (rc < 0) return rc;
  amber__s3_req *parts = calloc((size_t)n, sizeof *parts), done;
  memset(&done, 0, sizeof done);
  char *xml = NULL;
  if (!parts) rc = amber__fail(NULL, AMBER_ENOMEM, "out of memory");
  for (uint64_t i = 0; i < n && rc == 0; i++) {
    char num[24], what[64];
    snprintf(num, sizeof num, "%llu", (unsigned long long)(i + 1));
    snprintf(what, sizeof what, "PUT part %llu of %llu", (unsigned long long)(i + 1),
             (unsigned long long)n);
    const char *kv[] = {"partNumber", num, "uploadId", id};
    char *q = query(kv, 4);
    rc = q ? amber__s3_req_init(s, &parts[i], "PUT", key, 0, q, what)
           : amber__fail(NULL, AMBER_ENOMEM, "out of memory");
    free(q);
    parts[i].src = b;
    parts[i].src_off = i * part;
    parts[i].src_len = b->len - i * part < part ? b->len - i * part : part;
    parts[i].crc_header = 1;
  }
  if (rc == 0) rc = amber__s3_run(s, parts, (size_t)n);
  if (rc == 0 && !(xml = complete_xml(parts, (size_t)n)))
    rc = amber__fail(NULL, AMBER_ENOMEM, "out of memory");
  char want[32];
  if (rc == 0) {
    composite_crc(parts, (size_t)n, want);
    const char *kv[] = {"uploadId", id};
    char *q = query(kv, 2);
    rc = q ? amber__s3_req_init(s, &done, "POST", key, 0, q, "CompleteMultipartUpload")
           : amber__fail(NULL, AMBER_ENOMEM, "out of memory");
    free(q);
    done.post = xml;
    done.body_max = AMBER__S3_XML_MAX;
    done.error_in_200 = 1;
    if (rc == 0) rc = amber__s3_req_header(&done, "Content-Type: application/xml");
    if (rc == 0) rc = amber__s3_run(s, &done, 1);
    /* A completion whose answer was lost, then retried, finds the upload gone: the
     * object is there if the first one went through. */
    if (rc == AMBER_ENOENT && done.attempts > 1) {
      amber__s3_stat got;
      if (amber__s3_head(s, key, &got) == 0 && got.size == b->len &&
          same_crc32(got.crc32, want))
        rc = 0;
      else
        amber__fail(NULL, AMBER_EIO,
                    "s3://%s/%s: CompleteMultipartUpload: the upload was gone "
                    "on a retry and the object is not the one uploaded",
                    s->conf.bucket, done.key);
    }
  }
  if (rc < 0) { /* the parts are freed; the first failure is what the caller hears */
    char msg[AMBER__ERRLEN];
    snprintf(msg, sizeof msg, "%s", amber_last_error(NULL));
    amber__s3_upload_abort(s, key, id);
    amber__fail(NULL, rc, "%s", msg);
  } else if (st) {
    xml_result x = {"", ""};
    amber__s3_xml_parse(done.body ? done.body : "", done.body_len, result_fields, &x,
                        NULL);
    memset(st, 0, sizeof *st);
    st->size = b->len;
    snprintf(st->crc32, sizeof st->crc32, "%s", want);
    snprintf(st->etag, sizeof st->etag, "%s", x.etag);
  }
  for (uint64_t i = 0; parts && i < n; i++)
    amber__s3_req_free(&parts[i]);
  free(parts);
  amber__s3_req_free(&done);
  free(xml);
  return rc;
}

int amber__s3_upload(amber__s3 *s, const char *key, const amber__s3_body *b,
                     amber__s3_stat *st) {
  if (b->len <= s->opts.part_size) return put_one(s, key, b, st);
  return put_multi(s, key, b, st);
}

int amber__s3_put(amber__s3 *s, const char *key, const void *buf, size_t len,
                  amber__s3_stat *st) {
  amber__s3_body b = {buf ? buf : "", -1, len};
  return amber__s3_upload(s, key, &b, st);
}

/* ---- listings ---- */

typedef struct page_entry {
  char *name;
  char *upload_id;
  uint64_t size;
  time_t initiated;
} page_entry;

typedef struct page {
  const char *prefix;
  page_entry *e;
  size_t n, cap;
  page_entry cur;
  int truncated, oom;
  char next[1024], next_id[1024]; /* continuation token, or key and upload id markers */
} page;

static time_t parse_time(const char *t) {
  struct tm tm;
  memset(&tm, 0, sizeof tm);
  if (sscanf(t, "%d-%d-%dT%d:%d:%d", &tm.tm_year, &tm.tm_mon, &tm.tm_mday, &tm.tm_hour,
             &tm.tm_min, &tm.tm_sec) != 6)
    return 0;
  tm.tm_year -= 1900;
  tm.tm_mon -= 1;
  return timegm(&tm);
}

static void page_fields(void *arg, const char *parent, const char *name,
                        const char *text) {
  page *p = arg;
  int item = strcmp(parent, "Contents") == 0 || strcmp(parent, "Upload") == 0;
  if (item && strcmp(name, "Key") == 0 && !p->cur.name) {
    size_t pl = strlen(p->prefix);
    p->cur.name = strdup(strncmp(text, p->prefix, pl) == 0 ? text + pl : text);
    if (!p->cur.name) p->oom = 1;
  } else if (item && strcmp(name, "UploadId") == 0 && !p->cur.upload_id) {
    if (!(p->cur.upload_id = strdup(text))) p->oom = 1;
  } else if (item && strcmp(name, "Size") == 0) {
    p->cur.size = strtoull(text, NULL, 10);
  } else if (item && (strcmp(name, "Initiated") == 0 || strcmp(name, "LastModified") == 0)) {
    p->cur.initiated = parse_time(text);
  } else if (strcmp(parent, "CommonPrefixes") == 0 && strcmp(name, "Prefix") == 0 &&
             !p->cur.name) { /* a "directory" of a listing with a delimiter */
    size_t pl = strlen(p->prefix);
    p->cur.name = strdup(strncmp(text, p->prefix, pl) == 0 ? text + pl : text);
    if (!p->cur.name) p->oom = 1;
  } else if (strcmp(name, "Contents") == 0 || strcmp(name, "Upload") == 0 ||
             strcmp(name, "CommonPrefixes") == 0) {
    if (p->n == p->cap) {
      size_t cap = p->cap ? 2 * p->cap : 64;
      page_entry *e = realloc(p->e, cap * sizeof *e);
      if (!e) {
        p->oom = 1;
        free(p->cur.name);
        free(p->cur.upload_id);
        memset(&p->cur, 0, sizeof p->cur);
        return;
      }
      p->e = e;
      p->cap = cap;
    }
    p->e[p->n++] = p->cur;
    memset(&p->cur, 0, sizeof p->cur);
  } else if (strcmp(name, "IsTruncated") == 0) {
    p->truncated = strcmp(text, "true") == 0;
  } else if (strcmp(name, "NextContinuationToken") == 0 ||
             strcmp(name, "NextKeyMarker") == 0) {
    snprintf(p->next, sizeof p->next, "%s", text);
  } else if (strcmp(name, "NextUploadIdMarker") == 0) {
    snprintf(p->next_id, sizeof p->next_id, "%s", text);
  }
}

static void page_clear(page *p) {
  for (size_t i = 0; i < p->n; i++) {
    free(p->e[i].name);
    free(p->e[i].upload_id);
  }
  free(p->cur.name);
  free(p->cur.upload_id);
  memset(&p->cur, 0, sizeof p->cur);
  p->n = 0;
  p->truncated = 0;
}

/* Every page of a listing (`uploads`: ListMultipartUploads, else ListObjectsV2, with
 * `delim` the keys and common prefixes directly under `sub`), each entry handed to one
 * of the callbacks once its page is read; `most` > 0: one page of at most that many. */
static int list_pages(amber__s3 *s, const char *sub, int uploads, int delim, uint32_t most,
                      amber__s3_list_fn fn, amber__s3_upload_fn ufn, void *arg) {
  char *full = malloc(strlen(s->conf.prefix) + strlen(sub) + 1);
  if (!full) return amber__fail(NULL, AMBER_ENOMEM, "out of memory");
  sprintf(full, "%s%s", s->conf.prefix, sub);
  page p;
  memset(&p, 0, sizeof p);
  p.prefix = s->conf.prefix;
  int rc = 0, more = 1;
  char marker[1024] = "", marker_id[1024] = "";
  while (rc == 0 && more) {
    char *q, cap[16];
    snprintf(cap, sizeof cap, "%u", most ? most : s->opts.list_page);
    const char *page_most = most || s->opts.list_page ? cap : NULL;
    if (uploads) {
      const char *kv[] = {"key-marker",       marker[0] ? marker : NULL,
                          "max-uploads",      page_most,
                          "prefix",           full,
                          "upload-id-marker", marker_id[0] ? marker_id : NULL,
                          "uploads",          ""};
      q = query(kv, 10);
    } else {
      const char *kv[] = {"continuation-token",
                          marker[0] ? marker : NULL,
                          "delimiter",
                          delim ? "/" : NULL,
                          "list-type",
                          "2",
                          "max-keys",
                          page_most,
                          "prefix",
                          full};
      q = query(kv, 10);
    }
    amber__s3_req r;
    rc = q ? amber__s3_req_init(s, &r, "GET", sub, 1, q,
                                uploads ? "ListMultipartUploads" : "ListObjectsV2")
           : amber__fail(NULL, AMBER_ENOMEM, "out of memory");
    free(q);
    r.body_max = AMBER__S3_XML_MAX;
    if (rc == 0) rc = amber__s3_run(s, &r, 1);
    p.next[0] = p.next_id[0] = 0;
    if (rc == 0 &&
        amber__s3_xml_parse(r.body ? r.body : "", r.body_len, page_fields, &p, NULL) < 0)
      rc = amber__fail(NULL, AMBER_EIO, "s3://%s/%s: %s: the answer is not XML",
                       s->conf.bucket, full, r.what);
    if (rc == 0 && p.oom) rc = amber__fail(NULL, AMBER_ENOMEM, "out of memory");
    if (rc == 0 && p.truncated && !p.next[0])
      rc = amber__fail(NULL, AMBER_EIO,
                       "s3://%s/%s: %s: a truncated page without a marker",
                       s->conf.bucket, full, r.what);
    amber__s3_req_free(&r);
    for (size_t i = 0; rc == 0 && i < p.n; i++) {
      if (!p.e[i].name || (uploads && !p.e[i].upload_id)) continue;
      rc = uploads ? ufn(arg, p.e[i].name, p.e[i].upload_id, p.e[i].initiated)
                   : fn(arg, p.e[i].name, p.e[i].size, p.e[i].initiated);
    }
    more = p.truncated && !most;
    snprintf(marker, sizeof marker, "%s", p.next);
    snprintf(marker_id, sizeof marker_id, "%s", p.next_id);
    page_clear(&p);
  }
  free(p.e);
  free(full);
  return rc;
}

int amber__s3_list(amber__s3 *s, const char *sub, amber__s3_list_fn fn, void *arg) {
  return list_pages(s, sub, 0, 0, 0, fn, NULL, arg);
}

int amber__s3_list_dir(amber__s3 *s, const char *sub, amber__s3_list_fn fn, void *arg) {
  return list_pages(s, sub, 0, 1, 0, fn, NULL, arg);
}

static int found(void *arg, const char *name, uint64_t size, time_t mtime) {
  (void)name, (void)size, (void)mtime;
  *(int *)arg = 1;
  return 0;
}

int amber__s3_exists(amber__s3 *s, const char *sub) {
  int any = 0;
  int rc = list_pages(s, sub, 0, 0, 1, found, NULL, &any);
  return rc < 0 ? rc : any;
}

int amber__s3_uploads(amber__s3 *s, const char *sub, amber__s3_upload_fn fn, void *arg) {
  return list_pages(s, sub, 1, 0, 0, NULL, fn, arg);
}

#endif /* AMBER_HAVE_S3 */

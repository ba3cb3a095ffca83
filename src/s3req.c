/*
 * s3req.c - the S3 client's request engine: every operation of src/s3.c is a batch
 * of requests that this file runs. A curl multi handle keeps up to `parallel` of them
 * in flight; each one that fails transiently (5xx, 429/SlowDown, RequestTimeout, a
 * timeout, a cut connection) is tried again after its own backoff (full jitter) while
 * the others go on, and the batch stops at the first failure that no retry can mend,
 * with a message naming the object and S3's error code and message.
 *
 * libcurl sends and signs the requests (CURLOPT_AWS_SIGV4). What curl 7.88 (Debian
 * 12) asks of its caller, found against moto's signature check: the query string must
 * already be canonical (parameters sorted, values percent-encoded), since curl signs
 * it as given; "x-amz-content-sha256: UNSIGNED-PAYLOAD" goes with every request, since
 * curl cannot hash a body that it reads through a callback (the CRC32 checksum header
 * protects an upload instead, and S3 checks it); and "Expect: 100-continue" stays (an
 * empty "Expect:" to drop it would be signed, then not sent).
 *
 * Connections are reused: a call takes a set of them (a multi handle and its easy
 * handles) from the client's pool and gives it back, so that a thread's next call
 * finds them warm; DNS answers and TLS sessions are shared by all sets.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <expat.h>
#include <zlib.h>

#include "io.h"
#include "s3req.h"

#define ERR_BODY_MAX ((size_t)64 << 10) /* of an error answer, the start kept */
#define BACKOFF_CAP_MS 20000.0          /* the AWS SDKs' cap */
enum { READY, ACTIVE, WAITING, DONE };

/* ---- the client and its pool of connection sets ---- */

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static CURLcode curl_init_rc;
static void curl_init(void) {
  curl_init_rc = curl_global_init(CURL_GLOBAL_DEFAULT);
}

static void share_lock(CURL *h, curl_lock_data d, curl_lock_access a, void *arg) {
  (void)h, (void)a;
  pthread_mutex_lock(&((amber__s3 *)arg)->share_lock[d]);
}
static void share_unlock(CURL *h, curl_lock_data d, void *arg) {
  (void)h;
  pthread_mutex_unlock(&((amber__s3 *)arg)->share_lock[d]);
}

static amber__s3_conn *conn_take(amber__s3 *s) {
  pthread_mutex_lock(&s->lock);
  amber__s3_conn *c = s->idle;
  if (c) s->idle = c->next;
  pthread_mutex_unlock(&s->lock);
  if (c) return c;
  c = calloc(1, sizeof *c);
  if (!c) return NULL;
  c->easy = calloc(s->opts.parallel, sizeof *c->easy);
  c->free_easy = calloc(s->opts.parallel, sizeof *c->free_easy);
  c->multi = curl_multi_init();
  if (!c->easy || !c->free_easy || !c->multi) {
    if (c->multi) curl_multi_cleanup(c->multi);
    free(c->easy);
    free(c->free_easy);
    free(c);
    return NULL;
  }
  return c;
}

static void conn_give(amber__s3 *s, amber__s3_conn *c) {
  pthread_mutex_lock(&s->lock);
  c->next = s->idle;
  s->idle = c;
  pthread_mutex_unlock(&s->lock);
}

static void conn_free(amber__s3 *s, amber__s3_conn *c) {
  for (uint32_t i = 0; i < s->opts.parallel; i++)
    if (c->easy[i]) curl_easy_cleanup(c->easy[i]);
  curl_multi_cleanup(c->multi);
  free(c->easy);
  free(c->free_easy);
  free(c);
}

/* An easy handle of the set that no request uses; NULL when none can be made. */
static CURL *easy_take(amber__s3 *s, amber__s3_conn *c) {
  if (c->n_free) return c->free_easy[--c->n_free];
  for (uint32_t i = 0; i < s->opts.parallel; i++)
    if (!c->easy[i]) return c->easy[i] = curl_easy_init();
  return NULL;
}

int amber__s3_engine_init(amber__s3 *s) {
  int rc = amber__s3_load(); /* the libraries, where they are loaded at run time */
  if (rc) return rc;
  pthread_once(&curl_once, curl_init);
  if (curl_init_rc != CURLE_OK)
    return amber__fail(NULL, AMBER_EIO, "curl_global_init failed: %s",
                       curl_easy_strerror(curl_init_rc));
  pthread_mutex_init(&s->lock, NULL);
  for (int i = 0; i < CURL_LOCK_DATA_LAST; i++)
    pthread_mutex_init(&s->share_lock[i], NULL);
  s->locks_made = 1;
  if (!(s->share = curl_share_init()))
    return amber__fail(NULL, AMBER_ENOMEM, "out of memory");
  curl_share_setopt(s->share, CURLSHOPT_LOCKFUNC, share_lock);
  curl_share_setopt(s->share, CURLSHOPT_UNLOCKFUNC, share_unlock);
  curl_share_setopt(s->share, CURLSHOPT_USERDATA, s);
  curl_share_setopt(s->share, CURLSHOPT_SHARE, CURL_LOCK_DATA_DNS);
  curl_share_setopt(s->share, CURLSHOPT_SHARE, CURL_LOCK_DATA_SSL_SESSION);
  return 0;
}

void amber__s3_engine_fini(amber__s3 *s) {
  while (s->idle) {
    amber__s3_conn *c = s->idle;
    s->idle = c->next;
    conn_free(s, c);
  }
  if (s->share) curl_share_cleanup(s->share);
  s->share = NULL;
  if (!s->locks_made) return;
  pthread_mutex_destroy(&s->lock);
  for (int i = 0; i < CURL_LOCK_DATA_LAST; i++)
    pthread_mutex_destroy(&s->share_lock[i]);
  s->locks_made = 0;
}

/* ---- small helpers: encoding, checksums, XML ---- */

/* Percent-encodes as SigV4's canonical form wants it: all but A-Z a-z 0-9 - _ . ~
 * (and '/' in a path). */
char *amber__s3_uri_encode(const char *s, int keep_slash) {
  size_t n = strlen(s);
  char *out = malloc(3 * n + 1), *o = out;
  if (!out) return NULL;
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    if ((*p >= 'A' && *p <= 'Z') || (*p >= 'a' && *p <= 'z') ||
        (*p >= '0' && *p <= '9') || *p == '-' || *p == '_' || *p == '.' || *p == '~' ||
        (keep_slash && *p == '/')) {
      *o++ = (char)*p;
    } else {
      o += sprintf(o, "%%%02X", *p);
    }
  }
  *o = 0;
  return out;
}

static void base64(const uint8_t *in, size_t n, char *out) {
  static const char t[] =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  for (size_t i = 0; i < n; i += 3) {
    uint32_t v = (uint32_t)in[i] << 16;
    if (i + 1 < n) v |= (uint32_t)in[i + 1] << 8;
    if (i + 2 < n) v |= in[i + 2];
    *out++ = t[(v >> 18) & 63];
    *out++ = t[(v >> 12) & 63];
    *out++ = i + 1 < n ? t[(v >> 6) & 63] : '=';
    *out++ = i + 2 < n ? t[v & 63] : '=';
  }
  *out = 0;
}

/* The form of x-amz-checksum-crc32: base64 of the big-endian value. */
void amber__s3_crc32_b64(uint32_t crc, char out[12]) {
  uint8_t be[4] = {(uint8_t)(crc >> 24), (uint8_t)(crc >> 16), (uint8_t)(crc >> 8),
                   (uint8_t)crc};
  base64(be, 4, out);
}

/* CRC32 of `len` bytes of an upload's body from `off`. */
static int body_crc32(const amber__s3_body *b, uint64_t off, uint64_t len,
                      uint32_t *out) {
  uLong crc = crc32(0L, Z_NULL, 0);
  if (b->buf) {
    for (uint64_t done = 0; done < len;) { /* zlib's length is a uInt */
      uInt n = (uInt)(len - done < (1u << 30) ? len - done : (1u << 30));
      crc = crc32(crc, (const Bytef *)b->buf + off + done, n);
      done += n;
    }
  } else {
    size_t bs = 1u << 20;
    uint8_t *buf = malloc(bs);
    if (!buf) return AMBER_ENOMEM;
    for (uint64_t done = 0; done < len;) {
      size_t n = (size_t)(len - done < bs ? len - done : bs);
      if (amber__pread_full(b->fd, buf, n, off + done) < 0) {
        int err = errno;
        free(buf);
        return amber__fail(NULL, amber__errno_code(err), "reading the file to upload: %s",
                           strerror(err));
      }
      crc = crc32(crc, buf, (uInt)n);
      done += n;
    }
    free(buf);
  }
  *out = (uint32_t)crc;
  return 0;
}

/* Each element's text with its name and its parent's, at its end (expat). */
typedef struct xml_walk {
  amber__s3_xml_fn fn;
  void *arg;
  char stack[8][48];
  int depth;
  char text[2048]; /* keys are at most 1024 bytes; longer text is cut */
  size_t tlen;
  char root[48];
} xml_walk;

static void XMLCALL xw_start(void *ud, const XML_Char *name, const XML_Char **atts) {
  xml_walk *w = ud;
  (void)atts;
  if (w->depth == 0) snprintf(w->root, sizeof w->root, "%s", name);
  if (w->depth < 8) snprintf(w->stack[w->depth], sizeof w->stack[0], "%s", name);
  w->depth++;
  w->tlen = 0;
}
static void XMLCALL xw_end(void *ud, const XML_Char *name) {
  xml_walk *w = ud;
  w->text[w->tlen] = 0;
  if (w->fn && w->depth <= 8)
    w->fn(w->arg, w->depth >= 2 ? w->stack[w->depth - 2] : "", name, w->text);
  w->depth--;
  w->tlen = 0;
}
static void XMLCALL xw_text(void *ud, const XML_Char *s, int len) {
  xml_walk *w = ud;
  size_t n = (size_t)len;
  if (n > sizeof w->text - 1 - w->tlen) n = sizeof w->text - 1 - w->tlen;
  memcpy(w->text + w->tlen, s, n);
  w->tlen += n;
}

/* Parses `len` bytes of XML; 0, or -1 when it is not well-formed. `root` gets the
 * root element's name. */
int amber__s3_xml_parse(const char *buf, size_t len, amber__s3_xml_fn fn, void *arg,
                        char root[48]) {
  xml_walk *w = calloc(1, sizeof *w);
  XML_Parser p = XML_ParserCreate(NULL);
  int rc = -1;
  if (w && p && len < (size_t)1 << 30) {
    w->fn = fn;
    w->arg = arg;
    XML_SetUserData(p, w);
    XML_SetElementHandler(p, xw_start, xw_end);
    XML_SetCharacterDataHandler(p, xw_text);
    rc = XML_Parse(p, buf, (int)len, 1) == XML_STATUS_OK ? 0 : -1;
    if (root) snprintf(root, 48, "%s", w->root);
  }
  if (p) XML_ParserFree(p);
  free(w);
  return rc;
}

typedef struct s3_error {
  char code[64];
  char message[256];
} s3_error;

static void error_fields(void *arg, const char *parent, const char *name,
                         const char *text) {
  s3_error *e = arg;
  if (strcmp(parent, "Error") != 0) return;
  if (strcmp(name, "Code") == 0) snprintf(e->code, sizeof e->code, "%s", text);
  if (strcmp(name, "Message") == 0) snprintf(e->message, sizeof e->message, "%s", text);
}

/* ---- one request ---- */

/* A request of `key` (relative to the prefix), or of the bucket itself (`bucket`: a
 * listing of `key`'s names), with the headers that every request carries. */
int amber__s3_req_init(amber__s3 *s, amber__s3_req *r, const char *method,
                       const char *key, int bucket, const char *query, const char *what) {
  memset(r, 0, sizeof *r);
  r->method = method;
  snprintf(r->what, sizeof r->what, "%s", what ? what : method);
  size_t plen = strlen(s->conf.prefix);
  r->key = malloc(plen + strlen(key) + 1);
  char *enc = NULL;
  if (r->key) {
    memcpy(r->key, s->conf.prefix, plen);
    strcpy(r->key + plen, key);
    enc = amber__s3_uri_encode(r->key, 1);
  }
  size_t n = strlen(s->base) + (enc ? strlen(enc) : 0) + (query ? strlen(query) : 0) + 4;
  r->url = enc ? malloc(n) : NULL;
  if (r->url) {
    if (!bucket)
      snprintf(r->url, n, "%s/%s%s%s", s->base, enc, query ? "?" : "",
               query ? query : "");
    else /* the bucket itself: list requests; `key` names what is listed */
      snprintf(r->url, n, "%s%s?%s", s->base, s->conf.path_style ? "" : "/", query);
  }
  free(enc);
  r->hdrs = curl_slist_append(NULL, "x-amz-content-sha256: UNSIGNED-PAYLOAD");
  if (r->hdrs && s->conf.token) {
    char *h = malloc(strlen(s->conf.token) + 32);
    if (h) {
      sprintf(h, "x-amz-security-token: %s", s->conf.token);
      struct curl_slist *l = curl_slist_append(r->hdrs, h);
      free(h);
      if (!l) curl_slist_free_all(r->hdrs);
      r->hdrs = l;
    } else {
      curl_slist_free_all(r->hdrs);
      r->hdrs = NULL;
    }
  }
  if (!r->key || !r->url || !r->hdrs)
    return amber__fail(NULL, AMBER_ENOMEM, "out of memory");
  return 0;
}

int amber__s3_req_header(amber__s3_req *r, const char *h) {
  struct curl_slist *l = curl_slist_append(r->hdrs, h);
  if (!l) return amber__fail(NULL, AMBER_ENOMEM, "out of memory");
  r->hdrs = l;
  return 0;
}

void amber__s3_req_free(amber__s3_req *r) {
  free(r->url);
  free(r->key);
  free(r->body);
  curl_slist_free_all(r->hdrs);
  r->url = r->key = r->body = NULL;
  r->hdrs = NULL;
}

static size_t on_read(char *p, size_t size, size_t nitems, void *arg) {
  amber__s3_req *r = arg;
  uint64_t left = (r->post ? strlen(r->post) : r->src_len) - r->sent;
  size_t n = size * nitems < left ? size * nitems : (size_t)left;
  if (!n) return 0;
  if (r->post) {
    memcpy(p, r->post + r->sent, n);
  } else if (r->src->buf) {
    memcpy(p, (const uint8_t *)r->src->buf + r->src_off + r->sent, n);
  } else if (amber__pread_full(r->src->fd, p, n, r->src_off + r->sent) < 0) {
    r->refused = 1;
    r->refused_rc = amber__errno_code(errno);
    snprintf(r->refused_msg, sizeof r->refused_msg, "reading the file to upload: %s",
             strerror(errno));
    return CURL_READFUNC_ABORT;
  }
  r->sent += n;
  return n;
}

/* curl rewinds the body when it must send it again on the same attempt. */
static int on_seek(void *arg, curl_off_t off, int origin) {
  amber__s3_req *r = arg;
  uint64_t len = r->post ? strlen(r->post) : r->src_len;
  if (origin != SEEK_SET || off < 0 || (uint64_t)off > len) return CURL_SEEKFUNC_FAIL;
  r->sent = (uint64_t)off;
  return CURL_SEEKFUNC_OK;
}

static int header_is(const char *p, size_t len, const char *name, const char **value) {
  size_t n = strlen(name);
  if (len <= n || strncasecmp(p, name, n) != 0 || p[n] != ':') return 0;
  *value = p + n + 1;
  return 1;
}

/* Copies a header's value, trimmed of blanks, line end and (for ETag) quotes. */
static void header_value(const char *v, const char *end, char *out, size_t cap) {
  while (v < end && (*v == ' ' || *v == '\t' || *v == '"'))
    v++;
  while (end > v &&
         (end[-1] == '\r' || end[-1] == '\n' || end[-1] == ' ' || end[-1] == '"'))
    end--;
  size_t n = (size_t)(end - v) < cap - 1 ? (size_t)(end - v) : cap - 1;
  memcpy(out, v, n);
  out[n] = 0;
}

static size_t on_header(char *p, size_t size, size_t nitems, void *arg) {
  amber__s3_req *r = arg;
  size_t len = size * nitems;
  const char *v, *end = p + len;
  if (len > 5 && memcmp(p, "HTTP/", 5) == 0) { /* a new response (after a 100 too) */
    const char *sp = memchr(p, ' ', len);
    r->status = sp ? strtol(sp + 1, NULL, 10) : 0;
    r->etag[0] = r->crc32[0] = r->region[0] = 0;
    r->clen = 0;
  } else if (header_is(p, len, "etag", &v)) {
    header_value(v, end, r->etag, sizeof r->etag);
  } else if (header_is(p, len, "x-amz-checksum-crc32", &v)) {
    header_value(v, end, r->crc32, sizeof r->crc32);
  } else if (header_is(p, len, "x-amz-bucket-region", &v)) {
    header_value(v, end, r->region, sizeof r->region);
  } else if (header_is(p, len, "content-length", &v)) {
    r->clen = strtoull(v, NULL, 10);
    if (r->status >= 200 && r->status < 300 && r->body_max && r->clen > r->body_max &&
        strcmp(r->method, "HEAD") != 0) {
      r->refused = 1;
      r->refused_rc = AMBER_ERANGE;
      snprintf(r->refused_msg, sizeof r->refused_msg,
               "the object is %llu bytes, more than the %zu expected",
               (unsigned long long)r->clen, r->body_max);
      return 0;
    }
  }
  return len;
}

static size_t on_body(char *p, size_t size, size_t nitems, void *arg) {
  amber__s3_req *r = arg;
  size_t len = size * nitems;
  int ok = r->status >= 200 && r->status < 300;
  if (ok && r->dst) {
    if (len > r->dst_len - r->got) {
      r->refused = 1;
      r->refused_rc = AMBER_ECORRUPT;
      snprintf(r->refused_msg, sizeof r->refused_msg,
               "the server sent more than the %llu bytes asked for",
               (unsigned long long)r->dst_len);
      return 0;
    }
    memcpy(r->dst + r->got, p, len);
    r->got += len;
    return len;
  }
  if (ok && !r->body_max) return len;
  size_t max = ok ? r->body_max : ERR_BODY_MAX;
  if (len > max - r->body_len) {
    if (!ok) return len; /* the start of an error answer is enough */
    r->refused = 1;
    r->refused_rc = AMBER_ERANGE;
    snprintf(r->refused_msg, sizeof r->refused_msg, "the answer is longer than %zu bytes",
             max);
    return 0;
  }
  if (r->body_len + len + 1 > r->body_cap) {
    size_t cap = r->body_cap ? r->body_cap : 4096;
    if (ok && r->clen + 1 > cap && r->clen <= max) cap = (size_t)r->clen + 1;
    while (cap < r->body_len + len + 1)
      cap *= 2;
    char *b = realloc(r->body, cap);
    if (!b) {
      r->refused = 1;
      r->refused_rc = AMBER_ENOMEM;
      snprintf(r->refused_msg, sizeof r->refused_msg, "out of memory for the answer");
      return 0;
    }
    r->body = b;
    r->body_cap = cap;
  }
  memcpy(r->body + r->body_len, p, len);
  r->body_len += len;
  r->body[r->body_len] = 0;
  r->got += len;
  return len;
}

/* Sets up an easy handle for one attempt of `r`. */
static int req_start(amber__s3 *s, CURL *h, amber__s3_req *r) {
  if (r->crc_header && r->attempts == 0) {
    int rc = body_crc32(r->src, r->src_off, r->src_len, &r->crc);
    char hdr[64], b64[12];
    amber__s3_crc32_b64(r->crc, b64);
    snprintf(hdr, sizeof hdr, "x-amz-checksum-crc32: %s", b64);
    if (rc < 0 || (rc = amber__s3_req_header(r, hdr)) < 0) return rc;
  }
  if (r->attempts == 0) r->first = amber__now();
  r->sent = r->got = 0;
  r->status = 0;
  r->body_len = 0;
  r->etag[0] = r->crc32[0] = r->region[0] = r->cerr[0] = 0;
  r->clen = 0;
  r->refused = 0;
  curl_easy_reset(h);
  curl_easy_setopt(h, CURLOPT_URL, r->url);
  curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(h, CURLOPT_SHARE, s->share);
  curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(h, CURLOPT_PATH_AS_IS, 1L);
  curl_easy_setopt(h, CURLOPT_TCP_KEEPALIVE, 1L);
  curl_easy_setopt(h, CURLOPT_AWS_SIGV4, s->sigv4);
  curl_easy_setopt(h, CURLOPT_USERNAME, s->conf.key_id);
  curl_easy_setopt(h, CURLOPT_PASSWORD, s->conf.secret);
  curl_easy_setopt(h, CURLOPT_HTTPHEADER, r->hdrs);
  curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, (long)s->opts.connect_ms);
  curl_easy_setopt(h, CURLOPT_LOW_SPEED_LIMIT, 1L);
  curl_easy_setopt(h, CURLOPT_LOW_SPEED_TIME, (long)s->opts.stall_s);
  curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, on_header);
  curl_easy_setopt(h, CURLOPT_HEADERDATA, r);
  curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_body);
  curl_easy_setopt(h, CURLOPT_WRITEDATA, r);
  curl_easy_setopt(h, CURLOPT_ERRORBUFFER, r->cerr);
  curl_easy_setopt(h, CURLOPT_PRIVATE, r);
  if (r->src || r->post) {
    curl_easy_setopt(h, CURLOPT_READFUNCTION, on_read);
    curl_easy_setopt(h, CURLOPT_READDATA, r);
    curl_easy_setopt(h, CURLOPT_SEEKFUNCTION, on_seek);
    curl_easy_setopt(h, CURLOPT_SEEKDATA, r);
  }
  curl_off_t blen = (curl_off_t)(r->post ? strlen(r->post) : r->src_len);
  if (strcmp(r->method, "HEAD") == 0) {
    curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
  } else if (strcmp(r->method, "PUT") == 0) {
    curl_easy_setopt(h, CURLOPT_UPLOAD, 1L);
    curl_easy_setopt(h, CURLOPT_INFILESIZE_LARGE, blen);
  } else if (strcmp(r->method, "POST") == 0) {
    curl_easy_setopt(h, CURLOPT_POST, 1L);
    curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE, blen);
  } else if (strcmp(r->method, "DELETE") == 0) {
    curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, "DELETE");
  }
  r->easy = h;
  r->state = ACTIVE;
  __atomic_fetch_add(&s->counters.requests, 1, __ATOMIC_RELAXED);
  return 0;
}

/* S3 asks to be tried again: server errors, throttling, a slow request, a body that
 * arrived other than it was sent (its checksum did not match). */
static int transient_http(long status, const char *code) {
  return status >= 500 || status == 429 || strcmp(code, "SlowDown") == 0 ||
         strcmp(code, "BadDigest") == 0 || strcmp(code, "RequestTimeout") == 0 ||
         strcmp(code, "InternalError") == 0 || strcmp(code, "ServiceUnavailable") == 0;
}

/* The network failed, not the request. */
static int transient_curl(CURLcode c) {
  switch (c) {
  case CURLE_COULDNT_RESOLVE_HOST:
  case CURLE_COULDNT_CONNECT:
  case CURLE_OPERATION_TIMEDOUT:
  case CURLE_SEND_ERROR:
  case CURLE_RECV_ERROR:
  case CURLE_GOT_NOTHING:
  case CURLE_PARTIAL_FILE:
  case CURLE_SSL_CONNECT_ERROR:
  case CURLE_HTTP2:
  case CURLE_HTTP2_STREAM:
    return 1;
  default:
    return 0;
  }
}

static const char *status_text(long st) {
  switch (st) {
  case 301:
    return "PermanentRedirect";
  case 400:
    return "BadRequest";
  case 403:
    return "Forbidden";
  case 404:
    return "NotFound";
  case 412:
    return "PreconditionFailed";
  case 416:
    return "InvalidRange";
  default:
    return "HTTP error";
  }
}

/* The failure of a request that will not be retried, told as S3 told it. */
static int http_fail(amber__s3 *s, amber__s3_req *r, const s3_error *e) {
  long st = r->status;
  int code = st == 403   ? AMBER_EPERM
             : st == 404 ? AMBER_ENOENT
             : st == 416 ? AMBER_ERANGE
             : st == 412 ? AMBER_ECHANGED /* an If-Match on a replaced object */
             : st == 301 || st == 307 || st == 400 ? AMBER_EINVAL
                                                   : AMBER_EIO;
  char hint[200] = "";
  if (st == 403)
    snprintf(hint, sizeof hint, " (%s)", s->conf.creds_from);
  else if (r->region[0] && strcmp(r->region, s->conf.region) != 0)
    snprintf(hint, sizeof hint, " (the bucket is in region %s, not %s: set AWS_REGION)",
             r->region, s->conf.region);
  return amber__fail(NULL, code, "s3://%s/%s: %s: %ld %s%s%s%s", s->conf.bucket, r->key,
                     r->what, st, e->code[0] ? e->code : status_text(st),
                     e->message[0] ? ": " : "", e->message, hint);
}

/* After an attempt: 0 done, 1 to be retried, or the error of a failed request. */
static int req_verdict(amber__s3 *s, amber__s3_req *r, CURLcode cc) {
  r->attempts++;
  __atomic_fetch_add(&s->counters.bytes_up, r->sent, __ATOMIC_RELAXED);
  __atomic_fetch_add(&s->counters.bytes_down, r->got, __ATOMIC_RELAXED);
  if (r->refused)
    return amber__fail(NULL, r->refused_rc, "s3://%s/%s: %s: %s", s->conf.bucket, r->key,
                       r->what, r->refused_msg);
  s3_error e = {"", ""};
  if (cc != CURLE_OK) {
    if (!transient_curl(cc))
      return amber__fail(NULL, AMBER_EIO, "s3://%s/%s: %s: %s%s%s", s->conf.bucket,
                         r->key, r->what, curl_easy_strerror(cc), r->cerr[0] ? ": " : "",
                         r->cerr);
    snprintf(r->last, sizeof r->last, "%s%s%s", curl_easy_strerror(cc),
             r->cerr[0] ? ": " : "", r->cerr);
  } else {
    int ok = r->status >= 200 && r->status < 300;
    char root[48] = "";
    if ((!ok || r->error_in_200) && r->body_len)
      amber__s3_xml_parse(r->body, r->body_len, error_fields, &e, root);
    if (ok && !(r->error_in_200 && strcmp(root, "Error") == 0)) {
      if (r->dst && r->got != r->dst_len)
        return amber__fail(NULL, AMBER_ECORRUPT,
                           "s3://%s/%s: %s: the object ends after %llu of the %llu bytes",
                           s->conf.bucket, r->key, r->what, (unsigned long long)r->got,
                           (unsigned long long)r->dst_len);
      return 0;
    }
    if (ok) r->status = 500; /* S3's late failure: told as one */
    if (!transient_http(r->status, e.code)) return http_fail(s, r, &e);
    snprintf(r->last, sizeof r->last, "%ld %s%s%s", r->status,
             e.code[0] ? e.code : status_text(r->status), e.message[0] ? ": " : "",
             e.message);
  }
  if (r->attempts > s->opts.retries)
    return amber__fail(
        NULL, AMBER_EIO, "s3://%s/%s: %s: %s (gave up after %u attempts in %.1f s)",
        s->conf.bucket, r->key, r->what, r->last, r->attempts, amber__now() - r->first);
  return 1;
}

/* Full jitter: uniform in [0, min(cap, base * 2^(attempt-1))]. */
static double backoff_s(const amber__s3 *s, uint32_t attempts) {
  static _Thread_local uint64_t x;
  if (!x) x = ((uint64_t)(amber__now() * 1e9) ^ (uint64_t)(uintptr_t)&x) | 1;
  x ^= x >> 12, x ^= x << 25, x ^= x >> 27;
  double u = (double)((x * 0x2545F4914F6CDD1Dull) >> 11) / 9007199254740992.0;
  double ceil_ms = s->opts.backoff_ms;
  for (uint32_t i = 1; i < attempts && ceil_ms < BACKOFF_CAP_MS; i++)
    ceil_ms *= 2;
  if (ceil_ms > BACKOFF_CAP_MS) ceil_ms = BACKOFF_CAP_MS;
  return u * ceil_ms / 1000.0;
}

/* ---- the engine: a batch of requests, `parallel` in flight ---- */

static void release(amber__s3_conn *c, amber__s3_req *r) {
  curl_multi_remove_handle(c->multi, r->easy);
  c->free_easy[c->n_free++] = r->easy;
  r->easy = NULL;
}

int amber__s3_run(amber__s3 *s, amber__s3_req *rs, size_t n) {
  amber__s3_conn *c = conn_take(s);
  if (!c) return amber__fail(NULL, AMBER_ENOMEM, "out of memory for a connection");
  size_t fresh = 0, done = 0, waiting = 0, active = 0;
  int rc = 0;
  while (done < n && rc == 0) {
    double now = amber__now(), next_due = now + 1.0;
    while (active < s->opts.parallel && rc == 0) {
      amber__s3_req *r = NULL;
      for (size_t i = 0; waiting && i < fresh; i++) {
        if (rs[i].state != WAITING) continue;
        if (rs[i].not_before <= now && !r) r = &rs[i];
        if (rs[i].not_before < next_due) next_due = rs[i].not_before;
      }
      if (r)
        waiting--;
      else if (fresh < n)
        r = &rs[fresh++];
      else
        break;
      CURL *h = easy_take(s, c);
      if (!h) {
        rc = amber__fail(NULL, AMBER_ENOMEM, "out of memory for a request");
        break;
      }
      if ((rc = req_start(s, h, r)) < 0) {
        c->free_easy[c->n_free++] = h;
        break;
      }
      curl_multi_add_handle(c->multi, h);
      active++;
    }
    if (rc) break;
    int running = 0;
    if (curl_multi_perform(c->multi, &running) != CURLM_OK) {
      rc = amber__fail(NULL, AMBER_EIO, "s3://%s: curl_multi_perform failed",
                       s->conf.bucket);
      break;
    }
    CURLMsg *m;
    int queued;
    while ((m = curl_multi_info_read(c->multi, &queued))) {
      if (m->msg != CURLMSG_DONE) continue;
      amber__s3_req *r = NULL;
      curl_easy_getinfo(m->easy_handle, CURLINFO_PRIVATE, (char **)&r);
      CURLcode cc = m->data.result;
      release(c, r);
      active--;
      r->state = DONE;
      int v = req_verdict(s, r, cc);
      if (v == 0) {
        done++;
      } else if (v == 1) {
        r->state = WAITING;
        r->not_before = amber__now() + backoff_s(s, r->attempts);
        if (r->not_before < next_due) next_due = r->not_before;
        waiting++;
        __atomic_fetch_add(&s->counters.retries, 1, __ATOMIC_RELAXED);
      } else if (rc == 0) {
        rc = v;
      }
    }
    if (rc || done == n) break;
    double wait = next_due - amber__now();
    int ms = wait <= 0 ? 0 : wait >= 1.0 ? 1000 : (int)(wait * 1000) + 1;
    curl_multi_poll(c->multi, NULL, 0, ms, NULL);
  }
  for (size_t i = 0; i < n; i++)
    if (rs[i].state == ACTIVE) release(c, &rs[i]);
  conn_give(s, c);
  return rc;
}

/*
 * s3req.h - internal to the S3 client: its request engine (src/s3req.c), shared with
 * the operations of src/s3.c. Only built with libcurl (AMBER_HAVE_S3).
 */
#ifndef AMBER_S3REQ_H
#define AMBER_S3REQ_H

#include <curl/curl.h>
#include <expat.h>
#include <pthread.h>
#include <zlib.h>

#include "s3.h"
#include "s3dl.h" /* after the libraries' headers: a run-time build calls them through it */

#define AMBER__S3_MIB (1024ull * 1024)
/* The largest XML answer kept (a page of 1000 keys is about 300 KB). */
#define AMBER__S3_XML_MAX ((size_t)16 << 20)

/* A curl multi handle and its easy handles: the connections of one call at a time. */
typedef struct amber__s3_conn {
  CURLM *multi;
  CURL **easy; /* opts.parallel of them, created on first use */
  uint32_t n_free;
  CURL **free_easy;
  struct amber__s3_conn *next;
} amber__s3_conn;

struct amber__s3 {
  amber__s3_conf conf;
  amber__s3_opts opts;
  char *url;  /* s3://bucket/prefix */
  char *base; /* an object's URL is base + "/" + its encoded key */
  char sigv4[96];
  CURLSH *share; /* DNS cache and TLS sessions, for every connection set */
  pthread_mutex_t share_lock[CURL_LOCK_DATA_LAST];
  pthread_mutex_t lock; /* guards idle */
  int locks_made;
  amber__s3_conn *idle;
  amber__s3_counters counters; /* updated with atomics */
};

/* One request and its attempts, run by amber__s3_run. The operation fills the first
 * part (amber__s3_req_init, then its own fields); the engine the rest. */

typedef struct amber__s3_req {
  /* what the operation asks */
  const char *method;
  char *url;
  char *key; /* the object's key in the bucket (prefix included), for messages */
  char what[64];
  struct curl_slist *hdrs;
  const amber__s3_body *src; /* the body sent (PUT, POST), or NULL */
  uint64_t src_off, src_len;
  const char *post; /* or this small body, for POST */
  int crc_header;   /* compute the body's CRC32 before the first attempt and send it */
  uint32_t crc;
  uint8_t *dst; /* a 2xx body goes here (ranged GET), exactly dst_len bytes */
  uint64_t dst_len;
  size_t body_max;  /* or is kept up to this many bytes (XML, whole GET); 0: dropped */
  int error_in_200; /* a 200 whose XML is <Error> failed late (CompleteMultipartUpload) */
  /* one attempt */
  uint64_t sent, got;
  long status;
  char *body;
  size_t body_len, body_cap;
  char etag[80], crc32[32], region[32];
  uint64_t clen;
  int refused, refused_rc; /* a callback of ours stopped the transfer */
  char refused_msg[200];
  char cerr[CURL_ERROR_SIZE];
  /* across attempts */
  CURL *easy;
  int state;
  uint32_t attempts;
  double first, not_before;
  char last[400]; /* the last transient failure, told when retries run out */
} amber__s3_req;

/* Sets up the parts of the client that the engine owns (curl, the share handle, the
 * pool of connection sets); amber__s3_engine_fini undoes it, also after a failed init. */
int amber__s3_engine_init(amber__s3 *s);
void amber__s3_engine_fini(amber__s3 *s);

/* A request of `key` (relative to the prefix), or of the bucket itself (`bucket`: a
 * listing, `key` naming what is listed), with `query` already canonical (sorted,
 * encoded) and `what` naming it in messages (NULL: the method). */
int amber__s3_req_init(amber__s3 *s, amber__s3_req *r, const char *method,
                       const char *key, int bucket, const char *query, const char *what);
int amber__s3_req_header(amber__s3_req *r, const char *h);
void amber__s3_req_free(amber__s3_req *r);
/* Runs `n` requests, opts.parallel at a time, each retried on its own after a backoff;
 * 0 when all succeeded, else the first permanent failure (the others are stopped). */
int amber__s3_run(amber__s3 *s, amber__s3_req *rs, size_t n);

/* Percent-encoded as SigV4's canonical form wants: all but A-Z a-z 0-9 - _ . ~ (and
 * '/' when keep_slash). A new string, or NULL. */
char *amber__s3_uri_encode(const char *s, int keep_slash);
/* The form of x-amz-checksum-crc32: base64 of the big-endian value. */
void amber__s3_crc32_b64(uint32_t crc, char out[12]);
/* Each element's text with its name and its parent's name, at its end. */
typedef void (*amber__s3_xml_fn)(void *arg, const char *parent, const char *name,
                                 const char *text);
/* Parses `len` bytes of XML (expat); 0, or -1 when it is not well-formed. `root` (may
 * be NULL) gets the root element's name. */
int amber__s3_xml_parse(const char *buf, size_t len, amber__s3_xml_fn fn, void *arg,
                        char root[48]);

#endif /* AMBER_S3REQ_H */

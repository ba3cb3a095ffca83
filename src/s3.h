/*
 * s3.h - internal: a client of one S3 bucket and prefix ("s3://bucket/prefix"), the
 * protocol layer under s3:// stores (src/s3.c, configuration in src/s3conf.c).
 *
 * libcurl sends the requests and signs them (AWS SigV4, curl >= 7.75), expat parses
 * S3's XML answers, zlib computes the CRC32 checksums sent with every upload. Every
 * call retries with exponential backoff and full jitter on 5xx, 429/SlowDown,
 * RequestTimeout, timeouts and cut connections, and fails at once on any other 4xx
 * with a message that names the object and S3's error code and message. Failures go
 * through amber__fail with a NULL handle: the calling thread's last error.
 *
 * Keys are relative to the prefix ("ckpt-5.amber" is s3://bucket/prefix/ckpt-5.amber).
 * One client may be used by many threads at once: each call takes a set of
 * connections (a curl multi handle and its easy handles) from the client's pool and
 * gives it back, so a thread's calls reuse warm connections.
 *
 * Built without libcurl (AMBER_HAVE_S3 undefined), amber__s3_open fails with
 * AMBER_EFORMAT, "built without S3 support", and nothing else can be reached.
 */
#ifndef AMBER_S3_H
#define AMBER_S3_H

#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "internal.h"

/* ---- configuration (src/s3conf.c) ---- */

/* Where and as whom: parsed from the URL, then the standard AWS environment and
 * files, in the precedence of the AWS CLI and SDKs:
 *   credentials  AWS_ACCESS_KEY_ID + AWS_SECRET_ACCESS_KEY (+ AWS_SESSION_TOKEN), else
 *                the profile (AWS_PROFILE, else "default") in the credentials file
 *                (AWS_SHARED_CREDENTIALS_FILE, else ~/.aws/credentials), else in the
 *                config file (AWS_CONFIG_FILE, else ~/.aws/config, "[profile NAME]");
 *   region       AWS_REGION, AWS_DEFAULT_REGION, the profile's region, "us-east-1";
 *   endpoint     AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, the profile's s3 endpoint_url,
 *                its endpoint_url (none of these with AWS_IGNORE_CONFIGURED_ENDPOINT_URLS
 *                true); none: AWS itself, https://BUCKET.s3.REGION.amazonaws.com;
 *   addressing   path-style (ENDPOINT/BUCKET/KEY) when an endpoint is given, as local
 *                servers need, or the profile's s3 addressing_style says "path", or
 *                the bucket name has a dot; virtual-hosted otherwise.
 * Not read: credential_process, SSO, web identity, instance metadata (IMDS). */
typedef struct amber__s3_conf {
  char *bucket;
  char *prefix;   /* "" or ending in '/' */
  char *endpoint; /* scheme://host[:port][/path] without a trailing '/'; NULL: AWS */
  char *region;
  char *key_id, *secret, *token; /* token NULL without a session token */
  char *creds_from; /* where the credentials came from, for messages */
  int path_style;
} amber__s3_conf;

/* Fills `c` for `url` ("s3://bucket[/prefix]"). 0, AMBER_EINVAL for a malformed URL
 * or a profile that no file has, AMBER_EPERM when no credentials are found,
 * AMBER_ENOMEM. On failure `c` holds nothing to free. */
int amber__s3_conf_load(amber__s3_conf *c, const char *url);
void amber__s3_conf_free(amber__s3_conf *c);

/* ---- the client (src/s3.c) ---- */

typedef struct amber__s3 amber__s3;

/* Zero in a field means its default. */
typedef struct amber__s3_opts {
  /* requests in flight in one call: parts, ranges (0: 8) */
  uint32_t parallel;
  /* multipart part and parallel GET piece (0: 16 MiB; at least 5 MiB, S3's smallest) */
  uint64_t part_size;
  /* retries after a first failed attempt (0: 10) */
  uint32_t retries;
  /* the first retry waits up to this, doubling each time up to 20 s (0: 200) */
  uint32_t backoff_ms;
  /* a transfer that moves no byte for this long is retried (0: 30) */
  uint32_t stall_s;
  /* connection timeout (0: 10000) */
  uint32_t connect_ms;
  /* keys per listing page (0: the server's most, 1000) */
  uint32_t list_page;
} amber__s3_opts;

/* What the server holds for a key: HEAD's answer, or what an upload asked for. */
typedef struct amber__s3_stat {
  uint64_t size;
  char etag[80];  /* without its quotes */
  char crc32[32]; /* x-amz-checksum-crc32, base64; "X-N" for a multipart object of N
                     parts (CRC32 of its parts' CRC32s, S3's COMPOSITE checksum); "" when
                     the object has none */
} amber__s3_stat;

/* Opens a client of `url` (configuration as above; no request is made). */
int amber__s3_open(amber__s3 **out, const char *url, const amber__s3_opts *opts);
void amber__s3_close(amber__s3 *s);
/* "s3://bucket/prefix" as given to open (without a trailing '/'). */
const char *amber__s3_url(const amber__s3 *s);

/* What an upload reads: `len` bytes of `buf`, or of the file `fd` from offset 0 when
 * buf is NULL (read with pread, so that parts go in parallel and a retry reads again;
 * the file must not change until the upload returns). */
typedef struct amber__s3_body {
  const void *buf;
  int fd;
  uint64_t len;
} amber__s3_body;

/* Uploads an object whole, with a CRC32 checksum that the server checks: one PUT up
 * to part_size, else a multipart upload with `parallel` parts in flight, aborted on
 * failure (nothing is left under the key but what was there before). `st` (may be
 * NULL) gets what the server must now report for the key (size, checksum, ETag). */
int amber__s3_upload(amber__s3 *s, const char *key, const amber__s3_body *body,
                     amber__s3_stat *st);
/* amber__s3_upload of a buffer. */
int amber__s3_put(amber__s3 *s, const char *key, const void *buf, size_t len,
                  amber__s3_stat *st);
/* HEAD: size, ETag and checksum of a key; AMBER_ENOENT when there is none. */
int amber__s3_head(amber__s3 *s, const char *key, amber__s3_stat *st);
/* Reads the key back (HEAD) and checks its size and checksum against what an upload
 * returned in `want`: 0, or AMBER_ECORRUPT naming both. */
int amber__s3_confirm(amber__s3 *s, const char *key, const amber__s3_stat *want);

/* GETs a whole object into a new buffer (*out, freed with free(), NUL-terminated
 * beyond *len) of at most `max` bytes: a larger object is refused with AMBER_ERANGE
 * before anything is allocated for it. AMBER_ENOENT when the key does not exist. */
int amber__s3_get(amber__s3 *s, const char *key, size_t max, void **out, size_t *len);

/* One byte range of an object, read into `buf`. */
typedef struct amber__s3_range {
  uint64_t off;
  size_t len;
  void *buf;
} amber__s3_range;
/* Ranged GETs of `n` ranges of one object, `parallel` at a time (a range longer than
 * part_size goes as several). Every byte asked for must exist: a range past the end is
 * AMBER_ECORRUPT. The buffers are written only inside their ranges. */
int amber__s3_get_ranges(amber__s3 *s, const char *key, const amber__s3_range *r,
                         size_t n);

/* One object opened for reading by ranges, the way a reader reads a checkpoint file:
 * its size and ETag are read once (HEAD), and every read asks for that version only
 * (If-Match), so that an object replaced while it is read (a compact rewriting a
 * step under the same key) fails the read with AMBER_ECHANGED instead of mixing two
 * versions. A range outside the object is AMBER_ECORRUPT, asked of no server. One
 * handle may serve many threads; the client must outlive it. */
typedef struct amber__s3_obj amber__s3_obj;
int amber__s3_obj_open(amber__s3_obj **out, amber__s3 *s, const char *key);
uint64_t amber__s3_obj_size(const amber__s3_obj *o);
/* Exactly `len` bytes at `off` (ranged GETs, in parallel pieces when long). */
int amber__s3_obj_pread(amber__s3_obj *o, void *buf, size_t len, uint64_t off);
/* Several ranges at once, `parallel` requests in flight. */
int amber__s3_obj_preadv(amber__s3_obj *o, const amber__s3_range *r, size_t n);
void amber__s3_obj_close(amber__s3_obj *o);

/* DELETE: 0 also when the key did not exist (S3 does not say). */
int amber__s3_delete(amber__s3 *s, const char *key);

/* Lists the keys that start with `sub` (relative to the prefix, "" for all) in key
 * order, all pages of ListObjectsV2; `fn` gets each name (relative to the prefix) and
 * size, and a non-zero return stops the listing and is returned. */
typedef int (*amber__s3_list_fn)(void *arg, const char *name, uint64_t size);
int amber__s3_list(amber__s3 *s, const char *sub, amber__s3_list_fn fn, void *arg);

/* Multipart uploads begun and neither completed nor aborted under the prefix + `sub`
 * (ListMultipartUploads, all pages): what a crashed upload leaves, which S3 keeps
 * (and bills) until it is aborted. `fn` gets each one's name (relative to the
 * prefix), upload id and start time (0 when the server gives none it can parse). */
typedef int (*amber__s3_upload_fn)(void *arg, const char *name, const char *upload_id,
                                   time_t initiated);
int amber__s3_uploads(amber__s3 *s, const char *sub, amber__s3_upload_fn fn, void *arg);
/* Aborts one multipart upload: its parts are freed. 0 also when it is gone already. */
int amber__s3_upload_abort(amber__s3 *s, const char *key, const char *upload_id);

/* Tests only: starts a multipart upload of `key` and leaves it, as a crash would,
 * giving its id (at least 1024 bytes at `id`). */
int amber__s3_upload_begin(amber__s3 *s, const char *key, char *id, size_t id_len);

/* The client's counters since open, for tests and benches. */
typedef struct amber__s3_counters {
  uint64_t requests; /* attempts sent, retries included */
  uint64_t retries;
  uint64_t bytes_up, bytes_down;
} amber__s3_counters;
void amber__s3_counters_get(const amber__s3 *s, amber__s3_counters *c);

#endif /* AMBER_S3_H */

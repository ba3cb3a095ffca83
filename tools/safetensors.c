/*
 * safetensors.c - parse and format the header of a safetensors file.
 *
 * `amber import` reads safetensors files that come from anywhere, so the parser
 * treats the header as hostile input: its length is checked against the file
 * before anything is allocated, jansson parses exactly those N bytes (rejecting
 * duplicate keys), and every tensor entry is validated - dtype, shape, offsets,
 * the size arithmetic without overflow, no overlap with another tensor - before
 * the caller may read a byte of data through it. Formatting is the reverse, for
 * `amber export`: compact UTF-8 JSON in the caller's tensor order, padded with
 * spaces so that the data area starts at a multiple of 8.
 *
 * We accept gaps between tensors (the reference implementation does not): they
 * cost nothing to skip and some writers align tensors.
 *
 * This is the CLI's side of the library's boundary (docs/DESIGN.md): it uses only
 * the public header, and it alone links jansson; libamber knows no JSON library.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <jansson.h>

#include "amber.h"
#include "safetensors.h"

#define META_KEY "__metadata__"

/* safetensors dtype names, indexed by amber_dtype. The others that safetensors
 * 0.8 defines (F8_E8M0, F8_E4M3FNUZ, F8_E5M2FNUZ, F6_E2M3, F6_E3M2, F4, C64) are
 * valid safetensors that amber does not carry: import refuses them by name. */
static const char *const st_names[] = {
    [AMBER_F32] = "F32", [AMBER_F16] = "F16",         [AMBER_BF16] = "BF16",
    [AMBER_F64] = "F64", [AMBER_F8_E4M3] = "F8_E4M3", [AMBER_F8_E5M2] = "F8_E5M2",
    [AMBER_I64] = "I64", [AMBER_I32] = "I32",         [AMBER_I16] = "I16",
    [AMBER_I8] = "I8",   [AMBER_U8] = "U8",           [AMBER_BOOL] = "BOOL",
    [AMBER_U16] = "U16", [AMBER_U32] = "U32",         [AMBER_U64] = "U64",
};
#define NST_NAMES (sizeof st_names / sizeof st_names[0])

static int st_dtype(const char *s) {
  for (size_t i = 1; i < NST_NAMES; i++)
    if (st_names[i] && !strcmp(st_names[i], s)) return (int)i;
  return 0;
}

static const char *st_name(int dt) {
  return (dt > 0 && (size_t)dt < NST_NAMES) ? st_names[dt] : NULL;
}

__attribute__((format(printf, 4, 5))) static int fail(char *err, size_t errlen, int code,
                                                      const char *fmt, ...) {
  if (err && errlen) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
  }
  return code;
}

/* The header length field: 8 bytes, little-endian. */
static uint64_t get_le64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}

static void put_le64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* Reads exactly `len` bytes at offset 0; -1 with errno set (EIO when the file is
 * shorter than that). */
static int pread_all(int fd, uint8_t *buf, size_t len) {
  size_t done = 0;
  while (done < len) {
    ssize_t n = pread(fd, buf + done, len - done, (off_t)done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (n == 0) errno = EIO;
      return -1;
    }
    done += (size_t)n;
  }
  return 0;
}

/* Writes "[d0, d1, ...]" into buf; big enough for AMBER_MAX_DIMS 20-digit dims. */
#define SHAPE_STRLEN (2 + AMBER_MAX_DIMS * 22)
static const char *fmt_shape(char buf[SHAPE_STRLEN], const int64_t *shape,
                             uint32_t ndim) {
  size_t pos = 0;
  buf[pos++] = '[';
  buf[pos] = '\0';
  for (uint32_t i = 0; i < ndim && i < AMBER_MAX_DIMS; i++)
    pos += (size_t)snprintf(buf + pos, SHAPE_STRLEN - pos, "%s%lld", i ? ", " : "",
                            (long long)shape[i]);
  snprintf(buf + pos, SHAPE_STRLEN - pos, "]");
  return buf;
}

/* product(shape) * itemsize into *nbytes; 1 on overflow or a negative dim. */
static int shape_bytes(const int64_t *shape, uint32_t ndim, int dtype, uint64_t *nbytes) {
  uint64_t n = 1;
  for (uint32_t i = 0; i < ndim; i++)
    if (shape[i] < 0 || __builtin_mul_overflow(n, (uint64_t)shape[i], &n)) return 1;
  return __builtin_mul_overflow(n, amber_dtype_size(dtype), nbytes);
}

/* 1 when `s` is valid UTF-8 as jansson demands it of object keys: no overlong
 * forms, no surrogates, nothing above U+10FFFF. */
static int utf8_valid(const char *str) {
  const unsigned char *s = (const unsigned char *)str;
  while (*s) {
    uint32_t c = *s++;
    int n;
    if (c < 0x80) continue;
    if (c >= 0xC2 && c <= 0xDF) {
      n = 1, c &= 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
      n = 2, c &= 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      n = 3, c &= 0x07;
    } else {
      return 0;
    }
    for (int i = 0; i < n; i++, s++) {
      if ((*s & 0xC0) != 0x80) return 0; /* also stops at the terminating NUL */
      c = (c << 6) | (*s & 0x3Fu);
    }
    if ((n == 2 && c < 0x800) || (n == 3 && c < 0x10000) || c > 0x10FFFF ||
        (c >= 0xD800 && c <= 0xDFFF))
      return 0;
  }
  return 1;
}

/* ---- parsing ---------------------------------------------------------------- */

typedef struct parser {
  char *err;
  size_t errlen;
  uint64_t data_start; /* 8 + N */
  uint64_t data_size;  /* file_size - data_start */
} parser;

/* Decodes N from the first 8 bytes and checks it against the limit and the file
 * before anyone allocates N bytes. */
static int check_length(const uint8_t len8[8], uint64_t file_size, uint64_t *n, char *err,
                        size_t errlen) {
  *n = get_le64(len8);
  if (*n > AMBER__ST_MAX_HEADER)
    return fail(err, errlen, AMBER_ECORRUPT,
                "safetensors header length %llu exceeds the limit of %u bytes",
                (unsigned long long)*n, (unsigned)AMBER__ST_MAX_HEADER);
  if (*n > file_size - 8)
    return fail(err, errlen, AMBER_ECORRUPT,
                "safetensors header length %llu runs past the end of the %llu-byte file",
                (unsigned long long)*n, (unsigned long long)file_size);
  return 0;
}

static int too_short(uint64_t file_size, char *err, size_t errlen) {
  return fail(err, errlen, AMBER_ECORRUPT,
              "file of %llu bytes is too short for a safetensors header length",
              (unsigned long long)file_size);
}

/* A JSON integer >= 0 (a real such as 1.0 is refused). */
static int get_uint(const json_t *j, uint64_t *v) {
  if (!json_is_integer(j) || json_integer_value(j) < 0) return 0;
  *v = (uint64_t)json_integer_value(j);
  return 1;
}

static int parse_shape(const parser *p, const char *name, const json_t *js,
                       amber__st_tensor *t) {
  if (!json_is_array(js))
    return fail(p->err, p->errlen, AMBER_ECORRUPT, "tensor '%s': shape is not an array",
                name);
  size_t nd = json_array_size(js);
  if (nd > AMBER_MAX_DIMS)
    return fail(p->err, p->errlen, AMBER_EFORMAT,
                "tensor '%s': shape has %zu dimensions, at most %d are supported", name,
                nd, AMBER_MAX_DIMS);
  for (size_t i = 0; i < nd; i++) {
    uint64_t d;
    if (!get_uint(json_array_get(js, i), &d))
      return fail(p->err, p->errlen, AMBER_ECORRUPT,
                  "tensor '%s': shape entry %zu is not a non-negative integer", name, i);
    t->shape[i] = (int64_t)d;
  }
  t->ndim = (uint32_t)nd;
  return 0;
}

static int parse_offsets(const parser *p, const char *name, const json_t *jo,
                         uint64_t off[2]) {
  if (!json_is_array(jo) || json_array_size(jo) != 2 ||
      !get_uint(json_array_get(jo, 0), &off[0]) ||
      !get_uint(json_array_get(jo, 1), &off[1]))
    return fail(p->err, p->errlen, AMBER_ECORRUPT,
                "tensor '%s': data_offsets is not [begin, end] of non-negative integers",
                name);
  if (off[0] > off[1])
    return fail(p->err, p->errlen, AMBER_ECORRUPT,
                "tensor '%s': data_offsets [%llu, %llu] begin after they end", name,
                (unsigned long long)off[0], (unsigned long long)off[1]);
  if (off[1] > p->data_size)
    return fail(p->err, p->errlen, AMBER_ECORRUPT,
                "tensor '%s': data_offsets [%llu, %llu] run past the end of the "
                "%llu-byte data area",
                name, (unsigned long long)off[0], (unsigned long long)off[1],
                (unsigned long long)p->data_size);
  return 0;
}

/* Validates one "name": {dtype, shape, data_offsets} entry into *t (name not set). */
static int parse_entry(const parser *p, const char *name, json_t *val,
                       amber__st_tensor *t) {
  char sh[SHAPE_STRLEN];
  if (!*name)
    return fail(p->err, p->errlen, AMBER_ECORRUPT, "a tensor has an empty name");
  if (!json_is_object(val))
    return fail(p->err, p->errlen, AMBER_ECORRUPT, "tensor '%s': entry is not an object",
                name);
  json_t *jd = NULL, *js = NULL, *jo = NULL, *v;
  const char *k;
  json_object_foreach(val, k, v) {
    if (!strcmp(k, "dtype"))
      jd = v;
    else if (!strcmp(k, "shape"))
      js = v;
    else if (!strcmp(k, "data_offsets"))
      jo = v;
    else
      return fail(p->err, p->errlen, AMBER_ECORRUPT, "tensor '%s': unknown key '%s'",
                  name, k);
  }
  if (!jd || !js || !jo)
    return fail(p->err, p->errlen, AMBER_ECORRUPT, "tensor '%s': \"%s\" is missing", name,
                !jd   ? "dtype"
                : !js ? "shape"
                      : "data_offsets");
  if (!json_is_string(jd))
    return fail(p->err, p->errlen, AMBER_ECORRUPT, "tensor '%s': dtype is not a string",
                name);
  t->dtype = st_dtype(json_string_value(jd));
  if (!t->dtype)
    return fail(p->err, p->errlen, AMBER_EFORMAT,
                "tensor '%s': dtype '%.40s' is not supported by amber (it carries F64 "
                "F32 F16 BF16 F8_E4M3 F8_E5M2 I64 I32 I16 I8 U64 U32 U16 U8 BOOL)",
                name, json_string_value(jd));
  int rc = parse_shape(p, name, js, t);
  if (rc) return rc;
  if (shape_bytes(t->shape, t->ndim, t->dtype, &t->nbytes))
    return fail(p->err, p->errlen, AMBER_ECORRUPT,
                "tensor '%s': size of shape %s of %s overflows 64 bits", name,
                fmt_shape(sh, t->shape, t->ndim), st_name(t->dtype));
  uint64_t off[2] = {0, 0};
  rc = parse_offsets(p, name, jo, off);
  if (rc) return rc;
  if (off[1] - off[0] != t->nbytes)
    return fail(p->err, p->errlen, AMBER_ECORRUPT,
                "tensor '%s': data_offsets [%llu, %llu] do not match shape %s of %s "
                "(%llu bytes)",
                name, (unsigned long long)off[0], (unsigned long long)off[1],
                fmt_shape(sh, t->shape, t->ndim), st_name(t->dtype),
                (unsigned long long)t->nbytes);
  t->offset = p->data_start + off[0];
  return 0;
}

static int parse_meta(const parser *p, json_t *m, amber__st_header *h) {
  const char *k;
  json_t *v;
  if (!json_is_object(m))
    return fail(p->err, p->errlen, AMBER_ECORRUPT, META_KEY " is not an object");
  json_object_foreach(m, k, v) {
    if (!json_is_string(v))
      return fail(p->err, p->errlen, AMBER_ECORRUPT,
                  META_KEY ": value of '%s' is not a string", k);
  }
  h->metadata = json_dumps(m, JSON_COMPACT | JSON_PRESERVE_ORDER);
  if (!h->metadata)
    return fail(p->err, p->errlen, AMBER_ENOMEM, "out of memory copying " META_KEY);
  h->metadata_len = strlen(h->metadata);
  return 0;
}

/* By offset; ties (empty tensors) by size then name, so the order is deterministic. */
static int cmp_offset(const void *a, const void *b) {
  const amber__st_tensor *x = a, *y = b;
  if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
  if (x->nbytes != y->nbytes) return x->nbytes < y->nbytes ? -1 : 1;
  return strcmp(x->name, y->name);
}

/* Sorted tensors must not share a byte. An empty tensor holds no byte, so it may
 * sit anywhere, even inside another one. */
static int check_overlap(const parser *p, const amber__st_header *h) {
  const amber__st_tensor *last = NULL;
  for (size_t i = 0; i < h->count; i++) {
    const amber__st_tensor *t = &h->tensors[i];
    if (!t->nbytes) continue;
    if (last && t->offset < last->offset + last->nbytes)
      return fail(p->err, p->errlen, AMBER_ECORRUPT,
                  "tensors '%s' [%llu, %llu] and '%s' [%llu, %llu] overlap", last->name,
                  (unsigned long long)(last->offset - p->data_start),
                  (unsigned long long)(last->offset - p->data_start + last->nbytes),
                  t->name, (unsigned long long)(t->offset - p->data_start),
                  (unsigned long long)(t->offset - p->data_start + t->nbytes));
    last = t;
  }
  return 0;
}

static int parse_root(const parser *p, json_t *root, amber__st_header *h) {
  if (!json_is_object(root))
    return fail(p->err, p->errlen, AMBER_ECORRUPT,
                "safetensors header is not a JSON object");
  json_t *meta = json_object_get(root, META_KEY);
  size_t n = json_object_size(root) - (meta ? 1 : 0);
  if (meta) {
    int rc = parse_meta(p, meta, h);
    if (rc) return rc;
  }
  h->tensors = calloc(n ? n : 1, sizeof *h->tensors);
  if (!h->tensors)
    return fail(p->err, p->errlen, AMBER_ENOMEM, "out of memory for %zu tensors", n);
  const char *key;
  json_t *val;
  json_object_foreach(root, key, val) {
    if (val == meta) continue;
    amber__st_tensor *t = &h->tensors[h->count];
    int rc = parse_entry(p, key, val, t);
    if (rc) return rc;
    if (!(t->name = strdup(key)))
      return fail(p->err, p->errlen, AMBER_ENOMEM, "out of memory for tensor names");
    h->count++;
  }
  qsort(h->tensors, h->count, sizeof *h->tensors, cmp_offset);
  return check_overlap(p, h);
}

int amber__st_parse(const uint8_t *buf, size_t avail, uint64_t file_size,
                    amber__st_header *out, char *err, size_t errlen) {
  if (!out || (!buf && avail))
    return fail(err, errlen, AMBER_EINVAL, "amber__st_parse: NULL argument");
  memset(out, 0, sizeof *out);
  if (file_size < 8) return too_short(file_size, err, errlen);
  if (avail < 8)
    return fail(err, errlen, AMBER_EINVAL, "only %zu bytes of the file were given",
                avail);
  uint64_t n;
  int rc = check_length(buf, file_size, &n, err, errlen);
  if (rc) return rc;
  if (n > avail - 8)
    return fail(err, errlen, AMBER_EINVAL,
                "only %zu bytes of the file were given, the header needs %llu", avail,
                (unsigned long long)(8 + n));

  json_error_t je;
  json_t *root =
      json_loadb((const char *)buf + 8, (size_t)n, JSON_REJECT_DUPLICATES, &je);
  if (!root)
    return fail(err, errlen,
                json_error_code(&je) == json_error_out_of_memory ? AMBER_ENOMEM
                                                                 : AMBER_ECORRUPT,
                "safetensors header is not valid JSON: %s (at byte %d of %llu)", je.text,
                je.position, (unsigned long long)n);
  parser p = {err, errlen, 8 + n, file_size - 8 - n};
  out->data_start = p.data_start;
  rc = parse_root(&p, root, out);
  json_decref(root);
  if (rc) amber__st_header_free(out);
  return rc;
}

int amber__st_read_header(int fd, uint64_t file_size, amber__st_header *out, char *err,
                          size_t errlen) {
  uint8_t len8[8];
  uint64_t n;
  if (!out)
    return fail(err, errlen, AMBER_EINVAL, "amber__st_read_header: NULL argument");
  memset(out, 0, sizeof *out);
  if (file_size < 8) return too_short(file_size, err, errlen);
  if (pread_all(fd, len8, sizeof len8) < 0)
    return fail(err, errlen, errno == ENOMEM ? AMBER_ENOMEM : AMBER_EIO,
                "reading the safetensors header length: %s", strerror(errno));
  int rc = check_length(len8, file_size, &n, err, errlen);
  if (rc) return rc;
  uint8_t *buf = malloc((size_t)(8 + n));
  if (!buf)
    return fail(err, errlen, AMBER_ENOMEM, "out of memory for a %llu-byte header",
                (unsigned long long)n);
  if (pread_all(fd, buf, (size_t)(8 + n)) < 0)
    rc = fail(err, errlen, errno == ENOMEM ? AMBER_ENOMEM : AMBER_EIO, "reading the safetensors header: %s",
              strerror(errno));
  else
    rc = amber__st_parse(buf, (size_t)(8 + n), file_size, out, err, errlen);
  free(buf);
  return rc;
}

void amber__st_header_free(amber__st_header *h) {
  if (!h) return;
  for (size_t i = 0; i < h->count; i++)
    free(h->tensors[i].name);
  free(h->tensors);
  free(h->metadata);
  memset(h, 0, sizeof *h);
}

/* ---- formatting ------------------------------------------------------------- */

static int add_meta(json_t *root, const char *metadata, size_t len, char *err,
                    size_t errlen) {
  json_error_t je;
  json_t *m = json_loadb(metadata, len, JSON_REJECT_DUPLICATES, &je);
  if (!m)
    return fail(err, errlen, AMBER_EINVAL, "metadata is not valid JSON: %s", je.text);
  const char *k;
  json_t *v;
  int rc = 0;
  if (!json_is_object(m))
    rc = fail(err, errlen, AMBER_EINVAL, "metadata is not a JSON object");
  json_object_foreach(m, k, v) {
    if (!rc && !json_is_string(v))
      rc = fail(err, errlen, AMBER_EINVAL, "metadata: value of '%s' is not a string", k);
  }
  if (rc) {
    json_decref(m);
    return rc;
  }
  if (json_object_set_new(root, META_KEY, m))
    return fail(err, errlen, AMBER_ENOMEM, "out of memory formatting the metadata");
  return 0;
}

/* Adds t as the entry at relative offset *pos and advances *pos past it. */
static int add_tensor(json_t *root, const amber__st_tensor *t, size_t i, uint64_t *pos,
                      char *err, size_t errlen) {
  char sh[SHAPE_STRLEN];
  uint64_t nbytes, end;
  if (!t->name || !*t->name)
    return fail(err, errlen, AMBER_EINVAL, "tensor %zu has an empty name", i);
  if (!utf8_valid(t->name))
    return fail(err, errlen, AMBER_EINVAL, "tensor %zu: name is not valid UTF-8", i);
  if (!strcmp(t->name, META_KEY))
    return fail(err, errlen, AMBER_EINVAL, "tensor name '" META_KEY "' is reserved");
  if (json_object_get(root, t->name))
    return fail(err, errlen, AMBER_EINVAL, "tensor '%s' appears twice", t->name);
  if (!st_name(t->dtype))
    return fail(err, errlen, AMBER_EINVAL, "tensor '%s': unknown dtype %d", t->name,
                t->dtype);
  if (t->ndim > AMBER_MAX_DIMS)
    return fail(err, errlen, AMBER_EINVAL, "tensor '%s': %u dimensions, at most %d",
                t->name, (unsigned)t->ndim, AMBER_MAX_DIMS);
  if (shape_bytes(t->shape, t->ndim, t->dtype, &nbytes) || nbytes != t->nbytes)
    return fail(err, errlen, AMBER_EINVAL,
                "tensor '%s': %llu bytes do not match shape %s of %s", t->name,
                (unsigned long long)t->nbytes, fmt_shape(sh, t->shape, t->ndim),
                st_name(t->dtype));
  if (__builtin_add_overflow(*pos, nbytes, &end) || end > INT64_MAX)
    return fail(err, errlen, AMBER_EINVAL, "tensor '%s': data area exceeds 2^63 bytes",
                t->name);

  json_t *e = json_object(), *shape = json_array(), *offs = json_array();
  int bad = !e || !shape || !offs;
  for (uint32_t d = 0; !bad && d < t->ndim; d++)
    bad = json_array_append_new(shape, json_integer(t->shape[d]));
  bad = bad || json_array_append_new(offs, json_integer((json_int_t)*pos)) ||
        json_array_append_new(offs, json_integer((json_int_t)end)) ||
        json_object_set_new(e, "dtype", json_string(st_name(t->dtype))) ||
        json_object_set(e, "shape", shape) || json_object_set(e, "data_offsets", offs) ||
        json_object_set(root, t->name, e);
  json_decref(e);
  json_decref(shape);
  json_decref(offs);
  if (bad) return fail(err, errlen, AMBER_ENOMEM, "out of memory formatting the header");
  *pos = end;
  return 0;
}

int amber__st_format_header(amber__st_tensor *t, size_t n, const char *metadata,
                            size_t metadata_len, uint8_t **out, size_t *outlen, char *err,
                            size_t errlen) {
  if (!out || !outlen || (!t && n))
    return fail(err, errlen, AMBER_EINVAL, "amber__st_format_header: NULL argument");
  *out = NULL;
  *outlen = 0;
  json_t *root = json_object();
  if (!root)
    return fail(err, errlen, AMBER_ENOMEM, "out of memory formatting the header");
  int rc = 0;
  if (metadata && metadata_len) rc = add_meta(root, metadata, metadata_len, err, errlen);
  uint64_t pos = 0;
  for (size_t i = 0; i < n && !rc; i++)
    rc = add_tensor(root, &t[i], i, &pos, err, errlen);
  char *js = rc ? NULL : json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
  json_decref(root);
  if (rc) return rc;
  if (!js) return fail(err, errlen, AMBER_ENOMEM, "out of memory formatting the header");

  size_t len = strlen(js), hlen = len + (8 - len % 8) % 8; /* 8 + hlen aligned to 8 */
  if (hlen > AMBER__ST_MAX_HEADER) {
    free(js);
    return fail(err, errlen, AMBER_EINVAL, "header of %zu bytes exceeds the limit of %u",
                hlen, (unsigned)AMBER__ST_MAX_HEADER);
  }
  uint8_t *b = malloc(8 + hlen);
  if (!b) {
    free(js);
    return fail(err, errlen, AMBER_ENOMEM, "out of memory formatting the header");
  }
  put_le64(b, hlen);
  memcpy(b + 8, js, len);
  memset(b + 8 + len, ' ', hlen - len);
  free(js);
  pos = 8 + hlen; /* offsets set only on success: t is untouched on failure */
  for (size_t i = 0; i < n; i++) {
    t[i].offset = pos;
    pos += t[i].nbytes;
  }
  *out = b;
  *outlen = 8 + hlen;
  return 0;
}

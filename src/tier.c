/*
 * tier.c - what the drain and the replicas share (src/tier.h): a checkpoint file
 * read with every checksum checked as it passes, what a destination holds of one
 * store, the chain of a step across a memory store and a destination, installing a
 * step there with its pointer last, and the memory tier's TIERS file.
 *
 * Installing follows the store's own commit protocol (FORMAT.md): each file of the
 * step's chain that the destination lacks is read and checked whole, then put whole
 * (a temporary name, fsync, rename, fsync of the directory), oldest first, and only
 * then LATEST moves. A crash
 * in between leaves whole files that no pointer names yet: readers ignore them, and
 * the next install finds them there (by their footer's state id) and does not copy
 * them again.
 */
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "xxh.h"

#include "format.h"
#include "global.h"
#include "tier.h"

/* ---- a checkpoint file read with its checksums checked ---- */

#define VBLOCK (4u << 20)

typedef struct span {
  uint64_t off, size, sum, chunk;
} span;

struct amber__vsrc {
  const amber__ckpt *c;
  uint8_t *buf;
  uint64_t pos;      /* the next offset to read */
  span *sp;          /* the chunks' payloads, by offset */
  size_t nsp, next;  /* sp[next]: the first payload not yet wholly seen */
  XXH3_state_t *hs;  /* sp[next]'s hash so far */
  XXH3_state_t *ixs; /* the index's */
  uint8_t hdr[AMBER__HEADER_SIZE], ftr[AMBER__FOOTER_SIZE];
};

static int cmp_span(const void *a, const void *b) {
  const span *x = a, *y = b;
  return x->off < y->off ? -1 : x->off > y->off;
}

void amber__vsrc_close(amber__vsrc *v) {
  if (!v) return;
  free(v->buf);
  free(v->sp);
  if (v->hs) XXH3_freeState(v->hs);
  if (v->ixs) XXH3_freeState(v->ixs);
  free(v);
}

/* Payloads that overlap one another (no writer makes them; a hostile file may) are
 * not hashed in passing: each is read again on its own. */
static int check_apart(amber__vsrc *v, amber__err *e) {
  for (size_t i = 0; i < v->nsp; i++) {
    span *s = &v->sp[i];
    uint8_t *b = malloc(s->size ? (size_t)s->size : 1);
    if (!b) return amber__fail(e, AMBER_ENOMEM, "out of memory");
    int bad = amber__pread_full(v->c->fd, b, (size_t)s->size, s->off) != 0 ||
              amber__xxh3(b, (size_t)s->size) != s->sum;
    free(b);
    if (bad)
      return amber__fail(e, AMBER_ECORRUPT, "%s: chunk %" PRIu64 " fails its checksum",
                         v->c->path, s->chunk);
  }
  v->nsp = 0;
  return 0;
}

int amber__vsrc_open(amber__vsrc **out, amber__err *e, const amber__ckpt *c) {
  *out = NULL;
  amber__vsrc *v = calloc(1, sizeof *v);
  if (!v) return amber__fail(e, AMBER_ENOMEM, "out of memory");
  v->c = c;
  const amber__index *ix = &c->ix;
  v->buf = malloc(VBLOCK);
  v->sp = malloc((ix->n_chunks ? ix->n_chunks : 1) * sizeof *v->sp);
  v->hs = XXH3_createState();
  v->ixs = XXH3_createState();
  if (!v->buf || !v->sp || !v->hs || !v->ixs) {
    amber__vsrc_close(v);
    return amber__fail(e, AMBER_ENOMEM, "out of memory");
  }
  for (uint64_t i = 0; i < ix->n_chunks; i++) {
    if (!ix->chunks[i].size) continue; /* an empty payload has no bytes to check */
    v->sp[v->nsp++] =
        (span){ix->chunks[i].offset, ix->chunks[i].size, ix->chunks[i].checksum, i};
  }
  qsort(v->sp, v->nsp, sizeof *v->sp, cmp_span);
  int overlap = 0;
  for (size_t i = 1; i < v->nsp; i++)
    overlap |= v->sp[i].off < v->sp[i - 1].off + v->sp[i - 1].size;
  int rc = overlap ? check_apart(v, e) : 0;
  XXH3_64bits_reset(v->hs);
  XXH3_64bits_reset(v->ixs);
  if (rc) {
    amber__vsrc_close(v);
    return rc;
  }
  *out = v;
  return 0;
}

/* Copies the part of [b0, b0 + n) that lies in [off, off + len) to dst + (its
 * place in that range). */
static void capture(uint8_t *dst, uint64_t off, uint64_t len, const uint8_t *b,
                    uint64_t b0, uint64_t n) {
  uint64_t lo = off > b0 ? off : b0, hi = off + len < b0 + n ? off + len : b0 + n;
  if (lo < hi) memcpy(dst + (lo - off), b + (lo - b0), (size_t)(hi - lo));
}

/* Checks block [b0, b0 + n) of the file as it passes. */
static int check_block(amber__vsrc *v, amber__err *e, const uint8_t *b, uint64_t b0,
                       uint64_t n) {
  const amber__footer *f = &v->c->ftr;
  uint64_t b1 = b0 + n;
  capture(v->hdr, 0, AMBER__HEADER_SIZE, b, b0, n);
  capture(v->ftr, v->c->size - AMBER__FOOTER_SIZE, AMBER__FOOTER_SIZE, b, b0, n);
  uint64_t lo = f->index_offset > b0 ? f->index_offset : b0;
  uint64_t hi =
      f->index_offset + f->index_size < b1 ? f->index_offset + f->index_size : b1;
  if (lo < hi) XXH3_64bits_update(v->ixs, b + (lo - b0), (size_t)(hi - lo));
  while (v->next < v->nsp && v->sp[v->next].off < b1) {
    span *s = &v->sp[v->next];
    lo = s->off > b0 ? s->off : b0;
    hi = s->off + s->size < b1 ? s->off + s->size : b1;
    XXH3_64bits_update(v->hs, b + (lo - b0), (size_t)(hi - lo));
    if (s->off + s->size > b1) break; /* goes on in the next block */
    if (XXH3_64bits_digest(v->hs) != s->sum)
      return amber__fail(e, AMBER_ECORRUPT,
                         "%s: chunk %" PRIu64 " at offset %" PRIu64 " fails its checksum",
                         v->c->path, s->chunk, s->off);
    XXH3_64bits_reset(v->hs);
    v->next++;
  }
  return 0;
}

/* After the last block: what the open decoded is what passed. */
static int check_end(amber__vsrc *v, amber__err *e) {
  uint8_t h[AMBER__HEADER_SIZE], f[AMBER__FOOTER_SIZE];
  amber__header_encode(&v->c->hdr, h);
  amber__footer fo = v->c->ftr;
  amber__footer_encode(&fo, f);
  if (memcmp(h, v->hdr, sizeof h))
    return amber__fail(e, AMBER_ECORRUPT, "%s: header changed while it was copied",
                       v->c->path);
  if (memcmp(f, v->ftr, sizeof f) || XXH3_64bits_digest(v->ixs) != fo.index_checksum)
    return amber__fail(e, AMBER_ECORRUPT,
                       "%s: index or footer changed while it was copied", v->c->path);
  if (v->next != v->nsp)
    return amber__fail(e, AMBER_ECORRUPT, "%s: chunk payloads past the end of the file",
                       v->c->path);
  return 0;
}

int amber__vsrc_pull(amber__vsrc *v, amber__err *e, const void **p, size_t *n) {
  *p = v->buf, *n = 0;
  uint64_t left = v->c->size - v->pos;
  if (!left) return 0;
  size_t len = left < VBLOCK ? (size_t)left : VBLOCK;
  if (amber__pread_full(v->c->fd, v->buf, len, v->pos) != 0)
    return amber__fail(e, amber__errno_code(errno), "cannot read %s: %s", v->c->path,
                       strerror(errno));
  int rc = check_block(v, e, v->buf, v->pos, len);
  v->pos += len;
  if (!rc && v->pos == v->c->size) rc = check_end(v, e);
  if (!rc) *n = len;
  return rc;
}

int amber__vsrc_check(amber__err *e, const amber__ckpt *c) {
  amber__vsrc *v;
  int rc = amber__vsrc_open(&v, e, c);
  for (size_t n = 1; !rc && n;) {
    const void *p;
    rc = amber__vsrc_pull(v, e, &p, &n);
  }
  amber__vsrc_close(v);
  return rc;
}

/* ---- what a destination holds of one store ---- */

void amber__dview_init(amber__dview *v, amber__dest *d, int32_t rank) {
  memset(v, 0, sizeof *v);
  v->d = d;
  if (rank >= 0) snprintf(v->prefix, sizeof v->prefix, "rank-%05d/", (int)rank);
}

void amber__dview_free(amber__dview *v) {
  free(v->k);
  v->k = NULL, v->n = v->cap = 0;
}

void amber__dview_name(const amber__dview *v, uint64_t step, char *buf, size_t len) {
  snprintf(buf, len, "%sckpt-%020" PRIu64 ".amber", v->prefix, step);
}

static amber__known *find_known(amber__dview *v, uint64_t step) {
  size_t lo = 0, hi = v->n;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (v->k[mid].step < step)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo < v->n && v->k[lo].step == step ? &v->k[lo] : NULL;
}

static int learn(amber__dview *v, amber__err *e, const amber__known *k) {
  amber__known *old = find_known(v, k->step);
  if (old) {
    *old = *k;
    return 0;
  }
  if (v->n == v->cap) {
    amber__known *grown =
        realloc(v->k, (v->cap = v->cap ? 2 * v->cap : 64) * sizeof *grown);
    if (!grown) return amber__fail(e, AMBER_ENOMEM, "out of memory");
    v->k = grown;
  }
  size_t i = v->n++;
  while (i > 0 && v->k[i - 1].step > k->step) {
    v->k[i] = v->k[i - 1];
    i--;
  }
  v->k[i] = *k;
  return 0;
}

int amber__dview_has(amber__dview *v, amber__err *e, uint64_t step, uint64_t state) {
  amber__known *k = find_known(v, step);
  if (k && k->state == state) return 1;
  char name[64];
  uint64_t size;
  amber__dview_name(v, step, name, sizeof name);
  amber__err scratch;
  int rc = v->d->ops->stat(v->d, &scratch, name, &size);
  if (rc == AMBER_ENOENT) return 0;
  if (rc) return amber__fail(e, rc, "%s", scratch.msg);
  if (size < AMBER__HEADER_SIZE + AMBER__INDEX_FIXED + AMBER__FOOTER_SIZE) return 0;
  uint8_t hb[AMBER__HEADER_SIZE], fb[AMBER__FOOTER_SIZE];
  amber__header h;
  amber__footer f;
  if ((rc = v->d->ops->read(v->d, &scratch, name, size - sizeof fb, fb, sizeof fb)) ||
      (rc = v->d->ops->read(v->d, &scratch, name, 0, hb, sizeof hb))) {
    if (rc == AMBER_ENOENT || rc == AMBER_ECORRUPT) return 0; /* gone, or shorter now */
    return amber__fail(e, rc, "%s", scratch.msg);
  }
  /* A file that does not decode, or holds another state, is not the one wanted: the
   * install puts it again (over it). */
  if (amber__footer_decode(NULL, name, fb, size, &f) || f.state_id != state ||
      amber__header_decode(NULL, name, hb, &h) || h.step != step)
    return 0;
  amber__known nk = {step, state, AMBER_NO_STEP, 0};
  if (h.kind != AMBER_KIND_FULL) {
    nk.parent = h.parent_step, nk.parent_state = h.parent_state;
    if (nk.parent >= step) return 0;
    if ((rc = amber__dview_has(v, e, nk.parent, nk.parent_state)) != 1) return rc;
  }
  rc = learn(v, e, &nk);
  return rc ? rc : 1;
}

int amber__dview_latest(amber__dview *v, amber__err *e, uint64_t *step, uint64_t *state) {
  char name[32];
  snprintf(name, sizeof name, "%sLATEST", v->prefix);
  uint8_t *b;
  size_t len;
  amber__err scratch;
  int rc = amber__dest_get(v->d, &scratch, name, 128, &b, &len);
  if (rc == AMBER_ENOENT) return rc;
  if (rc == AMBER_ECORRUPT)
    return amber__fail(e, rc, "%s/%s is malformed (expected '<step> <16 hex digits>')",
                       v->d->where, name);
  if (rc) return amber__fail(e, rc, "%s", scratch.msg);
  char what[4200];
  snprintf(what, sizeof what, "%s/%s", v->d->where, name);
  rc = amber__latest_decode(e, what, (const char *)b, len, step, state);
  free(b);
  return rc;
}

/* ---- chains and installs ---- */

void amber__tier_chain_free(amber__ckpt *c, size_t n) {
  for (size_t i = 0; c && i < n; i++)
    amber__ckpt_close(&c[i]);
  free(c);
}

int amber__tier_chain(amber_store *st, amber__err *e, uint64_t step, uint64_t state,
                      uint64_t have, amber__dview *v, amber__ckpt **out, size_t *n) {
  *out = NULL, *n = 0;
  amber__ckpt *c = NULL;
  size_t cap = 0, k = 0;
  uint64_t want = state, child = AMBER_NO_STEP;
  int rc = 0;
  for (;;) {
    if (have != AMBER_NO_STEP && step <= have) break;
    if (v && (rc = amber__dview_has(v, e, step, want)) != 0) {
      if (rc == 1) rc = 0;
      break;
    }
    if (k == cap) {
      amber__ckpt *grown = realloc(c, (cap = cap ? 2 * cap : 8) * sizeof *grown);
      if (!grown) {
        rc = amber__fail(e, AMBER_ENOMEM, "out of memory");
        break;
      }
      c = grown;
    }
    if ((rc = amber__ckpt_open(e, st, step, &c[k])) != 0) {
      if (rc == AMBER_ENOENT && child != AMBER_NO_STEP)
        rc = amber__fail(e, AMBER_EPARENT,
                         "step %" PRIu64 " needs step %" PRIu64
                         ", whose file is missing from "
                         "%s%s",
                         child, step, st->path, v ? " and from the durable tier" : "");
      break;
    }
    amber__ckpt *f = &c[k++];
    if (f->ftr.state_id != want) {
      rc = amber__fail(e, child == AMBER_NO_STEP ? AMBER_ECORRUPT : AMBER_EPARENT,
                       "%s: state id %016" PRIx64 " differs from the %016" PRIx64
                       " that %s names",
                       f->path, f->ftr.state_id, want,
                       child == AMBER_NO_STEP ? "its pointer" : "its child");
      break;
    }
    if (f->hdr.kind == AMBER_KIND_FULL) break;
    child = step;
    step = f->hdr.parent_step, want = f->hdr.parent_state;
  }
  if (rc) {
    amber__tier_chain_free(c, k);
    return rc;
  }
  *out = c, *n = k;
  return 0;
}

static void count_bytes(void *arg, uint64_t n) {
  amber__tcount *c = arg;
  c->bytes += n;
  if (c->total && n) /* done == total only at the end (amber_drain_run's) */
    amber__progress("drain", c->bytes < c->total ? c->bytes : c->total - 1, c->total);
}

int amber__tier_install(amber_store *st, amber__dview *v, amber__err *e, uint64_t step,
                        uint64_t state, int pointer, const atomic_int *stop,
                        amber__tcount *cnt) {
  amber__ckpt *c;
  size_t n;
  int rc = amber__tier_chain(st, e, step, state, AMBER_NO_STEP, v, &c, &n);
  if (rc) return rc;
  for (size_t i = n; i-- > 0 && !rc;) { /* oldest first */
    if (stop && atomic_load(stop)) {
      rc = AMBER_ECANCELED;
      break;
    }
    /* Checked whole, then put: the file is immutable, so what is put is what was
     * checked, and the destination reads it as it likes (in parallel parts). */
    char name[64];
    amber__dview_name(v, c[i].hdr.step, name, sizeof name);
    amber__body body = {NULL, c[i].fd, c[i].size, cnt ? count_bytes : NULL, cnt};
    if ((rc = amber__vsrc_check(e, &c[i])) != 0) break;
    if ((rc = v->d->ops->put(v->d, e, name, &body)) != 0) break;
    amber__known k = {c[i].hdr.step, c[i].ftr.state_id, AMBER_NO_STEP, 0};
    if (c[i].hdr.kind != AMBER_KIND_FULL)
      k.parent = c[i].hdr.parent_step, k.parent_state = c[i].hdr.parent_state;
    rc = learn(v, e, &k);
    if (cnt) cnt->files++;
  }
  amber__tier_chain_free(c, n);
  if (rc || !pointer) return rc;
  char line[AMBER__LATEST_MAX], name[32];
  size_t len = amber__latest_encode(step, state, line);
  snprintf(name, sizeof name, "%sLATEST", v->prefix);
  return amber__dest_put_bytes(v->d, e, name, line, len);
}

/* ---- the TIERS file ---- */

#define TIERS_MAX 65536

/* Appends `s` as a JSON string. */
static size_t json_string(char *out, size_t cap, size_t o, const char *s) {
  if (o < cap) out[o] = '"';
  o++;
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    char esc[8];
    size_t k;
    if (*p == '"' || *p == '\\')
      k = (size_t)snprintf(esc, sizeof esc, "\\%c", *p);
    else if (*p < 0x20)
      k = (size_t)snprintf(esc, sizeof esc, "\\u%04x", *p);
    else
      esc[0] = (char)*p, k = 1;
    for (size_t i = 0; i < k; i++, o++)
      if (o < cap) out[o] = esc[i];
  }
  if (o < cap) out[o] = '"';
  return o + 1;
}

int amber__tiers_write(amber__err *e, const char *memory, const char *durable) {
  char buf[TIERS_MAX], path[4200];
  size_t o = (size_t)snprintf(buf, sizeof buf, "{\"amber.tiers\": 1, \"durable\": ");
  o = json_string(buf, sizeof buf, o, durable);
  o += (size_t)snprintf(buf + (o < sizeof buf ? o : sizeof buf),
                        o < sizeof buf ? sizeof buf - o : 0, "}\n");
  if (o >= sizeof buf)
    return amber__fail(e, AMBER_EINVAL, "durable path too long: %s", durable);
  snprintf(path, sizeof path, "%s/TIERS", memory);
  /* What a crash left of an earlier write (nothing else removes it from the root of
   * a multi-rank store). */
  DIR *dd = opendir(memory);
  struct dirent *de;
  while (dd && (de = readdir(dd))) {
    size_t len = strlen(de->d_name);
    if (!strncmp(de->d_name, "TIERS.", 6) && len > 10 &&
        !strcmp(de->d_name + len - 4, ".tmp"))
      unlinkat(dirfd(dd), de->d_name, 0);
  }
  if (dd) closedir(dd);
  /* A writer opening the store removes *.tmp files, this one's too: try again. */
  int rc = 0;
  for (int tries = 0; tries < 5; tries++)
    if ((rc = amber__write_file_durable(memory, path, e, buf, o)) != AMBER_ENOENT) break;
  return rc;
}

/* A small JSON reader for the TIERS object: a string, a number, or a value of an
 * unknown key skipped whole. `p` moves past what it read; 0 or -1. */
typedef struct jin {
  const char *p, *end;
} jin;

static void ws(jin *j) {
  while (j->p < j->end &&
         (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r'))
    j->p++;
}

static int hexval(char c) {
  return c >= '0' && c <= '9'   ? c - '0'
         : c >= 'a' && c <= 'f' ? c - 'a' + 10
         : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                : -1;
}

/* A string into out (cap bytes, NUL-terminated; out NULL: skipped). */
static int jstring(jin *j, char *out, size_t cap) {
  size_t o = 0;
  if (j->p >= j->end || *j->p++ != '"') return -1;
  while (j->p < j->end && *j->p != '"') {
    unsigned c = (unsigned char)*j->p++;
    if (c < 0x20) return -1;
    if (c == '\\') {
      if (j->p >= j->end) return -1;
      char x = *j->p++;
      const char *m = strchr("\"\\/bfnrt", x);
      if (x && m) {
        c = (unsigned char)"\"\\/\b\f\n\r\t"[m - "\"\\/bfnrt"];
      } else if (x == 'u' && j->end - j->p >= 4) {
        unsigned u = 0;
        for (int i = 0; i < 4; i++) {
          int h = hexval(*j->p++);
          if (h < 0) return -1;
          u = u * 16 + (unsigned)h;
        }
        if (u == 0 || u >= 0x80) return -1; /* TIERS escapes control characters only */
        c = u;
      } else {
        return -1;
      }
    }
    if (out) {
      if (o + 1 >= cap) return -1;
      out[o++] = (char)c;
    }
  }
  if (j->p >= j->end) return -1;
  j->p++;
  if (out) out[o] = 0;
  return 0;
}

static int jskip(jin *j, int depth) {
  ws(j);
  if (j->p >= j->end || depth > 32) return -1;
  char c = *j->p;
  if (c == '"') return jstring(j, NULL, 0);
  if (c == '{' || c == '[') {
    char close = c == '{' ? '}' : ']';
    j->p++;
    ws(j);
    if (j->p < j->end && *j->p == close) return j->p++, 0;
    for (;;) {
      if (c == '{') {
        ws(j);
        if (jstring(j, NULL, 0)) return -1;
        ws(j);
        if (j->p >= j->end || *j->p++ != ':') return -1;
      }
      if (jskip(j, depth + 1)) return -1;
      ws(j);
      if (j->p >= j->end) return -1;
      if (*j->p == close) return j->p++, 0;
      if (*j->p++ != ',') return -1;
    }
  }
  const char *s = j->p;
  while (j->p < j->end && strchr("+-.0123456789eEtruefalsn", *j->p))
    j->p++;
  return j->p > s ? 0 : -1;
}

int amber__tiers_read(amber__err *e, const char *memory, char **durable) {
  char path[4200];
  *durable = NULL;
  snprintf(path, sizeof path, "%s/TIERS", memory);
  FILE *f = fopen(path, "rb");
  if (!f) {
    if (errno == ENOENT)
      return amber__fail(e, AMBER_ENOENT, "%s records no durable tier (no TIERS file)",
                         memory);
    return amber__fail(e, amber__errno_code(errno), "cannot open %s: %s", path,
                       strerror(errno));
  }
  char *buf = malloc(TIERS_MAX), *out = malloc(TIERS_MAX);
  size_t len = buf ? fread(buf, 1, TIERS_MAX, f) : 0;
  fclose(f);
  if (!buf || !out) {
    free(buf), free(out);
    return amber__fail(e, AMBER_ENOMEM, "out of memory");
  }
  int ok = len < TIERS_MAX, version = 0, have = 0;
  buf[ok ? len : TIERS_MAX - 1] = 0; /* strtol below stops there */
  jin j = {buf, buf + len};
  ws(&j);
  ok = ok && j.p < j.end && *j.p++ == '{';
  ws(&j);
  if (ok && j.p < j.end && *j.p == '}')
    j.p++;
  else
    while (ok) {
      char key[256];
      ws(&j);
      if (jstring(&j, key, sizeof key)) {
        ok = 0;
        break;
      }
      ws(&j);
      ok = j.p < j.end && *j.p++ == ':';
      ws(&j);
      if (!ok) break;
      if (!strcmp(key, "durable")) {
        ok = !jstring(&j, out, TIERS_MAX) && *out;
        have = ok;
      } else if (!strcmp(key, "amber.tiers")) {
        char *end;
        long v = strtol(j.p, &end, 10);
        ok = end > j.p && end <= j.end;
        j.p = end;
        version = (int)v;
      } else {
        ok = !jskip(&j, 0);
      }
      ws(&j);
      if (!ok || j.p >= j.end)
        ok = 0;
      else if (*j.p == '}') {
        j.p++;
        break;
      } else {
        ok = *j.p++ == ',';
      }
    }
  ws(&j);
  ok = ok && j.p == j.end;
  free(buf);
  if (ok && version != 1) {
    free(out);
    return amber__fail(e, AMBER_EFORMAT,
                       "%s: version %d of the TIERS file is unknown (this "
                       "library reads 1)",
                       path, version);
  }
  if (!ok || !have) {
    free(out);
    return amber__fail(e, AMBER_ECORRUPT,
                       "%s is malformed (expected a JSON object with "
                       "\"amber.tiers\": 1 and \"durable\": PATH)",
                       path);
  }
  *durable = out;
  return 0;
}

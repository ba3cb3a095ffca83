/*
 * tpack.c - replicas of a rank's files (docs/FORMAT.md, "Pack"): the files a peer
 * needs to go from one step of a rank store to a later one, framed as one blob
 * (pack); the blob installed into a directory, files first and pointers last
 * (unpack); and what a directory can restore (holdings). The replicator that sends
 * blobs between ranks is the caller's; this file only reads and writes stores.
 *
 * A blob comes from another process, so unpack treats it as hostile: every frame's
 * checksum and name is checked before anything is written (a name is one of the
 * store's own names, so nothing lands outside the directory), and each file's own
 * checks (a checkpoint's header, footer and index checksum, a manifest's checksum
 * and tiling, a pointer's form) pass first too. A damaged blob changes nothing.
 */
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "format.h"
#include "global.h"
#include "tier.h"

#define PK_MAGIC "AMBERPK1"
#define PK_VERSION 1
#define PK_HEADER 32
#define PK_FRAME 16 /* before the name */
#define PK_NAME_MAX 255

/* ---- names ---- */

enum { F_CKPT, F_MANIFEST, F_LATEST, F_GLOBAL };

/* The kind of a frame's name, its rank (-1 for the root) and step; -1 when it is no
 * name a blob may carry. Only the exact forms the stores use are taken. */
static int name_kind(const char *name, int32_t *rank, uint64_t *step) {
  *rank = -1, *step = AMBER_NO_STEP;
  const char *slash = strchr(name, '/');
  if (slash) {
    char dir[16];
    uint32_t r;
    size_t len = (size_t)(slash - name);
    if (len >= sizeof dir) return -1;
    memcpy(dir, name, len);
    dir[len] = 0;
    char again[16];
    if (!amber__parse_rank_name(dir, &r) || r >= AMBER__MF_MAX_WORLD) return -1;
    snprintf(again, sizeof again, "rank-%05u", r);
    if (strcmp(again, dir)) return -1; /* one spelling of each rank */
    *rank = (int32_t)r;
    name = slash + 1;
    if (strchr(name, '/')) return -1;
  }
  if (!strcmp(name, "LATEST")) return F_LATEST;
  if (amber__parse_ckpt_name(name, step)) return F_CKPT;
  if (*rank >= 0) return -1;
  if (!strcmp(name, "GLOBAL")) return F_GLOBAL;
  if (amber__parse_manifest_name(name, step)) return F_MANIFEST;
  return -1;
}

/* ---- pack ---- */

typedef struct frame {
  char name[64];
  uint64_t len;
  const void *data; /* or NULL: a checkpoint file, read from ck */
  amber__ckpt *ck;
} frame;

static uint64_t frame_size(const frame *f) {
  return PK_FRAME + strlen(f->name) + f->len + 8;
}

/* Writes frame `f` at `p`; a checkpoint file's bytes are checked as they are read. */
static int put_frame(uint8_t *p, amber__err *e, const frame *f) {
  size_t nl = strlen(f->name);
  memset(p, 0, PK_FRAME);
  amber__put16(p, (uint16_t)nl);
  amber__put64(p + 8, f->len);
  memcpy(p + PK_FRAME, f->name, nl);
  uint8_t *d = p + PK_FRAME + nl;
  if (f->data) {
    memcpy(d, f->data, (size_t)f->len);
  } else {
    amber__vsrc *v;
    int rc = amber__vsrc_open(&v, e, f->ck);
    for (uint64_t o = 0; !rc;) {
      const void *b;
      size_t n;
      if ((rc = amber__vsrc_pull(v, e, &b, &n)) != 0 || !n) break;
      memcpy(d + o, b, n);
      o += n;
    }
    amber__vsrc_close(v);
    if (rc) return rc;
  }
  amber__put64(d + f->len, amber__xxh3(p, (size_t)(PK_FRAME + nl + f->len)));
  return 0;
}

/* The state id of committed step `want` of rank store `st` (and, for a multi-rank
 * store whose directory holds want's manifest, that manifest in *m, *have_m). */
static int want_state(const char *memory, int32_t rank, amber_store *st, amber__err *e,
                      uint64_t want, uint64_t *state, amber__manifest *m, int *have_m,
                      int *part) {
  *have_m = 0, *part = 1;
  if (rank >= 0) {
    uint64_t g;
    int rc = amber__global_read_latest(memory, e, &g);
    if (rc == 0 && want <= g && amber__global_load_manifest(memory, want, e, m) == 0) {
      *have_m = 1;
      if ((uint32_t)rank >= m->world || !(m->ranks[rank].flags & AMBER__RANK_PRESENT)) {
        *part = 0;
        return 0;
      }
      *state = m->ranks[rank].hash;
      if (m->ranks[rank].step != want)
        return amber__fail(e, AMBER_ECORRUPT,
                           "manifest of step %" PRIu64 " names rank %d's "
                           "step %" PRIu64,
                           want, (int)rank, m->ranks[rank].step);
      return 0;
    }
  }
  uint64_t latest, lstate;
  int rc = amber__store_state(st, e, &latest, &lstate);
  if (rc) return rc;
  if (want > latest)
    return amber__fail(e, AMBER_ENOENT,
                       "step %" PRIu64 " is not committed in %s (its LATEST "
                       "is %" PRIu64 ")",
                       want, st->path, latest);
  if (want == latest) {
    *state = lstate;
    return 0;
  }
  amber__ckpt c;
  if ((rc = amber__ckpt_open(e, st, want, &c)) != 0) return rc;
  *state = c.ftr.state_id;
  amber__ckpt_close(&c);
  return 0;
}

int amber_tier_pack(const char *memory, int32_t rank, uint64_t have, uint64_t want,
                    void **blob, size_t *len) {
  if (!memory || !blob || !len || rank < -1 || want == AMBER_NO_STEP)
    return amber__fail(NULL, AMBER_EINVAL, "amber_tier_pack: bad argument");
  *blob = NULL, *len = 0;
  char path[4200];
  if (rank >= 0)
    snprintf(path, sizeof path, "%s/rank-%05d", memory, (int)rank);
  else
    snprintf(path, sizeof path, "%s", memory);
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY;
  amber_store *st;
  int rc = amber_store_open(&st, path, &so);
  if (rc) return rc;
  amber__err e;
  amber__manifest m;
  int have_m = 0, part = 1;
  uint64_t state = 0;
  amber__ckpt *c = NULL;
  size_t n = 0, nf = 0;
  uint8_t *mbytes = NULL;
  size_t mlen = 0;
  frame *f = NULL;
  rc = want_state(memory, rank, st, &e, want, &state, &m, &have_m, &part);
  if (!rc && part) rc = amber__tier_chain(st, &e, want, state, have, NULL, &c, &n);
  if (!rc && have_m) {
    char mp[4200];
    amber__global_manifest_path(memory, want, mp, sizeof mp);
    rc = amber__read_small(mp, &e, &mbytes, &mlen, (size_t)1 << 32);
  }
  if (!rc && !(f = calloc(n + 3, sizeof *f)))
    rc = amber__fail(&e, AMBER_ENOMEM, "out of memory");
  char prefix[24] = "", line[AMBER__LATEST_MAX];
  uint8_t g[AMBER__GLOBAL_SIZE];
  if (rank >= 0) snprintf(prefix, sizeof prefix, "rank-%05d/", (int)rank);
  for (size_t i = n; !rc && i-- > 0; nf++) { /* oldest first */
    snprintf(f[nf].name, sizeof f[nf].name, "%sckpt-%020" PRIu64 ".amber", prefix,
             c[i].hdr.step);
    f[nf].len = c[i].size, f[nf].ck = &c[i];
  }
  if (!rc && have_m) {
    snprintf(f[nf].name, sizeof f[nf].name, "step-%020" PRIu64 ".manifest", want);
    f[nf].len = mlen, f[nf++].data = mbytes;
  }
  if (!rc && part) {
    snprintf(f[nf].name, sizeof f[nf].name, "%sLATEST", prefix);
    f[nf].len = amber__latest_encode(want, state, line), f[nf++].data = line;
  }
  if (!rc && have_m) {
    amber__global_encode(want, g);
    snprintf(f[nf].name, sizeof f[nf].name, "GLOBAL");
    f[nf].len = sizeof g, f[nf++].data = g;
  }
  uint64_t total = PK_HEADER;
  for (size_t i = 0; !rc && i < nf; i++)
    total += frame_size(&f[i]);
  uint8_t *b = NULL;
  if (!rc && (total > SIZE_MAX || !(b = malloc((size_t)total))))
    rc = amber__fail(&e, AMBER_ENOMEM, "out of memory for a blob of %" PRIu64 " bytes",
                     total);
  if (!rc) {
    memcpy(b, PK_MAGIC, 8);
    amber__put32(b + 8, PK_VERSION);
    amber__put32(b + 12, (uint32_t)nf);
    amber__put64(b + 16, total);
    amber__put64(b + 24, amber__xxh3(b, 24));
  }
  for (size_t i = 0, o = PK_HEADER; !rc && i < nf; o += (size_t)frame_size(&f[i++]))
    rc = put_frame(b + o, &e, &f[i]);
  free(f);
  free(mbytes);
  amber__tier_chain_free(c, n);
  if (have_m) amber__manifest_free(&m);
  amber_store_close(st);
  if (rc) {
    free(b);
    return amber__fail(NULL, rc, "pack of step %" PRIu64 " of %s: %s", want, path, e.msg);
  }
  *blob = b, *len = (size_t)total;
  return 0;
}

/* ---- unpack ---- */

typedef struct uframe {
  char name[PK_NAME_MAX + 1];
  int kind;
  int32_t rank;
  uint64_t step, state; /* a pointer's target; a checkpoint's state id */
  const uint8_t *data;
  uint64_t len;
} uframe;

/* The checks of a checkpoint file that need no reading of its payloads. */
static int check_ckpt(amber__err *e, const uframe *f) {
  amber__header h;
  amber__footer ft;
  if (f->len < AMBER__HEADER_SIZE + AMBER__INDEX_FIXED + AMBER__FOOTER_SIZE)
    return amber__fail(e, AMBER_ECORRUPT, "%s: %" PRIu64 " bytes is too short", f->name,
                       f->len);
  int rc = amber__header_decode(e, f->name, f->data, &h);
  if (!rc)
    rc = amber__footer_decode(e, f->name, f->data + f->len - AMBER__FOOTER_SIZE, f->len,
                              &ft);
  if (!rc && h.step != f->step)
    rc = amber__fail(e, AMBER_ECORRUPT, "%s holds step %" PRIu64, f->name, h.step);
  if (!rc &&
      amber__xxh3(f->data + ft.index_offset, (size_t)ft.index_size) != ft.index_checksum)
    rc = amber__fail(e, AMBER_ECORRUPT, "%s: index checksum mismatch", f->name);
  return rc;
}

/* Parses and checks the whole blob: *out (malloc'd) gets its frames. */
static int parse_blob(amber__err *e, const uint8_t *b, size_t len, uframe **out,
                      size_t *n) {
  *out = NULL, *n = 0;
  if (len < PK_HEADER || memcmp(b, PK_MAGIC, 8) ||
      amber__get64(b + 24) != amber__xxh3(b, 24))
    return amber__fail(e, AMBER_ECORRUPT,
                       "blob: not a pack (bad magic or header checksum)");
  if (amber__get32(b + 8) != PK_VERSION)
    return amber__fail(e, AMBER_EFORMAT,
                       "blob: pack version %u is unknown (this library "
                       "reads %d)",
                       amber__get32(b + 8), PK_VERSION);
  uint32_t count = amber__get32(b + 12);
  if (amber__get64(b + 16) != len || count > (len - PK_HEADER) / (PK_FRAME + 9))
    return amber__fail(e, AMBER_ECORRUPT,
                       "blob: its length or frame count is wrong "
                       "(truncated?)");
  uframe *f = calloc(count ? count : 1, sizeof *f);
  if (!f) return amber__fail(e, AMBER_ENOMEM, "out of memory");
  size_t o = PK_HEADER;
  int rc = 0;
  for (uint32_t i = 0; !rc && i < count; i++) {
    const uint8_t *p = b + o;
    size_t left = len - o;
    uint64_t nl = left >= PK_FRAME ? amber__get16(p) : 0,
             dl = left >= PK_FRAME ? amber__get64(p + 8) : 0;
    if (left < PK_FRAME || amber__get16(p + 2) || amber__get32(p + 4) || !nl ||
        nl > PK_NAME_MAX || dl > left || left - dl < PK_FRAME + nl + 8) {
      rc = amber__fail(e, AMBER_ECORRUPT,
                       "blob: frame %u is malformed or runs past the end", i);
      break;
    }
    uframe *u = &f[i];
    memcpy(u->name, p + PK_FRAME, (size_t)nl);
    u->name[nl] = 0;
    u->data = p + PK_FRAME + nl, u->len = dl;
    if (amber__get64(u->data + dl) != amber__xxh3(p, (size_t)(PK_FRAME + nl + dl))) {
      rc = amber__fail(e, AMBER_ECORRUPT, "blob: frame %u fails its checksum", i);
      break;
    }
    if (strlen(u->name) != nl || (u->kind = name_kind(u->name, &u->rank, &u->step)) < 0) {
      rc = amber__fail(e, AMBER_ECORRUPT, "blob: frame %u has a name no store holds", i);
      break;
    }
    if (u->kind == F_CKPT) {
      rc = check_ckpt(e, u);
      if (!rc) u->state = amber__get64(u->data + u->len - AMBER__FOOTER_SIZE + 32);
    } else if (u->kind == F_MANIFEST) {
      amber__manifest m;
      rc = amber__manifest_decode(e, u->name, u->data, (size_t)u->len, &m);
      if (!rc && m.step != u->step)
        rc = amber__fail(e, AMBER_ECORRUPT, "%s holds step %" PRIu64, u->name, m.step);
      if (!rc) amber__manifest_free(&m);
    } else if (u->kind == F_LATEST) {
      rc = amber__latest_decode(e, u->name, (const char *)u->data, (size_t)u->len,
                                &u->step, &u->state);
    } else {
      rc = amber__global_decode(e, u->name, u->data, (size_t)u->len, &u->step);
    }
    o += PK_FRAME + nl + dl + 8;
  }
  if (!rc && o != len)
    rc = amber__fail(e, AMBER_ECORRUPT, "blob: bytes after its last frame");
  if (rc) {
    free(f);
    return rc;
  }
  *out = f, *n = count;
  return 0;
}

/* Moves a rank store's LATEST (or the store's) to the frame's target once the
 * directory holds its file and whole chain, and never back to an older step. */
static int install_latest(amber__dest *d, amber__err *e, const uframe *u) {
  amber__dview v;
  amber__dview_init(&v, d, u->rank);
  int rc = amber__dview_has(&v, e, u->step, u->state);
  uint64_t cur, cur_state;
  if (rc == 0)
    rc = amber__fail(e, AMBER_EPARENT,
                     "%s names step %" PRIu64 ", whose chain %s/%s does not "
                     "hold whole",
                     u->name, u->step, d->where, v.prefix[0] ? v.prefix : ".");
  if (rc == 1) {
    rc = amber__dview_latest(&v, e, &cur, &cur_state);
    if (rc == 0 && cur > u->step)
      rc = 1; /* newer already */
    else
      rc = amber__dest_put_bytes(d, e, u->name, u->data, (size_t)u->len);
  }
  amber__dview_free(&v);
  return rc < 0 ? rc : 0;
}

static int install_global(amber__dest *d, amber__err *e, const uframe *u) {
  char name[64];
  uint64_t size, cur;
  snprintf(name, sizeof name, "step-%020" PRIu64 ".manifest", u->step);
  amber__err scratch;
  if (d->ops->stat(d, &scratch, name, &size))
    return amber__fail(e, AMBER_EPARENT,
                       "GLOBAL names step %" PRIu64 ", whose manifest %s/%s "
                       "is missing",
                       u->step, d->where, name);
  uint8_t *b;
  size_t len;
  if (amber__dest_get(d, &scratch, "GLOBAL", 4096, &b, &len) == 0) {
    int newer = amber__global_decode(NULL, "GLOBAL", b, len, &cur) == 0 && cur >= u->step;
    free(b);
    if (newer) return 0;
  }
  return amber__dest_put_bytes(d, e, "GLOBAL", u->data, (size_t)u->len);
}

int amber_tier_unpack(const char *dir, const void *blob, size_t len) {
  if (!dir || (!blob && len))
    return amber__fail(NULL, AMBER_EINVAL, "amber_tier_unpack: NULL");
  amber__err e;
  uframe *f;
  size_t n;
  int rc = parse_blob(&e, blob, len, &f, &n);
  amber__dest *d = NULL;
  if (!rc) rc = amber__dest_dir_open(&d, &e, dir, 1);
  /* files first, oldest first as packed (one the directory holds already is kept);
   * then the pointers, GLOBAL last */
  for (int pass = 0; !rc && pass < 3; pass++)
    for (size_t i = 0; !rc && i < n; i++) {
      const uframe *u = &f[i];
      if (pass == 0 && u->kind == F_CKPT) {
        amber__dview v;
        amber__dview_init(&v, d, u->rank);
        rc = amber__dview_has(&v, &e, u->step, u->state);
        amber__dview_free(&v);
        if (rc == 0)
          rc = amber__dest_put_bytes(d, &e, u->name, u->data, (size_t)u->len);
        else if (rc == 1)
          rc = 0;
      } else if (pass == 0 && u->kind == F_MANIFEST) {
        rc = amber__dest_put_bytes(d, &e, u->name, u->data, (size_t)u->len);
      } else if (pass == 1 && u->kind == F_LATEST) {
        rc = install_latest(d, &e, u);
      } else if (pass == 2 && u->kind == F_GLOBAL) {
        rc = install_global(d, &e, u);
      }
    }
  amber__dest_close(d);
  free(f);
  if (rc) return amber__fail(NULL, rc, "unpack into %s: %s", dir, e.msg);
  return 0;
}

/* ---- holdings ---- */

typedef struct hfile {
  uint64_t step, state, parent, parent_state;
  int ok, full, valid;
} hfile;

/* What store `path` can restore: the newest committed step whose chain is whole, and
 * the oldest from which every committed step after it up to that one is. */
static int store_holding(const char *path, int32_t rank, amber_tier_holding *h) {
  memset(h, 0, sizeof *h);
  h->kind = AMBER_TIER_STORE, h->rank = rank;
  h->step = h->oldest = AMBER_NO_STEP;
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY;
  amber_store *st;
  int rc = amber_store_open(&st, path, &so);
  if (rc) return rc;
  uint64_t latest = AMBER_NO_STEP, lstate = 0;
  int has_latest = amber__read_latest(st, NULL, &latest, &lstate) == 0;
  uint64_t *steps = NULL;
  size_t n = 0;
  rc = amber__store_steps(st, NULL, has_latest ? latest : AMBER_NO_STEP, &steps, &n);
  hfile *fs = rc ? NULL : calloc(n ? n : 1, sizeof *fs);
  if (!rc && !fs) rc = amber__fail(NULL, AMBER_ENOMEM, "out of memory");
  for (size_t i = 0; !rc && i < n; i++)
    fs[i].step = steps[i];
  free(steps);
  for (size_t i = 0; !rc && i < n; i++) {
    amber__ckpt c;
    if (amber__ckpt_open(NULL, st, fs[i].step, &c) != 0) continue;
    fs[i].ok = 1, fs[i].state = c.ftr.state_id,
    fs[i].full = c.hdr.kind == AMBER_KIND_FULL;
    fs[i].parent = c.hdr.parent_step, fs[i].parent_state = c.hdr.parent_state;
    amber__ckpt_close(&c);
    if (fs[i].full) {
      fs[i].valid = 1;
      continue;
    }
    for (size_t j = 0; j < i; j++)
      if (fs[j].step == fs[i].parent)
        fs[i].valid = fs[j].valid && fs[j].state == fs[i].parent_state;
  }
  if (has_latest && n && fs[n - 1].step == latest && fs[n - 1].state != lstate)
    fs[n - 1].valid = 0; /* LATEST names another file than the one there */
  size_t top = n;
  while (top > 0 && !fs[top - 1].valid)
    top--;
  if (top > 0) {
    h->step = fs[top - 1].step, h->state = fs[top - 1].state;
    size_t low = top - 1;
    while (low > 0 && fs[low - 1].valid)
      low--;
    h->oldest = fs[low].step;
  }
  free(fs);
  amber_store_close(st);
  return rc;
}

static int cmp_u32(const void *a, const void *b) {
  uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
  return x < y ? -1 : x > y;
}

int amber_tier_holdings(const char *dir, amber_tier_holding **out, size_t *n) {
  if (!dir || !out || !n)
    return amber__fail(NULL, AMBER_EINVAL, "amber_tier_holdings: NULL");
  *out = NULL, *n = 0;
  DIR *dd = opendir(dir);
  if (!dd)
    return amber__fail(NULL, amber__errno_code(errno), "%s: %s", dir, strerror(errno));
  uint32_t *ranks = NULL;
  uint64_t *steps = NULL;
  size_t nr = 0, ns = 0, cr = 0;
  int multi = 0, rc = 0;
  struct dirent *de;
  while (!rc && (de = readdir(dd))) {
    uint32_t r;
    uint64_t s;
    if (amber__parse_manifest_name(de->d_name, &s) || !strcmp(de->d_name, "GLOBAL"))
      multi = 1;
    if (!amber__parse_rank_name(de->d_name, &r)) continue;
    multi = 1;
    if (nr == cr) {
      uint32_t *g = realloc(ranks, (cr = cr ? 2 * cr : 16) * sizeof *g);
      if (!g) {
        rc = amber__fail(NULL, AMBER_ENOMEM, "out of memory");
        break;
      }
      ranks = g;
    }
    ranks[nr++] = r;
  }
  closedir(dd);
  if (!rc && multi) rc = amber__manifest_steps(dir, AMBER_NO_STEP, &steps, &ns);
  amber_tier_holding *h = rc ? NULL : calloc((multi ? nr + ns : 1) + 1, sizeof *h);
  if (!rc && !h) rc = amber__fail(NULL, AMBER_ENOMEM, "out of memory");
  size_t k = 0;
  if (!rc && !multi) rc = store_holding(dir, -1, &h[k++]);
  if (nr) qsort(ranks, nr, sizeof *ranks, cmp_u32);
  for (size_t i = 0; !rc && i < nr; i++) {
    char p[4200];
    amber__global_rank_path(dir, ranks[i], p, sizeof p);
    rc = store_holding(p, (int32_t)ranks[i], &h[k++]);
  }
  uint64_t g = AMBER_NO_STEP;
  if (!rc && ns && amber__global_read_latest(dir, NULL, &g)) g = AMBER_NO_STEP;
  for (size_t i = 0; !rc && i < ns; i++) {
    amber__manifest m;
    if (amber__global_load_manifest(dir, steps[i], NULL, &m))
      continue; /* damaged: not held */
    amber__manifest_free(&m);
    amber_tier_holding *e = &h[k++];
    memset(e, 0, sizeof *e);
    e->kind = AMBER_TIER_MANIFEST, e->rank = -1, e->step = e->oldest = steps[i];
    if (g != AMBER_NO_STEP && steps[i] <= g) e->flags = AMBER_TIER_COMMITTED;
  }
  free(ranks);
  free(steps);
  if (rc) {
    free(h);
    return rc;
  }
  *out = h, *n = k;
  return 0;
}

/*
 * trestore.c - the restore from the fastest tier (docs/DESIGN.md, "Peer replicas and
 * the restore"): every rank reports what its memory directory holds, rank 0 the
 * durable tier's newest step; the ranks agree on the newest step every rank can
 * restore from some tier, the files a memory directory lacks come from the peer
 * whose directory holds them (src/xfer.c) or from the durable tier, and each rank
 * learns where its step is. Every decision is computed by every rank from the same
 * gathered reports, so the ranks agree without a coordinator.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "xfer.h"

/* One rank's report, as every rank reads it. */
typedef struct report {
  int rc;
  const char *msg, *id; /* the directory's identity: host, then the path */
  size_t msg_len, id_len;
  uint32_t nstore, nman;
  const uint8_t *store; /* (i32 rank, u64 step, u64 oldest, u64 step's state id) each */
  const uint8_t *man;   /* u64 step each */
} report;

#define STORE_ENTRY 28

typedef struct restore {
  amber__err err;
  const amber_comm *c;
  const char *memory, *durable;
  report *rep;
  int *leader;         /* the lowest rank sharing each rank's directory */
  uint64_t durable_step; /* D, AMBER_NO_STEP: none */
  uint32_t durable_world;
  /* the step's manifest as far as the decision needs it */
  uint32_t world;
  int repl;            /* it has a replicated tensor: every rank needs rank 0's part */
  uint8_t *present;    /* per rank: it wrote a part */
  uint64_t *mstep;     /* per rank: its part's step in its store */
  uint64_t *mstate;    /* and that step's state id */
  uint32_t *tier;      /* per rank: AMBER_RESTORE_* */
  uint8_t *mbytes;     /* the step's manifest, for the directories that lack it */
  size_t mlen;
} restore;

/* i32 rc, u16 message length, message, u16 id length, id, u32 stores, u32 manifests,
 * the stores, the manifests' steps. */
static int my_report(restore *s, uint8_t **out, size_t *len) {
  char host[256], id[4500];
  amber__host_name(NULL, host, sizeof host);
  snprintf(id, sizeof id, "%.255s\n%.4000s", host, s->memory);
  amber_tier_holding *h = NULL;
  size_t nh = 0, ns = 0, nm = 0;
  int rc = amber_tier_holdings(s->memory, &h, &nh);
  if (rc == AMBER_ENOENT) rc = 0, nh = 0; /* a memory directory lost with its host */
  else if (rc < 0) amber__fail(&s->err, rc, "%s", amber_last_error(NULL));
  if (rc < 0) nh = 0;
  for (size_t i = 0; i < nh; i++) {
    ns += h[i].kind == AMBER_TIER_STORE && h[i].rank >= 0 && h[i].step != AMBER_NO_STEP;
    nm += h[i].kind == AMBER_TIER_MANIFEST;
  }
  size_t ml = rc < 0 ? strnlen(s->err.msg, 1000) : 0, il = strlen(id);
  uint8_t *b = malloc(6 + ml + 2 + il + 8 + STORE_ENTRY * ns + 8 * nm), *p = b;
  if (!b) {
    amber_free(h);
    return amber__fail(&s->err, AMBER_ENOMEM, "out of memory");
  }
  amber__put32(p, (uint32_t)rc), amber__put16(p + 4, (uint16_t)ml);
  memcpy(p + 6, s->err.msg, ml);
  p += 6 + ml;
  amber__put16(p, (uint16_t)il);
  memcpy(p + 2, id, il);
  p += 2 + il;
  amber__put32(p, (uint32_t)ns), amber__put32(p + 4, (uint32_t)nm);
  p += 8;
  for (size_t i = 0; i < nh; i++)
    if (h[i].kind == AMBER_TIER_STORE && h[i].rank >= 0 && h[i].step != AMBER_NO_STEP) {
      amber__put32(p, (uint32_t)h[i].rank), amber__put64(p + 4, h[i].step);
      amber__put64(p + 12, h[i].oldest), amber__put64(p + 20, h[i].state);
      p += STORE_ENTRY;
    }
  for (size_t i = 0; i < nh; i++)
    if (h[i].kind == AMBER_TIER_MANIFEST) amber__put64(p, h[i].step), p += 8;
  amber_free(h);
  *out = b, *len = (size_t)(p - b);
  return 0;
}

static void read_report(const uint8_t *p, report *r) {
  r->rc = (int)amber__get32(p);
  r->msg_len = amber__get16(p + 4), r->msg = (const char *)p + 6;
  p += 6 + r->msg_len;
  r->id_len = amber__get16(p), r->id = (const char *)p + 2;
  p += 2 + r->id_len;
  r->nstore = amber__get32(p), r->nman = amber__get32(p + 4);
  r->store = p + 8;
  r->man = r->store + STORE_ENTRY * (size_t)r->nstore;
}

static int holds_manifest(const report *r, uint64_t step) {
  for (uint32_t i = 0; i < r->nman; i++)
    if (amber__get64(r->man + 8 * i) == step) return 1;
  return 0;
}

/* Whether directory report `r` holds rank q's part of the step (its step in the
 * restorable range of its rank store there; when that is the store's newest step,
 * with the state id the manifest names: a directory that kept the part of a step
 * that a killed job wrote, and a later job wrote again, does not hold it). */
static int holds_part(const restore *s, const report *r, int q) {
  uint64_t step = s->mstep[q];
  for (uint32_t i = 0; i < r->nstore; i++) {
    const uint8_t *e = r->store + STORE_ENTRY * i;
    if ((int)amber__get32(e) == q && amber__get64(e + 12) <= step &&
        step <= amber__get64(e + 4) &&
        (step != amber__get64(e + 4) || amber__get64(e + 20) == s->mstate[q]))
      return 1;
  }
  return 0;
}

/* The ranks whose parts rank r needs: its own (when it wrote one) and rank 0's when
 * the step has a replicated tensor (rank 0 writes those). */
static int needs(const restore *s, int r, int *q) {
  int n = 0;
  if (s->present[r]) q[n++] = r;
  if (s->repl && r != 0 && s->present[0]) q[n++] = 0;
  return n;
}

/* The lowest directory (by its leader) that holds rank q's part of the step; -1 when
 * none does. */
static int holder_of(const restore *s, int q) {
  for (int l = 0; l < s->c->size; l++)
    if (s->leader[l] == l && holds_part(s, &s->rep[l], q)) return l;
  return -1;
}

/* The manifest of `step` from rank `src`, which reads it in `dir`, to every rank (its
 * length, then its bytes): each decodes what the decision needs (world size,
 * whether a tensor is replicated, each rank's part) and keeps the bytes for the
 * directories that lack it. Returns a collective's failure, 1 when `src` could not
 * read it, else 0. */
static int share_manifest(restore *s, int src, const char *dir, uint64_t step) {
  uint8_t hdr[8];
  uint8_t *b = NULL;
  size_t len = 0;
  free(s->mbytes), s->mbytes = NULL, s->mlen = 0, s->world = 0;
  if (s->c->rank == src && amber__global_manifest_bytes(dir, step, NULL, &b, &len, NULL) < 0)
    len = 0;
  amber__put64(hdr, len);
  int crc = s->c->broadcast(s->c->ctx, hdr, sizeof hdr, src);
  if (crc < 0 || !(len = (size_t)amber__get64(hdr))) {
    free(b);
    return crc < 0 ? crc : 1;
  }
  if (s->c->rank != src && !(b = malloc(len))) return AMBER_ENOMEM;
  if ((crc = s->c->broadcast(s->c->ctx, b, len, src)) < 0) {
    free(b);
    return crc;
  }
  amber__manifest m;
  if (amber__manifest_decode(NULL, "the step's manifest", b, len, &m) < 0) {
    free(b);
    return 1;
  }
  s->world = m.world, s->repl = 0;
  for (uint32_t i = 0; i < m.ntensors; i++)
    s->repl |= (m.tensors[i].flags & AMBER_SHARD_REPLICATED) != 0;
  for (uint32_t q = 0; m.world == (uint32_t)s->c->size && q < m.world; q++)
    s->present[q] = (m.ranks[q].flags & AMBER__RANK_PRESENT) != 0, s->mstep[q] = m.ranks[q].step,
    s->mstate[q] = m.ranks[q].hash;
  amber__manifest_free(&m);
  s->mbytes = b, s->mlen = len;
  return 0;
}

/* The tiers of every rank for step `step` from memory; 1 when every rank finds what
 * it needs in memory (or, with `durable_ok`, in the durable tier), else 0. */
static int decide(restore *s, int durable_ok) {
  int q[2];
  for (int r = 0; r < s->c->size; r++) {
    const report *own = &s->rep[s->leader[r]];
    int n = needs(s, r, q), here = 1, found = 1;
    for (int i = 0; i < n; i++) {
      here &= holds_part(s, own, q[i]);
      found &= holder_of(s, q[i]) >= 0;
    }
    s->tier[r] = here ? AMBER_RESTORE_MEMORY : found ? AMBER_RESTORE_PEER
                 : durable_ok ? AMBER_RESTORE_DURABLE : AMBER_RESTORE_NONE;
    if (s->tier[r] == AMBER_RESTORE_NONE) return 0;
  }
  return 1;
}

/* The transfers that fill the directories: for each directory (by its leader) and
 * each part its PEER ranks need that it lacks, one transfer from the lowest
 * directory holding it. In rank order, so that every rank makes the same list. */
static int plan_peers(restore *s, amber__xfer **out, size_t *n) {
  int size = s->c->size, q[2];
  amber__xfer *x = calloc(2 * (size_t)size + 1, sizeof *x);
  if (!x) return AMBER_ENOMEM;
  *n = 0;
  for (int r = 0; r < size; r++) {
    if (s->tier[r] != AMBER_RESTORE_PEER) continue;
    int l = s->leader[r], k = needs(s, r, q);
    for (int i = 0; i < k; i++) {
      if (holds_part(s, &s->rep[l], q[i])) continue;
      int dup = 0;
      for (size_t j = 0; j < *n && !dup; j++) dup = x[j].to == l && x[j].what == q[i];
      if (dup) continue;
      amber__xfer *t = &x[(*n)++];
      t->from = holder_of(s, q[i]), t->to = l, t->what = q[i];
      t->have = AMBER_NO_STEP, t->want = s->mstep[q[i]];
    }
  }
  *out = x;
  return 0;
}

static int pack_part(void *ctx, amber__err *e, const amber__xfer *x, void **blob, size_t *len) {
  restore *s = ctx;
  int rc = amber_tier_pack(s->memory, x->what, x->have, x->want, blob, len);
  return rc < 0 ? amber__fail(e, rc, "packing rank %d's step %llu for rank %d: %s", x->what,
                              (unsigned long long)x->want, x->to, amber_last_error(NULL))
                : 0;
}

static int unpack_part(void *ctx, amber__err *e, const amber__xfer *x, const void *blob,
                       size_t len) {
  restore *s = ctx;
  int rc = amber_tier_unpack(s->memory, blob, len);
  return rc < 0 ? amber__fail(e, rc, "installing rank %d's step %llu from rank %d in %s: %s",
                              x->what, (unsigned long long)x->want, x->from, s->memory,
                              amber_last_error(NULL))
                : 0;
}

/* A directory's leader: the parts its DURABLE ranks need that it lacks, copied from
 * the durable tier (packed there, installed here), each once. */
static int copy_durable(restore *s, uint64_t *bytes) {
  int q[2], me = s->c->rank, rank0 = 0; /* rank 0's part, the one several ranks need */
  if (s->leader[me] != me) return 0;
  for (int r = 0; r < s->c->size; r++) {
    if (s->leader[r] != me || s->tier[r] != AMBER_RESTORE_DURABLE) continue;
    int k = needs(s, r, q);
    for (int i = 0; i < k; i++) {
      if (holds_part(s, &s->rep[me], q[i]) || (q[i] == 0 && rank0)) continue;
      void *blob = NULL;
      size_t len = 0;
      int rc = amber_tier_pack(s->durable, q[i], AMBER_NO_STEP, s->mstep[q[i]], &blob, &len);
      if (rc == 0) rc = amber_tier_unpack(s->memory, blob, len);
      amber_free(blob);
      if (rc < 0)
        return amber__fail(&s->err, rc, "copying rank %d's step %llu from %s to %s: %s", q[i],
                           (unsigned long long)s->mstep[q[i]], s->durable, s->memory,
                           amber_last_error(NULL));
      *bytes += len;
      rank0 |= q[i] == 0;
    }
  }
  return 0;
}

/* Rank 0: the durable tier's newest committed step and its world size, to every rank
 * (AMBER_NO_STEP when there is no durable tier or it holds no step); *zrc gets rank
 * 0's failure to list it, with its message in s->err on every rank. Returns a
 * collective's failure. */
static int durable_newest(restore *s, int *zrc) {
  uint8_t b[16 + 256];
  memset(b, 0, sizeof b);
  amber__put64(b + 4, AMBER_NO_STEP);
  if (s->c->rank == 0 && s->durable) {
    amber_global_step_info *gs = NULL;
    size_t n = 0;
    int rc = amber_global_list(s->durable, &gs, &n);
    if (rc < 0)
      snprintf((char *)b + 16, 256, "the durable tier %.90s: %.130s", s->durable,
               amber_last_error(NULL));
    for (size_t i = n; rc == 0 && i-- > 0;)
      if (!(gs[i].flags & AMBER_CKPT_DAMAGED)) {
        amber__put64(b + 4, gs[i].step), amber__put32(b + 12, gs[i].world_size);
        break;
      }
    amber_free(gs);
    amber__put32(b, (uint32_t)rc);
  }
  int crc = s->c->broadcast(s->c->ctx, b, sizeof b, 0);
  if (crc < 0) return crc;
  s->durable_step = amber__get64(b + 4), s->durable_world = amber__get32(b + 12);
  if ((*zrc = (int)amber__get32(b)) < 0)
    amber__fail(&s->err, *zrc, "rank 0: %.255s", (const char *)b + 16);
  return 0;
}

static int cmp_desc(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? 1 : x > y ? -1 : 0;
}

/* The steps whose manifests some memory directory holds, newest first, once each. */
static int memory_steps(const restore *s, uint64_t **out, size_t *n) {
  size_t total = 0;
  for (int r = 0; r < s->c->size; r++) total += s->rep[r].nman;
  uint64_t *v = malloc((total ? total : 1) * sizeof *v);
  if (!v) return AMBER_ENOMEM;
  size_t k = 0;
  for (int r = 0; r < s->c->size; r++)
    for (uint32_t i = 0; i < s->rep[r].nman; i++) v[k++] = amber__get64(s->rep[r].man + 8 * i);
  qsort(v, k, sizeof *v, cmp_desc);
  size_t u = 0;
  for (size_t i = 0; i < k; i++)
    if (!u || v[u - 1] != v[i]) v[u++] = v[i];
  *out = v, *n = u;
  return 0;
}

/* The agreement: the step and every rank's tier (s->tier), the same on every rank.
 * *step AMBER_NO_STEP when no tier holds a step every rank can restore. */
static int agree_step(restore *s, uint64_t *step) {
  uint64_t *cand = NULL, d = s->durable_step;
  size_t nc = 0;
  *step = AMBER_NO_STEP;
  if (memory_steps(s, &cand, &nc) < 0)
    return amber__fail(&s->err, AMBER_ENOMEM, "out of memory");
  int rc = 0;
  for (size_t i = 0; rc == 0 && i < nc && (d == AMBER_NO_STEP || cand[i] >= d); i++) {
    int holder = 0;
    while (!holds_manifest(&s->rep[holder], cand[i])) holder++;
    if ((rc = share_manifest(s, holder, s->memory, cand[i])) < 0) break;
    if (rc == 0 && s->world == (uint32_t)s->c->size && decide(s, cand[i] == d))
      *step = cand[i];
    rc = rc < 0 ? rc : 0;
    if (*step != AMBER_NO_STEP) break;
  }
  uint64_t newest = nc ? cand[0] : AMBER_NO_STEP;
  free(cand);
  if (rc < 0)
    return amber__fail(&s->err, rc, "restore: a collective failed (%s)", amber_strerror(rc));
  if (*step != AMBER_NO_STEP || (d == AMBER_NO_STEP && newest == AMBER_NO_STEP)) return 0;
  if (d == AMBER_NO_STEP) /* steps held, none whole: not a new job, and nothing to take */
    return amber__fail(&s->err, AMBER_ENOENT, "restore: the memory directories hold steps up "
                       "to %llu, but in none of them does every rank find its part (a host "
                       "lost without a replica, or another world size), and %s",
                       (unsigned long long)newest, s->durable ? "the durable tier holds no "
                       "step" : "there is no durable tier");
  /* every rank from the durable tier's newest step */
  *step = d;
  if ((rc = share_manifest(s, 0, s->durable, d)) < 0)
    return amber__fail(&s->err, rc, "restore: a collective failed (%s)", amber_strerror(rc));
  if (rc > 0)
    return amber__fail(&s->err, AMBER_ECORRUPT, "restore: rank 0 cannot read the manifest "
                       "of step %llu of the durable tier %s", (unsigned long long)d,
                       s->durable);
  for (int r = 0; r < s->c->size; r++) s->tier[r] = AMBER_RESTORE_DURABLE;
  return 0;
}

/* The memory directory's GLOBAL at least `step`, whose manifest it holds now (a path
 * whose copy a crash cut short, or one a restore just filled): by its leader, after
 * what it installed there. */
static int global_forward(restore *s, uint64_t step) {
  uint64_t g;
  if (s->leader[s->c->rank] != s->c->rank) return 0;
  if (!holds_manifest(&s->rep[s->c->rank], step)) { /* parts here, its manifest not */
    char p[4200];
    amber__global_manifest_path(s->memory, step, p, sizeof p);
    int rc = mkdir(s->memory, 0755) < 0 && errno != EEXIST
                 ? amber__fail(&s->err, amber__errno_code(errno), "cannot create %s: %s",
                               s->memory, strerror(errno))
                 : amber__write_file_durable(s->memory, p, &s->err, s->mbytes, s->mlen);
    if (rc < 0) return rc;
  }
  int rc = amber__global_read_latest(s->memory, NULL, &g);
  if (rc == 0 && g >= step) return 0;
  return amber__global_write_latest(s->memory, &s->err, step);
}

int amber_tiers_restore(const char *memory, const char *durable, const amber_comm *comm,
                        const amber_p2p *p2p, amber_tiers_result *out) {
  if (!out) return amber__fail(NULL, AMBER_EINVAL, "amber_tiers_restore: NULL result");
  memset(out, 0, sizeof *out);
  out->step = AMBER_NO_STEP;
  int rc = amber__comm_check(comm, NULL);
  if (rc == 0) rc = amber__p2p_check(p2p, NULL);
  if (rc < 0) return rc;
  if (!memory || !*memory)
    return amber__fail(NULL, AMBER_EINVAL, "amber_tiers_restore: no memory directory");
  restore s;
  memset(&s, 0, sizeof s);
  s.c = comm, s.memory = memory, s.durable = durable && *durable ? durable : NULL;
  size_t n = (size_t)comm->size;
  s.rep = calloc(n, sizeof *s.rep), s.leader = calloc(n, sizeof *s.leader);
  s.present = calloc(n, 1), s.mstep = calloc(n, sizeof *s.mstep);
  s.mstate = calloc(n, sizeof *s.mstate);
  s.tier = calloc(n, sizeof *s.tier);
  uint8_t *mine = NULL, *all = NULL;
  size_t len = 0;
  uint64_t *lens = calloc(2 * n, sizeof *lens);
  int crc = s.rep && s.leader && s.present && s.mstep && s.mstate && s.tier && lens ? 0 : AMBER_ENOMEM;
  if (crc == 0 && (crc = my_report(&s, &mine, &len)) == 0)
    crc = amber__comm_allgatherv(comm, &s.err, mine, len, &all, lens, lens + n);
  free(mine);
  int bad = -1;
  for (size_t r = 0; crc == 0 && r < n; r++) {
    read_report(all + lens[n + r], &s.rep[r]);
    if (s.rep[r].rc < 0 && bad < 0) bad = (int)r;
    s.leader[r] = (int)r;
    for (size_t l = 0; l < r && s.leader[r] == (int)r; l++)
      if (s.rep[l].id_len == s.rep[r].id_len && !memcmp(s.rep[l].id, s.rep[r].id, s.rep[r].id_len))
        s.leader[r] = (int)l;
  }
  uint64_t step = AMBER_NO_STEP, bytes = 0;
  amber__xfer *x = NULL;
  size_t nx = 0;
  int local = 0, zrc = 0;
  if (crc < 0) {
    rc = amber__fail(&s.err, crc, "restore: a collective failed (%s)", amber_strerror(crc));
  } else if (bad >= 0) { /* every rank knows the failure: none goes on */
    rc = amber__fail(&s.err, s.rep[bad].rc, "rank %d: %.*s", bad, (int)s.rep[bad].msg_len,
                     s.rep[bad].msg);
  } else if ((crc = durable_newest(&s, &zrc)) < 0) {
    rc = amber__fail(&s.err, crc, "restore: a collective failed (%s)", amber_strerror(crc));
  } else if (zrc < 0) {
    rc = zrc;
  } else if ((rc = agree_step(&s, &step)) == 0 && step != AMBER_NO_STEP &&
             s.world == (uint32_t)comm->size) {
    /* the memory directories filled: from the peers, then from the durable tier */
    amber__xfer_count cnt = {0, 0};
    if ((rc = plan_peers(&s, &x, &nx)) < 0) {
      rc = amber__fail(&s.err, rc, "out of memory"); /* every rank alike */
    } else {
      uint32_t rounds = amber__xfer_schedule(x, nx);
      rc = amber__xfer_run(p2p, &s.err, comm->rank, x, nx, rounds, pack_part, unpack_part, &s,
                           &local, &cnt);
      bytes = cnt.received;
      if (rc == 0) rc = local;
      if (rc == 0) rc = copy_durable(&s, &bytes);
      if (rc == 0) rc = global_forward(&s, step);
      int broken;
      rc = amber__comm_agree(comm, &s.err, rc, &broken);
    }
  }
  if (rc == 0 && step != AMBER_NO_STEP) {
    out->step = step, out->world_size = s.world, out->fetched_bytes = bytes;
    out->tier = s.tier[comm->rank];
    out->dir = s.world == (uint32_t)comm->size ? memory : durable;
    for (size_t r = 0; r < n; r++) {
      out->ranks_memory += s.tier[r] == AMBER_RESTORE_MEMORY;
      out->ranks_peer += s.tier[r] == AMBER_RESTORE_PEER;
      out->ranks_durable += s.tier[r] == AMBER_RESTORE_DURABLE;
    }
  }
  free(x), free(all), free(lens);
  free(s.rep), free(s.leader), free(s.present), free(s.mstep), free(s.mstate), free(s.tier), free(s.mbytes);
  if (rc < 0) amber__fail(NULL, rc, "%s", s.err.msg);
  return rc;
}

/*
 * replicas.c - peer replicas (docs/DESIGN.md, "Peer replicas and the restore"): after
 * each committed step, every rank sends the files that step added to its rank store
 * to `replicas` peers on other hosts, which keep them in their own memory directory
 * under the sender's rank store (rank-SSSSS/). The peers are a ring over hosts; the
 * transfers go in rounds of sendrecv (src/xfer.c), each file packed by
 * amber_tier_pack and installed by amber_tier_unpack (files first, pointers last),
 * so a crash at any instant leaves each replica at a committed step. An exchange of
 * every rank's outcome ends each step, so every rank returns the same result, and
 * an error stops the replicator for good (sticky).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "xfer.h"

struct amber_replicas {
  amber__err err; /* first: amber_last_error reads it */
  amber_comm comm;
  amber_p2p p2p;
  char *memory;
  uint64_t keep_last;
  int sticky;      /* the error that stopped the replicator, 0 while it runs */
  amber__xfer *x;  /* every rank's transfers (the ring), scheduled */
  size_t nx;
  uint32_t rounds;
  int *peers;      /* this rank's receivers, k = 1, 2, ... */
  size_t npeers;
  amber_replicas_stats stats;
};

void amber_replicas_opts_init(amber_replicas_opts *o) {
  memset(o, 0, sizeof *o);
}

void amber_replicas_close(amber_replicas *r) {
  if (!r) return;
  free(r->memory);
  free(r->x);
  free(r->peers);
  free(r);
}

/* The ring over hosts (amber_replicas_open's rule) as transfers, k = 1 first: with
 * hosts of one size each k is a permutation of the ranks, one round. `hosts` holds
 * every rank's host name, rank order. */
static int make_ring(amber_replicas *r, char **hosts, uint32_t replicas) {
  int size = r->comm.size, nh = 0;
  size_t sz = (size_t)size;
  /* host[q]: its host, numbered by lowest rank; host h's ranks are order[first[h] ..
   * first[h + 1]), in rank order, and rank q is the idx[q]-th of them */
  int *host = malloc(sz * sizeof *host), *order = malloc(sz * sizeof *order);
  int *first = calloc(sz + 1, sizeof *first), *next = malloc(sz * sizeof *next);
  int *idx = malloc(sz * sizeof *idx);
  int rc = host && order && first && next && idx ? 0 : AMBER_ENOMEM;
  for (int q = 0; rc == 0 && q < size; q++) {
    host[q] = -1;
    for (int p = 0; p < q && host[q] < 0; p++)
      if (!strcmp(hosts[p], hosts[q])) host[q] = host[p];
    if (host[q] < 0) host[q] = nh++;
    first[host[q] + 1]++;
  }
  for (int h = 0; rc == 0 && h < nh; h++) first[h + 1] += first[h], next[h] = first[h];
  for (int q = 0; rc == 0 && q < size; q++) {
    idx[q] = next[host[q]] - first[host[q]];
    order[next[host[q]]++] = q;
  }
  uint32_t k_max = nh > 1 ? (replicas < (uint32_t)(nh - 1) ? replicas : (uint32_t)(nh - 1)) : 0;
  if (rc == 0) {
    r->x = calloc(sz * k_max + 1, sizeof *r->x);
    r->peers = calloc((size_t)k_max + 1, sizeof *r->peers);
    if (!r->x || !r->peers) rc = AMBER_ENOMEM;
  }
  for (uint32_t k = 1; rc == 0 && k <= k_max; k++)
    for (int q = 0; q < size; q++) {
      int h = (host[q] + (int)k) % nh, n = first[h + 1] - first[h];
      amber__xfer *t = &r->x[r->nx++];
      t->from = q, t->to = order[first[h] + idx[q] % n], t->what = q;
      t->have = t->want = AMBER_NO_STEP;
      if (q == r->comm.rank) r->peers[r->npeers++] = t->to;
    }
  if (rc == 0) r->rounds = amber__xfer_schedule(r->x, r->nx);
  free(host), free(order), free(first), free(next), free(idx);
  return rc < 0 ? amber__fail(&r->err, rc, "replicas: out of memory") : 0;
}

/* This rank's report at open, for each transfer it receives: the step and state id
 * of the replica its memory directory holds of the sender (u32 transfer, u64 step,
 * u64 state each), so that the sender packs only what the replica lacks. */
static int held_replicas(amber_replicas *r, uint8_t **out, size_t *len) {
  amber_tier_holding *h = NULL;
  size_t nh = 0, n = 0;
  int rc = amber_tier_holdings(r->memory, &h, &nh);
  if (rc == AMBER_ENOENT) rc = 0, nh = 0;
  if (rc < 0) return amber__fail(&r->err, rc, "%s", amber_last_error(NULL));
  uint8_t *b = malloc(20 * r->nx + 1);
  if (!b) {
    amber_free(h);
    return amber__fail(&r->err, AMBER_ENOMEM, "replicas: out of memory");
  }
  for (size_t i = 0; i < r->nx; i++) {
    if (r->x[i].to != r->comm.rank) continue;
    for (size_t j = 0; j < nh; j++)
      if (h[j].kind == AMBER_TIER_STORE && h[j].rank == r->x[i].what &&
          h[j].step != AMBER_NO_STEP) {
        amber__put32(b + 20 * n, (uint32_t)i);
        amber__put64(b + 20 * n + 4, h[j].step), amber__put64(b + 20 * n + 12, h[j].state);
        n++;
      }
  }
  amber_free(h);
  *out = b, *len = 20 * n;
  return 0;
}

/* This rank's own store, read-only (the writer beside the replicator is its only
 * writer): AMBER_ENOENT while this rank has written nothing. */
static int open_own(amber_replicas *r, amber_store **st) {
  char dir[4200];
  amber__global_rank_path(r->memory, (uint32_t)r->comm.rank, dir, sizeof dir);
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY;
  return amber_store_open(st, dir, &so);
}

/* Whether this rank's own store holds committed step `step` with state id `state`:
 * then a peer's replica at that step needs only what came after it. */
static int own_has(amber_replicas *r, uint64_t step, uint64_t state) {
  amber_store *st;
  if (open_own(r, &st) < 0) return 0;
  int has = amber__ckpt_has_state(st, step, state);
  amber_store_close(st);
  return has;
}

/* Open's exchange of the replicas the peers hold: each sender's transfers start
 * from them. Collective (one allgather of blobs). */
static int learn_have(amber_replicas *r, int rc) {
  uint8_t *mine = NULL, *all = NULL;
  size_t len = 0;
  if (rc == 0) rc = held_replicas(r, &mine, &len);
  uint64_t *lens = calloc(2 * (size_t)r->comm.size, sizeof *lens);
  int crc = lens ? amber__comm_allgatherv(&r->comm, &r->err, mine, rc == 0 ? len : 0, &all,
                                          lens, lens + r->comm.size)
                 : AMBER_ENOMEM;
  free(mine);
  for (int q = 0; crc == 0 && q < r->comm.size; q++)
    for (uint64_t o = 0; o + 20 <= lens[q]; o += 20) {
      const uint8_t *p = all + lens[r->comm.size + q] + o;
      uint32_t i = amber__get32(p);
      if (i >= r->nx || r->x[i].from != r->comm.rank || r->x[i].to != q) continue;
      uint64_t step = amber__get64(p + 4), state = amber__get64(p + 12);
      if (own_has(r, step, state)) r->x[i].have = step;
    }
  free(all), free(lens);
  if (crc < 0) return amber__fail(&r->err, crc, "replicas: a collective failed (%s)",
                                  amber_strerror(crc));
  return rc;
}

int amber_replicas_open(amber_replicas **out, const char *memory, const amber_comm *comm,
                        const amber_p2p *p2p, uint32_t replicas,
                        const amber_replicas_opts *opts) {
  *out = NULL;
  int rc = amber__comm_check(comm, NULL);
  if (rc == 0) rc = amber__p2p_check(p2p, NULL);
  if (rc < 0) return rc;
  if (!memory || !*memory) return amber__fail(NULL, AMBER_EINVAL, "replicas: no memory directory");
  if (opts && (opts->flags || opts->reserved0 || opts->reserved[0] || opts->reserved[1] ||
               opts->reserved[2] || opts->reserved[3]))
    return amber__fail(NULL, AMBER_EINVAL, "replicas: reserved option set");
  amber_replicas *r = calloc(1, sizeof *r);
  if (!r || !(r->memory = strdup(memory))) {
    free(r);
    return amber__fail(NULL, AMBER_ENOMEM, "out of memory");
  }
  r->comm = *comm, r->p2p = *p2p;
  r->keep_last = opts && opts->keep_last ? opts->keep_last : 2;
  r->stats.step = AMBER_NO_STEP;
  char host[256];
  amber__host_name(opts ? opts->host : NULL, host, sizeof host);
  uint8_t *all = NULL;
  uint64_t *lens = calloc(2 * (size_t)comm->size, sizeof *lens);
  char **hosts = calloc((size_t)comm->size, sizeof *hosts);
  int crc = lens && hosts ? amber__comm_allgatherv(comm, &r->err, host, strlen(host), &all, lens,
                                                  lens + comm->size)
                          : AMBER_ENOMEM;
  for (int q = 0; crc == 0 && q < comm->size; q++) {
    if (!(hosts[q] = malloc(lens[q] + 1))) {
      rc = amber__fail(&r->err, AMBER_ENOMEM, "out of memory");
      break;
    }
    memcpy(hosts[q], all + lens[comm->size + q], lens[q]);
    hosts[q][lens[q]] = 0;
  }
  if (crc == 0 && rc == 0) rc = make_ring(r, hosts, replicas);
  for (int q = 0; hosts && q < comm->size; q++) free(hosts[q]);
  free(hosts), free(all), free(lens);
  if (crc < 0) { /* nothing more can be agreed */
    amber__fail(&r->err, crc, "replicas: a collective failed (%s)", amber_strerror(crc));
    amber__err_adopt(&r->err);
    amber_replicas_close(r);
    return crc;
  }
  int broken;
  rc = learn_have(r, rc);
  rc = amber__comm_agree(&r->comm, &r->err, rc, &broken);
  if (rc < 0) {
    amber__err_adopt(&r->err);
    amber_replicas_close(r);
    return rc;
  }
  *out = r;
  return 0;
}

int amber_replicas_peers(const amber_replicas *r, int *peers, size_t cap, size_t *n) {
  if (!r || !n || (cap && !peers))
    return amber__fail(NULL, AMBER_EINVAL, "amber_replicas_peers: NULL argument");
  for (size_t i = 0; i < r->npeers && i < cap; i++) peers[i] = r->peers[i];
  *n = r->npeers;
  return 0;
}

int amber_replicas_stats_get(const amber_replicas *r, amber_replicas_stats *out) {
  if (!r || !out)
    return amber__fail(NULL, AMBER_EINVAL, "amber_replicas_stats_get: NULL argument");
  *out = r->stats;
  return 0;
}

/* The newest committed step of this rank's store at or before `step` (AMBER_NO_STEP:
 * none): its file of `step`, or of its last step before it when it wrote none for
 * `step` (a rank without tensors or metadata of its own writes none). */
static int own_want(amber_replicas *r, uint64_t step, uint64_t *want) {
  amber_store *st;
  *want = AMBER_NO_STEP;
  int rc = open_own(r, &st);
  if (rc == AMBER_ENOENT) return 0; /* this rank wrote no file yet */
  if (rc < 0) return amber__fail(&r->err, rc, "%s", amber_last_error(NULL));
  amber_ckpt_info *info = NULL;
  size_t n = 0;
  rc = amber_store_list(st, &info, &n);
  if (rc < 0) amber__fail(&r->err, rc, "%s", amber_last_error(st));
  for (size_t i = 0; rc == 0 && i < n; i++)
    if (info[i].step <= step) *want = info[i].step;
  amber_free(info);
  amber_store_close(st);
  return rc;
}

typedef struct step_ctx {
  amber_replicas *r;
  uint64_t want; /* this rank's files' step, AMBER_NO_STEP: none */
} step_ctx;

static int pack_own(void *ctx, amber__err *e, const amber__xfer *x, void **blob, size_t *len) {
  step_ctx *c = ctx;
  *blob = NULL, *len = 0;
  if (c->want == AMBER_NO_STEP || c->want == x->have) return 0; /* nothing new */
  int rc = amber_tier_pack(c->r->memory, c->r->comm.rank, x->have, c->want, blob, len);
  return rc < 0 ? amber__fail(e, rc, "packing step %llu for rank %d: %s",
                              (unsigned long long)c->want, x->to, amber_last_error(NULL))
                : 0;
}

/* Installs what rank x->what sent, then keeps the newest keep_last steps of its
 * replica (and what their restores need). */
static int unpack_replica(void *ctx, amber__err *e, const amber__xfer *x, const void *blob,
                          size_t len) {
  amber_replicas *r = ((step_ctx *)ctx)->r;
  if (!len) return 0;
  int rc = amber_tier_unpack(r->memory, blob, len);
  if (rc < 0)
    return amber__fail(e, rc, "installing rank %d's files in %s: %s", x->what, r->memory,
                       amber_last_error(NULL));
  char dir[4200];
  amber__global_rank_path(r->memory, (uint32_t)x->what, dir, sizeof dir);
  amber_store *st;
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_NOCREATE;
  rc = amber_store_open(&st, dir, &so);
  if (rc == 0) {
    if ((rc = amber_store_prune(st, r->keep_last, NULL)) < 0)
      amber__fail(e, rc, "%s", amber_last_error(st));
    amber_store_close(st);
  } else {
    amber__fail(e, rc, "%s", amber_last_error(NULL));
  }
  return rc;
}

int amber_replicas_step(amber_replicas *r, uint64_t step) {
  if (!r) return amber__fail(NULL, AMBER_EINVAL, "amber_replicas_step: NULL replicator");
  if (r->sticky) return amber__fail(&r->err, r->sticky, "%s", r->err.msg);
  if (r->stats.step != AMBER_NO_STEP && step <= r->stats.step)
    return amber__fail(&r->err, AMBER_EINVAL, "replicas: step %llu is not after step %llu",
                       (unsigned long long)step, (unsigned long long)r->stats.step);
  double t0 = amber__now();
  step_ctx c = {r, AMBER_NO_STEP};
  int rc = own_want(r, step, &c.want), local = 0;
  amber__xfer_count cnt = {0, 0};
  /* a rank that cannot say what it has still goes through every round, sending
   * nothing, so that the others do not wait for it */
  if (rc < 0) c.want = AMBER_NO_STEP;
  int xrc = amber__xfer_run(&r->p2p, &r->err, r->comm.rank, r->x, r->nx, r->rounds, pack_own,
                            unpack_replica, &c, &local, &cnt);
  if (rc == 0) rc = xrc < 0 ? xrc : local;
  if (rc < 0) {
    char m[sizeof r->err.msg];
    snprintf(m, sizeof m, "%s", r->err.msg);
    amber__fail(&r->err, rc, "step %llu: %s", (unsigned long long)step, m);
  }
  int broken;
  rc = amber__comm_agree(&r->comm, &r->err, rc, &broken);
  if (rc < 0) {
    r->sticky = rc;
    if (broken)
      amber__fail(&r->err, rc, "replicas: step %llu: a collective failed (%s)",
                  (unsigned long long)step, amber_strerror(rc));
    return amber__fail(&r->err, rc, "%s (replication stopped)", r->err.msg);
  }
  for (size_t i = 0; i < r->nx; i++)
    if (r->x[i].from == r->comm.rank && c.want != AMBER_NO_STEP) r->x[i].have = c.want;
  r->stats.step = step;
  r->stats.sent_bytes = cnt.sent, r->stats.received_bytes = cnt.received;
  r->stats.total_sent += cnt.sent, r->stats.total_received += cnt.received;
  r->stats.seconds = amber__now() - t0;
  return 0;
}

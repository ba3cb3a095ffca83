/*
 * comm.c - the collectives that many-rank saves need, over the job's own
 * communicator (amber_comm): the trivial one-rank communicator and an allgather of
 * blobs of any length built from the fixed-length allgather the interface asks of
 * an engine, so that engines implement as little as possible; and the check of a
 * caller's point-to-point exchange (amber_p2p).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "global.h"

static int self_allgather(void *ctx, const void *send, size_t len, void *recv) {
  (void)ctx;
  if (len) memcpy(recv, send, len);
  return 0;
}

static int self_broadcast(void *ctx, void *buf, size_t len, int root) {
  (void)ctx, (void)buf, (void)len;
  return root == 0 ? 0 : AMBER_EINVAL;
}

static int self_barrier(void *ctx) {
  (void)ctx;
  return 0;
}

static const amber_comm comm_self = {0, 1, self_allgather, self_broadcast, self_barrier,
                                     NULL, AMBER_COMM_ANY_THREAD, {0}};

const amber_comm *amber_comm_self(void) {
  return &comm_self;
}

int amber__comm_check(const amber_comm *c, amber__err *e) {
  if (!c || !c->allgather || !c->broadcast || !c->barrier || c->size < 1 || c->rank < 0 ||
      c->rank >= c->size || (uint32_t)c->size > AMBER__MF_MAX_WORLD)
    return amber__fail(e, AMBER_EINVAL, "invalid communicator (rank %d of %d)",
                       c ? c->rank : -1, c ? c->size : 0);
  if (c->flags & ~(uint64_t)AMBER_COMM_ANY_THREAD)
    return amber__fail(e, AMBER_EINVAL, "communicator: unknown flags 0x%llx",
                       (unsigned long long)c->flags);
  for (int i = 0; i < 3; i++)
    if (c->reserved[i])
      return amber__fail(e, AMBER_EINVAL, "communicator: reserved fields must be zero");
  return 0;
}

int amber__p2p_check(const amber_p2p *p, amber__err *e) {
  if (!p || !p->sendrecv)
    return amber__fail(e, AMBER_EINVAL, "invalid point-to-point exchange (no sendrecv)");
  if (p->flags & ~(uint64_t)AMBER_COMM_ANY_THREAD)
    return amber__fail(e, AMBER_EINVAL, "point-to-point exchange: unknown flags 0x%llx",
                       (unsigned long long)p->flags);
  for (int i = 0; i < 3; i++)
    if (p->reserved[i])
      return amber__fail(e, AMBER_EINVAL,
                         "point-to-point exchange: reserved fields must be zero");
  return 0;
}

int amber__comm_allgatherv(const amber_comm *c, amber__err *e, const void *send, size_t len,
                           uint8_t **out, uint64_t *lens, uint64_t *offs) {
  size_t n = (size_t)c->size;
  uint8_t mine[8];
  uint8_t *all = malloc(n * 8);
  if (!all) return amber__fail(e, AMBER_ENOMEM, "allgather: out of memory");
  amber__put64(mine, len);
  int rc = c->allgather(c->ctx, mine, 8, all);
  if (rc < 0) {
    free(all);
    return amber__fail(e, rc, "allgather of sizes failed (%s)", amber_strerror(rc));
  }
  uint64_t max = 0, total = 0;
  for (size_t r = 0; r < n; r++) {
    lens[r] = amber__get64(all + 8 * r);
    offs[r] = total;
    total += lens[r];
    if (lens[r] > max) max = lens[r];
  }
  free(all);
  if (max > (UINT64_C(1) << 32) || max * n > (UINT64_C(1) << 34))
    return amber__fail(e, AMBER_ERANGE, "allgather: blobs too large (%llu bytes)",
                       (unsigned long long)max);
  uint8_t *pad = calloc(1, max ? max : 1);
  uint8_t *recv = malloc(max * n + 1);
  uint8_t *res = malloc(total + 1);
  if (!pad || !recv || !res) {
    free(pad), free(recv), free(res);
    return amber__fail(e, AMBER_ENOMEM, "allgather: out of memory");
  }
  if (len) memcpy(pad, send, len);
  rc = c->allgather(c->ctx, pad, max, recv);
  free(pad);
  if (rc < 0) {
    free(recv), free(res);
    return amber__fail(e, rc, "allgather failed (%s)", amber_strerror(rc));
  }
  for (size_t r = 0; r < n; r++)
    if (lens[r]) memcpy(res + offs[r], recv + r * max, lens[r]);
  free(recv);
  *out = res;
  return 0;
}

int amber__comm_agree(const amber_comm *c, amber__err *e, int rc, int *broken) {
  char msg[AMBER__ERRLEN];
  if (broken) *broken = 0;
  if (rc < 0) { /* this rank's reason, named as the other ranks name it */
    snprintf(msg, sizeof msg, "%s", e->msg);
    amber__fail(e, rc, "rank %d: %s", c->rank, msg);
  }
  size_t ml = rc < 0 ? strlen(e->msg) : 0;
  uint8_t *mine = malloc(4 + ml), *all = NULL;
  uint64_t *lens = calloc((size_t)c->size * 2, sizeof *lens);
  int crc = mine && lens ? 0 : AMBER_ENOMEM;
  if (crc == 0) {
    amber__put32(mine, (uint32_t)rc);
    memcpy(mine + 4, e->msg, ml);
    crc = amber__comm_allgatherv(c, e, mine, 4 + ml, &all, lens, lens + c->size);
  }
  free(mine);
  if (crc < 0) {
    free(lens);
    if (broken) *broken = 1;
    return crc;
  }
  const uint64_t *offs = lens + c->size;
  int brc = 0;
  for (int r = 0; r < c->size && brc == 0; r++) {
    if (lens[r] < 4) continue;
    brc = (int)amber__get32(all + offs[r]);
    if (brc < 0 && r != c->rank)
      amber__fail(e, brc, "%.*s", (int)(lens[r] - 4), (const char *)all + offs[r] + 4);
  }
  free(all);
  free(lens);
  return brc < 0 ? brc : 0;
}

/*
 * xfer.c - moving a rank's packed files to other ranks (src/xfer.h): the host of a
 * rank, the schedule of transfers in rounds, and one rank's run of a schedule over
 * an amber_p2p. The peer replicas and the restore from the tiers both move files
 * this way; what they pack and where they install it is theirs.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "xfer.h"

void amber__host_name(const char *given, char *buf, size_t len) {
  const char *env = getenv("AMBER_HOST");
  if (given && *given) snprintf(buf, len, "%s", given);
  else if (env && *env) snprintf(buf, len, "%s", env);
  else if (gethostname(buf, len) != 0) snprintf(buf, len, "(unknown host)");
  buf[len - 1] = 0;
}

/* busy[rank * cap + round]: bit 0 the rank sends in that round, bit 1 it receives. */
typedef struct busy_rounds {
  uint8_t *busy;
  size_t ranks, cap;
} busy_rounds;

static int grow(busy_rounds *r, size_t need) {
  if (need <= r->cap) return 0;
  size_t cap = r->cap ? 2 * r->cap : 8;
  while (cap < need) cap *= 2;
  uint8_t *b = calloc(r->ranks * cap, 1);
  if (!b) return -1;
  for (size_t k = 0; k < r->ranks; k++)
    if (r->cap) memcpy(b + k * cap, r->busy + k * r->cap, r->cap);
  free(r->busy);
  r->busy = b, r->cap = cap;
  return 0;
}

uint32_t amber__xfer_schedule(amber__xfer *x, size_t n) {
  busy_rounds r = {NULL, 0, 0};
  for (size_t i = 0; i < n; i++) {
    if ((size_t)x[i].from + 1 > r.ranks) r.ranks = (size_t)x[i].from + 1;
    if ((size_t)x[i].to + 1 > r.ranks) r.ranks = (size_t)x[i].to + 1;
  }
  uint32_t total = 0;
  for (size_t i = 0; i < n; i++) {
    uint32_t k = 0;
    for (;; k++) {
      if (grow(&r, (size_t)k + 1) < 0) { /* out of memory: one transfer per round */
        for (size_t j = 0; j < n; j++) x[j].round = (uint32_t)j;
        free(r.busy);
        return (uint32_t)n;
      }
      if (!(r.busy[(size_t)x[i].from * r.cap + k] & 1) &&
          !(r.busy[(size_t)x[i].to * r.cap + k] & 2))
        break;
    }
    r.busy[(size_t)x[i].from * r.cap + k] |= 1;
    r.busy[(size_t)x[i].to * r.cap + k] |= 2;
    x[i].round = k;
    if (k + 1 > total) total = k + 1;
  }
  free(r.busy);
  return total;
}

int amber__xfer_run(const amber_p2p *p, amber__err *e, int me, const amber__xfer *x, size_t n,
                    uint32_t rounds, amber__pack_fn pack, amber__unpack_fn unpack, void *ctx,
                    int *local, amber__xfer_count *count) {
  amber__err scratch; /* the messages of failures after the first */
  *local = 0;
  for (uint32_t k = 0; k < rounds; k++) {
    const amber__xfer *out = NULL, *in = NULL;
    for (size_t i = 0; i < n; i++)
      if (x[i].round == k) {
        if (x[i].from == me) out = &x[i];
        if (x[i].to == me) in = &x[i];
      }
    if (!out && !in) continue;
    void *blob = NULL;
    size_t len = 0;
    int sends = 0; /* a sender that could not pack says so, and sends no bytes */
    if (out) {
      int rc = pack(ctx, *local ? &scratch : e, out, &blob, &len);
      if (rc < 0 && !*local) *local = rc;
      if (rc < 0) amber_free(blob), blob = NULL, len = 0;
      sends = rc == 0;
    }
    uint8_t ssz[8], rsz[8];
    amber__put64(ssz, sends ? (uint64_t)len : UINT64_MAX);
    int rc = p->sendrecv(p->ctx, ssz, out ? 8 : 0, out ? out->to : AMBER_P2P_NONE, rsz,
                         in ? 8 : 0, in ? in->from : AMBER_P2P_NONE);
    uint64_t rlen = in && rc == 0 ? amber__get64(rsz) : 0;
    int gets = in && rc == 0 && rlen != UINT64_MAX;
    void *rb = NULL;
    if (gets && (rlen > SIZE_MAX - 1 || !(rb = malloc((size_t)rlen + 1)))) rc = AMBER_ENOMEM;
    if (rc == 0 && (sends || gets))
      rc = p->sendrecv(p->ctx, blob, sends ? len : 0, sends ? out->to : AMBER_P2P_NONE, rb,
                       gets ? (size_t)rlen : 0, gets ? in->from : AMBER_P2P_NONE);
    amber_free(blob);
    if (rc < 0) {
      char who[64];
      if (out && in && out->to != in->from)
        snprintf(who, sizeof who, "ranks %d and %d", out->to, in->from);
      else snprintf(who, sizeof who, "rank %d", out ? out->to : in->from);
      free(rb);
      return amber__fail(e, rc, "the exchange with %s failed (%s)", who, amber_strerror(rc));
    }
    if (sends) count->sent += len;
    if (gets) {
      count->received += rlen;
      int urc = unpack(ctx, *local ? &scratch : e, in, rb, (size_t)rlen);
      if (urc < 0 && !*local) *local = urc;
    }
    free(rb);
  }
  return 0;
}

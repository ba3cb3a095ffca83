/*
 * xfer.h - moving a rank's packed files to other ranks, for the peer replicas
 * (src/replicas.c) and the restore from the tiers (src/trestore.c): this rank's
 * host, a schedule of transfers in rounds where each rank sends to at most one rank
 * and receives from at most one, and the run of a schedule over an amber_p2p. Not
 * part of the public API.
 */
#ifndef AMBER_XFER_H
#define AMBER_XFER_H

#include "global.h"

/* One transfer: rank `from` sends `what`'s files (the caller's meaning) to rank
 * `to`. */
typedef struct amber__xfer {
  int from, to;
  int32_t what;
  uint64_t have, want; /* the caller's: what to pack */
  uint32_t round;      /* set by amber__xfer_schedule */
} amber__xfer;

/* This rank's host into buf: `given` when not NULL, else the environment's
 * AMBER_HOST (tests: each simulated host a process), else gethostname(). */
void amber__host_name(const char *given, char *buf, size_t len);

/* Gives every transfer a round: in the array's order, the first round in which its
 * sender sends nothing yet and its receiver receives nothing yet (a greedy edge
 * colouring: at most 2D - 1 rounds for D transfers per rank at most; D rounds for a
 * ring). Deterministic: the same array gives the same rounds on every rank.
 * Returns the number of rounds. */
uint32_t amber__xfer_schedule(amber__xfer *x, size_t n);

/* Packs the files of transfer `x` as one blob (*blob released with amber_free). */
typedef int (*amber__pack_fn)(void *ctx, amber__err *e, const amber__xfer *x, void **blob,
                              size_t *len);
/* Installs the blob of transfer `x`. */
typedef int (*amber__unpack_fn)(void *ctx, amber__err *e, const amber__xfer *x,
                                const void *blob, size_t len);

typedef struct amber__xfer_count {
  uint64_t sent, received; /* bytes of blobs */
} amber__xfer_count;

/* Runs rank `me`'s part of the scheduled transfers: in each round where it sends or
 * receives, it packs what it sends, then exchanges the sizes (u64 each way; a
 * sender that could not pack sends UINT64_MAX and no bytes) and the bytes with one
 * sendrecv each, and installs what it received. Every rank goes through the same
 * rounds, so no round waits on a rank that is elsewhere. A pack or unpack failure
 * is this rank's: the first one goes to *local (message in e) and the rounds go on;
 * a sendrecv failure ends the run (returned: the exchange is broken). An empty blob
 * (nothing to send) travels as such; unpack gets len 0 for it. */
int amber__xfer_run(const amber_p2p *p, amber__err *e, int me, const amber__xfer *x, size_t n,
                    uint32_t rounds, amber__pack_fn pack, amber__unpack_fn unpack, void *ctx,
                    int *local, amber__xfer_count *count);

#endif /* AMBER_XFER_H */

/*
 * cadence.h - internal: when the writer's next save is a full checkpoint rather
 * than a delta (docs/DESIGN.md, "Cadence"). The cadence decides from counters of
 * the chain since the last full (how many deltas, how many bytes, the full's
 * size) and a back-off after dense deltas; the writer records each committed save
 * and, on resuming, has it learn the counters from the latest checkpoint's chain.
 */
#ifndef AMBER_CADENCE_H
#define AMBER_CADENCE_H

#include <stdint.h>

/* full_share when the options leave it 0 */
#define AMBER__DEFAULT_FULL_SHARE 0.5

typedef struct amber__cadence {
  uint32_t full_every; /* deltas between fulls at most (UINT32_MAX: no limit) */
  double full_share;   /* a full once the deltas' bytes reach this share of it */
  uint64_t deltas_since_full, bytes_since_full, last_full_bytes;
  uint32_t dense_backoff, fulls_to_go; /* dense deltas: fulls before the next try */
  int known; /* the counters describe the store's latest chain */
} amber__cadence;

/* Options as resolved by amber_writer_open (defaults applied). */
void amber__cadence_init(amber__cadence *c, uint32_t full_every, double full_share);
/* Sets the counters from the latest checkpoint's chain: `full_bytes`, the size
 * of its full checkpoint (0: unknown), and `deltas` files of `delta_bytes` in
 * all since. */
void amber__cadence_learn(amber__cadence *c, uint64_t full_bytes, uint64_t deltas,
                          uint64_t delta_bytes);
/* 1 when the cadence asks for a full save next (counters must be known). */
int amber__cadence_decide(const amber__cadence *c);
/* Records a committed save: a delta (delta != 0) or a full of `bytes` bytes. */
void amber__cadence_record(amber__cadence *c, int delta, uint64_t bytes);

#endif /* AMBER_CADENCE_H */

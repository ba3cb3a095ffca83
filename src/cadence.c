/*
 * cadence.c - the writer's choice between a full checkpoint and a delta (see
 * cadence.h). A delta chain costs restore time and grows with every save; a full
 * resets it. A full is due after full_every deltas, once the deltas since the
 * last full add up to full_share of its size, and for a while after a delta that
 * alone reached that share (dense changes: a delta then costs about as much to
 * write as a full and more to restore).
 */
#include "cadence.h"

void amber__cadence_init(amber__cadence *c, uint32_t full_every, double full_share) {
  *c = (amber__cadence){.full_every = full_every, .full_share = full_share};
}

void amber__cadence_learn(amber__cadence *c, uint64_t full_bytes, uint64_t deltas,
                          uint64_t delta_bytes) {
  c->last_full_bytes = full_bytes;
  c->deltas_since_full = deltas;
  c->bytes_since_full = delta_bytes;
  c->known = 1;
}

int amber__cadence_decide(const amber__cadence *c) {
  if (c->full_every != UINT32_MAX && c->deltas_since_full >= c->full_every) return 1;
  if (c->fulls_to_go) return 1; /* backing off after a dense delta */
  return c->full_share > 0 && c->last_full_bytes &&
         (double)c->bytes_since_full >= c->full_share * (double)c->last_full_bytes;
}

void amber__cadence_record(amber__cadence *c, int delta, uint64_t bytes) {
  if (delta) {
    c->deltas_since_full++;
    c->bytes_since_full += bytes;
    /* A delta that alone reaches full_share of a full costs about as much to write
     * and more to restore: write fulls for a while, twice as long each time. */
    if (c->full_share > 0 && c->last_full_bytes &&
        (double)bytes >= c->full_share * (double)c->last_full_bytes) {
      uint32_t b = c->dense_backoff;
      c->dense_backoff = b ? (b >= 16 ? 32 : 2 * b) : 1;
      c->fulls_to_go = c->dense_backoff;
    } else {
      c->dense_backoff = 0;
    }
  } else {
    c->deltas_since_full = c->bytes_since_full = 0;
    c->last_full_bytes = bytes;
    if (c->fulls_to_go) c->fulls_to_go--;
  }
  c->known = 1;
}

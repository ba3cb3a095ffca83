/*
 * trajectory.h - what the delta tests (tests/test_delta_*.c) share.
 *
 * A trajectory (a `world`) declares tensors of every float dtype (scalar, empty,
 * odd sizes, sizes that straddle small chunks) plus integer and bool tensors, then
 * for each step mutates the live values like an optimizer would (small drifts on
 * most elements, a few large jumps, NaN/Inf set and cleared, untouched elements,
 * integer increments), saves, and opens a reader on that step to check:
 *  - exact (default or explicit): the restore is bit-identical to the live bytes;
 *  - threshold:ABS:REL: |x - r| <= ABS + REL*|r| for every element, in double via
 *    amber__to_f64 as the policies compare, and non-finite values bit-identical;
 *    with a share cap ("/SHARE:MULT") within MULT times that, and at most
 *    floor(SHARE*n) (at least 1) stored per chunk besides the forced ones (beyond
 *    MULT bounds);
 *  - budget:FRAC[:CAP]: every element within CAP, and at most floor(FRAC*n) (at
 *    least 1) stored per chunk besides the forced ones;
 *  - integer and bool tensors exact under any policy;
 *  - per chunk of each delta file: `stored` equals the number of elements whose
 *    restored bits changed, UNCHANGED chunks change nothing.
 * A `small` store is one f32 tensor of which a share changes each step, for the
 * cadence and corruption tests.
 *
 * Everything is seeded; a failure prints the seed, step, tensor and element.
 */
#ifndef AMBER_TRAJECTORY_H
#define AMBER_TRAJECTORY_H

#include "testutil.h"

/* ---- policies as the tests expect them ---- */

enum { P_EXACT, P_THR, P_BUD };

typedef struct {
  int kind;
  double abs, rel;  /* threshold */
  double frac, cap; /* budget; cap INFINITY when absent */
  const char *spec; /* what the index must record */
  double share, mult; /* threshold's share cap; share 0 when absent */
} pol;

extern const pol EXACT;

static inline pol thr(double a, double r, const char *spec) {
  pol p = {P_THR, a, r, 0, 0, spec, 0, 0};
  return p;
}
/* A threshold with a share cap: "threshold:ABS:REL/SHARE:MULT". */
static inline pol thrc(double a, double r, double share, double mult, const char *spec) {
  pol p = {P_THR, a, r, 0, 0, spec, share, mult};
  return p;
}
static inline pol bud(double f, double c, const char *spec) {
  pol p = {P_BUD, 0, 0, f, c, spec, 0, 0};
  return p;
}

static inline int is_float(int dt) {
  return dt == AMBER_F32 || dt == AMBER_F16 || dt == AMBER_BF16 || dt == AMBER_F64 ||
         dt == AMBER_F8_E4M3 || dt == AMBER_F8_E5M2;
}

/* Failure details are printed for the first few only. */
extern int details;
#define DETAIL(...)                                                                  \
  do {                                                                               \
    if (details++ < 25) fprintf(stderr, "    " __VA_ARGS__);                         \
  } while (0)

/* ---- element helpers ---- */

/* Value of one element as the policies compare it. */
double val(int dt, const uint8_t *p);
/* Stores v as an f64 (dt AMBER_F64) or else an f32. */
void put_f(int dt, uint8_t *p, double v);
/* Uniform in [0, 1). */
double urand(uint64_t *s);
/* Whether restored `r` is an acceptable restore of live `x` under `p`. */
int elem_ok(int dt, const pol *p, const uint8_t *x, const uint8_t *r, size_t w);
/* A small move of one element (never across the sign or into NaN/Inf). */
void drift(int dt, uint8_t *p, uint64_t *rng, int tiny);

/* ---- a trajectory ---- */

typedef struct {
  char name[48];
  int dtype;
  uint32_t ndim;
  int64_t shape[2];
  size_t n, w, nb;
  uint8_t *live, *prev, *got; /* prev: the restore of the previous step */
  uint8_t *live_mem;          /* live is live_mem + 1 when misaligned */
  pol p;                      /* the policy this tensor must follow */
} tens;

typedef struct {
  uint64_t seed, rng;
  int tiny;
  int misalign; /* live buffers at odd addresses, as inside a mapped safetensors file */
  const char *dir;
  amber_store *st;
  amber_writer *w;
  tens t[64];
  size_t n;
  int have_prev;
} world;

/* A fresh trajectory in a new directory; `tiny` allows subnormal and tiny values. */
void world_init(world *W, uint64_t seed, int tiny);
/* Declares one tensor of random values that must follow `p` (exact if not float). */
tens *add_tensor(world *W, const char *name, int dt, uint32_t ndim, int64_t d0, int64_t d1,
                 const pol *p);
/* Every float dtype as a scalar, an empty tensor, an odd 1-D size and a 2-D size,
 * the sizes around multiples of `chunk`; then integer and bool tensors. */
void add_standard(world *W, uint64_t chunk, const pol *p);
/* Opens store and writer, adds `rules` (NULL-terminated) and declares the tensors;
 * 0 when something failed (already reported). */
int world_open(world *W, const amber_writer_opts *wo, const char *const *rules);
void world_close(world *W);
void world_free(world *W);
/* One optimizer-like step on every live element. */
void world_mutate(world *W);
/* Saves `step` and checks its restore as the header comment says; returns the
 * checkpoint's kind, or -1. */
int save_check(world *W, uint64_t step, uint32_t flags);

/* Live buffers of run_trajectory's worlds at odd addresses when set. */
extern int g_misalign;
/* Runs `steps` steps of a trajectory under one policy for every float tensor;
 * counts the kinds saved in *nfull (may be NULL). */
void run_trajectory(uint64_t seed, uint64_t chunk, const char *rule, const pol *p, int steps,
                    uint32_t full_every, double full_share, int tiny, int *nfull);

/* ---- a small store ---- */

/* A small store: one f32 tensor where `share` of the elements change each step. */
typedef struct {
  const char *dir;
  amber_store *st;
  amber_writer *w;
  float x[4000];
  uint64_t rng;
} small;

void small_open(small *S, const char *dir, const amber_writer_opts *wo);
void small_init(small *S, uint64_t seed);
void small_step(small *S, double share);
void small_close(small *S);

#endif

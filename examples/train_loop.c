/*
 * train_loop.c - how a C or C++ trainer uses amber: a small MLP trained with AdamW
 * on synthetic regression data, checkpointed after every optimizer step with the
 * split save, and resumed from the store after a crash.
 *
 *   train_loop STORE [--steps N] [--kill-at S] [--policy SPEC]
 *
 * Each step: forward + backward on a batch (the compute that overlaps the scan of
 * the previous checkpoint), amber_writer_fence (the scan must be done before the
 * tensors change), the AdamW update, then amber_writer_begin for the new state.
 * The batch of step t is drawn from a generator seeded by t, so a resumed run sees
 * exactly the data an uninterrupted one does. With --kill-at S the process
 * SIGKILLs itself in the middle of saving step S, as a crash would.
 *
 * Prints "final step N loss L hash H" where H is a hash of the parameters: with
 * the exact policy a resumed run must print the same line as an uninterrupted one.
 */
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "amber.h"

enum { IN = 32, HID = 64, OUT = 8, BATCH = 64 };

typedef struct model {
  float w1[HID * IN], b1[HID], w2[OUT * HID], b2[OUT]; /* parameters */
} model;

#define NPARAM ((int)(sizeof(model) / sizeof(float)))

static model params, grads, m1, m2; /* m1, m2: AdamW moments, same layout */
static int64_t step_counter;

static uint64_t rng_next(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

static float rng_uniform(uint64_t *s) {
  return (float)(rng_next(s) >> 40) / 16777216.0f * 2.0f - 1.0f;
}

/* Target: a fixed random linear map followed by tanh. */
static void batch(int64_t t, float *x, float *y) {
  uint64_t s = 0x9E3779B97F4A7C15ull ^ (uint64_t)t * 0xBF58476D1CE4E5B9ull;
  uint64_t ts = 42;
  for (int i = 0; i < BATCH * IN; i++) x[i] = rng_uniform(&s);
  for (int b = 0; b < BATCH; b++)
    for (int o = 0; o < OUT; o++) {
      float acc = 0;
      uint64_t ws = ts + (uint64_t)o;
      for (int i = 0; i < IN; i++) acc += rng_uniform(&ws) * x[b * IN + i];
      y[b * OUT + o] = tanhf(acc);
    }
}

/* Forward and backward on one batch; returns the mean squared error. */
static float forward_backward(int64_t t) {
  static float x[BATCH * IN], y[BATCH * OUT], h[BATCH * HID], p[BATCH * OUT];
  batch(t, x, y);
  memset(&grads, 0, sizeof grads);
  float loss = 0;
  for (int b = 0; b < BATCH; b++) {
    for (int j = 0; j < HID; j++) {
      float a = params.b1[j];
      for (int i = 0; i < IN; i++) a += params.w1[j * IN + i] * x[b * IN + i];
      h[b * HID + j] = a > 0 ? a : 0;
    }
    for (int o = 0; o < OUT; o++) {
      float a = params.b2[o];
      for (int j = 0; j < HID; j++) a += params.w2[o * HID + j] * h[b * HID + j];
      p[b * OUT + o] = a;
      float d = a - y[b * OUT + o];
      loss += d * d;
      float g = 2 * d / (BATCH * OUT);
      grads.b2[o] += g;
      for (int j = 0; j < HID; j++) grads.w2[o * HID + j] += g * h[b * HID + j];
    }
    for (int j = 0; j < HID; j++) {
      if (h[b * HID + j] <= 0) continue;
      float g = 0;
      for (int o = 0; o < OUT; o++) {
        float d = p[b * OUT + o] - y[b * OUT + o];
        g += 2 * d / (BATCH * OUT) * params.w2[o * HID + j];
      }
      grads.b1[j] += g;
      for (int i = 0; i < IN; i++) grads.w1[j * IN + i] += g * x[b * IN + i];
    }
  }
  return loss / (BATCH * OUT);
}

static void adamw_step(void) {
  const float lr = 3e-3f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.01f;
  step_counter++;
  float c1 = 1 - powf(b1, (float)step_counter), c2 = 1 - powf(b2, (float)step_counter);
  float *p = (float *)&params, *g = (float *)&grads, *m = (float *)&m1, *v = (float *)&m2;
  for (int i = 0; i < NPARAM; i++) {
    m[i] = b1 * m[i] + (1 - b1) * g[i];
    v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
    p[i] -= lr * ((m[i] / c1) / (sqrtf(v[i] / c2) + eps) + wd * p[i]);
  }
}

static uint64_t params_hash(void) {
  const uint8_t *b = (const uint8_t *)&params;
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < sizeof params; i++) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

static int die(const char *what, const void *handle) {
  fprintf(stderr, "train_loop: %s: %s\n", what, amber_last_error(handle));
  return 1;
}

/* Declares every tensor of the training state, in one place for save and load. */
static const struct {
  const char *name;
  float *data;
  int64_t n;
} tensors[] = {
    {"model.w1", params.w1, HID * IN},      {"model.b1", params.b1, HID},
    {"model.w2", params.w2, OUT * HID},     {"model.b2", params.b2, OUT},
    {"optim.w1.exp_avg", m1.w1, HID * IN},  {"optim.b1.exp_avg", m1.b1, HID},
    {"optim.w2.exp_avg", m1.w2, OUT * HID}, {"optim.b2.exp_avg", m1.b2, OUT},
    {"optim.w1.exp_avg_sq", m2.w1, HID * IN}, {"optim.b1.exp_avg_sq", m2.b1, HID},
    {"optim.w2.exp_avg_sq", m2.w2, OUT * HID}, {"optim.b2.exp_avg_sq", m2.b2, OUT},
};
#define NT (sizeof tensors / sizeof tensors[0])

/* Restores the latest checkpoint; returns 0 with nothing restored for an empty store. */
static int resume(amber_store *st) {
  amber_reader *r = NULL;
  int rc = amber_reader_open(&r, st, AMBER_LATEST, NULL);
  if (rc == AMBER_ENOENT) return 0;
  if (rc) return die("cannot open the latest checkpoint", NULL);
  for (size_t i = 0; i < NT && !rc; i++) {
    size_t k;
    if ((rc = amber_reader_find(r, tensors[i].name, &k)) == 0)
      rc = amber_reader_read(r, k, tensors[i].data, (uint64_t)tensors[i].n * sizeof(float));
  }
  size_t k;
  if (!rc && (rc = amber_reader_find(r, "optim.step", &k)) == 0)
    rc = amber_reader_read(r, k, &step_counter, sizeof step_counter);
  if (rc) {
    int ret = die("cannot restore", r);
    amber_reader_close(r);
    return ret;
  }
  fprintf(stderr, "train_loop: resumed from step %" PRIu64 "\n", amber_reader_step(r));
  amber_reader_close(r);
  return 0;
}

int main(int argc, char **argv) {
  const char *store = NULL, *policy = NULL;
  int64_t steps = 100, kill_at = -1;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoll(argv[++i]);
    else if (!strcmp(argv[i], "--kill-at") && i + 1 < argc) kill_at = atoll(argv[++i]);
    else if (!strcmp(argv[i], "--policy") && i + 1 < argc) policy = argv[++i];
    else if (!store && argv[i][0] != '-') store = argv[i];
    else {
      fprintf(stderr, "usage: train_loop STORE [--steps N] [--kill-at S] [--policy SPEC]\n");
      return 2;
    }
  }
  if (!store) {
    fprintf(stderr, "usage: train_loop STORE [--steps N] [--kill-at S] [--policy SPEC]\n");
    return 2;
  }
  uint64_t init = 7;
  for (int i = 0; i < NPARAM; i++) ((float *)&params)[i] = 0.1f * rng_uniform(&init);
  amber_store *st = NULL;
  amber_writer *w = NULL;
  if (amber_store_open(&st, store, NULL)) return die("cannot open the store", NULL);
  if (resume(st)) return 1;
  if (amber_writer_open(&w, st, NULL)) return die("cannot open a writer", NULL);
  for (size_t i = 0; i < NT; i++)
    if (amber_writer_add(w, tensors[i].name, AMBER_F32, 1, &tensors[i].n, tensors[i].data, NULL))
      return die("cannot declare a tensor", w);
  if (amber_writer_add(w, "optim.step", AMBER_I64, 0, NULL, &step_counter, NULL))
    return die("cannot declare the step counter", w);
  if (policy && amber_writer_add_policy(w, policy)) return die("bad policy", w);
  float loss = 0;
  while (step_counter < steps) {
    loss = forward_backward(step_counter + 1); /* overlaps the scan of the last save */
    if (amber_writer_fence(w)) return die("fence", w);
    adamw_step();
    int rc = amber_writer_wait(w); /* the previous checkpoint is durable */
    if (rc) fprintf(stderr, "train_loop: checkpoint failed, training goes on: %s\n",
                    amber_last_error(w));
    if (amber_writer_begin(w, (uint64_t)step_counter, 0))
      fprintf(stderr, "train_loop: cannot start checkpoint %" PRId64 ": %s\n", step_counter,
              amber_last_error(w));
    if (step_counter == kill_at) {
      usleep(1000); /* somewhere inside the save */
      raise(SIGKILL);
    }
  }
  if (amber_writer_wait(w)) return die("last checkpoint", w);
  amber_writer_close(w);
  amber_store_close(st);
  printf("final step %" PRId64 " loss %.6f hash %016" PRIx64 "\n", step_counter, loss,
         params_hash());
  return 0;
}

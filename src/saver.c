/*
 * saver.c - the writer's asynchronous save (see saver.h). One state, changed by
 * one function under the mutex, says where the begun save is; every wait in this
 * file is a wait for a state (or for the commit gate's verdict):
 *
 *   IDLE -> QUEUED (begin) -> RUNNING (save thread) -> SCANNED (fence returns)
 *        -> DONE (status kept) -> IDLE (wait reports it); RUNNING -> DONE directly
 *        when the save ends before marking its scan.
 *
 * As libuv says of its callbacks: if begin fails, nothing runs and wait has
 * nothing to report.
 */
#include <assert.h>
#include <inttypes.h>
#include <stdio.h>

#include "saver.h"

/* The one transition function: checks the move, makes it and wakes the waiters.
 * Called with mu held. */
static void to(amber__saver *s, amber__save_state next) {
  static const unsigned allowed[] = {
      [AMBER__SAVE_IDLE] = 1u << AMBER__SAVE_QUEUED | 1u << AMBER__SAVE_IDLE,
      [AMBER__SAVE_QUEUED] = 1u << AMBER__SAVE_RUNNING,
      [AMBER__SAVE_RUNNING] = 1u << AMBER__SAVE_SCANNED | 1u << AMBER__SAVE_DONE,
      [AMBER__SAVE_SCANNED] = 1u << AMBER__SAVE_DONE,
      [AMBER__SAVE_DONE] = 1u << AMBER__SAVE_IDLE,
  };
  assert(allowed[s->state] & (1u << next));
  (void)allowed;
  s->state = next;
  pthread_cond_broadcast(&s->cv);
}

static void *saver_main(void *arg) {
  amber__saver *s = arg;
  pthread_mutex_lock(&s->mu);
  for (;;) {
    while (!s->stop && s->state != AMBER__SAVE_QUEUED) pthread_cond_wait(&s->cv, &s->mu);
    if (s->stop) break;
    to(s, AMBER__SAVE_RUNNING);
    uint64_t step = s->step;
    pthread_mutex_unlock(&s->mu);
    int rc = s->run(s->ctx, step);
    pthread_mutex_lock(&s->mu);
    s->result = rc;
    to(s, AMBER__SAVE_DONE);
  }
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

void amber__saver_init(amber__saver *s, int (*run)(void *, uint64_t), void *ctx) {
  memset(s, 0, sizeof *s);
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->cv, NULL);
  s->run = run;
  s->ctx = ctx;
}

void amber__saver_destroy(amber__saver *s) {
  if (s->thread_on) {
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    s->thread_on = 0;
  }
  pthread_mutex_destroy(&s->mu);
  pthread_cond_destroy(&s->cv);
}

amber__save_state amber__saver_state(amber__saver *s) {
  pthread_mutex_lock(&s->mu);
  amber__save_state st = s->state;
  pthread_mutex_unlock(&s->mu);
  return st;
}

static int running(amber__save_state st) {
  return st == AMBER__SAVE_QUEUED || st == AMBER__SAVE_RUNNING || st == AMBER__SAVE_SCANNED;
}

int amber__saver_busy(amber__saver *s) {
  return running(amber__saver_state(s));
}

void amber__saver_arm(amber__saver *s) {
  __atomic_store_n(&s->cancel, 0, __ATOMIC_SEQ_CST);
  __atomic_store_n(&s->gate, AMBER__GATE_NONE, __ATOMIC_SEQ_CST);
}

int amber__saver_start(amber__saver *s, amber__err *e) {
  if (s->thread_on) return 0;
  if (pthread_create(&s->thread, NULL, saver_main, s) != 0)
    return amber__fail(e, AMBER_ENOMEM, "cannot start the save thread");
  s->thread_on = 1;
  return 0;
}

void amber__saver_submit(amber__saver *s, uint64_t step, int confirm) {
  pthread_mutex_lock(&s->mu);
  s->step = step;
  s->result = 0;
  __atomic_store_n(&s->gate, confirm ? AMBER__GATE_PENDING : AMBER__GATE_NONE, __ATOMIC_SEQ_CST);
  to(s, AMBER__SAVE_QUEUED);
  pthread_mutex_unlock(&s->mu);
}

void amber__saver_scanned(amber__saver *s) {
  pthread_mutex_lock(&s->mu);
  if (s->state == AMBER__SAVE_RUNNING) to(s, AMBER__SAVE_SCANNED);
  pthread_mutex_unlock(&s->mu);
}

void amber__saver_fence(amber__saver *s) {
  pthread_mutex_lock(&s->mu);
  while (s->state == AMBER__SAVE_QUEUED || s->state == AMBER__SAVE_RUNNING)
    pthread_cond_wait(&s->cv, &s->mu);
  pthread_mutex_unlock(&s->mu);
}

/* Records the verdict on a gated save; called with mu held. */
static void give_verdict(amber__saver *s, int ok, const char *why) {
  if (!ok) snprintf(s->why, sizeof s->why, "%s", why);
  __atomic_store_n(&s->gate, ok ? AMBER__GATE_OK : AMBER__GATE_VETO, __ATOMIC_SEQ_CST);
  pthread_cond_broadcast(&s->cv);
}

int amber__saver_wait(amber__saver *s) {
  pthread_mutex_lock(&s->mu);
  if (s->state != AMBER__SAVE_IDLE && s->gate == AMBER__GATE_PENDING)
    /* nobody will confirm it now: refuse, not hang */
    give_verdict(s, 0, "not confirmed (amber_writer_wait or amber_writer_close came before "
                       "amber_writer_confirm)");
  while (running(s->state)) pthread_cond_wait(&s->cv, &s->mu);
  int rc = s->state == AMBER__SAVE_DONE ? s->result : 0;
  to(s, AMBER__SAVE_IDLE);
  pthread_mutex_unlock(&s->mu);
  return rc;
}

void amber__saver_cancel(amber__saver *s) {
  pthread_mutex_lock(&s->mu); /* wakes a save waiting at its commit gate */
  __atomic_store_n(&s->cancel, 1, __ATOMIC_SEQ_CST);
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
}

int amber__saver_confirm(amber__saver *s, int ok, const char *why, int *job) {
  pthread_mutex_lock(&s->mu);
  /* the verdict covers the whole scan: wait for it as a fence does */
  while ((s->state == AMBER__SAVE_QUEUED || s->state == AMBER__SAVE_RUNNING) &&
         s->gate == AMBER__GATE_PENDING)
    pthread_cond_wait(&s->cv, &s->mu);
  int pending = s->state != AMBER__SAVE_IDLE && s->gate == AMBER__GATE_PENDING;
  if (pending) give_verdict(s, ok, why && *why ? why : "vetoed by amber_writer_confirm");
  *job = s->state != AMBER__SAVE_IDLE;
  pthread_mutex_unlock(&s->mu);
  return pending;
}

int amber__saver_stopping(amber__saver *s) {
  return __atomic_load_n(&s->cancel, __ATOMIC_RELAXED) ||
         __atomic_load_n(&s->gate, __ATOMIC_RELAXED) == AMBER__GATE_VETO;
}

int amber__saver_check_stop(amber__saver *s, amber__err *e, uint64_t step) {
  if (__atomic_load_n(&s->cancel, __ATOMIC_SEQ_CST))
    return amber__fail(e, AMBER_ECANCELED, "the save of step %" PRIu64 " was canceled", step);
  if (__atomic_load_n(&s->gate, __ATOMIC_SEQ_CST) != AMBER__GATE_VETO) return 0;
  pthread_mutex_lock(&s->mu);
  int rc = amber__fail(e, AMBER_ECHANGED, "step %" PRIu64 " not committed: %s", step, s->why);
  pthread_mutex_unlock(&s->mu);
  return rc;
}

int amber__saver_await_verdict(amber__saver *s, amber__err *e, uint64_t step) {
  pthread_mutex_lock(&s->mu);
  while (s->gate == AMBER__GATE_PENDING && !s->cancel) pthread_cond_wait(&s->cv, &s->mu);
  pthread_mutex_unlock(&s->mu);
  return amber__saver_check_stop(s, e, step);
}

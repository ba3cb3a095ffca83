/*
 * saver.h - internal: the life cycle of the writer's asynchronous save
 * (amber_writer_begin / fence / confirm / cancel / wait) as one state with one
 * transition function, the save thread that runs it, and the commit gate of
 * AMBER_SAVE_CONFIRM. What a save does is the writer's business: the saver calls
 * `run` on its thread and keeps the status until wait reports it.
 */
#ifndef AMBER_SAVER_H
#define AMBER_SAVER_H

#include <pthread.h>
#include <stdint.h>

#include "internal.h"

typedef enum amber__save_state {
  AMBER__SAVE_IDLE,    /* no save, or its status was reported */
  AMBER__SAVE_QUEUED,  /* begun; the save thread has not taken it yet */
  AMBER__SAVE_RUNNING, /* the save reads the tensors' memory */
  AMBER__SAVE_SCANNED, /* it no longer reads them: a fence returns */
  AMBER__SAVE_DONE     /* finished; its status waits for amber_writer_wait */
} amber__save_state;

/* The commit gate of a save begun with AMBER_SAVE_CONFIRM. */
enum { AMBER__GATE_NONE = 0, AMBER__GATE_PENDING, AMBER__GATE_OK, AMBER__GATE_VETO };

typedef struct amber__saver {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  pthread_t thread;
  int thread_on, stop;
  amber__save_state state; /* changed only by to() in saver.c, under mu */
  int result;              /* the status of a DONE save */
  uint64_t step;           /* of the save begun last */
  int cancel;              /* amber_writer_cancel (read by workers atomically) */
  int gate;                /* AMBER__GATE_* (read by workers atomically) */
  char why[AMBER__ERRLEN]; /* the veto's reason */
  int (*run)(void *ctx, uint64_t step);
  void *ctx;
} amber__saver;

/* `run(ctx, step)` performs a begun save on the save thread (started lazily). */
void amber__saver_init(amber__saver *s, int (*run)(void *, uint64_t), void *ctx);
/* Stops the save thread (after amber__saver_wait) and releases the rest. */
void amber__saver_destroy(amber__saver *s);

/* The current state (a snapshot taken under the lock). */
amber__save_state amber__saver_state(amber__saver *s);
/* A save was begun and still runs (QUEUED, RUNNING or SCANNED). */
int amber__saver_busy(amber__saver *s);

/* Clears cancel and gate before a new save (synchronous or begun). */
void amber__saver_arm(amber__saver *s);
/* Starts the save thread unless it runs: 0, or AMBER_ENOMEM (into `e`). */
int amber__saver_start(amber__saver *s, amber__err *e);
/* Hands save `step` to the started save thread (IDLE -> QUEUED); `confirm`: it
 * commits only after a verdict. */
void amber__saver_submit(amber__saver *s, uint64_t step, int confirm);
/* The save no longer reads the tensors' memory (RUNNING -> SCANNED; nothing in
 * other states, such as a synchronous save's IDLE). */
void amber__saver_scanned(amber__saver *s);
/* Blocks while the begun save still reads the tensors' memory. */
void amber__saver_fence(amber__saver *s);
/* Waits for the begun save (refusing a verdict nobody will give now) and
 * returns its status, once: the state becomes IDLE. 0 when there is none. */
int amber__saver_wait(amber__saver *s);

/* amber_writer_cancel: marks the save canceled and wakes its commit gate. */
void amber__saver_cancel(amber__saver *s);
/* Gives the verdict on a gated save, once its scan is over. 1 when a verdict was
 * pending (and is now given), else 0; *job: whether a save was begun. */
int amber__saver_confirm(amber__saver *s, int ok, const char *why, int *job);
/* A cancel or a veto: the rest of the save's work is wasted (cheap, for workers). */
int amber__saver_stopping(amber__saver *s);
/* 0, or the failure (into `e`) of save `step` that was canceled or vetoed. */
int amber__saver_check_stop(amber__saver *s, amber__err *e, uint64_t step);
/* The commit gate: waits for the verdict of a gated save, then check_stop. */
int amber__saver_await_verdict(amber__saver *s, amber__err *e, uint64_t step);

#endif /* AMBER_SAVER_H */

/*
 * global_files.h - what the multi-rank tests do to a store's files behind the
 * library's back: rewrite a step's manifest (checksum recomputed, as a tool or an
 * attacker would), and open one rank's file of a step as a single-rank store.
 */
#ifndef AMBER_GLOBAL_FILES_H
#define AMBER_GLOBAL_FILES_H

#include <stdio.h>
#include <stdlib.h>

#include "amber.h"
#include "global.h"
#include "testutil.h"

/* Rewrites the manifest of `step` of store `p` through `fn`. */
static inline void tg_patch_manifest(const char *p, uint64_t step,
                                     void (*fn)(amber__manifest *)) {
  amber__manifest m;
  amber__err e;
  int rc = amber__global_load_manifest(p, step, &e, &m);
  CHECK_OK(rc);
  if (rc < 0) return;
  fn(&m);
  uint8_t *b = NULL;
  size_t len = 0;
  CHECK_OK(amber__manifest_encode(&m, &e, &b, &len));
  char f[4200];
  snprintf(f, sizeof f, "%s/step-%020llu.manifest", p, (unsigned long long)step);
  CHECK(tu_write_file(f, b, len) == 0);
  free(b);
  amber__manifest_free(&m);
}

/* Opens rank `r`'s store of `p` read-only and a reader of its `step`: 0, or the
 * failure (then *st and *rd are NULL). Close both. */
static inline int tg_rank_reader(const char *p, int r, uint64_t step, amber_store **st,
                                 amber_reader **rd) {
  char dir[4300];
  snprintf(dir, sizeof dir, "%.4200s/rank-%05d", p, r);
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY | AMBER_OPEN_NOCREATE;
  *st = NULL, *rd = NULL;
  int rc = amber_store_open(st, dir, &so);
  if (rc == 0 && (rc = amber_reader_open(rd, *st, step, NULL)) < 0) {
    amber_store_close(*st);
    *st = NULL;
  }
  return rc;
}

#endif /* AMBER_GLOBAL_FILES_H */

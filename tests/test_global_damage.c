/*
 * test_global_damage.c - a multi-rank store that is damaged, or in use, in the
 * ways an outside probe found (issue 30), with ranks as threads
 * (tests/comm_threads.h): a store without GLOBAL is refused by readers, writers
 * and the CLI, and keeps every rank's files; overlapping shards fail the step on
 * every rank; a manifest whose shards overlap, moved between ranks, or whose dtype
 * or shape disagrees with the rank files is refused (reads, verify); a damaged or
 * missing manifest is listed as damaged and the older steps stay readable; a
 * manifest removed while a listing runs is left out of it; a rank store without
 * LATEST still reads and a writer repairs it; a job that opens a store in use by
 * another is refused on every rank and creates nothing there. Also the golden
 * store whose rank files hold box tables (FORMAT.md, "Box table").
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "amber.h"
#include "comm_threads.h"
#include "global_files.h"
#include "global.h"
#include "testutil.h"

#define ROWS 16
#define COLS 8

static float wval(int64_t i, int64_t j, uint64_t step) {
  return (float)(i * COLS + j) + 1000.0f * (float)step;
}

/* Rank r's rows of "w" when `n` ranks split it. */
static void rows(int r, int n, int64_t *off, int64_t *shape) {
  off[0] = ROWS * r / n, off[1] = 0;
  shape[0] = ROWS * (r + 1) / n - off[0], shape[1] = COLS;
}

typedef struct job {
  const char *path;
  uint64_t first, last;
  uint32_t full_every; /* 0: the default */
  int expect_open;     /* what amber_global_writer_open must return */
  const char *open_msg; /* and a part of its message */
  int overlap;          /* every rank declares the same rows */
} job;

static void rank_main(const amber_comm *c, void *arg) {
  const job *jb = arg;
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.full_every = jb->full_every;
  wo.full_share = -1;
  amber_global_writer *gw = NULL;
  int rc = amber_global_writer_open(&gw, jb->path, c, &wo);
  RCHECK(rc == jb->expect_open);
  if (rc < 0) {
    RCHECK(!jb->open_msg || strstr(amber_last_error(NULL), jb->open_msg));
    if (c->rank == 0) fprintf(stderr, "  (expected) %s\n", amber_last_error(NULL));
    return;
  }
  int64_t g[2] = {ROWS, COLS}, off[2], sh[2];
  rows(c->rank, c->size, off, sh);
  if (jb->overlap) off[0] = 0, sh[0] = ROWS / c->size; /* same rows, volumes add up */
  float w[ROWS * COLS], b = 0.5f;
  RCHECK(amber_global_writer_add(gw, "w", AMBER_F32, 2, g, off, sh, w, 0) == 0);
  int64_t one = 1;
  RCHECK(amber_global_writer_add(gw, "b", AMBER_F32, 1, &one, NULL, NULL, &b,
                                 AMBER_SHARD_REPLICATED) == 0);
  for (uint64_t s = jb->first; s <= jb->last; s++) {
    for (int64_t i = 0; i < sh[0]; i++)
      for (int64_t j = 0; j < COLS; j++) w[i * COLS + j] = wval(off[0] + i, j, s);
    b = (float)s;
    rc = amber_global_writer_save(gw, s, 0);
    if (jb->overlap) {
      RCHECK(rc == AMBER_EMISMATCH);
      RCHECK(strstr(amber_last_error(gw), "tensor 'w'") && strstr(amber_last_error(gw), "overlap") &&
             strstr(amber_last_error(gw), "rank 0") && strstr(amber_last_error(gw), "rank 1"));
      if (c->rank == 1) fprintf(stderr, "  (expected) %s\n", amber_last_error(gw));
    } else {
      RCHECK(rc == 0);
    }
  }
  amber_global_writer_close(gw);
}

static void run(const char *path, int n, uint64_t first, uint64_t last, int expect_open,
                const char *open_msg) {
  job jb = {path, first, last, 0, expect_open, open_msg, 0};
  atomic_store(&rank_fails, 0);
  tc_run(n, rank_main, &jb);
  CHECK(atomic_load(&rank_fails) == 0);
}

/* Reads all of "w" of `step` (whatever shape the manifest gives it) and checks it
 * against the values saved at `want`: < 0 when the read fails, 1 when it succeeds
 * with other values (the caller's buffer holds -1 where nothing was written). */
static int read_w(const char *path, uint64_t step, uint64_t want) {
  amber_global_reader *g = NULL;
  int rc = amber_global_reader_open(&g, path, step);
  float got[ROWS * COLS];
  for (size_t i = 0; i < ROWS * COLS; i++) got[i] = -1.0f;
  int64_t o[2] = {0, 0};
  size_t wi = 0;
  amber_global_tensor t;
  if (rc == 0) rc = amber_global_reader_find(g, "w", &wi);
  if (rc == 0) rc = amber_global_reader_tensor(g, wi, &t);
  if (rc == 0 && t.shape[0] * t.shape[1] != ROWS * COLS) rc = 1;
  if (rc == 0) rc = amber_global_reader_read(g, wi, o, t.shape, got, sizeof got);
  if (rc == 0)
    for (int64_t i = 0; i < ROWS * COLS; i++)
      if (got[i] != wval(i / COLS, i % COLS, want)) {
        fprintf(stderr, "  w[%lld] = %g after a read that succeeded, saved %g\n", (long long)i,
                (double)got[i], (double)wval(i / COLS, i % COLS, want));
        rc = 1;
        break;
      }
  if (rc < 0) fprintf(stderr, "  (read of step %llu) %s\n", (unsigned long long)step,
                      g ? amber_last_error(g) : amber_last_error(NULL));
  amber_global_reader_close(g);
  return rc;
}

static size_t count_files(const char *path, int rank) {
  char dir[4200];
  snprintf(dir, sizeof dir, "%s/rank-%05d", path, rank);
  return (size_t)tu_system("exit $(ls %s | grep -c '^ckpt-.*\\.amber$')", dir);
}

static void path_of(char *buf, size_t len, const char *store, const char *fmt, uint64_t v) {
  char name[256];
  snprintf(name, sizeof name, fmt, (unsigned long long)v);
  snprintf(buf, len, "%s/%s", store, name);
}

/* The CLI on `path`: exit status of `amber ARGS`, its output in *out (malloc'd). */
static int cli(const char *path, const char *args, char **out) {
  char f[4200];
  snprintf(f, sizeof f, "%s.cli-out", path);
  int rc = tu_system("%s %s %s > %s 2>&1", AMBER_CLI, args, path, f);
  size_t len;
  *out = (char *)tu_read_file(f, &len);
  if (*out) {
    char *t = realloc(*out, len + 1);
    if (t) t[len] = 0, *out = t;
  }
  return rc;
}

static int cli_says(const char *path, const char *args, int want_ok, const char *needle) {
  char *out = NULL;
  int rc = cli(path, args, &out);
  int ok = (rc == 0) == want_ok && out && (!needle || strstr(out, needle));
  if (!ok) fprintf(stderr, "  amber %s %s: exit %d:\n%s\n", args, path, rc, out ? out : "");
  free(out);
  return ok;
}

/* ---- a store without GLOBAL ---- */

static void test_store_without_global_is_refused_everywhere_and_keeps_its_files(void) {
  const char *p = tu_tmpdir();
  run(p, 2, 1, 6, 0, NULL);
  char global[4200], saved[4200];
  snprintf(global, sizeof global, "%s/GLOBAL", p);
  snprintf(saved, sizeof saved, "%s/GLOBAL.saved", tu_tmpdir());
  CHECK(rename(global, saved) == 0);
  amber_global_step_info *gs = NULL;
  size_t n = 0;
  CHECK_RC(amber_global_list(p, &gs, &n), AMBER_ECORRUPT);
  CHECK(strstr(amber_last_error(NULL), "GLOBAL is missing") != NULL);
  amber_free(gs);
  amber_global_reader *g = NULL;
  CHECK_RC(amber_global_reader_open(&g, p, AMBER_LATEST), AMBER_ECORRUPT);
  CHECK_RC(amber_global_reader_open(&g, p, 3), AMBER_ECORRUPT);
  /* the next writer refuses on every rank, and removes nothing */
  run(p, 2, 7, 7, AMBER_ECORRUPT, "GLOBAL is missing");
  CHECK(count_files(p, 0) == 6 && count_files(p, 1) == 6);
  CHECK(cli_says(p, "ls", 0, "GLOBAL is missing"));
  CHECK(cli_says(p, "verify", 0, "GLOBAL is missing"));
  char args[4300];
  snprintf(args, sizeof args, "export -o %s/x.safetensors", tu_tmpdir());
  CHECK(cli_says(p, args, 0, "GLOBAL is missing"));
  /* GLOBAL back: everything is there */
  CHECK(rename(saved, global) == 0);
  CHECK(read_w(p, AMBER_LATEST, 6) == 0);
  CHECK(read_w(p, 2, 2) == 0);
}

/* What a crash in the first global commit leaves (one manifest, one file per rank,
 * no GLOBAL) is still an empty store: listed as such, and the next writer starts
 * afresh. */
static void test_first_commit_crash_without_global_is_an_empty_store(void) {
  const char *p = tu_tmpdir();
  run(p, 2, 5, 5, 0, NULL);
  char global[4200];
  snprintf(global, sizeof global, "%s/GLOBAL", p);
  CHECK(unlink(global) == 0);
  amber_global_step_info *gs = NULL;
  size_t n = 9;
  CHECK_OK(amber_global_list(p, &gs, &n));
  CHECK(n == 0);
  amber_free(gs);
  amber_global_reader *g = NULL;
  CHECK_RC(amber_global_reader_open(&g, p, AMBER_LATEST), AMBER_ENOENT);
  run(p, 2, 1, 2, 0, NULL);
  CHECK(read_w(p, AMBER_LATEST, 2) == 0);
  char m5[4200];
  path_of(m5, sizeof m5, p, "step-%020llu.manifest", 5);
  CHECK(access(m5, F_OK) != 0); /* the uncommitted manifest is gone */
  CHECK(count_files(p, 0) == 2 && count_files(p, 1) == 2);
}

/* ---- overlapping and moved shards ---- */

static void test_overlapping_shards_fail_the_step_on_every_rank(void) {
  const char *p = tu_tmpdir();
  job jb = {p, 1, 1, 0, 0, NULL, 1};
  atomic_store(&rank_fails, 0);
  tc_run(2, rank_main, &jb);
  CHECK(atomic_load(&rank_fails) == 0);
  amber_global_step_info *gs = NULL;
  size_t n = 9;
  CHECK_OK(amber_global_list(p, &gs, &n));
  CHECK(n == 0);
  amber_free(gs);
}

static amber__mtensor *tensor_w(amber__manifest *m) {
  for (uint32_t i = 0; i < m->ntensors; i++)
    if (!strcmp(m->tensors[i].name, "w")) return &m->tensors[i];
  return &m->tensors[0];
}
static void swap_ranks(amber__manifest *m) {
  amber__mtensor *t = tensor_w(m);
  uint32_t r = t->shards[0].rank;
  t->shards[0].rank = t->shards[1].rank, t->shards[1].rank = r;
}
static void swap_offsets(amber__manifest *m) {
  amber__mtensor *t = tensor_w(m);
  int64_t o = t->shards[0].off[0];
  t->shards[0].off[0] = t->shards[1].off[0], t->shards[1].off[0] = o;
}
static void same_rows(amber__manifest *m) { /* volumes still add up */
  tensor_w(m)->shards[1].off[0] = 0;
}
static void other_dtype(amber__manifest *m) {
  tensor_w(m)->dtype = AMBER_I32;
}
static void other_shape(amber__manifest *m) { /* the same volume, rows and columns swapped */
  amber__mtensor *t = tensor_w(m);
  t->shape[0] = COLS, t->shape[1] = ROWS;
  t->shards[1].off[0] = 0, t->shards[1].off[1] = ROWS / 2;
  t->shards[0].shape[0] = t->shards[1].shape[0] = COLS;
  t->shards[0].shape[1] = t->shards[1].shape[1] = ROWS / 2;
}

static void test_manifest_with_overlapping_moved_or_mismatched_shards_is_refused(void) {
  static const struct {
    const char *what;
    void (*fn)(amber__manifest *);
    const char *says;
  } cases[] = {{"ranks swapped", swap_ranks, "moved or swapped"},
               {"offsets swapped", swap_offsets, "moved or swapped"},
               {"overlapping rows", same_rows, "overlap"},
               {"another dtype", other_dtype, "another dtype or shape"},
               {"another global shape", other_shape, "another"}};
  for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
    const char *p = tu_tmpdir();
    fprintf(stderr, "  %s:\n", cases[k].what);
    run(p, 2, 1, 3, 0, NULL);
    tg_patch_manifest(p, 3, cases[k].fn);
    CHECK(read_w(p, 3, 3) < 0);
    CHECK(strstr(amber_last_error(NULL), cases[k].says) != NULL);
    amber_global_reader *g = NULL;
    int rc = amber_global_reader_open(&g, p, 3);
    if (rc == 0) rc = amber_global_reader_verify(g);
    CHECK(rc == AMBER_ECORRUPT);
    amber_global_reader_close(g);
    CHECK(read_w(p, 2, 2) == 0); /* the steps before are untouched */
    CHECK(cli_says(p, "verify", 0, "step 3: FAILED"));
  }
}

/* ---- damaged and missing manifests in the listing ---- */

static void check_listing(const char *p, int damaged3) {
  amber_global_step_info *gs = NULL;
  size_t n = 0;
  CHECK_OK(amber_global_list(p, &gs, &n));
  CHECK(n == 3);
  for (size_t i = 0; i < n && n == 3; i++) {
    CHECK(gs[i].step == i + 1);
    CHECK(!(gs[i].flags & AMBER_CKPT_DAMAGED) == !(damaged3 && i == 2));
  }
  amber_free(gs);
}

static void test_damaged_or_missing_manifest_is_listed_and_older_steps_read(void) {
  static const char *how[] = {"flipped", "truncated", "deleted"};
  for (int k = 0; k < 3; k++) {
    const char *p = tu_tmpdir();
    fprintf(stderr, "  latest manifest %s:\n", how[k]);
    run(p, 2, 1, 3, 0, NULL);
    check_listing(p, 0);
    char f[4200];
    path_of(f, sizeof f, p, "step-%020llu.manifest", 3);
    if (k == 0) CHECK(tu_flip_byte(f, TU_MIDDLE, 0x04) == 0);
    if (k == 1) CHECK(truncate(f, 100) == 0);
    if (k == 2) CHECK(unlink(f) == 0);
    check_listing(p, 1);
    CHECK(read_w(p, AMBER_LATEST, 3) == AMBER_ECORRUPT);
    if (k == 2) CHECK(strstr(amber_last_error(NULL), "GLOBAL names step 3") != NULL);
    CHECK(read_w(p, 2, 2) == 0);
    CHECK(cli_says(p, "ls", 1, "damaged"));
    CHECK(cli_says(p, "ls --json", 1, "\"damaged\": true"));
    CHECK(cli_says(p, "verify", 0, "step 3: FAILED"));
    CHECK(cli_says(p, "verify", 0, "step 2: ok"));
    char args[4300];
    snprintf(args, sizeof args, "export --step 2 -o %s/x.safetensors", tu_tmpdir());
    CHECK(cli_says(p, args, 1, NULL));
  }
}

/* A manifest removed while a listing runs (a prune beside it) is left out of the
 * listing: here one is moved away and back as fast as possible while the listing
 * runs again and again; it must never fail nor flag a step. */
static atomic_int toggling;

static void *toggle_main(void *arg) {
  const char *p = arg;
  char f[4200], away[4300];
  path_of(f, sizeof f, p, "step-%020llu.manifest", 1);
  snprintf(away, sizeof away, "%s.away", f);
  while (atomic_load(&toggling)) {
    rename(f, away);
    rename(away, f);
  }
  return NULL;
}

static void test_manifest_removed_while_listing_is_left_out(void) {
  const char *p = tu_tmpdir();
  run(p, 1, 1, 3, 0, NULL);
  atomic_store(&toggling, 1);
  pthread_t th;
  pthread_create(&th, NULL, toggle_main, (void *)p);
  int fails = 0, flagged = 0, seen = 0;
  for (int i = 0; i < 4000; i++) {
    amber_global_step_info *gs = NULL;
    size_t n = 0;
    if (amber_global_list(p, &gs, &n) < 0) {
      if (!fails++) fprintf(stderr, "  listing failed: %s\n", amber_last_error(NULL));
      continue;
    }
    for (size_t j = 0; j < n; j++) flagged += (gs[j].flags & AMBER_CKPT_DAMAGED) != 0;
    seen += n == 2;
    amber_free(gs);
  }
  atomic_store(&toggling, 0);
  pthread_join(th, NULL);
  fprintf(stderr, "  %d listings without step 1, %d failed, %d flags\n", seen, fails, flagged);
  CHECK(fails == 0 && flagged == 0);
}

/* ---- a rank store without LATEST ---- */

static void test_rank_latest_missing_or_damaged_reads_and_writer_repairs(void) {
  for (int k = 0; k < 2; k++) {
    const char *p = tu_tmpdir();
    run(p, 2, 1, 3, 0, NULL); /* a full step, then deltas */
    char latest[4200];
    snprintf(latest, sizeof latest, "%s/rank-00001/LATEST", p);
    if (k == 0) CHECK(unlink(latest) == 0);
    else CHECK(tu_write_file(latest, "garbage\n", 8) == 0);
    CHECK(read_w(p, AMBER_LATEST, 3) == 0);
    CHECK(read_w(p, 1, 1) == 0);
    CHECK(cli_says(p, "verify", 1, NULL));
    run(p, 2, 4, 4, 0, NULL); /* LATEST back from the manifests, then a step */
    CHECK(count_files(p, 1) == 4);
    CHECK(read_w(p, 3, 3) == 0 && read_w(p, 4, 4) == 0);
    size_t len = 0;
    char *txt = (char *)tu_read_file(latest, &len);
    CHECK(txt && len > 2 && !strncmp(txt, "4 ", 2));
    free(txt);
  }
}

/* One step, one file per rank: without LATEST a rank store looks like a first
 * commit's leftover, which a writable open removes. The manifest says otherwise:
 * neither the next writer nor maintenance removes it. */
static void test_lone_committed_rank_file_without_latest_is_kept(void) {
  const char *p = tu_tmpdir();
  run(p, 2, 1, 1, 0, NULL);
  char latest[4200];
  snprintf(latest, sizeof latest, "%s/rank-00001/LATEST", p);
  CHECK(unlink(latest) == 0);
  size_t removed = 9;
  CHECK_OK(amber_global_prune(p, 5, &removed));
  CHECK(count_files(p, 1) == 1);
  CHECK(read_w(p, 1, 1) == 0);
  run(p, 2, 2, 2, 0, NULL);
  CHECK(count_files(p, 1) == 2);
  CHECK(read_w(p, 1, 1) == 0 && read_w(p, 2, 2) == 0);
}

/* ---- the box table, golden ---- */

/* The bytes of the box table of `path`'s rank `r` file of `step`, parsed here by
 * FORMAT.md's table (not by the library), must be: "w" at rank r's rows of a
 * (ROWS, COLS) tensor, then, on rank 0, "b" at 0 of a (1) tensor. */
static void check_box_table(const char *path, int r, uint64_t step) {
  amber_store *st;
  amber_reader *rd;
  CHECK_OK(tg_rank_reader(path, r, step, &st, &rd));
  size_t li;
  amber_tensor_info ti;
  uint8_t t[256];
  if (!rd || amber_reader_find(rd, "amber.boxes", &li) != 0 ||
      amber_reader_info(rd, li, &ti) != 0 || ti.dtype != AMBER_U8 || ti.nbytes > sizeof t) {
    CHECK(!"a box table in the rank's file");
    amber_reader_close(rd);
    amber_store_close(st);
    return;
  }
  CHECK(li == amber_reader_count(rd) - 1); /* after the rank's own tensors */
  CHECK_OK(amber_reader_read(rd, li, t, ti.nbytes));
  size_t want = 16 + (4 + 1 + 32) + (r == 0 ? 4 + 1 + 16 : 0);
  CHECK(ti.nbytes == want);
  CHECK(!memcmp(t, "AMBERBX1", 8) && amber__get32(t + 8) == (r == 0 ? 2u : 1u) &&
        amber__get32(t + 12) == 0);
  const uint8_t *b = t + 16;
  CHECK(amber__get16(b) == 1 && b[2] == 2 && b[3] == 0 && b[4] == 'w');
  CHECK(amber__get64(b + 5) == ROWS && amber__get64(b + 13) == COLS);
  CHECK(amber__get64(b + 21) == (uint64_t)(ROWS / 2 * r) && amber__get64(b + 29) == 0);
  if (r == 0) {
    b += 37;
    CHECK(amber__get16(b) == 1 && b[2] == 1 && b[3] == 0 && b[4] == 'b');
    CHECK(amber__get64(b + 5) == 1 && amber__get64(b + 13) == 0);
  }
  amber_reader_close(rd);
  amber_store_close(st);
}

/* A golden multi-rank store whose rank files hold box tables: 3 steps at 2 ranks
 * (full, delta, delta), "w" by rows and "b" replicated. Its values load, each rank
 * file's table holds its boxes byte for byte, and swapping the ranks of "w"'s
 * shards in a copy of its manifest is refused. With AMBER_WRITE_GOLDEN set,
 * (re)writes it into tests/golden/. */
static void test_golden_store_with_box_tables_loads_and_holds_them(void) {
  char p[4200];
  snprintf(p, sizeof p, "%s/tests/golden/v1.3-ranks2-boxes", AMBER_SOURCE_DIR);
  if (getenv("AMBER_WRITE_GOLDEN")) {
    tu_rm_rf(p);
    run(p, 2, 1, 3, 0, NULL);
    tu_system("find %s -name .lock -delete", p);
  }
  for (uint64_t s = 1; s <= 3; s++) CHECK(read_w(p, s, s) == 0);
  for (int r = 0; r < 2; r++)
    for (uint64_t s = 1; s <= 3; s++) check_box_table(p, r, s);
  const char *copy = tu_tmpdir();
  CHECK(tu_system("cp -r %s/. %s", p, copy) == 0);
  tg_patch_manifest(copy, 3, swap_ranks);
  CHECK(read_w(copy, 3, 3) == AMBER_ECORRUPT);
  CHECK(read_w(copy, 2, 2) == 0);
}

/* ---- a store in use ---- */

static atomic_int holder_state; /* 1: the 2-rank job holds its writers; 2: release them */

static void holder_main(const amber_comm *c, void *arg) {
  amber_global_writer *gw = NULL;
  RCHECK(amber_global_writer_open(&gw, arg, c, NULL) == 0);
  float w[ROWS * COLS] = {0};
  int64_t g[2] = {ROWS, COLS}, off[2], sh[2];
  rows(c->rank, c->size, off, sh);
  RCHECK(amber_global_writer_add(gw, "w", AMBER_F32, 2, g, off, sh, w, 0) == 0);
  RCHECK(amber_global_writer_save(gw, 1, 0) == 0);
  c->barrier(c->ctx);
  if (c->rank == 0) atomic_store(&holder_state, 1);
  while (atomic_load(&holder_state) != 2) usleep(1000);
  amber_global_writer_close(gw);
}

static void *holder_job(void *arg) {
  tc_run(2, holder_main, arg);
  return NULL;
}

static void test_store_in_use_is_refused_on_every_rank_and_left_untouched(void) {
  const char *p = tu_tmpdir();
  atomic_store(&rank_fails, 0);
  atomic_store(&holder_state, 0);
  pthread_t th;
  pthread_create(&th, NULL, holder_job, (void *)p);
  while (atomic_load(&holder_state) != 1) usleep(1000);
  job jb = {p, 1, 1, 0, AMBER_ELOCKED, "in use", 0};
  tc_run(3, rank_main, &jb);
  char r2[4200];
  snprintf(r2, sizeof r2, "%s/rank-00002", p);
  CHECK(access(r2, F_OK) != 0); /* nothing created */
  atomic_store(&holder_state, 2);
  pthread_join(th, NULL);
  CHECK(atomic_load(&rank_fails) == 0);
  amber_global_step_info *gs = NULL;
  size_t n = 0;
  CHECK_OK(amber_global_list(p, &gs, &n));
  CHECK(n == 1 && gs[0].world_size == 2);
  amber_free(gs);
}

int main(void) {
  alarm(300); /* a rank stuck in a collective must not hang the suite */
  TEST_RUN(test_store_without_global_is_refused_everywhere_and_keeps_its_files);
  TEST_RUN(test_first_commit_crash_without_global_is_an_empty_store);
  TEST_RUN(test_overlapping_shards_fail_the_step_on_every_rank);
  TEST_RUN(test_manifest_with_overlapping_moved_or_mismatched_shards_is_refused);
  TEST_RUN(test_damaged_or_missing_manifest_is_listed_and_older_steps_read);
  TEST_RUN(test_manifest_removed_while_listing_is_left_out);
  TEST_RUN(test_rank_latest_missing_or_damaged_reads_and_writer_repairs);
  TEST_RUN(test_lone_committed_rank_file_without_latest_is_kept);
  TEST_RUN(test_store_in_use_is_refused_on_every_rank_and_left_untouched);
  TEST_RUN(test_golden_store_with_box_tables_loads_and_holds_them);
  return tu_finish();
}

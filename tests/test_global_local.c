/*
 * test_global_local.c - the global writer's local mode (AMBER_WRITER_GLOBAL_LOCAL,
 * src/glocal.c), with thread ranks and one directory per simulated host: every
 * path gets each step's manifest and GLOBAL; a reader of one path restores its
 * ranks' own shards bit-exactly (and the replicated tensors where rank 0's files
 * are); an open after a crash between the paths' copies agrees on the step (rolls
 * a copied step forward, drops an uncopied one, takes the newest complete step) and
 * installs what a path lacks; a wiped path is refused, nothing removed, and so are
 * paths of another world size; a copy that fails on one path fails the step
 * everywhere; ranks may share a path.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "amber.h"
#include "global.h"
#include "local_job.h"
#include "testutil.h"

/* GLOBAL's step of `dir` (AMBER_NO_STEP when absent or damaged). */
static uint64_t global_of(const char *dir) {
  uint64_t s;
  return amber__global_read_latest(dir, NULL, &s) == 0 ? s : AMBER_NO_STEP;
}

static int exists(const char *path) {
  return access(path, F_OK) == 0;
}

static int has_manifest(const char *dir, uint64_t step) {
  char p[4300];
  lj_manifest_name(dir, step, p, sizeof p);
  return exists(p);
}

static int has_rank_file(const char *dir, int r, uint64_t step) {
  char p[4300];
  snprintf(p, sizeof p, "%.4000s/rank-%05d/ckpt-%020llu.amber", dir, r, (unsigned long long)step);
  return exists(p);
}

/* `nd` host directories under a fresh temporary directory; rank r's is
 * dirs[r * nd / n]. */
static void make_hosts(lj_job *jb, int n, int nd, char dirs[][4200]) {
  const char *t = tu_tmpdir();
  for (int h = 0; h < nd; h++) snprintf(dirs[h], 4200, "%.4000s/host%d", t, h);
  for (int r = 0; r < n; r++) jb->dir[r] = dirs[r * nd / n];
}

/* Every rank's own rows at every step in [from, to] from its own path; "b" where
 * rank 0's files are (its path), and on other paths a failure naming rank 0. */
static void check_all(const lj_job *jb, int n, uint64_t from, uint64_t to) {
  for (uint64_t s = from; s <= to; s++)
    for (int r = 0; r < n; r++) {
      int with_rank0 = !strcmp(jb->dir[r], jb->dir[0]);
      int rc = lj_check_rank(jb->dir[r], s, s, r, n, with_rank0);
      CHECK_OK(rc);
      if (!with_rank0) {
        CHECK_RC(lj_check_rank(jb->dir[r], s, s, r, n, 1), AMBER_ENOENT);
        CHECK(strstr(amber_last_error(NULL), "rank 0") != NULL);
      }
    }
}

static void test_every_path_gets_the_manifest_and_global_and_reads_its_ranks(void) {
  char dirs[4][4200];
  lj_job jb = lj_job_init();
  make_hosts(&jb, 4, 4, dirs);
  jb.first = 1, jb.last = 4;
  lj_run(&jb, 4);
  for (int h = 0; h < 4; h++) {
    CHECK(global_of(dirs[h]) == 4);
    for (uint64_t s = 1; s <= 4; s++) {
      char a[4300], b[4300];
      lj_manifest_name(dirs[0], s, a, sizeof a);
      lj_manifest_name(dirs[h], s, b, sizeof b);
      size_t la = 0, lb = 0;
      uint8_t *x = tu_read_file(a, &la), *y = tu_read_file(b, &lb);
      CHECK(x && y && la == lb && !memcmp(x, y, la)); /* the same bytes on every path */
      free(x), free(y);
    }
    for (int r = 0; r < 4; r++) /* a path holds its own rank's store only */
      CHECK(has_rank_file(dirs[h], r, 4) == (r == h));
    amber_global_step_info *info;
    size_t n;
    CHECK_OK(amber_global_list(dirs[h], &info, &n));
    CHECK(n == 4 && info[0].kind == AMBER_KIND_FULL && info[3].kind == AMBER_KIND_DELTA);
    amber_free(info);
  }
  check_all(&jb, 4, 1, 4);
}

static void test_ranks_sharing_a_path_and_retention(void) {
  char dirs[2][4200];
  lj_job jb = lj_job_init();
  make_hosts(&jb, 4, 2, dirs); /* ranks 0, 1 on host 0; 2, 3 on host 1 */
  jb.first = 1, jb.last = 5, jb.keep_last = 2;
  lj_run(&jb, 4);
  for (int h = 0; h < 2; h++) {
    CHECK(global_of(dirs[h]) == 5);
    for (uint64_t s = 1; s <= 5; s++) CHECK(has_manifest(dirs[h], s) == (s >= 4));
  }
  check_all(&jb, 4, 4, 5);
  /* background commits (a communicator usable from any thread) in local mode */
  tc_flags = AMBER_COMM_ANY_THREAD;
  jb.first = 6, jb.last = 8;
  lj_run(&jb, 4);
  tc_flags = 0;
  check_all(&jb, 4, 7, 8);
}

/* Saves steps 1..3, keeps each path's GLOBAL (and rank 2's LATEST) of step 3, then
 * saves step 4: the caller then puts back what a crash would have left. */
typedef struct snapshot {
  uint8_t *global[4];
  size_t global_len[4];
  uint8_t *latest2;
  size_t latest2_len;
} snapshot;

static void save_1_to_4(lj_job *jb, char dirs[][4200], snapshot *sn) {
  make_hosts(jb, 4, 4, dirs);
  jb->first = 1, jb->last = 3;
  lj_run(jb, 4);
  char p[4300];
  for (int h = 0; h < 4; h++) {
    snprintf(p, sizeof p, "%.4000s/GLOBAL", dirs[h]);
    sn->global[h] = tu_read_file(p, &sn->global_len[h]);
  }
  snprintf(p, sizeof p, "%.4000s/rank-00002/LATEST", dirs[2]);
  sn->latest2 = tu_read_file(p, &sn->latest2_len);
  jb->first = jb->last = 4;
  lj_run(jb, 4);
}

/* Path h as a crash before its copy of step 4 left it: no manifest 4, GLOBAL 3. */
static void uncopy(char dirs[][4200], const snapshot *sn, int h, int keep_manifest) {
  char p[4300];
  if (!keep_manifest) {
    lj_manifest_name(dirs[h], 4, p, sizeof p);
    CHECK(unlink(p) == 0);
  }
  snprintf(p, sizeof p, "%.4000s/GLOBAL", dirs[h]);
  CHECK(tu_write_file(p, sn->global[h], sn->global_len[h]) == 0);
}

static void free_snapshot(snapshot *sn) {
  for (int h = 0; h < 4; h++) free(sn->global[h]);
  free(sn->latest2);
}

/* Reopens the job for step 5 and checks what every path then says. */
static void resume_and_check(lj_job *jb, char dirs[][4200], int with4) {
  jb->first = jb->last = 5;
  lj_run(jb, 4);
  for (int h = 0; h < 4; h++) {
    CHECK(global_of(dirs[h]) == 5);
    CHECK(has_manifest(dirs[h], 4) == with4);
    CHECK(has_rank_file(dirs[h], h, 4) == with4);
  }
  check_all(jb, 4, with4 ? 3 : 5, 5);
  if (with4) check_all(jb, 4, 4, 4);
  else
    for (int r = 0; r < 4; r++) CHECK_RC(lj_check_rank(dirs[r], 4, 4, r, 4, 0), AMBER_ENOENT);
}

static void test_open_rolls_forward_a_step_that_only_rank_0s_path_committed(void) {
  char dirs[4][4200];
  lj_job jb = lj_job_init();
  snapshot sn;
  save_1_to_4(&jb, dirs, &sn);
  for (int h = 1; h < 4; h++) uncopy(dirs, &sn, h, 0);
  CHECK(global_of(dirs[0]) == 4 && global_of(dirs[1]) == 3);
  resume_and_check(&jb, dirs, 1);
  free_snapshot(&sn);
}

static void test_open_rolls_forward_a_manifest_that_no_global_names_yet(void) {
  char dirs[4][4200];
  lj_job jb = lj_job_init();
  snapshot sn;
  save_1_to_4(&jb, dirs, &sn);
  /* only the last path wrote its manifest of 4, and no path moved GLOBAL */
  for (int h = 0; h < 4; h++) uncopy(dirs, &sn, h, h == 3);
  resume_and_check(&jb, dirs, 1);
  free_snapshot(&sn);
}

static void test_open_drops_a_step_that_no_path_copied(void) {
  char dirs[4][4200];
  lj_job jb = lj_job_init();
  snapshot sn;
  save_1_to_4(&jb, dirs, &sn);
  /* every rank's part of 4 is committed in its store, but no copy was written */
  for (int h = 0; h < 4; h++) uncopy(dirs, &sn, h, 0);
  resume_and_check(&jb, dirs, 0);
  free_snapshot(&sn);
}

static void test_open_takes_the_newest_step_every_rank_holds(void) {
  char dirs[4][4200];
  lj_job jb = lj_job_init();
  snapshot sn;
  save_1_to_4(&jb, dirs, &sn);
  /* rank 2's part of step 4 is gone (its store back at 3): step 4 cannot load, every
   * path goes back to 3 */
  char p[4300];
  snprintf(p, sizeof p, "%.4000s/rank-00002/LATEST", dirs[2]);
  CHECK(tu_write_file(p, sn.latest2, sn.latest2_len) == 0);
  snprintf(p, sizeof p, "%.4000s/rank-00002/ckpt-%020d.amber", dirs[2], 4);
  CHECK(unlink(p) == 0);
  resume_and_check(&jb, dirs, 0);
  free_snapshot(&sn);
}

static void test_a_wiped_path_is_refused_on_every_rank_and_nothing_is_removed(void) {
  char dirs[4][4200];
  lj_job jb = lj_job_init();
  make_hosts(&jb, 4, 2, dirs);
  jb.first = 1, jb.last = 3;
  lj_run(&jb, 4);
  char saved[4300];
  snprintf(saved, sizeof saved, "%.4000s.saved", dirs[1]);
  CHECK(tu_system("cp -a '%s' '%s' && rm -rf '%s'", dirs[1], saved, dirs[1]) == 0);
  jb.first = jb.last = 4;
  atomic_store(&rank_fails, 0);
  tc_run(4, lj_rank, &jb);
  for (int r = 0; r < 4; r++) {
    CHECK(jb.open_rc[r] == AMBER_ECORRUPT);
    CHECK(strstr(jb.open_msg[r], "amber_tiers_restore") != NULL);
    CHECK(!strcmp(jb.open_msg[r], jb.open_msg[0]));
  }
  fprintf(stderr, "  (expected) %s\n", jb.open_msg[0]);
  CHECK(global_of(dirs[0]) == 3);
  for (uint64_t s = 1; s <= 3; s++)
    CHECK(has_manifest(dirs[0], s) && has_rank_file(dirs[0], 0, s) && has_rank_file(dirs[0], 1, s));
  /* the directory back (as a restore from a peer puts it): the job goes on */
  CHECK(tu_system("rm -rf '%s' && mv '%s' '%s'", dirs[1], saved, dirs[1]) == 0);
  lj_run(&jb, 4);
  check_all(&jb, 4, 3, 4);
}

static void test_a_copy_that_fails_on_one_path_fails_the_step_everywhere(void) {
  char dirs[4][4200];
  lj_job jb = lj_job_init();
  make_hosts(&jb, 4, 4, dirs);
  jb.first = 1, jb.last = 4, jb.block_rank = 2, jb.block_step = 3;
  lj_run(&jb, 4);
  for (int r = 0; r < 4; r++) {
    CHECK(jb.save_rc[r] < 0);
    CHECK(strstr(jb.save_msg[r], "rank 2 failed") != NULL);
  }
  fprintf(stderr, "  (expected) %s\n", jb.save_msg[0]);
  for (int h = 0; h < 4; h++) {
    CHECK(global_of(dirs[h]) == 4);
    CHECK(!has_manifest(dirs[h], 3) && !has_rank_file(dirs[h], h, 3));
    CHECK_RC(lj_check_rank(dirs[h], 3, 3, h, 4, 0), AMBER_ENOENT);
  }
  amber_global_step_info *info;
  size_t n;
  CHECK_OK(amber_global_list(dirs[1], &info, &n));
  CHECK(n == 3 && info[2].step == 4 && info[2].kind == AMBER_KIND_FULL);
  amber_free(info);
  check_all(&jb, 4, 4, 4);
  check_all(&jb, 4, 1, 2);
}

static void test_paths_of_another_world_size_are_refused(void) {
  char dirs[4][4200];
  lj_job jb = lj_job_init();
  make_hosts(&jb, 4, 4, dirs);
  jb.first = 1, jb.last = 2;
  lj_run(&jb, 4);
  jb.first = jb.last = 3;
  tc_run(2, lj_rank, &jb); /* dirs 0 and 1, at 2 ranks */
  for (int r = 0; r < 2; r++) {
    CHECK(jb.open_rc[r] == AMBER_ECORRUPT);
    CHECK(strstr(jb.open_msg[r], "another world size") != NULL);
  }
  CHECK(global_of(dirs[0]) == 2 && has_rank_file(dirs[0], 0, 2));
}

static void test_single_rank_writers_refuse_the_local_flag(void) {
  amber_store *st;
  CHECK_OK(amber_store_open(&st, tu_tmpdir(), NULL));
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.flags = AMBER_WRITER_GLOBAL_LOCAL;
  amber_writer *w = NULL;
  CHECK_RC(amber_writer_open(&w, st, &wo), AMBER_EINVAL);
  amber_store_close(st);
}

int main(void) {
  TEST_RUN(test_every_path_gets_the_manifest_and_global_and_reads_its_ranks);
  TEST_RUN(test_ranks_sharing_a_path_and_retention);
  TEST_RUN(test_open_rolls_forward_a_step_that_only_rank_0s_path_committed);
  TEST_RUN(test_open_rolls_forward_a_manifest_that_no_global_names_yet);
  TEST_RUN(test_open_drops_a_step_that_no_path_copied);
  TEST_RUN(test_open_takes_the_newest_step_every_rank_holds);
  TEST_RUN(test_a_wiped_path_is_refused_on_every_rank_and_nothing_is_removed);
  TEST_RUN(test_a_copy_that_fails_on_one_path_fails_the_step_everywhere);
  TEST_RUN(test_paths_of_another_world_size_are_refused);
  TEST_RUN(test_single_rank_writers_refuse_the_local_flag);
  return tu_finish();
}

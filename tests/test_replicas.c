/*
 * test_replicas.c - peer replicas and the restore from the fastest tier
 * (src/replicas.c, src/trestore.c), with thread ranks and one directory per simulated
 * host (tests/local_job.h): the peers are a ring over hosts; every step is replicated
 * at about one delta per rank; a wiped host restores bit-identical from its peer; all
 * memory lost restores the durable tier's newest step (into memory, and the job goes
 * on from it; at another world size from the durable tier itself); a host lost
 * without a replica mixes tiers on the durable tier's step; a replication error is
 * the same on every rank and sticky, and a new replicator sends only what the peers
 * lack; a job SIGKILLed at random moments (during replications too) leaves no torn
 * step in any tier, and restarts from the restored step, host wiped or not.
 */
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "amber.h"
#include "global.h"
#include "local_job.h"
#include "testutil.h"

#define MAXS 256

typedef struct rep_ctx {
  uint32_t replicas;
  uint64_t keep_last;
  int fail_rank;        /* with fail_step: that rank's fail_at-th sendrecv of the step fails */
  uint64_t fail_step;
  int fail_at;
  uint64_t reopen_step; /* each rank closes its replicator and opens a new one there */
  amber_replicas *r[64];
  int rc[64][MAXS];
  char msg[64][512];
  amber_replicas_stats st[64][MAXS];
} rep_ctx;

/* each rank's replicator, opened at its first step (collectively: every rank's first
 * committed step is the same), on the thread ranks' own p2p; a host is a directory */
static void rep_after(const amber_comm *c, lj_job *jb, uint64_t step) {
  rep_ctx *x = jb->user;
  int me = c->rank;
  if (step == x->reopen_step) amber_replicas_close(x->r[me]), x->r[me] = NULL;
  if (step == x->fail_step && me == x->fail_rank)
    atomic_store(&tc_sendrecv_fail_at[me], x->fail_at);
  if (!x->r[me]) {
    amber_replicas_opts o;
    amber_replicas_opts_init(&o);
    o.host = jb->dir[me], o.keep_last = x->keep_last;
    RCHECK(amber_replicas_open(&x->r[me], jb->dir[me], c, tc_p2p(c), x->replicas, &o) == 0);
    if (!x->r[me]) return;
  }
  int rc = amber_replicas_step(x->r[me], step);
  if (step < MAXS) {
    x->rc[me][step] = rc;
    amber_replicas_stats_get(x->r[me], &x->st[me][step]);
  }
  if (rc < 0) snprintf(x->msg[me], sizeof x->msg[0], "%s", amber_last_error(x->r[me]));
}

static void rep_done(const amber_comm *c, lj_job *jb) {
  rep_ctx *x = jb->user;
  amber_replicas_close(x->r[c->rank]);
  x->r[c->rank] = NULL;
}

/* ---- the restore, on every rank ---- */

typedef struct rs_job {
  const char *dir[64];
  const char *durable;
  amber_tiers_result res[64];
  int rc[64];
  char msg[64][512];
} rs_job;

static void rs_rank(const amber_comm *c, void *arg) {
  rs_job *j = arg;
  j->rc[c->rank] = amber_tiers_restore(j->dir[c->rank], j->durable, c, tc_p2p(c),
                                       &j->res[c->rank]);
  snprintf(j->msg[c->rank], sizeof j->msg[0], "%s", amber_last_error(NULL));
}

static void restore(rs_job *j, const lj_job *jb, int n, const char *durable) {
  memset(j, 0, sizeof *j);
  for (int r = 0; r < n; r++) j->dir[r] = jb->dir[r];
  j->durable = durable;
  tc_run(n, rs_rank, j);
  for (int r = 0; r < n; r++) {
    CHECK_OK(j->rc[r]);
    if (j->rc[r]) fprintf(stderr, "  rank %d: %s\n", r, j->msg[r]);
    CHECK(j->res[r].step == j->res[0].step); /* the same step everywhere */
  }
}

/* Every rank reads its rows and "b" at the restored step from where the restore
 * says, bit for bit. */
static void check_restored(const rs_job *j, int n, uint64_t want) {
  for (int r = 0; r < n; r++) {
    if (j->res[r].step != want)
      fprintf(stderr, "  rank %d restored step %lld (tier %u), wanted %llu\n", r,
              (long long)j->res[r].step, j->res[r].tier, (unsigned long long)want);
    CHECK(j->res[r].step == want);
    if (j->res[r].step != want || !j->res[r].dir) continue;
    CHECK_OK(lj_check_rank(j->res[r].dir, want, want, r, n, 1));
  }
}

static void make_hosts(lj_job *jb, int n, int nd, char dirs[][4200]) {
  const char *t = tu_tmpdir();
  for (int h = 0; h < nd; h++) snprintf(dirs[h], 4200, "%.4000s/host%d", t, h);
  for (int r = 0; r < n; r++) jb->dir[r] = dirs[r * nd / n];
}

static void wipe(const char *dir) {
  CHECK(tu_system("rm -rf '%s'", dir) == 0);
}

/* ---- peers ---- */

typedef struct peer_job {
  const char *host[8];
  uint32_t replicas;
  int peers[8][8];
  size_t n[8];
  const char *dir;
} peer_job;

static void peer_rank(const amber_comm *c, void *arg) {
  peer_job *p = arg;
  amber_replicas_opts o;
  amber_replicas_opts_init(&o);
  o.host = p->host[c->rank];
  amber_replicas *r = NULL;
  RCHECK(amber_replicas_open(&r, p->dir, c, tc_p2p(c), p->replicas, &o) == 0);
  if (r) RCHECK(amber_replicas_peers(r, p->peers[c->rank], 8, &p->n[c->rank]) == 0);
  amber_replicas_close(r);
}

static void check_peers(int n, uint32_t replicas, const char *hosts, const char *want) {
  peer_job p;
  memset(&p, 0, sizeof p);
  static char names[8][2];
  for (int r = 0; r < n; r++) names[r][0] = hosts[r], names[r][1] = 0, p.host[r] = names[r];
  p.replicas = replicas;
  p.dir = tu_tmpdir();
  atomic_store(&rank_fails, 0);
  tc_run(n, peer_rank, &p);
  CHECK(atomic_load(&rank_fails) == 0);
  char got[128] = "";
  size_t o = 0;
  for (int r = 0; r < n; r++) {
    o += (size_t)snprintf(got + o, sizeof got - o, "%s", r ? "|" : "");
    for (size_t k = 0; k < p.n[r] && k < 8; k++)
      o += (size_t)snprintf(got + o, sizeof got - o, "%d", p.peers[r][k]);
  }
  if (strcmp(got, want))
    fprintf(stderr, "  hosts %s, replicas %u: peers %s, wanted %s\n", hosts, replicas, got, want);
  CHECK(!strcmp(got, want));
}

static void test_peers_are_a_ring_over_hosts(void) {
  check_peers(4, 1, "aabb", "2|3|0|1");   /* the i-th rank of the next host */
  check_peers(4, 3, "aabb", "2|3|0|1");   /* one replica per other host */
  check_peers(4, 2, "abcd", "12|23|30|01");
  check_peers(3, 1, "aab", "2|2|0");      /* a host of one rank keeps both */
  check_peers(4, 2, "abab", "1|0|3|2");   /* hosts by name, not by rank order */
  check_peers(3, 2, "aaa", "||");         /* one host: no replicas */
}

/* ---- replication and restore ---- */

static void test_a_wiped_host_restores_bit_identical_from_its_peer(void) {
  char dirs[4][4200];
  lj_job jb = lj_job_init();
  rep_ctx *x = calloc(1, sizeof *x);
  make_hosts(&jb, 4, 4, dirs);
  x->replicas = 1;
  jb.user = x, jb.after = rep_after, jb.done = rep_done;
  jb.first = 1, jb.last = 6;
  lj_run(&jb, 4);
  for (int r = 0; r < 4; r++) {
    for (uint64_t s = 1; s <= 6; s++) CHECK(x->rc[r][s] == 0);
    /* about one delta per rank per step: a delta step sends far less than the first */
    CHECK(x->st[r][1].sent_bytes > 0);
    for (uint64_t s = 2; s <= 6; s++) CHECK(x->st[r][s].sent_bytes * 3 < x->st[r][1].sent_bytes);
    /* rank r's peer is rank r+1 (the next host): its replica there is at step 6 */
    char p[4300];
    snprintf(p, sizeof p, "%.4000s/rank-%05d/LATEST", dirs[(r + 1) % 4], r);
    CHECK(access(p, F_OK) == 0);
  }
  printf("  replication: step 1 %llu bytes, step 6 %llu bytes (rank 1)\n",
         (unsigned long long)x->st[1][1].sent_bytes, (unsigned long long)x->st[1][6].sent_bytes);
  wipe(dirs[2]);
  rs_job j;
  restore(&j, &jb, 4, NULL);
  check_restored(&j, 4, 6);
  CHECK(j.res[2].tier == AMBER_RESTORE_PEER && j.res[2].fetched_bytes > 0);
  CHECK(j.res[0].tier == AMBER_RESTORE_MEMORY);
  CHECK(j.res[1].tier == AMBER_RESTORE_MEMORY); /* rank 0's replica is on host 1 */
  CHECK(j.res[3].tier == AMBER_RESTORE_PEER);   /* rank 0's part ("b") fetched */
  CHECK(j.res[0].ranks_memory == 2 && j.res[0].ranks_peer == 2);
  /* the job goes on from the restored step, replicating again */
  jb.first = 7, jb.last = 8;
  lj_run(&jb, 4);
  for (int r = 0; r < 4; r++) CHECK(x->rc[r][8] == 0);
  restore(&j, &jb, 4, NULL);
  check_restored(&j, 4, 8);
  free(x);
}

/* A directory that keeps rank 0's part of a step in another state than the step's
 * manifest names (a killed job wrote the step there, and the next job wrote it again
 * after its restore) does not hold that part: the restore fetches it again, over the
 * stale file, instead of reading the stale file (AMBER_ECORRUPT: "state id differs"). */
static void test_a_stale_part_of_the_step_is_fetched_again(void) {
  char dirs[4][4200];
  lj_job jb = lj_job_init();
  rep_ctx *x = calloc(1, sizeof *x);
  make_hosts(&jb, 4, 4, dirs);
  x->replicas = 1;
  jb.user = x, jb.after = rep_after, jb.done = rep_done;
  jb.first = 1, jb.last = 3;
  lj_run(&jb, 4);
  /* host 3's copy of rank 0's part: one full checkpoint of step 3 in another state */
  char stale[4300];
  snprintf(stale, sizeof stale, "%.4000s/rank-%05d", dirs[3], 0);
  wipe(stale);
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, stale, NULL));
  amber_writer *w = NULL;
  if (st) CHECK_OK(amber_writer_open(&w, st, NULL));
  float other[4] = {1, 2, 3, 4};
  int64_t shape[1] = {4};
  if (w) {
    CHECK_OK(amber_writer_add(w, "other", AMBER_F32, 1, shape, other, NULL));
    CHECK_OK(amber_writer_save(w, 3, AMBER_SAVE_FULL));
  }
  amber_writer_close(w);
  amber_store_close(st);
  rs_job j;
  restore(&j, &jb, 4, NULL);
  check_restored(&j, 4, 3);
  CHECK(j.res[3].tier == AMBER_RESTORE_PEER && j.res[3].fetched_bytes > 0);
  free(x);
}

/* The durable tier written directly (as a drain would): a shared store of the same
 * job's steps 1..last. */
static void write_durable(const char *durable, int n, uint64_t last) {
  lj_job d = lj_job_init();
  for (int r = 0; r < n; r++) d.dir[r] = durable;
  d.shared = 1, d.first = 1, d.last = last;
  lj_run(&d, n);
}

static void test_all_memory_lost_restores_the_durable_tiers_newest_step(void) {
  char dirs[4][4200], durable[4300];
  lj_job jb = lj_job_init();
  rep_ctx *x = calloc(1, sizeof *x);
  make_hosts(&jb, 4, 2, dirs);
  snprintf(durable, sizeof durable, "%.4000s/durable", tu_tmpdir());
  write_durable(durable, 4, 4);
  x->replicas = 1;
  jb.user = x, jb.after = rep_after, jb.done = rep_done;
  jb.first = 1, jb.last = 6;
  lj_run(&jb, 4);
  wipe(dirs[0]), wipe(dirs[1]);
  rs_job j;
  restore(&j, &jb, 4, durable);
  check_restored(&j, 4, 4);
  for (int r = 0; r < 4; r++) {
    CHECK(j.res[r].tier == AMBER_RESTORE_DURABLE && j.res[r].dir == jb.dir[r]);
    CHECK(j.res[r].world_size == 4);
  }
  /* the memory tier holds step 4 whole again: the job goes on from it */
  jb.first = 5, jb.last = 6;
  lj_run(&jb, 4);
  restore(&j, &jb, 4, durable);
  check_restored(&j, 4, 6);
  for (int r = 0; r < 4; r++) CHECK(j.res[r].tier != AMBER_RESTORE_DURABLE);
  /* at another world size the memory tier does not serve: the durable tier does, as
   * it is (its step 4, written by 4 ranks, read by 2) */
  rs_job k;
  memset(&k, 0, sizeof k);
  k.dir[0] = dirs[0], k.dir[1] = dirs[1], k.durable = durable;
  tc_run(2, rs_rank, &k);
  for (int r = 0; r < 2; r++) {
    CHECK_OK(k.rc[r]);
    CHECK(k.res[r].step == 4 && k.res[r].tier == AMBER_RESTORE_DURABLE);
    CHECK(k.res[r].world_size == 4 && k.res[r].dir == durable);
    CHECK_OK(lj_check_rank(durable, 4, 4, r, 2, 1));
  }
  free(x);
}

/* The durable tier as a drain of steps 1..`last` leaves it: the hosts' own files
 * (each rank's store, rank 0's manifests and GLOBAL), not another job's. A step that
 * mixes tiers needs the very files the memory tiers' manifest names: a separate job
 * writes the same steps only as long as it runs the same way (it did not always,
 * and the restore then read a part whose state id the manifest does not name). */
static void drain_copy(char dirs[][4200], int n, const char *durable) {
  CHECK(tu_system("mkdir -p '%s'", durable) == 0);
  for (int r = 0; r < n; r++)
    CHECK(tu_system("cp -r '%s/rank-%05d' '%s/'", dirs[r], r, durable) == 0);
  CHECK(tu_system("cp '%s'/step-*.manifest '%s/GLOBAL' '%s/'", dirs[0], dirs[0], durable) == 0);
}

static void test_a_host_lost_without_a_replica_mixes_tiers_on_the_durable_step(void) {
  char dirs[4][4200], durable[4300];
  lj_job jb = lj_job_init();
  make_hosts(&jb, 4, 4, dirs);
  snprintf(durable, sizeof durable, "%.4000s/durable", tu_tmpdir());
  jb.first = 1, jb.last = 3; /* no replicas */
  lj_run(&jb, 4);
  drain_copy(dirs, 4, durable);
  jb.first = 4, jb.last = 5;
  lj_run(&jb, 4);
  wipe(dirs[1]);
  rs_job j;
  restore(&j, &jb, 4, durable);
  check_restored(&j, 4, 3);
  CHECK(j.res[0].tier == AMBER_RESTORE_MEMORY);
  CHECK(j.res[1].tier == AMBER_RESTORE_DURABLE);
  CHECK(j.res[2].tier == AMBER_RESTORE_PEER); /* rank 0's part, from host 0 */
  CHECK(j.res[0].ranks_durable == 1 && j.res[0].ranks_peer == 2);
  /* the job goes on from step 3: its writer agrees on it, dropping 4 and 5 */
  jb.first = 4, jb.last = 5;
  lj_run(&jb, 4);
  for (int r = 0; r < 4; r++) CHECK_OK(lj_check_rank(dirs[r], 5, 5, r, 4, r == 0));
}

static void test_replication_errors_are_the_same_everywhere_and_sticky(void) {
  char dirs[4][4200];
  lj_job jb = lj_job_init();
  rep_ctx *x = calloc(1, sizeof *x);
  make_hosts(&jb, 4, 4, dirs);
  x->replicas = 1;
  /* rank 2's exchange of the bytes in step 3 breaks (its second sendrecv: the sizes,
   * then the bytes, in the one round of a ring of one replica); step 4 meets the
   * stopped replicator; step 5 opens a new one */
  x->fail_rank = 2, x->fail_step = 3, x->fail_at = 2, x->reopen_step = 5;
  jb.user = x, jb.after = rep_after, jb.done = rep_done;
  jb.first = 1, jb.last = 5;
  lj_run(&jb, 4);
  for (int r = 0; r < 4; r++) {
    CHECK(x->rc[r][2] == 0 && x->rc[r][3] == AMBER_EIO && x->rc[r][4] == AMBER_EIO);
    CHECK(strstr(x->msg[r], "rank 2: step 3") != NULL);
    CHECK(strstr(x->msg[r], "replication stopped") != NULL);
    /* the new replicator: the peers hold step 2, so step 5 sends about a delta */
    CHECK(x->rc[r][5] == 0);
    CHECK(x->st[r][5].sent_bytes * 3 < x->st[r][1].sent_bytes);
  }
  fprintf(stderr, "  (expected) %s\n", x->msg[0]);
  wipe(dirs[3]);
  rs_job j;
  restore(&j, &jb, 4, NULL);
  check_restored(&j, 4, 5);
  free(x);
}

/* ---- killed at random moments ---- */

typedef struct kill_job {
  lj_job jb; /* the template of each rank's job */
  rep_ctx x;
} kill_job;

/* In the child: a failed check ends it at once with status 3, which the parent sees
 * (it is killed otherwise); a step every millisecond, so that kills land anywhere. */
static void kill_after(const amber_comm *c, lj_job *jb, uint64_t step) {
  rep_after(c, jb, step);
  if (atomic_load(&rank_fails)) _exit(3);
  usleep(1000);
}

/* The child's rank: restores, then saves and replicates steps until it is killed. */
static void kill_rank(const amber_comm *c, void *arg) {
  kill_job *k = arg;
  amber_tiers_result res;
  int rc = amber_tiers_restore(k->jb.dir[c->rank], NULL, c, tc_p2p(c), &res);
  RCHECK(rc == 0);
  if (rc < 0) _exit(3);
  lj_job *mine = malloc(sizeof *mine);
  *mine = k->jb;
  mine->first = res.step == AMBER_NO_STEP ? 1 : res.step + 1;
  mine->last = mine->first + 100;
  if (mine->last >= MAXS) mine->last = MAXS - 1;
  lj_rank(c, mine);
  if (atomic_load(&rank_fails)) _exit(3);
  free(mine);
}

/* No tier shows a torn step: each path's GLOBAL step reads back exactly for the
 * ranks that write there, and every rank store there (replicas too) opens at its
 * LATEST, verifies, and holds that step's rows exactly. */
static void check_no_torn_step(const lj_job *jb, char dirs[][4200], int n, int nd) {
  for (int h = 0; h < nd; h++) {
    amber_global_step_info *info = NULL;
    size_t cnt = 0;
    CHECK_OK(amber_global_list(dirs[h], &info, &cnt));
    if (cnt) {
      uint64_t g = info[cnt - 1].step;
      for (int r = 0; r < n; r++)
        if (jb->dir[r] == dirs[h]) CHECK_OK(lj_check_rank(dirs[h], g, g, r, n, 0));
    }
    amber_free(info);
    for (int q = 0; q < n; q++) {
      char p[4300];
      snprintf(p, sizeof p, "%.4000s/rank-%05d", dirs[h], q);
      amber_store_opts so;
      amber_store_opts_init(&so);
      so.flags = AMBER_OPEN_READONLY;
      amber_store *st;
      if (amber_store_open(&st, p, &so) < 0) continue;
      uint64_t l;
      amber_reader *rd = NULL;
      if (amber_store_latest(st, &l) == 0) {
        CHECK_OK(amber_reader_open(&rd, st, l, NULL));
        if (rd) CHECK_OK(amber_reader_verify(rd));
        int64_t off[2], sh[2];
        lj_rows(q, n, off, sh);
        size_t i, cntw = (size_t)(sh[0] * sh[1]);
        float *got = malloc(cntw * sizeof *got + 1), *exp = malloc(cntw * sizeof *exp + 1);
        for (int64_t a = 0; a < sh[0]; a++)
          for (int64_t b = 0; b < LJ_COLS; b++) exp[a * LJ_COLS + b] = lj_w(off[0] + a, b, l);
        if (rd && amber_reader_find(rd, "w", &i) == 0)
          CHECK_OK(amber_reader_read(rd, i, got, cntw * sizeof *got));
        CHECK(rd && !memcmp(got, exp, cntw * sizeof *got));
        free(got), free(exp);
      }
      amber_reader_close(rd);
      amber_store_close(st);
    }
  }
}

static void test_kills_during_saves_and_replications_leave_no_torn_step(void) {
  const char *env = getenv("AMBER_KILL_ITERS");
  int iters = env ? atoi(env) / 10 : 6;
  if (iters < 3) iters = 3;
  char dirs[4][4200];
  kill_job *k = calloc(1, sizeof *k);
  k->jb = lj_job_init();
  make_hosts(&k->jb, 4, 4, dirs);
  k->x.replicas = 1;
  k->jb.user = &k->x, k->jb.after = kill_after, k->jb.done = rep_done;
  uint64_t seed = (uint64_t)time(NULL) * 2654435761u;
  printf("  kill seed %llu\n", (unsigned long long)seed);
  uint64_t last = 0;
  for (int it = 0; it < iters; it++) {
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
      tc_run(4, kill_rank, k);
      _exit(0);
    }
    usleep((useconds_t)(20000 + tu_rand(&seed) % 300000));
    kill(pid, SIGKILL);
    int status;
    waitpid(pid, &status, 0);
    CHECK(WIFSIGNALED(status) || (WIFEXITED(status) && WEXITSTATUS(status) == 0));
    check_no_torn_step(&k->jb, dirs, 4, 4);
    /* and a host lost with it, once its rank's files have a replica on the next host */
    int h = (int)(tu_rand(&seed) % 4);
    char rep[4300];
    snprintf(rep, sizeof rep, "%.4000s/rank-%05d/LATEST", dirs[(h + 1) % 4], h);
    if (it % 2 && access(rep, F_OK) == 0) wipe(dirs[h]);
    rs_job j;
    restore(&j, &k->jb, 4, NULL);
    if (j.res[0].step != AMBER_NO_STEP) {
      check_restored(&j, 4, j.res[0].step);
      last = j.res[0].step;
    }
    printf("  kill %d: restored step %llu (%u from memory, %u from peers)\n", it,
           (unsigned long long)j.res[0].step, j.res[0].ranks_memory, j.res[0].ranks_peer);
  }
  CHECK(last > 0);
  free(k);
}

int main(void) {
  TEST_RUN(test_peers_are_a_ring_over_hosts);
  TEST_RUN(test_a_wiped_host_restores_bit_identical_from_its_peer);
  TEST_RUN(test_a_stale_part_of_the_step_is_fetched_again);
  TEST_RUN(test_all_memory_lost_restores_the_durable_tiers_newest_step);
  TEST_RUN(test_a_host_lost_without_a_replica_mixes_tiers_on_the_durable_step);
  TEST_RUN(test_replication_errors_are_the_same_everywhere_and_sticky);
  TEST_RUN(test_kills_during_saves_and_replications_leave_no_torn_step);
  return tu_finish();
}

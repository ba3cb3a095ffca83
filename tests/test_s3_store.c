/*
 * test_s3_store.c - s3:// stores against a real S3 server (tests/s3_server.py's
 * moto behind its fault proxy): a memory tier drained to an s3:// store by the commit
 * rule for objects (each object uploaded whole and confirmed, the pointer last), and
 * the store read straight from its objects by ranges. Pinned here:
 *  - every drained step restores bit-identically from the object store, single- and
 *    multi-rank (read at another world size), and a box of a tensor reads only the
 *    chunks that hold it;
 *  - a drain SIGKILLed at random moments, or failing (a refused request, the retries
 *    of a connection cut or a 503 run out, the server down and up), leaves only whole
 *    steps visible to a reader of the bucket, loses nothing committed, and the next
 *    drain finishes;
 *  - refused credentials and a missing bucket fail at once, naming the object;
 *  - compact and prune work on the object store, a writer is refused there, and the
 *    sweep removes what interrupted uploads left only after its grace period.
 */
#include <inttypes.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "s3_harness.h"
#include "testutil.h"
#include "tier_job.h"

static tu_s3 srv;

static void url_of(char *buf, size_t len, const char *name) {
  snprintf(buf, len, "s3://amber-test/%s", name);
}

static void mem_of(char *buf, size_t len, const char *name) {
  snprintf(buf, len, "%s/%s", tu_tmpdir(), name);
}

/* A memory tier of `steps` steps (a full every 4). */
static void build(const char *mem, uint64_t steps) {
  job j;
  job_open(&j, mem, 4);
  for (uint64_t s = 1; s <= steps; s++)
    job_save(&j, s, 0);
  job_close(&j);
}

static void test_drained_steps_restore_bit_identically_from_s3(void) {
  char mem[2048], url[256];
  mem_of(mem, sizeof mem, "mem1");
  url_of(url, sizeof url, "drained");
  build(mem, 9);
  CHECK_OK(amber_drain_run(mem, url, NULL));
  uint64_t steps[MAXSTEP];
  size_t n = steps_of(url, steps);
  CHECK(n == 9);
  for (size_t i = 0; i < n; i++) {
    CHECK(steps[i] == i + 1);
    check_step(url, steps[i]);
  }
  /* the memory tier records it, and keeps only its newest chain */
  char *durable = NULL;
  CHECK_OK(amber_tier_durable(mem, &durable));
  CHECK(durable && strcmp(durable, url) == 0);
  amber_free(durable);
  check_only_newest_chain(mem, 9);
}

static void test_a_box_reads_only_the_chunks_that_hold_it(void) {
  char mem[2048], url[256];
  mem_of(mem, sizeof mem, "mem2");
  url_of(url, sizeof url, "box");
  job j;
  job_open(&j, mem, 100);
  job_save(&j, 1, AMBER_SAVE_FULL);
  job_close(&j);
  CHECK_OK(amber_drain_run(mem, url, NULL));
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY;
  amber_store *st = NULL;
  amber_reader *r = NULL;
  CHECK_OK(amber_store_open(&st, url, &so));
  CHECK_OK(amber_reader_open(&r, st, 1, NULL));
  if (!r) return;
  /* 20000 floats in chunks of 4096: elements 9000..9099 lie in chunk 2 alone */
  tu_s3_cmd(&srv, "reset");
  float got[100];
  size_t idx = 0;
  int64_t off[AMBER_MAX_DIMS] = {9000}, shape[AMBER_MAX_DIMS] = {100};
  void *bufs[1] = {got};
  uint64_t sizes[1] = {sizeof got};
  CHECK_OK(amber_reader_read_boxes(r, 1, &idx, off, shape, bufs, sizes));
  CHECK(memcmp(got, states[1] + 9000, sizeof got) == 0);
  CHECK(tu_s3_requests(&srv, NULL) == 1); /* one ranged GET, of chunk 2 */
  amber_reader_close(r);
  amber_store_close(st);
}

/* Runs amber_drain_run(mem, url) in a child killed after `delay`; 1 when killed. */
static int killed_drain(const char *mem, const char *url, useconds_t delay) {
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) _exit(amber_drain_run(mem, url, NULL) == 0 ? 0 : 3);
  usleep(delay);
  kill(pid, SIGKILL);
  int status = 0;
  CHECK(waitpid(pid, &status, 0) == pid);
  if (WIFEXITED(status)) CHECK(WEXITSTATUS(status) == 0);
  return WIFSIGNALED(status);
}

static void test_a_killed_drain_leaves_only_whole_steps_in_the_bucket(void) {
  char mem[2048], url[256];
  mem_of(mem, sizeof mem, "mem3");
  url_of(url, sizeof url, "killed");
  build(mem, 8);
  uint64_t seed = 20251207;
  int kills = 0, partial = 0;
  tu_s3_cmd(&srv, "reset");
  tu_s3_cmd(&srv, "delay 400 15"); /* answers 15 ms late, so kills land all along */
  for (int done = 0; !done && !tu_failures;) {
    done = !killed_drain(mem, url, (useconds_t)(tu_rand(&seed) % 500000));
    kills += !done;
    size_t l = check_visible(mem, url, 8, 0);
    partial += l > 0 && l < 8;
  }
  tu_s3_cmd(&srv, "reset");
  CHECK(kills >= 1);
  CHECK(partial >= 1); /* some kill landed between two steps' pointers */
  CHECK(check_visible(mem, url, 8, 0) == 8);
}

static void test_faults_during_a_drain_lose_nothing(void) {
  char mem[2048], url[256];
  mem_of(mem, sizeof mem, "mem4");
  url_of(url, sizeof url, "faults");
  build(mem, 6);
  tu_s3_cmd(&srv, "reset");
  tu_s3_cmd(&srv, "pass 3");
  tu_s3_cmd(&srv, "cut 1 20000"); /* a connection cut in the middle of an upload */
  tu_s3_cmd(&srv, "pass 4");
  tu_s3_cmd(&srv, "fail 2 503 SlowDown");
  tu_s3_cmd(&srv, "pass 2");
  tu_s3_cmd(&srv, "fail 1 500 InternalError");
  CHECK_OK(amber_drain_run(mem, url, NULL));
  CHECK(check_visible(mem, url, 6, 0) == 6);
  /* the server down in the middle of the next drain, and up again */
  job j;
  job_open(&j, mem, 4);
  for (uint64_t s = 7; s <= 9; s++)
    job_save(&j, s, 0);
  job_close(&j);
  tu_s3_cmd(&srv, "reset");
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) _exit(amber_drain_run(mem, url, NULL) == 0 ? 0 : 3);
  usleep(30000);
  tu_s3_cmd(&srv, "down");
  usleep(1500000);
  tu_s3_cmd(&srv, "up");
  int status = 0;
  CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);
  CHECK(check_visible(mem, url, 9, 0) == 9);
}

static void test_a_failed_upload_moves_no_pointer(void) {
  char mem[2048], url[256];
  mem_of(mem, sizeof mem, "mem5");
  url_of(url, sizeof url, "refused");
  build(mem, 3);
  CHECK_OK(amber_drain_run(mem, url, NULL));
  job j;
  job_open(&j, mem, 4);
  job_save(&j, 4, 0);
  job_save(&j, 5, 0);
  job_close(&j);
  /* a request refused (a 4xx: no retry) at every point of the drain in turn: each
   * drain stops there, naming the object, with only whole steps visible */
  int failures = 0, done = 0;
  for (int k = 0; k < 60 && !done && !tu_failures; k += 2) {
    tu_s3_cmd(&srv, "reset");
    tu_s3_cmd(&srv, "pass %d", k);
    tu_s3_cmd(&srv, "fail 1 403 AccessDenied");
    int rc = amber_drain_run(mem, url, NULL);
    done = rc == 0;
    if (!done) {
      failures++;
      CHECK_RC(rc, AMBER_EPERM);
      CHECK(strstr(amber_last_error(NULL), ": 403 ") &&
            strstr(amber_last_error(NULL), "s3://amber-test/refused"));
    }
    tu_s3_cmd(&srv, "reset");
    check_visible(mem, url, 5, 0);
  }
  CHECK(done && failures >= 5);
  CHECK(check_visible(mem, url, 5, 0) == 5);
}

static void test_refused_credentials_and_a_missing_bucket_fail_at_once(void) {
  char mem[2048], url[256];
  mem_of(mem, sizeof mem, "mem6");
  url_of(url, sizeof url, "auth");
  build(mem, 1);
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY;
  amber_store *st = NULL;
  setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret", 1);
  tu_s3_cmd(&srv, "reset");
  CHECK_RC(amber_drain_run(mem, url, NULL), AMBER_EPERM);
  CHECK(strstr(amber_last_error(NULL), "s3://amber-test/auth") &&
        strstr(amber_last_error(NULL), "SignatureDoesNotMatch"));
  CHECK_RC(amber_store_open(&st, url, &so), AMBER_EPERM);
  CHECK(strstr(amber_last_error(NULL), "s3://amber-test/auth"));
  CHECK(tu_s3_requests(&srv, NULL) == 2); /* one request each: no retry */
  tu_s3_env(&srv, 0);
  tu_s3_cmd(&srv, "reset");
  CHECK_RC(amber_drain_run(mem, "s3://no-such-bucket-here/run", NULL), AMBER_ENOENT);
  CHECK(strstr(amber_last_error(NULL), "s3://no-such-bucket-here/run") &&
        strstr(amber_last_error(NULL), "NoSuchBucket"));
  CHECK_RC(amber_store_open(&st, "s3://no-such-bucket-here/run", &so), AMBER_ENOENT);
  CHECK(strstr(amber_last_error(NULL), "NoSuchBucket"));
  CHECK(tu_s3_requests(&srv, NULL) == 2);
  /* and an empty prefix is no store */
  CHECK_RC(amber_store_open(&st, "s3://amber-test/nothing-here", &so), AMBER_ENOENT);
  CHECK(strstr(amber_last_error(NULL), "no store at s3://amber-test/nothing-here"));
}

static void test_many_ranks_drained_and_read_at_another_world_size(void) {
  char mem[2048], url[256];
  mem_of(mem, sizeof mem, "gmem");
  url_of(url, sizeof url, "global");
  gjob jb = {.path = mem,
             .first = 1,
             .last = 5,
             .full_every = 3,
             .fail_rank = -1,
             .durable = url};
  amber_drain_opts_init(&jb.dopts);
  g_run(&jb, 2); /* each rank's drain beside its writer; rank 0 moves GLOBAL */
  uint64_t steps[16];
  size_t n = g_steps(url, steps, 16);
  CHECK(n == 5);
  for (size_t i = 0; i < n; i++)
    g_check(url, steps[i]); /* the whole tensors: both ranks' files */
  CHECK(amber_global_is_store(url) == 1);
  /* a box of rank 1's rows only, as a rank of another world size asks */
  amber_global_reader *g = NULL;
  CHECK_OK(amber_global_reader_open(&g, url, 5));
  if (g) {
    size_t wi;
    CHECK_OK(amber_global_reader_find(g, "w", &wi));
    float got[2 * G_COLS];
    int64_t off[2] = {G_ROWS - 2, 0}, shape[2] = {2, G_COLS};
    CHECK_OK(amber_global_reader_read(g, wi, off, shape, got, sizeof got));
    for (int i = 0; i < 2; i++)
      for (int k = 0; k < G_COLS; k++)
        CHECK(got[i * G_COLS + k] == g_wval(G_ROWS - 2 + i, k, 5));
    amber_global_reader_close(g);
  }
  /* prune and compact of a multi-rank store in the bucket */
  size_t removed = 0, compacted = 0;
  CHECK_OK(amber_global_compact(url, 4, &compacted));
  g_check(url, 4);
  CHECK_OK(amber_global_prune(url, 1, &removed));
  CHECK(removed == 4 && g_steps(url, steps, 16) == 1 && steps[0] == 5);
  g_check(url, 5);
}

/* The checkpoint objects of `url` (steps), whatever their pointer says. */
static size_t objects_of(const char *url, uint64_t *steps) {
  amber__s3 *s = NULL;
  if (amber__s3_open(&s, url, NULL)) return 0;
  size_t n = 0;
  for (uint64_t k = 1; k < 16; k++) {
    char key[64];
    amber__s3_stat st;
    snprintf(key, sizeof key, "ckpt-%020" PRIu64 ".amber", k);
    if (amber__s3_head(s, key, &st) == 0) steps[n++] = k;
  }
  amber__s3_close(s);
  return n;
}

static int count_uploads(void *arg, const char *name, const char *id, time_t t) {
  (void)name, (void)id, (void)t;
  ++*(int *)arg;
  return 0;
}

static void test_compact_prune_and_sweep_in_the_bucket(void) {
  char mem[2048], url[256];
  mem_of(mem, sizeof mem, "mem7");
  url_of(url, sizeof url, "maint");
  build(mem, 6);
  CHECK_OK(amber_drain_run(mem, url, NULL));
  amber_store *st = NULL;
  CHECK_OK(amber_store_open(&st, url, NULL)); /* writable, for maintenance */
  amber_writer *w = NULL;
  CHECK_RC(amber_writer_open(&w, st, NULL), AMBER_EINVAL);
  CHECK(strstr(amber_last_error(NULL), "amber_drain_start"));
  amber_ckpt_info *info = NULL;
  size_t n = 0;
  CHECK_OK(amber_store_list(st, &info, &n));
  CHECK(n == 6 && info[2].kind == AMBER_KIND_DELTA);
  amber_free(info);
  CHECK_OK(amber_store_compact(st, 3));
  CHECK_OK(amber_store_list(st, &info, &n));
  CHECK(n == 6 && info[2].kind == AMBER_KIND_FULL && info[3].parent == 3);
  amber_free(info);
  for (uint64_t s = 1; s <= 6; s++)
    check_step(url, s);
  size_t removed = 0;
  CHECK_OK(amber_store_prune(st, 2, &removed));
  amber_store_close(st);
  uint64_t kept[MAXSTEP], objs[16];
  size_t nk = steps_of(url, kept);
  CHECK(removed >= 1 && nk + removed == 6 && kept[nk - 1] == 6);
  check_step(url, 5);
  check_step(url, 6);
  /* what an interrupted drain leaves: a checkpoint object no pointer names, and an
   * unfinished multipart upload */
  amber__s3 *s = NULL;
  CHECK_OK(amber__s3_open(&s, url, NULL));
  if (!s) return;
  char id[1024];
  CHECK_OK(amber__s3_put(s, "ckpt-00000000000000000009.amber", "partial", 7, NULL));
  CHECK_OK(amber__s3_upload_begin(s, "ckpt-00000000000000000010.amber", id, sizeof id));
  CHECK(objects_of(url, objs) == nk + 1);
  CHECK(steps_of(url, kept) == nk); /* a reader sees only what LATEST reaches */
  CHECK_OK(amber_store_sweep(url, 3600, &removed));
  /* younger than the grace, maybe a drain's in flight: kept (moto dates every
   * multipart upload 2010-11-10, a constant of its answer, so only the object's age
   * can be seen kept here) */
  CHECK(objects_of(url, objs) == nk + 1);
  sleep(2);
  CHECK_OK(amber_store_sweep(url, 1, &removed));
  CHECK(removed >= 1);
  CHECK(objects_of(url, objs) == nk && objs[nk - 1] == 6);
  int ups = 0;
  CHECK_OK(amber__s3_uploads(s, "", count_uploads, &ups));
  CHECK(ups == 0);
  amber__s3_close(s);
  check_step(url, 6);
}

static void test_staging_is_one_directory_per_url_and_user(void) {
  char *a = NULL, *b = NULL, *c = NULL;
  CHECK_OK(amber_tier_staging("s3://bucket/run", &a));
  CHECK_OK(amber_tier_staging("s3://bucket/run/", &b));
  CHECK_OK(amber_tier_staging("s3://bucket/other", &c));
  CHECK(a && b && c && strcmp(a, b) == 0 && strcmp(a, c) != 0 && strstr(a, "/amber-"));
  amber_free(a), amber_free(b), amber_free(c);
  CHECK_RC(amber_tier_staging("/not/a/url", &a), AMBER_EINVAL);
}

int main(void) {
  amber__s3 *probe = NULL;
  if (amber__s3_open(&probe, "s3://amber-test", NULL) == AMBER_EFORMAT)
    return tu_s3_skip(amber_last_error(NULL));
  amber__s3_close(probe);
  if (tu_s3_start(&srv) != 0) return tu_s3_skip("the S3 server did not start");
  tu_s3_env(&srv, 0);
  tu_run("drained_steps_restore_bit_identically_from_s3",
         test_drained_steps_restore_bit_identically_from_s3);
  tu_run("a_box_reads_only_the_chunks_that_hold_it",
         test_a_box_reads_only_the_chunks_that_hold_it);
  tu_run("a_killed_drain_leaves_only_whole_steps_in_the_bucket",
         test_a_killed_drain_leaves_only_whole_steps_in_the_bucket);
  tu_run("faults_during_a_drain_lose_nothing", test_faults_during_a_drain_lose_nothing);
  tu_run("a_failed_upload_moves_no_pointer", test_a_failed_upload_moves_no_pointer);
  tu_run("refused_credentials_and_a_missing_bucket_fail_at_once",
         test_refused_credentials_and_a_missing_bucket_fail_at_once);
  tu_run("many_ranks_drained_and_read_at_another_world_size",
         test_many_ranks_drained_and_read_at_another_world_size);
  tu_run("compact_prune_and_sweep_in_the_bucket",
         test_compact_prune_and_sweep_in_the_bucket);
  tu_run("staging_is_one_directory_per_url_and_user",
         test_staging_is_one_directory_per_url_and_user);
  tu_s3_stop(&srv);
  return tu_finish();
}

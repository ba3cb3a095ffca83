/*
 * test_s3_faults.c - the S3 client (src/s3.c) through faults injected between it
 * and a real S3 server (tests/s3_server.py's proxy in front of moto): 500/503/429
 * answers, connections cut in the middle of an upload and of a download, answers that
 * stall, the server down and back up. Each operation succeeds, and what it wrote is
 * whole (read back and compared, its checksum confirmed). Errors that no retry can
 * mend (wrong secret, unknown key, missing bucket) fail at once, with S3's code and
 * the object named, and the proxy's count shows that they were sent once.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "s3_harness.h"
#include "testutil.h"

#define MiB (1024u * 1024u)

static tu_s3 srv;

/* Reads `key` back and compares it with `data`, and confirms its checksum. */
static void check_whole(amber__s3 *s, const char *key, const void *data, size_t n,
                        const amber__s3_stat *st) {
  CHECK_OK(amber__s3_confirm(s, key, st));
  void *got = NULL;
  size_t len = 0;
  CHECK_OK(amber__s3_get(s, key, n, &got, &len));
  CHECK(len == n && got && memcmp(got, data, n) == 0);
  free(got);
}

static void test_5xx_and_throttling_are_retried(void) {
  amber__s3 *s = tu_s3_client("retry", NULL);
  CHECK(s != NULL);
  if (!s) return;
  uint8_t data[4096];
  tu_fill_random(data, sizeof data, 1);
  amber__s3_stat st;
  tu_s3_cmd(&srv, "reset");
  tu_s3_cmd(&srv, "fail 2 503 SlowDown");
  tu_s3_cmd(&srv, "fail 1 500 InternalError");
  tu_s3_cmd(&srv, "fail 1 429 TooManyRequests");
  CHECK_OK(amber__s3_put(s, "k", data, sizeof data, &st));
  CHECK(tu_s3_requests(&srv, NULL) == 5);
  amber__s3_counters c;
  amber__s3_counters_get(s, &c);
  CHECK(c.retries == 4);
  tu_s3_cmd(&srv, "fail 2 503 SlowDown");
  check_whole(s, "k", data, sizeof data, &st);
  amber__s3_close(s);
}

static void test_retries_run_out_with_the_last_error_told(void) {
  amber__s3_opts o = {.retries = 3};
  amber__s3 *s = tu_s3_client("retry", &o);
  CHECK(s != NULL);
  if (!s) return;
  tu_s3_cmd(&srv, "reset");
  tu_s3_cmd(&srv, "fail 10 503 SlowDown");
  CHECK_RC(amber__s3_put(s, "gone", "x", 1, NULL), AMBER_EIO);
  const char *msg = amber_last_error(NULL);
  CHECK(strstr(msg, "s3://amber-test/retry/gone") && strstr(msg, "503 SlowDown") &&
        strstr(msg, "gave up after 4 attempts"));
  CHECK(tu_s3_requests(&srv, NULL) == 4);
  tu_s3_cmd(&srv, "reset");
  amber__s3_close(s);
}

static void test_connection_cut_mid_upload_is_retried_whole(void) {
  amber__s3_opts o = {.part_size = 5 * MiB, .parallel = 2};
  amber__s3 *s = tu_s3_client("cut", &o);
  CHECK(s != NULL);
  if (!s) return;
  size_t n = 3 * MiB;
  uint8_t *data = malloc(12 * MiB);
  tu_fill_random(data, 12 * MiB, 2);
  amber__s3_stat st;
  tu_s3_cmd(&srv, "reset");
  tu_s3_cmd(&srv, "cut 1 1000000"); /* a third of the body, then a reset */
  CHECK_OK(amber__s3_put(s, "one", data, n, &st));
  CHECK(tu_s3_requests(&srv, NULL) == 2);
  check_whole(s, "one", data, n, &st);
  /* a multipart upload whose first part is cut, twice */
  tu_s3_cmd(&srv, "reset");
  tu_s3_cmd(&srv, "pass 1");
  tu_s3_cmd(&srv, "cut 2 4000000");
  CHECK_OK(amber__s3_put(s, "multi", data, 12 * MiB, &st));
  CHECK(tu_s3_requests(&srv, NULL) == 7); /* create, 3 parts + 2 retries, complete */
  check_whole(s, "multi", data, 12 * MiB, &st);
  free(data);
  amber__s3_close(s);
}

static void test_connection_cut_mid_download_is_retried(void) {
  amber__s3 *s = tu_s3_client("cutget", NULL);
  CHECK(s != NULL);
  if (!s) return;
  size_t n = 2 * MiB;
  uint8_t *data = malloc(n), *buf = malloc(n);
  tu_fill_random(data, n, 3);
  amber__s3_stat st;
  CHECK_OK(amber__s3_put(s, "k", data, n, &st));
  tu_s3_cmd(&srv, "reset");
  tu_s3_cmd(&srv, "cutresp 1 100000");
  void *got = NULL;
  size_t len = 0;
  CHECK_OK(amber__s3_get(s, "k", n, &got, &len));
  CHECK(len == n && memcmp(got, data, n) == 0);
  free(got);
  CHECK(tu_s3_requests(&srv, NULL) == 2);
  tu_s3_cmd(&srv, "cutresp 1 1000");
  amber__s3_range r = {1000, n - 2000, buf};
  CHECK_OK(amber__s3_get_ranges(s, "k", &r, 1));
  CHECK(memcmp(buf, data + 1000, n - 2000) == 0);
  free(data);
  free(buf);
  amber__s3_close(s);
}

static void test_a_stalled_answer_times_out_and_is_retried(void) {
  amber__s3_opts o = {.stall_s = 1};
  amber__s3 *s = tu_s3_client("stall", &o);
  CHECK(s != NULL);
  if (!s) return;
  CHECK_OK(amber__s3_put(s, "k", "abc", 3, NULL));
  tu_s3_cmd(&srv, "reset");
  tu_s3_cmd(&srv, "delay 1 3000");
  double t0 = (double)time(NULL);
  amber__s3_stat st;
  CHECK_OK(amber__s3_head(s, "k", &st));
  CHECK(st.size == 3);
  CHECK(tu_s3_requests(&srv, NULL) == 2);
  CHECK((double)time(NULL) - t0 < 10);
  amber__s3_close(s);
}

/* A body changed on the way (what TCP's checksum can miss) is refused by its CRC32,
 * as S3 refuses it (here the proxy checks in moto's place), and sent again. */
static void test_a_body_damaged_on_the_way_is_refused_and_sent_again(void) {
  amber__s3_opts o = {.part_size = 5 * MiB};
  amber__s3 *s = tu_s3_client("flip", &o);
  CHECK(s != NULL);
  if (!s) return;
  size_t n = 11 * MiB;
  uint8_t *data = malloc(n);
  tu_fill_random(data, n, 5);
  amber__s3_stat st;
  tu_s3_cmd(&srv, "reset");
  tu_s3_cmd(&srv, "flip 1 1000");
  CHECK_OK(amber__s3_put(s, "one", data, 4096, &st));
  CHECK(tu_s3_requests(&srv, NULL) == 2);
  check_whole(s, "one", data, 4096, &st);
  tu_s3_cmd(&srv, "reset");
  tu_s3_cmd(&srv, "pass 1");
  tu_s3_cmd(&srv, "flip 1 4000000");
  CHECK_OK(amber__s3_put(s, "multi", data, n, &st));
  CHECK(tu_s3_requests(&srv, NULL) == 6); /* create, 3 parts + 1 again, complete */
  check_whole(s, "multi", data, n, &st);
  free(data);
  amber__s3_close(s);
}

/* The answer to CompleteMultipartUpload is lost after the server completed it: the
 * retry finds the upload gone (S3's NoSuchUpload, injected: moto completes it again),
 * and the object, read back with its checksum, is the one uploaded. */
static void test_a_lost_completion_answer_is_checked_not_failed(void) {
  amber__s3_opts o = {.part_size = 5 * MiB};
  amber__s3 *s = tu_s3_client("complete", &o);
  CHECK(s != NULL);
  if (!s) return;
  size_t n = 11 * MiB;
  uint8_t *data = malloc(n);
  tu_fill_random(data, n, 6);
  amber__s3_stat st;
  tu_s3_cmd(&srv, "reset");
  tu_s3_cmd(&srv, "pass 4"); /* create, 3 parts */
  tu_s3_cmd(&srv, "cutresp 1 10");
  tu_s3_cmd(&srv, "fail 1 404 NoSuchUpload");
  CHECK_OK(amber__s3_put(s, "k", data, n, &st));
  CHECK(tu_s3_requests(&srv, NULL) == 7); /* ... complete twice, HEAD */
  check_whole(s, "k", data, n, &st);
  /* and when the object is not the one uploaded, the loss is not taken for success */
  tu_s3_cmd(&srv, "reset");
  tu_s3_cmd(&srv, "pass 1");
  tu_s3_cmd(&srv, "fail 3 404 NoSuchUpload"); /* parts refused: the upload is gone */
  CHECK_RC(amber__s3_put(s, "k", data, n - 1, &st), AMBER_ENOENT);
  CHECK(strstr(amber_last_error(NULL), "NoSuchUpload") != NULL);
  free(data);
  amber__s3_close(s);
}

typedef struct put_job {
  amber__s3 *s;
  const uint8_t *data;
  size_t n;
  amber__s3_stat st;
  int rc;
} put_job;

static void *put_thread(void *arg) {
  put_job *j = arg;
  j->rc = amber__s3_put(j->s, "after", j->data, j->n, &j->st);
  return NULL;
}

/* The server goes down (its connections cut, new ones refused) while an upload
 * runs, and comes back with its data: the upload succeeds, what was there before is
 * still there. */
static void test_server_down_and_back_up(void) {
  amber__s3_opts o = {
      .part_size = 5 * MiB, .parallel = 2, .retries = 30, .backoff_ms = 50};
  amber__s3 *s = tu_s3_client("restart", &o);
  CHECK(s != NULL);
  if (!s) return;
  size_t n = 11 * MiB;
  uint8_t *data = malloc(n);
  tu_fill_random(data, n, 4);
  amber__s3_stat before;
  CHECK_OK(amber__s3_put(s, "before", data, 1000, &before));
  tu_s3_cmd(&srv, "reset");
  tu_s3_cmd(&srv, "pass 1");
  tu_s3_cmd(&srv, "delay 2 1500"); /* parts in flight when the server goes down */
  put_job j = {s, data, n, {0}, 1};
  pthread_t t;
  pthread_create(&t, NULL, put_thread, &j);
  usleep(500000);
  CHECK(strncmp(tu_s3_cmd(&srv, "down"), "ok", 2) == 0);
  usleep(1500000);
  CHECK(strncmp(tu_s3_cmd(&srv, "up"), "ok", 2) == 0);
  pthread_join(t, NULL);
  CHECK_OK(j.rc);
  if (j.rc) fprintf(stderr, "upload: %s\n", amber_last_error(NULL));
  amber__s3_counters c;
  amber__s3_counters_get(s, &c);
  CHECK(c.retries >= 2);
  check_whole(s, "after", data, n, &j.st);
  check_whole(s, "before", data, 1000, &before);
  free(data);
  amber__s3_close(s);
}

static void test_wrong_secret_and_unknown_key_fail_at_once(void) {
  setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret", 1);
  amber__s3 *s = tu_s3_client("auth", NULL);
  CHECK(s != NULL);
  if (s) {
    tu_s3_cmd(&srv, "reset");
    CHECK_RC(amber__s3_put(s, "obj", "x", 1, NULL), AMBER_EPERM);
    const char *msg = amber_last_error(NULL);
    CHECK(strstr(msg, "s3://amber-test/auth/obj") &&
          strstr(msg, "403 SignatureDoesNotMatch"));
    CHECK(strstr(msg, "AWS_ACCESS_KEY_ID") != NULL); /* where the credentials came from */
    void *got;
    size_t len;
    CHECK_RC(amber__s3_get(s, "obj", 10, &got, &len), AMBER_EPERM);
    CHECK(tu_s3_requests(&srv, NULL) == 2); /* no retry storm */
    amber__s3_close(s);
  }
  setenv("AWS_ACCESS_KEY_ID", "AKIANOSUCHKEY0000000", 1);
  s = tu_s3_client("auth", NULL);
  CHECK(s != NULL);
  if (s) {
    tu_s3_cmd(&srv, "reset");
    CHECK_RC(amber__s3_put(s, "obj", "x", 1, NULL), AMBER_EPERM);
    CHECK(strstr(amber_last_error(NULL), "InvalidAccessKeyId") != NULL);
    CHECK(tu_s3_requests(&srv, NULL) == 1);
    amber__s3_close(s);
  }
  tu_s3_env(&srv, 0);
}

static int count_names(void *arg, const char *name, uint64_t size) {
  (void)name, (void)size;
  ++*(int *)arg;
  return 0;
}

static void test_missing_bucket_fails_at_once(void) {
  amber__s3 *s = NULL;
  CHECK_OK(amber__s3_open(&s, "s3://no-such-bucket-here/run", NULL));
  if (!s) return;
  tu_s3_cmd(&srv, "reset");
  CHECK_RC(amber__s3_put(s, "obj", "x", 1, NULL), AMBER_ENOENT);
  const char *msg = amber_last_error(NULL);
  CHECK(strstr(msg, "s3://no-such-bucket-here/run/obj") &&
        strstr(msg, "404 NoSuchBucket"));
  int n = 0;
  CHECK_RC(amber__s3_list(s, "", count_names, &n), AMBER_ENOENT);
  CHECK(strstr(amber_last_error(NULL), "NoSuchBucket") != NULL);
  CHECK(tu_s3_requests(&srv, NULL) == 2);
  amber__s3_close(s);
}

int main(void) {
  amber__s3 *probe = NULL;
  if (amber__s3_open(&probe, "s3://amber-test", NULL) == AMBER_EFORMAT)
    return tu_s3_skip(amber_last_error(NULL));
  amber__s3_close(probe);
  if (tu_s3_start(&srv) < 0) return tu_s3_skip("the S3 test server could not start");
  tu_s3_env(&srv, 0);
  TEST_RUN(test_5xx_and_throttling_are_retried);
  TEST_RUN(test_retries_run_out_with_the_last_error_told);
  TEST_RUN(test_connection_cut_mid_upload_is_retried_whole);
  TEST_RUN(test_connection_cut_mid_download_is_retried);
  TEST_RUN(test_a_stalled_answer_times_out_and_is_retried);
  TEST_RUN(test_a_body_damaged_on_the_way_is_refused_and_sent_again);
  TEST_RUN(test_a_lost_completion_answer_is_checked_not_failed);
  TEST_RUN(test_server_down_and_back_up);
  TEST_RUN(test_wrong_secret_and_unknown_key_fail_at_once);
  TEST_RUN(test_missing_bucket_fails_at_once);
  tu_s3_stop(&srv);
  return tu_finish();
}

/*
 * test_s3.c - the S3 client (src/s3.c) against a real S3 server (moto's, started by
 * tests/s3_harness.c), through the fault proxy with no fault set: every operation's
 * round trip (put, head, confirm, get, ranged get, list with pages, delete),
 * multipart uploads of a file and of a buffer with parts in parallel, the abort of a
 * failed upload and the leftovers of a crashed one, and credentials read from a
 * profile file. The faults are test_s3_faults.c's.
 */
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "s3_harness.h"
#include "testutil.h"

#define MiB (1024u * 1024u)

static tu_s3 srv;

typedef struct names {
  char name[16][128];
  uint64_t size[16];
  int n;
} names;

static int collect(void *arg, const char *name, uint64_t size) {
  names *l = arg;
  if (l->n < 16) {
    snprintf(l->name[l->n], sizeof l->name[0], "%s", name);
    l->size[l->n] = size;
  }
  l->n++;
  return 0;
}

typedef struct uploads {
  char name[8][128];
  char id[8][1024];
  int n;
} uploads;

static int collect_upload(void *arg, const char *name, const char *id, time_t t) {
  uploads *u = arg;
  (void)t;
  if (u->n < 8) {
    snprintf(u->name[u->n], sizeof u->name[0], "%s", name);
    snprintf(u->id[u->n], sizeof u->id[0], "%s", id);
  }
  u->n++;
  return 0;
}

static void test_put_head_confirm_get_round_trip(void) {
  amber__s3 *s = tu_s3_client("rt", NULL);
  CHECK(s != NULL);
  if (!s) return;
  uint8_t data[1000];
  tu_fill_random(data, sizeof data, 1);
  amber__s3_stat put, head;
  CHECK_OK(amber__s3_put(s, "obj", data, sizeof data, &put));
  CHECK(put.size == sizeof data && strlen(put.crc32) == 8 && put.etag[0]);
  CHECK_OK(amber__s3_head(s, "obj", &head));
  CHECK(head.size == sizeof data);
  CHECK(strcmp(head.crc32, put.crc32) == 0);
  CHECK(strcmp(head.etag, put.etag) == 0);
  CHECK_OK(amber__s3_confirm(s, "obj", &put));
  amber__s3_stat other = put;
  other.size++;
  CHECK_RC(amber__s3_confirm(s, "obj", &other), AMBER_ECORRUPT);
  CHECK(strstr(amber_last_error(NULL), "s3://amber-test/rt/obj") != NULL);
  void *got = NULL;
  size_t len = 0;
  CHECK_OK(amber__s3_get(s, "obj", 1 << 20, &got, &len));
  CHECK(len == sizeof data && got && memcmp(got, data, len) == 0);
  free(got);
  /* a larger object than the caller allows is refused before it is read */
  CHECK_RC(amber__s3_get(s, "obj", 999, &got, &len), AMBER_ERANGE);
  CHECK(strstr(amber_last_error(NULL), "1000 bytes") != NULL);
  CHECK_RC(amber__s3_get(s, "missing", 1 << 20, &got, &len), AMBER_ENOENT);
  CHECK(strstr(amber_last_error(NULL), "NoSuchKey") != NULL);
  CHECK(strstr(amber_last_error(NULL), "s3://amber-test/rt/missing") != NULL);
  CHECK_RC(amber__s3_head(s, "missing", &head), AMBER_ENOENT);
  /* an empty object */
  CHECK_OK(amber__s3_put(s, "empty", NULL, 0, &put));
  CHECK_OK(amber__s3_get(s, "empty", 10, &got, &len));
  CHECK(len == 0 && got != NULL);
  free(got);
  amber__s3_close(s);
}

static void test_keys_with_any_characters_round_trip_and_list(void) {
  amber__s3 *s = tu_s3_client("odd names/", NULL);
  CHECK(s != NULL);
  if (!s) return;
  const char *keys[] = {"a b+c=d&e", "x/y%z", "\xc3\xa9t\xc3\xa9~(1)"};
  for (int i = 0; i < 3; i++)
    CHECK_OK(amber__s3_put(s, keys[i], keys[i], strlen(keys[i]), NULL));
  names l = {0};
  CHECK_OK(amber__s3_list(s, "", collect, &l));
  CHECK(l.n == 3);
  for (int i = 0; i < 3; i++) {
    int found = 0;
    for (int j = 0; j < l.n && j < 16; j++)
      found |= strcmp(l.name[j], keys[i]) == 0 && l.size[j] == strlen(keys[i]);
    CHECK(found);
    void *got;
    size_t len;
    CHECK_OK(amber__s3_get(s, keys[i], 100, &got, &len));
    CHECK(len == strlen(keys[i]) && memcmp(got, keys[i], len) == 0);
    free(got);
  }
  amber__s3_close(s);
}

static void test_list_walks_every_page_in_key_order(void) {
  amber__s3_opts o = {.list_page = 2};
  amber__s3 *s = tu_s3_client("list", &o);
  CHECK(s != NULL);
  if (!s) return;
  const char *keys[] = {"ckpt-3", "ckpt-1", "LATEST", "ckpt-2", "sub/ckpt-9"};
  for (int i = 0; i < 5; i++)
    CHECK_OK(amber__s3_put(s, keys[i], "xxxx", (size_t)i, NULL));
  tu_s3_cmd(&srv, "reset");
  names l = {0};
  CHECK_OK(amber__s3_list(s, "", collect, &l));
  CHECK(l.n == 5);
  CHECK(tu_s3_requests(&srv, NULL) == 3); /* pages of 2 */
  const char *order[] = {"LATEST", "ckpt-1", "ckpt-2", "ckpt-3", "sub/ckpt-9"};
  for (int i = 0; i < 5 && i < l.n; i++)
    CHECK(strcmp(l.name[i], order[i]) == 0);
  CHECK(l.size[0] == 2 && l.size[1] == 1 && l.size[4] == 4);
  names sub = {0};
  CHECK_OK(amber__s3_list(s, "ckpt-", collect, &sub));
  CHECK(sub.n == 3);
  names none = {0};
  CHECK_OK(amber__s3_list(s, "nothing", collect, &none));
  CHECK(none.n == 0);
  amber__s3_close(s);
}

static void test_delete_removes_and_is_quiet_about_missing_keys(void) {
  amber__s3 *s = tu_s3_client("del", NULL);
  CHECK(s != NULL);
  if (!s) return;
  CHECK_OK(amber__s3_put(s, "k", "v", 1, NULL));
  CHECK_OK(amber__s3_delete(s, "k"));
  amber__s3_stat st;
  CHECK_RC(amber__s3_head(s, "k", &st), AMBER_ENOENT);
  CHECK_OK(amber__s3_delete(s, "k"));
  names l = {0};
  CHECK_OK(amber__s3_list(s, "", collect, &l));
  CHECK(l.n == 0);
  amber__s3_close(s);
}

/* A file of 2.5 parts, uploaded with its parts in flight at once; read back whole and
 * in ranges, several at once, across the parts' boundaries. */
static void test_multipart_file_parts_in_parallel_and_ranged_gets(void) {
  amber__s3_opts o = {.part_size = 8 * MiB, .parallel = 4};
  amber__s3 *s = tu_s3_client("mp", &o);
  CHECK(s != NULL);
  if (!s) return;
  size_t n = 20 * MiB + 12345;
  uint8_t *data = malloc(n);
  tu_fill_random(data, n, 2);
  char path[512];
  snprintf(path, sizeof path, "%s/big", tu_tmpdir());
  CHECK(tu_write_file(path, data, n) == 0);
  int fd = open(path, O_RDONLY);
  CHECK(fd >= 0);
  amber__s3_body body = {NULL, fd, n};
  amber__s3_stat st;
  tu_s3_cmd(&srv, "reset");
  CHECK_OK(amber__s3_upload(s, "big", &body, &st));
  int most = 0;
  CHECK(tu_s3_requests(&srv, &most) == 5); /* create, 3 parts, complete */
  CHECK(most >= 2);
  CHECK(st.size == n && strstr(st.crc32, "-3") != NULL);
  CHECK_OK(amber__s3_confirm(s, "big", &st)); /* the server's own composite CRC32 */
  void *got = NULL;
  size_t len = 0;
  CHECK_OK(amber__s3_get(s, "big", n, &got, &len));
  CHECK(len == n && memcmp(got, data, n) == 0);
  free(got);
  /* ranges: one across both part boundaries (longer than a piece, so in two), small
   * ones, the last byte */
  size_t lens[4] = {13 * MiB, 100, 1, 1};
  uint64_t offs[4] = {3 * MiB, 8 * MiB - 50, 0, n - 1};
  amber__s3_range r[4];
  for (int i = 0; i < 4; i++)
    r[i] = (amber__s3_range){offs[i], lens[i], malloc(lens[i])};
  tu_s3_cmd(&srv, "reset");
  CHECK_OK(amber__s3_get_ranges(s, "big", r, 4));
  CHECK(tu_s3_requests(&srv, &most) == 5);
  CHECK(most >= 2);
  for (int i = 0; i < 4; i++) {
    CHECK(memcmp(r[i].buf, data + offs[i], lens[i]) == 0);
    free(r[i].buf);
  }
  /* past the end: refused, not a short buffer */
  uint8_t tail[10];
  amber__s3_range past = {n - 5, 10, tail};
  CHECK(amber__s3_get_ranges(s, "big", &past, 1) < 0);
  amber__s3_range beyond = {n + 5, 10, tail};
  CHECK(amber__s3_get_ranges(s, "big", &beyond, 1) < 0);
  close(fd);
  free(data);
  amber__s3_close(s);
}

static void test_multipart_from_a_buffer(void) {
  amber__s3_opts o = {.part_size = 5 * MiB, .parallel = 2};
  amber__s3 *s = tu_s3_client("mpbuf", &o);
  CHECK(s != NULL);
  if (!s) return;
  size_t n = 11 * MiB;
  uint8_t *data = malloc(n);
  tu_fill_random(data, n, 3);
  amber__s3_stat st;
  CHECK_OK(amber__s3_put(s, "b", data, n, &st));
  CHECK(strstr(st.crc32, "-3") != NULL);
  CHECK_OK(amber__s3_confirm(s, "b", &st));
  void *got;
  size_t len;
  CHECK_OK(amber__s3_get(s, "b", n, &got, &len));
  CHECK(len == n && memcmp(got, data, n) == 0);
  free(got);
  free(data);
  amber__s3_close(s);
}

/* An object read by ranges as a reader reads a checkpoint: size once, bytes at any
 * offset, several ranges at once; an object replaced under the same key fails the
 * next read instead of mixing two versions. */
static void test_object_read_by_ranges_is_pinned_to_its_version(void) {
  amber__s3 *s = tu_s3_client("obj", NULL);
  CHECK(s != NULL);
  if (!s) return;
  size_t n = 100000;
  uint8_t *data = malloc(n), a[100], b[5000];
  tu_fill_random(data, n, 7);
  CHECK_OK(amber__s3_put(s, "ckpt-1.amber", data, n, NULL));
  amber__s3_obj *o = NULL;
  CHECK_OK(amber__s3_obj_open(&o, s, "ckpt-1.amber"));
  if (o) {
    CHECK(amber__s3_obj_size(o) == n);
    CHECK_OK(amber__s3_obj_pread(o, a, sizeof a, n - sizeof a));
    CHECK(memcmp(a, data + n - sizeof a, sizeof a) == 0);
    amber__s3_range r[2] = {{10, sizeof a, a}, {50000, sizeof b, b}};
    tu_s3_cmd(&srv, "reset");
    CHECK_OK(amber__s3_obj_preadv(o, r, 2));
    CHECK(tu_s3_requests(&srv, NULL) == 2);
    CHECK(memcmp(a, data + 10, sizeof a) == 0 && memcmp(b, data + 50000, sizeof b) == 0);
    CHECK_RC(amber__s3_obj_pread(o, a, 2, n - 1), AMBER_ECORRUPT);
    CHECK(tu_s3_requests(&srv, NULL) == 2); /* refused before any request */
    data[0] ^= 1;
    CHECK_OK(amber__s3_put(s, "ckpt-1.amber", data, n, NULL)); /* a compact, say */
    CHECK_RC(amber__s3_obj_pread(o, a, sizeof a, 0), AMBER_ECHANGED);
    CHECK(strstr(amber_last_error(NULL), "s3://amber-test/obj/ckpt-1.amber") &&
          strstr(amber_last_error(NULL), "replaced"));
    amber__s3_obj_close(o);
  }
  CHECK_RC(amber__s3_obj_open(&o, s, "ckpt-2.amber"), AMBER_ENOENT);
  free(data);
  amber__s3_close(s);
}

typedef struct thread_job {
  amber__s3 *s;
  int id, rc;
} thread_job;

static void *thread_round_trips(void *arg) {
  thread_job *j = arg;
  uint8_t data[3000], back[3000];
  for (int i = 0; i < 10 && j->rc == 0; i++) {
    char key[64];
    snprintf(key, sizeof key, "t%d/k%d", j->id, i);
    tu_fill_random(data, sizeof data, (uint64_t)(j->id * 100 + i + 1));
    amber__s3_stat st;
    amber__s3_range r = {0, sizeof back, back};
    j->rc = amber__s3_put(j->s, key, data, sizeof data, &st);
    if (j->rc == 0) j->rc = amber__s3_confirm(j->s, key, &st);
    if (j->rc == 0) j->rc = amber__s3_get_ranges(j->s, key, &r, 1);
    if (j->rc == 0 && memcmp(data, back, sizeof data) != 0) j->rc = -100;
  }
  return NULL;
}

/* One client, four threads at once: each call takes its own connections from the
 * pool and gives them back, so they are reused, not made per call. */
static void test_one_client_serves_many_threads(void) {
  amber__s3 *s = tu_s3_client("threads", NULL);
  CHECK(s != NULL);
  if (!s) return;
  tu_s3_cmd(&srv, "reset");
  pthread_t t[4];
  thread_job j[4];
  for (int i = 0; i < 4; i++) {
    j[i] = (thread_job){s, i, 0};
    pthread_create(&t[i], NULL, thread_round_trips, &j[i]);
  }
  for (int i = 0; i < 4; i++) {
    pthread_join(t[i], NULL);
    CHECK_OK(j[i].rc);
  }
  int conns = 0, req = 0, most = 0;
  sscanf(tu_s3_cmd(&srv, "count"), "ok %d %d %d", &req, &conns, &most);
  CHECK(req == 120);
  CHECK(conns <= 8); /* at most a few per thread, not one per request */
  amber__s3_close(s);
}

/* A part refused for good fails the upload at once, and the upload is aborted: no
 * leftover, no object. */
static void test_failed_multipart_is_aborted(void) {
  amber__s3_opts o = {.part_size = 5 * MiB, .parallel = 1};
  amber__s3 *s = tu_s3_client("mpfail", &o);
  CHECK(s != NULL);
  if (!s) return;
  size_t n = 11 * MiB;
  uint8_t *data = malloc(n);
  tu_fill_random(data, n, 4);
  tu_s3_cmd(&srv, "reset");
  tu_s3_cmd(&srv, "pass 2"); /* create and part 1 */
  tu_s3_cmd(&srv, "fail 1 403 AccessDenied");
  CHECK_RC(amber__s3_put(s, "x", data, n, NULL), AMBER_EPERM);
  const char *msg = amber_last_error(NULL);
  CHECK(strstr(msg, "s3://amber-test/mpfail/x") && strstr(msg, "part 2 of 3") &&
        strstr(msg, "AccessDenied"));
  CHECK(tu_s3_requests(&srv, NULL) == 4); /* create, part 1, part 2, abort */
  uploads u = {0};
  CHECK_OK(amber__s3_uploads(s, "", collect_upload, &u));
  CHECK(u.n == 0);
  amber__s3_stat st;
  CHECK_RC(amber__s3_head(s, "x", &st), AMBER_ENOENT);
  free(data);
  amber__s3_close(s);
}

/* What a crash leaves (an upload begun, never completed) is listed and aborted. */
static void test_leftover_uploads_are_listed_and_aborted(void) {
  amber__s3 *s = tu_s3_client("left", NULL);
  CHECK(s != NULL);
  if (!s) return;
  char id[1024];
  CHECK_OK(amber__s3_upload_begin(s, "a", id, sizeof id));
  /* a process killed in the middle of its parts: its answers are slow, so the kill
   * comes first; this process lists directly, past the proxy and its delays */
  tu_s3_cmd(&srv, "reset");
  tu_s3_cmd(&srv, "delay 20 2000");
  pid_t pid = fork();
  if (pid == 0) {
    amber__s3_opts o = {.part_size = 5 * MiB, .parallel = 1};
    amber__s3 *c = tu_s3_client("left", &o);
    size_t n = 16 * MiB;
    uint8_t *data = calloc(1, n);
    amber__s3_put(c, "b", data, n, NULL);
    _exit(0);
  }
  tu_s3_env(&srv, 1);
  amber__s3 *direct = tu_s3_client("left", NULL);
  uploads u = {0};
  for (int i = 0; direct && i < 200 && u.n < 2; i++) {
    usleep(50000);
    memset(&u, 0, sizeof u);
    CHECK_OK(amber__s3_uploads(direct, "", collect_upload, &u));
  }
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  amber__s3_close(direct);
  tu_s3_env(&srv, 0);
  tu_s3_cmd(&srv, "reset");
  memset(&u, 0, sizeof u);
  CHECK_OK(amber__s3_uploads(s, "", collect_upload, &u));
  CHECK(u.n == 2);
  CHECK(u.n >= 1 && strcmp(u.name[0], "a") == 0 && strcmp(u.id[0], id) == 0);
  CHECK(u.n >= 2 && strcmp(u.name[1], "b") == 0);
  for (int i = 0; i < u.n && i < 8; i++)
    CHECK_OK(amber__s3_upload_abort(s, u.name[i], u.id[i]));
  CHECK_OK(amber__s3_upload_abort(s, u.name[0], u.id[0])); /* gone already: fine */
  memset(&u, 0, sizeof u);
  CHECK_OK(amber__s3_uploads(s, "", collect_upload, &u));
  CHECK(u.n == 0);
  amber__s3_stat st;
  CHECK_RC(amber__s3_head(s, "b", &st), AMBER_ENOENT);
  amber__s3_close(s);
}

/* Credentials from a profile of a credentials file, region and endpoint from the
 * config file, as `aws --profile` reads them; a wrong secret there is named. */
static void test_credentials_from_a_profile_file(void) {
  char cred[512], conf[512];
  snprintf(cred, sizeof cred, "%s/credentials", tu_tmpdir());
  snprintf(conf, sizeof conf, "%s/config", tu_tmpdir());
  char text[1024];
  int n = snprintf(
      text, sizeof text,
      "[default]\naws_access_key_id = nobody\naws_secret_access_key = nothing\n\n"
      "# the test user\n[amber]\naws_access_key_id = %s\naws_secret_access_key = %s\n"
      "[wrong]\naws_access_key_id = %s\naws_secret_access_key = not-it\n",
      srv.key, srv.secret, srv.key);
  CHECK(tu_write_file(cred, text, (size_t)n) == 0);
  n = snprintf(
      text, sizeof text,
      "[profile amber]\nregion = us-east-1\ns3 =\n  endpoint_url = http://127.0.0.1:%d\n"
      "[profile wrong]\nendpoint_url = http://127.0.0.1:%d\n",
      srv.proxy_port, srv.proxy_port);
  CHECK(tu_write_file(conf, text, (size_t)n) == 0);
  unsetenv("AWS_ACCESS_KEY_ID");
  unsetenv("AWS_SECRET_ACCESS_KEY");
  unsetenv("AWS_ENDPOINT_URL");
  unsetenv("AWS_REGION");
  setenv("AWS_SHARED_CREDENTIALS_FILE", cred, 1);
  setenv("AWS_CONFIG_FILE", conf, 1);
  setenv("AWS_PROFILE", "amber", 1);
  amber__s3 *s = tu_s3_client("profile", NULL);
  CHECK(s != NULL);
  if (s) {
    CHECK_OK(amber__s3_put(s, "p", "x", 1, NULL));
    amber__s3_stat st;
    CHECK_OK(amber__s3_head(s, "p", &st));
    amber__s3_close(s);
  }
  setenv("AWS_PROFILE", "wrong", 1);
  s = tu_s3_client("profile", NULL);
  CHECK(s != NULL);
  if (s) {
    CHECK_RC(amber__s3_put(s, "p", "x", 1, NULL), AMBER_EPERM);
    const char *msg = amber_last_error(NULL);
    CHECK(strstr(msg, "SignatureDoesNotMatch") && strstr(msg, "profile 'wrong'"));
    amber__s3_close(s);
  }
  tu_s3_env(&srv, 0);
}

int main(void) {
  amber__s3 *probe = NULL;
  if (amber__s3_open(&probe, "s3://amber-test", NULL) == AMBER_EFORMAT)
    return tu_s3_skip(amber_last_error(NULL));
  amber__s3_close(probe);
  if (tu_s3_start(&srv) < 0) return tu_s3_skip("the S3 test server could not start");
  tu_s3_env(&srv, 0);
  TEST_RUN(test_put_head_confirm_get_round_trip);
  TEST_RUN(test_keys_with_any_characters_round_trip_and_list);
  TEST_RUN(test_list_walks_every_page_in_key_order);
  TEST_RUN(test_delete_removes_and_is_quiet_about_missing_keys);
  TEST_RUN(test_multipart_file_parts_in_parallel_and_ranged_gets);
  TEST_RUN(test_multipart_from_a_buffer);
  TEST_RUN(test_object_read_by_ranges_is_pinned_to_its_version);
  TEST_RUN(test_one_client_serves_many_threads);
  TEST_RUN(test_failed_multipart_is_aborted);
  TEST_RUN(test_leftover_uploads_are_listed_and_aborted);
  TEST_RUN(test_credentials_from_a_profile_file);
  tu_s3_stop(&srv);
  return tu_finish();
}

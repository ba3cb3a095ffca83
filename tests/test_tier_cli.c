/*
 * test_tier_cli.c - the CLI on storage tiers (tools/cli.c): `amber drain MEMDIR
 * [DURABLE]` finishes a drain (the recorded durable tier by default; exit 0, 1 with
 * a clear message, 2 on a usage error); `amber ls` of a memory tier shows which tiers
 * hold each step (text and --json), of any other store exactly what it showed
 * before; `amber verify` checks a memory tier as any store.
 */
#include <jansson.h>
#include <stdarg.h>
#include <stdlib.h>
#include <unistd.h>

#include "cli_run.h"
#include "testutil.h"
#include "tier_job.h"

/* The line of `text` that starts with step `step` in its first column. */
static const char *row(const char *text, uint64_t step) {
  char head[32];
  snprintf(head, sizeof head, "%-20llu ", (unsigned long long)step);
  for (const char *p = text; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL)
    if (!strncmp(p, head, strlen(head))) return p;
  return NULL;
}

/* Whether row `step` of `text` ends in `tiers`. */
static int row_tiers(const char *text, uint64_t step, const char *tiers) {
  const char *r = row(text, step);
  if (!r) return 0;
  const char *end = strchr(r, '\n');
  size_t len = end ? (size_t)(end - r) : strlen(r), tl = strlen(tiers);
  return len > tl && !strncmp(r + len - tl, tiers, tl) && r[len - tl - 1] == ' ';
}

static void test_drain_ls_and_verify_of_a_single_rank_memory_tier(void) {
  const char *t = tu_tmpdir();
  char mem[2048], dur[2048];
  snprintf(mem, sizeof mem, "%s/mem", t);
  snprintf(dur, sizeof dur, "%s/durable", t);
  job j;
  job_open(&j, mem, 4); /* fulls at 1, 6 */
  for (uint64_t s = 1; s <= 8; s++)
    job_save(&j, s, 0);
  /* before any drain: no TIERS, the listing as it always was */
  result r = cli("ls '%s'", mem);
  CHECK_EXIT(r, 0);
  CHECK(strstr(r.out, "tiers") == NULL && row(r.out, 8));
  char *plain = strdup(r.out);
  result_free(&r);
  setenv("AMBER_PROGRESS", "1", 1); /* progress lines, as on a terminal */
  r = cli("drain '%s' '%s'", mem, dur);
  unsetenv("AMBER_PROGRESS");
  CHECK_EXIT(r, 0);
  CHECK(strstr(r.out, "every committed step is durable") && strstr(r.out, "step 8"));
  CHECK(strstr(r.err, "drain ") && strstr(r.err, "100% of"));
  result_free(&r);
  for (uint64_t s = 1; s <= 8; s++)
    check_step(dur, s);
  job_save(&j, 9, 0); /* committed to memory only */
  r = cli("ls '%s'", mem);
  CHECK_EXIT(r, 0);
  CHECK(strstr(r.out, "tiers") != NULL);
  CHECK(row_tiers(r.out, 1, "durable") && row_tiers(r.out, 5, "durable"));
  CHECK(row_tiers(r.out, 6, "memory,durable") && row_tiers(r.out, 8, "memory,durable"));
  CHECK(row_tiers(r.out, 9, "memory"));
  result_free(&r);
  r = cli("ls '%s' --json", mem);
  CHECK_EXIT(r, 0);
  json_t *arr = json_loads(r.out, 0, NULL);
  CHECK(json_is_array(arr) && json_array_size(arr) == 9);
  for (size_t i = 0; arr && i < json_array_size(arr); i++) {
    json_t *o = json_array_get(arr, i), *tiers = json_object_get(o, "tiers");
    size_t step = (size_t)json_integer_value(json_object_get(o, "step"));
    CHECK(step == i + 1 && json_is_array(tiers));
    size_t want = step <= 5 || step == 9 ? 1 : 2;
    CHECK(json_array_size(tiers) == want);
    const char *first = json_string_value(json_array_get(tiers, 0));
    CHECK(first && !strcmp(first, step <= 5 ? "durable" : "memory"));
  }
  json_decref(arr);
  result_free(&r);
  r = cli("verify '%s'", mem);
  CHECK_EXIT(r, 0);
  CHECK(strstr(r.out, "step 9: ok") && strstr(r.out, "step 6: ok"));
  result_free(&r);
  r = cli("drain '%s'", mem); /* the recorded durable tier */
  CHECK_EXIT(r, 0);
  CHECK(strstr(r.out, "step 9") != NULL);
  result_free(&r);
  check_step(dur, 9);
  r = cli("ls '%s'", dur); /* the durable tier itself has no TIERS */
  CHECK_EXIT(r, 0);
  CHECK(strstr(r.out, "tiers") == NULL && row(r.out, 1) && row(r.out, 9));
  result_free(&r);
  r = cli("drain '%s' --json", mem);
  CHECK_EXIT(r, 0);
  json_t *o = json_loads(r.out, 0, NULL);
  CHECK(o && json_integer_value(json_object_get(o, "durable_step")) == 9);
  json_decref(o);
  result_free(&r);
  job_close(&j);
  /* a store that never had a drain lists as before */
  char other[2100];
  snprintf(other, sizeof other, "%s/other", t);
  job_open(&j, other, 4);
  for (uint64_t s = 1; s <= 8; s++)
    job_save(&j, s, 0);
  job_close(&j);
  r = cli("ls '%s'", other);
  CHECK_EXIT(r, 0);
  CHECK(strlen(r.out) == strlen(plain) && strstr(r.out, "tiers") == NULL);
  result_free(&r);
  free(plain);
}

static void test_drain_of_a_multi_rank_memory_tier(void) {
  const char *t = tu_tmpdir();
  char mem[2048], dur[2048];
  snprintf(mem, sizeof mem, "%s/mem", t);
  snprintf(dur, sizeof dur, "%s/durable", t);
  gjob jb = {.path = mem, .first = 1, .last = 5, .full_every = 2, .fail_rank = -1};
  g_run(&jb, 2);
  result r = cli("drain '%s' '%s' --json", mem, dur);
  CHECK_EXIT(r, 0);
  json_t *o = json_loads(r.out, 0, NULL);
  CHECK(o && json_integer_value(json_object_get(o, "durable_step")) == 5);
  json_decref(o);
  result_free(&r);
  for (uint64_t s = 1; s <= 5; s++)
    g_check(dur, s);
  r = cli("ls '%s'", mem);
  CHECK_EXIT(r, 0);
  CHECK(row_tiers(r.out, 1, "durable") && row_tiers(r.out, 5, "memory,durable"));
  result_free(&r);
  r = cli("verify '%s'", mem);
  CHECK_EXIT(r, 0);
  result_free(&r);
}

static void test_drain_fails_clearly(void) {
  const char *t = tu_tmpdir();
  char mem[2048];
  snprintf(mem, sizeof mem, "%s/mem", t);
  result r = cli("drain '%s/none'", t);
  CHECK_EXIT(r, 1);
  CHECK(strstr(r.err, "no memory tier at") != NULL);
  result_free(&r);
  job j;
  job_open(&j, mem, 4);
  job_save(&j, 1, 0);
  job_close(&j);
  r = cli("drain '%s'", mem);
  CHECK_EXIT(r, 1);
  CHECK(strstr(r.err, "records no durable tier") && strstr(r.err, "amber drain"));
  result_free(&r);
  /* a durable tier's missing parents are made (as a store's are); one under a file
   * cannot be */
  char file[2100];
  snprintf(file, sizeof file, "%s/plain", t);
  CHECK(tu_write_file(file, "x", 1) == 0);
  r = cli("drain '%s' '%s/under'", mem, file);
  CHECK_EXIT(r, 1);
  CHECK(strstr(r.err, "cannot drain") != NULL);
  result_free(&r);
  r = cli("drain '%s' '%s/new/parents/durable'", mem, t);
  CHECK_EXIT(r, 0);
  result_free(&r);
  r = cli("drain");
  CHECK_EXIT(r, 2);
  result_free(&r);
  r = cli("drain a b c");
  CHECK_EXIT(r, 2);
  result_free(&r);
  r = cli("drain --help");
  CHECK_EXIT(r, 0);
  CHECK(strstr(r.out, "TIERS") && strstr(r.out, "MEMDIR [DURABLE]"));
  result_free(&r);
  r = cli("--help");
  CHECK(strstr(r.out, "amber drain MEMDIR") != NULL);
  result_free(&r);
}

int main(void) {
  TEST_RUN(test_drain_ls_and_verify_of_a_single_rank_memory_tier);
  TEST_RUN(test_drain_of_a_multi_rank_memory_tier);
  TEST_RUN(test_drain_fails_clearly);
  return tu_finish();
}

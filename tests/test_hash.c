/*
 * test_hash.c - the XXH3 builds the library picks at run time (src/xxh.h): the
 * AVX2 and AVX-512 builds of xxHash's code give the library's digests, one-shot and
 * streamed in pieces of every size (and with the library's updates mixed in on the
 * same state), for every length up to a few stripes' worth and beyond; amber__xxh3,
 * whichever build it picked, too.
 */
#include <stdlib.h>

#define AMBER_XXH_LIBRARY /* XXH3_64bits* below are the library's own */
#include "xxh.h"

#include "internal.h"
#include "testutil.h"

#ifdef AMBER_XXH_WIDE
uint64_t amber__xxh3_avx2(const void *data, size_t len);
int amber__xxh3_update_avx2(void *state, const void *data, size_t len);
uint64_t amber__xxh3_avx512(const void *data, size_t len);
int amber__xxh3_update_avx512(void *state, const void *data, size_t len);
#endif

typedef uint64_t (*oneshot_fn)(const void *, size_t);
typedef int (*update_fn)(void *, const void *, size_t);

struct build {
  const char *name;
  oneshot_fn oneshot;
  update_fn update;
};

static uint64_t lib_oneshot(const void *d, size_t n) { return XXH3_64bits(d, n); }
static int lib_update(void *s, const void *d, size_t n) {
  return XXH3_64bits_update(s, d, n) == XXH_OK ? 0 : -1;
}
static uint64_t picked_oneshot(const void *d, size_t n) { return amber__xxh3(d, n); }
static int picked_update(void *s, const void *d, size_t n) {
#ifdef AMBER_XXH_WIDE
  return amber__xxh3_update_wide(s, d, n) == XXH_OK ? 0 : -1;
#else
  return lib_update(s, d, n);
#endif
}

enum { BIG = (3u << 20) + 4093 }; /* several blocks of XXH3's 1 KB stripes, and a tail */

static uint8_t *data(void) {
  static uint8_t *buf;
  if (!buf) {
    buf = malloc(BIG);
    tu_fill_random(buf, BIG, 7);
  }
  return buf;
}

static void same_digests(const struct build *b) {
  const uint8_t *d = data();
  int bad = 0;
  /* every length through 4 KB (the short-input paths and the first stripes), at an
   * odd address too, then long inputs */
  for (size_t n = 0; n <= 4096 && bad < 5; n++)
    for (size_t at = 0; at < 2; at++)
      if (b->oneshot(d + at, n) != XXH3_64bits(d + at, n)) {
        fprintf(stderr, "%s: length %zu at +%zu differs\n", b->name, n, at);
        bad++;
      }
  for (size_t n = 4097; n < BIG && bad < 5; n = n * 3 + 11)
    if (b->oneshot(d, n) != XXH3_64bits(d, n)) {
      fprintf(stderr, "%s: length %zu differs\n", b->name, n);
      bad++;
    }
  CHECK(b->oneshot(d, BIG) == XXH3_64bits(d, BIG));
  CHECK(bad == 0);
}

static void same_streams(const struct build *b) {
  const uint8_t *d = data();
  uint64_t want = XXH3_64bits(d, BIG);
  uint64_t rs = 11;
  for (int round = 0; round < 6; round++) {
    XXH3_state_t st;
    XXH3_INITSTATE(&st);
    XXH3_64bits_reset(&st);
    /* pieces of 0 bytes to 256 KB; from round 3 on every other piece goes through
     * the library's update, as a state may be passed between them */
    size_t off = 0, k = 0;
    while (off < BIG) {
      uint64_t r = tu_rand(&rs);
      size_t n = round % 3 == 0 ? (size_t)(r % 64) : round % 3 == 1 ? (size_t)(r % 4096)
                                                                    : (size_t)(r % (256u << 10));
      if (n > BIG - off) n = BIG - off;
      int rc = round >= 3 && k++ % 2 ? lib_update(&st, d + off, n) : b->update(&st, d + off, n);
      CHECK(rc == 0);
      off += n;
    }
    uint64_t got = XXH3_64bits_digest(&st);
    if (got != want) fprintf(stderr, "%s: streamed round %d differs\n", b->name, round);
    CHECK(got == want);
  }
}

static struct build builds[4];
static size_t nbuilds;

static void test_every_build_gives_the_librarys_digests(void) {
  for (size_t i = 0; i < nbuilds; i++) {
    same_digests(&builds[i]);
    same_streams(&builds[i]);
  }
}

int main(void) {
  builds[nbuilds++] = (struct build){"picked", picked_oneshot, picked_update};
  builds[nbuilds++] = (struct build){"library", lib_oneshot, lib_update};
#ifdef AMBER_XXH_WIDE
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2"))
    builds[nbuilds++] = (struct build){"avx2", amber__xxh3_avx2, amber__xxh3_update_avx2};
  else
    fprintf(stderr, "test_hash: no AVX2 here: its build is not checked\n");
  if (__builtin_cpu_supports("avx512f"))
    builds[nbuilds++] = (struct build){"avx512", amber__xxh3_avx512, amber__xxh3_update_avx512};
  else
    fprintf(stderr, "test_hash: no AVX-512 here: its build is not checked\n");
#endif
  for (size_t i = 0; i < nbuilds; i++) fprintf(stderr, "test_hash: checking %s\n", builds[i].name);
  TEST_RUN(test_every_build_gives_the_librarys_digests);
  return tu_finish();
}

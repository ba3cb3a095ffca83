/*
 * hash.c - xxh3, the one hash of the format: every checksum, the content hash and
 * the state id (docs/FORMAT.md). Streaming hashes over staged data use xxhash's
 * state API where the data is (src/io.c, src/writer.c).
 *
 * With AMBER_XXH_WIDE, also the choice of XXH3 build (src/xxh.h): AVX-512, AVX2 or
 * the library's, made at the first hash from what the CPU and the kernel support.
 */
#define AMBER_XXH_LIBRARY /* this file calls the library's XXH3 by its own name */
#include "xxh.h"

#include "internal.h"

#ifdef AMBER_XXH_WIDE
uint64_t amber__xxh3_avx2(const void *data, size_t len);
int amber__xxh3_update_avx2(void *state, const void *data, size_t len);
uint64_t amber__xxh3_avx512(const void *data, size_t len);
int amber__xxh3_update_avx512(void *state, const void *data, size_t len);

typedef uint64_t (*oneshot_fn)(const void *, size_t);
typedef int (*update_fn)(void *, const void *, size_t);

static uint64_t lib_oneshot(const void *data, size_t len) {
  return XXH3_64bits(data, len);
}
static int lib_update(void *state, const void *data, size_t len) {
  return XXH3_64bits_update(state, data, len) == XXH_OK ? 0 : -1;
}

static oneshot_fn oneshot; /* set once, atomically: every thread picks the same */
static update_fn update;

static void pick(void) {
  oneshot_fn o = lib_oneshot;
  update_fn u = lib_update;
  __builtin_cpu_init();
  /* __builtin_cpu_supports also checks that the kernel saves the registers. */
  if (__builtin_cpu_supports("avx512f")) {
    o = amber__xxh3_avx512, u = amber__xxh3_update_avx512;
  } else if (__builtin_cpu_supports("avx2")) {
    o = amber__xxh3_avx2, u = amber__xxh3_update_avx2;
  }
  __atomic_store_n(&update, u, __ATOMIC_RELAXED);
  __atomic_store_n(&oneshot, o, __ATOMIC_RELEASE);
}

uint64_t amber__xxh3_wide(const void *data, size_t len) {
  oneshot_fn o = __atomic_load_n(&oneshot, __ATOMIC_ACQUIRE);
  if (!o) {
    pick();
    o = __atomic_load_n(&oneshot, __ATOMIC_ACQUIRE);
  }
  return o(data, len);
}

XXH_errorcode amber__xxh3_update_wide(XXH3_state_t *state, const void *data, size_t len) {
  if (!__atomic_load_n(&oneshot, __ATOMIC_ACQUIRE)) pick();
  update_fn u = __atomic_load_n(&update, __ATOMIC_RELAXED);
  return u(state, data, len) == 0 ? XXH_OK : XXH_ERROR;
}
#endif

uint64_t amber__xxh3(const void *data, size_t len) {
#ifdef AMBER_XXH_WIDE
  return amber__xxh3_wide(data, len);
#else
  return XXH3_64bits(data, len);
#endif
}

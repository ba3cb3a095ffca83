/*
 * xxh_wide.h - XXH3 compiled for one vector extension: the body of xxh_avx2.c and
 * xxh_avx512.c, each of which defines XXH_WIDE_NAME(base) (the suffix of its
 * functions) and alone is built with that extension's flag (CMakeLists.txt). xxHash's
 * own code, its header inlined (XXH_INLINE_ALL: static, under XXH_INLINE_ names),
 * picks the widest vectors the flag allows. Called only where the CPU has them
 * (src/hash.c); see src/xxh.h.
 */
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <stddef.h>
#include <stdint.h>

/* The state is the library's XXH3_state_t: the same struct under another name. */
uint64_t XXH_WIDE_NAME(amber__xxh3)(const void *data, size_t len);
int XXH_WIDE_NAME(amber__xxh3_update)(void *state, const void *data, size_t len);

uint64_t XXH_WIDE_NAME(amber__xxh3)(const void *data, size_t len) {
  return XXH3_64bits(data, len);
}

int XXH_WIDE_NAME(amber__xxh3_update)(void *state, const void *data, size_t len) {
  return XXH3_64bits_update((XXH3_state_t *)state, data, len) == XXH_OK ? 0 : -1;
}

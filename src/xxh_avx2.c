/*
 * xxh_avx2.c - XXH3 compiled for AVX2: xxHash's own code (xxhash.h, inlined), this
 * file alone built with -mavx2 (CMakeLists.txt). Called only where the CPU has
 * AVX2 (src/hash.c); see src/xxh.h.
 */
#define XXH_INLINE_ALL /* the implementation, static, under XXH_INLINE_ names */
#include <xxhash.h>

#include <stddef.h>
#include <stdint.h>

/* The state is the library's XXH3_state_t: the same struct under another name. */
uint64_t amber__xxh3_avx2(const void *data, size_t len);
int amber__xxh3_update_avx2(void *state, const void *data, size_t len);

uint64_t amber__xxh3_avx2(const void *data, size_t len) {
  return XXH3_64bits(data, len);
}

int amber__xxh3_update_avx2(void *state, const void *data, size_t len) {
  return XXH3_64bits_update((XXH3_state_t *)state, data, len) == XXH_OK ? 0 : -1;
}

/*
 * xxh.h - internal: xxHash as the library includes it. Every checksum of the
 * format is XXH3 (src/hash.c).
 *
 * XXH_STATIC_LINKING_ONLY: XXH3_state_t on the stack, no allocation per chunk.
 *
 * AMBER_XXH_WIDE (x86-64, set by CMake): XXH3_64bits and XXH3_64bits_update are
 * replaced by amber__xxh3_wide*, which run xxHash's own code compiled for AVX2 or
 * AVX-512 (src/xxh_avx2.c, src/xxh_avx512.c: xxhash.h inlined, XXH_INLINE_ALL) where
 * the CPU has them, and the library's functions elsewhere (src/hash.c picks once).
 * The digests are the same; a distribution's libxxhash is built for SSE2, and not
 * every build carries xxHash's own dispatcher (Debian's static archive does not).
 * On a restore from memory, where every chunk is hashed as it is copied, the SSE2
 * hash takes a fifth of the time, AVX-512 half of that.
 */
#ifndef AMBER_XXH_H
#define AMBER_XXH_H

#include <stddef.h>
#include <stdint.h>

#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#ifdef AMBER_XXH_WIDE
uint64_t amber__xxh3_wide(const void *data, size_t len);
XXH_errorcode amber__xxh3_update_wide(XXH3_state_t *state, const void *data, size_t len);
#endif
#if defined(AMBER_XXH_WIDE) && !defined(AMBER_XXH_LIBRARY)
#undef XXH3_64bits
#define XXH3_64bits amber__xxh3_wide
#undef XXH3_64bits_update
#define XXH3_64bits_update amber__xxh3_update_wide
#endif

#endif

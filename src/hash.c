/*
 * hash.c - xxh3, the one hash of the format: every checksum, the content hash and
 * the state id (docs/FORMAT.md). Streaming hashes over staged data use xxhash's
 * state API where the data is (src/io.c, src/writer.c).
 */
#include <xxhash.h>

#include "internal.h"

uint64_t amber__xxh3(const void *data, size_t len) {
  return XXH3_64bits(data, len);
}

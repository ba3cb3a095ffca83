/*
 * fuzz_manifest.c - fuzz target for the manifest parser (src/manifest.c). The
 * input is decoded as it is, and once more with its length field and checksum
 * recomputed, so that mutations reach the table parsers behind the checksum. A
 * decoded manifest is encoded again and must give the same bytes, but for its
 * format_minor, which the encoder sets from the contents (4 where a rank holds
 * several shards of a tensor, else 2; a reader takes any it knows), and so the
 * checksum; a failure must come with a message. The input is also decoded as a rank file's box table
 * (the other table src/manifest.c parses), which must encode again to as many
 * bytes. Built as a libFuzzer target (AMBER_FUZZ) and, with fuzz/replay.c, as a
 * plain test over tests/corpus/manifest/.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "global.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void one(const uint8_t *in, size_t len) {
  amber__manifest m;
  amber__err e;
  e.msg[0] = 0;
  int rc = amber__manifest_decode(&e, "fuzz", in, len, &m);
  if (rc < 0) {
    if (!e.msg[0]) {
      fprintf(stderr, "fuzz_manifest: failure without a message\n");
      abort();
    }
    return;
  }
  uint8_t *out;
  size_t olen;
  if (amber__manifest_encode(&m, &e, &out, &olen) == 0) {
    if (olen != len || memcmp(out, in, 10) != 0 || memcmp(out + 12, in + 12, len - 20) != 0) {
      fprintf(stderr, "fuzz_manifest: decode then encode changed the bytes\n");
      abort();
    }
    free(out);
  }
  amber__manifest_free(&m);
}

static void boxes(const uint8_t *in, size_t len) {
  amber__box *b = NULL;
  size_t n = 0;
  amber__err e;
  e.msg[0] = 0;
  if (amber__boxes_decode(&e, "fuzz", in, len, &b, &n) < 0) {
    if (!e.msg[0]) {
      fprintf(stderr, "fuzz_manifest: box table failure without a message\n");
      abort();
    }
    return;
  }
  uint8_t *out;
  size_t olen;
  if (amber__boxes_encode(b, n, &e, &out, &olen) == 0) {
    if (olen != len) {
      fprintf(stderr, "fuzz_manifest: a box table encodes to another size\n");
      abort();
    }
    free(out);
  }
  free(b);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  one(data, size);
  boxes(data, size);
  if (size >= AMBER__MF_HEADER + 8 && size < (1u << 24)) {
    uint8_t *c = malloc(size);
    if (!c) return 0;
    memcpy(c, data, size);
    amber__put64(c + 48, size);
    amber__put64(c + size - 8, amber__xxh3(c, size - 8));
    one(c, size);
    free(c);
  }
  return 0;
}

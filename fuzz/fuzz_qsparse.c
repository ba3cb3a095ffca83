/*
 * fuzz_qsparse.c - fuzz target for the decoder of quantized sparse bodies
 * (docs/FORMAT.md, "Quantized sparse body"; Guarantee 5), below the zstd frame and
 * the checksums that keep a file-level fuzzer (fuzz_reader.c) from reaching it.
 *
 * Input: 1 byte dtype selector (f32, f64, bf16, f16, then f8 and i32, which must be
 * refused), 2 bytes n (1..4096 elements, little-endian), 2 bytes k, then the body.
 * The target decodes the body onto a chunk of n elements into a buffer of exactly
 * n elements, with index scratch of exactly k entries each. It aborts if a refused
 * body changed the chunk or was refused with another code than AMBER_ECORRUPT, if
 * a body of a dtype without codes was accepted, or if an accepted one changed an
 * element that its positions do not name. Built as a libFuzzer target (AMBER_FUZZ)
 * and, with fuzz/replay.c, as a plain test over tests/corpus/qsparse/
 * (tests/corpus/make_qsparse_corpus.py writes its seeds).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "codec.h"
#include "internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define ASSERT(c)                                                                        \
  do {                                                                                   \
    if (!(c)) {                                                                          \
      fprintf(stderr, "fuzz_qsparse: %s failed\n", #c);                                  \
      abort();                                                                           \
    }                                                                                    \
  } while (0)

static const int DTYPES[] = {AMBER_F32, AMBER_F64, AMBER_BF16, AMBER_F16, AMBER_F8_E4M3,
                             AMBER_I32};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 5) return 0;
  int dt = DTYPES[data[0] % 6];
  size_t n = 1 + amber__get16(data + 1) % 4096, k = amber__get16(data + 3) % (n + 1);
  size_t w = amber_dtype_size(dt), len = size - 5;
  const uint8_t *body = data + 5;
  uint8_t *dst = malloc(n * w), *before = malloc(n * w);
  uint32_t *idx = malloc((k ? k : 1) * 4), *esc = malloc((k ? k : 1) * 4);
  ASSERT(dst && before && idx && esc);
  for (size_t i = 0; i < n * w; i++) before[i] = (uint8_t)(i * 37 + 11);
  memcpy(dst, before, n * w);
  int rc = amber__qsparse_apply(dst, body, len, n, k, dt, idx, esc);
  if (rc) {
    ASSERT(rc == AMBER_ECORRUPT && !memcmp(dst, before, n * w));
  } else {
    ASSERT(amber__quant_dtype(dt));
    /* only the named elements changed */
    uint8_t *named = calloc(n, 1);
    ASSERT(named);
    for (size_t i = 0; i < k; i++) {
      ASSERT(idx[i] < n && (i == 0 || idx[i] > idx[i - 1]));
      named[idx[i]] = 1;
    }
    for (size_t e = 0; e < n; e++)
      if (!named[e]) ASSERT(!memcmp(dst + e * w, before + e * w, w));
    free(named);
  }
  free(dst), free(before), free(idx), free(esc);
  return 0;
}

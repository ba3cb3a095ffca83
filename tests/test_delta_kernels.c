/*
 * test_delta_kernels.c - the scan kernels and the sparse bodies of a delta: every
 * SIMD level selects exactly what the portable kernels select and moves the
 * reference the same way; a budget fills exactly from a cluster of equal changes;
 * the policies hold through the portable and AVX2 kernels too; and the sparse
 * body is byte for byte docs/FORMAT.md's on both sides of the bitmap/varint
 * crossover.
 */
#include <math.h>
#include <stdlib.h>

#include "codec.h"
#include "format.h"
#include "internal.h"
#include "scan.h"
#include "trajectory.h"

/* ---- the fused f32 kernels against the portable ones ---- */

/* One f32 value as a trajectory might hold it: drifts of every size, exact ties,
 * subnormals, signed zeros, NaN of several encodings and infinities. */
static float odd_f32(uint64_t *rs, float base) {
  uint64_t r = tu_rand(rs);
  switch (r % 16) {
  case 0: return base;                              /* unchanged */
  case 1: return base + 1e-3f;                      /* ties: the same change */
  case 2: return base - 1e-3f;
  case 3: return 0x1p-140f * (float)(r >> 40 & 0xff); /* subnormals */
  case 4: return -0.0f;
  case 5: return (r >> 8) & 1 ? INFINITY : -INFINITY;
  case 6: {
    uint32_t b = 0x7f800001u | (uint32_t)(r >> 16 & 0x7fffff) | (uint32_t)(r >> 40 & 1) << 31;
    float f;
    memcpy(&f, &b, 4);
    return f; /* a NaN, payload and sign random */
  }
  case 7: return base * 1e30f;
  default: return base + (float)((double)(int64_t)(r >> 1) / 9.2e18) * 0.01f;
  }
}

/* Every scan level must select the same elements, in the same order, with the
 * same values, and leave the same reference: the fused kernels are a faster way
 * to run the portable ones, nothing else. */
static void test_simd_kernels_select_what_the_portable_ones_select(void) {
  const size_t sizes[] = {0, 1, 7, 15, 16, 17, 31, 33, 100, 255, 256, 257, 4099, 65536 + 5};
  struct {
    int kind;
    double abs, rel, cap;
    double frac, share, mult; /* share: a threshold's share cap ("/SHARE:MULT") */
  } pols[] = {{AMBER__SCAN_THRESHOLD, 1e-3, 1e-2, INFINITY, 0, 0, 0},
              {AMBER__SCAN_THRESHOLD, 1e-4, 1e-3, INFINITY, 0, 0.05, 4},
              {AMBER__SCAN_THRESHOLD, 0, 1e-3, INFINITY, 0, 0.3, 1},
              {AMBER__SCAN_THRESHOLD, 1e-6, 0, INFINITY, 0, 1e-4, 100},
              {AMBER__SCAN_THRESHOLD, 0, 0, INFINITY, 0, 0, 0},
              {AMBER__SCAN_THRESHOLD, 0, 1e-3, INFINITY, 0, 0, 0},
              {AMBER__SCAN_THRESHOLD, 0, 1e-5, INFINITY, 0, 0, 0},
              {AMBER__SCAN_THRESHOLD, 1e-40, 0, INFINITY, 0, 0, 0},
              {AMBER__SCAN_THRESHOLD, INFINITY, 0, INFINITY, 0, 0, 0},
              {AMBER__SCAN_BUDGET, 0, 0, INFINITY, 0.02, 0, 0},
              {AMBER__SCAN_BUDGET, 0, 0, 0.5, 0.1, 0, 0},
              {AMBER__SCAN_BUDGET, 0, 0, 1e-3, 0, 0, 0},
              {AMBER__SCAN_BUDGET, 0, 0, 0, 1, 0, 0},
              {AMBER__SCAN_BUDGET, 0, 0, INFINITY, 0.3, 0, 0}};
  size_t maxn = 65536 + 5, cases = 0;
  float *base = malloc(maxn * 4);
  uint8_t *live = malloc(maxn * 4 + 4), *ref0 = malloc(maxn * 4);
  uint8_t *ref[3], *vals[3], *olds[3];
  uint32_t *idx[3], *keys[3];
  for (int l = 0; l < 3; l++) {
    ref[l] = malloc(maxn * 4);
    vals[l] = malloc(maxn * 4);
    olds[l] = malloc(maxn * 4);
    idx[l] = malloc(maxn * 4);
    keys[l] = malloc(maxn * 4);
  }
  uint64_t rs = 777;
  for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++) {
    size_t n = sizes[si];
    for (size_t pi = 0; pi < sizeof pols / sizeof *pols; pi++) {
      for (int mis = 0; mis < 2; mis++) { /* live at an odd address, as in safetensors */
        uint8_t *lv = live + mis;
        for (size_t i = 0; i < n; i++) {
          base[i] = (float)((double)(int64_t)tu_rand(&rs) / 9.2e18);
          if (tu_rand(&rs) % 4 == 0) base[i] *= 0x1p-130f; /* near and below FLT_MIN */
          float r = tu_rand(&rs) % 8 ? base[i] : odd_f32(&rs, base[i]);
          float x = odd_f32(&rs, base[i]);
          if (tu_rand(&rs) % 4 == 0) { /* a change of one or two units in the last place */
            float to = tu_rand(&rs) % 2 ? INFINITY : -INFINITY;
            x = nextafterf(r, to);
            if (tu_rand(&rs) % 2) x = nextafterf(x, to);
          }
          memcpy(ref0 + 4 * i, &r, 4);
          memcpy(lv + 4 * i, &x, 4);
        }
        size_t k[3];
        for (int l = 0; l < 3; l++) {
          memcpy(ref[l], ref0, n * 4);
          amber__scan_args a = {.kind = pols[pi].kind, .dtype = AMBER_F32, .n = n, .live = lv,
                                .ref = ref[l], .abs = pols[pi].abs, .rel = pols[pi].rel,
                                .cap = pols[pi].cap, .keys = keys[l], .idx = idx[l],
                                .vals = vals[l], .olds = olds[l]};
          if (a.kind == AMBER__SCAN_BUDGET) {
            a.budget = (size_t)(pols[pi].frac * (double)n);
            if (!a.budget && pols[pi].frac > 0) a.budget = 1;
          }
          if (pols[pi].share > 0) { /* as chunk.c sets it: the reference stays */
            a.share_k = (size_t)(pols[pi].share * (double)n);
            if (!a.share_k) a.share_k = 1;
            a.mult = pols[pi].mult;
            a.defer = 1;
          }
          amber__scan_use_simd(l);
          k[l] = amber__scan(&a);
        }
        amber__scan_use_simd(2);
        for (int l = 1; l < 3; l++) {
          int same = k[l] == k[0] && !memcmp(idx[l], idx[0], k[0] * 4) &&
                     !memcmp(vals[l], vals[0], k[0] * 4) && !memcmp(ref[l], ref[0], n * 4);
          CHECK(same);
          if (!same)
            DETAIL("n=%zu policy %zu misaligned=%d: level %d selected %zu, portable %zu", n, pi,
                   mis, l, k[l], k[0]);
        }
        cases++;
      }
    }
  }
  CHECK(cases == 2 * sizeof pols / sizeof *pols * sizeof sizes / sizeof *sizes);
  for (int l = 0; l < 3; l++) {
    free(ref[l]);
    free(vals[l]);
    free(olds[l]);
    free(idx[l]);
    free(keys[l]);
  }
  free(base);
  free(live);
  free(ref0);
}

/* Changes that are (nearly) all equal, as under Lion or in bf16: the budget is
 * still filled exactly, the larger changes all go first, indices stay sorted, and
 * the reference takes exactly the selected values. */
static void test_budget_fills_from_a_cluster_of_equal_changes(void) {
  const size_t n = 200003, budget = n / 50;
  const int dtypes[] = {AMBER_F32, AMBER_BF16};
  uint8_t *live = malloc(n * 4), *ref = malloc(n * 4), *ref0 = malloc(n * 4);
  uint8_t *vals = malloc(n * 4), *olds = malloc(n * 4);
  uint32_t *idx = malloc(n * 4), *keys = malloc(n * 4);
  uint64_t rs = 4242;
  for (int di = 0; di < 2; di++) {
    int dt = dtypes[di];
    size_t w = amber_dtype_size(dt), big = 0;
    for (size_t i = 0; i < n; i++) {
      float r = (float)((double)(int64_t)tu_rand(&rs) / 9.2e18) * 0.05f;
      int large = tu_rand(&rs) % 200 == 0; /* 0.5%: must all be selected */
      float x = r + ((tu_rand(&rs) & 1) ? 1e-4f : -1e-4f) * (large ? 50.0f : 1.0f);
      big += large;
      if (dt == AMBER_F32) {
        memcpy(ref0 + 4 * i, &r, 4);
        memcpy(live + 4 * i, &x, 4);
      } else { /* bf16: the top half of the f32 */
        uint32_t rb, xb;
        memcpy(&rb, &r, 4);
        memcpy(&xb, &x, 4);
        uint16_t r16 = (uint16_t)(rb >> 16), x16 = (uint16_t)(xb >> 16);
        if (x16 == r16) x16 ^= 1;
        memcpy(ref0 + 2 * i, &r16, 2);
        memcpy(live + 2 * i, &x16, 2);
      }
    }
    for (int level = 0; level < 3; level++) {
      memcpy(ref, ref0, n * w);
      amber__scan_args a = {.kind = AMBER__SCAN_BUDGET, .dtype = dt, .n = n, .live = live,
                            .ref = ref, .cap = INFINITY, .budget = budget, .keys = keys,
                            .idx = idx, .vals = vals, .olds = olds};
      amber__scan_use_simd(level);
      size_t k = amber__scan(&a);
      amber__scan_use_simd(2);
      CHECK(k == budget);
      size_t sorted = 1, large_in = 0, moved = 0, valsok = 1;
      for (size_t i = 0; i < k; i++) {
        if (i && idx[i] <= idx[i - 1]) sorted = 0;
        double d = fabs(amber__to_f64(dt, live + idx[i] * w) - amber__to_f64(dt, ref0 + idx[i] * w));
        large_in += d > 2e-3;
        if (memcmp(vals + i * w, live + idx[i] * w, w)) valsok = 0;
      }
      for (size_t i = 0; i < n; i++) moved += memcmp(ref + i * w, ref0 + i * w, w) != 0;
      CHECK(sorted && valsok);
      CHECK(large_in == big);
      CHECK(moved == k);
      if (!sorted || !valsok || large_in != big || moved != k)
        DETAIL("dtype %d level %d: %zu selected (budget %zu), sorted %zu, %zu of %zu large "
               "changes, %zu reference elements moved\n",
               dt, level, k, budget, sorted, large_in, big, moved);
    }
  }
  free(live);
  free(ref);
  free(ref0);
  free(vals);
  free(olds);
  free(idx);
  free(keys);
}

/* The threshold and budget properties once more through the portable kernels,
 * which machines without AVX2 run. */
static void test_policies_hold_through_the_portable_kernels(void) {
  amber__scan_use_simd(0);
  const pol t = thr(1e-3, 1e-2, "threshold:1e-3:1e-2"), b = bud(0.1, 0.01, "budget:0.1:0.01");
  run_trajectory(901, 64, t.spec, &t, 40, UINT32_MAX, -1, 1, NULL);
  run_trajectory(902, 1000, b.spec, &b, 40, UINT32_MAX, -1, 1, NULL);
  amber__scan_use_simd(1);
  run_trajectory(903, 1000, b.spec, &b, 40, UINT32_MAX, -1, 1, NULL);
  amber__scan_use_simd(2);
}

/* The sparse body as docs/FORMAT.md describes it, written the obvious way: the
 * index form is the varint gaps when they are shorter than the bitmap. */
static size_t reference_sparse_body(uint8_t *body, const uint32_t *idx, const uint8_t *vals,
                                    size_t k, size_t n, size_t w) {
  size_t bitmap = (n + 7) / 8, varints = 0, o = 1;
  for (size_t i = 0; i < k; i++)
    for (uint32_t g = i ? idx[i] - idx[i - 1] - 1 : idx[0];; g >>= 7) {
      varints++;
      if (g < 0x80) break;
    }
  body[0] = varints < bitmap;
  if (body[0]) {
    for (size_t i = 0; i < k; i++) {
      uint32_t g = i ? idx[i] - idx[i - 1] - 1 : idx[0];
      for (; g >= 0x80; g >>= 7) body[o++] = (uint8_t)(g | 0x80);
      body[o++] = (uint8_t)g;
    }
  } else {
    memset(body + 1, 0, bitmap);
    for (size_t i = 0; i < k; i++) body[1 + idx[i] / 8] |= (uint8_t)(1u << (idx[i] % 8));
    o += bitmap;
  }
  for (size_t i = 0; i < k; i++)
    for (size_t b = 0; b < w; b++) body[o + b * k + i] = vals[i * w + b];
  return o + k * w;
}

/* amber__sparse_encode writes the reference body byte for byte on both sides of
 * the bitmap/varint crossover (gaps of 1 to 4 varint bytes, selections from empty
 * to full), and amber__sparse_apply puts every value back where it came from. */
static void test_sparse_bodies_match_the_format_across_the_crossover(void) {
  const size_t sizes[] = {1, 7, 8, 9, 40, 41, 1000, 4099, 70000};
  const size_t widths[] = {1, 2, 4, 8};
  uint64_t rng = 0x5eed5;
  size_t cases = 0, varint_cases = 0;
  for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
    size_t n = sizes[si];
    uint32_t *idx = malloc(n * sizeof *idx), *scratch = malloc(n * sizeof *scratch);
    uint8_t *vals = malloc(n * 8), *dst = malloc(n * 8), *want = malloc(n * 8);
    size_t cap = amber__sparse_bound(n, n, 8);
    uint8_t *got = malloc(cap), *ref = malloc(cap);
    CHECK(idx && scratch && vals && dst && want && got && ref);
    for (int trial = 0; trial < 60; trial++) {
      /* densities around 1/8 (the crossover for one-byte gaps) and far from it;
       * sparse selections have gaps of 2 and 3 bytes */
      double p = trial < 40 ? 0.05 + 0.0025 * trial : 1.0 / (double)(1 + (trial % 20) * 40);
      size_t k = 0;
      for (size_t i = 0; i < n; i++) {
        rng = rng * 6364136223846793005u + 1442695040888963407u;
        double u = (double)(rng >> 11) / 9007199254740992.0;
        if (u < p || (trial % 7 == 3 && i == n - 1)) idx[k++] = (uint32_t)i;
      }
      size_t w = widths[trial % 4];
      for (size_t i = 0; i < k * w; i++) vals[i] = (uint8_t)(rng >> (8 * (i % 8)));
      size_t glen = amber__sparse_encode(got, idx, vals, k, n, w);
      size_t rlen = reference_sparse_body(ref, idx, vals, k, n, w);
      CHECK(glen == rlen);
      CHECK(glen <= amber__sparse_bound(n, k, w));
      if (glen != rlen || memcmp(got, ref, rlen) != 0) {
        fprintf(stderr, "    n=%zu k=%zu w=%zu trial=%d: body differs\n", n, k, w, trial);
        CHECK(0);
        break;
      }
      varint_cases += got[0] == 1;
      memset(dst, 0xA5, n * w);
      memset(want, 0xA5, n * w);
      for (size_t i = 0; i < k; i++) memcpy(want + (size_t)idx[i] * w, vals + i * w, w);
      CHECK_OK(amber__sparse_apply(dst, got, glen, n, k, w, scratch));
      CHECK(memcmp(dst, want, n * w) == 0);
      cases++;
    }
    free(idx), free(scratch), free(vals), free(dst), free(want), free(got), free(ref);
  }
  CHECK(varint_cases > 0 && varint_cases < cases); /* both forms were exercised */
  /* four-byte gaps: three elements of the largest chunk */
  size_t n = AMBER__MAX_CHUNK_ELEMS, k = 3;
  uint32_t idx[3] = {0, (1u << 21) + 7, (uint32_t)n - 1}, scratch[3];
  uint8_t vals[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  uint8_t *got = malloc(amber__sparse_bound(n, k, 4)), *ref = malloc(amber__sparse_bound(n, k, 4));
  CHECK(got && ref);
  size_t glen = amber__sparse_encode(got, idx, vals, k, n, 4);
  CHECK(glen == reference_sparse_body(ref, idx, vals, k, n, 4) && memcmp(got, ref, glen) == 0);
  CHECK(got[0] == 1 && glen == 1 + 1 + 4 + 4 + 12);
  uint8_t *dst = calloc(n, 4);
  CHECK(dst != NULL);
  CHECK_OK(amber__sparse_apply(dst, got, glen, n, k, 4, scratch));
  CHECK(memcmp(dst + 4 * (size_t)idx[1], vals + 4, 4) == 0 &&
        memcmp(dst + 4 * (n - 1), vals + 8, 4) == 0);
  free(dst), free(got), free(ref);
}

int main(void) {
  TEST_RUN(test_simd_kernels_select_what_the_portable_ones_select);
  TEST_RUN(test_policies_hold_through_the_portable_kernels);
  TEST_RUN(test_budget_fills_from_a_cluster_of_equal_changes);
  TEST_RUN(test_sparse_bodies_match_the_format_across_the_crossover);
  return tu_finish();
}

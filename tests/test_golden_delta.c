/*
 * test_golden_delta.c - a chain of delta checkpoints written by format 1.0 must
 * restore forever (docs/FORMAT.md; docs/DESIGN.md, "Golden files").
 *
 * tests/golden/v1.0/delta/ holds a small store written once by this program
 * (`test_golden_delta --regenerate DIR`, one thread, so the files are
 * reproducible) and committed: step 100 full, then steps 101..105, each a delta
 * of the one before, with every delta encoding of format 1.0:
 *  - "w.sparse" (f32, 4 chunks of 256): chunk 0 changes 3 elements per step
 *    (SPARSE, varint indices), chunk 1 every 5th (SPARSE, bitmap), chunk 2 never
 *    (UNCHANGED), chunk 3 all of them to random bits (RAW);
 *  - "w.xor" (f32, exact): the lowest bit of about half the elements flips each
 *    step (XOR_ZSTD);
 *  - "m.thr" (bf16, threshold:1e-2:1e-2), "v.thr" (f32, threshold:0:1e-3) and
 *    "b.bud" (f16, budget:0.25:0.05): lossy tensors whose restores lag the values;
 *  - "step" (i64 scalar), "frozen" (f16, never changes), "mask" (bool), "rng" (u8).
 * The normal run opens the committed store read-only and checks every step's
 * tensors against values recomputed here from the same generator (bit-exact for
 * exact tensors, within the bound for lossy ones), the metadata, the list, that
 * verify passes, and that the files really hold each encoding (parsed with the
 * internal index decoder). Never regenerate the files of a released format
 * version: a new version gets a new directory.
 */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <unistd.h>

#include <zstd.h>

#include "ckpt.h"
#include "format.h"
#include "internal.h"
#include "scan.h"
#include "testutil.h"

#define GOLDEN AMBER_SOURCE_DIR "/tests/golden/v1.0/delta"
#define FIRST 100
#define LAST 105
#define CHUNK 256

enum { T_SPARSE, T_XOR, T_MTHR, T_VTHR, T_BUD, T_STEP, T_FROZEN, T_MASK, T_RNG, NT };

typedef struct {
  const char *name;
  int dtype;
  uint32_t ndim;
  int64_t n;
  const char *rule;   /* passed to amber_writer_add_policy, or NULL */
  const char *policy; /* what the index records */
  double abs, rel;    /* threshold bound; cap for budget in abs */
} spec;

static const spec specs[NT] = {
    {"w.sparse", AMBER_F32, 1, 4 * CHUNK, NULL, "exact", 0, 0},
    {"w.xor", AMBER_F32, 1, 600, NULL, "exact", 0, 0},
    {"m.thr", AMBER_BF16, 1, 700, "m.thr=threshold:1e-2:1e-2", "threshold:1e-2:1e-2", 1e-2, 1e-2},
    {"v.thr", AMBER_F32, 1, 300, "v.thr=threshold:0:1e-3", "threshold:0:1e-3", 0, 1e-3},
    {"b.bud", AMBER_F16, 1, 256, "b.bud=budget:0.25:0.05", "budget:0.25:0.05", 0.05, 0},
    {"step", AMBER_I64, 0, 1, NULL, "exact", 0, 0},
    {"frozen", AMBER_F16, 1, 513, NULL, "exact", 0, 0},
    {"mask", AMBER_BOOL, 1, 77, NULL, "exact", 0, 0},
    {"rng", AMBER_U8, 1, 32, NULL, "exact", 0, 0},
};

/* ---- the generator: a pure function of (tensor, element, step) ---- */

/* splitmix64's finalizer; written out here so that the values never change. */
static uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

static uint64_t H(int t, uint64_t k, uint64_t step) {
  return mix(mix(mix((uint64_t)t) ^ k) ^ step);
}

static uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

/* A float in [-1, 1] with few significant bits, from a hash. */
static float small_float(uint64_t h) {
  return (float)((int)(h % 20001) - 10000) * 1e-4f;
}

/* Whether element k of "w.sparse" changes at delta step s (> FIRST). */
static int sparse_changes(uint64_t k, uint64_t s) {
  uint64_t c = k / CHUNK, j = k % CHUNK;
  switch (c) {
  case 0: return j == (s * 37) % CHUNK || j == (s * 101 + 7) % CHUNK || j == (s * 13 + 200) % CHUNK;
  case 1: return (j + s) % 5 == 0;
  case 2: return 0;
  default: return 1;
  }
}

/* Bits (little-endian, in a u64) of element k of tensor t at step s. */
static uint64_t gen(int t, uint64_t k, uint64_t s) {
  uint64_t d = s - FIRST;
  switch (t) {
  case T_SPARSE: {
    uint64_t at = FIRST;
    for (uint64_t q = s; q > FIRST && at == FIRST; q--)
      if (sparse_changes(k, q)) at = q;
    if (k / CHUNK == 3 && at > FIRST) return (uint32_t)H(t, k, at); /* random bits */
    return f32_bits(small_float(H(t, k, at)));
  }
  case T_XOR: {
    uint32_t b = f32_bits(small_float(H(t, k, 0)) + 2.0f);
    for (uint64_t q = FIRST + 1; q <= s; q++) b ^= (uint32_t)(H(t, k, q) & 1);
    return b;
  }
  case T_MTHR: { /* drift of up to 0.01 per step; bf16 by truncation */
    float base = 2 * small_float(H(t, k, 0)), dir = small_float(H(t, k, 1));
    return f32_bits(base + 0.01f * (float)d * dir) >> 16;
  }
  case T_VTHR: { /* relative drift of up to 7e-4 per step */
    float base = small_float(H(t, k, 0)) + 1.5f, dir = small_float(H(t, k, 1));
    return f32_bits(base * (1 + 7e-4f * (float)d * dir));
  }
  case T_BUD: /* f16 near 1..1.5, 0 to 2 units in the last place per step */
    return 0x3C00u + H(t, k, 0) % 512 + d * (H(t, k, 1) % 3);
  case T_STEP: return s;
  case T_FROZEN: return 0x3C00u + H(t, k, 0) % 1000;
  case T_MASK: return H(t, k, s / 2) & 1;
  default: return H(t, k, s) & 0xff;
  }
}

static size_t nbytes(int t) {
  return (size_t)specs[t].n * amber_dtype_size(specs[t].dtype);
}

static void fill(int t, uint64_t s, uint8_t *out) {
  size_t w = amber_dtype_size(specs[t].dtype);
  for (uint64_t k = 0; k < (uint64_t)specs[t].n; k++) {
    uint64_t v = gen(t, k, s);
    for (size_t b = 0; b < w; b++) out[k * w + b] = (uint8_t)(v >> (8 * b));
  }
}

static int meta_of(uint64_t step, char *buf, size_t cap) {
  return snprintf(buf, cap, "{\"amber.golden\": \"v1.0/delta\", \"step\": %" PRIu64 "}", step);
}

/* ---- regenerate ---- */

static int regenerate(const char *dir) {
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.threads = 1; /* payloads in a fixed order: reproducible files */
  amber_store *st = NULL;
  int rc = amber_store_open(&st, dir, &so);
  uint64_t latest;
  if (!rc && amber_store_latest(st, &latest) == 0) rc = AMBER_EEXIST; /* never overwrite */
  amber_writer_opts wo;
  tu_deltas_only(&wo, CHUNK);
  amber_writer *w = NULL;
  uint8_t *data[NT] = {0};
  if (!rc) rc = amber_writer_open(&w, st, &wo);
  for (int t = 0; t < NT && !rc; t++) {
    data[t] = calloc(nbytes(t) + 1, 1);
    int64_t shape = specs[t].n;
    rc = amber_writer_add(w, specs[t].name, specs[t].dtype, specs[t].ndim, &shape, data[t], NULL);
    if (!rc && specs[t].rule) rc = amber_writer_add_policy(w, specs[t].rule);
  }
  for (uint64_t s = FIRST; s <= LAST && !rc; s++) {
    char meta[128];
    int n = meta_of(s, meta, sizeof meta);
    for (int t = 0; t < NT; t++) fill(t, s, data[t]);
    rc = amber_writer_set_meta(w, meta, (size_t)n);
    if (!rc) rc = amber_writer_save(w, s, 0);
  }
  if (rc)
    fprintf(stderr, "regenerate %s: %s: %s\n", dir, amber_strerror(rc),
            w ? amber_last_error(w) : amber_last_error(NULL));
  amber_writer_close(w);
  amber_store_close(st);
  for (int t = 0; t < NT; t++) free(data[t]);
  char p[4200];
  snprintf(p, sizeof p, "%s/.lock", dir);
  unlink(p);
  if (!rc) printf("wrote %s: steps %d..%d\n", dir, FIRST, LAST);
  return rc ? 1 : 0;
}

/* ---- checks of the committed store ---- */

static void test_golden_delta_store_lists_one_full_and_five_deltas(void) {
  amber_store *st = tu_open_ro(GOLDEN);
  if (!st) return;
  uint64_t latest = 0;
  CHECK_OK(amber_store_latest(st, &latest));
  CHECK(latest == LAST);
  amber_ckpt_info *info = NULL;
  size_t n = 0;
  CHECK_OK(amber_store_list(st, &info, &n));
  CHECK(n == LAST - FIRST + 1);
  for (size_t i = 0; info && i < n; i++) {
    CHECK(info[i].step == FIRST + i);
    CHECK(info[i].kind == (i ? AMBER_KIND_DELTA : AMBER_KIND_FULL));
    CHECK(info[i].parent == (i ? FIRST + i - 1 : AMBER_NO_STEP));
    if (i) CHECK(info[i].bytes < info[0].bytes / 2);
  }
  amber_free(info);
  amber_store_close(st);
}

/* Whether restored element r is acceptable for the generator's x under spec t. */
static int elem_ok(int t, const uint8_t *x, const uint8_t *r) {
  const spec *sp = &specs[t];
  size_t w = amber_dtype_size(sp->dtype);
  if (!memcmp(x, r, w)) return 1;
  if (!strcmp(sp->policy, "exact")) return 0;
  double xv = amber__to_f64(sp->dtype, x), rv = amber__to_f64(sp->dtype, r);
  if (!isfinite(xv) || !isfinite(rv)) return 0;
  if (!strncmp(sp->policy, "budget", 6)) return fabs(xv - rv) <= sp->abs;
  return fabs(xv - rv) <= sp->abs + sp->rel * fabs(rv);
}

static void test_golden_delta_every_step_restores_expected_values(void) {
  amber_store *st = tu_open_ro(GOLDEN);
  size_t lagging[NT] = {0};
  for (uint64_t s = FIRST; st && s <= LAST; s++) {
    amber_reader *r = NULL;
    CHECK_OK(amber_reader_open(&r, st, s, NULL));
    if (!r) continue;
    CHECK(amber_reader_step(r) == s);
    CHECK(amber_reader_count(r) == NT);
    const char *json = NULL;
    size_t len = 0;
    char meta[128];
    int mlen = meta_of(s, meta, sizeof meta);
    CHECK_OK(amber_reader_meta(r, &json, &len));
    CHECK(json && len == (size_t)mlen && !memcmp(json, meta, len));
    for (int t = 0; t < NT && (size_t)t < amber_reader_count(r); t++) {
      const spec *sp = &specs[t];
      amber_tensor_info ti;
      CHECK_OK(amber_reader_info(r, (size_t)t, &ti));
      CHECK(!strcmp(ti.name, sp->name) && ti.dtype == sp->dtype && ti.ndim == sp->ndim);
      CHECK(ti.nelems == (uint64_t)sp->n && ti.chunk_elems == CHUNK);
      CHECK(ti.policy && !strcmp(ti.policy, sp->policy));
      uint8_t *want = malloc(nbytes(t) + 1), *got = malloc(nbytes(t) + 1);
      fill(t, s, want);
      CHECK_OK(amber_reader_read(r, (size_t)t, got, nbytes(t)));
      size_t w = amber_dtype_size(sp->dtype), bad = 0;
      for (int64_t k = 0; k < sp->n; k++) {
        bad += !elem_ok(t, want + k * w, got + k * w);
        lagging[t] += memcmp(want + k * w, got + k * w, w) != 0;
      }
      CHECK(bad == 0);
      if (bad)
        fprintf(stderr, "    step %" PRIu64 " '%s' (%s): %zu elements wrong\n", s, sp->name,
                sp->policy, bad);
      free(want);
      free(got);
    }
    CHECK_OK(amber_reader_verify(r));
    amber_reader_close(r);
  }
  /* the lossy tensors really are lossy in these files: some change was deferred */
  CHECK(lagging[T_MTHR] > 0 && lagging[T_VTHR] > 0 && lagging[T_BUD] > 0);
  amber_store_close(st);
}

/* The committed deltas hold every delta encoding of format 1.0, where the
 * generator meant them to be. */
static void test_golden_delta_files_hold_every_encoding(void) {
  amber_store *st = tu_open_ro(GOLDEN);
  if (!st) return;
  enum { UNCH, VARINT, BITMAP, XOR, RAW, NKIND };
  const char *kind_name[NKIND] = {"UNCHANGED", "SPARSE/varint", "SPARSE/bitmap", "XOR_ZSTD",
                                  "RAW"};
  int seen[NKIND] = {0}, where[NKIND] = {0};
  amber__stage stage = {0};
  void *dctx = ZSTD_createDCtx();
  for (uint64_t s = FIRST; s <= LAST; s++) {
    amber__err e;
    amber__ckpt c;
    int rc = amber__ckpt_open(&e, st, s, &c);
    CHECK_OK(rc);
    if (rc) continue;
    CHECK(c.hdr.format_major == 1 && c.hdr.format_minor == 0);
    CHECK(c.hdr.kind == (s == FIRST ? AMBER_KIND_FULL : AMBER_KIND_DELTA));
    CHECK(c.ix.n_tensors == NT);
    for (uint64_t t = 0; s > FIRST && t < c.ix.n_tensors && t < NT; t++) {
      const amber__tensor *xt = &c.ix.tensors[t];
      for (uint64_t j = 0; j < xt->n_chunks; j++) {
        const amber__chunk *ch = &c.ix.chunks[xt->first_chunk + j];
        int kind = -1;
        switch (ch->encoding) {
        case AMBER__ENC_UNCHANGED: kind = UNCH; break;
        case AMBER__ENC_XOR_ZSTD: kind = XOR; break;
        case AMBER__ENC_RAW: kind = RAW; break;
        case AMBER__ENC_SPARSE: {
          const uint8_t *p = NULL;
          uint8_t body[1];
          ZSTD_inBuffer in;
          ZSTD_outBuffer out = {body, 1, 0};
          CHECK_OK(amber__chunk_load(&e, &c, ch, &stage, &p));
          if (!p) break;
          in.src = p;
          in.size = (size_t)ch->size;
          in.pos = 0;
          ZSTD_DCtx_reset(dctx, ZSTD_reset_session_only);
          ZSTD_decompressStream(dctx, &out, &in); /* the first byte: index_mode */
          CHECK(out.pos == 1 && body[0] <= 1);
          if (out.pos == 1) kind = body[0] ? VARINT : BITMAP;
          break;
        }
        default: CHECK(0 && "unexpected encoding in a delta");
        }
        if (kind < 0) continue;
        seen[kind]++;
        /* where the generator aims each encoding */
        if (t == T_SPARSE && j == 0 && kind == VARINT) where[VARINT]++;
        if (t == T_SPARSE && j == 1 && kind == BITMAP) where[BITMAP]++;
        if (t == T_SPARSE && j == 2 && kind == UNCH) where[UNCH]++;
        if (t == T_SPARSE && j == 3 && kind == RAW) where[RAW]++;
        if (t == T_XOR && kind == XOR) where[XOR]++;
        if (t == T_FROZEN) CHECK(kind == UNCH && ch->size == 0 && ch->stored == 0);
      }
    }
    amber__ckpt_close(&c);
  }
  for (int k = 0; k < NKIND; k++) {
    CHECK(seen[k] > 0 && where[k] > 0);
    if (!seen[k] || !where[k])
      fprintf(stderr, "    %s: %d chunks in the deltas, %d where intended\n", kind_name[k],
              seen[k], where[k]);
  }
  ZSTD_freeDCtx(dctx);
  amber__stage_free(&stage);
  amber_store_close(st);
}

/* The generator still writes what the committed files hold: a fresh store from
 * this library restores the same values (guards the test's own expectations). */
static void test_regenerated_store_restores_like_the_golden_one(void) {
  char dir[4200];
  snprintf(dir, sizeof dir, "%s/store", tu_tmpdir());
  CHECK(regenerate(dir) == 0);
  amber_store *a = tu_open_ro(GOLDEN), *b = NULL;
  CHECK_OK(amber_store_open(&b, dir, NULL));
  for (uint64_t s = FIRST; a && b && s <= LAST; s++) {
    amber_reader *ra = NULL, *rb = NULL;
    CHECK_OK(amber_reader_open(&ra, a, s, NULL));
    CHECK_OK(amber_reader_open(&rb, b, s, NULL));
    for (int t = 0; ra && rb && t < NT; t++) {
      uint8_t *x = malloc(nbytes(t) + 1), *y = malloc(nbytes(t) + 1);
      CHECK_OK(amber_reader_read(ra, (size_t)t, x, nbytes(t)));
      CHECK_OK(amber_reader_read(rb, (size_t)t, y, nbytes(t)));
      if (!strcmp(specs[t].policy, "exact")) CHECK(memcmp(x, y, nbytes(t)) == 0);
      free(x);
      free(y);
    }
    amber_reader_close(ra);
    amber_reader_close(rb);
  }
  amber_store_close(a);
  amber_store_close(b);
}

int main(int argc, char **argv) {
  if (argc == 3 && !strcmp(argv[1], "--regenerate")) return regenerate(argv[2]);
  if (argc != 1) {
    fprintf(stderr, "usage: %s [--regenerate DIR]\n", argv[0]);
    return 2;
  }
  TEST_RUN(test_golden_delta_store_lists_one_full_and_five_deltas);
  TEST_RUN(test_golden_delta_every_step_restores_expected_values);
  TEST_RUN(test_golden_delta_files_hold_every_encoding);
  TEST_RUN(test_regenerated_store_restores_like_the_golden_one);
  return tu_finish();
}

/*
 * bench.c - `amber bench`: the benchmark of the CLI.
 *
 * Machines here are shared and noisy, so every figure is printed next to a
 * baseline measured in the same run on the same bytes: memcpy of the state (the
 * memory floor), a plain buffered write+fsync of the same bytes (what a naive
 * checkpointer costs), and a plain buffered read of it back. The state is a
 * synthetic GPT-2-small-like training state: weights, Adam's exp_avg and
 * exp_avg_sq, split into tensors the way a transformer's are.
 *
 *   amber bench [--size-mb N] [--deltas D] [--policy SPEC] [--dir D] [--json FILE]
 *   amber bench --full [--size-mb N] [--dir D] [--json FILE] [--repeat R]
 *   mpirun -np N amber bench --ranks [--size-mb N] [--deltas D] [--policy SPEC] [--dir D]
 *
 * The delta mode lives in bench_delta.c, the many-rank mode (built when MPI is
 * found) in bench_ranks.c.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "amber.h"
#include "bench.h"

double amber__bench_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void rm_rf(const char *dir) {
  char cmd[4400];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0) fprintf(stderr, "amber bench: could not remove %s\n", dir);
}

/* Splits `total` floats into GPT-2-like tensors: per layer a 4:1:4:4 mix of
 * attention and MLP matrices plus small vectors; three roles (param, exp_avg,
 * exp_avg_sq) of equal size. */
int amber__bench_state(bench_state *s, uint64_t total_bytes) {
  uint64_t per_role = total_bytes / 3 / 4; /* floats per role */
  static const char *roles[3] = {"param", "exp_avg", "exp_avg_sq"};
  uint64_t per_layer = per_role / 12;
  if (per_layer < 16) per_layer = 16;
  static const struct {
    const char *name;
    double share;
  } parts[] = {{"attn.c_attn.weight", 3.0 / 12}, {"attn.c_proj.weight", 1.0 / 12},
               {"mlp.c_fc.weight", 4.0 / 12},    {"mlp.c_proj.weight", 3.99 / 12},
               {"ln_1.weight", 0.005 / 12},      {"ln_2.bias", 0.005 / 12}};
  size_t nparts = sizeof parts / sizeof parts[0];
  s->n = 3 * 12 * nparts;
  s->t = calloc(s->n, sizeof *s->t);
  if (!s->t) return -1;
  size_t k = 0;
  for (int r = 0; r < 3; r++)
    for (int l = 0; l < 12; l++)
      for (size_t p = 0; p < nparts; p++, k++) {
        bench_tensor *t = &s->t[k];
        snprintf(t->name, sizeof t->name, "h.%d.%s.%s", l, parts[p].name, roles[r]);
        t->n = (int64_t)((double)per_layer * parts[p].share);
        if (t->n < 1) t->n = 1;
        t->role = r;
        t->x = malloc((size_t)t->n * sizeof(float));
        if (!t->x) return -1;
        s->bytes += (uint64_t)t->n * 4;
      }
  amber__bench_fill(s, 1);
  return 0;
}

/* Values with the magnitudes of a trained state: weights ~N(0, 0.02), exp_avg
 * ~1e-4, exp_avg_sq ~1e-10 (positive). */
void amber__bench_fill(bench_state *s, uint64_t seed) {
  for (size_t i = 0; i < s->n; i++) {
    bench_tensor *t = &s->t[i];
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + i;
    double scale = t->role == 0 ? 0.02 : t->role == 1 ? 1e-4 : 1e-10;
    for (int64_t j = 0; j < t->n; j++) {
      x ^= x >> 12;
      x ^= x << 25;
      x ^= x >> 27;
      uint64_t r = x * 0x2545F4914F6CDD1Dull;
      /* sum of two uniforms: cheap, bell-shaped enough for byte statistics */
      double u = ((double)(r >> 40) + (double)(r & 0xFFFFFF)) / 16777216.0 - 1.0;
      t->x[j] = (float)(t->role == 2 ? scale * (1.5 + u) : scale * 1.7 * u);
    }
  }
}

void amber__bench_free(bench_state *s) {
  for (size_t i = 0; i < s->n; i++) free(s->t[i].x);
  free(s->t);
  memset(s, 0, sizeof *s);
}

/* Plain buffered write+fsync of the state, as a naive checkpointer does it. */
double amber__bench_plain_write(const bench_state *s, const char *path) {
  double t0 = amber__bench_now();
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return -1;
  for (size_t i = 0; i < s->n; i++) {
    const char *p = (const char *)s->t[i].x;
    size_t left = (size_t)s->t[i].n * 4;
    while (left) {
      ssize_t w = write(fd, p, left);
      if (w < 0) {
        close(fd);
        return -1;
      }
      p += w;
      left -= (size_t)w;
    }
  }
  if (fsync(fd) != 0) return -1;
  close(fd);
  return amber__bench_now() - t0;
}

/* Drops a file's pages from the page cache so that reads come from the disk. */
static void drop_cache(const char *path) {
  int fd = open(path, O_RDONLY);
  if (fd < 0) return;
  fdatasync(fd);
  posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  close(fd);
}

void amber__bench_drop_store(const char *dir) {
  DIR *d = opendir(dir);
  struct dirent *e;
  while (d && (e = readdir(d))) {
    if (strncmp(e->d_name, "ckpt-", 5) != 0) continue;
    char p[4400];
    snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
    drop_cache(p);
  }
  if (d) closedir(d);
}

static double plain_read(bench_state *dst, const char *path) {
  double t0 = amber__bench_now();
  int fd = open(path, O_RDONLY);
  if (fd < 0) return -1;
  for (size_t i = 0; i < dst->n; i++) {
    char *p = (char *)dst->t[i].x;
    size_t left = (size_t)dst->t[i].n * 4;
    while (left) {
      ssize_t r = read(fd, p, left);
      if (r <= 0) {
        close(fd);
        return -1;
      }
      p += r;
      left -= (size_t)r;
    }
  }
  close(fd);
  return amber__bench_now() - t0;
}

int amber__bench_save(amber_store *st, amber_writer **w, const bench_state *s,
                      const amber_writer_opts *wo, uint64_t step, uint32_t flags, double *secs) {
  if (!*w) {
    if (amber_writer_open(w, st, wo)) return -1;
    for (size_t i = 0; i < s->n; i++)
      if (amber_writer_add(*w, s->t[i].name, AMBER_F32, 1, &s->t[i].n, s->t[i].x, NULL))
        return -1;
  }
  double t0 = amber__bench_now();
  int rc = amber_writer_save(*w, step, flags);
  *secs = amber__bench_now() - t0;
  return rc;
}

int amber__bench_restore(amber_store *st, uint64_t step, bench_state *dst, double *secs) {
  double t0 = amber__bench_now();
  amber_reader *r = NULL;
  int rc = amber_reader_open(&r, st, step, NULL);
  for (size_t i = 0; !rc && i < dst->n; i++)
    rc = amber_reader_read(r, i, dst->t[i].x, (uint64_t)dst->t[i].n * 4);
  amber_reader_close(r);
  *secs = amber__bench_now() - t0;
  return rc;
}

static int same_state(const bench_state *a, const bench_state *b) {
  for (size_t i = 0; i < a->n; i++)
    if (memcmp(a->t[i].x, b->t[i].x, (size_t)a->t[i].n * 4)) return 0;
  return 1;
}

static double gbps(uint64_t bytes, double s) {
  return s > 0 ? (double)bytes / s / 1e9 : 0;
}

double amber__bench_median(double *v, int n) {
  for (int i = 1; i < n; i++)
    for (int j = i; j > 0 && v[j] < v[j - 1]; j--) {
      double t = v[j];
      v[j] = v[j - 1];
      v[j - 1] = t;
    }
  return n ? (n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2])) : 0;
}

static int bench_full(const bench_opts *o) {
  bench_state s = {0}, d = {0};
  printf("amber bench --full: %.2f GB synthetic state, %d repeats, in %s\n",
         (double)o->size_bytes / 1e9, o->repeat, o->dir);
  if (amber__bench_state(&s, o->size_bytes) || amber__bench_state(&d, o->size_bytes)) {
    fprintf(stderr, "amber bench: out of memory\n");
    return 1;
  }
  amber__bench_fill(&d, 2); /* touch every page of the restore buffers */
  char plain[4200], store[4200];
  snprintf(plain, sizeof plain, "%s/plain.bin", o->dir);
  snprintf(store, sizeof store, "%s/store", o->dir);
  enum { R = 16 };
  double t_memcpy[R], t_pw[R], t_pr[R], t_save[R], t_restore[R], t_csave[R], t_first[R],
      t_warm[R];
  int reps = o->repeat > R ? R : o->repeat, rc = 0;
  uint64_t file_bytes = 0, cfile_bytes = 0;
  for (int k = 0; k < reps && !rc; k++) {
    /* Each file is deleted only at the end of a repeat, then the disk is let
     * settle: deleting gigabytes (discard on this file system) slows whatever
     * writes next. Odd repeats run amber first, even ones the plain baseline. */
    double t0 = amber__bench_now();
    for (size_t i = 0; i < s.n; i++) memcpy(d.t[i].x, s.t[i].x, (size_t)s.t[i].n * 4);
    t_memcpy[k] = amber__bench_now() - t0;
    amber_store *st = NULL;
    amber_writer *w = NULL;
    amber_writer_opts wo;
    amber_writer_opts_init(&wo);
    rc = amber_store_open(&st, store, NULL);
    for (int half = 0; half < 2 && !rc; half++) {
      if ((half == 0) == (k % 2 == 0)) {
        t_pw[k] = amber__bench_plain_write(&s, plain);
        drop_cache(plain);
        t_pr[k] = plain_read(&d, plain);
        if (t_pw[k] < 0 || t_pr[k] < 0) {
          fprintf(stderr, "amber bench: plain I/O in %s failed: %s\n", o->dir, strerror(errno));
          rc = 1;
        }
        continue;
      }
      /* a one-off save (as `amber import`): no reference state is kept */
      rc = amber__bench_save(st, &w, &s, &wo, 1, AMBER_SAVE_FULL | AMBER_SAVE_NO_REFERENCE,
                             &t_save[k]);
      /* a training writer's first full save allocates its reference state; later
       * ones reuse it */
      if (!rc) rc = amber__bench_save(st, &w, &s, &wo, 3, AMBER_SAVE_FULL, &t_first[k]);
      if (!rc) rc = amber__bench_save(st, &w, &s, &wo, 4, AMBER_SAVE_FULL, &t_warm[k]);
      amber_writer_close(w);
      w = NULL;
      if (rc) break;
      amber_ckpt_info *li = NULL;
      size_t n = 0;
      amber_store_list(st, &li, &n);
      file_bytes = n ? li[0].bytes : 0;
      amber_free(li);
      amber__bench_drop_store(store);
      amber__bench_fill(&d, 3);
      rc = amber__bench_restore(st, 1, &d, &t_restore[k]);
      if (!rc && !same_state(&s, &d)) {
        fprintf(stderr, "amber bench: restored state differs from the saved one\n");
        rc = 1;
      }
    }
    /* the same with compression, to show what it costs and saves */
    wo.flags = AMBER_WRITER_COMPRESS_FULL;
    if (!rc) rc = amber__bench_save(st, &w, &s, &wo, 5, AMBER_SAVE_FULL, &t_csave[k]);
    amber_writer_close(w);
    if (!rc) {
      amber_ckpt_info *li = NULL;
      size_t n = 0;
      amber_store_list(st, &li, &n);
      cfile_bytes = n ? li[n - 1].bytes : 0;
      amber_free(li);
    }
    if (rc && rc != 1) fprintf(stderr, "amber bench: %s\n", amber_last_error(NULL));
    amber_store_close(st);
    unlink(plain);
    rm_rf(store);
    sync();
    sleep(1);
  }
  if (rc) {
    amber__bench_free(&s);
    amber__bench_free(&d);
    return 1;
  }
  double m = amber__bench_median(t_memcpy, reps), pw = amber__bench_median(t_pw, reps);
  double pr = amber__bench_median(t_pr, reps);
  double sv = amber__bench_median(t_save, reps), rs = amber__bench_median(t_restore, reps);
  double cs = amber__bench_median(t_csave, reps), sf = amber__bench_median(t_first, reps);
  double sw = amber__bench_median(t_warm, reps);
  uint64_t B = s.bytes;
  printf("\n%-34s %10s %10s %10s\n", "phase (median)", "seconds", "GB/s", "vs plain");
  printf("%-34s %10.3f %10.2f %10s\n", "memcpy of the state", m, gbps(B, m), "-");
  printf("%-34s %10.3f %10.2f %10s\n", "plain write+fsync (buffered)", pw, gbps(B, pw), "1.00x");
  printf("%-34s %10.3f %10.2f %9.2fx\n", "amber full save, one-off", sv, gbps(B, sv), pw / sv);
  printf("%-34s %10.3f %10.2f %9.2fx\n", "amber full save, training writer", sw, gbps(B, sw),
         pw / sw);
  printf("%-34s %10.3f %10.2f %9.2fx\n", "  its first (allocates reference)", sf, gbps(B, sf),
         pw / sf);
  printf("%-34s %10.3f %10.2f %9.2fx\n", "amber full save, zstd", cs, gbps(B, cs), pw / cs);
  printf("%-34s %10.3f %10.2f %10s\n", "plain read (buffered, cold)", pr, gbps(B, pr), "1.00x");
  printf("%-34s %10.3f %10.2f %9.2fx\n", "amber full restore (cold)", rs, gbps(B, rs), pr / rs);
  printf("\nfile bytes: raw %" PRIu64 " (%.4f of state), zstd %" PRIu64 " (%.4f of state)\n",
         file_bytes, (double)file_bytes / (double)B, cfile_bytes,
         (double)cfile_bytes / (double)B);
  printf("targets: save >= 3x plain write: %s (one-off), %s (training writer); restore faster "
         "than plain read: %s\n",
         pw / sv >= 3 ? "met" : "NOT met", pw / sw >= 3 ? "met" : "NOT met",
         pr / rs > 1 ? "met" : "NOT met");
  if (o->json_path) {
    FILE *f = fopen(o->json_path, "w");
    if (f) {
      fprintf(f,
              "{\"mode\": \"full\", \"state_bytes\": %" PRIu64 ", \"repeats\": %d,\n"
              " \"memcpy_s\": %.6f, \"plain_write_fsync_s\": %.6f, \"plain_read_s\": %.6f,\n"
              " \"amber_save_s\": %.6f, \"amber_save_warm_s\": %.6f, \"amber_save_first_s\": %.6f,\n"
              " \"amber_save_zstd_s\": %.6f, \"amber_restore_s\": %.6f,\n"
              " \"file_bytes\": %" PRIu64 ", \"file_bytes_zstd\": %" PRIu64 ",\n"
              " \"save_speedup\": %.4f, \"restore_speedup\": %.4f}\n",
              B, reps, m, pw, pr, sv, sw, sf, cs, rs, file_bytes, cfile_bytes, pw / sv, pr / rs);
      fclose(f);
      printf("figures written to %s\n", o->json_path);
    }
  }
  amber__bench_free(&s);
  amber__bench_free(&d);
  return 0;
}

static void usage(FILE *f) {
  fprintf(f, "usage: amber bench [--full|--async|--ranks] [--size-mb N] [--dir DIR] [--json FILE]\n"
             "                   [--deltas D] [--policy SPEC] [--repeat R]\n"
             "  (default)   delta saves of a synthetic AdamW trajectory: phases, sizes,\n"
             "              restore of full + deltas, against same-run baselines\n"
             "  --full      full save and restore against plain buffered write/read\n"
             "  --async     a training loop with begin/fence/wait: stall per checkpoint,\n"
             "              save-to-durable, a synchronous save of the same state, peak RSS\n"
             "  --ranks     under mpirun: each rank saves 1/N of the state as one global\n"
             "              step; each rank's save, the global commit's own cost, and a\n"
             "              single-rank save of the same total bytes (no --json)\n"
             "  --funneled  ranks mode: MPI_THREAD_FUNNELED, so the global commit runs\n"
             "              inside wait() (default MPI_THREAD_MULTIPLE: in the background)\n"
             "  --compute-ms  async mode: compute between optimizer steps (default 1500)\n"
             "  --deltas    delta mode: number of deltas after the full (default 20)\n"
             "  --policy    delta mode: policy rule (default budget:0.02)\n"
             "  --size-mb   state size in MB (default 1490, GPT-2 small with AdamW)\n"
             "  --dir       where to write (default: a new directory under /var/tmp)\n"
             "  --repeat    repetitions; medians are printed (default 3)\n"
             "  --json      also write the figures as JSON to FILE\n");
}

static int parse_u64(const char *s, uint64_t *v) {
  char *e;
  errno = 0;
  if (!s || !*s || *s == '-') return -1;
  unsigned long long x = strtoull(s, &e, 10);
  if (*e || errno) return -1;
  *v = x;
  return 0;
}

int amber__bench_main(int argc, char **argv) {
  bench_opts o = {.size_bytes = 1490ull * 1000 * 1000, .repeat = 3, .deltas = 20,
                  .compute_ms = 1500};
  int mode = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    uint64_t v;
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      usage(stdout);
      return 0;
    } else if (!strcmp(a, "--full")) {
      mode = 1;
    } else if (!strcmp(a, "--async")) {
      mode = 2;
    } else if (!strcmp(a, "--ranks")) {
      mode = 3;
    } else if (!strcmp(a, "--funneled")) {
      o.funneled = 1;
    } else if (!strcmp(a, "--compute-ms") && i + 1 < argc && !parse_u64(argv[i + 1], &v)) {
      o.compute_ms = (int)(v > 600000 ? 600000 : v);
      i++;
    } else if (!strcmp(a, "--size-mb") && i + 1 < argc && !parse_u64(argv[i + 1], &v) && v) {
      o.size_bytes = v * 1000 * 1000;
      i++;
    } else if (!strcmp(a, "--repeat") && i + 1 < argc && !parse_u64(argv[i + 1], &v) && v) {
      o.repeat = (int)(v > 16 ? 16 : v);
      i++;
    } else if (!strcmp(a, "--deltas") && i + 1 < argc && !parse_u64(argv[i + 1], &v) && v) {
      o.deltas = (int)(v > 200 ? 200 : v);
      i++;
    } else if (!strcmp(a, "--policy") && i + 1 < argc) {
      o.policy = argv[++i];
    } else if (!strcmp(a, "--dir") && i + 1 < argc) {
      o.dir = argv[++i];
    } else if (!strcmp(a, "--json") && i + 1 < argc) {
      o.json_path = argv[++i];
    } else {
      fprintf(stderr, "amber bench: bad argument '%s'\n", a);
      usage(stderr);
      return 2;
    }
  }
  if (mode == 3) {
#ifdef AMBER_WITH_MPI
    if (o.json_path) {
      fprintf(stderr, "amber bench: --json is not supported with --ranks\n");
      return 2;
    }
    return amber__bench_ranks(&o) ? 1 : 0;
#else
    fprintf(stderr, "amber bench: --ranks needs MPI, and this amber was built without it "
                    "(install libopenmpi-dev and rebuild)\n");
    return 1;
#endif
  }
  char tmpl[] = "/var/tmp/amber-bench-XXXXXX";
  int own_dir = 0;
  if (!o.dir) {
    if (!mkdtemp(tmpl)) {
      fprintf(stderr, "amber bench: cannot create a directory: %s\n", strerror(errno));
      return 1;
    }
    o.dir = tmpl;
    own_dir = 1;
  }
  int rc = mode == 1 ? bench_full(&o) : mode == 2 ? amber__bench_async(&o) : amber__bench_delta(&o);
  if (own_dir) rm_rf(tmpl);
  return rc;
}

/*
 * cli.c - the `amber` command-line tool.
 *
 * A thin layer over the public API (include/amber.h) plus the CLI's own
 * safetensors header code (tools/safetensors.h): `import` turns a safetensors file
 * into a step of a store, `export` writes a step back as a standard safetensors
 * file, `ls`, `info` and `verify` inspect a store, `drain` finishes the drain of a
 * memory tier to its durable tier, and `bench` forwards to
 * tools/bench.c. The command line is a contract (docs/DESIGN.md, "Interfaces other
 * programs depend on"): exit 0 on success, 1 on failure, 2 on a usage error;
 * `--json` prints machine output, built with jansson, on stdout. Errors go to
 * stderr as "amber: <what failed>: <why>", naming the file and the step. Nothing
 * here knows the store's file format.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "amber.h"
#include "safetensors.h"

/* Defined in tools/bench.c; receives argv starting at "bench". */
int amber__bench_main(int argc, char **argv);

/* ---- command-line parsing ---------------------------------------------------- */

enum {
  OPT_STEP = 1u << 0,
  OPT_JSON = 1u << 1,
  OPT_OUT = 1u << 2,
  OPT_POLICY = 1u << 3,
  OPT_FULL = 1u << 4,
  OPT_CHUNK = 1u << 5,
  OPT_KEEP = 1u << 6,
  OPT_GRACE = 1u << 7,
};

typedef struct args {
  const char *pos[2];
  int npos;
  int json, full, have_step;
  uint64_t step, chunk_elems, keep_last, grace;
  int have_keep, have_grace;
  const char *out;
  const char **policies; /* point into argv */
  size_t npolicies;
} args;

typedef struct command {
  const char *name;
  int (*run)(const args *a);
  unsigned opts;
  int npos;      /* positional arguments, all required */
  int nopt;      /* optional positional arguments after them */
  unsigned need; /* options that are required */
  const char *synopsis;
  const char *help; /* description and options, for --help */
} command;

/* A decimal integer with nothing else around it: no sign, no spaces, no overflow. */
static int parse_u64(const char *s, uint64_t *v) {
  if (!s || *s < '0' || *s > '9') return -1;
  char *end;
  errno = 0;
  unsigned long long x = strtoull(s, &end, 10);
  if (*end || errno) return -1;
  *v = x;
  return 0;
}

static void usage_line(FILE *f, const command *c) {
  fprintf(f, "usage: amber %s %s\n", c->name, c->synopsis);
}

__attribute__((format(printf, 2, 3))) static int usage_error(const command *c,
                                                             const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "amber %s: ", c->name);
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  usage_line(stderr, c);
  fprintf(stderr, "Try 'amber %s --help'.\n", c->name);
  return 2;
}

/* Takes the value of option argv[*i], given as "--opt=value" or "--opt value". */
static const char *opt_value(int argc, char **argv, int *i, const char *eq) {
  if (eq) return eq + 1;
  if (*i + 1 >= argc) return NULL;
  return argv[++*i];
}

/* Fills `a` from argv[1..]; returns -1 to go on, or the exit status (0 after
 * --help, 2 after a usage error). */
static int parse_args(const command *c, int argc, char **argv, args *a) {
  int only_pos = 0;
  for (int i = 1; i < argc; i++) {
    const char *s = argv[i];
    if (only_pos || s[0] != '-' || !s[1]) {
      if (a->npos == c->npos + c->nopt) return usage_error(c, "unexpected argument '%s'", s);
      a->pos[a->npos++] = s;
      continue;
    }
    if (!strcmp(s, "--")) {
      only_pos = 1;
      continue;
    }
    if (!strcmp(s, "--help") || !strcmp(s, "-h")) {
      usage_line(stdout, c);
      fputs(c->help, stdout);
      return 0;
    }
    const char *eq = strncmp(s, "--", 2) ? NULL : strchr(s, '=');
    size_t len = eq ? (size_t)(eq - s) : strlen(s);
#define IS(name) (strlen(name) == len && !strncmp(s, name, len))
    unsigned opt = IS("--step")                 ? OPT_STEP
                   : IS("--json")               ? OPT_JSON
                   : IS("-o") || IS("--output") ? OPT_OUT
                   : IS("--policy")             ? OPT_POLICY
                   : IS("--full")               ? OPT_FULL
                   : IS("--chunk-elems")        ? OPT_CHUNK
                   : IS("--keep-last")          ? OPT_KEEP
                   : IS("--grace")              ? OPT_GRACE
                                                : 0;
#undef IS
    if (!(opt & c->opts)) return usage_error(c, "unknown option '%s'", s);
    if ((opt == OPT_JSON || opt == OPT_FULL) && eq)
      return usage_error(c, "option '%.*s' takes no value", (int)len, s);
    const char *v = NULL;
    if (opt != OPT_JSON && opt != OPT_FULL && !(v = opt_value(argc, argv, &i, eq)))
      return usage_error(c, "option '%s' needs a value", s);
    if (opt == OPT_JSON) {
      a->json = 1;
    } else if (opt == OPT_FULL) {
      a->full = 1;
    } else if (opt == OPT_OUT) {
      if (!*v) return usage_error(c, "empty output path");
      a->out = v;
    } else if (opt == OPT_POLICY) {
      a->policies[a->npolicies++] = v;
    } else if (opt == OPT_STEP) {
      if (parse_u64(v, &a->step) || a->step == AMBER_NO_STEP)
        return usage_error(c, "bad step '%s' (a decimal number below 2^64-1)", v);
      a->have_step = 1;
    } else if (opt == OPT_KEEP) {
      if (parse_u64(v, &a->keep_last) || !a->keep_last)
        return usage_error(c, "bad --keep-last '%s' (a positive decimal number)", v);
      a->have_keep = 1;
    } else if (opt == OPT_GRACE) {
      if (parse_u64(v, &a->grace))
        return usage_error(c, "bad --grace '%s' (seconds, a decimal number)", v);
      a->have_grace = 1;
    } else if (parse_u64(v, &a->chunk_elems) || !a->chunk_elems) {
      return usage_error(c, "bad --chunk-elems '%s' (a positive decimal number)", v);
    }
  }
  if (a->npos < c->npos) return usage_error(c, "missing arguments");
  if ((c->need & OPT_STEP) && !a->have_step) return usage_error(c, "--step is required");
  if ((c->need & OPT_OUT) && !a->out) return usage_error(c, "-o OUT is required");
  if ((c->need & OPT_KEEP) && !a->have_keep) return usage_error(c, "--keep-last is required");
  return -1;
}

/* ---- small helpers ----------------------------------------------------------- */

/* Prints "amber: <what>: <the library's message>" and returns 1. */
__attribute__((format(printf, 3, 4))) static int fail(int rc, const void *handle,
                                                      const char *fmt, ...) {
  const char *why = amber_last_error(handle);
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "amber: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, ": %s\n", *why ? why : amber_strerror(rc));
  va_end(ap);
  return 1;
}

/* Prints "amber: <what>: <strerror(errno)>" and returns 1. */
__attribute__((format(printf, 1, 2))) static int sys_fail(const char *fmt, ...) {
  int err = errno;
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "amber: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, ": %s\n", strerror(err));
  va_end(ap);
  return 1;
}

/* An object store's URL ("s3://bucket/prefix"), which the library reads as a store. */
static int is_url(const char *path) {
  return strncmp(path, "s3://", 5) == 0;
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static const char *human_bytes(uint64_t b, char buf[32]) {
  static const char *const unit[] = {"B", "kB", "MB", "GB", "TB", "PB", "EB"};
  double v = (double)b;
  int u = 0;
  while (v >= 1000 && u < 6)
    v /= 1000, u++;
  snprintf(buf, 32, u ? "%.1f %s" : "%.0f %s", v, unit[u]);
  return buf;
}

/* ---- progress on stderr ---------------------------------------------------------
 * Long work (export, verify, compact, import of GB-sized states) draws one progress
 * line on stderr when stderr is a terminal, after the first half second, from the
 * library's progress hook (amber_set_progress). AMBER_PROGRESS=1 forces it on
 * (from the start, one line per report: for logs and tests), AMBER_PROGRESS=0 off. */
static struct {
  pthread_mutex_t mu;
  int on, forced, drawn;
  char label[128];
  double start, last;
} prog = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void progress_init(void) {
  const char *e = getenv("AMBER_PROGRESS");
  prog.forced = e && !strcmp(e, "1");
  prog.on = prog.forced || (isatty(STDERR_FILENO) && !(e && !strcmp(e, "0")));
}

/* Draws "LABEL: 45% of 1.5 GB" at most 4 times a second, and at the end. */
static void progress_draw(const char *label, uint64_t done, uint64_t total) {
  pthread_mutex_lock(&prog.mu);
  double t = now();
  if ((prog.forced || t - prog.start >= 0.5) && (t - prog.last >= 0.25 || done == total)) {
    char b[32];
    fprintf(stderr, prog.forced ? "%s: %3.0f%% of %s\n" : "\r%s: %3.0f%% of %s  ", label,
            total ? 100.0 * (double)done / (double)total : 100.0, human_bytes(total, b));
    prog.drawn = 1, prog.last = t;
  }
  pthread_mutex_unlock(&prog.mu);
}

/* The library's report: under the command's label, naming the library's part of
 * the work when it is another (compact verifies first). */
static void on_progress(void *ctx, const char *what, uint64_t done, uint64_t total) {
  (void)ctx;
  char label[160];
  size_t n = strlen(what);
  if (!strncmp(prog.label, what, n) && prog.label[n] == ' ')
    snprintf(label, sizeof label, "%s", prog.label);
  else
    snprintf(label, sizeof label, "%s (%s)", prog.label, what);
  progress_draw(label, done, total);
}

/* Starts reporting the library's progress under `label` (printf format). */
__attribute__((format(printf, 1, 2))) static void progress_begin(const char *fmt, ...) {
  if (!prog.on) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(prog.label, sizeof prog.label, fmt, ap);
  va_end(ap);
  prog.start = now(), prog.last = 0, prog.drawn = 0;
  amber_set_progress(on_progress, NULL);
}

/* Stops it, and clears the line on a terminal, before the command prints. */
static void progress_end(void) {
  if (!prog.on) return;
  amber_set_progress(NULL, NULL);
  if (prog.drawn && !prog.forced) fputs("\r\033[K", stderr);
  prog.drawn = 0;
}

static const char *kind_name(uint32_t kind) {
  return kind == AMBER_KIND_FULL    ? "full"
         : kind == AMBER_KIND_DELTA ? "delta"
                                    : "unknown";
}

/* JSON integers are signed 64-bit in jansson; a larger value becomes a real. */
static json_t *ju64(uint64_t v) {
  return v <= INT64_MAX ? json_integer((json_int_t)v) : json_real((double)v);
}

static json_t *jstep_or_null(uint64_t step) {
  return step == AMBER_NO_STEP ? json_null() : ju64(step);
}

static json_t *jhash(uint64_t h) {
  char hex[17];
  snprintf(hex, sizeof hex, "%016" PRIx64, h);
  return json_string(hex);
}

/* Prints `j` and releases it. NULL means that building it failed: out of memory,
 * or a string (a path, a tensor name) that is not valid UTF-8. */
static int print_json(json_t *j) {
  if (!j) {
    fprintf(stderr, "amber: cannot build the JSON output (out of memory, or a name or "
                    "path that is not valid UTF-8)\n");
    return 1;
  }
  int rc = json_dumpf(j, stdout, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
  json_decref(j);
  if (rc == 0 && fputc('\n', stdout) != EOF && fflush(stdout) == 0) return 0;
  fprintf(stderr, "amber: cannot write the output: %s\n", strerror(errno));
  return 1;
}

/* Opens an existing store with `flags`; a missing one is reported as the library
 * says it ("amber: no store at PATH: no such directory"), nothing else added. */
static int open_existing(const char *path, uint32_t flags, amber_store **st) {
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = flags | AMBER_OPEN_NOCREATE;
  int rc = amber_store_open(st, path, &so);
  if (rc == AMBER_ENOENT) {
    fprintf(stderr, "amber: %s\n", amber_last_error(NULL));
    return 1;
  }
  return rc ? fail(rc, NULL, "cannot open store %s", path) : 0;
}

/* For ls, info, verify and export: never creates or writes anything in the store. */
static int open_store_ro(const char *path, amber_store **st) {
  return open_existing(path, AMBER_OPEN_READONLY, st);
}

/* "step 12" or "the latest step", for messages. */
static const char *step_words(const args *a, char buf[48]) {
  if (!a->have_step) return "the latest step";
  snprintf(buf, 48, "step %" PRIu64, a->step);
  return buf;
}

static int open_reader(amber_store *st, const args *a, amber_reader **r) {
  char sw[48];
  int rc = amber_reader_open(r, st, a->have_step ? a->step : AMBER_LATEST, NULL);
  return rc ? fail(rc, NULL, "cannot open %s of %s", step_words(a, sw), a->pos[0]) : 0;
}

static void shape_text(const int64_t *shape, uint32_t ndim, char *buf, size_t len) {
  size_t pos = (size_t)snprintf(buf, len, "[");
  for (uint32_t d = 0; d < ndim && pos < len; d++)
    pos += (size_t)snprintf(buf + pos, len - pos, "%s%" PRId64, d ? ", " : "", shape[d]);
  if (pos < len) snprintf(buf + pos, len - pos, "]");
}

/* ---- import ------------------------------------------------------------------- */

/* The checkpoint meta for a safetensors __metadata__ object (FORMAT.md,
 * "Metadata"): {"__metadata__": {...}}, malloc'ed; NULL when out of memory. */
static char *wrap_metadata(const char *metadata) {
  json_t *m = json_loads(metadata, JSON_REJECT_DUPLICATES, NULL);
  json_t *root = m ? json_pack("{s:o}", "__metadata__", m) : NULL;
  char *text = root ? json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
  json_decref(root);
  return text;
}

/* Kind and file size of a just-committed step, for the summary. */
static void committed_info(amber_store *st, uint64_t step, amber_ckpt_info *out) {
  amber_ckpt_info *list = NULL;
  size_t n = 0;
  memset(out, 0, sizeof *out);
  out->step = step;
  out->kind = UINT32_MAX;
  if (amber_store_list(st, &list, &n) == 0)
    for (size_t i = 0; i < n; i++)
      if (list[i].step == step) *out = list[i];
  amber_free(list);
}

/* Declares the file's tensors, policies and metadata, then saves step N. */
static int import_save(const args *a, amber_writer *w, const amber__st_header *h,
                       const uint8_t *map) {
  const char *file = a->pos[0], *dir = a->pos[1];
  for (size_t i = 0; i < h->count; i++) {
    const amber__st_tensor *t = &h->tensors[i];
    int rc = amber_writer_add(w, t->name, t->dtype, t->ndim, t->shape,
                              t->nbytes ? map + t->offset : map, NULL);
    if (rc) return fail(rc, w, "%s: tensor '%s'", file, t->name);
  }
  for (size_t i = 0; i < a->npolicies; i++) {
    int rc = amber_writer_add_policy(w, a->policies[i]);
    if (rc) return fail(rc, w, "--policy '%s'", a->policies[i]);
  }
  if (h->metadata) {
    char *meta = wrap_metadata(h->metadata);
    int rc = meta ? amber_writer_set_meta(w, meta, strlen(meta)) : AMBER_ENOMEM;
    free(meta);
    if (rc) return fail(rc, w, "%s: keeping __metadata__", file);
  }
  /* One save per process: a full one needs no reference state in memory. */
  progress_begin("import step %" PRIu64, a->step);
  int rc = amber_writer_save(w, a->step,
                             (a->full ? AMBER_SAVE_FULL : 0) | AMBER_SAVE_NO_REFERENCE);
  progress_end();
  if (rc) return fail(rc, w, "import of %s into %s as step %" PRIu64, file, dir, a->step);
  return 0;
}

static int import_report(const args *a, amber_store *st, const amber__st_header *h,
                         double secs) {
  uint64_t bytes = 0;
  for (size_t i = 0; i < h->count; i++)
    bytes += h->tensors[i].nbytes;
  amber_ckpt_info ci;
  committed_info(st, a->step, &ci);
  if (a->json)
    return print_json(json_pack("{s:o,s:s,s:s,s:s,s:I,s:o,s:o,s:f}", "step",
                                ju64(a->step), "kind", kind_name(ci.kind), "file",
                                a->pos[0], "store", a->pos[1], "tensors",
                                (json_int_t)h->count, "bytes", ju64(bytes),
                                "stored_bytes", ju64(ci.bytes), "seconds", secs));
  char b1[32], b2[32];
  printf("imported step %" PRIu64 " (%s): %zu tensors, %s, stored %s, %.3f s\n", a->step,
         kind_name(ci.kind), h->count, human_bytes(bytes, b1), human_bytes(ci.bytes, b2),
         secs);
  return 0;
}

/* An s3:// store is written through its staging directory (amber_tier_staging), then
 * drained to it: the step must come after the object store's latest, which the
 * staging directory may not hold. *staging (malloc'd) names the directory. */
static int import_staging(const args *a, char **staging) {
  const char *url = a->pos[1];
  amber_store_opts so;
  amber_store_opts_init(&so);
  so.flags = AMBER_OPEN_READONLY;
  amber_store *st = NULL;
  uint64_t latest = AMBER_NO_STEP;
  int rc = amber_store_open(&st, url, &so);
  if (rc == 0 && (rc = amber_store_latest(st, &latest)) == AMBER_ENOENT) rc = 0;
  amber_store_close(st);
  if (rc == AMBER_ENOENT) rc = 0, latest = AMBER_NO_STEP; /* nothing there yet */
  if (rc) return fail(rc, NULL, "cannot open store %s", url);
  if (latest != AMBER_NO_STEP && a->step <= latest) {
    fprintf(stderr, "amber: step %" PRIu64 " is not after the latest step %" PRIu64 " of %s\n",
            a->step, latest, url);
    return 1;
  }
  if ((rc = amber_tier_staging(url, staging)) != 0)
    return fail(rc, NULL, "cannot name a staging directory for %s", url);
  return 0;
}

static int cmd_import(const args *a) {
  const char *file = a->pos[0], *dir = a->pos[1];
  char *staging = NULL;
  if (is_url(dir)) {
    if (import_staging(a, &staging)) return 1;
    dir = staging;
  }
  int fd = open(file, O_RDONLY | O_CLOEXEC);
  struct stat sb;
  const char *why = NULL;
  if (fd < 0 || fstat(fd, &sb) != 0)
    why = strerror(errno);
  else if (!S_ISREG(sb.st_mode))
    why = "not a regular file";
  if (why) {
    fprintf(stderr, "amber: cannot read %s: %s\n", file, why);
    if (fd >= 0) close(fd);
    free(staging);
    return 1;
  }
  size_t size = (size_t)sb.st_size;
  /* The writer reads tensors straight from the mapping: no copy of the file. */
  const uint8_t *map = NULL;
  if (size) {
    void *p = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      fprintf(stderr, "amber: cannot map %s: %s\n", file, strerror(errno));
      close(fd);
      free(staging);
      return 1;
    }
    madvise(p, size, MADV_SEQUENTIAL);
    map = p;
  }
  close(fd);

  double t0 = now();
  amber__st_header h;
  char err[512];
  int rc = amber__st_parse(map, size, size, &h, err, sizeof err);
  if (rc) {
    /* Parsed before the store is opened, so a bad file leaves the store untouched. */
    fprintf(stderr, "amber: %s: %s\n", file, err);
    if (map) munmap((void *)map, size);
    free(staging);
    return 1;
  }
  amber_store *st = NULL;
  amber_writer *w = NULL;
  amber_writer_opts wo;
  amber_writer_opts_init(&wo);
  wo.chunk_elems = a->chunk_elems;
  int ret = 1;
  if ((rc = amber_store_open(&st, dir, NULL)) != 0)
    fail(rc, NULL, "cannot open store %s for writing", dir);
  else if ((rc = amber_writer_open(&w, st, &wo)) != 0)
    fail(rc, NULL, "cannot write to store %s", dir);
  else if (import_save(a, w, &h, map) == 0) {
    rc = 0;
    if (staging) { /* committed in the staging directory: durable once drained */
      amber_writer_close(w), w = NULL; /* the drain reads a store no writer holds */
      progress_begin("upload step %" PRIu64 " to %s", a->step, a->pos[1]);
      rc = amber_drain_run(staging, a->pos[1], NULL);
      progress_end();
      if (rc)
        fail(rc, NULL, "step %" PRIu64 " is committed in %s but not in %s (amber drain %s "
             "finishes it)", a->step, staging, a->pos[1], staging);
    }
    if (!rc) ret = import_report(a, st, &h, now() - t0);
  }
  amber_writer_close(w);
  amber_store_close(st);
  free(staging);
  amber__st_header_free(&h);
  if (map) munmap((void *)map, size);
  return ret;
}

/* ---- export ------------------------------------------------------------------- */

/* The temporary output, removed if a signal ends the export. */
static char tmp_path[4200];
static volatile sig_atomic_t have_tmp;

static void on_signal(int sig) {
  if (have_tmp) unlink(tmp_path);
  signal(sig, SIG_DFL);
  raise(sig);
}

static int write_all(int fd, const uint8_t *p, uint64_t n) {
  while (n) {
    ssize_t k = write(fd, p, n > (1u << 30) ? (1u << 30) : (size_t)n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return -1;
    p += k;
    n -= (uint64_t)k;
  }
  return 0;
}

/* fsync of the directory holding `path`, so that a rename into it is durable. */
static int sync_parent(const char *path) {
  char dir[4200];
  const char *slash = strrchr(path, '/');
  if (!slash)
    snprintf(dir, sizeof dir, ".");
  else
    snprintf(dir, sizeof dir, "%.*s", slash == path ? 1 : (int)(slash - path), path);
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return -1;
  int rc = fsync(fd);
  close(fd);
  return rc;
}

typedef struct export_job {
  amber_reader *r;
  amber_global_reader *g; /* instead of r, for a multi-rank store */
  uint64_t step;
  const amber__st_tensor *t;
  size_t n;
  const uint8_t *hdr;
  size_t hdr_len;
  uint8_t *buf; /* one buffer, sized to the largest tensor */
  uint64_t total;
  const char *store, *out;
} export_job;

/* Writes the header and every tensor to fd. */
static int export_data(const export_job *j, int fd) {
  uint64_t step = j->step, done = 0;
  int64_t zero[AMBER_MAX_DIMS] = {0};
  if (prog.on) {
    snprintf(prog.label, sizeof prog.label, "export step %" PRIu64, step);
    prog.start = now(), prog.last = 0;
  }
  if (write_all(fd, j->hdr, j->hdr_len)) return sys_fail("writing %s", tmp_path);
  for (size_t i = 0; i < j->n; i++) {
    int rc = j->g ? amber_global_reader_read(j->g, i, zero, j->t[i].shape, j->buf,
                                             j->t[i].nbytes)
                  : amber_reader_read(j->r, i, j->buf, j->t[i].nbytes);
    if (rc) progress_end();
    if (rc)
      return fail(rc, j->g ? (const void *)j->g : (const void *)j->r, "reading tensor '%s' of step %" PRIu64 " of %s", j->t[i].name,
                  step, j->store);
    if (write_all(fd, j->buf, j->t[i].nbytes)) return sys_fail("writing %s", tmp_path);
    done += j->t[i].nbytes;
    if (prog.on) progress_draw(prog.label, done, j->total);
  }
  progress_end();
  return 0;
}

/* Creates "OUT.<16 random hex digits>.tmp" for writing, as the library names its
 * temporary files: exclusively and without following a link (O_EXCL, O_NOFOLLOW),
 * under a name nobody can predict (OUT's directory may be shared, and a link
 * planted at a predictable name would redirect the export), mode 0644 less the
 * umask. Returns the descriptor, or -1 with errno set. */
static int create_tmp(const char *out, char *path, size_t len) {
  for (int tries = 0; tries < 100; tries++) {
    uint64_t r; /* without entropy yet (early boot) a guessable name: O_EXCL keeps it safe */
    if (getrandom(&r, sizeof r, GRND_NONBLOCK) != (ssize_t)sizeof r)
      r = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32) ^ (uint64_t)tries;
    int n = snprintf(path, len, "%s.%016" PRIx64 ".tmp", out, r);
    if (n < 0 || (size_t)n >= len) {
      errno = ENAMETOOLONG;
      return -1;
    }
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd >= 0 || errno != EEXIST) return fd;
  }
  return -1;
}

/* Writes a new temporary file beside OUT, fsyncs it and renames it to OUT: a
 * failed or interrupted export never leaves a partial OUT. */
static int export_file(const export_job *j) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGHUP, &sa, NULL);
  int fd = create_tmp(j->out, tmp_path, sizeof tmp_path);
  if (fd < 0) return sys_fail("cannot export to %s: cannot create %s", j->out, tmp_path);
  have_tmp = 1;
  int ret = export_data(j, fd);
  if (!ret && fsync(fd) != 0) ret = sys_fail("fsync of %s", tmp_path);
  if (close(fd) != 0 && !ret) ret = sys_fail("closing %s", tmp_path);
  if (!ret && rename(tmp_path, j->out) != 0)
    ret = sys_fail("cannot rename %s to %s", tmp_path, j->out);
  if (ret) unlink(tmp_path);
  have_tmp = 0;
  if (!ret && sync_parent(j->out) != 0)
    ret = sys_fail("fsync of the directory of %s", j->out);
  return ret;
}

/* The "__metadata__" object of the checkpoint's meta, as JSON text (malloc'ed), or
 * NULL when there is none. safetensors allows only string values, so an object with
 * other values is left out with a warning rather than failing the export. */
static char *export_metadata(amber_reader *r, uint64_t step) {
  const char *json;
  size_t len;
  if (amber_reader_meta(r, &json, &len) != 0 || !json || !len) return NULL;
  json_t *root = json_loadb(json, len, 0, NULL);
  json_t *m = json_object_get(root, "__metadata__");
  char *text = NULL;
  if (json_is_object(m)) {
    const char *k;
    json_t *v;
    int strings = 1;
    json_object_foreach(m, k, v) strings &= json_is_string(v);
    if (strings)
      text = json_dumps(m, JSON_COMPACT | JSON_PRESERVE_ORDER);
    else
      fprintf(stderr,
              "amber: warning: step %" PRIu64 ": __metadata__ holds non-string "
              "values, which safetensors cannot keep; not exported\n",
              step);
  }
  json_decref(root);
  return text;
}

static int export_report(const args *a, const export_job *j, double secs) {
  uint64_t step = j->step;
  if (a->json)
    return print_json(json_pack("{s:o,s:s,s:s,s:I,s:o,s:f}", "step", ju64(step), "store",
                                j->store, "file", j->out, "tensors", (json_int_t)j->n,
                                "bytes", ju64(j->total), "seconds", secs));
  char b[32];
  printf("exported step %" PRIu64 " to %s: %zu tensors, %s, %.3f s\n", step, j->out, j->n,
         human_bytes(j->total, b), secs);
  return 0;
}

/* export of a multi-rank store: the consolidated global tensors, as if the state had
 * never been sharded. */
static int global_export(const args *a, double t0) {
  amber_global_reader *g = NULL;
  int rc = amber_global_reader_open(&g, a->pos[0], a->have_step ? a->step : AMBER_LATEST);
  if (rc) return fail(rc, NULL, "cannot open multi-rank store %s", a->pos[0]), 1;
  export_job j = {.g = g, .step = amber_global_reader_step(g),
                  .n = amber_global_reader_count(g), .store = a->pos[0], .out = a->out};
  uint64_t max = 0;
  amber__st_tensor *t = calloc(j.n ? j.n : 1, sizeof *t);
  uint8_t *hdr = NULL;
  int ret = 1;
  rc = t ? 0 : AMBER_ENOMEM;
  for (size_t i = 0; i < j.n && !rc; i++) {
    amber_global_tensor gt;
    if ((rc = amber_global_reader_tensor(g, i, &gt)) != 0) break;
    t[i].name = (char *)gt.name;
    t[i].dtype = gt.dtype;
    t[i].ndim = gt.ndim;
    memcpy(t[i].shape, gt.shape, sizeof t[i].shape);
    uint64_t n = amber_dtype_size(gt.dtype);
    for (uint32_t d = 0; d < gt.ndim; d++) n *= (uint64_t)gt.shape[d];
    t[i].nbytes = n;
    j.total += n;
    if (n > max) max = n;
  }
  char err[512] = "";
  if (rc) {
    fail(rc, NULL, "reading the tensor list of step %" PRIu64 " of %s", j.step, a->pos[0]);
  } else if ((rc = amber__st_format_header(t, j.n, NULL, 0, &hdr, &j.hdr_len, err,
                                           sizeof err)) != 0) {
    fprintf(stderr, "amber: cannot export step %" PRIu64 " of %s as safetensors: %s\n",
            j.step, a->pos[0], err);
  } else if (max > SIZE_MAX || !(j.buf = malloc(max ? (size_t)max : 1))) {
    fprintf(stderr, "amber: out of memory for a %" PRIu64 "-byte tensor buffer\n", max);
  } else {
    j.t = t;
    j.hdr = hdr;
    if (export_file(&j) == 0) ret = export_report(a, &j, now() - t0);
  }
  free(j.buf);
  free(hdr);
  free(t);
  amber_global_reader_close(g);
  return ret;
}

static int cmd_export(const args *a) {
  double t0 = now();
  if (amber_global_is_store(a->pos[0])) return global_export(a, t0);
  amber_store *st = NULL;
  amber_reader *r = NULL;
  if (open_store_ro(a->pos[0], &st)) return 1;
  if (open_reader(st, a, &r)) {
    amber_store_close(st);
    return 1;
  }
  export_job j = {.r = r, .step = amber_reader_step(r), .n = amber_reader_count(r),
                  .store = a->pos[0], .out = a->out};
  uint64_t step = j.step, max = 0;
  amber__st_tensor *t = calloc(j.n ? j.n : 1, sizeof *t);
  char *meta = export_metadata(r, step);
  uint8_t *hdr = NULL;
  int ret = 1, rc = t ? 0 : AMBER_ENOMEM;
  for (size_t i = 0; i < j.n && !rc; i++) {
    amber_tensor_info ti;
    if ((rc = amber_reader_info(r, i, &ti)) != 0) break;
    t[i].name = (char *)ti.name; /* owned by the reader; format_header only reads it */
    t[i].dtype = ti.dtype;
    t[i].ndim = ti.ndim;
    memcpy(t[i].shape, ti.shape, sizeof t[i].shape);
    t[i].nbytes = ti.nbytes;
    j.total += ti.nbytes;
    if (ti.nbytes > max) max = ti.nbytes;
  }
  char err[512] = "";
  if (rc) {
    fail(rc, r, "reading the tensor list of step %" PRIu64 " of %s", step, a->pos[0]);
  } else if ((rc = amber__st_format_header(t, j.n, meta, meta ? strlen(meta) : 0, &hdr,
                                           &j.hdr_len, err, sizeof err)) != 0) {
    fprintf(stderr, "amber: cannot export step %" PRIu64 " of %s as safetensors: %s\n",
            step, a->pos[0], err);
  } else if (max > SIZE_MAX || !(j.buf = malloc(max ? (size_t)max : 1))) {
    fprintf(stderr, "amber: out of memory for a %" PRIu64 "-byte tensor buffer\n", max);
  } else {
    j.t = t;
    j.hdr = hdr;
    if (export_file(&j) == 0) ret = export_report(a, &j, now() - t0);
  }
  free(j.buf);
  free(hdr);
  free(meta);
  free(t);
  amber_reader_close(r);
  amber_store_close(st);
  return ret;
}

/* A store whose list is empty is empty, or it lost LATEST but still holds
 * checkpoint files (FORMAT.md, "Store layout"), which only the reader reports.
 * Returns 0 when it is empty, else prints why and returns 1. */
/* A store with no committed checkpoint is fine (a writer made it and has not committed
 * yet: it holds its .lock); a directory that holds nothing of a store is a mistake
 * (a mistyped path must not "verify"), and an unreadable latest step is damage. */
static int check_empty(amber_store *st, const char *path) {
  amber_reader *r = NULL;
  int rc = amber_reader_open(&r, st, AMBER_LATEST, NULL);
  amber_reader_close(r);
  if (rc != AMBER_ENOENT && rc != 0) return fail(rc, NULL, "store %s is damaged", path);
  if (is_url(path)) return 0; /* a read-only open of an empty prefix failed already */
  static const char *const marks[] = {"LATEST", ".lock"};
  char p[4200];
  struct stat sb;
  for (size_t i = 0; i < sizeof marks / sizeof *marks; i++) {
    snprintf(p, sizeof p, "%s/%s", path, marks[i]);
    if (stat(p, &sb) == 0) return 0;
  }
  fprintf(stderr, "amber: %s is not an amber store (it holds no LATEST, .lock or GLOBAL): "
          "is the path right?\n", path);
  return 1;
}

/* ---- ls ----------------------------------------------------------------------- */

/* ---- storage tiers (ls of a memory tier) --------------------------------------- */

/* Where a step is: bit 0 the store listed (the memory tier), bit 1 its durable tier. */
#define IN_MEMORY 1u
#define IN_DURABLE 2u

/* The durable tier that store `path`'s TIERS file records (NULL when none; a TIERS
 * file that cannot be read is said on stderr, and the listing goes on without it). */
static char *recorded_durable(const char *path) {
  char *durable = NULL;
  int rc = amber_tier_durable(path, &durable);
  if (rc && rc != AMBER_ENOENT)
    fprintf(stderr, "amber: %s: the durable tier is unknown: %s\n", path, amber_last_error(NULL));
  return rc ? NULL : durable;
}

static void tiers_text(unsigned t, char buf[24]) {
  snprintf(buf, 24, "%s%s%s", t & IN_MEMORY ? "memory" : "", t == 3 ? "," : "",
           t & IN_DURABLE ? "durable" : "");
}

static json_t *tiers_json(unsigned t) {
  json_t *arr = json_array();
  if (arr && (t & IN_MEMORY)) json_array_append_new(arr, json_string("memory"));
  if (arr && (t & IN_DURABLE)) json_array_append_new(arr, json_string("durable"));
  return arr;
}

/* The union of two sorted step lists: for its k-th step, ia[k] and ib[k] (malloc'd,
 * *n entries each) are its places in a and b, or -1. */
static int merge_steps(const uint64_t *a, size_t na, const uint64_t *b, size_t nb, long **ia,
                       long **ib, size_t *n) {
  *ia = malloc((na + nb + 1) * sizeof **ia);
  *ib = malloc((na + nb + 1) * sizeof **ib);
  if (!*ia || !*ib) return -1;
  size_t i = 0, j = 0, k = 0;
  while (i < na || j < nb) {
    int take_a = j == nb || (i < na && a[i] <= b[j]);
    int take_b = i == na || (j < nb && b[j] <= a[i]);
    (*ia)[k] = take_a ? (long)i++ : -1;
    (*ib)[k] = take_b ? (long)j++ : -1;
    k++;
  }
  *n = k;
  return 0;
}

static uint64_t *ckpt_steps(const amber_ckpt_info *c, size_t n) {
  uint64_t *s = malloc((n + 1) * sizeof *s);
  for (size_t i = 0; s && i < n; i++) s[i] = c[i].step;
  return s;
}

static uint64_t *global_steps(const amber_global_step_info *g, size_t n) {
  uint64_t *s = malloc((n + 1) * sizeof *s);
  for (size_t i = 0; s && i < n; i++) s[i] = g[i].step;
  return s;
}

/* The tiers of row k of a merge. */
static unsigned row_tiers(const long *im, const long *id, size_t k) {
  return (im[k] >= 0 ? IN_MEMORY : 0) | (id[k] >= 0 ? IN_DURABLE : 0);
}

/* ---- multi-rank stores (ls, verify) ------------------------------------------- */

static int global_ls(const args *a) {
  amber_global_step_info *gs = NULL, *dg = NULL;
  size_t n = 0, nd = 0;
  int rc = amber_global_list(a->pos[0], &gs, &n);
  if (rc) return fail(rc, NULL, "cannot list multi-rank store %s", a->pos[0]), 1;
  /* A memory tier: its durable tier's steps too, each row saying where it is. */
  char *durable = recorded_durable(a->pos[0]);
  if (durable && (rc = amber_global_list(durable, &dg, &nd)) != 0)
    fprintf(stderr, "amber: cannot list the durable tier %s: %s\n", durable,
            amber_last_error(NULL));
  uint64_t *ms = global_steps(gs, n), *ds = global_steps(dg, nd);
  long *im = NULL, *id = NULL;
  size_t rows = 0;
  int ret = 0;
  if (!ms || !ds || merge_steps(ms, n, ds, nd, &im, &id, &rows)) {
    fprintf(stderr, "amber: out of memory\n");
    ret = 1, rows = 0;
  }
  if (a->json && !ret) {
    json_t *arr = json_array();
    for (size_t r = 0; arr && r < rows; r++) {
      const amber_global_step_info *g = im[r] >= 0 ? &gs[im[r]] : &dg[id[r]];
      int damaged = (g->flags & AMBER_CKPT_DAMAGED) != 0; /* kind and the rest unknown */
      json_t *o = json_pack("{s:o,s:o,s:o,s:o,s:o,s:b}", "step", ju64(g->step), "kind",
                            damaged ? json_null() : json_string(kind_name(g->kind)),
                            "parent", jstep_or_null(g->parent), "bytes", ju64(g->bytes),
                            "world_size", damaged ? json_null() : ju64(g->world_size),
                            "damaged", damaged);
      if (o && durable) json_object_set_new(o, "tiers", tiers_json(row_tiers(im, id, r)));
      if (json_array_append_new(arr, o) != 0) {
        json_decref(arr);
        arr = NULL;
      }
    }
    ret = print_json(arr);
  } else if (!ret) {
    if (rows)
      printf("%-20s  %-5s  %-20s  %14s  %s\n", "step", "kind", "parent", "bytes",
             durable ? "world_size  tiers" : "world_size");
    for (size_t r = 0; r < rows; r++) {
      const amber_global_step_info *g = im[r] >= 0 ? &gs[im[r]] : &dg[id[r]];
      char parent[24] = "-", tiers[24] = "";
      if (g->parent != AMBER_NO_STEP) snprintf(parent, sizeof parent, "%" PRIu64, g->parent);
      if (durable) tiers_text(row_tiers(im, id, r), tiers);
      if (g->flags & AMBER_CKPT_DAMAGED)
        printf("%-20" PRIu64 "  %-5s  %-20s  %14s  damaged (amber verify says why)%s%s\n",
               g->step, "?", "?", "?", durable ? "  " : "", tiers);
      else
        printf("%-20" PRIu64 "  %-5s  %-20s  %14" PRIu64 "  %-10u%s%s\n", g->step,
               kind_name(g->kind), parent, g->bytes, g->world_size, durable ? "  " : "", tiers);
    }
  }
  free(im), free(id), free(ms), free(ds);
  amber_free(gs);
  amber_free(dg);
  free(durable);
  return ret;
}

/* 1 when step `step` of a listing is no longer listed (a prune removed it while
 * verify ran), so that a failure to read it is no damage. */
static int global_step_gone(const char *path, uint64_t step) {
  amber_global_step_info *gs = NULL;
  size_t n = 0;
  int gone = amber_global_list(path, &gs, &n) == 0;
  for (size_t i = 0; gone && i < n; i++) gone = gs[i].step != step;
  amber_free(gs);
  return gone;
}

static int global_verify(const args *a) {
  amber_global_step_info one = {.step = a->step}, *gs = &one;
  size_t n = 1;
  if (!a->have_step) {
    int rc = amber_global_list(a->pos[0], &gs, &n);
    if (rc) return fail(rc, NULL, "cannot list multi-rank store %s", a->pos[0]), 1;
  }
  json_t *arr = a->json ? json_array() : NULL;
  int bad = (a->json && !arr) || n == 0;
  for (size_t i = 0; i < n; i++) {
    amber_global_reader *g = NULL;
    int rc = amber_global_reader_open(&g, a->pos[0], gs[i].step);
    char why[1200] = "";
    progress_begin("verify step %" PRIu64 ", rank by rank", gs[i].step);
    if (rc == 0) rc = amber_global_reader_verify(g);
    progress_end();
    if (rc) snprintf(why, sizeof why, "%s", amber_last_error(g));
    amber_global_reader_close(g);
    if (rc && gs != &one && !(gs[i].flags & AMBER_CKPT_DAMAGED) &&
        global_step_gone(a->pos[0], gs[i].step)) {
      if (!arr) printf("step %" PRIu64 ": removed since the listing (pruned)\n", gs[i].step);
      continue;
    }
    bad |= rc != 0;
    if (arr) {
      json_t *o = json_pack("{s:o,s:b,s:s?}", "step", ju64(gs[i].step), "ok", rc == 0,
                            "error", rc ? why : NULL);
      if (json_array_append_new(arr, o) != 0) bad = 1;
    } else if (rc) {
      printf("step %" PRIu64 ": FAILED: %s\n", gs[i].step, why);
    } else {
      printf("step %" PRIu64 ": ok\n", gs[i].step);
    }
  }
  if (a->json && print_json(arr)) bad = 1;
  if (gs != &one) amber_free(gs);
  return bad;
}

static int cmd_ls(const args *a) {
  if (amber_global_is_store(a->pos[0])) return global_ls(a);
  amber_store *st = NULL;
  if (open_store_ro(a->pos[0], &st)) return 1;
  amber_ckpt_info *ck = NULL, *dk = NULL;
  size_t n = 0, nd = 0;
  int rc = amber_store_list(st, &ck, &n);
  if (rc || (n == 0 && check_empty(st, a->pos[0]))) {
    if (rc) fail(rc, st, "cannot list store %s", a->pos[0]);
    amber_store_close(st);
    return 1;
  }
  /* A memory tier: its durable tier's steps too, each row saying where it is. */
  char *durable = recorded_durable(a->pos[0]);
  amber_store *ds = NULL;
  if (durable) {
    amber_store_opts so;
    amber_store_opts_init(&so);
    so.flags = AMBER_OPEN_READONLY;
    if ((rc = amber_store_open(&ds, durable, &so)) == 0) rc = amber_store_list(ds, &dk, &nd);
    if (rc)
      fprintf(stderr, "amber: cannot list the durable tier %s: %s\n", durable,
              amber_last_error(ds ? (const void *)ds : NULL));
  }
  uint64_t *ms = ckpt_steps(ck, n), *dss = ckpt_steps(dk, nd);
  long *im = NULL, *id = NULL;
  size_t rows = 0;
  int ret = 0;
  if (!ms || !dss || merge_steps(ms, n, dss, nd, &im, &id, &rows)) {
    fprintf(stderr, "amber: out of memory\n");
    ret = 1, rows = 0;
  }
  if (a->json && !ret) {
    json_t *arr = json_array();
    for (size_t r = 0; arr && r < rows; r++) {
      const amber_ckpt_info *c = im[r] >= 0 ? &ck[im[r]] : &dk[id[r]];
      json_t *o = json_pack("{s:o,s:s,s:o,s:o,s:o,s:b}", "step", ju64(c->step), "kind",
                            kind_name(c->kind), "parent", jstep_or_null(c->parent),
                            "bytes", ju64(c->bytes), "hash", jhash(c->hash), "damaged",
                            (c->flags & AMBER_CKPT_DAMAGED) != 0);
      if (o && durable) json_object_set_new(o, "tiers", tiers_json(row_tiers(im, id, r)));
      if (json_array_append_new(arr, o) != 0) {
        json_decref(arr);
        arr = NULL;
      }
    }
    ret = print_json(arr);
  } else if (!ret) {
    if (rows)
      printf("%-20s  %-5s  %-20s  %14s  %s\n", "step", "kind", "parent", "bytes",
             durable ? "hash              tiers" : "hash");
    for (size_t r = 0; r < rows; r++) {
      const amber_ckpt_info *c = im[r] >= 0 ? &ck[im[r]] : &dk[id[r]];
      char parent[24] = "-", tiers[24] = "";
      if (c->parent != AMBER_NO_STEP) snprintf(parent, sizeof parent, "%" PRIu64, c->parent);
      if (durable) tiers_text(row_tiers(im, id, r), tiers);
      if (c->flags & AMBER_CKPT_DAMAGED)
        printf("%-20" PRIu64 "  %-5s  %-20s  %14" PRIu64 "  damaged (amber verify says why)%s%s\n",
               c->step, "?", "?", c->bytes, durable ? "  " : "", tiers);
      else
        printf("%-20" PRIu64 "  %-5s  %-20s  %14" PRIu64 "  %016" PRIx64 "%s%s\n", c->step,
               kind_name(c->kind), parent, c->bytes, c->hash, durable ? "  " : "", tiers);
    }
  }
  free(im), free(id), free(ms), free(dss);
  amber_free(ck);
  amber_free(dk);
  amber_store_close(ds);
  amber_store_close(st);
  free(durable);
  return ret;
}

/* ---- info --------------------------------------------------------------------- */

static json_t *tensor_json(const amber_tensor_info *ti) {
  json_t *shape = json_array();
  for (uint32_t d = 0; shape && d < ti->ndim; d++)
    if (json_array_append_new(shape, json_integer(ti->shape[d])) != 0) {
      json_decref(shape);
      shape = NULL;
    }
  if (!shape) return NULL;
  return json_pack("{s:s,s:s,s:o,s:s?,s:o,s:o,s:o,s:o,s:o,s:o}", "name", ti->name,
                   "dtype", amber_dtype_name(ti->dtype), "shape", shape, "policy",
                   ti->policy, "nbytes", ju64(ti->nbytes), "stored_bytes",
                   ju64(ti->stored_bytes), "stored_elems", ju64(ti->stored_elems),
                   "nelems", ju64(ti->nelems), "chunk_elems", ju64(ti->chunk_elems),
                   "nchunks", ju64(ti->nchunks));
}

static int info_json(amber_reader *r, const amber_ckpt_info *ci) {
  json_t *tensors = json_array();
  size_t n = amber_reader_count(r);
  for (size_t i = 0; tensors && i < n; i++) {
    amber_tensor_info ti;
    if (amber_reader_info(r, i, &ti) != 0 ||
        json_array_append_new(tensors, tensor_json(&ti)) != 0) {
      json_decref(tensors);
      tensors = NULL;
    }
  }
  const char *meta;
  size_t mlen;
  amber_reader_meta(r, &meta, &mlen);
  json_t *mj = meta && mlen ? json_loadb(meta, mlen, 0, NULL) : NULL;
  if (!tensors) {
    json_decref(mj);
    return print_json(NULL);
  }
  return print_json(json_pack("{s:o,s:s,s:o,s:o,s:o,s:o?,s:o}", "step", ju64(ci->step),
                              "kind", kind_name(ci->kind), "parent",
                              jstep_or_null(ci->parent), "bytes", ju64(ci->bytes), "hash",
                              jhash(ci->hash), "meta", mj, "tensors", tensors));
}

/* A recorded policy for people: its numbers with 6 significant digits (a rule in
 * units records the numbers it resolved to, e.g. 1.0000000000000002e-06, the f64
 * product of an lr and a unit). JSON output keeps the exact text. */
static int number_at(const char *spec, const char *p) {
  return (p == spec || strchr(":/", p[-1])) &&
         (*p == '-' || *p == '.' || (*p >= '0' && *p <= '9'));
}

static void policy_text(const char *spec, char *buf, size_t len) {
  size_t o = 0;
  for (const char *p = spec; *p && o + 1 < len;) {
    char *end = (char *)p;
    double v = number_at(spec, p) ? strtod(p, &end) : 0;
    if (end > p) {
      int n = snprintf(buf + o, len - o, "%.6g", v);
      o += n > 0 ? (size_t)n : 0;
      p = end;
    } else {
      buf[o++] = *p++;
    }
  }
  buf[o < len ? o : len - 1] = 0;
}

/* The preset the Checkpointer was given, when its metadata names one ("policy"). */
static void print_preset(const char *meta, size_t len) {
  if (!meta || !len) return;
  json_error_t je;
  json_t *m = json_loadb(meta, len, 0, &je);
  json_t *p = m ? json_object_get(m, "policy") : NULL;
  if (json_is_string(p)) printf("policy: %s\n", json_string_value(p));
  json_decref(m);
}

/* Columns of UTF-8 text, counting code points (not bytes) as one column each. */
static int columns(const char *s) {
  int n = 0;
  for (; *s; s++)
    n += ((unsigned char)*s & 0xC0) != 0x80;
  return n;
}

static void info_text(amber_reader *r, const amber_ckpt_info *ci) {
  char parent[24] = "-";
  if (ci->parent != AMBER_NO_STEP)
    snprintf(parent, sizeof parent, "%" PRIu64, ci->parent);
  size_t n = amber_reader_count(r), mlen;
  const char *meta;
  amber_reader_meta(r, &meta, &mlen);
  printf("step %" PRIu64 "  kind %s  parent %s  bytes %" PRIu64 "  hash %016" PRIx64
         "  tensors %zu  meta %zu bytes\n",
         ci->step, kind_name(ci->kind), parent, ci->bytes, ci->hash, n, mlen);
  print_preset(meta, mlen);
  int w = 4;
  amber_tensor_info ti;
  for (size_t i = 0; i < n; i++)
    if (amber_reader_info(r, i, &ti) == 0 && columns(ti.name) > w)
      w = columns(ti.name) > 48 ? 48 : columns(ti.name);
  if (n)
    printf("%-*s  %-7s  %-20s  %-28s  %14s  %7s\n", w, "name", "dtype", "shape", "policy",
           "stored bytes", "stored");
  for (size_t i = 0; i < n; i++) {
    if (amber_reader_info(r, i, &ti) != 0) continue;
    char shape[200], share[16] = "-", pol[200] = "-";
    shape_text(ti.shape, ti.ndim, shape, sizeof shape);
    if (ti.policy) policy_text(ti.policy, pol, sizeof pol);
    if (ti.nelems)
      snprintf(share, sizeof share, "%.1f%%",
               100.0 * (double)ti.stored_elems / (double)ti.nelems);
    int pad = w > columns(ti.name) ? w - columns(ti.name) : 0;
    printf("%s%*s  %-7s  %-20s  %-28s  %14" PRIu64 "  %7s\n", ti.name, pad, "",
           amber_dtype_name(ti.dtype), shape, pol, ti.stored_bytes, share);
  }
}

/* info of a multi-rank store: the global tensor table of one step. */
static int global_info(const args *a) {
  amber_global_reader *g = NULL;
  int rc = amber_global_reader_open(&g, a->pos[0], a->have_step ? a->step : AMBER_LATEST);
  if (rc) return fail(rc, NULL, "cannot open multi-rank store %s", a->pos[0]), 1;
  size_t n = amber_global_reader_count(g);
  int ret = 0;
  json_t *arr = a->json ? json_array() : NULL;
  if (!a->json)
    printf("step %" PRIu64 ", world size %u, %zu tensors\n", amber_global_reader_step(g),
           amber_global_reader_world_size(g), n);
  for (size_t i = 0; i < n; i++) {
    amber_global_tensor t;
    amber_global_reader_tensor(g, i, &t);
    char shape[256] = "";
    size_t o = 0;
    for (uint32_t d = 0; d < t.ndim && o < sizeof shape - 24; d++)
      o += (size_t)snprintf(shape + o, sizeof shape - o, "%s%" PRId64, d ? "," : "", t.shape[d]);
    if (arr) {
      json_t *sh = json_array();
      for (uint32_t d = 0; sh && d < t.ndim; d++) json_array_append_new(sh, json_integer(t.shape[d]));
      json_array_append_new(arr, json_pack("{s:s,s:s,s:o,s:I,s:b}", "name", t.name, "dtype",
                                           amber_dtype_name(t.dtype), "shape", sh, "shards",
                                           (json_int_t)t.nshards, "replicated",
                                           (t.flags & AMBER_SHARD_REPLICATED) != 0));
    } else {
      printf("  %-40s %-5s [%s]  %u shard%s%s\n", t.name, amber_dtype_name(t.dtype), shape,
             t.nshards, t.nshards == 1 ? "" : "s",
             (t.flags & AMBER_SHARD_REPLICATED) ? " (replicated)" : "");
    }
  }
  if (a->json)
    ret = print_json(json_pack("{s:o,s:I,s:o}", "step", ju64(amber_global_reader_step(g)),
                               "world_size", (json_int_t)amber_global_reader_world_size(g),
                               "tensors", arr ? arr : json_array()));
  amber_global_reader_close(g);
  return ret;
}

static int cmd_info(const args *a) {
  if (amber_global_is_store(a->pos[0])) return global_info(a);
  amber_store *st = NULL;
  amber_reader *r = NULL;
  if (open_store_ro(a->pos[0], &st)) return 1;
  if (open_reader(st, a, &r)) {
    amber_store_close(st);
    return 1;
  }
  amber_ckpt_info ci;
  int ret = 0, rc = amber_reader_ckpt_info(r, &ci);
  if (rc)
    ret = fail(rc, r, "cannot read step %" PRIu64 " of %s", amber_reader_step(r),
               a->pos[0]);
  else if (a->json)
    ret = info_json(r, &ci);
  else
    info_text(r, &ci);
  amber_reader_close(r);
  amber_store_close(st);
  return ret;
}

/* ---- verify ------------------------------------------------------------------- */

/* Opens and verifies one step; 0 when intact, else writes the reason to `why`. */
static int verify_step(amber_store *st, uint64_t step, char *why, size_t len) {
  amber_reader *r = NULL;
  amber_reader_opts ro; /* the step's own files, never a memory tier's image of it */
  amber_reader_opts_init(&ro);
  ro.flags = AMBER_READER_FILES;
  int rc = amber_reader_open(&r, st, step, &ro);
  if (rc) {
    snprintf(why, len, "%s",
             *amber_last_error(NULL) ? amber_last_error(NULL) : amber_strerror(rc));
    return rc;
  }
  rc = amber_reader_verify(r);
  if (rc)
    snprintf(why, len, "%s",
             *amber_last_error(r) ? amber_last_error(r) : amber_strerror(rc));
  amber_reader_close(r);
  return rc;
}

/* 1 when step `step` is no longer listed (the drain of a memory tier, or a prune,
 * removed it while verify ran), so that a failure to read it is no damage. */
static int store_step_gone(amber_store *st, uint64_t step) {
  amber_ckpt_info *ck = NULL;
  size_t n = 0;
  int gone = amber_store_list(st, &ck, &n) == 0;
  for (size_t i = 0; gone && i < n; i++) gone = ck[i].step != step;
  amber_free(ck);
  return gone;
}

static int cmd_verify(const args *a) {
  if (amber_global_is_store(a->pos[0])) return global_verify(a);
  amber_store *st = NULL;
  if (open_store_ro(a->pos[0], &st)) return 1;
  amber_ckpt_info one = {.step = a->step}, *ck = &one;
  size_t n = 1;
  if (!a->have_step) {
    int rc = amber_store_list(st, &ck, &n);
    if (rc || (n == 0 && check_empty(st, a->pos[0]))) {
      if (rc) fail(rc, st, "cannot list store %s", a->pos[0]);
      amber_store_close(st);
      return 1;
    }
  }
  json_t *arr = a->json ? json_array() : NULL;
  int bad = a->json && !arr;
  char why[1200];
  for (size_t i = 0; i < n; i++) {
    progress_begin("verify step %" PRIu64, ck[i].step);
    int rc = verify_step(st, ck[i].step, why, sizeof why);
    progress_end();
    if (rc && ck != &one && !(ck[i].flags & AMBER_CKPT_DAMAGED) &&
        store_step_gone(st, ck[i].step)) {
      if (!arr) printf("step %" PRIu64 ": removed since the listing (pruned)\n", ck[i].step);
      continue;
    }
    bad |= rc != 0;
    if (arr) {
      json_t *o = json_pack("{s:o,s:b,s:s?}", "step", ju64(ck[i].step), "ok", rc == 0,
                            "error", rc ? why : NULL);
      if (json_array_append_new(arr, o) != 0) bad = 1;
    } else if (rc) {
      printf("step %" PRIu64 ": FAILED: %s\n", ck[i].step, why);
    } else {
      printf("step %" PRIu64 ": ok\n", ck[i].step);
    }
  }
  if (a->json && print_json(arr)) bad = 1;
  if (ck != &one) amber_free(ck);
  amber_store_close(st);
  return bad;
}

/* ---- compact, prune ----------------------------------------------------------- */

/* Opens an existing store for writing (takes the writer lock). */
static int open_store_rw(const char *path, amber_store **st) {
  return open_existing(path, 0, st);
}

/* One global step's entry of amber_global_list; 0 when found. */
static int global_step_info(const char *path, uint64_t step, amber_global_step_info *out) {
  amber_global_step_info *gs = NULL;
  size_t n = 0;
  int rc = amber_global_list(path, &gs, &n);
  if (rc) return rc;
  rc = AMBER_ENOENT;
  for (size_t i = 0; i < n; i++)
    if (step == AMBER_LATEST ? i + 1 == n : gs[i].step == step) *out = gs[i], rc = 0;
  amber_free(gs);
  return rc;
}

/* compact of a multi-rank store: every rank's file of the step becomes full. */
static int global_compact(const args *a) {
  amber_global_step_info before, after;
  uint64_t step = a->have_step ? a->step : AMBER_LATEST;
  int rc = global_step_info(a->pos[0], step, &before);
  if (rc == AMBER_ENOENT && a->have_step) {
    fprintf(stderr, "amber: multi-rank store %s has no global step %" PRIu64 "\n", a->pos[0],
            a->step);
    return 1;
  }
  if (rc == AMBER_ENOENT) {
    fprintf(stderr, "amber: multi-rank store %s has no committed global step\n", a->pos[0]);
    return 1;
  }
  if (rc) return fail(rc, NULL, "cannot list multi-rank store %s", a->pos[0]);
  step = before.step;
  double t0 = now();
  size_t files = 0;
  progress_begin("compact step %" PRIu64 ", rank by rank", step);
  rc = amber_global_compact(a->pos[0], step, &files);
  progress_end();
  if (rc)
    return fail(rc, NULL, "cannot compact step %" PRIu64 " of %s", step, a->pos[0]), 1;
  double secs = now() - t0;
  if ((rc = global_step_info(a->pos[0], step, &after)) != 0)
    return fail(rc, NULL, "cannot list multi-rank store %s", a->pos[0]), 1;
  if (a->json)
    return print_json(json_pack("{s:o,s:s,s:s,s:o,s:o,s:I,s:I,s:f}", "step", ju64(step), "was",
                                kind_name(before.kind), "kind", kind_name(after.kind),
                                "bytes_before", ju64(before.bytes), "bytes", ju64(after.bytes),
                                "world_size", (json_int_t)after.world_size, "rank_files",
                                (json_int_t)files, "seconds", secs));
  char b0[32], b1[32];
  printf("step %" PRIu64 ": %s (%s) -> %s (%s), %zu of %u rank files rewritten, in %.2f s\n",
         step, kind_name(before.kind), human_bytes(before.bytes, b0), kind_name(after.kind),
         human_bytes(after.bytes, b1), files, after.world_size, secs);
  return 0;
}

static int cmd_compact(const args *a) {
  if (amber_global_is_store(a->pos[0])) return global_compact(a);
  amber_store *st = NULL;
  if (open_store_rw(a->pos[0], &st)) return 1;
  uint64_t step = a->step;
  int rc = a->have_step ? 0 : amber_store_latest(st, &step);
  if (rc) {
    amber_store_close(st);
    return fail(rc, st, "cannot find the latest step of %s", a->pos[0]);
  }
  amber_ckpt_info before, after;
  committed_info(st, step, &before);
  double t0 = now();
  progress_begin("compact step %" PRIu64, step);
  rc = amber_store_compact(st, step);
  progress_end();
  if (rc) {
    int ret = fail(rc, st, "cannot compact step %" PRIu64 " of %s", step, a->pos[0]);
    amber_store_close(st);
    return ret;
  }
  committed_info(st, step, &after);
  double secs = now() - t0;
  int ret = 0;
  if (a->json) {
    ret = print_json(json_pack("{s:o,s:s,s:s,s:o,s:o,s:f}", "step", ju64(step), "was",
                               kind_name(before.kind), "kind", kind_name(after.kind),
                               "bytes_before", ju64(before.bytes), "bytes", ju64(after.bytes),
                               "seconds", secs));
  } else {
    char b0[32], b1[32];
    printf("step %" PRIu64 ": %s (%s) -> %s (%s) in %.2f s\n", step, kind_name(before.kind),
           human_bytes(before.bytes, b0), kind_name(after.kind), human_bytes(after.bytes, b1),
           secs);
  }
  amber_store_close(st);
  return ret;
}

/* An s3:// store: what interrupted uploads left, older than --grace (default an
 * hour, so that a running drain's uploads in flight are left alone). */
static int prune_sweep(const args *a, size_t *swept) {
  *swept = 0;
  if (!is_url(a->pos[0])) return 0;
  int rc = amber_store_sweep(a->pos[0], a->have_grace ? a->grace : 3600, swept);
  return rc ? fail(rc, NULL, "cannot sweep %s", a->pos[0]) : 0;
}

static int cmd_prune(const args *a) {
  size_t swept = 0;
  if (amber_global_is_store(a->pos[0])) {
    size_t removed = 0;
    int rc = amber_global_prune(a->pos[0], a->keep_last, &removed);
    if (rc) return fail(rc, NULL, "cannot prune %s", a->pos[0]), 1;
    if (prune_sweep(a, &swept)) return 1;
    if (a->json)
      return print_json(json_pack("{s:o,s:o}", "removed", ju64(removed), "swept", ju64(swept)));
    printf("removed %zu global step%s", removed, removed == 1 ? "" : "s");
    if (is_url(a->pos[0])) printf(", swept %zu leftover%s", swept, swept == 1 ? "" : "s");
    printf("\n");
    return 0;
  }
  amber_store *st = NULL;
  if (open_store_rw(a->pos[0], &st)) return 1;
  size_t removed = 0;
  int rc = amber_store_prune(st, a->keep_last, &removed);
  if (rc) {
    int ret = fail(rc, st, "cannot prune %s", a->pos[0]);
    amber_store_close(st);
    return ret;
  }
  amber_ckpt_info *ck = NULL;
  size_t n = 0;
  amber_store_list(st, &ck, &n);
  int ret = prune_sweep(a, &swept);
  if (ret)
    ;
  else if (a->json)
    ret = print_json(json_pack("{s:o,s:o,s:o}", "removed", ju64(removed), "kept", ju64(n),
                               "swept", ju64(swept)));
  else if (is_url(a->pos[0]))
    printf("removed %zu checkpoint%s, kept %zu, swept %zu leftover%s\n", removed,
           removed == 1 ? "" : "s", n, swept, swept == 1 ? "" : "s");
  else
    printf("removed %zu checkpoint%s, kept %zu\n", removed, removed == 1 ? "" : "s", n);
  amber_free(ck);
  amber_store_close(st);
  return ret;
}

/* ---- drain ------------------------------------------------------------------------ */

/* Finishes the drain of a memory tier (what a crashed job left): every committed step
 * copied to the durable tier, pointers last, and the memory tier kept to what its
 * newest step needs. */
static int cmd_drain(const args *a) {
  const char *mem = a->pos[0];
  char *recorded = NULL;
  const char *durable = a->npos > 1 ? a->pos[1] : NULL;
  struct stat sb;
  if (stat(mem, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
    fprintf(stderr, "amber: no memory tier at %s\n", mem);
    return 1;
  }
  if (!durable) {
    int rc = amber_tier_durable(mem, &recorded);
    if (rc == AMBER_ENOENT) {
      fprintf(stderr, "amber: %s records no durable tier (no TIERS file): give it, as in "
                      "amber drain %s DURABLE\n", mem, mem);
      return 1;
    }
    if (rc) return fail(rc, NULL, "cannot read the durable tier of %s", mem);
    durable = recorded;
  }
  double t0 = now();
  progress_begin("drain %s to %s", mem, durable);
  int rc = amber_drain_run(mem, durable, NULL);
  progress_end();
  double secs = now() - t0;
  int ret = 0;
  if (rc) {
    ret = fail(rc, NULL, "cannot drain %s", mem);
  } else {
    /* Where the durable tier stands now. */
    uint64_t step = AMBER_NO_STEP;
    if (amber_global_is_store(durable)) {
      amber_global_step_info *gs = NULL;
      size_t n = 0;
      if (amber_global_list(durable, &gs, &n) == 0 && n) step = gs[n - 1].step;
      amber_free(gs);
    } else {
      amber_store *st = NULL;
      amber_store_opts so;
      amber_store_opts_init(&so);
      so.flags = AMBER_OPEN_READONLY;
      if (amber_store_open(&st, durable, &so) == 0 && amber_store_latest(st, &step) != 0)
        step = AMBER_NO_STEP;
      amber_store_close(st);
    }
    if (a->json)
      ret = print_json(json_pack("{s:s,s:s,s:o,s:f}", "memory", mem, "durable", durable,
                                 "durable_step", jstep_or_null(step), "seconds", secs));
    else if (step == AMBER_NO_STEP)
      printf("%s: nothing committed to drain (durable tier %s)\n", mem, durable);
    else
      printf("%s: every committed step is durable in %s (its latest: step %" PRIu64
             "), in %.2f s\n", mem, durable, step, secs);
  }
  free(recorded);
  return ret;
}

/* ---- main --------------------------------------------------------------------- */

static const command commands[] = {
    {"import", cmd_import, OPT_STEP | OPT_POLICY | OPT_FULL | OPT_CHUNK | OPT_JSON, 2, 0,
     OPT_STEP, "FILE.safetensors STORE --step N [--policy SPEC]... [--full] [--json]",
     "Adds step N to STORE (created if missing) from a safetensors file: a full "
     "checkpoint\n"
     "for an empty store or with --full, else the library chooses full or delta.\n"
     "  --step N           the step; must be greater than the store's latest\n"
     "  --policy SPEC      [PATTERN=]exact|threshold:ABS[:REL][/SHARE:MULT]|"
     "budget:FRAC[:CAP],\n"
     "                     optionally @q8|@q4|@bf16[+lead]; repeatable,\n"
     "                     the last matching pattern wins\n"
     "  --full             force a full checkpoint\n"
     "  --chunk-elems N    elements per chunk (default: the library's)\n"
     "  --json             print the summary as a JSON object\n"},
    {"export", cmd_export, OPT_STEP | OPT_OUT | OPT_JSON, 1, 0, OPT_OUT,
     "STORE -o OUT.safetensors [--step N] [--json]",
     "Writes the restored state of step N (default: latest) as a safetensors file.\n"
     "OUT is replaced atomically: a failed export leaves no partial file.\n"
     "  -o, --output FILE  the safetensors file to write\n"
     "  --step N           the step (default: the latest)\n"
     "  --json             print the summary as a JSON object\n"},
    {"ls", cmd_ls, OPT_JSON, 1, 0, 0, "STORE [--json]",
     "Lists the committed checkpoints: step, kind, parent, bytes, hash. A file whose\n"
     "header or footer is damaged is listed as damaged (amber verify says why). For a\n"
     "memory tier (its TIERS file records a durable tier), the durable tier's steps\n"
     "too, and a column tiers: memory, durable or memory,durable.\n"
     "  --json             an array of {step, kind, parent, bytes, hash, damaged}, with\n"
     "                     \"tiers\": [\"memory\", \"durable\"] for a memory tier\n"},
    {"info", cmd_info, OPT_STEP | OPT_JSON, 1, 0, 0, "STORE [--step N] [--json]",
     "Describes one checkpoint and its tensors: dtype, shape, policy, stored bytes and\n"
     "the share of elements stored.\n"
     "  --step N           the step (default: the latest)\n"
     "  --json             a JSON object with a \"tensors\" array\n"},
    {"verify", cmd_verify, OPT_STEP | OPT_JSON, 1, 0, 0, "STORE [--step N] [--json]",
     "Checks every checksum, link and chunk that restoring each step (default: all\n"
     "committed steps) needs. Exit status 0 only if all are intact.\n"
     "  --step N           only this step\n"
     "  --json             an array of {step, ok, error}\n"},
    {"compact", cmd_compact, OPT_STEP | OPT_JSON, 1, 0, 0, "STORE [--step N] [--json]",
     "Rewrites step N (default: the latest) as a full checkpoint that restores exactly\n"
     "the same state, after verifying it. Later deltas stay valid; a crash leaves the old\n"
     "or the new file. Bounds restore time and the damage of a lost file.\n"
     "  --step N           the step (default: the latest)\n"
     "  --json             print the result as a JSON object\n"},
    {"prune", cmd_prune, OPT_KEEP | OPT_GRACE | OPT_JSON, 1, 0, OPT_KEEP,
     "STORE --keep-last K [--grace SECONDS] [--json]",
     "Deletes old checkpoints, keeping the newest K and every checkpoint their restores\n"
     "need (their chains back to a full checkpoint). An s3:// store also loses what\n"
     "interrupted uploads left and no pointer reaches (unfinished multipart uploads,\n"
     "checkpoint objects after LATEST, manifests after GLOBAL) once older than the grace\n"
     "period, since a running drain's uploads look the same until its pointer moves.\n"
     "  --keep-last K      how many of the newest checkpoints to keep (>= 1)\n"
     "  --grace SECONDS    s3:// only: leave leftovers younger than this (default 3600)\n"
     "  --json             print {removed, kept, swept}\n"},
    {"drain", cmd_drain, OPT_JSON, 1, 1, 0, "MEMDIR [DURABLE] [--json]",
     "Finishes the drain of a memory tier (a store on a memory file system, such as\n"
     "/dev/shm/RUN, that a job checkpoints into) to its durable tier: copies every\n"
     "committed step the durable tier lacks, in commit order, each step's files first\n"
     "and its pointer last (multi-rank: each manifest, then GLOBAL, once every rank's\n"
     "files of it are there), then removes from MEMDIR the files that are durable and\n"
     "that its newest step does not need. Resumes what a crashed job's drain left;\n"
     "a crash of this command leaves both tiers intact, and running it again goes on.\n"
     "DURABLE defaults to the durable tier recorded in MEMDIR/TIERS (the job's drain\n"
     "records it). Exit status 0 once every committed step is durable.\n"
     "  --json             print {memory, durable, durable_step, seconds}\n"},
};
#define NCOMMANDS (sizeof commands / sizeof commands[0])

static void usage(FILE *f) {
  fprintf(f, "usage: amber COMMAND [ARGS]   (amber COMMAND --help for details)\n\n"
             "Incremental checkpoints of training state.\n\ncommands:\n");
  for (size_t i = 0; i < NCOMMANDS; i++)
    fprintf(f, "  amber %s %s\n", commands[i].name, commands[i].synopsis);
  fprintf(f, "  amber bench [--full] [...]   (the benchmark, see amber bench --help)\n"
             "\n  amber --version\n\nexit status: 0 success, 1 failure, 2 usage error\n");
}

static int short_usage(void) {
  fprintf(stderr, "usage: amber {import|export|ls|info|verify|compact|prune|drain|bench} "
                  "ARGS...\n"
                  "Try 'amber --help'.\n");
  return 2;
}

int main(int argc, char **argv) {
  progress_init();
  if (argc < 2) return short_usage();
  if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
    usage(stdout);
    return 0;
  }
  if (!strcmp(argv[1], "--version")) {
    printf("amber %s (file format %d.%d)\n", amber_version_string(), AMBER_FORMAT_MAJOR,
           AMBER_FORMAT_MINOR);
    return 0;
  }
  if (!strcmp(argv[1], "bench")) return amber__bench_main(argc - 1, argv + 1);
  const command *c = NULL;
  for (size_t i = 0; i < NCOMMANDS && !c; i++)
    if (!strcmp(argv[1], commands[i].name)) c = &commands[i];
  if (!c) {
    fprintf(stderr, "amber: unknown command '%s'\n", argv[1]);
    return short_usage();
  }
  args a;
  memset(&a, 0, sizeof a);
  a.policies = malloc((size_t)argc * sizeof *a.policies);
  if (!a.policies) {
    fprintf(stderr, "amber: out of memory\n");
    return 1;
  }
  int ret = parse_args(c, argc - 1, argv + 1, &a);
  if (ret < 0) ret = c->run(&a);
  free(a.policies);
  return ret;
}

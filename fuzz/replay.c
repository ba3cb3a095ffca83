/*
 * replay.c - a main() for fuzz targets built as plain tests: it feeds every file of
 * the given corpus directories (or files) to LLVMFuzzerTestOneInput once. Built
 * with gcc and the sanitizers, this turns the committed corpus into a regression
 * test without needing libFuzzer.
 */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int run_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    perror(path);
    return 1;
  }
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  uint8_t *buf = malloc(n > 0 ? (size_t)n : 1);
  size_t got = (buf && n > 0) ? fread(buf, 1, (size_t)n, f) : 0;
  fclose(f);
  if (!buf || got != (size_t)(n > 0 ? n : 0)) {
    fprintf(stderr, "%s: read failed\n", path);
    free(buf);
    return 1;
  }
  LLVMFuzzerTestOneInput(buf, got);
  free(buf);
  return 0;
}

int main(int argc, char **argv) {
  int files = 0, bad = 0;
  for (int i = 1; i < argc; i++) {
    struct stat sb;
    if (stat(argv[i], &sb) != 0) {
      perror(argv[i]);
      return 1;
    }
    if (!S_ISDIR(sb.st_mode)) {
      bad += run_file(argv[i]);
      files++;
      continue;
    }
    DIR *d = opendir(argv[i]);
    struct dirent *e;
    while (d && (e = readdir(d))) {
      if (e->d_name[0] == '.') continue;
      char p[4096];
      snprintf(p, sizeof p, "%s/%s", argv[i], e->d_name);
      bad += run_file(p);
      files++;
    }
    if (d) closedir(d);
  }
  if (files == 0) {
    fprintf(stderr, "replay: no corpus files found\n");
    return 1;
  }
  printf("replayed %d corpus files\n%d passed, %d failed\n", files, files - bad, bad);
  return bad ? 1 : 0;
}

/*
 * save_stats.h - internal: where the time of the writer's last save went, kept by
 * src/writer.c and published by amber_writer_save_stats (src/stats.c).
 */
#ifndef AMBER_SAVE_STATS_H
#define AMBER_SAVE_STATS_H

#include <stdint.h>

#include "internal.h"

/* Where the time of the writer's last save went (for `amber bench`). */
typedef struct amber__save_stats {
  int delta, workers;
  uint64_t bytes;     /* file size */
  double prepare_s;   /* deciding full/delta, loading the reference if needed */
  double chunks_s;    /* wall time of the parallel scan/encode/append loop */
  double scan_cpu_s;  /* summed over workers */
  double encode_cpu_s;
  double finish_s;    /* last writes and fsync of the file */
  double commit_s;    /* rename, directory fsync, LATEST */
  double total_s;
} amber__save_stats;
void amber__writer_stats(const amber_writer *w, amber__save_stats *out);

#endif /* AMBER_SAVE_STATS_H */

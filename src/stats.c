/*
 * stats.c - amber_writer_save_stats: the public view of the figures the writer
 * keeps about its last save (amber__save_stats, filled in src/writer.c). The
 * public struct is fixed (reserved fields for growth); the internal one may
 * change with the writer, so the fields are copied one by one.
 */
#include "internal.h"
#include "save_stats.h"

int amber_writer_save_stats(const amber_writer *w, amber_save_stats *out) {
  if (!w || !out)
    return amber__fail(NULL, AMBER_EINVAL, "amber_writer_save_stats: NULL argument");
  amber__save_stats s;
  amber__writer_stats(w, &s);
  memset(out, 0, sizeof *out);
  out->kind = s.delta ? AMBER_KIND_DELTA : AMBER_KIND_FULL;
  out->workers = (uint32_t)s.workers;
  out->bytes = s.bytes;
  out->prepare_s = s.prepare_s;
  out->chunks_s = s.chunks_s;
  out->scan_cpu_s = s.scan_cpu_s;
  out->encode_cpu_s = s.encode_cpu_s;
  out->finish_s = s.finish_s;
  out->commit_s = s.commit_s;
  out->total_s = s.total_s;
  return 0;
}

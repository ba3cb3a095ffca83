/*
 * writer.h - internal: what the library's other files ask of an amber_writer
 * beyond the public API (src/writer.c).
 */
#ifndef AMBER_WRITER_H
#define AMBER_WRITER_H

#include <stddef.h>

#include "amber.h"

/* Tensor `index`'s policy rules match `name` instead of its own name (copied; NULL:
 * its own again). The global writer names a rank's second and later boxes of a
 * global tensor otherwise in its file (amber__box_file_name), and a rule names
 * the global tensor. Not during a save (AMBER_EBUSY). */
int amber__writer_match_as(amber_writer *w, size_t index, const char *name);

#endif /* AMBER_WRITER_H */

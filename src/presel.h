/*
 * presel.h - internal: encoding a chunk of a pre-selected tensor (see
 * amber_writer_set_selection), whose selection the caller made, e.g. on a GPU.
 */
#ifndef AMBER_PRESEL_H
#define AMBER_PRESEL_H

#include <stdint.h>

#include "amber.h"
#include "chunk.h"

/* Checks chunk `j`'s selection `sel` (indices strictly increasing, each below
 * src->n) and appends it as UNCHANGED, SPARSE or, for AMBER_SELECT_WHOLE, RAW.
 * A bad selection fails the file (amber__ckpt_fail: AMBER_EINVAL naming the
 * tensor, the chunk and the index), so nothing of the save is committed. */
void amber__chunk_presel(amber__scratch *s, const amber__chunk_src *src,
                         const amber_chunk_sel *sel, uint64_t j, amber__chunk *c);

#endif

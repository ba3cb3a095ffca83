/*
 * names.h - internal: hash table from tensor names to positions (see names.c).
 */
#ifndef AMBER_NAMES_H
#define AMBER_NAMES_H

#include <stddef.h>
#include <stdint.h>

#include "internal.h"

/* Gives the name (and its length) of the entry at `pos`. */
typedef const char *(*amber__name_fn)(const void *ctx, size_t pos, size_t *len);

typedef struct amber__names {
  uint64_t *hash; /* 0: empty slot */
  size_t *pos;
  size_t cap, n;
} amber__names;

/* Position of `name`, or -1. */
long amber__names_find(const amber__names *h, const char *name, size_t len,
                       amber__name_fn name_of, const void *ctx);
/* Adds name -> pos: 0, 1 if the name is already there, -1 out of memory. */
int amber__names_insert(amber__names *h, const char *name, size_t len, size_t pos,
                        amber__name_fn name_of, const void *ctx);
void amber__names_free(amber__names *h);

#endif

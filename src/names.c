/*
 * names.c - a small open-addressing hash table from tensor names to positions,
 * so that declaring and finding tensors stays linear for states of tens of
 * thousands of tensors. It stores positions only; the caller owns the names and
 * gives them back through a callback when comparing.
 */
#include <stdlib.h>
#include <string.h>

#include "names.h"

static uint64_t hash_name(const char *s, size_t len) {
  return amber__xxh3(s, len) | 1; /* 0 marks an empty slot */
}

void amber__names_free(amber__names *h) {
  free(h->hash);
  free(h->pos);
  memset(h, 0, sizeof *h);
}

static size_t find_slot(const amber__names *h, const char *name, size_t len, uint64_t hv,
                        amber__name_fn name_of, const void *ctx, int *found) {
  size_t mask = h->cap - 1, i = (size_t)hv & mask;
  for (;; i = (i + 1) & mask) {
    if (h->hash[i] == 0) {
      *found = 0;
      return i;
    }
    if (h->hash[i] == hv) {
      size_t l;
      const char *other = name_of(ctx, h->pos[i], &l);
      if (l == len && !memcmp(other, name, len)) {
        *found = 1;
        return i;
      }
    }
  }
}

long amber__names_find(const amber__names *h, const char *name, size_t len,
                       amber__name_fn name_of, const void *ctx) {
  if (!h->cap) return -1;
  int found;
  size_t i = find_slot(h, name, len, hash_name(name, len), name_of, ctx, &found);
  return found ? (long)h->pos[i] : -1;
}

static int grow(amber__names *h, amber__name_fn name_of, const void *ctx) {
  amber__names bigger = {0};
  bigger.cap = h->cap ? 2 * h->cap : 64;
  bigger.hash = calloc(bigger.cap, sizeof *bigger.hash);
  bigger.pos = malloc(bigger.cap * sizeof *bigger.pos);
  if (!bigger.hash || !bigger.pos) {
    amber__names_free(&bigger);
    return -1;
  }
  for (size_t i = 0; i < h->cap; i++) {
    if (!h->hash[i]) continue;
    int found;
    size_t len;
    const char *nm = name_of(ctx, h->pos[i], &len);
    size_t j = find_slot(&bigger, nm, len, h->hash[i], name_of, ctx, &found);
    bigger.hash[j] = h->hash[i];
    bigger.pos[j] = h->pos[i];
  }
  bigger.n = h->n;
  amber__names_free(h);
  *h = bigger;
  return 0;
}

int amber__names_insert(amber__names *h, const char *name, size_t len, size_t pos,
                        amber__name_fn name_of, const void *ctx) {
  if ((h->n + 1) * 2 > h->cap && grow(h, name_of, ctx) != 0) return -1;
  int found;
  uint64_t hv = hash_name(name, len);
  size_t i = find_slot(h, name, len, hv, name_of, ctx, &found);
  if (found) return 1;
  h->hash[i] = hv;
  h->pos[i] = pos;
  h->n++;
  return 0;
}

/*
 * dtype.c - the dtype table: each amber_dtype's name and element size, the one
 * place that maps between them (include/amber.h, "Data types"). The values are
 * stored on disk (docs/FORMAT.md), so the table is indexed by them.
 */
#include <string.h>

#include "internal.h"

static const struct {
  const char *name;
  size_t size;
} dtypes[] = {
    [AMBER_F32] = {"f32", 4},          [AMBER_F16] = {"f16", 2},
    [AMBER_BF16] = {"bf16", 2},        [AMBER_F64] = {"f64", 8},
    [AMBER_F8_E4M3] = {"f8_e4m3", 1}, [AMBER_F8_E5M2] = {"f8_e5m2", 1},
    [AMBER_I64] = {"i64", 8},          [AMBER_I32] = {"i32", 4},
    [AMBER_I16] = {"i16", 2},          [AMBER_I8] = {"i8", 1},
    [AMBER_U8] = {"u8", 1},            [AMBER_BOOL] = {"bool", 1},
    [AMBER_U16] = {"u16", 2},          [AMBER_U32] = {"u32", 4},
    [AMBER_U64] = {"u64", 8},
};
#define NDTYPES ((int)(sizeof dtypes / sizeof dtypes[0]))

size_t amber_dtype_size(int dt) {
  return (dt > 0 && dt < NDTYPES) ? dtypes[dt].size : 0;
}

const char *amber_dtype_name(int dt) {
  return (dt > 0 && dt < NDTYPES) ? dtypes[dt].name : NULL;
}

int amber_dtype_from_name(const char *name) {
  if (!name) return 0;
  for (int i = 1; i < NDTYPES; i++)
    if (!strcmp(dtypes[i].name, name)) return i;
  return 0;
}

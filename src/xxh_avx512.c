/* xxh_avx512.c - XXH3 compiled for AVX-512 (this file alone built with -mavx512f):
 * xxh_wide.h. */
#define XXH_WIDE_NAME(base) base##_avx512
#include "xxh_wide.h"

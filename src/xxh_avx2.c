/* xxh_avx2.c - XXH3 compiled for AVX2 (this file alone built with -mavx2): xxh_wide.h. */
#define XXH_WIDE_NAME(base) base##_avx2
#include "xxh_wide.h"

/*
 * half.h - internal: the conversions between f32 and the 16-bit floats (IEEE
 * binary16 and bfloat16) that the scan, the quantizer and the decoder share.
 * Widening is exact; narrowing rounds to nearest, ties to even, as PyTorch's
 * .half() / .bfloat16() and CUDA's __float2half_rn do, so that a quantized delta
 * of a 16-bit tensor restores the same bits on every implementation. NaN
 * narrows to a quiet NaN of the same sign.
 */
#ifndef AMBER_HALF_H
#define AMBER_HALF_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define AMBER__EXP32 0x7f800000u

static inline float amber__bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint32_t amber__f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static inline float amber__f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0x1f) return amber__bits_f32(sign | AMBER__EXP32 | (man << 13)); /* Inf / NaN */
  if (exp == 0) {
    float v = (float)man * 5.9604644775390625e-8f; /* subnormal: man * 2^-24, exact */
    return sign ? -v : v;
  }
  return amber__bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

static inline float amber__bf16_to_f32(uint16_t h) {
  return amber__bits_f32((uint32_t)h << 16);
}

static inline uint16_t amber__f32_to_bf16(float f) {
  uint32_t u = amber__f32_bits(f);
  if ((u & 0x7fffffffu) > AMBER__EXP32) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

static inline uint16_t amber__f32_to_f16(float f) {
  uint32_t u = amber__f32_bits(f), sign = (u >> 16) & 0x8000, a = u & 0x7fffffffu;
  if (a > AMBER__EXP32) return (uint16_t)(sign | 0x7e00 | ((a >> 13) & 0x3ff)); /* NaN */
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* rounds to Inf (or is Inf) */
  if (a < 0x38800000u) { /* below 2^-14: a subnormal f16 in units of 2^-24, or zero */
    /* the scaling by 2^24 is exact; nearbyintf rounds ties to even */
    return (uint16_t)(sign | (uint32_t)nearbyintf(amber__bits_f32(a) * 0x1p24f));
  }
  uint32_t r = a - 0x38000000u; /* rebias the exponent from 127 to 15 */
  r += 0xfffu + ((r >> 13) & 1);
  return (uint16_t)(sign | (r >> 13));
}

#endif /* AMBER_HALF_H */

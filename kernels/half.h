// IEEE 754 binary16 conversion, identical on host and device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/hd.h"

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

namespace turbokv {

TURBOKV_HD uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

// The index of the first inf or NaN of x[0, n) (the f32 patterns with every
// exponent bit set), or n when there is none: SIMD on every target
// (kernels/cpu/simd_codec.cc), since every request's tensors pass through it.
size_t FirstNonFinite(const float* x, size_t n);

// Over finite x[0, n) cut into blocks of `block` > 0 values (n a multiple
// of it): the largest |x| and, when largest_block_square is not null, the
// largest sum of squares of a block. SIMD on every target, for the checks
// that every appended value fits its codec; the sums are added in an order
// of the target's, so a caller deciding at a bound leaves itself a margin.
void LargestMagnitudes(const float* x, size_t n, size_t block, float* largest, float* largest_block_square);

TURBOKV_HD float BitsToFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// Largest finite fp16 value.
constexpr float kHalfMax = 65504.0f;
// Smallest normal fp16 value, 2^-14: below it fp16 values are subnormal.
constexpr float kHalfMinNormal = 6.103515625e-05f;

// Rounds to nearest, ties to even, like F16C's vcvtps2ph and CUDA's
// __float2half_rn, except that values beyond the fp16 range (infinities too)
// saturate to +-65504: a stored cache entry is always finite. NaN maps to a
// quiet NaN.
TURBOKV_HD uint16_t FloatToHalfBits(float f) {
  const uint32_t x = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  // 65520 and above would round to infinity.
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7bffu);
  if (ax < 0x38800000u) {  // below 2^-14: an fp16 subnormal or zero
    if (ax <= 0x33000000u) return sign;  // at most 2^-25: ties to even zero
    const uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - (ax >> 23);  // 14..24
    uint32_t r = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  const uint32_t rebased = ax - 0x38000000u;  // exponent bias 127 -> 15
  uint32_t h = rebased >> 13;
  const uint32_t rem = rebased & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

// Exact (every binary16 is a float): the GPU's conversion instruction gives
// the same float as the bit manipulation below, in one instruction.
TURBOKV_HD float HalfBitsToFloat(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24, exact in float.
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  if (exp == 31) return BitsToFloat(sign | 0x7f800000u | (mant << 13));
  return BitsToFloat(sign | ((exp + 112u) << 23) | (mant << 13));
#endif
}

// Little-endian load and store of an fp16 field at any byte offset.
TURBOKV_HD uint16_t LoadHalfBits(const uint8_t* p) {
  return static_cast<uint16_t>(p[0] | (p[1] << 8));
}
TURBOKV_HD void StoreHalfBits(uint8_t* p, uint16_t h) {
  p[0] = static_cast<uint8_t>(h & 0xff);
  p[1] = static_cast<uint8_t>(h >> 8);
}

}  // namespace turbokv

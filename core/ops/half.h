// float16 / bfloat16 <-> float32 conversions, bit-exact and branch-light, for
// host and device. Rounding is to nearest, ties to even; NaN stays NaN, made
// quiet with its payload truncated, exactly as the F16C instructions do.
#pragma once

#include <cstdint>
#include <cstring>

#include "host_device.h"

namespace embedcore::ops {

EMBEDCORE_HD uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
EMBEDCORE_HD float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

EMBEDCORE_HD float BFloat16ToFloat(uint16_t h) { return BitsFloat(uint32_t(h) << 16); }

EMBEDCORE_HD uint16_t FloatToBFloat16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

EMBEDCORE_HD float HalfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu)  // inf, or NaN made quiet with its payload kept (as F16C's vcvtph2ps does)
    return BitsFloat(sign | 0x7f800000u | (mant ? 0x400000u : 0u) | (mant << 13));
  if (exp != 0) return BitsFloat(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return BitsFloat(sign);
  // Subnormal half: mant * 2^-24, exact in float.
  float v = float(mant) * 5.9604644775390625e-08f;
  return sign ? -v : v;
}

EMBEDCORE_HD uint16_t FloatToHalf(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // quiet NaN, payload kept (as F16C)
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);           // overflow -> inf
  if (a >= 0x38800000u) {                                          // normal half
    uint32_t r = a - 0x38000000u;                                  // rebias 127 -> 15
    r += 0xfffu + ((r >> 13) & 1u);                                // round to nearest even
    return uint16_t(sign | (r >> 13));
  }
  if (a < 0x33000000u) return sign;                                // below half of min subnormal
  // Subnormal half: shift the 24-bit significand, rounding to nearest even.
  const uint32_t e = a >> 23;
  const uint32_t m = (a & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - e;  // 14..24
  uint32_t r = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (r & 1u))) ++r;
  return uint16_t(sign | r);
}

/// Storage element types, and their conversions to and from float32.
struct F16 {
  uint16_t bits;
};
struct BF16 {
  uint16_t bits;
};

EMBEDCORE_HD float ToFloat(float v) { return v; }
EMBEDCORE_HD float ToFloat(F16 v) { return HalfToFloat(v.bits); }
EMBEDCORE_HD float ToFloat(BF16 v) { return BFloat16ToFloat(v.bits); }

template <typename T>
EMBEDCORE_HD T FromFloat(float v);
template <>
EMBEDCORE_HD float FromFloat<float>(float v) {
  return v;
}
template <>
EMBEDCORE_HD F16 FromFloat<F16>(float v) {
  return F16{FloatToHalf(v)};
}
template <>
EMBEDCORE_HD BF16 FromFloat<BF16>(float v) {
  return BF16{FloatToBFloat16(v)};
}

}  // namespace embedcore::ops

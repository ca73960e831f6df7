// core/ops/half.h: float16 / bfloat16 <-> float32, bit-exact, round to
// nearest even, subnormals, inf and NaN. The references here are written
// independently (exact values in double, nearest candidate by distance), and
// on a CPU with F16C the half conversions are also checked against the
// hardware's.
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define EMBEDCORE_TEST_HAVE_F16C 1
#endif

#include "kernels.h"
#include "ops/half.h"
#include "test_util.h"

namespace ops = embedcore::ops;
using embedcore_test::Bits;

namespace {

float FromBits(uint32_t u) { return ops::BitsFloat(u); }

// ------------------------------------------------------------ references
// The exact value of a finite half, computed from its fields in double.
double HalfValue(uint16_t h) {
  const int e = (h >> 10) & 0x1f;
  const int m = h & 0x3ff;
  const double v = e == 0 ? std::ldexp(double(m), -24) : std::ldexp(double(1024 + m), e - 25);
  return (h & 0x8000) ? -v : v;
}

bool HalfIsNaN(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0; }

// Nearest half to a non-NaN float, ties to even, overflow to inf (IEEE 754).
uint16_t RefFloatToHalf(float f) {
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double a = std::fabs(double(f));
  // Rounded with an unbounded exponent, anything >= 65520 (the midpoint of
  // 65504 and 2^16) would be 2^16 or more: it overflows.
  if (a >= 65520.0) return sign | 0x7c00;
  // Largest positive half <= a, by bisection over the ordered patterns.
  uint16_t lo = 0, hi = 0x7bff;
  while (lo < hi) {
    const uint16_t mid = uint16_t((lo + hi + 1) / 2);
    if (HalfValue(mid) <= a) lo = mid; else hi = uint16_t(mid - 1);
  }
  if (HalfValue(lo) == a || lo == 0x7bff) return sign | lo;
  const uint16_t up = uint16_t(lo + 1);
  const double dlo = a - HalfValue(lo), dup = HalfValue(up) - a;
  if (dlo < dup) return sign | lo;
  if (dup < dlo) return sign | up;
  return sign | ((lo & 1) == 0 ? lo : up);
}

// Nearest bfloat16 to a non-NaN float, ties to even, overflow to inf.
uint16_t RefFloatToBFloat16(float f) {
  const uint32_t u = Bits(f);
  const uint32_t sign = u & 0x80000000u, a = u & 0x7fffffffu;
  if (a == 0x7f800000u) return uint16_t((sign | a) >> 16);
  const uint32_t lo = a & 0xffff0000u, up = lo + 0x10000u;
  auto value = [](uint32_t bits) {  // 0x7f800000 as the next binade, 2^128
    return bits == 0x7f800000u ? std::ldexp(1.0, 128) : double(FromBits(bits));
  };
  const double x = double(FromBits(a));
  const double dlo = x - value(lo), dup = value(up) - x;
  uint32_t r;
  if (dlo < dup) r = lo;
  else if (dup < dlo) r = up;
  else r = ((lo >> 16) & 1u) == 0 ? lo : up;
  return uint16_t((sign | r) >> 16);
}

#if EMBEDCORE_TEST_HAVE_F16C
bool HasF16C() { return embedcore::kernels::CpuHasF16c(); }  // (clang's builtin does not take "f16c")
__attribute__((target("f16c"))) float HardwareHalfToFloat(uint16_t h) { return _cvtsh_ss(h); }
__attribute__((target("f16c"))) uint16_t HardwareFloatToHalf(float f) {
  return uint16_t(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}
#endif

// The floats whose rounding to half is worth checking around half `h`
// (positive, finite): h itself, the float neighbours of h, the midpoint to
// the next half and the float neighbours of that midpoint.
std::vector<float> InterestingFloatsNear(uint16_t h) {
  std::vector<float> out;
  const float v = float(HalfValue(h));
  out.push_back(v);
  out.push_back(std::nextafter(v, 0.0f));
  out.push_back(std::nextafter(v, std::numeric_limits<float>::infinity()));
  if (h < 0x7bff) {
    const double mid = (HalfValue(h) + HalfValue(uint16_t(h + 1))) / 2;
    const float m = float(mid);  // exact: 12 significant bits fit in 24
    out.push_back(m);
    out.push_back(std::nextafter(m, 0.0f));
    out.push_back(std::nextafter(m, std::numeric_limits<float>::infinity()));
  }
  return out;
}

}  // namespace

// ------------------------------------------------------------ float16
EMBEDCORE_TEST(HalfToFloatExhaustive) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t h = uint16_t(i);
    const float f = ops::HalfToFloat(h);
    EMBEDCORE_EXPECT_EQ(std::signbit(f), (h & 0x8000) != 0);
    if (HalfIsNaN(h)) {
      EMBEDCORE_EXPECT_MSG(std::isnan(f), "half 0x" << std::hex << h);
    } else if ((h & 0x7fff) == 0x7c00) {
      EMBEDCORE_EXPECT_MSG(std::isinf(f), "half 0x" << std::hex << h);
    } else {
      EMBEDCORE_EXPECT_BITS_EQ(f, float(HalfValue(h)));
    }
  }
}

EMBEDCORE_TEST(HalfRoundTripExhaustive) {
  // Every half comes back unchanged; a NaN comes back quiet, sign and payload kept (as F16C does).
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t h = uint16_t(i);
    const uint16_t back = ops::FloatToHalf(ops::HalfToFloat(h));
    if (HalfIsNaN(h)) {
      EMBEDCORE_EXPECT_EQ(back, uint16_t(h | 0x0200));
    } else {
      EMBEDCORE_EXPECT_EQ(back, h);
    }
  }
}

EMBEDCORE_TEST(FloatToHalfAroundEveryHalf) {
  // For every positive finite half, the floats at, just below and just above
  // it and at, below and above the midpoint to the next half; both signs.
  for (uint32_t i = 0; i <= 0x7bff; ++i) {
    for (float f : InterestingFloatsNear(uint16_t(i))) {
      EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(f), RefFloatToHalf(f));
      EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(-f), RefFloatToHalf(-f));
    }
  }
}

EMBEDCORE_TEST(FloatToHalfRandomBits) {
  std::mt19937 rng(12345);
  for (int i = 0; i < 1 << 18; ++i) {
    const float f = FromBits(uint32_t(rng()));
    if (std::isnan(f)) continue;
    EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(f), RefFloatToHalf(f));
  }
  // And many in the half range, where the rounding is interesting.
  std::uniform_real_distribution<float> dist(-70000.0f, 70000.0f);
  std::uniform_int_distribution<int> scale(-30, 0);
  for (int i = 0; i < 1 << 18; ++i) {
    const float f = std::ldexp(dist(rng), scale(rng));
    EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(f), RefFloatToHalf(f));
  }
}

EMBEDCORE_TEST(FloatToHalfTiesToEven) {
  // Normal range: the tie goes to the even significand.
  EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(1.0f + 0x1p-11f), uint16_t(0x3c00));      // 1 | 1+2^-10
  EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(1.0f + 3 * 0x1p-11f), uint16_t(0x3c02));  // 1+2^-10 | 1+2^-9
  EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(2049.0f), uint16_t(0x6800));              // 2048 | 2050
  EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(2051.0f), uint16_t(0x6802));              // 2050 | 2052
  EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(-2049.0f), uint16_t(0xe800));
  // Just off the tie goes to the nearer one.
  EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(std::nextafter(2049.0f, 3000.0f)), uint16_t(0x6801));
  EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(std::nextafter(2051.0f, 0.0f)), uint16_t(0x6801));
  // Subnormal range (steps of 2^-24).
  EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(0x1p-25f), uint16_t(0x0000));         // 0 | 1: even is 0
  EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(3 * 0x1p-25f), uint16_t(0x0002));     // 1 | 2
  EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(5 * 0x1p-25f), uint16_t(0x0002));     // 2 | 3
  EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(std::nextafter(0x1p-25f, 1.0f)), uint16_t(0x0001));
  // The largest subnormal and the smallest normal, and the tie between them
  // (rounds up into the normal range).
  EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(1023 * 0x1p-24f), uint16_t(0x03ff));
  EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(0x1p-14f), uint16_t(0x0400));
  EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(1023.5f * 0x1p-24f), uint16_t(0x0400));
}

EMBEDCORE_TEST(FloatToHalfSubnormalsAndZero) {
  EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(0.0f), uint16_t(0x0000));
  EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(-0.0f), uint16_t(0x8000));
  EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(0x1p-24f), uint16_t(0x0001));  // smallest subnormal
  EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(-0x1p-24f), uint16_t(0x8001));
  EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(1e-30f), uint16_t(0x0000));   // underflows to +0
  EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(-1e-30f), uint16_t(0x8000));  // keeps its sign
  EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(std::numeric_limits<float>::denorm_min()), uint16_t(0x0000));
  EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(-std::numeric_limits<float>::denorm_min()), uint16_t(0x8000));
  EMBEDCORE_EXPECT_BITS_EQ(ops::HalfToFloat(0x0001), 0x1p-24f);
  EMBEDCORE_EXPECT_BITS_EQ(ops::HalfToFloat(0x03ff), 1023 * 0x1p-24f);
  EMBEDCORE_EXPECT_BITS_EQ(ops::HalfToFloat(0x8000), -0.0f);
}

EMBEDCORE_TEST(FloatToHalfOverflowInfNaN) {
  EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(65504.0f), uint16_t(0x7bff));  // the largest half
  EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(std::nextafter(65520.0f, 0.0f)), uint16_t(0x7bff));
  EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(65520.0f), uint16_t(0x7c00));  // the tie overflows
  EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(-65520.0f), uint16_t(0xfc00));
  EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(1e10f), uint16_t(0x7c00));
  EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(std::numeric_limits<float>::max()), uint16_t(0x7c00));
  EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(std::numeric_limits<float>::infinity()), uint16_t(0x7c00));
  EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(-std::numeric_limits<float>::infinity()), uint16_t(0xfc00));
  // Every NaN, quiet or signalling, becomes a quiet NaN of its sign with the
  // top 10 payload bits kept, as F16C's vcvtps2ph does.
  for (uint32_t payload : {0x1u, 0x2000u, 0x400000u, 0x7fffffu, 0x3fffffu}) {
    const uint16_t kept = uint16_t(0x7e00 | ((payload >> 13) & 0x3ff));
    EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(FromBits(0x7f800000u | payload)), kept);
    EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(FromBits(0xff800000u | payload)), uint16_t(0x8000 | kept));
  }
  EMBEDCORE_EXPECT(std::isinf(ops::HalfToFloat(0x7c00)) && ops::HalfToFloat(0x7c00) > 0);
  EMBEDCORE_EXPECT(std::isinf(ops::HalfToFloat(0xfc00)) && ops::HalfToFloat(0xfc00) < 0);
}

EMBEDCORE_TEST(HalfMatchesF16CHardware) {
#if EMBEDCORE_TEST_HAVE_F16C
  if (!HasF16C()) {
    std::printf("  (no F16C on this CPU: skipped)\n");
    return;
  }
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t h = uint16_t(i);
    if (HalfIsNaN(h)) continue;  // the hardware also quiets NaNs; payloads may differ
    EMBEDCORE_EXPECT_BITS_EQ(ops::HalfToFloat(h), HardwareHalfToFloat(h));
  }
  for (uint32_t i = 0; i <= 0x7bff; ++i) {
    for (float f : InterestingFloatsNear(uint16_t(i))) {
      EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(f), HardwareFloatToHalf(f));
      EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(-f), HardwareFloatToHalf(-f));
    }
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 1 << 20; ++i) {
    const float f = FromBits(uint32_t(rng()));
    if (std::isnan(f)) continue;
    EMBEDCORE_EXPECT_EQ(ops::FloatToHalf(f), HardwareFloatToHalf(f));
  }
#else
  std::printf("  (not an x86-64 GCC/Clang build: skipped)\n");
#endif
}

// ------------------------------------------------------------ bfloat16
EMBEDCORE_TEST(BFloat16ToFloatExhaustive) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const float f = ops::BFloat16ToFloat(uint16_t(i));
    EMBEDCORE_EXPECT_EQ(Bits(f), i << 16);
  }
}

EMBEDCORE_TEST(BFloat16RoundTripExhaustive) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t h = uint16_t(i);
    const uint16_t back = ops::FloatToBFloat16(ops::BFloat16ToFloat(h));
    const bool nan = (h & 0x7f80) == 0x7f80 && (h & 0x7f) != 0;
    // A signalling NaN comes back quiet, with its sign and payload.
    EMBEDCORE_EXPECT_EQ(back, nan ? uint16_t(h | 0x40) : h);
  }
}

EMBEDCORE_TEST(FloatToBFloat16ExhaustiveOverUpperBits) {
  // For every upper half (every bfloat16), the low halves that decide the
  // rounding: exact, just above, just below the tie, the tie, just above it,
  // the most below the next one; and some random ones.
  std::mt19937 rng(99);
  for (uint32_t hi = 0; hi < 65536; ++hi) {
    const uint32_t lows[] = {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu,
                             uint32_t(rng()) & 0xffffu, uint32_t(rng()) & 0xffffu};
    for (uint32_t low : lows) {
      const uint32_t u = (hi << 16) | low;
      const float f = FromBits(u);
      if (std::isnan(f)) {
        EMBEDCORE_EXPECT_EQ(ops::FloatToBFloat16(f), uint16_t((u >> 16) | 0x40));
      } else {
        EMBEDCORE_EXPECT_EQ(ops::FloatToBFloat16(f), RefFloatToBFloat16(f));
      }
    }
  }
}

EMBEDCORE_TEST(FloatToBFloat16Specials) {
  // Ties to even: 1 + 2^-8 is the midpoint of 1 (0x3f80) and 1 + 2^-7 (0x3f81).
  EMBEDCORE_EXPECT_EQ(ops::FloatToBFloat16(1.0f + 0x1p-8f), uint16_t(0x3f80));
  EMBEDCORE_EXPECT_EQ(ops::FloatToBFloat16(1.0f + 3 * 0x1p-8f), uint16_t(0x3f82));
  EMBEDCORE_EXPECT_EQ(ops::FloatToBFloat16(-(1.0f + 0x1p-8f)), uint16_t(0xbf80));
  // Overflow: the largest float rounds to inf; the largest bfloat16 stays.
  EMBEDCORE_EXPECT_EQ(ops::FloatToBFloat16(std::numeric_limits<float>::max()), uint16_t(0x7f80));
  EMBEDCORE_EXPECT_EQ(ops::FloatToBFloat16(FromBits(0x7f7f0000u)), uint16_t(0x7f7f));
  EMBEDCORE_EXPECT_EQ(ops::FloatToBFloat16(FromBits(0x7f7f7fffu)), uint16_t(0x7f7f));
  EMBEDCORE_EXPECT_EQ(ops::FloatToBFloat16(FromBits(0x7f7f8000u)), uint16_t(0x7f80));
  EMBEDCORE_EXPECT_EQ(ops::FloatToBFloat16(std::numeric_limits<float>::infinity()), uint16_t(0x7f80));
  EMBEDCORE_EXPECT_EQ(ops::FloatToBFloat16(-std::numeric_limits<float>::infinity()), uint16_t(0xff80));
  // Zeros and float subnormals (bfloat16 has float's exponent range).
  EMBEDCORE_EXPECT_EQ(ops::FloatToBFloat16(0.0f), uint16_t(0x0000));
  EMBEDCORE_EXPECT_EQ(ops::FloatToBFloat16(-0.0f), uint16_t(0x8000));
  EMBEDCORE_EXPECT_EQ(ops::FloatToBFloat16(FromBits(0x00010000u)), uint16_t(0x0001));
  EMBEDCORE_EXPECT_EQ(ops::FloatToBFloat16(FromBits(0x00008000u)), uint16_t(0x0000));  // tie -> even 0
  EMBEDCORE_EXPECT_EQ(ops::FloatToBFloat16(FromBits(0x00018000u)), uint16_t(0x0002));  // tie -> even 2
  EMBEDCORE_EXPECT_EQ(ops::FloatToBFloat16(FromBits(0x007fffffu)), uint16_t(0x0080));  // up to the min normal
  // NaN stays NaN, quiet, with its sign; never inf.
  EMBEDCORE_EXPECT_EQ(ops::FloatToBFloat16(FromBits(0x7f800001u)), uint16_t(0x7fc0));
  EMBEDCORE_EXPECT_EQ(ops::FloatToBFloat16(FromBits(0xff800001u)), uint16_t(0xffc0));
  EMBEDCORE_EXPECT_EQ(ops::FloatToBFloat16(FromBits(0x7fffffffu)), uint16_t(0x7fff));
  EMBEDCORE_EXPECT_EQ(ops::FloatToBFloat16(std::numeric_limits<float>::quiet_NaN()), uint16_t(0x7fc0));
}

// ------------------------------------------------------------ element types
EMBEDCORE_TEST(ElementTypeWrappers) {
  EMBEDCORE_EXPECT_BITS_EQ(ops::ToFloat(1.5f), 1.5f);
  EMBEDCORE_EXPECT_BITS_EQ(ops::ToFloat(ops::F16{0x3e00}), 1.5f);
  EMBEDCORE_EXPECT_BITS_EQ(ops::ToFloat(ops::BF16{0x3fc0}), 1.5f);
  EMBEDCORE_EXPECT_BITS_EQ(ops::FromFloat<float>(-2.25f), -2.25f);
  EMBEDCORE_EXPECT_EQ(ops::FromFloat<ops::F16>(-2.25f).bits, uint16_t(0xc080));
  EMBEDCORE_EXPECT_EQ(ops::FromFloat<ops::BF16>(-2.25f).bits, uint16_t(0xc010));
  static_assert(sizeof(ops::F16) == 2 && sizeof(ops::BF16) == 2, "storage elements are 2 bytes");
}

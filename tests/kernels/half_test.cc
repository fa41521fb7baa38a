#include "kernels/half.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "hwy/targets.h"

namespace turbokv {
namespace {

TEST(HalfTest, EveryFiniteHalfRoundTrips) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7c00) == 0x7c00) continue;  // Inf and NaN
    const float f = HalfBitsToFloat(static_cast<uint16_t>(h));
    EXPECT_EQ(FloatToHalfBits(f), h) << "half bits " << h;
  }
}

TEST(HalfTest, MidpointsRoundToEven) {
  // Between consecutive positive finite halves a < b: the midpoint goes to the
  // one with an even mantissa, anything off the midpoint to the nearer one.
  for (uint32_t h = 0; h < 0x7bff; ++h) {
    const double a = HalfBitsToFloat(static_cast<uint16_t>(h));
    const double b = HalfBitsToFloat(static_cast<uint16_t>(h + 1));
    const float mid = static_cast<float>((a + b) / 2);  // exact in float
    const uint32_t even = (h & 1) ? h + 1 : h;
    ASSERT_EQ(FloatToHalfBits(mid), even) << "half bits " << h;
    EXPECT_EQ(FloatToHalfBits(std::nextafter(mid, 0.0f)), h);
    EXPECT_EQ(FloatToHalfBits(std::nextafter(mid, 1e9f)), h + 1);
    EXPECT_EQ(FloatToHalfBits(-mid), even | 0x8000u);
  }
}

TEST(HalfTest, SaturatesInsteadOfInfinity) {
  EXPECT_EQ(FloatToHalfBits(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToHalfBits(65519.0f), 0x7bff);
  EXPECT_EQ(FloatToHalfBits(65520.0f), 0x7bff);
  EXPECT_EQ(FloatToHalfBits(1e30f), 0x7bff);
  EXPECT_EQ(FloatToHalfBits(-1e30f), 0xfbff);
  EXPECT_EQ(FloatToHalfBits(std::numeric_limits<float>::max()), 0x7bff);
}

TEST(HalfTest, TinyValuesAndSignedZero) {
  EXPECT_EQ(FloatToHalfBits(0.0f), 0x0000);
  EXPECT_EQ(FloatToHalfBits(-0.0f), 0x8000);
  EXPECT_EQ(FloatToHalfBits(1e-30f), 0x0000);
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1.0f, -25)), 0x0000);  // tie to even zero
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(FloatToHalfBits(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
}

TEST(HalfTest, NanStaysNan) {
  const uint16_t h = FloatToHalfBits(std::numeric_limits<float>::quiet_NaN());
  EXPECT_TRUE(std::isnan(HalfBitsToFloat(h)));
}

// FirstNonFinite on every SIMD target: lengths around the vector widths,
// every kind of non-finite value in the vector part and in the tail, the
// first of two, and the largest finite values and denormals (which are
// finite).
TEST(FiniteTest, FirstNonFiniteOnEveryTarget) {
  const float inf = std::numeric_limits<float>::infinity();
  const float specials[] = {inf, -inf, std::nanf(""), -std::nanf("")};
  int tested = 0;
  for (int64_t bits = hwy::SupportedTargets() & HWY_TARGETS; bits != 0; bits &= bits - 1) {
    const int64_t target = bits & -bits;
    hwy::SetSupportedTargetsForTest(target);
    const std::string name = hwy::TargetName(target);
    for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{15}, size_t{16}, size_t{17}, size_t{33}, size_t{4099}}) {
      std::vector<float> x(n);
      for (size_t i = 0; i < n; ++i) {
        const float edge[] = {std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                              std::numeric_limits<float>::denorm_min(), -0.0f, 1.5f};
        x[i] = edge[i % 5];
      }
      EXPECT_EQ(FirstNonFinite(x.data(), n), n) << name << " n=" << n;
      for (size_t at : {size_t{0}, n / 2, n - 1}) {
        if (n == 0) break;
        for (float special : specials) {
          std::vector<float> y = x;
          y[at] = special;
          if (at + 1 < n) y[n - 1] = inf;  // a later one does not count
          EXPECT_EQ(FirstNonFinite(y.data(), n), at) << name << " n=" << n << " at " << at << " " << special;
        }
      }
    }
    ++tested;
  }
  hwy::SetSupportedTargetsForTest(0);
  EXPECT_GE(tested, HWY_ARCH_X86 ? 2 : 1);
}

// LargestMagnitudes against a double reference: the largest |x| exactly,
// the largest block sum of squares to float rounding, for block sizes that
// are and are not multiples of every target's lanes.
TEST(FiniteTest, LargestMagnitudesOnEveryTarget) {
  int tested = 0;
  for (int64_t bits = hwy::SupportedTargets() & HWY_TARGETS; bits != 0; bits &= bits - 1) {
    const int64_t target = bits & -bits;
    hwy::SetSupportedTargetsForTest(target);
    const std::string name = hwy::TargetName(target);
    for (size_t block : {size_t{8}, size_t{32}, size_t{40}, size_t{64}, size_t{128}}) {
      for (size_t blocks : {size_t{0}, size_t{1}, size_t{3}, size_t{9}}) {
        const size_t n = block * blocks;
        std::vector<float> x(n);
        uint32_t state = static_cast<uint32_t>(n * 2654435761u + block);
        for (float& v : x) {
          state = state * 1664525u + 1013904223u;
          v = (static_cast<float>(state >> 8) / 16777216.0f - 0.5f) * 100.0f;
        }
        // The largest, negative, inside the blocks; then, larger, the last
        // value of all (in a block's scalar tail where lanes do not divide it).
        if (n == 0) {
          float largest = -1.0f, square = -1.0f;
          LargestMagnitudes(x.data(), 0, block, &largest, &square);
          EXPECT_EQ(largest, 0.0f) << name;
          EXPECT_EQ(square, 0.0f) << name;
          continue;
        }
        for (const size_t at : {n * 2 / 3, n - 1}) {
          x[at] = at == n - 1 ? 61000.0f : -60000.0f;
          double largest = 0, square = 0;
          for (size_t b = 0; b < n; b += block) {
            double sum = 0;
            for (size_t i = b; i < b + block; ++i) {
              largest = std::max(largest, std::fabs(static_cast<double>(x[i])));
              sum += static_cast<double>(x[i]) * x[i];
            }
            square = std::max(square, sum);
          }
          float got_largest = -1.0f, got_square = -1.0f, alone = -1.0f;
          LargestMagnitudes(x.data(), n, block, &got_largest, &got_square);
          LargestMagnitudes(x.data(), n, block, &alone, nullptr);
          EXPECT_EQ(got_largest, static_cast<float>(largest)) << name << " block " << block << " n " << n;
          EXPECT_EQ(alone, got_largest) << name << " block " << block << " n " << n;
          EXPECT_NEAR(got_square, square, 1e-6 * square) << name << " block " << block << " n " << n;
        }
      }
    }
    ++tested;
  }
  hwy::SetSupportedTargetsForTest(0);
  EXPECT_GE(tested, HWY_ARCH_X86 ? 2 : 1);
}

}  // namespace
}  // namespace turbokv

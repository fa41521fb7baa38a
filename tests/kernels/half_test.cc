#include "kernels/half.h"

#include <cmath>
#include <cstdint>
#include <limits>

#include "gtest/gtest.h"

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

}  // namespace
}  // namespace turbokv

#include "mori/core/fp8.hpp"

#include <gtest/gtest.h>

#include <cmath>

using mori::core::FloatToFp8;
using mori::core::Fp8Format;
using mori::core::Fp8ToFloat;

TEST(Fp8, KnownEncodingsE4M3Fn) {
  EXPECT_EQ(FloatToFp8(1.f, Fp8Format::kE4M3Fn), 0x38);
  EXPECT_EQ(FloatToFp8(-2.f, Fp8Format::kE4M3Fn), 0xC0);
  EXPECT_EQ(FloatToFp8(448.f, Fp8Format::kE4M3Fn), 0x7E);
  EXPECT_EQ(FloatToFp8(1e6f, Fp8Format::kE4M3Fn), 0x7E);                 // saturates
  EXPECT_EQ(FloatToFp8(std::ldexp(1.f, -9), Fp8Format::kE4M3Fn), 0x01);  // smallest subnormal
  EXPECT_TRUE(std::isnan(Fp8ToFloat(0x7F, Fp8Format::kE4M3Fn)));
  EXPECT_EQ(Fp8ToFloat(0x80, Fp8Format::kE4M3Fn), 0.f);  // -0
}

TEST(Fp8, KnownEncodingsE4M3Fnuz) {
  EXPECT_EQ(FloatToFp8(1.f, Fp8Format::kE4M3Fnuz), 0x40);
  EXPECT_EQ(FloatToFp8(240.f, Fp8Format::kE4M3Fnuz), 0x7F);
  EXPECT_EQ(FloatToFp8(1e6f, Fp8Format::kE4M3Fnuz), 0x7F);
  EXPECT_EQ(FloatToFp8(std::ldexp(1.f, -10), Fp8Format::kE4M3Fnuz), 0x01);
  EXPECT_TRUE(std::isnan(Fp8ToFloat(0x80, Fp8Format::kE4M3Fnuz)));
  EXPECT_EQ(FloatToFp8(-0.f, Fp8Format::kE4M3Fnuz), 0x00);  // no negative zero
}

TEST(Fp8, EveryFiniteCodeRoundTrips) {
  for (Fp8Format f : {Fp8Format::kE4M3Fn, Fp8Format::kE4M3Fnuz}) {
    for (int c = 0; c < 256; c++) {
      float v = Fp8ToFloat(static_cast<uint8_t>(c), f);
      if (std::isnan(v)) continue;
      if (v == 0.f) continue;  // +-0 compare equal; checked above
      EXPECT_EQ(FloatToFp8(v, f), c) << "format " << static_cast<int>(f) << " code " << c;
    }
  }
}

TEST(Fp8, RoundsToNearestEven) {
  // Between 1.0 (0x38) and 1.125 (0x39) in e4m3fn: the midpoint goes to the even code.
  EXPECT_EQ(FloatToFp8(1.0625f, Fp8Format::kE4M3Fn), 0x38);
  EXPECT_EQ(FloatToFp8(1.07f, Fp8Format::kE4M3Fn), 0x39);
}

#include "mori/core/fp8.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

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

// Fp8Encode / Fp8Decode (the kernels' bit-level forms) against the defining search.
namespace {

float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

void ExpectEncodeMatches(float x) {
  for (Fp8Format f : {Fp8Format::kE4M3Fn, Fp8Format::kE4M3Fnuz}) {
    ASSERT_EQ(mori::core::Fp8Encode(x, f), FloatToFp8(x, f))
        << "format " << static_cast<int>(f) << " x " << x << " (bits 0x" << std::hex <<
        [&] {
          uint32_t b;
          std::memcpy(&b, &x, sizeof(b));
          return b;
        }()
        << ")";
  }
}

}  // namespace

TEST(Fp8, EncodeMatchesSearchAtEveryCodeAndMidpoint) {
  for (Fp8Format f : {Fp8Format::kE4M3Fn, Fp8Format::kE4M3Fnuz}) {
    for (int c = 0; c < 0x7F; c++) {
      const float lo = Fp8ToFloat(static_cast<uint8_t>(c), f);
      const float hi = Fp8ToFloat(static_cast<uint8_t>(c + 1), f);
      if (std::isnan(lo) || std::isnan(hi)) continue;
      const float mid = (lo + hi) / 2;  // exact: fp8 values have 4 significant bits
      for (float v : {lo, hi, mid, std::nextafter(mid, 0.f), std::nextafter(mid, 1e9f),
                      std::nextafter(lo, 1e9f), std::nextafter(hi, 0.f)}) {
        ExpectEncodeMatches(v);
        ExpectEncodeMatches(-v);
      }
    }
  }
}

TEST(Fp8, EncodeMatchesSearchOnSpecialsAndSweep) {
  for (float v : {0.f, -0.f, INFINITY, -INFINITY, 448.f, 449.f, 464.f, 480.f, 1e30f, 240.f, 248.f,
                  FromBits(1), FromBits(0x00800000u), 0x1p-10f, 0x1p-11f, 0x1p-11f * 1.0001f}) {
    ExpectEncodeMatches(v);
    ExpectEncodeMatches(-v);
  }
  // Every 40009th fp32 bit pattern (all exponents, many mantissas), both signs; NaNs map to NaN.
  for (uint64_t b = 0; b < 0x80000000ull; b += 40009) {
    const float x = FromBits(static_cast<uint32_t>(b));
    if (std::isnan(x)) {
      EXPECT_TRUE(
          std::isnan(Fp8ToFloat(mori::core::Fp8Encode(x, Fp8Format::kE4M3Fn), Fp8Format::kE4M3Fn)));
      continue;
    }
    ExpectEncodeMatches(x);
    ExpectEncodeMatches(-x);
  }
}

TEST(Fp8, DecodeMatchesEveryCode) {
  for (Fp8Format f : {Fp8Format::kE4M3Fn, Fp8Format::kE4M3Fnuz}) {
    for (int c = 0; c < 256; c++) {
      const float want = Fp8ToFloat(static_cast<uint8_t>(c), f);
      for (const float got : {mori::core::Fp8Decode(static_cast<uint8_t>(c), f),
                              mori::core::Fp8DecodeMul(static_cast<uint8_t>(c), f)}) {
        if (std::isnan(want)) {
          EXPECT_TRUE(std::isnan(got)) << c;
        } else {
          uint32_t a, b;
          std::memcpy(&a, &want, 4);
          std::memcpy(&b, &got, 4);
          EXPECT_EQ(a, b) << "format " << static_cast<int>(f) << " code " << c;
        }
      }
    }
  }
}

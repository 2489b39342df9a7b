// core::Bf16RoundBits against the definition of round-to-nearest-even: of the two bf16 values
// either side of x, the nearer (exact arithmetic in double), the one with the even code on a tie,
// infinity beyond the largest finite value plus half its ulp; -0 kept; NaN to 0x7FFF.
#include "mori/core/float16.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>

using mori::core::Bf16RoundBits;
using mori::core::Bf16ToFloat;
using mori::core::kBf16QuietNan;

namespace {

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// The magnitude of bf16 code m (sign cleared), with 0x7F80 read as 2^128: the value the
// exponent range would give next after the largest finite one (IEEE-754's overflow rule).
double Magnitude(uint32_t m) {
  if (m == 0x7F80u) return std::ldexp(1.0, 128);
  return static_cast<double>(Bf16ToFloat(static_cast<uint16_t>(m)));
}

uint16_t Reference(float x) {
  if (std::isnan(x)) return kBf16QuietNan;
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(x));
  if (std::isinf(x)) return sign | 0x7F80;
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint32_t lo = (u & 0x7FFFFFFFu) >> 16, hi = lo + 1;  // lo <= |x| < hi
  const double dl = a - Magnitude(lo), dh = Magnitude(hi) - a;
  uint32_t m = dl < dh ? lo : dh < dl ? hi : (lo % 2 == 0 ? lo : hi);
  return static_cast<uint16_t>(sign | m);
}

void Check(uint32_t u) {
  const float x = FromBits(u);
  ASSERT_EQ(Bf16RoundBits(x), Reference(x)) << std::hex << "fp32 bits 0x" << u;
}

}  // namespace

TEST(Bf16RoundBits, KnownValues) {
  EXPECT_EQ(Bf16RoundBits(1.0f), 0x3F80);
  EXPECT_EQ(Bf16RoundBits(-2.0f), 0xC000);
  EXPECT_EQ(Bf16RoundBits(-0.0f), 0x8000);
  EXPECT_EQ(Bf16RoundBits(FromBits(0x3F808000u)), 0x3F80);  // tie: to the even code
  EXPECT_EQ(Bf16RoundBits(FromBits(0x3F818000u)), 0x3F82);
  EXPECT_EQ(Bf16RoundBits(FromBits(0x7F7FFFFFu)), 0x7F80);  // past max + ulp/2: infinity
  EXPECT_EQ(Bf16RoundBits(FromBits(0x7F7F7FFFu)), 0x7F7F);
  EXPECT_EQ(Bf16RoundBits(FromBits(0x00000001u)), 0x0000);  // below half the smallest subnormal
  EXPECT_EQ(Bf16RoundBits(FromBits(0x00008000u)), 0x0000);  // tie with 0: even
  EXPECT_EQ(Bf16RoundBits(FromBits(0x00018000u)), 0x0002);
  EXPECT_EQ(Bf16RoundBits(FromBits(0x7FC00000u)), kBf16QuietNan);
  EXPECT_EQ(Bf16RoundBits(FromBits(0xFF800001u)), kBf16QuietNan);  // signalling, negative
  EXPECT_EQ(Bf16RoundBits(FromBits(0x7F800000u)), 0x7F80);
  EXPECT_EQ(Bf16RoundBits(FromBits(0xFF800000u)), 0xFF80);
}

TEST(Bf16RoundBits, EveryCodeAndTheMidpointsAroundIt) {
  for (uint32_t b = 0; b < 0x10000u; b++) {
    const uint32_t u = b << 16;
    if (std::isnan(FromBits(u))) continue;
    EXPECT_EQ(Bf16RoundBits(FromBits(u)), b);  // representable: exact
    for (uint32_t d : {1u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu}) Check(u + d);
  }
}

TEST(Bf16RoundBits, RandomBitPatterns) {
  std::mt19937 rng(11);
  for (int i = 0; i < (1 << 20); i++) Check(static_cast<uint32_t>(rng()));
}

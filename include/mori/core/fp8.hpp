// FP8 E4M3 in the two encodings our GPUs use:
//   e4m3fn   (NVIDIA Hopper, OCP): bias 7, max 448, NaN = S.1111.111, no infinities, +-0.
//   e4m3fnuz (AMD MI300 / gfx942): bias 8, max 240, NaN = 1.0000.000 (the only one), no -0.
// FloatToFp8 / Fp8ToFloat define the conversions (a search over the codes: slow, obviously
// right); Fp8Encode is the kernels' bit-level form of FloatToFp8, equal to it for every float
// (tests/core/fp8_test.cpp). All are host and device code, so both encodings work on every backend.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "mori/core/gpu.hpp"

namespace mori::core {

enum class Fp8Format : uint8_t { kE4M3Fn = 0, kE4M3Fnuz = 1 };

// The encoding a platform's FP8 hardware and frameworks use for "float8 e4m3" (gpu.hpp).
constexpr Fp8Format kNativeFp8Format = kNativeFp8IsFnuz ? Fp8Format::kE4M3Fnuz : Fp8Format::kE4M3Fn;

MORI_HD inline int Fp8Bias(Fp8Format f) { return f == Fp8Format::kE4M3Fn ? 7 : 8; }
MORI_HD inline float Fp8Max(Fp8Format f) { return f == Fp8Format::kE4M3Fn ? 448.f : 240.f; }

MORI_HD inline float Fp8ToFloat(uint8_t v, Fp8Format f) {
  const uint32_t sign = v >> 7, exp = (v >> 3) & 0xF, man = v & 0x7;
  if (f == Fp8Format::kE4M3Fn) {
    if (exp == 0xF && man == 0x7) return __builtin_nanf("");
  } else {
    if (v == 0x80) return __builtin_nanf("");
  }
  const int bias = Fp8Bias(f);
  float mag;
  if (exp == 0) {
    mag = static_cast<float>(man) / 8.f;  // subnormal: man/8 * 2^(1-bias)
    for (int i = 0; i < bias - 1; i++) mag *= 0.5f;
  } else {
    mag = 1.f + static_cast<float>(man) / 8.f;
    int e = static_cast<int>(exp) - bias;
    for (; e > 0; e--) mag *= 2.f;
    for (; e < 0; e++) mag *= 0.5f;
  }
  return sign ? -mag : mag;
}

// Round to nearest even, saturating to the format's max (as frameworks' saturating casts do).
MORI_HD inline uint8_t FloatToFp8(float x, Fp8Format f) {
  if (x != x) return f == Fp8Format::kE4M3Fn ? 0x7F : 0x80;
  uint32_t sign = 0;
  if (x < 0.f || (x == 0.f && 1.f / x < 0.f)) {
    sign = 1;
    x = -x;
  }
  const float maxv = Fp8Max(f);
  if (x >= maxv) x = maxv;
  // Search the 127 non-negative finite codes for the nearest (ties to even mantissa).
  uint8_t best = 0;
  float bestErr = x;
  for (uint32_t code = 1; code < 0x80; code++) {
    float v = Fp8ToFloat(static_cast<uint8_t>(code), f);
    if (v != v || v > maxv) continue;
    float err = v > x ? v - x : x - v;
    if (err < bestErr || (err == bestErr && (code & 1) == 0)) {
      bestErr = err;
      best = static_cast<uint8_t>(code);
    }
  }
  if (best == 0 && sign && f == Fp8Format::kE4M3Fnuz) return 0;  // fnuz has no -0
  return static_cast<uint8_t>((sign << 7) | best);
}

// FloatToFp8 by bit manipulation (the kernels' encoder): round to nearest even, |x| >= max and
// +-inf saturate to +-max, NaN gives the format's NaN, e4m3fnuz has no -0. Subnormal fp32 inputs
// are converted exactly as long as the code is not compiled to flush them to zero.
MORI_HD inline uint8_t Fp8Encode(float x, Fp8Format f) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof(bits));
  const uint32_t sign = bits >> 31;
  const uint32_t a = bits & 0x7FFFFFFFu;
  const bool fn = f == Fp8Format::kE4M3Fn;
  if (a > 0x7F800000u) return fn ? 0x7F : 0x80;  // NaN
  const int bias = Fp8Bias(f);
  const uint32_t maxCode = fn ? 0x7Eu : 0x7Fu;
  float mag;
  memcpy(&mag, &a, sizeof(mag));
  uint32_t code;
  if (mag >= Fp8Max(f)) {
    code = maxCode;
  } else if (a < (static_cast<uint32_t>(128 - bias) << 23)) {
    // Below the smallest normal 2^(1 - bias): multiples of 2^(-2 - bias), scaled exactly to an
    // integer 0..8 and rounded to nearest even (8 is the smallest normal's code).
    code = static_cast<uint32_t>(rintf(mag * (fn ? 512.f : 1024.f)));
  } else {
    // Normal: keep 3 mantissa bits, rounding the 20 dropped ones to nearest even (a carry moves
    // into the exponent), then rebias the exponent from 127 to `bias`.
    const uint32_t r = a + 0x7FFFFu + ((a >> 20) & 1u);
    code = (r >> 20) - (static_cast<uint32_t>(127 - bias) << 3);
    if (code > maxCode) code = maxCode;
  }
  if (sign == 0 || (code == 0 && !fn)) return static_cast<uint8_t>(code);
  return static_cast<uint8_t>(code | 0x80u);
}

// Fp8ToFloat by bit manipulation (exact for every code).
MORI_HD inline float Fp8Decode(uint8_t v, Fp8Format f) {
  const uint32_t sign = v >> 7, exp = (v >> 3) & 0xF, man = v & 0x7;
  const bool fn = f == Fp8Format::kE4M3Fn;
  if (fn ? (exp == 0xF && man == 0x7) : v == 0x80) return __builtin_nanf("");
  float mag;
  if (exp == 0) {
    mag = static_cast<float>(man) * (fn ? 0x1p-9f : 0x1p-10f);
  } else {
    const uint32_t bits = ((exp + 127u - static_cast<uint32_t>(Fp8Bias(f))) << 23) | (man << 20);
    memcpy(&mag, &bits, sizeof(mag));
  }
  return sign ? -mag : mag;
}

// Fp8ToFloat in four operations (the combine's decode of fp8_direct_cast rows): the code's 7 low
// bits placed as an fp32 exponent and mantissa are the value times 2^(bias - 127), an fp32 normal
// or (exponent 0) subnormal, so one multiplication by the exact 2^(127 - bias) gives the value;
// the NaN code is selected. Exact for every code as long as the code is not compiled to flush
// fp32 subnormal inputs to zero (nvcc without -ftz=true / --use_fast_math, HIP's default).
MORI_HD inline float Fp8DecodeMul(uint8_t v, Fp8Format f) {
  const bool fn = f == Fp8Format::kE4M3Fn;
  const uint32_t bits =
      (static_cast<uint32_t>(v & 0x80u) << 24) | (static_cast<uint32_t>(v & 0x7Fu) << 20);
  float x;
  memcpy(&x, &bits, sizeof(x));
  x *= fn ? 0x1p120f : 0x1p119f;
  const bool nan = fn ? (v & 0x7Fu) == 0x7Fu : v == 0x80u;
  return nan ? __builtin_nanf("") : x;
}

}  // namespace mori::core

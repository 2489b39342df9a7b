// FP8 E4M3 in the two encodings our GPUs use:
//   e4m3fn   (NVIDIA Hopper, OCP): bias 7, max 448, NaN = S.1111.111, no infinities, +-0.
//   e4m3fnuz (AMD MI300 / gfx942): bias 8, max 240, NaN = 1.0000.000 (the only one), no -0.
// Dispatch only moves FP8 bytes; these conversions are for references, tests and combine paths,
// written portably (host and device) so both encodings work on every backend.
#pragma once

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

}  // namespace mori::core

// fp32 to bfloat16, the bit-level rounding shared by host and device: round to nearest even,
// overflow to infinity, subnormals kept, -0 kept, every NaN to the quiet NaN 0x7FFF (the NaN
// NVIDIA's cvt.rn.bf16x2.f32 produces, so that kernels give the same bits on every platform).
// Kernels pack pairs with core::PackBf16x2 (gpu_device.hpp), which is this function or the
// hardware conversion that equals it (tests/python/test_ep_combine_pack.py).
#pragma once

#include <cstdint>

#include "mori/core/host_device.hpp"

namespace mori::core {

constexpr uint16_t kBf16QuietNan = 0x7FFF;

MORI_HD_INLINE uint16_t Bf16RoundBits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return kBf16QuietNan;
  u += 0x7FFFu + ((u >> 16) & 1u);  // ties to the even one of the two neighbours
  return static_cast<uint16_t>(u >> 16);
}

MORI_HD_INLINE float Bf16ToFloat(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace mori::core

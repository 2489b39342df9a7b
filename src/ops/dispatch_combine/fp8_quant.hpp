// The fused FP8 quantisation of dispatch (EpDispatchQuant, config.hpp has the formula), as host
// and device functions: the dispatch kernel quantises with these, and mori._C._testing binds
// EpFp8QuantizeRow (the same steps on the host) so that tests check them against the reference.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "mori/core/fp8.hpp"
#include "mori/core/gpu.hpp"
#include "mori/ops/dispatch_combine/config.hpp"

namespace mori::ops::detail {

MORI_HD inline float EpBf16ToFloat(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  memcpy(&f, &bits, sizeof(f));
  return f;
}

// Scale of a group with largest magnitude `amax`, and the factor its elements are multiplied by.
struct EpFp8GroupScale {
  float scale;
  float inv;  // 1 / scale, rounded once
};
MORI_HD inline EpFp8GroupScale EpFp8ScaleOf(float amax, core::Fp8Format f, bool roundScale) {
  const float maxv = core::Fp8Max(f);
  const float floor = maxv * 0x1p-126f;  // exact; floor / maxv = 2^-126
  float s = (amax > floor ? amax : floor) / maxv;
  if (roundScale) {
    // Up to a power of two: s is normal and positive, so clearing the mantissa and adding one
    // to the exponent (when the mantissa is not zero) is 2^ceil(log2 s).
    uint32_t b;
    memcpy(&b, &s, sizeof(b));
    if ((b & 0x7FFFFFu) != 0) b = (b & 0xFF800000u) + 0x800000u;
    memcpy(&s, &b, sizeof(s));
  }
  return EpFp8GroupScale{s, 1.0f / s};
}

MORI_HD inline uint8_t EpFp8Quantize(float x, const EpFp8GroupScale& s, core::Fp8Format f) {
  return core::Fp8Encode(x * s.inv, f);
}

// Stores the scale of group g of a row's scales (`scales`: that row's EpDispatchQuantScaleBytes
// bytes): an fp32, or (kUe8m0) its exponent byte; the writer of the last group (nGroups - 1)
// also zeroes the unused bytes of the last word.
MORI_HD inline void EpFp8StoreScale(uint8_t* scales, int g, int nGroups, const EpFp8GroupScale& s,
                                    EpDispatchQuant quant) {
  if (quant == EpDispatchQuant::kFp8Ue8m0) {
    uint32_t b;
    memcpy(&b, &s.scale, sizeof(b));
    scales[g] = static_cast<uint8_t>(b >> 23);
    if (g == nGroups - 1) {
      for (int j = nGroups; j % 4 != 0; j++) scales[j] = 0;
    }
  } else {
    reinterpret_cast<float*>(scales)[g] = s.scale;
  }
}

MORI_HD inline bool EpQuantRoundsScale(EpDispatchQuant quant) {
  return quant == EpDispatchQuant::kFp8RoundScale || quant == EpDispatchQuant::kFp8Ue8m0;
}

// One row (hiddenDim bf16 values, a multiple of kEpQuantGroup) quantised on the host, by the same
// steps as the kernel: amax over each group, EpFp8ScaleOf, EpFp8Quantize, EpFp8StoreScale.
inline void EpFp8QuantizeRow(const uint16_t* x, int hiddenDim, EpDispatchQuant quant,
                             core::Fp8Format f, uint8_t* codes, uint8_t* scales) {
  const int nGroups = hiddenDim / kEpQuantGroup;
  for (int g = 0; g < nGroups; g++) {
    float amax = 0.f;
    for (int i = 0; i < kEpQuantGroup; i++)
      amax = fmaxf(amax, fabsf(EpBf16ToFloat(x[g * kEpQuantGroup + i])));
    const EpFp8GroupScale s = EpFp8ScaleOf(amax, f, EpQuantRoundsScale(quant));
    for (int i = 0; i < kEpQuantGroup; i++)
      codes[g * kEpQuantGroup + i] = EpFp8Quantize(EpBf16ToFloat(x[g * kEpQuantGroup + i]), s, f);
    EpFp8StoreScale(scales, g, nGroups, s, quant);
  }
}

}  // namespace mori::ops::detail

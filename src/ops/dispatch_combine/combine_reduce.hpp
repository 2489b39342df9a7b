// The fp32 row sums every combine shares (pull: combine_body.hpp, push:
// combine_push_body.hpp): a warp sums n rows of 16-byte vectors in a fixed order (ascending
// PE), with as many loads per lane in flight as the registers allow.
#pragma once

#include <cstdint>

#include "common_device.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/fp8.hpp"

namespace mori::ops::detail {

constexpr int kCombineMaxWarps = kEpMaxThreadsPerBlock / kWarpSize;
constexpr int kCombinePeerBatch = 4;  // rows loaded together (weights; token rows when n >= 3)

// ---- quant_type fp8_direct_cast -------------------------------------------------------------
// One 16-byte vector of the input dtype (Elem::kPerVec elements) is kPerVec e4m3 codes on the
// wire: 8 bytes (bf16, fp16) or 4 (fp32). A wire row is the input row's elements, one byte each,
// so output vector v of a row is wire bytes [v * kPerVec, (v + 1) * kPerVec).
struct EpFp8Codes {
  uint32_t lo, hi;  // code i in byte i % 4 of lo (i < 4) or of hi
};

// The saturating direct cast (core::Fp8Encode: round to nearest even, |x| beyond the format's
// max and infinities to +-max, NaN to NaN) of one input vector.
template <typename Elem>
MORI_DEVICE_INLINE EpFp8Codes EpEncodeFp8(const uint4& v, core::Fp8Format f) {
  float x[Elem::kPerVec];
  Elem::Unpack(v, x);
  uint32_t w[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < Elem::kPerVec; i++)
    w[i / 4] |= static_cast<uint32_t>(core::Fp8Encode(x[i], f)) << (8 * (i % 4));
  return EpFp8Codes{w[0], w[1]};
}

template <typename Elem>
MORI_DEVICE_INLINE EpFp8Codes EpLoadFp8(const uint8_t* row, int v) {
  if constexpr (Elem::kPerVec == 8) {
    const uint2 u = reinterpret_cast<const uint2*>(row)[v];
    return EpFp8Codes{u.x, u.y};
  } else {
    static_assert(Elem::kPerVec == 4, "a wire vector is 8 or 4 codes");
    return EpFp8Codes{reinterpret_cast<const uint32_t*>(row)[v], 0u};
  }
}

template <typename Elem>
MORI_DEVICE_INLINE void EpStoreFp8(uint8_t* row, size_t v, const EpFp8Codes& c) {
  if constexpr (Elem::kPerVec == 8) {
    reinterpret_cast<uint2*>(row)[v] = make_uint2(c.lo, c.hi);
  } else {
    reinterpret_cast<uint32_t*>(row)[v] = c.lo;
  }
}

// acc[i] += the exact fp32 value of code i (core::Fp8DecodeMul), i ascending.
template <typename Elem>
MORI_DEVICE_INLINE void EpAccumulateFp8(float (&acc)[Elem::kPerVec], const EpFp8Codes& c,
                                        core::Fp8Format f) {
#pragma unroll
  for (int i = 0; i < Elem::kPerVec; i++)
    acc[i] += core::Fp8DecodeMul(static_cast<uint8_t>((i < 4 ? c.lo : c.hi) >> (8 * (i % 4))), f);
}

// Grid-wide cast of `vecs` 16-byte vectors of Elem at src into their codes at dst (vector i to
// wire bytes [i * kPerVec, (i + 1) * kPerVec)); src 16-byte, dst kPerVec-byte aligned.
template <typename Elem>
MORI_DEVICE_INLINE void GridCastFp8(uint8_t* dst, const uint8_t* src, size_t vecs,
                                    core::Fp8Format f) {
  constexpr int kU = 4;  // loads in flight per thread
  const uint4* s = reinterpret_cast<const uint4*>(src);
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + (kU - 1) * stride < vecs; i += kU * stride) {
    uint4 r[kU];
#pragma unroll
    for (int u = 0; u < kU; u++) r[u] = s[i + u * stride];
#pragma unroll
    for (int u = 0; u < kU; u++) EpStoreFp8<Elem>(dst, i + u * stride, EpEncodeFp8<Elem>(r[u], f));
  }
  for (; i < vecs; i += stride) EpStoreFp8<Elem>(dst, i, EpEncodeFp8<Elem>(s[i], f));
}

// How a reduction reads its rows: 16-byte vectors of Elem, or (quant_type fp8_direct_cast) the
// e4m3 codes of such vectors, decoded while accumulated.
template <typename Elem>
struct EpPlainRows {
  using Vec = uint4;
  MORI_DEVICE_INLINE Vec Load(const uint8_t* row, int v) const {
    return reinterpret_cast<const uint4*>(row)[v];
  }
  MORI_DEVICE_INLINE void Accumulate(float (&acc)[Elem::kPerVec], const Vec& x) const {
    Elem::Accumulate(acc, x);
  }
};
template <typename Elem>
struct EpFp8Rows {
  using Vec = EpFp8Codes;
  core::Fp8Format format;
  MORI_DEVICE_INLINE Vec Load(const uint8_t* row, int v) const { return EpLoadFp8<Elem>(row, v); }
  MORI_DEVICE_INLINE void Accumulate(float (&acc)[Elem::kPerVec], const Vec& x) const {
    EpAccumulateFp8<Elem>(acc, x, format);
  }
};

// out[v] = sum over members j (in order) of rows[j][v], for v in [vb, ve) of this warp's lanes.
// Each lane keeps kB rows x kU vectors of loads in flight before it accumulates them. Rows says
// how a row's vector v is read (EpPlainRows: 16-byte vectors; EpFp8Rows: wire codes).
template <typename Elem, int kB, int kU, typename Rows = EpPlainRows<Elem>>
MORI_DEVICE_INLINE void WarpReduceRowsBatched(uint4* __restrict__ out, const uint8_t* const* rows,
                                              int n, int vb, int ve, const Rows& rd = Rows{}) {
  const int lane = core::LaneId();
  for (int v0 = vb + lane; v0 < ve; v0 += kU * kWarpSize) {
    float acc[kU][Elem::kPerVec];
#pragma unroll
    for (int u = 0; u < kU; u++) {
#pragma unroll
      for (int i = 0; i < Elem::kPerVec; i++) acc[u][i] = 0.0f;
    }
    for (int jb = 0; jb < n; jb += kB) {
      typename Rows::Vec r[kB][kU];
#pragma unroll
      for (int j = 0; j < kB; j++) {
        if (jb + j < n) {
#pragma unroll
          for (int u = 0; u < kU; u++) {
            if (v0 + u * kWarpSize < ve) r[j][u] = rd.Load(rows[jb + j], v0 + u * kWarpSize);
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kB; j++) {
        if (jb + j < n) {
#pragma unroll
          for (int u = 0; u < kU; u++) {
            if (v0 + u * kWarpSize < ve) rd.Accumulate(acc[u], r[j][u]);
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kU; u++) {
      if (v0 + u * kWarpSize < ve) out[v0 + u * kWarpSize] = Elem::Pack(acc[u]);
    }
  }
}

// The same for n <= kB rows (one batch): each vector's sum is finished and packed before the
// next vector's starts, so only one fp32 accumulator is live and the registers go to loads in
// flight instead (kB x kU per lane). Same additions in the same order as above.
template <typename Elem, int kB, int kU>
MORI_DEVICE_INLINE void WarpSumFewRows(uint4* __restrict__ out, const uint8_t* const* rows, int n,
                                       int vb, int ve) {
  const int lane = core::LaneId();
  for (int v0 = vb + lane; v0 < ve; v0 += kU * kWarpSize) {
    uint4 r[kB][kU];
#pragma unroll
    for (int j = 0; j < kB; j++) {
      if (j < n) {
        const uint4* src = reinterpret_cast<const uint4*>(rows[j]);
#pragma unroll
        for (int u = 0; u < kU; u++) {
          if (v0 + u * kWarpSize < ve) r[j][u] = src[v0 + u * kWarpSize];
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kU; u++) {
      if (v0 + u * kWarpSize < ve) {
        float acc[Elem::kPerVec];
#pragma unroll
        for (int i = 0; i < Elem::kPerVec; i++) acc[i] = 0.0f;
#pragma unroll
        for (int j = 0; j < kB; j++) {
          if (j < n) Elem::Accumulate(acc, r[j][u]);
        }
        out[v0 + u * kWarpSize] = Elem::Pack(acc);
      }
    }
  }
}

// Loads in flight per lane (rows x vectors) by row count n (warp-uniform), for the kernel built
// for 512 threads per block (128 registers per thread; larger shapes spill) and the one built for
// up to 256 (255 registers): each build keeps as many loads in flight as its registers hold
// without spilling. More warps beat more loads per warp at the same bytes in flight, so the
// 256-thread shapes serve launches of <= 8 warps (the config default) and larger launches use
// the 512-thread build (figures: docs/performance.md, "Combine loads in flight").
template <int kThreads>
struct EpCombineShape {
  static constexpr int kVecsTwoRows = 4;   // n <= 2: 2 rows x 4 vectors per lane
  static constexpr int kVecsFourRows = 2;  // n <= 4: 4 rows x 2 vectors (and batches of 4 beyond)
};
template <>
struct EpCombineShape<256> {
  static constexpr int kVecsTwoRows = 8;
  static constexpr int kVecsFourRows = 4;
};

// The reduction is bound by how many loads are in flight per lane (docs/performance.md, "Combine
// loads in flight"): with n <= 2 rows the shape takes more vectors per row, so the lanes keep the
// same number of loads in flight as with 4 rows.
template <typename Elem, int kThreads>
MORI_DEVICE_INLINE void WarpReduceRows(uint4* __restrict__ out, const uint8_t* const* rows, int n,
                                       int vb, int ve) {
  using S = EpCombineShape<kThreads>;
  if (n <= 2) {
    WarpSumFewRows<Elem, 2, S::kVecsTwoRows>(out, rows, n, vb, ve);
  } else if (n <= kCombinePeerBatch) {
    WarpSumFewRows<Elem, kCombinePeerBatch, S::kVecsFourRows>(out, rows, n, vb, ve);
  } else {
    WarpReduceRowsBatched<Elem, kCombinePeerBatch, S::kVecsFourRows>(out, rows, n, vb, ve);
  }
}

// quant_type fp8_direct_cast: out[v] = round(sum over rows j < n, ascending, of the decoded codes
// of rows[j] (wire rows) for v), summed in fp32 from +0.0. The 256-thread build keeps
// kCombinePeerBatch rows x EpCombineShape's 4-row vectors of loads in flight per lane; the
// 512-thread build one (its 128 registers are taken by the kernels' other reductions: any more
// here and the pull and InterNode kernels spill on every path, ptxas -v).
template <typename Elem, int kThreads>
MORI_DEVICE_INLINE void WarpReduceFp8(uint4* __restrict__ out, const uint8_t* const* rows, int n,
                                      int vb, int ve, core::Fp8Format f) {
  constexpr bool kWide = kThreads <= 256;
  constexpr int kB = kWide ? kCombinePeerBatch : 1;
  constexpr int kU = kWide ? EpCombineShape<kThreads>::kVecsFourRows : 1;
  WarpReduceRowsBatched<Elem, kB, kU>(out, rows, n, vb, ve, EpFp8Rows<Elem>{f});
}

// Staged combine (WarpReduceRowsStaged, sm_90+): each of n rows (1 <= n <= kEpCombineStageRows)
// is streamed in chunks of EpStagedChunkBytes(n) bytes, so that one chunk of every row fits one
// stage; chunks are multiples of 16 bytes (the unit of the bulk copies and of the sums). Bytes
// [begin, end) of a row make EpStagedChunkCount chunks; chunk c starts at begin + c * chunk and
// has EpStagedChunkLength(begin + c * chunk, end, chunk) bytes (the last one may be shorter).
MORI_HD inline uint32_t EpStagedChunkBytes(int n) {
  return (static_cast<uint32_t>(kEpCombineStageBytes) / n) & ~15u;
}
MORI_HD inline uint32_t EpStagedChunkCount(uint32_t begin, uint32_t end, uint32_t chunk) {
  return (end - begin + chunk - 1) / chunk;
}
MORI_HD inline uint32_t EpStagedChunkLength(uint32_t off, uint32_t end, uint32_t chunk) {
  return end - off < chunk ? end - off : chunk;
}

// Host: calls launch(Elem{}) with the element type of a dtype combine can sum (both combines'
// launchers); other dtypes raise InvalidUsageError.
template <typename F>
void WithCombineElem(EpDataType dataType, F&& launch) {
  switch (dataType) {
    case EpDataType::kBFloat16: launch(EpBf16Elem{}); break;
    case EpDataType::kFloat16: launch(EpFp16Elem{}); break;
    case EpDataType::kFloat32: launch(EpFp32Elem{}); break;
    default:
      MORI_THROW(InvalidUsageError, "EP combine: no kernel for dtype %s (fp8 combine is not built)",
                 EpDataTypeName(dataType));
  }
}

}  // namespace mori::ops::detail

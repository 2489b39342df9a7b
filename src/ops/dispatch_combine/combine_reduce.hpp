// The fp32 row sums both IntraNode combines share (pull: intranode_combine.cpp, push:
// intranode_combine_push.cpp): a warp sums n rows of 16-byte vectors in a fixed order (ascending
// PE), with as many loads per lane in flight as the registers allow.
#pragma once

#include <cstdint>

#include "intranode_device.hpp"
#include "mori/core/errors.hpp"

namespace mori::ops::detail {

constexpr int kCombineMaxWarps = kEpMaxThreadsPerBlock / kWarpSize;
constexpr int kCombinePeerBatch = 4;  // rows loaded together (weights; token rows when n >= 3)

// out[v] = sum over members j (in order) of rows[j][v], for v in [vb, ve) of this warp's lanes.
// Each lane keeps kB rows x kU vectors of 16-byte loads in flight before it accumulates them.
template <typename Elem, int kB, int kU>
MORI_DEVICE_INLINE void WarpReduceRowsBatched(uint4* __restrict__ out, const uint8_t* const* rows,
                                              int n, int vb, int ve) {
  const int lane = core::LaneId();
  for (int v0 = vb + lane; v0 < ve; v0 += kU * kWarpSize) {
    float acc[kU][Elem::kPerVec];
#pragma unroll
    for (int u = 0; u < kU; u++) {
#pragma unroll
      for (int i = 0; i < Elem::kPerVec; i++) acc[u][i] = 0.0f;
    }
    for (int jb = 0; jb < n; jb += kB) {
      uint4 r[kB][kU];
#pragma unroll
      for (int j = 0; j < kB; j++) {
        if (jb + j < n) {
          const uint4* src = reinterpret_cast<const uint4*>(rows[jb + j]);
#pragma unroll
          for (int u = 0; u < kU; u++) {
            if (v0 + u * kWarpSize < ve) r[j][u] = src[v0 + u * kWarpSize];
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kB; j++) {
        if (jb + j < n) {
#pragma unroll
          for (int u = 0; u < kU; u++) {
            if (v0 + u * kWarpSize < ve) Elem::Accumulate(acc[u], r[j][u]);
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

// Expert-major ("standard MoE") layout of the last dispatch and its way back: the kernels behind
// EpDispatchCombineHandle::ConvertDispatchOutput / ConvertCombineInput (handle.hpp; layout and
// formula: docs/ep.md; buffers: MORI_EP_EXPERT_MAJOR_REGIONS in layout.hpp). Every kernel here is
// local: it reads and writes this PE's memory only and waits for nobody, and all of them take the
// received row count R from the device (*totalRecv), so nothing needs the host.
//
// ConvertDispatchOutput, three launches:
//   1. Mark: for each received row r and each k whose expert e is local, bit r of marks[e] (a row
//      naming e twice marks it once); rowSlot[r][k] = -1 where the k-th expert is not local.
//   2. Assign, one block per local expert e: the slots of e are its marked rows in ascending row
//      order, so row r gets slot = (marked rows of e below r): a block-wide prefix sum of the
//      words' popcounts plus the set bits below r in its word. Writes srcRows, srcPos, counts[e]
//      and rowSlot[r][k] for every k naming e, and clears each word it read. Marks are all zero
//      between conversions: mark sets bits only in words below ceil(R / 32) and assign clears
//      exactly those words (both read the same R).
//   3. Copy: item g < sum(counts) is slot g - prefix[e] of the expert e whose count prefix holds g
//      (EpWordOfPosition); one warp copies that row (16-byte vectors) and its scales row, or, with
//      column-major scales, scatters the row's scale elements into column j of expert e's
//      [scaleDim][Rmax] block (element (j, slot) at j * Rmax + slot).
// ConvertCombineInput, one launch: a warp (several for few rows, EpPartsPerRow) per received row
// r sums weight[r][k] * expertOut[e_k][rowSlot[r][k]] over the k with rowSlot >= 0, in ascending
// k, in fp32 (each product rounded to fp32 and never fused with the addition), and writes the
// sum rounded once to the output dtype into the registered combine input.
#include "combine_reduce.hpp"
#include "common_device.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu_check.hpp"
#include "mori/ops/dispatch_combine/handle.hpp"
#include "mori/shmem/shmem_api.hpp"

namespace mori::ops {
namespace detail {

constexpr int kAssignThreads = 256;
constexpr int kMaxWarps = kEpMaxThreadsPerBlock / kWarpSize;
constexpr int kCopyUnroll = 4;       // 16-byte loads in flight per lane while copying a row
constexpr int kWeightedVectors = 2;  // vectors per lane summed together (loads in flight per row)

// What both directions read of the last dispatch.
struct ExpertMajorCommon {
  const int32_t* totalRecv;
  const void* indices;  // dispatch output [Rmax][K], int32 or int64
  int32_t indexIs64;
  int32_t rank;
  int32_t expertsPerRank;
  int32_t topK;
  int32_t rmax;
  const int32_t* srcPos;  // dispatch output [Rmax]
  int32_t* rowSlot;       // [Rmax][K]
};

struct ToExpertMajorKernelArgs {
  ExpertMajorCommon c;
  int32_t markWords;
  const uint8_t* tokens;  // dispatch output [Rmax][rowBytes]
  uint32_t rowBytes;
  const uint8_t* scales;  // dispatch output [Rmax][scaleBytes], or nullptr (config without scales)
  uint32_t scaleBytes;
  // 0: outScales is [Epr][Rmax][scaleBytes]. Else the scale element size (1, 2, 4 or 8 bytes)
  // and outScales is [Epr][scaleBytes / scaleColumnMajor][Rmax] elements.
  uint32_t scaleColumnMajor;
  uint32_t* marks;     // [Epr][markWords]
  uint8_t* outTokens;  // [Epr][Rmax][rowBytes]
  uint8_t* outScales;  // [Epr][Rmax][scaleBytes]
  int32_t* counts;     // [Epr]
  int32_t* srcRows;    // [Epr][Rmax]
  int32_t* outSrcPos;  // [Epr][Rmax]
};

struct FromExpertMajorKernelArgs {
  ExpertMajorCommon c;
  const uint8_t* expertOut;  // [Epr][expertRows][rowBytes]
  int64_t expertRows;
  uint32_t rowBytes;
  const float* weights;  // [>= R][K]
  uint8_t* out;          // [>= R][rowBytes]: the registered combine input
};

MORI_DEVICE_INLINE int ReceivedRows(const int32_t* totalRecv, int rmax) {
  const int r = *totalRecv;
  return r < 0 ? 0 : (r > rmax ? rmax : r);
}

MORI_DEVICE_INLINE int64_t LoadIndex(const void* indices, int32_t is64, size_t i) {
  return is64 != 0 ? static_cast<const int64_t*>(indices)[i]
                   : static_cast<int64_t>(static_cast<const int32_t*>(indices)[i]);
}

// Exclusive prefix sum of `v` over the block, and (*total) the block's sum. Every thread of the
// block calls it; warpSums holds one int per warp.
MORI_DEVICE_INLINE int BlockExclusiveScan(int v, int* warpSums, int* total) {
  const int warp = core::WarpId();
  const int inclusive = WarpInclusiveScan(v);
  if (core::LaneId() == kWarpSize - 1) warpSums[warp] = inclusive;
  __syncthreads();
  int before = 0, all = 0;
  for (int w = 0; w < core::WarpsPerBlock(); w++) {
    const int s = warpSums[w];
    if (w < warp) before += s;
    all += s;
  }
  __syncthreads();  // warpSums is rewritten by the next call
  *total = all;
  return before + inclusive - v;
}

__global__ void ToExpertMajorMarkKernel(ToExpertMajorKernelArgs a) {
  const int R = ReceivedRows(a.c.totalRecv, a.c.rmax);
  const size_t n = static_cast<size_t>(R) * a.c.topK;
  const int64_t first = static_cast<int64_t>(a.c.rank) * a.c.expertsPerRank;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t e = LoadIndex(a.c.indices, a.c.indexIs64, i) - first;
    if (e >= 0 && e < a.c.expertsPerRank) {
      const int r = static_cast<int>(i / a.c.topK);
      atomicOr(&a.marks[static_cast<size_t>(e) * a.markWords + r / 32], 1u << (r % 32));
    } else {
      a.c.rowSlot[i] = -1;
    }
  }
}

__global__ void __launch_bounds__(kAssignThreads)
    ToExpertMajorAssignKernel(ToExpertMajorKernelArgs a) {
  __shared__ int warpSums[kAssignThreads / kWarpSize];
  const int R = ReceivedRows(a.c.totalRecv, a.c.rmax);
  const int nWords = (R + 31) / 32;
  for (int e = blockIdx.x; e < a.c.expertsPerRank; e += gridDim.x) {
    uint32_t* marks = a.marks + static_cast<size_t>(e) * a.markWords;
    const int64_t expert = static_cast<int64_t>(a.c.rank) * a.c.expertsPerRank + e;
    int base = 0;
    for (int w0 = 0; w0 < nWords; w0 += blockDim.x) {  // uniform over the block
      const int w = w0 + static_cast<int>(threadIdx.x);
      uint32_t bits = 0;
      if (w < nWords) {
        bits = marks[w];
        if (bits != 0) marks[w] = 0;
      }
      int total = 0;
      int slot = base + BlockExclusiveScan(__popc(bits), warpSums, &total);
      while (bits != 0) {
        const int r = w * 32 + (__ffs(static_cast<int>(bits)) - 1);
        bits &= bits - 1;
        const size_t at = static_cast<size_t>(e) * a.c.rmax + slot;
        a.srcRows[at] = r;
        a.outSrcPos[at] = a.c.srcPos[r];
        const size_t row = static_cast<size_t>(r) * a.c.topK;
        for (int k = 0; k < a.c.topK; k++) {
          if (LoadIndex(a.c.indices, a.c.indexIs64, row + k) == expert) a.c.rowSlot[row + k] = slot;
        }
        slot++;
      }
      base += total;
    }
    if (threadIdx.x == 0) a.counts[e] = base;
  }
}

// Column-major scales: this warp's slot of one expert, element j of its scales row (T-sized) to
// element (j, slot) of the expert's [scaleBytes / sizeof(T)][rmax] block at dstE.
template <typename T>
MORI_DEVICE_INLINE void ScatterScaleColumn(uint8_t* dstE, const uint8_t* src, uint32_t scaleBytes,
                                           int rmax, int slot) {
  const int n = static_cast<int>(scaleBytes / sizeof(T));
  for (int j = core::LaneId(); j < n; j += kWarpSize)
    reinterpret_cast<T*>(dstE)[static_cast<size_t>(j) * rmax + slot] =
        reinterpret_cast<const T*>(src)[j];
}

__global__ void __launch_bounds__(kEpMaxThreadsPerBlock)
    ToExpertMajorCopyKernel(ToExpertMajorKernelArgs a) {
  __shared__ int prefix[kEpMaxExpertsPerRank + 1];
  __shared__ int warpSums[kMaxWarps];
  const int Epr = a.c.expertsPerRank;
  int items = 0;
  for (int e0 = 0; e0 < Epr; e0 += blockDim.x) {  // uniform over the block
    const int e = e0 + static_cast<int>(threadIdx.x);
    int total = 0;
    const int before = BlockExclusiveScan(e < Epr ? a.counts[e] : 0, warpSums, &total);
    if (e < Epr) prefix[e] = items + before;
    items += total;
  }
  __syncthreads();
  const int lane = core::LaneId();
  const int warps = core::WarpsPerBlock();
  const int totalWarps = static_cast<int>(gridDim.x) * warps;
  const int vecs = static_cast<int>(a.rowBytes / 16);
  for (int g = static_cast<int>(blockIdx.x) * warps + core::WarpId(); g < items; g += totalWarps) {
    const int e = EpWordOfPosition(prefix, Epr, g);
    const size_t at = static_cast<size_t>(e) * a.c.rmax + (g - prefix[e]);
    const size_t r = static_cast<size_t>(a.srcRows[at]);
    WarpCopyVectors<kCopyUnroll>(reinterpret_cast<uint4*>(a.outTokens + at * a.rowBytes),
                                 reinterpret_cast<const uint4*>(a.tokens + r * a.rowBytes), 0,
                                 vecs);
    if (a.scales != nullptr && a.scaleColumnMajor != 0) {
      const uint8_t* src = a.scales + r * a.scaleBytes;
      uint8_t* dstE = a.outScales + static_cast<size_t>(e) * a.c.rmax * a.scaleBytes;
      const int slot = g - prefix[e];
      switch (a.scaleColumnMajor) {
        case 8: ScatterScaleColumn<uint64_t>(dstE, src, a.scaleBytes, a.c.rmax, slot); break;
        case 4: ScatterScaleColumn<uint32_t>(dstE, src, a.scaleBytes, a.c.rmax, slot); break;
        case 2: ScatterScaleColumn<uint16_t>(dstE, src, a.scaleBytes, a.c.rmax, slot); break;
        default: ScatterScaleColumn<uint8_t>(dstE, src, a.scaleBytes, a.c.rmax, slot); break;
      }
    } else if (a.scales != nullptr) {
      const uint8_t* src = a.scales + r * a.scaleBytes;
      uint8_t* dst = a.outScales + at * a.scaleBytes;
      if (a.scaleBytes % 4 == 0) {  // rows of a multiple of 4 bytes in 256-aligned regions
        for (uint32_t i = lane; i < a.scaleBytes / 4; i += kWarpSize)
          reinterpret_cast<uint32_t*>(dst)[i] = reinterpret_cast<const uint32_t*>(src)[i];
      } else {
        for (uint32_t i = lane; i < a.scaleBytes; i += kWarpSize) dst[i] = src[i];
      }
    }
  }
}

// out[v] = sum over j < n (ascending) of w[j] * rows[j][v] for the vectors v in [vb, ve) of this
// warp's lanes: fp32, each product rounded (core::MulNoContract), one rounding at the end.
template <typename Elem>
MORI_DEVICE_INLINE void WarpWeightedSum(uint4* __restrict__ out, const uint8_t* const* rows,
                                        const float* w, int n, int vb, int ve) {
  constexpr int kU = kWeightedVectors;
  for (int v0 = vb + core::LaneId(); v0 < ve; v0 += kU * kWarpSize) {
    float acc[kU][Elem::kPerVec];
#pragma unroll
    for (int u = 0; u < kU; u++) {
#pragma unroll
      for (int i = 0; i < Elem::kPerVec; i++) acc[u][i] = 0.0f;
    }
    for (int j = 0; j < n; j++) {
      const uint4* src = reinterpret_cast<const uint4*>(rows[j]);
      const float wj = w[j];
      uint4 x[kU];
#pragma unroll
      for (int u = 0; u < kU; u++) {
        if (v0 + u * kWarpSize < ve) x[u] = src[v0 + u * kWarpSize];
      }
#pragma unroll
      for (int u = 0; u < kU; u++) {
        if (v0 + u * kWarpSize < ve) {
          // The elements as fp32: +0.0 + x is x (a -0.0 becomes +0.0, which changes no sum
          // below: every product is added to an accumulator that starts at +0.0).
          float f[Elem::kPerVec];
#pragma unroll
          for (int i = 0; i < Elem::kPerVec; i++) f[i] = 0.0f;
          Elem::Accumulate(f, x[u]);
#pragma unroll
          for (int i = 0; i < Elem::kPerVec; i++) acc[u][i] += core::MulNoContract(wj, f[i]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kU; u++) {
      if (v0 + u * kWarpSize < ve) out[v0 + u * kWarpSize] = Elem::Pack(acc[u]);
    }
  }
}

template <typename Elem>
__global__ void __launch_bounds__(kEpMaxThreadsPerBlock)
    FromExpertMajorKernel(FromExpertMajorKernelArgs a) {
  __shared__ const uint8_t* rowsOf[kMaxWarps][kEpMaxTopK];
  __shared__ float weightsOf[kMaxWarps][kEpMaxTopK];
  const int R = ReceivedRows(a.c.totalRecv, a.c.rmax);
  const int lane = core::LaneId();
  const int warp = core::WarpId();
  const int warps = core::WarpsPerBlock();
  const int totalWarps = static_cast<int>(gridDim.x) * warps;
  const int vecs = static_cast<int>(a.rowBytes / 16);
  const int parts = EpPartsPerRow(R, totalWarps, vecs);
  const int64_t first = static_cast<int64_t>(a.c.rank) * a.c.expertsPerRank;
  const int64_t items = static_cast<int64_t>(R) * parts;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * warps + warp; item < items;
       item += totalWarps) {
    const int r = static_cast<int>(item / parts);
    const int part = static_cast<int>(item % parts);
    const size_t row = static_cast<size_t>(r) * a.c.topK;
    // The row's local experts in ascending k: (expert output row, weight) into this warp's lists.
    int n = 0;
    for (int k0 = 0; k0 < a.c.topK; k0 += kWarpSize) {
      const int k = k0 + lane;
      const int slot = k < a.c.topK ? a.c.rowSlot[row + k] : -1;
      const LaneMask local = core::WarpBallot(slot >= 0);
      if (slot >= 0) {
        const int at = n + core::PopCount(local & LowerLanesMask(lane));
        const int64_t e = LoadIndex(a.c.indices, a.c.indexIs64, row + k) - first;
        rowsOf[warp][at] = a.expertOut + (e * a.expertRows + slot) * a.rowBytes;
        weightsOf[warp][at] = a.weights[row + k];
      }
      n += core::PopCount(local);
    }
    core::WarpSync();
    WarpWeightedSum<Elem>(reinterpret_cast<uint4*>(a.out + static_cast<size_t>(r) * a.rowBytes),
                          rowsOf[warp], weightsOf[warp], n, EpShareBegin(vecs, part, parts),
                          EpShareBegin(vecs, part + 1, parts));
    core::WarpSync();  // the next item rewrites this warp's lists
  }
}

ExpertMajorCommon MakeExpertMajorCommon(const EpDispatchCombineHandle& h, EpIndexType indexType,
                                        uint8_t* rowSlot) {
  const EpDispatchCombineConfig& c = h.Config();
  ExpertMajorCommon m{};
  m.totalRecv = h.TotalRecvTokenNum();
  m.indices = h.DispatchOutIndices();
  m.indexIs64 = indexType == EpIndexType::kInt64 ? 1 : 0;
  m.rank = c.rank;
  m.expertsPerRank = c.numExpertsPerRank;
  m.topK = c.numExpertsPerToken;
  m.rmax = c.MaxNumRecvTokens();
  m.srcPos = h.DispatchSrcTokenPos();
  m.rowSlot = reinterpret_cast<int32_t*>(rowSlot);
  return m;
}

void Launch(void (*kernel)(ToExpertMajorKernelArgs), int blocks, int threads,
            const ToExpertMajorKernelArgs& a, gpuStream_t stream) {
  MORI_CHECK_GPU(core::GpuLaunchKernel(kernel, blocks, threads, 0, stream, false, a));
}

}  // namespace detail

void* EpDispatchCombineHandle::ExpertMajorTokens() const {
  return expertMajorBase != nullptr ? expertMajorBase + expertMajorLayout.tokens : nullptr;
}
void* EpDispatchCombineHandle::ExpertMajorScales() const {
  return expertMajorBase != nullptr && config.ScaleRowBytes() > 0
             ? expertMajorBase + expertMajorLayout.scales
             : nullptr;
}
int32_t* EpDispatchCombineHandle::ExpertMajorCounts() const {
  return expertMajorBase != nullptr
             ? reinterpret_cast<int32_t*>(expertMajorBase + expertMajorLayout.counts)
             : nullptr;
}
int32_t* EpDispatchCombineHandle::ExpertMajorSrcRows() const {
  return expertMajorBase != nullptr
             ? reinterpret_cast<int32_t*>(expertMajorBase + expertMajorLayout.srcRows)
             : nullptr;
}
int32_t* EpDispatchCombineHandle::ExpertMajorSrcPos() const {
  return expertMajorBase != nullptr
             ? reinterpret_cast<int32_t*>(expertMajorBase + expertMajorLayout.srcPos)
             : nullptr;
}

void EpDispatchCombineHandle::AllocateExpertMajor(gpuStream_t stream) {
  if (expertMajorBase != nullptr) return;
  gpuStreamCaptureStatus capture = gpuStreamCaptureStatusNone;
  MORI_CHECK_GPU(gpuStreamIsCapturing(stream, &capture));
  const EpExpertMajorLayout layout = MakeEpExpertMajorLayout(config);
  MORI_ENSURE(capture == gpuStreamCaptureStatusNone, InvalidUsageError,
              "EP convert_dispatch_output: the first conversion of an op allocates its "
              "expert-major buffers (%zu bytes) and cannot run during a graph capture; convert "
              "once before capturing",
              layout.totalBytes);
  // With peer access on, an allocation may wait for this GPU's kernels while holding the runtime
  // lock the RDMA emulator's thread needs to enqueue the copies those kernels wait for: wait for
  // this PE's work first (bounded), so the allocation has nothing to wait for.
  shmem::ShmemDeviceSynchronize();
  void* block = nullptr;
  const gpuError_t err = gpuMalloc(&block, layout.totalBytes);
  if (err != gpuSuccess) {
    (void)gpuGetLastError();
    MORI_THROW(GpuRuntimeError,
               "EP convert_dispatch_output: allocating the expert-major buffers (%zu bytes: "
               "num_experts_per_rank %d x %d rows x %zu-byte rows, plus scales and slot maps) "
               "failed: %s",
               layout.totalBytes, config.numExpertsPerRank, config.MaxNumRecvTokens(),
               config.MaxTokenRowBytes(), gpuGetErrorString(err));
  }
  // Marks must start all zero (the kernels keep them so); the rest is zeroed for determinism.
  const gpuError_t zero = gpuMemsetAsync(block, 0, layout.totalBytes, stream);
  if (zero != gpuSuccess) {
    (void)gpuFree(block);
    MORI_CHECK_GPU(zero);
  }
  expertMajorBase = static_cast<uint8_t*>(block);
  expertMajorLayout = layout;
}

void EpDispatchCombineHandle::ConvertDispatchOutput(const EpToExpertMajorArgs& args,
                                                    gpuStream_t stream) {
  CheckUsable("convert_dispatch_output");
  CheckNoPendingDispatch("convert_dispatch_output", stream);
  MORI_ENSURE(lastNumTokens >= 0, InvalidUsageError,
              "EP convert_dispatch_output: no dispatch yet (it converts the rows of the last "
              "dispatch)");
  int blocks = 0, warps = 0;
  ResolveLaunch(lastNumTokens, args.blockNum, args.warpPerBlock, false, &blocks, &warps);
  AllocateExpertMajor(stream);

  const EpDispatchCombineConfig& c = config;
  detail::ToExpertMajorKernelArgs a{};
  a.c = detail::MakeExpertMajorCommon(*this, lastIndexType,
                                      expertMajorBase + expertMajorLayout.rowSlot);
  a.markWords = (a.c.rmax + 31) / 32;
  a.tokens = static_cast<const uint8_t*>(DispatchOutTokens());
  a.rowBytes = lastRowBytes;
  a.scales = static_cast<const uint8_t*>(DispatchOutScales());  // nullptr: no scales
  a.scaleBytes = static_cast<uint32_t>(c.ScaleRowBytes());
  a.scaleColumnMajor = args.columnMajorScales ? static_cast<uint32_t>(c.scaleTypeSize) : 0u;
  a.marks = reinterpret_cast<uint32_t*>(expertMajorBase + expertMajorLayout.marks);
  a.outTokens = static_cast<uint8_t*>(ExpertMajorTokens());
  a.outScales = static_cast<uint8_t*>(ExpertMajorScales());
  a.counts = ExpertMajorCounts();
  a.srcRows = ExpertMajorSrcRows();
  a.outSrcPos = ExpertMajorSrcPos();

  const int threads = warps * core::kWarpSize;
  detail::Launch(detail::ToExpertMajorMarkKernel, blocks, threads, a, stream);
  detail::Launch(detail::ToExpertMajorAssignKernel, c.numExpertsPerRank, detail::kAssignThreads, a,
                 stream);
  detail::Launch(detail::ToExpertMajorCopyKernel, blocks, threads, a, stream);
  convertedCall = dispatchCalls;
}

void EpDispatchCombineHandle::ConvertCombineInput(const EpFromExpertMajorArgs& args,
                                                  gpuStream_t stream) {
  CheckUsable("convert_combine_input");
  CheckNoPendingDispatch("convert_combine_input", stream);
  MORI_ENSURE(!pendingCombine, InvalidUsageError,
              "EP convert_combine_input on PE %d: a combine_send is pending (it reads the "
              "registered combine input); call combine_recv first",
              config.rank);
  const EpDispatchCombineConfig& c = config;
  MORI_ENSURE(lastNumTokens >= 0, InvalidUsageError,
              "EP convert_combine_input: no dispatch yet (it takes back the rows of the last "
              "dispatch)");
  MORI_ENSURE(expertMajorBase != nullptr && convertedCall == dispatchCalls, InvalidUsageError,
              "EP convert_combine_input: the last dispatch was not converted to the expert-major "
              "layout (call convert_dispatch_output after it: the slots come from that "
              "conversion)");
  MORI_ENSURE(args.dataType == EpDataType::kBFloat16 || args.dataType == EpDataType::kFloat16 ||
                  args.dataType == EpDataType::kFloat32,
              InvalidUsageError,
              "EP convert_combine_input: dtype %s is not supported (bf16, fp16 or fp32)",
              EpDataTypeIsValid(static_cast<int32_t>(args.dataType)) ? EpDataTypeName(args.dataType)
                                                                     : "unknown");
  const size_t rowBytes = CheckedRowBytes("convert_combine_input", args.dataType, args.hiddenDim);
  MORI_ENSURE(args.expertOut != nullptr &&
                  reinterpret_cast<uintptr_t>(args.expertOut) % kEpRowAlignBytes == 0,
              InvalidUsageError,
              "EP convert_combine_input: expert output %p is null or not %d-byte aligned",
              args.expertOut, kEpRowAlignBytes);
  const int rmax = c.MaxNumRecvTokens();
  MORI_ENSURE(args.expertRows >= rmax, InvalidUsageError,
              "EP convert_combine_input: the expert output has %lld rows per expert but a local "
              "expert can receive %d (max_num_tokens_to_recv)",
              static_cast<long long>(args.expertRows), rmax);
  const float* weights = args.weights;
  if (weights == nullptr) {
    weights = DispatchOutWeights();
  } else {
    MORI_ENSURE(reinterpret_cast<uintptr_t>(weights) % 4 == 0, InvalidUsageError,
                "EP convert_combine_input: weights are not 4-byte aligned");
    MORI_ENSURE(args.weightRows >= rmax, InvalidUsageError,
                "EP convert_combine_input: weights have %lld rows; they must cover every row a "
                "dispatch can deliver (%d, max_num_tokens_to_recv)",
                static_cast<long long>(args.weightRows), rmax);
  }
  int blocks = 0, warps = 0;
  ResolveLaunch(lastNumTokens, args.blockNum, args.warpPerBlock, false, &blocks, &warps);

  detail::FromExpertMajorKernelArgs a{};
  a.c = detail::MakeExpertMajorCommon(*this, lastIndexType,
                                      expertMajorBase + expertMajorLayout.rowSlot);
  a.expertOut = static_cast<const uint8_t*>(args.expertOut);
  a.expertRows = args.expertRows;
  a.rowBytes = static_cast<uint32_t>(rowBytes);
  a.weights = weights;
  a.out = static_cast<uint8_t*>(CombineInputBuffer());
  detail::WithCombineElem(args.dataType, [&](auto elem) {
    MORI_CHECK_GPU(core::GpuLaunchKernel(detail::FromExpertMajorKernel<decltype(elem)>, blocks,
                                         warps * core::kWarpSize, 0, stream, false, a));
  });
}

}  // namespace mori::ops

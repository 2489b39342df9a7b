// EpDispatchCombineConfig validation, names, and the buffer layouts (layout.hpp).
#include <algorithm>

#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/ops/dispatch_combine/config.hpp"
#include "mori/ops/dispatch_combine/layout.hpp"

namespace mori::ops {

const char* EpKernelTypeName(EpDispatchCombineKernelType type) {
  switch (type) {
    case EpDispatchCombineKernelType::kIntraNode: return "IntraNode";
    case EpDispatchCombineKernelType::kInterNode: return "InterNode";
    case EpDispatchCombineKernelType::kInterNodeV1: return "InterNodeV1";
    case EpDispatchCombineKernelType::kInterNodeV1LL: return "InterNodeV1LL";
    case EpDispatchCombineKernelType::kAsyncLL: return "AsyncLL";
    case EpDispatchCombineKernelType::kIntraNodeLL: return "IntraNodeLL";
  }
  return "unknown";
}

bool EpKernelTypeIsBuilt(EpDispatchCombineKernelType type) {
  return type == EpDispatchCombineKernelType::kIntraNode ||
         type == EpDispatchCombineKernelType::kInterNode ||
         type == EpDispatchCombineKernelType::kInterNodeV1 ||
         type == EpDispatchCombineKernelType::kInterNodeV1LL ||
         type == EpDispatchCombineKernelType::kAsyncLL;
}

const char* EpQuantTypeName(EpQuantType type) {
  switch (type) {
    case EpQuantType::kNone: return "none";
    case EpQuantType::kFp8DirectCast: return "fp8_direct_cast";
  }
  return "unknown";
}

const char* EpDispatchQuantName(EpDispatchQuant quant) {
  switch (quant) {
    case EpDispatchQuant::kNone: return "none";
    case EpDispatchQuant::kFp8: return "fp8";
    case EpDispatchQuant::kFp8RoundScale: return "fp8 (round_scale)";
    case EpDispatchQuant::kFp8Ue8m0: return "fp8 (use_ue8m0)";
  }
  return "unknown";
}

const char* EpDataTypeName(EpDataType type) {
  switch (type) {
    case EpDataType::kBFloat16: return "bfloat16";
    case EpDataType::kFloat16: return "float16";
    case EpDataType::kFloat32: return "float32";
    case EpDataType::kFp8E4M3Fn: return "float8_e4m3fn";
    case EpDataType::kFp8E4M3Fnuz: return "float8_e4m3fnuz";
  }
  return "unknown";
}

int EpDataTypeSize(EpDataType type) {
  switch (type) {
    case EpDataType::kBFloat16: return 2;
    case EpDataType::kFloat16: return 2;
    case EpDataType::kFloat32: return 4;
    case EpDataType::kFp8E4M3Fn: return 1;
    case EpDataType::kFp8E4M3Fnuz: return 1;
  }
  return 0;
}

bool EpDataTypeIsValid(int32_t value) {
  return value >= static_cast<int32_t>(EpDataType::kBFloat16) &&
         value <= static_cast<int32_t>(EpDataType::kFp8E4M3Fnuz);
}

const char* EpIndexTypeName(EpIndexType type) {
  return type == EpIndexType::kInt64 ? "int64" : "int32";
}

int EpIndexTypeSize(EpIndexType type) { return type == EpIndexType::kInt64 ? 8 : 4; }

namespace {

void CheckRange(const char* field, long long value, long long lo, long long hi,
                const char* why = nullptr) {
  if (value < lo || value > hi) {
    MORI_THROW(InvalidUsageError,
               "EpDispatchCombineConfig.%s = %lld is out of range [%lld, %lld]%s%s", field, value,
               lo, hi, why ? ": " : "", why ? why : "");
  }
}

size_t AlignUp(size_t v, size_t a) { return (v + a - 1) / a * a; }

// An enum field whose value this build has no code for: a value outside the enum is "not a
// <what>", a named one is "not built yet" with what the build has instead.
[[noreturn]] void ThrowNotBuilt(const char* field, const char* what, int value, int numValues,
                                const char* name, const char* instead) {
  MORI_ENSURE(value >= 0 && value < numValues, InvalidUsageError,
              "EpDispatchCombineConfig.%s = %d is not a %s", field, value, what);
  MORI_THROW(InvalidUsageError, "EpDispatchCombineConfig.%s = %s: not built yet (%s)", field, name,
             instead);
}

}  // namespace

void EpDispatchCombineConfig::Validate() const {
  CheckRange("world_size", worldSize, 1, kEpMaxWorldSize);
  CheckRange("rank", rank, 0, worldSize - 1, "must be a rank of the group");
  CheckRange("hidden_dim", hiddenDim, 1, 1 << 20);
  CheckRange("max_token_type_size", maxTokenTypeSize, 1, 8,
             "bytes of the largest token element (1 fp8, 2 bf16/fp16, 4 fp32)");
  MORI_ENSURE(MaxTokenRowBytes() >= static_cast<size_t>(kEpRowAlignBytes), InvalidUsageError,
              "EpDispatchCombineConfig: hidden_dim * max_token_type_size = %zu bytes is smaller "
              "than one %d-byte vector",
              MaxTokenRowBytes(), kEpRowAlignBytes);
  MORI_ENSURE(MaxTokenRowBytes() <= (static_cast<size_t>(16) << 20), InvalidUsageError,
              "EpDispatchCombineConfig: a token row of %zu bytes is larger than 16 MiB",
              MaxTokenRowBytes());
  CheckRange("scale_dim", scaleDim, 0, 1 << 16);
  if (scaleDim > 0) {
    MORI_ENSURE(
        scaleTypeSize == 1 || scaleTypeSize == 2 || scaleTypeSize == 4 || scaleTypeSize == 8,
        InvalidUsageError,
        "EpDispatchCombineConfig.scale_type_size = %d: with scale_dim = %d it must be 1, "
        "2, 4 or 8 bytes",
        scaleTypeSize, scaleDim);
  } else {
    CheckRange("scale_type_size", scaleTypeSize, 0, 8);
  }
  CheckRange("max_num_inp_token_per_rank", maxNumInpTokenPerRank, 1, kEpMaxTokensPerRank);
  CheckRange("num_experts_per_rank", numExpertsPerRank, 1, kEpMaxExpertsPerRank);
  CheckRange("num_experts_per_token", numExpertsPerToken, 1, kEpMaxTopK);
  CheckRange("warp_num_per_block", warpNumPerBlock, 1, kEpMaxThreadsPerBlock / core::kWarpSize,
             "block size is warp_num_per_block * warp size, at most 512 threads");
  CheckRange("block_num", blockNum, 1, 1 << 16);
  CheckRange("gpu_per_node", gpuPerNode, 1, 1 << 16);
  CheckRange("rdma_block_num", rdmaBlockNum, 0, 1 << 16);
  CheckRange("num_qp_per_pe", numQpPerPe, 1, 1 << 10);
  CheckRange("max_total_recv_tokens", maxTotalRecvTokens, 0, 1 << 30,
             "0 means world_size * max_num_inp_token_per_rank");
  if (!EpKernelTypeIsBuilt(kernelType)) {
    ThrowNotBuilt(
        "kernel_type", "kernel type", static_cast<int>(kernelType), kEpNumKernelTypes,
        EpKernelTypeName(kernelType),
        "this build has IntraNode, InterNode, InterNodeV1, InterNodeV1LL and AsyncLL; for "
        "small batches on one node use IntraNode, or AsyncLL for the split phase");
  }
  if (RunsAs() != EpDispatchCombineKernelType::kIntraNode) {
    MORI_ENSURE(worldSize % LocalSize() == 0, InvalidUsageError,
                "EpDispatchCombineConfig: kernel_type %s needs nodes of equal size, but "
                "world_size = %d is not a multiple of gpu_per_node = %d",
                EpKernelTypeName(kernelType), worldSize, gpuPerNode);
  }
  if (IsV1()) {
    CheckRange("num_qp_per_pe", numQpPerPe, 1, kEpV1MaxChannels,
               "InterNodeV1/V1LL: channels (QPs) per rail peer");
    for (int ws : {32, 64}) {
      const size_t smem = EpV1DispatchSmemBytes(*this, ws);
      MORI_ENSURE(smem <= kEpMaxDispatchSmemBytes, InvalidUsageError,
                  "EpDispatchCombineConfig: the %s dispatch kernel would need %zu bytes of "
                  "shared memory (max_num_inp_token_per_rank = %d, gpu_per_node = %d, "
                  "num_experts_per_rank = %d); the limit is %zu",
                  EpKernelTypeName(kernelType), smem, maxNumInpTokenPerRank, LocalSize(),
                  numExpertsPerRank, kEpMaxDispatchSmemBytes);
    }
  }
  MORI_ENSURE(static_cast<int>(quantType) >= 0 && static_cast<int>(quantType) < kEpNumQuantTypes,
              InvalidUsageError,
              "EpDispatchCombineConfig.quant_type = %d is not a quant type (none 0, "
              "fp8_direct_cast 1)",
              static_cast<int>(quantType));
  if (quantType == EpQuantType::kFp8DirectCast) {
    MORI_ENSURE(hiddenDim % kEpFp8CombineAlign == 0, InvalidUsageError,
                "EpDispatchCombineConfig: quant_type fp8_direct_cast needs hidden_dim to be a "
                "multiple of %d (combine rows move as %d-byte vectors of e4m3 codes), got %d",
                kEpFp8CombineAlign, kEpFp8CombineAlign, hiddenDim);
  }
  for (int ws : {32, 64}) {
    size_t smem = EpDispatchSmemBytes(*this, ws);
    MORI_ENSURE(
        smem <= kEpMaxDispatchSmemBytes, InvalidUsageError,
        "EpDispatchCombineConfig: the dispatch kernel would need %zu bytes of shared memory "
        "(max_num_inp_token_per_rank = %d, num_experts_per_rank = %d); the limit is %zu",
        smem, maxNumInpTokenPerRank, numExpertsPerRank, kEpMaxDispatchSmemBytes);
  }
}

size_t EpDispatchSmemBytes(const EpDispatchCombineConfig& c, int warpSize) {
  size_t words = (static_cast<size_t>(c.maxNumInpTokenPerRank) + warpSize - 1) / warpSize;
  return AlignUp(words * (warpSize / 8), 16) + AlignUp((words + 1) * sizeof(int32_t), 16) +
         AlignUp(static_cast<size_t>(c.numExpertsPerRank) * sizeof(int32_t), 16);
}

size_t EpV1DispatchSmemBytes(const EpDispatchCombineConfig& c, int warpSize) {
  const size_t words = (static_cast<size_t>(c.maxNumInpTokenPerRank) + warpSize - 1) / warpSize;
  const size_t lists = static_cast<size_t>(c.LocalSize()) + 1;
  return lists *
             (AlignUp(words * (warpSize / 8), 16) + AlignUp((words + 1) * sizeof(int32_t), 16)) +
         AlignUp(static_cast<size_t>(c.LocalSize()) * c.numExpertsPerRank * sizeof(int32_t), 16);
}

const char* EpRegionRoleName(EpRegionRole role) {
  switch (role) {
    case EpRegionRole::kControl: return "control";
    case EpRegionRole::kOutput: return "output";
    case EpRegionRole::kInput: return "input";
    case EpRegionRole::kStaging: return "staging";
  }
  return "unknown";
}

EpLayoutDims MakeEpLayoutDims(const EpDispatchCombineConfig& c) {
  EpLayoutDims d{};
  d.w = static_cast<size_t>(c.worldSize);
  d.k = static_cast<size_t>(c.numExpertsPerToken);
  d.m = static_cast<size_t>(c.maxNumInpTokenPerRank);
  d.epr = static_cast<size_t>(c.numExpertsPerRank);
  d.rmax = static_cast<size_t>(c.MaxNumRecvTokens());
  d.row = c.MaxTokenRowBytes();
  d.scaleRow = c.ScaleRowBytes();
  d.push = EpPushCombineFits(c) ? 1 : 0;
  d.split = EpSplitDispatchFits(c) ? 1 : 0;
  d.inter = c.RunsAs() == EpDispatchCombineKernelType::kInterNode ? 1 : 0;
  d.landing = d.m * std::min(d.k, d.w);
  d.local = static_cast<size_t>(c.KernelLocalSize());
  d.markWords = (d.rmax + 31) / 32;
  d.hidden = static_cast<size_t>(c.hiddenDim);
  d.fp8 = c.quantType == EpQuantType::kFp8DirectCast ? 1 : 0;
  if (c.IsV1()) {
    const int g = c.LocalSize();
    d.g = static_cast<size_t>(g);
    d.v1Nodes = static_cast<size_t>(c.worldSize / g - 1);
    d.v1Par = c.RunsAs() == EpDispatchCombineKernelType::kInterNodeV1LL ? 2 : 1;
    d.v1Ht = d.v1Par == 1 ? 1 : 0;
    d.v1Q = static_cast<size_t>(c.numQpPerPe);
    // The largest record: the widest row, int64 indices, the config's scales.
    d.v1Rec = EpV1RecordLayout(static_cast<uint32_t>(d.row), c.numExpertsPerToken,
                               static_cast<uint32_t>(d.scaleRow), 8, g)
                  .bytes;
    d.v1Part = EpV1PartialBytes(static_cast<uint32_t>(d.row), c.numExpertsPerToken);
    d.v1CountWords = static_cast<size_t>(EpV1CountWords(g, c.numExpertsPerRank));
  }
  return d;
}

namespace {

// Lays out the regions of one table in order, each kEpBufferAlign-aligned; unused regions (0
// bytes) get offset 0 and take no room.
struct RegionPlacer {
  size_t off = 0;
  std::vector<EpRegionInfo>* out = nullptr;
  size_t Take(const char* name, size_t bytes, EpRegionRole role) {
    const size_t at = bytes == 0 ? 0 : off;
    if (bytes != 0) off = AlignUp(off + bytes, kEpBufferAlign);
    if (out != nullptr) out->push_back(EpRegionInfo{name, at, bytes, role});
    return at;
  }
};

}  // namespace

#define MORI_EP_PLACE(field, name, bytes, role) l->field = p.Take(name, bytes, EpRegionRole::role);

// One expansion of each table: the offsets into *l and, when `out` is set, the region list.
static void PlaceSymmetric(const EpDispatchCombineConfig& c, EpSymmetricLayout* l,
                           std::vector<EpRegionInfo>* out) {
  const EpLayoutDims d = MakeEpLayoutDims(c);
  RegionPlacer p;
  p.out = out;
  MORI_EP_SYMMETRIC_REGIONS(MORI_EP_PLACE, d)
  l->totalBytes = p.off;
}

static void PlaceLocal(const EpDispatchCombineConfig& c, EpLocalLayout* l,
                       std::vector<EpRegionInfo>* out) {
  const EpLayoutDims d = MakeEpLayoutDims(c);
  RegionPlacer p;
  p.out = out;
  MORI_EP_LOCAL_REGIONS(MORI_EP_PLACE, d)
  l->totalBytes = p.off;
}

static void PlaceExpertMajor(const EpDispatchCombineConfig& c, EpExpertMajorLayout* l,
                             std::vector<EpRegionInfo>* out) {
  const EpLayoutDims d = MakeEpLayoutDims(c);
  RegionPlacer p;
  p.out = out;
  MORI_EP_EXPERT_MAJOR_REGIONS(MORI_EP_PLACE, d)
  l->totalBytes = p.off;
}

#undef MORI_EP_PLACE

EpSymmetricLayout MakeEpSymmetricLayout(const EpDispatchCombineConfig& c) {
  EpSymmetricLayout l;
  PlaceSymmetric(c, &l, nullptr);
  return l;
}

EpLocalLayout MakeEpLocalLayout(const EpDispatchCombineConfig& c) {
  EpLocalLayout l;
  PlaceLocal(c, &l, nullptr);
  return l;
}

EpExpertMajorLayout MakeEpExpertMajorLayout(const EpDispatchCombineConfig& c) {
  EpExpertMajorLayout l;
  PlaceExpertMajor(c, &l, nullptr);
  return l;
}

std::vector<EpRegionInfo> EpSymmetricRegions(const EpDispatchCombineConfig& c) {
  EpSymmetricLayout l;
  std::vector<EpRegionInfo> out;
  PlaceSymmetric(c, &l, &out);
  return out;
}

std::vector<EpRegionInfo> EpLocalRegions(const EpDispatchCombineConfig& c) {
  EpLocalLayout l;
  std::vector<EpRegionInfo> out;
  PlaceLocal(c, &l, &out);
  return out;
}

size_t EpSymmetricBytes(const EpDispatchCombineConfig& config) {
  config.Validate();
  return MakeEpSymmetricLayout(config).totalBytes;
}

size_t EpLocalBytes(const EpDispatchCombineConfig& config) {
  config.Validate();
  return MakeEpLocalLayout(config).totalBytes;
}

std::vector<EpRegionInfo> EpExpertMajorRegions(const EpDispatchCombineConfig& c) {
  EpExpertMajorLayout l;
  std::vector<EpRegionInfo> out;
  PlaceExpertMajor(c, &l, &out);
  return out;
}

size_t EpExpertMajorBytes(const EpDispatchCombineConfig& config) {
  config.Validate();
  return MakeEpExpertMajorLayout(config).totalBytes;
}

}  // namespace mori::ops

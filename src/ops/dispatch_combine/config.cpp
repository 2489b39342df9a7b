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
    MORI_THROW(InvalidUsageError, "EpDispatchCombineConfig.%s = %lld is out of range [%lld, %lld]%s%s",
               field, value, lo, hi, why ? ": " : "", why ? why : "");
  }
}

size_t AlignUp(size_t v, size_t a) { return (v + a - 1) / a * a; }

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
    MORI_ENSURE(scaleTypeSize == 1 || scaleTypeSize == 2 || scaleTypeSize == 4 || scaleTypeSize == 8,
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
  switch (kernelType) {
    case EpDispatchCombineKernelType::kIntraNode: break;
    case EpDispatchCombineKernelType::kInterNode:
    case EpDispatchCombineKernelType::kInterNodeV1:
    case EpDispatchCombineKernelType::kInterNodeV1LL:
      MORI_THROW(InvalidUsageError,
                 "EpDispatchCombineConfig.kernel_type = %s: not built yet (this build has the "
                 "IntraNode kernels only; every PE must be reachable over NVLink/xGMI)",
                 EpKernelTypeName(kernelType));
    default:
      MORI_THROW(InvalidUsageError, "EpDispatchCombineConfig.kernel_type = %d is not a kernel type",
                 static_cast<int>(kernelType));
  }
  for (int ws : {32, 64}) {
    size_t smem = EpDispatchSmemBytes(*this, ws);
    MORI_ENSURE(smem <= kEpMaxDispatchSmemBytes, InvalidUsageError,
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

EpSymmetricLayout MakeEpSymmetricLayout(const EpDispatchCombineConfig& c) {
  const size_t w = static_cast<size_t>(c.worldSize);
  const size_t k = static_cast<size_t>(c.numExpertsPerToken);
  const size_t rmax = static_cast<size_t>(c.MaxNumRecvTokens());
  EpSymmetricLayout l;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    size_t at = off;
    off = AlignUp(off + bytes, kEpBufferAlign);
    return at;
  };
  l.countInbox = take(2 * w * w * sizeof(EpSignal));
  l.expertInbox = take(2 * w * static_cast<size_t>(c.numExpertsPerRank) * sizeof(int32_t));
  l.readyInbox = take(2 * w * sizeof(EpSignal));
  l.doneInbox = take(w * sizeof(EpSignal));
  l.arrived = take(w * sizeof(uint64_t));
  l.dispatchOutTokens = take(rmax * c.MaxTokenRowBytes());
  l.dispatchOutWeights = take(rmax * k * sizeof(float));
  l.dispatchOutScales = take(rmax * c.ScaleRowBytes());
  l.dispatchOutIndices = take(rmax * k * sizeof(int64_t));
  l.dispatchOutSrcPos = take(rmax * sizeof(int32_t));
  l.combineInTokens = take(rmax * c.MaxTokenRowBytes());
  l.combineInWeights = take(rmax * k * sizeof(float));
  if (EpPushCombineFits(c)) {
    const size_t slots = 2 * static_cast<size_t>(c.maxNumInpTokenPerRank) * w;  // 2 parities
    l.pushArrived = take(2 * w * sizeof(uint64_t));
    l.pushRecvTokens = take(slots * c.MaxTokenRowBytes());
    l.pushRecvWeights = take(slots * k * sizeof(float));
  }
  l.totalBytes = off;
  return l;
}

EpLocalLayout MakeEpLocalLayout(const EpDispatchCombineConfig& c) {
  const size_t w = static_cast<size_t>(c.worldSize);
  const size_t k = static_cast<size_t>(c.numExpertsPerToken);
  const size_t m = static_cast<size_t>(c.maxNumInpTokenPerRank);
  EpLocalLayout l;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    size_t at = off;
    off = AlignUp(off + bytes, kEpBufferAlign);
    return at;
  };
  l.state = take(sizeof(EpDeviceState));
  l.totalRecv = take(sizeof(int32_t));
  l.localExpertCount = take(static_cast<size_t>(c.numExpertsPerRank) * sizeof(int32_t));
  l.tokenSlot = take(m * w * sizeof(int32_t));
  l.combineOutWeights = take(m * k * sizeof(float));
  l.combineOutTokens = take(m * c.MaxTokenRowBytes());
  l.totalBytes = off;
  return l;
}

size_t EpSymmetricBytes(const EpDispatchCombineConfig& config) {
  config.Validate();
  return MakeEpSymmetricLayout(config).totalBytes;
}

size_t EpLocalBytes(const EpDispatchCombineConfig& config) {
  config.Validate();
  return MakeEpLocalLayout(config).totalBytes;
}

}  // namespace mori::ops

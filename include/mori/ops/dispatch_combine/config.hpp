// Configuration of an expert-parallel dispatch/combine group (MORI's field names).
//
// Plain host C++: no GPU runtime needed, so size hints and validation work anywhere.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mori::ops {

// Which kernel family moves the tokens (MORI's names and numbering, so a value means the same in
// both libraries). kIntraNode: every PE reachable by load/store over NVLink/xGMI. kInterNode: nodes
// of gpuPerNode PEs; same-node PEs by load/store, other nodes by GPU-posted RDMA, one copy per
// destination PE. kInterNodeV1 (high throughput: chunks, credits) and kInterNodeV1LL (low latency:
// parity-buffered, no credits; lists of at most kEpV1LLMaxTokens records go as one WRITE per
// channel, longer ones in V1's chunks): nodes of gpuPerNode PEs, rail-aligned and
// node-deduplicated (a token crosses the network at most once per remote node, to the PE with the
// sender's local index, which forwards it over P2P; docs/ep_internode_v1.md). kAsyncLL (the split
// phase: dispatch_send/dispatch_recv, combine_send/combine_recv, at any
// maxNumInpTokenPerRank): it has no kernels of its own and runs as kIntraNode or kInterNode
// (EpDispatchCombineConfig::RunsAs), with the split-phase staging and the push combine sized for
// its tokens per rank. No type caps maxNumInpTokenPerRank below kEpMaxTokensPerRank.
// kIntraNodeLL is not built: Validate rejects it, naming the built ones.
enum class EpDispatchCombineKernelType : int32_t {
  kIntraNode = 0,
  kInterNode = 1,
  kInterNodeV1 = 2,
  kInterNodeV1LL = 3,
  kAsyncLL = 4,
  kIntraNodeLL = 5,
};
constexpr int32_t kEpNumKernelTypes = 6;  // values 0 .. kEpNumKernelTypes - 1 have names
const char* EpKernelTypeName(EpDispatchCombineKernelType type);
bool EpKernelTypeIsBuilt(EpDispatchCombineKernelType type);

// How combine moves rows on the wire (MORI's numbering). kNone: in the input dtype.
// kFp8DirectCast: every row a PE returns (its own tokens' rows too) is cast to e4m3 (saturating,
// round to nearest even, no scale) before it moves; the token's PE decodes each row to fp32, sums
// in ascending PE order from +0.0 and rounds once to the input dtype. The e4m3 encoding is the
// device's (EpDispatchCombineHandle::CombineFp8Format). Needs a hidden size that is a multiple of
// kEpFp8CombineAlign.
enum class EpQuantType : int32_t {
  kNone = 0,
  kFp8DirectCast = 1,
};
constexpr int32_t kEpNumQuantTypes = 2;
// MORI's config string of a quant type ("none", "fp8_direct_cast").
const char* EpQuantTypeName(EpQuantType type);
// kFp8DirectCast rows are hidden bytes and move as 16-byte vectors.
constexpr int kEpFp8CombineAlign = 16;

// Fused quantisation of one dispatch call (DeepEP's use_fp8 / round_scale / use_ue8m0): the
// sender reads bf16 rows and writes e4m3 codes plus one scale per kEpQuantGroup elements to the
// receiver. Per group: amax = max |x|; scale = max(amax, fp8max * 2^-126) / fp8max (fp32
// division, so 1/scale is finite and an all-zero group has scale 2^-126); kRoundScale and
// kUe8m0 round the scale up to a power of two; code = e4m3(x * (1 / scale)), the product rounded
// once to fp32, the cast rounding to nearest even and saturating at +-fp8max. Scales: fp32
// [rows][hidden / 128], or (kUe8m0) the scales' exponent bytes (bias 127), 4 per 32-bit word,
// scale j in byte j % 4 (little-endian) of word j / 4, unused bytes of the last word 0.
enum class EpDispatchQuant : int32_t {
  kNone = 0,
  kFp8 = 1,
  kFp8RoundScale = 2,
  kFp8Ue8m0 = 3,
};
constexpr int kEpNumDispatchQuants = 4;
constexpr int kEpQuantGroup = 128;  // elements per scale
const char* EpDispatchQuantName(EpDispatchQuant quant);
// Bytes of one row of scales a quantised dispatch of `hiddenDim` elements writes (0 for kNone).
inline int EpDispatchQuantScaleBytes(EpDispatchQuant quant, int hiddenDim) {
  const int groups = hiddenDim / kEpQuantGroup;
  if (quant == EpDispatchQuant::kNone) return 0;
  return quant == EpDispatchQuant::kFp8Ue8m0 ? (groups + 3) / 4 * 4 : groups * 4;
}

// Token element type of one call. Dispatch moves bytes (any of these); combine sums in fp32 and
// needs a floating type it can read (bf16, fp16, fp32).
enum class EpDataType : int32_t {
  kBFloat16 = 0,
  kFloat16 = 1,
  kFloat32 = 2,
  kFp8E4M3Fn = 3,    // NVIDIA / OCP e4m3
  kFp8E4M3Fnuz = 4,  // AMD gfx942 e4m3 (no negative zero, bias 8)
};
const char* EpDataTypeName(EpDataType type);
int EpDataTypeSize(EpDataType type);
bool EpDataTypeIsValid(int32_t value);

// Element type of the top-k expert index tensor.
enum class EpIndexType : int32_t { kInt32 = 0, kInt64 = 1 };
const char* EpIndexTypeName(EpIndexType type);
int EpIndexTypeSize(EpIndexType type);

// Limits of this implementation (checked by Validate and at every call).
constexpr int kEpMaxWorldSize = 32;         // PEs of one IntraNode group
constexpr int kEpMaxTopK = 64;              // numExpertsPerToken
constexpr int kEpMaxExpertsPerRank = 4096;  // numExpertsPerRank (shared-memory histogram)
constexpr int kEpMaxTokensPerRank = 65536;  // maxNumInpTokenPerRank (shared-memory bitmap)
constexpr int kEpMaxThreadsPerBlock = 512;  // kernels are compiled for at most this many
constexpr int kEpRowAlignBytes = 16;        // token rows move as 16-byte vectors
constexpr int kEpSmallBatchTokens = 128;    // small-batch launch defaults up to this many tokens
constexpr int kEpSmallBatchBlocks = 64;  // default blocks (at least) for small batches (measured)
// InterNodeV1LL: a list of at most this many records (a PE's tokens for one remote node, or the
// partials of one rail peer's records) goes as one WRITE per channel; longer lists in V1's chunks.
constexpr int kEpV1LLMaxTokens = 256;
constexpr int kEpV1MaxChannels = 16;  // InterNodeV1/V1LL: numQpPerPe (channels per rail peer)

struct EpDispatchCombineConfig {
  int rank = 0;
  int worldSize = 0;
  int hiddenDim = 4096;             // largest hidden size of any call (a call may use less)
  int scaleDim = 0;                 // per-token scale elements (0: no scales)
  int scaleTypeSize = 0;            // bytes per scale element
  int maxTokenTypeSize = 4;         // largest token element size of any call (sizes buffers)
  int maxNumInpTokenPerRank = 128;  // most tokens one rank dispatches per call
  int numExpertsPerRank = 1;
  int numExpertsPerToken = 2;     // top-k
  int warpNumPerBlock = 8;        // default warps per block (per-call override possible)
  int blockNum = 80;              // default blocks (per-call override possible)
  bool useExternalInpBuf = true;  // combine input is a user tensor (copied) by default
  EpDispatchCombineKernelType kernelType = EpDispatchCombineKernelType::kIntraNode;
  int gpuPerNode = 8;    // inter-node kernels only
  int rdmaBlockNum = 0;  // inter-node kernels only
  int numQpPerPe = 1;    // inter-node kernels only
  // Rows one PE can receive in one dispatch (sizes the receive buffers); 0: W * M (every token of
  // every PE). A dispatch that would exceed it records an error naming the PEs instead of writing.
  int maxTotalRecvTokens = 0;
  EpQuantType quantType = EpQuantType::kNone;  // combine's wire format

  // Raises InvalidUsageError naming the first bad field, its value and the allowed range.
  void Validate() const;

  int NumExperts() const { return worldSize * numExpertsPerRank; }
  // Receive capacity: every source token reaches a PE at most once, so W * M rows always suffice;
  // maxTotalRecvTokens lowers it.
  int MaxNumRecvTokens() const {
    const int all = worldSize * maxNumInpTokenPerRank;
    return maxTotalRecvTokens > 0 && maxTotalRecvTokens < all ? maxTotalRecvTokens : all;
  }
  // PEs per node as the config states it (an op within one node has one node of worldSize PEs).
  int LocalSize() const { return gpuPerNode < worldSize ? gpuPerNode : worldSize; }
  // The kernel type whose kernels, buffer layout and topology rules this config gets: kAsyncLL
  // runs as kIntraNode when all its PEs are one node (LocalSize() == worldSize) and as kInterNode
  // otherwise; every other type runs as itself. Whatever picks kernels or buffers reads this;
  // messages, the agreement across PEs and what users read back keep kernelType.
  EpDispatchCombineKernelType RunsAs() const {
    if (kernelType != EpDispatchCombineKernelType::kAsyncLL) return kernelType;
    return LocalSize() == worldSize ? EpDispatchCombineKernelType::kIntraNode
                                    : EpDispatchCombineKernelType::kInterNode;
  }
  // PEs per node as the kernels see them: every PE of an op that runs as kIntraNode is on its
  // node (whatever gpuPerNode says), else LocalSize().
  int KernelLocalSize() const {
    return RunsAs() == EpDispatchCombineKernelType::kIntraNode ? worldSize : LocalSize();
  }
  // The node-deduplicated kernel types (InterNodeV1, InterNodeV1LL).
  bool IsV1() const {
    const EpDispatchCombineKernelType t = RunsAs();
    return t == EpDispatchCombineKernelType::kInterNodeV1 ||
           t == EpDispatchCombineKernelType::kInterNodeV1LL;
  }
  size_t MaxTokenRowBytes() const {
    return static_cast<size_t>(hiddenDim) * static_cast<size_t>(maxTokenTypeSize);
  }
  size_t ScaleRowBytes() const {
    return static_cast<size_t>(scaleDim) * static_cast<size_t>(scaleTypeSize);
  }
};

}  // namespace mori::ops

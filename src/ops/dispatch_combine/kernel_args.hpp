// Dispatch/combine kernels of every family: argument structs and launchers (internal to src/ops).
// Files by family: intranode_*.cpp, internode_*.cpp and internode_v1_*.cpp hold each family's
// entry points, instantiations and launchers; the IntraNode and InterNode families share their
// bodies (dispatch_body.hpp, combine_body.hpp, combine_push_body.hpp: the family is a template
// parameter); common_device.hpp, combine_reduce.hpp, fp8_quant.hpp and trace_device.hpp are the
// device code every family uses. Protocol: docs/ep.md.
//
// Kernel names. Each family has one entry point per phase, a __global__ named by family and phase
// around the shared body; that name is what profilers show, and what ROCm/mori's and DeepEP's own
// tests look for in a profile:
//   mori::ops::dispatch::EpDispatch{IntraNode,InterNode,InterNodeV1}Kernel
//   mori::ops::combine::EpCombine{IntraNode,InterNode,InterNodeV1}Kernel   (pull; V1: its combine)
//   mori::ops::combine::push::EpCombine{IntraNode,InterNode}Kernel         (push)
// InterNodeV1LL is a mode of the InterNodeV1 kernels. A call launches its phase's kernel once (a
// split call's halves: once each), so a profile holds one row per family name; no other kernel's
// name holds "dispatch", "combine" or "notify" in lower case (helpers stay in mori::ops::detail).
#pragma once

#include <climits>
#include <cstdint>

#include "mori/core/device/wait.hpp"
#include "mori/core/gpu.hpp"
#include "mori/ops/dispatch_combine/config.hpp"
#include "mori/ops/dispatch_combine/layout.hpp"
#include "mori/ops/dispatch_combine/phase.hpp"
#include "mori/shmem/shmem_types.hpp"

namespace mori::ops {

// Kernel family of a launch (template parameter of the shared kernels).
enum class EpFamily : int32_t { kIntraNode = 0, kInterNode = 1 };

// What both kernels need about the group and the handle's buffers.
struct EpKernelCommon {
  int32_t rank;
  int32_t worldSize;
  int32_t maxTokensPerRank;   // M
  int32_t numExpertsPerRank;  // Epr
  int32_t numExperts;
  int32_t topK;                     // K
  int32_t localSize;                // PEs per node (node of PE p: p / localSize)
  int32_t channels;                 // InterNodeV1/V1LL: QPs (channels) per rail peer
  int32_t lowLatency;               // 1: InterNodeV1LL (parity-buffered, no credits), 0: V1
  int32_t maxRecvRows;              // receive capacity (config MaxNumRecvTokens)
  shmem::ShmemDeviceContext shmem;  // peers' heaps (P2P), RDMA endpoints, the wait context
  uint64_t symmHeapOffset;          // offset of the handle's symmetric block in every heap
  EpSymmetricLayout symm;           // offsets inside that block
  uint8_t* symmLocal;               // this PE's symmetric block
  EpDeviceState* state;
  int32_t* tokenSlot;  // [M][W]
  int32_t* v1Route;    // InterNodeV1/V1LL: [R][M][G] (layout.hpp v1Route), else unused
  int32_t* v1ListPos;  // InterNodeV1/V1LL: [M][R]
  int32_t* totalRecv;
  int32_t* localExpertCount;  // [Epr]
  // 1: the launchers launch the kernel as a programmatic dependent launch (MORI_EP_PDL, where the
  // device and the kernels' code allow it; EpKernelEnter waits for the kernel ahead).
  int32_t programmatic;
  // Phase trace (EpDispatchCombineHandle::SetTrace; layout: mori/ops/dispatch_combine/trace.hpp).
  // nullptr: off.
  uint64_t* trace;
  int32_t traceSlots;
  int32_t traceMaxBlocks;
};

// How a scales row is copied: 4-byte words when its size and both bases allow, else bytes.
enum class EpScaleCopy : int32_t { kNone = 0, kWords = 1, kBytes = 2 };

// Which part of the dispatch a launch runs (EpDispatchPhase, phase.hpp; docs/ep_split_phase.md).
// kBoth: the fused dispatch.
// kSend: announce the counts to every PE and write our rows into each destination's staging
// slots (splitTokens etc., [parity][our PE]; InterNode: another node's PE gets them by RDMA
// WRITEs from our stage*, then a tail word in its splitTail); no wait on any peer. kReceive (same
// arguments, later on the stream): wait for every PE's counts and staged rows, copy them to their
// final rows (source PE, then list order: exactly the fused output), place our tokens' slots on
// the destinations (tokenSlot), and advance the epoch. Both halves use the same epoch.

struct EpDispatchKernelArgs {
  EpKernelCommon c;
  EpDispatchPhase phase;
  const uint8_t* inTokens;  // [T][inRowBytes]
  const float* inWeights;   // [T][K] or nullptr
  const uint8_t* inScales;  // [T][scaleBytes] or nullptr
  const void* inIndices;    // [T][K] IndexT
  int32_t numTokens;        // T
  uint32_t rowBytes;        // bytes of a row as it arrives (multiple of 16)
  uint32_t inRowBytes;      // bytes of an input row: rowBytes, or 2 * hidden when quantising
  uint32_t scaleBytes;      // bytes of a scales row as it arrives
  EpScaleCopy scaleCopy;    // kNone when quantising (the kernel writes the scales)
  // kNone: rows are copied. Else bf16 rows are quantised to `fp8Format` codes while copied, and
  // scaleBytes = EpDispatchQuantScaleBytes(quant, hidden) bytes of scales written per row.
  EpDispatchQuant quant;
  int32_t fp8Format;  // core::Fp8Format of the codes (quant only)
  uint64_t format;    // EpDispatchFormat(...) of this call
  // 1: the sending blocks check every expert id against [-1, numExperts) (ids outside count as
  // -1 either way). A PE with such an id flags every count it announces this call
  // (kEpDispatchFormatInputError) and sends its report (the first offender: lowest token, then
  // top-k slot) with them.
  int32_t checkIds;
  // MORI_EP_DISPATCH_LOCAL_BLOCKS (0: unset): blocks on the local copy (EpDispatchLocalBlocks).
  int32_t localBlocks;
  // Host-mapped word (the handle's) where the receive step records the report of the lowest PE
  // that flagged its count for this PE, if the word is 0 (every PE of the call records the same
  // report). nullptr: nothing is recorded.
  uint64_t* inputErrorRecord;
};

// Which part of the push combine a launch runs (EpCombinePhase, phase.hpp). kSend stores our rows
// into their tokens' PEs and publishes them (no wait on any peer); kReceive waits for every PE's
// rows for our tokens and sums them. A split-phase combine is a kSend launch, any work, then a
// kReceive launch with the same arguments; both use the same epoch (only kReceive advances it).

// copyTokens / copyWeights of an IntraNode pull combine whose EpCombinePrecopyKernel, launched just
// before it, signals ready and copies the rows, tagging them chunk by chunk (combineRowsReady),
// possibly while the combine runs (both nonzero flags take it; our own rows are still read in
// inTokens / inWeights).
constexpr int32_t kEpCopiedBefore = 2;

struct EpCombineKernelArgs {
  EpKernelCommon c;
  const uint8_t* inTokens;  // source of the copy when copyTokens
  int64_t inRows;           // rows readable at inTokens (copy only)
  const float* inWeights;   // source of the weights copy when copyWeights
  int64_t inWeightRows;
  EpCombineSource tokenSource;   // announced to peers (kRegistered or kDispatchOut)
  EpCombineSource weightSource;  // kNone, kRegistered or kDispatchOut
  int32_t copyTokens;            // 1: copy inTokens into combineInTokens first; kEpCopiedBefore
  int32_t copyWeights;           // 1: copy inWeights into combineInWeights first; kEpCopiedBefore
  uint8_t* outTokens;            // [T][rowBytes], local
  float* outWeights;             // [T][K], local; nullptr: no output weights
  int32_t numTokens;             // T of the last dispatch
  uint32_t rowBytes;
  int32_t dataType;       // EpDataType, for the cross-PE format check
  int32_t partsPerToken;  // warps sharing one token's row (small batches)
  int32_t staged;         // 1: peer rows arrive by bulk copies into shared memory
  EpCombinePhase phase;   // push combine only: both halves, or one of a split-phase call
  // 1: quant_type fp8_direct_cast. Rows travel as e4m3 codes (fp8Format, a core::Fp8Format) of
  // rowBytes / element size bytes. Pull, InterNode and V1: a kernel first casts the input (the
  // copy source, or the buffer tokenSource names) into combineInFp8, which peers read (never
  // staged). Push: rows are cast while pushed, this PE's own rows into its own slots too.
  int32_t wireFp8;
  int32_t fp8Format;
};

// Whether EpCombinePrecopyKernel, launched just before, takes this combine's external input.
MORI_HD inline bool EpCopiedBefore(const EpCombineKernelArgs& a) {
  return a.copyTokens == kEpCopiedBefore || a.copyWeights == kEpCopiedBefore;
}
// The push combine (combine_push_body.hpp) reads its input in place: inTokens/inWeights are
// this PE's rows (registered buffer, dispatch output or the caller's tensor; inWeights nullptr:
// none) with inRows/inWeightRows readable rows; copyTokens/copyWeights/staged are unused.

// Staged combine (large batches, where the bulk copy engine exists): each warp streams its token's
// rows through kEpCombineStages shared-memory stages of kEpCombineStageBytes (split over the
// token's rows, at most kEpCombineStageRows of them; more rows take the register path).
constexpr int kEpCombineStages = 3;
constexpr int kEpCombineStageBytes = 4096;
constexpr int kEpCombineStageRows = 4;
inline size_t EpCombineStagedSmemBytes(int warps) {
  return static_cast<size_t>(warps) * kEpCombineStages * kEpCombineStageBytes;
}
// The SMs one PE's grids may take so that the grids of every PE on its GPU fit at once (docs/ep.md,
// "Residency"). Under CUDA MPS (mps) the pesOnGpu processes of a GPU run concurrently and each
// sees numSms, its share: with a thread percentage p (1-100) from the environment the GPU has
// numSms * 100 / p SMs, else numSms; each PE gets at most that divided by pesOnGpu. Without MPS the
// processes take turns on the whole GPU, so numSms is returned unchanged, as with one PE.
inline int EpResidentSms(int numSms, int pesOnGpu, bool mps, int mpsThreadPercent) {
  if (!mps || pesOnGpu <= 1) return numSms;
  const long long gpu = mpsThreadPercent >= 1 && mpsThreadPercent <= 100
                            ? static_cast<long long>(numSms) * 100 / mpsThreadPercent
                            : numSms;
  const long long share = gpu / pesOnGpu;
  return static_cast<int>(share < 1 ? 1 : (share < numSms ? share : numSms));
}

// MORI_EP_COMBINE_STAGED=auto stages only ops of at most this many PEs: with 2 H200s staging was
// faster (most rows local or on one link), with 4 it was slower (docs/performance.md, "Staged
// combine").
constexpr int kEpStagedAutoMaxPes = 2;

// Launchers, one per family and phase (their kernels' instantiations are next to them).
void LaunchEpIntraNodeDispatch(const EpDispatchKernelArgs& args, EpIndexType indexType, int blocks,
                               int threads, size_t smemBytes, gpuStream_t stream);
void LaunchEpInterNodeDispatch(const EpDispatchKernelArgs& args, EpIndexType indexType, int blocks,
                               int threads, size_t smemBytes, gpuStream_t stream);
// args.staged (IntraNode only) selects the staged kernel (dynamic shared memory
// EpCombineStagedSmemBytes), which needs PrepareEpCombineStaged() once on the launching device (its
// shared-memory opt-in).
void PrepareEpCombineStaged();
void LaunchEpIntraNodeCombine(const EpCombineKernelArgs& args, EpDataType dataType, int blocks,
                              int threads, gpuStream_t stream);
void LaunchEpInterNodeCombine(const EpCombineKernelArgs& args, EpDataType dataType, int blocks,
                              int threads, gpuStream_t stream);
// quant_type fp8_direct_cast (args.wireFp8): launches the cast of this PE's combine rows into
// combineInFp8 (after PEs p0 to p1 - 1, its readers, finished reading the last combine's codes)
// and returns the arguments of the combine kernel that follows (tokenSource kFp8Wire, no token
// copy). Otherwise launches nothing and returns args. The pull combines' launchers do this
// themselves (combine_cast.cpp).
EpCombineKernelArgs LaunchEpCombineCast(const EpCombineKernelArgs& args, EpDataType dataType,
                                        int p0, int p1, int blocks, int threads,
                                        gpuStream_t stream);
// IntraNode pull combine of an external input (args.copyTokens or copyWeights, no fp8 wire),
// MORI_EP_COMBINE_PRECOPY: launches EpCombinePrecopyKernel (`blocks` blocks; `overlapped`: the
// combine kernel is a programmatic launch, run beside it) and returns the combine kernel's
// arguments (copy flags kEpCopiedBefore: it neither copies nor signals ready, and waits for the
// copied rows' tags).
EpCombineKernelArgs LaunchEpCombinePrecopy(const EpCombineKernelArgs& args, int blocks,
                                           bool overlapped, gpuStream_t stream);
// Whether the kernels' code for this device waits in EpKernelEnter (then they may be launched
// programmatically: EpKernelCommon::programmatic).
bool EpKernelsHaveGridDependency();
// InterNodeV1 / InterNodeV1LL (internode_v1_dispatch.cpp, internode_v1_combine.cpp;
// docs/ep_internode_v1.md): one kernel family, args.c.lowLatency picks the mode. smemBytes:
// EpV1DispatchSmemBytes.
void LaunchEpV1Dispatch(const EpDispatchKernelArgs& args, EpIndexType indexType, int blocks,
                        int threads, size_t smemBytes, gpuStream_t stream);
void LaunchEpV1Combine(const EpCombineKernelArgs& args, EpDataType dataType, int blocks,
                       int threads, gpuStream_t stream);
// The push combine (small-batch configs) of each family.
void LaunchEpIntraNodePushCombine(const EpCombineKernelArgs& args, EpDataType dataType, int blocks,
                                  int threads, gpuStream_t stream);
void LaunchEpInterNodePushCombine(const EpCombineKernelArgs& args, EpDataType dataType, int blocks,
                                  int threads, gpuStream_t stream);

}  // namespace mori::ops

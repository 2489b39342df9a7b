// EpDispatchCombineHandle: allocation, argument checks and launches (no host synchronisation in
// Dispatch/Combine).
#include "mori/ops/dispatch_combine/handle.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "backend.hpp"
#include "kernel_args.hpp"
#include "common_device.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/fp8.hpp"
#include "mori/core/gpu_check.hpp"
#include "mori/core/logging.hpp"
#include "mori/core/mps.hpp"
#include "mori/core/profiler_range.hpp"
#include "mori/ops/dispatch_combine/agreement.hpp"
#include "mori/shmem/shmem_api.hpp"

namespace mori::ops {

namespace {

bool Aligned(const void* p, size_t a) { return (reinterpret_cast<uintptr_t>(p) % a) == 0; }

// Runs `step`; on failure returns its message (and keeps the exception in *error) instead of
// raising, so this PE can still tell its peers in the next agreement exchange.
template <typename F>
std::string Attempt(F&& step, std::exception_ptr* error) {
  try {
    step();
    return std::string();
  } catch (const core::Error& e) {
    *error = std::current_exception();
    return e.Message();
  } catch (const std::exception& e) {
    *error = std::current_exception();
    return e.what();
  }
}

// The host calls named as profiler ranges, "mori.ep.<call>[<kernel type>]".
enum class EpRangeCall {
  kCreate,
  kRelease,
  kDispatch,
  kDispatchSend,
  kDispatchRecv,
  kCombine,
  kCombineSend,
  kCombineRecv,
  kCount
};

// The range names, every call and kernel type, built the first time ranges are on. Plain
// characters in static storage: valid while static objects are destroyed at exit.
const char* EpRangeName(EpRangeCall call, EpDispatchCombineKernelType type) {
  constexpr int kCalls = static_cast<int>(EpRangeCall::kCount);
  static char names[kCalls][kEpNumKernelTypes + 1][64];
  static std::once_flag built;
  std::call_once(built, [] {
    const char* const calls[kCalls] = {"create",        "release", "dispatch",     "dispatch_send",
                                       "dispatch_recv", "combine", "combine_send", "combine_recv"};
    for (int c = 0; c < kCalls; c++)
      for (int t = 0; t <= kEpNumKernelTypes; t++)
        std::snprintf(names[c][t], sizeof(names[c][t]), "mori.ep.%s[%s]", calls[c],
                      EpKernelTypeName(static_cast<EpDispatchCombineKernelType>(t)));
  });
  int t = static_cast<int>(type);
  if (t < 0 || t >= kEpNumKernelTypes) t = kEpNumKernelTypes;  // "unknown"
  return names[static_cast<int>(call)][t];
}

// A range around one host call of an op of kernel type `type` (one branch when ranges are off).
core::ScopedProfilerRange EpRange(EpRangeCall call, EpDispatchCombineKernelType type) {
  return core::ScopedProfilerRange([call, type] { return EpRangeName(call, type); });
}

// Allgathers this PE's row and returns the first disagreement (empty when every PE agrees).
std::string Agree(EpAgreementStage stage, const EpAgreementRow& mine, int npes) {
  std::vector<EpAgreementRow> rows(static_cast<size_t>(npes));
  shmem::ShmemBootstrapAllgather(&mine, rows.data(), sizeof(EpAgreementRow));
  return FindEpDisagreement(stage, rows.data(), npes);
}

}  // namespace

EpDispatchCombineHandle::EpDispatchCombineHandle(const EpDispatchCombineConfig& cfg) : config(cfg) {
  const auto range = EpRange(EpRangeCall::kCreate, cfg.kernelType);
  MORI_ENSURE(shmem::ShmemIsInitialized(), InvalidUsageError,
              "EpDispatchCombineHandle: shmem is not initialised (call shmem init, e.g. "
              "mori.shmem.shmem_torch_process_group_init, before creating the op)");
  const int pe = shmem::ShmemMyPe();
  const int npes = shmem::ShmemNPes();

  // 1. Local checks. A PE that fails one still takes part in the exchange below (marked
  // unusable), so that every PE raises now instead of waiting for it in a collective.
  std::exception_ptr localError;
  std::string problem = Attempt(
      [&] {
        config.Validate();
        MORI_ENSURE(config.rank == pe && config.worldSize == npes, InvalidUsageError,
                    "EpDispatchCombineHandle: config rank/world_size = %d/%d but shmem has PE %d "
                    "of %d",
                    config.rank, config.worldSize, pe, npes);
        MORI_CHECK_GPU(gpuGetDevice(&device));
        MORI_CHECK_GPU(gpuDeviceGetAttribute(&numSms, gpuDevAttrMultiProcessorCount, device));
        {
          // PEs sharing this GPU under MPS run at once: grids capped so that all fit together
          // (at least world_size blocks stay possible: dispatch needs one per destination).
          const core::MpsClient mps = core::DetectMpsClient();
          const int sharing = shmem::ShmemPesOnMyGpu();
          const int resident = EpResidentSms(numSms, sharing, mps.active, mps.threadPercent);
          if (resident < numSms) {
            MORI_INFO(kLogOps,
                      "EP op on PE %d: %d PEs share this GPU under CUDA MPS; grids capped at %d "
                      "of the %d SMs it shows (docs/ep.md, Residency)",
                      pe, sharing, std::max(resident, std::min(numSms, config.worldSize)), numSms);
            numSms = std::max(resident, std::min(numSms, config.worldSize));
          }
        }
        backend = MakeEpBackend(config, device, numSms);  // checks shmem's topology
        symmLayout = MakeEpSymmetricLayout(config);
        localLayout = MakeEpLocalLayout(config);
        // Whatever used the heap range before (an earlier op) is done on this PE once this
        // returns, and on every PE once the exchange below completes. A pending device error
        // stays pending (calls refuse to launch until it is read).
        shmem::ShmemDeviceSynchronize();
      },
      &localError);

  // 2. Config agreement: same config (and layout) on every PE, enough free heap everywhere.
  EpAgreementRow row =
      problem.empty()
          ? MakeEpConfigAgreementRow(config, shmem::ShmemHeapFreeBytes(), backend->PushCombine())
          : MakeEpUnusableAgreementRow(EpAgreementStage::kConfig, problem);
  std::string disagreement;
  try {
    disagreement = Agree(EpAgreementStage::kConfig, row, npes);
  } catch (...) {
    if (!localError) throw;
  }
  if (localError) std::rethrow_exception(localError);
  if (!disagreement.empty())
    MORI_THROW(InvalidUsageError, "EpDispatchCombineHandle on PE %d: %s (nothing was allocated)",
               pe, disagreement.c_str());

  // 3. Allocate and zero (every PE makes the same ShmemMallocAlign call).
  problem = Attempt(
      [&] {
        symmBase =
            static_cast<uint8_t*>(shmem::ShmemMallocAlign(kEpBufferAlign, symmLayout.totalBytes));
        void* local = nullptr;
        MORI_CHECK_GPU(gpuMalloc(&local, localLayout.totalBytes));
        localBase = static_cast<uint8_t*>(local);
        MORI_CHECK_GPU(gpuMemset(symmBase, 0, symmLayout.totalBytes));
        MORI_CHECK_GPU(gpuMemset(localBase, 0, localLayout.totalBytes));
        void* word = nullptr;
        MORI_CHECK_GPU(gpuHostAlloc(&word, sizeof(uint64_t), gpuHostAllocMapped));
        badExpertIdHost = static_cast<uint64_t*>(word);
        *badExpertIdHost = 0;
        MORI_CHECK_GPU(gpuHostGetDevicePointer(&word, badExpertIdHost, 0));
        badExpertIdDev = static_cast<uint64_t*>(word);
        shmem::ShmemDeviceSynchronize();
        symmHeapOffset = shmem::ShmemQueryMemObj(symmBase).heapOffset;
        for (int p = 0; p < npes; p++) {
          if (shmem::ShmemNodeOf(p) != shmem::ShmemNodeOf(pe)) continue;  // reached by RDMA
          MORI_ENSURE(shmem::ShmemPtrP2p(symmBase, p) != nullptr, InvalidUsageError,
                      "EpDispatchCombineHandle: PE %d's symmetric heap is not mapped on PE %d", p,
                      pe);
        }
      },
      &localError);

  // 4. Allocation agreement: the block has the same heap offset on every PE. The exchange is also
  // the barrier that keeps peers from writing into our buffers before they are zeroed.
  row = problem.empty() ? MakeEpAllocationAgreementRow(symmHeapOffset)
                        : MakeEpUnusableAgreementRow(EpAgreementStage::kAllocation, problem);
  try {
    disagreement = Agree(EpAgreementStage::kAllocation, row, npes);
  } catch (...) {
    if (!localError) localError = std::current_exception();
  }
  if (localError || !disagreement.empty()) {
    // Every PE that completed the exchange reached the same verdict and frees its block here, so
    // offsets stay in step. Nothing was launched on these buffers.
    if (localBase != nullptr) (void)gpuFree(localBase);
    localBase = nullptr;
    if (badExpertIdHost != nullptr) (void)gpuFreeHost(badExpertIdHost);
    badExpertIdHost = badExpertIdDev = nullptr;
    if (symmBase != nullptr) shmem::ShmemFree(symmBase);
    symmBase = nullptr;
    if (localError) std::rethrow_exception(localError);
    MORI_THROW(InvalidUsageError, "EpDispatchCombineHandle on PE %d: %s", pe, disagreement.c_str());
  }
  shmemCtx = shmem::ShmemGetDeviceContext();
  initGeneration = shmem::ShmemInitGeneration();
  MORI_INFO(kLogOps,
            "EP handle: PE %d/%d hidden %d x %d B, max %d tokens/PE, %d experts/PE, top-%d: "
            "%zu B symmetric at heap offset 0x%llx, %zu B local",
            pe, npes, config.hiddenDim, config.maxTokenTypeSize, config.maxNumInpTokenPerRank,
            config.numExpertsPerRank, config.numExpertsPerToken, symmLayout.totalBytes,
            static_cast<unsigned long long>(symmHeapOffset), localLayout.totalBytes);
}

EpDispatchCombineHandle::~EpDispatchCombineHandle() {
  // Never throws: a destructor may run while another exception unwinds. Release() has already
  // left the handle in its final state (buffers freed, or kept where freeing was not safe).
  try {
    Release();
  } catch (const std::exception& e) {
    MORI_WARN(kLogOps, "EP handle: destroying the op on PE %d: %s", config.rank, e.what());
  } catch (...) {
    MORI_WARN(kLogOps, "EP handle: destroying the op on PE %d failed (unknown exception)",
              config.rank);
  }
  if (!shmem::ShmemProcessExiting()) {
    for (gpuEvent_t e : {combineSentEvent, dispatchSentEvent, dispatchRecvEvent})
      if (e != nullptr) (void)gpuEventDestroy(e);
  }
}

void EpDispatchCombineHandle::Release() {
  if (symmBase == nullptr && localBase == nullptr) return;
  const auto range = EpRange(EpRangeCall::kRelease, config.kernelType);
  uint8_t* symm = symmBase;
  uint8_t* local = localBase;
  uint64_t* badIdWord = badExpertIdHost;
  uint8_t* expertMajor = expertMajorBase;  // only this PE's kernels use it
  symmBase = nullptr;                      // idempotent even when a step below raises
  localBase = nullptr;
  badExpertIdHost = badExpertIdDev = nullptr;
  expertMajorBase = nullptr;
  if (shmem::ShmemProcessExiting()) return;  // nothing is freed at exit (ShmemPrepareProcessExit)
  if (shmem::ShmemInitGeneration() != initGeneration) {
    // shmem was finalized since: finalize waited for every PE's device work and the heap is gone.
    (void)gpuFree(local);
    (void)gpuFreeHost(badIdWord);
    if (expertMajor != nullptr) (void)gpuFree(expertMajor);
    return;
  }
  // Peers' kernels read our combine input and write our inboxes after our own last call returned,
  // and ours touch theirs (RDMA writes land even after the kernel that posted them ended): free
  // only once every PE's device work and RDMA requests have drained. Every PE reaches the
  // same verdict from the same rows, so either all free the block or none does (offsets stay
  // symmetric either way).
  std::exception_ptr firstError;
  bool drained = Attempt([] { shmem::ShmemDeviceSynchronize(); }, &firstError).empty();
  std::string disagreement = "the PEs could not be asked";
  try {
    disagreement =
        Agree(EpAgreementStage::kRelease, MakeEpReleaseAgreementRow(drained), config.worldSize);
  } catch (...) {
    if (!firstError) firstError = std::current_exception();
  }
  if (drained) {
    (void)gpuFree(local);
    (void)gpuFreeHost(badIdWord);
    if (expertMajor != nullptr) (void)gpuFree(expertMajor);
  } else {
    MORI_WARN(kLogOps,
              "EP handle on PE %d: this GPU's work did not finish; keeping %zu bytes of device "
              "memory that its kernels may still use",
              config.rank, localLayout.totalBytes);
  }
  if (disagreement.empty()) {
    shmem::ShmemFree(symm);
  } else {
    MORI_WARN(kLogOps,
              "EP handle on PE %d: not freeing the op's %zu bytes of symmetric heap (offset "
              "0x%llx), a PE may still access them: %s. They are released by shmem finalize.",
              config.rank, symmLayout.totalBytes, static_cast<unsigned long long>(symmHeapOffset),
              disagreement.c_str());
    if (!firstError)
      firstError = std::make_exception_ptr(core::RemoteError(
          __FILE__, __LINE__,
          core::StrFormat("EP op release on PE %d: %s", config.rank, disagreement.c_str())));
  }
  if (firstError) std::rethrow_exception(firstError);
}

void EpDispatchCombineHandle::CheckUsable(const char* what, bool refuseOnDeviceError) const {
  MORI_ENSURE(symmBase != nullptr, InvalidUsageError, "EP %s: the op was released", what);
  MORI_ENSURE(shmem::ShmemIsInitialized(), InvalidUsageError,
              "EP %s: shmem was finalized; this op's buffers are gone (create a new op after "
              "re-initialising shmem)",
              what);
  MORI_ENSURE(shmem::ShmemInitGeneration() == initGeneration, InvalidUsageError,
              "EP %s: shmem was re-initialised since this op was created; create a new op", what);
  int dev = -1;
  MORI_CHECK_GPU(gpuGetDevice(&dev));
  MORI_ENSURE(dev == device, InvalidUsageError,
              "EP %s: current device is %d but the op was created on device %d", what, dev, device);
  // After a device-side timeout or abort every bounded wait gives up at once: a kernel launched
  // now would only abort, and its half-done signals would put this PE out of step.
  std::string pending;
  if (refuseOnDeviceError && shmem::ShmemDeviceErrorPending(&pending))
    MORI_THROW(TimeoutError,
               "EP %s refused: a device-side error is pending on this PE (%s). Read it with "
               "shmem_check_device_error() (op.check_device_error() in Python), which clears it; "
               "after a real device timeout the PEs' epochs may disagree: destroy the op on every "
               "PE and create a new one",
               what, pending.c_str());
}

float* EpDispatchCombineHandle::DispatchOutWeights() const {
  return reinterpret_cast<float*>(symmBase + symmLayout.dispatchOutWeights);
}
void* EpDispatchCombineHandle::DispatchOutScales() const {
  return config.ScaleRowBytes() > 0 ? symmBase + symmLayout.dispatchOutScales : nullptr;
}
int32_t* EpDispatchCombineHandle::DispatchSrcTokenPos() const {
  return reinterpret_cast<int32_t*>(symmBase + symmLayout.dispatchOutSrcPos);
}
int32_t* EpDispatchCombineHandle::TotalRecvTokenNum() const {
  return reinterpret_cast<int32_t*>(localBase + localLayout.totalRecv);
}
int32_t* EpDispatchCombineHandle::LocalExpertCount() const {
  return reinterpret_cast<int32_t*>(localBase + localLayout.localExpertCount);
}
float* EpDispatchCombineHandle::CombineInputWeights() const {
  return reinterpret_cast<float*>(symmBase + symmLayout.combineInWeights);
}
float* EpDispatchCombineHandle::CombineOutWeights() const {
  return reinterpret_cast<float*>(localBase + localLayout.combineOutWeights);
}

void EpDispatchCombineHandle::ResolveLaunch(int numTokens, int blockNum, int warpPerBlock,
                                            bool forDispatch, int* blocksOut, int* warpsOut) const {
  const int maxWarps = kEpMaxThreadsPerBlock / core::kWarpSize;
  int blocks = blockNum;
  int warps = warpPerBlock;
  if (blocks <= 0) {
    blocks = config.blockNum;
    // Small batches are latency-bound: both kernels spread them over up to kEpSmallBatchBlocks
    // SMs, more than the config's default blocks (figures: docs/performance.md, "Small batches").
    if (numTokens <= kEpSmallBatchTokens)
      blocks = std::max(blocks, std::min(numSms, kEpSmallBatchBlocks));
  }
  if (warps <= 0) warps = config.warpNumPerBlock;
  MORI_ENSURE(warps >= 1 && warps <= maxWarps, InvalidUsageError,
              "EP %s: warp_per_block = %d is out of range [1, %d] (block size %d threads at most, "
              "warp size %d)",
              forDispatch ? "dispatch" : "combine", warps, maxWarps, kEpMaxThreadsPerBlock,
              core::kWarpSize);
  blocks = std::min(blocks, backend->MaxBlocks(numSms));
  if (forDispatch) {
    MORI_ENSURE(config.worldSize <= numSms, InvalidUsageError,
                "EP dispatch: needs at least world_size = %d blocks but the GPU has %d SMs",
                config.worldSize, numSms);
    blocks = std::max(blocks, config.worldSize);  // at least one block per destination
  }
  MORI_ENSURE(blocks >= 1, InvalidUsageError, "EP: block_num must be positive");
  *blocksOut = blocks;
  *warpsOut = warps;
}

size_t EpDispatchCombineHandle::CheckedRowBytes(const char* what, EpDataType dataType,
                                                int hiddenDim) const {
  const EpDispatchCombineConfig& c = config;
  MORI_ENSURE(hiddenDim >= 1 && hiddenDim <= c.hiddenDim, InvalidUsageError,
              "EP %s: hidden size %d is out of range [1, %d] (config hidden_dim)", what, hiddenDim,
              c.hiddenDim);
  const int esize = EpDataTypeSize(dataType);
  MORI_ENSURE(esize <= c.maxTokenTypeSize, InvalidUsageError,
              "EP %s: dtype %s has %d-byte elements but max_token_type_size is %d", what,
              EpDataTypeName(dataType), esize, c.maxTokenTypeSize);
  const size_t rowBytes = static_cast<size_t>(hiddenDim) * esize;
  MORI_ENSURE(rowBytes % kEpRowAlignBytes == 0, InvalidUsageError,
              "EP %s: a token row is %zu bytes (hidden %d x %d B); it must be a multiple of %d "
              "bytes",
              what, rowBytes, hiddenDim, esize, kEpRowAlignBytes);
  return rowBytes;
}

void EpDispatchCombineHandle::Reset(gpuStream_t) {}

bool EpDispatchCombineHandle::ProgrammaticLaunch() const {
  return backend != nullptr && backend->Programmatic();
}

int EpDispatchCombineHandle::CombineFp8Format() const {
  return backend != nullptr ? backend->CombineFp8Format() : 0;
}

void EpDispatchCombineHandle::FillCommonArgs(EpKernelCommon* common) const {
  const EpDispatchCombineConfig& c = config;
  common->rank = c.rank;
  common->worldSize = c.worldSize;
  common->maxTokensPerRank = c.maxNumInpTokenPerRank;
  common->numExpertsPerRank = c.numExpertsPerRank;
  common->numExperts = c.NumExperts();
  common->topK = c.numExpertsPerToken;
  common->localSize = c.KernelLocalSize();
  common->channels = c.numQpPerPe;
  common->lowLatency = 0;  // FillFamilyArgs: InterNodeV1LL's mode
  common->maxRecvRows = c.MaxNumRecvTokens();
  common->shmem = shmemCtx;
  common->symmHeapOffset = symmHeapOffset;
  common->symm = symmLayout;
  common->symmLocal = symmBase;
  common->state = reinterpret_cast<EpDeviceState*>(localBase + localLayout.state);
  common->tokenSlot = reinterpret_cast<int32_t*>(localBase + localLayout.tokenSlot);
  common->v1Route = reinterpret_cast<int32_t*>(localBase + localLayout.v1Route);
  common->v1ListPos = reinterpret_cast<int32_t*>(localBase + localLayout.v1ListPos);
  common->totalRecv = TotalRecvTokenNum();
  common->localExpertCount = LocalExpertCount();
  common->programmatic = backend->Programmatic() ? 1 : 0;
  common->trace = traceBuf;
  common->traceSlots = traceSlots;
  common->traceMaxBlocks = traceMaxBlocks;
  backend->FillFamilyArgs(common);
}

void EpDispatchCombineHandle::SetTrace(uint64_t* buffer, int slots, int maxBlocks) {
  MORI_ENSURE(buffer == nullptr || (slots > 0 && maxBlocks > 0), InvalidUsageError,
              "EP SetTrace: slots (%d) and maxBlocks (%d) must be positive", slots, maxBlocks);
  MORI_ENSURE(Aligned(buffer, 8), InvalidUsageError, "EP SetTrace: buffer is not 8-byte aligned");
  traceBuf = buffer;
  traceSlots = buffer != nullptr ? slots : 0;
  traceMaxBlocks = buffer != nullptr ? maxBlocks : 0;
}

void EpDispatchCombineHandle::SetDeviceTimeoutForTest(int64_t ms) {
  CheckUsable("SetDeviceTimeoutForTest", false);
  constexpr int64_t kMaxMs = 24ll * 3600 * 1000;  // shmem init's bound on MORI_DEVICE_TIMEOUT_MS
  MORI_ENSURE(ms >= 1 && ms <= kMaxMs, InvalidUsageError,
              "EP SetDeviceTimeoutForTest: %lld ms is out of range [1, %lld]",
              static_cast<long long>(ms), static_cast<long long>(kMaxMs));
  // Every launch copies shmemCtx into its arguments (FillCommonArgs).
  shmemCtx.wait.timeoutNs = static_cast<uint64_t>(ms) * 1000000ull;
}

namespace {

// The message of an input-error report: the same on every PE of the call but for the last clause.
std::string DescribeInputError(uint64_t report, int numExperts) {
  int pe = 0, token = 0, k = 0;
  long long id = 0;
  EpUnpackInputError(report, &pe, &token, &k, &id);
  return core::StrFormat(
      "EP input error: PE %d's dispatch had expert id %lld for token %d (top-k slot %d), outside "
      "[-1, %d) (num_experts); every PE treated it as -1 (no expert) and every PE raises this "
      "error once; the op stays usable",
      pe, id, token, k, numExperts);
}

// `e` with `suffix` appended to its message, same kind and file:line.
[[noreturn]] void RethrowWithSuffix(const core::Error& e, const std::string& suffix) {
  const std::string m = e.Message() + suffix;
  switch (e.Kind()) {
    case core::ErrorKind::kInvalidUsage: throw core::InvalidUsageError(e.File(), e.Line(), m);
    case core::ErrorKind::kTimeout: throw core::TimeoutError(e.File(), e.Line(), m);
    case core::ErrorKind::kSystem: throw core::SystemError(e.File(), e.Line(), m);
    case core::ErrorKind::kGpuRuntime: throw core::GpuRuntimeError(e.File(), e.Line(), m);
    case core::ErrorKind::kRemote: throw core::RemoteError(e.File(), e.Line(), m);
    case core::ErrorKind::kInternal: break;
  }
  throw core::InternalError(e.File(), e.Line(), m);
}

}  // namespace

uint64_t EpDispatchCombineHandle::TakeInputErrorReport() {
  if (heldInputError != 0) return std::exchange(heldInputError, uint64_t{0});
  if (badExpertIdHost == nullptr) return 0;
  if (__atomic_load_n(badExpertIdHost, __ATOMIC_ACQUIRE) == 0) return 0;
  return __atomic_exchange_n(badExpertIdHost, 0, __ATOMIC_ACQ_REL);
}

bool EpDispatchCombineHandle::InputErrorPending(gpuStream_t stream) {
  if (heldInputError == 0 &&
      (badExpertIdHost == nullptr || __atomic_load_n(badExpertIdHost, __ATOMIC_ACQUIRE) == 0))
    return false;
  // Inside a capture nothing runs now: the report (of earlier work) stays for a later check.
  gpuStreamCaptureStatus capture = gpuStreamCaptureStatusNone;
  MORI_CHECK_GPU(gpuStreamIsCapturing(stream, &capture));
  if (capture != gpuStreamCaptureStatusNone) return false;
  if (heldInputError == 0)
    heldInputError = __atomic_exchange_n(badExpertIdHost, 0, __ATOMIC_ACQ_REL);
  return heldInputError != 0;
}

void EpDispatchCombineHandle::TakeExpertIdError(const char* what, bool afterLaunch) {
  const uint64_t seen = TakeInputErrorReport();
  if (seen == 0) return;
  MORI_THROW(
      InvalidUsageError, "%s (raised on PE %d by %s%s)",
      DescribeInputError(seen, config.NumExperts()).c_str(), config.rank, what,
      afterLaunch ? ", after it launched on every PE: the call takes place, do not repeat it" : "");
}

void EpDispatchCombineHandle::CheckDeviceError() {
  const uint64_t seen = TakeInputErrorReport();
  std::string input;
  if (seen != 0)
    input = DescribeInputError(seen, config.NumExperts()) +
            core::StrFormat(" (raised on PE %d by check_device_error)", config.rank);
  try {
    shmem::ShmemCheckDeviceError();
  } catch (const core::Error& e) {
    if (seen == 0) throw;
    RethrowWithSuffix(e, "; and " + input);
  }
  if (seen != 0) MORI_THROW(InvalidUsageError, "%s", input.c_str());
}

bool EpDispatchCombineHandle::SplitDispatchAvailable() const {
  return backend != nullptr && EpSplitDispatchFits(config);
}

bool EpDispatchCombineHandle::SplitCombineAvailable() const {
  return backend != nullptr && backend->PushCombine();
}

void EpDispatchCombineHandle::CheckNoPendingDispatch(const char* what, gpuStream_t stream) {
  MORI_ENSURE(!pendingDispatch, InvalidUsageError,
              "EP %s on PE %d: a dispatch_send is pending; call dispatch_recv first", what,
              config.rank);
  if (!dispatchRecvFollow || stream == dispatchRecvStream) return;
  // A wait must not join a capture with work outside it: only when both sides are alike.
  gpuStreamCaptureStatus capture = gpuStreamCaptureStatusNone;
  MORI_CHECK_GPU(gpuStreamIsCapturing(stream, &capture));
  if ((capture != gpuStreamCaptureStatusNone) == dispatchRecvCaptured)
    MORI_CHECK_GPU(gpuStreamWaitEvent(stream, dispatchRecvEvent, 0));
  dispatchRecvFollow = false;
}

void EpDispatchCombineHandle::Dispatch(const EpDispatchArgs& args, gpuStream_t stream) {
  const auto range = EpRange(EpRangeCall::kDispatch, config.kernelType);
  LaunchDispatchCall(args, EpDispatchPhase::kBoth, stream);
}

void EpDispatchCombineHandle::DispatchSend(const EpDispatchArgs& args, gpuStream_t stream) {
  const auto range = EpRange(EpRangeCall::kDispatchSend, config.kernelType);
  CheckUsable("dispatch_send");
  MORI_ENSURE(SplitDispatchAvailable(), InvalidUsageError,
              "EP dispatch_send: split-phase dispatch is built for kernel_type AsyncLL, and "
              "IntraNode and InterNode with max_num_inp_token_per_rank <= %d; this op is %s with "
              "%d tokens per rank (use dispatch)",
              kEpSplitDispatchMaxTokens, EpKernelTypeName(config.kernelType),
              config.maxNumInpTokenPerRank);
  if (dispatchSentEvent == nullptr)
    MORI_CHECK_GPU(gpuEventCreateWithFlags(&dispatchSentEvent, gpuEventDisableTiming));
  if (dispatchRecvEvent == nullptr)
    MORI_CHECK_GPU(gpuEventCreateWithFlags(&dispatchRecvEvent, gpuEventDisableTiming));
  LaunchDispatchCall(args, EpDispatchPhase::kSend, stream);
  pendingDispatch = true;
  pendingDispatchArgs = args;
  MORI_CHECK_GPU(gpuEventRecord(dispatchSentEvent, stream));
}

void EpDispatchCombineHandle::DispatchReceive(gpuStream_t stream, int blockNum, int warpPerBlock) {
  const auto range = EpRange(EpRangeCall::kDispatchRecv, config.kernelType);
  CheckUsable("dispatch_recv", false);
  MORI_ENSURE(pendingDispatch, InvalidUsageError,
              "EP dispatch_recv: no dispatch_send is pending on PE %d", config.rank);
  pendingDispatch = false;  // the pair ends here even if the launch below fails
  MORI_CHECK_GPU(gpuStreamWaitEvent(stream, dispatchSentEvent, 0));
  EpDispatchArgs args = pendingDispatchArgs;
  if (blockNum >= 1) args.blockNum = blockNum;
  if (warpPerBlock >= 1) args.warpPerBlock = warpPerBlock;
  LaunchDispatchCall(args, EpDispatchPhase::kReceive, stream);
  MORI_CHECK_GPU(gpuEventRecord(dispatchRecvEvent, stream));
  gpuStreamCaptureStatus capture = gpuStreamCaptureStatusNone;
  MORI_CHECK_GPU(gpuStreamIsCapturing(stream, &capture));
  dispatchRecvFollow = true;
  dispatchRecvStream = stream;
  dispatchRecvCaptured = capture != gpuStreamCaptureStatusNone;
}

void EpDispatchCombineHandle::LaunchDispatchCall(const EpDispatchArgs& args, EpDispatchPhase phase,
                                                 gpuStream_t stream) {
  const bool receive = phase == EpDispatchPhase::kReceive;
  const char* what = phase == EpDispatchPhase::kBoth
                         ? "dispatch"
                         : (phase == EpDispatchPhase::kSend ? "dispatch_send" : "dispatch_recv");
  if (!receive) {
    CheckUsable(what);
    MORI_ENSURE(!pendingCombine, InvalidUsageError,
                "EP %s on PE %d: a combine_send is pending; call combine_recv first", what,
                config.rank);
    CheckNoPendingDispatch(what, stream);
  }
  const EpDispatchCombineConfig& c = config;
  MORI_ENSURE(EpDataTypeIsValid(static_cast<int32_t>(args.dataType)), InvalidUsageError,
              "EP dispatch: unknown dtype code %d", static_cast<int>(args.dataType));
  MORI_ENSURE(args.indexType == EpIndexType::kInt32 || args.indexType == EpIndexType::kInt64,
              InvalidUsageError, "EP dispatch: unknown index type code %d",
              static_cast<int>(args.indexType));
  MORI_ENSURE(args.numTokens >= 0 && args.numTokens <= c.maxNumInpTokenPerRank, InvalidUsageError,
              "EP dispatch: %d tokens, but max_num_inp_token_per_rank is %d", args.numTokens,
              c.maxNumInpTokenPerRank);
  const int32_t quantCode = static_cast<int32_t>(args.quant);
  MORI_ENSURE(quantCode >= 0 && quantCode < kEpNumDispatchQuants, InvalidUsageError,
              "EP dispatch: unknown quantisation code %d", static_cast<int>(quantCode));
  const bool quant = args.quant != EpDispatchQuant::kNone;
  // The rows as they arrive: the input's dtype, or the fp8 codes of a quantised dispatch.
  const EpDataType outType = quant ? args.quantOutType : args.dataType;
  size_t quantScaleBytes = 0;
  if (quant) {
    const char* q = EpDispatchQuantName(args.quant);
    MORI_ENSURE(args.dataType == EpDataType::kBFloat16, InvalidUsageError,
                "EP dispatch: %s quantisation needs bfloat16 input, got %s", q,
                EpDataTypeName(args.dataType));
    MORI_ENSURE(args.quantOutType == EpDataType::kFp8E4M3Fn ||
                    args.quantOutType == EpDataType::kFp8E4M3Fnuz,
                InvalidUsageError,
                "EP dispatch: %s quantisation writes float8_e4m3fn or float8_e4m3fnuz, "
                "not %s",
                q,
                EpDataTypeIsValid(static_cast<int32_t>(args.quantOutType))
                    ? EpDataTypeName(args.quantOutType)
                    : "an unknown dtype");
    MORI_ENSURE(args.hiddenDim % kEpQuantGroup == 0, InvalidUsageError,
                "EP dispatch: %s quantisation needs a hidden size that is a multiple of %d (one "
                "scale per %d elements), got %d",
                q, kEpQuantGroup, kEpQuantGroup, args.hiddenDim);
    MORI_ENSURE(args.scales == nullptr, InvalidUsageError,
                "EP dispatch: scales were passed with %s quantisation, which computes them", q);
    quantScaleBytes = static_cast<size_t>(EpDispatchQuantScaleBytes(args.quant, args.hiddenDim));
    MORI_ENSURE(c.scaleTypeSize == 4 && c.ScaleRowBytes() >= quantScaleBytes, InvalidUsageError,
                "EP dispatch: %s quantisation of hidden %d writes %zu 4-byte scale words per row, "
                "but the config has scale_dim = %d, scale_type_size = %d (it needs scale_type_size "
                "= 4 and scale_dim >= %zu)",
                q, args.hiddenDim, quantScaleBytes / 4, c.scaleDim, c.scaleTypeSize,
                quantScaleBytes / 4);
  }
  const size_t rowBytes = CheckedRowBytes("dispatch", outType, args.hiddenDim);
  const size_t inRowBytes = static_cast<size_t>(args.hiddenDim) * EpDataTypeSize(args.dataType);
  if (args.numTokens > 0) {
    MORI_ENSURE(args.input != nullptr && args.indices != nullptr, InvalidUsageError,
                "EP dispatch: input and indices are required when there are tokens");
    MORI_ENSURE(Aligned(args.input, kEpRowAlignBytes), InvalidUsageError,
                "EP dispatch: input %p is not %d-byte aligned", args.input, kEpRowAlignBytes);
    MORI_ENSURE(Aligned(args.indices, EpIndexTypeSize(args.indexType)), InvalidUsageError,
                "EP dispatch: indices %p are not aligned to their element size", args.indices);
    MORI_ENSURE(args.weights == nullptr || Aligned(args.weights, 4), InvalidUsageError,
                "EP dispatch: weights %p are not 4-byte aligned",
                static_cast<const void*>(args.weights));
  }
  const size_t scaleBytes = quant ? quantScaleBytes : c.ScaleRowBytes();
  MORI_ENSURE(args.scales == nullptr || scaleBytes > 0, InvalidUsageError,
              "EP dispatch: scales were given but the config has scale_dim = 0");

  int blocks = 0, warps = 0;
  ResolveLaunch(args.numTokens, args.blockNum, args.warpPerBlock, true, &blocks, &warps);

  EpDispatchKernelArgs k{};
  FillCommonArgs(&k.c);
  k.inTokens = static_cast<const uint8_t*>(args.input);
  k.inWeights = args.weights;
  k.inScales = static_cast<const uint8_t*>(args.scales);
  k.inIndices = args.indices;
  k.numTokens = args.numTokens;
  k.rowBytes = static_cast<uint32_t>(rowBytes);
  k.inRowBytes = static_cast<uint32_t>(inRowBytes);
  k.scaleBytes = static_cast<uint32_t>(scaleBytes);
  k.quant = args.quant;
  k.fp8Format = static_cast<int32_t>(args.quantOutType == EpDataType::kFp8E4M3Fnuz
                                         ? core::Fp8Format::kE4M3Fnuz
                                         : core::Fp8Format::kE4M3Fn);
  if (args.scales == nullptr) {
    k.scaleCopy = EpScaleCopy::kNone;
  } else if (scaleBytes % 4 == 0 && Aligned(args.scales, 4)) {
    k.scaleCopy = EpScaleCopy::kWords;
  } else {
    k.scaleCopy = EpScaleCopy::kBytes;
  }
  k.format = EpDispatchFormat(k.rowBytes, static_cast<int>(outType),
                              static_cast<int>(args.indexType), static_cast<int>(quantCode));
  // The senders check the ids; the receive step (fused, or the receive half) records the report
  // every PE of the call agrees on. A report never stops a launch (docs/ep.md, "Errors").
  k.checkIds = args.checkExpertIds && !receive ? 1 : 0;
  k.localBlocks = backend->DispatchLocalBlocks();
  k.inputErrorRecord = badExpertIdDev;
  k.phase = phase;
  if (phase != EpDispatchPhase::kBoth) k.format |= kEpDispatchFormatSplit;
  if (phase == EpDispatchPhase::kSend) k.c.trace = nullptr;  // a trace records the receive half

  backend->LaunchDispatch(k, args.indexType, blocks, warps * core::kWarpSize,
                          backend->DispatchSmemBytes(), stream);
  if (phase == EpDispatchPhase::kSend) return;  // the outputs change with the receive half
  lastNumTokens = args.numTokens;
  lastRowBytes = k.rowBytes;
  lastIndexType = args.indexType;
  dispatchCalls++;
}

void EpDispatchCombineHandle::Combine(const EpCombineArgs& args, gpuStream_t stream) {
  const auto range = EpRange(EpRangeCall::kCombine, config.kernelType);
  LaunchCombineCall(args, EpCombinePhase::kBoth, stream);
}

void EpDispatchCombineHandle::CombineSend(const EpCombineArgs& args, gpuStream_t stream) {
  const auto range = EpRange(EpRangeCall::kCombineSend, config.kernelType);
  if (combineSentEvent == nullptr)
    MORI_CHECK_GPU(gpuEventCreateWithFlags(&combineSentEvent, gpuEventDisableTiming));
  LaunchCombineCall(args, EpCombinePhase::kSend, stream);
  pendingCombine = true;
  pendingCombineArgs = args;
  MORI_CHECK_GPU(gpuEventRecord(combineSentEvent, stream));
}

void EpDispatchCombineHandle::CombineReceive(gpuStream_t stream) {
  const auto range = EpRange(EpRangeCall::kCombineRecv, config.kernelType);
  CheckUsable("combine_recv", false);
  MORI_ENSURE(pendingCombine, InvalidUsageError,
              "EP combine_recv: no combine_send is pending on PE %d", config.rank);
  pendingCombine = false;  // the pair ends here even if the launch below fails
  MORI_CHECK_GPU(gpuStreamWaitEvent(stream, combineSentEvent, 0));
  LaunchCombineCall(pendingCombineArgs, EpCombinePhase::kReceive, stream);
}

void EpDispatchCombineHandle::LaunchCombineCall(const EpCombineArgs& args, EpCombinePhase phase,
                                                gpuStream_t stream) {
  const char* what = phase == EpCombinePhase::kBoth
                         ? "combine"
                         : (phase == EpCombinePhase::kSend ? "combine_send" : "combine_recv");
  CheckUsable(what, phase != EpCombinePhase::kReceive);
  if (phase != EpCombinePhase::kReceive) {
    CheckNoPendingDispatch(what, stream);
    MORI_ENSURE(!pendingCombine, InvalidUsageError,
                "EP %s on PE %d: a combine_send is pending; call combine_recv first", what,
                config.rank);
    MORI_ENSURE(phase == EpCombinePhase::kBoth || backend->PushCombine(), InvalidUsageError,
                "EP combine_send: split-phase combine needs the push combine (kernel_type "
                "AsyncLL, or IntraNode or InterNode with max_num_inp_token_per_rank <= %d; "
                "MORI_EP_COMBINE_PUSH on); this op (kernel_type %s, %d tokens per rank) uses the "
                "%s combine",
                kEpPushCombineMaxTokens, EpKernelTypeName(config.kernelType),
                config.maxNumInpTokenPerRank, backend->CombineName());
  }
  const EpDispatchCombineConfig& c = config;
  MORI_ENSURE(lastNumTokens >= 0, InvalidUsageError,
              "EP combine: no dispatch yet (combine returns the rows of the last dispatch)");
  MORI_ENSURE(args.dataType == EpDataType::kBFloat16 || args.dataType == EpDataType::kFloat16 ||
                  args.dataType == EpDataType::kFloat32,
              InvalidUsageError,
              "EP combine: dtype %s is not supported (combine sums bf16, fp16 or fp32; fp8 combine "
              "is not built)",
              EpDataTypeIsValid(static_cast<int32_t>(args.dataType)) ? EpDataTypeName(args.dataType)
                                                                     : "unknown");
  const size_t rowBytes = CheckedRowBytes("combine", args.dataType, args.hiddenDim);
  MORI_ENSURE(args.input != nullptr && Aligned(args.input, kEpRowAlignBytes), InvalidUsageError,
              "EP combine: input %p is null or not %d-byte aligned", args.input, kEpRowAlignBytes);
  MORI_ENSURE(args.inputRows >= 0 && args.weightRows >= 0, InvalidUsageError,
              "EP combine: negative row counts");
  MORI_ENSURE(args.weights == nullptr || Aligned(args.weights, 4), InvalidUsageError,
              "EP combine: weights are not 4-byte aligned");
  const bool fp8 = c.quantType == EpQuantType::kFp8DirectCast;
  MORI_ENSURE(!fp8 || args.hiddenDim % kEpFp8CombineAlign == 0, InvalidUsageError,
              "EP combine: quant_type fp8_direct_cast needs a hidden size that is a multiple of "
              "%d (rows move as %d-byte vectors of e4m3 codes), got %d",
              kEpFp8CombineAlign, kEpFp8CombineAlign, args.hiddenDim);

  EpCombineKernelArgs k{};
  FillCommonArgs(&k.c);

  if (args.input == CombineInputBuffer()) {
    k.tokenSource = EpCombineSource::kRegistered;
  } else if (args.input == DispatchOutTokens()) {
    MORI_ENSURE(rowBytes == lastRowBytes, InvalidUsageError,
                "EP combine: the input is the dispatch output buffer, whose rows are %u bytes, "
                "but combine rows are %zu bytes (hidden %d x %s)",
                lastRowBytes, rowBytes, args.hiddenDim, EpDataTypeName(args.dataType));
    k.tokenSource = EpCombineSource::kDispatchOut;
  } else {
    k.tokenSource = EpCombineSource::kRegistered;
    k.copyTokens = 1;
    k.inTokens = static_cast<const uint8_t*>(args.input);
    k.inRows = args.inputRows;
  }
  if (args.weights == nullptr) {
    k.weightSource = EpCombineSource::kNone;
  } else if (args.weights == CombineInputWeights()) {
    k.weightSource = EpCombineSource::kRegistered;
  } else if (args.weights == DispatchOutWeights()) {
    k.weightSource = EpCombineSource::kDispatchOut;
  } else {
    k.weightSource = EpCombineSource::kRegistered;
    k.copyWeights = 1;
    k.inWeights = args.weights;
    k.inWeightRows = args.weightRows;
  }
  k.outTokens = static_cast<uint8_t*>(CombineOutTokens());
  k.outWeights = args.weights != nullptr ? CombineOutWeights() : nullptr;
  k.numTokens = lastNumTokens;
  k.rowBytes = static_cast<uint32_t>(rowBytes);
  k.dataType = static_cast<int32_t>(args.dataType);
  k.wireFp8 = fp8 ? 1 : 0;
  k.fp8Format = backend->CombineFp8Format();

  int blocks = 0, warps = 0;
  ResolveLaunch(lastNumTokens, args.blockNum, args.warpPerBlock, false, &blocks, &warps);
  const int vecs = static_cast<int>(rowBytes / 16);
  const int totalWarps = blocks * warps;
  // Small batches: several warps per token, at most one item per warp (floor: with ceil, some
  // warps reduce twice in a row while others idle, two rounds of peer-load latency).
  const int parts = detail::EpPartsPerRow(lastNumTokens, totalWarps, vecs);
  k.partsPerToken = parts;
  k.phase = phase;
  if (phase == EpCombinePhase::kSend) k.c.trace = nullptr;  // a trace records the receive half
  backend->LaunchCombine(k, args, c.MaxNumRecvTokens(), blocks, warps * core::kWarpSize, stream);
}

}  // namespace mori::ops

// EpDispatchCombineHandle: the host object of one expert-parallel group. Torch-free: calls take
// device pointers, sizes and a stream.
//
// Semantics (MORI's):
//  * Dispatch: token t of this PE goes once to every distinct PE owning one of its top-k experts
//    (expert e lives on PE e / numExpertsPerRank; -1 or any id outside [0, numExperts) is no
//    expert), with its weights row (float[K]), scales row (scaleDim x scaleTypeSize bytes) and
//    indices row. Each receiver gets its rows compact and in a fixed order: by source PE, then by
//    source token index. It also gets, per row, the source position srcPe *
//    maxNumInpTokenPerRank + srcToken, the total row count (on the device) and the number of
//    received tokens per local expert.
//  * Combine: for each of this PE's tokens of the last dispatch, the rows its destination PEs
//    return (same row slots as dispatch) are summed in fp32 in ascending PE order and written in
//    the input dtype; weights rows likewise. Repeated runs are bitwise identical.
//  * Both calls are collective (every PE calls them, in the same order, with the same dtype, row
//    size and optional parts), launch one kernel on `stream` and never synchronise the host.
//    Counters and flags are epoch-tagged or reset by the kernels themselves, so back-to-back
//    calls and CUDA-graph replays need no host step.
//  * Outputs live in the handle's buffers and stay valid until the next call of the same kind
//    (dispatch outputs: until this PE's next dispatch starts).
//  * While a device-side error or abort is pending (the error record's abort flag is raised),
//    Dispatch and Combine raise TimeoutError before launching anything, until the error is read
//    (ShmemCheckDeviceError / ShmemStreamSynchronize clear it). After a real device timeout the
//    PEs' epochs may disagree: destroy the handle on every PE and make a new one.
//  * Construction and destruction are collective: every PE creates its handles with the same
//    config and destroys them in the same order (agreement.hpp has what is exchanged).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "mori/core/gpu.hpp"
#include "mori/ops/dispatch_combine/config.hpp"
#include "mori/ops/dispatch_combine/layout.hpp"
#include "mori/ops/dispatch_combine/phase.hpp"
#include "mori/ops/dispatch_combine/trace.hpp"
#include "mori/shmem/shmem_types.hpp"

namespace mori::ops {

struct EpDispatchArgs {
  const void* input = nullptr;  // [numTokens][hiddenDim] of dataType, 16-byte aligned
  EpDataType dataType = EpDataType::kBFloat16;
  int numTokens = 0;               // 0 .. maxNumInpTokenPerRank
  int hiddenDim = 0;               // 1 .. config.hiddenDim; row bytes a multiple of 16
  const float* weights = nullptr;  // [numTokens][K] or nullptr
  const void* scales = nullptr;    // [numTokens][scaleDim] of scaleTypeSize bytes, or nullptr
  const void* indices = nullptr;   // [numTokens][K] global expert ids
  EpIndexType indexType = EpIndexType::kInt32;
  int blockNum = -1;      // -1: config (or the small-batch default)
  int warpPerBlock = -1;  // -1: config (or the small-batch default)
  // The kernel checks every id against [-1, numExperts) (no host synchronisation). An id outside
  // is treated as -1 (no expert) and every PE of the call launches and completes it; this PE's
  // first offender is sent with its counts, so every PE's dispatch records the same report (the
  // lowest such PE's), which TakeExpertIdError / CheckDeviceError raise as InvalidUsageError
  // naming that PE, token, top-k slot and id. No call refuses to launch because of a report.
  bool checkExpertIds = true;
  // Fused quantisation (EpDispatchQuant, config.hpp): dataType bf16, hiddenDim a multiple of
  // kEpQuantGroup, no scales; the receivers get quantOutType codes (kFp8E4M3Fn or kFp8E4M3Fnuz)
  // in DispatchOutTokens() and EpDispatchQuantScaleBytes(quant, hiddenDim) bytes of scales per
  // row, packed, in DispatchOutScales() (the config must reserve them: scaleTypeSize 4).
  EpDispatchQuant quant = EpDispatchQuant::kNone;
  EpDataType quantOutType = EpDataType::kFp8E4M3Fn;
};

struct EpCombineArgs {
  // [inputRows][hiddenDim] rows in dispatch-output order. Three kinds are recognised by address:
  // the registered buffer (CombineInputBuffer(): zero-copy), the dispatch output buffer
  // (DispatchOutTokens(): read in place), anything else (copied into the registered buffer).
  const void* input = nullptr;
  EpDataType dataType = EpDataType::kBFloat16;  // bf16, fp16 or fp32
  int hiddenDim = 0;
  int64_t inputRows = 0;           // rows readable at `input` (checked on the device)
  const float* weights = nullptr;  // [weightRows][K] or nullptr (then no output weights)
  int64_t weightRows = 0;
  int blockNum = -1;
  int warpPerBlock = -1;
};

// Expert-major ("standard MoE", DeepEP low-latency) layout of the last dispatch (docs/ep.md):
// ConvertDispatchOutput groups the received rows by local expert, ConvertCombineInput takes the
// experts' outputs back into the registered combine input, weighted. Both are local (no PE
// waits for another), launch on `stream` and never synchronise the host; the first conversion
// of a handle allocates the EpExpertMajorBytes(config) block, so it must not be inside a graph
// capture (a later one may be).
struct EpToExpertMajorArgs {
  int blockNum = -1;  // -1: config (or the small-batch default)
  int warpPerBlock = -1;
  // Layout of ExpertMajorScales(): false, [Epr][Rmax][scaleDim] (row-major); true, [Epr][scaleDim]
  // [Rmax] (column-major per expert, the slot index contiguous: DeepEP's low-latency scales),
  // elements of scaleTypeSize bytes. The region's size is the same.
  bool columnMajorScales = false;
};

struct EpFromExpertMajorArgs {
  const void* expertOut = nullptr;  // [numExpertsPerRank][expertRows][hiddenDim], 16-byte aligned
  EpDataType dataType = EpDataType::kBFloat16;  // bf16, fp16 or fp32: also the output's dtype
  int hiddenDim = 0;
  int64_t expertRows = 0;  // rows per expert (>= MaxNumRecvTokens)
  // [weightRows][K] routing weights of the received rows; nullptr: DispatchOutWeights() (rows
  // from PEs whose dispatch passed no weights are undefined there, as in Dispatch).
  const float* weights = nullptr;
  int64_t weightRows = 0;  // >= MaxNumRecvTokens
  int blockNum = -1;
  int warpPerBlock = -1;
};

// Opaque types of the library's implementation, held by pointer only: the kernels' common
// arguments and a kernel family's requirements and launches. Users never name them.
struct EpKernelCommon;
class EpBackend;

class EpDispatchCombineHandle {
 public:
  // Collective over the shmem PEs (allocates symmetric memory, zeroes it). Raises
  // InvalidUsageError for a bad config, a kernel type that is not built, shmem not initialised,
  // rank/worldSize not matching shmem, or a topology the kernel type cannot serve (IntraNode: a PE
  // not reachable by load/store; InterNode: gpu_per_node not matching shmem's nodes). Before
  // allocating, the PEs exchange their configs through the bootstrap and after allocating the heap
  // offset of the block: if any PE's config (or layout) differs, a PE cannot create the handle, a
  // PE lacks heap, or the offsets differ, every PE raises InvalidUsageError naming the first PE and
  // field that differ, and nothing stays allocated.
  explicit EpDispatchCombineHandle(const EpDispatchCombineConfig& config);
  // Release(), with failures logged as warnings instead of raised (collective, like Release).
  ~EpDispatchCombineHandle();
  EpDispatchCombineHandle(const EpDispatchCombineHandle&) = delete;
  EpDispatchCombineHandle& operator=(const EpDispatchCombineHandle&) = delete;

  void Dispatch(const EpDispatchArgs& args, gpuStream_t stream);
  void Combine(const EpCombineArgs& args, gpuStream_t stream);
  // Split-phase combine (push combine only: IntraNode, small-batch config): CombineSend stores this
  // PE's rows into their tokens' PEs and returns without waiting on any peer; any work may run
  // before CombineReceive, which waits for every PE's rows and writes the outputs Combine would.
  // The input and weights must stay unchanged until CombineReceive has run (it reads this PE's
  // own rows from them). Between the two only CombineReceive is accepted (Dispatch, Combine and
  // a second CombineSend raise InvalidUsageError). The halves may run on different streams (the
  // receive waits for the send); both eager, or both captured in the same graph. Once a send
  // has launched, CombineReceive launches even while a device error is pending (the kernel's
  // waits then end at once), so the PEs stay in step.
  void CombineSend(const EpCombineArgs& args, gpuStream_t stream);
  void CombineReceive(gpuStream_t stream);
  bool CombinePending() const { return pendingCombine; }
  // Split-phase dispatch (IntraNode and InterNode, EpSplitDispatchFits:
  // max_num_inp_token_per_rank <= 256; docs/ep_split_phase.md). DispatchSend checks `args` as
  // Dispatch does, announces this PE's counts and writes its rows into staging slots of their
  // destinations, and returns without any block waiting on a peer; any work may run before
  // DispatchReceive, which waits for every PE's rows, compacts them and leaves exactly the outputs
  // Dispatch would have (same rows, order, metadata, counts, and the slots combine uses). The
  // input, weights, scales and indices are read by the send kernel only; keep them unchanged until
  // it has run (work between the halves may run beside it on other streams). Between the two only
  // DispatchReceive is accepted: Dispatch, a second DispatchSend, Combine, CombineSend and the
  // expert-major conversions raise InvalidUsageError. Every PE of a call uses the same form (a PE
  // whose call is the fused dispatch records a format mismatch). Streams, graphs and pending device
  // errors: as CombineSend/CombineReceive; the next call after a receive on another stream waits
  // for it.
  void DispatchSend(const EpDispatchArgs& args, gpuStream_t stream);
  // blockNum / warpPerBlock < 1: DispatchSend's.
  void DispatchReceive(gpuStream_t stream, int blockNum = -1, int warpPerBlock = -1);
  bool DispatchPending() const { return pendingDispatch; }
  // Whether this op can split its dispatch (DispatchSend's requirements) / its combine (the push
  // combine, CombineSend's requirement).
  bool SplitDispatchAvailable() const;
  bool SplitCombineAvailable() const;
  // Expert-major layout of the last dispatch's received rows: for local expert e, slot s <
  // ExpertMajorCounts()[e], row e * Rmax + s of ExpertMajorTokens() (and of ExpertMajorScales()
  // when the config has scales) is received row ExpertMajorSrcRows()[e * Rmax + s], whose
  // source position is ExpertMajorSrcPos()[...]. Slots follow received-row order; a row with
  // several local experts appears under each, once per distinct expert. Raises
  // InvalidUsageError before any dispatch, or when the block must be allocated during a capture.
  void ConvertDispatchOutput(const EpToExpertMajorArgs& args, gpuStream_t stream);
  // For each received row r of the last dispatch: CombineInputBuffer() row r = the sum, in fp32
  // and ascending k, of weight[r][k] * expertOut[e_k][slot of r under e_k] over the k whose
  // expert e_k is local, rounded once to args.dataType (no local expert: zeros). Needs the
  // ConvertDispatchOutput of that dispatch; the combine that follows reads the registered buffer.
  void ConvertCombineInput(const EpFromExpertMajorArgs& args, gpuStream_t stream);
  // Kept for MORI compatibility: the kernels reset their own state, so this does nothing.
  void Reset(gpuStream_t stream);
  // Collective (every PE releases its handle; bounded by MORI_HOST_TIMEOUT_MS and the bootstrap's
  // timeout): waits for this GPU's work, then exchanges "drained" with every PE through the
  // bootstrap, and frees the symmetric block only if every PE drained (peers' kernels read and
  // write our block after our own last call returns). If a PE did not drain or a peer never
  // answered, the block is kept (released by shmem finalize; every PE decides alike, so heap
  // offsets stay symmetric) and the error is raised. After shmem was finalized it only frees the
  // local memory. Idempotent: the handle is released even when this raises; later calls raise.
  void Release();

  const EpDispatchCombineConfig& Config() const { return config; }
  int Device() const { return device; }
  size_t SymmetricBytes() const { return symmLayout.totalBytes; }
  size_t LocalBytes() const { return localLayout.totalBytes; }
  // Starts of the two blocks (offsets: EpSymmetricRegions / EpLocalRegions of Config()).
  void* SymmetricBase() const { return symmBase; }
  void* LocalBase() const { return localBase; }

  // Dispatch outputs (first *TotalRecvTokenNum() rows are valid).
  void* DispatchOutTokens() const { return symmBase + symmLayout.dispatchOutTokens; }
  float* DispatchOutWeights() const;
  void* DispatchOutScales() const;  // nullptr when scaleDim == 0
  void* DispatchOutIndices() const { return symmBase + symmLayout.dispatchOutIndices; }
  int32_t* DispatchSrcTokenPos() const;
  int32_t* TotalRecvTokenNum() const;
  int32_t* LocalExpertCount() const;
  // Zero-copy combine input (rows in dispatch-output order) and weights.
  void* CombineInputBuffer() const { return symmBase + symmLayout.combineInTokens; }
  float* CombineInputWeights() const;
  // Expert-major outputs (nullptr before the first ConvertDispatchOutput; offsets:
  // EpExpertMajorRegions of Config()).
  void* ExpertMajorBase() const { return expertMajorBase; }
  void* ExpertMajorTokens() const;
  void* ExpertMajorScales() const;  // nullptr when scaleDim == 0
  int32_t* ExpertMajorCounts() const;
  int32_t* ExpertMajorSrcRows() const;
  int32_t* ExpertMajorSrcPos() const;
  // Combine outputs ([numTokens of the last dispatch] rows are valid).
  void* CombineOutTokens() const { return localBase + localLayout.combineOutTokens; }
  float* CombineOutWeights() const;

  // Whether the kernels are programmatic dependent launches (decided at creation from MORI_EP_PDL,
  // the device and the kernels' code).
  bool ProgrammaticLaunch() const;
  // The e4m3 encoding of quant_type fp8_direct_cast combine rows (core::Fp8Format: 0 e4m3fn,
  // 1 e4m3fnuz): the device's, e4m3fnuz on AMD gfx94x, e4m3fn elsewhere (decided at creation).
  int CombineFp8Format() const;
  // Host view of the last dispatch call (-1 before the first).
  int LastDispatchNumTokens() const { return lastNumTokens; }
  int LastDispatchRowBytes() const { return static_cast<int>(lastRowBytes); }
  // Launch shape a call would use for these overrides (after defaults and clamping).
  void ResolveLaunch(int numTokens, int blockNum, int warpPerBlock, bool forDispatch,
                     int* blocksOut, int* warpsOut) const;
  int MultiProcessorCount() const { return numSms; }
  // Raises (and clears) the input-error report this PE's dispatches recorded (InvalidUsageError
  // naming the PE whose input it was, token, top-k slot and id; every PE of that dispatch recorded
  // the same report). Reads host memory, no synchronisation: a dispatch still running reports at
  // a later check (after synchronising with it, every PE raises). `what` names the caller;
  // afterLaunch: the caller's call has launched (the message says it takes place).
  // Dispatch, Combine and the split-phase halves never raise a report themselves (a PE must not
  // skip a launch its peers wait for): the Python calls ask InputErrorPending before they launch
  // and raise the report it saw after they launched.
  void TakeExpertIdError(const char* what, bool afterLaunch = false);
  // Before a call launches: whether a report is here to be raised once it has launched; false
  // while `stream` captures a graph (nothing would run now, so the report stays for a later
  // check). A report it finds is moved out of the word the dispatch kernels record into (held
  // until TakeExpertIdError or CheckDeviceError takes it), so that the call about to launch can
  // record its own report there: a kernel records only into an empty word.
  bool InputErrorPending(gpuStream_t stream);
  // shmem's device error record (ShmemCheckDeviceError) and this op's input-error report, both
  // read and cleared: raises the device error (with the report appended when there is one), else
  // the report.
  void CheckDeviceError();

  // Per-block phase trace of the kernels launched (or graph-captured) from now on. `buffer` is
  // device memory of kEpTraceKinds * slots * maxBlocks * kEpTraceWords uint64 (layout:
  // mori/ops/dispatch_combine/trace.hpp; reader: mori.ops.trace); nullptr turns it off.
  void SetTrace(uint64_t* buffer, int slots, int maxBlocks);
  // Reads this GPU's trace clock against the host's CLOCK_REALTIME (a short kernel answering the
  // host through mapped memory; best of a few rounds). Needs no other work of this GPU to hold
  // all of its SMs; bounded by MORI_HOST_TIMEOUT_MS (TimeoutError). Defined in trace.cpp.
  EpTraceClockSample SampleTraceClock() const;
  // Test hook: the bound of every device wait of this op's calls launched from now on, in
  // milliseconds (MORI_DEVICE_TIMEOUT_MS as read at shmem init otherwise). Lets a failure-mode
  // test see an attributed timeout in seconds while the job's bound stays long; no other use.
  void SetDeviceTimeoutForTest(int64_t ms);

 private:
  // refuseOnDeviceError = false: every check but the pending device error (the receive half).
  void CheckUsable(const char* what, bool refuseOnDeviceError = true) const;
  // Bytes of a row of `hiddenDim` elements of `dataType`; raises InvalidUsageError (naming `what`)
  // when the hidden size, the element size or the row's 16-byte multiple does not fit the config.
  size_t CheckedRowBytes(const char* what, EpDataType dataType, int hiddenDim) const;
  // Allocates and zeroes the expert-major block on first use (refused during a graph capture).
  void AllocateExpertMajor(gpuStream_t stream);
  // The part of the kernel arguments dispatch and combine share.
  void FillCommonArgs(EpKernelCommon* common) const;

  EpDispatchCombineConfig config;
  EpSymmetricLayout symmLayout;
  EpLocalLayout localLayout;
  int device = -1;
  int numSms = 0;
  std::unique_ptr<EpBackend> backend;  // the kernel family
  uint8_t* symmBase = nullptr;         // local address of the symmetric block
  uint64_t symmHeapOffset = 0;         // its offset in every PE's heap
  uint8_t* localBase = nullptr;
  uint64_t initGeneration =
      0;  // shmem's init generation at construction (notices finalize/re-init)
  shmem::ShmemDeviceContext shmemCtx{};
  // The last CombineSend's arguments, until its CombineReceive, and an event recorded after the
  // send kernel (the receive's stream waits for it: the halves may run on different streams).
  bool pendingCombine = false;
  EpCombineArgs pendingCombineArgs{};
  gpuEvent_t combineSentEvent = nullptr;
  // Combine's checks and launch, for one phase of the push combine (kBoth: the whole combine).
  void LaunchCombineCall(const EpCombineArgs& args, EpCombinePhase phase, gpuStream_t stream);
  // The last DispatchSend's arguments until its DispatchReceive; events after the send (the
  // receive waits for it) and after the receive (a later call on another stream waits for it).
  bool pendingDispatch = false;
  EpDispatchArgs pendingDispatchArgs{};
  gpuEvent_t dispatchSentEvent = nullptr;
  gpuEvent_t dispatchRecvEvent = nullptr;
  bool dispatchRecvFollow = false;  // dispatchRecvEvent is to be waited for by a later call
  gpuStream_t dispatchRecvStream = nullptr;
  bool dispatchRecvCaptured = false;  // recorded while dispatchRecvStream was capturing
  // Dispatch's checks and launch, for one phase (kBoth: the fused dispatch).
  void LaunchDispatchCall(const EpDispatchArgs& args, EpDispatchPhase phase, gpuStream_t stream);
  // Refuses a call named `what` while a split dispatch is pending; makes `stream` wait for the
  // last DispatchReceive when it ran on another stream.
  void CheckNoPendingDispatch(const char* what, gpuStream_t stream);
  int lastNumTokens = -1;
  uint32_t lastRowBytes = 0;
  // Mapped pinned word the dispatch receive step records the agreed input-error report in
  // (EpPackInputError; 0: none).
  uint64_t* badExpertIdHost = nullptr;
  uint64_t* badExpertIdDev = nullptr;
  uint64_t heldInputError = 0;      // a report InputErrorPending moved out of the word (0: none)
  uint64_t TakeInputErrorReport();  // the held report, else the word's, cleared (0: none)
  EpIndexType lastIndexType = EpIndexType::kInt32;
  uint64_t dispatchCalls = 0;          // Dispatch calls launched
  uint64_t convertedCall = 0;          // dispatchCalls at the last ConvertDispatchOutput (0: none)
  uint8_t* expertMajorBase = nullptr;  // expert-major block (lazily allocated; local memory)
  EpExpertMajorLayout expertMajorLayout;
  uint64_t* traceBuf = nullptr;  // SetTrace (debug)
  int traceSlots = 0;
  int traceMaxBlocks = 0;
};

}  // namespace mori::ops

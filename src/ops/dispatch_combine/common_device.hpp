// Device helpers shared by the IntraNode dispatch and combine kernels: signals, peer addressing,
// warp scans, 16-byte row copies and the fp32 accumulation of token vectors.
#pragma once

#include <cstdint>
#include <cstdio>

#include "mori/core/device/wait.hpp"
#include "mori/core/gpu.hpp"
#include "mori/ops/dispatch_combine/layout.hpp"
#include "mori/shmem/device/copy.hpp"
#include "mori/shmem/shmem_device_api.hpp"
#include "fp8_quant.hpp"
#include "kernel_args.hpp"
#include "trace_device.hpp"

namespace mori::ops::detail {

using core::kWarpSize;
using core::LaneMask;

// ---------------------------------------------------------------------------------------------
// Addressing
// ---------------------------------------------------------------------------------------------
// Base of PE `pe`'s symmetric block as mapped here (the host checked every PE is mapped).
MORI_DEVICE_INLINE uint8_t* PeerBlock(const EpKernelCommon& c, int pe) {
  return reinterpret_cast<uint8_t*>(c.shmem.peerHeapBases[pe] + c.symmHeapOffset);
}

template <typename T>
MORI_DEVICE_INLINE T* At(uint8_t* block, size_t offset) {
  return reinterpret_cast<T*>(block + offset);
}

// The first step of every EP kernel, before it reads anything an earlier kernel on the stream
// wrote (its epoch, the caller's inputs): with a programmatic launch the kernel may start while
// the one ahead of it is still finishing, and GridDependencyWait returns when that one completed
// (a plain launch returns at once).
MORI_DEVICE_INLINE void EpKernelEnter() { core::GridDependencyWait(); }

// What every EP kernel knows once it has entered: this call's epoch (the last call's of the same
// kind + 1, kept in EpDeviceState by the last call's last block) and its parity, and the block's
// trace record (nullptr: tracing off).
struct EpKernelStart {
  uint64_t epoch;
  int parity;
  uint64_t* trace;
};

// The prologue of every EP kernel: EpKernelEnter, then the epoch, then (thread 0) the start of
// the block's trace record with `traceParts` (partsPerToken for a combine). Callers reset their
// shared flags and synchronise the block after it.
MORI_DEVICE_INLINE EpKernelStart EpBeginKernel(const EpKernelCommon& c, EpTraceKind kind,
                                               int traceParts, bool waitForPrevious = true) {
  if (waitForPrevious) EpKernelEnter();
  const uint64_t* last =
      kind == EpTraceKind::kDispatch ? &c.state->dispatchEpoch : &c.state->combineEpoch;
  const uint64_t epoch = *reinterpret_cast<const volatile uint64_t*>(last) + 1;
  uint64_t* const trace = EpTraceRecord(c, kind, epoch);
  if (threadIdx.x == 0) EpTraceBegin(trace, epoch, traceParts);
  return EpKernelStart{epoch, static_cast<int>(epoch & 1), trace};
}

// EpKernelStart plus what every EP kernel reads first: the call's shape and the thread's place in
// the block. Kernels and their phase functions take it by const reference (all force-inlined, so
// its fields live in registers). The wait context is NOT in it: each kernel keeps a private copy
// of c.shmem.wait beside it, because the (rare) error path takes that copy's address, and an
// escaping address would put the whole object it belongs to (this frame, or the kernel parameter
// block) into local memory.
struct EpKernelFrame {
  uint64_t epoch;
  int parity;
  uint64_t* tr;  // the block's trace record, nullptr: tracing off
  int W, me, K;  // world size, our rank, top-k
  int tid, nThreads, lane, warp, nWarps;
};

// The frame of a kernel that has begun (EpBeginKernel returned `s`). A kernel with paths of their
// own (dispatch: send or receive half) forms it in each path, after the branch.
MORI_DEVICE_INLINE EpKernelFrame EpKernelFrameOf(const EpKernelCommon& c, const EpKernelStart& s) {
  return EpKernelFrame{s.epoch,
                       s.parity,
                       s.trace,
                       c.worldSize,
                       c.rank,
                       c.topK,
                       static_cast<int>(threadIdx.x),
                       static_cast<int>(blockDim.x),
                       core::LaneId(),
                       core::WarpId(),
                       core::WarpsPerBlock()};
}

// The prologue of every EP kernel (EpBeginKernel), as one frame.
// waitForPrevious = false: the kernel ahead of it let it start early (GridDependentsLaunch) and is
// waited for through flags.
MORI_DEVICE_INLINE EpKernelFrame EpEnterKernel(const EpKernelCommon& c, EpTraceKind kind,
                                               int traceParts, bool waitForPrevious = true) {
  return EpKernelFrameOf(c, EpBeginKernel(c, kind, traceParts, waitForPrevious));
}

// ---------------------------------------------------------------------------------------------
// Signals: value first, then the epoch tag with release order (see EpSignal).
// ---------------------------------------------------------------------------------------------
MORI_DEVICE_INLINE void SignalStore(EpSignal* s, uint64_t value, uint64_t epoch) {
  core::AtomicStoreRelaxedSystem(&s->value, value);
  core::AtomicStoreReleaseSystem(&s->tag, epoch);
}

// The same for one signal slot on each of W PEs, published by ONE thread: values (relaxed), one
// system acq_rel fence, tags (relaxed). A release store waits until every earlier store of the
// thread is acknowledged, so W release stores in a row to W peers cost W NVLink round trips; this
// costs one (figures: docs/performance.md, "Where the LL time goes"). A reader that acquires a
// tag sees its value and everything ordered before the fence (fence + relaxed store = release).
// `slot(p)` returns PE p's slot (nullptr: PE p gets none).
template <typename SlotOf>
MORI_DEVICE_INLINE void SignalStoreAll(int W, SlotOf slot, uint64_t value, uint64_t epoch) {
  for (int p = 0; p < W; p++) {
    if (slot(p) != nullptr) core::AtomicStoreRelaxedSystem(&slot(p)->value, value);
  }
  core::FenceAcqRelSystem();
  for (int p = 0; p < W; p++) {
    if (slot(p) != nullptr) core::AtomicStoreRelaxedSystem(&slot(p)->tag, epoch);
  }
}

// Records a protocol or usage violation that a check found (no wait expired) in the shared device
// error record, kind "usage": `value`, read from the word at `addr`, had to satisfy
// `value <op> required`. The host raises InvalidUsageError.
template <typename T>
MORI_DEVICE_INLINE void ReportError(const core::WaitContext& ctx, int peer, const char* label,
                                    const T* addr, core::CmpOp op, T required, T value) {
  core::RecordUsageError(ctx, peer, label, addr, op, required, value);
}
// The same for a value that is not a word in memory (a kernel argument, a sum formed here).
MORI_DEVICE_INLINE void ReportError(const core::WaitContext& ctx, int peer, const char* label,
                                    core::CmpOp op, uint64_t required, uint64_t value) {
  core::RecordUsageError(ctx, peer, label, static_cast<const uint64_t*>(nullptr), op, required,
                         value);
}

// A receive-capacity overflow kept for later (InterNodeV1/V1LL: found mid-call, recorded by the
// grid's last block once every signal of the call is out, so that no peer waits for one that an
// early abort would skip): rows << 32 | kind << 16 | (pe + 1); kind 1: our own received total
// (pe: this PE), 0: rows of one source for local PE pe. 0: none. Each call keeps the first.
constexpr uint64_t kEpCapOverflowTotal = 1ull << 16;
MORI_DEVICE_INLINE void EpKeepCapOverflow(uint64_t* word, int pe, uint64_t rows, bool total) {
  const uint64_t v = (rows << 32) | (total ? kEpCapOverflowTotal : 0ull) |
                     static_cast<uint64_t>(static_cast<uint32_t>(pe + 1) & 0xFFFFu);
  atomicCAS(reinterpret_cast<unsigned long long*>(word), 0ull, static_cast<unsigned long long>(v));
}
// Records the overflow kept in `word` (if any) as a usage error and clears the word.
MORI_DEVICE_INLINE void EpRecordKeptCapOverflow(const core::WaitContext& wait, uint64_t* word,
                                                int maxRecvRows) {
  const uint64_t v = atomicExch(reinterpret_cast<unsigned long long*>(word), 0ull);
  if (v == 0) return;
  const int pe = static_cast<int>(v & 0xFFFFu) - 1;
  if ((v & kEpCapOverflowTotal) != 0) {
    ReportError(wait, -1, "EP dispatch: rows exceed max_total_recv_tokens", core::CmpOp::kLe,
                static_cast<uint64_t>(maxRecvRows), v >> 32);
  } else {
    ReportError(wait, pe, "EP dispatch: PE rows > max_total_recv_tokens", core::CmpOp::kLe,
                static_cast<uint64_t>(maxRecvRows), v >> 32);
  }
}

// ---------------------------------------------------------------------------------------------
// Input errors every PE of a call learns (docs/ep.md, "Errors"). A sending block that checks ids
// keeps the smallest key token * K + slot of an id outside [-1, numExperts) in a shared word
// (EpNoInputError: none); the PE then flags every count it announces and writes its report
// (EpPackInputError) into the receiver's inputErrorInbox before that count signal. The receive
// step of every PE records the report of the lowest flagging PE for the host.
// ---------------------------------------------------------------------------------------------
constexpr int kEpNoInputError = 0x7FFFFFFF;
static_assert(kEpMaxWorldSize <= core::kWarpSize, "warp 0 holds one lane per source PE");

template <typename IndexT>
MORI_DEVICE_INLINE bool EpBadExpertId(IndexT e, IndexT numExperts) {
  return e < static_cast<IndexT>(-1) || e >= numExperts;
}

// The report of this PE's first bad id (key from the shared word, not kEpNoInputError).
template <typename IndexT>
MORI_DEVICE_INLINE uint64_t EpInputErrorReport(int rank, int key, const IndexT* idx, int K) {
  const int t = key / K;
  const int k = key - t * K;
  return EpPackInputError(rank, t, k, static_cast<long long>(idx[static_cast<size_t>(t) * K + k]));
}

// This PE's inputErrorInbox slot for `src`'s report of a call of `parity`.
MORI_DEVICE_INLINE uint64_t* EpInputErrorSlot(const EpKernelCommon& c, uint8_t* block, int parity,
                                              int src) {
  return At<uint64_t>(block, c.symm.inputErrorInbox) + EpPushArrivedIndex(parity, src, c.worldSize);
}

// Keeps `report` in the host-mapped record unless it holds one the host has not taken yet, and
// prints one line on the PE the report names.
__device__ __noinline__ inline void EpKeepInputError(uint64_t* record, int rank, uint64_t report,
                                                     int numExperts) {
  if (core::AtomicCasSystem<unsigned long long>(reinterpret_cast<unsigned long long*>(record), 0ull,
                                                static_cast<unsigned long long>(report)) != 0ull)
    return;
  int pe = 0, token = 0, k = 0;
  long long id = 0;
  EpUnpackInputError(report, &pe, &token, &k, &id);
  if (pe == rank)
    printf(
        "[MORI device error] rank %d: EP dispatch: expert id %lld of token %d (top-k slot %d) is "
        "outside [-1, %d); every PE treated it as -1 (no expert) and raises InvalidUsageError at "
        "its next check\n",
        rank, id, token, k, numExperts);
}

// Warp 0 of a receiving block, after lane s read PE s's count for this PE (flagged: the count
// carried kEpDispatchFormatInputError; report: this PE's inputErrorInbox slot of s, read after
// that count signal was acquired; lanes >= W pass false): the lowest flagging PE's report goes to
// `record` (nullptr: none). Every lane of warp 0 calls.
MORI_DEVICE_INLINE void EpRecordInputError(const EpKernelCommon& c, uint64_t* record, bool flagged,
                                           uint64_t report) {
  const LaneMask m = core::WarpBallot(flagged);
  if (m == 0) return;
  const int first =
      core::PopCount((m & (~m + static_cast<LaneMask>(1))) - static_cast<LaneMask>(1));
  const uint64_t r = core::WarpShfl(report, first);
  if (core::LaneId() == 0 && record != nullptr) EpKeepInputError(record, c.rank, r, c.numExperts);
}

// Waits until `s` carries `epoch`; returns false on timeout/abort or if it carries a later epoch
// (a protocol violation, recorded). On success *value is the payload.
MORI_DEVICE_INLINE bool SignalWait(const core::WaitContext& ctx, EpSignal* s, uint64_t epoch,
                                   int peer, const char* label, uint64_t* value) {
  if (!core::WaitUntil(ctx, &s->tag, core::CmpOp::kGe, epoch, peer, label)) return false;
  uint64_t seen = core::AtomicLoadAcquireSystem(&s->tag);
  if (seen != epoch) {
    ReportError(ctx, peer, "EP signal from a later call (PEs out of step)", &s->tag,
                core::CmpOp::kEq, epoch, seen);
    return false;
  }
  *value = core::AtomicLoadRelaxedSystem(&s->value);
  return true;
}

// ---------------------------------------------------------------------------------------------
// Inter-node helpers: PEs of another node are reached by RDMA (the shmem device API posts the
// work requests); every signal they receive is one tagged word (EpTagWord).
// ---------------------------------------------------------------------------------------------
MORI_DEVICE_INLINE int NodeOf(const EpKernelCommon& c, int pe) { return pe / c.localSize; }
MORI_DEVICE_INLINE bool IsRemote(const EpKernelCommon& c, int pe) {
  return NodeOf(c, pe) != NodeOf(c, c.rank);
}
constexpr uint64_t kEpTagMask = 0xFFFFFFFF00000000ull;

// Waits until the tagged word at `w` carries `epoch`; *value = its value.
MORI_DEVICE_INLINE bool TagWait(const core::WaitContext& wait, uint64_t* w, uint64_t epoch,
                                int peer, const char* label, uint32_t* value) {
  uint64_t seen = 0;
  if (!core::WaitUntilMasked(wait, w, kEpTagMask, EpTagWord(epoch, 0), peer, label, &seen))
    return false;
  *value = EpTagValue(seen);
  return true;
}

// Waits for the tagged pair {count, format} of src's tokens for dst (interCount) of this call;
// false on timeout/abort or a format other than `format` (recorded). *count: the count;
// *inputError: src flagged an input error (kEpDispatchFormatInputError).
MORI_DEVICE_INLINE bool InterCountWait(const EpKernelCommon& c, const core::WaitContext& wait,
                                       int parity, int src, int dst, uint64_t epoch,
                                       uint64_t format, const char* label, uint32_t* count,
                                       bool* inputError) {
  uint64_t* w = At<uint64_t>(c.symmLocal, c.symm.interCount) +
                EpInterCountIndex(parity, src, dst, c.worldSize);
  uint32_t fmt = 0;
  if (!TagWait(wait, w, epoch, src, label, count) || !TagWait(wait, w + 1, epoch, src, label, &fmt))
    return false;
  if (EpCallFormat(fmt) != static_cast<uint32_t>(format)) {
    ReportError(wait, src, "EP dispatch: PEs passed different dtype/hidden/index type",
                static_cast<const uint64_t*>(w + 1), core::CmpOp::kEq,
                static_cast<uint64_t>(static_cast<uint32_t>(format)), EpCallFormat(fmt));
    return false;
  }
  *inputError = (fmt & kEpDispatchFormatInputError) != 0;
  return true;
}

// This call's token count of PE `src` for PE `dst`, checked against our `format`: the count signal
// in our countInbox (IntraNode: every PE stores its counts into every PE's inbox) or the tagged
// {count, format} pair in our interCount (InterNode). False on timeout/abort or a format mismatch
// (recorded); *count is set on success, and *inputError (when not null) to whether src flagged an
// input error with it.
template <EpFamily kFamily>
MORI_DEVICE_INLINE bool EpCountWait(const EpKernelCommon& c, const core::WaitContext& wait,
                                    int parity, int src, int dst, uint64_t epoch, uint64_t format,
                                    const char* label, uint32_t* count,
                                    bool* inputError = nullptr) {
  bool flagged = false;
  if constexpr (kFamily == EpFamily::kInterNode) {
    if (!InterCountWait(c, wait, parity, src, dst, epoch, format, label, count, &flagged))
      return false;
  } else {
    EpSignal* slot = At<EpSignal>(c.symmLocal, c.symm.countInbox) +
                     EpCountInboxIndex(parity, src, dst, c.worldSize);
    uint64_t v = 0;
    if (!SignalWait(wait, slot, epoch, src, label, &v)) return false;
    if (EpCallFormat(EpFormatOf(v)) != format) {
      ReportError(wait, src,
                  "EP dispatch: PEs passed different dtype/hidden/index type or split phase",
                  &slot->value, core::CmpOp::kEq, format, EpCallFormat(EpFormatOf(v)));
      return false;
    }
    *count = EpCountOf(v);
    flagged = (EpFormatOf(v) & kEpDispatchFormatInputError) != 0;
  }
  if (inputError != nullptr) *inputError = flagged;
  return true;
}

// RDMA WRITE of `bytes` from `src` (in this PE's heap, or <= 64 bytes from anywhere) to PE pe's
// copy of our symmetric address `dst`, on QP 0 to pe (every write of the op on one QP: RC order
// holds between any two of them). Failures are recorded by the shmem device API.
MORI_DEVICE_INLINE bool RdmaWrite(const EpKernelCommon& c, int pe, void* dst, const void* src,
                                  size_t bytes) {
  return bytes == 0 || shmem::ShmemPutMemNbiThreadQp(c.shmem, dst, src, bytes, pe, 0);
}

// Waits for the landing word `w` (landingReady, pushLandTail) of `peer` (another node) to carry
// this call's epoch, and checks its format (EpLandingValue) against our combine's `ready`.
// *weights: the peer's rows came with weights. False on timeout/abort or another format (recorded).
MORI_DEVICE_INLINE bool InterLandingWait(const core::WaitContext& wait, uint64_t* w, uint64_t epoch,
                                         int peer, uint64_t ready, const char* label,
                                         bool* weights) {
  uint32_t v = 0;
  if (!TagWait(wait, w, epoch, peer, label, &v)) return false;
  const uint32_t mine = EpLandingValue(ready, false);
  if ((v & ~0x10u) != mine) {
    ReportError(wait, peer, "EP combine: PEs called combine with different dtype/hidden",
                static_cast<const uint64_t*>(w), core::CmpOp::kEq, static_cast<uint64_t>(mine),
                static_cast<uint64_t>(v & ~0x10u));
    return false;
  }
  *weights = (v & 0x10u) != 0;
  return true;
}

// Where our rows for the tokens of PE `s` (another node) start in s's landing regions
// (landingTokens, pushLand*: by destination PE, then list index): after the rows s sent in the
// last dispatch to the PEs below us that are not on s's node, from s's count words of that
// dispatch (interCount, which every PE receives). False on timeout/abort (recorded).
MORI_DEVICE_INLINE bool InterLandingBase(const EpKernelCommon& c, const core::WaitContext& wait,
                                         int s, size_t* base) {
  const uint64_t dEpoch = *reinterpret_cast<volatile uint64_t*>(&c.state->dispatchEpoch);
  const int dParity = static_cast<int>(dEpoch & 1);
  size_t sum = 0;
  for (int d = 0; d < c.rank; d++) {
    if (NodeOf(c, d) == NodeOf(c, s)) continue;
    uint32_t cnt = 0;
    if (!TagWait(wait,
                 At<uint64_t>(c.symmLocal, c.symm.interCount) +
                     EpInterCountIndex(dParity, s, d, c.worldSize),
                 dEpoch, s, "EP combine: count word of the last dispatch", &cnt))
      return false;
    sum += cnt;
  }
  *base = sum;
  return true;
}

// ---------------------------------------------------------------------------------------------
// Block 0 of a dispatch (either form), once every source's count signal has been acquired (by
// any thread of the block, before a barrier): the per-local-expert counts of this call, from the
// histograms the count signals published.
MORI_DEVICE_INLINE void EpSumExpertCounts(const EpKernelCommon& c, int parity) {
  const int W = c.worldSize;
  const int Epr = c.numExpertsPerRank;
  int32_t* einbox = At<int32_t>(c.symmLocal, c.symm.expertInbox);
  for (int e = static_cast<int>(threadIdx.x); e < Epr; e += static_cast<int>(blockDim.x)) {
    int sum = 0;
    for (int s = 0; s < W; s++)
      sum += core::AtomicLoadRelaxedSystem(einbox + EpExpertInboxIndex(parity, s, e, W, Epr));
    c.localExpertCount[e] = sum;
  }
}

// Receive side of a dispatch (every thread of ONE block, after this PE's own sends): every
// source's count (their sum is checked against the receive capacity before any row is waited
// for: a sender whose rows would not fit writes none), then the rows: arrived[s] (or, InterNode,
// the RDMA tail of a source on another node) must reach the count; arrived[s] is reset. Writes
// the received total, recvCount[s] and the per-local-expert counts. sTotal and sFailed are the
// block's shared words (sTotal 0 on entry). capOverflow (not null): a total above the receive
// capacity is kept there (EpKeepCapOverflow) instead of recorded at once; sFailed either way.
template <EpFamily kFamily>
MORI_DEVICE_INLINE void EpDispatchReceive(const EpKernelCommon& c, const core::WaitContext& wait,
                                          int parity, uint64_t epoch, uint64_t format, int& sTotal,
                                          int& sFailed, uint64_t* inputErrorRecord,
                                          uint64_t* capOverflow = nullptr) {
  using core::CmpOp;
  constexpr bool kInter = kFamily == EpFamily::kInterNode;
  const int W = c.worldSize;
  const int me = c.rank;
  const int tid = static_cast<int>(threadIdx.x);
  const int nThreads = static_cast<int>(blockDim.x);
  if (sFailed == 0) {
    bool flagged = false;  // lane s of warp 0: PE s flagged an input error (W <= warp size)
    uint64_t report = 0;
    for (int s = tid; s < W; s += nThreads) {
      uint32_t cnt = 0;
      if (!EpCountWait<kFamily>(c, wait, parity, s, me, epoch, format,
                                "EP dispatch: token count for this PE", &cnt, &flagged)) {
        sFailed = 1;
        flagged = false;
      } else if (flagged) {
        report = core::AtomicLoadRelaxedSystem(EpInputErrorSlot(c, c.symmLocal, parity, s));
      }
      c.state->recvCount[s] = static_cast<int32_t>(cnt);  // for the push and InterNode combines
      atomicAdd(&sTotal, static_cast<int>(cnt));
    }
    if (tid < kWarpSize) EpRecordInputError(c, inputErrorRecord, flagged, report);
    __syncthreads();
    if (tid == 0 && sFailed == 0 && sTotal > c.maxRecvRows) {
      if (capOverflow != nullptr) {
        EpKeepCapOverflow(capOverflow, me, static_cast<uint64_t>(sTotal), true);
      } else {
        ReportError(wait, -1, "EP dispatch: rows exceed max_total_recv_tokens", CmpOp::kLe,
                    static_cast<uint64_t>(c.maxRecvRows), static_cast<uint64_t>(sTotal));
      }
      sFailed = 1;
    }
    __syncthreads();
  }
  if (sFailed == 0) {
    uint64_t* arrived = At<uint64_t>(c.symmLocal, c.symm.arrived);
    for (int s = tid; s < W; s += nThreads) {
      const uint64_t cnt = static_cast<uint64_t>(c.state->recvCount[s]);
      if (cnt == 0) continue;
      if (kInter && IsRemote(c, s)) {
        // Rows from another node: the tail word follows them on the sender's QP.
        uint64_t* tailWord = At<uint64_t>(c.symmLocal, c.symm.interTail) + s;
        uint32_t rows = 0;
        if (!TagWait(wait, tailWord, epoch, s, "EP dispatch: RDMA rows (tail) from PE", &rows)) {
          sFailed = 1;
        } else if (rows != cnt) {
          ReportError(wait, s, "EP dispatch: RDMA tail != announced count",
                      static_cast<const uint64_t*>(tailWord), CmpOp::kEq, cnt,
                      static_cast<uint64_t>(rows));
          sFailed = 1;
        }
        continue;
      }
      if (!core::WaitUntil(wait, arrived + s, CmpOp::kGe, cnt, s,
                           "EP dispatch: rows arrived from PE")) {
        sFailed = 1;
        continue;
      }
      const uint64_t got = core::AtomicLoadAcquireSystem(arrived + s);
      if (got != cnt) {
        ReportError(wait, s, "EP dispatch: more rows arrived than announced",
                    static_cast<const uint64_t*>(arrived + s), CmpOp::kEq, cnt, got);
        sFailed = 1;
        continue;
      }
      core::AtomicStoreRelaxedSystem(arrived + s, static_cast<uint64_t>(0));
    }
    // The histograms came with the count signals acquired above (by other threads of this
    // block: the barrier carries the acquire to them).
    __syncthreads();
    if (tid == 0) *c.totalRecv = sTotal;
    EpSumExpertCounts(c, parity);
  }
}

// ---------------------------------------------------------------------------------------------
// Dispatch block roles. Block b serves destination *dest as member *g of a group of *G blocks;
// block 0 always leads the local destination (dest == rank), every destination has exactly one
// leader (g == 0). With at least 3 blocks per destination the local destination gets
// EpDispatchLocalBlocks blocks and the rest are dealt round-robin over the W - 1 peers: a block
// copies local rows (inside our own HBM) about twice as fast as it streams rows to a peer
// (docs/performance.md, "Dispatch block split and scan"), and every destination gets about the
// same number of rows, so each local block should carry about twice a peer block's rows, and the
// local copy must not be the last to finish.
// Tested through mori._C._testing (src/pybind/ep_test_bindings.cpp), as the work splits below.
// ---------------------------------------------------------------------------------------------
// Blocks of nb (>= 3W) on the local copy: `requested` (MORI_EP_DISPATCH_LOCAL_BLOCKS, 0 = unset)
// kept within [1, nb - 3(W - 1)] (every peer keeps 3 blocks), else nb / (2W - 1), at least 1.
MORI_HD inline int EpDispatchLocalBlocks(int nb, int W, int requested) {
  if (requested <= 0) return nb / (2 * W - 1) > 1 ? nb / (2 * W - 1) : 1;
  const int most = nb - 3 * (W - 1);
  return requested < most ? requested : most;
}

MORI_HD inline void EpDispatchBlockRole(int b, int nb, int W, int me, int localBlocks, int* dest,
                                        int* g, int* G) {
  if (W <= 1 || nb < 3 * W) {
    *dest = (b + me) % W;
    *g = b / W;
    *G = (nb - 1 - (b % W)) / W + 1;
    return;
  }
  const int nLocal = EpDispatchLocalBlocks(nb, W, localBlocks);
  if (b < nLocal) {
    *dest = me;
    *g = b;
    *G = nLocal;
    return;
  }
  const int r = b - nLocal;
  const int nRemote = nb - nLocal;
  const int q = r % (W - 1);
  *dest = (me + 1 + q) % W;
  *g = r / (W - 1);
  *G = (nRemote - 1 - q) / (W - 1) + 1;
}

// ---------------------------------------------------------------------------------------------
// Work splits of the kernels (host-callable: the launcher and the tests use them too).
// ---------------------------------------------------------------------------------------------
// Start of share i when n items are cut into `parts` contiguous shares: share i is
// [EpShareBegin(n, i, parts), EpShareBegin(n, i + 1, parts)); the shares cover [0, n) once, in
// order, and their sizes differ by at most one.
MORI_HD inline int EpShareBegin(int n, int i, int parts) {
  return static_cast<int>(static_cast<long long>(n) * i / parts);
}

// How many warps share one row (of `vecs` 16-byte vectors) when `rows` rows go to `warps` warps:
// floor(warps / rows) while rows are fewer than warps, so that every warp has at most one item
// (ceil would give some warps two: two rounds of load latency instead of one), but no more parts
// than leave each part two vectors per lane; 1 otherwise.
MORI_HD inline int EpPartsPerRow(int rows, int warps, int vecs) {
  if (rows <= 0 || rows >= warps) return 1;
  const int parts = warps / rows;
  const int maxParts = vecs / (2 * kWarpSize) > 1 ? vecs / (2 * kWarpSize) : 1;
  return parts < maxParts ? parts : maxParts;
}

// Dispatch: rows [0, S) of a destination's list of `rows` are split into the G blocks' shares
// (EpShareBegin); the rest, one row per warp of the group (`groupWarps`), is the pool that warps
// claim after their share. A pool only where every share keeps at least one row per warp (at
// least two rows per warp of the group); else S = rows.
MORI_HD inline int EpDispatchShareRows(int rows, int groupWarps) {
  return rows >= 2 * groupWarps ? rows - groupWarps : rows;
}

// The word of a membership bitmap that holds list position p: the last of words [0, nWords)
// whose exclusive prefix count is <= p (prefix non-decreasing, prefix[0] == 0 <= p).
MORI_HD inline int EpWordOfPosition(const int* prefix, int nWords, int p) {
  int lo = 0, hi = nWords - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (prefix[mid] <= p) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// ---------------------------------------------------------------------------------------------
// Warp helpers
// ---------------------------------------------------------------------------------------------
MORI_DEVICE_INLINE LaneMask LowerLanesMask(int lane) {
  return (static_cast<LaneMask>(1) << lane) - static_cast<LaneMask>(1);
}

// 1-based index of the lowest set bit, 0 if none.
MORI_DEVICE_INLINE int FindFirstSet(LaneMask m) {
  if constexpr (sizeof(LaneMask) == 8) {
    return __ffsll(static_cast<unsigned long long>(m));
  } else {
    return __ffs(static_cast<unsigned int>(m));
  }
}

MORI_DEVICE_INLINE int WarpInclusiveScan(int v) {
  const int lane = core::LaneId();
  for (int off = 1; off < kWarpSize; off <<= 1) {
    int n = core::WarpShfl(v, lane >= off ? lane - off : lane);
    if (lane >= off) v += n;
  }
  return v;
}

// Position (0-based) of the n-th set bit of `word` (n < popcount(word)); warp-uniform inputs.
MORI_DEVICE_INLINE int WarpNthSetBit(LaneMask word, int n) {
  const int lane = core::LaneId();
  const bool set = ((word >> lane) & static_cast<LaneMask>(1)) != 0;
  const bool hit = set && core::PopCount(word & LowerLanesMask(lane)) == n;
  return FindFirstSet(core::WarpBallot(hit)) - 1;
}

// ---------------------------------------------------------------------------------------------
// Row copies. A warp copies vectors [vBegin, vEnd) of a row; each lane keeps kUnroll 16-byte loads
// in flight before it stores them.
// ---------------------------------------------------------------------------------------------
template <int kUnroll>
MORI_DEVICE_INLINE void WarpCopyVectors(uint4* __restrict__ dst, const uint4* __restrict__ src,
                                        int vBegin, int vEnd) {
  const int lane = core::LaneId();
  int v = vBegin + lane;
  for (; v + (kUnroll - 1) * kWarpSize < vEnd; v += kUnroll * kWarpSize) {
    uint4 r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; u++) r[u] = src[v + u * kWarpSize];
#pragma unroll
    for (int u = 0; u < kUnroll; u++) dst[v + u * kWarpSize] = r[u];
  }
  uint4 r[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; u++) {
    if (v + u * kWarpSize < vEnd) r[u] = src[v + u * kWarpSize];
  }
#pragma unroll
  for (int u = 0; u < kUnroll; u++) {
    if (v + u * kWarpSize < vEnd) dst[v + u * kWarpSize] = r[u];
  }
}

// The end of a combine kernel, thread 0 of every block, after the block's barrier: one system
// fence (cumulative over the barrier: it releases the block's peer loads), the block counted in
// combineBlocksDone, its trace words stamped. Returns true in the grid's last block, which has
// reset the per-call grid counters (every block stopped drawing work items and claiming copy
// chunks before its count) and then signals "done" and publishes the epoch.
MORI_DEVICE_INLINE bool EpCombineCountBlockDone(const EpKernelCommon& c, uint64_t* tr) {
  EpTraceStamp(tr, kEpCombineReduced);
  core::FenceAcqRelSystem();
  EpTraceStamp(tr, kEpCombineFenced);
  const unsigned old = atomicAdd(&c.state->combineBlocksDone, 1u);
  if (tr != nullptr) {
    EpTraceStamp(tr, kEpCombineCounted);
    tr[kEpTraceWordArrival] = static_cast<uint64_t>(old) + 1;
  }
  if (old != gridDim.x - 1) return false;
  c.state->combineBlocksDone = 0;
  c.state->combineNextItem = 0;
  c.state->combineCopyNextChunk = 0;
  return true;
}

// Size of the chunks a grid of `blocks` blocks claims to copy `n` units: about two per block,
// whole multiples of `align` units, at least 4096 units (a claim costs an atomic round trip).
MORI_HD inline size_t EpCopyChunkSize(size_t n, size_t align, unsigned blocks) {
  size_t chunk = (n + 2 * static_cast<size_t>(blocks) - 1) / (2 * static_cast<size_t>(blocks));
  chunk = (chunk + align - 1) / align * align;
  return chunk < 4096 ? 4096 : chunk;
}

// ---------------------------------------------------------------------------------------------
// Token element types for combine: a 16-byte vector of kPerVec elements, accumulated in fp32
// (one add per element, in the caller's order) and packed back with round-to-nearest-even.
// Unpack gives the elements' exact fp32 values (-0 stays -0).
// ---------------------------------------------------------------------------------------------
struct EpBf16Elem {
  static constexpr int kPerVec = 8;
  MORI_DEVICE_INLINE static void Unpack(const uint4& v, float (&x)[kPerVec]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
      x[2 * i] = __uint_as_float(w[i] << 16);
      x[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
  }
  MORI_DEVICE_INLINE static void Accumulate(float (&acc)[kPerVec], const uint4& v) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
      acc[2 * i] += __uint_as_float(w[i] << 16);
      acc[2 * i + 1] += __uint_as_float(w[i] & 0xFFFF0000u);
    }
  }
  MORI_DEVICE_INLINE static uint4 Pack(const float (&acc)[kPerVec]) {
    return make_uint4(core::PackBf16x2(acc[0], acc[1]), core::PackBf16x2(acc[2], acc[3]),
                      core::PackBf16x2(acc[4], acc[5]), core::PackBf16x2(acc[6], acc[7]));
  }
};

struct EpFp16Elem {
  static constexpr int kPerVec = 8;
  MORI_DEVICE_INLINE static float ToFloat(uint32_t bits16) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits16)));
  }
  MORI_DEVICE_INLINE static void Unpack(const uint4& v, float (&x)[kPerVec]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
      x[2 * i] = ToFloat(w[i] & 0xFFFFu);
      x[2 * i + 1] = ToFloat(w[i] >> 16);
    }
  }
  MORI_DEVICE_INLINE static void Accumulate(float (&acc)[kPerVec], const uint4& v) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
      acc[2 * i] += ToFloat(w[i] & 0xFFFFu);
      acc[2 * i + 1] += ToFloat(w[i] >> 16);
    }
  }
  MORI_DEVICE_INLINE static uint4 Pack(const float (&acc)[kPerVec]) {
    return make_uint4(core::PackHalf2(acc[0], acc[1]), core::PackHalf2(acc[2], acc[3]),
                      core::PackHalf2(acc[4], acc[5]), core::PackHalf2(acc[6], acc[7]));
  }
};

struct EpFp32Elem {
  static constexpr int kPerVec = 4;
  MORI_DEVICE_INLINE static void Unpack(const uint4& v, float (&x)[kPerVec]) {
    x[0] = __uint_as_float(v.x);
    x[1] = __uint_as_float(v.y);
    x[2] = __uint_as_float(v.z);
    x[3] = __uint_as_float(v.w);
  }
  MORI_DEVICE_INLINE static void Accumulate(float (&acc)[kPerVec], const uint4& v) {
    acc[0] += __uint_as_float(v.x);
    acc[1] += __uint_as_float(v.y);
    acc[2] += __uint_as_float(v.z);
    acc[3] += __uint_as_float(v.w);
  }
  MORI_DEVICE_INLINE static uint4 Pack(const float (&acc)[kPerVec]) {
    return make_uint4(__float_as_uint(acc[0]), __float_as_uint(acc[1]), __float_as_uint(acc[2]),
                      __float_as_uint(acc[3]));
  }
};

// ---------------------------------------------------------------------------------------------
// // Fused quantisation (EpDispatchQuant). A lane holds input vector v of a row (8 bf16); a group
// of kEpQuantGroup elements is 16 vectors, held by lanes 16k..16k+15 of the warp (callers keep
// their rounds group-aligned: the first vector of a round and the warp size are multiples of 16),
// so a group's amax is a max over those 16 lanes. Every lane of the warp calls this (shuffles);
// `valid` is the same for the 16 lanes of a group. Writes the 8 codes of v to codes[8v..8v+8) and
// (the group's first lane) the group's scale.
constexpr int kQuantGroupVecs = kEpQuantGroup / 8;
static_assert(kWarpSize % kQuantGroupVecs == 0, "a warp holds whole quantisation groups");

MORI_DEVICE_INLINE void QuantizeVector(const uint4& x, bool valid, int v, uint8_t* codes,
                                       uint8_t* scales, int nGroups, EpDispatchQuant quant,
                                       core::Fp8Format fmt) {
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
  float e[8];
#pragma unroll
  for (int i = 0; i < 4; i++) {
    e[2 * i] = EpBf16ToFloat(static_cast<uint16_t>(w[i] & 0xFFFFu));
    e[2 * i + 1] = EpBf16ToFloat(static_cast<uint16_t>(w[i] >> 16));
  }
  float amax = 0.f;
  if (valid) {
#pragma unroll
    for (int i = 0; i < 8; i++) amax = fmaxf(amax, fabsf(e[i]));
  }
#pragma unroll
  for (int off = kQuantGroupVecs / 2; off > 0; off >>= 1)
    amax = fmaxf(amax, core::WarpShflXor(amax, off));
  if (!valid) return;
  const EpFp8GroupScale s = EpFp8ScaleOf(amax, fmt, EpQuantRoundsScale(quant));
  uint32_t lo = 0, hi = 0;
#pragma unroll
  for (int i = 0; i < 4; i++) {
    lo |= static_cast<uint32_t>(EpFp8Quantize(e[i], s, fmt)) << (8 * i);
    hi |= static_cast<uint32_t>(EpFp8Quantize(e[4 + i], s, fmt)) << (8 * i);
  }
  *reinterpret_cast<uint2*>(codes + static_cast<size_t>(v) * 8) = make_uint2(lo, hi);
  if (v % kQuantGroupVecs == 0) EpFp8StoreScale(scales, v / kQuantGroupVecs, nGroups, s, quant);
}

// WarpCopyVectors with quantisation: input vectors [vBegin, vEnd) of a row (group-aligned).
template <int kUnroll>
MORI_DEVICE_INLINE void WarpQuantizeVectors(uint8_t* codes, uint8_t* scales, const uint4* src,
                                            int vBegin, int vEnd, int nGroups,
                                            EpDispatchQuant quant, core::Fp8Format fmt) {
  const int lane = core::LaneId();
  for (int base = vBegin; base < vEnd; base += kUnroll * kWarpSize) {  // warp-uniform
    uint4 r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; u++) {
      const int v = base + lane + u * kWarpSize;
      r[u] = v < vEnd ? src[v] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; u++) {
      const int v = base + lane + u * kWarpSize;
      QuantizeVector(r[u], v < vEnd, v, codes, scales, nGroups, quant, fmt);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// External combine input (copyTokens / copyWeights): every block waits until PEs [p0, p1) finished
// reading our registered buffers in the last combine and checks that the input has the rows
// dispatch received. The copy into the registered buffers is cut into chunks (EpCopyChunkSize:
// about two per block) that blocks claim from c.state->combineCopyNextChunk, not shares by block
// index: the blocks that are resident copy all of it, so no block waits for "ready" from a block of
// its own grid that has not started (ranks sharing a GPU, e.g. under MPS, may leave the grid fewer
// SMs than blocks; docs/ep.md "Residency"). At least one chunk, so that some block signals also
// when no row was received. After its copies a block fences once (not per thread: fence.sc.sys in
// every thread serialises GPU-wide; the barrier orders the block's copies before thread 0's
// cumulative release fence) and adds its chunk count to combineCopyChunksDone; the block that
// completes the last chunk (thread 0, after acquiring every block's copies) resets that counter and
// runs onLast() unless the device aborted. The grid's last block resets combineCopyNextChunk in
// EpCombineCountBlockDone (once every block stopped claiming). sFailed / sClaim: the block's shared
// words. Every thread of every block calls. skipOwn: the rows this PE received from itself (and
// their weights) are left out of the copy; only this PE reads them, and it reads them from the
// caller's tensors (EpCombineOwnRowsInPlace).
// The checks before an external input is copied into the registered buffer, in every block: PEs
// p0..p1 - 1 finished reading that buffer in the last combine (done tag >= epoch - 1), and the
// input (and weights) hold the rows dispatch received (thread 0; recorded when `report`). Sets
// sFailed on a failure; the caller synchronises the block before reading it.
MORI_DEVICE_INLINE void EpCombineCopyChecks(const EpCombineKernelArgs& a,
                                            const core::WaitContext& wait, uint64_t epoch, int p0,
                                            int p1, bool report, int& sFailed) {
  using core::CmpOp;
  const EpKernelCommon& c = a.c;
  const int tid = static_cast<int>(threadIdx.x);
  const int rows = *reinterpret_cast<volatile int32_t*>(c.totalRecv);
  EpSignal* done = At<EpSignal>(c.symmLocal, c.symm.doneInbox);
  for (int p = p0 + tid; p < p1; p += static_cast<int>(blockDim.x)) {
    if (!core::WaitUntil(wait, &done[p].tag, CmpOp::kGe, epoch - 1, p,
                         "EP combine: peer done reading (last combine)"))
      sFailed = 1;
  }
  if (tid == 0) {
    if (a.copyTokens != 0 && rows > a.inRows) {
      if (report)
        ReportError(wait, -1, "EP combine: input has fewer rows than dispatch received", CmpOp::kGe,
                    static_cast<uint64_t>(rows), static_cast<uint64_t>(a.inRows));
      sFailed = 1;
    }
    if (a.copyWeights != 0 && rows > a.inWeightRows) {
      if (report)
        ReportError(wait, -1, "EP combine: weights have fewer rows than dispatch received",
                    CmpOp::kGe, static_cast<uint64_t>(rows), static_cast<uint64_t>(a.inWeightRows));
      sFailed = 1;
    }
  }
}

template <typename OnLast>
MORI_DEVICE_INLINE void EpCombineCopyInput(const EpCombineKernelArgs& a,
                                           const core::WaitContext& wait, uint64_t epoch, int p0,
                                           int p1, bool skipOwn, int& sFailed, unsigned& sClaim,
                                           OnLast onLast) {
  const EpKernelCommon& c = a.c;
  const int tid = static_cast<int>(threadIdx.x);
  const int nThreads = static_cast<int>(blockDim.x);
  const int rows = *reinterpret_cast<volatile int32_t*>(c.totalRecv);
  EpCombineCopyChecks(a, wait, epoch, p0, p1, true, sFailed);
  __syncthreads();
  // Own rows [ownBegin, ownBegin + ownRows) left out: a copied offset o (bytes or words) below
  // the cut is o in the buffers, one at or past it is o + the own rows' size.
  size_t ownBegin = 0, ownRows = 0;
  if (skipOwn) {
    for (int s = 0; s < c.rank; s++) ownBegin += static_cast<size_t>(c.state->recvCount[s]);
    ownRows = static_cast<size_t>(c.state->recvCount[c.rank]);
    if (ownBegin + ownRows > static_cast<size_t>(rows)) ownBegin = ownRows = 0;  // never: counts
  }
  const size_t copyRows = static_cast<size_t>(rows) - ownRows;
  const size_t tokBytes = a.copyTokens != 0 ? copyRows * a.rowBytes : 0;
  const size_t wWords = a.copyWeights != 0 ? copyRows * c.topK : 0;
  // copy(at, n) for the pieces of copied range [off, off + n) (at: buffer offset).
  auto pieces = [](size_t off, size_t n, size_t cut, size_t skip, auto&& copy) {
    if (off < cut) {
      const size_t m = n < cut - off ? n : cut - off;
      copy(off, m);
      off += m;
      n -= m;
    }
    if (n > 0) copy(off + skip, n);
  };
  const size_t tokChunk = EpCopyChunkSize(tokBytes, 16, gridDim.x);
  const size_t wChunk = EpCopyChunkSize(wWords, 1, gridDim.x);
  const unsigned tokChunks = static_cast<unsigned>((tokBytes + tokChunk - 1) / tokChunk);
  const unsigned wChunks = static_cast<unsigned>((wWords + wChunk - 1) / wChunk);
  const unsigned chunks = tokChunks + wChunks > 0 ? tokChunks + wChunks : 1;
  unsigned copied = 0;
  if (sFailed == 0) {
    for (;;) {
      __syncthreads();  // everyone read the last claim
      if (tid == 0) sClaim = atomicAdd(&c.state->combineCopyNextChunk, 1u);
      __syncthreads();
      const unsigned ch = sClaim;
      if (ch >= chunks) break;
      if (ch < tokChunks) {
        const size_t off = static_cast<size_t>(ch) * tokChunk;
        const size_t n = tokBytes - off < tokChunk ? tokBytes - off : tokChunk;
        pieces(off, n, ownBegin * a.rowBytes, ownRows * a.rowBytes, [&](size_t at, size_t m) {
          shmem::detail::CopyElements<uint4, shmem::detail::kCopyUnroll>(
              reinterpret_cast<uint4*>(c.symmLocal + c.symm.combineInTokens + at),
              reinterpret_cast<const uint4*>(a.inTokens + at), m / 16, tid, nThreads);
        });
      } else if (wWords > 0) {
        const size_t off = static_cast<size_t>(ch - tokChunks) * wChunk;
        const size_t n = wWords - off < wChunk ? wWords - off : wChunk;
        pieces(off, n, ownBegin * c.topK, ownRows * c.topK, [&](size_t at, size_t m) {
          uint32_t* dst = At<uint32_t>(c.symmLocal, c.symm.combineInWeights) + at;
          const uint32_t* src = reinterpret_cast<const uint32_t*>(a.inWeights) + at;
          for (size_t i = tid; i < m; i += nThreads) dst[i] = src[i];
        });
      }
      copied++;
    }
  }
  __syncthreads();
  if (tid == 0 && copied > 0) {
    core::FenceAcqRelSystem();
    const unsigned old = atomicAdd(&c.state->combineCopyChunksDone, copied);
    if (old + copied == chunks) {
      c.state->combineCopyChunksDone = 0;
      core::FenceAcqRelSystem();  // acquire: every block's copy (seen through the counter)
      if (!core::DeviceAborted(wait)) onLast();
    }
  }
}

// The pull combine's own rows under skipOwn (EpCombineCopyInput): this PE reads the rows (and
// weights) it received from itself in the caller's tensors, which have the registered buffers'
// row layout, instead of their uncopied places there.
MORI_DEVICE_INLINE void EpCombineOwnRowsInPlace(const EpCombineKernelArgs& a,
                                                const uint8_t** tokens, const float** weights) {
  if (a.copyTokens != 0) *tokens = a.inTokens;
  if (a.copyWeights != 0 && *weights != nullptr) *weights = a.inWeights;
}

// Pull combine, a PE still copying its input (ready bit kEpReadyCopying; EpCombinePrecopyKernel):
// lane `peer` (a bit of `copying`) waits until that PE tagged, in our combineRowsReady, the chunk
// of its registered buffer holding row `slot` (slot < 0: none) for this combine. Out of line: its
// registers stay out of the reduction's. False on timeout/abort (recorded).
__device__ __noinline__ inline bool EpCopiedRowsWait(const EpKernelCommon& c,
                                                     const core::WaitContext& wait, uint64_t epoch,
                                                     unsigned long long copying, int peer,
                                                     int slot) {
  if (slot < 0 || ((copying >> peer) & 1) == 0) return true;
  uint64_t* tag =
      At<uint64_t>(c.symmLocal, c.symm.combineRowsReady) +
      static_cast<size_t>(peer) * EpCombineCopyChunks(static_cast<size_t>(c.maxRecvRows)) +
      static_cast<size_t>(slot) / kEpCombineCopyRows;
  return core::WaitUntil(wait, tag, core::CmpOp::kGe, epoch, peer,
                         "EP combine: peer's copy of our rows (precopy chunk)");
}

// Our ready slot of this combine on PE p (readyInbox[parity][our rank] there).
MORI_DEVICE_INLINE EpSignal* EpReadySlotOn(const EpKernelCommon& c, int p, int parity) {
  return At<EpSignal>(PeerBlock(c, p), c.symm.readyInbox) +
         EpReadyInboxIndex(parity, c.rank, c.worldSize);
}

// Waits for PE p's ready signal of this combine (readyInbox[parity][p]) and checks that p combines
// with our format (dtype, row bytes; EpReadyFormat of our `ready`). False on timeout/abort or a
// mismatch (recorded); *v: p's ready value.
MORI_DEVICE_INLINE bool EpReadyWait(const EpKernelCommon& c, const core::WaitContext& wait,
                                    int parity, uint64_t epoch, int p, uint64_t ready,
                                    uint64_t* v) {
  EpSignal* const sig =
      At<EpSignal>(c.symmLocal, c.symm.readyInbox) + EpReadyInboxIndex(parity, p, c.worldSize);
  if (!SignalWait(wait, sig, epoch, p, "EP combine: peer input ready", v)) return false;
  if (EpReadyFormat(*v) != EpReadyFormat(ready)) {
    ReportError(wait, p, "EP combine: PEs called combine with different dtype/hidden",
                static_cast<const uint64_t*>(&sig->value), core::CmpOp::kEq, EpReadyFormat(ready),
                EpReadyFormat(*v));
    return false;
  }
  return true;
}

// Where PE p's combine rows and weights are, from its ready value `v` (weights nullptr: none;
// tokens kFp8Wire: its e4m3 codes in combineInFp8, rows of the wire size).
MORI_DEVICE_INLINE void EpReadySources(const EpKernelCommon& c, int p, uint64_t v,
                                       const uint8_t** tokens, const float** weights) {
  const EpCombineSource ts = EpReadyTokens(v);
  const EpCombineSource ws = EpReadyWeights(v);
  uint8_t* pb = PeerBlock(c, p);
  *tokens = pb + (ts == EpCombineSource::kFp8Wire       ? c.symm.combineInFp8
                  : ts == EpCombineSource::kDispatchOut ? c.symm.dispatchOutTokens
                                                        : c.symm.combineInTokens);
  *weights = ws == EpCombineSource::kNone ? nullptr
                                          : At<const float>(pb, ws == EpCombineSource::kDispatchOut
                                                                    ? c.symm.dispatchOutWeights
                                                                    : c.symm.combineInWeights);
}

}  // namespace mori::ops::detail

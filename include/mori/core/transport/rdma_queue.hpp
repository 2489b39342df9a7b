// The mlx5 send-queue posting protocol shared by GPU threads and (in tests) host threads.
//
// Endpoint handles are plain structs of pointers: a GPU holds them in its state, the counters live
// in device or mapped host memory, the host test harness uses ordinary memory. Every counter is a
// free-running 64-bit count of 64-byte basic blocks (never wraps in practice); only the 16-bit
// wqe_index / doorbell record see the hardware's wrap-around.
//
//   reserved  : next free block; ReserveSlots fetch-adds it (many threads at once)
//   ready     : blocks published; a thread publishes [start, start+n) only when ready == start
//   signalled : end of the newest published WQE that requested a CQE (written by the publisher)
//   completed : blocks whose WQEs completed (advanced by whoever drains the CQ)
//
// Tickets: the value of `ready` right after a post's WQEs ("everything before this block") is the
// post's ticket; the post has completed once completed >= ticket (IsCompleted, WaitCompleted).
//
// Selective signalling: a WQE may be posted without a CQE request (WqeDesc::unsignalled). RC
// completes a QP's WQEs in order, so a CQE for a WQE also completes every earlier one; PollCq
// advances `completed` to the end of the WQE named by the CQE's wqe_counter, so `completed` stays
// exact at CQE granularity and never passes a WQE that has not completed. Two rules keep every
// wait finite:
//  * WriteWqe requests a CQE anyway for a WQE that holds the last block of a signal period
//    (SignalPeriod: a quarter of the ring), and a reservation is at most MaxReserveBlocks. A
//    reserver waiting for ring space needs completions up to its own start minus at most
//    (ring - period + 1 - n) blocks; the WQE holding the last block of the period before its
//    start requested a CQE, and that CQE covers them.
//  * WaitCompleted (and Quiet) post a CQE-requesting NOP when `signalled` is below the target:
//    nothing else would ever complete the unsignalled tail.
// The CQ must have at least as many entries as the SQ has basic blocks (no overrun possible). A
// WQE may span several blocks and cross the ring end: it is staged and copied in 16-byte units.
// After any wait fails (timeout) the endpoint is dead: reserved slots that were never published
// block everyone behind them (same as a device abort).
//
// Memory ordering: WQE bytes are plain stores; the doorbell record is a release store made only by
// the thread whose turn it is (it acquired `ready` from its predecessor), so the consumer of the
// record (NIC, emulator) that loads it with acquire sees every WQE up to it. CQEs are consumed by
// an acquire load of their last 32-bit word (wqe_counter, signature, op_own), which the producer
// writes last with release.
#pragma once

#include <cstdint>

#include "mori/core/transport/hd_atomics.hpp"
#include "mori/core/transport/mlx5_wqe.hpp"

#if MORI_DEVICE_PASS
#include "mori/core/device/wait.hpp"
#else
namespace mori::core {
struct DeviceErrorRecord;  // defined in core/device_error.hpp, written by core/device/wait.hpp
}
#endif

namespace mori::core::rdma {

enum class DoorbellMode : uint32_t {
  kUar = 0,      // `doorbell` is the NIC's (GPU-mapped) UAR register: 8-byte MMIO store
  kMailbox = 1,  // `doorbell` is host memory a CPU thread (or the emulator) watches
};

// Send queue of one RC QP.
struct SqHandle {
  void* ring;          // WQE ring, numBlocks * 64 bytes
  uint32_t numBlocks;  // power of two, at most 32768
  uint32_t qpn;
  uint64_t* reserved;  // counters (see the header comment)
  uint64_t* ready;
  uint64_t* signalled;
  uint32_t* dbrec;     // SQ doorbell record (DBR dword 1): BE32(producer & 0xffff)
  uint64_t* doorbell;  // UAR register or mailbox: first 8 bytes of the last published ctrl seg
  DoorbellMode doorbellMode;
};

// First error completion seen on a CQ (sticky; `valid` is written last with release).
struct CqErrorInfo {
  uint32_t valid;
  uint32_t qpn;
  uint16_t wqeCounter;
  uint8_t syndrome;
  uint8_t vendorSyndrome;
  uint8_t cqeOpcode;
  uint8_t sendOpcode;
  uint16_t pad;
};

// Completion queue of the SQ above (64-byte CQEs, normal, not collapsed).
struct CqHandle {
  void* ring;
  uint32_t numCqes;     // power of two, >= the SQ's numBlocks
  uint32_t* dbrec;      // CQ doorbell record dword 0: BE32(consumer & 0xffffff)
  uint64_t* consumer;   // CQEs consumed (free-running)
  uint64_t* completed;  // SQ blocks completed (free-running)
  uint32_t* pollLock;   // one poller at a time (try-lock; others just re-check)
  CqErrorInfo* error;
};

struct QpEndpoint {
  SqHandle sq;
  CqHandle cq;
};

// Memory behind the counters of one endpoint (host tests, mapped host memory, device memory).
struct alignas(64) QpCounters {
  alignas(64) uint64_t reserved;
  alignas(64) uint64_t ready;
  uint64_t signalled;  // written with ready, by the same (publishing) thread
  alignas(64) uint64_t completed;
  uint64_t consumer;
  uint32_t pollLock;
  alignas(64) uint32_t sqDbrec[2];  // [0] receive queue (unused), [1] send queue
  uint32_t cqDbrec[2];              // [0] consumer index, [1] arm (unused)
  uint64_t doorbellMailbox;
  CqErrorInfo error;
};

enum class QueueStatus : int32_t {
  kOk = 0,
  kTimeout = 1,  // a bounded wait expired; see QueueResult.waitedFor
  kQpError = 2,  // an error completion was seen on this QP (see CqHandle::error)
  kInvalid = 3,  // bad argument (e.g. a WQE larger than the ring)
};

// Outcome of an operation: on kTimeout what it waited for (`*addr >= expected`, saw `seen`).
struct QueueResult {
  QueueStatus status;
  const char* waitedFor;  // static string
  const void* addr;
  uint64_t expected;
  uint64_t seen;
  uint64_t elapsedNs;
  uint64_t value;  // ReserveSlots: the first reserved block
};

// How long a wait may spin. Device code passes its error record so a timeout is attributed and
// raises the abort flag exactly like core::WaitUntil (nullptr: just return the status).
struct PostContext {
  uint64_t timeoutNs;
  DeviceErrorRecord* err;
  int32_t rank;
  int32_t peer;
};

MORI_HD_INLINE QueueResult QueueOk(uint64_t value = 0) {
  return QueueResult{QueueStatus::kOk, nullptr, nullptr, 0, 0, 0, value};
}

MORI_HD_INLINE bool QpInError(const CqHandle& cq) { return hd::LoadAcquire(&cq.error->valid) != 0; }

// Drains ready CQEs (at most `maxCqes`) if no other thread is draining: advances consumer and
// completed, updates the CQ doorbell record, records the first error CQE. Returns the number of
// CQEs consumed by this call (0 also when another thread holds the poll lock).
MORI_HD_INLINE uint32_t PollCq(const SqHandle& sq, const CqHandle& cq, uint32_t maxCqes = 64) {
  if (!hd::TryLock(cq.pollLock)) return 0;
  uint64_t ci = hd::LoadRelaxed(cq.consumer);
  uint64_t done = hd::LoadRelaxed(cq.completed);
  uint32_t n = 0;
  for (; n < maxCqes; n++) {
    uint8_t* cqe = static_cast<uint8_t*>(cq.ring) +
                   (static_cast<size_t>(ci & (cq.numCqes - 1)) * sizeof(mlx5::Mlx5Cqe64));
    const uint32_t tail = hd::LoadAcquire(reinterpret_cast<uint32_t*>(cqe + 60));
    const uint8_t opOwn = static_cast<uint8_t>(tail >> 24);
    if (!mlx5::CqeReadyForSoftware(opOwn, static_cast<uint32_t>(ci), cq.numCqes)) break;
    const mlx5::Mlx5CqeFields f = mlx5::DecodeCqe(cqe);
    // The completed WQE starts at the block whose low 16 bits are wqeCounter, at most one ring
    // ahead of `done`; its size is read from its ctrl segment, still in the ring (its slots are
    // not reusable before `completed` passes them).
    const uint64_t start = done + static_cast<uint16_t>(f.wqeCounter - static_cast<uint16_t>(done));
    const uint8_t* ctrl = static_cast<const uint8_t*>(
        mlx5::SqBasicBlock(sq.ring, static_cast<uint32_t>(start), sq.numBlocks));
    const uint32_t ds = ctrl[7];
    done = start + mlx5::WqeBasicBlocks(ds == 0 ? 1 : ds);
    if (mlx5::IsErrorCqeOpcode(f.opcode) && cq.error->valid == 0) {
      cq.error->qpn = f.qpn;
      cq.error->wqeCounter = f.wqeCounter;
      cq.error->syndrome = f.syndrome;
      cq.error->vendorSyndrome = f.vendorSyndrome;
      cq.error->cqeOpcode = f.opcode;
      cq.error->sendOpcode = f.sendOpcode;
      hd::StoreRelease<uint32_t>(&cq.error->valid, 1u);
    }
    ci++;
  }
  if (n > 0) {
    hd::StoreRelaxed(cq.consumer, ci);
    hd::StoreRelease<uint32_t>(cq.dbrec, mlx5::HostToBe32(static_cast<uint32_t>(ci) & 0xffffffu));
    hd::StoreRelease(cq.completed, done);
  }
  hd::Unlock(cq.pollLock);
  return n;
}

namespace detail {
// Bounded wait for `*counter >= target`, polling the CQ meanwhile when `poll` is set.
MORI_HD_INLINE QueueResult WaitCounterAtLeast(const QpEndpoint& ep, uint64_t* counter,
                                              uint64_t target, bool poll, const PostContext& ctx,
                                              const char* label) {
  uint64_t v = hd::LoadAcquire(counter);
  if (v >= target) return QueueOk();
  const uint64_t t0 = hd::NowNs();
#if MORI_DEVICE_PASS
  uint64_t nextAbortCheck = kAbortCheckFirstNs;  // the abort flag is a PCIe read: ration it
#endif
  for (uint32_t iter = 1;; iter++) {
    if (poll) PollCq(ep.sq, ep.cq);
    v = hd::LoadAcquire(counter);
    if (v >= target) return QueueOk();
    if ((iter & 15u) == 0) {
      const uint64_t elapsed = hd::NowNs() - t0;
#if MORI_DEVICE_PASS
      WaitContext wctx{ctx.err, ctx.timeoutNs, ctx.rank};
      if (elapsed >= nextAbortCheck) {
        if (DeviceAborted(wctx))
          return QueueResult{QueueStatus::kTimeout, label, counter, target, v, elapsed, 0};
        nextAbortCheck = elapsed + kAbortCheckPeriodNs;
      }
      if (elapsed > ctx.timeoutNs) {
        RecordWaitTimeout<uint64_t>(wctx, ctx.peer, label, counter, CmpOp::kGe, target, v, elapsed);
        return QueueResult{QueueStatus::kTimeout, label, counter, target, v, elapsed, 0};
      }
#else
      if (elapsed > ctx.timeoutNs) {
        return QueueResult{QueueStatus::kTimeout, label, counter, target, v, elapsed, 0};
      }
#endif
    }
    hd::Pause(iter);
  }
}

// Copies `bytes` (multiple of 16) of a staged WQE into the ring starting at block `start`.
MORI_HD_INLINE void CopyToRing(const SqHandle& sq, uint64_t start, const uint8_t* src,
                               uint32_t bytes) {
  for (uint32_t off = 0; off < bytes; off += mlx5::kSegmentBytes) {
    uint8_t* dst = static_cast<uint8_t*>(mlx5::SqBasicBlock(
                       sq.ring, static_cast<uint32_t>(start + off / 64), sq.numBlocks)) +
                   (off % 64);
    const uint64_t* s = reinterpret_cast<const uint64_t*>(src + off);
    uint64_t* d = reinterpret_cast<uint64_t*>(dst);
    d[0] = s[0];
    d[1] = s[1];
  }
}
}  // namespace detail

// Blocks per signal period: WriteWqe requests a CQE for every WQE that holds the last block of a
// period (see the header comment).
MORI_HD_INLINE uint32_t SignalPeriod(const SqHandle& sq) {
  return sq.numBlocks >= 4 ? sq.numBlocks / 4 : 1;
}
// The largest reservation (in blocks) that cannot wait on WQEs nobody will complete.
MORI_HD_INLINE uint32_t MaxReserveBlocks(const SqHandle& sq) {
  return sq.numBlocks - SignalPeriod(sq) + 1;
}
// Whether a WQE of `blocks` blocks at `block` holds the last block of a signal period.
MORI_HD_INLINE bool HoldsPeriodEnd(const SqHandle& sq, uint64_t block, uint32_t blocks) {
  const uint64_t period = SignalPeriod(sq);
  return (block + blocks) / period != block / period;
}

// Reserves `numBlocks` consecutive basic blocks (at most MaxReserveBlocks); result.value = the
// first block's counter. Waits (bounded, draining the CQ) until the ring has room for them. Fails
// fast with kQpError once the QP has seen an error completion (nothing is reserved then).
MORI_HD_INLINE QueueResult ReserveSlots(const QpEndpoint& ep, uint32_t numBlocks,
                                        const PostContext& ctx) {
  if (numBlocks == 0 || numBlocks > MaxReserveBlocks(ep.sq) ||
      numBlocks > mlx5::kMaxWqeBasicBlocks * 64) {
    return QueueResult{QueueStatus::kInvalid,
                       "block count within MaxReserveBlocks",
                       nullptr,
                       MaxReserveBlocks(ep.sq),
                       numBlocks,
                       0,
                       0};
  }
  if (QpInError(ep.cq)) {
    return QueueResult{QueueStatus::kQpError, "no error completion", nullptr, 0, 0, 0, 0};
  }
  const uint64_t start = hd::FetchAddRelaxed<uint64_t>(ep.sq.reserved, numBlocks);
  const uint64_t need = start + numBlocks;  // completed must reach need - ring size
  if (need > ep.sq.numBlocks) {
    QueueResult r = detail::WaitCounterAtLeast(ep, ep.cq.completed, need - ep.sq.numBlocks, true,
                                               ctx, "SQ slots freed by completions");
    if (r.status != QueueStatus::kOk) return r;
  }
  return QueueOk(start);
}

// What to post. Sizes: write/read/atomic 1 block; inline write WqeBasicBlocks(DsRdmaWriteInline).
enum class WqeKind : uint32_t {
  kWrite,
  kWriteImm,
  kWriteInline,
  kRead,
  kFetchAdd,
  kCompareSwap,
  kNop,
};

struct WqeDesc {
  WqeKind kind;
  uint8_t fence;     // 0 or mlx5::kCtrlFence / kCtrlInitiatorSmallFence
  bool unsignalled;  // request no CQE (a later CQE of this SQ covers it; see HoldsPeriodEnd)
  mlx5::Mlx5LocalBuf local;    // write source / read destination / atomic result (8 bytes)
  mlx5::Mlx5RemoteBuf remote;  // write/read/atomic target
  uint64_t swapAdd;            // atomics: addend or new value
  uint64_t compare;            // compare-swap: expected value
  uint32_t immHost;            // write-imm: immediate (host value)
  const void* inlineData;      // inline write: bytes (len in local.len)
};

// Largest inline payload WriteWqe accepts (4 basic blocks).
constexpr uint32_t kMaxInlineBlocks = 4;
constexpr uint32_t kMaxInlinePayload = 4 * mlx5::kSendWqeBasicBlock - 2 * mlx5::kSegmentBytes - 4;

MORI_HD_INLINE uint32_t WqeBlocks(const WqeDesc& d) {
  if (d.kind == WqeKind::kWriteInline) {
    return mlx5::WqeBasicBlocks(mlx5::DsRdmaWriteInline(d.local.len));
  }
  return 1;
}

// Writes one WQE into reserved blocks starting at `block`. It requests a CQE unless
// d.unsignalled (and it does not hold the end of a signal period). Returns the blocks written (0:
// the description does not fit, e.g. inline payload too large).
MORI_HD_INLINE uint32_t WriteWqe(const SqHandle& sq, uint64_t block, const WqeDesc& d) {
  const uint32_t blocks = WqeBlocks(d);
  const bool cqe = !d.unsignalled || HoldsPeriodEnd(sq, block, blocks);
  const mlx5::Mlx5WqeHeader h{static_cast<uint16_t>(block), sq.qpn,
                              static_cast<uint8_t>((cqe ? mlx5::kCtrlCqUpdate : 0) | d.fence)};
  if (d.kind == WqeKind::kWriteInline && d.local.len > kMaxInlinePayload) return 0;
  const bool contiguous =
      (static_cast<uint32_t>(block) & (sq.numBlocks - 1)) + blocks <= sq.numBlocks;
  alignas(16) uint8_t staging[kMaxInlineBlocks * mlx5::kSendWqeBasicBlock];
  void* dst = contiguous ? mlx5::SqBasicBlock(sq.ring, static_cast<uint32_t>(block), sq.numBlocks)
                         : static_cast<void*>(staging);
  uint32_t ds = 0;
  switch (d.kind) {
    case WqeKind::kWrite:
    case WqeKind::kWriteImm:
      ds = mlx5::EncodeRdmaWriteWqe(dst, h, d.local, d.remote, d.kind == WqeKind::kWriteImm,
                                    mlx5::ImmData(d.immHost));
      break;
    case WqeKind::kWriteInline:
      ds = mlx5::EncodeRdmaWriteInlineWqe(dst, h, d.inlineData, d.local.len, d.remote);
      break;
    case WqeKind::kRead: ds = mlx5::EncodeRdmaReadWqe(dst, h, d.local, d.remote); break;
    case WqeKind::kFetchAdd:
      ds = mlx5::EncodeAtomicWqe(dst, h, mlx5::kOpAtomicFa, d.local, d.remote, d.swapAdd, 0);
      break;
    case WqeKind::kCompareSwap:
      ds =
          mlx5::EncodeAtomicWqe(dst, h, mlx5::kOpAtomicCs, d.local, d.remote, d.swapAdd, d.compare);
      break;
    case WqeKind::kNop: ds = mlx5::EncodeNopWqe(dst, h); break;
  }
  if (!contiguous) {
    // Unused tail of the last block stays as it was; the WQE is ds * 16 bytes.
    detail::CopyToRing(sq, block, staging, ds * mlx5::kSegmentBytes);
  }
  return blocks;
}

// Publishes blocks [start, start + numBlocks) once every earlier reservation is published
// (bounded wait on `ready`), then rings: doorbell record = new producer index (release), then the
// doorbell with the first 8 bytes of the ctrl segment of the last WQE (at block `lastWqe`).
// One doorbell publishes every WQE of the range. result.value = start + numBlocks (the ticket).
MORI_HD_INLINE QueueResult RingDoorbell(const QpEndpoint& ep, uint64_t start, uint32_t numBlocks,
                                        uint64_t lastWqe, const PostContext& ctx) {
  // The doorbell value and the last WQE's CQE request are read before publication: once the
  // record moves, the WQE may complete and its slot be reused by another poster.
  const uint8_t* ctrl = static_cast<const uint8_t*>(
      mlx5::SqBasicBlock(ep.sq.ring, static_cast<uint32_t>(lastWqe), ep.sq.numBlocks));
  const uint64_t db = mlx5::detail::LoadWord<uint64_t>(ctrl, 0);
  const bool lastRequestsCqe = ((mlx5::detail::Load32(ctrl, 8) >> 24) & mlx5::kCtrlCqUpdate) != 0;
  hd::FenceRelease();  // this thread's WQE bytes before its publication
  QueueResult r = detail::WaitCounterAtLeast(ep, ep.sq.ready, start, false, ctx,
                                             "earlier SQ reservations published");
  if (r.status != QueueStatus::kOk) return r;
  const uint64_t end = start + numBlocks;
  hd::StoreRelease<uint32_t>(ep.sq.dbrec, mlx5::SqDoorbellRecord(static_cast<uint32_t>(end)));
  hd::StoreRelease<uint64_t>(ep.sq.doorbell, db);
  // Publishers run one at a time (in `ready` order), so `signalled` only grows; the release
  // store of `ready` orders it for readers that acquire `ready`.
  if (lastRequestsCqe) hd::StoreRelaxed<uint64_t>(ep.sq.signalled, end);
  hd::StoreRelease<uint64_t>(ep.sq.ready, end);
  return QueueOk(end);
}

// Reserve + write + ring one WQE. result.value = its first block (its ticket is that plus
// WqeBlocks(d)).
MORI_HD_INLINE QueueResult PostWqe(const QpEndpoint& ep, const WqeDesc& d, const PostContext& ctx) {
  const uint32_t blocks = WqeBlocks(d);
  if (d.kind == WqeKind::kWriteInline && d.local.len > kMaxInlinePayload) {
    return QueueResult{QueueStatus::kInvalid,
                       "inline payload within kMaxInlinePayload",
                       nullptr,
                       kMaxInlinePayload,
                       d.local.len,
                       0,
                       0};
  }
  QueueResult r = ReserveSlots(ep, blocks, ctx);
  if (r.status != QueueStatus::kOk) return r;
  const uint64_t start = r.value;
  WriteWqe(ep.sq, start, d);
  r = RingDoorbell(ep, start, blocks, start, ctx);
  if (r.status != QueueStatus::kOk) return r;
  return QueueOk(start);
}

// Posts d[0..n) in this order with one reservation and one doorbell (n >= 1; their blocks together
// at most MaxReserveBlocks). Each WQE requests a CQE as its description says. result.value = the
// ticket (the block after the last WQE).
MORI_HD_INLINE QueueResult PostWqes(const QpEndpoint& ep, const WqeDesc* d, uint32_t n,
                                    const PostContext& ctx) {
  uint32_t blocks = 0;
  for (uint32_t i = 0; i < n; i++) {
    if (d[i].kind == WqeKind::kWriteInline && d[i].local.len > kMaxInlinePayload) {
      return QueueResult{QueueStatus::kInvalid,
                         "inline payload within kMaxInlinePayload",
                         nullptr,
                         kMaxInlinePayload,
                         d[i].local.len,
                         0,
                         0};
    }
    blocks += WqeBlocks(d[i]);
  }
  QueueResult r = ReserveSlots(ep, blocks, ctx);
  if (r.status != QueueStatus::kOk) return r;
  const uint64_t start = r.value;
  uint64_t at = start, last = start;
  for (uint32_t i = 0; i < n; i++) {
    last = at;
    at += WriteWqe(ep.sq, at, d[i]);
  }
  return RingDoorbell(ep, start, blocks, last, ctx);
}

// How a signal word is updated after its data (same QP: RC executes in order, so the target sees
// the data before the signal). kSet: an 8-byte inline WRITE (single-copy atomic at the target);
// kAdd: an 8-byte FETCH_ADD (old value into `addResult`).
enum class SignalUpdate : uint32_t { kSet, kAdd };

// The signal WQE; `value` must stay alive until the WQE is written (kSet copies it inline). It
// requests a CQE.
MORI_HD_INLINE WqeDesc SignalWqe(SignalUpdate update, const mlx5::Mlx5RemoteBuf& word,
                                 const uint64_t& value, const mlx5::Mlx5LocalBuf& addResult) {
  WqeDesc s{};
  s.remote = word;
  if (update == SignalUpdate::kSet) {
    s.kind = WqeKind::kWriteInline;
    s.inlineData = &value;
    s.local = mlx5::Mlx5LocalBuf{0, 0, sizeof(uint64_t)};
  } else {
    s.kind = WqeKind::kFetchAdd;
    s.local = addResult;
    s.swapAdd = value;
  }
  return s;
}

// Data followed by its signal on the same QP, both in one reservation and one doorbell. `data` may
// be unsignalled: the signal's CQE covers it. result.value = the ticket.
MORI_HD_INLINE QueueResult PostWriteWithSignal(const QpEndpoint& ep, const WqeDesc& data,
                                               const WqeDesc& signal, const PostContext& ctx) {
  const WqeDesc d[2] = {data, signal};
  return PostWqes(ep, d, 2, ctx);
}

// RDMA WRITE of `src` to `dst`, then a fetch-add of `signalAdd` on `signal` (old value into
// `signalResult`), one reservation and one doorbell.
MORI_HD_INLINE QueueResult PostWriteWithSignal(const QpEndpoint& ep, const mlx5::Mlx5LocalBuf& src,
                                               const mlx5::Mlx5RemoteBuf& dst,
                                               const mlx5::Mlx5LocalBuf& signalResult,
                                               const mlx5::Mlx5RemoteBuf& signal,
                                               uint64_t signalAdd, const PostContext& ctx) {
  WqeDesc w{};
  w.kind = WqeKind::kWrite;
  w.local = src;
  w.remote = dst;
  return PostWriteWithSignal(ep, w, SignalWqe(SignalUpdate::kAdd, signal, signalAdd, signalResult),
                             ctx);
}

// Non-blocking: true once every WQE before block `ticket` has completed (successfully or not: see
// QpInError). Drains ready CQEs once unless another thread is draining. Unsignalled WQEs complete
// only with a later CQE of this SQ: a ticket whose last WQE requested a CQE completes by itself;
// WaitCompleted and Quiet request one when needed.
MORI_HD_INLINE bool IsCompleted(const QpEndpoint& ep, uint64_t ticket) {
  if (hd::LoadAcquire(ep.cq.completed) >= ticket) return true;
  PollCq(ep.sq, ep.cq);
  return hd::LoadAcquire(ep.cq.completed) >= ticket;
}

// Waits (bounded, draining the CQ) until every WQE before block `ticket` (<= the published
// count) has completed. When no published CQE request covers the ticket (`signalled` < ticket),
// it first posts a NOP that requests one. kQpError when an error completion was seen (details in
// ep.cq.error). result.value = the block count waited for.
MORI_HD_INLINE QueueResult WaitCompleted(const QpEndpoint& ep, uint64_t ticket,
                                         const PostContext& ctx) {
  uint64_t target = ticket;
  if (hd::LoadAcquire(ep.cq.completed) < target && hd::LoadAcquire(ep.sq.signalled) < target) {
    WqeDesc nop{};
    nop.kind = WqeKind::kNop;
    const QueueResult r = PostWqe(ep, nop, ctx);
    if (r.status != QueueStatus::kOk) return r;
    target = r.value + 1;
  }
  QueueResult r =
      detail::WaitCounterAtLeast(ep, ep.cq.completed, target, true, ctx, "SQ completions (quiet)");
  if (r.status != QueueStatus::kOk) return r;
  if (QpInError(ep.cq)) {
    return QueueResult{QueueStatus::kQpError, "no error completion", nullptr, 0, 0, 0, target};
  }
  return QueueOk(target);
}

// Waits (bounded, draining the CQ) until every published WQE has completed.
MORI_HD_INLINE QueueResult Quiet(const QpEndpoint& ep, const PostContext& ctx) {
  return WaitCompleted(ep, hd::LoadAcquire(ep.sq.ready), ctx);
}

// Builds an endpoint over `c` with the given rings (host tests, emulator set-up).
MORI_HD_INLINE QpEndpoint MakeEndpoint(void* sqRing, uint32_t sqBlocks, uint32_t qpn, void* cqRing,
                                       uint32_t numCqes, QpCounters* c) {
  QpEndpoint ep{};
  ep.sq.ring = sqRing;
  ep.sq.numBlocks = sqBlocks;
  ep.sq.qpn = qpn;
  ep.sq.reserved = &c->reserved;
  ep.sq.ready = &c->ready;
  ep.sq.signalled = &c->signalled;
  ep.sq.dbrec = &c->sqDbrec[1];
  ep.sq.doorbell = &c->doorbellMailbox;
  ep.sq.doorbellMode = DoorbellMode::kMailbox;
  ep.cq.ring = cqRing;
  ep.cq.numCqes = numCqes;
  ep.cq.dbrec = &c->cqDbrec[0];
  ep.cq.consumer = &c->consumer;
  ep.cq.completed = &c->completed;
  ep.cq.pollLock = &c->pollLock;
  ep.cq.error = &c->error;
  return ep;
}

}  // namespace mori::core::rdma

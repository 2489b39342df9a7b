// The mlx5 send-queue posting protocol shared by GPU threads and (in tests) host threads.
//
// Endpoint handles are plain structs of pointers: a GPU holds them in its state, the counters live
// in device or mapped host memory, the host test harness uses ordinary memory. Every counter is a
// free-running 64-bit count of 64-byte basic blocks (never wraps in practice); only the 16-bit
// wqe_index / doorbell record see the hardware's wrap-around.
//
//   reserved  : next free block; ReserveSlots fetch-adds it (many threads at once)
//   ready     : blocks published; a thread publishes [start, start+n) only when ready == start
//   completed : blocks whose WQEs completed (advanced by whoever drains the CQ)
//
// Contract: every WQE posted through WriteWqe requests a CQE (kCtrlCqUpdate), so `completed` is
// exact and Quiet is "completed == ready". The CQ must have at least as many entries as the SQ
// has basic blocks (no overrun possible). A WQE may span several blocks and cross the ring end:
// it is staged and copied in 16-byte units. After any wait fails (timeout) the endpoint is dead:
// reserved slots that were never published block everyone behind them (same as a device abort).
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

#if MORI_HD_DEVICE_PASS
#include "mori/core/device/wait.hpp"
#else
namespace mori::core {
struct DeviceErrorRecord;  // defined in core/device/wait.hpp (device builds)
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
  uint64_t* reserved;   // counters (see the header comment)
  uint64_t* ready;
  uint32_t* dbrec;      // SQ doorbell record (DBR dword 1): BE32(producer & 0xffff)
  uint64_t* doorbell;   // UAR register or mailbox: first 8 bytes of the last published ctrl seg
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
  kTimeout = 1,   // a bounded wait expired; see QueueResult.waitedFor
  kQpError = 2,   // an error completion was seen on this QP (see CqHandle::error)
  kInvalid = 3,   // bad argument (e.g. a WQE larger than the ring)
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

MORI_HD_INLINE bool QpInError(const CqHandle& cq) {
  return hd::LoadAcquire(&cq.error->valid) != 0;
}

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
#if MORI_HD_DEVICE_PASS
  uint64_t nextAbortCheck = kAbortCheckFirstNs;  // the abort flag is a PCIe read: ration it
#endif
  for (uint32_t iter = 1;; iter++) {
    if (poll) PollCq(ep.sq, ep.cq);
    v = hd::LoadAcquire(counter);
    if (v >= target) return QueueOk();
    if ((iter & 15u) == 0) {
      const uint64_t elapsed = hd::NowNs() - t0;
#if MORI_HD_DEVICE_PASS
      WaitContext wctx{ctx.err, ctx.timeoutNs, ctx.rank};
      if (elapsed >= nextAbortCheck) {
        if (DeviceAborted(wctx))
          return QueueResult{QueueStatus::kTimeout, label, counter, target, v, elapsed, 0};
        nextAbortCheck = elapsed + kAbortCheckPeriodNs;
      }
      if (elapsed > ctx.timeoutNs) {
        RecordWaitTimeout<uint64_t>(wctx, ctx.peer, label, counter, CmpOp::kGe, target, v,
                                    elapsed);
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
    uint8_t* dst =
        static_cast<uint8_t*>(mlx5::SqBasicBlock(sq.ring, static_cast<uint32_t>(start + off / 64),
                                                 sq.numBlocks)) +
        (off % 64);
    const uint64_t* s = reinterpret_cast<const uint64_t*>(src + off);
    uint64_t* d = reinterpret_cast<uint64_t*>(dst);
    d[0] = s[0];
    d[1] = s[1];
  }
}
}  // namespace detail

// Reserves `numBlocks` consecutive basic blocks; result.value = the first block's counter. Waits
// (bounded, draining the CQ) until the ring has room for them. Fails fast with kQpError once the
// QP has seen an error completion (nothing is reserved then).
MORI_HD_INLINE QueueResult ReserveSlots(const QpEndpoint& ep, uint32_t numBlocks,
                                        const PostContext& ctx) {
  if (numBlocks == 0 || numBlocks > ep.sq.numBlocks || numBlocks > mlx5::kMaxWqeBasicBlocks * 64) {
    return QueueResult{QueueStatus::kInvalid, "block count within the ring", nullptr,
                       ep.sq.numBlocks, numBlocks, 0, 0};
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
  uint8_t fence;           // 0 or mlx5::kCtrlFence / kCtrlInitiatorSmallFence
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

// Writes one WQE into reserved blocks starting at `block` (signalled: requests a CQE). Returns
// the blocks written (0: the description does not fit, e.g. inline payload too large).
MORI_HD_INLINE uint32_t WriteWqe(const SqHandle& sq, uint64_t block, const WqeDesc& d) {
  const mlx5::Mlx5WqeHeader h{static_cast<uint16_t>(block), sq.qpn,
                              static_cast<uint8_t>(mlx5::kCtrlCqUpdate | d.fence)};
  const uint32_t blocks = WqeBlocks(d);
  if (d.kind == WqeKind::kWriteInline && d.local.len > kMaxInlinePayload) return 0;
  const bool contiguous = (static_cast<uint32_t>(block) & (sq.numBlocks - 1)) + blocks <= sq.numBlocks;
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
    case WqeKind::kRead:
      ds = mlx5::EncodeRdmaReadWqe(dst, h, d.local, d.remote);
      break;
    case WqeKind::kFetchAdd:
      ds = mlx5::EncodeAtomicWqe(dst, h, mlx5::kOpAtomicFa, d.local, d.remote, d.swapAdd, 0);
      break;
    case WqeKind::kCompareSwap:
      ds = mlx5::EncodeAtomicWqe(dst, h, mlx5::kOpAtomicCs, d.local, d.remote, d.swapAdd,
                                 d.compare);
      break;
    case WqeKind::kNop:
      ds = mlx5::EncodeNopWqe(dst, h);
      break;
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
MORI_HD_INLINE QueueResult RingDoorbell(const QpEndpoint& ep, uint64_t start, uint32_t numBlocks,
                                        uint64_t lastWqe, const PostContext& ctx) {
  // The doorbell value is read before publication: once the record moves, the WQE may complete
  // and its slot be reused by another poster.
  const uint8_t* ctrl = static_cast<const uint8_t*>(
      mlx5::SqBasicBlock(ep.sq.ring, static_cast<uint32_t>(lastWqe), ep.sq.numBlocks));
  const uint64_t db = mlx5::detail::LoadWord<uint64_t>(ctrl, 0);
  hd::FenceRelease();  // this thread's WQE bytes before its publication
  QueueResult r = detail::WaitCounterAtLeast(ep, ep.sq.ready, start, false, ctx,
                                             "earlier SQ reservations published");
  if (r.status != QueueStatus::kOk) return r;
  const uint64_t end = start + numBlocks;
  hd::StoreRelease<uint32_t>(ep.sq.dbrec, mlx5::SqDoorbellRecord(static_cast<uint32_t>(end)));
  hd::StoreRelease<uint64_t>(ep.sq.doorbell, db);
  hd::StoreRelease<uint64_t>(ep.sq.ready, end);
  return QueueOk(end);
}

// Reserve + write + ring one WQE. result.value = its first block.
MORI_HD_INLINE QueueResult PostWqe(const QpEndpoint& ep, const WqeDesc& d, const PostContext& ctx) {
  const uint32_t blocks = WqeBlocks(d);
  if (d.kind == WqeKind::kWriteInline && d.local.len > kMaxInlinePayload) {
    return QueueResult{QueueStatus::kInvalid, "inline payload within kMaxInlinePayload", nullptr,
                       kMaxInlinePayload, d.local.len, 0, 0};
  }
  QueueResult r = ReserveSlots(ep, blocks, ctx);
  if (r.status != QueueStatus::kOk) return r;
  const uint64_t start = r.value;
  WriteWqe(ep.sq, start, d);
  r = RingDoorbell(ep, start, blocks, start, ctx);
  if (r.status != QueueStatus::kOk) return r;
  return QueueOk(start);
}

// Write followed by a signal on the same QP (RC executes in order, so the target sees the data
// before the signal): a fetch-add of `signalAdd` on `signal` (old value into `signalResult`).
// Both WQEs are reserved together and published with one doorbell.
MORI_HD_INLINE QueueResult PostWriteWithSignal(const QpEndpoint& ep, const mlx5::Mlx5LocalBuf& src,
                                               const mlx5::Mlx5RemoteBuf& dst,
                                               const mlx5::Mlx5LocalBuf& signalResult,
                                               const mlx5::Mlx5RemoteBuf& signal,
                                               uint64_t signalAdd, const PostContext& ctx) {
  QueueResult r = ReserveSlots(ep, 2, ctx);
  if (r.status != QueueStatus::kOk) return r;
  const uint64_t start = r.value;
  WqeDesc w{};
  w.kind = WqeKind::kWrite;
  w.local = src;
  w.remote = dst;
  WriteWqe(ep.sq, start, w);
  WqeDesc s{};
  s.kind = WqeKind::kFetchAdd;
  s.local = signalResult;
  s.remote = signal;
  s.swapAdd = signalAdd;
  WriteWqe(ep.sq, start + 1, s);
  return RingDoorbell(ep, start, 2, start + 1, ctx);
}

// Waits (bounded, draining the CQ) until every published WQE has completed. kQpError when an
// error completion was seen (its details are in ep.cq.error).
MORI_HD_INLINE QueueResult Quiet(const QpEndpoint& ep, const PostContext& ctx) {
  const uint64_t target = hd::LoadAcquire(ep.sq.ready);
  QueueResult r = detail::WaitCounterAtLeast(ep, ep.cq.completed, target, true, ctx,
                                             "SQ completions (quiet)");
  if (r.status != QueueStatus::kOk) return r;
  if (QpInError(ep.cq)) {
    return QueueResult{QueueStatus::kQpError, "no error completion", nullptr, 0, 0, 0, target};
  }
  return QueueOk(target);
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

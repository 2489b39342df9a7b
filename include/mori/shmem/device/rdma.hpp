// The RDMA route of the shmem device API: each call becomes mlx5 work requests posted by the
// calling thread (the scope's leader for Warp/Block calls) on an RC queue pair to the peer, with
// the posting protocol of core/transport/rdma_queue.hpp. Internal to the shmem device API.
//
// Contract (what differs from the load/store route):
//  * Local buffers of RDMA work requests must lie in this PE's symmetric heap (registered at init)
//    or in a buffer registered with ShmemRegisterBuffer: put sources of more than kRdmaInlineMax
//    bytes (smaller ones travel inline in the WQE, from any memory), get destinations. Otherwise
//    the call records "not RDMA-registered".
//  * Which QP: the ...Qp functions take a channel `qp` (used modulo the peer's numQps), so the
//    requests of one channel stay in RC order whichever threads post them; the other functions use
//    the calling thread's QP (global warp index mod numQps), so the RC order of one thread's (and
//    one warp's) operations to one PE is preserved: a signal or an atomic posted after a put lands
//    after it. Between requests on different QPs only quiet orders.
//  * A put's data WRITEs and its signal are reserved together and published with one doorbell;
//    the signal requests a CQE, the data WRITEs before it do not (the signal's CQE covers them).
//  * Puts and gets complete at quiet (ShmemQuiet*, the blocking variants, the barrier): a get's
//    data is in its destination only then. Fetching atomics wait for their own completion. A
//    put's ticket (the SQ block count after its requests) tells when it has completed without a
//    quiet (ShmemRdmaCompleted).
//  * Atomics over RDMA are 64-bit (the NIC's FETCH_ADD / COMPARE_SWAP); 32-bit ones record an
//  error.
//  * A timed-out wait is recorded by the queue (label names what it waited for); an error
//    completion is recorded with QPN, WQE index and syndrome (kind kRemote, cmp =
//    kDeviceErrorRdmaCqe; the host raises RemoteError). Either
//    way the abort flag is raised, and the call reports failure.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mori/core/device/wait.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/transport/rdma_queue.hpp"
#include "mori/shmem/device/resolve.hpp"
#include "mori/shmem/device/scope.hpp"
#include "mori/shmem/shmem_types.hpp"

namespace mori::shmem::detail {

namespace rdma = core::rdma;
namespace mlx5 = core::mlx5;

// Puts of at most this many bytes travel inline in the WQE (no registration needed for the source).
constexpr uint32_t kRdmaInlineMax = 64;
// Largest single RDMA message; longer puts/gets are split.
constexpr uint64_t kRdmaMaxMessage = 1ull << 30;
// QP choice of the functions without a `qp` argument: the calling thread's warp (see RdmaQpIndex).
constexpr int64_t kWarpQp = -1;

MORI_DEVICE_INLINE rdma::PostContext RdmaPostCtx(const ShmemDeviceContext& ctx, int pe) {
  return rdma::PostContext{ctx.wait.timeoutNs, ctx.wait.err, ctx.rank, pe};
}

// The QP to `pe` for channel `qp` (>= 0: qp mod numQps; kWarpQp: the calling thread's global warp
// index mod numQps; see the contract above).
MORI_DEVICE_INLINE uint32_t RdmaQpIndex(const ShmemRdmaPeer& p, int64_t qp = kWarpQp) {
  if (p.numQps <= 1) return 0;
  if (qp >= 0) return static_cast<uint32_t>(static_cast<uint64_t>(qp) % p.numQps);
  const uint32_t block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const uint32_t warp =
      (block * static_cast<uint32_t>(BlockThreads()) + static_cast<uint32_t>(FlatThreadId())) /
      static_cast<uint32_t>(core::kWarpSize);
  return warp % p.numQps;
}

// [addr, addr + bytes) as the local side of a work request: it must be inside this PE's heap or
// a buffer registered with ShmemRegisterBuffer.
MORI_DEVICE_INLINE bool RdmaLocal(const ShmemDeviceContext& ctx, const void* addr, size_t bytes,
                                  uint32_t& lkey, CallStatus& st) {
  const uint64_t a = reinterpret_cast<uintptr_t>(addr);
  const uint64_t off = a - ctx.heapBase;
  if (off <= ctx.heapSize && bytes <= ctx.heapSize - off) {
    lkey = ctx.heapLkey;
    return true;
  }
  if (ctx.userRegions != nullptr) {
    for (int i = 0; i < kMaxUserRegions; i++) {
      const ShmemUserRegion& r = ctx.userRegions[i];
      const uint64_t o = a - r.base;
      if (r.size != 0 && o <= r.size && bytes <= r.size - o) {
        lkey = r.lkey;
        return true;
      }
    }
  }
  st.Set(CallError::kNotRegistered, a, bytes);
  return false;
}

// The remote side: PE pe's copy of the local symmetric range [addr, addr + bytes).
MORI_DEVICE_INLINE bool RdmaRemote(const ShmemDeviceContext& ctx, const ShmemRdmaPeer& p,
                                   const void* addr, size_t bytes, size_t align, uint64_t& raddr,
                                   CallStatus& st) {
  const uint64_t a = reinterpret_cast<uintptr_t>(addr);
  const uint64_t off = a - ctx.heapBase;
  if (off > ctx.heapSize || bytes > ctx.heapSize - off) {
    st.Set(CallError::kNotInHeap, a, bytes);
    return false;
  }
  if ((a & (align - 1)) != 0) {
    st.Set(CallError::kMisaligned, a, align);
    return false;
  }
  raddr = p.remoteHeapBase + off;
  return true;
}

// Records a failed queue operation: timeouts are already recorded by the queue's bounded waits;
// an error completion gets its own record (QPN, WQE index, syndrome); a rejected request is a
// usage error.
__device__ __noinline__ inline void ReportRdmaFailure(const ShmemDeviceContext& ctx, int pe,
                                                      const char* op, const rdma::QueueResult& r,
                                                      const rdma::QpEndpoint& ep) {
  if (r.status == rdma::QueueStatus::kTimeout) return;
  if (r.status == rdma::QueueStatus::kQpError) {
    const rdma::CqErrorInfo& e = *ep.cq.error;
    const uint64_t syndrome = static_cast<uint64_t>(e.syndrome) |
                              (static_cast<uint64_t>(e.vendorSyndrome) << 8) |
                              (static_cast<uint64_t>(e.sendOpcode) << 16);
    const core::DeviceErrorFields f{core::DeviceErrorKind::kRemote,
                                    pe,
                                    core::kDeviceErrorRdmaCqe,
                                    0,
                                    e.qpn,
                                    e.wqeCounter,
                                    syndrome,
                                    0};
    if (core::RecordDeviceError(ctx.wait, f, op, ": error completion") || ctx.wait.err == nullptr) {
      printf(
          "[MORI device error] rank %d block %d thread %d: %s: RDMA error completion from pe %d: "
          "QP 0x%x WQE %u syndrome 0x%02x vendor 0x%02x\n",
          ctx.rank, (int)blockIdx.x, (int)threadIdx.x, op, pe, e.qpn, (unsigned)e.wqeCounter,
          (unsigned)e.syndrome, (unsigned)e.vendorSyndrome);
    }
    return;
  }
  CallStatus st;
  st.Set(CallError::kRdmaRejected, r.seen, r.expected);
  ReportCallError(ctx.wait, pe, op, st);
}

// Posts one WQE on the calling thread's QP to `pe`; returns the queue result (value = its block).
MORI_DEVICE_INLINE rdma::QueueResult RdmaPost(const ShmemDeviceContext& ctx, int pe,
                                              const rdma::WqeDesc& d, const char* op) {
  const ShmemRdmaPeer& p = ctx.rdmaPeers[pe];
  const rdma::QpEndpoint& ep = p.qps[RdmaQpIndex(p)];
  const rdma::QueueResult r = rdma::PostWqe(ep, d, RdmaPostCtx(ctx, pe));
  if (r.status != rdma::QueueStatus::kOk) ReportRdmaFailure(ctx, pe, op, r, ep);
  return r;
}

// Waits until every WQE before `ticket` on QP index q to `pe` has completed (posting a
// CQE-requesting NOP when nothing published would complete them).
MORI_DEVICE_INLINE bool RdmaWaitCompleted(const ShmemDeviceContext& ctx, int pe, uint32_t q,
                                          uint64_t ticket, const char* op) {
  const rdma::QpEndpoint& ep = ctx.rdmaPeers[pe].qps[q];
  const rdma::QueueResult r = rdma::WaitCompleted(ep, ticket, RdmaPostCtx(ctx, pe));
  if (r.status == rdma::QueueStatus::kOk) return true;
  ReportRdmaFailure(ctx, pe, op, r, ep);
  return false;
}

// Completes every WQE posted so far on QP index q to `pe`.
MORI_DEVICE_INLINE bool RdmaQuietQp(const ShmemDeviceContext& ctx, int pe, uint32_t q,
                                    const char* op) {
  const rdma::QpEndpoint& ep = ctx.rdmaPeers[pe].qps[q];
  return RdmaWaitCompleted(ctx, pe, q, core::hd::LoadAcquire(ep.sq.ready), op);
}

// Completes every WQE posted so far on every QP to `pe`.
MORI_DEVICE_INLINE bool RdmaQuietPe(const ShmemDeviceContext& ctx, int pe, const char* op) {
  const ShmemRdmaPeer& p = ctx.rdmaPeers[pe];
  bool ok = true;
  for (uint32_t q = 0; q < p.numQps; q++) ok = RdmaQuietQp(ctx, pe, q, op) && ok;
  return ok;
}

// Non-blocking: whether every WQE before `ticket` on QP index q to `pe` has completed. A completed
// QP in error is recorded (like a failed quiet) and counts as completed, so callers do not spin.
MORI_DEVICE_INLINE bool RdmaCompleted(const ShmemDeviceContext& ctx, int pe, uint32_t q,
                                      uint64_t ticket, const char* op) {
  const rdma::QpEndpoint& ep = ctx.rdmaPeers[pe].qps[q];
  if (!rdma::IsCompleted(ep, ticket)) return false;
  if (rdma::QpInError(ep.cq)) {
    const rdma::QueueResult r{
        rdma::QueueStatus::kQpError, "no error completion", nullptr, 0, 0, 0, 0};
    ReportRdmaFailure(ctx, pe, op, r, ep);
  }
  return true;
}

// Completes every WQE posted so far to every RDMA peer (nothing to do without RDMA peers).
MORI_DEVICE_INLINE bool RdmaQuietAll(const ShmemDeviceContext& ctx, const char* op) {
  if (ctx.rdmaPeers == nullptr) return true;
  bool ok = true;
  for (int pe = 0; pe < ctx.worldSize; pe++) {
    if (ctx.transport[pe] == TransportType::kRdma) ok = RdmaQuietPe(ctx, pe, op) && ok;
  }
  return ok;
}

// RDMA WRITE (local -> remote) or READ (remote -> local) of `bytes` between `local` (in this PE's
// heap) and PE pe's copy of the symmetric range at `symm`, in kRdmaMaxMessage pieces. Leader-only.
MORI_DEVICE_INLINE bool RdmaTransfer(const ShmemDeviceContext& ctx, int pe, rdma::WqeKind kind,
                                     const void* local, const void* symm, size_t bytes,
                                     const char* op, CallStatus& st) {
  const ShmemRdmaPeer& p = ctx.rdmaPeers[pe];
  uint64_t raddr = 0;
  if (!RdmaRemote(ctx, p, symm, bytes, 1, raddr, st)) return false;
  if (bytes == 0) return true;
  rdma::WqeDesc d{};
  d.remote = mlx5::Mlx5RemoteBuf{raddr, p.rkey};
  if (kind == rdma::WqeKind::kWrite && bytes <= kRdmaInlineMax) {
    d.kind = rdma::WqeKind::kWriteInline;
    d.inlineData = local;
    d.local = mlx5::Mlx5LocalBuf{0, 0, static_cast<uint32_t>(bytes)};
    return RdmaPost(ctx, pe, d, op).status == rdma::QueueStatus::kOk;
  }
  uint32_t lkey = 0;
  if (!RdmaLocal(ctx, local, bytes, lkey, st)) return false;
  d.kind = kind;
  for (uint64_t done = 0; done < bytes; done += kRdmaMaxMessage) {
    const uint64_t n = bytes - done < kRdmaMaxMessage ? bytes - done : kRdmaMaxMessage;
    d.local = mlx5::Mlx5LocalBuf{reinterpret_cast<uintptr_t>(local) + done, lkey,
                                 static_cast<uint32_t>(n)};
    d.remote.addr = raddr + done;
    if (RdmaPost(ctx, pe, d, op).status != rdma::QueueStatus::kOk) return false;
  }
  return true;
}

// RDMA READ of PE pe's copy of symmetric `src` into local `dest` (in the heap). Completes at quiet.
MORI_DEVICE_INLINE bool RdmaGet(const ShmemDeviceContext& ctx, int pe, void* dest, const void* src,
                                size_t bytes, const char* op, CallStatus& st) {
  return RdmaTransfer(ctx, pe, rdma::WqeKind::kRead, dest, src, bytes, op, st);
}

// The scratch word (in this PE's heap) for the result of the WQE at `slot` on QP index q: indexed
// by the slot modulo twice the ring, so it is unique while the WQE is outstanding and overwritten
// only after a full ring of later WQEs has also completed, far longer than a fetching thread
// needs to read it after its completion.
MORI_DEVICE_INLINE uint64_t* RdmaScratchWord(const ShmemRdmaPeer& p, uint32_t q, uint64_t slot) {
  const uint64_t words = 2ull * p.qps[q].sq.numBlocks;
  return p.scratch + static_cast<uint64_t>(q) * words + (slot & (words - 1));
}

// One single-word request on PE pe's copy of symmetric `addr` whose result lands in its scratch
// word (RdmaScratchWord):
// FETCH_ADD / COMPARE_SWAP (64-bit) or a READ of `bytes` (<= 8, naturally aligned). With `fetch`,
// waits for this WQE's completion and returns the scratch word in *old.
MORI_DEVICE_INLINE bool RdmaFetchOp(const ShmemDeviceContext& ctx, int pe, const void* addr,
                                    rdma::WqeKind kind, uint32_t bytes, uint64_t swapAdd,
                                    uint64_t compare, bool fetch, uint64_t* old, const char* op,
                                    CallStatus& st) {
  const ShmemRdmaPeer& p = ctx.rdmaPeers[pe];
  uint64_t raddr = 0;
  if (!RdmaRemote(ctx, p, addr, bytes, bytes, raddr, st)) return false;
  const uint32_t q = RdmaQpIndex(p);
  const rdma::QpEndpoint& ep = p.qps[q];
  const rdma::PostContext pc = RdmaPostCtx(ctx, pe);
  rdma::QueueResult r = rdma::ReserveSlots(ep, 1, pc);
  if (r.status != rdma::QueueStatus::kOk) {
    ReportRdmaFailure(ctx, pe, op, r, ep);
    return false;
  }
  const uint64_t slot = r.value;
  uint64_t* result = RdmaScratchWord(p, q, slot);
  if (kind == rdma::WqeKind::kRead) *result = 0;  // a short read fills only its low bytes
  rdma::WqeDesc d{};
  d.kind = kind;
  d.local = mlx5::Mlx5LocalBuf{reinterpret_cast<uintptr_t>(result), ctx.heapLkey, bytes};
  d.remote = mlx5::Mlx5RemoteBuf{raddr, p.rkey};
  d.swapAdd = swapAdd;
  d.compare = compare;
  rdma::WriteWqe(ep.sq, slot, d);
  r = rdma::RingDoorbell(ep, slot, 1, slot, pc);
  if (r.status == rdma::QueueStatus::kOk && fetch) {
    r = rdma::detail::WaitCounterAtLeast(ep, ep.cq.completed, slot + 1, true, pc,
                                         "completion of a fetching RDMA request");
    if (r.status == rdma::QueueStatus::kOk && rdma::QpInError(ep.cq)) {
      r = rdma::QueueResult{
          rdma::QueueStatus::kQpError, "no error completion", nullptr, 0, 0, 0, 0};
    }
    if (r.status == rdma::QueueStatus::kOk) *old = core::AtomicLoadAcquireSystem(result);
  }
  if (r.status != rdma::QueueStatus::kOk) {
    ReportRdmaFailure(ctx, pe, op, r, ep);
    return false;
  }
  return true;
}

// One put to an RDMA peer: the data [src, src + bytes) -> PE pe's copy of symmetric `dest`, then
// optionally the signal word. sigOp kNone: no signal.
struct RdmaPutArgs {
  void* dest;
  const void* src;
  size_t bytes;
  uint64_t* sigAddr;
  uint64_t sigValue;
  SignalOp sigOp;
  CqeMode cqe;  // with a signal, only the signal requests a CQE whatever this says
};

// The data WQEs of one put: one inline WRITE (<= kRdmaInlineMax bytes, source anywhere) or
// kRdmaMaxMessage pieces gathering from registered memory.
struct RdmaPutPieces {
  rdma::WqeDesc desc;  // the first piece; piece k moves both addresses by k * kRdmaMaxMessage
  uint32_t count;
  uint32_t blocks;  // of all pieces
  uint64_t bytes;

  // Describes [src, src + bytes) -> remote `raddr`; false with `st` set when the source needs a
  // registration it does not have.
  MORI_DEVICE_INLINE bool Plan(const ShmemDeviceContext& ctx, const ShmemRdmaPeer& p,
                               const void* src, size_t n, uint64_t raddr, CallStatus& st) {
    desc = rdma::WqeDesc{};
    desc.remote = mlx5::Mlx5RemoteBuf{raddr, p.rkey};
    desc.unsignalled = true;
    bytes = n;
    count = blocks = 0;
    if (n == 0) return true;
    if (n <= kRdmaInlineMax) {
      desc.kind = rdma::WqeKind::kWriteInline;
      desc.inlineData = src;
      desc.local = mlx5::Mlx5LocalBuf{0, 0, static_cast<uint32_t>(n)};
      count = 1;
      blocks = rdma::WqeBlocks(desc);
      return true;
    }
    uint32_t lkey = 0;
    if (!RdmaLocal(ctx, src, n, lkey, st)) return false;
    desc.kind = rdma::WqeKind::kWrite;
    desc.local = mlx5::Mlx5LocalBuf{reinterpret_cast<uintptr_t>(src), lkey, 0};
    count = blocks = static_cast<uint32_t>((n + kRdmaMaxMessage - 1) / kRdmaMaxMessage);
    return true;
  }

  // Piece k, requesting a CQE when `cqe`.
  MORI_DEVICE_INLINE rdma::WqeDesc Piece(uint32_t k, bool cqe) const {
    rdma::WqeDesc d = desc;
    d.unsignalled = !cqe;
    if (d.kind == rdma::WqeKind::kWrite) {
      const uint64_t off = static_cast<uint64_t>(k) * kRdmaMaxMessage;
      d.local.addr += off;
      d.local.len =
          static_cast<uint32_t>(bytes - off < kRdmaMaxMessage ? bytes - off : kRdmaMaxMessage);
      d.remote.addr += off;
    }
    return d;
  }
  // Blocks of piece k.
  MORI_DEVICE_INLINE uint32_t PieceBlocks() const { return count == 0 ? 0 : blocks / count; }
};

// The signal WQE at `slot` (a FETCH_ADD's old value goes to the slot's scratch word). `value` must
// stay alive until it is written.
MORI_DEVICE_INLINE rdma::WqeDesc RdmaSignalWqe(const ShmemDeviceContext& ctx,
                                               const ShmemRdmaPeer& p, uint32_t q, uint64_t slot,
                                               uint64_t sigRaddr, SignalOp sigOp,
                                               const uint64_t& value) {
  const mlx5::Mlx5LocalBuf result{reinterpret_cast<uintptr_t>(RdmaScratchWord(p, q, slot)),
                                  ctx.heapLkey, sizeof(uint64_t)};
  return rdma::SignalWqe(
      sigOp == SignalOp::kAdd ? rdma::SignalUpdate::kAdd : rdma::SignalUpdate::kSet,
      mlx5::Mlx5RemoteBuf{sigRaddr, p.rkey}, value, result);
}

// Posts a put (data pieces, then the signal) on QP index q of `pe`, in as few reservations as
// MaxReserveBlocks allows (one unless the data needs more pieces than a reservation holds), each
// published with one doorbell. The last WQE requests a CQE (unless it is data with cqe kSkipped).
// *ticket (optional) = the block count after the last WQE. Leader-only.
MORI_DEVICE_INLINE bool RdmaPutSignal(const ShmemDeviceContext& ctx, int pe, int64_t qp,
                                      const RdmaPutArgs& a, uint64_t* ticket, const char* op,
                                      CallStatus& st) {
  const ShmemRdmaPeer& p = ctx.rdmaPeers[pe];
  const uint32_t q = RdmaQpIndex(p, qp);
  const rdma::QpEndpoint& ep = p.qps[q];
  const bool hasSig = a.sigOp != SignalOp::kNone;
  uint64_t raddr = 0, sigRaddr = 0;
  if (!RdmaRemote(ctx, p, a.dest, a.bytes, 1, raddr, st)) return false;
  if (hasSig && !RdmaRemote(ctx, p, a.sigAddr, sizeof(uint64_t), sizeof(uint64_t), sigRaddr, st))
    return false;
  RdmaPutPieces data;
  if (!data.Plan(ctx, p, a.src, a.bytes, raddr, st)) return false;
  const uint32_t n = data.count + (hasSig ? 1 : 0);
  const uint32_t cap = rdma::MaxReserveBlocks(ep.sq);
  const rdma::PostContext pc = RdmaPostCtx(ctx, pe);
  uint64_t end = 0;
  for (uint32_t i = 0; i < n;) {
    // WQEs [i, j) go into this reservation (a single WQE larger than `cap` is refused by it).
    uint32_t j = i, blocks = 0;
    while (j < n) {
      const uint32_t b = j < data.count ? data.PieceBlocks() : 1;
      if (blocks + b > cap && j > i) break;
      blocks += b;
      j++;
    }
    rdma::QueueResult r = rdma::ReserveSlots(ep, blocks, pc);
    if (r.status != rdma::QueueStatus::kOk) {
      ReportRdmaFailure(ctx, pe, op, r, ep);
      return false;
    }
    const uint64_t start = r.value;
    uint64_t at = start, last = start;
    for (uint32_t k = i; k < j; k++) {
      last = at;
      const bool lastOfPut = k + 1 == n;
      at += rdma::WriteWqe(ep.sq, at,
                           k < data.count
                               ? data.Piece(k, lastOfPut && a.cqe == CqeMode::kRequested)
                               : RdmaSignalWqe(ctx, p, q, at, sigRaddr, a.sigOp, a.sigValue));
    }
    r = rdma::RingDoorbell(ep, start, blocks, last, pc);
    if (r.status != rdma::QueueStatus::kOk) {
      ReportRdmaFailure(ctx, pe, op, r, ep);
      return false;
    }
    end = r.value;
    i = j;
  }
  if (ticket != nullptr) *ticket = end;
  return true;
}

// RDMA WRITE of local `src` to PE pe's copy of symmetric `dest` (up to kRdmaInlineMax bytes
// inline, from any memory) on the calling thread's QP. Completes at quiet.
MORI_DEVICE_INLINE bool RdmaPut(const ShmemDeviceContext& ctx, int pe, void* dest, const void* src,
                                size_t bytes, const char* op, CallStatus& st) {
  const RdmaPutArgs a{dest, src, bytes, nullptr, 0, SignalOp::kNone, CqeMode::kRequested};
  return RdmaPutSignal(ctx, pe, kWarpQp, a, nullptr, op, st);
}

// Warp-batched put to one RDMA peer: every lane of a full warp calls with its own (dest, src,
// bytes; bytes == 0: nothing) and the same sigAddr, sigValue, sigOp, pe and qp. Every lane checks
// its own range; the leader reserves the blocks of every lane's WQEs plus the signal at once, each
// lane writes its WQEs at its offset (an exclusive scan of the lanes' block counts), the leader
// writes the signal (or, without one, the last data WQE requests the CQE) and rings one doorbell.
// Every lane gets the result and the ticket. The batch must fit one reservation
// (rdma::MaxReserveBlocks); otherwise nothing is posted and the leader records "RDMA request
// refused".
MORI_DEVICE_INLINE bool RdmaPutBatchWarp(const ShmemDeviceContext& ctx, int pe, int64_t qp,
                                         const RdmaPutArgs& a, uint64_t* ticket, const char* op) {
  const int lane = WarpScope::Rank();
  const ShmemRdmaPeer& p = ctx.rdmaPeers[pe];
  const uint32_t q = RdmaQpIndex(p, qp);
  const rdma::QpEndpoint& ep = p.qps[q];
  const bool hasSig = a.sigOp != SignalOp::kNone;
  CallStatus st;
  uint64_t raddr = 0, sigRaddr = 0;
  RdmaPutPieces data;
  bool ok =
      a.bytes == 0 || RdmaRemote(ctx, p, a.dest, a.bytes, 1, raddr, st);  // idle lanes: any dest
  ok = ok && data.Plan(ctx, p, a.src, a.bytes, raddr, st);
  if (ok && lane == 0 && hasSig)
    ok = RdmaRemote(ctx, p, a.sigAddr, sizeof(uint64_t), sizeof(uint64_t), sigRaddr, st);
  const core::LaneMask bad = core::WarpBallot(!ok);
  if (bad != 0) {  // the lowest failing lane reports
    if (!ok && (bad & ((core::LaneMask(1) << lane) - 1)) == 0)
      ReportCallError(ctx.wait, pe, op, st);
    return false;
  }
  uint32_t upTo = data.blocks;  // inclusive scan of the lanes' blocks
  for (int off = 1; off < core::kWarpSize; off <<= 1) {
    const uint32_t t = core::WarpShfl(upTo, lane >= off ? lane - off : lane);
    if (lane >= off) upTo += t;
  }
  const uint32_t dataBlocks = core::WarpShfl(upTo, core::kWarpSize - 1);
  const uint32_t offset = upTo - data.blocks;
  const uint32_t total = dataBlocks + (hasSig ? 1 : 0);
  if (total == 0) {
    if (ticket != nullptr) *ticket = 0;
    return true;
  }
  const rdma::PostContext pc = RdmaPostCtx(ctx, pe);
  rdma::QueueResult r = rdma::QueueOk();
  if (lane == 0) r = rdma::ReserveSlots(ep, total, pc);
  if (core::WarpShfl(static_cast<int>(r.status), 0) != static_cast<int>(rdma::QueueStatus::kOk)) {
    if (lane == 0) ReportRdmaFailure(ctx, pe, op, r, ep);
    return false;
  }
  const uint64_t start = core::WarpShfl(static_cast<unsigned long long>(r.value), 0);
  // Without a signal the lane holding the batch's last WQE requests the CQE.
  const bool holdsLast = !hasSig && data.count > 0 && offset + data.blocks == dataBlocks;
  for (uint32_t k = 0; k < data.count; k++) {
    rdma::WriteWqe(ep.sq, start + offset + k * data.PieceBlocks(),
                   data.Piece(k, holdsLast && k + 1 == data.count));
  }
  const uint64_t myLast = holdsLast ? start + offset + (data.count - 1) * data.PieceBlocks() : 0;
  const uint64_t lastData = core::WarpReduceSum(static_cast<unsigned long long>(myLast));
  // Every lane's WQE bytes before the leader's publication (its release fence is cumulative over
  // what it observed through the warp barrier).
  core::FenceBlock();
  WarpScope::Sync();
  if (lane == 0) {
    core::FenceBlock();
    uint64_t last = lastData;
    if (hasSig) {
      last = start + dataBlocks;
      rdma::WriteWqe(ep.sq, last, RdmaSignalWqe(ctx, p, q, last, sigRaddr, a.sigOp, a.sigValue));
    }
    r = rdma::RingDoorbell(ep, start, total, last, pc);
    if (r.status != rdma::QueueStatus::kOk) ReportRdmaFailure(ctx, pe, op, r, ep);
  }
  const bool posted = WarpScope::Broadcast(r.status == rdma::QueueStatus::kOk);
  const uint64_t end = WarpScope::BroadcastWord(r.value);
  if (ticket != nullptr) *ticket = posted ? end : 0;
  return posted;
}

}  // namespace mori::shmem::detail

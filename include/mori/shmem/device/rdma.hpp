// The RDMA route of the shmem device API: each call becomes mlx5 work requests posted by the
// calling thread (the scope's leader for Warp/Block calls) on an RC queue pair to the peer, with the
// posting protocol of core/transport/rdma_queue.hpp. Internal to the shmem device API.
//
// Contract (what differs from the load/store route):
//  * Local buffers of RDMA work requests must lie in this PE's symmetric heap (registered at init)
//    or in a buffer registered with ShmemRegisterBuffer: put sources of more than kRdmaInlineMax
//    bytes (smaller ones travel inline in the WQE, from any memory), get destinations. Otherwise
//    the call records "not RDMA-registered".
//  * A thread always uses the same QP to a peer (QP = global warp index mod numQps), so the RC
//    order of one thread's (and one warp's) operations to one PE is preserved: a signal or an
//    atomic posted after a put lands after it. Between threads on different QPs only quiet orders.
//  * Puts and gets complete at quiet (ShmemQuiet*, the blocking variants, the barrier): a get's
//    data is in its destination only then. Fetching atomics wait for their own completion.
//  * Atomics over RDMA are 64-bit (the NIC's FETCH_ADD / COMPARE_SWAP); 32-bit ones record an error.
//  * A timed-out wait is recorded by the queue (label names what it waited for); an error
//    completion is recorded with QPN, WQE index and syndrome (cmp = kDeviceErrorRdmaCqe). Either
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

MORI_DEVICE_INLINE rdma::PostContext RdmaPostCtx(const ShmemDeviceContext& ctx, int pe) {
  return rdma::PostContext{ctx.wait.timeoutNs, ctx.wait.err, ctx.rank, pe};
}

// The calling thread's QP to `pe` (see the contract above).
MORI_DEVICE_INLINE uint32_t RdmaQpIndex(const ShmemRdmaPeer& p) {
  if (p.numQps <= 1) return 0;
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
    const core::DeviceErrorFields f{pe, core::kDeviceErrorRdmaCqe, 0, e.qpn, e.wqeCounter,
                                    syndrome, 0};
    if (core::RecordDeviceError(ctx.wait, f, op, ": error completion") ||
        ctx.wait.err == nullptr) {
      printf("[MORI device error] rank %d block %d thread %d: %s: RDMA error completion from pe %d: "
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

// Completes every WQE posted so far on every QP to `pe`.
MORI_DEVICE_INLINE bool RdmaQuietPe(const ShmemDeviceContext& ctx, int pe, const char* op) {
  const ShmemRdmaPeer& p = ctx.rdmaPeers[pe];
  bool ok = true;
  for (uint32_t q = 0; q < p.numQps; q++) {
    const rdma::QueueResult r = rdma::Quiet(p.qps[q], RdmaPostCtx(ctx, pe));
    if (r.status != rdma::QueueStatus::kOk) {
      ReportRdmaFailure(ctx, pe, op, r, p.qps[q]);
      ok = false;
    }
  }
  return ok;
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

// RDMA WRITE of local `src` to PE pe's copy of symmetric `dest` (up to kRdmaInlineMax bytes
// inline, from any memory). Completes at quiet.
MORI_DEVICE_INLINE bool RdmaPut(const ShmemDeviceContext& ctx, int pe, void* dest, const void* src,
                                size_t bytes, const char* op, CallStatus& st) {
  return RdmaTransfer(ctx, pe, rdma::WqeKind::kWrite, src, dest, bytes, op, st);
}

// RDMA READ of PE pe's copy of symmetric `src` into local `dest` (in the heap). Completes at quiet.
MORI_DEVICE_INLINE bool RdmaGet(const ShmemDeviceContext& ctx, int pe, void* dest, const void* src,
                                size_t bytes, const char* op, CallStatus& st) {
  return RdmaTransfer(ctx, pe, rdma::WqeKind::kRead, dest, src, bytes, op, st);
}

// One single-word request on PE pe's copy of symmetric `addr` whose result lands in a scratch
// word of this PE's heap indexed by the WQE's slot modulo twice the ring: unique while the WQE is
// outstanding, and overwritten only after a full ring of later WQEs has also completed, far longer
// than the fetching thread needs to read it after its completion:
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
  const uint64_t words = 2ull * ep.sq.numBlocks;
  uint64_t* result = p.scratch + static_cast<uint64_t>(q) * words + (slot & (words - 1));
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
      r = rdma::QueueResult{rdma::QueueStatus::kQpError, "no error completion", nullptr, 0, 0, 0, 0};
    }
    if (r.status == rdma::QueueStatus::kOk) *old = core::AtomicLoadAcquireSystem(result);
  }
  if (r.status != rdma::QueueStatus::kOk) {
    ReportRdmaFailure(ctx, pe, op, r, ep);
    return false;
  }
  return true;
}

// Signal after data on the same QP: kAdd is a FETCH_ADD (old value discarded), kSet an inline
// 8-byte write. Leader-only.
MORI_DEVICE_INLINE bool RdmaSignal(const ShmemDeviceContext& ctx, int pe, uint64_t* sigAddr,
                                   uint64_t value, SignalOp sigOp, const char* op, CallStatus& st) {
  if (sigOp == SignalOp::kAdd) {
    return RdmaFetchOp(ctx, pe, sigAddr, rdma::WqeKind::kFetchAdd, sizeof(uint64_t), value, 0, false,
                       nullptr, op, st);
  }
  const ShmemRdmaPeer& p = ctx.rdmaPeers[pe];
  uint64_t raddr = 0;
  if (!RdmaRemote(ctx, p, sigAddr, sizeof(uint64_t), sizeof(uint64_t), raddr, st)) return false;
  rdma::WqeDesc d{};
  d.kind = rdma::WqeKind::kWriteInline;
  d.inlineData = &value;
  d.local = mlx5::Mlx5LocalBuf{0, 0, sizeof(uint64_t)};
  d.remote = mlx5::Mlx5RemoteBuf{raddr, p.rkey};
  return RdmaPost(ctx, pe, d, op).status == rdma::QueueStatus::kOk;
}

}  // namespace mori::shmem::detail

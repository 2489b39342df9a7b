// Shmem device API: one-sided put/get, put-with-signal, atomics, waits, quiet/fence and the device
// barrier, called from kernels. Header-only; compiles for CUDA and HIP from this one source.
//
// Conventions (hold for every function below):
//  * `ctx` is the ShmemDeviceContext the host got from ShmemGetDeviceContext() and passed to the
//    kernel by value.
//  * A "symmetric" address is a LOCAL address inside this PE's heap [heapBase, heapBase+heapSize)
//    (e.g. a ShmemMalloc result); the call targets the same offset in PE `pe`'s heap. Addresses
//    called "local" may be any device-accessible memory of this PE.
//  * Scope suffix: Thread = the calling thread alone; Warp = every lane of the calling warp calls
//    with the same arguments (full warps: block size a multiple of core::kWarpSize); Block = every
//    thread of the block calls with the same arguments. Work is split across the scope's threads.
//  * Transport: PEs reached by load/store (self, P2P over NVLink/xGMI) are served with loads and
//    stores; PEs reached only by RDMA through mlx5 work requests the calling thread (the scope's
//    leader) posts itself (device/rdma.hpp states what differs there: local buffers of large
//    puts and of gets must be in the heap, gets complete at quiet, atomics are 64-bit, one QP per
//    warp unless a ...Qp function names the channel). An unreachable or out-of-range PE, or an
//    address outside the heap, records a device error (see device/resolve.hpp; the host raises it
//    from ShmemCheckDeviceError / ShmemStreamSynchronize) and returns false / a zero value without
//    touching memory. Every thread of the scope gets the same result.
//  * Nbi ("non-blocking") puts are complete, i.e. visible to the target PE, after
//  ShmemQuiet{Thread,
//    Warp,Block} covering the issuing thread (or, for load/store peers, the end of the kernel; for
//    RDMA peers a kernel's end completes nothing: quiet, the device barrier or the host's
//    ShmemBarrierAll does). The source buffer may be reused as soon as the call returns, except
//    for an RDMA put of more than 64 bytes, which the NIC reads until it completes (quiet).
//    Blocking variants = Nbi + a scope-wide system release: when they return, the data of the whole
//    scope is delivered (put) or in `dest` for every thread of the scope (get), ordered before
//    every later store, atomic or signal by ANY thread of the scope, so a PE that observes such a
//    later write (acquire: waits, AtomicFetch) sees the data. They are not sequentially consistent:
//    only ShmemQuiet* (fence.sc) also orders the puts before later LOADS of words other PEs write
//    (store-buffering / Dekker patterns).
//  * Scope-wide completion uses one fence, not one per thread: scope sync, ONE thread runs a
//    system acq_rel fence, scope sync. Fences are cumulative through the barrier (PTX and
//    HIP/HSA memory models: the barrier makes every thread's earlier accesses happen-before the
//    fence), so that fence orders the stores of the whole scope, and the second sync lets every
//    thread issue dependent writes. A system fence in every thread of a large grid would
//    serialise GPU-wide.
//  * Ordering between puts to different PEs, and between puts and atomics, needs
//    ShmemFenceThread/ShmemQuietThread; put-with-signal and the barrier order the data for you.
//  * Signals: every signal that may cross nodes is ONE naturally aligned 8-byte word; pack an epoch
//    (or sequence number) and the value into it. An RDMA WRITE of a larger struct (e.g. {epoch,
//    count}) is one message with no order inside it: the reader can see the new epoch with the
//    old count, or the reverse. The NIC writes an 8-byte inline WRITE (SignalOp::kSet) and an
//    8-byte FETCH_ADD (kAdd) single-copy atomically, ordered after the data posted before it on
//    the same QP.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "mori/core/device/wait.hpp"
#include "mori/core/gpu.hpp"
#include "mori/shmem/device/copy.hpp"
#include "mori/shmem/device/rdma.hpp"
#include "mori/shmem/device/resolve.hpp"
#include "mori/shmem/device/scope.hpp"
#include "mori/shmem/device/shmem_device_types.hpp"
#include "mori/shmem/shmem_types.hpp"

namespace mori::shmem {

// =============================================================================================
// Queries
// =============================================================================================
MORI_DEVICE_INLINE int ShmemMyPe(const ShmemDeviceContext& ctx) { return ctx.rank; }
MORI_DEVICE_INLINE int ShmemNPes(const ShmemDeviceContext& ctx) { return ctx.worldSize; }
// Topology (the host's ShmemNodeOf / ShmemLocalRank agree): nodes are numbered 0.. in the order of
// their lowest PE; a PE's local rank is its index among its node's PEs in PE order. -1 for a pe out
// of range (a query: no error is recorded).
MORI_DEVICE_INLINE int ShmemNumNodes(const ShmemDeviceContext& ctx) { return ctx.numNodes; }
MORI_DEVICE_INLINE int ShmemNodeOf(const ShmemDeviceContext& ctx, int pe) {
  return static_cast<unsigned>(pe) < static_cast<unsigned>(ctx.worldSize) ? ctx.nodeOf[pe] : -1;
}
MORI_DEVICE_INLINE int ShmemLocalRankOf(const ShmemDeviceContext& ctx, int pe) {
  return static_cast<unsigned>(pe) < static_cast<unsigned>(ctx.worldSize) ? ctx.localRankOf[pe]
                                                                          : -1;
}

// PE `pe`'s copy of the symmetric object at `addr`, usable with plain loads/stores from this
// kernel; nullptr when `pe` is not load/store reachable or `addr` is not in the heap. No error is
// recorded (this is a query).
template <typename T>
MORI_DEVICE_INLINE T* ShmemPtrP2p(const ShmemDeviceContext& ctx, T* addr, int pe) {
  if (static_cast<unsigned>(pe) >= static_cast<unsigned>(ctx.worldSize)) return nullptr;
  const TransportType t = ctx.transport[pe];
  if (t != TransportType::kSelf && t != TransportType::kP2P) return nullptr;
  detail::CallStatus st;
  return reinterpret_cast<T*>(detail::ResolveSymmetric(ctx, addr, 0, pe, 1, st));
}

namespace detail {

// ---------------------------------------------------------------------------------------------
// Scope-generic implementations; the public functions below pick Scope and name the operation.
// Each one switches on the route to `pe`: load/store (self, P2P) is served here; the RDMA transport
// slots in at `case Route::kRdma`. Errors funnel into one ReportCallError per function, by the
// scope's leader; the route and addresses are the same for every thread of the scope, so all of
// them return the same result.
// ---------------------------------------------------------------------------------------------
// How an Nbi put or signal is posted to an RDMA peer (load/store peers ignore it).
struct PostOpts {
  int64_t qp = kWarpQp;               // a channel (>= 0, used mod numQps) or the calling warp's QP
  CqeMode cqe = CqeMode::kRequested;  // for the data of a put without signal
  uint64_t* ticket = nullptr;         // receives the ticket (0: nothing to complete)
};

// The leader's RDMA outcome shared with the whole scope in one broadcast: the ticket, or
// kFailedPost (tickets never reach it).
constexpr uint64_t kFailedPost = ~0ull;
template <class Scope>
MORI_DEVICE_INLINE bool ShareRdmaOutcome(bool ok, uint64_t ticket, const PostOpts& o) {
  const uint64_t word = Scope::BroadcastWord(ok ? ticket : kFailedPost);
  if (o.ticket != nullptr) *o.ticket = word == kFailedPost ? 0 : word;
  return word != kFailedPost;
}

template <class Scope>
MORI_DEVICE_INLINE bool PutMemNbi(const ShmemDeviceContext& ctx, void* dest, const void* src,
                                  size_t bytes, int pe, const char* op, const PostOpts& o = {}) {
  CallStatus st;
  switch (RouteTo(ctx, pe, st)) {
    case Route::kLoadStore: {
      const uintptr_t remote = ResolveSymmetric(ctx, dest, bytes, pe, 1, st);
      if (remote == 0) break;
      ScopedCopy<Scope>(reinterpret_cast<void*>(remote), src, bytes);
      if (o.ticket != nullptr) *o.ticket = 0;
      return true;
    }
    case Route::kRdma: {
      // The scope's source data (written by any of its threads) is in place before the leader
      // posts the work requests for the whole range.
      Scope::Sync();
      uint64_t ticket = 0;
      const RdmaPutArgs a{dest, src, bytes, nullptr, 0, SignalOp::kNone, o.cqe};
      const bool ok = Scope::Rank() != 0 || RdmaPutSignal(ctx, pe, o.qp, a, &ticket, op, st);
      if (!ok && st.code != CallError::kNone) ReportCallError(ctx.wait, pe, op, st);
      return ShareRdmaOutcome<Scope>(ok, ticket, o);
    }
    default: break;
  }
  if (Scope::Rank() == 0) ReportCallError(ctx.wait, pe, op, st);
  return false;
}

template <class Scope>
MORI_DEVICE_INLINE bool GetMemNbi(const ShmemDeviceContext& ctx, void* dest, const void* src,
                                  size_t bytes, int pe, const char* op) {
  CallStatus st;
  switch (RouteTo(ctx, pe, st)) {
    case Route::kLoadStore: {
      const uintptr_t remote = ResolveSymmetric(ctx, src, bytes, pe, 1, st);
      if (remote == 0) break;
      ScopedCopy<Scope>(dest, reinterpret_cast<const void*>(remote), bytes);
      return true;
    }
    case Route::kRdma: {
      Scope::Sync();
      const bool ok = Scope::Rank() != 0 || RdmaGet(ctx, pe, dest, src, bytes, op, st);
      if (!ok && st.code != CallError::kNone) ReportCallError(ctx.wait, pe, op, st);
      return Scope::Broadcast(ok);
    }
    default: break;
  }
  if (Scope::Rank() == 0) ReportCallError(ctx.wait, pe, op, st);
  return false;
}

// Scope-wide system release: scope sync, one thread fence.acq_rel.sys (cumulative: it covers
// every access the scope's threads made before the first sync), scope sync so every thread of the
// scope is ordered after it. Used by the blocking variants and the barrier.
template <class Scope>
MORI_DEVICE_INLINE void ScopeFenceAcqRelSystem() {
  Scope::Sync();
  if (Scope::Rank() == 0) core::FenceAcqRelSystem();
  Scope::Sync();
}

// Signal update by the thread that just ran FenceAcqRelSystem: fence + relaxed system-scope
// atomic is a release pattern (PTX and C++/HIP fence-atomic synchronisation), so the one fence
// orders the data before the signal; a second release fence inside the atomic is not needed.
MORI_DEVICE_INLINE void ApplySignalAfterFence(uint64_t* remoteSig, uint64_t value, SignalOp sigOp) {
  if (sigOp == SignalOp::kAdd) {
    core::AtomicFetchAddSystem(remoteSig, value);
  } else {
    core::AtomicStoreRelaxedSystem(remoteSig, value);
  }
}

// Data by the whole scope, scope sync, then one thread runs fence.acq_rel.sys (cumulative through
// the sync: it covers the whole scope's data) and updates the signal: fence + atomic is a release,
// so a PE that observes the signal (acquire, e.g. ShmemSignalWaitUntil) sees all of the data.
template <class Scope>
MORI_DEVICE_INLINE bool PutMemSignalNbi(const ShmemDeviceContext& ctx, void* dest, const void* src,
                                        size_t bytes, uint64_t* sigAddr, uint64_t sigValue,
                                        SignalOp sigOp, int pe, const char* op,
                                        const PostOpts& o = {}) {
  CallStatus st;
  switch (RouteTo(ctx, pe, st)) {
    case Route::kLoadStore: {
      if (sigOp != SignalOp::kSet && sigOp != SignalOp::kAdd) {
        st.Set(CallError::kBadSignalOp, 0, static_cast<uint64_t>(sigOp));
        break;
      }
      const uintptr_t remote = ResolveSymmetric(ctx, dest, bytes, pe, 1, st);
      if (remote == 0) break;
      const uintptr_t remoteSig =
          ResolveSymmetric(ctx, sigAddr, sizeof(uint64_t), pe, sizeof(uint64_t), st);
      if (remoteSig == 0) break;
      ScopedCopy<Scope>(reinterpret_cast<void*>(remote), src, bytes);
      Scope::Sync();
      if (Scope::Rank() == 0) {
        core::FenceAcqRelSystem();
        ApplySignalAfterFence(reinterpret_cast<uint64_t*>(remoteSig), sigValue, sigOp);
      }
      if (o.ticket != nullptr) *o.ticket = 0;
      return true;
    }
    case Route::kRdma: {
      if (sigOp != SignalOp::kSet && sigOp != SignalOp::kAdd) {
        st.Set(CallError::kBadSignalOp, 0, static_cast<uint64_t>(sigOp));
        break;
      }
      // Data, then the signal, on one QP in one reservation: RC order delivers the data first.
      Scope::Sync();
      uint64_t ticket = 0;
      const RdmaPutArgs a{dest, src, bytes, sigAddr, sigValue, sigOp, CqeMode::kRequested};
      const bool ok = Scope::Rank() != 0 || RdmaPutSignal(ctx, pe, o.qp, a, &ticket, op, st);
      if (!ok && st.code != CallError::kNone) ReportCallError(ctx.wait, pe, op, st);
      return ShareRdmaOutcome<Scope>(ok, ticket, o);
    }
    default: break;
  }
  if (Scope::Rank() == 0) ReportCallError(ctx.wait, pe, op, st);
  return false;
}

// Warp-batched put (see ShmemPutMemBatchSignalNbiWarp). Load/store route: the warp copies every
// lane's range in turn, then (with a signal) syncs and the leader runs one system acq_rel fence
// and updates the signal.
MORI_DEVICE_INLINE bool PutMemBatchSignalNbiWarp(const ShmemDeviceContext& ctx, void* dest,
                                                 const void* src, size_t bytes, uint64_t* sigAddr,
                                                 uint64_t sigValue, SignalOp sigOp, int pe,
                                                 int64_t qp, uint64_t* ticket, const char* op) {
  const int lane = WarpScope::Rank();
  CallStatus st;
  const Route route = RouteTo(ctx, pe, st);
  if (route != Route::kFailed && sigOp != SignalOp::kSet && sigOp != SignalOp::kAdd &&
      sigOp != SignalOp::kNone) {
    st.Set(CallError::kBadSignalOp, 0, static_cast<uint64_t>(sigOp));
  } else if (route == Route::kRdma) {
    const RdmaPutArgs a{dest, src, bytes, sigAddr, sigValue, sigOp, CqeMode::kRequested};
    return RdmaPutBatchWarp(ctx, pe, qp, a, ticket, op);
  } else if (route == Route::kLoadStore) {
    uintptr_t remote = 0, remoteSig = 0;
    bool ok = bytes == 0 || (remote = ResolveSymmetric(ctx, dest, bytes, pe, 1, st)) != 0;
    if (ok && lane == 0 && sigOp != SignalOp::kNone) {
      remoteSig = ResolveSymmetric(ctx, sigAddr, sizeof(uint64_t), pe, sizeof(uint64_t), st);
      ok = remoteSig != 0;
    }
    const core::LaneMask bad = core::WarpBallot(!ok);
    if (bad != 0) {  // the lowest failing lane reports
      if (!ok && (bad & ((core::LaneMask(1) << lane) - 1)) == 0)
        ReportCallError(ctx.wait, pe, op, st);
      return false;
    }
    for (int l = 0; l < core::kWarpSize; l++) {
      const unsigned long long n = core::WarpShfl(static_cast<unsigned long long>(bytes), l);
      if (n == 0) continue;
      const auto to = core::WarpShfl(static_cast<unsigned long long>(remote), l);
      const auto from =
          core::WarpShfl(static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(src)), l);
      ScopedCopy<WarpScope>(reinterpret_cast<void*>(to), reinterpret_cast<const void*>(from), n);
    }
    if (sigOp != SignalOp::kNone) {
      WarpScope::Sync();
      if (lane == 0) {
        core::FenceAcqRelSystem();
        ApplySignalAfterFence(reinterpret_cast<uint64_t*>(remoteSig), sigValue, sigOp);
      }
    }
    if (ticket != nullptr) *ticket = 0;
    return true;
  }
  if (lane == 0) ReportCallError(ctx.wait, pe, op, st);
  return false;
}

// Target of a Thread-scope single-word operation (atomic or immediate) on PE `pe`: PE pe's copy
// of `addr`, or nullptr after reporting an error.
template <typename T>
MORI_DEVICE_INLINE T* WordTarget(const ShmemDeviceContext& ctx, const T* addr, int pe,
                                 const char* op) {
  CallStatus st;
  switch (RouteTo(ctx, pe, st)) {
    case Route::kLoadStore: {
      const uintptr_t remote = ResolveSymmetric(ctx, addr, sizeof(T), pe, alignof(T), st);
      if (remote == 0) break;
      return reinterpret_cast<T*>(remote);
    }
    case Route::kRdma:  // callers take the RDMA route before asking for a load/store target
      st.Set(CallError::kRdmaUnsupported, reinterpret_cast<uintptr_t>(addr), sizeof(T));
      break;
    default: break;
  }
  ReportCallError(ctx.wait, pe, op, st);
  return nullptr;
}

template <typename T>
MORI_DEVICE_INLINE T* AtomicTarget(const ShmemDeviceContext& ctx, const T* addr, int pe,
                                   const char* op) {
  static_assert(std::is_same<T, uint32_t>::value || std::is_same<T, uint64_t>::value ||
                    std::is_same<T, int32_t>::value || std::is_same<T, int64_t>::value,
                "shmem atomics take uint32_t, uint64_t, int32_t or int64_t");
  static_assert(alignof(T) == sizeof(T), "atomics need naturally aligned words");
  return WordTarget(ctx, addr, pe, op);
}

template <typename T>
MORI_DEVICE_INLINE T* ImmediateTarget(const ShmemDeviceContext& ctx, const T* addr, int pe,
                                      const char* op) {
  static_assert(std::is_arithmetic<T>::value, "typed put/get take arithmetic types");
  return WordTarget(ctx, addr, pe, op);
}

MORI_DEVICE_INLINE bool IsRdma(const ShmemDeviceContext& ctx, int pe) {
  return static_cast<unsigned>(pe) < static_cast<unsigned>(ctx.worldSize) &&
         ctx.transport[pe] == TransportType::kRdma;
}

// Blocking completion of a scope's operation to `pe`: the scope-wide system release of the
// load/store route, plus (RDMA) the leader's quiet of every QP to `pe`. Every thread gets the
// result.
template <class Scope>
MORI_DEVICE_INLINE bool CompleteToPe(const ShmemDeviceContext& ctx, int pe, bool ok,
                                     const char* op) {
  ScopeFenceAcqRelSystem<Scope>();
  if (!ok || !IsRdma(ctx, pe)) return ok;
  const bool quiet = Scope::Rank() != 0 || RdmaQuietPe(ctx, pe, op);
  return Scope::Broadcast(quiet);
}

// RDMA route of the single-word operations (Thread scope). Atomics are 64-bit only.
template <typename T>
MORI_DEVICE_INLINE bool RdmaWord(const ShmemDeviceContext& ctx, const T* addr, int pe,
                                 rdma::WqeKind kind, uint64_t swapAdd, uint64_t compare, bool fetch,
                                 T* old, const char* op) {
  CallStatus st;
  uint64_t v = 0;
  bool ok = false;
  if (kind != rdma::WqeKind::kRead && sizeof(T) != sizeof(uint64_t)) {
    st.Set(CallError::kRdmaUnsupported, reinterpret_cast<uintptr_t>(addr), sizeof(T));
  } else {
    ok = RdmaFetchOp(ctx, pe, addr, kind, sizeof(T), swapAdd, compare, fetch, &v, op, st);
  }
  if (!ok) {
    if (st.code != CallError::kNone) ReportCallError(ctx.wait, pe, op, st);
    return false;
  }
  if (fetch && old != nullptr) {
    T r;
    memcpy(&r, &v, sizeof(T));
    *old = r;
  }
  return true;
}

// Inline RDMA write of one value (Thread scope).
template <typename T>
MORI_DEVICE_INLINE bool RdmaPutWord(const ShmemDeviceContext& ctx, T* dest, T value, int pe,
                                    const char* op) {
  CallStatus st;
  if ((reinterpret_cast<uintptr_t>(dest) & (alignof(T) - 1)) != 0) {
    st.Set(CallError::kMisaligned, reinterpret_cast<uintptr_t>(dest), alignof(T));
  } else if (RdmaPut(ctx, pe, dest, &value, sizeof(T), op, st)) {
    return true;
  }
  if (st.code != CallError::kNone) ReportCallError(ctx.wait, pe, op, st);
  return false;
}

// One arrival at PE p's device barrier counter.
MORI_DEVICE_INLINE bool BarrierArrive(const ShmemDeviceContext& ctx, int p) {
  uint64_t* word = ctx.syncArea + kSyncWordDeviceBarrier;
  if (IsRdma(ctx, p)) {
    return RdmaWord<uint64_t>(ctx, word, p, rdma::WqeKind::kFetchAdd, 1, 0, false, nullptr,
                              "ShmemBarrierAll");
  }
  uint64_t* remote = WordTarget(ctx, word, p, "ShmemBarrierAll");
  if (remote == nullptr) return false;
  core::AtomicFetchAddReleaseSystem(remote, uint64_t{1});
  return true;
}

// Every PE has arrived at epoch `epoch` once this PE's counter reaches epoch * worldSize: counters
// only grow, and no PE passes epoch e before all PEs arrived at e, so no PE has contributed more
// than `epoch` arrivals while this wait is pending.
MORI_DEVICE_INLINE bool BarrierWait(const ShmemDeviceContext& ctx, uint64_t epoch) {
  return core::WaitUntil(ctx.wait, ctx.syncArea + kSyncWordDeviceBarrier, core::CmpOp::kGe,
                         epoch * static_cast<uint64_t>(ctx.worldSize), -1,
                         "ShmemBarrierAll arrivals");
}

}  // namespace detail

// =============================================================================================
// Put: copy `bytes` from local `src` to symmetric `dest` on PE `pe`. Any size and alignment;
// 16-byte vectors where dest and src agree modulo 16.
// =============================================================================================
MORI_DEVICE_INLINE bool ShmemPutMemNbiThread(const ShmemDeviceContext& ctx, void* dest,
                                             const void* src, size_t bytes, int pe) {
  return detail::PutMemNbi<detail::ThreadScope>(ctx, dest, src, bytes, pe, "ShmemPutMemNbiThread");
}
MORI_DEVICE_INLINE bool ShmemPutMemNbiWarp(const ShmemDeviceContext& ctx, void* dest,
                                           const void* src, size_t bytes, int pe) {
  return detail::PutMemNbi<detail::WarpScope>(ctx, dest, src, bytes, pe, "ShmemPutMemNbiWarp");
}
MORI_DEVICE_INLINE bool ShmemPutMemNbiBlock(const ShmemDeviceContext& ctx, void* dest,
                                            const void* src, size_t bytes, int pe) {
  return detail::PutMemNbi<detail::BlockScope>(ctx, dest, src, bytes, pe, "ShmemPutMemNbiBlock");
}

// Blocking: on return the scope's data is delivered to PE `pe` and ordered before every later
// write of any thread of the scope (see the conventions at the top; one fence per scope).
MORI_DEVICE_INLINE bool ShmemPutMemThread(const ShmemDeviceContext& ctx, void* dest,
                                          const void* src, size_t bytes, int pe) {
  const bool ok =
      detail::PutMemNbi<detail::ThreadScope>(ctx, dest, src, bytes, pe, "ShmemPutMemThread");
  return detail::CompleteToPe<detail::ThreadScope>(ctx, pe, ok, "ShmemPutMemThread");
}
MORI_DEVICE_INLINE bool ShmemPutMemWarp(const ShmemDeviceContext& ctx, void* dest, const void* src,
                                        size_t bytes, int pe) {
  const bool ok =
      detail::PutMemNbi<detail::WarpScope>(ctx, dest, src, bytes, pe, "ShmemPutMemWarp");
  return detail::CompleteToPe<detail::WarpScope>(ctx, pe, ok, "ShmemPutMemWarp");
}
MORI_DEVICE_INLINE bool ShmemPutMemBlock(const ShmemDeviceContext& ctx, void* dest, const void* src,
                                         size_t bytes, int pe) {
  const bool ok =
      detail::PutMemNbi<detail::BlockScope>(ctx, dest, src, bytes, pe, "ShmemPutMemBlock");
  return detail::CompleteToPe<detail::BlockScope>(ctx, pe, ok, "ShmemPutMemBlock");
}

// Immediate put of one arithmetic value (a single store of sizeof(T) bytes) to symmetric `dest`
// on PE `pe`; `dest` must be aligned to alignof(T).
template <typename T>
MORI_DEVICE_INLINE bool ShmemPutTypeNbiThread(const ShmemDeviceContext& ctx, T* dest,
                                              detail::NonDeduced<T> value, int pe) {
  if (detail::IsRdma(ctx, pe))
    return detail::RdmaPutWord<T>(ctx, dest, value, pe, "ShmemPutTypeNbiThread");
  T* p = detail::ImmediateTarget(ctx, dest, pe, "ShmemPutTypeNbiThread");
  if (p == nullptr) return false;
  *reinterpret_cast<volatile T*>(p) = value;
  return true;
}
template <typename T>
MORI_DEVICE_INLINE bool ShmemPutTypeThread(const ShmemDeviceContext& ctx, T* dest,
                                           detail::NonDeduced<T> value, int pe) {
  const bool ok = ShmemPutTypeNbiThread<T>(ctx, dest, value, pe);
  return detail::CompleteToPe<detail::ThreadScope>(ctx, pe, ok, "ShmemPutTypeThread");
}

// =============================================================================================
// Get: copy `bytes` from symmetric `src` on PE `pe` to local `dest`. The P2P transport reads the
// peer directly, so the data is in `dest` for the calling thread when the Nbi call returns; the
// blocking variants also sync the scope so every thread of it sees the whole result.
// =============================================================================================
MORI_DEVICE_INLINE bool ShmemGetMemNbiThread(const ShmemDeviceContext& ctx, void* dest,
                                             const void* src, size_t bytes, int pe) {
  return detail::GetMemNbi<detail::ThreadScope>(ctx, dest, src, bytes, pe, "ShmemGetMemNbiThread");
}
MORI_DEVICE_INLINE bool ShmemGetMemNbiWarp(const ShmemDeviceContext& ctx, void* dest,
                                           const void* src, size_t bytes, int pe) {
  return detail::GetMemNbi<detail::WarpScope>(ctx, dest, src, bytes, pe, "ShmemGetMemNbiWarp");
}
MORI_DEVICE_INLINE bool ShmemGetMemNbiBlock(const ShmemDeviceContext& ctx, void* dest,
                                            const void* src, size_t bytes, int pe) {
  return detail::GetMemNbi<detail::BlockScope>(ctx, dest, src, bytes, pe, "ShmemGetMemNbiBlock");
}
MORI_DEVICE_INLINE bool ShmemGetMemThread(const ShmemDeviceContext& ctx, void* dest,
                                          const void* src, size_t bytes, int pe) {
  const bool ok =
      detail::GetMemNbi<detail::ThreadScope>(ctx, dest, src, bytes, pe, "ShmemGetMemThread");
  return detail::CompleteToPe<detail::ThreadScope>(ctx, pe, ok, "ShmemGetMemThread");
}
MORI_DEVICE_INLINE bool ShmemGetMemWarp(const ShmemDeviceContext& ctx, void* dest, const void* src,
                                        size_t bytes, int pe) {
  const bool ok =
      detail::GetMemNbi<detail::WarpScope>(ctx, dest, src, bytes, pe, "ShmemGetMemWarp");
  return detail::CompleteToPe<detail::WarpScope>(ctx, pe, ok, "ShmemGetMemWarp");
}
MORI_DEVICE_INLINE bool ShmemGetMemBlock(const ShmemDeviceContext& ctx, void* dest, const void* src,
                                         size_t bytes, int pe) {
  const bool ok =
      detail::GetMemNbi<detail::BlockScope>(ctx, dest, src, bytes, pe, "ShmemGetMemBlock");
  return detail::CompleteToPe<detail::BlockScope>(ctx, pe, ok, "ShmemGetMemBlock");
}

// Single load of one arithmetic value from symmetric `src` on PE `pe` (T{} on error).
template <typename T>
MORI_DEVICE_INLINE T ShmemGetType(const ShmemDeviceContext& ctx, const T* src, int pe) {
  if (detail::IsRdma(ctx, pe)) {
    T v{};
    detail::RdmaWord<T>(ctx, src, pe, detail::rdma::WqeKind::kRead, 0, 0, true, &v, "ShmemGetType");
    return v;
  }
  const T* p = detail::ImmediateTarget(ctx, src, pe, "ShmemGetType");
  if (p == nullptr) return T{};
  return *reinterpret_cast<const volatile T*>(p);
}

// =============================================================================================
// Put with signal: put `bytes` to symmetric `dest` on PE `pe`, then update the symmetric signal
// word `sigAddr` on PE `pe` (kSet: store `sigValue`; kAdd: add `sigValue`) so that a PE observing
// the new signal value sees all of the data. After the whole scope's data is written, the scope
// syncs and one thread runs a system acq_rel fence and issues the signal (one fence per call, not
// per thread). Nbi: the other threads of the scope do not wait for the signal. `sigAddr` must be
// 8-byte aligned.
// =============================================================================================
MORI_DEVICE_INLINE bool ShmemPutMemSignalNbiThread(const ShmemDeviceContext& ctx, void* dest,
                                                   const void* src, size_t bytes, uint64_t* sigAddr,
                                                   uint64_t sigValue, SignalOp op, int pe) {
  return detail::PutMemSignalNbi<detail::ThreadScope>(ctx, dest, src, bytes, sigAddr, sigValue, op,
                                                      pe, "ShmemPutMemSignalNbiThread");
}
MORI_DEVICE_INLINE bool ShmemPutMemSignalNbiWarp(const ShmemDeviceContext& ctx, void* dest,
                                                 const void* src, size_t bytes, uint64_t* sigAddr,
                                                 uint64_t sigValue, SignalOp op, int pe) {
  return detail::PutMemSignalNbi<detail::WarpScope>(ctx, dest, src, bytes, sigAddr, sigValue, op,
                                                    pe, "ShmemPutMemSignalNbiWarp");
}
MORI_DEVICE_INLINE bool ShmemPutMemSignalNbiBlock(const ShmemDeviceContext& ctx, void* dest,
                                                  const void* src, size_t bytes, uint64_t* sigAddr,
                                                  uint64_t sigValue, SignalOp op, int pe) {
  return detail::PutMemSignalNbi<detail::BlockScope>(ctx, dest, src, bytes, sigAddr, sigValue, op,
                                                     pe, "ShmemPutMemSignalNbiBlock");
}

// Signal only (Thread scope): update `sigAddr` on PE `pe` with release semantics, ordered after
// this thread's earlier puts.
MORI_DEVICE_INLINE bool ShmemSignalThread(const ShmemDeviceContext& ctx, uint64_t* sigAddr,
                                          uint64_t sigValue, SignalOp op, int pe) {
  return detail::PutMemSignalNbi<detail::ThreadScope>(ctx, sigAddr, nullptr, 0, sigAddr, sigValue,
                                                      op, pe, "ShmemSignalThread");
}

// =============================================================================================
// Channels: explicit QPs, tickets, selective signalling and warp-batched puts. For bulk traffic
// to RDMA peers; to load/store peers each call behaves as its counterpart above (qp and CqeMode
// are ignored, the ticket is 0).
//  * `qp` picks the RDMA queue pair to `pe`: qp mod ShmemRdmaNumQps(ctx, pe). The requests of one
//    (pe, qp) execute in the order they were published (RC), whichever threads post them, so a
//    channel that owns a QP can send its signal after its data with a later call. Order between
//    posters on one QP is the order in which their calls published (one call after another
//    returned, or program order within a thread). Requests on different QPs are not ordered by
//    ShmemFenceThread: order them with ShmemQuietThreadQp / ShmemRdmaWaitCompleted.
//  * Tickets: `*ticket` (when the pointer is not null; every thread of the scope gets it) is the
//    SQ block count after the call's requests on (pe, qp), 0 when nothing was posted (load/store
//    peers, empty puts). Every request up to a ticket has completed once ShmemRdmaCompleted(ctx,
//    pe, qp, ticket) returns true: the NIC has read the local sources (staging may be reused) and
//    the remote writes are done.
//  * Completions: a signal, a batch and a put with CqeMode::kRequested request a CQE for their
//    last request, so their tickets complete by themselves. Puts with CqeMode::kSkipped request
//    none: they complete with the next CQE-requesting request on that QP (by any caller), or with
//    ShmemRdmaWaitCompleted / quiet, which post a CQE-requesting NOP when none is pending.
//  * Data plus signal: the data WRITEs and the signal (kSet: 8-byte inline WRITE, kAdd: 8-byte
//    FETCH_ADD) are reserved together and published with one doorbell.
// =============================================================================================
// Number of RDMA queue pairs to `pe` (0 when `pe` is not reached by RDMA or out of range).
MORI_DEVICE_INLINE uint32_t ShmemRdmaNumQps(const ShmemDeviceContext& ctx, int pe) {
  return detail::IsRdma(ctx, pe) ? ctx.rdmaPeers[pe].numQps : 0;
}

// Nbi put on channel `qp` (scopes as ShmemPutMemNbi{Thread,Warp,Block}).
MORI_DEVICE_INLINE bool ShmemPutMemNbiThreadQp(const ShmemDeviceContext& ctx, void* dest,
                                               const void* src, size_t bytes, int pe, uint32_t qp,
                                               CqeMode cqe = CqeMode::kRequested,
                                               uint64_t* ticket = nullptr) {
  return detail::PutMemNbi<detail::ThreadScope>(ctx, dest, src, bytes, pe, "ShmemPutMemNbiThreadQp",
                                                detail::PostOpts{qp, cqe, ticket});
}
MORI_DEVICE_INLINE bool ShmemPutMemNbiWarpQp(const ShmemDeviceContext& ctx, void* dest,
                                             const void* src, size_t bytes, int pe, uint32_t qp,
                                             CqeMode cqe = CqeMode::kRequested,
                                             uint64_t* ticket = nullptr) {
  return detail::PutMemNbi<detail::WarpScope>(ctx, dest, src, bytes, pe, "ShmemPutMemNbiWarpQp",
                                              detail::PostOpts{qp, cqe, ticket});
}
MORI_DEVICE_INLINE bool ShmemPutMemNbiBlockQp(const ShmemDeviceContext& ctx, void* dest,
                                              const void* src, size_t bytes, int pe, uint32_t qp,
                                              CqeMode cqe = CqeMode::kRequested,
                                              uint64_t* ticket = nullptr) {
  return detail::PutMemNbi<detail::BlockScope>(ctx, dest, src, bytes, pe, "ShmemPutMemNbiBlockQp",
                                               detail::PostOpts{qp, cqe, ticket});
}

// Put with signal on channel `qp`: data and signal in one reservation and one doorbell (RDMA);
// semantics as ShmemPutMemSignalNbi{Thread,Warp,Block}.
MORI_DEVICE_INLINE bool ShmemPutMemSignalNbiThreadQp(const ShmemDeviceContext& ctx, void* dest,
                                                     const void* src, size_t bytes,
                                                     uint64_t* sigAddr, uint64_t sigValue,
                                                     SignalOp op, int pe, uint32_t qp,
                                                     uint64_t* ticket = nullptr) {
  return detail::PutMemSignalNbi<detail::ThreadScope>(
      ctx, dest, src, bytes, sigAddr, sigValue, op, pe, "ShmemPutMemSignalNbiThreadQp",
      detail::PostOpts{qp, CqeMode::kRequested, ticket});
}
MORI_DEVICE_INLINE bool ShmemPutMemSignalNbiWarpQp(const ShmemDeviceContext& ctx, void* dest,
                                                   const void* src, size_t bytes, uint64_t* sigAddr,
                                                   uint64_t sigValue, SignalOp op, int pe,
                                                   uint32_t qp, uint64_t* ticket = nullptr) {
  return detail::PutMemSignalNbi<detail::WarpScope>(
      ctx, dest, src, bytes, sigAddr, sigValue, op, pe, "ShmemPutMemSignalNbiWarpQp",
      detail::PostOpts{qp, CqeMode::kRequested, ticket});
}
MORI_DEVICE_INLINE bool ShmemPutMemSignalNbiBlockQp(const ShmemDeviceContext& ctx, void* dest,
                                                    const void* src, size_t bytes,
                                                    uint64_t* sigAddr, uint64_t sigValue,
                                                    SignalOp op, int pe, uint32_t qp,
                                                    uint64_t* ticket = nullptr) {
  return detail::PutMemSignalNbi<detail::BlockScope>(
      ctx, dest, src, bytes, sigAddr, sigValue, op, pe, "ShmemPutMemSignalNbiBlockQp",
      detail::PostOpts{qp, CqeMode::kRequested, ticket});
}

// Signal only, on channel `qp` (Thread scope): ordered after everything published earlier on
// (pe, qp), e.g. a channel's Nbi puts; for load/store peers after this thread's earlier puts.
MORI_DEVICE_INLINE bool ShmemSignalThreadQp(const ShmemDeviceContext& ctx, uint64_t* sigAddr,
                                            uint64_t sigValue, SignalOp op, int pe, uint32_t qp,
                                            uint64_t* ticket = nullptr) {
  return detail::PutMemSignalNbi<detail::ThreadScope>(
      ctx, sigAddr, nullptr, 0, sigAddr, sigValue, op, pe, "ShmemSignalThreadQp",
      detail::PostOpts{qp, CqeMode::kRequested, ticket});
}

// Warp-batched put with one trailing signal. Every lane of a full warp calls it with its OWN
// (dest: symmetric, src: local, bytes; bytes == 0: the lane has nothing) and the SAME sigAddr,
// sigValue, sigOp (kSet, kAdd or kNone: no signal), pe and qp. Every lane gets the same result
// (false: nothing was posted or copied, error recorded by the first failing lane) and ticket.
//   RDMA: one reservation for every lane's WRITEs plus the signal, each lane writes its own WQEs,
//   one doorbell; only the last request (the signal, else the last WRITE) requests a CQE. Sources
//   of more than 64 bytes must be registered (heap or ShmemRegisterBuffer) and stay unchanged
//   until the ticket completes. The batch must fit one reservation: every lane's requests (an
//   inline WRITE of <= 64 B takes 1-2 blocks, else one block per GiB) plus the signal, at most
//   3/4 of the SQ ring plus one block (193 blocks of the default 256-block ring); otherwise the
//   call records "RDMA request refused". Lanes post without waiting for each other, so this is
//   also how several lanes of one AMD wavefront post at once (Thread-scope RDMA calls must come
//   from one lane per wavefront there).
//   Load/store: the warp copies every lane's range in turn; with a signal, one system release
//   fence, then the signal store / atomic, so a PE that observes the signal sees every lane's data.
MORI_DEVICE_INLINE bool ShmemPutMemBatchSignalNbiWarp(const ShmemDeviceContext& ctx, void* dest,
                                                      const void* src, size_t bytes,
                                                      uint64_t* sigAddr, uint64_t sigValue,
                                                      SignalOp sigOp, int pe, uint32_t qp,
                                                      uint64_t* ticket = nullptr) {
  return detail::PutMemBatchSignalNbiWarp(ctx, dest, src, bytes, sigAddr, sigValue, sigOp, pe, qp,
                                          ticket, "ShmemPutMemBatchSignalNbiWarp");
}

// Non-blocking (Thread scope): true once every request up to `ticket` on (pe, qp) has completed;
// always true for load/store peers and ticket 0. It only drains completions that arrived: a ticket
// whose last request skipped its CQE needs a later CQE-requesting request on the QP (or
// ShmemRdmaWaitCompleted). An error completion is recorded (as by quiet) and returns true, so a
// caller polling it stops; the abort flag then makes the kernel's bounded waits give up.
MORI_DEVICE_INLINE bool ShmemRdmaCompleted(const ShmemDeviceContext& ctx, int pe, uint32_t qp,
                                           uint64_t ticket) {
  if (ticket == 0 || !detail::IsRdma(ctx, pe)) return true;
  const ShmemRdmaPeer& p = ctx.rdmaPeers[pe];
  return detail::RdmaCompleted(ctx, pe, detail::RdmaQpIndex(p, qp), ticket, "ShmemRdmaCompleted");
}

// Bounded wait (Thread scope) until every request up to `ticket` on (pe, qp) has completed,
// posting a CQE-requesting NOP first when no pending request would complete them. False on
// timeout or an error completion (recorded).
MORI_DEVICE_INLINE bool ShmemRdmaWaitCompleted(const ShmemDeviceContext& ctx, int pe, uint32_t qp,
                                               uint64_t ticket) {
  if (ticket == 0 || !detail::IsRdma(ctx, pe)) return true;
  const ShmemRdmaPeer& p = ctx.rdmaPeers[pe];
  return detail::RdmaWaitCompleted(ctx, pe, detail::RdmaQpIndex(p, qp), ticket,
                                   "ShmemRdmaWaitCompleted");
}

// =============================================================================================
// Atomics (Thread scope, system-scope atomics on PE `pe`'s copy of symmetric `dest`).
// T: uint32_t, uint64_t, int32_t, int64_t; `dest` aligned to sizeof(T). FetchAdd, Add,
// CompareSwap and Swap are relaxed (order them with ShmemFenceThread); Fetch is an acquire load,
// Set a release store. On error they return 0 / false (error recorded).
// =============================================================================================
template <typename T>
MORI_DEVICE_INLINE T ShmemAtomicFetchAdd(const ShmemDeviceContext& ctx, T* dest,
                                         detail::NonDeduced<T> value, int pe) {
  if (detail::IsRdma(ctx, pe)) {
    T old{};
    detail::RdmaWord<T>(ctx, dest, pe, detail::rdma::WqeKind::kFetchAdd,
                        static_cast<uint64_t>(value), 0, true, &old, "ShmemAtomicFetchAdd");
    return old;
  }
  T* p = detail::AtomicTarget(ctx, dest, pe, "ShmemAtomicFetchAdd");
  return p == nullptr ? T{} : core::AtomicFetchAddSystem(p, value);
}
template <typename T>
MORI_DEVICE_INLINE bool ShmemAtomicAdd(const ShmemDeviceContext& ctx, T* dest,
                                       detail::NonDeduced<T> value, int pe) {
  if (detail::IsRdma(ctx, pe)) {
    return detail::RdmaWord<T>(ctx, dest, pe, detail::rdma::WqeKind::kFetchAdd,
                               static_cast<uint64_t>(value), 0, false, nullptr, "ShmemAtomicAdd");
  }
  T* p = detail::AtomicTarget(ctx, dest, pe, "ShmemAtomicAdd");
  if (p == nullptr) return false;
  core::AtomicFetchAddSystem(p, value);
  return true;
}
// Stores `value` if the current value equals `compare`; returns the value seen before.
template <typename T>
MORI_DEVICE_INLINE T ShmemAtomicCompareSwap(const ShmemDeviceContext& ctx, T* dest,
                                            detail::NonDeduced<T> compare,
                                            detail::NonDeduced<T> value, int pe) {
  if (detail::IsRdma(ctx, pe)) {
    T old{};
    detail::RdmaWord<T>(ctx, dest, pe, detail::rdma::WqeKind::kCompareSwap,
                        static_cast<uint64_t>(value), static_cast<uint64_t>(compare), true, &old,
                        "ShmemAtomicCompareSwap");
    return old;
  }
  T* p = detail::AtomicTarget(ctx, dest, pe, "ShmemAtomicCompareSwap");
  return p == nullptr ? T{} : core::AtomicCasSystem(p, compare, value);
}
template <typename T>
MORI_DEVICE_INLINE T ShmemAtomicSwap(const ShmemDeviceContext& ctx, T* dest,
                                     detail::NonDeduced<T> value, int pe) {
  if (detail::IsRdma(ctx, pe)) {  // no swap verb: compare-swap until the value did not change
    T seen{};
    if (!detail::RdmaWord<T>(ctx, dest, pe, detail::rdma::WqeKind::kFetchAdd, 0, 0, true, &seen,
                             "ShmemAtomicSwap"))
      return T{};
    for (;;) {
      T got{};
      if (!detail::RdmaWord<T>(ctx, dest, pe, detail::rdma::WqeKind::kCompareSwap,
                               static_cast<uint64_t>(value), static_cast<uint64_t>(seen), true,
                               &got, "ShmemAtomicSwap"))
        return T{};
      if (got == seen) return seen;
      seen = got;
    }
  }
  T* p = detail::AtomicTarget(ctx, dest, pe, "ShmemAtomicSwap");
  return p == nullptr ? T{} : core::AtomicSwapSystem(p, value);
}
template <typename T>
MORI_DEVICE_INLINE T ShmemAtomicFetch(const ShmemDeviceContext& ctx, const T* src, int pe) {
  if (detail::IsRdma(ctx, pe)) {
    T v{};
    detail::RdmaWord<T>(ctx, src, pe, detail::rdma::WqeKind::kFetchAdd, 0, 0, true, &v,
                        "ShmemAtomicFetch");
    return v;
  }
  T* p = detail::AtomicTarget(ctx, src, pe, "ShmemAtomicFetch");
  return p == nullptr ? T{} : core::AtomicLoadAcquireSystem(p);
}
template <typename T>
MORI_DEVICE_INLINE bool ShmemAtomicSet(const ShmemDeviceContext& ctx, T* dest,
                                       detail::NonDeduced<T> value, int pe) {
  if (detail::IsRdma(ctx, pe)) {  // an 8-byte inline write: single-copy atomic at the target
    if (sizeof(T) != sizeof(uint64_t)) {
      return detail::RdmaWord<T>(ctx, dest, pe, detail::rdma::WqeKind::kFetchAdd, 0, 0, false,
                                 nullptr, "ShmemAtomicSet");  // records "not supported over RDMA"
    }
    return detail::RdmaPutWord<T>(ctx, dest, value, pe, "ShmemAtomicSet");
  }
  T* p = detail::AtomicTarget(ctx, dest, pe, "ShmemAtomicSet");
  if (p == nullptr) return false;
  core::AtomicStoreReleaseSystem(p, value);
  return true;
}

// =============================================================================================
// Waits on LOCAL memory (typically a symmetric word peers write). Thin wrappers of
// core::WaitUntil: true once `*addr op value` holds (acquire: data the writer put before its
// release is visible); false on timeout (MORI_DEVICE_TIMEOUT_MS; error recorded with rank, `peer`,
// label, address, expected and seen values) or when another wait of this PE already failed. The
// kernel should return promptly on false. `peer` (the PE expected to write; -1 if unknown) and
// `label` only attribute a timeout.
// =============================================================================================
template <typename T>
MORI_DEVICE_INLINE bool ShmemWaitUntil(const ShmemDeviceContext& ctx, T* addr, core::CmpOp op,
                                       detail::NonDeduced<T> value, int peer = -1,
                                       const char* label = "ShmemWaitUntil") {
  return core::WaitUntil(ctx.wait, addr, op, value, peer, label);
}
MORI_DEVICE_INLINE bool ShmemSignalWaitUntil(const ShmemDeviceContext& ctx, uint64_t* sigAddr,
                                             core::CmpOp op, uint64_t value, int peer = -1,
                                             const char* label = "ShmemSignalWaitUntil") {
  return core::WaitUntil(ctx.wait, sigAddr, op, value, peer, label);
}

// =============================================================================================
// Quiet / fence. P2P stores complete through the memory system, so both are a system fence; quiet
// also waits until every RDMA work request posted so far (by any thread of this PE, to any PE)
// has completed; fence needs nothing more for RDMA, since a thread keeps to one QP per peer and RC
// executes a QP's requests in order:
//   ShmemQuietThread: every put/atomic this thread issued before is complete and visible on its
//                     target PE (and the source buffers are reusable). Sequentially consistent
//                     (fence.sc.sys), so it also orders those puts before this thread's later
//                     loads of words other PEs write.
//   ShmemQuietWarp / ShmemQuietBlock: the same for every put/atomic any thread of the warp /
//                     block issued before; all threads of the scope call it. One thread runs the
//                     fence between two scope syncs (cumulative through the barrier), instead of
//                     one SC fence per thread.
//   ShmemFenceThread: puts/atomics this thread issued before are ordered before those it issues
//                     after, per target PE (an acq_rel system fence: ordering, not completion).
// =============================================================================================
MORI_DEVICE_INLINE void ShmemQuietThread(const ShmemDeviceContext& ctx) {
  core::FenceSystem();
  detail::RdmaQuietAll(ctx, "ShmemQuietThread");
}
// Quiet towards one PE: every put/atomic issued to `pe` before (by this thread; for an RDMA PE by
// any thread of this PE, since completion is tracked per QP) is complete on `pe`. Cheaper than
// ShmemQuietThread(ctx) when other RDMA peers have work outstanding.
MORI_DEVICE_INLINE void ShmemQuietThread(const ShmemDeviceContext& ctx, int pe) {
  core::FenceSystem();
  if (detail::IsRdma(ctx, pe)) detail::RdmaQuietPe(ctx, pe, "ShmemQuietThread");
}
// Quiet of one channel (Thread scope): a system fence, then every request published so far on
// (pe, qp) (by any thread) is complete on `pe`. Other QPs to `pe` are not waited for. False on
// timeout or an error completion (recorded).
MORI_DEVICE_INLINE bool ShmemQuietThreadQp(const ShmemDeviceContext& ctx, int pe, uint32_t qp) {
  core::FenceSystem();
  if (!detail::IsRdma(ctx, pe)) return true;
  const ShmemRdmaPeer& p = ctx.rdmaPeers[pe];
  return detail::RdmaQuietQp(ctx, pe, detail::RdmaQpIndex(p, qp), "ShmemQuietThreadQp");
}
MORI_DEVICE_INLINE void ShmemQuietWarp(const ShmemDeviceContext& ctx) {
  detail::WarpScope::Sync();
  if (detail::WarpScope::Rank() == 0) {
    core::FenceSystem();
    detail::RdmaQuietAll(ctx, "ShmemQuietWarp");
  }
  detail::WarpScope::Sync();
}
MORI_DEVICE_INLINE void ShmemQuietBlock(const ShmemDeviceContext& ctx) {
  detail::BlockScope::Sync();
  if (detail::BlockScope::Rank() == 0) {
    core::FenceSystem();
    detail::RdmaQuietAll(ctx, "ShmemQuietBlock");
  }
  detail::BlockScope::Sync();
}
MORI_DEVICE_INLINE void ShmemFenceThread(const ShmemDeviceContext&) { core::FenceAcqRelSystem(); }

// =============================================================================================
// Device barrier across all PEs. Returns true when every PE has arrived; false on timeout (error
// "ShmemBarrierAll arrivals" recorded with the expected and seen arrival counts) or when a PE
// cannot be reached by load/store (error recorded). On true, all puts the caller(s) issued before
// the barrier are visible on their targets.
//   ShmemBarrierAllThread: exactly one thread per PE calls it (covers that thread's puts).
//   ShmemBarrierAllBlock:  every thread of exactly one block per PE calls it (covers the block's
//                          puts); every thread gets the result.
// Uses syncArea[kSyncWordDeviceBarrier] (monotonic arrival counter) and *barrierEpoch (this PE's
// count of device barriers, persists across kernels): device barriers of one PE (these and
// ShmemBarrierOnStream) must not run concurrently with each other, e.g. keep them on one stream.
// =============================================================================================
MORI_DEVICE_INLINE bool ShmemBarrierAllThread(const ShmemDeviceContext& ctx) {
  core::FenceAcqRelSystem();  // this thread's puts before its arrivals
  const uint64_t epoch = *ctx.barrierEpoch + 1;
  *ctx.barrierEpoch = epoch;
  bool ok = detail::RdmaQuietAll(ctx, "ShmemBarrierAll");  // RDMA puts complete before arrivals
  for (int p = 0; p < ctx.worldSize; p++) ok = detail::BarrierArrive(ctx, p) && ok;
  return ok && detail::BarrierWait(ctx, epoch);
}

MORI_DEVICE_INLINE bool ShmemBarrierAllBlock(const ShmemDeviceContext& ctx) {
  const int tid = detail::FlatThreadId();
  const int nthreads = detail::BlockThreads();
  const uint64_t epoch = *ctx.barrierEpoch + 1;
  // Every thread's puts before any arrival: sync, one acq_rel system fence (cumulative), sync.
  detail::ScopeFenceAcqRelSystem<detail::BlockScope>();
  // RDMA puts complete before any arrival (the leader quiets every QP; completion is global).
  bool ok = detail::BlockScope::Broadcast(tid != 0 || detail::RdmaQuietAll(ctx, "ShmemBarrierAll"));
  for (int p = tid; p < ctx.worldSize; p += nthreads) ok = detail::BarrierArrive(ctx, p) && ok;
  ok = __syncthreads_and(ok) != 0;
  if (tid == 0) {
    *ctx.barrierEpoch = epoch;
    if (ok) ok = detail::BarrierWait(ctx, epoch);
  }
  return __syncthreads_and(tid != 0 || ok) != 0;
}

}  // namespace mori::shmem

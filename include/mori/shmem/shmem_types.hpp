// Plain structs shared by the shmem host API and device API.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mori/application/transport_types.hpp"
#include "mori/core/device/wait.hpp"
#include "mori/core/transport/rdma_queue.hpp"

namespace mori::shmem {

using application::TransportType;
using application::TransportTypeName;

// Slots of the internal synchronisation area (carved from the symmetric heap at init).
constexpr int kSyncAreaWords = 64;  // uint64 words reserved at heap offset 0 for internal sync

// How kernels of this PE reach one RDMA peer (device pointers); built by shmem init from the
// application layer's RdmaTransport.
struct ShmemRdmaPeer {
  const core::rdma::QpEndpoint* qps;  // numQps connected RC endpoints to the peer
  uint32_t numQps;
  uint32_t rkey;            // the peer's heap key
  uint64_t remoteHeapBase;  // the peer's heap base as its NIC addresses it
  uint64_t* scratch;        // numQps * 2 * (SQ blocks) words in this PE's heap: fetched values
};

// A local buffer registered for RDMA with ShmemRegisterBuffer (size 0: free entry).
struct ShmemUserRegion {
  uint64_t base;
  uint64_t size;
  uint32_t lkey;
  uint32_t pad;
};
constexpr int kMaxUserRegions = 64;

// Everything a kernel needs to use the shmem device API. Obtained on the host from
// ShmemGetDeviceContext() and passed to kernels by value (it lives in kernel parameter space,
// so no per-module global state has to be kept in sync). All pointers are device pointers.
struct ShmemDeviceContext {
  int32_t rank;
  int32_t worldSize;
  uintptr_t heapBase;  // this PE's heap base (local address)
  uint64_t heapSize;
  const uintptr_t* peerHeapBases;  // [worldSize]: base of PE p's heap as mapped here; 0 if not
                                   // load/store reachable (RDMA-only or none)
  const TransportType* transport;  // [worldSize]
  uint64_t* syncArea;              // symmetric; internal barrier counters (kSyncAreaWords words)
  uint64_t* barrierEpoch;          // local, non-symmetric: epoch of the last device barrier, per PE
  core::WaitContext wait;          // timeout + error record for every bounded wait
  const ShmemRdmaPeer* rdmaPeers;  // [worldSize] (entries of non-RDMA PEs unused); nullptr when
                                   // no PE of the job is reached by RDMA
  uint32_t heapLkey;               // this PE's heap key (local side of RDMA work requests)
  const ShmemUserRegion* userRegions;  // [kMaxUserRegions] in device memory (registered buffers);
                                       // nullptr without RDMA
  // Topology (see application/context/context.hpp): nodes are numbered 0..numNodes-1 in the order
  // of their lowest PE; a PE's local rank is its index among its node's PEs in PE order.
  const int32_t* nodeOf;       // [worldSize]: node of every PE
  const int32_t* localRankOf;  // [worldSize]: local rank of every PE
  int32_t numNodes;
};

// A symmetric allocation: same offset in every PE's heap.
struct SymmMemObj {
  void* localPtr;
  size_t size;
  uint64_t heapOffset;
  const uintptr_t* peerHeapBases;  // as in ShmemDeviceContext

  // Device only. Peer's copy of this object as mapped here (nullptr if PE p is not load/store
  // reachable). On the host use ShmemPtrP2p.
  template <typename T = void>
  __device__ T* GetAs(int pe) const {
    uintptr_t base = peerHeapBases[pe];
    return base == 0 ? nullptr : reinterpret_cast<T*>(base + heapOffset);
  }
  template <typename T = void>
  __host__ __device__ T* GetAs() const {
    return reinterpret_cast<T*>(localPtr);
  }
};

}  // namespace mori::shmem

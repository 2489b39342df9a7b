// Execution scopes of the shmem device API: which threads cooperate on one call.
//   ThreadScope: the calling thread alone.
//   WarpScope:   all kWarpSize lanes of the calling warp (full warps only: blockDim.x*y*z must be a
//                multiple of core::kWarpSize).
//   BlockScope:  every thread of the calling block.
// Rank()/Size() index the threads inside the scope; Sync() is the scope's barrier (it also orders
// the scope's memory operations at block level, as __syncthreads/__syncwarp do).
#pragma once

#include <cstdint>

#include "mori/core/gpu.hpp"

namespace mori::shmem::detail {

// Linear thread index inside the block (threads form warps in this order).
MORI_DEVICE_INLINE int FlatThreadId() {
  return static_cast<int>(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z));
}
MORI_DEVICE_INLINE int BlockThreads() {
  return static_cast<int>(blockDim.x * blockDim.y * blockDim.z);
}

// Broadcast(v) / BroadcastWord(v): every thread of the scope gets the value the scope's leader
// (Rank() == 0) passed; all threads of the scope call it (it syncs the scope).
struct ThreadScope {
  MORI_DEVICE_INLINE static int Rank() { return 0; }
  MORI_DEVICE_INLINE static int Size() { return 1; }
  MORI_DEVICE_INLINE static void Sync() {}
  MORI_DEVICE_INLINE static bool Broadcast(bool v) { return v; }
  MORI_DEVICE_INLINE static uint64_t BroadcastWord(uint64_t v) { return v; }
};

struct WarpScope {
  MORI_DEVICE_INLINE static int Rank() { return FlatThreadId() & (core::kWarpSize - 1); }
  MORI_DEVICE_INLINE static int Size() { return core::kWarpSize; }
  MORI_DEVICE_INLINE static void Sync() { core::WarpSync(); }
  MORI_DEVICE_INLINE static bool Broadcast(bool v) {
    return core::WarpShfl(static_cast<int>(v), 0) != 0;
  }
  MORI_DEVICE_INLINE static uint64_t BroadcastWord(uint64_t v) {
    return static_cast<uint64_t>(core::WarpShfl(static_cast<unsigned long long>(v), 0));
  }
};

struct BlockScope {
  MORI_DEVICE_INLINE static int Rank() { return FlatThreadId(); }
  MORI_DEVICE_INLINE static int Size() { return BlockThreads(); }
  MORI_DEVICE_INLINE static void Sync() { __syncthreads(); }
  MORI_DEVICE_INLINE static bool Broadcast(bool v) {
    return __syncthreads_or(FlatThreadId() == 0 && v) != 0;
  }
  // The second sync keeps a later broadcast from overwriting the word before every thread read it.
  MORI_DEVICE_INLINE static uint64_t BroadcastWord(uint64_t v) {
    __shared__ uint64_t word;
    if (FlatThreadId() == 0) word = v;
    __syncthreads();
    const uint64_t r = word;
    __syncthreads();
    return r;
  }
};

}  // namespace mori::shmem::detail

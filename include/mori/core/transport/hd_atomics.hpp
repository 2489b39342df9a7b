// Host/device atomics shim for code shared by GPU threads and, in tests, host threads (the RDMA
// posting protocol). The one place that picks the implementation: device compiles use gpu.hpp's
// system-scope atomics; host compiles use the __atomic builtins (understood by ThreadSanitizer).
// Host-only translation units do not need the GPU runtime headers.
#pragma once

#include <cstdint>

#include "mori/core/host_device.hpp"

#if MORI_GPU_COMPILER
#include "mori/core/gpu.hpp"
#endif

#if !MORI_DEVICE_PASS
#include <chrono>
#include <thread>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#endif

namespace mori::core::hd {

template <typename T>
MORI_HD_INLINE T LoadAcquire(T* p) {
#if MORI_DEVICE_PASS
  return AtomicLoadAcquireSystem(p);
#else
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}
template <typename T>
MORI_HD_INLINE T LoadRelaxed(T* p) {
#if MORI_DEVICE_PASS
  return AtomicLoadRelaxedSystem(p);
#else
  return __atomic_load_n(p, __ATOMIC_RELAXED);
#endif
}
template <typename T>
MORI_HD_INLINE void StoreRelease(T* p, T v) {
#if MORI_DEVICE_PASS
  AtomicStoreReleaseSystem(p, v);
#else
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
#endif
}
template <typename T>
MORI_HD_INLINE void StoreRelaxed(T* p, T v) {
#if MORI_DEVICE_PASS
  AtomicStoreRelaxedSystem(p, v);
#else
  __atomic_store_n(p, v, __ATOMIC_RELAXED);
#endif
}
// Relaxed fetch-add: returns the old value.
template <typename T>
MORI_HD_INLINE T FetchAddRelaxed(T* p, T v) {
#if MORI_DEVICE_PASS
  return AtomicFetchAddSystem(p, v);
#else
  return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
#endif
}
// Try-acquire of a 0/1 lock word; true when this caller now holds it.
MORI_HD_INLINE bool TryLock(uint32_t* lock) {
#if MORI_DEVICE_PASS
  if (AtomicCasSystem<uint32_t>(lock, 0u, 1u) != 0u) return false;
  FenceAcqRelSystem();
  return true;
#else
  uint32_t expected = 0;
  return __atomic_compare_exchange_n(lock, &expected, 1u, false, __ATOMIC_ACQUIRE,
                                     __ATOMIC_RELAXED);
#endif
}
MORI_HD_INLINE void Unlock(uint32_t* lock) { StoreRelease<uint32_t>(lock, 0u); }
// Release fence: this thread's earlier stores (the WQE bytes) before its later ones.
MORI_HD_INLINE void FenceRelease() {
#if MORI_DEVICE_PASS
  FenceAcqRelSystem();
#else
  __atomic_thread_fence(__ATOMIC_RELEASE);
#endif
}
// Monotonic nanoseconds (device: the GPU's global timer).
MORI_HD_INLINE uint64_t NowNs() {
#if MORI_DEVICE_PASS
  return WallClockNs();
#else
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
#endif
}
// Back-off inside a spin loop; `iter` counts the iterations so far.
MORI_HD_INLINE void Pause(uint32_t iter) {
#if MORI_DEVICE_PASS
  (void)iter;
  SpinPause();
#else
  if (iter < 64) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#endif
  } else {
    std::this_thread::yield();
  }
#endif
}

}  // namespace mori::core::hd

// Wide cooperative memory copy used by every load/store (P2P) put and get.
//
// ScopedCopy<Scope>(dst, src, bytes): the threads of Scope (see scope.hpp) copy `bytes` bytes;
// every thread of the scope must call it with the same arguments. Either pointer may be a peer
// GPU's P2P-mapped address. Ranges must not overlap.
//
// The widest element both pointers can share is used: 16-byte vectors when dst and src agree
// modulo 16 (after a byte head that aligns dst), else 8, 4, or single bytes. Each thread keeps
// kCopyUnroll independent loads in flight before its stores, with the scope's threads on
// consecutive elements (coalesced), so one warp moves kWarpSize * 64 bytes per step.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mori/core/gpu.hpp"
#include "mori/shmem/device/scope.hpp"

namespace mori::shmem::detail {

constexpr int kCopyUnroll = 4;      // 16-byte loads in flight per thread
constexpr int kByteCopyUnroll = 8;  // for the byte fallback (mutually misaligned pointers)

// Elementwise copy of n elements of V; thread `tid` of `nthreads` takes i = tid, tid + nthreads...
template <typename V, int kUnroll>
MORI_DEVICE_INLINE void CopyElements(V* dst, const V* src, size_t n, size_t tid, size_t nthreads) {
  size_t i = tid;
  const size_t batch = nthreads * kUnroll;
  for (; i + (kUnroll - 1) * nthreads < n; i += batch) {
    V r[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; k++) r[k] = src[i + k * nthreads];
#pragma unroll
    for (int k = 0; k < kUnroll; k++) dst[i + k * nthreads] = r[k];
  }
  for (; i < n; i += nthreads) dst[i] = src[i];
}

// dst and src agree modulo sizeof(V): byte head up to dst's V alignment, V body, byte tail.
template <typename V, int kUnroll>
MORI_DEVICE_INLINE void CopyCoAligned(uint8_t* dst, const uint8_t* src, size_t bytes, size_t tid,
                                      size_t nthreads) {
  constexpr size_t kAlign = sizeof(V);
  size_t head = (kAlign - (reinterpret_cast<uintptr_t>(dst) & (kAlign - 1))) & (kAlign - 1);
  if (head > bytes) head = bytes;
  const size_t nvec = (bytes - head) / kAlign;
  const size_t tailStart = head + nvec * kAlign;
  for (size_t i = tid; i < head; i += nthreads) dst[i] = src[i];
  CopyElements<V, kUnroll>(reinterpret_cast<V*>(dst + head), reinterpret_cast<const V*>(src + head),
                           nvec, tid, nthreads);
  for (size_t i = tailStart + tid; i < bytes; i += nthreads) dst[i] = src[i];
}

MORI_DEVICE_INLINE void CopyBytes(void* dstv, const void* srcv, size_t bytes, size_t tid,
                                  size_t nthreads) {
  uint8_t* dst = static_cast<uint8_t*>(dstv);
  const uint8_t* src = static_cast<const uint8_t*>(srcv);
  const uintptr_t diff = reinterpret_cast<uintptr_t>(dst) ^ reinterpret_cast<uintptr_t>(src);
  if ((diff & 15) == 0) {
    CopyCoAligned<uint4, kCopyUnroll>(dst, src, bytes, tid, nthreads);
  } else if ((diff & 7) == 0) {
    CopyCoAligned<uint64_t, kCopyUnroll>(dst, src, bytes, tid, nthreads);
  } else if ((diff & 3) == 0) {
    CopyCoAligned<uint32_t, kCopyUnroll>(dst, src, bytes, tid, nthreads);
  } else {
    CopyElements<uint8_t, kByteCopyUnroll>(dst, src, bytes, tid, nthreads);
  }
}

template <class Scope>
MORI_DEVICE_INLINE void ScopedCopy(void* dst, const void* src, size_t bytes) {
  CopyBytes(dst, src, bytes, static_cast<size_t>(Scope::Rank()),
            static_cast<size_t>(Scope::Size()));
}

}  // namespace mori::shmem::detail

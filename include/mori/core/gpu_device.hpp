// Device side of the portability layer: function qualifiers, warp geometry (32 lanes on NVIDIA,
// 64 on AMD) and lane masks, shuffles and ballots, system-scope atomics and fences, bulk copies
// into shared memory, packing fp32 pairs into 16-bit floats, the grid-dependency wait, clocks and
// the spin pause. Kernels include core/gpu.hpp, which includes this header; they never test the
// platform themselves.
#pragma once

#include <cstdint>

#include "mori/core/float16.hpp"
#include "mori/core/gpu_runtime.hpp"

#if MORI_CUDA && MORI_GPU_COMPILER
#include <cuda/atomic>
#endif

#define MORI_DEVICE __device__
#define MORI_DEVICE_INLINE __device__ __forceinline__

namespace mori::core {

// ---------------------------------------------------------------------------------------------
// Warp geometry. AMD CDNA wavefronts are 64 lanes; NVIDIA warps are 32.
// ---------------------------------------------------------------------------------------------
#if MORI_HIP
constexpr int kWarpSize = 64;
using LaneMask = uint64_t;
#else
constexpr int kWarpSize = 32;
using LaneMask = uint32_t;
#endif
constexpr LaneMask kFullLaneMask = ~LaneMask(0);

#if MORI_GPU_COMPILER

MORI_DEVICE_INLINE int LaneId() { return static_cast<int>(threadIdx.x) & (kWarpSize - 1); }
MORI_DEVICE_INLINE int WarpId() { return static_cast<int>(threadIdx.x) / kWarpSize; }
MORI_DEVICE_INLINE int WarpsPerBlock() { return static_cast<int>(blockDim.x) / kWarpSize; }

MORI_DEVICE_INLINE void WarpSync() {
#if MORI_HIP
  __builtin_amdgcn_wave_barrier();
#else
  __syncwarp();
#endif
}

MORI_DEVICE_INLINE LaneMask WarpBallot(bool pred) {
#if MORI_HIP
  return __ballot(pred);
#else
  return __ballot_sync(kFullLaneMask, pred);
#endif
}

template <typename T>
MORI_DEVICE_INLINE T WarpShfl(T v, int srcLane) {
#if MORI_HIP
  return __shfl(v, srcLane, kWarpSize);
#else
  return __shfl_sync(kFullLaneMask, v, srcLane, kWarpSize);
#endif
}

template <typename T>
MORI_DEVICE_INLINE T WarpShflXor(T v, int laneMask) {
#if MORI_HIP
  return __shfl_xor(v, laneMask, kWarpSize);
#else
  return __shfl_xor_sync(kFullLaneMask, v, laneMask, kWarpSize);
#endif
}

template <typename T>
MORI_DEVICE_INLINE T WarpReduceSum(T v) {
  for (int off = kWarpSize / 2; off > 0; off /= 2) v += WarpShflXor(v, off);
  return v;
}

// a * b rounded to fp32, never contracted with a following addition into a fused multiply-add:
// sums of such products are bitwise those of a reference that rounds every product (torch).
MORI_DEVICE_INLINE float MulNoContract(float a, float b) {
#if MORI_HIP
#pragma clang fp contract(off)
  return a * b;
#else
  return __fmul_rn(a, b);
#endif
}

// Two fp32 values rounded to nearest even into one word of two 16-bit floats, lo in bits 0-15
// and hi in bits 16-31: bf16 (NaN to core::kBf16QuietNan, float16.hpp) and fp16. One conversion
// instruction per pair on NVIDIA sm_80+; elsewhere bitwise the same result in software (bf16)
// or per-element conversions (fp16).
MORI_DEVICE_INLINE uint32_t PackBf16x2(float lo, float hi) {
#if MORI_CUDA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t w;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
  return w;
#else
  return static_cast<uint32_t>(Bf16RoundBits(lo)) |
         (static_cast<uint32_t>(Bf16RoundBits(hi)) << 16);
#endif
}
MORI_DEVICE_INLINE uint32_t PackHalf2(float lo, float hi) {
#if MORI_CUDA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t w;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
  return w;
#else
  return static_cast<uint32_t>(__half_as_ushort(__float2half_rn(lo))) |
         (static_cast<uint32_t>(__half_as_ushort(__float2half_rn(hi))) << 16);
#endif
}

MORI_DEVICE_INLINE int PopCount(LaneMask m) {
#if MORI_HIP
  return __popcll(m);
#else
  return __popc(m);
#endif
}

// ---------------------------------------------------------------------------------------------
// Memory ordering and system-scope atomics (visible to peer GPUs and the host).
// ---------------------------------------------------------------------------------------------
// Sequentially consistent system fence (fence.sc.sys on NVIDIA). Expensive: executed by every
// thread of a large grid it serialises GPU-wide. Prefer the pattern "scope barrier, then one
// thread FenceAcqRelSystem, then the release/signal store": fences are cumulative, so one thread's
// fence covers the stores of every thread that synchronised with it through the barrier.
MORI_DEVICE_INLINE void FenceSystem() { __threadfence_system(); }
// Release/acquire system fence: orders this thread's (and, cumulatively, its synchronised
// peers') prior loads and stores before its later ones, as seen by peer GPUs and the host.
MORI_DEVICE_INLINE void FenceAcqRelSystem() {
#if MORI_HIP
  __builtin_amdgcn_fence(__ATOMIC_ACQ_REL, "");
#else
  asm volatile("fence.acq_rel.sys;" ::: "memory");
#endif
}
MORI_DEVICE_INLINE void FenceDevice() { __threadfence(); }
MORI_DEVICE_INLINE void FenceBlock() { __threadfence_block(); }

#if MORI_HIP
#define MORI_SYS_SCOPE __HIP_MEMORY_SCOPE_SYSTEM
template <typename T>
MORI_DEVICE_INLINE T AtomicLoadRelaxedSystem(T* p) {
  return __hip_atomic_load(p, __ATOMIC_RELAXED, MORI_SYS_SCOPE);
}
template <typename T>
MORI_DEVICE_INLINE T AtomicLoadAcquireSystem(T* p) {
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, MORI_SYS_SCOPE);
}
template <typename T>
MORI_DEVICE_INLINE void AtomicStoreRelaxedSystem(T* p, T v) {
  __hip_atomic_store(p, v, __ATOMIC_RELAXED, MORI_SYS_SCOPE);
}
template <typename T>
MORI_DEVICE_INLINE void AtomicStoreReleaseSystem(T* p, T v) {
  __hip_atomic_store(p, v, __ATOMIC_RELEASE, MORI_SYS_SCOPE);
}
template <typename T>
MORI_DEVICE_INLINE T AtomicFetchAddSystem(T* p, T v) {
  return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, MORI_SYS_SCOPE);
}
template <typename T>
MORI_DEVICE_INLINE T AtomicFetchAddReleaseSystem(T* p, T v) {
  return __hip_atomic_fetch_add(p, v, __ATOMIC_RELEASE, MORI_SYS_SCOPE);
}
template <typename T>
MORI_DEVICE_INLINE T AtomicSwapSystem(T* p, T v) {
  return __hip_atomic_exchange(p, v, __ATOMIC_RELAXED, MORI_SYS_SCOPE);
}
// Returns the value seen before the operation (== compare on success).
template <typename T>
MORI_DEVICE_INLINE T AtomicCasSystem(T* p, T compare, T v) {
  __hip_atomic_compare_exchange_strong(p, &compare, v, __ATOMIC_RELAXED, __ATOMIC_RELAXED,
                                       MORI_SYS_SCOPE);
  return compare;
}
#undef MORI_SYS_SCOPE
#else
template <typename T>
using SysAtomicRef = cuda::atomic_ref<T, cuda::thread_scope_system>;
template <typename T>
MORI_DEVICE_INLINE T AtomicLoadRelaxedSystem(T* p) {
  return SysAtomicRef<T>(*p).load(cuda::memory_order_relaxed);
}
template <typename T>
MORI_DEVICE_INLINE T AtomicLoadAcquireSystem(T* p) {
  return SysAtomicRef<T>(*p).load(cuda::memory_order_acquire);
}
template <typename T>
MORI_DEVICE_INLINE void AtomicStoreRelaxedSystem(T* p, T v) {
  SysAtomicRef<T>(*p).store(v, cuda::memory_order_relaxed);
}
template <typename T>
MORI_DEVICE_INLINE void AtomicStoreReleaseSystem(T* p, T v) {
  SysAtomicRef<T>(*p).store(v, cuda::memory_order_release);
}
template <typename T>
MORI_DEVICE_INLINE T AtomicFetchAddSystem(T* p, T v) {
  return SysAtomicRef<T>(*p).fetch_add(v, cuda::memory_order_relaxed);
}
template <typename T>
MORI_DEVICE_INLINE T AtomicFetchAddReleaseSystem(T* p, T v) {
  return SysAtomicRef<T>(*p).fetch_add(v, cuda::memory_order_release);
}
template <typename T>
MORI_DEVICE_INLINE T AtomicSwapSystem(T* p, T v) {
  return SysAtomicRef<T>(*p).exchange(v, cuda::memory_order_relaxed);
}
template <typename T>
MORI_DEVICE_INLINE T AtomicCasSystem(T* p, T compare, T v) {
  SysAtomicRef<T>(*p).compare_exchange_strong(compare, v, cuda::memory_order_relaxed);
  return compare;
}
#endif

// ---------------------------------------------------------------------------------------------
// Bulk asynchronous copies, global -> shared memory, completing on a shared-memory barrier
// (NVIDIA Hopper's bulk copy engine, the non-tensor form of TMA). One thread moves a whole
// contiguous range (16-byte aligned, a multiple of 16 bytes), without registers, so an SM can keep
// far more bytes in flight than its registers hold; the source may be a peer GPU's memory.
// kHasBulkAsyncCopy is true only in a device pass for sm_90+; elsewhere these functions are
// never called (callers test it with `if constexpr`) and trap if they are.
// Protocol: one thread MbarInit(bar, 1) each barrier, FenceMbarInit(), a warp/block barrier; per
// use: MbarArriveExpectTx(bar, total bytes) then BulkCopyToShared(...) for each range; readers
// poll MbarTryWait(bar, phase) with phase = (use count) & 1.
// ---------------------------------------------------------------------------------------------
#if MORI_CUDA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kHasBulkAsyncCopy = true;
MORI_DEVICE_INLINE uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
MORI_DEVICE_INLINE void MbarInit(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SharedAddress(bar)), "r"(count)
               : "memory");
}
// Makes initialised barriers visible to the bulk copy engine.
MORI_DEVICE_INLINE void FenceMbarInit() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Orders this thread's earlier generic-proxy memory accesses (e.g. an acquire of a flag that
// publishes the data) before its later bulk copies.
MORI_DEVICE_INLINE void FenceProxyAsync() { asm volatile("fence.proxy.async;" ::: "memory"); }
MORI_DEVICE_INLINE void MbarArriveExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(SharedAddress(bar)),
               "r"(bytes)
               : "memory");
}
MORI_DEVICE_INLINE void BulkCopyToShared(void* dst, const void* src, uint32_t bytes,
                                         uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(SharedAddress(dst)),
      "l"(src), "r"(bytes), "r"(SharedAddress(bar))
      : "memory");
}
MORI_DEVICE_INLINE bool MbarTryWait(uint64_t* bar, uint32_t phase) {
  uint32_t done;
  asm volatile(
      "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
      "selp.u32 %0, 1, 0, p; }"
      : "=r"(done)
      : "r"(SharedAddress(bar)), "r"(phase)
      : "memory");
  return done != 0;
}
#else
constexpr bool kHasBulkAsyncCopy = false;
MORI_DEVICE_INLINE void MbarInit(uint64_t*, uint32_t) { __builtin_trap(); }
MORI_DEVICE_INLINE void FenceMbarInit() { __builtin_trap(); }
MORI_DEVICE_INLINE void FenceProxyAsync() { __builtin_trap(); }
MORI_DEVICE_INLINE void MbarArriveExpectTx(uint64_t*, uint32_t) { __builtin_trap(); }
MORI_DEVICE_INLINE void BulkCopyToShared(void*, const void*, uint32_t, uint64_t*) {
  __builtin_trap();
}
MORI_DEVICE_INLINE bool MbarTryWait(uint64_t*, uint32_t) {
  __builtin_trap();
  return true;
}
#endif

// ---------------------------------------------------------------------------------------------
// Programmatic dependent launch (NVIDIA sm_90+). A kernel launched with GpuLaunchKernel(...,
// programmatic = true, ...) may be launched before the kernel ahead of it on the stream has
// finished: once every block of that kernel has exited or called GridDependentsLaunch(). It must
// call GridDependencyWait() before it touches anything an earlier kernel on the stream writes; the
// wait returns when those kernels have completed and their memory is visible. What is gained is the
// launch latency, overlapped with the previous kernel's completion. Elsewhere (HIP, older NVIDIA
// GPUs, a plain launch) the wait does nothing and the launch is an ordinary one.
// ---------------------------------------------------------------------------------------------
MORI_DEVICE_INLINE void GridDependencyWait() {
#if MORI_CUDA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the kernel launched programmatically after this one start before this one has finished:
// once every block of this kernel has called it (or exited). GridDependencyWait() there still
// waits for this kernel's completion; a kernel that skips it must learn of what this one writes
// after the call through flags, and this kernel must never wait for it (its blocks may only get
// SMs as this one's leave). No-op where programmatic launches do not exist.
MORI_DEVICE_INLINE void GridDependentsLaunch() {
#if MORI_CUDA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ---------------------------------------------------------------------------------------------
// Time and back-off.
// ---------------------------------------------------------------------------------------------
// A monotonic clock in nanoseconds, comparable across the threads of one GPU.
MORI_DEVICE_INLINE uint64_t WallClockNs() {
#if MORI_HIP
  // s_memrealtime counts a constant 100 MHz clock on CDNA2/CDNA3.
  return __builtin_amdgcn_s_memrealtime() * 10ull;
#else
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#endif
}

// The multiprocessor (SM / CU) the calling thread runs on.
MORI_DEVICE_INLINE uint32_t SmId() {
#if MORI_HIP
  return static_cast<uint32_t>(__smid());
#else
  uint32_t id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
#endif
}

// Brief pause in spin loops; lets other warps of the SM make progress.
MORI_DEVICE_INLINE void SpinPause() {
#if MORI_HIP
  __builtin_amdgcn_s_sleep(1);
#else
  __nanosleep(32);
#endif
}

#endif  // MORI_GPU_COMPILER

}  // namespace mori::core

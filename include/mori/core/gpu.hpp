// The one portability header: everything that differs between CUDA and HIP lives here.
// Kernels and host code use the gpu* runtime names and the mori::core device helpers below,
// never #ifdef on the platform themselves.
//
// Backend selection: MORI_BACKEND_HIP / MORI_BACKEND_CUDA come from the build (cmake/MoriGpu.cmake);
// a HIP compiler also implies HIP.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "mori/core/hd.hpp"

#if defined(MORI_BACKEND_HIP) || defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
#define MORI_HIP 1
#include <hip/hip_fp16.h>
#include <hip/hip_runtime.h>
#else
#define MORI_CUDA 1
#include <cuda.h>  // driver API types only (entry points come through cudart)
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#if defined(__CUDACC__)
#include <cuda/atomic>
#endif
#endif

#if MORI_DEVICE_PASS
#define MORI_DEVICE_COMPILE 1
#endif

#define MORI_HOST_DEVICE __host__ __device__
#define MORI_DEVICE __device__
#define MORI_DEVICE_INLINE __device__ __forceinline__

// ---------------------------------------------------------------------------------------------
// Runtime API names
// ---------------------------------------------------------------------------------------------
#if MORI_HIP
#define MORI_GPU_NAME(x) hip##x
#define MORI_GPU_PLATFORM_NAME "HIP"
#else
#define MORI_GPU_NAME(x) cuda##x
#define MORI_GPU_PLATFORM_NAME "CUDA"
#endif

using gpuError_t = MORI_GPU_NAME(Error_t);
using gpuStream_t = MORI_GPU_NAME(Stream_t);
using gpuEvent_t = MORI_GPU_NAME(Event_t);
using gpuIpcMemHandle_t = MORI_GPU_NAME(IpcMemHandle_t);
#if MORI_HIP
using gpuDeviceProp_t = hipDeviceProp_t;
using gpuPointerAttributes_t = hipPointerAttribute_t;
#define gpuHostAlloc hipHostMalloc
#define gpuFreeHost hipHostFree
#define gpuHostAllocMapped hipHostMallocMapped
#define gpuHostAllocPortable hipHostMallocPortable
#define gpuDevAttrMultiProcessorCount hipDeviceAttributeMultiprocessorCount
#define gpuHostRegisterIoMemory hipHostRegisterIoMemory
#else
using gpuDeviceProp_t = cudaDeviceProp;
using gpuPointerAttributes_t = cudaPointerAttributes;
#define gpuHostAlloc cudaHostAlloc
#define gpuFreeHost cudaFreeHost
#define gpuHostAllocMapped cudaHostAllocMapped
#define gpuHostAllocPortable cudaHostAllocPortable
#define gpuDevAttrMultiProcessorCount cudaDevAttrMultiProcessorCount
#define gpuHostRegisterIoMemory cudaHostRegisterIoMemory
#endif

#define gpuSuccess MORI_GPU_NAME(Success)
#define gpuErrorNotReady MORI_GPU_NAME(ErrorNotReady)
#define gpuErrorPeerAccessAlreadyEnabled MORI_GPU_NAME(ErrorPeerAccessAlreadyEnabled)
#define gpuGetErrorString MORI_GPU_NAME(GetErrorString)
#define gpuGetErrorName MORI_GPU_NAME(GetErrorName)
#define gpuGetLastError MORI_GPU_NAME(GetLastError)
#define gpuPeekAtLastError MORI_GPU_NAME(PeekAtLastError)
#define gpuGetDevice MORI_GPU_NAME(GetDevice)
#define gpuSetDevice MORI_GPU_NAME(SetDevice)
#define gpuGetDeviceCount MORI_GPU_NAME(GetDeviceCount)
#define gpuGetDeviceProperties MORI_GPU_NAME(GetDeviceProperties)
#define gpuDeviceGetAttribute MORI_GPU_NAME(DeviceGetAttribute)
#define gpuDeviceGetPCIBusId MORI_GPU_NAME(DeviceGetPCIBusId)
#define gpuDeviceCanAccessPeer MORI_GPU_NAME(DeviceCanAccessPeer)
#define gpuDeviceGetByPCIBusId MORI_GPU_NAME(DeviceGetByPCIBusId)
#define gpuDeviceEnablePeerAccess MORI_GPU_NAME(DeviceEnablePeerAccess)
#define gpuDeviceSynchronize MORI_GPU_NAME(DeviceSynchronize)
#define gpuDriverGetVersion MORI_GPU_NAME(DriverGetVersion)
#define gpuRuntimeGetVersion MORI_GPU_NAME(RuntimeGetVersion)
#define gpuMalloc MORI_GPU_NAME(Malloc)
#define gpuFree MORI_GPU_NAME(Free)
#define gpuHostGetDevicePointer MORI_GPU_NAME(HostGetDevicePointer)
#define gpuHostRegister MORI_GPU_NAME(HostRegister)
#define gpuHostUnregister MORI_GPU_NAME(HostUnregister)
#define gpuHostRegisterMapped MORI_GPU_NAME(HostRegisterMapped)
#define gpuHostRegisterPortable MORI_GPU_NAME(HostRegisterPortable)
#define gpuErrorNotSupported MORI_GPU_NAME(ErrorNotSupported)
#define gpuErrorHostMemoryAlreadyRegistered MORI_GPU_NAME(ErrorHostMemoryAlreadyRegistered)
#define gpuMemGetInfo MORI_GPU_NAME(MemGetInfo)
#define gpuMemcpy MORI_GPU_NAME(Memcpy)
#define gpuMemcpyAsync MORI_GPU_NAME(MemcpyAsync)
#define gpuMemcpyPeerAsync MORI_GPU_NAME(MemcpyPeerAsync)
#define gpuMemset MORI_GPU_NAME(Memset)
#define gpuMemsetAsync MORI_GPU_NAME(MemsetAsync)
#define gpuMemcpyHostToDevice MORI_GPU_NAME(MemcpyHostToDevice)
#define gpuMemcpyDeviceToHost MORI_GPU_NAME(MemcpyDeviceToHost)
#define gpuMemcpyDeviceToDevice MORI_GPU_NAME(MemcpyDeviceToDevice)
#define gpuMemcpyDefault MORI_GPU_NAME(MemcpyDefault)
#define gpuPointerGetAttributes MORI_GPU_NAME(PointerGetAttributes)
#define gpuIpcGetMemHandle MORI_GPU_NAME(IpcGetMemHandle)
#define gpuIpcOpenMemHandle MORI_GPU_NAME(IpcOpenMemHandle)
#define gpuIpcCloseMemHandle MORI_GPU_NAME(IpcCloseMemHandle)
#define gpuIpcMemLazyEnablePeerAccess MORI_GPU_NAME(IpcMemLazyEnablePeerAccess)
#define gpuStreamCreate MORI_GPU_NAME(StreamCreate)
#define gpuStreamCreateWithFlags MORI_GPU_NAME(StreamCreateWithFlags)
#define gpuStreamNonBlocking MORI_GPU_NAME(StreamNonBlocking)
#define gpuStreamCreateWithPriority MORI_GPU_NAME(StreamCreateWithPriority)
#define gpuDeviceGetStreamPriorityRange MORI_GPU_NAME(DeviceGetStreamPriorityRange)
#define gpuStreamDestroy MORI_GPU_NAME(StreamDestroy)
#define gpuStreamSynchronize MORI_GPU_NAME(StreamSynchronize)
#define gpuStreamQuery MORI_GPU_NAME(StreamQuery)
#define gpuEventCreate MORI_GPU_NAME(EventCreate)
#define gpuEventCreateWithFlags MORI_GPU_NAME(EventCreateWithFlags)
#define gpuEventDisableTiming MORI_GPU_NAME(EventDisableTiming)
#define gpuEventDestroy MORI_GPU_NAME(EventDestroy)
#define gpuEventRecord MORI_GPU_NAME(EventRecord)
#define gpuEventQuery MORI_GPU_NAME(EventQuery)
#define gpuEventSynchronize MORI_GPU_NAME(EventSynchronize)
#define gpuEventElapsedTime MORI_GPU_NAME(EventElapsedTime)
#define gpuFuncSetAttribute MORI_GPU_NAME(FuncSetAttribute)
#define gpuFuncAttributeMaxDynamicSharedMemorySize \
  MORI_GPU_NAME(FuncAttributeMaxDynamicSharedMemorySize)
#define gpuFuncGetAttributes MORI_GPU_NAME(FuncGetAttributes)
#define gpuFuncAttributes MORI_GPU_NAME(FuncAttributes)
#define gpuOccupancyMaxActiveBlocksPerMultiprocessor \
  MORI_GPU_NAME(OccupancyMaxActiveBlocksPerMultiprocessor)

namespace mori::core {

// ---------------------------------------------------------------------------------------------
// Host-side platform facts, so that callers never test the platform themselves.
// ---------------------------------------------------------------------------------------------
#if MORI_HIP
constexpr bool kPlatformHip = true;
#else
constexpr bool kPlatformHip = false;
#endif
// The FP8 "e4m3" encoding the platform's hardware and frameworks use: e4m3fnuz on AMD (gfx942),
// e4m3fn on NVIDIA.
constexpr bool kNativeFp8IsFnuz = kPlatformHip;
// DLPack device type of this platform's GPU memory (kDLROCM = 10, kDLCUDA = 2).
constexpr int32_t kDlpackGpuDeviceType = kPlatformHip ? 10 : 2;

// "gfx942" / "sm_90".
inline std::string GpuArchName(const gpuDeviceProp_t& p) {
#if MORI_HIP
  return std::string(p.gcnArchName);
#else
  return "sm_" + std::to_string(p.major) + std::to_string(p.minor);
#endif
}

// A runtime or driver version number as text ("13.0", "6.2.41133"); "none" for 0.
inline std::string GpuVersionText(int v) {
  if (v == 0) return "none";
#if MORI_HIP
  return std::to_string(v / 10000000) + "." + std::to_string((v / 100000) % 100) + "." +
         std::to_string(v % 100000);
#else
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
#endif
}

// Whether kernels' modules are loaded when the process starts using the GPU (true on HIP). CUDA
// loads lazily unless CUDA_MODULE_LOADING=EAGER; a lazy load may synchronise the context.
// *setting: the variable's value ("" when unset, "n/a" on HIP).
inline bool GpuModuleLoadingIsEager(std::string* setting) {
#if MORI_HIP
  if (setting != nullptr) *setting = "n/a";
  return true;
#else
  const char* v = std::getenv("CUDA_MODULE_LOADING");
  if (setting != nullptr) *setting = v != nullptr ? v : "";
  return v != nullptr && std::strcmp(v, "EAGER") == 0;
#endif
}

// NVIDIA sm_90 (Hopper) or later: the devices with bulk asynchronous copies (kHasBulkAsyncCopy)
// and programmatic dependent launches (GpuLaunchKernel). A kernel must also have been built for
// sm_90+ to use them (kHasBulkAsyncCopy, GpuKernelHasGridDependency).
inline bool GpuIsNvidiaSm90OrLater(const gpuDeviceProp_t& p) {
  return !kPlatformHip && p.major >= 9;
}

// Whether kernels on this device can use the bulk copies of kHasBulkAsyncCopy.
// *smemOptinBytes: the dynamic shared memory a block may opt in to (0 where unused).
inline bool GpuHasBulkAsyncCopy(const gpuDeviceProp_t& p, size_t* smemOptinBytes) {
#if MORI_HIP
  *smemOptinBytes = 0;
#else
  *smemOptinBytes = p.sharedMemPerBlockOptin;
#endif
  return GpuIsNvidiaSm90OrLater(p);
}

// Whether GpuLaunchKernel's programmatic launches may be used on this device: sm_90+, and a
// runtime and driver of CUDA 12.3 or later (from 12.3 on, stream capture records them as
// programmatic graph edges, so captured EP calls behave as eager ones).
inline bool GpuHasProgrammaticLaunch(const gpuDeviceProp_t& p) {
  if (!GpuIsNvidiaSm90OrLater(p)) return false;
  int runtime = 0, driver = 0;
  if (gpuRuntimeGetVersion(&runtime) != gpuSuccess || gpuDriverGetVersion(&driver) != gpuSuccess) {
    (void)gpuGetLastError();
    return false;
  }
  return runtime >= 12030 && driver >= 12030;
}

}  // namespace mori::core

namespace mori::core {

// Device memory whose atomics and stores are coherent with peer GPUs mapping it over P2P
// (AMD needs fine-grained memory for that; on NVIDIA ordinary device memory already is).
inline gpuError_t GpuMallocCoherent(void** ptr, size_t bytes) {
#if MORI_HIP
  return hipExtMallocWithFlags(ptr, bytes, hipDeviceMallocFinegrained);
#else
  return cudaMalloc(ptr, bytes);
#endif
}

// dma-buf export of device memory for RDMA registration (ibv_reg_dmabuf_mr). Exports the whole
// allocation that contains [ptr, ptr + bytes) (its size rounded up to `pageBytes`) and returns
// the fd in *fd (the caller closes it) and the offset of ptr inside the exported range in *offset
// (what ibv_reg_dmabuf_mr takes as `offset`; registering a sub-allocation with offset 0 maps the
// wrong pages). gpuErrorNotSupported when this runtime cannot export: HIP before 6.2 (no
// hipMemGetHandleForAddressRange), a CUDA driver without the entry points. Host only.
#if MORI_CUDA
namespace detail {
struct CudaDmabufEntryPoints {
  CUresult (*getAddressRange)(CUdeviceptr* base, size_t* size, CUdeviceptr ptr) = nullptr;
  CUresult (*getHandle)(void* handle, CUdeviceptr ptr, size_t size, CUmemRangeHandleType type,
                        unsigned long long flags) = nullptr;
};
// Through the runtime: mori links cudart only (libcuda is loaded by it at run time).
template <typename Fn>
inline void CudaDriverEntryPoint(const char* name, Fn* out) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  cudaError_t rc = cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found);
#else
  cudaError_t rc = cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault, &found);
#endif
  if (rc == cudaSuccess && found == cudaDriverEntryPointSuccess) *out = reinterpret_cast<Fn>(fn);
}
inline const CudaDmabufEntryPoints& CudaDmabuf() {
  static const CudaDmabufEntryPoints eps = [] {
    CudaDmabufEntryPoints e;
    CudaDriverEntryPoint("cuMemGetAddressRange", &e.getAddressRange);
    CudaDriverEntryPoint("cuMemGetHandleForAddressRange", &e.getHandle);
    return e;
  }();
  return eps;
}
}  // namespace detail
#endif

// On CUDA, *driverError (if given) receives the CUresult of a failed driver call.
inline gpuError_t GpuExportDmabuf(void* ptr, size_t bytes, size_t pageBytes, int* fd,
                                  uint64_t* offset, int* driverError = nullptr) {
  if (driverError != nullptr) *driverError = 0;
  *fd = -1;
  *offset = 0;
  if (ptr == nullptr || bytes == 0 || pageBytes == 0) return MORI_GPU_NAME(ErrorInvalidValue);
#if MORI_HIP
#if defined(HIP_VERSION) && HIP_VERSION >= 60200000
  hipDeviceptr_t base = nullptr;
  size_t allocBytes = 0;
  hipError_t rc = hipMemGetAddressRange(&base, &allocBytes, ptr);
  if (rc != hipSuccess) return rc;
  const uintptr_t b = reinterpret_cast<uintptr_t>(base);
  const size_t exportBytes = (allocBytes + pageBytes - 1) / pageBytes * pageBytes;
  int handle = -1;
  rc = hipMemGetHandleForAddressRange(&handle, base, exportBytes, hipMemRangeHandleTypeDmaBufFd, 0);
  if (rc != hipSuccess) return rc;
  *fd = handle;
  *offset = reinterpret_cast<uintptr_t>(ptr) - b;
  return hipSuccess;
#else
  (void)bytes;
  (void)pageBytes;
  return hipErrorNotSupported;
#endif
#else
  const detail::CudaDmabufEntryPoints& eps = detail::CudaDmabuf();
  if (eps.getAddressRange == nullptr || eps.getHandle == nullptr) return cudaErrorNotSupported;
  CUdeviceptr base = 0;
  size_t allocBytes = 0;
  CUresult r = eps.getAddressRange(&base, &allocBytes, reinterpret_cast<CUdeviceptr>(ptr));
  if (r != CUDA_SUCCESS) {
    if (driverError != nullptr) *driverError = static_cast<int>(r);
    return cudaErrorInvalidValue;
  }
  const size_t exportBytes = (allocBytes + pageBytes - 1) / pageBytes * pageBytes;
  int handle = -1;
  r = eps.getHandle(&handle, base, exportBytes, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
  if (r != CUDA_SUCCESS) {
    if (driverError != nullptr) *driverError = static_cast<int>(r);
    return r == CUDA_ERROR_NOT_SUPPORTED ? cudaErrorNotSupported : cudaErrorInvalidValue;
  }
  *fd = handle;
  *offset = reinterpret_cast<uintptr_t>(ptr) - static_cast<uintptr_t>(base);
  return cudaSuccess;
#endif
}

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

#if defined(__CUDACC__) || defined(__HIPCC__)

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
// finished: once every block of that kernel has exited. It must call GridDependencyWait() before
// it touches anything an earlier kernel on the stream writes; the wait returns when those kernels
// have completed and their memory is visible. What is gained is the launch latency, overlapped
// with the previous kernel's completion. Elsewhere (HIP, older NVIDIA GPUs, a plain launch) the
// wait does nothing and the launch is an ordinary one.
// ---------------------------------------------------------------------------------------------
MORI_DEVICE_INLINE void GridDependencyWait() {
#if MORI_CUDA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
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

// kernel<<<grid, block, smem, stream>>>(args...), as a programmatic dependent launch when
// `programmatic` (see GridDependencyWait; callers pass true only where
// GpuHasProgrammaticLaunch and GpuKernelHasGridDependency hold). Returns the launch's status.
template <typename... Params, typename... Args>
inline gpuError_t GpuLaunchKernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                                  gpuStream_t stream, bool programmatic, Args&&... args) {
#if MORI_HIP
  (void)programmatic;
  hipLaunchKernelGGL(kernel, grid, block, smem, stream, static_cast<Args&&>(args)...);
  return hipGetLastError();
#else
  cudaLaunchAttribute attr[1] = {};
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = programmatic ? 1 : 0;
  const cudaError_t launched = cudaLaunchKernelEx(&cfg, kernel, static_cast<Args&&>(args)...);
  const cudaError_t last = cudaGetLastError();  // consumed here, as MORI_CHECK_LAUNCH would
  return launched != cudaSuccess ? launched : last;
#endif
}

// Whether `kernel`'s code for this device was compiled for a target with the grid-dependency
// instructions (NVIDIA PTX ISA target sm_90+): only then does its GridDependencyWait wait, and
// only then may it be launched programmatically.
template <typename... Params>
inline bool GpuKernelHasGridDependency(void (*kernel)(Params...)) {
#if MORI_HIP
  (void)kernel;
  return false;
#else
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(kernel)) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attr.ptxVersion >= 90;
#endif
}

#endif  // __CUDACC__ || __HIPCC__

}  // namespace mori::core

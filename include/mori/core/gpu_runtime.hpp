// Host side of the portability layer: the GPU runtime's API under gpu* names, runtime errors and
// streams, host-side platform facts, coherent allocation, device memory ranges for dma-buf export
// and the kernel launch helpers. Host code that needs only the runtime includes this header;
// kernels include core/gpu.hpp. Callers never test the platform themselves.
//
// Backend selection: MORI_BACKEND_HIP / MORI_BACKEND_CUDA come from the build
// (cmake/MoriGpu.cmake); a HIP compiler also implies HIP.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "mori/core/host_device.hpp"

#if defined(MORI_BACKEND_HIP) || defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
#define MORI_HIP 1
#include <hip/hip_fp16.h>
#include <hip/hip_runtime.h>
#else
#define MORI_CUDA 1
#include <cuda.h>  // driver API types only (entry points come through cudart)
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#endif

// The profiler range API (see "Profiler ranges" below), only in the unit that asks for it.
#if defined(MORI_GPU_PROFILER_RANGE_API)
#if MORI_HIP
#include <dlfcn.h>
#else
#include <nvtx3/nvToolsExt.h>
#endif
#endif

// ---------------------------------------------------------------------------------------------
// Runtime API names
// ---------------------------------------------------------------------------------------------
// MORI_GPU_RUNTIME_LIBRARY: the name of the runtime's shared library without ".so" (its file is
// <name>.so*).
#if MORI_HIP
#define MORI_GPU_NAME(x) hip##x
#define MORI_GPU_PLATFORM_NAME "HIP"
#define MORI_GPU_RUNTIME_LIBRARY "libamdhip64"
#else
#define MORI_GPU_NAME(x) cuda##x
#define MORI_GPU_PLATFORM_NAME "CUDA"
#define MORI_GPU_RUNTIME_LIBRARY "libcudart"
#endif

using gpuError_t = MORI_GPU_NAME(Error_t);
using gpuStream_t = MORI_GPU_NAME(Stream_t);
using gpuEvent_t = MORI_GPU_NAME(Event_t);
using gpuIpcMemHandle_t = MORI_GPU_NAME(IpcMemHandle_t);
using gpuGraph_t = MORI_GPU_NAME(Graph_t);
using gpuGraphExec_t = MORI_GPU_NAME(GraphExec_t);
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
#define gpuErrorInvalidValue MORI_GPU_NAME(ErrorInvalidValue)
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
#define gpuStreamIsCapturing MORI_GPU_NAME(StreamIsCapturing)
#define gpuStreamCaptureStatus MORI_GPU_NAME(StreamCaptureStatus)
#define gpuStreamCaptureStatusNone MORI_GPU_NAME(StreamCaptureStatusNone)
#define gpuThreadExchangeStreamCaptureMode MORI_GPU_NAME(ThreadExchangeStreamCaptureMode)
#define gpuStreamCaptureMode MORI_GPU_NAME(StreamCaptureMode)
#define gpuStreamCaptureModeRelaxed MORI_GPU_NAME(StreamCaptureModeRelaxed)
#define gpuStreamCaptureModeThreadLocal MORI_GPU_NAME(StreamCaptureModeThreadLocal)
#define gpuStreamBeginCapture MORI_GPU_NAME(StreamBeginCapture)
#define gpuStreamEndCapture MORI_GPU_NAME(StreamEndCapture)
#define gpuGraphInstantiateWithFlags MORI_GPU_NAME(GraphInstantiateWithFlags)
#define gpuGraphLaunch MORI_GPU_NAME(GraphLaunch)
#define gpuGraphExecDestroy MORI_GPU_NAME(GraphExecDestroy)
#define gpuGraphDestroy MORI_GPU_NAME(GraphDestroy)
#define gpuEventCreate MORI_GPU_NAME(EventCreate)
#define gpuEventCreateWithFlags MORI_GPU_NAME(EventCreateWithFlags)
#define gpuEventDisableTiming MORI_GPU_NAME(EventDisableTiming)
#define gpuEventDestroy MORI_GPU_NAME(EventDestroy)
#define gpuEventRecord MORI_GPU_NAME(EventRecord)
#define gpuStreamWaitEvent MORI_GPU_NAME(StreamWaitEvent)
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

// NVIDIA sm_90 (Hopper) or later: the devices with bulk asynchronous copies (kHasBulkAsyncCopy)
// and programmatic dependent launches (GpuLaunchKernel). A kernel must also have been built for
// sm_90+ to use them (kHasBulkAsyncCopy, GpuKernelHasGridDependency).
inline bool GpuIsNvidiaSm90OrLater(const gpuDeviceProp_t& p) {
  return !kPlatformHip && p.major >= 9;
}

// The most shared memory one block may have (CUDA: with the opt-in attribute set).
inline size_t GpuMaxSharedMemPerBlock(const gpuDeviceProp_t& p) {
#if MORI_HIP
  return p.sharedMemPerBlock;
#else
  return p.sharedMemPerBlockOptin;
#endif
}

// Whether kernels on this device can use the bulk copies of kHasBulkAsyncCopy.
// *smemOptinBytes: the dynamic shared memory a block may opt in to (0 where unused).
inline bool GpuHasBulkAsyncCopy(const gpuDeviceProp_t& p, size_t* smemOptinBytes) {
#if MORI_HIP
  *smemOptinBytes = 0;
#else
  *smemOptinBytes = GpuMaxSharedMemPerBlock(p);
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

// Device memory whose atomics and stores are coherent with peer GPUs mapping it over P2P
// (AMD needs fine-grained memory for that; on NVIDIA ordinary device memory already is).
inline gpuError_t GpuMallocCoherent(void** ptr, size_t bytes) {
#if MORI_HIP
  return hipExtMallocWithFlags(ptr, bytes, hipDeviceMallocFinegrained);
#else
  return cudaMalloc(ptr, bytes);
#endif
}

// ---------------------------------------------------------------------------------------------
// Device memory ranges, for dma-buf export (application/rdma/gpu_dmabuf.hpp). Host only. On CUDA
// both are driver calls reached through cudart (mori links cudart only; libcuda is loaded by it
// at run time): a failed driver call returns a runtime error and puts its CUresult into
// *driverError when given. Both return gpuErrorNotSupported where this runtime cannot export
// dma-bufs: a CUDA driver without the entry points, HIP before 6.2 (no
// hipMemGetHandleForAddressRange).
// ---------------------------------------------------------------------------------------------
#if MORI_CUDA
namespace detail {
struct CudaDmabufEntryPoints {
  CUresult (*getAddressRange)(CUdeviceptr* base, size_t* size, CUdeviceptr ptr) = nullptr;
  CUresult (*getHandle)(void* handle, CUdeviceptr ptr, size_t size, CUmemRangeHandleType type,
                        unsigned long long flags) = nullptr;
};
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

// The base and size of the device allocation that contains `ptr`.
inline gpuError_t GpuMemGetAllocationRange(void* ptr, void** base, size_t* bytes,
                                           int* driverError = nullptr) {
  if (driverError != nullptr) *driverError = 0;
#if MORI_HIP
#if defined(HIP_VERSION) && HIP_VERSION >= 60200000
  return hipMemGetAddressRange(base, bytes, ptr);
#else
  (void)ptr;
  (void)base;
  (void)bytes;
  return hipErrorNotSupported;
#endif
#else
  const detail::CudaDmabufEntryPoints& eps = detail::CudaDmabuf();
  if (eps.getAddressRange == nullptr || eps.getHandle == nullptr) return cudaErrorNotSupported;
  CUdeviceptr b = 0;
  const CUresult r = eps.getAddressRange(&b, bytes, reinterpret_cast<CUdeviceptr>(ptr));
  if (r != CUDA_SUCCESS) {
    if (driverError != nullptr) *driverError = static_cast<int>(r);
    return cudaErrorInvalidValue;
  }
  *base = reinterpret_cast<void*>(b);
  return cudaSuccess;
#endif
}

// A dma-buf file descriptor (the caller closes it) for the device range [base, base + bytes),
// which must lie in one allocation and be whole pages.
inline gpuError_t GpuMemGetDmabufFd(void* base, size_t bytes, int* fd, int* driverError = nullptr) {
  if (driverError != nullptr) *driverError = 0;
#if MORI_HIP
#if defined(HIP_VERSION) && HIP_VERSION >= 60200000
  return hipMemGetHandleForAddressRange(fd, base, bytes, hipMemRangeHandleTypeDmaBufFd, 0);
#else
  (void)base;
  (void)bytes;
  (void)fd;
  return hipErrorNotSupported;
#endif
#else
  const detail::CudaDmabufEntryPoints& eps = detail::CudaDmabuf();
  if (eps.getHandle == nullptr) return cudaErrorNotSupported;
  const CUresult r = eps.getHandle(fd, reinterpret_cast<CUdeviceptr>(base), bytes,
                                   CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
  if (r != CUDA_SUCCESS) {
    if (driverError != nullptr) *driverError = static_cast<int>(r);
    return r == CUDA_ERROR_NOT_SUPPORTED ? cudaErrorNotSupported : cudaErrorInvalidValue;
  }
  return cudaSuccess;
#endif
}

// ---------------------------------------------------------------------------------------------
// Profiler ranges: the platform's timeline annotations under one set of names. Host only, and
// only where MORI_GPU_PROFILER_RANGE_API is defined before this header is included (by
// core/profiler_range.cpp, whose ScopedProfilerRange is what the rest of mori uses), so that no
// other unit pulls in the NVTX headers.
//   CUDA: NVTX v3, header-only: a tool such as Nsight Systems injects its library through
//         NVTX_INJECTION64_PATH; without one every call is a no-op. Ranges go to the domain "mori".
//   HIP:  roctx, opened with dlopen by GpuProfilerRangeOpen, so libmori loads without it.
// The caller serialises GpuProfilerRangeOpen and pushes or pops only after it returned true; a
// range is popped on the thread that pushed it.
// ---------------------------------------------------------------------------------------------
#if defined(MORI_GPU_PROFILER_RANGE_API)
// The API's name, for messages.
constexpr const char* kGpuProfilerRangeApiName = kPlatformHip ? "roctx" : "NVTX";

namespace detail {
struct GpuProfilerRangeApi {
#if MORI_HIP
  int (*push)(const char* message) = nullptr;
  int (*pop)() = nullptr;
#else
  nvtxDomainHandle_t domain = nullptr;
#endif
};
// Trivially destructible, so ranges still work while static objects are destroyed at exit.
inline GpuProfilerRangeApi& GpuProfilerRanges() {
  static GpuProfilerRangeApi api;
  return api;
}
}  // namespace detail

// Makes the API ready. False, with the reason in *why, where this platform's profiler library is
// missing (HIP: no libroctx64 to open); pushes and pops are then not allowed.
inline bool GpuProfilerRangeOpen(std::string* why) {
  detail::GpuProfilerRangeApi& api = detail::GpuProfilerRanges();
#if MORI_HIP
  // roctracer's library, then the rocprofiler-sdk one that exports the same two entry points.
  const char* const libraries[] = {"libroctx64.so", "libroctx64.so.4",
                                   "librocprofiler-sdk-roctx.so"};
  why->clear();
  for (const char* library : libraries) {
    void* handle = dlopen(library, RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* error = dlerror();
      *why += std::string(why->empty() ? "" : "; ") + (error != nullptr ? error : library);
      continue;
    }
    api.push = reinterpret_cast<int (*)(const char*)>(dlsym(handle, "roctxRangePushA"));
    api.pop = reinterpret_cast<int (*)()>(dlsym(handle, "roctxRangePop"));
    if (api.push != nullptr && api.pop != nullptr) return true;  // kept open for the process
    *why += std::string(why->empty() ? "" : "; ") + library + ": no roctxRangePushA/roctxRangePop";
    api.push = nullptr;
    api.pop = nullptr;
    dlclose(handle);
  }
  return false;
#else
  why->clear();
  api.domain = nvtxDomainCreateA("mori");
  return true;
#endif
}

// Opens a range named `name` on this thread (the tool copies the name).
inline void GpuProfilerRangePush(const char* name) {
#if MORI_HIP
  (void)detail::GpuProfilerRanges().push(name);
#else
  nvtxEventAttributes_t attr = {};
  attr.version = NVTX_VERSION;
  attr.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
  attr.messageType = NVTX_MESSAGE_TYPE_ASCII;
  attr.message.ascii = name;
  (void)nvtxDomainRangePushEx(detail::GpuProfilerRanges().domain, &attr);
#endif
}

// Closes this thread's innermost range.
inline void GpuProfilerRangePop() {
#if MORI_HIP
  (void)detail::GpuProfilerRanges().pop();
#else
  (void)nvtxDomainRangePop(detail::GpuProfilerRanges().domain);
#endif
}
#endif  // MORI_GPU_PROFILER_RANGE_API

#if MORI_GPU_COMPILER

// ---------------------------------------------------------------------------------------------
// Kernel launches.
// ---------------------------------------------------------------------------------------------
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

#endif  // MORI_GPU_COMPILER

}  // namespace mori::core

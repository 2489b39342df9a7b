// Compilation-mode macros for code compiled for both host and device, in headers shared by
// host-only and GPU translation units (wire formats, the posting protocol, buffer layouts).
// Besides core/gpu_runtime.hpp and core/gpu_device.hpp this is the only place that tests the
// compiler; it includes no GPU runtime header, so host-only code and host tests can use it.
//   MORI_GPU_COMPILER  1 when nvcc or a HIP compiler compiles the unit (host or device pass)
//   MORI_DEVICE_PASS   1 in the device pass of such a compiler
//   MORI_HD            __host__ __device__ under a GPU compiler, nothing otherwise
//   MORI_HD_INLINE     MORI_HD inline: a function defined in a header for host and device
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define MORI_GPU_COMPILER 1
#define MORI_HD __host__ __device__
#else
#define MORI_GPU_COMPILER 0
#define MORI_HD
#endif

#define MORI_HD_INLINE MORI_HD inline

#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
#define MORI_DEVICE_PASS 1
#else
#define MORI_DEVICE_PASS 0
#endif

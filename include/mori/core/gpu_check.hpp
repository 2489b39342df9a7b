// Checked GPU runtime calls: a failure raises GpuRuntimeError carrying file:line and the call.
#pragma once

#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"

#define MORI_CHECK_GPU(call)                                                                \
  do {                                                                                      \
    gpuError_t moriErr_ = (call);                                                           \
    if (moriErr_ != gpuSuccess) {                                                           \
      (void)gpuGetLastError(); /* clear a non-sticky error so the process stays usable */   \
      MORI_THROW(GpuRuntimeError, "%s failed: %s (%s)", #call, gpuGetErrorString(moriErr_), \
                 gpuGetErrorName(moriErr_));                                                \
    }                                                                                       \
  } while (0)

// After a kernel launch: launch-configuration errors surface here.
#define MORI_CHECK_LAUNCH() MORI_CHECK_GPU(gpuGetLastError())

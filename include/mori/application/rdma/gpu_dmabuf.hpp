// dma-buf export of device memory for RDMA registration (ibv_reg_dmabuf_mr). Host only.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mori/core/gpu_runtime.hpp"

namespace mori::application {

// Exports the whole allocation that contains [ptr, ptr + bytes) (its size rounded up to
// `pageBytes`) and returns the fd in *fd (the caller closes it) and the offset of ptr inside the
// exported range in *offset: what ibv_reg_dmabuf_mr takes as `offset` (registering a
// sub-allocation with offset 0 maps the wrong pages). gpuErrorNotSupported when this runtime
// cannot export (core::GpuMemGetDmabufFd); on CUDA *driverError (if given) receives the CUresult
// of a failed driver call.
gpuError_t GpuExportDmabuf(void* ptr, size_t bytes, size_t pageBytes, int* fd, uint64_t* offset,
                           int* driverError = nullptr);

}  // namespace mori::application

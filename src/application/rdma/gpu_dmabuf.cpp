#include "mori/application/rdma/gpu_dmabuf.hpp"

namespace mori::application {

gpuError_t GpuExportDmabuf(void* ptr, size_t bytes, size_t pageBytes, int* fd, uint64_t* offset,
                           int* driverError) {
  if (driverError != nullptr) *driverError = 0;
  *fd = -1;
  *offset = 0;
  if (ptr == nullptr || bytes == 0 || pageBytes == 0) return gpuErrorInvalidValue;
  void* base = nullptr;
  size_t allocBytes = 0;
  gpuError_t e = core::GpuMemGetAllocationRange(ptr, &base, &allocBytes, driverError);
  if (e != gpuSuccess) return e;
  const size_t exportBytes = (allocBytes + pageBytes - 1) / pageBytes * pageBytes;
  int handle = -1;
  e = core::GpuMemGetDmabufFd(base, exportBytes, &handle, driverError);
  if (e != gpuSuccess) return e;
  *fd = handle;
  *offset = reinterpret_cast<uintptr_t>(ptr) - reinterpret_cast<uintptr_t>(base);
  return gpuSuccess;
}

}  // namespace mori::application

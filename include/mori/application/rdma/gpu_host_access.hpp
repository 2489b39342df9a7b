// What the verbs transport needs from the GPU runtime, behind an interface so that everything
// else (verbs, mlx5, bootstrap exchanges, endpoint wiring, the doorbell proxy) is host C++ that
// runs and is tested on machines without a GPU: the runtime implementation lives in
// src/application/rdma/verbs_transport.cpp (gpu.hpp), tests use an identity mapping.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace mori::application {

class GpuHostAccess {
 public:
  virtual ~GpuHostAccess() = default;
  // Registers the page-aligned host range [base, base + bytes) for device access, mapped
  // (gpuHostRegister with the mapped flag; `io`: memory-mapped I/O such as a UAR page). Returns
  // false with the runtime's reason in *why.
  virtual bool RegisterHost(void* base, size_t bytes, bool io, std::string* why) = 0;
  virtual void UnregisterHost(void* base) noexcept = 0;
  // Device address of registered or mapped-allocated host memory; false with *why on failure.
  virtual bool DevicePointer(void* host, void** device, std::string* why) = 0;
  // Zeroed pinned host memory mapped for the device; throws GpuRuntimeError.
  virtual void* AllocMappedHost(size_t bytes) = 0;
  virtual void FreeMappedHost(void* host) noexcept = 0;
  // dma-buf of the device range (see GpuExportDmabuf in gpu_dmabuf.hpp). False with *why when
  // unsupported.
  virtual bool ExportDmabuf(void* ptr, size_t bytes, int* fd, uint64_t* offset,
                            std::string* why) = 0;
};

// Page-granular registration of provider-owned host memory for the GPU. Pages shared by several
// objects (doorbell records of many QPs and CQs live in one page; several QPs share a UAR page)
// are registered once; runs of unregistered pages are registered in one call each. Releases
// everything in reverse order (ReleaseAll, destructor). Not thread-safe.
class GpuHostRegistry {
 public:
  GpuHostRegistry(GpuHostAccess& gpu, size_t pageBytes);
  ~GpuHostRegistry() { ReleaseAll(); }
  GpuHostRegistry(const GpuHostRegistry&) = delete;
  GpuHostRegistry& operator=(const GpuHostRegistry&) = delete;

  // Device address of host [p, p + bytes), registering its pages as needed. Null with *why when
  // the runtime refuses (registration or device pointer) or the device addresses of the range
  // are not contiguous. A page already registered with the other `io` kind is refused too.
  void* TryMap(void* p, size_t bytes, bool io, std::string* why);
  // Same, raising GpuRuntimeError "<what>: <why>".
  void* Map(void* p, size_t bytes, bool io, const char* what);
  void ReleaseAll() noexcept;
  size_t Registrations() const { return runs.size(); }

 private:
  struct Run {
    uintptr_t base;
    size_t bytes;
    bool io;
  };
  const Run* FindPage(uintptr_t page) const;

  GpuHostAccess& gpu;
  size_t pageBytes;
  std::vector<Run> runs;
};

}  // namespace mori::application

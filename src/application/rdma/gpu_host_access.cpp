#include "mori/application/rdma/gpu_host_access.hpp"

#include "mori/core/errors.hpp"
#include "mori/core/logging.hpp"

namespace mori::application {

GpuHostRegistry::GpuHostRegistry(GpuHostAccess& g, size_t page) : gpu(g), pageBytes(page) {
  MORI_ENSURE(page > 0 && (page & (page - 1)) == 0, InvalidUsageError,
              "GpuHostRegistry: page size %zu is not a power of two", page);
}

const GpuHostRegistry::Run* GpuHostRegistry::FindPage(uintptr_t page) const {
  for (const Run& r : runs) {
    if (page >= r.base && page - r.base < r.bytes) return &r;
  }
  return nullptr;
}

void* GpuHostRegistry::TryMap(void* p, size_t bytes, bool io, std::string* why) {
  if (p == nullptr || bytes == 0) {
    *why = "empty range";
    return nullptr;
  }
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t lo = a & ~(pageBytes - 1);
  const uintptr_t hi = (a + bytes + pageBytes - 1) & ~(pageBytes - 1);
  uintptr_t page = lo;
  while (page < hi) {
    if (const Run* r = FindPage(page)) {
      if (r->io != io) {
        *why = core::StrFormat("page %p is already registered as %s memory",
                               reinterpret_cast<void*>(page), r->io ? "I/O" : "ordinary");
        return nullptr;
      }
      page += pageBytes;
      continue;
    }
    uintptr_t end = page + pageBytes;
    while (end < hi && FindPage(end) == nullptr) end += pageBytes;
    std::string reason;
    if (!gpu.RegisterHost(reinterpret_cast<void*>(page), end - page, io, &reason)) {
      *why = core::StrFormat("registering %p (+%zu)%s failed: %s", reinterpret_cast<void*>(page),
                             static_cast<size_t>(end - page), io ? " as I/O memory" : "",
                             reason.c_str());
      return nullptr;
    }
    runs.push_back({page, end - page, io});
    page = end;
  }
  void* first = nullptr;
  void* last = nullptr;
  std::string reason;
  if (!gpu.DevicePointer(p, &first, &reason) ||
      !gpu.DevicePointer(static_cast<char*>(p) + bytes - 1, &last, &reason)) {
    *why = "no device pointer for " + core::StrFormat("%p", p) + ": " + reason;
    return nullptr;
  }
  if (reinterpret_cast<uintptr_t>(last) - reinterpret_cast<uintptr_t>(first) != bytes - 1) {
    *why = core::StrFormat("device addresses of %p (+%zu) are not contiguous (%p .. %p)", p, bytes,
                           first, last);
    return nullptr;
  }
  return first;
}

void* GpuHostRegistry::Map(void* p, size_t bytes, bool io, const char* what) {
  std::string why;
  void* d = TryMap(p, bytes, io, &why);
  if (d == nullptr) MORI_THROW(GpuRuntimeError, "%s: %s", what, why.c_str());
  return d;
}

void GpuHostRegistry::ReleaseAll() noexcept {
  while (!runs.empty()) {
    gpu.UnregisterHost(reinterpret_cast<void*>(runs.back().base));
    runs.pop_back();
  }
}

}  // namespace mori::application

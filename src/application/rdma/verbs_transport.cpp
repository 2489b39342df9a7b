// CreateVerbsRdmaTransport: the GPU-runtime side of the verbs transport. Everything else is host
// C++ in verbs_transport_core.cpp (tested on machines without a GPU or NIC); this file only
// supplies the GPU runtime (GpuHostAccess over gpu.hpp), the GPU's PCI bus id, the env settings
// and the process-wide libibverbs/libmlx5 tables.
#include "mori/application/rdma/verbs_transport.hpp"

#include <unistd.h>

#include <cstring>

#include "mori/application/rdma/gpu_dmabuf.hpp"
#include "mori/application/rdma/ibverbs_loader.hpp"
#include "mori/application/rdma/mlx5dv_queue.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_check.hpp"
#include "mori/core/logging.hpp"

namespace mori::application {
namespace {

std::string GpuErrorText(gpuError_t e) {
  return core::StrFormat("%s (%s)", gpuGetErrorString(e), gpuGetErrorName(e));
}

class RuntimeGpuHostAccess final : public GpuHostAccess {
 public:
  bool RegisterHost(void* base, size_t bytes, bool io, std::string* why) override {
    unsigned int flags = gpuHostRegisterMapped | gpuHostRegisterPortable;
    if (io) flags |= gpuHostRegisterIoMemory;
    gpuError_t e = gpuHostRegister(base, bytes, flags);
    if (e != gpuSuccess) {
      (void)gpuGetLastError();
      *why = std::string(io ? "gpuHostRegister(IoMemory|Mapped): " : "gpuHostRegister(Mapped): ") +
             GpuErrorText(e);
      return false;
    }
    return true;
  }
  void UnregisterHost(void* base) noexcept override {
    gpuError_t e = gpuHostUnregister(base);
    if (e != gpuSuccess) {
      (void)gpuGetLastError();
      MORI_WARN(kLogRdma, "gpuHostUnregister(%p): %s", base, GpuErrorText(e).c_str());
    }
  }
  bool DevicePointer(void* host, void** device, std::string* why) override {
    gpuError_t e = gpuHostGetDevicePointer(device, host, 0);
    if (e != gpuSuccess) {
      (void)gpuGetLastError();
      *why = "gpuHostGetDevicePointer: " + GpuErrorText(e);
      return false;
    }
    return true;
  }
  void* AllocMappedHost(size_t bytes) override {
    void* p = nullptr;
    MORI_CHECK_GPU(gpuHostAlloc(&p, bytes, gpuHostAllocMapped | gpuHostAllocPortable));
    std::memset(p, 0, bytes);
    return p;
  }
  void FreeMappedHost(void* p) noexcept override {
    gpuError_t e = gpuFreeHost(p);
    if (e != gpuSuccess) {
      (void)gpuGetLastError();
      MORI_WARN(kLogRdma, "gpuFreeHost(%p): %s", p, GpuErrorText(e).c_str());
    }
  }
  bool ExportDmabuf(void* ptr, size_t bytes, int* fd, uint64_t* offset, std::string* why) override {
    const long page = sysconf(_SC_PAGESIZE);
    int driverError = 0;
    gpuError_t e = GpuExportDmabuf(ptr, bytes, page > 0 ? static_cast<size_t>(page) : 4096, fd,
                                   offset, &driverError);
    if (e != gpuSuccess) {
      (void)gpuGetLastError();
      *why = "dma-buf export: " + GpuErrorText(e) +
             (driverError != 0 ? core::StrFormat(" (driver error %d)", driverError) : "");
      return false;
    }
    return true;
  }
};

}  // namespace

std::unique_ptr<RdmaTransport> CreateVerbsRdmaTransport(BootstrapNetwork& boot,
                                                        const Context& context,
                                                        const SymmetricHeap& heap,
                                                        const RdmaTransportConfig& config) {
  VerbsTransportSetup setup;
  setup.rank = context.Rank();
  setup.worldSize = context.WorldSize();
  setup.transports = context.Transports();
  setup.heapBase = heap.Base();
  setup.heapSize = heap.Size();
  setup.config = config;
  int device = 0;
  char bus[64] = {};
  MORI_CHECK_GPU(gpuGetDevice(&device));
  MORI_CHECK_GPU(gpuDeviceGetPCIBusId(bus, sizeof(bus), device));
  setup.gpuPciBusId = bus;
  const core::EnvValues& env = core::Env();
  setup.doorbell = ParseRdmaDoorbellPolicy(env.rdmaDoorbell);
  setup.deviceFilter = env.rdmaDevices;
  VerbsLibraries libs;
  libs.verbs = Ibverbs(&libs.verbsWhy);
  libs.mlx5 = Mlx5dv(&libs.mlx5Why);
  return CreateVerbsRdmaTransportWith(boot, setup, libs, std::make_unique<RuntimeGpuHostAccess>());
}

}  // namespace mori::application

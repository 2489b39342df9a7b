#include "mori/application/memory/symmetric_heap.hpp"

#include <cstring>

#include "mori/core/gpu_check.hpp"
#include "mori/core/logging.hpp"

namespace mori::application {

static_assert(sizeof(gpuIpcMemHandle_t) == SymmetricHeap::kIpcHandleBytes,
              "SymmetricHeap keeps IPC handles as kIpcHandleBytes raw bytes");

SymmetricHeap::SymmetricHeap(BootstrapNetwork& boot, const Context& context, uint64_t bytes)
    : size(bytes), allocator(bytes) {
  const int worldSize = boot.WorldSize();
  MORI_ENSURE(bytes >= 4096, InvalidUsageError,
              "symmetric heap size %llu is too small (MORI_SHMEM_HEAP_SIZE)",
              static_cast<unsigned long long>(bytes));
  // Every PE must use the same size, or offsets would not be symmetric.
  std::vector<uint64_t> sizes(worldSize);
  boot.Allgather(&bytes, sizes.data(), sizeof(uint64_t));
  for (int pe = 0; pe < worldSize; pe++)
    MORI_ENSURE(sizes[pe] == bytes, InvalidUsageError,
                "MORI_SHMEM_HEAP_SIZE differs between PEs: rank %d has %llu, rank %d has %llu",
                boot.Rank(), static_cast<unsigned long long>(bytes), pe,
                static_cast<unsigned long long>(sizes[pe]));

  gpuError_t err = core::GpuMallocCoherent(&base, bytes);
  if (err != gpuSuccess) {
    (void)gpuGetLastError();
    size_t freeB = 0, totalB = 0;
    (void)gpuMemGetInfo(&freeB, &totalB);
    MORI_THROW(GpuRuntimeError,
               "cannot allocate the symmetric heap of %llu bytes (%s); the GPU has %zu of %zu "
               "bytes free; lower MORI_SHMEM_HEAP_SIZE",
               static_cast<unsigned long long>(bytes), gpuGetErrorString(err), freeB, totalB);
  }
  try {
    MORI_CHECK_GPU(gpuMemset(base, 0, bytes));
    gpuIpcMemHandle_t mine;
    std::memset(&mine, 0, sizeof(mine));
    MORI_CHECK_GPU(gpuIpcGetMemHandle(&mine, base));
    std::vector<gpuIpcMemHandle_t> handles(worldSize);
    boot.Allgather(&mine, handles.data(), sizeof(gpuIpcMemHandle_t));
    ipcHandles.resize(static_cast<size_t>(worldSize) * kIpcHandleBytes);
    std::memcpy(ipcHandles.data(), handles.data(), ipcHandles.size());

    peerBases.assign(worldSize, 0);
    for (int pe = 0; pe < worldSize; pe++) {
      if (pe == boot.Rank()) {
        peerBases[pe] = reinterpret_cast<uintptr_t>(base);
        continue;
      }
      if (context.Transport(pe) != TransportType::kP2P) continue;
      void* mapped = nullptr;
      MORI_CHECK_GPU(gpuIpcOpenMemHandle(&mapped, handles[pe], gpuIpcMemLazyEnablePeerAccess));
      openedHandles.push_back(mapped);
      peerBases[pe] = reinterpret_cast<uintptr_t>(mapped);
    }
    MORI_CHECK_GPU(gpuDeviceSynchronize());
  } catch (...) {
    Release();
    throw;
  }
  MORI_INFO(kLogMem, "symmetric heap: %llu bytes at %p, %zu peers mapped",
            static_cast<unsigned long long>(bytes), base, openedHandles.size());
}

void SymmetricHeap::CloseMappings() {
  for (void* p : openedHandles) {
    gpuError_t e = gpuIpcCloseMemHandle(p);
    if (e != gpuSuccess)
      MORI_WARN(kLogMem, "closing IPC mapping %p failed: %s", p, gpuGetErrorString(e));
  }
  openedHandles.clear();
  for (size_t pe = 0; pe < peerBases.size(); pe++) {
    if (peerBases[pe] != reinterpret_cast<uintptr_t>(base)) peerBases[pe] = 0;
  }
}

void SymmetricHeap::Release() {
  CloseMappings();
  if (base != nullptr) {
    gpuError_t e = gpuFree(base);
    if (e != gpuSuccess)
      MORI_WARN(kLogMem, "freeing the symmetric heap failed: %s", gpuGetErrorString(e));
    base = nullptr;
  }
}

SymmetricHeap::~SymmetricHeap() { Release(); }

}  // namespace mori::application

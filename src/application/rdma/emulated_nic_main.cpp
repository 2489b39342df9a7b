// mori-emulated-nic: the NIC process of one PE under MORI_RDMA_EMULATE (emulated_nic.hpp).
//
// The PE's emulated transport starts it with the connection on kEmuNicConnFd and the shared ring
// memory on kEmuNicRingFd. It opens the heaps and buffers it serves through IPC handles and moves
// data with its own GPU context: copies on one stream (between two GPUs a copy engine moves them;
// within one GPU a copy kernel), 8-byte atomics with a one-thread kernel (system-scope atomics, as
// the GPUs' own). Its calls never wait for the PE's process: that process's runtime locks, launch
// queues, hardware work queues and synchronisations belong to another context. It serves until the
// PE stops it, the connection closes, or the process that started it is gone.
#include <dirent.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "mori/application/rdma/emulated_nic.hpp"
#include "mori/core/env.hpp"
#include "mori/core/gpu_check.hpp"
#include "mori/core/logging.hpp"

namespace {

using namespace mori;
using application::EmuMemoryAccessor;
using application::EmuNicMemory;

enum EmuAtomicOp : int { kEmuFetchAdd = 0, kEmuCompareSwap = 1 };

__global__ void EmuAtomicKernel(uint64_t* target, uint64_t swapAdd, uint64_t compare, int op,
                                uint64_t* old) {
  const uint64_t v = op == kEmuFetchAdd ? core::AtomicFetchAddSystem(target, swapAdd)
                                        : core::AtomicCasSystem(target, compare, swapAdd);
  core::AtomicStoreRelaxedSystem(old, v);
}

// Copies and atomics on one high-priority stream; Flush() waits for it, bounded, before the
// emulator publishes a completion, so a CQE means the data is in place.
class GpuMemoryAccessor : public EmuMemoryAccessor {
 public:
  GpuMemoryAccessor(int device, int64_t timeoutMs) : device(device), timeoutMs(timeoutMs) {
    MORI_CHECK_GPU(gpuSetDevice(device));
    int least = 0, greatest = 0;
    MORI_CHECK_GPU(gpuDeviceGetStreamPriorityRange(&least, &greatest));
    MORI_CHECK_GPU(gpuStreamCreateWithPriority(&stream, gpuStreamNonBlocking, greatest));
    void* p = nullptr;
    MORI_CHECK_GPU(gpuHostAlloc(&p, sizeof(uint64_t), gpuHostAllocMapped));
    oldHost = static_cast<uint64_t*>(p);
    void* d = nullptr;
    MORI_CHECK_GPU(gpuHostGetDevicePointer(&d, p, 0));
    oldDev = static_cast<uint64_t*>(d);
  }
  ~GpuMemoryAccessor() override {
    (void)gpuSetDevice(device);
    try {
      Wait("the last copies and atomics");
    } catch (const std::exception& e) {
      // A kernel holds every SM the atomic or copy kernel could use: leave the stream.
      MORI_WARN(kLogRdma, "emulated NIC: %s; its stream is not destroyed", e.what());
      return;
    }
    (void)gpuStreamDestroy(stream);
    (void)gpuFreeHost(oldHost);
  }

  void Copy(void* dst, const void* src, size_t bytes) override {
    Bind();
    lastDst = dst;
    lastSrc = src;
    lastBytes = bytes;
    MORI_CHECK_GPU(gpuMemcpyAsync(dst, src, bytes, gpuMemcpyDefault, stream));
  }
  uint64_t FetchAdd64(void* target, uint64_t add) override {
    return Atomic(target, add, 0, kEmuFetchAdd);
  }
  uint64_t CompareSwap64(void* target, uint64_t expected, uint64_t desired) override {
    return Atomic(target, desired, expected, kEmuCompareSwap);
  }
  void Flush() override {
    Bind();
    Wait("a copy", true);
  }

 private:
  void Bind() {
    thread_local int bound = -1;  // the emulator's worker is not the thread that made this
    if (bound != device) {
      MORI_CHECK_GPU(gpuSetDevice(device));
      bound = device;
    }
  }
  uint64_t Atomic(void* target, uint64_t swapAdd, uint64_t compare, int op) {
    Bind();
    *reinterpret_cast<volatile uint64_t*>(oldHost) = ~0ull;
    EmuAtomicKernel<<<1, 1, 0, stream>>>(static_cast<uint64_t*>(target), swapAdd, compare, op,
                                         oldDev);
    MORI_CHECK_LAUNCH();
    Wait("an atomic (a one-thread kernel: it needs an SM of this GPU)");
    return *reinterpret_cast<volatile uint64_t*>(oldHost);
  }
  static int DeviceOf(const void* p) {
    gpuPointerAttributes_t attr{};
    if (gpuPointerGetAttributes(&attr, p) != gpuSuccess) {
      (void)gpuGetLastError();
      return -1;
    }
    return attr.device;
  }
  void Wait(const char* what, bool copy = false) {
    const bool done = core::PollGpuReady(
        [&] { return gpuStreamQuery(stream); }, timeoutMs, kSlowCallMs,
        [&] {
          if (copy) {
            MORI_WARN(kLogRdma,
                      "emulated NIC: %s on device %d pending for over %d ms (the newest: %zu "
                      "bytes from device %d to device %d); a copy within one GPU runs as a "
                      "kernel and needs an SM that the PEs' kernels leave free",
                      what, device, kSlowCallMs, lastBytes, DeviceOf(lastSrc), DeviceOf(lastDst));
          } else {
            MORI_WARN(kLogRdma, "emulated NIC: %s on device %d pending for over %d ms", what,
                      device, kSlowCallMs);
          }
        });
    MORI_ENSURE(done, TimeoutError,
                "emulated NIC: %s on device %d did not finish within MORI_HOST_TIMEOUT_MS=%lld ms",
                what, device, static_cast<long long>(timeoutMs));
  }

  static constexpr int kSlowCallMs = 1000;
  int device;
  int64_t timeoutMs;
  void* lastDst = nullptr;
  const void* lastSrc = nullptr;
  size_t lastBytes = 0;
  gpuStream_t stream = nullptr;
  uint64_t* oldHost = nullptr;
  uint64_t* oldDev = nullptr;
};

class GpuNicBackend : public application::EmuNicBackend {
 public:
  void Bind(const std::string& busId) override {
    MORI_CHECK_GPU(gpuDeviceGetByPCIBusId(&device, busId.c_str()));
    MORI_CHECK_GPU(gpuSetDevice(device));
    MORI_CHECK_GPU(gpuFree(nullptr));  // creates the context now
  }
  void* Open(const EmuNicMemory& m) override {
    static_assert(sizeof(gpuIpcMemHandle_t) == application::kEmuNicHandleBytes,
                  "an IPC handle travels as kEmuNicHandleBytes raw bytes");
    gpuIpcMemHandle_t h;
    std::memcpy(&h, m.handle, sizeof(h));
    void* p = nullptr;
    MORI_CHECK_GPU(gpuIpcOpenMemHandle(&p, h, gpuIpcMemLazyEnablePeerAccess));
    return p;
  }
  void Close(void* mapped) override {
    const gpuError_t e = gpuIpcCloseMemHandle(mapped);
    if (e != gpuSuccess)
      MORI_WARN(kLogRdma, "emulated NIC: closing the mapping %p failed: %s", mapped,
                gpuGetErrorString(e));
  }
  std::unique_ptr<EmuMemoryAccessor> MakeAccessor(int64_t timeoutMs) override {
    return std::make_unique<GpuMemoryAccessor>(device, timeoutMs);
  }

 private:
  int device = -1;
};

pid_t parentPid = 0;
bool ParentAlive() { return getppid() == parentPid; }

// Descriptors inherited from the PE's process other than ours are closed: the NIC must not keep
// its sockets or files open.
void CloseInheritedFds() {
  std::vector<int> fds;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (dirent* e = readdir(d)) {
      const int fd = std::atoi(e->d_name);
      if (e->d_name[0] != '.' && fd > application::kEmuNicRingFd && fd != dirfd(d))
        fds.push_back(fd);
    }
    closedir(d);
  }
  for (int fd : fds) close(fd);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr,
                 "mori-emulated-nic: started by mori's emulated RDMA transport "
                 "(MORI_RDMA_EMULATE=1), not by hand\n");
    return 2;
  }
  parentPid = static_cast<pid_t>(std::atoll(argv[1]));
  const size_t ringBytes = static_cast<size_t>(std::strtoull(argv[2], nullptr, 10));
  // Interrupts go to the PE's process, which stops this one; a write to a closed connection is
  // an error return, not a signal.
  signal(SIGINT, SIG_IGN);
  signal(SIGPIPE, SIG_IGN);
  CloseInheritedFds();
  // One stream: a few hardware work queues are enough (under MPS they come from a shared pool).
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "2", 1);
  if (!ParentAlive()) return 1;
  void* rings =
      mmap(nullptr, ringBytes, PROT_READ | PROT_WRITE, MAP_SHARED, application::kEmuNicRingFd, 0);
  if (rings == MAP_FAILED) {
    std::fprintf(stderr, "mori-emulated-nic: mapping the %zu bytes of ring memory failed: %s\n",
                 ringBytes, std::strerror(errno));
    return 1;
  }
  close(application::kEmuNicRingFd);
  GpuNicBackend backend;
  int rc = 1;
  try {
    rc = application::RunEmulatedNicServer(application::kEmuNicConnFd, rings, ringBytes, backend,
                                           &ParentAlive);
  } catch (const std::exception& e) {
    MORI_ERROR(kLogRdma, "emulated NIC: %s", e.what());
  }
  munmap(rings, ringBytes);
  return rc;
}

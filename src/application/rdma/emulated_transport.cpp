// The emulated RDMA transport (MORI_RDMA_EMULATE=1): real mlx5 rings posted by GPU threads,
// executed by this process's QueueEmulator thread against the peers' heaps through IPC mappings.
//
// Per RDMA peer and QP, one block of mapped pinned host memory holds the SQ ring, the CQ ring and
// the QpCounters (doorbell records, mailbox, counters): the GPU writes WQEs and doorbell records
// there over PCIe, the emulator reads them with host loads and writes CQEs back. Keys are exchanged
// like real rkeys: every PE registers its own heap with its emulator and publishes {key, base}
// through the bootstrap; each emulator then registers the peers' heaps under those keys, addressed
// by the peers' own heap addresses (iova) and touched through this process's IPC mappings.
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "mori/application/rdma/queue_emulator.hpp"
#include "mori/application/rdma/rdma_transport.hpp"
#include "mori/core/env.hpp"
#include "mori/core/gpu_check.hpp"
#include "mori/core/logging.hpp"

namespace mori::application {

namespace {

namespace rdma = core::rdma;

enum EmuAtomicOp : int { kEmuFetchAdd = 0, kEmuCompareSwap = 1 };

__global__ void EmuAtomicKernel(uint64_t* target, uint64_t swapAdd, uint64_t compare, int op,
                                uint64_t* old) {
  const uint64_t v = op == kEmuFetchAdd ? core::AtomicFetchAddSystem(target, swapAdd)
                                        : core::AtomicCasSystem(target, compare, swapAdd);
  core::AtomicStoreRelaxedSystem(old, v);
}

// Touches GPU memory (this PE's heap and the peers' heaps through IPC mappings) for the emulator:
// copies on a high-priority stream of this PE's device (between two GPUs a copy engine moves them;
// within one GPU CUDA runs a copy kernel, which waits for a free SM while resident kernels hold
// every SM: tools/bench/copy_beside_spin_probe.cu, so the EP launches leave SMs free), 8-byte
// atomics through a one-thread kernel (system-scope atomics, as the GPUs' own). Flush() waits for
// the stream, bounded by MORI_HOST_TIMEOUT_MS, before the emulator publishes a completion.
// The driver maps streams onto CUDA_DEVICE_MAX_CONNECTIONS hardware work queues, and work in one
// queue starts in order: a stream of the same queue whose next work waits for this stream's copies
// (a receive behind an event of an unfinished send) holds them until the device timeout. Enough
// queues keep that unlikely; nothing here can choose the queue.
class GpuMemoryAccessor : public EmuMemoryAccessor {
 public:
  explicit GpuMemoryAccessor(int device) : device(device), timeoutMs(core::Env().hostTimeoutMs) {
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
    // No warm-up launch is needed for the atomic kernel: CreateEmulatedRdmaTransport requires
    // eager module loading, so it is loaded before any user kernel can be waiting on it.
  }
  ~GpuMemoryAccessor() override {
    (void)gpuSetDevice(device);
    try {
      Wait("the last copies and atomics");
    } catch (const std::exception& e) {
      // The stream is stuck (a kernel holds every SM): destroying it would block, so leave it.
      MORI_WARN(kLogRdma, "RDMA emulator: %s; its stream is not destroyed", e.what());
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
    const auto t0 = std::chrono::steady_clock::now();
    MORI_CHECK_GPU(gpuMemcpyAsync(dst, src, bytes, gpuMemcpyDefault, stream));
    // Enqueuing must not wait for the GPU. It does while another thread of this process is in a
    // runtime call that waits for the GPU (a launch waiting for room in a full queue, a device
    // allocation with peer access on, a synchronous copy to pageable memory: each holds the
    // runtime's calls from other threads), and every QP of this PE stalls meanwhile: say so, once.
    const auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0)
            .count();
    if (ms >= kSlowCallMs && !warnedSlowEnqueue) {
      warnedSlowEnqueue = true;
      MORI_WARN(
          kLogRdma,
          "RDMA emulator: enqueuing a %zu-byte copy on device %d took %lld ms: another "
          "thread's runtime call (a launch waiting for room in a full queue, a device "
          "allocation, a synchronous copy) waited behind kernels that wait for the emulator "
          "(queue less work behind unfinished RDMA kernels; docs/rdma.md, \"Host run-ahead\")",
          bytes, device, static_cast<long long>(ms));
    }
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
    // The worker thread is not the thread that created the accessor.
    thread_local int bound = -1;
    if (bound != device) {
      MORI_CHECK_GPU(gpuSetDevice(device));
      // Another thread may capture a graph in global mode (PyTorch's default) while kernels of
      // earlier calls wait for this thread's copies; relaxed mode keeps this thread's stream
      // queries and launches (its own stream, never captured) legal meanwhile.
      gpuStreamCaptureMode mode = gpuStreamCaptureModeRelaxed;
      MORI_CHECK_GPU(gpuThreadExchangeStreamCaptureMode(&mode));
      bound = device;
    }
  }
  uint64_t Atomic(void* target, uint64_t swapAdd, uint64_t compare, int op) {
    Bind();
    *reinterpret_cast<volatile uint64_t*>(oldHost) = ~0ull;
    EmuAtomicKernel<<<1, 1, 0, stream>>>(static_cast<uint64_t*>(target), swapAdd, compare, op,
                                         oldDev);
    MORI_CHECK_LAUNCH();
    Wait("an atomic (needs one free SM on the initiator's GPU)");
    return *reinterpret_cast<volatile uint64_t*>(oldHost);
  }
  // The device holding `p` (-1: unknown).
  static int DeviceOf(const void* p) {
    gpuPointerAttributes_t attr{};
    if (gpuPointerGetAttributes(&attr, p) != gpuSuccess) {
      (void)gpuGetLastError();
      return -1;
    }
    return attr.device;
  }
  // Bounded stream wait: a kernel occupying every SM would keep the atomic kernel from running.
  // `copy`: the stream's newest work is the copy of Copy()'s last call, named in the warning (a
  // copy within one GPU runs as a kernel and needs a free SM; between GPUs it does not).
  void Wait(const char* what, bool copy = false) {
    // Copies of a few MB take microseconds: one pending for a second is not being served (SMs
    // or the stream's hardware queue held by other work), and every QP of this PE waits with it.
    const bool done = core::PollGpuReady(
        [&] { return gpuStreamQuery(stream); }, timeoutMs, kSlowCallMs,
        [&] {
          const char* conn = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
          if (copy) {
            MORI_WARN(kLogRdma,
                      "RDMA emulator: %s on device %d pending for over %d ms (the newest: %zu "
                      "bytes from device %d to device %d). Causes: kernels holding every SM of "
                      "this process's share, or this stream sharing a hardware work queue with a "
                      "stream whose next work waits for RDMA (CUDA_DEVICE_MAX_CONNECTIONS=%s; "
                      "docs/rdma.md, \"Hardware work queues\")",
                      what, device, kSlowCallMs, lastBytes, DeviceOf(lastSrc), DeviceOf(lastDst),
                      conn != nullptr ? conn : "unset");
          } else {
            MORI_WARN(kLogRdma,
                      "RDMA emulator: %s on device %d pending for over %d ms "
                      "(CUDA_DEVICE_MAX_CONNECTIONS=%s; docs/rdma.md, \"Hardware work queues\")",
                      what, device, kSlowCallMs, conn != nullptr ? conn : "unset");
          }
        });
    MORI_ENSURE(done, TimeoutError,
                "RDMA emulator: %s on device %d did not finish within MORI_HOST_TIMEOUT_MS=%lld ms",
                what, device, static_cast<long long>(timeoutMs));
  }

  static constexpr int kSlowCallMs = 1000;
  int device;
  int64_t timeoutMs;
  bool warnedSlowEnqueue = false;
  void* lastDst = nullptr;  // Copy()'s last call, for Wait's warning
  const void* lastSrc = nullptr;
  size_t lastBytes = 0;
  gpuStream_t stream = nullptr;
  uint64_t* oldHost = nullptr;
  uint64_t* oldDev = nullptr;
};

// Published by every PE through the bootstrap.
struct EmuHeapKey {
  uint64_t base;
  uint32_t key;
  uint32_t pad;
};

constexpr size_t kPage = 4096;

EmuOptions EmulatorOptionsFromEnv() {
  const core::EnvValues env = core::Env();
  MORI_ENSURE(env.rdmaEmulateChaos >= 0, InvalidUsageError,
              "MORI_RDMA_EMULATE_CHAOS=%lld: the seed must be >= 0 (0 = off)",
              static_cast<long long>(env.rdmaEmulateChaos));
  MORI_ENSURE(env.rdmaEmulateTrace >= 0 &&
                  static_cast<uint64_t>(env.rdmaEmulateTrace) <= kEmuMaxTraceEntries,
              InvalidUsageError, "MORI_RDMA_EMULATE_TRACE=%lld is out of range [0, %zu]",
              static_cast<long long>(env.rdmaEmulateTrace), kEmuMaxTraceEntries);
  EmuOptions o;
  o.chaosSeed = static_cast<uint64_t>(env.rdmaEmulateChaos);
  o.traceEntries = static_cast<size_t>(env.rdmaEmulateTrace);
  return o;
}

size_t RoundUp(size_t v, size_t to) { return (v + to - 1) / to * to; }

// Mapped pinned host memory, freed on destruction.
struct PinnedBlock {
  uint8_t* host = nullptr;
  uint8_t* dev = nullptr;
  ~PinnedBlock() {
    if (host != nullptr) (void)gpuFreeHost(host);
  }
};

class EmulatedRdmaTransport : public RdmaTransport {
 public:
  EmulatedRdmaTransport(BootstrapNetwork& boot, const Context& context, const SymmetricHeap& heap,
                        const RdmaTransportConfig& config) {
    rank = boot.Rank();
    const int worldSize = boot.WorldSize();
    MORI_ENSURE(config.numQpPerPe >= 1 && config.numQpPerPe <= 64, InvalidUsageError,
                "MORI_NUM_QP_PER_PE=%d is out of range [1, 64]", config.numQpPerPe);
    MORI_ENSURE(config.sqBlocks >= 4 && config.sqBlocks <= 32768 &&
                    (config.sqBlocks & (config.sqBlocks - 1)) == 0,
                InvalidUsageError, "RDMA SQ size %u must be a power of two in [4, 32768]",
                config.sqBlocks);
    int device = 0;
    MORI_CHECK_GPU(gpuGetDevice(&device));
    const EmuOptions options = EmulatorOptionsFromEnv();
    emulator =
        std::make_unique<QueueEmulator>(std::make_unique<GpuMemoryAccessor>(device), options);

    // Keys: our own heap, then everyone's {base, key}.
    const EmuMemoryRegion mine =
        emulator->RegisterMemory(rank, heap.Base(), heap.Size(), kEmuAllAccess);
    lkey = mine.lkey;
    EmuHeapKey me{reinterpret_cast<uint64_t>(heap.Base()), mine.rkey, 0};
    std::vector<EmuHeapKey> keys(worldSize);
    boot.Allgather(&me, keys.data(), sizeof(EmuHeapKey));

    peers.resize(worldSize);
    const uint32_t numCqes = config.sqBlocks;
    const size_t sqBytes = static_cast<size_t>(config.sqBlocks) * 64;
    const size_t cqBytes = static_cast<size_t>(numCqes) * 64;
    perQp = RoundUp(sqBytes + cqBytes + sizeof(rdma::QpCounters), kPage);
    int rdmaPeers = 0;
    for (int pe = 0; pe < worldSize; pe++)
      rdmaPeers += context.Transport(pe) == TransportType::kRdma;
    if (rdmaPeers > 0) {
      const size_t total = perQp * rdmaPeers * config.numQpPerPe;
      void* p = nullptr;
      MORI_CHECK_GPU(gpuHostAlloc(&p, total, gpuHostAllocMapped));
      block.host = static_cast<uint8_t*>(p);
      std::memset(block.host, 0, total);
      void* d = nullptr;
      MORI_CHECK_GPU(gpuHostGetDevicePointer(&d, p, 0));
      block.dev = static_cast<uint8_t*>(d);
    }
    uint32_t nextQpn = 0x100;
    size_t slot = 0;
    for (int pe = 0; pe < worldSize; pe++) {
      if (context.Transport(pe) != TransportType::kRdma) continue;
      const uintptr_t mapped = heap.HostAccessBase(pe);
      MORI_ENSURE(mapped != 0, InvalidUsageError,
                  "MORI_RDMA_EMULATE: rank %d cannot map the heap of PE %d (the emulator needs "
                  "every PE on this host)",
                  rank, pe);
      emulator->RegisterMemoryAs(pe, keys[pe].key, keys[pe].base, reinterpret_cast<void*>(mapped),
                                 heap.Size(), kEmuAllAccess);
      RdmaPeerEndpoints& out = peers[pe];
      out.rkey = keys[pe].key;
      out.remoteHeapBase = keys[pe].base;
      for (int q = 0; q < config.numQpPerPe; q++, slot++) {
        uint8_t* h = block.host + slot * perQp;
        const uintptr_t shift =
            reinterpret_cast<uintptr_t>(block.dev) - reinterpret_cast<uintptr_t>(block.host);
        auto dev = [&](void* hp) {
          return reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(hp) + shift);
        };
        void* sqHost = h;
        void* cqHost = h + sqBytes;
        auto* ctrHost = reinterpret_cast<rdma::QpCounters*>(h + sqBytes + cqBytes);
        EmuInitCqRing(cqHost, numCqes);
        const uint32_t qpn = nextQpn++;
        // The endpoint the GPU uses: the same memory through device pointers.
        rdma::QpEndpoint ep =
            rdma::MakeEndpoint(dev(sqHost), config.sqBlocks, qpn, dev(cqHost), numCqes,
                               static_cast<rdma::QpCounters*>(dev(ctrHost)));
        out.qps.push_back(ep);
        // The emulator's view: host pointers.
        const rdma::QpEndpoint hostEp =
            rdma::MakeEndpoint(sqHost, config.sqBlocks, qpn, cqHost, numCqes, ctrHost);
        emulator->AddQp(EmuQpFromEndpoint(hostEp, rank, pe));
      }
    }
    describe =
        "emulated (QueueEmulator thread, " + std::to_string(config.numQpPerPe) +
        " QP per peer, SQ " + std::to_string(config.sqBlocks) + " blocks" +
        (options.chaosSeed != 0 ? ", chaos seed " + std::to_string(options.chaosSeed) : "") +
        (options.traceEntries != 0 ? ", trace " + std::to_string(options.traceEntries) : "") + ")";
    if (rdmaPeers > 0) emulator->Start();
    MORI_INFO(kLogRdma, "rank %d: RDMA transport %s to %d peers", rank, describe.c_str(),
              rdmaPeers);
  }

  ~EmulatedRdmaTransport() override {
    try {
      Stop();
    } catch (const std::exception& e) {
      MORI_WARN(kLogRdma, "stopping the RDMA emulator: %s", e.what());
    }
    emulator.reset();  // joins the worker (if Stop could not) before the rings go
  }

  std::string Describe() const override { return describe; }
  uint32_t HeapLkey() const override { return lkey; }
  const std::vector<RdmaPeerEndpoints>& Peers() const override { return peers; }
  void Stop() override {
    if (emulator && emulator->Running())
      emulator->Stop(static_cast<int>(core::Env().hostTimeoutMs));
  }
  std::string FatalError() const override { return emulator ? emulator->FatalError() : ""; }
  RdmaWireStats WireStats(bool reset) override { return emulator->WireStats(reset); }
  uint32_t RegisterLocal(void* ptr, size_t bytes) override {
    MORI_ENSURE(ptr != nullptr && bytes > 0, InvalidUsageError,
                "RDMA buffer registration: empty range (%p, %zu bytes)", ptr, bytes);
    std::lock_guard<std::mutex> lock(userMu);
    MORI_ENSURE(userKeys.count(ptr) == 0, InvalidUsageError,
                "RDMA buffer registration: %p is already registered", ptr);
    const uint32_t key = emulator->RegisterMemory(rank, ptr, bytes, kEmuAllAccess).lkey;
    userKeys[ptr] = key;
    return key;
  }
  void DeregisterLocal(void* ptr) override {
    std::lock_guard<std::mutex> lock(userMu);
    auto it = userKeys.find(ptr);
    MORI_ENSURE(it != userKeys.end(), InvalidUsageError,
                "RDMA buffer deregistration: %p is not registered", ptr);
    emulator->DeregisterMemory(it->second);
    userKeys.erase(it);
  }

 private:
  int rank = 0;
  std::mutex userMu;
  std::map<void*, uint32_t> userKeys;  // RegisterLocal: buffer -> its key
  PinnedBlock block;                   // declared before the emulator: destroyed after it
  std::unique_ptr<QueueEmulator> emulator;
  uint32_t lkey = 0;
  std::vector<RdmaPeerEndpoints> peers;
  size_t perQp = 0;
  std::string describe;
};

}  // namespace

std::unique_ptr<RdmaTransport> CreateEmulatedRdmaTransport(BootstrapNetwork& boot,
                                                           const Context& context,
                                                           const SymmetricHeap& heap,
                                                           const RdmaTransportConfig& config) {
  // CUDA loads a kernel's module at its first launch by default, and a load may synchronise the
  // context: a launch issued while a kernel spins on RDMA completions would then wait for that
  // kernel, which waits for the emulator, whose copies wait for the load. Real NICs need no
  // runtime calls, so only the emulator requires eager loading.
  std::string loading;
  MORI_ENSURE(core::GpuModuleLoadingIsEager(&loading), InvalidUsageError,
              "MORI_RDMA_EMULATE=1 on CUDA needs CUDA_MODULE_LOADING=EAGER in the environment of "
              "the process before it starts using the GPU (found '%s'): with lazy loading, "
              "launching a kernel while another waits for emulated RDMA completions can stall both",
              loading.c_str());
  return std::make_unique<EmulatedRdmaTransport>(boot, context, heap, config);
}

}  // namespace mori::application

// The emulated RDMA transport (MORI_RDMA_EMULATE=1): real mlx5 rings posted by GPU threads,
// executed by this PE's emulated NIC, a process of its own (emulated_nic.hpp, mori-emulated-nic).
//
// Per RDMA peer and QP, one page-aligned block of shared host memory (a memfd mapped here and in
// the NIC process, registered here for the GPU) holds the SQ ring, the CQ ring and the QpCounters
// (doorbell records, mailbox, counters): the GPU writes WQEs and doorbell records there over PCIe,
// the NIC reads them with host loads and writes CQEs back. Keys are exchanged like real rkeys:
// every PE's NIC registers that PE's heap and the PE publishes {key, base} through the bootstrap;
// each NIC then registers the peers' heaps under those keys, addressed by the peers' own heap
// addresses (iova) and touched through the NIC's IPC mappings of them.
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "mori/application/rdma/emulated_nic.hpp"
#include "mori/application/rdma/rdma_transport.hpp"
#include "mori/core/env.hpp"
#include "mori/core/gpu_check.hpp"
#include "mori/core/logging.hpp"

extern char** environ;

namespace mori::application {

namespace {

namespace rdma = core::rdma;

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

constexpr size_t kPage = 4096;
size_t RoundUp(size_t v, size_t to) { return (v + to - 1) / to * to; }

// Host memory shared with the NIC process and mapped for this PE's GPU.
class SharedRings {
 public:
  explicit SharedRings(size_t bytes) : bytes(bytes) {
    fd = memfd_create("mori-emulated-nic-rings", MFD_CLOEXEC);
    MORI_CHECK_SYS(fd);
    try {
      MORI_CHECK_SYS(ftruncate(fd, static_cast<off_t>(bytes)));
      void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      MORI_ENSURE(p != MAP_FAILED, SystemError, "mapping %zu bytes of ring memory failed: %s",
                  bytes, std::strerror(errno));
      host = static_cast<uint8_t*>(p);
      MORI_CHECK_GPU(gpuHostRegister(host, bytes, gpuHostRegisterMapped));
      registered = true;
      void* d = nullptr;
      MORI_CHECK_GPU(gpuHostGetDevicePointer(&d, host, 0));
      dev = static_cast<uint8_t*>(d);
    } catch (...) {
      Release();
      throw;
    }
  }
  ~SharedRings() { Release(); }
  SharedRings(const SharedRings&) = delete;
  SharedRings& operator=(const SharedRings&) = delete;

  int fd = -1;
  size_t bytes;
  uint8_t* host = nullptr;
  uint8_t* dev = nullptr;

 private:
  void Release() {
    if (registered) (void)gpuHostUnregister(host);
    registered = false;
    if (host != nullptr) munmap(host, bytes);
    host = nullptr;
    if (fd >= 0) close(fd);
    fd = -1;
  }
  bool registered = false;
};

// Where the NIC program is: next to the library holding this code (libmori).
std::string NicProgramPath() {
  Dl_info info{};
  MORI_ENSURE(dladdr(reinterpret_cast<void*>(&CreateEmulatedRdmaTransport), &info) != 0 &&
                  info.dli_fname != nullptr,
              SystemError, "MORI_RDMA_EMULATE: cannot tell where libmori is loaded from");
  std::string dir = info.dli_fname;
  const size_t slash = dir.rfind('/');
  dir = slash == std::string::npos ? "." : dir.substr(0, slash);
  const std::string path = dir + "/" + kEmuNicProgram;
  MORI_ENSURE(access(path.c_str(), X_OK) == 0, InvalidUsageError,
              "MORI_RDMA_EMULATE: the emulated NIC program %s is missing or not executable (%s); "
              "it is built and installed next to libmori",
              path.c_str(), std::strerror(errno));
  return path;
}

// The NIC process: started with the connection and the ring memory, reaped on destruction.
class NicProcess {
 public:
  NicProcess(int ringFd, size_t ringBytes) {
    const std::string path = NicProgramPath();
    int sv[2];
    MORI_CHECK_SYS(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv));
    // Above the target numbers, so that each dup2 below moves a descriptor (and clears its
    // close-on-exec flag) instead of meeting itself.
    const int childConn = fcntl(sv[1], F_DUPFD_CLOEXEC, 16);
    const int childRing = fcntl(ringFd, F_DUPFD_CLOEXEC, 16);
    close(sv[1]);
    auto cleanup = [&] {
      if (childConn >= 0) close(childConn);
      if (childRing >= 0) close(childRing);
    };
    if (childConn < 0 || childRing < 0) {
      cleanup();
      close(sv[0]);
      MORI_THROW(SystemError, "MORI_RDMA_EMULATE: duplicating descriptors failed: %s",
                 std::strerror(errno));
    }
    posix_spawn_file_actions_t fa;
    posix_spawnattr_t attr;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, childConn, kEmuNicConnFd);
    posix_spawn_file_actions_adddup2(&fa, childRing, kEmuNicRingFd);
    posix_spawnattr_init(&attr);
    // Signals blocked or handled by this process's threads are not the NIC's.
    sigset_t none, all;
    sigemptyset(&none);
    sigfillset(&all);
    posix_spawnattr_setsigmask(&attr, &none);
    posix_spawnattr_setsigdefault(&attr, &all);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
    const std::string parent = std::to_string(getpid()), bytes = std::to_string(ringBytes);
    char* argv[] = {const_cast<char*>(path.c_str()), const_cast<char*>(parent.c_str()),
                    const_cast<char*>(bytes.c_str()), nullptr};
    const int rc = posix_spawn(&pid, path.c_str(), &fa, &attr, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&attr);
    cleanup();
    if (rc != 0) {
      close(sv[0]);
      MORI_THROW(SystemError, "MORI_RDMA_EMULATE: starting %s failed: %s", path.c_str(),
                 std::strerror(rc));
    }
    conn = sv[0];
  }
  ~NicProcess() {
    if (conn >= 0) close(conn);
    // The NIC ends when its connection closes; a bound, then a kill, keep this from hanging.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!Reaped() && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (!Reaped()) {
      MORI_WARN(kLogRdma, "the emulated NIC process %d did not exit; killing it",
                static_cast<int>(pid));
      kill(pid, SIGKILL);
      while (!Reaped() && std::chrono::steady_clock::now() < deadline + std::chrono::seconds(5))
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  NicProcess(const NicProcess&) = delete;
  NicProcess& operator=(const NicProcess&) = delete;

  // The connection, handed to the client (which closes it).
  int TakeConnection() {
    const int fd = conn;
    conn = -1;
    return fd;
  }
  static std::string DescribeExit(void* self) {
    auto* p = static_cast<NicProcess*>(self);
    std::lock_guard<std::mutex> lock(p->mu);
    p->ReapLocked();
    if (!p->exited) return core::StrFormat("the NIC process %d is still running", (int)p->pid);
    if (p->status < 0) return core::StrFormat("the NIC process %d has ended", (int)p->pid);
    if (WIFSIGNALED(p->status))
      return core::StrFormat("the NIC process %d was killed by signal %d", (int)p->pid,
                             WTERMSIG(p->status));
    return core::StrFormat("the NIC process %d exited with status %d", (int)p->pid,
                           WEXITSTATUS(p->status));
  }

 private:
  bool Reaped() {
    std::lock_guard<std::mutex> lock(mu);
    ReapLocked();
    return exited;
  }
  void ReapLocked() {
    if (exited) return;
    int st = 0;
    const pid_t r = waitpid(pid, &st, WNOHANG);
    if (r == pid) {
      exited = true;
      status = st;
    } else if (r < 0 && errno == ECHILD) {
      exited = true;  // reaped elsewhere (SIGCHLD ignored): the status is unknown
      status = -1;
    }
  }
  pid_t pid = -1;
  int conn = -1;
  std::mutex mu;
  bool exited = false;
  int status = 0;
};

// Published by every PE through the bootstrap: its heap's key, or why its set-up failed.
struct EmuPeRecord {
  uint64_t base;
  uint32_t key;
  int32_t status;  // kOk, kNoRdma, kFailed
  char error[240];
};
enum : int32_t { kStatusOk = 0, kStatusNoRdma = 1, kStatusFailed = 2 };

void SetError(EmuPeRecord* r, const std::exception& e) {
  r->status = kStatusFailed;
  std::snprintf(r->error, sizeof(r->error), "%s", e.what());
}

// Raises on every PE when any PE failed; this PE's own error first.
void AgreeOnOutcome(BootstrapNetwork& boot, EmuPeRecord& mine, std::exception_ptr local,
                    std::vector<EmuPeRecord>& all, const char* step) {
  boot.Allgather(&mine, all.data(), sizeof(EmuPeRecord));
  if (local) std::rethrow_exception(local);
  for (size_t p = 0; p < all.size(); p++) {
    if (all[p].status == kStatusFailed) {
      all[p].error[sizeof(all[p].error) - 1] = '\0';
      MORI_THROW(RemoteError, "PE %zu could not %s: %s", p, step, all[p].error);
    }
  }
}

class EmulatedRdmaTransport : public RdmaTransport {
 public:
  EmulatedRdmaTransport(BootstrapNetwork& boot, const Context& context, const SymmetricHeap& heap,
                        const RdmaTransportConfig& config)
      : heapSize(heap.Size()) {
    rank = boot.Rank();
    const int worldSize = boot.WorldSize();
    const int64_t timeoutMs = core::Env().hostTimeoutMs;
    std::vector<int> rdmaPeers;
    for (int pe = 0; pe < worldSize; pe++)
      if (context.Transport(pe) == TransportType::kRdma) rdmaPeers.push_back(pe);
    peers.resize(worldSize);
    const uint32_t numCqes = config.sqBlocks;
    const size_t sqBytes = static_cast<size_t>(config.sqBlocks) * 64;
    const size_t cqBytes = static_cast<size_t>(numCqes) * 64;
    const size_t perQp = RoundUp(sqBytes + cqBytes + sizeof(rdma::QpCounters), kPage);
    EmuOptions options;

    // Local set-up: the NIC process and this PE's heap registered with it.
    EmuPeRecord mine{};
    mine.status = rdmaPeers.empty() ? kStatusNoRdma : kStatusOk;
    mine.base = reinterpret_cast<uint64_t>(heap.Base());
    std::exception_ptr localError;
    if (!rdmaPeers.empty()) {
      try {
        MORI_ENSURE(config.numQpPerPe >= 1 && config.numQpPerPe <= 64, InvalidUsageError,
                    "MORI_NUM_QP_PER_PE=%d is out of range [1, 64]", config.numQpPerPe);
        MORI_ENSURE(config.sqBlocks >= 4 && config.sqBlocks <= 32768 &&
                        (config.sqBlocks & (config.sqBlocks - 1)) == 0,
                    InvalidUsageError, "RDMA SQ size %u must be a power of two in [4, 32768]",
                    config.sqBlocks);
        for (int pe : rdmaPeers)
          MORI_ENSURE(std::strncmp(context.Peer(pe).nodeId, context.Peer(rank).nodeId,
                                   sizeof(PeerRecord::nodeId)) == 0,
                      InvalidUsageError,
                      "MORI_RDMA_EMULATE: rank %d cannot reach PE %d, which runs on another host "
                      "(the emulated NIC needs every PE on this host)",
                      rank, pe);
        options = EmulatorOptionsFromEnv();
        rings = std::make_unique<SharedRings>(perQp * rdmaPeers.size() * config.numQpPerPe);
        nic = std::make_unique<NicProcess>(rings->fd, rings->bytes);
        client = std::make_unique<EmulatedNicClient>(nic->TakeConnection(), timeoutMs,
                                                     &NicProcess::DescribeExit, nic.get());
        int device = 0;
        MORI_CHECK_GPU(gpuGetDevice(&device));
        char busId[32] = {};
        MORI_CHECK_GPU(gpuDeviceGetPCIBusId(busId, sizeof(busId), device));
        client->Init(EmuNicInit{rank, busId, options, timeoutMs});
        lkey = client->Register(HeapMemory(heap, rank, mine.base));
        mine.key = lkey;
      } catch (const std::exception& e) {
        SetError(&mine, e);
        localError = std::current_exception();
      }
    }
    std::vector<EmuPeRecord> all(worldSize);
    AgreeOnOutcome(boot, mine, localError, all, "start its emulated NIC");

    // The peers' heaps under their keys, then the queue pairs; agreed again (every PE takes part
    // in the exchange, a PE without RDMA peers too).
    EmuPeRecord outcome{};
    try {
      size_t slot = 0;
      for (int pe : rdmaPeers) {
        MORI_ENSURE(all[pe].status == kStatusOk, RemoteError,
                    "PE %d reaches PE %d through RDMA, but PE %d has no RDMA peers", rank, pe, pe);
        client->Register(HeapMemory(heap, pe, all[pe].base), all[pe].key);
        RdmaPeerEndpoints& out = peers[pe];
        out.rkey = all[pe].key;
        out.remoteHeapBase = all[pe].base;
        for (int q = 0; q < config.numQpPerPe; q++, slot++) {
          EmuNicQp qp;
          qp.sqOffset = slot * perQp;
          qp.cqOffset = qp.sqOffset + sqBytes;
          qp.countersOffset = qp.cqOffset + cqBytes;
          qp.sqBlocks = config.sqBlocks;
          qp.numCqes = numCqes;
          qp.qpn = nextQpn++;
          qp.pe = rank;
          qp.remotePe = pe;
          client->AddQp(qp);  // initialises the CQ ring before any GPU thread sees it
          out.qps.push_back(rdma::MakeEndpoint(
              rings->dev + qp.sqOffset, config.sqBlocks, qp.qpn, rings->dev + qp.cqOffset, numCqes,
              reinterpret_cast<rdma::QpCounters*>(rings->dev + qp.countersOffset)));
        }
      }
      if (client) client->Start();  // a PE without RDMA peers has no NIC
    } catch (const std::exception& e) {
      SetError(&outcome, e);
      localError = std::current_exception();
    }
    AgreeOnOutcome(boot, outcome, localError, all, "connect its emulated queue pairs");
    if (rdmaPeers.empty()) return;
    describe =
        "emulated (NIC process, " + std::to_string(config.numQpPerPe) + " QP per peer, SQ " +
        std::to_string(config.sqBlocks) + " blocks" +
        (options.chaosSeed != 0 ? ", chaos seed " + std::to_string(options.chaosSeed) : "") +
        (options.traceEntries != 0 ? ", trace " + std::to_string(options.traceEntries) : "") + ")";
    MORI_INFO(kLogRdma, "rank %d: RDMA transport %s to %zu peers", rank, describe.c_str(),
              rdmaPeers.size());
  }

  ~EmulatedRdmaTransport() override {
    try {
      Stop();
    } catch (const std::exception& e) {
      MORI_WARN(kLogRdma, "stopping the emulated NIC: %s", e.what());
    }
    client.reset();  // closes the connection: the NIC process ends
    nic.reset();     // reaped (bounded) before the ring memory goes
    rings.reset();
  }

  std::string Describe() const override { return describe; }
  uint32_t HeapLkey() const override { return lkey; }
  const std::vector<RdmaPeerEndpoints>& Peers() const override { return peers; }
  void Stop() override {
    if (client && client->Connected() && !stopped) {
      stopped = true;
      client->Stop(core::Env().hostTimeoutMs);
    }
  }
  std::string FatalError() const override { return client ? client->FatalError() : ""; }
  RdmaWireStats WireStats(bool reset) override {
    if (client) return client->WireStats(reset);
    RdmaWireStats none;
    none.available = true;
    none.source = "emulated NIC (this PE has no RDMA peers: nothing on the wire)";
    return none;
  }
  uint32_t RegisterLocal(void* ptr, size_t bytes) override {
    MORI_ENSURE(ptr != nullptr && bytes > 0, InvalidUsageError,
                "RDMA buffer registration: empty range (%p, %zu bytes)", ptr, bytes);
    std::lock_guard<std::mutex> lock(userMu);
    MORI_ENSURE(userKeys.count(ptr) == 0, InvalidUsageError,
                "RDMA buffer registration: %p is already registered", ptr);
    uint32_t key = 0;
    if (client) {
      key = client->Register(BufferMemory(ptr, bytes));
    } else {
      key = nextLocalKey++;  // no RDMA peer: no work request will name it
    }
    userKeys[ptr] = key;
    return key;
  }
  void DeregisterLocal(void* ptr) override {
    std::lock_guard<std::mutex> lock(userMu);
    auto it = userKeys.find(ptr);
    MORI_ENSURE(it != userKeys.end(), InvalidUsageError,
                "RDMA buffer deregistration: %p is not registered", ptr);
    if (client) client->Deregister(it->second);
    userKeys.erase(it);
  }

 private:
  EmuNicMemory HeapMemory(const SymmetricHeap& heap, int pe, uint64_t base) const {
    EmuNicMemory m;
    m.pe = pe;
    std::memcpy(m.handle, heap.IpcHandle(pe), kEmuNicHandleBytes);
    m.allocBase = base;
    m.allocBytes = heapSize;
    m.base = base;
    m.length = heapSize;
    return m;
  }
  // A buffer of this PE: the NIC maps the whole allocation holding it through its IPC handle.
  EmuNicMemory BufferMemory(void* ptr, size_t bytes) const {
    void* allocBase = ptr;
    size_t allocBytes = bytes;
    const gpuError_t rangeErr = core::GpuMemGetAllocationRange(ptr, &allocBase, &allocBytes);
    if (rangeErr != gpuSuccess) {
      (void)gpuGetLastError();
      MORI_ENSURE(rangeErr == gpuErrorNotSupported, InvalidUsageError,
                  "RDMA buffer registration: %p is not device memory of this process (the "
                  "emulated NIC reaches device allocations only): %s",
                  ptr, gpuGetErrorString(rangeErr));
      allocBase = ptr;  // this runtime cannot tell the allocation: the handle covers it
      allocBytes = bytes;
    }
    gpuIpcMemHandle_t h;
    std::memset(&h, 0, sizeof(h));
    const gpuError_t e = gpuIpcGetMemHandle(&h, allocBase);
    if (e != gpuSuccess) {
      (void)gpuGetLastError();
      MORI_THROW(InvalidUsageError,
                 "RDMA buffer registration: the emulated NIC reaches device memory through IPC "
                 "handles, and the allocation holding %p has none (%s; e.g. memory from "
                 "virtual-memory APIs or PyTorch's expandable segments)",
                 ptr, gpuGetErrorString(e));
    }
    static_assert(sizeof(h) == kEmuNicHandleBytes, "an IPC handle is kEmuNicHandleBytes bytes");
    EmuNicMemory m;
    m.pe = rank;
    std::memcpy(m.handle, &h, sizeof(h));
    m.allocBase = reinterpret_cast<uint64_t>(allocBase);
    m.allocBytes = allocBytes;
    m.base = reinterpret_cast<uint64_t>(ptr);
    m.length = bytes;
    return m;
  }

  int rank = 0;
  uint64_t heapSize;
  uint32_t nextQpn = 0x100;
  uint32_t nextLocalKey = 0x1000a5;
  std::mutex userMu;
  std::map<void*, uint32_t> userKeys;  // RegisterLocal: buffer -> its key
  // Destroyed in reverse: the client (connection) before the process before the rings.
  std::unique_ptr<SharedRings> rings;
  std::unique_ptr<NicProcess> nic;
  std::unique_ptr<EmulatedNicClient> client;
  bool stopped = false;
  uint32_t lkey = 0;
  std::vector<RdmaPeerEndpoints> peers;
  std::string describe = "emulated (no RDMA peers)";
};

}  // namespace

std::unique_ptr<RdmaTransport> CreateEmulatedRdmaTransport(BootstrapNetwork& boot,
                                                           const Context& context,
                                                           const SymmetricHeap& heap,
                                                           const RdmaTransportConfig& config) {
  return std::make_unique<EmulatedRdmaTransport>(boot, context, heap, config);
}

}  // namespace mori::application

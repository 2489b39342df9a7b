// Shmem host API: init/finalize, queries, symmetric allocation, host-side synchronisation and the
// surfacing of device-side errors.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "mori/application/bootstrap/mpi_plugin.hpp"
#include "mori/application/bootstrap/socket_bootstrap.hpp"
#include "mori/application/context/context.hpp"
#include "mori/application/memory/symmetric_heap.hpp"
#include "mori/application/rdma/rdma_transport.hpp"
#include "mori/core/device_error.hpp"
#include "mori/core/env.hpp"
#include "mori/core/gpu_check.hpp"
#include "mori/core/logging.hpp"
#include "mori/core/profiler_range.hpp"
#include "mori/shmem/device/barrier_launch.hpp"
#include "mori/shmem/shmem_api.hpp"

namespace mori::shmem {

static_assert(sizeof(application::SocketUniqueId) == kUniqueIdBytes,
              "the socket bootstrap's unique id must fill UniqueId exactly");

namespace {

struct ShmemState {
  int device = -1;
  std::unique_ptr<application::BootstrapNetwork> boot;
  std::unique_ptr<application::Context> context;
  std::unique_ptr<application::SymmetricHeap> heap;
  std::unique_ptr<application::RdmaTransport> rdma;  // null when no PE of the job uses RDMA
  ShmemRdmaPeer* rdmaPeersDev = nullptr;
  ShmemUserRegion* userRegionsDev = nullptr;  // [kMaxUserRegions]
  std::vector<ShmemUserRegion> userRegions;   // host copy of the table
  std::vector<core::rdma::QpEndpoint*> rdmaEndpointsDev;
  core::DeviceErrorRecord* errHost = nullptr;  // mapped pinned memory
  core::DeviceErrorRecord* errDev = nullptr;
  uintptr_t* peerBasesDev = nullptr;
  TransportType* transportDev = nullptr;
  int32_t* nodeOfDev = nullptr;
  int32_t* localRankOfDev = nullptr;
  uint64_t* barrierEpochDev = nullptr;
  uint64_t syncAreaOffset = 0;
  ShmemDeviceContext devCtx{};
};

// Timeouts above a day are a configuration mistake, not a wish for "no bound".
constexpr int64_t kMaxTimeoutMs = 24ll * 3600 * 1000;

std::mutex gMutex;
std::unique_ptr<ShmemState> gState;
uint64_t gInitGeneration = 0;  // incremented by every successful init
std::atomic<bool> gProcessExiting{false};

ShmemState& State(const char* caller) {
  if (!gState)
    MORI_THROW(InvalidUsageError, "%s: shmem is not initialised (call an init function first)",
               caller);
  return *gState;
}

// Frees what init allocated; tolerant of partially initialised state.
void DestroyState(ShmemState& s) {
  if (s.rdma) {
    try {
      s.rdma->Stop();
    } catch (const std::exception& e) {
      MORI_WARN(kLogInit, "stopping the RDMA transport: %s", e.what());
    }
    s.rdma.reset();
  }
  for (core::rdma::QpEndpoint* p : s.rdmaEndpointsDev) (void)gpuFree(p);
  s.rdmaEndpointsDev.clear();
  if (s.rdmaPeersDev) (void)gpuFree(s.rdmaPeersDev);
  s.rdmaPeersDev = nullptr;
  if (s.userRegionsDev) (void)gpuFree(s.userRegionsDev);
  s.userRegionsDev = nullptr;
  if (s.heap) s.heap.reset();
  if (s.peerBasesDev) (void)gpuFree(s.peerBasesDev);
  if (s.transportDev) (void)gpuFree(s.transportDev);
  if (s.nodeOfDev) (void)gpuFree(s.nodeOfDev);
  if (s.localRankOfDev) (void)gpuFree(s.localRankOfDev);
  if (s.barrierEpochDev) (void)gpuFree(s.barrierEpochDev);
  if (s.errHost) (void)gpuFreeHost(s.errHost);
  s.peerBasesDev = nullptr;
  s.transportDev = nullptr;
  s.nodeOfDev = nullptr;
  s.localRankOfDev = nullptr;
  s.barrierEpochDev = nullptr;
  s.errHost = nullptr;
  s.context.reset();
  if (s.boot) s.boot->Finalize();
  s.boot.reset();
}

template <typename T>
T* DeviceCopyOf(const std::vector<T>& host) {
  void* p = nullptr;
  MORI_CHECK_GPU(gpuMalloc(&p, host.size() * sizeof(T)));
  MORI_CHECK_GPU(gpuMemcpy(p, host.data(), host.size() * sizeof(T), gpuMemcpyHostToDevice));
  return static_cast<T*>(p);
}

// Builds the RDMA transport (collective) and the device view of it in s.devCtx.
void SetUpRdma(ShmemState& s) {
  const int worldSize = s.boot->WorldSize();
  application::RdmaTransportConfig cfg;
  const int64_t numQp = core::Env().numQpPerPe;
  MORI_ENSURE(numQp >= 1 && numQp <= 64, InvalidUsageError,
              "MORI_NUM_QP_PER_PE=%lld is out of range [1, 64]", static_cast<long long>(numQp));
  cfg.numQpPerPe = static_cast<int>(numQp);
  // Scratch words for fetched values: 2 per SQ block of every QP (see shmem/device/rdma.hpp).
  // Allocated on every PE in the same order, so it is symmetric like the sync area.
  const uint64_t scratchWordsPerPeer = 2ull * cfg.sqBlocks * cfg.numQpPerPe;
  const uint64_t scratchOffset =
      s.heap->Allocator().Allocate(scratchWordsPerPeer * worldSize * sizeof(uint64_t), 256);
  if (core::Env().rdmaEmulate) {
    s.rdma = application::CreateEmulatedRdmaTransport(*s.boot, *s.context, *s.heap, cfg);
  } else {
    // A NIC is required from here on: without one the transport raises on every PE (collectively),
    // naming the reason (no libibverbs, no ACTIVE port, MORI_RDMA_DEVICES excluded all, ...).
    s.rdma = application::CreateVerbsRdmaTransport(*s.boot, *s.context, *s.heap, cfg);
  }
  std::vector<ShmemRdmaPeer> peers(worldSize);
  const auto& eps = s.rdma->Peers();
  auto* scratch =
      reinterpret_cast<uint64_t*>(reinterpret_cast<uintptr_t>(s.heap->Base()) + scratchOffset);
  for (int pe = 0; pe < worldSize; pe++) {
    ShmemRdmaPeer& p = peers[pe];
    p = ShmemRdmaPeer{};
    if (s.context->Transport(pe) != TransportType::kRdma) continue;
    MORI_ENSURE(eps[pe].qps.size() == static_cast<size_t>(cfg.numQpPerPe), InternalError,
                "RDMA transport gave %zu QPs for PE %d, expected %d", eps[pe].qps.size(), pe,
                cfg.numQpPerPe);
    s.rdmaEndpointsDev.push_back(DeviceCopyOf(eps[pe].qps));
    p.qps = s.rdmaEndpointsDev.back();
    p.numQps = static_cast<uint32_t>(eps[pe].qps.size());
    p.rkey = eps[pe].rkey;
    p.remoteHeapBase = eps[pe].remoteHeapBase;
    p.scratch = scratch + scratchWordsPerPeer * pe;
  }
  s.rdmaPeersDev = DeviceCopyOf(peers);
  s.devCtx.rdmaPeers = s.rdmaPeersDev;
  s.userRegions.assign(kMaxUserRegions, ShmemUserRegion{});
  s.userRegionsDev = DeviceCopyOf(s.userRegions);
  s.devCtx.userRegions = s.userRegionsDev;
  s.devCtx.heapLkey = s.rdma->HeapLkey();
  MORI_INFO(kLogInit, "rank %d: RDMA transport: %s", s.boot->Rank(), s.rdma->Describe().c_str());
}

void BuildState(ShmemState& s) {
  MORI_CHECK_GPU(gpuGetDevice(&s.device));
  const int rank = s.boot->Rank(), worldSize = s.boot->WorldSize();
  core::SetLogRank(rank);
  s.context = std::make_unique<application::Context>(*s.boot, s.device);
  // RDMA is set up when any PE of the job has an RDMA peer (every PE must agree: the transport's
  // exchanges and the scratch allocation are collective).
  int32_t myRdmaPeers = 0;
  for (TransportType t : s.context->Transports()) myRdmaPeers += t == TransportType::kRdma;
  std::vector<int32_t> rdmaPeerCounts(worldSize);
  s.boot->Allgather(&myRdmaPeers, rdmaPeerCounts.data(), sizeof(int32_t));
  bool anyRdma = false;
  for (int32_t n : rdmaPeerCounts) anyRdma = anyRdma || n > 0;
  s.heap = std::make_unique<application::SymmetricHeap>(*s.boot, *s.context, core::Env().heapSize);
  // The internal sync area is the heap's first allocation: offset 0 on every PE, zeroed.
  s.syncAreaOffset = s.heap->Allocator().Allocate(kSyncAreaWords * sizeof(uint64_t), 256);

  void* rec = nullptr;
  MORI_CHECK_GPU(gpuHostAlloc(&rec, sizeof(core::DeviceErrorRecord), gpuHostAllocMapped));
  s.errHost = static_cast<core::DeviceErrorRecord*>(rec);
  std::memset(s.errHost, 0, sizeof(core::DeviceErrorRecord));
  void* recDev = nullptr;
  MORI_CHECK_GPU(gpuHostGetDevicePointer(&recDev, rec, 0));
  s.errDev = static_cast<core::DeviceErrorRecord*>(recDev);

  s.peerBasesDev = DeviceCopyOf(s.heap->PeerBases());
  s.transportDev = DeviceCopyOf(s.context->Transports());
  s.nodeOfDev = DeviceCopyOf(s.context->NodesOfPes());
  s.localRankOfDev = DeviceCopyOf(s.context->LocalRanksOfPes());
  s.barrierEpochDev = DeviceCopyOf(std::vector<uint64_t>{0});

  ShmemDeviceContext& c = s.devCtx;
  c.rank = rank;
  c.worldSize = worldSize;
  c.heapBase = reinterpret_cast<uintptr_t>(s.heap->Base());
  c.heapSize = s.heap->Size();
  c.peerHeapBases = s.peerBasesDev;
  c.transport = s.transportDev;
  c.nodeOf = s.nodeOfDev;
  c.localRankOf = s.localRankOfDev;
  c.numNodes = s.context->NumNodes();
  c.syncArea = reinterpret_cast<uint64_t*>(c.heapBase + s.syncAreaOffset);
  c.barrierEpoch = s.barrierEpochDev;
  c.wait.err = s.errDev;
  const int64_t deviceMs = core::Env().deviceTimeoutMs, hostMs = core::Env().hostTimeoutMs;
  MORI_ENSURE(deviceMs >= 1 && deviceMs <= kMaxTimeoutMs, InvalidUsageError,
              "MORI_DEVICE_TIMEOUT_MS=%lld is out of range [1, %lld]",
              static_cast<long long>(deviceMs), static_cast<long long>(kMaxTimeoutMs));
  MORI_ENSURE(hostMs >= 1 && hostMs <= kMaxTimeoutMs, InvalidUsageError,
              "MORI_HOST_TIMEOUT_MS=%lld is out of range [1, %lld]", static_cast<long long>(hostMs),
              static_cast<long long>(kMaxTimeoutMs));
  c.wait.timeoutNs = static_cast<uint64_t>(deviceMs) * 1000000ull;
  c.wait.rank = rank;

  c.rdmaPeers = nullptr;
  c.heapLkey = 0;
  c.userRegions = nullptr;
  if (anyRdma) SetUpRdma(s);
  s.boot->Barrier();  // every PE has mapped every heap before anyone uses it
}

// A pending record as ShmemCheckDeviceError reports it: a claimed record as core::
// DescribeDeviceError gives it; the abort flag without a record (a host wait expired, or
// ShmemAbortDeviceWaits) as an abort.
std::string DescribePending(const core::DeviceErrorRecord& e, int myRank) {
  if (e.claimed != 0) return core::DescribeDeviceError(e);
  return core::StrFormat(
      "rank %d: device work was aborted (a host wait expired earlier, or "
      "ShmemAbortDeviceWaits was called)",
      myRank);
}

// Copies the mapped record if an error is pending. abortFlag is the publication point: the
// device claims the record, fills it, fences and only then raises abortFlag, so a claimed record
// without the flag is still being written.
bool PeekDeviceError(const ShmemState& s, core::DeviceErrorRecord* copy) {
  const volatile core::DeviceErrorRecord* v = s.errHost;
  if (v->abortFlag == 0) return false;
  std::atomic_thread_fence(std::memory_order_acquire);
  std::memcpy(copy, s.errHost, sizeof(*copy));
  return true;
}

// Reads the mapped record; if set, clears it and raises.
void RaiseIfDeviceError(ShmemState& s) {
  core::DeviceErrorRecord copy;
  if (!PeekDeviceError(s, &copy)) return;
  std::memset(s.errHost, 0, sizeof(core::DeviceErrorRecord));
  std::atomic_thread_fence(std::memory_order_seq_cst);
  // A failed RDMA transport may be why a wait expired or the host aborted; a usage error or an
  // error completion names its own cause.
  std::string note;
  const bool waitOrAbort =
      copy.claimed == 0 || copy.kind == static_cast<int32_t>(core::DeviceErrorKind::kTimeout);
  if (waitOrAbort && s.rdma && !s.rdma->FatalError().empty())
    note = "RDMA transport: " + s.rdma->FatalError();
  if (copy.claimed == 0) {
    std::string what = DescribePending(copy, s.devCtx.rank);
    if (!note.empty()) what += "; " + note;
    throw core::TimeoutError(__FILE__, __LINE__, what);
  }
  // Usage errors raise InvalidUsageError, remote failures RemoteError, expired waits TimeoutError.
  core::ThrowDeviceError(copy, __FILE__, __LINE__, note);
}

void RaiseAbortFlag(ShmemState& s) {
  reinterpret_cast<volatile uint32_t*>(&s.errHost->abortFlag)[0] = 1;
}

// Bounded wait for all of this device's work. The runtime's device synchronisation cannot be
// polled, so it runs on a helper thread that a deadline watches. On expiry the abort flag makes
// every bounded device wait give up; if the device still does not drain (a kernel that is not
// ours spins forever), the helper thread is left behind and TimeoutError is raised.
void DeviceSynchronizeBounded(ShmemState& s, const char* what);

// This PE's device work finished and every RDMA request it posted completed: RDMA work requests
// outlive the kernels that posted them (a kernel need not wait for its last signals), so what
// this PE put has landed on its peers only after the quiet.
void DrainBounded(ShmemState& s, const char* what, const char* quietWhat) {
  DeviceSynchronizeBounded(s, what);
  if (s.rdma) {
    LaunchRdmaQuiet(s.devCtx, nullptr);
    DeviceSynchronizeBounded(s, quietWhat);
  }
}

void DeviceSynchronizeBounded(ShmemState& s, const char* what) {
  struct Shared {
    std::mutex m;
    std::condition_variable cv;
    bool done = false;
    gpuError_t err = gpuSuccess;
  };
  auto shared = std::make_shared<Shared>();
  const int device = s.device;
  std::thread worker([shared, device] {
    gpuError_t e = gpuSetDevice(device);
    if (e == gpuSuccess) e = gpuDeviceSynchronize();
    std::lock_guard<std::mutex> lock(shared->m);
    shared->err = e;
    shared->done = true;
    shared->cv.notify_all();
  });
  const auto limit = std::chrono::milliseconds(core::Env().hostTimeoutMs);
  std::unique_lock<std::mutex> lock(shared->m);
  bool finished = shared->cv.wait_for(lock, limit, [&] { return shared->done; });
  if (!finished) {
    RaiseAbortFlag(s);
    finished = shared->cv.wait_for(lock, std::chrono::seconds(5), [&] { return shared->done; });
  }
  lock.unlock();
  if (!finished) {
    worker.detach();
    MORI_THROW(TimeoutError,
               "rank %d: %s: device work did not finish within MORI_HOST_TIMEOUT_MS=%lld ms, nor "
               "5 s after device waits were told to abort (a kernel outside mori?)",
               s.devCtx.rank, what, static_cast<long long>(core::Env().hostTimeoutMs));
  }
  worker.join();
  if (shared->err != gpuSuccess) {
    (void)gpuGetLastError();
    MORI_THROW(GpuRuntimeError, "rank %d: %s: device synchronize failed: %s", s.devCtx.rank, what,
               gpuGetErrorString(shared->err));
  }
}

void InitWith(std::unique_ptr<application::BootstrapNetwork> boot) {
  const core::ScopedProfilerRange range("mori.shmem.init");
  static std::once_flag atExitRegistered;
  std::call_once(atExitRegistered, [] { std::atexit([] { ShmemPrepareProcessExit(); }); });
  std::lock_guard<std::mutex> lock(gMutex);
  MORI_ENSURE(!gState, InvalidUsageError,
              "shmem is already initialised; call shmem_finalize first");
  MORI_ENSURE(boot != nullptr, InvalidUsageError, "ShmemInit: bootstrap is null");
  auto s = std::make_unique<ShmemState>();
  s->boot = std::move(boot);
  try {
    BuildState(*s);
  } catch (...) {
    DestroyState(*s);
    throw;
  }
  gState = std::move(s);
  gInitGeneration++;
}

void ReloadSettings() {
  core::ReloadEnv();
  core::ReloadLogSettings();
}

}  // namespace

void ShmemInit(std::unique_ptr<application::BootstrapNetwork> bootstrap) {
  ReloadSettings();
  InitWith(std::move(bootstrap));
}

UniqueId ShmemGetUniqueId() {
  ReloadSettings();
  application::SocketUniqueId sid = application::SocketBootstrapNetwork::CreateUniqueId();
  UniqueId id;
  std::memcpy(id.bytes, &sid, kUniqueIdBytes);
  return id;
}

void ShmemInitWithUniqueId(int rank, int nranks, const UniqueId& id) {
  ReloadSettings();
  MORI_ENSURE(nranks > 0 && rank >= 0 && rank < nranks, InvalidUsageError,
              "rank %d / nranks %d out of range", rank, nranks);
  application::SocketUniqueId sid = application::SocketUniqueIdFromBytes(id.bytes, kUniqueIdBytes);
  InitWith(std::make_unique<application::SocketBootstrapNetwork>(sid, rank, nranks));
}

void ShmemMpiInit(void* mpiComm) {
  ReloadSettings();
  // The communicator's size is not known here: it is the plugin's MPI_Comm by contract.
  InitWith(std::make_unique<application::MpiPluginBootstrapNetwork>(mpiComm, 0));
}

void ShmemFinalize() {
  std::lock_guard<std::mutex> lock(gMutex);
  if (!gState) return;
  const core::ScopedProfilerRange range("mori.shmem.finalize");
  ShmemState& s = *gState;
  // Peers may still read or write our heap until everyone has finished their device work.
  std::exception_ptr firstError;
  try {
    DrainBounded(s, "shmem_finalize", "shmem_finalize (RDMA quiet)");
  } catch (const std::exception& e) {
    MORI_WARN(kLogInit, "finalize continues after: %s", e.what());
  }
  try {
    s.boot->Barrier();
    // Every PE's device work is done: no more work requests will be posted to our emulator.
    if (s.rdma) s.rdma->Stop();
    // Unmap the peers' heaps everywhere before anyone frees its own, so that the memory is
    // released when finalize returns (see SymmetricHeap::CloseMappings).
    s.heap->CloseMappings();
    s.boot->Barrier();
  } catch (...) {
    firstError = std::current_exception();
  }
  DestroyState(s);
  gState.reset();
  if (firstError) std::rethrow_exception(firstError);
}

bool ShmemProcessExiting() noexcept { return gProcessExiting.load(); }

void ShmemPrepareProcessExit() noexcept {
  gProcessExiting = true;
  std::unique_ptr<ShmemState> abandoned;
  {
    std::lock_guard<std::mutex> lock(gMutex);
    abandoned = std::move(gState);
  }
  if (!abandoned) return;
  try {
    if (abandoned->rdma) abandoned->rdma->Stop();
  } catch (const std::exception& e) {
    MORI_WARN(kLogInit, "process exit: stopping the RDMA transport: %s", e.what());
  } catch (...) {
  }
  // Never destroyed: the bootstrap may hold callbacks into an interpreter that is shutting down,
  // and freeing device memory or unmapping peers' heaps is the driver's job at exit.
  (void)abandoned.release();
}

bool ShmemIsInitialized() {
  std::lock_guard<std::mutex> lock(gMutex);
  return gState != nullptr;
}

int ShmemMyPe() { return State("shmem_mype").devCtx.rank; }
int ShmemNPes() { return State("shmem_npes").devCtx.worldSize; }

TransportType ShmemTransportType(int pe) {
  ShmemState& s = State("shmem_transport_type");
  MORI_ENSURE(pe >= 0 && pe < s.devCtx.worldSize, InvalidUsageError, "pe %d out of range [0, %d)",
              pe, s.devCtx.worldSize);
  return s.context->Transport(pe);
}

int ShmemNodeOf(int pe) {
  ShmemState& s = State("shmem_node_of");
  MORI_ENSURE(pe >= 0 && pe < s.devCtx.worldSize, InvalidUsageError,
              "shmem_node_of: pe %d out of range [0, %d)", pe, s.devCtx.worldSize);
  return s.context->NodeOf(pe);
}
int ShmemNumNodes() { return State("shmem_num_nodes").context->NumNodes(); }
int ShmemLocalRank() { return State("shmem_local_rank").context->LocalRank(); }
int ShmemLocalSize() { return State("shmem_local_size").context->LocalSize(); }
int ShmemPesOnMyGpu() {
  const application::Context& c = *State("shmem_pes_on_my_gpu").context;
  int n = 0;
  for (int pe = 0; pe < c.WorldSize(); pe++) n += c.SameGpu(pe) ? 1 : 0;
  return n;
}

ShmemDeviceContext ShmemGetDeviceContext() { return State("ShmemGetDeviceContext").devCtx; }

void* ShmemMallocAlign(size_t alignment, size_t size) {
  std::lock_guard<std::mutex> lock(gMutex);  // the allocator is not thread-safe by itself
  ShmemState& s = State("shmem_malloc");
  MORI_ENSURE(size > 0, InvalidUsageError, "shmem_malloc: size must be positive");
  if (alignment < 256) alignment = 256;
  MORI_ENSURE((alignment & (alignment - 1)) == 0, InvalidUsageError,
              "shmem_malloc_align: alignment %zu is not a power of two", alignment);
  uint64_t off = s.heap->Allocator().Allocate(size, alignment);
  return static_cast<char*>(s.heap->Base()) + off;
}

void* ShmemMalloc(size_t size) { return ShmemMallocAlign(256, size); }

void ShmemFree(void* ptr) {
  if (ptr == nullptr) return;
  std::lock_guard<std::mutex> lock(gMutex);
  ShmemState& s = State("shmem_free");
  MORI_ENSURE(s.heap->Contains(ptr), InvalidUsageError,
              "shmem_free: %p is not inside the symmetric heap", ptr);
  uint64_t off = s.heap->OffsetOf(ptr);
  MORI_ENSURE(off != s.syncAreaOffset, InvalidUsageError,
              "shmem_free: %p is the library's internal sync area", ptr);
  s.heap->Allocator().Free(off);
}

void* ShmemPtrP2p(const void* ptr, int pe) {
  ShmemState& s = State("shmem_ptr_p2p");
  MORI_ENSURE(pe >= 0 && pe < s.devCtx.worldSize, InvalidUsageError, "pe %d out of range [0, %d)",
              pe, s.devCtx.worldSize);
  if (!s.heap->Contains(ptr)) return nullptr;
  uintptr_t base = s.heap->PeerBase(pe);
  return base == 0 ? nullptr : reinterpret_cast<void*>(base + s.heap->OffsetOf(ptr));
}

SymmMemObj ShmemQueryMemObj(const void* ptr) {
  ShmemState& s = State("ShmemQueryMemObj");
  MORI_ENSURE(s.heap->Contains(ptr), InvalidUsageError,
              "ShmemQueryMemObj: %p is not inside the symmetric heap", ptr);
  SymmMemObj o{};
  o.localPtr = const_cast<void*>(ptr);
  o.heapOffset = s.heap->OffsetOf(ptr);
  o.size = s.heap->Allocator().AllocationSize(o.heapOffset);
  MORI_ENSURE(o.size > 0, InvalidUsageError,
              "ShmemQueryMemObj: %p is not the start of a symmetric allocation", ptr);
  o.peerHeapBases = s.peerBasesDev;
  return o;
}

void ShmemRegisterBuffer(void* ptr, size_t bytes) {
  std::lock_guard<std::mutex> lock(gMutex);
  ShmemState& s = State("shmem_register_buffer");
  MORI_ENSURE(ptr != nullptr && bytes > 0, InvalidUsageError,
              "shmem_register_buffer: empty range (%p, %zu bytes)", ptr, bytes);
  if (!s.rdma) return;  // no RDMA peer: load/store needs no registration
  int slot = -1;
  for (int i = 0; i < kMaxUserRegions; i++) {
    MORI_ENSURE(
        s.userRegions[i].base != reinterpret_cast<uintptr_t>(ptr) || s.userRegions[i].size == 0,
        InvalidUsageError, "shmem_register_buffer: %p is already registered", ptr);
    if (slot < 0 && s.userRegions[i].size == 0) slot = i;
  }
  MORI_ENSURE(
      slot >= 0, InvalidUsageError,
      "shmem_register_buffer: %d buffers are registered already (the limit); deregister one",
      kMaxUserRegions);
  const uint32_t lkey = s.rdma->RegisterLocal(ptr, bytes);
  s.userRegions[slot] = ShmemUserRegion{reinterpret_cast<uintptr_t>(ptr), bytes, lkey, 0};
  MORI_CHECK_GPU(gpuMemcpy(s.userRegionsDev + slot, &s.userRegions[slot], sizeof(ShmemUserRegion),
                           gpuMemcpyHostToDevice));
}

void ShmemDeregisterBuffer(void* ptr) {
  std::lock_guard<std::mutex> lock(gMutex);
  ShmemState& s = State("shmem_deregister_buffer");
  if (!s.rdma) return;
  for (int i = 0; i < kMaxUserRegions; i++) {
    if (s.userRegions[i].size == 0 || s.userRegions[i].base != reinterpret_cast<uintptr_t>(ptr))
      continue;
    // Device lookups stop matching first, then the key goes.
    s.userRegions[i] = ShmemUserRegion{};
    MORI_CHECK_GPU(gpuMemcpy(s.userRegionsDev + i, &s.userRegions[i], sizeof(ShmemUserRegion),
                             gpuMemcpyHostToDevice));
    s.rdma->DeregisterLocal(ptr);
    return;
  }
  MORI_THROW(InvalidUsageError, "shmem_deregister_buffer: %p is not registered", ptr);
}

application::RdmaWireStats ShmemRdmaStats(bool reset) {
  std::lock_guard<std::mutex> lock(gMutex);  // finalize cannot drop the transport meanwhile
  ShmemState& s = State("shmem_rdma_stats");
  if (s.rdma) return s.rdma->WireStats(reset);
  application::RdmaWireStats none;
  none.available = true;
  none.source = "no RDMA peers (every PE is reached by load/store)";
  return none;
}

size_t ShmemHeapFreeBytes() { return State("shmem_heap_free_bytes").heap->Allocator().FreeBytes(); }

void ShmemStreamSynchronize(gpuStream_t stream) {
  ShmemState& s = State("shmem_stream_synchronize");
  if (!core::PollGpuReady([&] { return gpuStreamQuery(stream); }, core::Env().hostTimeoutMs)) {
    // Make every bounded device wait give up so the stream drains, then report.
    RaiseAbortFlag(s);
    MORI_THROW(TimeoutError,
               "rank %d: device work on stream %p did not finish within MORI_HOST_TIMEOUT_MS=%lld "
               "ms; device waits were told to abort",
               s.devCtx.rank, static_cast<void*>(stream),
               static_cast<long long>(core::Env().hostTimeoutMs));
  }
  RaiseIfDeviceError(s);
}

void ShmemCheckDeviceError() { RaiseIfDeviceError(State("shmem_check_device_error")); }

bool ShmemDeviceErrorPending(std::string* description) {
  const ShmemState& s = State("shmem_device_error_pending");
  core::DeviceErrorRecord copy;
  if (!PeekDeviceError(s, &copy)) return false;
  if (description != nullptr) *description = DescribePending(copy, s.devCtx.rank);
  return true;
}

void ShmemAbortDeviceWaits() { RaiseAbortFlag(State("shmem_abort_device_waits")); }

uint32_t ShmemExchangeRdmaPeerKey(int pe, uint32_t rkey) {
  std::lock_guard<std::mutex> lock(gMutex);  // finalize cannot free the table meanwhile
  ShmemState& s = State("shmem_exchange_rdma_peer_key");
  MORI_ENSURE(pe >= 0 && pe < s.devCtx.worldSize, InvalidUsageError,
              "shmem_exchange_rdma_peer_key: pe %d out of range [0, %d)", pe, s.devCtx.worldSize);
  MORI_ENSURE(s.rdmaPeersDev != nullptr && s.context->Transport(pe) == TransportType::kRdma,
              InvalidUsageError,
              "shmem_exchange_rdma_peer_key: PE %d is not reached by RDMA from PE %d", pe,
              s.devCtx.rank);
  // The kernels read the key from this device table at every request (ShmemRdmaPeer::rkey).
  uint32_t* key = &s.rdmaPeersDev[pe].rkey;
  uint32_t previous = 0;
  MORI_CHECK_GPU(gpuMemcpy(&previous, key, sizeof(previous), gpuMemcpyDeviceToHost));
  MORI_CHECK_GPU(gpuMemcpy(key, &rkey, sizeof(rkey), gpuMemcpyHostToDevice));
  return previous;
}

void ShmemBootstrapAllgather(const void* send, void* recv, size_t bytesPerPe) {
  ShmemState& s = State("shmem_bootstrap_allgather");
  MORI_ENSURE(bytesPerPe > 0 && send != nullptr && recv != nullptr, InvalidUsageError,
              "shmem_bootstrap_allgather: empty or null buffers");
  s.boot->Allgather(send, recv, bytesPerPe);
}

void ShmemDeviceSynchronize() {
  DrainBounded(State("shmem_device_synchronize"), "shmem_device_synchronize",
               "shmem_device_synchronize (RDMA quiet)");
}

uint64_t ShmemInitGeneration() {
  std::lock_guard<std::mutex> lock(gMutex);
  return gState ? gInitGeneration : 0;
}

void ShmemBarrierAll() {
  ShmemState& s = State("shmem_barrier_all");
  // What every PE put before the barrier has landed when it returns (as for load/store peers).
  DrainBounded(s, "shmem_barrier_all", "shmem_barrier_all (RDMA quiet)");
  RaiseIfDeviceError(s);
  s.boot->Barrier();
}

void ShmemBarrierOnStream(gpuStream_t stream) {
  ShmemState& s = State("shmem_barrier_on_stream");
  LaunchDeviceBarrier(s.devCtx, stream);
}

}  // namespace mori::shmem

// Host part of the verbs RDMA transport (see verbs_transport.hpp). No GPU runtime here: the GPU
// is reached only through GpuHostAccess.
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>

#include "mori/application/rdma/doorbell_proxy.hpp"
#include "mori/application/rdma/ibverbs_loader.hpp"
#include "mori/application/rdma/mlx5dv_queue.hpp"
#include "mori/application/rdma/nic_affinity.hpp"
#include "mori/application/rdma/rdma_devices.hpp"
#include "mori/application/rdma/rdma_setup.hpp"
#include "mori/application/rdma/verbs_transport.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/logging.hpp"

namespace mori::application {

RdmaDoorbellPolicy ParseRdmaDoorbellPolicy(const std::string& text) {
  std::string t;
  for (char c : text) {
    if (!std::isspace(static_cast<unsigned char>(c))) {
      t += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    }
  }
  if (t.empty() || t == "auto") return RdmaDoorbellPolicy::kAuto;
  if (t == "uar") return RdmaDoorbellPolicy::kUar;
  if (t == "cpu") return RdmaDoorbellPolicy::kCpu;
  MORI_THROW(InvalidUsageError, "MORI_RDMA_DOORBELL=\"%s\": expected auto, uar or cpu",
             text.c_str());
}

const char* RdmaDoorbellPolicyName(RdmaDoorbellPolicy p) {
  switch (p) {
    case RdmaDoorbellPolicy::kAuto: return "auto";
    case RdmaDoorbellPolicy::kUar: return "uar";
    case RdmaDoorbellPolicy::kCpu: return "cpu";
  }
  return "?";
}

namespace {

// Exchanged by allgather before any QP is connected, and again after.
struct PeRecord {
  int32_t status;  // kStatus*
  int32_t numQp;
  uint32_t rkey;
  uint32_t pad;
  uint64_t heapIova;
  char error[232];
};
static_assert(sizeof(PeRecord) == 256, "PeRecord layout");
constexpr int32_t kStatusOk = 0;
constexpr int32_t kStatusFailed = 1;
constexpr int32_t kStatusNoRdma = 2;

// The text peers see: a typed error's message (without file:line), else what().
void SetError(PeRecord* r, const std::exception& e) {
  r->status = kStatusFailed;
  const auto* typed = dynamic_cast<const core::Error*>(&e);
  std::snprintf(r->error, sizeof(r->error), "%s", typed ? typed->Message().c_str() : e.what());
}

bool IsPowerOfTwo(uint32_t v) { return v != 0 && (v & (v - 1)) == 0; }

class VerbsRdmaTransport final : public RdmaTransport {
 public:
  VerbsRdmaTransport(const VerbsTransportSetup& s, const VerbsLibraries& l,
                     std::unique_ptr<GpuHostAccess> g)
      : setup(s), libs(l), gpu(std::move(g)) {}
  ~VerbsRdmaTransport() override { Release(); }

  void Build(BootstrapNetwork& boot);

  std::string Describe() const override {
    if (rdmaPeers.empty()) return "verbs, no RDMA peers";
    return "verbs " + deviceName +
           (mode == core::rdma::DoorbellMode::kUar ? ", UAR doorbell" : ", CPU-assisted doorbell");
  }
  uint32_t HeapLkey() const override { return heapMr ? heapMr->Lkey() : 0; }
  const std::vector<RdmaPeerEndpoints>& Peers() const override { return peers; }
  void Stop() override {
    if (proxy) proxy->Stop(setup.stopTimeoutMs);
  }
  std::string FatalError() const override { return proxy ? proxy->FatalError() : std::string(); }
  RdmaWireStats WireStats(bool) override {
    RdmaWireStats s;
    s.available = false;
    s.source =
        "not available: the verbs transport does not count work requests (the software "
        "queue emulator does, MORI_RDMA_EMULATE=1)";
    return s;
  }
  uint32_t RegisterLocal(void* ptr, size_t bytes) override;
  void DeregisterLocal(void* ptr) override;

 private:
  // One registration of [ptr, ptr + bytes): dma-buf first (device memory), else ibv_reg_mr.
  std::unique_ptr<RdmaMemoryRegion> RegisterRange(void* ptr, size_t bytes, const char* what);
  void SetUpLocal();
  void ConnectAll(const std::vector<RdmaConnectionInfo>& remote);
  void Release() noexcept;

  VerbsTransportSetup setup;
  VerbsLibraries libs;
  std::vector<int> rdmaPeers;
  std::string deviceName;
  int portNum = 0;
  core::rdma::DoorbellMode mode = core::rdma::DoorbellMode::kMailbox;
  size_t pageBytes = 4096;

  // Released in reverse order by Release().
  std::unique_ptr<GpuHostAccess> gpu;
  std::unique_ptr<GpuHostRegistry> registry;
  std::unique_ptr<RdmaProtectionDomain> pd;
  std::unique_ptr<RdmaMemoryRegion> heapMr;
  std::mutex userMu;
  std::map<void*, std::unique_ptr<RdmaMemoryRegion>> userMrs;  // RegisterLocal
  std::vector<std::unique_ptr<RdmaRcQueuePair>> qps;           // [peer index][qp], flattened
  std::vector<Mlx5QueueMemory> queues;                         // parallel to qps
  core::rdma::QpCounters* countersHost = nullptr;
  core::rdma::QpCounters* countersDevice = nullptr;
  std::unique_ptr<DoorbellProxy> proxy;

  std::vector<RdmaPeerEndpoints> peers;
};

void VerbsRdmaTransport::Release() noexcept {
  try {
    if (proxy) proxy->Stop(setup.stopTimeoutMs);
  } catch (const std::exception& e) {
    MORI_ERROR(kLogRdma, "verbs transport: %s", e.what());
  }
  proxy.reset();  // joins
  // GPU registrations of provider memory go before the provider frees it (QP/CQ destruction).
  if (registry) registry->ReleaseAll();
  if (countersHost != nullptr) gpu->FreeMappedHost(countersHost);
  countersHost = nullptr;
  countersDevice = nullptr;
  while (!qps.empty()) qps.pop_back();
  userMrs.clear();
  heapMr.reset();
  pd.reset();
  registry.reset();
}

std::unique_ptr<RdmaMemoryRegion> VerbsRdmaTransport::RegisterRange(void* ptr, size_t bytes,
                                                                    const char* what) {
  int fd = -1;
  uint64_t offset = 0;
  std::string dmabufWhy;
  if (!gpu->ExportDmabuf(ptr, bytes, &fd, &offset, &dmabufWhy)) {
    MORI_INFO(kLogRdma, "PE %d: %s dma-buf export unavailable (%s); registering with ibv_reg_mr",
              setup.rank, what, dmabufWhy.c_str());
    fd = -1;
  }
  std::unique_ptr<RdmaMemoryRegion> mr;
  try {
    mr = std::make_unique<RdmaMemoryRegion>(*pd, ptr, bytes, fd, offset);
  } catch (...) {
    if (fd >= 0) close(fd);
    throw;
  }
  if (fd >= 0) close(fd);  // the registration holds its own reference to the dma-buf
  return mr;
}

uint32_t VerbsRdmaTransport::RegisterLocal(void* ptr, size_t bytes) {
  MORI_ENSURE(ptr != nullptr && bytes > 0, InvalidUsageError,
              "RDMA buffer registration: empty range (%p, %zu bytes)", ptr, bytes);
  MORI_ENSURE(pd != nullptr, InvalidUsageError,
              "RDMA buffer registration: this PE has no RDMA device (no RDMA peers)");
  std::lock_guard<std::mutex> lock(userMu);
  MORI_ENSURE(userMrs.count(ptr) == 0, InvalidUsageError,
              "RDMA buffer registration: %p is already registered", ptr);
  std::unique_ptr<RdmaMemoryRegion> mr = RegisterRange(ptr, bytes, "user buffer");
  const uint32_t lkey = mr->Lkey();
  userMrs[ptr] = std::move(mr);
  return lkey;
}

void VerbsRdmaTransport::DeregisterLocal(void* ptr) {
  std::lock_guard<std::mutex> lock(userMu);
  auto it = userMrs.find(ptr);
  MORI_ENSURE(it != userMrs.end(), InvalidUsageError,
              "RDMA buffer deregistration: %p is not registered", ptr);
  userMrs.erase(it);
}

void VerbsRdmaTransport::SetUpLocal() {
  const RdmaTransportConfig& cfg = setup.config;
  MORI_ENSURE(cfg.numQpPerPe >= 1 && cfg.numQpPerPe <= 256, InvalidUsageError,
              "MORI_NUM_QP_PER_PE=%d: expected 1..256", cfg.numQpPerPe);
  MORI_ENSURE(IsPowerOfTwo(cfg.sqBlocks) && cfg.sqBlocks <= 32768, InvalidUsageError,
              "RDMA SQ size %u basic blocks: expected a power of two up to 32768", cfg.sqBlocks);
  MORI_ENSURE(setup.heapBase != nullptr && setup.heapSize > 0, InvalidUsageError,
              "verbs transport: no heap to register");
  if (libs.verbs == nullptr) {
    MORI_THROW(SystemError, "RDMA peers but no verbs: %s", libs.verbsWhy.c_str());
  }
  if (libs.mlx5 == nullptr) {
    MORI_THROW(SystemError, "RDMA peers but no mlx5 direct verbs: %s", libs.mlx5Why.c_str());
  }
  const IbverbsApi& api = *libs.verbs;

  // 1. NIC and port.
  std::string why;
  std::vector<RdmaDeviceInfo> devices =
      DiscoverRdmaDevicesWith(api, setup.deviceFilter, setup.sysfsClassDir, &why);
  if (devices.empty())
    MORI_THROW(SystemError, "no RDMA device for PE %d: %s", setup.rank, why.c_str());
  NicChoice choice = ChooseNicForGpu(setup.gpuPciBusId, devices, setup.pciDevicesDir);
  const RdmaDeviceInfo& dev = devices[static_cast<size_t>(choice.index)];
  deviceName = dev.name;
  for (const RdmaPortInfo& p : dev.ports) {
    if (p.Active()) {
      portNum = p.port;
      break;
    }
  }
  MORI_ENSURE(portNum > 0, SystemError, "RDMA device %s has no ACTIVE port", deviceName.c_str());
  MORI_INFO(kLogRdma, "PE %d: GPU %s uses %s port %d (%s)", setup.rank,
            setup.gpuPciBusId.empty() ? "?" : setup.gpuPciBusId.c_str(), deviceName.c_str(),
            portNum, choice.reason.c_str());

  // 2. PD and the heap, registered once.
  pd = std::make_unique<RdmaProtectionDomain>(api, deviceName);
  heapMr = RegisterRange(setup.heapBase, setup.heapSize, "heap");
  MORI_INFO(kLogRdma, "PE %d: heap %p (+%llu) registered on %s via %s, lkey 0x%x rkey 0x%x",
            setup.rank, setup.heapBase, static_cast<unsigned long long>(setup.heapSize),
            deviceName.c_str(), heapMr->ViaDmabuf() ? "dma-buf" : "ibv_reg_mr", heapMr->Lkey(),
            heapMr->Rkey());

  // 3./4. Queue pairs, their provider memory, counters.
  registry = std::make_unique<GpuHostRegistry>(*gpu, pageBytes);
  RdmaQpConfig qc;
  qc.portNum = portNum;
  qc.cqDepth = static_cast<int>(cfg.sqBlocks);
  qc.maxSendWr = static_cast<int>(cfg.sqBlocks);
  qc.maxRecvWr = 0;
  qc.sysfsClassDir = setup.sysfsClassDir;
  const size_t numQueues = rdmaPeers.size() * static_cast<size_t>(cfg.numQpPerPe);
  for (size_t i = 0; i < numQueues; i++) {
    qps.push_back(std::make_unique<RdmaRcQueuePair>(*pd, qc));
    queues.push_back(
        InitMlx5Queue(*libs.mlx5, qps.back()->Qp(), qps.back()->Cq(), cfg.sqBlocks, deviceName));
  }
  countersHost = static_cast<core::rdma::QpCounters*>(
      gpu->AllocMappedHost(numQueues * sizeof(core::rdma::QpCounters)));
  void* dev0 = nullptr;
  if (!gpu->DevicePointer(countersHost, &dev0, &why)) {
    MORI_THROW(GpuRuntimeError, "device pointer of the RDMA queue counters: %s", why.c_str());
  }
  countersDevice = static_cast<core::rdma::QpCounters*>(dev0);

  // 5. Doorbell mode: every QP's UAR mapped, or none used.
  mode = core::rdma::DoorbellMode::kMailbox;
  std::vector<void*> uarDevice(numQueues, nullptr);
  if (setup.doorbell != RdmaDoorbellPolicy::kCpu) {
    std::string uarWhy;
    bool all = true;
    for (size_t i = 0; i < numQueues && all; i++) {
      uarDevice[i] = registry->TryMap(queues[i].uarReg, sizeof(uint64_t), /*io=*/true, &uarWhy);
      all = uarDevice[i] != nullptr;
    }
    if (all) {
      mode = core::rdma::DoorbellMode::kUar;
    } else if (setup.doorbell == RdmaDoorbellPolicy::kUar) {
      MORI_THROW(GpuRuntimeError,
                 "MORI_RDMA_DOORBELL=uar: the UAR page of %s cannot be mapped for the GPU: %s",
                 deviceName.c_str(), uarWhy.c_str());
    } else {
      MORI_INFO(kLogRdma, "PE %d: UAR of %s not mappable for the GPU (%s); CPU-assisted doorbell",
                setup.rank, deviceName.c_str(), uarWhy.c_str());
    }
  }

  std::vector<DoorbellProxyQueue> proxyQueues;
  peers.assign(static_cast<size_t>(setup.worldSize), RdmaPeerEndpoints{});
  for (size_t k = 0; k < rdmaPeers.size(); k++) {
    RdmaPeerEndpoints& pe = peers[static_cast<size_t>(rdmaPeers[k])];
    for (int j = 0; j < cfg.numQpPerPe; j++) {
      const size_t i = k * static_cast<size_t>(cfg.numQpPerPe) + static_cast<size_t>(j);
      const Mlx5QueueMemory& m = queues[i];
      void* sqRing = registry->Map(m.sqBuf, size_t{m.sqBlocks} * 64, false, "RDMA SQ ring");
      void* sqDbrec = registry->Map(m.sqDbrec, sizeof(uint32_t), false, "RDMA SQ doorbell record");
      void* cqRing = registry->Map(m.cqBuf, size_t{m.numCqes} * 64, false, "RDMA CQ ring");
      void* cqDbrec = registry->Map(m.cqDbrec, sizeof(uint32_t), false, "RDMA CQ doorbell record");
      core::rdma::QpEndpoint ep = core::rdma::MakeEndpoint(sqRing, m.sqBlocks, m.qpn, cqRing,
                                                           m.numCqes, countersDevice + i);
      ep.sq.dbrec = static_cast<uint32_t*>(sqDbrec);
      ep.cq.dbrec = static_cast<uint32_t*>(cqDbrec);
      if (mode == core::rdma::DoorbellMode::kUar) {
        ep.sq.doorbell = static_cast<uint64_t*>(uarDevice[i]);
        ep.sq.doorbellMode = core::rdma::DoorbellMode::kUar;
      } else {
        proxyQueues.push_back({&countersHost[i].ready, &countersHost[i].doorbellMailbox,
                               static_cast<uint64_t*>(m.uarReg), m.qpn});
      }
      pe.qps.push_back(ep);
    }
  }
  if (mode == core::rdma::DoorbellMode::kMailbox) {
    proxy = std::make_unique<DoorbellProxy>(std::move(proxyQueues));
  }
}

void VerbsRdmaTransport::ConnectAll(const std::vector<RdmaConnectionInfo>& remote) {
  const int nq = setup.config.numQpPerPe;
  for (size_t k = 0; k < rdmaPeers.size(); k++) {
    const int p = rdmaPeers[k];
    for (int j = 0; j < nq; j++) {
      const RdmaConnectionInfo& r = remote[static_cast<size_t>(p) * nq + j];
      try {
        qps[k * nq + j]->Connect(r);
      } catch (const core::Error& e) {
        MORI_THROW(SystemError, "PE %d: QP %d of %d towards PE %d on %s: %s", setup.rank, j, nq, p,
                   deviceName.c_str(), e.Message().c_str());
      }
    }
  }
}

void VerbsRdmaTransport::Build(BootstrapNetwork& boot) {
  MORI_ENSURE(boot.Rank() == setup.rank && boot.WorldSize() == setup.worldSize &&
                  setup.transports.size() == static_cast<size_t>(setup.worldSize),
              InvalidUsageError,
              "verbs transport: rank %d / world %d / %zu transports disagree with the bootstrap "
              "(rank %d of %d)",
              setup.rank, setup.worldSize, setup.transports.size(), boot.Rank(), boot.WorldSize());
  const long sys = sysconf(_SC_PAGESIZE);
  pageBytes = setup.pageBytes != 0 ? setup.pageBytes : (sys > 0 ? static_cast<size_t>(sys) : 4096);
  for (int p = 0; p < setup.worldSize; p++) {
    if (p != setup.rank && setup.transports[static_cast<size_t>(p)] == TransportType::kRdma) {
      rdmaPeers.push_back(p);
    }
  }
  peers.assign(static_cast<size_t>(setup.worldSize), RdmaPeerEndpoints{});
  const int nq = setup.config.numQpPerPe;
  const size_t n = static_cast<size_t>(setup.worldSize);

  // Local set-up; a failure is reported to every PE before anyone raises.
  PeRecord mine{};
  mine.numQp = nq;
  mine.status = rdmaPeers.empty() ? kStatusNoRdma : kStatusOk;
  std::exception_ptr localError;
  if (!rdmaPeers.empty()) {
    try {
      SetUpLocal();
      mine.rkey = heapMr->Rkey();
      mine.heapIova = heapMr->Addr();
    } catch (const std::exception& e) {
      SetError(&mine, e);
      localError = std::current_exception();
    }
  }
  std::vector<PeRecord> all(n);
  boot.Allgather(&mine, all.data(), sizeof(PeRecord));
  if (localError) std::rethrow_exception(localError);
  for (size_t p = 0; p < n; p++) {
    if (all[p].status == kStatusFailed) {
      all[p].error[sizeof(all[p].error) - 1] = '\0';
      MORI_THROW(RemoteError, "PE %zu could not set up its RDMA transport: %s", p, all[p].error);
    }
    if (all[p].numQp != nq) {
      MORI_THROW(InvalidUsageError,
                 "MORI_NUM_QP_PER_PE differs between PEs (%d on PE %d, %d on PE %zu); it must be "
                 "the same everywhere",
                 nq, setup.rank, all[p].numQp, p);
    }
  }
  for (int p : rdmaPeers) {
    if (all[static_cast<size_t>(p)].status != kStatusOk) {
      MORI_THROW(RemoteError, "PE %d reaches PE %d through RDMA, but PE %d has no RDMA peers",
                 setup.rank, p, p);
    }
    peers[static_cast<size_t>(p)].rkey = all[static_cast<size_t>(p)].rkey;
    peers[static_cast<size_t>(p)].remoteHeapBase = all[static_cast<size_t>(p)].heapIova;
  }

  // Connection table: block p holds our QPs towards PE p.
  std::vector<RdmaConnectionInfo> send(n * static_cast<size_t>(nq)), recv(send.size());
  for (size_t k = 0; k < rdmaPeers.size(); k++) {
    for (int j = 0; j < nq; j++) {
      send[static_cast<size_t>(rdmaPeers[k]) * nq + j] = qps[k * nq + j]->LocalInfo();
    }
  }
  boot.AllToAll(send.data(), recv.data(), sizeof(RdmaConnectionInfo) * static_cast<size_t>(nq));

  PeRecord outcome{};
  outcome.numQp = nq;
  try {
    ConnectAll(recv);
  } catch (const std::exception& e) {
    SetError(&outcome, e);
    localError = std::current_exception();
  }
  boot.Allgather(&outcome, all.data(), sizeof(PeRecord));
  if (localError) std::rethrow_exception(localError);
  for (size_t p = 0; p < n; p++) {
    if (all[p].status == kStatusFailed) {
      all[p].error[sizeof(all[p].error) - 1] = '\0';
      MORI_THROW(RemoteError, "PE %zu could not connect its RDMA queue pairs: %s", p, all[p].error);
    }
  }
  if (proxy) proxy->Start();
  if (!rdmaPeers.empty()) {
    MORI_INFO(kLogRdma, "PE %d: %s, %zu RDMA peers x %d QPs, SQ %u blocks", setup.rank,
              Describe().c_str(), rdmaPeers.size(), nq, setup.config.sqBlocks);
  }
}

}  // namespace

std::unique_ptr<RdmaTransport> CreateVerbsRdmaTransportWith(BootstrapNetwork& boot,
                                                            const VerbsTransportSetup& setup,
                                                            const VerbsLibraries& libs,
                                                            std::unique_ptr<GpuHostAccess> gpu) {
  MORI_ENSURE(gpu != nullptr, InvalidUsageError, "verbs transport needs a GpuHostAccess");
  auto t = std::make_unique<VerbsRdmaTransport>(setup, libs, std::move(gpu));
  t->Build(boot);  // on failure `t` releases what was built, in reverse order
  return t;
}

}  // namespace mori::application

// The verbs RDMA transport's host side on a machine without NIC or GPU:
//  * GPU<->NIC affinity on a temporary sysfs tree;
//  * GpuHostRegistry (page-granular GPU registration of provider memory) with a recording fake;
//  * the CPU-assisted doorbell proxy: host threads post with core::rdma::PostWqe (the emulator
//    completes the WQEs), the proxy copies mailbox values to fake "UAR registers" in memory;
//  * libmlx5 loading at MLX5_1.2 and InitMlx5Queue against a stand-in libmlx5 (fake_mlx5.cpp)
//    over QPs of the stand-in libibverbs (fake_ibverbs.cpp);
//  * CreateVerbsRdmaTransportWith with ranks as threads over an in-process bootstrap, the fakes,
//    and an identity "GPU" (GpuHostAccess) that checks every pointer handed to the GPU was
//    registered first. The GPU runtime half (verbs_transport.cpp: gpuHostRegister, dma-buf
//    export, bus id) is not run here: it needs a GPU.
#include "mori/application/rdma/verbs_transport.hpp"

#include <dlfcn.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "../core/scoped_env.hpp"
#include "mori/application/rdma/doorbell_proxy.hpp"
#include "mori/application/rdma/gpu_host_access.hpp"
#include "mori/application/rdma/ibverbs_loader.hpp"
#include "mori/application/rdma/mlx5dv_queue.hpp"
#include "mori/application/rdma/nic_affinity.hpp"
#include "mori/application/rdma/queue_emulator.hpp"
#include "mori/application/rdma/rdma_setup.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/transport/rdma_queue.hpp"

#if __has_include(<infiniband/mlx5dv.h>)
#include <infiniband/mlx5dv.h>
#endif

namespace mori::application {
namespace {

namespace fs = std::filesystem;
using core::rdma::DoorbellMode;
using core::rdma::QpEndpoint;

std::string MessageOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const core::Error& e) {
    return e.Message();
  }
  return "<no exception>";
}

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/mori_verbs_XXXXXX";
    path = mkdtemp(tmpl);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string path;
};

// --- NIC affinity ----------------------------------------------------------------------------
// sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/{0000:02:00.0 GPU, 0000:02:01.0 NIC A}
// sys/devices/pci0000:00/0000:00:02.0/0000:03:00.0                   NIC C (same root complex)
// sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0                   NIC B (NUMA 1)
// sys/bus/pci/devices/<bdf> -> ../../../devices/...
class FakePciTree {
 public:
  FakePciTree() {
    Add("0000:02:00.0", "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0", 0);
    Add("0000:02:01.0", "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0", 0);
    Add("0000:03:00.0", "pci0000:00/0000:00:02.0/0000:03:00.0", 0);
    Add("0000:81:00.0", "pci0000:80/0000:80:01.0/0000:81:00.0", 1);
    Add("0000:c1:00.0", "pci0000:c0/0000:c0:01.0/0000:c1:00.0", 1);  // a GPU on NUMA 1
  }
  std::string Devices() const { return dir.path + "/sys/bus/pci/devices"; }

 private:
  void Add(const std::string& bdf, const std::string& rel, int numa) {
    const std::string real = dir.path + "/sys/devices/" + rel;
    fs::create_directories(real);
    std::FILE* f = std::fopen((real + "/numa_node").c_str(), "w");
    std::fprintf(f, "%d\n", numa);
    std::fclose(f);
    fs::create_directories(dir.path + "/sys/bus/pci/devices");
    fs::create_symlink("../../../devices/" + rel, dir.path + "/sys/bus/pci/devices/" + bdf);
  }
  TempDir dir;
};

RdmaDeviceInfo Nic(const std::string& name, const std::string& bdf, int numa) {
  RdmaDeviceInfo d;
  d.name = name;
  d.pciBusId = bdf;
  d.numaNode = numa;
  return d;
}

TEST(NicAffinity, NormalizesBusIds) {
  EXPECT_EQ(NormalizePciBusId("0000:17:00.0"), "0000:17:00.0");
  EXPECT_EQ(NormalizePciBusId("00000000:17:00.0"), "0000:17:00.0");
  EXPECT_EQ(NormalizePciBusId(" 0000:AB:00.1\n"), "0000:ab:00.1");
  EXPECT_EQ(NormalizePciBusId("00010000:17:00.0"), "10000:17:00.0");
  EXPECT_EQ(NormalizePciBusId(""), "");
}

TEST(NicAffinity, ShortestPciePathWins) {
  FakePciTree t;
  const std::vector<RdmaDeviceInfo> all = {Nic("mlx5_b", "0000:81:00.0", 1),
                                           Nic("mlx5_c", "0000:03:00.0", 0),
                                           Nic("mlx5_a", "0000:02:01.0", 0)};
  EXPECT_EQ(PciDevicePath(t.Devices(), "0000:02:00.0").size(),
            PciDevicePath(t.Devices(), "0000:02:01.0").size());
  NicChoice c = ChooseNicForGpu("0000:02:00.0", all, t.Devices());
  EXPECT_EQ(c.index, 2);  // behind the same switch
  EXPECT_EQ(c.gpuNuma, 0);
  EXPECT_NE(c.reason.find("closest on PCIe"), std::string::npos) << c.reason;
  // Same answer for the runtime's 8-digit upper-case form.
  EXPECT_EQ(ChooseNicForGpu("00000000:02:00.0", all, t.Devices()).index, 2);
  // Without it: the NIC under the same root complex beats the one on the other socket.
  NicChoice c2 = ChooseNicForGpu("0000:02:00.0", {all[0], all[1]}, t.Devices());
  EXPECT_EQ(c2.index, 1);
  EXPECT_GT(c2.sharedComponents, 0);
  // A GPU on NUMA 1 under its own root complex: path ties (only /sys/devices shared) -> NUMA.
  NicChoice c3 = ChooseNicForGpu("0000:c1:00.0", {all[1], all[2], all[0]}, t.Devices());
  EXPECT_EQ(c3.index, 2);
  EXPECT_TRUE(c3.sameNuma);
  EXPECT_NE(c3.reason.find("same NUMA node 1"), std::string::npos) << c3.reason;
}

TEST(NicAffinity, FallsBackToOrder) {
  FakePciTree t;
  // Unknown GPU: nothing shared, NUMA unknown -> the first device.
  NicChoice c = ChooseNicForGpu(
      "0000:99:00.0", {Nic("x", "0000:81:00.0", 1), Nic("y", "0000:02:01.0", 0)}, t.Devices());
  EXPECT_EQ(c.index, 0);
  EXPECT_EQ(c.gpuNuma, -1);
  EXPECT_EQ(c.reason, "first in device order");
  EXPECT_EQ(ChooseNicForGpu("", {Nic("x", "", -1)}, t.Devices()).reason, "only device");
  NicChoice none = ChooseNicForGpu("0000:02:00.0", {}, t.Devices());
  EXPECT_EQ(none.index, -1);
}

// --- GPU registrations -----------------------------------------------------------------------
// Identity "GPU": device pointer == host pointer, but only for memory registered or allocated
// through it, so a test fails if the transport hands the GPU an unregistered pointer.
class FakeGpu : public GpuHostAccess {
 public:
  struct Registration {
    uintptr_t base;
    size_t bytes;
    bool io;
  };
  std::function<int()> liveQps;  // sampled at each unregistration (must still be alive)

  bool RegisterHost(void* base, size_t bytes, bool io, std::string* why) override {
    std::lock_guard<std::mutex> lock(mu);
    if (io && refuseIo) {
      *why = "operation not supported (fake)";
      return false;
    }
    if (reinterpret_cast<uintptr_t>(base) % 4096 != 0) {
      *why = "not page aligned";
      return false;
    }
    for (const Registration& r : regs) {
      if (Overlap(r, reinterpret_cast<uintptr_t>(base), bytes)) {
        *why = "already registered";  // as cudaErrorHostMemoryAlreadyRegistered
        return false;
      }
    }
    regs.push_back({reinterpret_cast<uintptr_t>(base), bytes, io});
    everRegistered.push_back(regs.back());
    return true;
  }
  void UnregisterHost(void* base) noexcept override {
    std::lock_guard<std::mutex> lock(mu);
    for (size_t i = 0; i < regs.size(); i++) {
      if (regs[i].base == reinterpret_cast<uintptr_t>(base)) {
        regs.erase(regs.begin() + static_cast<long>(i));
        unregisterOrder.push_back(reinterpret_cast<uintptr_t>(base));
        if (liveQps) liveQpsAtUnregister.push_back(liveQps());
        return;
      }
    }
    badUnregister++;
  }
  bool DevicePointer(void* host, void** device, std::string* why) override {
    std::lock_guard<std::mutex> lock(mu);
    const uintptr_t a = reinterpret_cast<uintptr_t>(host);
    for (const Registration& r : regs) {
      if (Overlap(r, a, 1)) {
        *device = host;
        return true;
      }
    }
    for (const auto& [p, n] : allocations) {
      if (a >= reinterpret_cast<uintptr_t>(p) && a < reinterpret_cast<uintptr_t>(p) + n) {
        *device = host;
        return true;
      }
    }
    *why = "not registered (fake)";
    return false;
  }
  void* AllocMappedHost(size_t bytes) override {
    void* p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
    std::memset(p, 0, bytes);
    std::lock_guard<std::mutex> lock(mu);
    allocations[p] = bytes;
    return p;
  }
  void FreeMappedHost(void* p) noexcept override {
    std::lock_guard<std::mutex> lock(mu);
    allocations.erase(p);
    std::free(p);
  }
  bool ExportDmabuf(void*, size_t, int* fd, uint64_t* offset, std::string* why) override {
    if (dmabufOffset < 0) {
      *why = "unsupported (fake)";
      return false;
    }
    *fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    exportedFd = *fd;
    *offset = static_cast<uint64_t>(dmabufOffset);
    return true;
  }

  static bool Overlap(const Registration& r, uintptr_t a, size_t n) {
    return a < r.base + r.bytes && r.base < a + n;
  }

  std::mutex mu;
  bool refuseIo = false;
  long dmabufOffset = -1;  // < 0: export unsupported
  int exportedFd = -1;
  std::vector<Registration> regs, everRegistered;
  std::vector<uintptr_t> unregisterOrder;
  std::vector<int> liveQpsAtUnregister;
  std::map<void*, size_t> allocations;
  int badUnregister = 0;
};

TEST(GpuHostRegistry, SharedPagesRegisteredOnceReleasedInReverse) {
  FakeGpu gpu;
  std::vector<uint8_t> mem(6 * 4096 + 4096);
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(mem.data()) + 4095) &
                                             ~uintptr_t{4095});
  {
    GpuHostRegistry reg(gpu, 4096);
    EXPECT_EQ(reg.Map(base + 8, 4, false, "dbrec A"), base + 8);
    EXPECT_EQ(reg.Map(base + 16, 4, false, "dbrec B"), base + 16);  // same page: no new call
    EXPECT_EQ(reg.Registrations(), 1u);
    // Spans the registered page and two new ones: one call for the run of new pages.
    EXPECT_EQ(reg.Map(base + 100, 3 * 4096 - 200, false, "ring"), base + 100);
    EXPECT_EQ(reg.Registrations(), 2u);
    EXPECT_EQ(gpu.regs[1].base, reinterpret_cast<uintptr_t>(base + 4096));
    EXPECT_EQ(gpu.regs[1].bytes, 2u * 4096);
    // I/O memory on a page already registered as ordinary memory is refused.
    std::string why;
    EXPECT_EQ(reg.TryMap(base + 4096 + 8, 8, true, &why), nullptr);
    EXPECT_NE(why.find("already registered as ordinary"), std::string::npos) << why;
    EXPECT_EQ(reg.TryMap(base + 5 * 4096 + 0x800, 8, true, &why), base + 5 * 4096 + 0x800);
    EXPECT_TRUE(gpu.regs.back().io);
    gpu.refuseIo = true;
    EXPECT_EQ(reg.TryMap(base + 4 * 4096, 8, true, &why), nullptr);
    EXPECT_NE(why.find("operation not supported"), std::string::npos) << why;
    EXPECT_THROW(reg.Map(base + 4 * 4096, 8, true, "uar"), core::GpuRuntimeError);
  }
  EXPECT_TRUE(gpu.regs.empty());
  ASSERT_EQ(gpu.unregisterOrder.size(), 3u);
  EXPECT_EQ(gpu.unregisterOrder[0], reinterpret_cast<uintptr_t>(base + 5 * 4096));
  EXPECT_EQ(gpu.unregisterOrder[2], reinterpret_cast<uintptr_t>(base));
  EXPECT_EQ(gpu.badUnregister, 0);
}

// --- doorbell proxy --------------------------------------------------------------------------
// One endpoint over ordinary memory, executed by the emulator (NOPs need no memory regions).
struct HostQueue {
  explicit HostQueue(uint32_t blocks, uint32_t qpn)
      : ring(blocks * 64), cq(blocks * 64), counters(new core::rdma::QpCounters{}) {
    EmuInitCqRing(cq.data(), blocks);
    ep = core::rdma::MakeEndpoint(ring.data(), blocks, qpn, cq.data(), blocks, counters.get());
  }
  std::vector<uint8_t> ring, cq;
  std::unique_ptr<core::rdma::QpCounters> counters;
  QpEndpoint ep;
  uint64_t fakeUar = 0;  // the "UAR register": ordinary memory
};

uint16_t WqeIndexOf(uint64_t doorbellValue) {
  // First ctrl dword (big-endian): opmod(8) | wqe_index(16) | opcode(8).
  const uint8_t* b = reinterpret_cast<const uint8_t*>(&doorbellValue);
  return static_cast<uint16_t>((b[1] << 8) | b[2]);
}
uint32_t QpnOf(uint64_t doorbellValue) {
  const uint8_t* b = reinterpret_cast<const uint8_t*>(&doorbellValue);
  return (uint32_t{b[4]} << 16) | (uint32_t{b[5]} << 8) | b[6];
}

core::rdma::PostContext HostCtx() {
  return core::rdma::PostContext{10'000'000'000ull, nullptr, 0, 1};
}

TEST(DoorbellProxy, CopiesDoorbellValuesInOrderAcrossWrap) {
  constexpr int kQueues = 2, kThreadsPerQueue = 2, kPerThread = 36000;  // 72000 WQEs per QP
  std::vector<std::unique_ptr<HostQueue>> qs;
  QueueEmulator emu;
  std::vector<DoorbellProxyQueue> pq;
  for (int i = 0; i < kQueues; i++) {
    qs.push_back(std::make_unique<HostQueue>(64, 0x120 + i));
    emu.AddQp(EmuQpFromEndpoint(qs.back()->ep, 0, 1));
    pq.push_back({&qs.back()->counters->ready, &qs.back()->counters->doorbellMailbox,
                  &qs.back()->fakeUar, 0x120u + i});
  }
  std::vector<std::vector<uint64_t>> seen(kQueues);
  std::vector<uint64_t*> target(kQueues, nullptr);
  DoorbellProxy proxy(pq, [&](size_t q, uint64_t* uar, uint64_t v) {
    seen[q].push_back(v);
    target[q] = uar;
    DoorbellProxy::MmioWrite(uar, v);
  });
  emu.Start();
  proxy.Start();
  std::vector<std::thread> posters;
  std::atomic<int> failures{0};
  for (int q = 0; q < kQueues; q++) {
    for (int t = 0; t < kThreadsPerQueue; t++) {
      posters.emplace_back([&, q] {
        core::rdma::WqeDesc d{};
        d.kind = core::rdma::WqeKind::kNop;
        for (int i = 0; i < kPerThread; i++) {
          if (core::rdma::PostWqe(qs[q]->ep, d, HostCtx()).status != core::rdma::QueueStatus::kOk) {
            failures++;
            return;
          }
        }
      });
    }
  }
  for (auto& t : posters) t.join();
  ASSERT_EQ(failures.load(), 0);
  for (auto& q : qs) {
    EXPECT_EQ(core::rdma::Quiet(q->ep, HostCtx()).status, core::rdma::QueueStatus::kOk);
  }
  const auto t0 = std::chrono::steady_clock::now();
  proxy.Stop(2000);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(500));
  emu.Stop();
  EXPECT_TRUE(proxy.FatalError().empty()) << proxy.FatalError();
  for (int q = 0; q < kQueues; q++) {
    const uint64_t total = uint64_t{kThreadsPerQueue} * kPerThread;
    ASSERT_FALSE(seen[q].empty());
    EXPECT_EQ(target[q], &qs[q]->fakeUar);
    // Every value is this QP's, and the WQE indices only move forward (16-bit wrap extended).
    uint64_t extended = 0;
    for (size_t i = 0; i < seen[q].size(); i++) {
      EXPECT_EQ(QpnOf(seen[q][i]), 0x120u + q);
      const uint16_t idx = WqeIndexOf(seen[q][i]);
      const uint64_t next =
          i == 0 ? idx : extended + static_cast<uint16_t>(idx - static_cast<uint16_t>(extended));
      ASSERT_TRUE(i == 0 || next > extended) << "queue " << q << " value " << i;
      extended = next;
    }
    // The last doorbell names the last WQE, and the register holds it.
    EXPECT_EQ(extended, total - 1);
    EXPECT_EQ(qs[q]->fakeUar, qs[q]->counters->doorbellMailbox);
    EXPECT_EQ(qs[q]->fakeUar, seen[q].back());
    EXPECT_LE(seen[q].size(), total);
  }
  EXPECT_EQ(proxy.DoorbellsWritten(), seen[0].size() + seen[1].size());
  proxy.Stop();  // idempotent
}

TEST(DoorbellProxy, StopIsBoundedEvenWhenTheWriterHangs) {
  HostQueue q(16, 0x33);
  std::atomic<bool> entered{false}, release{false};
  DoorbellProxy proxy({{&q.counters->ready, &q.counters->doorbellMailbox, &q.fakeUar, 0x33}},
                      [&](size_t, uint64_t* uar, uint64_t v) {
                        entered = true;
                        while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
                        *uar = v;
                      });
  proxy.Start();
  core::rdma::WqeDesc d{};
  d.kind = core::rdma::WqeKind::kNop;
  ASSERT_EQ(core::rdma::PostWqe(q.ep, d, HostCtx()).status, core::rdma::QueueStatus::kOk);
  while (!entered) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(proxy.Stop(50), core::TimeoutError);
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(took, std::chrono::milliseconds(50));
  EXPECT_LT(took, std::chrono::milliseconds(1000));
  release = true;
  proxy.Stop(2000);
  EXPECT_FALSE(proxy.Running());
  EXPECT_EQ(q.fakeUar, q.counters->doorbellMailbox);
}

TEST(DoorbellProxy, ProcessOnceAndInvariants) {
  HostQueue q(16, 0x44);
  DoorbellProxy proxy({{&q.counters->ready, &q.counters->doorbellMailbox, &q.fakeUar, 0x44}});
  EXPECT_EQ(proxy.ProcessOnce(), 0u);  // nothing published
  core::rdma::WqeDesc d{};
  d.kind = core::rdma::WqeKind::kNop;
  ASSERT_EQ(core::rdma::PostWqe(q.ep, d, HostCtx()).status, core::rdma::QueueStatus::kOk);
  ASSERT_EQ(core::rdma::PostWqe(q.ep, d, HostCtx()).status, core::rdma::QueueStatus::kOk);
  EXPECT_EQ(proxy.ProcessOnce(), 1u);  // two WQEs, one doorbell (the newer covers both)
  EXPECT_EQ(WqeIndexOf(q.fakeUar), 1);
  EXPECT_EQ(proxy.ProcessOnce(), 0u);
  q.counters->ready = 1;  // a broken poster
  proxy.ProcessOnce();
  EXPECT_NE(proxy.FatalError().find("went back from 2 to 1"), std::string::npos)
      << proxy.FatalError();
  EXPECT_THROW(DoorbellProxy({{&q.counters->ready, nullptr, &q.fakeUar, 1}}),
               core::InvalidUsageError);
}

// --- env -------------------------------------------------------------------------------------
TEST(VerbsTransportEnv, DoorbellPolicy) {
  core::testing::ScopedEnv env;
  EXPECT_EQ(core::Env().rdmaDoorbell, "auto");
  EXPECT_EQ(ParseRdmaDoorbellPolicy("auto"), RdmaDoorbellPolicy::kAuto);
  EXPECT_EQ(ParseRdmaDoorbellPolicy(""), RdmaDoorbellPolicy::kAuto);
  EXPECT_EQ(ParseRdmaDoorbellPolicy(" UAR "), RdmaDoorbellPolicy::kUar);
  EXPECT_EQ(ParseRdmaDoorbellPolicy("cpu"), RdmaDoorbellPolicy::kCpu);
  EXPECT_NE(MessageOf([] { ParseRdmaDoorbellPolicy("gpu"); }).find("MORI_RDMA_DOORBELL"),
            std::string::npos);
  env.Set("MORI_RDMA_DOORBELL", "cpu");
  core::ReloadEnv();
  EXPECT_EQ(core::Env().rdmaDoorbell, "cpu");
}

#if defined(MORI_FAKE_IBVERBS_PATH) && defined(MORI_FAKE_MLX5_PATH)
// --- libmlx5 and InitMlx5Queue against the stand-ins -----------------------------------------
using Mlx5SetFn = void (*)(const char*, long);
using Mlx5ResetFn = void (*)();
using Mlx5LookupFn = int (*)(uint32_t, mlx5dv_qp*, mlx5dv_cq*);
using Mlx5OldFn = int (*)();
using LiveFn = int (*)(const char*);
using ResetFn = void (*)();
using RecordFn = int (*)(int, uint32_t*, ibv_qp_attr*, int*);
using CountFn = int (*)();
using RegMrRecordFn = int (*)(int, void**, size_t*, int*, uint64_t*, uint64_t*);

class VerbsFake : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    ASSERT_TRUE(LoadIbverbsApi(MORI_FAKE_IBVERBS_PATH, &verbs, &why)) << why;
    ASSERT_TRUE(LoadMlx5dvApi(MORI_FAKE_MLX5_PATH, &mlx5, &why)) << why;
    Sym(verbs.handle, &live, "fake_ibverbs_live");
    Sym(verbs.handle, &resetVerbs, "fake_ibverbs_reset");
    Sym(verbs.handle, &modifyCount, "fake_ibverbs_modify_qp_count");
    Sym(verbs.handle, &modifyRecord, "fake_ibverbs_modify_qp_record");
    Sym(verbs.handle, &regMrRecord, "fake_ibverbs_reg_mr_record");
    Sym(mlx5.handle, &mlx5Set, "fake_mlx5_set");
    Sym(mlx5.handle, &mlx5Reset, "fake_mlx5_reset");
    Sym(mlx5.handle, &mlx5Lookup, "fake_mlx5_lookup");
    Sym(mlx5.handle, &mlx5OldCalls, "fake_mlx5_old_abi_calls");
    resetVerbs();
    mlx5Reset();
    for (const char* kind : {"pd", "mr", "cq", "qp"}) ASSERT_EQ(live(kind), 0) << kind;
  }
  void TearDown() override {
    if (live != nullptr) {
      for (const char* kind : {"pd", "mr", "cq", "qp"}) EXPECT_EQ(live(kind), 0) << kind;
    }
    if (mlx5Reset != nullptr) mlx5Reset();
    if (resetVerbs != nullptr) resetVerbs();
  }
  template <typename Fn>
  void Sym(void* handle, Fn* fn, const char* name) {
    *fn = reinterpret_cast<Fn>(dlsym(handle, name));
    ASSERT_NE(*fn, nullptr) << name;
  }
  // RTR destination QPN of every QP that reached RTR.
  std::map<uint32_t, uint32_t> RtrDestinations() {
    std::map<uint32_t, uint32_t> out;
    for (int i = 0; i < modifyCount(); i++) {
      uint32_t qpn = 0;
      ibv_qp_attr a{};
      int mask = 0;
      EXPECT_EQ(modifyRecord(i, &qpn, &a, &mask), 0);
      if ((mask & IBV_QP_STATE) != 0 && a.qp_state == IBV_QPS_RTR) out[qpn] = a.dest_qp_num;
    }
    return out;
  }

  IbverbsApi verbs;
  Mlx5dvApi mlx5;
  LiveFn live = nullptr;
  ResetFn resetVerbs = nullptr;
  CountFn modifyCount = nullptr;
  RecordFn modifyRecord = nullptr;
  RegMrRecordFn regMrRecord = nullptr;
  Mlx5SetFn mlx5Set = nullptr;
  Mlx5ResetFn mlx5Reset = nullptr;
  Mlx5LookupFn mlx5Lookup = nullptr;
  Mlx5OldFn mlx5OldCalls = nullptr;
};

TEST_F(VerbsFake, LoaderBindsTheHeaderVersion) {
  std::string why;
  Mlx5dvApi none;
  EXPECT_FALSE(LoadMlx5dvApi("libmlx5_does_not_exist.so.1", &none, &why));
  EXPECT_NE(why.find("libmlx5 not available"), std::string::npos) << why;
  EXPECT_EQ(none.initObj, nullptr);
  // The table's entry point is the MLX5_1.2 one: calling it never reaches the 1.0 stand-in.
  mlx5dv_obj obj{};
  EXPECT_EQ(mlx5.initObj(&obj, 0), 0);
  EXPECT_EQ(mlx5OldCalls(), 0);
  void* old = dlvsym(mlx5.handle, "mlx5dv_init_obj", "MLX5_1.0");
  ASSERT_NE(old, nullptr);
  EXPECT_NE(old, reinterpret_cast<void*>(mlx5.initObj));
}

TEST_F(VerbsFake, InitMlx5QueueTakesProviderMemoryAndChecksIt) {
  RdmaProtectionDomain pd(verbs, "mlx5_0");
  RdmaQpConfig qc;
  qc.maxSendWr = 256;
  qc.cqDepth = 256;
  qc.maxRecvWr = 0;
  RdmaRcQueuePair qp(pd, qc);
  Mlx5QueueMemory m = InitMlx5Queue(mlx5, qp.Qp(), qp.Cq(), 256, "mlx5_0");
  mlx5dv_qp q{};
  mlx5dv_cq c{};
  ASSERT_EQ(mlx5Lookup(qp.LocalInfo().qpn, &q, &c), 0);
  EXPECT_EQ(m.qpn, qp.LocalInfo().qpn);
  EXPECT_EQ(m.sqBuf, q.sq.buf);
  EXPECT_EQ(m.sqBlocks, 256u);
  EXPECT_EQ(m.sqDbrec, reinterpret_cast<uint32_t*>(q.dbrec) + 1);  // MLX5_SND_DBR
  EXPECT_EQ(m.uarReg, q.bf.reg);
  EXPECT_EQ(m.cqBuf, c.buf);
  EXPECT_EQ(m.numCqes, 512u);  // pow2(256 + 1)
  EXPECT_EQ(m.cqDbrec, reinterpret_cast<uint32_t*>(c.dbrec));

  auto expectBad = [&](const char* knob, long value, const char* text) {
    mlx5Set(knob, value);
    std::string msg = MessageOf([&] { InitMlx5Queue(mlx5, qp.Qp(), qp.Cq(), 256, "mlx5_0"); });
    EXPECT_NE(msg.find(text), std::string::npos) << knob << ": " << msg;
    EXPECT_NE(msg.find("mlx5_0"), std::string::npos) << msg;
    mlx5Reset();
  };
  expectBad("stride", 128, "SQ stride is 128");
  expectBad("wqe_cnt", 512, "wqe_cnt (basic blocks) is 512, mori needs 256");
  expectBad("cqe_size", 128, "CQE size");
  expectBad("cqe_cnt", 128, "fewer CQEs than SQ blocks");
  expectBad("cqe_cnt", 300, "not a power of two");
  expectBad("null_bf", 1, "null queue memory");
  expectBad("fail", EOPNOTSUPP, "mlx5dv_init_obj failed");
  EXPECT_THROW(InitMlx5Queue(mlx5, qp.Qp(), qp.Cq(), 100, "mlx5_0"), core::InvalidUsageError);
}

// --- the whole transport, ranks as threads -------------------------------------------------
// In-process bootstrap: every collective is a deposit, a barrier, a read and a barrier.
class ThreadWorld {
 public:
  explicit ThreadWorld(int n) : size(n), slots(static_cast<size_t>(n)) {}
  void Exchange(int rank, const void* data, size_t bytes,
                const std::function<void(const std::vector<std::vector<uint8_t>>&)>& read) {
    const uint8_t* d = static_cast<const uint8_t*>(data);
    slots[static_cast<size_t>(rank)].assign(d, d + bytes);
    Barrier();
    read(slots);
    Barrier();
  }
  void Barrier() {
    std::unique_lock<std::mutex> lock(mu);
    const uint64_t gen = generation;
    if (++arrived == size) {
      arrived = 0;
      generation++;
      cv.notify_all();
      return;
    }
    if (!cv.wait_for(lock, std::chrono::seconds(20), [&] { return generation != gen; })) {
      MORI_THROW(TimeoutError, "thread bootstrap: barrier timed out");
    }
  }
  const int size;

 private:
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  std::vector<std::vector<uint8_t>> slots;
};

class ThreadBootstrap : public BootstrapNetwork {
 public:
  ThreadBootstrap(ThreadWorld& w, int r) : world(w), rank(r) {}
  int Rank() const override { return rank; }
  int WorldSize() const override { return world.size; }
  void Allgather(const void* send, void* recv, size_t bytes) override {
    world.Exchange(rank, send, bytes, [&](const std::vector<std::vector<uint8_t>>& all) {
      for (size_t p = 0; p < all.size(); p++) {
        std::memcpy(static_cast<uint8_t*>(recv) + p * bytes, all[p].data(), bytes);
      }
    });
  }
  void AllToAll(const void* send, void* recv, size_t bytes) override {
    world.Exchange(rank, send, bytes * static_cast<size_t>(world.size),
                   [&](const std::vector<std::vector<uint8_t>>& all) {
                     for (size_t p = 0; p < all.size(); p++) {
                       std::memcpy(static_cast<uint8_t*>(recv) + p * bytes,
                                   all[p].data() + static_cast<size_t>(rank) * bytes, bytes);
                     }
                   });
  }
  void Barrier() override { world.Barrier(); }

 private:
  ThreadWorld& world;
  int rank;
};

struct RankResult {
  std::unique_ptr<RdmaTransport> transport;
  FakeGpu* gpu = nullptr;  // owned by the transport
  std::string error;
  core::ErrorKind errorKind = core::ErrorKind::kInternal;
  std::vector<uint8_t> heap;
};

// World of 3: PE 0 <-> 1 and 0 <-> 2 through RDMA, 1 <-> 2 through P2P.
std::vector<TransportType> TransportsOf(int rank) {
  const TransportType r = TransportType::kRdma, p = TransportType::kP2P, s = TransportType::kSelf;
  const std::vector<std::vector<TransportType>> t = {{s, r, r}, {r, s, p}, {r, p, s}};
  return t[static_cast<size_t>(rank)];
}

class VerbsTransportFake : public VerbsFake {
 protected:
  // Runs CreateVerbsRdmaTransportWith on `n` threads; `tweak` adjusts each rank's inputs.
  std::vector<RankResult> Run(
      int n, const std::function<void(int, VerbsTransportSetup&, FakeGpu&)>& tweak) {
    ThreadWorld world(n);
    std::vector<RankResult> out(static_cast<size_t>(n));
    std::vector<std::thread> threads;
    for (int r = 0; r < n; r++) {
      threads.emplace_back([&, r] {
        RankResult& res = out[static_cast<size_t>(r)];
        res.heap.assign(1 << 16, 0);
        try {
          ThreadBootstrap boot(world, r);
          VerbsTransportSetup s;
          s.rank = r;
          s.worldSize = n;
          s.transports = TransportsOf(r);
          s.heapBase = res.heap.data();
          s.heapSize = res.heap.size();
          s.config.numQpPerPe = 2;
          s.config.sqBlocks = 64;
          s.deviceFilter = "mlx5_0";
          s.sysfsClassDir = sysfs.path;
          s.pciDevicesDir = sysfs.path;
          s.stopTimeoutMs = 2000;
          auto gpu = std::make_unique<FakeGpu>();
          gpu->liveQps = [this] { return live("qp"); };
          res.gpu = gpu.get();
          tweak(r, s, *gpu);
          VerbsLibraries libs;
          libs.verbs = &verbs;
          libs.mlx5 = &mlx5;
          res.transport = CreateVerbsRdmaTransportWith(boot, s, libs, std::move(gpu));
        } catch (const core::Error& e) {
          res.error = e.Message();
          res.errorKind = e.Kind();
          res.gpu = nullptr;
        }
      });
    }
    for (auto& t : threads) t.join();
    return out;
  }
  TempDir sysfs;
};

TEST_F(VerbsTransportFake, ThreeRanksUarDoorbell) {
  auto ranks = Run(3, [](int r, VerbsTransportSetup&, FakeGpu& gpu) {
    if (r == 0) gpu.dmabufOffset = 0x2000;  // PE 0 registers through dma-buf
  });
  for (int r = 0; r < 3; r++)
    ASSERT_TRUE(ranks[r].error.empty()) << "PE " << r << ": " << ranks[r].error;
  std::map<uint32_t, uint32_t> dest = RtrDestinations();
  EXPECT_EQ(dest.size(), 8u);  // (0,1) and (0,2) pairs, 2 QPs on each side
  std::set<const void*> counters;
  for (int r = 0; r < 3; r++) {
    RdmaTransport& t = *ranks[r].transport;
    EXPECT_EQ(t.Describe(), "verbs mlx5_0, UAR doorbell");
    EXPECT_NE(t.HeapLkey(), 0u);
    EXPECT_TRUE(t.FatalError().empty());
    ASSERT_EQ(t.Peers().size(), 3u);
    for (int p = 0; p < 3; p++) {
      const RdmaPeerEndpoints& pe = t.Peers()[p];
      if (TransportsOf(r)[p] != TransportType::kRdma) {
        EXPECT_TRUE(pe.qps.empty()) << r << "->" << p;
        continue;
      }
      ASSERT_EQ(pe.qps.size(), 2u);
      EXPECT_EQ(pe.remoteHeapBase, reinterpret_cast<uintptr_t>(ranks[p].heap.data()));
      EXPECT_NE(pe.rkey, 0u);
      for (int j = 0; j < 2; j++) {
        const QpEndpoint& ep = pe.qps[j];
        mlx5dv_qp q{};
        mlx5dv_cq c{};
        ASSERT_EQ(mlx5Lookup(ep.sq.qpn, &q, &c), 0);
        EXPECT_EQ(ep.sq.ring, q.sq.buf);
        EXPECT_EQ(ep.sq.numBlocks, 64u);
        EXPECT_EQ(ep.sq.dbrec, reinterpret_cast<uint32_t*>(q.dbrec) + 1);
        EXPECT_EQ(ep.sq.doorbell, q.bf.reg);
        EXPECT_EQ(ep.sq.doorbellMode, DoorbellMode::kUar);
        EXPECT_EQ(ep.cq.ring, c.buf);
        EXPECT_EQ(ep.cq.numCqes, c.cqe_cnt);
        EXPECT_GE(ep.cq.numCqes, 64u);
        EXPECT_EQ(ep.cq.dbrec, reinterpret_cast<uint32_t*>(c.dbrec));
        EXPECT_TRUE(counters.insert(ep.sq.reserved).second);
        // The peer's QP j towards us is our QP j's destination, and the other way round.
        const QpEndpoint& back = ranks[p].transport->Peers()[r].qps[j];
        EXPECT_EQ(dest[ep.sq.qpn], back.sq.qpn);
        EXPECT_EQ(dest[back.sq.qpn], ep.sq.qpn);
        // The CQ ring is as the provider left it.
        const auto* cqes = static_cast<const uint8_t*>(c.buf);
        for (uint32_t k = 0; k < c.cqe_cnt * 64; k++) {
          ASSERT_EQ(cqes[k], k % 64 == 63 ? 0xf0 : 0) << "CQE byte " << k;
        }
      }
    }
    // UAR pages registered as I/O memory, everything else not; every pointer came from a
    // registration (the fake refuses others).
    // One I/O registration per distinct UAR page of this PE's QPs (the fake hands out two
    // registers per page, shared by whichever QPs, of any rank, were created next to each other).
    std::set<uintptr_t> uarPages;
    for (const RdmaPeerEndpoints& pe : t.Peers()) {
      for (const QpEndpoint& ep : pe.qps) {
        uarPages.insert(reinterpret_cast<uintptr_t>(ep.sq.doorbell) & ~uintptr_t{4095});
      }
    }
    size_t io = 0;
    for (const auto& reg : ranks[r].gpu->everRegistered) {
      if (!reg.io) continue;
      io++;
      EXPECT_EQ(reg.bytes, 4096u);
      EXPECT_EQ(uarPages.count(reg.base), 1u);
    }
    EXPECT_EQ(io, uarPages.size());
  }
  // PE 0's heap went through dma-buf with the offset inside the allocation; the fd was closed.
  EXPECT_GE(ranks[0].gpu->exportedFd, 0);
  EXPECT_EQ(fcntl(ranks[0].gpu->exportedFd, F_GETFD), -1);
  int viaDmabuf = 0, viaRegMr = 0;
  void* addr = nullptr;
  size_t len = 0;
  int fd = -1;
  uint64_t off = 0, iova = 0;
  for (int i = 0; regMrRecord(i, &addr, &len, &fd, &off, &iova) == 0; i++) {
    EXPECT_EQ(len, 1u << 16);
    if (fd >= 0) {
      viaDmabuf++;
      EXPECT_EQ(off, 0x2000u);  // the heap's offset inside its allocation
      EXPECT_EQ(iova, reinterpret_cast<uintptr_t>(ranks[0].heap.data()));
    } else {
      viaRegMr++;
      EXPECT_TRUE(addr == ranks[1].heap.data() || addr == ranks[2].heap.data());
    }
  }
  EXPECT_EQ(viaDmabuf, 1);  // the heap is registered once per PE
  EXPECT_EQ(viaRegMr, 2);
  for (auto& r : ranks) {
    r.transport->Stop();
    r.transport->Stop();  // idempotent
  }
  // Destruction: GPU registrations are released while the QPs still exist (the provider frees
  // the memory behind them when they are destroyed), then nothing is left registered.
  for (int r = 0; r < 3; r++) {
    const int qpsBefore = live("qp");
    std::vector<int> seen;
    ranks[r].gpu->liveQps = [&] {
      seen.push_back(live("qp"));
      return seen.back();
    };
    ranks[r].transport.reset();  // also destroys the FakeGpu
    EXPECT_FALSE(seen.empty());
    for (int s : seen)
      EXPECT_EQ(s, qpsBefore) << "PE " << r << " unregistered after QP destruction";
  }
}

TEST_F(VerbsTransportFake, CpuAssistedDoorbellWhenUarIsRefused) {
  auto ranks = Run(3, [](int, VerbsTransportSetup&, FakeGpu& gpu) { gpu.refuseIo = true; });
  for (int r = 0; r < 3; r++)
    ASSERT_TRUE(ranks[r].error.empty()) << "PE " << r << ": " << ranks[r].error;
  RdmaTransport& t = *ranks[0].transport;
  EXPECT_EQ(t.Describe(), "verbs mlx5_0, CPU-assisted doorbell");
  const QpEndpoint& ep = t.Peers()[1].qps[1];
  EXPECT_EQ(ep.sq.doorbellMode, DoorbellMode::kMailbox);
  mlx5dv_qp q{};
  mlx5dv_cq c{};
  ASSERT_EQ(mlx5Lookup(ep.sq.qpn, &q, &c), 0);
  EXPECT_NE(ep.sq.doorbell, q.bf.reg);
  // Post from the host as a GPU thread would: the proxy rings the (fake) UAR register.
  core::rdma::WqeDesc d{};
  d.kind = core::rdma::WqeKind::kNop;
  for (int i = 0; i < 3; i++) {
    ASSERT_EQ(core::rdma::PostWqe(ep, d, HostCtx()).status, core::rdma::QueueStatus::kOk);
  }
  auto* reg = static_cast<volatile uint64_t*>(q.bf.reg);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (*reg != *ep.sq.doorbell && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(*reg, *ep.sq.doorbell);
  EXPECT_EQ(WqeIndexOf(*reg), 2);
  EXPECT_EQ(QpnOf(*reg), ep.sq.qpn);
  // The provider's doorbell record got the producer index (big-endian 3).
  EXPECT_EQ(*ep.sq.dbrec, core::mlx5::HostToBe32(3));
  for (auto& r : ranks) {
    const auto t0 = std::chrono::steady_clock::now();
    r.transport->Stop();
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(500));
    r.transport->Stop();
  }
  for (auto& r : ranks) r.transport.reset();
}

TEST_F(VerbsTransportFake, ForcedModes) {
  {
    auto ranks = Run(
        3, [](int, VerbsTransportSetup& s, FakeGpu&) { s.doorbell = RdmaDoorbellPolicy::kCpu; });
    for (auto& r : ranks) {
      ASSERT_TRUE(r.error.empty()) << r.error;
      EXPECT_EQ(r.transport->Describe(), "verbs mlx5_0, CPU-assisted doorbell");
      for (const auto& reg : r.gpu->everRegistered) EXPECT_FALSE(reg.io);
    }
    for (auto& r : ranks) r.transport.reset();
  }
  mlx5Reset();
  // uar forced but refused on PE 2: PE 2 raises why, everyone else names PE 2.
  auto ranks = Run(3, [](int r, VerbsTransportSetup& s, FakeGpu& gpu) {
    s.doorbell = RdmaDoorbellPolicy::kUar;
    gpu.refuseIo = r == 2;
  });
  EXPECT_EQ(ranks[2].errorKind, core::ErrorKind::kGpuRuntime) << ranks[2].error;
  EXPECT_NE(ranks[2].error.find("MORI_RDMA_DOORBELL=uar"), std::string::npos) << ranks[2].error;
  for (int r = 0; r < 2; r++) {
    EXPECT_EQ(ranks[r].errorKind, core::ErrorKind::kRemote) << ranks[r].error;
    EXPECT_NE(ranks[r].error.find("PE 2 could not set up"), std::string::npos) << ranks[r].error;
    EXPECT_EQ(ranks[r].transport, nullptr);
  }
}

TEST_F(VerbsTransportFake, CollectiveFailures) {
  // Different MORI_NUM_QP_PER_PE: every PE raises InvalidUsageError.
  auto ranks = Run(3, [](int r, VerbsTransportSetup& s, FakeGpu&) {
    if (r == 1) s.config.numQpPerPe = 3;
  });
  for (auto& r : ranks) {
    EXPECT_EQ(r.errorKind, core::ErrorKind::kInvalidUsage) << r.error;
    EXPECT_NE(r.error.find("MORI_NUM_QP_PER_PE differs"), std::string::npos) << r.error;
  }
  mlx5Reset();
  // No usable device on PE 1 (it has an RDMA peer): PE 1 says why, the others name PE 1.
  ranks = Run(3, [](int r, VerbsTransportSetup& s, FakeGpu&) {
    if (r == 1) s.deviceFilter = "mlx5_9";
  });
  EXPECT_EQ(ranks[1].errorKind, core::ErrorKind::kSystem) << ranks[1].error;
  EXPECT_NE(ranks[1].error.find("no RDMA device for PE 1"), std::string::npos) << ranks[1].error;
  EXPECT_NE(ranks[0].error.find("PE 1 could not set up its RDMA transport"), std::string::npos)
      << ranks[0].error;
  EXPECT_NE(ranks[2].error.find("PE 1 could not set up"), std::string::npos) << ranks[2].error;
  mlx5Reset();
  // Provider memory that does not fit (CQE size 128): SystemError on every PE that has peers.
  mlx5Set("cqe_size", 128);
  ranks = Run(3, [](int, VerbsTransportSetup&, FakeGpu&) {});
  for (auto& r : ranks) EXPECT_FALSE(r.error.empty());
  EXPECT_NE(ranks[0].error.find("CQE size"), std::string::npos) << ranks[0].error;
}

TEST_F(VerbsTransportFake, UserBuffersRegisterAndDeregister) {
  auto ranks = Run(3, [](int, VerbsTransportSetup&, FakeGpu&) {});
  for (int r = 0; r < 3; r++)
    ASSERT_TRUE(ranks[r].error.empty()) << "PE " << r << ": " << ranks[r].error;
  RdmaTransport& t = *ranks[1].transport;
  std::vector<uint8_t> buf(8192), other(4096);
  const int mrsBefore = live("mr");
  const uint32_t lkey = t.RegisterLocal(buf.data(), buf.size());
  EXPECT_NE(lkey, 0u);
  EXPECT_NE(lkey, t.HeapLkey());
  EXPECT_EQ(live("mr"), mrsBefore + 1);
  bool recorded = false;
  void* addr = nullptr;
  size_t len = 0;
  int fd = -2;
  uint64_t off = 0, iova = 0;
  for (int i = 0; regMrRecord(i, &addr, &len, &fd, &off, &iova) == 0; i++)
    recorded = recorded || (addr == buf.data() && len == buf.size());
  EXPECT_TRUE(recorded) << "the buffer was registered with the NIC";
  EXPECT_THROW(t.RegisterLocal(buf.data(), 16), core::InvalidUsageError);  // already registered
  EXPECT_THROW(t.RegisterLocal(nullptr, 16), core::InvalidUsageError);
  const uint32_t lkey2 = t.RegisterLocal(other.data(), other.size());
  EXPECT_NE(lkey2, lkey);
  EXPECT_EQ(live("mr"), mrsBefore + 2);
  t.DeregisterLocal(buf.data());
  EXPECT_EQ(live("mr"), mrsBefore + 1);
  EXPECT_THROW(t.DeregisterLocal(buf.data()), core::InvalidUsageError);
  // The remaining one is released with the transport.
  for (auto& r : ranks) r.transport.reset();
  EXPECT_EQ(live("mr"), 0);
}

TEST_F(VerbsTransportFake, NoRdmaPeersNeedsNoLibraries) {
  ThreadWorld world(2);
  std::vector<std::string> errors(2);
  std::vector<std::unique_ptr<RdmaTransport>> ts(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; r++) {
    threads.emplace_back([&, r] {
      try {
        ThreadBootstrap boot(world, r);
        VerbsTransportSetup s;
        s.rank = r;
        s.worldSize = 2;
        s.transports = {r == 0 ? TransportType::kSelf : TransportType::kP2P,
                        r == 1 ? TransportType::kSelf : TransportType::kP2P};
        VerbsLibraries none;  // no libibverbs, no libmlx5
        none.verbsWhy = "libibverbs not available: test";
        ts[r] = CreateVerbsRdmaTransportWith(boot, s, none, std::make_unique<FakeGpu>());
      } catch (const core::Error& e) {
        errors[r] = e.Message();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; r++) {
    ASSERT_TRUE(errors[r].empty()) << errors[r];
    EXPECT_EQ(ts[r]->Describe(), "verbs, no RDMA peers");
    EXPECT_EQ(ts[r]->HeapLkey(), 0u);
    EXPECT_EQ(ts[r]->Peers().size(), 2u);
    ts[r]->Stop();
  }
}
#endif  // MORI_FAKE_IBVERBS_PATH && MORI_FAKE_MLX5_PATH

}  // namespace
}  // namespace mori::application

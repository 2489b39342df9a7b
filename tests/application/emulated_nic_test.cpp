// The emulated NIC's exchange (application/rdma/emulated_nic.hpp) on CPUs: the server loop in a
// thread with a host backend (an "IPC handle" carries a host address), the client on the other end
// of a socket pair, WQEs posted by host threads into the shared rings. Everything the PE's process
// and its NIC process say to each other goes through the real framing and the real server; only
// process start-up and GPU memory are left to the GPU suites.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "mori/application/rdma/emulated_nic.hpp"
#include "mori/core/errors.hpp"

namespace {

using namespace mori;
namespace crdma = mori::core::rdma;
namespace mlx5 = mori::core::mlx5;
using application::EmulatedNicClient;
using application::EmuNicMemory;
using application::EmuNicQp;

constexpr uint64_t kTimeoutNs = 20ull * 1000 * 1000 * 1000;
constexpr uint32_t kSqBlocks = 64;

// "IPC handles" are host addresses; Open/Close are counted per address.
class HostBackend : public application::EmuNicBackend {
 public:
  void Bind(const std::string& busId) override { boundTo = busId; }
  void* Open(const EmuNicMemory& m) override {
    void* p = nullptr;
    std::memcpy(&p, m.handle, sizeof(p));
    opens++;
    open[p]++;
    return p;
  }
  void Close(void* mapped) override {
    closes++;
    if (--open[mapped] == 0) open.erase(mapped);
  }
  std::unique_ptr<application::EmuMemoryAccessor> MakeAccessor(int64_t) override {
    return application::MakeHostMemoryAccessor();
  }
  std::string boundTo;
  std::atomic<int> opens{0}, closes{0};
  std::map<void*, int> open;
};

EmuNicMemory Memory(int pe, void* alloc, size_t allocBytes, void* base, size_t length) {
  EmuNicMemory m;
  m.pe = pe;
  std::memcpy(m.handle, &alloc, sizeof(alloc));
  m.allocBase = reinterpret_cast<uint64_t>(alloc);
  m.allocBytes = allocBytes;
  m.base = reinterpret_cast<uint64_t>(base);
  m.length = length;
  return m;
}

// A NIC server in a thread and a client connected to it, over shared ring memory for `qps` QPs.
struct Nic {
  explicit Nic(int qps = 1, int64_t timeoutMs = 2000) : rings(RingBytes(qps)) {
    int sv[2];
    EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    serverFd = sv[1];
    server = std::async(std::launch::async, [this] {
      return application::RunEmulatedNicServer(serverFd, rings.data(), rings.size(), backend);
    });
    client = std::make_unique<EmulatedNicClient>(sv[0], timeoutMs, &Describe, this);
  }
  ~Nic() {
    client.reset();  // closes the connection: a server still running returns
    if (server.valid()) server.wait();
    close(serverFd);
  }
  static size_t QpBytes() { return kSqBlocks * 64 * 2 + 4096; }
  static size_t RingBytes(int qps) { return QpBytes() * qps; }
  static std::string Describe(void*) { return "the test's server thread"; }
  EmuNicQp Qp(int index, int pe, int remotePe) const {
    EmuNicQp q;
    q.sqOffset = QpBytes() * index;
    q.cqOffset = q.sqOffset + kSqBlocks * 64;
    q.countersOffset = q.cqOffset + kSqBlocks * 64;
    q.sqBlocks = kSqBlocks;
    q.numCqes = kSqBlocks;
    q.qpn = 0x100 + index;
    q.pe = pe;
    q.remotePe = remotePe;
    return q;
  }
  // The endpoint a poster uses for QP `q` (the PE's view of the same ring memory).
  crdma::QpEndpoint Endpoint(const EmuNicQp& q) {
    uint8_t* r = rings.data();
    return crdma::MakeEndpoint(r + q.sqOffset, q.sqBlocks, q.qpn, r + q.cqOffset, q.numCqes,
                               reinterpret_cast<crdma::QpCounters*>(r + q.countersOffset));
  }
  void Init() {
    application::EmuNicInit init;
    init.rank = 0;
    init.gpuBusId = "0000:00:00.0";
    init.hostTimeoutMs = 2000;
    client->Init(init);
  }

  // Page-aligned and zeroed, as the transport's shared memory.
  struct Rings {
    explicit Rings(size_t bytes)
        : bytes(bytes), p(static_cast<uint8_t*>(std::aligned_alloc(4096, bytes))) {
      std::memset(p, 0, bytes);
    }
    ~Rings() { std::free(p); }
    uint8_t* data() { return p; }
    size_t size() const { return bytes; }
    size_t bytes;
    uint8_t* p;
  } rings;
  HostBackend backend;
  int serverFd = -1;
  std::future<int> server;
  std::unique_ptr<EmulatedNicClient> client;
};

crdma::PostContext Ctx() { return crdma::PostContext{kTimeoutNs, nullptr, 0, 1}; }

void Check(const crdma::QueueResult& r, const crdma::QpEndpoint& ep) {
  application::ThrowIfFailed(r, ep);
}

// Two "PEs": this one's heap (key chosen by the NIC) and a peer's (key given, as exchanged),
// writes and fetch-adds from host threads through the NIC, counted in its wire statistics; a
// stop ends the server cleanly and closes every mapping.
TEST(EmulatedNic, WritesAndAtomicsThroughTheServer) {
  Nic nic;
  nic.Init();
  EXPECT_EQ(nic.backend.boundTo, "0000:00:00.0");
  constexpr int kThreads = 4, kOps = 300;
  std::vector<uint64_t> mine(kThreads * kOps * 2), peer(kThreads * kOps + 1, 0);
  for (size_t i = 0; i < mine.size(); i++) mine[i] = 0x9e3779b97f4a7c15ull * (i + 3);
  const uint32_t myKey =
      nic.client->Register(Memory(0, mine.data(), mine.size() * 8, mine.data(), mine.size() * 8));
  EXPECT_NE(myKey, 0u);
  constexpr uint32_t kPeerKey = 0x7a5;
  EXPECT_EQ(nic.client->Register(
                Memory(1, peer.data(), peer.size() * 8, peer.data(), peer.size() * 8), kPeerKey),
            kPeerKey);
  const EmuNicQp q = nic.Qp(0, 0, 1);
  nic.client->AddQp(q);
  const crdma::QpEndpoint ep = nic.Endpoint(q);
  nic.client->Start();
  uint64_t* counter = &peer[kThreads * kOps];
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; t++) {
    threads.emplace_back([&, t] {
      try {
        for (int i = 0; i < kOps; i++) {
          const size_t k = static_cast<size_t>(t) * kOps + i;
          crdma::WqeDesc d{};
          if (i % 3 == 0) {
            d.kind = crdma::WqeKind::kFetchAdd;
            d.local = mlx5::Mlx5LocalBuf{reinterpret_cast<uint64_t>(&mine[kThreads * kOps + k]),
                                         myKey, 8};
            d.remote = mlx5::Mlx5RemoteBuf{reinterpret_cast<uint64_t>(counter), kPeerKey};
            d.swapAdd = 1;
          } else {
            d.kind = crdma::WqeKind::kWrite;
            d.local = mlx5::Mlx5LocalBuf{reinterpret_cast<uint64_t>(&mine[k]), myKey, 8};
            d.remote = mlx5::Mlx5RemoteBuf{reinterpret_cast<uint64_t>(&peer[k]), kPeerKey};
          }
          Check(crdma::PostWqe(ep, d, Ctx()), ep);
        }
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
        failures++;
      }
    });
  }
  for (auto& th : threads) th.join();
  ASSERT_EQ(failures.load(), 0);
  Check(crdma::Quiet(ep, Ctx()), ep);
  std::vector<uint64_t> olds;
  for (int t = 0; t < kThreads; t++) {
    for (int i = 0; i < kOps; i++) {
      const size_t k = static_cast<size_t>(t) * kOps + i;
      if (i % 3 == 0) {
        EXPECT_EQ(peer[k], 0u) << k;
        olds.push_back(mine[kThreads * kOps + k]);
      } else {
        ASSERT_EQ(peer[k], mine[k]) << "write " << k;
      }
    }
  }
  EXPECT_EQ(*counter, olds.size());
  std::sort(olds.begin(), olds.end());
  for (size_t i = 0; i < olds.size(); i++) ASSERT_EQ(olds[i], i) << "fetch-add old values";

  const application::RdmaWireStats s = nic.client->WireStats(true);
  ASSERT_TRUE(s.available);
  uint64_t writes = 0, adds = 0;
  for (const auto& row : s.perPeer) {
    EXPECT_EQ(row.srcPe, 0);
    EXPECT_EQ(row.dstPe, 1);
    if (row.opcode == application::RdmaOpcode::kWrite) writes += row.wqes;
    if (row.opcode == application::RdmaOpcode::kFetchAdd) adds += row.wqes;
  }
  EXPECT_EQ(writes, uint64_t(kThreads) * kOps - olds.size());
  EXPECT_EQ(adds, olds.size());
  EXPECT_EQ(nic.client->WireStats(false).perPeer.size(), 0u) << "reset by the first read";
  EXPECT_EQ(nic.client->FatalError(), "");
  nic.client->Stop(2000);
  EXPECT_EQ(nic.server.get(), 0);
  EXPECT_EQ(nic.backend.opens.load(), 2);
  EXPECT_EQ(nic.backend.closes.load(), 2);
}

// A buffer's allocation is mapped once for all its ranges and closed when its last range is
// deregistered; a range outside its allocation, an unknown key and requests before Init are
// refused with InvalidUsageError, and the connection stays usable.
TEST(EmulatedNic, RegistrationsShareMappingsAndErrorsAreTyped) {
  Nic nic;
  std::vector<uint8_t> alloc(4096);
  EXPECT_THROW(nic.client->Register(Memory(0, alloc.data(), 4096, alloc.data(), 64)),
               core::InvalidUsageError);
  nic.Init();
  EXPECT_THROW(nic.Init(), core::InvalidUsageError);
  const uint32_t a = nic.client->Register(Memory(0, alloc.data(), 4096, alloc.data(), 1024));
  const uint32_t b = nic.client->Register(Memory(0, alloc.data(), 4096, alloc.data() + 2048, 2048));
  EXPECT_NE(a, b);
  EXPECT_EQ(nic.backend.opens.load(), 1);
  EXPECT_THROW(nic.client->Register(Memory(0, alloc.data(), 4096, alloc.data() + 4000, 200)),
               core::InvalidUsageError);
  EXPECT_THROW(nic.client->Register(Memory(0, alloc.data(), 8192, alloc.data(), 64)),
               core::InvalidUsageError)
      << "the same allocation with another size";
  EXPECT_THROW(nic.client->Deregister(0x12345), core::InvalidUsageError);
  EmuNicQp bad = nic.Qp(0, 0, 1);
  bad.countersOffset = nic.rings.size() - 8;
  EXPECT_THROW(nic.client->AddQp(bad), core::InvalidUsageError);
  nic.client->Deregister(a);
  EXPECT_EQ(nic.backend.closes.load(), 0) << "range b still uses the mapping";
  nic.client->Deregister(b);
  EXPECT_EQ(nic.backend.closes.load(), 1);
  const uint32_t c = nic.client->Register(Memory(0, alloc.data(), 4096, alloc.data(), 4096));
  EXPECT_NE(c, 0u);
  EXPECT_EQ(nic.backend.opens.load(), 2) << "mapped again after it was closed";
  nic.client->Stop(2000);
  EXPECT_EQ(nic.server.get(), 0);
  EXPECT_TRUE(nic.backend.open.empty());
}

// A NIC that is gone: the next request raises SystemError naming why, and so does every later
// one; FatalError says the same instead of raising.
TEST(EmulatedNic, ServerGoneIsASystemError) {
  Nic nic;
  nic.Init();
  nic.client->Stop(2000);  // the server returns, its end closes
  EXPECT_EQ(nic.server.get(), 0);
  shutdown(nic.serverFd, SHUT_RDWR);
  try {
    nic.client->Start();
    FAIL() << "a request to a stopped NIC succeeded";
  } catch (const core::SystemError& e) {
    EXPECT_NE(std::string(e.what()).find("the test's server thread"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(nic.client->WireStats(false), core::SystemError);
  EXPECT_NE(nic.client->FatalError().find("does not answer"), std::string::npos);
  EXPECT_FALSE(nic.client->Connected());
}

// The server's loop ends by itself once the process that started it is gone (its liveness check
// fails), without any message.
TEST(EmulatedNic, ServerEndsWhenItsParentIsGone) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  HostBackend backend;
  std::vector<uint8_t> rings(4096);
  static std::atomic<bool> alive{true};
  alive = true;
  auto server = std::async(std::launch::async, [&] {
    return application::RunEmulatedNicServer(sv[1], rings.data(), rings.size(), backend,
                                             [] { return alive.load(); });
  });
  EXPECT_EQ(server.wait_for(std::chrono::milliseconds(1500)), std::future_status::timeout);
  alive = false;
  ASSERT_EQ(server.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_EQ(server.get(), 1);
  close(sv[0]);
  close(sv[1]);
}

}  // namespace

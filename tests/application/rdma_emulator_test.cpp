// The RDMA posting protocol (core/transport/rdma_queue.hpp) driven by host threads against the
// software queue emulator: data, atomics, ordering, 16-bit wrap, SQ full, error CQEs and flush,
// bounded waits. Every WQE goes through the mlx5 encoders into a real ring; the emulator executes
// the bytes it finds there.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <thread>
#include <vector>

#include "mori/application/rdma/queue_emulator.hpp"
#include "mori/core/errors.hpp"

namespace {

using namespace mori;
namespace crdma = mori::core::rdma;
namespace mlx5 = mori::core::mlx5;
using application::EmuAccess;
using application::QueueEmulator;

constexpr uint64_t kLongTimeoutNs = 20ull * 1000 * 1000 * 1000;

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};
using Buf = std::unique_ptr<uint8_t, AlignedFree>;
Buf Alloc(size_t bytes) {
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  std::memset(p, 0, (bytes + 63) / 64 * 64);
  return Buf(static_cast<uint8_t*>(p));
}

// One QP from PE 0 to PE 1: rings, counters, endpoint, registered in the emulator.
struct Loop {
  Buf sq, cq;
  std::unique_ptr<crdma::QpCounters> counters;
  crdma::QpEndpoint ep;
  size_t qpIndex = 0;
  // Declare a Loop before its QueueEmulator: the emulator (its worker) must stop before the
  // rings and counters it watches are freed.
  Loop(uint32_t sqBlocks, uint32_t numCqes, uint32_t qpn = 0x1234) {
    sq = Alloc(sqBlocks * 64ull);
    cq = Alloc(numCqes * 64ull);
    counters = std::make_unique<crdma::QpCounters>();
    std::memset(counters.get(), 0, sizeof(crdma::QpCounters));
    application::EmuInitCqRing(cq.get(), numCqes);
    ep = crdma::MakeEndpoint(sq.get(), sqBlocks, qpn, cq.get(), numCqes, counters.get());
  }
  void Attach(QueueEmulator& emu) { qpIndex = emu.AddQp(application::EmuQpFromEndpoint(ep, 0, 1)); }
};

crdma::PostContext Ctx(uint64_t timeoutNs = kLongTimeoutNs) {
  return crdma::PostContext{timeoutNs, nullptr, 0, 1};
}

void Check(const crdma::QueueResult& r, const crdma::QpEndpoint& ep) {
  application::ThrowIfFailed(r, ep);
}

mlx5::Mlx5LocalBuf Local(const void* p, uint32_t len, application::EmuMemoryRegion mr) {
  return mlx5::Mlx5LocalBuf{reinterpret_cast<uint64_t>(p), mr.lkey, len};
}
mlx5::Mlx5RemoteBuf Remote(const void* p, application::EmuMemoryRegion mr) {
  return mlx5::Mlx5RemoteBuf{reinterpret_cast<uint64_t>(p), mr.rkey};
}

// 8 threads x 1,500 operations on one QP: half RDMA writes, half fetch-adds on one counter;
// 12,000 WQEs wrap the 256-block ring 46 times (the 16-bit wqe_index wrap: InlineWritesReadsAndWrap).
// Posters publish in reservation order, so with more threads than free cores every post waits for
// the scheduler to run the thread whose turn it is: 80,000 WQEs took 60-100 s on 2 cores beside 2
// busy processes (1 s idle), hence the smaller count.
TEST(RdmaEmulator, ManyThreadsWritesAndFetchAdd) {
  constexpr int kThreads = 8, kOps = 1500;
  Loop loop(256, 256);
  QueueEmulator emu;
  loop.Attach(emu);
  std::vector<uint64_t> src(kThreads * kOps), dst(kThreads * kOps, 0), results(kThreads * kOps, ~0ull);
  alignas(8) static uint64_t counter;
  counter = 0;
  for (size_t i = 0; i < src.size(); i++) src[i] = 0x9e3779b97f4a7c15ull * (i + 1);
  auto srcMr = emu.RegisterMemory(0, src.data(), src.size() * 8, EmuAccess::kEmuAllAccess);
  auto resMr = emu.RegisterMemory(0, results.data(), results.size() * 8, EmuAccess::kEmuAllAccess);
  auto dstMr = emu.RegisterMemory(1, dst.data(), dst.size() * 8, EmuAccess::kEmuAllAccess);
  auto ctrMr = emu.RegisterMemory(1, &counter, 8, EmuAccess::kEmuAllAccess);
  emu.Start();
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; t++) {
    threads.emplace_back([&, t] {
      try {
        for (int i = 0; i < kOps; i++) {
          const size_t k = static_cast<size_t>(t) * kOps + i;
          crdma::WqeDesc d{};
          if (i % 2 == 0) {
            d.kind = crdma::WqeKind::kWrite;
            d.local = Local(&src[k], 8, srcMr);
            d.remote = Remote(&dst[k], dstMr);
          } else {
            d.kind = crdma::WqeKind::kFetchAdd;
            d.local = Local(&results[k], 8, resMr);
            d.remote = Remote(&counter, ctrMr);
            d.swapAdd = 1;
          }
          Check(crdma::PostWqe(loop.ep, d, Ctx()), loop.ep);
        }
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
        failures++;
      }
    });
  }
  for (auto& th : threads) th.join();
  ASSERT_EQ(failures.load(), 0);
  Check(crdma::Quiet(loop.ep, Ctx()), loop.ep);
  EXPECT_EQ(loop.counters->ready, uint64_t(kThreads) * kOps);
  EXPECT_EQ(mlx5::BeToHost32(loop.counters->sqDbrec[1]), uint32_t(kThreads * kOps) & 0xffff);
  EXPECT_EQ(counter, uint64_t(kThreads) * kOps / 2);
  std::vector<uint64_t> olds;
  for (int t = 0; t < kThreads; t++) {
    for (int i = 0; i < kOps; i++) {
      const size_t k = static_cast<size_t>(t) * kOps + i;
      if (i % 2 == 0) {
        ASSERT_EQ(dst[k], src[k]) << "write " << k;
      } else {
        ASSERT_EQ(dst[k], 0u);
        olds.push_back(results[k]);
      }
    }
  }
  std::sort(olds.begin(), olds.end());
  for (size_t i = 0; i < olds.size(); i++) ASSERT_EQ(olds[i], i) << "fetch-add old values";
  EXPECT_EQ(emu.Stats().errors, 0u);
  EXPECT_TRUE(emu.FatalError().empty()) << emu.FatalError();
}

// A write followed by a signal (fetch-add) on the same QP: a receiver that sees signal count c
// for a writer finds that writer's first c records complete.
TEST(RdmaEmulator, WriteThenSignalOrdering) {
  constexpr int kWriters = 4, kOps = 2000, kRec = 64;
  Loop loop(64, 64);
  QueueEmulator emu;
  loop.Attach(emu);
  std::vector<uint8_t> src(size_t(kWriters) * kOps * kRec), dst(src.size(), 0);
  std::vector<uint64_t> sig(kWriters, 0), res(size_t(kWriters) * kOps, 0);
  for (size_t i = 0; i < src.size(); i++) src[i] = static_cast<uint8_t>(i * 131 + 7 + i / 251);
  auto srcMr = emu.RegisterMemory(0, src.data(), src.size(), EmuAccess::kEmuAllAccess);
  auto resMr = emu.RegisterMemory(0, res.data(), res.size() * 8, EmuAccess::kEmuAllAccess);
  auto dstMr = emu.RegisterMemory(1, dst.data(), dst.size(), EmuAccess::kEmuAllAccess);
  auto sigMr = emu.RegisterMemory(1, sig.data(), sig.size() * 8, EmuAccess::kEmuAllAccess);
  emu.Start();
  std::atomic<bool> writersDone{false};
  std::atomic<long> violations{0}, checks{0};
  std::thread receiver([&] {
    while (true) {
      const bool last = writersDone.load(std::memory_order_acquire);
      for (int t = 0; t < kWriters; t++) {
        const uint64_t c = __atomic_load_n(&sig[t], __ATOMIC_ACQUIRE);
        if (c == 0) continue;
        const size_t k = size_t(t) * kOps + (c - 1);  // the newest signalled record
        if (std::memcmp(&dst[k * kRec], &src[k * kRec], kRec) != 0) violations++;
        checks++;
      }
      if (last) break;
      std::this_thread::yield();
    }
  });
  std::vector<std::thread> writers;
  for (int t = 0; t < kWriters; t++) {
    writers.emplace_back([&, t] {
      try {
        for (int i = 0; i < kOps; i++) {
          const size_t k = size_t(t) * kOps + i;
          Check(crdma::PostWriteWithSignal(loop.ep, Local(&src[k * kRec], kRec, srcMr),
                                           Remote(&dst[k * kRec], dstMr), Local(&res[k], 8, resMr),
                                           Remote(&sig[t], sigMr), 1, Ctx()),
                loop.ep);
        }
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
      }
    });
  }
  for (auto& w : writers) w.join();
  Check(crdma::Quiet(loop.ep, Ctx()), loop.ep);
  writersDone.store(true, std::memory_order_release);
  receiver.join();
  EXPECT_EQ(violations.load(), 0);
  EXPECT_GT(checks.load(), 0);
  for (int t = 0; t < kWriters; t++) EXPECT_EQ(sig[t], uint64_t(kOps));
  EXPECT_EQ(dst, src);
  for (int t = 0; t < kWriters; t++) {
    for (int i = 0; i < kOps; i++) ASSERT_EQ(res[size_t(t) * kOps + i], uint64_t(i));
  }
}

// Inline writes of 1..200 bytes (1 to 4 blocks, crossing the end of a 16-block ring), read back
// with RDMA READ; 70,000 WQEs so the 16-bit index wraps.
TEST(RdmaEmulator, InlineWritesReadsAndWrap) {
  Loop loop(16, 16);
  QueueEmulator emu;
  loop.Attach(emu);
  constexpr int kSlots = 32, kSlotBytes = 256, kOps = 70000;
  std::vector<uint8_t> remote(kSlots * kSlotBytes, 0), expect(remote.size(), 0), back(remote.size());
  auto remoteMr = emu.RegisterMemory(1, remote.data(), remote.size(), EmuAccess::kEmuAllAccess);
  auto backMr = emu.RegisterMemory(0, back.data(), back.size(), EmuAccess::kEmuAllAccess);
  emu.Start();
  uint8_t payload[crdma::kMaxInlinePayload];
  for (int i = 0; i < kOps; i++) {
    const uint32_t len = 1 + (i * 7) % 200;
    const int slot = i % kSlots;
    for (uint32_t b = 0; b < len; b++) payload[b] = static_cast<uint8_t>(i + b * 3);
    std::memcpy(&expect[slot * kSlotBytes], payload, len);
    crdma::WqeDesc d{};
    d.kind = crdma::WqeKind::kWriteInline;
    d.local.len = len;
    d.inlineData = payload;
    d.remote = Remote(&remote[slot * kSlotBytes], remoteMr);
    // The payload is copied into the WQE, so the buffer may change right after posting.
    Check(crdma::PostWqe(loop.ep, d, Ctx()), loop.ep);
  }
  Check(crdma::Quiet(loop.ep, Ctx()), loop.ep);
  EXPECT_EQ(remote, expect);
  EXPECT_GT(loop.counters->ready, 65536u * 2);
  crdma::WqeDesc rd{};
  rd.kind = crdma::WqeKind::kRead;
  rd.local = Local(back.data(), static_cast<uint32_t>(back.size()), backMr);
  rd.remote = Remote(remote.data(), remoteMr);
  Check(crdma::PostWqe(loop.ep, rd, Ctx()), loop.ep);
  Check(crdma::Quiet(loop.ep, Ctx()), loop.ep);
  EXPECT_EQ(back, expect);
  // The payload limit is enforced before anything is reserved.
  crdma::WqeDesc big{};
  big.kind = crdma::WqeKind::kWriteInline;
  big.local.len = crdma::kMaxInlinePayload + 1;
  big.inlineData = payload;
  EXPECT_EQ(crdma::PostWqe(loop.ep, big, Ctx()).status, crdma::QueueStatus::kInvalid);
}

TEST(RdmaEmulator, CompareSwap) {
  Loop loop(8, 8);
  QueueEmulator emu;
  loop.Attach(emu);
  alignas(8) uint64_t target = 5, old[3] = {0, 0, 0};
  auto tMr = emu.RegisterMemory(1, &target, 8, EmuAccess::kEmuAllAccess);
  auto oMr = emu.RegisterMemory(0, old, sizeof(old), EmuAccess::kEmuAllAccess);
  emu.Start();
  auto cs = [&](int i, uint64_t expected, uint64_t desired) {
    crdma::WqeDesc d{};
    d.kind = crdma::WqeKind::kCompareSwap;
    d.local = Local(&old[i], 8, oMr);
    d.remote = Remote(&target, tMr);
    d.compare = expected;
    d.swapAdd = desired;
    Check(crdma::PostWqe(loop.ep, d, Ctx()), loop.ep);
  };
  cs(0, 5, 9);   // succeeds
  cs(1, 5, 11);  // fails: target is 9
  cs(2, 9, 0xffffffff00000001ull);
  Check(crdma::Quiet(loop.ep, Ctx()), loop.ep);
  EXPECT_EQ(old[0], 5u);
  EXPECT_EQ(old[1], 9u);
  EXPECT_EQ(old[2], 9u);
  EXPECT_EQ(target, 0xffffffff00000001ull);
}

// A peer's region registered under the key its own registration produced, addressed by the peer's
// address for it (iova) and touched through another mapping (as the emulated transport does with
// IPC mappings): WRITE, READ and FETCH_ADD use iova addresses and land in the mapped memory; the
// iova itself is never touched; a (pe, key) pair cannot be registered twice.
TEST(RdmaEmulator, RegionsAddressedByIova) {
  Loop loop(16, 16);
  QueueEmulator emu;
  loop.Attach(emu);
  std::vector<uint8_t> src(256), back(256);
  for (size_t i = 0; i < src.size(); i++) src[i] = static_cast<uint8_t>(i * 7 + 1);
  alignas(8) uint8_t mapped[1024] = {};         // where PE 1's memory is reachable from here
  const uint64_t iova = 0x7f0000100000ull;      // PE 1's own address for it (never dereferenced)
  const uint32_t peerKey = 0xabcd01u;           // the key PE 1's registration produced
  emu.RegisterMemoryAs(1, peerKey, iova, mapped, sizeof(mapped), EmuAccess::kEmuAllAccess);
  EXPECT_THROW(emu.RegisterMemoryAs(1, peerKey, iova, mapped, 8, EmuAccess::kEmuAllAccess),
               core::InvalidUsageError);
  EXPECT_THROW(emu.RegisterMemoryAs(1, 0, iova, mapped, 8, EmuAccess::kEmuAllAccess),
               core::InvalidUsageError);
  auto srcMr = emu.RegisterMemory(0, src.data(), src.size(), EmuAccess::kEmuAllAccess);
  alignas(8) uint64_t old = 0;
  auto backMr = emu.RegisterMemory(0, back.data(), back.size(), EmuAccess::kEmuAllAccess);
  auto oldMr = emu.RegisterMemory(0, &old, 8, EmuAccess::kEmuAllAccess);
  emu.Start();
  crdma::WqeDesc w{};
  w.kind = crdma::WqeKind::kWrite;
  w.local = Local(src.data(), 256, srcMr);
  w.remote = mlx5::Mlx5RemoteBuf{iova + 64, peerKey};
  Check(crdma::PostWqe(loop.ep, w, Ctx()), loop.ep);
  uint64_t init = 40;
  std::memcpy(mapped + 512, &init, 8);
  crdma::WqeDesc fa{};
  fa.kind = crdma::WqeKind::kFetchAdd;
  fa.local = Local(&old, 8, oldMr);
  fa.remote = mlx5::Mlx5RemoteBuf{iova + 512, peerKey};
  fa.swapAdd = 2;
  Check(crdma::PostWqe(loop.ep, fa, Ctx()), loop.ep);
  crdma::WqeDesc r{};
  r.kind = crdma::WqeKind::kRead;
  r.local = Local(back.data(), 256, backMr);
  r.remote = mlx5::Mlx5RemoteBuf{iova + 64, peerKey};
  Check(crdma::PostWqe(loop.ep, r, Ctx()), loop.ep);
  Check(crdma::Quiet(loop.ep, Ctx()), loop.ep);
  EXPECT_EQ(std::memcmp(mapped + 64, src.data(), 256), 0);
  EXPECT_EQ(std::memcmp(back.data(), src.data(), 256), 0);
  EXPECT_EQ(old, 40u);
  uint64_t now = 0;
  std::memcpy(&now, mapped + 512, 8);
  EXPECT_EQ(now, 42u);
  // The iova range ends where the mapping ends: one byte past it is a remote access error.
  crdma::WqeDesc past = w;
  past.local = Local(src.data(), 8, srcMr);
  past.remote = mlx5::Mlx5RemoteBuf{iova + sizeof(mapped) - 7, peerKey};
  Check(crdma::PostWqe(loop.ep, past, Ctx()), loop.ep);
  const crdma::QueueResult q = crdma::Quiet(loop.ep, Ctx());
  EXPECT_EQ(q.status, crdma::QueueStatus::kQpError);
  EXPECT_EQ(loop.ep.cq.error->syndrome, mlx5::kSyndromeRemoteAccessErr);
  emu.Stop();
}

// A 4-block ring: posters block until completions free space; nothing is lost.
TEST(RdmaEmulator, SqFullBlocksPosters) {
  constexpr int kThreads = 4, kOps = 2000;
  Loop loop(4, 4);
  QueueEmulator emu;
  loop.Attach(emu);
  alignas(8) static uint64_t counter;
  counter = 0;
  std::vector<uint64_t> results(kThreads * kOps, ~0ull);
  auto ctrMr = emu.RegisterMemory(1, &counter, 8, EmuAccess::kEmuAllAccess);
  auto resMr = emu.RegisterMemory(0, results.data(), results.size() * 8, EmuAccess::kEmuAllAccess);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; t++) {
    threads.emplace_back([&, t] {
      try {
        for (int i = 0; i < kOps; i++) {
          crdma::WqeDesc d{};
          d.kind = crdma::WqeKind::kFetchAdd;
          d.local = Local(&results[size_t(t) * kOps + i], 8, resMr);
          d.remote = Remote(&counter, ctrMr);
          d.swapAdd = 1;
          Check(crdma::PostWqe(loop.ep, d, Ctx()), loop.ep);
        }
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
      }
    });
  }
  // Emulator not running yet: exactly one ring's worth gets published, the rest waits.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(__atomic_load_n(&loop.counters->ready, __ATOMIC_ACQUIRE), 4u);
  EXPECT_GT(__atomic_load_n(&loop.counters->reserved, __ATOMIC_ACQUIRE), 4u);
  emu.Start();
  for (auto& th : threads) th.join();
  Check(crdma::Quiet(loop.ep, Ctx()), loop.ep);
  EXPECT_EQ(counter, uint64_t(kThreads) * kOps);
  std::sort(results.begin(), results.end());
  for (size_t i = 0; i < results.size(); i++) ASSERT_EQ(results[i], i);
}

struct ErrorCase {
  const char* name;
  uint8_t syndrome;
};

// One batch of 4 WQEs: good write, bad WQE, good write, good fetch-add. Expect the first to land,
// an attributed error CQE for the second, the rest flushed (not executed), QP in error.
void RunErrorBatch(int which) {
  Loop loop(16, 16, 0xabcde);
  QueueEmulator emu;
  loop.Attach(emu);
  std::vector<uint64_t> src = {11, 22, 33}, dst(4, 0), res(1, 0);
  auto srcMr = emu.RegisterMemory(0, src.data(), src.size() * 8, EmuAccess::kEmuAllAccess);
  auto resMr = emu.RegisterMemory(0, res.data(), 8, EmuAccess::kEmuAllAccess);
  auto dstMr = emu.RegisterMemory(1, dst.data(), dst.size() * 8, EmuAccess::kEmuAllAccess);
  auto noWrite = emu.RegisterMemory(1, dst.data(), dst.size() * 8, EmuAccess::kEmuRemoteRead);
  emu.Start();
  // Move the producer off zero so the attributed index is not trivially 0.
  for (int i = 0; i < 5; i++) {
    crdma::WqeDesc nop{};
    nop.kind = crdma::WqeKind::kNop;
    Check(crdma::PostWqe(loop.ep, nop, Ctx()), loop.ep);
  }
  Check(crdma::Quiet(loop.ep, Ctx()), loop.ep);
  crdma::QueueResult r = crdma::ReserveSlots(loop.ep, 4, Ctx());
  Check(r, loop.ep);
  const uint64_t start = r.value;
  crdma::WqeDesc d{};
  d.kind = crdma::WqeKind::kWrite;
  d.local = Local(&src[0], 8, srcMr);
  d.remote = Remote(&dst[0], dstMr);
  crdma::WriteWqe(loop.ep.sq, start, d);
  crdma::WqeDesc bad = d;
  bad.local = Local(&src[1], 8, srcMr);
  bad.remote = Remote(&dst[1], dstMr);
  uint8_t expectSyndrome = mlx5::kSyndromeRemoteAccessErr;
  switch (which) {
    case 0: bad.remote.rkey = dstMr.rkey ^ 0x100; break;                // unknown rkey
    case 1: bad.remote.addr = reinterpret_cast<uint64_t>(&dst[3]) + 4; break;  // past the end
    case 2: bad.remote.rkey = noWrite.rkey; break;                     // no remote write access
    case 3: bad.remote.rkey = srcMr.rkey; bad.remote.addr = d.local.addr; break;  // PE 0's key
    case 4:
      bad.local.lkey = dstMr.lkey;  // a PE 1 key used as a local key
      expectSyndrome = mlx5::kSyndromeLocalProtErr;
      break;
  }
  crdma::WriteWqe(loop.ep.sq, start + 1, bad);
  crdma::WqeDesc after = d;
  after.local = Local(&src[2], 8, srcMr);
  after.remote = Remote(&dst[2], dstMr);
  crdma::WriteWqe(loop.ep.sq, start + 2, after);
  crdma::WqeDesc fa{};
  fa.kind = crdma::WqeKind::kFetchAdd;
  fa.local = Local(&res[0], 8, resMr);
  fa.remote = Remote(&dst[3], dstMr);
  fa.swapAdd = 1;
  crdma::WriteWqe(loop.ep.sq, start + 3, fa);
  Check(crdma::RingDoorbell(loop.ep, start, 4, start + 3, Ctx()), loop.ep);

  const crdma::QueueResult q = crdma::Quiet(loop.ep, Ctx());
  ASSERT_EQ(q.status, crdma::QueueStatus::kQpError);
  const crdma::CqErrorInfo& e = loop.counters->error;
  EXPECT_EQ(e.qpn, 0xabcdeu);
  EXPECT_EQ(e.wqeCounter, static_cast<uint16_t>(start + 1));
  EXPECT_EQ(e.syndrome, expectSyndrome);
  EXPECT_EQ(e.sendOpcode, mlx5::kOpRdmaWrite);
  const std::string msg = application::DescribeQueueResult(q, loop.ep);
  EXPECT_NE(msg.find("QP 0xabcde"), std::string::npos) << msg;
  EXPECT_NE(msg.find("WQE index 6"), std::string::npos) << msg;
  EXPECT_THROW(application::ThrowIfFailed(q, loop.ep), core::RemoteError);
  EXPECT_EQ(dst[0], 11u);
  EXPECT_EQ(dst[1], 0u);
  EXPECT_EQ(dst[2], 0u) << "WQE after the error must be flushed, not executed";
  EXPECT_EQ(dst[3], 0u);
  EXPECT_EQ(emu.QpState(loop.qpIndex), application::EmuQpState::kError);
  // CQEs in the ring: 5 NOPs + good write (REQ), bad (REQ_ERR), then two flushes.
  for (int i = 0; i < 4; i++) {
    const mlx5::Mlx5CqeFields f = mlx5::DecodeCqe(loop.cq.get() + (5 + i) * 64);
    EXPECT_EQ(f.wqeCounter, static_cast<uint16_t>(start + i));
    EXPECT_EQ(f.qpn, 0xabcdeu);
    if (i == 0) {
      EXPECT_EQ(f.opcode, mlx5::kCqeReq);
      EXPECT_EQ(f.byteCount, 8u);
    } else {
      EXPECT_EQ(f.opcode, mlx5::kCqeReqErr);
      EXPECT_EQ(f.syndrome, i == 1 ? expectSyndrome : uint8_t(mlx5::kSyndromeWrFlushErr));
    }
  }
  EXPECT_EQ(emu.Stats().wqesFlushed, 2u);
  // A QP in error refuses new work at once.
  EXPECT_EQ(crdma::ReserveSlots(loop.ep, 1, Ctx()).status, crdma::QueueStatus::kQpError);
}

TEST(RdmaEmulator, ErrorBadRkeyAndFlush) { RunErrorBatch(0); }
TEST(RdmaEmulator, ErrorOutOfRange) { RunErrorBatch(1); }
TEST(RdmaEmulator, ErrorNoRemoteWriteAccess) { RunErrorBatch(2); }
TEST(RdmaEmulator, ErrorKeyOfWrongPe) { RunErrorBatch(3); }
TEST(RdmaEmulator, ErrorBadLkey) { RunErrorBatch(4); }

// Misaligned atomic target: remote invalid request.
TEST(RdmaEmulator, ErrorMisalignedAtomic) {
  Loop loop(8, 8);
  QueueEmulator emu;
  loop.Attach(emu);
  alignas(8) uint64_t words[2] = {0, 0}, res = 0;
  auto wMr = emu.RegisterMemory(1, words, sizeof(words), EmuAccess::kEmuAllAccess);
  auto rMr = emu.RegisterMemory(0, &res, 8, EmuAccess::kEmuAllAccess);
  emu.Start();
  crdma::WqeDesc d{};
  d.kind = crdma::WqeKind::kFetchAdd;
  d.local = Local(&res, 8, rMr);
  d.remote = Remote(reinterpret_cast<uint8_t*>(words) + 4, wMr);
  d.swapAdd = 1;
  Check(crdma::PostWqe(loop.ep, d, Ctx()), loop.ep);
  EXPECT_EQ(crdma::Quiet(loop.ep, Ctx()).status, crdma::QueueStatus::kQpError);
  EXPECT_EQ(loop.counters->error.syndrome, mlx5::kSyndromeRemoteInvalReqErr);
}

// Emulator never started: the ring fills, then posting and quiet time out with a clear message.
TEST(RdmaEmulator, WaitsAreBoundedWithoutEmulator) {
  Loop loop(8, 8);
  QueueEmulator emu;
  loop.Attach(emu);
  crdma::WqeDesc nop{};
  nop.kind = crdma::WqeKind::kNop;
  for (int i = 0; i < 8; i++) Check(crdma::PostWqe(loop.ep, nop, Ctx()), loop.ep);
  const auto t0 = std::chrono::steady_clock::now();
  const crdma::QueueResult r = crdma::PostWqe(loop.ep, nop, Ctx(50ull * 1000 * 1000));
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_EQ(r.status, crdma::QueueStatus::kTimeout);
  EXPECT_LT(ms, 2000.0);
  const std::string msg = application::DescribeQueueResult(r, loop.ep);
  EXPECT_NE(msg.find("timed out"), std::string::npos) << msg;
  EXPECT_NE(msg.find("SQ slots freed by completions"), std::string::npos) << msg;
  EXPECT_NE(msg.find(">= 1, saw 0"), std::string::npos) << msg;
  try {
    Check(crdma::Quiet(loop.ep, Ctx(20ull * 1000 * 1000)), loop.ep);
    FAIL() << "quiet should time out";
  } catch (const core::TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("quiet"), std::string::npos) << e.what();
  }
  // The publisher behind an unpublished reservation also gives up in time.
  crdma::QpCounters c2{};
  Buf sq2 = Alloc(64 * 8), cq2 = Alloc(64 * 8);
  application::EmuInitCqRing(cq2.get(), 8);
  crdma::QpEndpoint ep2 = crdma::MakeEndpoint(sq2.get(), 8, 7, cq2.get(), 8, &c2);
  crdma::QueueResult a = crdma::ReserveSlots(ep2, 1, Ctx());  // never published
  crdma::QueueResult b = crdma::ReserveSlots(ep2, 1, Ctx());
  ASSERT_EQ(a.status, crdma::QueueStatus::kOk);
  crdma::WriteWqe(ep2.sq, b.value, nop);
  const crdma::QueueResult rb = crdma::RingDoorbell(ep2, b.value, 1, b.value, Ctx(20ull * 1000 * 1000));
  ASSERT_EQ(rb.status, crdma::QueueStatus::kTimeout);
  EXPECT_NE(application::DescribeQueueResult(rb, ep2).find("earlier SQ reservations published"),
            std::string::npos);
}

TEST(RdmaEmulator, StartStopAndManualProcessing) {
  Loop loop(8, 8);
  QueueEmulator emu;
  loop.Attach(emu);
  for (int i = 0; i < 20; i++) {
    emu.Start();
    emu.Stop();
  }
  EXPECT_FALSE(emu.Running());
  crdma::WqeDesc nop{};
  nop.kind = crdma::WqeKind::kNop;
  Check(crdma::PostWqe(loop.ep, nop, Ctx()), loop.ep);
  Check(crdma::PostWqe(loop.ep, nop, Ctx()), loop.ep);
  EXPECT_EQ(emu.ProcessOnce(), 2u);
  Check(crdma::Quiet(loop.ep, Ctx()), loop.ep);
  EXPECT_EQ(emu.Stats().cqesWritten, 2u);
  // Configuration errors are typed.
  application::EmuQpConfig bad = application::EmuQpFromEndpoint(loop.ep, 0, 1);
  bad.sqBlocks = 6;
  EXPECT_THROW(emu.AddQp(bad), core::InvalidUsageError);
}

}  // namespace

// The RDMA posting protocol (core/transport/rdma_queue.hpp) driven by host threads against the
// software queue emulator: data, atomics, ordering, 16-bit wrap, SQ full, error CQEs and flush,
// bounded waits, selective signalling, wire statistics and the trace ring, chaos mode. Every WQE
// goes through the mlx5 encoders into a real ring; the emulator executes the bytes it finds there.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
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
  void Attach(QueueEmulator& emu, int pe = 0, int remotePe = 1) {
    qpIndex = emu.AddQp(application::EmuQpFromEndpoint(ep, pe, remotePe));
  }
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
// 12,000 WQEs wrap the 256-block ring 46 times (the 16-bit wqe_index wrap:
// InlineWritesReadsAndWrap). Posters publish in reservation order, so with more threads than free
// cores every post waits for the scheduler to run the thread whose turn it is: 80,000 WQEs took
// 60-100 s on 2 cores beside 2 busy processes (1 s idle), hence the smaller count.
TEST(RdmaEmulator, ManyThreadsWritesAndFetchAdd) {
  constexpr int kThreads = 8, kOps = 1500;
  Loop loop(256, 256);
  QueueEmulator emu;
  loop.Attach(emu);
  std::vector<uint64_t> src(kThreads * kOps), dst(kThreads * kOps, 0),
      results(kThreads * kOps, ~0ull);
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
  std::vector<uint8_t> remote(kSlots * kSlotBytes, 0), expect(remote.size(), 0),
      back(remote.size());
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
  alignas(8) uint8_t mapped[1024] = {};     // where PE 1's memory is reachable from here
  const uint64_t iova = 0x7f0000100000ull;  // PE 1's own address for it (never dereferenced)
  const uint32_t peerKey = 0xabcd01u;       // the key PE 1's registration produced
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
    case 0: bad.remote.rkey = dstMr.rkey ^ 0x100; break;                       // unknown rkey
    case 1: bad.remote.addr = reinterpret_cast<uint64_t>(&dst[3]) + 4; break;  // past the end
    case 2: bad.remote.rkey = noWrite.rkey; break;  // no remote write access
    case 3:
      bad.remote.rkey = srcMr.rkey;
      bad.remote.addr = d.local.addr;
      break;  // PE 0's key
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
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
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
  const crdma::QueueResult rb =
      crdma::RingDoorbell(ep2, b.value, 1, b.value, Ctx(20ull * 1000 * 1000));
  ASSERT_EQ(rb.status, crdma::QueueStatus::kTimeout);
  EXPECT_NE(application::DescribeQueueResult(rb, ep2).find("earlier SQ reservations published"),
            std::string::npos);
}

// The host accessor, whose copies of at least `gateBytes` wait until Release(): an emulator whose
// copies are held up.
class GatedAccessor : public application::EmuMemoryAccessor {
 public:
  explicit GatedAccessor(size_t gateBytes) : gateBytes(gateBytes) {}
  void Copy(void* dst, const void* src, size_t bytes) override {
    if (bytes >= gateBytes) {
      held.store(true, std::memory_order_release);
      while (!released.load(std::memory_order_acquire))
        std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    host->Copy(dst, src, bytes);
  }
  uint64_t FetchAdd64(void* target, uint64_t add) override { return host->FetchAdd64(target, add); }
  uint64_t CompareSwap64(void* target, uint64_t expected, uint64_t desired) override {
    return host->CompareSwap64(target, expected, desired);
  }
  void Flush() override { host->Flush(); }
  void Release() { released.store(true, std::memory_order_release); }
  std::atomic<bool> held{false};

 private:
  std::unique_ptr<application::EmuMemoryAccessor> host = application::MakeHostMemoryAccessor();
  size_t gateBytes;
  std::atomic<bool> released{false};
};

// InterNodeV1's combine tail on one QP, with the emulator held up in the chunk's copy (as seen on
// a GPU at 2 x 4): a signalled WRITE completes (the blocks before), then the chunk WRITE
// (unsignalled) + its tail in one doorbell and the inline landFree. The quiet expires exactly
// those 3 blocks short and the tail has not landed ("saw 0" at the owner); nothing is lost: once
// the copy goes through, every WQE completes in order and the quiet succeeds.
TEST(RdmaEmulator, HeldCopyLeavesQuietShortByTheWqesBehindIt) {
  constexpr size_t kChunk = 4096;
  Loop loop(64, 64);
  auto gate = std::make_unique<GatedAccessor>(kChunk);
  GatedAccessor* g = gate.get();
  QueueEmulator emu(std::move(gate));
  loop.Attach(emu);
  std::vector<uint8_t> src(kChunk + 128), dst(kChunk + 128, 0);
  for (size_t i = 0; i < src.size(); i++) src[i] = static_cast<uint8_t>(i * 37 + 11);
  uint64_t words[2] = {0, 0};  // the peer's landing tail and landFree
  auto srcMr = emu.RegisterMemory(0, src.data(), src.size(), EmuAccess::kEmuAllAccess);
  auto dstMr = emu.RegisterMemory(1, dst.data(), dst.size(), EmuAccess::kEmuAllAccess);
  auto wordMr = emu.RegisterMemory(1, words, sizeof(words), EmuAccess::kEmuAllAccess);
  emu.Start();
  crdma::WqeDesc rec{};  // an earlier signalled WRITE (the count record): completes
  rec.kind = crdma::WqeKind::kWrite;
  rec.local = Local(&src[kChunk], 128, srcMr);
  rec.remote = Remote(&dst[kChunk], dstMr);
  Check(crdma::PostWqe(loop.ep, rec, Ctx()), loop.ep);
  Check(crdma::Quiet(loop.ep, Ctx()), loop.ep);
  const uint64_t before = *loop.ep.cq.completed;
  ASSERT_EQ(before, 1u);
  crdma::WqeDesc chunk{};
  chunk.kind = crdma::WqeKind::kWrite;
  chunk.unsignalled = true;
  chunk.local = Local(src.data(), kChunk, srcMr);
  chunk.remote = Remote(dst.data(), dstMr);
  const uint64_t tailValue = (uint64_t{1} << 32) | 85;  // {call 1, 85 records}
  Check(crdma::PostWriteWithSignal(
            loop.ep, chunk,
            crdma::SignalWqe(crdma::SignalUpdate::kSet, Remote(&words[0], wordMr), tailValue,
                             mlx5::Mlx5LocalBuf{0, 0, 0}),
            Ctx()),
        loop.ep);
  const uint64_t freed = uint64_t{1} << 32;
  crdma::WqeDesc landFree{};
  landFree.kind = crdma::WqeKind::kWriteInline;
  landFree.inlineData = &freed;
  landFree.local = mlx5::Mlx5LocalBuf{0, 0, sizeof(freed)};
  landFree.remote = Remote(&words[1], wordMr);
  Check(crdma::PostWqe(loop.ep, landFree, Ctx()), loop.ep);
  ASSERT_EQ(*loop.ep.sq.ready, before + 3);
  for (int i = 0; i < 100000 && !g->held.load(); i++)
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  ASSERT_TRUE(g->held.load());
  const crdma::QueueResult r = crdma::Quiet(loop.ep, Ctx(50ull * 1000 * 1000));
  ASSERT_EQ(r.status, crdma::QueueStatus::kTimeout);
  EXPECT_EQ(r.expected, before + 3);
  EXPECT_EQ(r.seen, before);
  EXPECT_EQ(__atomic_load_n(&words[0], __ATOMIC_ACQUIRE), 0u);
  g->Release();
  Check(crdma::Quiet(loop.ep, Ctx()), loop.ep);
  EXPECT_EQ(*loop.ep.cq.completed, before + 3);
  EXPECT_EQ(words[0], tailValue);
  EXPECT_EQ(words[1], freed);
  EXPECT_EQ(dst, src);
  emu.Stop();
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

// --- wire statistics, trace ring, selective signalling, chaos mode ---------------------------

using application::EmuOptions;
using application::RdmaOpcode;
using application::RdmaOpStats;
using application::RdmaWireStats;
using application::RdmaWqeOutcome;

crdma::WqeDesc WriteDesc(const void* src, uint32_t len, application::EmuMemoryRegion smr,
                         const void* dst, application::EmuMemoryRegion dmr) {
  crdma::WqeDesc d{};
  d.kind = crdma::WqeKind::kWrite;
  d.local = Local(src, len, smr);
  d.remote = Remote(dst, dmr);
  return d;
}

crdma::WqeDesc NopDesc() {
  crdma::WqeDesc d{};
  d.kind = crdma::WqeKind::kNop;
  return d;
}

// Posts one WQE and lets the emulator execute it in this thread.
void PostAndProcess(QueueEmulator& emu, Loop& loop, const crdma::WqeDesc& d) {
  Check(crdma::PostWqe(loop.ep, d, Ctx()), loop.ep);
  EXPECT_EQ(emu.ProcessOnce(), 1u);
}

const RdmaOpStats* FindRow(const RdmaWireStats& s, int src, int dst, RdmaOpcode op) {
  for (const RdmaOpStats& r : s.perPeer) {
    if (r.srcPe == src && r.dstPe == dst && r.opcode == op) return &r;
  }
  return nullptr;
}

// Expected row: counts, then the non-empty histogram buckets as {bucket, count}.
struct ExpectRow {
  int src, dst;
  RdmaOpcode op;
  uint64_t wqes, bytes, inlineWqes, atomics, errors, flushed;
  std::vector<std::pair<int, uint64_t>> hist;
};

void ExpectRows(const RdmaWireStats& s, const std::vector<ExpectRow>& rows) {
  ASSERT_EQ(s.perPeer.size(), rows.size());
  for (const ExpectRow& e : rows) {
    const RdmaOpStats* r = FindRow(s, e.src, e.dst, e.op);
    ASSERT_NE(r, nullptr) << e.src << "->" << e.dst << " " << application::RdmaOpcodeName(e.op);
    SCOPED_TRACE(std::to_string(e.src) + "->" + std::to_string(e.dst) + " " +
                 application::RdmaOpcodeName(e.op));
    EXPECT_EQ(r->wqes, e.wqes);
    EXPECT_EQ(r->bytes, e.bytes);
    EXPECT_EQ(r->inlineWqes, e.inlineWqes);
    EXPECT_EQ(r->atomics, e.atomics);
    EXPECT_EQ(r->errors, e.errors);
    EXPECT_EQ(r->flushed, e.flushed);
    std::array<uint64_t, application::kRdmaSizeBuckets> want{};
    for (auto [bucket, count] : e.hist) want[bucket] = count;
    for (int k = 0; k < application::kRdmaSizeBuckets; k++)
      EXPECT_EQ(r->sizeHist[k], want[k]) << "size bucket " << k;
  }
  // Sorted by (src, dst, opcode).
  for (size_t i = 1; i < s.perPeer.size(); i++) {
    const RdmaOpStats &a = s.perPeer[i - 1], &b = s.perPeer[i];
    EXPECT_TRUE(std::make_tuple(a.srcPe, a.dstPe, a.opcode) <
                std::make_tuple(b.srcPe, b.dstPe, b.opcode));
  }
}

TEST(RdmaEmulatorStats, SizeBucketsAndNames) {
  using application::RdmaSizeBucket;
  EXPECT_EQ(RdmaSizeBucket(0), 0);
  EXPECT_EQ(RdmaSizeBucket(1), 1);
  EXPECT_EQ(RdmaSizeBucket(2), 2);
  EXPECT_EQ(RdmaSizeBucket(3), 2);
  EXPECT_EQ(RdmaSizeBucket(4), 3);
  EXPECT_EQ(RdmaSizeBucket(8), 4);
  EXPECT_EQ(RdmaSizeBucket(4095), 12);
  EXPECT_EQ(RdmaSizeBucket(4096), 13);
  EXPECT_EQ(RdmaSizeBucket(0xffffffffull), 32);
  EXPECT_EQ(RdmaSizeBucket(1ull << 40), application::kRdmaSizeBuckets - 1);
  EXPECT_EQ(application::RdmaSizeBucketLow(0), 0u);
  EXPECT_EQ(application::RdmaSizeBucketLow(1), 1u);
  EXPECT_EQ(application::RdmaSizeBucketLow(13), 4096u);
  const char* names[] = {"write",        "write_inline", "read", "fetch_add",
                         "compare_swap", "write_imm",    "nop",  "other"};
  for (int op = 0; op < application::kRdmaNumOpcodes; op++)
    EXPECT_STREQ(application::RdmaOpcodeName(static_cast<RdmaOpcode>(op)), names[op]);
}

// Every opcode on two QPs to PE 1 (counted together) and one QP to PE 2 that fails: exact
// counts, bytes, inline and atomic counts, histogram buckets, errors and flushes; then reset.
TEST(RdmaEmulatorStats, ExactCountsPerPeerAndOpcodeAndReset) {
  Loop a(64, 64, 0x100), b(64, 64, 0x101), c(64, 64, 0x102);
  QueueEmulator emu;
  a.Attach(emu, 0, 1);
  b.Attach(emu, 0, 1);
  c.Attach(emu, 0, 2);
  std::vector<uint8_t> src(8192), dst1(8192, 0), dst2(256, 0), back(256);
  for (size_t i = 0; i < src.size(); i++) src[i] = static_cast<uint8_t>(i * 13 + 5);
  alignas(8) uint64_t words[4] = {0, 0, 0, 0}, results[8] = {};
  auto srcMr = emu.RegisterMemory(0, src.data(), src.size(), EmuAccess::kEmuAllAccess);
  auto backMr = emu.RegisterMemory(0, back.data(), back.size(), EmuAccess::kEmuAllAccess);
  auto resMr = emu.RegisterMemory(0, results, sizeof(results), EmuAccess::kEmuAllAccess);
  auto dst1Mr = emu.RegisterMemory(1, dst1.data(), dst1.size(), EmuAccess::kEmuAllAccess);
  auto wordsMr = emu.RegisterMemory(1, words, sizeof(words), EmuAccess::kEmuAllAccess);
  auto dst2Mr = emu.RegisterMemory(2, dst2.data(), dst2.size(), EmuAccess::kEmuAllAccess);

  uint32_t off = 0;
  for (uint32_t len : {1u, 8u, 64u, 100u, 4096u}) {  // buckets 1, 4, 7, 7, 13
    PostAndProcess(emu, a, WriteDesc(&src[off], len, srcMr, &dst1[off], dst1Mr));
    off += len;
  }
  uint8_t payload[200];
  for (uint32_t i = 0; i < sizeof(payload); i++) payload[i] = static_cast<uint8_t>(i ^ 0x5a);
  for (uint32_t len : {5u, 64u, 200u}) {  // buckets 3, 7, 8
    crdma::WqeDesc d{};
    d.kind = crdma::WqeKind::kWriteInline;
    d.local.len = len;
    d.inlineData = payload;
    d.remote = Remote(&dst1[6000], dst1Mr);
    PostAndProcess(emu, a, d);
  }
  crdma::WqeDesc rd{};
  rd.kind = crdma::WqeKind::kRead;
  rd.local = Local(back.data(), 256, backMr);
  rd.remote = Remote(&dst1[0], dst1Mr);
  PostAndProcess(emu, a, rd);  // bucket 9
  for (int i = 0; i < 3; i++) {
    crdma::WqeDesc fa{};
    fa.kind = crdma::WqeKind::kFetchAdd;
    fa.local = Local(&results[i], 8, resMr);
    fa.remote = Remote(&words[0], wordsMr);
    fa.swapAdd = 10;
    PostAndProcess(emu, a, fa);
  }
  for (int i = 0; i < 2; i++) {
    crdma::WqeDesc cs{};
    cs.kind = crdma::WqeKind::kCompareSwap;
    cs.local = Local(&results[3 + i], 8, resMr);
    cs.remote = Remote(&words[1], wordsMr);
    cs.compare = 0;
    cs.swapAdd = 77;  // succeeds once
    PostAndProcess(emu, a, cs);
  }
  PostAndProcess(emu, a, NopDesc());
  PostAndProcess(emu, a, NopDesc());
  crdma::WqeDesc imm = WriteDesc(&src[100], 16, srcMr, &dst1[7000], dst1Mr);
  imm.kind = crdma::WqeKind::kWriteImm;
  imm.immHost = 42;
  PostAndProcess(emu, a, imm);  // bucket 5
  PostAndProcess(emu, b, WriteDesc(&src[200], 8, srcMr, &dst1[7100], dst1Mr));
  PostAndProcess(emu, b, WriteDesc(&src[208], 8, srcMr, &dst1[7108], dst1Mr));
  // To PE 2: one good write (bucket 6), a bad rkey, then a fetch-add and an inline write that
  // are flushed.
  PostAndProcess(emu, c, WriteDesc(&src[0], 32, srcMr, &dst2[0], dst2Mr));
  crdma::WqeDesc bad = WriteDesc(&src[0], 32, srcMr, &dst2[64], dst2Mr);
  bad.remote.rkey ^= 0x100;
  Check(crdma::PostWqe(c.ep, bad, Ctx()), c.ep);
  crdma::WqeDesc fa{};
  fa.kind = crdma::WqeKind::kFetchAdd;
  fa.local = Local(&results[7], 8, resMr);
  fa.remote = Remote(&words[3], wordsMr);
  fa.swapAdd = 1;
  Check(crdma::PostWqe(c.ep, fa, Ctx()), c.ep);
  crdma::WqeDesc inl{};
  inl.kind = crdma::WqeKind::kWriteInline;
  inl.local.len = 4;
  inl.inlineData = payload;
  inl.remote = Remote(&dst2[128], dst2Mr);
  Check(crdma::PostWqe(c.ep, inl, Ctx()), c.ep);
  EXPECT_EQ(emu.ProcessOnce(), 3u);
  Check(crdma::Quiet(a.ep, Ctx()), a.ep);
  Check(crdma::Quiet(b.ep, Ctx()), b.ep);
  EXPECT_EQ(crdma::Quiet(c.ep, Ctx()).status, crdma::QueueStatus::kQpError);
  // The data moved as counted.
  EXPECT_EQ(std::memcmp(dst1.data(), src.data(), 4269), 0);
  EXPECT_EQ(std::memcmp(back.data(), src.data(), 256), 0);
  EXPECT_EQ(words[0], 30u);
  EXPECT_EQ(words[1], 77u);
  EXPECT_EQ(words[3], 0u);
  EXPECT_EQ(dst2[128], 0u);

  const std::vector<ExpectRow> expected = {
      {0, 1, RdmaOpcode::kWrite, 7, 4269 + 16, 0, 0, 0, 0, {{1, 1}, {4, 3}, {7, 2}, {13, 1}}},
      {0, 1, RdmaOpcode::kWriteInline, 3, 269, 3, 0, 0, 0, {{3, 1}, {7, 1}, {8, 1}}},
      {0, 1, RdmaOpcode::kRead, 1, 256, 0, 0, 0, 0, {{9, 1}}},
      {0, 1, RdmaOpcode::kFetchAdd, 3, 24, 0, 3, 0, 0, {{4, 3}}},
      {0, 1, RdmaOpcode::kCompareSwap, 2, 16, 0, 2, 0, 0, {{4, 2}}},
      {0, 1, RdmaOpcode::kWriteImm, 1, 16, 0, 0, 0, 0, {{5, 1}}},
      {0, 1, RdmaOpcode::kNop, 2, 0, 0, 0, 0, 0, {{0, 2}}},
      {0, 2, RdmaOpcode::kWrite, 1, 32, 0, 0, 1, 0, {{6, 1}}},
      {0, 2, RdmaOpcode::kWriteInline, 0, 0, 0, 0, 0, 1, {}},
      {0, 2, RdmaOpcode::kFetchAdd, 0, 0, 0, 0, 0, 1, {}},
  };
  const RdmaWireStats s = emu.WireStats(true);
  EXPECT_TRUE(s.available);
  EXPECT_EQ(s.source, "software queue emulator");
  ExpectRows(s, expected);
  EXPECT_TRUE(s.trace.empty());
  EXPECT_EQ(s.traceCapacity, 0u);
  EXPECT_EQ(s.traceDropped, 0u);
  EXPECT_EQ(emu.Stats().wqesExecuted, 20u);
  EXPECT_EQ(emu.Stats().errors, 1u);
  EXPECT_EQ(emu.Stats().wqesFlushed, 2u);
  // Reset: zero after the read above; counting goes on from there.
  EXPECT_TRUE(emu.WireStats().perPeer.empty());
  PostAndProcess(emu, b, NopDesc());
  PostAndProcess(emu, b, WriteDesc(&src[300], 3, srcMr, &dst1[7200], dst1Mr));
  ExpectRows(emu.WireStats(), {{0, 1, RdmaOpcode::kWrite, 1, 3, 0, 0, 0, 0, {{2, 1}}},
                               {0, 1, RdmaOpcode::kNop, 1, 0, 0, 0, 0, 0, {{0, 1}}}});
  ExpectRows(emu.WireStats(), {{0, 1, RdmaOpcode::kWrite, 1, 3, 0, 0, 0, 0, {{2, 1}}},
                               {0, 1, RdmaOpcode::kNop, 1, 0, 0, 0, 0, 0, {{0, 1}}}});
  // Rung but not executed: pending (one 64-byte SQ block each), not yet counted.
  EXPECT_EQ(emu.WireStats().pendingSqBlocks, 0u);
  Check(crdma::PostWqe(b.ep, NopDesc(), Ctx()), b.ep);
  Check(crdma::PostWqe(b.ep, WriteDesc(&src[300], 3, srcMr, &dst1[7200], dst1Mr), Ctx()), b.ep);
  const RdmaWireStats before = emu.WireStats();
  EXPECT_EQ(before.pendingSqBlocks, 2u);
  ExpectRows(before, {{0, 1, RdmaOpcode::kWrite, 1, 3, 0, 0, 0, 0, {{2, 1}}},
                      {0, 1, RdmaOpcode::kNop, 1, 0, 0, 0, 0, 0, {{0, 1}}}});
  EXPECT_EQ(emu.ProcessOnce(), 2u);
  const RdmaWireStats after = emu.WireStats();
  EXPECT_EQ(after.pendingSqBlocks, 0u);
  ExpectRows(after, {{0, 1, RdmaOpcode::kWrite, 2, 6, 0, 0, 0, 0, {{2, 2}}},
                     {0, 1, RdmaOpcode::kNop, 2, 0, 0, 0, 0, 0, {{0, 2}}}});
}

// The trace ring keeps the newest entries in execution order and counts the overwritten ones.
TEST(RdmaEmulatorStats, TraceRingOrderWrapAndDropped) {
  Loop a(32, 32, 0x200), b(32, 32, 0x201);
  EmuOptions opts;
  opts.traceEntries = 8;
  QueueEmulator emu(nullptr, opts);
  a.Attach(emu, 3, 5);
  b.Attach(emu, 3, 6);
  std::vector<uint8_t> src(64, 1), dst5(64, 0), dst6(64, 0);
  auto srcMr = emu.RegisterMemory(3, src.data(), src.size(), EmuAccess::kEmuAllAccess);
  auto d5 = emu.RegisterMemory(5, dst5.data(), dst5.size(), EmuAccess::kEmuAllAccess);
  auto d6 = emu.RegisterMemory(6, dst6.data(), dst6.size(), EmuAccess::kEmuAllAccess);
  // Writes of 1..12 bytes, alternating QPs: odd sizes on a, even sizes on b.
  const uint64_t t0 = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                std::chrono::steady_clock::now().time_since_epoch())
                                                .count());
  auto post = [&](uint32_t len) {
    if (len % 2 == 1) {
      PostAndProcess(emu, a, WriteDesc(src.data(), len, srcMr, dst5.data(), d5));
    } else {
      PostAndProcess(emu, b, WriteDesc(src.data(), len, srcMr, dst6.data(), d6));
    }
  };
  for (uint32_t len = 1; len <= 5; len++) post(len);
  RdmaWireStats s = emu.WireStats();
  EXPECT_EQ(s.traceCapacity, 8u);
  EXPECT_EQ(s.traceDropped, 0u);
  ASSERT_EQ(s.trace.size(), 5u);
  for (uint32_t len = 6; len <= 12; len++) post(len);
  s = emu.WireStats(true);
  EXPECT_EQ(s.traceDropped, 4u);
  ASSERT_EQ(s.trace.size(), 8u);
  uint64_t lastTime = t0;
  for (size_t i = 0; i < s.trace.size(); i++) {
    const application::RdmaTraceEntry& e = s.trace[i];
    const uint32_t len = static_cast<uint32_t>(5 + i);  // sizes 5..12 survive, oldest first
    const bool onA = len % 2 == 1;
    SCOPED_TRACE("entry " + std::to_string(i));
    EXPECT_EQ(e.bytes, len);
    EXPECT_EQ(e.opcode, RdmaOpcode::kWrite);
    EXPECT_EQ(e.outcome, RdmaWqeOutcome::kOk);
    EXPECT_EQ(e.qp, onA ? a.qpIndex : b.qpIndex);
    EXPECT_EQ(e.qpn, onA ? 0x200u : 0x201u);
    EXPECT_EQ(e.srcPe, 3);
    EXPECT_EQ(e.dstPe, onA ? 5 : 6);
    EXPECT_EQ(e.wqeIndex, (len - 1) / 2);  // each QP's own WQE count
    EXPECT_GE(e.timeNs, lastTime);
    lastTime = e.timeNs;
  }
  // After the reset: empty, nothing dropped; new entries start over.
  s = emu.WireStats();
  EXPECT_TRUE(s.trace.empty());
  EXPECT_EQ(s.traceDropped, 0u);
  PostAndProcess(emu, a, NopDesc());
  s = emu.WireStats();
  ASSERT_EQ(s.trace.size(), 1u);
  EXPECT_EQ(s.trace[0].opcode, RdmaOpcode::kNop);
  EXPECT_EQ(s.trace[0].wqeIndex, 6u);
  // The ring size is bounded.
  EmuOptions tooBig;
  tooBig.traceEntries = application::kEmuMaxTraceEntries + 1;
  EXPECT_THROW(QueueEmulator(nullptr, tooBig), core::InvalidUsageError);
}

// Clears the CQ-update request of the WQE at `block` (the posting side's WriteWqe signals every
// WQE).
void Unsignal(const crdma::SqHandle& sq, uint64_t block) {
  auto* ctrl = static_cast<uint8_t*>(
      mlx5::SqBasicBlock(sq.ring, static_cast<uint32_t>(block), sq.numBlocks));
  ctrl[11] = static_cast<uint8_t>(ctrl[11] & ~mlx5::kCtrlCqUpdate);
}

// Posts `descs` with one doorbell; all but those marked in `signalled` carry no CQ-update flag.
uint64_t PostBatch(const crdma::QpEndpoint& ep, const std::vector<crdma::WqeDesc>& descs,
                   const std::vector<bool>& signalled) {
  uint32_t blocks = 0;
  for (const auto& d : descs) blocks += crdma::WqeBlocks(d);
  crdma::QueueResult r = crdma::ReserveSlots(ep, blocks, Ctx());
  Check(r, ep);
  uint64_t at = r.value, last = r.value;
  for (size_t i = 0; i < descs.size(); i++) {
    last = at;
    at += crdma::WriteWqe(ep.sq, at, descs[i]);
    if (!signalled[i]) Unsignal(ep.sq, last);
  }
  Check(crdma::RingDoorbell(ep, r.value, blocks, last, Ctx()), ep);
  return r.value;
}

// WQEs without kCtrlCqUpdate execute without a CQE; the next signalled CQE completes them all
// (`completed` advances exactly over every block up to and including the signalled WQE).
TEST(RdmaEmulatorSignalling, UnsignalledCompleteThroughNextSignalledCqe) {
  Loop loop(16, 16);
  QueueEmulator emu;
  loop.Attach(emu);
  std::vector<uint8_t> src(1024), dst(1024, 0);
  for (size_t i = 0; i < src.size(); i++) src[i] = static_cast<uint8_t>(i * 7 + 3);
  auto srcMr = emu.RegisterMemory(0, src.data(), src.size(), EmuAccess::kEmuAllAccess);
  auto dstMr = emu.RegisterMemory(1, dst.data(), dst.size(), EmuAccess::kEmuAllAccess);
  uint8_t payload[200];
  for (uint32_t i = 0; i < sizeof(payload); i++) payload[i] = static_cast<uint8_t>(200 - i);
  crdma::WqeDesc inl{};
  inl.kind = crdma::WqeKind::kWriteInline;
  inl.local.len = 200;  // 4 blocks
  inl.inlineData = payload;
  inl.remote = Remote(&dst[512], dstMr);
  // Three unsignalled WQEs (1 + 4 + 1 blocks): executed, no CQE, nothing completes.
  PostBatch(loop.ep,
            {WriteDesc(&src[0], 64, srcMr, &dst[0], dstMr), inl,
             WriteDesc(&src[64], 64, srcMr, &dst[64], dstMr)},
            {false, false, false});
  EXPECT_EQ(emu.ProcessOnce(), 3u);
  EXPECT_EQ(emu.Stats().wqesExecuted, 3u);
  EXPECT_EQ(emu.Stats().cqesWritten, 0u);
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), 128), 0);
  EXPECT_EQ(std::memcmp(&dst[512], payload, 200), 0);
  EXPECT_EQ(crdma::PollCq(loop.ep.sq, loop.ep.cq), 0u);
  EXPECT_EQ(loop.counters->completed, 0u);
  // A signalled NOP: one CQE naming it, and completed covers all 7 blocks.
  PostBatch(loop.ep, {NopDesc()}, {true});
  EXPECT_EQ(emu.ProcessOnce(), 1u);
  EXPECT_EQ(emu.Stats().cqesWritten, 1u);
  const mlx5::Mlx5CqeFields f = mlx5::DecodeCqe(loop.cq.get());
  EXPECT_EQ(f.opcode, mlx5::kCqeReq);
  EXPECT_EQ(f.wqeCounter, 6u);
  EXPECT_EQ(crdma::PollCq(loop.ep.sq, loop.ep.cq), 1u);
  EXPECT_EQ(loop.counters->completed, 7u);
  Check(crdma::Quiet(loop.ep, Ctx()), loop.ep);

  // Many laps of the 16-block ring in batches of 3 unsignalled + 1 signalled WQE, emulator
  // running: completed ends exactly at ready, one CQE per batch.
  emu.Start();
  constexpr int kBatches = 3000;
  for (int i = 0; i < kBatches; i++) {
    const uint32_t o = static_cast<uint32_t>(i % 8) * 64;
    PostBatch(loop.ep,
              {WriteDesc(&src[o], 8, srcMr, &dst[o], dstMr), inl,
               WriteDesc(&src[o + 8], 8, srcMr, &dst[o + 8], dstMr), NopDesc()},
              {false, false, false, true});
  }
  Check(crdma::Quiet(loop.ep, Ctx()), loop.ep);
  emu.Stop();
  EXPECT_EQ(loop.counters->completed, loop.counters->ready);
  EXPECT_EQ(loop.counters->ready, 7u + kBatches * 7u);
  EXPECT_EQ(emu.Stats().cqesWritten, 1u + kBatches);
  EXPECT_EQ(emu.Stats().wqesExecuted, 4u + kBatches * 4u);
}

// An unsignalled WQE that fails still writes its error CQE, and every later WQE (signalled or
// not) a flush CQE; unsignalled WQEs before it executed.
TEST(RdmaEmulatorSignalling, ErrorsAlwaysCompleteWithCqes) {
  Loop loop(16, 16, 0x77);
  QueueEmulator emu;
  loop.Attach(emu);
  std::vector<uint64_t> src = {1, 2, 3, 4}, dst(4, 0);
  auto srcMr = emu.RegisterMemory(0, src.data(), 32, EmuAccess::kEmuAllAccess);
  auto dstMr = emu.RegisterMemory(1, dst.data(), 32, EmuAccess::kEmuAllAccess);
  crdma::WqeDesc bad = WriteDesc(&src[1], 8, srcMr, &dst[1], dstMr);
  bad.remote.rkey ^= 0x100;
  const uint64_t start = PostBatch(
      loop.ep,
      {WriteDesc(&src[0], 8, srcMr, &dst[0], dstMr), bad,
       WriteDesc(&src[2], 8, srcMr, &dst[2], dstMr), WriteDesc(&src[3], 8, srcMr, &dst[3], dstMr)},
      {false, false, false, true});
  EXPECT_EQ(emu.ProcessOnce(), 4u);
  EXPECT_EQ(dst, (std::vector<uint64_t>{1, 0, 0, 0}));
  EXPECT_EQ(emu.Stats().cqesWritten, 3u);  // the error and two flushes; none for the first write
  for (int i = 0; i < 3; i++) {
    const mlx5::Mlx5CqeFields f = mlx5::DecodeCqe(loop.cq.get() + i * 64);
    EXPECT_EQ(f.opcode, mlx5::kCqeReqErr);
    EXPECT_EQ(f.wqeCounter, static_cast<uint16_t>(start + 1 + i));
    EXPECT_EQ(f.syndrome, i == 0 ? uint8_t(mlx5::kSyndromeRemoteAccessErr)
                                 : uint8_t(mlx5::kSyndromeWrFlushErr));
  }
  EXPECT_EQ(crdma::Quiet(loop.ep, Ctx()).status, crdma::QueueStatus::kQpError);
  EXPECT_EQ(loop.counters->completed, start + 4);
  EXPECT_EQ(loop.counters->error.wqeCounter, static_cast<uint16_t>(start + 1));
  ExpectRows(emu.WireStats(), {{0, 1, RdmaOpcode::kWrite, 1, 8, 0, 0, 1, 2, {{4, 1}}}});
}

// Chaos mode, single-threaded: 4 QPs with 24 WQEs each, all published before processing starts.
// Returns the execution order as (QP index, wqe index) from the trace; checks that every WQE ran
// once, in order within its QP, and that every CQE arrives (in order) in the end.
struct ChaosRun {
  std::vector<std::pair<uint32_t, uint16_t>> order;
  size_t lateAfterExecution = 0;
};

ChaosRun RunChaosSchedule(uint64_t seed) {
  constexpr int kQps = 4, kPerQp = 24;
  std::vector<std::unique_ptr<Loop>> loops;
  for (int q = 0; q < kQps; q++) loops.push_back(std::make_unique<Loop>(32, 32, 0x300 + q));
  EmuOptions opts;
  opts.chaosSeed = seed;
  opts.traceEntries = 1024;
  QueueEmulator emu(nullptr, opts);
  for (auto& l : loops) l->Attach(emu);
  alignas(8) static uint64_t counters[kQps];
  std::vector<uint64_t> olds(kQps * kPerQp, ~0ull);
  for (auto& c : counters) c = 0;
  auto ctrMr = emu.RegisterMemory(1, counters, sizeof(counters), EmuAccess::kEmuAllAccess);
  auto oldMr = emu.RegisterMemory(0, olds.data(), olds.size() * 8, EmuAccess::kEmuAllAccess);
  for (int q = 0; q < kQps; q++) {
    for (int i = 0; i < kPerQp; i++) {
      crdma::WqeDesc fa{};
      fa.kind = crdma::WqeKind::kFetchAdd;
      fa.local = Local(&olds[q * kPerQp + i], 8, oldMr);
      fa.remote = Remote(&counters[q], ctrMr);
      fa.swapAdd = 1;
      Check(crdma::PostWqe(loops[q]->ep, fa, Ctx()), loops[q]->ep);
    }
  }
  ChaosRun run;
  for (int round = 0; emu.Stats().wqesExecuted < kQps * kPerQp && round < 100000; round++) {
    emu.ProcessOnce();
  }
  EXPECT_EQ(emu.Stats().wqesExecuted, uint64_t(kQps) * kPerQp);
  run.lateAfterExecution = emu.PendingCqes();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (emu.PendingCqes() > 0 && std::chrono::steady_clock::now() < deadline) {
    EXPECT_EQ(emu.ProcessOnce(), 0u);
    std::this_thread::yield();
  }
  EXPECT_EQ(emu.PendingCqes(), 0u);
  for (int q = 0; q < kQps; q++) {
    Check(crdma::Quiet(loops[q]->ep, Ctx()), loops[q]->ep);
    EXPECT_EQ(loops[q]->counters->completed, uint64_t(kPerQp));
    EXPECT_EQ(counters[q], uint64_t(kPerQp)) << "QP " << q;
    for (int i = 0; i < kPerQp; i++) {
      // The i-th fetch-add of a QP saw exactly the i before it: once each, in RC order.
      EXPECT_EQ(olds[q * kPerQp + i], uint64_t(i)) << "QP " << q << " WQE " << i;
      const mlx5::Mlx5CqeFields f = mlx5::DecodeCqe(loops[q]->cq.get() + i * 64);
      EXPECT_EQ(f.opcode, mlx5::kCqeReq);
      EXPECT_EQ(f.wqeCounter, uint16_t(i)) << "CQEs of one QP stay in order";
    }
  }
  const RdmaWireStats s = emu.WireStats();
  EXPECT_EQ(s.source, seed == 0
                          ? std::string("software queue emulator")
                          : "software queue emulator (chaos seed " + std::to_string(seed) + ")");
  EXPECT_EQ(s.traceDropped, 0u);
  std::vector<uint16_t> next(kQps, 0);
  for (const auto& e : s.trace) {
    EXPECT_EQ(e.wqeIndex, next[e.qp]) << "QP " << e.qp << " out of order";
    next[e.qp] = static_cast<uint16_t>(e.wqeIndex + 1);
    run.order.emplace_back(e.qp, e.wqeIndex);
  }
  EXPECT_EQ(run.order.size(), size_t(kQps) * kPerQp);
  return run;
}

TEST(RdmaEmulatorChaos, ServesQpsOutOfOrderKeepsRcOrderAndIsSeeded) {
  const ChaosRun plain = RunChaosSchedule(0);
  EXPECT_EQ(plain.lateAfterExecution, 0u);
  for (size_t i = 0; i < plain.order.size(); i++) {
    ASSERT_EQ(plain.order[i].first, i / 24) << "plain mode drains QP after QP";
  }
  int reordered = 0;
  size_t late = 0;
  for (uint64_t seed : {1ull, 2ull, 3ull, 0x9e3779b97f4a7c15ull}) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    const ChaosRun a = RunChaosSchedule(seed);
    const ChaosRun b = RunChaosSchedule(seed);
    EXPECT_EQ(a.order, b.order) << "the same seed must give the same schedule";
    reordered += a.order != plain.order ? 1 : 0;
    late += a.lateAfterExecution;
  }
  EXPECT_GT(reordered, 0) << "chaos mode never changed the order in which QPs were served";
  EXPECT_GT(late, 0u) << "chaos mode never held a completion back";
  EXPECT_NE(RunChaosSchedule(1).order, RunChaosSchedule(2).order);
}

// Chaos mode with the worker: one poster thread per QP posts write + signal pairs on small rings
// (completions held back make posters wait for ring space). Every WQE executes exactly once, each
// QP's fetch-adds see their predecessors in order, and the counted traffic is exact.
TEST(RdmaEmulatorChaos, ConcurrentPostersExactlyOnce) {
  constexpr int kQps = 4, kOps = 400, kRec = 64;
  std::vector<std::unique_ptr<Loop>> loops;
  for (int q = 0; q < kQps; q++) loops.push_back(std::make_unique<Loop>(8, 8, 0x400 + q));
  EmuOptions opts;
  opts.chaosSeed = 12345;
  opts.traceEntries = 2 * kQps * kOps;
  QueueEmulator emu(nullptr, opts);
  for (auto& l : loops) l->Attach(emu);
  std::vector<uint8_t> src(size_t(kQps) * kOps * kRec), dst(src.size(), 0);
  for (size_t i = 0; i < src.size(); i++) src[i] = static_cast<uint8_t>(i * 29 + i / 509);
  std::vector<uint64_t> sig(kQps, 0), res(size_t(kQps) * kOps, ~0ull);
  auto srcMr = emu.RegisterMemory(0, src.data(), src.size(), EmuAccess::kEmuAllAccess);
  auto dstMr = emu.RegisterMemory(1, dst.data(), dst.size(), EmuAccess::kEmuAllAccess);
  auto sigMr = emu.RegisterMemory(1, sig.data(), sig.size() * 8, EmuAccess::kEmuAllAccess);
  auto resMr = emu.RegisterMemory(0, res.data(), res.size() * 8, EmuAccess::kEmuAllAccess);
  emu.Start();
  std::vector<std::thread> posters;
  for (int q = 0; q < kQps; q++) {
    posters.emplace_back([&, q] {
      try {
        const crdma::QpEndpoint& ep = loops[q]->ep;
        for (int i = 0; i < kOps; i++) {
          const size_t k = size_t(q) * kOps + i;
          Check(crdma::PostWriteWithSignal(ep, Local(&src[k * kRec], kRec, srcMr),
                                           Remote(&dst[k * kRec], dstMr), Local(&res[k], 8, resMr),
                                           Remote(&sig[q], sigMr), 1, Ctx()),
                ep);
        }
        Check(crdma::Quiet(ep, Ctx()), ep);
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
      }
    });
  }
  for (auto& t : posters) t.join();
  emu.Stop();
  EXPECT_EQ(dst, src);
  for (int q = 0; q < kQps; q++) {
    EXPECT_EQ(sig[q], uint64_t(kOps));
    EXPECT_EQ(loops[q]->counters->completed, 2u * kOps);
    for (int i = 0; i < kOps; i++) ASSERT_EQ(res[size_t(q) * kOps + i], uint64_t(i)) << "QP " << q;
  }
  const RdmaWireStats s = emu.WireStats();
  ExpectRows(s, {{0,
                  1,
                  RdmaOpcode::kWrite,
                  uint64_t(kQps) * kOps,
                  uint64_t(kQps) * kOps * kRec,
                  0,
                  0,
                  0,
                  0,
                  {{7, uint64_t(kQps) * kOps}}},
                 {0,
                  1,
                  RdmaOpcode::kFetchAdd,
                  uint64_t(kQps) * kOps,
                  uint64_t(kQps) * kOps * 8,
                  0,
                  uint64_t(kQps) * kOps,
                  0,
                  0,
                  {{4, uint64_t(kQps) * kOps}}}});
  ASSERT_EQ(s.trace.size(), size_t(2) * kQps * kOps);
  std::vector<uint32_t> next(kQps, 0);
  for (const auto& e : s.trace) {
    ASSERT_EQ(e.wqeIndex, static_cast<uint16_t>(next[e.qp])) << "QP " << e.qp;
    next[e.qp]++;
  }
  EXPECT_EQ(emu.PendingCqes(), 0u);
}

}  // namespace

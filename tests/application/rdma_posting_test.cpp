// The bulk-posting additions of the RDMA posting protocol (core/transport/rdma_queue.hpp), driven
// by host threads against the software queue emulator: several WQEs in one reservation published
// by one doorbell, the signal word after its data (inline 8-byte WRITE and FETCH_ADD; a concurrent
// reader of signals is rdma_emulator_test's and shmem_rdma_test's business), WQEs that
// request no CQE and the later CQE that covers them, the CQE forced once per signal period (so a
// stream of unsignalled posts never waits for completions nobody requested), the non-blocking
// ticket query, the NOP that WaitCompleted / Quiet post for an unsignalled tail, lanes writing
// their own WQEs into one reservation (what a warp batch does), and an error inside an unsignalled
// batch. Where a test needs to see WQEs before they execute, the emulator is driven by hand
// (ProcessOnce) instead of its worker thread.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "mori/application/rdma/queue_emulator.hpp"
#include "mori/core/errors.hpp"

namespace {

using namespace mori;
namespace crdma = mori::core::rdma;
namespace mlx5 = mori::core::mlx5;
using application::EmuAccess;
using application::EmuMemoryRegion;
using application::QueueEmulator;

constexpr uint64_t kTimeoutNs = 20ull * 1000 * 1000 * 1000;

crdma::PostContext Post(uint64_t timeoutNs = kTimeoutNs) {
  return crdma::PostContext{timeoutNs, nullptr, 0, 1};
}

// Rings, counters and the endpoint of one QP from PE 0 to PE 1 (declare before the emulator that
// watches it, so the emulator stops first).
class TestQp {
 public:
  explicit TestQp(uint32_t blocks) : sq(blocks * 64 / 8 + 8), cq(blocks * 64 / 8 + 8) {
    std::memset(&counters, 0, sizeof(counters));
    application::EmuInitCqRing(Aligned(cq), blocks);
    ep = crdma::MakeEndpoint(Aligned(sq), blocks, 0x77, Aligned(cq), blocks, &counters);
  }
  void AttachTo(QueueEmulator& emu) { emu.AddQp(application::EmuQpFromEndpoint(ep, 0, 1)); }
  // The fm_ce_se byte of the WQE at `block`.
  uint8_t CtrlFlags(uint64_t block) const {
    const auto* ctrl = static_cast<const uint8_t*>(
        mlx5::SqBasicBlock(ep.sq.ring, static_cast<uint32_t>(block), ep.sq.numBlocks));
    return static_cast<uint8_t>(mlx5::detail::Load32(ctrl, 8) >> 24);
  }
  bool RequestsCqe(uint64_t block) const { return (CtrlFlags(block) & mlx5::kCtrlCqUpdate) != 0; }
  uint64_t Completed() const { return __atomic_load_n(&counters.completed, __ATOMIC_ACQUIRE); }
  uint64_t Ready() const { return __atomic_load_n(&counters.ready, __ATOMIC_ACQUIRE); }

  crdma::QpCounters counters;
  crdma::QpEndpoint ep;

 private:
  // 64-byte aligned view of a word vector.
  static void* Aligned(std::vector<uint64_t>& v) {
    const uintptr_t p = reinterpret_cast<uintptr_t>(v.data());
    return reinterpret_cast<void*>((p + 63) & ~uintptr_t{63});
  }
  std::vector<uint64_t> sq, cq;
};

// Source words on PE 0, target words on PE 1, both registered.
struct Words {
  Words(QueueEmulator& emu, size_t n) : src(n), dst(n, 0), result(n, 0) {
    for (size_t i = 0; i < n; i++) src[i] = 0xc0ffee0000000000ull + i * 0x10001ull;
    srcMr = emu.RegisterMemory(0, src.data(), n * 8, EmuAccess::kEmuAllAccess);
    resultMr = emu.RegisterMemory(0, result.data(), n * 8, EmuAccess::kEmuAllAccess);
    dstMr = emu.RegisterMemory(1, dst.data(), n * 8, EmuAccess::kEmuAllAccess);
  }
  // WRITE of src[i..i+n) to dst[j..j+n).
  crdma::WqeDesc Write(size_t i, size_t j, size_t n = 1, bool unsignalled = false) const {
    crdma::WqeDesc d{};
    d.kind = crdma::WqeKind::kWrite;
    d.unsignalled = unsignalled;
    d.local = mlx5::Mlx5LocalBuf{reinterpret_cast<uint64_t>(&src[i]), srcMr.lkey,
                                 static_cast<uint32_t>(n * 8)};
    d.remote = Remote(j);
    return d;
  }
  mlx5::Mlx5RemoteBuf Remote(size_t j) const {
    return mlx5::Mlx5RemoteBuf{reinterpret_cast<uint64_t>(&dst[j]), dstMr.rkey};
  }
  mlx5::Mlx5LocalBuf Result(size_t k) const {
    return mlx5::Mlx5LocalBuf{reinterpret_cast<uint64_t>(&result[k]), resultMr.lkey, 8};
  }
  uint64_t Dst(size_t j) const { return __atomic_load_n(&dst[j], __ATOMIC_ACQUIRE); }

  std::vector<uint64_t> src, dst, result;
  EmuMemoryRegion srcMr{}, resultMr{}, dstMr{};
};

crdma::WqeDesc InlineWrite(const void* data, uint32_t len, const mlx5::Mlx5RemoteBuf& to,
                           bool unsignalled) {
  crdma::WqeDesc d{};
  d.kind = crdma::WqeKind::kWriteInline;
  d.unsignalled = unsignalled;
  d.inlineData = data;
  d.local = mlx5::Mlx5LocalBuf{0, 0, len};
  d.remote = to;
  return d;
}

void Ok(const crdma::QueueResult& r, const crdma::QpEndpoint& ep) {
  application::ThrowIfFailed(r, ep);
}

// Reserve, write and ring for one unsignalled (or signalled) WQE; returns its ticket.
uint64_t PostOne(const TestQp& qp, const crdma::WqeDesc& d) {
  const crdma::QueueResult r = crdma::PostWqes(qp.ep, &d, 1, Post());
  Ok(r, qp.ep);
  return r.value;
}

TEST(RdmaPosting, SignalPeriodAndReservationLimit) {
  struct Case {
    uint32_t blocks, period, maxReserve;
  };
  for (const Case c :
       {Case{1, 1, 1}, Case{2, 1, 2}, Case{4, 1, 4}, Case{16, 4, 13}, Case{256, 64, 193}}) {
    crdma::SqHandle sq{};
    sq.numBlocks = c.blocks;
    EXPECT_EQ(crdma::SignalPeriod(sq), c.period) << c.blocks;
    EXPECT_EQ(crdma::MaxReserveBlocks(sq), c.maxReserve) << c.blocks;
  }
  crdma::SqHandle sq{};
  sq.numBlocks = 16;  // period 4: blocks 3, 7, 11, ... end a period
  EXPECT_FALSE(crdma::HoldsPeriodEnd(sq, 0, 3));
  EXPECT_TRUE(crdma::HoldsPeriodEnd(sq, 0, 4));
  EXPECT_TRUE(crdma::HoldsPeriodEnd(sq, 3, 1));
  EXPECT_FALSE(crdma::HoldsPeriodEnd(sq, 4, 3));
  EXPECT_TRUE(crdma::HoldsPeriodEnd(sq, 6, 2));
  EXPECT_TRUE(crdma::HoldsPeriodEnd(sq, 65535, 1));  // 65535 = 4 * 16383 + 3

  TestQp qp(16);
  const crdma::QueueResult tooBig = crdma::ReserveSlots(qp.ep, 14, Post());
  EXPECT_EQ(tooBig.status, crdma::QueueStatus::kInvalid);
  EXPECT_EQ(tooBig.expected, 13u);
  EXPECT_EQ(qp.counters.reserved, 0u) << "a refused reservation reserves nothing";
  const crdma::QueueResult fits = crdma::ReserveSlots(qp.ep, 13, Post());
  EXPECT_EQ(fits.status, crdma::QueueStatus::kOk);
  EXPECT_EQ(qp.counters.reserved, 13u);
}

// Three WQEs of different sizes in one reservation: nothing is visible to the NIC until the one
// doorbell, which publishes all three; only the last requests a CQE.
TEST(RdmaPosting, SeveralWqesOneReservationOneDoorbell) {
  TestQp qp(64);
  QueueEmulator emu;
  qp.AttachTo(emu);
  Words w(emu, 64);
  uint8_t small[24], large[80];  // inline: 24 bytes fit one block, 80 bytes take two
  for (int i = 0; i < 24; i++) small[i] = static_cast<uint8_t>(0x11 + i);
  for (int i = 0; i < 80; i++) large[i] = static_cast<uint8_t>(0x80 + i);
  const crdma::WqeDesc d[3] = {InlineWrite(small, sizeof(small), w.Remote(0), true),
                               w.Write(0, 16, 4, true),
                               InlineWrite(large, sizeof(large), w.Remote(32), false)};
  const uint32_t blocks = crdma::WqeBlocks(d[0]) + crdma::WqeBlocks(d[1]) + crdma::WqeBlocks(d[2]);
  ASSERT_EQ(blocks, 4u);  // 1 + 1 + 2

  crdma::QueueResult r = crdma::ReserveSlots(qp.ep, blocks, Post());
  Ok(r, qp.ep);
  const uint64_t start = r.value;
  uint64_t at = start;
  for (const crdma::WqeDesc& x : d) at += crdma::WriteWqe(qp.ep.sq, at, x);
  EXPECT_EQ(emu.ProcessOnce(), 0u) << "WQEs written but not yet rung must not execute";
  EXPECT_EQ(qp.counters.sqDbrec[1], 0u);
  r = crdma::RingDoorbell(qp.ep, start, blocks, start + 2, Post());
  Ok(r, qp.ep);
  EXPECT_EQ(r.value, start + blocks) << "RingDoorbell returns the ticket";
  EXPECT_EQ(mlx5::BeToHost32(qp.counters.sqDbrec[1]), static_cast<uint32_t>(start + blocks));
  const auto* lastCtrl =
      static_cast<const uint8_t*>(mlx5::SqBasicBlock(qp.ep.sq.ring, start + 2, qp.ep.sq.numBlocks));
  EXPECT_EQ(qp.counters.doorbellMailbox, mlx5::detail::LoadWord<uint64_t>(lastCtrl, 0))
      << "the doorbell carries the last WQE's ctrl segment";
  EXPECT_FALSE(qp.RequestsCqe(start));
  EXPECT_FALSE(qp.RequestsCqe(start + 1));
  EXPECT_TRUE(qp.RequestsCqe(start + 2));
  EXPECT_EQ(qp.counters.signalled, start + blocks);

  EXPECT_EQ(emu.ProcessOnce(), 3u) << "one doorbell published all three WQEs";
  EXPECT_EQ(emu.Stats().cqesWritten, 1u);
  EXPECT_TRUE(crdma::IsCompleted(qp.ep, r.value));
  EXPECT_EQ(qp.Completed(), start + blocks);
  EXPECT_EQ(std::memcmp(w.dst.data(), small, sizeof(small)), 0);
  for (int i = 0; i < 4; i++) EXPECT_EQ(w.dst[16 + i], w.src[i]);
  EXPECT_EQ(std::memcmp(&w.dst[32], large, sizeof(large)), 0);

  // PostWqes does the same in one call: five WQEs, one doorbell, one CQE.
  crdma::WqeDesc five[5];
  for (int i = 0; i < 5; i++) five[i] = w.Write(10 + i, 48 + i, 1, i < 4);
  r = crdma::PostWqes(qp.ep, five, 5, Post());
  Ok(r, qp.ep);
  EXPECT_EQ(r.value, start + blocks + 5);
  EXPECT_EQ(emu.ProcessOnce(), 5u);
  EXPECT_EQ(emu.Stats().cqesWritten, 2u);
  EXPECT_TRUE(crdma::IsCompleted(qp.ep, r.value));
  for (int i = 0; i < 5; i++) EXPECT_EQ(w.dst[48 + i], w.src[10 + i]);
}

// Data plus signal in one reservation: kSet writes exactly the 8-byte word (its neighbours keep
// their values), kAdd adds and returns the old value; the unsignalled data is covered by the
// signal's CQE.
TEST(RdmaPosting, SignalWordSetAndAdd) {
  TestQp qp(64);
  QueueEmulator emu;
  qp.AttachTo(emu);
  Words w(emu, 64);
  w.dst[40] = 0x1111111111111111ull;
  w.dst[42] = 0x2222222222222222ull;
  const uint64_t packed = (uint64_t{7} << 32) | 0xabcdu;  // epoch 7, value 0xabcd
  crdma::QueueResult r = crdma::PostWriteWithSignal(
      qp.ep, w.Write(0, 0, 8, true),
      crdma::SignalWqe(crdma::SignalUpdate::kSet, w.Remote(41), packed, w.Result(0)), Post());
  Ok(r, qp.ep);
  const uint64_t first = r.value;
  EXPECT_FALSE(qp.RequestsCqe(first - 2));
  EXPECT_TRUE(qp.RequestsCqe(first - 1));
  EXPECT_EQ(emu.ProcessOnce(), 2u);
  EXPECT_EQ(w.dst[41], packed);
  EXPECT_EQ(w.dst[40], 0x1111111111111111ull);
  EXPECT_EQ(w.dst[42], 0x2222222222222222ull);
  for (int i = 0; i < 8; i++) EXPECT_EQ(w.dst[i], w.src[i]);
  EXPECT_EQ(emu.Stats().cqesWritten, 1u);
  EXPECT_TRUE(crdma::IsCompleted(qp.ep, first));

  w.dst[43] = 100;
  r = crdma::PostWriteWithSignal(
      qp.ep, w.Write(8, 8, 4, true),
      crdma::SignalWqe(crdma::SignalUpdate::kAdd, w.Remote(43), 5, w.Result(1)), Post());
  Ok(r, qp.ep);
  EXPECT_EQ(emu.ProcessOnce(), 2u);
  EXPECT_EQ(w.dst[43], 105u);
  EXPECT_EQ(w.result[1], 100u) << "FETCH_ADD returns the old value";
  for (int i = 8; i < 12; i++) EXPECT_EQ(w.dst[i], w.src[i]);
  EXPECT_EQ(emu.Stats().cqesWritten, 2u);
  EXPECT_TRUE(crdma::IsCompleted(qp.ep, r.value));
}

// Unsignalled WQEs execute but complete only with a later CQE: `completed` does not move for them
// and the ticket query stays false; one signalled WQE after them completes them all.
TEST(RdmaPosting, UnsignalledWqesCompleteWithTheNextCqe) {
  TestQp qp(64);  // signal period 16: the first five WQEs hold no period end
  QueueEmulator emu;
  qp.AttachTo(emu);
  Words w(emu, 16);
  std::vector<uint64_t> tickets;
  for (int i = 0; i < 5; i++) tickets.push_back(PostOne(qp, w.Write(i, i, 1, true)));
  for (int i = 0; i < 5; i++) EXPECT_FALSE(qp.RequestsCqe(i));
  EXPECT_EQ(qp.counters.signalled, 0u);
  EXPECT_EQ(emu.ProcessOnce(), 5u);
  for (int i = 0; i < 5; i++) EXPECT_EQ(w.dst[i], w.src[i]) << "executed without a CQE";
  EXPECT_EQ(emu.Stats().cqesWritten, 0u);
  EXPECT_EQ(crdma::PollCq(qp.ep.sq, qp.ep.cq), 0u);
  EXPECT_EQ(qp.Completed(), 0u);
  for (uint64_t t : tickets) EXPECT_FALSE(crdma::IsCompleted(qp.ep, t));

  const uint64_t last = PostOne(qp, w.Write(5, 5));
  EXPECT_EQ(qp.counters.signalled, last);
  EXPECT_EQ(emu.ProcessOnce(), 1u);
  EXPECT_EQ(emu.Stats().cqesWritten, 1u);
  EXPECT_TRUE(crdma::IsCompleted(qp.ep, last));
  EXPECT_EQ(qp.Completed(), last) << "one CQE covers every earlier WQE";
  for (uint64_t t : tickets) EXPECT_TRUE(crdma::IsCompleted(qp.ep, t));
}

// A WQE that holds the last block of a signal period requests a CQE even when asked not to, so
// tickets up to it complete without any further post.
TEST(RdmaPosting, PeriodEndForcesACqe) {
  TestQp qp(16);  // period 4
  QueueEmulator emu;
  qp.AttachTo(emu);
  Words w(emu, 32);
  std::vector<uint64_t> tickets;
  for (int i = 0; i < 4; i++) tickets.push_back(PostOne(qp, w.Write(i, i, 1, true)));
  EXPECT_FALSE(qp.RequestsCqe(0));
  EXPECT_FALSE(qp.RequestsCqe(1));
  EXPECT_FALSE(qp.RequestsCqe(2));
  EXPECT_TRUE(qp.RequestsCqe(3));
  EXPECT_EQ(qp.counters.signalled, 4u);
  // A 2-block inline WQE at block 4 holds no period end; one at block 7 (7, 8) does.
  uint8_t bytes[80] = {};
  tickets.push_back(PostOne(qp, InlineWrite(bytes, sizeof(bytes), w.Remote(8), true)));   // 4..5
  tickets.push_back(PostOne(qp, w.Write(4, 4, 1, true)));                                 // 6
  tickets.push_back(PostOne(qp, InlineWrite(bytes, sizeof(bytes), w.Remote(10), true)));  // 7..8
  EXPECT_FALSE(qp.RequestsCqe(4));
  EXPECT_FALSE(qp.RequestsCqe(6));
  EXPECT_TRUE(qp.RequestsCqe(7));
  EXPECT_EQ(emu.ProcessOnce(), 7u);
  EXPECT_EQ(emu.Stats().errors, 0u);
  EXPECT_EQ(emu.Stats().cqesWritten, 2u);
  for (uint64_t t : tickets) EXPECT_TRUE(crdma::IsCompleted(qp.ep, t)) << t;
  EXPECT_EQ(qp.Completed(), 9u);
}

// A long stream of unsignalled posts (1- to 4-block WQEs) from several threads on a 16-block ring
// never waits for completions nobody requested: every reservation is bounded by a short timeout.
TEST(RdmaPosting, UnsignalledStreamNeverStalls) {
  constexpr int kThreads = 3, kOps = 2000;
  TestQp qp(16);
  QueueEmulator emu;
  qp.AttachTo(emu);
  Words w(emu, kThreads * 32 + 32);  // the longest inline WRITE (197 bytes) stays inside
  emu.Start();
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; t++) {
    threads.emplace_back([&, t] {
      try {
        uint8_t payload[200];
        for (int i = 0; i < kOps; i++) {
          const size_t slot = static_cast<size_t>(t) * 32 + (i % 4) * 8;
          crdma::WqeDesc d;
          if (i % 3 == 0) {
            d = w.Write(slot, slot, 8, true);
          } else {
            const uint32_t len = 8 + (i * 13) % 190;  // 1 to 4 blocks
            std::memset(payload, i & 0xff, len);
            d = InlineWrite(payload, len, w.Remote(slot), true);
          }
          const crdma::QueueResult r =
              crdma::PostWqes(qp.ep, &d, 1, Post(5ull * 1000 * 1000 * 1000));
          Ok(r, qp.ep);
        }
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
        failures++;
      }
    });
  }
  for (auto& th : threads) th.join();
  ASSERT_EQ(failures.load(), 0);
  Ok(crdma::Quiet(qp.ep, Post()), qp.ep);
  EXPECT_EQ(qp.Completed(), qp.Ready());
  const application::EmuStats st = emu.Stats();
  EXPECT_EQ(st.errors, 0u);
  // Only WQEs holding a period end (at most one per period) and quiet's NOP requested a CQE.
  EXPECT_LE(st.cqesWritten, qp.Ready() / crdma::SignalPeriod(qp.ep.sq) + 1);
  EXPECT_LT(st.cqesWritten, st.wqesExecuted);
}

// Quiet and WaitCompleted post a CQE-requesting NOP only when the newest published WQE requested
// none; with a signalled tail they post nothing.
TEST(RdmaPosting, QuietPostsNopOnlyForAnUnsignalledTail) {
  TestQp qp(64);
  QueueEmulator emu;
  qp.AttachTo(emu);
  Words w(emu, 16);
  emu.Start();
  const uint64_t t1 = PostOne(qp, w.Write(0, 0));
  Ok(crdma::Quiet(qp.ep, Post()), qp.ep);
  EXPECT_EQ(qp.Ready(), t1) << "signalled tail: no NOP";
  EXPECT_EQ(qp.Completed(), t1);

  const uint64_t t2 = PostOne(qp, w.Write(1, 1, 1, true));
  const crdma::QueueResult q = crdma::Quiet(qp.ep, Post());
  Ok(q, qp.ep);
  EXPECT_EQ(qp.Ready(), t2 + 1) << "unsignalled tail: one NOP";
  EXPECT_EQ(q.value, t2 + 1);
  EXPECT_TRUE(qp.RequestsCqe(t2));
  EXPECT_EQ(qp.Completed(), t2 + 1);
  EXPECT_EQ(w.Dst(1), w.src[1]);

  const uint64_t t3 = PostOne(qp, w.Write(2, 2, 1, true));
  Ok(crdma::WaitCompleted(qp.ep, t3, Post()), qp.ep);
  EXPECT_TRUE(crdma::IsCompleted(qp.ep, t3));
  EXPECT_EQ(qp.Ready(), t3 + 1);
  // Completed tickets need nothing more.
  Ok(crdma::WaitCompleted(qp.ep, t1, Post()), qp.ep);
  Ok(crdma::Quiet(qp.ep, Post()), qp.ep);
  EXPECT_EQ(qp.Ready(), t3 + 1);
  EXPECT_EQ(w.Dst(2), w.src[2]);
}

// The ticket query never waits: without a NIC making progress it answers false at once, and the
// bounded wait times out naming what it waited for.
TEST(RdmaPosting, CompletedQueryDoesNotBlock) {
  TestQp qp(64);
  QueueEmulator emu;
  qp.AttachTo(emu);
  Words w(emu, 16);
  const uint64_t t = PostOne(qp, w.Write(0, 0));
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 1000; i++) ASSERT_FALSE(crdma::IsCompleted(qp.ep, t));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  const crdma::QueueResult r = crdma::WaitCompleted(qp.ep, t, Post(20ull * 1000 * 1000));
  EXPECT_EQ(r.status, crdma::QueueStatus::kTimeout);
  ASSERT_NE(r.waitedFor, nullptr);
  EXPECT_NE(std::string(r.waitedFor).find("SQ completions"), std::string::npos) << r.waitedFor;
  EXPECT_EQ(emu.ProcessOnce(), 1u);
  EXPECT_TRUE(crdma::IsCompleted(qp.ep, t));
}

// What a warp batch does, with threads as lanes: the leader reserves every lane's blocks plus a
// trailing FETCH_ADD signal, each lane writes its own WQE at its offset (no lane waits for
// another), the leader writes the signal and rings once. One doorbell, one CQE, all data.
TEST(RdmaPosting, LanesWriteTheirOwnWqesIntoOneReservation) {
  constexpr int kLanes = 8;
  TestQp qp(64);
  QueueEmulator emu;
  qp.AttachTo(emu);
  Words w(emu, 128);
  // Lane l: l even: 8-byte gather WRITE (1 block); l odd: inline WRITE of 70 bytes (2 blocks).
  uint32_t offset[kLanes], total = 0;
  uint8_t inlineBytes[kLanes][70];
  for (int l = 0; l < kLanes; l++) {
    offset[l] = total;
    total += (l % 2 == 0) ? 1 : 2;
    std::memset(inlineBytes[l], 0x30 + l, sizeof(inlineBytes[l]));
  }
  crdma::QueueResult r = crdma::ReserveSlots(qp.ep, total + 1, Post());
  Ok(r, qp.ep);
  const uint64_t start = r.value;
  std::vector<std::thread> lanes;
  for (int l = 0; l < kLanes; l++) {
    lanes.emplace_back([&, l] {
      const crdma::WqeDesc d = (l % 2 == 0) ? w.Write(l, l, 1, true)
                                            : InlineWrite(inlineBytes[l], sizeof(inlineBytes[l]),
                                                          w.Remote(16 + 10 * l), true);
      crdma::WriteWqe(qp.ep.sq, start + offset[l], d);
    });
  }
  for (auto& th : lanes) th.join();
  w.dst[127] = 40;
  const uint64_t add = 2;
  crdma::WriteWqe(qp.ep.sq, start + total,
                  crdma::SignalWqe(crdma::SignalUpdate::kAdd, w.Remote(127), add, w.Result(0)));
  r = crdma::RingDoorbell(qp.ep, start, total + 1, start + total, Post());
  Ok(r, qp.ep);
  EXPECT_EQ(emu.ProcessOnce(), static_cast<size_t>(kLanes + 1));
  EXPECT_EQ(emu.Stats().cqesWritten, 1u);
  EXPECT_TRUE(crdma::IsCompleted(qp.ep, r.value));
  EXPECT_EQ(w.dst[127], 42u);
  for (int l = 0; l < kLanes; l++) {
    if (l % 2 == 0) {
      EXPECT_EQ(w.dst[l], w.src[l]) << "lane " << l;
    } else {
      EXPECT_EQ(std::memcmp(&w.dst[16 + 10 * l], inlineBytes[l], sizeof(inlineBytes[l])), 0)
          << "lane " << l;
    }
  }
}

// An error inside an unsignalled batch still completes: the failing WQE gets an error CQE, every
// later one a flush CQE, so `completed` reaches the ticket and Quiet reports the error (attributed
// to the failing WQE) instead of waiting.
TEST(RdmaPosting, ErrorInsideAnUnsignalledBatch) {
  TestQp qp(64);
  QueueEmulator emu;
  qp.AttachTo(emu);
  Words w(emu, 16);
  crdma::WqeDesc d[4] = {w.Write(0, 0, 1, true), w.Write(1, 1, 1, true), w.Write(2, 2, 1, true),
                         w.Write(3, 3, 1, false)};
  d[1].remote.rkey ^= 0x100;  // unknown key
  const crdma::QueueResult r = crdma::PostWqes(qp.ep, d, 4, Post());
  Ok(r, qp.ep);
  emu.ProcessOnce();
  const crdma::QueueResult q = crdma::Quiet(qp.ep, Post());
  ASSERT_EQ(q.status, crdma::QueueStatus::kQpError);
  EXPECT_EQ(qp.Completed(), r.value);
  EXPECT_EQ(qp.counters.error.wqeCounter, static_cast<uint16_t>(r.value - 3));
  EXPECT_EQ(qp.counters.error.syndrome, mlx5::kSyndromeRemoteAccessErr);
  EXPECT_EQ(w.dst[0], w.src[0]);
  EXPECT_EQ(w.dst[1], 0u);
  EXPECT_EQ(w.dst[2], 0u) << "flushed, not executed";
  EXPECT_TRUE(crdma::IsCompleted(qp.ep, r.value));
  EXPECT_EQ(crdma::ReserveSlots(qp.ep, 1, Post()).status, crdma::QueueStatus::kQpError);
}

}  // namespace

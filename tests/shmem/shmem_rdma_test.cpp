// The shmem device API through the RDMA transport, with the software queue emulator as the NIC
// (MORI_RDMA_EMULATE=1): kernels post real mlx5 WQEs, each PE's emulator thread executes them
// against the peers' heaps. --gpu-per-node G (MORI_GPU_PER_NODE, default 1) makes G consecutive
// PEs one node: with G = 1 every other PE is an RDMA peer; with G = 2 and 4 PEs (CTest's
// shmem_rdma_mixed_test, ranks may share a GPU) each PE has a P2P and two RDMA peers, so every
// case below runs over a mixed transport table. All ordered pairs, self included:
//  * topology: host ShmemNodeOf / ShmemLocalRank / ShmemLocalSize / ShmemNumNodes and the device
//    queries agree with each other and with the layout; same-node peers P2P, other nodes kRdma;
//  * put and get, Thread/Warp/Block scopes, Nbi + quiet and blocking, sizes 1 B .. 1 MiB + 5
//    (inline and gather paths), random data, poisoned destinations with guard bytes;
//  * put-with-signal (add and set) for 8 rounds: the receiver waits for the signal in a kernel and
//    checks the data there (the signal never overtakes its data);
//  * explicit-QP channels: a put without CQE from one warp, then the channel's signal (a packed
//    epoch|value word) from another warp on the same QP; only that QP's counters move;
//  * put-with-signal on explicit QPs (3 scopes, kAdd/kSet, inline/gather): one reservation for data
//    and signal, only the signal requests a CQE, every thread gets the ticket;
//  * warp-batched puts (per-lane ranges of 0..8 KiB, trailing kAdd/kSet/no signal): one
//    reservation for the whole warp, the last request asks for the CQE, windows exact;
//  * selective signalling and tickets: unsignalled puts do not complete by themselves, the bounded
//    ticket wait posts the NOP that completes them, a staging buffer reused once its put's ticket
//    completed arrives intact in both versions;
//  * Nbi puts left outstanding at a kernel's end, completed by the host ShmemBarrierAll;
//  * quiet: a 1 MiB Nbi put, ShmemQuietThread(ctx, pe) (per-PE quiet), then an atomic flag; the
//    receiver checks the data once the flag arrives;
//  * atomics under contention (64-bit fetch-add from 4x64 threads of every PE: exact totals and
//  every
//    fetched value seen exactly once), compare-swap election (one winner), swap, fetch, set;
//  * typed immediates (put/get of 1..8-byte types);
//  * 100 device barriers, each ordering an RDMA put before it;
//  * a gpuMalloc buffer: puts from it refused until ShmemRegisterBuffer, then puts from it to every
//    PE and a get into it are exact, and after ShmemDeregisterBuffer puts are refused again;
//  * errors: a 32-bit atomic over RDMA is refused with an attributed usage error; a work request
//    with a bad rkey completes in error and is raised as RemoteError naming the peer, QP and
//    syndrome 0x13 (remote access), and later posts on that QP, and the host barrier's quiet,
//    report it again instead of hanging.
#include <algorithm>
#include <cinttypes>
#include <set>
#include <vector>

#include "gpu_test_harness.hpp"
#include "mori/core/env.hpp"
#include "mori/shmem/shmem_device_api.hpp"

using namespace mori;
using namespace mori::shmem;
using namespace mori::test;

namespace {

// PEs per node (--gpu-per-node): PEs p and q share a node when p / gGpuPerNode == q / gGpuPerNode.
int gGpuPerNode = 1;

// The next PE after `rank` (cyclically) on another node: reached by RDMA.
int NextRdmaPeer(int rank, int n) {
  for (int k = 1; k < n; k++) {
    const int p = (rank + k) % n;
    if (p / gGpuPerNode != rank / gGpuPerNode) return p;
  }
  return -1;
}

constexpr size_t kSlot = (1u << 20) + 256;  // largest message + guard room
constexpr uint8_t kPoison = 0xEE;
const size_t kSizes[] = {1, 7, 64, 65, 4099, (1u << 20) + 5};
enum class Scope { kThread, kWarp, kBlock };
const char* ScopeName(Scope s) {
  return s == Scope::kThread ? "thread" : s == Scope::kWarp ? "warp" : "block";
}

MORI_HD inline uint64_t SeedOf(int pe, int round) { return 0x5eed0000ull + pe * 131 + round; }

// ---- put / get ------------------------------------------------------------------------------
// Every PE puts its `src` to slot `me` of `recv` on every PE (or gets every PE's src into slot p
// of `recv`). The calling threads: thread 0 / warp 0 / the whole block.
template <bool kGet, bool kBlocking>
__global__ void PutGetKernel(ShmemDeviceContext ctx, Scope scope, uint8_t* src, uint8_t* recv,
                             size_t bytes, DeviceFailLog* log) {
  const int me = ctx.rank, n = ctx.worldSize;
  const int tid = static_cast<int>(threadIdx.x);
  const bool inWarp0 = tid < core::kWarpSize;
  for (int k = 0; k < n; k++) {
    const int pe = (me + k) % n;
    bool ok = true;
    uint8_t* slot = recv + (kGet ? pe : me) * kSlot;
    if (scope == Scope::kThread) {
      if (tid != 0) continue;
      if (kGet)
        ok = kBlocking ? ShmemGetMemThread(ctx, slot, src, bytes, pe)
                       : ShmemGetMemNbiThread(ctx, slot, src, bytes, pe);
      else
        ok = kBlocking ? ShmemPutMemThread(ctx, slot, src, bytes, pe)
                       : ShmemPutMemNbiThread(ctx, slot, src, bytes, pe);
    } else if (scope == Scope::kWarp) {
      if (!inWarp0) continue;
      if (kGet)
        ok = kBlocking ? ShmemGetMemWarp(ctx, slot, src, bytes, pe)
                       : ShmemGetMemNbiWarp(ctx, slot, src, bytes, pe);
      else
        ok = kBlocking ? ShmemPutMemWarp(ctx, slot, src, bytes, pe)
                       : ShmemPutMemNbiWarp(ctx, slot, src, bytes, pe);
    } else {
      if (kGet)
        ok = kBlocking ? ShmemGetMemBlock(ctx, slot, src, bytes, pe)
                       : ShmemGetMemNbiBlock(ctx, slot, src, bytes, pe);
      else
        ok = kBlocking ? ShmemPutMemBlock(ctx, slot, src, bytes, pe)
                       : ShmemPutMemNbiBlock(ctx, slot, src, bytes, pe);
    }
    DEV_CHECK(log, me, ok, "%s to pe %d (%llu bytes) returned false", kGet ? "get" : "put", pe,
              (unsigned long long)bytes);
  }
  if (!kBlocking) {
    if (scope == Scope::kThread && tid == 0) ShmemQuietThread(ctx);
    if (scope == Scope::kWarp && inWarp0) ShmemQuietWarp(ctx);
    if (scope == Scope::kBlock) ShmemQuietBlock(ctx);
  }
}

void TestPutGet(RankEnv& env, uint8_t* src, uint8_t* recv, gpuStream_t stream) {
  const int n = env.npes;
  std::vector<uint8_t> host(kSlot * n);
  FailLogBuffer log;
  int bad = 0, cases = 0;
  for (int get = 0; get < 2; get++) {
    for (int blocking = 0; blocking < 2; blocking++) {
      for (Scope scope : {Scope::kThread, Scope::kWarp, Scope::kBlock}) {
        for (size_t bytes : kSizes) {
          const int round = cases++;
          FillPattern(host.data(), kSlot, SeedOf(env.rank, round));
          TEST_CHECK_GPU(gpuMemcpy(src, host.data(), kSlot, gpuMemcpyHostToDevice));
          TEST_CHECK_GPU(gpuMemset(recv, kPoison, kSlot * n));
          ShmemBarrierAll();  // everyone's source and poison are in place
          auto launch = [&](auto kernel) {
            kernel<<<1, 128, 0, stream>>>(ShmemGetDeviceContext(), scope, src, recv, bytes,
                                          log.Get());
          };
          if (get && blocking) launch(PutGetKernel<true, true>);
          if (get && !blocking) launch(PutGetKernel<true, false>);
          if (!get && blocking) launch(PutGetKernel<false, true>);
          if (!get && !blocking) launch(PutGetKernel<false, false>);
          TEST_CHECK_GPU(gpuGetLastError());
          ShmemStreamSynchronize(stream);
          ShmemBarrierAll();  // every PE's puts into our recv completed (quiet) before this
          TEST_CHECK_GPU(gpuMemcpy(host.data(), recv, kSlot * n, gpuMemcpyDeviceToHost));
          for (int s = 0; s < n; s++) {
            const uint8_t* slot = host.data() + s * kSlot;
            const size_t bad1 = FirstPatternMismatch(slot, bytes, SeedOf(s, round));
            const size_t bad2 = FirstNotEqual(slot + bytes, kSlot - bytes, kPoison);
            if (bad1 != bytes || bad2 != kSlot - bytes) {
              if (bad++ < 8)
                env.Check(false,
                          "%s %s %s %zu B, slot of pe %d: data mismatch at %zu, guard at %zu",
                          get ? "get" : "put", blocking ? "blocking" : "nbi+quiet",
                          ScopeName(scope), bytes, s, bad1, bad2);
            }
          }
        }
      }
    }
  }
  env.Check(bad == 0 && log.Count() == 0,
            "put/get over RDMA: %d cases x %d PEs, %d slot mismatches, %u device failures", cases,
            n, bad, log.Count());
}

// ---- put with signal ------------------------------------------------------------------------
__global__ void PutSignalKernel(ShmemDeviceContext ctx, uint8_t* src, uint8_t* recv, size_t bytes,
                                uint64_t* sigs, int round, DeviceFailLog* log) {
  const int me = ctx.rank, n = ctx.worldSize;
  const SignalOp op = (round & 1) ? SignalOp::kSet : SignalOp::kAdd;
  for (int k = 1; k <= n; k++) {
    const int pe = (me + k) % n;
    // The signal words are zeroed before every round: kAdd adds 1, kSet stores round + 1.
    const bool ok = ShmemPutMemSignalNbiBlock(ctx, recv + me * kSlot, src, bytes, &sigs[me],
                                              op == SignalOp::kAdd ? 1 : round + 1, op, pe);
    if (threadIdx.x == 0) DEV_CHECK(log, me, ok, "put-signal to pe %d returned false", pe);
  }
  ShmemQuietBlock(ctx);
}

__global__ void WaitAndCheckKernel(ShmemDeviceContext ctx, uint8_t* recv, size_t bytes,
                                   uint64_t* sigs, int round, DeviceFailLog* log) {
  const int me = ctx.rank, n = ctx.worldSize;
  const uint64_t expected = (round & 1) ? static_cast<uint64_t>(round + 1) : 1;
  __shared__ int ok;
  for (int s = 0; s < n; s++) {
    if (threadIdx.x == 0)
      ok = ShmemSignalWaitUntil(ctx, &sigs[s], core::CmpOp::kEq, expected, s, "put-signal round");
    __syncthreads();
    if (!ok) return;
    int mism = 0;
    const uint64_t seed = SeedOf(s, 1000 + round);
    for (size_t i = threadIdx.x; i < bytes; i += blockDim.x)
      mism += recv[s * kSlot + i] != PatternByte(seed, i);
    mism = __syncthreads_count(mism != 0);
    if (threadIdx.x == 0)
      DEV_CHECK(log, me, mism == 0,
                "round %d: data from pe %d not in place when its signal was seen", round, s);
    __syncthreads();
  }
}

void TestPutSignal(RankEnv& env, uint8_t* src, uint8_t* recv, uint64_t* sigs, gpuStream_t stream) {
  const int n = env.npes;
  const size_t bytes = 256 * 1024 + 48;
  std::vector<uint8_t> host(bytes);
  FailLogBuffer log;
  for (int round = 0; round < 8; round++) {
    FillPattern(host.data(), bytes, SeedOf(env.rank, 1000 + round));
    TEST_CHECK_GPU(gpuMemcpy(src, host.data(), bytes, gpuMemcpyHostToDevice));
    TEST_CHECK_GPU(gpuMemset(sigs, 0, n * sizeof(uint64_t)));
    ShmemBarrierAll();
    PutSignalKernel<<<1, 128, 0, stream>>>(ShmemGetDeviceContext(), src, recv, bytes, sigs, round,
                                           log.Get());
    WaitAndCheckKernel<<<1, 256, 0, stream>>>(ShmemGetDeviceContext(), recv, bytes, sigs, round,
                                              log.Get());
    TEST_CHECK_GPU(gpuGetLastError());
    ShmemStreamSynchronize(stream);
    ShmemBarrierAll();
  }
  env.Check(log.Count() == 0, "put-with-signal over RDMA, 8 rounds (add/set): %u device failures",
            log.Count());
}

// ---- quiet then flag --------------------------------------------------------------------------
__global__ void QuietFlagKernel(ShmemDeviceContext ctx, uint8_t* src, uint8_t* recv, size_t bytes,
                                uint64_t* flag, DeviceFailLog* log) {
  const int me = ctx.rank, next = (me + 1) % ctx.worldSize;
  if (threadIdx.x != 0) return;
  bool ok = ShmemPutMemNbiThread(ctx, recv, src, bytes, next);
  ShmemQuietThread(ctx, next);  // quiet towards that PE only
  ok = ShmemAtomicAdd<uint64_t>(ctx, flag, 1, next) && ok;
  DEV_CHECK(log, me, ok, "nbi put / flag to pe %d failed", next);
}
__global__ void FlagCheckKernel(ShmemDeviceContext ctx, uint8_t* recv, size_t bytes, uint64_t* flag,
                                uint64_t seed, DeviceFailLog* log) {
  __shared__ int ok;
  if (threadIdx.x == 0)
    ok = ShmemWaitUntil<uint64_t>(ctx, flag, core::CmpOp::kGe, 1, -1, "quiet flag");
  __syncthreads();
  if (!ok) return;
  int mism = 0;
  for (size_t i = threadIdx.x; i < bytes; i += blockDim.x) mism += recv[i] != PatternByte(seed, i);
  mism = __syncthreads_count(mism != 0);
  if (threadIdx.x == 0)
    DEV_CHECK(log, ctx.rank, mism == 0, "data not complete when the flag arrived");
}

void TestQuiet(RankEnv& env, uint8_t* src, uint8_t* recv, uint64_t* flag, gpuStream_t stream) {
  const size_t bytes = 1u << 20;
  std::vector<uint8_t> host(bytes);
  FillPattern(host.data(), bytes, SeedOf(env.rank, 2000));
  TEST_CHECK_GPU(gpuMemcpy(src, host.data(), bytes, gpuMemcpyHostToDevice));
  TEST_CHECK_GPU(gpuMemset(recv, kPoison, bytes));
  TEST_CHECK_GPU(gpuMemset(flag, 0, sizeof(uint64_t)));
  ShmemBarrierAll();
  FailLogBuffer log;
  const int prev = (env.rank + env.npes - 1) % env.npes;
  QuietFlagKernel<<<1, 32, 0, stream>>>(ShmemGetDeviceContext(), src, recv, bytes, flag, log.Get());
  FlagCheckKernel<<<1, 256, 0, stream>>>(ShmemGetDeviceContext(), recv, bytes, flag,
                                         SeedOf(prev, 2000), log.Get());
  TEST_CHECK_GPU(gpuGetLastError());
  ShmemStreamSynchronize(stream);
  ShmemBarrierAll();
  env.Check(log.Count() == 0, "1 MiB nbi put + quiet + flag from pe %d: %u device failures", prev,
            log.Count());
}

// ---- host barrier completes RDMA puts a kernel left outstanding --------------------------------
__global__ void NbiNoQuietKernel(ShmemDeviceContext ctx, uint8_t* src, uint8_t* recv, size_t bytes,
                                 int* ok) {
  const int me = ctx.rank, n = ctx.worldSize;
  bool all = true;
  for (int k = 1; k < n; k++)
    all = ShmemPutMemNbiBlock(ctx, recv + me * kSlot, src, bytes, (me + k) % n) && all;
  if (threadIdx.x == 0) *ok = all ? 1 : 0;  // no quiet: the kernel ends with requests in flight
}

// Work requests published but not yet seen completed, over every QP of this PE. Only a device-side
// quiet polls the CQs, so this stays > 0 after a kernel's end until something quiets.
__global__ void OutstandingKernel(ShmemDeviceContext ctx, unsigned long long* out) {
  unsigned long long n = 0;
  for (int pe = 0; pe < ctx.worldSize; pe++) {
    if (ctx.transport[pe] != TransportType::kRdma) continue;
    const ShmemRdmaPeer& p = ctx.rdmaPeers[pe];
    for (uint32_t q = 0; q < p.numQps; q++)
      n += core::AtomicLoadAcquireSystem(p.qps[q].sq.ready) -
           core::AtomicLoadAcquireSystem(p.qps[q].cq.completed);
  }
  *out = n;
}

void TestHostBarrierCompletes(RankEnv& env, uint8_t* src, uint8_t* recv, gpuStream_t stream) {
  const int n = env.npes;
  const size_t bytes = 512 * 1024 + 16;
  std::vector<uint8_t> host(kSlot * n);
  FillPattern(host.data(), bytes, SeedOf(env.rank, 4000));
  TEST_CHECK_GPU(gpuMemcpy(src, host.data(), bytes, gpuMemcpyHostToDevice));
  TEST_CHECK_GPU(gpuMemset(recv, kPoison, kSlot * n));
  int* ok = nullptr;
  TEST_CHECK_GPU(gpuMalloc(reinterpret_cast<void**>(&ok), sizeof(int)));
  ShmemBarrierAll();
  NbiNoQuietKernel<<<1, 128, 0, stream>>>(ShmemGetDeviceContext(), src, recv, bytes, ok);
  TEST_CHECK_GPU(gpuGetLastError());
  ShmemBarrierAll();  // device sync, RDMA quiet, bootstrap barrier
  unsigned long long* outstanding = nullptr;
  TEST_CHECK_GPU(gpuMalloc(reinterpret_cast<void**>(&outstanding), sizeof(unsigned long long)));
  OutstandingKernel<<<1, 1, 0, stream>>>(ShmemGetDeviceContext(), outstanding);
  ShmemStreamSynchronize(stream);
  unsigned long long left = ~0ull;
  TEST_CHECK_GPU(gpuMemcpy(&left, outstanding, sizeof(left), gpuMemcpyDeviceToHost));
  TEST_CHECK_GPU(gpuFree(outstanding));
  env.Check(left == 0,
            "after ShmemBarrierAll every RDMA request of this PE is completed: %llu left", left);
  int r = 0;
  TEST_CHECK_GPU(gpuMemcpy(&r, ok, sizeof(int), gpuMemcpyDeviceToHost));
  TEST_CHECK_GPU(gpuMemcpy(host.data(), recv, kSlot * n, gpuMemcpyDeviceToHost));
  int bad = 0;
  for (int s = 0; s < n; s++) {
    if (s == env.rank) continue;
    bad += FirstPatternMismatch(host.data() + s * kSlot, bytes, SeedOf(s, 4000)) != bytes;
  }
  env.Check(
      r == 1 && bad == 0,
      "nbi puts without quiet, completed by the host ShmemBarrierAll: returned %d, %d bad slots", r,
      bad);
  TEST_CHECK_GPU(gpuFree(ok));
}

// ---- atomics ----------------------------------------------------------------------------------
constexpr int kAtomicBlocks = 4, kAtomicThreads = 64, kAtomicIters = 4;
struct AtomicWords {
  uint64_t ctr;
  uint64_t wins;
  uint64_t lock;
  uint64_t swap;
  uint64_t set[64];
  uint32_t narrow;
  uint32_t pad;
};

__global__ void FetchAddKernel(ShmemDeviceContext ctx, AtomicWords* w, uint64_t* seen,
                               uint64_t total, DeviceFailLog* log) {
  const int me = ctx.rank, n = ctx.worldSize;
  for (int k = 0; k < n; k++) {
    const int pe = (me + k) % n;
    for (int it = 0; it < kAtomicIters; it++) {
      const uint64_t old = ShmemAtomicFetchAdd<uint64_t>(ctx, &w->ctr, 1, pe);
      DEV_CHECK(log, me, old < total, "fetch-add on pe %d returned %llu >= %llu", pe,
                (unsigned long long)old, (unsigned long long)total);
      if (old < total) ShmemAtomicAdd<uint64_t>(ctx, &seen[old], 1, pe);
    }
  }
  ShmemQuietThread(ctx);
}

__global__ void ElectSwapSetKernel(ShmemDeviceContext ctx, AtomicWords* w, DeviceFailLog* log) {
  const int me = ctx.rank, n = ctx.worldSize, next = (me + 1) % n;
  if (threadIdx.x != 0) return;
  // Election on PE 0's lock word: exactly one PE wins over all.
  const uint64_t prev = ShmemAtomicCompareSwap<uint64_t>(ctx, &w->lock, 0, me + 1, 0);
  if (prev == 0) ShmemAtomicAdd<uint64_t>(ctx, &w->wins, 1, 0);
  DEV_CHECK(log, me, prev <= static_cast<uint64_t>(n), "compare-swap returned %llu",
            (unsigned long long)prev);
  // One swapper per word: PE me swaps into PE next's word, which starts at 0.
  const uint64_t mine = (static_cast<uint64_t>(me) + 1) << 32;
  const uint64_t old = ShmemAtomicSwap<uint64_t>(ctx, &w->swap, mine, next);
  DEV_CHECK(log, me, old == 0, "swap on pe %d returned %llu, expected 0", next,
            (unsigned long long)old);
  // Set our word on every PE, then fetch it back.
  for (int k = 0; k < n; k++) {
    const int pe = (me + k) % n;
    const uint64_t v = 0xabcd000000000000ull | (static_cast<uint64_t>(me) << 16) | pe;
    ShmemAtomicSet<uint64_t>(ctx, &w->set[me], v, pe);
    ShmemQuietThread(ctx);
    const uint64_t got = ShmemAtomicFetch<uint64_t>(ctx, &w->set[me], pe);
    DEV_CHECK(log, me, got == v, "fetch after set on pe %d: 0x%llx, expected 0x%llx", pe,
              (unsigned long long)got, (unsigned long long)v);
  }
  ShmemQuietThread(ctx);
}

void TestAtomics(RankEnv& env, AtomicWords* w, uint64_t* seen, gpuStream_t stream) {
  const int n = env.npes;
  const uint64_t total = static_cast<uint64_t>(n) * kAtomicBlocks * kAtomicThreads * kAtomicIters;
  TEST_CHECK_GPU(gpuMemset(w, 0, sizeof(AtomicWords)));
  TEST_CHECK_GPU(gpuMemset(seen, 0, total * sizeof(uint64_t)));
  ShmemBarrierAll();
  FailLogBuffer log;
  FetchAddKernel<<<kAtomicBlocks, kAtomicThreads, 0, stream>>>(ShmemGetDeviceContext(), w, seen,
                                                               total, log.Get());
  ElectSwapSetKernel<<<1, 32, 0, stream>>>(ShmemGetDeviceContext(), w, log.Get());
  TEST_CHECK_GPU(gpuGetLastError());
  ShmemStreamSynchronize(stream);
  ShmemBarrierAll();
  AtomicWords h{};
  TEST_CHECK_GPU(gpuMemcpy(&h, w, sizeof(h), gpuMemcpyDeviceToHost));
  std::vector<uint64_t> s(total);
  TEST_CHECK_GPU(gpuMemcpy(s.data(), seen, total * sizeof(uint64_t), gpuMemcpyDeviceToHost));
  size_t notOnce = 0;
  for (uint64_t v : s) notOnce += v != 1;
  env.Check(h.ctr == total && notOnce == 0,
            "fetch-add over RDMA from %d PEs x %d threads x %d: total %" PRIu64
            " (expected %" PRIu64 "), %zu fetched values not seen exactly once",
            n, kAtomicBlocks * kAtomicThreads, kAtomicIters, h.ctr, total, notOnce);
  if (env.rank == 0)
    env.Check(h.wins == 1 && h.lock >= 1 && h.lock <= static_cast<uint64_t>(n),
              "compare-swap election: %" PRIu64 " winners (expected 1), lock = %" PRIu64, h.wins,
              h.lock);
  const int prev = (env.rank + n - 1) % n;
  env.Check(h.swap == (static_cast<uint64_t>(prev) + 1) << 32, "swap from pe %d left 0x%" PRIx64,
            prev, h.swap);
  int setBad = 0;
  for (int p = 0; p < n; p++)
    setBad += h.set[p] != (0xabcd000000000000ull | (static_cast<uint64_t>(p) << 16) | env.rank);
  env.Check(setBad == 0 && log.Count() == 0, "set/fetch: %d wrong words, %u device failures",
            setBad, log.Count());
}

// ---- typed immediates -------------------------------------------------------------------------
struct TypedSlots {
  uint8_t u8[64];
  int16_t i16[64];
  uint32_t u32[64];
  float f32[64];
  double f64[64];
  uint64_t u64[64];
};
__global__ void TypedKernel(ShmemDeviceContext ctx, TypedSlots* t, DeviceFailLog* log) {
  const int me = ctx.rank, n = ctx.worldSize;
  if (threadIdx.x != 0) return;
  for (int k = 0; k < n; k++) {
    const int pe = (me + k) % n;
    bool ok = ShmemPutTypeNbiThread<uint8_t>(ctx, &t->u8[me], uint8_t(0x80 + me), pe);
    ok = ShmemPutTypeNbiThread<int16_t>(ctx, &t->i16[me], int16_t(-1000 - me), pe) && ok;
    ok = ShmemPutTypeNbiThread<uint32_t>(ctx, &t->u32[me], 0xdead0000u + me, pe) && ok;
    ok = ShmemPutTypeNbiThread<float>(ctx, &t->f32[me], 1.5f + me, pe) && ok;
    ok = ShmemPutTypeNbiThread<double>(ctx, &t->f64[me], -2.25 - me, pe) && ok;
    ok = ShmemPutTypeThread<uint64_t>(ctx, &t->u64[me], 0x1234567800000000ull + me, pe) && ok;
    DEV_CHECK(log, me, ok, "typed puts to pe %d failed", pe);
  }
  ShmemQuietThread(ctx);
}
__global__ void TypedGetKernel(ShmemDeviceContext ctx, TypedSlots* t, DeviceFailLog* log) {
  const int me = ctx.rank, n = ctx.worldSize;
  if (threadIdx.x != 0) return;
  for (int pe = 0; pe < n; pe++) {
    // PE pe holds in slot me what we put there.
    const bool ok = ShmemGetType<uint8_t>(ctx, &t->u8[me], pe) == uint8_t(0x80 + me) &&
                    ShmemGetType<int16_t>(ctx, &t->i16[me], pe) == int16_t(-1000 - me) &&
                    ShmemGetType<uint32_t>(ctx, &t->u32[me], pe) == 0xdead0000u + me &&
                    ShmemGetType<float>(ctx, &t->f32[me], pe) == 1.5f + me &&
                    ShmemGetType<double>(ctx, &t->f64[me], pe) == -2.25 - me &&
                    ShmemGetType<uint64_t>(ctx, &t->u64[me], pe) == 0x1234567800000000ull + me;
    DEV_CHECK(log, me, ok, "typed gets from pe %d returned wrong values", pe);
  }
}

void TestTyped(RankEnv& env, TypedSlots* t, gpuStream_t stream) {
  TEST_CHECK_GPU(gpuMemset(t, 0, sizeof(TypedSlots)));
  ShmemBarrierAll();
  FailLogBuffer log;
  TypedKernel<<<1, 32, 0, stream>>>(ShmemGetDeviceContext(), t, log.Get());
  TEST_CHECK_GPU(gpuGetLastError());
  ShmemStreamSynchronize(stream);
  ShmemBarrierAll();
  TypedGetKernel<<<1, 32, 0, stream>>>(ShmemGetDeviceContext(), t, log.Get());
  ShmemStreamSynchronize(stream);
  TypedSlots h{};
  TEST_CHECK_GPU(gpuMemcpy(&h, t, sizeof(h), gpuMemcpyDeviceToHost));
  int bad = 0;
  for (int s = 0; s < env.npes; s++) {
    bad += h.u8[s] != uint8_t(0x80 + s) || h.i16[s] != int16_t(-1000 - s) ||
           h.u32[s] != 0xdead0000u + s || h.f32[s] != 1.5f + s || h.f64[s] != -2.25 - s ||
           h.u64[s] != 0x1234567800000000ull + s;
  }
  ShmemBarrierAll();
  env.Check(bad == 0 && log.Count() == 0,
            "typed put/get over RDMA: %d wrong slots, %u device failures", bad, log.Count());
}

// ---- device barrier ---------------------------------------------------------------------------
__global__ void BarrierKernel(ShmemDeviceContext ctx, uint64_t* word, int iters,
                              DeviceFailLog* log) {
  const int me = ctx.rank, n = ctx.worldSize, next = (me + 1) % n;
  __shared__ int stop;
  for (int i = 1; i <= iters; i++) {
    if (threadIdx.x == 0)
      ShmemPutTypeNbiThread<uint64_t>(ctx, word, static_cast<uint64_t>(i), next);
    if (!ShmemBarrierAllBlock(ctx)) return;
    if (threadIdx.x == 0) {
      const uint64_t v = core::AtomicLoadAcquireSystem(word);
      stop = v != static_cast<uint64_t>(i);
      DEV_CHECK(log, me, !stop, "barrier %d: word from the previous PE is %llu", i,
                (unsigned long long)v);
    }
    __syncthreads();
    if (stop) return;
    if (!ShmemBarrierAllBlock(ctx)) return;  // nobody overwrites before everyone checked
  }
}

void TestBarrier(RankEnv& env, uint64_t* word, gpuStream_t stream) {
  TEST_CHECK_GPU(gpuMemset(word, 0, sizeof(uint64_t)));
  ShmemBarrierAll();
  FailLogBuffer log;
  BarrierKernel<<<1, 64, 0, stream>>>(ShmemGetDeviceContext(), word, 100, log.Get());
  TEST_CHECK_GPU(gpuGetLastError());
  ShmemStreamSynchronize(stream);
  env.Check(log.Count() == 0, "100 device barriers ordering RDMA puts: %u device failures",
            log.Count());
}

// ---- registered user buffers --------------------------------------------------------------------
__global__ void UserPutKernel(ShmemDeviceContext ctx, uint8_t* buf, uint8_t* recv, size_t bytes,
                              int* ok) {
  const int me = ctx.rank, n = ctx.worldSize;
  bool all = true;
  for (int k = 0; k < n; k++)
    all = ShmemPutMemBlock(ctx, recv + me * kSlot, buf, bytes, (me + k) % n) && all;
  if (threadIdx.x == 0) *ok = all ? 1 : 0;
}
__global__ void UserGetKernel(ShmemDeviceContext ctx, uint8_t* buf, uint8_t* src, size_t bytes,
                              int pe, int* ok) {
  const bool r = ShmemGetMemBlock(ctx, buf, src, bytes, pe);
  if (threadIdx.x == 0) *ok = r ? 1 : 0;
}

std::string RaisedBy(const std::function<void()>& f, core::ErrorKind* kind);

void TestUserBuffer(RankEnv& env, uint8_t* src, uint8_t* recv, gpuStream_t stream) {
  const int n = env.npes, next = (env.rank + 1) % n;
  const size_t bytes = (1u << 20) + 40;
  uint8_t* buf = nullptr;
  int* ok = nullptr;
  TEST_CHECK_GPU(gpuMalloc(reinterpret_cast<void**>(&buf), bytes));
  TEST_CHECK_GPU(gpuMalloc(reinterpret_cast<void**>(&ok), sizeof(int)));
  std::vector<uint8_t> host(std::max(bytes, kSlot * n));
  FillPattern(host.data(), bytes, SeedOf(env.rank, 3000));
  TEST_CHECK_GPU(gpuMemcpy(buf, host.data(), bytes, gpuMemcpyHostToDevice));
  FillPattern(host.data(), bytes, SeedOf(env.rank, 3001));
  TEST_CHECK_GPU(gpuMemcpy(src, host.data(), bytes, gpuMemcpyHostToDevice));
  TEST_CHECK_GPU(gpuMemset(recv, kPoison, kSlot * n));
  int r = -1;
  core::ErrorKind kind = core::ErrorKind::kInternal;

  // Not registered: refused.
  UserPutKernel<<<1, 128, 0, stream>>>(ShmemGetDeviceContext(), buf, recv, bytes, ok);
  std::string what = RaisedBy([&] { ShmemStreamSynchronize(stream); }, &kind);
  TEST_CHECK_GPU(gpuMemcpy(&r, ok, sizeof(int), gpuMemcpyDeviceToHost));
  env.Check(r == 0 && kind == core::ErrorKind::kInvalidUsage &&
                what.find("not RDMA-registered") != std::string::npos,
            "put from an unregistered gpuMalloc buffer refused (returned %d): '%s'", r,
            what.c_str());

  ShmemRegisterBuffer(buf, bytes);
  ShmemBarrierAll();
  UserPutKernel<<<1, 128, 0, stream>>>(ShmemGetDeviceContext(), buf, recv, bytes, ok);
  ShmemStreamSynchronize(stream);
  TEST_CHECK_GPU(gpuMemcpy(&r, ok, sizeof(int), gpuMemcpyDeviceToHost));
  ShmemBarrierAll();
  TEST_CHECK_GPU(gpuMemcpy(host.data(), recv, kSlot * n, gpuMemcpyDeviceToHost));
  int bad = 0;
  for (int s = 0; s < n; s++)
    bad += FirstPatternMismatch(host.data() + s * kSlot, bytes, SeedOf(s, 3000)) != bytes;
  env.Check(r == 1 && bad == 0,
            "puts from a registered buffer to every PE: returned %d, %d bad slots", r, bad);

  UserGetKernel<<<1, 128, 0, stream>>>(ShmemGetDeviceContext(), buf, src, bytes, next, ok);
  ShmemStreamSynchronize(stream);
  TEST_CHECK_GPU(gpuMemcpy(&r, ok, sizeof(int), gpuMemcpyDeviceToHost));
  TEST_CHECK_GPU(gpuMemcpy(host.data(), buf, bytes, gpuMemcpyDeviceToHost));
  const size_t mism = FirstPatternMismatch(host.data(), bytes, SeedOf(next, 3001));
  env.Check(r == 1 && mism == bytes,
            "get from pe %d into a registered buffer: returned %d, mismatch at %zu of %zu", next, r,
            mism, bytes);

  ShmemBarrierAll();
  ShmemDeregisterBuffer(buf);
  UserPutKernel<<<1, 128, 0, stream>>>(ShmemGetDeviceContext(), buf, recv, bytes, ok);
  what = RaisedBy([&] { ShmemStreamSynchronize(stream); }, &kind);
  TEST_CHECK_GPU(gpuMemcpy(&r, ok, sizeof(int), gpuMemcpyDeviceToHost));
  bool twice = false;
  try {
    ShmemDeregisterBuffer(buf);
  } catch (const core::InvalidUsageError&) {
    twice = true;
  }
  env.Check(r == 0 && kind == core::ErrorKind::kInvalidUsage && twice,
            "after deregistration the put is refused again (returned %d: '%s'); a second "
            "deregistration raises: %d",
            r, what.c_str(), (int)twice);
  TEST_CHECK_GPU(gpuFree(buf));
  TEST_CHECK_GPU(gpuFree(ok));
  ShmemBarrierAll();
}

// ---- topology ---------------------------------------------------------------------------------
__global__ void TopologyKernel(ShmemDeviceContext ctx, int* out) {
  const int n = ctx.worldSize;
  out[0] = ShmemNumNodes(ctx);
  out[1] = ShmemNodeOf(ctx, -1);
  out[2] = ShmemNodeOf(ctx, n);
  out[3] = ShmemLocalRankOf(ctx, n);
  for (int p = 0; p < n; p++) {
    out[4 + 3 * p] = ShmemNodeOf(ctx, p);
    out[5 + 3 * p] = ShmemLocalRankOf(ctx, p);
    out[6 + 3 * p] = static_cast<int>(ShmemRdmaNumQps(ctx, p));
  }
}

// Nodes of gGpuPerNode consecutive PEs: host and device queries agree with each other and with
// that layout; same-node peers are P2P where the GPUs allow it (always for PEs sharing a GPU),
// other nodes RDMA; in a mixed run both kinds are present.
void TestTopology(RankEnv& env, uint8_t* heapPtr, gpuStream_t stream) {
  const int n = env.npes, g = gGpuPerNode, me = env.rank;
  const int numNodes = (n + g - 1) / g;
  int ngpus = 0, myDevice = 0;
  TEST_CHECK_GPU(gpuGetDeviceCount(&ngpus));
  TEST_CHECK_GPU(gpuGetDevice(&myDevice));
  const int numQps = core::Env().numQpPerPe;
  env.Check(ShmemNumNodes() == numNodes && ShmemLocalRank() == me % g &&
                ShmemLocalSize() == std::min(g, n - (me / g) * g),
            "host topology: %d nodes (expected %d), local rank %d of %d (expected %d of %d)",
            ShmemNumNodes(), numNodes, ShmemLocalRank(), ShmemLocalSize(), me % g,
            std::min(g, n - (me / g) * g));
  int* dev = nullptr;
  const size_t words = 4 + 3 * static_cast<size_t>(n);
  TEST_CHECK_GPU(gpuMalloc(reinterpret_cast<void**>(&dev), words * sizeof(int)));
  TopologyKernel<<<1, 1, 0, stream>>>(ShmemGetDeviceContext(), dev);
  TEST_CHECK_GPU(gpuGetLastError());
  ShmemStreamSynchronize(stream);
  std::vector<int> d(words);
  TEST_CHECK_GPU(gpuMemcpy(d.data(), dev, words * sizeof(int), gpuMemcpyDeviceToHost));
  TEST_CHECK_GPU(gpuFree(dev));
  env.Check(d[0] == numNodes && d[1] == -1 && d[2] == -1 && d[3] == -1,
            "device: %d nodes (expected %d), out-of-range pe gives %d/%d/%d (expected -1)", d[0],
            numNodes, d[1], d[2], d[3]);
  int bad = 0, p2p = 0, rdma = 0;
  for (int p = 0; p < n; p++) {
    const TransportType t = ShmemTransportType(p);
    bool expectP2p = p == me;
    if (p != me && p / g == me / g) {
      const int peerDevice = p % ngpus;  // the harness binds PE p to GPU p mod ngpus
      int can = peerDevice == myDevice;
      if (!can) TEST_CHECK_GPU(gpuDeviceCanAccessPeer(&can, myDevice, peerDevice));
      expectP2p = can != 0;
    }
    const TransportType want = p == me     ? TransportType::kSelf
                               : expectP2p ? TransportType::kP2P
                                           : TransportType::kRdma;
    const bool loadStore = ShmemPtrP2p(heapPtr, p) != nullptr;
    const int qps = want == TransportType::kRdma ? numQps : 0;
    const bool ok = ShmemNodeOf(p) == p / g && d[4 + 3 * p] == p / g && d[5 + 3 * p] == p % g &&
                    t == want && loadStore == (want != TransportType::kRdma) && d[6 + 3 * p] == qps;
    if (!ok && bad++ < 4)
      env.Check(false,
                "pe %d: node %d / device %d (expected %d), local rank %d (expected %d), transport "
                "%s (expected %s), load/store %d, %d QPs (expected %d)",
                p, ShmemNodeOf(p), d[4 + 3 * p], p / g, d[5 + 3 * p], p % g, TransportTypeName(t),
                TransportTypeName(want), (int)loadStore, d[6 + 3 * p], qps);
    p2p += t == TransportType::kP2P;
    rdma += t == TransportType::kRdma;
  }
  env.Check(bad == 0 && rdma > 0,
            "topology of %d PEs, %d per node: %d P2P and %d RDMA peers, %d mismatches", n, g, p2p,
            rdma, bad);
  bool raised = false;
  try {
    ShmemNodeOf(n);
  } catch (const core::InvalidUsageError&) {
    raised = true;
  }
  env.Check(raised, "ShmemNodeOf(%d) raises InvalidUsageError", n);
}

// ---- channels: explicit QPs, tickets, one-doorbell put + signal, warp batches -------------------
// This PE's view of its QP q to RDMA peer `pe`.
__device__ const core::rdma::QpEndpoint& Qp(const ShmemDeviceContext& ctx, int pe, uint32_t q) {
  return ctx.rdmaPeers[pe].qps[q];
}
__device__ uint64_t QpReady(const ShmemDeviceContext& ctx, int pe, uint32_t q) {
  return core::AtomicLoadAcquireSystem(Qp(ctx, pe, q).sq.ready);
}
// Whether the WQE at `block` requests a CQE (read by the thread that posted it, before anything
// else posts on the QP).
__device__ bool WqeRequestsCqe(const ShmemDeviceContext& ctx, int pe, uint32_t q, uint64_t block) {
  const core::rdma::SqHandle& sq = Qp(ctx, pe, q).sq;
  const auto* ctrl = static_cast<const volatile uint8_t*>(
      core::mlx5::SqBasicBlock(sq.ring, static_cast<uint32_t>(block), sq.numBlocks));
  return (ctrl[11] & core::mlx5::kCtrlCqUpdate) != 0;
}
// Blocks of the data WQEs of an RDMA put of `bytes` (< 1 GiB).
MORI_HD inline uint32_t PutBlocks(size_t bytes) {
  if (bytes == 0) return 0;
  if (bytes > shmem::detail::kRdmaInlineMax) return 1;
  return core::mlx5::WqeBasicBlocks(core::mlx5::DsRdmaWriteInline(static_cast<uint32_t>(bytes)));
}

constexpr int kChannels = 3;  // more channels than QPs: channel c uses QP c mod numQps
constexpr size_t kChannelBytes = 3000;
constexpr int kMaxTestQps = 16;

// Channel c of this PE to each PE: warp 0 puts the chunk (no CQE of its own) on QP c, then, after
// the block barrier, warp 1 signals on the same channel. Two warps would use two QPs without the
// explicit channel; the kernel also checks that only QP c mod numQps received the two requests.
__global__ void ChannelKernel(ShmemDeviceContext ctx, uint8_t* src, uint8_t* recv, uint64_t* sigs,
                              uint64_t epoch, DeviceFailLog* log) {
  const int me = ctx.rank, n = ctx.worldSize;
  const int warp = static_cast<int>(threadIdx.x) / core::kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % core::kWarpSize;
  __shared__ uint64_t before[kMaxTestQps];
  for (int k = 0; k < n; k++) {
    const int pe = (me + k) % n;
    const uint32_t nq = ShmemRdmaNumQps(ctx, pe);
    for (int c = 0; c < kChannels; c++) {
      if (threadIdx.x == 0)
        for (uint32_t q = 0; q < nq && q < kMaxTestQps; q++) before[q] = QpReady(ctx, pe, q);
      __syncthreads();
      if (warp == 0) {
        const bool ok =
            ShmemPutMemNbiWarpQp(ctx, recv + me * kSlot + c * kChannelBytes,
                                 src + c * kChannelBytes, kChannelBytes, pe, c, CqeMode::kSkipped);
        if (lane == 0) DEV_CHECK(log, me, ok, "channel %d put to pe %d returned false", c, pe);
      }
      __syncthreads();
      if (warp == 1 && lane == 0) {
        uint64_t t = ~0ull;
        const uint64_t word = (epoch << 32) | static_cast<uint64_t>(c + 1);
        const bool ok =
            ShmemSignalThreadQp(ctx, &sigs[me * kChannels + c], word, SignalOp::kSet, pe, c, &t);
        DEV_CHECK(log, me, ok, "channel %d signal to pe %d returned false", c, pe);
        if (nq == 0) {
          DEV_CHECK(log, me, t == 0, "load/store channel: ticket %llu, expected 0",
                    (unsigned long long)t);
        } else {
          const uint32_t used = c % nq;
          for (uint32_t q = 0; q < nq && q < kMaxTestQps; q++) {
            const uint64_t grew = QpReady(ctx, pe, q) - before[q];
            DEV_CHECK(log, me, grew == (q == used ? 2u : 0u),
                      "channel %d to pe %d: QP %u got %llu blocks (channel QP %u)", c, pe, q,
                      (unsigned long long)grew, used);
          }
          DEV_CHECK(log, me, t == QpReady(ctx, pe, used) && WqeRequestsCqe(ctx, pe, used, t - 1),
                    "channel %d to pe %d: ticket %llu, the signal must request a CQE", c, pe,
                    (unsigned long long)t);
          const bool forced = core::rdma::HoldsPeriodEnd(Qp(ctx, pe, used).sq, t - 2, 1);
          DEV_CHECK(log, me, forced || !WqeRequestsCqe(ctx, pe, used, t - 2),
                    "channel %d to pe %d: the CqeMode::kSkipped put requested a CQE", c, pe);
        }
      }
      __syncthreads();
    }
  }
  ShmemQuietBlock(ctx);
}

// Waits for every sender's channel signals (the packed word: epoch, channel + 1) and checks the
// chunk behind each.
__global__ void ChannelCheckKernel(ShmemDeviceContext ctx, uint8_t* recv, uint64_t* sigs,
                                   uint64_t epoch, DeviceFailLog* log) {
  const int n = ctx.worldSize;
  __shared__ int ok;
  for (int s = 0; s < n; s++) {
    for (int c = 0; c < kChannels; c++) {
      if (threadIdx.x == 0)
        ok =
            ShmemSignalWaitUntil(ctx, &sigs[s * kChannels + c], core::CmpOp::kEq,
                                 (epoch << 32) | static_cast<uint64_t>(c + 1), s, "channel signal");
      __syncthreads();
      if (!ok) return;
      int mism = 0;
      const uint64_t seed = SeedOf(s, 5000 + static_cast<int>(epoch));
      for (size_t i = threadIdx.x; i < kChannelBytes; i += blockDim.x)
        mism += recv[s * kSlot + c * kChannelBytes + i] != PatternByte(seed, c * kChannelBytes + i);
      mism = __syncthreads_count(mism != 0);
      if (threadIdx.x == 0)
        DEV_CHECK(log, ctx.rank, mism == 0,
                  "epoch %llu: channel %d of pe %d: data not in place "
                  "when its signal was seen",
                  (unsigned long long)epoch, c, s);
      __syncthreads();
    }
  }
}

void TestChannels(RankEnv& env, uint8_t* src, uint8_t* recv, uint64_t* sigs, gpuStream_t stream) {
  const int n = env.npes;
  std::vector<uint8_t> host(kChannels * kChannelBytes);
  FailLogBuffer log;
  for (uint64_t epoch = 1; epoch <= 3; epoch++) {
    FillPattern(host.data(), host.size(), SeedOf(env.rank, 5000 + static_cast<int>(epoch)));
    TEST_CHECK_GPU(gpuMemcpy(src, host.data(), host.size(), gpuMemcpyHostToDevice));
    TEST_CHECK_GPU(gpuMemset(sigs, 0, n * kChannels * sizeof(uint64_t)));
    ShmemBarrierAll();
    ChannelKernel<<<1, 2 * core::kWarpSize, 0, stream>>>(ShmemGetDeviceContext(), src, recv, sigs,
                                                         epoch, log.Get());
    ChannelCheckKernel<<<1, 256, 0, stream>>>(ShmemGetDeviceContext(), recv, sigs, epoch,
                                              log.Get());
    TEST_CHECK_GPU(gpuGetLastError());
    ShmemStreamSynchronize(stream);
    ShmemBarrierAll();
  }
  env.Check(log.Count() == 0,
            "explicit-QP channels (%d per PE, put then signal from another warp), 3 epochs: %u "
            "device failures",
            kChannels, log.Count());
}

// Put with signal on channel `round` through the Qp variants (scope by round): data and signal in
// one reservation (the QP's counters grow by exactly their blocks), only the signal requests a
// CQE, every thread of the scope gets the ticket. WaitAndCheckKernel checks the receiving side.
__global__ void PutSignalQpKernel(ShmemDeviceContext ctx, Scope scope, uint8_t* src, uint8_t* recv,
                                  size_t bytes, uint64_t* sigs, int round, DeviceFailLog* log) {
  const int me = ctx.rank, n = ctx.worldSize;
  const SignalOp op = (round & 1) ? SignalOp::kSet : SignalOp::kAdd;
  const uint64_t value = op == SignalOp::kAdd ? 1 : static_cast<uint64_t>(round + 1);
  const int tid = static_cast<int>(threadIdx.x);
  __shared__ uint64_t before, leaderTicket;
  for (int k = 1; k <= n; k++) {
    const int pe = (me + k) % n;
    const uint32_t nq = ShmemRdmaNumQps(ctx, pe);
    const uint32_t q = nq == 0 ? 0 : static_cast<uint32_t>(round) % nq;
    if (tid == 0) before = nq == 0 ? 0 : QpReady(ctx, pe, q);
    __syncthreads();
    uint64_t t = ~0ull;
    bool ok = true, caller = true;
    uint8_t* dst = recv + me * kSlot;
    if (scope == Scope::kThread) {
      caller = tid == 0;
      if (caller)
        ok =
            ShmemPutMemSignalNbiThreadQp(ctx, dst, src, bytes, &sigs[me], value, op, pe, round, &t);
    } else if (scope == Scope::kWarp) {
      caller = tid < core::kWarpSize;
      if (caller)
        ok = ShmemPutMemSignalNbiWarpQp(ctx, dst, src, bytes, &sigs[me], value, op, pe, round, &t);
    } else {
      ok = ShmemPutMemSignalNbiBlockQp(ctx, dst, src, bytes, &sigs[me], value, op, pe, round, &t);
    }
    if (tid == 0) leaderTicket = t;
    __syncthreads();
    if (caller) {
      DEV_CHECK(log, me, ok, "put-signal (Qp, scope %d) to pe %d returned false", (int)scope, pe);
      DEV_CHECK(log, me, t == leaderTicket, "thread %d got ticket %llu, the leader %llu", tid,
                (unsigned long long)t, (unsigned long long)leaderTicket);
    }
    if (tid == 0 && nq > 0) {
      const uint32_t data = PutBlocks(bytes);
      const core::rdma::SqHandle& sq = Qp(ctx, pe, q).sq;
      DEV_CHECK(log, me, t - before == data + 1 && core::AtomicLoadAcquireSystem(sq.reserved) == t,
                "put-signal to pe %d: %llu blocks in one reservation, expected %u", pe,
                (unsigned long long)(t - before), data + 1);
      DEV_CHECK(log, me, WqeRequestsCqe(ctx, pe, q, t - 1), "the signal WQE requests no CQE");
      DEV_CHECK(log, me,
                core::rdma::HoldsPeriodEnd(sq, before, data) || !WqeRequestsCqe(ctx, pe, q, before),
                "the data WQE before the signal requested a CQE");
    } else if (tid == 0) {
      DEV_CHECK(log, me, t == 0, "load/store put-signal ticket %llu", (unsigned long long)t);
    }
    __syncthreads();
  }
  ShmemQuietBlock(ctx);
}

void TestPutSignalQp(RankEnv& env, uint8_t* src, uint8_t* recv, uint64_t* sigs,
                     gpuStream_t stream) {
  const int n = env.npes;
  FailLogBuffer log;
  std::vector<uint8_t> host(256 * 1024 + 48);
  for (int round = 8; round < 16; round++) {  // WaitAndCheckKernel's rounds: parity picks the op
    const size_t bytes = (round / 2) % 2 == 0 ? 40 : host.size();  // inline / gather
    const Scope scope = static_cast<Scope>((round / 2) % 3);
    FillPattern(host.data(), bytes, SeedOf(env.rank, 1000 + round));
    TEST_CHECK_GPU(gpuMemcpy(src, host.data(), bytes, gpuMemcpyHostToDevice));
    TEST_CHECK_GPU(gpuMemset(sigs, 0, n * sizeof(uint64_t)));
    ShmemBarrierAll();
    PutSignalQpKernel<<<1, 128, 0, stream>>>(ShmemGetDeviceContext(), scope, src, recv, bytes, sigs,
                                             round, log.Get());
    WaitAndCheckKernel<<<1, 256, 0, stream>>>(ShmemGetDeviceContext(), recv, bytes, sigs, round,
                                              log.Get());
    TEST_CHECK_GPU(gpuGetLastError());
    ShmemStreamSynchronize(stream);
    ShmemBarrierAll();
  }
  env.Check(
      log.Count() == 0,
      "put-with-signal on explicit QPs, one reservation (kAdd/kSet, inline/gather, 3 scopes): "
      "%u device failures",
      log.Count());
}

// Warp batch: lane l puts BatchLaneBytes(l, round) bytes of its own window (0 for some lanes),
// one trailing signal (round % 3: kAdd, kSet, none).
constexpr size_t kLaneWindow = 8192;
MORI_HD inline size_t BatchLaneBytes(int lane, int round) {
  const size_t sizes[] = {0, 8, 64, 65, 1000, 4099, kLaneWindow};
  return sizes[(lane + round) % 7];
}
MORI_HD inline SignalOp BatchOp(int round) {
  return round % 3 == 0 ? SignalOp::kAdd : round % 3 == 1 ? SignalOp::kSet : SignalOp::kNone;
}
MORI_HD inline uint64_t BatchSignal(int round) {
  return BatchOp(round) == SignalOp::kAdd ? 1 : static_cast<uint64_t>(round + 1);
}

__global__ void BatchKernel(ShmemDeviceContext ctx, uint8_t* src, uint8_t* recv, uint64_t* sigs,
                            int round, DeviceFailLog* log) {
  const int me = ctx.rank, n = ctx.worldSize;
  const int lane = static_cast<int>(threadIdx.x) % core::kWarpSize;
  const SignalOp op = BatchOp(round);
  const size_t bytes = BatchLaneBytes(lane, round);
  for (int k = 1; k <= n; k++) {
    const int pe = (me + k) % n;
    const uint32_t nq = ShmemRdmaNumQps(ctx, pe);
    const uint32_t q = nq == 0 ? 0 : static_cast<uint32_t>(round) % nq;
    const uint64_t before = nq == 0 ? 0 : QpReady(ctx, pe, q);  // every lane reads the same
    core::WarpSync();
    uint64_t t = ~0ull;
    const bool ok = ShmemPutMemBatchSignalNbiWarp(ctx, recv + me * kSlot + lane * kLaneWindow,
                                                  src + lane * kLaneWindow, bytes, &sigs[me],
                                                  BatchSignal(round), op, pe, round, &t);
    DEV_CHECK(log, me, ok, "batch to pe %d returned false (lane %d, %llu bytes)", pe, lane,
              (unsigned long long)bytes);
    DEV_CHECK(log, me, core::WarpShfl(static_cast<unsigned long long>(t), 0) == t,
              "lane %d got another ticket than lane 0", lane);
    if (lane == 0 && nq > 0) {
      // One reservation: every lane's blocks plus the signal; the last request asks for the CQE.
      uint64_t blocks = 0, last = 0;
      for (int l = 0; l < core::kWarpSize; l++) {
        const uint32_t b = PutBlocks(BatchLaneBytes(l, round));
        if (b > 0) last = before + blocks;
        blocks += b;
      }
      if (op != SignalOp::kNone) last = before + blocks++;
      DEV_CHECK(log, me, t - before == blocks, "batch to pe %d: %llu blocks, expected %llu", pe,
                (unsigned long long)(t - before), (unsigned long long)blocks);
      DEV_CHECK(log, me, WqeRequestsCqe(ctx, pe, q, last),
                "batch to pe %d: last WQE at %llu "
                "requests no CQE",
                pe, (unsigned long long)last);
      if (op == SignalOp::kNone) {  // it completes by itself: the bounded wait posts nothing
        DEV_CHECK(log, me,
                  ShmemRdmaWaitCompleted(ctx, pe, round, t) && QpReady(ctx, pe, q) == t &&
                      ShmemRdmaCompleted(ctx, pe, round, t),
                  "batch without signal to pe %d did not complete as ticket %llu", pe,
                  (unsigned long long)t);
      }
    } else if (lane == 0) {
      DEV_CHECK(log, me, t == 0, "load/store batch ticket %llu", (unsigned long long)t);
    }
    core::WarpSync();
  }
  ShmemQuietWarp(ctx);
}

// Every lane window of every sender: its bytes from the sender's pattern, the rest still poison.
__global__ void BatchCheckKernel(ShmemDeviceContext ctx, uint8_t* recv, uint64_t* sigs, int round,
                                 DeviceFailLog* log) {
  const int n = ctx.worldSize;
  const SignalOp op = BatchOp(round);
  __shared__ int ok;
  for (int s = 0; s < n; s++) {
    if (threadIdx.x == 0)
      ok = op == SignalOp::kNone || ShmemSignalWaitUntil(ctx, &sigs[s], core::CmpOp::kEq,
                                                         BatchSignal(round), s, "batch signal");
    __syncthreads();
    if (!ok) return;
    int mism = 0;
    const uint64_t seed = SeedOf(s, 7000 + round);
    for (int l = 0; l < core::kWarpSize; l++) {
      const size_t b = BatchLaneBytes(l, round);
      const uint8_t* w = recv + s * kSlot + l * kLaneWindow;
      for (size_t i = threadIdx.x; i < kLaneWindow; i += blockDim.x)
        mism += w[i] != (i < b ? PatternByte(seed, l * kLaneWindow + i) : kPoison);
    }
    mism = __syncthreads_count(mism != 0);
    if (threadIdx.x == 0)
      DEV_CHECK(log, ctx.rank, mism == 0, "round %d: batch from pe %d: %d threads saw wrong bytes",
                round, s, mism);
    __syncthreads();
  }
}

void TestBatch(RankEnv& env, uint8_t* src, uint8_t* recv, uint64_t* sigs, gpuStream_t stream) {
  const int n = env.npes;
  const size_t span = core::kWarpSize * kLaneWindow;
  std::vector<uint8_t> host(span);
  FailLogBuffer log;
  for (int round = 0; round < 6; round++) {
    FillPattern(host.data(), span, SeedOf(env.rank, 7000 + round));
    TEST_CHECK_GPU(gpuMemcpy(src, host.data(), span, gpuMemcpyHostToDevice));
    TEST_CHECK_GPU(gpuMemset(recv, kPoison, kSlot * n));
    TEST_CHECK_GPU(gpuMemset(sigs, 0, n * sizeof(uint64_t)));
    ShmemBarrierAll();
    BatchKernel<<<1, core::kWarpSize, 0, stream>>>(ShmemGetDeviceContext(), src, recv, sigs, round,
                                                   log.Get());
    if (BatchOp(round) == SignalOp::kNone) {  // nothing to wait for: check after the barrier
      ShmemStreamSynchronize(stream);
      ShmemBarrierAll();
    }
    BatchCheckKernel<<<1, 256, 0, stream>>>(ShmemGetDeviceContext(), recv, sigs, round, log.Get());
    TEST_CHECK_GPU(gpuGetLastError());
    ShmemStreamSynchronize(stream);
    ShmemBarrierAll();
  }
  env.Check(
      log.Count() == 0,
      "warp-batched puts (lanes of 0..8192 bytes, trailing kAdd/kSet/no signal), 6 rounds: %u "
      "device failures",
      log.Count());
}

// Selective signalling and tickets, one thread (one lane per wavefront):
//  * three puts without CQEs: their ticket does not complete by itself (unless the signal period
//    forced a CQE), ShmemRdmaWaitCompleted posts the NOP that completes it;
//  * staging reuse: a put from a staging buffer, ShmemRdmaCompleted polled until true, then the
//    staging is overwritten for the next put; the receiver must see both versions.
constexpr size_t kStagingBytes = 64 * 1024;
constexpr size_t kStagingOffset = 4096;
__global__ void TicketKernel(ShmemDeviceContext ctx, uint8_t* src, uint8_t* recv,
                             DeviceFailLog* log) {
  const int me = ctx.rank, n = ctx.worldSize;
  if (threadIdx.x != 0) return;
  uint8_t* staging = src + kStagingOffset;
  for (int k = 1; k <= n; k++) {
    const int pe = (me + k) % n;
    const uint32_t nq = ShmemRdmaNumQps(ctx, pe), qp = 1;
    const uint32_t q = nq == 0 ? 0 : qp % nq;
    const uint64_t before = nq == 0 ? 0 : QpReady(ctx, pe, q);
    uint64_t t[3];
    for (int j = 0; j < 3; j++) {
      const bool ok = ShmemPutMemNbiThreadQp(ctx, recv + me * kSlot + j * 64, src + j * 64, 48, pe,
                                             qp, CqeMode::kSkipped, &t[j]);
      DEV_CHECK(log, me, ok, "unsignalled put %d to pe %d returned false", j, pe);
    }
    if (nq > 0) {
      const uint32_t b = PutBlocks(48);  // an inline WRITE of 48 bytes: 2 blocks
      const bool forced = core::rdma::HoldsPeriodEnd(Qp(ctx, pe, q).sq, before, 3 * b);
      DEV_CHECK(log, me, t[0] == before + b && t[2] == before + 3 * b,
                "tickets %llu..%llu after %llu, %u blocks each", (unsigned long long)t[0],
                (unsigned long long)t[2], (unsigned long long)before, b);
      if (!forced) {
        bool early = false;
        for (int j = 0; j < 3; j++) early = early || WqeRequestsCqe(ctx, pe, q, before + j * b);
        const uint64_t t0 = core::WallClockNs();
        while (!early && core::WallClockNs() - t0 < 20ull * 1000 * 1000)
          early = ShmemRdmaCompleted(ctx, pe, qp, t[2]);
        DEV_CHECK(log, me, !early, "unsignalled puts to pe %d completed without a CQE", pe);
      }
      const bool waited = ShmemRdmaWaitCompleted(ctx, pe, qp, t[2]);
      DEV_CHECK(log, me, waited && (forced || QpReady(ctx, pe, q) == t[2] + 1),
                "ShmemRdmaWaitCompleted to pe %d: %d, ready %llu (expected the NOP at %llu)", pe,
                (int)waited, (unsigned long long)QpReady(ctx, pe, q), (unsigned long long)t[2]);
      for (int j = 0; j < 3; j++)
        DEV_CHECK(log, me, ShmemRdmaCompleted(ctx, pe, qp, t[j]), "ticket %d to pe %d", j, pe);
    } else {
      DEV_CHECK(log, me, t[0] == 0 && t[2] == 0, "load/store tickets must be 0");
    }
    for (int v = 0; v < 2; v++) {
      const uint64_t seed = SeedOf(me, 9000 + v);
      for (size_t i = 0; i < kStagingBytes; i++) staging[i] = PatternByte(seed, i);
      uint64_t ticket = 0;
      const bool ok =
          ShmemPutMemNbiThreadQp(ctx, recv + me * kSlot + kStagingOffset + v * kStagingBytes,
                                 staging, kStagingBytes, pe, qp, CqeMode::kRequested, &ticket);
      bool done = false;
      const uint64_t t0 = core::WallClockNs();
      while (ok && !done && core::WallClockNs() - t0 < 10ull * 1000 * 1000 * 1000)
        done = ShmemRdmaCompleted(ctx, pe, qp, ticket);
      DEV_CHECK(log, me, ok && done, "staging put %d to pe %d: posted %d, completed %d", v, pe,
                (int)ok, (int)done);
    }
  }
  ShmemQuietThread(ctx);
}

void TestTickets(RankEnv& env, uint8_t* src, uint8_t* recv, gpuStream_t stream) {
  const int n = env.npes;
  std::vector<uint8_t> host(kSlot * n);
  FillPattern(host.data(), kStagingOffset, SeedOf(env.rank, 8000));
  TEST_CHECK_GPU(gpuMemcpy(src, host.data(), kStagingOffset, gpuMemcpyHostToDevice));
  TEST_CHECK_GPU(gpuMemset(recv, kPoison, kSlot * n));
  ShmemBarrierAll();
  FailLogBuffer log;
  TicketKernel<<<1, core::kWarpSize, 0, stream>>>(ShmemGetDeviceContext(), src, recv, log.Get());
  TEST_CHECK_GPU(gpuGetLastError());
  ShmemStreamSynchronize(stream);
  ShmemBarrierAll();
  TEST_CHECK_GPU(gpuMemcpy(host.data(), recv, kSlot * n, gpuMemcpyDeviceToHost));
  std::vector<uint8_t> expect(kStagingOffset);
  int bad = 0;
  for (int s = 0; s < n; s++) {
    const uint8_t* slot = host.data() + s * kSlot;
    FillPattern(expect.data(), kStagingOffset, SeedOf(s, 8000));
    for (int j = 0; j < 3; j++) bad += std::memcmp(slot + j * 64, expect.data() + j * 64, 48) != 0;
    for (int v = 0; v < 2; v++)
      bad += FirstPatternMismatch(slot + kStagingOffset + v * kStagingBytes, kStagingBytes,
                                  SeedOf(s, 9000 + v)) != kStagingBytes;
  }
  env.Check(bad == 0 && log.Count() == 0,
            "selective signalling and tickets (unsignalled puts, NOP on wait, staging reused after "
            "the ticket completed): %d bad ranges, %u device failures",
            bad, log.Count());
}

// ---- errors -----------------------------------------------------------------------------------
__global__ void NarrowAtomicKernel(ShmemDeviceContext ctx, AtomicWords* w, int target,
                                   int* result) {
  *result = ShmemAtomicAdd<uint32_t>(ctx, &w->narrow, 1u, target) ? 1 : 0;
}

__global__ void BadRkeyKernel(ShmemDeviceContext ctx, uint8_t* src, int next, int* result) {
  const ShmemRdmaPeer& p = ctx.rdmaPeers[next];
  core::rdma::WqeDesc d{};
  d.kind = core::rdma::WqeKind::kWrite;
  d.local = core::mlx5::Mlx5LocalBuf{reinterpret_cast<uintptr_t>(src), ctx.heapLkey, 256};
  d.remote = core::mlx5::Mlx5RemoteBuf{p.remoteHeapBase + 4096, p.rkey ^ 0x00ffff00u};
  const core::rdma::QpEndpoint& ep = p.qps[0];
  const core::rdma::QueueResult r = core::rdma::PostWqe(
      ep, d, core::rdma::PostContext{ctx.wait.timeoutNs, ctx.wait.err, ctx.rank, next});
  const bool quiet = shmem::detail::RdmaQuietPe(ctx, next, "bad rkey test");
  *result = (r.status == core::rdma::QueueStatus::kOk ? 1 : 0) | (quiet ? 2 : 0);
}

__global__ void PutAfterErrorKernel(ShmemDeviceContext ctx, uint8_t* src, uint8_t* dst, int target,
                                    int* result) {
  *result = ShmemPutMemThread(ctx, dst, src, 4096, target) ? 1 : 0;
}

std::string RaisedBy(const std::function<void()>& f, core::ErrorKind* kind) {
  try {
    f();
  } catch (const core::Error& e) {
    *kind = e.Kind();
    return e.what();
  }
  return "";
}

void TestErrors(RankEnv& env, AtomicWords* w, uint8_t* src, uint8_t* dst, gpuStream_t stream) {
  int* result = nullptr;
  TEST_CHECK_GPU(gpuMalloc(reinterpret_cast<void**>(&result), sizeof(int)));
  const int next = NextRdmaPeer(env.rank, env.npes);
  int r = -1;
  core::ErrorKind kind = core::ErrorKind::kInternal;

  NarrowAtomicKernel<<<1, 1, 0, stream>>>(ShmemGetDeviceContext(), w, next, result);
  std::string what = RaisedBy([&] { ShmemStreamSynchronize(stream); }, &kind);
  TEST_CHECK_GPU(gpuMemcpy(&r, result, sizeof(int), gpuMemcpyDeviceToHost));
  env.Check(r == 0 && kind == core::ErrorKind::kInvalidUsage &&
                what.find("not supported over RDMA") != std::string::npos,
            "32-bit atomic over RDMA refused (returned %d): '%s'", r, what.c_str());

  ShmemBarrierAll();
  BadRkeyKernel<<<1, 1, 0, stream>>>(ShmemGetDeviceContext(), src, next, result);
  what = RaisedBy([&] { ShmemStreamSynchronize(stream); }, &kind);
  TEST_CHECK_GPU(gpuMemcpy(&r, result, sizeof(int), gpuMemcpyDeviceToHost));
  const std::string pe = core::StrFormat("to pe %d", next);
  env.Check(
      r == 1 && kind == core::ErrorKind::kRemote &&
          what.find("RDMA error completion") != std::string::npos &&
          what.find("syndrome 0x13") != std::string::npos && what.find(pe) != std::string::npos,
      "bad rkey: posted, quiet failed (result %d), raised RemoteError naming pe %d and syndrome "
      "0x13: '%s'",
      r, next, what.c_str());

  PutAfterErrorKernel<<<1, 1, 0, stream>>>(ShmemGetDeviceContext(), src, dst, next, result);
  what = RaisedBy([&] { ShmemStreamSynchronize(stream); }, &kind);
  TEST_CHECK_GPU(gpuMemcpy(&r, result, sizeof(int), gpuMemcpyDeviceToHost));
  env.Check(r == 0 && kind == core::ErrorKind::kRemote,
            "a put on the failed QP is refused at once (returned %d): '%s'", r, what.c_str());
  TEST_CHECK_GPU(gpuFree(result));
  // The failed QP stays failed: the host barrier's quiet reports it again (on every PE here, since
  // every PE broke its QP to its next RDMA peer), instead of waiting on it.
  kind = core::ErrorKind::kInternal;
  what = RaisedBy([&] { ShmemBarrierAll(); }, &kind);
  env.Check(
      kind == core::ErrorKind::kRemote && what.find("RDMA error completion") != std::string::npos,
      "the host barrier reports the failed QP again: '%s'", what.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  // --gpu-per-node G (default 1): G consecutive PEs form a node (P2P inside it), other nodes are
  // reached through the emulator. Children inherit the environment.
  const char* g = mori::test::detail::ArgValue(argc, argv, "--gpu-per-node");
  gGpuPerNode = g != nullptr ? std::atoi(g) : 1;
  if (gGpuPerNode < 1) {
    std::printf("shmem_rdma_test: --gpu-per-node must be >= 1\n0 passed, 1 failed\n");
    return 1;
  }
  setenv("MORI_GPU_PER_NODE", std::to_string(gGpuPerNode).c_str(), 1);
  setenv("MORI_RDMA_EMULATE", "1", 1);
  setenv("MORI_NUM_QP_PER_PE", "2", 0);  // explicit channels need more than one QP
  Options opt;
  opt.minPes = gGpuPerNode + 1;  // at least two nodes
  return RunOnAllGpus(
      argc, argv, "shmem_rdma_test",
      [](RankEnv& env) {
        const int n = env.npes;
        gpuStream_t stream;
        TEST_CHECK_GPU(gpuStreamCreateWithFlags(&stream, gpuStreamNonBlocking));
        auto* src = static_cast<uint8_t*>(ShmemMalloc(kSlot));
        auto* recv = static_cast<uint8_t*>(ShmemMalloc(kSlot * n));
        auto* sigs = static_cast<uint64_t*>(ShmemMalloc(64 * sizeof(uint64_t)));
        auto* chanSigs =
            static_cast<uint64_t*>(ShmemMalloc(kMaxRanks * kChannels * sizeof(uint64_t)));
        auto* words = static_cast<AtomicWords*>(ShmemMalloc(sizeof(AtomicWords)));
        const uint64_t total =
            static_cast<uint64_t>(n) * kAtomicBlocks * kAtomicThreads * kAtomicIters;
        auto* seen = static_cast<uint64_t*>(ShmemMalloc(total * sizeof(uint64_t)));
        auto* typed = static_cast<TypedSlots*>(ShmemMalloc(sizeof(TypedSlots)));

        TestTopology(env, src, stream);
        TestPutGet(env, src, recv, stream);
        TestPutSignal(env, src, recv, sigs, stream);
        TestChannels(env, src, recv, chanSigs, stream);
        TestPutSignalQp(env, src, recv, sigs, stream);
        TestBatch(env, src, recv, sigs, stream);
        TestTickets(env, src, recv, stream);
        TestQuiet(env, src, recv, sigs + 32, stream);
        TestHostBarrierCompletes(env, src, recv, stream);
        TestAtomics(env, words, seen, stream);
        TestTyped(env, typed, stream);
        TestBarrier(env, sigs + 40, stream);
        TestUserBuffer(env, src, recv, stream);
        TestErrors(env, words, src, recv, stream);  // last: it leaves a QP in the error state
        TEST_CHECK_GPU(gpuStreamDestroy(stream));
      },
      opt);
}

// The shmem device API through the RDMA transport, every GPU its own node (MORI_GPU_PER_NODE=1)
// and the software queue emulator as the NIC (MORI_RDMA_EMULATE=1): kernels post real mlx5 WQEs,
// each PE's emulator thread executes them against the peers' heaps. All ordered pairs, self
// included (self stays load/store):
//  * topology: every other PE is kRdma and not load/store reachable;
//  * put and get, Thread/Warp/Block scopes, Nbi + quiet and blocking, sizes 1 B .. 1 MiB + 5
//    (inline and gather paths), random data, poisoned destinations with guard bytes;
//  * put-with-signal (add and set) for 8 rounds: the receiver waits for the signal in a kernel and
//    checks the data there (the signal never overtakes its data);
//  * Nbi puts left outstanding at a kernel's end, completed by the host ShmemBarrierAll;
//  * quiet: a 1 MiB Nbi put, ShmemQuietThread(ctx, pe) (per-PE quiet), then an atomic flag; the
//    receiver checks the data once the flag arrives;
//  * atomics under contention (64-bit fetch-add from 4x64 threads of every PE: exact totals and every
//    fetched value seen exactly once), compare-swap election (one winner), swap, fetch, set;
//  * typed immediates (put/get of 1..8-byte types);
//  * 100 device barriers, each ordering an RDMA put before it;
//  * a gpuMalloc buffer: puts from it refused until ShmemRegisterBuffer, then puts from it to every
//    PE and a get into it are exact, and after ShmemDeregisterBuffer puts are refused again;
//  * errors: a 32-bit atomic over RDMA is refused with an attributed usage error; a work request
//    with a bad rkey completes in error and is raised as RemoteError naming the peer, QP and
//    syndrome 0x13 (remote access), and later posts on that QP, and the host barrier's quiet, report
//    it again instead of hanging.
#include <algorithm>
#include <cinttypes>
#include <set>
#include <vector>

#include "gpu_test_harness.hpp"
#include "mori/shmem/shmem_device_api.hpp"

using namespace mori;
using namespace mori::shmem;
using namespace mori::test;

namespace {

constexpr size_t kSlot = (1u << 20) + 256;  // largest message + guard room
constexpr uint8_t kPoison = 0xEE;
const size_t kSizes[] = {1, 7, 64, 65, 4099, (1u << 20) + 5};
enum class Scope { kThread, kWarp, kBlock };
const char* ScopeName(Scope s) { return s == Scope::kThread ? "thread" : s == Scope::kWarp ? "warp" : "block"; }

MORI_HOST_DEVICE inline uint64_t SeedOf(int pe, int round) { return 0x5eed0000ull + pe * 131 + round; }

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
      if (kGet) ok = kBlocking ? ShmemGetMemThread(ctx, slot, src, bytes, pe)
                               : ShmemGetMemNbiThread(ctx, slot, src, bytes, pe);
      else ok = kBlocking ? ShmemPutMemThread(ctx, slot, src, bytes, pe)
                          : ShmemPutMemNbiThread(ctx, slot, src, bytes, pe);
    } else if (scope == Scope::kWarp) {
      if (!inWarp0) continue;
      if (kGet) ok = kBlocking ? ShmemGetMemWarp(ctx, slot, src, bytes, pe)
                               : ShmemGetMemNbiWarp(ctx, slot, src, bytes, pe);
      else ok = kBlocking ? ShmemPutMemWarp(ctx, slot, src, bytes, pe)
                          : ShmemPutMemNbiWarp(ctx, slot, src, bytes, pe);
    } else {
      if (kGet) ok = kBlocking ? ShmemGetMemBlock(ctx, slot, src, bytes, pe)
                               : ShmemGetMemNbiBlock(ctx, slot, src, bytes, pe);
      else ok = kBlocking ? ShmemPutMemBlock(ctx, slot, src, bytes, pe)
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
            kernel<<<1, 128, 0, stream>>>(ShmemGetDeviceContext(), scope, src, recv, bytes, log.Get());
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
                env.Check(false, "%s %s %s %zu B, slot of pe %d: data mismatch at %zu, guard at %zu",
                          get ? "get" : "put", blocking ? "blocking" : "nbi+quiet", ScopeName(scope),
                          bytes, s, bad1, bad2);
            }
          }
        }
      }
    }
  }
  env.Check(bad == 0 && log.Count() == 0,
            "put/get over RDMA: %d cases x %d PEs, %d slot mismatches, %u device failures", cases, n,
            bad, log.Count());
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
      DEV_CHECK(log, me, mism == 0, "round %d: data from pe %d not in place when its signal was seen",
                round, s);
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
  if (threadIdx.x == 0) ok = ShmemWaitUntil<uint64_t>(ctx, flag, core::CmpOp::kGe, 1, -1, "quiet flag");
  __syncthreads();
  if (!ok) return;
  int mism = 0;
  for (size_t i = threadIdx.x; i < bytes; i += blockDim.x) mism += recv[i] != PatternByte(seed, i);
  mism = __syncthreads_count(mism != 0);
  if (threadIdx.x == 0) DEV_CHECK(log, ctx.rank, mism == 0, "data not complete when the flag arrived");
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
  for (int k = 1; k < n; k++) all = ShmemPutMemNbiBlock(ctx, recv + me * kSlot, src, bytes, (me + k) % n) && all;
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
  env.Check(left == 0, "after ShmemBarrierAll every RDMA request of this PE is completed: %llu left",
            left);
  int r = 0;
  TEST_CHECK_GPU(gpuMemcpy(&r, ok, sizeof(int), gpuMemcpyDeviceToHost));
  TEST_CHECK_GPU(gpuMemcpy(host.data(), recv, kSlot * n, gpuMemcpyDeviceToHost));
  int bad = 0;
  for (int s = 0; s < n; s++) {
    if (s == env.rank) continue;
    bad += FirstPatternMismatch(host.data() + s * kSlot, bytes, SeedOf(s, 4000)) != bytes;
  }
  env.Check(r == 1 && bad == 0,
            "nbi puts without quiet, completed by the host ShmemBarrierAll: returned %d, %d bad slots",
            r, bad);
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

__global__ void FetchAddKernel(ShmemDeviceContext ctx, AtomicWords* w, uint64_t* seen, uint64_t total,
                               DeviceFailLog* log) {
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
  DEV_CHECK(log, me, old == 0, "swap on pe %d returned %llu, expected 0", next, (unsigned long long)old);
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
            "fetch-add over RDMA from %d PEs x %d threads x %d: total %" PRIu64 " (expected %" PRIu64
            "), %zu fetched values not seen exactly once",
            n, kAtomicBlocks * kAtomicThreads, kAtomicIters, h.ctr, total, notOnce);
  if (env.rank == 0)
    env.Check(h.wins == 1 && h.lock >= 1 && h.lock <= static_cast<uint64_t>(n),
              "compare-swap election: %" PRIu64 " winners (expected 1), lock = %" PRIu64, h.wins, h.lock);
  const int prev = (env.rank + n - 1) % n;
  env.Check(h.swap == (static_cast<uint64_t>(prev) + 1) << 32, "swap from pe %d left 0x%" PRIx64,
            prev, h.swap);
  int setBad = 0;
  for (int p = 0; p < n; p++)
    setBad += h.set[p] != (0xabcd000000000000ull | (static_cast<uint64_t>(p) << 16) | env.rank);
  env.Check(setBad == 0 && log.Count() == 0, "set/fetch: %d wrong words, %u device failures", setBad,
            log.Count());
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
  env.Check(bad == 0 && log.Count() == 0, "typed put/get over RDMA: %d wrong slots, %u device failures",
            bad, log.Count());
}

// ---- device barrier ---------------------------------------------------------------------------
__global__ void BarrierKernel(ShmemDeviceContext ctx, uint64_t* word, int iters, DeviceFailLog* log) {
  const int me = ctx.rank, n = ctx.worldSize, next = (me + 1) % n;
  __shared__ int stop;
  for (int i = 1; i <= iters; i++) {
    if (threadIdx.x == 0) ShmemPutTypeNbiThread<uint64_t>(ctx, word, static_cast<uint64_t>(i), next);
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
  env.Check(log.Count() == 0, "100 device barriers ordering RDMA puts: %u device failures", log.Count());
}

// ---- registered user buffers --------------------------------------------------------------------
__global__ void UserPutKernel(ShmemDeviceContext ctx, uint8_t* buf, uint8_t* recv, size_t bytes,
                              int* ok) {
  const int me = ctx.rank, n = ctx.worldSize;
  bool all = true;
  for (int k = 0; k < n; k++) all = ShmemPutMemBlock(ctx, recv + me * kSlot, buf, bytes, (me + k) % n) && all;
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
            "put from an unregistered gpuMalloc buffer refused (returned %d): '%s'", r, what.c_str());

  ShmemRegisterBuffer(buf, bytes);
  ShmemBarrierAll();
  UserPutKernel<<<1, 128, 0, stream>>>(ShmemGetDeviceContext(), buf, recv, bytes, ok);
  ShmemStreamSynchronize(stream);
  TEST_CHECK_GPU(gpuMemcpy(&r, ok, sizeof(int), gpuMemcpyDeviceToHost));
  ShmemBarrierAll();
  TEST_CHECK_GPU(gpuMemcpy(host.data(), recv, kSlot * n, gpuMemcpyDeviceToHost));
  int bad = 0;
  for (int s = 0; s < n; s++) bad += FirstPatternMismatch(host.data() + s * kSlot, bytes, SeedOf(s, 3000)) != bytes;
  env.Check(r == 1 && bad == 0, "puts from a registered buffer to every PE: returned %d, %d bad slots", r, bad);

  UserGetKernel<<<1, 128, 0, stream>>>(ShmemGetDeviceContext(), buf, src, bytes, next, ok);
  ShmemStreamSynchronize(stream);
  TEST_CHECK_GPU(gpuMemcpy(&r, ok, sizeof(int), gpuMemcpyDeviceToHost));
  TEST_CHECK_GPU(gpuMemcpy(host.data(), buf, bytes, gpuMemcpyDeviceToHost));
  const size_t mism = FirstPatternMismatch(host.data(), bytes, SeedOf(next, 3001));
  env.Check(r == 1 && mism == bytes, "get from pe %d into a registered buffer: returned %d, mismatch at %zu of %zu",
            next, r, mism, bytes);

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

// ---- errors -----------------------------------------------------------------------------------
__global__ void NarrowAtomicKernel(ShmemDeviceContext ctx, AtomicWords* w, int* result) {
  *result = ShmemAtomicAdd<uint32_t>(ctx, &w->narrow, 1u, (ctx.rank + 1) % ctx.worldSize) ? 1 : 0;
}

__global__ void BadRkeyKernel(ShmemDeviceContext ctx, uint8_t* src, int* result) {
  const int next = (ctx.rank + 1) % ctx.worldSize;
  const ShmemRdmaPeer& p = ctx.rdmaPeers[next];
  core::rdma::WqeDesc d{};
  d.kind = core::rdma::WqeKind::kWrite;
  d.local = core::mlx5::Mlx5LocalBuf{reinterpret_cast<uintptr_t>(src), ctx.heapLkey, 256};
  d.remote = core::mlx5::Mlx5RemoteBuf{p.remoteHeapBase + 4096, p.rkey ^ 0x00ffff00u};
  const core::rdma::QpEndpoint& ep = p.qps[0];
  const core::rdma::QueueResult r =
      core::rdma::PostWqe(ep, d, core::rdma::PostContext{ctx.wait.timeoutNs, ctx.wait.err, ctx.rank, next});
  const bool quiet = shmem::detail::RdmaQuietPe(ctx, next, "bad rkey test");
  *result = (r.status == core::rdma::QueueStatus::kOk ? 1 : 0) | (quiet ? 2 : 0);
}

__global__ void PutAfterErrorKernel(ShmemDeviceContext ctx, uint8_t* src, uint8_t* dst, int* result) {
  *result = ShmemPutMemThread(ctx, dst, src, 4096, (ctx.rank + 1) % ctx.worldSize) ? 1 : 0;
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
  const int next = (env.rank + 1) % env.npes;
  int r = -1;
  core::ErrorKind kind = core::ErrorKind::kInternal;

  NarrowAtomicKernel<<<1, 1, 0, stream>>>(ShmemGetDeviceContext(), w, result);
  std::string what = RaisedBy([&] { ShmemStreamSynchronize(stream); }, &kind);
  TEST_CHECK_GPU(gpuMemcpy(&r, result, sizeof(int), gpuMemcpyDeviceToHost));
  env.Check(r == 0 && kind == core::ErrorKind::kInvalidUsage &&
                what.find("not supported over RDMA") != std::string::npos,
            "32-bit atomic over RDMA refused (returned %d): '%s'", r, what.c_str());

  ShmemBarrierAll();
  BadRkeyKernel<<<1, 1, 0, stream>>>(ShmemGetDeviceContext(), src, result);
  what = RaisedBy([&] { ShmemStreamSynchronize(stream); }, &kind);
  TEST_CHECK_GPU(gpuMemcpy(&r, result, sizeof(int), gpuMemcpyDeviceToHost));
  const std::string pe = core::StrFormat("to pe %d", next);
  env.Check(r == 1 && kind == core::ErrorKind::kRemote &&
                what.find("RDMA error completion") != std::string::npos &&
                what.find("syndrome 0x13") != std::string::npos && what.find(pe) != std::string::npos,
            "bad rkey: posted, quiet failed (result %d), raised RemoteError naming pe %d and syndrome "
            "0x13: '%s'",
            r, next, what.c_str());

  PutAfterErrorKernel<<<1, 1, 0, stream>>>(ShmemGetDeviceContext(), src, dst, result);
  what = RaisedBy([&] { ShmemStreamSynchronize(stream); }, &kind);
  TEST_CHECK_GPU(gpuMemcpy(&r, result, sizeof(int), gpuMemcpyDeviceToHost));
  env.Check(r == 0 && kind == core::ErrorKind::kRemote,
            "a put on the failed QP is refused at once (returned %d): '%s'", r, what.c_str());
  TEST_CHECK_GPU(gpuFree(result));
  // The failed QP stays failed: the host barrier's quiet reports it again (on every PE here, since
  // every PE broke its QP to the next one), instead of waiting on it.
  kind = core::ErrorKind::kInternal;
  what = RaisedBy([&] { ShmemBarrierAll(); }, &kind);
  env.Check(kind == core::ErrorKind::kRemote && what.find("RDMA error completion") != std::string::npos,
            "the host barrier reports the failed QP again: '%s'", what.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  // Every GPU its own node, the emulator as the NIC (children inherit the environment).
  setenv("MORI_GPU_PER_NODE", "1", 1);
  setenv("MORI_RDMA_EMULATE", "1", 1);
  setenv("CUDA_MODULE_LOADING", "EAGER", 1);  // the emulator requires it (see docs/rdma.md)
  return RunOnAllGpus(argc, argv, "shmem_rdma_test", [](RankEnv& env) {
    const int n = env.npes;
    gpuStream_t stream;
    TEST_CHECK_GPU(gpuStreamCreateWithFlags(&stream, gpuStreamNonBlocking));
    auto* src = static_cast<uint8_t*>(ShmemMalloc(kSlot));
    auto* recv = static_cast<uint8_t*>(ShmemMalloc(kSlot * n));
    auto* sigs = static_cast<uint64_t*>(ShmemMalloc(64 * sizeof(uint64_t)));
    auto* words = static_cast<AtomicWords*>(ShmemMalloc(sizeof(AtomicWords)));
    const uint64_t total = static_cast<uint64_t>(n) * kAtomicBlocks * kAtomicThreads * kAtomicIters;
    auto* seen = static_cast<uint64_t*>(ShmemMalloc(total * sizeof(uint64_t)));
    auto* typed = static_cast<TypedSlots*>(ShmemMalloc(sizeof(TypedSlots)));

    int rdmaPeers = 0, p2pPtrs = 0;
    for (int p = 0; p < n; p++) {
      if (p == env.rank) continue;
      rdmaPeers += ShmemTransportType(p) == TransportType::kRdma;
      p2pPtrs += ShmemPtrP2p(src, p) != nullptr;
    }
    env.Check(rdmaPeers == n - 1 && p2pPtrs == 0,
              "every other PE is reached by RDMA only: %d of %d kRdma, %d load/store pointers",
              rdmaPeers, n - 1, p2pPtrs);

    TestPutGet(env, src, recv, stream);
    TestPutSignal(env, src, recv, sigs, stream);
    TestQuiet(env, src, recv, sigs + 32, stream);
    TestHostBarrierCompletes(env, src, recv, stream);
    TestAtomics(env, words, seen, stream);
    TestTyped(env, typed, stream);
    TestBarrier(env, sigs + 40, stream);
    TestUserBuffer(env, src, recv, stream);
    TestErrors(env, words, src, recv, stream);  // last: it leaves a QP in the error state
    TEST_CHECK_GPU(gpuStreamDestroy(stream));
  });
}

// Device API atomics under contention, all PEs at once, one process per GPU:
//  * fetch-add on every PE's counters (uint32, uint64; int32/int64 add with negative values):
//    exact final counts, and the fetched values of each counter form a permutation of
//    [0, total) (every value is marked once in a symmetric "seen" array on the counter's PE);
//  * CAS-based increment (uint32, uint64) and a CAS spin lock guarding a plain read-modify-write;
//  * swap: the values swapped out plus the final value are exactly the initial value plus every
//    value swapped in;
//  * fetch / set of every type between every pair.
#include <cinttypes>
#include <vector>

#include "gpu_test_harness.hpp"
#include "mori/shmem/shmem_device_api.hpp"

using namespace mori;
using namespace mori::shmem;
using namespace mori::test;

namespace {

constexpr int kBlocks = 8;
constexpr int kThreads = 256;
constexpr int kIters = 4;  // fetch-adds per thread per target PE
constexpr int kCasBlocks = 4;
constexpr int kCasWarps = 4;  // lane 0 of each warp contends
constexpr int kCasIters = 16;
constexpr int kLockBlocks = 4;  // thread 0 of each block contends
constexpr int kLockIters = 16;
constexpr int kSwapBlocks = 4;
constexpr int kSwapThreads = 64;
constexpr int kSwapIters = 8;
constexpr uint64_t kSpinLimitNs = 10ull * 1000 * 1000 * 1000;  // CAS loops give up after 10 s

// Symmetric layout (one allocation, zeroed).
struct Counters {
  uint32_t ctr32;
  uint32_t cas32;
  int32_t add32;
  int32_t pad0;
  uint64_t ctr64;
  uint64_t cas64;
  int64_t add64;
  uint64_t lock;
  uint64_t locked;  // incremented non-atomically under `lock`
  uint64_t swap;
  uint64_t set64[64];
  uint32_t set32[64];
  int64_t seti64[64];
  int32_t seti32[64];
};

struct Arrays {
  Counters* c;         // symmetric
  uint32_t* seen32;    // symmetric [total]: fetched values of ctr32 on this PE
  uint32_t* seen64;    // symmetric [total]: fetched values of ctr64 on this PE
  uint32_t* seenSwap;  // symmetric [swapTotal + 1]: values swapped out of `swap` on this PE
};

__global__ void __launch_bounds__(kThreads)
    FetchAddKernel(ShmemDeviceContext ctx, Arrays a, uint64_t total, DeviceFailLog* log) {
  const int n = ctx.worldSize, me = ctx.rank;
  for (int k = 0; k < n; k++) {
    const int pe = (me + k) % n;  // spread the load over targets
    for (int it = 0; it < kIters; it++) {
      const uint32_t v32 = ShmemAtomicFetchAdd<uint32_t>(ctx, &a.c->ctr32, 1u, pe);
      const uint64_t v64 = ShmemAtomicFetchAdd<uint64_t>(ctx, &a.c->ctr64, 1ull, pe);
      DEV_CHECK(log, me, v32 < total && v64 < total,
                "fetch-add on pe %d returned %u / %llu >= %llu", pe, v32, (unsigned long long)v64,
                (unsigned long long)total);
      if (v32 < total) ShmemAtomicAdd<uint32_t>(ctx, &a.seen32[v32], 1u, pe);
      if (v64 < total) ShmemAtomicAdd<uint32_t>(ctx, &a.seen64[v64], 1u, pe);
      const bool ok = ShmemAtomicAdd<int32_t>(ctx, &a.c->add32, -1, pe);
      const int64_t old = ShmemAtomicFetchAdd<int64_t>(ctx, &a.c->add64, -3, pe);
      DEV_CHECK(log, me, ok && old <= 0 && old > -3 * (int64_t)total,
                "signed atomics on pe %d: add ok %d, fetched %lld", pe, (int)ok, (long long)old);
    }
  }
}

template <typename T>
__device__ bool CasIncrement(const ShmemDeviceContext& ctx, T* addr, int pe) {
  const uint64_t start = core::WallClockNs();
  T cur = ShmemAtomicFetch<T>(ctx, addr, pe);
  for (;;) {
    const T prev = ShmemAtomicCompareSwap<T>(ctx, addr, cur, static_cast<T>(cur + 1), pe);
    if (prev == cur) return true;
    cur = prev;
    if (core::WallClockNs() - start > kSpinLimitNs) return false;
  }
}

__global__ void CasKernel(ShmemDeviceContext ctx, Arrays a, DeviceFailLog* log) {
  if (core::LaneId() != 0) return;
  const int n = ctx.worldSize, me = ctx.rank;
  for (int k = 0; k < n; k++) {
    const int pe = (me + k) % n;
    for (int it = 0; it < kCasIters; it++) {
      DEV_CHECK(log, me, CasIncrement<uint64_t>(ctx, &a.c->cas64, pe),
                "64-bit CAS increment on pe %d gave up", pe);
      DEV_CHECK(log, me, CasIncrement<uint32_t>(ctx, &a.c->cas32, pe),
                "32-bit CAS increment on pe %d gave up", pe);
    }
  }
}

// A CAS spin lock per PE guards a non-atomic increment of `locked` on that PE.
__global__ void LockKernel(ShmemDeviceContext ctx, Arrays a, DeviceFailLog* log) {
  if (threadIdx.x != 0) return;
  const int n = ctx.worldSize, me = ctx.rank;
  const uint64_t myId = uint64_t(me) * kLockBlocks + blockIdx.x + 1;  // nonzero
  for (int k = 0; k < n; k++) {
    const int pe = (me + k) % n;
    uint64_t* locked = ShmemPtrP2p(ctx, &a.c->locked, pe);
    DEV_CHECK(log, me, locked != nullptr, "ShmemPtrP2p(locked, pe %d) is null", pe);
    if (locked == nullptr) return;
    for (int it = 0; it < kLockIters; it++) {
      const uint64_t start = core::WallClockNs();
      bool got = false;
      while (!(got = ShmemAtomicCompareSwap<uint64_t>(ctx, &a.c->lock, 0, myId, pe) == 0)) {
        if (core::WallClockNs() - start > kSpinLimitNs) break;
        core::SpinPause();
      }
      DEV_CHECK(log, me, got, "lock on pe %d not acquired within 10 s", pe);
      if (!got) return;
      core::FenceSystem();  // acquire side: see the previous holder's increment
      const uint64_t v = core::AtomicLoadRelaxedSystem(locked);
      core::AtomicStoreRelaxedSystem(locked, v + 1);
      const uint64_t owner = ShmemAtomicFetch<uint64_t>(ctx, &a.c->lock, pe);
      DEV_CHECK(log, me, owner == myId, "lock on pe %d owned by %llu while %llu holds it", pe,
                (unsigned long long)owner, (unsigned long long)myId);
      ShmemAtomicSet<uint64_t>(ctx, &a.c->lock, 0, pe);  // release: the increment is visible first
    }
  }
}

__global__ void SwapKernel(ShmemDeviceContext ctx, Arrays a, uint64_t swapTotal,
                           DeviceFailLog* log) {
  const int n = ctx.worldSize, me = ctx.rank;
  const uint64_t gtid = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int k = 0; k < n; k++) {
    const int pe = (me + k) % n;
    for (int it = 0; it < kSwapIters; it++) {
      // Unique nonzero value per (source PE, thread, target, iteration) among those sent to pe.
      const uint64_t value =
          1 + (uint64_t(me) * kSwapBlocks * kSwapThreads + gtid) * kSwapIters + uint64_t(it);
      const uint64_t old = ShmemAtomicSwap<uint64_t>(ctx, &a.c->swap, value, pe);
      DEV_CHECK(log, me, old <= swapTotal, "swap on pe %d returned %llu > %llu", pe,
                (unsigned long long)old, (unsigned long long)swapTotal);
      if (old <= swapTotal) ShmemAtomicAdd<uint32_t>(ctx, &a.seenSwap[old], 1u, pe);
    }
  }
}

MORI_HD uint64_t SetValue(int src, int dst, int kind) {
  return Mix64(uint64_t(src) * 977 + uint64_t(dst) * 13 + uint64_t(kind));
}

// Thread p: set this PE's slot on PE p, for every type.
__global__ void SetKernel(ShmemDeviceContext ctx, Arrays a, DeviceFailLog* log) {
  const int pe = threadIdx.x, me = ctx.rank;
  if (pe >= ctx.worldSize) return;
  bool ok = ShmemAtomicSet<uint64_t>(ctx, &a.c->set64[me], SetValue(me, pe, 0), pe);
  ok &= ShmemAtomicSet<uint32_t>(ctx, &a.c->set32[me], uint32_t(SetValue(me, pe, 1)), pe);
  ok &= ShmemAtomicSet<int64_t>(ctx, &a.c->seti64[me], int64_t(SetValue(me, pe, 2)), pe);
  ok &= ShmemAtomicSet<int32_t>(ctx, &a.c->seti32[me], int32_t(SetValue(me, pe, 3)), pe);
  DEV_CHECK(log, me, ok, "ShmemAtomicSet to pe %d returned false", pe);
}

// Thread p: fetch, from PE p, what every PE q set there.
__global__ void FetchKernel(ShmemDeviceContext ctx, Arrays a, DeviceFailLog* log) {
  const int pe = threadIdx.x, me = ctx.rank, n = ctx.worldSize;
  if (pe >= n) return;
  for (int q = 0; q < n; q++) {
    const uint64_t v64 = ShmemAtomicFetch<uint64_t>(ctx, &a.c->set64[q], pe);
    const uint32_t v32 = ShmemAtomicFetch<uint32_t>(ctx, &a.c->set32[q], pe);
    const int64_t vi64 = ShmemAtomicFetch<int64_t>(ctx, &a.c->seti64[q], pe);
    const int32_t vi32 = ShmemAtomicFetch<int32_t>(ctx, &a.c->seti32[q], pe);
    DEV_CHECK(log, me, v64 == SetValue(q, pe, 0), "fetch u64 slot %d on pe %d: %llu", q, pe,
              (unsigned long long)v64);
    DEV_CHECK(log, me, v32 == uint32_t(SetValue(q, pe, 1)), "fetch u32 slot %d on pe %d: %u", q, pe,
              v32);
    DEV_CHECK(log, me, vi64 == int64_t(SetValue(q, pe, 2)), "fetch i64 slot %d on pe %d: %lld", q,
              pe, (long long)vi64);
    DEV_CHECK(log, me, vi32 == int32_t(SetValue(q, pe, 3)), "fetch i32 slot %d on pe %d: %d", q, pe,
              vi32);
  }
}

// Counts entries of `seen` (n entries) different from 1; reports the first.
bool CheckPermutation(RankEnv& env, const char* what, const uint32_t* dev, size_t n) {
  std::vector<uint32_t> h(n);
  TEST_CHECK_GPU(gpuMemcpy(h.data(), dev, n * sizeof(uint32_t), gpuMemcpyDeviceToHost));
  size_t bad = 0, first = n;
  for (size_t i = 0; i < n; i++) {
    if (h[i] != 1) {
      if (first == n) first = i;
      bad++;
    }
  }
  return env.Check(bad == 0,
                   "%s: %zu values, %zu not seen exactly once (first: value %zu seen %u times)",
                   what, n, bad, first, first < n ? h[first] : 0u);
}

void RunBody(RankEnv& env) {
  const int n = env.npes;
  if (n > 64) {
    env.Check(false, "this test supports at most 64 PEs");
    return;
  }
  const ShmemDeviceContext ctx = ShmemGetDeviceContext();
  gpuStream_t stream;
  TEST_CHECK_GPU(gpuStreamCreateWithFlags(&stream, gpuStreamNonBlocking));
  FailLogBuffer log;

  const uint64_t total = uint64_t(n) * kBlocks * kThreads * kIters;  // fetch-adds per counter
  const uint64_t swapTotal = uint64_t(n) * kSwapBlocks * kSwapThreads * kSwapIters;
  Arrays a{};
  a.c = static_cast<Counters*>(ShmemMalloc(sizeof(Counters)));
  a.seen32 = static_cast<uint32_t*>(ShmemMalloc(total * sizeof(uint32_t)));
  a.seen64 = static_cast<uint32_t*>(ShmemMalloc(total * sizeof(uint32_t)));
  a.seenSwap = static_cast<uint32_t*>(ShmemMalloc((swapTotal + 1) * sizeof(uint32_t)));
  TEST_CHECK_GPU(gpuMemset(a.c, 0, sizeof(Counters)));
  TEST_CHECK_GPU(gpuMemset(a.seen32, 0, total * sizeof(uint32_t)));
  TEST_CHECK_GPU(gpuMemset(a.seen64, 0, total * sizeof(uint32_t)));
  TEST_CHECK_GPU(gpuMemset(a.seenSwap, 0, (swapTotal + 1) * sizeof(uint32_t)));
  ShmemBarrierAll();

  // Everything contends at once: the kernels of one PE run back to back on one stream while
  // the other PEs run theirs.
  FetchAddKernel<<<kBlocks, kThreads, 0, stream>>>(ctx, a, total, log.Get());
  CasKernel<<<kCasBlocks, kCasWarps * core::kWarpSize, 0, stream>>>(ctx, a, log.Get());
  LockKernel<<<kLockBlocks, core::kWarpSize, 0, stream>>>(ctx, a, log.Get());
  SwapKernel<<<kSwapBlocks, kSwapThreads, 0, stream>>>(ctx, a, swapTotal, log.Get());
  SetKernel<<<1, 64, 0, stream>>>(ctx, a, log.Get());
  TEST_CHECK_GPU(gpuGetLastError());
  ShmemStreamSynchronize(stream);
  ShmemBarrierAll();  // every PE finished: our counters are final

  Counters c{};
  TEST_CHECK_GPU(gpuMemcpy(&c, a.c, sizeof(c), gpuMemcpyDeviceToHost));
  env.Check(c.ctr32 == uint32_t(total), "uint32 fetch-add count %u, want %" PRIu64, c.ctr32, total);
  env.Check(c.ctr64 == total, "uint64 fetch-add count %" PRIu64 ", want %" PRIu64, c.ctr64, total);
  env.Check(c.add32 == -int32_t(total), "int32 add(-1) count %d, want -%" PRIu64, c.add32, total);
  env.Check(c.add64 == -3 * int64_t(total),
            "int64 fetch-add(-3) count %" PRId64 ", want -3*%" PRIu64, c.add64, total);
  CheckPermutation(env, "uint32 fetch-add results", a.seen32, total);
  CheckPermutation(env, "uint64 fetch-add results", a.seen64, total);

  const uint64_t casTotal = uint64_t(n) * kCasBlocks * kCasWarps * kCasIters;
  env.Check(c.cas64 == casTotal, "uint64 CAS increments %" PRIu64 ", want %" PRIu64, c.cas64,
            casTotal);
  env.Check(c.cas32 == uint32_t(casTotal), "uint32 CAS increments %u, want %" PRIu64, c.cas32,
            casTotal);
  const uint64_t lockTotal = uint64_t(n) * kLockBlocks * kLockIters;
  env.Check(c.locked == lockTotal, "increments under the CAS lock %" PRIu64 ", want %" PRIu64,
            c.locked, lockTotal);
  env.Check(c.lock == 0, "CAS lock released (value %" PRIu64 ")", c.lock);

  // The final swap value was never swapped out: count it, then every value must appear once.
  env.Check(c.swap >= 1 && c.swap <= swapTotal, "final swap value %" PRIu64 " in [1, %" PRIu64 "]",
            c.swap, swapTotal);
  if (c.swap <= swapTotal) {
    uint32_t one = 0;
    TEST_CHECK_GPU(gpuMemcpy(&one, a.seenSwap + c.swap, sizeof(one), gpuMemcpyDeviceToHost));
    one += 1;
    TEST_CHECK_GPU(gpuMemcpy(a.seenSwap + c.swap, &one, sizeof(one), gpuMemcpyHostToDevice));
  }
  CheckPermutation(env, "swap: values swapped out + final value", a.seenSwap, swapTotal + 1);

  for (int q = 0; q < n; q++) {
    const bool ok = c.set64[q] == SetValue(q, env.rank, 0) &&
                    c.set32[q] == uint32_t(SetValue(q, env.rank, 1)) &&
                    c.seti64[q] == int64_t(SetValue(q, env.rank, 2)) &&
                    c.seti32[q] == int32_t(SetValue(q, env.rank, 3));
    env.Check(ok, "ShmemAtomicSet of all 4 types from pe %d", q);
  }
  FetchKernel<<<1, 64, 0, stream>>>(ctx, a, log.Get());
  TEST_CHECK_GPU(gpuGetLastError());
  ShmemStreamSynchronize(stream);
  env.Check(log.Count() == 0, "atomics kernels: %u device check failures", log.Count());

  ShmemBarrierAll();
  ShmemFree(a.c);
  ShmemFree(a.seen32);
  ShmemFree(a.seen64);
  ShmemFree(a.seenSwap);
  TEST_CHECK_GPU(gpuStreamDestroy(stream));
}

}  // namespace

int main(int argc, char** argv) { return RunOnAllGpus(argc, argv, "shmem_atomic_test", RunBody); }

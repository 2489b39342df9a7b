// Device barrier, one process per GPU: 10,000 ShmemBarrierAllBlock in one kernel, 10,000
// ShmemBarrierAllThread in one kernel, and 1,000 kernel launches separated by
// ShmemBarrierOnStream. Before barrier i every PE writes i into its slot on every peer; after it,
// every slot must hold i or i+1 (a peer may already be in iteration i+1, never further): a
// barrier that releases early shows up as a value < i, a PE that runs ahead as a value > i+1.
#include <chrono>
#include <cinttypes>
#include <vector>

#include "gpu_test_harness.hpp"
#include "mori/shmem/shmem_device_api.hpp"

using namespace mori;
using namespace mori::shmem;
using namespace mori::test;

namespace {

constexpr int kLoopIters = 10000;
constexpr int kLaunchIters = 1000;
constexpr int kBlockThreads = 128;

struct Result {
  unsigned long long badCount;  // slots outside [i, i+1]
  unsigned long long firstIter;
  long long firstPe;
  unsigned long long firstValue;
  unsigned long long completed;  // barriers that returned true
};

__device__ void RecordBad(Result* r, uint64_t iter, int pe, uint64_t v) {
  if (atomicAdd(&r->badCount, 1ull) == 0) {
    r->firstIter = iter;
    r->firstPe = pe;
    r->firstValue = v;
  }
}

__device__ void CheckSlot(const ShmemDeviceContext& ctx, uint64_t* slots, int q, uint64_t val,
                          Result* r) {
  const uint64_t v = core::AtomicLoadRelaxedSystem(&slots[q]);
  if (v < val || v > val + 1) {
    RecordBad(r, val, q, v);
    if (r->badCount <= 4)
      printf("[rank %d] barrier check: after barrier for value %llu, slot of pe %d holds %llu\n",
             ctx.rank, (unsigned long long)val, q, (unsigned long long)v);
  }
}

// One block; threads p < n write to / check PE p.
__global__ void __launch_bounds__(kBlockThreads)
    BlockLoopKernel(ShmemDeviceContext ctx, uint64_t* slots, uint64_t base, int iters, Result* r) {
  const int n = ctx.worldSize, me = ctx.rank, t = static_cast<int>(threadIdx.x);
  for (int i = 1; i <= iters; i++) {
    const uint64_t val = base + uint64_t(i);
    for (int p = t; p < n; p += blockDim.x)
      ShmemPutTypeNbiThread<uint64_t>(ctx, &slots[me], val, p);
    if (!ShmemBarrierAllBlock(ctx)) {
      if (t == 0) printf("[rank %d] ShmemBarrierAllBlock failed at iteration %d\n", me, i);
      return;
    }
    if (t == 0) r->completed++;
    for (int q = t; q < n; q += blockDim.x) CheckSlot(ctx, slots, q, val, r);
  }
}

// One thread does everything.
__global__ void ThreadLoopKernel(ShmemDeviceContext ctx, uint64_t* slots, uint64_t base, int iters,
                                 Result* r) {
  const int n = ctx.worldSize, me = ctx.rank;
  for (int i = 1; i <= iters; i++) {
    const uint64_t val = base + uint64_t(i);
    for (int p = 0; p < n; p++) ShmemPutTypeNbiThread<uint64_t>(ctx, &slots[me], val, p);
    if (!ShmemBarrierAllThread(ctx)) {
      printf("[rank %d] ShmemBarrierAllThread failed at iteration %d\n", me, i);
      return;
    }
    r->completed++;
    for (int q = 0; q < n; q++) CheckSlot(ctx, slots, q, val, r);
  }
}

__global__ void WriteKernel(ShmemDeviceContext ctx, uint64_t* slots, uint64_t val) {
  const int p = static_cast<int>(threadIdx.x);
  if (p < ctx.worldSize) ShmemPutTypeNbiThread<uint64_t>(ctx, &slots[ctx.rank], val, p);
}
__global__ void CheckKernel(ShmemDeviceContext ctx, uint64_t* slots, uint64_t val, Result* r) {
  const int q = static_cast<int>(threadIdx.x);
  if (q == 0) r->completed++;
  if (q < ctx.worldSize) CheckSlot(ctx, slots, q, val, r);
}

bool Verify(RankEnv& env, const char* what, Result* dev, unsigned long long wantCompleted,
            double seconds) {
  Result h{};
  TEST_CHECK_GPU(gpuMemcpy(&h, dev, sizeof(h), gpuMemcpyDeviceToHost));
  env.Log("%s: %llu barriers in %.3f s (%.2f us each)", what, h.completed, seconds,
          h.completed ? seconds * 1e6 / double(h.completed) : 0.0);
  bool ok = env.Check(h.completed == wantCompleted, "%s: %llu of %llu barriers completed", what,
                      h.completed, wantCompleted);
  ok &= env.Check(h.badCount == 0,
                  "%s: %llu slot checks outside [i, i+1] (first: value %llu, pe %lld holds %llu)",
                  what, h.badCount, h.firstIter, h.firstPe, h.firstValue);
  TEST_CHECK_GPU(gpuMemset(dev, 0, sizeof(Result)));
  return ok;
}

void RunBody(RankEnv& env) {
  const int n = env.npes;
  const ShmemDeviceContext ctx = ShmemGetDeviceContext();
  gpuStream_t stream;
  TEST_CHECK_GPU(gpuStreamCreateWithFlags(&stream, gpuStreamNonBlocking));
  auto* slots = static_cast<uint64_t*>(ShmemMalloc(n * sizeof(uint64_t)));
  TEST_CHECK_GPU(gpuMemset(slots, 0, n * sizeof(uint64_t)));
  Result* r = nullptr;
  TEST_CHECK_GPU(gpuMalloc(reinterpret_cast<void**>(&r), sizeof(Result)));
  TEST_CHECK_GPU(gpuMemset(r, 0, sizeof(Result)));
  ShmemBarrierAll();
  using Clock = std::chrono::steady_clock;
  uint64_t base = 0;

  // 1. Block variant, looped inside one kernel.
  auto t0 = Clock::now();
  BlockLoopKernel<<<1, kBlockThreads, 0, stream>>>(ctx, slots, base, kLoopIters, r);
  TEST_CHECK_GPU(gpuGetLastError());
  ShmemStreamSynchronize(stream);
  Verify(env, "ShmemBarrierAllBlock x10000 in one kernel", r, kLoopIters,
         std::chrono::duration<double>(Clock::now() - t0).count());
  base += kLoopIters;
  ShmemBarrierAll();

  // 2. Thread variant, looped inside one kernel (continues the epochs of 1).
  t0 = Clock::now();
  ThreadLoopKernel<<<1, 1, 0, stream>>>(ctx, slots, base, kLoopIters, r);
  TEST_CHECK_GPU(gpuGetLastError());
  ShmemStreamSynchronize(stream);
  Verify(env, "ShmemBarrierAllThread x10000 in one kernel", r, kLoopIters,
         std::chrono::duration<double>(Clock::now() - t0).count());
  base += kLoopIters;
  ShmemBarrierAll();

  // 3. Kernel launches separated by ShmemBarrierOnStream, all enqueued without host syncs.
  t0 = Clock::now();
  const int threads = ((n + core::kWarpSize - 1) / core::kWarpSize) * core::kWarpSize;
  for (int i = 1; i <= kLaunchIters; i++) {
    WriteKernel<<<1, threads, 0, stream>>>(ctx, slots, base + uint64_t(i));
    ShmemBarrierOnStream(stream);
    CheckKernel<<<1, threads, 0, stream>>>(ctx, slots, base + uint64_t(i), r);
  }
  TEST_CHECK_GPU(gpuGetLastError());
  ShmemStreamSynchronize(stream);
  Verify(env, "1000 launches with ShmemBarrierOnStream", r, kLaunchIters,
         std::chrono::duration<double>(Clock::now() - t0).count());
  base += kLaunchIters;

  // 4. Mixed: the device barrier after a host barrier still agrees on epochs.
  ShmemBarrierAll();
  BlockLoopKernel<<<1, kBlockThreads, 0, stream>>>(ctx, slots, base, 10, r);
  TEST_CHECK_GPU(gpuGetLastError());
  ShmemStreamSynchronize(stream);
  Verify(env, "ShmemBarrierAllBlock x10 after the others", r, 10, 0.0);

  // The arrival counter has exactly (barriers so far) * n arrivals once everyone is done.
  ShmemBarrierAll();
  uint64_t arrivals = 0, epoch = 0;
  TEST_CHECK_GPU(gpuMemcpy(&arrivals, ctx.syncArea + kSyncWordDeviceBarrier, sizeof(arrivals),
                           gpuMemcpyDeviceToHost));
  TEST_CHECK_GPU(gpuMemcpy(&epoch, ctx.barrierEpoch, sizeof(epoch), gpuMemcpyDeviceToHost));
  // At least the barriers above (the host API may use the device barrier too); once every PE is
  // idle, all have the same epoch and this PE has seen exactly epoch * n arrivals.
  const uint64_t barriers = 2ull * kLoopIters + kLaunchIters + 10;
  env.Check(epoch >= barriers, "device barrier epoch %" PRIu64 ", want >= %" PRIu64, epoch,
            barriers);
  env.Check(arrivals == epoch * uint64_t(n),
            "device barrier arrivals %" PRIu64 ", want epoch * n = %" PRIu64, arrivals,
            epoch * uint64_t(n));

  (void)gpuFree(r);
  ShmemFree(slots);
  TEST_CHECK_GPU(gpuStreamDestroy(stream));
}

}  // namespace

int main(int argc, char** argv) { return RunOnAllGpus(argc, argv, "shmem_barrier_test", RunBody); }

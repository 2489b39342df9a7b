// Init / finalize 20 times in one process per GPU, each time using the heap (malloc, a P2P put
// to every peer, device and host barriers). Free GPU memory and open file descriptors, measured
// after the first cycle (the GPU context and the runtime's own descriptors exist by then), must
// not grow: less than 64 MiB and 4 descriptors of slack after the last cycle.
#include <cinttypes>
#include <vector>

#include "gpu_test_harness.hpp"
#include "mori/shmem/shmem_device_api.hpp"

using namespace mori;
using namespace mori::shmem;
using namespace mori::test;

namespace {

constexpr int kCycles = 20;
constexpr size_t kBytes = 1 << 20;
constexpr size_t kMemSlack = size_t{64} << 20;
constexpr int kFdSlack = 4;

// Block p puts this PE's buffer to PE p (slot me).
__global__ void PutAllKernel(ShmemDeviceContext ctx, uint8_t* recv, const uint8_t* src, int* ok) {
  const int pe = static_cast<int>(blockIdx.x);
  const bool r = ShmemPutMemBlock(ctx, recv + size_t(ctx.rank) * kBytes, src, kBytes, pe);
  if (threadIdx.x == 0 && !r) *ok = 0;
}

// One init / use / finalize cycle. Returns false if any check failed.
bool Cycle(RankEnv& env, int cycle, const shmem::UniqueId& id) {
  const int n = env.npes, me = env.rank;
  ShmemInitWithUniqueId(me, n, id);
  bool ok = env.Check(ShmemMyPe() == me && ShmemNPes() == n, "cycle %d: init gives pe %d of %d",
                      cycle, ShmemMyPe(), ShmemNPes());
  const ShmemDeviceContext ctx = ShmemGetDeviceContext();
  auto* recv = static_cast<uint8_t*>(ShmemMalloc(size_t(n) * kBytes));
  uint8_t* src = nullptr;
  int* flag = nullptr;
  TEST_CHECK_GPU(gpuMalloc(reinterpret_cast<void**>(&src), kBytes));
  TEST_CHECK_GPU(gpuMalloc(reinterpret_cast<void**>(&flag), sizeof(int)));
  std::vector<uint8_t> h(kBytes);
  FillPattern(h.data(), kBytes, SeedOf(me, cycle, 99));
  TEST_CHECK_GPU(gpuMemcpy(src, h.data(), kBytes, gpuMemcpyHostToDevice));
  const int one = 1;
  TEST_CHECK_GPU(gpuMemcpy(flag, &one, sizeof(int), gpuMemcpyHostToDevice));
  ShmemBarrierAll();
  PutAllKernel<<<n, 256>>>(ctx, recv, src, flag);
  TEST_CHECK_GPU(gpuGetLastError());
  ShmemBarrierOnStream(nullptr);
  ShmemStreamSynchronize(nullptr);
  ShmemBarrierAll();
  int flagHost = 0;
  TEST_CHECK_GPU(gpuMemcpy(&flagHost, flag, sizeof(int), gpuMemcpyDeviceToHost));
  ok &= env.Check(flagHost == 1, "cycle %d: puts returned true", cycle);
  int badPeers = 0;
  for (int p = 0; p < n; p++) {
    TEST_CHECK_GPU(gpuMemcpy(h.data(), recv + size_t(p) * kBytes, kBytes, gpuMemcpyDeviceToHost));
    if (FirstPatternMismatch(h.data(), kBytes, SeedOf(p, cycle, 99)) != kBytes) badPeers++;
  }
  ok &= env.Check(badPeers == 0, "cycle %d: data from %d of %d PEs wrong", cycle, badPeers, n);
  (void)gpuFree(src);
  (void)gpuFree(flag);
  ShmemFree(recv);
  ShmemFinalize();
  ok &= env.Check(!ShmemIsInitialized(), "cycle %d: finalized", cycle);
  return ok;
}

size_t FreeGpuMemory() {
  size_t freeBytes = 0, totalBytes = 0;
  TEST_CHECK_GPU(gpuMemGetInfo(&freeBytes, &totalBytes));
  return freeBytes;
}

void RunBody(RankEnv& env) {
  // The parent's id is for the first cycle; every later cycle needs a fresh one.
  Cycle(env, 0, env.FirstUniqueId());
  TEST_CHECK_GPU(gpuDeviceSynchronize());
  const size_t mem0 = FreeGpuMemory();
  const int fds0 = CountOpenFds();
  env.Log("after cycle 0: %.1f MiB GPU memory free, %d open fds", mem0 / 1048576.0, fds0);
  int failedCycles = 0;
  for (int c = 1; c < kCycles; c++) {
    if (!Cycle(env, c, env.NextUniqueId())) failedCycles++;
  }
  TEST_CHECK_GPU(gpuDeviceSynchronize());
  const size_t mem1 = FreeGpuMemory();
  const int fds1 = CountOpenFds();
  env.Log("after cycle %d: %.1f MiB GPU memory free, %d open fds", kCycles - 1, mem1 / 1048576.0,
          fds1);
  env.Check(failedCycles == 0, "%d init/finalize cycles, %d failed", kCycles, failedCycles);
  const long long lost = static_cast<long long>(mem0) - static_cast<long long>(mem1);
  env.Check(lost < static_cast<long long>(kMemSlack),
            "free GPU memory shrank by %.1f MiB over %d cycles (limit %zu MiB)", lost / 1048576.0,
            kCycles - 1, kMemSlack >> 20);
  env.Check(fds1 - fds0 < kFdSlack, "open fds grew by %d over %d cycles (limit %d)", fds1 - fds0,
            kCycles - 1, kFdSlack);
}

}  // namespace

int main(int argc, char** argv) {
  // A small heap keeps 20 cycles quick; a leak of a whole heap still shows.
  setenv("MORI_SHMEM_HEAP_SIZE", "256M", 0);
  Options opt;
  opt.initShmem = false;  // the body initialises and finalises itself
  return RunOnAllGpus(argc, argv, "shmem_init_finalize_test", RunBody, opt);
}

// Does a cudaMemcpyAsync run while kernels hold every SM of the GPUs? (CUDA only, sm_90;
// standalone, not part of the CMake build.) The RDMA emulator moves RDMA WRITEs with
// cudaMemcpyAsync on a high-priority non-blocking stream while EP kernels spin waiting for them:
// if such a copy needs an SM (a copy kernel rather than the copy engine), a grid holding every SM
// of the GPU starves it. Each case: a spinner grid (two 1024-thread blocks per SM with 100 KB of
// shared memory each: every thread slot of the SM taken, so no other block fits) fills GPU 0
// and/or GPU 1 and waits on a host-mapped flag (at most 3 s, by the GPU clock);
// once every block is resident a 4 MiB copy is enqueued on a high-priority non-blocking stream of
// GPU 0 and polled for up to 500 ms; then the spinners are released. Prints one line per case.
// "batch+hint": the same copy through cudaMemcpyBatchAsync with
// cudaMemcpyFlagPreferOverlapWithCompute (CUDA 12.8+; CUDA 13's signature), the documented way to
// ask for a copy that overlaps compute. Results: docs/performance.md, "Copies beside full GPUs".
//
// clang-format off
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/copy_beside_spin_probe tools/bench/copy_beside_spin_probe.cu
//   /tmp/copy_beside_spin_probe        # uses GPUs 0 and 1 when there are two
// clang-format on
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <cuda_runtime.h>

#include "cuda_probe_check.hpp"

constexpr size_t kCopyBytes = 4u << 20;
constexpr int kSpinSmem = 100 * 1024;
constexpr int kSpinThreads = 1024;
constexpr int kSpinBlocksPerSm = 2;

__device__ __forceinline__ uint64_t GlobalTimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__global__ void __launch_bounds__(kSpinThreads)
    Spin(volatile int* release, int* started, uint64_t maxNs) {
  extern __shared__ char smem[];
  if (threadIdx.x == 0) {
    atomicAdd_system(started, 1);
    const uint64_t t0 = GlobalTimer();
    while (*release == 0 && GlobalTimer() - t0 < maxNs) {
    }
  }
  smem[threadIdx.x] = 1;
  __syncthreads();
}

struct Spinner {
  int dev, sms;
  int* started;  // host-mapped
  cudaStream_t s;
  void Start(volatile int* release, int blocks) {
    CK(cudaSetDevice(dev));
    *started = 0;
    int* startedDev;
    CK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&startedDev), started, 0));
    int* relDev;
    CK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&relDev), const_cast<int*>(release), 0));
    Spin<<<blocks, kSpinThreads, kSpinSmem, s>>>(relDev, startedDev, 3000000000ull);
    CK(cudaGetLastError());
  }
  bool AllIn(int blocks) {
    for (int i = 0; i < 2000; i++) {
      if (*reinterpret_cast<volatile int*>(started) >= blocks) return true;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    return false;
  }
};

int main() {
  int n = 0;
  CK(cudaGetDeviceCount(&n));
  const bool two = n >= 2;
  int* release;
  CK(cudaHostAlloc(reinterpret_cast<void**>(&release), sizeof(int), cudaHostAllocMapped));
  Spinner sp[2];
  void* buf[2][2] = {};
  for (int d = 0; d < (two ? 2 : 1); d++) {
    CK(cudaSetDevice(d));
    CK(cudaFuncSetAttribute(Spin, cudaFuncAttributeMaxDynamicSharedMemorySize, kSpinSmem));
    CK(cudaDeviceGetAttribute(&sp[d].sms, cudaDevAttrMultiProcessorCount, d));
    sp[d].dev = d;
    CK(cudaHostAlloc(reinterpret_cast<void**>(&sp[d].started), sizeof(int), cudaHostAllocMapped));
    CK(cudaStreamCreateWithFlags(&sp[d].s, cudaStreamNonBlocking));
    CK(cudaMalloc(&buf[d][0], kCopyBytes));
    CK(cudaMalloc(&buf[d][1], kCopyBytes));
    if (two) {
      int can = 0;
      CK(cudaDeviceCanAccessPeer(&can, d, 1 - d));
      if (can) CK(cudaDeviceEnablePeerAccess(1 - d, 0));
    }
  }
  CK(cudaSetDevice(0));
  int least = 0, greatest = 0;
  CK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t hp;
  CK(cudaStreamCreateWithPriority(&hp, cudaStreamNonBlocking, greatest));

  struct Case {
    const char* name;
    int dstDev;    // copy GPU 0 buffer -> this GPU's buffer
    int freeSms0;  // SMs the GPU 0 spinner leaves free (-1: no spinner)
    int freeSms1;  // the same on GPU 1
    bool batch;    // cudaMemcpyBatchAsync with cudaMemcpyFlagPreferOverlapWithCompute
  };
  const Case cases[] = {
      {"no spinner (reference)", 0, -1, -1, false},
      {"same GPU, every SM full", 0, 0, -1, false},
      {"same GPU, one SM free", 0, 1, -1, false},
      {"peer GPU 0 -> 1, GPU 0 full", 1, 0, -1, false},
      {"peer GPU 0 -> 1, GPU 1 full", 1, -1, 0, false},
      {"peer GPU 0 -> 1, both full", 1, 0, 0, false},
      {"peer GPU 0 -> 1, both one SM free", 1, 1, 1, false},
      {"batch+hint: no spinner (reference)", 0, -1, -1, true},
      {"batch+hint: same GPU, every SM full", 0, 0, -1, true},
      {"batch+hint: peer GPU 0 -> 1, both full", 1, 0, 0, true},
  };
  printf("%-48s %10s %s\n", "case", "copy ms",
         "(4 MiB, high-priority non-blocking stream of GPU 0)");
  for (const Case& c : cases) {
    if ((c.dstDev == 1 || c.freeSms1 >= 0) && !two) continue;
    *release = 0;
    bool in = true;
    const int fr[2] = {c.freeSms0, c.freeSms1};
    for (int d = 0; d < 2; d++) {
      if (fr[d] < 0) continue;
      const int blocks = kSpinBlocksPerSm * (sp[d].sms - fr[d]);
      sp[d].Start(release, blocks);
      in = sp[d].AllIn(blocks) && in;
    }
    CK(cudaSetDevice(0));
    const auto t0 = std::chrono::steady_clock::now();
    if (c.batch) {
      cudaMemcpyAttributes attr{};
      attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
      size_t attrIdx = 0, size = kCopyBytes;
      void* dst = buf[c.dstDev][1];
      const void* src = buf[0][0];
      CK(cudaMemcpyBatchAsync(&dst, &src, &size, 1, &attr, &attrIdx, 1, hp));
    } else {
      CK(cudaMemcpyAsync(buf[c.dstDev][1], buf[0][0], kCopyBytes, cudaMemcpyDefault, hp));
    }
    double ms = -1;
    while (true) {
      const cudaError_t q = cudaStreamQuery(hp);
      const double el =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (q == cudaSuccess) {
        ms = el;
        break;
      }
      if (q != cudaErrorNotReady) CK(q);
      if (el > 500) break;
    }
    *release = 1;
    for (int d = 0; d < (two ? 2 : 1); d++) {
      CK(cudaSetDevice(d));
      CK(cudaDeviceSynchronize());
    }
    CK(cudaSetDevice(0));
    CK(cudaStreamSynchronize(hp));
    if (ms < 0)
      printf("%-48s %10s%s\n", c.name, "> 500", in ? "" : "  (spinners not all resident)");
    else
      printf("%-48s %10.3f%s\n", c.name, ms, in ? "" : "  (spinners not all resident)");
  }
  return 0;
}

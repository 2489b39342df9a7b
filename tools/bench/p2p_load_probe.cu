// NVLink remote-load probe (CUDA only, sm_90; standalone, not part of the CMake build): how many
// bytes per second one GPU can pull from a peer while the peer pulls from it, by the way the loads
// are issued: 16-byte register loads (4, 8, 16 in flight per thread), cp.async into shared
// memory, and bulk copies (TMA, cp.async.bulk on an mbarrier) of 2-4 KB per warp. 512 threads per
// block, 8 / 16 / 24 / 132 blocks; the copy engine (peer memcpy both ways) as the reference.
// It only reads (a dummy checksum keeps the loads alive), so there is no result to verify.
// Figures (2x H200) and their use: docs/performance.md, "Combine loads in flight".
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/p2p_load_probe tools/bench/p2p_load_probe.cu
//   /tmp/p2p_load_probe            # GPUs 0 and 1
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>

#include "cuda_probe_check.hpp"

constexpr size_t kBytes = 256ull << 20;

template <int U>
__global__ void __launch_bounds__(512)
    RegLoad(const uint4* __restrict__ src, size_t nvec, uint32_t* out) {
  const size_t per = nvec / gridDim.x;
  const uint4* s = src + per * blockIdx.x;
  uint32_t acc = 0;
  for (size_t v = threadIdx.x; v + (U - 1) * blockDim.x < per; v += U * blockDim.x) {
    uint4 r[U];
#pragma unroll
    for (int u = 0; u < U; u++) r[u] = s[v + u * blockDim.x];
#pragma unroll
    for (int u = 0; u < U; u++) acc ^= r[u].x ^ r[u].y ^ r[u].z ^ r[u].w;
  }
  if (acc == 0x12345678u) out[0] = acc;
}

__device__ __forceinline__ void CpAsync16(void* smem, const void* g) {
  unsigned sa = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa), "l"(g) : "memory");
}
__device__ __forceinline__ void CpCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void CpWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// S stages of U 16-byte loads per thread, in dynamic smem [S][U][blockDim].
template <int S, int U>
__global__ void __launch_bounds__(512)
    CpAsyncLoad(const uint4* __restrict__ src, size_t nvec, uint32_t* out) {
  extern __shared__ uint4 sm[];
  const size_t per = nvec / gridDim.x;
  const uint4* s = src + per * blockIdx.x;
  const int T = blockDim.x, t = threadIdx.x;
  const size_t stepVec = static_cast<size_t>(U) * T;
  const size_t steps = per / stepVec;
  uint32_t acc = 0;
  auto issue = [&](size_t st) {
    if (st < steps) {
      uint4* b = sm + (st % S) * U * T;
#pragma unroll
      for (int u = 0; u < U; u++) CpAsync16(&b[u * T + t], &s[st * stepVec + u * T + t]);
    }
    CpCommit();
  };
  for (int i = 0; i < S - 1; i++) issue(i);
  for (size_t st = 0; st < steps; st++) {
    issue(st + S - 1);
    CpWait<S - 1>();
    const uint4* b = sm + (st % S) * U * T;
#pragma unroll
    for (int u = 0; u < U; u++) {
      uint4 r = b[u * T + t];
      acc ^= r.x ^ r.y ^ r.z ^ r.w;
    }
  }
  CpWait<0>();
  if (acc == 0x12345678u) out[0] = acc;
}

// TMA bulk: each warp's lane 0 streams chunks of C bytes into S smem stages; the warp reads them.
template <int S, int C>
__global__ void __launch_bounds__(512)
    TmaLoad(const uint8_t* __restrict__ src, size_t bytes, uint32_t* out) {
  extern __shared__ __align__(128) uint8_t smb[];
  __shared__ __align__(8) uint64_t bars[16][S];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
  const size_t per = bytes / gridDim.x / nw / C * C;  // per warp
  const uint8_t* s = src + (static_cast<size_t>(blockIdx.x) * nw + warp) * per;
  uint8_t* buf = smb + static_cast<size_t>(warp) * S * C;
  const size_t steps = per / C;
  if (lane == 0) {
    for (int i = 0; i < S; i++) {
      unsigned ba = static_cast<unsigned>(__cvta_generic_to_shared(&bars[warp][i]));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(ba));
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncwarp();
  auto issue = [&](size_t st) {
    if (lane == 0 && st < steps) {
      const int i = st % S;
      unsigned ba = static_cast<unsigned>(__cvta_generic_to_shared(&bars[warp][i]));
      unsigned da = static_cast<unsigned>(__cvta_generic_to_shared(buf + i * C));
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(ba), "r"(C)
                   : "memory");
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
          "[%3];\n" ::"r"(da),
          "l"(s + st * C), "r"(C), "r"(ba)
          : "memory");
    }
  };
  uint32_t acc = 0;
  for (int i = 0; i < S - 1; i++) issue(i);
  for (size_t st = 0; st < steps; st++) {
    issue(st + S - 1);
    const int i = st % S;
    const unsigned phase = (st / S) & 1;
    unsigned ba = static_cast<unsigned>(__cvta_generic_to_shared(&bars[warp][i]));
    uint32_t done = 0;
    while (!done) {
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, "
          "0, p; }\n"
          : "=r"(done)
          : "r"(ba), "r"(phase)
          : "memory");
    }
    const uint4* b = reinterpret_cast<const uint4*>(buf + i * C);
    for (int v = lane; v < C / 16; v += 32) {
      uint4 r = b[v];
      acc ^= r.x ^ r.y ^ r.z ^ r.w;
    }
    __syncwarp();  // everyone read stage i before lane 0 refills it
  }
  if (acc == 0x12345678u) out[0] = acc;
}

struct Gpu {
  uint4* buf;
  uint32_t* out;
  cudaStream_t st;
  cudaEvent_t a, b;
};

template <typename F>
double Run(std::vector<Gpu>& g, F launch, int reps) {
  float worst = 0;
  for (int it = 0; it < 2; it++) {  // warm-up, then timed
    for (int d = 0; d < 2; d++) {
      CK(cudaSetDevice(d));
      CK(cudaEventRecord(g[d].a, g[d].st));
      for (int r = 0; r < reps; r++) launch(d, g[1 - d].buf, g[d]);
      CK(cudaEventRecord(g[d].b, g[d].st));
    }
    for (int d = 0; d < 2; d++) {
      CK(cudaSetDevice(d));
      CK(cudaEventSynchronize(g[d].b));
      CK(cudaGetLastError());
    }
  }
  for (int d = 0; d < 2; d++) {
    float ms;
    CK(cudaSetDevice(d));
    CK(cudaEventElapsedTime(&ms, g[d].a, g[d].b));
    if (ms > worst) worst = ms;
  }
  return kBytes * reps / (worst * 1e-3) / 1e9;
}

int main() {
  std::vector<Gpu> g(2);
  for (int d = 0; d < 2; d++) {
    CK(cudaSetDevice(d));
    CK(cudaDeviceEnablePeerAccess(1 - d, 0));
    CK(cudaMalloc(&g[d].buf, kBytes));
    CK(cudaMemset(g[d].buf, d + 1, kBytes));
    CK(cudaMalloc(&g[d].out, 64));
    CK(cudaStreamCreate(&g[d].st));
    CK(cudaEventCreate(&g[d].a));
    CK(cudaEventCreate(&g[d].b));
    CK(cudaFuncSetAttribute(CpAsyncLoad<2, 8>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            200 << 10));
    CK(cudaFuncSetAttribute(CpAsyncLoad<3, 8>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            200 << 10));
    CK(cudaFuncSetAttribute(CpAsyncLoad<4, 4>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            200 << 10));
    CK(cudaFuncSetAttribute(TmaLoad<3, 4096>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            200 << 10));
    CK(cudaFuncSetAttribute(TmaLoad<2, 4096>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            200 << 10));
    CK(cudaFuncSetAttribute(TmaLoad<4, 2048>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            200 << 10));
  }
  const size_t nvec = kBytes / 16;
  const int reps = 5;
  printf("%-28s %8s %8s %8s %8s\n", "remote loads, GB/s per GPU", "8 blk", "16 blk", "24 blk",
         "132 blk");
  auto row = [&](const char* name, auto launchB) {
    printf("%-28s", name);
    for (int nb : {8, 16, 24, 132})
      printf(" %8.1f", Run(
                           g, [&](int d, uint4* src, Gpu& me) { launchB(nb, src, me); }, reps));
    printf("\n");
    fflush(stdout);
  };
  row("regs U=4",
      [&](int nb, uint4* s, Gpu& m) { RegLoad<4><<<nb, 512, 0, m.st>>>(s, nvec, m.out); });
  row("regs U=8",
      [&](int nb, uint4* s, Gpu& m) { RegLoad<8><<<nb, 512, 0, m.st>>>(s, nvec, m.out); });
  row("regs U=16",
      [&](int nb, uint4* s, Gpu& m) { RegLoad<16><<<nb, 512, 0, m.st>>>(s, nvec, m.out); });
  row("cp.async S=2 U=8 (16/thr)", [&](int nb, uint4* s, Gpu& m) {
    CpAsyncLoad<2, 8><<<nb, 512, 2 * 8 * 512 * 16, m.st>>>(s, nvec, m.out);
  });
  row("cp.async S=3 U=8 (24/thr)", [&](int nb, uint4* s, Gpu& m) {
    CpAsyncLoad<3, 8><<<nb, 512, 3 * 8 * 512 * 16, m.st>>>(s, nvec, m.out);
  });
  row("cp.async S=4 U=4 (16/thr)", [&](int nb, uint4* s, Gpu& m) {
    CpAsyncLoad<4, 4><<<nb, 512, 4 * 4 * 512 * 16, m.st>>>(s, nvec, m.out);
  });
  row("tma S=2 C=4K/warp", [&](int nb, uint4* s, Gpu& m) {
    TmaLoad<2, 4096>
        <<<nb, 512, 16 * 2 * 4096, m.st>>>(reinterpret_cast<uint8_t*>(s), kBytes, m.out);
  });
  row("tma S=3 C=4K/warp", [&](int nb, uint4* s, Gpu& m) {
    TmaLoad<3, 4096>
        <<<nb, 512, 16 * 3 * 4096, m.st>>>(reinterpret_cast<uint8_t*>(s), kBytes, m.out);
  });
  row("tma S=4 C=2K/warp", [&](int nb, uint4* s, Gpu& m) {
    TmaLoad<4, 2048>
        <<<nb, 512, 16 * 4 * 2048, m.st>>>(reinterpret_cast<uint8_t*>(s), kBytes, m.out);
  });
  // local copy-engine reference: peer memcpy both ways at once
  printf("%-28s", "copy engine (peer memcpy)");
  printf(" %8.1f\n",
         Run(
             g,
             [&](int d, uint4* src, Gpu& me) {
               CK(cudaMemcpyAsync(me.buf, src, kBytes, cudaMemcpyDeviceToDevice, me.st));
             },
             reps));
  return 0;
}

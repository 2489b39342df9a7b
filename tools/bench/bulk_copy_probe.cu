// Row-copy probe (CUDA only, sm_90; standalone, not part of the CMake build): how fast a few SMs
// move the dispatch's rows, by the way they are copied: 16-byte register loads and stores (8 in
// flight per lane, as the dispatch's WarpCopyVectors), or bulk copies (the non-tensor form of
// TMA: cp.async.bulk global -> shared on an mbarrier, then shared -> global in a bulk group),
// STAGES chunks of CHUNK bytes in flight per warp. Rows of 7168 B (FP8 hidden 7168) and 14336 B
// (BF16), 4096 of them, row i to row i. Two cases: within GPU 0 (the dispatch's local copy), and
// GPUs 0 and 1 each storing into the other at once (its rows to a peer). 8 / 16 / 24 blocks.
// Each copy is checked once against its source (bytes equal). Figures (2x H200) and their use:
// docs/performance.md, "Bulk copies for the dispatch's rows?".
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -I tools/bench -o /tmp/bcp tools/bench/bulk_copy_probe.cu
//   /tmp/bcp            # GPUs 0 and 1 (one GPU: the local case only)
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cuda_runtime.h>

#include "cuda_probe_check.hpp"

constexpr int kRows = 4096;
constexpr int kUnroll = 8;

__global__ void __launch_bounds__(512)
    RegCopy(uint4* __restrict__ dst, const uint4* __restrict__ src, int rows, int rowVecs) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nWarps = blockDim.x / 32;
  const int per = (rows + gridDim.x - 1) / gridDim.x;
  const int r0 = per * blockIdx.x, r1 = min(rows, r0 + per);
  for (int r = r0 + warp; r < r1; r += nWarps) {
    const uint4* s = src + static_cast<size_t>(r) * rowVecs;
    uint4* d = dst + static_cast<size_t>(r) * rowVecs;
    for (int v0 = 0; v0 < rowVecs; v0 += kUnroll * 32) {
      uint4 x[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; u++) {
        const int v = v0 + lane + u * 32;
        if (v < rowVecs) x[u] = s[v];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; u++) {
        const int v = v0 + lane + u * 32;
        if (v < rowVecs) d[v] = x[u];
      }
    }
  }
}

__device__ __forceinline__ unsigned Smem(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// One lane per warp drives a pipeline of `stages` chunks of `chunk` bytes: load chunk j into stage
// j % stages, wait for it, store it, and refill the stage once the store has read it.
__global__ void __launch_bounds__(512)
    BulkCopy(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src, int rows, int rowBytes,
             int chunk, int stages) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nWarps = blockDim.x / 32;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem) + warp * 8;  // up to 8 stages
  uint8_t* buf = smem + nWarps * 64 + static_cast<size_t>(warp) * stages * chunk;
  if (lane == 0) {
    for (int s = 0; s < stages; s++)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(Smem(bars + s)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncwarp();
  if (lane != 0) return;
  const int per = (rows + gridDim.x - 1) / gridDim.x;
  const int r0 = per * blockIdx.x, r1 = min(rows, r0 + per);
  const int chunksPerRow = (rowBytes + chunk - 1) / chunk;
  // this warp's chunks: rows r0 + warp, + nWarps, ...; chunk index j -> (row, piece)
  int myRows = r1 > r0 + warp ? (r1 - r0 - warp + nWarps - 1) / nWarps : 0;
  const int n = myRows * chunksPerRow;
  auto where = [&](int j, size_t* off, unsigned* bytes) {
    const int row = r0 + warp + (j / chunksPerRow) * nWarps;
    const int piece = j % chunksPerRow;
    *off = static_cast<size_t>(row) * rowBytes + static_cast<size_t>(piece) * chunk;
    *bytes = static_cast<unsigned>(min(chunk, rowBytes - piece * chunk));
  };
  auto load = [&](int j) {
    size_t off;
    unsigned bytes;
    where(j, &off, &bytes);
    const int s = j % stages;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(Smem(bars + s)),
                 "r"(bytes)
                 : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
            "r"(Smem(buf + static_cast<size_t>(s) * chunk)),
        "l"(src + off), "r"(bytes), "r"(Smem(bars + s))
        : "memory");
  };
  for (int j = 0; j < stages && j < n; j++) load(j);
  for (int j = 0; j < n; j++) {
    const int s = j % stages;
    const unsigned phase = (j / stages) & 1;
    unsigned done = 0;
    while (!done)
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, "
          "0, p; }"
          : "=r"(done)
          : "r"(Smem(bars + s)), "r"(phase)
          : "memory");
    size_t off;
    unsigned bytes;
    where(j, &off, &bytes);
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + off),
                 "r"(Smem(buf + static_cast<size_t>(s) * chunk)), "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (j + stages < n) {
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      load(j + stages);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

struct Side {
  int dev;
  uint8_t *src, *dst;  // dst: on this GPU (local) or on the peer (remote)
  cudaStream_t stream;
};

int main() {
  int ngpu = 0;
  CK(cudaGetDeviceCount(&ngpu));
  const size_t maxBytes = static_cast<size_t>(kRows) * 14336;
  std::vector<uint8_t*> srcs(2, nullptr), dsts(2, nullptr);
  std::vector<cudaStream_t> streams(2);
  const int nDev = ngpu >= 2 ? 2 : 1;
  for (int d = 0; d < nDev; d++) {
    CK(cudaSetDevice(d));
    if (nDev == 2) CK(cudaDeviceEnablePeerAccess(1 - d, 0));
    CK(cudaMalloc(&srcs[d], maxBytes));
    CK(cudaMalloc(&dsts[d], maxBytes));
    CK(cudaStreamCreate(&streams[d]));
    std::vector<uint8_t> h(maxBytes);
    for (size_t i = 0; i < maxBytes; i++) h[i] = static_cast<uint8_t>((i * 2654435761u) >> 13) ^ d;
    CK(cudaMemcpy(srcs[d], h.data(), maxBytes, cudaMemcpyHostToDevice));
    CK(cudaFuncSetAttribute(BulkCopy, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));
  }
  struct Way {
    const char* name;
    int threads, chunk, stages;
  };
  const Way ways[] = {{"registers, 512 threads, 8 x 16 B per lane", 512, 0, 0},
                      {"bulk, 16 warps x 3 stages x 3.5 KB", 512, 3584, 3},
                      {"bulk, 16 warps x 2 stages x 7 KB", 512, 7168, 2},
                      {"bulk, 8 warps x 4 stages x 7 KB", 256, 7168, 4},
                      {"bulk, 4 warps x 6 stages x 7 KB", 128, 7168, 6}};
  const int blockCounts[] = {8, 16, 24};
  for (int remote = 0; remote < nDev; remote++) {
    for (int rowBytes : {7168, 14336}) {
      const size_t bytes = static_cast<size_t>(kRows) * rowBytes;
      printf("\n%s, rows of %d B (%.1f MB), GB/s per GPU (rows moved / time):\n",
             remote ? "GPUs 0 and 1 storing into each other" : "within GPU 0", rowBytes,
             bytes / 1e6);
      printf("| copy | 8 blocks | 16 | 24 |\n|---|---|---|---|\n");
      for (const Way& w : ways) {
        printf("| %s |", w.name);
        for (int nb : blockCounts) {
          const int sides = remote ? 2 : 1;
          auto launch = [&](int d) {
            uint8_t* to = remote ? dsts[1 - d] : dsts[d];
            CK(cudaSetDevice(d));
            if (w.chunk == 0) {
              RegCopy<<<nb, w.threads, 0, streams[d]>>>(reinterpret_cast<uint4*>(to),
                                                        reinterpret_cast<const uint4*>(srcs[d]),
                                                        kRows, rowBytes / 16);
            } else {
              const size_t sm = (w.threads / 32) * (64 + static_cast<size_t>(w.stages) * w.chunk);
              BulkCopy<<<nb, w.threads, sm, streams[d]>>>(to, srcs[d], kRows, rowBytes, w.chunk,
                                                          w.stages);
            }
            CK(cudaGetLastError());
          };
          // check once
          for (int d = 0; d < sides; d++) {
            uint8_t* to = remote ? dsts[1 - d] : dsts[d];
            CK(cudaSetDevice(remote ? 1 - d : d));
            CK(cudaMemset(to, 0xEE, bytes));
          }
          for (int d = 0; d < sides; d++) {
            CK(cudaSetDevice(remote ? 1 - d : d));
            CK(cudaDeviceSynchronize());
          }
          for (int d = 0; d < sides; d++) launch(d);
          for (int d = 0; d < sides; d++) {
            CK(cudaSetDevice(d));
            CK(cudaStreamSynchronize(streams[d]));
          }
          for (int d = 0; d < sides; d++) {
            std::vector<uint8_t> a(bytes), b(bytes);
            CK(cudaMemcpy(a.data(), srcs[d], bytes, cudaMemcpyDefault));
            CK(cudaMemcpy(b.data(), remote ? dsts[1 - d] : dsts[d], bytes, cudaMemcpyDefault));
            if (memcmp(a.data(), b.data(), bytes) != 0) {
              printf(" WRONG |");
              fflush(stdout);
              goto next;
            }
          }
          {
            const int reps = 20;
            std::vector<cudaEvent_t> e0(sides), e1(sides);
            for (int d = 0; d < sides; d++) {
              CK(cudaSetDevice(d));
              CK(cudaEventCreate(&e0[d]));
              CK(cudaEventCreate(&e1[d]));
              CK(cudaEventRecord(e0[d], streams[d]));
            }
            for (int r = 0; r < reps; r++)
              for (int d = 0; d < sides; d++) launch(d);
            float worst = 0;
            for (int d = 0; d < sides; d++) {
              CK(cudaSetDevice(d));
              CK(cudaEventRecord(e1[d], streams[d]));
              CK(cudaEventSynchronize(e1[d]));
              float ms = 0;
              CK(cudaEventElapsedTime(&ms, e0[d], e1[d]));
              worst = ms > worst ? ms : worst;
            }
            printf(" %.0f |", bytes * reps / (worst * 1e-3) / 1e9);
          }
        next:;
        }
        printf("\n");
        fflush(stdout);
      }
    }
  }
  return 0;
}

// Put bandwidth and latency between two GPUs over the shmem device API (P2P), against the copy
// engine's rate for the same bytes in the same run.
//
//   shmem_put_bench [--gpus A,B] [--min-size BYTES] [--max-size BYTES] [--blocks LIST]
//                   [--threads N] [--repeats N] [--latency-iters N] [--kernel-ms MS]
//
// Two processes (forked; PE 0 on GPU A sends, PE 1 on GPU B receives). Sizes: 8 B to 256 MiB,
// powers of 4 plus 1 MiB and the maximum. All times are GPU-event times, median of --repeats
// samples after a warm-up.
//
// Copy engine (CE), the reference: back-to-back gpuMemcpyAsync into PE 1's buffer through its P2P
// mapping, one per message ("CE per message"); also its asymptotic rate, one copy of the maximum
// size ("CE asymptotic").
//
// Table 1, "per launch": ONE message per kernel launch, back-to-back launches (each sample enough
// of them to last ~5 ms), so launch overhead is part of every message:
//   thread        ShmemPutMemThread, one thread
//   warp          ShmemPutMemWarp, one warp
//   block         ShmemPutMemBlock, one block of --threads
//   multi-warp    every warp of <blocks> blocks puts its own contiguous chunk (ShmemPutMemWarp)
//   multi-block   every block puts its own contiguous chunk (ShmemPutMemBlock)
// Table 2, "in-kernel, N messages per launch" (how device-initiated communication libraries
// measure put bandwidth): one launch performs N back-to-back messages of the size, each warp
// (multi-warp) or block (multi-block) putting its chunk every iteration, then one quiet of the
// scope (ShmemQuietWarp/Block) at the end; time per message = launch time / N (N chosen so a
// launch lasts ~--kernel-ms). Two flavours: "nbi" (ShmemPutMemNbi{Warp,Block}, completion only
// at the final quiet) and "blocking" (ShmemPutMem{Warp,Block}: every message completed before the
// next).
// Block counts: --blocks (default 16, 32, 64 and the SM count); the summary reports the best per
// size. Every variant's result is verified once per size after its timed runs. Latency: 8-byte
// ping-pong between the two PEs, one-way = round trip / 2, for put-with-signal, atomic set of a
// flag, and an immediate put of the flag. The target (>= 85% of the copy engine for messages of
// 1 MiB and more, warp and block scope) is evaluated on each table separately.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "mori/core/gpu_check.hpp"
#include "mori/core/gpu_count.hpp"
#include "mori/shmem/shmem_api.hpp"
#include "mori/shmem/shmem_device_api.hpp"

using namespace mori;
using namespace mori::shmem;

namespace {

enum class Variant : int {
  kCopyEngine,
  kThread,
  kWarp,
  kBlock,
  kMultiWarp,
  kMultiBlock,
  kLoopWarpNbi,
  kLoopBlockNbi,
  kLoopWarp,
  kLoopBlock
};

const char* VariantName(Variant v) {
  switch (v) {
    case Variant::kCopyEngine: return "copy-engine";
    case Variant::kThread: return "thread";
    case Variant::kWarp: return "warp";
    case Variant::kBlock: return "block";
    case Variant::kMultiWarp: return "multi-warp";
    case Variant::kMultiBlock: return "multi-block";
    case Variant::kLoopWarpNbi: return "multi-warp nbi";
    case Variant::kLoopBlockNbi: return "multi-block nbi";
    case Variant::kLoopWarp: return "multi-warp";
    case Variant::kLoopBlock: return "multi-block";
  }
  return "?";
}

struct Config {
  int gpus[2] = {0, 1};
  size_t minSize = 8;
  size_t maxSize = size_t{256} << 20;
  std::vector<int> blocks;  // empty: {16, 32, 64, SM count}
  int threads = 512;
  int repeats = 7;
  int latencyIters = 10000;
  double kernelMs = 2.0;  // target duration of one in-kernel launch
  // Per-scope size caps keep slow scopes from taking minutes.
  size_t threadCap = size_t{1} << 20;
  size_t warpCap = size_t{64} << 20;
};

// [begin, begin + len) of part `i` of `parts` equal, 16-byte aligned chunks of `bytes`.
__device__ __forceinline__ void Chunk(size_t bytes, size_t parts, size_t i, size_t& begin,
                                      size_t& len) {
  size_t chunk = (bytes + parts - 1) / parts;
  chunk = (chunk + 15) & ~size_t{15};
  begin = i * chunk;
  len = begin >= bytes ? 0 : (bytes - begin < chunk ? bytes - begin : chunk);
}

__global__ void PutThreadKernel(ShmemDeviceContext ctx, uint8_t* dst, const uint8_t* src,
                                size_t bytes, int pe) {
  ShmemPutMemThread(ctx, dst, src, bytes, pe);
}
__global__ void PutWarpKernel(ShmemDeviceContext ctx, uint8_t* dst, const uint8_t* src,
                              size_t bytes, int pe) {
  ShmemPutMemWarp(ctx, dst, src, bytes, pe);
}
__global__ void PutBlockKernel(ShmemDeviceContext ctx, uint8_t* dst, const uint8_t* src,
                               size_t bytes, int pe) {
  ShmemPutMemBlock(ctx, dst, src, bytes, pe);
}
__global__ void PutMultiWarpKernel(ShmemDeviceContext ctx, uint8_t* dst, const uint8_t* src,
                                   size_t bytes, int pe) {
  const size_t warps = size_t(gridDim.x) * core::WarpsPerBlock();
  const size_t w = size_t(blockIdx.x) * core::WarpsPerBlock() + core::WarpId();
  size_t begin, len;
  Chunk(bytes, warps, w, begin, len);
  if (len > 0) ShmemPutMemWarp(ctx, dst + begin, src + begin, len, pe);
}
__global__ void PutMultiBlockKernel(ShmemDeviceContext ctx, uint8_t* dst, const uint8_t* src,
                                    size_t bytes, int pe) {
  size_t begin, len;
  Chunk(bytes, gridDim.x, blockIdx.x, begin, len);
  if (len > 0) ShmemPutMemBlock(ctx, dst + begin, src + begin, len, pe);
}

// In-kernel loops: `iters` back-to-back messages of `bytes`, each warp / block putting its chunk
// every iteration, one scope quiet at the end.
template <bool kBlocking>
__global__ void LoopWarpKernel(ShmemDeviceContext ctx, uint8_t* dst, const uint8_t* src,
                               size_t bytes, int pe, int iters) {
  const size_t warps = size_t(gridDim.x) * core::WarpsPerBlock();
  const size_t w = size_t(blockIdx.x) * core::WarpsPerBlock() + core::WarpId();
  size_t begin, len;
  Chunk(bytes, warps, w, begin, len);
  if (len > 0) {
    for (int i = 0; i < iters; i++) {
      if constexpr (kBlocking) {
        ShmemPutMemWarp(ctx, dst + begin, src + begin, len, pe);
      } else {
        ShmemPutMemNbiWarp(ctx, dst + begin, src + begin, len, pe);
      }
    }
  }
  ShmemQuietWarp(ctx);
}
template <bool kBlocking>
__global__ void LoopBlockKernel(ShmemDeviceContext ctx, uint8_t* dst, const uint8_t* src,
                                size_t bytes, int pe, int iters) {
  size_t begin, len;
  Chunk(bytes, gridDim.x, blockIdx.x, begin, len);
  if (len > 0) {
    for (int i = 0; i < iters; i++) {
      if constexpr (kBlocking) {
        ShmemPutMemBlock(ctx, dst + begin, src + begin, len, pe);
      } else {
        ShmemPutMemNbiBlock(ctx, dst + begin, src + begin, len, pe);
      }
    }
  }
  ShmemQuietBlock(ctx);
}

__global__ void FillKernel(uint8_t* p, size_t bytes, uint32_t salt) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < bytes;
       i += size_t(gridDim.x) * blockDim.x)
    p[i] = static_cast<uint8_t>((i * 2654435761u + salt) >> 13);
}
__global__ void CompareKernel(const uint8_t* a, const uint8_t* b, size_t bytes,
                              unsigned long long* bad) {
  unsigned long long mine = 0;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < bytes;
       i += size_t(gridDim.x) * blockDim.x)
    mine += a[i] != b[i];
  if (mine) atomicAdd(bad, mine);
}

// Latency ping-pong: PE 0 sends, PE 1 answers; `iters` timed round trips after `warmup`.
__global__ void PingPongKernel(ShmemDeviceContext ctx, uint64_t* data, uint64_t* sig, int mode,
                               int warmup, int iters, uint64_t base, unsigned long long* elapsedNs,
                               int* ok) {
  if (threadIdx.x != 0) return;
  const int me = ctx.rank, peer = 1 - me;
  uint64_t t0 = 0;
  bool good = true;
  for (int i = 0; i < warmup + iters && good; i++) {
    if (i == warmup) t0 = core::WallClockNs();
    const uint64_t v = base + uint64_t(i) + 1;
    auto send = [&]() {
      switch (mode) {
        case 0:
          return ShmemPutMemSignalNbiThread(ctx, data, data + 1, sizeof(uint64_t), sig, v,
                                            SignalOp::kSet, peer);
        case 1: return ShmemAtomicSet<uint64_t>(ctx, sig, v, peer);
        default: return ShmemPutTypeNbiThread<uint64_t>(ctx, sig, v, peer);
      }
    };
    if (me == 0) {
      good = send() && ShmemSignalWaitUntil(ctx, sig, core::CmpOp::kGe, v, peer, "bench ping-pong");
    } else {
      good = ShmemSignalWaitUntil(ctx, sig, core::CmpOp::kGe, v, peer, "bench ping-pong") && send();
    }
  }
  *elapsedNs = core::WallClockNs() - t0;
  *ok = good ? 1 : 0;
}

class Timer {
 public:
  explicit Timer(gpuStream_t s) : stream(s) {
    MORI_CHECK_GPU(gpuEventCreate(&start));
    MORI_CHECK_GPU(gpuEventCreate(&stop));
  }
  ~Timer() {
    (void)gpuEventDestroy(start);
    (void)gpuEventDestroy(stop);
  }
  // Median microseconds per call of `op` (which enqueues one operation on the stream).
  // Median microseconds of ONE enqueue of `op` (one in-kernel launch), after one warm-up.
  double MedianLaunchUs(const std::function<void()>& op, int repeats) {
    op();
    std::vector<double> samples;
    for (int r = 0; r < repeats; r++) samples.push_back(Sample(op, 1));
    std::sort(samples.begin(), samples.end());
    return samples[samples.size() / 2];
  }
  double MedianUs(const std::function<void()>& op, int repeats) {
    op();
    op();  // warm-up
    double one = Sample(op, 1);
    int iters = one > 0 ? static_cast<int>(5000.0 / one) : 1000;  // ~5 ms per sample
    iters = std::max(1, std::min(iters, 1000));
    std::vector<double> samples;
    for (int r = 0; r < repeats; r++) samples.push_back(Sample(op, iters) / iters);
    std::sort(samples.begin(), samples.end());
    return samples[samples.size() / 2];
  }

 private:
  double Sample(const std::function<void()>& op, int iters) {
    MORI_CHECK_GPU(gpuEventRecord(start, stream));
    for (int i = 0; i < iters; i++) op();
    MORI_CHECK_GPU(gpuEventRecord(stop, stream));
    MORI_CHECK_GPU(gpuEventSynchronize(stop));
    MORI_CHECK_LAUNCH();
    float ms = 0;
    MORI_CHECK_GPU(gpuEventElapsedTime(&ms, start, stop));
    return ms * 1000.0;
  }
  gpuStream_t stream;
  gpuEvent_t start, stop;
};

std::string SizeText(size_t b) {
  char buf[32];
  if (b >= (size_t{1} << 20) && b % (size_t{1} << 20) == 0)
    std::snprintf(buf, sizeof(buf), "%zu MiB", b >> 20);
  else if (b >= 1024 && b % 1024 == 0)
    std::snprintf(buf, sizeof(buf), "%zu KiB", b >> 10);
  else
    std::snprintf(buf, sizeof(buf), "%zu B", b);
  return buf;
}

struct Row {
  size_t bytes;
  Variant v;
  int blocks;
  int threads;
  double us;  // per message
  int iters;  // messages per launch (1: per-launch table)
};

int RunPe(int rank, const Config& cfg, const UniqueId& id) {
  MORI_CHECK_GPU(gpuSetDevice(cfg.gpus[rank]));
  ShmemInitWithUniqueId(rank, 2, id);
  const ShmemDeviceContext ctx = ShmemGetDeviceContext();
  const int peer = 1 - rank;
  gpuStream_t stream;
  MORI_CHECK_GPU(gpuStreamCreateWithFlags(&stream, gpuStreamNonBlocking));

  auto* dst = static_cast<uint8_t*>(ShmemMalloc(cfg.maxSize));
  auto* pingData = static_cast<uint64_t*>(ShmemMalloc(2 * sizeof(uint64_t)));
  auto* pingSig = static_cast<uint64_t*>(ShmemMalloc(sizeof(uint64_t)));
  MORI_CHECK_GPU(gpuMemset(pingSig, 0, sizeof(uint64_t)));
  MORI_CHECK_GPU(gpuMemset(pingData, 0, 2 * sizeof(uint64_t)));
  uint8_t* src = nullptr;
  unsigned long long* bad = nullptr;
  unsigned long long* elapsed = nullptr;
  int* ok = nullptr;
  MORI_CHECK_GPU(gpuMalloc(reinterpret_cast<void**>(&src), cfg.maxSize));
  MORI_CHECK_GPU(gpuMalloc(reinterpret_cast<void**>(&bad), sizeof(unsigned long long)));
  MORI_CHECK_GPU(gpuMalloc(reinterpret_cast<void**>(&elapsed), sizeof(unsigned long long)));
  MORI_CHECK_GPU(gpuMalloc(reinterpret_cast<void**>(&ok), sizeof(int)));
  FillKernel<<<1024, 256, 0, stream>>>(src, cfg.maxSize, 0x1234u + rank);
  MORI_CHECK_LAUNCH();
  MORI_CHECK_GPU(gpuStreamSynchronize(stream));
  uint8_t* peerDst = static_cast<uint8_t*>(ShmemPtrP2p(dst, peer));
  if (peerDst == nullptr) {
    std::printf("PE %d: PE %d is not P2P-reachable (transport %s); nothing to measure\n", rank,
                peer, TransportTypeName(ShmemTransportType(peer)));
    ShmemFinalize();
    return 1;
  }

  int sms = 0;
  MORI_CHECK_GPU(gpuDeviceGetAttribute(&sms, gpuDevAttrMultiProcessorCount, cfg.gpus[rank]));
  std::vector<int> blockCounts = cfg.blocks;
  if (blockCounts.empty()) blockCounts = {16, 32, 64, sms};
  std::sort(blockCounts.begin(), blockCounts.end());
  blockCounts.erase(std::unique(blockCounts.begin(), blockCounts.end()), blockCounts.end());

  std::vector<size_t> sizes;
  for (size_t s = 8; s <= cfg.maxSize; s *= 4)
    if (s >= cfg.minSize) sizes.push_back(s);
  for (size_t s : {size_t{1} << 20, cfg.maxSize})
    if (s >= cfg.minSize && s <= cfg.maxSize &&
        std::find(sizes.begin(), sizes.end(), s) == sizes.end())
      sizes.push_back(s);
  std::sort(sizes.begin(), sizes.end());

  Timer timer(stream);
  std::vector<Row> rows;
  std::vector<double> ceUsBySize(sizes.size(), 0.0);
  double ceAsymGBs = 0;
  int verifyFailures = 0;

  size_t bytes = 0;  // the size being measured (captured by the helpers below)
  auto verify = [&](Variant v, int blocks, const std::function<void()>& op) {
    FillKernel<<<256, 256, 0, stream>>>(peerDst, bytes, 0xEEEEu);  // poison PE 1's buffer
    op();
    MORI_CHECK_GPU(gpuMemsetAsync(bad, 0, sizeof(unsigned long long), stream));
    CompareKernel<<<256, 256, 0, stream>>>(peerDst, src, bytes, bad);
    MORI_CHECK_LAUNCH();
    unsigned long long h = 0;
    MORI_CHECK_GPU(gpuMemcpyAsync(&h, bad, sizeof(h), gpuMemcpyDeviceToHost, stream));
    MORI_CHECK_GPU(gpuStreamSynchronize(stream));
    ShmemCheckDeviceError();
    if (h != 0) {
      verifyFailures++;
      std::printf("VERIFY FAILED: %s, %d blocks, %s: %llu bytes differ\n", VariantName(v), blocks,
                  SizeText(bytes).c_str(), h);
    }
  };
  auto ce = [&]() {
    MORI_CHECK_GPU(gpuMemcpyAsync(peerDst, src, bytes, gpuMemcpyDeviceToDevice, stream));
  };

  if (rank == 0) {
    std::printf(
        "shmem put bandwidth: PE 0 (GPU %d) -> PE 1 (GPU %d), %d SMs, %d repeats (median), "
        "%d threads per block\n",
        cfg.gpus[0], cfg.gpus[1], sms, cfg.repeats, cfg.threads);
    bytes = cfg.maxSize;
    const double us = timer.MedianUs(ce, cfg.repeats);
    ceAsymGBs = double(bytes) / (us * 1e3);
    std::printf("copy engine asymptotic rate (one %s gpuMemcpyAsync): %.2f GB/s\n",
                SizeText(bytes).c_str(), ceAsymGBs);
    std::printf(
        "\n[1] PER LAUNCH: one message per kernel launch (blocking ShmemPutMem*), back-to-back "
        "launches;\n    launch overhead is included in every message. CE = one gpuMemcpyAsync per "
        "message.\n");
    std::printf("%-10s | %-16s | %6s | %7s | %10s | %8s | %7s\n", "size", "scope", "blocks",
                "threads", "us/msg", "GB/s", "% of CE");
    std::fflush(stdout);
  }

  // ---- Table 1: per launch -------------------------------------------------------------------
  for (size_t si = 0; si < sizes.size(); si++) {
    bytes = sizes[si];
    ShmemBarrierAll();  // PE 1 idles at these while PE 0 measures
    if (rank != 0) continue;
    double ceUs = 0;
    auto report = [&](Variant v, int blocks, int threads, double us) {
      rows.push_back({bytes, v, blocks, threads, us, 1});
      const double gbs = double(bytes) / (us * 1e3);
      const double pct = ceUs > 0 ? 100.0 * ceUs / us : 100.0;
      std::printf("%-10s | %-16s | %6d | %7d | %10.2f | %8.2f | %6.1f%%\n", SizeText(bytes).c_str(),
                  VariantName(v), blocks, threads, us, gbs, pct);
      std::fflush(stdout);
    };

    ceUs = timer.MedianUs(ce, cfg.repeats);
    ceUsBySize[si] = ceUs;
    verify(Variant::kCopyEngine, 0, ce);
    report(Variant::kCopyEngine, 0, 0, ceUs);

    struct Launch {
      Variant v;
      int blocks;
      int threads;
      void (*kernel)(ShmemDeviceContext, uint8_t*, const uint8_t*, size_t, int);
    };
    std::vector<Launch> launches;
    if (bytes <= cfg.threadCap) launches.push_back({Variant::kThread, 1, 1, PutThreadKernel});
    if (bytes <= cfg.warpCap)
      launches.push_back({Variant::kWarp, 1, core::kWarpSize, PutWarpKernel});
    launches.push_back({Variant::kBlock, 1, cfg.threads, PutBlockKernel});
    for (int b : blockCounts)
      launches.push_back({Variant::kMultiWarp, b, cfg.threads, PutMultiWarpKernel});
    for (int b : blockCounts)
      launches.push_back({Variant::kMultiBlock, b, cfg.threads, PutMultiBlockKernel});
    for (const Launch& l : launches) {
      auto op = [&]() { l.kernel<<<l.blocks, l.threads, 0, stream>>>(ctx, dst, src, bytes, peer); };
      const double us = timer.MedianUs(op, cfg.repeats);
      verify(l.v, l.blocks, op);
      report(l.v, l.blocks, l.threads, us);
    }
  }

  // ---- Table 2: in-kernel, N messages per launch ---------------------------------------------
  if (rank == 0) {
    std::printf(
        "\n[2] IN-KERNEL: one launch performs N back-to-back messages (each warp/block puts its "
        "chunk per\n    message, one ShmemQuietWarp/Block at the end); us/msg = launch time / N. "
        "nbi = ShmemPutMemNbi*,\n    blocking = ShmemPutMem* (each message completed before the "
        "next). %% of CE: vs back-to-back\n    gpuMemcpyAsync per message (table 1); %% asym: "
        "vs the CE asymptotic %.2f GB/s.\n",
        ceAsymGBs);
    std::printf("%-10s | %-11s | %-8s | %6s | %7s | %6s | %10s | %8s | %7s | %7s\n", "size",
                "scope", "mode", "blocks", "threads", "N", "us/msg", "GB/s", "% of CE", "% asym");
    std::fflush(stdout);
  }
  for (size_t si = 0; si < sizes.size(); si++) {
    bytes = sizes[si];
    ShmemBarrierAll();
    if (rank != 0) continue;
    const double ceUs = ceUsBySize[si];
    struct Loop {
      Variant v;
      bool blocking;
      int blocks;
      void (*kernel)(ShmemDeviceContext, uint8_t*, const uint8_t*, size_t, int, int);
    };
    std::vector<Loop> loops;
    for (int b : blockCounts)
      loops.push_back({Variant::kLoopWarpNbi, false, b, LoopWarpKernel<false>});
    for (int b : blockCounts)
      loops.push_back({Variant::kLoopBlockNbi, false, b, LoopBlockKernel<false>});
    for (int b : blockCounts) loops.push_back({Variant::kLoopWarp, true, b, LoopWarpKernel<true>});
    for (int b : blockCounts)
      loops.push_back({Variant::kLoopBlock, true, b, LoopBlockKernel<true>});
    for (const Loop& l : loops) {
      int iters = 4;
      auto op = [&]() {
        l.kernel<<<l.blocks, cfg.threads, 0, stream>>>(ctx, dst, src, bytes, peer, iters);
      };
      // Pick N so one launch lasts ~kernelMs (4 <= N <= kMaxIters): grow N until the launch is
      // long enough that its fixed overhead does not skew the scaling, then scale.
      constexpr int kMaxIters = 100000;
      const double targetUs = cfg.kernelMs * 1e3;
      double t = timer.MedianLaunchUs(op, 1);
      while (t < 0.2 * targetUs && iters < kMaxIters) {
        iters = std::min(kMaxIters, iters * 8);
        t = timer.MedianLaunchUs(op, 1);
      }
      iters = static_cast<int>(std::max(4.0, std::min<double>(kMaxIters, iters * targetUs / t)));
      const double us = timer.MedianLaunchUs(op, cfg.repeats) / iters;
      verify(l.v, l.blocks, op);
      rows.push_back({bytes, l.v, l.blocks, cfg.threads, us, iters});
      const double gbs = double(bytes) / (us * 1e3);
      const bool warp = l.v == Variant::kLoopWarp || l.v == Variant::kLoopWarpNbi;
      std::printf("%-10s | %-11s | %-8s | %6d | %7d | %6d | %10.3f | %8.2f | %6.1f%% | %6.1f%%\n",
                  SizeText(bytes).c_str(), warp ? "multi-warp" : "multi-block",
                  l.blocking ? "blocking" : "nbi", l.blocks, cfg.threads, iters, us, gbs,
                  100.0 * ceUs / us, 100.0 * gbs / ceAsymGBs);
      std::fflush(stdout);
    }
  }

  // Latency: both PEs run the ping-pong kernel at once.
  const char* modeNames[] = {"put 8 B + signal (PutMemSignalNbiThread)",
                             "atomic set of a flag (AtomicSet)",
                             "immediate put of a flag (PutTypeNbiThread)"};
  uint64_t base = 0;
  const int warmup = 100;
  for (int mode = 0; mode < 3; mode++) {
    ShmemBarrierAll();
    PingPongKernel<<<1, 32, 0, stream>>>(ctx, pingData, pingSig, mode, warmup, cfg.latencyIters,
                                         base, elapsed, ok);
    MORI_CHECK_LAUNCH();
    ShmemStreamSynchronize(stream);
    base += uint64_t(warmup + cfg.latencyIters);
    unsigned long long ns = 0;
    int good = 0;
    MORI_CHECK_GPU(gpuMemcpy(&ns, elapsed, sizeof(ns), gpuMemcpyDeviceToHost));
    MORI_CHECK_GPU(gpuMemcpy(&good, ok, sizeof(good), gpuMemcpyDeviceToHost));
    if (rank == 0) {
      const double rtUs = double(ns) / 1e3 / cfg.latencyIters;
      std::printf("latency %-44s: round trip %7.3f us, one-way %7.3f us%s\n", modeNames[mode], rtUs,
                  rtUs / 2, good ? "" : "  (WAIT FAILED)");
      if (!good) verifyFailures++;
    }
  }

  if (rank == 0) {
    // Best (fastest) row of a set of variants at one size: per-message us (0: none measured).
    auto best = [&](size_t sz, const std::vector<Variant>& vs, int* blocksOut) {
      double us = 0;
      for (const Row& r : rows) {
        if (r.bytes != sz || std::find(vs.begin(), vs.end(), r.v) == vs.end()) continue;
        if (us == 0 || r.us < us) {
          us = r.us;
          if (blocksOut) *blocksOut = r.blocks;
        }
      }
      return us;
    };
    struct Class {
      const char* name;
      const char* shortName;
      std::vector<Variant> warp, block;
    };
    const Class classes[] = {
        {"[1] per launch (1 msg/launch, blocking)",
         "[1] per launch",
         {Variant::kWarp, Variant::kMultiWarp},
         {Variant::kBlock, Variant::kMultiBlock}},
        {"[2] in-kernel nbi (N msgs/launch)",
         "[2] in-kernel nbi",
         {Variant::kLoopWarpNbi},
         {Variant::kLoopBlockNbi}},
        {"[2] in-kernel blocking (N msgs/launch)",
         "[2] in-k. blocking",
         {Variant::kLoopWarp},
         {Variant::kLoopBlock}},
    };

    std::printf(
        "\nbest per size: %% of CE per message, (blocks) of the best configuration:\n%-10s | %8s",
        "size", "CE GB/s");
    for (const Class& c : classes) std::printf(" | %-21s", c.shortName);
    std::printf("\n%-10s | %8s", "", "");
    for (size_t i = 0; i < 3; i++) std::printf(" | %-10s %-10s", "warp", "block");
    std::printf("\n");
    for (size_t si = 0; si < sizes.size(); si++) {
      const double ceUs = ceUsBySize[si];
      std::printf("%-10s | %8.2f", SizeText(sizes[si]).c_str(), double(sizes[si]) / (ceUs * 1e3));
      for (const Class& c : classes) {
        std::printf(" |");
        for (int k = 0; k < 2; k++) {
          int blk = 0;
          const double us = best(sizes[si], k == 0 ? c.warp : c.block, &blk);
          char cell[32];
          std::snprintf(cell, sizeof(cell), "%.1f%%(%d)", us > 0 ? 100.0 * ceUs / us : 0.0, blk);
          std::printf(" %-10s", cell);
        }
      }
      std::printf("\n");
    }

    std::printf(
        "\ntarget: best warp-scope and block-scope put >= 85%% of the copy engine (back-to-back "
        "gpuMemcpyAsync per message) for >= 1 MiB, evaluated on each measurement separately:\n");
    for (const Class& c : classes) {
      for (int k = 0; k < 2; k++) {
        double worst = 1e9, worstAsym = 1e9;
        size_t worstSize = 0;
        for (size_t si = 0; si < sizes.size(); si++) {
          if (sizes[si] < (size_t{1} << 20)) continue;
          const double us = best(sizes[si], k == 0 ? c.warp : c.block, nullptr);
          const double pct = us > 0 ? 100.0 * ceUsBySize[si] / us : 0.0;
          const double asym = us > 0 ? 100.0 * double(sizes[si]) / (us * 1e3) / ceAsymGBs : 0.0;
          worstAsym = std::min(worstAsym, asym);
          if (pct < worst) {
            worst = pct;
            worstSize = sizes[si];
          }
        }
        if (worstSize != 0)
          std::printf(
              "  %-40s %s scope: worst %5.1f%% of CE (at %s): %-7s [vs CE asymptotic: "
              "worst %.1f%%]\n",
              c.name, k == 0 ? "warp " : "block", worst, SizeText(worstSize).c_str(),
              worst >= 85.0 ? "MET" : "NOT MET", worstAsym);
      }
    }
    std::printf("%s\n", verifyFailures == 0 ? "all results verified" : "SOME RESULTS WRONG");
  }

  ShmemBarrierAll();
  MORI_CHECK_GPU(gpuFree(src));
  MORI_CHECK_GPU(gpuFree(bad));
  MORI_CHECK_GPU(gpuFree(elapsed));
  MORI_CHECK_GPU(gpuFree(ok));
  ShmemFree(dst);
  ShmemFree(pingData);
  ShmemFree(pingSig);
  MORI_CHECK_GPU(gpuStreamDestroy(stream));
  ShmemFinalize();
  return verifyFailures == 0 ? 0 : 1;
}

size_t ParseSize(const char* s) {
  char* end = nullptr;
  double v = std::strtod(s, &end);
  switch (end && *end ? (*end | 0x20) : 0) {
    case 'k': v *= 1024; break;
    case 'm': v *= 1024 * 1024; break;
    case 'g': v *= 1024.0 * 1024 * 1024; break;
    default: break;
  }
  return static_cast<size_t>(v);
}

}  // namespace

int main(int argc, char** argv) {
  Config cfg;
  for (int i = 1; i < argc; i++) {
    const std::string a = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : nullptr;
    if (a == "--gpus" && v) {
      std::sscanf(v, "%d,%d", &cfg.gpus[0], &cfg.gpus[1]);
      i++;
    } else if (a == "--min-size" && v) {
      cfg.minSize = ParseSize(v);
      i++;
    } else if (a == "--max-size" && v) {
      cfg.maxSize = ParseSize(v);
      i++;
    } else if (a == "--blocks" && v) {
      cfg.blocks.clear();
      for (const char* p = v; *p;) {
        cfg.blocks.push_back(std::atoi(p));
        while (*p && *p != ',') p++;
        if (*p == ',') p++;
      }
      i++;
    } else if (a == "--threads" && v) {
      cfg.threads = std::atoi(v);
      i++;
    } else if (a == "--repeats" && v) {
      cfg.repeats = std::max(1, std::atoi(v));
      i++;
    } else if (a == "--latency-iters" && v) {
      cfg.latencyIters = std::max(1, std::atoi(v));
      i++;
    } else if (a == "--kernel-ms" && v) {
      cfg.kernelMs = std::max(0.1, std::atof(v));
      i++;
    } else {
      std::printf(
          "usage: %s [--gpus A,B] [--min-size B] [--max-size B] [--blocks N,N..] "
          "[--threads N] [--repeats N] [--latency-iters N] [--kernel-ms MS]\n",
          argv[0]);
      return a == "-h" || a == "--help" ? 0 : 2;
    }
  }
  if (cfg.threads <= 0 || cfg.threads % core::kWarpSize != 0 || cfg.threads > 1024) {
    std::printf("--threads must be a multiple of %d in (0, 1024]\n", core::kWarpSize);
    return 2;
  }
  std::string why;
  const int gpus = std::max(0, core::CountGpusInChildProcess(&why));
  if (gpus < 2 || cfg.gpus[0] == cfg.gpus[1] || std::max(cfg.gpus[0], cfg.gpus[1]) >= gpus ||
      std::min(cfg.gpus[0], cfg.gpus[1]) < 0) {
    std::printf(
        "SKIPPED: shmem_put_bench needs two distinct GPUs (found %d, asked for %d,%d%s%s)\n", gpus,
        cfg.gpus[0], cfg.gpus[1], why.empty() ? "" : "; ", why.c_str());
    return 77;
  }
  const UniqueId id = ShmemGetUniqueId();
  pid_t pids[2];
  for (int rank = 0; rank < 2; rank++) {
    pids[rank] = fork();
    if (pids[rank] == 0) {
      int rc = 1;
      try {
        rc = RunPe(rank, cfg, id);
      } catch (const std::exception& e) {
        std::printf("PE %d failed: %s\n", rank, e.what());
      }
      std::fflush(stdout);
      _exit(rc);
    }
  }
  bool good = true;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    good = good && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  return good ? 0 : 1;
}

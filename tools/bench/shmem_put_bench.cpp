// Put bandwidth and latency between two GPUs over the shmem device API (P2P), against the copy
// engine's rate for the same bytes in the same run.
//
//   shmem_put_bench [--gpus A,B] [--min-size BYTES] [--max-size BYTES] [--blocks LIST]
//                   [--threads N] [--repeats N] [--latency-iters N]
//
// Two processes (forked; PE 0 on GPU A sends, PE 1 on GPU B receives). For each size (8 B to
// 256 MiB, powers of 4 plus 1 MiB and the maximum) PE 0 times, with GPU events, a warm-up and the
// median of --repeats samples (each sample enough back-to-back operations to last ~5 ms):
//   copy-engine   gpuMemcpyAsync into PE 1's buffer through its P2P mapping
//   thread        ShmemPutMemThread, one thread
//   warp          ShmemPutMemWarp, one warp
//   block         ShmemPutMemBlock, one block of --threads
//   multi-warp    every warp of <blocks> blocks puts its own contiguous chunk (ShmemPutMemWarp)
//   multi-block   every block puts its own contiguous chunk (ShmemPutMemBlock)
// and prints size | scope | blocks | threads | us | GB/s | % of copy engine. Every variant's
// result is verified once per size. Latency: 8-byte ping-pong between the two PEs, one-way =
// round trip / 2, for put-with-signal, atomic set of a flag, and an immediate put of the flag.
// Multi-block scopes are how the device API reaches link speed: the target is >= 85% of the copy
// engine for messages of 1 MiB and more (printed at the end).
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
#include "mori/shmem/shmem_api.hpp"
#include "mori/shmem/shmem_device_api.hpp"

using namespace mori;
using namespace mori::shmem;

namespace {

enum class Variant : int { kCopyEngine, kThread, kWarp, kBlock, kMultiWarp, kMultiBlock };

const char* VariantName(Variant v) {
  switch (v) {
    case Variant::kCopyEngine:
      return "copy-engine";
    case Variant::kThread:
      return "thread";
    case Variant::kWarp:
      return "warp";
    case Variant::kBlock:
      return "block";
    case Variant::kMultiWarp:
      return "multi-warp";
    case Variant::kMultiBlock:
      return "multi-block";
  }
  return "?";
}

struct Config {
  int gpus[2] = {0, 1};
  size_t minSize = 8;
  size_t maxSize = size_t{256} << 20;
  std::vector<int> blocks;  // empty: {32, SM count}
  int threads = 512;
  int repeats = 7;
  int latencyIters = 10000;
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
        case 1:
          return ShmemAtomicSet<uint64_t>(ctx, sig, v, peer);
        default:
          return ShmemPutTypeNbiThread<uint64_t>(ctx, sig, v, peer);
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
  double us;
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
  if (blockCounts.empty()) blockCounts = {32, sms};

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
  int verifyFailures = 0;
  if (rank == 0) {
    std::printf(
        "shmem put bandwidth: PE 0 (GPU %d) -> PE 1 (GPU %d), %d SMs, %d repeats (median)\n",
        cfg.gpus[0], cfg.gpus[1], sms, cfg.repeats);
    std::printf("%-10s | %-12s | %6s | %7s | %10s | %8s | %7s\n", "size", "scope", "blocks",
                "threads", "us", "GB/s", "% of CE");
    std::fflush(stdout);
  }
  for (size_t bytes : sizes) {
    ShmemBarrierAll();  // PE 1 idles at these while PE 0 measures
    if (rank != 0) continue;
    double ceUs = 0;
    auto report = [&](Variant v, int blocks, int threads, double us) {
      rows.push_back({bytes, v, blocks, threads, us});
      const double gbs = double(bytes) / (us * 1e3);
      const double pct = ceUs > 0 ? 100.0 * ceUs / us : 100.0;
      std::printf("%-10s | %-12s | %6d | %7d | %10.2f | %8.2f | %6.1f%%\n", SizeText(bytes).c_str(),
                  VariantName(v), blocks, threads, us, gbs, pct);
      std::fflush(stdout);
    };
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
    ceUs = timer.MedianUs(ce, cfg.repeats);
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
    // Target: warp- and block-scope puts at >= 85% of the copy engine for >= 1 MiB.
    std::printf(
        "target: best warp-scope and block-scope put >= 85%% of copy engine for >= 1 MiB\n");
    for (int kind = 0; kind < 2; kind++) {
      double worst = 1e9;
      size_t worstSize = 0;
      for (size_t bytes : sizes) {
        if (bytes < (size_t{1} << 20)) continue;
        double ce = 0, best = 0;
        for (const Row& r : rows) {
          if (r.bytes != bytes) continue;
          if (r.v == Variant::kCopyEngine) ce = r.us;
          const bool match = kind == 0 ? (r.v == Variant::kWarp || r.v == Variant::kMultiWarp)
                                       : (r.v == Variant::kBlock || r.v == Variant::kMultiBlock);
          if (match) best = std::max(best, 1.0 / r.us);
        }
        const double pct = 100.0 * ce * best;
        if (pct < worst) {
          worst = pct;
          worstSize = bytes;
        }
      }
      if (worstSize != 0)
        std::printf("  %s scope: worst case %.1f%% of copy engine (at %s): %s\n",
                    kind == 0 ? "warp" : "block", worst, SizeText(worstSize).c_str(),
                    worst >= 85.0 ? "MET" : "NOT MET");
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
    case 'k':
      v *= 1024;
      break;
    case 'm':
      v *= 1024 * 1024;
      break;
    case 'g':
      v *= 1024.0 * 1024 * 1024;
      break;
    default:
      break;
  }
  return static_cast<size_t>(v);
}

int CountGpus() {
  int fds[2];
  if (pipe(fds) != 0) return 0;
  if (fork() == 0) {
    int n = 0;
    if (gpuGetDeviceCount(&n) != gpuSuccess) n = 0;
    (void)!write(fds[1], &n, sizeof(n));
    _exit(0);
  }
  int n = 0;
  if (read(fds[0], &n, sizeof(n)) != sizeof(n)) n = 0;
  wait(nullptr);
  return n;
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
    } else {
      std::printf(
          "usage: %s [--gpus A,B] [--min-size B] [--max-size B] [--blocks N,N..] "
          "[--threads N] [--repeats N] [--latency-iters N]\n",
          argv[0]);
      return a == "-h" || a == "--help" ? 0 : 2;
    }
  }
  if (cfg.threads <= 0 || cfg.threads % core::kWarpSize != 0 || cfg.threads > 1024) {
    std::printf("--threads must be a multiple of %d in (0, 1024]\n", core::kWarpSize);
    return 2;
  }
  const int gpus = CountGpus();
  if (gpus < 2 || cfg.gpus[0] == cfg.gpus[1] || std::max(cfg.gpus[0], cfg.gpus[1]) >= gpus ||
      std::min(cfg.gpus[0], cfg.gpus[1]) < 0) {
    std::printf("SKIPPED: shmem_put_bench needs two distinct GPUs (found %d, asked for %d,%d)\n",
                gpus, cfg.gpus[0], cfg.gpus[1]);
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

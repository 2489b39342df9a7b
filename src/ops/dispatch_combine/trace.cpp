// EpDispatchCombineHandle::SampleTraceClock: the GPU's trace clock read against the host's
// CLOCK_REALTIME, so that traces of different PEs (and hosts) share one time axis.
//
// One thread of a probe kernel waits for the host's go word (mapped host memory), reads the GPU
// wall clock (the clock of the trace's time words) and writes it back to mapped memory. The host
// reads CLOCK_REALTIME just before it writes go (t0) and just after it sees the answer (t1): the
// GPU read happened in [t0, t1], so its host time is (t0 + t1) / 2 within (t1 - t0) / 2. The
// round with the shortest round trip wins.
#include <time.h>

#include <cstdint>
#include <limits>

#include "mori/core/device/wait.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu_check.hpp"
#include "mori/ops/dispatch_combine/handle.hpp"
#include "mori/ops/dispatch_combine/trace.hpp"

namespace mori::ops {

namespace {

constexpr int kClockRounds = 16;

struct ClockProbeWords {
  uint32_t go;  // host -> GPU: round i + 1 may start; kProbeStop: stop
  uint32_t pad;
  uint64_t answer[kClockRounds];  // GPU -> host: the GPU clock of round i (never 0)
};
constexpr uint32_t kProbeStop = std::numeric_limits<uint32_t>::max();

__global__ void EpTraceClockProbeKernel(ClockProbeWords* w, core::WaitContext wait) {
  for (int i = 0; i < kClockRounds; i++) {
    if (!core::WaitUntil(wait, &w->go, core::CmpOp::kGe, static_cast<uint32_t>(i + 1), -1,
                         "EP trace clock probe: the host's go"))
      return;
    if (core::AtomicLoadAcquireSystem(&w->go) == kProbeStop) return;
    const uint64_t t = core::WallClockNs();
    core::AtomicStoreRelaxedSystem(&w->answer[i], t != 0 ? t : 1);
  }
}

int64_t RealtimeNs() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

int64_t MonotonicNs() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

// Owns the mapped words and the stream; on the way out (also on an error) it stops the kernel
// and waits for it (bounded) before freeing what the kernel uses.
class ClockProbe {
 public:
  explicit ClockProbe(int64_t timeoutMs) : timeoutMs(timeoutMs) {
    MORI_CHECK_GPU(gpuHostAlloc(reinterpret_cast<void**>(&words), sizeof(ClockProbeWords),
                                gpuHostAllocMapped));
    *words = ClockProbeWords{};
    MORI_CHECK_GPU(gpuHostGetDevicePointer(reinterpret_cast<void**>(&wordsDev), words, 0));
    MORI_CHECK_GPU(gpuStreamCreateWithFlags(&stream, gpuStreamNonBlocking));
  }
  ~ClockProbe() {
    if (launched) {
      __atomic_store_n(&words->go, kProbeStop, __ATOMIC_RELEASE);
      const bool done = core::PollGpuReady([&] { return gpuStreamQuery(stream); }, timeoutMs);
      if (!done) return;  // the kernel may still read the words: leak them rather than free
    }
    (void)gpuStreamDestroy(stream);
    (void)gpuFreeHost(words);
  }
  ClockProbe(const ClockProbe&) = delete;
  ClockProbe& operator=(const ClockProbe&) = delete;

  void Launch(const core::WaitContext& wait) {
    EpTraceClockProbeKernel<<<1, 1, 0, stream>>>(wordsDev, wait);
    MORI_CHECK_LAUNCH();
    launched = true;
  }

  // Round i: false if the answer did not come within the timeout.
  bool Round(int i, EpTraceClockSample* out) {
    const int64_t deadline = MonotonicNs() + timeoutMs * 1000000LL;
    const int64_t t0 = RealtimeNs();
    __atomic_store_n(&words->go, static_cast<uint32_t>(i + 1), __ATOMIC_RELEASE);
    uint64_t g = 0;
    for (uint32_t spins = 0;; spins++) {
      g = __atomic_load_n(&words->answer[i], __ATOMIC_ACQUIRE);
      if (g != 0) break;
      if ((spins & 1023u) == 0 && MonotonicNs() > deadline) return false;
    }
    const int64_t t1 = RealtimeNs();
    out->hostNs = t0 + (t1 - t0) / 2;
    out->deviceNs = g;
    out->uncertaintyNs = (t1 - t0 + 1) / 2;
    return true;
  }

 private:
  int64_t timeoutMs;
  ClockProbeWords* words = nullptr;
  ClockProbeWords* wordsDev = nullptr;
  gpuStream_t stream = nullptr;
  bool launched = false;
};

}  // namespace

EpTraceClockSample EpDispatchCombineHandle::SampleTraceClock() const {
  CheckUsable("trace clock sample");
  const int64_t timeoutMs = core::Env().hostTimeoutMs;
  ClockProbe probe(timeoutMs);
  probe.Launch(shmemCtx.wait);
  EpTraceClockSample best;
  best.uncertaintyNs = -1;
  for (int i = 0; i < kClockRounds; i++) {
    EpTraceClockSample s;
    if (!probe.Round(i, &s))
      MORI_THROW(TimeoutError,
                 "EP trace clock sample on PE %d: the probe kernel did not answer within "
                 "MORI_HOST_TIMEOUT_MS=%lld ms (is the GPU held by kernels that wait for this "
                 "host?)",
                 config.rank, static_cast<long long>(timeoutMs));
    if (best.uncertaintyNs < 0 || s.uncertaintyNs < best.uncertaintyNs) best = s;
  }
  return best;
}

}  // namespace mori::ops

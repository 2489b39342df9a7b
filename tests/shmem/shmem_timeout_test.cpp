// Bounded device waits, one process per GPU, with MORI_DEVICE_TIMEOUT_MS=500: a kernel waits for
// a signal nobody sends. The kernel must return (the wait gives up), ShmemStreamSynchronize and
// ShmemCheckDeviceError must raise mori::core::TimeoutError naming the rank, the peer, the
// address and the expected / seen values, the record must be cleared once reported, and the
// library must keep working afterwards (a put-with-signal ring and a device barrier). Host waits:
// with MORI_HOST_TIMEOUT_MS=3000 and a foreign kernel spinning, ShmemBarrierAll raises
// TimeoutError instead of hanging, and the library works again once the kernel ends.
#include <cctype>
#include <chrono>
#include <cinttypes>
#include <string>

#include "gpu_test_harness.hpp"
#include "mori/shmem/shmem_device_api.hpp"

using namespace mori;
using namespace mori::shmem;
using namespace mori::test;

namespace {

constexpr uint64_t kExpected = 4242424242ull;  // never sent
constexpr uint64_t kSeen = 1717171717ull;      // what the signal word holds
constexpr const char* kLabel = "planted-missing-signal";
constexpr size_t kRingBytes = 65536 + 5;
constexpr int kThreads = 256;

struct WaitOutcome {
  int returned;  // 1 once the waiting thread is past the wait
  int ok;        // what the wait returned
  unsigned long long elapsedNs;
};

__global__ void PlantedWaitKernel(ShmemDeviceContext ctx, uint64_t* sig, int peer,
                                  WaitOutcome* out) {
  if (threadIdx.x != 0) return;
  const uint64_t t0 = core::WallClockNs();
  const bool ok = ShmemSignalWaitUntil(ctx, sig, core::CmpOp::kEq, kExpected, peer, kLabel);
  out->elapsedNs = core::WallClockNs() - t0;
  out->ok = ok ? 1 : 0;
  out->returned = 1;
}

// A kernel that is not mori's: it spins until the host sets *release (or 30 s pass, so the test
// itself can never hang the machine).
__global__ void ForeignSpinKernel(const volatile int* release) {
  const uint64_t t0 = core::WallClockNs();
  while (*release == 0 && core::WallClockNs() - t0 < 30ull * 1000 * 1000 * 1000) {
  }
}

// Ring: put-with-signal to the next PE, wait for the previous PE's, check its data in place.
__global__ void __launch_bounds__(kThreads)
    RingKernel(ShmemDeviceContext ctx, uint8_t* recv, const uint8_t* src, uint64_t* sig,
               uint64_t round, DeviceFailLog* log) {
  const int n = ctx.worldSize, me = ctx.rank;
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  const bool sent =
      ShmemPutMemSignalNbiBlock(ctx, recv, src, kRingBytes, sig, round, SignalOp::kSet, next);
  DEV_CHECK(log, me, sent, "ring put-with-signal to pe %d returned false", next);
  bool ok = true;
  if (threadIdx.x == 0)
    ok = ShmemSignalWaitUntil(ctx, sig, core::CmpOp::kEq, round, prev, "ring test");
  ok = __syncthreads_and(ok) != 0;
  DEV_CHECK(log, me, ok, "ring signal from pe %d did not arrive", prev);
  if (!ok) return;
  const uint64_t seed = SeedOf(prev, me, round, 7);
  for (size_t i = threadIdx.x; i < kRingBytes; i += blockDim.x) {
    const uint8_t got = static_cast<const volatile uint8_t*>(recv)[i];
    DEV_CHECK(log, me, got == PatternByte(seed, i), "ring data byte %llu from pe %d: 0x%02x",
              (unsigned long long)i, prev, got);
  }
}

// True if `msg` contains `key` followed (after spaces, ':' or '=') by the decimal `value`.
bool HasNumberAfter(const std::string& msg, const char* key, long long value) {
  const std::string want = std::to_string(value);
  for (size_t pos = msg.find(key); pos != std::string::npos; pos = msg.find(key, pos + 1)) {
    size_t i = pos + std::strlen(key);
    while (i < msg.size() && (msg[i] == ' ' || msg[i] == ':' || msg[i] == '=')) i++;
    size_t j = i;
    if (j < msg.size() && msg[j] == '-') j++;
    while (j < msg.size() && std::isdigit(static_cast<unsigned char>(msg[j]))) j++;
    if (msg.compare(i, j - i, want) == 0 && j > i) return true;
  }
  return false;
}

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// Checks the content of a TimeoutError message for the planted wait.
void CheckMessage(RankEnv& env, const char* phase, const std::string& msg, int peer,
                  const void* addr) {
  char hex[32];
  std::snprintf(hex, sizeof(hex), "%" PRIx64,
                static_cast<uint64_t>(reinterpret_cast<uintptr_t>(addr)));
  const std::string low = Lower(msg);
  env.Check(HasNumberAfter(low, "rank", env.rank), "%s: message names rank %d: %s", phase, env.rank,
            msg.c_str());
  env.Check(HasNumberAfter(low, "peer", peer), "%s: message names peer %d", phase, peer);
  env.Check(low.find(hex) != std::string::npos, "%s: message has the address 0x%s", phase, hex);
  env.Check(msg.find(std::to_string(kExpected)) != std::string::npos,
            "%s: message has the expected value %" PRIu64, phase, kExpected);
  env.Check(msg.find(std::to_string(kSeen)) != std::string::npos,
            "%s: message has the seen value %" PRIu64, phase, kSeen);
  env.Check(msg.find(kLabel) != std::string::npos, "%s: message has the wait's label '%s'", phase,
            kLabel);
}

void CheckOutcome(RankEnv& env, const char* phase, WaitOutcome* dev) {
  WaitOutcome o{};
  TEST_CHECK_GPU(gpuMemcpy(&o, dev, sizeof(o), gpuMemcpyDeviceToHost));
  env.Check(o.returned == 1 && o.ok == 0,
            "%s: the wait returned false and the kernel went on (returned %d, ok %d)", phase,
            o.returned, o.ok);
  env.Check(o.elapsedNs >= 400ull * 1000 * 1000 && o.elapsedNs < 10ull * 1000 * 1000 * 1000,
            "%s: the wait gave up after %.1f ms (timeout 500 ms)", phase, o.elapsedNs / 1e6);
  TEST_CHECK_GPU(gpuMemset(dev, 0, sizeof(WaitOutcome)));
}

bool RecordIsClear(RankEnv& env, const char* phase) {
  try {
    ShmemCheckDeviceError();
  } catch (const core::Error& e) {
    return env.Check(false, "%s: error record not cleared after it was reported: %s", phase,
                     e.what());
  }
  return env.Check(true, "%s: error record cleared after it was reported", phase);
}

void RunBody(RankEnv& env) {
  const int n = env.npes, me = env.rank;
  const int peer = (me + 1) % n;  // the PE that "should" have sent the signal
  const ShmemDeviceContext ctx = ShmemGetDeviceContext();
  env.Check(ctx.wait.timeoutNs == 500ull * 1000 * 1000,
            "device timeout from MORI_DEVICE_TIMEOUT_MS=500 is %" PRIu64 " ns", ctx.wait.timeoutNs);
  gpuStream_t stream;
  TEST_CHECK_GPU(gpuStreamCreateWithFlags(&stream, gpuStreamNonBlocking));
  auto* sig = static_cast<uint64_t*>(ShmemMalloc(sizeof(uint64_t)));
  TEST_CHECK_GPU(gpuMemcpy(sig, &kSeen, sizeof(kSeen), gpuMemcpyHostToDevice));
  WaitOutcome* out = nullptr;
  TEST_CHECK_GPU(gpuMalloc(reinterpret_cast<void**>(&out), sizeof(WaitOutcome)));
  TEST_CHECK_GPU(gpuMemset(out, 0, sizeof(WaitOutcome)));
  ShmemBarrierAll();

  // 1. Surfaced by ShmemStreamSynchronize.
  using Clock = std::chrono::steady_clock;
  auto t0 = Clock::now();
  PlantedWaitKernel<<<1, 64, 0, stream>>>(ctx, sig, peer, out);
  TEST_CHECK_GPU(gpuGetLastError());
  std::string msg;
  bool timeoutError = false;
  try {
    ShmemStreamSynchronize(stream);
  } catch (const core::TimeoutError& e) {
    timeoutError = true;
    msg = e.what();
  } catch (const core::Error& e) {
    msg = e.what();
  }
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  env.Check(timeoutError, "ShmemStreamSynchronize raised TimeoutError after %.2f s: '%s'", secs,
            msg.c_str());
  CheckMessage(env, "ShmemStreamSynchronize", msg, peer, sig);
  CheckOutcome(env, "ShmemStreamSynchronize", out);
  RecordIsClear(env, "ShmemStreamSynchronize");

  // 2. Surfaced by ShmemCheckDeviceError after a plain stream synchronisation.
  PlantedWaitKernel<<<1, 64, 0, stream>>>(ctx, sig, peer, out);
  TEST_CHECK_GPU(gpuGetLastError());
  TEST_CHECK_GPU(gpuStreamSynchronize(stream));
  msg.clear();
  timeoutError = false;
  try {
    ShmemCheckDeviceError();
  } catch (const core::TimeoutError& e) {
    timeoutError = true;
    msg = e.what();
  } catch (const core::Error& e) {
    msg = e.what();
  }
  env.Check(timeoutError, "ShmemCheckDeviceError raised TimeoutError: '%s'", msg.c_str());
  CheckMessage(env, "ShmemCheckDeviceError", msg, peer, sig);
  CheckOutcome(env, "ShmemCheckDeviceError", out);
  RecordIsClear(env, "ShmemCheckDeviceError");

  // 3. Still usable: put-with-signal ring, device barrier, host barrier; no error appears.
  FailLogBuffer log;
  auto* recv = static_cast<uint8_t*>(ShmemMalloc(kRingBytes));
  auto* ringSig = static_cast<uint64_t*>(ShmemMalloc(sizeof(uint64_t)));
  uint8_t* src = nullptr;
  TEST_CHECK_GPU(gpuMalloc(reinterpret_cast<void**>(&src), kRingBytes));
  std::vector<uint8_t> h(kRingBytes);
  bool usable = true;
  try {
    for (uint64_t round = 1; round <= 3; round++) {
      FillPattern(h.data(), kRingBytes, SeedOf(me, (me + 1) % n, round, 7));
      TEST_CHECK_GPU(gpuMemcpy(src, h.data(), kRingBytes, gpuMemcpyHostToDevice));
      TEST_CHECK_GPU(gpuMemset(recv, kPoison, kRingBytes));
      ShmemBarrierAll();
      RingKernel<<<1, kThreads, 0, stream>>>(ctx, recv, src, ringSig, round, log.Get());
      TEST_CHECK_GPU(gpuGetLastError());
      ShmemBarrierOnStream(stream);
      ShmemStreamSynchronize(stream);
      ShmemBarrierAll();
      TEST_CHECK_GPU(gpuMemcpy(h.data(), recv, kRingBytes, gpuMemcpyDeviceToHost));
      const size_t bad =
          FirstPatternMismatch(h.data(), kRingBytes, SeedOf((me + n - 1) % n, me, round, 7));
      env.Check(bad == kRingBytes,
                "after the timeouts, ring round %" PRIu64 " from pe %d: first bad byte %zd", round,
                (me + n - 1) % n, bad == kRingBytes ? (ssize_t)-1 : (ssize_t)bad);
    }
  } catch (const core::Error& e) {
    usable = false;
    env.Check(false, "library unusable after the timeouts: %s", e.what());
  }
  if (usable) env.Check(log.Count() == 0, "ring kernels: %u device check failures", log.Count());

  // 4. Host waits are bounded too: with a foreign kernel spinning, ShmemBarrierAll must raise
  //    TimeoutError after MORI_HOST_TIMEOUT_MS (+ the 5 s abort grace), not hang; once the kernel
  //    is released the library works again.
  int* releaseHost = nullptr;
  TEST_CHECK_GPU(
      gpuHostAlloc(reinterpret_cast<void**>(&releaseHost), sizeof(int), gpuHostAllocMapped));
  *reinterpret_cast<volatile int*>(releaseHost) = 0;
  int* releaseDev = nullptr;
  TEST_CHECK_GPU(gpuHostGetDevicePointer(reinterpret_cast<void**>(&releaseDev), releaseHost, 0));
  ForeignSpinKernel<<<1, 1, 0, stream>>>(releaseDev);
  TEST_CHECK_GPU(gpuGetLastError());
  {
    const auto t0 = std::chrono::steady_clock::now();
    bool timedOut = false;
    std::string hostMsg;
    try {
      ShmemBarrierAll();
    } catch (const core::TimeoutError& e) {
      timedOut = true;
      hostMsg = e.what();
    } catch (const core::Error& e) {
      hostMsg = e.what();
    }
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    env.Check(timedOut && secs >= 2.5 && secs < 20.0,
              "ShmemBarrierAll with a spinning foreign kernel raised TimeoutError after %.2f s: "
              "'%s'",
              secs, hostMsg.c_str());
    env.Check(hostMsg.find("MORI_HOST_TIMEOUT_MS") != std::string::npos,
              "the host timeout message names MORI_HOST_TIMEOUT_MS");
  }
  *reinterpret_cast<volatile int*>(releaseHost) = 1;
  try {
    ShmemStreamSynchronize(stream);  // reports (and clears) the abort raised above
  } catch (const core::TimeoutError&) {
  }
  bool clean = true;
  try {
    ShmemCheckDeviceError();
    ShmemBarrierAll();
  } catch (const core::Error& e) {
    clean = false;
    env.Check(false, "library unusable after the host timeout: %s", e.what());
  }
  if (clean) env.Check(true, "library usable after the host timeout");
  (void)gpuFreeHost(releaseHost);

  ShmemBarrierAll();
  (void)gpuFree(src);
  (void)gpuFree(out);
  ShmemFree(recv);
  ShmemFree(ringSig);
  ShmemFree(sig);
  TEST_CHECK_GPU(gpuStreamDestroy(stream));
}

}  // namespace

int main(int argc, char** argv) {
  setenv("MORI_DEVICE_TIMEOUT_MS", "500", 1);  // before init (the children inherit it)
  setenv("MORI_HOST_TIMEOUT_MS", "3000", 1);
  return RunOnAllGpus(argc, argv, "shmem_timeout_test", RunBody);
}

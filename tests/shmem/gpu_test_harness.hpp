// A small harness for the multi-GPU shmem test programs (one process per GPU, forked).
//
//   int main(int argc, char** argv) {
//     return mori::test::RunOnAllGpus(argc, argv, "shmem_foo_test", [](mori::test::RankEnv& env) {
//       env.Check(x == y, "x %d == y %d", x, y);
//     });
//   }
//
// The parent never touches the GPU (CUDA/HIP cannot be used in a child forked after the parent
// initialised the runtime): it counts GPUs in a throw-away probe child, takes the unique id
// (ShmemGetUniqueId, a socket address; no GPU), forks one child per GPU, and waits with a deadline.
// Each child binds GPU `rank`, initialises shmem (unless Options::initShmem is false), runs the
// body, finalises and exits. Check counts live in shared memory, so the parent still tallies a
// child that crashed or hung. Output ends with "N passed, M failed"; exit status 0 only when
// nothing failed; 77 (CTest SKIP_RETURN_CODE) with "SKIPPED: <reason>" when fewer than 2 GPUs.
//
// Options on the command line: --npes N (default: all GPUs), --timeout S (default 300), -v.
#pragma once

#include <dirent.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_check.hpp"
#include "mori/core/gpu_count.hpp"
#include "mori/shmem/shmem_api.hpp"

namespace mori::test {

constexpr int kSkipExitCode = 77;
constexpr int kMaxRanks = 64;
constexpr int kMaxIdGenerations = 64;

// Created before fork (MAP_SHARED | MAP_ANONYMOUS): every process sees the same bytes.
struct SharedState {
  std::atomic<int> passed[kMaxRanks];
  std::atomic<int> failed[kMaxRanks];
  std::atomic<int> finished[kMaxRanks];  // 1 once the child reached its normal end
  std::atomic<uint32_t> idGeneration;    // number of unique ids published in ids[]
  shmem::UniqueId ids[kMaxIdGenerations];
};

struct Options {
  int minPes = 2;         // fewer GPUs: SKIPPED
  bool initShmem = true;  // the harness calls ShmemInitWithUniqueId / ShmemFinalize around the body
  int timeoutSec = 300;   // parent deadline for all children
};

class RankEnv {
 public:
  RankEnv(int rank, int npes, bool verbose, SharedState* shared)
      : rank(rank), npes(npes), verbose(verbose), shared(shared) {}

  const int rank;
  const int npes;
  const bool verbose;

  // Counts one check; prints failures always and passes with -v. Returns `ok`.
  bool Check(bool ok, const char* fmt, ...) __attribute__((format(printf, 3, 4))) {
    va_list ap;
    va_start(ap, fmt);
    std::string msg = core::StrFormatV(fmt, ap);
    va_end(ap);
    if (ok) {
      shared->passed[rank].fetch_add(1);
      if (verbose) std::printf("[rank %d] PASS %s\n", rank, msg.c_str());
    } else {
      shared->failed[rank].fetch_add(1);
      std::printf("[rank %d] FAIL %s\n", rank, msg.c_str());
    }
    std::fflush(stdout);
    return ok;
  }
  void Log(const char* fmt, ...) __attribute__((format(printf, 2, 3))) {
    va_list ap;
    va_start(ap, fmt);
    std::string msg = core::StrFormatV(fmt, ap);
    va_end(ap);
    std::printf("[rank %d] %s\n", rank, msg.c_str());
    std::fflush(stdout);
  }
  int Failed() const { return shared->failed[rank].load(); }
  int Passed() const { return shared->passed[rank].load(); }

  // A fresh unique id for a collective re-init: rank 0 creates and publishes it, the others wait
  // for it (bounded). Every rank must call it the same number of times.
  shmem::UniqueId NextUniqueId(int timeoutSec = 120) {
    const uint32_t gen = ++idCalls;  // generation 0 is the parent's id
    MORI_ENSURE(gen < kMaxIdGenerations, InvalidUsageError, "too many unique-id generations");
    if (rank == 0) {
      shared->ids[gen] = shmem::ShmemGetUniqueId();
      shared->idGeneration.store(gen + 1, std::memory_order_release);
    } else {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeoutSec);
      while (shared->idGeneration.load(std::memory_order_acquire) < gen + 1) {
        if (std::chrono::steady_clock::now() > deadline)
          MORI_THROW(TimeoutError, "rank %d: rank 0 did not publish unique id #%u within %d s",
                     rank, gen, timeoutSec);
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
    return shared->ids[gen];
  }
  const shmem::UniqueId& FirstUniqueId() const { return shared->ids[0]; }

 private:
  SharedState* shared;
  uint32_t idCalls = 0;
};

// Aborts a child when a GPU runtime call fails; messages carry rank and call.
#define TEST_CHECK_GPU(call) MORI_CHECK_GPU(call)

inline int CountOpenFds() {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  if (d == nullptr) return -1;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] != '.') n++;
  }
  closedir(d);
  return n - 1;  // the directory stream itself
}

namespace detail {

inline const char* ArgValue(int argc, char** argv, const char* name) {
  for (int i = 1; i + 1 < argc; i++)
    if (std::strcmp(argv[i], name) == 0) return argv[i + 1];
  return nullptr;
}
inline bool HasFlag(int argc, char** argv, const char* name) {
  for (int i = 1; i < argc; i++)
    if (std::strcmp(argv[i], name) == 0) return true;
  return false;
}

}  // namespace detail

using TestBody = std::function<void(RankEnv&)>;

// Returns the process exit status (0, 1, or kSkipExitCode).
inline int RunOnAllGpus(int argc, char** argv, const char* name, const TestBody& body,
                        Options opt = {}) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  const bool verbose = detail::HasFlag(argc, argv, "-v");
  if (const char* t = detail::ArgValue(argc, argv, "--timeout")) opt.timeoutSec = std::atoi(t);
  // Quick failures beat 60-second device waits in a test; callers may still override.
  setenv("MORI_DEVICE_TIMEOUT_MS", "20000", 0);

  std::string reason;
  const int ngpus = core::CountGpusInChildProcess(&reason);
  if (ngpus < 0) {
    std::printf("SKIPPED: %s: no usable GPU: %s\n", name, reason.c_str());
    return kSkipExitCode;
  }
  // One PE per GPU by default; --npes above the GPU count puts PEs on GPUs round-robin (shmem maps
  // peers on the same GPU as plain device memory: the protocols run, nothing crosses a link).
  int npes = ngpus;
  const char* npesArg = detail::ArgValue(argc, argv, "--npes");
  if (npesArg != nullptr) npes = std::atoi(npesArg);
  if (ngpus < 1 || (npesArg == nullptr && ngpus < opt.minPes)) {
    std::printf("SKIPPED: %s: needs at least %d GPUs, found %d (--npes %d shares GPUs)\n", name,
                opt.minPes, ngpus, opt.minPes);
    return kSkipExitCode;
  }
  if (npes < opt.minPes || npes > kMaxRanks) {
    std::printf("SKIPPED: %s: --npes %d not in [%d, %d]\n", name, npes, opt.minPes, kMaxRanks);
    return kSkipExitCode;
  }

  void* mem =
      mmap(nullptr, sizeof(SharedState), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) {
    std::printf("%s: mmap of the shared state failed\n0 passed, 1 failed\n", name);
    return 1;
  }
  SharedState* shared = new (mem) SharedState();
  for (int r = 0; r < kMaxRanks; r++) {
    shared->passed[r] = 0;
    shared->failed[r] = 0;
    shared->finished[r] = 0;
  }
  try {
    shared->ids[0] = shmem::ShmemGetUniqueId();  // before fork, in the parent (no GPU involved)
    shared->idGeneration = 1;
  } catch (const std::exception& e) {
    std::printf("%s: ShmemGetUniqueId failed: %s\n0 passed, 1 failed\n", name, e.what());
    return 1;
  }

  std::printf("%s: %d PEs (of %d GPUs), timeout %d s\n", name, npes, ngpus, opt.timeoutSec);
  std::fflush(stdout);
  const pid_t parent = getpid();
  std::vector<pid_t> pids(npes, -1);
  for (int rank = 0; rank < npes; rank++) {
    pid_t pid = fork();
    if (pid < 0) {
      std::printf("%s: fork failed for rank %d\n", name, rank);
      for (int r = 0; r < rank; r++) kill(pids[r], SIGKILL);
      std::printf("0 passed, 1 failed\n");
      return 1;
    }
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the parent (e.g. killed by CTest)
      if (getppid() != parent) _exit(3);
      RankEnv env(rank, npes, verbose, shared);
      int code = 0;
      try {
        TEST_CHECK_GPU(gpuSetDevice(rank % ngpus));
        if (opt.initShmem) shmem::ShmemInitWithUniqueId(rank, npes, shared->ids[0]);
        body(env);
        if (opt.initShmem) shmem::ShmemFinalize();
      } catch (const std::exception& e) {
        env.Check(false, "exception: %s", e.what());
        code = 2;
      }
      shared->finished[rank] = 1;
      if (code == 0 && env.Failed() > 0) code = 1;
      env.Log("done: %d passed, %d failed", env.Passed(), env.Failed());
      std::fflush(stdout);
      std::fflush(stderr);
      _exit(code);
    }
    pids[rank] = pid;
  }

  // Wait with a deadline; after a child fails hard, the others get a grace period (they may be
  // stuck in a collective with it).
  using Clock = std::chrono::steady_clock;
  auto deadline = Clock::now() + std::chrono::seconds(opt.timeoutSec);
  std::vector<int> status(npes, 0);
  std::vector<bool> alive(npes, true), killed(npes, false);
  int remaining = npes;
  while (remaining > 0) {
    int st = 0;
    pid_t pid = waitpid(-1, &st, WNOHANG);
    if (pid > 0) {
      for (int r = 0; r < npes; r++) {
        if (pids[r] != pid) continue;
        alive[r] = false;
        status[r] = st;
        remaining--;
        const bool hard = !WIFEXITED(st) || (WEXITSTATUS(st) != 0 && WEXITSTATUS(st) != 1);
        if (hard) {
          auto grace = Clock::now() + std::chrono::seconds(60);
          if (grace < deadline) deadline = grace;
        }
      }
      continue;
    }
    if (Clock::now() > deadline) {
      for (int r = 0; r < npes; r++) {
        if (!alive[r]) continue;
        std::printf("%s: rank %d (pid %d) still running at the deadline: killing it\n", name, r,
                    (int)pids[r]);
        kill(pids[r], SIGKILL);
        killed[r] = true;
      }
      for (int r = 0; r < npes; r++) {
        if (!alive[r]) continue;
        waitpid(pids[r], &status[r], 0);
        alive[r] = false;
        remaining--;
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }

  int passed = 0, failed = 0;
  bool allOk = true;
  for (int r = 0; r < npes; r++) {
    passed += shared->passed[r].load();
    failed += shared->failed[r].load();
    const int st = status[r];
    std::string how;
    if (killed[r]) {
      how = "killed at the deadline (hung)";
    } else if (WIFSIGNALED(st)) {
      how = core::StrFormat("died from signal %d (%s)", WTERMSIG(st), strsignal(WTERMSIG(st)));
    } else if (WIFEXITED(st) && WEXITSTATUS(st) != 0) {
      how = core::StrFormat("exit code %d", WEXITSTATUS(st));
    } else if (!shared->finished[r].load()) {
      how = "exited without finishing";
    }
    if (!how.empty()) {
      allOk = false;
      // A child that died or hung did not count its own failure: count one for it.
      const bool counted = WIFEXITED(st) && !killed[r] && shared->failed[r].load() > 0;
      if (!counted) failed++;
      std::printf("%s: rank %d: %s\n", name, r, how.c_str());
    }
  }
  std::printf("%s: %s\n", name, (allOk && failed == 0) ? "OK" : "FAILED");
  std::printf("%d passed, %d failed\n", passed, failed);
  std::fflush(stdout);
  munmap(mem, sizeof(SharedState));
  return (allOk && failed == 0) ? 0 : 1;
}

// ---------------------------------------------------------------------------------------------
// Device-side failure log: kernels count failed checks and print the first few with rank and
// location; the host reads the count back and turns it into one failed check.
// ---------------------------------------------------------------------------------------------
struct DeviceFailLog {
  unsigned int count;
};

#if defined(__CUDACC__) || defined(__HIPCC__)
#define DEV_CHECK(log, rank, cond, fmt, ...)                                                     \
  do {                                                                                           \
    if (!(cond)) {                                                                               \
      unsigned int n_ = atomicAdd(&(log)->count, 1u);                                            \
      if (n_ < 8)                                                                                \
        printf("[rank %d] DEVICE CHECK FAILED %s:%d block %d thread %d: " fmt "\n", (int)(rank), \
               __FILE__, __LINE__, (int)blockIdx.x, (int)threadIdx.x, ##__VA_ARGS__);            \
    }                                                                                            \
  } while (0)
#endif

// Owns a zeroed DeviceFailLog in device memory.
class FailLogBuffer {
 public:
  FailLogBuffer() {
    TEST_CHECK_GPU(gpuMalloc(&dev, sizeof(DeviceFailLog)));
    Reset();
  }
  ~FailLogBuffer() { (void)gpuFree(dev); }
  FailLogBuffer(const FailLogBuffer&) = delete;
  FailLogBuffer& operator=(const FailLogBuffer&) = delete;
  DeviceFailLog* Get() const { return static_cast<DeviceFailLog*>(dev); }
  void Reset() { TEST_CHECK_GPU(gpuMemset(dev, 0, sizeof(DeviceFailLog))); }
  // Call after the kernels finished.
  unsigned int Count() const {
    DeviceFailLog h{};
    TEST_CHECK_GPU(gpuMemcpy(&h, dev, sizeof(h), gpuMemcpyDeviceToHost));
    return h.count;
  }

 private:
  void* dev = nullptr;
};

// Deterministic test data: byte i of the stream identified by `seed`.
MORI_HD inline uint64_t Mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
MORI_HD inline uint8_t PatternByte(uint64_t seed, uint64_t i) {
  return static_cast<uint8_t>(Mix64(seed ^ ((i >> 3) * 0xD6E8FEB86659FD93ull)) >> ((i & 7) * 8));
}
// p[i] = PatternByte(seed, i) for i < n (one hash per 8 bytes).
inline void FillPattern(uint8_t* p, size_t n, uint64_t seed) {
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t w = Mix64(seed ^ ((i >> 3) * 0xD6E8FEB86659FD93ull));
    for (size_t k = 0; k < 8 && i + k < n; k++) p[i + k] = static_cast<uint8_t>(w >> (k * 8));
  }
}
// Index of the first i < n with p[i] != PatternByte(seed, i), or n.
inline size_t FirstPatternMismatch(const uint8_t* p, size_t n, uint64_t seed) {
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t w = Mix64(seed ^ ((i >> 3) * 0xD6E8FEB86659FD93ull));
    for (size_t k = 0; k < 8 && i + k < n; k++)
      if (p[i + k] != static_cast<uint8_t>(w >> (k * 8))) return i + k;
  }
  return n;
}
inline size_t FirstNotEqual(const uint8_t* p, size_t n, uint8_t v) {
  for (size_t i = 0; i < n; i++)
    if (p[i] != v) return i;
  return n;
}
MORI_HD inline uint64_t SeedOf(uint64_t a, uint64_t b, uint64_t c, uint64_t d = 0) {
  return Mix64(Mix64(Mix64(a * 0x100000001B3ull + 1) ^ b) ^ (c * 31 + d));
}

constexpr uint8_t kPoison = 0xAB;

}  // namespace mori::test

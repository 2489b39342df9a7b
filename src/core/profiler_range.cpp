// Profiler ranges: the MORI_NVTX switch and its one-time resolution. The platform's API (NVTX or
// roctx) is reached through core/gpu_runtime.hpp's GpuProfilerRange* functions.
#define MORI_GPU_PROFILER_RANGE_API 1  // this unit is their one user
#include "mori/core/profiler_range.hpp"

#include <mutex>
#include <string>

#include "mori/core/env.hpp"
#include "mori/core/gpu_runtime.hpp"
#include "mori/core/logging.hpp"

namespace mori::core {

namespace detail {
std::atomic<int> gProfilerRanges{kProfilerRangesUnknown};
}  // namespace detail

namespace {

std::mutex gResolveMutex;

// The state, resolved on first use. Setting the state last (release) publishes the opened API to
// every thread that then reads the state (acquire).
int ResolveProfilerRanges() {
  int state = detail::gProfilerRanges.load(std::memory_order_acquire);
  if (state != detail::kProfilerRangesUnknown) return state;
  std::lock_guard<std::mutex> lock(gResolveMutex);
  state = detail::gProfilerRanges.load(std::memory_order_relaxed);
  if (state != detail::kProfilerRangesUnknown) return state;
  bool on = EnvSnapshot()->nvtx;  // raises on a malformed value, leaving the state unknown
  if (on) {
    std::string why;
    if (GpuProfilerRangeOpen(&why)) {
      MORI_INFO(kLogInit, "MORI_NVTX: mori's host calls are %s ranges", kGpuProfilerRangeApiName);
    } else {
      MORI_WARN(kLogInit, "MORI_NVTX=1, but %s could not be opened (%s): profiler ranges stay off",
                kGpuProfilerRangeApiName, why.c_str());
      on = false;
    }
  }
  state = on ? detail::kProfilerRangesOn : detail::kProfilerRangesOff;
  detail::gProfilerRanges.store(state, std::memory_order_release);
  return state;
}

}  // namespace

bool ProfilerRangesEnabled() { return ResolveProfilerRanges() == detail::kProfilerRangesOn; }

namespace detail {

bool ProfilerRangePush(const char* name) {
  if (ResolveProfilerRanges() != kProfilerRangesOn) return false;
  GpuProfilerRangePush(name);
  return true;
}

void ProfilerRangePop() { GpuProfilerRangePop(); }

}  // namespace detail

}  // namespace mori::core

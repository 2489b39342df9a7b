// Named profiler ranges around mori's host calls, so that timelines (Nsight Systems, rocprof) show
// the calls around their kernels: NVTX ranges in the domain "mori" on CUDA, roctx ranges on HIP.
// Off unless MORI_NVTX=1 (the env table); the setting is read once, at the first range, and the
// state then holds for the process. Off, a range costs one load and one branch and never builds
// its name.
#pragma once

#include <atomic>
#include <type_traits>
#include <utility>

namespace mori::core {

namespace detail {
enum : int { kProfilerRangesUnknown = 0, kProfilerRangesOff = 1, kProfilerRangesOn = 2 };
// kProfilerRangesUnknown until the first range resolves it; then Off or On for good.
extern std::atomic<int> gProfilerRanges;
// Resolves the state if needed; when ranges are on, opens a range named `name` and returns true.
bool ProfilerRangePush(const char* name);
void ProfilerRangePop();
}  // namespace detail

// Whether ranges are on. The first call (or the first range) reads MORI_NVTX and, when it is set,
// opens the platform's profiler API; where that is missing (HIP without libroctx64) a warning is
// logged once and ranges stay off. Raises InvalidUsageError on a malformed MORI_NVTX (the state
// then stays unresolved).
bool ProfilerRangesEnabled();

// A range from construction to destruction on the constructing thread. Ranges nest; a range
// whose constructor found them off pushes and pops nothing, so pushes and pops always pair.
class ScopedProfilerRange {
 public:
  // `name` is read during the constructor only (the tool copies it).
  explicit ScopedProfilerRange(const char* name) {
    if (detail::gProfilerRanges.load(std::memory_order_relaxed) != detail::kProfilerRangesOff)
      pushed_ = detail::ProfilerRangePush(name);
  }
  // `name()` returns the name (const char*) and is called only when ranges are on: for names
  // built on first use.
  template <typename NameFn, typename = std::enable_if_t<std::is_convertible_v<
                                 decltype(std::declval<NameFn&>()()), const char*>>>
  explicit ScopedProfilerRange(NameFn&& name) {
    if (detail::gProfilerRanges.load(std::memory_order_relaxed) != detail::kProfilerRangesOff &&
        ProfilerRangesEnabled())
      pushed_ = detail::ProfilerRangePush(name());
  }
  ~ScopedProfilerRange() {
    if (pushed_) detail::ProfilerRangePop();
  }
  ScopedProfilerRange(const ScopedProfilerRange&) = delete;
  ScopedProfilerRange& operator=(const ScopedProfilerRange&) = delete;

 private:
  bool pushed_ = false;
};

}  // namespace mori::core

// Checked GPU runtime calls: a failure raises GpuRuntimeError carrying file:line and the call.
#pragma once

#include <chrono>
#include <cstdint>
#include <thread>

#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"

#define MORI_CHECK_GPU(call)                                                                \
  do {                                                                                      \
    gpuError_t moriErr_ = (call);                                                           \
    if (moriErr_ != gpuSuccess) {                                                           \
      (void)gpuGetLastError(); /* clear a non-sticky error so the process stays usable */   \
      MORI_THROW(GpuRuntimeError, "%s failed: %s (%s)", #call, gpuGetErrorString(moriErr_), \
                 gpuGetErrorName(moriErr_));                                                \
    }                                                                                       \
  } while (0)

// After a kernel launch: launch-configuration errors surface here.
#define MORI_CHECK_LAUNCH() MORI_CHECK_GPU(gpuGetLastError())

namespace mori::core {

// Host-side bounded poll of a GPU query (`query()` returns gpuStreamQuery / gpuEventQuery of
// what is waited for): true once it returns gpuSuccess, false once `timeoutMs` passed first (the
// caller reports the expiry); any other error raises GpuRuntimeError. `onSlow()` runs once when
// the wait passes `slowMs` (negative: never). Spins a little, then sleeps 20 us between polls.
template <typename Query, typename OnSlow>
bool PollGpuReady(Query query, int64_t timeoutMs, int64_t slowMs, OnSlow onSlow) {
  const auto start = std::chrono::steady_clock::now();
  bool warned = slowMs < 0;
  for (int polls = 0;; polls++) {
    const gpuError_t e = query();
    if (e == gpuSuccess) return true;
    if (e != gpuErrorNotReady) MORI_CHECK_GPU(e);
    const auto waited = std::chrono::steady_clock::now() - start;
    if (!warned && waited > std::chrono::milliseconds(slowMs)) {
      warned = true;
      onSlow();
    }
    if (waited > std::chrono::milliseconds(timeoutMs)) return false;
    if (polls > 200) std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

template <typename Query>
bool PollGpuReady(Query query, int64_t timeoutMs) {
  return PollGpuReady(query, timeoutMs, -1, [] {});
}

}  // namespace mori::core

// Small host-includable types of the shmem device API (no GPU compiler needed to include this).
#pragma once

#include <cstdint>

namespace mori::shmem {

// How a put-with-signal updates the signal word on the destination PE.
enum class SignalOp : int32_t {
  kSet = 0,  // atomic store (release): *sig = value
  kAdd = 1,  // atomic add (release): *sig += value
};

inline const char* SignalOpName(SignalOp op) {
  switch (op) {
    case SignalOp::kSet:
      return "set";
    case SignalOp::kAdd:
      return "add";
  }
  return "?";
}

// Words of ShmemDeviceContext::syncArea used by the device API. The area is symmetric, zeroed at
// init and only ever grows (monotonic counters), so no reset is needed between barriers or kernels.
constexpr int kSyncWordDeviceBarrier = 0;  // arrivals at this PE's device barrier, all epochs


}  // namespace mori::shmem

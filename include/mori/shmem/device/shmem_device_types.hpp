// Small host-includable types of the shmem device API (no GPU compiler needed to include this).
#pragma once

#include <cstdint>

namespace mori::shmem {

// How a put-with-signal updates the signal word on the destination PE. A signal is ONE 8-byte word
// (see "Signals" in shmem_device_api.hpp).
enum class SignalOp : int32_t {
  kSet = 0,   // atomic store (release): *sig = value
  kAdd = 1,   // atomic add (release): *sig += value
  kNone = 2,  // no signal: accepted only by ShmemPutMemBatchSignalNbiWarp
};

inline const char* SignalOpName(SignalOp op) {
  switch (op) {
    case SignalOp::kSet: return "set";
    case SignalOp::kAdd: return "add";
    case SignalOp::kNone: return "none";
  }
  return "?";
}

// Whether the RDMA work requests of a put request a completion (CQE) of their own. Completions
// free SQ slots and advance tickets; skipping them saves the NIC a CQE write per put. A put
// without one completes when a later CQE-requesting request on the same QP does (any signal,
// a batch, a put with kRequested, or the NOP a quiet / ShmemRdmaWaitCompleted posts when needed).
// Load/store peers ignore it.
enum class CqeMode : int32_t {
  kRequested = 0,
  kSkipped = 1,
};

// Words of ShmemDeviceContext::syncArea used by the device API. The area is symmetric, zeroed at
// init and only ever grows (monotonic counters), so no reset is needed between barriers or kernels.
constexpr int kSyncWordDeviceBarrier = 0;  // arrivals at this PE's device barrier, all epochs

}  // namespace mori::shmem

// Routing of a device API call to its transport, symmetric address translation and the device-side
// error record for invalid calls. Internal to the shmem device API (namespace detail).
//
// Errors that are not timed-out waits (pe out of range, address outside the symmetric heap,
// an operation the transport does not offer) are written to the same DeviceErrorRecord the bounded
// waits use, with kind kUsage and cmp = kDeviceErrorNotAWait, so the host raises them as
// InvalidUsageError through ShmemCheckDeviceError; they also raise the abort flag, so every bounded
// wait of the PE gives up instead of waiting for data that will not come. The API call then returns
// false (or a zero value) and does nothing.
//
// Each API function reports through one ReportCallError call site: HIP inlines every device
// function (printf included), so error paths are funnelled to keep kernels small.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mori/core/device/wait.hpp"
#include "mori/core/gpu.hpp"
#include "mori/shmem/device/shmem_device_types.hpp"
#include "mori/shmem/shmem_types.hpp"

namespace mori::shmem::detail {

template <typename T>
struct Identity {
  using type = T;
};
// A parameter of this type does not take part in template argument deduction.
template <typename T>
using NonDeduced = typename Identity<T>::type;

enum class CallError : uint32_t {
  kNone = 0,
  kPeOutOfRange,     // detail: pe
  kPeUnreachable,    // transport kNone; detail: pe
  kNotRegistered,    // RDMA local buffer outside this PE's heap; addr: the address; detail: bytes
  kRdmaRejected,     // the RDMA queue refused the request; addr: value seen; detail: limit
  kRdmaUnsupported,  // an operation RDMA does not offer (e.g. 32-bit atomics); detail: bytes
  kNotInHeap,        // addr: the address; detail: bytes
  kMisaligned,       // addr: the address; detail: required alignment
  kPeerNotMapped,    // peerHeapBases[pe] == 0; detail: pe
  kBadSignalOp,      // detail: the SignalOp value
};

MORI_HD inline const char* CallErrorText(CallError e) {
  switch (e) {
    case CallError::kNone: return "no error";
    case CallError::kPeOutOfRange: return "pe out of range";
    case CallError::kPeUnreachable: return "pe unreachable";
    case CallError::kNotRegistered: return "not RDMA-registered";
    case CallError::kRdmaRejected: return "RDMA request refused";
    case CallError::kRdmaUnsupported: return "not supported over RDMA";
    case CallError::kNotInHeap: return "addr not in heap";
    case CallError::kMisaligned: return "misaligned address";
    case CallError::kPeerNotMapped: return "peer heap not mapped";
    case CallError::kBadSignalOp: return "invalid SignalOp";
  }
  return "unknown error";
}

struct CallStatus {
  CallError code = CallError::kNone;
  uint64_t addr = 0;
  uint64_t detail = 0;
  MORI_DEVICE_INLINE void Set(CallError c, uint64_t a, uint64_t d) {
    code = c;
    addr = a;
    detail = d;
  }
};

// Writes the error record (first error of the PE wins, as in core::RecordWaitTimeout) with
// label "<op>: <what>" (the longest op name, 29 characters, plus ": " plus the longest text, 23,
// fits kDeviceErrorLabelLen - 1), prints one line, raises the abort flag.
__device__ __noinline__ inline void ReportCallError(const core::WaitContext& w, int peer,
                                                    const char* op, const CallStatus& st) {
  const char* what = CallErrorText(st.code);
  const core::DeviceErrorFields f{
      core::DeviceErrorKind::kUsage, peer, core::kDeviceErrorNotAWait, 0, st.addr, st.detail, 0, 0};
  if (!core::RecordDeviceError(w, f, op, ": ", what) && w.err != nullptr) return;
  printf(
      "[MORI device error] rank %d block %d thread %d: %s: %s (pe %d, addr 0x%llx, detail %llu)\n",
      w.rank, (int)blockIdx.x, (int)threadIdx.x, op, what, peer, (unsigned long long)st.addr,
      (unsigned long long)st.detail);
}

enum class Route { kLoadStore, kRdma, kFailed };

// How this PE reaches `pe` (kFailed with `st` set for a pe out of range or unreachable).
MORI_DEVICE_INLINE Route RouteTo(const ShmemDeviceContext& ctx, int pe, CallStatus& st) {
  if (static_cast<unsigned>(pe) >= static_cast<unsigned>(ctx.worldSize)) {
    st.Set(CallError::kPeOutOfRange, 0, static_cast<uint64_t>(pe));
    return Route::kFailed;
  }
  switch (ctx.transport[pe]) {
    case TransportType::kSelf:
    case TransportType::kP2P: return Route::kLoadStore;
    case TransportType::kRdma: return Route::kRdma;
    default: break;
  }
  st.Set(CallError::kPeUnreachable, 0, static_cast<uint64_t>(pe));
  return Route::kFailed;
}

// PE `pe`'s copy of the local symmetric range [addr, addr + bytes), as mapped in this process (a
// load/store route). Returns 0 with `st` set if the range is not inside the heap, `addr` is not
// aligned to `align` (a power of two), or the peer's heap is not mapped.
MORI_DEVICE_INLINE uintptr_t ResolveSymmetric(const ShmemDeviceContext& ctx, const void* addr,
                                              size_t bytes, int pe, size_t align, CallStatus& st) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(addr);
  const uint64_t off = a - ctx.heapBase;  // wraps to a huge value below the heap
  if (off > ctx.heapSize || bytes > ctx.heapSize - off) {
    st.Set(CallError::kNotInHeap, a, bytes);
    return 0;
  }
  if ((a & (align - 1)) != 0) {
    st.Set(CallError::kMisaligned, a, align);
    return 0;
  }
  if (pe == ctx.rank) return a;
  const uintptr_t base = ctx.peerHeapBases[pe];
  if (base == 0) {
    st.Set(CallError::kPeerNotMapped, a, static_cast<uint64_t>(pe));
    return 0;
  }
  return base + off;
}

}  // namespace mori::shmem::detail

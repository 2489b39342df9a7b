// The one bounded-wait primitive every device-side spin uses.
//
// Contract: WaitUntil returns true once `*addr <op> target` holds. If the condition does not hold
// within the context's timeout, or another thread has already recorded an error (the abort flag),
// it returns false. On its own timeout it records, once per error record, who waited (rank, block,
// thread), on whom (peer), for what (label, address, comparison, expected value) and what it saw,
// prints one line, and raises the abort flag so every other wait of every kernel sharing the record
// bails out. Callers return from the kernel when a wait returns false; the host reads the record
// (it lives in mapped host memory) and raises TimeoutError. No trap: the GPU context stays usable.
// A violation that a check finds without any wait expiring is recorded with RecordUsageError
// (InvalidUsageError on the host) through the same record and abort flag.
#pragma once

#include <cstdint>

#include "mori/core/device_error.hpp"
#include "mori/core/gpu.hpp"

namespace mori::core {

// What a kernel needs to bound its waits; passed by value inside device contexts.
struct WaitContext {
  DeviceErrorRecord* err;  // device-visible pointer to the mapped record
  uint64_t timeoutNs;
  int32_t rank;
};

#if MORI_GPU_COMPILER

template <typename T>
MORI_DEVICE_INLINE bool CompareValues(T v, CmpOp op, T target) {
  switch (op) {
    case CmpOp::kEq: return v == target;
    case CmpOp::kNe: return v != target;
    case CmpOp::kGt: return v > target;
    case CmpOp::kGe: return v >= target;
    case CmpOp::kLt: return v < target;
    case CmpOp::kLe: return v <= target;
  }
  return false;
}

MORI_DEVICE_INLINE bool DeviceAborted(const WaitContext& ctx) {
  return ctx.err != nullptr && AtomicLoadRelaxedSystem(&ctx.err->abortFlag) != 0;
}

// The one writer of the error record. The first caller claims it, fills it with `f` and the label
// l0 + l1 + l2 (truncated), fences, and only then raises the abort flag: the host reads the record
// only once the flag is up, so it never sees a half-written one. Later callers (an error is
// already recorded) only raise the flag. Returns true for the caller that claimed the record.
__device__ __noinline__ inline bool RecordDeviceError(const WaitContext& ctx,
                                                      const DeviceErrorFields& f, const char* l0,
                                                      const char* l1 = nullptr,
                                                      const char* l2 = nullptr) {
  DeviceErrorRecord* e = ctx.err;
  if (e == nullptr) return false;
  if (AtomicCasSystem<uint32_t>(&e->claimed, 0u, 1u) != 0u) {
    AtomicStoreRelaxedSystem<uint32_t>(&e->abortFlag, 1u);
    return false;
  }
  e->kind = static_cast<int32_t>(f.kind);
  e->reserved = 0;
  e->rank = ctx.rank;
  e->peer = f.peer;
  e->block = static_cast<int32_t>(blockIdx.x);
  e->thread = static_cast<int32_t>(threadIdx.x);
  e->cmp = f.cmp;
  e->valueBytes = f.valueBytes;
  e->addr = f.addr;
  e->expected = f.expected;
  e->seen = f.seen;
  e->elapsedNs = f.elapsedNs;
  int i = 0;
  const char* parts[3] = {l0, l1, l2};
  for (const char* part : parts) {
    for (int j = 0; part != nullptr && part[j] != '\0' && i < kDeviceErrorLabelLen - 1; j++)
      e->label[i++] = part[j];
  }
  e->label[i] = '\0';
  FenceSystem();
  AtomicStoreRelaxedSystem<uint32_t>(&e->abortFlag, 1u);
  return true;
}

// Records a timed-out wait (first error wins), prints one line, raises the abort flag.
template <typename T>
__device__ __noinline__ void RecordWaitTimeout(const WaitContext& ctx, int peer, const char* label,
                                               const T* addr, CmpOp op, T target, T seen,
                                               uint64_t elapsedNs) {
  const DeviceErrorFields f{DeviceErrorKind::kTimeout,        peer,
                            static_cast<int32_t>(op),         static_cast<int32_t>(sizeof(T)),
                            reinterpret_cast<uint64_t>(addr), static_cast<uint64_t>(target),
                            static_cast<uint64_t>(seen),      elapsedNs};
  if (RecordDeviceError(ctx, f, label)) {
    printf(
        "[MORI device timeout] rank %d block %d thread %d: waited %llu ns for %s on peer %d: "
        "*%p %s %llu, saw %llu\n",
        ctx.rank, (int)blockIdx.x, (int)threadIdx.x, (unsigned long long)elapsedNs,
        label ? label : "?", peer, (const void*)addr, CmpOpName(op), (unsigned long long)target,
        (unsigned long long)seen);
  }
}

// Records a violated check (first error wins), prints one line, raises the abort flag: `value`
// had to satisfy `value <op> required` and did not. `addr` is the word `value` was read from
// (nullptr: a value not in memory, e.g. a kernel argument). The host raises InvalidUsageError.
template <typename T>
__device__ __noinline__ void RecordUsageError(const WaitContext& ctx, int peer, const char* label,
                                              const T* addr, CmpOp op, T required, T value) {
  const DeviceErrorFields f{
      DeviceErrorKind::kUsage,          peer,
      static_cast<int32_t>(op),         addr != nullptr ? static_cast<int32_t>(sizeof(T)) : 0,
      reinterpret_cast<uint64_t>(addr), static_cast<uint64_t>(required),
      static_cast<uint64_t>(value),     0};
  if (RecordDeviceError(ctx, f, label) || ctx.err == nullptr) {
    printf(
        "[MORI device error] rank %d block %d thread %d: %s (peer %d): found %llu, required %s "
        "%llu (at %p)\n",
        ctx.rank, (int)blockIdx.x, (int)threadIdx.x, label ? label : "?", peer,
        (unsigned long long)value, CmpOpName(op), (unsigned long long)required, (const void*)addr);
  }
}

// How often a spinning wait looks at the abort flag. The flag lives in mapped host memory, so a
// look is a PCIe read; with hundreds of threads spinning, frequent looks slow every GPU of the job
// (measured: docs/performance.md, "Waits and the abort flag"). Reading it on a time schedule keeps
// aborts prompt (within 200 us) at a negligible cost.
constexpr uint64_t kAbortCheckFirstNs = 20000;    // the first look, after 20 us of waiting
constexpr uint64_t kAbortCheckPeriodNs = 200000;  // then every 200 us

namespace detail {
// The bounded spin behind WaitUntil and WaitUntilMasked: acquire loads until `done(v)`; on timeout
// records `*addr op target`, seen v.
template <typename T, typename Done>
MORI_DEVICE_INLINE bool SpinUntil(const WaitContext& ctx, T* addr, Done done, CmpOp op, T target,
                                  int peer, const char* label) {
  T v = AtomicLoadAcquireSystem(addr);
  if (done(v)) return true;
  const uint64_t start = WallClockNs();
  uint64_t nextAbortCheck = kAbortCheckFirstNs;
  for (uint32_t iter = 1;; iter++) {
    v = AtomicLoadAcquireSystem(addr);
    if (done(v)) return true;
    if ((iter & 63u) == 0) {
      const uint64_t elapsed = WallClockNs() - start;
      if (elapsed >= nextAbortCheck) {
        if (DeviceAborted(ctx)) return false;
        nextAbortCheck = elapsed + kAbortCheckPeriodNs;
      }
      if (elapsed > ctx.timeoutNs) {
        RecordWaitTimeout(ctx, peer, label, addr, op, target, v, elapsed);
        return false;
      }
      SpinPause();
    }
  }
}
}  // namespace detail

// Spin with acquire loads until `*addr op target`. See the header comment for the contract.
template <typename T>
MORI_DEVICE_INLINE bool WaitUntil(const WaitContext& ctx, T* addr, CmpOp op, T target, int peer,
                                  const char* label) {
  return detail::SpinUntil(
      ctx, addr, [&](T v) { return CompareValues(v, op, target); }, op, target, peer, label);
}

// Spin until `(*addr & mask) == (target & mask)` (tagged words: wait for a tag, whatever the
// value beside it). Same contract as WaitUntil; a timeout records `== target` and the whole word
// seen. On success *seen is the word (when seen != nullptr).
template <typename T>
MORI_DEVICE_INLINE bool WaitUntilMasked(const WaitContext& ctx, T* addr, T mask, T target, int peer,
                                        const char* label, T* seen = nullptr) {
  T last = 0;
  const bool ok = detail::SpinUntil(
      ctx, addr,
      [&](T v) {
        last = v;
        return (v & mask) == (target & mask);
      },
      CmpOp::kEq, target, peer, label);
  if (seen != nullptr) *seen = last;
  return ok;
}

#endif  // MORI_GPU_COMPILER

}  // namespace mori::core

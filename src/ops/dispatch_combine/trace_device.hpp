// Device side of the EP kernels' per-block phase trace (EpDispatchCombineHandle::SetTrace): where
// a block's record is and how thread 0 fills it. The layout, the stamp indices and their meaning:
// include/mori/ops/dispatch_combine/trace.hpp. Off (trace == nullptr) it costs one predictable
// branch per phase boundary.
#pragma once

#include <cstdint>

#include "kernel_args.hpp"
#include "mori/core/gpu.hpp"
#include "mori/ops/dispatch_combine/trace.hpp"

namespace mori::ops::detail {

MORI_DEVICE_INLINE uint32_t EpSmId() { return core::SmId(); }

MORI_DEVICE_INLINE uint64_t EpCycles() { return static_cast<uint64_t>(clock64()); }

// This block's record of this launch, or nullptr when tracing is off (or the block is beyond the
// buffer). Only thread 0 writes the stamps; other threads may write their own words.
MORI_DEVICE_INLINE uint64_t* EpTraceRecord(const EpKernelCommon& c, EpTraceKind kind,
                                           uint64_t epoch) {
  if (c.trace == nullptr || static_cast<int>(blockIdx.x) >= c.traceMaxBlocks || c.traceSlots <= 0)
    return nullptr;
  const size_t slot = static_cast<size_t>(epoch % static_cast<uint64_t>(c.traceSlots));
  return c.trace +
         ((static_cast<size_t>(static_cast<int>(kind)) * c.traceSlots + slot) * c.traceMaxBlocks +
          blockIdx.x) *
             kEpTraceWords;
}

// Stamp `s` (an EpCombineStamp / EpDispatchStamp): the GPU wall clock and the cycle counter.
MORI_DEVICE_INLINE void EpTraceStamp(uint64_t* r, int s) {
  if (r != nullptr) {
    r[kEpTraceWordTime + s] = core::WallClockNs();
    r[kEpTraceWordCycles + s] = EpCycles();
  }
}

// Clears the record, fills the launch's words and stamps the entry.
MORI_DEVICE_INLINE void EpTraceBegin(uint64_t* r, uint64_t epoch, int parts) {
  if (r != nullptr) {
    for (int i = 0; i < kEpTraceWords; i++) r[i] = 0;
    r[kEpTraceWordEpoch] = epoch;
    r[kEpTraceWordBlock] = blockIdx.x;
    r[kEpTraceWordSmId] = EpSmId();
    r[kEpTraceWordGrid] = gridDim.x;
    r[kEpTraceWordBlockDim] = blockDim.x;
    r[kEpTraceWordParts] = static_cast<uint64_t>(parts);
    r[kEpTraceWordMagic] = kEpTraceMagic;
    EpTraceStamp(r, kEpCombineEntry);  // the entry stamp of both kinds
  }
}

}  // namespace mori::ops::detail

// Debug-only per-block phase trace of the IntraNode kernels (EpDispatchCombineHandle::SetTrace,
// tools/bench/ep_trace.py). Off (trace == nullptr) it costs one predictable branch per phase
// boundary. On, thread 0 of every block writes one record per launch; the layout below is mirrored
// by tools/bench/ep_trace.py.
//
// Buffer: uint64 [2 kinds][slots][maxBlocks][kEpTraceWords]; kind 0 = combine, 1 = dispatch; the
// slot is epoch % slots (the kernel's own epoch: consecutive launches land in consecutive slots).
// Record words:
//   0..7   globaltimer (ns) at the stamp points, 8..15 clock64 at the same points (0: not reached)
//          combine : 0 entry, 1 phase 1 done (ready sent / copy counted), 2 phase 2 done (after
//                    the barrier: every peer's ready seen), 3 phase 3 done (after the barrier),
//                    4 after the per-block release fence, 5 after the grid-counter add (exit),
//                    6 last block only: done signals sent and epoch bumped
//          dispatch: 0 entry, 7 scan done (bitmap + prefix), 1 announce done (barrier), 4 counts
//                    of lower PEs seen (send base known), 6 rows copied (after the barrier),
//                    2 rows published (fence + arrived add), 3 receive side done (before the
//                    epoch barrier), 5 after the grid-counter add
//   16 epoch  17 block  18 SM id  19 arrival order at the grid counter (1-based; 0: unknown)
//   20 gridDim.x  21 blockDim.x  22 partsPerToken (combine)  23 kEpTraceMagic
//   24..31 combine: globaltimer when this block saw peer p's ready signal (p < 8)
//   24..31 dispatch: unused
#pragma once

#include <cstdint>

#include "intranode.hpp"
#include "mori/core/gpu.hpp"

namespace mori::ops::detail {

constexpr int kEpTraceWords = 32;
constexpr uint64_t kEpTraceMagic = 0x7ace0001ull;
constexpr int kEpTracePeers = 8;

MORI_DEVICE_INLINE uint32_t EpSmId() { return core::SmId(); }

MORI_DEVICE_INLINE uint64_t EpCycles() { return static_cast<uint64_t>(clock64()); }

// This block's record of this launch, or nullptr when tracing is off (or the block is beyond the
// buffer). Only thread 0 writes the stamps; other threads may write their own words.
enum class EpTraceKind : int { kCombine = 0, kDispatch = 1 };

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

MORI_DEVICE_INLINE void EpTraceStamp(uint64_t* r, int i) {
  if (r != nullptr) {
    r[i] = core::WallClockNs();
    r[8 + i] = EpCycles();
  }
}

MORI_DEVICE_INLINE void EpTraceBegin(uint64_t* r, uint64_t epoch, int parts) {
  if (r != nullptr) {
    for (int i = 0; i < kEpTraceWords; i++) r[i] = 0;
    r[16] = epoch;
    r[17] = blockIdx.x;
    r[18] = EpSmId();
    r[20] = gridDim.x;
    r[21] = blockDim.x;
    r[22] = static_cast<uint64_t>(parts);
    r[23] = kEpTraceMagic;
    EpTraceStamp(r, 0);
  }
}

}  // namespace mori::ops::detail

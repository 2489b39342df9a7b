// Which part of a dispatch or combine one kernel launch runs: the whole call, or one half of a
// split-phase call (EpDispatchCombineHandle::DispatchSend / DispatchReceive, CombineSend /
// CombineReceive; docs/ep_split_phase.md). The handle passes it to the kernels; users call the
// handle's methods and never pass a phase themselves.
#pragma once

#include <cstdint>

namespace mori::ops {

// kBoth: the fused dispatch. kSend: announce this PE's counts and write its rows into the
// destinations' staging slots, waiting on no peer. kReceive: wait for every PE's counts and staged
// rows and move them to their final rows (the outputs the fused dispatch gives).
enum class EpDispatchPhase : int32_t { kBoth = 0, kSend = 1, kReceive = 2 };

// Push combine only. kBoth: the whole combine. kSend: store this PE's rows into their tokens' PEs,
// waiting on no peer. kReceive: wait for every PE's rows of this PE's tokens and sum them.
enum class EpCombinePhase : int32_t { kBoth = 0, kSend = 1, kReceive = 2 };

}  // namespace mori::ops

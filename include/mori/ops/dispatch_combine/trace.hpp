// The per-block phase trace of the EP kernels: the record layout the kernels write (writers:
// src/ops/dispatch_combine/trace_device.hpp) and the clock sample that places the records' GPU
// timestamps on the host's wall clock. Readers: mori.ops.trace (Chrome-trace/Perfetto JSON, through
// the binding's TRACE_LAYOUT, built from these constants) and tools/bench/ep_trace.py.
//
// Tracing is on while EpDispatchCombineHandle::SetTrace holds a buffer: thread 0 of every block
// of every kernel launched (or graph-captured) afterwards writes one record per launch.
//
// Buffer: uint64 [kEpTraceKinds][slots][maxBlocks][kEpTraceWords], kind as EpTraceKind; the slot is
// epoch % slots (the kernel's own epoch: consecutive launches of a kind land in consecutive
// slots); blocks at or past maxBlocks write nothing.
//
// Record (kEpTraceWords words):
//   kEpTraceWordTime + s    GPU wall clock (ns: globaltimer, s_memrealtime on AMD) at stamp s
//   kEpTraceWordCycles + s  clock64 (the SM's cycle counter) at stamp s; 0 at both: not reached
//   kEpTraceWordEpoch       the launch's epoch (1-based count of launches of this kind)
//   kEpTraceWordBlock       blockIdx.x
//   kEpTraceWordSmId        the SM (CU) the block ran on
//   kEpTraceWordArrival     arrival order at the grid counter (1-based; 0: not reached)
//   kEpTraceWordGrid        gridDim.x        kEpTraceWordBlockDim  blockDim.x
//   kEpTraceWordParts       combine: partsPerToken (0 for dispatch)
//   kEpTraceWordMagic       kEpTraceMagic in the low 32 bits: the record was written
//   kEpTraceWordPeerReady + p   combine: GPU wall clock when this block saw peer p's ready
//                           signal (pull) or rows (push), p < kEpTracePeers; 0: not seen
// Stamp indices s are EpCombineStamp / EpDispatchStamp; a block passes them in the order of
// kEpCombineTracePhases / kEpDispatchTracePhases (each phase ends at its stamp and starts at the
// previous reached one, the first at the entry stamp).
#pragma once

#include <cstdint>

namespace mori::ops {

enum class EpTraceKind : int { kCombine = 0, kDispatch = 1 };
constexpr int kEpTraceKinds = 2;

constexpr int kEpTraceWords = 40;
constexpr int kEpTraceStamps = 12;  // stamp slots per record
constexpr int kEpTracePeers = 8;    // peers whose ready time a combine record holds
constexpr uint64_t kEpTraceMagic = 0x7ace0001ull;

constexpr int kEpTraceWordTime = 0;
constexpr int kEpTraceWordCycles = kEpTraceWordTime + kEpTraceStamps;
constexpr int kEpTraceWordEpoch = kEpTraceWordCycles + kEpTraceStamps;
constexpr int kEpTraceWordBlock = kEpTraceWordEpoch + 1;
constexpr int kEpTraceWordSmId = kEpTraceWordBlock + 1;
constexpr int kEpTraceWordArrival = kEpTraceWordSmId + 1;
constexpr int kEpTraceWordGrid = kEpTraceWordArrival + 1;
constexpr int kEpTraceWordBlockDim = kEpTraceWordGrid + 1;
constexpr int kEpTraceWordParts = kEpTraceWordBlockDim + 1;
constexpr int kEpTraceWordMagic = kEpTraceWordParts + 1;
constexpr int kEpTraceWordPeerReady = kEpTraceWordMagic + 1;
static_assert(kEpTraceWordPeerReady + kEpTracePeers == kEpTraceWords, "EP trace record layout");

// Combine stamps. Pull combine (large batches): sent = this PE's ready signal sent (input copied
// first when it is not the registered buffer); peers_ready = every peer's ready seen (+ block
// barrier); reduced = rows summed; fenced = after the block's release fence; counted = after the
// grid-counter add; tail = last block only: done signals sent and epoch bumped. Push combine
// (small batches): sent = rows pushed to their tokens' PEs (+ fence and arrival add); peers_ready =
// every PE's rows for our tokens arrived; reduced = summed from local memory; fenced = reduced (no
// fence of its own); tail = arrival counters checked and reset, epoch bumped. InterNodeV1/V1LL
// combine: sent = input in place, ready sent; peers_ready = the local PEs' rows ready;
// v1_summed = the proxy's partial sums of its rail peers' tokens written; proxied = those shares
// posted (the last block of a share: landFree wait, WRITE + tail); v1_own_summed = the owner's
// own-node sums written; v1_landed = every partial's landing tail seen (waits for the network);
// reduced = every node's partial summed; fenced, counted, tail as the pull combine. With more
// than two nodes the proxy loops over the rail peers: v1_summed is stamped in the last one.
// Kernels without these steps never stamp them (readers skip stamps that were not reached); the
// phases they end are named v1_*.
//
// Dispatch of InterNodeV1/V1LL: v1_staged = our records for the remote node scanned and staged
// (no wait); scanned = their shares posted (V1: after the credit); announced = rail peers' count
// records relayed (waits for the network); send_base = own-node counts announced; copied =
// own-node rows copied; v1_tails_seen = the rail peer's count record and tails seen (waits for
// the network; with more than two nodes: those of the last rail peer, after forwarding the
// others); published = the records forwarded; received and counted as IntraNode.
enum EpCombineStamp : int {
  kEpCombineEntry = 0,
  kEpCombineSent = 1,
  kEpCombinePeersReady = 2,
  kEpCombineReduced = 3,
  kEpCombineFenced = 4,
  kEpCombineCounted = 5,
  kEpCombineTail = 6,
  kEpCombineProxied = 7,
  kEpCombineV1Summed = 8,
  kEpCombineV1OwnSummed = 9,
  kEpCombineV1Landed = 10,
};

// Dispatch stamps, in the order a block passes them: entry; scanned (destination bitmap + prefix);
// announced (counts announced, after the block barrier); send_base (counts of lower PEs seen:
// where our rows go is known); copied (rows copied, after the barrier); published (fence + arrival
// add); received (block 0: every source's count and rows waited for and totals written; other
// blocks pass at once); counted (after the grid-counter add).
enum EpDispatchStamp : int {
  kEpDispatchEntry = 0,
  kEpDispatchAnnounced = 1,
  kEpDispatchPublished = 2,
  kEpDispatchReceived = 3,
  kEpDispatchSendBase = 4,
  kEpDispatchCounted = 5,
  kEpDispatchCopied = 6,
  kEpDispatchScanned = 7,
  kEpDispatchV1Staged = 8,
  kEpDispatchV1TailsSeen = 9,
};
static_assert(static_cast<int>(kEpCombineEntry) == static_cast<int>(kEpDispatchEntry),
              "one entry stamp (EpTraceBegin)");

// One phase of a block: from the previous reached stamp (the entry stamp for the first) to `stamp`.
struct EpTracePhase {
  int stamp;
  const char* name;
};

inline constexpr EpTracePhase kEpCombineTracePhases[] = {
    {kEpCombineSent, "send"},
    {kEpCombinePeersReady, "wait_peers"},
    {kEpCombineV1Summed, "v1_proxy_sums"},
    {kEpCombineProxied, "v1_post_partials"},
    {kEpCombineV1OwnSummed, "v1_own_sums"},
    {kEpCombineV1Landed, "v1_landing_wait"},
    {kEpCombineReduced, "reduce"},
    {kEpCombineFenced, "fence"},
    {kEpCombineCounted, "grid_counter"},
    {kEpCombineTail, "tail"},
};
inline constexpr EpTracePhase kEpDispatchTracePhases[] = {
    {kEpDispatchV1Staged, "v1_stage"},    {kEpDispatchScanned, "scan"},
    {kEpDispatchAnnounced, "announce"},   {kEpDispatchSendBase, "count_wait"},
    {kEpDispatchCopied, "copy"},          {kEpDispatchV1TailsSeen, "v1_tail_wait"},
    {kEpDispatchPublished, "publish"},    {kEpDispatchReceived, "receive"},
    {kEpDispatchCounted, "grid_counter"},
};

// A simultaneous reading of the host's CLOCK_REALTIME and a GPU's wall clock (the clock of the
// records' time words): the GPU clock was read at some host time in
// [hostNs - uncertaintyNs, hostNs + uncertaintyNs].
struct EpTraceClockSample {
  int64_t hostNs = 0;
  uint64_t deviceNs = 0;
  int64_t uncertaintyNs = 0;
};

}  // namespace mori::ops

// Every byte the dispatch/combine handle allocates, in one place: the symmetric block (same
// offsets on every PE, reached by peers over P2P) and the local block (this PE only), plus the
// size hints callers can use before allocating anything.
//
// Plain C++ (usable without a GPU runtime); the index helpers are host+device when compiled by
// a GPU compiler.
//
// Symmetric block (one ShmemMallocAlign per handle), offsets from its start, each 256-aligned:
//   countInbox    EpSignal[2][W][W]     [parity][src][dst]: src's token count for dst (+format)
//   expertInbox   int32[2][W][Epr]      [parity][src][e]:  src's tokens for our local expert e
//                                       (no tags: published with src's count signal to us)
//   readyInbox    EpSignal[2][W]        [parity][src]:     src's combine input is ready (+source)
//   doneInbox     EpSignal[W]           [src]:             src finished reading our buffers
//   arrived       uint64[W]             [src]:             rows src has finished writing to us
//   dispatchOutTokens   [Rmax][rowBytes]          rows received by dispatch (compact)
//   dispatchOutWeights  [Rmax][K] float
//   dispatchOutScales   [Rmax][scaleBytes]        (absent when scaleDim == 0)
//   dispatchOutIndices  [Rmax][K] int64-sized     (int32 calls use a [Rmax][K] int32 prefix)
//   dispatchOutSrcPos   [Rmax] int32              srcRank * maxNumInpTokenPerRank + srcToken
//   combineInTokens     [Rmax][rowBytes]          the registered (zero-copy) combine input
//   combineInWeights    [Rmax][K] float
//   pushArrived         uint64[2][W]              [parity][src]: 16-byte vectors src pushed to us
//   pushRecvTokens      [2][M][W][rowBytes]       [parity][t][d]: row of our token t from PE d
//   pushRecvWeights     [2][M][W][K] float        (the push buffers only when EpPushCombineFits)
// where W = worldSize, Epr = numExpertsPerRank, K = numExpertsPerToken, Rmax = W *
// maxNumInpTokenPerRank, rowBytes = hiddenDim * maxTokenTypeSize at most (a call packs its rows
// with its own row size).
//
// Push combine (small-batch configs, EpPushCombineFits): instead of every PE pulling its tokens'
// rows from the PEs that hold them, each PE pushes the rows it holds to their tokens' PEs
// (pushRecvTokens, one slot per token and PE), then sums locally. Double-buffered by the combine
// epoch's parity, as readyInbox (which carries the push combine's format signal): combine may be
// called several times after one dispatch, and a PE may then be one call ahead. See docs/ep.md.
//
// Local block (one device allocation per handle):
//   state         EpDeviceState              epochs and grid counters (kernels update them)
//   totalRecv     int32                      rows received by the last dispatch
//   localExpertCount int32[Epr]              received tokens per local expert (last dispatch)
//   tokenSlot     int32[M][W]                row of token t on PE d, or -1 (last dispatch)
//   combineOutWeights [M][K] float
//   combineOutTokens  [M][rowBytes]
#pragma once

#include <cstddef>
#include <cstdint>

#include "mori/ops/dispatch_combine/config.hpp"
#include "mori/core/hd.hpp"

#define MORI_EP_HD MORI_HD

namespace mori::ops {

constexpr size_t kEpBufferAlign = 256;

// A signal slot: `value` is written first, then `tag` (the call's epoch) with release order; a
// reader waits for the tag and then reads the value. Epochs are 64-bit and never wrap. doneInbox
// slots carry only the tag (their value is not written).
struct EpSignal {
  uint64_t tag;
  uint64_t value;
};
static_assert(sizeof(EpSignal) == 16, "EpSignal must be 16 bytes");

// Per-handle device state in local memory. Only the kernels touch it after construction.
struct EpDeviceState {
  uint64_t dispatchEpoch;          // dispatch calls completed on this PE
  uint64_t combineEpoch;           // combine calls completed on this PE
  uint32_t dispatchBlocksDone;     // grid counter: last block bumps the epoch and resets it
  uint32_t combineBlocksDone;
  uint32_t combineCopyBlocksDone;  // grid counter of the external-input copy
  uint32_t combineNextItem;        // combine work queue (items beyond the first round); last block
                                   // resets it
  uint32_t combineFailed;           // push combine: a block failed (the last block then does not
                                   // judge the arrival counts); last block resets it
  // Written by dispatch for the push combine: sendCount[d] = our tokens routed to PE d,
  // recvCount[s] = rows received from PE s (last dispatch).
  int32_t sendCount[kEpMaxWorldSize];
  int32_t recvCount[kEpMaxWorldSize];
};

struct EpSymmetricLayout {
  size_t countInbox = 0;
  size_t expertInbox = 0;
  size_t readyInbox = 0;
  size_t doneInbox = 0;
  size_t arrived = 0;
  size_t dispatchOutTokens = 0;
  size_t dispatchOutWeights = 0;
  size_t dispatchOutScales = 0;
  size_t dispatchOutIndices = 0;
  size_t dispatchOutSrcPos = 0;
  size_t combineInTokens = 0;
  size_t combineInWeights = 0;
  size_t pushArrived = 0;      // the push buffers' offsets are 0 (and their sizes 0) when the
  size_t pushRecvTokens = 0;   // config has too many tokens per rank for them
  size_t pushRecvWeights = 0;
  size_t totalBytes = 0;
};

struct EpLocalLayout {
  size_t state = 0;
  size_t totalRecv = 0;
  size_t localExpertCount = 0;
  size_t tokenSlot = 0;
  size_t combineOutWeights = 0;
  size_t combineOutTokens = 0;
  size_t totalBytes = 0;
};

// Push combine buffers exist (and the push combine may run) when a config has at most this many
// tokens per rank: they cost maxNumInpTokenPerRank x W rows per PE.
constexpr int kEpPushCombineMaxTokens = 256;
inline bool EpPushCombineFits(const EpDispatchCombineConfig& config) {
  return config.maxNumInpTokenPerRank <= kEpPushCombineMaxTokens;
}

// Layouts for a config (Validate() it first; sizes are computed in size_t).
EpSymmetricLayout MakeEpSymmetricLayout(const EpDispatchCombineConfig& config);
EpLocalLayout MakeEpLocalLayout(const EpDispatchCombineConfig& config);

// Size hints: bytes of symmetric heap (MORI_SHMEM_HEAP_SIZE must leave room for it) and of
// ordinary device memory a handle for `config` allocates. They validate the config.
size_t EpSymmetricBytes(const EpDispatchCombineConfig& config);
size_t EpLocalBytes(const EpDispatchCombineConfig& config);
// Dynamic shared memory of the IntraNode dispatch kernel (membership bitmap, word prefix sums,
// expert histogram); Validate() keeps it within kEpMaxDispatchSmemBytes.
size_t EpDispatchSmemBytes(const EpDispatchCombineConfig& config, int warpSize);
constexpr size_t kEpMaxDispatchSmemBytes = 40 * 1024;

// --- index helpers (element indices into the arrays above) ---------------------------------
MORI_EP_HD inline size_t EpCountInboxIndex(int parity, int src, int dst, int worldSize) {
  return (static_cast<size_t>(parity) * worldSize + src) * worldSize + dst;
}
MORI_EP_HD inline size_t EpExpertInboxIndex(int parity, int src, int expert, int worldSize,
                                            int expertsPerRank) {
  return (static_cast<size_t>(parity) * worldSize + src) * expertsPerRank + expert;
}
MORI_EP_HD inline size_t EpReadyInboxIndex(int parity, int src, int worldSize) {
  return static_cast<size_t>(parity) * worldSize + src;
}
// Push combine: slot of token `t`'s row from PE `pe` in pushRecvTokens (rows) / pushRecvWeights
// (rows of K floats), and the arrival counter of `pe` in pushArrived, for a call of `parity`.
MORI_EP_HD inline size_t EpPushSlot(int parity, int t, int pe, int maxTokens, int worldSize) {
  return (static_cast<size_t>(parity) * maxTokens + t) * worldSize + pe;
}
MORI_EP_HD inline size_t EpPushArrivedIndex(int parity, int pe, int worldSize) {
  return static_cast<size_t>(parity) * worldSize + pe;
}

// --- payload encodings ---------------------------------------------------------------------
// countInbox value: count in bits 0..31, the dispatch "format" (row size, dtype, index type) in
// bits 32..63. Every PE of one call must use the same format; a PE that sees another one records
// an error instead of writing or reading misplaced rows. (Whether a call passes weights/scales is
// not part of it: a PE without tokens may pass neither.)
MORI_EP_HD inline uint64_t EpDispatchFormat(uint32_t rowBytes, int dataType, int indexType) {
  return (static_cast<uint64_t>(rowBytes / 16u) & 0xFFFFFull) |
         (static_cast<uint64_t>(dataType & 0xF) << 20) |
         (static_cast<uint64_t>(indexType & 0x1) << 24);
}
MORI_EP_HD inline uint64_t EpPackCount(uint32_t count, uint64_t format) {
  return static_cast<uint64_t>(count) | (format << 32);
}
MORI_EP_HD inline uint32_t EpCountOf(uint64_t packed) { return static_cast<uint32_t>(packed); }
MORI_EP_HD inline uint64_t EpFormatOf(uint64_t packed) { return packed >> 32; }

// Where a PE's combine input rows (and weights) are, announced with its ready signal (readyInbox
// value; the push combine sends the same value, and there only "no weights" matters).
enum class EpCombineSource : uint32_t {
  kNone = 0,         // weights only: the PE passed no weights
  kRegistered = 1,   // combineInTokens / combineInWeights (zero-copy, or copied there)
  kDispatchOut = 2,  // dispatchOutTokens / dispatchOutWeights (input was the dispatch output)
};
// readyInbox value: token source bits 0..3, weight source bits 4..7, dtype bits 8..11, row
// bytes bits 16..47.
MORI_EP_HD inline uint64_t EpPackReady(EpCombineSource tokens, EpCombineSource weights,
                                       int dataType, uint32_t rowBytes) {
  return static_cast<uint64_t>(tokens) | (static_cast<uint64_t>(weights) << 4) |
         (static_cast<uint64_t>(dataType & 0xF) << 8) | (static_cast<uint64_t>(rowBytes) << 16);
}
MORI_EP_HD inline EpCombineSource EpReadyTokens(uint64_t v) {
  return static_cast<EpCombineSource>(v & 0xF);
}
MORI_EP_HD inline EpCombineSource EpReadyWeights(uint64_t v) {
  return static_cast<EpCombineSource>((v >> 4) & 0xF);
}
MORI_EP_HD inline uint64_t EpReadyFormat(uint64_t v) { return v >> 8; }

}  // namespace mori::ops

// Every byte the dispatch/combine handle allocates, in one place: the symmetric block (same
// offsets on every PE, reached by peers over P2P or RDMA), the local block (this PE only) and the
// expert-major block (this PE only, allocated on first use), plus the size hints callers can use
// before allocating anything.
//
// Plain C++ (usable without a GPU runtime); the index helpers are host+device when compiled by
// a GPU compiler.
//
// The regions are ONE table per block (MORI_EP_SYMMETRIC_REGIONS / MORI_EP_LOCAL_REGIONS below):
// name, size for a config, and role. The offsets (EpSymmetricLayout / EpLocalLayout), the
// creation-time agreement rows (agreement.cpp), mori.ops.ep_layout() and the test helper
// debug_fill_buffers (regions of role kOutput) are all derived from it. A region a config does not
// use (the push buffers of a large-batch config, the inter-node regions of an IntraNode op) has
// size 0 and offset 0.
//
// W = worldSize, Epr = numExpertsPerRank, K = numExpertsPerToken, M = maxNumInpTokenPerRank,
// Rmax = MaxNumRecvTokens() (W * M, or max_total_recv_tokens when set), rowBytes = hiddenDim *
// maxTokenTypeSize at most (a call packs its rows with its own row size), G = gpuPerNode.
//
// Push combine (small-batch IntraNode and InterNode configs and every AsyncLL config,
// EpPushCombineFits): instead of every PE pulling its tokens' rows from the PEs that hold them,
// each PE pushes the rows it holds to their tokens' PEs (pushRecvTokens, one slot per token and
// same-node PE; InterNode: pushLand* by RDMA from another node's PEs), then sums locally.
// Double-buffered by the combine epoch's parity, as readyInbox (which carries the push combine's
// format signal): combine may be called several times after one dispatch, and a PE may then be one
// call ahead. See docs/ep.md.
//
// Inter-node regions (kernel type InterNode): PEs of other nodes are reached by RDMA, so every
// signal they write is one tagged 8-byte word (EpTagWord: the call's epoch in the high half), rows
// travel from registered staging by RDMA WRITE, and combine rows come back into a landing region of
// their token's PE. See docs/ep.md.
//
// Node-deduplicated regions (kernel types InterNodeV1, InterNodeV1LL; docs/ep_internode_v1.md §3):
// a PE sends each of its tokens at most once per remote node, as one record, to its rail peer
// there, which forwards it over P2P (v1Inbox -> the IntraNode outputs of its node) and in combine
// returns one partial sum per token (v1PartialOut -> the owner's v1Landing). Remote node n is kept
// at slot (n - myNode - 1) mod N. Parity P = 2 for V1LL (dispatch k % 2, combine e % 2), 1 for V1.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "mori/core/host_device.hpp"
#include "mori/ops/dispatch_combine/config.hpp"

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
  uint64_t dispatchEpoch;       // dispatch calls completed on this PE
  uint64_t combineEpoch;        // combine calls completed on this PE
  uint32_t dispatchBlocksDone;  // grid counter: last block bumps the epoch and resets it
  uint32_t combineBlocksDone;
  uint32_t combineCopyChunksDone;  // external-input copy: chunks copied; the block that completes
                                   // the last one signals "ready" and resets it
  uint32_t combineCopyNextChunk;   // external-input copy: chunks claimed (+ one failed claim per
                                   // block); the last block of the grid resets it
  uint32_t combineNextItem;        // combine work queue (items beyond the first round); last block
                                   // resets it
  uint32_t combineFailed;          // push combine: a block failed (the last block then does not
                                   // judge the arrival counts); last block resets it
  uint32_t dispatchFailed;         // split dispatch receive: a block failed (as combineFailed)
  uint32_t pushNextShare;          // push combine: step 2's shares claimed (tickets; claims past
                                   // the last share fail); the last block of the grid resets it
  uint32_t pushSharesDone;  // push combine: shares pushed (and, InterNode, prepared for other
                            // nodes); the block completing the last posts the WRITEs, resets it
  // Written by dispatch for the push and InterNode combines: sendCount[d] = our tokens routed to
  // PE d, recvCount[s] = rows received from PE s (last dispatch).
  int32_t sendCount[kEpMaxWorldSize];
  int32_t recvCount[kEpMaxWorldSize];
  // Dispatch: rows of the pool at the end of our list for PE d claimed so far (claims past the
  // pool fail); the last block of the grid that claimed (EpDispatchBlockDone), or after a split
  // send that of the receive half (the op allows no second send before it), resets them.
  uint32_t dispatchNextItem[kEpMaxWorldSize];
  // InterNode dispatch: blocks of the group serving another node's PE d that have staged their
  // rows; the last one posts the group's RDMA WRITEs and resets it.
  uint32_t stagedBlocks[kEpMaxWorldSize];
  // InterNodeV1/V1LL, per remote node slot m (and channel): blocks that finished packing our
  // records for node m (dispatch), forwarding the records of m's rail peer (dispatch, V1: the last
  // posts the credit), summing the partials of m's rail peer on each channel (combine: the last
  // posts them); a local PE without weights contributed to the partials of (m, channel). The last
  // block of each group resets its counter.
  uint32_t v1Packed[kEpMaxWorldSize];
  uint32_t v1Forwarded[kEpMaxWorldSize];
  uint32_t v1Summed[kEpMaxWorldSize * kEpV1MaxChannels];
  uint32_t v1NoWeights[kEpMaxWorldSize * kEpV1MaxChannels];
  // Last dispatch: records of the rail peer of slot m for our node (what our combine returns to
  // it), and our records for node slot m (what our combine waits for).
  int32_t v1InRecords[kEpMaxWorldSize];
  int32_t v1OutRecords[kEpMaxWorldSize];
  // InterNodeV1/V1LL dispatch: the first receive-capacity overflow found this call
  // (EpKeepCapOverflow); the grid's last block records it once the call's signals are out and
  // clears it.
  uint64_t v1CapOverflow;
  // EpCombinePrecopyKernel: its checks failed (it signalled ready to this PE only); the IntraNode
  // combine kernel beside it reads it after that ready, its last block resets it.
  uint32_t combinePrecopyFailed;
};

// EpCombinePrecopyKernel copies an external combine input in chunks of this many rows (aligned in
// the receive buffer) and tags each chunk on the PE whose tokens its rows belong to
// (combineRowsReady), so that PE's combine may read those rows while the rest are copied.
constexpr size_t kEpCombineCopyRows = 8;
MORI_HD constexpr size_t EpCombineCopyChunks(size_t rmax) {
  return (rmax + kEpCombineCopyRows - 1) / kEpCombineCopyRows;
}

// The sizes regions are computed from (EpLayoutDims(config)).
struct EpLayoutDims {
  size_t w, k, m, epr;
  size_t rmax;       // receive capacity in rows
  size_t row;        // largest token row, bytes
  size_t scaleRow;   // scales row, bytes
  size_t push;       // 1: the push-combine buffers exist (EpPushCombineFits), else 0
  size_t split;      // 1: the split-phase dispatch staging exists (EpSplitDispatchFits), else 0
  size_t inter;      // 1: the inter-node regions exist (kernel type InterNode), else 0
  size_t landing;    // rows of the landing region: M * min(K, W)
  size_t local;      // PEs per node as the kernels see them (KernelLocalSize: W on one node)
  size_t markWords;  // 32-bit words of one expert's row bitmap: ceil(rmax / 32)
  size_t hidden;     // hiddenDim
  size_t fp8;        // 1: combine rows travel as e4m3 (quant_type fp8_direct_cast), else 0
  // InterNodeV1/V1LL (all 0 otherwise): remote nodes N - 1, PEs per node G, parity sets (2 for
  // V1LL, 1 for V1), 1 for V1 (credits, landFree), channels Q, largest dispatch record and partial
  // (bytes), 8-byte words of one count record.
  size_t v1Nodes, g, v1Par, v1Ht, v1Q, v1Rec, v1Part, v1CountWords;
};

// What a region holds: kControl (signals, counters: zeroed at creation, kernels keep them
// consistent), kOutput (results callers read; debug_fill_buffers poisons them), kInput (buffers
// callers may write, e.g. the zero-copy combine input), kStaging (kernel-private data).
enum class EpRegionRole : int32_t { kControl = 0, kOutput = 1, kInput = 2, kStaging = 3 };
const char* EpRegionRoleName(EpRegionRole role);

// X(field, python name, bytes, role). Order is layout order.
// An X-macro table, one row per entry, laid out by hand:
// clang-format off
#define MORI_EP_SYMMETRIC_REGIONS(X, d)                                                           \
  /* [parity][src][dst] src's token count for dst (+format); IntraNode */                         \
  X(countInbox, "count_inbox", 2 * d.w * d.w * sizeof(EpSignal), kControl)                       \
  /* [parity][src][e] src's tokens for our local expert e (published with src's count signal) */ \
  X(expertInbox, "expert_inbox", 2 * d.w * d.epr * sizeof(int32_t), kControl)                    \
  /* [parity][src] src's combine input is ready (+ where it is) */                                 \
  X(readyInbox, "ready_inbox", 2 * d.w * sizeof(EpSignal), kControl)                             \
  /* [src] src finished reading our buffers (tag only) */                                          \
  X(doneInbox, "done_inbox", d.w * sizeof(EpSignal), kControl)                                   \
  /* [src] rows src (same node) has finished writing to us */                                      \
  X(arrived, "arrived", d.w * sizeof(uint64_t), kControl)                                        \
  /* [parity][src] src's input-error report (EpPackInputError) of the dispatch of that parity, */  \
  /* written only when src flags its count for us (kEpDispatchFormatInputError): by src, or by */ \
  /* the rail peer relaying src's count record (V1); published by that count signal            */ \
  X(inputErrorInbox, "input_error_inbox", 2 * d.w * sizeof(uint64_t), kControl)                  \
  X(dispatchOutTokens, "dispatch_out_tokens", d.rmax * d.row, kOutput)                           \
  X(dispatchOutWeights, "dispatch_out_weights", d.rmax * d.k * sizeof(float), kOutput)           \
  X(dispatchOutScales, "dispatch_out_scales", d.rmax * d.scaleRow, kOutput)                      \
  /* int64-sized; int32 calls use a [Rmax][K] int32 prefix */                                      \
  X(dispatchOutIndices, "dispatch_out_indices", d.rmax * d.k * sizeof(int64_t), kOutput)         \
  /* srcRank * M + srcToken */                                                                     \
  X(dispatchOutSrcPos, "dispatch_out_src_pos", d.rmax * sizeof(int32_t), kOutput)                \
  X(combineInTokens, "combine_in_tokens", d.rmax * d.row, kInput)                                \
  X(combineInWeights, "combine_in_weights", d.rmax * d.k * sizeof(float), kInput)                \
  /* [src][c] tag (combine epoch): src copied the rows of our tokens among its input rows */    \
  /* c * kEpCombineCopyRows .. + kEpCombineCopyRows - 1 into its registered buffer (precopy)   */ \
  X(combineRowsReady, "combine_rows_ready", d.w * EpCombineCopyChunks(d.rmax) * sizeof(uint64_t), \
    kControl)                                                                                     \
  /* [parity][src] 16-byte vectors src pushed to us */                                             \
  X(pushArrived, "push_arrived", d.push * 2 * d.w * sizeof(uint64_t), kControl)                  \
  /* [parity][t][j] row of our token t from the PE of local index j on our node */                \
  X(pushRecvTokens, "push_recv_tokens", d.push * 2 * d.m * d.local * d.row, kStaging)             \
  X(pushRecvWeights, "push_recv_weights", d.push * 2 * d.m * d.local * d.k * sizeof(float),       \
    kStaging)                                                                                     \
  /* push combine, InterNode: [parity][src] tagged word {epoch, EpLandingValue}: src (another */  \
  /* node) has RDMA-written its rows for our tokens into pushLand* of this parity */              \
  X(pushLandTail, "push_land_tail", d.push * d.inter * 2 * d.w * sizeof(uint64_t), kControl)      \
  /* push combine, InterNode: [parity][landing rows] as landingTokens / landingWeights */         \
  X(pushLandTokens, "push_land_tokens", d.push * d.inter * 2 * d.landing * d.row, kStaging)       \
  X(pushLandWeights, "push_land_weights",                                                         \
    d.push * d.inter * 2 * d.landing * d.k * sizeof(float), kStaging)                             \
  /* split-phase dispatch: [parity][src] rows src's dispatch_send has finished writing to us */   \
  X(splitArrived, "split_arrived", d.split * 2 * d.w * sizeof(uint64_t), kControl)               \
  /* split-phase dispatch: [parity][src][j] src's j-th row for us (EpSplitRow), metadata alike */ \
  X(splitTokens, "split_tokens", d.split * 2 * d.w * d.m * d.row, kStaging)                      \
  X(splitWeights, "split_weights", d.split * 2 * d.w * d.m * d.k * sizeof(float), kStaging)      \
  X(splitScales, "split_scales", d.split * 2 * d.w * d.m * d.scaleRow, kStaging)                 \
  X(splitIndices, "split_indices", d.split * 2 * d.w * d.m * d.k * sizeof(int64_t), kStaging)    \
  X(splitSrcPos, "split_src_pos", d.split * 2 * d.w * d.m * sizeof(int32_t), kStaging)           \
  /* split-phase dispatch, InterNode: [parity][src] tagged word {epoch, rows}: src (another    */ \
  /* node) has RDMA-written its staged rows for us                                             */ \
  X(splitTail, "split_tail", d.split * d.inter * 2 * d.w * sizeof(uint64_t), kControl)           \
  /* InterNode: [parity][src][dst][2] tagged words {count, format} of src's tokens for dst */     \
  X(interCount, "inter_count", d.inter * 2 * d.w * d.w * 2 * sizeof(uint64_t), kControl)         \
  /* InterNode: [src] tagged word: src's RDMA rows to us are complete (value: rows) */             \
  X(interTail, "inter_tail", d.inter * d.w * sizeof(uint64_t), kControl)                         \
  /* InterNode: [dst] tagged word: dst's combine rows for us have landed (value: format) */        \
  X(landingReady, "landing_ready", d.inter * d.w * sizeof(uint64_t), kControl)                   \
  /* InterNode: [dst][M] rows (and metadata) for another node's PE dst, packed before the WRITE */ \
  X(stageTokens, "stage_tokens", d.inter * d.w * d.m * d.row, kStaging)                          \
  X(stageWeights, "stage_weights", d.inter * d.w * d.m * d.k * sizeof(float), kStaging)          \
  X(stageScales, "stage_scales", d.inter * d.w * d.m * d.scaleRow, kStaging)                     \
  X(stageIndices, "stage_indices", d.inter * d.w * d.m * d.k * sizeof(int64_t), kStaging)        \
  X(stageSrcPos, "stage_src_pos", d.inter * d.w * d.m * sizeof(int32_t), kStaging)               \
  X(stageHist, "stage_hist", d.inter * d.w * d.epr * sizeof(int32_t), kStaging)                  \
  /* InterNode: rows of our tokens returned by other nodes' PEs, by destination then list index */ \
  X(landingTokens, "landing_tokens", d.inter * d.landing * d.row, kStaging)                      \
  X(landingWeights, "landing_weights", d.inter * d.landing * d.k * sizeof(float), kStaging)       \
  /* quant_type fp8_direct_cast: [Rmax][hidden] e4m3 codes of our combine input (what peers read) */ \
  X(combineInFp8, "combine_in_fp8", d.fp8 * d.rmax * d.hidden, kStaging)                          \
  /* V1: [k%2][m][words] tagged count record of m's rail peer (EpV1CountWord order) */             \
  X(v1CountRec, "v1_count_rec", 2 * d.v1Nodes * d.v1CountWords * 8, kControl)                     \
  /* V1: [P][m][c] tagged word: records of channel c of m's rail peer landed (value: records) */   \
  X(v1Tail, "v1_tail", d.v1Par * d.v1Nodes * d.v1Q * 8, kControl)                                 \
  /* V1 (not LL): [m] tagged word: m's rail peer forwarded all our records of call k (value 0) */ \
  X(v1Credit, "v1_credit", d.v1Ht * d.v1Nodes * 8, kControl)                                      \
  /* V1: [P][m][c] tagged word: partials of channel c from m's rail peer landed (EpV1LandValue) */ \
  X(v1LandTail, "v1_land_tail", d.v1Par * d.v1Nodes * d.v1Q * 8, kControl)                        \
  /* V1 (not LL): [m] tagged word: m's rail peer finished reading its landing (value 0) */         \
  X(v1LandFree, "v1_land_free", d.v1Ht * d.v1Nodes * 8, kControl)                                 \
  /* V1: [P][m][M] records of m's rail peer for our node (RDMA), read by our forwarders */          \
  X(v1Inbox, "v1_inbox", d.v1Par * d.v1Nodes * d.m * d.v1Rec, kStaging)                           \
  /* V1: [P][m][M] partials of our tokens from node m's rail peer (RDMA), read by our combine */    \
  X(v1Landing, "v1_landing", d.v1Par * d.v1Nodes * d.m * d.v1Part, kStaging)                      \
  /* V1: [m][M] our records for node m, packed for the WRITE (read by the NIC) */                  \
  X(v1SendStage, "v1_send_stage", d.v1Nodes * d.m * d.v1Rec, kStaging)                           \
  /* V1: [m][words] our count record for node m (read by the NIC) */                               \
  X(v1CountSend, "v1_count_send", d.v1Nodes * d.v1CountWords * 8, kStaging)                      \
  /* V1: [m][M] partial sums of m's rail peer's tokens, for the WRITE (read by the NIC) */          \
  X(v1PartialOut, "v1_partial_out", d.v1Nodes * d.m * d.v1Part, kStaging)
// clang-format on

// An X-macro table, one row per entry, laid out by hand:
// clang-format off
#define MORI_EP_LOCAL_REGIONS(X, d)                                                               \
  /* epochs and grid counters (kernels update them) */                                             \
  X(state, "state", sizeof(EpDeviceState), kControl)                                             \
  /* rows received by the last dispatch */                                                         \
  X(totalRecv, "total_recv", sizeof(int32_t), kOutput)                                           \
  /* received tokens per local expert (last dispatch) */                                           \
  X(localExpertCount, "local_expert_count", d.epr * sizeof(int32_t), kOutput)                    \
  /* [M][W] row of token t on PE d, or -1 (last dispatch) */                                       \
  X(tokenSlot, "token_slot", d.m * d.w * sizeof(int32_t), kControl)                              \
  X(combineOutWeights, "combine_out_weights", d.m * d.k * sizeof(float), kOutput)                \
  X(combineOutTokens, "combine_out_tokens", d.m * d.row, kOutput)                               \
  /* V1: [m][M][G] row where our forwarders put record i of m's rail peer on local PE g, or -1 */ \
  X(v1Route, "v1_route", d.v1Nodes * d.m * d.g * sizeof(int32_t), kControl)                      \
  /* V1: [M][m] index of our token t in our list for node slot m, or -1 (last dispatch) */         \
  X(v1ListPos, "v1_list_pos", d.m * d.v1Nodes * sizeof(int32_t), kControl)
// clang-format on

// The expert-major ("standard MoE") block: ordinary device memory a handle allocates at its first
// ConvertDispatchOutput (handle.hpp), never before. [e][slot] = local expert e, slot < Rmax (a
// row reaches an expert at most once); valid slots: [0, counts[e]).
// An X-macro table, one row per entry, laid out by hand:
// clang-format off
#define MORI_EP_EXPERT_MAJOR_REGIONS(X, d)                                                        \
  /* [Epr][Rmax] rows of the last dispatch, grouped by local expert, received-row order */        \
  X(tokens, "tokens", d.epr * d.rmax * d.row, kOutput)                                           \
  X(scales, "scales", d.epr * d.rmax * d.scaleRow, kOutput)                                      \
  /* [Epr] rows per local expert */                                                                \
  X(counts, "counts", d.epr * sizeof(int32_t), kOutput)                                          \
  /* [Epr][Rmax] received-row index of each slot */                                                \
  X(srcRows, "src_rows", d.epr * d.rmax * sizeof(int32_t), kOutput)                              \
  /* [Epr][Rmax] srcRank * M + srcToken of each slot */                                            \
  X(srcPos, "src_pos", d.epr * d.rmax * sizeof(int32_t), kOutput)                                \
  /* [Epr][markWords] bit r: received row r has expert e; all zero between conversions */        \
  X(marks, "marks", d.epr * d.markWords * sizeof(uint32_t), kControl)                            \
  /* [Rmax][K] slot of (row, k) under the row's k-th expert, -1 where that expert is not local */ \
  X(rowSlot, "row_slot", d.rmax * d.k * sizeof(int32_t), kStaging)
// clang-format on

#define MORI_EP_LAYOUT_FIELD(field, name, bytes, role) size_t field = 0;
struct EpExpertMajorLayout {
  MORI_EP_EXPERT_MAJOR_REGIONS(MORI_EP_LAYOUT_FIELD, _)
  size_t totalBytes = 0;
};
struct EpSymmetricLayout {
  MORI_EP_SYMMETRIC_REGIONS(MORI_EP_LAYOUT_FIELD, _)
  size_t totalBytes = 0;
};
struct EpLocalLayout {
  MORI_EP_LOCAL_REGIONS(MORI_EP_LAYOUT_FIELD, _)
  size_t totalBytes = 0;
};
#undef MORI_EP_LAYOUT_FIELD

// One region of a layout, as the table describes it (bytes 0: unused by this config).
struct EpRegionInfo {
  const char* name;
  size_t offset;
  size_t bytes;
  EpRegionRole role;
};

// Push combine buffers exist (and the push combine, the one with a split phase, may run) for
// every AsyncLL config and for IntraNode and InterNode configs of at most this many tokens per
// rank: they cost 2 x maxNumInpTokenPerRank x (PEs per node) rows per PE, and InterNode two
// landing sets more. (AsyncLL is the split-phase type: its buffers are sized for its tokens per
// rank, whatever their number; each call's launch shape follows the call's tokens.)
constexpr int kEpPushCombineMaxTokens = 256;
inline bool EpPushCombineFits(const EpDispatchCombineConfig& config) {
  const EpDispatchCombineKernelType t = config.RunsAs();
  return (t == EpDispatchCombineKernelType::kIntraNode ||
          t == EpDispatchCombineKernelType::kInterNode) &&
         (config.kernelType == EpDispatchCombineKernelType::kAsyncLL ||
          config.maxNumInpTokenPerRank <= kEpPushCombineMaxTokens);
}

// Split-phase dispatch (dispatch_send / dispatch_recv) needs, per PE, staging for every source's
// rows of two calls (2 x W x M rows with their metadata: the send writes no final positions, so
// it waits on no peer's counts; docs/ep_split_phase.md). It exists for every AsyncLL config and
// for IntraNode and InterNode configs of at most kEpSplitDispatchMaxTokens tokens per rank.
constexpr int kEpSplitDispatchMaxTokens = kEpPushCombineMaxTokens;
inline bool EpSplitDispatchFits(const EpDispatchCombineConfig& config) {
  const EpDispatchCombineKernelType t = config.RunsAs();
  return (t == EpDispatchCombineKernelType::kIntraNode ||
          t == EpDispatchCombineKernelType::kInterNode) &&
         (config.kernelType == EpDispatchCombineKernelType::kAsyncLL ||
          config.maxNumInpTokenPerRank <= kEpSplitDispatchMaxTokens);
}

EpLayoutDims MakeEpLayoutDims(const EpDispatchCombineConfig& config);
// Layouts for a config (Validate() it first; sizes are computed in size_t).
EpSymmetricLayout MakeEpSymmetricLayout(const EpDispatchCombineConfig& config);
EpLocalLayout MakeEpLocalLayout(const EpDispatchCombineConfig& config);
EpExpertMajorLayout MakeEpExpertMajorLayout(const EpDispatchCombineConfig& config);
// The tables with offsets, in layout order (every region, used or not).
std::vector<EpRegionInfo> EpSymmetricRegions(const EpDispatchCombineConfig& config);
std::vector<EpRegionInfo> EpLocalRegions(const EpDispatchCombineConfig& config);
std::vector<EpRegionInfo> EpExpertMajorRegions(const EpDispatchCombineConfig& config);

// Size hints: bytes of symmetric heap (MORI_SHMEM_HEAP_SIZE must leave room for it) and of
// ordinary device memory a handle for `config` allocates. They validate the config.
size_t EpSymmetricBytes(const EpDispatchCombineConfig& config);
size_t EpLocalBytes(const EpDispatchCombineConfig& config);
// Bytes of ordinary device memory the first expert-major conversion allocates (validates).
size_t EpExpertMajorBytes(const EpDispatchCombineConfig& config);
// Dynamic shared memory of the IntraNode dispatch kernel (membership bitmap, word prefix sums,
// expert histogram); Validate() keeps it within kEpMaxDispatchSmemBytes.
size_t EpDispatchSmemBytes(const EpDispatchCombineConfig& config, int warpSize);
constexpr size_t kEpMaxDispatchSmemBytes = 40 * 1024;

// Dynamic shared memory of the InterNodeV1/V1LL dispatch kernel (the G + 1 membership bitmaps of
// one node with their prefix counts, and that node's expert histograms); Validate keeps it within
// kEpMaxDispatchSmemBytes.
size_t EpV1DispatchSmemBytes(const EpDispatchCombineConfig& config, int warpSize);

// --- index helpers (element indices into the arrays above) ---------------------------------
MORI_HD inline size_t EpCountInboxIndex(int parity, int src, int dst, int worldSize) {
  return (static_cast<size_t>(parity) * worldSize + src) * worldSize + dst;
}
MORI_HD inline size_t EpExpertInboxIndex(int parity, int src, int expert, int worldSize,
                                         int expertsPerRank) {
  return (static_cast<size_t>(parity) * worldSize + src) * expertsPerRank + expert;
}
MORI_HD inline size_t EpReadyInboxIndex(int parity, int src, int worldSize) {
  return static_cast<size_t>(parity) * worldSize + src;
}
// Push combine: slot of token `t`'s row from the PE of local index `j` (its index on our node of
// `localSize` PEs) in pushRecvTokens (rows) / pushRecvWeights (rows of K floats), and the arrival
// counter of PE `pe` in pushArrived, for a call of `parity`.
MORI_HD inline size_t EpPushSlot(int parity, int t, int j, int maxTokens, int localSize) {
  return (static_cast<size_t>(parity) * maxTokens + t) * localSize + j;
}
MORI_HD inline size_t EpPushArrivedIndex(int parity, int pe, int worldSize) {
  return static_cast<size_t>(parity) * worldSize + pe;
}
// Split-phase dispatch: first staging row of source `src` for a call of `parity` in split*
// (rows, or rows of K weights / indices, scale rows, source positions); its j-th row is this + j.
// The arrival counter of `src` in splitArrived, and its tail word in splitTail, are at
// EpPushArrivedIndex(parity, src, worldSize).
MORI_HD inline size_t EpSplitRow(int parity, int src, int maxTokens, int worldSize) {
  return (static_cast<size_t>(parity) * worldSize + src) * maxTokens;
}

// --- payload encodings ---------------------------------------------------------------------
// countInbox value: count in bits 0..31, the dispatch "format" (row size, dtype and index type of
// the rows as they arrive, fused quantisation) in bits 32..63. Every PE of one call must use the
// same format; a PE that sees another one records an error instead of writing or reading
// misplaced rows. (Whether a call passes weights/scales is not part of it: a PE without tokens
// may pass neither.)
MORI_HD inline uint64_t EpDispatchFormat(uint32_t rowBytes, int dataType, int indexType,
                                         int quant) {
  return (static_cast<uint64_t>(rowBytes / 16u) & 0xFFFFFull) |
         (static_cast<uint64_t>(dataType & 0xF) << 20) |
         (static_cast<uint64_t>(indexType & 0x1) << 24) |
         (static_cast<uint64_t>(quant & 0x3) << 25);
}
// Set in the format of a dispatch_send (its counts announce staged rows, not final positions): a
// PE whose call is the fused dispatch sees another format and records the mismatch.
constexpr uint64_t kEpDispatchFormatSplit = 1ull << 27;
// Set in the format a PE announces with its counts when its own input of the call had an error
// (an expert id outside [-1, numExperts), treated as -1); the report is in the receiver's
// inputErrorInbox[parity][PE], written before the count signal that publishes it. Not part of the
// call's format: readers compare EpCallFormat. Every receiver records the report of the lowest
// flagging PE, so every PE of the call holds the same one.
constexpr uint64_t kEpDispatchFormatInputError = 1ull << 28;
MORI_HD inline uint64_t EpCallFormat(uint64_t format) {
  return format & ~kEpDispatchFormatInputError;
}
MORI_HD inline uint64_t EpPackCount(uint32_t count, uint64_t format) {
  return static_cast<uint64_t>(count) | (format << 32);
}
MORI_HD inline uint32_t EpCountOf(uint64_t packed) { return static_cast<uint32_t>(packed); }
MORI_HD inline uint64_t EpFormatOf(uint64_t packed) { return packed >> 32; }

// An input-error report (inputErrorInbox, and the handle's host-mapped record): bit 63 set, the
// PE whose input it was (bits 56..61), top-k slot (bits 49..55), token (bits 32..48), the expert
// id saturated to int32 (bits 0..31).
MORI_HD inline uint64_t EpPackInputError(int pe, int token, int k, long long id) {
  const long long lo = -2147483647ll - 1, hi = 2147483647ll;
  const long long clipped = id < lo ? lo : (id > hi ? hi : id);
  return (1ull << 63) | (static_cast<uint64_t>(pe & 0x3F) << 56) |
         (static_cast<uint64_t>(k & 0x7F) << 49) | (static_cast<uint64_t>(token & 0x1FFFF) << 32) |
         static_cast<uint64_t>(static_cast<uint32_t>(static_cast<int32_t>(clipped)));
}
static_assert(kEpMaxWorldSize <= 64 && kEpMaxTopK <= 128 && kEpMaxTokensPerRank <= (1 << 17),
              "an input-error report holds any PE, top-k slot and token");
MORI_HD inline void EpUnpackInputError(uint64_t w, int* pe, int* token, int* k, long long* id) {
  *pe = static_cast<int>((w >> 56) & 0x3F);
  *k = static_cast<int>((w >> 49) & 0x7F);
  *token = static_cast<int>((w >> 32) & 0x1FFFF);
  *id = static_cast<int32_t>(static_cast<uint32_t>(w));
}

// Where a PE's combine input rows (and weights) are, announced with its ready signal (readyInbox
// value; the push combine sends the same value, and there only "no weights" matters).
enum class EpCombineSource : uint32_t {
  kNone = 0,         // weights only: the PE passed no weights
  kRegistered = 1,   // combineInTokens / combineInWeights (zero-copy, or copied there)
  kDispatchOut = 2,  // dispatchOutTokens / dispatchOutWeights (input was the dispatch output)
  kFp8Wire = 3,      // tokens only: combineInFp8 (quant_type fp8_direct_cast; cast there first)
};
// What a combine row is on the wire (part of the format PEs compare): the input dtype, or e4m3
// codes in one of the two encodings (core::Fp8Format + 1).
enum class EpCombineWire : uint32_t { kInput = 0, kFp8E4M3Fn = 1, kFp8E4M3Fnuz = 2 };
// readyInbox value: token source bits 0..3, weight source bits 4..7, dtype bits 8..11, wire
// bits 13..14, bit 15 = rows still being copied (EpCombinePrecopyKernel: read a row once its chunk
// is tagged in combineRowsReady), row bytes (of the input dtype) bits 16..47.
constexpr uint64_t kEpReadyCopying = uint64_t{1} << 15;
MORI_HD inline uint64_t EpPackReady(EpCombineSource tokens, EpCombineSource weights, int dataType,
                                    uint32_t rowBytes, EpCombineWire wire = EpCombineWire::kInput,
                                    bool copying = false) {
  return static_cast<uint64_t>(tokens) | (static_cast<uint64_t>(weights) << 4) |
         (static_cast<uint64_t>(dataType & 0xF) << 8) |
         (static_cast<uint64_t>(static_cast<uint32_t>(wire) & 0x3) << 13) |
         (copying ? kEpReadyCopying : 0) | (static_cast<uint64_t>(rowBytes) << 16);
}
MORI_HD inline bool EpReadyCopying(uint64_t v) { return (v & kEpReadyCopying) != 0; }
MORI_HD inline EpCombineSource EpReadyTokens(uint64_t v) {
  return static_cast<EpCombineSource>(v & 0xF);
}
MORI_HD inline EpCombineSource EpReadyWeights(uint64_t v) {
  return static_cast<EpCombineSource>((v >> 4) & 0xF);
}
// What PEs must agree on (dtype, wire, row bytes), whether or not their rows are still copied.
MORI_HD inline uint64_t EpReadyFormat(uint64_t v) { return (v & ~kEpReadyCopying) >> 8; }

// --- tagged words (inter-node signals) -------------------------------------------------------
// A signal a NIC writes must be ONE aligned 8-byte word: an RDMA WRITE gives the reader no order
// inside a message. The high half is the call's epoch (mod 2^32: readers compare it for equality,
// and a slot is rewritten at most two calls later), the low half a 32-bit value.
MORI_HD inline uint64_t EpTagWord(uint64_t epoch, uint32_t value) {
  return (epoch << 32) | static_cast<uint64_t>(value);
}
MORI_HD inline uint32_t EpTagOf(uint64_t word) { return static_cast<uint32_t>(word >> 32); }
MORI_HD inline uint32_t EpTagValue(uint64_t word) { return static_cast<uint32_t>(word); }
// interCount slot of src's count word pair for dst ([parity][src][dst][2]: count, then format).
MORI_HD inline size_t EpInterCountIndex(int parity, int src, int dst, int worldSize) {
  return ((static_cast<size_t>(parity) * worldSize + src) * worldSize + dst) * 2;
}
// landingReady value: the combine format (EpReadyFormat: dtype bits 0..3, wire bits 5..6, row
// bytes from bit 8; Validate keeps rows within 16 MiB, so it fits 32 bits) and bit 4 = weights
// were sent.
MORI_HD inline uint32_t EpLandingValue(uint64_t ready, bool weights) {
  return static_cast<uint32_t>(EpReadyFormat(ready)) | (weights ? 0x10u : 0u);
}

// --- InterNodeV1 / V1LL records (docs/ep_internode_v1.md §2) -------------------------------
MORI_HD inline uint32_t EpAlignUp(uint32_t v, uint32_t a) { return (v + a - 1) / a * a; }
// A dispatch record, 16-byte aligned: [row | K fp32 weights | scales | K indices | source token |
// G int32 idx(s->j, t), -1: local PE j does not need the token]. Every PE of a call computes the
// same layout (row bytes, index type and scale bytes are part of the call's format).
struct EpV1Record {
  uint32_t weights, scales, indices, srcPos, header, bytes;  // offsets, then the size
};
MORI_HD inline EpV1Record EpV1RecordLayout(uint32_t rowBytes, int k, uint32_t scaleBytes,
                                           int idxBytes, int g) {
  EpV1Record r;
  r.weights = rowBytes;
  r.scales = r.weights + 4u * k;
  r.indices = EpAlignUp(r.scales + scaleBytes, 8);
  r.srcPos = r.indices + static_cast<uint32_t>(idxBytes * k);
  r.header = r.srcPos + 4;
  r.bytes = EpAlignUp(r.header + 4u * g, 16);
  return r;
}
// A combine partial: [row | K fp32 weights], 16-byte aligned (weights always travel: whether the
// owner asked for them is its own call's business).
MORI_HD inline uint32_t EpV1PartialBytes(uint32_t rowBytes, int k) {
  return EpAlignUp(rowBytes + 4u * k, 16);
}
// V1 chunks: ceil(512 KiB / record) records (V1LL sends each channel's share as one chunk).
constexpr uint32_t kEpV1ChunkBytes = 512u << 10;
MORI_HD inline int EpV1ChunkRecords(uint32_t recordBytes) {
  return static_cast<int>((kEpV1ChunkBytes + recordBytes - 1) / recordBytes);
}
// A count record's tagged words: the sender's dispatch format, its records for the node, its
// count for each of the node's G PEs, then G expert histograms of Epr entries.
constexpr int kEpV1CountFormat = 0;
constexpr int kEpV1CountRecords = 1;
constexpr int kEpV1CountPerPe = 2;
MORI_HD inline int EpV1CountWords(int g, int epr) { return 2 + g + g * epr; }
// Slot of node n among the remote nodes of a PE on node `me` (N nodes), and back.
MORI_HD inline int EpV1NodeSlot(int n, int me, int numNodes) {
  return (n - me - 1 + numNodes) % numNodes;
}
MORI_HD inline int EpV1SlotNode(int m, int me, int numNodes) { return (me + 1 + m) % numNodes; }
// A landing tail's value: partials landed (bits 0..16), bit 17: a PE of the proxy's node passed no
// weights for them, bits 18..31: the combine format (EpReadyFormat: dtype, row bytes / 16) mod
// 2^14, compared by the owner.
MORI_HD inline uint32_t EpV1LandValue(uint32_t count, bool noWeights, uint64_t readyFormat) {
  const uint32_t fmt = static_cast<uint32_t>((readyFormat & 0xF) | ((readyFormat >> 12) << 4));
  return (count & 0x1FFFFu) | (noWeights ? (1u << 17) : 0u) | ((fmt & 0x3FFFu) << 18);
}

}  // namespace mori::ops

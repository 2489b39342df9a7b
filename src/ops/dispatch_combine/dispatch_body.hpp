// The dispatch body the IntraNode and InterNode families share (the family is a template
// parameter; InterNode adds the staged RDMA WRITEs to other nodes). Each family's entry point and
// instantiations: intranode_dispatch.cpp, internode_dispatch.cpp. IntraNode dispatch: one kernel,
// one count exchange, rows written straight into the receivers' output buffers over P2P.
// Protocol and layout: docs/ep.md; buffers: layout.hpp.
//
// Block b serves destination PE d with group index g of G (EpDispatchBlockRole: round-robin, or
// with >= 3 blocks per destination nb / (2W - 1) blocks on the local copy and the rest on the
// peers); the G blocks serving d split d's token list evenly but for a pool of its last rows,
// which the warps that finish their share first claim one at a time, so every block streams
// rows to ONE peer.
//   1. Every block scans all tokens' top-k ids once and builds, in shared memory, the bitmap of
//      tokens that go to d (a token goes once per distinct destination) and its prefix counts.
//      The list position of a token is its rank in that bitmap.
//   2. The group leader (g == 0) announces count(rank -> d) to every PE in epoch-tagged signals
//      (countInbox, parity-double-buffered) and writes, to d, the per-local-expert histogram
//      (expertInbox, plain values published by the same fence as the count signals). Block 0
//      first waits until every PE finished reading our buffers in the last combine; its
//      announcement count(rank -> rank) therefore also says "our buffers may be written".
//   3. A block with rows for d waits for count(s -> d) of every s < rank (its rows start at their
//      sum on d: receivers see rows ordered by source PE, then token) and for count(d -> d) (d has
//      started this call, so its output buffers are free; for our own rows, IntraNode, it checks
//      the done inbox itself as block 0 does). In the 256-thread build each warp has already
//      loaded its first item (it needs no count) so the loads overlap this wait.
//   4. It records the slot of each of its tokens on d (for combine), copies the rows (token,
//      weights, indices, scales, source position) with 16-byte vectors (a row's small metadata is
//      loaded before its token vectors, so its latency overlaps them), then ONE thread fences
//      (release, system scope, after the block barrier) and adds the block's row count to d's
//      arrived[rank].
//   5. Block 0 waits for every source's count and then for arrived[s] to reach it, resets
//      arrived[s], and writes the received total and the per-local-expert counts. The kernel ends
//      only then, so the next kernel on the stream sees every received row.
//   6. The last block to finish bumps the dispatch epoch and resets the grid counter.
// Split phase (EpDispatchPhase, docs/ep_split_phase.md): a kSend launch does 1, 2 and 4 with the
// rows going to slot [parity][rank][list position] of the destination's staging (split*) and the
// block's row count to its splitArrived[parity][rank]; it skips block 0's done wait and 3 (no
// final position is needed, so nothing waits on a peer) and ends there. A later kReceive launch
// (EpDispatchReceiveHalf) compacts the staged rows into the outputs. Why the staging slots of a
// parity are free when a PE sends call k+2 into them: its receive of call k+1 came first on its
// stream and waited for every PE's count of call k+1, which each PE announces in its send of
// call k+1, after its receive of call k (the last reader of those slots) on its stream. The same
// holds for splitArrived (reset by the receive's last block), countInbox and expertInbox. So the
// receive waits for EVERY PE's count, also from PEs that staged nothing for us.
#pragma once

#include "kernel_args.hpp"
#include "common_device.hpp"
#include "trace_device.hpp"
#include "mori/core/gpu_check.hpp"

namespace mori::ops {
namespace detail {

using core::CmpOp;

constexpr int kDispatchCopyUnroll = 8;  // 16-byte loads in flight per lane
constexpr int kDispatchScanBatch = 8;   // top-k ids loaded together per token in the scan

MORI_DEVICE_INLINE size_t AlignUp16(size_t v) { return (v + 15) & ~static_cast<size_t>(15); }

// Thread 0 of every block at the end of a dispatch (either form): counts the block in the grid
// counter (and the trace). True in the last block, which has reset the counter and the item claims
// (every block has stopped claiming) and ends the call.
MORI_DEVICE_INLINE bool EpDispatchBlockDone(const EpKernelCommon& c, uint64_t* tr) {
  __threadfence();
  const unsigned old = atomicAdd(&c.state->dispatchBlocksDone, 1u);
  if (tr != nullptr) {
    EpTraceStamp(tr, kEpDispatchCounted);
    tr[kEpTraceWordArrival] = static_cast<uint64_t>(old) + 1;
  }
  if (old != gridDim.x - 1) return false;
  c.state->dispatchBlocksDone = 0;
  for (int d = 0; d < c.worldSize; d++) c.state->dispatchNextItem[d] = 0;
  return true;
}

// Threads of a block: waits until every PE finished reading our buffers in the last combine (its
// done signal to us carries our combine epoch). False in a thread whose wait expired.
MORI_DEVICE_INLINE bool EpPeersDoneReading(const EpKernelCommon& c, const core::WaitContext& wait,
                                           int tid, int nThreads, int W, const char* what) {
  const uint64_t prevCombine = *reinterpret_cast<volatile uint64_t*>(&c.state->combineEpoch);
  EpSignal* done = At<EpSignal>(c.symmLocal, c.symm.doneInbox);
  bool ok = true;
  for (int p = tid; p < W; p += nThreads) {
    if (!core::WaitUntil(wait, &done[p].tag, CmpOp::kGe, prevCombine, p, what)) ok = false;
  }
  return ok;
}

// Receive half of a split-phase dispatch (EpDispatchPhase::kReceive, same arguments as the send).
// Every block waits for every source's count for us and for its staged rows, forms the prefix
// sums (rows ordered by source PE, then the source's list order: the fused dispatch's order),
// waits until every PE finished reading our outputs in the last combine, and copies its share of
// rows. Block b < W also moves our tokens' slots on PE b (tokenSlot, list positions after the
// send) by the rows of the PEs below us for b. Block 0 writes the totals; the last block checks
// and resets the arrival counters and advances the epoch.
template <typename IndexT, EpFamily kFamily>
MORI_DEVICE_INLINE void EpDispatchReceiveHalf(const EpDispatchKernelArgs& a,
                                              const EpKernelFrame& f) {
  constexpr bool kInter = kFamily == EpFamily::kInterNode;
  __shared__ int sCount[kEpMaxWorldSize];
  __shared__ int sBase[kEpMaxWorldSize + 1];
  __shared__ int sShift;
  __shared__ int sFailedR;
  const EpKernelCommon& c = a.c;
  const core::WaitContext wait = c.shmem.wait;  // private copy (see EpKernelFrame)
  const int M = c.maxTokensPerRank;
  const int T = a.numTokens;
  const int b = static_cast<int>(blockIdx.x);
  uint8_t* const L = c.symmLocal;
  uint64_t* const arrived =
      At<uint64_t>(L, c.symm.splitArrived) + EpPushArrivedIndex(f.parity, 0, f.W);
  if (f.tid == 0) {
    sFailedR = 0;
    sShift = 0;
  }
  __syncthreads();

  // ---- R1. counts and staged rows of every source; the counts of lower PEs for PE b --------
  bool flagged = false;  // lane s of warp 0: PE s flagged an input error in its send
  uint64_t report = 0;
  for (int s = f.tid; s < f.W; s += f.nThreads) {
    uint32_t n = 0;
    if (!EpCountWait<kFamily>(c, wait, f.parity, s, f.me, f.epoch, a.format,
                              "EP dispatch_recv: token count for this PE", &n, &flagged)) {
      sFailedR = 1;
      n = 0;
      flagged = false;
    } else if (flagged && b == 0) {
      report = core::AtomicLoadRelaxedSystem(EpInputErrorSlot(c, L, f.parity, s));
    }
    if (n > 0 && kInter && IsRemote(c, s)) {
      // Another node's rows: its tail word of this parity follows them on its QP.
      uint64_t* tailWord = At<uint64_t>(L, c.symm.splitTail) + EpPushArrivedIndex(f.parity, s, f.W);
      uint32_t rows = 0;
      if (!TagWait(wait, tailWord, f.epoch, s, "EP dispatch_recv: RDMA rows (tail) from PE",
                   &rows)) {
        sFailedR = 1;
      } else if (rows != n) {
        ReportError(wait, s, "EP dispatch_recv: RDMA tail != announced count",
                    static_cast<const uint64_t*>(tailWord), CmpOp::kEq, static_cast<uint64_t>(n),
                    static_cast<uint64_t>(rows));
        sFailedR = 1;
      }
    } else if (n > 0 && !core::WaitUntil(wait, arrived + s, CmpOp::kGe, static_cast<uint64_t>(n), s,
                                         "EP dispatch_recv: staged rows from PE")) {
      sFailedR = 1;
    }
    sCount[s] = static_cast<int>(n);
  }
  if (b == 0 && f.tid < kWarpSize) EpRecordInputError(c, a.inputErrorRecord, flagged, report);
  // (InterNode: our rows for another node's PE keep their list position as slot: the landing row.)
  if (b < f.W && !(kInter && IsRemote(c, b))) {
    for (int p = f.tid; p < f.me; p += f.nThreads) {
      uint32_t n = 0;
      if (!EpCountWait<kFamily>(c, wait, f.parity, p, b, f.epoch, a.format,
                                "EP dispatch_recv: token count of a lower PE", &n)) {
        sFailedR = 1;
      } else {
        atomicAdd(&sShift, static_cast<int>(n));
      }
    }
  }
  __syncthreads();
  if (f.tid == 0) {
    int sum = 0;
    for (int s = 0; s < f.W; s++) {
      sBase[s] = sum;
      sum += sCount[s];
    }
    sBase[f.W] = sum;
    if (sFailedR == 0 && sum > c.maxRecvRows) {
      if (b == 0)
        ReportError(wait, -1, "EP dispatch_recv: rows exceed max_total_recv_tokens", CmpOp::kLe,
                    static_cast<uint64_t>(c.maxRecvRows), static_cast<uint64_t>(sum));
      sFailedR = 1;
    }
  }
  __syncthreads();
  // ---- R2. nobody still reads our outputs (the last combine) ----------------------------------
  if (sFailedR == 0 && !EpPeersDoneReading(c, wait, f.tid, f.nThreads, f.W,
                                           "EP dispatch_recv: peer done reading (last combine)"))
    sFailedR = 1;
  __syncthreads();
  if (f.tid == 0) EpTraceStamp(f.tr, kEpDispatchAnnounced);
  const bool ok = sFailedR == 0;
  const int R = sBase[f.W];

  // ---- R3. our tokens' rows on PE b start after the lower PEs' rows there --------------------
  if (ok && b < f.W && sShift != 0) {
    for (int t = f.tid; t < T; t += f.nThreads) {
      int32_t* slot = c.tokenSlot + static_cast<size_t>(t) * f.W + b;
      if (*slot >= 0) *slot += sShift;
    }
  }

  // ---- R4. staged rows to their final rows ---------------------------------------------------
  if (ok) {
    const int totalWarps = static_cast<int>(gridDim.x) * f.nWarps;
    const int gWarp = b * f.nWarps + f.warp;
    const int vecs = static_cast<int>(a.rowBytes / 16);
    const int parts = EpPartsPerRow(R, totalWarps, vecs);
    const int items = R * parts;
    const size_t sb = a.scaleBytes;
    for (int item = gWarp; item < items; item += totalWarps) {
      const int r = item / parts;
      const int part = item - r * parts;
      int s = 0;
      while (sBase[s + 1] <= r) s++;  // sBase[W] = R > r
      const size_t from = EpSplitRow(f.parity, s, M, f.W) + static_cast<size_t>(r - sBase[s]);
      WarpCopyVectors<kDispatchCopyUnroll>(
          reinterpret_cast<uint4*>(L + c.symm.dispatchOutTokens +
                                   static_cast<size_t>(r) * a.rowBytes),
          reinterpret_cast<const uint4*>(L + c.symm.splitTokens + from * a.rowBytes),
          EpShareBegin(vecs, part, parts), EpShareBegin(vecs, part + 1, parts));
      if (part != 0) continue;
      const float* sw = At<float>(L, c.symm.splitWeights) + from * f.K;
      float* dw = At<float>(L, c.symm.dispatchOutWeights) + static_cast<size_t>(r) * f.K;
      const IndexT* si = At<IndexT>(L, c.symm.splitIndices) + from * f.K;
      IndexT* di = At<IndexT>(L, c.symm.dispatchOutIndices) + static_cast<size_t>(r) * f.K;
      for (int k = f.lane; k < f.K; k += kWarpSize) {
        dw[k] = sw[k];
        di[k] = si[k];
      }
      const uint8_t* ss = L + c.symm.splitScales + from * sb;
      uint8_t* ds = L + c.symm.dispatchOutScales + static_cast<size_t>(r) * sb;
      if (sb % 4 == 0) {
        for (size_t i = f.lane; i < sb / 4; i += kWarpSize)
          reinterpret_cast<uint32_t*>(ds)[i] = reinterpret_cast<const uint32_t*>(ss)[i];
      } else {
        for (size_t i = f.lane; i < sb; i += kWarpSize) ds[i] = ss[i];
      }
      if (f.lane == 0)
        At<int32_t>(L, c.symm.dispatchOutSrcPos)[r] =
            At<const int32_t>(L, c.symm.splitSrcPos)[from];
    }
  }

  // ---- R5. totals (block 0); arrival counters and epoch (last block) -------------------------
  if (b == 0 && ok) {
    if (f.tid == 0) *c.totalRecv = R;
    for (int s = f.tid; s < f.W; s += f.nThreads) c.state->recvCount[s] = sCount[s];
    EpSumExpertCounts(c, f.parity);  // the barrier after R1 carried the counts' acquire
  }
  if (f.tid == 0) EpTraceStamp(f.tr, kEpDispatchReceived);
  __syncthreads();
  if (f.tid == 0) {
    if (!ok) atomicOr(&c.state->dispatchFailed, 1u);
    if (EpDispatchBlockDone(c, f.tr)) {
      __threadfence();
      const bool failed = atomicExch(&c.state->dispatchFailed, 0u) != 0;
      for (int s = 0; s < f.W; s++) {
        if (kInter && IsRemote(c, s)) continue;  // tail words are tagged: nothing to reset
        const uint64_t got = core::AtomicLoadRelaxedSystem(arrived + s);
        if (!failed && got != static_cast<uint64_t>(sCount[s]))
          ReportError(wait, s, "EP dispatch_recv: more rows staged than announced",
                      static_cast<const uint64_t*>(arrived + s), CmpOp::kEq,
                      static_cast<uint64_t>(sCount[s]), got);
        core::AtomicStoreRelaxedSystem(arrived + s, static_cast<uint64_t>(0));
      }
      // Read by the next kernel: the kernel boundary publishes it.
      c.state->dispatchEpoch = f.epoch;
    }
  }
}

// kThreads: the block size the kernel is built for (256, or kEpMaxThreadsPerBlock). The 256-thread
// build has the registers to hold each warp's first item across the count wait (kEarlyLoad; about
// 155 registers a thread, so one block per SM); in the 512-thread build (128 registers a thread)
// that would spill, so it loads after the wait.
// The send path is one body with numbered steps, its values read once into locals at the top:
// split into phase functions (frame and plan passed by reference), the 512-thread builds spill
// more (InterNode most), and IntraNode must keep its registers.
template <typename IndexT, int kThreads, EpFamily kFamily>
MORI_DEVICE_INLINE void EpDispatchBody(const EpDispatchKernelArgs& a) {
  constexpr bool kEarlyLoad = kThreads <= 256;
  constexpr bool kInter = kFamily == EpFamily::kInterNode;
  extern __shared__ __align__(16) uint8_t smemDyn[];
  __shared__ int sFailed;
  __shared__ int sSendBase;
  __shared__ int sTotal;
  __shared__ int sInputError;  // leaders: smallest token * K + slot of a bad id (EpNoInputError)
  __shared__ int sRows;        // rows this block copied

  const EpKernelCommon& c = a.c;
  const EpKernelStart start = EpBeginKernel(c, EpTraceKind::kDispatch, 0);
  // Split phase: the receive half is its own path; the send half is this kernel without the
  // waits and with the staging as destination. Each path forms its frame after the branch (what
  // one path computes is not live in the other).
  if (a.phase == EpDispatchPhase::kReceive) {
    EpDispatchReceiveHalf<IndexT, kFamily>(a, EpKernelFrameOf(c, start));
    return;
  }
  const bool split = a.phase == EpDispatchPhase::kSend;
  // A private copy: the (rare) error path takes its address, which must not pull the whole
  // kernel parameter block into local memory.
  const core::WaitContext wait = c.shmem.wait;
  const EpKernelFrame f = EpKernelFrameOf(c, start);
  const int W = f.W;
  const int me = f.me;
  const int T = a.numTokens;
  const int K = f.K;
  const int Epr = c.numExpertsPerRank;
  const int tid = f.tid;
  const int nThreads = f.nThreads;
  const int lane = f.lane;
  const int warp = f.warp;
  const int nWarps = f.nWarps;
  const int b = static_cast<int>(blockIdx.x);
  int dest = 0, g = 0, G = 1;
  EpDispatchBlockRole(b, static_cast<int>(gridDim.x), W, me, a.localBlocks, &dest, &g, &G);
  const bool leader = g == 0;
  // InterNode: `dest` is on another node. Its rows are staged in our block (stage*[dest], list
  // order) and the group's last block WRITEs them to their final rows on dest by RDMA.
  const bool destRemote = kInter && IsRemote(c, dest);
  const uint64_t epoch = start.epoch;
  const int parity = start.parity;

  // Shared memory: membership bitmap of the destination, exclusive prefix counts per word, and
  // (leaders) the histogram over the destination's local experts. Sized by EpDispatchSmemBytes.
  const int nWordsMax = (c.maxTokensPerRank + kWarpSize - 1) / kWarpSize;
  LaneMask* words = reinterpret_cast<LaneMask*>(smemDyn);
  int* prefix = reinterpret_cast<int*>(smemDyn + AlignUp16(nWordsMax * sizeof(LaneMask)));
  int* hist = reinterpret_cast<int*>(reinterpret_cast<uint8_t*>(prefix) +
                                     AlignUp16((nWordsMax + 1) * sizeof(int)));

  const IndexT* idx = static_cast<const IndexT*>(a.inIndices);
  const int nWords = (T + kWarpSize - 1) / kWarpSize;

  uint64_t* const tr = start.trace;
  if (tid == 0) {
    sFailed = 0;
    sSendBase = 0;
    sTotal = 0;
    sRows = 0;
    sInputError = kEpNoInputError;
  }
  if (leader) {
    for (int e = tid; e < Epr; e += nThreads) hist[e] = 0;
  }
  __syncthreads();

  // ---- 1. membership of destination `dest` ------------------------------------------------
  // A warp takes words (32 tokens, a lane each) nWarps apart. The first kDispatchScanBatch ids of
  // the next two words are in flight while a word is processed, so the loads' latency overlaps
  // the work. The test of an id is two compares in the index type against dest's expert range
  // (ids outside [0, numExperts) fall outside it too), never a division: every block tests all
  // T x K ids (docs/performance.md, "Dispatch block split and scan").
  // Leaders also check every id against [-1, numExperts) when asked (a.checkIds) and keep the
  // first offender: every leader finds the same one, flags its count for its destination with it
  // and sends the report (step 2), so every PE's receive step learns it in this call. The kernels
  // treat the id as -1 either way, so the ranks stay in step.
  const bool checkIds = leader && a.checkIds != 0;
  const IndexT numE = static_cast<IndexT>(c.numExperts);
  const IndexT lo = static_cast<IndexT>(dest) * static_cast<IndexT>(Epr);
  const IndexT hi = lo + static_cast<IndexT>(Epr);
  // Where a row of ids is a whole number of 16-byte vectors (K x sizeof(IndexT), and the tensor
  // 16-byte aligned), a batch is loaded as vectors: one load instruction per 16 bytes instead of
  // one per id (lanes are rows apart, so each scalar load touches a sector per lane).
  constexpr int kIdsPerVec = 16 / static_cast<int>(sizeof(IndexT));
  const bool vecIds = (K % kIdsPerVec) == 0 && (reinterpret_cast<uintptr_t>(idx) & 15) == 0;
  auto loadIds = [&](int w, int k0, IndexT(&ids)[kDispatchScanBatch]) {
    const int t = w * kWarpSize + lane;
    const IndexT* row = idx + static_cast<size_t>(t) * K;
    if (vecIds) {
      static_assert(kDispatchScanBatch % kIdsPerVec == 0, "a batch is whole vectors");
#pragma unroll
      for (int q = 0; q < kDispatchScanBatch / kIdsPerVec; q++) {
        const int k = k0 + q * kIdsPerVec;
        uint4 v = make_uint4(~0u, ~0u, ~0u, ~0u);  // every id -1
        if (t < T && k < K) v = *reinterpret_cast<const uint4*>(row + k);
        __builtin_memcpy(&ids[q * kIdsPerVec], &v, sizeof v);
      }
      return;
    }
#pragma unroll
    for (int u = 0; u < kDispatchScanBatch; u++)
      ids[u] = t < T && k0 + u < K ? row[k0 + u] : static_cast<IndexT>(-1);
  };
  // Marks membership from one batch of ids (k0.. of token t) and, in leaders, counts each distinct
  // expert of `dest` once: an id is compared with the earlier ids of this batch (registers) and,
  // for top-k above the batch, of the earlier batches (memory).
  auto scanBatch = [&](int t, int k0, const IndexT(&ids)[kDispatchScanBatch], bool* member) {
    // Membership only, without branches, in the blocks that are not leaders (the leader's checks
    // and histogram below). Not in InterNode: its 512-thread int32 build spills more with it.
    if (!kInter && !leader) {
      bool any = false;
#pragma unroll
      for (int u = 0; u < kDispatchScanBatch; u++) any |= (ids[u] >= lo) & (ids[u] < hi);
      *member |= any;
      return;
    }
#pragma unroll
    for (int u = 0; u < kDispatchScanBatch; u++) {
      const IndexT e = ids[u];
      if (checkIds && EpBadExpertId(e, numE)) atomicMin(&sInputError, t * K + k0 + u);
      if (e < lo || e >= hi) continue;  // another PE's expert, -1 or an out-of-range id
      *member = true;
      if (leader) {
        const IndexT* row = idx + static_cast<size_t>(t) * K;
        bool dup = false;
        for (int j = 0; j < k0; j++) dup = dup || row[j] == e;
#pragma unroll
        for (int j = 0; j < kDispatchScanBatch; j++) dup = dup || (j < u && ids[j] == e);
        if (!dup) atomicAdd(&hist[static_cast<int>(e - lo)], 1);
      }
    }
  };
  {
    IndexT cur[kDispatchScanBatch], next[kDispatchScanBatch];
    loadIds(warp, 0, cur);  // a word past the last one loads as -1 ids
    loadIds(warp + nWarps, 0, next);
    for (int w = warp; w < nWords; w += nWarps) {
      IndexT after[kDispatchScanBatch];
      loadIds(w + 2 * nWarps, 0, after);
      const int t = w * kWarpSize + lane;
      bool member = false;
      if (t < T) {
        scanBatch(t, 0, cur, &member);
        for (int k0 = kDispatchScanBatch; k0 < K; k0 += kDispatchScanBatch) {
          IndexT more[kDispatchScanBatch];
          loadIds(w, k0, more);
          scanBatch(t, k0, more, &member);
        }
      }
      const LaneMask m = core::WarpBallot(member);
      if (lane == 0) words[w] = m;
#pragma unroll
      for (int u = 0; u < kDispatchScanBatch; u++) {
        cur[u] = next[u];
        next[u] = after[u];
      }
    }
  }
  __syncthreads();
  if (warp == 0) {
    int carry = 0;
    for (int base = 0; base < nWords; base += kWarpSize) {
      const int w = base + lane;
      const int cnt = w < nWords ? core::PopCount(words[w]) : 0;
      const int incl = WarpInclusiveScan(cnt);
      if (w < nWords) prefix[w] = carry + incl - cnt;
      carry += core::WarpShfl(incl, kWarpSize - 1);
    }
    if (lane == 0) prefix[nWords] = carry;
  }
  __syncthreads();
  const int countD = prefix[nWords];
  // The format a leader announces with its count: flagged when its scan (ended before the
  // barriers above) found a bad id.
  const bool inputError = checkIds && sInputError != kEpNoInputError;
  const uint64_t countFormat = a.format | (inputError ? kEpDispatchFormatInputError : 0ull);
  if (tid == 0) EpTraceStamp(tr, kEpDispatchScanned);

  // ---- 2. announce ------------------------------------------------------------------------
  // (A split send writes no outputs of any PE: the receive half waits for this instead.)
  if (b == 0 && !split) {
    // Our count(rank -> rank) tells every sender that our buffers are free: wait until every PE
    // finished reading them in the last combine.
    if (!EpPeersDoneReading(c, wait, tid, nThreads, W,
                            "EP dispatch: peer done reading (last combine)"))
      sFailed = 1;
    __syncthreads();
  }
  if constexpr (!kInter) {
    if (leader && sFailed == 0) {
      // Values from all threads (relaxed), the barrier, ONE release fence (thread 0, cumulative
      // over the barrier, as in 4c), then thread 0 stores the W tags: a release store per thread
      // (Epr histogram entries, 256 with one PE) would cost one system fence each. The tag of the
      // count signal to d also publishes d's histogram. Block 0's done-waits are ordered before all
      // of it by the barrier above (causality is transitive through bar.sync).
      const uint64_t packed = EpPackCount(static_cast<uint32_t>(countD), countFormat);
      const size_t countSlot = EpCountInboxIndex(parity, me, dest, W);
      for (int p = tid; p < W; p += nThreads)
        core::AtomicStoreRelaxedSystem(
            &(At<EpSignal>(PeerBlock(c, p), c.symm.countInbox) + countSlot)->value, packed);
      int32_t* ex = At<int32_t>(PeerBlock(c, dest), c.symm.expertInbox);
      for (int e = tid; e < Epr; e += nThreads)
        core::AtomicStoreRelaxedSystem(ex + EpExpertInboxIndex(parity, me, e, W, Epr), hist[e]);
      if (tid == 0 && inputError)  // published by the count signal to dest, as the histogram
        core::AtomicStoreRelaxedSystem(EpInputErrorSlot(c, PeerBlock(c, dest), parity, me),
                                       EpInputErrorReport(me, sInputError, idx, K));
      __syncthreads();
      if (tid == 0) {
        core::FenceAcqRelSystem();
        for (int p = 0; p < W; p++)
          core::AtomicStoreRelaxedSystem(
              &(At<EpSignal>(PeerBlock(c, p), c.symm.countInbox) + countSlot)->tag, epoch);
        c.state->sendCount[dest] = countD;  // for the push combine
      }
    }
  } else if (leader && sFailed == 0) {
    // InterNode: the histogram (stores to a same-node dest, staged for a remote one), the barrier,
    // ONE release fence, then tagged {count, format} words: stores to same-node PEs, 16-byte RDMA
    // WRITEs to the others. A remote dest gets its histogram (and an input-error report) by RDMA
    // first, on the QP that then carries its count words (RC order: the words land after them).
    const size_t countSlot = EpInterCountIndex(parity, me, dest, W);
    int32_t* ex = destRemote
                      ? At<int32_t>(c.symmLocal, c.symm.stageHist) + static_cast<size_t>(dest) * Epr
                      : At<int32_t>(PeerBlock(c, dest), c.symm.expertInbox) +
                            EpExpertInboxIndex(parity, me, 0, W, Epr);
    for (int e = tid; e < Epr; e += nThreads) core::AtomicStoreRelaxedSystem(ex + e, hist[e]);
    __syncthreads();
    if (tid == 0) {
      // The report goes into our own slot (our receiver reads it; the RDMA source for a remote
      // dest: registered memory) and, for a same-node dest, into its slot.
      uint64_t* const ownReport = EpInputErrorSlot(c, c.symmLocal, parity, me);
      if (inputError) {
        const uint64_t report = EpInputErrorReport(me, sInputError, idx, K);
        core::AtomicStoreRelaxedSystem(ownReport, report);
        if (!destRemote)
          core::AtomicStoreRelaxedSystem(EpInputErrorSlot(c, PeerBlock(c, dest), parity, me),
                                         report);
      }
      core::FenceAcqRelSystem();
      const uint64_t words[2] = {EpTagWord(epoch, static_cast<uint32_t>(countD)),
                                 EpTagWord(epoch, static_cast<uint32_t>(countFormat))};
      uint64_t* mine = At<uint64_t>(c.symmLocal, c.symm.interCount) + countSlot;
      bool ok = true;
      // Posts in order (one call site): a remote dest's histogram (i = -2) and report (i = -1),
      // then the count words to every PE, dest first (its words follow what came before them).
      for (int i = -2; i < W && ok; i++) {
        const int p = i < 0 ? dest : (dest + i) % W;
        if (!IsRemote(c, p)) {
          if (i < 0) continue;
          uint64_t* w = At<uint64_t>(PeerBlock(c, p), c.symm.interCount) + countSlot;
          core::AtomicStoreRelaxedSystem(w, words[0]);
          core::AtomicStoreRelaxedSystem(w + 1, words[1]);
          continue;
        }
        if (i == -1 && !inputError) continue;
        void* to = mine;
        const void* from = words;
        size_t bytes = sizeof(words);
        if (i == -2) {
          to = At<int32_t>(c.symmLocal, c.symm.expertInbox) +
               EpExpertInboxIndex(parity, me, 0, W, Epr);
          from = ex;
          bytes = static_cast<size_t>(Epr) * sizeof(int32_t);
        } else if (i == -1) {
          to = ownReport;
          from = ownReport;
          bytes = sizeof(uint64_t);
        }
        ok = RdmaWrite(c, p, to, from, bytes);
      }
      if (!ok) sFailed = 1;
      c.state->sendCount[dest] = countD;
    }
  }
  __syncthreads();  // every thread has seen sFailed before phase 3 may change it
  if (tid == 0) EpTraceStamp(tr, kEpDispatchAnnounced);

  // ---- 3a. what this block copies, and the first item of each warp loaded now -------------
  // Rows [i0, i1) of the first S rows of dest's list (its share), in items of a row slice each;
  // with at least two rows per warp of the group, the last rows (one per warp of the group:
  // EpDispatchShareRows) are a pool that warps claim one row at a time from
  // dispatchNextItem[dest] as they finish their share. So a block that starts late (the leader:
  // histogram and announcement) or streams slowly copies fewer of them. Which token an item is
  // and which vectors it covers is known from the bitmap alone; only where it goes (sendBase)
  // needs the counts. So each warp loads its first item's metadata and first round of vectors
  // here, and the latency of those loads overlaps the count wait below (small batches: the whole
  // copy of most warps is that one round).
  // Items cut rows into input vectors; a quantised row only at group boundaries.
  const bool quant = a.quant != EpDispatchQuant::kNone;
  const core::Fp8Format fp8 = static_cast<core::Fp8Format>(a.fp8Format);
  const int vecs = static_cast<int>(a.inRowBytes / 16);
  const int unitVecs = quant ? kQuantGroupVecs : 1;
  const int nUnits = vecs / unitVecs;  // quant: the row's groups
  // Few rows (small batches): several warps share a row, every warp has at most one item.
  const int groupWarps = G * nWarps;
  const int S = EpDispatchShareRows(countD, groupWarps);
  const int i0 = EpShareBegin(S, g, G);
  const int i1 = EpShareBegin(S, g + 1, G);
  // Items [0, items) are the share's; [items, last) the pool's rows (a share then has at least
  // nWarps rows: one part each).
  const int parts = EpPartsPerRow(i1 - i0, nWarps, vecs);
  const int items = sFailed == 0 ? (i1 - i0) * parts : 0;
  const int last = sFailed == 0 ? items + (countD - S) : 0;
  const int nScaleWords = static_cast<int>(a.scaleBytes / 4);
  // Fast metadata (K <= warp, scales as <= 2 words per lane): loaded with the token vectors,
  // stored after them, so they add no latency of their own.
  const bool metaFast = K <= kWarpSize && a.scaleCopy != EpScaleCopy::kBytes &&
                        (a.scaleCopy != EpScaleCopy::kWords || nScaleWords <= 2 * kWarpSize);
  struct Item {
    int t, p, vb, ve;
    bool meta;  // the row's first part: it carries the row's metadata (fast: in w, id, s0, s1)
    float w;
    IndexT id;
    uint32_t s0, s1;
    uint4 r[kDispatchCopyUnroll];  // vectors [vb, vb + kDispatchCopyUnroll * kWarpSize), strided
  };
  // Locates `item` and loads its fast metadata and (kEarlyLoad) its first round into `it`.
  auto loadItem = [&](int item, Item& it) {
    const int r = item / parts;
    const int part = item - r * parts;
    it.p = item < items ? i0 + r : S + (item - items);
    const int lo = EpWordOfPosition(prefix, nWords, it.p);
    it.t = lo * kWarpSize + WarpNthSetBit(words[lo], it.p - prefix[lo]);
    it.vb = EpShareBegin(nUnits, part, parts) * unitVecs;
    it.ve = EpShareBegin(nUnits, part + 1, parts) * unitVecs;
    it.meta = part == 0;
    it.w = 0.0f;
    it.id = 0;
    it.s0 = it.s1 = 0;
    if (it.meta && metaFast) {
      if (lane < K) {
        if (a.inWeights != nullptr) it.w = a.inWeights[static_cast<size_t>(it.t) * K + lane];
        it.id = idx[static_cast<size_t>(it.t) * K + lane];
      }
      if (a.scaleCopy == EpScaleCopy::kWords) {
        const uint32_t* src = reinterpret_cast<const uint32_t*>(
            a.inScales + static_cast<size_t>(it.t) * a.scaleBytes);
        if (lane < nScaleWords) it.s0 = src[lane];
        if (lane + kWarpSize < nScaleWords) it.s1 = src[lane + kWarpSize];
      }
    }
    if constexpr (kEarlyLoad) {
      const uint4* src =
          reinterpret_cast<const uint4*>(a.inTokens + static_cast<size_t>(it.t) * a.inRowBytes);
#pragma unroll
      for (int u = 0; u < kDispatchCopyUnroll; u++) {
        const int v = it.vb + lane + u * kWarpSize;
        if (v < it.ve) it.r[u] = src[v];
      }
    }
  };
  Item it;  // the warp's current item (its first is loaded now where kEarlyLoad)
  if (kEarlyLoad && warp < items) loadItem(warp, it);

  // ---- 3b. where our rows go on `dest`, and may we write there ----------------------------
  if (countD > 0 && sFailed == 0 && !split) {
    // Our own rows (IntraNode, dest == me): our buffers may be written once every PE finished
    // reading them in the last combine. The block checks that itself, as block 0 does before its
    // count(rank -> rank) says so to the other senders, instead of waiting for that count (the
    // leader's whole scan, fence and signal).
    const bool ownRows = !kInter && dest == me;
    if (ownRows && !EpPeersDoneReading(c, wait, tid, nThreads, W,
                                       "EP dispatch: peer done reading (last combine)"))
      sFailed = 1;
    for (int s = tid; s < W; s += nThreads) {
      if (s >= me && (s != dest || ownRows)) continue;
      uint32_t n = 0;
      if (!EpCountWait<kFamily>(c, wait, parity, s, dest, epoch, a.format,
                                "EP dispatch: token count of a lower PE", &n)) {
        sFailed = 1;
      } else if (s < me) {
        atomicAdd(&sSendBase, static_cast<int>(n));
      }
    }
  }
  __syncthreads();

  if (sFailed == 0 && !split) {
    const int sendBase = sSendBase;
    if (countD > 0 && tid == 0 && static_cast<long long>(sendBase) + countD > c.maxRecvRows) {
      ReportError(wait, dest, "EP dispatch: PE rows > max_total_recv_tokens", CmpOp::kLe,
                  static_cast<uint64_t>(c.maxRecvRows), static_cast<uint64_t>(sendBase + countD));
      sFailed = 1;
    }
    __syncthreads();
  }

  if (tid == 0) EpTraceStamp(tr, kEpDispatchSendBase);
  if (sFailed == 0) {
    const int sendBase = sSendBase;
    // Rows for a remote dest are staged at their list index (the WRITE places them at sendBase);
    // the slot combine keeps for them is that index too (their landing position). A split send
    // stages at the list index too; its receive half adds the base to the slots.
    const int slotBase = destRemote || split ? 0 : sendBase;
    // ---- 4a. slots of our tokens on `dest` (combine reads them) ---------------------------
    {
      const int t0 = EpShareBegin(T, g, G);
      const int t1 = EpShareBegin(T, g + 1, G);
      for (int t = t0 + tid; t < t1; t += nThreads) {
        const int w = t / kWarpSize;
        const int bit = t - w * kWarpSize;
        const LaneMask word = words[w];
        int slot = -1;
        if (((word >> bit) & static_cast<LaneMask>(1)) != 0)
          slot = slotBase + prefix[w] + core::PopCount(word & LowerLanesMask(bit));
        c.tokenSlot[static_cast<size_t>(t) * W + dest] = slot;
      }
    }

    // ---- 4b. the items: first round from registers, the rest streamed ---------------------
    uint8_t* outTok;
    float* outW;
    uint8_t* outS;
    IndexT* outIdx;
    int32_t* outPos;
    if (destRemote) {
      const size_t rows = static_cast<size_t>(dest) * c.maxTokensPerRank;  // stage*[dest]
      outTok = c.symmLocal + c.symm.stageTokens + rows * a.rowBytes;
      outW = At<float>(c.symmLocal, c.symm.stageWeights) + rows * K;
      outS = c.symmLocal + c.symm.stageScales + rows * a.scaleBytes;
      outIdx = At<IndexT>(c.symmLocal, c.symm.stageIndices) + rows * K;
      outPos = At<int32_t>(c.symmLocal, c.symm.stageSrcPos) + rows;
    } else if (split) {
      uint8_t* db = PeerBlock(c, dest);
      const size_t rows = EpSplitRow(parity, me, c.maxTokensPerRank, W);
      outTok = db + c.symm.splitTokens + rows * a.rowBytes;
      outW = At<float>(db, c.symm.splitWeights) + rows * K;
      outS = db + c.symm.splitScales + rows * a.scaleBytes;
      outIdx = At<IndexT>(db, c.symm.splitIndices) + rows * K;
      outPos = At<int32_t>(db, c.symm.splitSrcPos) + rows;
    } else {
      uint8_t* db = PeerBlock(c, dest);
      outTok = db + c.symm.dispatchOutTokens;
      outW = At<float>(db, c.symm.dispatchOutWeights);
      outS = db + c.symm.dispatchOutScales;
      outIdx = At<IndexT>(db, c.symm.dispatchOutIndices);
      outPos = At<int32_t>(db, c.symm.dispatchOutSrcPos);
    }
    int myRows = 0;
    for (int item = warp; item < last;) {
      // Past the share, the next item is a pool row claimed now: the atomic's latency overlaps
      // this item's copy (a claim past the pool ends the loop).
      int next = item + nWarps;
      if (next >= items) {
        next = last;
        if (last > items && lane == 0)
          next = items + static_cast<int>(atomicAdd(&c.state->dispatchNextItem[dest], 1u));
      }
      if (!kEarlyLoad || item != warp) loadItem(item, it);
      const int t = it.t;
      const size_t slot = static_cast<size_t>(slotBase) + it.p;
      uint8_t* const dstRow = outTok + slot * a.rowBytes;
      uint4* dst = reinterpret_cast<uint4*>(dstRow);
      uint8_t* const dstScales = outS + slot * a.scaleBytes;  // written here only when quantising
      const int nGroups = nUnits;
      int vFrom = it.vb;
      if constexpr (kEarlyLoad) {
#pragma unroll
        for (int u = 0; u < kDispatchCopyUnroll; u++) {
          const int v = it.vb + lane + u * kWarpSize;
          if (quant) {
            QuantizeVector(it.r[u], v < it.ve, v, dstRow, dstScales, nGroups, a.quant, fp8);
          } else if (v < it.ve) {
            dst[v] = it.r[u];
          }
        }
        vFrom += kDispatchCopyUnroll * kWarpSize;
      }
      const uint4* srcRow =
          reinterpret_cast<const uint4*>(a.inTokens + static_cast<size_t>(t) * a.inRowBytes);
      if (quant) {
        WarpQuantizeVectors<kDispatchCopyUnroll>(dstRow, dstScales, srcRow, vFrom, it.ve, nGroups,
                                                 a.quant, fp8);
      } else {
        WarpCopyVectors<kDispatchCopyUnroll>(dst, srcRow, vFrom, it.ve);
      }
      if (it.meta && metaFast) {
        if (lane < K) {
          if (a.inWeights != nullptr) outW[slot * K + lane] = it.w;
          outIdx[slot * K + lane] = it.id;
        }
        if (a.scaleCopy == EpScaleCopy::kWords) {
          uint32_t* dstS = reinterpret_cast<uint32_t*>(outS + slot * a.scaleBytes);
          if (lane < nScaleWords) dstS[lane] = it.s0;
          if (lane + kWarpSize < nScaleWords) dstS[lane + kWarpSize] = it.s1;
        }
        if (lane == 0) outPos[slot] = me * c.maxTokensPerRank + t;
      } else if (it.meta) {
        for (int k = lane; k < K; k += kWarpSize) {
          if (a.inWeights != nullptr)
            outW[slot * K + k] = a.inWeights[static_cast<size_t>(t) * K + k];
          outIdx[slot * K + k] = idx[static_cast<size_t>(t) * K + k];
        }
        if (a.scaleCopy == EpScaleCopy::kWords) {
          const uint32_t* src =
              reinterpret_cast<const uint32_t*>(a.inScales + static_cast<size_t>(t) * a.scaleBytes);
          uint32_t* dstS = reinterpret_cast<uint32_t*>(outS + slot * a.scaleBytes);
          for (int i = lane; i < nScaleWords; i += kWarpSize) dstS[i] = src[i];
        } else if (a.scaleCopy == EpScaleCopy::kBytes) {
          const int n = static_cast<int>(a.scaleBytes);
          const uint8_t* src = a.inScales + static_cast<size_t>(t) * a.scaleBytes;
          uint8_t* dstS = outS + slot * a.scaleBytes;
          for (int i = lane; i < n; i += kWarpSize) dstS[i] = src[i];
        }
        if (lane == 0) outPos[slot] = me * c.maxTokensPerRank + t;
      }
      myRows += it.meta ? 1 : 0;
      item = core::WarpShfl(next, 0);
    }
    if (lane == 0 && myRows > 0) atomicAdd(&sRows, myRows);
  }

  // ---- 4c. publish our rows ------------------------------------------------------------------
  // One fence per block, not per thread (fence.sc.sys in every thread serialises GPU-wide): the
  // barrier orders every thread's row stores before thread 0's release fence, which is cumulative.
  __syncthreads();
  const int nRows = sRows;
  if (tid == 0) EpTraceStamp(tr, kEpDispatchCopied);
  if (destRemote) {
    // The group's last block to have staged its rows WRITEs the whole list (each array one
    // contiguous range of dest's outputs) and then the tail word, all from one thread (one QP: the
    // tail lands after the rows), then waits for their completion (the staging is reusable when
    // the kernel ends, and a later call's tail cannot overtake this one).
    if (tid == 0) {
      core::FenceAcqRelSystem();
      const unsigned old = atomicAdd(&c.state->stagedBlocks[dest], 1u);
      if (old == static_cast<unsigned>(G) - 1) {
        c.state->stagedBlocks[dest] = 0;
        core::FenceAcqRelSystem();  // acquire the other blocks' staging (through the counter)
        if (countD > 0 && sFailed == 0 && !core::DeviceAborted(wait)) {
          const size_t rows = static_cast<size_t>(dest) * c.maxTokensPerRank;
          const size_t n = static_cast<size_t>(countD);
          uint8_t* L = c.symmLocal;
          const size_t idxBytes = sizeof(IndexT) * K;
          // Where the rows go on dest: their final rows, or (split send) our staging slots there
          // [parity][rank], followed by the tail word of that parity.
          const size_t at = split ? EpSplitRow(parity, me, c.maxTokensPerRank, W)
                                  : static_cast<size_t>(sSendBase);
          const EpSymmetricLayout& y = c.symm;
          bool ok = RdmaWrite(c, dest,
                              L + (split ? y.splitTokens : y.dispatchOutTokens) + at * a.rowBytes,
                              L + y.stageTokens + rows * a.rowBytes, n * a.rowBytes);
          if (ok && a.inWeights != nullptr)
            ok = RdmaWrite(
                c, dest,
                L + (split ? y.splitWeights : y.dispatchOutWeights) + at * K * sizeof(float),
                L + y.stageWeights + rows * K * sizeof(float), n * K * sizeof(float));
          if (ok && (a.scaleCopy != EpScaleCopy::kNone || a.quant != EpDispatchQuant::kNone))
            ok = RdmaWrite(c, dest,
                           L + (split ? y.splitScales : y.dispatchOutScales) + at * a.scaleBytes,
                           L + y.stageScales + rows * a.scaleBytes, n * a.scaleBytes);
          if (ok)
            ok = RdmaWrite(c, dest,
                           L + (split ? y.splitIndices : y.dispatchOutIndices) + at * idxBytes,
                           L + y.stageIndices + rows * idxBytes, n * idxBytes);
          if (ok)
            ok = RdmaWrite(c, dest,
                           L + (split ? y.splitSrcPos : y.dispatchOutSrcPos) + at * sizeof(int32_t),
                           L + y.stageSrcPos + rows * sizeof(int32_t), n * sizeof(int32_t));
          const uint64_t tail = EpTagWord(epoch, static_cast<uint32_t>(countD));
          uint64_t* tailWord =
              split ? At<uint64_t>(L, y.splitTail) + EpPushArrivedIndex(parity, me, W)
                    : At<uint64_t>(L, y.interTail) + me;
          if (ok) ok = RdmaWrite(c, dest, tailWord, &tail, sizeof(tail));
          if (ok) shmem::ShmemQuietThread(c.shmem, dest);
        }
      }
    }
  } else if (tid == 0 && nRows > 0 && sFailed == 0) {
    core::FenceAcqRelSystem();
    uint64_t* counter = split ? At<uint64_t>(PeerBlock(c, dest), c.symm.splitArrived) +
                                    EpPushArrivedIndex(parity, me, W)
                              : At<uint64_t>(PeerBlock(c, dest), c.symm.arrived) + me;
    core::AtomicFetchAddSystem(counter, static_cast<uint64_t>(nRows));
  }
  if (tid == 0) EpTraceStamp(tr, kEpDispatchPublished);
  // A split send ends here: the receive half checks the counts and advances the epoch (a failure
  // here leaves rows missing, which the receive half's bounded wait reports).
  if (split) return;

  // ---- 5. receive side (block 0) -------------------------------------------------------------
  if (b == 0)
    EpDispatchReceive<kFamily>(c, wait, parity, epoch, a.format, sTotal, sFailed,
                               a.inputErrorRecord);

  // ---- 6. epoch ------------------------------------------------------------------------------
  if (tid == 0) EpTraceStamp(tr, kEpDispatchReceived);
  __syncthreads();
  // The next kernel reads the epoch: the kernel boundary publishes it.
  if (tid == 0 && EpDispatchBlockDone(c, tr)) c.state->dispatchEpoch = epoch;
}

}  // namespace detail

}  // namespace mori::ops

// The push combine body the IntraNode and InterNode families share, for small-batch configs
// (EpPushCombineFits, MORI_EP_COMBINE_PUSH): IntraNode, and InterNode (AsyncLL too) where PEs of
// other nodes get their rows by RDMA. Each family's entry point and instantiations:
// intranode_combine_push.cpp, internode_combine_push.cpp. Protocol: docs/ep.md; buffers: layout.hpp
// (pushArrived, pushRecvTokens, pushRecvWeights, pushLand*).
//
// The pull combine (combine_body.hpp) costs two waits on peers before its first byte moves:
// every PE's "ready" signal, then the load round trip of every row, and a third signal at its end
// ("done reading your buffers"). Here each PE instead writes the rows it holds to their tokens'
// PEs (stores need no round trip), and every PE sums from its own memory:
//   1. Block 0 signals every PE of our node (readyInbox, as the pull combine's ready signal) with
//      our row format and whether we return weights (a PE checks both before it sums), and, with
//      the same fence, "done reading your buffers" (we never read a peer's buffers in this mode).
//   2. The rows we received from the other PEs of our node in the last dispatch (the dispatch
//      output is ordered by source PE, so they are one range; rows from ourselves stay where they
//      are) are stored, from the combine input (registered buffer, dispatch output or the caller's
//      tensor: no copy), into slot [parity][token][our local index] of the source PE's
//      pushRecvTokens, weights alike. The work is cut into shares that blocks claim (so resident
//      blocks do all of it); after each share a block fences once and adds the 16-byte vectors it
//      stored for each PE to that PE's pushArrived[parity][our PE].
//   2'. InterNode: the rows we received from each PE s of another node (one contiguous range each)
//      go back by RDMA WRITE into s's pushLandTokens[parity] at InterLandingBase(s) (weights
//      alike), followed on the same QP by a tagged tail word in s's pushLandTail[parity][our PE]
//      (the format, and whether weights came), then "done" into s's doneInbox. The tail goes to
//      every PE of another node, also with no rows: a PE waits for every PE's tail or signal. The
//      WRITEs read registered memory: the blocks first cast those rows to e4m3 into combineInFp8
//      (fp8_direct_cast) or copy them from the caller's tensor into the registered buffer; the
//      block completing the last share posts. Nothing waits for their completion until step 5.
//   3. Every block waits until pushArrived[d] reaches sendCount[d] x vectors per row for every PE
//      d of our node, and for every other node's PE's tail of this parity.
//   4. Each token's rows are summed in fp32 in ascending PE order, exactly as the pull combine:
//      the row from PE d is in pushRecvTokens[t][d's local index] (another node's: in pushLand*
//      at d's landing offset plus the token's list position), ours is in our input at its slot.
//   5. The last block completes our WRITEs (they read our input), checks and resets pushArrived
//      and bumps the combine epoch.
// quant_type fp8_direct_cast (a.wireFp8): rows are cast to e4m3 while pushed (slots of wireRow
// bytes), and our own tokens' rows are pushed into our own slots as well (counted in our own
// pushArrived[me]), so every summed row is decoded from codes, whichever PE holds it.
// Split phase (EpCombinePhase): a kSend launch runs steps 1-2' and returns (no wait on any peer),
// a later kReceive launch with the same arguments steps 3-5. The argument below holds unchanged: a
// PE's next kSend comes after its kReceive on its stream.
// Why the receive slots (and landings) of a parity are free when a PE pushes call k+2 into them:
// it finished call k+1 first, which needed every PE's signal or tail of call k+1, which each PE
// sends after it finished call k (the last reader of those slots). The same holds for the
// counters and signals. (Combine may run several times after one dispatch, so "the next dispatch"
// is no guard here.) This needs step 3 to wait for EVERY PE's signal or tail, also from PEs that
// pushed us nothing: else a PE could finish call k+1 before a PE it has no rows from finished call
// k (the protocol model, tests/python/test_ep_protocol_model.py modes "push" and "inter_push",
// finds that race when the wait is skipped).
#pragma once

#include "combine_reduce.hpp"
#include "kernel_args.hpp"
#include "common_device.hpp"
#include "trace_device.hpp"
#include "mori/core/gpu_check.hpp"

namespace mori::ops {
namespace detail {

using core::CmpOp;

constexpr int kPushUnroll = 8;  // 16-byte loads in flight per lane while pushing a row

// InterNode, step 2' (one thread, after every block prepared its rows): for every PE s of another
// node, our rows of its tokens (and weights), then the tail word and "done", by RDMA WRITE on one
// QP (RC order: the tail lands after the rows). `tok` / `wts`: the registered rows the WRITEs read
// (wts nullptr: no weights). False on failure (recorded).
MORI_DEVICE_INLINE bool PushPostRemote(const EpCombineKernelArgs& a, const core::WaitContext& wait,
                                       uint64_t epoch, int parity, uint64_t format,
                                       uint32_t wireRow, const uint8_t* tok, const uint8_t* wts) {
  const EpKernelCommon& c = a.c;
  const int W = c.worldSize;
  const int me = c.rank;
  const int K = c.topK;
  uint8_t* L = c.symmLocal;
  const size_t landing = static_cast<size_t>(c.maxTokensPerRank) * (K < W ? K : W);
  const uint64_t landed = EpTagWord(epoch, EpLandingValue(format, wts != nullptr));
  uint64_t* doneTag = &(At<EpSignal>(L, c.symm.doneInbox) + me)->tag;
  size_t recvBase = 0;
  for (int s = 0; s < W; s++) {
    const size_t n = static_cast<size_t>(c.state->recvCount[s]);
    if (IsRemote(c, s)) {
      size_t base = 0;
      if (n > 0 && !InterLandingBase(c, wait, s, &base)) return false;
      const size_t at = static_cast<size_t>(parity) * landing + base;
      bool ok = RdmaWrite(c, s, L + c.symm.pushLandTokens + at * wireRow, tok + recvBase * wireRow,
                          n * wireRow);
      if (ok && wts != nullptr)
        ok = RdmaWrite(c, s, L + c.symm.pushLandWeights + at * K * sizeof(float),
                       wts + recvBase * K * sizeof(float), n * K * sizeof(float));
      if (ok)
        ok = RdmaWrite(c, s,
                       At<uint64_t>(L, c.symm.pushLandTail) + EpPushArrivedIndex(parity, me, W),
                       &landed, sizeof(landed));
      if (ok) ok = RdmaWrite(c, s, doneTag, &epoch, sizeof(epoch));
      if (!ok) return false;
    }
    recvBase += n;
  }
  return true;
}

// 512-thread blocks have 128 registers per thread: half the loads in flight per lane (twice the
// warps) keep step 2 out of local memory.
template <int kThreads>
constexpr int kPushUnrollFor = kThreads > 256 ? kPushUnroll / 2 : kPushUnroll;

// What the steps of a push combine call share: the kernel computes these once, at its entry, and
// the step functions read them from here (recomputing them there changes register allocation).
struct EpPushShape {
  int M, T, G;            // max tokens per rank, tokens, PEs of our node (W on one node)
  int node0;              // our node's first PE
  int totalWarps, gWarp;  // the grid's warps; this warp's index among them
  unsigned nShares;       // step 2's work, in shares of nWarps warps' items
  bool fp8;               // quant_type fp8_direct_cast: rows are pushed as e4m3 codes
  core::Fp8Format fp8Format;
  uint64_t format;         // our ready format (EpPackReady)
  int vecs;                // input vectors of a row (the arrival unit)
  uint32_t wireRow;        // bytes of a pushed row (a slot)
  int R;                   // rows dispatch received (the combine input's rows)
  uint8_t* L;              // our symmetric block
  uint8_t* recvTok;        // pushRecvTokens
  float* recvW;            // pushRecvWeights
  uint64_t* arrived;       // pushArrived[parity][.]
  size_t landing;          // InterNode: rows of one parity's landing
  const uint8_t* wireTok;  // InterNode: the registered rows the WRITEs of step 2' read
  const float* wireW;      // and weights (nullptr: none)
};

// Step 1 (block 0, thread 0, send). End: our format (and weights) in every local PE's readyInbox
// and "done reading your buffers" in its doneInbox, published by one fence.
template <bool kInter>
MORI_DEVICE_INLINE void EpPushSignalReady(const EpKernelCommon& c, const EpKernelFrame& f,
                                          const EpPushShape& sh) {
  constexpr bool inter = kInter;
  const auto& [M, T, G, node0, totalWarps, gWarp, nShares, fp8, fp8Format, format, vecs, wireRow, R,
               L, recvTok, recvW, arrived, landing, wireTok, wireW] = sh;

  // ---- 1. our format, and done, to every PE of our node ---------------------------------------
  const size_t readySlot = EpReadyInboxIndex(f.parity, f.me, f.W);
  SignalStoreAll(
      f.W,
      [&](int p) {
        return inter && IsRemote(c, p)
                   ? nullptr
                   : At<EpSignal>(PeerBlock(c, p), c.symm.readyInbox) + readySlot;
      },
      format, f.epoch);
  // The done tags (no value) are ordered by SignalStoreAll's fence too (other nodes: step 2').
  for (int p = 0; p < f.W; p++) {
    if (!(inter && IsRemote(c, p)))
      core::AtomicStoreRelaxedSystem(&(At<EpSignal>(PeerBlock(c, p), c.symm.doneInbox) + f.me)->tag,
                                     f.epoch);
  }
}

// Step 2', one share (InterNode). Start: as step 2. End: this block's items of the share for other
// nodes' PEs are in registered memory (cast or copied; not yet published).
template <typename Elem, int kThreads, bool kInter>
MORI_DEVICE_INLINE void EpPushPrepareRemoteShare(const EpCombineKernelArgs& a,
                                                 const EpKernelFrame& f, const EpPushShape& sh,
                                                 int sWarp, int localBegin, int localEnd,
                                                 const int& sFailed) {
  const EpKernelCommon& c = a.c;
  constexpr bool inter = kInter;
  constexpr int kUnroll = kPushUnrollFor<kThreads>;
  const auto& [M, T, G, node0, totalWarps, gWarp, nShares, fp8, fp8Format, format, vecs, wireRow, R,
               L, recvTok, recvW, arrived, landing, wireTok, wireW] = sh;

  // ---- 2'. InterNode: the rows for other nodes' PEs into registered memory -------------------
  // (fp8: cast to codes; the caller's tensor: copied; the registered buffer or the dispatch
  // output: already there.)
  const bool copyTok = !fp8 && a.inTokens != wireTok;
  const bool copyW = wireW != nullptr && a.inWeights != wireW;
  if (inter && sFailed == 0 && (fp8 || copyTok || copyW)) {
    const int nLocal = localEnd - localBegin;
    const int nPrep = R - nLocal;
    const int parts = EpPartsPerRow(nPrep, totalWarps, vecs);
    for (int item = sWarp; item < nPrep * parts; item += totalWarps) {
      const int q = item / parts;
      const int part = item % parts;
      const int r = q < localBegin ? q : q + nLocal;
      const int vb = EpShareBegin(vecs, part, parts);
      const int ve = EpShareBegin(vecs, part + 1, parts);
      const uint4* src =
          reinterpret_cast<const uint4*>(a.inTokens + static_cast<size_t>(r) * a.rowBytes);
      if (fp8) {
        uint8_t* dstRow = L + c.symm.combineInFp8 + static_cast<size_t>(r) * wireRow;
        for (int v = vb + f.lane; v < ve; v += kWarpSize)
          EpStoreFp8<Elem>(dstRow, v, EpEncodeFp8<Elem>(src[v], fp8Format));
      } else if (copyTok) {
        WarpCopyVectors<kUnroll>(reinterpret_cast<uint4*>(L + c.symm.combineInTokens +
                                                          static_cast<size_t>(r) * a.rowBytes),
                                 src, vb, ve);
      }
      if (copyW && part == 0) {
        float* dw = At<float>(L, c.symm.combineInWeights) + static_cast<size_t>(r) * f.K;
        for (int k = f.lane; k < f.K; k += kWarpSize)
          dw[k] = a.inWeights[static_cast<size_t>(r) * f.K + k];
      }
    }
  }
}

// End of a share. Start: the block's stores of the share are done. End: they are published (one
// fence, then pushArrived on each PE); InterNode: the block completing the last share has posted
// step 2'; sShare holds the block's next claim (>= nShares: none).
template <bool kInter>
MORI_DEVICE_INLINE void EpPushPublishShare(const EpCombineKernelArgs& a, const EpKernelFrame& f,
                                           const core::WaitContext& wait, const EpPushShape& sh,
                                           unsigned long long* sPushed, int& sFailed,
                                           unsigned& sShare) {
  const EpKernelCommon& c = a.c;
  constexpr bool inter = kInter;
  const auto& [M, T, G, node0, totalWarps, gWarp, nShares, fp8, fp8Format, format, vecs, wireRow, R,
               L, recvTok, recvW, arrived, landing, wireTok, wireW] = sh;

  // Claims so far, read before the barrier and the fence below (their waits hide its latency).
  const uint32_t claimed =
      f.tid == 0 ? core::AtomicLoadRelaxedSystem(&c.state->pushNextShare) : nShares;
  // One release fence per share (as dispatch): the barrier orders every thread's stores before
  // thread 0's cumulative fence; the counter adds after it publish them.
  __syncthreads();
  if (f.tid == 0) {
    bool any = false;
    for (int p = 0; p < f.W; p++) any = any || sPushed[p] != 0;
    if (any || inter) {
      core::FenceAcqRelSystem();
      for (int p = 0; p < f.W; p++) {
        if (sPushed[p] != 0)
          core::AtomicFetchAddSystem(At<uint64_t>(PeerBlock(c, p), c.symm.pushArrived) +
                                         EpPushArrivedIndex(f.parity, f.me, f.W),
                                     static_cast<uint64_t>(sPushed[p]));
        sPushed[p] = 0;
      }
    }
    if constexpr (inter) {
      // The block completing the last share acquires every share's prepared rows (through the
      // counter; its fence also orders them before the NIC reads them) and posts. Every share is
      // counted, also after a failure, so the counter always returns to 0.
      const unsigned old = atomicAdd(&c.state->pushSharesDone, 1u);
      if (old == nShares - 1) {
        c.state->pushSharesDone = 0;
        core::FenceAcqRelSystem();
        if (sFailed == 0 && !core::DeviceAborted(wait) &&
            !PushPostRemote(a, wait, f.epoch, f.parity, format, wireRow, wireTok,
                            reinterpret_cast<const uint8_t*>(wireW)))
          sFailed = 1;
      }
    }
    // Claim again only while some share is unclaimed.
    sShare = claimed >= nShares ? nShares : atomicAdd(&c.state->pushNextShare, 1u);
  }
}

// The end of a send-only launch (thread 0). End: a failure is recorded for the receive half; the
// grid's last block has reset the share queue.
MORI_DEVICE_INLINE void EpPushSendDone(const EpKernelCommon& c, const EpKernelFrame& f,
                                       const int& sFailed) {
  // Send only: a failure here fails the receive half (which checks combineFailed at its end).
  // The grid's last block resets the share queue (every block has stopped claiming).
  if (f.tid == 0) {
    if (sFailed != 0) atomicOr(&c.state->combineFailed, 1u);
    const unsigned old = atomicAdd(&c.state->combineBlocksDone, 1u);
    if (old == gridDim.x - 1) {
      c.state->combineBlocksDone = 0;
      c.state->pushNextShare = 0;
    }
  }
}

// Step 3. Start: the block's sends are done (or a receive launch). End: every PE's signal (or
// tail) of this call is seen and its rows for our tokens have arrived, else sFailed (no barrier).
template <bool kInter>
MORI_DEVICE_INLINE void EpPushWaitArrivals(const EpCombineKernelArgs& a, const EpKernelFrame& f,
                                           const core::WaitContext& wait, const EpPushShape& sh,
                                           int& sFailed) {
  const EpKernelCommon& c = a.c;
  constexpr bool inter = kInter;
  const auto& [M, T, G, node0, totalWarps, gWarp, nShares, fp8, fp8Format, format, vecs, wireRow, R,
               L, recvTok, recvW, arrived, landing, wireTok, wireW] = sh;

  // ---- 3. every PE's rows for our tokens have arrived ---------------------------------------
  if (sFailed == 0) {
    EpSignal* inbox = At<EpSignal>(L, c.symm.readyInbox);
    for (int p = f.tid; p < f.W; p += f.nThreads) {
      if (p == f.me && !fp8) continue;  // fp8: our own rows arrive in our slots too
      const int sent = c.state->sendCount[p];
      if (inter && IsRemote(c, p)) {
        uint64_t* w = At<uint64_t>(L, c.symm.pushLandTail) + EpPushArrivedIndex(f.parity, p, f.W);
        bool weights = false;
        if (!InterLandingWait(wait, w, f.epoch, p, format,
                              "EP combine: peer's rows landed (push, landing tail)", &weights)) {
          sFailed = 1;
          continue;
        }
        if (a.outWeights != nullptr && sent > 0 && !weights) {
          ReportError(wait, p, "EP combine: a PE passed no weights, this PE asked for weights",
                      static_cast<const uint64_t*>(w), CmpOp::kNe,
                      static_cast<uint64_t>(EpCombineSource::kNone),
                      static_cast<uint64_t>(EpCombineSource::kNone));
          sFailed = 1;
        }
        if (f.tr != nullptr && p < kEpTracePeers)
          f.tr[kEpTraceWordPeerReady + p] = core::WallClockNs();
        continue;
      }
      EpSignal* sig = inbox + EpReadyInboxIndex(f.parity, p, f.W);
      uint64_t v = 0;
      if (!SignalWait(wait, sig, f.epoch, p, "EP combine: peer's push started (format signal)",
                      &v)) {
        sFailed = 1;
        continue;
      }
      if (EpReadyFormat(v) != EpReadyFormat(format)) {
        ReportError(wait, p, "EP combine: PEs called combine with different dtype/hidden",
                    static_cast<const uint64_t*>(&sig->value), CmpOp::kEq, EpReadyFormat(format),
                    EpReadyFormat(v));
        sFailed = 1;
        continue;
      }
      if (a.outWeights != nullptr && sent > 0 && EpReadyWeights(v) == EpCombineSource::kNone) {
        ReportError(wait, p, "EP combine: a PE passed no weights, this PE asked for weights",
                    static_cast<const uint64_t*>(&sig->value), CmpOp::kNe,
                    static_cast<uint64_t>(EpCombineSource::kNone),
                    static_cast<uint64_t>(EpReadyWeights(v)));
        sFailed = 1;
        continue;
      }
      const uint64_t expected = static_cast<uint64_t>(sent) * static_cast<uint64_t>(vecs);
      if (expected > 0 && !core::WaitUntil(wait, arrived + p, CmpOp::kGe, expected, p,
                                           "EP combine: rows pushed by PE")) {
        sFailed = 1;
        continue;
      }
      if (f.tr != nullptr && p < kEpTracePeers)
        f.tr[kEpTraceWordPeerReady + p] = core::WallClockNs();
    }
  }
}

// Step 4. Start: every row for our tokens is in our memory (step 3, the block synchronised). End:
// this block's output rows (and weights) are the sums in ascending PE order.
template <typename Elem, int kThreads, bool kInter>
MORI_DEVICE_INLINE void EpPushReduce(const EpCombineKernelArgs& a, const EpKernelFrame& f,
                                     const EpPushShape& sh, const uint32_t* sLandOff,
                                     const uint8_t* (*sRows)[kEpMaxWorldSize],
                                     const float* (*sWRows)[kEpMaxWorldSize], const int& sFailed) {
  const EpKernelCommon& c = a.c;
  constexpr bool inter = kInter;
  const auto& [M, T, G, node0, totalWarps, gWarp, nShares, fp8, fp8Format, format, vecs, wireRow, R,
               L, recvTok, recvW, arrived, landing, wireTok, wireW] = sh;

  // ---- 4. reduce from our own memory ----------------------------------------------------------
  if (sFailed == 0) {
    const int P = a.partsPerToken;
    const int items = T * P;
    const uint8_t* const landTok = L + c.symm.pushLandTokens;
    const float* const landW = At<const float>(L, c.symm.pushLandWeights);
    for (int item = gWarp; item < items; item += totalWarps) {
      const int t = item / P;
      const int part = item - t * P;
      const int slot = f.lane < f.W ? c.tokenSlot[static_cast<size_t>(t) * f.W + f.lane] : -1;
      const LaneMask members = core::WarpBallot(slot >= 0);
      const int n = core::PopCount(members);
      if (slot >= 0) {
        const int j = core::PopCount(members & LowerLanesMask(f.lane));  // ascending PE order
        if (inter && IsRemote(c, f.lane)) {  // another node's PE: the token's list position there
          const size_t lr = static_cast<size_t>(f.parity) * landing + sLandOff[f.lane] + slot;
          sRows[f.warp][j] = landTok + lr * wireRow;
          sWRows[f.warp][j] = landW + lr * f.K;
        } else {
          const size_t ps = EpPushSlot(f.parity, t, f.lane - node0, M, G);
          sRows[f.warp][j] = f.lane == f.me && !fp8
                                 ? a.inTokens + static_cast<size_t>(slot) * a.rowBytes
                                 : recvTok + ps * wireRow;
          sWRows[f.warp][j] = f.lane == f.me ? (a.inWeights != nullptr
                                                    ? a.inWeights + static_cast<size_t>(slot) * f.K
                                                    : nullptr)
                                             : recvW + ps * f.K;
        }
      }
      core::WarpSync();
      const int vb = EpShareBegin(vecs, part, P);
      const int ve = EpShareBegin(vecs, part + 1, P);
      uint4* const outRow =
          reinterpret_cast<uint4*>(a.outTokens + static_cast<size_t>(t) * a.rowBytes);
      if (fp8) {
        WarpReduceFp8<Elem, kThreads>(outRow, sRows[f.warp], n, vb, ve, fp8Format);
      } else {
        WarpReduceRows<Elem, kThreads>(outRow, sRows[f.warp], n, vb, ve);
      }
      // outWeights is set only when this PE passed weights, so its own row has them.
      if (part == 0 && a.outWeights != nullptr) {
        for (int k = f.lane; k < f.K; k += kWarpSize) {
          float acc = 0.0f;
          for (int j = 0; j < n; j++) acc += sWRows[f.warp][j][k];  // ascending PE order
          a.outWeights[static_cast<size_t>(t) * f.K + k] = acc;
        }
      }
      core::WarpSync();  // the next item rewrites this warp's member lists
    }
  }
}

// Step 5 (thread 0, the block synchronised). End: the block is counted; the grid's last block has
// completed our WRITEs, checked and reset pushArrived and bumped the combine epoch.
template <bool kInter>
MORI_DEVICE_INLINE void EpPushFinish(const EpKernelCommon& c, const EpKernelFrame& f,
                                     const core::WaitContext& wait, const EpPushShape& sh,
                                     const int& sFailed) {
  constexpr bool inter = kInter;
  const auto& [M, T, G, node0, totalWarps, gWarp, nShares, fp8, fp8Format, format, vecs, wireRow, R,
               L, recvTok, recvW, arrived, landing, wireTok, wireW] = sh;

  EpTraceStamp(f.tr, kEpCombineReduced);
  EpTraceStamp(f.tr, kEpCombineFenced);
  if (sFailed != 0) atomicOr(&c.state->combineFailed, 1u);
  __threadfence();
  const unsigned old = atomicAdd(&c.state->combineBlocksDone, 1u);
  if (f.tr != nullptr) {
    EpTraceStamp(f.tr, kEpCombineCounted);
    f.tr[kEpTraceWordArrival] = static_cast<uint64_t>(old) + 1;
  }
  if (old == gridDim.x - 1) {
    __threadfence();
    const bool failed = atomicExch(&c.state->combineFailed, 0u) != 0;
    c.state->combineBlocksDone = 0;
    c.state->pushNextShare = 0;  // every block has stopped claiming push shares
    // Our WRITEs of step 2' read our input until they complete (the caller may reuse it next).
    if constexpr (inter) {
      if (!core::DeviceAborted(wait)) shmem::ShmemQuietThread(c.shmem);
    }
    for (int p = 0; p < f.W; p++) {
      if ((p == f.me && !fp8) || (inter && IsRemote(c, p))) continue;
      const uint64_t expected =
          static_cast<uint64_t>(c.state->sendCount[p]) * static_cast<uint64_t>(vecs);
      const uint64_t got = core::AtomicLoadRelaxedSystem(arrived + p);
      if (!failed && got != expected)
        ReportError(wait, p, "EP combine: more vectors pushed than this PE sent to that PE",
                    static_cast<const uint64_t*>(arrived + p), CmpOp::kEq, expected, got);
      core::AtomicStoreRelaxedSystem(arrived + p, static_cast<uint64_t>(0));
    }
    // The next kernel on the stream reads the epoch: the kernel boundary publishes it.
    c.state->combineEpoch = f.epoch;
    EpTraceStamp(f.tr, kEpCombineTail);
  }
}

// kInter: the InterNode family (steps 2' and the tails of step 3). A template parameter, as the
// pull kernel's family: the work-request code's registers and stack would spill the IntraNode
// build.
template <typename Elem, int kThreads, bool kInter>
MORI_DEVICE_INLINE void EpCombinePushBody(const EpCombineKernelArgs& a) {
  __shared__ const uint8_t* sRows[kCombineMaxWarps][kEpMaxWorldSize];
  __shared__ const float* sWRows[kCombineMaxWarps][kEpMaxWorldSize];
  __shared__ unsigned long long sPushed[kEpMaxWorldSize];  // vectors this block stored per PE
  __shared__ uint32_t sLandOff[kEpMaxWorldSize];  // InterNode: landing row of PE p's first row
  __shared__ int sFailed;
  __shared__ unsigned sShare;  // the push share this block claimed (step 2); >= nShares: none

  const EpKernelCommon& c = a.c;
  const EpKernelFrame f = EpEnterKernel(c, EpTraceKind::kCombine, a.partsPerToken);
  const core::WaitContext wait = c.shmem.wait;  // private copy (see EpKernelFrame)
  const int M = c.maxTokensPerRank;
  const int T = a.numTokens;
  const int G = c.localSize;      // W on one node (IntraNode family)
  constexpr bool inter = kInter;  // PEs of other nodes get their rows by RDMA (step 2')
  constexpr int kUnroll = kPushUnrollFor<kThreads>;
  const int node0 = f.me - f.me % G;  // our node's first PE
  const int totalWarps = static_cast<int>(gridDim.x) * f.nWarps;
  const int gWarp = static_cast<int>(blockIdx.x) * f.nWarps + f.warp;
  const unsigned nShares = gridDim.x;  // step 2's work, in shares of nWarps warps' items
  const bool fp8 = a.wireFp8 != 0;
  const core::Fp8Format fp8Format = static_cast<core::Fp8Format>(a.fp8Format);
  const uint64_t format =
      EpPackReady(a.tokenSource, a.weightSource, a.dataType, a.rowBytes,
                  fp8 ? static_cast<EpCombineWire>(a.fp8Format + 1) : EpCombineWire::kInput);
  const int vecs = static_cast<int>(a.rowBytes / 16);  // input vectors (the arrival unit)
  const uint32_t wireRow = fp8 ? a.rowBytes / (16 / Elem::kPerVec) : a.rowBytes;
  const int R = *reinterpret_cast<volatile int32_t*>(c.totalRecv);
  uint8_t* const L = c.symmLocal;
  uint8_t* const recvTok = L + c.symm.pushRecvTokens;
  float* const recvW = At<float>(L, c.symm.pushRecvWeights);
  uint64_t* const arrived =
      At<uint64_t>(L, c.symm.pushArrived) + EpPushArrivedIndex(f.parity, 0, f.W);
  const size_t landing = static_cast<size_t>(M) * (f.K < f.W ? f.K : f.W);
  // InterNode: the registered rows (and weights) the WRITEs of step 2' read.
  const uint8_t* const wireTok =
      L + (fp8                                              ? c.symm.combineInFp8
           : a.tokenSource == EpCombineSource::kDispatchOut ? c.symm.dispatchOutTokens
                                                            : c.symm.combineInTokens);
  const float* const wireW =
      a.inWeights == nullptr ? nullptr
                             : At<const float>(L, a.weightSource == EpCombineSource::kDispatchOut
                                                      ? c.symm.dispatchOutWeights
                                                      : c.symm.combineInWeights);
  const EpPushShape sh{M,       T,         G,       node0,   totalWarps, gWarp, nShares,
                       fp8,     fp8Format, format,  vecs,    wireRow,    R,     L,
                       recvTok, recvW,     arrived, landing, wireTok,    wireW};

  const bool doSend = a.phase != EpCombinePhase::kReceive;  // steps 1-2'
  const bool doRecv = a.phase != EpCombinePhase::kSend;     // steps 3-5
  if (f.tid == 0) {
    sFailed = 0;
    // The first claim of step 2 (its latency overlaps the loads above).
    if (doSend) sShare = atomicAdd(&c.state->pushNextShare, 1u);
    // Same verdict in every block; block 0 records it.
    if (R > a.inRows || (a.inWeights != nullptr && R > a.inWeightRows)) {
      if (blockIdx.x == 0)
        ReportError(wait, -1,
                    R > a.inRows ? "EP combine: input has fewer rows than dispatch received"
                                 : "EP combine: weights have fewer rows than dispatch received",
                    CmpOp::kGe, static_cast<uint64_t>(R),
                    static_cast<uint64_t>(R > a.inRows ? a.inRows : a.inWeightRows));
      sFailed = 1;
    }
    if (inter && doRecv) {
      uint32_t off = 0;  // landing order: destination PE, then list index
      for (int p = 0; p < f.W; p++) {
        sLandOff[p] = off;
        if (IsRemote(c, p)) off += static_cast<uint32_t>(c.state->sendCount[p]);
      }
    }
  }
  for (int p = f.tid; p < f.W; p += f.nThreads) sPushed[p] = 0;
  __syncthreads();

  if (doSend && blockIdx.x == 0 && f.tid == 0 && sFailed == 0) EpPushSignalReady<kInter>(c, f, sh);

  // Rows of the dispatch output by source PE: our node's sources [localBegin, localEnd), our own
  // [selfBegin, selfBegin + recvCount[me]).
  int localBegin = 0, localEnd = 0, selfBegin = 0;
  if (doSend) {
    int before = 0;
    for (int s = 0; s < f.W; s++) {
      if (s == node0) localBegin = before;
      if (s == f.me) selfBegin = before;
      before += c.state->recvCount[s];
      if (s == node0 + G - 1) localEnd = before;
    }
  }

  // Steps 2 and 2' are cut into nShares shares (share i: the items of warps i * nWarps ... of a
  // grid-strided loop), which blocks claim from c.state->pushNextShare, not shares by block index:
  // a block claims again after each share while shares are unclaimed, so the blocks that are
  // resident push everything before any of them waits in step 3. A PE whose grid is not all
  // resident (ranks sharing a GPU under MPS: other clients' blocks hold SMs of its share) would
  // otherwise wait for rows its own unplaced blocks hold back, while its peers wait for those rows
  // too (docs/ep.md "Residency").
  while (doSend) {
    __syncthreads();  // sShare (and the last share's bookkeeping) is visible
    if (sShare >= nShares) break;
    const int sWarp = static_cast<int>(sShare) * f.nWarps + f.warp;

    // ---- 2. push the rows we hold to their tokens' PEs on our node ------------------------------
    // (Kept in the body: as a step function it changes the 512-thread InterNode build's spills.)
    if (sFailed == 0) {
      // fp8: our own rows are pushed too (into our own slots).
      const int selfCount = fp8 ? 0 : c.state->recvCount[f.me];
      const int nPush = localEnd - localBegin - selfCount;
      // As the reduce: several warps per row when rows are fewer than warps, one item per warp.
      const int parts = EpPartsPerRow(nPush, totalWarps, vecs);
      const int items = nPush * parts;
      for (int item = sWarp; item < items; item += totalWarps) {
        const int q = localBegin + item / parts;
        const int part = item % parts;
        const int r = q < selfBegin ? q : q + selfCount;
        const int vb = EpShareBegin(vecs, part, parts);
        const int ve = EpShareBegin(vecs, part + 1, parts);
        // The row's first kUnroll vectors per lane (all of them for small batches) and its
        // weights are loaded before the source position, on which only the destination depends:
        // the two latencies overlap.
        const uint4* src =
            reinterpret_cast<const uint4*>(a.inTokens + static_cast<size_t>(r) * a.rowBytes);
        uint4 head[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; u++) {
          const int v = vb + f.lane + u * kWarpSize;
          if (v < ve) head[u] = src[v];
        }
        float w = 0.0f;
        const bool doW = part == 0 && a.inWeights != nullptr;
        if (doW && f.lane < f.K) w = a.inWeights[static_cast<size_t>(r) * f.K + f.lane];
        const int pos = At<const int32_t>(L, c.symm.dispatchOutSrcPos)[r];
        const int s = pos / M;
        const int t = pos - s * M;
        // Dispatch wrote these; never expected: a source outside our node's PEs (or ourselves).
        if (s < node0 || s >= node0 + G || (s == f.me && !fp8)) {
          // The record names the source PE the row's position word decodes to, and what it must be.
          if (f.lane == 0)
            ReportError(wait, s, "EP combine: source PE of a received row (out of step)",
                        s == f.me ? CmpOp::kNe : CmpOp::kLt,
                        static_cast<uint64_t>(s == f.me ? f.me : node0 + G),
                        static_cast<uint64_t>(static_cast<uint32_t>(s)));
          sFailed = 1;
          break;
        }
        const size_t slot = EpPushSlot(f.parity, t, f.me - node0, M, G);
        uint8_t* const pb = PeerBlock(c, s);
        uint8_t* const dstRow = pb + c.symm.pushRecvTokens + slot * wireRow;
        if (fp8) {
#pragma unroll
          for (int u = 0; u < kUnroll; u++) {
            const int v = vb + f.lane + u * kWarpSize;
            if (v < ve) EpStoreFp8<Elem>(dstRow, v, EpEncodeFp8<Elem>(head[u], fp8Format));
          }
          for (int v = vb + f.lane + kUnroll * kWarpSize; v < ve; v += kWarpSize)
            EpStoreFp8<Elem>(dstRow, v, EpEncodeFp8<Elem>(src[v], fp8Format));
        } else {
          uint4* dst = reinterpret_cast<uint4*>(dstRow);
#pragma unroll
          for (int u = 0; u < kUnroll; u++) {
            const int v = vb + f.lane + u * kWarpSize;
            if (v < ve) dst[v] = head[u];
          }
          if (vb + kUnroll * kWarpSize < ve)
            WarpCopyVectors<kUnroll>(dst, src, vb + kUnroll * kWarpSize, ve);
        }
        if (doW) {
          float* dw = At<float>(pb, c.symm.pushRecvWeights) + slot * f.K;
          if (f.lane < f.K) dw[f.lane] = w;
          for (int k = f.lane + kWarpSize; k < f.K; k += kWarpSize)
            dw[k] = a.inWeights[static_cast<size_t>(r) * f.K + k];
        }
        if (f.lane == 0) atomicAdd(&sPushed[s], static_cast<unsigned long long>(ve - vb));
      }
    }

    EpPushPrepareRemoteShare<Elem, kThreads, kInter>(a, f, sh, sWarp, localBegin, localEnd,
                                                     sFailed);
    EpPushPublishShare<kInter>(a, f, wait, sh, sPushed, sFailed, sShare);
  }  // shares
  if (doSend && f.tid == 0) EpTraceStamp(f.tr, kEpCombineSent);

  if (!doRecv) {
    EpPushSendDone(c, f, sFailed);
    return;
  }

  EpPushWaitArrivals<kInter>(a, f, wait, sh, sFailed);
  __syncthreads();
  if (f.tid == 0) EpTraceStamp(f.tr, kEpCombinePeersReady);
  EpPushReduce<Elem, kThreads, kInter>(a, f, sh, sLandOff, sRows, sWRows, sFailed);

  // ---- 5. complete our WRITEs; check and reset the arrival counters; epoch --------------------
  __syncthreads();
  if (f.tid == 0) EpPushFinish<kInter>(c, f, wait, sh, sFailed);
}

}  // namespace detail

}  // namespace mori::ops

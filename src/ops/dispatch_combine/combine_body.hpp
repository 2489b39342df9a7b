// The pull combine body the IntraNode and InterNode families share (the family is a template
// parameter). Each family's entry point and instantiations: intranode_combine.cpp (also the staged
// build), internode_combine.cpp; the fp8_direct_cast input cast they and InterNodeV1 run first:
// combine_cast.cpp. IntraNode combine: pull-based, deterministic. Protocol: docs/ep.md; buffers:
// layout.hpp.
//   1. Input in place (zero-copy registered buffer, or the dispatch output itself): block 0
//      signals "ready" to every PE at once. External input: every block copies a share of the rows
//      other PEs read into the registered buffer (after every PE finished reading that buffer in
//      the last combine); the last block to finish signals "ready". The ready signal says where our
//      rows are. The rows we received from ourselves are read in the caller's tensor. IntraNode
//      with MORI_EP_COMBINE_PRECOPY: EpCombinePrecopyKernel (combine_cast.cpp) signals ready and
//      copies instead, possibly while this kernel runs (copy flags kEpCopiedBefore).
//   2. Every block waits for every PE's ready signal (epoch-tagged, parity-double-buffered). A PE
//      whose ready says "copying" has its rows read only once their chunk is tagged
//      (combineRowsReady, EpCopiedRowsWait).
//   3. For each of this PE's tokens of the last dispatch, a warp (or, for small batches, several
//      warps on slices of the row) loads the rows from the token's destination PEs, at the slots
//      dispatch recorded, with several 16-byte loads from several PEs in flight, and sums them in
//      fp32 in ascending PE order: bitwise reproducible. Weights rows likewise. Large batches on
//      sm_90+ (staged kernel): lane 0 streams the rows through shared-memory stages with bulk
//      copies instead, and the lanes sum from there in the same order.
//   4. The last block to finish tells every PE "done reading your buffers" (doneInbox) and bumps
//      the combine epoch. Nobody waits for that here: the next dispatch (before it lets anyone
//      write our dispatch output) and the next combine (before it overwrites our registered
//      buffer) wait for it.
#pragma once

#include "kernel_args.hpp"
#include "common_device.hpp"
#include "combine_reduce.hpp"
#include "trace_device.hpp"
#include "mori/core/gpu_check.hpp"

namespace mori::ops {
namespace detail {

using core::CmpOp;

// Waits (bounded by the device timeout) until stage barrier `bar` completes `phase`; every lane
// polls it (each acquires the copied bytes). Warp-uniform result: false if a lane timed out; the
// record names the barrier, the phase waited for and the time waited. The abort flag is not
// polled: it lives in host memory (a PCIe read), and these waits are on this GPU's own copy
// engine, whose copies complete (or fault the kernel) without any peer's help, normally within
// microseconds. The staged kernel has no registers to spare: polling the flag on core::WaitUntil's
// schedule, or recording from every lane before the ballot, makes it spill.
MORI_DEVICE_INLINE bool WarpWaitStage(const core::WaitContext& wait, uint64_t* bar,
                                      uint32_t phase) {
  bool timedOut = false;
  uint32_t spins = 0;
  uint64_t t0 = 0, waited = 0;
  while (!core::MbarTryWait(bar, phase)) {
    if ((++spins & 255u) == 0) {
      const uint64_t now = core::WallClockNs();
      if (t0 == 0) {
        t0 = now;
      } else if (now - t0 > wait.timeoutNs) {
        timedOut = true;
        waited = now - t0;
        break;
      }
    }
  }
  const bool anyTimedOut = core::WarpBallot(timedOut) != 0;
  if (anyTimedOut && core::LaneId() == 0)  // lanes poll one barrier: they time out together
    core::RecordWaitTimeout(wait, -1, "EP combine: bulk copy of peer rows into shared memory",
                            static_cast<const uint64_t*>(bar), CmpOp::kEq,
                            static_cast<uint64_t>(phase), static_cast<uint64_t>(~phase & 1u),
                            waited > 0 ? waited : wait.timeoutNs);
  return !anyTimedOut;
}

// o[v] = sum over the kN rows of a stage (row j at st + j * chunk) of their vector v, for the
// chunk's `vecs` vectors: fp32 from +0.0, rows in order: the additions of the predicated loop in
// WarpReduceRowsStaged (and of WarpSumFewRows), so the sums are bitwise the same. With the row
// count a constant the loop carries no predicated-off loads and sums (docs/performance.md,
// "Staged combine"); more vectors per lane in flight spill in the 128-register build.
template <typename Elem, int kN>
MORI_DEVICE_INLINE void WarpSumStage(uint4* __restrict__ o, const uint8_t* st, uint32_t chunk,
                                     int vecs) {
  static_assert(kN >= 1 && kN <= kEpCombineStageRows, "a stage holds 1..kEpCombineStageRows rows");
  for (int v = core::LaneId(); v < vecs; v += kWarpSize) {
    float acc[Elem::kPerVec];
#pragma unroll
    for (int i = 0; i < Elem::kPerVec; i++) acc[i] = 0.0f;
#pragma unroll
    for (int j = 0; j < kN; j++)
      Elem::Accumulate(acc, reinterpret_cast<const uint4*>(st + j * chunk)[v]);
    o[v] = Elem::Pack(acc);
  }
}

// out[v] = sum over rows j < n (n in 1..kEpCombineStageRows, ascending PE order) of rows[j][v]
// for v in [vb, ve): lane 0 streams chunks of every row into the warp's kEpCombineStages stages
// with bulk copies (kEpCombineStages - 1 chunks ahead of the one being summed), the lanes sum
// each chunk from shared memory. `uses` counts the chunks this warp has streamed (stage k %
// kEpCombineStages, barrier phase (k / kEpCombineStages) & 1). Same additions, same order, as
// WarpSumFewRows. Returns false (warp-uniform) if a copy did not complete in time.
template <typename Elem>
MORI_DEVICE_INLINE bool WarpReduceRowsStaged(uint4* __restrict__ out, const uint8_t* const* rows,
                                             int n, int vb, int ve, uint8_t* stages, uint64_t* bars,
                                             uint32_t* uses, const core::WaitContext& wait) {
  constexpr int S = kEpCombineStages;
  constexpr bool kSumByCount = Elem::kPerVec == 8;
  const int lane = core::LaneId();
  const uint32_t chunk = EpStagedChunkBytes(n);
  const uint32_t begin = static_cast<uint32_t>(vb) * 16, end = static_cast<uint32_t>(ve) * 16;
  const int nChunks = static_cast<int>(EpStagedChunkCount(begin, end, chunk));
  const uint32_t k0 = *uses;
  auto issue = [&](int c) {
    if (lane == 0) {
      const uint32_t k = k0 + c;
      uint64_t* bar = bars + k % S;
      const uint32_t off = begin + c * chunk;
      const uint32_t bytes = EpStagedChunkLength(off, end, chunk);
      uint8_t* dst = stages + (k % S) * kEpCombineStageBytes;
      core::MbarArriveExpectTx(bar, bytes * n);
      for (int j = 0; j < n; j++)
        core::BulkCopyToShared(dst + j * chunk, rows[j] + off, bytes, bar);
    }
  };
  for (int c = 0; c < S - 1 && c < nChunks; c++) issue(c);
  for (int c = 0; c < nChunks; c++) {
    // The stage refilled here was summed in the previous step, which ended with a warp barrier.
    if (c + S - 1 < nChunks) issue(c + S - 1);
    const uint32_t k = k0 + c;
    if (!WarpWaitStage(wait, bars + k % S, (k / S) & 1u)) return false;
    const uint8_t* st = stages + (k % S) * kEpCombineStageBytes;
    const uint32_t off = begin + c * chunk;
    const int vecs = static_cast<int>(EpStagedChunkLength(off, end, chunk) / 16);
    uint4* o = out + off / 16;
    // One or two rows (every token of an op of at most two PEs, which `auto` stages) are summed
    // with the row count a constant; three or four rows, and fp32 rows (that build has no
    // registers for more copies of the loop: it spills), take the predicated loop.
    if (kSumByCount && n == 1) {
      WarpSumStage<Elem, 1>(o, st, chunk, vecs);
    } else if (kSumByCount && n == 2) {
      WarpSumStage<Elem, 2>(o, st, chunk, vecs);
    } else {
      for (int v = lane; v < vecs; v += kWarpSize) {
        float acc[Elem::kPerVec];
#pragma unroll
        for (int i = 0; i < Elem::kPerVec; i++) acc[i] = 0.0f;
#pragma unroll
        for (int j = 0; j < kEpCombineStageRows; j++) {
          if (j < n) Elem::Accumulate(acc, reinterpret_cast<const uint4*>(st + j * chunk)[v]);
        }
        o[v] = Elem::Pack(acc);
      }
    }
    core::WarpSync();
  }
  *uses = k0 + static_cast<uint32_t>(nChunks);
  return true;
}

// InterNode: returns the rows (and weights) we received from each PE of another node to that PE's
// landing region, where it sums them: rows of source s start at our recvBase(s) and land at
// InterLandingBase(s). Waits until s finished reading its landing region in its last combine
// (done), then WRITEs and the landing-ready word, on one QP. One thread; completed by the quiet at
// the end of the combine. Rows are `wireRow` bytes, read from where `ready` says (EpReadyTokens).
// Returns false on failure (recorded).
template <typename Elem>
MORI_DEVICE_INLINE bool InterReturnRows(const EpCombineKernelArgs& a, const core::WaitContext& wait,
                                        uint64_t epoch, uint64_t ready, uint32_t wireRow) {
  const EpKernelCommon& c = a.c;
  const int W = c.worldSize;
  const int me = c.rank;
  const int K = c.topK;
  uint8_t* L = c.symmLocal;
  const EpCombineSource ts = EpReadyTokens(ready);
  const uint8_t* tok = L + (ts == EpCombineSource::kFp8Wire       ? c.symm.combineInFp8
                            : ts == EpCombineSource::kDispatchOut ? c.symm.dispatchOutTokens
                                                                  : c.symm.combineInTokens);
  const uint8_t* wts =
      a.weightSource == EpCombineSource::kNone
          ? nullptr
          : L + (a.weightSource == EpCombineSource::kDispatchOut ? c.symm.dispatchOutWeights
                                                                 : c.symm.combineInWeights);
  const uint64_t landed = EpTagWord(epoch, EpLandingValue(ready, wts != nullptr));
  EpSignal* done = At<EpSignal>(L, c.symm.doneInbox);
  size_t recvBase = 0;
  for (int s = 0; s < W; s++) {
    const size_t n = static_cast<size_t>(c.state->recvCount[s]);
    if (n > 0 && IsRemote(c, s)) {
      size_t landingBase = 0;
      if (!InterLandingBase(c, wait, s, &landingBase)) return false;
      if (!core::WaitUntil(wait, &done[s].tag, CmpOp::kGe, epoch - 1, s,
                           "EP combine: peer done reading landing (last)"))
        return false;
      bool ok = RdmaWrite(c, s, L + c.symm.landingTokens + landingBase * wireRow,
                          tok + recvBase * wireRow, n * wireRow);
      if (ok && wts != nullptr)
        ok = RdmaWrite(c, s, L + c.symm.landingWeights + landingBase * K * sizeof(float),
                       wts + recvBase * K * sizeof(float), n * K * sizeof(float));
      if (ok) ok = RdmaWrite(c, s, At<uint64_t>(L, c.symm.landingReady) + me, &landed, 8);
      if (!ok) return false;
    }
    recvBase += n;
  }
  return true;
}

template <typename Elem, int kThreads, bool kStaged, EpFamily kFamily>
MORI_DEVICE_INLINE void EpCombineBody(const EpCombineKernelArgs& a) {
  constexpr bool kInter = kFamily == EpFamily::kInterNode;
  __shared__ const uint8_t* sTok[kEpMaxWorldSize];
  __shared__ const float* sW[kEpMaxWorldSize];
  __shared__ const uint8_t* sRows[kCombineMaxWarps][kEpMaxWorldSize];
  __shared__ int sPeer[kCombineMaxWarps][kEpMaxWorldSize];
  __shared__ int sSlot[kCombineMaxWarps][kEpMaxWorldSize];
  __shared__ int sFailed;
  __shared__ unsigned sClaim;
  __shared__ unsigned long long sCopying;  // bit p: PE p's rows are still being copied (tags)
  __shared__ __align__(8) uint64_t sStageBars[kCombineMaxWarps][kEpCombineStages];
  extern __shared__ __align__(128) uint8_t sStages[];  // staged: [warps][stages][stage bytes]
  constexpr bool kUseStages = kStaged && core::kHasBulkAsyncCopy;

  const EpKernelCommon& c = a.c;
  // EpCombinePrecopyKernel ran just before on this stream and may still be copying: it let this
  // kernel start (after everything before it had completed) and gates its rows by tags, so this
  // kernel does not wait for it here (it does before its end).
  const bool gated = !kInter && EpCopiedBefore(a);
  const EpKernelFrame f = EpEnterKernel(c, EpTraceKind::kCombine, a.partsPerToken, !gated);
  const core::WaitContext wait = c.shmem.wait;  // private copy (see EpKernelFrame)
  const int W = f.W, me = f.me, K = f.K, T = a.numTokens;
  const int tid = f.tid, nThreads = f.nThreads, lane = f.lane, warp = f.warp, nWarps = f.nWarps;
  const uint64_t epoch = f.epoch;
  const int parity = f.parity;
  // fp8_direct_cast: our rows are in combineInFp8 (EpCombineCastKernel ran first; tokenSource is
  // kFp8Wire); peers read (or we RDMA-write) them from there, wireRow bytes each.
  const bool fp8 = a.wireFp8 != 0;
  const uint32_t wireRow = fp8 ? a.rowBytes / (16 / Elem::kPerVec) : a.rowBytes;
  const uint64_t ready =
      EpPackReady(a.tokenSource, a.weightSource, a.dataType, a.rowBytes,
                  fp8 ? static_cast<EpCombineWire>(a.fp8Format + 1) : EpCombineWire::kInput);

  // Phase trace (trace_device.hpp): nullptr unless SetTrace was called; thread 0 stamps phase ends.
  uint64_t* const tr = f.tr;
  if (tid == 0) {
    sFailed = 0;
    sCopying = 0;
  }
  __syncthreads();

  // ---- 1. input in place, or copied into the registered buffer -------------------------------
  if (gated) {
    // EpCombinePrecopyKernel signals our ready (step 2 reads whether its checks failed).
  } else if (a.copyTokens != 0 || a.copyWeights != 0) {
    // Chunks claimed by the resident blocks; the block completing the last one signals ready.
    EpCombineCopyInput(a, wait, epoch, 0, W, true, sFailed, sClaim, [&] {
      // SignalStoreAll's fence also releases the copies acquired above.
      SignalStoreAll(
          W,
          [&](int p) { return kInter && IsRemote(c, p) ? nullptr : EpReadySlotOn(c, p, parity); },
          ready, epoch);
      if constexpr (kInter) {
        // SignalStoreAll's fence also orders the copies before the NIC reads them.
        if (!InterReturnRows<Elem>(a, wait, epoch, ready, wireRow)) sFailed = 1;
      }
    });
  } else if (blockIdx.x == 0) {
    for (int p = tid; p < W; p += nThreads) {
      if (kInter && IsRemote(c, p)) continue;
      SignalStore(EpReadySlotOn(c, p, parity), ready, epoch);
    }
    if constexpr (kInter) {
      // The input (written by earlier kernels) is in place: return other nodes' rows.
      if (tid == 0 && !InterReturnRows<Elem>(a, wait, epoch, ready, wireRow)) sFailed = 1;
    }
  }
  if (tid == 0) EpTraceStamp(tr, kEpCombineSent);

  // ---- 2. every PE's rows are ready ------------------------------------------------------------
  if (sFailed == 0) {
    for (int p = tid; p < W; p += nThreads) {
      if (kInter && IsRemote(c, p)) {
        // Rows from another node's PE arrive in our landing region, after its rows for lower
        // PEs of other nodes (landing order: destination, then list index = the token's slot).
        size_t off = 0;
        for (int d = 0; d < p; d++)
          if (IsRemote(c, d)) off += static_cast<size_t>(c.state->sendCount[d]);
        sTok[p] = nullptr;
        sW[p] = nullptr;
        if (c.state->sendCount[p] == 0) continue;  // none of our tokens went there
        bool weights = false;
        if (!InterLandingWait(wait, At<uint64_t>(c.symmLocal, c.symm.landingReady) + p, epoch, p,
                              ready, "EP combine: rows landed from PE", &weights)) {
          sFailed = 1;
          continue;
        }
        sTok[p] = c.symmLocal + c.symm.landingTokens + off * wireRow;
        if (weights) sW[p] = At<const float>(c.symmLocal, c.symm.landingWeights) + off * K;
        continue;
      }
      uint64_t v = 0;
      if (!EpReadyWait(c, wait, parity, epoch, p, ready, &v)) {
        sFailed = 1;
        continue;
      }
      if (tr != nullptr && p < kEpTracePeers) tr[kEpTraceWordPeerReady + p] = core::WallClockNs();
      EpReadySources(c, p, v, &sTok[p], &sW[p]);
      if (p == me) {
        EpCombineOwnRowsInPlace(a, &sTok[p], &sW[p]);
        // Our precopy's checks failed (set before our ready): nobody else gets our ready either.
        if (gated && *reinterpret_cast<volatile uint32_t*>(&c.state->combinePrecopyFailed) != 0)
          sFailed = 1;
      } else if (!kInter && EpReadyCopying(v)) {
        atomicOr(&sCopying, 1ull << p);
      }
    }
  }
  __syncthreads();
  if (tid == 0) EpTraceStamp(tr, kEpCombinePeersReady);

  // ---- 3. reduce ------------------------------------------------------------------------------
  if (sFailed == 0) {
    const int vecs = static_cast<int>(a.rowBytes / 16);
    const int P = a.partsPerToken;
    // int: P > 1 only when T < the warp count, so items < 2 x the warp count or items = T.
    const int items = T * P;
    const int stride = static_cast<int>(gridDim.x) * nWarps;
    // Every warp takes one item of the first round (item = global warp index). With more items
    // than warps (large batches) the rest are handed out by a work counter, one item at a time, so
    // warps that drew light tokens (fewer rows) take more and the blocks finish together, which a
    // fixed stride does not ensure (docs/performance.md, "Combine balance"). A warp asks for the
    // item after its next one while it reduces the current one, so the atomic's latency is hidden.
    const bool queued = items > stride;
    int item = static_cast<int>(blockIdx.x) * nWarps + warp;
    uint32_t ticket = 0;  // lane 0: the counter value drawn for the item after `next`
    if (queued && lane == 0) ticket = atomicAdd(&c.state->combineNextItem, 1u);
    int next = queued ? stride + static_cast<int>(core::WarpShfl(ticket, 0)) : item + stride;
    // Staged: this warp's stages and their barriers; the proxy fence orders the ready acquires
    // above (through the block barrier) before this warp's bulk copies of the peers' rows.
    uint8_t* const stages =
        sStages + static_cast<size_t>(warp) * kEpCombineStages * kEpCombineStageBytes;
    uint32_t stageUses = 0;
    if constexpr (kUseStages) {
      if (lane == 0) {
        for (int i = 0; i < kEpCombineStages; i++) core::MbarInit(&sStageBars[warp][i], 1);
        core::FenceMbarInit();
        core::FenceProxyAsync();
      }
      core::WarpSync();
    }
    // The slot table entry of the next item is loaded while the current one is reduced.
    int nextSlot = -1;
    if (item < items && lane < W) nextSlot = c.tokenSlot[static_cast<size_t>(item / P) * W + lane];
    for (; item < items;) {
      const int t = item / P;
      const int part = item - t * P;
      const int slot = nextSlot;
      if (next < items && lane < W)
        nextSlot = c.tokenSlot[static_cast<size_t>(next / P) * W + lane];
      if (queued && next < items && lane == 0) ticket = atomicAdd(&c.state->combineNextItem, 1u);
      // A row of a PE still copying its input is read once that PE has tagged its chunk.
      // (The mask is read from shared memory each time: a register for it spills.)
      if (!kInter && sCopying != 0 &&
          core::WarpBallot(!EpCopiedRowsWait(c, wait, epoch, sCopying, lane, slot)) != 0)
        break;  // recorded; the rest of this warp's items are left undone
      const LaneMask members = core::WarpBallot(slot >= 0);
      const int n = core::PopCount(members);
      if (slot >= 0) {
        const int j = core::PopCount(members & LowerLanesMask(lane));  // ascending PE order
        sRows[warp][j] = sTok[lane] + static_cast<size_t>(slot) * wireRow;
        sPeer[warp][j] = lane;
        sSlot[warp][j] = slot;
      }
      core::WarpSync();
      // The staged kernel's bulk copies (async proxy) read the rows the tags above acquired.
      if (kUseStages && sCopying != 0 && lane == 0) core::FenceProxyAsync();
      const int vb = EpShareBegin(vecs, part, P);
      const int ve = EpShareBegin(vecs, part + 1, P);
      // Weights (part 0): the first kCombinePeerBatch rows' values for k = lane are loaded before
      // the token rows, so their peer latency overlaps the row reduction; a PE that returned rows
      // without weights contributes 0 and is reported.
      const bool doW = part == 0 && a.outWeights != nullptr;
      float wPre[kCombinePeerBatch];
#pragma unroll
      for (int j = 0; j < kCombinePeerBatch; j++) {
        wPre[j] = 0.0f;
        if (doW && j < n && lane < K) {
          const float* src = sW[sPeer[warp][j]];
          if (src != nullptr) wPre[j] = src[static_cast<size_t>(sSlot[warp][j]) * K + lane];
        }
      }
      uint4* const outRow =
          reinterpret_cast<uint4*>(a.outTokens + static_cast<size_t>(t) * a.rowBytes);
      if (!kUseStages && fp8) {  // the staged kernel is never launched with fp8 (the launcher)
        WarpReduceFp8<Elem, kThreads>(outRow, sRows[warp], n, vb, ve,
                                      static_cast<core::Fp8Format>(a.fp8Format));
      } else if (kUseStages && n >= 1 && n <= kEpCombineStageRows) {
        if (!WarpReduceRowsStaged<Elem>(outRow, sRows[warp], n, vb, ve, stages, sStageBars[warp],
                                        &stageUses, wait))
          break;  // recorded; the rest of this warp's items are left undone
      } else {
        WarpReduceRows<Elem, kThreads>(outRow, sRows[warp], n, vb, ve);
      }
      if (doW) {
        if (lane == 0) {
          for (int j = 0; j < n; j++) {
            if (sW[sPeer[warp][j]] == nullptr)  // that PE returned rows but no weights
              ReportError(wait, sPeer[warp][j],
                          "EP combine: a PE passed no weights, this PE asked for weights",
                          CmpOp::kNe, static_cast<uint64_t>(EpCombineSource::kNone),
                          static_cast<uint64_t>(EpCombineSource::kNone));
          }
        }
        for (int k = lane; k < K; k += kWarpSize) {
          float acc = 0.0f;
          for (int jb = 0; jb < n; jb += kCombinePeerBatch) {
            float v[kCombinePeerBatch];
#pragma unroll
            for (int j = 0; j < kCombinePeerBatch; j++) {
              v[j] = 0.0f;
              if (jb + j < n) {
                if (jb == 0 && k == lane) {
                  v[j] = wPre[j];
                } else {
                  const float* src = sW[sPeer[warp][jb + j]];
                  if (src != nullptr) v[j] = src[static_cast<size_t>(sSlot[warp][jb + j]) * K + k];
                }
              }
            }
#pragma unroll
            for (int j = 0; j < kCombinePeerBatch; j++) {
              if (jb + j < n) acc += v[j];  // ascending PE order, as the rows
            }
          }
          a.outWeights[static_cast<size_t>(t) * K + k] = acc;
        }
      }
      core::WarpSync();  // the next item rewrites this warp's member lists
      item = next;
      if (queued) {
        next = item < items ? stride + static_cast<int>(core::WarpShfl(ticket, 0)) : items;
      } else {
        next = item + stride;
      }
    }
  }

  // ---- 4. done reading; epoch ----------------------------------------------------------------
  // One fence per block (see step 1): the barrier orders the block's peer loads before thread 0's
  // cumulative release fence; the last block acquires them all through the counter, then signals.
  __syncthreads();
  if (tid == 0) {
    // Gated: the precopy kernel must have completed before the last block resets its claim
    // counter and failure flag, and before this kernel completes (the stream's next kernels wait
    // for this one only).
    // (Re-evaluated from the arguments: a register kept for it spills in the staged kernel.)
    if (!kInter && EpCopiedBefore(a)) core::GridDependencyWait();
    if (EpCombineCountBlockDone(c, tr)) {
      if constexpr (!kInter) c.state->combinePrecopyFailed = 0;  // read in step 2 (own ready)
      // The abort flag is a PCIe read: issued before the fence, its latency overlaps the fence's.
      const bool aborted = core::DeviceAborted(wait);
      // Acquire every block's peer loads (through the counter) and release them to the done
      // signals: readers only wait for the tags (the value is unused), so relaxed tag stores after
      // this one fence publish them, without a release store (an NVLink round trip) per peer.
      core::FenceAcqRelSystem();
      if (!aborted) {
        if constexpr (kInter) {
          // Our WRITEs read our input buffers until they complete: complete them first.
          shmem::ShmemQuietThread(c.shmem);
        }
        for (int p = 0; p < W; p++) {
          uint64_t* tag = &(At<EpSignal>(c.symmLocal, c.symm.doneInbox) + me)->tag;
          if (kInter && IsRemote(c, p)) {
            RdmaWrite(c, p, tag, &epoch, sizeof(epoch));
          } else {
            core::AtomicStoreRelaxedSystem(
                &(At<EpSignal>(PeerBlock(c, p), c.symm.doneInbox) + me)->tag, epoch);
          }
        }
      }
      // The next kernel on the stream reads the epoch: the kernel boundary publishes it.
      c.state->combineEpoch = epoch;
      EpTraceStamp(tr, kEpCombineTail);
    }
  }
}

}  // namespace detail

}  // namespace mori::ops

// InterNodeV1 / InterNodeV1LL dispatch: rail-aligned, node-deduplicated. One kernel; every block
// takes its share of each phase, in this order (a phase waits only for earlier phases of any PE,
// so any number of blocks makes progress). Design and waits: docs/ep_internode_v1.md §5-7.
//   1. Pack, per remote node n (groups of blocks): scan which tokens node n needs (list L(me, n),
//      token order) and idx(me -> j, t) for its G PEs; the group leader posts the count record
//      (format, |L|, count(me -> j), the G expert histograms; every word tagged) to our rail peer
//      there on QP 0; the blocks pack the records into v1SendStage; the group's last block posts,
//      per channel q, the share's chunks (WRITE + tail on QP q; V1LL: one chunk for lists of up to
//      kEpV1LLMaxTokens records, V1's chunks above, and a tail also for an empty share; V1: after
//      credit >= k - 1).
//   2. Relay, per rail peer s (one block): wait s's count record of this call, store count(s -> j)
//      into every local PE's countInbox[k % 2][s][j] and s's histogram into j's expertInbox: from
//      then every PE of the node holds all W counts of its column, as with IntraNode.
//   3. Own node: block 0 waits until the local PEs finished reading our buffers (last combine),
//      then stores count(me -> j) and the histograms on the local PEs; every block copies its
//      share of L(me, node) from the input (fused FP8 quantisation included) to each local j that
//      needs it, at base(me -> j) + idx, after count(s -> j) for s < me and count(j -> j).
//   4. Forward, per rail peer s: as each channel's tail lands, copy every record to each local j
//      with idx >= 0 at base(s -> j) + idx (route remembers where, for combine); arrived[s] on j.
//      V1: the last block posts credit {k} to s (also when s sent nothing).
//   5. Block 0 receives as IntraNode (EpDispatchReceive); the last block completes our WRITEs
//      (quiet: the staging is reused by the next call) and bumps the epoch.
#include "internode_v1_device.hpp"
#include "kernel_args.hpp"
#include "mori/core/gpu_check.hpp"

namespace mori::ops {
namespace detail {

using core::CmpOp;

constexpr int kV1CopyUnroll = 8;

// Writes token t of our input (vectors [vb, ve) of its input row; `meta`: also its weights,
// scales, indices and source position) to `d`, quantising when the call does. One warp.
template <typename IndexT>
MORI_DEVICE_INLINE void WarpWriteInputRow(const EpDispatchKernelArgs& a, int t, int vb, int ve,
                                          bool meta, const EpV1RowDst& d) {
  const EpKernelCommon& c = a.c;
  const int K = c.topK;
  const int lane = core::LaneId();
  const uint4* src =
      reinterpret_cast<const uint4*>(a.inTokens + static_cast<size_t>(t) * a.inRowBytes);
  if (a.quant != EpDispatchQuant::kNone) {
    const int nGroups = static_cast<int>(a.inRowBytes / 16) / kQuantGroupVecs;
    WarpQuantizeVectors<kV1CopyUnroll>(d.row, d.scales, src, vb, ve, nGroups, a.quant,
                                       static_cast<core::Fp8Format>(a.fp8Format));
  } else {
    WarpCopyVectors<kV1CopyUnroll>(reinterpret_cast<uint4*>(d.row), src, vb, ve);
  }
  if (!meta) return;
  const IndexT* ids = static_cast<const IndexT*>(a.inIndices) + static_cast<size_t>(t) * K;
  for (int k = lane; k < K; k += kWarpSize) {
    if (a.inWeights != nullptr) d.weights[k] = a.inWeights[static_cast<size_t>(t) * K + k];
    reinterpret_cast<IndexT*>(d.indices)[k] = ids[k];
  }
  if (a.scaleCopy == EpScaleCopy::kWords) {
    WarpCopyWords(
        reinterpret_cast<uint32_t*>(d.scales),
        reinterpret_cast<const uint32_t*>(a.inScales + static_cast<size_t>(t) * a.scaleBytes),
        static_cast<int>(a.scaleBytes / 4));
  } else if (a.scaleCopy == EpScaleCopy::kBytes) {
    WarpCopyBytes(d.scales, a.inScales + static_cast<size_t>(t) * a.scaleBytes,
                  static_cast<int>(a.scaleBytes));
  }
  if (lane == 0) *d.srcPos = c.rank * c.maxTokensPerRank + t;
}

// Copies a record's row vectors [vb, ve) (and, `meta`, its other fields) to `d`. One warp.
MORI_DEVICE_INLINE void WarpForwardRecord(const uint8_t* rec, const EpV1Record& L,
                                          uint32_t scaleBytes, int idxBytes, int K, int vb, int ve,
                                          bool meta, const EpV1RowDst& d) {
  WarpCopyVectors<kV1CopyUnroll>(reinterpret_cast<uint4*>(d.row),
                                 reinterpret_cast<const uint4*>(rec), vb, ve);
  if (!meta) return;
  WarpCopyWords(reinterpret_cast<uint32_t*>(d.weights),
                reinterpret_cast<const uint32_t*>(rec + L.weights), K);
  WarpCopyWords(reinterpret_cast<uint32_t*>(d.indices),
                reinterpret_cast<const uint32_t*>(rec + L.indices), K * idxBytes / 4);
  if (scaleBytes % 4 == 0) {
    WarpCopyWords(reinterpret_cast<uint32_t*>(d.scales),
                  reinterpret_cast<const uint32_t*>(rec + L.scales),
                  static_cast<int>(scaleBytes / 4));
  } else {
    WarpCopyBytes(d.scales, rec + L.scales, static_cast<int>(scaleBytes));
  }
  if (core::LaneId() == 0) *d.srcPos = *reinterpret_cast<const int32_t*>(rec + L.srcPos);
}

// base(s -> j) for each local PE j = node * G + g with cnt[g] > 0 (rows of source s for j), into
// base[g]: the sum of count(s' -> j) over s' < s, after count(j -> j) (j started this call: its
// outputs are free). Rows that would pass j's receive capacity: base[g] = -1 (j gets none of s's
// rows) and the overflow is kept for the grid's last block (EpKeepCapOverflow), not raised now:
// an early abort would make this PE's other blocks drop signals its peers wait for (count
// announcements, relays, V1LL empty-share tails); j finds the overflow itself from its counts.
// Every thread of the block calls; false (block-uniform) on failure (recorded).
MORI_DEVICE_INLINE bool EpV1Bases(const EpKernelCommon& c, const core::WaitContext& wait,
                                  const EpV1Topo& tp, int parity, uint64_t epoch, uint64_t format,
                                  int s, const int* cnt, int* base, int& sFailed) {
  const int W = c.worldSize;
  const int tid = static_cast<int>(threadIdx.x);
  const int nThreads = static_cast<int>(blockDim.x);
  for (int g = tid; g < tp.G; g += nThreads) base[g] = 0;
  __syncthreads();
  for (int i = tid; i < tp.G * W; i += nThreads) {
    const int g = i / W;
    const int sp = i - g * W;
    const int j = tp.LocalPe(g);
    if (cnt[g] == 0 || (sp >= s && sp != j)) continue;
    uint32_t n = 0;
    if (!EpCountWait<EpFamily::kIntraNode>(
            c, wait, parity, sp, j, epoch, format,
            "EP V1 dispatch: count of a lower PE for a local PE (base; another node's PE: relayed "
            "by its rail peer on this node)",
            &n)) {
      sFailed = 1;
    } else if (sp < s) {
      atomicAdd(&base[g], static_cast<int>(n));
    }
  }
  __syncthreads();
  if (tid == 0 && sFailed == 0) {
    for (int g = 0; g < tp.G; g++) {
      const long long end = static_cast<long long>(base[g]) + cnt[g];
      if (cnt[g] > 0 && end > c.maxRecvRows) {
        EpKeepCapOverflow(&c.state->v1CapOverflow, tp.LocalPe(g), static_cast<uint64_t>(end),
                          false);
        base[g] = -1;
      }
    }
  }
  __syncthreads();
  return sFailed == 0;
}

// After a block copied rows of source s: one release fence, then arrived[s] += rows[g] on each
// local PE (thread 0; the caller synchronised the block).
MORI_DEVICE_INLINE void EpV1PublishRows(const EpKernelCommon& c, const EpV1Topo& tp, int s,
                                        const int* rows) {
  bool any = false;
  for (int g = 0; g < tp.G; g++) any = any || rows[g] > 0;
  if (!any) return;
  core::FenceAcqRelSystem();
  for (int g = 0; g < tp.G; g++) {
    if (rows[g] > 0)
      core::AtomicFetchAddSystem(At<uint64_t>(PeerBlock(c, tp.LocalPe(g)), c.symm.arrived) + s,
                                 static_cast<uint64_t>(rows[g]));
  }
}

// kThreads: the most threads per block the build serves. Blocks of <= 256 threads (the default
// launch) take a build with 255 registers per thread; the 512-thread build's 128 spill.
template <typename IndexT, int kThreads>
MORI_DEVICE_INLINE void EpV1DispatchBody(const EpDispatchKernelArgs& a) {
  extern __shared__ __align__(16) uint8_t smemDyn[];
  __shared__ int sFailed;
  __shared__ int sTotal;
  __shared__ int sInputError;  // smallest token * K + slot of a bad id (kEpNoInputError: none)
  __shared__ int sCnt[kEpMaxWorldSize];   // rows of the current source for each local PE
  __shared__ int sBase[kEpMaxWorldSize];  // their first row on that PE
  __shared__ int sRows[kEpMaxWorldSize];  // rows this block copied to each local PE
  __shared__ int sList;                   // records of the current source for our node

  const EpKernelCommon& c = a.c;
  const EpKernelFrame f = EpEnterKernel(c, EpTraceKind::kDispatch, 0);
  const core::WaitContext wait = c.shmem.wait;  // private copy (see EpKernelFrame)
  const EpV1Topo tp(c);
  const int T = a.numTokens;
  const int M = c.maxTokensPerRank;
  const int Epr = c.numExpertsPerRank;
  const int G = tp.G;
  const int R = tp.R;
  const int b = static_cast<int>(blockIdx.x);
  const int nb = static_cast<int>(gridDim.x);
  const int par = tp.ll ? f.parity : 0;  // inbox / tail set of this call
  constexpr int kIdxBytes = static_cast<int>(sizeof(IndexT));
  const EpV1Record L = EpV1RecordLayout(a.rowBytes, f.K, a.scaleBytes, kIdxBytes, G);
  const int words = EpV1CountWords(G, Epr);
  const IndexT* idx = static_cast<const IndexT*>(a.inIndices);
  EpV1NodeScan scan = EpV1ScanLayout(smemDyn, M, T, G);
  const bool quant = a.quant != EpDispatchQuant::kNone;
  const int inVecs = static_cast<int>(a.inRowBytes / 16);
  const int unitVecs = quant ? kQuantGroupVecs : 1;  // a quantised row splits at group bounds
  const int units = inVecs / unitVecs;
  const int outVecs = static_cast<int>(a.rowBytes / 16);
  uint8_t* const L0 = c.symmLocal;
  if (f.tid == 0) {
    sFailed = 0;
    sTotal = 0;
    sInputError = kEpNoInputError;
  }
  __syncthreads();
  // The scans that announce counts (group leaders, block 0 for our node) check the ids when asked:
  // a PE with an id outside [-1, numExperts) flags every count it announces (the count record's
  // format word, the own node's count signals) and sends its report first (docs/ep.md, "Errors").
  int* const checkIds = a.checkIds != 0 ? &sInputError : nullptr;
  // This PE's report slot on every PE: the RDMA source for the rail peers (registered memory).
  uint64_t* const ownReport = EpInputErrorSlot(c, c.symmLocal, f.parity, f.me);

  // ---- 1. pack and post our records for each remote node ----------------------------------
  for (int m = 0; m < R; m++) {
    int g = 0, gs = 1;
    if (!EpV1Serves(b, nb, R, m, &g, &gs)) continue;
    const int n = EpV1SlotNode(m, tp.node, tp.N);
    const int peer = tp.RailPeer(m);
    const int slotOnPeer = tp.SlotOnPeer(m);
    EpV1ScanNode<IndexT>(c, idx, T, n, scan, g == 0, g == 0 ? checkIds : nullptr);
    const int cList = scan.Size(G);
    if (g == 0) {
      const bool inputError = checkIds != nullptr && sInputError != kEpNoInputError;
      // The count record, every word tagged with this call (the relay checks each).
      uint64_t* rec = At<uint64_t>(L0, c.symm.v1CountSend) + static_cast<size_t>(m) * words;
      for (int w = f.tid; w < words; w += f.nThreads) {
        uint32_t v = 0;
        if (w == kEpV1CountFormat) {
          v = static_cast<uint32_t>(a.format | (inputError ? kEpDispatchFormatInputError : 0ull));
        } else if (w == kEpV1CountRecords) {
          v = static_cast<uint32_t>(cList);
        } else if (w < kEpV1CountPerPe + G) {
          v = static_cast<uint32_t>(scan.Size(w - kEpV1CountPerPe));
        } else {
          v = static_cast<uint32_t>(scan.hist[w - kEpV1CountPerPe - G]);
        }
        rec[w] = EpTagWord(f.epoch, v);
      }
      __syncthreads();
      if (f.tid == 0) {
        if (inputError)
          core::AtomicStoreRelaxedSystem(ownReport,
                                         EpInputErrorReport(f.me, sInputError, idx, f.K));
        core::FenceAcqRelSystem();  // the record's words (and report) before the NIC reads them
        uint64_t* dst = At<uint64_t>(L0, c.symm.v1CountRec) +
                        (static_cast<size_t>(f.parity) * R + slotOnPeer) * words;
        // The report (i = 0) lands before the record (i = 1) on QP 0 (RC order): the relay reads
        // it once the record's flagged format word is there. One call site for both posts.
        for (int i = inputError ? 0 : 1; i < 2; i++) {
          if (!shmem::ShmemPutMemNbiThreadQp(
                  c.shmem, i == 0 ? ownReport : dst, i == 0 ? ownReport : rec,
                  i == 0 ? sizeof(uint64_t) : static_cast<size_t>(words) * 8, peer, 0)) {
            sFailed = 1;
            break;
          }
        }
        c.state->v1OutRecords[m] = cList;
      }
    }
    // Our tokens' positions in this list (combine finds their partials by them).
    {
      const int t0 = EpShareBegin(T, g, gs), t1 = EpShareBegin(T, g + 1, gs);
      for (int t = t0 + f.tid; t < t1; t += f.nThreads)
        c.v1ListPos[static_cast<size_t>(t) * R + m] = scan.PosOf(G, t);
    }
    // Pack this block's share of the list: record i = token TokenAt(G, i).
    const int i0 = EpShareBegin(cList, g, gs), i1 = EpShareBegin(cList, g + 1, gs);
    const int parts = EpPartsPerRow(i1 - i0, f.nWarps, inVecs);
    uint8_t* stage = L0 + c.symm.v1SendStage + static_cast<size_t>(m) * M * L.bytes;
    for (int item = f.warp; item < (i1 - i0) * parts; item += f.nWarps) {
      const int i = i0 + item / parts;
      const int part = item % parts;
      const int t = scan.TokenAt(G, i);
      uint8_t* r = stage + static_cast<size_t>(i) * L.bytes;
      WarpWriteInputRow<IndexT>(a, t, EpShareBegin(units, part, parts) * unitVecs,
                                EpShareBegin(units, part + 1, parts) * unitVecs, part == 0,
                                EpV1RecordRow(r, L));
      if (part == 0 && f.lane < G)
        reinterpret_cast<int32_t*>(r + L.header)[f.lane] = scan.PosOf(f.lane, t);
    }
    __syncthreads();
    if (f.tid == 0) {
      EpTraceStamp(f.tr, kEpDispatchV1Staged);
      core::FenceAcqRelSystem();
      const unsigned old = atomicAdd(&c.state->v1Packed[m], 1u);
      if (old == static_cast<unsigned>(gs) - 1) {
        c.state->v1Packed[m] = 0;
        core::FenceAcqRelSystem();  // acquire the group's staging (through the counter)
        // Posted also after an error elsewhere on this PE (the staging is complete): the rail
        // peer waits for these tails (V1LL: also an empty share's) whatever we found.
        bool ok = true;
        // V1: the rail peer forwarded all our records of the last call (its inbox is free).
        if (!tp.ll)
          ok = TagWaitAtLeast(wait, At<uint64_t>(L0, c.symm.v1Credit) + m, f.epoch - 1, peer,
                              "EP V1 dispatch: credit (rail peer forwarded our last call)");
        // V1LL: lists of up to kEpV1LLMaxTokens records as one WRITE per channel (the LL path),
        // longer ones in V1's chunks (forwarding overlaps the transfer); the forwarders take
        // either (tails count the share's records cumulatively).
        const int chunk = tp.ll && cList <= kEpV1LLMaxTokens ? (cList > 0 ? cList : 1)
                                                             : EpV1ChunkRecords(L.bytes);
        uint8_t* inbox =
            L0 + c.symm.v1Inbox + (static_cast<size_t>(par) * R + slotOnPeer) * M * L.bytes;
        uint64_t* tails =
            At<uint64_t>(L0, c.symm.v1Tail) + (static_cast<size_t>(par) * R + slotOnPeer) * tp.Q;
        for (int q = 0; q < tp.Q && ok; q++)
          ok = PostShare(c, peer, q, inbox, stage, L.bytes, EpShareBegin(cList, q, tp.Q),
                         EpShareBegin(cList, q + 1, tp.Q), chunk, tails + q, f.epoch, 0, tp.ll);
        if (!ok) sFailed = 1;
      }
    }
    __syncthreads();
  }

  if (f.tid == 0) EpTraceStamp(f.tr, kEpDispatchScanned);

  // ---- 2. relay our rail peers' count records to the local PEs --------------------------------
  for (int m = 0; m < R; m++) {
    int g = 0, gs = 1;
    if (!EpV1Serves(nb - 1 - b, nb, R, m, &g, &gs) || g != 0) continue;
    const int s = tp.RailPeer(m);
    uint64_t* rec =
        At<uint64_t>(L0, c.symm.v1CountRec) + (static_cast<size_t>(f.parity) * R + m) * words;
    for (int w = f.tid; w < words; w += f.nThreads) {
      uint32_t v = 0;
      if (!TagWait(wait, rec + w, f.epoch, s, "EP V1 dispatch: count record from rail peer", &v))
        sFailed = 1;
    }
    __syncthreads();
    if (sFailed == 0) {
      const uint64_t fmt = EpTagValue(rec[kEpV1CountFormat]);
      if (f.tid == 0 && (fmt & kEpDispatchFormatInputError) != 0) {
        // s's report landed before its record (QP 0); the relayed counts carry the flag.
        const uint64_t report = core::AtomicLoadRelaxedSystem(EpInputErrorSlot(c, L0, f.parity, s));
        for (int q = 0; q < G; q++)
          core::AtomicStoreRelaxedSystem(
              EpInputErrorSlot(c, PeerBlock(c, tp.LocalPe(q)), f.parity, s), report);
      }
      for (int i = f.tid; i < G * G; i += f.nThreads) {
        const int q = i / G, gg = i - q * G;
        EpSignal* slot = At<EpSignal>(PeerBlock(c, tp.LocalPe(q)), c.symm.countInbox) +
                         EpCountInboxIndex(f.parity, s, tp.LocalPe(gg), f.W);
        core::AtomicStoreRelaxedSystem(&slot->value,
                                       EpPackCount(EpTagValue(rec[kEpV1CountPerPe + gg]), fmt));
      }
      for (int i = f.tid; i < G * Epr; i += f.nThreads) {
        const int gg = i / Epr, e = i - gg * Epr;
        int32_t* ex = At<int32_t>(PeerBlock(c, tp.LocalPe(gg)), c.symm.expertInbox);
        core::AtomicStoreRelaxedSystem(
            ex + EpExpertInboxIndex(f.parity, s, e, f.W, Epr),
            static_cast<int32_t>(EpTagValue(rec[kEpV1CountPerPe + G + i])));
      }
      __syncthreads();
      if (f.tid == 0) {
        core::FenceAcqRelSystem();  // the values (and histograms) before the tags
        for (int i = 0; i < G * G; i++) {
          const int q = i / G, gg = i - q * G;
          EpSignal* slot = At<EpSignal>(PeerBlock(c, tp.LocalPe(q)), c.symm.countInbox) +
                           EpCountInboxIndex(f.parity, s, tp.LocalPe(gg), f.W);
          core::AtomicStoreRelaxedSystem(&slot->tag, f.epoch);
        }
        c.state->v1InRecords[m] = static_cast<int32_t>(EpTagValue(rec[kEpV1CountRecords]));
      }
    }
    __syncthreads();
  }
  if (f.tid == 0) EpTraceStamp(f.tr, kEpDispatchAnnounced);

  // ---- 3. own node: announce (block 0), copy our rows to the local PEs -----------------------
  EpV1ScanNode<IndexT>(c, idx, T, tp.node, scan, b == 0, b == 0 ? checkIds : nullptr);
  if (b == 0) {
    const bool inputError = checkIds != nullptr && sInputError != kEpNoInputError;
    const uint64_t countFormat = a.format | (inputError ? kEpDispatchFormatInputError : 0ull);
    const uint64_t prevCombine = *reinterpret_cast<volatile uint64_t*>(&c.state->combineEpoch);
    EpSignal* done = At<EpSignal>(L0, c.symm.doneInbox);
    for (int g = f.tid; g < G; g += f.nThreads) {
      if (!core::WaitUntil(wait, &done[tp.LocalPe(g)].tag, CmpOp::kGe, prevCombine, tp.LocalPe(g),
                           "EP V1 dispatch: local PE done reading (last combine)"))
        sFailed = 1;
    }
    __syncthreads();
    if (sFailed == 0) {
      for (int i = f.tid; i < G * G; i += f.nThreads) {
        const int q = i / G, gg = i - q * G;
        EpSignal* slot = At<EpSignal>(PeerBlock(c, tp.LocalPe(q)), c.symm.countInbox) +
                         EpCountInboxIndex(f.parity, f.me, tp.LocalPe(gg), f.W);
        core::AtomicStoreRelaxedSystem(
            &slot->value, EpPackCount(static_cast<uint32_t>(scan.Size(gg)), countFormat));
      }
      if (inputError && f.tid == 0) {
        const uint64_t report = EpInputErrorReport(f.me, sInputError, idx, f.K);
        for (int q = 0; q < G; q++)
          core::AtomicStoreRelaxedSystem(
              EpInputErrorSlot(c, PeerBlock(c, tp.LocalPe(q)), f.parity, f.me), report);
      }
      for (int i = f.tid; i < G * Epr; i += f.nThreads) {
        const int gg = i / Epr, e = i - gg * Epr;
        int32_t* ex = At<int32_t>(PeerBlock(c, tp.LocalPe(gg)), c.symm.expertInbox);
        core::AtomicStoreRelaxedSystem(ex + EpExpertInboxIndex(f.parity, f.me, e, f.W, Epr),
                                       scan.hist[i]);
      }
      __syncthreads();
      if (f.tid == 0) {
        core::FenceAcqRelSystem();
        for (int i = 0; i < G * G; i++) {
          const int q = i / G, gg = i - q * G;
          core::AtomicStoreRelaxedSystem(
              &(At<EpSignal>(PeerBlock(c, tp.LocalPe(q)), c.symm.countInbox) +
                EpCountInboxIndex(f.parity, f.me, tp.LocalPe(gg), f.W))
                   ->tag,
              f.epoch);
        }
      }
    }
  }
  if (f.tid == 0) EpTraceStamp(f.tr, kEpDispatchSendBase);
  {
    const int cList = scan.Size(G);
    const int i0 = EpShareBegin(cList, b, nb), i1 = EpShareBegin(cList, b + 1, nb);
    const int t0 = EpShareBegin(T, b, nb), t1 = EpShareBegin(T, b + 1, nb);
    for (int g = f.tid; g < G; g += f.nThreads) {
      sCnt[g] = scan.Size(g);
      sRows[g] = 0;
    }
    __syncthreads();
    if (sFailed == 0 && (i0 < i1 || t0 < t1) &&
        EpV1Bases(c, wait, tp, f.parity, f.epoch, a.format, f.me, sCnt, sBase, sFailed)) {
      // Slots of our tokens on the local PEs (combine pulls from them); other nodes' columns
      // are not used by this family.
      for (int i = f.tid; i < (t1 - t0) * G; i += f.nThreads) {
        const int t = t0 + i / G, g = i % G;
        const int p = scan.PosOf(g, t);
        c.tokenSlot[static_cast<size_t>(t) * f.W + tp.LocalPe(g)] =
            p < 0 || sBase[g] < 0 ? -1 : sBase[g] + p;
      }
      const int parts = EpPartsPerRow(i1 - i0, f.nWarps, inVecs);
      for (int item = f.warp; item < (i1 - i0) * parts; item += f.nWarps) {
        const int i = i0 + item / parts;
        const int part = item % parts;
        const int t = scan.TokenAt(G, i);
        for (int g = 0; g < G; g++) {
          const int p = scan.PosOf(g, t);
          if (p < 0 || sBase[g] < 0) continue;  // not for j, or past j's capacity
          WarpWriteInputRow<IndexT>(
              a, t, EpShareBegin(units, part, parts) * unitVecs,
              EpShareBegin(units, part + 1, parts) * unitVecs, part == 0,
              EpV1OutputRow(c, tp.LocalPe(g), static_cast<size_t>(sBase[g] + p), a.rowBytes,
                            a.scaleBytes, kIdxBytes));
          if (part == 0 && f.lane == 0) atomicAdd(&sRows[g], 1);
        }
      }
    }
    __syncthreads();
    if (f.tid == 0 && sFailed == 0) EpV1PublishRows(c, tp, f.me, sRows);
    __syncthreads();
  }
  if (f.tid == 0) EpTraceStamp(f.tr, kEpDispatchCopied);

  // ---- 4. forward our rail peers' records to the local PEs -----------------------------------
  for (int m = 0; m < R; m++) {
    const int s = tp.RailPeer(m);
    uint64_t* rec =
        At<uint64_t>(L0, c.symm.v1CountRec) + (static_cast<size_t>(f.parity) * R + m) * words;
    for (int w = f.tid; w <= kEpV1CountPerPe + G - 1; w += f.nThreads) {
      uint32_t v = 0;
      if (!TagWait(wait, rec + w, f.epoch, s, "EP V1 dispatch: count record from rail peer", &v)) {
        sFailed = 1;
      } else if (w == kEpV1CountFormat && EpCallFormat(v) != static_cast<uint32_t>(a.format)) {
        // Its records are laid out by its format: forwarding them under ours would misplace them.
        ReportError(wait, s, "EP dispatch: PEs passed different dtype/hidden/index type",
                    static_cast<const uint64_t*>(rec + w), CmpOp::kEq,
                    static_cast<uint64_t>(static_cast<uint32_t>(a.format)), EpCallFormat(v));
        sFailed = 1;
      } else if (w == kEpV1CountRecords) {
        sList = static_cast<int>(v);
      } else if (w >= kEpV1CountPerPe) {
        sCnt[w - kEpV1CountPerPe] = static_cast<int>(v);
      }
    }
    for (int g = f.tid; g < G; g += f.nThreads) sRows[g] = 0;
    __syncthreads();
    if (sFailed != 0) break;
    const int cList = sList;
    const int i0 = EpShareBegin(cList, b, nb), i1 = EpShareBegin(cList, b + 1, nb);
    // Tails: of every channel whose share meets our range, until the chunks up to the end of our
    // range landed (tails count the share's records cumulatively, chunk by chunk; V1LL lists of
    // up to kEpV1LLMaxTokens records: one chunk, waited for whole); V1LL: an empty share's tail
    // too (one block waits it), so that no tail of this call is left for the next call of this
    // parity.
    for (int q = f.tid; q < tp.Q; q += f.nThreads) {
      const int s0 = EpShareBegin(cList, q, tp.Q), s1 = EpShareBegin(cList, q + 1, tp.Q);
      const bool meets = s0 < s1 && s0 < i1 && i0 < s1;
      const bool empty = s0 == s1 && tp.ll && b == (m * tp.Q + q) % nb;
      const int upTo = tp.ll && cList <= kEpV1LLMaxTokens ? s1 : (i1 < s1 ? i1 : s1);
      uint32_t v = 0;
      if ((meets || empty) &&
          !TailWait(
              wait, At<uint64_t>(L0, c.symm.v1Tail) + (static_cast<size_t>(par) * R + m) * tp.Q + q,
              f.epoch, static_cast<uint32_t>(upTo - s0), static_cast<uint32_t>(s1 - s0),
              0xFFFFFFFFu, s, "EP V1 dispatch: records of a channel (tail) from rail peer", &v))
        sFailed = 1;
    }
    __syncthreads();
    // Block-uniform: every thread calls EpV1Bases (it has barriers) or none does.
    const bool based = sFailed == 0 && i0 < i1 &&
                       EpV1Bases(c, wait, tp, f.parity, f.epoch, a.format, s, sCnt, sBase, sFailed);
    if (f.tid == 0) EpTraceStamp(f.tr, kEpDispatchV1TailsSeen);
    if (based) {
      const uint8_t* inbox = L0 + c.symm.v1Inbox + (static_cast<size_t>(par) * R + m) * M * L.bytes;
      int32_t* route = c.v1Route + static_cast<size_t>(m) * M * G;
      const int parts = EpPartsPerRow(i1 - i0, f.nWarps, outVecs);
      for (int item = f.warp; item < (i1 - i0) * parts; item += f.nWarps) {
        const int i = i0 + item / parts;
        const int part = item % parts;
        const uint8_t* r = inbox + static_cast<size_t>(i) * L.bytes;
        const int32_t* head = reinterpret_cast<const int32_t*>(r + L.header);
        for (int g = 0; g < G; g++) {
          const int p = head[g];
          // Not for j (a bad index is never written), or past j's capacity.
          if (p < 0 || p >= sCnt[g] || sBase[g] < 0) continue;
          WarpForwardRecord(r, L, a.scaleBytes, kIdxBytes, f.K, EpShareBegin(outVecs, part, parts),
                            EpShareBegin(outVecs, part + 1, parts), part == 0,
                            EpV1OutputRow(c, tp.LocalPe(g), static_cast<size_t>(sBase[g] + p),
                                          a.rowBytes, a.scaleBytes, kIdxBytes));
          if (part == 0 && f.lane == 0) atomicAdd(&sRows[g], 1);
        }
        if (part == 0 && f.lane < G) {
          const int p = head[f.lane];
          route[static_cast<size_t>(i) * G + f.lane] =
              p < 0 || p >= sCnt[f.lane] || sBase[f.lane] < 0 ? -1 : sBase[f.lane] + p;
        }
      }
    }
    __syncthreads();
    if (f.tid == 0) {
      if (sFailed == 0) EpV1PublishRows(c, tp, s, sRows);
      if (!tp.ll) {
        // V1: the last block to finish with s's records (every block reads some or none)
        // tells s its records of this call are out of our inbox.
        core::FenceAcqRelSystem();
        const unsigned old = atomicAdd(&c.state->v1Forwarded[m], 1u);
        if (old == static_cast<unsigned>(nb) - 1) {
          c.state->v1Forwarded[m] = 0;
          core::FenceAcqRelSystem();
          const uint64_t credit = EpTagWord(f.epoch, 0);
          if (sFailed == 0 && !core::DeviceAborted(wait) &&
              !shmem::ShmemPutMemNbiThreadQp(c.shmem,
                                             At<uint64_t>(L0, c.symm.v1Credit) + tp.SlotOnPeer(m),
                                             &credit, sizeof(credit), s, 0))
            sFailed = 1;
        }
      }
    }
    __syncthreads();
  }
  if (f.tid == 0) EpTraceStamp(f.tr, kEpDispatchPublished);

  // ---- 5. receive (block 0); epoch ----------------------------------------------------------
  if (b == 0)
    EpDispatchReceive<EpFamily::kIntraNode>(c, wait, f.parity, f.epoch, a.format, sTotal, sFailed,
                                            a.inputErrorRecord, &c.state->v1CapOverflow);
  if (f.tid == 0) EpTraceStamp(f.tr, kEpDispatchReceived);
  __syncthreads();
  if (f.tid == 0) {
    __threadfence();
    const unsigned old = atomicAdd(&c.state->dispatchBlocksDone, 1u);
    if (f.tr != nullptr) {
      EpTraceStamp(f.tr, kEpDispatchCounted);
      f.tr[kEpTraceWordArrival] = static_cast<uint64_t>(old) + 1;
    }
    if (old == gridDim.x - 1) {
      c.state->dispatchBlocksDone = 0;
      // Our WRITEs read v1SendStage and v1CountSend until they complete; the next call rewrites
      // them.
      if (!core::DeviceAborted(wait)) shmem::ShmemQuietThread(c.shmem);
      // Every block is past its last signal: a receive-capacity overflow found this call is
      // recorded now (every PE of the call finishes it: each finds its own errors).
      EpRecordKeptCapOverflow(wait, &c.state->v1CapOverflow, c.maxRecvRows);
      c.state->dispatchEpoch = f.epoch;
    }
  }
}

}  // namespace detail

// The entry point of the family, both modes (kernel_args.hpp, "Kernel names").
namespace dispatch {
template <typename IndexT, int kThreads>
__global__ void __launch_bounds__(kThreads, 1)
    EpDispatchInterNodeV1Kernel(const EpDispatchKernelArgs a) {
  detail::EpV1DispatchBody<IndexT, kThreads>(a);
}
}  // namespace dispatch

// Two instantiations per index type, for blocks of <= 256 threads and of more (V1 and V1LL are
// one kernel: args.c.lowLatency).
void LaunchEpV1Dispatch(const EpDispatchKernelArgs& args, EpIndexType indexType, int blocks,
                        int threads, size_t smemBytes, gpuStream_t stream) {
  constexpr int kMaxT = kEpMaxThreadsPerBlock;
  const bool narrow = threads <= 256;
  auto kernel = indexType == EpIndexType::kInt32
                    ? (narrow ? dispatch::EpDispatchInterNodeV1Kernel<int32_t, 256>
                              : dispatch::EpDispatchInterNodeV1Kernel<int32_t, kMaxT>)
                    : (narrow ? dispatch::EpDispatchInterNodeV1Kernel<int64_t, 256>
                              : dispatch::EpDispatchInterNodeV1Kernel<int64_t, kMaxT>);
  MORI_CHECK_GPU(core::GpuLaunchKernel(kernel, blocks, threads, smemBytes, stream,
                                       args.c.programmatic != 0, args));
}

}  // namespace mori::ops

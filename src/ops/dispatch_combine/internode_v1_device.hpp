// Device helpers of the InterNodeV1 / InterNodeV1LL kernels (internode_v1_dispatch.cpp,
// internode_v1_combine.cpp): topology, block groups, the per-node membership scan, tagged-word
// waits and the chunked WRITE + tail posts. Design: docs/ep_internode_v1.md.
#pragma once

#include <cstdint>

#include "common_device.hpp"

namespace mori::ops::detail {

// Where this PE stands: G PEs per node, N nodes, R = N - 1 remote nodes (slot m is node
// EpV1SlotNode(m, node, N)), local index li (the rail: our rail peer on node n is n * G + li),
// Q channels per rail peer, P parity sets (V1LL 2, V1 1).
struct EpV1Topo {
  int G, N, R, node, li, Q;
  bool ll;
  MORI_DEVICE_INLINE explicit EpV1Topo(const EpKernelCommon& c)
      : G(c.localSize),
        N(c.worldSize / c.localSize),
        R(c.worldSize / c.localSize - 1),
        node(c.rank / c.localSize),
        li(c.rank % c.localSize),
        Q(c.channels),
        ll(c.lowLatency != 0) {}
  // Our rail peer on the node of remote slot m.
  MORI_DEVICE_INLINE int RailPeer(int m) const { return EpV1SlotNode(m, node, N) * G + li; }
  // Our slot on that rail peer (where it keeps what we send it).
  MORI_DEVICE_INLINE int SlotOnPeer(int m) const {
    return EpV1NodeSlot(node, EpV1SlotNode(m, node, N), N);
  }
  MORI_DEVICE_INLINE int LocalPe(int g) const { return node * G + g; }
};

// Blocks serving item i of `items` (round robin over the grid): with nb >= items, blocks b with
// b % items == i, *g = b / items of *gs; with fewer blocks, block i % nb alone. Whether block b
// serves item i.
MORI_HD inline bool EpV1Serves(int b, int nb, int items, int i, int* g, int* gs) {
  if (nb >= items) {
    if (b % items != i) return false;
    *g = b / items;
    *gs = (nb - 1 - i) / items + 1;
    return true;
  }
  *g = 0;
  *gs = 1;
  return b == i % nb;
}

// Waits until a monotone tagged word (credit, landFree) carries call `epoch` or a later one,
// (int32)(tag - epoch) >= 0: safe across the 2^32 wrap (a writer is a few calls ahead at most).
MORI_DEVICE_INLINE bool TagWaitAtLeast(const core::WaitContext& wait, uint64_t* w, uint64_t epoch,
                                       int peer, const char* label) {
  const uint32_t want = static_cast<uint32_t>(epoch);
  return core::detail::SpinUntil(
      wait, w, [&](uint64_t v) { return static_cast<int32_t>(EpTagOf(v) - want) >= 0; },
      core::CmpOp::kGe, EpTagWord(epoch, 0), peer, label);
}

// Waits until a tail word (records or partials of one channel landed, cumulative over the
// channel's chunks) carries call `epoch` with at least `want` landed; more than `most` (the
// channel's share) is a protocol error, a later call's tag "PEs out of step" (both recorded).
// *value: the word's value.
MORI_DEVICE_INLINE bool TailWait(const core::WaitContext& wait, uint64_t* w, uint64_t epoch,
                                 uint32_t want, uint32_t most, uint32_t countMask, int peer,
                                 const char* label, uint32_t* value) {
  const uint32_t tag = static_cast<uint32_t>(epoch);
  uint64_t seen = 0;
  const bool ok = core::detail::SpinUntil(
      wait, w,
      [&](uint64_t v) {
        seen = v;
        const int32_t ahead = static_cast<int32_t>(EpTagOf(v) - tag);
        return ahead > 0 || (ahead == 0 && (EpTagValue(v) & countMask) >= want);
      },
      core::CmpOp::kGe, EpTagWord(epoch, want), peer, label);
  if (!ok) return false;
  if (EpTagOf(seen) != tag) {
    ReportError(wait, peer, "EP V1: tail word of a later call (PEs out of step)",
                static_cast<const uint64_t*>(w), core::CmpOp::kEq, EpTagWord(epoch, want), seen);
    return false;
  }
  if ((EpTagValue(seen) & countMask) > most) {
    ReportError(wait, peer, "EP V1: tail count > the channel's announced share",
                static_cast<const uint64_t*>(w), core::CmpOp::kLe, EpTagWord(epoch, most), seen);
    return false;
  }
  *value = EpTagValue(seen);
  return true;
}

// Posts share [s0, s1) of `recBytes`-byte records (at srcBase / dstBase + s0 * recBytes: this PE's
// staging, the peer's inbox or landing, both symmetric) to PE pe on channel q, in chunks of
// `chunk` records: each chunk one WRITE plus the tail word {epoch, records of the share landed |
// extra} on the same QP, one doorbell (RC: the tail lands after the chunk). An empty share posts
// one tail when `tailIfEmpty` (V1LL). One thread. False on failure (recorded).
MORI_DEVICE_INLINE bool PostShare(const EpKernelCommon& c, int pe, int q, uint8_t* dstBase,
                                  const uint8_t* srcBase, uint32_t recBytes, int s0, int s1,
                                  int chunk, uint64_t* tail, uint64_t epoch, uint32_t extra,
                                  bool tailIfEmpty) {
  if (s0 == s1 && !tailIfEmpty) return true;
  int x = s0;
  do {
    const int y = s1 - x < chunk ? s1 : x + chunk;
    const size_t off = static_cast<size_t>(x) * recBytes;
    if (!shmem::ShmemPutMemSignalNbiThreadQp(
            c.shmem, dstBase + off, srcBase + off, static_cast<size_t>(y - x) * recBytes, tail,
            EpTagWord(epoch, static_cast<uint32_t>(y - s0) | extra), shmem::SignalOp::kSet, pe,
            static_cast<uint32_t>(q)))
      return false;
    x = y;
  } while (x < s1);
  return true;
}

// The membership of one node n in this PE's tokens, in shared memory (EpV1DispatchSmemBytes):
// list g < G holds the tokens for PE n * G + g, list G the tokens for any of them (our list for
// node n, in token order). Word w of a list covers tokens [w, w + 1) * warp size; prefix(l, w) =
// members in the words before w, Size(l) = the list's length.
struct EpV1NodeScan {
  LaneMask* words;  // [G + 1][wordsMax]
  int* prefix;      // [G + 1][wordsMax + 1]
  int* hist;        // [G][Epr]: tokens per expert of the node (distinct experts of a token)
  int nWords, wordsMax, G;

  MORI_DEVICE_INLINE LaneMask Word(int l, int w) const { return words[l * wordsMax + w]; }
  MORI_DEVICE_INLINE const int* Prefix(int l) const { return prefix + l * (wordsMax + 1); }
  MORI_DEVICE_INLINE int Size(int l) const { return Prefix(l)[nWords]; }
  // Position of token t in list l, or -1.
  MORI_DEVICE_INLINE int PosOf(int l, int t) const {
    const int w = t / kWarpSize;
    const int bit = t - w * kWarpSize;
    const LaneMask word = Word(l, w);
    if (((word >> bit) & static_cast<LaneMask>(1)) == 0) return -1;
    return Prefix(l)[w] + core::PopCount(word & LowerLanesMask(bit));
  }
  // Token at position p of list l (p warp-uniform; every lane calls).
  MORI_DEVICE_INLINE int TokenAt(int l, int p) const {
    const int w = EpWordOfPosition(Prefix(l), nWords, p);
    return w * kWarpSize + WarpNthSetBit(Word(l, w), p - Prefix(l)[w]);
  }
};

MORI_DEVICE_INLINE EpV1NodeScan EpV1ScanLayout(uint8_t* smem, int maxTokens, int T, int G) {
  EpV1NodeScan s;
  s.wordsMax = (maxTokens + kWarpSize - 1) / kWarpSize;
  s.nWords = (T + kWarpSize - 1) / kWarpSize;
  s.G = G;
  const size_t wordBytes = (static_cast<size_t>(s.wordsMax) * sizeof(LaneMask) + 15) & ~size_t(15);
  const size_t prefBytes = (static_cast<size_t>(s.wordsMax + 1) * sizeof(int) + 15) & ~size_t(15);
  s.words = reinterpret_cast<LaneMask*>(smem);
  s.prefix = reinterpret_cast<int*>(smem + (G + 1) * wordBytes);
  s.hist = reinterpret_cast<int*>(smem + (G + 1) * (wordBytes + prefBytes));
  return s;
}

// Fills `s` for node n from the T x K ids (every thread of the block calls; ends with a block
// barrier). countHist: also the expert histograms. inputError (a shared word, or nullptr: no
// check): the smallest key token * K + slot of an id outside [-1, numExperts) is kept there (such
// ids count as -1 either way; kEpNoInputError: none).
template <typename IndexT>
MORI_DEVICE_INLINE void EpV1ScanNode(const EpKernelCommon& c, const IndexT* idx, int T, int n,
                                     EpV1NodeScan& s, bool countHist, int* inputError) {
  const int tid = static_cast<int>(threadIdx.x);
  const int nThreads = static_cast<int>(blockDim.x);
  const int lane = core::LaneId();
  const int warp = core::WarpId();
  const int nWarps = core::WarpsPerBlock();
  const int G = s.G;
  const int K = c.topK;
  const int Epr = c.numExpertsPerRank;
  if (countHist) {
    for (int i = tid; i < G * Epr; i += nThreads) s.hist[i] = 0;
  }
  __syncthreads();
  const IndexT lo = static_cast<IndexT>(n) * G * Epr;
  const IndexT hi = lo + static_cast<IndexT>(G) * Epr;
  const IndexT numE = static_cast<IndexT>(c.numExperts);
  for (int w = warp; w < s.nWords; w += nWarps) {
    const int t = w * kWarpSize + lane;
    uint32_t mask = 0;
    if (t < T) {
      const IndexT* row = idx + static_cast<size_t>(t) * K;
      for (int k = 0; k < K; k++) {
        const IndexT e = row[k];
        if (inputError != nullptr && EpBadExpertId(e, numE)) atomicMin(inputError, t * K + k);
        if (e < lo || e >= hi) continue;
        const int rel = static_cast<int>(e - lo);
        mask |= 1u << (rel / Epr);
        if (countHist) {
          bool dup = false;
          for (int j = 0; j < k; j++) dup = dup || row[j] == e;
          if (!dup) atomicAdd(&s.hist[rel], 1);
        }
      }
    }
    for (int l = 0; l < G; l++) {
      const LaneMask m = core::WarpBallot(((mask >> l) & 1u) != 0);
      if (lane == 0) s.words[l * s.wordsMax + w] = m;
    }
    const LaneMask any = core::WarpBallot(mask != 0);
    if (lane == 0) s.words[G * s.wordsMax + w] = any;
  }
  __syncthreads();
  for (int l = warp; l <= G; l += nWarps) {
    int* pre = s.prefix + l * (s.wordsMax + 1);
    int carry = 0;
    for (int base = 0; base < s.nWords; base += kWarpSize) {
      const int w = base + lane;
      const int cnt = w < s.nWords ? core::PopCount(s.words[l * s.wordsMax + w]) : 0;
      const int incl = WarpInclusiveScan(cnt);
      if (w < s.nWords) pre[w] = carry + incl - cnt;
      carry += core::WarpShfl(incl, kWarpSize - 1);
    }
    if (lane == 0) pre[s.nWords] = carry;
  }
  __syncthreads();
}

// Where a dispatch row goes: one row of every IntraNode output array (a local PE's, or one of our
// records' fields).
struct EpV1RowDst {
  uint8_t* row;
  float* weights;
  uint8_t* scales;
  uint8_t* indices;  // IndexT
  int32_t* srcPos;
};

// The outputs of local PE `pe` at row `slot`.
MORI_DEVICE_INLINE EpV1RowDst EpV1OutputRow(const EpKernelCommon& c, int pe, size_t slot,
                                            uint32_t rowBytes, uint32_t scaleBytes, int idxBytes) {
  uint8_t* db = PeerBlock(c, pe);
  const int K = c.topK;
  return EpV1RowDst{db + c.symm.dispatchOutTokens + slot * rowBytes,
                    At<float>(db, c.symm.dispatchOutWeights) + slot * K,
                    db + c.symm.dispatchOutScales + slot * scaleBytes,
                    db + c.symm.dispatchOutIndices + slot * K * idxBytes,
                    At<int32_t>(db, c.symm.dispatchOutSrcPos) + slot};
}

// The fields of a record at `rec`.
MORI_DEVICE_INLINE EpV1RowDst EpV1RecordRow(uint8_t* rec, const EpV1Record& L) {
  return EpV1RowDst{rec, reinterpret_cast<float*>(rec + L.weights), rec + L.scales, rec + L.indices,
                    reinterpret_cast<int32_t*>(rec + L.srcPos)};
}

// A warp copies `n` 4-byte words (lanes strided).
MORI_DEVICE_INLINE void WarpCopyWords(uint32_t* dst, const uint32_t* src, int n) {
  for (int i = core::LaneId(); i < n; i += kWarpSize) dst[i] = src[i];
}
MORI_DEVICE_INLINE void WarpCopyBytes(uint8_t* dst, const uint8_t* src, int n) {
  for (int i = core::LaneId(); i < n; i += kWarpSize) dst[i] = src[i];
}

}  // namespace mori::ops::detail

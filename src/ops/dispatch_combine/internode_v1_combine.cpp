// InterNodeV1 / InterNodeV1LL combine: two-level and deterministic. One kernel; every block takes
// its share of each phase in order (docs/ep_internode_v1.md §5-7):
//   1. Input in place: block 0 signals "ready" to the local PEs. External input: every block waits
//      until the local PEs finished reading our registered buffer (last combine); the resident
//      blocks copy the input into it in chunks they claim, and the block that completes the last
//      chunk signals "ready" (EpCombineCopyInput; docs/ep.md "Residency").
//   2. Every block waits for the ready signal of every local PE (where its rows are).
//   3. Proxy, per rail peer o: for each record o sent us in the last dispatch, the partial
//      P = round(sum over the local PEs j it went to, ascending, of j's row) in fp32 (weights
//      likewise, unrounded fp32), into v1PartialOut; the last block to finish a channel's share
//      posts it (WRITE + landing tail on that QP; V1LL also for an empty share, one WRITE for up
//      to kEpV1LLMaxTokens partials; V1, and V1LL above that, in chunks; V1 after o freed its
//      landing: landFree >= e - 1).
//   4. Owner: waits for every channel's landing tail; for each token, the own node's partial from
//      the local PEs (pulled, rounded), then the sum in fp32 over the nodes holding a destination,
//      ascending, of their partials, rounded: out = round(sum_n P_n).
//   5. The last block completes our WRITEs (quiet: v1PartialOut is rewritten by the next combine),
//      posts landFree {e} to every rail peer (V1), signals "done reading" to the local PEs and
//      bumps the epoch.
// quant_type fp8_direct_cast: the rows are e4m3 codes in combineInFp8 (EpCombineCastKernel ran
// first), read over P2P; steps 3 and 4 sum their decoded values in fp32 and round the partials to
// the combine dtype, which cross the network as without it (docs/ep_internode_v1.md, "FP8
// combine").
#include "combine_reduce.hpp"
#include "internode_v1_device.hpp"
#include "kernel_args.hpp"
#include "mori/core/gpu_check.hpp"

namespace mori::ops {
namespace detail {

using core::CmpOp;

// Lane g < G holds `slot`, the row of an item on local PE g, or -1. The members' rows (in
// tok[g], rows of rowBytes) go to rows[0..n) in ascending g; returns n (every lane). Ends with a
// warp barrier (rows is read by the whole warp next).
MORI_DEVICE_INLINE int WarpMemberRows(int slot, const uint8_t* const* tok, uint32_t rowBytes,
                                      const uint8_t** rows) {
  const LaneMask members = core::WarpBallot(slot >= 0);
  if (slot >= 0)
    rows[core::PopCount(members & LowerLanesMask(core::LaneId()))] =
        tok[core::LaneId()] + static_cast<size_t>(slot) * rowBytes;
  core::WarpSync();
  return core::PopCount(members);
}

// round(sum of the local PEs' rows[0..n), ascending) over vectors [vb, ve) of a row: rows of the
// combine dtype, or (kFp8) e4m3 codes of core::Fp8Format fp8Format.
template <typename Elem, int kThreads, bool kFp8>
MORI_DEVICE_INLINE void ReduceLocalRows(uint4* out, const uint8_t* const* rows, int n, int vb,
                                        int ve, int32_t fp8Format) {
  if constexpr (kFp8) {
    WarpReduceFp8<Elem, kThreads>(out, rows, n, vb, ve, static_cast<core::Fp8Format>(fp8Format));
  } else {
    (void)fp8Format;
    WarpReduceRows<Elem, kThreads>(out, rows, n, vb, ve);
  }
}

// What the phases of a V1 combine call share, derived from its arguments and the frame.
struct EpV1CombineShape {
  int T, M, G, R;      // tokens, max tokens per rank, local PEs, rail peers
  int nb, par;         // blocks; the landing set of this call
  uint8_t* L0;         // our symmetric block
  uint32_t wireRow;    // bytes of a local PE's row as read (e4m3 codes: kFp8)
  uint32_t partBytes;  // bytes of a partial (row, then weights)
  int vecs, P;         // 16-byte vectors of a row; parts per token
  // Items (record or token x part) are dealt to the grid's warps round robin. Set by the body
  // after step 2, where they are first needed (formed at the top, the fp8 512-thread builds
  // spill more).
  int stride, gwarp;
};

template <typename Elem, bool kFp8>
MORI_DEVICE_INLINE EpV1CombineShape EpV1CombineShapeOf(const EpCombineKernelArgs& a,
                                                       const EpKernelFrame& f, const EpV1Topo& tp) {
  const EpKernelCommon& c = a.c;
  const int nb = static_cast<int>(gridDim.x);
  return EpV1CombineShape{a.numTokens,
                          c.maxTokensPerRank,
                          tp.G,
                          tp.R,
                          nb,
                          tp.ll ? f.parity : 0,
                          c.symmLocal,
                          kFp8 ? a.rowBytes / (16 / Elem::kPerVec) : a.rowBytes,
                          EpV1PartialBytes(a.rowBytes, f.K),
                          static_cast<int>(a.rowBytes / 16),
                          a.partsPerToken,
                          0,   // stride: see EpV1CombineShape
                          0};  // gwarp
}

// Step 3. Start: every local PE's rows are ready (sTok, sW filled). End: our partials of every
// rail peer's records are written and posted (by the last block of each channel share).
template <typename Elem, bool kFp8, int kThreads>
MORI_DEVICE_INLINE void EpV1CombineProxy(const EpCombineKernelArgs& a, const EpKernelFrame& f,
                                         const core::WaitContext& wait, const EpV1Topo& tp,
                                         const EpV1CombineShape& v, uint64_t ready,
                                         const uint8_t* const* sTok, const float* const* sW,
                                         const uint8_t* (*sRows)[kEpMaxWorldSize], int& sFailed) {
  const EpKernelCommon& c = a.c;
  const auto& [T, M, G, R, nb, par, L0, wireRow, partBytes, vecs, P, stride, gwarp] = v;

  // ---- 3. proxy: partial sums of our rail peers' tokens --------------------------------------
  for (int m = 0; m < R && sFailed == 0; m++) {
    const int cnt = c.state->v1InRecords[m];
    const int32_t* route = c.v1Route + static_cast<size_t>(m) * M * G;
    uint8_t* out = L0 + c.symm.v1PartialOut + static_cast<size_t>(m) * M * partBytes;
    for (int item = gwarp; item < cnt * P; item += stride) {
      const int i = item / P;
      const int part = item - i * P;
      const int n = WarpMemberRows(f.lane < G ? route[static_cast<size_t>(i) * G + f.lane] : -1,
                                   sTok, wireRow, sRows[f.warp]);
      uint8_t* prow = out + static_cast<size_t>(i) * partBytes;
      ReduceLocalRows<Elem, kThreads, kFp8>(reinterpret_cast<uint4*>(prow), sRows[f.warp], n,
                                            EpShareBegin(vecs, part, P),
                                            EpShareBegin(vecs, part + 1, P), a.fp8Format);
      if (part == 0) {
        bool noW = false;
        for (int k = f.lane; k < f.K; k += kWarpSize) {
          float acc = 0.0f;
          for (int g = 0; g < G; g++) {  // ascending local PE, as the rows
            const int sl = route[static_cast<size_t>(i) * G + g];
            if (sl < 0) continue;
            if (sW[g] == nullptr) {
              noW = true;
            } else {
              acc += sW[g][static_cast<size_t>(sl) * f.K + k];
            }
          }
          reinterpret_cast<float*>(prow + a.rowBytes)[k] = acc;
        }
        if (core::WarpBallot(noW) != 0 && f.lane == 0) {
          int q = 0;
          while (q + 1 < tp.Q && EpShareBegin(cnt, q + 1, tp.Q) <= i) q++;
          atomicOr(&c.state->v1NoWeights[m * kEpV1MaxChannels + q], 1u);
        }
      }
      core::WarpSync();  // the next item rewrites this warp's row list
    }
    __syncthreads();
    if (f.tid == 0) {
      EpTraceStamp(f.tr, kEpCombineV1Summed);
      core::FenceAcqRelSystem();  // our partials (and weight flags) before the counters
      for (int q = 0; q < tp.Q; q++) {
        const int at = m * kEpV1MaxChannels + q;
        const unsigned old = atomicAdd(&c.state->v1Summed[at], 1u);
        if (old != static_cast<unsigned>(nb) - 1) continue;
        c.state->v1Summed[at] = 0;
        core::FenceAcqRelSystem();  // acquire every block's partials (through the counter)
        const bool noW = atomicExch(&c.state->v1NoWeights[at], 0u) != 0;
        const int s0 = EpShareBegin(cnt, q, tp.Q), s1 = EpShareBegin(cnt, q + 1, tp.Q);
        const int o = tp.RailPeer(m);
        bool ok = !core::DeviceAborted(wait);
        // V1: o finished reading its landing region in its last combine.
        if (ok && !tp.ll && s0 < s1)
          ok = TagWaitAtLeast(wait, At<uint64_t>(L0, c.symm.v1LandFree) + m, f.epoch - 1, o,
                              "EP V1 combine: landFree (rail peer read its last landing)");
        const size_t at2 = static_cast<size_t>(par) * R + tp.SlotOnPeer(m);
        // V1LL: up to kEpV1LLMaxTokens partials as one WRITE per channel, V1's chunks above (the
        // owner waits for the share's whole count either way).
        const int chunk = tp.ll && cnt <= kEpV1LLMaxTokens ? (s1 > s0 ? s1 - s0 : 1)
                                                           : EpV1ChunkRecords(partBytes);
        if (ok)
          ok = PostShare(c, o, q, L0 + c.symm.v1Landing + at2 * M * partBytes, out, partBytes, s0,
                         s1, chunk, At<uint64_t>(L0, c.symm.v1LandTail) + at2 * tp.Q + q, f.epoch,
                         EpV1LandValue(0, noW, EpReadyFormat(ready)), tp.ll);
        if (!ok) sFailed = 1;
      }
    }
    __syncthreads();
  }
}

// Step 4. Start: this block is past step 3 (the local PEs' rows are ready, sTok and sW filled).
// End: each of this block's output rows (and weights) is the rounded sum over the nodes holding a
// destination, ascending, of their partials (ours: from the local rows).
template <typename Elem, bool kFp8, int kThreads>
MORI_DEVICE_INLINE void EpV1CombineOwner(const EpCombineKernelArgs& a, const EpKernelFrame& f,
                                         const core::WaitContext& wait, const EpV1Topo& tp,
                                         const EpV1CombineShape& v, uint64_t ready,
                                         const uint8_t* const* sTok, const float* const* sW,
                                         const uint8_t* (*sRows)[kEpMaxWorldSize], int& sFailed) {
  const EpKernelCommon& c = a.c;
  const auto& [T, M, G, R, nb, par, L0, wireRow, partBytes, vecs, P, stride, gwarp] = v;

  // ---- 4. owner: own node's partials, then the other nodes' -----------------------------------
  // Pass 1 needs no other node: P_own = round(sum of the local rows, ascending) into the output
  // row, while the partials travel. The same warp takes the same items in pass 2 (same lanes, same
  // vectors), which adds the nodes' partials in ascending node order.
  if (sFailed == 0) {
    for (int item = gwarp; item < T * P; item += stride) {
      const int t = item / P;
      const int part = item - t * P;
      const int nLocal = WarpMemberRows(
          f.lane < G ? c.tokenSlot[static_cast<size_t>(t) * f.W + tp.LocalPe(f.lane)] : -1, sTok,
          wireRow, sRows[f.warp]);
      if (nLocal > 0)
        ReduceLocalRows<Elem, kThreads, kFp8>(
            reinterpret_cast<uint4*>(a.outTokens + static_cast<size_t>(t) * a.rowBytes),
            sRows[f.warp], nLocal, EpShareBegin(vecs, part, P), EpShareBegin(vecs, part + 1, P),
            a.fp8Format);
      core::WarpSync();  // the next item rewrites this warp's row list
    }
  }
  if (f.tr != nullptr) __syncthreads();  // tracing: the stamp covers every warp's own-node sums
  if (f.tid == 0) EpTraceStamp(f.tr, kEpCombineV1OwnSummed);
  // The partials' tails (every channel of every rail peer: V1LL; the channels with partials: V1).
  for (int i = f.tid; i < R * tp.Q && sFailed == 0; i += f.nThreads) {
    const int m = i / tp.Q, q = i - m * tp.Q;
    const int cnt = c.state->v1OutRecords[m];
    const int s0 = EpShareBegin(cnt, q, tp.Q), s1 = EpShareBegin(cnt, q + 1, tp.Q);
    if (s0 == s1 && !tp.ll) continue;
    uint64_t* w =
        At<uint64_t>(L0, c.symm.v1LandTail) + (static_cast<size_t>(par) * R + m) * tp.Q + q;
    uint32_t v = 0;
    if (!TailWait(wait, w, f.epoch, static_cast<uint32_t>(s1 - s0), static_cast<uint32_t>(s1 - s0),
                  0x1FFFFu, tp.RailPeer(m),
                  "EP V1 combine: partials of a channel (landing tail) from rail peer", &v)) {
      sFailed = 1;
      continue;
    }
    const uint32_t mine = EpV1LandValue(0, false, EpReadyFormat(ready));
    if ((v & ~0x3FFFFu) != mine) {
      ReportError(wait, tp.RailPeer(m),
                  "EP combine: PEs called combine with different dtype/hidden",
                  static_cast<const uint64_t*>(w), CmpOp::kEq, static_cast<uint64_t>(mine),
                  static_cast<uint64_t>(v & ~0x3FFFFu));
      sFailed = 1;
    } else if ((v & (1u << 17)) != 0 && a.outWeights != nullptr) {
      ReportError(wait, tp.RailPeer(m),
                  "EP combine: a PE passed no weights, this PE asked for weights",
                  static_cast<const uint64_t*>(w), CmpOp::kNe,
                  static_cast<uint64_t>(EpCombineSource::kNone),
                  static_cast<uint64_t>(EpCombineSource::kNone));
    }
  }
  __syncthreads();
  if (f.tid == 0) EpTraceStamp(f.tr, kEpCombineV1Landed);
  if (sFailed == 0) {
    const uint8_t* landing = L0 + c.symm.v1Landing + static_cast<size_t>(par) * R * M * partBytes;
    for (int item = gwarp; item < T * P; item += stride) {
      const int t = item / P;
      const int part = item - t * P;
      const int vb = EpShareBegin(vecs, part, P), ve = EpShareBegin(vecs, part + 1, P);
      uint4* const outRow =
          reinterpret_cast<uint4*>(a.outTokens + static_cast<size_t>(t) * a.rowBytes);
      const int nLocal = core::PopCount(core::WarpBallot(
          f.lane < G && c.tokenSlot[static_cast<size_t>(t) * f.W + tp.LocalPe(f.lane)] >= 0));
      // Every node holding a destination, ascending: its partial (ours: the row of pass 1).
      const int pos = f.lane < R ? c.v1ListPos[static_cast<size_t>(t) * R + f.lane] : -1;
      const LaneMask remote = core::WarpBallot(pos >= 0);
      core::WarpSync();
      int n = 0;
      for (int nd = 0; nd < tp.N; nd++) {
        if (nd == tp.node) {
          if (nLocal > 0) sRows[f.warp][n++] = reinterpret_cast<const uint8_t*>(outRow);
          continue;
        }
        const int m = EpV1NodeSlot(nd, tp.node, tp.N);
        const int p = core::WarpShfl(pos, m);
        if (p >= 0) sRows[f.warp][n++] = landing + (static_cast<size_t>(m) * M + p) * partBytes;
      }
      core::WarpSync();
      if (remote != 0 || nLocal == 0)
        WarpReduceRows<Elem, kThreads>(outRow, sRows[f.warp], n, vb, ve);
      if (part == 0 && a.outWeights != nullptr) {
        for (int k = f.lane; k < f.K; k += kWarpSize) {
          float acc = 0.0f;
          for (int nd = 0; nd < tp.N; nd++) {
            if (nd == tp.node) {
              if (nLocal == 0) continue;
              float own = 0.0f;
              for (int g = 0; g < G; g++) {
                const int sl = c.tokenSlot[static_cast<size_t>(t) * f.W + tp.LocalPe(g)];
                if (sl < 0) continue;
                if (sW[g] == nullptr) {
                  ReportError(wait, tp.LocalPe(g),
                              "EP combine: a PE passed no weights, this PE asked for weights",
                              CmpOp::kNe, static_cast<uint64_t>(EpCombineSource::kNone),
                              static_cast<uint64_t>(EpCombineSource::kNone));
                } else {
                  own += sW[g][static_cast<size_t>(sl) * f.K + k];
                }
              }
              acc += own;
              continue;
            }
            const int m = EpV1NodeSlot(nd, tp.node, tp.N);
            const int p = c.v1ListPos[static_cast<size_t>(t) * R + m];
            if (p >= 0)
              acc += reinterpret_cast<const float*>(
                  landing + (static_cast<size_t>(m) * M + p) * partBytes + a.rowBytes)[k];
          }
          a.outWeights[static_cast<size_t>(t) * f.K + k] = acc;
        }
      }
      core::WarpSync();
    }
  }
}

// Step 5, the grid's last block (thread 0): completes our WRITEs, frees our rail peers' landings
// (V1), signals "done reading" to the local PEs and bumps the epoch.
MORI_DEVICE_INLINE void EpV1CombineFinish(const EpKernelCommon& c, const EpKernelFrame& f,
                                          const core::WaitContext& wait, const EpV1Topo& tp) {
  const int G = tp.G;
  const int R = tp.R;
  uint8_t* const L0 = c.symmLocal;

  const bool aborted = core::DeviceAborted(wait);
  core::FenceAcqRelSystem();  // every block's reads (through the counter) before the signals
  if (!aborted) {
    if (!tp.ll) {
      const uint64_t freed = EpTagWord(f.epoch, 0);
      for (int m = 0; m < R; m++)
        shmem::ShmemPutMemNbiThreadQp(c.shmem,
                                      At<uint64_t>(L0, c.symm.v1LandFree) + tp.SlotOnPeer(m),
                                      &freed, sizeof(freed), tp.RailPeer(m), 0);
    }
    // Our partial WRITEs read v1PartialOut until they complete.
    shmem::ShmemQuietThread(c.shmem);
    for (int g = 0; g < G; g++)
      core::AtomicStoreRelaxedSystem(
          &(At<EpSignal>(PeerBlock(c, tp.LocalPe(g)), c.symm.doneInbox) + f.me)->tag, f.epoch);
  }
  c.state->combineEpoch = f.epoch;
  EpTraceStamp(f.tr, kEpCombineTail);
}

// kFp8: a.wireFp8 (a build of its own: the plain build's registers stay those of one reduction).
// kThreads: the most threads per block the build serves. The plain kernel has a build for <= 256
// (launches of <= 8 warps, the default), whose 255 registers per thread hold its reductions with
// next to no spills (the 512-thread build's 128 spill about 2 KB per thread).
template <typename Elem, bool kFp8, int kThreads>
MORI_DEVICE_INLINE void EpV1CombineBody(const EpCombineKernelArgs& a) {
  __shared__ const uint8_t* sTok[kEpMaxWorldSize];  // local PE g's combine rows
  __shared__ const float* sW[kEpMaxWorldSize];      // its weights (nullptr: none)
  __shared__ const uint8_t* sRows[kCombineMaxWarps][kEpMaxWorldSize];
  __shared__ int sFailed;
  __shared__ unsigned sClaim;  // external input: the block's copy chunk (EpCombineCopyInput)

  const EpKernelCommon& c = a.c;
  const EpKernelFrame f = EpEnterKernel(c, EpTraceKind::kCombine, a.partsPerToken);
  const core::WaitContext wait = c.shmem.wait;  // private copy (see EpKernelFrame)
  const EpV1Topo tp(c);
  EpV1CombineShape v = EpV1CombineShapeOf<Elem, kFp8>(a, f, tp);
  const int G = tp.G;
  const int b = static_cast<int>(blockIdx.x);
  const uint64_t ready =
      EpPackReady(a.tokenSource, a.weightSource, a.dataType, a.rowBytes,
                  kFp8 ? static_cast<EpCombineWire>(a.fp8Format + 1) : EpCombineWire::kInput);
  if (f.tid == 0) sFailed = 0;
  __syncthreads();

  // ---- 1. input; ready to the local PEs ------------------------------------------------------
  auto signalReady = [&]() {
    SignalStoreAll(
        G, [&](int g) { return EpReadySlotOn(c, tp.LocalPe(g), f.parity); }, ready, f.epoch);
  };
  if (a.copyTokens != 0 || a.copyWeights != 0) {
    EpCombineCopyInput(a, wait, f.epoch, tp.LocalPe(0), tp.LocalPe(G), false, sFailed, sClaim,
                       signalReady);
  } else if (b == 0 && f.tid == 0) {
    signalReady();
  }
  if (f.tid == 0) EpTraceStamp(f.tr, kEpCombineSent);

  // ---- 2. the local PEs' rows are ready -------------------------------------------------------
  if (sFailed == 0) {
    for (int g = f.tid; g < G; g += f.nThreads) {
      const int p = tp.LocalPe(g);
      uint64_t v = 0;
      if (!EpReadyWait(c, wait, f.parity, f.epoch, p, ready, &v)) {
        sFailed = 1;
        continue;
      }
      EpReadySources(c, p, v, &sTok[g], &sW[g]);
    }
  }
  __syncthreads();
  if (f.tid == 0) EpTraceStamp(f.tr, kEpCombinePeersReady);
  v.stride = v.nb * f.nWarps;  // only now (see EpV1CombineShape)
  v.gwarp = b * f.nWarps + f.warp;

  EpV1CombineProxy<Elem, kFp8, kThreads>(a, f, wait, tp, v, ready, sTok, sW, sRows, sFailed);
  if (f.tid == 0) EpTraceStamp(f.tr, kEpCombineProxied);

  EpV1CombineOwner<Elem, kFp8, kThreads>(a, f, wait, tp, v, ready, sTok, sW, sRows, sFailed);

  // ---- 5. quiet, landFree, done, epoch ---------------------------------------------------------
  __syncthreads();
  if (f.tid == 0) {
    if (EpCombineCountBlockDone(c, f.tr)) EpV1CombineFinish(c, f, wait, tp);
  }
}

}  // namespace detail

// The entry point of the family, both modes (kernel_args.hpp, "Kernel names").
namespace combine {
template <typename Elem, bool kFp8, int kThreads>
__global__ void __launch_bounds__(kThreads)
    EpCombineInterNodeV1Kernel(const EpCombineKernelArgs a) {
  detail::EpV1CombineBody<Elem, kFp8, kThreads>(a);
}
}  // namespace combine

// Three instantiations per element type combine sums (V1 and V1LL are one kernel): plain for
// blocks of <= 256 threads and of <= kEpMaxThreadsPerBlock, and quant_type fp8_direct_cast (any
// block size; the cast kernel first, and this node's PEs read the codes).
void LaunchEpV1Combine(const EpCombineKernelArgs& in, EpDataType dataType, int blocks, int threads,
                       gpuStream_t stream) {
  const int p0 = in.c.rank / in.c.localSize * in.c.localSize;
  const EpCombineKernelArgs args =
      LaunchEpCombineCast(in, dataType, p0, p0 + in.c.localSize, blocks, threads, stream);
  detail::WithCombineElem(dataType, [&](auto elem) {
    using Elem = decltype(elem);
    auto kernel =
        args.wireFp8 != 0 ? combine::EpCombineInterNodeV1Kernel<Elem, true, kEpMaxThreadsPerBlock>
        : threads <= 256  ? combine::EpCombineInterNodeV1Kernel<Elem, false, 256>
                          : combine::EpCombineInterNodeV1Kernel<Elem, false, kEpMaxThreadsPerBlock>;
    MORI_CHECK_GPU(
        core::GpuLaunchKernel(kernel, blocks, threads, 0, stream, args.c.programmatic != 0, args));
  });
}

}  // namespace mori::ops

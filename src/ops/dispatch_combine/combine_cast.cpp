// The kernels that prepare a pull combine's input before the combine kernel, and their launchers
// (kernel_args.hpp): the cast to e4m3 codes for quant_type fp8_direct_cast (pull IntraNode and
// InterNode combines, InterNodeV1; instantiated once per token type, LaunchEpCombineCast), and the
// copy of an external input on every SM (IntraNode, MORI_EP_COMBINE_PRECOPY;
// LaunchEpCombinePrecopy).
#include "combine_body.hpp"

namespace mori::ops {
namespace detail {

// quant_type fp8_direct_cast, pull, InterNode and V1 combines: casts this PE's received rows
// (a.inTokens, a.inRows readable) into combineInFp8, whose codes peers read in the combine kernel
// launched right after this one on the same stream (the kernel boundary orders the codes before its
// ready signal, as for a zero-copy input). First waits until the PEs that read combineInFp8, p0 to
// p1 - 1, finished reading it in the last combine (done tag >= that combine's epoch). A separate
// kernel: the combine kernel's registers are all taken by its reduction.
template <typename Elem>
__global__ void __launch_bounds__(kEpMaxThreadsPerBlock)
    EpCombineCastKernel(const EpCombineKernelArgs a, int p0, int p1) {
  __shared__ int sFailed;
  const EpKernelCommon& c = a.c;
  const core::WaitContext wait = c.shmem.wait;
  const int tid = static_cast<int>(threadIdx.x);
  const uint64_t last = *reinterpret_cast<volatile uint64_t*>(&c.state->combineEpoch);
  const int R = *reinterpret_cast<volatile int32_t*>(c.totalRecv);
  if (tid == 0) sFailed = 0;
  __syncthreads();
  EpSignal* done = At<EpSignal>(c.symmLocal, c.symm.doneInbox);
  for (int p = p0 + tid; p < p1; p += static_cast<int>(blockDim.x)) {
    if (!core::WaitUntil(wait, &done[p].tag, CmpOp::kGe, last, p,
                         "EP combine: peer done reading (last combine)"))
      sFailed = 1;
  }
  if (tid == 0 && R > a.inRows) {
    if (blockIdx.x == 0)
      ReportError(wait, -1, "EP combine: input has fewer rows than dispatch received", CmpOp::kGe,
                  static_cast<uint64_t>(R), static_cast<uint64_t>(a.inRows));
    sFailed = 1;
  }
  __syncthreads();
  if (sFailed == 0 && R > 0)
    GridCastFp8<Elem>(c.symmLocal + c.symm.combineInFp8, a.inTokens,
                      static_cast<size_t>(R) * (a.rowBytes / 16),
                      static_cast<core::Fp8Format>(a.fp8Format));
}

// quant_type fp8_direct_cast (in.wireFp8): launches EpCombineCastKernel (readers p0 to p1 - 1)
// and returns the combine kernel's arguments, which read the codes in place (never staged);
// otherwise returns `in`.
template <typename Elem>
EpCombineKernelArgs CastCombineInput(const EpCombineKernelArgs& in, int p0, int p1, int blocks,
                                     int threads, gpuStream_t stream) {
  EpCombineKernelArgs args = in;
  if (args.wireFp8 == 0) return args;
  EpCombineKernelArgs cast = args;
  if (args.copyTokens == 0) {
    cast.inTokens = args.c.symmLocal + (args.tokenSource == EpCombineSource::kDispatchOut
                                            ? args.c.symm.dispatchOutTokens
                                            : args.c.symm.combineInTokens);
    cast.inRows = args.c.maxRecvRows;
  }
  MORI_CHECK_GPU(core::GpuLaunchKernel(EpCombineCastKernel<Elem>, blocks, threads, 0, stream, false,
                                       cast, p0, p1));
  args.copyTokens = 0;
  args.tokenSource = EpCombineSource::kFp8Wire;
  args.staged = 0;
  return args;
}

// MORI_EP_COMBINE_PRECOPY, IntraNode pull combine of an external input: copies the rows other PEs
// read (our own rows stay in the caller's tensor) into the registered buffer, on the SMs the
// combine kernel launched right after it on this stream leaves free, while that kernel runs.
//   - Every block first waits until every PE finished reading our registered buffers in the last
//     combine and checks the input's rows. Block 0 then signals "ready" (where our rows are, their
//     format) to every PE at once, before any row is copied; on a failure it signals only us, with
//     state->combinePrecopyFailed set (the combine kernel reads it after our ready: it skips its
//     reads; the other PEs get no ready, as from a combine kernel that failed its copy).
//   - Then calls GridDependentsLaunch: the combine kernel (copy flags kEpCopiedBefore) starts on
//     the free SMs without waiting for this kernel, and reads a peer's copied row only once the
//     chunk's tag for this combine is in our combineRowsReady.
//   - Blocks claim runs of chunks of kEpCombineCopyRows rows (aligned in the receive buffer) of
//     the PEs' segments in turn (run k of every segment before run k + 1 of any), so every
//     reader's rows arrive in its tokens' order, as its reducing warps take them; after a run one
//     fence and a tag per chunk on the PE whose tokens the rows are. A run is one chunk when the
//     combine runs beside this kernel (`overlapped`: the first rows are ready soonest), else
//     about half a block's share (fewer claims and fences: nothing reads a tag before the end).
// This kernel waits for nothing the combine kernel does, so the combine's waits for tags always
// end, wherever and whenever its blocks are placed. Without a programmatic launch the combine
// kernel simply starts after it.
__global__ void __launch_bounds__(kEpMaxThreadsPerBlock)
    EpCombinePrecopyKernel(const EpCombineKernelArgs a, bool overlapped) {
  __shared__ int sFailed;
  __shared__ unsigned sClaim;
  EpKernelEnter();  // the input is written by the kernels before this one
  const EpKernelCommon& c = a.c;
  const core::WaitContext wait = c.shmem.wait;
  const uint64_t epoch = *reinterpret_cast<volatile uint64_t*>(&c.state->combineEpoch) + 1;
  const int parity = static_cast<int>(epoch & 1);
  const int W = c.worldSize, me = c.rank;
  const int tid = static_cast<int>(threadIdx.x), nThreads = static_cast<int>(blockDim.x);
  const uint64_t ready = EpPackReady(a.tokenSource, a.weightSource, a.dataType, a.rowBytes,
                                     EpCombineWire::kInput, true);
  if (tid == 0) sFailed = 0;
  __syncthreads();
  EpCombineCopyChecks(a, wait, epoch, 0, W, blockIdx.x == 0, sFailed);  // block 0 reports
  __syncthreads();
  const bool failed = sFailed != 0;
  if (blockIdx.x == 0 && tid == 0) {
    if (failed) {
      c.state->combinePrecopyFailed = 1;
      SignalStore(EpReadySlotOn(c, me, parity), ready, epoch);  // release: the flag first
    } else {
      SignalStoreAll(
          W, [&](int p) { return EpReadySlotOn(c, p, parity); }, ready, epoch);
    }
  }
  core::GridDependentsLaunch();
  if (failed) return;

  const size_t R = kEpCombineCopyRows;
  const size_t chunksPerSrc = EpCombineCopyChunks(static_cast<size_t>(c.maxRecvRows));
  const int K = c.topK;
  // Segment of PE q: the rows we received from it, [base, base + n) (receive order).
  auto segment = [&](int q, size_t* base, size_t* n) {
    size_t b = 0;
    for (int s = 0; s < q; s++) b += static_cast<size_t>(c.state->recvCount[s]);
    *base = b;
    *n = static_cast<size_t>(c.state->recvCount[q]);
  };
  auto chunksOf = [&](size_t base, size_t n) {
    return n == 0 ? 0 : (base + n - 1) / R - base / R + 1;
  };
  const int others = W - 1;
  size_t rounds = 0, total = 0;  // chunks of the longest segment, of all
  for (int q = 0; q < W; q++) {
    if (q == me) continue;
    size_t base = 0, n = 0;
    segment(q, &base, &n);
    const size_t k = chunksOf(base, n);
    if (k > rounds) rounds = k;
    total += k;
  }
  const size_t run =
      overlapped ? 1 : (total + 2 * static_cast<size_t>(gridDim.x) - 1) / (2 * gridDim.x);
  for (;;) {
    __syncthreads();  // everyone read the last claim
    if (tid == 0) sClaim = atomicAdd(&c.state->combineCopyNextChunk, 1u);
    __syncthreads();
    const size_t g = sClaim;
    const size_t k0 = g / static_cast<size_t>(others) * run;
    if (k0 >= rounds) break;
    const int q = (me + 1 + static_cast<int>(g % static_cast<size_t>(others))) % W;
    size_t base = 0, n = 0;
    segment(q, &base, &n);
    const size_t cnt = chunksOf(base, n);
    if (k0 >= cnt) continue;
    const size_t k1 = k0 + run < cnt ? k0 + run : cnt;  // chunks [k0, k1) of the segment
    const size_t lo = (base / R + k0) * R > base ? (base / R + k0) * R : base;
    const size_t hi = (base / R + k1) * R < base + n ? (base / R + k1) * R : base + n;
    if (a.copyTokens != 0) {
      shmem::detail::CopyElements<uint4, shmem::detail::kCopyUnroll>(
          reinterpret_cast<uint4*>(c.symmLocal + c.symm.combineInTokens + lo * a.rowBytes),
          reinterpret_cast<const uint4*>(a.inTokens + lo * a.rowBytes), (hi - lo) * a.rowBytes / 16,
          tid, nThreads);
    }
    if (a.copyWeights != 0) {
      uint32_t* dst = At<uint32_t>(c.symmLocal, c.symm.combineInWeights) + lo * K;
      const uint32_t* src = reinterpret_cast<const uint32_t*>(a.inWeights) + lo * K;
      for (size_t i = tid; i < (hi - lo) * K; i += nThreads) dst[i] = src[i];
    }
    __syncthreads();
    if (tid == 0) {
      // Cumulative over the barrier: releases the block's copies of the run to q's readers.
      core::FenceAcqRelSystem();
      uint64_t* tags = At<uint64_t>(PeerBlock(c, q), c.symm.combineRowsReady) + me * chunksPerSrc;
      for (size_t k = k0; k < k1; k++) core::AtomicStoreRelaxedSystem(tags + base / R + k, epoch);
    }
  }
}

}  // namespace detail

EpCombineKernelArgs LaunchEpCombinePrecopy(const EpCombineKernelArgs& args, int blocks,
                                           bool overlapped, gpuStream_t stream) {
  MORI_CHECK_GPU(core::GpuLaunchKernel(detail::EpCombinePrecopyKernel, blocks,
                                       kEpMaxThreadsPerBlock, 0, stream, false, args, overlapped));
  EpCombineKernelArgs out = args;
  if (out.copyTokens != 0) out.copyTokens = kEpCopiedBefore;
  if (out.copyWeights != 0) out.copyWeights = kEpCopiedBefore;
  return out;
}

EpCombineKernelArgs LaunchEpCombineCast(const EpCombineKernelArgs& args, EpDataType dataType,
                                        int p0, int p1, int blocks, int threads,
                                        gpuStream_t stream) {
  EpCombineKernelArgs out = args;
  detail::WithCombineElem(dataType, [&](auto elem) {
    out = detail::CastCombineInput<decltype(elem)>(args, p0, p1, blocks, threads, stream);
  });
  return out;
}

}  // namespace mori::ops

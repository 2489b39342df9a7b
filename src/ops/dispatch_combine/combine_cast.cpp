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

// MORI_EP_COMBINE_PRECOPY, IntraNode pull combine of an external input: the combine's step 1 for
// such an input (EpCombineCopyInput: wait until every PE finished reading our registered buffers
// in the last combine, check the input's rows, copy every row but our own, signal ready), run by
// a grid of every SM instead of the combine's blocks, so the copy runs at the GPU's memory
// bandwidth rather than at that of the combine's SMs. The combine kernel launched right after it
// on the same stream (copy flags kEpCopiedBefore) only waits for the PEs' ready signals; a failure
// here is left in state->combinePrecopyFailed for it (no ready signal was sent: it skips its waits,
// as the in-kernel copy's blocks do).
__global__ void __launch_bounds__(kEpMaxThreadsPerBlock)
    EpCombinePrecopyKernel(const EpCombineKernelArgs a) {
  __shared__ int sFailed;
  __shared__ unsigned sClaim;
  const EpKernelCommon& c = a.c;
  const core::WaitContext wait = c.shmem.wait;
  const uint64_t epoch = *reinterpret_cast<volatile uint64_t*>(&c.state->combineEpoch) + 1;
  const int parity = static_cast<int>(epoch & 1);
  const int W = c.worldSize;
  const uint64_t ready =
      EpPackReady(a.tokenSource, a.weightSource, a.dataType, a.rowBytes, EpCombineWire::kInput);
  if (threadIdx.x == 0) sFailed = 0;
  __syncthreads();
  EpCombineCopyInput(a, wait, epoch, 0, W, true, sFailed, sClaim, [&] {
    // SignalStoreAll's fence also releases the copies acquired above.
    SignalStoreAll(
        W, [&](int p) { return EpReadySlotOn(c, p, parity); }, ready, epoch);
  });
  if (threadIdx.x == 0 && sFailed != 0) c.state->combinePrecopyFailed = 1;
}

}  // namespace detail

EpCombineKernelArgs LaunchEpCombinePrecopy(const EpCombineKernelArgs& args, int blocks,
                                           gpuStream_t stream) {
  MORI_CHECK_GPU(core::GpuLaunchKernel(detail::EpCombinePrecopyKernel, blocks,
                                       kEpMaxThreadsPerBlock, 0, stream, false, args));
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

// The cast of a combine's input to e4m3 codes for quant_type fp8_direct_cast (pull IntraNode and
// InterNode combines, InterNodeV1): its kernel, instantiated once per token type, and its launcher
// (kernel_args.hpp, LaunchEpCombineCast).
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

}  // namespace detail

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

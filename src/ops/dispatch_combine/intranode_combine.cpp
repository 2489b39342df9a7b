// The IntraNode family's pull combine kernel: its entry point (kernel_args.hpp, "Kernel names")
// around the shared body (combine_body.hpp), its instantiations (register path and staged) and
// its launcher.
#include "combine_body.hpp"

namespace mori::ops {

namespace combine {
template <typename Elem, int kThreads, bool kStaged>
__global__ void __launch_bounds__(kThreads) EpCombineIntraNodeKernel(const EpCombineKernelArgs a) {
  detail::EpCombineBody<Elem, kThreads, kStaged, EpFamily::kIntraNode>(a);
}
}  // namespace combine

namespace detail {

// The instantiations: per token type combine can sum, for blocks of up to 256 threads and of up
// to kEpMaxThreadsPerBlock, and staged. An fp8_direct_cast input is cast first (combine_cast.cpp).
template <typename Elem>
void LaunchIntraNodeCombine(const EpCombineKernelArgs& in, EpDataType dataType, int blocks,
                            int threads, gpuStream_t stream) {
  constexpr int kMaxT = kEpMaxThreadsPerBlock;
  const EpCombineKernelArgs args =
      LaunchEpCombineCast(in, dataType, 0, in.c.worldSize, blocks, threads, stream);
  auto kernel = args.staged != 0 ? combine::EpCombineIntraNodeKernel<Elem, kMaxT, true>
                : threads <= 256 ? combine::EpCombineIntraNodeKernel<Elem, 256, false>
                                 : combine::EpCombineIntraNodeKernel<Elem, kMaxT, false>;
  const size_t smem = args.staged != 0 ? EpCombineStagedSmemBytes(threads / kWarpSize) : 0;
  MORI_CHECK_GPU(
      core::GpuLaunchKernel(kernel, blocks, threads, smem, stream, args.c.programmatic != 0, args));
}

// Above 48 KB a kernel's dynamic shared memory must be opted in to (per device).
template <typename Elem>
void OptInStagedSmem() {
  MORI_CHECK_GPU(gpuFuncSetAttribute(
      reinterpret_cast<const void*>(
          combine::EpCombineIntraNodeKernel<Elem, kEpMaxThreadsPerBlock, true>),
      gpuFuncAttributeMaxDynamicSharedMemorySize,
      static_cast<int>(EpCombineStagedSmemBytes(kEpMaxThreadsPerBlock / kWarpSize))));
}

}  // namespace detail

void PrepareEpCombineStaged() {
  detail::OptInStagedSmem<detail::EpBf16Elem>();
  detail::OptInStagedSmem<detail::EpFp16Elem>();
  detail::OptInStagedSmem<detail::EpFp32Elem>();
}

void LaunchEpIntraNodeCombine(const EpCombineKernelArgs& args, EpDataType dataType, int blocks,
                              int threads, gpuStream_t stream) {
  detail::WithCombineElem(dataType, [&](auto elem) {
    detail::LaunchIntraNodeCombine<decltype(elem)>(args, dataType, blocks, threads, stream);
  });
}

}  // namespace mori::ops

// The InterNode family's pull combine kernel: its entry point (kernel_args.hpp, "Kernel names")
// around the shared body (combine_body.hpp), its instantiations and its launcher.
#include "combine_body.hpp"

namespace mori::ops {

namespace combine {
template <typename Elem, int kThreads>
__global__ void __launch_bounds__(kThreads) EpCombineInterNodeKernel(const EpCombineKernelArgs a) {
  detail::EpCombineBody<Elem, kThreads, false, EpFamily::kInterNode>(a);
}
}  // namespace combine

// The instantiations: one per token type combine can sum, blocks of up to kEpMaxThreadsPerBlock
// (register path). An fp8_direct_cast input is cast first (combine_cast.cpp).
void LaunchEpInterNodeCombine(const EpCombineKernelArgs& in, EpDataType dataType, int blocks,
                              int threads, gpuStream_t stream) {
  const EpCombineKernelArgs args =
      LaunchEpCombineCast(in, dataType, 0, in.c.worldSize, blocks, threads, stream);
  detail::WithCombineElem(dataType, [&](auto elem) {
    using Elem = decltype(elem);
    MORI_CHECK_GPU(
        core::GpuLaunchKernel(combine::EpCombineInterNodeKernel<Elem, kEpMaxThreadsPerBlock>,
                              blocks, threads, 0, stream, args.c.programmatic != 0, args));
  });
}

}  // namespace mori::ops

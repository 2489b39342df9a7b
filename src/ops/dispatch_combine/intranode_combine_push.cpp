// The IntraNode family's push combine kernel (small batches): its entry point (kernel_args.hpp,
// "Kernel names") around the shared body (combine_push_body.hpp), its instantiations and its
// launcher.
#include "combine_push_body.hpp"

namespace mori::ops {

namespace combine::push {
template <typename Elem, int kThreads>
__global__ void __launch_bounds__(kThreads) EpCombineIntraNodeKernel(const EpCombineKernelArgs a) {
  detail::EpCombinePushBody<Elem, kThreads, false>(a);
}
}  // namespace combine::push

// The instantiations: per token type combine can sum, for blocks of up to 256 threads and of up
// to kEpMaxThreadsPerBlock.
void LaunchEpIntraNodePushCombine(const EpCombineKernelArgs& args, EpDataType dataType, int blocks,
                                  int threads, gpuStream_t stream) {
  detail::WithCombineElem(dataType, [&](auto elem) {
    using Elem = decltype(elem);
    auto kernel = threads <= 256
                      ? combine::push::EpCombineIntraNodeKernel<Elem, 256>
                      : combine::push::EpCombineIntraNodeKernel<Elem, kEpMaxThreadsPerBlock>;
    MORI_CHECK_GPU(
        core::GpuLaunchKernel(kernel, blocks, threads, 0, stream, args.c.programmatic != 0, args));
  });
}

}  // namespace mori::ops

// The InterNode family's push combine kernel (small batches; AsyncLL across nodes): its entry
// point (kernel_args.hpp, "Kernel names") around the shared body (combine_push_body.hpp: the rows
// for other nodes go by RDMA), its instantiations and its launcher.
#include "combine_push_body.hpp"

namespace mori::ops {

namespace combine::push {
template <typename Elem, int kThreads>
__global__ void __launch_bounds__(kThreads) EpCombineInterNodeKernel(const EpCombineKernelArgs a) {
  detail::EpCombinePushBody<Elem, kThreads, true>(a);
}
}  // namespace combine::push

// The instantiations: one per token type combine can sum, blocks of up to kEpMaxThreadsPerBlock
// (as the pull kernel's).
void LaunchEpInterNodePushCombine(const EpCombineKernelArgs& args, EpDataType dataType, int blocks,
                                  int threads, gpuStream_t stream) {
  detail::WithCombineElem(dataType, [&](auto elem) {
    using Elem = decltype(elem);
    MORI_CHECK_GPU(
        core::GpuLaunchKernel(combine::push::EpCombineInterNodeKernel<Elem, kEpMaxThreadsPerBlock>,
                              blocks, threads, 0, stream, args.c.programmatic != 0, args));
  });
}

}  // namespace mori::ops

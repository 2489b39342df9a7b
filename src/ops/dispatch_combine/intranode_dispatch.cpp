// The IntraNode family's dispatch kernel: its entry point (kernel_args.hpp, "Kernel names") around
// the shared body (dispatch_body.hpp), its instantiations and its launcher.
#include "dispatch_body.hpp"

namespace mori::ops {

namespace dispatch {
template <typename IndexT, int kThreads>
__global__ void __launch_bounds__(kThreads, 1)
    EpDispatchIntraNodeKernel(const EpDispatchKernelArgs a) {
  detail::EpDispatchBody<IndexT, kThreads, EpFamily::kIntraNode>(a);
}
}  // namespace dispatch

// The instantiations: per index type, for blocks of up to 256 threads (255 registers per thread:
// no spills) and of up to kEpMaxThreadsPerBlock.
void LaunchEpIntraNodeDispatch(const EpDispatchKernelArgs& args, EpIndexType indexType, int blocks,
                               int threads, size_t smemBytes, gpuStream_t stream) {
  using dispatch::EpDispatchIntraNodeKernel;
  constexpr int kMaxT = kEpMaxThreadsPerBlock;
  const bool small = threads <= 256;
  auto kernel = indexType == EpIndexType::kInt32
                    ? (small ? EpDispatchIntraNodeKernel<int32_t, 256>
                             : EpDispatchIntraNodeKernel<int32_t, kMaxT>)
                    : (small ? EpDispatchIntraNodeKernel<int64_t, 256>
                             : EpDispatchIntraNodeKernel<int64_t, kMaxT>);
  MORI_CHECK_GPU(core::GpuLaunchKernel(kernel, blocks, threads, smemBytes, stream,
                                       args.c.programmatic != 0, args));
}

bool EpKernelsHaveGridDependency() {
  // Every kernel file is compiled with the same targets: one kernel answers for all.
  return core::GpuKernelHasGridDependency(dispatch::EpDispatchIntraNodeKernel<int32_t, 256>);
}

}  // namespace mori::ops

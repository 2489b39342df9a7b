// The InterNode family's dispatch kernel: its entry point (kernel_args.hpp, "Kernel names") around
// the shared body (dispatch_body.hpp: IntraNode's, plus the staged RDMA WRITEs to other nodes),
// its instantiations and its launcher.
#include "dispatch_body.hpp"

namespace mori::ops {

namespace dispatch {
template <typename IndexT, int kThreads>
__global__ void __launch_bounds__(kThreads, 1)
    EpDispatchInterNodeKernel(const EpDispatchKernelArgs a) {
  detail::EpDispatchBody<IndexT, kThreads, EpFamily::kInterNode>(a);
}
}  // namespace dispatch

// The instantiations: per index type, for blocks of up to 256 threads (255 registers per thread:
// no spills) and of up to kEpMaxThreadsPerBlock (128: this build spills).
void LaunchEpInterNodeDispatch(const EpDispatchKernelArgs& args, EpIndexType indexType, int blocks,
                               int threads, size_t smemBytes, gpuStream_t stream) {
  using dispatch::EpDispatchInterNodeKernel;
  constexpr int kMaxT = kEpMaxThreadsPerBlock;
  const bool small = threads <= 256;
  auto kernel = indexType == EpIndexType::kInt32
                    ? (small ? EpDispatchInterNodeKernel<int32_t, 256>
                             : EpDispatchInterNodeKernel<int32_t, kMaxT>)
                    : (small ? EpDispatchInterNodeKernel<int64_t, 256>
                             : EpDispatchInterNodeKernel<int64_t, kMaxT>);
  MORI_CHECK_GPU(core::GpuLaunchKernel(kernel, blocks, threads, smemBytes, stream,
                                       args.c.programmatic != 0, args));
}

}  // namespace mori::ops

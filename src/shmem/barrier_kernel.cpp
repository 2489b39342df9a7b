// The kernel behind ShmemBarrierOnStream: one block runs the device barrier.
#include "mori/core/gpu_check.hpp"
#include "mori/shmem/device/barrier_launch.hpp"
#include "mori/shmem/shmem_device_api.hpp"

namespace mori::shmem {

namespace {
// One warp: enough threads to spread the arrivals over peers; thread 0 waits.
constexpr int kBarrierThreads = core::kWarpSize;

__global__ void __launch_bounds__(kBarrierThreads) DeviceBarrierKernel(ShmemDeviceContext ctx) {
  (void)ShmemBarrierAllBlock(ctx);  // a timeout is in the error record; nothing else to do here
}

__global__ void RdmaQuietKernel(ShmemDeviceContext ctx) { ShmemQuietThread(ctx); }
}  // namespace

void LaunchDeviceBarrier(const ShmemDeviceContext& ctx, gpuStream_t stream) {
  DeviceBarrierKernel<<<1, kBarrierThreads, 0, stream>>>(ctx);
  MORI_CHECK_LAUNCH();
}

void LaunchRdmaQuiet(const ShmemDeviceContext& ctx, gpuStream_t stream) {
  if (ctx.rdmaPeers == nullptr) return;
  RdmaQuietKernel<<<1, 1, 0, stream>>>(ctx);
  MORI_CHECK_LAUNCH();
}

}  // namespace mori::shmem

// Host launcher of the device barrier kernel behind ShmemBarrierOnStream
// (src/shmem/barrier_kernel.cpp).
#pragma once

#include "mori/core/gpu.hpp"
#include "mori/shmem/shmem_types.hpp"

namespace mori::shmem {

// Enqueues a one-block kernel on `stream` that runs ShmemBarrierAllBlock(ctx) across all PEs.
// Asynchronous; a timeout inside it is recorded in ctx.wait's error record (read it with
// ShmemCheckDeviceError / ShmemStreamSynchronize). Launch errors raise GpuRuntimeError.
void LaunchDeviceBarrier(const ShmemDeviceContext& ctx, gpuStream_t stream);

// Enqueues a one-thread kernel on `stream` that waits until every RDMA work request this PE posted
// so far has completed (ShmemQuietThread). Kernel ends do not complete RDMA requests; the host
// barrier and finalize use this. Nothing to do (no launch) without RDMA peers.
void LaunchRdmaQuiet(const ShmemDeviceContext& ctx, gpuStream_t stream);

}  // namespace mori::shmem

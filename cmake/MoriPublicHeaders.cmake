# Which headers under include/ are installed, and which stay inside the build (paths relative to
# include/). Every header under include/mori is in exactly one of the lists below;
# tests/package checks that, and compiles every installed header on its own against a copy of the
# installed set (so an installed header cannot include one that is not installed).
#
# MORI_PUBLIC_HEADERS: installed. The C++ API engines use: shmem host and device API, the EP
# handle with its config, layout and size hints, errors, the env table, the portability layer, the
# bootstrap interfaces a caller may implement or construct. core/transport/* and core/device/*
# are installed because the shmem types and device API include them; their contents are not API.
set(MORI_PUBLIC_HEADERS
  mori/core/host_device.hpp
  mori/core/gpu.hpp
  mori/core/gpu_runtime.hpp
  mori/core/gpu_device.hpp
  mori/core/gpu_check.hpp
  mori/core/gpu_count.hpp
  mori/core/errors.hpp
  mori/core/env.hpp
  mori/core/float16.hpp
  mori/core/fp8.hpp
  mori/core/device_error.hpp
  mori/core/device/wait.hpp
  mori/core/transport/hd_atomics.hpp
  mori/core/transport/mlx5_wqe.hpp
  mori/core/transport/rdma_queue.hpp
  mori/application/transport_types.hpp
  mori/application/bootstrap/bootstrap.hpp
  mori/application/bootstrap/socket_bootstrap.hpp
  mori/application/bootstrap/callback_bootstrap.hpp
  mori/application/rdma/rdma_stats.hpp
  mori/shmem/shmem_api.hpp
  mori/shmem/shmem_types.hpp
  mori/shmem/shmem_device_api.hpp
  mori/shmem/device/copy.hpp
  mori/shmem/device/rdma.hpp
  mori/shmem/device/resolve.hpp
  mori/shmem/device/scope.hpp
  mori/shmem/device/shmem_device_types.hpp
  mori/ops/dispatch_combine.hpp
  mori/ops/dispatch_combine/config.hpp
  mori/ops/dispatch_combine/handle.hpp
  mori/ops/dispatch_combine/layout.hpp
  mori/ops/dispatch_combine/phase.hpp
  mori/ops/dispatch_combine/trace.hpp)

# The installed headers that only a GPU compiler (nvcc, or clang for HIP) can compile: the shmem
# device API (it uses threadIdx, __noinline__ ...). Every other installed header compiles in a
# plain C++ translation unit too (with the GPU runtime's include directory and the backend
# definition that mori::mori carries), so host code of an engine may include it from a .cpp file
# compiled by the host compiler.
set(MORI_PUBLIC_DEVICE_HEADERS
  mori/shmem/shmem_device_api.hpp
  mori/shmem/device/copy.hpp
  mori/shmem/device/rdma.hpp
  mori/shmem/device/resolve.hpp
  mori/shmem/device/scope.hpp)

# MORI_INTERNAL_HEADERS: not installed. Implementation interfaces shared between mori's own
# sources, tests and tools (context and heap, RDMA set-up and transports, logging, the EP
# agreement rows, the MPI plugin's loader: the MPI bootstrap is reached through ShmemMpiInit,
# which needs no MPI header).
set(MORI_INTERNAL_HEADERS
  mori/core/bounded_worker.hpp
  mori/core/logging.hpp
  mori/core/mps.hpp
  mori/core/profiler_range.hpp
  mori/core/strings.hpp
  mori/application/bootstrap/mpi_bootstrap.hpp
  mori/application/bootstrap/mpi_plugin.hpp
  mori/application/context/context.hpp
  mori/application/memory/heap_allocator.hpp
  mori/application/memory/symmetric_heap.hpp
  mori/application/rdma/device_filter.hpp
  mori/application/rdma/doorbell_proxy.hpp
  mori/application/rdma/emulated_nic.hpp
  mori/application/rdma/gpu_dmabuf.hpp
  mori/application/rdma/gpu_host_access.hpp
  mori/application/rdma/ibverbs_loader.hpp
  mori/application/rdma/mlx5dv_queue.hpp
  mori/application/rdma/nic_affinity.hpp
  mori/application/rdma/queue_emulator.hpp
  mori/application/rdma/rdma_devices.hpp
  mori/application/rdma/rdma_setup.hpp
  mori/application/rdma/rdma_transport.hpp
  mori/application/rdma/verbs_transport.hpp
  mori/ops/dispatch_combine/agreement.hpp
  mori/shmem/device/barrier_launch.hpp)

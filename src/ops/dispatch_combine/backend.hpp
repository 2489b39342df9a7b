// A kernel family behind EpDispatchCombineHandle (internal to src/ops). The handle is the shell:
// collective creation and destruction, the cross-PE agreement, argument checks, accessors and
// launch shapes. A backend holds what one family requires of shmem's topology, what it decides
// when an op is created (which combine kernel, programmatic launches, SMs it must leave free) and
// how it launches dispatch and combine.
#pragma once

#include <memory>

#include "kernel_args.hpp"
#include "mori/core/gpu.hpp"
#include "mori/ops/dispatch_combine/config.hpp"
#include "mori/ops/dispatch_combine/handle.hpp"

namespace mori::ops {

class EpBackend {
 public:
  virtual ~EpBackend() = default;
  // Kernels are programmatic dependent launches (EpKernelCommon::programmatic).
  bool Programmatic() const { return programmatic; }
  // core::Fp8Format of fp8_direct_cast combine rows on this device
  // (EpCombineKernelArgs::fp8Format).
  int CombineFp8Format() const { return combineFp8Format; }
  // The combine pushes rows (a protocol every PE must share: part of the agreement row).
  virtual bool PushCombine() const { return false; }
  // Most blocks one launch may use on a GPU of `numSms` SMs (every block must be resident: they
  // wait on each other), before the family's own minimum.
  virtual int MaxBlocks(int numSms) const { return numSms; }
  // Dynamic shared memory of a dispatch launch.
  virtual size_t DispatchSmemBytes() const = 0;
  // The family's fields of the kernels' common arguments (EpKernelCommon), after the handle's.
  virtual void FillFamilyArgs(EpKernelCommon* /*common*/) const {}
  // How this op combines, as error messages name it ("pull", "push", ...).
  virtual const char* CombineName() const = 0;
  virtual void LaunchDispatch(const EpDispatchKernelArgs& k, EpIndexType indexType, int blocks,
                              int threads, size_t smemBytes, gpuStream_t stream) = 0;
  // `k` is filled by the shell as for the pull combine (sources, copies, outputs, parts per
  // token); the backend picks the kernel and may rewrite how the input is read. `bufferRows` is
  // the receive capacity (rows readable in the op's own buffers).
  virtual void LaunchCombine(EpCombineKernelArgs& k, const EpCombineArgs& args, int64_t bufferRows,
                             int blocks, int threads, gpuStream_t stream) = 0;

  // MORI_EP_DISPATCH_LOCAL_BLOCKS as the dispatch kernels take it
  // (EpDispatchKernelArgs::localBlocks; 0: unset).
  int DispatchLocalBlocks() const { return dispatchLocalBlocks; }

  // Called once by MakeEpBackend.
  void SetCombineFp8Format(int format) { combineFp8Format = format; }
  void SetDispatchLocalBlocks(int blocks) { dispatchLocalBlocks = blocks; }

 protected:
  bool programmatic = false;

 private:
  int combineFp8Format = 0;
  int dispatchLocalBlocks = 0;
};

// The backend of config.RunsAs() on the current device (decides from MORI_EP_* and the device):
// IntraNode, InterNode, or InterNodeV1 (which also runs InterNodeV1LL, its low-latency mode).
// Raises InvalidUsageError when shmem's topology does not fit the family (IntraNode: every PE by
// load/store; InterNode and InterNodeV1: shmem's nodes are gpu_per_node consecutive PEs,
// load/store within a node, RDMA across nodes). gridSms: the SMs the op's grids may take (the
// device's, or fewer where PEs share it under MPS: docs/ep.md, "Residency").
std::unique_ptr<EpBackend> MakeEpBackend(const EpDispatchCombineConfig& config, int device,
                                         int gridSms);

}  // namespace mori::ops

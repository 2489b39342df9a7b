// The backends of the handle, one per kernel family: IntraNode, InterNode and InterNodeV1 (which
// runs InterNodeV1LL too) (backend.hpp).
#include "backend.hpp"

#include <algorithm>
#include <vector>

#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/fp8.hpp"
#include "mori/core/gpu_check.hpp"
#include "mori/core/logging.hpp"
#include "mori/shmem/shmem_api.hpp"

namespace mori::ops {

namespace {

bool LoadStore(shmem::TransportType t) {
  return t == shmem::TransportType::kSelf || t == shmem::TransportType::kP2P;
}

// Programmatic dependent launches: MORI_EP_PDL, the device and the kernels' code allow them.
bool ProgrammaticAllowed(const gpuDeviceProp_t& prop) {
  return core::Env().epPdl && core::GpuHasProgrammaticLaunch(prop) && EpKernelsHaveGridDependency();
}

gpuDeviceProp_t DeviceProperties(int device) {
  gpuDeviceProp_t prop{};
  MORI_CHECK_GPU(gpuGetDeviceProperties(&prop, device));
  return prop;
}

// The push combine reads every input in place, the caller's tensors included (no copy; InterNode
// copies only the rows it WRITEs to other nodes into registered memory, in the kernel): rewrites
// the pull combine's arguments for it.
void ReadInPlaceForPush(EpCombineKernelArgs& k, const EpCombineArgs& args, int64_t bufferRows) {
  k.inTokens = static_cast<const uint8_t*>(args.input);
  k.inRows = k.copyTokens != 0 ? args.inputRows : bufferRows;
  k.inWeights = args.weights;
  k.inWeightRows = k.copyWeights != 0 ? args.weightRows : bufferRows;
  k.copyTokens = 0;
  k.copyWeights = 0;
  k.staged = 0;
}

class IntraNodeBackend final : public EpBackend {
 public:
  IntraNodeBackend(const EpDispatchCombineConfig& c, int device, int gridSms) : config(c) {
    for (int p = 0; p < c.worldSize; p++) {
      const shmem::TransportType t = shmem::ShmemTransportType(p);
      MORI_ENSURE(LoadStore(t), InvalidUsageError,
                  "EpDispatchCombineHandle: kernel_type IntraNode needs load/store (P2P over "
                  "NVLink/xGMI) access to every PE, but PE %d is reached by '%s' from PE %d (use "
                  "kernel_type InterNode across nodes)",
                  p, shmem::TransportTypeName(t), c.rank);
    }
    const gpuDeviceProp_t prop = DeviceProperties(device);
    // The staged combine needs the bulk copy engine, its shared memory (plus a margin for the
    // kernel's static shared memory) and MORI_EP_COMBINE_STAGED: "auto" stages where it was
    // measured faster, at most kEpStagedAutoMaxPes PEs (docs/ep.md, combine step 3).
    const bool wantStaged =
        core::ParseEnvAutoBool("MORI_EP_COMBINE_STAGED", core::Env().epCombineStaged)
            .value_or(c.worldSize <= kEpStagedAutoMaxPes);
    size_t smemOptin = 0;
    staged = wantStaged && core::GpuHasBulkAsyncCopy(prop, &smemOptin) &&
             EpCombineStagedSmemBytes(kEpMaxThreadsPerBlock / core::kWarpSize) + (16u << 10) <=
                 smemOptin;
    if (staged) PrepareEpCombineStaged();
    programmatic = ProgrammaticAllowed(prop);
    push = EpPushCombineFits(c) && core::Env().epCombinePush;
    precopy = core::Env().epCombinePrecopy && c.worldSize > 1;
    smCount = std::max(1, gridSms);
  }
  bool PushCombine() const override { return push; }
  size_t DispatchSmemBytes() const override { return EpDispatchSmemBytes(config, core::kWarpSize); }
  const char* CombineName() const override { return push ? "push" : "pull"; }

  void LaunchDispatch(const EpDispatchKernelArgs& k, EpIndexType indexType, int blocks, int threads,
                      size_t smemBytes, gpuStream_t stream) override {
    LaunchEpIntraNodeDispatch(k, indexType, blocks, threads, smemBytes, stream);
  }

  void LaunchCombine(EpCombineKernelArgs& k, const EpCombineArgs& args, int64_t bufferRows,
                     int blocks, int threads, gpuStream_t stream) override {
    if (push) {
      ReadInPlaceForPush(k, args, bufferRows);
      LaunchEpIntraNodePushCombine(k, args.dataType, blocks, threads, stream);
      return;
    }
    // An external input with MORI_EP_COMBINE_PRECOPY (more than one PE: with one, every row is
    // our own and nothing is copied): copied by a kernel launched first. With programmatic
    // launches the combine kernel runs beside it, so it takes the SMs the combine leaves (at
    // least half); otherwise every SM, before the combine.
    if (precopy && (k.copyTokens != 0 || k.copyWeights != 0) && k.wireFp8 == 0)
      k = LaunchEpCombinePrecopy(k,
                                 programmatic ? std::max(smCount - blocks, smCount / 2) : smCount,
                                 programmatic, stream);
    // Staged (bulk copies into shared memory) for large batches, where warps take many items and
    // the loads in flight bound the rate; small batches keep the register path (one item per warp,
    // latency-bound either way), and so does a combine that copies an external input itself
    // (docs/performance.md, "Staged combine").
    const long long items = static_cast<long long>(k.numTokens) * k.partsPerToken;
    k.staged = staged && (k.copyTokens == 0 || k.copyTokens == kEpCopiedBefore) && k.wireFp8 == 0 &&
                       items > blocks * (threads / core::kWarpSize)
                   ? 1
                   : 0;
    LaunchEpIntraNodeCombine(k, args.dataType, blocks, threads, stream);
  }

 private:
  EpDispatchCombineConfig config;
  bool staged = false;   // large-batch combine may use the staged (bulk-copy) kernel
  bool push = false;     // small-batch config: combine pushes rows (EpPushCombineFits)
  bool precopy = false;  // external input: copied by a kernel before (or beside) the combine
  int smCount = 1;       // SMs the op's grids may take (the precopy kernel's grid: from them)
};

// Nodes of gpu_per_node consecutive PEs, load/store within a node and RDMA across nodes, as the
// InterNode and InterNodeV1 families need. Returns whether some PE is reached through the RDMA
// emulator (MORI_RDMA_EMULATE).
bool CheckNodeTopology(const EpDispatchCombineConfig& c) {
  const int pe = c.rank;
  const int G = c.LocalSize();
  MORI_ENSURE(shmem::ShmemLocalSize() == G, InvalidUsageError,
              "EpDispatchCombineHandle: config gpu_per_node = %d (%d PEs per node in this group "
              "of %d) but shmem's node of PE %d has %d PEs (set gpu_per_node to the GPUs per "
              "node, as MORI_GPU_PER_NODE when nodes are emulated)",
              c.gpuPerNode, G, c.worldSize, pe, shmem::ShmemLocalSize());
  bool emulated = false;
  for (int p = 0; p < c.worldSize; p++) {
    const shmem::TransportType t = shmem::ShmemTransportType(p);
    const bool sameNode = p / G == pe / G;
    MORI_ENSURE(shmem::ShmemNodeOf(p) == p / G, InvalidUsageError,
                "EpDispatchCombineHandle: with gpu_per_node = %d PE %d belongs to node %d, but "
                "shmem puts it on node %d (nodes must be consecutive PEs)",
                c.gpuPerNode, p, p / G, shmem::ShmemNodeOf(p));
    MORI_ENSURE(sameNode ? LoadStore(t) : t == shmem::TransportType::kRdma, InvalidUsageError,
                "EpDispatchCombineHandle: PE %d is %s node of PE %d and must be reached by %s, "
                "but shmem reaches it by '%s'",
                p, sameNode ? "on the" : "not on the", pe, sameNode ? "load/store" : "RDMA",
                shmem::TransportTypeName(t));
    emulated = emulated || (t == shmem::TransportType::kRdma && core::Env().rdmaEmulate);
  }
  return emulated;
}

// What the families across nodes share: the topology check, and the emulated NIC's needs. The
// emulated NIC executes atomics, and copies within one GPU, as kernels of its own process on the
// GPUs the kernels wait on: launches leave it half the SMs (which MPS clients share) and are not
// programmatic (a kernel launched early holds SMs with waiting blocks).
class AcrossNodesBackend : public EpBackend {
 public:
  AcrossNodesBackend(const EpDispatchCombineConfig& c, int device)
      : config(c), emulated(CheckNodeTopology(c)) {
    programmatic = ProgrammaticAllowed(DeviceProperties(device)) && !emulated;
  }
  int MaxBlocks(int numSms) const override {
    return emulated ? std::min(numSms, std::max(config.worldSize, numSms / 2)) : numSms;
  }

 protected:
  EpDispatchCombineConfig config;

 private:
  bool emulated;  // some PE is reached through the RDMA emulator
};

class InterNodeBackend final : public AcrossNodesBackend {
 public:
  InterNodeBackend(const EpDispatchCombineConfig& c, int device) : AcrossNodesBackend(c, device) {
    push = EpPushCombineFits(c) && core::Env().epCombinePush;
    // One channel (QP 0 of shmem's QPs to each peer) whatever num_qp_per_pe says: spreading the
    // posts over several QPs (RdmaWrite) has not been run on a GPU yet.
    if (c.numQpPerPe > 1)
      MORI_WARN(
          kLogOps,
          "EP InterNode on PE %d: num_qp_per_pe = %d is not used yet: this build posts on one "
          "QP per peer",
          c.rank, c.numQpPerPe);
  }
  bool PushCombine() const override { return push; }
  size_t DispatchSmemBytes() const override { return EpDispatchSmemBytes(config, core::kWarpSize); }
  const char* CombineName() const override { return push ? "push" : "InterNode landing"; }

  void LaunchDispatch(const EpDispatchKernelArgs& k, EpIndexType indexType, int blocks, int threads,
                      size_t smemBytes, gpuStream_t stream) override {
    LaunchEpInterNodeDispatch(k, indexType, blocks, threads, smemBytes, stream);
  }

  void LaunchCombine(EpCombineKernelArgs& k, const EpCombineArgs& args, int64_t bufferRows,
                     int blocks, int threads, gpuStream_t stream) override {
    k.staged = 0;
    if (push) {
      ReadInPlaceForPush(k, args, bufferRows);
      LaunchEpInterNodePushCombine(k, args.dataType, blocks, threads, stream);
    } else {
      LaunchEpInterNodeCombine(k, args.dataType, blocks, threads, stream);
    }
  }

 private:
  bool push = false;  // small-batch config: combine pushes rows (EpPushCombineFits)
};

// InterNodeV1 and its low-latency mode InterNodeV1LL (EpKernelCommon::lowLatency): one kernel
// family, node-deduplicated (docs/ep_internode_v1.md).
class InterNodeV1Backend final : public AcrossNodesBackend {
 public:
  using AcrossNodesBackend::AcrossNodesBackend;
  size_t DispatchSmemBytes() const override {
    return EpV1DispatchSmemBytes(config, core::kWarpSize);
  }
  void FillFamilyArgs(EpKernelCommon* common) const override {
    common->lowLatency = config.RunsAs() == EpDispatchCombineKernelType::kInterNodeV1LL ? 1 : 0;
  }
  const char* CombineName() const override { return "node-deduplicated"; }

  void LaunchDispatch(const EpDispatchKernelArgs& k, EpIndexType indexType, int blocks, int threads,
                      size_t smemBytes, gpuStream_t stream) override {
    LaunchEpV1Dispatch(k, indexType, blocks, threads, smemBytes, stream);
  }

  void LaunchCombine(EpCombineKernelArgs& k, const EpCombineArgs& args, int64_t, int blocks,
                     int threads, gpuStream_t stream) override {
    k.staged = 0;
    LaunchEpV1Combine(k, args.dataType, blocks, threads, stream);
  }
};

// The e4m3 encoding of the device's FP8 hardware and frameworks: e4m3fnuz on AMD gfx94x (MI300),
// e4m3fn elsewhere (as dispatch's default fp8_dtype).
int DeviceFp8Format(int device) {
  const bool fnuz = core::kPlatformHip &&
                    core::GpuArchName(DeviceProperties(device)).find("gfx94") != std::string::npos;
  return static_cast<int>(fnuz ? core::Fp8Format::kE4M3Fnuz : core::Fp8Format::kE4M3Fn);
}

}  // namespace

std::unique_ptr<EpBackend> MakeEpBackend(const EpDispatchCombineConfig& config, int device,
                                         int gridSms) {
  std::unique_ptr<EpBackend> b;
  if (config.IsV1()) {
    b = std::make_unique<InterNodeV1Backend>(config, device);  // InterNodeV1, InterNodeV1LL
  } else if (config.RunsAs() == EpDispatchCombineKernelType::kInterNode) {
    b = std::make_unique<InterNodeBackend>(config, device);
  } else {
    b = std::make_unique<IntraNodeBackend>(config, device, gridSms);
  }
  b->SetCombineFp8Format(DeviceFp8Format(device));
  b->SetDispatchLocalBlocks(
      static_cast<int>(std::clamp<int64_t>(core::Env().epDispatchLocalBlocks, 0, 1 << 20)));
  return b;
}

}  // namespace mori::ops

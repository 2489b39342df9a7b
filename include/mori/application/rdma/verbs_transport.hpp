// The verbs back-end of RdmaTransport (rdma_transport.hpp), split for testing:
//
//   CreateVerbsRdmaTransport (src/application/rdma/verbs_transport.cpp, GPU-language TU): reads
//     the GPU's PCI bus id, the env table and the process-wide libibverbs/libmlx5 tables, and
//     hands the GPU runtime over as a GpuHostAccess;
//   CreateVerbsRdmaTransportWith (here, host C++): everything else, driven through the given
//     verbs/mlx5 tables and GpuHostAccess, so tests run it with stand-in libraries, an identity
//     "GPU" mapping and ranks as threads, on machines without a NIC or a GPU.
//
// Set-up, per PE (collective; every PE calls it, with or without RDMA peers):
//  1. NIC: discovery (MORI_RDMA_DEVICES), then ChooseNicForGpu; its first ACTIVE port.
//  2. PD; the heap registered once: dma-buf first (GpuHostAccess::ExportDmabuf, offset of the heap
//     inside its allocation), else ibv_reg_mr.
//  3. Per RDMA peer numQpPerPe RC QPs, each with its own CQ: max_send_wr = CQ depth = sqBlocks,
//     no receive queue (receive completions would share the CQ and break the SQ accounting).
//  4. mlx5dv_init_obj per QP/CQ (InitMlx5Queue checks sizes); counters in one mapped pinned host
//     block; SQ ring, doorbell records and CQ ring registered for the GPU (GpuHostRegistry).
//  5. Doorbell: MORI_RDMA_DOORBELL=uar|cpu|auto. uar/auto try to register each QP's UAR page as
//     I/O memory for the GPU (DoorbellMode::kUar); auto falls back to the CPU-assisted mode
//     (kMailbox + a DoorbellProxy thread), uar raises instead.
//  6. Exchanges: allgather {status, numQp, heap rkey, heap iova} (a PE that failed locally tells
//     everyone why, so every PE raises instead of timing out); all-to-all of the [peer][qp]
//     connection table; Connect (RESET->RTR->RTS); allgather of the outcome.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "mori/application/rdma/gpu_host_access.hpp"
#include "mori/application/rdma/rdma_transport.hpp"

namespace mori::application {

struct IbverbsApi;
struct Mlx5dvApi;

enum class RdmaDoorbellPolicy { kAuto, kUar, kCpu };
// MORI_RDMA_DOORBELL text: "auto" (also empty), "uar", "cpu"; case-insensitive, trimmed.
// InvalidUsageError naming the variable otherwise.
RdmaDoorbellPolicy ParseRdmaDoorbellPolicy(const std::string& text);
const char* RdmaDoorbellPolicyName(RdmaDoorbellPolicy p);

struct VerbsTransportSetup {
  int rank = 0;
  int worldSize = 0;
  std::vector<TransportType> transports;  // per PE; kRdma peers get queue pairs
  void* heapBase = nullptr;               // this PE's symmetric heap (device memory)
  uint64_t heapSize = 0;
  std::string gpuPciBusId;  // for the NIC choice; "" = no preference
  RdmaTransportConfig config;
  RdmaDoorbellPolicy doorbell = RdmaDoorbellPolicy::kAuto;
  std::string deviceFilter;  // MORI_RDMA_DEVICES text
  std::string sysfsClassDir = "/sys/class/infiniband";
  std::string pciDevicesDir = "/sys/bus/pci/devices";
  size_t pageBytes = 0;      // 0: the system page size
  int stopTimeoutMs = 5000;  // bound of Stop() on the doorbell proxy
};

// Library tables; a null table with its reason is a local set-up failure (reported collectively)
// only on a PE that has RDMA peers.
struct VerbsLibraries {
  const IbverbsApi* verbs = nullptr;
  std::string verbsWhy;
  const Mlx5dvApi* mlx5 = nullptr;
  std::string mlx5Why;
};

std::unique_ptr<RdmaTransport> CreateVerbsRdmaTransportWith(BootstrapNetwork& boot,
                                                            const VerbsTransportSetup& setup,
                                                            const VerbsLibraries& libs,
                                                            std::unique_ptr<GpuHostAccess> gpu);

}  // namespace mori::application

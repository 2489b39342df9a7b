// The RDMA transport of one PE, as shmem init builds it: per remote RDMA peer, MORI_NUM_QP_PER_PE
// connected RC queue pairs whose endpoint handles (core/transport/rdma_queue.hpp) are usable by
// GPU threads, the symmetric heap registered once (local lkey; each peer's rkey and heap base
// exchanged through the bootstrap), and whatever host thread the doorbell or the emulator needs.
//
// Two back-ends behind one interface:
//  * emulated (MORI_RDMA_EMULATE=1): rings and counters in mapped host memory, a QueueEmulator
//    thread executes the WQEs the GPU posts against the peers' heaps through IPC mappings (every
//    PE must be on one host). Test and bring-up mode, see docs/rdma.md.
//  * verbs: ibverbs-created QPs whose SQ/CQ/doorbell record are taken with mlx5dv_init_obj; the
//    doorbell is the NIC's UAR mapped for the GPU, else a CPU-assisted doorbell thread.
//
// Collective: every PE creates its transport in the same init step (the bootstrap exchanges are
// all-to-all), including PEs with no RDMA peer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mori/application/bootstrap/bootstrap.hpp"
#include "mori/application/context/context.hpp"
#include "mori/application/memory/symmetric_heap.hpp"
#include "mori/application/rdma/rdma_stats.hpp"
#include "mori/core/transport/rdma_queue.hpp"

namespace mori::application {

struct RdmaTransportConfig {
  int numQpPerPe = 1;       // MORI_NUM_QP_PER_PE
  uint32_t sqBlocks = 256;  // SQ ring size in 64-byte basic blocks (power of two)
};

// What a GPU thread needs to reach one RDMA peer. Pointers are valid in device code of this PE.
struct RdmaPeerEndpoints {
  std::vector<core::rdma::QpEndpoint> qps;  // numQpPerPe entries; empty for non-RDMA PEs
  uint32_t rkey = 0;                        // the peer's heap rkey
  uint64_t remoteHeapBase = 0;              // the peer's heap base as its NIC addresses it (iova)
};

class RdmaTransport {
 public:
  virtual ~RdmaTransport() = default;
  // e.g. "emulated", "verbs, UAR doorbell", "verbs, CPU-assisted doorbell"
  virtual std::string Describe() const = 0;
  // Key of this PE's registered heap for the local side of WQEs.
  virtual uint32_t HeapLkey() const = 0;
  // One entry per PE (index = PE).
  virtual const std::vector<RdmaPeerEndpoints>& Peers() const = 0;
  // Registers a local buffer [ptr, ptr + bytes) of this PE (device memory of its GPU, or host
  // memory the GPU can reach) as the local side of work requests: put sources, get destinations.
  // Returns its lkey. Not collective. Overlapping registrations are allowed.
  virtual uint32_t RegisterLocal(void* ptr, size_t bytes) = 0;
  // Drops the registration made for `ptr` (InvalidUsageError if there is none). Work requests
  // using it must have completed (quiet) before.
  virtual void DeregisterLocal(void* ptr) = 0;
  // Stops host threads (emulator, doorbell proxy) within a bound; idempotent. Called by shmem
  // finalize after the device work is done and before the heap is unmapped and freed.
  virtual void Stop() = 0;
  // First host-side failure of a helper thread (not an error CQE), empty if none.
  virtual std::string FatalError() const = 0;
  // The work requests this PE put on the wire (rdma_stats.hpp), zeroed after reading when `reset`.
  // Only the emulator counts them; a back-end that cannot returns `available == false`.
  virtual RdmaWireStats WireStats(bool reset) = 0;
};

// Collective. Builds the emulated transport for every PE whose transport is kRdma in `context`.
// `heap` must map those peers for host access (SymmetricHeap's emulation mappings).
std::unique_ptr<RdmaTransport> CreateEmulatedRdmaTransport(BootstrapNetwork& boot,
                                                           const Context& context,
                                                           const SymmetricHeap& heap,
                                                           const RdmaTransportConfig& config);

// Collective. Builds the verbs transport (real mlx5 NIC).
std::unique_ptr<RdmaTransport> CreateVerbsRdmaTransport(BootstrapNetwork& boot,
                                                        const Context& context,
                                                        const SymmetricHeap& heap,
                                                        const RdmaTransportConfig& config);

}  // namespace mori::application

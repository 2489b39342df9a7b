// Shmem host API. Collective calls (init, finalize, malloc, free, barrier) must be made by every PE
// in the same order. Errors are raised as mori::core::Error subclasses.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "mori/application/bootstrap/bootstrap.hpp"
#include "mori/application/rdma/rdma_stats.hpp"
#include "mori/core/gpu.hpp"
#include "mori/shmem/shmem_types.hpp"

namespace mori::shmem {

constexpr size_t kUniqueIdBytes = 128;
struct UniqueId {
  uint8_t bytes[kUniqueIdBytes];
};

// Init flags, numbered as MORI/NVSHMEM do.
enum ShmemInitFlag : unsigned { kShmemInitWithMpiComm = 0, kShmemInitWithUniqueId = 1 };

// --- init / finalize -----------------------------------------------------------------------
// Binds to the calling thread's current GPU. Takes ownership of the bootstrap.
void ShmemInit(std::unique_ptr<application::BootstrapNetwork> bootstrap);
// Socket bootstrap: rank 0 calls ShmemGetUniqueId, the caller shares the bytes with every rank,
// and every rank calls ShmemInitWithUniqueId(rank, nranks, id).
UniqueId ShmemGetUniqueId();
void ShmemInitWithUniqueId(int rank, int nranks, const UniqueId& id);
// MPI bootstrap (only when built with MPI; otherwise raises InvalidUsageError). `comm` is an
// MPI_Comm passed as a pointer to avoid exposing mpi.h here; nullptr = MPI_COMM_WORLD.
void ShmemMpiInit(void* mpiComm);
void ShmemFinalize();
bool ShmemIsInitialized();
// Process exit without finalize (engines exit with shmem and ops alive). Stops this PE's RDMA
// service thread and abandons the state without any collective, device synchronisation or free:
// peers may have exited already, and the process's GPU memory goes with it. Afterwards shmem
// reads as not initialised, so objects holding symmetric memory (EP ops) release nothing
// collectively either. Idempotent, never throws. Registered with std::atexit at the first init
// (it then runs before the GPU runtime's own exit handlers); the Python package calls it from
// its atexit hook, which runs before objects are collected at interpreter shutdown.
void ShmemPrepareProcessExit() noexcept;
// True once ShmemPrepareProcessExit ran: the process is exiting and nothing is to be freed.
bool ShmemProcessExiting() noexcept;

// --- queries --------------------------------------------------------------------------------
int ShmemMyPe();
int ShmemNPes();
TransportType ShmemTransportType(int pe);
// Topology. A node is the set of PEs with the same host (boot id, or MORI_NODE_ID) and the same
// MORI_GPU_PER_NODE group (rank / MORI_GPU_PER_NODE when set); its PEs are reached by P2P where
// the GPUs allow it, PEs of other nodes by RDMA. Nodes are numbered 0.. in the order of their
// lowest PE; the local rank is this PE's index among its node's PEs in PE order.
int ShmemNodeOf(int pe);  // node of PE `pe` (InvalidUsageError if out of range)
int ShmemNumNodes();
int ShmemLocalRank();   // this PE's index on its node
int ShmemLocalSize();   // number of PEs on this PE's node
int ShmemPesOnMyGpu();  // number of PEs (this one included) whose GPU is this PE's GPU
// The struct kernels take by value to use the device API.
ShmemDeviceContext ShmemGetDeviceContext();

// --- symmetric memory ------------------------------------------------------------------------
// Collective. Same offset on every PE. Alignment is honoured for any power of two.
void* ShmemMalloc(size_t size);
void* ShmemMallocAlign(size_t alignment, size_t size);
void ShmemFree(void* ptr);
// Peer's address of a symmetric pointer as mapped in this process; nullptr if not P2P reachable.
void* ShmemPtrP2p(const void* ptr, int pe);
SymmMemObj ShmemQueryMemObj(const void* ptr);
size_t ShmemHeapFreeBytes();
// Registers a local (non-heap) buffer of this PE as a source of device puts and a destination of
// device gets to PEs reached by RDMA (the heap is registered already). Not collective; at most
// kMaxUserRegions buffers at once. Without RDMA peers there is nothing to register: a no-op.
void ShmemRegisterBuffer(void* ptr, size_t bytes);
// Ends the registration of `ptr` (InvalidUsageError if it is not registered while RDMA is in use).
// Device work using the buffer must have completed first (quiet, or a stream synchronize).
void ShmemDeregisterBuffer(void* ptr);

// --- synchronisation ------------------------------------------------------------------------
// Host barrier: waits for this PE's device work, then a bootstrap barrier.
void ShmemBarrierAll();
// Device barrier across all PEs, enqueued on `stream` (no host synchronisation).
void ShmemBarrierOnStream(gpuStream_t stream);
// Bounded host wait for `stream`; raises TimeoutError after MORI_HOST_TIMEOUT_MS and surfaces a
// recorded device error (see ShmemCheckDeviceError).
void ShmemStreamSynchronize(gpuStream_t stream);
// Raises the first recorded device-side error, then clears the record so the library stays
// usable: TimeoutError for a wait that expired (or an abort), InvalidUsageError for a call or
// protocol violation a kernel found, RemoteError for an RDMA error completion; the message names
// the rank, block, thread, peer, address and the expected and seen values.
void ShmemCheckDeviceError();
// Cheap host read of the mapped error record: true while a device error or abort is pending
// (every bounded device wait gives up at once until it is read). Does not clear it; when
// `description` is given it receives what ShmemCheckDeviceError would report.
bool ShmemDeviceErrorPending(std::string* description = nullptr);
// Raises the abort flag without recording a wait: every bounded device wait of every kernel gives
// up; the next ShmemCheckDeviceError / ShmemStreamSynchronize raises TimeoutError ("aborted").
// What a host wait does on expiry; for watchdogs and tests.
void ShmemAbortDeviceWaits();
// Test hook (fault injection): stores `rkey` as the heap key this PE's kernels put into their RDMA
// requests to PE `pe` and returns the key it replaces. A request carrying a wrong key completes in
// error (remote access) and leaves its QP failed until shmem is finalized. Call only while none
// of this PE's device work is running. InvalidUsageError when `pe` is not reached by RDMA.
uint32_t ShmemExchangeRdmaPeerKey(int pe, uint32_t rkey);
// Bounded wait for all of this PE's device work (MORI_HOST_TIMEOUT_MS), then for the completion
// of every RDMA request it posted (a kernel may finish before its last puts have landed): on
// return, everything this PE put has reached its peers. Leaves a recorded device error in place
// for ShmemCheckDeviceError / ShmemStreamSynchronize to report.
void ShmemDeviceSynchronize();
// Collective over all PEs through the bootstrap (host only: no device synchronisation, device
// errors left in place): `recv` holds NPes() * bytesPerPe bytes, PE p's `send` lands at
// p * bytesPerPe. Bounded like init: MORI_BOOTSTRAP_TIMEOUT for the socket bootstrap, the torch
// and MPI bootstraps by their own timeouts. For small agreement checks, not for data.
void ShmemBootstrapAllgather(const void* send, void* recv, size_t bytesPerPe);
// Identifies the current init: 0 when not initialised, a new value after every init. Objects that
// hold symmetric memory compare it to notice a finalize (and re-init) under them.
uint64_t ShmemInitGeneration();

// --- RDMA statistics --------------------------------------------------------------------------
// The RDMA work requests this PE put on the wire since init (or the last reset): per (this PE,
// peer, opcode) counts, bytes and size histogram, plus the trace ring (MORI_RDMA_EMULATE_TRACE).
// Counted by the software queue emulator (MORI_RDMA_EMULATE=1); the verbs transport returns
// `available == false` with the reason in `source`. Without any RDMA peer in the job: empty, and
// available. `reset` zeroes the counters and the trace after reading. Not collective.
application::RdmaWireStats ShmemRdmaStats(bool reset = false);

}  // namespace mori::shmem

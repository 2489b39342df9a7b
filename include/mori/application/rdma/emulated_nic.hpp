// The emulated NIC of MORI_RDMA_EMULATE: a QueueEmulator served in a process of its own.
//
// A PE's process never executes the WQEs its kernels post. Its emulated NIC process
// (mori-emulated-nic, spawned by the emulated transport) maps the rings (shared host memory the
// PE's GPU also maps), opens the heaps and registered buffers of the PEs it serves through IPC
// handles, and copies with its own GPU context. Nothing the PE's process does (kernels queued
// behind EP calls, a launch waiting for room in a full queue, allocations, module loads,
// synchronisations, CUDA graphs, other streams) can hold up the NIC's runtime calls: they are
// another process's calls on another context, the way a real NIC is another device.
//
// This header is host-only: the client (the PE's side) and the server loop (the NIC's side) talk
// over a connected stream socket in request/response messages; the server's GPU specifics come in
// through EmuNicBackend, so the whole exchange is tested on CPUs with host memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "mori/application/rdma/queue_emulator.hpp"
#include "mori/application/rdma/rdma_stats.hpp"

namespace mori::application {

constexpr size_t kEmuNicHandleBytes = 64;  // an IPC memory handle, as raw bytes
// The NIC process's descriptors at start: the connection and the shared ring memory.
constexpr int kEmuNicConnFd = 3;
constexpr int kEmuNicRingFd = 4;
// The NIC program's file name; it is installed next to libmori.
constexpr const char* kEmuNicProgram = "mori-emulated-nic";

// What the NIC process needs to reach memory of one PE: the owner's IPC handle of the allocation
// that holds it, that allocation's base address in the owner's process (the iova WQEs use), and the
// registered range inside it.
struct EmuNicMemory {
  int pe = -1;
  uint8_t handle[kEmuNicHandleBytes] = {};
  uint64_t allocBase = 0;   // the allocation's address in the owner's process
  uint64_t allocBytes = 0;  // its size
  uint64_t base = 0;        // the registered range, in the owner's addresses
  uint64_t length = 0;
  uint32_t access = kEmuAllAccess;
};

// One queue pair, by offsets into the shared ring memory (the same offsets in both processes).
struct EmuNicQp {
  uint64_t sqOffset = 0;
  uint64_t cqOffset = 0;
  uint64_t countersOffset = 0;  // core::rdma::QpCounters
  uint32_t sqBlocks = 0;
  uint32_t numCqes = 0;
  uint32_t qpn = 0;
  int pe = -1;        // the PE that posts on it (its lkeys)
  int remotePe = -1;  // the connected peer (its rkeys)
};

struct EmuNicInit {
  int rank = -1;
  std::string gpuBusId;  // the GPU of the PE, as its process names it (PCI bus id)
  EmuOptions options;
  int64_t hostTimeoutMs = 0;  // bound of the NIC's own GPU waits
};

// The NIC process's GPU side; a host stand-in serves the CPU tests.
class EmuNicBackend {
 public:
  virtual ~EmuNicBackend() = default;
  // Selects the GPU (Init). Throws on failure.
  virtual void Bind(const std::string& gpuBusId) = 0;
  // Maps an allocation of another process (its IPC handle); returns where the NIC touches its
  // first byte. Called once per (pe, allocBase) however many ranges are registered in it.
  virtual void* Open(const EmuNicMemory& m) = 0;
  virtual void Close(void* mapped) = 0;
  virtual std::unique_ptr<EmuMemoryAccessor> MakeAccessor(int64_t hostTimeoutMs) = 0;
};

// The NIC's message loop on `fd` until a stop request or the end of the connection; `rings` is
// the shared ring memory as mapped in this process. `parentAlive`, if given, is asked about once
// a second while idle; the loop ends when it returns false. Returns 0 after a clean stop.
int RunEmulatedNicServer(int fd, void* rings, size_t ringBytes, EmuNicBackend& backend,
                         bool (*parentAlive)() = nullptr);

// The PE's side of the connection. Every call is one request and its response, serialised by a
// mutex and bounded by `timeoutMs`; a NIC-side error comes back as the same error type with the
// NIC's message. When the connection breaks, `describeExit` (if set) says why (the process's exit
// status) in the error.
class EmulatedNicClient {
 public:
  EmulatedNicClient(int fd, int64_t timeoutMs, std::string (*describeExit)(void*) = nullptr,
                    void* describeArg = nullptr);
  ~EmulatedNicClient();  // closes the connection
  EmulatedNicClient(const EmulatedNicClient&) = delete;
  EmulatedNicClient& operator=(const EmulatedNicClient&) = delete;

  void Init(const EmuNicInit& init);
  // Registers a range; key 0 lets the NIC choose it. Returns the key.
  uint32_t Register(const EmuNicMemory& m, uint32_t key = 0);
  void Deregister(uint32_t key);
  void AddQp(const EmuNicQp& qp);
  void Start();
  RdmaWireStats WireStats(bool reset);
  // The NIC's first failure that is not an error CQE, or why the NIC is gone; empty if neither.
  std::string FatalError();
  // Stops the emulator (joins it within `timeoutMs`) and ends the server loop.
  void Stop(int64_t timeoutMs);
  bool Connected() const { return fd >= 0; }

 private:
  std::string Call(uint32_t type, const std::string& payload);
  int fd;
  int64_t timeoutMs;
  std::string (*describeExit)(void*);
  void* describeArg;
  std::string broken;  // why the connection is gone, once it is
  std::mutex mu;
};

}  // namespace mori::application

// Host-side verbs control path: protection domain, memory registration, RC queue pair with its
// CQ, and the RESET -> INIT -> RTR -> RTS connection sequence. RAII throughout: every object
// releases what it created, in reverse order, and never throws from a destructor (a failed
// release is a WARN). Every failed verbs call raises core::SystemError naming the call, the errno
// text, the device and the port; nonsensical remote connection data raises core::RemoteError.
//
// All verbs calls go through an IbverbsApi table (ibverbs_loader.hpp): the process-wide Ibverbs()
// by default, a test's stand-in library otherwise. The table must outlive every object here.
// verbs types are only forward-declared; this header does not need the rdma-core headers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "mori/application/rdma/rdma_devices.hpp"

struct ibv_context;
struct ibv_pd;
struct ibv_mr;
struct ibv_cq;
struct ibv_qp;

namespace mori::application {

struct IbverbsApi;

// An opened device and one protection domain on it.
class RdmaProtectionDomain {
 public:
  // Through Ibverbs(); raises SystemError when libibverbs is not available.
  explicit RdmaProtectionDomain(const std::string& deviceName);
  // Through `api` (which must outlive this object).
  RdmaProtectionDomain(const IbverbsApi& api, const std::string& deviceName);
  ~RdmaProtectionDomain();
  RdmaProtectionDomain(const RdmaProtectionDomain&) = delete;
  RdmaProtectionDomain& operator=(const RdmaProtectionDomain&) = delete;

  const IbverbsApi& Api() const { return *api; }
  const std::string& DeviceName() const { return deviceName; }
  ibv_context* Context() const { return context; }
  ibv_pd* Pd() const { return pd; }

 private:
  const IbverbsApi* api;
  std::string deviceName;
  ibv_context* context = nullptr;
  ibv_pd* pd = nullptr;
};

// Access flags every region gets: local write | remote write | remote read | remote atomic.
int RdmaMemoryRegionAccessFlags();

// A registered range [ptr, ptr + length). With dmabufFd >= 0 (and libibverbs >= 1.12) the range
// is registered through ibv_reg_dmabuf_mr (offset = dmabufOffset into the dma-buf, iova = ptr)
// first; when that is unavailable or fails, through ibv_reg_mr (an INFO says why). The PD must
// outlive the region.
class RdmaMemoryRegion {
 public:
  RdmaMemoryRegion(const RdmaProtectionDomain& pd, void* ptr, size_t length, int dmabufFd = -1,
                   uint64_t dmabufOffset = 0);
  ~RdmaMemoryRegion();
  RdmaMemoryRegion(const RdmaMemoryRegion&) = delete;
  RdmaMemoryRegion& operator=(const RdmaMemoryRegion&) = delete;

  uint32_t Lkey() const;
  uint32_t Rkey() const;
  uintptr_t Addr() const;  // the registered address (iova) as the NIC sees it
  size_t Length() const { return length; }
  bool ViaDmabuf() const { return viaDmabuf; }
  ibv_mr* Mr() const { return mr; }

 private:
  const RdmaProtectionDomain& pd;
  size_t length;
  bool viaDmabuf = false;
  ibv_mr* mr = nullptr;
};

struct RdmaQpConfig {
  int portNum = 1;       // 1-based verbs port
  int cqDepth = 4096;    // CQ entries
  int maxSendWr = 4096;  // send queue depth
  int maxRecvWr = 256;   // receive queue depth
  int maxSendSge = 1;
  int maxRecvSge = 1;
  int maxInlineData = 0;
  int maxRdAtomic = 16;      // RTS max_rd_atomic (outstanding reads/atomics we initiate)
  int maxDestRdAtomic = 16;  // RTR max_dest_rd_atomic (ones we accept)
  int minRnrTimer = 12;      // RTR min_rnr_timer (IB encoding; 12 = 0.64 ms)
  int gidIndex = -1;         // -1: MORI_RDMA_GID_INDEX when >= 0, else chosen automatically
  // Where discovery reads GID types when the library cannot say (tests point it elsewhere).
  std::string sysfsClassDir = "/sys/class/infiniband";
};

// What a peer needs to connect to this QP (exchanged out of band).
struct RdmaConnectionInfo {
  uint32_t qpn = 0;  // 24-bit queue pair number
  uint32_t psn = 0;  // 24-bit initial packet sequence number of our send queue
  uint16_t lid = 0;  // InfiniBand LID (0 on Ethernet)
  uint8_t gid[16] = {};
  uint8_t mtu = 0;  // active MTU of our port, as enum ibv_mtu (1 = 256 .. 5 = 4096)
  uint8_t portNum = 0;
  int32_t gidIndex = 0;
};
using ConnectionInfo = RdmaConnectionInfo;

// The GID index for a port: `requested` when >= 0 (must be inside the GID table, else
// InvalidUsageError); else, on an Ethernet (RoCE) port, the first RoCE v2 GID that is
// IPv4-mapped (::ffff:a.b.c.d); else 0. Exposed for tests.
int ChooseRdmaGidIndex(const RdmaPortInfo& port, int64_t requested);

// An RC queue pair with one CQ for both send and receive completions, created in RESET.
class RdmaRcQueuePair {
 public:
  RdmaRcQueuePair(const RdmaProtectionDomain& pd, const RdmaQpConfig& config = RdmaQpConfig{});
  ~RdmaRcQueuePair();
  RdmaRcQueuePair(const RdmaRcQueuePair&) = delete;
  RdmaRcQueuePair& operator=(const RdmaRcQueuePair&) = delete;

  const RdmaConnectionInfo& LocalInfo() const { return local; }
  bool IsEthernet() const { return ethernet; }
  // RESET -> INIT -> RTR -> RTS towards `remote`. Once per QP (InvalidUsageError after). A failed
  // transition leaves the QP in whatever state verbs left it; destroy it.
  void Connect(const RdmaConnectionInfo& remote);
  bool Connected() const { return connected; }

  ibv_qp* Qp() const { return qp; }
  ibv_cq* Cq() const { return cq; }

 private:
  void ModifyOrThrow(void* attr, int mask, const char* transition);
  void Release() noexcept;

  const RdmaProtectionDomain& pd;
  RdmaQpConfig config;
  RdmaConnectionInfo local;
  bool ethernet = false;
  bool connected = false;
  ibv_cq* cq = nullptr;
  ibv_qp* qp = nullptr;
};

}  // namespace mori::application

#include "mori/application/rdma/rdma_setup.hpp"

#include <cerrno>
#include <chrono>
#include <cstring>
#include <random>

#include "mori/application/rdma/ibverbs_loader.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/logging.hpp"

#include "verbs_headers.hpp"

namespace mori::application {
namespace {

// errno text for a verbs call: int-returning calls give an errno value (some older providers
// return -1 and set errno), pointer-returning ones set errno.
std::string ErrText(int err) {
  if (err == 0) return "no error code";
  return core::StrFormat("%s (errno %d)", std::strerror(err), err);
}

int RcErrno(int rc) { return rc > 0 ? rc : (rc < 0 && errno != 0 ? errno : (rc < 0 ? -rc : 0)); }

[[noreturn]] void ThrowVerbs(const char* call, const std::string& device, int port, int err) {
  if (port > 0) {
    MORI_THROW(SystemError, "%s failed on %s port %d: %s", call, device.c_str(), port,
               ErrText(err).c_str());
  }
  MORI_THROW(SystemError, "%s failed on %s: %s", call, device.c_str(), ErrText(err).c_str());
}

const IbverbsApi& LoadedApi() {
  std::string why;
  const IbverbsApi* api = Ibverbs(&why);
  if (api == nullptr) MORI_THROW(SystemError, "RDMA set-up impossible: %s", why.c_str());
  return *api;
}

bool IsIpv4MappedGid(const uint8_t* raw) {
  for (int i = 0; i < 10; i++) {
    if (raw[i] != 0) return false;
  }
  return raw[10] == 0xff && raw[11] == 0xff;
}

uint32_t RandomPsn() {
  uint64_t seed =
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  try {
    std::random_device rd;
    seed ^= (static_cast<uint64_t>(rd()) << 32) | rd();
  } catch (...) {
  }
  std::mt19937_64 gen(seed);
  return static_cast<uint32_t>(gen() & 0xffffffu);
}

}  // namespace

int ChooseRdmaGidIndex(const RdmaPortInfo& port, int64_t requested) {
  if (requested >= 0) {
    MORI_ENSURE(port.gidTableLen <= 0 || requested < port.gidTableLen, InvalidUsageError,
                "GID index %lld is outside the GID table of port %d (%d entries; "
                "MORI_RDMA_GID_INDEX)",
                static_cast<long long>(requested), port.port, port.gidTableLen);
    return static_cast<int>(requested);
  }
  if (port.linkLayer == RdmaLinkLayer::kEthernet) {
    for (const RdmaGidInfo& g : port.gids) {
      if (g.type == "RoCE v2" && IsIpv4MappedGid(g.raw)) return g.index;
    }
  }
  return 0;
}

#if MORI_HAVE_VERBS_H

// --- protection domain ---------------------------------------------------------------------
RdmaProtectionDomain::RdmaProtectionDomain(const std::string& deviceName)
    : RdmaProtectionDomain(LoadedApi(), deviceName) {}

RdmaProtectionDomain::RdmaProtectionDomain(const IbverbsApi& apiRef, const std::string& name)
    : api(&apiRef), deviceName(name) {
  int count = 0;
  errno = 0;
  ibv_device** list = api->getDeviceList(&count);
  if (list == nullptr) ThrowVerbs("ibv_get_device_list", deviceName, 0, errno);
  ibv_device* device = nullptr;
  std::string present;
  for (int i = 0; i < count; i++) {
    const char* n = api->getDeviceName(list[i]);
    std::string s = n != nullptr ? n : "";
    present += (present.empty() ? "" : ",") + s;
    if (s == deviceName) device = list[i];
  }
  if (device == nullptr) {
    api->freeDeviceList(list);
    MORI_THROW(InvalidUsageError, "RDMA device %s does not exist (devices present: %s)",
               deviceName.c_str(), present.empty() ? "none" : present.c_str());
  }
  errno = 0;
  context = api->openDevice(device);
  int err = errno;
  api->freeDeviceList(list);
  if (context == nullptr) ThrowVerbs("ibv_open_device", deviceName, 0, err);
  errno = 0;
  pd = api->allocPd(context);
  if (pd == nullptr) {
    err = errno;
    api->closeDevice(context);
    context = nullptr;
    ThrowVerbs("ibv_alloc_pd", deviceName, 0, err);
  }
  MORI_DEBUG(kLogRdma, "%s: protection domain allocated", deviceName.c_str());
}

RdmaProtectionDomain::~RdmaProtectionDomain() {
  if (pd != nullptr) {
    int rc = api->deallocPd(pd);
    if (rc != 0) {
      MORI_WARN(kLogRdma, "ibv_dealloc_pd failed on %s: %s", deviceName.c_str(),
                ErrText(RcErrno(rc)).c_str());
    }
  }
  if (context != nullptr) {
    int rc = api->closeDevice(context);
    if (rc != 0) {
      MORI_WARN(kLogRdma, "ibv_close_device failed on %s: %s", deviceName.c_str(),
                ErrText(RcErrno(rc)).c_str());
    }
  }
}

// --- memory region -------------------------------------------------------------------------
int RdmaMemoryRegionAccessFlags() {
  return IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
         IBV_ACCESS_REMOTE_ATOMIC;
}

RdmaMemoryRegion::RdmaMemoryRegion(const RdmaProtectionDomain& pdRef, void* ptr, size_t len,
                                   int dmabufFd, uint64_t dmabufOffset)
    : pd(pdRef), length(len) {
  MORI_ENSURE(ptr != nullptr && len > 0, InvalidUsageError,
              "memory registration on %s needs a non-empty range (ptr %p, length %zu)",
              pd.DeviceName().c_str(), ptr, len);
  const IbverbsApi& api = pd.Api();
  const int access = RdmaMemoryRegionAccessFlags();
  std::string dmabufWhy;
  if (dmabufFd >= 0) {
    if (api.regDmabufMr == nullptr) {
      dmabufWhy = "libibverbs has no ibv_reg_dmabuf_mr";
    } else {
      errno = 0;
      mr = api.regDmabufMr(pd.Pd(), dmabufOffset, len, reinterpret_cast<uintptr_t>(ptr), dmabufFd,
                           access);
      if (mr != nullptr) {
        viaDmabuf = true;
      } else {
        dmabufWhy = "ibv_reg_dmabuf_mr failed: " + ErrText(errno);
      }
    }
    if (mr == nullptr) {
      MORI_INFO(kLogRdma, "%s: dma-buf registration of %p (+%zu) not used (%s); using ibv_reg_mr",
                pd.DeviceName().c_str(), ptr, len, dmabufWhy.c_str());
    }
  }
  if (mr == nullptr) {
    errno = 0;
    // Same choice as verbs.h's ibv_reg_mr inline: our flags are outside the optional range.
    if ((access & IBV_ACCESS_OPTIONAL_RANGE) != 0 && api.regMrIova2 != nullptr) {
      mr = api.regMrIova2(pd.Pd(), ptr, len, reinterpret_cast<uintptr_t>(ptr),
                          static_cast<unsigned int>(access));
    } else {
      mr = api.regMr(pd.Pd(), ptr, len, access);
    }
    if (mr == nullptr) {
      int err = errno;
      MORI_THROW(SystemError, "ibv_reg_mr failed on %s for %p (+%zu): %s%s%s",
                 pd.DeviceName().c_str(), ptr, len, ErrText(err).c_str(),
                 dmabufWhy.empty() ? "" : "; before that: ", dmabufWhy.c_str());
    }
  }
  MORI_DEBUG(kLogRdma, "%s: registered %p (+%zu)%s lkey 0x%x rkey 0x%x", pd.DeviceName().c_str(),
             ptr, len, viaDmabuf ? " via dma-buf" : "", mr->lkey, mr->rkey);
}

RdmaMemoryRegion::~RdmaMemoryRegion() {
  if (mr == nullptr) return;
  int rc = pd.Api().deregMr(mr);
  if (rc != 0) {
    MORI_WARN(kLogRdma, "ibv_dereg_mr failed on %s: %s", pd.DeviceName().c_str(),
              ErrText(RcErrno(rc)).c_str());
  }
}

uint32_t RdmaMemoryRegion::Lkey() const { return mr->lkey; }
uint32_t RdmaMemoryRegion::Rkey() const { return mr->rkey; }
uintptr_t RdmaMemoryRegion::Addr() const { return reinterpret_cast<uintptr_t>(mr->addr); }

// --- RC queue pair -------------------------------------------------------------------------
RdmaRcQueuePair::RdmaRcQueuePair(const RdmaProtectionDomain& pdRef, const RdmaQpConfig& cfg)
    : pd(pdRef), config(cfg) {
  const IbverbsApi& api = pd.Api();
  const std::string& dev = pd.DeviceName();
  const int port = config.portNum;
  MORI_ENSURE(port >= 1 && port <= 255, InvalidUsageError, "RDMA port %d on %s is not 1..255", port,
              dev.c_str());
  MORI_ENSURE(config.cqDepth > 0 && config.maxSendWr > 0 && config.maxRecvWr >= 0,
              InvalidUsageError, "RC QP on %s port %d: bad depths (cq %d, send %d, recv %d)",
              dev.c_str(), port, config.cqDepth, config.maxSendWr, config.maxRecvWr);
  MORI_ENSURE(config.maxRdAtomic >= 0 && config.maxRdAtomic <= 255 && config.maxDestRdAtomic >= 0 &&
                  config.maxDestRdAtomic <= 255,
              InvalidUsageError, "RC QP on %s port %d: rd_atomic limits must be 0..255",
              dev.c_str(), port);

  ibv_port_attr pa{};
  int rc = IbvQueryPort(api, pd.Context(), static_cast<uint8_t>(port), &pa);
  if (rc != 0) ThrowVerbs("ibv_query_port", dev, port, RcErrno(rc));
  ethernet = pa.link_layer == IBV_LINK_LAYER_ETHERNET;

  local.portNum = static_cast<uint8_t>(port);
  local.lid = ethernet ? 0 : pa.lid;
  local.mtu = static_cast<uint8_t>(pa.active_mtu);
  local.psn = RandomPsn();

  int64_t requested = config.gidIndex >= 0 ? config.gidIndex : core::Env().rdmaGidIndex;
  if (requested >= 0) {
    RdmaPortInfo info;
    info.port = port;
    info.gidTableLen = pa.gid_tbl_len;
    local.gidIndex = ChooseRdmaGidIndex(info, requested);
  } else if (ethernet) {
    std::string why;
    std::vector<RdmaDeviceInfo> found =
        DiscoverRdmaDevicesWith(api, dev, config.sysfsClassDir, &why);
    const RdmaPortInfo* portInfo = nullptr;
    for (const RdmaDeviceInfo& d : found) {
      for (const RdmaPortInfo& p : d.ports) {
        if (d.name == dev && p.port == port) portInfo = &p;
      }
    }
    if (portInfo != nullptr) {
      local.gidIndex = ChooseRdmaGidIndex(*portInfo, -1);
    } else {
      local.gidIndex = 0;
      MORI_WARN(kLogRdma, "%s port %d: no GID table from discovery (%s); using GID index 0",
                dev.c_str(), port, why.empty() ? "port not listed" : why.c_str());
    }
  } else {
    local.gidIndex = 0;
  }
  ibv_gid gid{};
  rc = api.queryGid(pd.Context(), static_cast<uint8_t>(port), local.gidIndex, &gid);
  if (rc != 0) ThrowVerbs("ibv_query_gid", dev, port, RcErrno(rc));
  std::memcpy(local.gid, gid.raw, 16);

  errno = 0;
  cq = api.createCq(pd.Context(), config.cqDepth, nullptr, nullptr, 0);
  if (cq == nullptr) ThrowVerbs("ibv_create_cq", dev, port, errno);

  ibv_qp_init_attr init{};
  init.send_cq = cq;
  init.recv_cq = cq;
  init.qp_type = IBV_QPT_RC;
  init.sq_sig_all = 0;
  init.cap.max_send_wr = static_cast<uint32_t>(config.maxSendWr);
  init.cap.max_recv_wr = static_cast<uint32_t>(config.maxRecvWr);
  init.cap.max_send_sge = static_cast<uint32_t>(config.maxSendSge);
  init.cap.max_recv_sge = static_cast<uint32_t>(config.maxRecvSge);
  init.cap.max_inline_data = static_cast<uint32_t>(config.maxInlineData);
  errno = 0;
  qp = api.createQp(pd.Pd(), &init);
  if (qp == nullptr) {
    int err = errno;
    Release();
    ThrowVerbs("ibv_create_qp", dev, port, err);
  }
  local.qpn = qp->qp_num;
  MORI_DEBUG(kLogRdma, "%s port %d: RC QP %u created (%s, gid index %d, psn %u)", dev.c_str(), port,
             local.qpn, ethernet ? "RoCE" : "IB", local.gidIndex, local.psn);
}

void RdmaRcQueuePair::Release() noexcept {
  const IbverbsApi& api = pd.Api();
  if (qp != nullptr) {
    int rc = api.destroyQp(qp);
    if (rc != 0) {
      MORI_WARN(kLogRdma, "ibv_destroy_qp failed on %s port %d: %s", pd.DeviceName().c_str(),
                config.portNum, ErrText(RcErrno(rc)).c_str());
    }
    qp = nullptr;
  }
  if (cq != nullptr) {
    int rc = api.destroyCq(cq);
    if (rc != 0) {
      MORI_WARN(kLogRdma, "ibv_destroy_cq failed on %s port %d: %s", pd.DeviceName().c_str(),
                config.portNum, ErrText(RcErrno(rc)).c_str());
    }
    cq = nullptr;
  }
}

RdmaRcQueuePair::~RdmaRcQueuePair() { Release(); }

void RdmaRcQueuePair::ModifyOrThrow(void* attrPtr, int mask, const char* transition) {
  auto* attr = static_cast<ibv_qp_attr*>(attrPtr);
  int rc = pd.Api().modifyQp(qp, attr, mask);
  if (rc != 0) {
    std::string call = std::string("ibv_modify_qp(") + transition + ")";
    ThrowVerbs(call.c_str(), pd.DeviceName(), config.portNum, RcErrno(rc));
  }
}

void RdmaRcQueuePair::Connect(const RdmaConnectionInfo& remote) {
  const std::string& dev = pd.DeviceName();
  MORI_ENSURE(!connected, InvalidUsageError, "RC QP %u on %s port %d is already connected",
              local.qpn, dev.c_str(), config.portNum);
  if (remote.qpn == 0 || remote.qpn > 0xffffffu || remote.psn > 0xffffffu ||
      remote.mtu < IBV_MTU_256 || remote.mtu > IBV_MTU_4096 || (!ethernet && remote.lid == 0)) {
    MORI_THROW(RemoteError,
               "RC QP %u on %s port %d: bad remote connection data (qpn %u, psn %u, mtu %u, "
               "lid %u)",
               local.qpn, dev.c_str(), config.portNum, remote.qpn, remote.psn, remote.mtu,
               remote.lid);
  }

  // RESET -> INIT
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_INIT;
  attr.pkey_index = 0;
  attr.port_num = local.portNum;
  attr.qp_access_flags = RdmaMemoryRegionAccessFlags();
  ModifyOrThrow(&attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS,
                "INIT");

  // INIT -> RTR
  attr = ibv_qp_attr{};
  attr.qp_state = IBV_QPS_RTR;
  attr.path_mtu = static_cast<ibv_mtu>(remote.mtu < local.mtu ? remote.mtu : local.mtu);
  attr.dest_qp_num = remote.qpn;
  attr.rq_psn = remote.psn;
  attr.max_dest_rd_atomic = static_cast<uint8_t>(config.maxDestRdAtomic);
  attr.min_rnr_timer = static_cast<uint8_t>(config.minRnrTimer);
  attr.ah_attr.port_num = local.portNum;
  attr.ah_attr.sl = 0;
  attr.ah_attr.src_path_bits = 0;
  if (ethernet) {
    attr.ah_attr.is_global = 1;
    attr.ah_attr.dlid = 0;
    std::memcpy(attr.ah_attr.grh.dgid.raw, remote.gid, 16);
    attr.ah_attr.grh.sgid_index = static_cast<uint8_t>(local.gidIndex);
    attr.ah_attr.grh.hop_limit = 64;
    attr.ah_attr.grh.flow_label = 0;
    attr.ah_attr.grh.traffic_class = 0;
  } else {
    attr.ah_attr.is_global = 0;
    attr.ah_attr.dlid = remote.lid;
  }
  ModifyOrThrow(&attr,
                IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                    IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER,
                "RTR");

  // RTR -> RTS
  attr = ibv_qp_attr{};
  attr.qp_state = IBV_QPS_RTS;
  attr.sq_psn = local.psn;
  attr.timeout = 20;
  attr.retry_cnt = 7;
  attr.rnr_retry = 7;
  attr.max_rd_atomic = static_cast<uint8_t>(config.maxRdAtomic);
  ModifyOrThrow(&attr,
                IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                    IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC,
                "RTS");
  connected = true;
  MORI_DEBUG(kLogRdma, "%s port %d: RC QP %u connected to QP %u", dev.c_str(), config.portNum,
             local.qpn, remote.qpn);
}

#else  // !MORI_HAVE_VERBS_H: every constructor reports why.

namespace {
[[noreturn]] void NoVerbs() {
  MORI_THROW(SystemError,
             "RDMA set-up impossible: this mori was built without the rdma-core headers");
}
}  // namespace

RdmaProtectionDomain::RdmaProtectionDomain(const std::string& deviceName)
    : RdmaProtectionDomain(LoadedApi(), deviceName) {}
RdmaProtectionDomain::RdmaProtectionDomain(const IbverbsApi& apiRef, const std::string& name)
    : api(&apiRef), deviceName(name) {
  NoVerbs();
}
RdmaProtectionDomain::~RdmaProtectionDomain() = default;
int RdmaMemoryRegionAccessFlags() { return 1 | 2 | 4 | 8; }
RdmaMemoryRegion::RdmaMemoryRegion(const RdmaProtectionDomain& pdRef, void*, size_t len, int,
                                   uint64_t)
    : pd(pdRef), length(len) {
  NoVerbs();
}
RdmaMemoryRegion::~RdmaMemoryRegion() = default;
uint32_t RdmaMemoryRegion::Lkey() const { return 0; }
uint32_t RdmaMemoryRegion::Rkey() const { return 0; }
uintptr_t RdmaMemoryRegion::Addr() const { return 0; }
RdmaRcQueuePair::RdmaRcQueuePair(const RdmaProtectionDomain& pdRef, const RdmaQpConfig& cfg)
    : pd(pdRef), config(cfg) {
  NoVerbs();
}
RdmaRcQueuePair::~RdmaRcQueuePair() = default;
void RdmaRcQueuePair::ModifyOrThrow(void*, int, const char*) { NoVerbs(); }
void RdmaRcQueuePair::Release() noexcept {}
void RdmaRcQueuePair::Connect(const RdmaConnectionInfo&) { NoVerbs(); }

#endif  // MORI_HAVE_VERBS_H

}  // namespace mori::application

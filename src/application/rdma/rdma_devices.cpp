#include "mori/application/rdma/rdma_devices.hpp"

#include <arpa/inet.h>
#include <limits.h>
#include <stdlib.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "mori/application/rdma/device_filter.hpp"
#include "mori/application/rdma/ibverbs_loader.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/logging.hpp"

#include "verbs_headers.hpp"

namespace mori::application {
namespace {

constexpr const char* kSysfsClassDir = "/sys/class/infiniband";
// GID tables on RoCE ports hold up to a few hundred entries; bound the scan all the same.
constexpr int kMaxGidsScanned = 1024;

std::string ReadFirstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in.good() || !std::getline(in, line)) return "";
  while (!line.empty() && (line.back() == '\n' || line.back() == '\r' || line.back() == ' ')) {
    line.pop_back();
  }
  return line;
}

#if MORI_HAVE_VERBS_H
const char* PortStateName(int state) {
  switch (state) {
    case IBV_PORT_NOP: return "NOP";
    case IBV_PORT_DOWN: return "DOWN";
    case IBV_PORT_INIT: return "INIT";
    case IBV_PORT_ARMED: return "ARMED";
    case IBV_PORT_ACTIVE: return "ACTIVE";
    case IBV_PORT_ACTIVE_DEFER: return "ACTIVE_DEFER";
  }
  return "UNKNOWN";
}

int MtuBytes(int mtu) { return mtu >= IBV_MTU_256 && mtu <= IBV_MTU_4096 ? 128 << mtu : 0; }

RdmaLinkLayer LinkLayerOf(uint8_t l) {
  if (l == IBV_LINK_LAYER_ETHERNET) return RdmaLinkLayer::kEthernet;
  // Old kernels report UNSPECIFIED for InfiniBand ports.
  if (l == IBV_LINK_LAYER_INFINIBAND || l == IBV_LINK_LAYER_UNSPECIFIED) {
    return RdmaLinkLayer::kInfiniBand;
  }
  return RdmaLinkLayer::kUnspecified;
}

const char* GidTypeName(uint32_t t) {
  switch (t) {
    case IBV_GID_TYPE_IB: return "IB";
    case IBV_GID_TYPE_ROCE_V1: return "RoCE v1";
    case IBV_GID_TYPE_ROCE_V2: return "RoCE v2";
  }
  return "";
}

bool IsZero(const uint8_t* raw) {
  for (int i = 0; i < 16; i++) {
    if (raw[i] != 0) return false;
  }
  return true;
}

std::string GidText(const uint8_t* raw) {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (inet_ntop(AF_INET6, raw, buf, sizeof(buf)) == nullptr) return "";
  return buf;
}

// Configured GIDs of one port, with their type when the library or sysfs says.
std::vector<RdmaGidInfo> QueryGids(const IbverbsApi& api, ibv_context* ctx,
                                   const std::string& sysfsClassDir, const std::string& dev,
                                   int port, int tableLen) {
  std::vector<RdmaGidInfo> gids;
  int n = tableLen < kMaxGidsScanned ? tableLen : kMaxGidsScanned;
  for (int i = 0; i < n; i++) {
    RdmaGidInfo g;
    g.index = i;
    bool have = false;
    if (api.queryGidEx != nullptr) {
      ibv_gid_entry entry{};
      if (api.queryGidEx(ctx, static_cast<uint32_t>(port), static_cast<uint32_t>(i), &entry, 0,
                         sizeof(entry)) == 0) {
        std::memcpy(g.raw, entry.gid.raw, 16);
        g.type = GidTypeName(entry.gid_type);
        have = true;
      }
    }
    if (!have) {
      ibv_gid gid{};
      if (api.queryGid(ctx, static_cast<uint8_t>(port), i, &gid) != 0) continue;
      std::memcpy(g.raw, gid.raw, 16);
      std::string t = ReadFirstLine(sysfsClassDir + "/" + dev + "/ports/" + std::to_string(port) +
                                    "/gid_attrs/types/" + std::to_string(i));
      g.type = t == "RoCE v2" ? "RoCE v2" : (t == "IB/RoCE v1" ? "RoCE v1" : "");
    }
    if (IsZero(g.raw)) continue;
    g.text = GidText(g.raw);
    gids.push_back(g);
  }
  return gids;
}

// Opens one device and fills its ports. Returns false with *why set when it cannot be queried.
bool QueryDevice(const IbverbsApi& api, ibv_device* device, const std::string& sysfsClassDir,
                 RdmaDeviceInfo* info, std::string* why) {
  ibv_context* ctx = api.openDevice(device);
  if (ctx == nullptr) {
    int err = errno;
    *why = core::StrFormat("ibv_open_device failed: %s", std::strerror(err));
    return false;
  }
  ibv_device_attr attr{};
  int rc = api.queryDevice(ctx, &attr);
  if (rc != 0) {
    *why = core::StrFormat("ibv_query_device failed: %s", std::strerror(rc > 0 ? rc : errno));
    api.closeDevice(ctx);
    return false;
  }
  info->vendorId = attr.vendor_id;
  info->vendorPartId = attr.vendor_part_id;
  info->firmware = attr.fw_ver;
  for (int p = 1; p <= attr.phys_port_cnt; p++) {
    ibv_port_attr pa{};
    RdmaPortInfo port;
    port.port = p;
    int prc = IbvQueryPort(api, ctx, static_cast<uint8_t>(p), &pa);
    if (prc != 0) {
      MORI_WARN(kLogRdma, "%s port %d: ibv_query_port failed: %s", info->name.c_str(), p,
                std::strerror(prc > 0 ? prc : errno));
      port.stateName = "UNKNOWN";
      info->ports.push_back(port);
      continue;
    }
    port.state = pa.state;
    port.stateName = PortStateName(pa.state);
    port.linkLayer = LinkLayerOf(pa.link_layer);
    port.activeMtu = MtuBytes(pa.active_mtu);
    port.lid = pa.lid;
    port.gidTableLen = pa.gid_tbl_len;
    port.gids = QueryGids(api, ctx, sysfsClassDir, info->name, p, pa.gid_tbl_len);
    info->ports.push_back(port);
  }
  api.closeDevice(ctx);
  return true;
}
#endif  // MORI_HAVE_VERBS_H

}  // namespace

const char* RdmaLinkLayerName(RdmaLinkLayer l) {
  switch (l) {
    case RdmaLinkLayer::kInfiniBand: return "IB";
    case RdmaLinkLayer::kEthernet: return "Ethernet";
    case RdmaLinkLayer::kUnspecified: break;
  }
  return "unspecified";
}

bool RdmaPortInfo::Active() const {
#if MORI_HAVE_VERBS_H
  return state == IBV_PORT_ACTIVE;
#else
  return state == 4;  // IBV_PORT_ACTIVE
#endif
}

void ReadRdmaSysfsInfo(const std::string& sysfsClassDir, const std::string& name,
                       std::string* pciBusId, int* numaNode) {
  std::string devLink = sysfsClassDir + "/" + name + "/device";
  pciBusId->clear();
  *numaNode = -1;
  char resolved[PATH_MAX];
  if (realpath(devLink.c_str(), resolved) != nullptr) {
    std::string r(resolved);
    size_t slash = r.find_last_of('/');
    *pciBusId = slash == std::string::npos ? r : r.substr(slash + 1);
  }
  std::string numa = ReadFirstLine(devLink + "/numa_node");
  if (!numa.empty()) {
    char* end = nullptr;
    long v = std::strtol(numa.c_str(), &end, 10);
    if (end != numa.c_str() && *end == '\0' && v >= 0) *numaNode = static_cast<int>(v);
  }
}

std::vector<RdmaDeviceInfo> DiscoverRdmaDevices(std::string* whyEmpty) {
  return DiscoverRdmaDevices(core::Env().rdmaDevices, whyEmpty);
}

std::vector<RdmaDeviceInfo> DiscoverRdmaDevices(const std::string& filterText,
                                                std::string* whyEmpty) {
  std::string why;
  const IbverbsApi* api = Ibverbs(&why);
  if (api == nullptr) {
    MORI_INFO(kLogRdma, "no RDMA devices: %s", why.c_str());
    if (whyEmpty != nullptr) *whyEmpty = why;
    return {};
  }
  return DiscoverRdmaDevicesWith(*api, filterText, kSysfsClassDir, whyEmpty);
}

std::vector<RdmaDeviceInfo> DiscoverRdmaDevicesWith(const IbverbsApi& apiRef,
                                                    const std::string& filterText,
                                                    const std::string& sysfsClassDir,
                                                    std::string* whyEmpty) {
  const IbverbsApi* api = &apiRef;
  std::vector<RdmaDeviceInfo> result;
  std::string why;
  auto finish = [&](const std::string& reason) {
    if (result.empty()) {
      MORI_INFO(kLogRdma, "no RDMA devices: %s", reason.c_str());
      if (whyEmpty != nullptr) *whyEmpty = reason;
    }
    return result;
  };
#if !MORI_HAVE_VERBS_H
  (void)api;
  (void)sysfsClassDir;
  why = "this mori was built without the rdma-core headers";
  return finish(why);
#else
  int count = 0;
  errno = 0;
  ibv_device** list = api->getDeviceList(&count);
  if (list == nullptr) {
    int err = errno;
    if (err == ENOSYS) {
      why =
          "the kernel provides no RDMA (ib_uverbs) support "
          "(ibv_get_device_list: Function not implemented)";
    } else {
      why = core::StrFormat("ibv_get_device_list failed: %s",
                            err != 0 ? std::strerror(err) : "no error code");
    }
    return finish(why);
  }
  std::vector<std::string> names;
  for (int i = 0; i < count; i++) {
    const char* n = api->getDeviceName(list[i]);
    names.push_back(n != nullptr ? n : "");
  }
  if (names.empty()) {
    api->freeDeviceList(list);
    why = "libibverbs lists no devices";
    return finish(why);
  }

  RdmaDeviceFilter filter = ParseRdmaDeviceFilter(filterText);
  std::vector<std::string> unmatched;
  std::vector<std::string> kept = ApplyRdmaDeviceFilter(filter, names, &unmatched);
  if (!unmatched.empty()) {
    MORI_WARN(kLogRdma, "MORI_RDMA_DEVICES=\"%s\": %s match%s no device; devices present: %s",
              filterText.c_str(), JoinDeviceNames(unmatched).c_str(),
              unmatched.size() == 1 ? "es" : "", JoinDeviceNames(names).c_str());
  }
  if (kept.empty()) {
    api->freeDeviceList(list);
    why = core::StrFormat("MORI_RDMA_DEVICES=\"%s\" leaves none of the devices present: %s",
                          filterText.c_str(), JoinDeviceNames(names).c_str());
    return finish(why);
  }

  std::vector<std::string> skipped;  // "name (reason)"
  for (const std::string& name : kept) {
    ibv_device* device = nullptr;
    for (int i = 0; i < count; i++) {
      if (names[i] == name) device = list[i];
    }
    RdmaDeviceInfo info;
    info.name = name;
    std::string err;
    if (!QueryDevice(*api, device, sysfsClassDir, &info, &err)) {
      MORI_WARN(kLogRdma, "RDMA device %s skipped: %s", name.c_str(), err.c_str());
      skipped.push_back(name + " (" + err + ")");
      continue;
    }
    bool active = false;
    for (const RdmaPortInfo& p : info.ports) active = active || p.Active();
    if (!active) {
      std::string states;
      for (const RdmaPortInfo& p : info.ports) {
        if (!states.empty()) states += ", ";
        states += "port " + std::to_string(p.port) + " " + p.stateName;
      }
      MORI_INFO(kLogRdma, "RDMA device %s skipped: no ACTIVE port (%s)", name.c_str(),
                states.c_str());
      skipped.push_back(name + " (no ACTIVE port: " + (states.empty() ? "no ports" : states) + ")");
      continue;
    }
    ReadRdmaSysfsInfo(sysfsClassDir, name, &info.pciBusId, &info.numaNode);
    result.push_back(std::move(info));
  }
  api->freeDeviceList(list);
  std::string joined;
  for (const std::string& s : skipped) joined += (joined.empty() ? "" : "; ") + s;
  why = "no usable RDMA device: " + joined;
  return finish(why);
#endif
}

}  // namespace mori::application

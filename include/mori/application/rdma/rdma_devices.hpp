// RDMA device discovery: every ibverbs device with at least one ACTIVE port, filtered by
// MORI_RDMA_DEVICES (see device_filter.hpp). Uses libibverbs through the lazy loader, so it works,
// returning an empty list with a reason, on hosts without rdma-core or without RDMA devices.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mori::application {

enum class RdmaLinkLayer { kUnspecified, kInfiniBand, kEthernet };
const char* RdmaLinkLayerName(RdmaLinkLayer l);  // "IB", "Ethernet", "unspecified"

struct RdmaGidInfo {
  int index = 0;
  uint8_t raw[16] = {};
  std::string text;  // IPv6 notation; an IPv4-mapped GID reads "::ffff:a.b.c.d"
  std::string type;  // "IB", "RoCE v1", "RoCE v2", or "" when the library cannot say
};

struct RdmaPortInfo {
  int port = 0;           // 1-based, as verbs numbers ports
  int state = 0;          // enum ibv_port_state value
  std::string stateName;  // "ACTIVE", "DOWN", "INIT", "ARMED", "ACTIVE_DEFER", "NOP"
  RdmaLinkLayer linkLayer = RdmaLinkLayer::kUnspecified;
  int activeMtu = 0;  // bytes (256..4096); 0 when unknown
  uint16_t lid = 0;   // InfiniBand local identifier (0 on Ethernet)
  int gidTableLen = 0;
  std::vector<RdmaGidInfo> gids;  // configured (non-zero) entries only, by index
  bool Active() const;
};

struct RdmaDeviceInfo {
  std::string name;       // e.g. "mlx5_0"
  std::string pciBusId;   // e.g. "0000:17:00.0"; "" when sysfs does not say
  int numaNode = -1;      // -1: unknown / no NUMA
  uint32_t vendorId = 0;  // PCI vendor (0x02c9 Mellanox/NVIDIA, 0x14e4 Broadcom, ...)
  uint32_t vendorPartId = 0;
  std::string firmware;
  std::vector<RdmaPortInfo> ports;  // every port, active or not
};

// Devices mori may use, in MORI_RDMA_DEVICES order (include list) or verbs order. Never throws for
// a missing library or device (an invalid env value elsewhere in the table still raises, as Env()
// does). An empty result comes with the reason in *whyEmpty (if given), e.g.
// "libibverbs not available: ..." or "no RDMA devices: libibverbs lists none".
// A filter name matching no device is a WARN listing the devices that exist.
std::vector<RdmaDeviceInfo> DiscoverRdmaDevices(std::string* whyEmpty);
// Same with the filter text given instead of read from MORI_RDMA_DEVICES (tests, tools).
std::vector<RdmaDeviceInfo> DiscoverRdmaDevices(const std::string& filterText,
                                                std::string* whyEmpty);

struct IbverbsApi;
// Discovery through a given verbs table and sysfs class directory (tests use a fake libibverbs
// and a temporary sysfs tree; the functions above pass Ibverbs() and "/sys/class/infiniband").
std::vector<RdmaDeviceInfo> DiscoverRdmaDevicesWith(const IbverbsApi& api,
                                                    const std::string& filterText,
                                                    const std::string& sysfsClassDir,
                                                    std::string* whyEmpty);

// sysfs facts of one device under `sysfsClassDir` (normally "/sys/class/infiniband"): the PCI bus
// id is the last component of the resolved `<dir>/<name>/device` link, the NUMA node is
// `<dir>/<name>/device/numa_node`. Missing entries leave "" / -1. Exposed for tests.
void ReadRdmaSysfsInfo(const std::string& sysfsClassDir, const std::string& name,
                       std::string* pciBusId, int* numaNode);

}  // namespace mori::application

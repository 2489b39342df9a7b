// GPU <-> NIC affinity: which RDMA device a GPU should use. A pure function of the devices found
// by discovery and the sysfs PCI tree, so tests run it on a temporary tree.
//
// Rule, in order: the NIC whose PCIe path shares the most components with the GPU's (the
// resolved `/sys/bus/pci/devices/<bdf>` links: devices behind one switch share the switch's
// bridges, devices under different root complexes share only `/sys/devices`); then a NIC on the
// GPU's NUMA node; then the first device in discovery order (MORI_RDMA_DEVICES order when that
// lists devices). A GPU or NIC whose sysfs entry is missing shares nothing.
#pragma once

#include <string>
#include <vector>

#include "mori/application/rdma/rdma_devices.hpp"

namespace mori::application {

// Lower-case "dddd:bb:dd.f". Runtimes print the domain with 4 or 8 digits ("00000000:17:00.0");
// leading zero digits beyond 4 are dropped. Other text is returned lower-cased.
std::string NormalizePciBusId(const std::string& busId);

// Components ("sys", "devices", "pci0000:10", "0000:10:01.0", ...) of the resolved
// `<pciDevicesDir>/<busId>` path; empty when it does not resolve.
std::vector<std::string> PciDevicePath(const std::string& pciDevicesDir, const std::string& busId);

// `<pciDevicesDir>/<busId>/numa_node`, -1 when missing or unknown.
int PciDeviceNumaNode(const std::string& pciDevicesDir, const std::string& busId);

struct NicChoice {
  int index = -1;            // into the devices given; -1 when there are none
  int sharedComponents = 0;  // path components the GPU and the NIC share
  bool sameNuma = false;     // both NUMA nodes known and equal
  int gpuNuma = -1;
  std::string reason;  // e.g. "shares 5 PCIe path components", "same NUMA node 1", "first"
};

// The NIC for the GPU at `gpuBusId` among `devices` (their pciBusId / numaNode as discovery
// reports them). `pciDevicesDir` is normally "/sys/bus/pci/devices".
NicChoice ChooseNicForGpu(const std::string& gpuBusId, const std::vector<RdmaDeviceInfo>& devices,
                          const std::string& pciDevicesDir = "/sys/bus/pci/devices");

}  // namespace mori::application

#include "mori/application/rdma/nic_affinity.hpp"

#include <limits.h>
#include <stdlib.h>

#include <cctype>
#include <fstream>
#include <memory>

#include "mori/core/errors.hpp"

namespace mori::application {

std::string NormalizePciBusId(const std::string& busId) {
  std::string s;
  for (char c : busId) {
    if (!std::isspace(static_cast<unsigned char>(c))) {
      s += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    }
  }
  // "dom:bb:dd.f": shorten a zero-padded domain longer than 4 digits.
  const size_t colon = s.find(':');
  if (colon != std::string::npos && colon > 4 && s.find(':', colon + 1) != std::string::npos) {
    size_t drop = 0;
    while (drop < colon - 4 && s[drop] == '0') drop++;
    s.erase(0, drop);
  }
  return s;
}

std::vector<std::string> PciDevicePath(const std::string& pciDevicesDir, const std::string& busId) {
  std::vector<std::string> parts;
  if (busId.empty()) return parts;
  const std::string link = pciDevicesDir + "/" + NormalizePciBusId(busId);
  std::unique_ptr<char, decltype(&free)> resolved(realpath(link.c_str(), nullptr), &free);
  if (!resolved) return parts;
  std::string p(resolved.get());
  size_t pos = 0;
  while (pos < p.size()) {
    size_t next = p.find('/', pos);
    if (next == std::string::npos) next = p.size();
    if (next > pos) parts.push_back(p.substr(pos, next - pos));
    pos = next + 1;
  }
  return parts;
}

int PciDeviceNumaNode(const std::string& pciDevicesDir, const std::string& busId) {
  if (busId.empty()) return -1;
  std::ifstream f(pciDevicesDir + "/" + NormalizePciBusId(busId) + "/numa_node");
  int node = -1;
  if (!(f >> node)) return -1;
  return node < 0 ? -1 : node;
}

NicChoice ChooseNicForGpu(const std::string& gpuBusId, const std::vector<RdmaDeviceInfo>& devices,
                          const std::string& pciDevicesDir) {
  NicChoice best;
  best.gpuNuma = PciDeviceNumaNode(pciDevicesDir, gpuBusId);
  if (devices.empty()) {
    best.reason = "no RDMA device";
    return best;
  }
  const std::vector<std::string> gpuPath = PciDevicePath(pciDevicesDir, gpuBusId);
  std::vector<int> shared(devices.size(), 0);
  std::vector<bool> sameNuma(devices.size(), false);
  for (size_t i = 0; i < devices.size(); i++) {
    const std::vector<std::string> nicPath = PciDevicePath(pciDevicesDir, devices[i].pciBusId);
    while (static_cast<size_t>(shared[i]) < gpuPath.size() &&
           static_cast<size_t>(shared[i]) < nicPath.size() &&
           gpuPath[shared[i]] == nicPath[shared[i]]) {
      shared[i]++;
    }
    sameNuma[i] = best.gpuNuma >= 0 && devices[i].numaNode == best.gpuNuma;
    if (best.index < 0 || shared[i] > best.sharedComponents ||
        (shared[i] == best.sharedComponents && sameNuma[i] && !best.sameNuma)) {
      best.index = static_cast<int>(i);
      best.sharedComponents = shared[i];
      best.sameNuma = sameNuma[i];
    }
  }
  // Which rule decided: the path when some other device is farther, else NUMA, else the order.
  bool pathDecided = false, numaDecided = false;
  for (size_t i = 0; i < devices.size(); i++) {
    if (static_cast<int>(i) == best.index) continue;
    if (shared[i] < best.sharedComponents) {
      pathDecided = true;
    } else if (best.sameNuma && !sameNuma[i]) {
      numaDecided = true;
    }
  }
  if (pathDecided) {
    best.reason =
        core::StrFormat("closest on PCIe (%d shared path components)", best.sharedComponents);
  } else if (numaDecided) {
    best.reason = core::StrFormat("same NUMA node %d", best.gpuNuma);
  } else {
    best.reason = devices.size() == 1 ? "only device" : "first in device order";
  }
  return best;
}

}  // namespace mori::application

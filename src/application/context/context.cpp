#include "mori/application/context/context.hpp"

#include <unistd.h>

#include <cstring>
#include <fstream>
#include <map>
#include <utility>

#include "mori/core/env.hpp"
#include "mori/core/gpu_check.hpp"
#include "mori/core/logging.hpp"

namespace mori::application {

std::string LocalNodeId() {
  const std::string& forced = core::Env().nodeId;
  if (!forced.empty()) return forced;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (f && std::getline(f, id) && !id.empty()) return id;
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return host;
}

namespace {
template <size_t N>
void CopyTrunc(char (&dst)[N], const std::string& src) {
  std::memset(dst, 0, N);
  std::strncpy(dst, src.c_str(), N - 1);
}
}  // namespace

Context::Context(BootstrapNetwork& boot, int device)
    : rank(boot.Rank()), worldSize(boot.WorldSize()) {
  PeerRecord self{};
  CopyTrunc(self.nodeId, LocalNodeId());
  MORI_CHECK_GPU(gpuDeviceGetPCIBusId(self.busId, sizeof(self.busId), device));
  self.pid = static_cast<int32_t>(getpid());
  self.device = device;
  const int64_t gpuPerNode = core::Env().gpuPerNode;
  MORI_ENSURE(gpuPerNode >= 0, InvalidUsageError, "MORI_GPU_PER_NODE must be >= 0, got %lld",
              static_cast<long long>(gpuPerNode));
  self.syntheticNode = gpuPerNode > 0 ? static_cast<int32_t>(rank / gpuPerNode) : -1;

  peers.resize(worldSize);
  boot.Allgather(&self, peers.data(), sizeof(PeerRecord));
  NumberNodes();

  sameNode.assign(worldSize, false);
  canP2P.assign(worldSize, false);
  sameGpu.assign(worldSize, false);
  transport.assign(worldSize, TransportType::kNone);
  const bool disableP2P = core::Env().disableP2P;
  for (int pe = 0; pe < worldSize; pe++) {
    const PeerRecord& p = peers[pe];
    const bool same = nodeOf[pe] == nodeOf[rank];
    sameNode[pe] = same;
    if (pe == rank) {
      canP2P[pe] = true;
      sameGpu[pe] = true;
      transport[pe] = TransportType::kSelf;
      continue;
    }
    if (same) {
      int peerDevice = -1;
      if (gpuDeviceGetByPCIBusId(&peerDevice, p.busId) == gpuSuccess) {
        int can = 0;
        if (peerDevice == device) {
          can = 1;  // two PEs on one GPU (tests): plain device memory
          sameGpu[pe] = true;
        } else {
          MORI_CHECK_GPU(gpuDeviceCanAccessPeer(&can, device, peerDevice));
        }
        canP2P[pe] = can != 0;
      } else {
        (void)gpuGetLastError();  // peer GPU not visible to this process
      }
    }
    if (canP2P[pe] && !disableP2P)
      transport[pe] = TransportType::kP2P;
    else
      transport[pe] = TransportType::kRdma;
    MORI_DEBUG(kLogTopo, "pe %d: node %s bus %s same-node %d p2p %d -> %s", pe, p.nodeId, p.busId,
               (int)same, (int)canP2P[pe], TransportTypeName(transport[pe]));
  }
  MORI_INFO(kLogTopo, "rank %d/%d: local rank %d of %d on node %d of %d (%s), GPU %s", rank,
            worldSize, localRank, localSize, nodeOf[rank], numNodes, self.nodeId, self.busId);
}

void Context::NumberNodes() {
  std::map<std::pair<std::string, int32_t>, int32_t> nodeIndex;  // node key -> node number
  std::vector<int32_t> nodeSize;
  nodeOf.assign(worldSize, -1);
  localRankOf.assign(worldSize, -1);
  for (int pe = 0; pe < worldSize; pe++) {
    const PeerRecord& p = peers[pe];
    const std::string id(p.nodeId, strnlen(p.nodeId, sizeof(p.nodeId)));
    auto it =
        nodeIndex
            .emplace(std::make_pair(id, p.syntheticNode), static_cast<int32_t>(nodeSize.size()))
            .first;
    if (it->second == static_cast<int32_t>(nodeSize.size())) nodeSize.push_back(0);
    nodeOf[pe] = it->second;
    localRankOf[pe] = nodeSize[it->second]++;
  }
  numNodes = static_cast<int>(nodeSize.size());
  localRank = localRankOf[rank];
  localSize = nodeSize[nodeOf[rank]];
}

}  // namespace mori::application

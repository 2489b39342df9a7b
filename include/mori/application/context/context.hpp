// Topology of the job as seen from this PE: which PEs share the node, which are reachable by
// P2P load/store, and the transport used for each PE. Built collectively at shmem init.
//
// A node is the set of PEs with the same node identity (LocalNodeId()) and the same synthetic node
// (rank / MORI_GPU_PER_NODE when that is set). Every PE computes the same numbering from the same
// allgathered records: nodes are numbered 0.. in the order of their lowest PE, and a PE's local
// rank is its index among its node's PEs in PE order. Same-node peers are reached by P2P when the
// GPUs allow it (and MORI_DISABLE_P2P is off), otherwise by RDMA; other nodes always by RDMA.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mori/application/bootstrap/bootstrap.hpp"
#include "mori/application/transport_types.hpp"

namespace mori::application {

struct PeerRecord {
  char nodeId[64];  // MORI_NODE_ID, kernel boot_id or host name (truncated)
  char busId[32];   // PCI bus id of the PE's GPU
  int32_t pid;
  int32_t device;         // the PE's device ordinal in its own process
  int32_t syntheticNode;  // rank / MORI_GPU_PER_NODE when set, else -1
};

class Context {
 public:
  // Collective over `boot`. `device` is this PE's current GPU ordinal.
  Context(BootstrapNetwork& boot, int device);

  int Rank() const { return rank; }
  int WorldSize() const { return worldSize; }
  int LocalRank() const { return localRank; }  // index among same-node PEs
  int LocalSize() const { return localSize; }  // number of same-node PEs
  int NumNodes() const { return numNodes; }
  int NodeOf(int pe) const { return nodeOf[pe]; }            // pe in [0, WorldSize())
  int LocalRankOf(int pe) const { return localRankOf[pe]; }  // pe's index on its node
  const std::vector<int32_t>& NodesOfPes() const { return nodeOf; }
  const std::vector<int32_t>& LocalRanksOfPes() const { return localRankOf; }
  bool SameNode(int pe) const { return sameNode[pe]; }
  bool CanP2P(int pe) const { return canP2P[pe]; }
  bool SameGpu(int pe) const { return sameGpu[pe]; }  // pe runs on this PE's GPU (itself too)
  TransportType Transport(int pe) const { return transport[pe]; }
  const std::vector<TransportType>& Transports() const { return transport; }
  const PeerRecord& Peer(int pe) const { return peers[pe]; }

 private:
  // Fills nodeOf, localRankOf, numNodes, localRank and localSize from `peers`.
  void NumberNodes();

  int rank;
  int worldSize;
  int localRank = 0;
  int localSize = 0;
  int numNodes = 0;
  std::vector<PeerRecord> peers;
  std::vector<int32_t> nodeOf;       // [worldSize]
  std::vector<int32_t> localRankOf;  // [worldSize]
  std::vector<bool> sameNode;
  std::vector<bool> canP2P;
  std::vector<bool> sameGpu;
  std::vector<TransportType> transport;
};

// This process's node identity: MORI_NODE_ID, else the kernel boot_id, else the host name.
std::string LocalNodeId();

}  // namespace mori::application

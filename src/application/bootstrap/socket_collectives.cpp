// The collectives of SocketBootstrapNetwork (socket_network.hpp): Allgather (ring), AllToAll
// (pairwise or Bruck) and Barrier (dissemination). Each call takes the next sequence number;
// every frame carries it with the collective and the step, so ranks that call different
// collectives, in a different order or with different sizes fail with RemoteError.
#include <cstdint>
#include <cstring>
#include <vector>

#include "mori/core/errors.hpp"
#include "socket_network.hpp"

namespace mori::application {

using detail::FrameType;

void SocketBootstrapNetwork::Allgather(const void* send, void* recv, size_t bytesPerRank) {
  Impl& m = *impl;
  m.CheckUsable("Allgather");
  const size_t n = static_cast<size_t>(m.worldSize);
  MORI_ENSURE(bytesPerRank == 0 || (send != nullptr && recv != nullptr), InvalidUsageError,
              "Allgather: null buffer with %zu bytes per rank", bytesPerRank);
  MORI_ENSURE(bytesPerRank <= SIZE_MAX / n, InvalidUsageError,
              "Allgather: %zu bytes per rank overflows", bytesPerRank);
  m.seq++;
  auto* out = static_cast<uint8_t*>(recv);
  if (bytesPerRank)
    std::memmove(out + static_cast<size_t>(m.rank) * bytesPerRank, send, bytesPerRank);
  if (m.worldSize == 1) return;
  m.Guarded([&] {
    int next = (m.rank + 1) % m.worldSize;
    int prev = (m.rank - 1 + m.worldSize) % m.worldSize;
    for (int s = 0; s < m.worldSize - 1; s++) {
      size_t sendIdx = static_cast<size_t>((m.rank - s + m.worldSize) % m.worldSize);
      size_t recvIdx = static_cast<size_t>((m.rank - s - 1 + 2 * m.worldSize) % m.worldSize);
      m.Step(FrameType::kAllgather, static_cast<uint32_t>(s), next, out + sendIdx * bytesPerRank,
             bytesPerRank, prev, out + recvIdx * bytesPerRank, bytesPerRank, "Allgather");
    }
  });
}

void SocketBootstrapNetwork::AllToAll(const void* send, void* recv, size_t bytesPerPeer) {
  Impl& m = *impl;
  m.CheckUsable("AllToAll");
  const size_t n = static_cast<size_t>(m.worldSize);
  MORI_ENSURE(bytesPerPeer == 0 || (send != nullptr && recv != nullptr), InvalidUsageError,
              "AllToAll: null buffer with %zu bytes per peer", bytesPerPeer);
  MORI_ENSURE(bytesPerPeer <= SIZE_MAX / n, InvalidUsageError,
              "AllToAll: %zu bytes per peer overflows", bytesPerPeer);
  m.seq++;
  const size_t total = n * bytesPerPeer;
  const auto* in = static_cast<const uint8_t*>(send);
  auto* out = static_cast<uint8_t*>(recv);
  std::vector<uint8_t> sendCopy;
  if (total && in < out + total && out < in + total) {  // overlapping buffers: keep the input
    sendCopy.assign(in, in + total);
    in = sendCopy.data();
  }
  const size_t me = static_cast<size_t>(m.rank);
  if (bytesPerPeer) std::memcpy(out + me * bytesPerPeer, in + me * bytesPerPeer, bytesPerPeer);
  if (m.worldSize == 1) return;

  bool pairwise =
      m.allToAll == SocketAllToAllAlgorithm::kPairwise ||
      (m.allToAll == SocketAllToAllAlgorithm::kAuto && m.worldSize <= kSocketPairwiseMaxWorldSize);
  m.Guarded([&] {
    if (pairwise) {
      if (!m.allPeersConnected) {
        std::vector<int> all;
        for (int p = 0; p < m.worldSize; p++) all.push_back(p);
        m.EnsureConnections(all, "AllToAll (connecting all pairs)");
        m.allPeersConnected = true;
      }
      for (int s = 1; s < m.worldSize; s++) {
        int to = (m.rank + s) % m.worldSize;
        int from = (m.rank - s + m.worldSize) % m.worldSize;
        m.Step(FrameType::kAllToAll, static_cast<uint32_t>(s), to,
               in + static_cast<size_t>(to) * bytesPerPeer, bytesPerPeer, from,
               out + static_cast<size_t>(from) * bytesPerPeer, bytesPerPeer, "AllToAll");
      }
      return;
    }
    // Bruck: block i of `work` is destined to rank (rank + i) % N. In round k every block whose
    // index has bit k set moves 2^k ranks forward; after all rounds block i came from rank - i.
    std::vector<uint8_t> work(total), packOut, packIn;
    for (size_t i = 0; i < n; i++)
      if (bytesPerPeer)
        std::memcpy(work.data() + i * bytesPerPeer, in + ((me + i) % n) * bytesPerPeer,
                    bytesPerPeer);
    uint32_t round = 0;
    for (size_t d = 1; d < n; d <<= 1, round++) {
      std::vector<size_t> idx;
      for (size_t i = 0; i < n; i++)
        if (i & d) idx.push_back(i);
      packOut.resize(idx.size() * bytesPerPeer);
      packIn.resize(idx.size() * bytesPerPeer);
      for (size_t j = 0; j < idx.size(); j++)
        if (bytesPerPeer)
          std::memcpy(packOut.data() + j * bytesPerPeer, work.data() + idx[j] * bytesPerPeer,
                      bytesPerPeer);
      int to = static_cast<int>((me + d) % n);
      int from = static_cast<int>((me + n - d % n) % n);
      m.Step(FrameType::kAllToAll, round, to, packOut.data(), packOut.size(), from, packIn.data(),
             packIn.size(), "AllToAll");
      for (size_t j = 0; j < idx.size(); j++)
        if (bytesPerPeer)
          std::memcpy(work.data() + idx[j] * bytesPerPeer, packIn.data() + j * bytesPerPeer,
                      bytesPerPeer);
    }
    for (size_t i = 1; i < n; i++)
      if (bytesPerPeer)
        std::memcpy(out + ((me + n - i) % n) * bytesPerPeer, work.data() + i * bytesPerPeer,
                    bytesPerPeer);
  });
}

void SocketBootstrapNetwork::Barrier() {
  Impl& m = *impl;
  m.CheckUsable("Barrier");
  m.seq++;
  if (m.worldSize == 1) return;
  m.Guarded([&] {
    // Dissemination: after round k every rank has heard, transitively, from 2^(k+1) ranks.
    uint32_t round = 0;
    for (int d = 1; d < m.worldSize; d <<= 1, round++) {
      int to = (m.rank + d) % m.worldSize;
      int from = (m.rank - d + m.worldSize) % m.worldSize;
      m.Step(FrameType::kBarrier, round, to, nullptr, 0, from, nullptr, 0, "Barrier");
    }
  });
}

}  // namespace mori::application

// TCP bootstrap over IPv4. Rank 0 creates a unique id (root address + session nonce), the caller
// ships its 128 bytes to every rank by any means, and every rank constructs the network from it.
//
// Rendezvous: every rank opens its own listener, connects to the root and sends {nonce, rank, its
// listen address}; the root validates (nonce, version, world size, rank range, duplicates),
// answers each connection with an ack or a reject carrying the reason, and once all ranks arrived
// connects back to each rank to hand out the address table. Afterwards ranks talk over direct
// connections, always opened by the lower rank: the ring (r±1) and the dissemination set (r±2^k)
// at init, every pair lazily on the first pairwise all-to-all.
//
// Every wait is bounded by MORI_BOOTSTRAP_TIMEOUT seconds without progress; a timeout names the
// ranks that never arrived. Every message carries a header (collective, sequence number, step,
// source rank, length) so a mismatched or corrupted message raises RemoteError. After any error
// the network tells its peers (best effort), closes its sockets and refuses further use.
// Not thread-safe: one thread drives a network at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>

#include "mori/application/bootstrap/bootstrap.hpp"

namespace mori::application {

constexpr size_t kSocketUniqueIdBytes = 128;
constexpr uint64_t kSocketUniqueIdMagic = 0x544F4F4249524F4DULL;  // "MORIBOOT" little-endian
constexpr uint32_t kSocketUniqueIdVersion = 1;

// The opaque id rank 0 hands to every rank. Plain bytes: copy it with memcpy.
struct SocketUniqueId {
  uint64_t magic;    // kSocketUniqueIdMagic
  uint32_t version;  // kSocketUniqueIdVersion
  uint32_t ipv4;     // root listener address, network byte order
  uint16_t port;     // root listener port, network byte order
  uint16_t reserved0;
  uint32_t reserved1;
  uint64_t nonce[2];  // random per session; the root rejects peers with another nonce
  uint8_t reserved[88];
};
static_assert(sizeof(SocketUniqueId) == kSocketUniqueIdBytes, "SocketUniqueId must be 128 bytes");
static_assert(std::is_trivially_copyable<SocketUniqueId>::value,
              "SocketUniqueId is copied as bytes");

// Copies `size` bytes into an id and validates magic and version (InvalidUsageError otherwise).
SocketUniqueId SocketUniqueIdFromBytes(const void* bytes, size_t size);

enum class SocketAllToAllAlgorithm {
  kAuto,      // pairwise up to kSocketPairwiseMaxWorldSize ranks, Bruck above
  kPairwise,  // N-1 direct exchanges; opens a connection to every peer
  kBruck,     // ceil(log2 N) exchanges over the dissemination connections; bounded fd count
};
constexpr int kSocketPairwiseMaxWorldSize = 64;

struct SocketBootstrapOptions {
  SocketAllToAllAlgorithm allToAll = SocketAllToAllAlgorithm::kAuto;
};

class SocketBootstrapNetwork : public BootstrapNetwork {
 public:
  // Called on rank 0 only. Binds and listens on the root socket immediately (port chosen by the
  // kernel; address from MORI_SOCKET_IFNAME, else the first non-loopback IPv4 interface, else
  // 127.0.0.1) and keeps the listener in a process-wide registry keyed by the nonce, so that
  // rank 0's constructor in this process adopts it. A listener nobody adopts is closed when a
  // bootstrap with that id ends in this process (whatever its rank and outcome), after
  // MORI_BOOTSTRAP_TIMEOUT seconds (rank 0 then binds the id's address itself), or when more than
  // 64 are pending (the oldest first).
  static SocketUniqueId CreateUniqueId();
  // Closes the listener of an id this process created but will not use. No-op otherwise.
  static void ReleaseUniqueId(const SocketUniqueId& id);
  // Listeners of ids made in this process that are still waiting to be adopted (diagnostics).
  static size_t PendingUniqueIdCount();

  // Collective over all `worldSize` ranks: returns once the address table is known and the ring
  // is connected. Rank 0 adopts the listener of CreateUniqueId (same process) or binds the id's
  // address itself. Raises InvalidUsageError (bad arguments or id), TimeoutError (ranks missing),
  // RemoteError (rejected by the root, peer failed or closed), SystemError (socket calls).
  SocketBootstrapNetwork(const SocketUniqueId& id, int rank, int worldSize,
                         const SocketBootstrapOptions& options = {});
  ~SocketBootstrapNetwork() override;
  SocketBootstrapNetwork(const SocketBootstrapNetwork&) = delete;
  SocketBootstrapNetwork& operator=(const SocketBootstrapNetwork&) = delete;

  int Rank() const override;
  int WorldSize() const override;
  void Allgather(const void* send, void* recv, size_t bytesPerRank) override;
  void AllToAll(const void* send, void* recv, size_t bytesPerPeer) override;
  void Barrier() override;
  void Finalize() override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl;
};

}  // namespace mori::application

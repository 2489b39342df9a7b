// Bootstrap: the out-of-band collective channel used during init (exchange of addresses, IPC
// handles, keys). Not on any data path. Every wait is bounded by MORI_BOOTSTRAP_TIMEOUT and a
// timeout names the ranks that never arrived.
#pragma once

#include <cstddef>
#include <memory>

namespace mori::application {

class BootstrapNetwork {
 public:
  virtual ~BootstrapNetwork() = default;

  virtual int Rank() const = 0;
  virtual int WorldSize() const = 0;

  // recv holds WorldSize() * bytesPerRank bytes; rank r's contribution lands at r * bytesPerRank.
  virtual void Allgather(const void* send, void* recv, size_t bytesPerRank) = 0;
  // send and recv hold WorldSize() * bytesPerPeer bytes; send block p goes to rank p and arrives
  // in the receiver's recv block Rank().
  virtual void AllToAll(const void* send, void* recv, size_t bytesPerPeer) = 0;
  virtual void Barrier() = 0;
  // Release sockets/communicators. Idempotent; the destructor calls it too.
  virtual void Finalize() {}
};

}  // namespace mori::application

// SocketBootstrapNetwork: the unique id and the construction of a network (rendezvous, then the
// ring and dissemination connections). The parts of the network are in socket_network.hpp.
#include "mori/application/bootstrap/socket_bootstrap.hpp"

#include <unistd.h>

#include <chrono>
#include <cstring>
#include <random>
#include <utility>

#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/logging.hpp"
#include "socket_listener_registry.hpp"
#include "socket_network.hpp"
#include "socket_util.hpp"

namespace mori::application {

using detail::Endpoint4;
using detail::Fd;

// ---- unique id ----------------------------------------------------------------------------------

SocketUniqueId SocketUniqueIdFromBytes(const void* bytes, size_t size) {
  MORI_ENSURE(bytes != nullptr, InvalidUsageError, "socket unique id: null bytes");
  MORI_ENSURE(size == kSocketUniqueIdBytes, InvalidUsageError,
              "socket unique id: expected %zu bytes, got %zu", kSocketUniqueIdBytes, size);
  SocketUniqueId id;
  std::memcpy(&id, bytes, sizeof(id));
  MORI_ENSURE(id.magic == kSocketUniqueIdMagic, InvalidUsageError,
              "socket unique id: bad magic 0x%016llx (not made by CreateUniqueId?)",
              static_cast<unsigned long long>(id.magic));
  MORI_ENSURE(id.version == kSocketUniqueIdVersion, InvalidUsageError,
              "socket unique id: version %u, this library speaks %u", id.version,
              kSocketUniqueIdVersion);
  return id;
}

SocketUniqueId SocketBootstrapNetwork::CreateUniqueId() {
  Endpoint4 want{detail::ChooseLocalIp(core::Env().socketIfname), 0};
  Endpoint4 bound;
  Fd fd = detail::Listen(want, &bound, "CreateUniqueId (root listener)");

  SocketUniqueId id{};
  id.magic = kSocketUniqueIdMagic;
  id.version = kSocketUniqueIdVersion;
  id.ipv4 = bound.ip;
  id.port = bound.port;
  std::random_device rd;
  auto now = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  for (int i = 0; i < 2; i++) {
    uint64_t hi = rd(), lo = rd();
    id.nonce[i] =
        (hi << 32 | lo) ^ (now * 0x9E3779B97F4A7C15ULL) ^ (uint64_t(::getpid()) << (16 * i));
  }

  detail::RegisterRootListener(id.nonce, std::move(fd));
  MORI_INFO(kLogBootstrap, "created socket unique id: root listens on %s",
            bound.ToString().c_str());
  return id;
}

void SocketBootstrapNetwork::ReleaseUniqueId(const SocketUniqueId& id) {
  Fd fd = detail::TakeRootListener(id.nonce);  // closed here
}

size_t SocketBootstrapNetwork::PendingUniqueIdCount() { return detail::PendingRootListenerCount(); }

// ---- the network --------------------------------------------------------------------------------

SocketBootstrapNetwork::SocketBootstrapNetwork(const SocketUniqueId& id, int rank, int worldSize,
                                               const SocketBootstrapOptions& options)
    : impl(new Impl()) {
  MORI_ENSURE(worldSize >= 1, InvalidUsageError, "socket bootstrap: world size %d < 1", worldSize);
  MORI_ENSURE(rank >= 0 && rank < worldSize, InvalidUsageError,
              "socket bootstrap: rank %d out of range [0, %d)", rank, worldSize);
  SocketUniqueId checked = SocketUniqueIdFromBytes(&id, sizeof(id));
  int64_t timeoutSec = core::Env().bootstrapTimeoutSec;
  MORI_ENSURE(timeoutSec > 0, InvalidUsageError, "MORI_BOOTSTRAP_TIMEOUT=%lld must be positive",
              static_cast<long long>(timeoutSec));

  Impl& m = *impl;
  m.rank = rank;
  m.worldSize = worldSize;
  m.nonce[0] = checked.nonce[0];
  m.nonce[1] = checked.nonce[1];
  // However the constructor ends, this process no longer needs a listener it made for the id: its
  // root has adopted it or is up elsewhere, or the session failed.
  struct ReleaseIdOnExit {
    const SocketUniqueId& id;
    ~ReleaseIdOnExit() { SocketBootstrapNetwork::ReleaseUniqueId(id); }
  } releaseIdOnExit{checked};
  m.timeoutSec = timeoutSec;
  m.allToAll = options.allToAll;
  m.rootAddr = Endpoint4{checked.ipv4, checked.port};
  m.addrs.assign(static_cast<size_t>(worldSize), Endpoint4{});
  m.conns.resize(static_cast<size_t>(worldSize));
  core::SetLogRank(rank);

  if (rank == 0) {
    m.listener = detail::TakeRootListener(m.nonce);
    if (m.listener.Valid()) {
      m.listenAddr = detail::LocalEndpoint(m.listener.Get());
    } else {
      m.listener = detail::Listen(m.rootAddr, &m.listenAddr,
                                  "rank 0 binding the unique id's root address (rank 0 must run on "
                                  "the host that created the id)");
    }
  }
  if (worldSize == 1) {
    m.listener.Reset();
    return;
  }
  m.Guarded([&] {
    if (rank == 0) {
      m.RootRendezvous();
    } else {
      m.ClientRendezvous();
    }
    m.EnsureConnections(m.EagerPeers(), "init (connecting the ring)");
  });
  MORI_INFO(kLogBootstrap, "socket bootstrap ready: rank %d of %d listens on %s (root %s)", rank,
            worldSize, m.listenAddr.ToString().c_str(), m.rootAddr.ToString().c_str());
}

SocketBootstrapNetwork::~SocketBootstrapNetwork() { Finalize(); }

int SocketBootstrapNetwork::Rank() const { return impl->rank; }
int SocketBootstrapNetwork::WorldSize() const { return impl->worldSize; }

void SocketBootstrapNetwork::Finalize() {
  if (!impl || impl->finalized) return;
  impl->CloseAll();
  impl->finalized = true;
}

}  // namespace mori::application

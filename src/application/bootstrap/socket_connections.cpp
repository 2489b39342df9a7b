// Opening and identifying the connections between ranks (socket_network.hpp): the lower rank of a
// pair connects and sends a kPeer hello; the higher one accepts and checks it. A non-root rank
// waiting for the address table also accepts the root's kRootTable connection here.
#include <poll.h>
#include <sys/uio.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "mori/core/errors.hpp"
#include "mori/core/logging.hpp"
#include "socket_network.hpp"

namespace mori::application {

using detail::Deadline;
using detail::Endpoint4;
using detail::Fd;
using detail::Hello;
using detail::HelloKind;
using detail::kHelloMagic;
using detail::kWireVersion;
using detail::MakeHello;
using detail::PollOnce;
using detail::RankListPhrase;
using detail::RecvSome;
using detail::SendSome;

std::vector<int> SocketBootstrapNetwork::Impl::EagerPeers() const {
  std::vector<int> peers;
  for (int d = 1; d < worldSize; d <<= 1) {
    peers.push_back((rank + d) % worldSize);
    peers.push_back((rank - d % worldSize + worldSize) % worldSize);
  }
  std::sort(peers.begin(), peers.end());
  peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
  peers.erase(std::remove(peers.begin(), peers.end(), rank), peers.end());
  return peers;
}

bool SocketBootstrapNetwork::Impl::IsEagerPeer(int p) const {
  auto e = EagerPeers();
  return std::binary_search(e.begin(), e.end(), p);
}

void SocketBootstrapNetwork::Impl::AcceptPending() {
  for (;;) {
    Endpoint4 from;
    Fd fd = detail::AcceptOne(listener.Get(), &from);
    if (!fd.Valid()) return;
    if (pending.size() >= kMaxPendingAccepts) {
      MORI_WARN(kLogBootstrap,
                "rank %d: too many unidentified connections; dropping the one "
                "from %s",
                rank, pending.front().from.ToString().c_str());
      pending.erase(pending.begin());
    }
    PendingAccept p;
    p.fd = std::move(fd);
    p.from = from;
    pending.push_back(std::move(p));
  }
}

bool SocketBootstrapNetwork::Impl::ReadHello(size_t i) {
  PendingAccept& p = pending[i];
  int err = 0;
  ssize_t n =
      RecvSome(p.fd.Get(), reinterpret_cast<char*>(&p.hello) + p.got, sizeof(Hello) - p.got, &err);
  if (n < 0) {
    MORI_DEBUG(kLogBootstrap, "rank %d: connection from %s closed before a complete hello", rank,
               p.from.ToString().c_str());
    p.fd.Reset();
    return false;
  }
  p.got += static_cast<size_t>(n);
  return p.got == sizeof(Hello);
}

std::string SocketBootstrapNetwork::Impl::CheckHelloCommon(const Hello& h, HelloKind kind) const {
  if (h.magic != kHelloMagic)
    return core::StrFormat("bad hello magic 0x%016llx (not a mori bootstrap peer)",
                           static_cast<unsigned long long>(h.magic));
  if (h.version != kWireVersion)
    return core::StrFormat("wire version %u, this rank speaks %u", h.version, kWireVersion);
  if (h.nonce[0] != nonce[0] || h.nonce[1] != nonce[1])
    return "session nonce mismatch (its unique id belongs to another session)";
  if (h.kind != static_cast<uint32_t>(kind))
    return core::StrFormat("unexpected hello kind %u", h.kind);
  if (h.worldSize != worldSize)
    return core::StrFormat("world size %d, this session has %d", h.worldSize, worldSize);
  if (h.rank < 0 || h.rank >= worldSize)
    return core::StrFormat("rank %d out of range [0, %d)", h.rank, worldSize);
  return "";
}

void SocketBootstrapNetwork::Impl::ServicePeerAccepts(const std::vector<pollfd>& fds,
                                                      size_t firstPending, size_t count,
                                                      std::vector<int>* identified) {
  for (size_t k = 0; k < count; k++) {
    size_t i = firstPending + k;
    if (fds[i].revents == 0) continue;
    if (!ReadHello(k)) continue;  // pending entries keep their order within this call
    PendingAccept& p = pending[k];
    bool isTable = p.hello.kind == static_cast<uint32_t>(HelloKind::kRootTable);
    std::string why = CheckHelloCommon(p.hello, isTable ? HelloKind::kRootTable : HelloKind::kPeer);
    int from = p.hello.rank;
    if (why.empty() && isTable) {
      if (from != 0 || !waitingTable || tableConn.Valid())
        why = core::StrFormat("unexpected address-table connection claiming rank %d", from);
      if (!why.empty()) {
        MORI_WARN(kLogBootstrap, "rank %d: rejected a connection from %s: %s", rank,
                  p.from.ToString().c_str(), why.c_str());
        p.fd.Reset();
      } else {
        tableConn = std::move(p.fd);
      }
      continue;
    }
    if (why.empty() && from >= rank)
      why =
          core::StrFormat("rank %d connected to rank %d, but the lower rank connects", from, rank);
    if (why.empty() && conns[static_cast<size_t>(from)].fd.Valid())
      why = core::StrFormat("rank %d is already connected", from);
    if (!why.empty()) {
      MORI_WARN(kLogBootstrap, "rank %d: rejected a connection from %s: %s", rank,
                p.from.ToString().c_str(), why.c_str());
      p.fd.Reset();
      continue;
    }
    conns[static_cast<size_t>(from)].fd = std::move(p.fd);
    conns[static_cast<size_t>(from)].atBoundary = true;
    identified->push_back(from);
  }
  pending.erase(std::remove_if(pending.begin(), pending.end(),
                               [](const PendingAccept& p) { return !p.fd.Valid(); }),
                pending.end());
}

void SocketBootstrapNetwork::Impl::EnsureConnections(const std::vector<int>& peers,
                                                     const char* what, bool waitTable) {
  struct Outgoing {
    int peer;
    Fd fd;
    bool connected = false;
    Hello hello{};
    size_t sent = 0;
  };
  std::vector<Outgoing> outgoing;
  std::vector<int> incoming;
  for (int p : peers) {
    if (p == rank || conns[static_cast<size_t>(p)].fd.Valid()) continue;
    if (p < rank) {
      incoming.push_back(p);
      continue;
    }
    Outgoing o;
    o.peer = p;
    int err = 0;
    o.fd = detail::StartConnect(addrs[static_cast<size_t>(p)], &err);
    if (!o.fd.Valid())
      MORI_THROW(RemoteError, "rank %d: %s: cannot connect to rank %d at %s: %s", rank, what, p,
                 addrs[static_cast<size_t>(p)].ToString().c_str(), std::strerror(err));
    o.hello = MakeHello(HelloKind::kPeer, nonce, rank, worldSize, listenAddr);
    outgoing.push_back(std::move(o));
  }
  bool haveTable = !waitTable;
  waitingTable = waitTable;
  Deadline dl = waitTable ? Deadline::AfterMilliseconds(timeoutSec * 1000 + kRootVerdictGraceMs)
                          : NewDeadline();
  std::vector<pollfd> fds;
  for (;;) {
    bool outDone = std::all_of(outgoing.begin(), outgoing.end(),
                               [](const Outgoing& o) { return o.sent == sizeof(Hello); });
    bool inDone = std::all_of(incoming.begin(), incoming.end(),
                              [&](int p) { return conns[static_cast<size_t>(p)].fd.Valid(); });
    if (outDone && inDone && haveTable) break;
    if (dl.Expired()) {
      std::vector<int> missingIn, missingOut;
      for (int p : incoming)
        if (!conns[static_cast<size_t>(p)].fd.Valid()) missingIn.push_back(p);
      for (const auto& o : outgoing)
        if (o.sent < sizeof(Hello)) missingOut.push_back(o.peer);
      std::string msg;
      if (!haveTable)
        msg =
            "the root (rank 0) did not send the address table (some ranks never connected "
            "to the root?)";
      if (!missingIn.empty())
        msg += core::StrFormat("%s%s never connected to this rank", msg.empty() ? "" : "; ",
                               RankListPhrase(missingIn).c_str());
      if (!missingOut.empty())
        msg += core::StrFormat("%sconnecting to %s did not complete", msg.empty() ? "" : "; ",
                               RankListPhrase(missingOut).c_str());
      MORI_THROW(TimeoutError, "rank %d: %s: no progress for %lld s: %s", rank, what,
                 static_cast<long long>(timeoutSec), msg.c_str());
    }
    fds.clear();
    fds.push_back({listener.Get(), POLLIN, 0});
    size_t firstPending = fds.size();
    for (const auto& p : pending) fds.push_back({p.fd.Get(), POLLIN, 0});
    size_t firstOut = fds.size();
    for (const auto& o : outgoing)
      fds.push_back({o.fd.Get(), short(o.sent < sizeof(Hello) ? POLLOUT : 0), 0});
    if (PollOnce(fds, dl.RemainingMs()) == 0) continue;
    bool progress = false;

    for (size_t k = 0; k < outgoing.size(); k++) {
      Outgoing& o = outgoing[k];
      if (fds[firstOut + k].revents == 0 || o.sent == sizeof(Hello)) continue;
      if (!o.connected) {
        int e = detail::ConnectResult(o.fd.Get());
        if (e != 0)
          MORI_THROW(RemoteError,
                     "rank %d: %s: connecting to rank %d at %s failed: %s (is "
                     "that rank still alive?)",
                     rank, what, o.peer, addrs[static_cast<size_t>(o.peer)].ToString().c_str(),
                     std::strerror(e));
        o.connected = true;
      }
      iovec iov{reinterpret_cast<char*>(&o.hello) + o.sent, sizeof(Hello) - o.sent};
      int err = 0;
      ssize_t n = SendSome(o.fd.Get(), &iov, 1, &err);
      if (n < 0)
        MORI_THROW(RemoteError, "rank %d: %s: sending the hello to rank %d failed: %s", rank, what,
                   o.peer, std::strerror(err));
      o.sent += static_cast<size_t>(n);
      progress = progress || n > 0;
      if (o.sent == sizeof(Hello)) {
        conns[static_cast<size_t>(o.peer)].fd = std::move(o.fd);
        conns[static_cast<size_t>(o.peer)].atBoundary = true;
      }
    }

    std::vector<int> identified;
    size_t pendingBefore = pending.size();
    ServicePeerAccepts(fds, firstPending, pendingBefore, &identified);
    progress = progress || !identified.empty();
    if (fds[0].revents != 0) {
      AcceptPending();
      progress = true;
    }
    if (!haveTable && tableConn.Valid()) {
      ReceiveTable();
      haveTable = true;
      waitingTable = false;
      progress = true;
      if (IsEagerPeer(0)) {  // the root keeps its end as the connection between us
        if (conns[0].fd.Valid())
          MORI_THROW(RemoteError, "rank %d: rank 0 opened a second connection", rank);
        conns[0].fd = std::move(tableConn);
        conns[0].atBoundary = true;
      } else {
        tableConn.Reset();
      }
    }
    if (progress) dl = NewDeadline();
  }
}

}  // namespace mori::application

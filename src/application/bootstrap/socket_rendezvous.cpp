// Rendezvous (socket_network.hpp): every rank opens its own listener, connects to the root and
// sends {nonce, rank, its listen address}; the root validates (nonce, version, world size, rank
// range, duplicates), answers each connection with an ack or a reject carrying the reason, and
// once all ranks arrived connects back to each rank to hand out the address table (or, when it
// fails, an abort naming the reason).
#include <poll.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
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
using detail::FrameHeader;
using detail::FrameType;
using detail::FrameTypeName;
using detail::Hello;
using detail::HelloKind;
using detail::kMaxErrorText;
using detail::MakeHeader;
using detail::MakeHello;
using detail::PollOnce;
using detail::RankListPhrase;
using detail::SendFrameNow;
using detail::SendSome;
using detail::TableEntry;

namespace {

bool IsRetryableConnectError(int e) {
  return e == ECONNREFUSED || e == ETIMEDOUT || e == ENETUNREACH || e == EHOSTUNREACH ||
         e == EAGAIN || e == ECONNRESET || e == EADDRNOTAVAIL;
}

}  // namespace

void SocketBootstrapNetwork::Impl::ReceiveTable() {
  std::vector<TableEntry> table(static_cast<size_t>(worldSize));
  RecvSpec r;
  r.fd = tableConn.Get();
  r.peer = 0;
  r.type = FrameType::kTable;
  r.data = table.data();
  r.length = table.size() * sizeof(TableEntry);
  Exchange(nullptr, &r, "rendezvous (receiving the address table from the root)");
  for (int i = 0; i < worldSize; i++)
    addrs[static_cast<size_t>(i)] = Endpoint4{table[i].ip, table[i].port};
  if (!addrs[static_cast<size_t>(rank)].operator==(listenAddr))
    MORI_THROW(RemoteError,
               "rank %d: the root's address table lists %s for this rank, but it "
               "listens on %s",
               rank, addrs[static_cast<size_t>(rank)].ToString().c_str(),
               listenAddr.ToString().c_str());
}

Fd SocketBootstrapNetwork::Impl::ConnectToRoot(const Deadline& dl) {
  int lastErr = 0;
  int backoffMs = 10;
  while (!dl.Expired()) {
    int err = 0;
    Fd fd = detail::StartConnect(rootAddr, &err);
    if (fd.Valid()) {
      std::vector<pollfd> p{{fd.Get(), POLLOUT, 0}};
      while (p[0].revents == 0 && !dl.Expired()) PollOnce(p, dl.RemainingMs());
      if (p[0].revents == 0) break;
      err = detail::ConnectResult(fd.Get());
      if (err == 0) return fd;
    }
    if (!IsRetryableConnectError(err))
      MORI_THROW(SystemError, "rank %d: connecting to the root (rank 0) at %s failed: %s", rank,
                 rootAddr.ToString().c_str(), std::strerror(err));
    lastErr = err;
    detail::SleepMs(backoffMs, dl);
    backoffMs = std::min(backoffMs * 2, 200);
  }
  MORI_THROW(TimeoutError,
             "rank %d: could not connect to the root (rank 0) at %s within %lld s "
             "(last error: %s)",
             rank, rootAddr.ToString().c_str(), static_cast<long long>(timeoutSec),
             lastErr ? std::strerror(lastErr) : "none");
}

void SocketBootstrapNetwork::Impl::ClientRendezvous() {
  Deadline dl = NewDeadline();
  Fd root = ConnectToRoot(dl);
  // Listen on the address this host uses to reach the root: reachable by the other ranks.
  Endpoint4 local = detail::LocalEndpoint(root.Get());
  listener = detail::Listen(Endpoint4{local.ip, 0}, &listenAddr, "bootstrap rank listener");

  Hello h = MakeHello(HelloKind::kRendezvous, nonce, rank, worldSize, listenAddr);
  {  // the hello is not a frame: send it raw
    Deadline sdl = NewDeadline();
    size_t sent = 0;
    while (sent < sizeof(h)) {
      std::vector<pollfd> p{{root.Get(), POLLOUT, 0}};
      if (PollOnce(p, sdl.RemainingMs()) == 0) {
        if (sdl.Expired())
          MORI_THROW(TimeoutError, "rank %d: sending the hello to the root timed out", rank);
        continue;
      }
      iovec iov{reinterpret_cast<char*>(&h) + sent, sizeof(h) - sent};
      int err = 0;
      ssize_t n = SendSome(root.Get(), &iov, 1, &err);
      if (n < 0)
        MORI_THROW(RemoteError,
                   "rank %d: sending the hello to the root (rank 0) at %s "
                   "failed: %s",
                   rank, rootAddr.ToString().c_str(), std::strerror(err));
      sent += static_cast<size_t>(n);
    }
  }
  RecvSpec ack;
  ack.fd = root.Get();
  ack.peer = 0;
  ack.type = FrameType::kAck;
  Exchange(nullptr, &ack, "rendezvous (waiting for the root's answer)");
  root.Reset();
  EnsureConnections({}, "rendezvous (waiting for the address table)", /*waitTable=*/true);
}

Fd SocketBootstrapNetwork::Impl::RootSendTo(int r, FrameType type, uint32_t step,
                                            const void* payload, size_t len, const Deadline& dl) {
  int err = 0;
  const Endpoint4& to = addrs[static_cast<size_t>(r)];
  Fd fd = detail::StartConnect(to, &err);
  if (!fd.Valid())
    MORI_THROW(RemoteError, "rank 0: cannot connect back to rank %d at %s: %s", r,
               to.ToString().c_str(), std::strerror(err));
  std::vector<pollfd> p{{fd.Get(), POLLOUT, 0}};
  while (p[0].revents == 0 && !dl.Expired()) PollOnce(p, dl.RemainingMs());
  if (p[0].revents == 0)
    MORI_THROW(TimeoutError, "rank 0: connecting back to rank %d at %s timed out", r,
               to.ToString().c_str());
  err = detail::ConnectResult(fd.Get());
  if (err != 0)
    MORI_THROW(RemoteError,
               "rank 0: connecting back to rank %d at %s failed: %s (did it exit "
               "after connecting to the root?)",
               r, to.ToString().c_str(), std::strerror(err));
  Hello h = MakeHello(HelloKind::kRootTable, nonce, 0, worldSize, listenAddr);
  FrameHeader fh = MakeHeader(type, 0, step, 0, len);
  std::vector<char> buf(sizeof(h) + sizeof(fh) + len);
  std::memcpy(buf.data(), &h, sizeof(h));
  std::memcpy(buf.data() + sizeof(h), &fh, sizeof(fh));
  if (len) std::memcpy(buf.data() + sizeof(h) + sizeof(fh), payload, len);
  size_t sent = 0;
  while (sent < buf.size()) {
    std::vector<pollfd> q{{fd.Get(), POLLOUT, 0}};
    if (PollOnce(q, dl.RemainingMs()) == 0) {
      if (dl.Expired())
        MORI_THROW(TimeoutError,
                   "rank 0: sending the %s to rank %d timed out (it is not "
                   "receiving)",
                   FrameTypeName(fh.type), r);
      continue;
    }
    iovec iov{buf.data() + sent, buf.size() - sent};
    ssize_t n = SendSome(fd.Get(), &iov, 1, &err);
    if (n < 0)
      MORI_THROW(RemoteError, "rank 0: sending the %s to rank %d failed: %s",
                 FrameTypeName(fh.type), r, std::strerror(err));
    sent += static_cast<size_t>(n);
  }
  return fd;
}

void SocketBootstrapNetwork::Impl::RootAbortArrived(const std::vector<char>& arrived, int firstRank,
                                                    core::ErrorKind kind,
                                                    const std::string& reason) {
  Deadline dl = Deadline::AfterMilliseconds(kRootAbortBudgetMs);
  std::string text = reason.substr(0, kMaxErrorText);
  for (int r = firstRank; r < worldSize && !dl.Expired(); r++) {
    if (!arrived[static_cast<size_t>(r)]) continue;
    try {
      RootSendTo(r, FrameType::kAbort, static_cast<uint32_t>(kind), text.data(), text.size(), dl);
    } catch (const core::Error&) {
      // best effort: that rank will time out on its own
    }
  }
}

std::string SocketBootstrapNetwork::Impl::CheckRendezvousHello(
    const Hello& h, const std::vector<char>& arrived) const {
  std::string why = CheckHelloCommon(h, HelloKind::kRendezvous);
  if (!why.empty()) return why;
  if (h.rank == 0) return "rank 0 is the root; another process claims rank 0";
  if (arrived[static_cast<size_t>(h.rank)])
    return core::StrFormat("duplicate rank %d: rank %d already connected from %s", h.rank, h.rank,
                           addrs[static_cast<size_t>(h.rank)].ToString().c_str());
  if (h.listenIp == 0 || h.listenPort == 0) return "no listen address in the hello";
  return "";
}

void SocketBootstrapNetwork::Impl::RootRendezvous() {
  Deadline dl = NewDeadline();
  std::vector<char> arrived(static_cast<size_t>(worldSize), 0);
  arrived[0] = 1;
  addrs[0] = listenAddr;
  int remaining = worldSize - 1;
  int rejected = 0;
  std::string lastRejection;
  std::vector<pollfd> fds;
  while (remaining > 0) {
    if (dl.Expired()) {
      std::vector<int> missing;
      for (int r = 1; r < worldSize; r++)
        if (!arrived[static_cast<size_t>(r)]) missing.push_back(r);
      std::string msg =
          core::StrFormat("rank 0 (root at %s): %s of %d never connected within %lld s",
                          listenAddr.ToString().c_str(), RankListPhrase(missing).c_str(), worldSize,
                          static_cast<long long>(timeoutSec));
      if (rejected)
        msg += core::StrFormat(" (rejected %d bad connection(s); last: %s)", rejected,
                               lastRejection.c_str());
      pending.clear();
      RootAbortArrived(arrived, 1, core::ErrorKind::kTimeout, msg);
      throw core::TimeoutError(__FILE__, __LINE__, msg);
    }
    fds.clear();
    fds.push_back({listener.Get(), POLLIN, 0});
    for (const auto& p : pending) fds.push_back({p.fd.Get(), POLLIN, 0});
    if (PollOnce(fds, dl.RemainingMs()) == 0) continue;
    for (size_t i = 0; i + 1 < fds.size(); i++) {
      if (fds[i + 1].revents == 0 || !ReadHello(i)) continue;
      PendingAccept& p = pending[i];
      std::string why = CheckRendezvousHello(p.hello, arrived);
      if (!why.empty()) {
        rejected++;
        lastRejection = core::StrFormat("%s from %s", why.c_str(), p.from.ToString().c_str());
        MORI_WARN(kLogBootstrap, "rank 0: rejected a rendezvous connection from %s: %s",
                  p.from.ToString().c_str(), why.c_str());
        (void)SendFrameNow(p.fd.Get(), FrameType::kReject, 0, 0, 0, why);
        p.fd.Reset();
        continue;
      }
      int r = p.hello.rank;
      arrived[static_cast<size_t>(r)] = 1;
      addrs[static_cast<size_t>(r)] = Endpoint4{p.hello.listenIp, p.hello.listenPort};
      remaining--;
      MORI_DEBUG(kLogBootstrap, "rank 0: rank %d arrived from %s, listens on %s", r,
                 p.from.ToString().c_str(), addrs[static_cast<size_t>(r)].ToString().c_str());
      (void)SendFrameNow(p.fd.Get(), FrameType::kAck, 0, 0, 0, "");
      p.fd.Reset();
    }
    pending.erase(std::remove_if(pending.begin(), pending.end(),
                                 [](const PendingAccept& p) { return !p.fd.Valid(); }),
                  pending.end());
    if (fds[0].revents != 0) AcceptPending();
  }
  pending.clear();

  std::vector<TableEntry> table(static_cast<size_t>(worldSize));
  for (int r = 0; r < worldSize; r++)
    table[static_cast<size_t>(r)] =
        TableEntry{addrs[static_cast<size_t>(r)].ip, addrs[static_cast<size_t>(r)].port, 0};
  for (int r = 1; r < worldSize; r++) {
    try {
      Fd fd = RootSendTo(r, FrameType::kTable, 0, table.data(), table.size() * sizeof(TableEntry),
                         NewDeadline());
      if (IsEagerPeer(r)) conns[static_cast<size_t>(r)].fd = std::move(fd);
    } catch (const core::Error& e) {
      RootAbortArrived(arrived, r + 1, e.Kind(), e.Message());
      throw;
    }
  }
}

}  // namespace mori::application

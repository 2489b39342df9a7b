// Framed sends and receives on the connections between ranks (socket_network.hpp), and what
// happens on an error: the peers are told with an abort frame (best effort) and every socket is
// closed.
#include <poll.h>
#include <sys/uio.h>

#include <cstring>
#include <string>
#include <vector>

#include "mori/core/errors.hpp"
#include "socket_network.hpp"

namespace mori::application {

using detail::Deadline;
using detail::FrameHeader;
using detail::FrameType;
using detail::FrameTypeName;
using detail::kFrameMagic;
using detail::kMaxErrorText;
using detail::MakeHeader;
using detail::PollOnce;
using detail::RecvSome;
using detail::SendFrameNow;
using detail::SendSome;

void SocketBootstrapNetwork::Impl::CloseAll() {
  for (auto& c : conns) {
    // Unread input would make close() reset the connection, which can destroy the abort frame
    // just queued for the peer; read what is there (bounded) so the close is a clean FIN.
    char sink[65536];
    int err = 0;
    for (int i = 0; c.fd.Valid() && i < 64 && RecvSome(c.fd.Get(), sink, sizeof(sink), &err) > 0;
         i++) {
    }
    c.fd.Reset();
  }
  pending.clear();
  tableConn.Reset();
  listener.Reset();
}

void SocketBootstrapNetwork::Impl::Break(core::ErrorKind kind, const std::string& reason) {
  if (brokenReason.empty()) brokenReason = reason.empty() ? "unknown error" : reason;
  std::string text = reason.substr(0, kMaxErrorText);
  for (auto& c : conns)
    if (c.fd.Valid() && c.atBoundary)
      (void)SendFrameNow(c.fd.Get(), FrameType::kAbort, rank, static_cast<uint32_t>(kind), seq,
                         text);
  CloseAll();
}

void SocketBootstrapNetwork::Impl::CheckUsable(const char* what) const {
  MORI_ENSURE(!finalized, InvalidUsageError, "socket bootstrap rank %d: %s after Finalize", rank,
              what);
  MORI_ENSURE(brokenReason.empty(), InvalidUsageError,
              "socket bootstrap rank %d: %s on a network broken by an earlier error (%s)", rank,
              what, brokenReason.c_str());
}

void SocketBootstrapNetwork::Impl::RaiseFromErrorFrame(const FrameHeader& h, int peer,
                                                       const std::string& text,
                                                       const char* what) const {
  if (h.type == static_cast<uint16_t>(FrameType::kReject))
    MORI_THROW(RemoteError, "rank %d: the root (rank 0) rejected this rank: %s", rank,
               text.c_str());
  if (h.step == static_cast<uint32_t>(core::ErrorKind::kTimeout))
    MORI_THROW(TimeoutError, "rank %d: %s failed because rank %d timed out: %s", rank, what, peer,
               text.c_str());
  MORI_THROW(RemoteError, "rank %d: %s failed because rank %d failed: %s", rank, what, peer,
             text.c_str());
}

void SocketBootstrapNetwork::Impl::ReadErrorText(int fd, int peer, const FrameHeader& h,
                                                 const char* what) const {
  std::string text;
  if (h.length > kMaxErrorText)
    MORI_THROW(RemoteError, "rank %d: %s: rank %d sent a %s frame of %llu bytes (corrupted?)", rank,
               what, peer, FrameTypeName(h.type), static_cast<unsigned long long>(h.length));
  text.resize(h.length);
  size_t got = 0;
  Deadline dl = Deadline::AfterMilliseconds(1000).Earlier(NewDeadline());
  while (got < text.size() && !dl.Expired()) {
    std::vector<pollfd> p{{fd, POLLIN, 0}};
    PollOnce(p, dl.RemainingMs());
    int err = 0;
    ssize_t n = RecvSome(fd, &text[got], text.size() - got, &err);
    if (n < 0) break;
    got += static_cast<size_t>(n);
  }
  text.resize(got);
  RaiseFromErrorFrame(h, peer, text, what);
}

void SocketBootstrapNetwork::Impl::CheckHeader(const FrameHeader& h, const RecvSpec& r,
                                               const std::string& what) const {
  const char* w = what.c_str();
  if (h.magic != kFrameMagic)
    MORI_THROW(RemoteError, "rank %d: %s: corrupted stream from rank %d (frame magic 0x%08x)", rank,
               w, r.peer, h.magic);
  if (h.srcRank != r.peer)
    MORI_THROW(RemoteError,
               "rank %d: %s: frame on the connection to rank %d claims to come "
               "from rank %d",
               rank, w, r.peer, h.srcRank);
  if (h.type != static_cast<uint16_t>(r.type))
    MORI_THROW(RemoteError,
               "rank %d: %s: rank %d sent a %s frame (seq %llu) where %s was "
               "expected: ranks called different collectives",
               rank, w, r.peer, FrameTypeName(h.type), static_cast<unsigned long long>(h.seq),
               FrameTypeName(static_cast<uint16_t>(r.type)));
  if (h.seq != r.seq)
    MORI_THROW(RemoteError,
               "rank %d: %s: rank %d is at collective #%llu, this rank at #%llu: "
               "ranks called collectives in a different order",
               rank, w, r.peer, static_cast<unsigned long long>(h.seq),
               static_cast<unsigned long long>(r.seq));
  if (h.step != r.step)
    MORI_THROW(RemoteError,
               "rank %d: %s: rank %d sent step %u, expected step %u (different "
               "algorithm or world size?)",
               rank, w, r.peer, h.step, r.step);
  if (h.length != r.length)
    MORI_THROW(RemoteError,
               "rank %d: %s: rank %d sent %llu bytes, this rank expects %llu: "
               "ranks passed different sizes",
               rank, w, r.peer, static_cast<unsigned long long>(h.length),
               static_cast<unsigned long long>(r.length));
}

void SocketBootstrapNetwork::Impl::Exchange(SendSpec* s, RecvSpec* r, const std::string& what) {
  const size_t kHdr = sizeof(FrameHeader);
  size_t sendTotal = s ? kHdr + s->header.length : 0, sendDone = 0;
  size_t recvTotal = r ? kHdr + r->length : 0, recvDone = 0;
  FrameHeader got{};
  bool headerChecked = false;
  Deadline dl = NewDeadline();
  std::vector<pollfd> fds;
  while ((s && sendDone < sendTotal) || (r && recvDone < recvTotal)) {
    bool wantSend = s && sendDone < sendTotal;
    bool wantRecv = r && recvDone < recvTotal;
    fds.clear();
    if (wantSend && wantRecv && s->fd == r->fd) {
      fds.push_back({s->fd, POLLIN | POLLOUT, 0});
    } else {
      if (wantSend) fds.push_back({s->fd, POLLOUT, 0});
      if (wantRecv) fds.push_back({r->fd, POLLIN, 0});
    }
    int ready = PollOnce(fds, dl.RemainingMs());
    if (ready == 0) {
      if (!dl.Expired()) continue;
      std::string waiting;
      if (wantRecv) waiting = core::StrFormat("waiting for data from rank %d", r->peer);
      if (wantSend)
        waiting += core::StrFormat("%swaiting to send to rank %d (it is not receiving)",
                                   waiting.empty() ? "" : " and ", s->peer);
      MORI_THROW(TimeoutError, "rank %d: %s: no progress for %lld s %s", rank, what.c_str(),
                 static_cast<long long>(timeoutSec), waiting.c_str());
    }
    bool progress = false;
    short sendEv = 0, recvEv = 0;
    for (const auto& p : fds) {
      if (wantSend && p.fd == s->fd) sendEv = p.revents;
      if (wantRecv && p.fd == r->fd) recvEv = p.revents;
    }
    if (wantRecv && recvEv) {
      int err = 0;
      ssize_t n;
      if (recvDone < kHdr)
        n = RecvSome(r->fd, reinterpret_cast<char*>(&got) + recvDone, kHdr - recvDone, &err);
      else
        n = RecvSome(r->fd, static_cast<char*>(r->data) + (recvDone - kHdr), recvTotal - recvDone,
                     &err);
      if (n < 0) {
        if (err == 0)
          MORI_THROW(RemoteError,
                     "rank %d: %s: connection to rank %d closed by the peer "
                     "(process exited or failed?)",
                     rank, what.c_str(), r->peer);
        MORI_THROW(RemoteError, "rank %d: %s: receiving from rank %d failed: %s", rank,
                   what.c_str(), r->peer, std::strerror(err));
      }
      recvDone += static_cast<size_t>(n);
      progress = n > 0;
      if (!headerChecked && recvDone >= kHdr) {
        headerChecked = true;
        if (got.magic == kFrameMagic && got.srcRank == r->peer &&
            (got.type == static_cast<uint16_t>(FrameType::kAbort) ||
             got.type == static_cast<uint16_t>(FrameType::kReject)))
          ReadErrorText(r->fd, r->peer, got, what.c_str());
        CheckHeader(got, *r, what);
      }
    }
    if (wantSend && sendEv) {
      iovec iov[2];
      int cnt = 0;
      if (sendDone < kHdr) {
        iov[cnt++] = {reinterpret_cast<char*>(&s->header) + sendDone, kHdr - sendDone};
        if (s->header.length > 0) iov[cnt++] = {const_cast<void*>(s->data), s->header.length};
      } else {
        iov[cnt++] = {static_cast<char*>(const_cast<void*>(s->data)) + (sendDone - kHdr),
                      sendTotal - sendDone};
      }
      int err = 0;
      ssize_t n = SendSome(s->fd, iov, cnt, &err);
      if (n < 0)
        MORI_THROW(RemoteError,
                   "rank %d: %s: sending to rank %d failed: %s (peer closed the "
                   "connection: process exited or failed?)",
                   rank, what.c_str(), s->peer, std::strerror(err));
      sendDone += static_cast<size_t>(n);
      progress = progress || n > 0;
      if (s->atBoundary) *s->atBoundary = sendDone == 0 || sendDone == sendTotal;
    }
    if (progress) dl = NewDeadline();
  }
}

SocketBootstrapNetwork::Impl::Conn& SocketBootstrapNetwork::Impl::ConnTo(int peer) {
  Conn& c = conns[static_cast<size_t>(peer)];
  if (!c.fd.Valid()) MORI_THROW(InternalError, "rank %d: no connection to rank %d", rank, peer);
  return c;
}

void SocketBootstrapNetwork::Impl::Step(FrameType type, uint32_t step, int to, const void* sendData,
                                        size_t sendLen, int from, void* recvData, size_t recvLen,
                                        const char* what) {
  SendSpec s;
  RecvSpec r;
  if (to >= 0) {
    Conn& c = ConnTo(to);
    s.fd = c.fd.Get();
    s.peer = to;
    s.atBoundary = &c.atBoundary;
    s.header = MakeHeader(type, rank, step, seq, sendLen);
    s.data = sendData;
  }
  if (from >= 0) {
    Conn& c = ConnTo(from);
    r.fd = c.fd.Get();
    r.peer = from;
    r.type = type;
    r.step = step;
    r.seq = seq;
    r.data = recvData;
    r.length = recvLen;
  }
  std::string label =
      core::StrFormat("%s #%llu step %u", what, static_cast<unsigned long long>(seq), step);
  Exchange(to >= 0 ? &s : nullptr, from >= 0 ? &r : nullptr, label);
}

}  // namespace mori::application

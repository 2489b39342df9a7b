#include "mori/application/bootstrap/socket_bootstrap.hpp"

#include <arpa/inet.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/logging.hpp"
#include "socket_util.hpp"

namespace mori::application {

using detail::Deadline;
using detail::Endpoint4;
using detail::Fd;

namespace {

// ---- wire format --------------------------------------------------------------------------------
// Every stream starts with one Hello from the connecting side, then carries Frames. All fields
// are in host byte order except addresses (network order): peers are assumed to share endianness.

constexpr uint64_t kHelloMagic = 0x4F4C4C4548524F4DULL;  // "MORHELLO"
constexpr uint32_t kWireVersion = 1;
constexpr uint32_t kFrameMagic = 0x4D524D46u;
constexpr size_t kMaxErrorText = 4096;
constexpr size_t kMaxPendingAccepts = 1024;
constexpr int kRootAbortBudgetMs = 2000;
// A rank waiting for the address table waits this much longer than the root's own rendezvous
// timeout, so that it normally hears the root's verdict (which names the missing ranks).
constexpr int kRootVerdictGraceMs = 1000;

enum class HelloKind : uint32_t {
  kRendezvous = 1,  // rank -> root: {rank, listen address}
  kPeer = 2,        // lower rank -> higher rank: a collective connection
  kRootTable = 3,   // root -> rank: the address table (or an abort) follows
};

struct Hello {
  uint64_t magic;
  uint32_t version;
  uint32_t kind;  // HelloKind
  uint64_t nonce[2];
  int32_t rank;
  int32_t worldSize;
  uint32_t listenIp;  // kRendezvous only
  uint16_t listenPort;
  uint16_t reserved;
};
static_assert(sizeof(Hello) == 48, "Hello is a fixed 48-byte wire record");

enum class FrameType : uint16_t {
  kAck = 1,     // root accepted a rendezvous hello
  kReject = 2,  // root rejected a rendezvous hello; payload: reason text
  kTable = 3,   // root -> rank: address table
  kAbort = 4,   // sender failed; step = its ErrorKind, payload: its error text
  kAllgather = 5,
  kAllToAll = 6,
  kBarrier = 7,
};

const char* FrameTypeName(uint16_t t) {
  switch (static_cast<FrameType>(t)) {
    case FrameType::kAck:
      return "ack";
    case FrameType::kReject:
      return "reject";
    case FrameType::kTable:
      return "address table";
    case FrameType::kAbort:
      return "abort";
    case FrameType::kAllgather:
      return "Allgather";
    case FrameType::kAllToAll:
      return "AllToAll";
    case FrameType::kBarrier:
      return "Barrier";
  }
  return "unknown";
}

struct FrameHeader {
  uint32_t magic;
  uint16_t type;  // FrameType
  uint16_t reserved;
  int32_t srcRank;
  uint32_t step;
  uint64_t seq;
  uint64_t length;  // payload bytes following the header
};
static_assert(sizeof(FrameHeader) == 32, "FrameHeader is a fixed 32-byte wire record");

struct TableEntry {
  uint32_t ip;
  uint16_t port;
  uint16_t reserved;
};
static_assert(sizeof(TableEntry) == 8, "TableEntry is a fixed 8-byte wire record");

FrameHeader MakeHeader(FrameType type, int srcRank, uint32_t step, uint64_t seq, uint64_t length) {
  FrameHeader h{};
  h.magic = kFrameMagic;
  h.type = static_cast<uint16_t>(type);
  h.srcRank = srcRank;
  h.step = step;
  h.seq = seq;
  h.length = length;
  return h;
}

Hello MakeHello(HelloKind kind, const uint64_t nonce[2], int rank, int worldSize,
                Endpoint4 listen) {
  Hello h{};
  h.magic = kHelloMagic;
  h.version = kWireVersion;
  h.kind = static_cast<uint32_t>(kind);
  h.nonce[0] = nonce[0];
  h.nonce[1] = nonce[1];
  h.rank = rank;
  h.worldSize = worldSize;
  h.listenIp = listen.ip;
  h.listenPort = listen.port;
  return h;
}

std::string RankList(const std::vector<int>& ranks) {
  std::string s;
  size_t shown = std::min<size_t>(ranks.size(), 32);
  for (size_t i = 0; i < shown; i++) s += (i ? "," : "") + std::to_string(ranks[i]);
  if (shown < ranks.size()) s += core::StrFormat(",... (%zu in all)", ranks.size());
  return s;
}

std::string RankListPhrase(const std::vector<int>& ranks) {
  return (ranks.size() == 1 ? "rank " : "ranks ") + RankList(ranks);
}

// ---- process-wide registry of root listeners made by CreateUniqueId
// -------------------------------

// An id's listener is needed only until rank 0 of that id adopts it in this process. One whose
// maker never becomes rank 0 would stay open forever, so entries are bounded: closed once a
// bootstrap with the id ends here (any rank; its root is then up, or the session failed), after
// MORI_BOOTSTRAP_TIMEOUT seconds unadopted (rank 0 then binds the id's address itself), and at
// most kMaxPendingListeners at once (the oldest goes first).
constexpr size_t kMaxPendingListeners = 64;

struct PendingListener {
  Fd fd;
  std::chrono::steady_clock::time_point created;
};

struct Registry {
  std::mutex mutex;
  std::map<std::pair<uint64_t, uint64_t>, PendingListener> listeners;
};

Registry& GetRegistry() {
  static Registry* registry = new Registry();  // never destroyed: usable during static teardown
  return *registry;
}

// Closes entries older than MORI_BOOTSTRAP_TIMEOUT. Call with reg.mutex held.
void ExpireListenersLocked(Registry& reg) {
  const int64_t timeoutSec = core::Env().bootstrapTimeoutSec;
  if (timeoutSec <= 0) return;  // the bootstrap itself rejects this value
  const auto now = std::chrono::steady_clock::now();
  for (auto it = reg.listeners.begin(); it != reg.listeners.end();) {
    if (now - it->second.created >= std::chrono::seconds(timeoutSec)) {
      MORI_INFO(kLogBootstrap,
                "closing the root listener of an unused socket unique id after "
                "MORI_BOOTSTRAP_TIMEOUT=%lld s",
                static_cast<long long>(timeoutSec));
      it = reg.listeners.erase(it);
    } else {
      ++it;
    }
  }
}

void RegisterListener(const uint64_t nonce[2], Fd fd) {
  Registry& reg = GetRegistry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  ExpireListenersLocked(reg);
  while (reg.listeners.size() >= kMaxPendingListeners) {
    auto oldest = reg.listeners.begin();
    for (auto it = reg.listeners.begin(); it != reg.listeners.end(); ++it)
      if (it->second.created < oldest->second.created) oldest = it;
    MORI_WARN(kLogBootstrap,
              "more than %zu socket unique ids made in this process are unused: closing the "
              "oldest one's root listener",
              kMaxPendingListeners);
    reg.listeners.erase(oldest);
  }
  reg.listeners[{nonce[0], nonce[1]}] =
      PendingListener{std::move(fd), std::chrono::steady_clock::now()};
}

Fd TakeRegisteredListener(const uint64_t nonce[2]) {
  Registry& reg = GetRegistry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  ExpireListenersLocked(reg);
  auto it = reg.listeners.find({nonce[0], nonce[1]});
  if (it == reg.listeners.end()) return Fd();
  Fd fd = std::move(it->second.fd);
  reg.listeners.erase(it);
  return fd;
}

bool IsRetryableConnectError(int e) {
  return e == ECONNREFUSED || e == ETIMEDOUT || e == ENETUNREACH || e == EHOSTUNREACH ||
         e == EAGAIN || e == ECONNRESET || e == EADDRNOTAVAIL;
}

// Writes as much as the socket takes now (non-blocking). Returns bytes written; -1 with *err set
// on a hard error.
ssize_t SendSome(int fd, const iovec* iov, int iovCount, int* err) {
  msghdr msg{};
  msg.msg_iov = const_cast<iovec*>(iov);
  msg.msg_iovlen = static_cast<size_t>(iovCount);
  for (;;) {
    ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0) return n;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    *err = errno;
    return -1;
  }
}

// Reads what is available now. Returns bytes read (>0), 0 when nothing is available, -1 on EOF
// (*err = 0) or error (*err = errno).
ssize_t RecvSome(int fd, void* buf, size_t len, int* err) {
  for (;;) {
    ssize_t n = ::recv(fd, buf, len, MSG_DONTWAIT);
    if (n > 0) return n;
    if (n == 0) {
      *err = 0;
      return -1;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    *err = errno;
    return -1;
  }
}

// Best-effort, non-blocking write of a whole small message (used for acks, rejects, aborts).
bool SendSmallNow(int fd, const void* data, size_t len) {
  iovec iov{const_cast<void*>(data), len};
  int err = 0;
  return SendSome(fd, &iov, 1, &err) == static_cast<ssize_t>(len);
}

bool SendFrameNow(int fd, FrameType type, int srcRank, uint32_t step, uint64_t seq,
                  const std::string& text) {
  std::string msg(sizeof(FrameHeader), '\0');
  FrameHeader h = MakeHeader(type, srcRank, step, seq, text.size());
  std::memcpy(&msg[0], &h, sizeof(h));
  msg += text;
  return SendSmallNow(fd, msg.data(), msg.size());
}

int PollOnce(std::vector<pollfd>& fds, int timeoutMs) {
  int rc = ::poll(fds.data(), fds.size(), timeoutMs);
  if (rc == -1) {
    if (errno == EINTR) return 0;
    int e = errno;
    MORI_THROW(SystemError, "poll() failed in the socket bootstrap: %s (errno %d)",
               std::strerror(e), e);
  }
  return rc;
}

}  // namespace

// ---- unique id
// -----------------------------------------------------------------------------------

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

  RegisterListener(id.nonce, std::move(fd));
  MORI_INFO(kLogBootstrap, "created socket unique id: root listens on %s",
            bound.ToString().c_str());
  return id;
}

void SocketBootstrapNetwork::ReleaseUniqueId(const SocketUniqueId& id) {
  Fd fd = TakeRegisteredListener(id.nonce);  // closed here
}

size_t SocketBootstrapNetwork::PendingUniqueIdCount() {
  Registry& reg = GetRegistry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  ExpireListenersLocked(reg);
  return reg.listeners.size();
}

// ---- the network
// ---------------------------------------------------------------------------------

struct SocketBootstrapNetwork::Impl {
  struct Conn {
    Fd fd;
    bool atBoundary = true;  // no frame half-sent: an abort frame may be appended
  };
  struct PendingAccept {
    Fd fd;
    Endpoint4 from;
    Hello hello{};
    size_t got = 0;
  };

  int rank = 0;
  int worldSize = 1;
  uint64_t nonce[2] = {0, 0};
  int64_t timeoutSec = 120;
  SocketAllToAllAlgorithm allToAll = SocketAllToAllAlgorithm::kAuto;
  Endpoint4 rootAddr;
  Fd listener;
  Endpoint4 listenAddr;
  std::vector<Endpoint4> addrs;
  std::vector<Conn> conns;
  std::vector<PendingAccept> pending;
  // The root's connection carrying the address table. It becomes conns[0] only when rank 0 is an
  // eager peer; otherwise rank 0 may open a separate kPeer connection later (even before the
  // table has been read here), which is why the two are told apart by the hello kind.
  Fd tableConn;
  bool waitingTable = false;
  bool allPeersConnected = false;
  uint64_t seq = 0;
  bool finalized = false;
  std::string brokenReason;

  Deadline NewDeadline() const { return Deadline::AfterSeconds(timeoutSec); }

  // rank r's peers at distance ±2^k: the ring (k = 0) and the dissemination barrier / Bruck set.
  std::vector<int> EagerPeers() const {
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
  bool IsEagerPeer(int p) const {
    auto e = EagerPeers();
    return std::binary_search(e.begin(), e.end(), p);
  }

  void CloseAll() {
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

  // Tell every connected peer why we fail (best effort, never blocks), then close everything.
  void Break(core::ErrorKind kind, const std::string& reason) {
    if (brokenReason.empty()) brokenReason = reason.empty() ? "unknown error" : reason;
    std::string text = reason.substr(0, kMaxErrorText);
    for (auto& c : conns)
      if (c.fd.Valid() && c.atBoundary)
        (void)SendFrameNow(c.fd.Get(), FrameType::kAbort, rank, static_cast<uint32_t>(kind), seq,
                           text);
    CloseAll();
  }

  template <typename F>
  void Guarded(F&& body) {
    try {
      body();
    } catch (const core::Error& e) {
      Break(e.Kind(), e.Message());
      throw;
    } catch (const std::exception& e) {
      Break(core::ErrorKind::kInternal, e.what());
      throw;
    }
  }

  void CheckUsable(const char* what) const {
    MORI_ENSURE(!finalized, InvalidUsageError, "socket bootstrap rank %d: %s after Finalize", rank,
                what);
    MORI_ENSURE(brokenReason.empty(), InvalidUsageError,
                "socket bootstrap rank %d: %s on a network broken by an earlier error (%s)", rank,
                what, brokenReason.c_str());
  }

  // Raises the error an abort or reject frame carries. `text` is the sender's reason.
  [[noreturn]] void RaiseFromErrorFrame(const FrameHeader& h, int peer, const std::string& text,
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

  // ---- one send and/or one receive of a frame, progressed together --------------------------
  // Waiting without progress for timeoutSec raises TimeoutError naming the peer(s).
  struct SendSpec {
    int fd = -1;
    int peer = -1;
    bool* atBoundary = nullptr;
    FrameHeader header{};
    const void* data = nullptr;
  };
  struct RecvSpec {
    int fd = -1;
    int peer = -1;
    FrameType type = FrameType::kAck;
    uint32_t step = 0;
    uint64_t seq = 0;
    void* data = nullptr;
    uint64_t length = 0;
  };

  void ReadErrorText(int fd, int peer, const FrameHeader& h, const char* what) const {
    std::string text;
    if (h.length > kMaxErrorText)
      MORI_THROW(RemoteError, "rank %d: %s: rank %d sent a %s frame of %llu bytes (corrupted?)",
                 rank, what, peer, FrameTypeName(h.type),
                 static_cast<unsigned long long>(h.length));
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

  void CheckHeader(const FrameHeader& h, const RecvSpec& r, const std::string& what) const {
    const char* w = what.c_str();
    if (h.magic != kFrameMagic)
      MORI_THROW(RemoteError, "rank %d: %s: corrupted stream from rank %d (frame magic 0x%08x)",
                 rank, w, r.peer, h.magic);
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

  void Exchange(SendSpec* s, RecvSpec* r, const std::string& what) {
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

  Conn& ConnTo(int peer) {
    Conn& c = conns[static_cast<size_t>(peer)];
    if (!c.fd.Valid()) MORI_THROW(InternalError, "rank %d: no connection to rank %d", rank, peer);
    return c;
  }

  // Sends `sendLen` bytes to `to` and receives `recvLen` bytes from `from` as one step of a
  // collective (either side may be skipped with -1).
  void Step(FrameType type, uint32_t step, int to, const void* sendData, size_t sendLen, int from,
            void* recvData, size_t recvLen, const char* what) {
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

  // ---- accepting and identifying incoming connections ------------------------------------------

  void AcceptPending() {
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

  // Reads hello bytes of pending[i]. Returns true when complete; drops the entry (and returns
  // false) when the peer closed first.
  bool ReadHello(size_t i) {
    PendingAccept& p = pending[i];
    int err = 0;
    ssize_t n = RecvSome(p.fd.Get(), reinterpret_cast<char*>(&p.hello) + p.got,
                         sizeof(Hello) - p.got, &err);
    if (n < 0) {
      MORI_DEBUG(kLogBootstrap, "rank %d: connection from %s closed before a complete hello", rank,
                 p.from.ToString().c_str());
      p.fd.Reset();
      return false;
    }
    p.got += static_cast<size_t>(n);
    return p.got == sizeof(Hello);
  }

  // Empty when the hello is acceptable, else the reason.
  std::string CheckHelloCommon(const Hello& h, HelloKind kind) const {
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

  // Identifies pending peer connections (hello kind kPeer from a lower rank); pending[k] is polled
  // in fds[firstPending + k]. Appends the ranks identified to *identified.
  void ServicePeerAccepts(const std::vector<pollfd>& fds, size_t firstPending, size_t count,
                          std::vector<int>* identified) {
    for (size_t k = 0; k < count; k++) {
      size_t i = firstPending + k;
      if (fds[i].revents == 0) continue;
      if (!ReadHello(k)) continue;  // pending entries keep their order within this call
      PendingAccept& p = pending[k];
      bool isTable = p.hello.kind == static_cast<uint32_t>(HelloKind::kRootTable);
      std::string why =
          CheckHelloCommon(p.hello, isTable ? HelloKind::kRootTable : HelloKind::kPeer);
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
        why = core::StrFormat("rank %d connected to rank %d, but the lower rank connects", from,
                              rank);
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

  // Makes sure a connection to every rank in `peers` exists: opens the ones to higher ranks,
  // accepts the ones from lower ranks (connections from other lower ranks are kept as well).
  // With waitTable (rendezvous of a non-root rank) it also waits for the root's connection and
  // reads the address table from it.
  void EnsureConnections(const std::vector<int>& peers, const char* what, bool waitTable = false) {
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
          MORI_THROW(RemoteError, "rank %d: %s: sending the hello to rank %d failed: %s", rank,
                     what, o.peer, std::strerror(err));
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

  // ---- rendezvous ------------------------------------------------------------------------------

  void ReceiveTable() {
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

  Fd ConnectToRoot(const Deadline& dl) {
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

  void ClientRendezvous() {
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

  // Root: connects to an arrived rank and sends hello + the given frame; returns the connection.
  Fd RootSendTo(int r, FrameType type, uint32_t step, const void* payload, size_t len,
                const Deadline& dl) {
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

  // Root failed during rendezvous: tell the ranks that arrived (best effort, bounded).
  void RootAbortArrived(const std::vector<char>& arrived, int firstRank, core::ErrorKind kind,
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

  std::string CheckRendezvousHello(const Hello& h, const std::vector<char>& arrived) const {
    std::string why = CheckHelloCommon(h, HelloKind::kRendezvous);
    if (!why.empty()) return why;
    if (h.rank == 0) return "rank 0 is the root; another process claims rank 0";
    if (arrived[static_cast<size_t>(h.rank)])
      return core::StrFormat("duplicate rank %d: rank %d already connected from %s", h.rank, h.rank,
                             addrs[static_cast<size_t>(h.rank)].ToString().c_str());
    if (h.listenIp == 0 || h.listenPort == 0) return "no listen address in the hello";
    return "";
  }

  void RootRendezvous() {
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
                            listenAddr.ToString().c_str(), RankListPhrase(missing).c_str(),
                            worldSize, static_cast<long long>(timeoutSec));
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
};

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
    m.listener = TakeRegisteredListener(m.nonce);
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

SocketBootstrapNetwork::~SocketBootstrapNetwork() {
  Finalize();
}

int SocketBootstrapNetwork::Rank() const {
  return impl->rank;
}
int SocketBootstrapNetwork::WorldSize() const {
  return impl->worldSize;
}

void SocketBootstrapNetwork::Finalize() {
  if (!impl || impl->finalized) return;
  impl->CloseAll();
  impl->finalized = true;
}

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

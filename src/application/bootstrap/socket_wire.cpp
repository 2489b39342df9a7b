#include "socket_wire.hpp"

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "mori/core/errors.hpp"

namespace mori::application::detail {

const char* FrameTypeName(uint16_t t) {
  switch (static_cast<FrameType>(t)) {
    case FrameType::kAck: return "ack";
    case FrameType::kReject: return "reject";
    case FrameType::kTable: return "address table";
    case FrameType::kAbort: return "abort";
    case FrameType::kAllgather: return "Allgather";
    case FrameType::kAllToAll: return "AllToAll";
    case FrameType::kBarrier: return "Barrier";
  }
  return "unknown";
}

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

bool SendFrameNow(int fd, FrameType type, int srcRank, uint32_t step, uint64_t seq,
                  const std::string& text) {
  std::string msg(sizeof(FrameHeader), '\0');
  FrameHeader h = MakeHeader(type, srcRank, step, seq, text.size());
  std::memcpy(&msg[0], &h, sizeof(h));
  msg += text;
  iovec iov{&msg[0], msg.size()};
  int err = 0;
  return SendSome(fd, &iov, 1, &err) == static_cast<ssize_t>(msg.size());
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

std::string RankListPhrase(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  const size_t shown = std::min<size_t>(ranks.size(), 32);
  for (size_t i = 0; i < shown; i++) s += (i ? "," : "") + std::to_string(ranks[i]);
  if (shown < ranks.size()) s += core::StrFormat(",... (%zu in all)", ranks.size());
  return s;
}

}  // namespace mori::application::detail

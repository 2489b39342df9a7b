#include "socket_util.hpp"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "mori/core/errors.hpp"

namespace mori::application::detail {

void Fd::Reset(int newFd) {
  if (fd >= 0) ::close(fd);  // close() errors are not actionable here
  fd = newFd;
}

int Deadline::RemainingMs(int capMs) const {
  auto left = std::chrono::duration_cast<std::chrono::microseconds>(end - Clock::now()).count();
  if (left <= 0) return 0;
  int64_t ms = (left + 999) / 1000;
  return ms > capMs ? capMs : static_cast<int>(ms);
}

std::string Endpoint4::ToString() const {
  char buf[INET_ADDRSTRLEN] = {};
  in_addr a{};
  a.s_addr = ip;
  inet_ntop(AF_INET, &a, buf, sizeof(buf));
  return core::StrFormat("%s:%u", buf, static_cast<unsigned>(ntohs(port)));
}

uint32_t ChooseLocalIp(const std::string& ifname) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) == -1) {
    int e = errno;
    if (!ifname.empty())
      MORI_THROW(SystemError, "getifaddrs failed while looking up MORI_SOCKET_IFNAME=%s: %s",
                 ifname.c_str(), std::strerror(e));
    return htonl(INADDR_LOOPBACK);
  }
  uint32_t found = 0;
  bool haveFound = false;
  for (ifaddrs* it = list; it != nullptr && !haveFound; it = it->ifa_next) {
    if (it->ifa_addr == nullptr || it->ifa_addr->sa_family != AF_INET) continue;
    uint32_t ip = reinterpret_cast<const sockaddr_in*>(it->ifa_addr)->sin_addr.s_addr;
    if (!ifname.empty()) {
      if (ifname == it->ifa_name) {
        found = ip;
        haveFound = true;
      }
      continue;
    }
    if (!(it->ifa_flags & IFF_UP) || (it->ifa_flags & IFF_LOOPBACK)) continue;
    if ((ntohl(ip) >> 24) == 127) continue;
    found = ip;
    haveFound = true;
  }
  freeifaddrs(list);
  if (haveFound) return found;
  if (!ifname.empty())
    MORI_THROW(InvalidUsageError,
               "MORI_SOCKET_IFNAME=%s: no interface of that name has an IPv4 "
               "address",
               ifname.c_str());
  return htonl(INADDR_LOOPBACK);
}

namespace {

sockaddr_in ToSockaddr(const Endpoint4& e) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = e.ip;
  sa.sin_port = e.port;
  return sa;
}

Endpoint4 FromSockaddr(const sockaddr_in& sa) { return Endpoint4{sa.sin_addr.s_addr, sa.sin_port}; }

void TuneStream(int fd) {
  int one = 1;
  // Bootstrap messages are small and latency-bound; failure to set this is harmless.
  (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

}  // namespace

Fd Listen(const Endpoint4& addr, Endpoint4* bound, const char* what) {
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.Valid()) {
    int e = errno;
    MORI_THROW(SystemError, "%s: socket() failed: %s (errno %d)", what, std::strerror(e), e);
  }
  int one = 1;
  (void)setsockopt(fd.Get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in sa = ToSockaddr(addr);
  if (::bind(fd.Get(), reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == -1) {
    int e = errno;
    MORI_THROW(SystemError, "%s: bind(%s) failed: %s (errno %d)", what, addr.ToString().c_str(),
               std::strerror(e), e);
  }
  if (::listen(fd.Get(), SOMAXCONN) == -1) {
    int e = errno;
    MORI_THROW(SystemError, "%s: listen(%s) failed: %s (errno %d)", what, addr.ToString().c_str(),
               std::strerror(e), e);
  }
  if (bound != nullptr) *bound = LocalEndpoint(fd.Get());
  return fd;
}

Fd AcceptOne(int listenFd, Endpoint4* peer) {
  sockaddr_in sa{};
  socklen_t len = sizeof(sa);
  int fd =
      ::accept4(listenFd, reinterpret_cast<sockaddr*>(&sa), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
  if (fd == -1) {
    int e = errno;
    switch (e) {
      case EAGAIN:
#if EAGAIN != EWOULDBLOCK
      case EWOULDBLOCK:
#endif
      case EINTR:
      case ECONNABORTED:
      case EPROTO:
      case ENETDOWN:
      case ENOPROTOOPT:
      case EHOSTDOWN:
      case ENONET:
      case EHOSTUNREACH:
      case EOPNOTSUPP:
      case ENETUNREACH: return Fd();
      default:
        MORI_THROW(SystemError, "accept() on the bootstrap listener failed: %s (errno %d)",
                   std::strerror(e), e);
    }
  }
  TuneStream(fd);
  if (peer != nullptr) *peer = FromSockaddr(sa);
  return Fd(fd);
}

Fd StartConnect(const Endpoint4& to, int* err) {
  *err = 0;
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.Valid()) {
    int e = errno;
    MORI_THROW(SystemError, "socket() failed: %s (errno %d)", std::strerror(e), e);
  }
  TuneStream(fd.Get());
  sockaddr_in sa = ToSockaddr(to);
  int rc;
  do {
    rc = ::connect(fd.Get(), reinterpret_cast<sockaddr*>(&sa), sizeof(sa));
  } while (rc == -1 && errno == EINTR);
  if (rc == -1 && errno != EINPROGRESS) {
    *err = errno;
    return Fd();
  }
  return fd;
}

int ConnectResult(int fd) {
  int soErr = 0;
  socklen_t len = sizeof(soErr);
  if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soErr, &len) == -1) return errno;
  return soErr;
}

Endpoint4 LocalEndpoint(int fd) {
  sockaddr_in sa{};
  socklen_t len = sizeof(sa);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) == -1) {
    int e = errno;
    MORI_THROW(SystemError, "getsockname() failed: %s (errno %d)", std::strerror(e), e);
  }
  return FromSockaddr(sa);
}

void SleepMs(int ms, const Deadline& deadline) {
  int wait = deadline.RemainingMs(ms);
  if (wait > 0) ::poll(nullptr, 0, wait);
}

}  // namespace mori::application::detail

// Internal helpers of the socket bootstrap: an owning fd, deadlines, IPv4 endpoints, listeners and
// non-blocking connects. Every socket made here is non-blocking and close-on-exec.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace mori::application::detail {

// Owns one file descriptor; closes it on destruction. Move-only.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd(fd) {}
  Fd(Fd&& other) noexcept : fd(other.Release()) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) Reset(other.Release());
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { Reset(); }

  int Get() const { return fd; }
  bool Valid() const { return fd >= 0; }
  int Release() {
    int f = fd;
    fd = -1;
    return f;
  }
  void Reset(int newFd = -1);

 private:
  int fd = -1;
};

// A point in time after which a wait gives up.
class Deadline {
 public:
  using Clock = std::chrono::steady_clock;
  static Deadline AfterSeconds(int64_t seconds) {
    return Deadline(Clock::now() + std::chrono::seconds(seconds));
  }
  static Deadline AfterMilliseconds(int64_t ms) {
    return Deadline(Clock::now() + std::chrono::milliseconds(ms));
  }
  bool Expired() const { return Clock::now() >= end; }
  // Milliseconds left, rounded up, clamped to [0, capMs] (for poll()).
  int RemainingMs(int capMs = 1 << 30) const;
  Deadline Earlier(const Deadline& other) const { return end < other.end ? *this : other; }

 private:
  explicit Deadline(Clock::time_point end) : end(end) {}
  Clock::time_point end;
};

// IPv4 endpoint, both fields in network byte order.
struct Endpoint4 {
  uint32_t ip = 0;
  uint16_t port = 0;
  std::string ToString() const;
  bool operator==(const Endpoint4& o) const { return ip == o.ip && port == o.port; }
};

// The IPv4 address the root listener binds to: the address of interface `ifname` when given
// (InvalidUsageError if it has none), else the first up, non-loopback interface, else 127.0.0.1.
uint32_t ChooseLocalIp(const std::string& ifname);

// socket + SO_REUSEADDR + bind + listen(SOMAXCONN). port 0 lets the kernel choose; the endpoint
// actually bound is returned through `bound`. Raises SystemError naming `what`.
Fd Listen(const Endpoint4& addr, Endpoint4* bound, const char* what);

// accept4 on a non-blocking listener; an invalid Fd when nothing is pending. Transient errors
// (ECONNABORTED, EINTR, ...) also yield an invalid Fd; hard errors raise SystemError.
Fd AcceptOne(int listenFd, Endpoint4* peer);

// Starts a non-blocking connect. On immediate failure returns an invalid Fd and sets *err.
Fd StartConnect(const Endpoint4& to, int* err);
// After POLLOUT on a connecting socket: 0 when connected, else the errno of the failure.
int ConnectResult(int fd);

Endpoint4 LocalEndpoint(int fd);

// Sleep up to `ms`, not past the deadline.
void SleepMs(int ms, const Deadline& deadline);

}  // namespace mori::application::detail

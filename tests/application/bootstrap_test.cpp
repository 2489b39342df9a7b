// Bootstrap tests. Multi-rank cases fork one process per rank on localhost; each child runs a body,
// writes a one-line report to a pipe and leaves with _exit (gtest in the child never reports).
// Children carry an alarm(); the parent kills whatever is left after its own deadline.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "mori/application/bootstrap/callback_bootstrap.hpp"
#include "mori/application/bootstrap/socket_bootstrap.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"

namespace mori::application {
namespace {

using core::ErrorKind;

constexpr int kChildAlarmSec = 25;
constexpr int kParentDeadlineSec = 30;

// ---- process harness -------------------------------------------------------------------------

struct Outcome {
  std::string report;  // "OK ...", "ERR <Kind> <message>", or empty if the child wrote nothing
  bool exited = false;
  int exitCode = -1;
  int signal = 0;

  bool Ok() const { return report.rfind("OK", 0) == 0; }
  bool Err(const char* kind) const {
    return report.rfind(std::string("ERR ") + kind + " ", 0) == 0;
  }
  bool Mentions(const std::string& s) const { return report.find(s) != std::string::npos; }
};

const char* KindTag(ErrorKind k) {
  switch (k) {
    case ErrorKind::kInvalidUsage: return "InvalidUsage";
    case ErrorKind::kTimeout: return "Timeout";
    case ErrorKind::kSystem: return "System";
    case ErrorKind::kGpuRuntime: return "GpuRuntime";
    case ErrorKind::kRemote: return "Remote";
    case ErrorKind::kInternal: return "Internal";
  }
  return "?";
}

void SetBootstrapTimeout(int seconds) {
  setenv("MORI_BOOTSTRAP_TIMEOUT", std::to_string(seconds).c_str(), 1);
  core::ReloadEnv();
}

// Sets one variable in this process for the scope, then restores it and the env snapshot.
class ScopedEnvVar {
 public:
  ScopedEnvVar(const char* name, const std::string& value) : name(name) {
    const char* old = std::getenv(name);
    hadOld = old != nullptr;
    if (hadOld) oldValue = old;
    setenv(name, value.c_str(), 1);
    core::ReloadEnv();
  }
  ~ScopedEnvVar() {
    if (hadOld)
      setenv(name, oldValue.c_str(), 1);
    else
      unsetenv(name);
    core::ReloadEnv();
  }

 private:
  const char* name;
  bool hadOld = false;
  std::string oldValue;
};

// Runs body(i) for i in [0, count) in `count` forked children and collects their reports.
std::vector<Outcome> RunProcesses(int count, const std::function<std::string(int)>& body,
                                  int childTimeoutSec = 10) {
  std::vector<int> readFds(static_cast<size_t>(count), -1);
  std::vector<pid_t> pids(static_cast<size_t>(count), -1);
  for (int i = 0; i < count; i++) {
    int p[2];
    if (pipe(p) != 0) throw std::runtime_error("pipe failed");
    pid_t pid = fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid == 0) {
      close(p[0]);
      for (int j = 0; j < i; j++) close(readFds[static_cast<size_t>(j)]);
      alarm(kChildAlarmSec);
      std::string report;
      try {
        SetBootstrapTimeout(childTimeoutSec);
        report = body(i);
      } catch (const core::Error& e) {
        report = std::string("ERR ") + KindTag(e.Kind()) + " " + e.Message();
      } catch (const std::exception& e) {
        report = std::string("ERR std ") + e.what();
      }
      size_t off = 0;
      while (off < report.size()) {
        ssize_t n = write(p[1], report.data() + off, report.size() - off);
        if (n <= 0) break;
        off += static_cast<size_t>(n);
      }
      _exit(0);
    }
    close(p[1]);
    readFds[static_cast<size_t>(i)] = p[0];
    pids[static_cast<size_t>(i)] = pid;
  }

  std::vector<Outcome> out(static_cast<size_t>(count));
  std::vector<bool> open(static_cast<size_t>(count), true);
  auto end = std::chrono::steady_clock::now() + std::chrono::seconds(kParentDeadlineSec);
  for (;;) {
    std::vector<pollfd> fds;
    std::vector<int> idx;
    for (int i = 0; i < count; i++)
      if (open[static_cast<size_t>(i)]) {
        fds.push_back({readFds[static_cast<size_t>(i)], POLLIN, 0});
        idx.push_back(i);
      }
    if (fds.empty()) break;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                    end - std::chrono::steady_clock::now())
                    .count();
    if (left <= 0) break;
    if (poll(fds.data(), fds.size(), static_cast<int>(left)) <= 0) continue;
    for (size_t k = 0; k < fds.size(); k++) {
      if (!fds[k].revents) continue;
      char buf[4096];
      ssize_t n = read(fds[k].fd, buf, sizeof(buf));
      size_t i = static_cast<size_t>(idx[k]);
      if (n > 0)
        out[i].report.append(buf, static_cast<size_t>(n));
      else
        open[i] = false;
    }
  }
  for (int i = 0; i < count; i++) {
    if (open[static_cast<size_t>(i)]) kill(pids[static_cast<size_t>(i)], SIGKILL);
    close(readFds[static_cast<size_t>(i)]);
    int status = 0;
    waitpid(pids[static_cast<size_t>(i)], &status, 0);
    Outcome& o = out[static_cast<size_t>(i)];
    o.exited = WIFEXITED(status);
    o.exitCode = o.exited ? WEXITSTATUS(status) : -1;
    o.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
  }
  if (std::getenv("BOOTSTRAP_TEST_VERBOSE") != nullptr) {
    for (size_t i = 0; i < out.size(); i++)
      std::fprintf(stderr, "  [%zu] exit=%d sig=%d %s\n", i, out[i].exitCode, out[i].signal,
                   out[i].report.c_str());
  }
  return out;
}

std::string Dump(const std::vector<Outcome>& outs) {
  std::string s;
  for (size_t i = 0; i < outs.size(); i++)
    s += "  [" + std::to_string(i) + "] exit=" + std::to_string(outs[i].exitCode) +
         " sig=" + std::to_string(outs[i].signal) + " " + outs[i].report + "\n";
  return s;
}

void ExpectAllOk(const std::vector<Outcome>& outs) {
  for (const auto& o : outs) EXPECT_TRUE(o.Ok()) << Dump(outs);
}

// Memory shared by the parent and its children (for gates and barrier checks).
template <typename T>
class Shared {
 public:
  explicit Shared(size_t count) : count(count) {
    void* p =
        mmap(nullptr, sizeof(T) * count, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("mmap failed");
    ptr = static_cast<T*>(p);
    for (size_t i = 0; i < count; i++) new (&ptr[i]) T();
  }
  ~Shared() { munmap(ptr, sizeof(T) * count); }
  T& operator[](size_t i) { return ptr[i]; }

 private:
  T* ptr;
  size_t count;
};

bool WaitFlag(std::atomic<int>& flag, int seconds) {
  auto end = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  while (flag.load() == 0) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

// Deterministic content every rank can recompute: byte j of the block rank `src` gives `dst`.
uint8_t PatternByte(uint64_t seed, int src, int dst, size_t j) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(src) * 0xBF58476D1CE4E5B9ULL +
               static_cast<uint64_t>(dst) * 0x94D049BB133111EBULL + j;
  x ^= x >> 31;
  x *= 0xD6E8FEB86659FD3BULL;
  x ^= x >> 29;
  return static_cast<uint8_t>(x);
}
void Fill(uint8_t* p, size_t n, uint64_t seed, int src, int dst) {
  for (size_t j = 0; j < n; j++) p[j] = PatternByte(seed, src, dst, j);
}
// Returns "" or a description of the first mismatch.
std::string Check(const uint8_t* p, size_t n, uint64_t seed, int src, int dst) {
  for (size_t j = 0; j < n; j++)
    if (p[j] != PatternByte(seed, src, dst, j))
      return "byte " + std::to_string(j) + " of block " + std::to_string(src) + "->" +
             std::to_string(dst) + " is wrong";
  return "";
}

// Allgather of `bytes` per rank with fresh data; "" or the mismatch.
std::string VerifiedAllgather(BootstrapNetwork& net, size_t bytes, uint64_t seed) {
  int n = net.WorldSize(), me = net.Rank();
  std::vector<uint8_t> send(bytes), recv(bytes * static_cast<size_t>(n) + 1, 0xEE);
  Fill(send.data(), bytes, seed, me, -1);
  net.Allgather(send.data(), recv.data(), bytes);
  for (int r = 0; r < n; r++) {
    std::string bad = Check(recv.data() + static_cast<size_t>(r) * bytes, bytes, seed, r, -1);
    if (!bad.empty()) return "Allgather(" + std::to_string(bytes) + "): " + bad;
  }
  if (recv.back() != 0xEE) return "Allgather wrote past the end";
  return "";
}

std::string VerifiedAllToAll(BootstrapNetwork& net, size_t bytes, uint64_t seed) {
  int n = net.WorldSize(), me = net.Rank();
  std::vector<uint8_t> send(bytes * static_cast<size_t>(n)),
      recv(bytes * static_cast<size_t>(n) + 1, 0xEE);
  for (int p = 0; p < n; p++)
    Fill(send.data() + static_cast<size_t>(p) * bytes, bytes, seed, me, p);
  net.AllToAll(send.data(), recv.data(), bytes);
  for (int r = 0; r < n; r++) {
    std::string bad = Check(recv.data() + static_cast<size_t>(r) * bytes, bytes, seed, r, me);
    if (!bad.empty()) return "AllToAll(" + std::to_string(bytes) + "): " + bad;
  }
  if (recv.back() != 0xEE) return "AllToAll wrote past the end";
  return "";
}

#define RETURN_IF_BAD(expr)                  \
  do {                                       \
    std::string bad_ = (expr);               \
    if (!bad_.empty()) return "BAD " + bad_; \
  } while (0)

// An id made in this (parent) process: rank 0's child adopts the inherited listener. The parent's
// registry entry is released once the children are running.
class ParentId {
 public:
  ParentId() : id(SocketBootstrapNetwork::CreateUniqueId()) {}
  ~ParentId() { SocketBootstrapNetwork::ReleaseUniqueId(id); }
  SocketUniqueId id;
};

// A raw TCP connection to the root of `id` (the parent plays a misbehaving peer).
int ConnectRaw(const SocketUniqueId& id) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = id.ipv4;
  sa.sin_port = id.port;
  if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Everything the peer sends until EOF or `seconds` pass.
std::string ReadAll(int fd, int seconds) {
  std::string s;
  auto end = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                    end - std::chrono::steady_clock::now())
                    .count();
    if (left <= 0) break;
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left)) <= 0) continue;
    char buf[4096];
    ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    s.append(buf, static_cast<size_t>(n));
  }
  return s;
}

// ---- unique id and argument checks (no network) ----------------------------------------------

TEST(SocketUniqueIdTest, LayoutAndCreation) {
  static_assert(sizeof(SocketUniqueId) == 128, "128-byte id");
  SocketUniqueId a = SocketBootstrapNetwork::CreateUniqueId();
  SocketUniqueId b = SocketBootstrapNetwork::CreateUniqueId();
  EXPECT_EQ(a.magic, kSocketUniqueIdMagic);
  EXPECT_EQ(a.version, kSocketUniqueIdVersion);
  EXPECT_NE(a.port, 0);
  EXPECT_NE(a.ipv4, 0u);
  EXPECT_TRUE(a.nonce[0] != b.nonce[0] || a.nonce[1] != b.nonce[1]);
  EXPECT_NE(a.port, b.port);  // both listeners are open at once

  SocketUniqueId c = SocketUniqueIdFromBytes(&a, sizeof(a));
  EXPECT_EQ(0, std::memcmp(&a, &c, sizeof(a)));
  EXPECT_THROW(SocketUniqueIdFromBytes(&a, 64), core::InvalidUsageError);
  SocketUniqueId bad = a;
  bad.magic ^= 1;
  EXPECT_THROW(SocketUniqueIdFromBytes(&bad, sizeof(bad)), core::InvalidUsageError);
  bad = a;
  bad.version = 99;
  EXPECT_THROW(SocketUniqueIdFromBytes(&bad, sizeof(bad)), core::InvalidUsageError);

  SocketBootstrapNetwork::ReleaseUniqueId(a);
  SocketBootstrapNetwork::ReleaseUniqueId(b);
  SocketBootstrapNetwork::ReleaseUniqueId(b);  // unknown by now: no-op
}

// ---- lifetime of unadopted unique-id listeners ------------------------------------------------

bool Listening(const SocketUniqueId& id) {
  int fd = ConnectRaw(id);
  if (fd < 0) return false;
  close(fd);
  return true;
}

TEST(SocketUniqueIdTest, UnusedListenerExpiresAfterBootstrapTimeout) {
  ScopedEnvVar timeout("MORI_BOOTSTRAP_TIMEOUT", "1");
  SocketUniqueId stale = SocketBootstrapNetwork::CreateUniqueId();
  EXPECT_TRUE(Listening(stale));
  std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  SocketUniqueId fresh = SocketBootstrapNetwork::CreateUniqueId();  // registry access: expiry
  EXPECT_EQ(SocketBootstrapNetwork::PendingUniqueIdCount(), 1u);    // everything older is gone
  EXPECT_FALSE(Listening(stale));
  EXPECT_TRUE(Listening(fresh));
  SocketBootstrapNetwork::ReleaseUniqueId(fresh);
  EXPECT_EQ(SocketBootstrapNetwork::PendingUniqueIdCount(), 0u);
  EXPECT_FALSE(Listening(fresh));
}

TEST(SocketUniqueIdTest, PendingListenersAreCapped) {
  ScopedEnvVar timeout("MORI_BOOTSTRAP_TIMEOUT", "120");
  const size_t before = SocketBootstrapNetwork::PendingUniqueIdCount();
  std::vector<SocketUniqueId> ids;
  for (int i = 0; i < 70; i++) ids.push_back(SocketBootstrapNetwork::CreateUniqueId());
  EXPECT_EQ(SocketBootstrapNetwork::PendingUniqueIdCount(), 64u);
  if (before == 0) {
    for (int i = 0; i < 6; i++) EXPECT_FALSE(Listening(ids[static_cast<size_t>(i)])) << i;
    for (int i = 6; i < 70; i++) EXPECT_TRUE(Listening(ids[static_cast<size_t>(i)])) << i;
  }
  for (const SocketUniqueId& id : ids) SocketBootstrapNetwork::ReleaseUniqueId(id);
  EXPECT_EQ(SocketBootstrapNetwork::PendingUniqueIdCount(), 0u);
}

TEST(SocketUniqueIdTest, MakerThatIsNotRootClosesItsListenerWhenTheBootstrapEnds) {
  // This process makes the id and joins as rank 1; rank 0 is a child process (it adopts its
  // inherited copy of the listener). Once rank 1's bootstrap is up, this process's copy is closed.
  ScopedEnvVar timeout("MORI_BOOTSTRAP_TIMEOUT", "10");
  const size_t before = SocketBootstrapNetwork::PendingUniqueIdCount();
  SocketUniqueId id = SocketBootstrapNetwork::CreateUniqueId();
  ASSERT_EQ(SocketBootstrapNetwork::PendingUniqueIdCount(), before + 1);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    alarm(kChildAlarmSec);
    int code = 2;
    try {
      SocketBootstrapNetwork net(id, 0, 2);
      code = VerifiedAllgather(net, 64, 7).empty() ? 0 : 1;
      net.Barrier();
    } catch (...) {
      code = 3;
    }
    _exit(code);
  }
  {
    SocketBootstrapNetwork net(id, 1, 2);
    EXPECT_EQ(VerifiedAllgather(net, 64, 7), "");
    EXPECT_EQ(SocketBootstrapNetwork::PendingUniqueIdCount(), before);
    net.Barrier();
  }
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  // A failed bootstrap releases it too.
  SocketUniqueId other = SocketBootstrapNetwork::CreateUniqueId();
  {
    ScopedEnvVar shortTimeout("MORI_BOOTSTRAP_TIMEOUT", "1");
    EXPECT_THROW(SocketBootstrapNetwork(other, 1, 2), core::TimeoutError);  // rank 0 never comes
  }
  EXPECT_EQ(SocketBootstrapNetwork::PendingUniqueIdCount(), before);
}

TEST(SocketUniqueIdTest, InterfaceSelection) {
  {
    ScopedEnvVar ifname("MORI_SOCKET_IFNAME", "lo");
    SocketUniqueId id = SocketBootstrapNetwork::CreateUniqueId();
    EXPECT_EQ(ntohl(id.ipv4), INADDR_LOOPBACK);
    SocketBootstrapNetwork::ReleaseUniqueId(id);
  }
  {
    ScopedEnvVar ifname("MORI_SOCKET_IFNAME", "no-such-if0");
    EXPECT_THROW(SocketBootstrapNetwork::CreateUniqueId(), core::InvalidUsageError);
  }
}

TEST(SocketBootstrapTest, InvalidArguments) {
  ParentId pid;
  EXPECT_THROW(SocketBootstrapNetwork(pid.id, 0, 0), core::InvalidUsageError);
  EXPECT_THROW(SocketBootstrapNetwork(pid.id, -1, 2), core::InvalidUsageError);
  EXPECT_THROW(SocketBootstrapNetwork(pid.id, 2, 2), core::InvalidUsageError);
  SocketUniqueId bad = pid.id;
  bad.magic = 0;
  EXPECT_THROW(SocketBootstrapNetwork(bad, 0, 2), core::InvalidUsageError);
}

TEST(SocketBootstrapTest, SingleRankAndFinalize) {
  SocketUniqueId id = SocketBootstrapNetwork::CreateUniqueId();
  SocketBootstrapNetwork net(id, 0, 1);
  EXPECT_EQ(net.Rank(), 0);
  EXPECT_EQ(net.WorldSize(), 1);
  EXPECT_EQ(VerifiedAllgather(net, 100, 1), "");
  EXPECT_EQ(VerifiedAllToAll(net, 100, 2), "");
  EXPECT_EQ(VerifiedAllgather(net, 0, 3), "");
  net.Barrier();
  std::vector<uint8_t> buf(8, 7);
  net.Allgather(buf.data(), buf.data(), 8);  // in place
  EXPECT_EQ(buf[0], 7);
  EXPECT_THROW(net.Allgather(nullptr, buf.data(), 8), core::InvalidUsageError);
  net.Finalize();
  net.Finalize();
  EXPECT_THROW(net.Barrier(), core::InvalidUsageError);
  EXPECT_THROW(net.Allgather(buf.data(), buf.data(), 1), core::InvalidUsageError);
}

// ---- healthy worlds --------------------------------------------------------------------------

class SocketWorldTest : public ::testing::TestWithParam<int> {};

TEST_P(SocketWorldTest, AllgatherRandomData) {
  const int n = GetParam();
  ParentId id;
  auto outs = RunProcesses(n, [&](int rank) -> std::string {
    SocketBootstrapNetwork net(id.id, rank, n);
    if (net.Rank() != rank || net.WorldSize() != n) return "BAD rank/world";
    uint64_t seed = 11;
    for (size_t bytes : {size_t(1), size_t(37), size_t(4096), size_t(100000)})
      RETURN_IF_BAD(VerifiedAllgather(net, bytes, seed++));
    // In place: rank r's contribution already sits at its slot of recv.
    std::vector<uint8_t> buf(static_cast<size_t>(n) * 16);
    Fill(buf.data() + static_cast<size_t>(rank) * 16, 16, 99, rank, -1);
    net.Allgather(buf.data() + static_cast<size_t>(rank) * 16, buf.data(), 16);
    for (int r = 0; r < n; r++) RETURN_IF_BAD(Check(buf.data() + r * 16, 16, 99, r, -1));
    net.Finalize();
    net.Finalize();
    return "OK";
  });
  ExpectAllOk(outs);
}

TEST_P(SocketWorldTest, AllToAllPairwiseAndBruck) {
  const int n = GetParam();
  ParentId pairwiseId, bruckId;
  auto outs = RunProcesses(n, [&](int rank) -> std::string {
    uint64_t seed = 21;
    {
      SocketBootstrapNetwork net(pairwiseId.id, rank, n,
                                 SocketBootstrapOptions{SocketAllToAllAlgorithm::kPairwise});
      for (size_t bytes : {size_t(1), size_t(13), size_t(5000)})
        RETURN_IF_BAD(VerifiedAllToAll(net, bytes, seed++));
    }
    {
      SocketBootstrapNetwork net(bruckId.id, rank, n,
                                 SocketBootstrapOptions{SocketAllToAllAlgorithm::kBruck});
      for (size_t bytes : {size_t(1), size_t(13), size_t(5000)})
        RETURN_IF_BAD(VerifiedAllToAll(net, bytes, seed++));
      // In place (send == recv).
      std::vector<uint8_t> buf(static_cast<size_t>(n) * 8);
      for (int p = 0; p < n; p++) Fill(buf.data() + p * 8, 8, 77, rank, p);
      net.AllToAll(buf.data(), buf.data(), 8);
      for (int r = 0; r < n; r++) RETURN_IF_BAD(Check(buf.data() + r * 8, 8, 77, r, rank));
    }
    return "OK";
  });
  ExpectAllOk(outs);
}

TEST_P(SocketWorldTest, BarrierManyTimes) {
  const int n = GetParam();
  constexpr int kRounds = 100;
  ParentId id;
  Shared<std::atomic<int>> arrivals(kRounds);
  auto outs = RunProcesses(n, [&](int rank) -> std::string {
    SocketBootstrapNetwork net(id.id, rank, n);
    for (int i = 0; i < kRounds; i++) {
      arrivals[static_cast<size_t>(i)].fetch_add(1);
      net.Barrier();
      // Everybody incremented before anybody left the barrier.
      int seen = arrivals[static_cast<size_t>(i)].load();
      if (seen != n)
        return "BAD barrier " + std::to_string(i) + " let rank " + std::to_string(rank) +
               " through after " + std::to_string(seen) + " arrivals";
    }
    return "OK";
  });
  ExpectAllOk(outs);
}

TEST_P(SocketWorldTest, BackToBackMixedSizes) {
  const int n = GetParam();
  ParentId id;
  auto outs = RunProcesses(n, [&](int rank) -> std::string {
    SocketBootstrapNetwork net(id.id, rank, n);
    const size_t kMiB = 1 << 20;
    RETURN_IF_BAD(VerifiedAllgather(net, 0, 1));
    RETURN_IF_BAD(VerifiedAllToAll(net, 1, 2));
    net.Barrier();
    RETURN_IF_BAD(VerifiedAllgather(net, kMiB, 3));
    RETURN_IF_BAD(VerifiedAllToAll(net, 0, 4));
    RETURN_IF_BAD(VerifiedAllgather(net, 1, 5));
    RETURN_IF_BAD(VerifiedAllToAll(net, kMiB, 6));
    net.Barrier();
    RETURN_IF_BAD(VerifiedAllToAll(net, 1, 7));
    RETURN_IF_BAD(VerifiedAllgather(net, 0, 8));
    net.Barrier();
    return "OK";
  });
  ExpectAllOk(outs);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, SocketWorldTest, ::testing::Values(2, 3, 4, 8),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "N" + std::to_string(i.param);
                         });

// A port on `ipv4` held for the test without a listener: bound (the kernel picks the port) with
// SO_REUSEADDR and never listening. No other socket gets the port (binds to port 0 and outgoing
// connections skip it), while a listener that also sets SO_REUSEADDR, as the bootstrap's root
// does, may still bind and listen on it. Closes on destruction.
class HeldPort {
 public:
  explicit HeldPort(uint32_t ipv4) {
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd_ < 0) return;
    int one = 1;
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = ipv4;
    sa.sin_port = 0;
    socklen_t len = sizeof(sa);
    if (setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0 ||
        bind(fd_, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 ||
        getsockname(fd_, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
      close(fd_);
      fd_ = -1;
      return;
    }
    port_ = sa.sin_port;
  }
  ~HeldPort() {
    if (fd_ >= 0) close(fd_);
  }
  HeldPort(const HeldPort&) = delete;
  HeldPort& operator=(const HeldPort&) = delete;
  bool Ok() const { return fd_ >= 0; }
  uint16_t Port() const { return port_; }  // network byte order

 private:
  int fd_ = -1;
  uint16_t port_ = 0;
};

TEST(SocketBootstrapTest, RootBindsIdAddressWhenNotRegistered) {
  // An id whose listener is not registered in this process, as if it came from another process:
  // rank 0 must bind the id's address itself. The id's own listener is released, and the id then
  // names a port this test holds (HeldPort), so that nothing else can take it before rank 0 binds.
  SocketUniqueId id = SocketBootstrapNetwork::CreateUniqueId();
  SocketBootstrapNetwork::ReleaseUniqueId(id);
  HeldPort held(id.ipv4);
  ASSERT_TRUE(held.Ok()) << "binding a port on the id's address failed: " << std::strerror(errno);
  id.port = held.Port();
  auto outs = RunProcesses(3, [&](int rank) -> std::string {
    // Rank 0 comes late: the others retry their connection to the root until it has bound.
    if (rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    SocketBootstrapNetwork net(id, rank, 3);
    RETURN_IF_BAD(VerifiedAllgather(net, 64, 5));
    return "OK";
  });
  ExpectAllOk(outs);
}

TEST(SocketBootstrapTest, CallbackNetworkOverSocketNetwork) {
  // The callback bootstrap driven by real collectives (as the torch path does with its own).
  ParentId id;
  auto outs = RunProcesses(3, [&](int rank) -> std::string {
    SocketBootstrapNetwork sock(id.id, rank, 3);
    CallbackBootstrapNetwork net(
        rank, 3, [&](const void* s, void* r, size_t b) { sock.Allgather(s, r, b); },
        [&](const void* s, void* r, size_t b) { sock.AllToAll(s, r, b); }, [&] { sock.Barrier(); });
    RETURN_IF_BAD(VerifiedAllgather(net, 300, 1));
    RETURN_IF_BAD(VerifiedAllToAll(net, 300, 2));
    net.Barrier();
    CallbackBootstrapNetwork emulated(
        rank, 3, [&](const void* s, void* r, size_t b) { sock.Allgather(s, r, b); }, nullptr,
        nullptr);
    RETURN_IF_BAD(VerifiedAllToAll(emulated, 100, 3));
    emulated.Barrier();
    return "OK";
  });
  ExpectAllOk(outs);
}

TEST(SocketBootstrapTest, ManyRanksAsThreadsUseBoundedConnections) {
  // 80 ranks (above kSocketPairwiseMaxWorldSize, so AllToAll runs Bruck) as threads of this
  // process: each rank holds about 2*log2(N) connections, not N-1.
  constexpr int kN = 80;
  rlimit lim{};
  getrlimit(RLIMIT_NOFILE, &lim);
  const rlim_t kNeed = 4096;
  if (lim.rlim_cur < kNeed) {
    if (lim.rlim_max < kNeed) GTEST_SKIP() << "RLIMIT_NOFILE hard limit " << lim.rlim_max;
    rlimit raised = lim;
    raised.rlim_cur = kNeed;
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &raised), 0);
  }
  ScopedEnvVar timeout("MORI_BOOTSTRAP_TIMEOUT", "20");
  ParentId id;
  std::vector<std::string> results(kN);
  std::vector<std::thread> threads;
  for (int r = 0; r < kN; r++) {
    threads.emplace_back([&, r] {
      try {
        SocketBootstrapNetwork net(id.id, r, kN);
        std::string bad = VerifiedAllgather(net, 24, 1);
        if (bad.empty()) bad = VerifiedAllToAll(net, 24, 2);
        if (bad.empty()) net.Barrier();
        if (bad.empty()) bad = VerifiedAllToAll(net, 0, 3);
        results[static_cast<size_t>(r)] = bad.empty() ? "OK" : bad;
      } catch (const std::exception& e) {
        results[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  setrlimit(RLIMIT_NOFILE, &lim);
  for (int r = 0; r < kN; r++) EXPECT_EQ(results[static_cast<size_t>(r)], "OK") << "rank " << r;
}

// ---- failures --------------------------------------------------------------------------------

TEST(SocketBootstrapFailureTest, MissingRankTimesOutNamingIt) {
  ParentId id;
  const int kRanks[] = {0, 1, 3};  // rank 2 of 4 never starts
  auto outs = RunProcesses(
      3,
      [&](int i) -> std::string {
        SocketBootstrapNetwork net(id.id, kRanks[i], 4);
        return "OK unexpectedly initialised";
      },
      /*childTimeoutSec=*/2);
  // Every rank names the missing one: the others wait a little longer than the root for its
  // verdict.
  for (const auto& o : outs) {
    EXPECT_TRUE(o.Err("Timeout")) << Dump(outs);
    EXPECT_TRUE(o.Mentions("rank 2 of 4 never connected")) << Dump(outs);
  }
}

TEST(SocketBootstrapFailureTest, SilentRankInCollectiveTimesOutNamingIt) {
  ParentId id;
  auto outs = RunProcesses(
      3,
      [&](int rank) -> std::string {
        SocketBootstrapNetwork net(id.id, rank, 3);
        if (rank == 1) {  // alive, connected, but never joins the collective
          std::this_thread::sleep_for(std::chrono::seconds(3));
          return "OK silent";
        }
        std::vector<uint8_t> s(8), r(24);
        net.Allgather(s.data(), r.data(), 8);
        return "OK unexpectedly completed";
      },
      /*childTimeoutSec=*/2);
  // Rank 2 waits for rank 1's data in the ring and names it. Rank 0 waits for rank 2 at the same
  // time: it names rank 1 if rank 2's abort reaches it first, else rank 2 (what it waited for).
  EXPECT_TRUE(outs[2].Err("Timeout")) << Dump(outs);
  EXPECT_TRUE(outs[2].Mentions("waiting for data from rank 1")) << Dump(outs);
  EXPECT_TRUE(outs[0].Err("Timeout")) << Dump(outs);
  EXPECT_TRUE(outs[0].Mentions("from rank 1") || outs[0].Mentions("from rank 2")) << Dump(outs);
}

TEST(SocketBootstrapFailureTest, PeerDyingMidCollectiveIsNamed) {
  ParentId id;
  auto outs = RunProcesses(
      4,
      [&](int rank) -> std::string {
        SocketBootstrapNetwork net(id.id, rank, 4);
        RETURN_IF_BAD(VerifiedAllgather(net, 32, 1));
        if (rank == 2) _exit(0);  // dies without a word; the kernel closes its sockets
        RETURN_IF_BAD(VerifiedAllgather(net, 32, 2));
        return "OK unexpectedly completed";
      },
      /*childTimeoutSec=*/5);
  EXPECT_TRUE(outs[2].report.empty()) << Dump(outs);
  EXPECT_TRUE(outs[3].Err("Remote")) << Dump(outs);  // receives from rank 2 in the ring
  for (int r : {0, 1, 3}) {
    EXPECT_TRUE(outs[static_cast<size_t>(r)].report.rfind("ERR ", 0) == 0) << Dump(outs);
    EXPECT_TRUE(outs[static_cast<size_t>(r)].Mentions("rank 2")) << Dump(outs);
  }
}

TEST(SocketBootstrapFailureTest, GarbageAndStalledConnectionsAtRootAreIgnored) {
  ParentId id;
  // Queued on the root listener before any rank starts.
  int garbage = ConnectRaw(id.id);
  int staller = ConnectRaw(id.id);
  ASSERT_GE(garbage, 0);
  ASSERT_GE(staller, 0);
  std::string junk(48, '\x5a');
  ASSERT_EQ(send(garbage, junk.data(), junk.size(), MSG_NOSIGNAL), 48);
  ASSERT_EQ(send(staller, "MORI", 4, MSG_NOSIGNAL), 4);  // a partial hello, then silence

  auto outs = RunProcesses(3, [&](int rank) -> std::string {
    SocketBootstrapNetwork net(id.id, rank, 3);
    RETURN_IF_BAD(VerifiedAllgather(net, 100, 9));
    return "OK";
  });
  ExpectAllOk(outs);
  std::string reply = ReadAll(garbage, 5);  // a reject frame naming the problem, then EOF
  EXPECT_NE(reply.find("magic"), std::string::npos) << reply.size() << " bytes";
  std::string stalled = ReadAll(staller, 5);  // closed once the rendezvous finished
  EXPECT_TRUE(stalled.empty());
  close(garbage);
  close(staller);
}

TEST(SocketBootstrapFailureTest, ForeignNonceIsRejectedAndWorldCompletes) {
  ParentId id;
  Shared<std::atomic<int>> rejected(1);
  auto outs = RunProcesses(4, [&](int i) -> std::string {
    if (i == 2) {  // same root address, another session's nonce
      SocketUniqueId foreign = id.id;
      foreign.nonce[0] ^= 0x1234;
      try {
        SocketBootstrapNetwork net(foreign, 2, 3);
      } catch (...) {
        rejected[0].store(1);
        throw;
      }
      rejected[0].store(1);
      return "OK unexpectedly accepted";
    }
    int rank = i == 3 ? 2 : i;
    if (rank == 2 && !WaitFlag(rejected[0], 10)) return "BAD foreign peer never finished";
    SocketBootstrapNetwork net(id.id, rank, 3);
    RETURN_IF_BAD(VerifiedAllgather(net, 10, 4));
    return "OK";
  });
  EXPECT_TRUE(outs[2].Err("Remote")) << Dump(outs);
  EXPECT_TRUE(outs[2].Mentions("nonce")) << Dump(outs);
  for (int i : {0, 1, 3}) EXPECT_TRUE(outs[static_cast<size_t>(i)].Ok()) << Dump(outs);
}

TEST(SocketBootstrapFailureTest, DuplicateRankIsRejected) {
  ParentId id;
  Shared<std::atomic<int>> rejected(1);
  auto outs = RunProcesses(4, [&](int i) -> std::string {
    int rank = i == 0 ? 0 : (i <= 2 ? 1 : 2);  // processes 1 and 2 both claim rank 1
    if (i == 3 && !WaitFlag(rejected[0], 10)) return "BAD no duplicate was rejected";
    try {
      SocketBootstrapNetwork net(id.id, rank, 3);
      RETURN_IF_BAD(VerifiedAllgather(net, 10, 4));
    } catch (const core::RemoteError&) {
      rejected[0].store(1);
      throw;
    }
    return "OK";
  });
  int oks = 0, dups = 0;
  for (int i : {1, 2}) {
    oks += outs[static_cast<size_t>(i)].Ok();
    dups += outs[static_cast<size_t>(i)].Err("Remote") &&
            outs[static_cast<size_t>(i)].Mentions("duplicate rank 1");
  }
  EXPECT_EQ(oks, 1) << Dump(outs);
  EXPECT_EQ(dups, 1) << Dump(outs);
  EXPECT_TRUE(outs[0].Ok()) << Dump(outs);
  EXPECT_TRUE(outs[3].Ok()) << Dump(outs);
}

TEST(SocketBootstrapFailureTest, MismatchedSizesAreDetected) {
  ParentId id;
  auto outs = RunProcesses(
      3,
      [&](int rank) -> std::string {
        SocketBootstrapNetwork net(id.id, rank, 3);
        size_t bytes = rank == 1 ? 8 : 16;
        std::vector<uint8_t> s(bytes), r(bytes * 3);
        net.Allgather(s.data(), r.data(), bytes);
        return "OK unexpectedly completed";
      },
      /*childTimeoutSec=*/5);
  bool named = false;
  for (const auto& o : outs) {
    EXPECT_TRUE(o.Err("Remote")) << Dump(outs);
    named = named || o.Mentions("different sizes");
  }
  EXPECT_TRUE(named) << Dump(outs);
}

TEST(SocketBootstrapFailureTest, MismatchedCollectivesAreDetected) {
  ParentId id;
  auto outs = RunProcesses(
      3,
      [&](int rank) -> std::string {
        SocketBootstrapNetwork net(id.id, rank, 3);
        net.Barrier();
        if (rank == 0) {
          net.Barrier();
        } else {
          std::vector<uint8_t> s(4), r(12);
          net.Allgather(s.data(), r.data(), 4);
        }
        return "OK unexpectedly completed";
      },
      /*childTimeoutSec=*/5);
  bool named = false;
  for (const auto& o : outs) {
    EXPECT_TRUE(o.report.rfind("ERR ", 0) == 0) << Dump(outs);
    named = named || o.Mentions("different collectives");
  }
  EXPECT_TRUE(named) << Dump(outs);
  // After the error the network refuses further use instead of hanging.
}

TEST(SocketBootstrapFailureTest, BrokenNetworkRefusesFurtherUse) {
  ParentId id;
  auto outs = RunProcesses(
      2,
      [&](int rank) -> std::string {
        SocketBootstrapNetwork net(id.id, rank, 2);
        size_t bytes = rank == 0 ? 4 : 8;
        std::vector<uint8_t> s(bytes), r(bytes * 2);
        try {
          net.Allgather(s.data(), r.data(), bytes);
          return "BAD mismatch not detected";
        } catch (const core::RemoteError&) {
        }
        try {
          net.Barrier();
          return "BAD barrier on a broken network";
        } catch (const core::InvalidUsageError&) {
        }
        net.Finalize();
        return "OK";
      },
      /*childTimeoutSec=*/5);
  ExpectAllOk(outs);
}

// ---- callback bootstrap (single process) -----------------------------------------------------

TEST(CallbackBootstrapTest, ForwardsArgumentsAndValidates) {
  const void* seenSend = nullptr;
  void* seenRecv = nullptr;
  size_t seenBytes = 0;
  int allgathers = 0, alltoalls = 0, barriers = 0;
  CallbackBootstrapNetwork net(
      1, 3,
      [&](const void* s, void* r, size_t b) {
        seenSend = s, seenRecv = r, seenBytes = b;
        allgathers++;
      },
      [&](const void* s, void* r, size_t b) {
        seenSend = s, seenRecv = r, seenBytes = b;
        alltoalls++;
      },
      [&] { barriers++; });
  EXPECT_EQ(net.Rank(), 1);
  EXPECT_EQ(net.WorldSize(), 3);
  uint8_t s[6], r[6];
  net.Allgather(s, r, 2);
  EXPECT_EQ(seenSend, s);
  EXPECT_EQ(seenRecv, r);
  EXPECT_EQ(seenBytes, 2u);
  net.AllToAll(s, r, 2);
  net.Barrier();
  EXPECT_EQ(allgathers, 1);
  EXPECT_EQ(alltoalls, 1);
  EXPECT_EQ(barriers, 1);
  EXPECT_THROW(net.Allgather(nullptr, r, 2), core::InvalidUsageError);
  EXPECT_THROW(net.AllToAll(s, nullptr, 2), core::InvalidUsageError);
  net.Allgather(nullptr, nullptr, 0);  // zero bytes: no buffers needed
  net.Finalize();
  net.Finalize();
  EXPECT_THROW(net.Barrier(), core::InvalidUsageError);

  auto ag = [](const void*, void*, size_t) {};
  EXPECT_THROW(CallbackBootstrapNetwork(3, 3, ag, nullptr, nullptr), core::InvalidUsageError);
  EXPECT_THROW(CallbackBootstrapNetwork(0, 0, ag, nullptr, nullptr), core::InvalidUsageError);
  EXPECT_THROW(CallbackBootstrapNetwork(0, 2, nullptr, nullptr, nullptr), core::InvalidUsageError);
}

TEST(CallbackBootstrapTest, FallbacksUseAllgather) {
  // A fake 3-rank world seen from rank 2: the allgather callback fills in the other ranks.
  const int n = 3, me = 2;
  int allgathers = 0;
  CallbackBootstrapNetwork net(
      me, n,
      [&](const void* s, void* r, size_t b) {
        allgathers++;
        auto* out = static_cast<uint8_t*>(r);
        for (int src = 0; src < n; src++) {
          if (src == me) {
            std::memcpy(out + src * b, s, b);
            continue;
          }
          size_t per = b / n;  // the AllToAll emulation gathers n blocks per rank
          for (int dst = 0; dst < n; dst++) Fill(out + src * b + dst * per, per, 5, src, dst);
        }
      },
      nullptr, nullptr);
  EXPECT_EQ(VerifiedAllToAll(net, 10, 5), "");
  net.Barrier();
  EXPECT_EQ(allgathers, 2);
}

TEST(CallbackBootstrapTest, CallbackExceptions) {
  CallbackBootstrapNetwork net(
      0, 2, [](const void*, void*, size_t) { throw std::runtime_error("process group is gone"); },
      [](const void*, void*, size_t) { MORI_THROW(TimeoutError, "torch timed out"); }, nullptr);
  uint8_t b[4];
  try {
    net.Allgather(b, b, 2);
    FAIL() << "no exception";
  } catch (const core::RemoteError& e) {
    EXPECT_NE(std::string(e.what()).find("process group is gone"), std::string::npos);
  }
  EXPECT_THROW(net.AllToAll(b, b, 2), core::TimeoutError);  // mori errors pass through unchanged
  EXPECT_THROW(net.Barrier(), core::RemoteError);           // barrier fallback -> allgather
}

}  // namespace
}  // namespace mori::application

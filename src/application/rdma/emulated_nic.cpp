// The emulated NIC's request/response exchange (emulated_nic.hpp): framing, the server loop and
// the client. Host-only C++: the GPU side of the NIC process is its EmuNicBackend.
//
// A frame is {uint32 type, uint32 status, uint64 payload bytes} followed by the payload; a
// request's status is 0, a response's is 0 or 1 + the core::ErrorKind of the NIC-side error
// (its payload is then the error's text).
#include "mori/application/rdma/emulated_nic.hpp"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <type_traits>
#include <utility>
#include <vector>

#include "mori/core/errors.hpp"
#include "mori/core/logging.hpp"

namespace mori::application {

namespace {

enum MsgType : uint32_t {
  kMsgInit = 1,
  kMsgRegister,
  kMsgDeregister,
  kMsgAddQp,
  kMsgStart,
  kMsgWireStats,
  kMsgFatal,
  kMsgStop,
};

struct FrameHeader {
  uint32_t type;
  uint32_t status;
  uint64_t bytes;
};

constexpr uint64_t kMaxFrameBytes = uint64_t{1} << 34;  // a full trace ring fits

// Plain-data encoding of one message.
class Writer {
 public:
  template <typename T>
  void Put(const T& v) {
    static_assert(std::is_trivially_copyable<T>::value, "plain data only");
    out.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  void PutString(const std::string& s) {
    Put<uint64_t>(s.size());
    out.append(s);
  }
  template <typename T>
  void PutVector(const std::vector<T>& v) {
    static_assert(std::is_trivially_copyable<T>::value, "plain data only");
    Put<uint64_t>(v.size());
    out.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
  }
  std::string out;
};

class Reader {
 public:
  explicit Reader(const std::string& in) : in(in) {}
  template <typename T>
  T Get() {
    static_assert(std::is_trivially_copyable<T>::value, "plain data only");
    T v;
    Take(&v, sizeof(T));
    return v;
  }
  std::string GetString() {
    const uint64_t n = Get<uint64_t>();
    Need(n);
    std::string s = in.substr(pos, n);
    pos += n;
    return s;
  }
  template <typename T>
  std::vector<T> GetVector() {
    const uint64_t n = Get<uint64_t>();
    MORI_ENSURE(n <= (in.size() - pos) / sizeof(T), InternalError,
                "emulated NIC: a message announces %llu elements of %zu bytes, %zu bytes remain",
                static_cast<unsigned long long>(n), sizeof(T), in.size() - pos);
    std::vector<T> v(n);
    Take(v.data(), n * sizeof(T));
    return v;
  }

 private:
  void Need(uint64_t n) const {
    MORI_ENSURE(n <= in.size() - pos, InternalError,
                "emulated NIC: a message is short (%llu more bytes needed at %zu of %zu)",
                static_cast<unsigned long long>(n), pos, in.size());
  }
  void Take(void* dst, size_t n) {
    Need(n);
    std::memcpy(dst, in.data() + pos, n);
    pos += n;
  }
  const std::string& in;
  size_t pos = 0;
};

enum class IoResult { kOk, kClosed, kTimeout, kError };

// Waits for `events` on fd until `deadline` (none: forever), calling `idle` about once a second
// (it returns false to give up).
IoResult WaitFd(int fd, short events, const std::chrono::steady_clock::time_point* deadline,
                bool (*idle)()) {
  for (;;) {
    int ms = 1000;
    if (deadline != nullptr) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                            *deadline - std::chrono::steady_clock::now())
                            .count();
      if (left <= 0) return IoResult::kTimeout;
      if (left < ms) ms = static_cast<int>(left);
    }
    pollfd p{fd, events, 0};
    const int rc = poll(&p, 1, ms);
    if (rc > 0) return IoResult::kOk;  // readable/writable, or hung up: the call tells which
    if (rc < 0 && errno != EINTR) return IoResult::kError;
    if (rc == 0 && idle != nullptr && !idle()) return IoResult::kClosed;
  }
}

IoResult ReadAll(int fd, void* dst, size_t n, const std::chrono::steady_clock::time_point* deadline,
                 bool (*idle)() = nullptr) {
  auto* p = static_cast<char*>(dst);
  while (n > 0) {
    const IoResult w = WaitFd(fd, POLLIN, deadline, idle);
    if (w != IoResult::kOk) return w;
    const ssize_t got = recv(fd, p, n, 0);
    if (got == 0) return IoResult::kClosed;
    if (got < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return errno == ECONNRESET ? IoResult::kClosed : IoResult::kError;
    }
    p += got;
    n -= static_cast<size_t>(got);
  }
  return IoResult::kOk;
}

IoResult WriteAll(int fd, const void* src, size_t n,
                  const std::chrono::steady_clock::time_point* deadline) {
  auto* p = static_cast<const char*>(src);
  while (n > 0) {
    const IoResult w = WaitFd(fd, POLLOUT, deadline, nullptr);
    if (w != IoResult::kOk) return w;
    const ssize_t put = send(fd, p, n, MSG_NOSIGNAL);
    if (put < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return errno == EPIPE || errno == ECONNRESET ? IoResult::kClosed : IoResult::kError;
    }
    p += put;
    n -= static_cast<size_t>(put);
  }
  return IoResult::kOk;
}

IoResult WriteFrame(int fd, uint32_t type, uint32_t status, const std::string& payload,
                    const std::chrono::steady_clock::time_point* deadline) {
  const FrameHeader h{type, status, payload.size()};
  IoResult r = WriteAll(fd, &h, sizeof(h), deadline);
  if (r == IoResult::kOk) r = WriteAll(fd, payload.data(), payload.size(), deadline);
  return r;
}

IoResult ReadFrame(int fd, FrameHeader* h, std::string* payload,
                   const std::chrono::steady_clock::time_point* deadline,
                   bool (*idle)() = nullptr) {
  IoResult r = ReadAll(fd, h, sizeof(*h), deadline, idle);
  if (r != IoResult::kOk) return r;
  if (h->bytes > kMaxFrameBytes) return IoResult::kError;
  payload->resize(h->bytes);
  return ReadAll(fd, payload->data(), payload->size(), deadline, idle);
}

const char* IoResultText(IoResult r) {
  switch (r) {
    case IoResult::kOk: return "ok";
    case IoResult::kClosed: return "the connection closed";
    case IoResult::kTimeout: return "no answer in time";
    case IoResult::kError: return "a socket error";
  }
  return "?";
}

[[noreturn]] void ThrowAs(core::ErrorKind kind, const std::string& msg) {
  using namespace core;
  switch (kind) {
    case ErrorKind::kInvalidUsage: MORI_THROW(InvalidUsageError, "%s", msg.c_str());
    case ErrorKind::kTimeout: MORI_THROW(TimeoutError, "%s", msg.c_str());
    case ErrorKind::kSystem: MORI_THROW(SystemError, "%s", msg.c_str());
    case ErrorKind::kGpuRuntime: MORI_THROW(GpuRuntimeError, "%s", msg.c_str());
    case ErrorKind::kRemote: MORI_THROW(RemoteError, "%s", msg.c_str());
    case ErrorKind::kInternal: break;
  }
  MORI_THROW(InternalError, "%s", msg.c_str());
}

// The NIC's state between messages.
class NicServer {
 public:
  NicServer(void* rings, size_t ringBytes, EmuNicBackend& backend)
      : rings(static_cast<uint8_t*>(rings)), ringBytes(ringBytes), backend(backend) {}
  ~NicServer() { Teardown(); }

  std::string Handle(uint32_t type, const std::string& payload) {
    Reader in(payload);
    Writer out;
    switch (type) {
      case kMsgInit: {
        MORI_ENSURE(!emulator, InvalidUsageError, "emulated NIC: initialised twice");
        EmuNicInit init;
        init.rank = in.Get<int32_t>();
        init.gpuBusId = in.GetString();
        init.options.chaosSeed = in.Get<uint64_t>();
        init.options.traceEntries = in.Get<uint64_t>();
        init.hostTimeoutMs = in.Get<int64_t>();
        rank = init.rank;
        backend.Bind(init.gpuBusId);
        emulator =
            std::make_unique<QueueEmulator>(backend.MakeAccessor(init.hostTimeoutMs), init.options);
        break;
      }
      case kMsgRegister: {
        Ready();
        const auto m = in.Get<EmuNicMemory>();
        const uint32_t key = in.Get<uint32_t>();
        MORI_ENSURE(m.length > 0 && m.base >= m.allocBase && m.length <= m.allocBytes &&
                        m.base - m.allocBase <= m.allocBytes - m.length,
                    InvalidUsageError,
                    "emulated NIC: PE %d's range [0x%llx, +%llu) is not inside its allocation "
                    "[0x%llx, +%llu)",
                    m.pe, static_cast<unsigned long long>(m.base),
                    static_cast<unsigned long long>(m.length),
                    static_cast<unsigned long long>(m.allocBase),
                    static_cast<unsigned long long>(m.allocBytes));
        const MapId id{m.pe, m.allocBase};
        auto it = maps.find(id);
        if (it == maps.end()) {
          it = maps.emplace(id, Mapping{static_cast<uint8_t*>(backend.Open(m)), m.allocBytes, 0})
                   .first;
        }
        MORI_ENSURE(it->second.bytes == m.allocBytes, InvalidUsageError,
                    "emulated NIC: PE %d's allocation at 0x%llx was %llu bytes, now %llu (freed "
                    "and reallocated while registered?)",
                    m.pe, static_cast<unsigned long long>(m.allocBase),
                    static_cast<unsigned long long>(it->second.bytes),
                    static_cast<unsigned long long>(m.allocBytes));
        void* access = it->second.ptr + (m.base - m.allocBase);
        uint32_t k = key;
        if (k == 0) {
          k = emulator->RegisterMemoryAt(m.pe, m.base, access, m.length, m.access).lkey;
        } else {
          emulator->RegisterMemoryAs(m.pe, k, m.base, access, m.length, m.access);
        }
        it->second.refs++;
        keys[{m.pe, k}] = id;
        out.Put<uint32_t>(k);
        break;
      }
      case kMsgDeregister: {
        Ready();
        const uint32_t key = in.Get<uint32_t>();
        auto it = keys.find({rank, key});
        MORI_ENSURE(it != keys.end(), InvalidUsageError,
                    "emulated NIC: rank %d has no registration with key 0x%x", rank, key);
        // Work requests on the range completed before (the caller's contract), and
        // DeregisterMemory waits for the worker's current pass: nothing touches the mapping
        // once its last range is gone. Closing it then keeps a later allocation at the same
        // address from reaching the freed one's memory.
        emulator->DeregisterMemory(key);
        auto m = maps.find(it->second);
        keys.erase(it);
        if (m != maps.end() && --m->second.refs == 0) {
          backend.Close(m->second.ptr);
          maps.erase(m);
        }
        break;
      }
      case kMsgAddQp: {
        Ready();
        const auto q = in.Get<EmuNicQp>();
        const uint64_t sqBytes = uint64_t{q.sqBlocks} * 64, cqBytes = uint64_t{q.numCqes} * 64;
        MORI_ENSURE(InRings(q.sqOffset, sqBytes) && InRings(q.cqOffset, cqBytes) &&
                        InRings(q.countersOffset, sizeof(core::rdma::QpCounters)),
                    InvalidUsageError,
                    "emulated NIC: QP 0x%x's rings (SQ at %llu, CQ at %llu, counters at %llu) are "
                    "outside the %zu bytes of ring memory",
                    q.qpn, static_cast<unsigned long long>(q.sqOffset),
                    static_cast<unsigned long long>(q.cqOffset),
                    static_cast<unsigned long long>(q.countersOffset), ringBytes);
        EmuInitCqRing(rings + q.cqOffset, q.numCqes);
        const core::rdma::QpEndpoint ep = core::rdma::MakeEndpoint(
            rings + q.sqOffset, q.sqBlocks, q.qpn, rings + q.cqOffset, q.numCqes,
            reinterpret_cast<core::rdma::QpCounters*>(rings + q.countersOffset));
        emulator->AddQp(EmuQpFromEndpoint(ep, q.pe, q.remotePe));
        break;
      }
      case kMsgStart:
        Ready();
        emulator->Start();
        break;
      case kMsgWireStats: {
        Ready();
        const RdmaWireStats s = emulator->WireStats(in.Get<uint8_t>() != 0);
        out.Put<uint8_t>(s.available ? 1 : 0);
        out.PutString(s.source);
        out.PutVector(s.perPeer);
        out.PutVector(s.trace);
        out.Put<uint64_t>(s.traceDropped);
        out.Put<uint64_t>(s.traceCapacity);
        out.Put<uint64_t>(s.pendingSqBlocks);
        break;
      }
      case kMsgFatal: out.PutString(emulator ? emulator->FatalError() : std::string()); break;
      case kMsgStop: {
        const int64_t ms = in.Get<int64_t>();
        if (emulator && emulator->Running()) emulator->Stop(static_cast<int>(ms));
        Teardown();
        break;
      }
      default: MORI_THROW(InternalError, "emulated NIC: unknown request type %u", type);
    }
    return out.out;
  }

 private:
  struct MapId {
    int pe;
    uint64_t allocBase;
    bool operator<(const MapId& o) const {
      return pe != o.pe ? pe < o.pe : allocBase < o.allocBase;
    }
  };
  struct Mapping {
    uint8_t* ptr;
    uint64_t bytes;
    int refs;
  };
  void Ready() const {
    MORI_ENSURE(emulator != nullptr, InvalidUsageError, "emulated NIC: not initialised");
  }
  bool InRings(uint64_t offset, uint64_t bytes) const {
    return offset <= ringBytes && bytes <= ringBytes - offset;
  }
  // The emulator (and its accessor, which waits for its copies) goes before the mappings.
  void Teardown() {
    emulator.reset();
    for (auto& [id, m] : maps) backend.Close(m.ptr);
    maps.clear();
    keys.clear();
  }

  uint8_t* rings;
  size_t ringBytes;
  EmuNicBackend& backend;
  int rank = -1;
  std::map<MapId, Mapping> maps;
  std::map<std::pair<int, uint32_t>, MapId> keys;  // (pe, key) -> its allocation
  std::unique_ptr<QueueEmulator> emulator;
};

}  // namespace

int RunEmulatedNicServer(int fd, void* rings, size_t ringBytes, EmuNicBackend& backend,
                         bool (*parentAlive)()) {
  NicServer server(rings, ringBytes, backend);
  for (;;) {
    FrameHeader h{};
    std::string payload;
    const IoResult r = ReadFrame(fd, &h, &payload, nullptr, parentAlive);
    if (r != IoResult::kOk) {
      if (r != IoResult::kClosed) MORI_WARN(kLogRdma, "emulated NIC: %s", IoResultText(r));
      return 1;  // the PE's process is gone: tear down (the server's destructor)
    }
    uint32_t status = 0;
    std::string reply;
    try {
      reply = server.Handle(h.type, payload);
    } catch (const core::Error& e) {
      status = 1 + static_cast<uint32_t>(e.Kind());
      reply = e.what();
    } catch (const std::exception& e) {
      status = 1 + static_cast<uint32_t>(core::ErrorKind::kInternal);
      reply = e.what();
    }
    const bool stop = h.type == kMsgStop;
    if (WriteFrame(fd, h.type, status, reply, nullptr) != IoResult::kOk) return 1;
    if (stop) return status == 0 ? 0 : 1;
  }
}

EmulatedNicClient::EmulatedNicClient(int fd, int64_t timeoutMs, std::string (*describeExit)(void*),
                                     void* describeArg)
    : fd(fd), timeoutMs(timeoutMs), describeExit(describeExit), describeArg(describeArg) {}

EmulatedNicClient::~EmulatedNicClient() {
  if (fd >= 0) close(fd);
}

std::string EmulatedNicClient::Call(uint32_t type, const std::string& payload) {
  std::lock_guard<std::mutex> lock(mu);
  MORI_ENSURE(broken.empty(), SystemError, "%s", broken.c_str());
  // The NIC may first finish an emulator pass (its GPU waits bounded by the timeout) and, for a
  // stop, the last copies (bounded again).
  const int64_t bound = 2 * timeoutMs + 5000;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(bound);
  FrameHeader h{};
  std::string reply;
  IoResult r = WriteFrame(fd, type, 0, payload, &deadline);
  if (r == IoResult::kOk) r = ReadFrame(fd, &h, &reply, &deadline);
  if (r == IoResult::kOk && h.type != type) r = IoResult::kError;
  if (r != IoResult::kOk) {
    broken = core::StrFormat(
        "the emulated NIC process does not answer (request %u: %s after up to %lld ms)%s%s", type,
        IoResultText(r), static_cast<long long>(bound), describeExit != nullptr ? "; " : "",
        describeExit != nullptr ? describeExit(describeArg).c_str() : "");
    close(fd);
    fd = -1;
    MORI_THROW(SystemError, "%s", broken.c_str());
  }
  if (h.status != 0) {
    ThrowAs(static_cast<core::ErrorKind>(h.status - 1), "emulated NIC process: " + reply);
  }
  return reply;
}

void EmulatedNicClient::Init(const EmuNicInit& init) {
  Writer w;
  w.Put<int32_t>(init.rank);
  w.PutString(init.gpuBusId);
  w.Put<uint64_t>(init.options.chaosSeed);
  w.Put<uint64_t>(init.options.traceEntries);
  w.Put<int64_t>(init.hostTimeoutMs);
  Call(kMsgInit, w.out);
}

uint32_t EmulatedNicClient::Register(const EmuNicMemory& m, uint32_t key) {
  Writer w;
  w.Put(m);
  w.Put<uint32_t>(key);
  const std::string r = Call(kMsgRegister, w.out);
  return Reader(r).Get<uint32_t>();
}

void EmulatedNicClient::Deregister(uint32_t key) {
  Writer w;
  w.Put<uint32_t>(key);
  Call(kMsgDeregister, w.out);
}

void EmulatedNicClient::AddQp(const EmuNicQp& qp) {
  Writer w;
  w.Put(qp);
  Call(kMsgAddQp, w.out);
}

void EmulatedNicClient::Start() { Call(kMsgStart, std::string()); }

RdmaWireStats EmulatedNicClient::WireStats(bool reset) {
  Writer w;
  w.Put<uint8_t>(reset ? 1 : 0);
  const std::string r = Call(kMsgWireStats, w.out);
  Reader in(r);
  RdmaWireStats s;
  s.available = in.Get<uint8_t>() != 0;
  s.source = in.GetString();
  s.perPeer = in.GetVector<RdmaOpStats>();
  s.trace = in.GetVector<RdmaTraceEntry>();
  s.traceDropped = in.Get<uint64_t>();
  s.traceCapacity = in.Get<uint64_t>();
  s.pendingSqBlocks = in.Get<uint64_t>();
  return s;
}

std::string EmulatedNicClient::FatalError() {
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!broken.empty()) return broken;
  }
  try {
    const std::string r = Call(kMsgFatal, std::string());
    return Reader(r).GetString();
  } catch (const core::Error& e) {
    return e.Message();
  }
}

void EmulatedNicClient::Stop(int64_t stopTimeoutMs) {
  Writer w;
  w.Put<int64_t>(stopTimeoutMs);
  Call(kMsgStop, w.out);
}

}  // namespace mori::application

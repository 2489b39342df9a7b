// Wire format of the socket bootstrap, and the non-blocking reads and writes every part of it uses.
//
// Every stream starts with one Hello from the connecting side, then carries Frames (a fixed header
// and `length` payload bytes). All fields are in host byte order except addresses (network
// order): peers are assumed to share endianness. The record sizes are part of the protocol.
#pragma once

#include <poll.h>
#include <sys/types.h>
#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "socket_util.hpp"

namespace mori::application::detail {

constexpr uint64_t kHelloMagic = 0x4F4C4C4548524F4DULL;  // "MORHELLO"
constexpr uint32_t kWireVersion = 1;
constexpr uint32_t kFrameMagic = 0x4D524D46u;
constexpr size_t kMaxErrorText = 4096;  // longest reason an abort or reject frame carries

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

// "ack", "Allgather", ...; "unknown" for a value off the list (a corrupted header).
const char* FrameTypeName(uint16_t t);

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

FrameHeader MakeHeader(FrameType type, int srcRank, uint32_t step, uint64_t seq, uint64_t length);
Hello MakeHello(HelloKind kind, const uint64_t nonce[2], int rank, int worldSize, Endpoint4 listen);

// Writes as much as the socket takes now (non-blocking). Returns bytes written; -1 with *err set
// on a hard error.
ssize_t SendSome(int fd, const iovec* iov, int iovCount, int* err);

// Reads what is available now. Returns bytes read (>0), 0 when nothing is available, -1 on EOF
// (*err = 0) or error (*err = errno).
ssize_t RecvSome(int fd, void* buf, size_t len, int* err);

// Best-effort, non-blocking write of one whole frame with a text payload (acks, rejects, aborts).
// True when the socket took all of it.
bool SendFrameNow(int fd, FrameType type, int srcRank, uint32_t step, uint64_t seq,
                  const std::string& text);

// poll() that returns 0 on EINTR and raises SystemError on any other failure.
int PollOnce(std::vector<pollfd>& fds, int timeoutMs);

// "rank 3" / "ranks 1,4,..." (at most 32 listed) for messages naming missing ranks.
std::string RankListPhrase(const std::vector<int>& ranks);

}  // namespace mori::application::detail

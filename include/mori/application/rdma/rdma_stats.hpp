// What one PE put on the RDMA wire: counters per (source PE, destination PE, opcode) and an
// optional trace ring of single work requests. Filled by the software queue emulator (each
// process's emulator executes the WQEs its own PE posted); the verbs back-end does not count and
// says so. Plain data, no dependencies: shmem and the Python binding hand it out as is.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace mori::application {

// Work-request kinds as counted. A WRITE carrying its payload inline is its own kind.
enum class RdmaOpcode : uint8_t {
  kWrite = 0,
  kWriteInline,
  kRead,
  kFetchAdd,
  kCompareSwap,
  kWriteImm,
  kNop,
  kOther,  // an opcode the emulator does not execute (always an error completion)
};
constexpr int kRdmaNumOpcodes = 8;

// Names used by mori.shmem.rdma_stats(): "write", "write_inline", "read", "fetch_add",
// "compare_swap", "write_imm", "nop", "other".
inline const char* RdmaOpcodeName(RdmaOpcode op) {
  switch (op) {
    case RdmaOpcode::kWrite: return "write";
    case RdmaOpcode::kWriteInline: return "write_inline";
    case RdmaOpcode::kRead: return "read";
    case RdmaOpcode::kFetchAdd: return "fetch_add";
    case RdmaOpcode::kCompareSwap: return "compare_swap";
    case RdmaOpcode::kWriteImm: return "write_imm";
    case RdmaOpcode::kNop: return "nop";
    case RdmaOpcode::kOther: return "other";
  }
  return "other";
}

// Size histogram: bucket 0 holds zero-byte requests, bucket k >= 1 sizes in [2^(k-1), 2^k); the
// last bucket also takes everything larger (a WQE carries at most 2^32 - 1 bytes).
constexpr int kRdmaSizeBuckets = 34;
inline int RdmaSizeBucket(uint64_t bytes) {
  int k = 0;
  while (bytes != 0 && k < kRdmaSizeBuckets - 1) {
    bytes >>= 1;
    k++;
  }
  return k;
}
// Smallest size that falls into bucket k (0, 1, 2, 4, 8, ...).
inline uint64_t RdmaSizeBucketLow(int k) { return k == 0 ? 0 : 1ull << (k - 1); }

// One (source PE, destination PE, opcode). `wqes`, `bytes`, `inlineWqes`, `atomics` and
// `sizeHist` count work requests that executed; `errors` those that completed with an error CQE,
// `flushed` those completed as flushed after an error (neither moved data).
struct RdmaOpStats {
  int srcPe = -1;
  int dstPe = -1;
  RdmaOpcode opcode = RdmaOpcode::kOther;
  uint64_t wqes = 0;
  uint64_t bytes = 0;       // payload: written, read, or 8 per atomic
  uint64_t inlineWqes = 0;  // payload carried inside the WQE
  uint64_t atomics = 0;
  uint64_t errors = 0;
  uint64_t flushed = 0;
  std::array<uint64_t, kRdmaSizeBuckets> sizeHist{};
};

enum class RdmaWqeOutcome : uint8_t { kOk = 0, kError, kFlushed };
inline const char* RdmaWqeOutcomeName(RdmaWqeOutcome o) {
  switch (o) {
    case RdmaWqeOutcome::kOk: return "ok";
    case RdmaWqeOutcome::kError: return "error";
    case RdmaWqeOutcome::kFlushed: return "flushed";
  }
  return "ok";
}

// One work request as the emulator executed it.
struct RdmaTraceEntry {
  uint64_t timeNs =
      0;  // CLOCK_MONOTONIC (std::chrono::steady_clock): comparable across processes of one host
  uint32_t qpn = 0;
  uint32_t qp = 0;  // the QP's index in its emulator (creation order)
  int srcPe = -1;
  int dstPe = -1;
  RdmaOpcode opcode = RdmaOpcode::kOther;
  RdmaWqeOutcome outcome = RdmaWqeOutcome::kOk;
  uint16_t wqeIndex = 0;  // the ctrl segment's wqe_index
  uint32_t bytes = 0;     // payload moved (0 unless kOk)
};

struct RdmaWireStats {
  bool available = false;  // false: this transport does not count (`source` says why)
  std::string source;      // what the numbers come from, or why there are none
  // Rows with at least one count, sorted by (srcPe, dstPe, opcode).
  std::vector<RdmaOpStats> perPeer;
  // The newest `traceCapacity` entries in execution order (oldest first); `traceDropped` older
  // ones were overwritten since the last reset.
  std::vector<RdmaTraceEntry> trace;
  uint64_t traceDropped = 0;
  uint64_t traceCapacity = 0;
  // SQ blocks (64 B) that posters have rung on the doorbell records but the emulator has not yet
  // executed, at the time of reading: 0 once everything posted so far is on the wire (and so in
  // the counts). Work requests a kernel posts without waiting for them (a last signal) may still
  // be pending when the kernel has finished.
  uint64_t pendingSqBlocks = 0;
};

}  // namespace mori::application

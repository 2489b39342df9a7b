// Software mlx5 queue emulator: a host thread that plays the NIC for RC queue pairs whose rings
// live in memory it can read (host memory in CPU tests; mapped host memory for GPU posters).
//
// It watches each QP's SQ doorbell record, consumes the WQE bytes posted there with the mlx5
// layouts of core/transport/mlx5_wqe.hpp (no side channel), executes RDMA WRITE (gather and
// inline), WRITE_IMM, READ, 8-byte FETCH_ADD and COMPARE_SWAP against registered memory regions
// (keys, bounds and access flags checked), in order per QP, and writes real 64-byte CQEs (owner bit
// per lap, wqe_counter, byte count, QPN, opcode). An error (bad lkey/rkey, out of range, bad
// opcode or index) yields an error CQE with the mlx5 syndrome and moves the QP to the error state:
// every later WQE completes as flushed (syndrome WR_FLUSH_ERR). A WQE without kCtrlCqUpdate in
// its ctrl segment completes without a CQE (the next signalled CQE covers it); error and flush
// completions are always written. It counts what it executes per (PE, peer, opcode) and can keep
// a trace ring (WireStats). Chaos mode (EmuOptions::chaosSeed) perturbs the schedule the way a
// real NIC may: delays, late CQEs, QPs served out of order with each other, RC order per QP kept.
// See docs/rdma.md for what it does not model. Test and bring-up mode (MORI_RDMA_EMULATE).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "mori/application/rdma/rdma_stats.hpp"
#include "mori/core/bounded_worker.hpp"
#include "mori/core/transport/rdma_queue.hpp"

namespace mori::application {

// Access flags (values as IBV_ACCESS_*).
enum EmuAccess : uint32_t {
  kEmuLocalWrite = 1,
  kEmuRemoteWrite = 2,
  kEmuRemoteRead = 4,
  kEmuRemoteAtomic = 8,
  kEmuAllAccess = 15,
};

// How the emulator touches region memory. The default is host memcpy / host atomics; a GPU
// back-end (copies on a stream) can replace it without touching the WQE logic.
class EmuMemoryAccessor {
 public:
  virtual ~EmuMemoryAccessor() = default;
  virtual void Copy(void* dst, const void* src, size_t bytes) = 0;
  // 8-byte atomics on the target (host order), returning the old value.
  virtual uint64_t FetchAdd64(void* target, uint64_t add) = 0;
  virtual uint64_t CompareSwap64(void* target, uint64_t expected, uint64_t desired) = 0;
  // Makes everything written so far visible before a completion is published.
  virtual void Flush() {}
};
std::unique_ptr<EmuMemoryAccessor> MakeHostMemoryAccessor();

struct EmuMemoryRegion {
  uint32_t lkey;
  uint32_t rkey;
};

// One queue pair. The rings, doorbell records and mailbox are the same memory the posting
// protocol's endpoint handle points to (see EmuQpFromEndpoint).
struct EmuQpConfig {
  void* sqRing;
  uint32_t sqBlocks;  // power of two
  uint32_t qpn;       // low 24 bits used
  const uint32_t* sqDbrec;
  void* cqRing;
  uint32_t numCqes;         // power of two
  const uint32_t* cqDbrec;  // consumer index (overrun check); may be null
  int pe;                   // the PE whose regions the lkeys of this QP refer to
  int remotePe;             // the PE whose regions the rkeys refer to (the connected peer)
  uint32_t remoteQpn;       // peer QP (WRITE_IMM responder CQE goes to its recvCq, if set)
  void* recvCqRing;         // optional responder CQ for WRITE_IMM arriving at this QP
  uint32_t recvNumCqes;
};

EmuQpConfig EmuQpFromEndpoint(const core::rdma::QpEndpoint& ep, int pe, int remotePe);

// Fills a CQ ring with invalid CQEs (op_own = INVALID << 4), as a freshly created CQ.
void EmuInitCqRing(void* cqRing, uint32_t numCqes);

enum class EmuQpState { kRts, kError };

// Chaos mode bounds (docs/rdma.md): a WQE is delayed with probability 1/kEmuChaosDelayOneIn by
// 1..kEmuChaosMaxDelayUs; a CQE is published up to kEmuChaosMaxCqeLateUs after its WQE executed
// (never before an earlier CQE of its QP); each visit of a QP takes 0..kEmuChaosMaxBurst WQEs.
constexpr uint32_t kEmuChaosDelayOneIn = 8;
constexpr uint32_t kEmuChaosMaxDelayUs = 100;
constexpr uint32_t kEmuChaosMaxCqeLateUs = 200;
constexpr uint32_t kEmuChaosMaxBurst = 4;
constexpr size_t kEmuMaxTraceEntries = size_t{1} << 24;

struct EmuOptions {
  uint64_t chaosSeed = 0;   // 0: plain mode (QPs in order, each drained, CQEs at once)
  size_t traceEntries = 0;  // trace ring size, 0 = no trace; at most kEmuMaxTraceEntries
};

struct EmuStats {
  uint64_t wqesExecuted;
  uint64_t wqesFlushed;
  uint64_t cqesWritten;
  uint64_t errors;
};

class QueueEmulator {
 public:
  explicit QueueEmulator(std::unique_ptr<EmuMemoryAccessor> accessor = nullptr,
                         const EmuOptions& options = EmuOptions{});
  ~QueueEmulator();  // stops the worker
  QueueEmulator(const QueueEmulator&) = delete;
  QueueEmulator& operator=(const QueueEmulator&) = delete;

  // Registers [base, base+length) of PE `pe`; keys are unique per emulator. WQEs address the
  // region by `base` itself.
  EmuMemoryRegion RegisterMemory(int pe, void* base, size_t length, uint32_t access);
  // The same, for memory WQEs address as `iova` and the emulator touches at `access` (e.g. the
  // emulator's IPC mapping of memory another process registered at `iova`).
  EmuMemoryRegion RegisterMemoryAt(int pe, uint64_t iova, void* access, size_t length,
                                   uint32_t accessFlags);
  // Registers a region of PE `pe` under a key chosen elsewhere (the key that PE's own registration
  // produced, exchanged as a real rkey would be). WQEs address it by `iova` (the address PE `pe`
  // registered, e.g. its heap base in its own process); the emulator touches it at `access`
  // (e.g. this process's IPC mapping of that memory). (pe, key) must be new.
  void RegisterMemoryAs(int pe, uint32_t key, uint64_t iova, void* access, size_t length,
                        uint32_t accessFlags);
  void DeregisterMemory(uint32_t lkey);
  // Adds a QP (its SQ producer is read from *sqDbrec; it starts at 0). Returns its index. The
  // rings, records and regions must outlive the emulator's processing: Stop() (or destroy the
  // emulator) before freeing them.
  size_t AddQp(const EmuQpConfig& cfg);

  void Start();  // spawns the worker thread (idempotent)
  // Stops and joins the worker within `timeoutMs`; throws TimeoutError if it does not stop.
  void Stop(int timeoutMs = 10000);
  bool Running() const { return worker.Running(); }

  // Processes whatever is published right now on every QP in the calling thread (tests, or a
  // caller that drives the emulator itself instead of Start()). Returns WQEs handled. In chaos
  // mode one call serves the QPs in a random order and takes 0..kEmuChaosMaxBurst WQEs from
  // each, and publishes only the CQEs that are due: call it until the expected work is done.
  size_t ProcessOnce();
  // CQEs executed but not yet published (chaos mode); 0 in plain mode.
  size_t PendingCqes() const;

  EmuQpState QpState(size_t qp) const;
  EmuStats Stats() const;
  // What this emulator executed, per (PE, peer, opcode), and the trace ring; `reset` zeroes both
  // after reading (nothing counted in between is lost). Thread-safe while the worker runs.
  RdmaWireStats WireStats(bool reset = false);
  const EmuOptions& Options() const { return options; }
  // The first worker-side failure that is not an error CQE (e.g. CQ overrun), empty if none.
  std::string FatalError() const;

 private:
  struct Region {
    int pe;
    uint8_t* base;  // where the emulator touches the memory
    uint64_t iova;  // the address WQEs use for `base`
    size_t length;
    uint32_t access;
    uint32_t key;
    bool live;
  };
  struct PendingCqe {
    core::mlx5::Mlx5CqeFields fields;
    uint64_t dueNs;  // steady-clock time from which it may be published
  };
  struct Qp {
    EmuQpConfig cfg;
    uint64_t consumed = 0;  // SQ blocks consumed (free-running)
    uint64_t cqProduced = 0;
    uint64_t recvCqProduced = 0;
    std::atomic<int> state{0};
    uint32_t index = 0;           // AddQp order
    size_t statBase = 0;          // first of its kRdmaNumOpcodes rows in statRows
    std::deque<PendingCqe> late;  // chaos mode: executed, CQE not yet published (in order)
  };
  // One pass over the QPs (mu held). `pending`: WQEs or CQEs left waiting by chaos mode.
  struct Round {
    size_t wqes = 0;
    size_t cqes = 0;
    bool pending = false;
  };
  Round ProcessRound();
  // Executes at most `limit` published WQEs of `qp`; `more` tells whether published ones remain.
  size_t ProcessQp(Qp& qp, uint64_t limit, bool* more);
  // Executes one WQE at block `blk`; returns its size in blocks (>= 1).
  uint32_t ExecuteWqe(Qp& qp, uint64_t blk);
  const Region* FindRegion(int pe, uint32_t key, uint64_t addr, uint64_t len, uint32_t access,
                           bool remote) const;
  static uint8_t* Translate(const Region* r, uint64_t addr) { return r->base + (addr - r->iova); }
  // Completes a WQE: publishes its CQE now, or (chaos mode) queues it behind the QP's late ones.
  void CompleteWqe(Qp& qp, const core::mlx5::Mlx5CqeFields& f);
  void PublishCqe(Qp& qp, const core::mlx5::Mlx5CqeFields& f);
  // Publishes the QP's late CQEs that are due (all of them with `all`); returns how many.
  size_t ReleaseLateCqes(Qp& qp, bool all);
  void WriteRecvCqe(Qp& qp, uint32_t imm, uint32_t byteCount);
  void Record(const Qp& qp, RdmaOpcode op, RdmaWqeOutcome outcome, uint32_t bytes, bool isInline,
              uint16_t wqeIndex);
  void Loop(const std::atomic<bool>& stop);
  void SetFatal(const std::string& what);

  const EmuOptions options;
  std::unique_ptr<EmuMemoryAccessor> mem;
  mutable std::mutex mu;  // regions, qps, fatal, rng; held by the processor for a whole pass
  std::vector<Region> regions;
  std::vector<std::unique_ptr<Qp>> qps;
  std::mt19937_64 rng;        // chaos schedule
  std::vector<size_t> order;  // chaos: QP visiting order of the current pass
  std::atomic<uint64_t> nExecuted{0}, nFlushed{0}, nCqes{0}, nErrors{0};
  std::atomic<size_t> nLate{0};
  std::string fatal;
  // Wire statistics and trace ring (statsMu only: readers never wait for a processing pass).
  mutable std::mutex statsMu;
  std::vector<RdmaOpStats> statRows;             // kRdmaNumOpcodes rows per (pe, remotePe) pair
  std::vector<RdmaTraceEntry> trace;             // ring of options.traceEntries
  uint64_t traceTotal = 0;                       // entries recorded since the last reset
  core::BoundedWorker worker{"queue emulator"};  // last: joined before the rest goes
};

// Readable description of a non-OK posting result (for host callers and error messages).
std::string DescribeQueueResult(const core::rdma::QueueResult& r, const core::rdma::QpEndpoint& ep);
// Raises TimeoutError (kTimeout), RemoteError (kQpError, with QPN, WQE index and syndrome) or
// InvalidUsageError (kInvalid); returns on kOk.
void ThrowIfFailed(const core::rdma::QueueResult& r, const core::rdma::QpEndpoint& ep);

}  // namespace mori::application

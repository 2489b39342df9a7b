// Software mlx5 queue emulator: a host thread that plays the NIC for RC queue pairs whose rings
// live in memory it can read (host memory in CPU tests; mapped host memory for GPU posters).
//
// It watches each QP's SQ doorbell record, consumes the WQE bytes posted there with the mlx5
// layouts of core/transport/mlx5_wqe.hpp (no side channel), executes RDMA WRITE (gather and
// inline), WRITE_IMM, READ, 8-byte FETCH_ADD and COMPARE_SWAP against registered memory regions
// (keys, bounds and access flags checked), in order per QP, and writes real 64-byte CQEs (owner bit
// per lap, wqe_counter, byte count, QPN, opcode). An error (bad lkey/rkey, out of range, bad
// opcode or index) yields an error CQE with the mlx5 syndrome and moves the QP to the error state:
// every later WQE completes as flushed (syndrome WR_FLUSH_ERR). See docs/rdma.md for what it does
// not model. Test and bring-up mode (MORI_RDMA_EMULATE).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

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
  uint32_t numCqes;  // power of two
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

struct EmuStats {
  uint64_t wqesExecuted;
  uint64_t wqesFlushed;
  uint64_t cqesWritten;
  uint64_t errors;
};

class QueueEmulator {
 public:
  explicit QueueEmulator(std::unique_ptr<EmuMemoryAccessor> accessor = nullptr);
  ~QueueEmulator();  // stops the worker
  QueueEmulator(const QueueEmulator&) = delete;
  QueueEmulator& operator=(const QueueEmulator&) = delete;

  // Registers [base, base+length) of PE `pe`; keys are unique per emulator. WQEs address the
  // region by `base` itself.
  EmuMemoryRegion RegisterMemory(int pe, void* base, size_t length, uint32_t access);
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
  // caller that drives the emulator itself instead of Start()). Returns WQEs handled.
  size_t ProcessOnce();

  EmuQpState QpState(size_t qp) const;
  EmuStats Stats() const;
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
  struct Qp {
    EmuQpConfig cfg;
    uint64_t consumed = 0;  // SQ blocks consumed (free-running)
    uint64_t cqProduced = 0;
    uint64_t recvCqProduced = 0;
    std::atomic<int> state{0};
  };
  size_t ProcessQp(Qp& qp);
  // Executes one WQE at block `blk`; returns its size in blocks (>= 1).
  uint32_t ExecuteWqe(Qp& qp, uint64_t blk);
  const Region* FindRegion(int pe, uint32_t key, uint64_t addr, uint64_t len, uint32_t access,
                           bool remote) const;
  static uint8_t* Translate(const Region* r, uint64_t addr) { return r->base + (addr - r->iova); }
  void WriteCqe(Qp& qp, const core::mlx5::Mlx5CqeFields& f);
  void WriteRecvCqe(Qp& qp, uint32_t imm, uint32_t byteCount);
  void Loop(const std::atomic<bool>& stop);
  void SetFatal(const std::string& what);

  std::unique_ptr<EmuMemoryAccessor> mem;
  mutable std::mutex mu;  // regions, qps, fatal
  std::vector<Region> regions;
  std::vector<std::unique_ptr<Qp>> qps;
  std::mutex processMu;  // one processor at a time (worker or ProcessOnce)
  std::atomic<uint64_t> nExecuted{0}, nFlushed{0}, nCqes{0}, nErrors{0};
  std::string fatal;
  core::BoundedWorker worker{"queue emulator"};  // last: joined before the rest goes
};

// Readable description of a non-OK posting result (for host callers and error messages).
std::string DescribeQueueResult(const core::rdma::QueueResult& r, const core::rdma::QpEndpoint& ep);
// Raises TimeoutError (kTimeout), RemoteError (kQpError, with QPN, WQE index and syndrome) or
// InvalidUsageError (kInvalid); returns on kOk.
void ThrowIfFailed(const core::rdma::QueueResult& r, const core::rdma::QpEndpoint& ep);

}  // namespace mori::application

// Software mlx5 queue emulator (see include/mori/application/rdma/queue_emulator.hpp).
#include "mori/application/rdma/queue_emulator.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>
#include <thread>

#include "mori/core/errors.hpp"
#include "mori/core/logging.hpp"

namespace mori::application {

namespace mlx5 = core::mlx5;
namespace crdma = core::rdma;

namespace {

class HostMemoryAccessor : public EmuMemoryAccessor {
 public:
  void Copy(void* dst, const void* src, size_t bytes) override { std::memmove(dst, src, bytes); }
  uint64_t FetchAdd64(void* target, uint64_t add) override {
    return __atomic_fetch_add(static_cast<uint64_t*>(target), add, __ATOMIC_SEQ_CST);
  }
  uint64_t CompareSwap64(void* target, uint64_t expected, uint64_t desired) override {
    __atomic_compare_exchange_n(static_cast<uint64_t*>(target), &expected, desired, false,
                                __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;
  }
  void Flush() override { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
};

const char* SyndromeName(uint8_t s) {
  switch (s) {
    case mlx5::kSyndromeLocalLengthErr: return "local length error";
    case mlx5::kSyndromeLocalQpOpErr: return "local QP operation error";
    case mlx5::kSyndromeLocalProtErr: return "local protection error";
    case mlx5::kSyndromeWrFlushErr: return "work request flushed";
    case mlx5::kSyndromeMwBindErr: return "memory window bind error";
    case mlx5::kSyndromeBadRespErr: return "bad response";
    case mlx5::kSyndromeLocalAccessErr: return "local access error";
    case mlx5::kSyndromeRemoteInvalReqErr: return "remote invalid request";
    case mlx5::kSyndromeRemoteAccessErr: return "remote access error";
    case mlx5::kSyndromeRemoteOpErr: return "remote operation error";
    case mlx5::kSyndromeTransportRetryExcErr: return "transport retry exceeded";
    case mlx5::kSyndromeRnrRetryExcErr: return "RNR retry exceeded";
    case mlx5::kSyndromeRemoteAbortedErr: return "remote aborted";
  }
  return "unknown syndrome";
}

// A failed WQE: syndrome for the error CQE.
struct WqeFailure {
  uint8_t syndrome;
  const char* why;
};

uint64_t NowNs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

RdmaOpcode CountedOpcode(uint8_t opcode, bool isInline) {
  switch (opcode) {
    case mlx5::kOpNop: return RdmaOpcode::kNop;
    case mlx5::kOpRdmaWrite: return isInline ? RdmaOpcode::kWriteInline : RdmaOpcode::kWrite;
    case mlx5::kOpRdmaWriteImm: return RdmaOpcode::kWriteImm;
    case mlx5::kOpRdmaRead: return RdmaOpcode::kRead;
    case mlx5::kOpAtomicFa: return RdmaOpcode::kFetchAdd;
    case mlx5::kOpAtomicCs: return RdmaOpcode::kCompareSwap;
  }
  return RdmaOpcode::kOther;
}

}  // namespace

std::unique_ptr<EmuMemoryAccessor> MakeHostMemoryAccessor() {
  return std::make_unique<HostMemoryAccessor>();
}

EmuQpConfig EmuQpFromEndpoint(const crdma::QpEndpoint& ep, int pe, int remotePe) {
  EmuQpConfig c{};
  c.sqRing = ep.sq.ring;
  c.sqBlocks = ep.sq.numBlocks;
  c.qpn = ep.sq.qpn;
  c.sqDbrec = ep.sq.dbrec;
  c.cqRing = ep.cq.ring;
  c.numCqes = ep.cq.numCqes;
  c.cqDbrec = ep.cq.dbrec;
  c.pe = pe;
  c.remotePe = remotePe;
  return c;
}

void EmuInitCqRing(void* cqRing, uint32_t numCqes) {
  std::memset(cqRing, 0, static_cast<size_t>(numCqes) * sizeof(mlx5::Mlx5Cqe64));
  for (uint32_t i = 0; i < numCqes; i++) {
    static_cast<uint8_t*>(cqRing)[i * sizeof(mlx5::Mlx5Cqe64) + 63] =
        static_cast<uint8_t>(mlx5::kCqeInvalid << 4);
  }
}

QueueEmulator::QueueEmulator(std::unique_ptr<EmuMemoryAccessor> accessor, const EmuOptions& opts)
    : options(opts),
      mem(accessor ? std::move(accessor) : MakeHostMemoryAccessor()),
      rng(opts.chaosSeed) {
  MORI_ENSURE(options.traceEntries <= kEmuMaxTraceEntries, InvalidUsageError,
              "queue emulator: a trace ring of %zu entries is above the limit of %zu",
              options.traceEntries, kEmuMaxTraceEntries);
  trace.resize(options.traceEntries);
}

QueueEmulator::~QueueEmulator() {
  try {
    Stop();
  } catch (const std::exception& e) {
    MORI_ERROR(kLogRdma, "queue emulator: %s", e.what());
  }
  // If the bounded stop failed, `worker` (the last member) joins before the rest is destroyed.
}

EmuMemoryRegion QueueEmulator::RegisterMemory(int pe, void* base, size_t length, uint32_t access) {
  return RegisterMemoryAt(pe, reinterpret_cast<uint64_t>(base), base, length, access);
}

EmuMemoryRegion QueueEmulator::RegisterMemoryAt(int pe, uint64_t iova, void* access, size_t length,
                                                uint32_t accessFlags) {
  MORI_ENSURE(access != nullptr && length > 0, InvalidUsageError,
              "RegisterMemory: empty region (base %p, length %zu)", access, length);
  std::lock_guard<std::mutex> lock(mu);
  // Keys: index in the upper bits, a constant tag in the low byte (0 is never a key).
  const uint32_t key = (static_cast<uint32_t>(regions.size() + 1) << 8) | 0xa5u;
  regions.push_back(
      Region{pe, static_cast<uint8_t*>(access), iova, length, accessFlags, key, true});
  return EmuMemoryRegion{key, key};
}

void QueueEmulator::RegisterMemoryAs(int pe, uint32_t key, uint64_t iova, void* access,
                                     size_t length, uint32_t accessFlags) {
  MORI_ENSURE(access != nullptr && length > 0 && key != 0, InvalidUsageError,
              "RegisterMemoryAs: empty region or zero key (pe %d, key 0x%x, length %zu)", pe, key,
              length);
  std::lock_guard<std::mutex> lock(mu);
  for (const Region& r : regions)
    MORI_ENSURE(!(r.live && r.pe == pe && r.key == key), InvalidUsageError,
                "RegisterMemoryAs: PE %d already has a region with key 0x%x", pe, key);
  regions.push_back(
      Region{pe, static_cast<uint8_t*>(access), iova, length, accessFlags, key, true});
}

void QueueEmulator::DeregisterMemory(uint32_t lkey) {
  std::lock_guard<std::mutex> lock(mu);
  for (Region& r : regions) {
    if (r.key == lkey) r.live = false;
  }
}

size_t QueueEmulator::AddQp(const EmuQpConfig& cfg) {
  MORI_ENSURE(cfg.sqRing && cfg.sqDbrec && cfg.cqRing, InvalidUsageError,
              "AddQp: SQ ring, SQ doorbell record and CQ ring are required");
  MORI_ENSURE(cfg.sqBlocks > 0 && (cfg.sqBlocks & (cfg.sqBlocks - 1)) == 0 && cfg.sqBlocks <= 32768,
              InvalidUsageError, "AddQp: SQ blocks %u must be a power of two <= 32768",
              cfg.sqBlocks);
  MORI_ENSURE(cfg.numCqes >= cfg.sqBlocks && (cfg.numCqes & (cfg.numCqes - 1)) == 0,
              InvalidUsageError, "AddQp: CQ entries %u must be a power of two >= SQ blocks %u",
              cfg.numCqes, cfg.sqBlocks);
  std::lock_guard<std::mutex> lock(mu);
  auto qp = std::make_unique<Qp>();
  qp->cfg = cfg;
  qp->index = static_cast<uint32_t>(qps.size());
  {
    // Counter rows are shared by every QP of one (pe, remotePe) pair.
    std::lock_guard<std::mutex> statsLock(statsMu);
    size_t base = statRows.size();
    for (size_t i = 0; i < statRows.size(); i += kRdmaNumOpcodes) {
      if (statRows[i].srcPe == cfg.pe && statRows[i].dstPe == cfg.remotePe) {
        base = i;
        break;
      }
    }
    if (base == statRows.size()) {
      for (int op = 0; op < kRdmaNumOpcodes; op++) {
        RdmaOpStats row;
        row.srcPe = cfg.pe;
        row.dstPe = cfg.remotePe;
        row.opcode = static_cast<RdmaOpcode>(op);
        statRows.push_back(row);
      }
    }
    qp->statBase = base;
  }
  qps.push_back(std::move(qp));
  return qps.size() - 1;
}

const QueueEmulator::Region* QueueEmulator::FindRegion(int pe, uint32_t key, uint64_t addr,
                                                       uint64_t len, uint32_t access,
                                                       bool remote) const {
  (void)remote;
  for (const Region& r : regions) {
    if (!r.live || r.key != key || r.pe != pe) continue;
    if ((r.access & access) != access) return nullptr;
    const uint64_t base = r.iova;
    if (addr < base || len > r.length || addr - base > r.length - len) return nullptr;
    return &r;
  }
  return nullptr;
}

void QueueEmulator::SetFatal(const std::string& what) {
  if (fatal.empty()) {
    fatal = what;
    MORI_ERROR(kLogRdma, "queue emulator: %s", what.c_str());
  }
}

void QueueEmulator::CompleteWqe(Qp& qp, const mlx5::Mlx5CqeFields& fields) {
  if (options.chaosSeed == 0) {
    PublishCqe(qp, fields);
    return;
  }
  // Late, but never ahead of an earlier CQE of this QP.
  uint64_t due = NowNs() + rng() % (uint64_t{kEmuChaosMaxCqeLateUs} * 1000 + 1);
  if (!qp.late.empty() && qp.late.back().dueNs > due) due = qp.late.back().dueNs;
  qp.late.push_back(PendingCqe{fields, due});
  nLate.fetch_add(1, std::memory_order_relaxed);
}

size_t QueueEmulator::ReleaseLateCqes(Qp& qp, bool all) {
  if (qp.late.empty()) return 0;
  const uint64_t now = NowNs();
  size_t n = 0;
  while (!qp.late.empty() && (all || qp.late.front().dueNs <= now)) {
    PublishCqe(qp, qp.late.front().fields);
    qp.late.pop_front();
    n++;
  }
  nLate.fetch_sub(n, std::memory_order_relaxed);
  return n;
}

void QueueEmulator::Record(const Qp& qp, RdmaOpcode op, RdmaWqeOutcome outcome, uint32_t bytes,
                           bool isInline, uint16_t wqeIndex) {
  const uint64_t now = options.traceEntries > 0 ? NowNs() : 0;
  std::lock_guard<std::mutex> lock(statsMu);
  RdmaOpStats& row = statRows[qp.statBase + static_cast<size_t>(op)];
  switch (outcome) {
    case RdmaWqeOutcome::kOk:
      row.wqes++;
      row.bytes += bytes;
      row.inlineWqes += isInline ? 1 : 0;
      row.atomics += (op == RdmaOpcode::kFetchAdd || op == RdmaOpcode::kCompareSwap) ? 1 : 0;
      row.sizeHist[RdmaSizeBucket(bytes)]++;
      break;
    case RdmaWqeOutcome::kError: row.errors++; break;
    case RdmaWqeOutcome::kFlushed: row.flushed++; break;
  }
  if (trace.empty()) return;
  RdmaTraceEntry& e = trace[traceTotal % trace.size()];
  e.timeNs = now;
  e.qpn = qp.cfg.qpn & mlx5::kQpnMask;
  e.qp = qp.index;
  e.srcPe = qp.cfg.pe;
  e.dstPe = qp.cfg.remotePe;
  e.opcode = op;
  e.outcome = outcome;
  e.wqeIndex = wqeIndex;
  e.bytes = outcome == RdmaWqeOutcome::kOk ? bytes : 0;
  traceTotal++;
}

void QueueEmulator::PublishCqe(Qp& qp, const mlx5::Mlx5CqeFields& fields) {
  const EmuQpConfig& c = qp.cfg;
  if (c.cqDbrec != nullptr) {
    const uint32_t ci = mlx5::BeToHost32(__atomic_load_n(c.cqDbrec, __ATOMIC_ACQUIRE)) & 0xffffffu;
    const uint32_t outstanding = (static_cast<uint32_t>(qp.cqProduced) - ci) & 0xffffffu;
    if (outstanding >= c.numCqes) {
      SetFatal(core::StrFormat("CQ overrun on QP 0x%x: %u CQEs outstanding, CQ holds %u", c.qpn,
                               outstanding, c.numCqes));
    }
  }
  mlx5::Mlx5CqeFields f = fields;
  f.owner = mlx5::CqeOwnerForIndex(static_cast<uint32_t>(qp.cqProduced), c.numCqes);
  alignas(8) uint8_t staged[64];
  mlx5::EncodeCqe(staged, f);
  uint8_t* slot = static_cast<uint8_t*>(c.cqRing) +
                  static_cast<size_t>(qp.cqProduced & (c.numCqes - 1)) * sizeof(mlx5::Mlx5Cqe64);
  std::memcpy(slot, staged, 60);
  uint32_t tail;
  std::memcpy(&tail, staged + 60, 4);
  __atomic_store_n(reinterpret_cast<uint32_t*>(slot + 60), tail, __ATOMIC_RELEASE);
  qp.cqProduced++;
  nCqes.fetch_add(1, std::memory_order_relaxed);
}

void QueueEmulator::WriteRecvCqe(Qp& qp, uint32_t imm, uint32_t byteCount) {
  // Responder CQE on the target QP's receive CQ (no receive queue is modelled).
  for (auto& peer : qps) {
    if ((peer->cfg.qpn & mlx5::kQpnMask) != (qp.cfg.remoteQpn & mlx5::kQpnMask)) continue;
    if (peer->cfg.recvCqRing == nullptr) return;
    mlx5::Mlx5CqeFields f{};
    f.opcode = mlx5::kCqeRespWrImm;
    f.owner =
        mlx5::CqeOwnerForIndex(static_cast<uint32_t>(peer->recvCqProduced), peer->cfg.recvNumCqes);
    f.byteCount = byteCount;
    f.qpn = peer->cfg.qpn;
    alignas(8) uint8_t staged[64];
    mlx5::EncodeCqe(staged, f);
    std::memcpy(staged + 36, &imm, 4);  // immediate as sent (network order)
    uint8_t* slot = static_cast<uint8_t*>(peer->cfg.recvCqRing) +
                    static_cast<size_t>(peer->recvCqProduced & (peer->cfg.recvNumCqes - 1)) * 64;
    std::memcpy(slot, staged, 60);
    uint32_t tail;
    std::memcpy(&tail, staged + 60, 4);
    __atomic_store_n(reinterpret_cast<uint32_t*>(slot + 60), tail, __ATOMIC_RELEASE);
    peer->recvCqProduced++;
    return;
  }
}

uint32_t QueueEmulator::ExecuteWqe(Qp& qp, uint64_t blk) {
  const EmuQpConfig& c = qp.cfg;
  const uint8_t* first = static_cast<const uint8_t*>(
      mlx5::SqBasicBlock(c.sqRing, static_cast<uint32_t>(blk), c.sqBlocks));
  const uint32_t w0 = mlx5::BeToHost32(mlx5::detail::Load32(first, 0));
  const uint32_t w1 = mlx5::BeToHost32(mlx5::detail::Load32(first, 4));
  const uint8_t opcode = static_cast<uint8_t>(w0 & 0xff);
  const uint16_t wqeIndex = static_cast<uint16_t>((w0 >> 8) & 0xffff);
  const uint32_t qpn = w1 >> 8;
  const uint32_t ds = w1 & 0xff;
  const uint8_t fm = first[11];
  const uint32_t imm = mlx5::detail::Load32(first, 12);
  uint32_t blocks = mlx5::WqeBasicBlocks(ds);
  const bool dsOk = ds >= 1 && blocks <= mlx5::kMaxWqeBasicBlocks && blocks <= c.sqBlocks;
  if (!dsOk) blocks = 1;

  // The whole WQE, gathered across the ring end.
  alignas(16) uint8_t w[mlx5::kMaxWqeBasicBlocks * mlx5::kSendWqeBasicBlock];
  for (uint32_t b = 0; b < blocks; b++) {
    std::memcpy(w + b * 64,
                mlx5::SqBasicBlock(c.sqRing, static_cast<uint32_t>(blk + b), c.sqBlocks), 64);
  }
  const uint32_t bytes = ds * mlx5::kSegmentBytes;

  mlx5::Mlx5CqeFields cqe{};
  cqe.qpn = c.qpn & mlx5::kQpnMask;
  cqe.wqeCounter = wqeIndex;
  cqe.sendOpcode = opcode;

  // For counting WQEs that do not execute: a WRITE whose first segment is inline.
  const bool firstSegInline =
      dsOk && bytes > 32 && (mlx5::BeToHost32(mlx5::detail::Load32(w, 32)) & mlx5::kInlineSegFlag);
  const uint16_t slot = static_cast<uint16_t>(blk);

  if (qp.state.load(std::memory_order_relaxed) != 0) {
    cqe.opcode = mlx5::kCqeReqErr;
    cqe.syndrome = mlx5::kSyndromeWrFlushErr;
    cqe.wqeCounter = slot;
    CompleteWqe(qp, cqe);
    nFlushed.fetch_add(1, std::memory_order_relaxed);
    Record(qp, CountedOpcode(opcode, firstSegInline), RdmaWqeOutcome::kFlushed, 0, false, slot);
    return blocks;
  }

  WqeFailure fail{0, nullptr};
  uint32_t byteCount = 0;
  bool sawInline = false;
  auto failWith = [&](uint8_t syn, const char* why) {
    if (fail.why == nullptr) fail = WqeFailure{syn, why};
  };
  if (!dsOk) failWith(mlx5::kSyndromeLocalLengthErr, "bad DS count");
  if (wqeIndex != static_cast<uint16_t>(blk))
    failWith(mlx5::kSyndromeLocalQpOpErr, "stale WQE index");
  if (qpn != (c.qpn & mlx5::kQpnMask)) failWith(mlx5::kSyndromeLocalQpOpErr, "QPN mismatch");

  auto raddr = [&]() { return mlx5::BeToHost64(mlx5::detail::LoadWord<uint64_t>(w, 16)); };
  auto rkey = [&]() { return mlx5::BeToHost32(mlx5::detail::Load32(w, 24)); };

  if (fail.why == nullptr) {
    switch (opcode) {
      case mlx5::kOpNop: break;
      case mlx5::kOpRdmaWrite:
      case mlx5::kOpRdmaWriteImm:
      case mlx5::kOpRdmaRead: {
        const bool isRead = opcode == mlx5::kOpRdmaRead;
        if (bytes < 32) {
          failWith(mlx5::kSyndromeLocalLengthErr, "no remote address segment");
          break;
        }
        // Scatter/gather list after the raddr segment: data segments or one inline segment.
        struct Piece {
          uint8_t* local;
          const uint8_t* inl;
          uint32_t len;
        };
        Piece pieces[mlx5::kMaxWqeBasicBlocks * 4];
        uint32_t numPieces = 0;
        uint64_t total = 0;
        uint32_t off = 32;
        while (off < bytes && fail.why == nullptr) {
          const uint32_t hdr = mlx5::BeToHost32(mlx5::detail::Load32(w, off));
          if (hdr & mlx5::kInlineSegFlag) {
            const uint32_t len = hdr & ~mlx5::kInlineSegFlag;
            if (isRead || off + mlx5::InlineSegBytes(len) > bytes) {
              failWith(mlx5::kSyndromeLocalLengthErr, "inline segment beyond the WQE");
              break;
            }
            pieces[numPieces++] = Piece{nullptr, w + off + 4, len};
            sawInline = true;
            total += len;
            off += mlx5::InlineSegBytes(len);
          } else {
            const uint32_t len = hdr;
            const uint32_t lkey = mlx5::BeToHost32(mlx5::detail::Load32(w, off + 4));
            const uint64_t addr = mlx5::BeToHost64(mlx5::detail::LoadWord<uint64_t>(w, off + 8));
            const Region* lr =
                len > 0 ? FindRegion(c.pe, lkey, addr, len, isRead ? kEmuLocalWrite : 0, false)
                        : nullptr;
            if (len > 0 && lr == nullptr) {
              failWith(mlx5::kSyndromeLocalProtErr, "bad lkey or local address");
              break;
            }
            pieces[numPieces++] = Piece{lr ? Translate(lr, addr) : nullptr, nullptr, len};
            total += len;
            off += mlx5::kSegmentBytes;
          }
        }
        if (fail.why != nullptr) break;
        const uint64_t ra = raddr();
        const Region* rr = total > 0 ? FindRegion(c.remotePe, rkey(), ra, total,
                                                  isRead ? kEmuRemoteRead : kEmuRemoteWrite, true)
                                     : nullptr;
        if (total > 0 && rr == nullptr) {
          failWith(mlx5::kSyndromeRemoteAccessErr, "bad rkey, access or remote address");
          break;
        }
        uint8_t* remote = rr ? Translate(rr, ra) : nullptr;
        for (uint32_t i = 0; i < numPieces; i++) {
          const Piece& p = pieces[i];
          if (isRead) {
            mem->Copy(p.local, remote, p.len);
          } else {
            mem->Copy(remote, p.inl ? p.inl : p.local, p.len);
          }
          remote += p.len;
        }
        byteCount = static_cast<uint32_t>(total);
        if (opcode == mlx5::kOpRdmaWriteImm) WriteRecvCqe(qp, imm, byteCount);
        break;
      }
      case mlx5::kOpAtomicFa:
      case mlx5::kOpAtomicCs: {
        if (ds != mlx5::kDsAtomic) {
          failWith(mlx5::kSyndromeLocalLengthErr, "atomic WQE needs 4 segments");
          break;
        }
        const uint64_t swapAdd = mlx5::BeToHost64(mlx5::detail::LoadWord<uint64_t>(w, 32));
        const uint64_t compare = mlx5::BeToHost64(mlx5::detail::LoadWord<uint64_t>(w, 40));
        const uint32_t len = mlx5::BeToHost32(mlx5::detail::Load32(w, 48));
        const uint32_t lkey = mlx5::BeToHost32(mlx5::detail::Load32(w, 52));
        const uint64_t laddr = mlx5::BeToHost64(mlx5::detail::LoadWord<uint64_t>(w, 56));
        const uint64_t ra = raddr();
        const Region* lr =
            len == 8 ? FindRegion(c.pe, lkey, laddr, 8, kEmuLocalWrite, false) : nullptr;
        if (lr == nullptr) {
          failWith(mlx5::kSyndromeLocalProtErr, "bad lkey or local result address");
          break;
        }
        if ((ra & 7) != 0) {
          failWith(mlx5::kSyndromeRemoteInvalReqErr, "misaligned atomic target");
          break;
        }
        const Region* rr = FindRegion(c.remotePe, rkey(), ra, 8, kEmuRemoteAtomic, true);
        if (rr == nullptr) {
          failWith(mlx5::kSyndromeRemoteAccessErr, "bad rkey, access or remote address");
          break;
        }
        void* target = Translate(rr, ra);
        const uint64_t old = opcode == mlx5::kOpAtomicFa
                                 ? mem->FetchAdd64(target, swapAdd)
                                 : mem->CompareSwap64(target, compare, swapAdd);
        mem->Copy(Translate(lr, laddr), &old, 8);  // host order (8-byte HCA atomics)
        byteCount = 8;
        break;
      }
      default: failWith(mlx5::kSyndromeLocalQpOpErr, "unsupported opcode"); break;
    }
  }

  if (fail.why != nullptr) {
    MORI_DEBUG(kLogRdma, "emulator: QP 0x%x WQE %u opcode 0x%02x: %s -> syndrome 0x%02x", c.qpn,
               wqeIndex, opcode, fail.why, fail.syndrome);
    qp.state.store(1, std::memory_order_release);
    nErrors.fetch_add(1, std::memory_order_relaxed);
    mem->Flush();
    cqe.opcode = mlx5::kCqeReqErr;
    cqe.syndrome = fail.syndrome;
    CompleteWqe(qp, cqe);  // error completions are written whether or not the WQE was signalled
    Record(qp, CountedOpcode(opcode, firstSegInline), RdmaWqeOutcome::kError, 0, false, slot);
    return blocks;
  }
  nExecuted.fetch_add(1, std::memory_order_relaxed);
  Record(qp, CountedOpcode(opcode, sawInline), RdmaWqeOutcome::kOk, byteCount, sawInline, slot);
  // Execution is synchronous and in order, so every fence mode is honoured trivially.
  // Completion request (fm_ce_se bits 3-2) 2 or 3 asks for a CQE; 0 and 1 complete silently: the
  // next CQE of this QP covers the WQE (the poller advances past every WQE up to the one named).
  if (fm & mlx5::kCtrlCqUpdate) {
    mem->Flush();
    cqe.opcode = mlx5::kCqeReq;
    cqe.byteCount = byteCount;
    CompleteWqe(qp, cqe);
  }
  return blocks;
}

size_t QueueEmulator::ProcessQp(Qp& qp, uint64_t limit, bool* more) {
  const uint32_t dbr = mlx5::BeToHost32(__atomic_load_n(qp.cfg.sqDbrec, __ATOMIC_ACQUIRE));
  const uint16_t pi = static_cast<uint16_t>(dbr & 0xffff);
  const uint64_t end = qp.consumed + static_cast<uint16_t>(pi - static_cast<uint16_t>(qp.consumed));
  size_t n = 0;
  while (qp.consumed < end && n < limit) {
    if (options.chaosSeed != 0) {
      const uint64_t r = rng();
      if (r % kEmuChaosDelayOneIn == 0) {
        std::this_thread::sleep_for(
            std::chrono::microseconds(1 + (r / kEmuChaosDelayOneIn) % kEmuChaosMaxDelayUs));
      }
    }
    const uint32_t blocks = ExecuteWqe(qp, qp.consumed);
    qp.consumed += blocks;
    n++;
  }
  *more = qp.consumed < end;
  return n;
}

QueueEmulator::Round QueueEmulator::ProcessRound() {
  Round round;
  const bool chaos = options.chaosSeed != 0;
  order.resize(qps.size());
  std::iota(order.begin(), order.end(), size_t{0});
  if (chaos) std::shuffle(order.begin(), order.end(), rng);
  for (size_t i : order) {
    Qp& qp = *qps[i];
    const uint64_t limit = chaos ? rng() % (kEmuChaosMaxBurst + 1) : UINT64_MAX;
    bool more = false;
    round.wqes += ProcessQp(qp, limit, &more);
    round.cqes += ReleaseLateCqes(qp, false);
    round.pending = round.pending || more || !qp.late.empty();
  }
  return round;
}

size_t QueueEmulator::ProcessOnce() {
  std::lock_guard<std::mutex> lock(mu);
  return ProcessRound().wqes;
}

size_t QueueEmulator::PendingCqes() const { return nLate.load(std::memory_order_relaxed); }

void QueueEmulator::Loop(const std::atomic<bool>& stop) {
  uint32_t idle = 0;
  while (!stop.load(std::memory_order_acquire)) {
    Round round;
    try {
      std::lock_guard<std::mutex> lock(mu);
      round = ProcessRound();
    } catch (const std::exception& e) {
      // A memory accessor failure (e.g. a GPU copy that did not finish in time): the emulator can
      // no longer make progress. Posters time out on their completions; FatalError() says why.
      std::lock_guard<std::mutex> lock(mu);
      SetFatal(std::string("worker stopped: ") + e.what());
      break;
    }
    if (round.wqes > 0 || round.cqes > 0) {
      idle = 0;
      continue;
    }
    if (round.pending) {  // chaos mode holds work back: come back soon
      std::this_thread::yield();
      continue;
    }
    // Back-off: yield first, then short sleeps (a GPU poster writes the records later).
    if (++idle < 256) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(idle < 4096 ? 10 : 200));
    }
  }
  // The WQEs behind late CQEs have executed: their completions are published before the worker
  // goes, so a later Quiet (or ProcessOnce caller) does not wait for them.
  std::lock_guard<std::mutex> lock(mu);
  for (auto& qp : qps) ReleaseLateCqes(*qp, true);
}

void QueueEmulator::Start() {
  worker.Start([this](const std::atomic<bool>& stop) { Loop(stop); });
}

void QueueEmulator::Stop(int timeoutMs) { worker.Stop(timeoutMs); }

EmuQpState QueueEmulator::QpState(size_t qp) const {
  std::lock_guard<std::mutex> lock(mu);
  MORI_ENSURE(qp < qps.size(), InvalidUsageError, "QpState: no QP %zu", qp);
  return qps[qp]->state.load(std::memory_order_acquire) ? EmuQpState::kError : EmuQpState::kRts;
}

EmuStats QueueEmulator::Stats() const {
  return EmuStats{nExecuted.load(), nFlushed.load(), nCqes.load(), nErrors.load()};
}

RdmaWireStats QueueEmulator::WireStats(bool reset) {
  RdmaWireStats out;
  out.available = true;
  out.source = options.chaosSeed != 0
                   ? core::StrFormat("software queue emulator (chaos seed %llu)",
                                     static_cast<unsigned long long>(options.chaosSeed))
                   : std::string("software queue emulator");
  // Same lock order as the worker (mu, then statsMu in Record).
  std::lock_guard<std::mutex> qpsLock(mu);
  for (const auto& qp : qps) {
    const uint32_t dbr = mlx5::BeToHost32(__atomic_load_n(qp->cfg.sqDbrec, __ATOMIC_ACQUIRE));
    out.pendingSqBlocks += static_cast<uint16_t>(static_cast<uint16_t>(dbr & 0xffff) -
                                                 static_cast<uint16_t>(qp->consumed));
  }
  std::lock_guard<std::mutex> lock(statsMu);
  for (RdmaOpStats& row : statRows) {
    if (row.wqes != 0 || row.errors != 0 || row.flushed != 0) out.perPeer.push_back(row);
    if (reset) {
      RdmaOpStats zero;
      zero.srcPe = row.srcPe;
      zero.dstPe = row.dstPe;
      zero.opcode = row.opcode;
      row = zero;
    }
  }
  std::sort(out.perPeer.begin(), out.perPeer.end(), [](const RdmaOpStats& a, const RdmaOpStats& b) {
    if (a.srcPe != b.srcPe) return a.srcPe < b.srcPe;
    if (a.dstPe != b.dstPe) return a.dstPe < b.dstPe;
    return a.opcode < b.opcode;
  });
  out.traceCapacity = trace.size();
  if (!trace.empty()) {
    const uint64_t kept = std::min<uint64_t>(traceTotal, trace.size());
    out.traceDropped = traceTotal - kept;
    out.trace.reserve(kept);
    for (uint64_t i = traceTotal - kept; i < traceTotal; i++)
      out.trace.push_back(trace[i % trace.size()]);
  }
  if (reset) traceTotal = 0;
  return out;
}

std::string QueueEmulator::FatalError() const {
  std::lock_guard<std::mutex> lock(mu);
  return fatal;
}

std::string DescribeQueueResult(const crdma::QueueResult& r, const crdma::QpEndpoint& ep) {
  switch (r.status) {
    case crdma::QueueStatus::kOk: return "ok";
    case crdma::QueueStatus::kTimeout:
      return core::StrFormat(
          "QP 0x%x: timed out after %.3f ms waiting for %s (*%p >= %llu, saw %llu)", ep.sq.qpn,
          static_cast<double>(r.elapsedNs) / 1e6, r.waitedFor ? r.waitedFor : "?", r.addr,
          static_cast<unsigned long long>(r.expected), static_cast<unsigned long long>(r.seen));
    case crdma::QueueStatus::kQpError: {
      const crdma::CqErrorInfo e = *ep.cq.error;
      return core::StrFormat(
          "QP 0x%x: error completion for WQE index %u (send opcode 0x%02x): syndrome 0x%02x (%s), "
          "vendor syndrome 0x%02x",
          e.qpn, e.wqeCounter, e.sendOpcode, e.syndrome, SyndromeName(e.syndrome),
          e.vendorSyndrome);
    }
    case crdma::QueueStatus::kInvalid:
      return core::StrFormat("QP 0x%x: invalid request: need %s (limit %llu, got %llu)", ep.sq.qpn,
                             r.waitedFor ? r.waitedFor : "?",
                             static_cast<unsigned long long>(r.expected),
                             static_cast<unsigned long long>(r.seen));
  }
  return "unknown status";
}

void ThrowIfFailed(const crdma::QueueResult& r, const crdma::QpEndpoint& ep) {
  switch (r.status) {
    case crdma::QueueStatus::kOk: return;
    case crdma::QueueStatus::kTimeout:
      MORI_THROW(TimeoutError, "%s", DescribeQueueResult(r, ep).c_str());
    case crdma::QueueStatus::kQpError:
      MORI_THROW(RemoteError, "%s", DescribeQueueResult(r, ep).c_str());
    case crdma::QueueStatus::kInvalid:
      MORI_THROW(InvalidUsageError, "%s", DescribeQueueResult(r, ep).c_str());
  }
}

}  // namespace mori::application

// mlx5 send-queue WQE segments and 64-byte CQEs: our own layouts and encoders, usable from host
// and device code. Every multi-byte field the NIC reads is big-endian; the encoders take host
// values and do the byte swaps. No verbs or GPU runtime header is included (layer core); the
// layouts are checked byte for byte against rdma-core's <infiniband/mlx5dv.h> in
// tests/core/mlx5_wqe_test.cpp.
//
// Destinations: segment encoders write whole 32/64-bit words; `dst` must be 16-byte aligned (all
// WQE segments start on 16-byte boundaries of the send queue) and the CQE at 64-byte alignment.
// A WQE that crosses the end of the SQ ring must be split by the caller (16-byte granularity).
#pragma once

#include <cstddef>
#include <cstdint>

#include "mori/core/host_device.hpp"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "mlx5_wqe.hpp assumes a little-endian host and device (x86-64, aarch64, NVIDIA, AMD GPUs)"
#endif

namespace mori::core::mlx5 {

// ---------------------------------------------------------------------------------------------
// Constants (values as in the mlx5 PRM; rdma-core names in comments)
// ---------------------------------------------------------------------------------------------
// Send WQE opcodes (MLX5_OPCODE_*): low byte of the control segment's first word.
enum Mlx5Opcode : uint8_t {
  kOpNop = 0x00,
  kOpRdmaWrite = 0x08,
  kOpRdmaWriteImm = 0x09,
  kOpSend = 0x0a,
  kOpSendImm = 0x0b,
  kOpRdmaRead = 0x10,
  kOpAtomicCs = 0x11,
  kOpAtomicFa = 0x12,
  kOpAtomicMaskedCs = 0x14,
  kOpAtomicMaskedFa = 0x15,
};

// CQE opcodes (MLX5_CQE_*): high nibble of op_own.
enum Mlx5CqeOpcode : uint8_t {
  kCqeReq = 0,
  kCqeRespWrImm = 1,
  kCqeRespSend = 2,
  kCqeRespSendImm = 3,
  kCqeRespSendInv = 4,
  kCqeReqErr = 13,
  kCqeRespErr = 14,
  kCqeInvalid = 15,
};

// Error CQE syndromes (MLX5_CQE_SYNDROME_*).
enum Mlx5CqeSyndrome : uint8_t {
  kSyndromeLocalLengthErr = 0x01,
  kSyndromeLocalQpOpErr = 0x02,
  kSyndromeLocalProtErr = 0x04,
  kSyndromeWrFlushErr = 0x05,
  kSyndromeMwBindErr = 0x06,
  kSyndromeBadRespErr = 0x10,
  kSyndromeLocalAccessErr = 0x11,
  kSyndromeRemoteInvalReqErr = 0x12,
  kSyndromeRemoteAccessErr = 0x13,
  kSyndromeRemoteOpErr = 0x14,
  kSyndromeTransportRetryExcErr = 0x15,
  kSyndromeRnrRetryExcErr = 0x16,
  kSyndromeRemoteAbortedErr = 0x22,
};

// Control segment byte 11 (fm_ce_se): fence mode bits 7-5, completion request bits 3-2,
// solicited event bit 1.
constexpr uint8_t kCtrlCqUpdate = 0x08;             // MLX5_WQE_CTRL_CQ_UPDATE: write a CQE
constexpr uint8_t kCtrlSolicited = 0x02;            // MLX5_WQE_CTRL_SOLICITED
constexpr uint8_t kCtrlFence = 0x80;                // MLX5_WQE_CTRL_FENCE (small-and-fence)
constexpr uint8_t kCtrlInitiatorSmallFence = 0x20;  // MLX5_WQE_CTRL_INITIATOR_SMALL_FENCE

constexpr uint32_t kSendWqeBasicBlock = 64;       // MLX5_SEND_WQE_BB
constexpr uint32_t kSendWqeShift = 6;             // MLX5_SEND_WQE_SHIFT
constexpr uint32_t kSegmentBytes = 16;            // one "DS" unit
constexpr uint32_t kInlineSegFlag = 0x80000000u;  // MLX5_INLINE_SEG
constexpr uint32_t kMaxWqeBasicBlocks = 16;       // a WQE spans at most 16 basic blocks (1 KiB)
constexpr uint8_t kCqeOwnerMask = 0x01;           // MLX5_CQE_OWNER_MASK
constexpr uint32_t kQpnMask = 0x00ffffffu;

// ---------------------------------------------------------------------------------------------
// Byte order (written with shifts: nvcc and clang device code both turn them into byte permutes)
// ---------------------------------------------------------------------------------------------
MORI_HD_INLINE constexpr uint16_t Bswap16(uint16_t v) {
  return static_cast<uint16_t>((v >> 8) | (v << 8));
}
MORI_HD_INLINE constexpr uint32_t Bswap32(uint32_t v) {
  return (v >> 24) | ((v >> 8) & 0x0000ff00u) | ((v << 8) & 0x00ff0000u) | (v << 24);
}
MORI_HD_INLINE constexpr uint64_t Bswap64(uint64_t v) {
  return (static_cast<uint64_t>(Bswap32(static_cast<uint32_t>(v))) << 32) |
         Bswap32(static_cast<uint32_t>(v >> 32));
}
// Host order <-> big-endian (the host and GPUs we target are little-endian; see the #error above).
MORI_HD_INLINE constexpr uint16_t HostToBe16(uint16_t v) { return Bswap16(v); }
MORI_HD_INLINE constexpr uint32_t HostToBe32(uint32_t v) { return Bswap32(v); }
MORI_HD_INLINE constexpr uint64_t HostToBe64(uint64_t v) { return Bswap64(v); }
MORI_HD_INLINE constexpr uint16_t BeToHost16(uint16_t v) { return Bswap16(v); }
MORI_HD_INLINE constexpr uint32_t BeToHost32(uint32_t v) { return Bswap32(v); }
MORI_HD_INLINE constexpr uint64_t BeToHost64(uint64_t v) { return Bswap64(v); }

static_assert(Bswap16(0x1234) == 0x3412, "Bswap16");
static_assert(Bswap32(0x12345678u) == 0x78563412u, "Bswap32");
static_assert(Bswap64(0x0102030405060708ull) == 0x0807060504030201ull, "Bswap64");

// ---------------------------------------------------------------------------------------------
// Layouts. Fields named *Be hold big-endian values as they lie in memory.
// ---------------------------------------------------------------------------------------------
// Control segment: first 16 bytes of every WQE.
struct Mlx5CtrlSeg {
  uint32_t opmodIdxOpcodeBe;  // opmod[31:24] | wqe_index[23:8] | opcode[7:0]
  uint32_t qpnDsBe;           // qpn[31:8] | ds[7:0] (WQE size in 16-byte units)
  uint8_t signature;
  uint8_t dciStreamChannelId[2];  // 0 for RC
  uint8_t fmCeSe;                 // fence mode / completion request / solicited
  uint32_t imm;                   // stored verbatim (immediate data is already network order)
};
static_assert(sizeof(Mlx5CtrlSeg) == 16, "ctrl seg is 16 bytes");
static_assert(offsetof(Mlx5CtrlSeg, opmodIdxOpcodeBe) == 0, "ctrl layout");
static_assert(offsetof(Mlx5CtrlSeg, qpnDsBe) == 4, "ctrl layout");
static_assert(offsetof(Mlx5CtrlSeg, signature) == 8, "ctrl layout");
static_assert(offsetof(Mlx5CtrlSeg, dciStreamChannelId) == 9, "ctrl layout");
static_assert(offsetof(Mlx5CtrlSeg, fmCeSe) == 11, "ctrl layout");
static_assert(offsetof(Mlx5CtrlSeg, imm) == 12, "ctrl layout");

// Remote address segment (RDMA write/read, atomics).
struct Mlx5RaddrSeg {
  uint64_t raddrBe;
  uint32_t rkeyBe;
  uint32_t reserved;
};
static_assert(sizeof(Mlx5RaddrSeg) == 16, "raddr seg is 16 bytes");
static_assert(offsetof(Mlx5RaddrSeg, raddrBe) == 0, "raddr layout");
static_assert(offsetof(Mlx5RaddrSeg, rkeyBe) == 8, "raddr layout");
static_assert(offsetof(Mlx5RaddrSeg, reserved) == 12, "raddr layout");

// Data (scatter/gather pointer) segment.
struct Mlx5DataSeg {
  uint32_t byteCountBe;
  uint32_t lkeyBe;
  uint64_t addrBe;
};
static_assert(sizeof(Mlx5DataSeg) == 16, "data seg is 16 bytes");
static_assert(offsetof(Mlx5DataSeg, byteCountBe) == 0, "data layout");
static_assert(offsetof(Mlx5DataSeg, lkeyBe) == 4, "data layout");
static_assert(offsetof(Mlx5DataSeg, addrBe) == 8, "data layout");

// 8-byte atomic arguments: fetch-add puts the addend in swapAdd (compare unused, 0);
// compare-swap puts the new value in swapAdd and the expected one in compare.
struct Mlx5AtomicSeg {
  uint64_t swapAddBe;
  uint64_t compareBe;
};
static_assert(sizeof(Mlx5AtomicSeg) == 16, "atomic seg is 16 bytes");
static_assert(offsetof(Mlx5AtomicSeg, swapAddBe) == 0, "atomic layout");
static_assert(offsetof(Mlx5AtomicSeg, compareBe) == 8, "atomic layout");

// Inline data: this 4-byte header (BE32 of len | kInlineSegFlag), the bytes, zero padding to 16.
struct Mlx5InlineSegHeader {
  uint32_t byteCountBe;
};
static_assert(sizeof(Mlx5InlineSegHeader) == 4, "inline header is 4 bytes");

// 64-byte completion queue entry, the fields this library reads.
struct alignas(8) Mlx5Cqe64 {
  uint8_t rsvd0[32];
  uint32_t srqnUidxBe;    // 32
  uint32_t immInvalPkey;  // 36 (immediate data as sent: network order)
  uint8_t app;            // 40
  uint8_t appOp;          // 41
  uint16_t appInfoBe;     // 42
  uint32_t byteCntBe;     // 44
  uint64_t timestampBe;   // 48
  uint32_t sopDropQpnBe;  // 56: send opcode[31:24] (requester CQEs) | qpn[23:0]
  uint16_t wqeCounterBe;  // 60: wqe_index of the completed WQE
  uint8_t signature;      // 62
  uint8_t opOwn;          // 63: opcode[7:4] | format[3:2] | se[1] | owner[0]
};
static_assert(sizeof(Mlx5Cqe64) == 64, "CQE is 64 bytes");
static_assert(offsetof(Mlx5Cqe64, srqnUidxBe) == 32, "cqe layout");
static_assert(offsetof(Mlx5Cqe64, immInvalPkey) == 36, "cqe layout");
static_assert(offsetof(Mlx5Cqe64, app) == 40, "cqe layout");
static_assert(offsetof(Mlx5Cqe64, appOp) == 41, "cqe layout");
static_assert(offsetof(Mlx5Cqe64, appInfoBe) == 42, "cqe layout");
static_assert(offsetof(Mlx5Cqe64, byteCntBe) == 44, "cqe layout");
static_assert(offsetof(Mlx5Cqe64, timestampBe) == 48, "cqe layout");
static_assert(offsetof(Mlx5Cqe64, sopDropQpnBe) == 56, "cqe layout");
static_assert(offsetof(Mlx5Cqe64, wqeCounterBe) == 60, "cqe layout");
static_assert(offsetof(Mlx5Cqe64, signature) == 62, "cqe layout");
static_assert(offsetof(Mlx5Cqe64, opOwn) == 63, "cqe layout");

// The same 64 bytes as an error CQE (opcode kCqeReqErr / kCqeRespErr).
struct alignas(8) Mlx5ErrCqe {
  uint8_t rsvd0[32];
  uint32_t srqnBe;            // 32
  uint8_t rsvd1[18];          // 36
  uint8_t vendorErrSyndrome;  // 54
  uint8_t syndrome;           // 55
  uint32_t sWqeOpcodeQpnBe;   // 56
  uint16_t wqeCounterBe;      // 60
  uint8_t signature;          // 62
  uint8_t opOwn;              // 63
};
static_assert(sizeof(Mlx5ErrCqe) == 64, "error CQE is 64 bytes");
static_assert(offsetof(Mlx5ErrCqe, srqnBe) == 32, "err cqe layout");
static_assert(offsetof(Mlx5ErrCqe, vendorErrSyndrome) == 54, "err cqe layout");
static_assert(offsetof(Mlx5ErrCqe, syndrome) == 55, "err cqe layout");
static_assert(offsetof(Mlx5ErrCqe, sWqeOpcodeQpnBe) == 56, "err cqe layout");
static_assert(offsetof(Mlx5ErrCqe, wqeCounterBe) == 60, "err cqe layout");
static_assert(offsetof(Mlx5ErrCqe, signature) == 62, "err cqe layout");
static_assert(offsetof(Mlx5ErrCqe, opOwn) == 63, "err cqe layout");

// ---------------------------------------------------------------------------------------------
// Sizes
// ---------------------------------------------------------------------------------------------
// 16-byte units ("DS") covering `bytes`.
MORI_HD_INLINE constexpr uint32_t DsCount(uint32_t bytes) {
  return (bytes + kSegmentBytes - 1) / kSegmentBytes;
}
// 64-byte basic blocks a WQE of `dsCount` 16-byte units occupies in the SQ.
MORI_HD_INLINE constexpr uint32_t WqeBasicBlocks(uint32_t dsCount) { return (dsCount + 3) / 4; }
// Bytes an inline segment carrying `len` payload bytes occupies (header + data, padded to 16).
MORI_HD_INLINE constexpr uint32_t InlineSegBytes(uint32_t len) {
  return DsCount(static_cast<uint32_t>(sizeof(Mlx5InlineSegHeader)) + len) * kSegmentBytes;
}
// DS counts of the WQEs built below (RC: no address vector segment).
constexpr uint32_t kDsRdmaWrite = 3;  // ctrl + raddr + data
constexpr uint32_t kDsRdmaRead = 3;   // ctrl + raddr + data (local destination)
constexpr uint32_t kDsAtomic = 4;     // ctrl + raddr + atomic + data (local result)
constexpr uint32_t kDsNop = 1;        // ctrl
MORI_HD_INLINE constexpr uint32_t DsRdmaWriteInline(uint32_t len) {
  return 2 + InlineSegBytes(len) / kSegmentBytes;
}
// Largest inline payload that fits a WQE of `maxBasicBlocks` blocks.
MORI_HD_INLINE constexpr uint32_t MaxInlineBytes(uint32_t maxBasicBlocks) {
  return maxBasicBlocks * kSendWqeBasicBlock - 2 * kSegmentBytes -
         static_cast<uint32_t>(sizeof(Mlx5InlineSegHeader));
}
static_assert(WqeBasicBlocks(kDsRdmaWrite) == 1 && WqeBasicBlocks(kDsAtomic) == 1, "one block");
static_assert(WqeBasicBlocks(5) == 2, "blocks round up");
static_assert(DsRdmaWriteInline(12) == 3 && DsRdmaWriteInline(13) == 4, "inline ds");

// Address of basic block `index` (a free-running counter) in an SQ of `numBlocks` (power of two).
MORI_HD_INLINE void* SqBasicBlock(void* sqBase, uint32_t index, uint32_t numBlocks) {
  return static_cast<uint8_t*>(sqBase) +
         (static_cast<size_t>(index & (numBlocks - 1)) << kSendWqeShift);
}

// ---------------------------------------------------------------------------------------------
// Stores: whole words. Device code stores through typed pointers (dst alignment is the caller's
// contract above); host code goes through __builtin_memcpy, which compiles to the same single
// store and keeps the host compilers' aliasing rules satisfied whatever the buffer's type.
// ---------------------------------------------------------------------------------------------
namespace detail {
#if MORI_DEVICE_PASS
template <typename T>
MORI_HD_INLINE void StoreWord(void* dst, size_t offset, T v) {
  *reinterpret_cast<T*>(static_cast<uint8_t*>(dst) + offset) = v;
}
template <typename T>
MORI_HD_INLINE T LoadWord(const void* src, size_t offset) {
  return *reinterpret_cast<const T*>(static_cast<const uint8_t*>(src) + offset);
}
#else
template <typename T>
MORI_HD_INLINE void StoreWord(void* dst, size_t offset, T v) {
  __builtin_memcpy(static_cast<uint8_t*>(dst) + offset, &v, sizeof(T));
}
template <typename T>
MORI_HD_INLINE T LoadWord(const void* src, size_t offset) {
  T v;
  __builtin_memcpy(&v, static_cast<const uint8_t*>(src) + offset, sizeof(T));
  return v;
}
#endif
MORI_HD_INLINE void Store32(void* dst, size_t offset, uint32_t v) { StoreWord(dst, offset, v); }
MORI_HD_INLINE void Store64(void* dst, size_t offset, uint64_t v) { StoreWord(dst, offset, v); }
MORI_HD_INLINE uint32_t Load32(const void* src, size_t offset) {
  return LoadWord<uint32_t>(src, offset);
}
MORI_HD_INLINE uint16_t Load16(const void* src, size_t offset) {
  return LoadWord<uint16_t>(src, offset);
}
MORI_HD_INLINE uint8_t Load8(const void* src, size_t offset) {
  return static_cast<const uint8_t*>(src)[offset];
}
}  // namespace detail

// ---------------------------------------------------------------------------------------------
// Segment encoders. Each writes its full 16 bytes (reserved bytes as 0) and returns bytes written.
// ---------------------------------------------------------------------------------------------
// Control segment. `wqeIndex` is the low 16 bits of the WQE's first basic-block counter; `qpn`
// keeps its low 24 bits; `fmFlags` is the fm_ce_se byte (kCtrlCqUpdate | fence bits ...);
// `immOrRkey` is stored verbatim: for RDMA_WRITE_IMM pass ImmData(hostValue).
MORI_HD_INLINE uint32_t EncodeCtrlSeg(void* dst, uint16_t wqeIndex, uint8_t opcode, uint8_t opmod,
                                      uint32_t qpn, uint8_t dsCount, uint8_t fmFlags,
                                      uint8_t signature, uint32_t immOrRkey) {
  detail::Store32(dst, 0,
                  HostToBe32((static_cast<uint32_t>(opmod) << 24) |
                             (static_cast<uint32_t>(wqeIndex) << 8) | opcode));
  detail::Store32(dst, 4, HostToBe32((qpn << 8) | dsCount));
  // Bytes 8..11 as one word: signature, dci stream id (0, 0), fm_ce_se.
  detail::Store32(dst, 8,
                  static_cast<uint32_t>(signature) | (static_cast<uint32_t>(fmFlags) << 24));
  detail::Store32(dst, 12, immOrRkey);
  return kSegmentBytes;
}
// Immediate data as the ctrl segment carries it (network order).
MORI_HD_INLINE constexpr uint32_t ImmData(uint32_t hostValue) { return HostToBe32(hostValue); }

MORI_HD_INLINE uint32_t EncodeRaddrSeg(void* dst, uint64_t raddr, uint32_t rkey) {
  detail::Store64(dst, 0, HostToBe64(raddr));
  detail::Store32(dst, 8, HostToBe32(rkey));
  detail::Store32(dst, 12, 0);
  return kSegmentBytes;
}

MORI_HD_INLINE uint32_t EncodeDataSeg(void* dst, uint32_t len, uint32_t lkey, uint64_t addr) {
  detail::Store32(dst, 0, HostToBe32(len));
  detail::Store32(dst, 4, HostToBe32(lkey));
  detail::Store64(dst, 8, HostToBe64(addr));
  return kSegmentBytes;
}

MORI_HD_INLINE uint32_t EncodeAtomicSeg(void* dst, uint64_t swapAdd, uint64_t compare) {
  detail::Store64(dst, 0, HostToBe64(swapAdd));
  detail::Store64(dst, 8, HostToBe64(compare));
  return kSegmentBytes;
}

// Inline data segment: header, `len` bytes of `data`, zero padding to a 16-byte multiple.
// Returns InlineSegBytes(len). `dst` must have room for that many contiguous bytes.
MORI_HD_INLINE uint32_t EncodeInlineSeg(void* dst, const void* data, uint32_t len) {
  detail::Store32(dst, 0, HostToBe32(len | kInlineSegFlag));
  uint8_t* out = static_cast<uint8_t*>(dst) + sizeof(Mlx5InlineSegHeader);
  const uint8_t* in = static_cast<const uint8_t*>(data);
  const uint32_t total = InlineSegBytes(len);
  for (uint32_t i = 0; i < len; i++) out[i] = in[i];
  for (uint32_t i = len + static_cast<uint32_t>(sizeof(Mlx5InlineSegHeader)); i < total; i++) {
    static_cast<uint8_t*>(dst)[i] = 0;
  }
  return total;
}

// ---------------------------------------------------------------------------------------------
// Whole RC WQEs (contiguous: the caller handles a WQE that would cross the SQ end).
// Each returns its DS count; the WQE occupies WqeBasicBlocks(ds) blocks.
// ---------------------------------------------------------------------------------------------
struct Mlx5WqeHeader {
  uint16_t wqeIndex;  // low 16 bits of the WQE's first basic-block counter
  uint32_t qpn;
  uint8_t fmFlags;  // kCtrlCqUpdate for a signalled WQE, fence bits as needed
};

struct Mlx5LocalBuf {
  uint64_t addr;
  uint32_t lkey;
  uint32_t len;
};

struct Mlx5RemoteBuf {
  uint64_t addr;
  uint32_t rkey;
};

// RDMA write (opcode kOpRdmaWrite) or write-with-immediate (kOpRdmaWriteImm, imm = ImmData(v)).
MORI_HD_INLINE uint32_t EncodeRdmaWriteWqe(void* dst, const Mlx5WqeHeader& h,
                                           const Mlx5LocalBuf& src, const Mlx5RemoteBuf& dstRemote,
                                           bool withImm = false, uint32_t imm = 0) {
  uint8_t* p = static_cast<uint8_t*>(dst);
  p += EncodeCtrlSeg(p, h.wqeIndex, withImm ? kOpRdmaWriteImm : kOpRdmaWrite, 0, h.qpn,
                     kDsRdmaWrite, h.fmFlags, 0, withImm ? imm : 0);
  p += EncodeRaddrSeg(p, dstRemote.addr, dstRemote.rkey);
  EncodeDataSeg(p, src.len, src.lkey, src.addr);
  return kDsRdmaWrite;
}

// RDMA write of `len` bytes carried inside the WQE (no lkey needed).
MORI_HD_INLINE uint32_t EncodeRdmaWriteInlineWqe(void* dst, const Mlx5WqeHeader& h,
                                                 const void* data, uint32_t len,
                                                 const Mlx5RemoteBuf& dstRemote) {
  const uint32_t ds = DsRdmaWriteInline(len);
  uint8_t* p = static_cast<uint8_t*>(dst);
  p += EncodeCtrlSeg(p, h.wqeIndex, kOpRdmaWrite, 0, h.qpn, static_cast<uint8_t>(ds), h.fmFlags, 0,
                     0);
  p += EncodeRaddrSeg(p, dstRemote.addr, dstRemote.rkey);
  EncodeInlineSeg(p, data, len);
  return ds;
}

// RDMA read of dst.len bytes from the remote source into the local destination.
MORI_HD_INLINE uint32_t EncodeRdmaReadWqe(void* dst, const Mlx5WqeHeader& h,
                                          const Mlx5LocalBuf& localDst, const Mlx5RemoteBuf& src) {
  uint8_t* p = static_cast<uint8_t*>(dst);
  p += EncodeCtrlSeg(p, h.wqeIndex, kOpRdmaRead, 0, h.qpn, kDsRdmaRead, h.fmFlags, 0, 0);
  p += EncodeRaddrSeg(p, src.addr, src.rkey);
  EncodeDataSeg(p, localDst.len, localDst.lkey, localDst.addr);
  return kDsRdmaRead;
}

// 8-byte fetch-add (kOpAtomicFa: swapAdd = addend, compare ignored and written 0) or
// compare-swap (kOpAtomicCs: swapAdd = new value, compare = expected). The old value lands in
// `result` (8 bytes, result.len is written as 8).
MORI_HD_INLINE uint32_t EncodeAtomicWqe(void* dst, const Mlx5WqeHeader& h, uint8_t opcode,
                                        const Mlx5LocalBuf& result, const Mlx5RemoteBuf& target,
                                        uint64_t swapAdd, uint64_t compare) {
  uint8_t* p = static_cast<uint8_t*>(dst);
  p += EncodeCtrlSeg(p, h.wqeIndex, opcode, 0, h.qpn, kDsAtomic, h.fmFlags, 0, 0);
  p += EncodeRaddrSeg(p, target.addr, target.rkey);
  p += EncodeAtomicSeg(p, swapAdd, opcode == kOpAtomicCs ? compare : 0);
  EncodeDataSeg(p, 8, result.lkey, result.addr);
  return kDsAtomic;
}

// NOP (e.g. a signalled WQE that closes a batch).
MORI_HD_INLINE uint32_t EncodeNopWqe(void* dst, const Mlx5WqeHeader& h) {
  EncodeCtrlSeg(dst, h.wqeIndex, kOpNop, 0, h.qpn, kDsNop, h.fmFlags, 0, 0);
  return kDsNop;
}

// Doorbell record value of the send queue (DBR dword 1): the producer counter's low 16 bits, BE.
MORI_HD_INLINE constexpr uint32_t SqDoorbellRecord(uint32_t producerIndex) {
  return HostToBe32(producerIndex & 0xffffu);
}

// ---------------------------------------------------------------------------------------------
// CQEs
// ---------------------------------------------------------------------------------------------
struct Mlx5CqeFields {
  uint8_t opcode;       // Mlx5CqeOpcode
  uint8_t owner;        // 0 or 1
  uint8_t format;       // op_own bits 3-2 (0: no compression)
  uint16_t wqeCounter;  // wqe_index of the completed WQE
  uint32_t byteCount;   // responder: bytes received; requester reads/atomics: bytes returned
  uint32_t qpn;
  uint8_t sendOpcode;      // requester CQEs: opcode of the completed WQE (top byte at offset 56)
  uint8_t syndrome;        // error CQEs only, else 0
  uint8_t vendorSyndrome;  // error CQEs only, else 0
};

MORI_HD_INLINE constexpr bool IsErrorCqeOpcode(uint8_t opcode) {
  return opcode == kCqeReqErr || opcode == kCqeRespErr;
}

// Reads the fields above from a 64-byte CQE (8-byte aligned).
MORI_HD_INLINE Mlx5CqeFields DecodeCqe(const void* cqe) {
  Mlx5CqeFields f{};
  const uint8_t opOwn = detail::Load8(cqe, 63);
  f.opcode = static_cast<uint8_t>(opOwn >> 4);
  f.owner = static_cast<uint8_t>(opOwn & kCqeOwnerMask);
  f.format = static_cast<uint8_t>((opOwn >> 2) & 0x3);
  f.wqeCounter = BeToHost16(detail::Load16(cqe, 60));
  const uint32_t sopQpn = BeToHost32(detail::Load32(cqe, 56));
  f.qpn = sopQpn & kQpnMask;
  f.sendOpcode = static_cast<uint8_t>(sopQpn >> 24);
  if (IsErrorCqeOpcode(f.opcode)) {
    f.syndrome = detail::Load8(cqe, 55);
    f.vendorSyndrome = detail::Load8(cqe, 54);
    f.byteCount = 0;
  } else {
    f.byteCount = BeToHost32(detail::Load32(cqe, 44));
  }
  return f;
}

// Writes a complete 64-byte CQE (all other bytes 0) from `f`: what the NIC would write, for the
// software queue emulator and tests. The word holding op_own is written last, but this makes no
// memory-ordering claim: a writer racing a poller must publish that word with release semantics.
MORI_HD_INLINE void EncodeCqe(void* cqe, const Mlx5CqeFields& f) {
  for (uint32_t off = 0; off < 56; off += 4) detail::Store32(cqe, off, 0);
  if (IsErrorCqeOpcode(f.opcode)) {
    // Bytes 52..55: reserved, reserved, vendor syndrome, syndrome.
    detail::Store32(cqe, 52,
                    (static_cast<uint32_t>(f.vendorSyndrome) << 16) |
                        (static_cast<uint32_t>(f.syndrome) << 24));
  } else {
    detail::Store32(cqe, 44, HostToBe32(f.byteCount));
  }
  detail::Store32(cqe, 56,
                  HostToBe32((static_cast<uint32_t>(f.sendOpcode) << 24) | (f.qpn & kQpnMask)));
  const uint8_t opOwn =
      static_cast<uint8_t>((f.opcode << 4) | ((f.format & 0x3) << 2) | (f.owner & kCqeOwnerMask));
  // wqe_counter, signature 0, op_own as one word.
  detail::Store32(
      cqe, 60,
      static_cast<uint32_t>(HostToBe16(f.wqeCounter)) | (static_cast<uint32_t>(opOwn) << 24));
}

// Normal (non-collapsed) CQ of `numCqes` entries (power of two): the CQE for consumer index `ci`
// is at slot ci & (numCqes-1) and belongs to software once its opcode is not kCqeInvalid and its
// owner bit equals the lap parity of `ci`.
MORI_HD_INLINE constexpr bool CqeReadyForSoftware(uint8_t opOwn, uint32_t ci, uint32_t numCqes) {
  return (opOwn >> 4) != kCqeInvalid && (opOwn & kCqeOwnerMask) == ((ci & numCqes) ? 1 : 0);
}
// The owner bit the NIC writes for producer index `pi` (what the emulator must write).
MORI_HD_INLINE constexpr uint8_t CqeOwnerForIndex(uint32_t pi, uint32_t numCqes) {
  return (pi & numCqes) ? 1 : 0;
}

}  // namespace mori::core::mlx5

// The device error record: the first error a kernel finds (a bounded wait that expired, a call or
// protocol violation, a remote failure), written once on the device into mapped host memory and
// turned into a typed exception on the host. Host and device see the same plain struct; this
// header includes no GPU runtime, so host-only code and host tests use it as it is. The device
// writer is core/device/wait.hpp (RecordDeviceError); the host reader is below.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "mori/core/host_device.hpp"

namespace mori::core {

enum class CmpOp : int32_t { kEq = 0, kNe, kGt, kGe, kLt, kLe };

MORI_HD inline const char* CmpOpName(CmpOp op) {
  switch (op) {
    case CmpOp::kEq: return "==";
    case CmpOp::kNe: return "!=";
    case CmpOp::kGt: return ">";
    case CmpOp::kGe: return ">=";
    case CmpOp::kLt: return "<";
    case CmpOp::kLe: return "<=";
  }
  return "?";
}

// What a record holds; it selects the exception the host raises.
enum class DeviceErrorKind : int32_t {
  kNone = 0,     // no recorder writes it (a zeroed record): the host raises InternalError
  kTimeout = 1,  // a bounded wait expired: TimeoutError
  kUsage = 2,    // a call or protocol violation found on the device: InvalidUsageError
  kRemote = 3,   // a remote failure (an RDMA error completion): RemoteError
};

const char* DeviceErrorKindName(DeviceErrorKind kind);  // "timeout", "usage", "remote", ...

constexpr int kDeviceErrorLabelLen = 64;  // "<op>: <what>": the longest op name plus text fit

// DeviceErrorRecord::cmp of a record that states no comparison. Otherwise cmp is a CmpOp: the
// condition `value <op> expected` that a wait waited for (kTimeout) or that a check required
// (kUsage), `seen` the value found, `addr` the word read (0: a value not in memory).
constexpr int32_t kDeviceErrorNotAWait = -1;  // usage: label says what, `expected` a detail
constexpr int32_t kDeviceErrorRdmaCqe = -2;   // remote: addr = QPN, expected = WQE index,
                                              // seen = syndrome | vendor << 8 | opcode << 16

// Lives in host-pinned memory mapped into the GPU. Plain 4- and 8-byte fields at fixed offsets
// (checked below), explicit padding, no pointers: host and device compilers agree on it.
struct DeviceErrorRecord {
  uint32_t claimed;    // 0: no error; the first failing thread sets 1 and fills the fields
  uint32_t abortFlag;  // nonzero: every bounded wait gives up at once
  int32_t rank;
  int32_t peer;  // -1 when the error is not about one peer
  int32_t block;
  int32_t thread;
  int32_t cmp;         // a CmpOp, or a kDeviceError* code
  int32_t valueBytes;  // 4 or 8 (0: the values are not a word in memory)
  int32_t kind;        // DeviceErrorKind
  uint32_t reserved;   // 0; keeps the 8-byte fields 8-byte aligned
  uint64_t addr;
  uint64_t expected;
  uint64_t seen;
  uint64_t elapsedNs;  // how long a wait waited (0 for other kinds)
  char label[kDeviceErrorLabelLen];
};
static_assert(offsetof(DeviceErrorRecord, kind) == 32 && offsetof(DeviceErrorRecord, addr) == 40 &&
                  offsetof(DeviceErrorRecord, label) == 72 && sizeof(DeviceErrorRecord) == 136,
              "DeviceErrorRecord is shared by host and device code: its layout is fixed");

// The fields of one error besides who reports it (rank, block, thread come from the caller).
struct DeviceErrorFields {
  DeviceErrorKind kind;
  int32_t peer;
  int32_t cmp;  // a CmpOp, or a kDeviceError* code
  int32_t valueBytes;
  uint64_t addr;
  uint64_t expected;
  uint64_t seen;
  uint64_t elapsedNs;
};

// Host side (src/core/device_error.cpp). For a claimed record: the message of its exception
// (rank, block, thread, label, peer, and per kind the wait / the violated check / the completion),
// and the exception itself, InvalidUsageError, TimeoutError, RemoteError or (an unknown kind)
// InternalError, carrying `file`:`line`; `note`, when not empty, is appended after "; ".
std::string DescribeDeviceError(const DeviceErrorRecord& e);
[[noreturn]] void ThrowDeviceError(const DeviceErrorRecord& e, const char* file, int line,
                                   const std::string& note = std::string());

}  // namespace mori::core

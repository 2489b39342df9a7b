// Host side of the device error record (mori/core/device_error.hpp): its message and its
// exception type.
#include "mori/core/device_error.hpp"

#include <cstring>

#include "mori/core/errors.hpp"

namespace mori::core {

const char* DeviceErrorKindName(DeviceErrorKind kind) {
  switch (kind) {
    case DeviceErrorKind::kNone: return "none";
    case DeviceErrorKind::kTimeout: return "timeout";
    case DeviceErrorKind::kUsage: return "usage";
    case DeviceErrorKind::kRemote: return "remote";
  }
  return "unknown";
}

namespace {

using ull = unsigned long long;

bool IsCmpOp(int32_t cmp) {
  return cmp >= static_cast<int32_t>(CmpOp::kEq) && cmp <= static_cast<int32_t>(CmpOp::kLe);
}

// The label as written by the device, never read past its buffer.
std::string Label(const DeviceErrorRecord& e) {
  return std::string(e.label, strnlen(e.label, sizeof(e.label)));
}

// "rank R (block B, thread T)": who recorded it.
std::string Who(const DeviceErrorRecord& e) {
  return StrFormat("rank %d (block %d, thread %d)", e.rank, e.block, e.thread);
}

// A violated check: what was found against what was required, and where it was read.
std::string Check(const DeviceErrorRecord& e) {
  std::string s = StrFormat("found %llu, required %s %llu", static_cast<ull>(e.seen),
                            CmpOpName(static_cast<CmpOp>(e.cmp)), static_cast<ull>(e.expected));
  if (e.addr != 0)
    s += StrFormat(" (%d-byte word at 0x%llx)", e.valueBytes, static_cast<ull>(e.addr));
  return s;
}

// Any record, field by field (a kind/cmp pair no recorder writes).
std::string Raw(const DeviceErrorRecord& e) {
  return StrFormat(
      "device error record of kind %d (%s) on %s: '%s', peer %d, cmp %d, address "
      "0x%llx, expected %llu, seen %llu",
      e.kind, DeviceErrorKindName(static_cast<DeviceErrorKind>(e.kind)), Who(e).c_str(),
      Label(e).c_str(), e.peer, e.cmp, static_cast<ull>(e.addr), static_cast<ull>(e.expected),
      static_cast<ull>(e.seen));
}

}  // namespace

std::string DescribeDeviceError(const DeviceErrorRecord& e) {
  if (e.claimed == 0) return "no device error recorded";
  const std::string label = Label(e);
  switch (static_cast<DeviceErrorKind>(e.kind)) {
    case DeviceErrorKind::kTimeout:
      if (!IsCmpOp(e.cmp)) break;
      return StrFormat(
          "device wait timed out on %s: waited %.3f ms for '%s' on peer %d: *0x%llx "
          "%s %llu (%d-byte value), last seen %llu",
          Who(e).c_str(), e.elapsedNs / 1e6, label.c_str(), e.peer, static_cast<ull>(e.addr),
          CmpOpName(static_cast<CmpOp>(e.cmp)), static_cast<ull>(e.expected), e.valueBytes,
          static_cast<ull>(e.seen));
    case DeviceErrorKind::kUsage:
      if (e.cmp == kDeviceErrorNotAWait)
        return StrFormat("device API error on %s: %s (pe %d, address 0x%llx, detail %llu)",
                         Who(e).c_str(), label.c_str(), e.peer, static_cast<ull>(e.addr),
                         static_cast<ull>(e.expected));
      if (!IsCmpOp(e.cmp)) break;
      {
        const std::string peer = e.peer >= 0 ? StrFormat(" (peer %d)", e.peer) : std::string();
        return StrFormat("invalid usage found on the device, %s: %s%s: %s", Who(e).c_str(),
                         label.c_str(), peer.c_str(), Check(e).c_str());
      }
    case DeviceErrorKind::kRemote:
      if (e.cmp != kDeviceErrorRdmaCqe) break;
      return StrFormat(
          "RDMA error completion on %s, %s: QP 0x%llx to pe %d, WQE index %llu, "
          "syndrome 0x%02llx, vendor syndrome 0x%02llx, send opcode 0x%02llx",
          Who(e).c_str(), label.c_str(), static_cast<ull>(e.addr), e.peer,
          static_cast<ull>(e.expected), static_cast<ull>(e.seen & 0xff),
          static_cast<ull>((e.seen >> 8) & 0xff), static_cast<ull>((e.seen >> 16) & 0xff));
    case DeviceErrorKind::kNone: break;
  }
  return Raw(e);
}

void ThrowDeviceError(const DeviceErrorRecord& e, const char* file, int line,
                      const std::string& note) {
  std::string what = DescribeDeviceError(e);
  if (!note.empty()) what += "; " + note;
  if (e.claimed != 0) {
    switch (static_cast<DeviceErrorKind>(e.kind)) {
      case DeviceErrorKind::kTimeout: throw TimeoutError(file, line, what);
      case DeviceErrorKind::kUsage: throw InvalidUsageError(file, line, what);
      case DeviceErrorKind::kRemote: throw RemoteError(file, line, what);
      case DeviceErrorKind::kNone: break;
    }
  }
  throw InternalError(file, line, what);
}

}  // namespace mori::core

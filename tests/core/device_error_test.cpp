// The host side of the device error record: each kind raises its own exception type, and the
// message carries the recorder, the label, the peer, the address and the values of that kind
// (no "waited" for a record that is not a wait). Records are filled here as a kernel fills them.
#include "mori/core/device_error.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "mori/core/errors.hpp"

namespace mori::core {
namespace {

// A record as rank 3, block 11, thread 96 fills it; `valueBytes` 8 where an address is given.
DeviceErrorRecord Filled(DeviceErrorKind kind, int32_t cmp, const char* label, int32_t peer = 2,
                         uint64_t addr = 0, uint64_t expected = 0, uint64_t seen = 0) {
  DeviceErrorRecord e{};
  e.claimed = 1;
  e.abortFlag = 1;
  e.kind = static_cast<int32_t>(kind);
  e.cmp = cmp;
  e.rank = 3;
  e.block = 11;
  e.thread = 96;
  e.peer = peer;
  e.valueBytes = addr != 0 ? 8 : 0;
  e.addr = addr;
  e.expected = expected;
  e.seen = seen;
  std::strncpy(e.label, label, sizeof(e.label) - 1);
  return e;
}

// Raises `e` and returns the error; fails the test if nothing or something else is thrown.
template <typename Expected>
std::string RaisedAs(const DeviceErrorRecord& e, const std::string& note = std::string()) {
  try {
    ThrowDeviceError(e, "init.cpp", 77, note);
  } catch (const Expected& err) {
    EXPECT_EQ(std::string(err.File()), "init.cpp");
    EXPECT_EQ(err.Line(), 77);
    return err.Message();
  } catch (const Error& err) {
    ADD_FAILURE() << "raised " << ErrorKindName(err.Kind()) << ": " << err.what();
    return std::string();
  }
  ADD_FAILURE() << "nothing thrown";
  return std::string();
}

bool Has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST(DeviceErrorTest, LayoutIsPlainAndFixed) {
  // Host and device share the record through mapped memory: the same offsets on both sides.
  EXPECT_EQ(sizeof(DeviceErrorRecord), 136u);
  EXPECT_EQ(offsetof(DeviceErrorRecord, claimed), 0u);
  EXPECT_EQ(offsetof(DeviceErrorRecord, abortFlag), 4u);
  EXPECT_EQ(offsetof(DeviceErrorRecord, cmp), 24u);
  EXPECT_EQ(offsetof(DeviceErrorRecord, kind), 32u);
  EXPECT_EQ(offsetof(DeviceErrorRecord, addr), 40u);
  EXPECT_EQ(offsetof(DeviceErrorRecord, elapsedNs), 64u);
  EXPECT_EQ(offsetof(DeviceErrorRecord, label), 72u);
  EXPECT_EQ(sizeof(DeviceErrorRecord::label), static_cast<size_t>(kDeviceErrorLabelLen));
  // A zeroed record (what the host allocates) holds no kind a recorder writes.
  DeviceErrorRecord zero{};
  EXPECT_EQ(zero.kind, static_cast<int32_t>(DeviceErrorKind::kNone));
}

TEST(DeviceErrorTest, ExpiredWaitIsTimeoutError) {
  DeviceErrorRecord e =
      Filled(DeviceErrorKind::kTimeout, static_cast<int32_t>(CmpOp::kGe),
             "EP dispatch: token count of a lower PE", 2, 0x7f00dead0040ull, 42, 17);
  e.elapsedNs = 1500000;
  const std::string msg = RaisedAs<TimeoutError>(e);
  EXPECT_TRUE(Has(msg, "timed out on rank 3 (block 11, thread 96)")) << msg;
  EXPECT_TRUE(Has(msg, "waited 1.500 ms for 'EP dispatch: token count of a lower PE' on peer 2"))
      << msg;
  EXPECT_TRUE(Has(msg, "*0x7f00dead0040 >= 42 (8-byte value), last seen 17")) << msg;
}

TEST(DeviceErrorTest, ViolatedCheckIsInvalidUsageWithoutWaitText) {
  // As the pull combine (combine_body.hpp) records combine input with fewer rows than dispatch
  // received: a kernel argument (no address), required rows >= 141, found 100.
  DeviceErrorRecord e =
      Filled(DeviceErrorKind::kUsage, static_cast<int32_t>(CmpOp::kGe),
             "EP combine: input has fewer rows than dispatch received", -1, 0, 141, 100);
  const std::string msg = RaisedAs<InvalidUsageError>(e);
  EXPECT_TRUE(Has(msg, "rank 3 (block 11, thread 96)")) << msg;
  EXPECT_TRUE(Has(msg, "EP combine: input has fewer rows than dispatch received")) << msg;
  EXPECT_TRUE(Has(msg, "found 100, required >= 141")) << msg;
  EXPECT_FALSE(Has(msg, "wait")) << msg;
  EXPECT_FALSE(Has(msg, "peer")) << msg;  // not about one peer
  EXPECT_FALSE(Has(msg, "0x")) << msg;    // no word in memory

  // A value read from a signal word: the peer and the word's address are named.
  DeviceErrorRecord f = Filled(DeviceErrorKind::kUsage, static_cast<int32_t>(CmpOp::kEq),
                               "EP dispatch: PEs passed different dtype/hidden/index type", 2,
                               0x7f0000001230ull, 0x1003, 0x2003);
  const std::string m2 = RaisedAs<InvalidUsageError>(f);
  EXPECT_TRUE(Has(m2, "(peer 2)")) << m2;
  EXPECT_TRUE(Has(m2, "found 8195, required == 4099 (8-byte word at 0x7f0000001230)")) << m2;
  EXPECT_FALSE(Has(m2, "waited")) << m2;
}

TEST(DeviceErrorTest, InvalidDeviceCallIsInvalidUsage) {
  DeviceErrorRecord e = Filled(DeviceErrorKind::kUsage, kDeviceErrorNotAWait,
                               "ShmemPutMemNbiThread: pe out of range", 9, 0x1000, 9);
  const std::string msg = RaisedAs<InvalidUsageError>(e);
  EXPECT_TRUE(Has(msg, "device API error on rank 3")) << msg;
  EXPECT_TRUE(Has(msg, "ShmemPutMemNbiThread: pe out of range (pe 9, address 0x1000, detail 9)"))
      << msg;
}

TEST(DeviceErrorTest, ErrorCompletionIsRemoteError) {
  // addr: the QPN; expected: the WQE index; seen: syndrome, vendor syndrome, opcode.
  DeviceErrorRecord e = Filled(DeviceErrorKind::kRemote, kDeviceErrorRdmaCqe,
                               "ShmemPutMemNbiThread: error completion", 1, 0x1a2b, 513,
                               0x13 | (0x88ull << 8) | (0x08ull << 16));
  const std::string msg = RaisedAs<RemoteError>(e, "RDMA transport: port down");
  EXPECT_TRUE(Has(msg, "RDMA error completion on rank 3")) << msg;
  EXPECT_TRUE(Has(msg,
                  "QP 0x1a2b to pe 1, WQE index 513, syndrome 0x13, vendor syndrome 0x88, "
                  "send opcode 0x08"))
      << msg;
  EXPECT_TRUE(Has(msg, "; RDMA transport: port down")) << msg;
}

TEST(DeviceErrorTest, UnknownKindIsInternalErrorAndOddRecordsListEveryField) {
  for (int32_t kind : {0, 4, -7}) {
    const DeviceErrorRecord e =
        Filled(static_cast<DeviceErrorKind>(kind), static_cast<int32_t>(CmpOp::kEq), "some check",
               2, 0xabc, 5, 6);
    const std::string msg = RaisedAs<InternalError>(e);
    EXPECT_TRUE(Has(msg, "kind " + std::to_string(kind))) << msg;
    EXPECT_TRUE(Has(msg, "'some check', peer 2, cmp 0, address 0xabc, expected 5, seen 6")) << msg;
  }
  // A kind with a cmp its recorders never write: the kind decides the type, the text lists the
  // fields.
  DeviceErrorRecord t = Filled(DeviceErrorKind::kTimeout, kDeviceErrorRdmaCqe, "odd");
  const std::string msg = RaisedAs<TimeoutError>(t);
  EXPECT_TRUE(Has(msg, "kind 1 (timeout)")) << msg;
  // An unclaimed record is no error of the device.
  DeviceErrorRecord none{};
  EXPECT_EQ(DescribeDeviceError(none), "no device error recorded");
  RaisedAs<InternalError>(none);
}

TEST(DeviceErrorTest, LabelIsReadWithinItsBuffer) {
  DeviceErrorRecord e = Filled(DeviceErrorKind::kUsage, static_cast<int32_t>(CmpOp::kEq), "");
  std::memset(e.label, 'x', sizeof(e.label));  // no terminating NUL
  const std::string msg = DescribeDeviceError(e);
  EXPECT_TRUE(Has(msg, std::string(kDeviceErrorLabelLen, 'x'))) << msg;
  EXPECT_FALSE(Has(msg, std::string(kDeviceErrorLabelLen + 1, 'x'))) << msg;
}

TEST(DeviceErrorTest, KindNames) {
  EXPECT_STREQ(DeviceErrorKindName(DeviceErrorKind::kTimeout), "timeout");
  EXPECT_STREQ(DeviceErrorKindName(DeviceErrorKind::kUsage), "usage");
  EXPECT_STREQ(DeviceErrorKindName(DeviceErrorKind::kRemote), "remote");
  EXPECT_STREQ(DeviceErrorKindName(static_cast<DeviceErrorKind>(9)), "unknown");
}

}  // namespace
}  // namespace mori::core

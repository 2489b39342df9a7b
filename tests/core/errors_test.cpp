// Typed errors: file:line in what(), kinds, checked syscalls, and StrFormat.
#include "mori/core/errors.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace mori::core {
namespace {

TEST(ErrorsTest, ThrowCarriesFileLineKindAndMessage) {
  int line = 0;
  try {
    line = __LINE__ + 1;
    MORI_THROW(TimeoutError, "rank %d never arrived after %s", 3, "5 s");
  } catch (const Error& e) {
    EXPECT_EQ(e.Kind(), ErrorKind::kTimeout);
    EXPECT_EQ(e.Message(), "rank 3 never arrived after 5 s");
    EXPECT_EQ(e.Line(), line);
    EXPECT_NE(std::string(e.File()).find("errors_test.cpp"), std::string::npos);
    // what() is "basename:line: kind: message".
    EXPECT_EQ(std::string(e.what()), "errors_test.cpp:" + std::to_string(line) +
                                         ": timeout: rank 3 never arrived after 5 s");
    return;
  }
  FAIL() << "nothing thrown";
}

TEST(ErrorsTest, EachTypeHasItsKind) {
  EXPECT_EQ(InvalidUsageError("f", 1, "m").Kind(), ErrorKind::kInvalidUsage);
  EXPECT_EQ(TimeoutError("f", 1, "m").Kind(), ErrorKind::kTimeout);
  EXPECT_EQ(SystemError("f", 1, "m").Kind(), ErrorKind::kSystem);
  EXPECT_EQ(GpuRuntimeError("f", 1, "m").Kind(), ErrorKind::kGpuRuntime);
  EXPECT_EQ(RemoteError("f", 1, "m").Kind(), ErrorKind::kRemote);
  EXPECT_EQ(InternalError("f", 1, "m").Kind(), ErrorKind::kInternal);
  for (ErrorKind k : {ErrorKind::kInvalidUsage, ErrorKind::kTimeout, ErrorKind::kSystem,
                      ErrorKind::kGpuRuntime, ErrorKind::kRemote, ErrorKind::kInternal})
    EXPECT_STRNE(ErrorKindName(k), "error");
  EXPECT_STREQ(ErrorKindName(ErrorKind::kInvalidUsage), "invalid usage");
}

TEST(ErrorsTest, CatchableAsBaseAndStdException) {
  EXPECT_THROW(MORI_THROW(RemoteError, "peer %d closed", 1), RemoteError);
  EXPECT_THROW(MORI_THROW(RemoteError, "peer %d closed", 1), Error);
  EXPECT_THROW(MORI_THROW(RemoteError, "peer %d closed", 1), std::runtime_error);
}

TEST(ErrorsTest, EnsureThrowsOnlyWhenFalse) {
  int evaluated = 0;
  auto check = [&](int n) {
    MORI_ENSURE((evaluated++, n > 0), InvalidUsageError, "n must be positive, got %d", n);
  };
  EXPECT_NO_THROW(check(1));
  try {
    check(-4);
    FAIL() << "nothing thrown";
  } catch (const InvalidUsageError& e) {
    EXPECT_EQ(e.Message(), "n must be positive, got -4");
  }
  EXPECT_EQ(evaluated, 2);
}

TEST(ErrorsTest, CheckSysGivesSystemErrorWithStrerror) {
  try {
    MORI_CHECK_SYS(close(-1));
    FAIL() << "nothing thrown";
  } catch (const SystemError& e) {
    EXPECT_EQ(e.Kind(), ErrorKind::kSystem);
    const std::string msg = e.Message();
    EXPECT_NE(msg.find("close(-1)"), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::strerror(EBADF)), std::string::npos) << msg;
    EXPECT_NE(msg.find("errno " + std::to_string(EBADF)), std::string::npos) << msg;
  }
  try {
    MORI_CHECK_SYS(open("/nonexistent-mori-dir/x", O_RDONLY));
    FAIL() << "nothing thrown";
  } catch (const SystemError& e) {
    EXPECT_NE(e.Message().find(std::strerror(ENOENT)), std::string::npos) << e.Message();
  }
}

TEST(ErrorsTest, CheckSysEvaluatesOnceAndPassesOnSuccess) {
  int calls = 0;
  auto ok = [&] { return ++calls, 0; };
  EXPECT_NO_THROW(MORI_CHECK_SYS(ok()));
  EXPECT_EQ(calls, 1);
  auto fail = [&] {
    ++calls;
    errno = EAGAIN;
    return -1;
  };
  EXPECT_THROW(MORI_CHECK_SYS(fail()), SystemError);
  EXPECT_EQ(calls, 2);
}

TEST(StrFormatTest, EdgeCases) {
  EXPECT_EQ(StrFormat("%s", ""), "");
  EXPECT_EQ(StrFormat("100%%"), "100%");
  EXPECT_EQ(StrFormat("%d-%s-%llu-%.2f", -1, "x", 18446744073709551615ull, 0.5),
            "-1-x-18446744073709551615-0.50");
  // Embedded formatting of a string longer than any fixed buffer.
  const std::string longText(5000, 'a');
  const std::string formatted = StrFormat("<%s|%s>", longText.c_str(), longText.c_str());
  EXPECT_EQ(formatted.size(), 2 * longText.size() + 3);
  EXPECT_EQ(formatted, "<" + longText + "|" + longText + ">");
  // Width padding past 1 KiB.
  EXPECT_EQ(StrFormat("%2000d", 7).size(), 2000u);
}

TEST(StrFormatTest, LongMessageSurvivesThrow) {
  const std::string longText(3000, 'z');
  try {
    MORI_THROW(InternalError, "prefix %s suffix", longText.c_str());
  } catch (const Error& e) {
    EXPECT_EQ(e.Message(), "prefix " + longText + " suffix");
    EXPECT_NE(std::string(e.what()).find(longText + " suffix"), std::string::npos);
    return;
  }
  FAIL() << "nothing thrown";
}

}  // namespace
}  // namespace mori::core

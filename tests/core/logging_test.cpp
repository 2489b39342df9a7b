// Logging settings from the env table: level and subsystem filters, and the log file pattern.
#include "mori/core/logging.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "mori/core/env.hpp"
#include "scoped_env.hpp"

namespace mori::core {
namespace {

// Restores the env and re-applies logging settings (closing any log file) after each test.
class LoggingTest : public ::testing::Test {
 protected:
  void TearDown() override {
    env.reset();
    ReloadLogSettings();
    SetLogRank(-1);
  }
  void Apply() {
    ReloadEnv();
    ReloadLogSettings();
  }
  std::unique_ptr<testing::ScopedEnv> env = std::make_unique<testing::ScopedEnv>();
};

TEST_F(LoggingTest, DefaultIsWarnForAllSubsystems) {
  Apply();
  EXPECT_TRUE(LogEnabled(LogLevel::kError, kLogShmem));
  EXPECT_TRUE(LogEnabled(LogLevel::kWarn, kLogRdma));
  EXPECT_FALSE(LogEnabled(LogLevel::kInfo, kLogInit));
}

TEST_F(LoggingTest, LevelThreshold) {
  env->Set("MORI_LOG_LEVEL", "INFO");
  Apply();
  EXPECT_TRUE(LogEnabled(LogLevel::kWarn, kLogShmem));
  EXPECT_TRUE(LogEnabled(LogLevel::kInfo, kLogShmem));
  EXPECT_FALSE(LogEnabled(LogLevel::kDebug, kLogShmem));

  env->Set("MORI_LOG_LEVEL", "trace");
  Apply();
  EXPECT_TRUE(LogEnabled(LogLevel::kTrace, kLogOps));

  env->Set("MORI_LOG_LEVEL", "NONE");
  Apply();
  EXPECT_FALSE(LogEnabled(LogLevel::kError, kLogOps));
}

TEST_F(LoggingTest, SubsystemFilter) {
  env->Set("MORI_LOG_LEVEL", "DEBUG");
  env->Set("MORI_LOG_SUBSYS", "SHMEM,mem");
  Apply();
  EXPECT_TRUE(LogEnabled(LogLevel::kDebug, kLogShmem));
  EXPECT_TRUE(LogEnabled(LogLevel::kDebug, kLogMem));
  EXPECT_FALSE(LogEnabled(LogLevel::kDebug, kLogRdma));
  EXPECT_FALSE(LogEnabled(LogLevel::kError, kLogBootstrap));

  env->Set("MORI_LOG_SUBSYS", "^RDMA,TOPO");
  Apply();
  EXPECT_FALSE(LogEnabled(LogLevel::kError, kLogRdma));
  EXPECT_FALSE(LogEnabled(LogLevel::kError, kLogTopo));
  EXPECT_TRUE(LogEnabled(LogLevel::kDebug, kLogShmem));
  EXPECT_TRUE(LogEnabled(LogLevel::kDebug, kLogInit));

  env->Set("MORI_LOG_SUBSYS", "ALL");
  Apply();
  EXPECT_TRUE(LogEnabled(LogLevel::kDebug, kLogRdma));
}

std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST_F(LoggingTest, FileWithHostAndPid) {
  char dirTemplate[] = "/tmp/mori-logging-test-XXXXXX";
  ASSERT_NE(mkdtemp(dirTemplate), nullptr);
  const std::filesystem::path dir(dirTemplate);
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  const std::filesystem::path expected =
      dir / ("mori." + std::string(host) + "." + std::to_string(getpid()) + ".log");

  env->Set("MORI_LOG_LEVEL", "INFO");
  env->Set("MORI_LOG_SUBSYS", "^OPS");
  env->Set("MORI_LOG_FILE", (dir / "mori.%h.%p.log").string());
  Apply();
  SetLogRank(5);
  MORI_INFO(kLogShmem, "hello %d from %s", 42, "shmem");
  MORI_DEBUG(kLogShmem, "too verbose");
  MORI_WARN(kLogOps, "filtered subsystem");
  MORI_ERROR(kLogMem, "heap %s", "trouble");

  // Switch back to stderr so the file is closed and flushed.
  env->Unset("MORI_LOG_FILE");
  Apply();

  ASSERT_TRUE(std::filesystem::exists(expected)) << expected;
  const std::string text = ReadFile(expected);
  const std::string prefix = std::string(host) + ":" + std::to_string(getpid()) + ":5 ";
  EXPECT_NE(text.find(prefix + "[MORI INFO SHMEM] hello 42 from shmem (logging_test.cpp:"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find(prefix + "[MORI ERROR MEM] heap trouble"), std::string::npos) << text;
  EXPECT_EQ(text.find("too verbose"), std::string::npos) << text;
  EXPECT_EQ(text.find("filtered subsystem"), std::string::npos) << text;
  // Exactly the two enabled lines.
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 2) << text;

  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace mori::core

// DetectMpsClient: the control pipe's presence under CUDA_MPS_PIPE_DIRECTORY and the thread
// percentage, read from the process environment (restored after each test).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>

#include "mori/core/mps.hpp"

using mori::core::DetectMpsClient;

namespace {

class SavedVar {
 public:
  explicit SavedVar(const char* n) : name(n) {
    if (const char* v = std::getenv(n)) value = v;
  }
  ~SavedVar() {
    if (value)
      setenv(name, value->c_str(), 1);
    else
      unsetenv(name);
  }

 private:
  const char* name;
  std::optional<std::string> value;
};

class MpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/mori-mps-test.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir = tmpl;
  }
  void TearDown() override {
    unlink((dir + "/control").c_str());
    rmdir(dir.c_str());
  }
  SavedVar pipe{"CUDA_MPS_PIPE_DIRECTORY"};
  SavedVar pct{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"};
  std::string dir;
};

TEST_F(MpsTest, ActiveOnlyWhereTheControlPipeExists) {
  setenv("CUDA_MPS_PIPE_DIRECTORY", dir.c_str(), 1);
  EXPECT_FALSE(DetectMpsClient().active);
  { std::ofstream(dir + "/control") << ""; }
  EXPECT_TRUE(DetectMpsClient().active);
  setenv("CUDA_MPS_PIPE_DIRECTORY", (dir + "/absent").c_str(), 1);
  EXPECT_FALSE(DetectMpsClient().active);
}

TEST_F(MpsTest, ThreadPercentage) {
  const std::pair<const char*, int> cases[] = {{"25", 25}, {"100", 100}, {"1", 1},
                                               {"0", 0},   {"101", 0},   {"-5", 0},
                                               {"25%", 0}, {"", 0},      {"abc", 0}};
  for (const auto& [text, want] : cases) {
    setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", text, 1);
    EXPECT_EQ(DetectMpsClient().threadPercent, want) << "'" << text << "'";
  }
  unsetenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
  EXPECT_EQ(DetectMpsClient().threadPercent, 0);
}

}  // namespace

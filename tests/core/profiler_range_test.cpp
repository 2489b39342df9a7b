// Profiler ranges (core/profiler_range.hpp) reach a profiler only when MORI_NVTX is on. The
// profiler here is nvtx_range_recorder, an NVTX v3 injection library that NVTX loads from
// NVTX_INJECTION64_PATH, as it loads Nsight Systems' own, and that records what it is given; the
// last case checks the names mori's own calls give their ranges, where they run without a GPU.
// Each case runs in a forked child: both the MORI_NVTX state and NVTX's initialisation happen once
// per process, and this parent process never makes a range or an NVTX call.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>

#include "mori/core/errors.hpp"
#include "mori/core/profiler_range.hpp"
#include "mori/ops/dispatch_combine/handle.hpp"
#include "mori/shmem/shmem_api.hpp"
#include "nvtx_range_recorder.hpp"

#ifndef MORI_NVTX_RECORDER_PATH
#error "MORI_NVTX_RECORDER_PATH must name the nvtx_range_recorder library"
#endif

namespace mori::core {
namespace {

using test::NvtxRecorderInits;
using test::NvtxRecorderLog;
using test::NvtxRecorderOpenRanges;
using test::NvtxRecorderPops;
using test::NvtxRecorderPushes;
using test::NvtxRecorderUnpairedPops;

enum class Tool { kRecorder, kNone };

// Runs `body` in a forked child whose MORI_NVTX is `nvtx` (nullptr: unset) and whose NVTX loads
// the recorder (Tool::kRecorder) or no tool, and returns what `body` returned. An exception in the
// child comes back as "exception: <what>"; a child that does not exit normally fails the test.
std::string InChild(const char* nvtx, Tool tool, const std::function<std::string()>& body) {
  int fds[2];
  if (pipe(fds) != 0) {
    ADD_FAILURE() << "pipe: errno " << errno;
    return "";
  }
  const pid_t pid = fork();
  if (pid < 0) {
    ADD_FAILURE() << "fork: errno " << errno;
    return "";
  }
  if (pid == 0) {
    close(fds[0]);
    std::string out;
    try {
      if (nvtx != nullptr)
        setenv("MORI_NVTX", nvtx, 1);
      else
        unsetenv("MORI_NVTX");
      if (tool == Tool::kRecorder)
        setenv("NVTX_INJECTION64_PATH", MORI_NVTX_RECORDER_PATH, 1);
      else
        unsetenv("NVTX_INJECTION64_PATH");
      out = body();
    } catch (const std::exception& e) {
      out = std::string("exception: ") + e.what();
    }
    for (size_t done = 0; done < out.size();) {
      const ssize_t n = write(fds[1], out.data() + done, out.size() - done);
      if (n <= 0) _exit(3);
      done += static_cast<size_t>(n);
    }
    _exit(0);
  }
  close(fds[1]);
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t n = read(fds[0], buf, sizeof(buf));
    if (n > 0) {
      out.append(buf, static_cast<size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      break;
    }
  }
  close(fds[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "child status " << status << ", output: " << out;
  return out;
}

// What the recorder saw, after `enabled` and how many lazily built names were built.
std::string Report(bool enabled, int built) {
  return "enabled=" + std::to_string(enabled) + " built=" + std::to_string(built) +
         " inits=" + std::to_string(NvtxRecorderInits()) +
         " pushes=" + std::to_string(NvtxRecorderPushes()) +
         " pops=" + std::to_string(NvtxRecorderPops()) +
         " unpaired=" + std::to_string(NvtxRecorderUnpairedPops()) +
         " open=" + std::to_string(NvtxRecorderOpenRanges()) + "\n" + NvtxRecorderLog();
}

// A nested pair of ranges, the inner one with a lazily built name.
std::string NestedRanges() {
  int built = 0;
  {
    const ScopedProfilerRange outer("mori.test.outer");
    const ScopedProfilerRange inner([&built] {
      built++;
      return "mori.test.inner";
    });
  }
  return Report(ProfilerRangesEnabled(), built);
}

// MORI_NVTX_RECORDER_OUT: the recorder appends each event to a file as it happens, so a process's
// ranges are seen without a profiler even when it ends with _exit (a forked PE).
TEST(ProfilerRangeTest, RecorderWritesItsLogAsItGoes) {
  char dir[] = "/tmp/mori-nvtx-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string prefix = std::string(dir) + "/ranges";
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    setenv("MORI_NVTX", "1", 1);
    setenv("NVTX_INJECTION64_PATH", MORI_NVTX_RECORDER_PATH, 1);
    setenv("MORI_NVTX_RECORDER_OUT", prefix.c_str(), 1);
    NestedRanges();
    _exit(0);  // no static destructors, as a forked PE ends
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  const std::string path = prefix + "." + std::to_string(pid);
  std::string log;
  if (FILE* f = std::fopen(path.c_str(), "r")) {
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) log.append(buf, n);
    std::fclose(f);
  }
  std::remove(path.c_str());
  rmdir(dir);
  EXPECT_EQ(log,
            "domain mori\npush mori mori.test.outer\npush mori mori.test.inner\npop mori\npop "
            "mori\n");
}

TEST(ProfilerRangeTest, NothingReachesTheToolWhenUnset) {
  EXPECT_EQ(InChild(nullptr, Tool::kRecorder, NestedRanges),
            "enabled=0 built=0 inits=0 pushes=0 pops=0 unpaired=0 open=0\n");
}

TEST(ProfilerRangeTest, NothingReachesTheToolWhenOff) {
  EXPECT_EQ(InChild("0", Tool::kRecorder, NestedRanges),
            "enabled=0 built=0 inits=0 pushes=0 pops=0 unpaired=0 open=0\n");
}

TEST(ProfilerRangeTest, RangesReachTheToolInTheMoriDomain) {
  EXPECT_EQ(InChild("1", Tool::kRecorder, NestedRanges),
            "enabled=1 built=1 inits=1 pushes=2 pops=2 unpaired=0 open=0\n"
            "domain mori\n"
            "push mori mori.test.outer\n"
            "push mori mori.test.inner\n"
            "pop mori\n"
            "pop mori\n");
}

TEST(ProfilerRangeTest, OtherBooleanSpellingsTurnThemOn) {
  const std::string out = InChild("on", Tool::kRecorder, NestedRanges);
  EXPECT_EQ(out.substr(0, out.find('\n')),
            "enabled=1 built=1 inits=1 pushes=2 pops=2 unpaired=0 open=0");
}

TEST(ProfilerRangeTest, ARangeEndsWhenAnExceptionLeavesItsScope) {
  const std::string out = InChild("1", Tool::kRecorder, [] {
    try {
      const ScopedProfilerRange range("mori.test.throws");
      throw std::runtime_error("leaving");
    } catch (const std::runtime_error&) {
    }
    return Report(ProfilerRangesEnabled(), 0);
  });
  EXPECT_EQ(out,
            "enabled=1 built=0 inits=1 pushes=1 pops=1 unpaired=0 open=0\n"
            "domain mori\n"
            "push mori mori.test.throws\n"
            "pop mori\n");
}

TEST(ProfilerRangeTest, EachThreadPairsItsOwnRanges) {
  const std::string out = InChild("1", Tool::kRecorder, [] {
    std::string threadReport[2];
    auto work = [](std::string* report) {
      for (int i = 0; i < 100; i++) {
        const ScopedProfilerRange outer("mori.test.thread.outer");
        const ScopedProfilerRange inner("mori.test.thread.inner");
      }
      *report = std::to_string(NvtxRecorderOpenRanges());
    };
    std::thread a(work, &threadReport[0]);
    std::thread b(work, &threadReport[1]);
    a.join();
    b.join();
    const std::string report = Report(ProfilerRangesEnabled(), 0);
    return "open in threads: " + threadReport[0] + " " + threadReport[1] + "; " +
           report.substr(0, report.find('\n'));
  });
  EXPECT_EQ(out,
            "open in threads: 0 0; "
            "enabled=1 built=0 inits=1 pushes=400 pops=400 unpaired=0 open=0");
}

// Without a tool NVTX's calls are no-ops: ranges are on and cost nothing else.
TEST(ProfilerRangeTest, OnWithoutAToolIsHarmless) {
  EXPECT_EQ(InChild("1", Tool::kNone, NestedRanges),
            "enabled=1 built=1 inits=0 pushes=0 pops=0 unpaired=0 open=0\n");
}

TEST(ProfilerRangeTest, AMalformedValueRaisesNamingTheVariable) {
  const std::string out = InChild("sometimes", Tool::kRecorder, [] {
    std::string result;
    try {
      const ScopedProfilerRange range("mori.test.malformed");
      result = "no exception";
    } catch (const InvalidUsageError& e) {
      result = e.what();
    }
    return result + "\n" + Report(false, 0);
  });
  EXPECT_NE(out.find("MORI_NVTX=sometimes"), std::string::npos) << out;
  EXPECT_NE(out.find("inits=0 pushes=0 pops=0"), std::string::npos) << out;
}

// The ranges of mori's own calls, as far as they run without a GPU: shmem init and op creation
// open their range first, then refuse (no bootstrap; shmem not initialised).
std::string MoriCalls() {
  try {
    shmem::ShmemInit(nullptr);
  } catch (const InvalidUsageError&) {
  }
  for (ops::EpDispatchCombineKernelType type :
       {ops::EpDispatchCombineKernelType::kIntraNode, ops::EpDispatchCombineKernelType::kAsyncLL}) {
    try {
      ops::EpDispatchCombineConfig config;
      config.kernelType = type;
      const ops::EpDispatchCombineHandle op(config);
    } catch (const InvalidUsageError&) {
    }
  }
  return Report(ProfilerRangesEnabled(), 0);
}

TEST(ProfilerRangeTest, MoriCallsAreNamedRanges) {
  EXPECT_EQ(InChild("1", Tool::kRecorder, MoriCalls),
            "enabled=1 built=0 inits=1 pushes=3 pops=3 unpaired=0 open=0\n"
            "domain mori\n"
            "push mori mori.shmem.init\n"
            "pop mori\n"
            "push mori mori.ep.create[IntraNode]\n"
            "pop mori\n"
            "push mori mori.ep.create[AsyncLL]\n"
            "pop mori\n");
  EXPECT_EQ(InChild(nullptr, Tool::kRecorder, MoriCalls),
            "enabled=0 built=0 inits=0 pushes=0 pops=0 unpaired=0 open=0\n");
}

}  // namespace
}  // namespace mori::core

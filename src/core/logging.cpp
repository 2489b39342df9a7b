#include "mori/core/logging.hpp"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <sstream>
#include <string>

#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"

namespace mori::core {
namespace {

struct SubsysName {
  const char* name;
  unsigned bit;
};
constexpr SubsysName kSubsysNames[] = {
    {"INIT", kLogInit}, {"BOOTSTRAP", kLogBootstrap}, {"SHMEM", kLogShmem}, {"MEM", kLogMem},
    {"TOPO", kLogTopo}, {"RDMA", kLogRdma},           {"OPS", kLogOps},     {"ENV", kLogEnv},
};

struct LogState {
  LogLevel level = LogLevel::kWarn;
  unsigned mask = kLogAll;
  FILE* out = stderr;
  std::string host;
};

std::mutex gMutex;
std::atomic<int> gLevel{-1};  // -1: settings not read yet
std::atomic<unsigned> gMask{kLogAll};
std::atomic<int> gRank{-1};
LogState gState;

LogLevel ParseLevel(const std::string& s) {
  const char* names[] = {"NONE", "ERROR", "WARN", "INFO", "DEBUG", "TRACE"};
  for (int i = 0; i < 6; i++)
    if (strcasecmp(s.c_str(), names[i]) == 0) return static_cast<LogLevel>(i);
  return LogLevel::kWarn;
}

unsigned ParseMask(const std::string& s) {
  std::string list = s;
  bool invert = !list.empty() && list[0] == '^';
  if (invert) list = list.substr(1);
  unsigned mask = 0;
  std::stringstream ss(list);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (strcasecmp(item.c_str(), "ALL") == 0) mask = kLogAll;
    for (const auto& n : kSubsysNames)
      if (strcasecmp(item.c_str(), n.name) == 0) mask |= n.bit;
  }
  return invert ? ~mask : mask;
}

std::string ExpandPath(const std::string& pattern, const std::string& host) {
  std::string out;
  for (size_t i = 0; i < pattern.size(); i++) {
    if (pattern[i] == '%' && i + 1 < pattern.size()) {
      char c = pattern[i + 1];
      if (c == 'h') {
        out += host;
        i++;
        continue;
      }
      if (c == 'p') {
        out += std::to_string(getpid());
        i++;
        continue;
      }
    }
    out += pattern[i];
  }
  return out;
}

void LoadLocked() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  gState.host = host;
  const EnvValues& env = Env();
  gState.level = ParseLevel(env.logLevel);
  gState.mask = ParseMask(env.logSubsys);
  if (gState.out != stderr && gState.out != nullptr) fclose(gState.out);
  gState.out = stderr;
  if (!env.logFile.empty()) {
    std::string path = ExpandPath(env.logFile, gState.host);
    FILE* f = fopen(path.c_str(), "a");
    if (f != nullptr) gState.out = f;
  }
  gMask.store(gState.mask);
  gLevel.store(static_cast<int>(gState.level));
}

void EnsureLoaded() {
  if (gLevel.load(std::memory_order_acquire) >= 0) return;
  std::lock_guard<std::mutex> lock(gMutex);
  if (gLevel.load() < 0) {
    try {
      LoadLocked();
    } catch (const Error&) {
      gLevel.store(static_cast<int>(LogLevel::kWarn));  // bad env values surface at init instead
    }
  }
}

}  // namespace

bool LogEnabled(LogLevel level, unsigned subsys) {
  EnsureLoaded();
  return static_cast<int>(level) <= gLevel.load(std::memory_order_relaxed) &&
         (gMask.load(std::memory_order_relaxed) & subsys) != 0;
}

void LogMessage(LogLevel level, unsigned subsys, const char* file, int line, const char* fmt, ...) {
  static const char* levelNames[] = {"NONE", "ERROR", "WARN", "INFO", "DEBUG", "TRACE"};
  const char* subsysName = "CORE";
  for (const auto& n : kSubsysNames)
    if (n.bit == subsys) subsysName = n.name;
  va_list args;
  va_start(args, fmt);
  std::string msg = StrFormatV(fmt, args);
  va_end(args);
  const char* base = std::strrchr(file, '/');
  base = base ? base + 1 : file;
  std::lock_guard<std::mutex> lock(gMutex);
  std::fprintf(gState.out, "%s:%d:%d [MORI %s %s] %s (%s:%d)\n", gState.host.c_str(), getpid(),
               gRank.load(), levelNames[static_cast<int>(level)], subsysName, msg.c_str(), base,
               line);
  std::fflush(gState.out);
}

void SetLogRank(int rank) { gRank.store(rank); }

void ReloadLogSettings() {
  std::lock_guard<std::mutex> lock(gMutex);
  LoadLocked();
}

}  // namespace mori::core

// NCCL-shaped logging: MORI_LOG_LEVEL threshold, MORI_LOG_SUBSYS filter, MORI_LOG_FILE (%h, %p).
// Lines look like "host:pid:rank [MORI INFO SHMEM] message".
#pragma once

#include <cstdarg>

namespace mori::core {

enum class LogLevel { kNone = 0, kError, kWarn, kInfo, kDebug, kTrace };

enum LogSubsys : unsigned {
  kLogInit = 1u << 0,
  kLogBootstrap = 1u << 1,
  kLogShmem = 1u << 2,
  kLogMem = 1u << 3,
  kLogTopo = 1u << 4,
  kLogRdma = 1u << 5,
  kLogOps = 1u << 6,
  kLogEnv = 1u << 7,
  kLogAll = ~0u,
};

bool LogEnabled(LogLevel level, unsigned subsys);
void LogMessage(LogLevel level, unsigned subsys, const char* file, int line, const char* fmt, ...)
    __attribute__((format(printf, 5, 6)));
// The rank shown in log lines once known (-1 before init).
void SetLogRank(int rank);
// Re-read the logging settings from the env table (after ReloadEnv).
void ReloadLogSettings();

}  // namespace mori::core

#define MORI_LOG(level, subsys, ...)                                                          \
  do {                                                                                        \
    if (::mori::core::LogEnabled(::mori::core::LogLevel::level, ::mori::core::subsys))        \
      ::mori::core::LogMessage(::mori::core::LogLevel::level, ::mori::core::subsys, __FILE__, \
                               __LINE__, __VA_ARGS__);                                        \
  } while (0)
#define MORI_ERROR(subsys, ...) MORI_LOG(kError, subsys, __VA_ARGS__)
#define MORI_WARN(subsys, ...) MORI_LOG(kWarn, subsys, __VA_ARGS__)
#define MORI_INFO(subsys, ...) MORI_LOG(kInfo, subsys, __VA_ARGS__)
#define MORI_DEBUG(subsys, ...) MORI_LOG(kDebug, subsys, __VA_ARGS__)
#define MORI_TRACE(subsys, ...) MORI_LOG(kTrace, subsys, __VA_ARGS__)

// Typed errors carrying file:line. Library code raises these; it never exits the process.
// Host-only header: no GPU runtime included here (see gpu_check.hpp for checked GPU calls).
#pragma once

#include <cerrno>
#include <cstdarg>
#include <cstring>
#include <stdexcept>
#include <string>

namespace mori::core {

enum class ErrorKind {
  kInvalidUsage,  // the caller passed something wrong; the object stays usable
  kTimeout,       // a bounded wait expired (host or device)
  kSystem,        // an OS call failed (errno)
  kGpuRuntime,    // a CUDA/HIP runtime call failed
  kRemote,        // a peer misbehaved (bad message, peer closed, remote error completion)
  kInternal,      // an invariant of ours broke
};

const char* ErrorKindName(ErrorKind kind);

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const char* file, int line, const std::string& message);
  ErrorKind Kind() const { return kind; }
  const char* File() const { return file; }
  int Line() const { return line; }
  // The message without the "file:line: " prefix.
  const std::string& Message() const { return message; }

 private:
  ErrorKind kind;
  const char* file;
  int line;
  std::string message;
};

#define MORI_DEFINE_ERROR(Name, KindValue)                   \
  class Name : public Error {                                \
   public:                                                   \
    Name(const char* file, int line, const std::string& msg) \
        : Error(KindValue, file, line, msg) {}               \
  };
MORI_DEFINE_ERROR(InvalidUsageError, ErrorKind::kInvalidUsage)
MORI_DEFINE_ERROR(TimeoutError, ErrorKind::kTimeout)
MORI_DEFINE_ERROR(SystemError, ErrorKind::kSystem)
MORI_DEFINE_ERROR(GpuRuntimeError, ErrorKind::kGpuRuntime)
MORI_DEFINE_ERROR(RemoteError, ErrorKind::kRemote)
MORI_DEFINE_ERROR(InternalError, ErrorKind::kInternal)
#undef MORI_DEFINE_ERROR

// printf-style formatting into a std::string.
std::string StrFormat(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string StrFormatV(const char* fmt, va_list args);

}  // namespace mori::core

// MORI_THROW(TimeoutError, "rank %d never arrived", r)
#define MORI_THROW(ErrorType, ...) \
  throw ::mori::core::ErrorType(__FILE__, __LINE__, ::mori::core::StrFormat(__VA_ARGS__))

// MORI_ENSURE(n > 0, InvalidUsageError, "n must be positive, got %d", n)
#define MORI_ENSURE(cond, ErrorType, ...)            \
  do {                                               \
    if (!(cond)) MORI_THROW(ErrorType, __VA_ARGS__); \
  } while (0)

// For OS calls returning -1 and setting errno.
#define MORI_CHECK_SYS(expr)                                                                 \
  do {                                                                                       \
    if ((expr) == -1) {                                                                      \
      int savedErrno_ = errno;                                                               \
      MORI_THROW(SystemError, "%s failed: %s (errno %d)", #expr, std::strerror(savedErrno_), \
                 savedErrno_);                                                               \
    }                                                                                        \
  } while (0)

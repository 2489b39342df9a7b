#include "mori/core/errors.hpp"

#include <cstdio>
#include <vector>

namespace mori::core {

const char* ErrorKindName(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidUsage: return "invalid usage";
    case ErrorKind::kTimeout: return "timeout";
    case ErrorKind::kSystem: return "system error";
    case ErrorKind::kGpuRuntime: return "GPU runtime error";
    case ErrorKind::kRemote: return "remote error";
    case ErrorKind::kInternal: return "internal error";
  }
  return "error";
}

namespace {
const char* BaseName(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash ? slash + 1 : path;
}
}  // namespace

Error::Error(ErrorKind kind, const char* file, int line, const std::string& message)
    : std::runtime_error(
          StrFormat("%s:%d: %s: %s", BaseName(file), line, ErrorKindName(kind), message.c_str())),
      kind(kind),
      file(file),
      line(line),
      message(message) {}

std::string StrFormatV(const char* fmt, va_list args) {
  va_list copy;
  va_copy(copy, args);
  int n = std::vsnprintf(nullptr, 0, fmt, copy);
  va_end(copy);
  if (n < 0) return fmt;
  std::vector<char> buf(static_cast<size_t>(n) + 1);
  std::vsnprintf(buf.data(), buf.size(), fmt, args);
  return std::string(buf.data(), static_cast<size_t>(n));
}

std::string StrFormat(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::string s = StrFormatV(fmt, args);
  va_end(args);
  return s;
}

}  // namespace mori::core

#include "mori/core/mps.hpp"

#include <unistd.h>

#include <cstdlib>
#include <string>

namespace mori::core {

MpsClient DetectMpsClient() {
  MpsClient m;
  const char* dir = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
  const std::string pipeDir = dir != nullptr && dir[0] != '\0' ? dir : "/tmp/nvidia-mps";
  m.active = access((pipeDir + "/control").c_str(), F_OK) == 0;
  if (const char* pct = std::getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")) {
    char* end = nullptr;
    const long v = std::strtol(pct, &end, 10);
    if (end != pct && *end == '\0' && v >= 1 && v <= 100) m.threadPercent = static_cast<int>(v);
  }
  return m;
}

}  // namespace mori::core

// Counting GPUs without initialising the GPU runtime in the calling process. A process that forks
// its PEs must not have used the runtime before fork: the children could not use it then.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "mori/core/gpu_runtime.hpp"

namespace mori::core {

// The number of GPUs the runtime sees, asked in a short-lived child process. -1 when it cannot
// tell (no GPU runtime, the runtime's error, pipe or fork failed), with the reason in *why when
// given.
inline int CountGpusInChildProcess(std::string* why = nullptr) {
  auto fail = [why](const std::string& reason) {
    if (why != nullptr) *why = reason;
    return -1;
  };
  int fds[2];
  if (pipe(fds) != 0) return fail("pipe() failed");
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return fail("fork() failed");
  }
  if (pid == 0) {
    close(fds[0]);
    int n = 0;
    const gpuError_t e = gpuGetDeviceCount(&n);
    char buf[256];
    if (e != gpuSuccess) {
      std::snprintf(buf, sizeof(buf), "-1 gpuGetDeviceCount failed: %s (%s)", gpuGetErrorName(e),
                    gpuGetErrorString(e));
    } else {
      std::snprintf(buf, sizeof(buf), "%d", n);
    }
    (void)!write(fds[1], buf, std::strlen(buf) + 1);
    _exit(0);
  }
  close(fds[1]);
  char buf[256] = {0};
  size_t got = 0;
  while (got < sizeof(buf) - 1) {
    const ssize_t r = read(fds[0], buf + got, sizeof(buf) - 1 - got);
    if (r <= 0) break;
    got += static_cast<size_t>(r);
  }
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (got == 0) return fail("the GPU probe process died without an answer (no GPU runtime?)");
  const int n = std::atoi(buf);
  if (n < 0) {
    const char* sp = std::strchr(buf, ' ');
    return fail(sp != nullptr ? sp + 1 : "gpuGetDeviceCount failed");
  }
  return n;
}

}  // namespace mori::core

// Whether this process runs its GPU work through CUDA MPS (Multi-Process Service), and the SM share
// its environment gives it. Under MPS the processes of one GPU run at the same time, each on up to
// its share of the SMs; without it they take turns (time slices). Host only.
#pragma once

namespace mori::core {

struct MpsClient {
  bool active = false;    // an MPS control pipe exists where this process would connect
  int threadPercent = 0;  // CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (1-100); 0 when unset or invalid
};

// Reads CUDA_MPS_PIPE_DIRECTORY (default /tmp/nvidia-mps: a "control" pipe there means a daemon the
// process connects to) and CUDA_MPS_ACTIVE_THREAD_PERCENTAGE. These are the CUDA driver's
// variables, not the library's settings (docs/ep.md, Residency).
MpsClient DetectMpsClient();

}  // namespace mori::core

// The one portability header kernels include: everything that differs between CUDA and HIP lives
// in the two headers below, and code above them uses the gpu* runtime names and the mori::core
// helpers, never an #if on the platform.
//   core/gpu_runtime.hpp  host: runtime API names, errors, streams, platform facts, launches
//   core/gpu_device.hpp   device: warp geometry, shuffles, ballots, atomics, fences, clocks,
//                         bulk copies
#pragma once

#include "mori/core/gpu_device.hpp"
#include "mori/core/gpu_runtime.hpp"

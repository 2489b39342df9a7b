// CK(call): the standalone CUDA probes' error check (tools/bench/*_probe.cu, built with plain
// nvcc outside the library): prints the call, line and CUDA error, then exits the probe.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#define CK(x)                                                             \
  do {                                                                    \
    cudaError_t e = (x);                                                  \
    if (e != cudaSuccess) {                                               \
      printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); \
      exit(1);                                                            \
    }                                                                     \
  } while (0)

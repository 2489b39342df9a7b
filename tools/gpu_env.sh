# shellcheck shell=bash
# Sourced by tools/run_tests.sh and tools/run_gpu_tests.sh: the GPU backend of a build and the
# GPUs the vendor's tool lists, for CUDA (nvidia-smi) and HIP (rocm-smi, else amd-smi).

# mori_build_backend <build dir>: CUDA or HIP as the build was configured (MORI_GPU_BACKEND in its
# CMakeCache.txt; AUTO resolved through the compiler CMake found). Prints nothing for a directory
# that is not configured.
mori_build_backend() {
  local cache=$1/CMakeCache.txt b
  [[ -f $cache ]] || return 0
  b=$(sed -n 's/^MORI_GPU_BACKEND:[A-Z]*=//p' "$cache" | tr '[:lower:]' '[:upper:]')
  if [[ $b != CUDA && $b != HIP ]]; then
    if grep -q '^CMAKE_HIP_COMPILER:' "$cache"; then b=HIP; else b=CUDA; fi
  fi
  echo "$b"
}

# mori_detect_backend: the backend for a new build: $MORI_GPU_BACKEND when CUDA or HIP, else CUDA
# when nvidia-smi or nvcc is found, HIP when rocm-smi, amd-smi or hipcc is, else CUDA.
mori_detect_backend() {
  local b
  b=$(tr '[:lower:]' '[:upper:]' <<<"${MORI_GPU_BACKEND:-}")
  if [[ $b == CUDA || $b == HIP ]]; then
    echo "$b"
  elif command -v nvidia-smi >/dev/null 2>&1 || command -v nvcc >/dev/null 2>&1 ||
    [[ -x /usr/local/cuda/bin/nvcc ]]; then
    echo CUDA
  elif command -v rocm-smi >/dev/null 2>&1 || command -v amd-smi >/dev/null 2>&1 ||
    command -v hipcc >/dev/null 2>&1; then
    echo HIP
  else
    echo CUDA
  fi
}

# mori_listed_gpus <CUDA|HIP>: how many GPUs the driver's tool lists (0 without the tool).
mori_listed_gpus() {
  local n=0
  if [[ $1 == HIP ]]; then
    if command -v rocm-smi >/dev/null 2>&1; then
      n=$(rocm-smi --showid 2>/dev/null | grep -oE '^GPU\[[0-9]+\]' | sort -u | wc -l)
    fi
    if [[ ${n:-0} -eq 0 ]] && command -v amd-smi >/dev/null 2>&1; then
      n=$(amd-smi list 2>/dev/null | grep -cE '^GPU: *[0-9]+' || true)
    fi
  else
    n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  fi
  echo "${n:-0}"
}

# mori_visible_devices <CUDA|HIP>: the device list the runtime is narrowed to, if any (HIP honours
# HIP_VISIBLE_DEVICES, ROCR_VISIBLE_DEVICES and CUDA_VISIBLE_DEVICES; the first set one is printed).
# Exit status 1 when none is set.
mori_visible_devices() {
  local v
  if [[ $1 == HIP ]]; then
    for v in HIP_VISIBLE_DEVICES ROCR_VISIBLE_DEVICES CUDA_VISIBLE_DEVICES; do
      if [[ -n ${!v+x} ]]; then echo "${!v}"; return 0; fi
    done
    return 1
  fi
  [[ -n ${CUDA_VISIBLE_DEVICES+x} ]] || return 1
  echo "$CUDA_VISIBLE_DEVICES"
}

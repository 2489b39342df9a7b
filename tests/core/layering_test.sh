#!/usr/bin/env bash
# Checks the layering rule of docs/architecture.md (a layer includes only itself and the layers
# below it) and that only the portability headers (core/gpu_runtime.hpp, core/gpu_device.hpp,
# core/host_device.hpp) test the platform. Usage: layering_test.sh <repo root>
set -u
root=${1:-.}
cd "$root" || exit 2
fail=0
check() {  # check <layer> <forbidden layer>...
  local layer=$1
  shift
  local files
  files=$(find "include/mori/$layer" "src/$layer" -type f \( -name '*.hpp' -o -name '*.cpp' -o -name '*.h' \) 2>/dev/null)
  [ -n "$files" ] || return 0
  for bad in "$@"; do
    hits=$(grep -HnE "#include [<\"]mori/$bad/" $files || true)
    if [ -n "$hits" ]; then
      echo "layering violation: $layer includes $bad:"
      echo "$hits"
      fail=1
    fi
  done
}
check core application shmem ops
check application shmem ops
check shmem ops
check ops application
layering=$fail

# The platform is tested only in the portability headers (docs/architecture.md, "One source").
fail=0
hits=$(grep -rnE '__CUDACC__|__HIPCC__|__CUDA_ARCH__|__HIP_DEVICE_COMPILE__|__HIP_PLATFORM|[^_]MORI_(HIP|CUDA)\b' \
  include src tools examples --include='*.hpp' --include='*.cpp' --include='*.h' --include='*.cu' 2>/dev/null |
  grep -vE '^include/mori/core/(gpu_runtime|gpu_device|host_device)\.hpp:' || true)
if [ -n "$hits" ]; then
  echo "platform tested outside core/gpu_runtime.hpp, core/gpu_device.hpp and core/host_device.hpp:"
  echo "$hits"
  fail=1
fi
platform=$fail

passed=$(( (layering == 0) + (platform == 0) ))
echo "$passed passed, $(( 2 - passed )) failed"
[ $layering -eq 0 ] && [ $platform -eq 0 ]

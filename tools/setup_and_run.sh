#!/usr/bin/env bash
# Set-up and main job: installs what is missing (Debian/Ubuntu via apt-get when available),
# builds mori, then runs the examples and the benchmarks on all local GPUs.
# Usage: tools/setup_and_run.sh [build-dir]        (env: MORI_GPU_BACKEND, MORI_GPU_ARCHS)
# Where packages cannot be installed (no package network, not root) it goes on with what is
# there; without GoogleTest it builds everything but the GoogleTest host suites and says so.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

# Packages for the chosen backend (tools/install_deps.sh --backend: AUTO follows the toolkit found).
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ] &&
  { ! [ -e /usr/include/gtest/gtest.h ] || ! command -v ninja >/dev/null 2>&1; }; then
  if ! timeout 900 bash tools/install_deps.sh --backend "${MORI_GPU_BACKEND:-auto}"; then
    echo "== some packages were not installed (listed above): going on with what is installed"
  fi
fi
# Ninja when present, else CMake's default generator (an existing build keeps its own).
generator=()
if ! [ -f "$build/CMakeCache.txt" ] && command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi

# The interpreter the Python module is built for: the first that has pybind11.
if [ -z "${PYTHON:-}" ]; then
  for cand in python3 /usr/bin/python3; do
    if "$cand" -c 'import pybind11' >/dev/null 2>&1; then PYTHON=$cand; break; fi
  done
fi
py=${PYTHON:-python3}
pybind_dir=$($py -m pybind11 --cmakedir 2>/dev/null || true)
cmake -S . -B "$build" ${generator[@]+"${generator[@]}"} \
  -DMORI_GPU_BACKEND="${MORI_GPU_BACKEND:-AUTO}" ${MORI_GPU_ARCHS:+-DMORI_GPU_ARCHS=$MORI_GPU_ARCHS} \
  ${pybind_dir:+-Dpybind11_DIR=$pybind_dir} -DPython_EXECUTABLE="$(command -v "$py")"
cmake --build "$build" -j "$(nproc)"
# tests/CMakeLists.txt adds the GoogleTest host suites (tests/core, tests/application) only when
# it finds GoogleTest; the GPU test programs and the Python tests need none.
if grep -q '^MORI_BUILD_TESTS:BOOL=ON' "$build/CMakeCache.txt" && ! [ -d "$build/tests/core" ]; then
  echo "== built everything but the GoogleTest host suites: GoogleTest was not found (install" \
    "libgtest-dev, or point GTest_DIR at one, and re-run to build them). tools/run_tests.sh $build" \
    "runs the GPU test programs and the Python tests."
fi

ngpu=$($py - <<'EOF' 2>/dev/null || echo 0
import ctypes
for lib in ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libamdhip64.so"):
    try:
        rt = ctypes.CDLL(lib)
    except OSError:
        continue
    n = ctypes.c_int(0)
    fn = rt.cudaGetDeviceCount if "cuda" in lib else rt.hipGetDeviceCount
    print(n.value if fn(ctypes.byref(n)) == 0 else 0)
    break
else:
    print(0)
EOF
)
if [ "${ngpu:-0}" -lt 1 ]; then
  echo "SKIPPED main job: it needs a local GPU (found none); the build succeeded."
  exit 0
fi

export PYTHONPATH="$PWD/$build/python${PYTHONPATH:+:$PYTHONPATH}"
if [ "$ngpu" -lt 2 ]; then
  # One GPU: the example's two PEs share it, the benchmark runs one rank (no link: the kernels'
  # own cost, with the torch baseline beside it).
  echo "== one GPU: the example starts 2 PEs on it, the EP benchmark 1 rank (nothing crosses a link)"
  "$build/examples/put_get" 2
  if [ -f tools/bench/ep_bench.py ]; then
    torchrun --nproc-per-node=1 tools/bench/ep_bench.py
  fi
  exit 0
fi
echo "== C++ example (put/get ring on $ngpu GPUs)"
"$build/examples/put_get"
if [ -x "$build/tools/shmem_put_bench" ]; then
  echo "== put bandwidth/latency between GPU 0 and 1"
  "$build/tools/shmem_put_bench"
fi
if [ -f tools/bench/ep_bench.py ]; then
  echo "== EP dispatch/combine benchmark on $ngpu GPUs"
  torchrun --nproc-per-node="$ngpu" tools/bench/ep_bench.py
fi

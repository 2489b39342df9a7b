#!/usr/bin/env bash
# Multi-GPU test run: the shmem GPU test programs, the C++ example, the Python example (when
# examples/python/put_get.py exists and torch imports) and the put benchmark, all on every local GPU.
#
#   tools/run_gpu_tests.sh [BUILD_DIR]        default: build-gpu
#
# Builds first when BUILD_DIR is not configured (CUDA, MORI_GPU_ARCHS, default 90; the Python module
# too when pybind11 is found). Each program's output goes to ${OUT:-/tmp}/gpu-tests-<name>.log; the
# run ends with a table (test | result | checks | seconds | log) and the failing lines of each
# failed log. Env: BENCH=0 skips the benchmark; TEST_TIMEOUT (s, default 900) bounds each program;
# MORI_TEST_NPES=N runs the shmem tests and the C++ example with N PEs, sharing GPUs when there are
# fewer (e.g. 4 PEs on a 1-GPU machine: the protocols between processes, no link).
# Exit status: 0 when nothing failed (skips for lack of GPUs included), 1 otherwise.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# NVLink multicast stays off on shared machines (see docs); also for programs we start.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

build=${1:-${MORI_BUILD_DIR:-build-gpu}}
out=${OUT:-/tmp}
mkdir -p "$out"
py=${PYTHON:-python3}
jobs=$(nproc 2>/dev/null || echo 4)
tests=(shmem_put_get_test shmem_atomic_test shmem_barrier_test shmem_timeout_test shmem_init_finalize_test shmem_rdma_test)
targets=("${tests[@]}" put_get shmem_put_bench)

# ---- build ----------------------------------------------------------------------------------
if [[ ! -f $build/build.ninja ]]; then
  pybind_dir=$($py -m pybind11 --cmakedir 2>/dev/null || true)
  common=(-S . -B "$build" -G Ninja -DMORI_GPU_BACKEND=CUDA "-DMORI_GPU_ARCHS=${MORI_GPU_ARCHS:-90}")
  echo "== configuring $build"
  if ! cmake "${common[@]}" ${pybind_dir:+-Dpybind11_DIR=$pybind_dir} \
      -DPython_EXECUTABLE="$(command -v "$py")" >"$out/gpu-tests-configure.log" 2>&1; then
    echo "   configure with the Python module failed (see $out/gpu-tests-configure.log); retrying without"
    rm -rf "$build"
    if ! cmake "${common[@]}" -DMORI_BUILD_PYTHON=OFF >>"$out/gpu-tests-configure.log" 2>&1; then
      tail -30 "$out/gpu-tests-configure.log"
      echo "run_gpu_tests.sh: configure failed"
      exit 1
    fi
  fi
fi
echo "== building ${targets[*]}"
if ! cmake --build "$build" -j "$jobs" --target "${targets[@]}" >"$out/gpu-tests-build.log" 2>&1; then
  grep -E "error|Error" "$out/gpu-tests-build.log" | head -30
  echo "run_gpu_tests.sh: build failed (log: $out/gpu-tests-build.log)"
  exit 1
fi
# Everything else (the Python module) on a best-effort basis: only the Python example needs it.
cmake --build "$build" -j "$jobs" >>"$out/gpu-tests-build.log" 2>&1 || echo "   (full build failed; see $out/gpu-tests-build.log)"

ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[[ ${ngpu:-0} -gt 0 ]] || ngpu=$($py -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
echo "== $ngpu local GPUs; logs in $out/gpu-tests-*.log"

# ---- run ------------------------------------------------------------------------------------
declare -a rows=() failedLogs=()
anyFailed=0
run() {  # run <name> <command...>
  local name=$1
  shift
  local log="$out/gpu-tests-$name.log" t0=$SECONDS rc result checks
  echo "-- $name: $*"
  timeout -k 10 "${TEST_TIMEOUT:-900}" "$@" >"$log" 2>&1
  rc=$?
  case $rc in
    0) result=PASS ;;
    77)
      # With two or more GPUs present a skip means the program could not use them: a failure.
      if [[ ${ngpu:-0} -ge 2 || -n ${MORI_TEST_NPES:-} ]]; then result="FAIL(skip)"; anyFailed=1; failedLogs+=("$log"); else result=SKIPPED; fi ;;
    124 | 137) result=TIMEOUT; anyFailed=1; failedLogs+=("$log") ;;
    *) result="FAIL($rc)"; anyFailed=1; failedLogs+=("$log") ;;
  esac
  checks=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$log" | tail -1)
  [[ $result == SKIPPED ]] && checks=$(grep -m1 '^SKIPPED' "$log" | cut -c1-60)
  add_row "$name" "$result" "${checks:--}" $((SECONDS - t0)) "$log"
  echo "   $result ${checks:-}"
}
add_row() {  # add_row <name> <result> <checks> <seconds> <log>
  rows+=("$(printf '%-26s | %-9s | %-26s | %5ds | %s' "$@")")
}

# MORI_TEST_NPES=N: N PEs in the shmem tests and the C++ example, several per GPU when N exceeds
# the GPU count (the protocols run between processes; nothing crosses a link).
npesArgs=()
[[ -n ${MORI_TEST_NPES:-} ]] && npesArgs=(--npes "$MORI_TEST_NPES")
for t in "${tests[@]}"; do
  run "$t" "$build/tests/shmem/$t" "${npesArgs[@]}"
done
run put_get_cpp "$build/examples/put_get" ${MORI_TEST_NPES:-}

if [[ -f examples/python/put_get.py ]]; then
  # The build tree holds the whole package (sources mirrored next to _C); the source tree has no _C.
  export PYTHONPATH="$PWD/$build/python${PYTHONPATH:+:$PYTHONPATH}"
  if ! command -v torchrun >/dev/null 2>&1 || ! $py -c 'import torch, mori' >/dev/null 2>&1; then
    add_row put_get_python SKIPPED "torch/torchrun or mori missing" 0 -
  elif [[ $ngpu -lt 2 ]]; then
    add_row put_get_python SKIPPED "fewer than 2 GPUs" 0 -
  else
    run put_get_python torchrun --nproc-per-node="$ngpu" examples/python/put_get.py
  fi
fi

if [[ ${BENCH:-1} != 0 ]]; then
  if [[ $ngpu -lt 2 ]]; then  # it measures a link: GPUs cannot be shared here (MORI_TEST_NPES)
    add_row shmem_put_bench SKIPPED "needs two distinct GPUs" 0 -
  else
    run shmem_put_bench "$build/tools/shmem_put_bench"
  fi
fi

# ---- report ---------------------------------------------------------------------------------
echo
printf '%-26s | %-9s | %-26s | %6s | %s\n' test result checks time log
printf '%s\n' "---------------------------+-----------+----------------------------+--------+-----"
printf '%s\n' "${rows[@]}"
for log in "${failedLogs[@]}"; do
  echo
  echo "==== failures in $log (FAIL / error lines, then the tail)"
  grep -E 'FAIL|DEVICE CHECK|EXCEPTION|exception|error|Error|killed|signal' "$log" | head -40
  echo "...."
  tail -15 "$log"
done
if [[ -f $out/gpu-tests-shmem_put_bench.log ]]; then
  echo
  echo "==== shmem_put_bench summary"
  grep -E '^(latency|target|  (warp|block) scope|all results|SOME)' "$out/gpu-tests-shmem_put_bench.log"
fi
exit $anyFailed

#!/usr/bin/env bash
# GPU test run on all local GPUs: the shmem GPU test programs, the C++ examples (put_get; the EP
# example for every kernel type, on emulated nodes for the inter-node ones), the Python example
# (when examples/python/put_get.py exists and torch imports), the EP correctness suites
# (tests/ops/ep_intranode_test.py, and tests/ops/ep_internode_test.py between emulated nodes where
# that file exists; every kernel type, AsyncLL included), the engine-loop suite
# (tests/ops/ep_engine_loop_test.py: steps without host synchronisation, per kernel type) and the
# put benchmark.
#
#   tools/run_gpu_tests.sh [--mps] [BUILD_DIR]        default BUILD_DIR: build-gpu
#
# The backend is the build's (MORI_GPU_BACKEND in BUILD_DIR/CMakeCache.txt): CUDA counts GPUs with
# nvidia-smi and honours CUDA_VISIBLE_DEVICES; HIP with rocm-smi (else amd-smi) and honours
# HIP_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES. Builds first when BUILD_DIR
# is not configured: backend $MORI_GPU_BACKEND, else CUDA where nvidia-smi or nvcc is found, HIP
# where rocm-smi, amd-smi or hipcc is; MORI_GPU_ARCHS, default 90 (CUDA) or gfx942 (HIP); Ninja
# when present; the Python module too when pybind11 is found. Writes two files into ${OUT:-/tmp}: gpu-tests-build.log (configure
# and build) and gpu-tests.log (every program's output, one section each). The run ends with a
# table (test | result | checks | seconds) and the failing lines of each failed program.
# Env: BENCH=0 skips the benchmark; TEST_TIMEOUT (s, default 900) bounds each program;
# MORI_TEST_NPES=N runs the shmem tests, the C++ example and the EP suites with N ranks, sharing
# GPUs when there are fewer (e.g. 4 on a 1-GPU machine: the protocols between processes, no link);
# MORI_EP_STRESS_ITERS (default 500) sets the EP suites' randomized stress iterations.
# --mps (or MORI_TEST_MPS=1): ranks sharing a GPU run at the same time under CUDA MPS, each with
# 100/(ranks per GPU) % of the SMs (tools/with_mps.sh), instead of taking turns (CUDA only).
# Exit status: 0 when nothing failed (skips for lack of GPUs included), 1 otherwise.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
# NVLink multicast stays off on shared machines (see docs); also for programs we start.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

mps=${MORI_TEST_MPS:-0}
args=()
for a in "$@"; do
  if [[ $a == --mps ]]; then mps=1; else args+=("$a"); fi
done
build=${args[0]:-${MORI_BUILD_DIR:-build-gpu}}
out=${OUT:-/tmp}
mkdir -p "$out"
buildLog=$out/gpu-tests-build.log
runLog=$out/gpu-tests.log
tmp=$(mktemp -d "${TMPDIR:-/tmp}/mori-gpu-tests.XXXXXX")
# shellcheck source=tools/with_mps.sh
source tools/with_mps.sh
# shellcheck source=tools/gpu_env.sh
source tools/gpu_env.sh
cleanup() {  # on every exit; a second signal must not cut it short
  trap '' INT TERM
  mps_stop
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT  # the EXIT trap then stops the MPS daemon
trap 'exit 143' TERM
py=${PYTHON:-python3}
jobs=$(nproc 2>/dev/null || echo 4)
tests=(shmem_put_get_test shmem_atomic_test shmem_barrier_test shmem_timeout_test shmem_init_finalize_test shmem_rdma_test)
targets=("${tests[@]}" mori-emulated-nic put_get ep_dispatch_combine shmem_put_bench)

# ---- build ----------------------------------------------------------------------------------
: >"$buildLog"
if [[ ! -f $build/CMakeCache.txt ]]; then
  backend=$(mori_detect_backend)
  if [[ $backend == HIP ]]; then defaultArchs=gfx942; else defaultArchs=90; fi
  pybind_dir=$($py -m pybind11 --cmakedir 2>/dev/null || true)
  common=(-S . -B "$build" -DMORI_GPU_BACKEND="$backend" "-DMORI_GPU_ARCHS=${MORI_GPU_ARCHS:-$defaultArchs}")
  command -v ninja >/dev/null 2>&1 && common+=(-G Ninja)
  echo "== configuring $build ($backend)"
  if ! cmake "${common[@]}" ${pybind_dir:+-Dpybind11_DIR=$pybind_dir} \
      -DPython_EXECUTABLE="$(command -v "$py")" >>"$buildLog" 2>&1; then
    echo "   configure with the Python module failed (see $buildLog); retrying without"
    rm -rf "$build"
    if ! cmake "${common[@]}" -DMORI_BUILD_PYTHON=OFF >>"$buildLog" 2>&1; then
      tail -30 "$buildLog"
      echo "run_gpu_tests.sh: configure failed"
      exit 1
    fi
  fi
fi
echo "== building ${targets[*]} in $build"
if ! cmake --build "$build" -j "$jobs" --target "${targets[@]}" >>"$buildLog" 2>&1; then
  grep -E "error|Error" "$buildLog" | head -30
  echo "run_gpu_tests.sh: build failed (log: $buildLog)"
  exit 1
fi
# Everything else (the Python module) on a best-effort basis: the Python example and the EP
# suites need it and fail without it.
cmake --build "$build" -j "$jobs" >>"$buildLog" 2>&1 || echo "   (full build failed; see $buildLog)"

# GPUs this run may use: the driver's list (nvidia-smi, rocm-smi), narrowed by the visible-devices
# variable when it is set (the ranks per GPU, the MPS share and the example's rank count follow
# from it).
backend=$(mori_build_backend "$build")
ngpu=$(mori_listed_gpus "$backend")
# torch.cuda is the HIP runtime's too in a ROCm build of torch.
[[ ${ngpu:-0} -gt 0 ]] || ngpu=$($py -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if visibleList=$(mori_visible_devices "$backend"); then
  IFS=, read -r -a visible <<<"$visibleList"
  nvis=0
  for v in "${visible[@]}"; do [[ -n ${v// /} ]] && nvis=$((nvis + 1)); done
  ((nvis < ngpu)) && ngpu=$nvis
fi
ranks=${MORI_TEST_NPES:-$ngpu}  # ranks of the multi-rank programs
echo "== $ngpu local GPUs ($backend build); output in $runLog"
if [[ $mps == 1 ]]; then
  if [[ $backend != CUDA ]]; then
    echo "run_gpu_tests.sh: --mps is CUDA MPS: not available for a $backend build"
    exit 1
  fi
  if [[ $ngpu -lt 1 ]]; then
    echo "run_gpu_tests.sh: --mps needs a GPU"
    exit 1
  fi
  mps_start $(((ranks + ngpu - 1) / ngpu)) || exit 1
fi

# ---- run ------------------------------------------------------------------------------------
: >"$runLog"
declare -a rows=() failedLogs=()
anyFailed=0
add_row() {  # add_row <name> <result> <checks> <seconds>
  rows+=("$(printf '%-26s | %-10s | %-40s | %5ds' "$@")")
}
fail_row() {  # fail_row <name> <result> <reason>: a failure that ran nothing
  add_row "$1" "$2" "$3" 0
  anyFailed=1
  echo "   $2 $3"
}
run() {  # run <name> <command...>
  local name=$1
  shift
  local log="$tmp/$name.log" t0=$SECONDS rc result checks
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
  if grep -q '^([0-9]* skipped)$' "$log"; then checks+=" $(grep '^([0-9]* skipped)$' "$log" | tail -1)"; fi
  [[ $result == SKIPPED ]] && checks=$(grep -m1 '^SKIPPED' "$log" | cut -c1-40)
  add_row "$name" "$result" "${checks:--}" $((SECONDS - t0))
  {
    echo "==== $name: $* (exit $rc, $((SECONDS - t0)) s)"
    cat "$log"
    echo
  } >>"$runLog"
  echo "   $result ${checks:-}"
}

# MORI_TEST_NPES=N: N PEs in the shmem tests and the C++ example, several per GPU when N exceeds
# the GPU count (the protocols run between processes; nothing crosses a link).
npesArgs=()
[[ -n ${MORI_TEST_NPES:-} ]] && npesArgs=(--npes "$MORI_TEST_NPES")
for t in "${tests[@]}"; do
  run "$t" "$build/tests/shmem/$t" "${npesArgs[@]}"
done
run put_get_cpp "$build/examples/put_get" ${MORI_TEST_NPES:-}
# The C++ EP example (examples/cpp/ep_dispatch_combine.cpp) with the run's ranks, every kernel type:
# IntraNode and AsyncLL on one node; the inter-node types and AsyncLL between emulated nodes of
# half the ranks (one per node for an odd count; RDMA through the emulated NIC).
for kt in IntraNode AsyncLL; do
  run "ep_cpp_$kt" "$build/examples/ep_dispatch_combine" --npes "$ranks" "$kt"
done
if [[ $ranks -lt 2 ]]; then
  add_row ep_cpp_emu SKIPPED "needs 2 ranks (MORI_TEST_NPES=4 shares a GPU)" 0
else
  for kt in InterNode InterNodeV1 InterNodeV1LL AsyncLL; do
    run "ep_cpp_emu_$kt" "$build/examples/ep_dispatch_combine" --npes "$ranks" \
      --gpu-per-node $((ranks % 2 == 0 ? ranks / 2 : 1)) "$kt"
  done
fi
# P2P and emulated RDMA peers in one run: 4 PEs in 2 virtual nodes (ranks share GPUs when fewer).
run shmem_rdma_mixed env MORI_RDMA_EMULATE=1 \
  "$build/tests/shmem/shmem_rdma_test" --gpu-per-node 2 --npes 4

# The build tree holds the whole package (sources mirrored next to _C); the source tree has no _C.
export PYTHONPATH="$PWD/$build/python${PYTHONPATH:+:$PYTHONPATH}"
export MORI_BUILD_DIR="$PWD/$build"
pyOk=0
$py -c 'import torch, mori' >/dev/null 2>&1 && pyOk=1
if [[ -f examples/python/put_get.py ]]; then
  if ! command -v torchrun >/dev/null 2>&1 || [[ $pyOk == 0 ]]; then
    add_row put_get_python SKIPPED "torch/torchrun or mori missing" 0
  elif [[ $ranks -lt 2 ]]; then
    add_row put_get_python SKIPPED "needs 2 ranks (MORI_TEST_NPES=2 shares a GPU)" 0
  else
    run put_get_python torchrun --nproc-per-node="$ranks" examples/python/put_get.py
  fi
fi

# The EP suites (every case, the stress with MORI_EP_STRESS_ITERS iterations).
export MORI_EP_STRESS_ITERS=${MORI_EP_STRESS_ITERS:-500}
if [[ $ngpu -lt 1 ]]; then
  add_row ep_intranode SKIPPED "no GPU" 0
elif [[ $pyOk == 0 ]]; then
  fail_row ep_intranode "FAIL" "torch or mori ($build/python) missing"
else
  run ep_intranode "$py" tests/ops/ep_intranode_test.py --nproc "$ranks"
  # AsyncLL (ROCm/mori's name) runs as IntraNode on one node.
  run ep_intranode_AsyncLL "$py" tests/ops/ep_intranode_test.py --nproc "$ranks" --kernel-type AsyncLL
  # Cases that need a GPU to themselves skip while ranks share GPUs: run them with one rank.
  if [[ $ranks -gt $ngpu ]]; then
    run ep_intranode_1rank "$py" tests/ops/ep_intranode_test.py --nproc 1 -k push_combine_beside_full_gpu
  fi
fi
if [[ -f tests/ops/ep_internode_test.py ]]; then
  # Two or more emulated nodes: half the ranks per node (one per node for an odd count).
  perNode=$((ranks % 2 == 0 ? ranks / 2 : 1))
  if [[ $ranks -lt 2 ]]; then
    add_row ep_internode SKIPPED "needs 2 ranks (MORI_TEST_NPES=4 shares a GPU)" 0
  elif [[ $pyOk == 0 ]]; then
    fail_row ep_internode "FAIL" "torch or mori ($build/python) missing"
  else
    run ep_internode env MORI_RDMA_EMULATE=1 \
      "$py" tests/ops/ep_internode_test.py --nproc "$ranks" --gpu-per-node "$perNode"
    # The node-deduplicated kernel types, same suite (combine checked by the two-level formula),
    # and AsyncLL (runs as InterNode across nodes).
    for kt in InterNodeV1 InterNodeV1LL AsyncLL; do
      run "ep_internode_$kt" env MORI_RDMA_EMULATE=1 \
        "$py" tests/ops/ep_internode_test.py --nproc "$ranks" --gpu-per-node "$perNode" \
        --kernel-type "$kt"
    done
  fi
fi

# The engine-loop suite, full form (300 steps without host synchronisation, a CUDA graph replayed
# 100 times; bad_expert_id on rows of its own): IntraNode and AsyncLL on one node, the inter-node
# kernel types and AsyncLL between emulated nodes (half the ranks per node).
if [[ -f tests/ops/ep_engine_loop_test.py ]]; then
  loop=(tests/ops/ep_engine_loop_test.py --nproc "$ranks")
  emu=(env MORI_RDMA_EMULATE=1)
  if [[ $ngpu -lt 1 ]]; then
    add_row engine_loop SKIPPED "no GPU" 0
  elif [[ $pyOk == 0 ]]; then
    fail_row engine_loop "FAIL" "torch or mori ($build/python) missing"
  else
    for kt in IntraNode AsyncLL; do
      run "engine_loop_$kt" "$py" "${loop[@]}" --kernel-type "$kt" -k engine_loop -k cuda_graph
    done
    run engine_loop_bad_id "$py" "${loop[@]}" --kernel-type IntraNode --kernel-type AsyncLL -k bad_expert_id
    if [[ $ranks -lt 2 ]]; then
      add_row engine_nodes SKIPPED "needs 2 ranks (MORI_TEST_NPES=4 shares a GPU)" 0
    else
      perNode=$((ranks % 2 == 0 ? ranks / 2 : 1))
      for kt in InterNode InterNodeV1 InterNodeV1LL AsyncLL; do
        run "engine_nodes_$kt" "${emu[@]}" "$py" "${loop[@]}" --gpu-per-node "$perNode" --kernel-type "$kt" \
          -k engine_loop -k cuda_graph
      done
      run engine_nodes_bad_id "${emu[@]}" "$py" "${loop[@]}" --gpu-per-node "$perNode" --kernel-type InterNode \
        --kernel-type InterNodeV1 --kernel-type InterNodeV1LL --kernel-type AsyncLL -k bad_expert_id
    fi
  fi
fi

if [[ ${BENCH:-1} != 0 ]]; then
  if [[ $ngpu -lt 2 ]]; then  # it measures a link: GPUs cannot be shared here (MORI_TEST_NPES)
    add_row shmem_put_bench SKIPPED "needs two distinct GPUs" 0
  else
    run shmem_put_bench "$build/tools/shmem_put_bench"
  fi
fi

# ---- report ---------------------------------------------------------------------------------
echo
printf '%-26s | %-10s | %-40s | %6s\n' test result checks time
printf '%s\n' "---------------------------+------------+------------------------------------------+-------"
printf '%s\n' "${rows[@]}"
echo "(output of each program: $runLog, build: $buildLog)"
for log in "${failedLogs[@]}"; do
  echo
  echo "==== failures of $(basename "$log" .log) (FAIL / error lines, then the tail)"
  grep -E 'FAIL|DEVICE CHECK|EXCEPTION|exception|error|Error|killed|signal' "$log" | head -40
  echo "...."
  tail -15 "$log"
done
if [[ -f $tmp/shmem_put_bench.log ]]; then
  echo
  echo "==== shmem_put_bench summary"
  grep -E '^(latency|target|  (warp|block) scope|all results|SOME)' "$tmp/shmem_put_bench.log"
fi
exit $anyFailed

#!/usr/bin/env bash
# The project's test command (README and .ci/run both call this).
#   tools/run_tests.sh [BUILD_DIR]      default: $MORI_BUILD_DIR or build
# Runs CTest (C++ tests) and then the Python tests. An empty suite is an error in both: nothing
# collected must never look green.
# Without a GPU the GPU programs report "SKIPPED: <reason>" (exit code 77, CTest counts them as
# skipped) and the GPU pytest tests skip with the reason. With a GPU every GPU test runs, ranks
# sharing GPUs when there are fewer than a test needs (CTest gives the shmem programs --npes 2;
# tests/python/test_ep_gpu.py runs the EP suites with --nproc 2 and 4), and a GPU test that skips
# fails the run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

build="${1:-${MORI_BUILD_DIR:-build}}"
if [[ ! -f "$build/CTestTestfile.cmake" ]]; then
  echo "run_tests.sh: '$build' is not a configured build directory with tests" >&2
  exit 2
fi

# The interpreter must have pytest and match the one the module was built for: prefer the
# build's Python_EXECUTABLE, then Debian's /usr/bin/python3 (a pyenv python3 may lack pytest).
if [[ -z "${PYTHON:-}" ]]; then
  built_for=$(sed -n 's/^Python_EXECUTABLE:[A-Z]*=//p' "$build/CMakeCache.txt")
  for cand in ${built_for:+"$built_for"} /usr/bin/python3 python3; do
    if "$cand" -c 'import pytest' >/dev/null 2>&1; then PYTHON="$cand"; break; fi
  done
fi
: "${PYTHON:?no python3 with pytest found; set PYTHON}"

export MORI_BUILD_DIR="$(cd "$build" && pwd)"
# <build>/python holds the importable package (python/mori/*.py linked next to _C*.so).
export PYTHONPATH="$MORI_BUILD_DIR/python${PYTHONPATH:+:$PYTHONPATH}"

# GPUs the runtime sees (through the module under test). A driver that lists GPUs the runtime
# cannot use is an error: every GPU test would skip and the run would look green. The driver's
# list comes from the build's backend: nvidia-smi (CUDA) or rocm-smi / amd-smi (HIP).
# shellcheck source=tools/gpu_env.sh
source tools/gpu_env.sh
backend=$(mori_build_backend "$build")
if [[ $backend == HIP ]]; then smi=rocm-smi; else smi=nvidia-smi; fi
gpus=$("$PYTHON" -c 'import mori; print(int(mori.device_info()["count"]))' 2>/dev/null || echo 0)
listed=$(mori_listed_gpus "$backend")
if [[ ${gpus:-0} -eq 0 && ${listed:-0} -gt 0 ]]; then
  echo "run_tests.sh: $smi lists $listed GPU(s) but the runtime sees none:" >&2
  "$PYTHON" -c 'import mori; print(mori.device_info()["error"])' >&2 || true
  exit 1
fi
if [[ ${gpus:-0} -gt 0 ]]; then
  echo "run_tests.sh: $gpus GPU(s) visible: every GPU test must run (a skip fails the run)"
else
  echo "run_tests.sh: no GPU visible: the GPU tests report SKIPPED with the reason"
fi

if [[ ! -d $build/tests/core ]]; then
  echo "run_tests.sh: note: $build has no GoogleTest host suites (GoogleTest was not found when it" \
    "was configured): CTest runs the GPU test programs only"
fi

ctest_log=$(mktemp)
trap 'rm -f "$ctest_log"' EXIT
ctest_rc=0
ctest --test-dir "$build" --output-on-failure --no-tests=error -j"${MORI_TEST_JOBS:-2}" 2>&1 |
  tee "$ctest_log" || ctest_rc=${PIPESTATUS[0]}
[[ $ctest_rc -eq 0 ]] || exit "$ctest_rc"
if [[ ${gpus:-0} -gt 0 ]]; then
  # CTest lists what did not run as "<number> - <name> (Skipped)".
  gpu_tests=$(ctest --test-dir "$build" -N -L gpu | sed -n 's/^ *Test *#[0-9]*: *//p')
  skipped=$(sed -n 's/^[[:space:]]*[0-9]* - \(.*\) (Skipped)$/\1/p' "$ctest_log")
  bad=$(comm -12 <(sort <<<"$gpu_tests") <(sort <<<"$skipped") | sed '/^$/d')
  if [[ -n $bad ]]; then
    echo "run_tests.sh: GPU tests skipped although $gpus GPU(s) are visible: ${bad//$'\n'/ }" >&2
    exit 1
  fi
fi

rc=0
"$PYTHON" -m pytest -q tests/python || rc=$?
if [[ $rc -eq 5 ]]; then
  echo "run_tests.sh: pytest collected no tests in tests/python" >&2
  exit 1
fi
exit $rc

#!/usr/bin/env bash
# The project's test command (README and .ci/run both call this).
#   tools/run_tests.sh [--quick] [BUILD_DIR]      BUILD_DIR default: $MORI_BUILD_DIR or build
# Full tier (the default): CTest (C++ tests) and the Python tests, every GPU test included.
# Quick tier (--quick): CTest without the GPU programs (label gpu) and the Python tests of the quick
# tier (pytest -m "not full": the CPU tests and a short form of the GPU tests, every EP kernel type
# once; markers in pyproject.toml).
# Both stages run whatever the other's result; the exit status is 0 only when both passed, and the
# last two lines give each stage's counts. An empty suite is an error in both: nothing collected
# must never look green.
# Without a GPU the GPU programs report "SKIPPED: <reason>" (exit code 77, CTest counts them as
# skipped) and the GPU pytest tests skip with the reason. With a GPU every GPU test of the tier
# runs, ranks sharing GPUs when there are fewer than a test needs (CTest gives the shmem programs
# --npes 2; tests/python/test_ep_gpu.py runs the EP suites with 2 and 4 ranks), and a GPU test that
# skips fails the run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

quick=0
build=""
for arg in "$@"; do
  case $arg in
    --quick) quick=1 ;;
    -h | --help)
      sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
      exit 0
      ;;
    -*)
      echo "run_tests.sh: unknown option '$arg' (usage: tools/run_tests.sh [--quick] [BUILD_DIR])" >&2
      exit 2
      ;;
    *)
      if [[ -n $build ]]; then
        echo "run_tests.sh: one build directory only (got '$build' and '$arg')" >&2
        exit 2
      fi
      build=$arg
      ;;
  esac
done
build="${build:-${MORI_BUILD_DIR:-build}}"
if [[ ! -f "$build/CTestTestfile.cmake" ]]; then
  echo "run_tests.sh: '$build' is not a configured build directory with tests" >&2
  exit 2
fi

# The interpreter must have pytest and match the one the module was built for: prefer the
# build's Python_EXECUTABLE, then Debian's /usr/bin/python3 (a pyenv python3 may lack pytest).
if [[ -z "${PYTHON:-}" ]]; then
  built_for=$(sed -n 's/^Python_EXECUTABLE:[A-Z]*=//p' "$build/CMakeCache.txt" 2>/dev/null || true)
  for cand in ${built_for:+"$built_for"} /usr/bin/python3 python3; do
    if "$cand" -c 'import pytest' >/dev/null 2>&1; then PYTHON="$cand"; break; fi
  done
fi
: "${PYTHON:?no python3 with pytest found; set PYTHON}"

MORI_BUILD_DIR="$(cd "$build" && pwd)"
export MORI_BUILD_DIR
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
tier=$([[ $quick -eq 1 ]] && echo "quick tier" || echo "full tier")
if [[ ${gpus:-0} -gt 0 ]]; then
  echo "run_tests.sh: $tier; $gpus GPU(s) visible: every GPU test of the tier must run (a skip fails the run)"
else
  echo "run_tests.sh: $tier; no GPU visible: the GPU tests report SKIPPED with the reason"
fi

if [[ ! -d $build/tests/core ]]; then
  echo "run_tests.sh: note: $build has no GoogleTest host suites (GoogleTest was not found when it" \
    "was configured): CTest runs the GPU test programs and the package checks only"
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# --- CTest --------------------------------------------------------------------------------------
ctest_args=(--test-dir "$build" --output-on-failure --no-tests=error -j"${MORI_TEST_JOBS:-2}")
[[ $quick -eq 1 ]] && ctest_args+=(-LE gpu)
ctest_rc=0
ctest "${ctest_args[@]}" 2>&1 | tee "$work/ctest.log" || ctest_rc=${PIPESTATUS[0]}
if [[ ${gpus:-0} -gt 0 && $quick -eq 0 ]]; then
  # CTest lists what did not run as "<number> - <name> (Skipped)".
  gpu_tests=$(ctest --test-dir "$build" -N -L gpu | sed -n 's/^ *Test *#[0-9]*: *//p')
  skipped=$(sed -n 's/^[[:space:]]*[0-9]* - \(.*\) (Skipped)$/\1/p' "$work/ctest.log")
  bad=$(comm -12 <(sort <<<"$gpu_tests") <(sort <<<"$skipped") | sed '/^$/d')
  if [[ -n $bad ]]; then
    echo "run_tests.sh: GPU tests skipped although $gpus GPU(s) are visible: ${bad//$'\n'/ }" >&2
    ctest_rc=1
  fi
fi
# "N% tests passed, F tests failed out of T" ("100% tests passed out of T" from CMake 4 on when
# none failed); skipped tests count as passed there.
ctest_summary="did not finish (exit $ctest_rc; its output above says why)"
if total_line=$(grep -E '^[0-9]+% tests passed(, [0-9]+ tests? failed)? out of [0-9]+' "$work/ctest.log" | tail -1); then
  c_failed=0
  [[ $total_line =~ ([0-9]+)\ tests?\ failed ]] && c_failed=${BASH_REMATCH[1]}
  c_total=$(sed -E 's/.* out of ([0-9]+).*/\1/' <<<"$total_line")
  c_skipped=$(grep -cE '^[[:space:]]*[0-9]+ - .* \(Skipped\)$' "$work/ctest.log" || true)
  ctest_summary="$((c_total - c_failed - c_skipped)) passed, $c_failed failed, $c_skipped skipped (of $c_total)"
fi
[[ $ctest_rc -eq 0 ]] || ctest_summary="FAILED: $ctest_summary"

# --- pytest -------------------------------------------------------------------------------------
# Live progress comes from pyproject.toml (log_cli: the GPU suites' case lines as they come);
# --durations lists the slowest tests; the counts come from the JUnit XML report, kept next to
# CTest's results (<build>/Testing/pytest.xml).
marker=$([[ $quick -eq 1 ]] && echo "not full" || echo "not quick")
report="$MORI_BUILD_DIR/Testing/pytest.xml"
mkdir -p "$MORI_BUILD_DIR/Testing"
rm -f "$report"
pytest_rc=0
"$PYTHON" -m pytest -q tests/python -m "$marker" --durations=10 --junitxml="$report" || pytest_rc=$?
pytest_summary=$("$PYTHON" - "$report" <<'EOF' 2>/dev/null || echo "no report (exit $pytest_rc; its output above says why)"
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
failed = n["failures"] + n["errors"]
print(f"{n['tests'] - failed - n['skipped']} passed, {failed} failed, {n['skipped']} skipped")
EOF
)
if [[ $pytest_rc -eq 5 ]]; then
  echo "run_tests.sh: pytest collected no tests in tests/python (-m \"$marker\")" >&2
fi
[[ $pytest_rc -eq 0 ]] || pytest_summary="FAILED: $pytest_summary"

echo "run_tests.sh: CTest ($tier): $ctest_summary"
echo "run_tests.sh: pytest ($tier): $pytest_summary"
[[ $ctest_rc -eq 0 && $pytest_rc -eq 0 ]]

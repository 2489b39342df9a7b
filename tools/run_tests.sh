#!/usr/bin/env bash
# The project's test command (README and .ci/run both call this).
#   tools/run_tests.sh [BUILD_DIR]      default: $MORI_BUILD_DIR or build
# Runs CTest (C++ tests; GPU programs without a GPU report "skipped", exit code 77) and then the
# Python tests. An empty suite is an error in both: nothing collected must never look green.
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

ctest --test-dir "$build" --output-on-failure --no-tests=error -j"${MORI_TEST_JOBS:-2}"

export MORI_BUILD_DIR="$(cd "$build" && pwd)"
# <build>/python holds the importable package (python/mori/*.py linked next to _C*.so).
export PYTHONPATH="$MORI_BUILD_DIR/python${PYTHONPATH:+:$PYTHONPATH}"
rc=0
"$PYTHON" -m pytest -q tests/python tests/ops/test_ep_block_roles.py || rc=$?
if [[ $rc -eq 5 ]]; then
  echo "run_tests.sh: pytest collected no tests in tests/python" >&2
  exit 1
fi
exit $rc

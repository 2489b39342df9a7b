#!/usr/bin/env bash
# Checks the layering rule of docs/architecture.md: a layer includes only itself and the layers
# below it. Usage: layering_test.sh <repo root>
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
if [ $fail -eq 0 ]; then echo "1 passed, 0 failed"; else echo "0 passed, 1 failed"; fi
exit $fail

#!/usr/bin/env bash
# Debian/Ubuntu packages the project builds and tests with (CI and tools/setup_and_run.sh).
# A no-op when everything is installed. Needs root.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
PKGS=(
  cmake ninja-build g++ pkg-config
  libibverbs-dev rdma-core ibverbs-providers libmpich-dev mpich
  libgtest-dev libgmock-dev pybind11-dev python3-pybind11 python3-dev python3-pytest python3-numpy
  hipcc libamdhip64-dev rocm-device-libs                     # HIP 5.2 + clang-15 (gfx90a build)
  clang-19 clang-tools-19 lld-19 llvm-19 libclang-rt-19-dev  # gfx942 build
  clang-format-14                                            # tools/check_format.sh (pinned)
)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  # Bounded network waits: without a package network this fails soon instead of retrying.
  apt-get update -qq -o Acquire::Retries=1 -o Acquire::http::Timeout=30 -o Acquire::https::Timeout=30
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
echo "packages ok (${#missing[@]} installed now)"

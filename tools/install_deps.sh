#!/usr/bin/env bash
# Debian/Ubuntu packages mori builds and tests with (CI and tools/setup_and_run.sh). A no-op when
# everything is installed; installing needs root.
#
#   tools/install_deps.sh [--backend all|cuda|hip|auto] [--dry-run]
#
# --backend (or env MORI_DEPS_BACKEND), default all:
#   cuda  build + tests: CMake, Ninja, g++, verbs, MPICH, GoogleTest, pybind11, pytest, numpy
#         (the CUDA toolkit itself comes from NVIDIA, not from these packages)
#   hip   the same plus HIP (hipcc, libamdhip64-dev, rocm-device-libs: HIP 5.2 and clang-15 on
#         Debian 12, for gfx90a) and clang-19 (gfx942)
#   all   cuda + hip + clang-format-14 (tools/check_format.sh): what CI installs
#   auto  cuda when nvcc is found (PATH, $CUDA_PATH, /usr/local/cuda), else hip when ROCm/hipcc
#         is, else all
# --dry-run (or MORI_DEPS_DRY_RUN=1): lists what is missing and whether this release's package
# lists have it; installs nothing.
# MORI_DEPS_EXTRA="pkg ...": more packages to install (also how the failure report is tested).
#
# Package names differ between releases: an entry "a|b" takes the first name the package lists
# know. A name that no list has is reported as unavailable on this release and the rest are
# installed; when apt-get fails, each package is retried alone and the failing ones are listed
# with apt's message. Exit status: 0 when every package is installed, 1 otherwise.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
APT_GET=${MORI_DEPS_APT_GET:-apt-get}    # test hook: a stand-in for apt-get
APT_CACHE=${MORI_DEPS_APT_CACHE:-apt-cache}
OS_RELEASE=${MORI_DEPS_OS_RELEASE:-/etc/os-release}  # test hook: another release's file

backend=${MORI_DEPS_BACKEND:-all}
dry=${MORI_DEPS_DRY_RUN:-0}
while (($#)); do
  case $1 in
    --backend) backend=${2:?--backend needs all, cuda, hip or auto}; shift 2 ;;
    --backend=*) backend=${1#*=}; shift ;;
    --dry-run) dry=1; shift ;;
    -h | --help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install_deps.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
backend=$(tr '[:upper:]' '[:lower:]' <<<"$backend")
if [[ $backend == auto ]]; then
  if command -v nvcc >/dev/null 2>&1 || [[ -x ${CUDA_PATH:-/usr/local/cuda}/bin/nvcc ]]; then
    backend=cuda
  elif command -v hipcc >/dev/null 2>&1 || [[ -d ${ROCM_PATH:-/opt/rocm} ]]; then
    backend=hip
  else
    backend=all
  fi
fi
case $backend in
  cuda | hip | all) ;;
  *) echo "install_deps.sh: backend must be all, cuda, hip or auto (got '$backend')" >&2; exit 2 ;;
esac

# The release, for the messages about names it lacks.
release=unknown
if [[ -r $OS_RELEASE ]]; then
  # shellcheck disable=SC1090
  release=$(. "$OS_RELEASE" && echo "${ID:-?} ${VERSION_ID:-?}")
fi

BASE=(
  cmake ninja-build g++ pkg-config
  libibverbs-dev rdma-core ibverbs-providers libmpich-dev mpich
  libgtest-dev libgmock-dev pybind11-dev python3-pybind11 python3-dev python3-pytest python3-numpy
)
HIP=(
  hipcc libamdhip64-dev rocm-device-libs                     # HIP (Debian 12: 5.2, clang-15: gfx90a)
  clang-19 clang-tools-19 lld-19 llvm-19 libclang-rt-19-dev  # gfx942
)
FORMAT=(clang-format-14)  # tools/check_format.sh (pinned)
PKGS=("${BASE[@]}")
[[ $backend == cuda ]] || PKGS+=("${HIP[@]}")
[[ $backend == all ]] && PKGS+=("${FORMAT[@]}")
# shellcheck disable=SC2206  # word splitting wanted
[[ -n ${MORI_DEPS_EXTRA:-} ]] && PKGS+=(${MORI_DEPS_EXTRA})

# What the distribution's own archive does not carry, to say where it comes from instead.
hint() {
  case "$release:$1" in
    "ubuntu 22.04:"hipcc | "ubuntu 22.04:"libamdhip64-dev | "ubuntu 22.04:"rocm-device-libs)
      echo "Ubuntu 22.04 has no HIP packages: install ROCm from AMD's repository (repo.radeon.com)" ;;
    "ubuntu 22.04:"*-19 | "ubuntu 22.04:"libclang-rt-19-dev)
      echo "Ubuntu 22.04 has no LLVM 19: apt.llvm.org has it (needed only for the gfx942 build)" ;;
    *:clang-format-14)
      echo "the format check is pinned to clang-format 14; without it tools/check_format.sh cannot run" ;;
  esac
}

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }
known() {  # the package lists have an installable version of it
  local c
  c=$("$APT_CACHE" policy "$1" 2>/dev/null | sed -n 's/^ *Candidate: *//p')
  [[ -n $c && $c != "(none)" ]]
}

missing=()
for entry in "${PKGS[@]}"; do
  IFS='|' read -r -a alts <<<"$entry"
  have=0
  for p in "${alts[@]}"; do installed "$p" && { have=1; break; }; done
  ((have)) || missing+=("$entry")
done
if ((${#missing[@]} == 0)); then
  echo "packages ok ($backend: ${#PKGS[@]} installed already)"
  exit 0
fi
echo "install_deps.sh ($release, backend $backend): missing ${missing[*]}"

if [[ $dry != 1 ]]; then
  if [[ $(id -u) != 0 ]]; then
    echo "install_deps.sh: installing needs root; as root: apt-get install ${missing[*]//|/ or }" >&2
    exit 1
  fi
  log=$(mktemp)
  trap 'rm -f "$log"' EXIT
  # Bounded network waits: without a package network this fails soon instead of retrying.
  if ! "$APT_GET" update -qq -o Acquire::Retries=1 -o Acquire::http::Timeout=30 \
      -o Acquire::https::Timeout=30 >"$log" 2>&1; then
    echo "install_deps.sh: apt-get update failed (package sources unreachable or broken):" >&2
    grep -E '^(E|W|Err):' "$log" | head -10 | sed 's/^/    /' >&2 || true
    echo "    going on with the package lists already on this machine" >&2
  fi
fi

# Resolve each entry to a name the lists know; the rest are unavailable on this release.
want=() unavailable=()
for entry in "${missing[@]}"; do
  IFS='|' read -r -a alts <<<"$entry"
  pick=""
  for p in "${alts[@]}"; do known "$p" && { pick=$p; break; }; done
  if [[ -n $pick ]]; then want+=("$pick"); else unavailable+=("$entry"); fi
done

report_unavailable() {
  local e h
  for e in "${unavailable[@]}"; do
    h=$(hint "${e%%|*}")
    echo "  not in the package lists of $release: ${e//|/ or }${h:+ ($h)}"
  done
}

if [[ $dry == 1 ]]; then
  ((${#want[@]})) && echo "would install: ${want[*]}"
  report_unavailable
  exit $((${#unavailable[@]} ? 1 : 0))
fi

failed=()
if ((${#want[@]})); then
  if ! "$APT_GET" install -y -qq --no-install-recommends "${want[@]}" >"$log" 2>&1; then
    echo "install_deps.sh: installing ${#want[@]} packages together failed; trying each alone"
    for p in "${want[@]}"; do
      if ! "$APT_GET" install -y -qq --no-install-recommends "$p" >"$log" 2>&1; then
        failed+=("$p")
        echo "  $p failed:"
        grep -E '^(E|W):|unmet|Depends:' "$log" | head -8 | sed 's/^/    /' || true
      fi
    done
  fi
fi
if ((${#unavailable[@]} + ${#failed[@]})); then
  echo "install_deps.sh: installed $((${#want[@]} - ${#failed[@]})) of ${#missing[@]} missing packages"
  report_unavailable
  ((${#failed[@]})) && echo "  failed to install: ${failed[*]}"
  exit 1
fi
echo "packages ok (${#want[@]} installed now)"

#!/usr/bin/env bash
# Builds DeepEP from its source into this Python, for `ep_bench.py --compare deep_ep`.
#
#   git clone -b v1.2.1 https://github.com/deepseek-ai/DeepEP /path/DeepEP   (where a network is)
#   tools/bench/build_deep_ep.sh /path/DeepEP
#
# DeepEP's setup.py takes NVSHMEM from NVSHMEM_DIR or the `nvidia-nvshmem-cu<major>` pip package;
# without either it builds the intranode kernels only (no low-latency mode, so the bench's LL
# comparison fails). This script says which it found, builds for sm_90 (TORCH_CUDA_ARCH_LIST,
# default 9.0) with MAX_JOBS (default: the core count) and checks the import. It needs torch and
# nvcc; it changes nothing in this repository.
set -euo pipefail
src=${1:?usage: build_deep_ep.sh DEEPEP_SOURCE_DIR}
py=${PYTHON:-python3}
[[ -f $src/setup.py ]] || { echo "build_deep_ep: no setup.py in $src" >&2; exit 2; }
if [[ -n ${NVSHMEM_DIR:-} ]]; then
  echo "build_deep_ep: NVSHMEM from NVSHMEM_DIR=$NVSHMEM_DIR"
elif "$py" -c "import nvidia.nvshmem" 2>/dev/null; then
  echo "build_deep_ep: NVSHMEM from the nvidia-nvshmem pip package"
else
  echo "build_deep_ep: no NVSHMEM: DeepEP builds without its low-latency mode" >&2
fi
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-$(nproc)}
(cd "$src" && "$py" -m pip install --no-build-isolation --no-deps --no-index -v . >build_deep_ep.log 2>&1) || {
  tail -30 "$src/build_deep_ep.log" >&2; echo "build_deep_ep: build failed (log: $src/build_deep_ep.log)" >&2; exit 1; }
(cd / && "$py" -c "import deep_ep, sys; print('build_deep_ep: deep_ep', getattr(deep_ep, '__version__', '?'), 'at', deep_ep.__file__)")

#!/usr/bin/env bash
# Builds DeepEP in its source tree, for `ep_bench.py --compare deep_ep`.
#
#   git clone -b v1.2.1 https://github.com/deepseek-ai/DeepEP /path/DeepEP   (where a network is)
#   tools/bench/build_deep_ep.sh /path/DeepEP        # then: export PYTHONPATH=/path/DeepEP:$PYTHONPATH
#
# DeepEP's setup.py takes NVSHMEM from NVSHMEM_DIR or the `nvidia-nvshmem-cu<major>` pip package;
# without either it builds the intranode kernels only (no low-latency mode, so the bench's LL
# comparison fails). This script says which it found and builds the extension in place
# (`setup.py build_ext --inplace`) for sm_90 (TORCH_CUDA_ARCH_LIST, default 9.0) with MAX_JOBS
# (default: the core count), then checks the import from there. CUDA 13 keeps libcu++ under
# include/cccl, which NVSHMEM's headers need in DeepEP's host (g++) unit: it is put on
# CPLUS_INCLUDE_PATH when present. Needs torch and nvcc; changes nothing in this repository.
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
cuda=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
[[ -d $cuda/include/cccl ]] && export CPLUS_INCLUDE_PATH=$cuda/include/cccl${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}
src=$(cd "$src" && pwd)
(cd "$src" && "$py" setup.py build_ext --inplace >build_deep_ep.log 2>&1) || {
  grep -iE -A4 "error" "$src/build_deep_ep.log" | head -40 >&2
  echo "build_deep_ep: build failed (log: $src/build_deep_ep.log)" >&2; exit 1; }
(cd / && PYTHONPATH=$src${PYTHONPATH:+:$PYTHONPATH} "$py" -c "import deep_ep; print('build_deep_ep: deep_ep at', deep_ep.__file__)")
echo "build_deep_ep: to use it: export PYTHONPATH=$src:\$PYTHONPATH"

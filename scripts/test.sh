#!/usr/bin/env bash
# Builds plm and runs the whole test suite on a fresh Debian bookworm machine:
# system packages, configure (build/), build, ctest. Exits with ctest's status.
# Environment: BUILD_DIR (default build), JOBS (default: all cores), CTEST_ARGS (e.g. "-L unit").
set -euo pipefail
cd "$(dirname "$0")/.."

build_dir=${BUILD_DIR:-build}
jobs=${JOBS:-$(nproc)}

bash scripts/setup-debian.sh

# Where the CUDA toolkit is present (CI has nvcc but no GPU), the CUDA sources are compiled too,
# so GPU code cannot rot unnoticed in a CPU-only CI.
cuda_args=()
nvcc=$(command -v nvcc || true)
[ -n "$nvcc" ] || { [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc; }
if [ -n "$nvcc" ] && [ "${PLM_CHECK_CUDA_SOURCES:-ON}" != OFF ]; then
  cuda_args=(-DPLM_CHECK_CUDA_SOURCES=ON -DCMAKE_CUDA_COMPILER="$nvcc")
  # cuDNN's fused attention compiles only with the cuDNN frontend's headers (PyPI wheel); without
  # them the check still compiles everything else.
  bash scripts/get-cudnn-frontend.sh ||
    echo "note: the cuDNN frontend headers could not be installed; cudnn_attention.cu is checked without cuDNN"
  # Likewise CUTLASS's headers (PyPI wheel) for the grouped expert GEMM (moe_grouped_sm90a.cu).
  bash scripts/get-cutlass.sh ||
    echo "note: the CUTLASS headers could not be installed; the grouped expert GEMM is not checked"
fi

echo "== configure ($build_dir)"
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release "${cuda_args[@]}"

echo "== build (-j$jobs)"
cmake --build "$build_dir" -j "$jobs"

echo "== test"
# MPI tests start several ranks per core and may run as root (CI containers).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
cd "$build_dir"
status=0
# shellcheck disable=SC2086
ctest --output-on-failure ${CTEST_ARGS:-} || status=$?
exit $status

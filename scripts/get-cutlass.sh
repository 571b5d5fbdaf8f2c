#!/usr/bin/env bash
# Installs CUTLASS's C++ headers (header-only; NVIDIA's nvidia-cutlass wheel from PyPI, the
# registry plm may use) for plm's SM90 grouped expert GEMM (src/gpu/moe_grouped_sm90.cu).
# Only the wheel's CUTLASS and CuTe headers (cutlass_library/source/include) and the CUTLASS
# util headers (cutlass_library/source/tools/util/include) are kept; nothing of it is copied into
# the repository.
#
# Usage: scripts/get-cutlass.sh [PREFIX]     (default /opt/plm-deps/cutlass)
# Environment: PLM_CUTLASS_VERSION (default 4.2.0), PIP (default: python3 -m pip).
# CMake finds PREFIX/include by itself at the default place; elsewhere set PLM_CUTLASS=PREFIX.
set -euo pipefail
prefix=${1:-/opt/plm-deps/cutlass}
version=${PLM_CUTLASS_VERSION:-4.2.0}
stamp="$prefix/.version"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$version" && -f "$prefix/include/cutlass/cutlass.h" ]]; then
  echo "get-cutlass: $prefix holds CUTLASS $version; nothing to do"
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# shellcheck source=scripts/wheel-headers.sh
source "$(dirname "$0")/wheel-headers.sh"
wheel_extract nvidia-cutlass "$version" "$work" cutlass_library/source/include/ \
  cutlass_library/source/tools/util/include/
src="$work/x/cutlass_library/source"
[[ -f "$src/include/cutlass/cutlass.h" ]] || { echo "get-cutlass: the nvidia-cutlass $version wheel has no cutlass_library/source/include/cutlass/cutlass.h" >&2; exit 1; }
[[ -f "$src/include/cutlass/gemm/group_array_problem_shape.hpp" ]] ||
  { echo "get-cutlass: CUTLASS $version has no grouped-GEMM problem shape (need 3.5 or newer)" >&2; exit 1; }
mkdir -p "$prefix"
rm -rf "$prefix/include"
cp -r "$src/include" "$prefix/include"
# The util headers (cutlass/util/...) share the cutlass/ namespace folder.
if [[ -d "$src/tools/util/include/cutlass" ]]; then
  cp -r "$src/tools/util/include/cutlass/." "$prefix/include/cutlass/"
fi
echo "$version" > "$stamp"
echo "get-cutlass: CUTLASS $version headers in $prefix/include"

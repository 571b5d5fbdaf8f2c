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
pip=${PIP:-python3 -m pip}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
$pip download --quiet --no-deps --only-binary=:all: --dest "$work" "nvidia-cutlass==$version" ||
  $pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 --platform manylinux_2_28_x86_64 \
    --dest "$work" "nvidia-cutlass==$version"
wheel=$(ls "$work"/nvidia_cutlass-*.whl | head -1)
python3 - "$wheel" "$work/x" <<'PY'
import sys, zipfile
keep = ("cutlass_library/source/include/", "cutlass_library/source/tools/util/include/")
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith(keep)])
PY
src="$work/x/cutlass_library/source"
[[ -f "$src/include/cutlass/cutlass.h" ]] || { echo "get-cutlass: $wheel has no cutlass_library/source/include/cutlass/cutlass.h" >&2; exit 1; }
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

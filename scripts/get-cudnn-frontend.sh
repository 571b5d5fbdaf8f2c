#!/usr/bin/env bash
# Installs the cuDNN frontend's C++ headers (header-only; NVIDIA's nvidia-cudnn-frontend wheel
# from PyPI, the registry plm may use) for plm's cuDNN fused attention (src/gpu/cudnn_attention.cu).
# Only the wheel's include/ folder is kept; nothing of it is copied into the repository.
#
# Usage: scripts/get-cudnn-frontend.sh [PREFIX]     (default /opt/plm-deps/cudnn-frontend)
# Environment: PLM_CUDNN_FRONTEND_VERSION (default 1.32.0), PIP (default: python3 -m pip).
# CMake finds PREFIX/include by itself at the default place; elsewhere set PLM_CUDNN_FRONTEND=PREFIX/include.
set -euo pipefail
prefix=${1:-/opt/plm-deps/cudnn-frontend}
version=${PLM_CUDNN_FRONTEND_VERSION:-1.32.0}
stamp="$prefix/.version"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$version" && -f "$prefix/include/cudnn_frontend.h" ]]; then
  echo "get-cudnn-frontend: $prefix holds cudnn-frontend $version; nothing to do"
  exit 0
fi
pip=${PIP:-python3 -m pip}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The wheel is platform-tagged (it also carries Python bindings); any x86_64 build has the same headers.
$pip download --quiet --no-deps --only-binary=:all: --dest "$work" "nvidia-cudnn-frontend==$version" ||
  $pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 --platform manylinux_2_28_x86_64 \
    --dest "$work" "nvidia-cudnn-frontend==$version"
wheel=$(ls "$work"/nvidia_cudnn_frontend-*.whl | head -1)
python3 - "$wheel" "$work/x" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("include/")])
PY
[[ -f "$work/x/include/cudnn_frontend.h" ]] || { echo "get-cudnn-frontend: $wheel has no include/cudnn_frontend.h" >&2; exit 1; }
mkdir -p "$prefix"
rm -rf "$prefix/include"
cp -r "$work/x/include" "$prefix/include"
echo "$version" > "$stamp"
echo "get-cudnn-frontend: cudnn-frontend $version headers in $prefix/include"

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
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# shellcheck source=scripts/wheel-headers.sh
source "$(dirname "$0")/wheel-headers.sh"
# The wheel is platform-tagged (it also carries Python bindings); any x86_64 build has the same headers.
wheel_extract nvidia-cudnn-frontend "$version" "$work" include/
[[ -f "$work/x/include/cudnn_frontend.h" ]] || { echo "get-cudnn-frontend: the nvidia-cudnn-frontend $version wheel has no include/cudnn_frontend.h" >&2; exit 1; }
mkdir -p "$prefix"
rm -rf "$prefix/include"
cp -r "$work/x/include" "$prefix/include"
echo "$version" > "$stamp"
echo "get-cudnn-frontend: cudnn-frontend $version headers in $prefix/include"

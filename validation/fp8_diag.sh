#!/usr/bin/env bash
# FP8 on the GPU, diagnosis: cuBLASLt's own error log (CUBLASLT_LOG_LEVEL=2) for a short
# bench_gpu_train run per preset, and plm train of inputs/cpu_gpu_compare.yaml in fp8.
#   PLM_PKG=... validation/fp8_diag.sh   (logs under $OUT/fp8_diag/)
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
pkg=${PLM_PKG:-$repo/build-cuda/pkg}
out=${OUT:-$repo/out}/fp8_diag
mkdir -p "$out"
export LD_LIBRARY_PATH="$pkg/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
for run in esm2_8m:65536 esm2_650m:16384; do
  IFS=: read -r preset tokens <<< "$run"
  CUBLASLT_LOG_LEVEL=2 PLM_PRECISION=fp8 PLM_FP8_RECIPE=delayed timeout 120 \
    "$pkg/bin/bench_gpu_train" "$preset" "$tokens" 3 none > "$out/bench_$preset.log" 2>&1
  echo "fp8 bench $run rc=$?"; grep -E "RESULT|FP8|error|failed|\[cublasLt\]" "$out/bench_$preset.log" | head -12
done
d=/tmp/plm-fp8-cmp; rm -rf "$d"
CUBLASLT_LOG_LEVEL=2 timeout 120 "$pkg/bin/plm" train "$repo/inputs/cpu_gpu_compare.yaml" \
  --set data.train="$pkg/data/train.h5" --set train.precision=fp8 --set train.steps=20 \
  --set train.run_dir="$d" --set checkpoint.dir="$d/ckpt" > "$out/train_cmp_fp8.log" 2>&1
echo "plm train cpu_gpu_compare fp8 rc=$?"; grep -E "step (1|10|20)/|error|\[cublasLt\]" "$out/train_cmp_fp8.log" | head -12

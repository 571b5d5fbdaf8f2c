#!/usr/bin/env bash
# fp8u device run: the fused-cast tests, then 650M bf16 / fp8 delayed fused / fp8 delayed with
# PLM_FP8_FUSED_CAST=0 side by side (one run each), logs into $OUT.
set -u
mkdir -p /tmp/p && tar -C /tmp/p -xJf .gpu-fp8u/pkg.tar.xz
pkg=/tmp/p/pkg
export LD_LIBRARY_PATH="$pkg/lib:/usr/local/cuda/lib64"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0
s=$OUT/summary.txt
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; echo "commit: $(cat $pkg/COMMIT 2>/dev/null)"; } | tee $s
for t in test_gpu_fp8 test_fp8_gpu_linear test_fp8_training test_gpu_layer_norm; do
  [[ -x $pkg/bin/$t ]] || { echo "$t: not packaged" | tee -a $s; continue; }
  st=$(date +%s); timeout 70 $pkg/bin/$t > $OUT/$t.log 2>&1; rc=$?
  echo "$t rc=$rc $(( $(date +%s) - st ))s $(grep -E '^\[  (PASSED|FAILED)' $OUT/$t.log | tr '\n' ' ')" | tee -a $s
  [[ $rc -ne 0 ]] && grep -E "Failure|Expected|Which is|error|FAILED|normwise|<" $OUT/$t.log | head -30 | tee -a $s
done
for cfg in bf16:delayed:1 fp8:delayed:1 fp8:delayed:0; do
  IFS=: read -r p r f <<< "$cfg"
  log=$OUT/bench_650m_${p}_${r}_fused$f.log
  st=$(date +%s)
  PLM_FP8_FUSED_CAST=$f PLM_PRECISION=$p PLM_FP8_RECIPE=$r timeout 80 $pkg/bin/bench_gpu_train esm2_650m 24576 ${STEPS:-16} none > $log 2>&1
  echo "bench 650m $cfg rc=$? $(( $(date +%s) - st ))s" | tee -a $s
  grep -E "RESULT|FP8|EVAL|breakdown|^    |error|out of memory" $log | tee -a $s
done

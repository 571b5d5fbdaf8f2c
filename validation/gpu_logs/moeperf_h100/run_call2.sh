#!/usr/bin/env bash
# Call 2 of branch moeperf on the lent H100: the MoE GPU tests (1 rank; the expert-parallel ones
# also at 2 ranks on the one GPU over staged MPI), then the 650M-like bench three times,
# ac6e217's binary and this branch's in turn (same machine, same call).  Carried as
# .gpu-moeperf/run.sh next to pkg.tar.xz (bench_gpu_moe_ac6e217 = the bench built at ac6e217).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p /tmp/p && tar -C /tmp/p -xJf "$here/pkg.tar.xz"
export LD_LIBRARY_PATH=/tmp/p/pkg/lib:/usr/local/cuda/lib64 NCCL_NVLS_ENABLE=0
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
B=/tmp/p/pkg/bin
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/info.txt"
for t in test_gpu_moe_grouped test_gpu_moe test_gpu_moe_bf16 test_fp8_moe test_ckpt_moe_expert_parallel; do
  timeout 120 "$B/$t" >> "$OUT/tests.log" 2>&1; echo "$t np1 rc=$?" | tee -a "$OUT/info.txt"
done
for run in "test_ckpt_moe_expert_parallel ExpertParallel.Bf16*:ExpertParallel.Zero*" "test_fp8_moe *"; do
  set -f; set -- $run; set +f
  timeout 120 mpiexec -n 2 --oversubscribe "$B/$1" --gtest_filter="$2" >> "$OUT/tests_np2.log" 2>&1
  echo "$1 np2 rc=$?" | tee -a "$OUT/info.txt"
done
grep -hE "^\[  (PASSED|FAILED)|Failure" "$OUT/tests.log" "$OUT/tests_np2.log" | sort | uniq -c
for i in 1 2 3; do
  timeout 60 "$B/bench_gpu_moe_ac6e217" 0 650M >> "$OUT/bench_base.log" 2>&1; echo "base $i rc=$?"
  timeout 60 "$B/bench_gpu_moe" 0 650M >> "$OUT/bench_new.log" 2>&1; echo "new $i rc=$?"
done
grep -hE "^train|^  auto |backward grouped \(PLM_MOE_GROUPED_TILE=128,256,128\)|bias grad" \
  "$OUT/bench_base.log" "$OUT/bench_new.log"

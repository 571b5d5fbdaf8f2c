#!/usr/bin/env bash
# One device run: everything plm does on a GPU machine, with logs under $OUT.
#   validation/gpu_run.sh [STAGE ...]   stages: info tests bench train hf  (default: all)
# Expects the folder made by scripts/package-cuda.sh at $PLM_PKG (default build-cuda/pkg):
# bin/ (plm, test and benchmark binaries) and lib/ (the shared libraries the GPU machine lacks).
# CUDA, NCCL and OpenMPI come from the machine itself.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
pkg=${PLM_PKG:-$repo/build-cuda/pkg}
out=${OUT:-$repo/out}
mkdir -p "$out"
export LD_LIBRARY_PATH="$pkg/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0
export PYTHONUNBUFFERED=1
stages=("$@")
[[ ${#stages[@]} -eq 0 ]] && stages=(info tests bench train hf)
summary="$out/summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }
has() { local s; for s in "${stages[@]}"; do [[ "$s" == "$1" ]] && return 0; done; return 1; }

if has info; then
  {
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    nvcc --version | tail -1
    echo "commit: $(cat "$pkg/COMMIT" 2>/dev/null || echo unknown)"
  } 2>&1 | tee "$out/info.txt"
  missing=$(for b in "$pkg"/bin/*; do ldd "$b" | grep "not found"; done | sort -u)
  [[ -n "$missing" ]] && note "MISSING LIBRARIES: $missing"
fi

if has tests; then
  for t in "$pkg"/bin/test_*; do
    name=$(basename "$t")
    start=$(date +%s%N)
    timeout 300 "$t" --gtest_brief=0 > "$out/$name.log" 2>&1
    rc=$?
    note "$(printf '%-32s rc=%d  %dms  %s' "$name" "$rc" "$(( ($(date +%s%N) - start) / 1000000 ))" \
      "$(grep -E '^\[  (PASSED|FAILED)' "$out/$name.log" | tr '\n' ' ')")"
    [[ $rc -ne 0 ]] && grep -E "Failure|Expected|Which is|error|rel|FAILED" "$out/$name.log" | head -30 | tee -a "$summary"
  done
fi

if has bench && [[ -x "$pkg/bin/bench_gpu" ]]; then
  timeout 400 "$pkg/bin/bench_gpu" > "$out/bench_gpu.log" 2>&1
  note "bench_gpu rc=$?"
  cat "$out/bench_gpu.log" >> "$summary"
fi

if has train && [[ -x "$pkg/bin/plm" && -f "$repo/validation/gpu_train.sh" ]]; then
  bash "$repo/validation/gpu_train.sh" "$pkg" "$out" >> "$summary" 2>&1
fi

if has hf; then
  timeout 500 python3 "$repo/validation/bench_hf.py" ${PLM_HF_ARGS:-} --out "$out/bench_hf.json" \
    > "$out/bench_hf.log" 2>&1
  note "bench_hf rc=$?"
  tail -20 "$out/bench_hf.log" >> "$summary"
fi
echo "==== summary"; cat "$summary"

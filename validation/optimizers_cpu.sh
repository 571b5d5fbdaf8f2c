#!/usr/bin/env bash
# The optimizer comparison of doc/optimizers.md on the CPU: the quickstart model
# (inputs/quickstart.yaml: 4 layers, hidden 128) trained 1,000 steps on the mmseqs2 proteins with
# each optimizer, one after the other, one rank and one BLAS thread each (a shared machine), then
# validation/plot_optimizers.py draws the loss curves side by side (doc/img/optimizers.png).
#   validation/optimizers_cpu.sh [PLM] [OUT]   (defaults: build/plm, runs/optimizers)
# Steps of 2,048 tokens (one micro-batch) keep the four runs under an hour on one core; every
# run sees the same batches (data.seed) and evaluates the same 32,768 validation tokens.
# Hyper-parameters: AdamW and 8-bit AdamW as the quickstart; Lion with the paper's advice (lr 5x
# smaller, weight decay 5x larger); Adafactor with the given lr and no parameter scaling
# (transformers' recommendation when a learning rate is given).
set -euo pipefail
cd "$(dirname "$0")/.."
plm=${1:-build/plm}
out=${2:-runs/optimizers}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1
[[ -f data/train.h5 ]] || "$plm" prep /usr/share/doc/mmseqs2/example-data/DB.fasta.gz --out data \
  --valid-fraction 0.05
common=(train.steps=1000 data.tokens_per_batch=2048 data.micro_batch_tokens=2048
        schedule.warmup_steps=50 train.log_every=10 train.eval_every=100 checkpoint.every=0
        checkpoint.resume=none)
declare -A extra=(
  [adamw]="optimizer.lr=2.0e-3"
  [adamw8bit]="optimizer.lr=2.0e-3"
  [lion]="optimizer.lr=4.0e-4 optimizer.weight_decay=0.05"
  [adafactor]="optimizer.lr=2.0e-3 optimizer.adafactor_scale_parameter=false"
)
for name in ${OPTIMIZERS:-adamw adamw8bit lion adafactor}; do
  sets=()
  for kv in "${common[@]}" optimizer.name=$name train.run_dir=$out/$name \
            checkpoint.dir=$out/$name/ckpt ${extra[$name]}; do
    sets+=(--set "$kv")
  done
  echo "== $name: ${extra[$name]}"
  mkdir -p "$out"
  "$plm" train inputs/quickstart.yaml "${sets[@]}" > "$out/$name.log" 2>&1
  grep -E "optimizer:|valid loss" "$out/$name.log" | tail -2
done

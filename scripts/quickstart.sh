#!/usr/bin/env bash
# The quickstart: on a fresh Debian bookworm machine, installs what plm needs, builds it,
# prepares the real proteins of Debian's mmseqs2-examples package (20,000 sequences) into data/
# and trains the small model of inputs/quickstart.yaml on the CPU, printing its progress.
# Outputs: data/{train,valid}.h5, run/ (training log, metrics, resolved deck), run/ckpt/.
# Environment: PLM_RANKS=N trains with N MPI ranks (default: 2 where there are 2 cores, one
# rank per core with one BLAS thread each: the fastest layout on a small machine);
# BUILD_DIR (default build), JOBS (default: all cores).
set -euo pipefail
cd "$(dirname "$0")/.."

build_dir=${BUILD_DIR:-build}
jobs=${JOBS:-$(nproc)}
ranks=${PLM_RANKS:-$(( $(nproc) >= 2 ? 2 : 1 ))}
fasta=/usr/share/doc/mmseqs2/example-data/DB.fasta.gz
deck=inputs/quickstart.yaml

say() { printf '\n== quickstart: %s\n' "$*"; }

bash scripts/setup-debian.sh

say "configure and build plm ($build_dir, -j$jobs)"
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release
cmake --build "$build_dir" -j "$jobs" --target plm
plm=("$build_dir/plm")
"${plm[@]}" --version

if [ "$ranks" -gt 1 ]; then
  # Root in containers and 2-core machines: allow both.
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  export OMPI_MCA_rmaps_base_oversubscribe=1
  export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}  # one core per rank
  plm=(mpiexec -n "$ranks" --oversubscribe --bind-to none "$build_dir/plm")
fi

# Runs one plm subcommand; a failure stops the quickstart, naming the step.
step() {
  local what=$1
  local status=0
  "${plm[@]}" "$@" || status=$?
  if [ "$status" -ne 0 ]; then
    say "\`plm $what\` failed (exit status $status); its message is above"
    exit "$status"
  fi
}

if [ -f data/train.h5 ] && [ -f data/valid.h5 ]; then
  say "data/train.h5 and data/valid.h5 exist; reusing them (delete data/ to prepare again)"
else
  say "prepare $fasta -> data/ (5% held out for validation)"
  step prep "$fasta" --out data --valid-fraction 0.05
fi

say "baseline: the untrained model on the validation set (what training must beat)"
step eval "$deck"

say "train $deck on $ranks rank(s) (resumes from run/ckpt if present; delete run/ to restart)"
step train "$deck"

say "validation perplexity by step (run/metrics.jsonl):"
grep -o '"step":[0-9]*,[^}]*"valid_ppl":[0-9.e+-]*' run/metrics.jsonl |
  sed -E 's/"step":([0-9]+),.*"valid_ppl":([0-9.e+-]+)/\1 \2/' |
  while read -r step ppl; do printf '  step %5d: %.2f\n' "$step" "$ppl"; done || true

say "done: training log in run/train.log, metrics in run/metrics.jsonl, resolved deck in run/deck.yaml, checkpoints in run/ckpt/"

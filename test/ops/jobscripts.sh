#!/bin/bash
# jobscripts/pbs-train.sh and slurm-train.sh without PBS or Slurm: qstat answers a 20 s
# walltime, qrerun and scontrol are recorders, srun is replaced by mpiexec (2 ranks).
#  - PBS: with STOP_BEFORE=12 the script's timer stops plm about 8 s in; plm checkpoints and
#    exits 75, the script reruns the job (qrerun <id>) and exits 0.
# The Slurm script is signalled as Slurm would signal it (srun is a fake that passes signals on to
# the tasks as srun does):
#  - SIGUSR1 (the --signal=B:USR1@120 time-limit warning): plm checkpoints and exits 75, the
#    script requeues the job (scontrol requeue <id>) and exits 0;
#  - SIGTERM to the script alone: plm checkpoints and exits 75, the script does not requeue and
#    exits 75;
#  - scancel as Slurm delivers it (SIGTERM to every task, to srun and to the script, whose trap
#    forwards SIGUSR1): the same, with each rank taking the three deliveries as one stop.
#   jobscripts.sh REPO PLM MPIEXEC WORKDIR
set -uo pipefail
repo=$1 plm=$2 mpiexec=$3 work=$4
rm -rf "$work" && mkdir -p "$work/bin"
# The scripts give each rank the GPU of its node-local rank: a CUDA build needs two GPUs here.
if "$plm" --version 2>/dev/null | grep -q "^CUDA: not enabled"; then :; else
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
  if [ "${gpus:-0}" -lt 2 ]; then echo "SKIP: a CUDA build of plm and ${gpus:-0} GPU(s): the job scripts start 2 ranks, one GPU each"; exit 77; fi
fi
# srun: starts the tasks (mpiexec, 2 ranks) and, as Slurm's srun does, passes a signal it
# receives on to every task.
cat > "$work/bin/srun" <<EOS
#!/bin/bash
while [[ \$1 == --* ]]; do shift; done
$mpiexec -n 2 --oversubscribe --bind-to none "\$@" &
launcher=\$!
forward() { kill -\$1 \$(pgrep -P \$launcher) 2>/dev/null; }
trap 'forward TERM' TERM
trap 'forward USR1' USR1
while true; do
  wait \$launcher; rc=\$?
  if [ \$rc -gt 128 ] && kill -0 \$launcher 2>/dev/null; then continue; fi
  exit \$rc
done
EOS
cat > "$work/bin/scontrol" <<EOS
#!/bin/bash
echo "\$@" >> $work/scontrol.calls
EOS
chmod +x "$work/bin/srun" "$work/bin/scontrol"
# A small dataset and deck.
python3 - "$work/seqs.fasta" <<'PY' 2>/dev/null || awk 'BEGIN{srand(7); a="ACDEFGHIKLMNPQRSTVWY"; for(i=0;i<120;i++){printf ">s%d\n",i; n=30+int(rand()*60); s=""; for(k=0;k<n;k++) s=s substr(a,1+int(rand()*20),1); print s}}' > "$work/seqs.fasta"
import random, sys
random.seed(7)
with open(sys.argv[1], "w") as f:
    for i in range(120):
        f.write(f">s{i}\n" + "".join(random.choice("ACDEFGHIKLMNPQRSTVWY") for _ in range(random.randint(30, 90))) + "\n")
PY
"$plm" prep "$work/seqs.fasta" --out "$work/data" --valid-fraction 0 > "$work/prep.log" 2>&1 || { cat "$work/prep.log"; exit 1; }
cat > "$work/deck.yaml" <<EOS
model: {preset: custom, layers: 2, hidden: 32, heads: 4, ffn: 64}
data: {train: $work/data/train.h5, valid: "", tokens_per_batch: 4096, micro_batch_tokens: 1024, max_seq_len: 64, prefetch: 1}
schedule: {warmup_steps: 2}
train: {steps: 100000, log_every: 1, eval_every: 0}
checkpoint: {every: 1000}
EOS
fail=0
# PBS: the script's own walltime timer (qstat says 20 s, STOP_BEFORE 12) sends the stop; qrerun
# is recorded. The job must checkpoint, exit 75 to the script, and the script rerun it.
cat > "$work/bin/qstat" <<EOS
#!/bin/bash
echo "    Resource_List.walltime = 00:00:20"
EOS
cat > "$work/bin/qrerun" <<EOS
#!/bin/bash
echo "qrerun \$@" >> $work/scontrol.calls
EOS
chmod +x "$work/bin/qstat" "$work/bin/qrerun"
hostname > "$work/nodefile"
run=$work/run_pbs
rm -f "$work/scontrol.calls"
start=$(date +%s)
(cd "$work" && PATH="$work/bin:$PATH" PBS_O_WORKDIR="$work" PBS_JOBID=77.pbs PBS_NODEFILE="$work/nodefile" \
   GPUS_PER_NODE=2 STOP_BEFORE=12 PLM="$plm" DECK="$work/deck.yaml" \
   SETS="--set train.run_dir=$run --set checkpoint.dir=$run/ckpt" \
   bash "$repo/jobscripts/pbs-train.sh") > "$work/job_pbs.log" 2>&1
rc=$?
calls=$(cat "$work/scontrol.calls" 2>/dev/null)
echo "PBS timer: script exit $rc after $(( $(date +%s) - start )) s, checkpoints: $(ls "$run/ckpt" 2>/dev/null | tr '\n' ' '), calls: ${calls:-none}"
[ "$rc" -eq 0 ] && [ "$calls" = "qrerun 77.pbs" ] && grep -q "its checkpoint is" "$work/job_pbs.log" || fail=1

# scancel (or a preemption) as Slurm delivers it: SIGTERM to every task directly, to srun (which
# passes it on to every task again) and to the batch script, whose trap forwards SIGUSR1 through
# srun. Each rank gets the one stop three times; it must stop once, with a complete checkpoint.
scancel_like() {
  local script=$1 srun_pid launcher
  srun_pid=$(pgrep -P "$script" | head -1)      # srun, in the script's background
  launcher=$(pgrep -P "$srun_pid" | head -1)    # mpiexec under the fake srun
  kill -TERM $(pgrep -P "$launcher")            # the tasks
  kill -TERM "$srun_pid"
  kill -TERM "$script"
}

for sig in USR1 TERM SCANCEL; do
  run=$work/run_$sig
  rm -f "$work/scontrol.calls"
  (cd "$work" && PATH="$work/bin:$PATH" SLURM_SUBMIT_DIR="$work" SLURM_JOB_ID=4242 SLURM_JOB_NUM_NODES=1 \
     SLURM_NTASKS_PER_NODE=2 SLURM_NTASKS=2 PLM="$plm" \
     exec bash "$repo/jobscripts/slurm-train.sh" "$work/deck.yaml" --set train.run_dir="$run" \
     --set checkpoint.dir="$run/ckpt") > "$work/job_$sig.log" 2>&1 &
  job=$!
  for _ in $(seq 1 600); do
    [ -f "$run/metrics.jsonl" ] && [ "$(grep -c '"kind":"train"' "$run/metrics.jsonl")" -ge 3 ] && break
    sleep 0.1
  done
  if [ "$sig" = SCANCEL ]; then scancel_like "$job"; else kill -"$sig" "$job"; fi
  wait "$job"; rc=$?
  steps=$(ls "$run/ckpt" 2>/dev/null | tr '\n' ' ')
  calls=$(cat "$work/scontrol.calls" 2>/dev/null)
  echo "SIG$sig: script exit $rc, checkpoints: $steps, scontrol: ${calls:-none}"
  if [ "$sig" = USR1 ]; then
    [ "$rc" -eq 0 ] && [ "$calls" = "requeue 4242" ] || fail=1
  else
    [ "$rc" -eq 75 ] && [ -z "$calls" ] || fail=1
  fi
  grep -q "its checkpoint is" "$work/job_$sig.log" || fail=1
  # A complete checkpoint (renamed from its .tmp only when written), no .tmp left, no exit at once.
  ls "$run/ckpt" 2>/dev/null | grep -q '^step_[0-9]*\.h5$' || fail=1
  ! ls "$run/ckpt" 2>/dev/null | grep -q 'tmp' || fail=1
  ! grep -q "second stop signal" "$work/job_$sig.log" || fail=1
done
[ "$fail" -eq 0 ] || { echo "FAILED"; for f in "$work"/job_*.log; do echo "== $f"; tail -n 30 "$f"; done; }
exit "$fail"

#!/bin/bash
# plm train on N nodes x G GPUs under Slurm: one MPI rank per GPU, each rank sees only its own
# GPU (CUDA_VISIBLE_DEVICES from its node-local rank). Gradients are averaged with NCCL.
#
#   sbatch --nodes=4 --ntasks-per-node=4 --gpus-per-node=4 jobscripts/slurm-train.sh \
#          inputs/esm2_650m.yaml --set train.steps=100000
#
# Arguments: the deck, then any `--set section.key=value` overrides. The run directory is the
# deck's train.run_dir (runs/esm2_650m for inputs/esm2_650m.yaml); a resubmitted job resumes from
# its newest checkpoint (checkpoint.resume: auto).
#
# Preemption and wall time (doc/operations.md): Slurm sends SIGUSR1 to this script 120 s before
# the time limit (--signal=B:USR1@120); a scancel or a preemption sends SIGTERM. Either is passed
# on to the ranks as SIGUSR1: they finish the current step, write a checkpoint and exit with
# status 75. After the time-limit signal the script then requeues the job (scontrol requeue),
# which resumes from that checkpoint; after a SIGTERM it does not (a scancel means stop; a
# preemption with PreemptMode=REQUEUE is requeued by Slurm itself). Raise the 120 s if a step
# plus a checkpoint save takes longer.
#SBATCH --job-name=plm-train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4          # = GPUs per node: one rank per GPU
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=16           # cores per rank: data loading and host work
#SBATCH --time=24:00:00
#SBATCH --output=plm-train-%j.out
#SBATCH --open-mode=append           # a requeued job appends to the same log
#SBATCH --signal=B:USR1@120          # SIGUSR1 to this script 120 s before the time limit
#SBATCH --requeue
set -euo pipefail

deck=${1:?usage: sbatch jobscripts/slurm-train.sh DECK [--set section.key=value]...}
shift
# The CUDA build (cmake --preset cuda, doc/gpu.md), not build/plm, the CPU build: on GPU nodes
# that one would run on the CPU (it warns at start that the GPUs are visible and left idle).
plm=${PLM:-$SLURM_SUBMIT_DIR/build-cuda/plm}
[ -x "$plm" ] || { echo "plm-train: $plm is not there: build it with cmake --preset cuda, or set PLM" >&2; exit 1; }

# Site modules: add what your site needs to find the CUDA, MPI and HDF5 runtime plm was built
# with (nothing is needed for the relocatable package of scripts/package-cuda.sh; the container
# of jobscripts/apptainer-train.sh brings its own), e.g.
#   module load cuda/13.0 openmpi/4.1 hdf5/1.14-parallel

# NVLink multicast (NVLS) stays off: plm's all-reduces do not need it, and on shared hosts a
# program that uses it can take the GPUs out of service for everyone.
export NCCL_NVLS_ENABLE=0
# Host threads per rank (Kokkos host space, OpenBLAS) match the cores Slurm gave the rank.
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
export OPENBLAS_NUM_THREADS=1

cd "$SLURM_SUBMIT_DIR"
echo "plm: $SLURM_JOB_NUM_NODES nodes x $SLURM_NTASKS_PER_NODE GPUs = $SLURM_NTASKS ranks, deck $deck"
"$plm" --version

# srun starts one task per GPU; each task keeps only the GPU of its node-local rank. It runs in
# the background so that this script can pass signals on while it waits. Since Slurm 22.05 srun
# no longer inherits the job's --cpus-per-task: it is passed on explicitly.
srun --kill-on-bad-exit=1 --cpu-bind=cores ${SLURM_CPUS_PER_TASK:+--cpus-per-task=$SLURM_CPUS_PER_TASK} \
  bash -c 'export CUDA_VISIBLE_DEVICES=$SLURM_LOCALID; exec "$@"' plm-rank \
  "$plm" train "$deck" "$@" &
step=$!
requeue=0
forward() { echo "plm-train: $1 received; asking plm to checkpoint and stop"; kill -USR1 "$step" 2>/dev/null || true; }
trap 'requeue=1; forward SIGUSR1' USR1
# A scancel or preemption signals every task (and srun) as well: plm takes the repeats of one
# stop as one stop (doc/operations.md), so this forward is harmless there and covers a SIGTERM
# sent to this script alone.
trap 'forward SIGTERM' TERM
# `wait` returns early (status > 128) when a trapped signal arrives: wait again until srun ends.
set +e
while true; do
  wait "$step"; rc=$?
  if [ "$rc" -gt 128 ] && kill -0 "$step" 2>/dev/null; then continue; fi
  break
done
set -e
requeue_status=75   # plm train: stopped on a signal with a checkpoint written
if [ "$rc" -eq "$requeue_status" ] && [ "$requeue" -eq 1 ]; then
  echo "plm-train: plm checkpointed and stopped (status 75); requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
[ "$rc" -eq "$requeue_status" ] && echo "plm-train: plm checkpointed and stopped; resubmit to continue"
exit "$rc"

#!/bin/bash
# plm train from the Apptainer image of jobscripts/plm.def on N nodes x G GPUs under Slurm: the
# same job as jobscripts/slurm-train.sh (one rank per GPU, the stop, checkpoint and requeue on
# the time limit or a scancel), with plm run from the image instead of a build on the host.
#
#   apptainer build plm.sif jobscripts/plm.def
#   sbatch --nodes=4 --ntasks-per-node=4 --gpus-per-node=4 jobscripts/apptainer-train.sh \
#          plm.sif inputs/esm2_650m.yaml --set train.steps=100000
#
# Arguments: the image, the deck, then any `--set section.key=value` overrides. srun starts each
# rank as `apptainer exec --nv plm.sif plm train ...` (jobscripts/apptainer-plm); the image's
# Open MPI 4.1 wires up through Slurm's PMIx (SLURM_MPI_TYPE, default pmix here: check
# `srun --mpi=list`). PLM_APPTAINER_ARGS adds apptainer options (e.g. "--bind /scratch").
#
# With Enroot and the pyxis plugin instead: `enroot import` an image with plm on PATH, then run
# slurm-train.sh's srun line with `--container-image=IMAGE --container-mounts=$PWD` and PLM=plm.
#SBATCH --job-name=plm-train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4          # = GPUs per node: one rank per GPU
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=16           # cores per rank: data loading and host work
#SBATCH --time=24:00:00
#SBATCH --output=plm-train-%j.out
#SBATCH --open-mode=append           # a requeued job appends to the same log
#SBATCH --signal=B:USR1@120          # SIGUSR1 to the script 120 s before the time limit
#SBATCH --requeue
set -euo pipefail

sif=${1:?usage: sbatch jobscripts/apptainer-train.sh IMAGE.sif DECK [--set section.key=value]...}
shift
cd "$SLURM_SUBMIT_DIR"
[ -f "$sif" ] || { echo "plm-train: image $sif is not there: build it with apptainer build $sif jobscripts/plm.def" >&2; exit 1; }
PLM_SIF=$(realpath "$sif")
export PLM_SIF
export PLM="$SLURM_SUBMIT_DIR/jobscripts/apptainer-plm"
export SLURM_MPI_TYPE=${SLURM_MPI_TYPE:-pmix}
# slurm-train.sh runs in this process (exec), so Slurm's signals reach its traps.
exec bash "$SLURM_SUBMIT_DIR/jobscripts/slurm-train.sh" "$@"

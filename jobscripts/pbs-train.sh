#!/bin/bash
# plm train on N nodes x G GPUs under PBS Pro: one MPI rank per GPU, each rank sees only its own
# GPU (CUDA_VISIBLE_DEVICES from its node-local rank). Gradients are averaged with NCCL.
#
#   qsub -l select=4:ncpus=64:ngpus=4:mpiprocs=4 -v DECK=inputs/esm2_650m.yaml jobscripts/pbs-train.sh
#
# Variables: DECK (required), SETS (optional overrides, e.g. "--set train.steps=100000"),
# PLM (the plm executable, default build/plm under the submit directory). The run directory is
# the deck's train.run_dir; a resubmitted job resumes from its newest checkpoint.
#PBS -N plm-train
#PBS -l select=2:ncpus=64:ngpus=4:mpiprocs=4
#PBS -l walltime=24:00:00
#PBS -j oe
set -euo pipefail

cd "$PBS_O_WORKDIR"
deck=${DECK:?qsub -v DECK=inputs/<deck>.yaml jobscripts/pbs-train.sh}
plm=${PLM:-$PBS_O_WORKDIR/build/plm}   # a CUDA build of plm
gpus_per_node=${GPUS_PER_NODE:-4}      # must equal mpiprocs in the select line

nodes=$(sort -u "$PBS_NODEFILE" | wc -l)
ranks=$((nodes * gpus_per_node))

# NVLink multicast (NVLS) stays off: plm's all-reduces do not need it, and on shared hosts a
# program that uses it can take the GPUs out of service for everyone.
export NCCL_NVLS_ENABLE=0
export OPENBLAS_NUM_THREADS=1

echo "plm: $nodes nodes x $gpus_per_node GPUs = $ranks ranks, deck $deck"
"$plm" --version

# OpenMPI: -x exports the variables to every rank; each rank picks the GPU of its node-local
# rank (OMPI_COMM_WORLD_LOCAL_RANK). With another MPI, use its local-rank variable
# (MPI_LOCALRANKID for MPICH/Cray PALS, PMI_LOCAL_RANK, ...).
# shellcheck disable=SC2086
mpiexec -n "$ranks" --map-by ppr:"$gpus_per_node":node --bind-to none \
  -x NCCL_NVLS_ENABLE -x OPENBLAS_NUM_THREADS -x PATH -x LD_LIBRARY_PATH \
  bash -c 'export CUDA_VISIBLE_DEVICES=${OMPI_COMM_WORLD_LOCAL_RANK:-${MPI_LOCALRANKID:-${PMI_LOCAL_RANK:-0}}}; exec "$@"' plm-rank \
  "$plm" train "$deck" ${SETS:-}

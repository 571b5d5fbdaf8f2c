#!/bin/bash
# plm train on N nodes x G GPUs under PBS Pro: one MPI rank per GPU, each rank sees only its own
# GPU (CUDA_VISIBLE_DEVICES from its node-local rank). Gradients are averaged with NCCL.
#
#   qsub -l select=4:ncpus=64:ngpus=4:mpiprocs=4 -v DECK=inputs/esm2_650m.yaml jobscripts/pbs-train.sh
#
# Variables: DECK (required), SETS (optional overrides, e.g. "--set train.steps=100000"),
# PLM (the plm executable, default build-cuda/plm under the submit directory: the CUDA build of
# `cmake --preset cuda`, doc/gpu.md). The run directory is the deck's train.run_dir; a
# resubmitted job resumes from its newest checkpoint. -V passes the submitting shell's
# environment (PATH, LD_LIBRARY_PATH, loaded modules) to the job.
#
# MPI: any mpiexec. The script asks `mpiexec --version` which one it is and uses that one's
# options for ranks per node and exported variables: Open MPI (--map-by ppr:G:node, -x), MPICH,
# Intel MPI and MVAPICH's Hydra (-ppn G, -genvall); any other gets the MPI standard's `-n` only
# (it places ranks by the select line's mpiprocs) plus MPIEXEC_ARGS, e.g. MPIEXEC_ARGS="--ppn 4"
# for Cray PALS. MPI_FLAVOUR=openmpi|hydra|other skips the detection; MPIEXEC names another
# launcher (default mpiexec).
#
# Preemption and wall time (doc/operations.md): PBS sends SIGTERM, then SIGKILL kill_delay
# seconds later (often only 10 s), so this script does not wait for it: STOP_BEFORE seconds
# (default 300) before the walltime it sends the ranks SIGUSR1 itself; a qdel or preemption's
# SIGTERM is passed on the same way. The ranks finish the step, write a checkpoint and exit with
# status 75. After the walltime timer's signal the script then reruns the job (qrerun; where
# users may not qrerun, it submits the same job again with qsub), which resumes from that
# checkpoint; after a SIGTERM it does not (a qdel means stop).
#PBS -N plm-train
#PBS -l select=2:ncpus=64:ngpus=4:mpiprocs=4
#PBS -l walltime=24:00:00
#PBS -j oe
#PBS -V
set -euo pipefail

cd "$PBS_O_WORKDIR"
deck=${DECK:?qsub -v DECK=inputs/<deck>.yaml jobscripts/pbs-train.sh}
# The CUDA build, not build/plm (the CPU build would leave the GPUs idle; it warns if it sees them).
plm=${PLM:-$PBS_O_WORKDIR/build-cuda/plm}
[ -x "$plm" ] || { echo "plm-train: $plm is not there: build it with cmake --preset cuda, or set PLM" >&2; exit 1; }
gpus_per_node=${GPUS_PER_NODE:-4}      # must equal mpiprocs in the select line

# Site modules: add what your site needs to find the CUDA, MPI and HDF5 runtime plm was built
# with (nothing for the relocatable package of scripts/package-cuda.sh), e.g.
#   module load cuda/13.0 openmpi/4.1 hdf5/1.14-parallel

nodes=$(sort -u "$PBS_NODEFILE" | wc -l)
ranks=$((nodes * gpus_per_node))

# NVLink multicast (NVLS) stays off: plm's all-reduces do not need it, and on shared hosts a
# program that uses it can take the GPUs out of service for everyone.
export NCCL_NVLS_ENABLE=0
export OPENBLAS_NUM_THREADS=1

echo "plm: $nodes nodes x $gpus_per_node GPUs = $ranks ranks, deck $deck"
"$plm" --version

# Which MPI launches: each has its own options for ranks per node and for passing variables on.
mpiexec=${MPIEXEC:-mpiexec}
flavour=${MPI_FLAVOUR:-}
if [ -z "$flavour" ]; then
  case "$("$mpiexec" --version 2>&1 | head -n 20)" in
    *"Open MPI"* | *OpenRTE* | *"Open RTE"* | *PRRTE*) flavour=openmpi ;;
    *HYDRA* | *Hydra* | *"Intel(R) MPI"* | *MPICH*) flavour=hydra ;;
    *) flavour=other ;;
  esac
fi
case "$flavour" in
  # Open MPI exports only what -x names to the ranks of other nodes.
  openmpi) launch=(-n "$ranks" --map-by "ppr:$gpus_per_node:node" --bind-to none
                   -x NCCL_NVLS_ENABLE -x OPENBLAS_NUM_THREADS -x PATH -x LD_LIBRARY_PATH) ;;
  hydra) launch=(-n "$ranks" -ppn "$gpus_per_node" -genvall) ;;
  other) launch=(-n "$ranks") ;;
  *) echo "plm-train: MPI_FLAVOUR=$flavour: use openmpi, hydra or other" >&2; exit 1 ;;
esac
echo "plm-train: launching with $mpiexec ($flavour MPI)"
# Each rank picks the GPU of its node-local rank, from whichever variable its MPI sets. Open MPI
# and Hydra's mpiexec pass SIGUSR1 on to every rank (a SIGTERM they would turn into a kill).
# shellcheck disable=SC2086
"$mpiexec" "${launch[@]}" ${MPIEXEC_ARGS:-} \
  bash -c 'export CUDA_VISIBLE_DEVICES=${OMPI_COMM_WORLD_LOCAL_RANK:-${MPI_LOCALRANKID:-${PALS_LOCAL_RANKID:-${PMI_LOCAL_RANK:-${MV2_COMM_WORLD_LOCAL_RANK:-0}}}}}; exec "$@"' plm-rank \
  "$plm" train "$deck" ${SETS:-} &
job=$!
forward() { echo "plm-train: $1; asking plm to checkpoint and stop"; kill -USR1 "$job" 2>/dev/null || true; }
rerun=0
# A qdel may signal the ranks on this node directly too: plm takes the repeats of one stop as
# one stop (doc/operations.md).
trap 'forward "SIGTERM received"' TERM
trap 'rerun=1; forward "SIGUSR1 received"' USR1
# The walltime in seconds (qstat's hh:mm:ss), minus STOP_BEFORE: then the timer asks for a stop.
stop_before=${STOP_BEFORE:-300}
walltime=$(qstat -f "$PBS_JOBID" 2>/dev/null | sed -n 's/.*Resource_List.walltime = //p' | head -1)
if [ -n "$walltime" ]; then
  IFS=: read -r h m s <<< "$walltime"
  stop_at=$(( 10#$h * 3600 + 10#$m * 60 + 10#$s - stop_before ))
  if [ "$stop_at" -gt 0 ]; then
    # The timer signals this script, which marks the rerun and passes the signal on.
    ( sleep "$stop_at" && echo "plm-train: $stop_before s to the walltime" && kill -USR1 $$ ) &
    timer=$!
  fi
fi
set +e
while true; do
  wait "$job"; rc=$?
  if [ "$rc" -gt 128 ] && kill -0 "$job" 2>/dev/null; then continue; fi
  break
done
set -e
[ -n "${timer:-}" ] && kill "$timer" 2>/dev/null || true
requeue_status=75   # plm train: stopped on a signal with a checkpoint written
if [ "$rc" -eq "$requeue_status" ] && [ "$rerun" -eq 1 ]; then
  echo "plm-train: plm checkpointed and stopped (status 75); rerunning job $PBS_JOBID"
  qrerun "$PBS_JOBID" || qsub -V -v "DECK=$deck,SETS=${SETS:-},PLM=$plm" "$PBS_O_WORKDIR/jobscripts/pbs-train.sh"
  exit 0
fi
[ "$rc" -eq "$requeue_status" ] && echo "plm-train: plm checkpointed and stopped; resubmit to continue"
exit "$rc"

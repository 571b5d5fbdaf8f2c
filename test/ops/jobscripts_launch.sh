#!/bin/bash
# The job scripts' launch lines without a batch system, an MPI or a GPU: fake mpiexec, srun,
# apptainer and plm record what they are given.
#  - pbs-train.sh picks its mpiexec options from `mpiexec --version`: Open MPI (--map-by, -x),
#    Hydra (-ppn, -genvall, no Open MPI flag), any other MPI (-n and MPIEXEC_ARGS only);
#  - slurm-train.sh passes the job's --cpus-per-task on to srun (Slurm >= 22.05);
#  - apptainer-train.sh runs slurm-train.sh with each rank as `apptainer exec --nv IMAGE plm
#    train DECK ...`, the rank's GPU chosen from SLURM_LOCALID, PMIx as srun's MPI type.
#   jobscripts_launch.sh REPO WORKDIR
set -uo pipefail
repo=$1 work=$2
rm -rf "$work" && mkdir -p "$work/bin"
fail=0
check() {  # check NAME FILE [+PATTERN | -PATTERN]...  (fixed strings that must / must not occur)
  local name=$1 file=$2 ok=1
  shift 2
  for p in "$@"; do
    if [[ $p == +* ]]; then grep -qF -- "${p:1}" "$file" || { echo "$name: missing '${p:1}'"; ok=0; }
    else grep -qF -- "${p:1}" "$file" && { echo "$name: unexpected '${p:1}'"; ok=0; }
    fi
  done
  if [ "$ok" -eq 1 ]; then echo "$name: ok"; else echo "== $file"; cat "$file"; fail=1; fi
}
cat > "$work/bin/plm" <<'EOS'
#!/bin/bash
[ "$1" = --version ] && { echo "plm 0.0.0 (fake)"; exit 0; }
echo "plm $* CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-unset}" >> "$CALLS"
EOS
# mpiexec: answers --version as MPI_VERSION_TEXT says, records the launch line, runs nothing.
cat > "$work/bin/mpiexec" <<'EOS'
#!/bin/bash
[ "$1" = --version ] && { echo "$MPI_VERSION_TEXT"; exit 0; }
echo "mpiexec $*" >> "$CALLS"
printf '%s\0' "$@" > "$CALLS.argv"
EOS
# srun: records its line, then runs the command as node-local task 1 (options dropped).
cat > "$work/bin/srun" <<'EOS'
#!/bin/bash
echo "srun $* SLURM_MPI_TYPE=${SLURM_MPI_TYPE:-unset}" >> "$CALLS"
while [[ $1 == --* ]]; do shift; done
SLURM_LOCALID=1 exec "$@"
EOS
cat > "$work/bin/apptainer" <<'EOS'
#!/bin/bash
echo "apptainer $* CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-unset}" >> "$CALLS"
EOS
printf '#!/bin/bash\n' > "$work/bin/qstat"
chmod +x "$work/bin"/*
printf 'node1\nnode1\nnode2\nnode2\n' > "$work/nodefile"
: > "$work/deck.yaml"

pbs() {  # pbs NAME VERSION_TEXT [VAR=VALUE]...
  local name=$1 text=$2
  shift 2
  (cd "$work" && env PATH="$work/bin:$PATH" CALLS="$work/$name.calls" MPI_VERSION_TEXT="$text" \
     PBS_O_WORKDIR="$work" PBS_JOBID=1.pbs PBS_NODEFILE="$work/nodefile" GPUS_PER_NODE=4 \
     PLM="$work/bin/plm" DECK="$work/deck.yaml" SETS="--set train.steps=5" "$@" \
     bash "$repo/jobscripts/pbs-train.sh") > "$work/$name.log" 2>&1 ||
    { echo "$name: the script failed"; cat "$work/$name.log"; fail=1; }
}
pbs pbs_openmpi "mpiexec (Open MPI) 5.0.3"
check pbs_openmpi "$work/pbs_openmpi.calls" "+-n 8 --map-by ppr:4:node --bind-to none" \
  "+-x NCCL_NVLS_ENABLE" "+-x LD_LIBRARY_PATH" "+train $work/deck.yaml --set train.steps=5"
pbs pbs_hydra "HYDRA build details:
    Version:                                 4.1.2"
check pbs_hydra "$work/pbs_hydra.calls" "+-n 8 -ppn 4 -genvall bash -c" "+train $work/deck.yaml" \
  "--map-by" "--bind-to" "--x "
pbs pbs_intel "Intel(R) MPI Library for Linux* OS, Version 2021.10"
check pbs_intel "$work/pbs_intel.calls" "+-n 8 -ppn 4 -genvall" "--map-by"
pbs pbs_other "mpiexec version 1.2.12" MPIEXEC_ARGS="--ppn 4 --depth 16"
check pbs_other "$work/pbs_other.calls" "+mpiexec -n 8 --ppn 4 --depth 16 bash -c" "--map-by" "--x " \
  "--genvall"
pbs pbs_forced "mpiexec (Open MPI) 4.1.6" MPI_FLAVOUR=hydra
check pbs_forced "$work/pbs_forced.calls" "+-ppn 4" "--map-by"
# The rank's GPU comes from the local-rank variable of whichever MPI started it: the launched
# command (after mpiexec's options) run as that MPI's node-local rank 3.
mapfile -d '' argv < "$work/pbs_hydra.calls.argv"
for ((i = 0; i < ${#argv[@]}; i++)); do [ "${argv[i]}" = bash ] && break; done
for v in OMPI_COMM_WORLD_LOCAL_RANK MPI_LOCALRANKID PALS_LOCAL_RANKID PMI_LOCAL_RANK MV2_COMM_WORLD_LOCAL_RANK; do
  rm -f "$work/rank.calls"
  env CALLS="$work/rank.calls" "$v=3" "${argv[@]:i}"
  check "local rank from $v" "$work/rank.calls" "+CUDA_VISIBLE_DEVICES=3"
done

slurm_env=(SLURM_SUBMIT_DIR="$work" SLURM_JOB_ID=9 SLURM_JOB_NUM_NODES=2 SLURM_NTASKS_PER_NODE=4
           SLURM_NTASKS=8 SLURM_CPUS_PER_TASK=16)
(cd "$work" && env PATH="$work/bin:$PATH" CALLS="$work/slurm.calls" "${slurm_env[@]}" PLM="$work/bin/plm" \
   bash "$repo/jobscripts/slurm-train.sh" "$work/deck.yaml" --set train.steps=5) > "$work/slurm.log" 2>&1 ||
  { echo "slurm: the script failed"; cat "$work/slurm.log"; fail=1; }
check slurm "$work/slurm.calls" "+--cpus-per-task=16" "+plm train $work/deck.yaml --set train.steps=5 CUDA_VISIBLE_DEVICES=1"

mkdir -p "$work/jobscripts"
cp "$repo/jobscripts/slurm-train.sh" "$repo/jobscripts/apptainer-plm" "$work/jobscripts/"
touch "$work/plm.sif"
(cd "$work" && env PATH="$work/bin:$PATH" CALLS="$work/apptainer.calls" "${slurm_env[@]}" \
   PLM_APPTAINER_ARGS="--bind /scratch" bash "$repo/jobscripts/apptainer-train.sh" plm.sif \
   "$work/deck.yaml" --set train.steps=5) > "$work/apptainer.log" 2>&1 ||
  { echo "apptainer: the script failed"; cat "$work/apptainer.log"; fail=1; }
check apptainer "$work/apptainer.calls" "+--cpus-per-task=16" "+SLURM_MPI_TYPE=pmix" \
  "+apptainer exec --nv --bind /scratch $work/plm.sif plm train $work/deck.yaml --set train.steps=5 CUDA_VISIBLE_DEVICES=1"
(cd "$work" && env PATH="$work/bin:$PATH" CALLS="$work/missing.calls" "${slurm_env[@]}" \
   bash "$repo/jobscripts/apptainer-train.sh" nothere.sif "$work/deck.yaml") > "$work/missing.log" 2>&1
rc=$?
if [ "$rc" -ne 0 ] && grep -q "image nothere.sif is not there" "$work/missing.log"; then echo "missing image: ok"
else echo "missing image: exit $rc"; cat "$work/missing.log"; fail=1; fi
# The image definition: its %post script parses, and every file it copies in exists.
awk '/^%post/{on=1; next} /^%/{on=0} on' "$repo/jobscripts/plm.def" > "$work/post.sh"
if [ -s "$work/post.sh" ] && bash -n "$work/post.sh"; then echo "plm.def %post: ok"
else echo "plm.def %post: missing or does not parse"; fail=1; fi
while read -r src _; do
  [ "$src" = .git ] && continue  # a clone has it, a source archive may not
  [ -e "$repo/$src" ] || { echo "plm.def %files: $src is not in the repository"; fail=1; }
done < <(awk '/^%files/{on=1; next} /^%/{on=0} on && NF' "$repo/jobscripts/plm.def")
[ "$fail" -eq 0 ] && echo "all launch lines as expected"
exit "$fail"

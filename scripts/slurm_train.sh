#!/bin/bash
# train.py --dp on several machines under Slurm (docs/data_parallel.md, "Multi-node"): one
# torchrun agent per node, each starting one process per GPU; the agents meet at the first
# node of the allocation (torchrun's c10d rendezvous) and the ranks train as one job, as
# `torchrun --standalone` does on one machine. As torchtitan's multinode_trainer.slurm
# and picotron's Slurm template launch theirs.
#
#   sbatch scripts/slurm_train.sh                          # from the repo root
#   sbatch --nodes 4 scripts/slurm_train.sh --dp zero3 --preset small --steps 2000
#
# Arguments after the script's name go to train.py, after the defaults below (argparse:
# the last one given wins). The repo and --ckpt must be on a filesystem every node sees:
# each rank writes its shard under --ckpt's folder, and a --resume reads all of them.
#
#SBATCH --job-name=nanoscale           # the name squeue shows
#SBATCH --nodes=2                      # machines; --nnodes below follows it
#SBATCH --ntasks-per-node=1            # one task per node: the torchrun agent, not a rank
#SBATCH --gpus-per-node=8              # GPUs per node: torchrun starts one rank per GPU
#SBATCH --cpus-per-task=16             # the agent's CPUs, shared by its ranks (data, gloo)
#SBATCH --time=01:00:00                # wall-clock limit: the job is killed after it
#SBATCH --output=%x-%j.out             # the log: job name and id (%x, %j), in the submit folder
set -euo pipefail                      # stop at the first failing command or unset variable

# The repo: sbatch runs a copy of this file from a spool folder, so not "$(dirname "$0")";
# SLURM_SUBMIT_DIR is the folder sbatch was called from (the repo root, on the shared disk).
REPO="${SLURM_SUBMIT_DIR:-$PWD}"
# The rendezvous host: the allocation's first node (scontrol expands "gpu[01-02]" into one
# name a line). Its agent hosts the store the others connect to; any free port will do.
MASTER=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT="${MASTER_PORT:-29500}"
# Ranks per node: the GPUs Slurm gave this node (NPROC_PER_NODE overrides, e.g. on CPUs).
NPROC_PER_NODE="${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}"
# One thread per rank for CPU-side work: 8 ranks each spinning 16 OpenMP threads on 16
# cores only fight (torchrun sets the same default when it starts more than one rank).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

# srun starts torchrun once per node (--ntasks-per-node=1), all at once:
#   --cpus-per-task     repeated: Slurm 22.05 to 23.02 do not pass sbatch's on to srun, and
#                       the agent and all its ranks would share one CPU
#   --kill-on-bad-exit  one node's agent fails: end the others too, not let them wait
#                       in a collective until --timeout
# and torchrun's flags:
#   --nnodes          the node count the rendezvous waits for (the allocation's)
#   --nproc-per-node  ranks this agent starts; RANK = the node's place x it + LOCAL_RANK
#   --rdzv-backend    c10d: the agents meet in a TCP store on $MASTER and agree on who is
#                     which node, so no node needs its own --node-rank
#   --rdzv-endpoint   where that store listens
#   --rdzv-id         the job's id: the run id every checkpoint records, so a restart
#                     (--max-restarts) resumes only a save of this job, never an older one
#   --max-restarts 0  a failed rank ends the job (raise it to restart from the last save)
srun --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" --kill-on-bad-exit=1 torchrun \
    --nnodes "$SLURM_NNODES" \
    --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$MASTER:$MASTER_PORT" \
    --rdzv-id "$SLURM_JOB_ID" \
    --max-restarts 0 \
    "$REPO/train.py" --dp zero2 --ckpt "$REPO/out/ckpt.pt" "$@"

#!/bin/bash
# Colonnade on a Slurm cluster: one `colonnade train` launcher per node, one rank per GPU.
#
#   sbatch examples/slurm.sh configs/llama2-7b.toml --parallel.tp=8 --parallel.pp=2
#
# Each launcher starts its node's ranks through torch's elastic agent (static rendezvous at
# node 0). Failures: a rank that dies or raises makes its launcher stop the node's other ranks
# and exit 1 with a report naming the rank, the collective and the dump files; srun
# --kill-on-bad-exit then ends the other nodes, whose ranks would otherwise fail on their own
# after parallel.timeout_s. Recovery is Slurm's requeue: the next run resumes from the latest
# checkpoint (checkpoint.load is set to the checkpoint root once it has a `latest` marker).
# Within-node restarts (--max-restarts) are for single-node jobs; across nodes use requeue.
#
#SBATCH --job-name=colonnade
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --output=slurm-%x-%j.out

set -euo pipefail

CONFIG=${1:?usage: sbatch examples/slurm.sh CONFIG.toml [--section.field=value ...]}
shift
GPUS_PER_NODE=${SLURM_GPUS_ON_NODE:-8}
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}
# Both directories must be on a filesystem every node sees: checkpoints, and the run directory
# where every rank keeps its heartbeat and failure dump (logging.dir/heartbeat, /failures).
CKPT=${CKPT:-checkpoints/$SLURM_JOB_NAME}
RUN_DIR=${RUN_DIR:-runs/$SLURM_JOB_NAME}

RESUME=()
if [ -f "$CKPT/latest" ]; then
    RESUME=(--checkpoint.load="$CKPT")  # requeued: continue from the last committed step
fi

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

# SLURM_NODEID differs per node, so it is read inside the task (single quotes).
srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c '
    exec colonnade train --config "$0" \
        --nproc "$1" --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" \
        --rdzv-endpoint "$2" "${@:3}"
' "$CONFIG" "$GPUS_PER_NODE" "$MASTER_ADDR:$MASTER_PORT" \
    --checkpoint.save="$CKPT" --checkpoint.interval=500 \
    --logging.dir="$RUN_DIR" --parallel.timeout_s=600 \
    "${RESUME[@]}" "$@"

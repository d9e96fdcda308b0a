#!/usr/bin/env bash
# Submit the server and the learner as two jobs that find each other through a shared run folder:
#   TANDEM_API_TOKEN=$(openssl rand -hex 16) deploy/slurm/launch.sh runs/run1 [deploy/configs/gpu-2x-split.toml]
# More rollout servers (a job array, each generating its shard of the prompts): TANDEM_NUM_SERVERS=4.
# A learner across nodes: TANDEM_LEARNER_NODES=2 TANDEM_GPUS_PER_NODE=4 (torchrun rendezvous; the learner
# derives its accumulation from prompts_per_step x group_size / (micro_batch_size x nodes x GPUs)).
set -euo pipefail
run_dir=$(realpath -m "${1:?usage: launch.sh RUN_DIR [CONFIG]}")
config=${2:-deploy/configs/gpu-2x-split.toml}
: "${TANDEM_API_TOKEN:?set TANDEM_API_TOKEN to a random secret}"
mkdir -p "$run_dir"
export TANDEM_RUN_DIR=$run_dir TANDEM_CONFIG=$config
export TANDEM_NUM_SERVERS=${TANDEM_NUM_SERVERS:-1}
if [ "$TANDEM_NUM_SERVERS" -gt 1 ]; then
  sbatch --export=ALL --array="0-$((TANDEM_NUM_SERVERS - 1))" --output="$run_dir/server-%A_%a.log" \
    deploy/slurm/server.sbatch
else
  sbatch --export=ALL --output="$run_dir/server-%j.log" deploy/slurm/server.sbatch
fi
nodes=${TANDEM_LEARNER_NODES:-1}
gpus=${TANDEM_GPUS_PER_NODE:-1}
sbatch --export=ALL --nodes="$nodes" --ntasks-per-node=1 --gres="gpu:$gpus" \
  --output="$run_dir/learner-%j.log" deploy/slurm/learner.sbatch
echo "submitted; the learner starts once the $TANDEM_NUM_SERVERS server URL(s) appear in $run_dir"

#!/usr/bin/env bash
# Submit the server and the learner as two jobs that find each other through a shared run folder:
#   TANDEM_API_TOKEN=$(openssl rand -hex 16) deploy/slurm/launch.sh runs/run1 [deploy/configs/gpu-2x-split.toml]
set -euo pipefail
run_dir=$(realpath -m "${1:?usage: launch.sh RUN_DIR [CONFIG]}")
config=${2:-deploy/configs/gpu-2x-split.toml}
: "${TANDEM_API_TOKEN:?set TANDEM_API_TOKEN to a random secret}"
mkdir -p "$run_dir"
export TANDEM_RUN_DIR=$run_dir TANDEM_CONFIG=$config
sbatch --export=ALL --output="$run_dir/server-%j.log" deploy/slurm/server.sbatch
sbatch --export=ALL --output="$run_dir/learner-%j.log" deploy/slurm/learner.sbatch
echo "submitted; the learner starts once $run_dir/server_url appears"

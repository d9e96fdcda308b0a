#!/usr/bin/env bash
# The launch logic both SLURM jobs share (and that runs on one machine without SLURM):
#
#   TANDEM_RUN_DIR=/shared/run1 deploy/slurm/run.sh server CONFIG [--section.key=value ...]
#   TANDEM_RUN_DIR=/shared/run1 deploy/slurm/run.sh learner CONFIG [--section.key=value ...]
#
# The server writes its URL to $TANDEM_RUN_DIR/server_url once /health answers; the learner waits for
# that file (up to TANDEM_WAIT_S seconds), then connects. Both keep their state under $TANDEM_RUN_DIR,
# so resubmitting either job resumes it. Multi-GPU learner: TANDEM_LAUNCHER="torchrun --nproc-per-node 4".
#
# GPUs: under SLURM each job gets what it asked for. On one machine without SLURM, unless
# CUDA_VISIBLE_DEVICES is set, the server takes GPU 0 and the learner GPU 0 too in timeslice placement
# (they share it: see learner.preflight) or GPU 1 in split placement; TANDEM_SERVER_GPUS /
# TANDEM_LEARNER_GPUS choose others (e.g. TANDEM_LEARNER_GPUS=1,2,3 with a torchrun launcher).
set -euo pipefail

role=${1:?usage: run.sh server|learner CONFIG [overrides...]}
config=${2:?usage: run.sh server|learner CONFIG [overrides...]}
shift 2
run_dir=${TANDEM_RUN_DIR:?set TANDEM_RUN_DIR to a folder that both jobs can see}
py=${TANDEM_PYTHON:-python}
mkdir -p "$run_dir"
url_file="$run_dir/server_url"

if [ -z "${SLURM_JOB_ID:-}" ] && [ -z "${CUDA_VISIBLE_DEVICES:-}" ]; then
  placement=$("$py" -m learner --config "$config" "$@" --check-config |
    "$py" -c "import json, sys; print(json.load(sys.stdin)['learner']['placement'])")
  case "$role/$placement" in
  server/*) CUDA_VISIBLE_DEVICES=${TANDEM_SERVER_GPUS:-0} ;;
  learner/split) CUDA_VISIBLE_DEVICES=${TANDEM_LEARNER_GPUS:-1} ;;
  learner/*) CUDA_VISIBLE_DEVICES=${TANDEM_LEARNER_GPUS:-0} ;;
  esac
  export CUDA_VISIBLE_DEVICES
  echo "run.sh: $role on GPU(s) $CUDA_VISIBLE_DEVICES ($placement placement; set CUDA_VISIBLE_DEVICES to choose)"
fi

case "$role" in
server)
  host=${TANDEM_HOST:-$(hostname -f 2>/dev/null || hostname)}
  port=${TANDEM_PORT:-8000}
  rm -f "$url_file"
  "$py" -m rollout_server --config "$config" --server.host=0.0.0.0 --server.port="$port" \
    --server.state_dir="$run_dir/server" "$@" &
  pid=$!
  trap 'kill -TERM "$pid" 2>/dev/null; wait "$pid"' TERM INT
  until "$py" -c "import urllib.request, sys; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=5)" 2>/dev/null; do
    kill -0 "$pid" 2>/dev/null || { echo "run.sh: the rollout server exited before it was healthy" >&2; wait "$pid"; exit 1; }
    sleep 3
  done
  echo "http://$host:$port" > "$url_file.tmp" && mv "$url_file.tmp" "$url_file"
  echo "run.sh: rollout server healthy at $(cat "$url_file")"
  wait "$pid"
  ;;
learner)
  waited=0
  limit=${TANDEM_WAIT_S:-1800}
  until [ -s "$url_file" ]; do
    if [ "$waited" -ge "$limit" ]; then
      echo "run.sh: no $url_file after ${limit}s: is the server job running with the same TANDEM_RUN_DIR?" >&2
      exit 1
    fi
    sleep 2
    waited=$((waited + 2))
  done
  url=$(cat "$url_file")
  echo "run.sh: learner connecting to $url"
  # shellcheck disable=SC2086  # TANDEM_LAUNCHER is a command line, split on purpose
  exec ${TANDEM_LAUNCHER:-"$py"} -m learner --config "$config" --learner.server_url="$url" \
    --learner.out_dir="$run_dir/learner" --resume "$@"
  ;;
*)
  echo "run.sh: unknown role '$role' (use server or learner)" >&2
  exit 2
  ;;
esac

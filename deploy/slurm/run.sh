#!/usr/bin/env bash
# The launch logic both SLURM jobs share (and that runs on one machine without SLURM):
#
#   TANDEM_RUN_DIR=/shared/run1 deploy/slurm/run.sh server CONFIG [--section.key=value ...]
#   TANDEM_RUN_DIR=/shared/run1 deploy/slurm/run.sh learner CONFIG [--section.key=value ...]
#
# The server writes its URL to $TANDEM_RUN_DIR/server_url once /health answers; the learner waits for
# that file (up to TANDEM_WAIT_S seconds), then connects. Both keep their state under $TANDEM_RUN_DIR,
# so resubmitting either job resumes it. A resubmitted server may come up on another node: the learner's
# wrapper reads the URL file(s) every TANDEM_URL_POLL_S seconds (10) and, when one changes, restarts the
# learner, which resumes from its checkpoint. Multi-GPU learner: TANDEM_LAUNCHER="torchrun --nproc-per-node 4".
#
# Several servers: TANDEM_NUM_SERVERS=N for every job. Server k (TANDEM_SHARD, else SLURM_ARRAY_TASK_ID)
# generates shard k of N of the prompts on port 8000+k (TANDEM_PORT overrides), keeps its state in
# server-k/ and writes its URL to server_urls/k; the learner waits for all N and pulls from them all
# (learner.server_urls). A server that dies is skipped until it is back at the same URL.
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
num_servers=${TANDEM_NUM_SERVERS:-1}
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

reap() {  # wait for process $pid through the signals that cut `wait` short (trapped below); its exit status
  while kill -0 "$pid" 2>/dev/null; do
    wait "$pid" 2>/dev/null || true
  done
  wait "$pid"  # bash keeps the status of a child it has reaped
}

case "$role" in
server)
  host=${TANDEM_HOST:-$(hostname -f 2>/dev/null || hostname)}
  state_dir="$run_dir/server"
  shard_args=()
  if [ "$num_servers" -gt 1 ]; then
    shard=${TANDEM_SHARD:-${SLURM_ARRAY_TASK_ID:-0}}
    mkdir -p "$run_dir/server_urls"
    url_file="$run_dir/server_urls/$shard" state_dir="$run_dir/server-$shard"
    shard_args=(--server.shard_index="$shard" --server.num_shards="$num_servers")
  fi
  port=${TANDEM_PORT:-$((8000 + ${shard:-0}))}
  rm -f "$url_file"
  "$py" -m rollout_server --config "$config" --server.host=0.0.0.0 --server.port="$port" \
    --server.state_dir="$state_dir" "${shard_args[@]}" "$@" &
  pid=$!
  trap 'kill -TERM "$pid" 2>/dev/null' TERM INT  # forwarded; reap below waits for the server's end
  until "$py" -c "import urllib.request, sys; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=5)" 2>/dev/null; do
    kill -0 "$pid" 2>/dev/null || { echo "run.sh: the rollout server exited before it was healthy" >&2; wait "$pid"; exit 1; }
    sleep 3
  done
  echo "http://$host:$port" > "$url_file.tmp" && mv "$url_file.tmp" "$url_file"
  echo "run.sh: rollout server healthy at $(cat "$url_file")"
  rc=0
  reap || rc=$?
  exit "$rc"  # the server's own status, also when the job was cancelled (a clean stop: 0)
  ;;
learner)
  waited=0
  limit=${TANDEM_WAIT_S:-1800}
  files=("$url_file")
  if [ "$num_servers" -gt 1 ]; then
    files=()
    for ((k = 0; k < num_servers; k++)); do files+=("$run_dir/server_urls/$k"); done
  fi
  for f in "${files[@]}"; do
    until [ -s "$f" ]; do
      if [ "$waited" -ge "$limit" ]; then
        echo "run.sh: no $f after ${limit}s: is the server job running with the same TANDEM_RUN_DIR?" >&2
        exit 1
      fi
      sleep 2
      waited=$((waited + 2))
    done
  done
  urls_now() {  # the URL(s) in the run folder, as the learner's option takes them; fails while one is missing
    if [ "$num_servers" -gt 1 ]; then
      local f
      for f in "${files[@]}"; do [ -s "$f" ] || return 1; done
      for f in "${files[@]}"; do cat "$f"; done | "$py" -c 'import json, sys; print(json.dumps(sys.stdin.read().split()))'
    else
      [ -s "$url_file" ] && cat "$url_file"
    fi
  }
  option=--learner.server_urls  # one URL, or a JSON list of several
  # Supervise the learner rather than exec it: a server job that is resubmitted and lands on another node
  # writes a new URL, which the learner (retrying the old one) would never see. When a URL file changes,
  # the learner gets SIGTERM (it checkpoints and exits) and starts again with --resume at the new URL.
  poll_s=${TANDEM_URL_POLL_S:-10}  # whole seconds
  pid="" stopping=0
  trap 'stopping=1; [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null' TERM INT
  urls=$(urls_now)
  while :; do
    echo "run.sh: learner connecting to $urls"
    # shellcheck disable=SC2086  # TANDEM_LAUNCHER is a command line, split on purpose
    ${TANDEM_LAUNCHER:-"$py"} -m learner --config "$config" "$option=$urls" \
      --learner.out_dir="$run_dir/learner" --resume "$@" &
    pid=$!
    moved=""
    ticks=0
    while :; do  # a 1-s tick, so that the job ends as soon as the learner does
      sleep 1 &
      wait $! 2>/dev/null || kill $! 2>/dev/null || true  # a signal cut the wait short: no stray sleep
      [ "$stopping" = 0 ] && kill -0 "$pid" 2>/dev/null || break
      ticks=$((ticks + 1))
      [ "$ticks" -ge "$poll_s" ] || continue
      ticks=0
      now=$(urls_now 2>/dev/null) || continue  # a server between jobs: nothing to follow yet
      if [ "$now" != "$urls" ]; then
        moved=$now
        echo "run.sh: the rollout server moved to $moved; restarting the learner (it resumes from its checkpoint)"
        kill -TERM "$pid" 2>/dev/null || true
        break
      fi
    done
    rc=0
    reap || rc=$?
    if [ "$stopping" = 0 ] && [ -z "$moved" ] && [ "$rc" != 0 ]; then
      # it gave up on an unreachable server: go on if that server has come back elsewhere meanwhile
      now=$(urls_now 2>/dev/null) && [ "$now" != "$urls" ] && moved=$now &&
        echo "run.sh: the learner exited $rc; the rollout server is now at $moved: starting it again"
    fi
    if [ "$stopping" = 1 ] || [ -z "$moved" ]; then
      exit "$rc"
    fi
    urls=$moved
  done
  ;;
*)
  echo "run.sh: unknown role '$role' (use server or learner)" >&2
  exit 2
  ;;
esac

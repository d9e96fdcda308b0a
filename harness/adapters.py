"""Adapters made up for benchmarks and tests: real peft LoRA adapters with random weights."""

from __future__ import annotations

from pathlib import Path


def random_adapter(
    model_dir: str,
    out: Path,
    *,
    seed: int = 0,
    r: int = 16,
    targets=("q_proj", "k_proj", "v_proj", "o_proj"),
    scale: float = 0.05,
) -> Path:
    """A peft LoRA adapter with B ~ N(0, scale) (so it changes the model), saved in peft's format: what
    benchmarks and tests publish. Imports torch and peft when called."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    model.save_pretrained(out)
    return Path(out)

"""Rollout throughput of the `vllm` and `hf` backends on the same workload, and their ratio.

    .venv/bin/python scripts/bench_rollout.py [--prompts 16] [--group-size 8] [--max-tokens 128]

Same prompts (GSM8K test, chat-templated), same G, same max new tokens, temperature 1, top_p 1, base model.
Each backend gets one warm-up batch first (vLLM compiles/allocates on first use), then the timed batch.
Both run in this process one after the other, so they share the machine's state and noise.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import time
from pathlib import Path

from shared.config import load_config
from shared.datasets import chat_prompt_ids, load_gsm8k
from shared.models import resolve_model


async def measure(backend_name: str, args) -> float:
    from rollout_server.app import make_backend

    cfg = load_config(args.config, [f"server.backend={backend_name}", "model.max_model_len=1024"])
    model = resolve_model(cfg.model.name)
    backend = await make_backend(cfg, model)
    problems = load_gsm8k("test", args.gsm8k)[: args.prompts]
    prompts = [chat_prompt_ids(backend.tokenizer, p.question) for p in problems]
    kw = dict(n=args.group_size, temperature=1.0, max_tokens=args.max_tokens, adapter=None)
    print(f"[{backend_name}] warm-up ...", flush=True)
    await backend.generate(prompts[:2], **kw)
    print(
        f"[{backend_name}] {len(prompts)} prompts x G={args.group_size}, <= {args.max_tokens} new tokens ...",
        flush=True,
    )
    t0 = time.perf_counter()
    samples = await backend.generate(prompts, **kw)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(s.token_ids) for row in samples for s in row)
    rate = tokens / elapsed
    print(f"[{backend_name}] {tokens} tokens in {elapsed:.1f} s = {rate:.1f} tok/s", flush=True)
    await backend.close()
    del backend
    gc.collect()
    return rate


def main() -> int:
    repo = Path(__file__).resolve().parents[1]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(repo / "deploy/configs/cpu.toml"))
    p.add_argument("--gsm8k", default=os.environ.get("TANDEM_GSM8K", str(repo.parent / "shared/data/gsm8k")))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--backends", default="vllm,hf")
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    rates = {b: asyncio.run(measure(b, args)) for b in args.backends.split(",")}
    print("\nbackend  tok/s")
    for b, r in rates.items():
        print(f"{b:<8} {r:8.1f}")
    if {"vllm", "hf"} <= rates.keys():
        print(f"vllm/hf ratio: {rates['vllm'] / rates['hf']:.2f}x")
    return 0


if __name__ == "__main__":  # vLLM spawns processes: the guard is required
    sys.exit(main())

"""Do two backends sample the same distribution? The base model, the same prompts, many samples each.

    .venv/bin/python scripts/sampling_check.py [--prompts 16] [--samples 32] [--max-tokens 32]

For each backend (the config's sampling: temperature, top_p 1, top_k off; the same chat-templated prompts
of the config's task, training split, in the producer's order), draws `--samples` completions per prompt from
the base model and reports: mean length, the fraction cut at max tokens, the verifier's mean reward, and the
mean sampler log-prob per token, each with its standard error. Equal distributions give differences within
about two standard errors; a difference in prompt rendering, stop handling or sampling shows up here.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import os
import statistics
import sys
from pathlib import Path

from shared.config import load_config
from shared.datasets import chat_prompt_ids, epoch_order, load_problems
from shared.models import resolve_model
from shared.reward import verify

REPO = Path(__file__).resolve().parents[1]


def _mean_se(xs: list[float]) -> tuple[float, float]:
    return statistics.mean(xs), statistics.stdev(xs) / math.sqrt(len(xs))


async def sample(backend_name: str, args) -> dict:
    from rollout_server.serving.serve import make_backend

    cfg = load_config(args.config, [f"server.backend={backend_name}", *args.overrides])
    backend = await make_backend(cfg, resolve_model(cfg.model.name))
    problems = load_problems(cfg.data)
    order = epoch_order(len(problems), cfg.data.seed, 0)[: args.prompts]
    chosen = [problems[i] for i in order]
    prompts = [chat_prompt_ids(backend.tokenizer, p.question) for p in chosen]
    out = await backend.generate(
        prompts,
        n=args.samples,
        temperature=cfg.sampling.temperature,
        max_tokens=args.max_tokens,
        adapter=None,
    )
    await backend.close()
    del backend
    gc.collect()
    lengths, cut, rewards, lps = [], [], [], []
    for problem, row in zip(chosen, out, strict=True):
        for s in row:
            lengths.append(len(s.token_ids))
            cut.append(float(s.finish_reason == "length"))
            rewards.append(verify(s.text, problem.answer))
            lps.append(sum(s.logprobs) / max(len(s.logprobs), 1))
    return {
        "length": _mean_se(lengths),
        "truncated": _mean_se(cut),
        "reward": _mean_se(rewards),
        "logprob/token": _mean_se(lps),
        "prompt_ids_head": prompts[0][:8],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "deploy/configs/cpu.toml"))
    p.add_argument("--backends", default="vllm,hf")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    results = {b: asyncio.run(sample(b, args)) for b in args.backends.split(",")}
    print(f"\n{args.prompts} prompts x {args.samples} samples, <= {args.max_tokens} tokens, base model")
    print(f"{'':14}" + "".join(f"{b:>22}" for b in results))
    for key in ("length", "truncated", "reward", "logprob/token"):
        print(f"{key:14}" + "".join(f"{r[key][0]:>13.3f} ± {r[key][1]:.3f}" for r in results.values()))
    heads = {b: r["prompt_ids_head"] for b, r in results.items()}
    print("same prompt ids:", len({tuple(h) for h in heads.values()}) == 1)
    return 0


if __name__ == "__main__":  # vLLM spawns processes: the guard is required
    sys.exit(main())

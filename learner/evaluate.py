"""Held-out accuracy of a published policy version, through the rollout server.

    python -m learner.evaluate --config deploy/configs/cpu.toml [--version N] [--limit 100] [--k 4]

Greedy pass@1 (temperature 0) and, with --k > 1, sampled pass@k at the config's temperature, on the
test split of the config's task (`data.task`), scored by the same verifier as training.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from learner.client import RolloutClient
from shared.cli import parse_cli
from shared.config import TandemConfig
from shared.datasets import DatasetError, load_problems
from shared.protocol import GenerateRequest
from shared.reward import verify


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def evaluate(
    client: RolloutClient, cfg: TandemConfig, version: int | None, limit: int, k: int = 1, batch: int = 32
) -> dict:
    problems = load_problems(cfg.data, "test")[:limit]
    greedy, sampled, t0 = [], [], time.perf_counter()
    for start in range(0, len(problems), batch):
        chunk = problems[start : start + batch]
        req = GenerateRequest(prompts=[p.question for p in chunk], version=version, temperature=0.0)
        res = client.generate(req, timeout=3600)
        greedy += [verify(row[0].text, p.answer) for row, p in zip(res.outputs, chunk, strict=True)]
        if k > 1:
            req = GenerateRequest(
                prompts=[p.question for p in chunk],
                version=version,
                n=k,
                temperature=cfg.sampling.temperature,
            )
            res = client.generate(req, timeout=3600)
            sampled += [
                pass_at_k(k, sum(verify(o.text, p.answer) for o in row), k)
                for row, p in zip(res.outputs, chunk, strict=True)
            ]
        done = start + len(chunk)
        print(
            f"\r[eval] v{res.version}: {done}/{len(problems)} problems", end="", file=sys.stderr, flush=True
        )
    print(file=sys.stderr)
    result = {
        "version": res.version,
        "task": cfg.data.task,
        "problems": len(problems),
        "pass@1_greedy": sum(greedy) / len(greedy),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if k > 1:
        result[f"pass@{k}_sampled"] = sum(sampled) / len(sampled)
    return result


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--version", type=int, default=None, help="adapter version (default: the one served)")
    p.add_argument("--limit", type=int, default=100, help="first N test problems")
    p.add_argument("--k", type=int, default=1, help="also sampled pass@k with k samples per problem")
    p.add_argument("--out", help="write the result as JSON here")


def main(argv: list[str] | None = None) -> int:
    args, cfg = parse_cli("python -m learner.evaluate", __doc__.split("\n\n")[0], argv, _args)
    try:
        client = RolloutClient(
            cfg.learner.server_url, token=os.environ.get(cfg.learner.api_token_env) or None
        )
        client.wait_ready(60)
        result = evaluate(client, cfg, args.version, args.limit, args.k)
    except DatasetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

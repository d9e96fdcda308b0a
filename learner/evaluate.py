"""Held-out accuracy of a published policy version, through the rollout server.

    python -m learner.evaluate --config deploy/configs/cpu.toml [--version N] [--limit 100] [--k 4]

Greedy pass@1 (temperature 0) and, with --k > 1, sampled pass@k at the config's temperature, on the
`data.eval_split` split of the config's task (with an environment, `env`, each sample played as an
episode by the server; a `verifiers` environment's held-out tasks, env.verifiers_eval, played by the
library's harness against the server's OpenAI API and scored by its rewards), scored by the reward
functions of training (`reward`): a completion is correct
when its reward is at least 1 (the built-in verifiers give 1 for a right answer), and `reward_greedy` is
the mean reward of the greedy completions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from typing import NoReturn

from learner.client import RolloutClient
from shared import quick_exit
from shared.cli import parse_cli
from shared.config import ConfigError, TandemConfig
from shared.datasets import DatasetError, Problem, load_problems
from shared.protocol import EpisodeRow, GeneratedText, GenerateRequest
from shared.rewards import RewardCall, RewardRunner

CORRECT = 1.0  # a completion whose reward reaches this counts as correct (the verifiers' 1 for right)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def evaluate(
    client: RolloutClient, cfg: TandemConfig, version: int | None, limit: int, k: int = 1, batch: int = 32
) -> dict:
    return asyncio.run(_evaluate(client, cfg, version, limit, k, batch))


async def _evaluate(
    client: RolloutClient, cfg: TandemConfig, version: int | None, limit: int, k: int, batch: int
) -> dict:
    """One event loop for the run: the reward runner's worker processes live in it; the (blocking)
    requests to the server go through a thread."""
    if cfg.env.kind == "verifiers":
        return await _evaluate_verifiers(client, cfg, version, limit)
    problems = load_problems(cfg.data, cfg.data.eval_split)[:limit]
    # (a judge of url = 'self' is the server this client talks to, with its token)
    runner = RewardRunner(cfg.reward, self_url=client.url, self_token=client.token or "")
    greedy, rewards, sampled, t0 = [], [], [], time.perf_counter()

    episodes = cfg.env.turns

    async def generate(chunk: list[Problem], messages, n: int, temperature: float):
        # With an environment, each sample is played as an episode by the server, as in training.
        rows = [EpisodeRow(answer=p.answer, metadata=dict(p.metadata)) for p in chunk] if episodes else None
        req = GenerateRequest(messages=messages, version=version, n=n, temperature=temperature, rows=rows)
        res = await asyncio.to_thread(client.generate, req, 3600)
        calls = [_call(o, p) for row, p in zip(res.outputs, chunk, strict=True) for o in row]
        totals = iter([runner.total(r) for r in await runner.score(calls)])
        return res.version, [[next(totals) for _ in row] for row in res.outputs]  # [problem][sample]

    try:
        for start in range(0, len(problems), batch):
            chunk = problems[start : start + batch]
            messages = [p.conversation() for p in chunk]
            served, totals = await generate(chunk, messages, 1, 0.0)
            rewards += [row[0] for row in totals]
            greedy += [row[0] >= CORRECT for row in totals]
            if k > 1:
                _, totals = await generate(chunk, messages, k, cfg.sampling.temperature)
                sampled += [pass_at_k(k, sum(t >= CORRECT for t in row), k) for row in totals]
            done = start + len(chunk)
            print(f"\r[eval] v{served}: {done}/{len(problems)} problems", end="", file=sys.stderr, flush=True)
    finally:
        await runner.close()
    print(file=sys.stderr)
    result = {
        "version": served,
        "task": cfg.data.task,
        "problems": len(problems),
        "pass@1_greedy": sum(greedy) / len(greedy),
        "reward_greedy": sum(rewards) / len(rewards),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if k > 1:
        result[f"pass@{k}_sampled"] = sum(sampled) / len(sampled)
    return result


async def _evaluate_verifiers(
    client: RolloutClient, cfg: TandemConfig, version: int | None, limit: int
) -> dict:
    """A `verifiers` environment's held-out tasks (env.verifiers_eval), one greedy episode each, played by
    the library's own harness through its evaluation client against the server's OpenAI API (chat
    completions), and scored by its rewards; correct = the weighted reward reaches CORRECT."""
    from shared import verifiers_tasks

    vf = verifiers_tasks.import_verifiers()
    env, _ = verifiers_tasks.load(cfg.env)
    tasks = verifiers_tasks.held_out(cfg.env)[:limit]
    if not tasks:
        raise ConfigError("learner.evaluate: env.verifiers_eval = 0 holds out no task of the environment")
    served = client.health().policy_version if version is None else version
    key_var = verifiers_tasks.prepare_process(client.token)
    ctx = vf.ModelContext(
        model=f"policy-v{served}" if served else "base",
        client=vf.EvalClientConfig(base_url=f"{client.url}/v1", api_key_var=key_var),
        sampling=vf.SamplingConfig(temperature=0.0, max_tokens=cfg.sampling.max_new_tokens),
    )
    gate, t0 = asyncio.Semaphore(cfg.server.openai_max_sequences), time.perf_counter()
    async with env.serving():
        episodes = await asyncio.gather(*(env.run_slot(env.slots(task, 1)[0], ctx, gate) for task in tasks))
    if failed := [e for e in episodes if not e.ok]:  # what went wrong, not only how often
        errors = [err for e in failed for err in [*e.errors, *(x for tr in e.traces for x in tr.errors)]]
        first = f"{errors[0].type}: {errors[0].message}" if errors else "no error recorded"
        print(f"[eval] {len(failed)} of {len(episodes)} episodes failed; the first: {first}", file=sys.stderr)
    totals, by_name = [], {}
    for e in episodes:
        trace = next((tr for tr in e.traces if tr.agent.trainable), None)
        rewards, total = verifiers_tasks.trace_rewards(trace) if trace and e.ok else ({}, 0.0)
        totals.append(total)
        for n, r in rewards.items():
            by_name.setdefault(n, []).append(r)
    return {
        "version": served,
        "task": f"verifiers:{env.config.taskset.id}",
        "problems": len(tasks),
        "pass@1_greedy": sum(x >= CORRECT for x in totals) / len(totals),
        "reward_greedy": sum(totals) / len(totals),
        "rewards": {n: sum(v) / len(tasks) for n, v in by_name.items()},
        "failed": sum(not e.ok for e in episodes),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def _call(output: GeneratedText, p: Problem) -> RewardCall:
    """The reward functions' call for an output, as in training: an episode's last turn, with the whole
    conversation in metadata["episode"]."""
    metadata = dict(p.metadata)
    if output.messages is not None:
        messages = [m.model_dump() for m in output.messages]
        metadata["episode"] = {"messages": messages, "turns": output.turns}
    return RewardCall(output.text, p.answer, p.prompt_text, metadata)


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--version", type=int, default=None, help="adapter version (default: the one served)")
    p.add_argument("--limit", type=int, default=100, help="first N test problems")
    p.add_argument("--k", type=int, default=1, help="also sampled pass@k with k samples per problem")
    p.add_argument("--out", help="write the result as JSON here")
    p.add_argument(
        "--run-dir",
        help="a learner's out_dir: append the result to its evaluations.jsonl, which the run's experiment "
        "trackers (learner.report_to) log as eval/* at its next step",
    )


def main(argv: list[str] | None = None) -> int:
    args, cfg = parse_cli("python -m learner.evaluate", __doc__.split("\n\n")[0], argv, _args)
    try:
        # every server serves every version: the first one listed evaluates
        client = RolloutClient(
            cfg.learner.server_urls[0], token=os.environ.get(cfg.server.api_token_env) or None
        )
        client.wait_ready(60)
        result = evaluate(client, cfg, args.version, args.limit, args.k)
    except (DatasetError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    if args.run_dir:
        with open(os.path.join(args.run_dir, "evaluations.jsonl"), "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0


def run() -> NoReturn:
    """The entry point (`python -m learner.evaluate`, and the `tandem-evaluate` console script): main()
    ending through shared/quick_exit.py, without the interpreter's teardown."""
    quick_exit.arm()
    quick_exit.exit(main())


if __name__ == "__main__":
    run()

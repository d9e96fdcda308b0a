"""Learner throughput on replayed groups: shared-prompt path against the plain one, or 1 process against 2.

    .venv/bin/python scripts/bench_learner.py RUN/learner/groups.jsonl   # a demo run's groups
    .venv/bin/python scripts/bench_learner.py --gsm8k-shaped   # ~150-token prompts, ~200-token completions
    .venv/bin/python scripts/bench_learner.py RUN/learner/groups.jsonl --compare processes
    .venv/bin/python scripts/bench_learner.py RUN/learner/groups.jsonl --compare old_logprobs
    .venv/bin/python scripts/bench_learner.py RUN/learner/groups.jsonl --compare packed_attention
    .venv/bin/python scripts/bench_learner.py RUN/learner/groups.jsonl --compare micro_batches \
        --set model.dtype=auto

Replays recorded groups (learner.replay_file: no server, the exact same batches) through the real DeepSpeed
ZeRO-2 learner, once per variant, side by side in one run, and prints completion tokens per second of
training (perf/train_s, first step excluded as warm-up), the ratio, and each learner's peak resident memory.
`--compare paths` (default): learner.shared_prompt=false (one padded row per completion, full logits: the
reference path) against true (each prompt encoded once per micro-batch, logits only where scored), one
process. `--compare processes`: 1 process against 2 (torchrun, gloo) with the cores split between them.
`--compare old_logprobs`: the sampler's log-probs as π_old against the learner's recomputed ones with
truncated importance sampling (grpo.old_logprobs = recompute, grpo.tis_cap = 2): what the correction costs.
`--compare packed_attention`: the packed rows' attention over the whole row under its mask (the reference)
against segment by segment (learner.packed_attention, learner/attention.py). `--compare micro_batches`:
--micro-batch-size completions a micro-batch (accumulated) against the whole step in one micro-batch.
`--set KEY=VALUE` (repeatable) gives every variant a config override, e.g. the run's own model.dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from harness.net import free_port

REPO = Path(__file__).resolve().parents[1]


def run(
    name: str,
    groups: Path,
    args,
    work: Path,
    world: int = 1,
    extra: tuple[str, ...] = (),
    micro: int | None = None,
) -> dict:
    """One learner over the replayed groups (`micro` completions a micro-batch, default
    --micro-batch-size): its metrics records and its peak RSS (MiB)."""
    recorded = json.loads((groups.parent / "config.json").read_text())
    b, g = step_shape(groups)
    micro = micro or args.micro_batch_size
    if (b * g) % (micro * world):
        raise SystemExit(f"B x G = {b * g} is not divisible by micro batch {micro} x {world} processes")
    out = work / name
    launcher = ["-m", "torch.distributed.run", f"--nproc-per-node={world}", f"--master-port={free_port()}"]
    cmd = [
        sys.executable,
        *(launcher if world > 1 else []),
        "-m",
        "learner",
        "--config",
        args.config,
        f"--sampling.group_size={g}",
        f"--sampling.max_new_tokens={recorded['sampling']['max_new_tokens']}",
        f"--sampling.temperature={recorded['sampling']['temperature']}",
        f"--learner.prompts_per_step={b}",
        f"--learner.micro_batch_size={micro}",
        f"--learner.grad_accum={b * g // (micro * world)}",
        f"--learner.steps={args.steps}",
        f"--learner.replay_file={groups}",
        f"--learner.out_dir={out}",
        *(f"--{kv}" for kv in args.set),
        *extra,
    ]
    threads = max(1, (os.cpu_count() or 1) // world)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    print(
        f"[{name}: {world} process(es), {threads} thread(s) each] {args.steps} replayed steps ...", flush=True
    )
    log = work / f"{name}.log"
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(
            proc.pid, 0
        )  # this child's own peak RSS (kB on Linux), its children's too
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"learner {name} failed; see {log}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"records": records, "peak_rss_mib": usage.ru_maxrss / 1024}


def step_shape(groups: Path) -> tuple[int, int]:
    """(prompts a step, completions a group) of the run that recorded `groups`."""
    recorded = json.loads((groups.parent / "config.json").read_text())
    return recorded["learner"]["prompts_per_step"], recorded["sampling"]["group_size"]


def tokens_per_step(groups: Path) -> dict[int, int]:
    per_step = {}
    for line in groups.read_text().splitlines():
        rec = json.loads(line)
        per_step[rec["step"]] = sum(len(c["token_ids"]) for g in rec["groups"] for c in g["completions"])
    return per_step


def gsm8k_shaped(folder: Path, steps: int, config: str, seed: int = 0) -> Path:
    """A groups.jsonl (and config.json) of GSM8K's shape: B = 2 prompts of 140-160 tokens, G = 8
    completions of 150-250 tokens (max_new_tokens 256), rewards 0/1 with both in every group. Token ids are
    random: the timing depends on the shapes, not on what the tokens say."""
    from shared.config import load_config

    rng = random.Random(seed)
    cfg = load_config(REPO / config, ["sampling.max_new_tokens=256", "learner.prompts_per_step=2"])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(cfg.dump() + "\n")
    with (folder / "groups.jsonl").open("w") as f:
        for step in range(1, steps + 1):
            groups = []
            for b in range(2):
                prompt = [rng.randrange(100, 49000) for _ in range(rng.randint(140, 160))]
                rewards = [1.0, 0.0] + [float(rng.random() < 0.4) for _ in range(6)]
                completions = []
                for r in rewards:
                    n = rng.randint(150, 250)
                    completions.append(
                        {
                            "token_ids": [rng.randrange(100, 49000) for _ in range(n)],
                            "logprobs": [-rng.uniform(0.0, 2.0) for _ in range(n)],
                            "text": "",
                            "reward": r,
                            "finish_reason": "stop",
                        }
                    )
                groups.append(
                    {
                        "group_id": f"s{step}-{b}",
                        "prompt_id": f"p{step}-{b}",
                        "prompt_token_ids": prompt,
                        "answer": "0",
                        "policy_version": step - 1,
                        "completions": completions,
                    }
                )
            f.write(json.dumps({"step": step, "groups": groups}) + "\n")
    return folder / "groups.jsonl"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "groups", type=Path, nargs="?", help="a run's learner/groups.jsonl (its config.json beside it)"
    )
    p.add_argument("--gsm8k-shaped", action="store_true", help="replay a generated GSM8K-shaped set instead")
    p.add_argument(
        "--compare",
        choices=["paths", "processes", "old_logprobs", "packed_attention", "micro_batches"],
        default="paths",
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for every variant"
    )
    p.add_argument("--config", default="deploy/configs/cpu.toml")
    p.add_argument("--steps", type=int, default=4, help="steps to replay; the first is a warm-up")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tandem-bench-learner-"))
    if args.gsm8k_shaped == (args.groups is not None):
        p.error("give a groups.jsonl or --gsm8k-shaped (one of them)")
    if args.gsm8k_shaped:
        args.groups = gsm8k_shaped(work / "gsm8k-shaped", args.steps, args.config)
    if not args.groups.is_file() or not (args.groups.parent / "config.json").is_file():
        p.error(f"{args.groups}: not a run's groups.jsonl with config.json beside it")
    tokens = tokens_per_step(args.groups)
    if len(tokens) < args.steps or args.steps < 2:
        p.error(f"--steps must be >= 2 and <= the {len(tokens)} steps recorded in {args.groups}")
    groups = args.groups.resolve()
    if args.compare == "paths":
        variants = {
            "plain": dict(extra=("--learner.shared_prompt=false",)),
            "shared_prompt": dict(extra=("--learner.shared_prompt=true",)),
        }
    elif args.compare == "packed_attention":
        variants = {
            "mask": dict(extra=("--learner.shared_prompt=true", "--learner.packed_attention=mask")),
            "segments": dict(extra=("--learner.shared_prompt=true", "--learner.packed_attention=segments")),
        }
    elif args.compare == "old_logprobs":
        variants = {
            "sampler": dict(extra=("--grpo.old_logprobs=sampler",)),
            "recompute_tis": dict(extra=("--grpo.old_logprobs=recompute", "--grpo.tis_cap=2")),
        }
    elif args.compare == "micro_batches":
        b, g = step_shape(groups)
        variants = {f"micro_{args.micro_batch_size}": {}, f"micro_{b * g}": dict(micro=b * g)}
    else:
        variants = {"1_process": dict(world=1), "2_processes": dict(world=2)}
    result: dict = {"groups": str(args.groups), "cpus": os.cpu_count(), "steps_timed": args.steps - 1}
    for name, kw in variants.items():
        r = run(name, groups, args, work, **kw)
        rate = statistics.median(tokens[rec["step"]] / rec["perf/train_s"] for rec in r["records"][1:])
        result[name] = {"completion_tokens_per_s": rate, "peak_rss_mib": r["peak_rss_mib"]}
        print(f"  {rate:.1f} completion tokens/s, peak RSS {r['peak_rss_mib']:.0f} MiB", flush=True)
    names = list(variants)
    ratio = result[names[1]]["completion_tokens_per_s"] / result[names[0]]["completion_tokens_per_s"]
    result["ratio"] = ratio
    print(
        f"\nlearner, completion tokens/s: {names[0]} {result[names[0]]['completion_tokens_per_s']:.1f}, "
        f"{names[1]} {result[names[1]]['completion_tokens_per_s']:.1f}; {names[1]}/{names[0]} = {ratio:.2f}"
        f"\npeak RSS: {names[0]} {result[names[0]]['peak_rss_mib']:.0f} MiB, "
        f"{names[1]} {result[names[1]]['peak_rss_mib']:.0f} MiB"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Learner throughput at 1 and 2 processes on the same global batch: tokens/s of the GRPO step.

    .venv/bin/python scripts/bench_learner.py RUN/learner/groups.jsonl [--steps 4]

Replays the groups a run recorded (learner.replay_file: no server, the exact same batches) through the real
DeepSpeed ZeRO-2 learner, once as one process and once as two (torchrun, gloo), with the same global batch
(B x G = micro batch x grad accumulation x processes) and the machine's cores split evenly between the
processes. Reports completion tokens per second of training (perf/train_s), first step excluded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from shared.net import free_port

REPO = Path(__file__).resolve().parents[1]


def run(world: int, groups: Path, args, work: Path) -> list[dict]:
    recorded = json.loads((groups.parent / "config.json").read_text())
    b, g = recorded["learner"]["prompts_per_step"], recorded["sampling"]["group_size"]
    micro = args.micro_batch_size
    if (b * g) % (micro * world):
        raise SystemExit(f"B x G = {b * g} is not divisible by micro batch {micro} x {world} processes")
    out = work / f"world{world}"
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
    ]
    threads = max(1, (os.cpu_count() or 1) // world)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    print(f"[{world} process(es), {threads} thread(s) each] {args.steps} replayed steps ...", flush=True)
    log = work / f"world{world}.log"
    rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"learner ({world} processes) failed; see {log}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def tokens_per_step(groups: Path) -> dict[int, int]:
    per_step = {}
    for line in groups.read_text().splitlines():
        rec = json.loads(line)
        per_step[rec["step"]] = sum(len(c["token_ids"]) for g in rec["groups"] for c in g["completions"])
    return per_step


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("groups", type=Path, help="a run's learner/groups.jsonl (its config.json beside it)")
    p.add_argument("--config", default="deploy/configs/cpu.toml")
    p.add_argument("--steps", type=int, default=4, help="steps to replay; the first is a warm-up")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args()
    if not args.groups.is_file() or not (args.groups.parent / "config.json").is_file():
        p.error(f"{args.groups}: not a run's groups.jsonl with config.json beside it")
    tokens = tokens_per_step(args.groups)
    if len(tokens) < args.steps or args.steps < 2:
        p.error(f"--steps must be >= 2 and <= the {len(tokens)} steps recorded in {args.groups}")
    work = Path(tempfile.mkdtemp(prefix="tandem-bench-learner-"))
    rates = {}
    for world in (1, 2):
        records = run(world, args.groups.resolve(), args, work)
        rates[world] = statistics.median(tokens[r["step"]] / r["perf/train_s"] for r in records[1:])
        print(f"  {rates[world]:.0f} completion tokens/s", flush=True)
    result = {
        "tokens_per_s_1_process": rates[1],
        "tokens_per_s_2_processes": rates[2],
        "ratio_2_over_1": rates[2] / rates[1],
        "cpus": os.cpu_count(),
    }
    print(
        f"\nlearner: 1 process {rates[1]:.0f} tok/s, 2 processes {rates[2]:.0f} tok/s; "
        f"2/1 = {rates[2] / rates[1]:.2f}"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

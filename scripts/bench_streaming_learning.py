"""Lockstep, continuous and in-flight production with a real learner beside the server (split placement),
side by side in one run: what the learner sees, and what it has learnt after the same wall clock.

    .venv/bin/python scripts/bench_streaming_learning.py [--seconds 240] [--seeds 0,1,2]
        [--modes lockstep,continuous,inflight] [--max-tokens 128] [--eval-problems 50] [--out DIR]
        [--set SECTION.KEY=VALUE ...]

For each seed, each mode in turn: the rollout server and the DeepSpeed learner from the config
(deploy/configs/cpu.toml in the CPU's precision, G = 4, 2 prompts a step) in split placement, each process
on its own cores (`--server-cores`, `--learner-cores`: two devices, as split placement means; on 2 cores
without pinning the learner's step took 190 s against the engine's threads), with every mode on vLLM's LoRA
path (in-flight updates need the versions as adapters; the same path for all keeps the comparison fair).
The learner trains for `--seconds` from its start, is stopped by SIGTERM (it finishes its step and
publishes it), and the served version is scored on `--eval-problems` held-out problems (greedy); the base
model is scored once. Modes: lockstep (server.production = "lockstep"), continuous ("continuous"),
inflight (continuous with server.inflight_updates = "continue").

Prints, per mode (mean over the seeds, then each seed): held-out accuracy after the window, steps per
minute, the learner's idle fraction (the share of its step time spent waiting for groups), per-token
version lag (mean and the mean of each step's 95th percentile), the engine's completion tokens/s over the
window, and samples continued. Writes results.json and a plot (accuracy per mode and seed) to the run folder.
The engine-side figures (slots busy, the tail) are scripts/bench_streaming.py's. Numbers: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx

from harness.net import free_port
from harness.procs import Proc, tandem_env, wait_healthy
from learner.client import RolloutClient
from learner.evaluate import evaluate
from shared.config import load_config

REPO = Path(__file__).resolve().parents[1]
SMALL = [  # a step's generation in ~20 s through LoRA on one core, so a window of minutes holds ~10 steps
    "--model.dtype=auto",
    "--sampling.group_size=4",
    "--learner.prompts_per_step=2",
    "--server.prompts_per_batch=4",
    "--server.queue_size=8",
]
MODES = {
    "lockstep": ["--server.production=lockstep", "--server.inflight_updates=off"],
    "continuous": ["--server.production=continuous", "--server.inflight_updates=off"],
    "inflight": ["--server.production=continuous", "--server.inflight_updates=continue"],
}


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(found[1]) if found else 0.0


def _cores(spec: str) -> set[int]:
    """'0', '0,1' or '2-3': the set of cores."""
    cores = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cores |= set(range(int(lo), int(hi or lo) + 1))
    return cores


def _pinned(cores: str, args: list[str], log: Path, env: dict[str, str]) -> Proc:
    """A process (and every process it starts) on `cores`: it inherits this one's affinity at its start."""
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, _cores(cores))
    try:
        return Proc(args, log, env)
    finally:
        os.sched_setaffinity(0, mine)


def one_run(args, mode: str, seed: int, out: Path, before: dict | None) -> dict:
    """One server and one learner for `args.seconds`; the learner's metrics and the held-out score."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    overrides = [
        *SMALL,
        "--learner.placement=split",
        "--learner.max_staleness=4",
        "--learner.steps=100000",  # stopped by the clock
        "--server.adapter_mode=lora",
        f"--sampling.max_new_tokens={args.max_tokens}",
        *MODES[mode],
        f"--data.seed={seed}", f"--server.seed={seed}", f"--learner.seed={seed}",
        f"--server.port={port}", f"--server.state_dir={out / 'server'}",
        f"--learner.server_urls={url}", f"--learner.out_dir={out / 'learner'}",
        *(f"--{s}" for s in args.set),
    ]  # fmt: skip
    cfg = load_config(REPO / args.config, [o[2:] for o in overrides])
    token = secrets.token_hex(16)
    server_env = tandem_env(token, VLLM_CPU_OMP_THREADS_BIND=args.server_cores)
    learner_env = tandem_env(token, OMP_NUM_THREADS=str(len(_cores(args.learner_cores))))
    server = _pinned(args.server_cores, ["-m", "rollout_server", "--config", args.config, *overrides],
                     out / "server.log", server_env)  # fmt: skip
    learner = None
    try:
        wait_healthy(server, url)
        client = RolloutClient(url, token=token)
        if before is None:
            before = evaluate(client, cfg, 0, args.eval_problems)
        tokens0 = _metric(url, "tandem_completion_tokens_total")
        learner = _pinned(args.learner_cores, ["-m", "learner", "--config", args.config, *overrides],
                          out / "learner.log", learner_env)  # fmt: skip
        t0 = time.time()
        while time.time() - t0 < args.seconds and learner.alive():
            time.sleep(1.0)
        if not learner.alive():
            raise RuntimeError(
                f"the learner ended early (exit {learner.returncode}): see {out / 'learner.log'}"
            )
        learner.signal(signal.SIGTERM)  # it finishes the step it is in, checkpoints and publishes it
        if learner.wait(timeout=600) != 0:
            raise RuntimeError(f"the learner failed to stop cleanly: see {out / 'learner.log'}")
        elapsed = time.time() - t0
        tokens = _metric(url, "tandem_completion_tokens_total") - tokens0
        continued = _metric(url, "tandem_samples_continued_total")
        client.pause_production()  # the evaluation has the engine to itself
        after = evaluate(client, cfg, None, args.eval_problems)
    finally:
        if learner is not None:
            learner.stop()
        server.stop()
    metrics = [json.loads(x) for x in (out / "learner" / "metrics.jsonl").read_text().splitlines()]
    later = metrics[1:] or metrics  # step 1 waits for the engine's first groups in every mode
    step_s = sum(m["perf/step_s"] for m in later)
    return {
        "mode": mode,
        "seed": seed,
        "before": before["pass@1_greedy"],
        "after": after["pass@1_greedy"],
        "version": after["version"],
        "steps": len(metrics),
        "steps_per_min": 60 * len(metrics) / elapsed,
        "idle": sum(m["perf/pull_s"] for m in later) / step_s if step_s else float("nan"),
        "token_lag": statistics.fmean(m["policy/token_lag"] for m in metrics),
        "token_lag_p95": statistics.fmean(m["policy/token_lag_p95"] for m in metrics),
        "tok_s": tokens / elapsed,
        "continued": continued,
        "_before": before,
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, (acc, lag) = plt.subplots(1, 2, figsize=(10, 4))
    for i, mode in enumerate(modes):
        mine = [r for r in rows if r["mode"] == mode]
        acc.bar(i, 100 * statistics.fmean(r["after"] for r in mine), color="C0", alpha=0.5)
        acc.scatter([i] * len(mine), [100 * r["after"] for r in mine], color="C0", zorder=3)
        lag.bar(i, statistics.fmean(r["token_lag"] for r in mine), color="C1", alpha=0.5)
        lag.scatter([i] * len(mine), [r["token_lag"] for r in mine], color="C1", zorder=3)
    base = 100 * statistics.fmean(r["before"] for r in rows)
    acc.axhline(base, color="grey", linestyle="--", label=f"base model {base:.0f} %")
    acc.set(xticks=range(len(modes)), xticklabels=modes, ylabel="held-out accuracy after the window (%)")
    acc.legend()
    lag.set(xticks=range(len(modes)), xticklabels=modes, ylabel="per-token version lag (mean)")
    fig.suptitle("split placement, same wall clock per run (bars: mean of the seeds; dots: each seed)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="deploy/configs/cpu.toml")
    p.add_argument("--seconds", type=float, default=240.0, help="the learner's wall clock per run")
    p.add_argument("--seeds", default="0,1,2", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--modes", default="lockstep,continuous,inflight", type=lambda s: s.split(","))
    p.add_argument("--max-tokens", type=int, default=128, help="sampling.max_new_tokens (a long tail)")
    p.add_argument("--eval-problems", type=int, default=50, help="held-out problems, greedy")
    p.add_argument("--out", default=None, help="run folder (default: runs/bench-streaming-learning-<time>)")
    p.add_argument("--server-cores", default="0", help="the rollout server's cores (vLLM binds its threads)")
    p.add_argument("--learner-cores", default="1", help="the learner's cores")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = p.parse_args()
    for name in ("server_cores", "learner_cores"):
        try:
            bad = _cores(getattr(args, name)) - os.sched_getaffinity(0)
        except ValueError:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)}: give cores as 0, 0,1 or 0-3")
        if bad:
            p.error(f"--{name.replace('_', '-')}: core(s) {sorted(bad)} not available here")
    if unknown := set(args.modes) - MODES.keys():
        p.error(f"unknown mode(s) {sorted(unknown)}: {', '.join(MODES)}")
    out = Path(args.out or REPO / "runs" / time.strftime("bench-streaming-learning-%Y%m%d-%H%M%S")).resolve()
    rows, before = [], {}
    for seed in args.seeds:
        for mode in args.modes:
            print(f"[seed {seed}] {mode}: {args.seconds:.0f} s of training ...", flush=True)
            row = one_run(args, mode, seed, out / f"{mode}-{seed}", before.get(seed))
            before[seed] = row.pop("_before")
            rows.append(row)
            print(
                f"  {100 * row['before']:.0f} % -> {100 * row['after']:.0f} % (v{row['version']}), "
                f"{row['steps_per_min']:.2f} steps/min, idle {100 * row['idle']:.0f} %, token lag "
                f"{row['token_lag']:.2f} (p95 {row['token_lag_p95']:.2f}), {row['tok_s']:.1f} tok/s, "
                f"{row['continued']:.0f} continued",
                flush=True,
            )
    (out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    plot(rows, out / "streaming_learning.png")
    print(
        f"\nmode        held-out after  steps/min  learner idle  token lag (p95)  tok/s  "
        f"({len(args.seeds)} seed(s), {args.seconds:.0f} s each, <= {args.max_tokens} tokens, LoRA, "
        f"server on cores {args.server_cores}, learner on {args.learner_cores})"
    )
    for mode in args.modes:
        mine = [r for r in rows if r["mode"] == mode]
        mean = {k: statistics.fmean(r[k] for r in mine) for k in mine[0] if k not in ("mode", "seed")}
        seeds = " ".join(f"{100 * r['after']:.0f}" for r in mine)
        print(
            f"{mode:<10} {100 * mean['after']:6.1f} % ({seeds})  {mean['steps_per_min']:7.2f}"
            f"  {100 * mean['idle']:10.0f} %  {mean['token_lag']:9.2f} ({mean['token_lag_p95']:.2f})"
            f"  {mean['tok_s']:5.1f}"
        )
    print(f"base model: {100 * statistics.fmean(r['before'] for r in rows):.1f} %; results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

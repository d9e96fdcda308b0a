"""The CPU demo: GRPO-train SmolLM2-135M-Instruct on the generated arithmetic task and watch it learn.

    make demo                       # or: .venv/bin/python scripts/demo.py [--steps 30] [--eval-problems 100]

Starts the rollout server (the config's backend: vLLM with merged versions on CPU) and the learner
(DeepSpeed ZeRO-2) from deploy/configs/cpu.toml, measures held-out accuracy before and after training
through the server, and ends with a summary and a PNG of the reward and accuracy curves. Everything lands
in runs/demo-<time>/.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import time
from pathlib import Path

from harness.net import free_port
from harness.procs import Proc, tandem_env, wait_healthy
from learner.client import RolloutClient
from learner.evaluate import evaluate
from shared.config import load_config

REPO = Path(__file__).resolve().parents[1]

# The demo's own choices on top of the config (your --section.key=value overrides come after and win).
# Measured on 2 cores (docs/benchmarks.md §2): bf16 where the CPU computes in it halves a step, and 4
# prompts a step for 24 steps gained +47 points in 3.7 min where cpu.toml's 2 x 12 gained +32 in 1.9. On a
# CPU without native bf16 a step costs 1.5x or more in float32 and the old demo already took 6-13.5 min
# on one, so there the demo keeps cpu.toml's 2 prompts x 12 steps (+28 mean) to stay within ~10 minutes.
# Each generation batch holds twice the prompts a step trains on (cpu.toml's 4 for 2): dynamic sampling
# drops a third to four fifths of the groups as degenerate, so a batch of 4 left most steps waiting for a
# second one; one batch of 8 costs less than two of 4 (§2: median step 9.1 -> 8.1 s, gains unchanged).
LARGER = [
    "--learner.prompts_per_step=4",
    "--server.prompts_per_batch=8",
    "--server.queue_size=8",
    "--learner.steps=24",
]


def run_demo(run: Path, seed: int, args: list[str]) -> tuple[dict, list[dict]] | None:
    """This script as a child process into folder `run` (for scripts that run it per seed or setting, its
    output kept quiet): its summary and metrics, or None (said) when it failed."""
    import subprocess

    cmd = [sys.executable, str(REPO / "scripts" / "demo.py"), "--seed", str(seed), "--out", str(run), *args]
    if subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL).returncode != 0:
        print(f"   failed: see {run}", flush=True)
        return None
    summary = json.loads((run / "summary.json").read_text())
    metrics = [json.loads(x) for x in (run / "learner" / "metrics.jsonl").read_text().splitlines()]
    return summary, metrics


def demo_choices(dtype: str) -> list[str]:
    """bfloat16 where the CPU computes in it (model.dtype = auto), and the larger run only in bf16 (`dtype`:
    the precision the run resolves to)."""
    return ["--model.dtype=auto", *(LARGER if dtype == "bfloat16" else [])]


class PeakRss:
    """Peak resident memory of each process tree (a process and its children: vLLM's engine core,
    DeepSpeed ranks), sampled while the demo runs."""

    def __init__(self):
        self.peak_mib: dict[str, float] = {}

    def sample(self, name: str, proc: Proc | None) -> None:
        import psutil

        if proc is None or not proc.alive():
            return
        try:
            root = psutil.Process(proc.pid)
            rss = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
        except psutil.Error:
            return
        self.peak_mib[name] = max(self.peak_mib.get(name, 0.0), rss / 2**20)


def follow(proc: Proc, log: Path, on_tick=lambda: None, prefix: str = "step ") -> None:
    """Echo the learner's progress lines while it runs."""
    seen = 0
    while True:
        lines = log.read_text(errors="replace").splitlines()
        for line in lines[seen:]:
            if line.startswith(prefix) or line.startswith("[learner]") or line.startswith("error"):
                print("  " + line, flush=True)
        seen = len(lines)
        on_tick()
        if not proc.alive():
            return
        time.sleep(1.0)


def _smooth(values: list[float], window: int = 5) -> list[float]:
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def plot(metrics: list[dict], before: float, after: float, steps: int, path: Path, task: str) -> None:
    """Training reward and held-out accuracy on top; the docs/design.md §5 diagnostics below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [m["step"] for m in metrics]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    ax = axes[0][0]
    reward = [m["reward/mean"] for m in metrics]
    ax.plot(x, reward, "o", alpha=0.35, label="per step (training batch)")
    ax.plot(x, _smooth(reward), "-", lw=2, label="5-step mean")
    ax.set(
        xlabel="optimizer step", ylabel="mean reward (fraction correct)", title="Training reward", ylim=(0, 1)
    )
    ax.legend(loc="lower right")
    ax = axes[0][1]
    ax.bar(["before (v0)", f"after (v{steps})"], [100 * before, 100 * after], color=["#999999", "#2a7ab9"])
    for i, v in enumerate([before, after]):
        ax.text(i, 100 * v + 1, f"{100 * v:.1f}%", ha="center")
    ax.set(ylabel="held-out accuracy, greedy pass@1 (%)", title="Held-out accuracy", ylim=(0, 100))
    kl = ("kl/ref", "k3 estimate", "KL to the reference (base model)")
    if all(m.get("kl/ref") is None for m in metrics):  # beta = 0: no reference pass, so the entropy instead
        kl = ("policy/entropy", "nats per token", "Policy entropy (no KL term: beta = 0)")
    panels = [
        (axes[0][2], "groups/degenerate", "fraction of groups", "Degenerate groups (all rewards equal)"),
        (axes[1][0], "completion/length", "tokens", "Completion length"),
        (axes[1][1], *kl),
        (axes[1][2], "ratio/clipfrac", "fraction of tokens", "PPO clip fraction"),
    ]
    for ax, key, ylabel, title in panels:
        y = [float("nan") if m.get(key) is None else m[key] for m in metrics]
        ax.plot(x, y, "o", alpha=0.35)
        ax.plot(x, _smooth(y), "-", lw=2)
        ax.set(xlabel="optimizer step", ylabel=ylabel, title=title)
    fig.suptitle(f"tandem: GRPO on SmolLM2-135M-Instruct (CPU, {task})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="deploy/configs/cpu.toml")
    p.add_argument(
        "--steps", type=int, default=None, help="optimizer steps (default: 24 in bf16, else the config's)"
    )
    p.add_argument("--eval-problems", type=int, default=100, help="held-out problems to score before/after")
    p.add_argument(
        "--seed", type=int, default=None, help="seed of data order, sampling, LoRA init (default: config)"
    )
    p.add_argument("--out", default=None, help="run folder (default: runs/demo-<time>)")
    p.add_argument(
        "overrides", nargs="*", metavar="--section.key=value", help="config overrides for both processes"
    )
    args, extra = p.parse_known_args()
    extra = [*args.overrides, *extra]
    bad = [o for o in extra if not (o.startswith("--") and "=" in o)]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)} (config overrides look like --section.key=value)")

    t_start = time.time()
    out = Path(args.out or REPO / "runs" / time.strftime("demo-%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    # the precision this run will have: auto, unless an override of yours names one
    demo = demo_choices(
        load_config(REPO / args.config, ["model.dtype=auto", *(o[2:] for o in extra)]).model.dtype
    )
    overrides = [
        *demo,
        f"--server.port={port}",
        f"--server.state_dir={out / 'server'}",
        f"--learner.server_urls=http://127.0.0.1:{port}",
        f"--learner.out_dir={out / 'learner'}",
    ]
    if args.steps:
        overrides.append(f"--learner.steps={args.steps}")
    if args.seed is not None:  # data order, sampling and LoRA init
        overrides += [f"--data.seed={args.seed}", f"--server.seed={args.seed}", f"--learner.seed={args.seed}"]
    overrides += extra
    cfg = load_config(REPO / args.config, [o[2:] for o in overrides])
    token = secrets.token_hex(16)
    env = tandem_env(token)
    env.setdefault("OMP_NUM_THREADS", "2")  # time-sliced: the two processes take turns

    print(f"tandem demo -> {out}\n{args.config} + {' '.join(o[2:] for o in demo)} ({cfg.model.dtype})\n")
    print(f"1/4 starting the rollout server ({cfg.server.backend} backend on CPU) ...", flush=True)
    server = Proc(["-m", "rollout_server", "--config", args.config, *overrides], out / "server.log", env)
    learner = None
    rss = PeakRss()
    try:
        wait_healthy(server, cfg.learner.server_urls[0])
        client = RolloutClient(cfg.learner.server_urls[0], token=token)
        print(
            f"2/4 held-out accuracy of the base model ({args.eval_problems} problems, greedy) ...", flush=True
        )
        before = evaluate(client, cfg, 0, args.eval_problems)
        print(f"    before: {100 * before['pass@1_greedy']:.1f}%\n", flush=True)

        print(
            f"3/4 GRPO training, {cfg.learner.steps} steps (G={cfg.sampling.group_size}, "
            f"{cfg.learner.prompts_per_step} prompts/step) ...",
            flush=True,
        )
        learner = Proc(["-m", "learner", "--config", args.config, *overrides], out / "learner.log", env)
        follow(
            learner,
            out / "learner.log",
            on_tick=lambda: (rss.sample("rollout_server", server), rss.sample("learner", learner)),
        )
        if learner.returncode != 0:
            print(f"the learner failed (exit {learner.returncode}); see {out / 'learner.log'}")
            return 1

        print("\n4/4 held-out accuracy after training ...", flush=True)
        after = evaluate(client, cfg, None, args.eval_problems)
    finally:
        if learner is not None:
            learner.stop()
        server.stop()

    metrics = [json.loads(line) for line in (out / "learner" / "metrics.jsonl").read_text().splitlines()]
    names = {"arith": "arithmetic word problems", "gsm8k": "GSM8K"}
    task = names.get(cfg.data.task, f"your task, {Path(cfg.data.path or '.').name}")
    if cfg.env.kind != "single_turn":
        task += f", {cfg.env.kind} episodes"
    plot(metrics, before["pass@1_greedy"], after["pass@1_greedy"], after["version"], out / "curves.png", task)
    summary = {
        "held_out_accuracy_before": before["pass@1_greedy"],
        "held_out_accuracy_after": after["pass@1_greedy"],
        "eval_problems": before["problems"],
        "steps": len(metrics),
        "final_version": after["version"],
        "wall_clock_s": round(time.time() - t_start, 1),
        "peak_rss_mib": {k: round(v) for k, v in rss.peak_mib.items()},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    delta = 100 * (after["pass@1_greedy"] - before["pass@1_greedy"])
    print(
        f"\n=== summary ===\n"
        f"held-out accuracy: {100 * before['pass@1_greedy']:.1f}% -> {100 * after['pass@1_greedy']:.1f}% "
        f"({delta:+.1f} points, {before['problems']} problems, greedy pass@1)\n"
        f"steps: {len(metrics)}   wall clock: {summary['wall_clock_s'] / 60:.1f} min\n"
        f"curves: {out / 'curves.png'}\nmetrics: {out / 'learner' / 'metrics.jsonl'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The rollout server's memory as versions go by: each of its processes' resident memory, and its slope.

    .venv/bin/python scripts/bench_server_memory.py [--versions 60] [--train] [--with-env NAME=VALUE[,...]]

Starts the vLLM server of deploy/configs/cpu.toml in bf16 (where the CPU computes in it; else fp32) with
the demo's batches (4 prompts x G 8, 32 tokens), and N times, time-sliced as the learner does: sleep,
publish a new version (three random adapters in turn), wake, pull and ack until a group of that version
arrives. With --train, the real learner trains N steps on it instead (the demo's run: 4 prompts a step,
dynamic sampling). Samples the resident memory of the app and of each of vLLM's processes every 5 versions
and prints it, then each process's growth per version over the second half of the run (after warm-up).
Each --with-env is one more run with those environment variables in the server's processes (e.g.
MALLOC_ARENA_MAX=1, or several joined by commas), side by side, and the ratio of its worker's growth to the
baseline's (docs/benchmarks.md §6b). With --max-growth, exits 1 when a process of the first run grows faster
than that: a check a soak can run.
"""

from __future__ import annotations

import argparse
import secrets
import sys
import tempfile
from pathlib import Path

from harness.adapters import random_adapter
from harness.net import free_port
from harness.procs import pull_until_version, start_server, tandem_env
from learner.client import RolloutClient
from shared.config import native_dtype
from shared.models import resolve_model


def resident(pid: int) -> dict[str, float]:
    """MiB resident of the server process and each of its descendants, by process name."""
    import psutil

    p = psutil.Process(pid)
    out = {"app": p.memory_info().rss / 2**20}
    for c in p.children(recursive=True):
        try:
            out[c.name()[:20]] = c.memory_info().rss / 2**20
        except psutil.Error:
            continue
    return out


def train(name: str, env: dict, steps: int, work: Path) -> list[tuple[int, dict[str, float]]]:
    """The demo's run for `steps` steps; resident memory of the server's processes after every 5th."""
    import time

    from harness.procs import Proc

    port, token, out = free_port(), secrets.token_hex(8), work / f"train-{name}"
    cli = [
        f"--model.dtype={native_dtype()}",
        *("--learner.prompts_per_step=4", "--server.queue_size=8"),  # the demo's
        f"--learner.steps={steps}",
        f"--server.state_dir={out / 'server'}",
        f"--learner.out_dir={out / 'learner'}",
        f"--learner.server_urls=http://127.0.0.1:{port}",
    ]
    server, _ = start_server(
        "deploy/configs/cpu.toml", cli, port, work / f"server-{name}.log", tandem_env(token, **env)
    )
    learner = Proc(
        ["-m", "learner", "--config", "deploy/configs/cpu.toml", *cli],
        work / f"learner-{name}.log",
        tandem_env(token),
    )
    samples, metrics = [], out / "learner" / "metrics.jsonl"
    try:
        while learner.alive():
            step = len(metrics.read_text().splitlines()) if metrics.exists() else 0
            if step and step % 5 == 0 and (not samples or samples[-1][0] != step):
                samples.append((step, resident(server.pid)))
                print(
                    f"  [{name}] step {step}: "
                    + ", ".join(f"{k} {m:.0f}" for k, m in samples[-1][1].items()),
                    flush=True,
                )
            time.sleep(1.0)
        if learner.returncode != 0:
            raise RuntimeError(f"the learner failed: {learner.log()[-3000:]}")
    finally:
        learner.stop()
        server.stop(timeout=60)
    return samples


def run(
    name: str, env: dict, versions: int, adapters: list[Path], work: Path
) -> list[tuple[int, dict[str, float]]]:
    port, token = free_port(), secrets.token_hex(8)
    cli = [
        f"--model.dtype={native_dtype()}",
        f"--server.state_dir={work / f'server-{name}'}",
        "--sampling.max_new_tokens=32",
        "--server.prompts_per_batch=4",
        "--server.queue_size=4",
    ]
    server, url = start_server(
        "deploy/configs/cpu.toml", cli, port, work / f"server-{name}.log", tandem_env(token, **env)
    )
    client, samples = RolloutClient(url, token=token), []
    try:
        for v in range(1, versions + 1):
            client.sleep()
            client.publish(v, adapters[v % len(adapters)])
            client.wake()
            pull_until_version(client, v, max_groups=4, wait_s=300)
            if v == 1 or v % 5 == 0:
                samples.append((v, resident(server.pid)))
                print(
                    f"  [{name}] v{v}: " + ", ".join(f"{k} {m:.0f}" for k, m in samples[-1][1].items()),
                    flush=True,
                )
    finally:
        client.close()
        server.stop(timeout=60)
    return samples


def slope(samples: list[tuple[int, dict[str, float]]], name: str) -> float:
    """MiB per version of process `name`, least squares over the second half of the samples."""
    half = [(v, s[name]) for v, s in samples[len(samples) // 2 :] if name in s]
    n = len(half)
    mx, my = sum(v for v, _ in half) / n, sum(m for _, m in half) / n
    return sum((v - mx) * (m - my) for v, m in half) / sum((v - mx) ** 2 for v, _ in half)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--versions", type=int, default=60, help="versions (or --train steps) per run (>= 20)")
    p.add_argument("--train", action="store_true", help="the real learner trains --versions steps instead")
    p.add_argument(
        "--with-env",
        action="append",
        default=[],
        metavar="NAME=VALUE[,...]",
        help="one more run with these in the server's environment, side by side (repeat for more runs)",
    )
    p.add_argument(
        "--max-growth",
        type=float,
        default=None,
        metavar="MIB",
        help="exit 1 when a process of the first run grows faster than this (MiB per version/step)",
    )
    args = p.parse_args()
    if args.versions < 20:
        p.error("--versions must be >= 20: the slope is taken over the second half")
    variants = [[kv.strip() for kv in e.split(",") if kv.strip()] for e in args.with_env]
    if any(not v or any("=" not in kv for kv in v) for v in variants):
        p.error("--with-env takes NAME=VALUE, or several joined by commas")
    work = Path(tempfile.mkdtemp(prefix="tandem-bench-memory-"))
    model = resolve_model("smollm2-135m")
    adapters = (
        [] if args.train else [random_adapter(model, work / f"a{i}", seed=i, scale=0.01) for i in range(3)]
    )
    runs = {"baseline": {}}
    for v in variants:
        runs[" ".join(v)] = dict(kv.split("=", 1) for kv in v)
    what = "training steps" if args.train else "versions, time-sliced"
    results = {}
    for i, (name, env) in enumerate(runs.items()):  # tag: its files and progress lines
        print(f"[{name}] {args.versions} {what} ...", flush=True)
        tag = "baseline" if i == 0 else f"with-env-{i}"
        if args.train:
            results[name] = train(tag, env, args.versions, work)
        else:
            results[name] = run(tag, env, args.versions, adapters, work)
    per = "step" if args.train else "version"
    print(f"\nresident memory growth per {per}, {per}s {args.versions // 2}..{args.versions} (MiB/{per}):")
    for name, samples in results.items():
        print(f"  [{name}] " + ", ".join(f"{k} {slope(samples, k):+.2f}" for k in samples[-1][1]))
    (a, sa), *others = results.items()
    worker = next(k for k in sa[-1][1] if "Worker" in k)
    for b, sb in others:
        print(f"vLLM worker's growth, [{b}] / [{a}]: {slope(sb, worker) / slope(sa, worker):.2f}")
    if args.max_growth is not None:
        over = {k: slope(sa, k) for k in sa[-1][1] if slope(sa, k) > args.max_growth}
        if over:
            print(
                f"FAIL: growing more than {args.max_growth} MiB/{per}: "
                + ", ".join(f"{k} {v:+.2f}" for k, v in over.items())
            )
            return 1
        print(f"ok: no process grows more than {args.max_growth} MiB/{per}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

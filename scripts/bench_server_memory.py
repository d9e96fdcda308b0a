"""The rollout server's memory per version served: each process's resident memory as versions go by.

    .venv/bin/python scripts/bench_server_memory.py [--versions 60] [--arenas 1,0] [--train]

For each value of server.vllm.malloc_arena_max (0: glibc's default), starts the vLLM server of
deploy/configs/cpu.toml in bf16 (where the CPU computes in it; else fp32) with the demo's batches (4 prompts
x G 8, 32 tokens), and N times, time-sliced as the learner does: sleep, publish a new version (three random
adapters in turn), wake, pull and ack until a group of that version arrives. With --train, the real
learner instead trains N steps on it (the demo's run: 4 prompts a step). Samples the resident memory of the
app and of each of vLLM's processes every 5 versions and prints it, then each process's growth per version
over the second half of the run (after warm-up), and the worker's growth with the default arenas over that
with the setting.
"""

from __future__ import annotations

import argparse
import secrets
import sys
import tempfile
from pathlib import Path

from learner.client import RolloutClient
from shared.config import native_dtype
from shared.models import random_adapter, resolve_model
from shared.net import free_port
from shared.procs import start_server, tandem_env


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


def train(arenas: int, steps: int, work: Path) -> list[tuple[int, dict[str, float]]]:
    """The demo's run for `steps` steps; resident memory of the server's processes after every 5th."""
    import time

    from shared.procs import Proc

    port, token, out = free_port(), secrets.token_hex(8), work / f"train-{arenas}"
    cli = [
        f"--model.dtype={native_dtype()}",
        f"--server.vllm.malloc_arena_max={arenas}",
        *("--learner.prompts_per_step=4", "--learner.grad_accum=4", "--server.queue_size=8"),  # the demo's
        f"--learner.steps={steps}",
        f"--server.state_dir={out / 'server'}",
        f"--learner.out_dir={out / 'learner'}",
        f"--learner.server_url=http://127.0.0.1:{port}",
    ]
    server, _ = start_server(
        "deploy/configs/cpu.toml", cli, port, work / f"server-{arenas}.log", tandem_env(token)
    )
    learner = Proc(
        ["-m", "learner", "--config", "deploy/configs/cpu.toml", *cli],
        work / f"learner-{arenas}.log",
        tandem_env(token),
    )
    samples, metrics = [], out / "learner" / "metrics.jsonl"
    try:
        while learner.alive():
            step = len(metrics.read_text().splitlines()) if metrics.exists() else 0
            if step and step % 5 == 0 and (not samples or samples[-1][0] != step):
                samples.append((step, resident(server.pid)))
                print(
                    f"  arenas={arenas} step {step}: "
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


def run(arenas: int, versions: int, adapters: list[Path], work: Path) -> list[tuple[int, dict[str, float]]]:
    port, token = free_port(), secrets.token_hex(8)
    cli = [
        f"--model.dtype={native_dtype()}",
        f"--server.state_dir={work / f'server-{arenas}'}",
        f"--server.vllm.malloc_arena_max={arenas}",
        "--sampling.max_new_tokens=32",
        "--server.prompts_per_batch=4",
        "--server.queue_size=4",
    ]
    server, url = start_server(
        "deploy/configs/cpu.toml", cli, port, work / f"server-{arenas}.log", tandem_env(token)
    )
    client, samples = RolloutClient(url, token=token), []
    try:
        for v in range(1, versions + 1):
            client.sleep()
            client.publish(v, adapters[v % len(adapters)])
            client.wake()
            while True:
                pulled = client.pull(4, wait_s=300)
                if pulled.lease_id:
                    client.ack(pulled.lease_id)
                if any(g.policy_version >= v for g in pulled.groups):
                    break
            if v == 1 or v % 5 == 0:
                samples.append((v, resident(server.pid)))
                print(
                    f"  arenas={arenas} v{v}: "
                    + ", ".join(f"{k} {m:.0f}" for k, m in samples[-1][1].items()),
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
    p.add_argument("--versions", type=int, default=60, help="versions published per server (>= 20)")
    p.add_argument(
        "--arenas", default="1,0", help="malloc_arena_max values to run, side by side (0: default)"
    )
    args = p.parse_args()
    if args.versions < 20:
        p.error("--versions must be >= 20: the slope is taken over the second half")
    work = Path(tempfile.mkdtemp(prefix="tandem-bench-memory-"))
    model = resolve_model("smollm2-135m")
    adapters = (
        [] if args.train else [random_adapter(model, work / f"a{i}", seed=i, scale=0.01) for i in range(3)]
    )
    results = {}
    for arenas in (int(a) for a in args.arenas.split(",")):
        what = "training steps" if args.train else "versions, time-sliced"
        print(f"server.vllm.malloc_arena_max={arenas}: {args.versions} {what} ...", flush=True)
        if args.train:
            results[arenas] = train(arenas, args.versions, work)
        else:
            results[arenas] = run(arenas, args.versions, adapters, work)
    print(
        f"\nresident memory growth per version, versions {args.versions // 2}..{args.versions} (MiB/version):"
    )
    for arenas, samples in results.items():
        names = samples[-1][1]
        print(f"  malloc_arena_max={arenas}: " + ", ".join(f"{k} {slope(samples, k):+.2f}" for k in names))
    if 0 in results and 1 in results:
        worker = next(k for k in results[0][-1][1] if "Worker" in k)
        a, b = slope(results[0], worker), slope(results[1], worker)
        print(f"worker growth, glibc's default arenas / one arena: {a:.2f} / {b:.2f} MiB per version")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Training production while the OpenAI-compatible endpoints serve evaluation traffic, side by side.

    .venv/bin/python scripts/bench_openai.py [--window 60] [--clients 16] [--max-sequences 8]

Starts a rollout server (the config's backend; vLLM with merged versions on CPU), publishes a LoRA adapter
as v1 and keeps a learner-like puller draining the queue, so production never pauses for a full queue.
Then, one window each: no evaluation; `--clients` threads sending chat completions (greedy, 32 tokens)
for `latest` (the served version); the same for `base` (another version than the served one: with
server.adapter_mode = "merge" the engine's weights are switched between the two). Prints training
production (groups and completion tokens per second) in each window and its ratio to the window without
evaluation, and the evaluation throughput: the priority rule of rollout_server/serving/openai_api.py,
measured.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from harness.adapters import random_adapter
from harness.net import free_port
from harness.procs import start_server, tandem_env
from learner.client import RolloutClient
from shared.models import resolve_model

QUESTION = "Liam has 13 cards. Liam gives away 8. How many cards does Liam have now?"


class Drainer(threading.Thread):
    """Pulls and acks every group, as a learner that never falls behind; counts what it got."""

    def __init__(self, client: RolloutClient):
        super().__init__(daemon=True)
        self.client, self.groups, self.tokens, self.stop = client, 0, 0, threading.Event()

    def run(self):
        while not self.stop.is_set():
            pulled = self.client.pull(16, wait_s=2)
            if pulled.lease_id:
                self.client.ack(pulled.lease_id)
            self.groups += len(pulled.groups)
            self.tokens += sum(len(c.token_ids) for g in pulled.groups for c in g.completions)


class Evaluator(threading.Thread):
    def __init__(self, url: str, token: str, model: str, stop: threading.Event):
        super().__init__(daemon=True)
        self.url, self.token, self.model, self.stop = url, token, model, stop
        self.requests, self.tokens, self.errors = 0, 0, 0

    def run(self):
        body = {"model": self.model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 32,
                "temperature": 0}  # fmt: skip
        with httpx.Client(timeout=600, headers={"Authorization": f"Bearer {self.token}"}) as http:
            while not self.stop.is_set():
                r = http.post(f"{self.url}/v1/chat/completions", json=body)
                if r.status_code != 200:
                    self.errors += 1
                    time.sleep(1)
                    continue
                self.requests += 1
                self.tokens += r.json()["usage"]["completion_tokens"]


def window(drainer: Drainer, seconds: float, url: str, token: str, model: str | None, clients: int) -> dict:
    stop = threading.Event()
    evals = [Evaluator(url, token, model, stop) for _ in range(clients if model else 0)]
    for e in evals:
        e.start()
    if evals:
        time.sleep(min(10.0, seconds / 4))  # the evaluation load reaches its steady state first
    g0, t0, start = drainer.groups, drainer.tokens, time.perf_counter()
    e0 = [(e.requests, e.tokens) for e in evals]
    time.sleep(seconds)
    elapsed = time.perf_counter() - start
    out = {
        "evaluating": model or "nothing",
        "groups_per_s": (drainer.groups - g0) / elapsed,
        "completion_tokens_per_s": (drainer.tokens - t0) / elapsed,
        "eval_requests_per_s": sum(e.requests - r for e, (r, _) in zip(evals, e0, strict=True)) / elapsed,
        "eval_tokens_per_s": sum(e.tokens - t for e, (_, t) in zip(evals, e0, strict=True)) / elapsed,
        "eval_errors": sum(e.errors for e in evals),
    }
    stop.set()
    for e in evals:
        e.join(timeout=600)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="deploy/configs/cpu.toml")
    p.add_argument("--window", type=float, default=60.0, help="seconds measured per scenario")
    p.add_argument(
        "--clients", type=int, default=16, help="concurrent evaluation clients (more than the cap)"
    )
    p.add_argument(
        "--max-sequences", type=int, default=None, help="server.openai_max_sequences (default: the config's)"
    )
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="tandem-bench-openai-"))
    port, token = free_port(), secrets.token_hex(8)
    cli = [f"--server.state_dir={work / 'server'}", "--server.queue_size=64"]
    if args.max_sequences:
        cli.append(f"--server.openai_max_sequences={args.max_sequences}")
    adapter = random_adapter(resolve_model("smollm2-135m"), work / "adapter", scale=0.01)
    print(f"starting the server ({args.config}) ...", flush=True)
    server, url = start_server(args.config, cli, port, work / "server.log", tandem_env(token))
    results = []
    try:
        client = RolloutClient(url, token=token)
        client.publish(1, adapter)
        drainer = Drainer(client)
        drainer.start()
        while drainer.groups < 8:  # warm: the first batches on v1 are done
            time.sleep(1)
        for model in (None, "latest", "base"):
            r = window(drainer, args.window, url, token, model, args.clients)
            results.append(r)
            print(
                f"  evaluating {r['evaluating']:>8}: production {r['groups_per_s'] * 60:6.1f} groups/min, "
                f"{r['completion_tokens_per_s']:6.1f} tokens/s; evaluation "
                f"{r['eval_requests_per_s'] * 60:6.1f} requests/min, {r['eval_tokens_per_s']:5.1f} tokens/s "
                f"({r['eval_errors']} errors)",
                flush=True,
            )
        drainer.stop.set()
    finally:
        server.stop(timeout=60)
    base = results[0]["completion_tokens_per_s"]
    print(f"\n{args.clients} evaluation clients, server.openai_max_sequences="
          f"{args.max_sequences or 'the config default'}; production relative to no evaluation:")  # fmt: skip
    for r in results[1:]:
        print(f"  evaluating {r['evaluating']:>8}: {r['completion_tokens_per_s'] / base:.2f}x the tokens/s")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "windows": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

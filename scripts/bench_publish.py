"""Adapter publish -> the server's 200, and -> the first group produced under the new version: p50/p95.

    .venv/bin/python scripts/bench_publish.py [--publishes 20] [--backend hf|vllm] [--modes always,timeslice]

Starts a rollout server (the config's; small batches so that one generation batch is short) and, for each
mode, N times uploads a LoRA r16 adapter as version v (HTTP multipart, as the learner does) and pulls (and
acks) groups until one stamped v arrives. `always`: the server produces throughout (split placement).
`timeslice`: the server is put to sleep, the adapter published, the server woken (as the time-sliced
learner does). Prints the upload alone (until the 200), publish -> first group, the server-side phases of
a publish (receive, validate, store, load; from /metrics) and, with the vLLM merge mode, the weight switch
(from the server's log), and the server's peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness.adapters import random_adapter
from harness.net import free_port
from harness.procs import pull_until_version, start_server, tandem_env
from learner.client import RolloutClient
from shared.models import resolve_model

REPO = Path(__file__).resolve().parents[1]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def phases(client: RolloutClient) -> dict[str, float]:
    """Seconds spent so far in each publish phase, from the server's /metrics."""
    out = {}
    for line in client._http.get("/metrics").text.splitlines():
        m = re.match(r'tandem_publish_phase_seconds_total\{phase="(\w+)"\} (\S+)', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def switch_times(log: Path) -> list[float]:
    """Seconds of each weight switch the server logged (vLLM merge mode)."""
    pattern = r"weights switched to .*? in ([0-9.]+) s"
    return [float(x) for x in re.findall(pattern, log.read_text(errors="replace"))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="deploy/configs/cpu.toml")
    p.add_argument("--backend", choices=["hf", "vllm"], default="hf")
    p.add_argument("--publishes", type=int, default=20)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--modes", default="always,timeslice", help="always, timeslice, or both (comma-separated)")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args()
    if not set(args.modes.split(",")) <= {"always", "timeslice"}:
        p.error("--modes takes always and/or timeslice")
    if args.publishes < 2:
        p.error("--publishes must be >= 2")
    import psutil

    work = Path(tempfile.mkdtemp(prefix="tandem-bench-publish-"))
    port, token = free_port(), secrets.token_hex(8)
    cli = [
        f"--server.backend={args.backend}",
        f"--server.state_dir={work / 'server'}",
        f"--sampling.group_size={args.group_size}",
        f"--sampling.max_new_tokens={args.max_tokens}",
        "--server.prompts_per_batch=1",
        "--server.queue_size=2",
    ]
    adapter = random_adapter(resolve_model("smollm2-135m"), work / "adapter", scale=0.01)
    server, url = start_server(args.config, cli, port, work / "server.log", tandem_env(token))
    result: dict = {"backend": args.backend, "config": args.config, "publishes_per_mode": args.publishes}
    result["workload"] = f"1 prompt per batch, G={args.group_size}, <= {args.max_tokens} new tokens, LoRA r16"
    peak_rss, v = 0, 0
    try:
        client = RolloutClient(url, token=token)
        print(f"server up ({args.backend}); {args.publishes} publishes per mode ...", flush=True)
        for mode in args.modes.split(","):
            latencies, uploads, before = [], [], phases(client)
            switches = len(switch_times(work / "server.log"))
            for _ in range(args.publishes):
                v += 1
                if mode == "timeslice":
                    client.sleep()
                t0 = time.perf_counter()
                client.publish(v, adapter)
                uploads.append(time.perf_counter() - t0)
                if mode == "timeslice":
                    client.wake()
                pull_until_version(client, v)
                latencies.append(time.perf_counter() - t0)
                tree = psutil.Process(server.pid)
                peak_rss = max(
                    peak_rss, sum(x.memory_info().rss for x in [tree, *tree.children(recursive=True)])
                )
                print(
                    f"  [{mode}] v{v}: {latencies[-1]:.2f} s (upload {uploads[-1] * 1000:.0f} ms)", flush=True
                )
            after = phases(client)
            merges = switch_times(work / "server.log")[switches:]
            result[mode] = {
                "first_group_p50_s": statistics.median(latencies),
                "first_group_p95_s": percentile(latencies, 95),
                "upload_p50_s": statistics.median(uploads),
                "upload_p95_s": percentile(uploads, 95),
                "server_phases_mean_ms": {
                    k: 1000 * (after[k] - before.get(k, 0.0)) / args.publishes for k in after
                },
                "weight_switch_mean_ms": 1000 * statistics.mean(merges) if merges else None,
                "latencies_s": latencies,
            }
    finally:
        server.stop(timeout=60)
    result["server_peak_rss_mib"] = peak_rss / 2**20
    for mode in args.modes.split(","):
        r = result[mode]
        ph = ", ".join(f"{k} {ms:.0f}" for k, ms in r["server_phases_mean_ms"].items())
        switch = f"; weight switch {r['weight_switch_mean_ms']:.0f} ms" if r["weight_switch_mean_ms"] else ""
        print(
            f"\n[{mode}] {args.publishes} publishes, {args.backend}: publish -> 200 p50 "
            f"{r['upload_p50_s'] * 1000:.0f} ms (p95 {r['upload_p95_s'] * 1000:.0f}); publish -> first group "
            f"p50 {r['first_group_p50_s']:.2f} s, p95 {r['first_group_p95_s']:.2f} s\n"
            f"  server phases (mean ms): {ph}{switch}"
        )
    print(f"server peak RSS {result['server_peak_rss_mib']:.0f} MiB")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

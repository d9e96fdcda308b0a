"""Adapter publish -> first group produced under the new version: p50 and p95 over N publishes.

    .venv/bin/python scripts/bench_publish.py [--publishes 20] [--backend hf|vllm]

Starts a rollout server (deploy/configs/cpu.toml, small batches so that one generation batch is short),
then N times: upload a LoRA adapter as version v (HTTP multipart, as the learner does), and pull (and ack)
groups until one stamped with version v arrives. The latency is from the start of the upload to that
pull's answer: upload + validation + engine load + the batch in flight when the adapter arrived + one
batch under v. Also prints the upload alone and the server's peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

from learner.client import RolloutClient
from shared.models import resolve_model
from shared.net import free_port
from shared.procs import start_server, tandem_env

REPO = Path(__file__).resolve().parents[1]


def make_adapter(model_dir: str, out: Path) -> Path:
    """A LoRA adapter of the config's shape (r16 on q/k/v/o) with small non-zero B."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    model.save_pretrained(out)
    return out


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="deploy/configs/cpu.toml")
    p.add_argument("--backend", choices=["hf", "vllm"], default="hf")
    p.add_argument("--publishes", type=int, default=20)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args()
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
    adapter = make_adapter(resolve_model("smollm2-135m"), work / "adapter")
    server, url = start_server(args.config, cli, port, work / "server.log", tandem_env(token))
    latencies, uploads, peak_rss = [], [], 0
    try:
        client = RolloutClient(url, token=token)
        print(f"server up ({args.backend}); {args.publishes} publishes ...", flush=True)
        for v in range(1, args.publishes + 1):
            t0 = time.perf_counter()
            client.publish(v, adapter)
            uploads.append(time.perf_counter() - t0)
            while True:
                pulled = client.pull(2, wait_s=120)
                if pulled.lease_id:
                    client.ack(pulled.lease_id)
                if any(g.policy_version >= v for g in pulled.groups):
                    break
            latencies.append(time.perf_counter() - t0)
            tree = psutil.Process(server.pid)
            rss = sum(x.memory_info().rss for x in [tree, *tree.children(recursive=True)])
            peak_rss = max(peak_rss, rss)
            print(f"  v{v}: {latencies[-1]:.2f} s (upload {uploads[-1] * 1000:.0f} ms)", flush=True)
    finally:
        server.stop(timeout=60)
    result = {
        "backend": args.backend,
        "workload": f"1 prompt per batch, G={args.group_size}, <= {args.max_tokens} new tokens, LoRA r16",
        "publishes": args.publishes,
        "latency_p50_s": statistics.median(latencies),
        "latency_p95_s": percentile(latencies, 95),
        "upload_p50_s": statistics.median(uploads),
        "server_peak_rss_mib": peak_rss / 2**20,
        "latencies_s": latencies,
    }
    print(
        f"\npublish -> first group under the new version ({args.publishes} publishes, {args.backend}): "
        f"p50 {result['latency_p50_s']:.2f} s, p95 {result['latency_p95_s']:.2f} s; "
        f"upload alone p50 {result['upload_p50_s'] * 1000:.0f} ms; "
        f"server peak RSS {result['server_peak_rss_mib']:.0f} MiB"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

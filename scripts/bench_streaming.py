"""Lockstep against continuous production (and in-flight weight updates) on the real engine, side by side
in one process.

    .venv/bin/python scripts/bench_streaming.py [--seconds 150] [--rounds 2] [--max-tokens 256]
        [--prompts 4] [--group-size 8] [--modes lockstep,continuous[,inflight]] [--publish-every S]
        [--set K=V ...]

One vLLM engine (the config's, merged weights, `--prompts` x G slots: server.vllm.max_num_seqs), built once;
for each mode in turn (alternating, `--rounds` times), a producer on a fresh state folder feeds a queue that
a consumer drains at once (pull, ack: a learner that is never the bottleneck), for `--seconds` after a
warm-up group. Lockstep: `--prompts` prompts x G a batch, the slots exactly; continuous: its default groups
in flight (twice the groups that fill the slots; the extra wait in vLLM's queue). GSM8K train prompts,
temperature 1, completions capped at `--max-tokens`: SmolLM2's answer lengths vary widely within a batch,
which is what the tail costs lockstep. Prints, per mode: engine tokens/s
(completion tokens of the groups queued in the window), the fraction of the window in which fewer than half
of the slots were decoding and the slots busy on average (vLLM's unfinished requests up to the slots,
sampled every 50 ms), groups/min, and the ratio.

`--publish-every S` publishes a new version every S seconds during each window (a learner that steps that
often; the same random LoRA weights under each new version number), and each mode's tokens are then also
measured for staleness: per token, the version served when its group was queued less the version that
sampled it (mean and 95th percentile). Mode `inflight` is continuous production with
server.inflight_updates = "continue" (a publish moves the samples in flight to the new version); it needs
LoRA adapters in the engine, so with it every mode runs on one engine in LoRA mode (vLLM's LoRA path: ~1/3
of the merged weights' speed on CPU), and without it on merged weights as before.
Numbers and the machine: docs/benchmarks.md. The learner's side (held-out accuracy after the same wall
clock, learner idle, steps per minute, token lag with a real learner): scripts/bench_streaming_learning.py.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from shared.config import load_config
from shared.datasets import load_gsm8k
from shared.models import resolve_model

REPO = Path(__file__).resolve().parents[1]


async def one_window(mode: str, backend, problems, args, work: Path) -> dict:
    from rollout_server.serving.app import Server

    overrides = [
        f"server.production={'lockstep' if mode == 'lockstep' else 'continuous'}",
        f"server.inflight_updates={'continue' if mode == 'inflight' else 'off'}",
        f"server.adapter_mode={'lora' if 'inflight' in args.modes else 'merge'}",
        "server.max_loras=4",  # the versions a group in flight may hold while newer ones are published
        f"server.prompts_per_batch={args.prompts}",
        f"server.queue_size={4 * args.prompts}",
        f"server.state_dir={work}",
        f"server.vllm.max_num_seqs={args.prompts * args.group_size}",
        f"sampling.group_size={args.group_size}",
        f"sampling.max_new_tokens={args.max_tokens}",
        "sampling.temperature=1.0",
        *args.set,
    ]
    cfg = load_config(args.config, overrides)
    server = Server(cfg, backend, problems, resolve_model(cfg.model.name))
    producer, queue = server.producer, server.queue
    slots = args.prompts * args.group_size
    state = {"tokens": 0, "groups": 0, "counting": False}
    lags: list[int] = []  # per token: the version served when its group was queued, less its own

    async def consume():
        while True:
            lease, groups = await queue.pull(64, wait_s=1.0)
            if lease is None:
                continue
            await queue.ack(lease)
            if state["counting"]:
                state["groups"] += len(groups)
                state["tokens"] += sum(len(c.token_ids) for g in groups for c in g.completions)
                for g in groups:
                    lags.extend(g.token_lags(server.policy.version))

    async def publish():
        config, weights = (args.adapter / f for f in ("adapter_config.json", "adapter_model.safetensors"))
        while True:
            await asyncio.sleep(args.publish_every)
            version = server.policy.version + 1
            await server.policy.publish(
                version, lambda v: server.store.write(v, config.read_bytes(), weights.read_bytes())
            )

    busy = []

    async def sample_slots():
        unfinished = backend.engine.output_processor.get_num_unfinished_requests
        while True:
            busy.append(min(unfinished(), slots))  # beyond the slots: waiting in vLLM's queue
            await asyncio.sleep(0.05)

    run = asyncio.create_task(producer.run())
    drain = asyncio.create_task(consume())
    while not queue.acked_total:  # warm-up: the first group through
        await asyncio.sleep(0.1)
    sampler = asyncio.create_task(sample_slots())
    publisher = asyncio.create_task(publish() if args.publish_every else asyncio.sleep(0))
    state["counting"], t0 = True, time.perf_counter()
    await asyncio.sleep(args.seconds)
    state["counting"], elapsed = False, time.perf_counter() - t0
    for task in (publisher, sampler, drain, run):
        task.cancel()
    await asyncio.gather(publisher, sampler, drain, run, return_exceptions=True)
    await producer.stop()
    server.journal.close()
    return {
        "tok_s": state["tokens"] / elapsed,
        "groups_s": state["groups"] / elapsed,
        "underused": sum(b < slots / 2 for b in busy) / max(len(busy), 1),
        "busy": statistics.mean(busy) if busy else 0.0,
        "lag": statistics.mean(lags) if lags else 0.0,
        "lag_p95": sorted(lags)[int(0.95 * (len(lags) - 1))] if lags else 0,
        "continued": server.metrics.samples_continued._value.get(),
    }


async def bench(args) -> dict[str, list[dict]]:
    from rollout_server.serving.serve import make_backend

    slots = f"server.vllm.max_num_seqs={args.prompts * args.group_size}"  # the same engine batch for all
    mode = "lora" if "inflight" in args.modes else "merge"
    cfg = load_config(args.config, ["server.backend=vllm", f"server.adapter_mode={mode}", slots, *args.set])
    backend = await make_backend(cfg, resolve_model(cfg.model.name))
    problems = load_gsm8k("train", args.gsm8k)
    results: dict[str, list[dict]] = {m: [] for m in args.modes}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-streaming-") as work:
        if args.publish_every:
            from harness.adapters import random_adapter

            model, folder = resolve_model(cfg.model.name), Path(work) / "adapter"
            args.adapter = random_adapter(model, folder, r=cfg.lora.r, scale=0.01)
        for r in range(args.rounds):
            for mode in args.modes:
                print(f"[round {r + 1}/{args.rounds}] {mode}: {args.seconds:.0f} s ...", flush=True)
                out = await one_window(mode, backend, problems, args, Path(work) / f"{mode}-{r}")
                results[mode].append(out)
                print(
                    f"  {out['tok_s']:.1f} tok/s, {out['groups_s'] * 60:.1f} groups/min, "
                    f"{100 * out['underused']:.0f} % of the time < half the slots busy, {out['busy']:.1f} of "
                    f"{args.prompts * args.group_size} busy on average"
                    + (f", token lag {out['lag']:.2f} (p95 {out['lag_p95']}), {out['continued']:.0f} samples "
                       "continued" if args.publish_every else ""),
                    flush=True,
                )  # fmt: skip
    await backend.close()
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "deploy/configs/cpu.toml"))
    p.add_argument("--gsm8k", default=os.environ.get("TANDEM_GSM8K", str(REPO.parent / "shared/data/gsm8k")))
    p.add_argument("--seconds", type=float, default=150.0, help="measured window per mode and round")
    p.add_argument("--rounds", type=int, default=2, help="each mode this many times, alternating")
    p.add_argument("--prompts", type=int, default=4, help="prompts a lockstep batch = groups in flight")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--modes", default="lockstep,continuous", type=lambda s: s.split(","))
    p.add_argument("--publish-every", type=float, default=0.0, help="seconds between publishes (0: none)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = p.parse_args()
    if unknown := set(args.modes) - {"lockstep", "continuous", "inflight"}:
        p.error(f"unknown mode(s) {sorted(unknown)}: lockstep, continuous, inflight")
    if "inflight" in args.modes and not args.publish_every:
        p.error("mode inflight moves samples to each newly published version: give --publish-every")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    results = asyncio.run(bench(args))
    engine = "LoRA adapters" if "inflight" in args.modes else "merged weights"
    published = f", a version every {args.publish_every:g} s" if args.publish_every else ""
    print(f"\nmode        tok/s  groups/min  < half busy  token lag (p95)  ({args.prompts} x "
          f"G={args.group_size} in flight, <= {args.max_tokens} tokens, {engine}{published}, "
          f"{args.rounds} x {args.seconds:.0f} s each)")  # fmt: skip
    mean = {m: {k: statistics.mean(r[k] for r in rs) for k in rs[0]} for m, rs in results.items()}
    for m, v in mean.items():
        print(
            f"{m:<10} {v['tok_s']:7.1f}  {60 * v['groups_s']:10.1f}  {100 * v['underused']:10.0f} %"
            f"  {v['lag']:9.2f} ({v['lag_p95']:.0f})"
        )
    for m in ("continuous", "inflight"):
        if {"lockstep", m} <= mean.keys():
            print(f"{m} / lockstep: {mean[m]['tok_s'] / mean['lockstep']['tok_s']:.2f}x tok/s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Lockstep against continuous production on the real engine, side by side in one process.

    .venv/bin/python scripts/bench_streaming.py [--seconds 150] [--rounds 2] [--max-tokens 256]
        [--prompts 4] [--group-size 8] [--modes lockstep,continuous] [--set K=V ...]

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
Numbers and the machine: docs/benchmarks.md.
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
        f"server.production={mode}",
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

    async def consume():
        while True:
            lease, groups = await queue.pull(64, wait_s=1.0)
            if lease is None:
                continue
            await queue.ack(lease)
            if state["counting"]:
                state["groups"] += len(groups)
                state["tokens"] += sum(len(c.token_ids) for g in groups for c in g.completions)

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
    state["counting"], t0 = True, time.perf_counter()
    await asyncio.sleep(args.seconds)
    state["counting"], elapsed = False, time.perf_counter() - t0
    for task in (sampler, drain, run):
        task.cancel()
    await asyncio.gather(sampler, drain, run, return_exceptions=True)
    await producer.stop()
    server.journal.close()
    return {
        "tok_s": state["tokens"] / elapsed,
        "groups_s": state["groups"] / elapsed,
        "underused": sum(b < slots / 2 for b in busy) / max(len(busy), 1),
        "busy": statistics.mean(busy) if busy else 0.0,
    }


async def bench(args) -> dict[str, list[dict]]:
    from rollout_server.serving.serve import make_backend

    slots = f"server.vllm.max_num_seqs={args.prompts * args.group_size}"  # the same engine batch for both
    cfg = load_config(args.config, ["server.backend=vllm", "server.adapter_mode=merge", slots, *args.set])
    backend = await make_backend(cfg, resolve_model(cfg.model.name))
    problems = load_gsm8k("train", args.gsm8k)
    results: dict[str, list[dict]] = {m: [] for m in args.modes}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-streaming-") as work:
        for r in range(args.rounds):
            for mode in args.modes:
                print(f"[round {r + 1}/{args.rounds}] {mode}: {args.seconds:.0f} s ...", flush=True)
                out = await one_window(mode, backend, problems, args, Path(work) / f"{mode}-{r}")
                results[mode].append(out)
                print(
                    f"  {out['tok_s']:.1f} tok/s, {out['groups_s'] * 60:.1f} groups/min, "
                    f"{100 * out['underused']:.0f} % of the time < half the slots busy, {out['busy']:.1f} of "
                    f"{args.prompts * args.group_size} busy on average",
                    flush=True,
                )
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
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = p.parse_args()
    if unknown := set(args.modes) - {"lockstep", "continuous"}:
        p.error(f"unknown mode(s) {sorted(unknown)}: lockstep, continuous")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    results = asyncio.run(bench(args))
    print(f"\nmode        tok/s  groups/min  < half busy   ({args.prompts} x G={args.group_size} in flight, "
          f"<= {args.max_tokens} tokens, {args.rounds} x {args.seconds:.0f} s each)")  # fmt: skip
    mean = {m: {k: statistics.mean(r[k] for r in rs) for k in rs[0]} for m, rs in results.items()}
    for m, v in mean.items():
        print(f"{m:<10} {v['tok_s']:7.1f}  {60 * v['groups_s']:10.1f}  {100 * v['underused']:10.0f} %")
    if {"lockstep", "continuous"} <= mean.keys():
        print(f"continuous / lockstep: {mean['continuous']['tok_s'] / mean['lockstep']['tok_s']:.2f}x tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

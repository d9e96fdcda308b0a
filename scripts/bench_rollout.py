"""Rollout throughput of the backends on the same workload, with and without a policy version loaded.

    .venv/bin/python scripts/bench_rollout.py [--prompts 16] [--group-size 8] [--max-tokens 128]
        [--cases vllm-base,vllm-merge,vllm-lora,openai-base,openai-lora,hf-merge,hf-base] [--set K=V ...]

Same prompts (GSM8K test, chat-templated), same G, same max new tokens, temperature 1, top_p 1. Cases:
`vllm-base`/`hf-base` the base model (vLLM without LoRA layers); `vllm-merge` vLLM with a LoRA r16
(q/k/v/o) version published and merged into its weights (server.adapter_mode = "merge"); `vllm-lora`
the same version through vLLM's LoRA kernels; `hf-merge` transformers with that version merged into a copy
(server.adapter_mode = "merge"); `openai-base`/`openai-lora` a stock vLLM OpenAI server started by this
script as its own process on the same cores (harness.procs.vllm_openai_args), reached over HTTP
(server.backend = "openai"), the version loaded by vLLM's runtime LoRA loading: what the hop to an external
engine costs against `vllm-base`/`vllm-lora` in process.
Each case gets one warm-up batch first (vLLM compiles/allocates on first use; the merge happens there),
then the timed batch; all run in this process one after the other, so they share the machine's state.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

from harness.adapters import random_adapter
from shared.config import load_config
from shared.datasets import chat_prompt_ids, load_gsm8k
from shared.models import resolve_model

CASES = {  # name: (backend, config overrides, with a version published)
    "vllm-base": ("vllm", ["server.adapter_mode=merge"], False),  # no LoRA layers: the bare engine
    "vllm-merge": ("vllm", ["server.adapter_mode=merge"], True),
    "vllm-lora": ("vllm", ["server.adapter_mode=lora"], True),
    "openai-base": ("openai", ["server.adapter_mode=lora"], False),
    "openai-lora": ("openai", ["server.adapter_mode=lora"], True),
    "hf-merge": ("hf", ["server.adapter_mode=merge"], True),
    "hf-base": ("hf", [], False),
}


async def measure(case: str, args, adapter_dir: Path) -> float:
    from rollout_server.engines.base import Adapter
    from rollout_server.serving.serve import make_backend

    backend_name, overrides, published = CASES[case]
    local = "vllm" if backend_name == "openai" else backend_name  # (openai: its endpoint is known below)
    overrides = [*overrides, *args.set]
    cfg = load_config(args.config, [f"server.backend={local}", "model.max_model_len=1024", *overrides])
    engine = None
    if backend_name == "openai":
        engine, url = external_engine(cfg, adapter_dir.parent)
        cfg = load_config(args.config, [*overrides, "model.max_model_len=1024", "server.backend=openai",
                                        f'server.openai.endpoints=["{url}"]'])  # fmt: skip
    backend = await make_backend(cfg, resolve_model(cfg.model.name))
    adapter = None
    if published:
        adapter = Adapter(1, str(adapter_dir))
        await backend.load_adapter(adapter)
    problems = load_gsm8k("test", args.gsm8k)[: args.prompts]
    prompts = [chat_prompt_ids(backend.tokenizer, p.question) for p in problems]
    kw = dict(n=args.group_size, temperature=1.0, max_tokens=args.max_tokens, adapter=adapter)
    print(f"[{case}] warm-up ...", flush=True)
    await backend.generate(prompts[:2], **kw)
    print(
        f"[{case}] {len(prompts)} prompts x G={args.group_size}, <= {args.max_tokens} new tokens ...",
        flush=True,
    )
    t0 = time.perf_counter()
    samples = await backend.generate(prompts, **kw)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(s.token_ids) for row in samples for s in row)
    rate = tokens / elapsed
    print(f"[{case}] {tokens} tokens in {elapsed:.1f} s = {rate:.1f} tok/s", flush=True)
    await backend.close()
    if engine is not None:
        engine.stop()
    del backend
    gc.collect()
    return rate


def external_engine(cfg, work: Path):
    """A stock vLLM OpenAI server on the cores the in-process engine uses, its KV cache the same size."""
    from harness.net import free_port
    from harness.procs import Proc, vllm_openai_args, vllm_openai_env, wait_healthy

    port = free_port()
    cores = ",".join(map(str, sorted(os.sched_getaffinity(0))[: cfg.server.vllm.cpu_threads]))
    args = vllm_openai_args(
        resolve_model(cfg.model.name), port, max_lora_rank=16, max_model_len=1024, dtype=cfg.model.dtype
    )
    print(f"[openai] starting a vLLM OpenAI server on cores {cores} (log: {work}/engine.log) ...", flush=True)
    proc = Proc(args, work / "engine.log", vllm_openai_env(cores))
    wait_healthy(proc, f"http://127.0.0.1:{port}", 600)
    return proc, f"http://127.0.0.1:{port}"


def main() -> int:
    repo = Path(__file__).resolve().parents[1]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(repo / "deploy/configs/cpu.toml"))
    p.add_argument("--gsm8k", default=os.environ.get("TANDEM_GSM8K", str(repo.parent / "shared/data/gsm8k")))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    p.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="a config override for every case, e.g. server.vllm.worker_in_engine_process=true (compare a "
        "setting by running the script once with it and once without: it may not reach back into an engine "
        "process started earlier in the same run)",
    )  # fmt: skip
    args = p.parse_args()
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        p.error(f"unknown case(s) {unknown}: choose from {', '.join(CASES)}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    with tempfile.TemporaryDirectory(prefix="tandem-bench-rollout-") as work:
        adapter_dir = Path(work) / "v1"
        if any(CASES[c][2] for c in cases):
            random_adapter(resolve_model(load_config(args.config).model.name), adapter_dir, seed=1)
        rates = {c: asyncio.run(measure(c, args, adapter_dir)) for c in cases}
    print(
        f"\ncase        tok/s   ({args.prompts} prompts x G={args.group_size}, <= {args.max_tokens} tokens)"
    )
    for c, r in rates.items():
        print(f"{c:<10} {r:7.1f}")
    for a, b in [("vllm-merge", "hf-merge"), ("vllm-merge", "vllm-base"), ("vllm-merge", "vllm-lora"),
                 ("vllm-base", "hf-base"), ("openai-base", "vllm-base"), ("openai-lora", "vllm-lora"),
                 ("openai-lora", "vllm-merge")]:  # fmt: skip
        if {a, b} <= rates.keys():
            print(f"{a} / {b}: {rates[a] / rates[b]:.2f}x")
    return 0


if __name__ == "__main__":  # vLLM spawns processes: the guard is required
    sys.exit(main())

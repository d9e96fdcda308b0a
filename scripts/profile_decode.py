"""Where vLLM's CPU decode step spends its time, operator by operator, against the limit model's floor.

    .venv/bin/python scripts/profile_decode.py [--dtype auto] [--prompts 4] [--group 8] [--new-tokens 64]

The bench step's generation (scripts/bench_trl.py: 4 arith prompts of ~90 tokens, G = 8, 64 new tokens,
SmolLM2-135M, merged weights) run in this process: vLLM's engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING
=0, one executor, no worker process) so that torch.profiler sees every operator of a step. Every sequence
runs all its tokens (ignore_eos) so each decode step has the whole batch in it. Prints:

- the decode step's wall time (a 64-token generation minus a 1-token one, per token) and the limit model's
  floor for it (scripts/limits.py: compute 2 FLOPs per weight per sequence at the measured matmul rate, or
  reading the weights and KV cache at the measured bandwidth, the larger);
- operator self time per decode step, the largest first, grouped (matmuls, attention, sampling, the rest),
  and what is not operator time (the engine's Python: scheduling, input preparation, output processing).

The served engine runs its worker in a process of its own and talks to it through shared memory; that
hop is not in this profile (bench_trl.py's pull time holds it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

# Operator name fragments by group (matched in this order; the first that matches wins).
GROUPS = [
    ("attention", ("attention", "attn", "paged", "sdpa", "flash", "cpu_attn")),
    ("matmul", ("mm", "linear", "gemm", "matmul", "onednn", "dnnl")),
    ("sampling", ("sort", "topk", "softmax", "multinomial", "exponential", "argmax", "gather", "cumsum")),
    ("norm / rotary / activation", ("rms", "norm", "rotary", "silu", "act_and_mul", "rope")),
]


def group_of(name: str) -> str:
    low = name.lower()
    for group, parts in GROUPS:
        if any(p in low for p in parts):
            return group
    return "other operators"


def prompts(n: int, tokenizer) -> list[list[int]]:
    from shared.datasets import chat_prompt_ids, load_problems
    from shared.task_config import DataConfig

    problems = load_problems(DataConfig(task="arith"), "train")[:n]
    return [chat_prompt_ids(tokenizer, p.conversation()) for p in problems]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--top", type=int, default=15, help="operators listed")
    args = p.parse_args()

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from limits import Shapes, decode_step_floor, measure
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from shared.config import native_dtype
    from shared.models import resolve_model

    dtype = native_dtype() if args.dtype == "auto" else args.dtype
    model = resolve_model("smollm2-135m")
    rates = measure(dtype)
    llm = LLM(model=model, dtype=dtype, max_model_len=512, enforce_eager=True, block_size=32, seed=0)
    batch = [TokensPrompt(prompt_token_ids=ids) for ids in prompts(args.prompts, llm.get_tokenizer())]

    def run(new_tokens: int) -> float:
        params = SamplingParams(
            n=args.group, temperature=0.7, max_tokens=new_tokens, ignore_eos=True, logprobs=0
        )
        t = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - t

    run(args.new_tokens)  # warm-up: kernels chosen, caches filled
    prefill = min(run(1) for _ in range(3))
    whole = min(run(args.new_tokens) for _ in range(2))
    steps = args.new_tokens - 1
    step = (whole - prefill) / steps

    def op_times(new_tokens: int) -> dict[str, float]:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run(new_tokens)
        out = defaultdict(float)
        for e in prof.key_averages():
            out[e.key] += e.self_cpu_time_total / 1e6
        return out

    # each operator's decode share: a profiled 64-token run minus a profiled 1-token one, per step
    first, full = op_times(1), op_times(args.new_tokens)
    per_step = {k: (full[k] - first.get(k, 0.0)) / steps for k in full}

    shapes = Shapes.of(model)
    seqs = args.prompts * args.group
    bytes_per = 2 if dtype == "bfloat16" else 4
    context = len(batch[0]["prompt_token_ids"]) + args.new_tokens // 2
    compute, read = decode_step_floor([context] * seqs, shapes, rates, bytes_per)
    floor = max(compute, read)

    print(f"machine: {os.cpu_count()} CPUs visible, torch threads {torch.get_num_threads()}; {rates}")
    print(
        f"{seqs} sequences ({args.prompts} prompts x G = {args.group}), {dtype}, {args.new_tokens} new tokens"
    )
    print(f"decode step: {1e3 * step:.1f} ms measured; floor {1e3 * floor:.1f} ms "
          f"(compute {1e3 * compute:.1f} ms, memory {1e3 * read:.1f} ms): {step / floor:.1f}x")  # fmt: skip
    total = sum(per_step.values())
    groups = defaultdict(float)
    for k, v in per_step.items():
        groups[group_of(k)] += v
    print(f"\noperator self time per decode step (profiled; {1e3 * total:.1f} ms of operators):")
    for k, v in sorted(per_step.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {1e3 * v:7.2f} ms  {100 * v / step:5.1f} %  {k}  [{group_of(k)}]")
    print("\nby group (share of the measured step):")
    for k, v in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {1e3 * v:7.2f} ms  {100 * v / step:5.1f} %  {k}")
    rest = step - total
    print(f"  {1e3 * rest:7.2f} ms  {100 * rest / step:5.1f} %  not operator time (the engine's Python, "
          f"scheduling, input and output processing; negative: the profiler's own cost)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

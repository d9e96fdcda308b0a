"""GPU benchmark of the production shape, time-sliced under an 8 GB cap, with no download: a random-init
model with DeepSeek-R1-Distill-Qwen-1.5B's dimensions, vLLM for the rollout, tandem's DeepSpeed learner
for the step, in one process the way the 8 GB placement runs them (the engine sleeps while the learner
trains).

    .venv/bin/python scripts/bench_gpu.py --dry-run     # anywhere: checks the arguments and builds the
                                                         # model on the meta device (no GPU, no vLLM)
    python scripts/bench_gpu.py [--gpu-gib 8] [--out runs/bench-gpu.json]    # on a CUDA machine, < 8 min

Reports device memory per phase (sampled every 20 ms from cudaMemGetInfo: what the GPU really holds,
vLLM's engine process included), rollout tokens/s without and with the adapter, and the learner's step
time; exits 1 if a phase went over --gpu-gib.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# DeepSeek-R1-Distill-Qwen-1.5B (Qwen2 architecture), from its published config.json.
R1_DISTILL_1_5B = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=131072,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    hidden_act="silu",
)
EXPECTED_PARAMS = 1.777e9  # its parameter count; the dry run checks the construction against it


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="check arguments and model construction only")
    p.add_argument("--gpu-gib", type=float, default=8.0, help="memory cap the time-sliced run must fit")
    p.add_argument("--prompts", type=int, default=2, help="B, prompts per step")
    p.add_argument("--group-size", type=int, default=4, help="G, completions per prompt")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=512, help="new tokens per completion (all generated)")
    p.add_argument("--steps", type=int, default=2, help="learner steps to time (the first one warms up)")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    for name in ("prompts", "group_size", "prompt_tokens", "max_tokens", "steps", "lora_rank"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.gpu_gib <= 0:
        p.error("--gpu-gib must be > 0")
    return args


def model_config():
    from transformers import Qwen2Config

    return Qwen2Config(**R1_DISTILL_1_5B, torch_dtype="bfloat16")


def tandem_config(args, model_dir: str, out_dir: str):
    """The production config (gpu-8gb-timeslice.toml) resized to this benchmark's workload."""
    from shared.config import load_config

    n = args.prompts * args.group_size
    return load_config(
        REPO / "deploy/configs/gpu-8gb-timeslice.toml",
        [
            f"model.name={model_dir}",
            f"sampling.group_size={args.group_size}",
            f"sampling.max_new_tokens={args.max_tokens}",
            f"learner.prompts_per_step={args.prompts}",
            "learner.micro_batch_size=1",
            f"learner.grad_accum={n}",
            f"lora.r={args.lora_rank}",
            f"lora.alpha={2 * args.lora_rank}",
            f"learner.out_dir={out_dir}",
        ],
    )


def synthetic_groups(args, vocab: int, seed: int = 0):
    """B groups of G random completions of exactly max_tokens, half rewarded: every token trains."""
    import random

    from shared.protocol import Completion, ScoredGroup

    rng = random.Random(seed)
    groups = []
    for b in range(args.prompts):
        completions = [
            Completion(
                token_ids=[rng.randrange(vocab) for _ in range(args.max_tokens)],
                logprobs=[-1.0] * args.max_tokens,
                text="",
                reward=float(i % 2),
                finish_reason="length",
            )
            for i in range(args.group_size)
        ]
        groups.append(
            ScoredGroup(
                group_id=f"bench-{b}",
                prompt_id=f"bench-{b}",
                prompt_token_ids=[rng.randrange(vocab) for _ in range(args.prompt_tokens)],
                answer="0",
                policy_version=0,
                completions=completions,
            )
        )
    return groups


def dry_run(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    cfg = model_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    n = sum(p.numel() for p in model.parameters())
    if abs(n - EXPECTED_PARAMS) > 0.01 * EXPECTED_PARAMS:
        print(
            f"error: built {n / 1e9:.3f}B parameters, expected {EXPECTED_PARAMS / 1e9:.3f}B", file=sys.stderr
        )
        return 1
    tcfg = tandem_config(args, "/nonexistent-model", "/tmp/bench-gpu")
    groups = synthetic_groups(args, cfg.vocab_size)
    tokens = sum(len(c.token_ids) for g in groups for c in g.completions)
    print(
        f"dry run ok: {type(model).__name__} with {n / 1e9:.3f}B parameters ({cfg.num_hidden_layers} layers, "
        f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}); LoRA r={tcfg.lora.r} on "
        f"{','.join(tcfg.lora.target_modules)}; a step = {args.prompts} x G={args.group_size} completions, "
        f"{tokens} tokens; cap {args.gpu_gib:g} GiB"
    )
    return 0


class DeviceMemory:
    """Peak device memory in use (all processes) per named phase, sampled in a thread."""

    def __init__(self, interval_s: float = 0.02):
        import torch

        self._torch, self.interval_s = torch, interval_s
        self.total = torch.cuda.mem_get_info()[1]
        self.peaks: dict[str, float] = {}
        self.phase = "idle"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def used_gib(self) -> float:
        free, total = self._torch.cuda.mem_get_info()
        return (total - free) / 2**30

    def _run(self) -> None:
        while not self._stop.is_set():
            used = self.used_gib()
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0.0), used)
            time.sleep(self.interval_s)

    def enter(self, phase: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {phase} ...", flush=True)
        self.phase = phase

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def run(args) -> int:
    import torch

    if not torch.cuda.is_available():
        print("error: no CUDA device (use --dry-run to check the script without one)", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from learner.engine import build_engine, init_distributed
    from learner.train import train_step

    mem = DeviceMemory()
    results: dict = {"gpu": torch.cuda.get_device_name(), "cap_gib": args.gpu_gib, "args": vars(args)}
    work = Path(tempfile.mkdtemp(prefix="tandem-bench-gpu-"))
    model_dir, out_dir = work / "model", work / "learner"

    mem.enter("random-init model (CPU) -> disk")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(), torch_dtype=torch.bfloat16)
    model.save_pretrained(model_dir)
    del model
    cfg = tandem_config(args, str(model_dir), str(out_dir))

    mem.enter("vLLM start")
    max_len = args.prompt_tokens + args.max_tokens
    llm = LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=max_len,
        gpu_memory_utilization=0.9 * args.gpu_gib * 2**30 / mem.total,
        enable_sleep_mode=True,
        enable_lora=True,
        max_lora_rank=args.lora_rank,
        max_loras=2,
        enforce_eager=True,
        seed=0,
    )
    groups = synthetic_groups(args, model_config().vocab_size)
    prompts = [TokensPrompt(prompt_token_ids=g.prompt_token_ids) for g in groups]
    params = SamplingParams(
        n=args.group_size,
        temperature=1.0,
        max_tokens=args.max_tokens,
        ignore_eos=True,
        detokenize=False,
        logprobs=0,
    )

    def rollout(phase: str, lora=None) -> float:
        mem.enter(phase)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        dt = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        return tokens / dt

    rollout("rollout warm-up")
    results["rollout_tok_s"] = rollout("rollout (base)")

    mem.enter("vLLM asleep (level 1)")
    llm.sleep(level=1)
    time.sleep(1.0)
    results["asleep_gib"] = mem.used_gib()

    mem.enter("learner build")
    init_distributed()
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_gib * 2**30 / mem.total))
    engine = build_engine(cfg, str(model_dir), 1, on_cpu=False)
    step_s = []
    for i in range(args.steps):
        mem.enter(f"learner step {i + 1}")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        train_step(engine, groups, cfg, 0, 1, pad_id=0)
        torch.cuda.synchronize()
        step_s.append(time.perf_counter() - t0)
    results["step_s"] = step_s
    results["learner_max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    adapter = out_dir / "adapters" / "v1"
    engine.module.save_pretrained(str(adapter))
    del engine
    torch.cuda.empty_cache()

    mem.enter("vLLM wake")
    llm.wake_up()
    results["rollout_lora_tok_s"] = rollout("rollout (adapter v1)", LoRARequest("policy-v1", 1, str(adapter)))
    mem.close()

    results["peak_gib_by_phase"] = {k: round(v, 2) for k, v in mem.peaks.items()}
    over = {k: v for k, v in mem.peaks.items() if v > args.gpu_gib}
    print("\nphase                              peak device memory (GiB)")
    for k, v in mem.peaks.items():
        print(f"  {k:<32} {v:6.2f}{'  OVER THE CAP' if k in over else ''}")
    tokens_step = args.prompts * args.group_size * args.max_tokens
    print(
        f"\nrollout: {results['rollout_tok_s']:.0f} tok/s base, "
        f"{results['rollout_lora_tok_s']:.0f} tok/s with the adapter; "
        f"learner step ({tokens_step} completion tokens): "
        + ", ".join(f"{s:.1f} s" for s in step_s)
        + f"; learner max allocated {results['learner_max_allocated_gib']:.2f} GiB"
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print("fits" if not over else f"DOES NOT FIT the {args.gpu_gib:g} GiB cap in: {', '.join(over)}")
    return 1 if over else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    return dry_run(args) if args.dry_run else run(args)


if __name__ == "__main__":  # vLLM's engine spawns processes: this guard is required
    sys.exit(main())

"""A full GRPO step, tandem against TRL's GRPOTrainer, on the same CPU workload, side by side in one run.

    .venv/bin/pip install trl==1.16.0        # once; it fits the project's pins (not a dependency)
    .venv/bin/python scripts/bench_trl.py [--steps 4] [--prompts 4] [--group-size 8] [--max-tokens 64]

Same model (SmolLM2-135M-Instruct) in the same precision (--dtype), same prompts (the arith task's train
split, in the same order), same B, G, max new tokens, temperature, LoRA (r, alpha, targets), beta,
constant learning rate (tiny by default, see --lr) and loss aggregation (TRL's loss_type="grpo" =
tandem's seq_mean_token_mean); no dynamic sampling on either side. tandem runs as its two processes
(server + DeepSpeed learner, time-sliced as in deploy/configs/cpu.toml, plus any --tandem overrides); TRL
as one process. Each side's first step is a warm-up; the figures are the median step time over the others
and completion tokens/s over the others, with the breakdown of a tandem step.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.net import free_port
from harness.procs import start_server, tandem_env
from shared.config import ConfigError, load_config, native_dtype

REPO = Path(__file__).resolve().parents[1]


def overrides(args) -> list[str]:
    n = args.prompts * args.group_size
    return [
        f"sampling.group_size={args.group_size}",
        f"sampling.max_new_tokens={args.max_tokens}",
        f"learner.prompts_per_step={args.prompts}",
        f"learner.micro_batch_size={min(8, n)}",
        f"learner.grad_accum={n // min(8, n)}",
        f"learner.steps={args.steps}",
        "learner.dynamic_sampling=false",
        f"learner.lr={args.lr}",
        f"server.queue_size={args.prompts}",
        f"server.prompts_per_batch={args.prompts}",
        f"model.dtype={args.dtype}",
    ]


def run_tandem(args, work: Path) -> tuple[list[tuple[float, float]], dict[str, float]]:
    """(step seconds, completion tokens) of each step, and the breakdown of a timed step."""
    port = free_port()
    extra = [
        *overrides(args),
        f"server.state_dir={work / 'server'}",
        f"learner.server_urls=http://127.0.0.1:{port}",
        f"learner.out_dir={work / 'learner'}",
    ]
    token = secrets.token_hex(8)
    env = tandem_env(token)
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    cli = [f"--{o}" for o in extra] + [f"--{o.removeprefix('--')}" for o in args.tandem]
    server, _ = start_server(args.config, cli, port, work / "server.log", env)
    try:
        print(f"[tandem] {args.steps} steps ...", flush=True)
        learner = subprocess.run(
            [sys.executable, "-m", "learner", "--config", args.config, *cli],
            cwd=REPO,
            env=env,
            stdout=(work / "learner.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        if learner.returncode != 0:
            raise SystemExit(f"tandem learner failed; see {work / 'learner.log'}")
    finally:
        server.stop(timeout=60)
    records = [json.loads(line) for line in (work / "learner" / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(line) for line in (work / "server" / "events.jsonl").read_text().splitlines()]
    n = args.prompts * args.group_size
    steps = [(r["perf/step_s"], r["completion/length"] * n) for r in records]
    return steps, breakdown(records[1:], events)


PHASES = {  # learner metric -> what it covers
    "perf/pull_s": "pull: wait for the step's groups (the server wakes, generates, scores)",
    "perf/train_s": "train: forward, backward, optimizer step",
    "perf/save_s": "save: adapter + checkpoint + groups on disk",
    "perf/publish_s": "handoff: ack, upload the adapter, wake the server",
}


def breakdown(records: list[dict], events: list[dict]) -> dict[str, float]:
    """Median seconds of each phase over the timed steps (learner metrics), the rest of the step (putting
    the server to sleep, metrics), and from the server's event log the time from each wake to its first
    group (generation + scoring)."""
    out = {label: statistics.median(r[key] for r in records) for key, label in PHASES.items()}
    rest = [r["perf/step_s"] - sum(r[key] for key in PHASES) for r in records]
    out["other: put the server to sleep, write metrics"] = statistics.median(rest)
    wakes = [e["t"] for e in events if e["event"] == "wake"]
    ready = [next((e["t"] for e in events if e["event"] == "group" and e["t"] > w), None) for w in wakes]
    # the warm-up step's groups come before any wake: each wake here is the rollout of a timed step
    generation = [r - w for w, r in zip(wakes, ready, strict=True) if r is not None]
    if generation:
        out["  server side: wake -> first group ready (generation + scoring)"] = statistics.median(generation)
    return out


def run_trl(args, cfg, work: Path, tuned: bool) -> list[tuple[float, float]]:
    """TRL as it ships (tuned=False: its GRPOConfig's defaults, gradient checkpointing on), or tuned as a
    user who benchmarks would: gradient checkpointing off and glibc keeping freed memory, as tandem's
    learner does (learner/process.keep_freed_memory). Call the default first: the allocator setting
    stays for the rest of the process."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from learner.engine import peft_lora
    from shared.datasets import chat_messages, epoch_order, load_problems
    from shared.models import resolve_model
    from shared.reward import verify

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    problems = load_problems(cfg.data)
    order = epoch_order(len(problems), cfg.data.seed, 0)[: args.prompts * args.steps]
    rows = [{"prompt": chat_messages(problems[i].question), "answer": problems[i].answer} for i in order]

    def reward(completions, answer, **_):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [verify(t, a) for t, a in zip(texts, answer, strict=True)]

    n = args.prompts * args.group_size
    micro = min(8, n)
    trl_args = GRPOConfig(
        output_dir=str(work / "trl"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=n // micro,
        num_generations=args.group_size,
        max_completion_length=args.max_tokens,
        temperature=cfg.sampling.temperature,
        top_p=1.0,
        learning_rate=cfg.learner.lr,
        lr_scheduler_type="constant",  # tandem's learning rate is constant
        weight_decay=cfg.learner.weight_decay,
        beta=cfg.grpo.beta,
        epsilon=cfg.grpo.epsilon_low,
        loss_type="grpo",
        scale_rewards="group",
        max_steps=args.steps,
        shuffle_dataset=False,
        use_cpu=True,
        bf16=args.dtype == "bfloat16",
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=0,
        **({"gradient_checkpointing": False} if tuned else {}),
    )
    if tuned:
        from learner.process import keep_freed_memory

        keep_freed_memory(lambda *a: None)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(resolve_model(cfg.model.name), dtype=dtype)
    peft = peft_lora(cfg.lora)

    class Timer(TrainerCallback):
        """Wall clock of each optimizer step (generation included) and its completion tokens."""

        def __init__(self):
            self.t = time.perf_counter()
            self.step_s: list[float] = []
            self.tokens: list[float] = []

        def on_step_end(self, *a, **k):
            now = time.perf_counter()
            self.step_s.append(now - self.t)
            self.t = now

        def on_log(self, args, state, control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                self.tokens.append(float(logs["completions/mean_length"]) * n)

    timer = Timer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=trl_args,
        train_dataset=Dataset.from_list(rows),
        peft_config=peft,
        callbacks=[timer],
    )
    print(f"[trl{' tuned' if tuned else ''}] {args.steps} steps ...", flush=True)
    timer.t = time.perf_counter()
    trainer.train()
    return list(zip(timer.step_s, timer.tokens, strict=True))


def print_breakdown(phases: dict[str, float], args) -> None:
    print(f"\na tandem step ({args.dtype}), median seconds of steps 2..{args.steps}:")
    for label, seconds in phases.items():
        print(f"  {seconds:6.2f}  {label}")


def limit_model(run: Path) -> dict:
    """The timed steps (2..) against what the machine allows (scripts/limits.py, its assumptions there):
    the median of each phase, measured and floor, and their ratio."""
    sys.path.insert(0, str(REPO / "scripts"))
    from limits import floors

    f = floors(run)
    timed = f["steps"][1:]
    med = {k: statistics.median(s[k] for s in timed) for k in timed[0] if k != "step"}
    floor_step = med["floor_generation_s"] + med["floor_training_s"]
    return {
        "rates": f["rates"],
        "generation": {"measured_s": med["pull_s"], "floor_s": med["floor_generation_s"]},
        "training": {"measured_s": med["train_s"], "floor_s": med["floor_training_s"]},
        "step": {"measured_s": med["step_s"], "floor_s": floor_step},
        "ratios": {
            "generation": med["pull_s"] / med["floor_generation_s"],
            "training": med["train_s"] / med["floor_training_s"],
            "step": med["step_s"] / floor_step,
        },
    }


def print_limits(limits: dict) -> None:
    r = limits["rates"]
    print(f"\nagainst the machine's limits (scripts/limits.py; measured here: {r['flops'] / 1e12:.2f} "
          f"TFLOP/s matmul, {r['bandwidth'] / 1e9:.1f} GB/s memory), median of the timed steps:")  # fmt: skip
    for phase, label in (
        ("generation", "generation (pull)"),
        ("training", "training"),
        ("step", "whole step"),
    ):
        m = limits[phase]
        print(f"  {label:18} measured {m['measured_s']:6.2f} s, floor {m['floor_s']:5.2f} s: "
              f"measured / floor = {limits['ratios'][phase]:.1f}")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="deploy/configs/cpu.toml")
    p.add_argument("--steps", type=int, default=4, help="steps per side; the first is a warm-up")
    p.add_argument("--prompts", type=int, default=4, help="B")
    p.add_argument("--group-size", type=int, default=8, help="G")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="both sides' precision (served and trained in); auto: bfloat16 on CPUs with AVX-512 BF16 or "
        "AMX, float32 on others (model.dtype = 'auto', shared/config.py)",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=1e-9,
        help="both sides' learning rate; tiny by default so that neither policy drifts and both generate "
        "the same length distribution every step (at the config's 7e-4, one side learnt to answer "
        "shorter within 3 steps and the step times no longer compared the same work)",
    )
    p.add_argument(
        "--tandem",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a config override for tandem's two processes only (repeatable), e.g. --tandem "
        "learner.placement=split",
    )
    p.add_argument(
        "--only",
        choices=["tandem", "trl"],
        default=None,
        help="run one side alone (to profile it); the ratio needs both",
    )
    p.add_argument(
        "--trl",
        default="default,tuned",
        help="TRL's variants, comma-separated: 'default' (as it ships) and 'tuned' (gradient checkpointing "
        "off, freed memory kept as tandem keeps it)",
    )
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args()
    if args.steps < 2:
        p.error("--steps must be >= 2 (the first step is a warm-up)")
    variants = [v.strip() for v in args.trl.split(",") if v.strip()]
    if not variants or set(variants) - {"default", "tuned"}:
        p.error(f"--trl {args.trl!r}: give 'default', 'tuned' or both")
    args.dtype = native_dtype() if args.dtype == "auto" else args.dtype  # one precision for both sides
    try:  # both sides read this config; say what is wrong before starting anything
        cfg = load_config(args.config, overrides(args))
        load_config(args.config, overrides(args) + [o.removeprefix("--") for o in args.tandem])
    except ConfigError as e:
        p.error(str(e))
    try:
        import trl
    except ImportError:
        p.error("TRL is not installed: .venv/bin/pip install trl==1.16.0")
    work = Path(tempfile.mkdtemp(prefix="tandem-bench-trl-"))
    sides, phases, limits = {}, {}, None
    if args.only in (None, "tandem"):
        sides["tandem"], phases = run_tandem(args, work)
        limits = limit_model(work / "learner")
    if args.only in (None, "trl"):
        for v in sorted(variants, key=["default", "tuned"].index):  # the default first (see run_trl)
            sides["trl" if v == "default" else "trl_tuned"] = run_trl(args, cfg, work, v == "tuned")
    n = args.prompts * args.group_size
    result = {
        "workload": f"{args.prompts} prompts x G={args.group_size}, <= {args.max_tokens} new tokens",
        "trl_version": trl.__version__,
    }
    for name, steps in sides.items():
        timed = steps[1:]  # the first step is a warm-up
        result[f"{name}_step_s"] = [s for s, _ in steps]
        result[f"{name}_completion_tokens"] = [t for _, t in steps]
        result[f"{name}_median_step_s"] = statistics.median(s for s, _ in timed)
        result[f"{name}_completions_per_s"] = n / result[f"{name}_median_step_s"]
        # The policies drift apart (one learns to answer shorter), so tokens/s is the fairer rate.
        result[f"{name}_completion_tokens_per_s"] = sum(t for _, t in timed) / sum(s for s, _ in timed)
    result["dtype"] = args.dtype
    if "tandem" in sides:
        result["tandem_step_breakdown_s"] = phases
        result["limit_model"] = limits
    print(f"\nmedian step time of steps 2..{args.steps} ({args.dtype}; work folder {work}):")
    for name in sides:
        print(f"  {name:10} {result[f'{name}_median_step_s']:6.1f} s, "
              f"{result[f'{name}_completion_tokens_per_s']:6.1f} completion tokens/s")  # fmt: skip
    if "tandem" in sides:
        t, tt = result["tandem_median_step_s"], result["tandem_completion_tokens_per_s"]
        for name, label in (("trl", "TRL default"), ("trl_tuned", "TRL tuned")):
            if name in sides:
                r, rt = result[f"{name}_median_step_s"], result[f"{name}_completion_tokens_per_s"]
                result[f"step_time_ratio_tandem_over_{name}"] = t / r
                result[f"tokens_per_s_ratio_tandem_over_{name}"] = tt / rt
                print(f"  tandem / {label}: step time {t / r:.2f}, tokens/s {tt / rt:.2f}")
        print_breakdown(phases, args)
        print_limits(limits)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

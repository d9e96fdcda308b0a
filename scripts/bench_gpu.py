"""GPU benchmark of the production shape, time-sliced on one GPU the way `docker compose up` runs it: the
product's own rollout server (vLLM backend) and learner (DeepSpeed ZeRO-2), as two processes started in
the production order, on a random-init model with DeepSeek-R1-Distill-Qwen-1.5B's dimensions and a
synthetic tokenizer of its vocabulary size (no download).

    .venv/bin/python scripts/bench_gpu.py --dry-run   # anywhere: the model on the meta device, the tokenizer,
                                                       # the resolved config and its memory preflight
    python scripts/bench_gpu.py [--gpu-gib 8] [--steps 3] [--out runs/bench-gpu.json]    # on a CUDA machine
    .venv/bin/python scripts/bench_gpu.py --rehearse --backend hf  # anywhere: the whole run on CPU with a
                                                       # tiny model, resident memory in place of the GPU's

vLLM's share is `server.vllm.gpu_memory_utilization` of the config (0.6) applied to --gpu-gib, whatever the
GPU's real size. Every 0.2 s the script reads what each process holds on the GPU (nvidia-smi, vLLM's engine
process counted with its server) and files it under the phase the run is in (from the server's event log:
server start, learner start-up, rollout, training, ...). It reports the peak of each process and of both per
phase, rollout tokens/s and step times from the learner's metrics, and exits 1 if a phase went over
--gpu-gib. With --cap, each process is also held to --gpu-gib by PyTorch's per-process memory fraction (an
allocation past it fails as it would on a GPU of that size; harness/device_env.py). Beside the measured peaks
it prints what the preflight (learner/preflight.py) predicted for the same config.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "deploy/configs/gpu-8gb-timeslice.toml"

# The rehearsal's model: the same architecture, small enough for a CPU.
TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=2000, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False, hidden_act="silu",
)  # fmt: skip
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
SPECIAL = ["<unk>", "<pad>", "<|end|>"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="check the model, tokenizer and config only")
    p.add_argument("--gpu-gib", type=float, default=8.0, help="the GPU size the run must fit")
    p.add_argument("--prompts", type=int, default=2, help="B, prompts per step")
    p.add_argument("--group-size", type=int, default=4, help="G, completions per prompt")
    p.add_argument("--max-tokens", type=int, default=512, help="new tokens per completion")
    p.add_argument("--steps", type=int, default=3, help="learner steps (the first one warms up)")
    p.add_argument(
        "--backend",
        choices=["vllm", "hf"],
        default="vllm",
        help="the server's engine: vllm (production), or hf (transformers' generate: the fallback where "
        "vLLM is not installed; asleep, it moves its weights to host RAM)",
    )
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument(
        "--cap",
        action="store_true",
        help="also hold each process to --gpu-gib with PyTorch's memory fraction",
    )
    p.add_argument(
        "--rehearse",
        action="store_true",
        help="run the whole benchmark on CPU with a tiny model (resident memory stands in for the GPU's): "
        "checks the script, the processes and the report where no GPU is",
    )
    p.add_argument("--work", default=None, help="the run's folder (model, logs, state; default: a temp dir)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more config override (repeatable)",
    )
    args = p.parse_args(argv)
    for name in ("prompts", "group_size", "max_tokens", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.gpu_gib <= 0:
        p.error("--gpu-gib must be > 0")
    return args


def model_config(tiny: bool = False):
    from transformers import Qwen2Config

    return Qwen2Config(**(TINY if tiny else R1_DISTILL_1_5B), dtype="bfloat16")


def make_tokenizer(vocab: int):
    """A word-level tokenizer with exactly `vocab` ids and a chat template: any id the random model samples
    decodes, and the server's chat prompts encode (to <unk> mostly), with no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {w: i for i, w in enumerate(SPECIAL)} | {f"w{i}": i for i in range(len(SPECIAL), vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|> {% endif %}"
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<|end|>",
        chat_template=template,
    )


def overrides(args, model_dir: str, work: Path, port: int) -> list[str]:
    """The production config, resized to this run and pointed at the random model and a work folder."""
    util = 0.6 * args.gpu_gib * 2**30 / max(args.total_bytes, 1)
    return [
        f"model.name={model_dir}",
        "data.task=arith",  # offline; rewards are ~0 for a random model, the work per step is the same
        f"sampling.group_size={args.group_size}",
        f"sampling.max_new_tokens={args.max_tokens}",
        f"server.port={port}",
        "server.host=127.0.0.1",
        f"server.state_dir={work / 'server'}",
        f"server.queue_size={args.prompts}",
        f"server.prompts_per_batch={args.prompts}",
        f"server.backend={args.backend}",
        f"server.vllm.gpu_memory_utilization={util:.4f}",
        f"learner.server_urls=http://127.0.0.1:{port}",
        f"learner.out_dir={work / 'learner'}",
        f"learner.steps={args.steps}",
        f"learner.prompts_per_step={args.prompts}",
        "learner.micro_batch_size=1",
        f"learner.grad_accum={args.prompts * args.group_size}",
        "learner.dynamic_sampling=false",
        "learner.min_free_mb=0",
        *args.set,
    ]


def dry_run(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from learner.preflight import Dims, report
    from shared.config import load_config

    cfg = model_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    n = sum(p.numel() for p in model.parameters())
    if abs(n - EXPECTED_PARAMS) > 0.01 * EXPECTED_PARAMS:
        print(
            f"error: built {n / 1e9:.3f}B parameters, expected {EXPECTED_PARAMS / 1e9:.3f}B", file=sys.stderr
        )
        return 1
    tok = make_tokenizer(cfg.vocab_size)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True
    )
    if len(tok) != cfg.vocab_size or tok.decode([cfg.vocab_size - 1]) != f"w{cfg.vocab_size - 1}":
        print(f"error: the tokenizer has {len(tok)} ids, the model {cfg.vocab_size}", file=sys.stderr)
        return 1
    args.total_bytes = args.gpu_gib * 2**30
    tcfg = load_config(CONFIG, overrides(args, "/random-model", Path("/tmp/bench-gpu"), 8000))
    text, fits = report(tcfg, Dims.from_config(R1_DISTILL_1_5B), args.gpu_gib)
    tokens = args.prompts * args.group_size * args.max_tokens
    print(
        f"dry run ok: {type(model).__name__} with {n / 1e9:.3f}B parameters ({cfg.num_hidden_layers} layers, "
        f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}); tokenizer of {len(tok)} ids, a chat prompt of "
        f"{len(prompt)} tokens; LoRA r={tcfg.lora.r} on {','.join(tcfg.lora.target_modules)}; a step = "
        f"{args.prompts} x G={args.group_size} completions, {tokens} tokens; cap {args.gpu_gib:g} GiB"
    )
    print(text)
    return 0 if fits else 1


# -- measuring ------------------------------------------------------------------------------------------
def _gpu_processes() -> tuple[dict[int, float], float, float]:
    """{pid: MiB} of the processes on the GPU, and the GPU's used and total MiB (nvidia-smi)."""
    apps = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=10,
    ).stdout  # fmt: skip
    held = {}
    for line in apps.strip().splitlines():
        with contextlib.suppress(ValueError):  # "[N/A]" where the driver cannot tell
            pid, mib = line.split(",")
            held[int(pid)] = float(mib)
    used, total = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=10,
    ).stdout.splitlines()[0].split(",")  # fmt: skip
    return held, float(used), float(total)


def _resident_processes() -> tuple[dict[int, float], float, float]:
    """The rehearsal's stand-in for the GPU: {pid: resident MiB} of every process, their sum and the RAM."""
    page_mib = os.sysconf("SC_PAGE_SIZE") / 2**20
    held = {}
    for d in Path("/proc").iterdir():
        with contextlib.suppress(OSError, IndexError, ValueError):  # a process may end meanwhile
            held[int(d.name)] = int((d / "statm").read_text().split()[1]) * page_mib
    total = os.sysconf("SC_PHYS_PAGES") * page_mib
    return held, sum(held.values()), total


def _root(pid: int, roots: dict[int, str]) -> str:
    """The role ("server", "learner") whose process tree holds `pid` (vLLM's engine core is a child)."""
    while pid > 1:
        if pid in roots:
            return roots[pid]
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return "other"


class Sampler:
    """Samples (time, MiB per role, MiB used on the GPU) every `interval_s` in a thread. On a GPU the
    processes outside the run's roles are counted too (as "other": what else holds the card); on the CPU
    rehearsal they are every process on the machine, so they are left out."""

    def __init__(self, roots: dict[int, str], probe=_gpu_processes, count_others=True, interval_s=0.2):
        self.roots, self.probe, self.count_others, self.interval_s = roots, probe, count_others, interval_s
        self.samples: list[tuple[float, dict[str, float], float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            held, used, _ = self.probe()
            by_role: dict[str, float] = {}
            for pid, mib in held.items():
                role = _root(pid, self.roots)
                if role != "other" or self.count_others:
                    by_role[role] = by_role.get(role, 0.0) + mib
            self.samples.append((time.time(), by_role, used))
            time.sleep(self.interval_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def phases(events: list[dict], healthy_at: float, learner_at: float) -> list[tuple[float, str]]:
    """(start time, phase name), in order, from the server's event log: sleeps and wakes bound the phases. A
    sleep before the learner's first lease is its build (on a GPU it sleeps the server to load its model);
    after it, each sleep starts a step's training."""
    out = [(0.0, "server start"), (healthy_at, "server up, learner starting")]
    step, leased = 0, False
    for e in events:
        if e["t"] < learner_at:
            continue
        if e["event"] == "lease":
            leased = True
        elif e["event"] == "sleep":
            out.append((e["t"], f"step {step + 1}: training" if leased else "learner build (server asleep)"))
            step += leased
        elif e["event"] == "wake":
            out.append((e["t"], f"step {step + 1}: rollout (server awake)"))
        elif e["event"] == "publish":
            out.append((e["t"], f"publish v{e['version']} (server asleep)"))
    return out


def peaks(samples, bounds: list[tuple[float, str]]) -> dict[str, dict[str, float]]:
    """Peak MiB per phase: of each role and of the whole GPU."""
    result: dict[str, dict[str, float]] = {}
    for t, by_role, used in samples:
        name = next((n for start, n in reversed(bounds) if t >= start), bounds[0][1])
        row = result.setdefault(name, {})
        for role, mib in [*by_role.items(), ("GPU used", used)]:
            row[role] = max(row.get(role, 0.0), mib)
    return result


def predicted(cfg, dims: dict, gpu_gib: float) -> dict:
    """What the preflight predicts for this config, in MiB: each process's total and each check's need."""
    from learner.preflight import Dims, checks, estimate

    d = Dims.from_config(dims)
    e = estimate(cfg, d)
    mib = 2**20
    return {
        "server": sum(e["server"].values()) / mib,
        "learner": sum(e["learner"].values()) / mib,
        "checks": {c.what: round(c.need / mib) for c in checks(cfg, d, gpu_gib)},
    }


def versus(table: dict[str, dict[str, float]], pred: dict) -> list[tuple[str, float, float]]:
    """(what, predicted MiB, measured peak MiB): each process at its busiest against the preflight."""

    def most(role: str, word: str) -> float:
        return max((row.get(role, 0.0) for name, row in table.items() if word in name), default=0.0)

    both = max((row.get("server", 0) + row.get("learner", 0) for row in table.values()), default=0.0)
    return [
        ("server, generating (preflight: vLLM's needs)", pred["server"], most("server", "rollout")),
        ("learner, training", pred["learner"], most("learner", "training")),
        ("both processes, any phase", max(pred["checks"].values()), both),
    ]


def run(args) -> int:
    gpu = not args.rehearse
    if gpu and shutil.which("nvidia-smi") is None:
        print("error: no nvidia-smi: a CUDA machine is needed (--dry-run checks the script without one, "
              "--rehearse runs it on CPU)", file=sys.stderr)  # fmt: skip
        return 2
    import torch
    from transformers import AutoModelForCausalLM

    from harness.device_env import CAP_ENV
    from harness.net import free_port
    from shared.config import load_config

    probe = _gpu_processes if gpu else _resident_processes
    _, _, total_mib = probe()
    args.total_bytes = total_mib * 2**20
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="tandem-bench-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model"
    dims = TINY if args.rehearse else R1_DISTILL_1_5B
    print(f"[bench] random-init model and tokenizer -> {model_dir}", flush=True)
    t0 = time.time()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(args.rehearse), dtype=torch.bfloat16)
    model.save_pretrained(model_dir)
    make_tokenizer(model.config.vocab_size).save_pretrained(model_dir)
    del model
    print(f"[bench] model written in {time.time() - t0:.0f} s", flush=True)

    port = free_port()
    settings = overrides(args, str(model_dir), work, port)
    pred = predicted(load_config(CONFIG, settings), dims, args.gpu_gib)
    config = ["--config", str(CONFIG), *(f"--{o}" for o in settings)]
    env = dict(
        os.environ, TANDEM_API_TOKEN="bench", VLLM_ALLOW_RUNTIME_LORA_UPDATING="1", PYTHONUNBUFFERED="1"
    )
    if args.cap:
        env[CAP_ENV] = str(args.gpu_gib * 1024)
    logs = {name: (work / f"{name}.log").open("wb") for name in ("server", "learner")}

    def start(module: str, name: str):
        # through harness.device_env: the cap (--cap) and any import block the caller set apply to both
        cmd = [sys.executable, "-m", "harness.device_env", module, *config]
        out = {"stdout": logs[name], "stderr": subprocess.STDOUT}
        return subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True, **out)

    started = time.time()
    server = start("rollout_server", "server")
    sampler = Sampler({server.pid: "server"}, probe, count_others=gpu)
    import httpx

    healthy_at = None
    while healthy_at is None:
        if server.poll() is not None:
            sampler.close()
            print((work / "server.log").read_text()[-4000:], file=sys.stderr)
            return 1
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).raise_for_status()
            healthy_at = time.time()
        except httpx.HTTPError:
            time.sleep(1)
    print(f"[bench] server healthy after {healthy_at - started:.0f} s; starting the learner", flush=True)
    learner = start("learner", "learner")
    sampler.roots[learner.pid] = "learner"
    learner_at = time.time()
    rc = learner.wait()
    sampler.close()
    server.terminate()
    server.wait(timeout=120)
    if rc != 0:
        print((work / "learner.log").read_text()[-4000:], file=sys.stderr)
        return 1

    events = [json.loads(line) for line in (work / "server/events.jsonl").read_text().splitlines()]
    table = peaks(sampler.samples, phases(events, healthy_at, learner_at))
    metrics = [json.loads(line) for line in (work / "learner/metrics.jsonl").read_text().splitlines()]
    cap_mib = args.gpu_gib * 1024
    # The GPU's own "used" counts every process on it; this run's two are what the cap is about, unless the
    # driver lists no processes (some virtual machines): then the whole GPU's use stands in for them.
    listed = any(row.get("server") or row.get("learner") for row in table.values())
    if gpu and not listed:
        print("warning: nvidia-smi listed no processes: checking the cap against the whole GPU's use")
    ours = (lambda r: r.get("server", 0) + r.get("learner", 0)) if listed else (lambda r: r["GPU used"])
    over = [p for p, row in table.items() if ours(row) > cap_mib]
    unit = "MiB" if gpu else "MiB resident (rehearsal on CPU)"
    print(f"\n{'phase':<40} {'server':>9} {'learner':>9} {'both':>9} {'GPU used':>9}  (peak {unit})")
    for name, row in table.items():
        both = row.get("server", 0) + row.get("learner", 0)
        print(f"{name:<40} {row.get('server', 0):9.0f} {row.get('learner', 0):9.0f} {both:9.0f} "
              f"{row['GPU used']:9.0f}{'  OVER THE CAP' if name in over else ''}")  # fmt: skip
    rows = versus(table, pred)
    print(f"\n{'preflight predicted vs measured':<48} {'predicted':>10} {'measured':>10}  (MiB)")
    for what, want, got in rows:
        print(f"{what:<48} {want:10.0f} {got:10.0f}")

    def each(key: str, fmt: str) -> str:
        return ", ".join(format(m[key], fmt) for m in metrics)

    print(
        f"\nrollout tok/s per step: {each('perf/rollout_tok_s', '.0f')}; train s per step: "
        f"{each('perf/train_s', '.1f')}; step s: {each('perf/step_s', '.1f')}"
    )
    if metrics and "mem/gpu_train_peak_mib" in metrics[0]:
        print(f"learner's PyTorch peak while training, MiB per step: {each('mem/gpu_train_peak_mib', '.0f')}")
    results = {
        "device": "gpu" if gpu else "cpu (rehearsal)", "total_mib": total_mib, "cap_gib": args.gpu_gib,
        "capped_by_memory_fraction": bool(args.cap), "args": {k: v for k, v in vars(args).items()},
        "peak_mib_by_phase": table, "preflight_mib": pred,
        "predicted_vs_measured_mib": [{"what": w, "predicted": p, "measured": m} for w, p, m in rows],
        "metrics": metrics, "work_dir": str(work), "fits": not over,
    }  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print("fits" if not over else f"DOES NOT FIT {args.gpu_gib:g} GiB in: {', '.join(over)}")
    return 1 if over else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    return dry_run(args) if args.dry_run else run(args)


if __name__ == "__main__":
    sys.exit(main())

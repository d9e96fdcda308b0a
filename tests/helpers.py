"""Start real tandem processes on loopback for end-to-end tests, and make LoRA adapters with peft."""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

from harness import procs
from harness.adapters import random_adapter
from harness.net import free_port  # noqa: F401 (tests import it from here)
from harness.procs import Proc, tandem_env
from harness.runs import SMALL_LEARNER, SMALL_RUN  # noqa: F401 (tests import them from here)
from learner.client import RolloutClient
from shared import protocol as P

REPO = Path(__file__).resolve().parents[1]
TOKEN = "test-token"


def proc_env(**extra: str) -> dict[str, str]:
    env = tandem_env(TOKEN)
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "2")
    env.update(extra)
    return env


def start_learner(
    url: str, out: Path, log: Path, args: list[str], launcher: list[str] = (), **env: str
) -> Proc:
    """`python -m learner` on cpu.toml with `args`, against the server at `url` (unless `args` name
    learner.server_urls: they come after it), writing to `out`."""
    cmd = [*launcher, "-m", "learner", "--config", "deploy/configs/cpu.toml", f"--learner.server_urls={url}"]
    cmd += [*args, f"--learner.out_dir={out}"]
    return Proc(cmd, log, env=proc_env(OMP_NUM_THREADS="1", **env))


def server_args(config: str, port: int, state_dir: Path, overrides: list[str]) -> list[str]:
    """`python -m rollout_server` arguments, for tests that start (and restart) a server themselves."""
    return [
        "-m",
        "rollout_server",
        "--config",
        config,
        f"--server.port={port}",
        f"--server.state_dir={state_dir}",
    ] + [*overrides]


def start_server(
    tmp: Path,
    overrides: list[str],
    config: str = "deploy/configs/cpu.toml",
    timeout: float = 400.0,
    env: dict[str, str] | None = None,
) -> tuple[Proc, RolloutClient]:
    """A rollout server on a free port with its state under tmp/server, healthy, and a client for it."""
    state = [f"--server.state_dir={tmp / 'server'}", *overrides]
    proc, url = procs.start_server(config, state, free_port(), tmp / "server.log", env or proc_env(), timeout)
    return proc, RolloutClient(url, token=TOKEN)


def make_adapter(
    model_dir: str, out: Path, *, seed: int = 0, r: int = 8, targets=("q_proj", "v_proj"), scale=0.05
):
    """A peft LoRA adapter with non-zero B (so it changes the model), saved in peft's format."""
    return random_adapter(model_dir, out, seed=seed, r=r, targets=targets, scale=scale)


def jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file; none while it does not exist yet."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(what: str, cond, procs: list[Proc], timeout: float = 600.0) -> None:
    """Poll `cond` until true; fail naming `what` on timeout or if one of `procs` exits first."""
    import pytest

    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        for p in procs:
            assert p.alive(), f"{what}: a process exited early:\n{p.log()[-4000:]}"
        time.sleep(0.2)
    pytest.fail(f"timed out waiting until {what}")


def make_nan_adapter(src: Path, out: Path) -> Path:
    """A copy of the adapter at `src` whose lora_B is all NaN: well-formed, and poison to a sampler."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    weights = load_file(str(out / "adapter_model.safetensors"))
    weights = {k: torch.full_like(v, float("nan")) if "lora_B" in k else v for k, v in weights.items()}
    save_file(weights, str(out / "adapter_model.safetensors"))
    return out


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity, as every JSON reader but Python's does."""

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def non_finite_bodies(spec: dict) -> list[tuple[str, str]]:
    """(path, raw body) for every JSON POST route of an OpenAPI schema and each of its numeric fields,
    holding NaN, Infinity or -Infinity there: non-standard JSON, which Python's reader takes."""
    out = []
    for path, ops in spec["paths"].items():
        body = ops.get("post", {}).get("requestBody", {}).get("content", {}).get("application/json")
        if body is None:
            continue
        schema = body["schema"]
        if "$ref" in schema:
            schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
        for name, prop in schema.get("properties", {}).items():
            kinds = {prop.get("type")} | {alt.get("type") for alt in prop.get("anyOf", [])}
            if kinds & {"number", "integer"}:
                out += [(path, f'{{"{name}": {c}}}') for c in ("NaN", "Infinity", "-Infinity")]
    return out


def rescore(client, steps) -> list[tuple[dict, list[float]]]:
    """(completion, its model tokens' log-probs re-scored, each on the version stamped on it: its group's,
    or the one `versions` names) of every trained one."""
    out = []
    for record in steps:
        for g in record["groups"]:
            for c in g["completions"]:
                versions = P.Completion.model_validate(c).token_versions(g["policy_version"])
                scored = {  # the whole completion under each version that sampled some of it
                    v: client.score(g["prompt_token_ids"], c["token_ids"], version=v).logprobs
                    for v in sorted(set(versions))
                }
                mask = c["mask"] or [1] * len(c["token_ids"])
                model = [t for t, m in enumerate(mask) if m]
                out.append((c, [scored[v][t] for t, v in zip(model, versions, strict=True)]))
    return out


def make_tiny_model(folder: Path, tokenizer_from: str, *, labels: int = 0, seed: int = 0) -> Path:
    """A tiny Llama (two layers of width 32, random weights) with the tokenizer and chat template of the
    model at `tokenizer_from`, saved in `folder`. labels = 0: a causal LM, for tests of what surrounds the
    engine (its answers are noise, its cost next to none); labels >= 1: a sequence classifier whose score
    head is far from zero so that texts score apart, a reward model for `rm:` (labels = 1)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        num_labels=max(labels, 1),
    )  # fmt: skip
    if labels:
        model = LlamaForSequenceClassification(config)
        with torch.no_grad():  # a score head far from zero, so rewards differ between texts
            model.score.weight.normal_(0, 2.0)
    else:  # generation stops at the tokenizer's end of turn, as the real model's does
        config.eos_token_id = config.pad_token_id = tokenizer.eos_token_id
        model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def make_reward_model(folder: Path, tokenizer_from: str, labels: int = 1, seed: int = 0) -> Path:
    """A tiny sequence classifier (make_tiny_model with labels >= 1): a reward model for `rm:`."""
    return make_tiny_model(folder, tokenizer_from, labels=labels, seed=seed)


@functools.lru_cache(maxsize=4)
def _classifier(folder: Path):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    return AutoTokenizer.from_pretrained(folder), model


def reward_model_score(folder: Path, prompt: str, completion: str, max_tokens: int = 2048) -> float:
    """The classifier's forward pass on one conversation, unpadded, as transformers gives it."""
    import torch

    tokenizer, model = _classifier(folder)
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    with torch.no_grad():
        return model(torch.tensor([ids[:max_tokens]])).logits[0, 0].item()

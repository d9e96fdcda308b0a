"""The learner's loop end to end without a server (learner.replay_file), on a tiny model the test builds
(SmolLM2's tokenizer, 2 layers of width 32), the real DeepSpeed engine, fp32: the loss curve of an
uninterrupted run, and the same run stopped after step 2 and resumed, step for step (torchtune's "expected
loss curve after a resume"). A loop that saved its checkpoint before the optimizer step, or a resume that
lost the optimizer's state, gives another step 3. The resumed step 3 runs under the profiler
(learner.profile_step): its report is written, and the step computes what the unprofiled one did."""

from __future__ import annotations

import json
import math
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import REPO, proc_env

STEPS = 3
UNIFORM = -math.log(49152)  # an untrained model's log-prob of any token: the sampler's, near enough


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_dir) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(out / "model")
    for f in Path(model_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.suffix == ".jinja":
            shutil.copy(f, out / "model" / f.name)
    rng = random.Random(0)
    with open(out / "groups.jsonl", "w") as fh:
        for step in range(1, STEPS + 1):
            groups = []
            for p in range(2):
                completions = []
                for i in range(4):
                    ids = [rng.randrange(100, 1000) for _ in range(rng.randint(3, 8))]
                    completions.append(
                        {"token_ids": ids, "logprobs": [UNIFORM] * len(ids), "text": "x",
                         "reward": float((i + p + step) % 2), "finish_reason": "stop"}
                    )  # fmt: skip
                prompt = [rng.randrange(100, 1000) for _ in range(6)]
                groups.append(
                    {"group_id": f"g{step}-{p}", "prompt_id": f"p{p}", "prompt_token_ids": prompt,
                     "answer": "1", "policy_version": step - 1, "completions": completions}
                )  # fmt: skip
            fh.write(json.dumps({"step": step, "groups": groups}) + "\n")
    return out


def _learn(tiny: Path, out: Path, *extra: str) -> str:
    cmd = [
        sys.executable, "-m", "learner", f"--model.name={tiny / 'model'}", "--model.dtype=float32",
        f"--learner.replay_file={tiny / 'groups.jsonl'}", f"--learner.steps={STEPS}",
        f"--learner.out_dir={out}",
        "--learner.prompts_per_step=2", "--learner.micro_batch_size=4", "--learner.grad_accum=2",
        "--sampling.group_size=4", "--grpo.beta=0.04", "--learner.lr=0.01", "--learner.report_to=[]", *extra,
    ]  # fmt: skip
    run = subprocess.run(cmd, cwd=REPO, env=proc_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


def _curve(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_resumed_run_continues_the_uninterrupted_run_s_loss_curve(tiny, tmp_path):
    whole = tmp_path / "whole"
    _learn(tiny, whole, "--learner.keep_checkpoints=3")
    curve = _curve(whole)
    assert [r["step"] for r in curve] == [1, 2, 3]
    losses = [r["loss"] for r in curve]
    assert all(math.isfinite(x) for x in losses) and len(set(losses)) == 3  # each step its own batch
    assert all(r["grad_norm"] > 0 for r in curve)
    v1, v3 = (load_file(str(whole / "adapters" / f"v{v}" / "adapter_model.safetensors")) for v in (1, 3))
    assert max((v3[k] - v1[k]).abs().max().item() for k in v1) > 1e-4  # steps 2 and 3 moved the adapter

    # The same run, stopped after step 2 (its checkpoint is the one left) and resumed for step 3.
    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    (resumed / "checkpoints" / "latest").write_text("step-2")
    shutil.rmtree(resumed / "checkpoints" / "step-3")
    log = _learn(tiny, resumed, "--resume", "--learner.profile_step=3")
    assert "at step 2, policy v2" in log and "done at step 3" in log
    profile = (resumed / "profile" / "step_3.txt").read_text()
    assert "by operator:" in profile and "by operator and input shapes:" in profile
    ops = ("aten::mm", "aten::addmm", "aten::linear", "aten::bmm")
    assert any(op in profile for op in ops), profile[:2000]
    assert (resumed / "profile" / "step_3.trace.json").stat().st_size > 0
    again = _curve(resumed)
    assert [r["step"] for r in again] == [1, 2, 3]
    for key in ("loss", "grad_norm", "kl/ref", "ratio/clipfrac"):
        assert again[2][key] == pytest.approx(curve[2][key], rel=1e-5, abs=1e-8), key
    a = load_file(str(whole / "adapters" / "v3" / "adapter_model.safetensors"))
    b = load_file(str(resumed / "adapters" / "v3" / "adapter_model.safetensors"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6

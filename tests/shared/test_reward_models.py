"""Reward models (shared/reward_models.py, `"rm:folder"` in reward.functions): a tiny sequence classifier
built and saved here (SmolLM2's tokenizer and chat template, two layers of width 32, random weights)
scores each completion as its own unpadded forward pass does, in batches that pad; the runner weighs it
with the other functions; a folder that is not a one-output classifier is refused in one line; a forward
pass that fails gives 0, counted, and the other functions still score."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from shared.config import ConfigError, RewardConfig
from shared.reward_models import RewardModel, check
from shared.rewards import RewardCall, RewardRunner, resolve
from tests.helpers import make_reward_model, reward_model_score

CALLS = [
    RewardCall("so #### 3", "3", "Q: 1+2?", {}),
    RewardCall("I think the answer is 4, since 2 + 2 = 4. #### 4", "3", "What is 1+2?", {}),
    RewardCall("#### 3", "3", "Q: 1+2?", {}),  # the shortest: padded most in a batch
]


@pytest.fixture(scope="module")
def rm(tmp_path_factory, model_dir) -> Path:
    return make_reward_model(tmp_path_factory.mktemp("rm") / "tiny-rm", model_dir)


def _score(cfg: RewardConfig, calls: list[RewardCall]) -> tuple[list[dict[str, float]], RewardRunner]:
    runner = RewardRunner(cfg)

    async def go():
        try:
            return await runner.score(calls)
        finally:
            await runner.close()

    return asyncio.run(go()), runner


def test_a_reward_model_scores_each_completion_as_its_own_forward_pass_does(rm):
    want = [reward_model_score(rm, c.prompt, c.completion) for c in CALLS]
    assert max(want) - min(want) > 0.01, "the texts score alike: nothing is compared"
    # batches of 2: the first pads its shorter text, the last holds one
    model = RewardModel(rm, batch_size=2)
    got = model.score([(c.prompt, c.completion) for c in CALLS])
    assert got == pytest.approx(want, abs=1e-5)
    assert "<|im_start|>assistant\nso #### 3" in model.text("Q: 1+2?", "so #### 3")  # the chat template


def test_the_runner_weighs_a_reward_model_with_the_other_functions(rm):
    cfg = RewardConfig(functions=["gsm8k", f"rm:{rm}"], weights=[1.0, 0.5], model_batch_size=2)
    fns = resolve(cfg)
    assert [(f.name, f.weight, f.inline) for f in fns] == [("gsm8k", 1.0, True), ("tiny-rm", 0.5, False)]
    out, runner = _score(cfg, CALLS)
    want = [reward_model_score(rm, c.prompt, c.completion) for c in CALLS]
    assert [r["gsm8k"] for r in out] == [1.0, 0.0, 1.0]
    assert [r["tiny-rm"] for r in out] == pytest.approx(want, abs=1e-5)
    assert runner.total(out[1]) == pytest.approx(0.5 * want[1], abs=1e-5)
    assert not runner.failures
    # one call at a time (lm-eval's path): the same value
    assert fns[1].fn(CALLS[1].completion, "3", CALLS[1].prompt, {}) == pytest.approx(want[1], abs=1e-5)


def test_a_long_conversation_is_cut_to_model_max_tokens(rm):
    long = RewardCall("step " * 400 + "#### 3", "3", "Q: 1+2?", {})
    out, runner = _score(RewardConfig(functions=[f"rm:{rm}"], model_max_tokens=64), [long])
    assert out[0]["tiny-rm"] == pytest.approx(
        reward_model_score(rm, long.prompt, long.completion, 64), abs=1e-5
    )
    assert not runner.failures


def test_a_folder_that_is_not_a_one_output_classifier_is_refused_in_one_line(tmp_path, model_dir):
    two = make_reward_model(tmp_path / "two-labels", model_dir, labels=2)
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    for spec, message in [
        (f"rm:{two}", r"reward.functions\[1\]: 'rm:.*two-labels': .* has 2 outputs; a reward model has one"),
        (f"rm:{model_dir}", r"reward.functions\[1\]: .* is a LlamaForCausalLM, not a sequence classifier"),
        (f"rm:{tmp_path / 'empty'}", r"reward.functions\[1\]: .* holds no config.json"),
        (f"rm:{tmp_path / 'broken'}", r"reward.functions\[1\]: .*config.json cannot be read"),
        ("rm:", r"reward.functions\[1\]: 'rm:': name the reward model's folder after 'rm:'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            resolve(RewardConfig(functions=["gsm8k", spec]))
    # checked from config.json alone: no weights are read
    assert json.loads((two / "config.json").read_text())["architectures"] == [
        "LlamaForSequenceClassification"
    ]
    (two / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="has 2 outputs"):
        check(f"rm:{two}")


def test_a_failing_forward_pass_gives_zero_counted_and_the_others_still_score(rm, monkeypatch):
    def broken(self, pairs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(RewardModel, "score", broken)
    seen = []
    cfg = RewardConfig(functions=["gsm8k", f"rm:{rm}"])
    runner = RewardRunner(cfg, on_failure=lambda name, kind: seen.append((name, kind)))

    async def go():
        return await runner.score(CALLS)

    out = asyncio.run(go())
    assert out == [
        {"gsm8k": 1.0, "tiny-rm": 0.0},
        {"gsm8k": 0.0, "tiny-rm": 0.0},
        {"gsm8k": 1.0, "tiny-rm": 0.0},
    ]
    assert seen == [("tiny-rm", "raised")] * 3 and runner.failures[("tiny-rm", "raised")] == 3


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "CPU"])
def test_model_device_names_cpu_or_a_cuda_device(device):
    with pytest.raises(ValueError, match="model_device"):
        RewardConfig(model_device=device)
    assert RewardConfig(model_device="cuda:1").model_device == "cuda:1"

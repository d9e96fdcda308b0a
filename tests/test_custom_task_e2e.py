"""Train on the user's own task end to end: a JSONL dataset with its own column names and a reward module,
both written here into a temporary folder (neither importable from the package), with three weighted
reward functions (a plain one, an async one read from its file path, one that always raises), a reward
model (a tiny sequence classifier saved here: `rm:folder`) and an LLM judge (the server's own served version
through its OpenAI API: url = 'self'), the real rollout server (vLLM) and the real DeepSpeed learner on
SmolLM2, two steps."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from transformers import AutoTokenizer

from shared.datasets import make_arith
from tests.helpers import (
    SMALL_LEARNER,
    make_reward_model,
    proc_env,
    reward_model_score,
    start_learner,
    start_server,
)

pytestmark = pytest.mark.slow

REWARDS = """
import re

def exact(completion, answer, prompt, metadata):
    numbers = re.findall(r"-?\\d+", completion)
    return 1.0 if numbers and numbers[-1] == answer else 0.0

async def tagged(completion, answer, prompt, metadata):
    assert prompt.startswith("Level "), prompt  # the template's rendering reaches the reward
    return metadata["level"] / 10 + (0.5 if "####" in completion else 0.0)

def broken(completion, answer, prompt, metadata):
    raise KeyError("a bug in the user's reward function")
"""
WEIGHTS = {"exact": 1.0, "tagged": 0.5, "broken": 0.25, "tiny-rm": 0.1, "judge": 0.2}
JUDGE = [
    "--reward.judge.url=self",
    "--reward.judge.model=latest",  # the served version: base would switch merged weights back and forth
    "--reward.judge.rubric=Question: {prompt}\nAnswer: {completion}\nIs it {answer}? Reply yes or no.",
    "--reward.judge.max_tokens=4",
]


def _exact(text: str, answer: str) -> float:
    numbers = re.findall(r"-?\d+", text)
    return 1.0 if numbers and numbers[-1] == answer else 0.0


def test_two_steps_on_a_jsonl_task_with_user_reward_functions(tmp_path, model_dir):
    data, code = tmp_path / "mytask", tmp_path / "code"
    data.mkdir()
    code.mkdir()
    rows = [
        {"uid": f"q{i:03d}", "problem": p.question, "solution_value": int(p.answer), "level": 1 + i % 3}
        for i, p in enumerate(make_arith("train", 64, difficulty=1))
    ]
    too_long = {"uid": "long", "problem": "How many? " * 400, "solution_value": 1, "level": 1}  # > 512 tokens
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*rows, too_long]))
    (code / "my_rewards.py").write_text(REWARDS)
    rm = make_reward_model(tmp_path / "tiny-rm", model_dir)
    task = [
        "--data.task=custom",
        f"--data.path={data}",
        "--data.custom.prompt_column=problem",
        "--data.custom.answer_column=solution_value",
        "--data.custom.id_column=uid",
        "--data.system_prompt=You are a careful calculator.",
        "--data.prompt_template=Level {level}: {prompt}\nEnd with a line '#### <number>'.",
        f'--reward.functions=["my_rewards:exact", "{code}/my_rewards.py:tagged", "my_rewards:broken", '
        f'"rm:{rm}", "judge"]',
        *JUDGE,
        f"--reward.weights={list(WEIGHTS.values())}",
        "--reward.truncated=score",  # cpu.toml zeroes completions cut at max_new_tokens: score them all here
        "--sampling.group_size=4",
        "--sampling.max_new_tokens=40",
        "--server.prompts_per_batch=2",
        "--server.queue_size=4",
    ]
    server, client = start_server(tmp_path, task, env=proc_env(PYTHONPATH=str(code)))
    try:
        out = tmp_path / "run"
        learner = start_learner(
            client.url, out, tmp_path / "learner.log", [*task, *SMALL_LEARNER, "--learner.steps=2"]
        )
        assert learner.wait(timeout=900) == 0, learner.log()[-5000:]
        client.pause_production()  # trained: what follows has the engine to itself
        assert client.health().policy_version == 2
        metrics_text = httpx.get(f"{client.url}/metrics", timeout=30).text
    finally:
        client.close()
        server.stop()

    by_uid = {r["uid"]: r for r in rows}
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    steps = [json.loads(line) for line in (out / "groups.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and [m["step"] for m in metrics] == [1, 2]
    for record, m in zip(steps, metrics, strict=True):
        values = {name: [] for name in WEIGHTS}
        for g in record["groups"]:
            row = by_uid[g["prompt_id"]]  # ids from the id column
            assert g["answer"] == str(row["solution_value"])
            prompt = tokenizer.decode(g["prompt_token_ids"])
            assert (
                "You are a careful calculator." in prompt
                and f"Level {row['level']}: {row['problem']}" in prompt
            )
            user = f"Level {row['level']}: {row['problem']}\nEnd with a line '#### <number>'."
            for c in g["completions"]:
                want = {
                    "exact": _exact(c["text"], g["answer"]),
                    "tagged": row["level"] / 10 + (0.5 if "####" in c["text"] else 0.0),
                    "broken": 0.0,
                    "tiny-rm": reward_model_score(rm, user, c["text"]),  # the reward model, by hand
                    "judge": c["rewards"]["judge"],  # SmolLM2's yes (1) or no (0); 0 when neither: counted
                }
                assert want["judge"] in (0.0, 1.0)
                assert c["rewards"] == pytest.approx(want, rel=1e-5, abs=1e-5)  # (the model: batched)
                assert c["reward"] == pytest.approx(sum(WEIGHTS[n] * v for n, v in want.items()), abs=1e-5)
                for name, v in want.items():
                    values[name].append(v)
        for name, v in values.items():  # the learner logs each function's mean over what it trained on
            assert m[f"reward/{name}/mean"] == pytest.approx(sum(v) / len(v), abs=1e-5)
    assert "long" not in {g["prompt_id"] for record in steps for g in record["groups"]}
    assert re.search(r"^tandem_prompts_too_long_total 1\.0$", metrics_text, re.M)  # left out at start
    assert "skipped 1 of 65 custom problems whose prompt alone" in (tmp_path / "server.log").read_text()
    # the judge asked the server's own OpenAI API once per distinct completion it scored (16 a step at
    # least); an answer with neither yes nor no was counted, not lost
    judged = (tmp_path / "server.log").read_text().count('"POST /v1/chat/completions HTTP/1.1" 200')
    bad = re.search(r'tandem_reward_failures_total\{function="judge",kind="bad_type"\} (\S+)', metrics_text)
    assert judged >= 16, judged
    print(f"judge: {judged} requests, {float(bad[1]) if bad else 0:.0f} answers without a yes or no")
    failures = re.search(
        r'tandem_reward_failures_total\{function="broken",kind="raised"\} (\S+)', metrics_text
    )
    assert (
        failures and float(failures.group(1)) >= 16
    )  # every call of the 2 steps' 4 groups x G = 4, at least

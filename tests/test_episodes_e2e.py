"""Agents end to end: a tool-use task and a multi-turn task, each written here into a temporary folder,
two steps each with the real rollout server (vLLM, merged versions) and the real DeepSpeed learner on
SmolLM2. Every trained trajectory's model tokens, re-scored on the version stamped on its group, give
back their sampler log-probs (sampled at T = 1, so those are the policy's own); the environment's tokens
are exactly what the chat template adds for the messages the environment sent. The multi-turn run's server
produces continuously (server.production): its groups' episodes end and are queued each on their own."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from rollout_server.production.episodes import Appender
from shared.config import load_config
from shared.datasets import chat_prompt_ids, load_problems
from shared.rewards import reasoning_gym
from tests.helpers import SMALL_LEARNER, rescore, start_learner, start_server

pytestmark = pytest.mark.slow

TASK = '''
import re

def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b

def guess(messages, answer, metadata):
    """Higher or lower: the episode ends when the model's last number is the answer."""
    numbers = re.findall(r"-?\\d+", messages[-1]["content"])
    if numbers and int(numbers[-1]) == int(answer):
        return None, True
    if not numbers:
        return "Say a number.", False
    return ("Higher." if int(numbers[-1]) < int(answer) else "Lower."), False

def solved(completion, answer, prompt, metadata):
    said = [m["content"] for m in metadata["episode"]["messages"] if m["role"] == "assistant"]
    return float(any(re.findall(r"-?\\d+", s)[-1:] == [answer] for s in said))
'''

COMMON = [
    "--sampling.temperature=1.0",  # sampler log-probs are then the policy's own, comparable with /v1/score
    "--sampling.max_new_tokens=24",
    "--sampling.group_size=4",
    "--server.prompts_per_batch=2",
    "--server.queue_size=4",
    "--reward.truncated=score",
    "--env.max_turns=3",
    "--data.arith.difficulty=1",
]


def _train(tmp_path, name: str, task: list[str]) -> tuple[list[dict], list[dict], list]:
    """Two steps on `task`: (groups.jsonl, metrics.jsonl, each trained completion re-scored)."""
    (tmp_path / name).mkdir()
    server, client = start_server(tmp_path / name, [*COMMON, *task])
    out = tmp_path / name / "run"
    learner = start_learner(
        client.url,
        out,
        tmp_path / name / "learner.log",
        [*COMMON, *task, *SMALL_LEARNER, "--learner.steps=2"],
    )
    try:
        assert learner.wait(timeout=900) == 0, learner.log()[-5000:]
        client.pause_production()  # trained: what follows has the engine to itself
        assert client.health().policy_version == 2
        steps = [json.loads(line) for line in (out / "groups.jsonl").read_text().splitlines()]
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        rescored = rescore(client, steps)
    finally:
        client.close()
        server.stop()
    return steps, metrics, rescored


def _check(rescored, tokenizer) -> int:
    """Sampler log-probs match the re-scored ones; environment segments are the template's tokens for a
    message. Returns how many trajectories had environment turns."""
    appender, episodes = Appender(tokenizer), 0
    for c, lps in rescored:
        assert len(lps) == len(c["logprobs"])
        mean = sum(abs(a - b) for a, b in zip(lps, c["logprobs"], strict=True)) / len(lps)
        assert mean < 2e-3, mean
        if c["mask"]:
            episodes += 1
            ids, mask = c["token_ids"], c["mask"]
            # Each environment segment is the template's rendering of one message (its text decoded back
            # from the segment), after a turn that ended with the end-of-turn token or was cut (closed).
            starts = [t for t in range(1, len(mask)) if mask[t] == 0 and mask[t - 1] == 1]
            for s in starts:
                end = next(t for t in range(s, len(mask)) if mask[t] == 1)
                stop = ids[s - 1] if ids[s - 1] == tokenizer.eos_token_id else None  # None: a cut turn
                segment = ids[s:end]
                text = tokenizer.decode(segment)
                role = "tool" if "<|im_start|>tool" in text else "user"
                content = text.split(f"<|im_start|>{role}\n", 1)[1].split("<|im_end|>", 1)[0]
                assert segment == appender.environment_ids([{"role": role, "content": content}], stop)
    return episodes


def _tool_task(folder) -> list[str]:
    """Arithmetic with the add tool, each prompt opening with one worked exchange that calls it (a model of
    135M parameters copies the call; told of the tool alone, it never made one in 16 samples)."""
    example = [
        {"role": "user", "content": "What is 2 + 3?"},
        {
            "role": "assistant",
            "content": '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
        },
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "#### 5"},
    ]
    rows = [
        {"messages": [*example, {"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
        for a in range(11, 19)
        for b in range(21, 29)
    ]
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [
        "--data.task=custom",
        f"--data.path={folder}",
        "--data.custom.messages_column=messages",
        "--data.custom.answer_column=answer",
    ]


def test_two_steps_each_on_a_tool_task_and_a_multi_turn_task(tmp_path, model_dir):
    (tmp_path / "task.py").write_text(TASK)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tools = [
        *_tool_task(tmp_path / "sums"),
        "--env.kind=tools",
        f'--env.tools=["{tmp_path}/task.py:add"]',
        f'--reward.functions=["gsm8k", "{tmp_path}/task.py:solved"]',
    ]
    steps, metrics, rescored = _train(tmp_path, "tools", tools)
    assert [m["step"] for m in metrics] == [1, 2] and "reward/solved/mean" in metrics[0]
    with_tools = _check(rescored, tokenizer)
    guessing = [
        "--env.kind=multi_turn",
        f"--env.step={tmp_path}/task.py:guess",
        "--data.system_prompt=Reply with one number only.",
        f'--reward.functions=["{tmp_path}/task.py:solved"]',
        "--server.production=continuous",  # episodes of each group played and queued on their own
        "--server.max_inflight_groups=2",  # the lockstep run's 2 prompts at a time: no more work than it
    ]
    steps, metrics, rescored = _train(tmp_path, "guess", guessing)
    multi = _check(rescored, tokenizer)
    print(f"trained trajectories with environment turns: tools {with_tools}, multi-turn {multi} (of 16 each)")
    # SmolLM2-135M rarely writes a tool call, even after a worked example: the tool turns' tokens are
    # checked where there are any, and always by the fast tests (tests/rollout_server/test_episodes.py).
    assert multi > 0, "no episode went past its first turn: the environment never answered"


def test_two_steps_on_a_reasoning_gym_task(tmp_path, model_dir):
    """data.task = 'reasoning_gym' in one line: generated offline, the reward its own score_answer; two
    solved problems shown before each question (data.reasoning_gym.shots), trained and re-scored as
    rendered."""
    pytest.importorskip("reasoning_gym")
    task = [
        "--data.task=reasoning_gym",
        "--data.reasoning_gym.task=basic_arithmetic",
        '--data.reasoning_gym.config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}',
        "--data.reasoning_gym.shots=2",
    ]
    steps, metrics, rescored = _train(tmp_path, "rg", task)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(0 <= m["reward/reasoning_gym/mean"] <= 1 for m in metrics)
    problems = {p.id: p for p in load_problems(load_config(None, [o[2:] for o in task]).data)}
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for record in steps:  # each reward is the task's score_answer of the completion's <answer> tag
        for g in record["groups"]:
            meta = dict(problems[g["prompt_id"]].metadata)
            # the prompt trained on is the conversation with its shots: 2 solved problems, then the question
            conversation = problems[g["prompt_id"]].conversation()
            assert [m["role"] for m in conversation] == ["system", *["user", "assistant"] * 2, "user"]
            assert g["prompt_token_ids"] == chat_prompt_ids(tokenizer, conversation)
            for c in g["completions"]:
                assert c["rewards"] == {"reasoning_gym": reasoning_gym(c["text"], g["answer"], "", meta)}
    assert _check(rescored, tokenizer) == 0  # single turn: no episodes

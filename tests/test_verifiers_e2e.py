"""A `verifiers` environment end to end (env.kind = "verifiers"): a taskset of two-turn episodes written
here into a temporary folder (its tasks, its rewards, its env's control flow: the model answers, the
environment asks a follow-up, the model answers again), played by the library's own `null` harness on its
`subprocess` runtime through its own training client, against the real rollout server (vLLM, SmolLM2) and
the real DeepSpeed learner, two steps. Every trained episode has two model turns; every model token,
re-scored on the version stamped on its group, gives back its sampler log-prob; the rubric's values reach
metrics.jsonl under their names; no group was dropped by the check against the engine's records."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.helpers import SMALL_LEARNER, TOKEN, proc_env, rescore, start_learner, start_server

pytestmark = pytest.mark.slow
pytest.importorskip("verifiers")

TASKSET = '''
"""Two turns: add two numbers, then add a third to the result."""
import re

import verifiers.v1 as vf


class SumData(vf.TaskData):
    first: int
    third: int
    answer: int


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task, trace) -> float:
        numbers = re.findall(r"-?\\d+", trace.last_reply or "")
        return float(bool(numbers) and int(numbers[-1]) == task.answer)

    @vf.reward(weight=0.5)
    async def first_right(self, task, trace) -> float:
        replies = [str(m.content) for m in trace.assistant_messages]
        return float(bool(replies) and str(task.first) in replies[0])


class SumEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class SumEnv(vf.Env[SumEnvConfig]):
    async def run(self, task, agents):
        async with agents.player.interaction(task) as chat:
            segment = await chat.turn()
            if not segment.terminated:
                await chat.turn(f"Now add {task.data.third} to that. Reply with the number only.")


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        for i in range(32):
            a, b, c = i % 7 + 1, i % 5 + 2, i % 3 + 1
            prompt = f"What is {a} + {b}? Reply with the number only."
            yield SumTask(SumData(prompt=prompt, first=a + b, third=c, answer=a + b + c), self.config.task)


__all__ = ["SumTaskset", "SumEnv"]
'''

COMMON = [
    "--sampling.temperature=1.0",  # sampler log-probs are then the policy's own, comparable with /v1/score
    "--sampling.max_new_tokens=16",
    "--sampling.group_size=4",
    "--server.prompts_per_batch=2",
    "--server.queue_size=4",
    "--env.kind=verifiers",
    '--env.verifiers={"taskset": {"id": "two_turn_sums"}}',
]


def test_two_steps_on_a_verifiers_environment_of_two_turns(tmp_path, model_dir):
    (tmp_path / "two_turn_sums.py").write_text(TASKSET)
    env = proc_env(PYTHONPATH=str(tmp_path))
    server, client = start_server(tmp_path, COMMON, env=env)
    out = tmp_path / "run"
    learner = start_learner(
        client.url, out, tmp_path / "learner.log", [*COMMON, *SMALL_LEARNER, "--learner.steps=2"],
        PYTHONPATH=str(tmp_path),
    )  # fmt: skip
    try:
        assert learner.wait(timeout=900) == 0, learner.log()[-5000:]
        steps = [json.loads(line) for line in (out / "groups.jsonl").read_text().splitlines()]
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        rescored = rescore(client, steps)
        text = httpx.get(f"{client.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    finally:
        client.close()
        server.stop()
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:  # the rubric's values, by name
        assert 0 <= m["reward/correct/mean"] <= 1 and 0 <= m["reward/first_right/mean"] <= 1
    invalid = re.search(r"^tandem_groups_invalid_total (\S+)$", text, re.M)
    assert invalid and float(invalid[1]) == 0, "a group failed the check against the engine's records"
    assert len(rescored) == 2 * 2 * 4  # 2 steps x 2 prompts x G = 4
    for c, lps in rescored:
        ids, mask = c["token_ids"], c["mask"]
        turns = sum(1 for t in range(len(mask)) if mask[t] == 1 and (t == 0 or mask[t - 1] == 0))
        assert turns == 2, f"{turns} model turns in an episode of two: {mask}"
        assert c["rewards"].keys() == {"correct", "first_right"}
        assert c["reward"] == pytest.approx(c["rewards"]["correct"] + 0.5 * c["rewards"]["first_right"])
        assert len(lps) == len(c["logprobs"]) == sum(mask) and len(ids) == len(mask)
        mean = sum(abs(a - b) for a, b in zip(lps, c["logprobs"], strict=True)) / len(lps)
        assert mean < 2e-3, mean

"""A `verifiers` taskset of two-turn episodes: the model adds two numbers, the environment asks it to add a
third to its answer, the model answers again. Rewards: `correct` (the last reply ends with the sum of all
three) and `first_right` (weight 0.5: the first reply holds the sum of the first two).

Train on it (both processes; examples/ on PYTHONPATH, so that the taskset id imports):

    PYTHONPATH=examples python -m rollout_server --config deploy/configs/cpu.toml \\
        --env.kind=verifiers --env.verifiers='{"taskset": {"id": "two_turn_sums"}}' --env.verifiers_eval=100

The taskset is the library's own kind (a Taskset of typed tasks, an Env whose run() drives the seat turn by
turn, rewards as decorated methods): it runs unchanged under the library's own eval too. 1,000 tasks from a
fixed seed; with env.verifiers_eval = 100 the last 100 are held out for learner.evaluate.
"""

import random
import re

import verifiers.v1 as vf

FOLLOW_UP = "Now add {third} to that. Reply with the number only."


class SumData(vf.TaskData):
    first: int  # the sum the first turn asks for
    third: int  # what the second turn adds
    answer: int


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task, trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply or "")
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
                await chat.turn(FOLLOW_UP.format(third=task.data.third))


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        rng = random.Random(0)
        for _ in range(1000):
            a, b, c = rng.randint(1, 9), rng.randint(1, 9), rng.randint(1, 5)
            prompt = f"What is {a} + {b}? Reply with the number only."
            yield SumTask(SumData(prompt=prompt, first=a + b, third=c, answer=a + b + c), self.config.task)


__all__ = ["SumTaskset", "SumEnv"]

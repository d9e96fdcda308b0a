"""The calculator task (examples/calculator.py) as a `verifiers` taskset with a function tool: the library's
own `Toolset`, an MCP tool server its runtime starts for each episode, whose `multiply` the model calls.

Train on it (both processes; examples/ on PYTHONPATH, so that the taskset id imports):

    PYTHONPATH=examples python -m rollout_server --config deploy/configs/cpu.toml \\
        --env.kind=verifiers --env.verifiers='{"taskset": {"id": "verifiers_calculator"}}'

The library's `null` harness offers the toolset's tools to the model; SmolLM2's chat template has no place
for them, so tandem's renderer (env.renderer = "bridge") describes them in the system message and reads the
model's <tool_call>{"name": ..., "arguments": {...}}</tool_call> back as the library's tool calls, as
env.kind = "tools" does. Each prompt opens with calculator.py's worked exchange. Reward `solved`: the last
reply ends with the product.
"""

import re

import calculator
import verifiers.v1 as vf


class Multiply(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # the tool is `multiply`, as in the worked exchange

    @vf.tool
    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first integer
            b: the second integer
        """
        return calculator.multiply(a, b)


class ProductData(vf.TaskData):
    answer: str


class ProductTask(vf.Task[ProductData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [Multiply(vf.ToolsetConfig())]

    @vf.reward
    async def solved(self, task, trace) -> float:
        numbers = re.findall(r"-?\d+", (trace.last_reply or "").replace(",", ""))
        return float(bool(numbers) and numbers[-1] == task.answer)


# calculator.py's worked exchange, its call as the library's tool call
CALL = {"id": "call_0", "name": "multiply", "arguments": '{"a": 12, "b": 34}'}
EXAMPLE = [
    {"role": "user", "content": "What is 12 * 34?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_0", "content": "408"},
    {"role": "assistant", "content": "The answer is 408."},
]


class ProductTaskset(vf.Taskset[ProductTask, vf.TasksetConfig]):
    def load(self):
        for row in calculator.rows(1000, seed=0):
            prompt = [*EXAMPLE, row["messages"][-1]]
            yield ProductTask(ProductData(prompt=prompt, answer=row["answer"]), self.config.task)


__all__ = ["ProductTaskset"]

if __name__ == "__main__":  # the library starts the tool server as `python -m verifiers_calculator`
    Multiply.run()

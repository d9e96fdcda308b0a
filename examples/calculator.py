"""A tool-use task where only the tool's answer can win: multiply a 3-digit by a 2-digit number.

    python examples/calculator.py DIR          # writes DIR/train.jsonl (2,000 rows) and DIR/test.jsonl (200)

Train on it (both processes, or an [env] section in your config):

    --data.task=custom --data.path=DIR
    --data.custom.messages_column=messages --data.custom.answer_column=answer
    --env.kind=tools --env.tools='["examples/calculator.py:multiply"]'
    --reward.functions='["examples/calculator.py:solved"]'

SmolLM2-135M cannot multiply 347 by 86 in its head; it succeeds when it calls `multiply` and copies the
result into its answer. Each prompt opens with one worked exchange (a model of 135M parameters copies a
call it has seen; told of the tool alone it hardly ever makes one). docs/benchmarks.md §10 measures how
GRPO teaches it to use the tool.
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return int(a) * int(b)


def solved(completion: str, answer: str, prompt: str, metadata: dict) -> float:
    """1 when the episode's last turn ends with the right number, else 0."""
    numbers = re.findall(r"-?\d+", completion.replace(",", ""))
    return float(bool(numbers) and numbers[-1] == answer)


EXAMPLE = [
    {"role": "user", "content": "What is 12 * 34?"},
    {
        "role": "assistant",
        "content": '<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}</tool_call>',
    },
    {"role": "tool", "content": "408"},
    {"role": "assistant", "content": "The answer is 408."},
]


def rows(n: int, seed: int, avoid: set[tuple[int, int]] = frozenset()) -> list[dict]:
    """n distinct problems, none of them in `avoid`."""
    rng, seen, out = random.Random(seed), set(avoid), []
    while len(out) < n:
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        question = {"role": "user", "content": f"What is {a} * {b}?"}
        out.append({"id": f"{a}x{b}", "messages": [*EXAMPLE, question], "answer": str(a * b), "pair": [a, b]})
    return out


def write(folder: str | Path, train: int = 2000, test: int = 200) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    train_rows = rows(train, seed=0)
    test_rows = rows(test, seed=1, avoid={tuple(r["pair"]) for r in train_rows})
    for name, split in (("train", train_rows), ("test", test_rows)):
        with open(folder / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps({k: v for k, v in r.items() if k != "pair"}) + "\n" for r in split)
    return folder


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit(__doc__.split("\n\n")[1].strip())
    print(f"wrote {write(sys.argv[1])}/{{train,test}}.jsonl")

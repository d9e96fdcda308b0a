"""Prompt sources: GSM8K (a local JSONL folder or the hub) and `arith`, a generated task of integer
word problems whose difficulty can be tuned to the model's edge of competence.

A dataset is a list of `Problem`s; `epoch_order` gives the deterministic order of an epoch, and
`chat_prompt` renders a problem through the model's chat template (duck-typed tokenizer: this module
imports neither torch nor transformers; `datasets` is imported only to read the hub).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from shared.config import DataConfig
from shared.reward import extract_answer

INSTRUCTION = (
    "Solve the problem step by step. End your reply with a final line of the form '#### <answer>', "
    "where <answer> is just the number."
)


@dataclass(frozen=True)
class Problem:
    id: str  # stable across runs: "<task>-<split>-<index>"
    question: str
    answer: str  # normalised final answer, e.g. "1000"


class DatasetError(RuntimeError):
    pass


def _gsm8k_rows(split: str, path: str | None, hub_id: str) -> list[dict]:
    if path is not None:
        file = Path(path) / f"{split}.jsonl"
        if not file.is_file():
            raise DatasetError(f"GSM8K split '{split}' not found: {file} does not exist")
        rows = []
        with file.open() as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DatasetError(f"{file}:{lineno}: invalid JSON: {e}") from None
                if not isinstance(row, dict) or "question" not in row or "answer" not in row:
                    raise DatasetError(f"{file}:{lineno}: need fields 'question' and 'answer'")
                rows.append(row)
        return rows
    try:
        import datasets as hf_datasets
    except ImportError:
        raise DatasetError("loading GSM8K from the hub needs `pip install datasets`") from None
    try:
        ds = hf_datasets.load_dataset(hub_id, "main", split=split)
    except Exception as e:  # network, auth, unknown split: say which dataset and how to avoid the hub
        raise DatasetError(
            f"could not load {hub_id} (config 'main', split '{split}') from the hub: {e}. "
            "Offline? Set data.path to a folder with {train,test}.jsonl."
        ) from e
    return [{"question": r["question"], "answer": r["answer"]} for r in ds]


def load_gsm8k(split: str = "train", path: str | None = None, hub_id: str = "openai/gsm8k") -> list[Problem]:
    problems = []
    for i, row in enumerate(_gsm8k_rows(split, path, hub_id)):
        answer = extract_answer(row["answer"])
        if answer is None:
            raise DatasetError(f"GSM8K {split}[{i}]: no final answer in the reference solution")
        problems.append(Problem(id=f"gsm8k-{split}-{i}", question=row["question"], answer=answer))
    return problems


_NAMES = ["Ava", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemi", "Liam"]
_ITEMS = ["apples", "marbles", "stickers", "books", "coins", "pencils", "cards", "shells", "stamps", "eggs"]


def _arith_problem(rng: random.Random, difficulty: int) -> tuple[str, int]:
    """A short word problem with an exact non-negative integer answer. `difficulty` (1..6) sets the
    number of operations and the size of the operands."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    hi = 10 * difficulty
    total = rng.randint(2, hi)
    parts = [f"{name} has {total} {item}."]
    for _ in range(max(1, difficulty - 1)):
        op = rng.choice(["buy", "give", "double"] if total <= hi * 4 else ["give"])
        if op == "buy" or total < 2:
            k = rng.randint(1, hi)
            parts.append(f"{name} gets {k} more.")
            total += k
        elif op == "give":
            k = rng.randint(1, total - 1)
            parts.append(f"{name} gives away {k}.")
            total -= k
        else:
            parts.append(f"Then the number of {item} {name} has doubles.")
            total *= 2
    parts.append(f"How many {item} does {name} have now?")
    return " ".join(parts), total


def make_arith(split: str, size: int, difficulty: int, seed: int = 0) -> list[Problem]:
    """The generated task. Splits are disjoint by construction: each split has its own RNG stream, and
    test questions that also occur in train are skipped."""
    train_rng = random.Random(f"arith-train-{difficulty}-{seed}")
    if split == "train":
        rng, n = train_rng, size
    elif split == "test":
        rng, n = random.Random(f"arith-test-{difficulty}-{seed}"), max(50, size // 10)
    else:
        raise DatasetError(f"arith: unknown split '{split}' (use 'train' or 'test')")
    seen_train = {_arith_problem(train_rng, difficulty)[0] for _ in range(size)} if split == "test" else set()
    problems: list[Problem] = []
    while len(problems) < n:
        q, a = _arith_problem(rng, difficulty)
        if q in seen_train:
            continue
        problems.append(Problem(id=f"arith{difficulty}-{split}-{len(problems)}", question=q, answer=str(a)))
    return problems


def load_problems(cfg: DataConfig, split: str | None = None) -> list[Problem]:
    split = split or cfg.split
    if cfg.task == "gsm8k":
        return load_gsm8k(split, cfg.path, cfg.hub_id)
    return make_arith(split, cfg.arith_size, cfg.arith_difficulty, cfg.seed)


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The order in which an epoch visits n problems: a permutation fixed by (seed, epoch)."""
    order = list(range(n))
    random.Random(f"{seed}-{epoch}").shuffle(order)
    return order


def chat_messages(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{question}\n\n{INSTRUCTION}"}]


def chat_prompt_ids(tokenizer, question: str) -> list[int]:
    """Token ids of the chat-templated prompt, ending with the assistant turn's header."""
    ids = tokenizer.apply_chat_template(chat_messages(question), add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)

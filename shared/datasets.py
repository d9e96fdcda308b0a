"""Prompt sources: GSM8K (a local JSONL folder or the hub), `arith` (a generated task of integer word
problems whose difficulty can be tuned to the model's edge of competence), and `custom`: the user's own
dataset, a local JSONL/JSON/CSV/Parquet file or folder or a hub dataset, read through a column mapping.

A dataset is a list of `Problem`s; `epoch_order` gives the deterministic order of an epoch; each problem
carries the conversation the model sees (`data.system_prompt`, `data.prompt_template`), which
`chat_prompt_ids` renders through the model's chat template (duck-typed tokenizer: this module imports
neither torch nor transformers; `datasets` is imported only to read files other than GSM8K's and the hub).
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.config import DataConfig
from shared.reward import extract_answer

INSTRUCTION = (
    "Solve the problem step by step. End your reply with a final line of the form '#### <answer>', "
    "where <answer> is just the number."
)
MATH_TEMPLATE = "{prompt}\n\n" + INSTRUCTION  # gsm8k and arith, unless data.prompt_template says otherwise
# File types a custom dataset may come in, and the `datasets` builder that reads each.
FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


@dataclass(frozen=True)
class Problem:
    id: str  # stable across runs: "<task>-<split>-<index>" (custom: "<split>-<index>" or the id column)
    question: str  # the prompt as the dataset has it
    answer: str  # the reference answer: gsm8k/arith normalise it ("1000"), custom passes the column as text
    # The conversation the model sees; None: the question with the math instruction (MATH_TEMPLATE).
    messages: tuple[dict[str, str], ...] | None = field(default=None, hash=False)
    # The row's other columns, handed to reward functions (JSON values).
    metadata: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def conversation(self) -> list[dict[str, str]]:
        if self.messages is None:
            return chat_messages(self.question)
        return [dict(m) for m in self.messages]

    @property
    def prompt_text(self) -> str:
        """The last user message as the model sees it: what reward functions get as `prompt`."""
        users = [m["content"] for m in self.conversation() if m["role"] == "user"]
        return users[-1] if users else ""


class DatasetError(RuntimeError):
    pass


def _gsm8k_rows(split: str, path: str | None, hub_id: str, hub_config: str) -> list[dict]:
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
        ds = hf_datasets.load_dataset(hub_id, hub_config, split=split)
    except Exception as e:  # network, auth, unknown split: say which dataset and how to avoid the hub
        raise DatasetError(
            f"could not load {hub_id} (config '{hub_config}', split '{split}') from the hub: {e}. "
            "Offline? Set data.path to a folder with {train,test}.jsonl."
        ) from e
    return [{"question": r["question"], "answer": r["answer"]} for r in ds]


def load_gsm8k(
    split: str = "train", path: str | None = None, hub_id: str = "openai/gsm8k", hub_config: str = "main"
) -> list[Problem]:
    problems = []
    for i, row in enumerate(_gsm8k_rows(split, path, hub_id, hub_config)):
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


def fill_template(template: str, fields: Mapping[str, Any]) -> str:
    """`data.prompt_template` filled from {prompt} and a row's columns (its syntax is checked with the
    config); DatasetError naming the field when the template asks for a column the row lacks."""
    try:
        return template.format_map(fields)
    except KeyError as e:
        have = ", ".join(sorted(fields))
        raise DatasetError(f"data.prompt_template: no column {e} (columns: {have})") from None


def render(cfg: DataConfig, prompt: str, row: Mapping[str, Any] | None = None) -> list[dict[str, str]]:
    """The conversation for one prompt: the system prompt, then the user message made from
    `data.prompt_template` with {prompt} and the row's columns."""
    template = cfg.prompt_template
    if template is None:
        template = "{prompt}" if cfg.task == "custom" else MATH_TEMPLATE
    text = fill_template(template, {**(row or {}), "prompt": prompt})
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    return [*system, {"role": "user", "content": text}]


def load_problems(cfg: DataConfig, split: str | None = None) -> list[Problem]:
    split = split or cfg.split
    if cfg.task == "custom":
        return load_custom(cfg, split)
    if cfg.task == "reasoning_gym":
        return load_reasoning_gym(cfg, split)
    if cfg.task == "gsm8k":
        problems = load_gsm8k(split, cfg.path, cfg.hub_id, cfg.hub_config or "main")
    else:
        problems = make_arith(split, cfg.arith.size, cfg.arith.difficulty, cfg.seed)
    if cfg.prompt_template is None and cfg.system_prompt is None:
        return problems  # the default conversation (Problem.conversation)
    return [dataclasses.replace(p, messages=tuple(render(cfg, p.question))) for p in problems]


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The order in which an epoch visits n problems: a permutation fixed by (seed, epoch)."""
    order = list(range(n))
    random.Random(f"{seed}-{epoch}").shuffle(order)
    return order


def chat_messages(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": MATH_TEMPLATE.format(prompt=question)}]


def chat_prompt_ids(
    tokenizer, messages: str | list[dict[str, str]], continue_final: bool = True
) -> list[int]:
    """Token ids of the chat-templated conversation (a bare question gets the math instruction), ending
    with the assistant turn's header; or, when the conversation ends with an assistant message and
    `continue_final`, inside that message (a prefill the model continues: data.reasoning_gym.answer_prefill).
    """
    messages = chat_messages(messages) if isinstance(messages, str) else messages
    ids = tokenizer.apply_chat_template(messages, tokenize=True, **_ending(messages, continue_final))
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def _ending(messages: list[dict[str, str]], continue_final: bool) -> dict[str, bool]:
    """How the chat template ends the prompt: inside a final assistant message (a prefill), or with the
    assistant turn's header."""
    if continue_final and messages and messages[-1]["role"] == "assistant":
        return {"continue_final_message": True}
    return {"add_generation_prompt": True}


# A token of a byte-level BPE vocabulary covers at least one byte of the text; room for a tokenizer that
# adds a few pieces of its own (SentencePiece's leading "▁", a BOS)
TOKENS_OVER_BYTES = 8


def _surely_fits(tokenizer, messages: list[dict[str, str]], room: int) -> bool:
    """Whether the templated prompt has fewer tokens than `room` for sure, from its text's length in bytes
    (False: it may not, tokenize it)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, **_ending(messages, True))
    return isinstance(text, str) and len(text.encode()) + TOKENS_OVER_BYTES < room


def drop_long_prompts(
    problems: list[Problem], tokenizer, max_model_len: int, exact: bool = False
) -> tuple[list[Problem], list[str]]:
    """The problems whose prompt leaves room for at least one completion token within max_model_len,
    and the ids of the others (the producer would skip them at every pass). A prompt whose templated text
    has fewer bytes than that room, less TOKENS_OVER_BYTES, fits without being tokenized (rendering is ~4x
    cheaper: 3 s of every server start went to tokenizing 5,000 short prompts); `exact`: tokenize all,
    the reference the fast path is tested against."""
    kept, dropped = [], []
    for p in problems:
        messages = p.conversation()
        fits = not exact and _surely_fits(tokenizer, messages, max_model_len - 1)
        fits = fits or len(chat_prompt_ids(tokenizer, messages)) < max_model_len - 1
        (kept if fits else dropped).append(p if fits else p.id)
    return kept, dropped


# -- custom datasets ---------------------------------------------------------------------------------
def _dataset_file(cfg: DataConfig, split: str) -> Path:
    path = Path(cfg.path)
    if path.is_dir():
        for ext in FORMATS:
            if (path / f"{split}{ext}").is_file():
                return path / f"{split}{ext}"
        found = ", ".join(sorted(f.name for f in path.iterdir())[:10]) or "nothing"
        raise DatasetError(
            f"data.path: no {split}.jsonl (or .json, .csv, .parquet) for split '{split}' in {path} "
            f"(found: {found})"
        )
    if not path.is_file():
        raise DatasetError(f"data.path: {path} does not exist")
    if path.suffix not in FORMATS:
        raise DatasetError(f"data.path: {path}: not one of {', '.join(FORMATS)}")
    if split != cfg.split:
        raise DatasetError(
            f"data.path is one file, read as the '{cfg.split}' split (data.split); split '{split}' needs a "
            f"folder holding {cfg.split}{path.suffix} and {split}{path.suffix}"
        )
    return path


def _read_table(cfg: DataConfig, split: str) -> tuple[list[dict[str, Any]], list[str]]:
    """(rows, column names) of one split of a custom dataset."""
    try:
        import datasets as hf_datasets
    except ImportError:
        raise DatasetError("a custom dataset needs `pip install datasets`") from None
    if cfg.path is not None:
        file = _dataset_file(cfg, split)
        hf_datasets.disable_progress_bars()
        try:
            ds = hf_datasets.load_dataset(FORMATS[file.suffix], data_files=str(file), split="train")
        except Exception as e:  # malformed JSON/CSV/Parquet: name the file and keep datasets' reason
            raise DatasetError(f"data.path: could not read {file}: {type(e).__name__}: {e}") from None
    else:
        try:
            ds = hf_datasets.load_dataset(cfg.hub_id, cfg.hub_config, split=split)
        except Exception as e:
            raise DatasetError(
                f"could not load {cfg.hub_id} (config {cfg.hub_config!r}, split '{split}') from the hub: "
                f"{e}. Offline? Set data.path to a local file or folder."
            ) from e
    return ds.to_list(), list(ds.column_names)


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _chat(value: Any, where: str) -> list[dict[str, str]]:
    ok = (
        isinstance(value, list)
        and value
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value
        )
    )
    if not ok:
        raise DatasetError(
            f"{where}: data.custom.messages_column must hold a non-empty list of {{role, content}}"
        )
    return [{"role": m["role"], "content": m["content"]} for m in value]


def load_custom(cfg: DataConfig, split: str) -> list[Problem]:
    """One split of the user's dataset through the column mapping of `data`; errors name the field."""
    rows, columns = _read_table(cfg, split)
    cols = cfg.custom
    source = cfg.path or cfg.hub_id
    wanted = {
        "data.custom.messages_column"
        if cols.messages_column
        else "data.custom.prompt_column": cols.messages_column or cols.prompt_column,
        "data.custom.answer_column": cols.answer_column,
        "data.custom.id_column": cols.id_column,
    }
    for key, col in wanted.items():
        if col is not None and col not in columns:
            raise DatasetError(f"{key}: no column '{col}' in {source} (columns: {', '.join(columns)})")
    if not rows:
        raise DatasetError(f"{source}: split '{split}' has no rows")
    used = {cols.messages_column or cols.prompt_column, cols.answer_column}
    problems, seen = [], set()
    for i, row in enumerate(rows):
        where = f"{source}, split '{split}', row {i}"
        if cols.messages_column:
            messages = _chat(row[cols.messages_column], where)
            if cfg.system_prompt and messages[0]["role"] != "system":
                messages.insert(0, {"role": "system", "content": cfg.system_prompt})
            question = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        else:
            question = row[cols.prompt_column]
            if not isinstance(question, str) or not question.strip():
                raise DatasetError(
                    f"{where}: data.custom.prompt_column '{cols.prompt_column}' is empty or not text"
                )
            messages = render(cfg, question, row)
        answer = row[cols.answer_column] if cols.answer_column else None
        pid = str(row[cols.id_column]) if cols.id_column else f"{split}-{i}"
        if pid in seen or not pid:
            raise DatasetError(f"{where}: data.custom.id_column: id {pid!r} is empty or not unique")
        seen.add(pid)
        metadata = {k: _jsonable(v) for k, v in row.items() if k not in used}
        problems.append(
            Problem(pid, question, "" if answer is None else str(answer), tuple(messages), metadata)
        )
    return problems


# -- reasoning-gym -----------------------------------------------------------------------------------
RG_PROMPT = "default"  # reasoning-gym's own system prompt of that name: think, then <answer>...</answer>
RG_PREFILL = "<answer>"  # data.reasoning_gym.answer_prefill: how every answer starts


def import_reasoning_gym():
    try:
        import reasoning_gym
    except ImportError:
        raise DatasetError(
            "data.task = 'reasoning_gym' needs the reasoning-gym package: pip install 'tandem[reasoning-gym]'"
        ) from None
    return reasoning_gym


def _rg_shots(cfg: DataConfig, solved: list[dict], k: int, entry: dict, key: str) -> tuple[dict, ...]:
    """data.reasoning_gym.shots: k solved train problems other than `entry`, drawn per problem from the
    data seed (the same turns every time the split is loaded), as user/assistant turns."""
    if len(solved) <= k:
        raise DatasetError(
            f"data.reasoning_gym.shots = {k}: the train split has {len(solved)} problems, and each problem's "
            "shots are others (raise data.reasoning_gym.size or lower shots)"
        )
    picked = random.Random(f"rg-shots-{cfg.seed}-{key}").sample(range(len(solved)), k + 1)
    shots = [solved[i] for i in picked if solved[i]["question"] != entry["question"]][:k]
    turns = []
    for shot in shots:
        user = fill_template(cfg.prompt_template or "{prompt}", {"prompt": shot["question"]})
        turns += [
            {"role": "user", "content": user},
            {"role": "assistant", "content": f"<answer>{shot['answer']}</answer>"},
        ]
    return tuple(turns)


def rg_dataset(name: str, config: Mapping[str, Any], seed: int, size: int):
    """reasoning-gym's generator for one task; DatasetError naming the task or field when it refuses."""
    rg = import_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        import difflib

        close = difflib.get_close_matches(name, DATASETS, n=3)
        hint = (
            f" (did you mean {', '.join(close)}?)"
            if close
            else f" ({len(DATASETS)} tasks: see reasoning_gym)"
        )
        raise DatasetError(f"data.reasoning_gym.task: reasoning-gym has no task '{name}'{hint}")
    try:
        return rg.create_dataset(name, **{**config, "seed": seed, "size": size})
    except (TypeError, ValueError, AssertionError) as e:
        raise DatasetError(f"data.reasoning_gym.config for '{name}': {e}") from None


def load_reasoning_gym(cfg: DataConfig, split: str) -> list[Problem]:
    """A reasoning-gym task (or weighted mix) as problems, generated from data.seed: the train split from
    item seeds seed·10^6 + [0, size), the test split from the next eval_size, minus any question the
    train split has. Each problem carries the task's entry, which the `reasoning_gym` reward scores with
    the task's own score_answer; the model is asked for <answer>...</answer> by reasoning-gym's prompt."""
    if split not in ("train", "test"):
        raise DatasetError(f"reasoning_gym: unknown split '{split}' (use 'train' or 'test')")
    opts = cfg.reasoning_gym
    weights = opts.mix or {opts.task: 1.0}
    configs = opts.config if opts.mix else {opts.task: opts.config}
    size = opts.size if split == "train" else opts.eval_size
    start = 0 if split == "train" else opts.size
    # one generator per task, its item seeds disjoint between the splits (items are drawn from seed + index)
    base = cfg.seed * 1_000_000
    tasks = {name: rg_dataset(name, configs.get(name, {}), base + start, size) for name in weights}
    pick = random.Random(f"rg-{split}-{cfg.seed}")
    names, taken = list(weights), dict.fromkeys(weights, 0)
    train = load_reasoning_gym(cfg, "train") if split == "test" else []
    seen_train = {p.question for p in train}
    rg = import_reasoning_gym()
    system = cfg.system_prompt if cfg.system_prompt is not None else rg.utils.SYSTEM_PROMPTS[RG_PROMPT]
    drawn = []  # (index, task name, entry), in the split's order
    for index in range(size):
        name = pick.choices(names, weights=[weights[n] for n in names])[0]
        entry = _jsonable(tasks[name][taken[name]])
        taken[name] += 1
        if entry["question"] not in seen_train:
            drawn.append((index, name, entry))
    # few-shot turns come from the train split, never from the problem itself or the held-out split
    solved = [entry for _, _, entry in drawn] if split == "train" else [p.metadata["rg_entry"] for p in train]
    problems = []
    for index, name, entry in drawn:
        user = fill_template(cfg.prompt_template or "{prompt}", {"prompt": entry["question"]})
        messages = ({"role": "system", "content": system},)
        if opts.shots:
            messages += _rg_shots(cfg, solved, opts.shots, entry, f"{split}-{index}")
        messages += ({"role": "user", "content": user},)
        metadata = {"rg_task": name, "rg_config": dict(configs.get(name, {})), "rg_entry": entry}
        if opts.answer_prefill:  # the answer's opening tag is the prompt's; the reward puts it back
            messages += ({"role": "assistant", "content": RG_PREFILL},)
            metadata["rg_prefill"] = RG_PREFILL
        problems.append(
            Problem(
                id=f"rg-{split}-{index}",
                question=entry["question"],
                answer=str(entry["answer"]),
                messages=messages,
                metadata=metadata,
            )
        )
    return problems

import json

import pytest

from shared.config import DataConfig
from shared.datasets import (
    INSTRUCTION,
    DatasetError,
    Problem,
    chat_prompt_ids,
    drop_long_prompts,
    epoch_order,
    load_gsm8k,
    load_problems,
    make_arith,
)
from shared.reward import verify


def test_gsm8k_local_folder(gsm8k_dir):
    train, test = load_gsm8k("train", str(gsm8k_dir)), load_gsm8k("test", str(gsm8k_dir))
    assert (len(train), len(test)) == (7473, 1319)
    # First test problem: Janet's ducks, 16 - 3 - 4 = 9 eggs sold at $2 -> 18.
    assert test[0].id == "gsm8k-test-0" and test[0].answer == "18" and "Janet" in test[0].question
    assert all(p.answer for p in train)


def test_gsm8k_bad_local_data_is_a_clear_error(tmp_path):
    with pytest.raises(DatasetError, match="train.jsonl does not exist"):
        load_gsm8k("train", str(tmp_path))
    (tmp_path / "train.jsonl").write_text('{"question": "q"}\n')
    with pytest.raises(DatasetError, match="train.jsonl:1: need fields 'question' and 'answer'"):
        load_gsm8k("train", str(tmp_path))
    (tmp_path / "train.jsonl").write_text("{oops\n")
    with pytest.raises(DatasetError, match="train.jsonl:1: invalid JSON"):
        load_gsm8k("train", str(tmp_path))


def test_gsm8k_hub_path_uses_datasets(monkeypatch):
    # No network here: check the hub branch asks `datasets` for openai/gsm8k 'main' and maps the rows.
    import datasets

    calls = []

    def fake_load(name, config, split):
        calls.append((name, config, split))
        return [{"question": "q?", "answer": "so #### 1,000"}]

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    problems = load_gsm8k("test")
    assert calls == [("openai/gsm8k", "main", "test")]
    assert problems[0].answer == "1000"


def test_gsm8k_hub_failure_says_how_to_go_offline(monkeypatch):
    import datasets

    def boom(*a, **k):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", boom)
    with pytest.raises(DatasetError, match="Set data.path to a folder"):
        load_gsm8k("train")


def test_epoch_order_is_deterministic_and_a_permutation():
    a, b = epoch_order(100, seed=1, epoch=0), epoch_order(100, seed=1, epoch=0)
    assert a == b and sorted(a) == list(range(100))
    assert epoch_order(100, seed=1, epoch=1) != a
    assert epoch_order(100, seed=2, epoch=0) != a


def test_arith_task_answers_verify_and_splits_are_disjoint():
    train = make_arith("train", 500, difficulty=3)
    test = make_arith("test", 500, difficulty=3)
    assert len(train) == 500 and len(test) == 50
    assert not {p.question for p in train} & {p.question for p in test}
    assert make_arith("train", 500, difficulty=3) == train  # deterministic
    for p in train:
        assert int(p.answer) >= 0
        assert verify(f"#### {p.answer}", p.answer) == 1.0


def test_arith_hand_checked_problem():
    # Recompute an answer from the question text, independent of the generator's own bookkeeping.
    import re

    for p in make_arith("train", 200, difficulty=4):
        total = None
        for sentence in p.question.split(". "):
            if m := re.search(r"has (\d+) ", sentence):
                total = int(m.group(1)) if total is None else total
            elif m := re.search(r"gets (\d+) more", sentence):
                total += int(m.group(1))
            elif m := re.search(r"gives away (\d+)", sentence):
                total -= int(m.group(1))
            elif "doubles" in sentence:
                total *= 2
        assert str(total) == p.answer, p.question


def test_load_problems_dispatches_on_task(gsm8k_dir):
    assert load_problems(DataConfig(path=str(gsm8k_dir)), "test")[0].answer == "18"
    assert load_problems(DataConfig(task="arith", arith={"size": 20}), "train")[0].id.startswith("arith")


def test_chat_prompt_uses_the_models_template(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = chat_prompt_ids(tok, "What is 2+3?")
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert "What is 2+3?" in text and INSTRUCTION in text
    assert type(ids) is list and all(type(i) is int for i in ids)  # plain ints (no tensor), for the wire
    assert json.loads(json.dumps(ids)) == ids


# -- custom datasets ---------------------------------------------------------------------------------
ROWS = [
    {"uid": "a1", "problem": "What is 2 + 2?", "final": 4, "level": 1},
    {"uid": "b2", "problem": "What is 3 x 3?", "final": 9, "level": 2},
]


def custom(**kw) -> DataConfig:
    columns = {k: kw.pop(k) for k in list(kw) if k.endswith("_column")}
    base = {"prompt_column": "problem", "answer_column": "final"}
    return DataConfig(task="custom", custom={**base, **columns}, **kw)


def write(folder, split: str, fmt: str, rows=ROWS):
    import pandas as pd

    path = folder / f"{split}.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "csv":
        pd.DataFrame(rows).to_csv(path, index=False)
    else:
        pd.DataFrame(rows).to_parquet(path)
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet"])
def test_custom_dataset_from_a_file_or_folder_in_every_format(tmp_path, fmt):
    file = write(tmp_path, "train", fmt)
    write(tmp_path, "test", fmt, ROWS[:1])
    from_file = load_problems(custom(path=str(file)))
    from_folder = load_problems(custom(path=str(tmp_path)))
    assert from_file == from_folder
    assert [(p.id, p.question, p.answer) for p in from_file] == [
        ("train-0", "What is 2 + 2?", "4"),
        ("train-1", "What is 3 x 3?", "9"),
    ]
    assert from_file[1].metadata == {"uid": "b2", "level": 2}  # the other columns, for reward functions
    assert from_file[0].conversation() == [{"role": "user", "content": "What is 2 + 2?"}]  # no instruction
    assert len(load_problems(custom(path=str(tmp_path)), "test")) == 1
    with pytest.raises(DatasetError, match="data.path is one file, read as the 'train' split"):
        load_problems(custom(path=str(file)), "test")


def test_custom_template_system_prompt_ids_and_messages(tmp_path):
    write(tmp_path, "train", "jsonl")
    cfg = custom(
        path=str(tmp_path),
        id_column="uid",
        system_prompt="Be brief.",
        prompt_template="[level {level}] {prompt}\nEnd with #### and the number.",
    )
    p = load_problems(cfg)[1]
    assert p.id == "b2"
    assert p.conversation() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "[level 2] What is 3 x 3?\nEnd with #### and the number."},
    ]
    assert p.prompt_text == "[level 2] What is 3 x 3?\nEnd with #### and the number."
    chat = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yes?"},
        {"role": "user", "content": "2+2?"},
    ]
    write(tmp_path, "train", "jsonl", [{"chat": chat, "final": 4}])
    p = load_problems(custom(path=str(tmp_path), messages_column="chat", system_prompt="S"))[0]
    assert p.conversation() == [{"role": "system", "content": "S"}, *chat] and p.prompt_text == "2+2?"
    # gsm8k and arith take the template and system prompt too
    arith = load_problems(
        DataConfig(task="arith", arith={"size": 10}, system_prompt="S", prompt_template="Q: {prompt}")
    )
    assert arith[0].conversation() == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": f"Q: {arith[0].question}"},
    ]


@pytest.mark.parametrize(
    "kw, rows, message",
    [
        (
            dict(prompt_column="question"),
            ROWS,
            r"data.custom.prompt_column: no column 'question' in .* \(columns: uid, problem, final, level\)",
        ),
        (dict(answer_column="solution"), ROWS, r"data.custom.answer_column: no column 'solution'"),
        (dict(id_column="key"), ROWS, r"data.custom.id_column: no column 'key'"),
        (
            dict(id_column="level"),
            [*ROWS, {**ROWS[0], "uid": "c"}],
            r"row 2: data.custom.id_column: id '1' is empty or not unique",
        ),
        (dict(prompt_template="{prompt} {missing}"), ROWS, r"data.prompt_template: no column 'missing'"),
        (
            dict(messages_column="problem"),
            ROWS,
            r"row 0: data.custom.messages_column must hold a non-empty list",
        ),
        (
            {},
            [{**ROWS[0], "problem": "  "}],
            r"row 0: data.custom.prompt_column 'problem' is empty or not text",
        ),
    ],
)
def test_custom_dataset_errors_name_the_field(tmp_path, kw, rows, message):
    write(tmp_path, "train", "jsonl", rows)
    with pytest.raises(DatasetError, match=message):
        load_problems(custom(path=str(tmp_path), **kw))


def test_custom_dataset_missing_empty_or_unreadable(tmp_path):
    with pytest.raises(DatasetError, match="data.path: .*nope does not exist"):
        load_problems(custom(path=str(tmp_path / "nope")))
    with pytest.raises(DatasetError, match=r"data.path: no train.jsonl \(or .json, .csv, .parquet\)"):
        load_problems(custom(path=str(tmp_path)))
    (tmp_path / "train.jsonl").write_text("")
    with pytest.raises(DatasetError, match="split 'train' has no rows|could not read"):
        load_problems(custom(path=str(tmp_path)))
    (tmp_path / "train.jsonl").write_text("{oops\n")
    with pytest.raises(DatasetError, match="data.path: could not read .*train.jsonl"):
        load_problems(custom(path=str(tmp_path)))


def test_custom_dataset_from_the_hub_passes_config_and_split(monkeypatch):
    import datasets

    calls = []

    class Fake:
        column_names = ["problem", "final", "level", "uid"]

        def to_list(self):
            return ROWS

    def fake_load(name, config, split):
        calls.append((name, config, split))
        return Fake()

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    problems = load_problems(custom(hub_id="me/tasks", hub_config="easy", split="validation"))
    assert calls == [("me/tasks", "easy", "validation")] and problems[0].id == "validation-0"


def test_prompts_too_long_are_dropped_and_named():
    from tests.fakes import FakeTokenizer

    problems = [Problem("short", "x" * 10, "1"), Problem("long", "x" * 500, "1")]
    kept, dropped = drop_long_prompts(problems, FakeTokenizer(), max_model_len=256)
    assert [p.id for p in kept] == ["short"] and dropped == ["long"]


@pytest.mark.parametrize("max_model_len", [128, 192, 1024])
def test_the_fast_length_check_drops_exactly_what_tokenizing_every_prompt_drops(
    model_dir, gsm8k_dir, max_model_len
):
    """The byte bound skips tokenizing prompts that surely fit; the plain path tokenizes them all. On 600
    GSM8K prompts (~100-250 tokens templated) at limits that keep all, some, and few of them."""
    from transformers import AutoTokenizer

    from shared.config import load_config

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    problems = load_problems(load_config(None, [f"data.path='{gsm8k_dir}'"]).data)[:600]
    fast = drop_long_prompts(problems, tokenizer, max_model_len)
    plain = drop_long_prompts(problems, tokenizer, max_model_len, exact=True)
    assert [p.id for p in fast[0]] == [p.id for p in plain[0]] and fast[1] == plain[1]
    # many dropped, a few, none: both paths decide at each limit
    assert {128: 150 < len(plain[1]) < 450, 192: 0 < len(plain[1]) < 60}.get(max_model_len, plain[1] == [])

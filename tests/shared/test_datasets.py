import json

import pytest

from shared.config import DataConfig
from shared.datasets import (
    INSTRUCTION,
    DatasetError,
    chat_prompt_ids,
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
    assert load_problems(DataConfig(task="arith", arith_size=20), "train")[0].id.startswith("arith")


def test_chat_prompt_uses_the_models_template(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = chat_prompt_ids(tok, "What is 2+3?")
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert "What is 2+3?" in text and INSTRUCTION in text
    assert type(ids) is list and all(type(i) is int for i in ids)  # plain ints (no tensor), for the wire
    assert json.loads(json.dumps(ids)) == ids

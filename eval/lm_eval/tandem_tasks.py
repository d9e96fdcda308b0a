"""lm-evaluation-harness tasks over tandem's own held-out problems, rendered exactly as tandem renders them.

    python -m lm_eval --include_path eval/lm_eval --tasks tandem_eval \\
        --model local-chat-completions --apply_chat_template \\
        --model_args base_url=http://127.0.0.1:8000/v1/chat/completions,model=policy-v12 \\
        --metadata '{"config": "deploy/configs/cpu.toml"}' --limit 50

`metadata.config` is a tandem TOML and `metadata.overrides` a list of its `section.key=value` overrides
(as on tandem's command lines, without the dashes); the problems are the config's `data.eval_split`
(GSM8K from a local JSONL folder with `data.path`, or the hub, a custom task's file, or arith), in the
order `learner.evaluate` scores them, so `--limit N` takes the same N. Offline unless the config says hub.

- `tandem_eval` (generate_until, for `local-chat-completions --apply_chat_template`): the user message is
  the one tandem trains on (data.prompt_template, by default the question and the '#### <answer>'
  instruction); the server applies the model's chat template. A completion is correct when the config's
  reward functions give it at least 1, as in `learner.evaluate`. Greedy; `max_gen_toks` defaults to the
  config's sampling.max_new_tokens.
- `tandem_eval_mc` (multiple_choice, log-likelihoods, for `local-completions`): the question, then four
  candidate final answers (the right one and three near misses); scored from the prompt's logprobs
  (`echo`), as harnesses score multiple-choice benchmarks.

A data.system_prompt is not in the user message: pass it with lm_eval's --system_instruction.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: tandem's `shared` package

from shared.config import load_config  # noqa: E402
from shared.datasets import load_problems  # noqa: E402
from shared.reward import extract_answer, normalize_number  # noqa: E402
from shared.rewards import RewardCall, call_function, checked, resolve  # noqa: E402

_TASK = {}  # the config of the last dataset() call: process_results scores with its reward functions


def dataset(config: str = "deploy/configs/cpu.toml", overrides: list[str] = (), **_):
    import datasets

    cfg = load_config(config, list(overrides))
    _TASK["cfg"], _TASK["functions"] = cfg, resolve(cfg.reward)
    rows = []
    for p in load_problems(cfg.data, cfg.data.eval_split):
        user = [m["content"] for m in p.conversation() if m["role"] == "user"][-1]
        rows.append({"id": p.id, "question": p.question, "user": user, "answer": p.answer})
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def doc_to_text(doc: dict) -> str:
    return doc["user"]


def max_gen_toks() -> int:
    return _TASK["cfg"].sampling.max_new_tokens


def process_results(doc: dict, results: list[str]) -> dict:
    """1 when the configured reward functions' weighted sum reaches 1 (learner.evaluate's `correct`)."""
    call = RewardCall(results[0], doc["answer"], doc["user"], {})
    total = sum(f.weight * checked(call_function(f.fn, call))[0] for f in _TASK["functions"])
    return {"exact_match": float(total >= 1.0)}


# -- multiple choice ---------------------------------------------------------------------------------
def mc_text(doc: dict) -> str:
    return f"Question: {doc['question']}\nAnswer:"


def mc_choices(doc: dict) -> list[str]:
    """The right final answer and three near misses, in an order fixed by the problem's id. (The harness
    puts its target_delimiter, a space, between the text and each choice.)"""
    right = normalize_number(extract_answer(doc["answer"]) or "0") or "0"
    n = float(right)
    fmt = (lambda x: str(int(x))) if n == int(n) else (lambda x: f"{x:g}")
    misses = [m for m in (n + 1, n - 1, n * 2 if n else 2, n + 10, n - 10) if fmt(m) != fmt(n)]
    options = [fmt(n)] + list(dict.fromkeys(fmt(m) for m in misses))[:3]
    shift = sum(map(ord, doc["id"])) % 4
    return options[shift:] + options[:shift]


def mc_target(doc: dict) -> int:
    return (4 - sum(map(ord, doc["id"])) % 4) % 4

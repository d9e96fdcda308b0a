"""Rewards from a trained reward model: a transformers sequence classifier with one output
(`AutoModelForSequenceClassification`, num_labels = 1) that scores each completion, named in
`reward.functions` as `"rm:path/to/folder"`:

    [reward]
    functions = ["gsm8k", "rm:/models/my-reward-model"]
    weights = [1.0, 0.5]
    model_device = "cpu"        # or "cuda", "cuda:1": where the reward model runs

The model reads the conversation as its tokenizer's chat template renders it (the prompt's last user
message, then the completion as the assistant's reply), or the prompt and the completion joined by a
blank line where the tokenizer has no template, cut to `reward.model_max_tokens`; its single logit is the
reward. It is loaded once, on the first call, in the process that scores (the rollout server, or
learner.evaluate), and scores `reward.model_batch_size` completions per forward pass, one batch at a time.
Its part of the reward is named after the folder (`reward/<folder>/mean` in the learner's metrics).

Checking a spec (`check`, run by --check-config and at the server's start) reads only the folder's
config.json: the weights load when the first group is scored.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

PREFIX = "rm:"


def is_reward_model(spec: str) -> bool:
    return spec.startswith(PREFIX)


def check(spec: str) -> Path:
    """The folder `spec` names, checked to hold a sequence classifier with one output; ValueError with
    the reason otherwise."""
    named = spec[len(PREFIX) :]
    if not named:
        raise ValueError(f"'{spec}': name the reward model's folder after 'rm:'")
    folder = Path(named).expanduser()
    config = folder / "config.json"
    if not config.is_file():
        raise ValueError(f"'{spec}': {folder} holds no config.json (a transformers model folder)")
    try:
        fields = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"'{spec}': {config} cannot be read ({e})") from None
    architectures = fields.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ValueError(
            f"'{spec}': {folder} is a {', '.join(architectures) or 'model without architectures'}, not a "
            "sequence classifier (AutoModelForSequenceClassification)"
        )
    labels = fields.get("num_labels", len(fields.get("id2label") or {}) or 2)
    if labels != 1:
        raise ValueError(
            f"'{spec}': {folder} has {labels} outputs; a reward model has one (num_labels = 1), whose "
            "logit is the reward"
        )
    return folder


class RewardModel:
    """One reward model, loaded on first use; `score` is thread-safe (one forward pass at a time)."""

    def __init__(self, folder: Path, device: str = "cpu", batch_size: int = 16, max_tokens: int = 2048):
        self.folder, self.device = folder, device
        self.batch_size, self.max_tokens = batch_size, max_tokens
        self._lock = threading.Lock()
        self._model: Any = None
        self._tokenizer: Any = None

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.folder)
        if tokenizer.pad_token is None:  # (Llama-style tokenizers): padding is masked out anyway
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "right"
        dtype = torch.float32 if self.device == "cpu" else torch.bfloat16
        model = AutoModelForSequenceClassification.from_pretrained(self.folder, dtype=dtype)
        # the classifier reads the last token before the padding, found through the pad token's id
        model.config.pad_token_id = tokenizer.pad_token_id
        self._model, self._tokenizer = model.to(self.device).eval(), tokenizer

    def text(self, prompt: str, completion: str) -> str:
        """What the model reads for one completion."""
        if self._tokenizer is None:
            with self._lock:
                if self._tokenizer is None:
                    self._load()
        if self._tokenizer.chat_template:
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            return self._tokenizer.apply_chat_template(messages, tokenize=False)
        return f"{prompt}\n\n{completion}"

    def score(self, pairs: list[tuple[str, str]]) -> list[float]:
        """The reward of each (prompt, completion), in order."""
        import torch

        texts = [self.text(p, c) for p, c in pairs]
        out: list[float] = []
        with self._lock, torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = self._tokenizer(
                    texts[start : start + self.batch_size],
                    return_tensors="pt",
                    padding=True,
                    truncation=True,
                    max_length=self.max_tokens,
                    add_special_tokens=not self._tokenizer.chat_template,  # the template has its own
                ).to(self.device)
                logits = self._model(**batch).logits
                out += logits[:, 0].float().tolist()
        return out

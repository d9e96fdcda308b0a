"""An LLM judge as a reward function (`"judge"` in reward.functions, configured under [reward.judge]):
each completion is put to a model behind any OpenAI-compatible chat endpoint (an external vLLM, a hosted
API, or this very rollout server's `base` model: url = "self") with a rubric, and the judge's answer
read as a score:

    [reward]
    functions = ["gsm8k", "judge"]
    weights = [1.0, 0.5]
    [reward.judge]
    url = "http://judge-host:8000/v1"      # or "self": this server's own OpenAI API
    model = "Qwen/Qwen2.5-7B-Instruct"
    rubric = "Question: {prompt}\\nAnswer: {completion}\\nIs the answer one sentence? Say yes or no."
    score = "yes_no"                       # or "number": the first number, from range[0] to range[1]
    api_key_env = "JUDGE_API_KEY"          # the key is read from this variable, never from the config

Judges are slow and fail, so none can stall production for longer than reward.judge.timeout_s per
completion: at most `max_concurrency` requests are in flight, a failed request (a connection error, an
HTTP error, an answer with no score in it) is retried after `backoff_s`, doubling, all within the
timeout, and what is still unscored then gets `failure_score` and is counted under the function's name
(`tandem_reward_failures_total{function="judge"}`: kind "timeout", "raised" for HTTP errors, "bad_type"
for answers without a score). Scores are cached by (rubric, prompt, completion, answer), so the
completions a group repeats are judged once.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import httpx

NAME = "judge"
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_YES_NO = re.compile(r"\b(yes|no)\b", re.I)


class JudgeFailure(Exception):
    """A judgement that failed, with the failure kind of shared/rewards.py's FAILURE_KINDS."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind


def read_score(text: str, how: str, low: float, high: float) -> float:
    """The score a judge's answer gives, in [0, 1]; JudgeFailure("bad_type") when it holds none."""
    if how == "yes_no":
        found = _YES_NO.search(text)
        if not found:
            raise JudgeFailure("bad_type", f"no yes or no in the judge's answer {text[:200]!r}")
        return 1.0 if found[1].lower() == "yes" else 0.0
    found = _NUMBER.search(text)
    if not found:
        raise JudgeFailure("bad_type", f"no number in the judge's answer {text[:200]!r}")
    value = float(found[0])
    return min(max((value - low) / (high - low), 0.0), 1.0)


class Judge:
    """Scores (prompt, completion, answer) triples through a chat endpoint; `score` never raises and
    never takes longer than cfg.timeout_s per triple."""

    def __init__(
        self, cfg: Any, url: str, transport: httpx.AsyncBaseTransport | None = None, token: str = ""
    ):
        """`cfg`: reward.judge; `token`: the bearer token to send where reward.judge.api_key_env names
        no variable (the rollout server's own, when it judges itself)."""
        self.cfg, self.url = cfg, url.rstrip("/")
        key = os.environ.get(cfg.api_key_env, "") if cfg.api_key_env else token
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._slots: asyncio.Semaphore | None = None
        self._cache: OrderedDict[str, float] = OrderedDict()

    def _key(self, prompt: str, completion: str, answer: str) -> str:
        parts = (self.cfg.rubric, prompt, completion, answer)
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()

    async def _ask(self, prompt: str, completion: str, answer: str) -> float:
        """One judgement, retried after failures until it succeeds (the caller bounds the time)."""
        content = self.cfg.rubric.format(prompt=prompt, completion=completion, answer=answer)
        body = {
            "model": self.cfg.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": self.cfg.max_tokens,
            "temperature": 0.0,
        }
        wait, last = self.cfg.backoff_s, None
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                await asyncio.sleep(wait)
                wait *= 2
            try:
                async with self._slots:
                    r = await self._client.post(f"{self.url}/chat/completions", json=body)
                if r.status_code != 200:
                    raise JudgeFailure("raised", f"HTTP {r.status_code} from the judge: {r.text[:300]}")
                text = r.json()["choices"][0]["message"]["content"] or ""
                low, high = self.cfg.range
                return read_score(text, self.cfg.score, low, high)
            except JudgeFailure as e:
                last = e
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
                last = JudgeFailure("raised", f"the judge's endpoint failed: {e!r}")
        raise last

    async def score(
        self, triples: list[tuple[str, str, str]], on_failure: Callable[[str, str], None]
    ) -> list[float]:
        """Each triple's score, or cfg.failure_score where it failed (on_failure(kind, detail) told, once
        per distinct triple)."""
        if self._client is None:  # made on first use, in the loop that uses it
            self._client = httpx.AsyncClient(
                headers=self._headers, timeout=self.cfg.timeout_s, transport=self._transport
            )
            self._slots = asyncio.Semaphore(self.cfg.max_concurrency)

        async def one(prompt: str, completion: str, answer: str) -> float:
            key = self._key(prompt, completion, answer)
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            try:
                value = await asyncio.wait_for(self._ask(prompt, completion, answer), self.cfg.timeout_s)
            except TimeoutError:
                on_failure("timeout", f"no score within reward.judge.timeout_s = {self.cfg.timeout_s} s")
                return self.cfg.failure_score
            except JudgeFailure as e:
                on_failure(e.kind, str(e))
                return self.cfg.failure_score
            self._cache[key] = value
            while len(self._cache) > self.cfg.cache_size:
                self._cache.popitem(last=False)
            return value

        unique = list(dict.fromkeys(triples))  # a completion the batch repeats is asked about once
        values = dict(zip(unique, await asyncio.gather(*(one(*t) for t in unique)), strict=True))
        return [values[t] for t in triples]

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

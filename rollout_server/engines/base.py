"""The seam between the server and an inference engine. Narrow on purpose: generate G completions with
token ids and per-token sampler logprobs, score a given completion, load/unload an adapter version,
sleep, wake. `vllm` and `hf` implement it; a remote OpenAI-compatible backend would too."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from shared.protocol import adapter_name


@dataclass(frozen=True)
class Adapter:
    """A published LoRA adapter, served under its own engine name (shared.protocol.adapter_name)."""

    version: int  # >= 1; version 0 is the base model and has no Adapter
    path: str

    @property
    def name(self) -> str:
        return adapter_name(self.version)


@dataclass(frozen=True)
class Sample:
    token_ids: list[int]  # completion tokens, the EOS token included when it stopped there
    logprobs: list[float]  # sampler logprob of each token, after temperature (empty for greedy)
    text: str  # decoded completion, special tokens skipped
    finish_reason: str  # "stop" | "length" | "interrupted" (generate's `interrupt`: not finished)


@dataclass(frozen=True)
class TextRequest:
    """One sequence as an OpenAI-style client asks for it (rollout_server/serving/openai_api.py)."""

    max_tokens: int  # 0: no completion, only the prompt's logprobs (echo)
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()  # the completion ends before the first of these; not included in it
    stop_token_ids: tuple[int, ...] = ()  # the completion ends at the first of these, included (as EOS)
    logprobs: int | None = None  # each generated token's logprob and this many alternatives; None: none
    prompt_logprobs: int | None = None  # the same for every prompt token (the first has none)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)  # the most likely tokens at this position


@dataclass(frozen=True)
class Piece:
    """What one sequence of a TextRequest adds at once: a streaming backend yields many, the others one.
    prompt_logprobs comes with the first piece (None for the first token, which nothing predicts)."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None  # one per token when TextRequest.logprobs is set
    finish_reason: str | None = None  # set on the last piece: "stop" | "length"
    prompt_logprobs: list[TokenLogprob | None] | None = None


class AdapterLoadError(ValueError):
    """The engine refused an adapter; the message says why."""


class GenerationAborted(RuntimeError):
    """The engine aborted a request before it finished (vLLM's sleep() aborts the requests running):
    its output is not a completion and must never reach the learner as one."""


class RolloutBackend(Protocol):
    name: str
    tokenizer: Any
    # True when the engine holds one version's weights at a time (vLLM merge mode): work for another
    # version runs only once the weights are switched, never beside production
    one_version: bool

    async def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        temperature: float,
        max_tokens: int,
        adapter: Adapter | None,
        logprobs: bool = True,
        interrupt: asyncio.Event | None = None,
    ) -> list[list[Sample]]:
        """[len(prompts)][n] samples. temperature > 0 samples with top_p=1, top_k=off; 0 is greedy.
        logprobs=False (evaluation) leaves Sample.logprobs empty and spares the engine keeping them.
        `interrupt` (in-flight weight updates): once it is set, return at once, each sample not yet
        finished as far as it got, with finish_reason "interrupted" (its tokens and logprobs so far, maybe
        none); the caller continues it from prompt + those tokens."""
        ...

    async def score(self, prompt: list[int], completion: list[int], adapter: Adapter | None) -> list[float]:
        """Teacher-forced log π(completion[t] | prompt, completion[:t]) at temperature 1."""
        ...

    def stream(
        self, prompt: list[int], request: TextRequest, adapter: Adapter | None
    ) -> AsyncIterator[Piece]:
        """One sequence for an OpenAI-style request, as it is produced. Closing the iterator early stops
        it in the engine. Raises GenerationAborted if the engine was put to sleep under it."""
        ...

    async def load_adapter(self, adapter: Adapter) -> None: ...

    async def unload_adapter(self, adapter: Adapter) -> None: ...

    async def sleep(self) -> None: ...

    async def wake(self) -> None: ...

    async def close(self) -> None: ...

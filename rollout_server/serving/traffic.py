"""How evaluation traffic (the OpenAI-compatible routes, the token route) runs on the engine beside
production: a version by name, a slot among server.openai_max_sequences, a wait for the wake while the
learner trains, a rerun when a sleep cut a sequence short before its first token, a bound on the whole
request's time, and the choices put together from their pieces."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import re
from collections.abc import AsyncIterator

from fastapi import HTTPException

from rollout_server.engines.base import Adapter, GenerationAborted, Piece, TextRequest, TokenLogprob
from rollout_server.production.adapters import AdapterRejected
from rollout_server.serving.openai_schema import BASE, IMPOSSIBLE, LATEST, OpenAIError
from shared.protocol import adapter_name

RETRIES = 3  # runs of a sequence that sleeps cut short before its first token


class OpenAIState:
    """What the endpoints share: the sequence slots and a cache of token texts. (Server.evaluations is
    another thing: the tasks in flight that SIGTERM cancels.)"""

    def __init__(self, max_sequences: int):
        self.slots = asyncio.Semaphore(max_sequences)
        self._texts: dict[int, str] = {}

    def token_text(self, tokenizer, token: int) -> str:
        if token not in self._texts:
            if len(self._texts) > 200_000:
                self._texts.clear()
            self._texts[token] = tokenizer.decode([token])
        return self._texts[token]


def resolve(s, model: str) -> tuple[Adapter | None, str]:
    """(adapter, canonical name) for a request's `model`; 404 in OpenAI's schema if there is none."""
    if model in (BASE, s.cfg.model.name):
        return None, BASE
    if model == LATEST:
        served = s.policy.served
        return served, served.name if served else BASE
    m = re.fullmatch(r"policy-v(\d{1,9})", model)
    if m and int(m[1]) >= 1:
        try:
            adapter = s.policy.lookup(int(m[1]))
            return adapter, adapter_name(int(m[1]))
        except AdapterRejected:
            pass
    raise OpenAIError(
        404,
        f"the model '{model}' does not exist here (GET /v1/models lists them)",
        "model",
        "model_not_found",
    )


async def until_awake(s) -> None:
    """Return once the server is awake; 503 with Retry-After after server.openai_wait_s asleep."""
    if not s.producer.sleeping:
        return
    try:
        await asyncio.wait_for(s.producer.until_awake(), s.cfg.server.openai_wait_s)
    except TimeoutError:
        err = OpenAIError(
            503,
            f"the server is asleep (the learner is training) and did not wake within server.openai_wait_s="
            f"{s.cfg.server.openai_wait_s:g}; retry later",
        )
        err.headers["Retry-After"] = "5"
        raise err from None


def _slot(s, adapter):
    """An evaluation slot, unless the engine holds one version's weights (vLLM merge mode) and this is
    another version: such requests run while production waits for the weights anyway, so as many as
    wait run together (server.vllm.eval_switch_every_s bounds how often that happens)."""
    version = adapter.version if adapter else 0
    if s.backend.one_version and version != s.policy.version:
        return contextlib.nullcontext()
    return s.openai.slots


async def sequence(s, prompt: list[int], request: TextRequest, adapter, slot=True) -> AsyncIterator[Piece]:
    """One choice, taking an evaluation slot (unless `slot` is false: production's own requests); run
    again after the wake if a sleep cut it short before its first token (a sleep aborts the engine's
    requests), at most RETRIES times."""
    for attempt in range(RETRIES + 1):
        await until_awake(s)
        started = False
        async with _slot(s, adapter) if slot else contextlib.nullcontext():
            try:
                async for piece in s.backend.stream(prompt, request, adapter):
                    started = True
                    yield _finite(piece)
                return
            except GenerationAborted:
                if started or attempt == RETRIES:
                    raise
        await asyncio.sleep(0.05)  # the sleep is in progress: wait for the wake at the top of the loop


def _finite(piece: Piece) -> Piece:
    """A token outside top_p's nucleus has logprob -inf, which JSON cannot carry (it went out as null, and
    a client adding logprobs up fails on it): such a logprob becomes IMPOSSIBLE, as vLLM's own OpenAI
    server writes it."""

    def clamp(lp: float) -> float:
        return max(lp, IMPOSSIBLE) if math.isfinite(lp) else IMPOSSIBLE

    def entry(e: TokenLogprob | None) -> TokenLogprob | None:
        if e is None:
            return None
        return TokenLogprob(e.token_id, clamp(e.logprob), {t: clamp(lp) for t, lp in e.top.items()})

    return dataclasses.replace(
        piece,
        logprobs=None if piece.logprobs is None else [entry(e) for e in piece.logprobs],
        prompt_logprobs=None if piece.prompt_logprobs is None else [entry(e) for e in piece.prompt_logprobs],
    )


async def merged(streams: list[AsyncIterator[Piece]]) -> AsyncIterator[tuple[int, Piece]]:
    """(choice index, piece) from several sequences as they come; closing this closes them all."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[Piece]):
        try:
            async for piece in stream:
                await queue.put((i, piece))
            await queue.put((i, done))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def bounded(s, work, timeout_s: float):
    """Run an evaluation request's work (here or /v1/generate's) as a task SIGTERM can cancel, for at most
    timeout_s: 504 past it, 503 when the server is shutting down."""
    task = asyncio.ensure_future(work)
    s.evaluations.add(task)
    try:
        return await asyncio.wait_for(task, timeout_s)
    except TimeoutError:
        raise HTTPException(
            504,
            f"generation ran past server.generate_timeout_s={timeout_s:g}; ask for fewer prompts, a "
            "smaller n or max_tokens",
        ) from None
    except asyncio.CancelledError:
        if s.shutting_down:
            raise HTTPException(503, "the server is shutting down") from None
        raise
    finally:
        s.evaluations.discard(task)


class Choice:
    """A choice's pieces put together."""

    def __init__(self):
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.finish_reason: str | None = None

    def add(self, piece: Piece) -> None:
        self.token_ids += piece.token_ids
        self.text += piece.text
        self.logprobs += piece.logprobs or []
        if piece.prompt_logprobs is not None:
            self.prompt_logprobs = piece.prompt_logprobs
        self.finish_reason = piece.finish_reason or self.finish_reason


def check_length(s, prompt: list[int], max_tokens: int, where: str) -> None:
    if not prompt:
        raise OpenAIError(400, f"{where} is empty", where)
    vocab = len(s.backend.tokenizer)
    if max(prompt) >= vocab or min(prompt) < 0:
        raise OpenAIError(400, f"{where}: token id outside the vocabulary (0..{vocab - 1})", where)
    limit = s.cfg.model.max_model_len
    if len(prompt) + max(1, max_tokens) > limit:
        raise OpenAIError(
            400,
            f"this model's context is model.max_model_len={limit} tokens; the prompt has {len(prompt)} and "
            f"max_tokens asks {max_tokens} more",
            "max_tokens" if max_tokens > 1 else where,
            "context_length_exceeded",
        )


def check_sequences(s, count: int) -> None:
    cap = s.cfg.server.max_generate_sequences
    if count > cap:
        raise OpenAIError(
            400, f"{count} sequences (prompts x n) exceed server.max_generate_sequences={cap}", "n"
        )


async def collect(s, streams: list[AsyncIterator[Piece]]) -> list[Choice]:
    choices = [Choice() for _ in streams]

    async def run():
        async for i, piece in merged(streams):
            choices[i].add(piece)

    await bounded(s, run(), s.cfg.server.generate_timeout_s)
    return choices

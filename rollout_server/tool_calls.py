"""The tool-call format tandem reads and writes, for every route that meets tool calls: env.kind =
"tools" episodes (production/episodes.py), the OpenAI routes (serving/openai_api.py, openai_schema.py) and
the verifiers renderer (environments/). The model calls a tool by writing
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes/Qwen format, which tandem also
teaches models whose chat template has no tools: the schemas go into the system message)."""

from __future__ import annotations

import json
import re
import weakref

from shared.datasets import chat_prompt_ids

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
TOOLS_PREAMBLE = (
    'You can call tools. To call one, write <tool_call>{"name": <tool name>, "arguments": {<arguments>}}'
    "</tool_call> and stop; its result comes back in the next message. Answer without a tool call when done. "
    "The tools:"
)


def render_ids(tokenizer, messages: list[dict], generation_prompt: bool, **kw) -> list[int]:
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=True, **kw
    )
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)


def call_arguments(arguments: dict | str | None) -> dict:
    """A call's arguments as a dict, from a dict or OpenAI's JSON string (one that is not a JSON object is
    kept as text under "raw")."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            arguments = {"raw": arguments}
        if not isinstance(arguments, dict):
            arguments = {"raw": json.dumps(arguments)}
    return arguments or {}


def tool_call_text(name: str, arguments: dict | str | None) -> str:
    """A call as the model writes it (what parse_tool_calls reads), for a chat template that has no place
    for calls (renders_tool_calls is false)."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": call_arguments(arguments)}) + "</tool_call>"


_PROBE_CALL = "tandem_probe_call"
_renders_calls: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> renders_tool_calls


def renders_tool_calls(tokenizer) -> bool:
    """Whether the chat template writes an assistant message's structured `tool_calls` itself (Qwen's,
    Llama 3's do; ChatML as SmolLM2 ships it does not): then a conversation's past calls go to it as they
    are, and it writes them as its model was trained to read them. Probed once per tokenizer."""
    if tokenizer not in _renders_calls:
        call = {"type": "function", "function": {"name": _PROBE_CALL, "arguments": {"x": 1}}}
        messages = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
        ]
        try:
            _renders_calls[tokenizer] = _PROBE_CALL in tokenizer.decode(
                render_ids(tokenizer, messages, False)
            )
        except Exception:  # a template that refuses the message has no place for it either
            _renders_calls[tokenizer] = False
    return _renders_calls[tokenizer]


class BadToolCall(ValueError):
    """A <tool_call> block that is not a call; its message is for the model, `kind` says what is wrong:
    "json" (not JSON), "object" (JSON, not an object), "name" (no string name) or "arguments" (not an
    object)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def read_tool_call(body: str) -> dict:
    """One <tool_call> block's body as {"name", "arguments"}, or BadToolCall: the one definition of a valid
    call, for env.kind = "tools", the OpenAI API and the verifiers renderer."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        raise BadToolCall("json", f"a tool call must hold JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        kind = "name" if isinstance(call, dict) else "object"
        raise BadToolCall(kind, 'a tool call is {"name": <tool name>, "arguments": {...}}')
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        raise BadToolCall("arguments", f"the arguments of '{call['name']}' must be a JSON object")
    return {"name": call["name"], "arguments": arguments}


def parse_tool_calls(text: str) -> list[dict] | str:
    """The calls in a model turn, [{"name", "arguments"}], or an error message for the model."""
    try:
        calls = [read_tool_call(body) for body in TOOL_CALL.findall(text)]
    except BadToolCall as e:
        return f"error: {e}"
    if not calls and "<tool_call>" in text:
        return "error: a tool call opened with <tool_call> must close with </tool_call>"
    return calls


def tools_prompt_ids(tokenizer, conversation: list[dict], schemas: list[dict]) -> list[int]:
    """The prompt with the tools described: by the chat template where it renders `tools`, else in the
    system message, in the format tandem parses."""
    with_tools = render_ids(tokenizer, conversation, True, tools=schemas)
    if with_tools != render_ids(tokenizer, conversation, True):
        return with_tools
    return chat_prompt_ids(tokenizer, tools_described(conversation, schemas))


def tools_described(conversation: list[dict], schemas: list[dict]) -> list[dict]:
    """The conversation with the tools described in its system message (one added where it has none), in
    the format parse_tool_calls reads: for a chat template that has no place for tools."""
    described = "\n".join([TOOLS_PREAMBLE, *(json.dumps(s.get("function", s)) for s in schemas)])
    if conversation and conversation[0]["role"] == "system":
        system = {**conversation[0], "content": (conversation[0].get("content") or "") + "\n\n" + described}
        return [system, *conversation[1:]]
    return [{"role": "system", "content": described}, *conversation]

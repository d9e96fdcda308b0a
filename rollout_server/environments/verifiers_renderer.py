"""The renderer tandem gives the `verifiers` training client by default (env.renderer = "bridge").

The library's client renders each turn of an episode to token ids. For a model the `renderers` library has
no renderer of its own for (any model served from a local folder, SmolLM2 among them) it falls back to
`DefaultRenderer`, which cannot extend the previous turn's tokens: each turn re-renders the whole
conversation, and a reply whose text tokenizes differently from how the model sampled it starts a new
branch of the trace, which tandem cannot train (the group is dropped; about one in eight on SmolLM2).

`BridgeRenderer` keeps the previous prompt and the sampled reply verbatim and appends what the model's own
chat template adds after an assistant turn: the rest of its close (ChatML's "\\n" after the sampled
<|im_end|>, or the whole close after a reply cut at the token limit), the new messages, the generation
prompt. It reads those pieces off the template, rendering a probe conversation with and without the new
messages, and bridges only when each render extends the one before it and the pieces tokenize as their
concatenation does; otherwise it returns None and the client re-renders, as `DefaultRenderer` would. Full
renders (the first turn, and every turn the bridge declines) are `DefaultRenderer`'s."""

from __future__ import annotations

import json

from renderers.base import (
    ParsedResponse,
    ParsedToolCall,
    RenderedTokens,
    ToolCallParseStatus,
    extract_message_tool_names,
)
from renderers.configs import DefaultRendererConfig
from renderers.default import DefaultRenderer

from rollout_server.tool_calls import (
    TOOL_CALL,
    BadToolCall,
    read_tool_call,
    tool_call_text,
    tools_described,
)

# Probe contents no template writes itself (Unicode private-use characters around a name).
_QUESTION, _REPLY = "\ue000tandem probe question\ue001", "\ue000tandem probe reply\ue001"
_BRIDGEABLE = ("user", "tool")  # the roles the library bridges


class BridgeRendererConfig(DefaultRendererConfig):
    """`DefaultRendererConfig`: extra fields are the template's kwargs; the bridge adds none."""


class BridgeRenderer(DefaultRenderer):
    config_class = BridgeRendererConfig

    def __init__(self, tokenizer, config: BridgeRendererConfig | None = None):
        super().__init__(tokenizer, config)
        self._described: dict[str, bool] = {}  # _text_tools' answers by the tools' JSON

    # -- function tools on a template that has no place for them -------------------------------------------
    @property
    def supports_tools(self) -> bool:
        return True

    def _text_tools(self, tools) -> bool:
        """Whether tandem describes `tools` itself: the chat template ignores them (SmolLM2's does) and no
        tool parser of the library is configured. The description and the call format are those of
        env.kind = "tools" (rollout_server/tool_calls.py): <tool_call>{"name": ..., "arguments": ...}
        </tool_call>."""
        if not tools or self._tool_parser is not None:
            return False
        key = json.dumps(tools, sort_keys=True, default=str)
        if key not in self._described:  # two probe renders, once per tool set rather than once per turn
            probe = [{"role": "user", "content": _QUESTION}]
            self._described[key] = self._text(probe, tools, True) == self._text(probe, None, True)
        return self._described[key]

    def _with_tools(self, messages: list, tools) -> list:
        """The conversation as the template renders it with tandem's tools description in the system message,
        and each assistant tool call written back as the text the model samples."""
        out = []
        for m in messages:
            m = dict(m)
            calls = m.pop("tool_calls", None) or []
            if m.get("role") == "assistant" and calls:
                text = "".join(
                    tool_call_text(c["function"]["name"], c["function"].get("arguments")) for c in calls
                )
                m["content"] = (m.get("content") or "") + text
            out.append(m)
        return tools_described(out, tools)

    def render(self, messages: list, *, tools=None, add_generation_prompt: bool = False) -> RenderedTokens:
        if not self._text_tools(tools):
            return super().render(messages, tools=tools, add_generation_prompt=add_generation_prompt)
        rendered = super().render(
            self._with_tools(messages, tools), add_generation_prompt=add_generation_prompt
        )
        if messages and messages[0].get("role") == "system":
            indices = rendered.message_indices
        else:  # the system message is tandem's: its tokens belong to no message of the caller's
            indices = [i - 1 if i > 0 else -1 for i in rendered.message_indices]
        return RenderedTokens(
            token_ids=rendered.token_ids,
            message_indices=indices,
            message_roles=[m.get("role") or "" for m in messages],
            message_tool_names=extract_message_tool_names(messages),
        )

    def render_ids(self, messages: list, *, tools=None, add_generation_prompt: bool = False) -> list[int]:
        return self.render(messages, tools=tools, add_generation_prompt=add_generation_prompt).token_ids

    def parse_response(self, token_ids: list[int], *, tools=None, prompt_ids=None) -> ParsedResponse:
        parsed = super().parse_response(token_ids, tools=tools, prompt_ids=prompt_ids)
        if not self._text_tools(tools) or "<tool_call>" not in parsed.content:
            return parsed
        content, _, _ = parsed.content.partition("<tool_call>")
        calls = [_tool_call(body) for body in TOOL_CALL.findall(parsed.content)]
        if parsed.content.count("<tool_call>") > len(calls):
            calls.append(
                ParsedToolCall(
                    raw=parsed.content.rpartition("<tool_call>")[2], status=ToolCallParseStatus.UNCLOSED_BLOCK
                )
            )
        return ParsedResponse(
            content=content,
            reasoning_content=parsed.reasoning_content,
            tool_calls=calls,
            reasoning_complete=True,
        )

    def _text(self, messages: list, tools, generation_prompt: bool) -> str:
        kwargs = dict(self.config.model_extra or {})
        if tools is not None:
            kwargs["tools"] = tools
        return self._tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )

    def _encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def bridge_pieces(self, new_messages: list, tools=None) -> list[str] | None:
        """The text the template adds after a closed assistant turn, in pieces: [the close after the
        reply's content, each new message, the generation prompt]; None when the template does not extend
        its own renders (or refuses the probe)."""
        probe = [{"role": "user", "content": _QUESTION}, {"role": "assistant", "content": _REPLY}]
        try:
            texts = [
                self._text(probe + list(new_messages[:i]), tools, False) for i in range(len(new_messages) + 1)
            ]
            texts.append(self._text(probe + list(new_messages), tools, True))
        except Exception:  # noqa: BLE001 - a template that raises on the probe (strict role order): re-render
            return None
        if any(not later.startswith(earlier) for earlier, later in zip(texts, texts[1:], strict=False)):
            return None
        at = texts[0].rfind(_REPLY)
        if at < 0:  # the template rewrites an assistant's content: only full renders are faithful to it
            return None
        return [texts[0][at + len(_REPLY) :]] + [b[len(a) :] for a, b in zip(texts, texts[1:], strict=False)]

    def bridge_to_next_turn(
        self,
        previous_prompt_ids: list[int],
        previous_completion_ids: list[int],
        new_messages: list,
        *,
        tools=None,
    ) -> RenderedTokens | None:
        """`previous_prompt_ids + previous_completion_ids` verbatim, then the close's remainder, the new
        messages and the generation prompt as the template renders them (see the module's docstring)."""
        if not previous_prompt_ids or not previous_completion_ids or not new_messages:
            return None
        if any(m.get("role") not in _BRIDGEABLE for m in new_messages):
            return None  # an assistant message would re-tokenize sampled text
        pieces = self.bridge_pieces(new_messages, tools)
        if pieces is None:
            return None
        ids = [self._encode(p) for p in pieces]
        if [t for piece in ids for t in piece] != self._encode("".join(pieces)):
            return None  # the pieces tokenize differently from the whole: the whole is what a render gives
        close = ids[0]
        # The close's head the engine already sampled (the stop token); none when the reply was cut short.
        sampled = next((k for k in range(len(close), 0, -1) if previous_completion_ids[-k:] == close[:k]), 0)
        if not sampled and previous_completion_ids[-1] in self.get_stop_token_ids():
            return None  # stopped on a token that is not the template's close: nothing to extend safely
        previous = [*previous_prompt_ids, *previous_completion_ids, *close[sampled:]]
        added = ids[1:]
        indices = [-1] * len(previous)
        for i, piece in enumerate(added):
            indices += [i if i < len(new_messages) else -1] * len(piece)
        token_ids = previous + [t for piece in added for t in piece]
        return RenderedTokens(
            token_ids=token_ids,
            message_indices=indices,
            sampled_mask=[False] * len(token_ids),
            message_roles=[m.get("role") or "" for m in new_messages],
            message_tool_names=extract_message_tool_names(new_messages),
        )


# BadToolCall's kinds as the library's parse statuses
_STATUS = {
    "json": ToolCallParseStatus.INVALID_JSON,
    "object": ToolCallParseStatus.MALFORMED_STRUCTURE,
    "name": ToolCallParseStatus.MISSING_NAME,
    "arguments": ToolCallParseStatus.MALFORMED_STRUCTURE,
}


def _tool_call(body: str) -> ParsedToolCall:
    """One <tool_call> block's body as the library's parse record."""
    try:
        call = read_tool_call(body)
    except BadToolCall as e:
        return ParsedToolCall(raw=body, status=_STATUS[e.kind])
    return ParsedToolCall(raw=body, name=call["name"], arguments=call["arguments"])

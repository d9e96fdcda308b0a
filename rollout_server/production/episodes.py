"""Episodes of several turns (`env.kind = "multi_turn" | "tools"`), token-exact (docs/design.md §9).

An episode is the prompt, then the model's turns exactly as the engine sampled them (stop token included)
and, between them, the tokens the chat template adds for each environment message. Nothing is ever
re-rendered: each turn's engine input is the previous input plus the model's turn plus the environment's
tokens, so the learner trains on exactly what the engine saw and sampled, and the mask marks the model's
tokens (the only ones trained on).

The environment's tokens. A message's tokens are what the template adds for it after an assistant turn:
render(BASE + messages, generation prompt) minus render(BASE), where BASE is a fixed user/assistant
exchange, preceded by the template's glue after the assistant's end-of-turn token (ChatML's "\\n" after
`<|im_end|>`, which the model does not sample: it stops at `<|im_end|>`), and by the end-of-turn token
itself after a turn cut at sampling.max_new_tokens (the environment closes it, as a chat API re-rendering
the cut text would). They depend on the message only, never on the conversation before it. Templates
that render earlier turns differently once more follow (e.g. ones that drop past reasoning) would make a
re-rendered conversation differ from what was sampled; tandem keeps the sampled tokens instead, since
those are what the policy produced and what the learner must score. A template whose render(BASE) is not
a prefix of render(BASE + messages) at all cannot be appended to and is refused with that reason.

An episode ends when the environment says so, at env.max_turns, or at its token budget (env.max_tokens):
it is never cut inside an environment message, and always ends on the model's tokens; its finish_reason
is its last turn's, or "length" when the budget ended it.

Tools: the model calls one by writing `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the
Hermes/Qwen format, which tandem also teaches models whose template has no tools: the schemas go into the
system message). A malformed call, an unknown tool, arguments the tool refuses or a tool that raises are
answered as the tool's result with an error message the model can learn from; a tool that hangs past
reward.timeout_s or kills its worker is an environment failure. Environment steps and tools run in the
reward workers (shared/rewards.py); an episode whose environment fails ends with reward 0, counted.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from rollout_server.tool_calls import (
    parse_tool_calls,
    render_ids,
)
from shared.config import ConfigError, EnvConfig

BASE = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]


class EpisodeError(ConfigError):
    """An environment that cannot run with this tokenizer or these functions; the message says why."""


def _after_last(ids: list[int], token: int | None) -> list[int] | None:
    """`ids` from the last occurrence of `token` on (itself included); None when it does not occur."""
    if token is None or token not in ids:
        return None
    return ids[len(ids) - 1 - ids[::-1].index(token) :]


class Appender:
    """The tokens an environment message adds after a model turn, as the chat template renders it."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._base = render_ids(tokenizer, BASE, False)
        # How the template closes an assistant turn: its end-of-turn token and what follows it.
        self._close = _after_last(self._base, getattr(tokenizer, "eos_token_id", None)) or []

    def environment_ids(self, messages: list[dict], stop_id: int | None) -> list[int]:
        """Tokens of `messages` and the next assistant header, to follow a model turn that ended with
        `stop_id` (the token that stopped it), or that was cut short (None): the environment then closes
        the turn for it with the template's end-of-turn, as a chat API re-rendering the cut text would."""
        after = render_ids(self.tokenizer, BASE + messages, True)
        if after[: len(self._base)] != self._base:
            raise EpisodeError(
                "the chat template renders a conversation differently once a message follows it, so the "
                "environment's tokens cannot be appended to what the model sampled"
            )
        ended = _after_last(self._base, stop_id)  # the stop token as the template has it, and the glue
        close = ended[1:] if ended is not None else self._close if stop_id is None else []
        return close + after[len(self._base) :]


@dataclass
class Episode:
    """One trajectory after the prompt: token ids, the model mask and one logprob per model token."""

    prompt: list[int]
    messages: list[dict]  # the conversation so far, for the environment and the reward functions
    budget: int  # tokens after the prompt this episode may hold
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: int = 0
    done: bool = False
    failed: str | None = None  # the environment's failure kind: the episode gets reward 0
    finish_reason: str = "stop"
    last_text: str = ""  # the model's last turn: what reward functions score

    @property
    def engine_input(self) -> list[int]:
        return self.prompt + self.ids

    def add_model_turn(self, sample) -> None:
        if not sample.token_ids:  # unusable (the group is dropped): nothing to continue from
            self.done = True
            return
        self.ids += sample.token_ids
        self.mask += [1] * len(sample.token_ids)
        self.logprobs += [min(lp, 0.0) for lp in sample.logprobs]  # float noise can give +1e-7
        self.turns += 1
        self.finish_reason, self.last_text = sample.finish_reason, sample.text
        self.messages.append({"role": "assistant", "content": sample.text})
        if len(self.ids) >= self.budget:
            self.done = True

    def add_environment(self, messages: list[dict], ids: list[int]) -> None:
        """Append the environment's reply; one that leaves no room for a model token ends the episode
        without it (finish_reason 'length')."""
        if len(self.ids) + len(ids) >= self.budget:
            self.done, self.finish_reason = True, "length"
            return
        self.ids += ids
        self.mask += [0] * len(ids)
        self.messages += messages


def as_messages(reply: Any) -> list[dict] | None:
    """An environment step's reply as messages: a string is a user message; None: nothing to say."""
    if reply is None:
        return []
    if isinstance(reply, str):
        return [{"role": "user", "content": reply}]
    if isinstance(reply, dict):
        reply = [reply]
    if isinstance(reply, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in reply
    ):
        return [{"role": m["role"], "content": m["content"]} for m in reply]
    return None


def tool_schemas(functions: dict[str, Any]) -> list[dict]:
    """OpenAI-style schemas from each tool's signature and Google-style docstring; EpisodeError names a
    tool whose schema cannot be made."""
    from transformers.utils import get_json_schema

    out = []
    for spec, fn in functions.items():
        try:
            out.append(get_json_schema(fn))
        except Exception as e:  # transformers' own errors: no docstring, an argument not described, ...
            raise EpisodeError(f"env.tools: '{spec}': {e}") from None
    return out


class Environment:
    """The environment's side of the turns after the first: `respond(episode, answer, metadata)` appends
    its reply to an unfinished episode, or ends it. `call(spec, args) -> (value, failure kind | None)`
    runs user code (the reward workers)."""

    def __init__(self, cfg: EnvConfig, tokenizer, call, tool_names: list[str] = ()):
        self.cfg = cfg
        self.appender = Appender(tokenizer)
        self.call = call
        self.tools = dict(zip(tool_names, cfg.tools, strict=True))  # tool name -> spec

    async def respond(self, episode: Episode, answer: str, metadata: dict) -> None:
        """The environment's reply to the model's last turn, appended; or the episode ends."""
        if episode.done or episode.turns >= self.cfg.max_turns:
            episode.done = True
            return
        if self.cfg.kind == "multi_turn":
            messages = await self._step(episode, answer, metadata)
        else:
            messages = await self._tool_results(episode)
        if not messages:  # done, failed, or nothing to say
            episode.done = True
            return
        stop = episode.ids[-1] if episode.finish_reason == "stop" else None  # None: cut at max_new_tokens
        episode.add_environment(messages, self.appender.environment_ids(messages, stop))

    async def _step(self, episode: Episode, answer: str, metadata: dict) -> list[dict] | None:
        value, failed = await self.call(self.cfg.step, [episode.messages, answer, metadata])
        if failed is None:
            ok = isinstance(value, list) and len(value) == 2 and isinstance(value[1], bool)
            messages = as_messages(value[0]) if ok else None
            if messages is None:
                failed = "bad_type"
            elif value[1]:
                return None  # done: the episode ends on the model's turn
            else:
                return messages
        episode.failed, episode.done = failed, True
        return None

    async def _tool_results(self, episode: Episode) -> list[dict] | None:
        calls = parse_tool_calls(episode.last_text)
        if isinstance(calls, str):
            return [{"role": "tool", "content": calls}]  # the model's mistake: it reads why
        results = []
        for call in calls:
            spec = self.tools.get(call["name"])
            if spec is None:
                known = ", ".join(self.tools)
                results.append(f"error: there is no tool named '{call['name']}' (the tools: {known})")
                continue
            value, failed = await self.call(spec, call["arguments"])
            if failed in ("timeout", "crashed"):
                episode.failed, episode.done = failed, True
                return None
            if failed is not None:  # raised on these arguments (TypeError included), or unencodable
                results.append(f"error: {call['name']} failed ({failed}) on {json.dumps(call['arguments'])}")
            else:
                results.append(value if isinstance(value, str) else json.dumps(value))
        return [{"role": "tool", "content": r} for r in results]


async def run_turns(
    backend,
    episodes: list[Episode],
    rows: list[tuple[str, dict]],
    env: Environment,
    max_new_tokens: int,
    **sampling,
) -> None:
    """Drive `episodes` (each holding its first model turn) until all are done: every round, the
    environment answers each unfinished one (concurrently), then one engine call samples the next turn
    of all of them (n=1 each), within the smallest remaining budget among them."""
    while True:
        await asyncio.gather(*(env.respond(e, a, m) for e, (a, m) in zip(episodes, rows, strict=True)))
        live = [e for e in episodes if not e.done]
        if not live:
            return
        max_tokens = min(max_new_tokens, *(e.budget - len(e.ids) for e in live))
        samples = await backend.generate(
            [e.engine_input for e in live], n=1, max_tokens=max_tokens, **sampling
        )
        for e, (s,) in zip(live, samples, strict=True):
            e.add_model_turn(s)


def build(cfg: EnvConfig, tokenizer, call=None) -> tuple[Environment, list[dict]]:
    """The environment of `cfg` (not single_turn) and its tools' schemas, its functions imported and
    checked now: an EpisodeError names what cannot run. User code then runs through `call` (the reward
    runner's call_env; None: only checking)."""
    from shared.rewards import load_env

    functions = load_env(cfg)
    schemas = tool_schemas(functions) if cfg.kind == "tools" else []
    names = [s["function"]["name"] for s in schemas]
    if len(set(names)) != len(names):
        raise EpisodeError(f"env.tools: two tools share a name ({', '.join(names)})")
    env = Environment(cfg, tokenizer, call, names)
    # The template can be appended to with the messages this environment sends (else EpisodeError).
    env.appender.environment_ids([{"role": "tool" if schemas else "user", "content": "."}], None)
    return env, schemas

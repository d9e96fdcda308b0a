"""Episodes of several turns on a scripted engine (fast): the trajectory's tokens, mask and logprobs exactly
as sampled and appended, every turn's engine input a prefix-extension of the last, and an environment or
tool that misbehaves handled without touching the server. The real engines run them end to end in
test_episodes_e2e.py."""

from __future__ import annotations

import asyncio
import re
import textwrap
import time

import pytest
from fastapi.testclient import TestClient

from rollout_server.engines.base import Sample
from rollout_server.production.episodes import Appender
from rollout_server.tool_calls import parse_tool_calls
from shared.datasets import Problem
from tests.fakes import fake_app

IM_START, IM_END = 1, 2  # ChatML's special tokens; IM_END is the end-of-turn (EOS) the model samples
SPECIAL = {"<|im_start|>": IM_START, "<|im_end|>": IM_END}


class ChatMLTokenizer:
    """A character-level tokenizer with ChatML's template (SmolLM2's and Qwen's shape, no default system)."""

    eos_token_id = IM_END

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in re.split(r"(<\|im_start\|>|<\|im_end\|>)", text):
            ids += [SPECIAL[piece]] if piece in SPECIAL else [ord(ch) for ch in piece]
        return ids

    def decode(self, ids, skip_special_tokens=False) -> str:
        names = {v: k for k, v in SPECIAL.items()}
        return "".join(("" if skip_special_tokens else names[t]) if t in names else chr(t) for t in ids)

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, tools=None):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return self.encode(text + ("<|im_start|>assistant\n" if add_generation_prompt else ""))

    def __len__(self):
        return 256


def env_ids(role: str, *contents: str) -> list[int]:
    """The tokens after a model turn that ended with <|im_end|>: ChatML's newline, the messages, and the
    next assistant header, written out by hand."""
    messages = "".join(f"<|im_start|>{role}\n{c}<|im_end|>\n" for c in contents)
    return ChatMLTokenizer().encode(f"\n{messages}<|im_start|>assistant\n")


class ScriptedBackend:
    """Answers each engine input with `script(input text, sample index)` and <|im_end|>; token t of a
    turn has logprob -(t + 1) / 100 - turn / 10, so every logprob of an episode is distinct. Records
    every engine input. `hold`: an asyncio.Event every later turn waits for (a test sets it)."""

    name = "scripted"
    one_version = False

    def __init__(self, script, hold=None):
        self.tokenizer = ChatMLTokenizer()
        self.script = script
        self.hold = hold
        self.inputs: list[list[int]] = []

    async def generate(self, prompts, *, n, temperature, max_tokens, adapter, logprobs=True):
        later = [p for p in prompts if self.tokenizer.decode(p).count("<|im_start|>assistant") > 1]
        if later and self.hold is not None:
            self.inputs += [list(p) for p in prompts]  # in the engine, held
            await self.hold.wait()
            del self.inputs[-len(prompts) :]
        out = []
        for prompt in prompts:
            self.inputs.append(list(prompt))
            text = self.tokenizer.decode(prompt)
            turn = text.count("<|im_start|>assistant")
            row = []
            for i in range(n):
                reply = self.script(text, i)
                ids = (self.tokenizer.encode(reply) + [IM_END])[:max_tokens]
                reason = "stop" if ids[-1] == IM_END else "length"
                lps = [-(t + 1) / 100 - turn / 10 for t in range(len(ids))]
                row.append(Sample(ids, lps, self.tokenizer.decode(ids, skip_special_tokens=True), reason))
            out.append(row)
        return out

    async def load_adapter(self, adapter): ...
    async def unload_adapter(self, adapter): ...
    async def sleep(self): ...
    async def wake(self): ...
    async def close(self): ...


def turn(text: str, turn_no: int) -> tuple[list[int], list[float]]:
    """The ids and logprobs ScriptedBackend gives a model turn `text` sampled as turn `turn_no`."""
    ids = ChatMLTokenizer().encode(text) + [IM_END]
    return ids, [-(t + 1) / 100 - turn_no / 10 for t in range(len(ids))]


PROBLEMS = [Problem(f"guess-train-{i}", f"Guess my number {i}.", "3") for i in range(4)]


def _pull_all(c: TestClient, n: int) -> list[dict]:
    r = c.post("/v1/groups/pull", json={"max_groups": n, "wait_s": 30})
    assert r.status_code == 200, r.text
    return r.json()["groups"]


def _metric(c: TestClient, pattern: str) -> float:
    found = re.search(pattern + r" (\S+)", c.get("/metrics").text)
    return float(found.group(1)) if found else 0.0


def test_a_three_turn_episode_is_the_sampled_and_appended_tokens_exactly(tmp_path):
    (tmp_path / "game.py").write_text(
        textwrap.dedent("""
        def step(messages, answer, metadata):
            turns = sum(m["role"] == "assistant" for m in messages)
            return (None, True) if turns == 3 else (f"no, try again ({turns})", False)

        def solved(completion, answer, prompt, metadata):
            return float(completion == "guess 3" and metadata["episode"]["turns"] == 3)
        """)
    )
    backend = ScriptedBackend(lambda text, i: f"guess {text.count('<|im_start|>assistant')}")
    env = {"kind": "multi_turn", "step": f"{tmp_path}/game.py:step", "max_turns": 5}
    reward = {"functions": [f"{tmp_path}/game.py:solved"], "timeout_s": 30}
    with TestClient(fake_app(tmp_path, backend, problems=PROBLEMS, env=env, reward=reward)) as c:
        groups = _pull_all(c, 2)
    (t1, l1), (t2, l2), (t3, l3) = turn("guess 1", 1), turn("guess 2", 2), turn("guess 3", 3)
    e1, e2 = env_ids("user", "no, try again (1)"), env_ids("user", "no, try again (2)")
    for g in groups:
        for comp in g["completions"]:
            assert comp["token_ids"] == t1 + e1 + t2 + e2 + t3
            assert comp["mask"] == [1] * len(t1) + [0] * len(e1) + [1] * len(t2) + [0] * len(e2) + [1] * len(
                t3
            )
            assert comp["logprobs"] == pytest.approx(l1 + l2 + l3, abs=0)  # one per model token, in order
            assert comp["reward"] == 1.0 and comp["finish_reason"] == "stop"
    prompt = groups[0]["prompt_token_ids"]
    assert prompt + t1 + e1 in backend.inputs and prompt + t1 + e1 + t2 + e2 in backend.inputs
    # Every later turn's engine input extends an earlier turn's input (the one before it) as it was.
    tok = ChatMLTokenizer()
    turns = [tok.decode(x).count("<|im_start|>assistant") for x in backend.inputs]
    for i, x in enumerate(backend.inputs):
        if turns[i] > 1:
            before = [y for y, k in zip(backend.inputs[:i], turns[:i], strict=True) if k == turns[i] - 1]
            assert any(len(y) < len(x) and x[: len(y)] == y for y in before), f"input {i} re-rendered"


def test_evaluation_plays_each_sample_as_an_episode_with_the_rows_answer(tmp_path):
    (tmp_path / "game.py").write_text(
        "def step(messages, answer, metadata):\n"
        "    said = messages[-1]['content']\n"
        "    return (None, True) if said.endswith(answer) else (f'not {said}, {metadata[\"hint\"]}', False)\n"
    )
    backend = ScriptedBackend(lambda text, i: f"guess {text.count('<|im_start|>assistant')}")
    env = {"kind": "multi_turn", "step": f"{tmp_path}/game.py:step", "max_turns": 4}
    with TestClient(fake_app(tmp_path, backend, problems=PROBLEMS, env=env, reward={"timeout_s": 30})) as c:
        body = {
            "prompts": ["a", "b"],
            "n": 2,
            "rows": [{"answer": "2", "metadata": {"hint": "up"}}, {"answer": "9"}],
        }
        body["rows"][1]["metadata"] = {"hint": "down"}
        r = c.post("/v1/generate", json=body)
        assert r.status_code == 200, r.text
        solved, capped = r.json()["outputs"]
        for o in solved:  # the answer 2 is said at the second turn
            assert (o["text"], o["turns"]) == ("guess 2", 2)
            assert [m["content"] for m in o["messages"][-3:]] == ["guess 1", "not guess 1, up", "guess 2"]
        for o in capped:  # never said: env.max_turns ends it
            assert (o["text"], o["turns"]) == ("guess 4", 4) and "not guess 3, down" in o["messages"][-2][
                "content"
            ]
        r = c.post("/v1/generate", json={"prompts": ["a"], "rows": []})
        assert r.status_code == 422 and "one per prompt" in r.text
    with TestClient(fake_app(tmp_path / "plain", ScriptedBackend(lambda text, i: "x"))) as c:
        r = c.post("/v1/generate", json={"prompts": ["a"], "rows": [{"answer": "1"}]})
        assert r.status_code == 422 and "this server's env.kind is 'single_turn'" in r.text


def test_an_episode_cut_by_a_sleep_is_made_again_whole(tmp_path):
    (tmp_path / "game.py").write_text(
        "def step(messages, answer, metadata):\n"
        "    turns = sum(m['role'] == 'assistant' for m in messages)\n"
        "    return (None, True) if turns == 2 else ('again', False)\n"
    )
    hold = asyncio.Event()
    backend = ScriptedBackend(lambda text, i: f"guess {text.count('<|im_start|>assistant')}", hold)
    env = {"kind": "multi_turn", "step": f"{tmp_path}/game.py:step"}
    app = fake_app(tmp_path, backend, problems=PROBLEMS, env=env, reward={"timeout_s": 30})
    with TestClient(app) as c:
        deadline = time.monotonic() + 30
        while (
            not any(len(x) > len(backend.inputs[0]) for x in backend.inputs) and time.monotonic() < deadline
        ):
            time.sleep(0.01)
        held = len(backend.inputs)
        assert held > 2  # the first batch's second turns are in the engine, held there
        c.post("/v1/sleep")  # cancels the batch mid-episode
        assert c.get("/health").json()["queue_depth"] == 0  # nothing half-done was queued
        c.post("/v1/wake")
        app.state.loop.call_soon_threadsafe(hold.set)
        groups = _pull_all(c, 2)
    (t1, _), (t2, _) = turn("guess 1", 1), turn("guess 2", 2)
    for g in groups:  # whole episodes: both turns and the environment's message between them
        assert all(x["token_ids"] == t1 + env_ids("user", "again") + t2 for x in g["completions"])
    first_turns = [
        x for x in backend.inputs if ChatMLTokenizer().decode(x).count("<|im_start|>assistant") == 1
    ]
    assert len(first_turns) > len(set(map(tuple, first_turns)))  # the cut batch's first turns sampled again


def test_a_turn_cut_at_max_new_tokens_is_closed_by_the_environment_and_the_episode_goes_on(tmp_path):
    (tmp_path / "game.py").write_text(
        "def step(messages, answer, metadata):\n"
        "    turns = sum(m['role'] == 'assistant' for m in messages)\n"
        "    return (None, True) if turns == 2 else ('go on', False)\n"
    )
    backend = ScriptedBackend(lambda text, i: "a long ramble" if text.count("assistant") == 1 else "ok")
    env = {"kind": "multi_turn", "step": f"{tmp_path}/game.py:step"}
    cut_at_6 = {"max_new_tokens": 6}  # the first turn is cut: "a long"
    app = fake_app(tmp_path, backend, problems=PROBLEMS, env=env, reward={"timeout_s": 30}, sampling=cut_at_6)
    with TestClient(app) as c:
        groups = _pull_all(c, 1)
    cut, _ = turn("a long", 1)
    cut = cut[:-1]  # no end-of-turn: it was cut
    ok, _ = turn("ok", 2)
    for x in groups[0]["completions"]:
        assert x["token_ids"] == cut + [IM_END] + env_ids("user", "go on") + ok
        assert x["mask"] == [1] * 6 + [0] * (1 + len(env_ids("user", "go on"))) + [1] * len(ok)
        assert x["finish_reason"] == "stop"  # the episode's last turn ended it


def test_the_appended_tokens_are_the_templates_for_the_message_after_an_end_of_turn():
    a = Appender(ChatMLTokenizer())
    assert a.environment_ids([{"role": "tool", "content": "42"}], IM_END) == env_ids("tool", "42")
    # A turn cut at max_new_tokens: the environment closes it with the template's end-of-turn first
    assert a.environment_ids([{"role": "user", "content": "x"}], None) == [IM_END] + env_ids("user", "x")


def test_a_tool_without_a_schema_is_refused_at_start_naming_it(tmp_path):
    from rollout_server.production.episodes import EpisodeError, build
    from shared.config import EnvConfig

    (tmp_path / "t.py").write_text("def bare(x):\n    return x\n")
    with pytest.raises(EpisodeError, match=r"env.tools: '.*t.py:bare': .*no docstring"):
        build(EnvConfig(kind="tools", tools=[f"{tmp_path}/t.py:bare"]), ChatMLTokenizer())


def test_tool_calls_parse_and_a_malformed_one_is_a_message_for_the_model():
    assert parse_tool_calls('ok <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>') == [
        {"name": "add", "arguments": {"a": 1}}
    ]
    assert parse_tool_calls("no call here") == []
    assert parse_tool_calls("<tool_call>{nope</tool_call>").startswith("error: a tool call must hold JSON")
    assert parse_tool_calls('<tool_call>{"name": "add"').startswith("error: a tool call opened with")
    assert "must be a JSON object" in parse_tool_calls('<tool_call>{"name": "a", "arguments": 3}</tool_call>')


TOOLS = '''
import time

def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b

def boom() -> str:
    """Always raises."""
    raise RuntimeError("kaboom")

def junk() -> str:
    """Returns what JSON cannot hold."""
    return {1, 2}

def hang() -> str:
    """Never returns."""
    time.sleep(600)

def always(completion, answer, prompt, metadata):
    return 1.0
'''

CALLS = [  # sample i's first turn; every second turn answers without a call
    '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
    "<tool_call>{nope</tool_call>",
    '<tool_call>{"name": "boom", "arguments": {}}</tool_call><tool_call>{"name": "junk", "arguments": {}}'
    '</tool_call><tool_call>{"name": "nosuch", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "hang", "arguments": {}}</tool_call>',
]


def test_tools_raising_hanging_junk_and_malformed_calls_are_answered_or_end_the_episode(tmp_path):
    (tmp_path / "tools.py").write_text(TOOLS)
    specs = [f"{tmp_path}/tools.py:{name}" for name in ("add", "boom", "junk", "hang")]
    backend = ScriptedBackend(lambda text, i: CALLS[i] if "<|im_start|>tool" not in text else "the answer")
    env = {"kind": "tools", "tools": specs}
    reward = {"functions": [f"{tmp_path}/tools.py:always"], "timeout_s": 2}
    model = {"max_model_len": 4096}  # a character a token: the tools' description is long
    with TestClient(fake_app(tmp_path, backend, problems=PROBLEMS, env=env, reward=reward, model=model)) as c:
        groups = _pull_all(c, 1)
        g = groups[0]
        tok = ChatMLTokenizer()
        assert '"name": "add"' in tok.decode(g["prompt_token_ids"])  # the tools are described in the prompt
        ok, bad, errors, hung = g["completions"]
        answer, _ = turn("the answer", 2)
        first = [turn(CALLS[i], 1)[0] for i in range(4)]
        assert ok["token_ids"] == first[0] + env_ids("tool", "5") + answer
        message = "error: a tool call must hold JSON (Expecting property name enclosed in double quotes at "
        message += "character 1)"
        assert bad["token_ids"] == first[1] + env_ids("tool", message) + answer
        results = [
            "error: boom failed (raised) on {}",
            "error: junk failed (bad_type) on {}",
            "error: there is no tool named 'nosuch' (the tools: add, boom, junk, hang)",
        ]
        assert errors["token_ids"] == first[2] + env_ids("tool", *results) + answer
        # The hanging tool: the environment failed, the episode ends on the model's turn with reward 0.
        assert hung["token_ids"] == first[3] and hung["mask"] is None
        assert [x["reward"] for x in g["completions"]] == [1.0, 1.0, 1.0, 0.0]
        assert _metric(c, r'tandem_reward_failures_total\{function="hang",kind="timeout"\}') >= 1
        assert _metric(c, r'tandem_reward_failures_total\{function="boom",kind="raised"\}') >= 1
        assert c.get("/health").status_code == 200  # the server goes on

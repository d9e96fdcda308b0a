"""The OpenAI-compatible endpoints on the fake engine, driven by the official `openai` SDK (fast): model
routing, the request and response schemas, streaming, logprobs, echo, the error schema, sleep, and the
cap on evaluation sequences. test_openai_e2e.py drives a real vLLM server the same way."""

from __future__ import annotations

import dataclasses
import threading
import time

import openai
import pytest
from fastapi.testclient import TestClient

from rollout_server.engines.base import TokenLogprob
from shared.datasets import chat_prompt_ids
from tests.fakes import FakeBackend, FakeTokenizer, fake_app, tiny_adapter
from tests.rollout_server.test_app import _publish

FIVE = "uvwxy"  # the fake's completion on the base model: tokens 20..24 (v1: 21..25, "vwxyz")


@pytest.fixture(autouse=True)
def _no_token(monkeypatch):
    monkeypatch.delenv("TANDEM_API_TOKEN", raising=False)


def _sdk(c: TestClient, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=c, max_retries=0)


def test_models_lists_base_every_stored_version_and_latest(tmp_path):
    with TestClient(fake_app(tmp_path, FakeBackend())) as c:
        sdk = _sdk(c)
        assert [(m.id, m.root) for m in sdk.models.list()] == [("base", c.app.state.server.cfg.model.name),
                                                               ("latest", "base")]  # fmt: skip
        assert _publish(c, 1, tiny_adapter(tmp_path / "a1")).status_code == 200
        assert _publish(c, 2, tiny_adapter(tmp_path / "a2")).status_code == 200
        ids = {m.id: m.root for m in sdk.models.list()}
        assert ids == {"base": c.app.state.server.cfg.model.name, "policy-v1": "policy-v1",
                       "policy-v2": "policy-v2", "latest": "policy-v2"}  # fmt: skip


def test_completions_pick_the_version_by_model_and_count_usage(tmp_path):
    backend = FakeBackend()
    with TestClient(fake_app(tmp_path, backend)) as c:
        sdk = _sdk(c)
        assert _publish(c, 1, tiny_adapter(tmp_path / "a1")).status_code == 200
        base = sdk.completions.create(model="base", prompt="hi", max_tokens=8, n=3)
        assert [ch.text for ch in base.choices] == [FIVE] * 3
        assert [ch.index for ch in base.choices] == [0, 1, 2]
        assert {ch.finish_reason for ch in base.choices} == {"stop"}
        assert base.model == "base"
        assert (base.usage.prompt_tokens, base.usage.completion_tokens, base.usage.total_tokens) == (
            2,
            15,
            17,
        )
        v1 = sdk.completions.create(model="policy-v1", prompt="hi", max_tokens=8)
        latest = sdk.completions.create(model="latest", prompt="hi", max_tokens=3)
        assert v1.choices[0].text == "vwxyz" and v1.model == "policy-v1"
        got = (latest.choices[0].text, latest.choices[0].finish_reason, latest.model)
        assert got == ("vwx", "length", "policy-v1")
        # two prompts (text and token ids) x n = 2: choices in prompt-major order, each prompt engine-encoded
        two = sdk.completions.create(model="base", prompt=[[5, 6, 7], [8, 9]], max_tokens=2, n=2)
        assert [ch.index for ch in two.choices] == [0, 1, 2, 3]
        assert two.usage.prompt_tokens == 5
        assert [t[0] for t in backend.texts[-4:]] == [[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]]
        assert (
            sdk.completions.create(model="base", prompt="ab", stop=["x"], max_tokens=9).choices[0].text
            == "uvw"
        )


def test_completion_logprobs_and_echo_with_max_tokens_zero_score_the_prompt(tmp_path):
    backend = FakeBackend()
    with TestClient(fake_app(tmp_path, backend)) as c:
        sdk = _sdk(c)
        out = sdk.completions.create(model="base", prompt="hi", max_tokens=2, logprobs=2).choices[0].logprobs
        assert out.tokens == ["u", "v"] and out.token_logprobs == [-0.5, -0.5]
        assert out.top_logprobs == [{"u": -0.5, "v": -1.5, "w": -2.5}, {"v": -0.5, "w": -1.5, "x": -2.5}]
        assert out.text_offset == [0, 1]
        # what a harness sends for a multiple-choice task: token ids, echo, no new token
        echo = sdk.completions.create(model="base", prompt=[3, 4, 5], max_tokens=0, echo=True, logprobs=1)
        ch = echo.choices[0]
        assert ch.text == "def" and ch.finish_reason == "length"
        assert ch.logprobs.tokens == ["d", "e", "f"]
        assert ch.logprobs.token_logprobs == [None, -1.0, -1.0]
        assert ch.logprobs.top_logprobs == [None, {"e": -1.0, "f": -2.0}, {"f": -1.0, "g": -2.0}]
        assert echo.usage.completion_tokens == 0
        assert backend.texts[-1][1].prompt_logprobs == 1 and backend.texts[-1][1].max_tokens == 0
        # echo and a completion: the prompt's text and logprobs, then the completion's
        both = sdk.completions.create(model="base", prompt=[3, 4], max_tokens=2, echo=True, logprobs=0)
        assert both.choices[0].text == "de" + "uv"
        assert both.choices[0].logprobs.token_logprobs == [None, -1.0, -0.5, -0.5]
        assert both.choices[0].logprobs.text_offset == [0, 1, 2, 3]


class _Nucleus(FakeBackend):
    """As vLLM's processed logprobs with a small top_p: the alternatives outside the nucleus are -inf."""

    async def stream(self, prompt, request, adapter):
        async for piece in super().stream(prompt, request, adapter):
            inf = [TokenLogprob(e.token_id, e.logprob, {t: float("-inf") if t != e.token_id else lp
                                                       for t, lp in e.top.items()})
                   for e in piece.logprobs or []]  # fmt: skip
            yield dataclasses.replace(piece, logprobs=inf if piece.logprobs is not None else None)


def test_a_logprob_of_minus_infinity_is_written_as_vllm_writes_it_not_as_null(tmp_path):
    with TestClient(fake_app(tmp_path, _Nucleus())) as c:
        sdk = _sdk(c)
        out = sdk.completions.create(model="base", prompt="hi", max_tokens=2, top_p=0.1, logprobs=2)
        assert out.choices[0].logprobs.top_logprobs == [
            {"u": -0.5, "v": -9999.0, "w": -9999.0},
            {"v": -0.5, "w": -9999.0, "x": -9999.0},
        ]
        streamed = sdk.completions.create(model="base", prompt="hi", max_tokens=1, logprobs=1, stream=True)
        assert [ch.choices[0].logprobs.top_logprobs for ch in streamed] == [[{"u": -0.5, "v": -9999.0}]]
        chat = sdk.chat.completions.create(
            model="base", messages=[{"role": "user", "content": "hi"}], max_tokens=1, logprobs=True,
            top_logprobs=2,
        )  # fmt: skip
        (tok,) = chat.choices[0].logprobs.content
        assert [t.logprob for t in tok.top_logprobs] == [-0.5, -9999.0]


def test_streamed_completions_add_up_to_the_whole_and_end_with_usage(tmp_path):
    with TestClient(fake_app(tmp_path, FakeBackend())) as c:
        sdk = _sdk(c)
        chunks = list(
            sdk.completions.create(
                model="base",
                prompt="hi",
                max_tokens=8,
                n=2,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        texts = {0: "", 1: ""}
        for ch in chunks[:-1]:
            (choice,) = ch.choices
            texts[choice.index] += choice.text
        assert texts == {0: FIVE, 1: FIVE}
        assert sorted(ch.choices[0].index for ch in chunks[:-1] if ch.choices[0].finish_reason == "stop") == [
            0,
            1,
        ]
        assert len(chunks) == 2 * 5 + 1  # a token a chunk, then the usage
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_chat_completions_render_the_chat_template_and_stream(tmp_path):
    backend = FakeBackend()
    with TestClient(fake_app(tmp_path, backend)) as c:
        sdk = _sdk(c)
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
        out = sdk.chat.completions.create(model="base", messages=messages, n=2, logprobs=True, top_logprobs=1)
        assert backend.texts[-1][0] == chat_prompt_ids(FakeTokenizer(), messages)
        room = c.app.state.server.cfg.model.max_model_len - len(backend.texts[-1][0])
        assert backend.texts[-1][1].max_tokens == room  # what max_model_len leaves
        assert [(ch.index, ch.message.role, ch.message.content) for ch in out.choices] == [
            (0, "assistant", FIVE), (1, "assistant", FIVE)]  # fmt: skip
        first = out.choices[0].logprobs.content[0]
        assert (first.token, first.logprob, first.bytes) == ("u", -0.5, [117])
        assert [(t.token, t.logprob) for t in first.top_logprobs] == [("u", -0.5)]
        assert out.usage.completion_tokens == 10 and out.object == "chat.completion"
        streamed = list(
            sdk.chat.completions.create(model="base", messages=messages, stream=True, max_tokens=3)
        )
        assert streamed[0].choices[0].delta.role == "assistant"
        assert "".join(ch.choices[0].delta.content or "" for ch in streamed) == "uvw"
        assert streamed[-1].choices[0].finish_reason == "length"


def test_errors_use_openai_schema_and_name_the_field(tmp_path):
    with TestClient(fake_app(tmp_path, FakeBackend())) as c:
        sdk = _sdk(c)
        with pytest.raises(openai.NotFoundError) as e:
            sdk.completions.create(model="policy-v7", prompt="hi")
        assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
        cases = [
            ({"frequency_penalty": 0.5}, "frequency_penalty"),
            ({"logit_bias": {"5": 1}}, "logit_bias"),
            ({"suffix": "end"}, "suffix"),
            ({"best_of": 3}, "best_of"),
            ({"guided_json": {}}, "guided_json"),
            ({"logprobs": 21}, "logprobs"),
            ({"max_tokens": 5000}, "max_tokens"),
            ({"max_tokens": 0}, "max_tokens"),
            ({"prompt": [[5], [100]]}, "prompt[1]"),
        ]
        for extra, param in cases:
            body = {"prompt": "hi"} | extra
            with pytest.raises(openai.BadRequestError) as e:
                sdk.completions.create(model="base", prompt=body.pop("prompt"), extra_body=body)
            assert e.value.status_code == 400 and e.value.body["param"] == param, (extra, e.value.body)
            assert e.value.body["type"] == "invalid_request_error"
        # a no-op value of an unsupported field is fine, as are seed and user (ignored)
        ok = sdk.completions.create(
            model="base", prompt="hi", frequency_penalty=0, seed=3, user="me", best_of=1
        )
        assert ok.choices[0].text == FIVE
        with pytest.raises(openai.BadRequestError) as e:
            sdk.chat.completions.create(model="base", messages=[{"role": "user", "content": None}])
        assert e.value.body["param"].startswith("messages.0")
        assert "a user message needs content" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            sdk.chat.completions.create(
                model="base", messages=[{"role": "user", "content": "x"}], tool_choice="required"
            )
        assert e.value.body["param"] == "tool_choice" and "only 'auto' or 'none'" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            sdk.chat.completions.create(
                model="base", messages=[{"role": "user", "content": "x"}], top_logprobs=2
            )
        assert e.value.body["param"] == "top_logprobs"
        r = c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        # tandem's own routes keep their schema
        assert "detail" in c.post("/v1/generate", json={"prompts": []}).json()


def test_no_token_is_a_401_and_a_wrong_one_a_403_in_openai_schema(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_API_TOKEN", "s3cret")
    with TestClient(fake_app(tmp_path, FakeBackend())) as c:
        no_token = openai.OpenAI(  # the SDK always sends a key: blank the header it makes of it
            base_url="http://testserver/v1", api_key="-", http_client=c, max_retries=0,
            default_headers={"Authorization": ""},
        )  # fmt: skip
        with pytest.raises(openai.AuthenticationError) as e:
            no_token.completions.create(model="base", prompt="hi")
        assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
        with pytest.raises(openai.PermissionDeniedError):
            _sdk(c, "wrong").completions.create(model="base", prompt="hi")
        assert _sdk(c, "s3cret").completions.create(model="base", prompt="hi").choices[0].text == FIVE


def test_asleep_a_request_waits_for_the_wake_within_a_bound_then_gets_503(tmp_path):
    with TestClient(fake_app(tmp_path, FakeBackend(), openai_wait_s=0.3)) as c:
        sdk = _sdk(c)
        assert c.post("/v1/sleep").status_code == 200
        t = time.monotonic()
        with pytest.raises(openai.InternalServerError) as e:
            sdk.completions.create(model="base", prompt="hi")
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "5"
        assert "asleep" in e.value.body["message"] and 0.3 <= time.monotonic() - t < 5
        threading.Timer(0.1, lambda: c.post("/v1/wake")).start()
    with TestClient(fake_app(tmp_path / "b", FakeBackend(), openai_wait_s=30)) as c:
        sdk = _sdk(c)
        assert c.post("/v1/sleep").status_code == 200
        waker = threading.Timer(0.5, lambda: c.post("/v1/wake"))
        waker.start()
        assert sdk.completions.create(model="base", prompt="hi").choices[0].text == FIVE
        waker.join()


def test_a_request_the_sleep_cut_short_runs_again_after_the_wake(tmp_path):
    backend = FakeBackend(abort_first=True)  # the first stream is aborted, as vLLM's sleep() does
    with TestClient(fake_app(tmp_path, backend)) as c:
        assert _sdk(c).completions.create(model="base", prompt="hi").choices[0].text == FIVE
        assert len(backend.texts) == 2


def test_evaluation_runs_at_most_openai_max_sequences_at_once(tmp_path):
    backend = FakeBackend(delay_s=0.01)
    with TestClient(fake_app(tmp_path, backend, openai_max_sequences=2)) as c:
        out = _sdk(c).completions.create(model="base", prompt="hi", n=6, max_tokens=5)
        assert [ch.text for ch in out.choices] == [FIVE] * 6
        assert backend.peak_streaming == 2
    backend = FakeBackend(delay_s=0.01)
    with TestClient(fake_app(tmp_path / "b", backend, openai_max_sequences=8)) as c:
        _sdk(c).completions.create(model="base", prompt="hi", n=6, max_tokens=5)
        assert backend.peak_streaming == 6


def test_an_engine_holding_one_version_runs_all_requests_for_another_version_together(tmp_path):
    """vLLM merge mode: production cannot use the engine while it holds another version's weights, so
    evaluation of that version is not held to openai_max_sequences (the switches are rate-limited)."""
    backend = FakeBackend(delay_s=0.01)
    backend.one_version = True
    with TestClient(fake_app(tmp_path, backend, openai_max_sequences=2)) as c:
        assert _publish(c, 1, tiny_adapter(tmp_path / "a1")).status_code == 200
        _sdk(c).completions.create(model="base", prompt="hi", n=6, max_tokens=5)
        assert backend.peak_streaming == 6
        backend.peak_streaming = 0
        _sdk(c).completions.create(model="latest", prompt="hi", n=6, max_tokens=5)  # the served version
        assert backend.peak_streaming == 2


MULTIPLY = {
    "type": "function",
    "function": {"name": "multiply", "description": "Multiply.", "parameters": {"type": "object"}},
}


def test_chat_completions_offer_tools_and_take_back_a_conversation_with_calls(tmp_path):
    """tools: described where the template has no place for them (the fake's has none) as env.kind = "tools"
    does; an assistant's tool_calls and a tool's result come back into the prompt as the model wrote and
    read them; tool_choice 'none' offers nothing; streamed, the same reply whole (a call is parsed from all
    of its text)."""
    import json

    from rollout_server.tool_calls import TOOLS_PREAMBLE

    backend = FakeBackend()
    call = {"id": "c1", "type": "function", "function": {"name": "multiply", "arguments": '{"a": 2, "b": 3}'}}
    call["index"] = 0  # what the SDK's stream accumulator keeps of a streamed call, and sends back
    messages = [
        {"role": "user", "content": "2*3?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "6"},
    ]
    with TestClient(fake_app(tmp_path, backend)) as c:
        sdk = _sdk(c)
        out = sdk.chat.completions.create(model="base", messages=messages, tools=[MULTIPLY], max_tokens=3)
        described = "\n".join([TOOLS_PREAMBLE, json.dumps(MULTIPLY["function"])])
        as_written = [
            {"role": "user", "content": "2*3?"},
            {
                "role": "assistant",
                "content": '<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call>',
            },
            {"role": "tool", "content": "6"},
        ]
        assert backend.texts[-1][0] == chat_prompt_ids(
            FakeTokenizer(), [{"role": "system", "content": described}, *as_written]
        )
        assert out.choices[0].message.content == "uvw" and out.choices[0].message.tool_calls is None
        sdk.chat.completions.create(model="base", messages=messages, tools=[MULTIPLY], tool_choice="none")
        assert backend.texts[-1][0] == chat_prompt_ids(FakeTokenizer(), as_written)  # offered nothing
        streamed = list(
            sdk.chat.completions.create(
                model="base", messages=messages, tools=[MULTIPLY], stream=True, max_tokens=3
            )
        )
        assert streamed[0].choices[0].delta.role == "assistant"
        assert "".join(ch.choices[0].delta.content or "" for ch in streamed) == "uvw"
        assert streamed[-1].choices[0].finish_reason == "length"


class NativeToolsTokenizer(FakeTokenizer):
    """Characters as tokens, and a template that writes tools and an assistant's structured tool_calls
    itself, as Qwen's does (a call on lines of its own, its arguments an object)."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, tools=None, **ignored):
        import json

        text = f"<tools>{json.dumps(tools)}</tools>" if tools else ""
        for m in messages:
            calls = [
                {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                for c in m.get("tool_calls", [])
            ]
            text += f"<{m['role']}>{m['content']}" + "".join(
                f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls
            )
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))

    def encode(self, text):
        return [ord(ch) for ch in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(chr, ids))

    def __len__(self):
        return 128


def test_a_template_that_writes_tool_calls_gets_a_conversation_s_calls_structured(tmp_path):
    """A chat template with a place for calls (Qwen's, Llama 3's) gets an assistant's tool_calls as they
    are, arguments as an object, and writes them as its model reads them; SmolLM2's ChatML (the test
    above) gets them written into the content in tandem's own form."""
    from rollout_server.tool_calls import renders_tool_calls

    backend = FakeBackend()
    backend.tokenizer = NativeToolsTokenizer()
    assert renders_tool_calls(backend.tokenizer) and not renders_tool_calls(FakeTokenizer())
    call = {"id": "c1", "type": "function", "function": {"name": "multiply", "arguments": '{"a": 2, "b": 3}'}}
    messages = [
        {"role": "user", "content": "2*3?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "6"},
    ]
    with TestClient(fake_app(tmp_path, backend)) as c:
        _sdk(c).chat.completions.create(model="base", messages=messages, tools=[MULTIPLY], max_tokens=3)
    prompt = backend.tokenizer.decode(backend.texts[-1][0])
    assert prompt.endswith(
        '<user>2*3?<assistant><tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
        "<tool>6<assistant>"
    ), prompt
    assert prompt.startswith('<tools>[{"type": "function", "function": {"name": "multiply"')


def test_a_reply_s_tool_call_blocks_become_openai_tool_calls():
    import json

    from rollout_server.serving.openai_api import reply

    made = reply(
        'Let me. <tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call>', [MULTIPLY]
    )
    assert made.content == "Let me. "
    [call] = made.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
        "function",
        "multiply",
        {"a": 2, "b": 3},
    )
    assert call.id.startswith("call_")
    assert reply('<tool_call>{"name": "multiply"}</tool_call>', [MULTIPLY]).content is None
    assert reply("<tool_call>{nope</tool_call>", [MULTIPLY]).content == "<tool_call>{nope</tool_call>"  # text
    assert reply('<tool_call>{"name": "m"}</tool_call>', []).tool_calls is None  # no tools offered: text


def test_a_reply_with_a_tool_call_comes_back_as_openai_writes_it_streamed_or_not(tmp_path, monkeypatch):
    from rollout_server.serving import openai_api
    from rollout_server.serving.openai_schema import CalledFunction, ChatReply, ToolCall

    made = ChatReply(
        content=None,
        tool_calls=[ToolCall(id="call_1", function=CalledFunction(name="multiply", arguments='{"a": 2}'))],
    )
    monkeypatch.setattr(openai_api, "reply", lambda text, tools: made if tools else ChatReply(content=text))
    with TestClient(fake_app(tmp_path, FakeBackend())) as c:
        sdk = _sdk(c)
        messages = [{"role": "user", "content": "2*3?"}]
        out = sdk.chat.completions.create(model="base", messages=messages, tools=[MULTIPLY], max_tokens=3)
        [choice] = out.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert [(t.id, t.function.name, t.function.arguments) for t in choice.message.tool_calls] == [
            ("call_1", "multiply", '{"a": 2}')
        ]
        chunks = list(
            sdk.chat.completions.create(
                model="base", messages=messages, tools=[MULTIPLY], max_tokens=3, stream=True
            )
        )
        deltas = [ch.choices[0].delta for ch in chunks]
        assert deltas[0].role == "assistant" and not any(d.content for d in deltas)
        [calls] = [d.tool_calls for d in deltas if d.tool_calls]
        assert [(t.index, t.id, t.function.name, t.function.arguments) for t in calls] == [
            (0, "call_1", "multiply", '{"a": 2}')
        ]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"

"""In-flight weight updates (server.inflight_updates = "continue") on the fake engine: a publish interrupts
the samples in flight, each goes on under the new version from its prompt and the tokens it has, and every
token is stamped with the version that sampled it. The real engine: tests/test_streaming_e2e.py."""

from __future__ import annotations

import asyncio
import time

import pytest
from fastapi.testclient import TestClient

from shared.config import ConfigError, TandemConfig, load_config
from tests.fakes import FakeBackend, fake_app, tiny_adapter
from tests.rollout_server.test_app import _metric, _publish, _pull


@pytest.fixture(autouse=True)
def _no_token(monkeypatch):
    monkeypatch.delenv("TANDEM_API_TOKEN", raising=False)


def _wait(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_publish_moves_the_samples_in_flight_to_the_new_version_token_exact(tmp_path):
    backend = FakeBackend(release=asyncio.Event())  # each sample: 2 tokens, then held until released
    app = fake_app(
        tmp_path, backend, sampling={"group_size": 2, "max_new_tokens": 10},
        production="continuous", inflight_updates="continue", max_inflight_groups=1, queue_size=1,
    )  # fmt: skip
    with TestClient(app) as c:
        _wait(lambda: backend.interruptible, "the first group in the engine")
        ((prompt, n, max_tokens, v),) = backend.interruptible
        assert (n, max_tokens, v) == (2, 10, 0)  # one request of G samples under the base model
        assert _publish(c, 1, tiny_adapter(tmp_path / "a1")).status_code == 200
        # Interrupted at 2 tokens each: both go on under v1 from prompt + their 2 tokens, 8 tokens left.
        _wait(lambda: len(backend.interruptible) == 3, "the samples continued")
        assert backend.interruptible[1:] == [(prompt + [20, 20], 1, 8, 1)] * 2
        app.state.loop.call_soon_threadsafe(backend.release.set)
        (group,) = _pull(c, 1)["groups"]
        assert _metric(c, "tandem_samples_continued_total") == 2.0
    assert group["policy_version"] == 0 and group["prompt_token_ids"] == prompt  # its oldest token's
    for comp in group["completions"]:
        # v0's 2 tokens (id 20, log-prob -0.5), then v1's 4 (id 21, -0.6): one sample, token exact
        assert comp["token_ids"] == [20, 20, 21, 21, 21, 21] and comp["finish_reason"] == "stop"
        assert comp["logprobs"] == pytest.approx([-0.5, -0.5, -0.6, -0.6, -0.6, -0.6])
        assert comp["versions"] == [[0, 0], [2, 1]]


def test_without_a_publish_nothing_is_interrupted_or_stamped(tmp_path):
    backend = FakeBackend(release=asyncio.Event())
    app = fake_app(
        tmp_path, backend, sampling={"group_size": 2}, production="continuous", inflight_updates="continue",
        max_inflight_groups=1, queue_size=1,
    )  # fmt: skip
    with TestClient(app) as c:
        _wait(lambda: backend.interruptible, "the first group in the engine")
        app.state.loop.call_soon_threadsafe(backend.release.set)
        (group,) = _pull(c, 1)["groups"]
        assert _metric(c, "tandem_samples_continued_total") == 0.0
    assert len(backend.interruptible) == 1  # the group's one request, never continued
    assert [x["versions"] for x in group["completions"]] == [None, None]
    assert [x["reward"] for x in group["completions"]] == [1.0, 0.0]  # the engine's own text, scored


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["server.inflight_updates=keep"], "not built yet: use 'continue' with server.adapter_mode"),
        (["server.inflight_updates=continue", "server.production=lockstep"], "set server.production = 'c"),
        (
            ["server.inflight_updates=continue", "server.production=continuous", "server.adapter_mode=merge"],
            "merged weights hold one version at a time: set server.adapter_mode = 'lora'",
        ),
        (
            ["server.inflight_updates=continue", "server.production=continuous", "server.backend=openai",
             "server.openai.endpoints=['http://e:8000']"],
            "not built for an external engine",
        ),
        (
            ["server.inflight_updates=continue", "server.production=continuous", "env.kind=multi_turn",
             "env.step=m:f"],
            "env.kind = 'multi_turn' plays episodes, each under one version",
        ),
    ],
)  # fmt: skip
def test_each_combination_left_out_is_a_one_line_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_continue_is_accepted_where_it_is_built():
    for backend in ("vllm", "hf"):
        cfg = load_config(
            None,
            [f"server.backend={backend}", "server.production=continuous", "server.inflight_updates=continue",
             "server.adapter_mode=lora"],
        )  # fmt: skip
        assert isinstance(cfg, TandemConfig) and cfg.server.inflight_updates == "continue"


def test_the_hf_backend_ends_interrupted_samples_where_they_are_with_their_own_logprobs():
    """An interrupt already set when the generation starts: each sample stops after its first token,
    "interrupted", its sampler log-prob the model's own; without one the same call runs to max_tokens."""
    from types import SimpleNamespace

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rollout_server.engines.hf import HFBackend

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    decode = lambda ids, **_: " ".join(map(str, ids))  # noqa: E731
    # an end-of-sequence id outside the vocabulary: a sample ends only at max_tokens or an interrupt
    backend = HFBackend(model, SimpleNamespace(eos_token_id=999, pad_token_id=0, decode=decode), "cpu")
    prompt = [5, 6, 7]

    async def sample(interrupt):
        out = await backend.generate(
            [prompt], n=3, temperature=1.0, max_tokens=12, adapter=None, interrupt=interrupt
        )
        return out[0]

    newer = asyncio.Event()
    newer.set()
    for s in asyncio.run(sample(newer)):
        assert (len(s.token_ids), s.finish_reason) == (1, "interrupted")
        own = asyncio.run(backend.score(prompt, s.token_ids, None))
        assert s.logprobs == pytest.approx(own, abs=1e-5)
    for s in asyncio.run(sample(asyncio.Event())):  # never set
        assert (len(s.token_ids), s.finish_reason) == (12, "length")

"""POST /inference/v1/generate, vLLM's token-in/token-out route, on the fake engine: the wire format both
vLLM's and the `renderers` client read, versions by `model`, stop token ids, the no-op sampling values, the
errors, and the records that check a trajectory against what the engine answered. test_server_e2e.py runs
it on the real engines."""

from __future__ import annotations

from array import array

import pytest
from fastapi.testclient import TestClient

from rollout_server.serving.token_api import Record, Records, digest
from tests.fakes import FakeBackend, fake_app, tiny_adapter
from tests.rollout_server.test_app import _publish

URL = "/inference/v1/generate"


@pytest.fixture(autouse=True)
def _no_token(monkeypatch):
    monkeypatch.delenv("TANDEM_API_TOKEN", raising=False)


def test_tokens_come_back_with_their_logprobs_as_both_clients_read_them_and_are_recorded(tmp_path):
    backend = FakeBackend()
    with TestClient(fake_app(tmp_path, backend)) as c:
        assert _publish(c, 1, tiny_adapter(tmp_path / "a1")).status_code == 200
        sp = {"n": 2, "max_tokens": 8, "logprobs": 1, "stop_token_ids": [23], "skip_special_tokens": False}
        sp["routed_experts_prompt_start"] = 2  # what the verifiers client adds on a bridged turn
        r = c.post(URL, json={"model": "policy-v1", "token_ids": [5, 6, 7], "sampling_params": sp})
        assert r.status_code == 200, r.text
        body = r.json()
        assert (body["model"], body["output_mode"], body["prompt_token_ids"]) == (
            "policy-v1",
            "tokens",
            [5, 6, 7],
        )
        assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
        for i, choice in enumerate(body["choices"]):
            # the fake on v1: tokens 21, 22, 23, ...; 23 is a stop token id: it ends the choice, included
            assert (choice["index"], choice["token_ids"]) == (i, [21, 22, 23])
            assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", 23)
            first = choice["logprobs"]["content"][0]
            assert first == {
                "token_id": 21, "token": "token_id:21", "logprob": -0.5, "rank": None,
                "top_logprobs": [{"token_id": 21, "token": "token_id:21", "logprob": -0.5, "rank": 1}],
            }  # fmt: skip
            assert [e["token"] for e in choice["logprobs"]["content"]] == [
                f"token_id:{t}" for t in (21, 22, 23)
            ]
        assert backend.texts[-1][2] == 1  # sampled by version 1
        records, rid = c.app.state.server.records, body["request_id"]
        assert records.check(1, [5, 6, 7], [21, 22, 23], [-0.5] * 3, request=(rid, 1)) is None
        assert records.check(1, [5, 6, 7], [21, 22, 23], [-0.5] * 3) is None  # found by content too

        # no model: the version served; no max_tokens: what the context leaves; no logprobs: none
        r = c.post(URL, json={"token_ids": [5, 6], "sampling_params": {"temperature": 0}})
        assert r.json()["model"] == "policy-v1" and r.json()["choices"][0]["logprobs"] is None
        assert backend.texts[-1][1].max_tokens == c.app.state.server.cfg.model.max_model_len - 2


def test_the_records_check_version_prompt_every_token_and_every_logprob():
    records = Records(capacity=2)
    record = Record(3, 3, digest([1, 2, 3]), array("q", [7, 8]), array("d", [-0.25, -1.5]), "stop")
    records.add("a", 0, [1, 2, 3], record)
    by_id = {"request": ("a", 0)}
    for how in ({}, by_id):  # by request id, or by what was sent and sampled
        assert records.check(3, [1, 2, 3], [7, 8], [-0.25, -1.5], **how) is None
        assert "answered by version 3, not 2" in records.check(2, [1, 2, 3], [7, 8], [-0.25, -1.5], **how)
        assert "logprobs differ" in records.check(3, [1, 2, 3], [7, 8], [-0.25, -1.5000001], **how)
    # by id, what differs is named; by content, a changed prompt or token finds no answer at all
    assert "the prompt differs" in records.check(3, [1, 2, 4], [7, 8], [-0.25, -1.5], **by_id)
    assert "differ from the engine's (token 1)" in records.check(3, [1, 2, 3], [7, 9], [-0.25, -1.5], **by_id)
    assert "(length 3 vs 2)" in records.check(3, [1, 2, 3], [7, 8, 9], [-0.25, -1.5, 0.0], **by_id)
    assert "not sampled here, or altered" in records.check(3, [1, 2, 4], [7, 8], [-0.25, -1.5])
    assert "not sampled here, or altered" in records.check(3, [1, 2, 3], [7, 9], [-0.25, -1.5])
    assert "no record of request 'a' choice 1" in records.check(
        3, [1, 2, 3], [7, 8], [0, 0], request=("a", 1)
    )
    records.add("b", 0, [5], record)
    six = Record(3, 1, digest([6]), array("q", [7, 8]), array("d", [-0.25, -1.5]), "stop")
    records.add("c", 0, [6], six)  # the oldest goes, by id and by content
    assert "older than the newest 2" in records.check(3, [1, 2, 3], [7, 8], [-0.25, -1.5], **by_id)
    assert "not sampled here" in records.check(3, [1, 2, 3], [7, 8], [-0.25, -1.5])
    assert "a" not in records and "c" in records and len(records) == 2
    assert records.check(3, [6], [7, 8], [-0.25, -1.5]) is None


def test_the_same_reply_answered_twice_is_checked_against_each_answer():
    """Two episodes of one task can get the same reply: the engine ran each in another batch, so their
    logprobs differ in the last bits. Checked by content, a span matches when it is either answer exactly."""
    records = Records(capacity=3)
    first, second = [-0.25, -1.5], [-0.25, -1.5000000000000002]
    for name, lps in (("a", first), ("b", second)):
        records.add(
            name, 0, [1, 2], Record(3, 2, digest([1, 2]), array("q", [7, 8]), array("d", lps), "stop")
        )
    assert records.check(3, [1, 2], [7, 8], first) is None
    assert records.check(3, [1, 2], [7, 8], second) is None
    assert "logprobs differ" in records.check(3, [1, 2], [7, 8], [-0.25, -1.25])
    records.add("c", 0, [9], Record(3, 1, digest([9]), array("q", [7]), array("d", [-1.0]), "stop"))
    records.add("d", 0, [9], Record(3, 1, digest([9]), array("q", [7]), array("d", [-1.0]), "stop"))
    assert "logprobs differ" in records.check(3, [1, 2], [7, 8], first)  # "a" is gone, "b" is left
    assert records.check(3, [1, 2], [7, 8], second) is None


@pytest.mark.parametrize(
    "body, status, param, message",
    [
        ({"sampling_params": {"top_k": 50}}, 400, "sampling_params.top_k", "top_k = 50 is not supported"),
        ({"sampling_params": {"logit_bias": {"1": 2}}}, 400, "sampling_params.logit_bias", "not supported"),
        ({"sampling_params": {"temperature": 3}}, 400, "sampling_params.temperature", "less than or equal"),
        ({"model": "policy-v9"}, 404, "model", "'policy-v9' does not exist"),
        ({"token_ids": [5, 10**6]}, 400, "token_ids", "outside the vocabulary"),
        ({"sampling_params": {"max_tokens": 10**5}}, 400, "max_tokens", "model.max_model_len="),
        ({"stream": True}, 400, "stream", "Input should be False"),
        ({"sampling_params": {"n": 2000}}, 400, "sampling_params.n", "less than or equal to 128"),
    ],
)
def test_what_cannot_be_honoured_is_a_4xx_naming_the_field(tmp_path, body, status, param, message):
    with TestClient(fake_app(tmp_path, FakeBackend())) as c:
        r = c.post(URL, json={"token_ids": [5, 6], **body})
        error = r.json()["error"]
        assert (r.status_code, error["param"]) == (status, param), r.text
        assert message in error["message"]


def test_values_that_change_nothing_are_accepted_and_a_request_id_is_used_once(tmp_path):
    with TestClient(fake_app(tmp_path, FakeBackend())) as c:
        noops = {"top_k": -1, "min_p": 0, "repetition_penalty": 1.0, "seed": 7, "ignore_eos": False}
        r = c.post(
            URL, json={"token_ids": [5], "request_id": "r1", "sampling_params": noops, "cache_salt": "x"}
        )
        assert r.status_code == 200 and r.json()["request_id"] == "r1"
        again = c.post(URL, json={"token_ids": [5], "request_id": "r1"})
        assert again.status_code == 409 and "was used already" in again.json()["error"]["message"]


def test_models_say_their_context_length_for_clients_that_check_prompts_before_sending(tmp_path):
    with TestClient(fake_app(tmp_path, FakeBackend())) as c:
        limit = c.app.state.server.cfg.model.max_model_len
        assert {m["max_model_len"] for m in c.get("/v1/models").json()["data"]} == {limit}

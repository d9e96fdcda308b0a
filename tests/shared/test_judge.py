"""The LLM judge (shared/judge.py, `"judge"` in reward.functions) against a fake OpenAI-compatible endpoint
(httpx's MockTransport): the rubric it is sent, its answers read as scores (worked by hand), the cache, a
bounded number of requests in flight, retries, and every way it fails (hangs, HTTP errors, answers with no
score): the completion gets failure_score within the timeout, counted, and the other functions score."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from shared.config import ConfigError, RewardConfig
from shared.judge import JudgeFailure, read_score
from shared.rewards import RewardCall, RewardRunner, resolve

RUBRIC = "Q: {prompt}\nA: {completion}\nReference: {answer}\nIs A right? Say yes or no."
CALLS = [
    RewardCall("so #### 3", "3", "1+2?", {}),
    RewardCall("#### 4", "3", "1+2?", {}),
    RewardCall("so #### 3", "3", "1+2?", {}),  # the first again: judged once
]


def judge_cfg(**judge) -> RewardConfig:
    fields = {"url": "http://judge.test/v1", "model": "the-judge", "rubric": RUBRIC, "backoff_s": 0.01}
    return RewardConfig(functions=["gsm8k", "judge"], weights=[1.0, 0.5], judge=fields | judge)


def scored(cfg: RewardConfig, handler, calls=CALLS, **runner) -> tuple[list[dict], RewardRunner, list[tuple]]:
    failures = []
    r = RewardRunner(cfg, on_failure=lambda name, kind: failures.append((name, kind)), **runner)
    r._judge._transport = httpx.MockTransport(handler)

    async def go():
        try:
            return await r.score(calls)
        finally:
            await r.close()

    return asyncio.run(go()), r, failures


def answer(text: str, status: int = 200) -> httpx.Response:
    return httpx.Response(status, json={"choices": [{"message": {"role": "assistant", "content": text}}]})


@pytest.mark.parametrize(
    ("text", "how", "want"),
    [
        ("Yes.", "yes_no", 1.0),
        ("no, because 2 + 2 = 4", "yes_no", 0.0),
        ("I'd say 7 out of 10", "number", 0.7),  # (7 - 0) / (10 - 0)
        ("Score: 15", "number", 1.0),  # clipped to the range
        ("-3", "number", 0.0),
        ("2.5", "number", 0.25),
    ],
)
def test_an_answer_is_read_as_a_score_by_hand(text, how, want):
    assert read_score(text, how, 0.0, 10.0) == pytest.approx(want)


@pytest.mark.parametrize(("text", "how"), [("Maybe.", "yes_no"), ("nothing here", "number")])
def test_an_answer_without_a_score_is_a_bad_type(text, how):
    with pytest.raises(JudgeFailure) as e:
        read_score(text, how, 0.0, 10.0)
    assert e.value.kind == "bad_type"


def test_each_completion_is_judged_with_the_rubric_once_and_weighed_with_the_others(monkeypatch):
    monkeypatch.setenv("MY_JUDGE_KEY", "sk-test")
    asked = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        asked.append((request.url.path, request.headers.get("authorization"), body))
        return answer("yes" if "#### 3" in body["messages"][0]["content"] else "no")

    out, runner, failures = scored(judge_cfg(api_key_env="MY_JUDGE_KEY"), handler)
    assert out == [{"gsm8k": 1.0, "judge": 1.0}, {"gsm8k": 0.0, "judge": 0.0}, {"gsm8k": 1.0, "judge": 1.0}]
    assert runner.total(out[0]) == 1.5 and failures == []
    assert len(asked) == 2  # the third completion repeats the first: from the cache
    path, auth, body = asked[0]
    assert path == "/v1/chat/completions" and auth == "Bearer sk-test"
    assert body == {
        "model": "the-judge",
        "messages": [
            {"role": "user", "content": "Q: 1+2?\nA: so #### 3\nReference: 3\nIs A right? Say yes or no."}
        ],
        "max_tokens": 16,
        "temperature": 0.0,
    }


def test_self_is_the_rollout_server_with_its_own_token():
    seen = []

    def handler(request):
        seen.append((str(request.url), request.headers.get("authorization")))
        return answer("7", 200)

    cfg = judge_cfg(url="self", model="base", score="number")
    out, _, _ = scored(cfg, handler, calls=CALLS[:1], self_url="http://127.0.0.1:8000", self_token="tok")
    assert out[0]["judge"] == pytest.approx(0.7)
    assert seen == [("http://127.0.0.1:8000/v1/chat/completions", "Bearer tok")]


def test_no_more_requests_in_flight_than_max_concurrency():
    now, most = 0, 0

    async def handler(request):
        nonlocal now, most
        now += 1
        most = max(most, now)
        await asyncio.sleep(0.05)
        now -= 1
        return answer("yes")

    calls = [RewardCall(f"#### {i}", "3", "1+2?", {}) for i in range(8)]
    out, _, failures = scored(judge_cfg(max_concurrency=2), handler, calls=calls)
    assert [r["judge"] for r in out] == [1.0] * 8 and failures == []
    assert most == 2


def test_a_failed_request_is_retried_after_a_backoff():
    statuses = [500, 503, 200]

    def handler(request):
        return answer("yes", statuses.pop(0))

    out, _, failures = scored(judge_cfg(retries=2), handler, calls=CALLS[:1])
    assert out[0]["judge"] == 1.0 and failures == [] and statuses == []


@pytest.mark.parametrize(
    ("reply", "kind"),
    [
        (lambda: answer("yes", 500), "raised"),  # an HTTP error, every time
        (lambda: answer("I cannot judge this."), "bad_type"),  # no score in the answer
        (lambda: httpx.Response(200, text="not json"), "raised"),  # not what an OpenAI server sends
    ],
)
def test_a_judge_that_keeps_failing_gives_failure_score_counted(reply, kind):
    calls = []

    def handler(request):
        calls.append(1)
        return reply()

    out, runner, failures = scored(judge_cfg(retries=1, failure_score=-0.5), handler, calls=CALLS[:2])
    assert [r["judge"] for r in out] == [-0.5, -0.5] and [r["gsm8k"] for r in out] == [1.0, 0.0]
    assert failures == [("judge", kind)] * 2 and runner.failures[("judge", kind)] == 2
    assert len(calls) == 4  # each completion: the request and one retry


def test_a_judge_that_never_answers_costs_its_timeout_and_no_more():
    async def handler(request):
        await asyncio.sleep(3600)

    started = time.monotonic()
    out, _, failures = scored(judge_cfg(timeout_s=0.5), handler, calls=CALLS[:2])
    assert time.monotonic() - started < 5
    assert [r["judge"] for r in out] == [0.0, 0.0] and [r["gsm8k"] for r in out] == [1.0, 0.0]
    assert failures == [("judge", "timeout")] * 2


def test_a_judge_is_configured_in_one_line_per_mistake(monkeypatch):
    monkeypatch.delenv("NO_SUCH_KEY", raising=False)
    for judge, message in [
        ({"url": ""}, r"reward.functions names 'judge': set reward.judge.url"),
        ({"rubric": ""}, r"set reward.judge.rubric"),
        ({"rubric": "{question} {completion}"}, r"reward.judge.rubric: \{question\}: it fills"),
        ({"range": (5, 1)}, r"reward.judge.range: \[5.0, 1.0\]: the lowest must be below the highest"),
    ]:
        with pytest.raises(ValueError, match=message):
            judge_cfg(**judge)
    with pytest.raises(
        ConfigError, match="reward.functions\\[1\\]: reward.judge.api_key_env: .* NO_SUCH_KEY"
    ):
        resolve(judge_cfg(api_key_env="NO_SUCH_KEY"))
    with pytest.raises(ConfigError, match="reward.judge.url = 'self' names the rollout server"):
        RewardRunner(judge_cfg(url="self"))

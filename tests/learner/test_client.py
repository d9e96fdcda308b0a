"""The learner's client against a scripted transport: what is retried (connection failures, 502-504),
what is not (4xx), how long, and how a stop request ends the wait. A fake clock: no real sleeping."""

from __future__ import annotations

import httpx
import pytest

from learner import client as client_mod
from learner.client import Interrupted, RolloutClient, ServerError, ServerUnavailable
from shared import protocol as P

HEALTH = P.Health(
    backend="hf", model="m", policy_version=3, sleeping=False, group_size=4, queue_depth=0, leased=0
).model_dump_json()


class FakeClock:
    def __init__(self):
        self.now = 0.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(client_mod, "time", c)
    return c


def scripted(answers, **kw) -> tuple[RolloutClient, list[str], list[httpx.Request]]:
    """A client whose transport plays `answers` in order: an exception class to raise, or (status, body)."""
    answers, logs, seen = list(answers), [], []

    def handler(request: httpx.Request) -> httpx.Response:
        request.read()
        seen.append(request)
        a = answers.pop(0)
        if isinstance(a, type):
            raise a("scripted failure", request=request)
        return httpx.Response(a[0], text=a[1], headers={"content-type": "application/json"})

    c = RolloutClient("http://server", log=logs.append, **kw)
    c._http = httpx.Client(base_url="http://server", transport=httpx.MockTransport(handler))
    return c, logs, seen


def test_without_retry_a_dead_server_fails_at_once(clock):
    c, logs, seen = scripted([httpx.ConnectError])
    with pytest.raises(ServerUnavailable, match="GET /health at http://server: ConnectError"):
        c.health()
    assert len(seen) == 1 and clock.sleeps == [] and logs == []


def test_retries_with_backoff_until_the_server_is_back(clock):
    c, logs, seen = scripted(
        [httpx.ConnectError, httpx.ReadError, (502, "bad gateway"), (503, "shutting down"), (200, HEALTH)],
        retry_s=600,
    )
    assert c.health().policy_version == 3
    assert clock.sleeps == [1.0, 2.0, 4.0, 8.0] and c.retries == 4
    assert sum("retrying in" in line for line in logs) == 4
    assert logs[-1] == "rollout server back after 15 s"


def test_backoff_is_capped_and_the_retry_budget_bounds_the_wait(clock):
    c, logs, _ = scripted([httpx.ConnectError] * 100, retry_s=120)
    with pytest.raises(
        ServerUnavailable, match=r"no answer for \d+ s .*gave up after learner.server_retry_s=120"
    ):
        c.pull(2, wait_s=1)
    assert max(clock.sleeps) <= 30.0 and clock.now <= 120.0
    assert clock.sleeps[:6] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0]


def test_client_errors_are_never_retried(clock):
    c, _, seen = scripted([(409, '{"detail": "not newer"}')], retry_s=600)
    with pytest.raises(ServerError, match="HTTP 409: not newer") as e:
        c.sleep()
    assert e.value.status == 409 and len(seen) == 1


def test_a_stop_request_ends_the_wait(clock):
    stop = {"now": False}
    c, _, seen = scripted([httpx.ConnectError] * 10, retry_s=600, should_stop=lambda: stop["now"])

    def sleep(s):
        clock.now += s
        stop["now"] = len(seen) >= 3  # SIGTERM arrives during the third backoff

    clock.sleep = sleep
    with pytest.raises(Interrupted, match="stop requested while the rollout server was unreachable"):
        c.pull(1, wait_s=0)
    assert len(seen) == 4


def test_a_retried_publish_that_had_gone_through_is_not_an_error(clock, tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.safetensors").write_bytes(b"w")
    # The first upload reached the server, which died before answering; the restarted one has v3.
    c, _, seen = scripted(
        [httpx.RemoteProtocolError, (409, '{"detail": "not newer"}'), (200, HEALTH)], retry_s=60
    )
    assert c.publish(3, tmp_path).version == 3
    assert [r.url.path for r in seen] == ["/v1/adapters", "/v1/adapters", "/health"]
    for r in seen[:2]:  # the files sent again in full, not an exhausted stream
        assert b'filename="adapter_model.safetensors"' in r.content and b"\r\nw\r\n" in r.content


def test_a_first_try_409_on_publish_stays_an_error(clock, tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.safetensors").write_bytes(b"w")
    c, _, _ = scripted([(409, '{"detail": "not newer"}')], retry_s=60)
    with pytest.raises(ServerError, match="HTTP 409"):
        c.publish(3, tmp_path)

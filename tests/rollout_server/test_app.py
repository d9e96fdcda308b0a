"""The server's logic on the fake engine, in process (fast): the routes through a test client, the producer
(prompt order, cursor, a batch cancelled by sleep, unusable samples) and the policy (a version retired
while a batch still uses it). The real engines run the same paths end to end in test_server_e2e.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from fastapi.testclient import TestClient

from rollout_server.production.adapters import AdapterRejected, AdapterStore
from rollout_server.production.policy import Policy
from shared import protocol as P
from shared.datasets import Problem, chat_prompt_ids, epoch_order
from tests.fakes import PROBLEMS, FakeBackend, FakeTokenizer, fake_app, tiny_adapter
from tests.helpers import non_finite_bodies, strict_json

ORDER = epoch_order(len(PROBLEMS), 0, 0)  # the producer's prompt order in epoch 0 (data.seed 0)


@pytest.fixture(autouse=True)
def _no_token(monkeypatch):
    monkeypatch.delenv("TANDEM_API_TOKEN", raising=False)


def _pull(c: TestClient, n: int, wait_s: float = 10.0) -> dict:
    r = c.post("/v1/groups/pull", json={"max_groups": n, "wait_s": wait_s})
    assert r.status_code == 200, r.text
    return r.json()


def _publish(c: TestClient, version: int, folder) -> object:
    files = {
        P.UPLOAD_CONFIG_FIELD: (P.ADAPTER_CONFIG_FILE, (folder / P.ADAPTER_CONFIG_FILE).read_bytes()),
        P.UPLOAD_WEIGHTS_FIELD: (P.ADAPTER_WEIGHTS_FILE, (folder / P.ADAPTER_WEIGHTS_FILE).read_bytes()),
    }
    return c.post("/v1/adapters", data={P.UPLOAD_VERSION_FIELD: str(version)}, files=files)


def _metric(c: TestClient, name: str) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_pull_gives_scored_groups_in_prompt_order_and_ack_settles_the_lease(tmp_path):
    with TestClient(fake_app(tmp_path, FakeBackend())) as c:
        body = _pull(c, 2)
        assert [g["prompt_id"] for g in body["groups"]] == [PROBLEMS[i].id for i in ORDER[:2]]
        for g in body["groups"]:
            assert g["policy_version"] == 0 and len(g["completions"]) == 4
            assert [x["reward"] for x in g["completions"]] == [1.0, 0.0, 1.0, 0.0]  # "#### 3" vs "#### 4"
            q = PROBLEMS[int(g["prompt_id"].rsplit("-", 1)[1])].question
            assert g["prompt_token_ids"] == chat_prompt_ids(FakeTokenizer(), q)
        assert c.get("/health").json()["leased"] == 2
        assert c.post("/v1/groups/ack", json={"lease_id": body["lease_id"]}).json() == {"acked": 2}
        assert c.post("/v1/groups/ack", json={"lease_id": body["lease_id"]}).status_code == 404
        health = c.get("/health").json()
        assert health["leased"] == 0 and health["policy_version"] == 0 and health["group_size"] == 4
        assert _metric(c, "tandem_groups_acked") == 2.0
    events = [json.loads(line) for line in (tmp_path / "state" / "events.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds.index("lease") < kinds.index("ack")


def test_a_published_version_is_served_and_stamps_every_group_made_after_it(tmp_path):
    backend = FakeBackend()
    with TestClient(fake_app(tmp_path, backend, queue_size=4)) as c:
        _pull(c, 2)
        r = _publish(c, 1, tiny_adapter(tmp_path / "a1"))
        assert r.status_code == 200 and r.json() == {"version": 1, "name": P.adapter_name(1)}
        assert c.get("/health").json()["policy_version"] == 1 and backend.loaded == [1]
        assert _metric(c, "tandem_policy_version") == 1.0
        versions = []
        for _ in range(10):  # what was queued before the publish, then groups of v1
            versions += [g["policy_version"] for g in _pull(c, 2)["groups"]]
            if versions[-1] == 1:
                break
        assert versions == sorted(versions) and versions[-1] == 1  # never a v0 group after a v1 one
        assert backend.adapters[-1] == 1
        again = _publish(c, 1, tiny_adapter(tmp_path / "a1"))
        assert again.status_code == 409 and "versions only move forward" in again.json()["detail"]
        wrong = c.post("/v1/adapters", data={"version": "2"}, files={"weights": ("x", b"x")})
        assert wrong.status_code == 422  # the protocol's field names, or nothing


def test_sleep_stops_production_and_evaluation_until_wake(tmp_path):
    with TestClient(fake_app(tmp_path, FakeBackend())) as c:
        _pull(c, 2)
        assert c.post("/v1/sleep").json() == {"sleeping": True}
        assert c.get("/health").json()["sleeping"] and _metric(c, "tandem_sleeping") == 1.0
        while c.get("/health").json()["queue_depth"]:  # drain what was made before the sleep
            _pull(c, 4, wait_s=0.1)
        t0 = time.monotonic()
        assert _pull(c, 2, wait_s=30)["groups"] == []  # asleep with nothing queued: answered at once
        assert time.monotonic() - t0 < 5
        r = c.post("/v1/generate", json={"prompts": ["What is 1 + 1?"]})
        assert r.status_code == 409 and "asleep" in r.json()["detail"]
        assert c.post("/v1/wake").json() == {"sleeping": False} and _metric(c, "tandem_sleeping") == 0.0
        assert len(_pull(c, 2)["groups"]) == 2


def test_a_batch_cancelled_by_sleep_is_made_again_and_the_cursor_moves_only_on_success(tmp_path):
    release = asyncio.Event()
    backend = FakeBackend(release=release)
    app = fake_app(tmp_path, backend)
    cursor = tmp_path / "state" / "cursor.json"
    with TestClient(app) as c:
        deadline = time.monotonic() + 10
        while not backend.calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert backend.calls == [(2, 4)]  # the first batch is in the engine, held there
        c.post("/v1/sleep")  # cancels it: its prompts are not consumed
        assert not cursor.exists()
        c.post("/v1/wake")
        app.state.loop.call_soon_threadsafe(release.set)
        body = _pull(c, 2)
        assert [g["prompt_id"] for g in body["groups"]] == [PROBLEMS[i].id for i in ORDER[:2]]
    saved = json.loads(cursor.read_text())
    assert saved["epoch"] * len(PROBLEMS) + saved["position"] >= 2  # at least the batch that came through
    assert len(backend.calls) >= 2 and backend.calls[1] == (2, 4)


@pytest.mark.parametrize("kind", ["empty", "nan"])
def test_a_group_with_an_unusable_sample_is_dropped_and_counted(tmp_path, kind):
    first = chat_prompt_ids(FakeTokenizer(), PROBLEMS[ORDER[0]].question)
    with TestClient(fake_app(tmp_path, FakeBackend(unusable=(first, kind)))) as c:
        groups = _pull(c, 3)["groups"]
        assert PROBLEMS[ORDER[0]].id not in [g["prompt_id"] for g in groups]
        assert [g["prompt_id"] for g in groups][:1] == [PROBLEMS[ORDER[1]].id]
        assert _metric(c, "tandem_groups_invalid_total") >= 1.0


def test_a_retired_version_is_unloaded_only_when_the_last_batch_using_it_ends(tmp_path):
    async def scenario():
        backend = FakeBackend()
        policy = Policy(backend, AdapterStore(tmp_path / "adapters"))
        files = tiny_adapter(tmp_path / "src")

        def write(v):
            return policy.store.write(
                v, (files / P.ADAPTER_CONFIG_FILE).read_bytes(), (files / P.ADAPTER_WEIGHTS_FILE).read_bytes()
            )

        await policy.publish(1, write)
        in_use = policy.acquire()  # a batch generating on v1
        await policy.publish(2, write)
        assert policy.version == 2 and backend.unloaded == []  # v1 stays loaded under the batch
        fresh = policy.acquire()
        await policy.release(fresh)
        assert backend.unloaded == []  # releasing v2 does not touch v1
        await policy.release(in_use)
        assert backend.unloaded == [1]
        await policy.publish(3, write)  # nothing uses v2: unloaded at once
        assert backend.unloaded == [1, 2] and backend.loaded == [1, 2, 3]

    asyncio.run(scenario())


def test_an_engine_call_refused_for_a_shutdown_is_a_503_to_retry_not_a_500(tmp_path):
    """The soak sent POST /v1/sleep as the server took SIGTERM: vLLM refused ("Server shutting down"),
    the route answered 500 and the learner stopped for good."""
    backend = FakeBackend()

    async def refused(*args, **kwargs):
        raise Exception("Server shutting down")

    with TestClient(fake_app(tmp_path, backend), raise_server_exceptions=False) as c:
        backend.sleep = backend.wake = refused
        c.app.state.server.shutting_down = True
        r = c.post("/v1/sleep")
        assert r.status_code == 503 and "shutting down" in r.json()["detail"]
        c.app.state.server.shutting_down = False
        assert c.post("/v1/wake").status_code == 500  # not shutting down: a real failure stays one


def test_a_pull_retried_with_its_request_id_gets_the_same_lease(tmp_path):
    with TestClient(fake_app(tmp_path, FakeBackend())) as c:
        body = {"max_groups": 2, "wait_s": 10, "request_id": "learner-7f3a"}
        first = c.post("/v1/groups/pull", json=body).json()
        second = c.post("/v1/groups/pull", json=body).json()
        assert second == first and len(first["groups"]) == 2
        assert c.get("/health").json()["leased"] == 2
        other = c.post("/v1/groups/pull", json={**body, "request_id": "learner-8b01"}).json()
        assert other["lease_id"] != first["lease_id"]
        bad = c.post("/v1/groups/pull", json={**body, "request_id": "../x y"})
        assert bad.status_code == 422 and "request_id" in bad.text

        # released by the pull's id (its learner was killed before it recorded the lease id): once
        assert c.post("/v1/groups/release", json={"request_id": "learner-7f3a"}).json() == {"released": 2}
        assert c.post("/v1/groups/release", json={"request_id": "learner-7f3a"}).json() == {"released": 0}
        assert c.post("/v1/groups/release", json={"request_id": "never-sent"}).json() == {"released": 0}
        assert c.get("/health").json()["leased"] == 2  # the other pull's
        both = c.post("/v1/groups/release", json={"request_id": "a", "lease_id": other["lease_id"]})
        assert both.status_code == 422 and "either lease_id or request_id" in both.text


def test_stored_versions_are_kept_within_keep_versions_except_every_kth_and_those_in_use(tmp_path):
    """The disk does not grow by an adapter a step: the newest `keep`, every `keep_every`-th, and any
    version a batch still generates on stay; an evaluation of a deleted one gets a 404 that says why."""

    async def scenario():
        policy = Policy(FakeBackend(), AdapterStore(tmp_path / "adapters"), keep=3, keep_every=5)
        files = tiny_adapter(tmp_path / "src")

        def write(v):
            return policy.store.write(
                v, (files / P.ADAPTER_CONFIG_FILE).read_bytes(), (files / P.ADAPTER_WEIGHTS_FILE).read_bytes()
            )

        await policy.publish(1, write)
        in_use = policy.acquire()  # a batch generating on v1 through everything below
        for v in range(2, 13):
            await policy.publish(v, write)
        assert policy.store.versions() == [1, 5, 10, 11, 12]
        await policy.release(in_use)
        await policy.publish(13, write)
        assert policy.store.versions() == [5, 10, 11, 12, 13]
        assert policy.lookup(10).version == 10
        with pytest.raises(AdapterRejected) as e:
            policy.lookup(7)
        assert e.value.status == 404
        assert "no longer stored here (server.keep_versions: the newest 3 and every 5-th)" in str(e.value)

    asyncio.run(scenario())


BAD_REWARDS = """
import math, time

def raises(completion, answer, prompt, metadata):
    raise RuntimeError("a bug in the user's reward")

def hangs(completion, answer, prompt, metadata):
    time.sleep(3600)

def nan(completion, answer, prompt, metadata):
    return math.nan

def text(completion, answer, prompt, metadata):
    return "0.5"
"""


def test_bad_reward_functions_give_zero_are_counted_and_the_groups_still_flow(tmp_path, monkeypatch):
    (tmp_path / "bad_rewards.py").write_text(BAD_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    bad = ["raises", "hangs", "nan", "text"]
    reward = {
        "functions": ["gsm8k", *(f"bad_rewards:{n}" for n in bad)],
        "weights": [2.0, 1.0, 1.0, 1.0, 1.0],
        "timeout_s": 1.0,
        "workers": 4,
    }
    with TestClient(fake_app(tmp_path, FakeBackend(), reward=reward, queue_size=2)) as c:
        body = _pull(c, 2, wait_s=60)
        assert len(body["groups"]) == 2
        for g in body["groups"]:
            for i, x in enumerate(g["completions"]):
                right = 1.0 if i % 2 == 0 else 0.0  # "#### 3" vs "#### 4"
                assert x["rewards"] == {"gsm8k": right, **{n: 0.0 for n in bad}}
                assert x["reward"] == 2.0 * right
        assert c.post("/v1/groups/ack", json={"lease_id": body["lease_id"]}).json() == {"acked": 2}
        assert _pull(c, 2, wait_s=60)["groups"]  # still producing
        assert c.get("/health").status_code == 200
        kinds = {"raises": "raised", "hangs": "timeout", "nan": "non_finite", "text": "bad_type"}
        for name, kind in kinds.items():
            label = f'tandem_reward_failures_total{{function="{name}",kind="{kind}"}}'
            assert _metric(c, label) >= 16.0  # 2 batches x 2 groups x G = 4, each call failed
        assert _metric(c, 'tandem_reward_function_sum{function="gsm8k"}') >= 8.0


@pytest.mark.parametrize("truncated, want", [("score", [1.0, 0.0, 1.0, 0.0]), ("zero", [1.0, 0.0, 0.0, 0.0])])
def test_truncated_completions_score_or_get_zero(tmp_path, truncated, want):
    """Sample 2 of every group says "#### 3", right, but was stopped at max_tokens."""
    app = fake_app(tmp_path, FakeBackend(cut=2), reward={"truncated": truncated})
    with TestClient(app) as c:
        for g in _pull(c, 2)["groups"]:
            assert [x["finish_reason"] for x in g["completions"]] == ["stop", "stop", "length", "stop"]
            assert [x["reward"] for x in g["completions"]] == want
            assert [x["rewards"]["gsm8k"] for x in g["completions"]] == want


def test_length_shaping_adds_its_parts_to_each_completion_s_reward(tmp_path):
    """Every fake completion is 1 token under a cap of 4 (sampling.max_new_tokens): with an overlong
    buffer of all 4 tokens its penalty is -0.5 * 1/4, the linear one -0.5 * 1/4; "#### 3" is right (1)."""
    reward = {"overlong_buffer": 4, "overlong_penalty": 0.5, "length_penalty": 0.5}
    app = fake_app(tmp_path, FakeBackend(), reward=reward, sampling={"max_new_tokens": 4})
    with TestClient(app) as c:
        for g in _pull(c, 2)["groups"]:
            for x in g["completions"]:
                right = 1.0 if x["text"] == "#### 3" else 0.0
                assert x["rewards"] == {"gsm8k": right, "overlong_penalty": -0.125, "length_penalty": -0.125}
                assert x["reward"] == pytest.approx(right - 0.25)


def test_non_finite_numbers_in_any_json_body_get_a_4xx_in_json_never_a_500(tmp_path):
    # Python's JSON reader takes NaN and Infinity; FastAPI's validation error echoed them back and could
    # not encode its own answer (500). Every JSON route of the schema, every numeric field, each constant.
    with TestClient(fake_app(tmp_path, FakeBackend()), raise_server_exceptions=False) as c:
        bodies = non_finite_bodies(c.get("/openapi.json").json())
        for path, raw in bodies:
            r = c.post(path, content=raw, headers={"content-type": "application/json"})
            assert 400 <= r.status_code < 500, (path, raw, r.status_code, r.text)
            strict_json(r.text)  # the answer itself is JSON
        r = c.post("/v1/groups/pull", content='{"max_groups": 1, "wait_s": Infinity}')
        assert r.status_code == 422 and "wait_s" in r.text, r.text
        r = c.post("/v1/generate", content='{"prompts": ["1+1"], "temperature": NaN}')
        assert r.status_code == 422 and "temperature" in r.text, r.text  # refused, not sampled with
        assert c.get("/health").status_code == 200
    assert len(bodies) >= 30  # pull, generate, score, the OpenAI routes: a schema that lost them fails here


def test_an_environment_that_fails_every_episode_stops_the_server_with_the_reason(tmp_path, monkeypatch):
    """env.kind = "verifiers": batches in which every episode failed are trained as zeros at first, but
    FAILING_BATCHES of them in a row stop the server (503, then exit 1) with the environment's reason; one
    good episode in a batch resets the count."""
    from rollout_server.environments.verifiers_runner import Played
    from rollout_server.production.producer import FAILING_BATCHES
    from rollout_server.serving import app as app_module

    def episode(failed):
        return Played([1, 2], [3], [1], [-0.5], "stop", "3", {"correct": 1.0}, 1.0, failed)

    class Runner:
        """Batch by batch: one good episode in the second batch, then nothing but failures."""

        def __init__(self, *args):
            self.batches = 0

        async def play(self, task_index, n, version):
            self.batches += 0.5  # two prompts a batch
            good = self.batches == 1.5  # the second batch's first task
            return [episode(None if good and i == 0 else "HarnessError: no tool server") for i in range(n)]

        async def close(self): ...

    monkeypatch.setattr(app_module, "VerifiersRunner", Runner)
    problems = [Problem(f"t-{i}", f"task {i}", "", metadata={"verifiers_task": i}) for i in range(20)]
    fatal = []
    app = fake_app(
        tmp_path,
        FakeBackend(),
        on_fatal=lambda: fatal.append(1),
        problems=problems,
        env={"kind": "verifiers", "verifiers": {"taskset": {"id": "t"}}},
        queue_size=20,
    )
    with TestClient(app) as c:
        deadline = time.monotonic() + 30
        while not fatal and time.monotonic() < deadline:
            time.sleep(0.05)
        r = c.get("/health")
        assert fatal and r.status_code == 503
        assert f"every episode of the last {FAILING_BATCHES} batches failed" in r.text
        assert "HarnessError: no tool server" in r.text
        # the batch with a good episode reset the count: 1 + 1 + FAILING_BATCHES batches were played
        queued = c.app.state.server.queue.depth
        assert queued == 2 * (2 + FAILING_BATCHES - 1)


def test_paused_production_queues_the_batch_in_flight_starts_no_other_and_resumes(tmp_path, monkeypatch):
    release = asyncio.Event()
    backend = FakeBackend(release=release)
    app = fake_app(tmp_path, backend)
    with TestClient(app) as c:
        deadline = time.monotonic() + 10
        while not backend.calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert backend.calls == [(2, 4)]  # the first batch is in the engine, held there
        answer = {}
        pausing = threading.Thread(target=lambda: answer.update(c.post("/v1/production/pause").json()))
        pausing.start()
        deadline = time.monotonic() + 10
        while not c.get("/health").json()["paused"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        pausing.join(timeout=0.3)
        assert pausing.is_alive()  # answered only once the batch in flight is queued
        app.state.loop.call_soon_threadsafe(release.set)
        pausing.join(timeout=10)
        assert answer == {"paused": True} and c.get("/health").json()["queue_depth"] == 2
        body = _pull(c, 4)  # the batch in flight finished and was queued, not thrown away
        assert [g["prompt_id"] for g in body["groups"]] == [PROBLEMS[i].id for i in ORDER[:2]]
        assert body["paused"]
        # Unpaused, the fake engine fills the queue in milliseconds; paused, nothing more is asked of it.
        empty = _pull(c, 4, wait_s=0.5)
        assert empty["groups"] == [] and empty["lease_id"] is None and empty["paused"]
        assert backend.calls == [(2, 4)]
        assert c.post("/v1/production/pause").json() == {"paused": True}  # idempotent
        assert c.post("/v1/production/resume").json() == {"paused": False}
        after = _pull(c, 2)
        assert [g["prompt_id"] for g in after["groups"]] == [PROBLEMS[i].id for i in ORDER[2:4]]
        assert not after["paused"] and not c.get("/health").json()["paused"]
        lines = (tmp_path / "state" / "events.jsonl").read_text().splitlines()
        events = [json.loads(x)["event"] for x in lines]
        assert events.count("pause") == 1 and events.count("resume") == 1
    # Token-protected like every POST.
    monkeypatch.setenv("TANDEM_API_TOKEN", "s3cret")
    with TestClient(fake_app(tmp_path / "b", FakeBackend())) as c:
        for path in ("/v1/production/pause", "/v1/production/resume"):
            assert c.post(path).status_code == 401
        assert c.post("/v1/production/pause", headers={"Authorization": "Bearer s3cret"}).json()["paused"]


def test_a_pull_whose_puller_is_gone_leases_nothing(tmp_path):
    """A learner killed while its pull waits: its connection closes, and the groups that come later are
    not leased to it (they held queue slots for server.lease_s before)."""
    from rollout_server.serving.app import _pull_while_connected

    backend = FakeBackend(release=asyncio.Event())
    app = fake_app(tmp_path, backend)

    class Gone:
        """A request whose client disconnects when `closed` is set."""

        def __init__(self):
            self.closed = asyncio.Event()

        async def receive(self):
            await self.closed.wait()
            return {"type": "http.disconnect"}

    async def body(s):
        req = P.PullRequest(max_groups=2, wait_s=30, request_id="dead-learner")
        gone = Gone()
        pulling = asyncio.ensure_future(_pull_while_connected(s, req, 30, gone))
        await asyncio.sleep(0.2)
        assert not pulling.done()  # waiting for groups
        gone.closed.set()
        assert await asyncio.wait_for(pulling, 5) == (None, [])
        backend.release.set()  # now the groups come
        while s.queue.depth < 2:
            await asyncio.sleep(0.01)
        assert s.queue.leased == 0 and s.queue.lease_of("dead-learner") is None

        # Leased just as the connection closed: given back at once.
        gone = Gone()
        gone.closed.set()
        assert await _pull_while_connected(s, req.model_copy(update={"request_id": "x"}), 30, gone) == (
            None,
            [],
        )
        assert s.queue.leased == 0 and s.queue.depth >= 2

    with TestClient(app):
        s = app.state.server
        asyncio.run_coroutine_threadsafe(body(s), app.state.loop).result(timeout=30)


def test_a_release_by_request_id_also_stops_the_pull_still_waiting_under_it(tmp_path):
    backend = FakeBackend(release=asyncio.Event())
    app = fake_app(tmp_path, backend)
    with TestClient(app) as c:
        answer = {}
        body = {"max_groups": 2, "wait_s": 30, "request_id": "learner-dead"}
        waiting = threading.Thread(target=lambda: answer.update(c.post("/v1/groups/pull", json=body).json()))
        waiting.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        # the restarted learner releases its predecessor's pull, which has no lease yet
        assert c.post("/v1/groups/release", json={"request_id": "learner-dead"}).json() == {"released": 0}
        waiting.join(timeout=10)
        assert answer["lease_id"] is None and answer["groups"] == []
        assert time.monotonic() - t0 < 3  # ended within a second or so, not at its 30 s
        app.state.loop.call_soon_threadsafe(backend.release.set)
        while c.get("/health").json()["queue_depth"] < 2:
            time.sleep(0.01)
        again = c.post("/v1/groups/pull", json={**body, "wait_s": 0}).json()  # a late retry of it
        assert again["groups"] == [] and c.get("/health").json()["leased"] == 0


def test_negative_rewards_are_summed_not_refused(tmp_path):
    """A length penalty makes rewards negative: the reward sum goes down (a Prometheus counter, which it
    once was, raised instead and stopped production)."""
    app = fake_app(tmp_path, FakeBackend(), sampling={"max_new_tokens": 2}, reward={"length_penalty": 5.0})
    with TestClient(app) as c:
        (group,) = _pull(c, 1)["groups"]
        # each completion is 1 of 2 tokens: 5 x 1/2 = 2.5 off its 1 or 0: -1.5, -2.5, -1.5, -2.5
        assert [x["reward"] for x in group["completions"]] == [-1.5, -2.5, -1.5, -2.5]
        c.post("/v1/production/pause")
        produced = _metric(c, "tandem_groups_produced_total")
        assert _metric(c, "tandem_reward_sum") == -8.0 * produced

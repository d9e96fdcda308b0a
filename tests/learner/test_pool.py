"""The learner's pool of rollout servers (learner.server_urls) against in-memory servers (fast): pulls go
to every server, leases back to the one that issued them, a dead server is skipped and, when it is back,
brought to the current version before it is pulled from; the run stops only when none answers."""

from __future__ import annotations

import time

import pytest

from learner.client import Interrupted, ServerError, ServerUnavailable
from learner.pool import ServerPool
from shared import protocol as P
from tests.learner.test_collect import _group


class FakeServer:
    """A rollout server's client-side interface, in memory: `groups` waiting, `down` to refuse."""

    def __init__(self, name: str, groups: int = 0, version: int = 0):
        self.url, self.name = f"http://{name}", name
        self.queue = [_group(f"{name}-{i}", version, [1.0, 0.0]) for i in range(groups)]
        self.version, self.sleeping, self.down = version, False, False
        self.leases: dict[str, list] = {}
        self.requests: dict[str | None, str] = {}  # request id -> lease
        self.acked, self.released, self.published, self.calls = [], [], [], []

    def _check(self, what: str):
        self.calls.append(what)
        if self.down:
            raise ServerUnavailable(f"{what} at {self.url}: ConnectError")

    def wait_ready(self, timeout_s, log=print):
        self._check("health")
        return self.health()

    def health(self):
        self._check("health")
        return P.Health(backend="fake", model="m", policy_version=self.version, sleeping=self.sleeping,
                        group_size=2, queue_depth=len(self.queue), leased=0)  # fmt: skip

    def pull(self, max_groups, wait_s, request_id=None):
        self._check("pull")
        if not self.queue:
            return P.PullResponse(lease_id=None, lease_s=0.0, groups=[])
        got, self.queue = self.queue[:max_groups], self.queue[max_groups:]
        lease = f"L{len(self.leases)}"
        self.leases[lease] = got
        self.requests[request_id] = lease
        return P.PullResponse(lease_id=lease, lease_s=60.0, groups=got)

    def ack(self, lease_id):
        self._check("ack")
        self.acked.append(lease_id)
        return P.AckResponse(acked=len(self.leases.get(lease_id, [])))

    def release(self, lease_id):
        self._check("release")
        self.released.append(lease_id)
        return P.ReleaseResponse(released=1)

    def release_pull(self, request_id):
        self._check("release")
        lease = self.requests.pop(request_id, None)
        self.released += [lease] if lease else []
        return P.ReleaseResponse(released=len(self.leases.get(lease, [])))

    def publish(self, version, folder):
        self._check("publish")
        if version <= self.version:  # as the real server: versions only move forward
            raise ServerError(f"adapter version {version} is not newer than the served version", 409)
        self.published.append(version)
        self.version = version
        return P.AdapterPublished(version=version, name=P.adapter_name(version))

    def sleep(self):
        self._check("sleep")
        self.sleeping = True
        return P.SleepState(sleeping=True)

    def wake(self):
        self._check("wake")
        self.sleeping = False
        return P.SleepState(sleeping=False)

    def close(self): ...


def _pool(*servers, retry_s=30.0, probe_s=0.0, should_stop=lambda: False):
    logs = []
    pool = ServerPool(list(servers), retry_s, probe_s, logs.append, should_stop)
    pool.wait_ready(1.0, log=logs.append)
    return pool, logs


def test_pulls_come_from_every_server_and_leases_go_back_to_their_own():
    a, b = FakeServer("a", groups=4), FakeServer("b", groups=4)
    pool, _ = _pool(a, b)
    leases = [pool.pull(1, wait_s=0.1) for _ in range(6)]
    names = [r.groups[0].group_id.split("-")[0] for r in leases]
    assert sorted(names) == ["a"] * 3 + ["b"] * 3  # in turn, not all from the first
    for r in leases:
        pool.ack(r.lease_id)
    assert sorted(a.acked) == ["L0", "L1", "L2"] and sorted(b.acked) == ["L0", "L1", "L2"]
    # with one server empty, the other's groups come without waiting on the empty one
    b.queue = []
    t = time.monotonic()
    assert [pool.pull(1, wait_s=5).groups[0].group_id[0] for _ in range(1)] == ["a"]
    assert time.monotonic() - t < 0.5
    pool.release(leases[0].lease_id)
    assert (a.released or b.released) == ["L0"]
    # a pull's lease found by the pull's id, whichever server answered it (the others have none)
    a.queue.append(_group("a-9", 0, [1.0, 0.0]))
    got = pool.pull(1, wait_s=0.1, request_id="r9")
    assert pool.release_pull("r9").released == 1 and got.lease_id.endswith(a.released[-1])
    assert pool.metrics()["server/0/groups"] + pool.metrics()["server/1/groups"] == 8


def test_a_dead_server_is_skipped_and_brought_to_the_current_version_when_back():
    a, b = FakeServer("a", groups=10), FakeServer("b", groups=10)
    pool, logs = _pool(a, b)
    held = pool.pull(1, wait_s=0.1)
    holder = a if held.groups[0].group_id.startswith("a") else b
    other = b if holder is a else a
    holder.down = True
    # publish, sleep, wake and pulls go on with the other server alone
    pool.sleep()
    pool.publish(1, "/tmp/v1")
    pool.wake()
    assert other.published == [1] and holder.published == []
    assert all(pool.pull(1, wait_s=0.1).groups[0].group_id.startswith(other.name) for _ in range(3))
    assert pool.ack(held.lease_id).acked == 0  # kept for the holder's return
    assert any("is down" in line for line in logs)
    pool.publish(2, "/tmp/v2")
    # back, having restarted with an older adapter: acks it missed, then v2, then awake like the others
    holder.down, holder.version, holder.sleeping = False, 0, True
    back = len(holder.calls)
    pulled = [pool.pull(1, wait_s=0.1) for _ in range(2)]
    assert holder.published == [2] and holder.acked == [held.lease_id.split("@")[1]] and not holder.sleeping
    since = holder.calls[back:]
    assert since.index("ack") < since.index("publish") < since.index("wake") < since.index("pull")
    assert {r.groups[0].group_id[0] for r in pulled} == {"a", "b"}
    assert any("brought from v0 to v2" in line for line in logs)
    m = pool.metrics()
    assert m[f"server/{holder is b:d}/failures"] >= 1 and m[f"server/{holder is b:d}/version"] == 2


def test_the_run_stops_only_when_no_server_answers_for_server_retry_s():
    a, b = FakeServer("a", groups=2), FakeServer("b", groups=2)
    pool, _ = _pool(a, b, retry_s=1.5)
    a.down = True
    assert pool.pull(1, wait_s=0.1).groups  # one is enough
    b.down = True
    with pytest.raises(ServerUnavailable, match="server_retry_s"):
        pool.pull(1, wait_s=0.1)
    stop = [False]
    pool, _ = _pool(FakeServer("c"), FakeServer("d"), retry_s=60, should_stop=lambda: stop[0])
    for m in pool.members:
        m.client.down = True
    stop[0] = True
    with pytest.raises(Interrupted):
        pool.publish(1, "/tmp/v1")


def test_start_needs_one_server_and_a_server_with_another_group_size_is_refused():
    a, b = FakeServer("a"), FakeServer("b")
    b.down = True
    pool, logs = _pool(a, b)
    assert any("not answering yet" in line for line in logs)
    b.down = False
    b.health = lambda: P.Health(backend="f", model="m", policy_version=0, sleeping=False, group_size=8,
                                queue_depth=0, leased=0)  # fmt: skip
    b.wait_ready = lambda timeout_s, log=print: b.health()
    with pytest.raises(Exception, match="group_size=8"):
        pool.pull(1, wait_s=0.1)


def test_a_server_back_during_a_publish_gets_that_version_once():
    """The publish itself finds the server back and catches it up to the version being published: the
    publish does not send it again (the server would refuse a version it already serves)."""
    a, b = FakeServer("a", groups=2), FakeServer("b", groups=2)
    pool, logs = _pool(a, b)
    b.down = True
    pool.publish(1, "/tmp/v1")
    b.down = False
    pool.publish(2, "/tmp/v2")
    assert a.published == [1, 2] and b.published == [2]
    assert any("brought from v0 to v2" in line for line in logs)


def test_the_single_client_and_the_pool_both_answer_everything_the_learner_asks():
    """learner.servers.Servers is the one face the loop talks to: each method, with its parameters."""
    import inspect

    from learner.client import RolloutClient
    from learner.servers import Servers

    wanted = {n: inspect.signature(f) for n, f in vars(Servers).items() if not n.startswith("_")}
    assert {"pull", "ack", "release", "release_pull", "publish", "sleep", "wake"} <= set(wanted)
    for cls in (RolloutClient, ServerPool):
        for name, sig in wanted.items():
            have = inspect.signature(getattr(cls, name))
            assert list(have.parameters) == list(sig.parameters), f"{cls.__name__}.{name}{have} is not {sig}"
    pool, _ = _pool(FakeServer("a"))
    assert isinstance(pool.retry_s, float) and isinstance(RolloutClient("http://x").retry_s, float)

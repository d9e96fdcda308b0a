"""Lease semantics of the queue, with a fake clock (no engine)."""

import asyncio

import pytest

from rollout_server.queue import LeaseError, LeaseQueue
from shared.protocol import Completion, ScoredGroup


def _group(i: int) -> ScoredGroup:
    c = Completion(token_ids=[1], logprobs=[-1.0], text="x", reward=float(i % 2), finish_reason="stop")
    return ScoredGroup(
        group_id=f"g{i}",
        prompt_id=f"p{i}",
        prompt_token_ids=[1],
        answer="1",
        policy_version=0,
        completions=[c, c],
    )


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def run(coro):
    return asyncio.run(coro)


def test_pull_ack_and_expiry():
    async def body():
        clock = Clock()
        q = LeaseQueue(capacity=10, lease_s=5.0, clock=clock)
        await q.put([_group(i) for i in range(4)])
        lease_a, a = await q.pull(2, wait_s=0)
        lease_b, b = await q.pull(2, wait_s=0)
        assert [g.group_id for g in a] == ["g0", "g1"] and [g.group_id for g in b] == ["g2", "g3"]
        # Leased groups leave room: a learner holding a lease may need more groups to fill its batch.
        assert (q.depth, q.leased, q.space()) == (0, 4, 10)
        assert await q.ack(lease_a) == 2
        clock.t = 5.0  # lease b expires: its groups return to the front, in order
        assert q.expire() == 2 and q.expired_total == 2
        lease_c, c = await q.pull(1, wait_s=0)
        assert [g.group_id for g in c] == ["g2"]
        with pytest.raises(LeaseError) as e:
            await q.ack(lease_b)  # g2 was handed out again
        assert e.value.status == 409
        with pytest.raises(LeaseError) as e:
            await q.ack("never-issued")
        assert e.value.status == 404
        assert await q.ack(lease_c) == 1
        assert q.acked_total == 3 and [g.group_id for g in q._ready] == ["g3"]

    run(body())


def test_late_ack_of_an_expired_lease_still_removes_its_groups():
    async def body():
        clock = Clock()
        q = LeaseQueue(capacity=10, lease_s=5.0, clock=clock)
        await q.put([_group(0), _group(1)])
        lease, _ = await q.pull(2, wait_s=0)
        clock.t = 6.0
        q.expire()
        assert q.depth == 2
        assert await q.ack(lease) == 2  # slow learner, not a dead one: nothing is trained twice
        assert q.depth == 0
        assert (await q.pull(5, wait_s=0)) == (None, [])

    run(body())


def test_concurrent_pullers_get_disjoint_groups():
    async def body():
        q = LeaseQueue(capacity=100, lease_s=60.0)
        pulls = [asyncio.create_task(q.pull(3, wait_s=2.0)) for _ in range(5)]
        await asyncio.sleep(0.05)
        await q.put([_group(i) for i in range(12)])
        results = await asyncio.gather(*pulls)
        ids = [g.group_id for _, groups in results for g in groups]
        assert sorted(ids) == sorted(f"g{i}" for i in range(12))  # each exactly once
        assert len({lease for lease, _ in results if lease}) == 4  # 12 groups / 3 per pull

    run(body())


def test_pull_waits_then_returns_empty():
    async def body():
        q = LeaseQueue(capacity=4, lease_s=60.0)
        assert await q.pull(1, wait_s=0.2) == (None, [])

    run(body())


def test_release_returns_groups_to_the_front_at_once():
    async def body():
        clock = Clock()
        q = LeaseQueue(capacity=10, lease_s=60.0, clock=clock)
        await q.put([_group(i) for i in range(3)])
        lease, _ = await q.pull(2, wait_s=0)
        assert await q.release(lease) == 2  # no waiting for the 60 s expiry
        assert [g.group_id for g in q._ready] == ["g0", "g1", "g2"]
        with pytest.raises(LeaseError) as e:
            await q.ack(lease)  # released leases cannot be acked any more
        assert e.value.status == 404
        lease2, _ = await q.pull(1, wait_s=0)
        clock.t = 61.0
        assert await q.release(lease2) == 0  # already back by expiry: nothing to do, no error
        with pytest.raises(LeaseError):
            await q.release("never-issued")

    run(body())


def test_a_queue_given_back_after_a_restart_keeps_its_order_and_its_leases():
    async def body():
        clock = Clock()
        old = LeaseQueue(capacity=10, lease_s=5.0, clock=clock)
        await old.put([_group(i) for i in range(5)])
        lease_id, _ = await old.pull(2, wait_s=0)
        clock.t = 4.0  # one second of the lease left when the server stops
        ready, leases = old.contents()
        assert [g.group_id for g in ready] == ["g2", "g3", "g4"]
        assert {k: [g.group_id for g in v] for k, v in leases.items()} == {lease_id: ["g0", "g1"]}

        new = LeaseQueue(capacity=10, lease_s=5.0, clock=clock)
        await new.put([_group(9)])  # made by the new server before it took the old queue back
        new.restore(ready, leases)
        assert [g.group_id for g in new.contents()[0]] == ["g2", "g3", "g4", "g9"]
        clock.t = 8.0  # past the old deadline, within a fresh lease_s
        assert new.expire() == 0
        assert await new.ack(lease_id) == 2  # the learner that held it acks as if nothing happened
        clock.t = 20.0
        _, got = await new.pull(10, wait_s=0)
        assert [g.group_id for g in got] == ["g2", "g3", "g4", "g9"]  # nothing came back twice

    run(body())

"""Lease semantics of the queue, with a fake clock (no engine)."""

import asyncio

import pytest

from rollout_server.production.queue import LeaseError, LeaseQueue
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


# -- the journal: the queue on disk as it changes ----------------------------------------------------------
def _ids(ready, leases, expired):
    return [g.group_id for g in ready], {k: [g.group_id for g in v] for k, v in leases.items()}, dict(expired)


def test_the_journal_replays_to_the_queue_after_any_sequence_of_changes(tmp_path):
    """Puts, pulls, acks, releases, expiries and late acks in a seeded random order, with compaction on the
    way: after each change, a queue rebuilt from the file alone (what a killed server has) is the queue."""
    import random

    from rollout_server.production.queue import Journal

    async def body():
        rng, clock, n = random.Random(0), Clock(), 0
        q = LeaseQueue(capacity=6, lease_s=5.0, clock=clock)
        q.journal = Journal(tmp_path / "queue.jsonl", "m")
        q.journal.compact(q)  # as the server does at start-up
        compactions = 0
        for i in range(1500):
            op = rng.choice(["put", "pull", "ack", "release", "tick", "late_ack"])
            if op == "put" and q.space() > 0:
                await q.put([_group(n + k) for k in range(2)], cursor=(0, n + 2, 1000))
                n += 2
            elif op == "pull":
                await q.pull(rng.randint(1, 3), wait_s=0)
            elif op in ("ack", "release") and q._leases:
                lease = rng.choice(list(q._leases))
                await (q.ack(lease) if op == "ack" else q.release(lease))
            elif op == "late_ack" and q._expired:
                with _maybe_conflict():
                    await q.ack(rng.choice(list(q._expired)))
            elif op == "tick":
                clock.t += rng.uniform(0, 4)
                q.expire()
            lines = (tmp_path / "queue.jsonl").read_text().count("\n")
            compactions += lines < getattr(q, "_last_lines", 0)
            q._last_lines = lines
            now = _ids(*q.contents(), q._expired)  # contents() expires what is due: a change too
            replayed = Journal(tmp_path / "queue.jsonl", "m")
            assert _ids(*replayed.replay()) == now, f"after change {i} ({op})"
            assert replayed.cursor == ((0, n, 1000) if n else None)
        assert compactions >= 3  # and the file stays small: 64 lines + 8 per group held
        assert lines <= 64 + 8 * 12 + 1

    run(body())


class _maybe_conflict:
    """A late ack either works or is refused with 409 (its groups were handed out again)."""

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        return kind is LeaseError and exc.status == 409


def test_a_journal_cut_short_by_a_kill_loses_only_the_change_being_written(tmp_path, caplog):
    from rollout_server.production.producer import StateError
    from rollout_server.production.queue import Journal

    async def body():
        q = LeaseQueue(capacity=6, lease_s=5.0)
        q.journal = Journal(tmp_path / "queue.jsonl", "m")
        q.journal.compact(q)
        await q.put([_group(0), _group(1)], cursor=(0, 2, 10))
        await q.put([_group(2)], cursor=(0, 3, 10))

    run(body())
    path = tmp_path / "queue.jsonl"
    whole = path.read_text()
    path.write_text(whole[:-20])  # the last put, half written: neither its group nor its cursor
    journal = Journal(path, "m")
    ready, leases, expired = journal.replay()
    assert [g.group_id for g in ready] == ["g0", "g1"] and journal.cursor == (0, 2, 10)

    lines = whole.splitlines()
    path.write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")
    with pytest.raises(StateError) as e:
        Journal(path, "m").replay()
    assert str(e.value).startswith(f"{path}, line 2: not JSON") and "delete it to start with an empty" in str(
        e.value
    )

    path.write_text(whole)
    assert Journal(path, "other-model").replay() == ([], {}, {})
    assert "holds groups of model 'm', not 'other-model'; dropped" in caplog.text


def test_a_retried_pull_gets_its_lease_again_also_after_a_restart(tmp_path):
    """A pull whose answer is lost on the way (a reset connection) is retried with the same request id:
    it must get the same lease, not a second one holding more groups until lease_s runs out (the soak
    found 2 groups held so at its end)."""
    from rollout_server.production.queue import Journal

    async def body():
        q = LeaseQueue(capacity=10, lease_s=5.0)
        q.journal = Journal(tmp_path / "queue.jsonl", "m")
        await q.put([_group(i) for i in range(4)])
        assert q.answered("r1") is None  # a new request
        lease, groups = await q.pull(2, wait_s=0, request_id="r1")
        assert q.answered("r1") == (lease, groups) and q.leased == 2 and q.depth == 2

        # the server restarts: the lease and the request that got it come back from the journal
        again = LeaseQueue(capacity=10, lease_s=5.0)
        journal = Journal(tmp_path / "queue.jsonl", "m")
        again.restore(*journal.replay(), journal.requests)
        assert again.answered("r1") == (lease, groups)
        await again.ack(lease)
        assert again.answered("r1") == (None, [])  # settled since: nothing, not someone else's groups

    run(body())

"""Continuous production (server.production = "continuous") on the fake engine: groups start, finish and
are queued on their own, out of their prompts' order, and still every prompt is queued exactly once across
kills, sleeps and pauses at any point. The engine's completion order is the test's (a seeded choice among
the generations in flight), so each seed replays the same story."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from fastapi.testclient import TestClient

from rollout_server.production.producer import Cursor, max_inflight_groups
from rollout_server.serving.app import Server
from shared.config import TandemConfig
from shared.datasets import Problem, epoch_order
from tests.fakes import FakeBackend, fake_app

PROBLEMS = [Problem(f"arith-train-{i}", f"What is {i} + 1?", "3") for i in range(7)]  # epochs wrap
# The fake engine answers 3 and 4 in turn: the odd problems here are never solved (settled groups)
SETTLING = [Problem(p.id, p.question, "3" if i % 2 == 0 else "7") for i, p in enumerate(PROBLEMS)]


@pytest.fixture(autouse=True)
def _no_token(monkeypatch):
    monkeypatch.delenv("TANDEM_API_TOKEN", raising=False)


class GatedBackend(FakeBackend):
    """Each generation waits until the test lets it finish (`finish`), so the test picks the order in which
    groups complete."""

    def __init__(self):
        super().__init__()
        self.gates: list[asyncio.Future] = []  # the generations in flight, each waiting for its gate

    async def generate(self, prompts, *, n, temperature, max_tokens, adapter, logprobs=True):
        gate = asyncio.get_running_loop().create_future()
        self.gates.append(gate)
        try:
            await gate
        finally:
            self.gates.remove(gate)
        return await super().generate(
            prompts, n=n, temperature=temperature, max_tokens=max_tokens, adapter=adapter, logprobs=logprobs
        )

    def finish(self, rng: random.Random) -> None:
        rng.choice([g for g in self.gates if not g.done()]).set_result(None)


def _cfg(tmp_path, data=None, **server) -> TandemConfig:
    return TandemConfig.model_validate(
        {
            "sampling": {"group_size": 2},
            "server": {"state_dir": str(tmp_path / "state"), "production": "continuous", **server},
            "data": data or {},
        }
    )


async def _settle() -> None:
    """Let every task run until all wait on something the test controls (no timers are involved)."""
    for _ in range(50):
        await asyncio.sleep(0)


def _index(group) -> int:
    """The prompt index (since epoch 0) a group was made from, read from its id."""
    epoch = int(group.group_id.rsplit("-", 2)[1][1:])
    order = epoch_order(len(PROBLEMS), 0, epoch)
    return epoch * len(PROBLEMS) + order.index(int(group.prompt_id.rsplit("-", 1)[1]))


async def _story(tmp_path, seed: int, curriculum: bool = False) -> tuple[list[int], Cursor, int, int]:
    """Lives of a server: in each, the engine finishes generations in a seeded order, a learner pulls and
    acks now and then, the server sleeps and wakes, pauses and resumes; then it is killed (its tasks
    cancelled, nothing saved: what is on disk is what a SIGKILL leaves), sometimes with its cursor.json
    lost too (a kill between the journal's line and the cursor file). Returns the prompt index of every
    group acked or left in the queue, the last cursor, and the most prompts queued ahead of the cursor.
    `curriculum`: data.curriculum = "skip_settled" on SETTLING, its odd problems skipped for an epoch after
    each settled group (the indices passed over are returned with the groups', and counted last)."""
    rng = random.Random(seed)
    data = {"curriculum": "skip_settled", "curriculum_skip_epochs": 1} if curriculum else None
    problems = SETTLING if curriculum else PROBLEMS
    cfg = _cfg(tmp_path, data, max_inflight_groups=4, queue_size=6)
    trained, most_ahead = [], 0
    for _ in range(5):
        backend = GatedBackend()
        server = Server(cfg, backend, problems, str(tmp_path))
        producer = server.producer
        run = asyncio.create_task(producer.run())
        for _ in range(rng.randint(2, 14)):
            await _settle()
            roll = rng.random()
            if roll < 0.1:
                await producer.sleep()  # cancels every generation in flight
                assert not backend.gates
                await producer.wake()
            elif roll < 0.2:
                pausing = asyncio.create_task(producer.pause())
                await _settle()
                while backend.gates:  # the groups in flight finish and are queued; nothing new starts
                    backend.finish(rng)
                    await _settle()
                await pausing
                await _settle()
                # nothing in flight (ended groups may wait in _work until the loop's next look)
                assert not backend.gates and producer._all_done()
                producer.resume()
            elif backend.gates:
                backend.finish(rng)
            if rng.random() < 0.4:
                lease, groups = await server.queue.pull(rng.randint(1, 3), wait_s=0)
                if lease is not None:
                    await server.queue.ack(lease)
                    trained += [_index(g) for g in groups]
            most_ahead = max(most_ahead, len(producer.cursor.ahead))
        run.cancel()
        for task in [run, *producer._work.values()]:
            task.cancel()
        await asyncio.gather(run, *producer._work.values(), return_exceptions=True)
        server.journal.close()
        if rng.random() < 0.3:
            (tmp_path / "state" / "cursor.json").unlink(missing_ok=True)
    ready, leases = server.queue.contents()
    left = [*ready, *(g for groups in leases.values() for g in groups)]
    events = [json.loads(line) for line in (tmp_path / "state" / "events.jsonl").read_text().splitlines()]
    passed = [i for e in events if e["event"] == "skip" for i in e["indices"]]
    return trained + [_index(g) for g in left] + passed, producer.cursor, most_ahead, len(passed)


@pytest.mark.parametrize(("seed", "curriculum"), [(0, False), (1, False), (2, False), (3, True), (4, True)])
def test_every_prompt_is_queued_once_across_out_of_order_groups_kills_sleeps_and_pauses(
    tmp_path, seed, curriculum
):
    """(With the curriculum: every prompt queued or passed over once.)"""
    made, cursor, most_ahead, passed = asyncio.run(_story(tmp_path, seed, curriculum))
    frontier = cursor.epoch * len(PROBLEMS) + cursor.position
    assert sorted(made) == sorted([*range(frontier), *(frontier + a for a in cursor.ahead)])
    assert len(made) == len(set(made))  # none twice (the line above: none skipped below the cursor)
    assert frontier > len(PROBLEMS)  # the story reached a second epoch
    assert most_ahead > 0  # groups were queued out of order
    assert (passed > 0) == curriculum  # the curriculum passed settled problems over


def test_the_cursor_counts_prompts_queued_out_of_order_and_skips_them_next(tmp_path):
    producer = Server(_cfg(tmp_path), GatedBackend(), PROBLEMS, str(tmp_path)).producer
    producer.cursor = Cursor(0, 2)
    assert producer._with([3, 5]) == Cursor(0, 2, (1, 3))
    producer.cursor = Cursor(0, 2, (1, 3))
    assert producer._next(3) == ([2, 4, 6], [])  # 3 and 5 are queued
    assert producer._with([2]) == Cursor(0, 4, (1,))  # 2, 3 done: on to 4, with 5 ahead
    assert producer._with([2, 4]) == Cursor(0, 6)
    assert producer._with([2, 4, 6]) == Cursor(1, 0)  # 7 problems: index 7 is epoch 1's first
    assert producer._with([8]) == Cursor(0, 2, (1, 3, 6))
    producer._work = {2: None}
    assert producer._next(2) == ([4, 6], [])  # in flight is not free either


def test_a_cursor_with_prompts_ahead_survives_its_file_and_a_damaged_one_is_named(tmp_path):
    import json

    from rollout_server.production.producer import StateError, load_cursor

    path = tmp_path / "cursor.json"
    path.write_text(json.dumps({"epoch": 1, "position": 2, "num_problems": 7, "ahead": [3, 1]}))
    assert load_cursor(path, 7) == Cursor(1, 2, (1, 3))
    path.write_text(json.dumps({"epoch": 1, "position": 2, "num_problems": 7, "ahead": [0]}))
    with pytest.raises(StateError, match="'ahead' must hold distinct offsets > 0: delete it"):
        load_cursor(path, 7)


def test_the_derived_groups_in_flight_are_twice_those_that_fill_vllm_s_batch():
    def cfg(**server):
        return TandemConfig.model_validate({"sampling": {"group_size": 8}, "server": server})

    assert max_inflight_groups(cfg()) == 2 * (64 // 8)  # vllm.max_num_seqs 64, G 8
    assert max_inflight_groups(cfg(vllm={"max_num_seqs": 20})) == 2 * 3
    assert max_inflight_groups(cfg(backend="hf", prompts_per_batch=5)) == 5
    assert max_inflight_groups(cfg(max_inflight_groups=2)) == 2


def _pull(c: TestClient, n: int) -> list[dict]:
    """n groups, pulled as they come (a pull answers with what is queued once there is any)."""
    groups = []
    while len(groups) < n:
        body = c.post("/v1/groups/pull", json={"max_groups": n - len(groups), "wait_s": 10}).json()
        assert body["groups"], "no group within 10 s"
        groups += body["groups"]
    return groups


def test_continuous_groups_reach_the_learner_with_their_version_and_one_sample_call_each(tmp_path):
    backend = FakeBackend()
    with TestClient(fake_app(tmp_path, backend, production="continuous", queue_size=4)) as c:
        groups = _pull(c, 4)
    order = epoch_order(20, 0, 0)
    assert sorted(g["prompt_id"] for g in groups) == sorted(f"arith-train-{i}" for i in order[:4])
    assert all(g["policy_version"] == 0 and len(g["completions"]) == 4 for g in groups)
    assert set(backend.calls) == {(1, 4)}  # one prompt a call: each group on its own


def test_a_group_the_engine_aborted_is_made_again_and_an_engine_error_ends_production(tmp_path):
    backend = FakeBackend(abort_first=True)
    with TestClient(fake_app(tmp_path, backend, production="continuous", queue_size=4)) as c:
        groups = _pull(c, 4)
    order = epoch_order(20, 0, 0)
    assert sorted(g["prompt_id"] for g in groups) == sorted(f"arith-train-{i}" for i in order[:4])
    assert backend.calls.count((1, 4)) == 5  # the aborted prompt's group made again
    fatal = []
    app = fake_app(
        tmp_path / "dies", FakeBackend(fail_after=2), lambda: fatal.append(1), production="continuous"
    )
    with TestClient(app) as c:
        for _ in range(100):
            if fatal:
                break
            asyncio.run(asyncio.sleep(0.05))
        r = c.get("/health")
    assert fatal == [1] and r.status_code == 503 and "engine core died" in r.json()["detail"]


async def _drawn_until(tmp_path, epoch: int, cfg) -> list[tuple[int, str]]:
    """(epoch, problem id) of every group a server on SETTLING makes until its cursor reaches `epoch`."""
    server = Server(cfg, FakeBackend(), SETTLING, str(tmp_path))
    run = asyncio.create_task(server.producer.run())
    drawn = []
    while server.producer.cursor.epoch < epoch:
        lease, groups = await server.queue.pull(8, wait_s=1.0)
        if lease is not None:
            await server.queue.ack(lease)
            drawn += [(int(g.group_id.rsplit("-", 2)[1][1:]), g.prompt_id) for g in groups]
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)
    server.journal.close()
    return drawn


def test_the_curriculum_skips_a_settled_problem_for_its_epochs_then_draws_it_again_across_a_restart(tmp_path):
    """The odd problems of SETTLING give all-zero groups: each sits out the next epoch (skip_epochs 1) and
    is drawn again in the one after; the even ones are drawn every epoch. The server is stopped as epoch 0
    ends and restarted: it keeps the curriculum (curriculum.json) and the cursor."""
    data = {"curriculum": "skip_settled", "curriculum_skip_epochs": 1}
    cfg = _cfg(tmp_path, data, production="lockstep", prompts_per_batch=1, queue_size=2)
    drawn = asyncio.run(_drawn_until(tmp_path, 1, cfg))
    drawn += asyncio.run(_drawn_until(tmp_path, 4, cfg))
    evens, odds = {p.id for p in SETTLING[::2]}, {p.id for p in SETTLING[1::2]}
    by_epoch = {e: sorted(p for de, p in drawn if de == e) for e in range(4)}
    assert by_epoch == {0: sorted(evens | odds), 1: sorted(evens), 2: sorted(evens | odds), 3: sorted(evens)}
    assert len(drawn) == len(set(drawn))  # none twice (the restart repeated nothing)

"""collect_groups against a scripted client (fast): stale groups dropped, degenerate ones held back while
dynamic sampling may pull more and used to fill the batch after, every lease on disk before its groups
are used, and a lease of only stale groups acked at once."""

from __future__ import annotations

import json

from learner.servers import collect_groups
from shared import protocol as P
from shared.config import load_config


def _group(gid: str, version: int, rewards: list[float]) -> P.ScoredGroup:
    comps = [
        P.Completion(token_ids=[5], logprobs=[-0.1], text="x", reward=r, finish_reason="stop")
        for r in rewards
    ]
    return P.ScoredGroup(
        group_id=gid,
        prompt_id=gid,
        prompt_token_ids=[1, 2],
        answer="1",
        policy_version=version,
        completions=comps,
    )


class ScriptedClient:
    """pull() plays the scripted responses in order; ack/release are recorded."""

    def __init__(self, responses: list[P.PullResponse], out=None):
        self.responses, self.out = list(responses), out
        self.on_disk: list[list[str]] = []  # inflight_leases.json as each pull was sent
        self.retry_s = 0.0
        self.asked: list[int] = []
        self.acked: list[str] = []
        self.released: list[str] = []

    def pull(self, max_groups: int, wait_s: float, request_id: str | None = None) -> P.PullResponse:
        self.asked.append(max_groups)
        if self.out is not None:
            on_disk = json.loads((self.out / "inflight_leases.json").read_text())
            self.on_disk.append([x.replace(request_id, "<this pull>") for x in on_disk])
        return self.responses.pop(0)

    def ack(self, lease_id: str) -> P.AckResponse:
        self.acked.append(lease_id)
        return P.AckResponse(acked=1)

    def release(self, lease_id: str) -> P.ReleaseResponse:
        self.released.append(lease_id)
        return P.ReleaseResponse(released=1)


def _resp(lease: str | None, *groups: P.ScoredGroup) -> P.PullResponse:
    return P.PullResponse(lease_id=lease, lease_s=60.0 if lease else 0.0, groups=list(groups))


def _cfg(*extra: str):
    return load_config(None, ["learner.prompts_per_step=2", "learner.max_staleness=0", *extra])


def test_stale_dropped_degenerate_held_back_and_every_lease_recorded(tmp_path):
    client = ScriptedClient(
        [
            _resp("L1", _group("old", 2, [1, 0]), _group("flat", 3, [1, 1])),  # stale; degenerate
            _resp("L2", _group("stale-only", 1, [1, 0])),  # nothing usable: acked at once
            _resp("L3", _group("good", 3, [1, 0]), _group("good2", 3, [0, 1])),
        ],
        out=tmp_path,
    )
    pulled = collect_groups(client, _cfg("learner.dynamic_sampling=true"), version=3, out=tmp_path)
    assert [g.group_id for g in pulled.groups] == ["good", "good2"]
    assert (pulled.stale, pulled.degenerate, pulled.dropped_degenerate, pulled.seen) == (2, 1, 1, 3)
    assert pulled.lease_ids == ["L1", "L3"] and client.acked == ["L2"]
    assert client.asked == [2, 2, 2]  # the degenerate group was not counted toward the batch
    assert json.loads((tmp_path / "inflight_leases.json").read_text()) == ["L1", "L3"]
    # each pull's id is on disk before it is sent: a kill before its lease id is recorded leaves it findable
    assert client.on_disk == [["pull:<this pull>"], ["L1", "pull:<this pull>"], ["L1", "pull:<this pull>"]]


def test_after_max_pull_rounds_degenerate_groups_fill_the_batch(tmp_path):
    client = ScriptedClient(
        [
            _resp("L1", _group("flat", 0, [0, 0]), _group("good", 0, [1, 0])),
            _resp("L2", _group("flat2", 0, [1, 1])),
        ]
    )
    cfg = _cfg("learner.dynamic_sampling=true", "learner.max_pull_rounds=2")
    pulled = collect_groups(client, cfg, version=0, out=tmp_path)
    assert [g.group_id for g in pulled.groups] == ["good", "flat"]  # filled from the spares, in order
    assert pulled.dropped_degenerate == 1 and pulled.lease_ids == ["L1", "L2"]  # flat2 dropped, still acked
    assert client.asked == [2, 1]


def test_without_dynamic_sampling_degenerate_groups_train(tmp_path):
    client = ScriptedClient([_resp("L1", _group("flat", 0, [1, 1]), _group("good", 0, [1, 0]))])
    pulled = collect_groups(client, _cfg("learner.dynamic_sampling=false"), version=0, out=tmp_path)
    assert [g.group_id for g in pulled.groups] == ["flat", "good"] and pulled.degenerate == 1


def test_a_lease_that_cannot_be_recorded_is_given_back(tmp_path, monkeypatch):
    import pytest

    from learner import checkpoint as ckpt

    client = ScriptedClient([_resp("L1", _group("good", 0, [1, 0]))])
    (tmp_path / "inflight_leases.json.tmp").mkdir()  # every write of the record fails
    with pytest.raises(ckpt.OutDirError):
        collect_groups(client, _cfg(), version=0, out=tmp_path)
    assert client.asked == []  # not even the pull's id could be recorded: no pull was sent

    writes = []  # the pull's id is recorded, its lease id is not
    real = ckpt.write_inflight

    def second_fails(out, ids):
        writes.append(ids)
        if len(writes) == 2:
            raise ckpt.OutDirError("disk full")
        real(out, ids)

    monkeypatch.setattr(ckpt, "write_inflight", second_fails)
    (tmp_path / "inflight_leases.json.tmp").rmdir()
    with pytest.raises(ckpt.OutDirError):
        collect_groups(client, _cfg(), version=0, out=tmp_path)
    assert client.released == ["L1"]


def test_a_restart_settles_trained_leases_untrained_ones_and_a_pull_never_recorded(tmp_path):
    from learner import checkpoint as ckpt
    from learner.servers import _settle_leases

    class Client(ScriptedClient):
        def release_pull(self, request_id):
            self.released.append(f"by request {request_id}")
            return P.ReleaseResponse(released=2)

    client, said = Client([]), []
    ckpt.write_inflight(tmp_path, ["L9", "pull:abc"])
    state = ckpt.State(step=3, version=3, pending_leases=["L8"])
    _settle_leases(client, state, tmp_path, said.append)
    assert client.acked == ["L8"] and client.released == ["L9", "by request abc"]
    assert said == [
        "released 1 group(s) pulled before the restart but never trained",
        "released 2 group(s) a pull got just before the restart, never recorded",
    ]
    assert json.loads((tmp_path / "inflight_leases.json").read_text()) == [] and state.pending_leases == []


def test_the_step_gets_the_record_failure_as_a_value_it_can_pass_between_ranks(tmp_path):
    import pickle

    from learner.checkpoint import State
    from learner.servers import collect_or_stop

    client = ScriptedClient([_resp("L1", _group("good", 0, [1, 0]))])
    (tmp_path / "inflight_leases.json.tmp").mkdir()  # the write of the record fails
    pulled = collect_or_stop(client, _cfg(), State(), tmp_path, log=print)
    assert pulled.groups == [] and "inflight_leases.json" in pulled.error and client.asked == []
    assert pickle.loads(pickle.dumps(pulled)).error == pulled.error  # what broadcast_object does with it

"""Several rollout servers feeding one learner (learner.server_urls, server.shard_index/num_shards), with
real engines on loopback: two servers split the prompts and both feed the run; one killed mid-run is
skipped, then, restarted, brought to the current version and pulled from again. Server 1 produces
continuously (server.production), server 0 in lockstep."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from harness.procs import Proc, wait_healthy
from tests.helpers import (
    SMALL_LEARNER,
    SMALL_RUN,
    free_port,
    jsonl,
    proc_env,
    server_args,
    start_learner,
    wait_for,
)

pytestmark = pytest.mark.slow

SERVER = [
    *SMALL_RUN,
    "--sampling.max_new_tokens=32",
    "--server.queue_size=4",
    "--server.lease_s=300",
    "--server.num_shards=2",
    "--server.max_loras=9",  # (checked against max_staleness in split placement; merge mode loads none)
]
LEARNER = [
    *SMALL_LEARNER,
    "--learner.keep_every=1",
    "--learner.server_retry_s=600",
    "--learner.server_probe_s=2",
    # Split: the servers generate while the learner trains. Time-sliced, every step's sleep aborts the
    # batches in flight, and on a 2-core box the slower server could finish none in a whole run.
    "--learner.placement=split",
    "--learner.max_staleness=8",  # nothing dropped as stale: every group a server leases is trained
]


def _server(tmp: Path, shard: int, port: int, backend: str, log: str) -> Proc:
    """Shard 1 produces continuously (groups queued out of order): its kill is continuous production's
    real-engine kill."""
    args = server_args("deploy/configs/cpu.toml", port, tmp / f"server{shard}", SERVER)
    args += [f"--server.shard_index={shard}", f"--server.backend={backend}"]
    if shard == 1:
        args.append("--server.production=continuous")
    return Proc(args, tmp / log, proc_env())


def _servers(tmp: Path, backend: str, procs: list[Proc]) -> list[str]:
    """Two servers, shards 0 and 1, started together; their URLs once both are healthy."""
    ports = [free_port(), free_port()]
    started = [_server(tmp, i, ports[i], backend, f"server{i}.log") for i in range(2)]
    procs += started
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    for proc, url in zip(started, urls, strict=True):
        wait_healthy(proc, url, 600)
    return urls


def _learner(urls: list[str], out: Path, steps: int, log: Path) -> Proc:
    args = [*SERVER, *LEARNER, f"--learner.steps={steps}", f"--learner.server_urls={json.dumps(urls)}"]
    return start_learner(urls[0], out, log, args)


def _produced(tmp: Path, shard: int) -> list[dict]:
    """A server's group events, each with the prompt id and epoch its group id carries."""
    out = []
    for e in jsonl(tmp / f"server{shard}" / "events.jsonl"):
        if e["event"] == "group":
            prompt, epoch = e["group_id"].rsplit("-", 2)[:2]
            out.append({**e, "prompt": prompt, "epoch": int(epoch[1:])})
    return out


def _health(url: str) -> dict:
    import httpx

    return httpx.get(f"{url}/health", timeout=10).json()


def test_two_servers_split_the_prompts_and_one_killed_is_skipped_then_brought_back(
    tmp_path, procs, model_dir
):
    """One story, so that two vLLM servers start once: both feed the learner their shards; server 1 is
    killed after v2, the learner trains on from server 0, and the restarted server 1 is brought to the
    current version before it is pulled from again."""
    urls = _servers(tmp_path, "vllm", procs)
    # Both with groups before the learner starts: the learner pulls from whichever has some, and once the
    # second server's first batch (the slowest: vLLM warms up) came after a whole 3-step run on the first's.
    wait_for("a group on each server", lambda: all(_health(u)["queue_depth"] for u in urls), procs)
    out = tmp_path / "run"
    learner = _learner(urls, out, 60, tmp_path / "learner.log")  # stopped below, once the story is told
    procs.append(learner)
    events = [tmp_path / f"server{i}" / "events.jsonl" for i in range(2)]

    def published(i: int, version: int) -> bool:
        return any(e["event"] == "publish" and e["version"] >= version for e in jsonl(events[i]))

    wait_for("v2 is published to server 1", lambda: published(1, 2), procs)
    procs[1].signal(signal.SIGKILL)
    procs[1].wait(timeout=30)
    killed_at = time.time()
    wait_for("the learner trains on from server 0", lambda: published(0, 4), [procs[0], learner], 600)
    assert "is down" in learner.log()
    restarted = _server(tmp_path, 1, int(urls[1].rsplit(":", 1)[1]), "vllm", "server1-again.log")
    procs.append(restarted)

    def leased_after_restart() -> bool:
        return any(e["event"] == "lease" and e["t"] > killed_at for e in jsonl(events[1]))

    wait_for("the restarted server's groups are pulled", leased_after_restart, [procs[0], learner], 600)
    learner.signal(signal.SIGTERM)  # finish the step, checkpoint, publish, exit 0
    assert learner.wait(timeout=600) == 0, learner.log()[-5000:]

    steps = jsonl(out / "groups.jsonl")
    ids = [g["group_id"] for t in steps for g in t["groups"]]
    assert len(ids) == 2 * len(steps) and len(ids) == len(set(ids)), "a group was trained twice"
    # the shards: server i makes only prompts whose index is i modulo 2, so never the other's
    made = {i: {e["group_id"] for e in _produced(tmp_path, i)} for i in range(2)}
    assert made[0] & set(ids) and made[1] & set(ids), "one server's groups were never trained"
    assert set(ids) <= made[0] | made[1]
    for i in range(2):
        assert {int(e["prompt"].rsplit("-", 1)[1]) % 2 for e in _produced(tmp_path, i)} == {i}
    both = {(e["prompt"], e["epoch"]) for e in _produced(tmp_path, 0)}
    assert not both & {(e["prompt"], e["epoch"]) for e in _produced(tmp_path, 1)}
    # the killed server, producing continuously: across the kill, no prompt of an epoch made twice
    again = [(e["prompt"], e["epoch"]) for e in _produced(tmp_path, 1)]
    assert len(again) == len(set(again)), "a prompt was queued twice across the kill"
    # per server: groups pulled over the run, each server's trained ones and any a kill cut off untrained
    last = jsonl(out / "metrics.jsonl")[-1]
    pulled = {i: last[f"server/{i}/groups"] for i in range(2)}
    for i in range(2):
        assert pulled[i] >= len(made[i] & set(ids)) > 0, (i, pulled)
    assert last["server/1/up"] == 1

    # the killed server: skipped while down, then brought to the current version before any pull
    log = learner.log()
    assert "is back; brought from v2 to v" in log, log[-3000:]
    after = [e for e in jsonl(events[1]) if e["t"] > killed_at]
    first_publish = next(i for i, e in enumerate(after) if e["event"] == "publish")
    leases = [i for i, e in enumerate(after) if e["event"] == "lease"]
    assert leases and first_publish < leases[0], "pulled from before it was brought to the current version"
    assert after[first_publish]["version"] > 2
    leased_after = {gid for e in after if e["event"] == "lease" for gid in e["group_ids"]}
    assert leased_after & set(ids), "the restarted server contributed no group"
    # the survivor lost nothing: every group it leased to the learner was trained
    leased0 = {gid for e in jsonl(events[0]) if e["event"] == "lease" for gid in e["group_ids"]}
    assert leased0 <= set(ids)
    final = json.loads((out / "run_summary.json").read_text())["policy_version"]
    assert final == len(steps) and [_health(u)["policy_version"] for u in urls] == [final, final]

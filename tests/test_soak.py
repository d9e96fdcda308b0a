"""The soak (scripts/soak.py): its audit of the records on disk, on records made up to break each
invariant; and a short soak of the shipped CPU stack, one fault of each kind, checked end to end."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))
from soak import Audit, Proxy  # noqa: E402


def _write(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _run(tmp: Path, steps: list[list[str]], events: list[dict], leased: int = 0, version: int | None = None):
    learner, server = tmp / "learner", tmp / "server0"
    _write(
        learner / "groups.jsonl",
        [{"step": i + 1, "groups": [{"group_id": g} for g in gs]} for i, gs in enumerate(steps)],
    )
    _write(learner / "metrics.jsonl", [{"step": i + 1} for i in range(len(steps))])
    (learner / "checkpoints").mkdir()
    (learner / "checkpoints" / "latest").write_text(f"step-{len(steps)}")
    (learner / "run_summary.json").write_text(json.dumps({"policy_version": len(steps)}))
    _write(server / "events.jsonl", events)
    health = {"server0": {"leased": leased, "policy_version": len(steps) if version is None else version}}
    return Audit(learner, [server], health).check()


G = [f"p{i}-e0-{i:012x}" for i in range(6)]


def _events(produced, leases):
    out = [{"event": "group", "group_id": g} for g in produced]
    for n, ids in enumerate(leases):
        out += [
            {"event": "lease", "lease_id": f"L{n}", "group_ids": ids},
            {"event": "ack", "lease_id": f"L{n}", "acked": len(ids)},
        ]
    return out


def test_the_audit_passes_a_clean_run_and_names_each_broken_invariant(tmp_path):
    clean = _run(tmp_path / "a", [G[:2], G[2:4]], _events(G[:5], [G[:2], G[2:5]]))
    assert clean["violations"] == []
    assert clean["groups"] == {
        "produced": 5,
        "trained": 4,
        "dropped_by_learner": 1,
        "queued_at_end": 0,
        "trained_twice": 0,
        "lost": 0,
    }

    twice = _run(tmp_path / "b", [G[:2], [G[1], G[2]]], _events(G[:3], [G[:2], G[1:3]]))
    assert "1 group(s) trained twice" in twice["violations"]
    again = G[0].replace("-000000000000", "-00000000abcd")  # the same prompt and epoch, another group
    epoch = _run(tmp_path / "c", [[G[0]], [again]], _events([G[0], again], [[G[0]], [again]]))
    assert "1 prompt(s) trained twice in one epoch" in epoch["violations"]
    lost = _run(tmp_path / "d", [G[:2]], _events(G[:4], [G[:2]]))
    assert "2 group(s) produced and then lost (never trained, dropped or queued)" in lost["violations"]
    held = _run(tmp_path / "e", [G[:2]], _events(G[:2], [G[:2]]), leased=2, version=0)
    assert "leases left open at the end: {'server0': 2}" in held["violations"]
    assert "the servers serve {'server0': 0}, the learner ended at v1" in held["violations"]


def _echo(conn) -> None:
    with contextlib.suppress(OSError):
        while data := conn.recv(64):
            conn.sendall(data)


def test_a_closed_proxy_cuts_its_connections_and_stops_answering():
    """A moved server's old proxy (fault server-move) must not keep its address answering."""
    import socket
    import threading
    import time

    upstream = socket.create_server(("127.0.0.1", 0))

    def echo():
        while True:
            try:
                conn, _ = upstream.accept()
            except OSError:
                return
            threading.Thread(target=_echo, args=(conn,), daemon=True).start()

    threading.Thread(target=echo, daemon=True).start()
    proxy = Proxy(upstream.getsockname()[1])
    client = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    client.sendall(b"hi")
    assert client.recv(64) == b"hi"
    proxy.close()
    try:
        cut = client.recv(64)  # the connection through it: cut (reset or closed), not left hanging
    except ConnectionResetError:
        cut = b""
    assert cut == b""
    deadline = time.time() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", proxy.port), timeout=1).close()
        except ConnectionRefusedError:
            break
        assert time.time() < deadline, "the closed proxy still accepts connections"
        time.sleep(0.1)
    upstream.close()


@pytest.mark.slow
def test_a_short_soak_of_the_shipped_cpu_stack_loses_nothing_and_trains_nothing_twice(tmp_path, model_dir):
    """deploy/configs/cpu.toml as shipped; one fault each time the learner reaches a new step, every kind
    in turn: the learner and the server killed and stopped, the network reset and stalled, the reward slow."""
    kinds = ["learner-kill", "server-kill", "net-reset", "net-stall", "learner-term", "slow-reward"]
    out = tmp_path / "soak"
    args = ["--steps", "7", "--fault-each-step", "--faults", ",".join(kinds), "--fault-s", "5", "10"]
    run = subprocess.run(
        [sys.executable, "scripts/soak.py", *args, "--seed", "1", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["faults"] == dict.fromkeys(kinds, 1)
    assert report["steps"] == 7 and report["final_version"] == 7
    assert report["groups"]["trained"] == 14  # 2 prompts a step
    assert report["groups"]["trained_twice"] == 0 and report["groups"]["lost"] == 0
    assert report["restarts"]["server0"] == 1 and report["restarts"]["learner"] >= 2

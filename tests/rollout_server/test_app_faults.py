"""The server app's fault handling on a deterministic fake engine, in process (fast): a producer that dies
takes the server down for its supervisor, SIGTERM ends evaluation requests at once, a large evaluation
request reaches the engine in batch-sized chunks, a damaged cursor is named, and a restart keeps the queue."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from rollout_server.engines.base import GenerationAborted
from rollout_server.production.producer import StateError, load_cursor
from rollout_server.serving.generate_api import _generate_in_chunks
from shared.config import TandemConfig
from shared.datasets import epoch_order
from tests.fakes import PROBLEMS, FakeBackend, fake_app


def test_a_dead_producer_turns_health_503_and_asks_to_exit(tmp_path, monkeypatch):
    monkeypatch.delenv("TANDEM_API_TOKEN", raising=False)
    fatal = []
    with TestClient(fake_app(tmp_path, FakeBackend(fail_after=1), on_fatal=lambda: fatal.append(1))) as c:
        for _ in range(100):
            if fatal:
                break
            asyncio.run(asyncio.sleep(0.05))
        r = c.get("/health")
    assert fatal == [1]  # serve() turns this into uvicorn's exit, and exit code 1
    assert r.status_code == 503 and "engine core died" in r.json()["detail"]


def test_sigterm_cancels_an_evaluation_in_flight_with_503(tmp_path, monkeypatch):
    monkeypatch.delenv("TANDEM_API_TOKEN", raising=False)
    app = fake_app(tmp_path, FakeBackend(delay_s=30.0))
    with TestClient(app) as c:
        app.state.loop.call_later(0.5, app.state.server.begin_shutdown)  # what the SIGTERM handler does
        r = c.post("/v1/generate", json={"prompts": ["What is 1 + 1?"], "n": 2})
    assert r.status_code == 503 and r.json()["detail"] == "the server is shutting down"


class _StopsWithTheServer(FakeBackend):
    """An engine whose processes get the server's stop signal too (a process group, a SLURM job step):
    the batch in flight waits until `signalled` is set, then ends aborted or with the engine dead."""

    def __init__(self, ending: str):
        super().__init__()
        self.ending, self.signalled = ending, asyncio.Event()

    async def generate(self, prompts, *, n, temperature, max_tokens, adapter, logprobs=True):
        self.calls.append((len(prompts), n))
        await self.signalled.wait()
        if self.ending == "aborted":
            raise GenerationAborted("the engine did not finish the request (abort)")
        raise RuntimeError("EngineCore encountered an issue")


@pytest.mark.parametrize("ending", ["aborted", "engine dead"])
def test_a_stop_signal_that_reaches_the_engine_too_is_a_clean_shutdown(tmp_path, monkeypatch, caplog, ending):
    """A long-polling pull answers "no groups" at once (it used to wait out server.shutdown_s and end as
    a 500, which stopped the learner); the engine's end is not taken for a failure (exit 1 and a
    restart) nor warned about; no new batch starts."""
    monkeypatch.delenv("TANDEM_API_TOKEN", raising=False)
    caplog.set_level("INFO", logger="tandem.server")
    backend, fatal = _StopsWithTheServer(ending), []
    app = fake_app(tmp_path, backend, on_fatal=lambda: fatal.append(1))
    with TestClient(app) as c:
        loop, server = app.state.loop, app.state.server
        loop.call_later(0.5, server.begin_shutdown)  # what the SIGTERM handler does
        loop.call_later(0.6, backend.signalled.set)
        t0 = time.monotonic()
        r = c.post("/v1/groups/pull", json={"max_groups": 2, "wait_s": 30})
        waited = time.monotonic() - t0
        for _ in range(40):  # the producer's end
            if server.producer_task.done():
                break
            time.sleep(0.05)
    assert r.status_code == 200 and r.json()["groups"] == [] and waited < 3
    assert server.producer_task.done() and fatal == [] and server.failure is None
    assert backend.calls == [(2, 4)]  # the batch in flight, and no other after the stop
    assert [r.getMessage() for r in caplog.records if r.levelname in ("WARNING", "ERROR")] == []


def test_an_engine_failing_during_shutdown_is_no_reason_to_be_restarted():
    """The producer can also meet the dead engine outside a batch (a weight switch as it lets go of an
    adapter): during a shutdown that is the stop signal's doing, not a failure (exit 1)."""
    from types import SimpleNamespace

    from rollout_server.serving.app import _producer_done

    async def dies():
        raise RuntimeError("EngineCore encountered an issue")

    async def main():
        task = asyncio.create_task(dies())
        await asyncio.wait({task})
        return task

    task = asyncio.run(main())
    for shutting_down, fatal in [(True, []), (False, [1])]:
        server, calls = SimpleNamespace(shutting_down=shutting_down, failure=None), []
        _producer_done(server, task, lambda calls=calls: calls.append(1))
        assert calls == fatal and (server.failure is None) == shutting_down


def test_an_evaluation_past_its_time_limit_gets_504(tmp_path, monkeypatch):
    monkeypatch.delenv("TANDEM_API_TOKEN", raising=False)
    with TestClient(fake_app(tmp_path, FakeBackend(delay_s=30.0), generate_timeout_s=0.5)) as c:
        r = c.post("/v1/generate", json={"prompts": ["What is 1 + 1?"], "n": 2})
    assert r.status_code == 504 and "server.generate_timeout_s=0.5" in r.json()["detail"]


@pytest.mark.parametrize(
    ("prompts", "n", "calls"),
    [
        (5, 2, [(4, 2), (1, 2)]),  # chunk 8 sequences: 4 prompts x 2, then the last one
        (1, 20, [(1, 8), (1, 8), (1, 4)]),  # n past a chunk: the prompt in three calls
        (3, 8, [(1, 8)] * 3),
    ],
)
def test_an_evaluation_reaches_the_engine_in_chunks_of_a_batch(prompts, n, calls):
    backend = FakeBackend()
    rows = asyncio.run(_generate_in_chunks(backend, [[1, 2]] * prompts, n, 1.0, 4, None, chunk=8))
    assert backend.calls == calls
    assert [len(r) for r in rows] == [n] * prompts
    assert rows[0][0].logprobs == []  # evaluation asks for no logprobs: the engine keeps no logits


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ('{"epoch": 0, "posi', "is not readable JSON"),
        ("[0, 3]", "must hold a JSON object, not list"),
        ('{"epoch": 0, "position": "3", "num_problems": 20}', "lacks integer epoch, position"),
        ('{"epoch": 0, "position": 999, "num_problems": 20}', "position 999 is outside"),
        ('{"epoch": -1, "position": 0, "num_problems": 20}', "is outside"),
    ],
)
def test_a_damaged_cursor_is_named_with_what_to_do(tmp_path, content, says):
    path = tmp_path / "cursor.json"
    path.write_text(content)
    with pytest.raises(StateError) as e:
        load_cursor(path, 20)
    assert str(e.value).startswith(str(path)) and says in str(e.value)
    assert "delete it to start the prompt order over" in str(e.value)


def test_a_good_cursor_loads_and_a_changed_dataset_starts_over(tmp_path):
    path = tmp_path / "cursor.json"
    path.write_text(json.dumps({"epoch": 2, "position": 7, "num_problems": 20}))
    c = load_cursor(path, 20)
    assert (c.epoch, c.position) == (2, 7)
    c = load_cursor(path, 21)
    assert (c.epoch, c.position) == (0, 0)


def test_the_server_names_a_damaged_cursor_and_exits_before_loading_the_engine(tmp_path):
    import subprocess
    import sys

    from tests.helpers import REPO, proc_env

    (tmp_path / "cursor.json").write_text('{"epoch": 0, "position": 12')  # cut short by a crash
    args = ["-m", "rollout_server", "--config", "deploy/configs/cpu.toml", f"--server.state_dir={tmp_path}"]
    run = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=REPO, env=proc_env(), timeout=120
    )
    assert run.returncode == 2
    errors = [line for line in run.stdout.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: {tmp_path}/cursor.json is not readable JSON (JSONDecodeError): delete it to start the "
        "prompt order over at epoch 0 (prompts already used come round again)"
    ]
    assert "starting hf backend" not in run.stderr + run.stdout and "Traceback" not in run.stderr


def test_a_batch_the_engine_aborted_is_made_again_not_queued(tmp_path, monkeypatch):
    monkeypatch.delenv("TANDEM_API_TOKEN", raising=False)
    backend = FakeBackend(abort_first=True)
    with TestClient(fake_app(tmp_path, backend)) as c:
        r = c.post("/v1/groups/pull", json={"max_groups": 2, "wait_s": 10})
        health = c.get("/health")
    # The aborted batch's prompts were not consumed: the first groups are of the first two in the order.
    order = epoch_order(len(PROBLEMS), 0, 0)
    assert [g["prompt_id"] for g in r.json()["groups"]] == [PROBLEMS[i].id for i in order[:2]]
    assert backend.calls[:2] == [(2, 4), (2, 4)]  # the same batch, twice
    assert health.status_code == 200


def test_serve_exits_1_when_the_producer_dies_so_a_supervisor_restarts_it(tmp_path, monkeypatch):
    """The whole serve(): uvicorn on a free port, the real model's folder and data, a fake engine whose
    second batch fails as a dead engine core would. The process must end (code 1), not linger on 503."""
    import signal

    import rollout_server.serving.serve as app_module
    from harness.net import free_port
    from rollout_server.serving.serve import serve

    async def fake_backend(cfg, model_path, inspected=None, fork_engine=False):
        assert fork_engine  # the server's own process has computed nothing: vLLM's engine may be forked
        return FakeBackend(fail_after=1)

    monkeypatch.setattr(app_module, "make_backend", fake_backend)
    monkeypatch.delenv("TANDEM_API_TOKEN", raising=False)
    cfg = TandemConfig.model_validate(
        {
            "data": {"task": "arith"},
            "sampling": {"group_size": 4},
            "server": {"state_dir": str(tmp_path), "port": free_port(), "backend": "hf"},
        }
    )
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM)}

    def too_long(signum, frame):
        raise TimeoutError("serve() was still running 60 s after its producer died")

    signal.signal(signal.SIGALRM, too_long)
    signal.alarm(60)  # a serve() that never returns would hang the suite: fail it instead
    try:
        assert serve(cfg) == 1
    finally:
        signal.alarm(0)
        for s, h in handlers.items():
            signal.signal(s, h)


def _full_queue(app, c) -> tuple[dict, list[str]]:
    """A lease of 2 groups pulled, then the 6 the queue holds once the producer waits for space."""
    lease = c.post("/v1/groups/pull", json={"max_groups": 2, "wait_s": 10}).json()
    queue = app.state.server.queue
    for _ in range(200):
        if queue.depth == 6:
            break
        time.sleep(0.02)
    return lease, [g.group_id for g in queue.contents()[0]]


def _takes_back(state: Path, lease: dict, waiting: list[str]) -> None:
    """A server started on `state` serves the `waiting` groups first, in order, the lease still acks, and
    its cursor is past every prompt it took back (its next batch makes new prompts)."""
    backend = FakeBackend(release=asyncio.Event())  # makes no new group: its first batch never ends
    app = fake_app(state.parent, backend, queue_size=6)
    with TestClient(app) as c:
        got = c.post("/v1/groups/pull", json={"max_groups": 10, "wait_s": 0}).json()["groups"]
        assert [g["group_id"] for g in got] == waiting
        assert c.post("/v1/groups/ack", json={"lease_id": lease["lease_id"]}).json() == {"acked": 2}
        cursor = app.state.server.producer.cursor
        assert (cursor.epoch, cursor.position) == (0, 8)  # 4 batches of 2 prompts made before the stop


def test_a_restarted_server_takes_back_its_queue_and_its_learner_s_lease(tmp_path, monkeypatch):
    """Groups the cursor has passed are not lost with a stop: the next start serves the waiting ones first,
    in order, and the learner's lease from before still acks."""
    monkeypatch.delenv("TANDEM_API_TOKEN", raising=False)
    app = fake_app(tmp_path, FakeBackend(), queue_size=6)
    with TestClient(app) as c:
        lease, waiting = _full_queue(app, c)
    assert len(waiting) == 6
    _takes_back(tmp_path / "state", lease, waiting)


def _copy_unless_renamed(src: str, dst: str) -> None:
    with contextlib.suppress(FileNotFoundError):  # a temporary file renamed over its target since the listing
        shutil.copy2(src, dst)


def test_a_server_killed_outright_takes_back_its_queue_and_its_cursor(tmp_path, monkeypatch):
    """SIGKILL, the OOM killer: no shutdown runs, so nothing can be saved then. The queue's journal is on
    disk as the queue changes; a copy of the state folder taken while the server runs is what a kill
    leaves. Before the journal, a killed server lost its queue and skipped those prompts for the epoch."""
    monkeypatch.delenv("TANDEM_API_TOKEN", raising=False)
    app = fake_app(tmp_path, FakeBackend(), queue_size=6)
    killed = tmp_path / "killed" / "state"
    with TestClient(app) as c:
        lease, waiting = _full_queue(app, c)
        # the server still runs: no shutdown has saved anything, and its writer may rename a file between
        # the copy's listing and its read (a CI run lost to that race): a kill finds the file renamed too
        shutil.copytree(tmp_path / "state", killed, copy_function=_copy_unless_renamed)
    assert len(waiting) == 6
    _takes_back(killed, lease, waiting)


def test_a_saved_queue_of_another_model_is_dropped_and_a_damaged_one_named(tmp_path, caplog):
    from rollout_server.production.producer import load_queue

    path = tmp_path / "queue.json"
    path.write_text(json.dumps({"model": "other-model", "ready": [{"not": "a group"}], "leases": {}}))
    assert load_queue(path, "smollm2-135m") == ([], {})
    assert "holds groups of model 'other-model', not 'smollm2-135m'; dropped" in caplog.text
    for content, says in [
        ('{"model": "smollm2-135m", "ready": [', "is not readable JSON (JSONDecodeError)"),
        ('{"model": "smollm2-135m", "ready": [{"not": "a group"}], "leases": {}}', "(ValidationError)"),
        ('{"model": "smollm2-135m", "ready": []}', "(KeyError)"),
    ]:
        path.write_text(content)
        with pytest.raises(StateError) as e:
            load_queue(path, "smollm2-135m")
        assert str(e.value).startswith(str(path)) and says in str(e.value)
        assert "delete it to start with an empty queue" in str(e.value)

"""learner/trackers.py without a learner: what reaches a tracker, once, across a resume; a tracker that
blocks or fails leaves metrics.jsonl whole; the real libraries made to fail. The real libraries storing a
real run are tested end to end in tests/learner/test_learner_e2e.py."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from learner import trackers as trackers_mod
from learner.metrics import STEP_KEYS, MetricsSink
from learner.trackers import Tracker, Trackers
from shared.cli import check_trackers
from shared.config import ConfigError, load_config
from shared.protocol import Completion, ScoredGroup


class Recorder(Tracker):
    """A tracker that records its calls (under W&B's name: report_to takes only real names)."""

    name = "wandb"
    calls: list = []
    gate: threading.Event | None = None  # set: log() waits for it
    fail: bool = False

    def start(self, run_id, config):
        self.calls.append(("start", run_id, config))
        return run_id or "run-1"

    def log(self, step, metrics, samples):
        if self.gate is not None:
            self.gate.wait()
        if self.fail:
            raise RuntimeError("tracker service unavailable")
        self.calls.append(("log", step, dict(metrics), samples))

    def finish(self, summary):
        self.calls.append(("finish", summary))


@pytest.fixture(autouse=True)
def _recorder():
    Recorder.calls, Recorder.gate, Recorder.fail = [], None, False
    yield


def _cfg(*extra: str):
    return load_config(None, ["learner.report_to=wandb", "learner.trackers.samples_every=2", *extra])


def _metrics(step: int) -> dict[str, float]:
    m = dict.fromkeys(STEP_KEYS, 0.0)
    m |= {"reward/mean": step / 10, "policy/version": float(step), "perf/pull_s": 1.0, "perf/train_s": 1.0}
    m["kl/ref"] = None  # beta = 0: no reference pass; not a number, so not sent
    return m


def _groups(version: int) -> list[ScoredGroup]:
    single = [
        Completion(token_ids=[5, 6], logprobs=[-0.1, -0.2], text="right", reward=1.0, rewards={"gsm8k": 1.0},
                   finish_reason="stop"),
        Completion(token_ids=[7], logprobs=[-0.3], text="wrong", reward=0.0, rewards={"gsm8k": 0.0},
                   finish_reason="length"),
    ]  # fmt: skip
    episode = Completion(
        token_ids=[1, 2, 3, 4, 5], logprobs=[-0.1, -0.1, -0.1], mask=[1, 1, 0, 0, 1], text="two turns",
        reward=0.5, rewards={"gsm8k": 0.5}, finish_reason="stop",
    )  # fmt: skip
    return [
        ScoredGroup(group_id="g1", prompt_id="p1", prompt_token_ids=[9, 9], answer="1",
                    policy_version=version, completions=single),
        ScoredGroup(group_id="g2", prompt_id="p2", prompt_token_ids=[8], answer="2",
                    policy_version=version, completions=[episode, episode]),
    ]  # fmt: skip


def _decode(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


def _sink(tmp_path: Path, cfg, log=print) -> tuple[MetricsSink, Trackers]:
    trackers = Trackers(cfg, tmp_path, log, kinds={"wandb": Recorder})
    return MetricsSink(tmp_path, cfg.learner.steps, tensorboard=False, trackers=trackers), trackers


def _logs(kind: str = "log") -> list[tuple]:
    return [c for c in Recorder.calls if c[0] == kind]


def test_every_step_reaches_the_tracker_once_with_config_samples_and_summary(tmp_path):
    cfg = _cfg("learner.trackers.samples_rows=3")
    sink, trackers = _sink(tmp_path, cfg)
    trackers.start(cfg.model_dump(), 0)
    for step in (1, 2, 3):
        sink.write(step, _metrics(step), _groups(step - 1), _decode)
    sink.close({"step": 3})

    starts = _logs("start")
    assert len(starts) == 1 and starts[0][1] is None and starts[0][2]["learner"]["report_to"] == ["wandb"]
    logs = _logs()
    assert [c[1] for c in logs] == [1, 2, 3]
    assert logs[1][2]["reward/mean"] == 0.2 and "kl/ref" not in logs[1][2]  # None is not a number
    assert logs[1][2]["tracker/wandb/errors"] == 0.0  # its own failures, counted beside the metrics
    # samples at step 1 and every samples_every (2) steps; whole groups first, samples_rows of them
    assert [c[3] is not None for c in logs] == [True, True, False]
    rows = logs[1][3]
    assert [(r["group"], r["completion"], r["version"]) for r in rows] == [
        ("g1", "right", 1), ("g1", "wrong", 1), ("g2", "two turns", 1)
    ]  # fmt: skip
    assert rows[0]["prompt"] == "t9 t9" and rows[0]["rewards"] == {"gsm8k": 1.0}
    # rewards [1, 0]: population std 0.5, so the advantages are +-0.5 / (0.5 + eps)
    assert rows[0]["advantage"] == pytest.approx(1.0, abs=1e-5)
    assert rows[1]["advantage"] == pytest.approx(-1.0, abs=1e-5)
    assert rows[2]["advantage"] == 0.0  # a degenerate group
    assert (rows[1]["tokens"], rows[1]["finish_reason"], rows[1]["turns"]) == (1, "length", 1)
    assert (rows[2]["tokens"], rows[2]["model_tokens"], rows[2]["turns"]) == (5, 3, 2)
    assert _logs("finish") == [("finish", {"step": 3})]
    book = json.loads((tmp_path / "trackers.json").read_text())
    assert book == {"wandb": {"id": "run-1", "step": 3, "evals": 0}}
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        1, 2, 3
    ]  # fmt: skip


def test_a_resume_continues_the_run_sends_what_it_missed_and_repeats_nothing(tmp_path):
    cfg = _cfg()
    sink, trackers = _sink(tmp_path, cfg)
    trackers.start(cfg.model_dump(), 0)
    for step in (1, 2):
        sink.write(step, _metrics(step), _groups(step - 1), _decode)
    for w in trackers.workers:  # the process dies here: no finish
        w.join(10)
    # Step 3 reached metrics.jsonl (after its checkpoint) but the process died before the tracker got it.
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 3, "time": 0.0, **_metrics(3)}) + "\n")
    (tmp_path / "evaluations.jsonl").write_text(json.dumps({"version": 3, "pass@1_greedy": 0.25}) + "\n")
    Recorder.calls = []

    sink, trackers = _sink(tmp_path, cfg)
    trackers.start(cfg.model_dump(), 3)  # resumed from step 3's checkpoint
    sink.write(4, _metrics(4), _groups(3), _decode)
    with (tmp_path / "evaluations.jsonl").open("a") as f:  # an evaluation after the last step
        f.write(json.dumps({"version": 4, "pass@1_greedy": 0.5}) + "\n")
    sink.close({"step": 4})

    assert [c[1] for c in _logs("start")] == ["run-1"]  # the same tracker run
    logs = _logs()
    assert [c[1] for c in logs] == [3, 4, 4]  # step 3 sent from metrics.jsonl; 1 and 2 not again
    assert logs[0][2]["reward/mean"] == 0.3 and logs[0][3] is None
    assert logs[1][2]["eval/pass@1_greedy"] == 0.25 and logs[1][2]["eval/version"] == 3.0
    assert logs[2][2] == {"eval/version": 4.0, "eval/pass@1_greedy": 0.5}  # into the last step's row
    assert json.loads((tmp_path / "trackers.json").read_text())["wandb"] == {
        "id": "run-1",
        "step": 4,
        "evals": 2,
    }

    Recorder.calls = []  # resumed again at the end: nothing is sent twice
    sink, trackers = _sink(tmp_path, cfg)
    trackers.start(cfg.model_dump(), 4)
    sink.close({"step": 4})
    assert _logs() == []


def test_a_tracker_that_hangs_neither_blocks_a_step_nor_loses_it(tmp_path):
    cfg = _cfg("learner.trackers.flush_s=30")
    sink, trackers = _sink(tmp_path, cfg)
    Recorder.gate = threading.Event()  # the tracker's service does not answer
    trackers.start(cfg.model_dump(), 0)
    steps = threading.Thread(target=lambda: [sink.write(s, _metrics(s)) for s in (1, 2, 3)])
    steps.start()
    steps.join(60)
    assert not steps.is_alive(), "a step waited on the tracker"
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    assert _logs() == []
    Recorder.gate.set()  # it answers again: everything queued goes out, in order
    sink.close({})
    assert [c[1] for c in _logs()] == [1, 2, 3]


def test_a_failing_tracker_is_reported_once_counted_and_training_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(trackers_mod, "_BACKOFF_S", (0.0,) * 5)
    cfg = _cfg()
    messages = []
    sink, trackers = _sink(tmp_path, cfg, messages.append)
    Recorder.fail = True
    trackers.start(cfg.model_dump(), 0)
    for step in (1, 2, 3):
        sink.write(step, _metrics(step), _groups(0), _decode)
    sink.close({})
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all("tracker/wandb/errors" in r and "tracker/wandb/dropped" in r for r in records)
    (worker,) = trackers.workers
    assert (worker.errors, worker.dropped) == (3 * trackers_mod._ATTEMPTS, 3)  # each step tried, then dropped
    failures = [m for m in messages if "RuntimeError" in m]
    assert failures == [
        "tracker wandb: RuntimeError: tracker service unavailable (training goes on; the tracker is retried "
        "in the background, its failures counted in tracker/wandb/errors)"
    ]
    assert _logs("finish") == [("finish", {})]  # the end still reaches it


def test_the_real_trackers_made_to_fail_leave_metrics_whole(tmp_path, monkeypatch):
    """MLflow's store under a regular file (unwritable even for root), Trackio's and W&B's clients
    raising: each failure counted, every step in metrics.jsonl."""
    pytest.importorskip("wandb")
    pytest.importorskip("trackio")
    pytest.importorskip("mlflow")
    import trackio
    import wandb

    monkeypatch.setattr(trackers_mod, "_BACKOFF_S", (0.0,) * 5)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    blocker = tmp_path / "a-file"
    blocker.write_text("")

    def refuse(*a, **k):
        raise ConnectionError("no route to host")

    monkeypatch.setattr(wandb, "init", refuse)
    monkeypatch.setattr(trackio.Run, "log", refuse)
    cfg = load_config(None, [
        "learner.report_to=wandb,trackio,mlflow", f"learner.trackers.trackio_dir={tmp_path / 'trackio'}",
        f"learner.trackers.mlflow_tracking_uri=file://{blocker}/mlruns", "learner.trackers.run_name=r",
    ])  # fmt: skip
    out = tmp_path / "run"
    out.mkdir()
    messages = []
    trackers = Trackers(cfg, out, messages.append)
    sink = MetricsSink(out, 2, tensorboard=False, trackers=trackers)
    trackers.start(cfg.model_dump(), 0)
    for step in (1, 2):
        sink.write(step, _metrics(step), _groups(0), _decode)
    sink.close({})
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    # every call tried _ATTEMPTS times, then dropped: 2 steps, the finish where it fails (W&B, MLflow: their
    # start failed, and each call tries it first; Trackio's finish logs nothing without a step)
    dropped = {w.tracker.name: (w.errors, w.dropped) for w in trackers.workers}
    assert dropped == {"wandb": (20, 4), "trackio": (10, 2), "mlflow": (20, 4)}
    for name in ("wandb", "trackio", "mlflow"):
        failed = [m for m in messages if m.startswith(f"tracker {name}: ") and "training goes on" in m]
        assert len(failed) == 1, messages


def test_a_tracker_that_is_not_installed_is_a_config_error(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "mlflow" else real(n, *a))
    check_trackers(load_config(None, ["learner.report_to=tensorboard"]))
    with pytest.raises(ConfigError) as e:
        check_trackers(load_config(None, ["learner.report_to=tensorboard,mlflow"]))
    assert str(e.value) == "learner.report_to names mlflow, not installed: pip install 'tandem[mlflow]'"
    # the learner's --check-config says it in one line; the server's does not ask (its image may lack it)
    from learner.__main__ import main as learner_main
    from rollout_server.__main__ import main as server_main

    with pytest.raises(SystemExit) as ended:
        learner_main(["--check-config", "--learner.report_to=mlflow"])
    assert ended.value.code == 2
    assert capsys.readouterr().err == (
        "error: learner.report_to names mlflow, not installed: pip install 'tandem[mlflow]'\n"
    )
    with pytest.raises(SystemExit) as ended:
        server_main(["--check-config", "--learner.report_to=mlflow"])
    assert ended.value.code == 0
    with pytest.raises(ConfigError, match="learner.report_to names a tracker twice"):
        load_config(None, ["learner.report_to=wandb,wandb"])
    with pytest.raises(ConfigError, match="learner.report_to.0: Input should be 'tensorboard'"):
        load_config(None, ["learner.report_to=neptune"])


def test_learner_evaluate_run_dir_appends_what_the_trackers_send(tmp_path, monkeypatch, capsys):
    from learner import evaluate as evaluate_mod

    class Client:
        def __init__(self, url, token=None):
            pass

        def wait_ready(self, timeout):
            pass

    results = iter(
        [{"version": 0, "pass@1_greedy": 0.1, "task": "gsm8k"}, {"version": 2, "pass@1_greedy": 0.4}]
    )
    monkeypatch.setattr(evaluate_mod, "RolloutClient", Client)
    monkeypatch.setattr(evaluate_mod, "evaluate", lambda *a: next(results))
    for _ in range(2):
        assert evaluate_mod.main(["--limit", "4", "--run-dir", str(tmp_path)]) == 0
    lines = [json.loads(line) for line in (tmp_path / "evaluations.jsonl").read_text().splitlines()]
    assert [r["version"] for r in lines] == [0, 2]

    cfg = _cfg()
    sink, trackers = _sink(tmp_path, cfg)
    trackers.start(cfg.model_dump(), 0)
    sink.write(1, _metrics(1))
    sink.close({})
    (log,) = _logs()
    # both evaluations since the last step, the newest winning a key; text is not a number: not sent
    assert {k: v for k, v in log[2].items() if k.startswith("eval/")} == {
        "eval/version": 2.0,
        "eval/pass@1_greedy": 0.4,
    }


def test_an_unreadable_evaluations_file_costs_the_evaluations_not_the_step(tmp_path):
    (tmp_path / "evaluations.jsonl").write_bytes(b'{"version": 1, "pass@1": \xff}\n')  # not UTF-8
    cfg = _cfg()
    sink, trackers = _sink(tmp_path, cfg)
    trackers.start(cfg.model_dump(), 0)
    sink.write(1, _metrics(1))
    sink.close({})
    assert [c[1] for c in _logs()] == [1]
    assert not any(k.startswith("eval/") for k in _logs()[0][2])

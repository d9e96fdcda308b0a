"""Faults with real processes on loopback: the rollout server killed and restarted under a running
learner, SIGTERM to either process, and the learner asked to stop while the server is gone.

The server runs the HF backend here: it restarts in seconds, and what is under test is the processes'
behaviour, not the engine (the vLLM server's own SIGTERM is tested in test_server_e2e.py)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from tests.helpers import (
    SMALL_LEARNER,
    SMALL_RUN,
    Proc,
    jsonl,
    proc_env,
    server_args,
    start_learner,
    start_server,
    wait_for,
)

pytestmark = pytest.mark.slow

SERVER = [
    *SMALL_RUN,
    "--server.backend=hf",
    "--sampling.max_new_tokens=32",
    "--server.queue_size=4",
    "--server.lease_s=300",
]
LEARNER = [*SMALL_LEARNER, "--learner.keep_every=1", "--learner.server_retry_s=600"]


def _learner(url: str, out: Path, extra: list[str], log: Path) -> Proc:
    return start_learner(url, out, log, [*SERVER, *LEARNER, *extra])


def _restart_server(tmp: Path, port: int, log_name: str) -> Proc:
    """The same port and state_dir as the killed one: what a supervisor (compose, SLURM) would do."""
    return Proc(server_args("deploy/configs/cpu.toml", port, tmp / "server", SERVER), tmp / log_name)


def test_a_server_killed_mid_generation_a_stop_while_it_is_gone_a_resume_and_a_stop_of_both(
    tmp_path, procs, model_dir
):
    """One run, so that the server and the learner start twice rather than six times: the server killed
    while generating; the learner retries, is stopped by SIGTERM while the server is gone and checkpoints;
    the restarted server serves the last version from its own store and goes on from its saved cursor; the
    learner resumes; then SIGTERM stops the learner after a step and the server while it generates."""
    server, client = start_server(tmp_path, SERVER)
    procs.append(server)
    port = int(client.url.rsplit(":", 1)[1])
    events_file, out = tmp_path / "server" / "events.jsonl", tmp_path / "run"
    metrics = out / "metrics.jsonl"
    learner = _learner(client.url, out, ["--learner.steps=50"], tmp_path / "learner.log")
    procs.append(learner)

    # Kill right after the wake that follows step 2's publish: the server is generating step 3's groups.
    wait_for(
        "the server wakes after publishing v2",
        lambda: (
            [e["event"] for e in jsonl(events_file) if e["event"] in ("publish", "wake")][-2:]
            == ["publish", "wake"]
            and any(e["event"] == "publish" and e["version"] == 2 for e in jsonl(events_file))
        ),
        [server, learner],
    )
    server.signal(signal.SIGKILL)
    server.wait(timeout=30)
    killed_at = time.time()
    cursor_at_kill = json.loads((tmp_path / "server" / "cursor.json").read_text())

    # The learner notices at once (its connection is reset), says so, and keeps retrying ...
    wait_for("the learner reports the dead server", lambda: "retrying in" in learner.log(), [learner], 60)
    assert time.time() - killed_at < 60
    time.sleep(5)  # a few retries' worth of a server that is really gone
    assert learner.alive()
    # ... until a SIGTERM, which checkpoints the last step and ends it with 0
    learner.signal(signal.SIGTERM)
    assert learner.wait(timeout=120) == 0, learner.log()[-4000:]
    step = int((out / "checkpoints" / "latest").read_text().removeprefix("step-"))
    assert step >= 2 and step == len(jsonl(metrics))
    assert "stop requested while the rollout server was unreachable" in learner.log()

    # A restarted server (same port and state_dir, as a supervisor would) and --resume go on from there.
    restarted = _restart_server(tmp_path, port, "server2.log")
    procs.append(restarted)
    resumed = _learner(client.url, out, ["--learner.steps=50", "--resume"], tmp_path / "2.log")
    procs.append(resumed)
    wait_for("the resumed learner trains two steps", lambda: len(jsonl(metrics)) >= step + 2, [resumed])
    assert f"at step {step}, policy v{step}" in resumed.log()
    # The restarted server restored v2 from its own adapter store and produced with it before any publish.
    assert "serving policy v2" in restarted.log()
    after = [e for e in jsonl(events_file) if e["t"] > killed_at]
    first_group = next(e for e in after if e["event"] == "group")
    first_publish = next(e for e in after if e["event"] == "publish")
    assert first_group["version"] == 2 and first_group["t"] < first_publish["t"]
    assert first_publish["version"] == 3
    # Its cursor continued from where the killed one had saved it, not from the start of the epoch.
    cursor_now = json.loads((tmp_path / "server" / "cursor.json").read_text())
    position = (cursor_now["epoch"], cursor_now["position"])
    assert position > (cursor_at_kill["epoch"], cursor_at_kill["position"])

    # SIGTERM to the learner: it finishes its step, checkpoints, publishes, and ends with 0.
    resumed.signal(signal.SIGTERM)
    assert resumed.wait(timeout=300) == 0, resumed.log()[-4000:]
    last = len(jsonl(metrics))
    assert "(stopped by signal)" in resumed.log()
    assert (out / "checkpoints" / "latest").read_text() == f"step-{last}"
    assert client.health().policy_version == last  # the step it finished was published before it left
    assert [r["step"] for r in jsonl(metrics)] == list(range(1, last + 1))
    trained = jsonl(out / "groups.jsonl")
    ids = [g["group_id"] for t in trained for g in t["groups"]]
    prompts = [g["prompt_id"] for t in trained for g in t["groups"]]
    assert len(ids) == len(set(ids)) == 2 * last, "a group was trained twice"
    assert len(prompts) == len(set(prompts)), "a prompt came round again: the cursor was reset"

    # The server is generating (the learner woke it after its last step) when it gets SIGTERM.
    restarted.signal(signal.SIGTERM)
    assert restarted.wait(timeout=60) == 0, restarted.log()[-4000:]
    assert "Application shutdown complete" in restarted.log()


def test_a_server_that_keeps_serving_old_weights_stops_the_learner_within_a_step(tmp_path, procs, model_dir):
    """TANDEM_FAULT_SERVE_PREVIOUS: the server acknowledges v2 but keeps sampling with v1's weights (as one
    whose adapter never reaches its engine). Step 3 trains groups stamped v2: the learner's own v2 log-probs
    of their tokens are far from the sampler's, so it stops with one line naming v2, the step unrecorded
    and its groups given back, none acked. (lr 0.05: each step moves the policy well past fp32's noise.)"""
    # a reward that tells any two completions of different parity apart: every step has a gradient
    (tmp_path / "parity.py").write_text(
        "def odd(completion, answer, prompt, metadata):\n    return len(completion) % 2\n"
    )
    rewards = [f'--reward.functions=["{tmp_path / "parity.py"}:odd"]']
    env = proc_env(TANDEM_FAULT_SERVE_PREVIOUS="1")
    server, client = start_server(tmp_path, [*SERVER, *rewards, "--sampling.max_new_tokens=16"], env=env)
    procs.append(server)
    out = tmp_path / "run"
    extra = ["--learner.steps=4", "--learner.lr=0.05", *rewards]
    learner = _learner(client.url, out, [*extra, "--sampling.max_new_tokens=16"], tmp_path / "learner.log")
    procs.append(learner)
    assert learner.wait(timeout=600) == 3, learner.log()[-4000:]
    errors = [line for line in learner.log().splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "does not serve the weights published as v2" in errors[0], errors
    assert client.url in errors[0] and "served_policy_max_gap" in errors[0]
    assert [r["step"] for r in jsonl(out / "metrics.jsonl")] == [1, 2]  # step 3 is not recorded
    assert (out / "checkpoints" / "latest").read_text() == "step-2"
    events = jsonl(tmp_path / "server" / "events.jsonl")
    leases = [e["lease_id"] for e in events if e["event"] == "lease"]
    acked = {e["lease_id"] for e in events if e["event"] == "ack"}
    released = {e["lease_id"] for e in events if e["event"] == "release"}
    assert leases[-1] in released and leases[-1] not in acked  # step 3's groups went back
    assert "TANDEM_FAULT_SERVE_PREVIOUS=1: v2 acknowledged, the weights served before kept" in server.log()

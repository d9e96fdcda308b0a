"""The SLURM launch logic, on one machine: the server job publishes its URL in the run folder and the
learner job finds it there."""

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, free_port, proc_env

SCRIPTS = sorted((REPO / "deploy" / "slurm").iterdir())
# A tiny run on the hf backend, for the jobs that start real processes (on a tiny model: the `small`
# fixture); the learner's part after LEARNER.
SMALL = [
    "--sampling.group_size=2",
    "--sampling.max_new_tokens=8",
    "--server.prompts_per_batch=2",
    "--server.backend=hf",
    "--server.host=127.0.0.1",
]
LEARNER = [
    "--learner.prompts_per_step=2",
    "--learner.micro_batch_size=2",
    "--learner.grad_accum=2",
    "--learner.dynamic_sampling=false",
]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert os.access(script, os.X_OK)


def test_learner_gives_up_clearly_without_a_server(tmp_path):
    env = proc_env(TANDEM_RUN_DIR=str(tmp_path), TANDEM_WAIT_S="2", TANDEM_PYTHON=sys.executable)
    out = subprocess.run(
        ["deploy/slurm/run.sh", "learner", "deploy/configs/cpu.toml"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "server_url" in out.stderr


@pytest.fixture
def small(tiny_model_dir) -> list[str]:
    """SMALL on a tiny model of SmolLM2's tokenizer: what the two-server test checks is how the jobs find
    each other, not what a step learns. (The resubmission test keeps SmolLM2: its server is moved after
    step 2 while the learner is still at work, and a tiny model's steps end before the move lands.)"""
    return [*SMALL, f"--model.name={tiny_model_dir}"]


def _server_job(env: dict[str, str], log: Path, small: list[str]) -> subprocess.Popen:
    """run.sh server on `small`, in a session of its own (as a job: a signal can reach all its processes)."""
    return subprocess.Popen(
        ["deploy/slurm/run.sh", "server", "deploy/configs/cpu.toml", *small],
        env=env,
        cwd=REPO,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


@pytest.mark.slow
def test_server_and_learner_find_each_other_through_the_run_dir(tmp_path, small):
    """Two server jobs (TANDEM_NUM_SERVERS, each its shard: TANDEM_SHARD as a job array's task id would be)
    and the learner job find each other through the run folder; every server gets the published v1. One
    server job: the resubmission test below (its learner job finds job A's URL, then B's)."""
    servers = 2
    ports = [free_port() for _ in range(servers)]
    started = []
    for k, port in enumerate(ports):
        env = proc_env(
            TANDEM_RUN_DIR=str(tmp_path), TANDEM_PORT=str(port), TANDEM_HOST="127.0.0.1",
            TANDEM_PYTHON=sys.executable, OMP_NUM_THREADS="1", TANDEM_NUM_SERVERS=str(servers),
            TANDEM_SHARD=str(k),
        )  # fmt: skip
        started.append(_server_job(env, tmp_path / f"server{k}.log", small))
    env = proc_env(TANDEM_RUN_DIR=str(tmp_path), TANDEM_PYTHON=sys.executable, OMP_NUM_THREADS="1",
                   TANDEM_NUM_SERVERS=str(servers))  # fmt: skip
    try:
        learner = subprocess.run(
            [
                "deploy/slurm/run.sh",
                "learner",
                "deploy/configs/cpu.toml",
                *small,
                *LEARNER,
                "--learner.steps=1",
            ],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert learner.returncode == 0, learner.stdout[-3000:] + learner.stderr[-3000:]
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        assert (tmp_path / "learner" / "adapters" / "v1" / "adapter_model.safetensors").is_file()
        assert [(tmp_path / "server_urls" / str(k)).read_text().strip() for k in range(servers)] == urls
        assert f"learner connecting to {json.dumps(urls)}" in learner.stdout
        for k in range(servers):  # each its own state and shard, and each got v1
            assert (tmp_path / f"server-{k}" / "adapters" / "v1").is_dir()
            assert f"shard {k} of {servers}" in (tmp_path / f"server{k}.log").read_text()
    finally:
        for server in started:
            os.killpg(server.pid, 15)
            server.wait(timeout=60)


@pytest.mark.parametrize(
    ("config", "env", "gpus"),
    [
        ("deploy/configs/gpu-8gb-timeslice.toml", {}, "0"),  # one GPU, shared with the server
        ("deploy/configs/gpu-2x-split.toml", {}, "1"),  # the server has GPU 0
        ("deploy/configs/gpu-2x-split.toml", {"TANDEM_LEARNER_GPUS": "1,2,3"}, "1,2,3"),
        ("deploy/configs/gpu-2x-split.toml", {"CUDA_VISIBLE_DEVICES": "5"}, "5"),  # the user's choice
        ("deploy/configs/gpu-2x-split.toml", {"SLURM_JOB_ID": "42"}, "unset"),  # SLURM assigns them
    ],
)
def test_on_one_machine_each_process_gets_its_gpus(tmp_path, config, env, gpus):
    """The learner's launcher replaced by a script that prints the GPUs it was given."""
    show = tmp_path / "show.sh"
    show.write_text('#!/bin/sh\necho "gpus=${CUDA_VISIBLE_DEVICES:-unset}"\n')
    show.chmod(0o755)
    (tmp_path / "server_url").write_text("http://127.0.0.1:1")
    base = proc_env(TANDEM_RUN_DIR=str(tmp_path), TANDEM_PYTHON=sys.executable, TANDEM_LAUNCHER=str(show))
    base.pop("CUDA_VISIBLE_DEVICES", None)
    base.pop("SLURM_JOB_ID", None)
    out = subprocess.run(
        ["deploy/slurm/run.sh", "learner", config],
        env=base | env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert f"gpus={gpus}" in out.stdout.splitlines()


# The learner replaced by a script that logs each start (its server option) and each SIGTERM. A learner
# started at a URL containing "gone" gives up at once (exit 3, as after learner.server_retry_s) once the
# server has come back elsewhere, as a resubmitted job on another node would.
STUB = """#!/bin/bash
for a in "$@"; do
  case "$a" in --learner.server_urls*|--resume) echo "start $a" >> "$TANDEM_RUN_DIR/log";; esac
done
case "$*" in *gone*) echo http://b:2 > "$TANDEM_RUN_DIR/server_url.tmp"; mv "$TANDEM_RUN_DIR/server_url.tmp" \
  "$TANDEM_RUN_DIR/server_url"; exit 3;; esac
trap 'echo term >> "$TANDEM_RUN_DIR/log"; exit 0' TERM
while :; do sleep 0.05; done
"""


def _supervised(tmp_path, servers: int = 1, script: str = STUB, **env) -> subprocess.Popen:
    stub = tmp_path / "learner.sh"
    stub.write_text(script)
    stub.chmod(0o755)
    env = proc_env(
        TANDEM_RUN_DIR=str(tmp_path), TANDEM_PYTHON=sys.executable, TANDEM_LAUNCHER=str(stub),
        TANDEM_URL_POLL_S="1", TANDEM_NUM_SERVERS=str(servers), SLURM_JOB_ID="1", **env,
    )  # fmt: skip
    return subprocess.Popen(
        ["deploy/slurm/run.sh", "learner", "deploy/configs/cpu.toml"],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _publish(path: Path, url: str) -> None:
    path.parent.mkdir(exist_ok=True)
    (tmp := path.with_suffix(".tmp")).write_text(url + "\n")
    tmp.replace(path)


def _log_until(tmp_path, lines: int) -> list[str]:
    log = tmp_path / "log"
    for _ in range(300):
        got = log.read_text().splitlines() if log.exists() else []
        if len(got) >= lines:
            return got
        time.sleep(0.05)
    raise AssertionError(f"the learner log has {got}, wanted {lines} lines")


def test_learner_follows_a_server_that_moved_to_another_node(tmp_path):
    """A resubmitted server job on another node writes a new URL: the learner gets SIGTERM and starts
    again at the new URL with --resume; a URL rewritten unchanged (same node) restarts nothing; SIGTERM
    to the job reaches the learner, and the job exits with its status."""
    _publish(tmp_path / "server_url", "http://a:1")
    job = _supervised(tmp_path)
    try:
        assert _log_until(tmp_path, 2) == ["start --learner.server_urls=http://a:1", "start --resume"]
        _publish(tmp_path / "server_url", "http://a:1")  # the same node again
        (tmp_path / "server_url").unlink()  # and a server between jobs (run.sh removes the file)
        time.sleep(1.5)
        _publish(tmp_path / "server_url", "http://b:2")
        restarted = ["term", "start --learner.server_urls=http://b:2", "start --resume"]
        assert _log_until(tmp_path, 5)[2:] == restarted
        job.send_signal(15)
        out, _ = job.communicate(timeout=30)
    finally:
        job.kill()
    assert job.returncode == 0, out
    assert (tmp_path / "log").read_text().splitlines()[5:] == ["term"]
    assert "the rollout server moved to http://b:2" in out


def test_learner_that_gave_up_starts_again_where_the_server_came_back(tmp_path):
    _publish(tmp_path / "server_url", "http://gone:1")
    job = _supervised(tmp_path)
    try:
        assert _log_until(tmp_path, 4) == [
            "start --learner.server_urls=http://gone:1", "start --resume",
            "start --learner.server_urls=http://b:2", "start --resume",
        ]  # fmt: skip
        job.send_signal(15)
        out, _ = job.communicate(timeout=30)
    finally:
        job.kill()
    assert job.returncode == 0 and "the learner exited 3; the rollout server is now at http://b:2" in out


def test_learner_exit_status_is_the_jobs_when_no_server_moved(tmp_path):
    """It gave up and its server is still where it was: the job fails with the learner's status."""
    _publish(tmp_path / "server_url", "http://gone:1")
    job = _supervised(tmp_path, script=STUB.replace("echo http://b:2", "echo http://gone:1"))
    out, _ = job.communicate(timeout=30)
    assert job.returncode == 3, out
    started = ["start --learner.server_urls=http://gone:1", "start --resume"]
    assert (tmp_path / "log").read_text().splitlines() == started


def test_learner_follows_one_of_several_servers(tmp_path):
    urls = tmp_path / "server_urls"
    _publish(urls / "0", "http://a:1")
    _publish(urls / "1", "http://c:3")
    job = _supervised(tmp_path, servers=2)
    try:
        assert _log_until(tmp_path, 2)[0] == 'start --learner.server_urls=["http://a:1", "http://c:3"]'
        _publish(urls / "1", "http://d:4")
        assert _log_until(tmp_path, 5)[2:4] == [
            "term",
            'start --learner.server_urls=["http://a:1", "http://d:4"]',
        ]
        job.send_signal(15)
        job.communicate(timeout=30)
    finally:
        job.kill()
    assert job.returncode == 0


@pytest.mark.slow
def test_a_server_job_resubmitted_elsewhere_is_followed_by_the_learner_job(tmp_path):
    """The real thing on one machine: server job A is stopped as `scancel` stops it (SIGTERM to all its
    processes) after the learner's step 2, and comes back as job B at another URL with the same run folder;
    the learner job follows it there, resumes at step 2 and finishes. A ends cleanly (exit 0)."""
    common = dict(TANDEM_RUN_DIR=str(tmp_path), TANDEM_PYTHON=sys.executable, OMP_NUM_THREADS="1")

    def server_job(port: int) -> subprocess.Popen:
        env = proc_env(TANDEM_PORT=str(port), TANDEM_HOST="127.0.0.1", **common)
        return _server_job(env, tmp_path / f"server-{port}.log", SMALL)

    first, second = free_port(), free_port()
    log = tmp_path / "learner-job.log"
    jobs = [server_job(first)]
    learner = subprocess.Popen(
        ["deploy/slurm/run.sh", "learner", "deploy/configs/cpu.toml", *SMALL, *LEARNER, "--learner.steps=4"],
        env=proc_env(TANDEM_URL_POLL_S="1", **common),
        cwd=REPO,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 600
        while "step    2/" not in log.read_text() and time.monotonic() < deadline:
            assert learner.poll() is None, log.read_text()[-3000:]
            time.sleep(1)
        os.killpg(jobs[0].pid, 15)  # scancel: every process of the job
        assert jobs[0].wait(timeout=120) == 0, (tmp_path / f"server-{first}.log").read_text()[-3000:]
        jobs.append(server_job(second))
        assert learner.wait(timeout=600) == 0, log.read_text()[-3000:]
    finally:
        learner.kill()
        for job in jobs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, 15)
            job.wait(timeout=60)
    out = log.read_text()
    assert f"learner connecting to http://127.0.0.1:{first}" in out  # job A's URL, from the run folder
    assert f"the rollout server moved to http://127.0.0.1:{second}" in out
    assert "resumed from" in out and "at step 2" in out
    assert "step    4/4" in out
    steps = [
        json.loads(line)["step"] for line in (tmp_path / "learner" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [1, 2, 3, 4]
    assert (tmp_path / "server" / "adapters" / "v4").is_dir()  # published to job B

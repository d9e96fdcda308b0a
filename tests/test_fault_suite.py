"""The faults a bad day brings, against real processes: the real DeepSpeed learner, a real rollout server
(HF backend: it restarts in seconds, and the behaviour under test is the processes', not the engine's;
the vLLM server gets the adapter checks in test_server_e2e.py) and SmolLM2-135M, on loopback (the kill
points on a tiny model of SmolLM2's tokenizer: six learner starts, and what they test is the order of
effects, not what a step learns).

- the learner SIGKILLed at three points of a step, with keep_every = 10, resumes and trains every
  group exactly once; a resume that finds the server ahead of its checkpoint reconciles both;
- a disk that fills and an out_dir that turns read-only mid-run: one line, the server awake, and --resume
  completes;
- a NaN adapter is refused, and one planted in the server's store is skipped at restart;
- a 400 MB body without a token is refused before it is read;
- SIGTERM during a long evaluation request ends the server within its promised bound.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from learner.client import ServerError
from tests.helpers import (
    SMALL_LEARNER,
    SMALL_RUN,
    TOKEN,
    Proc,
    jsonl,
    make_adapter,
    make_nan_adapter,
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
    "--server.lease_s=600",
]
LEARNER = [
    *SMALL_LEARNER,
    "--learner.keep_every=10",  # the shipped value: kills fall between the kept checkpoints
    "--learner.server_retry_s=60",
]


def _learner(url: str, out: Path, log: Path, *extra: str, crash_at: str | None = None) -> Proc:
    env = {"TANDEM_CRASH_AT": crash_at} if crash_at else {}
    return start_learner(url, out, log, [*SERVER, *LEARNER, *extra], **env)


def _trained_once(out: Path, steps: list[int]) -> list[str]:
    trained = jsonl(out / "groups.jsonl")
    assert [t["step"] for t in trained] == steps
    ids = [g["group_id"] for t in trained for g in t["groups"]]
    assert len(ids) == len(set(ids)) == 2 * len(steps), "a group was trained twice, or lost"
    return ids


def _events(state_dir: Path, since: float, kind: str) -> list[dict]:
    return [e for e in jsonl(state_dir / "events.jsonl") if e["t"] >= since and e["event"] == kind]


def _one_error_line(log: str) -> str:
    errors = [line for line in log.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in log, log[-4000:]
    return errors[0]


# -- the learner killed between effects -------------------------------------------------------------------
def test_learner_killed_at_each_point_of_a_step_resumes_and_trains_every_group_once(
    tmp_path, procs, tiny_model_dir
):
    """Six learner starts: on a tiny model (tests.helpers.make_tiny_model), since what is under test is
    which effects happened before each kill, not what the steps learn (174 s on SmolLM2, 97 s on it)."""
    tiny = f"--model.name={tiny_model_dir}"
    server, client = start_server(tmp_path, [*SERVER, tiny])
    procs.append(server)
    out, state_dir = tmp_path / "run", tmp_path / "server"

    # (kill point, step): after the checkpoint and before the ack; between ack and publish; after the
    # publish (the server asleep at the new version); while training (its groups leased, not acked).
    # keep_every = 10: none of these is a kept one.
    served_after = {"before_ack": 0, "before_publish": 1, "after_publish": 3, "in_training": 3}
    points = [("before_ack", 1), ("before_publish", 2), ("after_publish", 3), ("in_training", 4)]
    for n, (point, step) in enumerate(points):
        resume = ["--resume"] if n else []
        crash_at = f"{point}:{step}"
        p = _learner(
            client.url, out, tmp_path / f"{n}.log", tiny, "--learner.steps=4", *resume, crash_at=crash_at
        )
        procs.append(p)
        assert p.wait(timeout=600) == -signal.SIGKILL, p.log()[-4000:]
        assert f"TANDEM_CRASH_AT={point}:{step}: SIGKILL" in p.log()
        assert client.health().policy_version == served_after[point]
        if n:
            assert f"at step {step - 1}, policy v{step - 1}" in p.log()  # resumed from the kill before

    acked_before = {e["lease_id"] for e in _events(state_dir, 0, "ack")}
    last = _learner(client.url, out, tmp_path / "4.log", tiny, "--learner.steps=4", "--resume")
    procs.append(last)
    assert last.wait(timeout=600) == 0, last.log()[-4000:]
    log = last.log()
    assert "at step 3, policy v3" in log and "done at step 4; server serves v4" in log
    # the groups the learner killed in training had leased go back to the queue, and are trained once
    assert "released 2 group(s) pulled before the restart but never trained" in log
    assert "published v" not in log  # the server already served v3 (asleep: it was woken)

    _trained_once(out, [1, 2, 3, 4])
    health = client.health()
    assert (health.policy_version, health.sleeping, health.leased) == (4, False, 0)
    leased = {e["lease_id"] for e in _events(state_dir, 0, "lease")}
    settled = {e["lease_id"] for kind in ("ack", "release") for e in _events(state_dir, 0, kind)}
    assert leased <= settled  # no lease left to run out
    assert acked_before < settled  # the last learner settled what the killed ones left
    # Every trained step has its metrics record, the killed ones too (written with the checkpoint).
    assert [r["step"] for r in jsonl(out / "metrics.jsonl")] == [1, 2, 3, 4]
    # Checkpoints of trainable weights only, the newest two kept (no 10th step yet to keep for good).
    kept = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    assert kept == ["step-3", "step-4"]
    size_mb, base_mb = _dir_mb(out / "checkpoints" / "step-4"), _dir_mb(Path(tiny_model_dir))
    assert size_mb < base_mb / 4, f"a checkpoint of LoRA + its optimizer state is {size_mb:.2f} MB"

    # The server ahead of the checkpoint (here: `latest` pointed back at step 3 by hand): the resume
    # re-publishes its weights as the next version, drops v4's groups as stale, and records step 4 anew.
    (out / "checkpoints" / "latest").write_text("step-3")
    again = _learner(client.url, out, tmp_path / "5.log", tiny, "--learner.steps=4", "--resume")
    procs.append(again)
    assert again.wait(timeout=600) == 0, again.log()[-4000:]
    log = again.log()
    assert "WARNING: the server serves v4, ahead of this learner's checkpoint (step 3, v3)" in log
    assert "groups.jsonl: dropped 1 line(s) after step 3" in log
    assert "metrics.jsonl: dropped 1 line(s) after step 3" in log
    assert "published v5 to the server (it served v4)" in log and "done at step 4; server serves v6" in log
    ids = _trained_once(out, [1, 2, 3, 4])
    step4 = jsonl(out / "groups.jsonl")[-1]["groups"]
    assert {g["policy_version"] for g in step4} == {5}  # made by the re-published weights
    assert client.health().policy_version == 6 and len(ids) == 8


# -- out_dir fills up, or turns read-only ---------------------------------------------------------------
def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


@pytest.fixture
def small_disk(tmp_path):
    """A 200 MB tmpfs for out_dir; root and mount rights needed (as in CI here)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        _mount("-t", "tmpfs", "-o", "size=200m", "tmpfs", str(disk))
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot mount a tmpfs here ({e}): the disk-full test needs root")
    yield disk
    subprocess.run(["umount", "-R", str(disk)], capture_output=True)


def test_a_full_disk_and_a_read_only_out_dir_stop_with_one_line_and_resume(
    tmp_path, procs, small_disk, model_dir
):
    server, client = start_server(tmp_path, SERVER)
    procs.append(server)
    out = small_disk / "run"
    opts = ["--learner.min_free_mb=1", "--learner.steps=4"]

    first = _learner(client.url, out, tmp_path / "1.log", *opts)
    procs.append(first)
    wait_for("step 1 is done", lambda: len(jsonl(out / "metrics.jsonl")) >= 1, [first])
    # Fill the disk but 4 MB: the next adapter (7 MB) or checkpoint (29 MB) does not fit.
    free = shutil.disk_usage(small_disk).free
    with (small_disk / "ballast").open("wb") as f:
        f.truncate(0)
        for _ in range((free - 4 * 2**20) // 2**20):
            f.write(b"\0" * 2**20)
    assert first.wait(timeout=600) == 2
    line = _one_error_line(first.log())
    assert "could not write" in line and "No space left on device" in line and "--resume" in line
    health = client.health()
    assert not health.sleeping and health.leased == 0  # awake, and the step's groups given back

    (small_disk / "ballast").unlink()
    second = _learner(client.url, out, tmp_path / "2.log", *opts[:1], "--learner.steps=2", "--resume")
    procs.append(second)
    assert second.wait(timeout=600) == 0, second.log()[-4000:]

    third = _learner(client.url, out, tmp_path / "3.log", *opts, "--resume")
    procs.append(third)
    wait_for("step 3 is done", lambda: len(jsonl(out / "metrics.jsonl")) >= 3, [third])
    # out_dir turns read-only (a bind mount of itself, remounted ro: open files stay, new writes fail).
    _mount("--bind", str(out), str(out))
    _mount("-o", "remount,bind,ro", str(out))
    assert third.wait(timeout=600) == 2
    line = _one_error_line(third.log())
    assert "could not write" in line and "Read-only file system" in line
    health = client.health()
    assert not health.sleeping and health.leased == 0

    subprocess.run(["umount", str(out)], check=True)
    last = _learner(client.url, out, tmp_path / "4.log", *opts, "--resume")
    procs.append(last)
    assert last.wait(timeout=600) == 0, last.log()[-4000:]
    assert "done at step 4" in last.log()
    _trained_once(out, [1, 2, 3, 4])
    assert client.health().leased == 0


# -- the server: adapters, bodies, shutdown ----------------------------------------------------------------
def _rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


def _dir_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def _post_unread(port: int, head: bytes, size: int) -> tuple[bytes, int]:
    """Send headers announcing `size` body bytes, then body until the server answers; return the answer
    and how many body bytes went out (the server closes the connection without reading the rest)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(head + f"Content-Length: {size}\r\n\r\n".encode())
    sock.settimeout(0.05)
    sent, chunk = 0, b"x" * 2**20
    answer = b""
    while sent < size:
        try:
            answer = sock.recv(4096)
            break
        except TimeoutError:
            pass
        try:
            sent += sock.send(chunk)
        except (BrokenPipeError, ConnectionResetError):
            break
    sock.settimeout(10)
    answer = answer or sock.recv(4096)
    sock.close()
    return answer, sent


def test_server_refuses_bad_adapters_and_unauthenticated_bodies_and_stops_on_time(tmp_path, procs, model_dir):
    spool = tmp_path / "spool"  # the server's temp dir: where an upload would be spooled
    spool.mkdir()
    env = proc_env(TMPDIR=str(spool))
    server, client = start_server(tmp_path, SERVER, env=env)
    procs.append(server)
    port = int(client.url.rsplit(":", 1)[1])

    good = make_adapter(model_dir, tmp_path / "good", r=8)
    client.publish(1, good)
    nan = make_nan_adapter(good, tmp_path / "nan")
    with pytest.raises(ServerError) as e:
        client.publish(2, nan)
    assert e.value.status == 422 and "non-finite" in str(e.value)
    time.sleep(3)  # long enough for a poisoned producer to have died (it did within ~10 s)
    assert client.health().policy_version == 1
    assert client.pull(1, wait_s=30).groups  # still producing

    # 400 MB without a token: 401 from the headers, the body never read, spooled or held. (Asleep, so
    # no generation batch moves the server's memory while it is measured.)
    client.sleep()
    time.sleep(1)
    rss, spooled = _rss_mb(server.proc.pid), _dir_mb(spool)
    head = b"POST /v1/adapters HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
    answer, sent = _post_unread(port, head, 400 * 2**20)
    assert answer.startswith(b"HTTP/1.1 401"), answer
    assert sent < 400 * 2**20
    assert abs(_rss_mb(server.proc.pid) - rss) < 20 and abs(_dir_mb(spool) - spooled) < 20
    # 513 MB with the token: over server.max_adapter_mb, refused at once from Content-Length.
    authorized = head + f"Authorization: Bearer {TOKEN}\r\n".encode()
    answer, _ = _post_unread(port, authorized, 513 * 2**20)
    assert answer.startswith(b"HTTP/1.1 413"), answer
    client.wake()
    # Numbers from outside are bounded: a version past the protocol's range is refused, not served.
    r = httpx.post(
        f"{client.url}/v1/adapters",
        data={"version": str(2**40)},
        files={"adapter_config": b"{}", "adapter_model": b""},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert r.status_code == 422 and client.health().policy_version == 1

    # A NaN version planted in the store (a bad disk, or an older server that accepted it): skipped.
    server.stop()
    shutil.copytree(nan, tmp_path / "server" / "adapters" / "v2")
    args = server_args("deploy/configs/cpu.toml", port, tmp_path / "server", SERVER)
    restarted = Proc(args, tmp_path / "s2.log", env=env)
    procs.append(restarted)
    wait_for("the restarted server is healthy", lambda: _healthy(client), [restarted], timeout=300)
    assert client.health().policy_version == 1
    assert "stored adapter v2 is refused" in restarted.log() and "non-finite" in restarted.log()

    # SIGTERM while a long evaluation request runs (16 prompts x n = 64): cancelled, exit within 10 s.
    body = {"prompts": [f"Count from {i} to 500." for i in range(16)], "n": 64, "temperature": 1.0}
    answers = []

    def evaluate():
        auth = {"Authorization": f"Bearer {TOKEN}"}
        answers.append(
            httpx.post(f"{client.url}/v1/generate", json=body, headers=auth, timeout=600).status_code
        )

    thread = threading.Thread(target=evaluate)
    thread.start()
    time.sleep(8)
    assert thread.is_alive()  # still generating
    signalled = time.time()
    os.kill(restarted.proc.pid, signal.SIGTERM)
    assert restarted.wait(timeout=30) == 0
    took = time.time() - signalled
    thread.join(timeout=30)
    assert took < 10, f"SIGTERM took {took:.1f} s"
    assert answers == [503]


def _healthy(client) -> bool:
    try:
        client.health()
        return True
    except Exception:
        return False

"""The learner's stop signal: finish the step, checkpoint, exit; the same stop delivered twice (SLURM's
signal to every process of a step plus the wrapper's forward, Ctrl-C to a process group) must not abandon
the step, while a deliberate second signal later still does."""

import os
import signal
import time

import pytest

from learner.process import Stop


@pytest.fixture
def handlers():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def _send(sig):
    os.kill(os.getpid(), sig)
    time.sleep(0.01)  # Python runs the handler between bytecodes, here at the latest


def test_the_same_stop_twice_is_one_stop_and_a_later_signal_abandons_the_step(handlers, capsys):
    now = [100.0]
    stop = Stop(clock=lambda: now[0])
    assert not stop.requested
    _send(signal.SIGTERM)
    assert stop.requested and "SIGTERM: finishing this step" in capsys.readouterr().out
    now[0] += 1.5
    _send(signal.SIGINT)  # 1.5 s later: the same stop, arriving by a second path
    _send(signal.SIGTERM)
    assert stop.requested
    now[0] += 1.0  # 2.5 s after the first
    with pytest.raises(KeyboardInterrupt, match="SIGTERM while stopping"):
        _send(signal.SIGTERM)


def _catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler installed for `sig` (SigCgt in /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(caught >> (sig - 1) & 1)


def test_a_sigterm_during_the_heavy_imports_is_a_clean_stop(tmp_path):
    """The handler is installed before torch, transformers and DeepSpeed are imported (seconds): a stop
    that lands then ends the learner with 0 before it does anything, not with -15 (a failed exit for
    Compose and SLURM). The signal is sent as soon as the handler is seen, well inside the imports."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.helpers import REPO, proc_env

    cmd = [sys.executable, "-m", "learner", "--config", "deploy/configs/cpu.toml"]
    cmd += ["--learner.server_urls=http://127.0.0.1:1", f"--learner.out_dir={tmp_path / 'run'}"]
    p = subprocess.Popen(cmd, cwd=REPO, env=proc_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not _catches(p.pid, signal.SIGTERM):
        assert p.poll() is None and time.monotonic() < deadline, "the learner never installed its handler"
        time.sleep(0.005)
    imported = Path(f"/proc/{p.pid}/maps").read_text()
    p.send_signal(signal.SIGTERM)
    try:
        assert "libtorch" not in imported  # the handler came first
        out = p.communicate(timeout=120)[0].decode()
    finally:
        p.kill()
    assert p.returncode == 0, out
    assert "stopped before the run began: nothing to save" in out
    assert not (tmp_path / "run" / "checkpoints").exists()

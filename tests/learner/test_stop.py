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

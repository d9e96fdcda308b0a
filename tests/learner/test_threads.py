"""learner.threads: the learner computes on the last N cores it may use (a server on the same machine
takes the first ones with server.vllm.cpu_threads)."""

import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

SHOW = """
import os, torch
from learner.process import pin_threads
pin_threads({n}, print)
print(sorted(os.sched_getaffinity(0)), torch.get_num_threads())
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pick from")
def test_the_learner_takes_the_last_cores_and_as_many_threads():
    cores = sorted(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", SHOW.format(n=1)], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == f"[{cores[-1]}] 1"
    assert f"cores {cores[-1]} (learner.threads)" in out.stdout
    out = subprocess.run(
        [sys.executable, "-c", SHOW.format(n=None)], capture_output=True, text=True, cwd=REPO
    )
    assert out.stdout.splitlines()[-1].startswith(str(cores))  # unset: left as it was

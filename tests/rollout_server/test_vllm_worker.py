"""The worker's idle busy-poll (rollout_server/engines/vllm.py), on vLLM's own shared-memory queue condition:
bounded, a reader still returns at once while messages come often, and blocks on its socket soon after the
last one instead of spinning a core for vLLM's second."""

from __future__ import annotations

import asyncio
import time

import pytest

from rollout_server.engines.vllm import shorten_idle_spin

shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")
zmq = pytest.importorskip("zmq")


@pytest.fixture
def reader(monkeypatch, tmp_path):
    # the bound patches vLLM's class for the process: put the original back after the test
    monkeypatch.setattr(shm_broadcast.SpinCondition, "wait", shm_broadcast.SpinCondition.wait)
    context = zmq.Context()
    address = f"ipc://{tmp_path / 'notify'}"
    writer = shm_broadcast.SpinCondition(is_reader=False, context=context, notify_address=address)
    reader = shm_broadcast.SpinCondition(is_reader=True, context=context, notify_address=address)
    yield reader
    for s in (reader.local_notify_socket, reader.read_cancel_socket, reader.write_cancel_socket):
        s.close(linger=0)
    writer.local_notify_socket.close(linger=0)
    context.term()


def seconds_in_wait(reader, since_read_s: float, timeout_ms: int = 400) -> float:
    """How long reader.wait blocks `since_read_s` after a read, with nothing written meanwhile."""
    reader.record_read()
    time.sleep(since_read_s)
    t0 = time.monotonic()
    reader.wait(timeout_ms=timeout_ms)
    return time.monotonic() - t0


def test_vllms_reader_spins_for_a_second_after_a_read(reader):
    """The behaviour being bounded: 0.2 s after a read, wait() yields and returns (the caller spins)."""
    assert reader.busy_loop_s == 1
    assert seconds_in_wait(reader, 0.2) < 0.1


def test_bounded_reader_blocks_soon_after_its_last_read_and_spins_while_reads_are_frequent(reader):
    assert shorten_idle_spin(0.05)
    assert seconds_in_wait(reader, 0.2) >= 0.35  # blocked on its socket, until the 400 ms timeout
    assert reader.busy_loop_s == 0.05
    assert seconds_in_wait(reader, 0.0) < 0.1  # just read: still spinning, no added latency
    assert shorten_idle_spin(0.05)  # applied twice: one bound, not a wrapper around a wrapper
    assert not hasattr(shm_broadcast.SpinCondition.wait.tandem_unbounded, "tandem_unbounded")


class _Engine:
    """AsyncLLM's part that create() uses after building it."""

    def __init__(self):
        self.rpcs = []

    async def collective_rpc(self, method, args=()):
        self.rpcs.append((method, args))
        return [True]

    def get_tokenizer(self):
        return None


@pytest.fixture(autouse=True)
def compile_switch(monkeypatch) -> list[bool]:
    """Records create()'s calls of no_torch_compile instead of switching compilation off in the test's
    process (and, through the environment, in every process the suite starts after it)."""
    from rollout_server.engines import vllm as vllm_engine

    calls = []
    monkeypatch.setattr(vllm_engine, "no_torch_compile", lambda: calls.append(True))
    return calls


@pytest.fixture
def fake_start(monkeypatch) -> None:
    """VllmBackend.create() without an engine: its engine arguments come back as a dict, the engine it
    starts is an _Engine, and the variables create() sets for the engine's processes are restored after
    the test (they would otherwise hold for the rest of the session)."""
    from vllm.engine import arg_utils

    from rollout_server.engines import vllm as vllm_engine

    monkeypatch.setattr(arg_utils, "AsyncEngineArgs", lambda **kw: kw)
    monkeypatch.setattr(vllm_engine, "start_engine", lambda a, fork: _Engine())
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")


@pytest.mark.parametrize("block_size", [32, None])
def test_the_engine_gets_the_extension_the_block_size_and_its_idle_poll_bounded(
    monkeypatch, fake_start, block_size
):
    import os

    from rollout_server.engines import vllm as vllm_engine
    from rollout_server.engines.vllm import IDLE_SPIN_S, VllmBackend
    from shared.config import load_config
    from tests.helpers import REPO

    cfg = load_config(REPO / "deploy/configs/cpu.toml")
    assert cfg.server.vllm.block_size == 32  # the CPU recipe's (its prompts are shorter than vLLM's 128)
    cfg.server.vllm.block_size = block_size
    for in_engine, fork_engine in ((True, True), (True, False), (False, True)):
        args, engine = {}, _Engine()
        made = lambda a, fork, args=args, engine=engine: args.update(a, fork=fork) or engine  # noqa: E731
        monkeypatch.setattr(vllm_engine, "start_engine", made)
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        cfg.server.vllm.worker_in_engine_process = in_engine
        asyncio.run(VllmBackend.create(cfg, "/models/m", fork_engine=fork_engine))
        # forked from the server's process only when the worker runs in the engine's and the caller has
        # computed nothing (a fork after torch's thread pool started hangs)
        assert args.pop("fork") == (in_engine and fork_engine)
        assert args.get("block_size") == block_size  # unset: not passed, vLLM chooses
        assert args["worker_extension_cls"] == "rollout_server.engines.vllm.TandemWorker"
        spin = ("tandem_idle_spin", (IDLE_SPIN_S,))
        if in_engine:  # the worker in the engine core's process: vLLM's one-process executor
            assert args["distributed_executor_backend"] == "uni"
            assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # read by the engine process
            assert engine.rpcs == [spin]  # the engine core's stop signals left as they are
        else:  # a worker process of its own, which leaves stop signals to the engine core
            assert "distributed_executor_backend" not in args
            assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
            assert engine.rpcs == [spin, ("tandem_ignore_stop_signals", ())]


@pytest.mark.parametrize("theirs", [None, "256"])
def test_on_cpu_the_engine_keeps_few_compiled_kernels_unless_told_otherwise(monkeypatch, fake_start, theirs):
    """oneDNN's default cache (1,024 kernels) grew the worker with every version of a training run: the
    engine's processes inherit a small bound, and a value the user set wins."""
    import os

    from rollout_server.engines.vllm import ONEDNN_CACHE_CAPACITY, VllmBackend
    from shared.config import load_config
    from tests.helpers import REPO

    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", theirs or "")  # restored after the test
    if theirs is None:
        monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    asyncio.run(VllmBackend.create(load_config(REPO / "deploy/configs/cpu.toml"), "/models/m"))
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == (theirs or str(ONEDNN_CACHE_CAPACITY))
    assert ONEDNN_CACHE_CAPACITY <= 64


@pytest.mark.parametrize("eager", [True, False])
def test_an_eager_engine_on_cpu_compiles_nothing(fake_start, compile_switch, eager):
    """server.vllm.enforce_eager on CPU also switches off the few functions vLLM compiles in eager mode
    (~18 s of a first generation with a cold compile cache); without it vLLM compiles as it chooses."""
    from rollout_server.engines.vllm import VllmBackend
    from shared.config import load_config
    from tests.helpers import REPO

    cfg = load_config(REPO / "deploy/configs/cpu.toml")
    cfg.server.vllm.enforce_eager = eager
    asyncio.run(VllmBackend.create(cfg, "/models/m"))
    assert compile_switch == ([True] if eager else [])


def test_no_torch_compile_runs_compiled_functions_as_written_here_and_in_child_processes():
    """After no_torch_compile(), a torch.compile'd function runs without reaching its compiler, in the
    process and in a Python started from it (a spawned engine process reads the environment)."""
    import subprocess
    import sys

    from tests.helpers import REPO

    compiles = "torch.compile(lambda x: x * 2, backend=lambda gm, ex: print('compiled') or gm)(torch.ones(3))"
    script = (
        "import subprocess, sys, torch\n"
        "from rollout_server.engines.vllm import no_torch_compile\n"
        f"{compiles}\n"
        "no_torch_compile()\n"
        f"{compiles}\n"
        "print('child')\n"
        f"subprocess.run([sys.executable, '-c', {'import torch; ' + compiles!r}])\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=99)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["compiled", "child"]


def test_a_worker_outlives_a_stop_signal_meant_for_the_whole_process_group():
    """SIGTERM and SIGINT sent to every process (scancel, Ctrl-C) leave the worker to its engine core: the
    process that made itself a worker survives both; one that did not dies of the first."""
    import subprocess
    import sys

    from tests.helpers import REPO

    def survives(shielded: bool) -> bool:
        code = (
            "import os, signal, time\n"
            "from rollout_server.engines.vllm import leave_stop_signals_to_the_engine as shield\n"
            f"assert {shielded} is False or shield()\n"
            "os.kill(os.getpid(), signal.SIGINT); os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.2)\n"
            "print('alive')\n"
        )
        run = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        alive = run.stdout.strip() == "alive"
        assert (run.returncode == 0) == alive, run.stderr
        return alive

    assert survives(True)
    assert not survives(False)

"""Start and stop tandem's own processes (rollout server, learner) from scripts and tests: the one harness.
Each process runs in its own process group with its output in a log file, so stopping it also stops its
children (vLLM's engine core, DeepSpeed ranks). Imports nothing heavy."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from shared.config import TOKEN_ENV

REPO = Path(__file__).resolve().parents[1]


def tandem_env(token: str | None = None, **extra: str) -> dict[str, str]:
    """The environment tandem's processes run in: unbuffered output, one bounded KV cache on CPU."""
    env = dict(os.environ)
    env.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if token is not None:
        env[TOKEN_ENV] = token
    env.update(extra)
    return env


class Proc:
    """`python <args>` in its own process group, output appended to `log`."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None):
        self.log_path = log
        self._log = log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, *args],
            cwd=REPO,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env or tandem_env(),
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (a clean shutdown), SIGKILL after `timeout`; then whatever is left of the group."""
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()


def wait_healthy(proc: Proc, url: str, timeout: float = 600.0) -> None:
    """Poll GET {url}/health until it answers 200; fail with the log's tail if the process exits first
    or the time runs out (the process is stopped then)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.log_path.name}: exited with {proc.returncode}:\n{proc.log()[-4000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=5.0).status_code == 200:
                return
        time.sleep(0.2)
    proc.stop()
    raise RuntimeError(f"{proc.log_path.name}: not healthy after {timeout:.0f} s:\n{proc.log()[-4000:]}")


def start_server(
    config: str, overrides: list[str], port: int, log: Path, env: dict[str, str], timeout: float = 600.0
) -> tuple[Proc, str]:
    """`python -m rollout_server --config <config> --server.port=<port> <overrides>`, healthy; returns it
    and its URL."""
    proc = Proc(["-m", "rollout_server", "--config", config, f"--server.port={port}", *overrides], log, env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, timeout)
    return proc, url


def pull_until_version(client, version: int, max_groups: int = 2, wait_s: float = 120.0) -> None:
    """Pull and ack groups from a rollout server (a learner.client.RolloutClient) until one of `version`
    or later arrives: the first group under a version just published (benchmarks)."""
    while True:
        pulled = client.pull(max_groups, wait_s=wait_s)
        if pulled.lease_id:
            client.ack(pulled.lease_id)
        if any(g.policy_version >= version for g in pulled.groups):
            return


def vllm_openai_args(
    model: str, port: int, *, max_lora_rank: int, max_model_len: int, dtype: str
) -> list[str]:
    """A stock vLLM OpenAI-compatible server as `server.backend = "openai"` needs one (rollout_server/
    engines/external.py): LoRA loaded at run time, the token route, sampling logprobs after temperature. Run
    it with vllm_openai_env()."""
    return [
        "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
        "--host", "127.0.0.1", "--dtype", dtype, "--max-model-len", str(max_model_len),
        "--enable-lora", "--max-lora-rank", str(max_lora_rank), "--max-loras", "2", "--max-cpu-loras", "4",
        "--enable-scale-out", "--logprobs-mode", "processed_logprobs", "--seed", "0",
        "--block-size", "32", "--enforce-eager", "--disable-log-stats",
    ]  # fmt: skip


def vllm_openai_env(cores: str | None = None, **extra: str) -> dict[str, str]:
    """Its environment: runtime LoRA updates allowed, nothing compiled (as `--enforce-eager` on tandem's
    own engine: vLLM's sampler functions compile at the first request otherwise, ~18 s with a cold compile
    cache); `cores` ('0', '0,1'): the CPU cores it computes on (vLLM's default keeps one of them for its
    scheduler)."""
    env = tandem_env(VLLM_ALLOW_RUNTIME_LORA_UPDATING="True", TORCH_COMPILE_DISABLE="1", **extra)
    if cores is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cores
    return env

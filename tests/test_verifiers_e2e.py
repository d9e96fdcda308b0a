"""A `verifiers` environment end to end (env.kind = "verifiers"): a taskset of two-turn episodes
(examples/two_turn_sums.py: its tasks, its rewards, its env's control flow: the model answers, the
environment asks a follow-up, the model answers again) written into a temporary folder under a name of the
test's own, played by the library's own `null` harness on its `subprocess` runtime through its own training
client, against the real rollout server (vLLM, SmolLM2) and the real DeepSpeed learner, two steps. Every
trained episode has two model turns; every model token, re-scored on the version stamped on its group,
gives back its sampler log-prob; the rubric's values reach metrics.jsonl under their names; no group was
dropped (none split into branches by a re-render, none failing the check against the engine's records).
Then learner.evaluate plays held-out tasks through the library's evaluation client against the server's
OpenAI API."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.helpers import SMALL_LEARNER, TOKEN, proc_env, rescore, start_learner, start_server

pytestmark = pytest.mark.slow
pytest.importorskip("verifiers")
REPO = Path(__file__).resolve().parents[1]


COMMON = [
    "--sampling.temperature=1.0",  # sampler log-probs are then the policy's own, comparable with /v1/score
    "--sampling.max_new_tokens=16",
    "--sampling.group_size=4",
    "--server.prompts_per_batch=2",
    "--server.queue_size=4",
    "--env.kind=verifiers",
    '--env.verifiers={"taskset": {"id": "my_sums"}}',
    "--env.verifiers_eval=8",
]


def test_two_steps_on_a_verifiers_environment_of_two_turns(tmp_path, model_dir):
    (tmp_path / "my_sums.py").write_text((REPO / "examples" / "two_turn_sums.py").read_text())
    env = proc_env(PYTHONPATH=str(tmp_path))
    server, client = start_server(tmp_path, COMMON, env=env)
    out = tmp_path / "run"
    learner = start_learner(
        client.url, out, tmp_path / "learner.log", [*COMMON, *SMALL_LEARNER, "--learner.steps=2"],
        PYTHONPATH=str(tmp_path),
    )  # fmt: skip
    try:
        assert learner.wait(timeout=900) == 0, learner.log()[-5000:]
        steps = [json.loads(line) for line in (out / "groups.jsonl").read_text().splitlines()]
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        rescored = rescore(client, steps)
        text = httpx.get(f"{client.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
        cmd = [
            sys.executable,
            "-m",
            "learner.evaluate",
            "--config",
            "deploy/configs/cpu.toml",
            *COMMON,
            f"--learner.server_urls={client.url}",
            "--limit=4",
            f"--out={tmp_path / 'eval.json'}",
        ]
        evaluated = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    finally:
        client.close()
        server.stop()
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:  # the rubric's values, by name
        assert 0 <= m["reward/correct/mean"] <= 1 and 0 <= m["reward/first_right/mean"] <= 1
    # No group dropped: the bridge renderer (env.renderer's default) keeps each sampled reply as sampled, so
    # the library never splits an episode into branches, and every span passes the records' check.
    invalid = re.search(r"^tandem_groups_invalid_total (\S+)$", text, re.M)
    dropped = re.findall(r"group of \S+ dropped: (.*)", (tmp_path / "server.log").read_text())
    assert invalid and float(invalid[1]) == 0 and dropped == [], dropped
    assert len(rescored) == 2 * 2 * 4  # 2 steps x 2 prompts x G = 4
    for c, lps in rescored:
        ids, mask = c["token_ids"], c["mask"]
        turns = sum(1 for t in range(len(mask)) if mask[t] == 1 and (t == 0 or mask[t - 1] == 0))
        assert turns == 2, f"{turns} model turns in an episode of two: {mask}"
        assert c["rewards"].keys() == {"correct", "first_right"}
        assert c["reward"] == pytest.approx(c["rewards"]["correct"] + 0.5 * c["rewards"]["first_right"])
        assert len(lps) == len(c["logprobs"]) == sum(mask) and len(ids) == len(mask)
        mean = sum(abs(a - b) for a, b in zip(lps, c["logprobs"], strict=True)) / len(lps)
        assert mean < 2e-3, mean
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["version"] == 2 and result["problems"] == 4 and result["failed"] == 0
    assert result["rewards"].keys() == {"correct", "first_right"}
    expected = result["rewards"]["correct"] + 0.5 * result["rewards"]["first_right"]
    assert result["reward_greedy"] == pytest.approx(expected)

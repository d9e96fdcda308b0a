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
        client.pause_production()  # trained: what follows has the engine to itself
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


TOOL_TASKSET = [
    "--sampling.temperature=1.0",
    "--sampling.max_new_tokens=48",  # a call to multiply is 34 tokens
    "--sampling.group_size=8",
    "--server.prompts_per_batch=1",
    "--server.queue_size=2",
    "--env.kind=verifiers",
    '--env.verifiers={"taskset": {"id": "my_calculator"}}',
    "--env.verifiers_limit=200",
    "--env.verifiers_eval=8",
]
# (a reply cut at the token limit right after its call gets the close the template writes: <|im_end|>)
TOOL_TURN = re.compile(
    r"^(?:<\|im_end\|>)?\n<\|im_start\|>tool\n(.*)<\|im_end\|>\n<\|im_start\|>assistant\n$", re.S
)
CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def test_a_verifiers_taskset_with_a_function_tool_plays_its_tool_server_s_results(tmp_path, model_dir):
    """examples/verifiers_calculator.py under a name of the test's own: the library's `Toolset` (an MCP
    server its subprocess runtime starts for each episode) gives the null harness a `multiply` tool;
    SmolLM2's template has no place for tools, so the bridge renderer describes it and reads the model's
    <tool_call> text back as the library's calls. Groups are pulled until one holds an episode with a tool
    turn (at most 12 groups: about 1 episode in 6 makes a call that parses, so 96 without one would be a
    chance of ~1e-7). Each tool turn is masked out, holds what the tool server answered for the call the
    model wrote (the product, or the library's error for another name), and every model token re-scores to
    its sampler log-prob. Then learner.evaluate plays two held-out tasks through the library's evaluation
    client, which offers the tool through the server's OpenAI API (chat completions with `tools`)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    for name, source in (("my_calculator.py", "verifiers_calculator.py"), ("calculator.py", "calculator.py")):
        (tmp_path / name).write_text((REPO / "examples" / source).read_text())
    env = proc_env(PYTHONPATH=str(tmp_path))
    server, client = start_server(tmp_path, TOOL_TASKSET, env=env)
    groups, tool_turns = [], []
    cmd = [
        sys.executable, "-m", "learner.evaluate", "--config", "deploy/configs/cpu.toml", *TOOL_TASKSET,
        f"--learner.server_urls={client.url}", "--limit=2", f"--out={tmp_path / 'eval.json'}",
    ]  # fmt: skip
    # the evaluation runs while the groups are pulled: after the last pull the server would only be
    # producing groups nobody takes, which an evaluation run afterwards waited behind (~1 min)
    with open(tmp_path / "eval.log", "w+") as log:
        evaluating = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        while not tool_turns and len(groups) < 12:
            pulled = client.pull(2, wait_s=240)
            assert pulled.groups, "no group within 240 s"
            client.ack(pulled.lease_id)
            for g in pulled.groups:
                groups.append(g)
                for c in g.completions:
                    ids, mask = c.token_ids, c.mask or [1] * len(c.token_ids)  # none: all the model's
                    spans, i = [], 0
                    while i < len(mask):  # each run of the harness's tokens, after the model's call
                        if mask[i] == 0:
                            j = i
                            while j < len(mask) and mask[j] == 0:
                                j += 1
                            spans.append((tok.decode(ids[:i]), tok.decode(ids[i:j])))
                            i = j
                        else:
                            i += 1
                    tool_turns += [(g, c, before, turn) for before, turn in spans]
        rescored = {
            id(c): client.score(g.prompt_token_ids, c.token_ids, version=g.policy_version).logprobs
            for g, c, _, _ in tool_turns
        }
        text = httpx.get(f"{client.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
        evaluating.wait(timeout=600)
    finally:
        if evaluating.poll() is None:
            evaluating.kill()
            evaluating.wait()
        client.close()
        server.stop()
    # evaluation: the library's evaluation client offers the tool through the server's OpenAI API
    assert evaluating.returncode == 0, (tmp_path / "eval.log").read_text()[-3000:]
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["problems"] == 2 and result["failed"] == 0 and result["rewards"].keys() == {"solved"}
    assert tool_turns, f"no episode with a tool turn in {len(groups)} groups"
    print(f"{len(tool_turns)} tool turns in {len(groups)} groups")
    for _, c, before, turn in tool_turns:
        result = TOOL_TURN.match(turn)
        assert result, repr(turn)
        call = json.loads(CALL.findall(before)[-1])  # the model's last call before the turn
        args = call.get("arguments", {})
        if (
            call["name"] == "multiply"
            and set(args) == {"a", "b"}
            and all(isinstance(v, int) for v in args.values())
        ):
            assert result[1] == str(args["a"] * args["b"]), (call, result[1])
        else:
            assert "error" in result[1].lower(), (call, result[1])
        assert c.rewards.keys() == {"solved"}
        lps = [lp for lp, m in zip(rescored[id(c)], c.mask, strict=True) if m]  # (a tool turn: a mask)
        assert len(lps) == len(c.logprobs)
        assert sum(abs(a - b) for a, b in zip(lps, c.logprobs, strict=True)) / len(lps) < 2e-3
    invalid = re.search(r"^tandem_groups_invalid_total (\S+)$", text, re.M)
    assert invalid and float(invalid[1]) == 0

